"""Stage to stage: the hidden states and the residual of a microbatch, by point-to-point
send/recv over torch.distributed (gloo on CPU, NCCL on GPUs).

Per microbatch that computes tokens, stage s sends stage s + 1 exactly one message, in
step order, and stage s + 1 receives exactly one:

    header  (4,) int64: [step_id, kind, n, origin]
    payload kind TENSORS: (2, n, hidden_size) in the model's dtype: hidden states, residual
            kind FAILED:  (n,) uint8: the UTF-8 error text of stage `origin`

A stage whose step fails still receives its input and still sends a message (FAILED,
naming the stage where it began), so no stage waits for a microbatch that never comes
and the next microbatch's tensors are never read as this one's. The step id in the header
is checked: a mismatch means the stages disagree about the order of microbatches, which
nothing can repair.

Sends are asynchronous (`isend`): a stage hands its output on and starts its next
microbatch while the next stage receives; the tensors stay referenced until sent.
"""

from __future__ import annotations

from collections import deque

import torch
import torch.distributed as dist
from kvferry.engine.executor.partition import PipelineStage
from kvferry.engine.layers.tensor_parallel import TensorParallel

# Header kinds.
TENSORS = 0
FAILED = 1
_HEADER_SIZE = 4
# Sends a stage keeps in flight before it waits for the oldest (each holds its tensors).
MAX_PENDING_SENDS = 16

IntermediateTensors = tuple[torch.Tensor, torch.Tensor]


class UpstreamStepFailed(Exception):
    """An earlier stage failed this microbatch (its message names it)."""

    def __init__(self, origin: int, message: str) -> None:
        super().__init__(message)
        self.origin = origin
        self.message = message


class StagesOutOfStep(RuntimeError):
    """A stage received another microbatch than the one it is computing."""


class StageLink:
    """One stage's channels to the stage before it and the stage after it."""

    def __init__(self, stage: PipelineStage, hidden_size: int, dtype: torch.dtype,
                 device: torch.device, tp: TensorParallel | None = None) -> None:
        self.stage = stage
        self.hidden_size = hidden_size
        self.dtype = dtype
        self.device = device
        # Rank of (stage s, tensor-parallel rank t): s * T + t. Every tensor-parallel rank
        # holds the whole hidden states (after its layers' all-reduce), so rank t talks to
        # rank t of the stages on either side.
        tp = tp or TensorParallel()
        rank = stage.index * tp.size + tp.rank
        self.prev_rank = None if stage.is_first else rank - tp.size
        self.next_rank = None if stage.is_last else rank + tp.size
        self._pending: deque[tuple[dist.Work, tuple[torch.Tensor, ...]]] = deque()

    # ------------------------------------------------------------------ receive
    def recv(self, step_id: int) -> IntermediateTensors:
        """The previous stage's output of microbatch `step_id`; UpstreamStepFailed when it
        failed there."""
        assert self.prev_rank is not None, "the first stage receives nothing"
        header = torch.empty(_HEADER_SIZE, dtype=torch.int64, device=self.device)
        dist.recv(header, src=self.prev_rank)
        got_step, kind, size, origin = header.tolist()
        if got_step != step_id:
            raise StagesOutOfStep(
                f"pipeline stage {self.stage.index} computes microbatch {step_id} but stage "
                f"{self.prev_rank} sent microbatch {got_step}")
        if kind == FAILED:
            text = torch.empty(size, dtype=torch.uint8, device=self.device)
            dist.recv(text, src=self.prev_rank)
            raise UpstreamStepFailed(origin, bytes(text.cpu().tolist()).decode("utf-8", "replace"))
        if kind != TENSORS:
            raise StagesOutOfStep(f"pipeline stage {self.stage.index} got a message of "
                                  f"unknown kind {kind} from stage {self.prev_rank}")
        # (2, num_tokens, hidden_size): hidden states, residual
        payload = torch.empty((2, size, self.hidden_size), dtype=self.dtype, device=self.device)
        dist.recv(payload, src=self.prev_rank)
        return payload[0], payload[1]

    # ------------------------------------------------------------------ send
    def send(self, step_id: int, intermediate: IntermediateTensors) -> None:
        """Hands microbatch `step_id`'s output to the next stage without waiting."""
        hidden, residual = intermediate
        payload = torch.stack([hidden, residual])  # (2, num_tokens, hidden_size)
        self._send(self._header(step_id, TENSORS, hidden.shape[0], self.stage.index), payload)

    def send_failure(self, step_id: int, origin: int, message: str) -> None:
        """Tells the next stage that microbatch `step_id` failed on stage `origin`."""
        data = message.encode("utf-8")
        text = torch.tensor(list(data), dtype=torch.uint8, device=self.device)
        self._send(self._header(step_id, FAILED, len(data), origin), text)

    def wait_for_sends(self) -> None:
        """Blocks until every send has left (before the process group goes away)."""
        while self._pending:
            self._pending.popleft()[0].wait()

    def _header(self, step_id: int, kind: int, size: int, origin: int) -> torch.Tensor:
        return torch.tensor([step_id, kind, size, origin], dtype=torch.int64, device=self.device)

    def _send(self, header: torch.Tensor, payload: torch.Tensor) -> None:
        assert self.next_rank is not None, "the last stage sends nothing"
        while self._pending and self._pending[0][0].is_completed():
            self._pending.popleft()
        if len(self._pending) >= MAX_PENDING_SENDS:
            self._pending.popleft()[0].wait()
        for tensor in (header, payload):
            work = dist.isend(tensor, dst=self.next_rank)
            self._pending.append((work, (tensor,)))
