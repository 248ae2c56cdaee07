"""multipart/form-data as the server reads it (serve/forms.py): bodies encoded by the HTTP client the `openai`
package sends with (an independent encoder) parse back to what was encoded, bytes for bytes."""

from __future__ import annotations

import os

import pytest

httpx = pytest.importorskip("httpx2")

from ortpipe.serve.forms import Upload, parse_form  # noqa: E402
from ortpipe.serve.protocol import InvalidRequest  # noqa: E402


def encoded(data: dict[str, str], files: list[tuple[str, tuple[str, bytes, str]]]) -> tuple[str, bytes]:
    request = httpx.Request("POST", "http://localhost/v1/images/edits", data=data, files=files)
    return request.headers["content-type"], request.read()


def test_fields_and_files_parse_back_to_what_the_client_encoded() -> None:
    blob = os.urandom(4096) + b"\r\n--\r\n\r\n" + bytes(range(256))  # CRLFs and dashes inside a file
    text = {"prompt": "un cube rouge, « très » rouge\r\nsur deux lignes", "n": "2", "strength": "0.6"}
    files = [("image[]", ("écran.png", blob, "image/png")), ("image[]", ("b.webp", b"", "image/webp"))]
    kind, body = encoded(text, files)
    form = parse_form(kind, body)
    assert {name: values for name, values in form.fields.items() if name != "image[]"} == {
        name: [value] for name, value in text.items()
    }
    assert form.fields["image[]"] == [
        Upload("écran.png", "image/png", blob),
        Upload("b.webp", "image/webp", b""),
    ]


@pytest.mark.parametrize(
    ("kind", "body", "words"),
    [
        ("application/json", b"{}", "takes multipart/form-data"),
        ("multipart/form-data", b"", "no valid boundary"),
        ("multipart/form-data; boundary=b", b"--b\r\nContent-Disposition: form-data; name=\"a\"\r\n\r\nx",
         "does not end with its boundary"),
        ("multipart/form-data; boundary=b",
         b"--b\r\nContent-Disposition: form-data; name=\"a\"\r\nx\r\n--b--", "a part has no blank line"),
        ("multipart/form-data; boundary=b", b"--b\r\nContent-Type: text/plain\r\n\r\nx\r\n--b--",
         "a part is not form-data"),
        ("multipart/form-data; boundary=b", b"--b\r\nContent-Disposition: form-data\r\n\r\nx\r\n--b--",
         "a part has no name"),
        ("multipart/form-data; boundary=b",
         b"--b\r\nContent-Disposition: form-data; name=\"a\"\r\n\r\n\xff\xfe\r\n--b--", "is not UTF-8 text"),
    ],
)
def test_malformed_bodies_are_named(kind: str, body: bytes, words: str) -> None:
    with pytest.raises(InvalidRequest, match=words):
        parse_form(kind, body)
