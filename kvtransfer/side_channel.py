"""The producer's side channel: how two pods find each other with nothing else.

`remote_host:remote_port` in a request's params point here. A small HTTP server
(http_server.py: one thread, bounded connections and timeouts, bodies in msgpack) on the
producer answers:

- `GET  /kvferry/v1/handshake`: `HandshakeInfo`: engine id, NIXL agent name and metadata,
  KV layout and region of every block group, compatibility hash, lease length;
- `POST /kvferry/v1/renew` (`LeaseRequest` -> `LeaseReply`): heartbeats; extends the leases
  of the named requests and says which are still held;
- `POST /kvferry/v1/free` (`LeaseRequest` -> `LeaseReply`): the consumer will not pull
  (cancelled, failed, computed locally); ends the holds now.

With the service's transfer key every request and reply is signed (auth.py): a client
without the key gets a 401 and nothing else, and a consumer takes no reply that the key
did not sign. Renewals and frees name their reader (the consumer's NIXL agent), never "".

HTTP keeps the channel debuggable with curl; every client call has a connect and a read
timeout, so a producer that died or hangs costs a consumer at most their sum.
"""

from __future__ import annotations

import http.client
import logging
from typing import TypeVar

import msgspec
from kvferry.kvtransfer.auth import SIGNATURE_HEADER, SideChannelAuth
from kvferry.kvtransfer.http_server import BoundedHTTPServer, Request, Response, ServerLimits
from kvferry.kvtransfer.layout import KVLayout, RegionInfo
from kvferry.kvtransfer.lease import LeaseTable
from kvferry.kvtransfer.metrics import HoldEnd

logger = logging.getLogger(__name__)
_T = TypeVar("_T")

HANDSHAKE_PATH = "/kvferry/v1/handshake"
RENEW_PATH = "/kvferry/v1/renew"
FREE_PATH = "/kvferry/v1/free"
_CONTENT_TYPE = "application/msgpack"


class HandshakeInfo(msgspec.Struct, frozen=True):
    """Everything a consumer needs to read a producer's blocks."""

    protocol_version: int
    engine_id: str
    # Changes whenever the producer process restarts, even under the same engine id.
    agent_name: str
    # NIXL agent metadata (connection info and registered memory) for add_remote_agent.
    agent_metadata: bytes
    model_id: str
    # Per block group, and within a group per rank: its cache layout and where its cache
    # lives (group g, rank r at index g * num_ranks + r).
    layouts: list[KVLayout]
    regions: list[RegionInfo]
    compat_hash: str
    lease_s: float
    # The engine's parallel sizes: its P x T ranks (rank s * T + t: stage s, shard t) each
    # have a cache per group; a consumer of the same sizes reads rank r into its rank r.
    pipeline_parallel_size: int = 1
    tensor_parallel_size: int = 1
    # A parallel engine's ranks' NIXL agents (names, metadata), in rank order: each rank
    # registers its own cache, and `agent_metadata` is empty. [] for one process's agent.
    rank_agents: list[str] = []
    rank_agent_metadata: list[bytes] = []

    @property
    def num_ranks(self) -> int:
        return self.pipeline_parallel_size * self.tensor_parallel_size


def rank_agent_name(engine_agent: str, rank: int) -> str:
    """The NIXL agent name of rank `rank` of the engine whose agent name is `engine_agent`."""
    return f"{engine_agent}/r{rank}"


class LeaseRequest(msgspec.Struct, frozen=True):
    """Heartbeat or free for some of one producer's holds."""

    # The producer incarnation the consumer means (a restarted producer holds none of its
    # holds); "" means whichever runs now.
    agent_name: str
    req_ids: list[str]
    # The consumer asking (its NIXL agent name): the first to renew a hold is its only
    # reader. Required: a request that names no reader is refused.
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
    # Renew only: per requested id, whether a hold that is not held ended because this
    # reader's read of it finished (its own pull, not a lost hold). [] from a producer that
    # does not say: every hold not held counts as lost.
    pulled: list[bool] = []


class SideChannelError(Exception):
    """A side-channel call failed: refused, timed out, or answered with an error."""


class SideChannelAuthError(SideChannelError):
    """The producer refused the consumer's signature, or its reply was not signed with the
    service's key (another key, or not a producer of this service)."""


class SideChannelServer:
    """Serves one producer's handshake and leases from a background thread.

    `auth` None serves anyone (an insecure pod); otherwise only signed requests.
    """

    def __init__(self, host: str, port: int, info: HandshakeInfo, leases: LeaseTable,
                 auth: SideChannelAuth | None, limits: ServerLimits | None = None) -> None:
        self.info = info
        self.leases = leases
        self.auth = auth
        self._encoded_info = msgspec.msgpack.encode(info)
        self._http = BoundedHTTPServer(host, port, self.respond, "kvferry-side-channel", limits)

    @property
    def port(self) -> int:
        return self._http.port

    @property
    def num_connections(self) -> int:
        return self._http.num_connections

    def start(self) -> None:
        self._http.start()
        logger.info("KV side channel serving engine %s on port %d (%s)", self.info.engine_id,
                    self.port, "signed requests only" if self.auth else "INSECURE: no key")

    def close(self) -> None:
        self._http.close()

    def respond(self, request: Request) -> Response:
        """Answers one request: 401 unless signed (with a key), then the path's answer."""
        nonce = None
        if self.auth is not None:
            nonce, why = self.auth.check_request(request.method, request.path, request.body,
                                                 request.headers.get(SIGNATURE_HEADER.lower()))
            if nonce is None:
                return Response(401, f"side channel request not authenticated: {why}".encode())
        response = self._route(request)
        if nonce is None or self.auth is None:
            return response
        signature = self.auth.sign_reply(nonce, response.status, response.body)
        return Response(response.status, response.body, response.content_type,
                        ((SIGNATURE_HEADER, signature),))

    def _route(self, request: Request) -> Response:
        if request.method == "GET" and request.path == HANDSHAKE_PATH:
            return Response(200, self._encoded_info, _CONTENT_TYPE)
        if request.method != "POST" or request.path not in (RENEW_PATH, FREE_PATH):
            return Response(404, b"unknown path")
        try:
            return Response(200, self.handle(request.path, request.body), _CONTENT_TYPE)
        except (msgspec.DecodeError, msgspec.ValidationError, ValueError) as e:
            return Response(400, f"bad request body: {e}".encode())

    def handle(self, path: str, body: bytes) -> bytes:
        """Answers one renewal or free; raises ValueError for a request it cannot serve."""
        request = msgspec.msgpack.decode(body, type=LeaseRequest)
        if not request.reader:
            raise ValueError("reader must name the consumer (its NIXL agent name)")
        block_ids: list[list[list[int]]] = []
        pulled: list[bool] = []
        if request.agent_name and request.agent_name != self.info.agent_name:
            # Meant for an earlier incarnation of this producer: none of its holds exist.
            held = [False] * len(request.req_ids)
        elif path == RENEW_PATH:
            claims = self.leases.claim(request.req_ids, request.reader)
            held = [c is not None for c in claims]
            block_ids = [[list(g) for g in c or ()] for c in claims]
            pulled = self.leases.pulled_by(request.req_ids, request.reader)
        else:
            held = [self.leases.end(r, HoldEnd.FREED, request.reader) for r in request.req_ids]
        reply = LeaseReply(held=held, lease_s=self.leases.lease_s, agent_name=self.info.agent_name,
                           block_ids=block_ids, pulled=pulled)
        return msgspec.msgpack.encode(reply)

    @property
    def encoded_info(self) -> bytes:
        return self._encoded_info


class SideChannelClient:
    """A consumer's calls to one producer's side channel.

    Each call connects within `connect_timeout_s` and is answered within `timeout_s`;
    with `auth` every request is signed and every reply must be.
    """

    def __init__(self, host: str, port: int, timeout_s: float, reader: str = "",
                 auth: SideChannelAuth | None = None,
                 connect_timeout_s: float | None = None) -> None:
        self.host = host
        self.port = port
        self.timeout_s = timeout_s
        self.connect_timeout_s = connect_timeout_s or timeout_s
        # This consumer's NIXL agent name, sent with renewals and frees.
        self.reader = reader
        self.auth = auth

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
        headers = {"Content-Type": _CONTENT_TYPE} if body is not None else {}
        nonce = ""
        if self.auth is not None:
            headers[SIGNATURE_HEADER], nonce = self.auth.sign_request(method, path, body or b"")
        status, data, signature = self._exchange(method, path, body, headers)
        if status == 401:
            raise SideChannelAuthError(
                f"side channel {self.address}{path} refused this consumer's signature: the "
                f"producer runs with another KV transfer key (or none)")
        if self.auth is not None and not self.auth.reply_verifies(nonce, status, data, signature):
            raise SideChannelAuthError(
                f"side channel {self.address}{path}: the reply is not signed with this "
                "service's KV transfer key: not a producer of this service")
        if status != 200:
            raise SideChannelError(
                f"side channel {self.address}{path} answered {status}: "
                f"{data[:200].decode(errors='replace')}"
            )
        try:
            return msgspec.msgpack.decode(data, type=reply_type)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            raise SideChannelError(f"side channel {self.address}{path}: bad reply: {e}") from e

    def _exchange(self, method: str, path: str, body: bytes | None,
                  headers: dict[str, str]) -> tuple[int, bytes, str | None]:
        """(status, body, signature header) of one request on a fresh connection."""
        conn = http.client.HTTPConnection(self.host, self.port, timeout=self.connect_timeout_s)
        try:
            conn.connect()
            assert conn.sock is not None
            conn.sock.settimeout(self.timeout_s)
            conn.request(method, path, body=body, headers=headers)
            response = conn.getresponse()
            return response.status, response.read(), response.getheader(SIGNATURE_HEADER)
        except (OSError, http.client.HTTPException) as e:
            raise SideChannelError(f"side channel {self.address}{path}: {e}") from e
        finally:
            conn.close()
