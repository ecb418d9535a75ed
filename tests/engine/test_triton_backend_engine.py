"""The whole engine with the Triton attention backend (and, with it, the Triton RMSNorm,
SiLU-and-mul and rotary kernels in the model's layers) gives the torch backend's greedy
tokens.

On a machine without a GPU the kernels run under Triton's interpreter (tests/conftest.py
sets TRITON_INTERPRET=1 before they are imported), so CI runs this on every change; the
same batch runs on CUDA in test_cuda.py.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch
from kvferry.engine.attention import resolve_attention_backend

from kvferry import LLM, SamplingParams

VOCAB_SIZE = 256
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _llm(path: Path, backend: str) -> LLM:
    # A budget of 24 tokens splits longer prompts into chunks; 14 blocks of 8 tokens for
    # 8 requests of up to 60 tokens force preemption; a shared prefix gives prefix hits.
    return LLM(model=str(path), attention_backend=backend, device=DEVICE, dtype="float32",
               max_model_len=96, block_size=8, num_gpu_blocks_override=14,
               max_num_batched_tokens=24, max_num_seqs=8, enable_prefix_caching=True, seed=0)


def _greedy_tokens(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs]


def _layers_on_triton(llm: LLM) -> tuple[int, int]:
    """(modules with Triton kernels, how many of them use them) in the engine's model."""
    model = llm.llm_engine.engine_core.runner.model
    able = [m for m in model.modules() if hasattr(type(m), "triton_kernels")]
    return len(able), sum(m.triton_kernels for m in able)


# Qwen3 adds per-head q/k RMSNorm on views of the fused projection.
@pytest.mark.parametrize("architecture", ["LlamaForCausalLM", "Qwen3ForCausalLM"])
def test_triton_backend_matches_torch_on_a_mixed_batch(make_checkpoint, architecture) -> None:
    path = make_checkpoint(architecture, num_layers=2, hidden_size=64, num_heads=4,
                           num_kv_heads=2)
    rng = np.random.default_rng(21)
    shared = rng.integers(3, VOCAB_SIZE, size=19).tolist()
    lengths = [1, 30, 7, 35, 12, 3, 28, 16]
    prompts = [shared + rng.integers(3, VOCAB_SIZE, size=n).tolist() for n in lengths]

    results = {}
    for backend in ("torch", "triton"):
        llm = _llm(path, backend)
        assert llm.llm_engine.engine_core.runner.attn_backend.name == backend
        able, used = _layers_on_triton(llm)
        # Per layer: two norms, attention's rope, the MLP (Qwen3: two more norms); the
        # final norm.
        assert able == 2 * (4 if architecture == "LlamaForCausalLM" else 6) + 1
        assert used == (able if backend == "triton" else 0)
        results[backend] = _greedy_tokens(llm, prompts)
        stats = llm.llm_engine.stats
        assert stats.scheduler.num_preemptions > 0
        assert stats.scheduler.prefix_cache_hits > 0
        assert stats.num_steps > sum(len(p) for p in prompts) // 24  # chunked prefills

    assert results["triton"] == results["torch"]


def test_auto_is_triton_on_cuda_and_torch_on_cpu() -> None:
    assert resolve_attention_backend("auto", torch.device("cpu")) == "torch"
    assert resolve_attention_backend("auto", torch.device("cuda")) == "triton"
    assert resolve_attention_backend("torch", torch.device("cuda")) == "torch"


def test_triton_on_cpu_without_the_interpreter_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        resolve_attention_backend("triton", torch.device("cpu"))
    assert os.environ.get("TRITON_INTERPRET") is None
