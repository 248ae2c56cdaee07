"""A static server for the browser bundle (dist/web/, built by `python -m build.web`).

It exists for the MIME types: `.mjs` must be served as JavaScript and `.wasm` as application/wasm
(with a wrong wasm type Pyodide hangs without an error). `coop=True` adds the COOP/COEP headers
that make the page cross-origin isolated, which onnxruntime-web needs for threaded wasm.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import threading
from collections.abc import Sequence
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

TEXT = "text/plain; charset=utf-8"
MIME_TYPES = {
    ".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8",
    ".mjs": "text/javascript; charset=utf-8", ".css": "text/css; charset=utf-8",
    ".json": "application/json", ".wasm": "application/wasm", ".zip": "application/zip",
    ".onnx": "application/octet-stream", ".data": "application/octet-stream", ".ts": TEXT, ".txt": TEXT,
    ".svg": "image/svg+xml", ".png": "image/png", ".ico": "image/x-icon",
}
ISOLATION_HEADERS = {
    "Cross-Origin-Opener-Policy": "same-origin",
    "Cross-Origin-Embedder-Policy": "require-corp",
}


class BundleHandler(SimpleHTTPRequestHandler):
    extensions_map = {"": "application/octet-stream", **MIME_TYPES}

    def __init__(self, *args: Any, coop: bool, quiet: bool, **kwargs: Any):
        self.coop, self.quiet = coop, quiet
        super().__init__(*args, **kwargs)

    def end_headers(self) -> None:
        # Rebuilt bundles must not be mixed with cached files of an older build.
        self.send_header("Cache-Control", "no-cache")
        if self.coop:
            for name, value in ISOLATION_HEADERS.items():
                self.send_header(name, value)
        super().end_headers()

    def send_head(self) -> Any:  # GET's and HEAD's
        if "\x00" in self.translate_path(self.path):  # open() would raise: a traceback and no answer
            self.send_error(400, "The path holds a NUL byte (%00)")
            return None
        return super().send_head()

    def log_message(self, format: str, *args: Any) -> None:
        if not self.quiet:
            super().log_message(format, *args)


def port_number(text: str) -> int:
    """argparse's type of a --port: a whole number from 0 (a free one) to 65535."""
    try:
        port = int(text)
    except ValueError:
        port = -1
    if not 0 <= port <= 65535:
        wanted = "a whole number from 0 (a free one) to 65535"
        raise argparse.ArgumentTypeError(f"a port is {wanted}, not {text!r}")
    return port


def cannot_listen(host: str, port: int, error: BaseException) -> str:
    """Why a server could not listen, and what to do."""
    reason = getattr(error, "strerror", None) or str(error)
    return f"cannot listen on {host} port {port}: {reason}; pick another --port (0: a free one) or --host"


def make_server(root: str | os.PathLike[str], host: str = "127.0.0.1", port: int = 8000, coop: bool = False,
                quiet: bool = False) -> ThreadingHTTPServer:
    """A server for `root`; port 0 picks a free port (read it from `server.server_address`)."""
    handler = functools.partial(BundleHandler, directory=os.fspath(root), coop=coop, quiet=quiet)
    return ThreadingHTTPServer((host, port), handler)


def serve_in_thread(root: str | os.PathLike[str], coop: bool = False) -> tuple[ThreadingHTTPServer, str]:
    """Serve `root` on a free port of 127.0.0.1 from a daemon thread; returns the server and its URL."""
    server = make_server(root, port=0, coop=coop, quiet=True)
    threading.Thread(target=server.serve_forever, name="ortpipe-web", daemon=True).start()
    host, port = server.server_address[:2]
    return server, f"http://{host}:{port}/"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ortpipe web", description="Serve the browser bundle (dist/web).")
    add_arguments(parser)
    return run(parser.parse_args(argv))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("root", nargs="?", default=os.path.join("dist", "web"),
                        help="the bundle to serve (default: dist/web; build it with `python -m build.web`)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=port_number, default=8000)
    parser.add_argument("--coop", action="store_true",
                        help="send COOP/COEP headers (cross-origin isolation: threaded wasm)")


def run(args: argparse.Namespace) -> int:
    if not os.path.isfile(os.path.join(args.root, "worker.js")):
        print(f"ortpipe web: {args.root} is not a built bundle (no worker.js); "
              "run `python -m build.web` first", file=sys.stderr)
        return 2
    try:
        server = make_server(args.root, args.host, args.port, args.coop)
    except OSError as e:  # the port taken, an address this machine does not have
        print(f"ortpipe web: {cannot_listen(args.host, args.port, e)}", file=sys.stderr)
        return 2
    with server:
        host, port = server.server_address[:2]
        isolated = " (cross-origin isolated)" if args.coop else ""
        print(f"serving {args.root} at http://{host}:{port}/{isolated}")
        try:
            server.serve_forever()
        except KeyboardInterrupt:
            pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
