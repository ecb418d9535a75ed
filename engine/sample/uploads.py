"""A step's small host arrays moved to the device in one copy per dtype.

Sampling metadata is a dozen small per-row arrays (temperatures, top-k, seeds, penalties,
blocked stop tokens...). Moved one by one, each is a launch, and from pageable memory each
waits for the work queued on the stream, which with async scheduling is the step in
flight. Here they are packed back to back into a pinned host buffer per dtype and moved
with one non-blocking copy each; the step reads views of the device buffer.

A host buffer is refilled only after the copy that last read it is done: `PinnedUploads`
alternates between two per dtype and waits on the event of the one it takes back (two
steps old, so in practice done). On the CPU nothing is copied: the views are the arrays.
"""

from __future__ import annotations

import numpy as np
import torch

_TORCH_DTYPES = {np.dtype(np.int64): torch.int64, np.dtype(np.float32): torch.float32,
                 np.dtype(np.bool_): torch.bool}


class PinnedUploads:
    """Grow-only pinned host buffers, two per dtype used in turn, kept across steps."""

    def __init__(self) -> None:
        self._buffers: dict[tuple[torch.dtype, int], torch.Tensor] = {}
        self._copied: dict[tuple[torch.dtype, int], torch.cuda.Event] = {}
        self._turn: dict[torch.dtype, int] = {}

    def take(self, dtype: torch.dtype, numel: int) -> tuple[torch.Tensor, tuple[torch.dtype, int]]:
        """A pinned buffer of at least `numel` elements whose last copy is done."""
        turn = self._turn.get(dtype, 0)
        self._turn[dtype] = 1 - turn
        key = (dtype, turn)
        event = self._copied.pop(key, None)
        if event is not None:
            event.synchronize()
        buffer = self._buffers.get(key)
        if buffer is None or buffer.numel() < numel:
            size = max(numel, 2 * (0 if buffer is None else buffer.numel()), 1024)
            buffer = torch.empty(size, dtype=dtype, pin_memory=torch.cuda.is_available())
            self._buffers[key] = buffer
        return buffer, key

    def copied(self, key: tuple[torch.dtype, int]) -> None:
        """Records that the copy from buffer `key` was just queued."""
        event = torch.cuda.Event()
        event.record()
        self._copied[key] = event


def upload(arrays: list[np.ndarray], device: torch.device,
           pinned: PinnedUploads | None = None, pack_on_cpu: bool = False) -> list[torch.Tensor]:
    """`arrays` (int64, float32 or bool) as tensors on `device`, in order: on a GPU one
    copy per dtype through `pinned` (or, without it, one pageable copy per dtype).
    `pack_on_cpu`: pack even for the CPU (where the views are then of the host buffers), so
    the packing can be checked without a GPU."""
    if device.type == "cpu" and not pack_on_cpu:
        return [torch.from_numpy(np.ascontiguousarray(a)) for a in arrays]
    result: list[torch.Tensor | None] = [None] * len(arrays)
    by_dtype: dict[torch.dtype, list[int]] = {}
    for index, array in enumerate(arrays):
        by_dtype.setdefault(_TORCH_DTYPES[array.dtype], []).append(index)
    for dtype, indices in by_dtype.items():
        sizes = [arrays[i].size for i in indices]
        total = sum(sizes)
        if pinned is not None:
            host, key = pinned.take(dtype, total)
        else:
            host, key = torch.empty(total, dtype=dtype), None
        flat = host.numpy()
        offset = 0
        for index, size in zip(indices, sizes):
            flat[offset:offset + size] = arrays[index].reshape(-1)
            offset += size
        on_device = host[:total].to(device, non_blocking=pinned is not None)
        if pinned is not None and key is not None and device.type == "cuda":
            pinned.copied(key)
        offset = 0
        for index, size in zip(indices, sizes):
            result[index] = on_device[offset:offset + size].view(arrays[index].shape)
            offset += size
    return result  # type: ignore[return-value]
