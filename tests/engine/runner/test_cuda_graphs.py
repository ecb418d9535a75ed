"""Decode graphs (runner/cuda_graphs.py) on the CPU: the capture sizes, the padded fixed
buffers of the docstring's worked example, and whole engines whose decode-only steps run
through the padded buffers (eagerly: nothing is captured on a CPU) computing exactly what
the plain path computes, with padding rows never written to the cache nor sampled."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from kvferry.engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from kvferry.engine.frontend.llm_engine import LLMEngine
from kvferry.engine.runner.cuda_graphs import DecodeGraphs, capture_sizes
from kvferry.engine.runner.prepare_inputs import InputBuffers, prepare_inputs
from kvferry.engine.sampling_params import SamplingParams
from kvferry_testing.encdec_checkpoints import make_bart_checkpoint

BLOCK_SIZE = 4


@pytest.mark.parametrize(("max_num_seqs", "max_tokens", "expected"), [
    (256, 2048, [1, 2, 4, *range(8, 257, 8)]),
    (10, 2048, [1, 2, 4, 8, 10]),
    (3, 2048, [1, 2, 3]),
    (1, 2048, [1]),
    (256, 100, [1, 2, 4, *range(8, 97, 8), 100]),
    (16, 16, [1, 2, 4, 8, 16]),
])
def test_capture_sizes(max_num_seqs: int, max_tokens: int, expected: list[int]) -> None:
    assert capture_sizes(max_num_seqs, max_tokens) == expected


def test_padded_size_is_the_smallest_size_that_holds_the_batch() -> None:
    graphs = DecodeGraphs([1, 2, 4, 8, 10], torch.zeros((10, 3), dtype=torch.int32), 32,
                          torch.device("cpu"))
    assert [graphs.padded_size(n) for n in range(1, 12)] == [1, 2, 4, 4, 8, 8, 8, 8, 10, 10,
                                                             None]
    with pytest.raises(ValueError, match="ascending"):
        DecodeGraphs([4, 2], torch.zeros((4, 3), dtype=torch.int32), 32, torch.device("cpu"))
    with pytest.raises(ValueError, match="the block table has 4 rows"):
        DecodeGraphs([1, 8], torch.zeros((4, 3), dtype=torch.int32), 32, torch.device("cpu"))


def test_stage_pads_the_worked_example() -> None:
    """Three decodes at sequence lengths [17, 5, 9] in the graph of size 4, M = 8."""
    block_size, max_model_len = 4, 32
    block_table = np.zeros((8, 8), dtype=np.int32)
    block_table[0, :5] = [3, 4, 5, 6, 7]
    block_table[1, :2] = [8, 9]
    block_table[2, :3] = [10, 11, 12]
    token_ids = np.zeros((8, max_model_len), dtype=np.int32)
    token_ids[0, 16], token_ids[1, 4], token_ids[2, 8] = 101, 102, 103
    prepared = prepare_inputs(
        np.array([1, 1, 1]), np.array([16, 4, 8], dtype=np.int32), np.array([17, 5, 9]),
        token_ids, block_table, block_size, InputBuffers.allocate(16, 8))
    graphs = DecodeGraphs([1, 2, 4, 8], torch.from_numpy(block_table), max_model_len,
                          torch.device("cpu"))
    inputs = graphs.stage(prepared, 4)
    assert inputs.input_ids.tolist() == [101, 102, 103, 0]
    assert inputs.positions.tolist() == [16, 4, 8, 0]
    # Slots: block 7 offset 0, block 9 offset 0, block 12 offset 0; padding -1.
    assert inputs.slot_mapping.tolist() == [28, 36, 48, -1]
    assert inputs.query_start_loc.tolist() == [0, 1, 2, 3, 4]
    assert inputs.seq_lens.tolist() == [17, 5, 9, 0]
    # The same memory every step: a later, smaller step reads the same tensors.
    again = graphs.stage(prepared, 4)
    assert again.input_ids.data_ptr() == inputs.input_ids.data_ptr()
    assert again.seq_lens.data_ptr() == inputs.seq_lens.data_ptr()


@pytest.fixture(scope="module")
def checkpoint(make_checkpoint: Callable[..., Path]) -> Path:
    return make_checkpoint("LlamaForCausalLM", vocab_size=256)


def make_engine(model: Path, graphs: bool, backend: str = "torch",
                **scheduler: Any) -> LLMEngine:
    engine = LLMEngine(EngineConfig(
        model=ModelConfig(model=str(model), max_model_len=96),
        cache=CacheConfig(block_size=BLOCK_SIZE, num_gpu_blocks_override=120),
        scheduler=SchedulerConfig(max_num_seqs=12, max_num_batched_tokens=64, **scheduler),
        attention_backend=backend, device="cpu",
    ))
    if graphs:
        engine.runner.enable_decode_graphs()
    return engine


class GraphSpy:
    """Counts the graph steps of a runner by padded size, and the rows each sampled."""

    def __init__(self, engine: LLMEngine) -> None:
        graphs = engine.runner.graphs
        assert graphs is not None
        self.sizes: list[tuple[int, int]] = []  # (rows, padded size) per graph step
        run = graphs.run

        def counted(num_reqs: int, size: int) -> torch.Tensor:
            logits = run(num_reqs, size)
            assert logits.shape[0] == num_reqs  # padding rows never reach the sampler
            self.sizes.append((num_reqs, size))
            return logits

        graphs.run = counted  # type: ignore[method-assign]


def requests(num: int, seed: int = 0) -> list[tuple[str, list[int], SamplingParams]]:
    rng = np.random.default_rng(seed)
    out = []
    for i in range(num):
        prompt = rng.integers(3, 256, size=int(rng.integers(3, 30))).tolist()
        kind = i % 4
        if kind == 0:
            params = SamplingParams(temperature=0.0, max_tokens=int(rng.integers(5, 25)),
                                    ignore_eos=True)
        elif kind == 1:
            params = SamplingParams(temperature=0.9, top_p=0.9, seed=i, max_tokens=20,
                                    ignore_eos=True)
        elif kind == 2:
            params = SamplingParams(temperature=0.0, max_tokens=15, logprobs=2,
                                    ignore_eos=True)
        else:
            params = SamplingParams(temperature=0.8, top_k=10, seed=i, max_tokens=12,
                                    repetition_penalty=1.1, ignore_eos=True)
        out.append((f"r{i}", prompt, params))
    return out


def generate(engine: LLMEngine, reqs: list[tuple[str, list[int], SamplingParams]]
             ) -> dict[str, tuple[list[int], Any]]:
    for req_id, prompt, params in reqs:
        engine.add_request(req_id, {"prompt_token_ids": prompt}, params)
    final: dict[str, tuple[list[int], Any]] = {}
    for _ in range(300):
        if not engine.has_unfinished_requests():
            break
        for output in engine.step():
            if output.finished:
                completion = output.outputs[0]
                final[output.request_id] = (list(completion.token_ids), completion.logprobs)
    assert not engine.has_unfinished_requests()
    return final


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_graph_steps_equal_the_plain_path(checkpoint: Path, backend: str,
                                          async_scheduling: bool) -> None:
    """Eleven requests of mixed sampling finish at different steps, so decode-only steps
    of 11 down to 1 rows replay the padded sizes 12, 8, 4, 2, 1; every token and logprob
    equals the plain path's."""
    if backend == "triton" and not _triton_on_cpu():
        pytest.skip("Triton's interpreter is not active (TRITON_INTERPRET=1)")
    reqs = requests(11)
    plain = generate(make_engine(checkpoint, False, backend), reqs)
    engine = make_engine(checkpoint, True, backend, async_scheduling=async_scheduling)
    spy = GraphSpy(engine)
    padded = generate(engine, reqs)
    assert padded.keys() == plain.keys()
    for req_id, (tokens, logprobs) in plain.items():
        assert padded[req_id][0] == tokens, req_id
        if logprobs is not None:
            for got, want in zip(padded[req_id][1], logprobs, strict=True):
                assert got.keys() == want.keys()
                for token, entry in want.items():
                    assert got[token].logprob == pytest.approx(entry.logprob, abs=1e-5)
    used = {size for _, size in spy.sizes}
    assert {rows for rows, size in spy.sizes if rows < size}  # some steps were padded
    assert used <= {1, 2, 4, 8, 12} and 12 in used
    assert engine.num_free_blocks == engine.kv_cache_manager.block_pool.num_blocks - 1


def test_padding_rows_write_no_cache_block(checkpoint: Path) -> None:
    """Three requests decode through the graph of size 4: only their own blocks and the
    null block (where the torch backend drops a padding row's write) change."""
    engine = make_engine(checkpoint, True)
    spy = GraphSpy(engine)
    reqs = [(f"p{i}", list(range(5 + i, 14 + i)), SamplingParams(max_tokens=6, ignore_eos=True))
            for i in range(3)]
    for req_id, prompt, params in reqs:
        engine.add_request(req_id, {"prompt_token_ids": prompt}, params)
    engine.step()  # the three prefills
    kv_cache = engine.runner.kv_cache
    before = kv_cache.clone()
    held = {block for req_id, *_ in reqs
            for block in engine.kv_cache_manager.get_block_ids(req_id)}
    engine.step()  # a decode-only step of 3 rows, padded to 4
    assert spy.sizes == [(3, 4)]
    changed = {int(b) for b in torch.nonzero((kv_cache != before).flatten(1).any(dim=1))}
    assert changed and changed <= held | {0}


def test_enable_decode_graphs_refuses_encoder_decoder(tmp_path: Path) -> None:
    make_bart_checkpoint(tmp_path, seed=3)
    engine = LLMEngine(EngineConfig(
        model=ModelConfig(model=str(tmp_path), max_model_len=64),
        cache=CacheConfig(block_size=BLOCK_SIZE, num_gpu_blocks_override=64),
        device="cpu"))
    with pytest.raises(ValueError, match="cross-attention"):
        engine.runner.enable_decode_graphs()


def _triton_on_cpu() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"
