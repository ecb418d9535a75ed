"""One host-to-device copy for a step's index arrays.

A step needs six small index arrays on the device (input ids, positions, slot mapping,
query start offsets, sequence lengths, the rows whose logits are sampled). Copied one by
one that is six launches and six chances to synchronise; here they are packed, back to
back, into one pinned int64 staging buffer and moved with one non-blocking copy into a
device buffer of the same layout, whose slices the step then reads.

Layout of a step with T tokens, R requests and S sampled rows (offsets in elements):

    [ input_ids : T | positions : T | slot_mapping : T | query_start_loc : R + 1 |
      seq_lens : R | logits_indices : S ]

On the CPU nothing is copied: the step reads the host arrays themselves.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from kvferry.engine.runner.prepare_inputs import PreparedInputs


@dataclass
class StepTensors:
    """A step's index arrays as tensors on the device (int64, except as noted)."""

    input_ids: torch.Tensor  # (num_tokens,)
    positions: torch.Tensor  # (num_tokens,)
    slot_mapping: torch.Tensor  # (num_tokens,)
    query_start_loc: torch.Tensor  # (num_reqs + 1,) int32 on CPU, int64 on a device
    seq_lens: torch.Tensor  # (num_reqs,) int32 on CPU, int64 on a device
    logits_indices: torch.Tensor  # (num_sampled,)


class StepStaging:
    """Pinned staging buffer and its device twin, sized for the largest step."""

    def __init__(
        self, max_num_tokens: int, max_num_reqs: int, device: torch.device,
        stage_on_cpu: bool = False,
    ) -> None:
        """`stage_on_cpu`: pack and copy even when the device is the CPU (where the copy
        is pointless), so the packing can be checked without a GPU."""
        self.device = device
        self.capacity = 3 * max_num_tokens + 3 * max_num_reqs + 1
        self.host: torch.Tensor | None = None
        self.on_device: torch.Tensor | None = None
        # Recorded after each step's copy on a GPU: the next step refills the host buffer
        # only once the copy has read it.
        self._copied: torch.cuda.Event | None = None
        if device.type != "cpu" or stage_on_cpu:
            self.host = torch.zeros(self.capacity, dtype=torch.int64,
                                    pin_memory=torch.cuda.is_available())
            self.on_device = torch.zeros(self.capacity, dtype=torch.int64, device=device)

    def stage(self, prepared: PreparedInputs) -> StepTensors:
        """The step's arrays on the device, after at most one host-to-device copy."""
        arrays = (prepared.input_ids, prepared.positions, prepared.slot_mapping,
                  prepared.query_start_loc, prepared.seq_lens, prepared.logits_indices)
        if self.host is None or self.on_device is None:
            return StepTensors(*(torch.from_numpy(np.ascontiguousarray(a)) for a in arrays))
        if self._copied is not None:
            # The synchronous loop read the previous step's tokens, so this returns at once;
            # with async scheduling the previous step may still be queued behind the one
            # before it.
            self._copied.synchronize()
        host = self.host.numpy()
        offsets = np.cumsum([0, *(a.shape[0] for a in arrays)])
        for array, start, end in zip(arrays, offsets[:-1], offsets[1:]):
            host[start:end] = array  # widened to int64 where it is int32
        used = int(offsets[-1])
        # Non-blocking from pinned memory: the copy is queued on the stream, in order with
        # the step's kernels, and the host goes on preparing. The host buffer is reused by
        # the next step once the copy is done (the event).
        self.on_device[:used].copy_(self.host[:used], non_blocking=True)
        if self.on_device.device.type == "cuda":
            self._copied = torch.cuda.Event()
            self._copied.record()
        return StepTensors(*(self.on_device[s:e] for s, e in zip(offsets[:-1], offsets[1:])))
