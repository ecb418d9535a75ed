"""Listeners an attacker (or a broken peer) puts where params point, each counting the
connections it accepts: a test shows that forged params reach none of them.

- `SilentListener`: accepts and never answers (a hung producer, a black hole);
- `FakeSideChannel`: replays a real producer's handshake and answers every renewal with
  "held" for the blocks it was told, every free with "freed": what an attacker would run
  to make a consumer read blocks of its choosing.
"""

from __future__ import annotations

import contextlib
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import msgspec
from kvferry.kvtransfer.side_channel import HANDSHAKE_PATH, LeaseReply, LeaseRequest


class SilentListener:
    """Accepts connections and never answers; counts them, and how many were open at once."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.sock.settimeout(0.05)
        self.port = int(self.sock.getsockname()[1])
        self.num_accepted = 0
        self.most_open = 0
        self._held: list[socket.socket] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            with contextlib.suppress(TimeoutError):
                self._held.append(self.sock.accept()[0])
                self.num_accepted += 1
            # A connection its client gave up on reads end of stream (or fails).
            self._held = [c for c in self._held if _still_open(c)]
            self.most_open = max(self.most_open, len(self._held))

    def close(self) -> None:
        """Closes the held connections and the listener: waiting clients fail at once."""
        self._stop.set()
        self._thread.join(5)
        for conn in self._held:
            conn.close()
        self.sock.close()


def _still_open(conn: socket.socket) -> bool:
    try:
        return conn.recv(1024, socket.MSG_DONTWAIT | socket.MSG_PEEK) != b""
    except BlockingIOError:
        return True
    except OSError:
        return False


class FakeSideChannel:
    """Serves a recorded handshake and says "held" to everything, as an attacker would."""

    def __init__(self, handshake: bytes, agent_name: str, block_ids: list[list[int]]) -> None:
        self.handshake = handshake
        self.agent_name = agent_name
        self.block_ids = block_ids
        self.num_accepted = 0
        fake = self

        class Server(ThreadingHTTPServer):
            daemon_threads = True

            def verify_request(self, request: object, client_address: object) -> bool:
                fake.num_accepted += 1
                return True

        self._httpd = Server(("127.0.0.1", 0), _handler(self))
        self.port = int(self._httpd.server_address[1])
        self._thread = threading.Thread(target=self._httpd.serve_forever, args=(0.05,),
                                        daemon=True)
        self._thread.start()

    def reply_to(self, body: bytes) -> bytes:
        request = msgspec.msgpack.decode(body, type=LeaseRequest)
        return msgspec.msgpack.encode(LeaseReply(
            held=[True] * len(request.req_ids), lease_s=30.0, agent_name=self.agent_name,
            block_ids=[[list(g) for g in self.block_ids]] * len(request.req_ids)))

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(5)


def _handler(fake: FakeSideChannel) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_GET(self) -> None:
            self._send(fake.handshake if self.path == HANDSHAKE_PATH else b"")

        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            self._send(fake.reply_to(body))

        def _send(self, body: bytes) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "application/msgpack")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:
            pass

    return Handler
