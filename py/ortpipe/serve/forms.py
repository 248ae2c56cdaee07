"""multipart/form-data bodies (RFC 7578), as OpenAI's image edit and transcription endpoints take them: text
fields and files, read from the bytes the server already holds (the body's size is bounded before it gets
here).

A field's value is text; a part with a filename is a file, kept as bytes. A name may repeat (OpenAI's
`image[]`): `Form.fields` keeps every value in order. Malformed bodies are an `InvalidRequest` naming what
is wrong, never a traceback.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from email.message import Message

from .protocol import InvalidRequest


@dataclass(frozen=True)
class Upload:
    """A file part: its filename (as the client named it), content type and bytes."""

    filename: str
    content_type: str
    data: bytes


@dataclass
class Form:
    """A parsed form: each name's values (strings or Uploads), in the order they came."""

    fields: dict[str, list[str | Upload]] = field(default_factory=dict)


def _header_params(value: str, header: str) -> Message:
    message = Message()
    message[header] = value
    return message


def boundary_of(content_type: str) -> bytes:
    """The boundary of a multipart/form-data content type; an InvalidRequest for any other type."""
    params = _header_params(content_type, "content-type")
    if params.get_content_type() != "multipart/form-data":
        raise InvalidRequest(
            f"This endpoint takes multipart/form-data (its files as file parts, as OpenAI's does), but the "
            f"request's Content-Type is {content_type or 'missing'!r}."
        )
    boundary = params.get_param("boundary", header="content-type")
    if not isinstance(boundary, str) or not 1 <= len(boundary) <= 70:
        raise InvalidRequest("The multipart/form-data Content-Type has no valid boundary.")
    return boundary.encode("latin-1")


def parse_form(content_type: str, body: bytes) -> Form:
    """The fields and files of a multipart/form-data body."""
    delimiter = b"--" + boundary_of(content_type)
    data = b"\r\n" + body  # each delimiter, the first too, then follows a CRLF
    pieces = data.split(b"\r\n" + delimiter)
    if len(pieces) < 2 or not pieces[-1].startswith(b"--"):
        raise InvalidRequest("The multipart/form-data body is malformed: it does not end with its boundary.")
    form = Form()
    for piece in pieces[1:-1]:
        head, sep, content = piece.partition(b"\r\n\r\n")
        if not sep:
            raise InvalidRequest("The multipart/form-data body is malformed: a part has no blank line.")
        name, filename, kind = _part_headers(head)
        try:
            value: str | Upload = (
                Upload(filename, kind, content) if filename is not None else content.decode("utf-8")
            )
        except UnicodeDecodeError:
            raise InvalidRequest(f"The form field {name!r} is not UTF-8 text.", name) from None
        form.fields.setdefault(name, []).append(value)
    return form


def _part_headers(head: bytes) -> tuple[str, str | None, str]:
    """A part's field name, filename (None for a text field) and content type."""
    disposition, kind = None, "application/octet-stream"
    for line in head.decode("latin-1").split("\r\n")[1:]:  # [0]: the rest of the delimiter's line
        key, _, value = line.partition(":")
        key = key.strip().lower()
        if key == "content-disposition":
            disposition = value.strip()
        elif key == "content-type":
            kind = value.strip()
    if disposition is None or not re.match(r"form-data\s*(;|$)", disposition, re.IGNORECASE):
        raise InvalidRequest("The multipart/form-data body is malformed: a part is not form-data.")
    params = _header_params(disposition, "content-disposition")
    name = params.get_param("name", header="content-disposition")
    filename = params.get_filename()
    if not isinstance(name, str) or not name:
        raise InvalidRequest("The multipart/form-data body is malformed: a part has no name.")
    # RFC 7578: names and filenames are UTF-8 sent as they are; latin-1 read them byte for byte
    return _utf8(name), None if filename is None else _utf8(filename), kind


def _utf8(text: str) -> str:
    try:
        return text.encode("latin-1").decode("utf-8")
    except (UnicodeEncodeError, UnicodeDecodeError):
        return text
