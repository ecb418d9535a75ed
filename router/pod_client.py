"""A lean HTTP/1.1 client for the router's hops to the pods: keep-alive connections per pod,
one request at a time on each, the answer's body handed on chunk by chunk as it arrives.

At most `max_connections` are open to one pod; a hop beyond waits (FIFO) for one to come
free, within its read timeout, so a thousand client connections reuse a bounded set of
connections instead of opening a thousand at once against a busy pod.

A hop is one POST whose answer is relayed; a general client (aiohttp) spends about 150 us
of CPU on each, several times the cost of the bytes themselves, and at one stream that is
most of the latency the router adds. This client writes the request in one `write` and
parses the answer with httptools (the parser uvicorn uses); nothing else happens per request.

A large body (an uploaded audio file) is given as a list of buffers instead, views of the
one copy the router holds: they are written a slice at a time, each after the pod has read
the last (the transport's flow control), so the upload is never copied whole again into a
request or a socket buffer.

Failures raise what the hops already treat as a pod being down: `ConnectionError` (an
OSError) when a connection is lost or speaks bad HTTP, its subclass `PodUnreachable` when
none can be opened (refused, unreachable: nothing serves there), `TimeoutError` when a
deadline passes.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from urllib.parse import urlsplit

import httptools
from kvferry.router.config import DEFAULT_MAX_POD_CONNECTIONS
from kvferry.router.connection_pool import ConnectionPool

# Past this many unread bytes the connection stops reading until the relay catches up.
HIGH_WATER_BYTES = 1 << 20
# A body given as buffers is written in slices of this size, each once the transport has
# room for it (below its write high-water mark).
WRITE_SLICE_BYTES = 256 * 1024

# A request body: bytes written with the request, or buffers (bytes, bytearray, memoryview)
# written one slice at a time after it.
Body = bytes | Sequence[bytes | bytearray | memoryview]


class PodUnreachable(ConnectionError):
    """No connection could be opened to the pod: refused or unreachable, so nothing serves
    at its address (a connect that only took too long is a TimeoutError)."""


@dataclass(frozen=True)
class HopTimeout:
    """Deadlines of one hop, in seconds; None: no limit."""

    connect_s: float | None = None  # opening a new connection
    read_s: float | None = None  # waiting for the answer's headers or its next bytes
    total_s: float | None = None  # the whole exchange, to the answer's last byte


class PodConnection(asyncio.Protocol):
    """One keep-alive connection and the answer being received on it."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._parser = httptools.HttpResponseParser(self)
        self.transport: asyncio.Transport | None = None
        self.idle_since = 0.0
        self.is_lost = False
        self._error: Exception | None = None
        self._waiter: asyncio.Future[None] | None = None
        # The answer in progress.
        self.status = 0
        self.headers: dict[str, str] = {}
        self._header_name = ""
        self.is_headers_complete = False
        self.is_message_complete = False
        self._is_keep_alive = False
        self.num_received = 0  # bytes of the answer in progress
        self._chunks: list[bytes] = []
        self._num_buffered = 0
        self._is_paused = False
        # Writing a body in slices: the transport's buffer is full, and the future a writer
        # waits on until it drains; whether the request went out short of its body (the pod
        # answered before reading it all), which leaves the connection unusable.
        self._is_write_paused = False
        self._drain_waiter: asyncio.Future[None] | None = None
        self._is_body_cut = False

    # ------------------------------------------------------------------ asyncio callbacks
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def pause_writing(self) -> None:
        self._is_write_paused = True

    def resume_writing(self) -> None:
        self._is_write_paused = False
        waiter = self._drain_waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def data_received(self, data: bytes) -> None:
        self.num_received += len(data)
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(ConnectionError(f"the pod answered with bad HTTP: {exc}"))
            assert self.transport is not None
            self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.is_lost = True
        lost = ConnectionError(f"the pod closed the connection: {exc}" if exc
                               else "the pod closed the connection")
        if not self.is_message_complete:
            self._fail(lost)
        waiter = self._drain_waiter  # a body being written goes nowhere now
        if waiter is not None and not waiter.done():
            waiter.set_exception(lost)

    # ------------------------------------------------------------------ httptools callbacks
    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers[name.decode("latin-1").lower()] = value.decode("latin-1")

    def on_headers_complete(self) -> None:
        self.status = self._parser.get_status_code()
        # Asked now: once the message is complete the parser describes the next one.
        self._is_keep_alive = self._parser.should_keep_alive()
        self.is_headers_complete = True
        self._wake()

    def on_body(self, body: bytes) -> None:
        self._chunks.append(body)
        self._num_buffered += len(body)
        if self._num_buffered > HIGH_WATER_BYTES and not self._is_paused:
            self._is_paused = True
            assert self.transport is not None
            self.transport.pause_reading()
        self._wake()

    def on_message_complete(self) -> None:
        self.is_message_complete = True
        self._wake()

    # ------------------------------------------------------------------ the caller's side
    def start(self, request: bytes) -> None:
        """Sends a request on an idle connection and resets the answer's state."""
        assert self.transport is not None
        self.status = 0
        self.headers = {}
        self.is_headers_complete = False
        self.is_message_complete = False
        self._is_keep_alive = False
        self.num_received = 0
        self._error = None
        self._chunks = []
        self._num_buffered = 0
        self._is_body_cut = False
        self.transport.write(request)

    async def wait(self, timeout_s: float | None) -> None:
        """Until the parser or the connection has news; TimeoutError after `timeout_s`."""
        if self._error is not None:
            raise self._error
        waiter = self._waiter = self._loop.create_future()
        timer = (self._loop.call_later(timeout_s, _time_out, waiter)
                 if timeout_s is not None else None)
        try:
            await waiter
        finally:
            self._waiter = None
            if timer is not None:
                timer.cancel()
        if self._error is not None:
            raise self._error

    def take_chunks(self) -> list[bytes]:
        chunks, self._chunks = self._chunks, []
        self._num_buffered = 0
        if self._is_paused:
            self._is_paused = False
            assert self.transport is not None
            self.transport.resume_reading()
        return chunks

    @property
    def is_reusable(self) -> bool:
        return (self.is_message_complete and self._is_keep_alive and not self.is_lost
                and self._error is None and not self._is_body_cut)

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()

    def _wake(self) -> None:
        # A body's writer wakes too: an answer that comes before the whole body went out
        # ends the writing.
        for waiter in (self._waiter, self._drain_waiter):
            if waiter is not None and not waiter.done():
                waiter.set_result(None)

    def _fail(self, exc: Exception) -> None:
        self._error = exc
        for waiter in (self._waiter, self._drain_waiter):
            if waiter is not None and not waiter.done():
                waiter.set_exception(exc)

    async def write_body(self, parts: Sequence[bytes | bytearray | memoryview],
                         wait_s: Callable[[], float | None]) -> None:
        """Writes the body after the request's head, a slice at a time, waiting (up to
        `wait_s()` each time) for the pod to read what the transport holds before the next.
        Stops early when the pod answers first (a refusal before the body is read): the
        request is then cut short, and the connection is not reused."""
        assert self.transport is not None
        for part in parts:
            view = memoryview(part).cast("B")
            for offset in range(0, len(view), WRITE_SLICE_BYTES):
                if self.is_headers_complete:
                    self._is_body_cut = True
                    return
                if self._error is not None:
                    raise self._error
                self.transport.write(view[offset:offset + WRITE_SLICE_BYTES])
                try:
                    while self._is_write_paused and not self.is_headers_complete:
                        await self._drained(wait_s())
                except ConnectionError:
                    if not self.is_headers_complete:
                        raise
                    # Answered, then closed: the answer is the pod's word on the request.

    async def _drained(self, timeout_s: float | None) -> None:
        waiter = self._drain_waiter = self._loop.create_future()
        timer = (self._loop.call_later(timeout_s, _time_out, waiter)
                 if timeout_s is not None else None)
        try:
            await waiter
        finally:
            self._drain_waiter = None
            if timer is not None:
                timer.cancel()


def _time_out(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_exception(TimeoutError("the pod did not answer in time"))


class PodResponse:
    """An answer whose status and headers are in; its body is read with `read` or
    `iter_chunks`. `release` must follow: it returns the connection to the pool when the
    answer was read to its end, and closes it otherwise (the pod then stops the request)."""

    def __init__(self, client: PodClient, pool: ConnectionPool, conn: PodConnection,
                 timeout: HopTimeout, deadline: float | None) -> None:
        self._client = client
        self._pool = pool
        self._conn = conn
        self._timeout = timeout
        self._deadline = deadline
        self.status = conn.status
        self.headers = conn.headers
        self._is_released = False

    async def read_chunk(self) -> bytes:
        """The body's next bytes (what arrived since the last call, joined); b"" at its end."""
        conn = self._conn
        while True:
            chunks = conn.take_chunks()
            if chunks:
                return chunks[0] if len(chunks) == 1 else b"".join(chunks)
            if conn.is_message_complete:
                return b""
            await conn.wait(self._client.wait_s(self._timeout, self._deadline))

    async def iter_chunks(self) -> AsyncIterator[bytes]:
        """The body's bytes as they arrive, each delivery joined into one chunk."""
        while chunk := await self.read_chunk():
            yield chunk

    async def read(self) -> bytes:
        """The whole body."""
        return b"".join([chunk async for chunk in self.iter_chunks()])

    def release(self) -> None:
        if self._is_released:
            return
        self._is_released = True
        self._client.put_back(self._pool, self._conn)


class PodClient:
    """A connection pool per pod address; requests never share a connection."""

    def __init__(self, max_connections: int = DEFAULT_MAX_POD_CONNECTIONS) -> None:
        if max_connections < 1:
            raise ValueError(f"max_connections must be >= 1, got {max_connections}")
        self.max_connections = max_connections
        self._pools: dict[tuple[str, int], ConnectionPool] = {}
        # A pod's base URL -> (host, port, Host header value).
        self._addresses: dict[str, tuple[str, int, bytes]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None

    @property
    def num_waiting(self) -> int:
        """Hops waiting for a connection to come free, all pods together."""
        return sum(len(pool.waiters) for pool in self._pools.values())

    def num_open(self, base_url: str) -> int:
        """Connections open (or being opened) to the pod at `base_url`."""
        host, port, _ = self._address(base_url)
        pool = self._pools.get((host, port))
        return pool.num_open if pool is not None else 0

    async def post(self, base_url: str, path: str, body: Body, headers: dict[str, str],
                   timeout: HopTimeout) -> PodResponse:
        """POSTs `body` to the pod at `base_url`; returns once the answer's headers are in."""
        loop = self._loop = asyncio.get_running_loop()
        host, port, host_header = self._address(base_url)
        if isinstance(body, bytes):
            request, parts = _request_bytes(path, host_header, headers, body), ()
        else:
            size = sum(memoryview(p).nbytes for p in body)
            request, parts = _request_head(path, host_header, headers, size), body
        deadline = loop.time() + timeout.total_s if timeout.total_s is not None else None
        pool = self._pool((host, port))
        conn = await self._acquire(pool, host, port, timeout, deadline)
        if conn is not None:
            try:
                return await self._exchange(pool, conn, request, parts, timeout, deadline)
            except ConnectionError:
                if conn.num_received:
                    pool.free_slot()
                    raise
                # Closed by the pod as the request went out (an idle connection timing out
                # there): the request was never read, so it goes again on a new connection,
                # in the slot the closed one held.
            except BaseException:
                pool.free_slot()
                raise
        try:
            conn = await self._connect(loop, host, port, timeout, deadline)
            return await self._exchange(pool, conn, request, parts, timeout, deadline)
        except BaseException:
            pool.free_slot()
            raise

    async def _acquire(self, pool: ConnectionPool, host: str, port: int, timeout: HopTimeout,
                       deadline: float | None) -> PodConnection | None:
        """An idle connection, or None: a slot to open one. Waits while the pod has
        `max_connections` busy, up to the hop's read timeout (waiting for a connection is
        waiting for the pod's answer) or its deadline; TimeoutError past it."""
        assert self._loop is not None
        taken = pool.take(self._loop.time())
        if taken is not False:
            return taken  # type: ignore[return-value]
        waiter: asyncio.Future[PodConnection | None] = self._loop.create_future()
        pool.waiters.append(waiter)
        limit = self.wait_s(timeout, deadline)
        try:
            async with asyncio.timeout(limit):
                return await waiter
        except BaseException as exc:
            self._unwait(pool, waiter)
            if isinstance(exc, TimeoutError):
                raise TimeoutError(f"no connection to {host}:{port} came free within {limit} s "
                                   f"({pool.max_connections} open, the most allowed)") from None
            raise

    def _unwait(self, pool: ConnectionPool, waiter: asyncio.Future[PodConnection | None]
                ) -> None:
        """A hop stops waiting (timed out, cancelled). A connection or slot handed to it
        just before goes back to the pool, so none is lost."""
        if not waiter.done() or waiter.cancelled():
            # Cancelling this task cancelled the future it awaited too; either way it is
            # still in the queue.
            waiter.cancel()
            with contextlib.suppress(ValueError):
                pool.waiters.remove(waiter)
        elif waiter.exception() is None:
            handed = waiter.result()
            if handed is None:
                pool.free_slot()
            else:
                self.put_back(pool, handed)

    async def _exchange(self, pool: ConnectionPool, conn: PodConnection, request: bytes,
                        parts: Sequence[bytes | bytearray | memoryview], timeout: HopTimeout,
                        deadline: float | None) -> PodResponse:
        """Sends the request (and the body `parts`, if any) on `conn` and waits for the
        answer's headers; on failure the connection is closed and its slot stays with the
        caller."""
        conn.start(request)
        try:
            if parts:
                await conn.write_body(parts, lambda: self.wait_s(timeout, deadline))
            while not conn.is_headers_complete:
                await conn.wait(self.wait_s(timeout, deadline))
        except BaseException:
            conn.close()
            raise
        return PodResponse(self, pool, conn, timeout, deadline)

    def wait_s(self, timeout: HopTimeout, deadline: float | None) -> float | None:
        """How long the next wait for bytes may last (the read timeout, or less when the
        total deadline is nearer)."""
        if deadline is None:
            return timeout.read_s
        assert self._loop is not None
        left = max(0.0, deadline - self._loop.time())
        return left if timeout.read_s is None else min(left, timeout.read_s)

    def put_back(self, pool: ConnectionPool, conn: PodConnection) -> None:
        """A hop is done with `conn` (reused if its answer was read whole, else closed)."""
        assert self._loop is not None
        pool.put_back(conn, self._loop.time())

    async def close(self) -> None:
        for pool in self._pools.values():
            pool.close()
        self._pools.clear()

    def _pool(self, key: tuple[str, int]) -> ConnectionPool:
        pool = self._pools.get(key)
        if pool is None:
            pool = self._pools[key] = ConnectionPool(self.max_connections)
        return pool

    async def _connect(self, loop: asyncio.AbstractEventLoop, host: str, port: int,
                       timeout: HopTimeout, deadline: float | None) -> PodConnection:
        limit = timeout.connect_s
        if deadline is not None:
            left = max(0.0, deadline - loop.time())
            limit = left if limit is None else min(limit, left)
        try:
            async with asyncio.timeout(limit):
                _, conn = await loop.create_connection(lambda: PodConnection(loop), host, port)
        except TimeoutError:
            raise TimeoutError(f"connecting to {host}:{port} took over {limit} s") from None
        except OSError as exc:
            raise PodUnreachable(f"cannot connect to {host}:{port}: {exc}") from exc
        return conn

    def _address(self, base_url: str) -> tuple[str, int, bytes]:
        address = self._addresses.get(base_url)
        if address is None:
            parts = urlsplit(base_url)
            if parts.scheme != "http" or not parts.hostname:
                raise ValueError(f"a pod URL must be http://host[:port], got {base_url!r}")
            port = parts.port or 80
            address = (parts.hostname, port, f"{parts.hostname}:{port}".encode("latin-1"))
            self._addresses[base_url] = address
        return address


def _request_bytes(path: str, host_header: bytes, headers: dict[str, str], body: bytes) -> bytes:
    return _request_head(path, host_header, headers, len(body)) + body


def _request_head(path: str, host_header: bytes, headers: dict[str, str],
                  content_length: int) -> bytes:
    lines = [b"POST ", path.encode("latin-1"), b" HTTP/1.1\r\nhost: ", host_header,
             b"\r\ncontent-length: ", str(content_length).encode(), b"\r\n"]
    for name, value in headers.items():
        if "\r" in value or "\n" in value:
            raise ValueError(f"header {name} holds a line break")
        lines += [name.encode("latin-1"), b": ", value.encode("latin-1"), b"\r\n"]
    lines.append(b"\r\n")
    return b"".join(lines)

