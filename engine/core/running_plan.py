"""The common scheduling step for running requests, planned with NumPy in one pass.

Each running request wants its known tokens not yet computed (never past `max_model_len`:
a full sequence's last token is not fed); the budget serves them in running order.
Requests whose tokens cross into new blocks get them in one allocation, all or nothing.
When the pool cannot serve them all, the plan gives up and the scheduler's slow pass,
which can preempt, takes over.

With async scheduling a request's known tokens include its output placeholders (tokens
the steps in flight are sampling), and a request whose placeholder reaches its length cap
is not scheduled: that token ends it, so nothing after it would be kept.
"""

from __future__ import annotations

from operator import attrgetter

import numpy as np
from kvferry.engine.core.kv_cache import KVCacheManager
from kvferry.engine.core.request import Request
from kvferry.engine.core.step_budget import StepBudget

request_id = attrgetter("request_id")
_num_computed_tokens = attrgetter("num_computed_tokens")
_all_token_ids = attrgetter("all_token_ids")
_num_output_placeholders = attrgetter("num_output_placeholders")
_output_token_ids = attrgetter("output_token_ids")
_max_output_tokens = attrgetter("max_output_tokens")


def plan_running(
    running: list[Request], manager: KVCacheManager, max_model_len: int, budget: StepBudget,
    placeholders: bool = False,
) -> list[Request] | None:
    """Takes the running requests' tokens from the budget; None if blocks ran out.

    `placeholders`: count output placeholders as known tokens (async scheduling)."""
    num = len(running)
    if num == 0:
        return []
    # map() with C-level getters: these run every step over every running request.
    computed = np.fromiter(map(_num_computed_tokens, running), np.int64, num)
    known = np.fromiter(map(len, map(_all_token_ids, running)), np.int64, num)
    if placeholders:
        known = known_with_placeholders(running, known)
    wanted = np.maximum(np.minimum(known, max_model_len) - computed, 0)
    num_new = np.clip(budget.tokens - (np.cumsum(wanted) - wanted), 0, wanted)
    ends = computed + num_new
    req_ids = list(map(request_id, running))
    grow = np.flatnonzero(ends > manager.num_slots(req_ids))
    if grow.size:
        growing = [running[i] for i in grow.tolist()]
        new_block_ids = manager.allocate_running_slots(growing, ends[grow].tolist())
        if new_block_ids is None:
            return None
        budget.new_block_ids.update(zip(map(request_id, growing), new_block_ids))
    if manager.enable_caching:
        block_size = manager.block_size
        filling = np.flatnonzero(ends // block_size > computed // block_size)
        budget.filling.update((running[i].request_id, running[i]) for i in filling.tolist())
    rows = np.flatnonzero(num_new)
    if rows.size == num:
        # A copy: admitting waiting requests appends to the scheduler's running list.
        scheduled, scheduled_ids = list(running), req_ids
    else:
        scheduled = [running[i] for i in rows.tolist()]
        scheduled_ids = list(map(request_id, scheduled))
    budget.take_many(scheduled, scheduled_ids, num_new[rows].tolist())
    return scheduled


def known_with_placeholders(running: list[Request], known: np.ndarray) -> np.ndarray:
    """(len(running),) known tokens counting output placeholders; 0 for a request whose
    placeholder reaches its length cap (nothing to schedule: see the module docstring)."""
    num = len(running)
    pending = np.fromiter(map(_num_output_placeholders, running), np.int64, num)
    if not pending.any():
        return known
    outputs = np.fromiter(map(len, map(_output_token_ids, running)), np.int64, num)
    caps = np.fromiter(map(_max_output_tokens, running), np.int64, num)
    capped = (pending > 0) & (outputs + pending >= caps)
    return np.where(capped, 0, known + pending)
