"""`kvferry serve --model demo` on a fresh machine: the demo checkpoint is generated, and
its chat template makes /v1/chat/completions work."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import httpx

from kvferry_testing.serve_helpers import ServerProcess


def test_demo_model_serves_chat(server_factory: Callable[..., ServerProcess],
                                tmp_path: Path) -> None:
    server = server_factory("demo", env={"KVFERRY_CACHE": str(tmp_path / "cache")})
    assert (tmp_path / "cache").is_dir()  # generated here, not taken from another cache
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    out = httpx.post(f"{server.url}/v1/chat/completions", timeout=60,
                     json={"model": "demo", "messages": messages, "max_tokens": 5,
                           "ignore_eos": True})
    assert out.status_code == 200, out.text
    body = out.json()
    assert body["model"] == "demo" and body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 5
    rendered = httpx.post(f"{server.url}/tokenize", json={"messages": messages,
                                                          "return_token_strs": True}).json()
    # The demo template: role markers, each turn ended by </s>, then the assistant header.
    text = "".join(rendered["token_strs"])
    assert text.startswith("<|system|>") and text.count("</s>") == 2
    assert text.rstrip("Ċ\n").endswith("<|assistant|>")
    assert body["usage"]["prompt_tokens"] == rendered["count"]
