"""`kvferry serve --device cuda` answers the official `openai` client, streamed and not,
with the greedy tokens the offline engine gives on the same GPU. Runs where CUDA is
(`pytest -m gpu`) and skips elsewhere."""

from __future__ import annotations

import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from kvferry_testing.serve_helpers import API_KEY, ServerProcess, free_port, serve_command

from kvferry import LLM, SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (no GPU here)"),
]


@pytest.fixture(scope="module")
def checkpoint(make_checkpoint: Callable[..., Path]) -> Path:
    return make_checkpoint("LlamaForCausalLM", vocab_size=256)


@pytest.fixture(scope="module")
def server(checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    port = free_port()
    log_path = tmp_path_factory.mktemp("serve-cuda") / "serve.log"
    command = serve_command(str(checkpoint), port, "--device", "cuda", "--dtype", "bfloat16",
                            "--gpu-memory-utilization", "0.3", "--served-model-name", "tiny",
                            "--api-key", API_KEY)
    with log_path.open("wb") as log:
        # Outside the repository: its kvferry/ folder must not shadow the installed package.
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True, cwd=log_path.parent)
    server = ServerProcess(proc, port, log_path, API_KEY)
    try:
        server.wait_ready()
        yield server
    finally:
        server.kill_group()


def test_the_openai_client_on_a_gpu_server(server: ServerProcess, checkpoint: Path) -> None:
    import openai

    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY)
    prompts = [[5, 17, 42, 9, 100, 3], [7] * 30, list(range(3, 60))]
    answers = [client.completions.create(model="tiny", prompt=p, max_tokens=16, temperature=0,
                                         extra_body={"ignore_eos": True}) for p in prompts]
    for answer in answers:
        assert answer.usage.completion_tokens == 16
        assert answer.choices[0].finish_reason == "length"
    streamed = []
    for p in prompts:
        pieces = client.completions.create(model="tiny", prompt=p, max_tokens=16, temperature=0,
                                           stream=True, extra_body={"ignore_eos": True})
        streamed.append("".join(chunk.choices[0].text for chunk in pieces if chunk.choices))
    assert streamed == [a.choices[0].text for a in answers]
    # The offline engine on the same GPU and weights answers the same tokens.
    llm = LLM(model=str(checkpoint), device="cuda", dtype="bfloat16", max_model_len=1024,
              gpu_memory_utilization=0.3)
    offline = llm.generate([{"prompt_token_ids": p} for p in prompts],
                           SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
                           use_tqdm=False)
    assert [o.outputs[0].text for o in offline] == \
        [a.choices[0].text for a in answers]
