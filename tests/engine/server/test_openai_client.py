"""The official `openai` client against a live `kvferry serve`, and greedy output equal to
the offline `LLM.generate` on the same checkpoint."""

from __future__ import annotations

from pathlib import Path

import openai
import pytest

from kvferry_testing.serve_helpers import API_KEY, KV_CACHE_BYTES, MAX_MODEL_LEN, ServerProcess

# Every token decodes to one word: special tokens (EOS, <unk>) stay in the text.
RAW = {"ignore_eos": True, "skip_special_tokens": False}
PROMPTS = ["w5 w6 w7", "w10 w11 w12 w13 w14", "w100", "w200 w3 w3 w3 w9"]


@pytest.fixture(scope="module")
def client(live_server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{live_server.url}/v1", api_key=API_KEY, max_retries=0,
                         timeout=60)


def test_models_lists_the_served_name(client: openai.OpenAI) -> None:
    models = client.models.list()
    assert [m.id for m in models.data] == ["tiny"]


def test_completion_fields_and_usage(client: openai.OpenAI) -> None:
    out = client.completions.create(model="tiny", prompt="w5 w6 w7", max_tokens=5,
                                    temperature=0, extra_body=RAW)
    assert out.object == "text_completion" and out.model == "tiny"
    assert out.id.startswith("cmpl-")
    (choice,) = out.choices
    assert choice.finish_reason == "length"
    assert len(choice.text.split()) == 5  # word-level tokenizer: one word per token
    assert out.usage is not None
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (3, 5)
    assert out.usage.total_tokens == 8


def test_greedy_completions_equal_offline_generate(client: openai.OpenAI,
                                                   tiny_model: Path) -> None:
    from kvferry.engine.frontend.llm import LLM
    from kvferry.engine.sampling_params import SamplingParams

    llm = LLM(model=str(tiny_model), max_model_len=MAX_MODEL_LEN,
              kv_cache_memory_bytes=KV_CACHE_BYTES, device="cpu")
    offline = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)
    # One batched request, and one request per prompt: both must match.
    batched = client.completions.create(model="tiny", prompt=PROMPTS, max_tokens=12,
                                        temperature=0)
    by_index = sorted(batched.choices, key=lambda c: c.index)
    assert [c.text for c in by_index] == [o.outputs[0].text for o in offline]
    for prompt, expected in zip(PROMPTS, offline):
        single = client.completions.create(model="tiny", prompt=prompt, max_tokens=12,
                                           temperature=0)
        assert single.choices[0].text == expected.outputs[0].text
        assert single.choices[0].finish_reason == expected.outputs[0].finish_reason


def test_token_id_prompts(client: openai.OpenAI) -> None:
    text = client.completions.create(model="tiny", prompt="w5 w6 w7", max_tokens=6, temperature=0)
    # The word-level tokenizer adds no BOS: "w5 w6 w7" is [5, 6, 7].
    ids = client.completions.create(model="tiny", prompt=[5, 6, 7], max_tokens=6, temperature=0)
    batch = client.completions.create(model="tiny", prompt=[[5, 6, 7], [5, 6, 7]], max_tokens=6,
                                      temperature=0)
    assert ids.choices[0].text == text.choices[0].text
    assert [c.text for c in batch.choices] == [text.choices[0].text] * 2
    assert [c.index for c in batch.choices] == [0, 1]


def test_streaming_completion_chunks_and_usage(client: openai.OpenAI) -> None:
    stream = client.completions.create(model="tiny", prompt="w5 w6 w7", max_tokens=8,
                                       temperature=0, stream=True,
                                       stream_options={"include_usage": True},
                                       extra_body=RAW)
    chunks = list(stream)
    text_chunks = [c for c in chunks if c.choices]
    assert len(text_chunks) >= 3  # several chunks before the last
    assert all(c.usage is None for c in text_chunks)
    assert text_chunks[-1].choices[0].finish_reason == "length"
    assert all(c.choices[0].finish_reason is None for c in text_chunks[:-1])
    final = chunks[-1]
    assert final.choices == [] and final.usage is not None
    assert (final.usage.prompt_tokens, final.usage.completion_tokens) == (3, 8)
    whole = client.completions.create(model="tiny", prompt="w5 w6 w7", max_tokens=8,
                                      temperature=0, extra_body=RAW)
    assert "".join(c.choices[0].text for c in text_chunks) == whole.choices[0].text


def test_chat_completion(client: openai.OpenAI) -> None:
    messages = [{"role": "system", "content": "w3 w4"}, {"role": "user", "content": "w5 w6"}]
    out = client.chat.completions.create(model="tiny", messages=messages, max_tokens=4,
                                         temperature=0, extra_body=RAW)
    assert out.object == "chat.completion"
    (choice,) = out.choices
    assert choice.message.role == "assistant"
    assert len(choice.message.content.split()) == 4
    assert choice.finish_reason == "length"
    # The template renders "system w3 w4 user w5 w6 assistant " (role words are <unk>).
    assert out.usage.prompt_tokens == 7 and out.usage.completion_tokens == 4


def test_chat_max_completion_tokens_and_generation_prompt(client: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": "w5 w6"}]
    out = client.chat.completions.create(model="tiny", messages=messages, temperature=0,
                                         max_completion_tokens=3,
                                         extra_body={**RAW, "add_generation_prompt": False})
    assert out.usage.completion_tokens == 3
    assert out.usage.prompt_tokens == 3  # "user w5 w6", no "assistant" header


def test_chat_streaming(client: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": "w5 w6"}]
    chunks = list(client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=6, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body=RAW))
    assert chunks[0].choices[0].delta.role == "assistant"
    content = [c for c in chunks if c.choices and c.choices[0].delta.content]
    assert len(content) >= 3
    assert chunks[-1].usage.completion_tokens == 6 and chunks[-1].choices == []
    whole = client.chat.completions.create(model="tiny", messages=messages, max_tokens=6,
                                           temperature=0, extra_body=RAW)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == \
        whole.choices[0].message.content


def test_n_2_gives_two_different_choices(client: openai.OpenAI) -> None:
    out = client.completions.create(model="tiny", prompt="w5 w6 w7", max_tokens=10, n=2,
                                    temperature=1.0, seed=3, extra_body=RAW)
    assert sorted(c.index for c in out.choices) == [0, 1]
    assert out.choices[0].text != out.choices[1].text
    assert out.usage.completion_tokens == 20
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user",
                                          "content": "w5"}], n=2, max_tokens=5, seed=4,
                                          extra_body=RAW)
    assert sorted(c.index for c in chat.choices) == [0, 1]


def test_seed_reproducibility(client: openai.OpenAI) -> None:
    def sample(seed: int) -> str:
        out = client.completions.create(model="tiny", prompt="w5 w6 w7", max_tokens=12,
                                        temperature=1.0, seed=seed,
                                        extra_body=RAW)
        return out.choices[0].text

    first = sample(1234)
    assert sample(1234) == first
    assert sample(99) != first


def test_completion_logprobs(client: openai.OpenAI) -> None:
    out = client.completions.create(model="tiny", prompt="w5 w6 w7", max_tokens=4,
                                    temperature=0, logprobs=3, extra_body=RAW)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    assert " ".join(lp.tokens) == out.choices[0].text.strip()
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert logprob <= 0.0
        assert 3 <= len(top) <= 4
        # Greedy: the sampled token is the most likely one.
        assert max(top.values()) == pytest.approx(logprob)
        assert top[token] == pytest.approx(logprob)
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)


def test_chat_logprobs(client: openai.OpenAI) -> None:
    out = client.chat.completions.create(model="tiny", messages=[{"role": "user",
                                         "content": "w5"}], max_tokens=3, temperature=0,
                                         logprobs=True, top_logprobs=2,
                                         extra_body=RAW)
    content = out.choices[0].logprobs.content
    assert len(content) == 3
    for entry in content:
        assert len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].token == entry.token
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob)
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
        assert entry.bytes == list(entry.token.encode())


def test_stop_string_ends_the_completion(client: openai.OpenAI) -> None:
    free = client.completions.create(model="tiny", prompt="w5 w6 w7", max_tokens=10,
                                     temperature=0, extra_body=RAW)
    words = free.choices[0].text.split()
    stop_word = words[3]
    first = words.index(stop_word)
    out = client.completions.create(model="tiny", prompt="w5 w6 w7", max_tokens=10,
                                    temperature=0, stop=[stop_word],
                                    extra_body=RAW)
    choice = out.choices[0]
    assert choice.finish_reason == "stop"
    assert choice.model_extra["stop_reason"] == stop_word
    assert choice.text.split() == words[:first]
    streamed = client.completions.create(model="tiny", prompt="w5 w6 w7", max_tokens=10,
                                         temperature=0, stop=stop_word, stream=True,
                                         extra_body=RAW)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == choice.text


def test_echo_puts_the_prompt_first(client: openai.OpenAI) -> None:
    plain = client.completions.create(model="tiny", prompt="w5 w6 w7", max_tokens=4,
                                      temperature=0)
    echoed = client.completions.create(model="tiny", prompt="w5 w6 w7", max_tokens=4,
                                       temperature=0, echo=True)
    assert echoed.choices[0].text == "w5 w6 w7" + plain.choices[0].text
    streamed = client.completions.create(model="tiny", prompt="w5 w6 w7", max_tokens=4,
                                         temperature=0, echo=True, stream=True)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == echoed.choices[0].text


def test_priority_and_user_are_accepted(client: openai.OpenAI) -> None:
    out = client.completions.create(model="tiny", prompt="w5", max_tokens=2, user="alice",
                                    extra_body={"priority": -3})
    assert out.usage.completion_tokens <= 2
