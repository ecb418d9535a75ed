"""Which interface holds an address, and the network devices UCX is confined to: against
this machine's own interfaces, tables built here, and a sysfs tree of RDMA devices."""

from __future__ import annotations

import fcntl
import logging
import os
import socket
import struct
from pathlib import Path

import pytest
import torch
from kvferry.kvtransfer.interfaces import (
    InterfaceAddress,
    interface_addresses,
    interface_holding,
    rdma_devices,
    ucx_net_devices,
)
from kvferry.kvtransfer.nixl_backend import UCX_NET_DEVICES_ENV, NixlBackend
from kvferry_testing.sockets import sockets_of

SIOCGIFADDR = 0x8915  # <linux/sockios.h>: an interface's (first) IPv4 address

TABLE = [
    InterfaceAddress("lo", "127.0.0.1", True),
    InterfaceAddress("eth0", "10.0.0.7", False),
    InterfaceAddress("lo", "::1", True),
    InterfaceAddress("eth0", "fd00::7", False),
    InterfaceAddress("eth0", "fe80::1", False),
    InterfaceAddress("net1", "192.168.5.2", False),
]


def ipv4_of(interface: str) -> str | None:
    """The interface's IPv4 address by ioctl: a second opinion beside getifaddrs."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            packed = fcntl.ioctl(s.fileno(), SIOCGIFADDR,
                                 struct.pack("256s", interface.encode()[:15]))
        except OSError:  # no IPv4 address on it
            return None
    return socket.inet_ntoa(packed[20:24])


def test_this_machines_addresses_match_what_the_kernel_says_per_interface() -> None:
    found = interface_addresses()
    names = {name for _, name in socket.if_nameindex()}
    assert {entry.interface for entry in found} <= names
    for name in names:
        ipv4 = ipv4_of(name)
        if ipv4 is not None:
            assert InterfaceAddress(name, ipv4, name == "lo") in found, (name, ipv4, found)
    loopback = [entry for entry in found if entry.is_loopback]
    assert {"127.0.0.1"} <= {entry.address for entry in loopback}
    assert all(entry.interface == "lo" for entry in loopback)


@pytest.mark.parametrize(("address", "interface"), [
    ("10.0.0.7", "eth0"),
    ("192.168.5.2", "net1"),
    ("127.0.0.1", "lo"),
    # Linux routes all of 127/8 to the loopback interface, which lists only 127.0.0.1.
    ("127.0.0.2", "lo"),
    ("::1", "lo"),
    ("fd00:0:0::7", "eth0"),  # another spelling of fd00::7
    ("fe80::1%eth0", "eth0"),  # a link-local address with its scope
])
def test_the_interface_holding_an_address(address: str, interface: str) -> None:
    assert interface_holding(address, TABLE) == interface


def test_an_address_no_interface_holds_is_refused_with_the_addresses_there_are() -> None:
    with pytest.raises(ValueError) as refused:
        interface_holding("10.9.9.9", TABLE[:2])
    assert str(refused.value) == ("10.9.9.9 is not an address of this machine, which holds "
                                  "127.0.0.1 (lo), 10.0.0.7 (eth0)")
    with pytest.raises(ValueError, match="which holds none"):
        interface_holding("127.0.0.1", [])


def make_rdma_tree(root: Path, ports: dict[str, list[str]]) -> Path:
    for device, numbers in ports.items():
        for number in numbers:
            (root / device / "ports" / number).mkdir(parents=True)
    return root


def test_rdma_devices_are_named_device_colon_port(tmp_path: Path) -> None:
    root = make_rdma_tree(tmp_path / "infiniband", {"mlx5_1": ["1", "2"], "mlx5_0": ["1"]})
    assert rdma_devices(root) == ["mlx5_0:1", "mlx5_1:1", "mlx5_1:2"]
    assert rdma_devices(tmp_path / "absent") == []


def test_ucx_gets_the_kv_hosts_interface_then_the_rdma_devices(tmp_path: Path) -> None:
    root = make_rdma_tree(tmp_path / "infiniband", {"mlx5_0": ["1"]})
    assert ucx_net_devices("10.0.0.7", TABLE, root) == "eth0,mlx5_0:1"
    assert ucx_net_devices("127.0.0.1", TABLE, tmp_path / "absent") == "lo"
    with pytest.raises(ValueError, match="10.9.9.9 is not an address of this machine"):
        ucx_net_devices("10.9.9.9", TABLE, root)


def new_listeners(before: set[tuple[str, int]]) -> list[tuple[str, int]]:
    """This process's TCP listeners that were not in `before`: (address, port)."""
    now = {(s.address, s.port) for s in sockets_of([os.getpid()]) if s.is_open_to_anyone}
    return sorted(now - before)


def own_listeners() -> set[tuple[str, int]]:
    return {(s.address, s.port) for s in sockets_of([os.getpid()]) if s.is_open_to_anyone}


def test_a_backend_confined_to_loopback_listens_there_only_and_leaves_no_variable(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(UCX_NET_DEVICES_ENV, raising=False)
    before = own_listeners()
    backend = NixlBackend("interfaces-test-lo", read_threads=2, net_devices="lo")
    try:
        backend.register(torch.zeros(1024))
        listeners = new_listeners(before)
        # One UCX listener per worker, each on loopback.
        assert len(listeners) == 2 and all(a == "127.0.0.1" for a, _ in listeners), listeners
        assert UCX_NET_DEVICES_ENV not in os.environ
    finally:
        backend.close()


def test_a_ucx_net_devices_set_by_hand_wins_and_is_logged(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
) -> None:
    monkeypatch.setenv(UCX_NET_DEVICES_ENV, "lo")
    before = own_listeners()
    with caplog.at_level(logging.WARNING, logger="kvferry.kvtransfer.nixl_backend"):
        # A device no machine has: had it been used, UCX would have no TCP listener at all.
        backend = NixlBackend("interfaces-test-by-hand", net_devices="kvferry-none0")
    try:
        listeners = new_listeners(before)
        assert len(listeners) == 1 and listeners[0][0] == "127.0.0.1", listeners
        assert os.environ[UCX_NET_DEVICES_ENV] == "lo"
        assert [r.getMessage() for r in caplog.records] == [
            ("UCX_NET_DEVICES=lo is set: UCX uses those network devices, not kvferry-none0 "
            "(the KV host's); its listeners follow them")]
    finally:
        backend.close()
