"""The model runner of one pipeline stage, in its worker process.

A `StageRunner` is a `ModelRunner` whose model holds the stage's layers and whose KV cache
holds just their keys and values (blocks outermost, so a block is still one region per
stage). Every stage keeps the whole persistent batch (rows, block tables, positions) and
applies each microbatch's scheduler diff to it in the same order, so every stage computes
the same positions and slots; only the model pass differs:

- stage 0 embeds the tokens (or reads prompt embeddings), runs its layers and sends
  `(hidden_states, residual)` to stage 1 (p2p.py);
- a middle stage receives, runs its layers, sends;
- the last stage receives, runs its layers and the final norm, computes logits and
  samples, and records the sampled tokens in its batch as the single-process runner does.

The stages before the last learn the sampled tokens from the core: each `StepRequest`
carries the tokens sampled since they last heard (`apply_new_tokens`). A decode is in at
most one microbatch in flight, so its token is always known before the microbatch that
reads it is submitted.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.distributed as dist
from kvferry.engine.attention import AttentionMetadata
from kvferry.engine.config import CacheConfig
from kvferry.engine.core.scheduler_output import ModelRunnerOutput
from kvferry.engine.executor.messages import StepRequest
from kvferry.engine.executor.p2p import StageLink, StagesOutOfStep, UpstreamStepFailed
from kvferry.engine.executor.partition import PipelineStage
from kvferry.engine.layers.tensor_parallel import TensorParallel
from kvferry.engine.models.config import ModelArchConfig
from kvferry.engine.runner.async_output import ForwardPass
from kvferry.engine.runner.model_runner import ModelRunner
from kvferry.engine.runner.prepare_inputs import PreparedInputs
from kvferry.engine.runner.step_staging import StepTensors
from kvferry.engine.sample.sampler import SamplerOutput

if TYPE_CHECKING:
    from kvferry.engine.structured_output.manager import GrammarBitmask

logger = logging.getLogger(__name__)


class StageStepFailed(Exception):
    """A microbatch failed on stage `origin` (this one or an earlier one)."""

    def __init__(self, origin: int, message: str) -> None:
        super().__init__(message)
        self.origin = origin
        self.message = message


class RanksStepFailed(Exception):
    """A step failed on every tensor-parallel rank of this stage at the same point (rank 0's
    sampling, whose failure it broadcasts): the ranks are still in step, the step alone
    fails."""


class TensorParallelRankFailed(RuntimeError):
    """A step failed on one tensor-parallel rank by itself: the stage's other ranks may be
    waiting in a collective this rank skipped, and their next collectives would pair with
    the wrong ones. Fatal for the stage (the executor then stops every rank)."""


class StageRunner(ModelRunner):
    """Runs one pipeline stage's share of each microbatch."""

    def __init__(
        self,
        model_dir: Path,
        arch: ModelArchConfig,
        dtype: torch.dtype,
        device: torch.device,
        cache: CacheConfig,
        stage: PipelineStage,
        link: StageLink,
        *,
        max_num_reqs: int,
        max_model_len: int,
        max_num_batched_tokens: int,
        attention_backend: str = "auto",
        tp: TensorParallel | None = None,
    ) -> None:
        super().__init__(model_dir, arch, dtype, device, cache, max_num_reqs=max_num_reqs,
                         max_model_len=max_model_len,
                         max_num_batched_tokens=max_num_batched_tokens,
                         attention_backend=attention_backend, stage=stage, tp=tp)
        self.pipeline_stage = stage
        self.link = link
        # The microbatch being computed, and whether its input was received and its
        # output (or failure) sent: a failing step still does both, once.
        self._step_id = -1
        self._received = False
        self._sent = False
        # Seconds the step being computed waited for the previous stage's output.
        self.recv_wait_s = 0.0

    def execute_stage(self, request: StepRequest,
                      grammar_bitmask: GrammarBitmask | None = None) -> ModelRunnerOutput:
        """Runs this stage's part of one microbatch; on the last stage returns its sampled
        tokens (an empty output elsewhere). Raises StageStepFailed when it failed here or
        upstream, after passing the failure on; StagesOutOfStep (fatal) as it comes; with
        tensor parallelism, TensorParallelRankFailed (fatal) for an error of this rank's
        own."""
        scheduler_output = request.scheduler_output
        self._step_id, self._received, self._sent = request.step_id, False, False
        self.recv_wait_s = 0.0
        try:
            self.apply_new_tokens(request.new_token_ids)
            return self.execute_model(scheduler_output, grammar_bitmask)
        except StagesOutOfStep:
            raise
        except UpstreamStepFailed as exc:
            self._received = True
            failure = StageStepFailed(exc.origin, exc.message)
        except RanksStepFailed as exc:
            failure = StageStepFailed(self.pipeline_stage.index, str(exc))
        except Exception as exc:  # any error fails the step; the stage goes on
            if self.tp.size > 1:
                raise TensorParallelRankFailed(
                    f"tensor-parallel rank {self.tp.rank} of pipeline stage "
                    f"{self.pipeline_stage.index} failed microbatch {request.step_id} by "
                    f"itself ({type(exc).__name__}: {exc}); its ranks cannot stay in step"
                ) from exc
            logger.exception("pipeline stage %d failed microbatch %d",
                             self.pipeline_stage.index, request.step_id)
            failure = StageStepFailed(self.pipeline_stage.index, f"{type(exc).__name__}: {exc}")
        if scheduler_output.total_num_scheduled_tokens:
            self._pass_failure_on(failure)
        raise failure

    def apply_new_tokens(self, new_token_ids: dict[str, list[int]]) -> None:
        """Records tokens the last stage sampled (stages before it only): in each known
        request's state, and in its row when it has one (its next input)."""
        if self.pipeline_stage.is_last or not new_token_ids:
            return
        batch = self.input_batch
        rows: list[list[int]] = []
        tokens: list[list[int]] = []
        for req_id, token_ids in new_token_ids.items():
            state = self.requests.get(req_id)
            if state is None:
                continue  # finished or preempted meanwhile: nothing reads the token
            state.output_token_ids.extend(token_ids)
            row = batch.req_id_to_index.get(req_id)
            if row is None:
                continue  # out of the batch: the row is rebuilt from the state
            for i, token_id in enumerate(token_ids):
                if i == len(rows):
                    rows.append([])
                    tokens.append([])
                rows[i].append(row)
                tokens[i].append(token_id)
        # One vectorized append per round: a row's second token after its first.
        for round_rows, round_tokens in zip(rows, tokens):
            batch.append_tokens(np.asarray(round_rows), np.asarray(round_tokens))

    def _run_model(self, staged: StepTensors, prepared: PreparedInputs,
                   num_scheduled: np.ndarray, metadata: AttentionMetadata) -> torch.Tensor | None:
        stage = self.pipeline_stage
        if stage.is_first:
            out = super()._run_model(staged, prepared, num_scheduled, metadata)
        else:
            waiting_since = time.monotonic()
            intermediate = self.link.recv(self._step_id)
            self.recv_wait_s = time.monotonic() - waiting_since
            self._received = True
            out = self.model(None, staged.positions, self.kv_caches, metadata,
                             intermediate=intermediate)
        if stage.is_last:
            return out
        self.link.send(self._step_id, out)  # type: ignore[arg-type]
        self._sent = True
        return None

    def _sample(self, forward: ForwardPass,
                grammar_bitmask: GrammarBitmask | None) -> SamplerOutput:
        """With tensor parallelism, rank 0 samples (it alone is sent the grammar bitmask)
        and hands the tokens to the other ranks of the last stage, which record them in
        their batches as it does: every rank's next inputs are the same."""
        tp = self.tp
        if tp.size == 1:
            return super()._sample(forward, grammar_bitmask)
        num_rows = len(forward.rows)
        # [ok, token ids...]: a failed sample still reaches the other ranks, which fail
        # the step with it instead of waiting.
        message = torch.zeros(num_rows + 1, dtype=torch.int64, device=self.device)
        source = self.pipeline_stage.index * tp.size
        if tp.rank == 0:
            try:
                output = super()._sample(forward, grammar_bitmask)
            except Exception as exc:
                dist.broadcast(message, src=source, group=tp.group)
                raise RanksStepFailed(f"{type(exc).__name__}: {exc}") from exc
            message[0] = 1
            message[1:] = output.sampled_token_ids
            dist.broadcast(message, src=source, group=tp.group)
            return output
        dist.broadcast(message, src=source, group=tp.group)
        if not int(message[0]):
            raise RanksStepFailed(f"sampling failed on tensor-parallel rank 0 of stage "
                                  f"{self.pipeline_stage.index}")
        return SamplerOutput(message[1:].clone(), None)

    def _pass_failure_on(self, failure: StageStepFailed) -> None:
        """A failed microbatch still takes its input from the previous stage and tells the
        next one, so both stay in step."""
        if not self._received and not self.pipeline_stage.is_first:
            try:
                self.link.recv(self._step_id)
            except UpstreamStepFailed:
                pass  # failed there too; this stage's failure is reported
            self._received = True
        if not self._sent and not self.pipeline_stage.is_last:
            self.link.send_failure(self._step_id, failure.origin, failure.message)
            self._sent = True
