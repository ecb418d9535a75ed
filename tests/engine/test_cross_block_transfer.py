"""Cross-attention blocks moved between two engines over real NIXL (both in this process):
the decode engine's pulled cross blocks equal the encoder engine's byte for byte, and its
answer equals an engine that ran the encoder itself."""

from __future__ import annotations

from kvferry.engine.config import CacheConfig, EngineConfig, ModelConfig
from kvferry.engine.frontend.llm_engine import LLMEngine
from kvferry.kvtransfer.config import KVTransferConfig
from kvferry_testing.encdec_checkpoints import make_bart_checkpoint
from kvferry_testing.engine_runs import drain, run_one

from kvferry import LLM, SamplingParams
from kvferry.protocol.block_hash import hash_cross_blocks

BLOCK_SIZE = 8
PROMPT = "a long enough encoder input to fill a few blocks of cross attention keys"


def _engine(path, role: str) -> LLMEngine:
    return LLMEngine(EngineConfig(
        model=ModelConfig(model=str(path), dtype="float32", max_model_len=64),
        cache=CacheConfig(block_size=BLOCK_SIZE, num_gpu_blocks_override=64),
        device="cpu",
        kv_transfer=KVTransferConfig(model_id="bart", insecure=True, role=role,
                                     lease_s=10.0),
    ))


def _run(engine: LLMEngine, request_id: str, params: SamplingParams, **kwargs):
    return run_one(engine, request_id, PROMPT, params, **kwargs)


def _cross_blocks(engine: LLMEngine, key: bytes, num_positions: int) -> list[int]:
    pool = engine.engine_core.kv_cache_manager.block_pool
    hashes = hash_cross_blocks(key, -(-num_positions // BLOCK_SIZE))
    return [pool.cached_blocks[h].block_id for h in hashes]


def test_pulled_cross_blocks_equal_the_encoder_engines(tmp_path) -> None:
    path = make_bart_checkpoint(tmp_path / "bart", seed=11)
    encoder, decoder = _engine(path, "encoder"), _engine(path, "decode")
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    held = _run(encoder, "e", greedy, kv_transfer_params={"do_remote_decode": True})
    params = held.kv_transfer_params
    assert held.outputs[0].token_ids == [] and params["remote_block_ids"][0] == []
    answer = _run(decoder, "d", greedy, kv_transfer_params=params)
    stats = decoder.engine_core.make_stats()
    assert stats.kv_transfer.cross_bytes_pulled > 0
    assert decoder.stats.encoder_tokens_total == 0  # its encoder never ran

    processed = decoder.process_prompt(PROMPT)
    key, positions = processed.encoder.key(), processed.encoder.num_positions
    theirs = _cross_blocks(encoder, key, positions)
    ours = _cross_blocks(decoder, key, positions)
    assert theirs == [b for group in params["remote_block_ids"][1:] for b in group]
    enc_cache = encoder.engine_core.runner.kv_cache
    dec_cache = decoder.engine_core.runner.kv_cache
    for mine, remote in zip(ours, theirs):
        assert dec_cache[mine].numpy().tobytes() == enc_cache[remote].numpy().tobytes()

    colocated = LLM(model=str(path), dtype="float32", max_model_len=64, device="cpu",
                    block_size=BLOCK_SIZE, num_gpu_blocks_override=64)
    expected = colocated.generate(PROMPT, greedy, use_tqdm=False)[0]
    assert answer.outputs[0].token_ids == expected.outputs[0].token_ids
    for engine in (encoder, decoder):
        drain(engine)
        engine.engine_core.shutdown()
