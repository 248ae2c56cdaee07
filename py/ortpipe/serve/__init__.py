"""`ortpipe serve`: an OpenAI-compatible HTTP server over one loaded model (the `serve` extra).

    protocol.py  the OpenAI wire format: request bodies checked, responses and stream chunks built (no I/O)
    rows.py      a request as a row: chat template, tokens, the prompt cache, the core's Request
    engine.py    the engine thread that owns the pipeline, the bounded queue, the scheduler interface
    outputs.py   the endpoints of folders that make outputs: /v1/embeddings, /v1/audio/speech, /v1/images
    forms.py     multipart/form-data bodies (/v1/images/edits' image and mask files, transcriptions' audio)
    transcriptions.py  /v1/audio/transcriptions' form, for a folder whose decoder reads speech
    metrics.py   /metrics in the Prometheus text format
    app.py       the Starlette routes, API key, CORS, server-sent events, disconnects
    load.py      the serve benchmark (`ortpipe bench --serve`: tokens/s at 1 to 8 streams)

The HTTP stack is Starlette on uvicorn (its pure-Python h11 protocol: no compiler on an ARM board). What
decided it over the standard library's ThreadingHTTPServer: a server-sent-events stream per client is
a coroutine, not a thread; and ASGI tells the app when a client disconnects (`http.disconnect`) while its
request waits in the queue or between two tokens, which is what lets a client that leaves free its place at
once. With http.server a departure shows only when a write fails, so a queued request of a client that has
gone keeps its place until it is generated for nobody. The model never runs on the event loop: the engine
thread owns the pipeline (a loaded pipeline is used from one thread at a time).
"""

from __future__ import annotations

import argparse
import logging
import socket
import sys
from typing import Any

from ..config.settings import SETTINGS
from ..errors import OrtpipeError
from ..static_server import cannot_listen, port_number

DEFAULTS = {"host": "127.0.0.1", "port": 8000, "max_batch": 4, "max_queue": 16, "prompt_cache": 4}
# the settings table's rows a server sets for every request (config/settings.py)
SPECULATIVE = ("prompt_lookup_num_tokens", "ngram_size", "max_draft_tokens", "draft_model")


def _at_least(low: int) -> Any:
    """argparse's type of a count: a whole number from `low` up."""

    def count(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = low - 1
        if value < low:
            raise argparse.ArgumentTypeError(f"a whole number from {low} up, not {text!r}")
        return value

    return count


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", metavar="MODEL_DIR")
    p.add_argument("--host", default=DEFAULTS["host"], help="address to listen on (default: loopback only)")
    p.add_argument("--port", type=port_number, default=DEFAULTS["port"], help="port (0: a free one, printed)")
    p.add_argument(
        "--api-key",
        default=None,
        metavar="KEY",
        help="require `Authorization: Bearer KEY` on every route but /health (or set ORTPIPE_API_KEY)",
    )
    p.add_argument(
        "--cors",
        action="append",
        default=[],
        metavar="ORIGIN",
        help="allow browser pages from ORIGIN (repeatable; * for any)",
    )
    p.add_argument(
        "--max-batch",
        type=_at_least(1),
        default=DEFAULTS["max_batch"],
        metavar="N",
        help="requests generated at once, each a row with its own KV cache "
        f"(default {DEFAULTS['max_batch']})",
    )
    p.add_argument(
        "--max-queue",
        type=_at_least(0),
        default=DEFAULTS["max_queue"],
        metavar="N",
        help=f"requests that may wait for a row; beyond, 429 (default {DEFAULTS['max_queue']})",
    )
    p.add_argument(
        "--prompt-cache",
        type=_at_least(0),
        default=DEFAULTS["prompt_cache"],
        metavar="N",
        help=f"finished requests' KV caches kept for requests that continue them (default "
        f"{DEFAULTS['prompt_cache']}; 0: none)",
    )
    p.add_argument("--threads", type=int, help="intra-op threads per session (default: onnxruntime's)")
    g = p.add_argument_group(
        "speculative decoding (a request alone runs its drafts; rows of a batch make one token a run)"
    )
    for s in SETTINGS:
        if s.name in SPECULATIVE:
            if s.kind == "path":
                g.add_argument(s.flag, metavar="DIR", help=s.help)
            else:
                g.add_argument(s.flag, type=int, metavar="N", help=s.help)
    # --ep, --profile and --dtype: the CLI adds them, as to every command that loads a model



def run(args: argparse.Namespace) -> int:
    import os

    import uvicorn

    from ..targets.cpython import providers
    from .app import create_app
    from .engine import Engine

    overrides = providers.parse_overrides(args.ep)
    _log_to_stderr()
    failure: list[BaseException] = []

    def load() -> Any:
        from ..targets.cpython import load as load_cpython

        return load_cpython(
            args.model, provider=overrides, profile=args.profile, threads=args.threads, dtype=args.dtype
        )

    def fatal(e: BaseException) -> None:
        failure.append(e)
        server.should_exit = True

    engine = Engine(
        load,
        max_batch=args.max_batch,
        max_queue=args.max_queue,
        prompt_cache=args.prompt_cache,
        settings={name: getattr(args, name) for name in SPECULATIVE if getattr(args, name, None) is not None},
        on_fatal=fatal,
    )
    app = create_app(engine, args.model, args.api_key or os.environ.get("ORTPIPE_API_KEY"), args.cors)
    sock = listen(args.host, args.port)
    server = uvicorn.Server(
        uvicorn.Config(app, log_level="warning", access_log=False, timeout_graceful_shutdown=5)
    )
    host, port = sock.getsockname()[:2]
    print(
        f"ortpipe serve: {args.model} at http://{_url_host(host)}:{port}/v1 "
        f"(loading; GET /health answers 200 once loaded)",
        file=sys.stderr,
        flush=True,
    )
    server.run(sockets=[sock])
    if failure:
        raise failure[0]
    return 0


def listen(host: str, port: int) -> socket.socket:
    """A listening socket (port 0: a free one), IPv4 or IPv6 as `host` is written."""
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        return socket.create_server((host, port), family=family)
    except OSError as e:  # the port taken, an address this machine does not have or cannot resolve
        raise OrtpipeError(cannot_listen(host, port, e)) from None


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def _log_to_stderr() -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(message)s"))
    logger = logging.getLogger("ortpipe.serve")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
