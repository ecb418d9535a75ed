"""A small HTTP/1.1 server for the side channel: one thread, bounded in every dimension.

Any client that reaches a producer may connect to its side channel, so connections must
not cost threads or hold anything for long:

- one thread runs an asyncio loop that serves every connection, however many there are:
  an idle or slow connection is a suspended coroutine, not a blocked thread;
- a connection that sends no request within `idle_timeout_s`, or whose request (head and
  body) does not arrive within `read_timeout_s` of its first byte, is closed; so is one
  whose reply is not taken within `write_timeout_s`;
- at most `max_connections` are open: a new one closes the connection idle for longest,
  so a crowd of silent connections cannot lock a consumer out;
- heads are capped at `max_head_bytes` and bodies at `max_body_bytes`; only
  Content-Length bodies are accepted.

The handler is a plain function of (method, path, headers, body) run on the loop thread:
the side channel's work per request (a lease-table lookup, a msgpack encode) is too short
to be worth handing to other threads.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServerLimits:
    """What one client may hold of the server; the defaults suit the side channel."""

    max_connections: int = 256
    idle_timeout_s: float = 10.0
    read_timeout_s: float = 5.0
    write_timeout_s: float = 5.0
    max_head_bytes: int = 16 * 1024
    max_body_bytes: int = 1 << 20


@dataclass(frozen=True)
class Request:
    method: str
    path: str
    # Header names lower-cased.
    headers: dict[str, str]
    body: bytes


@dataclass(frozen=True)
class Response:
    status: int
    body: bytes
    content_type: str = "text/plain"
    # Extra headers (a signature).
    headers: tuple[tuple[str, str], ...] = ()


Handler = Callable[[Request], Response]

_REASONS = {200: "OK", 400: "Bad Request", 401: "Unauthorized", 404: "Not Found",
            411: "Length Required", 413: "Content Too Large"}


class _BadRequest(Exception):
    """A request that is answered with an error and then closed."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.response = Response(status, message.encode())


class BoundedHTTPServer:
    """Serves `handler` on `host:port` from one background thread, within `limits`."""

    def __init__(self, host: str, port: int, handler: Handler, name: str,
                 limits: ServerLimits | None = None) -> None:
        self.handler = handler
        self.limits = limits or ServerLimits()
        # Bound now, so the port is known (and taken) before start().
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._sock = socket.create_server((host, port), family=family, backlog=128)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._listening = threading.Event()
        self._stop: asyncio.Event | None = None
        # Open connections, least recently active first -> whether a reply is being written.
        self._open: dict[asyncio.StreamWriter, bool] = {}
        self._tasks: set[asyncio.Task[None]] = set()

    @property
    def port(self) -> int:
        return int(self._sock.getsockname()[1])

    @property
    def num_connections(self) -> int:
        return len(self._open)

    def start(self) -> None:
        self._thread.start()
        if not self._listening.wait(10):
            raise RuntimeError(f"{self._thread.name}: the server did not start within 10 s")

    def close(self) -> None:
        if self._thread.is_alive() and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
            self._thread.join(timeout=5)
        self._sock.close()

    # ------------------------------------------------------------------ loop thread
    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_until_complete(self._serve())
        finally:
            self._loop.close()

    async def _serve(self) -> None:
        self._stop = asyncio.Event()
        server = await asyncio.start_server(self._on_connection, sock=self._sock,
                                            limit=self.limits.max_head_bytes)
        self._listening.set()
        async with server:
            await self._stop.wait()
            # Aborted connections end their tasks (their reads see end of stream); a task
            # cancelled instead would make asyncio log its CancelledError.
            for writer in list(self._open):
                writer.transport.abort()
            if self._tasks:
                await asyncio.wait(list(self._tasks), timeout=self.limits.write_timeout_s)

    async def _on_connection(self, reader: asyncio.StreamReader,
                             writer: asyncio.StreamWriter) -> None:
        self._admit(writer)
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        try:
            while await self._serve_one(reader, writer):
                pass
        except (TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError,
                ConnectionError) as exc:
            # Slow, silent, oversized or vanished clients are simply closed.
            logger.debug("side channel connection closed: %s", type(exc).__name__)
        finally:
            self._tasks.discard(task)
            self._open.pop(writer, None)
            writer.close()

    def _admit(self, writer: asyncio.StreamWriter) -> None:
        """Registers a connection, closing the longest idle one when at the limit."""
        if len(self._open) >= self.limits.max_connections:
            idle = next((w for w, busy in self._open.items() if not busy), None)
            if idle is not None:
                self._open.pop(idle)
                idle.transport.abort()
        self._open[writer] = False

    async def _serve_one(self, reader: asyncio.StreamReader,
                         writer: asyncio.StreamWriter) -> bool:
        """Reads one request and answers it; False when the connection should close."""
        limits = self.limits
        try:
            async with asyncio.timeout(limits.idle_timeout_s):
                first = await reader.readexactly(1)
        except asyncio.IncompleteReadError:
            return False  # the client closed between requests
        try:
            async with asyncio.timeout(limits.read_timeout_s):
                request = await self._read_request(first, reader)
        except _BadRequest as bad:
            await self._write(writer, bad.response, keep_alive=False)
            return False
        keep_alive = request.headers.get("connection", "").lower() != "close"
        self._open[writer] = True
        await self._write(writer, self.handler(request), keep_alive)
        # Active just now: the last to be closed for room.
        self._open.pop(writer, None)
        self._open[writer] = False
        return keep_alive

    async def _read_request(self, first: bytes, reader: asyncio.StreamReader) -> Request:
        head = first + await reader.readuntil(b"\r\n\r\n")
        method, path, headers = _parse_head(head)
        if "transfer-encoding" in headers:
            raise _BadRequest(411, "send the body with a Content-Length")
        length = headers.get("content-length", "0")
        if not length.isdigit():
            raise _BadRequest(400, "Content-Length must be a number of bytes")
        if int(length) > self.limits.max_body_bytes:
            raise _BadRequest(413, f"the body may have at most {self.limits.max_body_bytes} bytes")
        body = await reader.readexactly(int(length)) if int(length) else b""
        return Request(method, path, headers, body)

    async def _write(self, writer: asyncio.StreamWriter, response: Response,
                     keep_alive: bool) -> None:
        reason = _REASONS.get(response.status, "Error")
        lines = [f"HTTP/1.1 {response.status} {reason}",
                 f"Content-Type: {response.content_type}",
                 f"Content-Length: {len(response.body)}",
                 f"Connection: {'keep-alive' if keep_alive else 'close'}",
                 *(f"{name}: {value}" for name, value in response.headers)]
        # One write: head and body leave in one segment, no wait on a delayed ACK.
        writer.write(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + response.body)
        async with asyncio.timeout(self.limits.write_timeout_s):
            await writer.drain()


def _parse_head(head: bytes) -> tuple[str, str, dict[str, str]]:
    """(method, path, headers) of a request head; _BadRequest when it is not HTTP/1.x."""
    try:
        text = head.decode("latin-1")
        request_line, *header_lines = text[:-4].split("\r\n")
        method, path, version = request_line.split(" ")
    except ValueError:
        raise _BadRequest(400, "malformed request line") from None
    if not version.startswith("HTTP/1."):
        raise _BadRequest(400, f"unsupported protocol {version[:16]!r}")
    headers = {}
    for line in header_lines:
        name, sep, value = line.partition(":")
        if not sep:
            raise _BadRequest(400, "malformed header line")
        headers[name.strip().lower()] = value.strip()
    return method, path, headers
