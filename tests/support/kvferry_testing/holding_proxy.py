"""A TCP proxy that can hold connections: a producer's side channel that answers late.

Put in front of a prefill server's side channel (the `remote_host`/`remote_port` a decode
server dials), it accepts every connection at once but, while held, forwards nothing: the
consumer's handshake, renewal and free calls sit in the proxy, so its request stays parked
waiting for remote KV for as long as the test wants. `release()` connects every held
connection to the producer and relays the bytes each side sent, even from a client that
has gone since (the kernel kept what it wrote), as a slow network would deliver them.
"""

from __future__ import annotations

import contextlib
import socket
import threading

_CHUNK = 1 << 16


class HoldingProxy:
    """127.0.0.1:<port> -> 127.0.0.1:<upstream_port>, held until `release()`."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._released = threading.Event()
        self._lock = threading.Lock()
        self._num_accepted = 0
        self._closed = False
        self._threads: list[threading.Thread] = []
        self._spawn(self._accept_loop)

    @property
    def port(self) -> int:
        return int(self._listener.getsockname()[1])

    @property
    def num_accepted(self) -> int:
        """Connections accepted so far (held or relayed)."""
        with self._lock:
            return self._num_accepted

    def release(self) -> None:
        """Relays every held connection and every later one at once."""
        self._released.set()

    def close(self) -> None:
        self._closed = True
        self._released.set()
        with contextlib.suppress(OSError):
            self._listener.close()

    def __enter__(self) -> HoldingProxy:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def _spawn(self, target: object, *args: object) -> None:
        thread = threading.Thread(target=target, args=args, daemon=True)  # type: ignore[arg-type]
        thread.start()
        self._threads.append(thread)

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            with self._lock:
                self._num_accepted += 1
            self._spawn(self._relay, client)

    def _relay(self, client: socket.socket) -> None:
        self._released.wait()
        with client, contextlib.suppress(OSError):
            upstream = socket.create_connection(("127.0.0.1", self.upstream_port), timeout=10)
            with upstream:
                back = threading.Thread(target=_pipe, args=(upstream, client), daemon=True)
                back.start()
                _pipe(client, upstream)
                back.join(timeout=10)


def _pipe(source: socket.socket, sink: socket.socket) -> None:
    """Copies until the source's end of stream, then ends the sink's side too."""
    with contextlib.suppress(OSError):
        while data := source.recv(_CHUNK):
            sink.sendall(data)
    with contextlib.suppress(OSError):
        sink.shutdown(socket.SHUT_WR)
