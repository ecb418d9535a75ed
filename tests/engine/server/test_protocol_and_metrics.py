"""Pure pieces of the server: request models to SamplingParams, error messages, chat
templates, logprob shapes, and the Prometheus metrics fed by the stats listener."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from kvferry.engine.core.messages import SchedulerStats
from kvferry.engine.frontend.outputs import Logprob
from kvferry.engine.server.chat import chat_logprobs
from kvferry.engine.server.chat_template import load_chat_template, render_chat
from kvferry.engine.server.completions import completion_logprobs
from kvferry.engine.server.errors import ApiError, validation_message
from kvferry.engine.server.metrics import EngineMetrics
from kvferry.engine.server.protocol import (
    ChatCompletionRequest,
    ChatDelta,
    CompletionRequest,
    param_of_message,
)
from kvferry.engine.frontend.stats import IterationStats


def test_completion_request_to_sampling_params() -> None:
    body = CompletionRequest.model_validate({
        "prompt": "hi", "max_tokens": 7, "temperature": 0, "top_k": 5, "seed": 3, "stop": "x",
        "stop_token_ids": [4], "n": 2, "logprobs": 2, "min_tokens": 1, "ignore_eos": True})
    params = body.to_sampling_params()
    assert (params.max_tokens, params.temperature, params.top_k, params.seed) == (7, 0, 5, 3)
    assert (params.stop, params.stop_token_ids, params.n, params.logprobs) == (["x"], [4], 2, 2)
    assert params.min_tokens == 1 and params.ignore_eos


def test_defaults_follow_openai() -> None:
    params = CompletionRequest(prompt="hi").to_sampling_params()
    assert (params.max_tokens, params.temperature, params.top_p, params.n) == (16, 1.0, 1.0, 1)
    chat = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "a"}]})
    assert chat.to_sampling_params().max_tokens is None  # up to the model's length


def test_chat_token_limits_and_logprobs() -> None:
    base = {"messages": [{"role": "user", "content": "a"}]}
    body = ChatCompletionRequest.model_validate({**base, "max_tokens": 9,
                                                 "max_completion_tokens": 4, "logprobs": True,
                                                 "top_logprobs": 3})
    params = body.to_sampling_params()
    assert params.max_tokens == 4 and params.logprobs == 3
    assert ChatCompletionRequest.model_validate({**base, "logprobs": True}
                                                ).to_sampling_params().logprobs == 0


@pytest.mark.parametrize(("prompt", "batch"), [
    ("a", ["a"]), (["a", "b"], ["a", "b"]), ([1, 2], [[1, 2]]), ([[1], [2, 3]], [[1], [2, 3]]),
])
def test_prompt_forms(prompt: object, batch: list[object]) -> None:
    assert CompletionRequest.model_validate({"prompt": prompt}).prompts() == batch


def test_value_errors_name_the_field() -> None:
    with pytest.raises(ApiError) as info:
        CompletionRequest(prompt="a", top_p=0).to_sampling_params()
    assert info.value.status == 400 and info.value.param == "top_p"
    assert "top_p must be in (0, 1], got 0" in info.value.message
    assert param_of_message("stop[2] must be a non-empty string") == "stop"
    assert param_of_message("the prompt is empty") is None


def test_type_errors_name_the_field() -> None:
    with pytest.raises(ValidationError) as info:
        ChatCompletionRequest.model_validate({"messages": [{"role": "u", "content": 5}]})
    message, param = validation_message(info.value.errors())
    assert param == "messages[0].content"
    assert message.startswith("messages[0].content: ")
    with pytest.raises(ValidationError) as info:
        CompletionRequest.model_validate({"prompt": "a", "temperature": float("inf")})
    assert validation_message(info.value.errors()) == (
        "temperature: Input should be a finite number", "temperature")


def test_chat_delta_leaves_out_what_is_unset() -> None:
    assert ChatDelta(content="x").model_dump() == {"content": "x"}
    assert ChatDelta(role="assistant", content="").model_dump() == {"role": "assistant",
                                                                    "content": ""}


def test_chat_templates(tmp_path) -> None:  # noqa: ANN001
    from kvferry.engine.models.demo import CHAT_TEMPLATE

    text = render_chat(CHAT_TEMPLATE, [{"role": "user", "content": "hi"}],
                       add_generation_prompt=True, special_tokens={})
    assert text == "<|user|>\nhi</s>\n<|assistant|>\n"
    with pytest.raises(ApiError) as info:
        render_chat(None, [], add_generation_prompt=True, special_tokens={})
    assert info.value.status == 400 and "no chat template" in info.value.message
    refusing = "{{ raise_exception('only user turns') }}"
    with pytest.raises(ApiError, match="only user turns"):
        render_chat(refusing, [], add_generation_prompt=True, special_tokens={})
    path = tmp_path / "t.jinja"
    path.write_text("{{ messages[0]['content'] }}")
    assert load_chat_template(str(path), "tokenizer's") == "{{ messages[0]['content'] }}"
    assert load_chat_template(None, "tokenizer's") == "tokenizer's"
    with pytest.raises(ValueError, match="neither a file"):
        load_chat_template("/no/such/file", None)


def _positions() -> list[dict[int, Logprob]]:
    return [
        {7: Logprob(-0.1, 1, "ab"), 9: Logprob(-2.0, 2, "c")},
        {4: Logprob(-3.0, 3, "d"), 5: Logprob(-0.5, 1, "e"), 6: Logprob(-1.0, 2, "f")},
    ]


def test_completion_logprobs_shape() -> None:
    out = completion_logprobs([7, 4], _positions(), text_offset=10)
    assert out.tokens == ["ab", "d"]
    assert out.token_logprobs == [-0.1, -3.0]
    assert out.text_offset == [10, 12]
    assert out.top_logprobs == [{"ab": -0.1, "c": -2.0}, {"d": -3.0, "e": -0.5, "f": -1.0}]


def test_chat_logprobs_shape() -> None:
    out = chat_logprobs([7, 4], _positions(), num_top=2)
    first, second = out.content
    assert (first.token, first.logprob, first.bytes) == ("ab", -0.1, [97, 98])
    assert [t.token for t in first.top_logprobs] == ["ab", "c"]
    # The sampled token (rank 3) is not among the top 2 alternatives.
    assert second.token == "d" and [t.token for t in second.top_logprobs] == ["e", "f"]


def _sample(metrics: EngineMetrics, name: str, **labels: str) -> float | None:
    return metrics.registry.get_sample_value(name, {"model_name": "m", **labels})


def test_metrics_follow_the_stats_listener() -> None:
    metrics = EngineMetrics("m", block_size=16, num_gpu_blocks=99, enable_prefix_caching=True)
    assert _sample(metrics, "vllm:cache_config_info", block_size="16", num_gpu_blocks="99",
                   enable_prefix_caching="True") == 1.0
    metrics.record(SchedulerStats(3, 2, 0.25, prefix_cache_queries=10, prefix_cache_hits=4,
                                  num_preemptions=1),
                   IterationStats(num_prompt_tokens=12, num_generation_tokens=3,
                                  time_to_first_tokens=[0.2], inter_token_latencies=[0.01, 0.03],
                                  e2e_latencies=[1.5], finish_reasons=["stop"],
                                  queue_times=[0.05]))
    # Cumulative scheduler counters: only their growth is added.
    metrics.record(SchedulerStats(0, 0, 0.0, prefix_cache_queries=16, prefix_cache_hits=8,
                                  num_preemptions=1),
                   IterationStats(num_generation_tokens=2, finish_reasons=["length", "abort"]))
    assert _sample(metrics, "vllm:num_requests_running") == 0
    assert _sample(metrics, "vllm:kv_cache_usage_perc") == 0.0
    assert _sample(metrics, "vllm:prompt_tokens_total") == 12
    assert _sample(metrics, "vllm:generation_tokens_total") == 5
    assert _sample(metrics, "vllm:prefix_cache_queries_total") == 16
    assert _sample(metrics, "vllm:prefix_cache_hits_total") == 8
    assert _sample(metrics, "vllm:num_preemptions_total") == 1
    for reason, count in (("stop", 1), ("length", 1), ("abort", 1), ("error", 0)):
        assert _sample(metrics, "vllm:request_success_total", finished_reason=reason) == count
    assert _sample(metrics, "vllm:time_to_first_token_seconds_count") == 1
    assert _sample(metrics, "vllm:inter_token_latency_seconds_sum") == pytest.approx(0.04)
    assert _sample(metrics, "vllm:time_per_output_token_seconds_count") == 2
    assert _sample(metrics, "vllm:e2e_request_latency_seconds_bucket", le="2.0") == 1
    assert _sample(metrics, "vllm:request_queue_time_seconds_count") == 1
    text = metrics.render().decode()
    assert 'vllm:num_requests_waiting{model_name="m"} 0.0' in text
