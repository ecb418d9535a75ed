"""Which network interface holds an address, and the network devices UCX may use.

UCX (under NIXL's UCX backend) opens a TCP listener on every network interface it finds,
one per UCX worker: a pod serving on loopback still accepted connections on its other
addresses. UCX uses only the devices named in `UCX_NET_DEVICES` when that is set, so the
KV host's interface is named there (see nixl_backend.py for where it is set). RDMA devices
stay usable beside it: they open no socket, and a GPU host moves its KV blocks over them.

NIXL's own `device_list` backend parameter cannot name an interface: it appends ":1" to
every entry (the port of an RDMA device), which no network interface matches.

Linux only (getifaddrs layout, sysfs), as NIXL is.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import ipaddress
import os
import socket
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

# Where the kernel lists RDMA devices and their ports (UCX names them "<device>:<port>").
RDMA_SYSFS = Path("/sys/class/infiniband")
_IFF_LOOPBACK = 0x8


@dataclass(frozen=True)
class InterfaceAddress:
    """One address held by one network interface of this machine."""

    interface: str  # e.g. "eth0", "lo"
    address: str  # e.g. "10.0.0.7", "fd00::2" (IPv6 without its %scope)
    is_loopback: bool  # the interface is a loopback interface (IFF_LOOPBACK)


class _Ifaddrs(ctypes.Structure):
    """`struct ifaddrs` of <ifaddrs.h> (glibc and musl lay it out alike)."""


_Ifaddrs._fields_ = [
    ("ifa_next", ctypes.POINTER(_Ifaddrs)),
    ("ifa_name", ctypes.c_char_p),
    ("ifa_flags", ctypes.c_uint),
    ("ifa_addr", ctypes.c_void_p),
    ("ifa_netmask", ctypes.c_void_p),
    ("ifa_ifu", ctypes.c_void_p),
    ("ifa_data", ctypes.c_void_p),
]


def interface_addresses() -> list[InterfaceAddress]:
    """Every IPv4 and IPv6 address of every interface of this machine (getifaddrs(3))."""
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    head = ctypes.POINTER(_Ifaddrs)()
    if libc.getifaddrs(ctypes.byref(head)) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"getifaddrs: {os.strerror(errno)}")
    try:
        found = []
        entry = head
        while entry:
            item = entry.contents
            address = _address_of(item.ifa_addr)
            if address is not None:
                found.append(InterfaceAddress(item.ifa_name.decode(errors="replace"), address,
                                              bool(item.ifa_flags & _IFF_LOOPBACK)))
            entry = item.ifa_next
        return found
    finally:
        libc.freeifaddrs(head)


def _address_of(sockaddr: int | None) -> str | None:
    """The address in a `struct sockaddr` of family AF_INET or AF_INET6, else None.

    Layouts: sockaddr_in is (family u16, port u16, addr 4 bytes); sockaddr_in6 is
    (family u16, port u16, flowinfo u32, addr 16 bytes, scope_id u32).
    """
    if not sockaddr:
        return None
    family = ctypes.c_ushort.from_address(sockaddr).value
    if family == socket.AF_INET:
        return socket.inet_ntop(socket.AF_INET, ctypes.string_at(sockaddr + 4, 4))
    if family == socket.AF_INET6:
        return socket.inet_ntop(socket.AF_INET6, ctypes.string_at(sockaddr + 8, 16))
    return None


def interface_holding(address: str, table: Sequence[InterfaceAddress]) -> str:
    """The name of the interface in `table` that holds `address`.

    A loopback address that no interface lists (127.0.0.2: Linux routes all of 127/8 to the
    loopback interface) belongs to the loopback interface. ValueError when no interface
    holds the address, listing the addresses there are.
    """
    wanted = ipaddress.ip_address(address.split("%", 1)[0])
    for entry in table:
        if ipaddress.ip_address(entry.address) == wanted:
            return entry.interface
    if wanted.is_loopback:
        for entry in table:
            if entry.is_loopback:
                return entry.interface
    held = ", ".join(f"{e.address} ({e.interface})" for e in table) or "none"
    raise ValueError(f"{address} is not an address of this machine, which holds {held}")


def rdma_devices(root: Path = RDMA_SYSFS) -> list[str]:
    """UCX's names ("mlx5_0:1") of the ports of every RDMA device under `root`, sorted."""
    if not root.is_dir():
        return []
    return sorted(f"{device.name}:{port.name}" for device in root.iterdir()
                  for port in (device / "ports").glob("*") if port.name.isdigit())


def ucx_net_devices(address: str, table: Sequence[InterfaceAddress] | None = None,
                    rdma_root: Path = RDMA_SYSFS) -> str:
    """`UCX_NET_DEVICES` for KV transfers at `address`: the interface holding it, then the
    RDMA devices. ValueError when no interface of this machine holds `address`.

    `table`: the machine's addresses (None reads them); `rdma_root`: where RDMA devices
    are listed.
    """
    interface = interface_holding(address, interface_addresses() if table is None else table)
    return ",".join([interface, *rdma_devices(rdma_root)])
