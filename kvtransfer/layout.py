"""The KV cache layout two engines must share, and the block runs a pull moves.

The engine's cache is one tensor per block group, blocks outermost:

    (num_blocks, num_layers, 2, block_size, num_kv_heads, head_size)

so block `b` is the contiguous byte range `[b * block_bytes, (b + 1) * block_bytes)` of the
tensor, across all layers, keys and values. A pull of blocks whose ids are consecutive on
both sides is therefore one contiguous read: the descriptors of a pull are its runs.

An engine of several ranks (pipeline stages, tensor-parallel shards) has one such tensor per
rank and group, each holding its rank's layers (`first_layer`, `num_layers`) and kv heads
(`first_kv_head`, `num_kv_heads`); a block id means the same tokens in every rank's tensor.
Between engines of the same ranks, rank r's blocks are read from the producer's rank r.
"""

from __future__ import annotations

import hashlib

import msgspec
import numpy as np
from kvferry.kvtransfer.params import TRANSFER_PROTOCOL_VERSION

# Version of the cache layout above; bump it whenever the byte order of a block changes.
KV_LAYOUT_VERSION = 1

# The fields a consumer compares, in the order a mismatch is reported.
LAYOUT_FIELDS = ("layout_version", "dtype", "block_size", "first_layer", "num_layers",
                 "first_kv_head", "num_kv_heads", "head_size")


class KVLayout(msgspec.Struct, frozen=True):
    """The shape of one block group's cache, as the side channel reports it."""

    block_size: int
    num_layers: int
    num_kv_heads: int
    head_size: int
    # torch dtype name without the prefix: "float16", "bfloat16", "float32".
    dtype: str
    element_size: int
    layout_version: int = KV_LAYOUT_VERSION
    # The part of the model the tensor holds (one rank's): its layers are the model's
    # [first_layer, first_layer + num_layers), its kv heads [first_kv_head, + num_kv_heads).
    # With them a consumer of other parallel sizes could tell which producer rank holds
    # which of its layers and heads.
    first_layer: int = 0
    first_kv_head: int = 0

    @property
    def block_bytes(self) -> int:
        """Bytes of one block: every layer's keys and values for `block_size` tokens."""
        return (
            self.num_layers * 2 * self.block_size * self.num_kv_heads * self.head_size
            * self.element_size
        )

    @classmethod
    def of_cache(cls, kv_cache: object, first_layer: int = 0, first_kv_head: int = 0
                 ) -> KVLayout:
        """The layout of an engine cache tensor (holding the model's layers and kv heads
        from the given ones on); raises ValueError for any other shape."""
        import torch

        if not isinstance(kv_cache, torch.Tensor):
            raise ValueError(f"a KV cache must be a torch.Tensor, got {type(kv_cache).__name__}")
        if kv_cache.dim() != 6 or kv_cache.shape[2] != 2:
            raise ValueError(
                "a KV cache must be (num_blocks, num_layers, 2, block_size, num_kv_heads, "
                f"head_size), got shape {tuple(kv_cache.shape)}"
            )
        if not kv_cache.is_contiguous():
            raise ValueError("a KV cache must be contiguous, so that a block is one byte range")
        _, num_layers, _, block_size, num_kv_heads, head_size = kv_cache.shape
        return cls(
            block_size=block_size, num_layers=num_layers, num_kv_heads=num_kv_heads,
            head_size=head_size, dtype=str(kv_cache.dtype).removeprefix("torch."),
            element_size=kv_cache.element_size(), first_layer=first_layer,
            first_kv_head=first_kv_head,
        )


class RegionInfo(msgspec.Struct, frozen=True):
    """Where one block group's cache lives in the producer's memory."""

    base_addr: int
    num_blocks: int
    # GPU ordinal for "VRAM"; 0 for "DRAM".
    device_id: int
    # NIXL memory type: "DRAM" (CPU) or "VRAM" (GPU).
    mem_type: str


def compatibility_hash(model_id: str, layouts: list[KVLayout], num_ranks: int = 1) -> str:
    """Hash of everything two engines must agree on to exchange blocks.

    Covers the model, the dtype and layout of every group and rank, the number of ranks and
    kvferry's protocol version: equal hashes mean a block read from the producer means the
    same on the consumer.
    """
    material = msgspec.msgpack.encode((TRANSFER_PROTOCOL_VERSION, model_id, num_ranks, layouts))
    return hashlib.sha256(material).hexdigest()[:16]


def find_layout_mismatch(local: KVLayout, remote: KVLayout) -> tuple[str, object, object] | None:
    """The first layout field that differs, with both values; None when all match."""
    for name in LAYOUT_FIELDS:
        mine, theirs = getattr(local, name), getattr(remote, name)
        if mine != theirs:
            return name, mine, theirs
    return None


def block_runs(local_ids: np.ndarray, remote_ids: np.ndarray) -> np.ndarray:
    """(num_runs, 3) int64 rows (local_start, remote_start, num_blocks).

    A run is a stretch where both the local and the remote ids go up by one. Example:
        local  [5, 6, 7, 9, 10]
        remote [3, 4, 8, 9, 10]
    breaks after index 1 (remote 4 -> 8) and after index 2 (local 7 -> 9):
        [[5, 3, 2], [7, 8, 1], [9, 9, 2]]
    """
    local_ids = np.asarray(local_ids, dtype=np.int64)
    remote_ids = np.asarray(remote_ids, dtype=np.int64)
    if local_ids.shape != remote_ids.shape or local_ids.ndim != 1:
        raise ValueError(
            f"local and remote block ids must be 1-D and of equal length, got "
            f"{local_ids.shape} and {remote_ids.shape}"
        )
    if local_ids.size == 0:
        return np.zeros((0, 3), dtype=np.int64)
    continues = (np.diff(local_ids) == 1) & (np.diff(remote_ids) == 1)
    # Index of the first block of each run, and one past the last block.
    starts = np.concatenate(([0], np.flatnonzero(~continues) + 1))
    ends = np.concatenate((starts[1:], [local_ids.size]))
    return np.stack((local_ids[starts], remote_ids[starts], ends - starts), axis=1)


def run_descriptors(
    starts: np.ndarray, lengths: np.ndarray, base_addr: int, block_bytes: int, device_id: int
) -> np.ndarray:
    """(num_runs, 3) uint64 NIXL descriptors (address, bytes, device id) of block runs."""
    descs = np.empty((len(starts), 3), dtype=np.uint64)
    descs[:, 0] = base_addr + starts.astype(np.uint64) * block_bytes
    descs[:, 1] = lengths.astype(np.uint64) * block_bytes
    descs[:, 2] = device_id
    return descs
