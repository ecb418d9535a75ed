"""The KV layout, its compatibility hash, and block runs as NIXL descriptors."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from kvferry.kvtransfer.layout import (
    KVLayout,
    block_runs,
    compatibility_hash,
    find_layout_mismatch,
    run_descriptors,
)


def layout(**changes: object) -> KVLayout:
    fields = {"block_size": 16, "num_layers": 32, "num_kv_heads": 8, "head_size": 128,
              "dtype": "bfloat16", "element_size": 2}
    return KVLayout(**{**fields, **changes})  # type: ignore[arg-type]


def test_the_layout_of_an_engine_cache() -> None:
    cache = torch.zeros((5, 3, 2, 4, 2, 8), dtype=torch.float16)
    found = KVLayout.of_cache(cache)
    assert found == KVLayout(block_size=4, num_layers=3, num_kv_heads=2, head_size=8,
                             dtype="float16", element_size=2)
    # One block is one contiguous slice of the tensor.
    assert found.block_bytes == cache[0].numel() * 2 == 3 * 2 * 4 * 2 * 8 * 2


def test_a_realistic_block_is_two_mebibytes() -> None:
    assert layout().block_bytes == 32 * 2 * 16 * 8 * 128 * 2 == 2 << 20


@pytest.mark.parametrize(
    ("cache", "message"),
    [
        (torch.zeros((5, 3, 4, 2, 8)), "must be \\(num_blocks"),
        (torch.zeros((5, 3, 3, 4, 2, 8)), "must be \\(num_blocks"),
        (torch.zeros((3, 5, 2, 4, 2, 8)).transpose(0, 1), "contiguous"),
    ],
)
def test_other_tensors_are_not_caches(cache: torch.Tensor, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        KVLayout.of_cache(cache)


def test_the_first_differing_field_is_named() -> None:
    assert find_layout_mismatch(layout(), layout()) is None
    assert find_layout_mismatch(layout(), layout(num_kv_heads=4)) == ("num_kv_heads", 8, 4)
    assert find_layout_mismatch(layout(), layout(dtype="float16", head_size=64)) == (
        "dtype", "bfloat16", "float16")


def test_the_hash_covers_model_and_layout() -> None:
    base = compatibility_hash("llama", [layout()])
    assert base == compatibility_hash("llama", [layout()])
    assert base != compatibility_hash("qwen", [layout()])
    assert base != compatibility_hash("llama", [layout(block_size=32)])
    assert base != compatibility_hash("llama", [layout(), layout()])


def test_runs_break_where_either_side_jumps() -> None:
    runs = block_runs(np.array([5, 6, 7, 9, 10]), np.array([3, 4, 8, 9, 10]))
    assert runs.tolist() == [[5, 3, 2], [7, 8, 1], [9, 9, 2]]


def test_consecutive_ids_on_both_sides_are_one_run() -> None:
    assert block_runs(np.arange(10, 30), np.arange(40, 60)).tolist() == [[10, 40, 20]]


def test_descending_ids_do_not_coalesce() -> None:
    assert block_runs(np.array([3, 2, 1]), np.array([4, 5, 6])).tolist() == [
        [3, 4, 1], [2, 5, 1], [1, 6, 1]]


def test_no_blocks_no_runs() -> None:
    assert block_runs(np.array([], dtype=np.int64), np.array([], dtype=np.int64)).shape == (0, 3)


def test_runs_need_equal_lengths() -> None:
    with pytest.raises(ValueError, match="equal length"):
        block_runs(np.array([1, 2]), np.array([1]))


def test_descriptors_are_address_length_device() -> None:
    descs = run_descriptors(np.array([2, 7]), np.array([3, 1]), 0x1000, 256, 0)
    assert descs.dtype == np.uint64
    assert descs.tolist() == [[0x1000 + 2 * 256, 3 * 256, 0], [0x1000 + 7 * 256, 256, 0]]


def test_split_descriptors_cuts_rows_into_equal_byte_runs() -> None:
    from kvferry.kvtransfer.nixl_backend import split_descriptors

    local = np.array([[1000, 10, 0], [2000, 30, 0], [3000, 20, 0]], dtype=np.uint64)
    remote = np.array([[5000, 10, 0], [6000, 30, 0], [7000, 20, 0]], dtype=np.uint64)

    (lo1, re1), (lo2, re2) = split_descriptors(local, remote, 2)

    assert lo1.tolist() == [[1000, 10, 0], [2000, 20, 0]]
    assert re1.tolist() == [[5000, 10, 0], [6000, 20, 0]]
    assert lo2.tolist() == [[2020, 10, 0], [3000, 20, 0]]
    assert re2.tolist() == [[6020, 10, 0], [7000, 20, 0]]
    thirds = split_descriptors(local, remote, 3)
    assert [lo[:, 1].sum() for lo, _ in thirds] == [20, 20, 20]
    assert [lo.tolist() for lo, _ in thirds] == [
        [[1000, 10, 0], [2000, 10, 0]], [[2010, 20, 0]], [[3000, 20, 0]]]
    # One row cut in four; a part never comes out empty.
    one = np.array([[0, 7, 0]], dtype=np.uint64)
    assert [lo.tolist() for lo, _ in split_descriptors(one, one, 4)] == [
        [[0, 1, 0]], [[1, 2, 0]], [[3, 2, 0]], [[5, 2, 0]]]
    assert len(split_descriptors(one, one, 9)) == 7
