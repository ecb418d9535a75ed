"""Host/device buffer pairs: a CPU tensor, its NumPy view, a device copy."""

from __future__ import annotations

import numpy as np
import torch


class CpuGpuBuffer:
    """One preallocated buffer seen three ways.

    `.cpu` and `.np` share memory, so NumPy code fills what torch copies; `.device` is the
    same tensor when the device is the CPU, else a device tensor filled by
    `copy_to_device(n)` (one host-to-device copy of the first `n` rows per step).

    On a GPU the copy goes through one of two pinned staging buffers, in turn: a copy from
    pageable memory would first wait for all the work queued on the stream (which async
    scheduling keeps busy), and the host goes on editing `.np` for the next step while
    this step's copy may still be queued. A staging buffer is refilled only after the
    copy that last read it is done (its event; two steps back, so in practice at once).
    """

    def __init__(self, *shape: int, dtype: torch.dtype, device: torch.device) -> None:
        self.cpu = torch.zeros(shape, dtype=dtype)
        self.np: np.ndarray = self.cpu.numpy()
        self.device = self.cpu if device.type == "cpu" else torch.zeros_like(self.cpu, device=device)
        self._staging: list[torch.Tensor] = []
        self._copied: list[torch.cuda.Event | None] = [None, None]
        self._turn = 0

    def copy_to_device(self, n: int | None = None) -> torch.Tensor:
        """Returns the first `n` rows on the device (all rows when n is None)."""
        if n is None:
            n = self.cpu.shape[0]
        if self.device is self.cpu:
            return self.device[:n]
        if not self._staging:
            pinned = torch.cuda.is_available()
            self._staging = [torch.empty(self.cpu.shape, dtype=self.cpu.dtype, pin_memory=pinned) for _ in range(2)]
        turn = self._turn
        copied = self._copied[turn]
        if copied is not None:
            copied.synchronize()
        staging = self._staging[turn]
        staging[:n].copy_(self.cpu[:n])
        self.device[:n].copy_(staging[:n], non_blocking=True)
        if self.device.device.type == "cuda":
            event = torch.cuda.Event()
            event.record()
            self._copied[turn] = event
        self._turn = 1 - turn
        return self.device[:n]
