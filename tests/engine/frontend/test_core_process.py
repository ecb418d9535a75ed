"""The engine core's loop over its sockets, with a stand-in core, and the real process
outliving no front end."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
import pytest
import zmq

from kvferry.engine.frontend.core_process import EngineCoreProc, FrontEndGone
from kvferry.engine.core.messages import (
    AbortRequests,
    AddRequest,
    CoreInput,
    CoreOutput,
    CoreStepOutputs,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    FinishReason,
    SchedulerStats,
    ShutdownCore,
)
from kvferry.engine.core.request import RequestStatus
from kvferry.engine.sampling_params import SamplingParams

TIMEOUT_S = 10.0


@dataclass
class FakeScheduler:
    core: FakeCore

    def make_stats(self) -> SchedulerStats:
        return SchedulerStats(num_running_reqs=len(self.core.remaining))


@dataclass
class FakeCore:
    """Generates token 7 once per step for each request until its max_tokens."""

    remaining: dict[str, int] = field(default_factory=dict)
    aborted: list[tuple[list[str], RequestStatus]] = field(default_factory=list)
    # Steps of transfer-only work left (blocks held for a pull): nothing to compute.
    num_transfer_steps: int = 0
    num_steps: int = 0
    # What ended the engine for good (a pipeline stage died); never, here.
    fatal_error: Exception | None = None

    def __post_init__(self) -> None:
        self.scheduler = FakeScheduler(self)

    def add_request(self, request: EngineCoreRequest) -> None:
        if request.req_id.startswith("bad"):
            raise ValueError("refused")
        self.remaining[request.req_id] = request.sampling_params.max_tokens or 1

    def abort_requests(self, req_ids: Iterable[str], status: RequestStatus) -> None:
        ids = list(req_ids)
        self.aborted.append((ids, status))
        for req_id in ids:
            self.remaining.pop(req_id, None)

    def has_unfinished_requests(self) -> bool:
        return bool(self.remaining) or self.num_transfer_steps > 0

    def has_requests_to_compute(self) -> bool:
        return bool(self.remaining)

    def step(self) -> EngineCoreOutputs:
        self.num_steps += 1
        if not self.remaining and self.num_transfer_steps > 0:
            self.num_transfer_steps -= 1
        outputs = []
        for req_id in list(self.remaining):
            self.remaining[req_id] -= 1
            done = self.remaining[req_id] == 0
            outputs.append(EngineCoreOutput(
                req_id, [7], finish_reason=FinishReason.LENGTH if done else None
            ))
            if done:
                del self.remaining[req_id]
        return EngineCoreOutputs(outputs, self.scheduler.make_stats())


@dataclass
class Loop:
    """An EngineCoreProc on a thread, and the front end's ends of its sockets."""

    core: FakeCore
    send_socket: zmq.Socket
    recv_socket: zmq.Socket
    thread: threading.Thread
    errors: list[BaseException]

    def send(self, message: CoreInput) -> None:
        self.send_socket.send(msgspec.msgpack.encode(message))

    def recv(self) -> CoreOutput:
        assert self.recv_socket.poll(int(TIMEOUT_S * 1000)), "no output from the core loop"
        return msgspec.msgpack.decode(self.recv_socket.recv(), type=CoreOutput)

    def recv_until_finished(self, req_id: str) -> list[CoreStepOutputs]:
        messages = []
        while True:
            message = self.recv()
            assert isinstance(message, CoreStepOutputs)
            messages.append(message)
            if any(o.req_id == req_id and o.finished for o in message.outputs.outputs):
                return messages

    def recv_until_idle(self) -> list[CoreStepOutputs]:
        messages = []
        while True:
            message = self.recv()
            assert isinstance(message, CoreStepOutputs)
            messages.append(message)
            if message.outputs.scheduler_stats.num_running_reqs == 0:
                return messages


@pytest.fixture()
def loop() -> Iterator[Loop]:
    context = zmq.Context()
    send_socket, recv_socket = context.socket(zmq.PUSH), context.socket(zmq.PULL)
    send_socket.bind("inproc://input")
    recv_socket.bind("inproc://output")
    core_input, core_output = context.socket(zmq.PULL), context.socket(zmq.PUSH)
    core_input.connect("inproc://input")
    core_output.connect("inproc://output")
    core = FakeCore()
    proc = EngineCoreProc(core, core_input, core_output, os.getppid())  # type: ignore[arg-type]
    errors: list[BaseException] = []

    def run() -> None:
        try:
            proc.run()
        except BaseException as exc:  # noqa: BLE001 - handed to the test thread
            errors.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    harness = Loop(core, send_socket, recv_socket, thread, errors)
    try:
        yield harness
    finally:
        harness.send(ShutdownCore())
        thread.join(TIMEOUT_S)
        for socket in (send_socket, recv_socket, core_input, core_output):
            socket.close(linger=0)
        context.term()
    assert not thread.is_alive()
    assert not errors


def add(req_id: str, max_tokens: int) -> AddRequest:
    return AddRequest(EngineCoreRequest(
        req_id, [5, 6], SamplingParams(max_tokens=max_tokens), eos_token_ids=[2],
        arrival_time=time.monotonic(),
    ))


def test_steps_until_done_and_counts_requests(loop: Loop) -> None:
    loop.send(add("a", 3))
    messages = loop.recv_until_idle()
    tokens = [t for m in messages for o in m.outputs.outputs if o.req_id == "a"
              for t in o.new_token_ids]
    assert tokens == [7, 7, 7]
    last = messages[-1].outputs.outputs[-1]
    assert last.finish_reason == FinishReason.LENGTH
    assert messages[-1].num_requests_received == 1


def test_a_refused_request_fails_alone(loop: Loop) -> None:
    loop.send(add("bad-1", 2))
    loop.send(add("good", 2))
    messages = loop.recv_until_finished("good")
    outputs = [o for m in messages for o in m.outputs.outputs]
    assert [(o.req_id, o.finish_reason) for o in outputs if o.req_id == "bad-1"] == [
        ("bad-1", FinishReason.ERROR)
    ]
    assert sum(len(o.new_token_ids) for o in outputs if o.req_id == "good") == 2
    assert messages[-1].num_requests_received == 2


def test_refused_request_alone_is_reported_at_once(loop: Loop) -> None:
    loop.send(add("bad-2", 2))
    message = loop.recv()
    assert isinstance(message, CoreStepOutputs)
    assert [(o.req_id, o.finish_reason) for o in message.outputs.outputs] == [
        ("bad-2", FinishReason.ERROR)
    ]


def test_abort_that_leaves_it_idle_sends_the_new_stats(loop: Loop) -> None:
    loop.send(add("long", 10_000))
    first = loop.recv()
    assert isinstance(first, CoreStepOutputs)
    loop.send(AbortRequests(["long"], FinishReason.STOP))
    messages = loop.recv_until_idle()
    assert messages[-1].outputs.scheduler_stats.num_running_reqs == 0
    assert loop.core.aborted == [(["long"], RequestStatus.FINISHED_STOPPED)]


def test_shutdown_ends_the_loop(loop: Loop) -> None:
    loop.send(ShutdownCore())
    loop.thread.join(TIMEOUT_S)
    assert not loop.thread.is_alive()


def test_idle_loop_exits_when_the_front_end_is_gone() -> None:
    context = zmq.Context()
    core_input, core_output = context.socket(zmq.PULL), context.socket(zmq.PUSH)
    core_input.bind("inproc://orphan-input")
    try:
        # Not our parent's pid: as if the front end had died and we had been re-parented.
        not_our_parent = os.getppid() + 1_000_000
        proc = EngineCoreProc(  # type: ignore[arg-type] - a stand-in core
            FakeCore(), core_input, core_output, not_our_parent
        )
        started = time.monotonic()
        with pytest.raises(FrontEndGone):
            proc.run()
        assert time.monotonic() - started < 3.0
    finally:
        core_input.close(linger=0)
        core_output.close(linger=0)
        context.term()


# ---------------------------------------------------------------------- the real process
_FRONT_END = textwrap.dedent("""
    import asyncio, sys
    from kvferry.engine.frontend.async_llm import AsyncLLM
    from kvferry.engine.config import CacheConfig, EngineConfig, ModelConfig

    async def main() -> None:
        config = EngineConfig(
            model=ModelConfig(model=sys.argv[1], max_model_len=128),
            cache=CacheConfig(num_gpu_blocks_override=16), device="cpu",
        )
        engine = await AsyncLLM.create(config)
        print(engine.core_pid, flush=True)
        await asyncio.sleep(3600)

    asyncio.run(main())
""")


def _is_gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return True
    return state == "Z"  # exited, not yet reaped by its new parent


def test_core_exits_when_the_front_end_is_killed(make_checkpoint, tmp_path: Path) -> None:
    checkpoint = make_checkpoint("LlamaForCausalLM")
    script = tmp_path / "front_end.py"
    script.write_text(_FRONT_END)
    front_end = subprocess.Popen(
        [sys.executable, str(script), str(checkpoint)], stdout=subprocess.PIPE, text=True
    )
    core_pid = None
    try:
        ready, _, _ = select.select([front_end.stdout], [], [], 60.0)
        assert ready, "the front end never reported its engine core"
        core_pid = int(front_end.stdout.readline())
        assert not _is_gone(core_pid)
        front_end.kill()
        front_end.wait(TIMEOUT_S)
        deadline = time.monotonic() + 5.0
        while not _is_gone(core_pid):
            assert time.monotonic() < deadline, "the engine core outlived its front end"
            time.sleep(0.05)
    finally:
        if front_end.poll() is None:
            front_end.kill()
            front_end.wait(TIMEOUT_S)
        if core_pid is not None and not _is_gone(core_pid):
            os.kill(core_pid, signal.SIGKILL)


def test_transfer_only_work_steps_without_spinning_or_repeating_stats(loop: Loop) -> None:
    loop.core.num_transfer_steps = 50
    loop.send(add("short", 1))
    messages = loop.recv_until_finished("short")
    started = time.monotonic()
    deadline = started + TIMEOUT_S
    while loop.core.num_transfer_steps and time.monotonic() < deadline:
        time.sleep(0.01)
    # Each idle step waits for input (2 ms) instead of spinning: 50 steps take about 0.1 s.
    assert loop.core.num_transfer_steps == 0 and time.monotonic() - started >= 0.05
    # Their stats did not change, so none of them was sent.
    assert not loop.recv_socket.poll(100)
    assert messages[-1].outputs.outputs[-1].finish_reason == FinishReason.LENGTH


def test_a_tmpdir_too_long_for_a_unix_socket_is_named_before_binding(tmp_path) -> None:
    from kvferry.engine.frontend.core_client import MAX_IPC_PATH_BYTES, _check_ipc_path

    deep = tmp_path / ("d" * (MAX_IPC_PATH_BYTES - len(str(tmp_path))))
    deep.mkdir()
    with pytest.raises(ValueError, match="more than the 107 a Unix socket allows: point TMPDIR"):
        _check_ipc_path(str(deep))
    assert not deep.exists()  # the unusable directory is removed
    _check_ipc_path(str(tmp_path))  # a short one passes
