"""`prompt_embeds` on /v1/completions with the official `openai` client: the output of
`embed_tokens(ids)` equals that of the ids for every decoder-only family; hostile payloads
are 400s that name their check while the server goes on serving (nothing they hold runs,
nothing they declare is allocated); finished requests leave the engine's memory flat."""

from __future__ import annotations

import concurrent.futures
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import torch
from kvferry_testing.embeds import (
    b64,
    code_running_archive,
    code_running_pickle,
    embedding_table,
    encode,
    huge_sparse,
    out_of_bounds_sparse,
    rss_bytes,
    saved,
    with_member,
)
from kvferry_testing.serve_helpers import MAX_MODEL_LEN, ServerProcess

ARCHITECTURES = ["LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"]
HIDDEN_SIZE = 64
# Small limits, so a test can go past them: bodies without prompt_embeds may be this large,
BODY_LIMIT = 64 * 1024
# and /v1/completions bodies with them this large.
EMBEDS_BODY_LIMIT = 4 * 1024 * 1024
PROMPTS = [[5, 6, 7], [10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26],
           [200], list(range(30, 130))]
GREEDY = {"max_tokens": 10, "temperature": 0.0}
RAW = {"ignore_eos": True, "skip_special_tokens": False}


def start_embeds_server(server_factory: Callable[..., ServerProcess], checkpoint: Path,
                        *flags: str) -> ServerProcess:
    return server_factory(checkpoint, "--served-model-name", "tiny", "--enable-prompt-embeds",
                          "--max-body-bytes", str(BODY_LIMIT),
                          "--max-embeds-body-bytes", str(EMBEDS_BODY_LIMIT), *flags)


@pytest.fixture(scope="module", params=ARCHITECTURES)
def family(request, make_checkpoint, server_factory) -> tuple[ServerProcess, torch.Tensor]:
    checkpoint = make_checkpoint(request.param)
    return start_embeds_server(server_factory, checkpoint), embedding_table(checkpoint)


@pytest.fixture(scope="module")
def llama(make_checkpoint, server_factory) -> tuple[ServerProcess, torch.Tensor]:
    checkpoint = make_checkpoint("LlamaForCausalLM")
    return start_embeds_server(server_factory, checkpoint), embedding_table(checkpoint)


def client_of(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=60)


def post(server: ServerProcess, body: dict[str, Any], **kwargs: Any) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/completions", json={"model": "tiny", **body},
                      timeout=60, **kwargs)


def assert_refused(server: ServerProcess, body: dict[str, Any], message: str,
                   param: str = "prompt_embeds") -> None:
    response = post(server, body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert message in error["message"], error["message"]
    assert error["param"] == param


def assert_serving(server: ServerProcess, table: torch.Tensor) -> None:
    response = post(server, {"prompt_embeds": encode(table[[5, 6, 7]]), "max_tokens": 2})
    assert response.status_code == 200, response.text
    assert len(response.json()["choices"][0]["text"].split()) <= 2


def test_embeddings_give_the_token_ids_output_through_the_openai_client(family) -> None:
    server, table = family
    client = client_of(server)
    for prompt in PROMPTS:
        by_ids = client.completions.create(model="tiny", prompt=prompt, **GREEDY, extra_body=RAW)
        # The official client needs a prompt: "" beside prompt_embeds is none (as for vLLM).
        by_embeds = client.completions.create(
            model="tiny", prompt="", **GREEDY,
            extra_body={**RAW, "prompt_embeds": encode(table[prompt])})
        # The same tokens; without prompt tokens as context, the first word comes without
        # the space that joins it to a prompt.
        assert by_embeds.choices[0].text == by_ids.choices[0].text.removeprefix(" ")
        assert by_embeds.choices[0].finish_reason == "length"
        assert by_embeds.usage is not None
        assert by_embeds.usage.prompt_tokens == len(prompt)
        assert by_embeds.usage.completion_tokens == 10


def test_a_batch_a_stream_and_echo(llama) -> None:
    server, table = llama
    client = client_of(server)
    expected = [client.completions.create(model="tiny", prompt=p, **GREEDY, extra_body=RAW)
                .choices[0].text.removeprefix(" ") for p in PROMPTS[:2]]
    batch = client.completions.create(
        model="tiny", prompt="", **GREEDY,
        extra_body={**RAW, "prompt_embeds": [encode(table[p]) for p in PROMPTS[:2]]})
    assert [c.text for c in sorted(batch.choices, key=lambda c: c.index)] == expected
    stream = client.completions.create(
        model="tiny", prompt="", stream=True, **GREEDY,
        extra_body={**RAW, "prompt_embeds": encode(table[PROMPTS[0]])})
    assert "".join(chunk.choices[0].text for chunk in stream if chunk.choices) == expected[0]
    # echo puts no prompt text in front: an embedding prompt has none.
    echoed = client.completions.create(
        model="tiny", prompt="", echo=True, **GREEDY,
        extra_body={**RAW, "prompt_embeds": encode(table[PROMPTS[0]])})
    assert echoed.choices[0].text == expected[0]


def test_identical_embedding_requests_share_prefix_blocks(llama) -> None:
    server, table = llama
    body = {"prompt_embeds": encode(table[list(range(40, 90))]), "max_tokens": 2}
    hits = server.metric("vllm:prefix_cache_hits_total")
    assert post(server, body).status_code == 200
    assert server.metric("vllm:prefix_cache_hits_total") == hits
    assert post(server, body).status_code == 200
    assert server.metric("vllm:prefix_cache_hits_total") == hits + 48  # 3 full blocks
    # The same ids as a token prompt share nothing with them.
    assert post(server, {"prompt": list(range(40, 90)), "max_tokens": 2}).status_code == 200
    assert server.metric("vllm:prefix_cache_hits_total") == hits + 48


def test_hostile_and_malformed_payloads_are_400s_that_name_their_check(llama,
                                                                       tmp_path: Path) -> None:
    server, table = llama
    marker = tmp_path / "code-ran"
    pid = server.proc.pid
    rss_before = rss_bytes(pid)
    row_cap = MAX_MODEL_LEN * HIDDEN_SIZE
    cases: list[tuple[dict[str, Any], str]] = [
        ({"prompt_embeds": "this is not base64!"}, "prompt_embeds is not valid base64"),
        ({"prompt_embeds": b64(code_running_pickle(marker))},
         "prompt_embeds is not a torch.save archive"),
        ({"prompt_embeds": b64(code_running_archive(marker))},
         ("could not be loaded safely (torch.load with weights_only=True): its pickle asks for "
         "more than tensors: Unsupported global: GLOBAL io.open")),
        ({"prompt_embeds": encode(huge_sparse())},
         "prompt_embeds has layout sparse_coo; only a dense (strided) tensor is accepted"),
        ({"prompt_embeds": encode(out_of_bounds_sparse(HIDDEN_SIZE))},
         "prompt_embeds has layout sparse_coo"),
        ({"prompt_embeds": b64(with_member(saved(table[:4]), "data/0", None,
                                           zipfile.ZIP_DEFLATED))},
         "is compressed; torch.save stores members uncompressed"),
        ({"prompt_embeds": encode(table[:4, :32])},
         "prompt_embeds has 32 columns; this model's hidden_size is 64"),
        ({"prompt_embeds": encode(table[:6].reshape(2, 3, HIDDEN_SIZE))},
         ("prompt_embeds must be 2-D (num_tokens, hidden_size), or 3-D with a batch dimension "
         "of 1; got shape (2, 3, 64)")),
        ({"prompt_embeds": encode(torch.ones(4, HIDDEN_SIZE, dtype=torch.int64))},
         "prompt_embeds has dtype int64; it must be float32, bfloat16, float16 or float64"),
        ({"prompt_embeds": encode(torch.full((4, HIDDEN_SIZE), float("nan")))},
         "prompt_embeds holds NaN or infinite values"),
        ({"prompt_embeds": encode(torch.full((4, HIDDEN_SIZE), float("inf")))},
         "prompt_embeds holds NaN or infinite values"),
        ({"prompt_embeds": encode(torch.zeros(0, HIDDEN_SIZE))},
         "prompt_embeds has 0 rows: a prompt needs at least one"),
        ({"prompt_embeds": encode(torch.randn(MAX_MODEL_LEN + 1, HIDDEN_SIZE))},
         (f"declares shape ({MAX_MODEL_LEN + 1}, 64): {(MAX_MODEL_LEN + 1) * 64} elements, more "
         f"than the cap of {row_cap} (the maximum model length of {MAX_MODEL_LEN} rows")),
        ({"prompt_embeds": encode(torch.zeros(1, HIDDEN_SIZE).expand(10**6, HIDDEN_SIZE))},
         f"declares shape (1000000, 64): 64000000 elements, more than the cap of {row_cap}"),
        # Past the cap of a valid payload (max_model_len x hidden_size float64 values).
        ({"prompt_embeds": b64(b"PK\x03\x04" + bytes(row_cap * 8 + 128 * 1024))},
         "characters of base64, more than the cap of"),
        ({"prompt_embeds": [encode(table[:3]), "AAAA"]},
         "prompt_embeds[1] is not a torch.save archive"),
        ({"prompt_embeds": []}, "prompt_embeds must not be empty"),
        ({"prompt_embeds": encode(table[:3]), "prompt": "w5 w6"},
         "give either prompt or prompt_embeds, not both"),
        ({"prompt_embeds": encode(table[:3]), "prompt_logprobs": 1},
         "a prompt given as embeddings has none"),
        ({"prompt_embeds": encode(table[:3]), "echo": True, "logprobs": 1},
         "a prompt given as embeddings has none"),
    ]
    for body, message in cases:
        assert_refused(server, {**body, "max_tokens": 2}, message)
        assert_serving(server, table)
    assert_refused(server, {"max_tokens": 2}, "prompt: Field required (or prompt_embeds)",
                   param="prompt")
    assert not marker.exists(), "a payload's pickle ran code in the server"
    # Nothing was densified or inflated: 4 TiB of sparse shape, a million expanded rows.
    assert rss_bytes(pid) - rss_before < 200 * 1024 * 1024
    assert server.proc.poll() is None


def test_bodies_with_embeddings_have_their_own_limit(llama) -> None:
    server, table = llama
    # Past --max-body-bytes with prompt_embeds: served.
    prompt = list(range(3, 256)) * 3
    body = {"prompt_embeds": encode(table[prompt]), "max_tokens": 2}
    assert len(body["prompt_embeds"]) > BODY_LIMIT
    assert post(server, body).status_code == 200
    # Past it without: 413, as before.
    big = post(server, {"prompt": "w5", "user": "x" * 2 * BODY_LIMIT})
    assert big.status_code == 413
    assert "(--max-body-bytes)" in big.json()["error"]["message"]
    chat = httpx.post(f"{server.url}/v1/chat/completions", timeout=60, json={
        "model": "tiny", "messages": [{"role": "user", "content": "w5"}],
        "user": "x" * 2 * BODY_LIMIT})
    assert chat.status_code == 413
    # Past --max-embeds-body-bytes: 413 naming it, before the body is read.
    response = post(server, {"prompt_embeds": "A" * (EMBEDS_BODY_LIMIT + 1024)})
    assert response.status_code == 413
    assert "(--max-embeds-body-bytes for a body with prompt_embeds)" in \
        response.json()["error"]["message"]
    assert_serving(server, table)


def test_a_server_without_the_flag_refuses_embeddings_by_name(live_server: ServerProcess,
                                                              tiny_model: Path) -> None:
    table = embedding_table(tiny_model)
    response = httpx.post(f"{live_server.url}/v1/completions", headers=live_server.headers,
                          json={"model": "tiny", "prompt_embeds": encode(table[:3])}, timeout=60)
    assert response.status_code == 400
    assert "start it with enable_prompt_embeds=True (--enable-prompt-embeds)" in \
        response.json()["error"]["message"]


def test_a_thousand_embedding_requests_leave_the_engine_memory_flat(llama) -> None:
    """Each request's tensor (256 rows, 64 KiB) is dropped when it finishes: 1,000 kept
    would be 64 MiB in the engine core and in the front end."""
    server, table = llama
    core_pid = server.engine_pid()

    def body(i: int) -> dict[str, Any]:
        ids = torch.randint(3, 256, (256,), generator=torch.Generator().manual_seed(i))
        return {"model": "tiny", "prompt_embeds": encode(table[ids]), "max_tokens": 1}

    with httpx.Client(timeout=60) as http:
        def send(i: int) -> int:
            return http.post(f"{server.url}/v1/completions", json=body(i)).status_code

        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            assert set(pool.map(send, range(100))) == {200}  # warm-up: caches, allocator
            core_before, front_before = rss_bytes(core_pid), rss_bytes(server.proc.pid)
            assert set(pool.map(send, range(1000))) == {200}
    core_growth = rss_bytes(core_pid) - core_before
    front_growth = rss_bytes(server.proc.pid) - front_before
    assert core_growth < 24 * 1024 * 1024, core_growth
    assert front_growth < 24 * 1024 * 1024, front_growth
