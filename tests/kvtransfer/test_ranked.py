"""The engine core's side of a parallel engine's transfer agents (`RankedBackend`), against
the workers' side of the pipes played by this test: a pull is done when every rank's READ
is, fails only once no rank can write any more, and a hold ends as pulled only when every
rank has the reader's notification from the reader's same rank."""

from __future__ import annotations

import time
from collections.abc import Iterator
from multiprocessing import Pipe
from multiprocessing.connection import Connection

import msgspec
import numpy as np
import pytest
from kvferry.kvtransfer.layout import KVLayout, RegionInfo
from kvferry.kvtransfer.nixl_backend import GroupRead, NixlError
from kvferry.kvtransfer.pulls import PULLED_NOTIF_PREFIX
from kvferry.kvtransfer.ranked import RankAgentInfo, RankedBackend, rank_agent_name
from kvferry_testing.handshakes import handshake_info

ENGINE = "kvferry-e1-aaaa"
PULLED = PULLED_NOTIF_PREFIX
PRODUCER = "kvferry-p1-bbbb"
LAYOUT = KVLayout(4, 1, 2, 16, "float16", 2)
REGION = RegionInfo(base_addr=4096, num_blocks=64, device_id=0, mem_type="DRAM")


class Ranks:
    """The workers' ends of the pipes."""

    def __init__(self, conns: list[Connection]) -> None:
        self.conns = conns

    def command(self, rank: int, timeout: float = 5.0) -> tuple:
        assert self.conns[rank].poll(timeout), f"rank {rank} got no command"
        return self.conns[rank].recv()

    def report(self, rank: int, message: tuple) -> None:
        self.conns[rank].send(message)


@pytest.fixture
def ranked() -> Iterator[tuple[RankedBackend, Ranks]]:
    pairs = [Pipe(duplex=True) for _ in range(2)]
    infos = [RankAgentInfo(rank_agent_name(ENGINE, r), b"meta", [LAYOUT], [REGION])
             for r in range(2)]
    backend = RankedBackend(ENGINE, [ours for ours, _ in pairs], infos)
    backend.connect(msgspec.structs.replace(
        handshake_info(), agent_name=PRODUCER, pipeline_parallel_size=2,
        rank_agents=[rank_agent_name(PRODUCER, r) for r in range(2)],
        rank_agent_metadata=[b"p0", b"p1"]))
    yield backend, Ranks([theirs for _, theirs in pairs])
    backend.close()


def reads() -> list[GroupRead]:
    runs = np.array([[5, 7, 2]], dtype=np.int64)
    return [GroupRead(REGION, REGION, 1024, runs, rank=r) for r in range(2)]


def start_read(backend: RankedBackend, ranks: Ranks):
    """A pull's READs, posted on both ranks: the transfer and its id."""
    transfer = backend.read(PRODUCER, reads(), b"note")
    tid = ranks.command(0)[1]
    assert ranks.command(1)[1] == tid
    return transfer, tid


def wait_state(backend: RankedBackend, transfer, state: str) -> None:
    deadline = time.monotonic() + 5
    while backend.poll(transfer) != state:
        assert time.monotonic() < deadline, f"never {state}"
        time.sleep(0.005)


def test_each_rank_reads_from_the_producers_same_rank_and_the_pull_ends_with_the_last(
        ranked) -> None:
    backend, ranks = ranked
    transfer = backend.read(PRODUCER, reads(), b"note")
    assert transfer.num_bytes == 2 * 2 * 1024
    for rank in range(2):
        kind, tid, name, metadata, rank_reads, notif = ranks.command(rank)
        assert (kind, name, metadata, notif) == (
            "read", rank_agent_name(PRODUCER, rank), f"p{rank}".encode(), b"note")
        assert [r.rank for r in rank_reads] == [rank]
    ranks.report(0, ("state", tid, "DONE", ""))
    time.sleep(0.05)
    assert backend.poll(transfer) == "PROC"
    ranks.report(1, ("state", tid, "DONE", ""))
    wait_state(backend, transfer, "DONE")
    assert backend.release(transfer)


def test_a_failed_rank_cancels_the_others_and_the_pull_fails_once_none_writes(ranked) -> None:
    backend, ranks = ranked
    transfer, tid = start_read(backend, ranks)
    ranks.report(0, ("state", tid, "ERR", "read failed"))
    # Rank 1 still reads: not over yet, and asked to stop.
    deadline = time.monotonic() + 5
    while backend.poll(transfer) == "PROC" and not ranks.conns[1].poll(0):
        assert time.monotonic() < deadline
        time.sleep(0.005)
    assert ranks.command(1) == ("release", tid)
    assert backend.poll(transfer) == "PROC"
    ranks.report(1, ("state", tid, "RELEASED", ""))
    wait_state(backend, transfer, "ERR")
    assert backend.release(transfer)


def test_a_timed_out_pull_is_released_on_every_rank_before_it_counts_as_over(ranked) -> None:
    backend, ranks = ranked
    transfer, tid = start_read(backend, ranks)
    assert not backend.release(transfer)
    assert ranks.command(0) == ("release", tid) and ranks.command(1) == ("release", tid)
    ranks.report(0, ("state", tid, "RELEASED", ""))
    ranks.report(1, ("state", tid, "DONE", ""))  # finished before the release reached it
    deadline = time.monotonic() + 5
    while not backend.release(transfer):
        assert time.monotonic() < deadline
        # Not an error: the caller released it (a timeout), and says so itself.
        assert backend.poll(transfer) == "PROC"
        time.sleep(0.005)


def test_a_rank_whose_agent_is_gone_fails_its_reads(ranked) -> None:
    backend, ranks = ranked
    transfer, tid = start_read(backend, ranks)
    ranks.report(0, ("state", tid, "DONE", ""))
    ranks.conns[1].close()  # the worker died
    wait_state(backend, transfer, "ERR")
    with pytest.raises(NixlError, match="ranks \\[1\\] are gone"):
        backend.read(PRODUCER, reads(), b"note")


def test_a_hold_is_pulled_once_every_rank_has_the_readers_notification(ranked) -> None:
    backend, ranks = ranked
    reader = "kvferry-d1-cccc"
    ranks.report(0, ("notifs", [(rank_agent_name(reader, 0), b"m")]))
    # Another rank's agent, or another agent, does not stand for rank 1.
    ranks.report(1, ("notifs", [(rank_agent_name(reader, 0), b"m"), ("intruder", b"m")]))
    time.sleep(0.1)
    assert backend.notifications() == []
    ranks.report(1, ("notifs", [(rank_agent_name(reader, 1), b"m")]))
    deadline = time.monotonic() + 5
    while not (got := backend.notifications()):
        assert time.monotonic() < deadline
        time.sleep(0.005)
    assert got == [(reader, b"m")]


def test_a_producer_must_list_an_agent_per_rank(ranked) -> None:
    backend, _ = ranked
    with pytest.raises(NixlError, match="lists 1 rank agents, this engine has 2 ranks"):
        backend.connect(msgspec.structs.replace(
            handshake_info(), rank_agents=["x/r0"], rank_agent_metadata=[b""]))


def test_only_notifications_of_holds_claimed_by_their_reader_count(ranked) -> None:
    backend, ranks = ranked
    reader = "kvferry-d1-cccc"
    backend.holds_for = lambda req_id, who: (req_id, who) == ("held", reader)
    for rank in range(2):
        ranks.report(rank, ("notifs", [(rank_agent_name(reader, rank), PULLED + b"other"),
                                       (rank_agent_name(reader, rank), PULLED + b"held")]))
    deadline = time.monotonic() + 5
    while not (got := backend.notifications()):
        assert time.monotonic() < deadline
        time.sleep(0.005)
    assert got == [(reader, PULLED + b"held")]


def test_a_workers_agent_survives_a_producers_bad_records() -> None:
    """Metadata that is not an agent's, a region NIXL does not know: the read fails, the
    agent goes on serving."""
    import torch
    from kvferry.kvtransfer.ranked import RankAgentServer, RankAgentSpec

    ours, theirs = Pipe(duplex=True)
    spec = RankAgentSpec("kvferry-w1-dddd/r0", "none", False, 1, 1 << 30, None)
    server = RankAgentServer(theirs, spec, 0, [torch.zeros(8, 1, 2, 4, 1, 8)], 0, 0)
    server.start()
    try:
        bad_region = RegionInfo(base_addr=4096, num_blocks=64, device_id=0, mem_type="X")
        runs = np.array([[1, 1, 1]], dtype=np.int64)
        commands = [
            ("read", 1, "kvferry-p1-bbbb/r0", b"not metadata", reads()[:1], b""),
            ("read", 2, "kvferry-p1-bbbb/r0", b"not metadata",
             [GroupRead(server.info.regions[0], bad_region, 256, runs)], b""),
        ]
        for tid, command in enumerate(commands, start=1):
            ours.send(command)
            assert ours.poll(5)
            kind, got, state, error = ours.recv()
            assert (kind, got, state) == ("state", tid, "ERR") and error
        assert server._thread.is_alive()
    finally:
        ours.send(("close",))
        server._thread.join(5)
