"""The connections to one pod address: at most `max_connections` open, idle ones reused
most recent first, and the hops waiting for one served first come, first served.

`PodClient` (pod_client.py) keeps one per pod; this module knows nothing of HTTP, only
that a connection can be lost, reused or closed.
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvferry.router.pod_client import PodConnection

# Servers close idle keep-alive connections (uvicorn after 5 s); one idle longer than this
# is closed rather than reused, so a request is never written into a closing connection.
MAX_IDLE_S = 4.0


class ConnectionPool:
    """The connections to one pod address: idle ones, how many are open, the hops waiting.

    `num_open` counts every connection open or being opened (idle ones included); it never
    passes `max_connections`. A hop takes an idle connection, or the right to open one
    (a slot), or waits in `waiters` until a released connection or a freed slot is handed
    to it. Invariant: a hop waits only while no connection is idle.
    """

    def __init__(self, max_connections: int) -> None:
        self.max_connections = max_connections
        self.num_open = 0
        # Most recently used last: hops take from the end, stale ones go from the front.
        self.idle: deque[PodConnection] = deque()
        # Each gets a connection, or None for a slot to open one.
        self.waiters: deque[asyncio.Future[PodConnection | None]] = deque()

    def take(self, now: float) -> PodConnection | None | bool:
        """An idle connection, None for a slot to open one, or False when the hop must wait."""
        self._close_stale(now)
        while self.idle:
            conn = self.idle.pop()
            if not conn.is_lost:
                return conn
            self._close(conn)
        if self.num_open < self.max_connections:
            self.num_open += 1
            return None
        return False

    def put_back(self, conn: PodConnection, now: float) -> None:
        """A hop is done with `conn`: it goes to the next waiter, or idle, or is closed."""
        if not conn.is_reusable:
            self._close(conn)
            return
        conn.idle_since = now
        if not self._hand_over(conn):
            self.idle.append(conn)

    def free_slot(self) -> None:
        """A slot taken to open a connection was not used, or its connection failed."""
        self.num_open -= 1
        self._pass_slot_on()

    def close(self) -> None:
        """Fails the waiting hops and closes the idle connections (busy ones close as
        their hops release them)."""
        while self.waiters:
            waiter = self.waiters.popleft()
            if not waiter.done():
                waiter.set_exception(ConnectionError("the router is stopping"))
        while self.idle:
            self._close(self.idle.pop())

    def _close(self, conn: PodConnection) -> None:
        conn.close()
        self.free_slot()

    def _close_stale(self, now: float) -> None:
        """Closes idle connections unused for MAX_IDLE_S (oldest first), which the pod is
        about to close itself; each frees a slot."""
        while self.idle and now - self.idle[0].idle_since >= MAX_IDLE_S:
            self._close(self.idle.popleft())

    def _pass_slot_on(self) -> None:
        if self.waiters and self.num_open < self.max_connections:
            self.num_open += 1
            if not self._hand_over(None):
                self.num_open -= 1

    def _hand_over(self, conn: PodConnection | None) -> bool:
        """Gives `conn` (or a slot) to the first hop still waiting; False when none is."""
        while self.waiters:
            waiter = self.waiters.popleft()
            if not waiter.done():
                waiter.set_result(conn)
                return True
        return False
