"""The Llama family split over tensor-parallel ranks (engine/layers/tensor_parallel.py):
two gloo processes, each loading its shard of a random checkpoint and its own KV cache
(its kv heads only), compute a prefill and a decode step whose logits equal the whole
model's; kv heads split (2 over 2 ranks) and replicated (1 over 2), tied and untied heads."""

from __future__ import annotations

import socket
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from kvferry.engine.attention.backend import AttentionMetadata
from kvferry.engine.attention.torch_backend import TorchAttentionBackend
from kvferry.engine.layers.tensor_parallel import TensorParallel
from kvferry.engine.models.loader import load_model
from kvferry.engine.runner.memory_profile import profile_batch

BLOCK_SIZE = 4
# Two prompts of 12 and 8 tokens, then one decode token each.
PREFILL_TOKENS, MAX_LEN = 20, 12


def _logits(path: Path, tp: TensorParallel | None) -> torch.Tensor:
    """Prefill then one decode step; returns both steps' logits, stacked by row."""
    torch.manual_seed(0)
    model = load_model(path, torch.float32, TorchAttentionBackend(), torch.device("cpu"),
                       tp=tp)
    attention = model.model.layers[0].self_attn
    metadata, positions, num_blocks = profile_batch(PREFILL_TOKENS, MAX_LEN, BLOCK_SIZE,
                                                    torch.device("cpu"))
    cache = torch.zeros((num_blocks + 2, len(model.model.layers), 2, BLOCK_SIZE,
                         attention.num_kv_heads, attention.head_size))
    views = [(cache[:, i, 0], cache[:, i, 1]) for i in range(cache.shape[1])]
    input_ids = torch.randint(3, model.config.vocab_size, (PREFILL_TOKENS,))
    prefill = model.compute_logits(model(input_ids, positions, views, metadata))
    # Each request's next token at the next position, in the same blocks.
    lens = metadata.seq_lens_np
    decode_positions = torch.tensor(lens, dtype=torch.int64)
    # One more block per request (blocks after the prefill's) for the decoded token.
    extra = num_blocks + torch.arange(len(lens), dtype=torch.int32)[:, None]
    tables = torch.cat([metadata.block_table, extra], dim=1)
    slots = torch.stack([tables[i, int(lens[i]) // BLOCK_SIZE] * BLOCK_SIZE
                         + int(lens[i]) % BLOCK_SIZE for i in range(len(lens))]).long()
    starts = torch.arange(len(lens) + 1, dtype=torch.int32)
    decode = AttentionMetadata(
        num_reqs=len(lens), num_actual_tokens=len(lens), max_query_len=1,
        max_seq_len=int(lens.max()) + 1, query_start_loc=starts,
        seq_lens=torch.tensor(lens + 1, dtype=torch.int32), block_table=tables,
        slot_mapping=slots, query_start_loc_np=starts.numpy(), seq_lens_np=lens + 1)
    next_ids = prefill[torch.tensor([int(e) - 1 for e in metadata.query_start_loc_np[1:]])]
    decoded = model.compute_logits(model(next_ids.argmax(dim=-1), decode_positions, views,
                                         decode))
    return torch.cat([prefill, decoded])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _rank(rank: int, size: int, port: int, path: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=size)
    try:
        torch.set_num_threads(1)
        logits = _logits(Path(path), TensorParallel(rank, size, dist.group.WORLD))
        torch.save(logits, out.format(rank=rank))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize(("num_kv_heads", "tied"), [(2, False), (1, True)])
def test_two_ranks_compute_the_whole_models_logits(
    make_checkpoint: Callable[..., Path], tmp_path: Path, num_kv_heads: int, tied: bool,
) -> None:
    path = make_checkpoint("LlamaForCausalLM", num_kv_heads=num_kv_heads,
                           tie_word_embeddings=tied, vocab_size=250)
    expected = _logits(path, None)
    out = str(tmp_path / "rank{rank}.pt")
    mp.start_processes(_rank, args=(2, _free_port(), str(path), out), nprocs=2, join=True,
                       start_method="spawn")
    for rank in range(2):
        got = torch.load(out.format(rank=rank))
        assert got.shape == expected.shape
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
        assert torch.equal(got.argmax(dim=-1), expected.argmax(dim=-1))


def test_a_model_without_tensor_parallelism_is_refused(tmp_path: Path) -> None:
    from kvferry_testing.encdec_checkpoints import make_bart_checkpoint

    make_bart_checkpoint(tmp_path, seed=3)
    with pytest.raises(ValueError, match="has no tensor parallelism"):
        load_model(tmp_path, torch.float32, TorchAttentionBackend(), torch.device("cpu"),
                   tp=TensorParallel(0, 2))
