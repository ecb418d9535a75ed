"""Tensor-parallel layers (engine/layers/tensor_parallel.py): which heads a rank holds (the
module docstring's worked example), and, in two real processes over gloo, sharded layers
loaded from whole checkpoint tensors computing what the whole layers compute."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from kvferry.engine.layers.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    TensorParallel,
    VocabParallelEmbedding,
    shard_heads,
)

HIDDEN, INTERMEDIATE, VOCAB, TOKENS = 16, 24, 37, 5


def test_the_worked_example_and_kv_head_splits() -> None:
    shard = shard_heads(8, 2, TensorParallel(rank=2, size=4))
    assert (shard.num_heads, shard.first_head, shard.num_kv_heads, shard.first_kv_head) == \
        (2, 4, 1, 1)
    # At least as many kv heads as ranks: split.
    assert shard_heads(8, 8, TensorParallel(1, 2)).first_kv_head == 4
    assert shard_heads(8, 8, TensorParallel(1, 2)).num_kv_heads == 4
    # Fewer: replicated on consecutive ranks.
    assert [shard_heads(8, 1, TensorParallel(r, 2)).first_kv_head for r in range(2)] == [0, 0]
    with pytest.raises(ValueError, match="6 attention heads do not split"):
        shard_heads(6, 2, TensorParallel(0, 4))
    with pytest.raises(ValueError, match="not a multiple of the 3 kv heads"):
        shard_heads(12, 3, TensorParallel(0, 4))
    with pytest.raises(ValueError, match="rank 2 of size 2"):
        TensorParallel(2, 2)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _weights() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator, dtype=torch.float64).float()
    return {"gate": rand(INTERMEDIATE, HIDDEN), "up": rand(INTERMEDIATE, HIDDEN),
            "down": rand(HIDDEN, INTERMEDIATE), "down_bias": rand(HIDDEN),
            "embed": rand(VOCAB, HIDDEN), "x": rand(TOKENS, HIDDEN),
            "ids": torch.tensor([0, 18, 19, 36, 7])}


def _rank(rank: int, size: int, port: int, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=size)
    try:
        tp = TensorParallel(rank, size, dist.group.WORLD)
        w = _weights()
        per_rank = INTERMEDIATE // size
        gate_up = ColumnParallelLinear(HIDDEN, [(rank * per_rank, per_rank)] * 2, bias=False,
                                       dtype=torch.float32)
        gate_up.load_checkpoint_tensor(gate_up.weight.data, 0, w["gate"])
        gate_up.load_checkpoint_tensor(gate_up.weight.data, 1, w["up"])
        down = RowParallelLinear((rank * per_rank, per_rank), HIDDEN, tp, bias=True,
                                 dtype=torch.float32)
        down.load_checkpoint_tensor(down.weight.data, None, w["down"])
        down.load_checkpoint_tensor(down.bias.data, None, w["down_bias"])
        gate, up = gate_up(w["x"]).split(per_rank, dim=-1)
        mlp = down(F.silu(gate) * up)
        embed = VocabParallelEmbedding(VOCAB, HIDDEN, tp, torch.float32)
        embed.load_checkpoint_tensor(embed.weight.data, None, w["embed"])
        torch.save({"mlp": mlp, "embeds": embed(w["ids"]), "logits": embed.logits(w["x"])},
                   out.format(rank=rank))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("size", [2, 3])
def test_sharded_layers_compute_what_the_whole_layers_do(tmp_path: Path, size: int) -> None:
    out = str(tmp_path / "rank{rank}.pt")
    mp.start_processes(_rank, args=(size, _free_port(), out), nprocs=size, join=True,
                       start_method="spawn")
    w = _weights()
    mlp = F.linear(F.silu(F.linear(w["x"], w["gate"])) * F.linear(w["x"], w["up"]),
                   w["down"], w["down_bias"])
    embeds = F.embedding(w["ids"], w["embed"])
    logits = F.linear(w["x"], w["embed"])
    for rank in range(size):
        got = torch.load(out.format(rank=rank))
        torch.testing.assert_close(got["mlp"], mlp, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got["embeds"], embeds, rtol=0, atol=0)
        assert got["logits"].shape == (TOKENS, VOCAB)  # the padding rows cut off
        torch.testing.assert_close(got["logits"], logits, rtol=1e-5, atol=1e-5)


def test_the_loader_gives_each_tensor_parallel_layer_its_shard(tmp_path: Path) -> None:
    from kvferry.engine.models.loader import load_weights
    from safetensors.torch import save_file
    from torch import nn

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = ColumnParallelLinear(4, [(4, 4)], bias=True, dtype=torch.float32)
            self.out = RowParallelLinear((2, 2), 3, TensorParallel(), bias=False,
                                         dtype=torch.float32)

    whole = {"proj.weight": torch.arange(32.0).reshape(8, 4), "proj.bias": torch.arange(8.0),
             "out.weight": torch.arange(12.0).reshape(3, 4)}
    save_file(whole, str(tmp_path / "model.safetensors"))
    block = Block()
    load_weights(block, tmp_path)
    assert torch.equal(block.proj.weight, whole["proj.weight"][4:8])
    assert torch.equal(block.proj.bias, whole["proj.bias"][4:8])
    assert torch.equal(block.out.weight, whole["out.weight"][:, 2:4])
    save_file({**whole, "out.weight": torch.zeros(5, 4)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"out.weight of shape \(5, 4\) does not fit"):
        load_weights(Block(), tmp_path)
