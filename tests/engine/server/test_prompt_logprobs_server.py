"""vLLM's `prompt_logprobs` and OpenAI's `echo` with `logprobs` through a live `kvferry serve`:
the values equal the log-softmax HF transformers computes over the same weights."""

from __future__ import annotations

from pathlib import Path

import httpx
import openai
import pytest
import torch
from kvferry_testing.serve_helpers import API_KEY, ServerProcess

PROMPT_IDS = [5, 6, 7, 30, 31, 9]  # the word-level tokenizer: "w5 w6 w7 w30 w31 w9"
PROMPT = " ".join(f"w{t}" for t in PROMPT_IDS)


@pytest.fixture(scope="module")
def expected(tiny_model: Path, hf_model) -> torch.Tensor:
    """(len(PROMPT_IDS) - 1, vocab) HF log-softmax predicting prompt tokens 1..P-1."""
    with torch.no_grad():
        logits = hf_model(tiny_model)(torch.tensor([PROMPT_IDS])).logits[0, :-1].float()
    return logits.log_softmax(dim=-1)


def post(server: ServerProcess, body: dict) -> dict:
    response = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60,
                          headers={"Authorization": f"Bearer {API_KEY}"})
    assert response.status_code == 200, response.text
    return response.json()


def test_prompt_logprobs_equal_hf(live_server: ServerProcess, expected: torch.Tensor) -> None:
    out = post(live_server, {"model": "tiny", "prompt": PROMPT, "max_tokens": 2,
                             "temperature": 0, "prompt_logprobs": 2})
    table = out["choices"][0]["prompt_logprobs"]
    assert len(table) == len(PROMPT_IDS) and table[0] is None
    for position, token_id in enumerate(PROMPT_IDS[1:], start=1):
        row = expected[position - 1]
        entry = table[position]
        mine = entry[str(token_id)]
        assert mine["logprob"] == pytest.approx(float(row[token_id]), abs=2e-4)
        assert mine["rank"] == int((row > row[token_id]).sum()) + 1
        assert mine["decoded_token"] == f"w{token_id}"
        top_values, top_ids = row.topk(2)
        for token, value in zip(top_ids.tolist(), top_values.tolist()):
            assert entry[str(token)]["logprob"] == pytest.approx(value, abs=2e-4)


def test_without_prompt_logprobs_the_choice_has_no_such_field(live_server: ServerProcess) -> None:
    out = post(live_server, {"model": "tiny", "prompt": PROMPT, "max_tokens": 2})
    assert "prompt_logprobs" not in out["choices"][0]


@pytest.mark.parametrize("stream", [False, True])
def test_echo_with_logprobs_scores_the_prompt_then_the_completion(
        live_server: ServerProcess, expected: torch.Tensor, stream: bool) -> None:
    client = openai.OpenAI(base_url=f"{live_server.url}/v1", api_key=API_KEY, max_retries=0)
    kwargs = dict(model="tiny", prompt=PROMPT, max_tokens=3, temperature=0, echo=True,
                  logprobs=1, extra_body={"ignore_eos": True, "skip_special_tokens": False})
    if stream:
        chunks = [c for c in client.completions.create(stream=True, **kwargs) if c.choices]
        text = "".join(c.choices[0].text for c in chunks)
        tokens = [t for c in chunks if c.choices[0].logprobs
                  for t in c.choices[0].logprobs.tokens]
        token_logprobs = [v for c in chunks if c.choices[0].logprobs
                          for v in c.choices[0].logprobs.token_logprobs]
        offsets = [o for c in chunks if c.choices[0].logprobs
                   for o in c.choices[0].logprobs.text_offset]
    else:
        choice = client.completions.create(**kwargs).choices[0]
        text = choice.text
        tokens, token_logprobs = choice.logprobs.tokens, choice.logprobs.token_logprobs
        offsets = choice.logprobs.text_offset
    assert text.startswith(PROMPT)
    assert tokens[:len(PROMPT_IDS)] == [f"w{t}" for t in PROMPT_IDS]
    assert len(tokens) == len(PROMPT_IDS) + 3
    assert token_logprobs[0] is None
    for position, token_id in enumerate(PROMPT_IDS[1:], start=1):
        assert token_logprobs[position] == pytest.approx(
            float(expected[position - 1][token_id]), abs=2e-4)
    assert all(v is not None for v in token_logprobs[len(PROMPT_IDS):])
    # The prompt's tokens come first, the completion's offsets start after the prompt.
    assert offsets[0] == 0 and offsets == sorted(offsets)
    assert offsets[len(PROMPT_IDS)] == len(PROMPT)
