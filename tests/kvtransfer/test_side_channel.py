"""The side channel over real HTTP on loopback, without NIXL."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest
from kvferry.kvtransfer.handshake import IncompatibleProducerError, LocalIdentity, check_compatible
from kvferry.kvtransfer.layout import KVLayout, compatibility_hash
from kvferry.kvtransfer.lease import LeaseTable
from kvferry.kvtransfer.metrics import KVTransferMetrics
from kvferry.kvtransfer.side_channel import (
    HandshakeInfo,
    SideChannelClient,
    SideChannelError,
    SideChannelServer,
)
from kvferry_testing.handshakes import LAYOUT, handshake_info


@pytest.fixture
def served() -> Iterator[tuple[SideChannelServer, SideChannelClient]]:
    leases = LeaseTable(30.0, KVTransferMetrics())
    server = SideChannelServer("127.0.0.1", 0, handshake_info(), leases)
    server.start()
    yield server, SideChannelClient("127.0.0.1", server.port, timeout_s=5.0)
    server.close()


def test_the_handshake_returns_what_the_producer_serves(served) -> None:
    server, client = served
    assert client.handshake() == server.info


def test_renew_reports_which_holds_exist(served) -> None:
    server, client = served
    server.leases.hold("a", ((1, 2),))
    reply = client.renew("agent-1", ["a", "b"])
    assert reply.held == [True, False]
    # What the consumer may read for each: the held blocks, per group.
    assert reply.block_ids == [[[1, 2]], []]
    assert (reply.lease_s, reply.agent_name) == (30.0, "agent-1")


def test_a_hold_claimed_by_one_reader_is_refused_to_another(served) -> None:
    server, _ = served
    first = SideChannelClient("127.0.0.1", server.port, timeout_s=5.0, reader="decode-1")
    second = SideChannelClient("127.0.0.1", server.port, timeout_s=5.0, reader="decode-2")
    server.leases.hold("a", ((1, 2),))
    assert first.renew("agent-1", ["a"]).held == [True]
    assert second.renew("agent-1", ["a"]).held == [False]
    assert second.free("agent-1", ["a"]).held == [False]
    assert server.leases.is_held("a")
    assert first.free("agent-1", ["a"]).held == [True]
    assert not server.leases.is_held("a")


def test_free_ends_holds_now(served) -> None:
    server, client = served
    server.leases.hold("a", ((1, 2),))
    assert client.free("agent-1", ["a"]).held == [True]
    assert not server.leases.is_held("a")
    assert server.leases.drain_ended() == ["a"]


def test_a_request_for_another_incarnation_finds_no_holds(served) -> None:
    server, client = served
    server.leases.hold("a", ((1,),))
    reply = client.free("agent-0", ["a"])
    assert reply.held == [False] and reply.agent_name == "agent-1"
    assert server.leases.is_held("a")


def test_a_bad_body_is_an_error_not_a_crash(served) -> None:
    _, client = served
    with pytest.raises(SideChannelError, match="400"):
        client._call("POST", "/kvferry/v1/renew", b"\xc1", dict)
    assert client.handshake().engine_id == "e1"


def test_an_unreachable_producer_is_a_side_channel_error() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(SideChannelError, match=f"127.0.0.1:{port}"):
        SideChannelClient("127.0.0.1", port, timeout_s=2.0).handshake()


def test_a_silent_producer_times_out() -> None:
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        client = SideChannelClient("127.0.0.1", listener.getsockname()[1], timeout_s=0.3)
        with pytest.raises(SideChannelError, match="timed out"):
            client.handshake()


def local_identity(model_id: str = "m", layout: KVLayout = LAYOUT) -> LocalIdentity:
    return LocalIdentity(model_id, [layout], compatibility_hash(model_id, [layout]))


def test_a_matching_producer_is_compatible() -> None:
    check_compatible(local_identity(), "h:1", handshake_info())


@pytest.mark.parametrize(
    ("remote", "field"),
    [
        (handshake_info(model_id="other"), "model_id"),
        (handshake_info(layout=KVLayout(8, 2, 2, 16, "float16", 2)), "block_size"),
        (handshake_info(layout=KVLayout(4, 2, 2, 16, "bfloat16", 2)), "dtype"),
        (handshake_info(layout=KVLayout(4, 3, 2, 16, "float16", 2)), "num_layers"),
        (handshake_info(layout=KVLayout(4, 2, 2, 16, "float16", 2, layout_version=2)),
         "layout_version"),
    ],
)
def test_a_mismatch_names_the_field(remote: HandshakeInfo, field: str) -> None:
    with pytest.raises(IncompatibleProducerError, match=f"{field} is .* there and .* here") as e:
        check_compatible(local_identity(), "h:1", remote)
    assert e.value.field == field
