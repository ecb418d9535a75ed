"""Small random-weight HF checkpoints built locally, and the HF model of one, as fixtures.

`make_checkpoint(...)` writes a transformers checkpoint (config, safetensors weights,
a word-level tokenizer of exactly `vocab_size` tokens) and returns its directory; each
distinct argument tuple is built once per test session. Nothing is downloaded. A conftest
that needs them imports the fixtures by name.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

# Random weights at this scale give logits that differ by far more than float32 noise,
# so greedy argmax is never a tie between HF and the engine.
_INIT_RANGE = 0.15
# Token ids of the specials every test tokenizer starts with.
UNK_ID, BOS_ID, EOS_ID = 0, 1, 2


def _hf_config(architecture: str, **fields: Any) -> Any:
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

    config_classes = {
        "LlamaForCausalLM": LlamaConfig,
        "Qwen2ForCausalLM": Qwen2Config,
        "Qwen3ForCausalLM": Qwen3Config,
    }
    if architecture not in config_classes:
        raise ValueError(f"make_checkpoint cannot build {architecture!r}")
    return config_classes[architecture](architectures=[architecture], **fields)


def _perturb_ones_and_zeros(model: torch.nn.Module, seed: int) -> None:
    """Norm weights start at 1 and biases at 0; randomize them so loading them is tested."""
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(1.0 + 0.2 * torch.randn(param.shape, generator=gen))
            elif name.endswith(".bias"):
                param.copy_(0.2 * torch.randn(param.shape, generator=gen))


def _save_word_tokenizer(path: Path, vocab_size: int) -> None:
    """A whitespace word-level tokenizer: `<unk> <s> </s> w3 ... w{vocab_size-1}`."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": UNK_ID, "<s>": BOS_ID, "</s>": EOS_ID}
    vocab.update({f"w{i}": i for i in range(3, vocab_size)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
    fast.chat_template = (
        "{% for m in messages %}{{ m['role'] }} {{ m['content'] }} {% endfor %}"
        "{% if add_generation_prompt %}assistant {% endif %}"
    )
    fast.save_pretrained(str(path))


def _build_checkpoint(
    path: Path, architecture: str, seed: int, dtype: str, sharded: bool, **fields: Any
) -> None:
    from transformers import AutoModelForCausalLM

    config = _hf_config(
        architecture,
        initializer_range=_INIT_RANGE,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        **fields,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _perturb_ones_and_zeros(model, seed)
    model = model.to(getattr(torch, dtype))
    # A tiny shard limit splits even a toy model into several files.
    shard_size = "40KB" if sharded else "10GB"
    model.save_pretrained(str(path), safe_serialization=True, max_shard_size=shard_size)
    _save_word_tokenizer(path, fields["vocab_size"])


@pytest.fixture(scope="session")
def make_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """Factory: builds (once per argument tuple) a random-weight HF checkpoint directory."""
    built: dict[tuple[Any, ...], Path] = {}

    def make(
        architecture: str = "LlamaForCausalLM",
        *,
        num_layers: int = 2,
        hidden_size: int = 64,
        num_heads: int = 4,
        num_kv_heads: int = 2,
        intermediate_size: int = 128,
        vocab_size: int = 256,
        tie_word_embeddings: bool = False,
        rope_scaling: dict[str, Any] | None = None,
        sharded: bool = False,
        max_position_embeddings: int = 1024,
        seed: int = 0,
        dtype: str = "float32",
        head_dim: int | None = None,
    ) -> Path:
        fields: dict[str, Any] = dict(
            num_hidden_layers=num_layers,
            hidden_size=hidden_size,
            num_attention_heads=num_heads,
            num_key_value_heads=num_kv_heads,
            intermediate_size=intermediate_size,
            vocab_size=vocab_size,
            tie_word_embeddings=tie_word_embeddings,
            max_position_embeddings=max_position_embeddings,
        )
        if rope_scaling is not None:
            fields["rope_scaling"] = dict(rope_scaling)
        if head_dim is not None or architecture == "Qwen3ForCausalLM":
            fields["head_dim"] = head_dim or hidden_size // num_heads
        key = (architecture, seed, dtype, sharded, repr(sorted(fields.items())))
        if key not in built:
            path = tmp_path_factory.mktemp(f"ckpt-{architecture}")
            _build_checkpoint(path, architecture, seed, dtype, sharded, **fields)
            built[key] = path
        return built[key]

    return make


@pytest.fixture(scope="session")
def hf_model() -> Callable[..., torch.nn.Module]:
    """Loader: the HF transformers model of a checkpoint in eval mode; float32 with eager
    attention unless `dtype` or `attn_implementation` say otherwise."""

    def load(
        path: Path, dtype: torch.dtype = torch.float32, attn_implementation: str = "eager"
    ) -> torch.nn.Module:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(
            str(path), dtype=dtype, attn_implementation=attn_implementation
        )
        return model.eval()

    return load


@pytest.fixture(scope="session")
def demo_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The `demo` checkpoint (random weights, a byte-level BPE tokenizer, so any text and
    JSON can be written in its tokens), built once per session in a temporary directory."""
    from kvferry.engine.models.demo import create_demo_checkpoint

    return create_demo_checkpoint(tmp_path_factory.mktemp("demo"))
