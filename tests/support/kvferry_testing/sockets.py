"""The socket table of a process tree, read from /proc: which addresses its processes
listen on (what `ss -ltnup` shows, without needing `ss`).

A socket is open to anyone who reaches its address when it is a TCP socket in LISTEN or an
unconnected UDP socket with a port. Each process's sockets are the `socket:[inode]` links in
/proc/<pid>/fd, looked up in /proc/<pid>/net/{tcp,tcp6,udp,udp6} (the tables of the
process's network namespace).
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import socket
import sys
from dataclasses import dataclass
from pathlib import Path

PROC = Path("/proc")
# /proc/net/tcp "st" column values (include/net/tcp_states.h).
TCP_LISTEN = 0x0A
UDP_UNCONNECTED = 0x07  # TCP_CLOSE: a UDP socket with no peer receives from anyone
TABLES = ("tcp", "tcp6", "udp", "udp6")


@dataclass(frozen=True)
class BoundSocket:
    """One socket of one process, where it is bound."""

    pid: int
    protocol: str  # "tcp", "tcp6", "udp" or "udp6" (the table it was found in)
    address: str  # e.g. "127.0.0.1", "::", "192.0.2.2"
    port: int
    state: int  # the table's "st" value: TCP_LISTEN, UDP_UNCONNECTED, ...

    @property
    def is_open_to_anyone(self) -> bool:
        """A TCP listener, or an unconnected UDP socket with a port."""
        if self.protocol.startswith("tcp"):
            return self.state == TCP_LISTEN
        return self.state == UDP_UNCONNECTED and self.port != 0

    @property
    def is_loopback(self) -> bool:
        address = ipaddress.ip_address(self.address)
        if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
            address = address.ipv4_mapped
        return address.is_loopback

    def __str__(self) -> str:
        host = f"[{self.address}]" if ":" in self.address else self.address
        return f"pid {self.pid} {self.protocol} {host}:{self.port} (st {self.state:#x})"


def process_tree(root: int) -> list[int]:
    """`root` and every live descendant of it (by the parent pid in /proc/<pid>/stat)."""
    children: dict[int, list[int]] = {}
    for entry in PROC.iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            stat = (entry / "stat").read_text()
            # "pid (comm) state ppid ...": comm may hold spaces and parentheses.
            ppid = int(stat[stat.rindex(")") + 2:].split()[1])
            children.setdefault(ppid, []).append(int(entry.name))
    tree, frontier = [], [root]
    while frontier:
        pid = frontier.pop()
        tree.append(pid)
        frontier.extend(children.get(pid, []))
    return sorted(tree)


def socket_inodes(pid: int) -> set[int]:
    """The inodes of the sockets `pid` holds open (empty if it is gone)."""
    inodes = set()
    with contextlib.suppress(OSError):
        for fd in os.listdir(PROC / str(pid) / "fd"):
            with contextlib.suppress(OSError):
                target = os.readlink(PROC / str(pid) / "fd" / fd)
                if target.startswith("socket:["):
                    inodes.add(int(target[len("socket:["):-1]))
    return inodes


def parse_table(text: str, protocol: str) -> dict[int, tuple[str, int, int]]:
    """inode -> (local address, local port, state) of a /proc/net/{tcp,udp}[6] table."""
    rows = {}
    for line in text.splitlines()[1:]:
        fields = line.split()
        if len(fields) < 10:
            continue
        address, port = decode_address(fields[1])
        rows[int(fields[9])] = (address, port, int(fields[3], 16))
    return rows


def decode_address(field: str) -> tuple[str, int]:
    """"0100007F:1F90" -> ("127.0.0.1", 8080).

    The address is hex of 32-bit words, each in the host's byte order: one word for IPv4,
    four for IPv6. The port is plain hex.
    """
    hex_address, hex_port = field.split(":")
    words = [bytes.fromhex(hex_address[i:i + 8]) for i in range(0, len(hex_address), 8)]
    if sys.byteorder == "little":
        words = [w[::-1] for w in words]
    packed = b"".join(words)
    family = socket.AF_INET if len(packed) == 4 else socket.AF_INET6
    return socket.inet_ntop(family, packed), int(hex_port, 16)


def sockets_of(pids: list[int]) -> list[BoundSocket]:
    """Every TCP and UDP socket the processes hold, IPv4 and IPv6."""
    found = []
    for pid in pids:
        inodes = socket_inodes(pid)
        if not inodes:
            continue
        for protocol in TABLES:
            try:
                table = parse_table((PROC / str(pid) / "net" / protocol).read_text(), protocol)
            except OSError:
                continue
            for inode in inodes & table.keys():
                address, port, state = table[inode]
                found.append(BoundSocket(pid, protocol, address, port, state))
    return sorted(found, key=lambda s: (s.pid, s.protocol, s.port))


def listeners_of_tree(root: int) -> list[BoundSocket]:
    """The sockets open to anyone of `root` and its descendants."""
    return [s for s in sockets_of(process_tree(root)) if s.is_open_to_anyone]


def non_loopback(sockets: list[BoundSocket]) -> list[str]:
    """The sockets in `sockets` bound to an address other than loopback, described."""
    return [str(s) for s in sockets if not s.is_loopback]
