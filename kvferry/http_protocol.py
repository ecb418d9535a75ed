"""uvicorn's httptools protocol with `kvferry.http_limits.HttpLimits` applied: deadlines on
the request being received (its headers, then its body) and a cap on open connections."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from kvferry.http_limits import HttpLimits
from kvferry.protocol.errors import error_body

# How long a connection refused for the connection limit stays open for its answer to be read.
REFUSED_LINGER_S = 1.0


def uvicorn_options(limits: HttpLimits) -> dict[str, Any]:
    """The uvicorn.Config options that apply `limits`."""
    return {"http": limited_protocol(limits), "timeout_keep_alive": limits.keep_alive_timeout_s}


def limited_protocol(limits: HttpLimits) -> type[asyncio.Protocol]:
    """uvicorn's httptools protocol with `limits` applied (uvicorn takes a protocol class)."""

    class Limited(LimitedHttpProtocol):
        pass

    Limited.limits = limits
    return Limited


def _error_response(status: int, reason: bytes, message: str, code: str) -> bytes:
    body = json.dumps(error_body(status, message, None, code)).encode()
    head = (b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
            b"connection: close\r\n\r\n" % (status, reason, len(body)))
    return head + body


class LimitedHttpProtocol(HttpToolsProtocol):
    """One connection, with a deadline on the request being received (its headers, then its
    body) and a cap on the connections open at once."""

    limits: HttpLimits = HttpLimits()
    # When the request being received must be in by (its headers, or its body).
    _deadline: asyncio.TimerHandle | None = None
    # Over the connection limit: answered 503, what the client sends is dropped.
    _is_refused = False

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        # `connections` holds every open connection of this server, this one included.
        if len(self.connections) > self.limits.max_connections:
            self._refuse_connection()
            return
        self._arm(self.limits.header_timeout_s, self._on_header_timeout)

    def data_received(self, data: bytes) -> None:
        if not self._is_refused:
            super().data_received(data)

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        if self._deadline is None:  # a later request on a kept-alive connection
            self._arm(self.limits.header_timeout_s, self._on_header_timeout)

    def on_headers_complete(self) -> None:
        super().on_headers_complete()
        self._arm(self.limits.body_timeout_s, self._on_body_timeout)

    def on_message_complete(self) -> None:
        self._disarm()
        super().on_message_complete()

    # ------------------------------------------------------------------ deadlines
    def _arm(self, timeout_s: float, on_timeout: Callable[[], None]) -> None:
        self._disarm()
        self._deadline = self.loop.call_later(timeout_s, on_timeout)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _on_header_timeout(self) -> None:
        # No request is in progress whose app could answer: just close.
        self._close()

    def _close(self) -> None:
        self._deadline = None
        if not self.transport.is_closing():
            self.transport.close()

    def _on_body_timeout(self) -> None:
        self._deadline = None
        if self.transport.is_closing():
            return
        cycle = self.cycle
        if cycle is not None and cycle.response_started:
            self.transport.close()
            return
        self._answer_and_close(408, b"Request Timeout",
                     f"the request body did not arrive within {self.limits.body_timeout_s:g} s "
                     "of its headers (--body-timeout)", "request_timeout")

    def _refuse_connection(self) -> None:
        """503 at once, then the connection is closed when the client has read it (it closes
        on `connection: close`) or after REFUSED_LINGER_S. Not closed at once: closing with
        the client's request unread would reset the connection, and the reset can destroy
        the answer before the client reads it."""
        self._is_refused = True
        self.transport.write(_error_response(
            503, b"Service Unavailable", f"the server holds its limit of "
            f"{self.limits.max_connections} open connections (--max-connections); retry later",
            "service_unavailable"))
        self._arm(REFUSED_LINGER_S, self._close)

    def _answer_and_close(self, status: int, reason: bytes, message: str, code: str) -> None:
        """Answers the error and closes. The app of a request in progress, waiting for its
        body, sees a disconnect once the close is done, and what it sends then is dropped."""
        self.transport.write(_error_response(status, reason, message, code))
        self.transport.close()
