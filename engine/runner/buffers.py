"""Host/device buffer pairs: a pinned-when-possible CPU tensor, its NumPy view, a device copy."""

from __future__ import annotations

import numpy as np
import torch


class CpuGpuBuffer:
    """One preallocated buffer seen three ways.

    `.cpu` and `.np` share memory, so NumPy code fills what torch copies; `.device` is the
    same tensor when the device is the CPU, else a device tensor filled by
    `copy_to_device(n)` (one host-to-device copy of the first `n` rows per step).
    """

    def __init__(self, *shape: int, dtype: torch.dtype, device: torch.device) -> None:
        self.cpu = torch.zeros(shape, dtype=dtype)
        self.np: np.ndarray = self.cpu.numpy()
        self.device = self.cpu if device.type == "cpu" else torch.zeros_like(self.cpu, device=device)

    def copy_to_device(self, n: int | None = None) -> torch.Tensor:
        """Returns the first `n` rows on the device (all rows when n is None)."""
        if n is None:
            n = self.cpu.shape[0]
        if self.device is not self.cpu:
            self.device[:n].copy_(self.cpu[:n], non_blocking=True)
        return self.device[:n]
