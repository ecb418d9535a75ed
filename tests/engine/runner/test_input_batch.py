"""InputBatch: dense rows that move together with their tokens, blocks and counts."""

import numpy as np
import pytest
import torch
from kvferry.engine.runner.input_batch import CachedRequestState, InputBatch
from kvferry.engine.sampling_params import SamplingParams

MAX_MODEL_LEN = 16
BLOCK_SIZE = 4


def make_batch(max_num_reqs: int = 4) -> InputBatch:
    return InputBatch(max_num_reqs, MAX_MODEL_LEN, BLOCK_SIZE, torch.device("cpu"))


def make_state(
    req_id: str,
    prompt_token_ids: list[int],
    block_ids: list[int],
    output_token_ids: list[int] | None = None,
    num_computed_tokens: int = 0,
) -> CachedRequestState:
    return CachedRequestState(
        req_id=req_id,
        prompt_token_ids=prompt_token_ids,
        sampling_params=SamplingParams(),
        output_token_ids=output_token_ids or [],
        block_ids=list(block_ids),
        num_computed_tokens=num_computed_tokens,
    )


def row_view(batch: InputBatch, row: int) -> tuple:
    """(req_id, tokens, block ids, num_tokens, num_prompt_tokens, num_computed, num_blocks)."""
    n = int(batch.num_tokens[row])
    nb = int(batch.num_blocks[row])
    return (
        batch.req_ids[row],
        batch.token_ids.np[row, :n].tolist(),
        batch.block_table.np[row, :nb].tolist(),
        n,
        int(batch.num_prompt_tokens[row]),
        int(batch.num_computed_tokens[row]),
        nb,
    )


def fill(batch: InputBatch, n: int) -> None:
    """Rows r0..r{n-1}: row i has prompt [10i+1, 10i+2, 10i+3], blocks [i+1] and 1 computed."""
    for i in range(n):
        prompt = [10 * i + 1, 10 * i + 2, 10 * i + 3]
        assert batch.add_request(make_state(f"r{i}", prompt, [i + 1], num_computed_tokens=1)) == i


def test_block_table_width_covers_max_model_len() -> None:
    batch = InputBatch(2, 10, 4, torch.device("cpu"))
    assert batch.max_num_blocks_per_req == 3
    assert tuple(batch.block_table.np.shape) == (2, 3)
    assert tuple(batch.token_ids.np.shape) == (2, 10)


def test_add_request_writes_the_next_row() -> None:
    batch = make_batch()
    state = make_state("a", [5, 6, 7], [3, 9], output_token_ids=[8], num_computed_tokens=3)
    assert batch.add_request(state) == 0
    assert batch.add_request(make_state("b", [1, 2], [4])) == 1
    assert batch.num_reqs == 2
    assert batch.active_req_ids == ["a", "b"]
    assert batch.req_id_to_index == {"a": 0, "b": 1}
    assert row_view(batch, 0) == ("a", [5, 6, 7, 8], [3, 9], 4, 3, 3, 2)
    assert row_view(batch, 1) == ("b", [1, 2], [4], 2, 2, 0, 1)
    assert batch.block_table.np[0].tolist() == [3, 9, 0, 0]
    assert batch.states[0] is state
    assert state.block_ids == [3, 9]  # not duplicated by the write


def test_add_request_to_a_full_batch_raises() -> None:
    batch = make_batch(max_num_reqs=2)
    fill(batch, 2)
    with pytest.raises(RuntimeError, match="input batch is full \\(2 rows\\)"):
        batch.add_request(make_state("x", [1], [1]))


def test_removing_a_middle_row_moves_the_last_row_into_the_hole() -> None:
    batch = make_batch()
    fill(batch, 4)
    batch.append_block_ids(3, [8, 9])
    moved = batch.states[3]
    batch.remove_requests({"r1"})
    assert batch.num_reqs == 3
    assert batch.active_req_ids == ["r0", "r3", "r2"]
    assert batch.req_id_to_index == {"r0": 0, "r3": 1, "r2": 2}
    assert row_view(batch, 1) == ("r3", [31, 32, 33], [4, 8, 9], 3, 3, 1, 3)
    assert row_view(batch, 0) == ("r0", [1, 2, 3], [1], 3, 3, 1, 1)
    assert row_view(batch, 2) == ("r2", [21, 22, 23], [3], 3, 3, 1, 1)
    assert batch.states[1] is moved
    assert batch.states[3] is None
    assert batch.req_ids[3] is None


def test_moved_row_clears_stale_block_ids_of_the_hole() -> None:
    batch = make_batch()
    batch.add_request(make_state("long", [1, 2, 3], [5, 6, 7, 8]))
    batch.add_request(make_state("short", [4], [9]))
    batch.remove_requests(["long"])
    assert batch.block_table.np[0].tolist() == [9, 0, 0, 0]
    assert row_view(batch, 0) == ("short", [4], [9], 1, 1, 0, 1)


def test_removing_several_rows_fills_holes_from_the_end() -> None:
    batch = make_batch()
    fill(batch, 4)
    batch.remove_requests({"r0", "r2"})
    assert batch.active_req_ids == ["r3", "r1"]
    assert batch.req_id_to_index == {"r3": 0, "r1": 1}
    assert row_view(batch, 0) == ("r3", [31, 32, 33], [4], 3, 3, 1, 1)
    assert row_view(batch, 1) == ("r1", [11, 12, 13], [2], 3, 3, 1, 1)


def test_removing_the_last_rows_moves_nothing() -> None:
    batch = make_batch()
    fill(batch, 4)
    batch.remove_requests(["r3", "r2"])
    assert batch.active_req_ids == ["r0", "r1"]
    assert batch.req_id_to_index == {"r0": 0, "r1": 1}
    assert row_view(batch, 1) == ("r1", [11, 12, 13], [2], 3, 3, 1, 1)


def test_removing_a_hole_and_the_last_row_together() -> None:
    batch = make_batch()
    fill(batch, 4)
    batch.remove_requests({"r1", "r3"})
    assert batch.active_req_ids == ["r0", "r2"]
    assert batch.req_id_to_index == {"r0": 0, "r2": 1}
    assert row_view(batch, 1) == ("r2", [21, 22, 23], [3], 3, 3, 1, 1)


def test_removing_every_row_and_unknown_ids() -> None:
    batch = make_batch()
    fill(batch, 3)
    batch.remove_requests({"r0", "r1", "r2", "ghost"})
    assert batch.num_reqs == 0
    assert batch.active_req_ids == []
    assert batch.req_id_to_index == {}
    assert batch.add_request(make_state("new", [7], [6])) == 0


def test_a_row_added_after_a_removal_lands_after_the_dense_rows() -> None:
    batch = make_batch()
    fill(batch, 3)
    batch.remove_requests(["r0"])
    assert batch.add_request(make_state("new", [7, 7], [6])) == 2
    assert batch.active_req_ids == ["r2", "r1", "new"]
    assert row_view(batch, 2) == ("new", [7, 7], [6], 2, 2, 0, 1)


def test_append_block_ids_extends_the_table_and_the_state() -> None:
    batch = make_batch()
    state = make_state("a", [1, 2, 3, 4, 5], [2, 3])
    batch.add_request(state)
    batch.append_block_ids(0, [7])
    batch.append_block_ids(0, [])
    assert row_view(batch, 0)[2] == [2, 3, 7]
    assert batch.block_table.np[0].tolist() == [2, 3, 7, 0]
    assert state.block_ids == [2, 3, 7]


def test_append_token_extends_the_row_up_to_max_model_len() -> None:
    batch = make_batch()
    batch.add_request(make_state("a", list(range(1, 15)), [1, 2, 3, 4]))
    batch.append_token(0, 40)
    batch.append_token(0, 41)
    assert int(batch.num_tokens[0]) == MAX_MODEL_LEN
    assert batch.token_ids.np[0].tolist() == list(range(1, 15)) + [40, 41]
    batch.append_token(0, 42)  # no room left: ignored
    assert int(batch.num_tokens[0]) == MAX_MODEL_LEN
    assert batch.token_ids.np[0, -1] == 41
    assert int(batch.num_prompt_tokens[0]) == 14


def test_appended_tokens_move_with_their_row() -> None:
    batch = make_batch()
    fill(batch, 2)
    batch.append_token(1, 99)
    batch.remove_requests(["r0"])
    assert row_view(batch, 0) == ("r1", [11, 12, 13, 99], [2], 4, 3, 1, 1)


def _rebuilt(batch: InputBatch, live_computed: dict[str, int]) -> InputBatch:
    """A fresh batch holding the same requests in the same rows, built from their states."""
    fresh = InputBatch(batch.max_num_reqs, MAX_MODEL_LEN, BLOCK_SIZE, torch.device("cpu"))
    for req_id in batch.active_req_ids:
        state = batch.states[batch.req_id_to_index[req_id]]
        assert state is not None
        state.num_computed_tokens = live_computed[req_id]
        fresh.add_request(state)
    return fresh


@pytest.mark.parametrize("seed", range(6))
def test_incremental_updates_equal_a_rebuild(seed: int) -> None:
    """Random adds, removals, sampled tokens, new blocks and computed counts, applied as the
    runner applies them: after every step the dense arrays (the block table's padding
    included) equal those of a batch rebuilt from the requests' states."""
    rng = np.random.default_rng(seed)
    batch = make_batch(max_num_reqs=6)
    live_computed: dict[str, int] = {}
    next_id = 0
    for _ in range(120):
        op = rng.integers(4)
        if op == 0 and batch.num_reqs < batch.max_num_reqs:
            prompt = rng.integers(1, 1000, size=rng.integers(1, 9)).tolist()
            blocks = rng.integers(1, 99, size=-(-len(prompt) // BLOCK_SIZE)).tolist()
            computed = int(rng.integers(0, len(prompt) + 1))
            batch.add_request(make_state(f"r{next_id}", prompt, blocks, num_computed_tokens=computed))
            live_computed[f"r{next_id}"] = computed
            next_id += 1
        elif op == 1 and batch.num_reqs:
            gone = rng.choice(batch.active_req_ids, size=rng.integers(1, batch.num_reqs + 1),
                              replace=False).tolist()
            batch.remove_requests(set(gone))
        elif op == 2 and batch.num_reqs:
            rows = np.flatnonzero(rng.random(batch.num_reqs) < 0.6)
            tokens = rng.integers(1, 1000, size=rows.size)
            for row, token in zip(rows, tokens):  # the runner records each in its state too
                if batch.num_tokens[row] < MAX_MODEL_LEN:
                    batch.states[row].output_token_ids.append(int(token))
            batch.append_tokens(rows, tokens)
            for row in range(batch.num_reqs):
                room = -(-int(batch.num_tokens[row]) // BLOCK_SIZE) - int(batch.num_blocks[row])
                if room > 0:
                    batch.append_block_ids(row, rng.integers(1, 99, size=room).tolist())
        elif op == 3 and batch.num_reqs:
            row = int(rng.integers(batch.num_reqs))
            computed = int(rng.integers(0, batch.num_tokens[row] + 1))
            batch.num_computed_tokens[row] = computed
            live_computed[batch.req_ids[row]] = computed
        fresh = _rebuilt(batch, live_computed)
        n = batch.num_reqs
        assert fresh.num_reqs == n and fresh.active_req_ids == batch.active_req_ids
        assert [row_view(batch, r) for r in range(n)] == [row_view(fresh, r) for r in range(n)]
        assert np.array_equal(batch.block_table.np[:n], fresh.block_table.np[:n])


def test_rows_of_prompt_embeddings_are_tracked_through_moves() -> None:
    """Which rows still compute prompt positions given as embeddings: counted, moved with
    their rows, and empty (no work at all) when no row has embeddings."""
    batch = make_batch()
    fill(batch, 2)  # r0, r1: token prompts
    assert batch.prompt_embeds_rows(2).tolist() == []
    embeds = make_state("e", [0, 0, 0, 0], [9], num_computed_tokens=2)
    embeds.prompt_embeds = torch.zeros(4, 8)
    assert batch.add_request(embeds) == 2
    done = make_state("d", [0, 0], [8], output_token_ids=[5], num_computed_tokens=2)
    done.prompt_embeds = torch.zeros(2, 8)
    assert batch.add_request(done) == 3
    assert batch.num_prompt_embeds_rows == 2
    # "d" has computed its whole prompt: its next input is its sampled token.
    assert batch.prompt_embeds_rows(4).tolist() == [2]
    batch.remove_requests(["r0"])  # "d" moves into row 0
    assert batch.req_ids[:3] == ["d", "r1", "e"]
    assert batch.has_prompt_embeds[:4].tolist() == [True, False, True, False]
    assert batch.prompt_embeds_rows(3).tolist() == [2]
    batch.remove_requests(["e", "d"])
    assert batch.num_prompt_embeds_rows == 0
    assert batch.prompt_embeds_rows(1).tolist() == []
