"""A multipart/form-data body read in place: where each part is, never a copy of the file.

The router holds an upload once (a transcription's audio file, up to
`--max-audio-body-bytes`) and sends it on to one or two pods. It needs three things of the
form: the file's bytes (its hash keys the encoder input), whether the client sent a
`kv_transfer_params` field (which only the router may set), and a body with that field
replaced. All three come from offsets into the body as received: `Form.content` is a view,
and `Form.with_field` returns the body as a list of views around one small new part.

The format (RFC 7578, on RFC 2046's multipart): an optional preamble, then parts, each
opened by a delimiter line `--BOUNDARY` and its header lines, a blank line and the content;
the CRLF before the next delimiter belongs to that delimiter. `--BOUNDARY--` closes the form.

    --B\\r\\n
    Content-Disposition: form-data; name="model"\\r\\n
    \\r\\n
    whisper\\r\\n
    --B\\r\\n
    Content-Disposition: form-data; name="file"; filename="a.wav"\\r\\n
    Content-Type: audio/wav\\r\\n
    \\r\\n
    RIFF....\\r\\n
    --B--\\r\\n
"""

from __future__ import annotations

import re
from dataclasses import dataclass

# The most header bytes one part may have (a name, a filename, a content type).
MAX_PART_HEADER_BYTES = 16 * 1024
# RFC 2046: a boundary is 1 to 70 characters of a restricted set.
_BOUNDARY = re.compile(r"^[0-9A-Za-z'()+_,\-./:=? ]{0,69}[0-9A-Za-z'()+_,\-./:=?]$")
# A parameter of a Content-Disposition header: name="value" or name=token.
_PARAMETER = re.compile(r';\s*([A-Za-z0-9_*-]+)\s*=\s*("(?:[^"\\]|\\.)*"|[^;\s]*)')


class FormError(ValueError):
    """The body is not the multipart form its content type says."""


@dataclass(frozen=True)
class FormPart:
    """One part of a form, as offsets into the body."""

    name: str | None  # its field name (None: a part without one)
    filename: str | None  # set for a file
    start: int  # the first byte of its delimiter line ("--BOUNDARY")
    content_start: int  # the first byte of its content
    content_end: int  # one past its content's last byte
    end: int  # the start of the next delimiter line (this part's end, CRLF included)


@dataclass(frozen=True)
class Form:
    """A multipart form over the body it was read from (which must not change meanwhile)."""

    body: bytearray | bytes
    boundary: bytes
    parts: tuple[FormPart, ...]

    def part(self, name: str) -> FormPart | None:
        """The first part named `name`."""
        return next((p for p in self.parts if p.name == name), None)

    def content(self, part: FormPart) -> memoryview:
        """A part's content, not copied."""
        return memoryview(self.body)[part.content_start:part.content_end]

    def with_field(self, name: str, value: bytes | None) -> list[memoryview | bytes]:
        """The body without any part named `name` and, when `value` is given, with a part
        `name` holding `value` first: as buffers to write one after the other (views of the
        body, and the new part)."""
        view = memoryview(self.body)
        first = self.parts[0].start if self.parts else len(self.body)
        out: list[memoryview | bytes] = [view[:first]] if first else []
        if value is not None:
            out.append(field_part(self.boundary, name, value))
        cursor = first
        for part in self.parts:
            if part.name == name:
                if part.start > cursor:
                    out.append(view[cursor:part.start])
                cursor = part.end
        if cursor < len(self.body):
            out.append(view[cursor:])
        return out


def field_part(boundary: bytes, name: str, value: bytes) -> bytes:
    """One form part holding a plain field (its delimiter line first, its CRLF last)."""
    if '"' in name or "\r" in name or "\n" in name:
        raise ValueError(f"a form field name cannot hold quotes or line breaks: {name!r}")
    return (b"--" + boundary + b'\r\nContent-Disposition: form-data; name="' + name.encode()
            + b'"\r\n\r\n' + value + b"\r\n")


def form_boundary(content_type: str) -> bytes | None:
    """The boundary of a `multipart/form-data` content type; None for any other type.
    FormError for a multipart form whose boundary is missing or not one RFC 2046 allows."""
    media_type, _, parameters = content_type.partition(";")
    if media_type.strip().lower() != "multipart/form-data":
        return None
    for key, value in _PARAMETER.findall(";" + parameters):
        if key.lower() == "boundary":
            boundary = _unquote(value)
            if not _BOUNDARY.match(boundary):
                raise FormError(f"the multipart boundary {boundary!r} is not one RFC 2046 "
                                "allows (1 to 70 characters)")
            return boundary.encode("latin-1")
    raise FormError("the multipart/form-data content type has no boundary")


def parse_form(body: bytearray | bytes, boundary: bytes) -> Form:
    """The parts of `body` (none of their contents copied); FormError says what is wrong."""
    delimiter = b"--" + boundary
    if body.startswith(delimiter):
        position = 0
    else:
        position = body.find(b"\r\n" + delimiter)
        if position < 0:
            raise FormError("the body holds no part: the multipart boundary never appears")
        position += 2
    parts = []
    while True:
        after = position + len(delimiter)
        if body[after:after + 2] == b"--":
            return Form(body, boundary, tuple(parts))
        part = _read_part(body, delimiter, position, after)
        parts.append(part)
        position = part.end


def _read_part(body: bytearray | bytes, delimiter: bytes, start: int, after: int) -> FormPart:
    line_end = body.find(b"\r\n", after, after + MAX_PART_HEADER_BYTES)
    if line_end < 0 or body[after:line_end].strip(b" \t"):
        raise FormError(f"a multipart delimiter line at byte {start} is not followed by a "
                        "line break")
    headers_end = body.find(b"\r\n\r\n", line_end, line_end + MAX_PART_HEADER_BYTES)
    if headers_end < 0:
        raise FormError(f"the part at byte {start} has no end to its headers within "
                        f"{MAX_PART_HEADER_BYTES} bytes")
    content_start = headers_end + 4
    content_end = body.find(b"\r\n" + delimiter, content_start)
    if content_end < 0:
        raise FormError(f"the part at byte {start} is not closed by a delimiter (a body cut "
                        "short?)")
    name, filename = _disposition(bytes(body[line_end + 2:headers_end]))
    return FormPart(name, filename, start, content_start, content_end, content_end + 2)


def _disposition(headers: bytes) -> tuple[str | None, str | None]:
    """The `name` and `filename` of a part's Content-Disposition header."""
    for line in headers.split(b"\r\n"):
        key, _, value = line.decode("utf-8", errors="replace").partition(":")
        if key.strip().lower() != "content-disposition":
            continue
        parameters = {k.lower(): _unquote(v) for k, v in _PARAMETER.findall(value)}
        return parameters.get("name"), parameters.get("filename")
    return None, None


def _unquote(value: str) -> str:
    if len(value) >= 2 and value[0] == value[-1] == '"':
        return re.sub(r"\\(.)", r"\1", value[1:-1])
    return value
