"""The side channel over real HTTP on loopback, without NIXL."""

from __future__ import annotations

import http.client
import socket
import threading
import time
from collections.abc import Iterator

import msgspec
import pytest
from kvferry.kvtransfer.auth import SIGNATURE_HEADER, SideChannelAuth, TransferKey
from kvferry.kvtransfer.handshake import IncompatibleProducerError, LocalIdentity, check_compatible
from kvferry.kvtransfer.http_server import ServerLimits
from kvferry.kvtransfer.layout import KVLayout, compatibility_hash
from kvferry.kvtransfer.lease import LeaseTable
from kvferry.kvtransfer.metrics import KVTransferMetrics
from kvferry.kvtransfer.side_channel import (
    HANDSHAKE_PATH,
    RENEW_PATH,
    HandshakeInfo,
    LeaseRequest,
    SideChannelAuthError,
    SideChannelClient,
    SideChannelError,
    SideChannelServer,
)
from kvferry_testing.handshakes import LAYOUT, handshake_info
from kvferry_testing.keys import TEST_KEY

OTHER_KEY = TransferKey(b"another-service-transfer-key-0123456789")


def client_of(server: SideChannelServer, reader: str = "decode-1",
              key: TransferKey | None = TEST_KEY, timeout_s: float = 5.0) -> SideChannelClient:
    auth = None if key is None else SideChannelAuth(key)
    return SideChannelClient("127.0.0.1", server.port, timeout_s=timeout_s, reader=reader,
                             auth=auth)


@pytest.fixture
def served() -> Iterator[tuple[SideChannelServer, SideChannelClient]]:
    leases = LeaseTable(30.0, KVTransferMetrics())
    server = SideChannelServer("127.0.0.1", 0, handshake_info(), leases, SideChannelAuth(TEST_KEY))
    server.start()
    yield server, client_of(server)
    server.close()


def test_the_handshake_returns_what_the_producer_serves(served) -> None:
    server, client = served
    assert client.handshake() == server.info


@pytest.mark.skipif(not socket.has_ipv6, reason="no IPv6 on this machine")
def test_a_side_channel_on_an_ipv6_kv_host_serves_there() -> None:
    leases = LeaseTable(30.0, KVTransferMetrics())
    server = SideChannelServer("::1", 0, handshake_info(), leases, SideChannelAuth(TEST_KEY))
    server.start()
    try:
        client = SideChannelClient("::1", server.port, timeout_s=5.0, reader="decode-1",
                                   auth=SideChannelAuth(TEST_KEY))
        assert client.handshake() == server.info
        with pytest.raises(OSError):  # bound to ::1 only
            socket.create_connection(("127.0.0.1", server.port), timeout=1).close()
    finally:
        server.close()


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
    first, second = client_of(server, "decode-1"), client_of(server, "decode-2")
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


@pytest.mark.parametrize("call", ["renew", "free"])
def test_a_renewal_or_free_that_names_no_reader_is_refused(served, call: str) -> None:
    server, client = served
    server.leases.hold("a", ((1, 2),))
    nameless = client_of(server, reader="")
    with pytest.raises(SideChannelError, match="400.*reader must name the consumer"):
        getattr(nameless, call)("agent-1", ["a"])
    assert server.leases.is_held("a") and server.leases.readers() == {}
    # A claimed hold stays its reader's too.
    assert client.renew("agent-1", ["a"]).held == [True]
    with pytest.raises(SideChannelError, match="400"):
        getattr(nameless, call)("agent-1", ["a"])
    assert server.leases.readers() == {"a": "decode-1"}


def test_a_bad_body_is_an_error_not_a_crash(served) -> None:
    _, client = served
    with pytest.raises(SideChannelError, match="400"):
        client._call("POST", "/kvferry/v1/renew", b"\xc1", dict)
    assert client.handshake().engine_id == "e1"


# ---------------------------------------------------------------------------- authentication
def raw_call(port: int, method: str, path: str, body: bytes = b"",
             headers: dict[str, str] | None = None) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    try:
        conn.request(method, path, body=body or None, headers=headers or {})
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


@pytest.mark.parametrize("key", [None, OTHER_KEY], ids=["no key", "another key"])
def test_a_client_without_the_key_gets_nothing(served, key: TransferKey | None) -> None:
    server, _ = served
    server.leases.hold("a", ((1, 2),))
    outsider = client_of(server, key=key)
    for call in (outsider.handshake, lambda: outsider.renew("agent-1", ["a"]),
                 lambda: outsider.free("agent-1", ["a"])):
        with pytest.raises(SideChannelAuthError, match="refused this consumer's signature"):
            call()
    status, body = raw_call(server.port, "GET", HANDSHAKE_PATH)
    assert status == 401 and server.info.agent_name.encode() not in body
    assert body == b"side channel request not authenticated: the request carries no valid " \
                   b"X-Kvferry-Signature header"
    # Nothing was claimed, renewed or freed.
    assert server.leases.is_held("a") and server.leases.readers() == {}


def test_a_replayed_or_altered_request_is_refused(served) -> None:
    server, _ = served
    server.leases.hold("a", ((1, 2),))
    auth = SideChannelAuth(TEST_KEY)
    body = LeaseRequest(agent_name="agent-1", req_ids=["a"], reader="decode-1")
    encoded = msgspec.msgpack.encode(body)
    signature, _ = auth.sign_request("POST", RENEW_PATH, encoded)
    headers = {SIGNATURE_HEADER: signature}
    assert raw_call(server.port, "POST", RENEW_PATH, encoded, headers)[0] == 200
    status, answer = raw_call(server.port, "POST", RENEW_PATH, encoded, headers)
    assert (status, answer) == (401, b"side channel request not authenticated: the request "
                                     b"was already served (a replay)")
    # The same signature over another body (another reader) does not verify.
    other = msgspec.msgpack.encode(LeaseRequest(agent_name="agent-1", req_ids=["a"],
                                                reader="decode-2"))
    signature, _ = auth.sign_request("POST", RENEW_PATH, encoded)
    status, answer = raw_call(server.port, "POST", RENEW_PATH, other, {SIGNATURE_HEADER: signature})
    assert status == 401 and b"does not verify" in answer
    assert server.leases.readers() == {"a": "decode-1"}


def test_a_request_signed_outside_the_skew_window_is_refused(served) -> None:
    server, _ = served
    late = SideChannelAuth(TEST_KEY, clock=lambda: time.time() - 31)
    client = SideChannelClient("127.0.0.1", server.port, timeout_s=5.0, reader="d", auth=late)
    with pytest.raises(SideChannelAuthError):
        client.handshake()
    status, body = raw_call(server.port, "GET", HANDSHAKE_PATH,
                            headers={SIGNATURE_HEADER: late.sign_request("GET", HANDSHAKE_PATH,
                                                                         b"")[0]})
    assert (status, body) == (401, b"side channel request not authenticated: the request was "
                                   b"signed more than 30 s from now")


@pytest.mark.parametrize("fake_key", [None, OTHER_KEY], ids=["no key", "another key"])
def test_a_producer_without_the_key_cannot_pass_for_one(fake_key: TransferKey | None) -> None:
    """A fake side channel that serves a real producer's handshake and holds, but not with
    the service's key, is refused by a consumer: its replies carry no signature of the
    service (or it refuses the consumer's)."""
    leases = LeaseTable(30.0, KVTransferMetrics())
    leases.hold("a", ((1, 2),))
    fake = SideChannelServer("127.0.0.1", 0, handshake_info(), leases,
                             None if fake_key is None else SideChannelAuth(fake_key))
    fake.start()
    try:
        consumer = client_of(fake)
        for call in (consumer.handshake, lambda: consumer.renew("agent-1", ["a"])):
            with pytest.raises(SideChannelAuthError, match="KV transfer key"):
                call()
    finally:
        fake.close()


# ---------------------------------------------------------------------------- bounds
def open_idle(port: int, count: int) -> list[socket.socket]:
    return [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(count)]


def test_idle_and_slow_connections_neither_add_threads_nor_block_a_handshake() -> None:
    leases = LeaseTable(30.0, KVTransferMetrics())
    limits = ServerLimits(max_connections=64, idle_timeout_s=2.0, read_timeout_s=1.0)
    server = SideChannelServer("127.0.0.1", 0, handshake_info(), leases,
                               SideChannelAuth(TEST_KEY), limits)
    server.start()
    threads_before = threading.active_count()
    idle = open_idle(server.port, 150)
    # Slow clients: a request head sent a few bytes at a time, never finished.
    slow = open_idle(server.port, 20)
    try:
        for sock in slow:
            sock.sendall(b"GET /kvferry/v1/handshake HTTP/1.1\r\nHost: x")
        started = time.monotonic()
        assert client_of(server).handshake() == server.info
        assert time.monotonic() - started < 1.0
        # One thread serves them all; the oldest idle ones made room for the newest.
        assert threading.active_count() == threads_before
        assert server.num_connections <= limits.max_connections
        # A slow request is closed within its read timeout, an idle connection within its
        # idle timeout: the server ends both (the client reads end of stream).
        deadline = time.monotonic() + limits.idle_timeout_s + 2.0
        for sock in (slow[-1], idle[-1]):
            sock.settimeout(max(0.1, deadline - time.monotonic()))
            assert sock.recv(1) == b""
        assert time.monotonic() < deadline
    finally:
        for sock in idle + slow:
            sock.close()
        server.close()


def test_an_oversized_or_chunked_body_is_refused_before_it_is_read(served) -> None:
    server, _ = served
    status, body = raw_call(server.port, "POST", RENEW_PATH,
                            headers={"Content-Length": str(2 << 20)})
    assert (status, body) == (413, b"the body may have at most 1048576 bytes")
    with socket.create_connection(("127.0.0.1", server.port), timeout=5) as sock:
        sock.sendall(b"POST /kvferry/v1/renew HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n")
        assert sock.recv(100).startswith(b"HTTP/1.1 411 ")


def test_an_unreachable_producer_is_a_side_channel_error() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(SideChannelError, match=f"127.0.0.1:{port}"):
        client_of_port = SideChannelClient("127.0.0.1", port, timeout_s=2.0,
                                           auth=SideChannelAuth(TEST_KEY))
        client_of_port.handshake()


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


def _two_stages(second: KVLayout) -> tuple[LocalIdentity, HandshakeInfo]:
    """This engine of two pipeline stages, and a producer whose stage 1 is `second`."""
    first = KVLayout(4, 1, 2, 16, "float16", 2)
    ours = [first, KVLayout(4, 1, 2, 16, "float16", 2, first_layer=1)]
    theirs = [first, second]
    local = LocalIdentity("m", ours, compatibility_hash("m", ours, 2), (2, 1))
    region = handshake_info().regions[0]
    remote = msgspec.structs.replace(
        handshake_info(), layouts=theirs, regions=[region, region], pipeline_parallel_size=2,
        compat_hash=compatibility_hash("m", theirs, 2),
        rank_agents=["agent-1/r0", "agent-1/r1"], rank_agent_metadata=[b"", b""])
    return local, remote


def test_engines_of_other_parallel_sizes_or_splits_are_refused_by_name() -> None:
    local, remote = _two_stages(KVLayout(4, 1, 2, 16, "float16", 2, first_layer=1))
    check_compatible(local, "h:1", remote)
    with pytest.raises(IncompatibleProducerError,
                       match="tensor_parallel_size is 2 there and 1 here"):
        check_compatible(local, "h:1", msgspec.structs.replace(remote, tensor_parallel_size=2))
    with pytest.raises(IncompatibleProducerError,
                       match="pipeline_parallel_size is 1 there and 2 here"):
        check_compatible(local, "h:1", handshake_info())
    # The same sizes, the layers split otherwise (another pp_layer_partition).
    local, remote = _two_stages(KVLayout(4, 1, 2, 16, "float16", 2, first_layer=2))
    with pytest.raises(IncompatibleProducerError, match="rank 1 first_layer is 2 there and 1 here"):
        check_compatible(local, "h:1", remote)


@pytest.mark.parametrize(("broken", "field"), [
    ({"regions": []}, "the number of regions"),
    ({"regions": [msgspec.structs.replace(handshake_info().regions[0], mem_type="X")]},
     "a region"),
    ({"regions": [msgspec.structs.replace(handshake_info().regions[0], base_addr=-1)]},
     "a region"),
])
def test_a_handshake_whose_records_do_not_hold_together_is_refused(broken: dict, field: str
                                                                  ) -> None:
    with pytest.raises(IncompatibleProducerError) as e:
        check_compatible(local_identity(), "h:1", msgspec.structs.replace(handshake_info(),
                                                                          **broken))
    assert e.value.field == field


def test_a_parallel_producer_must_name_its_rank_agents_after_itself() -> None:
    local, remote = _two_stages(KVLayout(4, 1, 2, 16, "float16", 2, first_layer=1))
    named = msgspec.structs.replace(remote, rank_agents=["agent-1/r0", "agent-1/r1"],
                                    rank_agent_metadata=[b"", b""])
    check_compatible(local, "h:1", named)
    for agents in (["agent-1/r0"], ["agent-1/r0", "another/r1"]):
        with pytest.raises(IncompatibleProducerError, match="rank_agents"):
            check_compatible(local, "h:1", msgspec.structs.replace(named, rank_agents=agents))
