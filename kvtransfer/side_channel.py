"""The producer's side channel: how two pods find each other with nothing else.

`remote_host:remote_port` in a request's params point here. A small HTTP server (one
thread per connection, bodies in msgpack) on the producer answers:

- `GET  /kvferry/v1/handshake`: `HandshakeInfo`: engine id, NIXL agent name and metadata,
  KV layout and region of every block group, compatibility hash, lease length;
- `POST /kvferry/v1/renew` (`LeaseRequest` -> `LeaseReply`): heartbeats; extends the leases
  of the named requests and says which are still held;
- `POST /kvferry/v1/free` (`LeaseRequest` -> `LeaseReply`): the consumer will not pull
  (cancelled, failed, computed locally); ends the holds now.

HTTP keeps the channel debuggable with curl; every client call has a timeout, so a
producer that died or hangs costs a consumer at most `side_channel_timeout_s`.
"""

from __future__ import annotations

import http.client
import logging
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TypeVar

import msgspec
from kvferry.kvtransfer.layout import KVLayout, RegionInfo
from kvferry.kvtransfer.lease import LeaseTable
from kvferry.kvtransfer.metrics import HoldEnd

logger = logging.getLogger(__name__)
_T = TypeVar("_T")

HANDSHAKE_PATH = "/kvferry/v1/handshake"
RENEW_PATH = "/kvferry/v1/renew"
FREE_PATH = "/kvferry/v1/free"
_CONTENT_TYPE = "application/msgpack"
# Largest request body accepted: a heartbeat naming many thousands of request ids.
_MAX_BODY_BYTES = 1 << 20


class HandshakeInfo(msgspec.Struct, frozen=True):
    """Everything a consumer needs to read a producer's blocks."""

    protocol_version: int
    engine_id: str
    # Changes whenever the producer process restarts, even under the same engine id.
    agent_name: str
    # NIXL agent metadata (connection info and registered memory) for add_remote_agent.
    agent_metadata: bytes
    model_id: str
    # Per block group: its cache layout and where its cache lives.
    layouts: list[KVLayout]
    regions: list[RegionInfo]
    compat_hash: str
    lease_s: float


class LeaseRequest(msgspec.Struct, frozen=True):
    """Heartbeat or free for some of one producer's holds."""

    # The producer incarnation the consumer means (a restarted producer holds none of its
    # holds); "" means whichever runs now.
    agent_name: str
    req_ids: list[str]
    # The consumer asking (its NIXL agent name): the first to renew a hold is its only
    # reader; "" speaks for no one in particular.
    reader: str = ""


class LeaseReply(msgspec.Struct, frozen=True):
    # Per requested id: held (renew) or freed now (free).
    held: list[bool]
    lease_s: float
    # The producer incarnation answering: another one than asked for means it restarted.
    agent_name: str
    # Renew only: per requested id, the block ids held for it, per block group ([] when not
    # held). A consumer reads only these: params naming other blocks are refused.
    block_ids: list[list[list[int]]] = []


class SideChannelError(Exception):
    """A side-channel call failed: refused, timed out, or answered with an error."""


class SideChannelServer:
    """Serves one producer's handshake and leases from a background thread."""

    def __init__(self, host: str, port: int, info: HandshakeInfo, leases: LeaseTable) -> None:
        self.info = info
        self.leases = leases
        self._encoded_info = msgspec.msgpack.encode(info)
        self._httpd = ThreadingHTTPServer((host, port), _make_handler(self))
        self._httpd.daemon_threads = True
        # A short poll interval only bounds how long close() waits for the serving thread.
        self._thread = threading.Thread(
            target=self._httpd.serve_forever, args=(0.05,), name="kvferry-side-channel",
            daemon=True,
        )

    @property
    def port(self) -> int:
        return self._httpd.server_address[1]

    def start(self) -> None:
        self._thread.start()
        logger.info("KV side channel serving engine %s on port %d", self.info.engine_id, self.port)

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=5)

    def handle(self, path: str, body: bytes) -> bytes:
        """Answers one POST; raises ValueError for a request it cannot serve."""
        request = msgspec.msgpack.decode(body, type=LeaseRequest)
        block_ids: list[list[list[int]]] = []
        if request.agent_name and request.agent_name != self.info.agent_name:
            # Meant for an earlier incarnation of this producer: none of its holds exist.
            held = [False] * len(request.req_ids)
        elif path == RENEW_PATH:
            claims = self.leases.claim(request.req_ids, request.reader)
            held = [c is not None for c in claims]
            block_ids = [[list(g) for g in c or ()] for c in claims]
        else:
            held = [self.leases.end(r, HoldEnd.FREED, request.reader) for r in request.req_ids]
        reply = LeaseReply(held=held, lease_s=self.leases.lease_s, agent_name=self.info.agent_name,
                           block_ids=block_ids)
        return msgspec.msgpack.encode(reply)

    @property
    def encoded_info(self) -> bytes:
        return self._encoded_info


def _make_handler(server: SideChannelServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        # Headers and body go out in two writes; with Nagle on, the body would wait for the
        # client's delayed ACK (~40 ms a call).
        disable_nagle_algorithm = True

        def do_GET(self) -> None:
            if self.path != HANDSHAKE_PATH:
                self._reply(404, b"unknown path")
                return
            self._reply(200, server.encoded_info, _CONTENT_TYPE)

        def do_POST(self) -> None:
            if self.path not in (RENEW_PATH, FREE_PATH):
                self._reply(404, b"unknown path")
                return
            length = int(self.headers.get("Content-Length") or 0)
            if not 0 < length <= _MAX_BODY_BYTES:
                self._reply(400, b"body must be 1 byte to 1 MiB of msgpack")
                return
            try:
                answer = server.handle(self.path, self.rfile.read(length))
            except (msgspec.DecodeError, msgspec.ValidationError) as e:
                self._reply(400, f"bad request body: {e}".encode())
                return
            self._reply(200, answer, _CONTENT_TYPE)

        def _reply(self, status: int, body: bytes, content_type: str = "text/plain") -> None:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:
            logger.debug("side channel: " + format, *args)

    return Handler


class SideChannelClient:
    """A consumer's calls to one producer's side channel; each bounded by `timeout_s`."""

    def __init__(self, host: str, port: int, timeout_s: float, reader: str = "") -> None:
        self.host = host
        self.port = port
        self.timeout_s = timeout_s
        # This consumer's NIXL agent name, sent with renewals and frees.
        self.reader = reader

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def handshake(self) -> HandshakeInfo:
        return self._call("GET", HANDSHAKE_PATH, None, HandshakeInfo)

    def renew(self, agent_name: str, req_ids: list[str]) -> LeaseReply:
        return self._call("POST", RENEW_PATH, self._lease_request(agent_name, req_ids), LeaseReply)

    def free(self, agent_name: str, req_ids: list[str]) -> LeaseReply:
        return self._call("POST", FREE_PATH, self._lease_request(agent_name, req_ids), LeaseReply)

    def _lease_request(self, agent_name: str, req_ids: list[str]) -> bytes:
        return msgspec.msgpack.encode(
            LeaseRequest(agent_name=agent_name, req_ids=req_ids, reader=self.reader)
        )

    def _call(self, method: str, path: str, body: bytes | None, reply_type: type[_T]) -> _T:
        conn = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout_s)
        try:
            headers = {"Content-Type": _CONTENT_TYPE} if body is not None else {}
            conn.request(method, path, body=body, headers=headers)
            response = conn.getresponse()
            data = response.read()
        except (OSError, http.client.HTTPException) as e:
            raise SideChannelError(f"side channel {self.address}{path}: {e}") from e
        finally:
            conn.close()
        if response.status != 200:
            raise SideChannelError(
                f"side channel {self.address}{path} answered {response.status}: "
                f"{data[:200].decode(errors='replace')}"
            )
        try:
            return msgspec.msgpack.decode(data, type=reply_type)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            raise SideChannelError(f"side channel {self.address}{path}: bad reply: {e}") from e
