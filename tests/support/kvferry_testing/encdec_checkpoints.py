"""Small random-weight BART and Whisper checkpoints, written by transformers' own classes.

`make_bart_checkpoint(path)` and `make_whisper_checkpoint(path)` write a directory that
both kvferry and transformers load: config.json, generation_config.json,
model.safetensors (from `save_pretrained`, so tied tensors are stored once, as HF
stores them), and a byte-level BPE tokenizer trained here on generated text
(tokenizer.json, tokenizer_config.json; `PreTrainedTokenizerFast`, so `AutoTokenizer`
loads it). Whisper's also gets preprocessor_config.json for `WhisperFeatureExtractor`,
sized so that its frames are exactly `2 * max_source_positions`. Everything comes from
the seed: two builds with the same arguments write the same tensors. Nothing is
downloaded.

Generation settings are plain so that an HF greedy `generate` is comparable with the
engine's: BART forces no token; Whisper's generation config has no `suppress_tokens`,
`begin_suppress_tokens` or `forced_decoder_ids`.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

# Random weights at this scale give peaked next-token distributions, so argmax ties
# against float32 noise do not occur. Query and key projections get larger weights: the
# sharper attention lets each step's token steer the next one, where with uniform weights
# a random decoder (BART's above all) settles on one token that it repeats.
INIT_STD = 0.15
QK_STD = 0.3
# Biases are the same at every step; larger ones pull every step towards the same tokens.
BIAS_STD = 0.05

# BART's special tokens, at the ids BART's tokenizer gives them; <mask> is the last id.
BART_BOS_ID, BART_PAD_ID, BART_EOS_ID, BART_UNK_ID = 0, 1, 2, 3
BART_SPECIAL_TOKENS = ["<s>", "<pad>", "</s>", "<unk>"]
BART_MASK_TOKEN = "<mask>"

# Whisper's special tokens, in Whisper's order, right after the BPE vocabulary.
WHISPER_EOT = "<|endoftext|>"
WHISPER_SOT = "<|startoftranscript|>"
WHISPER_LANGUAGES = ("en", "de", "fr")
WHISPER_TASKS = ("translate", "transcribe")
WHISPER_NO_TIMESTAMPS = "<|notimestamps|>"
WHISPER_SPECIAL_TOKENS = [
    WHISPER_EOT,
    WHISPER_SOT,
    *(f"<|{lang}|>" for lang in WHISPER_LANGUAGES),
    *(f"<|{task}|>" for task in WHISPER_TASKS),
    "<|startoflm|>",
    "<|startofprev|>",
    "<|nocaptions|>",
    WHISPER_NO_TIMESTAMPS,
]
# The feature extractor's defaults: 16 kHz audio, one frame per 160 samples.
WHISPER_SAMPLING_RATE = 16000
WHISPER_HOP_LENGTH = 160


def _corpus(seed: int, num_sentences: int = 3000) -> list[str]:
    """Pseudo-English sentences of invented words, from a seeded generator."""
    rng = random.Random(seed)
    syllables = [c + v for c in "bdfgklmnprstvz" for v in ("a", "e", "i", "o", "u", "ou")]
    words = ["".join(rng.choices(syllables, k=rng.randint(1, 3))) for _ in range(800)]
    sentences = []
    for _ in range(num_sentences):
        text = " ".join(rng.choices(words, k=rng.randint(3, 12)))
        sentences.append(text[0].upper() + text[1:] + rng.choice([".", "?", "!", ","]))
    return sentences


def _train_bpe(vocab_size: int, special_tokens: list[str], seed: int) -> Any:
    """A byte-level BPE of exactly `vocab_size` tokens, `special_tokens` first."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=special_tokens,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_corpus(seed), trainer=trainer)
    if tokenizer.get_vocab_size() != vocab_size:
        raise ValueError(
            f"the training corpus yields {tokenizer.get_vocab_size()} tokens, not {vocab_size}"
        )
    return tokenizer


def _save_tokenizer(path: Path, tokenizer: Any, **special: Any) -> None:
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, **special)
    fast.save_pretrained(str(path))
    # Name the class outright, so AutoTokenizer does not pick the model type's own one.
    config_path = path / "tokenizer_config.json"
    config = json.loads(config_path.read_text(encoding="utf-8"))
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    _write_json(config_path, config)


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def _randomize(model: torch.nn.Module, seed: int) -> None:
    """Redraws the query and key projections (QK_STD); layer norms start at (1, 0) and
    biases at 0, so randomize them (and BART's final_logits_bias) so that loading each is
    tested."""
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                param.copy_(QK_STD * torch.randn(param.shape, generator=gen))
            elif "norm" in name and name.endswith(".weight"):
                param.copy_(1.0 + 0.2 * torch.randn(param.shape, generator=gen))
            elif name.endswith(".bias"):
                param.copy_(BIAS_STD * torch.randn(param.shape, generator=gen))
        bias = getattr(model, "final_logits_bias", None)
        if bias is not None:
            bias.copy_(2 * BIAS_STD * torch.randn(bias.shape, generator=gen))


def _save_model(path: Path, model: torch.nn.Module, seed: int, dtype: str) -> None:
    _randomize(model, seed)
    model.to(getattr(torch, dtype)).save_pretrained(str(path), safe_serialization=True)


def make_bart_checkpoint(
    path: Path,
    seed: int = 0,
    *,
    d_model: int = 64,
    encoder_layers: int = 2,
    decoder_layers: int = 2,
    encoder_attention_heads: int = 4,
    decoder_attention_heads: int = 4,
    encoder_ffn_dim: int = 128,
    decoder_ffn_dim: int = 96,
    vocab_size: int = 512,
    max_position_embeddings: int = 128,
    scale_embedding: bool = False,
    tie_word_embeddings: bool = True,
    activation_function: str = "gelu",
    dtype: str = "float32",
) -> Path:
    """Writes a random BART checkpoint into `path` (created if needed); returns it.

    Token ids: <s> 0, <pad> 1, </s> 2, <unk> 3, <mask> the last; the tokenizer wraps
    a text in <s> ... </s> as BART's does, and the decoder starts with </s> (2), so the
    default decoder prompt is [2, 0].
    """
    from tokenizers import processors
    from transformers import BartConfig, BartForConditionalGeneration

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = _train_bpe(vocab_size - 1, BART_SPECIAL_TOKENS, seed)
    tokenizer.add_special_tokens([BART_MASK_TOKEN])
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A </s>",
        pair="<s> $A </s> </s> $B </s>",
        special_tokens=[("<s>", BART_BOS_ID), ("</s>", BART_EOS_ID)],
    )
    _save_tokenizer(
        path, tokenizer, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
        unk_token="<unk>", mask_token=BART_MASK_TOKEN,
    )
    config = BartConfig(
        architectures=["BartForConditionalGeneration"],
        vocab_size=vocab_size,
        d_model=d_model,
        encoder_layers=encoder_layers,
        decoder_layers=decoder_layers,
        encoder_attention_heads=encoder_attention_heads,
        decoder_attention_heads=decoder_attention_heads,
        encoder_ffn_dim=encoder_ffn_dim,
        decoder_ffn_dim=decoder_ffn_dim,
        max_position_embeddings=max_position_embeddings,
        scale_embedding=scale_embedding,
        tie_word_embeddings=tie_word_embeddings,
        activation_function=activation_function,
        init_std=INIT_STD,
        dropout=0.0,
        bos_token_id=BART_BOS_ID,
        pad_token_id=BART_PAD_ID,
        eos_token_id=BART_EOS_ID,
        decoder_start_token_id=BART_EOS_ID,
        forced_eos_token_id=None,
    )
    torch.manual_seed(seed)
    _save_model(path, BartForConditionalGeneration(config), seed, dtype)
    _write_json(
        path / "generation_config.json",
        {
            "bos_token_id": BART_BOS_ID,
            "decoder_start_token_id": BART_EOS_ID,
            "eos_token_id": BART_EOS_ID,
            "pad_token_id": BART_PAD_ID,
        },
    )
    return path


def make_whisper_checkpoint(
    path: Path,
    seed: int = 0,
    *,
    d_model: int = 64,
    encoder_layers: int = 2,
    decoder_layers: int = 2,
    encoder_attention_heads: int = 4,
    decoder_attention_heads: int = 4,
    encoder_ffn_dim: int = 128,
    decoder_ffn_dim: int = 96,
    vocab_size: int = 512,
    num_mel_bins: int = 16,
    max_source_positions: int = 100,
    max_target_positions: int = 64,
    tie_word_embeddings: bool = True,
    activation_function: str = "gelu",
    dtype: str = "float32",
) -> Path:
    """Writes a random Whisper checkpoint into `path` (created if needed); returns it.

    Its audio is `max_source_positions / 50` seconds at 16 kHz (so `max_source_positions`
    must be a multiple of 50): the feature extractor pads or cuts it to
    `2 * max_source_positions` frames. The special tokens follow the BPE vocabulary:
    <|endoftext|> (bos, eos and pad), <|startoftranscript|> (the decoder start), the
    language tokens, <|translate|>, <|transcribe|>, ..., <|notimestamps|> last.
    """
    from transformers import WhisperConfig, WhisperFeatureExtractor, WhisperForConditionalGeneration

    # frames = 2 * positions = seconds * rate / hop, so seconds = positions / 50.
    if max_source_positions % 50:
        raise ValueError(
            f"max_source_positions must be a multiple of 50, got {max_source_positions}"
        )
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = _train_bpe(vocab_size - len(WHISPER_SPECIAL_TOKENS), [], seed)
    tokenizer.add_special_tokens(WHISPER_SPECIAL_TOKENS)
    _save_tokenizer(
        path, tokenizer, bos_token=WHISPER_EOT, eos_token=WHISPER_EOT, pad_token=WHISPER_EOT,
        unk_token=WHISPER_EOT, additional_special_tokens=WHISPER_SPECIAL_TOKENS[1:],
    )
    ids = {token: tokenizer.token_to_id(token) for token in WHISPER_SPECIAL_TOKENS}
    eot, sot = ids[WHISPER_EOT], ids[WHISPER_SOT]
    config = WhisperConfig(
        architectures=["WhisperForConditionalGeneration"],
        vocab_size=vocab_size,
        num_mel_bins=num_mel_bins,
        d_model=d_model,
        encoder_layers=encoder_layers,
        decoder_layers=decoder_layers,
        encoder_attention_heads=encoder_attention_heads,
        decoder_attention_heads=decoder_attention_heads,
        encoder_ffn_dim=encoder_ffn_dim,
        decoder_ffn_dim=decoder_ffn_dim,
        max_source_positions=max_source_positions,
        max_target_positions=max_target_positions,
        tie_word_embeddings=tie_word_embeddings,
        activation_function=activation_function,
        init_std=INIT_STD,
        bos_token_id=eot,
        eos_token_id=eot,
        pad_token_id=eot,
        decoder_start_token_id=sot,
        suppress_tokens=None,
        begin_suppress_tokens=None,
    )
    torch.manual_seed(seed)
    _save_model(path, WhisperForConditionalGeneration(config), seed, dtype)
    generation = _whisper_generation_config(ids, max_target_positions)
    _write_json(path / "generation_config.json", generation)
    WhisperFeatureExtractor(
        feature_size=num_mel_bins,
        sampling_rate=WHISPER_SAMPLING_RATE,
        hop_length=WHISPER_HOP_LENGTH,
        chunk_length=max_source_positions // 50,
    ).save_pretrained(str(path))
    return path


def _whisper_generation_config(ids: dict[str, int], max_length: int) -> dict[str, Any]:
    eot = ids[WHISPER_EOT]
    return {
        "bos_token_id": eot,
        "eos_token_id": eot,
        "pad_token_id": eot,
        "decoder_start_token_id": ids[WHISPER_SOT],
        "lang_to_id": {f"<|{lang}|>": ids[f"<|{lang}|>"] for lang in WHISPER_LANGUAGES},
        "task_to_id": {task: ids[f"<|{task}|>"] for task in WHISPER_TASKS},
        "no_timestamps_token_id": ids[WHISPER_NO_TIMESTAMPS],
        "is_multilingual": True,
        "max_length": max_length,
    }


def whisper_decoder_prompt(path: Path, language: str = "en", task: str = "transcribe") -> list[int]:
    """The usual Whisper decoder prompt of checkpoint `path`:
    [<|startoftranscript|>, <|language|>, <|task|>, <|notimestamps|>]."""
    generation = json.loads((Path(path) / "generation_config.json").read_text(encoding="utf-8"))
    return [
        generation["decoder_start_token_id"],
        generation["lang_to_id"][f"<|{language}|>"],
        generation["task_to_id"][task],
        generation["no_timestamps_token_id"],
    ]


def load_hf_encdec(path: Path, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """The transformers model of a checkpoint built here, in eval mode, eager attention."""
    from transformers import BartForConditionalGeneration, WhisperForConditionalGeneration

    config = json.loads((Path(path) / "config.json").read_text(encoding="utf-8"))
    cls = {
        "BartForConditionalGeneration": BartForConditionalGeneration,
        "WhisperForConditionalGeneration": WhisperForConditionalGeneration,
    }[config["architectures"][0]]
    model = cls.from_pretrained(str(path), dtype=dtype, attn_implementation="eager")
    return model.eval()


_BUILDERS: dict[str, Callable[..., Path]] = {
    "bart": make_bart_checkpoint,
    "whisper": make_whisper_checkpoint,
}


@pytest.fixture(scope="session")
def make_encdec_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """Factory: `make_encdec_checkpoint("bart" | "whisper", seed=0, **sizes)` builds (once
    per argument tuple in a test session) a checkpoint directory and returns it."""
    built: dict[tuple[Any, ...], Path] = {}

    def make(kind: str, seed: int = 0, **sizes: Any) -> Path:
        if kind not in _BUILDERS:
            raise ValueError(f"make_encdec_checkpoint builds {', '.join(_BUILDERS)}, not {kind!r}")
        key = (kind, seed, repr(sorted(sizes.items())))
        if key not in built:
            built[key] = _BUILDERS[kind](tmp_path_factory.mktemp(f"ckpt-{kind}"), seed, **sizes)
        return built[key]

    return make
