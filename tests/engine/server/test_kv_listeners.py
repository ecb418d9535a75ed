"""Where a pod's KV transfer listeners are, read from the socket table of its processes (the
server and its engine core): on the KV host only, loopback for a pod on loopback, once UCX
has run a pull in both engine cores."""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from pathlib import Path

from kvferry_testing.pd_pods import (
    BLOCK_BYTES,
    Trio,
    bytes_pulled,
    complete,
    held_params,
    prefill_then_decode,
    prompt_of,
    start_role,
    text_of,
)
from kvferry_testing.serve_helpers import ServerProcess
from kvferry_testing.sockets import (
    BoundSocket,
    listeners_of_tree,
    non_loopback,
    process_tree,
    sockets_of,
)


def test_the_socket_reader_sees_listeners_by_address_and_protocol() -> None:
    """The reader the tests below rely on: a wildcard or non-loopback socket is flagged, a
    connected UDP socket is not open to anyone."""
    with socket.create_server(("127.0.0.1", 0)) as local, \
            socket.create_server(("::1", 0), family=socket.AF_INET6) as local6, \
            socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as wildcard_udp, \
            socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as connected_udp:
        wildcard_udp.bind(("0.0.0.0", 0))
        connected_udp.connect(("127.0.0.1", 9))
        pid = os.getpid()
        mine = {(s.protocol, s.address, s.port): s for s in sockets_of(process_tree(pid))}
        tcp = mine[("tcp", "127.0.0.1", local.getsockname()[1])]
        tcp6 = mine[("tcp6", "::1", local6.getsockname()[1])]
        udp = mine[("udp", "0.0.0.0", wildcard_udp.getsockname()[1])]
        connected = mine[("udp", "127.0.0.1", connected_udp.getsockname()[1])]
        assert tcp.is_open_to_anyone and tcp.is_loopback
        assert tcp6.is_open_to_anyone and tcp6.is_loopback
        assert udp.is_open_to_anyone and not udp.is_loopback
        assert not connected.is_open_to_anyone
        assert str(udp) in non_loopback(listeners_of_tree(pid))


def engine_listeners(server: ServerProcess) -> list[BoundSocket]:
    return [s for s in listeners_of_tree(server.proc.pid) if s.pid == server.engine_pid()]


def test_pods_on_loopback_listen_on_loopback_only_after_a_pull(trio: Trio) -> None:
    prompt = prompt_of(40, seed=9171)
    before = bytes_pulled(trio.decode)
    text, params = prefill_then_decode(trio, prompt)
    assert text == text_of(complete(trio.colocated, prompt, 8))
    assert bytes_pulled(trio.decode) - before == 3 * BLOCK_BYTES  # UCX ran in both cores
    assert params["remote_host"] == "127.0.0.1"
    for pod in (trio.prefill, trio.decode):
        listeners = listeners_of_tree(pod.proc.pid)
        assert non_loopback(listeners) == []
        # The reader sees the engine core's listeners: its side channel, and UCX's.
        in_core = engine_listeners(pod)
        assert len(in_core) >= 2, in_core
    side_channel = ("127.0.0.1", params["remote_port"])
    assert side_channel in {(s.address, s.port) for s in engine_listeners(trio.prefill)}


def test_a_pod_binds_and_advertises_its_kv_host_and_peers_pull_from_there(
    server_factory: Callable[..., ServerProcess], tiny_model: Path, trio: Trio,
) -> None:
    # Another loopback address: the side channel moves there, UCX stays on its interface.
    prefill = start_role(server_factory, tiny_model, "prefill", "--kv-host", "127.0.0.2")
    prompt = prompt_of(40, seed=9172)
    params = held_params(prefill, prompt)
    assert params["remote_host"] == "127.0.0.2"
    listeners = {(s.address, s.port) for s in engine_listeners(prefill)}
    assert ("127.0.0.2", params["remote_port"]) in listeners, listeners
    assert {address for address, _ in listeners} == {"127.0.0.1", "127.0.0.2"}, listeners
    assert non_loopback(listeners_of_tree(prefill.proc.pid)) == []
    before = bytes_pulled(trio.decode)
    text = text_of(complete(trio.decode, prompt, 8, params))
    assert text == text_of(complete(trio.colocated, prompt, 8))
    assert bytes_pulled(trio.decode) - before == 3 * BLOCK_BYTES
