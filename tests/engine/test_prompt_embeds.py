"""Prompts given as embeddings, through the offline engine: the same greedy output as the
token ids they embed, for every decoder-only family, alone and in batches mixed with token
prompts under chunked prefill and preemption; prefix caching keyed by the embeddings' hash;
refusals that name their check; no tensor outliving its request."""

from __future__ import annotations

import gc
import re
import weakref
from pathlib import Path

import numpy as np
import pytest
import torch
from kvferry.engine.core.messages import PROMPT_EMBEDS_DISABLED, EngineCoreRequest, PromptEmbeds
from safetensors.torch import load_file

from kvferry import LLM, SamplingParams
from kvferry.protocol.block_hash import hash_request_blocks
from kvferry.protocol.prompt_embeds import PLACEHOLDER_TOKEN_ID, embeds_salt

ARCHITECTURES = ["LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"]
VOCAB_SIZE = 256
HIDDEN_SIZE = 64
BLOCK_SIZE = 16
MAX_MODEL_LEN = 256


def _embedding_table(path: Path) -> torch.Tensor:
    """The checkpoint's own embed_tokens weight, (vocab_size, hidden_size)."""
    return load_file(str(path / "model.safetensors"))["model.embed_tokens.weight"]


def _prompts(seed: int, lengths: list[int]) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, VOCAB_SIZE, size=n).tolist() for n in lengths]


def _greedy(max_tokens: int, **extra) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **extra)


def _llm(path: Path, **overrides) -> LLM:
    kwargs = {"max_model_len": MAX_MODEL_LEN, "block_size": BLOCK_SIZE,
                  "num_gpu_blocks_override": 200, "enable_prompt_embeds": True}
    kwargs.update(overrides)
    return LLM(model=str(path), **kwargs)


def _assert_no_leaked_blocks(llm: LLM) -> None:
    engine = llm.llm_engine
    assert not engine.has_unfinished_requests()
    assert engine.num_free_blocks == engine.kv_cache_manager.block_pool.num_blocks - 1
    # Rows of finished requests go with the next step; their tensors went at once.
    assert all(s.prompt_embeds is None for s in engine.runner.requests.values())


@pytest.fixture(scope="module", params=ARCHITECTURES)
def family(request, make_checkpoint) -> tuple[Path, torch.Tensor]:
    path = make_checkpoint(request.param)
    return path, _embedding_table(path)


def test_embeddings_of_token_ids_give_the_token_ids_output(family) -> None:
    path, table = family
    llm = _llm(path)
    prompts = _prompts(1, [1, 5, 16, 17, 40, 97])
    params = _greedy(12)
    by_ids = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    by_embeds = llm.generate([{"prompt_embeds": table[p]} for p in prompts], params,
                             use_tqdm=False)
    for prompt, ids_out, embeds_out in zip(prompts, by_ids, by_embeds):
        assert embeds_out.outputs[0].token_ids == ids_out.outputs[0].token_ids
        # No prompt text and no placeholder ids are reported for an embedding prompt.
        assert embeds_out.prompt is None and embeds_out.prompt_token_ids == []
        assert embeds_out.outputs[0].finish_reason == "length"
    _assert_no_leaked_blocks(llm)


def test_a_leading_batch_dimension_of_one_is_squeezed(make_checkpoint) -> None:
    path = make_checkpoint("LlamaForCausalLM")
    table = _embedding_table(path)
    llm = _llm(path)
    prompt = _prompts(2, [23])[0]
    flat, batched = llm.generate([{"prompt_embeds": table[prompt]},
                                  {"prompt_embeds": table[prompt][None]}], _greedy(6),
                                 use_tqdm=False)
    assert flat.outputs[0].token_ids == batched.outputs[0].token_ids


def test_mixed_batch_under_chunked_prefill_and_preemption_matches_each_alone(family) -> None:
    """Embedding and token prompts share steps; prompts longer than the step budget are
    chunked and the small pool forces preemptions (recomputing embedding prompts from their
    tensor); each request still gets exactly what it gets alone."""
    path, table = family
    lengths = np.random.default_rng(3).integers(20, 110, size=12).tolist()
    prompts = _prompts(4, lengths)
    max_tokens = np.random.default_rng(5).integers(8, 24, size=12).tolist()
    inputs = [{"prompt_embeds": table[p]} if i % 2 == 0 else {"prompt_token_ids": p}
              for i, p in enumerate(prompts)]
    params = [_greedy(m) for m in max_tokens]
    llm = _llm(path, num_gpu_blocks_override=24, max_num_batched_tokens=48, max_num_seqs=8)
    together = llm.generate(inputs, params, use_tqdm=False)
    stats = llm.llm_engine.stats.scheduler
    assert stats.num_preemptions > 0
    assert max(lengths) > 48  # so some prompts were chunked
    _assert_no_leaked_blocks(llm)

    alone = _llm(path)
    for prompt_input, p, out in zip(inputs, params, together):
        single = alone.generate([prompt_input], p, use_tqdm=False)[0]
        assert out.outputs[0].token_ids == single.outputs[0].token_ids
    _assert_no_leaked_blocks(alone)


def test_n_completions_of_an_embedding_prompt_share_its_blocks(make_checkpoint) -> None:
    """The n sequences of one embedding prompt carry its embeddings each and share its
    prompt blocks; seeded sampling gives each what the same seed gives the token ids."""
    path = make_checkpoint("LlamaForCausalLM")
    table = _embedding_table(path)
    llm = _llm(path)
    prompt = _prompts(12, [37])[0]
    params = SamplingParams(n=2, temperature=0.9, seed=5, max_tokens=6, ignore_eos=True)
    by_ids = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
    hits = llm.llm_engine.stats.scheduler.prefix_cache_hits
    by_embeds = llm.generate([{"prompt_embeds": table[prompt]}], params, use_tqdm=False)[0]
    assert [c.token_ids for c in by_embeds.outputs] == [c.token_ids for c in by_ids.outputs]
    assert by_embeds.outputs[0].token_ids != by_embeds.outputs[1].token_ids
    # The second sequence found the first one's two full prompt blocks.
    assert llm.llm_engine.stats.scheduler.prefix_cache_hits - hits == 32
    _assert_no_leaked_blocks(llm)


def test_penalties_see_no_placeholder_ids(make_checkpoint, monkeypatch) -> None:
    """The sampler gets no prompt ids for an embedding prompt (a repetition penalty would
    otherwise count its placeholders as prompt tokens), and the token prompt's ids as ever."""
    from kvferry.engine.runner import model_runner

    path = make_checkpoint("LlamaForCausalLM")
    table = _embedding_table(path)
    llm = _llm(path)
    seen: list[list[list[int]]] = []
    build = model_runner.SamplingMetadata.build

    def spy(**kwargs):
        seen.append([list(p) for p in kwargs["prompt_token_ids"]])
        return build(**kwargs)

    monkeypatch.setattr(model_runner.SamplingMetadata, "build", staticmethod(spy))
    prompt = _prompts(6, [30])[0]
    llm.generate([{"prompt_embeds": table[prompt]}, {"prompt_token_ids": prompt}],
                 _greedy(3, repetition_penalty=1.8), use_tqdm=False)
    assert seen and all(rows == [[], prompt] for rows in seen)


def test_identical_embedding_prompts_share_blocks_and_never_token_prompts(make_checkpoint) -> None:
    path = make_checkpoint("LlamaForCausalLM")
    table = _embedding_table(path)
    llm = _llm(path, enable_prefix_caching=True)
    prompt = _prompts(7, [50])[0]
    params = _greedy(4)
    full_blocks = (len(prompt) - 1) // BLOCK_SIZE * BLOCK_SIZE

    first = llm.generate([{"prompt_embeds": table[prompt]}], params, use_tqdm=False)[0]
    second = llm.generate([{"prompt_embeds": table[prompt].clone()}], params, use_tqdm=False)[0]
    assert first.num_cached_tokens == 0
    assert second.num_cached_tokens == full_blocks == 48
    assert second.outputs[0].token_ids == first.outputs[0].token_ids

    # The same ids as tokens, and ids equal to the placeholders, find none of those blocks.
    tokens = llm.generate([{"prompt_token_ids": prompt},
                           {"prompt_token_ids": [PLACEHOLDER_TOKEN_ID] * len(prompt)}], params,
                          use_tqdm=False)
    assert [o.num_cached_tokens for o in tokens] == [0, 0]
    # ...and an embedding prompt finds none of a token prompt's blocks.
    other = _prompts(8, [40])[0]
    llm.generate([{"prompt_token_ids": other}], params, use_tqdm=False)
    assert llm.generate([{"prompt_embeds": table[other]}], params,
                        use_tqdm=False)[0].num_cached_tokens == 0
    # Other embeddings of the same length hit nothing either.
    changed = table[prompt].clone()
    changed[-1, 0] += 1.0
    assert llm.generate([{"prompt_embeds": changed}], params,
                        use_tqdm=False)[0].num_cached_tokens == 0
    _assert_no_leaked_blocks(llm)


def test_an_embedding_prompts_blocks_are_its_placeholders_hashed_with_its_salt(
        make_checkpoint) -> None:
    """What the router reproduces: placeholder ids hashed with the embeddings' hash."""
    path = make_checkpoint("LlamaForCausalLM")
    table = _embedding_table(path)
    llm = _llm(path)
    engine = llm.llm_engine
    embeds = table[_prompts(9, [35])[0]]
    engine.add_request("r", {"prompt_embeds": embeds}, _greedy(2))
    engine.step()
    request = engine.scheduler.requests["r"]
    assert request.prompt_token_ids == [PLACEHOLDER_TOKEN_ID] * 35
    assert request.cache_salt == embeds_salt(embeds)
    assert request.block_hashes == hash_request_blocks([PLACEHOLDER_TOKEN_ID] * 35, BLOCK_SIZE,
                                                       [], embeds_salt(embeds))
    while engine.has_unfinished_requests():
        engine.step()


def test_finished_and_aborted_requests_keep_no_tensor(make_checkpoint) -> None:
    path = make_checkpoint("LlamaForCausalLM")
    table = _embedding_table(path)
    llm = _llm(path)
    engine = llm.llm_engine
    refs = {}
    for req_id, prompt in zip(("done", "aborted"), _prompts(10, [40, 40])):
        engine.add_request(req_id, {"prompt_embeds": table[prompt]}, _greedy(3))
    engine.step()
    for req_id in ("done", "aborted"):
        tensor = engine.scheduler.requests[req_id].prompt_embeds
        assert tensor is not None and tensor.shape == (40, HIDDEN_SIZE)
        refs[req_id] = weakref.ref(tensor)
        assert engine.runner.requests[req_id].prompt_embeds is tensor
        del tensor
    engine.abort_request("aborted")
    while engine.has_unfinished_requests():
        engine.step()
    gc.collect()  # no step after the last: the tensors go when the requests finish
    assert refs["done"]() is None and refs["aborted"]() is None
    engine.step()  # the rows themselves leave with the next step
    assert engine.runner.input_batch.num_prompt_embeds_rows == 0
    _assert_no_leaked_blocks(llm)


def test_usage_counts_rows_and_text_has_no_prompt(make_checkpoint) -> None:
    path = make_checkpoint("LlamaForCausalLM")
    table = _embedding_table(path)
    llm = _llm(path)
    out = llm.generate([{"prompt_embeds": table[_prompts(11, [21])[0]]}], _greedy(3),
                       use_tqdm=False)[0]
    assert llm.llm_engine.stats.prompt_tokens_total == 21
    # A word-level tokenizer joins words with spaces: without prompt context, the first
    # output word comes without one.
    assert out.outputs[0].text == " ".join(f"w{t}" for t in out.outputs[0].token_ids if t > 2)


@pytest.mark.parametrize(
    ("embeds", "message"),
    [
        (torch.randn(5, HIDDEN_SIZE + 1), "has 65 columns; this model's hidden_size is 64"),
        (torch.randn(2, 5, HIDDEN_SIZE), "must be 2-D (num_tokens, hidden_size)"),
        (torch.randn(5), "must be 2-D"),
        (torch.ones(5, HIDDEN_SIZE, dtype=torch.int64), "has dtype int64; it must be"),
        (torch.full((5, HIDDEN_SIZE), float("nan")), "holds NaN or infinite values"),
        (torch.full((5, HIDDEN_SIZE), float("inf")), "holds NaN or infinite values"),
        (torch.zeros(0, HIDDEN_SIZE), "has 0 rows"),
        (torch.randn(MAX_MODEL_LEN + 1, HIDDEN_SIZE),
         f"has {MAX_MODEL_LEN + 1} rows, more than the maximum model length of 256"),
        (torch.randn(5, HIDDEN_SIZE).to_sparse(), "has layout sparse_coo"),
        ([[0.0] * HIDDEN_SIZE], "must hold a tensor, got list"),
    ],
)
def test_bad_embeddings_are_refused_by_name_and_the_engine_goes_on(make_checkpoint, embeds,
                                                                   message) -> None:
    path = make_checkpoint("LlamaForCausalLM")
    llm = _llm(path)
    with pytest.raises(ValueError) as excinfo:
        llm.generate([{"prompt_token_ids": [5, 6]}, {"prompt_embeds": embeds}], _greedy(2),
                     use_tqdm=False)
    assert message in str(excinfo.value)
    assert not llm.llm_engine.has_unfinished_requests()  # nothing was queued
    assert len(llm.generate([[5, 6]], _greedy(2), use_tqdm=False)[0].outputs[0].token_ids) == 2


def test_without_the_flag_embeddings_are_refused(make_checkpoint) -> None:
    llm = _llm(make_checkpoint("LlamaForCausalLM"), enable_prompt_embeds=False)
    with pytest.raises(ValueError, match="enable_prompt_embeds") as excinfo:
        llm.generate([{"prompt_embeds": torch.randn(4, HIDDEN_SIZE)}], _greedy(2),
                     use_tqdm=False)
    assert str(excinfo.value) == PROMPT_EMBEDS_DISABLED


def test_prompt_logprobs_are_refused_for_embeddings(make_checkpoint) -> None:
    llm = _llm(make_checkpoint("LlamaForCausalLM"))
    with pytest.raises(ValueError, match="a prompt given as embeddings has none"):
        llm.generate([{"prompt_embeds": torch.randn(4, HIDDEN_SIZE)}],
                     _greedy(2, prompt_logprobs=1), use_tqdm=False)


def test_the_core_refuses_embeddings_that_do_not_describe_a_valid_prompt(make_checkpoint) -> None:
    """Requests reach the core from another process: bad ones are refused with a reason."""
    llm = _llm(make_checkpoint("LlamaForCausalLM"))
    core = llm.llm_engine.engine_core
    good = PromptEmbeds.from_tensor(torch.randn(4, HIDDEN_SIZE))

    def request(**fields) -> EngineCoreRequest:
        base = {"req_id": "x", "prompt_token_ids": [], "sampling_params": _greedy(2),
                    "eos_token_ids": [2], "arrival_time": 0.0, "cache_salt": b"s", "prompt_embeds": good}
        return EngineCoreRequest(**{**base, **fields})

    cases = [
        ({"cache_salt": None}, "needs their hash as cache_salt"),
        ({"prompt_token_ids": [5]}, "not both"),
        ({"prompt_embeds": PromptEmbeds(good.data[:-4], "float32", 4, HIDDEN_SIZE)},
         "need 1024 bytes, got 1020"),
        ({"prompt_embeds": PromptEmbeds(good.data, "bfloat16", 8, HIDDEN_SIZE)},
         "of dtype bfloat16; the model runs in float32"),
        ({"prompt_embeds": PromptEmbeds(good.data, "float32", 2, 2 * HIDDEN_SIZE)},
         "has 128 columns"),
    ]
    for fields, message in cases:
        with pytest.raises(ValueError, match=message):
            core.add_request(request(**fields))
    assert not core.has_unfinished_requests()


def test_prompt_embeds_cross_as_bytes_and_come_back_equal() -> None:
    import msgspec

    tensor = torch.randn(7, HIDDEN_SIZE, dtype=torch.bfloat16)
    message = EngineCoreRequest("x", [], _greedy(2), [2], 0.0, cache_salt=b"s",
                                prompt_embeds=PromptEmbeds.from_tensor(tensor))
    wire = msgspec.msgpack.encode(message)
    back = msgspec.msgpack.decode(wire, type=EngineCoreRequest)
    assert back.prompt_embeds is not None
    assert back.prompt_embeds.dtype == "bfloat16" and back.prompt_embeds.num_tokens == 7
    assert torch.equal(back.prompt_embeds.to_tensor(), tensor)
    # Raw bytes, not a list of numbers: the tensor's 2 bytes per value and a short header.
    without = msgspec.msgpack.encode(EngineCoreRequest("x", [], _greedy(2), [2], 0.0,
                                                       cache_salt=b"s"))
    assert tensor.numel() * 2 < len(wire) - len(without) < tensor.numel() * 2 + 32


def test_a_constrained_output_of_an_embedding_prompt(demo_checkpoint: Path) -> None:
    """Structured outputs constrain what an embedding prompt generates, as for its ids."""
    from kvferry.engine.sampling_params import StructuredOutputsParams

    llm = LLM(str(demo_checkpoint), dtype="float32", max_model_len=256,
              kv_cache_memory_bytes=32 << 20, enable_prompt_embeds=True)
    ids = llm.get_tokenizer().encode("Describe the river and the town")
    table = _embedding_table(demo_checkpoint)
    params = SamplingParams(temperature=0.0, max_tokens=24, structured_outputs=(
        StructuredOutputsParams(regex=r"(yes|no|maybe) [0-9]{2}")))
    by_ids, by_embeds = llm.generate([{"prompt_token_ids": ids}, {"prompt_embeds": table[ids]}],
                                     params, use_tqdm=False)
    assert re.fullmatch(r"(yes|no|maybe) [0-9]{2}", by_embeds.outputs[0].text)
    assert by_embeds.outputs[0].token_ids == by_ids.outputs[0].token_ids
