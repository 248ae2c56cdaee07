"""web/unpack.js, the worker's helper that fetches and unpacks Python's memory snapshot and ortpipe's zip
on a thread of its own: what it hands back equals what Python's gzip and zipfile read from the same
files, and a zip it cannot unpack safely is an error (the worker then unpacks the zip in Python)."""

from __future__ import annotations

import gzip
import hashlib
import zipfile
from pathlib import Path
from typing import Any

import pytest
from build import web

# Runs in the page: the helper's two answers, each file and the snapshot as a SHA-256.
UNPACK = """async ({snapshot, zip}) => {
  const helper = new Worker('unpack.js', {type: 'module'});
  const answers = [];
  await new Promise((resolve, reject) => {
    helper.onerror = (event) => reject(new Error(event.message));
    helper.onmessage = ({data}) => { answers.push(data); if (answers.length === 2) resolve(); };
    helper.postMessage({snapshot, zip});
  });
  helper.terminate();
  const hex = async (bytes) => Array.from(new Uint8Array(await crypto.subtle.digest('SHA-256', bytes)),
    (b) => b.toString(16).padStart(2, '0')).join('');
  const result = {};
  for (const data of answers) {
    if (data.error) result[`${data.of}Error`] = data.error;
    if (data.snapshot) result.snapshot = {size: data.snapshot.byteLength, sha: await hex(data.snapshot)};
    if (data.files) {
      result.files = {};
      for (const [path, bytes] of data.files) result.files[path] = await hex(bytes);
    }
  }
  return result;
}"""


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def test_the_helper_unpacks_what_gzip_and_zipfile_read(page: Any, base_url: str, bundle: Path) -> None:
    page.goto(f"{base_url}versions.json")
    got = page.evaluate(UNPACK, {"snapshot": web.SNAPSHOT, "zip": "ortpipe.zip"})
    snapshot = gzip.decompress((bundle / web.SNAPSHOT).read_bytes())
    assert got["snapshot"] == {"size": len(snapshot), "sha": sha(snapshot)}
    with zipfile.ZipFile(bundle / "ortpipe.zip") as z:
        expected = {info.filename: sha(z.read(info)) for info in z.infolist() if not info.is_dir()}
    assert got["files"] == expected
    assert any(path.endswith(".onnx") for path in expected) and "ortpipe/__init__.py" in expected


def _zip(path: Path, entries: dict[str, bytes], compression: int = zipfile.ZIP_DEFLATED) -> None:
    with zipfile.ZipFile(path, "w", compression) as z:
        for name, data in entries.items():
            z.writestr(name, data)


@pytest.mark.parametrize("entries, compression, error", [
    ({"ortpipe/a.py": b"x = 1\n", "../escape.py": b"y = 2\n"}, zipfile.ZIP_DEFLATED,
     "the entry ../escape.py leaves its folder"),
    ({"/etc/absolute.py": b"z = 3\n"}, zipfile.ZIP_STORED, "the entry /etc/absolute.py leaves its folder"),
    ({"ortpipe/b.py": b"w = 4\n" * 100}, zipfile.ZIP_BZIP2,
     "compressed with method 12 (stored or deflated only)"),
])
def test_a_zip_it_cannot_unpack_safely_is_an_error(
    page: Any, base_url: str, bundle: Path, entries: dict[str, bytes], compression: int, error: str
) -> None:
    name = f"hostile-{sha(repr(entries).encode())[:8]}.zip"
    _zip(bundle / name, entries, compression)
    page.goto(f"{base_url}versions.json")
    got = page.evaluate(UNPACK, {"snapshot": web.SNAPSHOT, "zip": name})
    assert error in got["zipError"] and "files" not in got
    assert got["snapshot"]["size"] > 0  # the other answer is unaffected


def test_stored_entries_and_a_missing_file(page: Any, base_url: str, bundle: Path) -> None:
    _zip(bundle / "stored.zip", {"ortpipe/c.py": b"v = 5\n", "ortpipe/kernels/": b""}, zipfile.ZIP_STORED)
    page.goto(f"{base_url}versions.json")
    got = page.evaluate(UNPACK, {"snapshot": "pyodide/no-such-snapshot.bin", "zip": "stored.zip"})
    assert got["files"] == {"ortpipe/c.py": sha(b"v = 5\n")}  # the directory entry is left out
    assert "HTTP 404" in got["snapshotError"] and "rebuild the bundle" in got["snapshotError"]


def test_without_the_helper_the_worker_unpacks_on_its_own_thread(page: Any, bundle: Path, tmp_path: Path,
                                                                models: dict[str, Path]) -> None:
    """A bundle served without unpack.js: the worker's helper fails to start, and Python starts anyway."""
    from test_browser import GENERATE, PROMPT

    import ortpipe
    from ortpipe.static_server import serve_in_thread

    served = tmp_path / "web"
    served.mkdir()
    for item in bundle.iterdir():
        if item.name != "unpack.js":
            (served / item.name).symlink_to(item)
    server, url = serve_in_thread(served)
    try:
        page.goto(url)
        got = page.evaluate(GENERATE, {"model": "models/v2/", "device": "wasm",
                                       "options": {"promptIds": PROMPT, "maxNewTokens": 8}})
    finally:
        server.shutdown()
        server.server_close()
    expected = ortpipe.load(models["v2"]).generate(prompt_ids=PROMPT, max_new_tokens=8)
    assert got["result"]["tokens"] == expected.tokens
