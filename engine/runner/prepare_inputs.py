"""Index arithmetic that turns the persistent batch into one flat token batch.

Worked example (seed 002; block size 2, max_model_len 12, so 6 blocks per request):
three requests, nothing computed yet, scheduled 3, 2 and 5 tokens, block tables
[1, 2], [3] and [4, 5, 6].

    num_scheduled_tokens = [3, 2, 5]
    req_indices          = [0, 0, 0, 1, 1, 2, 2, 2, 2, 2]   which request owns each token
    cu_num_tokens        = [3, 5, 10]
    arange               = [0, 1, 2, 0, 1, 0, 1, 2, 3, 4]   index of the token in its request's chunk
    positions            = num_computed[req_indices] + arange = [0, 1, 2, 0, 1, 0, 1, 2, 3, 4]
    token_indices        = positions + req_indices * max_model_len   (into the flat token table)
    block_table_indices  = req_indices * 6 + positions // 2 = [0, 0, 1, 6, 6, 12, 12, 13, 13, 14]
    block_numbers        = block_table.flat[block_table_indices] = [1, 1, 2, 3, 3, 4, 4, 5, 5, 6]
    block_offsets        = positions % 2 = [0, 1, 0, 0, 1, 0, 1, 0, 1, 0]
    slot_mapping         = block_numbers * 2 + block_offsets = [2, 3, 4, 6, 7, 8, 9, 10, 11, 12]
    query_start_loc      = [0, 3, 5, 10]
    seq_lens             = num_computed + num_scheduled = [3, 2, 5]
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class PreparedInputs:
    """Host arrays of one step's flat batch (views into the runner's buffers)."""

    req_indices: np.ndarray  # (num_tokens,) row of the request each token belongs to
    cu_num_tokens: np.ndarray  # (num_reqs,) running total of scheduled tokens
    arange: np.ndarray  # (num_tokens,) index of each token within its request's chunk
    positions: np.ndarray  # (num_tokens,) position of each token in its sequence
    token_indices: np.ndarray  # (num_tokens,) index into the flattened token-id table
    input_ids: np.ndarray  # (num_tokens,)
    block_table_indices: np.ndarray  # (num_tokens,) index into the flattened block table
    block_numbers: np.ndarray  # (num_tokens,) physical block of each token
    block_offsets: np.ndarray  # (num_tokens,) offset of each token inside its block
    slot_mapping: np.ndarray  # (num_tokens,) block_number * block_size + offset
    query_start_loc: np.ndarray  # (num_reqs + 1,)
    seq_lens: np.ndarray  # (num_reqs,) computed + scheduled tokens
    max_query_len: int
    max_seq_len: int
    # Rows whose sequence is complete after this step (they sample a token), and the
    # flat index of their last token, whose logits are sampled.
    sampled_rows: np.ndarray
    logits_indices: np.ndarray


@dataclass
class InputBuffers:
    """Preallocated host arrays `prepare_inputs` writes into (sized for the largest step)."""

    arange: np.ndarray  # (max_num_tokens,) 0, 1, 2, ...
    positions: np.ndarray  # (max_num_tokens,) int64
    input_ids: np.ndarray  # (max_num_tokens,) int32, as the token-id table
    slot_mapping: np.ndarray  # (max_num_tokens,) int64
    query_start_loc: np.ndarray  # (max_num_reqs + 1,) int32
    seq_lens: np.ndarray  # (max_num_reqs,) int32

    @classmethod
    def allocate(cls, max_num_tokens: int, max_num_reqs: int) -> InputBuffers:
        return cls(
            arange=np.arange(max_num_tokens, dtype=np.int64),
            positions=np.zeros(max_num_tokens, dtype=np.int64),
            input_ids=np.zeros(max_num_tokens, dtype=np.int32),
            slot_mapping=np.zeros(max_num_tokens, dtype=np.int64),
            query_start_loc=np.zeros(max_num_reqs + 1, dtype=np.int32),
            seq_lens=np.zeros(max_num_reqs, dtype=np.int32),
        )


def prepare_inputs(
    num_scheduled_tokens: np.ndarray,  # (num_reqs,) per batch row
    num_computed_tokens: np.ndarray,  # (>= num_reqs,) per batch row, before this step
    num_tokens: np.ndarray,  # (>= num_reqs,) known tokens of each row (prompt + outputs)
    token_ids: np.ndarray,  # (max_num_reqs, max_model_len) token-id table
    block_table: np.ndarray,  # (max_num_reqs, max_num_blocks_per_req) block table
    block_size: int,
    buffers: InputBuffers,
) -> PreparedInputs:
    """Computes every per-token and per-request array of one step without a token loop."""
    num_reqs = num_scheduled_tokens.shape[0]
    max_model_len = token_ids.shape[1]
    max_blocks = block_table.shape[1]
    total = int(num_scheduled_tokens.sum())

    req_indices = np.repeat(np.arange(num_reqs), num_scheduled_tokens)
    cu_num_tokens = np.cumsum(num_scheduled_tokens)
    # Batched arange: 0..n-1 for every request, from one global arange minus each
    # request's starting offset.
    arange = buffers.arange[:total] - np.repeat(cu_num_tokens - num_scheduled_tokens,
                                                num_scheduled_tokens)
    positions = buffers.positions[:total]
    np.add(num_computed_tokens[req_indices], arange, out=positions)

    token_indices = positions + req_indices * max_model_len
    input_ids = buffers.input_ids[:total]
    np.take(token_ids.ravel(), token_indices, out=input_ids)

    block_table_indices = req_indices * max_blocks + positions // block_size
    block_numbers = block_table.ravel()[block_table_indices]
    block_offsets = positions % block_size
    slot_mapping = buffers.slot_mapping[:total]
    np.add(block_numbers * block_size, block_offsets, out=slot_mapping)

    query_start_loc = buffers.query_start_loc[: num_reqs + 1]
    query_start_loc[0] = 0
    query_start_loc[1:] = cu_num_tokens
    seq_lens = buffers.seq_lens[:num_reqs]
    np.add(num_computed_tokens[:num_reqs], num_scheduled_tokens, out=seq_lens)

    sampled_rows = np.flatnonzero(seq_lens >= num_tokens[:num_reqs])
    return PreparedInputs(
        req_indices=req_indices,
        cu_num_tokens=cu_num_tokens,
        arange=arange,
        positions=positions,
        token_indices=token_indices,
        input_ids=input_ids,
        block_table_indices=block_table_indices,
        block_numbers=block_numbers,
        block_offsets=block_offsets,
        slot_mapping=slot_mapping,
        query_start_loc=query_start_loc,
        seq_lens=seq_lens,
        max_query_len=int(num_scheduled_tokens.max()) if num_reqs else 0,
        max_seq_len=int(seq_lens.max()) if num_reqs else 0,
        sampled_rows=sampled_rows,
        logits_indices=cu_num_tokens[sampled_rows] - 1,
    )
