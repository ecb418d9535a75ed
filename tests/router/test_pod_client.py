"""The router's HTTP client for hops, against a fake engine pod (uvicorn, a real process)
and small raw servers that misbehave on purpose."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable, Iterator

import httpx
import pytest
from kvferry.router.pod_client import HopTimeout, PodClient, PodConnection, PodUnreachable
from kvferry_testing.procs import Proc, fake_engine, free_port

STREAM_BODY = json.dumps({"model": "fake", "prompt": "p", "stream": True}).encode()
WHOLE_BODY = json.dumps({"model": "fake", "prompt": "p"}).encode()
HEADERS = {"content-type": "application/json", "x-request-id": "req-1"}
TIMEOUT = HopTimeout(connect_s=2.0, read_s=10.0)


@pytest.fixture(scope="module")
def pod(tmp_path_factory: pytest.TempPathFactory, redis_url: str) -> Iterator[Proc]:
    proc = fake_engine(tmp_path_factory.mktemp("client"), redis_url, "client", "both", "pod")
    try:
        yield proc
    finally:
        proc.stop()


def base(pod: Proc) -> str:
    return f"http://127.0.0.1:{pod.port}"  # type: ignore[attr-defined]


def connections(pod: Proc) -> int:
    return httpx.get(base(pod) + "/fake/connections").json()


def set_behaviour(pod: Proc, behaviour: str) -> None:
    httpx.post(base(pod) + "/fake/behaviour", json={"behaviour": behaviour}).raise_for_status()


def received(pod: Proc) -> int:
    return len(httpx.get(base(pod) + "/fake/requests").json())


def run(body: Callable[[PodClient], Awaitable[object]], max_connections: int = 512) -> object:
    async def main() -> object:
        client = PodClient(max_connections)
        try:
            return await body(client)
        finally:
            await client.close()

    return asyncio.run(main())


def test_streams_come_chunk_by_chunk_over_one_kept_alive_connection(pod: Proc) -> None:
    before = connections(pod)

    async def body(client: PodClient) -> list[bytes]:
        texts = []
        for _ in range(5):
            response = await client.post(base(pod), "/v1/completions", STREAM_BODY, HEADERS,
                                         TIMEOUT)
            assert (response.status, response.headers["content-type"]) == (
                200, "text/event-stream")
            texts.append(b"".join([c async for c in response.iter_chunks()]))
            response.release()
        return texts

    texts = run(body)
    events = [line for line in texts[0].split(b"\n\n") if line]  # type: ignore[index]
    assert [json.loads(e[6:])["choices"][0]["text"] for e in events[:-1]] == [" a", " b", " c"]
    assert events[-1] == b"data: [DONE]"
    assert len(set(texts)) == 1  # type: ignore[arg-type]
    assert connections(pod) == before + 1


def test_a_whole_answer_is_read_by_its_length(pod: Proc) -> None:
    async def body(client: PodClient) -> dict:
        response = await client.post(base(pod), "/v1/completions", WHOLE_BODY, HEADERS, TIMEOUT)
        try:
            return json.loads(await response.read())
        finally:
            response.release()

    assert run(body)["choices"][0]["text"] == " a b c"  # type: ignore[index]


def test_a_released_unfinished_answer_closes_its_connection() -> None:
    """What tells an engine that its client left: the router closing the pod's connection."""

    async def body(client: PodClient) -> tuple[bytes, bytes]:
        closed = asyncio.get_running_loop().create_future()

        async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await reader.readuntil(b"\r\n\r\n")
            await reader.readexactly(len(STREAM_BODY))
            writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n"
                         b"7\r\ndata: a\r\n")
            await writer.drain()
            closed.set_result(await reader.read())  # b"" once the client closes
            writer.close()

        server = await asyncio.start_server(serve, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        try:
            response = await client.post(f"http://127.0.0.1:{port}", "/v1/completions",
                                         STREAM_BODY, HEADERS, TIMEOUT)
            first = await anext(aiter(response.iter_chunks()))
            response.release()
            return first, await asyncio.wait_for(closed, 10)
        finally:
            server.close()

    assert run(body) == (b"data: a", b"")


def test_a_stream_cut_by_the_pod_raises_and_the_next_request_reconnects(pod: Proc) -> None:
    async def body(client: PodClient) -> tuple[list[bytes], BaseException | None, int]:
        response = await client.post(base(pod), "/v1/completions", STREAM_BODY, HEADERS,
                                     TIMEOUT)
        got: list[bytes] = []
        error = None
        try:
            async for chunk in response.iter_chunks():
                got.append(chunk)
        except ConnectionError as exc:
            error = exc
        response.release()
        set_behaviour(pod, "ok")
        again = await client.post(base(pod), "/v1/completions", WHOLE_BODY, HEADERS, TIMEOUT)
        await again.read()
        again.release()
        return got, error, again.status

    set_behaviour(pod, "cut")
    try:
        got, error, status = run(body)  # type: ignore[misc]
    finally:
        set_behaviour(pod, "ok")
    assert b"".join(got).startswith(b"data: ") and b"[DONE]" not in b"".join(got)
    assert isinstance(error, ConnectionError)
    assert status == 200


@pytest.mark.parametrize("timeout", [HopTimeout(connect_s=2.0, read_s=0.3),
                                     HopTimeout(connect_s=2.0, total_s=0.3)])
def test_a_pod_that_never_answers_times_out(pod: Proc, timeout: HopTimeout) -> None:
    async def body(client: PodClient) -> None:
        await client.post(base(pod), "/v1/completions", WHOLE_BODY, HEADERS, timeout)

    set_behaviour(pod, "hang")
    try:
        with pytest.raises(TimeoutError):
            run(body)
    finally:
        set_behaviour(pod, "ok")


def test_a_refused_connection_is_a_connection_error_that_says_the_pod_is_unreachable() -> None:
    async def body(client: PodClient) -> None:
        await client.post(f"http://127.0.0.1:{free_port()}", "/v1/completions", WHOLE_BODY,
                          HEADERS, TIMEOUT)

    with pytest.raises(PodUnreachable, match="cannot connect"):
        run(body)


async def until(condition: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not condition():
        assert asyncio.get_running_loop().time() < deadline
        await asyncio.sleep(0.02)


async def whole(client: PodClient, url: str, timeout: HopTimeout = TIMEOUT) -> int:
    response = await client.post(url, "/v1/completions", WHOLE_BODY, HEADERS, timeout)
    await response.read()
    response.release()
    return response.status


def test_hops_beyond_the_cap_wait_for_a_connection_and_reuse_it(pod: Proc) -> None:
    """Six requests at once with a cap of two: the pod gets two, the others wait in the
    router, and all six go over the same two connections."""
    connections_before, received_before = connections(pod), received(pod)

    async def body(client: PodClient) -> tuple[list[int], int, int]:
        tasks = [asyncio.create_task(whole(client, base(pod))) for _ in range(6)]
        await until(lambda: client.num_waiting == 4)
        held = await asyncio.to_thread(received, pod)
        open_while_held = client.num_open(base(pod))
        await asyncio.to_thread(set_behaviour, pod, "ok")
        return await asyncio.gather(*tasks), held - received_before, open_while_held

    set_behaviour(pod, "hold")
    try:
        statuses, held, open_while_held = run(body, max_connections=2)  # type: ignore[misc]
    finally:
        set_behaviour(pod, "ok")
    assert (statuses, held, open_while_held) == ([200] * 6, 2, 2)
    assert connections(pod) - connections_before == 2


def test_a_hop_that_waits_past_its_timeout_fails_and_leaves_the_pool_whole(pod: Proc) -> None:
    async def body(client: PodClient) -> tuple[str, list[int], int]:
        held = asyncio.create_task(whole(client, base(pod)))
        await until(lambda: client.num_open(base(pod)) == 1)
        with pytest.raises(TimeoutError) as timed_out:
            await whole(client, base(pod), HopTimeout(connect_s=2.0, read_s=0.3))
        cancelled = asyncio.create_task(whole(client, base(pod)))
        await until(lambda: client.num_waiting == 1)
        cancelled.cancel()
        await asyncio.gather(cancelled, return_exceptions=True)
        assert client.num_waiting == 0
        await asyncio.to_thread(set_behaviour, pod, "ok")
        statuses = [await held, await whole(client, base(pod)), await whole(client, base(pod))]
        return str(timed_out.value), statuses, client.num_open(base(pod))

    set_behaviour(pod, "hold")
    try:
        message, statuses, num_open = run(body, max_connections=1)  # type: ignore[misc]
    finally:
        set_behaviour(pod, "ok")
    assert "no connection to 127.0.0.1" in message and "1 open, the most allowed" in message
    assert statuses == [200, 200, 200] and num_open == 1


async def post_twice(
    client: PodClient,
    serve: Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]],
    pause_s: float = 0.0,
) -> list[tuple[int, bytes]]:
    """Two requests through `client` to a loopback TCP server that runs `serve` for each
    connection; their statuses and bodies."""
    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    results = []
    try:
        for _ in range(2):
            response = await client.post(f"http://127.0.0.1:{port}", "/v1/completions",
                                         WHOLE_BODY, HEADERS, TIMEOUT)
            results.append((response.status, await response.read()))
            response.release()
            if pause_s:
                await asyncio.sleep(pause_s)
    finally:
        server.close()
    return results


def raw_server(answer: bytes, close_after: bool) -> Callable[[PodClient], Awaitable[object]]:
    """A body for `run`: a TCP server on a loopback port that reads one request per
    connection and writes `answer`, closing the connection after it if `close_after`; the
    client sends two requests. Returns the statuses and bodies, and how many connections
    the server accepted."""

    async def body(client: PodClient) -> object:
        accepted = 0

        async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            nonlocal accepted
            accepted += 1
            while await reader.readuntil(b"\r\n\r\n"):
                await reader.readexactly(len(WHOLE_BODY))
                writer.write(answer)
                await writer.drain()
                if close_after:
                    break
            writer.close()

        # The pause lets the server's close reach the client.
        return await post_twice(client, serve, pause_s=0.1), accepted

    return body


def test_a_connection_the_pod_closed_while_idle_is_not_reused() -> None:
    answer = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok"
    results, accepted = run(raw_server(answer, close_after=True))  # type: ignore[misc]
    assert results == [(200, b"ok"), (200, b"ok")]
    assert accepted == 2


def test_bad_http_from_a_pod_is_a_connection_error() -> None:
    with pytest.raises(ConnectionError, match="bad HTTP"):
        run(raw_server(b"NOT HTTP AT ALL\r\n\r\n", close_after=False))


def test_a_request_the_pod_dropped_unread_on_a_kept_connection_goes_again() -> None:
    """A pod closing a kept-alive connection just as the next request arrives (its idle
    timeout) never read that request: it is sent again on a new connection."""
    answer = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok"

    async def body(client: PodClient) -> tuple[list[tuple[int, bytes]], int]:
        accepted = 0

        async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            nonlocal accepted
            accepted += 1
            for index in range(2):
                await reader.readuntil(b"\r\n\r\n")
                await reader.readexactly(len(WHOLE_BODY))
                if accepted == 1 and index == 1:
                    break  # the second request on the first connection: dropped unanswered
                writer.write(answer)
                await writer.drain()
            writer.close()

        return await post_twice(client, serve), accepted

    assert run(body) == ([(200, b"ok"), (200, b"ok")], 2)


def test_a_connection_handed_to_a_hop_cancelled_meanwhile_goes_back_to_the_pool() -> None:
    """The hop that waited is cancelled (its client left) after a connection was handed to
    it but before it ran: the connection is not lost to the pool."""
    answer = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok"

    async def body(client: PodClient) -> tuple[int, int, int, int]:
        accepted = 0

        async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            nonlocal accepted
            accepted += 1
            while await reader.readuntil(b"\r\n\r\n"):
                await reader.readexactly(len(WHOLE_BODY))
                writer.write(answer)
                await writer.drain()

        server = await asyncio.start_server(serve, "127.0.0.1", 0)
        url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
        try:
            first = await client.post(url, "/v1/completions", WHOLE_BODY, HEADERS, TIMEOUT)
            waiting = asyncio.create_task(whole(client, url))
            await until(lambda: client.num_waiting == 1)
            await first.read()
            first.release()  # handed to the waiting hop ...
            waiting.cancel()  # ... which is cancelled before it runs
            await asyncio.gather(waiting, return_exceptions=True)
            status = await whole(client, url)
            return status, accepted, client.num_open(url), client.num_waiting
        finally:
            server.close()

    assert run(body, max_connections=1) == (200, 1, 1, 0)


def test_a_body_of_buffers_arrives_whole_and_is_written_as_the_pod_reads_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """An upload given as views of the router's one copy: the pod gets exactly their bytes
    with the right length, and while it reads slowly the transport never holds more than
    a slice or two of it (no second copy of the whole body)."""
    upload = bytearray(bytes(range(256)) * (24 * 1024))  # 6 MiB
    parts = [b"--head--", memoryview(upload)[:1000], memoryview(upload)[1000:]]
    expected = b"--head--" + bytes(upload)
    opened: list[PodConnection] = []
    connection_made = PodConnection.connection_made

    def record(conn: PodConnection, transport: asyncio.BaseTransport) -> None:
        opened.append(conn)
        connection_made(conn, transport)

    monkeypatch.setattr(PodConnection, "connection_made", record)

    async def body(client: PodClient) -> tuple[bytes, int, int]:
        got = asyncio.get_running_loop().create_future()

        async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            head = await reader.readuntil(b"\r\n\r\n")
            length = int(head.split(b"content-length: ")[1].split(b"\r\n")[0])
            data = b""
            while len(data) < length:
                data += await reader.read(64 * 1024)
                await asyncio.sleep(0.002)  # a pod that reads slowly
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
            await writer.drain()
            got.set_result(data)

        server = await asyncio.start_server(serve, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        largest = 0

        async def watch() -> None:
            nonlocal largest
            while True:
                for conn in opened:
                    if conn.transport is not None:
                        largest = max(largest, conn.transport.get_write_buffer_size())
                await asyncio.sleep(0.001)

        watcher = asyncio.ensure_future(watch())
        try:
            response = await client.post(f"http://127.0.0.1:{port}", "/upload", parts,
                                         HEADERS, TIMEOUT)
            answer = await response.read()
            response.release()
            assert answer == b"ok"
            return await asyncio.wait_for(got, 10), largest, client.num_open(
                f"http://127.0.0.1:{port}")
        finally:
            watcher.cancel()
            server.close()

    data, largest, num_open = run(body)  # type: ignore[misc]
    assert data == expected
    assert 0 < largest <= 2 * 256 * 1024, largest
    assert num_open == 1  # answered after the whole body: the connection is kept


def test_a_pod_that_answers_before_the_whole_body_gets_no_more_of_it() -> None:
    """A refusal sent while the body is still going out (a pod's 413) is the answer; the
    rest is not written and the connection, its request cut short, is not reused."""
    parts = [memoryview(bytearray(8 * 1024 * 1024))]

    async def body(client: PodClient) -> tuple[int, bytes, int]:
        async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await reader.readuntil(b"\r\n\r\n")
            await reader.read(1024)
            writer.write(b"HTTP/1.1 413 Payload Too Large\r\ncontent-length: 3\r\n\r\nbig")
            await writer.drain()
            await asyncio.sleep(1.0)  # keeps the socket open, reading nothing more
            writer.close()

        server = await asyncio.start_server(serve, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        try:
            response = await client.post(f"http://127.0.0.1:{port}", "/upload", parts,
                                         HEADERS, TIMEOUT)
            answer = await response.read()
            response.release()
            return response.status, answer, client.num_open(f"http://127.0.0.1:{port}")
        finally:
            server.close()

    assert run(body) == (413, b"big", 0)
