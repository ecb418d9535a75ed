"""The scheduler and KV cache manager with encoder-decoder requests (seed 004).

A request's blocks are its cross-attention table (sized to its encoder input) plus its
self-attention table: allocated together, freed together on finish, abort and preemption.
Cross blocks are cached all or nothing under a hash of the encoder input, so requests with
the same input share them and skip the encoder. The test plays the runner.
"""

from __future__ import annotations

import numpy as np
import pytest
from kvferry.engine.config import SchedulerConfig
from kvferry.engine.core.kv_cache import KVCacheManager
from kvferry.engine.core.messages import EncoderInput, FinishReason
from kvferry.engine.core.request import Request, RequestStatus
from kvferry.engine.core.scheduler import Scheduler
from kvferry.engine.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from kvferry.engine.sampling_params import SamplingParams

from kvferry.protocol.block_hash import hash_cross_blocks, hash_request_blocks

BLOCK_SIZE = 4
EOS = 2
FILLER = 7


def make_scheduler(num_blocks: int = 64, enable_caching: bool = True,
                   **config: object) -> Scheduler:
    config.setdefault("max_model_len", 64)
    config.setdefault("max_num_batched_tokens", 64)
    config.setdefault("max_num_encoder_tokens", 64)
    manager = KVCacheManager(num_blocks, BLOCK_SIZE, enable_caching)
    return Scheduler(SchedulerConfig(**config), manager)  # type: ignore[arg-type]


def encdec_request(req_id: str, encoder_ids: list[int], decoder: list[int] | None = None,
                   encode_only: bool = False, **params: object) -> Request:
    encoder = EncoderInput(token_ids=encoder_ids)
    params.setdefault("max_tokens", 4)
    return Request(
        request_id=req_id,
        prompt_token_ids=decoder or [2, 0],
        sampling_params=SamplingParams(**params),  # type: ignore[arg-type]
        eos_token_ids=(EOS,),
        encoder=encoder,
        encoder_key=encoder.key(),
        cache_salt=encoder.key(),
        encode_only=encode_only,
    )


def run_step(scheduler: Scheduler, token: int = FILLER) -> tuple[SchedulerOutput, list]:
    """Schedules a step and plays the runner: every request whose prompt is done samples
    `token`."""
    output = scheduler.schedule()
    sampled = [
        req_id for req_id, n in output.num_scheduled_tokens.items()
        if scheduler.requests[req_id].num_computed_tokens >= scheduler.requests[req_id].num_tokens
    ]
    outputs = scheduler.update_from_output(
        output, ModelRunnerOutput(req_ids=sampled, sampled_token_ids=[token] * len(sampled)))
    return output, outputs


def encoded(output: SchedulerOutput) -> list[str]:
    return [work.req_id for work in output.scheduled_encoder_inputs]


def test_admission_takes_cross_and_self_blocks_and_finishing_frees_both() -> None:
    scheduler = make_scheduler()
    manager = scheduler.kv_cache_manager
    free = manager.num_free_blocks
    request = encdec_request("a", list(range(10, 23)), [2, 0, 5, 6, 9])  # 13 -> 4 cross blocks
    scheduler.add_request(request)
    output, _ = run_step(scheduler)
    cross = manager.get_cross_block_ids("a")
    assert len(cross) == 4 and encoded(output) == ["a"]
    assert output.scheduled_encoder_inputs[0].cross_block_ids == cross
    new = output.scheduled_new_reqs[0]
    assert new.cross_block_ids == cross and new.num_encoder_tokens == 13
    # Seed 004: (seq group blocks) = |cross table| + |self table|.
    assert manager.num_free_blocks == free - (len(cross) + len(manager.get_block_ids("a")))
    assert not set(cross) & set(manager.get_block_ids("a"))
    while request.status is RequestStatus.RUNNING:
        run_step(scheduler)
    assert request.status is RequestStatus.FINISHED_LENGTH_CAPPED
    assert manager.num_free_blocks == free
    assert not manager.req_to_cross_blocks


def test_the_same_encoder_input_shares_cross_blocks_and_skips_the_encoder() -> None:
    scheduler = make_scheduler()
    manager = scheduler.kv_cache_manager
    ids = list(range(30, 39))
    first, second = encdec_request("a", ids), encdec_request("b", ids, [2, 0, 11])
    scheduler.add_request(first)
    scheduler.add_request(second)
    output, _ = run_step(scheduler)
    # "b" waits one step for "a"'s encoder instead of running the same encoder again.
    assert encoded(output) == ["a"] and list(output.num_scheduled_tokens) == ["a"]
    output, _ = run_step(scheduler)
    assert encoded(output) == [] and "b" in output.num_scheduled_tokens
    assert manager.get_cross_block_ids("b") == manager.get_cross_block_ids("a")
    assert output.scheduled_new_reqs[0].cross_block_ids == manager.get_cross_block_ids("a")
    held = {b.block_id for t in manager.req_to_blocks.values() for b in t}
    held |= set(manager.get_cross_block_ids("a"))
    assert manager.num_free_blocks == manager.block_pool.num_blocks - 1 - len(held)
    # A different input never matches, even with the same decoder prompt.
    scheduler.add_request(encdec_request("c", list(range(40, 49))))
    output, _ = run_step(scheduler)
    assert encoded(output) == ["c"]
    assert not set(manager.get_cross_block_ids("c")) & set(manager.get_cross_block_ids("a"))


def test_cross_block_hashes_never_equal_decoder_block_hashes() -> None:
    encoder = EncoderInput(token_ids=[1, 2, 3, 4])
    cross = set(hash_cross_blocks(encoder.key(), 8))
    decoder = hash_request_blocks(list(range(32)), BLOCK_SIZE, [], encoder.key())
    assert len(cross) == 8 and not cross & set(decoder)
    audio = EncoderInput(features=bytes(16), num_mel_bins=2, num_frames=2)
    assert audio.key() != EncoderInput(features=bytes(16), num_mel_bins=1, num_frames=4).key()


def test_the_encoder_budget_spreads_a_burst_of_encoders_over_steps() -> None:
    scheduler = make_scheduler(max_num_encoder_tokens=20)
    scheduler.add_request(encdec_request("running", list(range(100, 108)), max_tokens=10))
    run_step(scheduler)
    for i in range(3):
        scheduler.add_request(encdec_request(f"r{i}", list(range(10 * i, 10 * i + 10))))
    output, _ = run_step(scheduler)
    # Two encoders of 10 fit the budget of 20; the third waits; decoding goes on.
    assert encoded(output) == ["r0", "r1"]
    assert output.num_scheduled_tokens["running"] == 1
    assert scheduler.make_stats().num_waiting_for_encoder == 1
    assert scheduler.make_stats().num_step_encoder_tokens == 20
    output, _ = run_step(scheduler)
    assert encoded(output) == ["r2"]


def test_an_encoder_longer_than_the_budget_is_refused_by_the_limits() -> None:
    from kvferry.engine.core.messages import EngineLimits

    limits = EngineLimits(max_model_len=64, vocab_size=100, max_num_batched_tokens=64,
                          enable_chunked_prefill=True, max_encoder_len=8,
                          encoder_input="tokens")
    with pytest.raises(ValueError, match="more than the encoder's maximum of 8"):
        limits.check_encoder(EncoderInput(token_ids=list(range(9))))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        limits.check_encoder(EncoderInput(token_ids=[100]))
    with pytest.raises(ValueError, match="needs an encoder input"):
        limits.check_encoder(None)
    with pytest.raises(ValueError, match="reads token ids, not audio"):
        limits.check_encoder(EncoderInput(features=bytes(8), num_mel_bins=1, num_frames=2))


def test_preemption_frees_cross_blocks_and_resumes_from_the_cached_encoder() -> None:
    # 2 requests of 2 cross blocks each in a pool of 8 usable blocks: decoding both to 16
    # tokens needs more than the pool, so the second is preempted.
    scheduler = make_scheduler(num_blocks=9, max_model_len=16)
    manager = scheduler.kv_cache_manager
    a = encdec_request("a", list(range(10, 18)), max_tokens=12)
    b = encdec_request("b", list(range(20, 28)), max_tokens=12)
    scheduler.add_request(a)
    scheduler.add_request(b)
    preempted_step = None
    for step in range(40):
        output, _ = run_step(scheduler)
        if "b" in output.preempted_req_ids:
            preempted_step = step
            assert "b" not in manager.req_to_cross_blocks
        if preempted_step is not None and "b" in output.num_scheduled_tokens \
                and any(r.req_id == "b" for r in output.scheduled_new_reqs):
            # Resumed: its cross blocks come from the cache, its encoder does not run.
            assert "b" not in encoded(output)
            assert len(manager.get_cross_block_ids("b")) == 2
            break
    else:
        pytest.fail("b was never preempted and resumed")
    while a.status is RequestStatus.RUNNING or b.status is RequestStatus.RUNNING or \
            scheduler.waiting:
        run_step(scheduler)
    assert manager.num_free_blocks == 8


def test_aborting_frees_cross_blocks_and_an_encoder_aborted_mid_step_is_not_cached() -> None:
    scheduler = make_scheduler()
    manager = scheduler.kv_cache_manager
    request = encdec_request("a", list(range(10, 22)))
    scheduler.add_request(request)
    output = scheduler.schedule()
    scheduler.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)
    scheduler.update_from_output(output, ModelRunnerOutput(["a"], [FILLER]))
    assert manager.num_free_blocks == 63
    # Its encoder step was taken back: nothing of it is in the cache.
    again = encdec_request("a2", list(range(10, 22)))
    scheduler.add_request(again)
    output, _ = run_step(scheduler)
    assert encoded(output) == ["a2"]


def test_an_encode_only_request_leaves_its_cross_blocks_cached() -> None:
    scheduler = make_scheduler()
    manager = scheduler.kv_cache_manager
    scheduler.add_request(encdec_request("enc", list(range(50, 61)), encode_only=True))
    output, outputs = run_step(scheduler)
    assert encoded(output) == ["enc"] and output.total_num_scheduled_tokens == 0
    assert not output.is_empty
    assert [(o.req_id, o.new_token_ids, o.finish_reason) for o in outputs] == \
        [("enc", [], FinishReason.STOP)]
    assert manager.num_free_blocks == 63 and not manager.req_to_cross_blocks
    scheduler.add_request(encdec_request("dec", list(range(50, 61))))
    output, _ = run_step(scheduler)
    assert encoded(output) == [] and list(output.num_scheduled_tokens) == ["dec"]
    # Encoding an input that is cached already is done without a step of work.
    scheduler.add_request(encdec_request("enc2", list(range(50, 61)), encode_only=True))
    output, outputs = run_step(scheduler)
    assert encoded(output) == [] and [o.req_id for o in outputs if o.finished] == ["enc2"]


def _check_accounting(scheduler: Scheduler, live: dict[str, Request]) -> None:
    """free = total - (self blocks + cross blocks of live requests), shared ones once;
    reference counts equal the number of tables holding each block."""
    manager = scheduler.kv_cache_manager
    pool = manager.block_pool
    holders: dict[int, int] = {}
    for table in (*manager.req_to_blocks.values(), *manager.req_to_cross_blocks.values()):
        for block in table:
            holders[block.block_id] = holders.get(block.block_id, 0) + 1
    assert set(manager.req_to_blocks) | set(manager.req_to_cross_blocks) <= set(live)
    assert manager.num_free_blocks == pool.num_blocks - 1 - len(holders)
    cross_ids = {b.block_id for t in manager.req_to_cross_blocks.values() for b in t}
    assert manager.num_cross_blocks_in_use == len(cross_ids)
    for block in pool.blocks[1:]:
        assert block.ref_cnt == holders.get(block.block_id, 0), block
    for req_id, request in live.items():
        if request.status is RequestStatus.RUNNING and req_id in manager.req_to_blocks:
            cross = manager.req_to_cross_blocks[req_id]
            assert len(cross) == -(-request.num_encoder_tokens // BLOCK_SIZE)


@pytest.mark.parametrize("seed", range(6))
def test_block_accounting_holds_at_every_step_of_a_random_run(seed: int) -> None:
    rng = np.random.default_rng(seed)
    # A request takes at most 3 cross and 6 self blocks: a pool of 11-20 forces preemption.
    scheduler = make_scheduler(num_blocks=int(rng.integers(11, 21)), max_model_len=24,
                               max_num_batched_tokens=int(rng.integers(8, 33)),
                               max_num_encoder_tokens=int(rng.integers(12, 40)),
                               enable_caching=bool(rng.integers(0, 2)) or seed < 3)
    inputs = [list(rng.integers(10, 90, size=int(rng.integers(3, 12)))) for _ in range(5)]
    live: dict[str, Request] = {}
    arrivals = sorted(int(rng.integers(0, 10)) for _ in range(24))
    shared_hits = 0
    for step in range(400):
        for i, when in enumerate(arrivals):
            if when == step:
                ids = inputs[int(rng.integers(0, len(inputs)))]
                decoder = [2, 0] + list(rng.integers(10, 90, size=int(rng.integers(0, 8))))
                request = encdec_request(
                    f"r{i}", [int(t) for t in ids], [int(t) for t in decoder],
                    encode_only=bool(rng.random() < 0.15),
                    max_tokens=int(rng.integers(1, 15)))
                live[request.request_id] = request
                scheduler.add_request(request)
        if rng.random() < 0.08 and live:
            victim = str(rng.choice(sorted(live)))
            scheduler.finish_requests([victim], RequestStatus.FINISHED_ABORTED)
        output, _ = run_step(scheduler, token=int(rng.choice([FILLER, FILLER, EOS])))
        for new in output.scheduled_new_reqs:
            if new.req_id not in encoded(output):
                shared_hits += 1
        live = {k: r for k, r in live.items() if not r.is_finished}
        _check_accounting(scheduler, live)
        if step > max(arrivals) and not live:
            break
    else:
        pytest.fail("the run did not finish")
    manager = scheduler.kv_cache_manager
    assert manager.num_free_blocks == manager.block_pool.num_blocks - 1
    if manager.enable_caching:
        assert shared_hits > 0  # equal encoder inputs shared cross blocks
