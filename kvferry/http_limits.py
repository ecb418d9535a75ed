"""What every kvferry HTTP server (the router, each engine pod) bounds per connection, so
that clients that open connections and send nothing, or send a request slowly, cannot hold
a server's sockets and memory for ever.

- **Header time**: a new connection must complete its first request's headers within
  `header_timeout_s`; a later request on a kept-alive connection, within `header_timeout_s`
  of its first byte (until then the keep-alive timeout applies).
- **Body time**: a request's body must arrive whole within `body_timeout_s` of its headers;
  a client that sends less than its Content-Length is answered 408 and closed.
- **Idle time**: a kept-alive connection with no request is closed after
  `keep_alive_timeout_s` (uvicorn's `timeout_keep_alive`).
- **Open connections**: past `max_connections`, a new connection is answered 503 and closed.

Refusals carry the OpenAI error body, like every other answer of these servers. The
settings and their flags are here; `kvferry.http_protocol` applies them to uvicorn.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

DEFAULT_HEADER_TIMEOUT_S = 10.0
DEFAULT_BODY_TIMEOUT_S = 30.0
DEFAULT_KEEP_ALIVE_TIMEOUT_S = 5.0
DEFAULT_MAX_CONNECTIONS = 4096


@dataclass(frozen=True)
class HttpLimits:
    """Per-connection limits of one HTTP server (seconds, and a connection count)."""

    header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S
    body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S
    keep_alive_timeout_s: float = DEFAULT_KEEP_ALIVE_TIMEOUT_S
    max_connections: int = DEFAULT_MAX_CONNECTIONS

    def __post_init__(self) -> None:
        for name, flag in (("header_timeout_s", "--header-timeout"),
                           ("body_timeout_s", "--body-timeout"),
                           ("keep_alive_timeout_s", "--keep-alive-timeout")):
            if not getattr(self, name) > 0:
                raise ValueError(f"{flag} must be > 0, got {getattr(self, name)}")
        if self.max_connections < 1:
            raise ValueError(f"--max-connections must be >= 1, got {self.max_connections}")


def add_http_limit_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of `HttpLimits`, shared by `kvferry serve` and `kvferry router`."""
    group = parser.add_argument_group("connection limits")
    group.add_argument("--header-timeout", type=float, default=DEFAULT_HEADER_TIMEOUT_S,
                       metavar="S", help="close a connection whose request headers take "
                                         f"longer (default {DEFAULT_HEADER_TIMEOUT_S:g})")
    group.add_argument("--body-timeout", type=float, default=DEFAULT_BODY_TIMEOUT_S,
                       metavar="S", help="answer 408 and close when a request body takes "
                                         "longer after its headers (default "
                                         f"{DEFAULT_BODY_TIMEOUT_S:g})")
    group.add_argument("--keep-alive-timeout", type=float, default=DEFAULT_KEEP_ALIVE_TIMEOUT_S,
                       metavar="S", help="close a kept-alive connection idle this long "
                                         f"(default {DEFAULT_KEEP_ALIVE_TIMEOUT_S:g})")
    group.add_argument("--max-connections", type=int, default=DEFAULT_MAX_CONNECTIONS,
                       metavar="N", help="answer 503 and close new connections while N are "
                                         f"open (default {DEFAULT_MAX_CONNECTIONS})")


def http_limits_from_args(args: argparse.Namespace) -> HttpLimits:
    """ValueError names the flag out of range."""
    return HttpLimits(header_timeout_s=args.header_timeout, body_timeout_s=args.body_timeout,
                      keep_alive_timeout_s=args.keep_alive_timeout,
                      max_connections=args.max_connections)
