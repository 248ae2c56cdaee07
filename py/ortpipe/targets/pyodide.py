"""The browser target: the core's work carried out by onnxruntime-web, from Python inside Pyodide.

The Web Worker (web/worker.js) boots Pyodide and hands `load` a bridge (web/bridge.js) over
onnxruntime-web, fetch, tokenizers.js and jinja. Tensors are ort.Tensor proxies wrapped in
`Tensor`; only small integer results (the selected token) are copied into Python.

Images arrive decoded by the worker (web/images.js): uint8 [h, w, 3] RGB ort.Tensors, which the
core's preprocessing kernels turn into the vision session's inputs, as under CPython.

onnxruntime-web has no IOBinding, so a shared-buffer KV cache (Run.inplace) is not updated in
place: the buffer is fed as past and the present output, the same size, becomes the buffer for
the next run. The tokens are the same; the cost is one buffer allocation per layer and step.

Plain greedy decode steps run fused (the core's `Decode`): a JS `Decoder` (web/bridge.js) keeps
the cache between steps and answers with the token ids, so Python wraps no tensor per cache entry
and step. It runs several steps per answer (a burst of at most `BURST_MS` in bridge.js), since each
crossing into Python and back costs about as much as the core's work on a token. The core's cache
dict then holds `CacheSlot`s that read the JS side's current tensors, for the generic runs that
may follow (a chat turn, a rewind).
"""

from __future__ import annotations

import asyncio
import json
import struct
import time
from pathlib import Path
from typing import Any

import js
from pyodide.ffi import JsException, JsProxy, to_js

from ..chat import Chat
from ..config import CONFIG_FILE, load_config
from ..config.schema import SessionSpec
from ..errors import ConfigError, GenerationError, OrtpipeError
from ..execute.work import KERNEL, Decode, Run, RunAll, Work
from ..pipeline import Chunk, Pipeline, Request
from ..plan import make_plan
from ..preprocess.request import media_inputs
from ..signature import Signature, TensorInfo
from ..tokenizer import TextStream

KERNEL_DIR = Path(__file__).resolve().parent.parent / "kernels"
# Small text files fetched up front (in parallel); any other file is fetched or probed on demand.
TEXT_FILES = (CONFIG_FILE, "config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json")
# Weights stored beside a graph: the model builder's name, then Optimum's.
EXTERNAL_DATA = ("{file}.data", "{file}_data")
# JS twins (web/bridge.js) of kernel graphs that run on every token, for CPU tensors: a session run
# costs more than the work. The browser tests compare their tokens with the CPython target's.
NATIVE_KERNELS = {f"{KERNEL}argmax_last_float32": "argmaxLast"}
# Preprocessing kernels run on wasm whatever the device: their inputs (decoded pixels, samples) are
# on the CPU, and they compute in float64, which neither WebGPU nor the CPU kernels of the WebGPU
# build have (the bridge makes them with the wasm build); on wasm they equal CPython's bit for bit.
CPU_KERNELS = tuple(f"{KERNEL}{name}" for name in ("resize_", "normalize_", "patchify_", "log_mel_"))


class Tensor:
    """An ort.Tensor handle. GPU-resident tensors are disposed as soon as Python drops them:
    onnxruntime-web frees a GPU buffer only on `dispose()`, never on JS garbage collection."""

    __slots__ = ("js", "gpu")

    def __init__(self, tensor: JsProxy, gpu: bool = False):
        self.js: JsProxy | None = tensor
        self.gpu = gpu

    def take(self, other: Tensor) -> None:
        """Become `other` (a shared-buffer cache's present becomes its next past)."""
        self._release()
        self.js, self.gpu = other.js, other.gpu
        other.js = None

    def _release(self) -> None:
        if self.gpu and self.js is not None:
            self.js.dispose()

    def __del__(self) -> None:
        self._release()


class CacheSlot:
    """A KV cache entry a JS Decoder holds between fused decode steps: `js` is its current tensor.
    The decoder owns the tensor; dropping the slot disposes it there (GPU buffers)."""

    __slots__ = ("decoder", "name")
    gpu = False

    def __init__(self, decoder: JsProxy, name: str):
        self.decoder, self.name = decoder, name

    @property
    def js(self) -> JsProxy:
        return self.decoder.current(self.name)

    def take(self, other: Tensor) -> None:
        """Become `other` (a generic run's shared-buffer present)."""
        self.decoder.put(self.name, other.js)
        other.js = None

    def __del__(self) -> None:
        self.decoder.drop(self.name)


def _half_bits(value: float) -> int:
    return struct.unpack("<H", struct.pack("<e", value))[0]


class WebBackend:
    """The core's tensor operations on ort.Tensor, through the bridge."""

    fused_decode = frozenset({"shared", "concat"})  # the cache layouts whose Decode the driver runs
    decode_burst = 64  # steps per Decode at most; the JS Decoder also stops after BURST_MS

    def __init__(self, bridge: JsProxy):
        self.bridge = bridge

    def tensor(self, values: list[int], shape: tuple[int, ...], dtype: str) -> Tensor:
        if dtype == "float16":
            values = [_half_bits(v) for v in values]
        return Tensor(self.bridge.tensor(dtype, to_js(values), to_js(list(shape))))

    def full(self, shape: tuple[int, ...], value: float, dtype: str) -> Tensor:
        fill = _half_bits(value) if dtype == "float16" else value
        return Tensor(self.bridge.full(dtype, to_js(list(shape)), fill))

    def shape(self, handle: Tensor) -> tuple[int, ...]:
        return tuple(handle.js.dims)

    def dtype(self, handle: Tensor) -> str:
        return str(handle.js.type)  # onnxruntime-web's names are numpy's: float32, int64, ...

    def to_list(self, handle: Tensor) -> list[int]:
        return self.bridge.toList(handle.js).to_py()


class RemoteFolder:
    """A model folder at a URL prefix (the Folder protocol of ortpipe.folder).

    The usual text files are fetched up front, where a 404 means absent; files the core asks about
    later (the ONNX files a config names, detection's candidates) are probed with synchronous
    requests, which a worker may make.
    """

    def __init__(self, bridge: JsProxy, url: str, texts: dict[str, str | None]):
        self.bridge, self.base = bridge, url
        self._texts = dict(texts)
        self._exists: dict[str, bool] = {}

    @classmethod
    async def fetch(cls, bridge: JsProxy, url: str) -> RemoteFolder:
        base = url if url.endswith("/") else url + "/"
        try:
            texts = await asyncio.gather(*(bridge.fetchText(base + name) for name in TEXT_FILES))
        except JsException as e:
            raise ConfigError(f"cannot read the model folder {base}: {e.message}") from None
        return cls(bridge, base, dict(zip(TEXT_FILES, texts, strict=True)))

    def url(self, name: str) -> str:
        return self.base + name

    def exists(self, name: str) -> bool:
        if name in self._texts:
            return self._texts[name] is not None
        if name not in self._exists:
            self._exists[name] = bool(self.bridge.existsSync(self.url(name)))
        return self._exists[name]

    def read_text(self, name: str) -> str:
        if name not in self._texts:
            self._texts[name] = self.bridge.fetchTextSync(self.url(name))
        text = self._texts[name]
        if text is None:
            raise ConfigError(f"{self.url(name)} does not exist")
        return text

    def describe(self, name: str = "") -> str:
        return self.url(name)


class JsTokenizer:
    """tokenizers.js over the folder's tokenizer.json (+ tokenizer_config.json).

    Decoding skips tokenizers.js's clean-up of spaces, which the Rust `tokenizers` used by the
    CPython target does not do, so both targets give the same text.
    """

    def __init__(self, tokenizer: JsProxy, bridge: JsProxy):
        self._tok, self._bridge = tokenizer, bridge
        self._decode_ids = tokenizer.decode  # a bound JS method, looked up once
        self._encode = {flag: _js_object({"add_special_tokens": flag}) for flag in (True, False)}
        self._decode = {flag: _js_object({"skip_special_tokens": flag, "clean_up_tokenization_spaces": False})
                        for flag in (True, False)}

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, self._encode[add_special_tokens]).ids.to_py()

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._decode_ids(to_js(ids), self._decode[skip_special_tokens])

    def text_stream(self) -> JsTextStream:
        return JsTextStream(self._bridge.textStream(self._tok, TextStream.WINDOW, TextStream.CONTEXT))


class JsTextStream:
    """The core's TextStream run by its JS twin (web/bridge.js): a burst of tokens crosses into JS
    once, not once per token with its window of ids."""

    def __init__(self, stream: JsProxy):
        self._push_many, self._flush = stream.pushMany, stream.flush

    def push_many(self, tokens: list[int]) -> list[str]:
        return json.loads(self._push_many(*tokens))

    def flush(self) -> str:
        return self._flush()


class JsChatTemplate:
    """tokenizer_config.json's chat_template, rendered by @huggingface/jinja."""

    def __init__(self, bridge: JsProxy, tokenizer_config: dict[str, Any]):
        source = tokenizer_config.get("chat_template")
        if isinstance(source, list):  # named templates: take the default one
            source = next((t.get("template") for t in source if t.get("name") == "default"), None)
        if not isinstance(source, str):
            raise GenerationError("tokenizer_config.json has no chat_template, which messages and chat need: "
                                  "give a prompt instead, or add the model's chat_template")
        tokens = {k: _token_text(tokenizer_config.get(k)) for k in ("bos_token", "eos_token")}
        try:
            self._render = bridge.chatTemplate(source, json.dumps(tokens))
        except JsException as e:
            raise GenerationError(f"the chat template does not parse: {e.message}") from None

    def render(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        try:
            return self._render(json.dumps(messages), add_generation_prompt)
        except JsException as e:
            raise GenerationError(f"the chat template refused the conversation: {e.message}") from None


def _token_text(value: Any) -> str:
    return value.get("content", "") if isinstance(value, dict) else (value or "")


def _js_object(mapping: dict[str, Any]) -> JsProxy:
    return to_js(mapping, dict_converter=js.Object.fromEntries)


class Driver:
    """Carries out the core's Run / RunAll requests on onnxruntime-web sessions.

    One run at a time: onnxruntime-web refuses overlapping runs of a session, and its WebGPU build
    suspends wasm calls (asyncify), which must not interleave; so a RunAll's runs go one after another.
    """

    def __init__(self, bridge: JsProxy, sessions: dict[str, JsProxy], device: str):
        self.bridge, self.device = bridge, device
        self.sessions = dict(sessions)
        self._gpu = device == "webgpu"
        self._decoders: dict[str, tuple[JsProxy, dict[str, Any], CacheSlot]] = {}

    async def drive(self, gen: Work) -> Any:
        """Answer a core generator's requests until it returns; its return value is ours."""
        try:
            work = next(gen)
            while True:
                work = gen.send(await self.execute(work))
        except StopIteration as stop:
            return stop.value

    async def execute(self, work: Run | RunAll | Decode) -> Any:
        if type(work) is Decode:
            return await self.decode(work)
        if isinstance(work, Run):
            return await self.run(work)
        return [await self.run(r) for r in work.runs]

    def decoder(self, d: Decode) -> JsProxy:
        """The JS Decoder of `d`'s request and session, started (taking over the cache) if needed."""
        decoder, cache, first = self._decoders.get(d.session) or (None, None, None)
        # The core's KVCache replaces all its entries at once (a generic step, a rewind): the first
        # entry tells whether the decoder still holds the cache.
        if cache is not d.cache or d.cache[next(iter(d.presents.values()))] is not first:
            decoder = self._start_decoder(d)
        return decoder

    async def decode(self, d: Decode) -> list[int]:
        """Greedy decode steps run by the session's JS Decoder, which holds the cache."""
        try:
            return (await self.decoder(d).burst(d.token, d.past, d.limit)).to_py()
        except JsException as e:
            raise OrtpipeError(e.message) from None  # the Decoder's message names the session and position

    def _start_decoder(self, d: Decode) -> JsProxy:
        """A JS Decoder for the request whose cache is `d.cache`, holding that cache from now on."""
        spec = {"name": d.session, "ids": list(d.ids), "mask": list(d.mask) if d.mask else None,
                "positions": list(d.positions) if d.positions else None, "presents": d.presents,
                "outputs": list(d.outputs), "logits": d.logits, "vocab": d.logits_shape[-1],
                "capacity": d.capacity, "eos": sorted(d.eos), "gpu": self._gpu}
        decoder = self.bridge.decoder(self.sessions[d.session], _js_object(spec))
        names = list(d.presents.values())
        tensors = []
        for name in names:
            entry = d.cache[name]
            tensors.append(entry.js)
            if isinstance(entry, CacheSlot):
                entry.decoder.forget(name)  # an earlier decoder's entry: this one owns it now
            else:
                entry.js = None
        decoder.seed(to_js(names), to_js(tensors))
        slots = {name: CacheSlot(decoder, name) for name in names}
        d.cache.update(slots)
        self._decoders[d.session] = (decoder, d.cache, slots[names[0]])
        return decoder

    async def run(self, work: Run) -> dict[str, Tensor]:
        twin = None if self._gpu else NATIVE_KERNELS.get(work.session)
        if twin is not None:
            return {work.outputs[0]: Tensor(getattr(self.bridge, twin)(*(t.js for t in work.feeds.values())))}
        session = self.sessions.get(work.session) or await self._kernel(work.session)
        values = await self._run_session(session, work)
        gpu = self._gpu and not work.session.startswith(KERNEL)
        outputs = {name: Tensor(value, gpu) for name, value in zip(work.outputs, values, strict=True)}
        for present, past in (work.inplace or {}).items():
            work.feeds[past].take(outputs.pop(present))
        return outputs

    async def _run_session(self, session: JsProxy, work: Run) -> JsProxy:
        names, tensors = to_js(list(work.feeds)), to_js([t.js for t in work.feeds.values()])
        try:
            return await self.bridge.run(session, names, tensors, to_js(work.outputs))
        except JsException as e:
            shapes = ", ".join(f"{k} {list(_dims(v))}" for k, v in work.feeds.items())
            raise OrtpipeError(f'session "{work.session}" failed: {e.message}\n  inputs: {shapes}') from None

    async def _kernel(self, name: str) -> JsProxy:
        if not name.startswith(KERNEL):
            raise OrtpipeError(f'no session "{name}" is loaded')
        path = KERNEL_DIR / f"{name[len(KERNEL):]}.onnx"
        device = "wasm" if name.startswith(CPU_KERNELS) else self.device
        options = {"name": name, "device": device, "gpuOutputs": False, "externalData": []}
        session = await self.bridge.createSession(to_js(path.read_bytes()), _js_object(options))
        self.sessions[name] = session
        return session


def _answer_json(chunks: list[Chunk], **answer: Any) -> str:
    return json.dumps({"chunks": [{"token": c.token, "text": c.text} for c in chunks], **answer})


def _dims(t: Tensor) -> tuple[int, ...]:
    return tuple(t.js.dims) if t.js is not None else ()


def signature_of(bridge: JsProxy, session: JsProxy) -> Signature:
    raw = json.loads(bridge.signature(session))

    def info(entry: dict[str, Any]) -> TensorInfo:
        return TensorInfo(entry["name"], entry["type"] or "unknown", tuple(entry["shape"] or ()))

    return Signature(tuple(map(info, raw["inputs"])), tuple(map(info, raw["outputs"])))


async def open_session(bridge: JsProxy, folder: RemoteFolder, spec: SessionSpec, device: str) -> JsProxy:
    """A session on `device` for every model session; the config's execution providers are for CPython."""
    weights = [folder.url(n) for n in (p.format(file=spec.file) for p in EXTERNAL_DATA) if folder.exists(n)]
    options = {"name": spec.file, "device": device, "gpuOutputs": device == "webgpu", "externalData": weights}
    try:
        return await bridge.createSession(folder.url(spec.file), _js_object(options))
    except JsException as e:
        raise ConfigError(f'session "{spec.name}" could not be created from {folder.url(spec.file)} '
                          f"on {device}: {e.message}") from None


class WebPipeline:
    """A loaded model, driven by the worker: `request_json`, then `step_begin` and what it answers.

    Generation settings (do_sample, temperature, top_k, top_p, seed, stop, num_beams, ...) default
    to the config's and can be given per request, as in the CPython target.
    """

    def __init__(self, core: Pipeline, driver: Driver, folder: RemoteFolder, load_ms: float):
        self.core, self.driver, self.folder, self.load_ms = core, driver, folder, load_ms
        self.plan, self.config, self.tokenizer = core.plan, core.config, core.tokenizer
        self.decoder: JsProxy | None = None  # the JS Decoder the worker runs (see step_begin)
        self._request: Request | None = None  # the request being generated (see step_begin)
        self._step: Work | None = None  # its step being pumped, and that step's pending work
        self._work: Run | RunAll | Decode | None = None

    async def request(self, prompt: str | None = None, *, prompt_ids: list[int] | None = None,
                      messages: list[dict[str, str]] | None = None, max_new_tokens: int | None = None,
                      max_length: int | None = None, images: list[Tensor] | None = None,
                      **settings: Any) -> Request:
        """`images`: decoded images, uint8 [h, w, 3] RGB tensors, preprocessed into the inputs the
        pipeline's sessions read."""
        if messages is not None:
            if prompt is not None or prompt_ids is not None:
                raise GenerationError("give one of prompt, prompt_ids and messages")
            prompt = self.chat_template().render(messages)
        ids = self.core.prompt_ids(prompt, prompt_ids)
        inputs = None
        if images:
            backend = self.core.backend
            decoded = [(image, *backend.shape(image)[:2]) for image in images]
            inputs = await self.driver.drive(media_inputs(self.plan, self.folder, backend, decoded, []))
        request = self.core.request(ids, max_new_tokens, max_length, inputs, **settings)
        request.timings.load_ms = self.load_ms
        return request

    def chat_template(self) -> JsChatTemplate:
        if not self.folder.exists("tokenizer_config.json"):
            raise GenerationError(f"{self.folder.url('tokenizer_config.json')} is missing: messages need its "
                                  "chat_template")
        config = json.loads(self.folder.read_text("tokenizer_config.json"))
        return JsChatTemplate(self.driver.bridge, config)

    def chat(self, max_length: int | None = None, **settings: Any) -> Chat:
        """A multi-turn chat over one KV cache, with the folder's chat template (see ortpipe.chat)."""
        if self.tokenizer is None:
            raise GenerationError(f"{self.folder.url('tokenizer.json')} is missing: chat needs the tokenizer")
        return Chat(self.core, self.chat_template(), max_length, **settings)

    # The worker's side (web/worker.js): JSON in and out, so no proxies outlive a call.

    def chat_json(self, options: str) -> Chat:
        return self.chat(**json.loads(options))

    def say_json(self, chat: Chat, options: str) -> Request:
        """The request of a user turn, {"content", "max_new_tokens"}: the worker streams it."""
        settings = json.loads(options)
        content = settings.pop("content", None)
        unknown = sorted(set(settings) - {"max_new_tokens"})
        if not isinstance(content, str):
            raise GenerationError("a chat turn needs its content: a string")
        if unknown:
            raise GenerationError(f"a chat turn takes content and max_new_tokens, not {', '.join(unknown)}; "
                                  "give the other settings when the chat is made")
        request = chat.say(content, settings.get("max_new_tokens"))
        request.timings.load_ms = self.load_ms
        return request

    async def rewind(self, chat: Chat) -> None:
        """Drop the chat's last turn (the user's message and the reply)."""
        await self.driver.drive(chat.rewind())

    def chat_tokens_json(self, chat: Chat) -> str:
        return json.dumps(chat.gen.tokens)

    def info_json(self) -> str:
        tokens = self.config.tokens
        return json.dumps({
            "device": self.driver.device, "sessions": sorted(self.plan.signatures), "eos": list(tokens.eos),
            "tokenizer": self.tokenizer is not None, "max_length": self.config.generation.max_length,
            "model_type": self.config.metadata.get("model_type"), "load_ms": round(self.load_ms, 1)})

    async def request_json(self, options: str, images: JsProxy | None = None) -> Request:
        """`images`: the worker's decoded images (uint8 [h, w, 3] ort.Tensors), in prompt order."""
        tensors = [Tensor(image) for image in images] if images else None
        return await self.request(**json.loads(options), images=tensors)

    # The worker's generation loop. Steps whose work is fused decode steps are pumped with
    # synchronous calls, which cost far less than an awaited coroutine per token: an answer
    # {"chunks", "decode": [token, past, limit]} has the worker run a burst of the JS Decoder
    # (`decoder`) and hand the ids to `step_decoded`, whose answer carries their chunks and the next
    # burst's decode. Other work answers {"chunks", "async": true}: the worker awaits `step_rest`,
    # which drives it. {"chunks", "done": true} ends the request.

    def step_begin(self, request: Request) -> str:
        self._request = request
        self.decoder = None  # the worker's loop starts without one: its first decode is fresh
        return self._answer(None, [], start=True)

    def step_decoded(self, *tokens: int) -> str:
        return self._answer(list(tokens), [], start=False)

    async def step_rest(self) -> str:
        gen, work = self._step, self._work
        try:
            while True:
                work = gen.send(await self.driver.execute(work))
        except StopIteration as stop:
            return self._answer(None, list(stop.value), start=True)

    def _answer(self, value: list[int] | None, chunks: list[Chunk], start: bool) -> str:
        """Run the request's steps until one needs a Decode or async work, or the request ends."""
        while True:
            if start:
                if self._request.done:
                    self._request = self._step = self._work = None  # the worker holds the request
                    return _answer_json(chunks, done=True)
                self._step, value = self._request.step(), None
            try:
                work = self._step.send(value)
            except StopIteration as stop:
                chunks += stop.value
                start = True
                continue
            self._work = work
            if type(work) is not Decode:
                return _answer_json(chunks, **{"async": True})
            decoder = self.driver.decoder(work)
            fresh = decoder is not self.decoder
            self.decoder = decoder
            return _answer_json(chunks, decode=[work.token, work.past, work.limit], fresh=fresh)

    def result_json(self, request: Request) -> str:
        return json.dumps(request.result().as_dict())


async def load(bridge: JsProxy, model_url: str, device: str) -> WebPipeline:
    """Load the model folder at `model_url` (v1 or v2 genai_config.json, or a detected export)
    on `device`, "wasm" or "webgpu"."""
    start = time.perf_counter()
    folder = await RemoteFolder.fetch(bridge, model_url)
    config = load_config(folder)
    used = {s.run for s in config.pipeline.flow}
    sessions = {}
    for name, spec in config.pipeline.sessions.items():
        if name in used and folder.exists(spec.file):
            sessions[name] = await open_session(bridge, folder, spec, device)
    plan = make_plan(config, {n: signature_of(bridge, s) for n, s in sessions.items()})
    core = Pipeline(plan, WebBackend(bridge), _tokenizer(bridge, folder))
    return WebPipeline(core, Driver(bridge, sessions, device), folder, (time.perf_counter() - start) * 1000)


def _tokenizer(bridge: JsProxy, folder: RemoteFolder) -> JsTokenizer | None:
    if not folder.exists("tokenizer.json"):
        return None
    config = folder.read_text("tokenizer_config.json") if folder.exists("tokenizer_config.json") else None
    return JsTokenizer(bridge.tokenizer(folder.read_text("tokenizer.json"), config), bridge)


__all__ = ["Driver", "RemoteFolder", "WebBackend", "WebPipeline", "load"]
