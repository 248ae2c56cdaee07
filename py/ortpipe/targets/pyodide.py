"""The browser target: the core driven by onnxruntime-web, from Python inside Pyodide.

The Web Worker (web/worker.js) boots Pyodide and calls `task(...)` here once per message it gets
(load, generate, chat, say, rewind). A `Task` turns the core's work into typed JSON answers, and
the worker is its one pump: it awaits what each answer asks for (a session run, a session to open,
a burst of fused decode steps of the JS `Decoder`) and hands the result back, until the answer is
`done` or an `error` ({type, message}). Python never awaits, and the worker never reads a traceback.

Tensors are ort.Tensor proxies wrapped in `Tensor`; only small integer results (the selected
token) are copied into Python. Images arrive decoded by the worker (web/images.js): uint8
[h, w, 3] RGB ort.Tensors, which the core's preprocessing kernels turn into model inputs.

onnxruntime-web has no IOBinding: a shared-buffer KV cache's present comes back as a new tensor,
which the core takes as the buffer for the next run (the same tokens; one buffer allocation per
layer and step). Plain greedy decode steps run fused in a JS `Decoder` (web/bridge.js) that keeps
the cache between steps and answers with the token ids, several steps per answer; the core's cache
then holds `CacheSlot`s that read the Decoder's current tensors, for the generic runs that may
follow (a chat turn, a rewind).
"""

from __future__ import annotations

import dataclasses
import json
import os
import posixpath
import struct
import traceback
from collections.abc import Mapping
from typing import Any

import js
from pyodide.ffi import JsException, JsProxy, to_js

from ..config.settings import SEARCH
from ..errors import ConfigError, GenerationError, OrtpipeError
from ..execute.work import (
    KERNEL,
    Decode,
    Decoded,
    Open,
    Opened,
    ReadGraph,
    ReadWheel,
    Run,
    RunAll,
    Select,
    Work,
    kernel,
)
from ..folder import decode_text, inside
from ..kernels import CPU_ONLY, kernel_file
from ..loops.stages import StageChunk
from ..model import Model, load_model
from ..outputs import OutputRequest, Progress
from ..request import Chunk, Request
from ..sampling.sampler import Sampler
from ..signature import Signature, TensorInfo
from ..templates import Renderer, TemplateFailure
from ..tokenizer import TextStream
from ..variants import dtype_of, optimized_ahead

# Weights stored beside a graph: the model builder's name, then Optimum's.
EXTERNAL_DATA = ("{file}.data", "{file}_data")
# JS twins (web/bridge.js) of kernel graphs that run on every token, for CPU tensors: a session run
# costs more than the work. The browser tests compare their tokens with the CPython target's.
NATIVE_KERNELS = {f"{KERNEL}argmax_last_float32": "argmaxLast"}
NON_FINITE = "the model's logits are NaN or infinite"  # web/sampling.js's Picker throws it


class Tensor:
    """An ort.Tensor handle. GPU-resident tensors are disposed as soon as Python drops them:
    onnxruntime-web frees a GPU buffer only on `dispose()`, never on JS garbage collection."""

    __slots__ = ("js", "gpu")

    def __init__(self, tensor: JsProxy, gpu: bool = False):
        self.js: JsProxy | None = tensor
        self.gpu = gpu

    def __del__(self) -> None:
        if self.gpu and self.js is not None:
            self.js.dispose()


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

    def __del__(self) -> None:
        self.decoder.drop(self.name)


def _half_bits(value: float) -> int:
    return struct.unpack("<H", struct.pack("<e", value))[0]


class WebBackend:
    """The core's tensor operations on ort.Tensor, through the bridge."""

    fused_layouts = frozenset({"shared", "concat"})  # the cache layouts whose Decode the worker runs
    decode_burst = 64  # steps per Decode at most; the JS Decoder also stops after BURST_MS
    fused_sampling = True  # the Decoder selects by a Decode's pick (web/sampling.js)
    fused_speculation = True  # the JS Speculator runs rounds of such requests too (web/speculate.js)
    row_views = False  # every tensor is a copy on the JS side: the browser serves no batch of rows

    def __init__(self, bridge: JsProxy):
        self.bridge = bridge
        self.speculation_costs: dict = {}  # loops/speculative.py: what runs cost here, kept across requests

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

    Files the core asks about are probed and fetched with synchronous requests, which a worker may
    make; the worker's early downloads (web/prefetch.js) answer the probes they already know.
    """

    def __init__(self, bridge: JsProxy, url: str):
        self.bridge = bridge
        self.base = url if url.endswith("/") else url + "/"
        self._texts: dict[str, str | None] = {}
        self._exists: dict[str, bool] = {}

    def locate(self, name: str) -> str:
        if not inside(name):
            raise ConfigError(f'"{name}" is not a path inside the model folder {self.base}')
        return self.base + name

    def exists(self, name: str) -> bool:
        if name in self._texts:
            return self._texts[name] is not None
        if name not in self._exists:
            self._exists[name] = bool(self.bridge.existsSync(self.locate(name)))
        return self._exists[name]

    def read_text(self, name: str) -> str:
        if name not in self._texts:
            url = self.locate(name)
            try:
                data = self.bridge.fetchBytesSync(url)
            except JsException as e:
                raise ConfigError(f"cannot read {url}: {e.message}") from None
            self._texts[name] = None if data is None else decode_text(data.to_bytes(), url)
        text = self._texts[name]
        if text is None:
            raise ConfigError(f"{self.locate(name)} does not exist")
        return text

    def describe(self, name: str = "") -> str:
        return self.base + name


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


class WebPlatform:
    name = "pyodide"

    def __init__(self, bridge: JsProxy, driver: Driver | None = None):
        self.bridge, self.driver = bridge, driver
        self.backend = WebBackend(bridge)

    def tokenizer(self, tokenizer_json: str, tokenizer_config: str | None) -> JsTokenizer:
        return JsTokenizer(self.bridge.tokenizer(tokenizer_json, tokenizer_config), self.bridge)

    def folder(self, location: str) -> RemoteFolder:
        """A draft model's folder: an absolute URL (the embed API resolves it against the page)."""
        folder = RemoteFolder(self.bridge, location)
        if self.driver is not None:
            self.driver.folders.append(folder)
        return folder

    def compile_template(self, source: str) -> Renderer:
        """@huggingface/jinja: the bridge answers {text} or {error: {kind, message}} as JSON."""
        compiled = json.loads(self.bridge.chatTemplate(source))
        if "error" in compiled:
            raise TemplateFailure(compiled["error"]["kind"], compiled["error"]["message"])
        render = self.bridge.renderTemplate

        def rendered(context: dict[str, Any]) -> str:
            answer = json.loads(render(compiled["id"], json.dumps(context)))
            if "error" in answer:
                raise TemplateFailure(answer["error"]["kind"], answer["error"]["message"])
            return answer["text"]

        return rendered


def _js_object(mapping: dict[str, Any]) -> JsProxy:
    return to_js(mapping, dict_converter=js.Object.fromEntries)


def _dims(t: Any) -> tuple[int, ...]:
    return tuple(t.js.dims) if t.js is not None else ()


class Driver:
    """Starts the core's work on onnxruntime-web and takes the results back (`start`, `finish`);
    the worker awaits in between. One run at a time: onnxruntime-web refuses overlapping runs of a
    session, and its WebGPU build suspends wasm calls (asyncify), which must not interleave."""

    def __init__(self, bridge: JsProxy, folder: RemoteFolder, device: str):
        self.bridge, self.folder, self.device = bridge, folder, device
        self.folders = [folder]  # the model's, and the draft models' (WebPlatform.folder)
        self.sessions: dict[str, JsProxy] = {}
        self._gpu = device == "webgpu"
        self._decoders: dict[str, tuple[JsProxy, Mapping[str, Any], CacheSlot]] = {}
        self._speculators: dict[str, tuple[JsProxy, JsProxy | None, JsProxy]] = {}  # by the model's session
        self._kernels_sent: set[str] = set()
        self.optimized: set[str] = set()  # sessions created from graphs optimized ahead for the device

    def start(self, work: Any) -> tuple[bool, Any]:
        """(True, the answer) for work done at once; (False, a JS promise) for work to await."""
        kind = type(work)
        if kind is Run:
            twin = None if self._gpu else NATIVE_KERNELS.get(work.session)
            if twin is not None:
                out = getattr(self.bridge, twin)(*(t.js for t in work.feeds.values()))
                return True, {work.outputs[0]: Tensor(out)}
            return False, self._run(work)
        if kind is RunAll:  # one after another: see Bridge.runEach
            return False, self.bridge.runEach(to_js([self._call(r) for r in work.runs]))
        if kind is Open:
            return False, self._open(work)
        if kind is Select:  # web/sampling.js's Picker on the last row, as the Decoder's steps select
            return False, self.bridge.pickLast(work.logits.js, json.dumps(dataclasses.asdict(work.pick)))
        if kind is ReadGraph:
            return False, self.bridge.readGraph(work.path)
        if kind is ReadWheel:
            return False, self.bridge.fetchBytes(work.path, posixpath.basename(work.path))
        raise OrtpipeError(f"the browser driver got work it does not know: {type(work).__name__}")

    def finish(self, work: Any, raw: JsProxy) -> Any:
        """The answer the core expects, from what the awaited promise gave."""
        kind = type(work)
        if kind is Run:
            return self._outputs(work, raw)
        if kind is RunAll:
            return [self._outputs(r, out) for r, out in zip(work.runs, raw, strict=True)]
        if kind is ReadGraph:
            return JsBytesFile(raw, work.shown)
        if kind is ReadWheel:
            return _wheel_file(raw, work)
        if kind is Select:
            return int(raw)
        session = raw
        self.sessions[work.spec.name] = session
        return Opened(session, signature_of(self.bridge, session))

    def failure(self, work: Any, message: str) -> OrtpipeError:
        """What a JS failure while awaiting `work` means, with the context the message lacks."""
        if type(work) is Open:
            return ConfigError(
                f'session "{work.spec.name}" could not be created from {work.shown} on '
                f"{self.device}: {message}"
            )
        if type(work) is Run:
            shapes = ", ".join(f"{k} {list(_dims(v))}" for k, v in work.feeds.items())
            return OrtpipeError(f'session "{work.session}" failed: {message}\n  inputs: {shapes}')
        if type(work) is Select and NON_FINITE in message:  # (the rejection may come wrapped by Pyodide)
            return OrtpipeError(work.non_finite())
        return OrtpipeError(message)  # RunAll's and the Decoder's messages name their session

    def _run(self, work: Run) -> JsProxy:
        """A promise of the run's outputs; a kernel's session is made on its first run."""
        session, name, graph, device, names, tensors, outputs = self._call(work)
        if session is None:
            return self.bridge.runKernel(name, graph, device, names, tensors, outputs)
        return self.bridge.run(session, names, tensors, outputs)

    def _call(self, work: Run) -> list[Any]:
        """The run as Bridge.runEach takes it: [session or None (a kernel), the kernel's name, its graph (on
        its first run), device, input names, tensors, output names]."""
        session = self.sessions.get(work.session)
        names, tensors = to_js(list(work.feeds)), to_js([t.js for t in work.feeds.values()])
        graph, device = None, self.device
        if session is None:
            first = work.session not in self._kernels_sent
            self._kernels_sent.add(work.session)
            device = "wasm" if work.session.startswith(CPU_ONLY) else self.device
            graph = to_js(kernel_file(work.session).read_bytes()) if first else None
        return [session, work.session, graph, device, names, tensors, to_js(work.outputs)]

    def warm(self, kernels: list[str]) -> None:
        """Open these kernels' sessions in the background, before a request needs them (a sampled first
        token of the generic path, logprobs or an n-gram ban, otherwise waits for four or five to be
        made; the folder's own settings select in the worker, `Select`, and need none)."""
        for name in kernels:
            if name in self._kernels_sent or (not self._gpu and name in NATIVE_KERNELS):
                continue
            self._kernels_sent.add(name)
            device = "wasm" if name.startswith(CPU_ONLY) else self.device
            self.bridge.warmKernel(name, to_js(kernel_file(name).read_bytes()), device)

    def _outputs(self, work: Run, values: JsProxy) -> dict[str, Tensor]:
        gpu = self._gpu and not work.session.startswith(KERNEL)
        return {name: Tensor(value, gpu) for name, value in zip(work.outputs, values, strict=True)}

    def _open(self, work: Open) -> JsProxy:
        """A session on the worker's device for every model session (the config's execution providers
        are for CPython)."""
        file = work.spec.file
        # the folder the graph is in: the model's, or a draft model's
        folder = max((f for f in self.folders if work.path.startswith(f.base)), key=lambda f: len(f.base))
        weights = [
            folder.locate(n)
            for n in (p.format(file=file) for p in EXTERNAL_DATA)
            if folder.exists(n)
        ]
        # a graph optimized ahead for this device's provider: its session does not optimize it again
        optimized = optimized_ahead(work.optimized_for, self.device)
        if optimized:
            self.optimized.add(work.spec.name)
        options = {"name": file, "device": self.device, "gpuOutputs": self._gpu, "externalData": weights,
                   "optimized": optimized}
        return self.bridge.createSession(work.path, _js_object(options))

    # fused decode steps

    def decoder(self, d: Decode) -> tuple[JsProxy, bool]:
        """What runs `d`'s burst: the JS Decoder of its session holding `d.cache`, or a JS Speculator
        over it when `d` speculates; and whether it was just made (the worker reads it again)."""
        if d.speculation is not None:
            return self._speculator(d)
        return self._decoder(d)

    def _decoder(self, d: Decode) -> tuple[JsProxy, bool]:
        decoder, cache, first = self._decoders.get(d.step.session) or (None, None, None)
        # The core's KVCache replaces all its entries at once (a generic step, a rewind): the first
        # entry tells whether the decoder still holds the cache.
        if cache is d.cache and d.cache[next(iter(d.step.presents.values()))] is first:
            return decoder, False
        return self._start_decoder(d), True

    def decoded(self, d: Decode, tokens: list[int]) -> Decoded:
        cache = self._decoders[d.step.session][1]
        if d.speculation is None:
            return Decoded(tokens, cache)
        spec = d.speculation
        state = json.loads(self._speculators[d.step.session][2].state())
        spec.speculator.absorb(state)
        draft = None
        if spec.draft is not None:
            draft = (self._decoders[spec.draft.step.session][1], state["draftedTo"])
        return Decoded(tokens, cache, draft)

    def _speculator(self, d: Decode) -> tuple[JsProxy, bool]:
        """The JS Speculator over the Decoders of the model and of the draft model, given the text so
        far and the draft length's state (web/speculate.js)."""
        spec = d.speculation
        target, fresh = self._decoder(d)
        draft, draft_fresh, drafted_to = None, False, 0
        if spec.draft is not None:
            dd = spec.draft
            alone = Decode(dd.step, dd.cache, dd.capacity, d.eos, 0, dd.length, 1, "draft")
            draft, draft_fresh = self._decoder(alone)
            drafted_to = dd.length
        held = self._speculators.get(d.step.session)
        fresh = fresh or draft_fresh or held is None
        if fresh:
            speculator = spec.speculator
            config = {
                "eos": sorted(d.eos), "most": speculator.length.most,
                "ngram": speculator.ngram.size if speculator.ngram is not None else 0,
                "layout": d.step.layout, "seqAxes": dict(spec.seq_axes),
                "draftLayout": spec.draft.step.layout if spec.draft else None,
                "draftSeqAxes": dict(spec.draft.seq_axes) if spec.draft else None,
            }
            graphs = None
            if self._gpu and "concat" in (config["layout"], config["draftLayout"]):
                names = [f"{KERNEL}narrow_{t}" for t in ("float32", "float16")]
                graphs = _js_object({name: to_js(kernel_file(name).read_bytes()) for name in names})
            held = (target, draft, self.bridge.speculator(target, draft, json.dumps(config), graphs))
            self._speculators[d.step.session] = held
        held[2].prepare(json.dumps({"tokens": spec.tokens, "length": spec.speculator.length.state(),
                                    "draftedTo": drafted_to, "resets": spec.speculator.resets}))
        return held[2], fresh

    def _start_decoder(self, d: Decode) -> JsProxy:
        """A JS Decoder for the request whose cache is `d.cache`, holding that cache from now on."""
        step = d.step
        spec = {
            "name": step.session,
            "ids": list(step.ids),
            "mask": list(step.mask) if step.mask else None,
            "positions": list(step.positions) if step.positions else None,
            "presents": dict(step.presents),
            "outputs": list(step.outputs),
            "logits": step.logits,
            "vocab": step.logits_shape[-1],
            "capacity": d.capacity,
            "eos": sorted(d.eos),
            "gpu": self._gpu,
            "grow": step.layout == "shared" and not self._gpu,  # see web/bridge.js Decoder.narrow
        }
        decoder = self.bridge.decoder(self.sessions[step.session], _js_object(spec))
        names = list(step.presents.values())
        tensors = []
        for name in names:
            entry = d.cache[name]
            tensors.append(entry.js)
            if isinstance(entry, CacheSlot):
                entry.decoder.forget(name)  # an earlier decoder's entry: this one owns it now
            else:
                entry.js = None
        decoder.seed(to_js(names), to_js(tensors))
        if d.fixed:  # fed to every step; Python keeps them (the decoder does not dispose them)
            decoder.fix(to_js(list(d.fixed)), to_js([value.js for value in d.fixed.values()]))
        slots = {**d.cache, **{name: CacheSlot(decoder, name) for name in names}}
        self._decoders[step.session] = (decoder, slots, slots[names[0]])
        return decoder


PLUGIN_DIR = "/tmp/ortpipe-plugins"  # in Pyodide's in-memory file system


def _wheel_file(raw: JsProxy, work: ReadWheel) -> str:
    """The plugin's wheel (fetched bytes) written where Python's zip import can read it; its path."""
    if raw is None:
        raise ConfigError(f"{work.shown} does not exist: the plugin's wheel is part of the model folder")
    os.makedirs(PLUGIN_DIR, exist_ok=True)
    path = posixpath.join(PLUGIN_DIR, posixpath.basename(work.path))
    with open(path, "wb") as f:
        f.write(raw.to_bytes())
    return path


class JsBytesFile:
    """A graph file's bytes, held in JS, read as a seekable binary file: the core's graph reader takes
    the few fields it needs without copying the weights into Python."""

    def __init__(self, data: JsProxy, name: str):
        self.data, self.name = data, name
        self.size, self.position = int(data.length), 0

    def seek(self, offset: int, whence: int = 0) -> int:
        base = (0, self.position, self.size)[whence]
        self.position = base + offset
        return self.position

    def tell(self) -> int:
        return self.position

    def read(self, n: int = -1) -> bytes:
        end = self.size if n < 0 else min(self.size, self.position + n)
        start, self.position = self.position, max(end, self.position)
        return self.data.subarray(start, end).to_bytes() if end > start else b""


def signature_of(bridge: JsProxy, session: JsProxy) -> Signature:
    raw = json.loads(bridge.signature(session))

    def info(entry: dict[str, Any]) -> TensorInfo:
        return TensorInfo(entry["name"], entry["type"] or "unknown", tuple(entry["shape"] or ()))

    return Signature(tuple(map(info, raw["inputs"])), tuple(map(info, raw["outputs"])))


class Emit:
    """Chunks (and the Progress of loops that make no tokens) a task has for the page; the Task collects
    them into its next answer."""

    __slots__ = ("chunks",)

    def __init__(self, chunks: list[Chunk | Progress]):
        self.chunks = chunks


class Task:
    """One message's work, pumped by the worker: every call answers JSON, one of
    {"chunks", "progress", "next": "wait"}: await `pending`, then `advance(result)`;
    {"chunks", "next": "decode", "decode": [token, position, limit, pick], "fresh"}: run a burst of
      the JS Decoder (`decoder`, read again when fresh; `pick`: how it selects, or null for the
      argmax), then `decoded(...tokens)`;
    {"chunks", "next": "done", "value"}; or {"chunks", "error": {"type", "message"}}.
    A JS failure while awaiting is handed back with `fail(message)`: the core sees it where it asked."""

    def __init__(self, work: Work, driver: Driver | None):
        self.work, self.driver = work, driver
        self.pending: JsProxy | None = None
        self.decoder: JsProxy | None = None
        self._item: Any = None

    def advance(self, raw: Any = None) -> str:
        item = self._item
        if item is None:
            return self._answer(lambda: next(self.work))
        return self._answer(lambda: self.work.send(self.driver.finish(item, raw)))

    def decoded(self, *tokens: int) -> str:
        item = self._item
        return self._answer(lambda: self.work.send(self.driver.decoded(item, list(tokens))))

    def fail(self, message: str) -> str:
        error = self.driver.failure(self._item, message)
        return self._answer(lambda: self.work.throw(error))

    def _answer(self, resume: Any) -> str:
        chunks: list[dict[str, Any]] = []
        progress: list[dict[str, Any]] = []
        try:
            item = resume()
            while True:
                if type(item) is Emit:
                    chunks += [{"token": c.token, "text": c.text} for c in item.chunks if type(c) is Chunk]
                    progress += [{"step": c.step, "steps": c.steps, "what": c.what} for c in item.chunks
                                 if type(c) is Progress]
                    # a pipeline of stages: each stage's chunk (a loop that makes no tokens: token null)
                    chunks += [{"token": c.token, "text": c.text, "stage": c.stage} for c in item.chunks
                               if type(c) is StageChunk]
                    item = self.work.send(None)
                elif type(item) is Decode:
                    self._item = item
                    self.decoder, fresh = self.driver.decoder(item)
                    pick = dataclasses.asdict(item.pick) if item.pick is not None else None
                    return json.dumps(
                        {
                            "chunks": chunks,
                            "progress": progress,
                            "next": "decode",
                            "fresh": fresh,
                            "decode": [item.token, item.position, item.limit, pick],
                        }
                    )
                else:
                    now, value = self.driver.start(item)
                    if not now:
                        self._item, self.pending = item, value
                        return json.dumps({"chunks": chunks, "progress": progress, "next": "wait"})
                    item = self.work.send(value)
        except StopIteration as stop:
            return json.dumps({"chunks": chunks, "progress": progress, "next": "done", "value": stop.value})
        except OrtpipeError as e:
            return json.dumps({"chunks": chunks, "progress": progress,
                               "error": {"type": type(e).__name__, "message": str(e)}})
        except Exception as e:  # a bug: the page gets the traceback to report
            return json.dumps(
                {
                    "chunks": chunks,
                    "error": {
                        "type": "InternalError",
                        "message": (f"{type(e).__name__}: {e}\n{traceback.format_exc()}"),
                    },
                }
            )


class Worker:
    """The Python half of web/worker.js: the loaded model, its chats, and a Task per message."""

    def __init__(self, bridge: JsProxy):
        self.bridge = bridge
        self.model: Model | None = None
        self.driver: Driver | None = None
        self.chats: dict[int, Any] = {}
        self._chats_made = 0
        self.active: Request | OutputRequest | None = None
        self._interrupted = False  # an interrupt that came before the running task made its request
        self.outputs: list[dict[str, Any]] = []  # the last result's named outputs, for take_outputs

    def task(self, kind: str, options: str, images: JsProxy | None = None,
             tensors: JsProxy | None = None, mask: JsProxy | None = None) -> Task:
        """A Task for the worker's message `kind` with its JSON `options` (and decoded images, named
        tensors: a denoising request's latents, and inpainting's decoded mask)."""
        return Task(self._work(kind, json.loads(options), images, tensors, mask), self.driver)

    def _work(self, kind: str, options: dict[str, Any], images: JsProxy | None,
              tensors: JsProxy | None, mask: JsProxy | None = None) -> Work:
        if kind == "load":
            folder = RemoteFolder(self.bridge, options["url"])
            self.driver = Driver(self.bridge, folder, options["device"])
            plugins = bool(options.get("allow_plugins", False))
            return self._load(folder, options.get("dtype"), options.get("f16", True), plugins)

        if kind == "media":
            return self._check_media(options)
        if kind == "generate":
            decoded = [(Tensor(image), *tuple(image.dims)[:2]) for image in images] if images else None
            if tensors:
                options["inputs"] = {name: Tensor(t) for name, t in tensors.object_entries()}
            if mask:
                options["mask"] = (Tensor(mask), *tuple(mask.dims)[:2])
            return self._generate(options, decoded)
        if kind == "embed":
            return self._embed(options)
        if kind == "chat":
            return self._open_chat(options)
        if kind == "say":
            return self._say(options)
        if kind == "rewind":
            return self._rewind(options.get("chat"))
        return _failing(OrtpipeError(f"the worker asked for an unknown task {kind!r}"))

    def _load(self, folder: RemoteFolder, dtype: Any, f16: bool, allow_plugins: bool) -> Work:
        platform = WebPlatform(self.bridge, self.driver)
        device = self.driver.device
        self.model, _ = yield from load_model(
            folder, platform, allow_plugins=allow_plugins, dtype=dtype, device=device, f16=f16
        )
        self.driver.warm(self._default_kernels())
        return self.info()

    def _default_kernels(self) -> list[str]:
        """The kernels that select the first token of a request with the folder's settings."""
        model = self._loaded()
        gen = model.plan.generator
        if gen is None:
            return []
        dtype = model.plan.signatures[gen.session].output(gen.logits).dtype
        generation = model.config.generation
        return Sampler(model.backend, dtype, generation.settings, frozenset()).kernels()

    def _check_media(self, options: dict[str, Any]) -> Work:
        """Refuse images or a mask the loaded folder does not read, before the worker decodes (or
        fetches) any: options {images, mask}, whether the request gives them."""
        self._loaded().check_media(bool(options.get("images")), False, bool(options.get("mask")))
        return None
        yield  # a generator, like every task's work

    def _generate(self, options: dict[str, Any], images: list[Any] | None) -> Work:
        self._interrupted = bool(options.pop("interrupted", False))
        request = yield from self._loaded().request(**options, images=images)
        return (yield from self._run(request))

    def _say(self, options: dict[str, Any]) -> Work:
        self._interrupted = bool(options.pop("interrupted", False))
        chat = self._chat(options.pop("chat", None))
        content = options.pop("content", None)
        unknown = sorted(set(options) - {"max_new_tokens"})
        if not isinstance(content, str):
            raise GenerationError("a chat turn needs its content: a string")
        if unknown:
            raise GenerationError(
                f"a chat turn takes content and max_new_tokens, not {', '.join(unknown)}; "
                "give the other settings when the chat is made"
            )
        return (yield from self._run(chat.say(content, options.get("max_new_tokens"))))

    def _embed(self, options: dict[str, Any]) -> Work:
        self._interrupted = bool(options.pop("interrupted", False))
        unknown = sorted(set(options) - {"texts", "batch_size", "pooling", "normalize"})
        if unknown:
            raise GenerationError(
                f"embed takes texts, batchSize, pooling and normalize, not {', '.join(unknown)}"
            )
        request = self._loaded().embed(options.get("texts"), options.get("batch_size", 32),
                                       options.get("pooling"), options.get("normalize"))
        return (yield from self._run(request))

    def _run(self, request: Request | OutputRequest) -> Work:
        """The request run to its end, its chunks emitted as they come; returns the result (its named
        outputs described, their tensors kept for take_outputs)."""
        if self._interrupted:
            request.interrupt()
        self.active = request
        try:
            while not request.done:
                yield Emit((yield from request.advance()))
        finally:
            self.active = None
        result = request.result()
        self.outputs = []
        for name, value in result.outputs.items():
            kind = result.kinds[name]
            entry = {"name": name, "kind": kind["kind"], "tensor": value,
                     "samplingRate": kind.get("sampling_rate")}
            if kind["kind"] == "image":  # what a canvas takes: RGBA bytes
                made = yield Run(kernel("rgba8", "uint8"), {"image": value}, ("rgba",), None, "final")
                entry["rgba"] = made["rgba"]
            self.outputs.append(entry)
        backend = self._loaded().backend
        return result.as_dict(lambda name, value: {"dtype": backend.dtype(value),
                                                   "shape": list(backend.shape(value))})

    def take_outputs(self) -> JsProxy:
        """The last result's named outputs for the worker: [{name, kind, tensor, samplingRate, rgba}] (an
        image also as RGBA bytes [batch, height, width, 4]). The worker reads them, then calls
        release_outputs."""
        listed = [{k: v.js if isinstance(v, Tensor) else v for k, v in entry.items()}
                  for entry in self.outputs]
        return to_js(listed, dict_converter=js.Object.fromEntries)

    def release_outputs(self) -> None:
        self.outputs = []

    def _open_chat(self, options: dict[str, Any]) -> Work:
        yield from self._loaded().prepare(options)  # a draft model the settings name
        chat = self._loaded().chat(**options)
        self._chats_made += 1
        self.chats[self._chats_made] = chat
        return self._chats_made

    def _rewind(self, number: Any) -> Work:
        chat = self._chat(number)
        yield from chat.rewind()
        return list(chat.tokens)

    def _loaded(self) -> Model:
        if self.model is None:
            raise OrtpipeError("no model is loaded")
        return self.model

    def _chat(self, number: Any) -> Any:
        self._loaded()
        chat = self.chats.get(number)
        if chat is None:
            raise OrtpipeError("this chat was disposed")
        return chat

    def close_chat(self, number: int) -> None:
        self.chats.pop(number, None)

    def interrupt(self) -> None:
        if self.active is not None:
            self.active.interrupt()
        else:
            self._interrupted = True

    def info(self) -> dict[str, Any]:
        model = self._loaded()
        stages = getattr(model, "models", {})  # pipeline.stages: every stage's sessions
        opened = {n for m in stages.values() for n in m.plan.signatures} or set(model.plan.signatures)
        files = {name: model.config.pipeline.sessions[name].file for name in sorted(opened)}
        encoder = getattr(model, "plan", None) and model.plan.text_encoder
        return {
            "device": self.driver.device,
            "sessions": sorted(opened),
            "stages": list(stages),
            "files": files,  # the variant each session runs
            "optimized": sorted(self.driver.optimized & opened),  # graphs optimized ahead (variants.py)
            "dtypes": {name: dtype_of(file) for name, file in files.items()},
            "eos": list(model.config.tokens.eos),
            "tokenizer": model.tokenizer is not None,
            "max_length": model.config.generation.max_length,
            "model_type": model.config.metadata.get("model_type"),
            "load_ms": round(model.load_ms, 1),
            "notes": list(model.config.notes),
            # the generation settings a request gets unless it says otherwise (the page's placeholders)
            "defaults": {s.name: _plain(getattr(model.config.generation.settings, s.name)) for s in SEARCH},
            "loop": model.config.generation.loop,
            # an encoder-decoder's session that reads the prompt (T5, ...): its answer does not continue it
            "text_encoder": encoder.session if encoder is not None else None,
            "outputs": {o.name: o.kind for o in model.config.pipeline.outputs},
        }


def _plain(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value


def _failing(error: OrtpipeError) -> Work:
    raise error
    yield  # a generator, like every task's work


__all__ = ["Driver", "RemoteFolder", "Task", "WebBackend", "Worker"]
