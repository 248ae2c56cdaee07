"""Assemble the browser bundle, dist/web/: everything the demo page and the embed API load.

    python -m build.web [--out dist/web] [MODEL_DIR[=NAME] ...]

Takes from node_modules only what the worker loads (Pyodide's core files, one onnxruntime-web
build per device, tokenizers.js and jinja), our package as a zip (sources and kernel graphs;
Pyodide unpacks it, so no wheel is needed), the files of web/, and any model folders named on
the command line (copied to models/NAME/). Every asset is served from the page's origin.

With node, it boots the bundle's Pyodide, imports ortpipe and saves the interpreter's memory
(pyodide/python-snapshot.bin, gzipped): the worker starts Python from it in a fraction of the time.

Last it writes asset-manifest.json, every file of the bundle with a truncated SHA-256, and stamps
the manifest's version into sw.js: the service worker precaches exactly these files (checking
their hashes) under a cache named after the version, so the page works offline after one visit
and a rebuilt bundle replaces the cached one.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import subprocess
import sys
import zipfile
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "py" / "ortpipe"
WEB = ROOT / "web"
NODE_MODULES = ROOT / "node_modules"

# Pyodide's core: the loader, the interpreter and the standard library; ortpipe needs no package.
PYODIDE_FILES = (
    "pyodide.mjs", "pyodide.asm.mjs", "pyodide.asm.wasm", "python_stdlib.zip", "pyodide-lock.json",
)
# The worker starts Python from this memory snapshot (made by SNAPSHOT_SCRIPT with node).
SNAPSHOT = "pyodide/python-snapshot.bin"
SNAPSHOT_SCRIPT = ROOT / "build" / "python_snapshot.mjs"
# onnxruntime-web builds the worker imports: the plain wasm build for "wasm" (half the size of the
# others), the native WebGPU EP build for "webgpu". Each .mjs loads the wasm glue of the same stem.
ORT_FILES = (
    "ort.wasm.min.mjs", "ort-wasm-simd-threaded.mjs", "ort-wasm-simd-threaded.wasm",
    "ort.webgpu.min.mjs", "ort-wasm-simd-threaded.asyncify.mjs", "ort-wasm-simd-threaded.asyncify.wasm",
)
# The worker's first onnxruntime-web session, made while Python starts (any one-node graph does).
ORT_START_MODEL = PACKAGE / "kernels" / "argmax_float32.onnx"
VENDOR_FILES = {
    "tokenizers.mjs": "@huggingface/tokenizers/dist/tokenizers.min.mjs",
    "jinja.mjs": "@huggingface/jinja/dist/index.js",
}
VERSIONED = ("pyodide", "onnxruntime-web", "@huggingface/tokenizers", "@huggingface/jinja")
# The service worker (web/sw.js) and the manifest of what it precaches; neither is precached itself.
SERVICE_WORKER = "sw.js"
ASSET_MANIFEST = "asset-manifest.json"
VERSION_PLACEHOLDER = 'const BUNDLE_VERSION = "unbuilt";'
HASH_CHARS = 16  # hex digits kept of a SHA-256: enough to tell builds and files apart
# Files of web/ the bundle leaves out: build/bench_web.py's page, which needs transformers.js.
BENCH_FILES = ("bench.html", "bench.js")
# Files of a model folder the browser never reads.
MODEL_IGNORE = shutil.ignore_patterns("*.py", "__pycache__", ".*")


class BuildError(Exception):
    """A missing input, with what to run to get it."""


def build(out: Path, models: Sequence[tuple[str, Path]] = (), node_modules: Path = NODE_MODULES) -> Path:
    """Write the bundle to `out` (replacing it) and return `out`."""
    _check_inputs(node_modules, models)
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    _copy(node_modules / "pyodide", out / "pyodide", PYODIDE_FILES)
    _copy(node_modules / "onnxruntime-web" / "dist", out / "ort", ORT_FILES)
    shutil.copy2(ORT_START_MODEL, out / "ort" / "start.onnx")
    (out / "vendor").mkdir()
    for name, source in VENDOR_FILES.items():
        shutil.copy2(node_modules / source, out / "vendor" / name)
    for item in sorted(WEB.iterdir()):
        if item.is_file() and item.name not in BENCH_FILES:
            shutil.copy2(item, out / item.name)
    _package_zip(out / "ortpipe.zip")
    _python_snapshot(out)
    (out / "versions.json").write_text(json.dumps(versions(node_modules), indent=2) + "\n")
    (out / "models").mkdir()
    for name, folder in models:
        shutil.copytree(folder, out / "models" / name, ignore=MODEL_IGNORE)
    # The demo page offers these folders.
    (out / "models" / "index.json").write_text(json.dumps([name for name, _ in models]) + "\n")
    write_asset_manifest(out)
    return out


def write_asset_manifest(out: Path) -> dict[str, object]:
    """Write `out`/asset-manifest.json, {"version", "files": {path: hash}}, and stamp the version
    into the service worker; returns the manifest. Run it again after changing files in `out`."""
    files = {
        path.relative_to(out).as_posix(): file_hash(path)
        for path in sorted(out.rglob("*"))
        if path.is_file() and path.relative_to(out).as_posix() not in (SERVICE_WORKER, ASSET_MANIFEST)
    }
    listing = json.dumps(files, sort_keys=True).encode()
    manifest = {"version": hashlib.sha256(listing).hexdigest()[:HASH_CHARS], "files": files}
    (out / ASSET_MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    _stamp_service_worker(out / SERVICE_WORKER, manifest["version"])
    return manifest


def file_hash(path: Path) -> str:
    """The file's SHA-256, truncated: what sw.js checks each download against."""
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()[:HASH_CHARS]


def _stamp_service_worker(path: Path, version: str) -> None:
    """The browser updates a service worker when its script changes: the version makes it change."""
    source = (WEB / SERVICE_WORKER).read_text()
    if VERSION_PLACEHOLDER not in source:
        raise BuildError(f"{WEB / SERVICE_WORKER} lacks the line {VERSION_PLACEHOLDER!r} to stamp")
    path.write_text(source.replace(VERSION_PLACEHOLDER, f'const BUNDLE_VERSION = "{version}";'))


def versions(node_modules: Path) -> dict[str, str]:
    """The versions bundled: what the page shows and what a bug report needs."""
    from ortpipe import __version__

    found = {name: json.loads((node_modules / name / "package.json").read_text()) for name in VERSIONED}
    return {"ortpipe": __version__, **{name: package["version"] for name, package in found.items()}}


def _check_inputs(node_modules: Path, models: Sequence[tuple[str, Path]]) -> None:
    if not (node_modules / "pyodide").is_dir() or not (node_modules / "onnxruntime-web").is_dir():
        raise BuildError(f"{node_modules} lacks pyodide or onnxruntime-web: run `npm ci` in {ROOT}")
    for name, folder in models:
        if not folder.is_dir():
            raise BuildError(f"model folder {folder} (for models/{name}) is not a directory")


def _copy(source: Path, dest: Path, names: Sequence[str]) -> None:
    dest.mkdir(parents=True)
    for name in names:
        shutil.copy2(source / name, dest / name)


def _package_zip(path: Path) -> None:
    """ortpipe's sources and kernels, laid out to be unpacked into site-packages."""
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
        for file in sorted(PACKAGE.rglob("*")):
            cpython = file.relative_to(PACKAGE).parts[:2] == ("targets", "cpython")  # numpy's target
            if file.suffix in (".py", ".onnx") and "__pycache__" not in file.parts and not cpython:
                z.write(file, Path("ortpipe") / file.relative_to(PACKAGE))


def _python_snapshot(out: Path) -> None:
    """Boot the bundle's Pyodide under node with ortpipe imported and save its memory (gzipped)."""
    node = shutil.which("node")
    if node is None:
        raise BuildError("node is not on PATH: the bundle's Python snapshot is made with node "
                         "(install Node.js, as for `npm ci`)")
    command = [node, str(SNAPSHOT_SCRIPT), str(out / "pyodide"), str(out / "ortpipe.zip"),
               str(out / SNAPSHOT)]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise BuildError(f"making the Python snapshot failed ({' '.join(command)}):\n{done.stderr.strip()}")


def _model_arg(text: str) -> tuple[str, Path]:
    """MODEL_DIR or MODEL_DIR=NAME; NAME defaults to the folder's name."""
    folder, _, name = text.partition("=")
    path = Path(folder)
    return name or path.resolve().name, path


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m build.web", description=__doc__.splitlines()[0])
    parser.add_argument(
        "models",
        nargs="*",
        type=_model_arg,
        metavar="MODEL_DIR[=NAME]",
        help="model folders to copy under models/NAME/",
    )
    parser.add_argument("--out", type=Path, default=ROOT / "dist" / "web")
    args = parser.parse_args(argv)
    try:
        out = build(args.out, args.models)
    except BuildError as e:
        print(f"build.web: {e}", file=sys.stderr)
        return 2
    print(f"built {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
