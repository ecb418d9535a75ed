"""logit_bias and allowed_token_ids through a live `kvferry serve` and the official client."""

from __future__ import annotations

import openai
import pytest
from kvferry_testing.serve_helpers import API_KEY, ServerProcess

# Every token decodes to one word ("w42" is token 42): special tokens stay in the text.
RAW = {"ignore_eos": True, "skip_special_tokens": False}


@pytest.fixture(scope="module")
def client(live_server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{live_server.url}/v1", api_key=API_KEY, max_retries=0,
                         timeout=60)


@pytest.mark.parametrize("temperature", [0.0, 1.0, 1.8])
def test_a_bias_of_100_makes_every_sampled_token_that_token(client: openai.OpenAI,
                                                           temperature: float) -> None:
    out = client.completions.create(model="tiny", prompt="w5 w6 w7", max_tokens=10, n=2,
                                    temperature=temperature, logit_bias={"42": 100},
                                    extra_body=RAW)
    assert [c.text.split() for c in out.choices] == [["w42"] * 10] * 2


def test_a_bias_in_chat_streamed(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "w5 w6"}], max_tokens=6,
        temperature=1.0, logit_bias={"77": 100}, stream=True, extra_body=RAW)
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text.split() == ["w77"] * 6


def test_minus_100_bans_the_greedy_choice(client: openai.OpenAI) -> None:
    plain = client.completions.create(model="tiny", prompt="w9 w8", max_tokens=1,
                                      temperature=0, extra_body=RAW)
    first = int(plain.choices[0].text.split()[0].removeprefix("w"))
    banned = client.completions.create(model="tiny", prompt="w9 w8", max_tokens=1,
                                       temperature=0, logit_bias={str(first): -100},
                                       extra_body=RAW)
    assert banned.choices[0].text.split() != plain.choices[0].text.split()


def test_allowed_token_ids_limit_what_is_sampled(client: openai.OpenAI) -> None:
    out = client.completions.create(model="tiny", prompt="w5", max_tokens=12, temperature=1.5,
                                    extra_body={**RAW, "allowed_token_ids": [11, 12, 13]})
    assert set(out.choices[0].text.split()) <= {"w11", "w12", "w13"}


@pytest.mark.parametrize(("extra", "message"), [
    ({"logit_bias": {"w5": 1}}, "logit_bias keys must be token ids"),
    ({"logit_bias": {"5": 100.5}}, "logit_bias[5] must be in [-100, 100]"),
    ({"logit_bias": {"5": "1"}}, "logit_bias[5]: Input should be a valid number"),
    ({"logit_bias": {"99999999": 1}}, "outside the vocabulary"),
    ({"logit_bias": [5]}, "logit_bias"),
    ({"allowed_token_ids": []}, "allowed_token_ids must not be empty"),
    ({"allowed_token_ids": [99999999]}, "outside the vocabulary"),
    ({"allowed_token_ids": [True]}, "allowed_token_ids[0]"),
])
def test_bad_constraints_are_400s_naming_the_field(client: openai.OpenAI, extra: dict,
                                                   message: str) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model="tiny", prompt="w5", max_tokens=2, extra_body=extra)
    error = caught.value.body
    assert isinstance(error, dict)
    assert message in error["message"], error
    field = next(iter(extra))
    assert error["param"].startswith(field), error
