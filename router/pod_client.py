"""A lean HTTP/1.1 client for the router's hops to the pods: keep-alive connections per pod,
one request at a time on each, the answer's body handed on chunk by chunk as it arrives.

A hop is one POST whose answer is relayed; a general client (aiohttp) spends about 150 us
of CPU on each, several times the cost of the bytes themselves, and at one stream that is
most of the latency the router adds. This client writes the request in one `write` and
parses the answer with httptools (the parser uvicorn uses); nothing else happens per request.

Failures raise what the hops already treat as a pod being down: `ConnectionError` (an
OSError) when a connection is refused, lost or speaks bad HTTP, `TimeoutError` when a
deadline passes.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
from urllib.parse import urlsplit

import httptools

# Servers close idle keep-alive connections (uvicorn after 5 s); one idle longer than this
# is closed rather than reused, so a request is never written into a closing connection.
MAX_IDLE_S = 4.0
# Past this many unread bytes the connection stops reading until the relay catches up.
HIGH_WATER_BYTES = 1 << 20


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

    # ------------------------------------------------------------------ asyncio callbacks
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

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
        if not self.is_message_complete:
            self._fail(ConnectionError(f"the pod closed the connection: {exc}" if exc
                                       else "the pod closed the connection"))

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
                and self._error is None)

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _fail(self, exc: Exception) -> None:
        self._error = exc
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_exception(exc)


def _time_out(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_exception(TimeoutError("the pod did not answer in time"))


class PodResponse:
    """An answer whose status and headers are in; its body is read with `read` or
    `iter_chunks`. `release` must follow: it returns the connection to the pool when the
    answer was read to its end, and closes it otherwise (the pod then stops the request)."""

    def __init__(self, client: PodClient, key: tuple[str, int], conn: PodConnection,
                 timeout: HopTimeout, deadline: float | None) -> None:
        self._client = client
        self._key = key
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
        self._client.put_back(self._key, self._conn)


class PodClient:
    """Idle connections per pod address; requests never share a connection."""

    def __init__(self) -> None:
        self._idle: dict[tuple[str, int], list[PodConnection]] = {}
        # A pod's base URL -> (host, port, Host header value).
        self._addresses: dict[str, tuple[str, int, bytes]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None

    async def post(self, base_url: str, path: str, body: bytes, headers: dict[str, str],
                   timeout: HopTimeout) -> PodResponse:
        """POSTs `body` to the pod at `base_url`; returns once the answer's headers are in."""
        loop = self._loop = asyncio.get_running_loop()
        host, port, host_header = self._address(base_url)
        request = _request_bytes(path, host_header, headers, body)
        deadline = loop.time() + timeout.total_s if timeout.total_s is not None else None
        key = (host, port)
        conn = self._idle_connection(key, loop.time())
        if conn is not None:
            try:
                return await self._exchange(key, conn, request, timeout, deadline)
            except ConnectionError:
                if conn.num_received:
                    raise
                # Closed by the pod as the request went out (an idle connection timing out
                # there): the request was never read, so it goes again on a new connection.
        conn = await self._connect(loop, host, port, timeout, deadline)
        return await self._exchange(key, conn, request, timeout, deadline)

    async def _exchange(self, key: tuple[str, int], conn: PodConnection, request: bytes,
                        timeout: HopTimeout, deadline: float | None) -> PodResponse:
        """Sends the request on `conn` and waits for the answer's headers."""
        conn.start(request)
        try:
            while not conn.is_headers_complete:
                await conn.wait(self.wait_s(timeout, deadline))
        except BaseException:
            conn.close()
            raise
        return PodResponse(self, key, conn, timeout, deadline)

    def wait_s(self, timeout: HopTimeout, deadline: float | None) -> float | None:
        """How long the next wait for bytes may last (the read timeout, or less when the
        total deadline is nearer)."""
        if deadline is None:
            return timeout.read_s
        assert self._loop is not None
        left = max(0.0, deadline - self._loop.time())
        return left if timeout.read_s is None else min(left, timeout.read_s)

    def put_back(self, key: tuple[str, int], conn: PodConnection) -> None:
        if not conn.is_reusable:
            conn.close()
            return
        assert self._loop is not None
        conn.idle_since = self._loop.time()
        self._idle.setdefault(key, []).append(conn)

    async def close(self) -> None:
        for conns in self._idle.values():
            for conn in conns:
                conn.close()
        self._idle.clear()

    def _idle_connection(self, key: tuple[str, int], now: float) -> PodConnection | None:
        """The most recently used live idle connection to `key`; stale ones are closed."""
        conns = self._idle.get(key)
        while conns:
            conn = conns.pop()
            if not conn.is_lost and now - conn.idle_since < MAX_IDLE_S:
                return conn
            conn.close()
        return None

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
    lines = [b"POST ", path.encode("latin-1"), b" HTTP/1.1\r\nhost: ", host_header,
             b"\r\ncontent-length: ", str(len(body)).encode(), b"\r\n"]
    for name, value in headers.items():
        if "\r" in value or "\n" in value:
            raise ValueError(f"header {name} holds a line break")
        lines += [name.encode("latin-1"), b": ", value.encode("latin-1"), b"\r\n"]
    lines += [b"\r\n", body]
    return b"".join(lines)

