"""A tiny random-weight Llama with a locally trained tokenizer: the `demo` model source.

It lets a fresh machine with no network run the whole system end to end. The weights
are random, so the text it generates is meaningless; only its shapes, speed and
plumbing are real. Everything is derived from fixed seeds: two creations write
byte-identical files.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

# The model: ~4M parameters, grouped-query attention (8 query heads over 2 kv heads).
DEMO_NUM_LAYERS = 4
DEMO_HIDDEN_SIZE = 256
DEMO_INTERMEDIATE_SIZE = 768
DEMO_NUM_HEADS = 8
DEMO_NUM_KV_HEADS = 2
DEMO_MAX_POSITIONS = 4096
DEMO_VOCAB_SIZE = 2048
# Larger than usual init scale so next-token distributions are peaked, not uniform.
_WEIGHT_STD = 0.08
_SEED = 1234

# Special tokens take the first ids, in this order.
SPECIAL_TOKENS = ["<pad>", "<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>"]
PAD_ID, BOS_ID, EOS_ID = 0, 1, 2

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}</s>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

_ONSETS = [
    "",
    "b",
    "d",
    "f",
    "g",
    "k",
    "l",
    "m",
    "n",
    "p",
    "r",
    "s",
    "t",
    "v",
    "z",
    "st",
    "tr",
    "gr",
]
_VOWELS = ["a", "e", "i", "o", "u", "ai", "ou", "ea"]
_CODAS = ["", "", "n", "r", "s", "l", "m", "th", "nd"]


def corpus(num_sentences: int = 4000, seed: int = _SEED) -> list[str]:
    """Pseudo-English sentences from a seeded generator: invented words, punctuation, digits."""
    rng = random.Random(seed)
    syllables = [o + v + c for o in _ONSETS for v in _VOWELS for c in _CODAS]
    words = ["".join(rng.choices(syllables, k=rng.randint(1, 3))) for _ in range(1500)]
    sentences = []
    for _ in range(num_sentences):
        chosen = rng.choices(words, k=rng.randint(4, 14))
        if rng.random() < 0.2:
            chosen.insert(rng.randrange(len(chosen)), str(rng.randint(0, 9999)))
        text = " ".join(chosen)
        sentences.append(text[0].upper() + text[1:] + rng.choice([".", ".", "?", "!", ","]))
    return sentences


def _train_tokenizer() -> Any:
    """Byte-level BPE trained on the generated corpus (any text encodes, via bytes)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=DEMO_VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus(), trainer=trainer)
    # Every encoded prompt starts with <s>, as Llama's tokenizers do.
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", BOS_ID)]
    )
    return tokenizer


def _model_config(vocab_size: int) -> dict[str, Any]:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_act": "silu",
        "hidden_size": DEMO_HIDDEN_SIZE,
        "intermediate_size": DEMO_INTERMEDIATE_SIZE,
        "num_hidden_layers": DEMO_NUM_LAYERS,
        "num_attention_heads": DEMO_NUM_HEADS,
        "num_key_value_heads": DEMO_NUM_KV_HEADS,
        "head_dim": DEMO_HIDDEN_SIZE // DEMO_NUM_HEADS,
        "vocab_size": vocab_size,
        "max_position_embeddings": DEMO_MAX_POSITIONS,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
        "pad_token_id": PAD_ID,
        "torch_dtype": "float32",
    }


def _weight_shapes(vocab_size: int) -> dict[str, tuple[int, ...]]:
    """HF Llama tensor names and shapes, in a fixed order (the draw order of the RNG)."""
    hidden, inter = DEMO_HIDDEN_SIZE, DEMO_INTERMEDIATE_SIZE
    head_size = hidden // DEMO_NUM_HEADS
    kv_size = DEMO_NUM_KV_HEADS * head_size
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab_size, hidden)}
    for i in range(DEMO_NUM_LAYERS):
        p = f"model.layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (hidden,),
            p + "self_attn.q_proj.weight": (hidden, hidden),
            p + "self_attn.k_proj.weight": (kv_size, hidden),
            p + "self_attn.v_proj.weight": (kv_size, hidden),
            p + "self_attn.o_proj.weight": (hidden, hidden),
            p + "post_attention_layernorm.weight": (hidden,),
            p + "mlp.gate_proj.weight": (inter, hidden),
            p + "mlp.up_proj.weight": (inter, hidden),
            p + "mlp.down_proj.weight": (hidden, inter),
        }
    shapes["model.norm.weight"] = (hidden,)
    shapes["lm_head.weight"] = (vocab_size, hidden)
    return shapes


def _random_weights(vocab_size: int) -> dict[str, Any]:
    import torch

    gen = torch.Generator().manual_seed(_SEED)
    weights = {}
    for name, shape in _weight_shapes(vocab_size).items():
        if name.endswith("norm.weight"):
            weights[name] = torch.ones(shape)
        else:
            weights[name] = torch.randn(shape, generator=gen) * _WEIGHT_STD
    return weights


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def create_demo_checkpoint(path: Path) -> Path:
    """Writes the demo checkpoint into directory `path` (created if needed); returns it.

    Files: config.json, generation_config.json, model.safetensors, tokenizer.json,
    tokenizer_config.json. The model is random: its output text is meaningless.
    """
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = _train_tokenizer()
    vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
    tokenizer.save(str(path / "tokenizer.json"))
    _write_json(
        path / "tokenizer_config.json",
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": "<s>",
            "eos_token": "</s>",
            "pad_token": "<pad>",
            "clean_up_tokenization_spaces": False,
            "model_max_length": DEMO_MAX_POSITIONS,
            "chat_template": CHAT_TEMPLATE,
        },
    )
    _write_json(path / "config.json", _model_config(vocab_size))
    _write_json(
        path / "generation_config.json",
        {
            "bos_token_id": BOS_ID,
            "eos_token_id": EOS_ID,
            "pad_token_id": PAD_ID,
        },
    )
    save_file(
        _random_weights(vocab_size), str(path / "model.safetensors"), metadata={"format": "pt"}
    )
    return path
