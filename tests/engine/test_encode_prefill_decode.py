"""An encoder-decoder request with a long decoder prompt through three engines over real
NIXL (all in this process): an encoder engine holds the cross-attention blocks, a prefill
engine pulls them, computes the decoder prompt and holds both groups, and a decode engine
pulls both and decodes. Pulled blocks equal their producers' byte for byte, the answer
equals a colocated engine's, and every engine's blocks come back."""

from __future__ import annotations

from typing import Any

import pytest
from kvferry.engine.config import CacheConfig, EngineConfig, ModelConfig
from kvferry.engine.frontend.llm_engine import LLMEngine
from kvferry.kvtransfer.config import KVTransferConfig
from kvferry.kvtransfer.params import KVTransferParams
from kvferry_testing.encdec_checkpoints import make_bart_checkpoint
from kvferry_testing.engine_runs import drain, run_one

from kvferry import LLM, SamplingParams
from kvferry.protocol.block_hash import hash_cross_blocks

BLOCK_SIZE = 8
NUM_BLOCKS = 64
ENCODER_TEXT = "a long enough encoder input to fill a few blocks of cross attention keys"
# With the decoder start token prepended, 22 ids: three blocks of the decoder's cache.
DECODER_IDS = [0] + [17 + 3 * i for i in range(20)]
NUM_DECODER_TOKENS = len(DECODER_IDS) + 1
PROMPT = {"encoder_prompt": ENCODER_TEXT, "decoder_prompt": {"prompt_token_ids": DECODER_IDS}}
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def bart(tmp_path_factory):
    return make_bart_checkpoint(tmp_path_factory.mktemp("bart"), seed=12)


@pytest.fixture
def engines(bart):
    made: dict[str, LLMEngine] = {}

    def make(role: str) -> LLMEngine:
        made[role] = LLMEngine(EngineConfig(
            model=ModelConfig(model=str(bart), dtype="float32", max_model_len=64),
            cache=CacheConfig(block_size=BLOCK_SIZE, num_gpu_blocks_override=NUM_BLOCKS),
            device="cpu",
            kv_transfer=KVTransferConfig(model_id="bart", insecure=True, role=role,
                                         lease_s=10.0),
        ))
        return made[role]

    yield make
    for engine in made.values():
        engine.engine_core.shutdown()


@pytest.fixture(scope="module")
def expected(bart) -> list[int]:
    colocated = LLM(model=str(bart), dtype="float32", max_model_len=64, device="cpu",
                    block_size=BLOCK_SIZE, num_gpu_blocks_override=NUM_BLOCKS)
    return colocated.generate(PROMPT, GREEDY, use_tqdm=False)[0].outputs[0].token_ids


def _run(engine: LLMEngine, request_id: str, params: dict[str, Any]):
    return run_one(engine, request_id, PROMPT, GREEDY, kv_transfer_params=params)


def _drain(*engines: LLMEngine) -> None:
    """Every engine's holds pulled or freed: all blocks free again."""
    for engine in engines:
        drain(engine)


def _chain(make) -> tuple[LLMEngine, LLMEngine, dict[str, Any], dict[str, Any]]:
    """Encoder and prefill engines, the encoder's params and the prefill's."""
    encoder, prefill = make("encoder"), make("prefill")
    encoded = _run(encoder, "e", {"do_remote_decode": True}).kv_transfer_params
    held = _run(prefill, "p", {**encoded, "do_remote_decode": True}).kv_transfer_params
    return encoder, prefill, encoded, held


def _kv(engine: LLMEngine, block_ids: list[int]) -> list[bytes]:
    cache = engine.engine_core.runner.kv_cache
    return [cache[b].numpy().tobytes() for b in block_ids]


def test_the_prefill_engine_pulls_the_cross_blocks_and_holds_both_groups(engines,
                                                                         expected) -> None:
    encoder, prefill, encoded, held = _chain(engines)
    assert encoded["remote_block_ids"][0] == [] and encoded["kvferry_num_tokens"] == 0
    # The prefill pulled the encoder's cross blocks and ran no encoder of its own.
    assert prefill.stats.encoder_tokens_total == 0
    assert prefill.engine_core.make_stats().kv_transfer.cross_bytes_pulled > 0
    parsed = KVTransferParams.from_dict(held)
    assert parsed is not None and parsed.is_cross_pull
    assert parsed.kvferry_num_tokens == NUM_DECODER_TOKENS
    assert len(prefill.process_prompt(PROMPT).prompt_token_ids) == NUM_DECODER_TOKENS
    assert parsed.kvferry_encoder_hash == encoded["kvferry_encoder_hash"]
    assert parsed.kvferry_num_encoder_tokens == encoded["kvferry_num_encoder_tokens"]
    self_blocks, cross_blocks = held["remote_block_ids"]
    assert len(self_blocks) == -(-NUM_DECODER_TOKENS // BLOCK_SIZE)
    assert _kv(prefill, cross_blocks) == _kv(encoder, encoded["remote_block_ids"][1])

    decode = engines("decode")
    answer = _run(decode, "d", held)
    stats = decode.engine_core.make_stats()
    assert decode.stats.encoder_tokens_total == 0
    assert stats.kv_transfer.cross_bytes_pulled > 0
    # Both groups came over: the decoder prompt's blocks too (all but the last token,
    # which the decode engine computes to sample its first token).
    assert stats.kv_transfer.bytes_pulled > stats.kv_transfer.cross_bytes_pulled
    assert answer.num_cached_tokens == 0
    assert answer.outputs[0].token_ids == expected

    processed = decode.process_prompt(PROMPT)
    key, positions = processed.encoder.key(), processed.encoder.num_positions
    pool = decode.engine_core.kv_cache_manager.block_pool
    ours = [pool.cached_blocks[h].block_id
            for h in hash_cross_blocks(key, -(-positions // BLOCK_SIZE))]
    assert _kv(decode, ours) == _kv(prefill, cross_blocks)
    _drain(encoder, prefill, decode)


def test_a_decode_engine_holding_the_cross_blocks_pulls_only_the_decoder_prompt(
        engines, expected) -> None:
    encoder, prefill, _, held = _chain(engines)
    decode = engines("decode")
    # The same encoder input first came to this engine by itself: its cross blocks are
    # cached here.
    warm = _run(decode, "warm", {})
    assert warm.outputs[0].token_ids == expected
    encoded_here = decode.stats.encoder_tokens_total
    answer = _run(decode, "d", held)
    stats = decode.engine_core.make_stats()
    assert answer.outputs[0].token_ids == expected
    assert decode.stats.encoder_tokens_total == encoded_here
    assert stats.kv_transfer.cross_bytes_pulled == 0
    assert stats.kv_transfer.bytes_pulled > 0
    assert decode.engine_core.scheduler.remote.num_cross_cache_hits == 1
    _drain(encoder, prefill, decode)


def test_params_naming_another_encoder_input_are_computed_here(engines, expected) -> None:
    encoder, prefill, _, held = _chain(engines)
    decode = engines("decode")
    forged = {**held, "kvferry_encoder_hash": "00" * 32}
    answer = _run(decode, "d", forged)
    stats = decode.engine_core.make_stats()
    assert answer.outputs[0].token_ids == expected
    assert stats.kv_transfer.bytes_pulled == 0
    assert decode.engine_core.scheduler.remote.num_fallbacks == 1
    assert decode.stats.encoder_tokens_total > 0
    # The prefill's hold was let go at once, not left to its lease.
    _drain(encoder, prefill, decode)


def test_a_prefill_engine_whose_cross_pull_fails_encodes_and_still_holds(engines,
                                                                         expected) -> None:
    """The encoder engine is gone before the pull: under `recompute` the prefill engine
    runs the encoder itself, and the request still leaves a hold for the decode pod."""
    encoder = engines("encoder")
    encoded = _run(encoder, "e", {"do_remote_decode": True}).kv_transfer_params
    encoder.engine_core.shutdown()
    prefill = engines("prefill")
    held = _run(prefill, "p", {**encoded, "do_remote_decode": True}).kv_transfer_params
    assert prefill.stats.encoder_tokens_total > 0
    assert prefill.engine_core.scheduler.remote.num_fallbacks == 1
    decode = engines("decode")
    assert _run(decode, "d", held).outputs[0].token_ids == expected
    assert decode.stats.encoder_tokens_total == 0
    _drain(prefill, decode)


def test_a_hold_for_another_decoder_prompt_is_one_fallback(engines, expected) -> None:
    """The decode engine holds the cross blocks, and the prefill's hold was computed for
    another decoder prompt: nothing is pulled, the hold is let go, one fallback counted."""
    encoder, prefill, _, held = _chain(engines)
    decode = engines("decode")
    assert _run(decode, "warm", {}).outputs[0].token_ids == expected
    other = {"encoder_prompt": ENCODER_TEXT,
             "decoder_prompt": {"prompt_token_ids": [0] + [18 + 3 * i for i in range(20)]}}
    reference = run_one(decode, "ref", other, GREEDY).outputs[0].token_ids
    answer = run_one(decode, "d", other, GREEDY, kv_transfer_params=held)
    assert answer.outputs[0].token_ids == reference
    remote = decode.engine_core.scheduler.remote
    assert remote.num_fallbacks == 1 and remote.num_cross_cache_hits == 0
    assert decode.engine_core.make_stats().kv_transfer.bytes_pulled == 0
    _drain(encoder, prefill, decode)


def test_cross_params_refused_in_the_core_fall_back_instead_of_waiting(
        engines, expected, monkeypatch: pytest.MonkeyPatch) -> None:
    """Params that passed the front end but are refused by the engine core's own check
    (expired meanwhile): the parked request hears of it at once and, under `recompute`,
    runs its encoder here; the prefill still holds for the decode pod."""
    import kvferry.kvtransfer.connector as connector
    from kvferry.kvtransfer.auth import ParamsRefusal, TransferKey
    from kvferry.kvtransfer.metrics import FailureReason

    encoder = engines("encoder")
    encoded = _run(encoder, "e", {"do_remote_decode": True}).kv_transfer_params
    prefill = engines("prefill")
    scheduler = prefill.engine_core.scheduler.remote.connector
    monkeypatch.setattr(scheduler.config, "transfer_key", TransferKey(b"k" * 40))
    monkeypatch.setattr(connector, "check_params", lambda *_: ParamsRefusal(
        FailureReason.PARAMS_EXPIRED, "expired meanwhile"))
    held = run_one(prefill, "p", PROMPT, GREEDY, timeout_s=20,
                   kv_transfer_params={**encoded, "do_remote_decode": True}).kv_transfer_params
    monkeypatch.undo()
    assert prefill.stats.encoder_tokens_total > 0
    assert held is not None and held["kvferry_encoder_hash"] == encoded["kvferry_encoder_hash"]
    decode = engines("decode")
    assert _run(decode, "d", held).outputs[0].token_ids == expected
    _drain(encoder, prefill, decode)
