"""The persistent input batch: one row per running request, kept across steps.

Rows live in preallocated CPU tensors with NumPy views (seed 003): the token-id table
(max_num_reqs x max_model_len), computed-token counts and the block table
(max_num_reqs x max_num_blocks_per_req). A step touches only what changed: new rows, new
block ids, freshly sampled tokens. When requests leave, the last rows move into the holes
so rows 0..num_reqs-1 stay dense.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
from kvferry.engine.runner.buffers import CpuGpuBuffer
from kvferry.engine.sampling_params import SamplingParams


@dataclass
class CachedRequestState:
    """The runner's copy of one request (survives leaving and re-entering the batch)."""

    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    output_token_ids: list[int]
    block_ids: list[int]
    # As of when the row was last (re)built; while in the batch, the row's count is live.
    num_computed_tokens: int
    # A prompt given as embeddings (num_prompt_tokens, hidden_size); prompt_token_ids then
    # holds placeholders. Forgotten with the state when the request finishes.
    prompt_embeds: torch.Tensor | None = None
    # Encoder-decoder models: the cross-attention block table and encoder positions.
    cross_block_ids: list[int] = field(default_factory=list)
    num_encoder_tokens: int = 0


class InputBatch:
    """Dense rows of the requests scheduled in a step."""

    def __init__(
        self, max_num_reqs: int, max_model_len: int, block_size: int, device: torch.device,
        max_encoder_len: int = 0,
    ) -> None:
        self.max_num_reqs = max_num_reqs
        self.max_model_len = max_model_len
        self.max_num_blocks_per_req = -(-max_model_len // block_size)
        self.token_ids = CpuGpuBuffer(max_num_reqs, max_model_len, dtype=torch.int32, device=device)
        # Known tokens per row (prompt + outputs) and prompt tokens per row.
        self.num_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.num_prompt_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.num_computed_tokens = np.zeros(max_num_reqs, dtype=np.int32)
        self.block_table = CpuGpuBuffer(
            max_num_reqs, self.max_num_blocks_per_req, dtype=torch.int32, device=device
        )
        self.num_blocks = np.zeros(max_num_reqs, dtype=np.int32)
        # Rows whose prompt is given as embeddings, and how many there are (0: every step
        # runs the plain token path without looking further).
        self.has_prompt_embeds = np.zeros(max_num_reqs, dtype=bool)
        self.num_prompt_embeds_rows = 0
        # Encoder-decoder models: each row's cross-attention block table (fixed while the
        # row lives) and encoder positions; None for a decoder-only model.
        self.cross_block_table: CpuGpuBuffer | None = None
        self.num_encoder_tokens = np.zeros(max_num_reqs, dtype=np.int32)
        if max_encoder_len:
            self.cross_block_table = CpuGpuBuffer(
                max_num_reqs, -(-max_encoder_len // block_size), dtype=torch.int32,
                device=device)
        self.req_ids: list[str | None] = [None] * max_num_reqs
        self.req_id_to_index: dict[str, int] = {}
        self.states: list[CachedRequestState | None] = [None] * max_num_reqs
        self.num_reqs = 0

    # ------------------------------------------------------------------ rows
    def add_request(self, state: CachedRequestState) -> int:
        """Writes a request into the first free row (the end of the dense rows)."""
        row = self.num_reqs
        if row >= self.max_num_reqs:
            raise RuntimeError(f"input batch is full ({self.max_num_reqs} rows)")
        tokens = state.prompt_token_ids + state.output_token_ids
        self.token_ids.np[row, : len(tokens)] = tokens
        self.num_tokens[row] = len(tokens)
        self.num_prompt_tokens[row] = len(state.prompt_token_ids)
        self.num_computed_tokens[row] = state.num_computed_tokens
        has_embeds = state.prompt_embeds is not None
        self.has_prompt_embeds[row] = has_embeds
        self.num_prompt_embeds_rows += has_embeds
        self.num_blocks[row] = 0
        self.block_table.np[row] = 0  # no block id of the row's previous occupant survives
        self.append_block_ids(row, state.block_ids, record=False)
        if self.cross_block_table is not None:
            cross = self.cross_block_table.np
            cross[row] = 0
            cross[row, : len(state.cross_block_ids)] = state.cross_block_ids
            self.num_encoder_tokens[row] = state.num_encoder_tokens
        self.req_ids[row] = state.req_id
        self.req_id_to_index[state.req_id] = row
        self.states[row] = state
        self.num_reqs += 1
        return row

    def remove_requests(self, req_ids: set[str] | list[str]) -> None:
        """Drops rows and moves the last rows into the holes, keeping rows dense."""
        holes = sorted(self.req_id_to_index.pop(r) for r in req_ids if r in self.req_id_to_index)
        for hole in holes:
            self.req_ids[hole] = None
            self.states[hole] = None
            self.num_prompt_embeds_rows -= bool(self.has_prompt_embeds[hole])
            self.has_prompt_embeds[hole] = False
        last = self.num_reqs - 1
        for hole in holes:
            while last > hole and self.req_ids[last] is None:
                last -= 1
            if last <= hole:
                break
            self._move_row(last, hole)
            last -= 1
        self.num_reqs -= len(holes)

    def _move_row(self, src: int, dst: int) -> None:
        n = int(self.num_tokens[src])
        self.token_ids.np[dst, :n] = self.token_ids.np[src, :n]
        nb = int(self.num_blocks[src])
        self.block_table.np[dst, :nb] = self.block_table.np[src, :nb]
        self.block_table.np[dst, nb:] = 0
        if self.cross_block_table is not None:
            self.cross_block_table.np[dst] = self.cross_block_table.np[src]
        for array in (self.num_tokens, self.num_prompt_tokens, self.num_computed_tokens,
                      self.num_blocks, self.has_prompt_embeds, self.num_encoder_tokens):
            array[dst] = array[src]
        self.has_prompt_embeds[src] = False
        req_id = self.req_ids[src]
        assert req_id is not None
        self.req_ids[dst], self.req_ids[src] = req_id, None
        self.states[dst], self.states[src] = self.states[src], None
        self.req_id_to_index[req_id] = dst

    # ------------------------------------------------------------------ updates
    def append_block_ids(self, row: int, block_ids: list[int], record: bool = True) -> None:
        """Appends to a row's block table (block tables are append-only)."""
        if not block_ids:
            return
        start = int(self.num_blocks[row])
        end = start + len(block_ids)
        self.block_table.np[row, start:end] = block_ids
        self.block_table.np[row, end:] = 0
        self.num_blocks[row] = end
        state = self.states[row]
        if record and state is not None:
            state.block_ids.extend(block_ids)

    def append_token(self, row: int, token_id: int) -> None:
        """Records one sampled token: it is the next step's input for this row."""
        self.append_tokens(np.array([row]), np.array([token_id]))

    def append_tokens(self, rows: np.ndarray, token_ids: np.ndarray) -> None:
        """Records sampled tokens of many rows (rows already at max_model_len skip it)."""
        num_tokens = self.num_tokens[rows]
        fits = num_tokens < self.max_model_len
        rows, num_tokens = rows[fits], num_tokens[fits]
        self.token_ids.np[rows, num_tokens] = token_ids[fits]
        self.num_tokens[rows] = num_tokens + 1

    def prompt_embeds_rows(self, num_reqs: int) -> np.ndarray:
        """Rows among the first `num_reqs` that still compute prompt positions given as
        embeddings (before this step's tokens are counted)."""
        if not self.num_prompt_embeds_rows:
            return np.empty(0, dtype=np.int64)
        in_prompt = self.num_computed_tokens[:num_reqs] < self.num_prompt_tokens[:num_reqs]
        return np.flatnonzero(self.has_prompt_embeds[:num_reqs] & in_prompt)

    @property
    def active_req_ids(self) -> list[str]:
        return self.req_ids[: self.num_reqs]  # type: ignore[return-value]
