"""KV cache allocation: zeroed, contiguous, huge pages advised on CPU."""

from __future__ import annotations

from pathlib import Path

import torch
from kvferry.kvtransfer.memory import HUGE_PAGE_BYTES, advise_huge_pages, allocate_kv_cache


def test_the_cache_is_zeroed_and_contiguous() -> None:
    cache = allocate_kv_cache((9, 2, 2, 16, 8, 128), torch.bfloat16)
    assert cache.shape == (9, 2, 2, 16, 8, 128) and cache.dtype == torch.bfloat16
    assert cache.is_contiguous() and not cache.any()


def test_huge_pages_are_advised_when_the_kernel_offers_them() -> None:
    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    cache = torch.empty(4 * HUGE_PAGE_BYTES, dtype=torch.uint8)
    advised = advise_huge_pages(cache.data_ptr(), cache.numel())
    assert advised == ("[never]" not in thp)


def test_a_range_without_an_aligned_huge_page_is_left_alone() -> None:
    assert not advise_huge_pages(HUGE_PAGE_BYTES + 4096, HUGE_PAGE_BYTES - 8192)
