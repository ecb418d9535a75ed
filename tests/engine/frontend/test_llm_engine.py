"""The engine through its public surface: validation, stops, logprobs, aborts, stats, seeds."""

from __future__ import annotations

import math
import time
from pathlib import Path

import pytest
import torch

from kvferry import LLM, SamplingParams
from kvferry.engine.frontend.llm_engine import LLMEngine

MAX_MODEL_LEN = 128


@pytest.fixture(scope="module")
def checkpoint(make_checkpoint) -> Path:
    return make_checkpoint("LlamaForCausalLM")


@pytest.fixture()
def llm(checkpoint: Path) -> LLM:
    return LLM(model=str(checkpoint), max_model_len=MAX_MODEL_LEN, num_gpu_blocks_override=64)


def _engine(llm: LLM) -> LLMEngine:
    return llm.llm_engine


def _run(engine: LLMEngine) -> dict[str, object]:
    finished = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    return finished


def _assert_all_blocks_free(engine: LLMEngine) -> None:
    assert engine.num_free_blocks == engine.kv_cache_manager.block_pool.num_blocks - 1


GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
# Ids 0-2 are the test tokenizer's special tokens (dropped from text); the rest decode to "w<id>".
NUM_SPECIAL = 3
# The test checkpoints' EOS (the tokenizer's "</s>").
EOS_ID = 2


def _text(tokens: list[int]) -> str:
    return "".join(f" w{t}" for t in tokens if t >= NUM_SPECIAL)


@pytest.mark.parametrize(
    ("prompt", "params", "message"),
    [
        ({"prompt_token_ids": list(range(3, 3 + MAX_MODEL_LEN + 1))}, GREEDY,
         f"129 tokens, more than the maximum model length of {MAX_MODEL_LEN}"),
        ("", GREEDY, "the prompt is empty"),
        ({"prompt_token_ids": []}, GREEDY, "the prompt is empty"),
        ({"prompt_token_ids": [5, 256]}, GREEDY, "token id 256 is outside the vocabulary [0, 256)"),
        ({"prompt_token_ids": [-1, 5]}, GREEDY, "token id -1 is outside the vocabulary"),
        ({"prompt_token_ids": [5, "x"]}, GREEDY, "prompt_token_ids must be a list of integers"),
        ({"text": "w5"}, GREEDY, ("needs 'prompt' (text), 'prompt_token_ids' (ints) or "
                                    "'prompt_embeds'")),
    ],
)
def test_bad_prompts_raise_and_the_engine_keeps_serving(llm, prompt, params, message) -> None:
    engine = _engine(llm)
    engine.add_request("good", {"prompt_token_ids": [5, 6, 7]}, GREEDY)
    engine.step()  # the good request is running when the bad one arrives
    with pytest.raises(ValueError) as excinfo:
        engine.add_request("bad", prompt, params)
    assert message in str(excinfo.value)
    finished = _run(engine)
    assert list(finished) == ["good"]
    assert len(finished["good"].outputs[0].token_ids) == 6
    _assert_all_blocks_free(engine)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_tokens": 0}, "max_tokens must be >= 1, got 0"),
        ({"top_p": 0.0}, "top_p must be in (0, 1], got 0.0"),
        ({"top_p": 1.5}, "top_p must be in (0, 1], got 1.5"),
        ({"n": 0}, "n must be >= 1, got 0"),
    ],
)
def test_bad_sampling_params_raise(kwargs, message) -> None:
    with pytest.raises(ValueError) as excinfo:
        SamplingParams(**kwargs)
    assert message in str(excinfo.value)


def test_generate_validates_every_prompt_before_queueing_any(llm) -> None:
    with pytest.raises(ValueError, match="the prompt is empty"):
        llm.generate(["w5 w6", ""], GREEDY, use_tqdm=False)
    assert not _engine(llm).has_unfinished_requests()


def test_unknown_architecture_and_missing_tensors(make_checkpoint, tmp_path) -> None:
    import json
    import shutil

    source = make_checkpoint("LlamaForCausalLM")
    bad_arch = tmp_path / "bad-arch"
    shutil.copytree(source, bad_arch)
    config = json.loads((bad_arch / "config.json").read_text())
    config["architectures"] = ["MambaForCausalLM"]
    (bad_arch / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="unsupported architecture 'MambaForCausalLM'; "
                                         "supported: LlamaForCausalLM"):
        LLM(model=str(bad_arch), max_model_len=64, num_gpu_blocks_override=8)

    from safetensors.torch import load_file, save_file

    missing = tmp_path / "missing"
    shutil.copytree(source, missing)
    weights = load_file(missing / "model.safetensors")
    del weights["model.layers.1.mlp.down_proj.weight"]
    save_file(weights, missing / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="model.layers.1.mlp.down_proj.weight"):
        LLM(model=str(missing), max_model_len=64, num_gpu_blocks_override=8)


def test_prompt_forms_and_output_fields(llm) -> None:
    tokenizer = llm.get_tokenizer()
    ids = tokenizer.encode("w10 w11 w12")
    outputs = llm.generate(
        ["w10 w11 w12", {"prompt": "w10 w11 w12"}, {"prompt_token_ids": ids}, ids],
        GREEDY, use_tqdm=False,
    )
    assert [o.prompt for o in outputs] == ["w10 w11 w12", "w10 w11 w12", None, None]
    assert all(o.prompt_token_ids == ids for o in outputs)
    tokens = outputs[0].outputs[0].token_ids
    assert all(o.outputs[0].token_ids == tokens for o in outputs)
    # Word-level text: each token decodes to " w<id>".
    assert outputs[0].outputs[0].text == _text(tokens)
    assert outputs[0].outputs[0].finish_reason == "length"
    assert outputs[0].finished


def _greedy_tokens(llm: LLM, prompt: list[int], n: int) -> list[int]:
    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    return out[0].outputs[0].token_ids


def test_stop_token_ids_and_eos(llm) -> None:
    prompt = [5, 6, 7, 8]
    tokens = _greedy_tokens(llm, prompt, 8)
    stop_at = tokens[3]
    first = tokens.index(stop_at)
    params = SamplingParams(temperature=0.0, max_tokens=8, stop_token_ids=[stop_at])
    out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0].outputs[0]
    assert out.token_ids == tokens[: first + 1]
    assert out.finish_reason == "stop"
    assert out.stop_reason == stop_at
    # The stop token's text is left out of the output text.
    assert out.text == _text(tokens[:first])


def _hf_greedy(
    hf: torch.nn.Module, prompt: list[int], n: int, blocked: list[int], num_blocked: int
) -> list[int]:
    """HF's greedy continuation of `n` tokens; `blocked` ids may not be the first `num_blocked`."""
    sequence: list[int] = list(prompt)
    for i in range(n):
        with torch.no_grad():
            logits = hf(torch.tensor([sequence])).logits[0, -1]  # (vocab_size,)
        if i < num_blocked:
            logits[blocked] = -math.inf
        sequence.append(int(logits.argmax()))
    return sequence[len(prompt):]


def test_min_tokens_blocks_stop_tokens_then_stops_at_the_first(
    llm, checkpoint, hf_model
) -> None:
    prompt, min_tokens = [5, 6, 7, 8], 3
    hf = hf_model(checkpoint)
    # The token greedy decoding picks first: as a stop token it would end the request at once.
    stop = _hf_greedy(hf, prompt, 1, [], 0)[0]
    expected = _hf_greedy(hf, prompt, 12, [stop, EOS_ID], min_tokens)
    # Once allowed, the stop token comes back (before any EOS) and ends the request there.
    first_stop = expected.index(stop, min_tokens)
    assert EOS_ID not in expected[:first_stop]
    params = SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=[stop],
                            min_tokens=min_tokens)
    out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0].outputs[0]
    assert out.token_ids == expected[: first_stop + 1]
    assert (out.finish_reason, out.stop_reason) == ("stop", stop)
    _assert_all_blocks_free(_engine(llm))


def test_stop_string_is_cut_from_text(llm) -> None:
    prompt = [5, 6, 7, 8]
    tokens = _greedy_tokens(llm, prompt, 8)
    i = next(i for i in range(1, 7) if min(tokens[i], tokens[i + 1]) >= NUM_SPECIAL)
    stop = f"w{tokens[i]} w{tokens[i + 1]}"  # spans two tokens
    assert stop not in _text(tokens[:i + 1])
    params = SamplingParams(temperature=0.0, max_tokens=8, stop=[stop], ignore_eos=True)
    out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0].outputs[0]
    assert out.text == _text(tokens[:i]) + " "
    assert out.finish_reason == "stop"
    assert out.stop_reason == stop
    assert out.token_ids == tokens[: i + 2]
    _assert_all_blocks_free(_engine(llm))


def test_logprobs_top_n_include_the_sampled_token(llm, checkpoint, hf_model) -> None:
    prompt = [5, 6, 7, 8, 9]
    params = SamplingParams(temperature=0.0, max_tokens=3, logprobs=4, ignore_eos=True)
    out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0].outputs[0]
    assert len(out.logprobs) == 3
    hf = hf_model(checkpoint)
    sequence = prompt + out.token_ids
    with torch.no_grad():
        logits = hf(torch.tensor([sequence])).logits[0]
    reference = torch.log_softmax(logits.float(), dim=-1)
    total = 0.0
    for step, (token, position) in enumerate(zip(out.token_ids, out.logprobs)):
        ref = reference[len(prompt) - 1 + step]
        top = torch.topk(ref, 4)
        assert set(position) == set(top.indices.tolist()) | {token}
        assert position[token].rank == 1
        for token_id, logprob in position.items():
            assert math.isclose(logprob.logprob, ref[token_id].item(), abs_tol=1e-4)
        assert position[top.indices[1].item()].rank == 2
        assert position[token].decoded_token == f"w{token}"
        total += position[token].logprob
    assert math.isclose(out.cumulative_logprob, total, abs_tol=1e-5)


def test_seeded_sampling_is_reproducible_whatever_the_batch(llm) -> None:
    prompt = {"prompt_token_ids": [5, 6, 7, 8, 9]}
    params = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=10, seed=1234, ignore_eos=True)
    alone = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    others = [SamplingParams(temperature=1.0, max_tokens=10, ignore_eos=True)] * 5
    batch = llm.generate(
        [{"prompt_token_ids": [9, 10, 11]}] * 5 + [prompt], others + [params], use_tqdm=False
    )
    assert batch[-1].outputs[0].token_ids == alone
    other_seed = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=10, seed=99,
                                ignore_eos=True)
    assert llm.generate([prompt], other_seed, use_tqdm=False)[0].outputs[0].token_ids != alone


def test_n_copies_with_seed_differ_from_each_other(llm) -> None:
    params = SamplingParams(n=3, temperature=1.0, max_tokens=12, seed=7, ignore_eos=True)
    first = llm.generate([{"prompt_token_ids": [5, 6, 7]}], params, use_tqdm=False)[0]
    second = llm.generate([{"prompt_token_ids": [5, 6, 7]}], params, use_tqdm=False)[0]
    tokens = [c.token_ids for c in first.outputs]
    assert tokens == [c.token_ids for c in second.outputs]
    assert len({tuple(t) for t in tokens}) == 3


def test_abort_at_any_point_frees_blocks(llm) -> None:
    engine = _engine(llm)
    long = SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True)
    engine.add_request("waiting", {"prompt_token_ids": list(range(3, 40))}, long)
    engine.add_request("running", {"prompt_token_ids": list(range(3, 30))}, long)
    engine.add_request("kept", {"prompt_token_ids": [7, 8, 9]}, GREEDY)
    engine.step()
    engine.step()
    aborted = engine.abort_request(["running", "waiting", "unknown"])
    assert sorted(o.request_id for o in aborted) == ["running", "waiting"]
    assert all(o.finished and o.outputs[0].finish_reason == "abort" for o in aborted)
    finished = _run(engine)
    assert list(finished) == ["kept"]
    _assert_all_blocks_free(engine)


def test_priority_policy_runs_lower_values_first(checkpoint) -> None:
    llm = LLM(model=str(checkpoint), max_model_len=MAX_MODEL_LEN, num_gpu_blocks_override=64,
              max_num_seqs=1, scheduling_policy="priority")
    engine = _engine(llm)
    order = []
    for name, priority in [("low", 5), ("high", -1), ("mid", 0)]:
        engine.add_request(name, {"prompt_token_ids": [5, 6]}, GREEDY, priority=priority)
    while engine.has_unfinished_requests():
        order += [o.request_id for o in engine.step() if o.finished]
    assert order == ["high", "mid", "low"]


def test_statistics(llm) -> None:
    engine = _engine(llm)
    # Distinct first tokens: no prompt shares a block with another.
    prompts = [{"prompt_token_ids": [start] + list(range(3, 2 + n))}
               for start, n in ((200, 5), (201, 20), (202, 33))]
    llm.generate(prompts, GREEDY, use_tqdm=False)
    stats = engine.stats
    assert stats.prompt_tokens_total == 5 + 20 + 33
    assert stats.generation_tokens_total == 3 * 6
    assert stats.num_finished_requests == 3
    assert stats.scheduler.num_running_reqs == 0 and stats.scheduler.num_waiting_reqs == 0
    assert stats.scheduler.kv_cache_usage == 0.0
    # Every prompt was looked up; the same prompts again hit their full blocks.
    assert stats.scheduler.prefix_cache_queries == 5 + 20 + 33
    llm.generate(prompts, GREEDY, use_tqdm=False)
    assert stats.scheduler.prefix_cache_hits == 16 + 32
    assert stats.scheduler.prefix_cache_queries == 2 * (5 + 20 + 33)


def test_step_statistics_record_latencies(llm) -> None:
    engine = _engine(llm)
    # Arrived 5 s ago: time to first token counts from arrival, not from scheduling.
    arrival = time.monotonic() - 5.0
    engine.add_request("a", {"prompt_token_ids": [5, 6, 7]}, GREEDY, arrival_time=arrival)
    [out] = engine.step()
    first_token_time = out.metrics.first_token_time
    assert out.metrics.arrival_time == arrival
    assert arrival + 5.0 <= first_token_time <= time.monotonic()
    assert out.metrics.last_token_time == first_token_time
    assert out.metrics.finished_time is None
    first = engine.stats.last_iteration
    assert first.num_prompt_tokens == 3 and first.num_generation_tokens == 1
    assert first.time_to_first_tokens == [first_token_time - arrival]
    assert first.inter_token_latencies == [] and first.e2e_latencies == []
    assert engine.stats.scheduler.num_running_reqs == 1
    assert engine.stats.scheduler.kv_cache_usage == pytest.approx(1 / 63)

    [out] = engine.step()
    second_token_time = out.metrics.last_token_time
    assert out.metrics.first_token_time == first_token_time <= second_token_time
    second = engine.stats.last_iteration
    assert second.num_prompt_tokens == 0 and second.time_to_first_tokens == []
    assert second.inter_token_latencies == [second_token_time - first_token_time]

    metrics = _run(engine)["a"].metrics
    assert metrics.first_token_time == first_token_time
    assert second_token_time <= metrics.last_token_time <= metrics.finished_time
    last = engine.stats.last_iteration
    assert last.e2e_latencies == [metrics.finished_time - arrival]
    assert last.finish_reasons == ["length"]
    assert first.time_to_first_tokens[0] <= last.e2e_latencies[0]
    assert engine.stats.num_finished_requests == 1


def test_duplicate_request_id_is_rejected(llm) -> None:
    engine = _engine(llm)
    engine.add_request("x", {"prompt_token_ids": [5]}, GREEDY)
    with pytest.raises(ValueError, match="request id 'x' is already in use"):
        engine.add_request("x", {"prompt_token_ids": [6]}, GREEDY)
    _run(engine)
