"""The HTTP side: Starlette routes in OpenAI's shape over the engine.

A completion's response is an ASGI callable (`JobResponse`) that listens for the client's disconnect for
as long as the job lives, queued or generating: a client that leaves cancels its job at once, whatever the
ASGI server's version does with disconnects on its own.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from starlette.applications import Starlette
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from .. import __version__
from .engine import Delta, Engine, Failed, Finished, Job, Made, NotReady, QueueFull
from .forms import boundary_of, parse_form
from .outputs import OutputQuery, parse_embeddings, parse_image_edit, parse_images, parse_speech
from .protocol import Completion, InvalidRequest, Reply, Usage, error_body, parse_chat, parse_text
from .transcriptions import parse_transcription, parse_translation

MAX_BODY_BYTES = 8 * 2**20
SSE_HEADERS = {"cache-control": "no-cache", "x-accel-buffering": "no"}
DISCONNECTED = object()  # put on a job's events when its client leaves


def create_app(engine: Engine, model_dir: str | Path, api_key: str | None = None,
               cors: list[str] | None = None) -> Starlette:
    """The server's ASGI app; its lifespan starts the engine (the model loads behind /health's 503)."""
    api = Api(engine, Path(model_dir))
    engine.model = api.model

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        engine.start()
        try:
            yield
        finally:
            await asyncio.to_thread(engine.stop)

    routes = [Route("/v1/chat/completions", api.chat, methods=["POST"]),
              Route("/v1/completions", api.text, methods=["POST"]),
              Route("/v1/embeddings", api.embeddings, methods=["POST"]),
              Route("/v1/audio/speech", api.speech, methods=["POST"]),
              Route("/v1/audio/transcriptions", api.transcriptions, methods=["POST"]),
              Route("/v1/audio/translations", api.translations, methods=["POST"]),
              Route("/v1/images/generations", api.images, methods=["POST"]),
              Route("/v1/images/edits", api.image_edits, methods=["POST"]),
              Route("/v1/models", api.models), Route("/v1/models/{model:path}", api.one_model),
              Route("/health", api.health), Route("/metrics", api.metrics)]
    middleware = [Middleware(CORSMiddleware, allow_origins=cors, allow_methods=["GET", "POST"],
                             allow_headers=["*"])] if cors else []
    if api_key:
        middleware.append(Middleware(RequireKey, key=api_key))
    return Starlette(routes=routes, middleware=middleware, lifespan=lifespan,
                     exception_handlers={HTTPException: _http_error, Exception: _server_error})


class Api:
    """The routes' handlers over one engine and the model it serves."""

    def __init__(self, engine: Engine, model_dir: Path):
        self.engine = engine
        self.model = model_dir.resolve().name
        config = model_dir / "genai_config.json"
        seed = (config.read_bytes() if config.is_file() else self.model.encode()) + __version__.encode()
        self.fingerprint = "fp_" + hashlib.sha256(seed).hexdigest()[:10]  # changes with config and version
        self.created = int(time.time())

    async def chat(self, request: Request) -> Any:
        return await self._complete(request, parse_chat, "chatcmpl", "completions")

    async def text(self, request: Request) -> Any:
        return await self._complete(request, parse_text, "cmpl", "completions")

    async def embeddings(self, request: Request) -> Any:
        return await self._complete(request, parse_embeddings, "embd", "embeddings")

    async def speech(self, request: Request) -> Any:
        return await self._complete(request, parse_speech, "speech", "speech")

    async def images(self, request: Request) -> Any:
        return await self._complete(request, parse_images, "img", "images")

    async def image_edits(self, request: Request) -> Any:
        # its parse decodes the image and mask: off the event loop, which other clients' streams share
        return await self._complete(request, parse_image_edit, "img", "images", _form_body, threaded=True)

    async def transcriptions(self, request: Request) -> Any:
        # its parse only reads the form: the engine decodes the audio, at the folder's sampling rate
        return await self._complete(request, parse_transcription, "trsc", "completions", _form_body)

    async def translations(self, request: Request) -> Any:
        return await self._complete(request, parse_translation, "trsl", "completions", _form_body)

    async def _complete(self, request: Request, parse: Callable[[Any], Completion | OutputQuery],
                        prefix: str, endpoint: str, read: Callable[[Request], Any] | None = None,
                        threaded: bool = False) -> Any:
        engine = self.engine
        jobs: list[Job] = []
        try:
            engine.check_endpoint(endpoint)  # before the body: a model that does not answer here says so
            body = await (read or _json_body)(request)
            completion = await asyncio.to_thread(parse, body) if threaded else parse(body)
            request_id = f"{prefix}-{uuid.uuid4().hex[:24]}"
            loop = asyncio.get_running_loop()
            if isinstance(completion, OutputQuery) or completion.candidates == 1:
                jobs = [Job(request_id, completion, loop)]
            else:  # n choices (or best_of candidates): as many jobs, rows of the batch like any others
                room = engine.max_batch + engine.max_queue
                if completion.candidates > room:
                    name = "n" if completion.n >= completion.best_of else "best_of"
                    raise InvalidRequest(
                        f"Invalid '{name}': this server takes at most {room} choices a request (its "
                        f"--max-batch {engine.max_batch} plus --max-queue {engine.max_queue}); ask for "
                        "fewer.",
                        name, "integer_above_max_value")
                jobs = [Job(f"{request_id}/{i}", completion.choice(i), loop)
                        for i in range(completion.candidates)]
            submitted: list[Job] = []
            try:
                for job in jobs:
                    engine.submit(job)
                    submitted.append(job)
            except (QueueFull, NotReady):
                for job in submitted:  # all of a request's choices or none
                    engine.cancel(job)
                raise
        except InvalidRequest as e:
            return _error(e)
        except QueueFull as e:
            busy = (
                f"The server is busy: {engine.max_batch} requests are being generated and "
                f"{engine.max_queue} are waiting. Retry after {e.retry_after} s."
            )
            return _error(
                InvalidRequest(busy, code="rate_limit_exceeded", status=429, kind="requests"),
                {"retry-after": str(e.retry_after)},
            )
        except NotReady:
            why = f"The engine stopped: {engine.error}" if engine.error else "The model is loading."
            return _error(InvalidRequest(why, status=503, kind="server_error"), {"retry-after": "1"})
        if isinstance(completion, OutputQuery):
            return OutputResponse(jobs[0], engine)
        return JobResponse(jobs, engine, Reply(request_id, completion, self.model, self.fingerprint))

    def _model_object(self) -> dict[str, Any]:
        return {"id": self.model, "object": "model", "created": self.created, "owned_by": "ortpipe"}

    async def models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [self._model_object()]})

    async def one_model(self, request: Request) -> Response:
        name = request.path_params["model"]
        if name != self.model:
            return _error(
                InvalidRequest(f"The model '{name}' does not exist", "model", "model_not_found", status=404)
            )
        return JSONResponse(self._model_object())

    async def health(self, request: Request) -> Response:
        if self.engine.loaded:
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": "error" if self.engine.error else "loading"}, status_code=503)

    async def metrics(self, request: Request) -> Response:
        return PlainTextResponse(
            self.engine.metrics.render(self.engine.gauges()),
            media_type="text/plain; version=0.0.4; charset=utf-8",
        )


class OutputResponse:
    """An output endpoint's response: its JSON or media once the job is done; a client that leaves before
    cancels the job."""

    def __init__(self, job: Job, engine: Engine):
        self.job, self.engine = job, engine

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        watcher = asyncio.ensure_future(_watch(receive, self.job))
        finished = False
        try:
            event = await self.job.events.get()
            if event is DISCONNECTED:
                return
            finished = True
            if isinstance(event, Made):
                reply = event.reply
                response: Response = (
                    JSONResponse(reply.body)
                    if isinstance(reply.body, dict)
                    else Response(reply.body, media_type=reply.media_type)
                )
            else:
                assert isinstance(event, Failed)
                response = _error(event.error)
            await response(scope, receive, send)
        finally:
            watcher.cancel()
            if not finished:
                self.engine.cancel(self.job)


async def _watch(receive: Receive, job: Job) -> None:
    """Put DISCONNECTED on the job's events when its client leaves."""
    while (await receive())["type"] != "http.disconnect":
        pass
    job.events.put_nowait(DISCONNECTED)  # type: ignore[arg-type]


class JobResponse:
    """A completion's response: the whole JSON once its jobs (one per choice) finished, or their server-sent
    events as they come, each chunk naming its choice. A failed choice fails the request; a client that
    leaves cancels every choice."""

    def __init__(self, jobs: list[Job], engine: Engine, reply: Reply):
        self.jobs, self.engine, self.reply = jobs, engine, reply
        self.events: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()  # (choice, event) of every job
        self.held: list[tuple[int, Any]] = []  # events read before the first choice started, to go over again
        self.done: set[int] = set()  # the choices that finished or failed

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        readers = [asyncio.ensure_future(self._read(i, job)) for i, job in enumerate(self.jobs)]
        watcher = asyncio.ensure_future(self._watch(receive))
        try:
            first = await self._start()
            if first is DISCONNECTED:
                return
            if isinstance(first, Failed):
                await _error(first.error)(scope, receive, send)
            elif self.reply.completion.stream:
                await self._stream(send)
            else:
                await self._whole(scope, receive, send)
        finally:
            watcher.cancel()
            for reader in readers:
                reader.cancel()
            for i, job in enumerate(self.jobs):
                if i not in self.done:
                    self.engine.cancel(job)

    async def _read(self, i: int, job: Job) -> None:
        while True:
            event = await job.events.get()
            self.events.put_nowait((i, event))
            if isinstance(event, (Finished, Failed)):
                return

    async def _watch(self, receive: Receive) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        self.events.put_nowait((-1, DISCONNECTED))

    async def _start(self) -> Any:
        """The first choice's first event (Started, or Failed: the request is refused before any response);
        what the other choices sent meanwhile is held for `_next`."""
        while True:
            i, event = await self.events.get()
            if event is DISCONNECTED or i == 0:
                if isinstance(event, Failed):
                    self.done.add(0)
                return event
            self.held.append((i, event))

    async def _next(self) -> tuple[int, Any]:
        return self.held.pop(0) if self.held else await self.events.get()

    async def _whole(self, scope: Scope, receive: Receive, send: Send) -> None:
        n = len(self.jobs)
        texts: list[list[str]] = [[] for _ in range(n)]
        logprobs: list[list[Any]] = [[] for _ in range(n)]
        finished: dict[int, Finished] = {}
        while len(finished) < n:
            i, event = await self._next()
            if event is DISCONNECTED:
                return
            if isinstance(event, Delta):
                texts[i].append(event.text)
                logprobs[i] += event.logprobs or []
            elif isinstance(event, Failed):
                self.done.add(i)
                await _error(event.error)(scope, receive, send)
                return
            elif isinstance(event, Finished):
                self.done.add(i)
                finished[i] = event
        asked = self.reply.completion.settings.get("logprobs") is not None
        choices = [("".join(texts[i]), finished[i].finish_reason, logprobs[i] if asked else None)
                   for i in range(n)]
        if self.reply.completion.endpoint == "transcription":
            text, usage = choices[0][0], _usage(finished)
            response: Response = (PlainTextResponse(text) if self.reply.completion.response_format == "text"
                                  else JSONResponse(self.reply.transcription(text, usage)))
            await response(scope, receive, send)
            return
        wanted = self.reply.completion.n
        if n > wanted:  # best_of: the candidates with the highest mean log-probability a token, best first
            best = sorted(range(n), key=lambda i: -_mean_logprob(logprobs[i]))[:wanted]
            choices = [choices[i] for i in best]
        await JSONResponse(self.reply.response(choices, _usage(finished)))(scope, receive, send)

    async def _stream(self, send: Send) -> None:
        headers = [
            (b"content-type", b"text/event-stream; charset=utf-8"),
            *((k.encode(), v.encode()) for k, v in SSE_HEADERS.items()),
        ]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        if self.reply.chat:
            for i in range(len(self.jobs)):
                await _event(send, self.reply.chunk(first=True, index=i))
        finished: dict[int, Finished] = {}
        while len(finished) < len(self.jobs):
            i, event = await self._next()
            if event is DISCONNECTED:
                return
            if isinstance(event, Delta):
                await _event(send, self.reply.chunk(event.text, logprobs=event.logprobs, index=i))
            elif isinstance(event, Finished):
                self.done.add(i)
                finished[i] = event
                await _event(send, self.reply.chunk(finish_reason=event.finish_reason, index=i))
            elif isinstance(event, Failed):
                self.done.add(i)
                await _event(send, event.error.body())
                break
        else:
            if self.reply.completion.include_usage:
                await _event(send, self.reply.usage_chunk(_usage(finished)))
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})


def _mean_logprob(entries: list[Any]) -> float:
    return sum(e.logprob for e in entries) / len(entries) if entries else float("-inf")


def _usage(finished: dict[int, Finished]) -> Usage:
    """A request's usage over its choices: the prompt once (the first choice's), every choice's tokens."""
    first = finished[0].usage
    every = [f.usage for f in finished.values()]
    return Usage(first.prompt_tokens, sum(u.completion_tokens for u in every), first.cached_tokens,
                 sum(u.accepted_prediction_tokens for u in every),
                 sum(u.rejected_prediction_tokens for u in every))


async def _event(send: Send, data: dict[str, Any]) -> None:
    body = b"data: " + json.dumps(data, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"
    await send({"type": "http.response.body", "body": body, "more_body": True})


async def _body(request: Request) -> bytes:
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise _too_large()
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > MAX_BODY_BYTES:
            raise _too_large()
    return bytes(body)


async def _form_body(request: Request) -> Any:
    """A multipart/form-data body's fields and files (the content type checked before the body is read)."""
    content_type = request.headers.get("content-type", "")
    boundary_of(content_type)
    return parse_form(content_type, await _body(request))


async def _json_body(request: Request) -> Any:
    body = await _body(request)
    try:
        return json.loads(body)
    except (ValueError, RecursionError):
        raise InvalidRequest(
            "We could not parse the JSON body of your request. The API expects a JSON "
            "payload (Content-Type: application/json)."
        ) from None


def _too_large() -> InvalidRequest:
    return InvalidRequest(f"The request body is larger than {MAX_BODY_BYTES} bytes.", status=413)


def _error(e: InvalidRequest, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=headers)


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    wrong_url = exc.status_code in (404, 405)
    message = f"Invalid URL ({request.method} {request.url.path})" if wrong_url else exc.detail
    return JSONResponse(error_body(message), status_code=exc.status_code)


async def _server_error(request: Request, exc: Exception) -> Response:
    return JSONResponse(
        error_body("The server had an error while processing your request.", "server_error"), status_code=500
    )


class RequireKey:
    """--api-key: every route but /health needs `Authorization: Bearer KEY`."""

    def __init__(self, app: ASGIApp, key: str):
        self.app, self.key = app, key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] == "/health":
            await self.app(scope, receive, send)
            return
        scheme, _, token = Headers(scope=scope).get("authorization", "").partition(" ")
        if scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), self.key):
            await self.app(scope, receive, send)
            return
        message = (
            "Incorrect API key provided."
            if token
            else "You didn't provide an API key. Send it in an Authorization header using Bearer auth "
            "(Authorization: Bearer YOUR_KEY)."
        )
        response = JSONResponse(
            error_body(message, code="invalid_api_key" if token else None),
            status_code=401,
            headers={"www-authenticate": "Bearer"},
        )
        await response(scope, receive, send)
