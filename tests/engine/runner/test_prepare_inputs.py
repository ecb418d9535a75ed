"""Seeds 002 and 003's worked examples, reproduced number for number."""

import numpy as np
from kvferry.engine.runner.prepare_inputs import InputBuffers, prepare_inputs


def _block_table(rows: list[list[int]], max_num_reqs: int, max_blocks: int) -> np.ndarray:
    table = np.zeros((max_num_reqs, max_blocks), dtype=np.int32)
    for i, row in enumerate(rows):
        table[i, : len(row)] = row
    return table


def test_seed_002_step_1_block_size_2() -> None:
    max_model_len, block_size = 12, 2
    token_ids = np.arange(4 * max_model_len, dtype=np.int32).reshape(4, max_model_len) + 100
    block_table = _block_table([[1, 2], [3], [4, 5, 6]], 4, max_model_len // block_size)
    prepared = prepare_inputs(
        num_scheduled_tokens=np.array([3, 2, 5]),
        num_computed_tokens=np.array([0, 0, 0, 0], dtype=np.int32),
        num_tokens=np.array([3, 2, 8, 0]),  # request 2 has 3 prompt tokens left for later
        token_ids=token_ids,
        block_table=block_table,
        block_size=block_size,
        buffers=InputBuffers.allocate(16, 4),
    )
    assert prepared.req_indices.tolist() == [0, 0, 0, 1, 1, 2, 2, 2, 2, 2]
    assert prepared.positions.tolist() == [0, 1, 2, 0, 1, 0, 1, 2, 3, 4]
    assert prepared.block_table_indices.tolist() == [0, 0, 1, 6, 6, 12, 12, 13, 13, 14]
    assert prepared.block_numbers.tolist() == [1, 1, 2, 3, 3, 4, 4, 5, 5, 6]
    assert prepared.block_offsets.tolist() == [0, 1, 0, 0, 1, 0, 1, 0, 1, 0]
    assert prepared.slot_mapping.tolist() == [2, 3, 4, 6, 7, 8, 9, 10, 11, 12]
    assert prepared.query_start_loc.tolist() == [0, 3, 5, 10]
    assert prepared.seq_lens.tolist() == [3, 2, 5]
    assert prepared.max_query_len == 5
    assert prepared.input_ids.tolist() == [100, 101, 102, 112, 113, 124, 125, 126, 127, 128]
    # Request 2 is mid-prefill: only requests 0 and 1 sample, from their last tokens.
    assert prepared.sampled_rows.tolist() == [0, 1]
    assert prepared.logits_indices.tolist() == [2, 4]


def test_seed_003_mixed_decode_prefill_and_chunked_prefill() -> None:
    max_model_len, block_size, max_num_reqs = 240, 16, 8
    max_blocks = -(-max_model_len // block_size)
    assert max_blocks == 15
    block_table = _block_table(
        [
            [1, 2, 3, 4],
            [5, 6, 7, 8, 9, 10, 11, 12, 13, 14],
            [15, 16, 17, 18, 19, 20],
            [21, 22, 23, 24, 25],
            [26, 27],
        ],
        max_num_reqs,
        max_blocks,
    )
    rng = np.random.default_rng(0)
    token_ids = rng.integers(0, 32000, size=(max_num_reqs, max_model_len), dtype=np.int32)
    num_scheduled = np.array([1, 1, 93, 75, 30])
    num_computed = np.zeros(max_num_reqs, dtype=np.int32)
    num_computed[:5] = [54, 145, 0, 0, 0]
    num_tokens = np.zeros(max_num_reqs, dtype=np.int64)
    num_tokens[:5] = [55, 146, 93, 75, 50]  # request 4 is a chunked prefill
    prepared = prepare_inputs(
        num_scheduled, num_computed, num_tokens, token_ids, block_table, block_size,
        InputBuffers.allocate(256, max_num_reqs),
    )
    assert prepared.req_indices.tolist() == [0, 1] + [2] * 93 + [3] * 75 + [4] * 30
    assert prepared.cu_num_tokens.tolist() == [1, 2, 95, 170, 200]
    assert prepared.arange.tolist() == [0, 0, *range(93), *range(75), *range(30)]
    assert prepared.positions.tolist() == [54, 145, *range(93), *range(75), *range(30)]
    m = max_model_len
    assert prepared.token_indices[:4].tolist() == [54, 145 + m, 2 * m, 1 + 2 * m]
    assert prepared.token_indices[-1] == 29 + 4 * m
    assert prepared.input_ids.tolist() == token_ids.ravel()[prepared.token_indices].tolist()
    bti = prepared.block_table_indices
    assert bti[:4].tolist() == [3, 24, 30, 30]
    assert (bti[94], bti[95], bti[169], bti[170], bti[199]) == (35, 45, 49, 60, 61)
    assert prepared.block_numbers[:3].tolist() == [4, 14, 15]
    assert (prepared.block_numbers[94], prepared.block_numbers[169]) == (20, 25)
    assert prepared.block_numbers[-1] == 27
    assert prepared.block_offsets[:4].tolist() == [6, 1, 0, 1]
    assert (prepared.block_offsets[94], prepared.block_offsets[169]) == (12, 10)
    assert prepared.block_offsets[-1] == 13
    slots = prepared.slot_mapping
    assert slots[:4].tolist() == [70, 225, 240, 241]
    assert (slots[94], slots[95], slots[96], slots[169]) == (332, 336, 337, 410)
    assert (slots[170], slots[171], slots[199]) == (416, 417, 445)
    assert prepared.query_start_loc.tolist() == [0, 1, 2, 95, 170, 200]
    assert prepared.seq_lens.tolist() == [55, 146, 93, 75, 30]
    assert prepared.max_query_len == 93
    assert prepared.max_seq_len == 146
    assert prepared.sampled_rows.tolist() == [0, 1, 2, 3]
    assert prepared.logits_indices.tolist() == [0, 1, 94, 169]
