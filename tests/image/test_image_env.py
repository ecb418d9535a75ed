"""The image's environment runs every pod's command.

A fresh virtual environment holds what the image holds: the wheel, with exactly the extras
the Dockerfile names (image_bin, conftest.py). In it, `kvferry serve --model demo` comes up
healthy with the native CPU kernel compiled from the installed source, and the router and
the operator start.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
from kvferry_testing.image_files import KERNEL_BUILT, KERNEL_UNAVAILABLE, runtime_files
from kvferry_testing.image_processes import Process, clean_env, free_port

pytestmark = pytest.mark.slow

def test_every_module_imports_and_every_file_it_loads_is_installed(image_bin: Path) -> None:
    installed = runtime_files(image_bin / "python")
    assert installed["import_failures"] == {}
    source = runtime_files(sys.executable)
    # The same constants are found in the installed package as in the source tree.
    assert sorted(c["constant"] for c in installed["constants"]) == \
        sorted(c["constant"] for c in source["constants"])
    site = str(Path(installed["python"]).parents[1])
    for constant in installed["constants"]:
        assert constant["path"].startswith(site), constant  # the wheel's copy, not the tree's
        assert constant["exists"], f"{constant['constant']}: {constant['path']} is not installed"


def test_serve_demo_is_healthy_with_the_cpu_kernel(
    image_bin: Path, tmp_path: Path, launch: Callable[..., Process]
) -> None:
    cache = tmp_path / "cache"  # empty: the kernel is compiled and the demo model created here
    port = free_port()
    server = launch("serve", [str(image_bin / "kvferry"), "serve", "--model", "demo",
                              "--host", "127.0.0.1", "--port", str(port)],
                    clean_env(image_bin, HOME=str(tmp_path), KVFERRY_CACHE=str(cache)), port=port,
                    cwd=tmp_path)
    server.wait_http("/health")
    answer = httpx.post(f"{server.url}/v1/completions", timeout=60,
                        json={"model": "demo", "prompt": "Hello", "max_tokens": 4})
    assert answer.status_code == 200, answer.text
    assert answer.json()["usage"]["completion_tokens"] == 4
    assert server.stop() == 0, server.log()
    log = server.log()
    assert KERNEL_BUILT in log and KERNEL_UNAVAILABLE not in log, log
    assert len(list((cache / "kernels").glob("paged_decode-*.so"))) == 1


@pytest.mark.parametrize("command", ["router", "operator"])
def test_router_and_operator_commands_start(image_bin: Path, command: str) -> None:
    done = subprocess.run([str(image_bin / "kvferry"), command, "--help"], capture_output=True,
                          text=True, timeout=120, env=clean_env(image_bin), cwd=image_bin)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"usage: kvferry {command}"), done.stdout
