"""A live `kvferry serve` of a small random BART checkpoint, through the official client:
/v1/completions (whole, batched, token ids, streamed) equals the offline `LLM.generate` of
the same prompt, greedy: the prompt is the encoder's input, the decoder starts from
[decoder start, BOS]; an encoder prompt longer than the decoder's context (but within the
encoder's) is served. `usage.prompt_tokens` counts the encoder prompt's tokens and the
decoder prompt's. What BART cannot do (chat without a template, audio, echo, a prompt past
the encoder's positions) is a 400 that says so. /tokenize gives the encoder's ids. /metrics
counts the encoder's positions once per distinct prompt and frees the cross-attention
blocks when idle."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import openai
import pytest
from kvferry.engine.frontend.outputs import RequestOutput
from kvferry_testing.encdec_checkpoints import BART_BOS_ID, BART_EOS_ID, make_bart_checkpoint
from kvferry_testing.serve_helpers import ServerProcess

from kvferry import LLM, SamplingParams

# The decoder's context, kept below the encoder's 128 positions (max_position_embeddings),
# so that an encoder prompt may be longer than it.
MAX_MODEL_LEN = 32
MAX_ENCODER_LEN = 128
BLOCK_SIZE = 8
MAX_TOKENS = 12
DECODER_PROMPT = [BART_EOS_ID, BART_BOS_ID]  # BART's decoder start is </s>, then <s>
# A long prompt: more tokens than the decoder's context, fewer than the encoder's.
LONG_PROMPT = " ".join(["Kabo ditu zou lo ga"] * 8)
PROMPTS = ["Kabo ditu zou.", "Lo ga", LONG_PROMPT]
# prompt -> the offline API's greedy output
Expected = dict[str, RequestOutput]


@pytest.fixture(scope="module")
def bart_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_bart_checkpoint(tmp_path_factory.mktemp("bart"), seed=3)


@pytest.fixture(scope="module")
def server(server_factory: Callable[..., ServerProcess], bart_path: Path) -> Iterator[ServerProcess]:
    # Stopped with the module: servers of the whole session would not fit in memory.
    server = server_factory(bart_path, "--served-model-name", "bart",
                          "--max-model-len", str(MAX_MODEL_LEN), "--block-size", str(BLOCK_SIZE),
                          "--dtype", "float32", "--device", "cpu", "--enable-prefix-caching")
    yield server
    server.kill_group()


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0,
                         timeout=60)


@pytest.fixture(scope="module")
def offline(bart_path: Path) -> LLM:
    return LLM(model=str(bart_path), max_model_len=MAX_MODEL_LEN, block_size=BLOCK_SIZE,
               dtype="float32", device="cpu", num_gpu_blocks_override=200)


@pytest.fixture(scope="module")
def expected(offline: LLM) -> Expected:
    outputs = offline.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS),
                               use_tqdm=False)
    for out in outputs:
        assert out.prompt_token_ids == DECODER_PROMPT
        assert out.outputs[0].token_ids
    assert len(outputs[-1].encoder_prompt_token_ids) > MAX_MODEL_LEN
    return dict(zip(PROMPTS, outputs))


def test_completions_equal_the_offline_api(client: openai.OpenAI, expected: Expected) -> None:
    for prompt, offline_out in expected.items():
        out = client.completions.create(model="bart", prompt=prompt, max_tokens=MAX_TOKENS,
                                        temperature=0)
        (choice,) = out.choices
        assert choice.text == offline_out.outputs[0].text
        assert choice.finish_reason == offline_out.outputs[0].finish_reason
        assert out.usage is not None
        assert out.usage.prompt_tokens == (len(offline_out.encoder_prompt_token_ids)
                                           + len(DECODER_PROMPT))
        assert out.usage.completion_tokens == len(offline_out.outputs[0].token_ids)
        assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens


def test_a_batch_and_token_id_prompts_equal_the_offline_api(client: openai.OpenAI,
                                                            expected: Expected) -> None:
    batch = client.completions.create(model="bart", prompt=PROMPTS, max_tokens=MAX_TOKENS,
                                      temperature=0)
    texts = [c.text for c in sorted(batch.choices, key=lambda c: c.index)]
    assert texts == [expected[p].outputs[0].text for p in PROMPTS]
    assert batch.usage.prompt_tokens == sum(
        len(expected[p].encoder_prompt_token_ids) + len(DECODER_PROMPT) for p in PROMPTS)
    ids = expected[PROMPTS[0]].encoder_prompt_token_ids
    by_ids = client.completions.create(model="bart", prompt=ids, max_tokens=MAX_TOKENS,
                                       temperature=0)
    assert by_ids.choices[0].text == expected[PROMPTS[0]].outputs[0].text
    assert by_ids.usage.prompt_tokens == len(ids) + len(DECODER_PROMPT)


def test_a_streamed_completion_equals_the_offline_api(client: openai.OpenAI,
                                                      expected: Expected) -> None:
    for prompt, offline_out in expected.items():
        chunks = list(client.completions.create(
            model="bart", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, stream=True,
            stream_options={"include_usage": True}))
        text_chunks = [c for c in chunks if c.choices]
        assert "".join(c.choices[0].text for c in text_chunks) == offline_out.outputs[0].text
        assert text_chunks[-1].choices[0].finish_reason == offline_out.outputs[0].finish_reason
        usage = chunks[-1].usage
        assert usage.prompt_tokens == len(offline_out.encoder_prompt_token_ids) + 2
        assert usage.completion_tokens == len(offline_out.outputs[0].token_ids)


def bad_request(call: Callable[[], object]) -> dict:
    with pytest.raises(openai.BadRequestError) as caught:
        call()
    body = caught.value.body
    assert isinstance(body, dict) and body["type"] == "invalid_request_error"
    return body


def test_what_bart_cannot_do_is_a_400_that_says_so(client: openai.OpenAI,
                                                   expected: Expected) -> None:
    chat = bad_request(lambda: client.chat.completions.create(
        model="bart", messages=[{"role": "user", "content": "hi"}], max_tokens=2))
    assert chat["param"] == "messages"
    assert chat["message"].startswith("this model has no chat template")
    audio = bad_request(lambda: client.audio.transcriptions.create(
        model="bart", file=("a.wav", b"RIFF")))
    assert audio["param"] == "model"
    assert audio["message"] == ("this model does not take audio: /v1/audio/transcriptions "
                                "needs a Whisper model, and this server serves "
                                "BartForConditionalGeneration")
    echo = bad_request(lambda: client.completions.create(
        model="bart", prompt="Lo ga", max_tokens=2, echo=True))
    assert echo["param"] == "echo" and "encoder-decoder" in echo["message"]
    # The decoder's context bounds the decoder prompt (2 tokens) and the output.
    too_many = bad_request(lambda: client.completions.create(
        model="bart", prompt="Lo ga", max_tokens=MAX_MODEL_LEN - 1))
    assert too_many["param"] == "max_tokens"
    assert "2 + 31 passes the maximum model length of 32" in too_many["message"]
    # The encoder's positions bound the prompt, text or ids.
    long_text = bad_request(lambda: client.completions.create(
        model="bart", prompt="Kabo ditu " * 400, max_tokens=2))
    assert long_text["param"] == "prompt"
    assert long_text["message"].endswith(f"more than the encoder's maximum of {MAX_ENCODER_LEN}")
    long_ids = bad_request(lambda: client.completions.create(
        model="bart", prompt=[5] * (MAX_ENCODER_LEN + 1), max_tokens=2))
    assert long_ids["message"] == (f"the encoder prompt has {MAX_ENCODER_LEN + 1} tokens, more "
                                   f"than the encoder's maximum of {MAX_ENCODER_LEN}")
    # And the server goes on.
    out = client.completions.create(model="bart", prompt="Lo ga", max_tokens=MAX_TOKENS,
                                    temperature=0)
    assert out.choices[0].text == expected["Lo ga"].outputs[0].text


def test_tokenize_gives_the_encoders_ids(server: ServerProcess, expected: Expected) -> None:
    offline_out = expected[LONG_PROMPT]
    out = httpx.post(f"{server.url}/tokenize", json={"prompt": LONG_PROMPT}, timeout=60).json()
    assert out["tokens"] == offline_out.encoder_prompt_token_ids
    assert out["count"] == len(offline_out.encoder_prompt_token_ids)
    back = httpx.post(f"{server.url}/detokenize", json={"tokens": out["tokens"]},
                      timeout=60).json()
    assert back["prompt"] == LONG_PROMPT


def test_metrics_count_encoder_positions_once_per_distinct_prompt(
        server: ServerProcess, client: openai.OpenAI, offline: LLM) -> None:
    server.wait_metric("kvferry:cross_attention_blocks_in_use", 0)
    before = server.metric("kvferry:encoder_tokens_total")
    prompts = [f"Mu bou {word} ga lo zou ditu kabo." for word in ("ke", "vi", "sou")]
    lengths = [len(offline.get_tokenizer().encode(p)) for p in prompts]
    calls = [functools.partial(client.completions.create, model="bart", prompt=p,
                               max_tokens=MAX_TOKENS, temperature=0, extra_body={
                                   "ignore_eos": True})
             for p in prompts for _ in range(3)]
    peak = server.peak_metric_while("kvferry:cross_attention_blocks_in_use", calls,
                                    concurrency=3)
    assert server.metric("kvferry:encoder_tokens_total") - before == sum(lengths)
    assert peak > 0
    server.wait_metric("kvferry:cross_attention_blocks_in_use", 0)
    assert server.metric("kvferry:num_requests_waiting_for_encoder") == 0
    # A refused request runs nothing.
    bad_request(lambda: client.completions.create(model="bart", prompt=[5] * 200,
                                                  max_tokens=2))
    assert server.metric("kvferry:encoder_tokens_total") - before == sum(lengths)


def test_a_stream_left_early_frees_its_cross_blocks(server: ServerProcess) -> None:
    body = {"model": "bart", "prompt": "Ke vi sou kabo.", "max_tokens": MAX_MODEL_LEN - 2,
            "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as r:
        first = next(line for line in r.iter_lines() if line.startswith("data: "))
        assert '"finish_reason":null' in first
    server.wait_metric("vllm:num_requests_running", 0)
    server.wait_metric("kvferry:cross_attention_blocks_in_use", 0)
    assert "finish_reason=abort" in server.log()


def test_the_server_logged_no_traceback(server: ServerProcess) -> None:
    assert "Traceback" not in server.log()
