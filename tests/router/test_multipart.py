"""The router's in-place reading of a multipart form: parts found by offset in forms that
real clients encode, a field replaced without copying the file, and the result read back
by the parser the engine pods use (python-multipart, through Starlette)."""

from __future__ import annotations

import asyncio
import hashlib
import os
from typing import Any

import httpx
import pytest
from kvferry.router.multipart import FormError, field_part, form_boundary, parse_form
from starlette.requests import Request


def encoded(fields: dict[str, str], file: bytes) -> tuple[str, bytearray]:
    """A form as httpx encodes it: (content type, body)."""
    request = httpx.Request("POST", "http://x/", data=fields,
                            files={"file": ("a.wav", file, "audio/wav")})
    return request.headers["content-type"], bytearray(request.read())


def starlette_form(content_type: str, body: bytes) -> dict[str, Any]:
    """What the engine pod's route reads of a body: fields as text, the file's sha256."""
    scope = {"type": "http", "method": "POST", "path": "/", "headers": [
        (b"content-type", content_type.encode()), (b"content-length", str(len(body)).encode())]}

    async def read() -> dict[str, Any]:
        async def receive() -> dict[str, Any]:
            return {"type": "http.request", "body": body, "more_body": False}

        form = await Request(scope, receive).form()
        out: dict[str, Any] = {}
        for name, value in form.multi_items():
            out.setdefault(name, []).append(
                value if isinstance(value, str) else hashlib.sha256(await value.read()).hexdigest())
        return out

    return asyncio.run(read())


def test_parts_are_found_by_offset_and_the_file_is_a_view() -> None:
    data = os.urandom(100_000) + b"\r\n--not-the-boundary\r\n"
    content_type, body = encoded({"model": "whisper", "language": "en"}, data)
    form = parse_form(body, form_boundary(content_type))  # type: ignore[arg-type]
    assert [(p.name, p.filename) for p in form.parts] == [
        ("model", None), ("language", None), ("file", "a.wav")]
    file = form.part("file")
    assert file is not None
    content = form.content(file)
    assert isinstance(content, memoryview) and content.obj is body
    assert bytes(content) == data
    assert bytes(form.content(form.parts[0])) == b"whisper"


def test_a_field_is_replaced_and_the_pods_parser_reads_the_new_form() -> None:
    data = os.urandom(50_000)
    content_type, body = encoded({"model": "whisper", "kv_transfer_params": "{\"x\": 1}",
                                  "language": "en"}, data)
    form = parse_form(body, form_boundary(content_type))  # type: ignore[arg-type]
    replaced = form.with_field("kv_transfer_params", b'{"do_remote_decode":true}')
    # Views of the body around one new part: the file is never copied.
    assert sum(1 for b in replaced if isinstance(b, memoryview) and b.obj is body) == 2
    read = starlette_form(content_type, b"".join(replaced))
    assert read == {"kv_transfer_params": ['{"do_remote_decode":true}'], "model": ["whisper"],
                    "language": ["en"], "file": [hashlib.sha256(data).hexdigest()]}
    dropped = starlette_form(content_type, b"".join(form.with_field("kv_transfer_params", None)))
    assert "kv_transfer_params" not in dropped and dropped["model"] == ["whisper"]


def test_a_preamble_and_an_epilogue_are_kept_out_of_the_parts() -> None:
    boundary = b"B0undary"
    body = (b"preamble text\r\n" + field_part(boundary, "model", b"m") + b"--B0undary\r\n"
            b'Content-Disposition: form-data; name="file"; filename="x.flac"\r\n\r\n'
            b"FLAC\r\n--B0undary--\r\nepilogue")
    form = parse_form(body, boundary)
    assert [(p.name, bytes(form.content(p))) for p in form.parts] == [
        ("model", b"m"), ("file", b"FLAC")]
    with_params = b"".join(form.with_field("kv_transfer_params", b"{}"))
    assert with_params.startswith(b"preamble text\r\n--B0undary\r\nContent-Disposition: "
                                  b'form-data; name="kv_transfer_params"\r\n\r\n{}\r\n--B0undary')
    assert [p.name for p in parse_form(with_params, boundary).parts] == [
        "kv_transfer_params", "model", "file"]


@pytest.mark.parametrize("content_type,boundary", [
    ("multipart/form-data; boundary=abc", b"abc"),
    ('Multipart/Form-Data; charset=utf-8; boundary="a b:c"', b"a b:c"),
    ("application/json", None), ("", None)])
def test_the_boundary_comes_from_a_multipart_content_type(content_type: str,
                                                          boundary: bytes | None) -> None:
    assert form_boundary(content_type) == boundary


@pytest.mark.parametrize("content_type,message", [
    ("multipart/form-data", "has no boundary"),
    ("multipart/form-data; boundary=" + "x" * 71, "is not one RFC 2046 allows"),
    ('multipart/form-data; boundary="bad\x01"', "is not one RFC 2046 allows")])
def test_a_bad_boundary_is_refused(content_type: str, message: str) -> None:
    with pytest.raises(FormError, match=message):
        form_boundary(content_type)


@pytest.mark.parametrize("body,message", [
    (b"no delimiter at all", "never appears"),
    (b"--B\r\nContent-Disposition: form-data; name=\"a\"\r\n\r\nvalue cut short", "not closed"),
    (b"--B\r\nContent-Disposition: form-data; name=\"a\"", "no end to its headers"),
    (b"--Bjunk\r\n\r\nx\r\n--B--", "not followed by a line break")])
def test_a_body_that_is_not_the_form_it_claims_is_refused(body: bytes, message: str) -> None:
    with pytest.raises(FormError, match=message):
        parse_form(body, b"B")
