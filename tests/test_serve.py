"""`ortpipe serve` driven by the official `openai` client, on a model-builder export with a chat template.

Every generated text is checked against the same request run alone through `pipe.generate` on a pipeline
of its own. The test model decodes about 30,000 tokens/s, so tests that need requests to overlap slow the
engine down by sleeping before each of its steps.
"""

from __future__ import annotations

import functools
import http.client
import json
import logging
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")

import ortpipe  # noqa: E402
from ortpipe.errors import ConfigError  # noqa: E402
from ortpipe.serve import listen  # noqa: E402
from ortpipe.serve.app import create_app  # noqa: E402
from ortpipe.serve.engine import Engine  # noqa: E402

TEMPLATE = ("{% for m in messages %}<s>{{ m['role'] }}\n{{ m['content'] }}</s>\n{% endfor %}"
            "{% if add_generation_prompt %}<s>assistant\n{% endif %}")
MODEL = "llama"
REPO = Path(__file__).resolve().parent.parent


def with_template(source: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of a model folder, named MODEL, whose tokenizer config has TEMPLATE as its chat template."""
    folder = tmp_path_factory.mktemp("serve") / MODEL
    shutil.copytree(source, folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = TEMPLATE
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


@pytest.fixture(scope="module")
def folder(llama_builder_fp32: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return with_template(llama_builder_fp32, tmp_path_factory)


@pytest.fixture(scope="module")
def pipe(folder: Path) -> Any:
    """The reference: the same folder on a pipeline of its own, one request at a time."""
    return ortpipe.load(folder, threads=1)


def render(folder: Path, messages: list[dict[str, str]]) -> str:
    """The folder's chat template rendered by jinja2 directly, as transformers renders it."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    config = json.loads((folder / "tokenizer_config.json").read_text())
    template = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True).from_string(
        config["chat_template"]
    )
    tokens = {
        k: v if isinstance(v, str) else (v or {}).get("content", "")
        for k, v in config.items()
        if k in ("bos_token", "eos_token")
    }
    return template.render(messages=messages, add_generation_prompt=True, **tokens)


def alone(pipe: Any, prompt: str, max_tokens: int, **settings: Any) -> tuple[str, str]:
    """Text and OpenAI finish reason of a request run alone."""
    result = pipe.generate(prompt, max_new_tokens=max_tokens, **settings)
    return result.text, "length" if result.finish_reason == "length" else "stop"


class Served:
    """An engine and its app on an ephemeral port of 127.0.0.1, served by uvicorn from a thread."""

    def __init__(
        self,
        folder: Path,
        load: Callable[[], Any] | None = None,
        api_key: str | None = None,
        cors: list[str] | None = None,
        delay: float = 0.0,
        **options: Any,
    ):
        self.engine = Engine(load or (lambda: ortpipe.load(folder, threads=1)), **options)
        self.delay = delay
        sock = listen("127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        app = create_app(self.engine, folder, api_key=api_key, cors=cors)
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)

    def start(self) -> None:
        self.thread.start()
        until(lambda: self.server.started)

    def wait_loaded(self) -> None:
        until(lambda: self.engine.loaded)
        if self.delay:
            self.slow(self.delay)

    def slow(self, delay: float) -> None:
        """Every engine step sleeps `delay` seconds first, so that requests overlap."""
        step = self.engine.scheduler.step

        def slowed() -> None:
            time.sleep(delay)
            step()

        self.engine.scheduler.step = slowed

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(15)
        assert not self.thread.is_alive()

    def client(self, api_key: str = "unused", **options: Any) -> Any:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=api_key, **options)

    def get(self, path: str, headers: dict[str, str] | None = None) -> tuple[int, str]:
        return raw(self.url, "GET", path, None, headers)

    def metrics(self) -> dict[str, float]:
        status, text = self.get("/metrics")
        assert status == 200
        return {
            line.split(" ")[0]: float(line.split(" ")[1])
            for line in text.splitlines()
            if line and not line.startswith("#")
        }


def raw(
    url: str, method: str, path: str, body: bytes | None = None, headers: dict[str, str] | None = None
) -> tuple[int, str]:
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    try:
        conn.request(method, path, body, headers or {})
        response = conn.getresponse()
        return response.status, response.read().decode()
    finally:
        conn.close()


def until(condition: Callable[[], Any], timeout: float = 20.0) -> None:
    end = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.01)


@contextmanager
def served(folder: Path, **options: Any) -> Iterator[Served]:
    s = Served(folder, **options)
    s.start()
    try:
        s.wait_loaded()
        yield s
    finally:
        s.stop()


@pytest.fixture(scope="module")
def server(folder: Path) -> Iterator[Served]:
    with served(folder, max_batch=4, max_queue=32) as s:
        yield s


def chat_text(stream: Any) -> tuple[str, str | None, list[Any]]:
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    finish = finishes[0] if finishes else None
    return text, finish, chunks


# --- responses -------------------------------------------------------------------------------------------


def test_chat_greedy_equals_the_request_alone(server: Served, folder: Path, pipe: Any) -> None:
    messages = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "def f(x):"}]
    r = server.client().chat.completions.create(model=MODEL, messages=messages, max_tokens=24, temperature=0)
    prompt = render(folder, messages)
    text, finish = alone(pipe, prompt, 24)
    assert r.choices[0].message.content == text and r.choices[0].finish_reason == finish
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-") and r.model == MODEL
    assert r.choices[0].message.role == "assistant" and r.choices[0].index == 0
    assert r.usage.prompt_tokens == len(pipe.tokenizer.encode(prompt))
    assert r.usage.completion_tokens == len(pipe.generate(prompt, max_new_tokens=24).tokens)
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert r.usage.prompt_tokens_details.cached_tokens == 0


def test_chat_stream_with_usage_equals_the_whole_response(server: Served, folder: Path, pipe: Any) -> None:
    messages = [{"role": "user", "content": "import json\n"}]
    stream = server.client().chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=40,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    text, finish, chunks = chat_text(stream)
    assert (text, finish) == alone(pipe, render(folder, messages), 40)
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].object == "chat.completion.chunk"
    assert len({c.id for c in chunks}) == 1 and len({c.created for c in chunks}) == 1
    *body, last = chunks
    prompt = render(folder, messages)
    assert last.choices == [] and all(c.usage is None for c in body)
    assert last.usage.completion_tokens == len(pipe.generate(prompt, max_new_tokens=40).tokens)
    assert last.usage.prompt_tokens == len(pipe.tokenizer.encode(prompt))
    no_usage = server.client().chat.completions.create(
        model=MODEL, messages=messages, max_tokens=5, stream=True
    )
    assert all(c.choices for c in no_usage)  # without include_usage no usage chunk


def test_text_completions_whole_and_streamed(server: Served, pipe: Any) -> None:
    client = server.client()
    r = client.completions.create(model=MODEL, prompt="class Parser:", max_tokens=30, temperature=0)
    assert (r.choices[0].text, r.choices[0].finish_reason) == alone(pipe, "class Parser:", 30)
    assert (
        r.object == "text_completion"
        and r.id.startswith("cmpl-")
        and r.usage.prompt_tokens == len(pipe.tokenizer.encode("class Parser:"))
    )
    chunks = list(
        client.completions.create(
            model=MODEL,
            prompt="class Parser:",
            max_tokens=30,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == r.choices[0].text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == r.usage.completion_tokens
    default = client.completions.create(model=MODEL, prompt=[5, 17, 42], temperature=0)  # ids; 16 tokens
    assert default.choices[0].text == pipe.generate(prompt_ids=[5, 17, 42], max_new_tokens=16).text
    assert default.usage.prompt_tokens == 3 and default.usage.completion_tokens <= 16


def test_models_and_health(server: Served) -> None:
    models = server.client().models.list()
    assert [m.id for m in models.data] == [MODEL] and models.data[0].object == "model"
    assert server.client().models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        server.client().models.retrieve("gpt-4")
    assert server.get("/health") == (200, '{"status":"ok"}')


def test_stop_strings_across_token_boundaries_are_held_back(server: Served, folder: Path, pipe: Any) -> None:
    messages = [{"role": "user", "content": "def parse(text):"}]
    prompt = render(folder, messages)
    deltas = [c.text for c in pipe.stream(prompt, max_new_tokens=60)]
    full = "".join(deltas)
    stop, at = None, 0
    for i in range(1, len(deltas) - 1):  # the last 2 characters of one token and the first 2 of the next
        at += len(deltas[i - 1])
        a, b = deltas[i], deltas[i + 1]
        candidate = a[-2:] + b[:2]
        first = full.find(candidate) == at + len(a) - 2
        if len(a) >= 2 and len(b) >= 2 and candidate.isprintable() and first:
            stop = candidate
            break
    assert stop, f"no two neighbouring tokens of two printable characters in {deltas!r}"
    expected = full[: full.find(stop)]
    client = server.client()
    r = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=60, temperature=0, stop=["\x01never", stop]
    )
    assert r.choices[0].message.content == expected and r.choices[0].finish_reason == "stop"
    stream = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=60, temperature=0, stop=stop, stream=True
    )
    assert chat_text(stream)[:2] == (expected, "stop")  # no part of the stop string was ever sent


def test_the_event_stream_is_server_sent_events_ending_with_done(server: Served) -> None:
    body = json.dumps({"model": MODEL, "prompt": "import re", "max_tokens": 6, "stream": True}).encode()
    status, text = raw(server.url, "POST", "/v1/completions", body, {"content-type": "application/json"})
    events = text.split("\n\n")
    assert status == 200 and events[-2:] == ["data: [DONE]", ""]
    assert all(e.startswith("data: {") for e in events[:-2])
    assert json.loads(events[-3][6:])["choices"][0]["finish_reason"] in ("length", "stop")


# --- errors ----------------------------------------------------------------------------------------------

USER = [{"role": "user", "content": "hi"}]
BAD_CHAT = [
    ({"temperature": "hot"}, "temperature", "invalid_type"),
    ({"temperature": 3}, "temperature", "decimal_above_max_value"),
    ({"top_p": 1.5}, "top_p", "decimal_above_max_value"),
    ({"n": 0}, "n", "integer_below_min_value"),
    ({"n": 129}, "n", "integer_above_max_value"),
    ({"n": 37}, "n", "integer_above_max_value"),  # more than the test server's batch and queue hold
    ({"logprobs": 1}, "logprobs", "invalid_type"),
    ({"top_logprobs": 3}, "top_logprobs", "invalid_value"),  # logprobs must be true too
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs", "integer_above_max_value"),

    ({"presence_penalty": 2.5}, "presence_penalty", "decimal_above_max_value"),
    ({"frequency_penalty": "x"}, "frequency_penalty", "invalid_type"),
    ({"logit_bias": {"x": 10}}, "logit_bias", "invalid_value"),
    ({"logit_bias": {"5": -101}}, "logit_bias", "invalid_value"),
    ({"logit_bias": [5]}, "logit_bias", "invalid_type"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools", "unsupported_parameter"),
    ({"max_tokens": 0}, "max_tokens", "integer_below_min_value"),
    ({"max_completion_tokens": 10_000}, "messages", "context_length_exceeded"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop", "array_above_max_length"),
    ({"stop": [""]}, "stop[0]", "invalid_value"),
    ({"seed": 1.5}, "seed", "invalid_type"),
    ({"stream_options": {"include_usage": True}}, "stream_options", "invalid_value"),
    ({"messages": []}, "messages", "empty_array"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role", "invalid_value"),
    ({"messages": [{"role": "user"}]}, "messages[0].content", "missing_required_parameter"),
    (
        {"messages": [{"role": "user", "content": [{"type": "file", "file": {"file_id": "file-1"}}]}]},
        "messages[0].content[0].type",
        "unsupported_value",
    ),
    (
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
        "messages[0].content[0].image_url.url",
        "invalid_value",
    ),
    ({"extra_body": {"frobnicate": True}}, "frobnicate", "unknown_parameter"),
    ({"extra_body": {"prompt_lookup_num_tokens": -1}}, "prompt_lookup_num_tokens", "integer_below_min_value"),
    ({"extra_body": {"prompt_lookup_num_tokens": 33}}, "prompt_lookup_num_tokens", "integer_above_max_value"),
    ({"extra_body": {"prompt_lookup_num_tokens": 2.5}}, "prompt_lookup_num_tokens", "invalid_type"),
    ({"logprobs": True, "extra_body": {"prompt_lookup_num_tokens": 4}}, "prompt_lookup_num_tokens",
     "invalid_value"),  # one token a run: it would not speculate
    ({"logit_bias": {"9999": 5}}, "logit_bias", "invalid_value"),  # past the test model's vocabulary
    ({"prediction": "def f():"}, "prediction", "invalid_type"),
    ({"prediction": {"type": "text", "content": "x"}}, "prediction.type", "invalid_value"),
    ({"prediction": {"type": "content"}}, "prediction.content", "missing_required_parameter"),
    ({"prediction": {"type": "content", "content": "x", "weight": 1}}, "prediction.weight",
     "unknown_parameter"),
    ({"prediction": {"type": "content", "content": "x"}, "logprobs": True}, "prediction", "invalid_value"),
    # a path a client names: never
    ({"extra_body": {"draft_model": "/tmp"}}, "draft_model", "unknown_parameter"),
    # fields that change nothing here are still checked as OpenAI checks them
    ({"user": 5}, "user", "invalid_type"),
    ({"store": "yes"}, "store", "invalid_type"),
    ({"metadata": ["a"]}, "metadata", "invalid_type"),
    ({"metadata": {"team": 3}}, "metadata.team", "invalid_type"),
]


def test_fields_that_change_nothing_here_change_nothing(server: Served) -> None:
    """OpenAI's bookkeeping fields, well typed, are taken and leave the reply as it is."""
    client = server.client()
    plain = client.chat.completions.create(model=MODEL, messages=USER, max_tokens=6, temperature=0)
    marked = client.chat.completions.create(
        model=MODEL, messages=USER, max_tokens=6, temperature=0, user="u-1", metadata={"team": "a"},
        store=False, service_tier="auto", safety_identifier="s-1", prompt_cache_key="k",
    )
    assert marked.choices[0].message.content == plain.choices[0].message.content


@pytest.mark.parametrize(("options", "param", "code"), BAD_CHAT, ids=[p for _, p, _ in BAD_CHAT])
def test_a_bad_chat_request_is_a_400_naming_the_field(
    server: Served, options: dict, param: str, code: str
) -> None:
    options = {"messages": USER, **options}
    with pytest.raises(openai.BadRequestError) as info:
        server.client().chat.completions.create(model=MODEL, **options)
    error = info.value.body
    assert info.value.status_code == 400 and error["type"] == "invalid_request_error"
    assert (error["param"], error["code"]) == (param, code), error["message"]


def test_what_the_model_refuses_names_the_parameter(server: Served) -> None:
    """Refusals only the loaded model can make (its vocabulary) name the parameter, as the protocol's do."""
    client = server.client(max_retries=0)
    cases = (({"prompt": [3, 700]}, "prompt"), ({"prompt": "x", "logit_bias": {"600": 1}}, "logit_bias"))
    for options, param in cases:
        with pytest.raises(openai.BadRequestError) as info:
            client.completions.create(model=MODEL, max_tokens=2, **options)
        assert (info.value.body["param"], info.value.body["code"]) == (param, "invalid_value")
        assert "vocabulary size 512" in info.value.body["message"]


def test_malformed_bodies_and_urls_get_openai_errors(server: Served) -> None:
    post = {"content-type": "application/json"}
    status, body = raw(server.url, "POST", "/v1/chat/completions", b'{"model": "x", "messages": [', post)
    assert status == 400 and "could not parse the JSON body" in json.loads(body)["error"]["message"]
    status, body = raw(server.url, "POST", "/v1/chat/completions", b"[" * 100_000, post)  # past recursion
    assert status == 400
    status, body = raw(server.url, "POST", "/v1/completions", b'["a list"]', post)
    assert status == 400 and "expected a JSON object" in json.loads(body)["error"]["message"]
    status, body = raw(server.url, "POST", "/v1/completions", b'{"prompt": "x"}', post)
    assert status == 400 and json.loads(body)["error"]["param"] == "model"
    status, body = raw(server.url, "POST", "/v1/completions", b'{"model": "x", "prompt": ["a", "b"]}', post)
    assert status == 400 and json.loads(body)["error"]["code"] == "unsupported_parameter"
    status, body = raw(server.url, "POST", "/v1/moderations", b"{}", post)
    assert status == 404
    assert json.loads(body)["error"]["message"] == "Invalid URL (POST /v1/moderations)"
    for path in ("/v1/audio/transcriptions", "/v1/audio/translations"):
        status, body = raw(server.url, "POST", path, b"{}", post)  # a form, not JSON
        assert status == 400 and "takes multipart/form-data" in json.loads(body)["error"]["message"]
    status, body = raw(
        server.url, "POST", "/v1/embeddings", b"{}", post
    )  # the route of another kind of model
    assert status == 404 and json.loads(body)["error"]["message"] == (
        "This server's model is a text model: it answers POST /v1/chat/completions and POST /v1/completions "
        "only."
    )
    status, body = raw(server.url, "GET", "/v1/chat/completions")
    assert status == 405
    ok = server.client().chat.completions.create(model=MODEL, messages=USER, max_tokens=3)
    assert ok.choices[0].finish_reason in ("length", "stop")  # nothing above hurt the server


def test_an_api_key_is_required_when_set(folder: Path) -> None:
    with served(folder, api_key="sekrit") as s:
        with pytest.raises(openai.AuthenticationError) as info:
            s.client(api_key="wrong").chat.completions.create(model=MODEL, messages=USER, max_tokens=3)
        assert info.value.status_code == 401 and info.value.body["code"] == "invalid_api_key"
        status, body = s.get("/v1/models")
        assert status == 401 and "didn't provide an API key" in json.loads(body)["error"]["message"]
        assert s.get("/metrics")[0] == 401
        assert s.get("/health")[0] == 200  # for probes
        r = s.client(api_key="sekrit").chat.completions.create(model=MODEL, messages=USER, max_tokens=3)
        assert r.usage.completion_tokens >= 1
        assert s.get("/metrics", {"authorization": "Bearer sekrit"})[0] == 200


def test_cors_preflight_needs_no_key_and_names_the_origin(folder: Path) -> None:
    with served(folder, api_key="sekrit", cors=["http://edge.local"]) as s:
        status, _ = raw(
            s.url,
            "OPTIONS",
            "/v1/chat/completions",
            None,
            {
                "origin": "http://edge.local",
                "access-control-request-method": "POST",
                "access-control-request-headers": "authorization, content-type",
            },
        )
        assert status == 200
        host, port = s.url.removeprefix("http://").split(":")
        conn = http.client.HTTPConnection(host, int(port), timeout=10)
        conn.request(
            "GET", "/v1/models", headers={"origin": "http://edge.local", "authorization": "Bearer sekrit"}
        )
        response = conn.getresponse()
        assert (
            response.status == 200
            and response.getheader("access-control-allow-origin") == "http://edge.local"
        )
        conn.close()


def test_a_failing_request_ends_alone(server: Served, pipe: Any) -> None:
    """A failure inside one request (here a run that raises) is that request's 500; the others go on."""
    cache = server.engine.scheduler.cache
    open_row = cache.open

    def broken() -> Iterator[Any]:
        raise ortpipe.OrtpipeError('session "decoder" failed')
        yield

    def refuse() -> None:
        raise ortpipe.OrtpipeError('session "decoder" failed')

    def failing(ids: list[int], c: Any) -> Any:
        row = open_row(ids, c)
        if c.prompt == "boom":  # the row's first step raises, prefilled alone or with others
            row.request.advance = broken
            row.gen.core.begin_external = refuse
        return row

    cache.open = failing
    try:
        client = server.client(max_retries=0)
        with pytest.raises(openai.InternalServerError) as info:
            client.completions.create(model=MODEL, prompt="boom", max_tokens=5)
        assert info.value.body["type"] == "server_error"
        with pytest.raises(openai.APIError):
            list(client.completions.create(model=MODEL, prompt="boom", max_tokens=5, stream=True))
        r = client.completions.create(model=MODEL, prompt="import re", max_tokens=5, temperature=0)
        assert r.choices[0].text == alone(pipe, "import re", 5)[0]
    finally:
        cache.open = open_row


def test_a_broken_engine_fails_its_requests_and_its_health(folder: Path) -> None:
    with served(folder) as s:

        def broken() -> None:
            raise RuntimeError("a bug in a scheduler")

        s.engine.scheduler.step = broken
        with pytest.raises(openai.InternalServerError) as info:
            s.client(max_retries=0).completions.create(model=MODEL, prompt="import re", max_tokens=5)
        assert "a bug in a scheduler" in info.value.body["message"]
        assert s.get("/health") == (503, '{"status":"error"}')
        with pytest.raises(openai.InternalServerError) as info:
            s.client(max_retries=0).completions.create(model=MODEL, prompt="import re", max_tokens=5)
        assert info.value.status_code == 503


def test_health_is_503_until_the_model_is_loaded(folder: Path) -> None:
    release = threading.Event()

    def slow_load() -> Any:
        release.wait(20)
        return ortpipe.load(folder, threads=1)

    s = Served(folder, load=slow_load)
    s.start()
    try:
        assert s.get("/health") == (503, '{"status":"loading"}')
        with pytest.raises(openai.InternalServerError) as info:
            s.client(max_retries=0).chat.completions.create(model=MODEL, messages=USER)
        assert info.value.status_code == 503
        release.set()
        until(lambda: s.get("/health")[0] == 200)
        assert s.client().chat.completions.create(model=MODEL, messages=USER, max_tokens=2).choices
    finally:
        s.stop()


# --- load ------------------------------------------------------------------------------------------------


def test_twenty_concurrent_streams_each_equal_the_request_alone(folder: Path, pipe: Any) -> None:
    sampled = {"temperature": 0.8, "top_p": 0.9}
    requests = [
        (f"def task_{i}(queue):", 100 - 3 * i, {"temperature": 0} if i % 4 else {**sampled, "seed": i})
        for i in range(20)
    ]
    start = threading.Barrier(len(requests))  # the clients send together, so that some wait together
    with served(folder, max_batch=4, max_queue=32, delay=0.002) as s:
        client = s.client(max_retries=0)

        def stream(request: tuple[str, int, dict]) -> tuple[str, str | None]:
            prompt, max_tokens, settings = request
            messages = [{"role": "user", "content": prompt}]
            start.wait(timeout=60)
            text, finish, _ = chat_text(
                client.chat.completions.create(
                    model=MODEL, messages=messages, max_tokens=max_tokens, stream=True, **settings
                )
            )
            return text, finish

        with ThreadPoolExecutor(20) as pool:
            results = list(pool.map(stream, requests))
        metrics = s.metrics()
        assert type(s.engine.scheduler).__name__ == "Batched"  # one batched decoder run for all rows
        assert s.engine.scheduler.batch.steps > 0
        assert 0 < s.engine.scheduler.batch.prefills < 20  # requests admitted together prefilled together

    for (prompt, max_tokens, settings), got in zip(requests, results, strict=True):
        options = {"do_sample": True, **settings} if "seed" in settings else {}
        prompt = render(folder, [{"role": "user", "content": prompt}])
        assert got == alone(pipe, prompt, max_tokens, **options)
    finished = sum(v for k, v in metrics.items() if k.startswith("ortpipe_requests_total"))
    assert finished == 20 and metrics['ortpipe_requests_total{finish_reason="error"}'] == 0
    assert metrics["ortpipe_batch_rows"] == 0 and metrics["ortpipe_queue_length"] == 0
    assert metrics["ortpipe_batch_occupancy"] > 0.25  # rows did run side by side


def test_an_optimum_concat_export_is_batched_too(llama_concat: Path) -> None:
    """Rows of a concat cache (present = past + new) of different lengths, padded on the left in the
    batch: each completion equals the request alone."""
    reference = ortpipe.load(llama_concat, threads=1)
    sampled = {"temperature": 0.8, "top_p": 0.9}
    requests = [  # prompts of different lengths; every third sampled with its own seed
        ("def " + "spam_" * (1 + 3 * i) + "(x):", 30 - i,
         {"temperature": 0} if i % 3 else {**sampled, "seed": i})
        for i in range(8)
    ]
    with served(llama_concat, max_batch=4, max_queue=16, delay=0.002) as s:
        client = s.client(max_retries=0)

        def complete(request: tuple[str, int, dict]) -> str:
            prompt, max_tokens, settings = request
            chunks = client.completions.create(
                model=MODEL, prompt=prompt, max_tokens=max_tokens, stream=True, **settings
            )
            return "".join(c.choices[0].text for c in chunks if c.choices)

        with ThreadPoolExecutor(8) as pool:
            texts = list(pool.map(complete, requests))
        assert type(s.engine.scheduler).__name__ == "Batched"
        assert s.engine.scheduler.batch.steps > 0
        assert s.metrics()["ortpipe_batch_occupancy"] > 0.25
    for (prompt, max_tokens, settings), text in zip(requests, texts, strict=True):
        options = {"do_sample": True, **settings} if "seed" in settings else {}
        assert text == reference.generate(prompt, max_new_tokens=max_tokens, **options).text


def test_a_client_that_disconnects_frees_its_row_and_its_queue_place(folder: Path, pipe: Any) -> None:
    with served(folder, max_batch=1, max_queue=1, delay=0.02) as s:
        client = s.client(max_retries=0)
        long = client.chat.completions.create(
            model=MODEL, messages=USER, max_tokens=400, stream=True, stop=["\x01never"]
        )  # a stop string: one token per step
        next(iter(long))
        gave_up: list[Exception] = []

        def impatient() -> None:  # queued behind the long one, then gone after 0.5 s
            try:
                client.with_options(timeout=0.5).chat.completions.create(
                    model=MODEL, messages=USER, max_tokens=5
                )
            except openai.APITimeoutError as e:
                gave_up.append(e)

        waiting = threading.Thread(target=impatient)
        waiting.start()
        until(lambda: s.metrics()["ortpipe_queue_length"] == 1)
        with pytest.raises(openai.RateLimitError):
            client.chat.completions.create(model=MODEL, messages=USER, max_tokens=5)
        waiting.join()
        assert gave_up
        until(lambda: s.metrics()["ortpipe_queue_length"] == 0)
        long.close()  # the client leaves mid-stream
        r = client.chat.completions.create(model=MODEL, messages=USER, max_tokens=8, temperature=0)
        assert r.choices[0].message.content == alone(pipe, render(folder, USER), 8)[0]
        metrics = s.metrics()
    assert metrics['ortpipe_requests_total{finish_reason="interrupt"}'] == 1
    assert metrics["ortpipe_requests_rejected_total"] == 1


def test_a_request_s_choices_leave_together(folder: Path, pipe: Any) -> None:
    """n choices are queued all or none (a 429 leaves none behind), and a client that leaves frees every
    one of its rows and queue places."""
    with served(folder, max_batch=2, max_queue=2, delay=0.02) as s:
        client = s.client(max_retries=0)
        long = client.chat.completions.create(
            model=MODEL, messages=USER, max_tokens=400, stream=True, stop=["\x01never"], n=3
        )  # two rows generating, the third queued
        next(iter(long))
        until(lambda: s.metrics()["ortpipe_queue_length"] == 1)
        with pytest.raises(openai.RateLimitError):  # one place is left: two choices do not fit
            client.chat.completions.create(model=MODEL, messages=USER, max_tokens=5, n=2)
        assert s.metrics()["ortpipe_queue_length"] == 1
        long.close()  # the client leaves mid-stream
        until(lambda: s.metrics()["ortpipe_queue_length"] == 0)
        r = client.chat.completions.create(model=MODEL, messages=USER, max_tokens=8, temperature=0, n=2)
        assert [c.message.content for c in r.choices] == [alone(pipe, render(folder, USER), 8)[0]] * 2
        metrics = s.metrics()
    assert metrics["ortpipe_requests_rejected_total"] == 1
    # the long request's two generating rows ended when its client left, not after their 400 steps
    assert metrics['ortpipe_requests_total{finish_reason="interrupt"}'] == 2
    assert metrics['ortpipe_requests_total{finish_reason="length"}'] == 2  # the two choices after it


def test_beyond_the_queue_limit_requests_get_429_and_the_rest_succeed(folder: Path, pipe: Any) -> None:
    prompts = [f"def handler_{i}(event):" for i in range(12)]
    with served(folder, max_batch=1, max_queue=2, delay=0.01) as s:
        client = s.client(max_retries=0)

        def complete(prompt: str) -> Any:
            try:
                return client.completions.create(
                    model=MODEL, prompt=prompt, max_tokens=20, temperature=0, stop=["\x01never"], stream=True
                )
            except openai.RateLimitError as e:
                return e

        with ThreadPoolExecutor(12) as pool:
            answers = list(pool.map(complete, prompts))
            texts = list(
                pool.map(
                    lambda a: (
                        a if isinstance(a, Exception) else "".join(c.choices[0].text for c in a if c.choices)
                    ),
                    answers,
                )
            )
        assert s.get("/health")[0] == 200
    refused = [t for t in texts if isinstance(t, Exception)]
    assert refused and len(refused) <= 12 - 3
    for e in refused:
        assert e.status_code == 429 and int(e.response.headers["retry-after"]) >= 1
        assert e.body["code"] == "rate_limit_exceeded"
    for prompt, text in zip(prompts, texts, strict=True):
        if not isinstance(text, Exception):
            assert text == alone(pipe, prompt, 20)[0]


def test_a_conversation_continues_its_cached_prompt(server: Served, folder: Path, pipe: Any) -> None:
    client = server.client()
    first = [{"role": "user", "content": "def read_config(path):"}]
    r1 = client.chat.completions.create(model=MODEL, messages=first, max_tokens=12, temperature=0)
    second = [
        *first,
        {"role": "assistant", "content": r1.choices[0].message.content},
        {"role": "user", "content": "Now write it to a file."},
    ]
    r2 = client.chat.completions.create(model=MODEL, messages=second, max_tokens=12, temperature=0)
    assert r2.choices[0].message.content == alone(pipe, render(folder, second), 12)[0]
    assert r2.usage.prompt_tokens_details.cached_tokens >= len(pipe.tokenizer.encode(render(folder, first)))
    assert r2.usage.prompt_tokens == len(pipe.tokenizer.encode(render(folder, second)))


def test_a_cached_conversation_serves_other_settings_and_seeds(
    server: Served, folder: Path, pipe: Any
) -> None:
    """The next turn may change its sampling settings or ask for a seed: it still continues the cached
    prompt (a fresh sampler, the seed starting over) and gives what the request gives alone."""
    client = server.client()
    first = [{"role": "user", "content": "def parse_args(argv):"}]
    r1 = client.chat.completions.create(model=MODEL, messages=first, max_tokens=10, temperature=0)
    turn = [*first, {"role": "assistant", "content": r1.choices[0].message.content}]
    for i, settings in enumerate([{"temperature": 0.9, "top_p": 0.8, "seed": 11}, {"temperature": 0}]):
        turn = [*turn, {"role": "user", "content": f"And case {i}?"}]
        r = client.chat.completions.create(model=MODEL, messages=turn, max_tokens=10, **settings)
        prompt = render(folder, turn)
        options = {"do_sample": True, **settings} if "seed" in settings else {}
        assert r.choices[0].message.content == alone(pipe, prompt, 10, **options)[0]
        assert r.usage.prompt_tokens_details.cached_tokens > len(pipe.tokenizer.encode(render(folder, first)))
        turn = [*turn, {"role": "assistant", "content": r.choices[0].message.content}]


def test_penalties_and_logit_bias_equal_the_pipelines(server: Served, folder: Path,
                                                               pipe: Any) -> None:
    """OpenAI's penalties, through the `openai` client, in a batch of requests with and without them:
    each reply is what the pipeline gives for the same settings alone, and the penalties change it."""
    client = server.client()
    messages = [{"role": "user", "content": "def tokens(text):"}]
    prompt = render(folder, messages)
    first = pipe.generate(prompt, max_new_tokens=1).tokens[0]
    cases = [{}, {"frequency_penalty": 1.5}, {"presence_penalty": 2.0},
             {"frequency_penalty": -0.5, "presence_penalty": 1.0, "temperature": 0.8, "seed": 4},
             {"logit_bias": {str(first): -100, "40": 2.5}}]
    with ThreadPoolExecutor(len(cases)) as pool:
        replies = list(pool.map(lambda c: client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=32, **{"temperature": 0, **c}), cases))
    texts = []
    for settings, reply in zip(cases, replies, strict=True):
        options = {k: v for k, v in settings.items() if k != "temperature"}
        if "logit_bias" in options:
            options["logit_bias"] = {int(k): v for k, v in options["logit_bias"].items()}
        if "seed" in settings:
            options.update(do_sample=True, temperature=settings["temperature"])
        assert reply.choices[0].message.content == alone(pipe, prompt, 32, **options)[0], settings
        texts.append(reply.choices[0].message.content)
    assert len(set(texts)) == len(cases)


def test_n_choices_are_rows_of_the_batch_each_seeded_in_turn(server: Served, folder: Path, pipe: Any) -> None:
    """n choices: choice i is the request alone with seed + i (sampled), the same text for each when
    greedy; streamed, each chunk names its choice and the texts add up to the whole response's; the usage
    counts the prompt once and every choice's tokens."""
    client = server.client()
    messages = [{"role": "user", "content": "class Stack:"}]
    prompt = render(folder, messages)
    sampled = {"temperature": 0.9, "top_p": 0.95, "seed": 21}
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, n=3, **sampled)
    assert [c.index for c in whole.choices] == [0, 1, 2]
    alone_texts = [alone(pipe, prompt, 12, do_sample=True, temperature=0.9, top_p=0.95, seed=21 + i)[0]
                   for i in range(3)]
    assert [c.message.content for c in whole.choices] == alone_texts
    assert len(set(alone_texts)) == 3
    lengths = [len(pipe.generate(prompt, max_new_tokens=12, do_sample=True, temperature=0.9, top_p=0.95,
                                 seed=21 + i).tokens) for i in range(3)]
    assert whole.usage.completion_tokens == sum(lengths)
    assert whole.usage.prompt_tokens == len(pipe.tokenizer.encode(prompt))
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, n=3, stream=True,
                                            stream_options={"include_usage": True}, **sampled)
    chunks = list(stream)
    texts, finishes = ["", "", ""], [None, None, None]
    for c in chunks:
        for choice in c.choices:
            texts[choice.index] += choice.delta.content or ""
            finishes[choice.index] = choice.finish_reason or finishes[choice.index]
    assert texts == alone_texts
    assert finishes == [c.finish_reason for c in whole.choices]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == sum(lengths)
    greedy = client.completions.create(model=MODEL, prompt="def area(r):", max_tokens=8, n=2, temperature=0)
    assert greedy.choices[0].text == greedy.choices[1].text == alone(pipe, "def area(r):", 8)[0]


def test_best_of_returns_the_candidates_with_the_highest_mean_logprob(server: Served, pipe: Any) -> None:
    """best_of: candidate i is the request alone with seed + i; the n returned are those whose tokens' mean
    log-probability (the pipeline's own logprobs) is highest, best first; the usage counts every candidate;
    without logprobs asked, none are returned."""
    client = server.client(max_retries=0)
    sampled = {"temperature": 1.0, "seed": 40}
    prompt = "def area(r):"
    candidates = [list(pipe.stream(prompt, max_new_tokens=10, do_sample=True, temperature=1.0, seed=40 + i,
                                   logprobs=0)) for i in range(4)]
    texts = ["".join(c.text for c in chunks) for chunks in candidates]
    means = [sum(c.logprob for c in chunks) / len(chunks) for chunks in candidates]
    ranked = sorted(range(4), key=lambda i: -means[i])
    assert len({round(m, 6) for m in means}) == 4  # the ranking is not a tie
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=10, best_of=4, n=2, **sampled)
    assert [c.text for c in r.choices] == [texts[i] for i in ranked[:2]]
    assert [c.index for c in r.choices] == [0, 1] and all(c.logprobs is None for c in r.choices)
    assert r.usage.completion_tokens == sum(len(chunks) for chunks in candidates)
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=10, best_of=4, logprobs=1, **sampled)
    assert r.choices[0].text == texts[ranked[0]] and r.choices[0].logprobs is not None
    for options, says in (({"best_of": 1, "n": 2}, "at least n"),
                          ({"best_of": 2, "stream": True}, "streamed"), ({"best_of": 129}, "maximum value"),
                          ({"best_of": 2, "extra_body": {"prompt_lookup_num_tokens": 3}}, "speculate")):
        with pytest.raises(openai.BadRequestError) as info:
            client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, **options)
        assert info.value.body["param"] == "best_of" and says in info.value.body["message"]


# --- the command -----------------------------------------------------------------------------------------


def test_a_port_it_cannot_listen_on_is_a_clear_error(folder: Path, tmp_path: Path) -> None:
    """A port taken or out of range (serve and web): the command says so, with no traceback and no
    'bug in ortpipe' (an OSError and an OverflowError showed through before)."""
    taken = socket.create_server(("127.0.0.1", 0))
    port = taken.getsockname()[1]
    (tmp_path / "worker.js").write_text("")  # enough of a bundle for `ortpipe web`
    try:
        for command in (["serve", str(folder)], ["web", str(tmp_path)]):
            done = subprocess.run([sys.executable, "-m", "ortpipe.cli", *command, "--port", str(port)],
                                  capture_output=True, text=True, timeout=60)
            assert done.returncode != 0, done.stderr
            assert f"cannot listen on 127.0.0.1 port {port}: Address already in use" in done.stderr
            assert "bug in ortpipe" not in done.stderr and "Traceback" not in done.stderr
            done = subprocess.run([sys.executable, "-m", "ortpipe.cli", *command, "--port", "65536"],
                                  capture_output=True, text=True, timeout=60)
            wanted = "a port is a whole number from 0 (a free one) to 65535, not '65536'"
            assert done.returncode == 2 and wanted in done.stderr, done.stderr
    finally:
        taken.close()


@pytest.mark.parametrize(("flag", "value", "low"), [("--max-batch", "0", 1), ("--max-queue", "-1", 0),
                                                    ("--prompt-cache", "-1", 0)])
def test_counts_out_of_range_are_refused_by_the_command(folder: Path, flag: str, value: str,
                                                       low: int) -> None:
    command = [sys.executable, "-m", "ortpipe.cli", "serve", str(folder), "--port", "0", flag, value]
    done = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr  # a ValueError from the engine, 'a bug in ortpipe', before
    assert f"argument {flag}: a whole number from {low} up, not '{value}'" in done.stderr


def test_the_benchmark_command_says_why_it_cannot_measure(tmp_path: Path) -> None:
    """No server at --url, a --url that is no http URL, a folder the server cannot load: each a message
    naming the cause (RuntimeErrors read as 'a bug in ortpipe' before; the server's reason was lost)."""
    def bench(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "ortpipe.cli", "bench", "--serve", *args],
                              capture_output=True, text=True, timeout=120)

    closed = socket.create_server(("127.0.0.1", 0))
    port = closed.getsockname()[1]
    closed.close()
    done = bench("--url", f"http://127.0.0.1:{port}", "--streams", "1", "--rounds", "1")
    assert done.returncode == 1 and "requests failed at 1 streams" in done.stderr, done.stderr
    done = bench("--url", "notaurl")
    assert done.returncode == 2 and "--url takes a server's http:// URL" in done.stderr, done.stderr
    missing = tmp_path / "missing"
    done = bench(str(missing), "--streams", "1", "--rounds", "1")
    assert f"ortpipe serve exited with 2 while loading {missing}: " in done.stderr
    assert "does not exist or is not a directory" in done.stderr and "bug in ortpipe" not in done.stderr


def test_the_serve_command_listens_logs_each_request_and_stops(folder: Path) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "ortpipe.cli", "serve", str(folder), "--port", "0", "--max-batch", "2"],
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        url = re.search(r"http://127\.0\.0\.1:\d+", proc.stderr.readline()).group(0)
        until(lambda: raw(url, "GET", "/health")[0] == 200)
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused")
        r = client.completions.create(model=MODEL, prompt="import os", max_tokens=4)
        line = proc.stderr.readline()
        fields = r"prompt=\d+ cached=\d+ completion=\d+ ttft=[\d.]+ms [\d.]+ tokens/s finish=(length|stop)"
        assert re.search(rf"{r.id} {fields}", line), line
    finally:
        proc.send_signal(signal.SIGINT)  # uvicorn shuts down, then passes the interrupt on: 130, no traceback
        assert proc.wait(15) == 130
        assert "Traceback" not in proc.stderr.read()
        proc.stderr.close()


def test_serve_loads_with_the_profile_and_providers_asked_for(folder: Path) -> None:
    """--profile and --ep reach the load: an unknown profile, or a provider this environment lacks, is the
    load's ConfigError."""
    command = [sys.executable, "-m", "ortpipe.cli", "serve", str(folder), "--port", "0"]
    out = subprocess.run([*command, "--profile", "raspberri-pi"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and 'Unknown profile "raspberri-pi"' in out.stderr
    assert 'Did you mean "raspberry-pi"?' in out.stderr
    command += ["--profile", "raspberry-pi", "--ep", "qnn"]
    out = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and 'pip install "ortpipe[qnn]" installs it' in out.stderr


# --- logprobs --------------------------------------------------------------------------------------------


def test_logprobs_in_chat_and_completions_equal_the_pipelines(
    server: Served, pipe: Any, folder: Path
) -> None:
    """The chosen tokens' log-probabilities and their alternatives, in OpenAI's two shapes, are what
    pipe.generate gives (tests/test_sampling.py checks those against a hand computation)."""
    client = server.client(max_retries=0)
    prompt = render(folder, USER)
    expected = list(pipe.stream(prompt, max_new_tokens=6, logprobs=2))
    name = lambda t: pipe.tokenizer.decode([t], skip_special_tokens=False)  # noqa: E731
    chat = client.chat.completions.create(
        model=MODEL, messages=USER, max_tokens=6, temperature=0, logprobs=True, top_logprobs=2
    )
    content = chat.choices[0].logprobs.content
    assert [e.token for e in content] == [name(c.token) for c in expected]
    assert [e.logprob for e in content] == pytest.approx([c.logprob for c in expected], abs=1e-5)
    assert [[t.token for t in e.top_logprobs] for e in content] == [
        [name(t) for t, _ in c.top_logprobs] for c in expected
    ]
    streamed = [
        e
        for chunk in client.chat.completions.create(
            model=MODEL,
            messages=USER,
            max_tokens=6,
            temperature=0,
            logprobs=True,
            top_logprobs=2,
            stream=True,
        )
        if chunk.choices and chunk.choices[0].logprobs
        for e in chunk.choices[0].logprobs.content
    ]
    assert [e.token for e in streamed] == [e.token for e in content]
    text = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0, logprobs=2)
    logprobs = text.choices[0].logprobs
    assert logprobs.tokens == [name(c.token) for c in expected]
    assert logprobs.token_logprobs == pytest.approx([c.logprob for c in expected], abs=1e-5)
    assert [list(d) for d in logprobs.top_logprobs] == [
        [name(t) for t, _ in c.top_logprobs] for c in expected
    ]
    assert logprobs.text_offset == [sum(len(t) for t in logprobs.tokens[:i]) for i in range(len(expected))]
    plain = client.chat.completions.create(model=MODEL, messages=USER, max_tokens=6, temperature=0)
    assert (
        plain.choices[0].logprobs is None
        and plain.choices[0].message.content == chat.choices[0].message.content
    )


def test_the_serve_benchmark_command_reports_each_level(folder: Path) -> None:
    """`ortpipe bench --serve` starts a server, sends every level's streams and reports what they got (its
    times are not checked: this machine is shared)."""
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "ortpipe.cli",
            "bench",
            "--serve",
            str(folder),
            "--streams",
            "1,3",
            "--rounds",
            "2",
            "--prompt-tokens",
            "8",
            "--new-tokens",
            "5",
            "--threads",
            "1",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    levels = json.loads(done.stdout)["levels"]
    assert [(lv["streams"], lv["requests"], lv["tokens"]) for lv in levels] == [(1, 2, 10), (3, 6, 30)]
    assert all(lv["tokens_per_s"] > 0 and lv["ttft_p50_ms"] > 0 for lv in levels)
    wrong = subprocess.run(
        [sys.executable, "-m", "ortpipe.cli", "bench", "--serve", str(folder), "--streams", "x"],
        capture_output=True,
        text=True,
    )
    assert wrong.returncode == 2 and "--streams takes positive counts" in wrong.stderr
    tiny = subprocess.run(
        [sys.executable, "-m", "ortpipe.cli", "bench", "--serve", str(folder), "--vocab", "3"],
        capture_output=True,
        text=True,
    )
    assert tiny.returncode == 2 and "--vocab must be at least 4" in tiny.stderr


def test_the_load_generator_draws_the_same_prompts_for_any_server(monkeypatch: pytest.MonkeyPatch) -> None:
    """A level's prompts depend on its seed and `--vocab` only, so ortpipe and another server (`--url`) get
    the same requests; ids span the vocabulary given."""
    from ortpipe.serve import load

    sent: dict[str, list[list[int]]] = {}

    def fake(url: str, prompt: list[int], new_tokens: int, api_key: str | None) -> load.Sample:
        sent.setdefault(url, []).append(prompt)
        return load.Sample(0.01, 0.02, new_tokens)

    monkeypatch.setattr(load, "one_request", fake)
    for url in ("http://ortpipe", "http://other"):
        level = load.run_level(url, 2, 2, 6, 3, 32000, None)
        assert (level.requests, level.tokens) == (4, 12)
    assert sorted(sent["http://ortpipe"]) == sorted(sent["http://other"])
    assert max(max(p) for p in sent["http://ortpipe"]) >= 256


# --- speculative decoding ------------------------------------------------------------------------------


def _drafted(s: Served) -> float:
    return s.metrics()["ortpipe_speculative_drafted_tokens_total"]


@pytest.mark.parametrize("layout", ["shared", "concat"])
def test_a_request_alone_speculates_and_concurrent_ones_batch(layout: str, folder: Path, pipe: Any,
                                                              monkeypatch: pytest.MonkeyPatch,
                                                              request: pytest.FixtureRequest) -> None:
    """--prompt-lookup-num-tokens: a request alone leaves the batch and checks its drafts several tokens a
    run; when others come it joins the batch again, one token a run, and leaves it once it is alone again.
    Every text equals the request alone without speculation (fp32 graphs: greedy tokens are the same; a
    seeded sampled one draws each position's uniform either way). Both cache layouts the batch takes: the
    builder's shared buffer and Optimum's concat cache."""
    from ortpipe.loops.batched import Batch

    if layout == "concat":
        folder = request.getfixturevalue("llama_concat")
        pipe = ortpipe.load(folder, threads=1)

    from ortpipe.serve.engine import Batched

    alone_with: list[int] = []  # how many requests were open each time one ran alone
    step_alone = Batched._step_alone

    def noted(self: Batched, job: Any, row: Any) -> None:
        alone_with.append(len(self.open))
        step_alone(self, job, row)

    monkeypatch.setattr(Batched, "_step_alone", noted)
    moves, left = Counter(), set()  # leave: rows that left the batch; rejoin: rows that joined it after
    originals = {"join": Batch.join, "leave": Batch.leave}
    for name in originals:
        def counted(self: Batch, gen: Any, _name: str = name) -> Any:
            _original = originals[_name]
            if _name == "leave":
                moves["leave"] += 1
                left.add(id(gen))
            elif id(gen) in left:
                moves["rejoin"] += 1
            return (yield from _original(self, gen))

        monkeypatch.setattr(Batch, name, counted)
    repeated = "def spam(eggs):\n    return eggs + 1\n\n" * 3 + "def spam("
    with served(folder, max_batch=4, max_queue=16, settings={"prompt_lookup_num_tokens": 8}) as s:
        client = s.client(max_retries=0)
        r = client.completions.create(model=MODEL, prompt=repeated, max_tokens=60, temperature=0)
        assert r.choices[0].text == alone(pipe, repeated, 60)[0]
        alone_drafted = _drafted(s)
        assert alone_drafted > 0 and s.metrics()["ortpipe_speculative_accepted_tokens_total"] > 0
        assert moves == {"leave": 1}  # prefilled as a row, then alone

        r = client.completions.create(model=MODEL, prompt=repeated, max_tokens=60, temperature=0,
                                      extra_body={"prompt_lookup_num_tokens": 0})  # this request: none
        assert r.choices[0].text == alone(pipe, repeated, 60)[0]
        assert _drafted(s) == alone_drafted

        step = s.engine.scheduler.step

        def slowed() -> None:  # a request alone waits long enough for the others to come
            time.sleep(0.3 if s.engine.scheduler.rows == 1 else 0.002)
            step()

        s.engine.scheduler.step = slowed
        moves.clear()  # from here on no prompt continues a cached one (they start otherwise)
        left.clear()
        long = "# long\n" + repeated
        first = client.completions.create(model=MODEL, prompt=long, max_tokens=300, temperature=0,
                                          stream=True, stop=["\x01never"])
        chunks = iter(first)
        head = next(chunks).choices[0].text  # it runs alone now
        requests = [(f"# {i}\n" + repeated, 30 + 5 * i, {"temperature": 0} if i % 2 else {"temperature": 0.8,
                                                                                      "seed": i})
                    for i in range(4)]

        def complete(request: tuple[str, int, dict]) -> str:
            prompt, max_tokens, settings = request
            stream = client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, stream=True,
                                               **settings)
            return "".join(c.choices[0].text for c in stream if c.choices)

        with ThreadPoolExecutor(4) as pool:
            texts = list(pool.map(complete, requests))
        text = head + "".join(c.choices[0].text for c in chunks if c.choices)
        assert s.engine.scheduler.batch.steps > 0  # the others ran as rows of the batch
    assert moves["rejoin"] >= 1  # the first request joined the batch again when the others came
    assert max(alone_with) > 1  # probes: a speculating row ran alone while others were open
    assert text == alone(pipe, long, 300)[0]
    for (prompt, max_tokens, settings), got in zip(requests, texts, strict=True):
        options = {"do_sample": True, **settings} if "seed" in settings else {}
        assert got == pipe.generate(prompt, max_new_tokens=max_tokens, **options).text


@pytest.fixture(scope="module")
def concat_folder(llama_concat: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Optimum's concat export with the chat template of `folder`."""
    return with_template(llama_concat, tmp_path_factory)


def test_concurrent_speculating_requests_check_their_drafts_in_one_run(
        concat_folder: Path, monkeypatch: pytest.MonkeyPatch, unclocked: None) -> None:
    """On a concat cache (Optimum's exports) speculating requests that are rows of the batch check their
    drafts together, several positions a row in one run. Each text equals the request alone without
    speculation, a stop string inside an accepted run included (the tokens after it are taken back), and so
    does the next request that continues one of them from the prompt cache. The drafts are each reply's
    prediction (the reply alone), so that runs of many tokens are accepted."""
    from ortpipe.loops.batched import Batch
    from ortpipe.serve.engine import Batched

    pipe = ortpipe.load(concat_folder, threads=1)
    monkeypatch.setattr(Batched, "_speculating_turn", lambda self: [])  # never alone: rows of the batch
    checked: list[list[int]] = []
    taken_back: list[int] = []
    verify, take_back = Batch._verify, Batched._take_back

    def noted(self: Batch, drafts: list[list[int]]) -> Any:
        checked.append([len(d) for d in drafts])
        return (yield from verify(self, drafts))

    def counted(self: Batched, job: Any, row: Any, n: int) -> None:
        taken_back.append(n)
        take_back(self, job, row, n)

    monkeypatch.setattr(Batch, "_verify", noted)
    monkeypatch.setattr(Batched, "_take_back", counted)
    asks = [[{"role": "user", "content": f"# {i}\ndef spam(eggs):\n    return eggs + 1\n"}] for i in range(4)]
    plain = [alone(pipe, render(concat_folder, m), 48)[0] for m in asks]

    def late_stop(text: str) -> str:  # a piece of the text first found past its first quarter
        for at in range(len(text) // 4, len(text) - 1):
            for n in (3, 2, 1):
                piece = text[at : at + n]
                if len(piece) == n and "\ufffd" not in piece and text.find(piece) == at:
                    return piece
        raise AssertionError(f"no stop string for {text!r}")

    stops = [late_stop(text) if i % 2 else None for i, text in enumerate(plain)]
    expected = [alone(pipe, render(concat_folder, m), 48, **({"stop": [x]} if x else {}))[0]
                for m, x in zip(asks, stops, strict=True)]
    with served(concat_folder, max_batch=4, max_queue=16, settings={"prompt_lookup_num_tokens": 8}) as s:
        client = s.client(max_retries=0)
        step = s.engine.scheduler.step
        deadline = time.monotonic() + 10

        def gathered() -> None:  # the batch steps once the four requests are open
            if s.engine.scheduler.rows < 4 and not checked and time.monotonic() < deadline:
                time.sleep(0.01)  # the engine admits the next ones, then steps again
                return
            step()

        s.engine.scheduler.step = gathered

        def complete(i: int) -> str:
            r = client.chat.completions.create(model=MODEL, messages=asks[i], max_tokens=48, temperature=0,
                                               prediction={"type": "content", "content": plain[i]},
                                               **({"stop": [stops[i]]} if stops[i] else {}))
            return r.choices[0].message.content

        with ThreadPoolExecutor(4) as pool:
            got = list(pool.map(complete, range(4)))
        s.engine.scheduler.step = step
        follow = [*asks[1], {"role": "assistant", "content": got[1]}, {"role": "user", "content": "again"}]
        again = client.chat.completions.create(model=MODEL, messages=follow, max_tokens=16, temperature=0)
        assert again.usage.prompt_tokens_details.cached_tokens > 0  # it continued request 1's cache
    assert got == expected
    assert again.choices[0].message.content == alone(pipe, render(concat_folder, follow), 16)[0]
    assert any(sum(1 for n in row if n) > 1 for row in checked)  # several rows checked drafts in one run
    assert taken_back  # a stop string inside an accepted run


@pytest.fixture
def unclocked(monkeypatch: pytest.MonkeyPatch) -> None:
    """Draft lengths from the guessed costs of runs, not from the clock (tests/test_speculative.py): whether
    a round drafts then does not depend on how busy the machine is."""
    from ortpipe.loops.speculative import DraftLength

    monkeypatch.setattr(DraftLength, "timed", lambda *_: None)
    monkeypatch.setattr(DraftLength, "drafted", lambda *_: None)


def test_a_speculating_conversation_continues_its_cached_prompt(folder: Path, pipe: Any,
                                                                unclocked: None) -> None:
    """Prompt lookup keeps the prompt cache: the next turn prefills only its new tokens, and speculates."""
    with served(folder, settings={"prompt_lookup_num_tokens": 8}) as s:
        client = s.client(max_retries=0)
        first = [{"role": "user", "content": "def read_config(path):\n    return path\n" * 2}]
        r1 = client.chat.completions.create(model=MODEL, messages=first, max_tokens=24, temperature=0)
        second = [*first, {"role": "assistant", "content": r1.choices[0].message.content},
                  {"role": "user", "content": "def read_config(path):\n    return path\n" * 2}]
        drafted = _drafted(s)
        r2 = client.chat.completions.create(model=MODEL, messages=second, max_tokens=24, temperature=0)
        cached = r2.usage.prompt_tokens_details.cached_tokens
        assert cached >= len(pipe.tokenizer.encode(render(folder, first)))
        assert _drafted(s) > drafted
    assert r2.choices[0].message.content == alone(pipe, render(folder, second), 24)[0]


@pytest.fixture(scope="module")
def demo_fp32(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """models/demo with its int4 graph dequantized (onnx/model.onnx): a trained model, whose replies
    tokenize back to their own tokens (a prediction is text), on a graph where several tokens a run
    compute what one does."""
    import onnx
    from build import variants

    folder = tmp_path_factory.mktemp("demo") / "demo"
    shutil.copytree(REPO / "models" / "demo", folder)
    q4 = onnx.load(folder / "onnx" / "model_q4.onnx")
    variants.save(variants.dequantized(q4), folder / "onnx" / "model.onnx")
    return folder


def test_a_prediction_is_drafted_and_changes_no_token(demo_fp32: Path, unclocked: None) -> None:
    """Predicted Outputs: the reply is the one the request gives without (greedy and seeded sampled), and
    the prediction's drafts are counted in the usage; a wrong prediction has none taken. On chat's route in
    OpenAI's API; the demo has no chat template, so /v1/completions (ortpipe's, as chat's)."""
    reference = ortpipe.load(demo_fp32, threads=1, dtype="fp32")
    prompt = "import os\n\n\ndef read(path):\n"
    with served(demo_fp32, load=lambda: ortpipe.load(demo_fp32, threads=1, dtype="fp32")) as s:
        client = s.client(max_retries=0)
        for settings, options in (({"temperature": 0}, {"do_sample": False}),
                                  ({"temperature": 0.8, "seed": 7}, {"do_sample": True, "temperature": 0.8,
                                                                     "seed": 7})):
            expected = reference.generate(prompt, max_new_tokens=120, **options).text
            for content, right in ((expected, True), ("zzz " * 20, False)):
                predicted = {"prediction": {"type": "content", "content": content}}
                r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=120, **settings,
                                              extra_body=predicted)
                assert r.choices[0].text == expected
                details = r.usage.completion_tokens_details
                if right:
                    assert details.accepted_prediction_tokens > 80 and details.rejected_prediction_tokens <= 8
                else:
                    assert details.accepted_prediction_tokens == 0
        plain = client.completions.create(model=MODEL, prompt=prompt, max_tokens=20, temperature=0)
        assert plain.usage.completion_tokens_details.accepted_prediction_tokens == 0
        with pytest.raises(openai.BadRequestError) as info:  # longer than any reply: refused, not indexed
            long = {"prediction": {"type": "content", "content": "x = 1\n" * 2000}}
            client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, extra_body=long)
        assert info.value.body["param"] == "prediction" and "context" in info.value.body["message"]


def test_a_model_that_quantizes_a_run_with_one_scale_is_noted_when_rows_batch(
        folder: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The demo's q8 graph (dynamic int8 quantization: one activation scale a run) batches rows whose
    tokens may then differ from alone at near-ties: the server says so when it starts, and not for a
    float graph or a server of one row."""
    demo = REPO / "models" / "demo"
    caplog.set_level(logging.INFO, logger="ortpipe.serve")
    note = "quantizes a run's activations with one scale"
    said = {}
    for case, source, dtype, rows in (("q8, 4 rows", demo, "q8", 4), ("q8, 1 row", demo, "q8", 1),
                                      ("fp32, 4 rows", folder, None, 4)):
        caplog.clear()
        load = functools.partial(ortpipe.load, source, threads=1, dtype=dtype)
        with served(source, load=load, max_batch=rows):
            pass
        said[case] = [r.getMessage() for r in caplog.records if note in r.getMessage()]
    assert len(said["q8, 4 rows"]) == 1 and "(DynamicQuantizeLinear)" in said["q8, 4 rows"][0]
    assert said["q8, 1 row"] == [] and said["fp32, 4 rows"] == []


def test_speculating_rows_run_alone_when_alone_they_make_more_tokens_a_second() -> None:
    from ortpipe.serve.engine import alone_or_batched

    assert alone_or_batched([900.0], 0.0, False) == "alone"  # the only request
    assert alone_or_batched([500.0, 400.0], 300.0, False) == "alone"  # extractive: alone beats the batch
    assert alone_or_batched([200.0, 250.0], 300.0, False) == "batched"
    assert alone_or_batched([200.0, 250.0], 300.0, True) == "probe"  # a rate measured again now and then
    assert alone_or_batched([500.0, None], 300.0, False) == "alone"  # one not measured yet goes by the other
    assert alone_or_batched([200.0, None], 300.0, False) == "batched"
    assert alone_or_batched([200.0, None], 300.0, True) == "probe"
    assert alone_or_batched([None, None], 300.0, False) == "batched"  # nothing measured: nothing to choose by
    assert alone_or_batched([None, None], 300.0, True) == "probe"
    assert alone_or_batched([500.0, 400.0], 0.0, False) == "batched"  # the batch's rate not known yet


def test_a_draft_model_serves_and_per_request_lookup_is_refused_then(folder: Path, pipe: Any) -> None:
    from build import draft_models

    draft = str(draft_models.get("llama-draft-builder"))
    with served(folder, settings={"draft_model": draft, "max_draft_tokens": 4}) as s:
        client = s.client(max_retries=0)
        r = client.completions.create(model=MODEL, prompt="def ham(spam):", max_tokens=40, temperature=0)
        assert r.choices[0].text == alone(pipe, "def ham(spam):", 40)[0]
        assert _drafted(s) > 0
        # a prompt that continues a kept cache (ids: text would tokenize otherwise), its draft model's
        # cache started over (tests/test_lifecycle.py checks that it drafts)
        ids = pipe.tokenizer.encode("def ham(spam):")
        first = pipe.generate(prompt_ids=ids, max_new_tokens=20, do_sample=False)
        client.completions.create(model=MODEL, prompt=ids, max_tokens=20, temperature=0)
        more = [*ids, *first.tokens, 7]
        r = client.completions.create(model=MODEL, prompt=more, max_tokens=30, temperature=0)
        assert r.usage.prompt_tokens_details.cached_tokens >= len(ids) + 19
        assert r.choices[0].text == pipe.generate(prompt_ids=more, max_new_tokens=30, do_sample=False).text
        with pytest.raises(openai.BadRequestError) as info:
            client.completions.create(model=MODEL, prompt="def ham(spam):", max_tokens=4,
                                      extra_body={"prompt_lookup_num_tokens": 3})
        assert info.value.body["param"] == "prompt_lookup_num_tokens"
        assert "draft model" in info.value.body["message"]
        with pytest.raises(openai.BadRequestError) as info:
            client.completions.create(model=MODEL, prompt="def ham(spam):", max_tokens=4,
                                      extra_body={"prediction": {"type": "content", "content": "x"}})
        assert info.value.body["param"] == "prediction" and "draft model" in info.value.body["message"]


@pytest.mark.parametrize(("settings", "says"), [
    ({"prompt_lookup_num_tokens": 40}, "--prompt-lookup-num-tokens: prompt_lookup_num_tokens"),
    ({"draft_model": "/nonexistent/draft"}, "--draft-model /nonexistent/draft: "),
    ({"draft_model": "DRAFT", "prompt_lookup_num_tokens": 3}, "not both"),
])
def test_the_server_s_speculation_is_checked_before_it_serves(folder: Path, settings: dict,
                                                              says: str) -> None:
    from build import draft_models

    if settings.get("draft_model") == "DRAFT":
        settings = {**settings, "draft_model": str(draft_models.get("llama-draft-builder"))}
    engine = Engine(lambda: ortpipe.load(folder, threads=1), settings=settings)
    engine.start()
    until(lambda: engine.error is not None)
    assert isinstance(engine.error, ConfigError) and says in str(engine.error), engine.error
    assert not engine.loaded


def test_speculation_on_a_model_that_cannot_check_drafts_is_refused(gemma_builder: Path) -> None:
    engine = Engine(lambda: ortpipe.load(gemma_builder, threads=1), settings={"prompt_lookup_num_tokens": 4})
    engine.start()
    until(lambda: engine.error is not None)
    assert isinstance(engine.error, ConfigError), engine.error
    assert "cannot decode speculatively: its KV cache slides" in str(engine.error)


def test_speculation_for_a_folder_that_makes_no_text_is_refused(st_minilm: Path) -> None:
    engine = Engine(lambda: ortpipe.load(st_minilm, threads=1), settings={"prompt_lookup_num_tokens": 4})
    engine.start()
    until(lambda: engine.error is not None)
    assert isinstance(engine.error, ConfigError) and "--prompt-lookup-num-tokens" in str(engine.error)
    assert "makes embeddings, not text, and has no tokens to draft" in str(engine.error)


def storm(pipe: Any, model: Path, seed: int, n: int) -> list[dict[str, Any]]:
    """n seeded random chat requests and what each gives alone: prompts that repeat themselves (so lookup
    drafts), random lengths, stop strings found in the reply alone, predictions that are the reply alone,
    another reply or empty, greedy and seeded sampled, streamed or whole, a delay before each. The first
    four are greedy, long and predicted by their own replies, and start at once."""
    rng = random.Random(seed)
    words = ["spam", "eggs", "def", "return", "(eggs)", ":", "\n", "    ", "x", "+ 1"]
    cases: list[dict[str, Any]] = []
    for i in range(n):
        first = i < 4
        body = " ".join(rng.choice(words) for _ in range(rng.randint(2, 10)))
        messages = [{"role": "user", "content": f"# {i}\n" + body * rng.randint(1, 4)}]
        settings: dict[str, Any] = {"temperature": 0}
        if not first and rng.random() < 0.4:
            settings = {"temperature": 0.8, "seed": rng.randint(0, 99)}
        options = {"do_sample": True, **settings} if "seed" in settings else {}
        max_tokens = rng.randint(24 if first else 1, 40)
        reply, _ = alone(pipe, render(model, messages), max_tokens, **options)
        pieces = [reply[a : a + 2] for a in range(len(reply) // 3, len(reply) - 1)]
        pieces = [p for p in pieces if "\ufffd" not in p]
        if pieces and rng.random() < 0.5:
            settings["stop"] = [rng.choice(pieces)]
            options["stop"] = settings["stop"]
        roll = 0.0 if first else rng.random()
        prediction = reply if roll < 0.5 else (cases[-1]["reply"] if roll < 0.75 else "")
        if prediction or roll < 0.9:
            settings["prediction"] = {"type": "content", "content": prediction}
        cases.append({"messages": messages, "max_tokens": max_tokens, "settings": settings, "reply": reply,
                      "stream": rng.random() < 0.3, "delay": 0.0 if first else rng.random() * 0.3,
                      "expected": alone(pipe, render(model, messages), max_tokens, **options)})
    return cases


def ask(client: Any, case: dict[str, Any]) -> tuple[str, str | None]:
    """A storm's request, after its delay: its text and finish reason, streamed or whole."""
    time.sleep(case["delay"])
    create = functools.partial(client.chat.completions.create, model=MODEL, messages=case["messages"],
                               max_tokens=case["max_tokens"], **case["settings"])
    if not case["stream"]:
        r = create()
        return r.choices[0].message.content, r.choices[0].finish_reason
    text, finish = "", None
    for chunk in create(stream=True):
        for choice in chunk.choices:
            text += choice.delta.content or ""
            finish = choice.finish_reason or finish
    return text, finish


@pytest.mark.parametrize("layout", ["concat", "shared"])
def test_a_seeded_storm_of_speculating_requests_each_end_as_they_would_alone(
        layout: str, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch,
        unclocked: None) -> None:
    """Random concurrent requests (`storm`) on a speculating server, joining and leaving while others are
    mid-run: each ends with a 200 whose text and finish reason are the request's alone. On a concat cache
    the rows check their drafts together (never alone in turn here); on the builder's shared buffer, whose
    attention refuses that, speculating rows take turns alone and the rest batch."""
    from ortpipe.loops.batched import Batch
    from ortpipe.serve.engine import Batched

    model = request.getfixturevalue("concat_folder" if layout == "concat" else "folder")
    cases = storm(ortpipe.load(model, threads=1), model, 20261129, 16)
    if layout == "concat":
        monkeypatch.setattr(Batched, "_speculating_turn", lambda self: [])  # never alone: rows of the batch
    checked: list[list[int]] = []
    verify = Batch._verify

    def noted(self: Batch, drafts: list[list[int]]) -> Any:
        checked.append([len(d) for d in drafts])
        return (yield from verify(self, drafts))

    monkeypatch.setattr(Batch, "_verify", noted)
    with served(model, max_batch=4, max_queue=32, settings={"prompt_lookup_num_tokens": 8}) as s:
        step = s.engine.scheduler.step
        deadline = time.monotonic() + 10

        def gathered() -> None:  # the batch first steps once the first four are open, then as it comes
            if s.engine.scheduler.rows < 4 and not checked and time.monotonic() < deadline:
                time.sleep(0.01)
                return
            step()

        if layout == "concat":
            s.engine.scheduler.step = gathered
        client = s.client(max_retries=0)
        with ThreadPoolExecutor(6) as pool:
            got = list(pool.map(functools.partial(ask, client), cases))
        assert s.get("/health")[0] == 200
    for case, answer in zip(cases, got, strict=True):
        assert answer == case["expected"], case["settings"]
    if layout == "concat":  # rows checked their drafts together
        assert any(sum(1 for n in row if n) > 1 for row in checked)
    else:
        assert not checked
