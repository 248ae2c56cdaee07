"""The CPython target: the core's work carried out by onnxruntime, tensors as numpy arrays.

Plain `run()` is zero-copy on CPU. Sessions whose cache is one shared past/present buffer run
through an IOBinding that is kept between steps: the buffers are bound once, and only the inputs
that changed are bound again.
"""

from __future__ import annotations

import json
import os
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort

from ..chat import Chat
from ..config import load_config
from ..config.schema import SessionSpec
from ..errors import ConfigError, GenerationError, OrtpipeError
from ..execute.work import KERNEL, Decode, Run, RunAll, Work
from ..folder import LocalFolder
from ..loops.autoregressive import TokenGenerator
from ..pipeline import Chunk, Pipeline, Request, Result
from ..plan import Plan, make_plan
from ..preprocess import load_audio_config
from ..preprocess.request import media_inputs
from ..signature import Signature, TensorInfo
from ..trace import Span, Trace
from .media import decode_image, read_wav

KERNEL_DIR = Path(__file__).resolve().parent.parent / "kernels"
PROVIDERS = {
    "cpu": "CPUExecutionProvider", "cuda": "CUDAExecutionProvider", "dml": "DmlExecutionProvider",
    "openvino": "OpenVINOExecutionProvider", "qnn": "QNNExecutionProvider", "coreml": "CoreMLExecutionProvider",
    "webgpu": "WebGpuExecutionProvider", "tensorrt": "TensorrtExecutionProvider",
}
_ORT_TYPES = {"tensor(float)": "float32", "tensor(float16)": "float16", "tensor(double)": "float64",
              "tensor(int64)": "int64", "tensor(int32)": "int32", "tensor(bool)": "bool",
              "tensor(uint8)": "uint8", "tensor(int8)": "int8", "tensor(bfloat16)": "bfloat16"}
_SESSION_OPTIONS = ("intra_op_num_threads", "inter_op_num_threads")
# A burst of fused decode steps (one `Decode`) stops once it has run this long, so that a stream's
# chunks keep coming and an interrupt lands soon: on a model whose step takes longer, a burst is one step.
BURST_SECONDS = 0.02


class CpuBackend:
    """Tensors as numpy arrays."""

    fused_decode = frozenset({"shared", "concat"})  # the cache layouts whose Decode the driver carries out
    decode_burst = 64  # steps per Decode at most; the driver also stops a burst after BURST_SECONDS

    def tensor(self, values: list[int], shape: tuple[int, ...], dtype: str) -> np.ndarray:
        return np.array(values, dtype=dtype).reshape(shape)

    def full(self, shape: tuple[int, ...], value: float, dtype: str) -> np.ndarray:
        return np.full(shape, value, dtype=dtype)

    def shape(self, handle: np.ndarray) -> tuple[int, ...]:
        return handle.shape

    def dtype(self, handle: np.ndarray) -> str:
        return str(handle.dtype)

    def to_list(self, handle: np.ndarray) -> list[int]:
        return handle.ravel().tolist()


def provider_name(name: str) -> str:
    return PROVIDERS.get(name.lower(), name)


def choose_provider(spec: SessionSpec, override: str | None) -> tuple[str, dict[str, Any]]:
    """The first available provider of the session's list; a fallback is a warning, never silent."""
    wanted = [override] if override else list(spec.providers)
    available = ort.get_available_providers()
    for name in wanted:
        full = provider_name(name)
        if full in available:
            if full != provider_name(wanted[0]):
                warnings.warn(f'session "{spec.name}": {wanted[0]} is not available in this onnxruntime '
                              f"({', '.join(available)}); using {full}", stacklevel=3)
            return full, dict(spec.provider_options.get(name, {}))
    raise ConfigError(f'session "{spec.name}" asks for execution provider {" or ".join(wanted)}, but this '
                      f"onnxruntime has only {', '.join(available)}. Install the matching onnxruntime package "
                      "(one flavour per environment) or choose another provider")


def open_session(folder: Path, spec: SessionSpec, provider: str | None, threads: int | None) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.log_severity_level = 3  # failures reach the user as ortpipe errors with context, once
    for key in _SESSION_OPTIONS:
        if isinstance(spec.session_options.get(key), int):
            setattr(options, key, spec.session_options[key])
    if threads:
        options.intra_op_num_threads = threads
    name, provider_options = choose_provider(spec, provider)
    path = folder / spec.file
    try:
        session = ort.InferenceSession(str(path), options, providers=[name], provider_options=[provider_options])
    except Exception as e:  # onnxruntime raises its own types; give them context
        raise ConfigError(f'session "{spec.name}" could not be created from {path} with {name}: {e}') from e
    got = session.get_providers()[0]
    if got != name:
        warnings.warn(f'session "{spec.name}": asked for {name}, onnxruntime gave {got}', stacklevel=3)
    return session


def signature_of(session: ort.InferenceSession) -> Signature:
    def info(arg: Any) -> TensorInfo:
        return TensorInfo(arg.name, _ORT_TYPES.get(arg.type, arg.type), tuple(arg.shape))

    return Signature(tuple(map(info, session.get_inputs())), tuple(map(info, session.get_outputs())))


def _argmax_last(logits: np.ndarray) -> list[np.ndarray]:
    return [logits[:, -1].argmax(-1)]


def _narrow(x: np.ndarray, start: np.ndarray, end: np.ndarray, axis: np.ndarray) -> list[np.ndarray]:
    index = [slice(None)] * x.ndim
    index[int(axis[0])] = slice(int(start[0]), int(end[0]))
    return [np.ascontiguousarray(x[tuple(index)])]


# numpy twins of kernel graphs whose onnxruntime call costs more than the work (about 50 µs a run
# here, against 3 µs for an argmax); tests/test_kernels.py checks each twin against its graph.
NATIVE_KERNELS = {"argmax_last": _argmax_last, "narrow": _narrow}


class NativeKernel:
    """A kernel computed with numpy, with InferenceSession's run() signature."""

    def __init__(self, fn: Any):
        self.fn = fn

    def run(self, outputs: tuple[str, ...], feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
        return self.fn(**feeds)


class _Binding:
    """An IOBinding kept between runs of one session, with what is bound to it."""

    def __init__(self, session: ort.InferenceSession):
        self.io = session.io_binding()
        self.raw = self.io._iobinding  # the C++ binding under onnxruntime's Python wrapper
        self.inputs: dict[str, Any] = {}
        self.inplace: dict[str, Any] = {}  # output name -> the array it is written into
        self.inplace_inputs: dict[str, Any] = {}  # input name -> the OrtValue over that array
        self.outputs: list[str] = []  # binding order, which is the order get_outputs() returns
        self.fresh: list[str] = []  # outputs onnxruntime allocates anew on every run
        self.runs = 0  # generic runs so far: a fused decode set up before one must bind again


class _Fused:
    """What fused decode steps of one session bind besides the cache: the input id (and position)
    written in place, attention masks as views of one row of ones, logits into a preallocated array.
    For a concat cache only the row of ones and the run are kept (nothing is bound)."""

    def __init__(self) -> None:
        self.cache: dict[str, Any] | None = None  # the Decode.cache it is bound for
        self.runs = -1  # the binding's generic run count when it was bound
        self.ids = self.positions = self.logits = self.flat = self.ones = np.empty(0)
        self.keep: list[Any] = []  # OrtValues the binding refers to
        self.presents: list[int] = []  # concat: where each present is among the outputs
        self.logits_at = 0  # concat: where the logits are among them
        self.masks: list[Any] = []  # [n]: a C++ OrtValue over ones[:, :n], made when first needed
        self.mask_name: str | None = None
        self.binding: _Binding | None = None
        self.raw: Any = None
        self.run: Any = None

    def mask(self, n: int) -> Any:
        value = self.masks[n]
        if value is None:
            value = self.masks[n] = ort.OrtValue.ortvalue_from_numpy(self.ones[:, :n])._ortvalue
        return value


class Driver:
    """Carries out the core's Run / RunAll requests on onnxruntime sessions."""

    def __init__(self, sessions: dict[str, ort.InferenceSession]):
        self.sessions = dict(sessions)
        self._bindings: dict[str, _Binding] = {}
        self._fused: dict[str, _Fused] = {}
        self._pool: ThreadPoolExecutor | None = None
        self.trace: Trace | None = None  # set while a traced request runs
        self._label = ""

    def drive(self, gen: Work) -> Any:
        """Answer a core generator's requests until it returns; its return value is ours."""
        try:
            work = next(gen)
            while True:
                work = gen.send(self.execute(work))
        except StopIteration as stop:
            return stop.value

    def execute(self, work: Run | RunAll | Decode) -> Any:
        if type(work) is Decode:
            return self.decode(work)
        if isinstance(work, Run):
            return self.run(work)
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="ortpipe")
        return list(self._pool.map(self.run, work.runs))  # onnxruntime releases the GIL in run()

    def run(self, work: Run) -> dict[str, Any]:
        if self.trace is None:
            return self._run(work)
        start = time.perf_counter_ns()
        out = self._run(work)
        shapes = {k: list(getattr(v, "shape", ())) for k, v in work.feeds.items()}
        self._label = work.label or self._label  # kernels run inside the step that asked for them
        self.trace.add(Span(work.session, self._label, start / 1000, time.perf_counter_ns() / 1000,
                            threading.get_ident(), shapes))
        return out

    def decode(self, d: Decode) -> list[int]:
        """`d.limit` greedy decode steps at most, stopping after an eos or once BURST_SECONDS have
        passed. A traced request runs one step per Decode, so that every step has its own label."""
        step = self._decode_shared if d.shared else self._decode_concat
        burst = d.limit > 1 and self.trace is None
        end = time.perf_counter() + BURST_SECONDS if burst else 0.0  # one step: no clock read
        tokens = [step(d)]
        while burst and len(tokens) < d.limit and tokens[-1] not in d.eos and time.perf_counter() < end:
            d.token, d.past = tokens[-1], d.past + 1
            tokens.append(step(d))
        return tokens

    def _decode_shared(self, d: Decode) -> int:
        """A greedy decode step in one run. Shared buffer: the id written into the bound input
        array, a ready mask bound, and the argmax of logits that onnxruntime wrote into a
        preallocated array. Concat (below): a plain run whose presents replace the pasts in `d.cache`."""
        f = self._fused.get(d.session)
        if f is None or f.cache is not d.cache or f.runs != f.binding.runs:
            f = self._bind_fused(d)
        f.ids[0, 0] = d.token
        if f.positions.size:
            f.positions[0, 0] = d.past
        if f.mask_name is not None:
            f.raw.bind_ortvalue_input(f.mask_name, f.mask(d.past + 1))
        self._fused_run(d, f.run, f.raw, None)
        return int(f.flat.argmax())

    def _decode_concat(self, d: Decode) -> int:
        f = self._fused.get(d.session)
        if f is None or f.cache is not d.cache:
            f = self._fused[d.session] = _Fused()
            f.cache, f.run = d.cache, self.sessions[d.session]._sess.run  # the C++ call under the wrapper
            if d.mask:
                f.ones = np.ones((1, d.capacity), d.mask[1])
            f.presents = [d.outputs.index(present) for present in d.presents]
            f.logits_at = d.outputs.index(d.logits)
        feeds = dict(d.cache)
        feeds[d.ids[0]] = np.full((1, 1), d.token, d.ids[1])
        if d.mask:
            feeds[d.mask[0]] = f.ones[:, :d.past + 1]
        if d.positions:
            feeds[d.positions[0]] = np.full((1, 1), d.past, d.positions[1])
        values = self._fused_run(d, f.run, d.outputs, feeds, None)
        for past, i in zip(d.presents.values(), f.presents, strict=True):
            d.cache[past] = values[i]
        logits = values[f.logits_at]
        return int(logits.reshape(-1, logits.shape[-1])[-1].argmax())

    def _fused_run(self, d: Decode, run: Any, *args: Any) -> Any:
        """`run(*args)`, the run of a fused step: its failure named, its span traced."""
        start = time.perf_counter_ns() if self.trace is not None else 0
        try:
            values = run(*args)
        except Exception as e:
            raise OrtpipeError(f'session "{d.session}" failed on a decode step at position {d.past}: {e}') from e
        if start:
            self._label = d.label
            self.trace.add(Span(d.session, self._label, start / 1000, time.perf_counter_ns() / 1000,
                                threading.get_ident(), {d.ids[0]: [1, 1]}))
        return values

    def _bind_fused(self, d: Decode) -> _Fused:
        """Bind a session for fused decode steps of one request (after any generic run on it)."""
        session = self.sessions[d.session]
        b = self._bindings.get(d.session)
        if b is None:
            b = self._bindings[d.session] = _Binding(session)
        if any(b.inplace.get(out) is not d.cache[inp] for out, inp in d.presents.items()):
            self._rebind_outputs(b, Run(d.session, dict(d.cache), d.outputs, d.presents))
        for inp in d.presents.values():
            if b.inputs.get(inp) is not d.cache[inp]:
                b.io.bind_ortvalue_input(inp, b.inplace_inputs[inp])
                b.inputs[inp] = d.cache[inp]
        f = self._fused.get(d.session) or _Fused()
        f.keep = []

        def bind_array(name: str, array: np.ndarray) -> np.ndarray:
            value = ort.OrtValue.ortvalue_from_numpy(array)
            f.keep.append(value)
            b.io.bind_ortvalue_input(name, value)
            b.inputs[name] = array  # a generic run of the same shape copies into it
            return array

        f.ids = bind_array(d.ids[0], np.zeros((1, 1), d.ids[1]))
        f.positions = bind_array(d.positions[0], np.zeros((1, 1), d.positions[1])) if d.positions else np.empty(0)
        f.mask_name = d.mask[0] if d.mask else None
        if d.mask:
            b.inputs.pop(d.mask[0], None)
            if f.ones.shape != (1, d.capacity) or f.ones.dtype != np.dtype(d.mask[1]):
                f.ones = np.ones((1, d.capacity), d.mask[1])
                f.masks = [None] * (d.capacity + 1)
        types = {o.name: o.type for o in session.get_outputs()}
        f.logits = np.empty(d.logits_shape, _ORT_TYPES[types[d.logits]])
        f.flat = f.logits.reshape(-1)
        logits = ort.OrtValue.ortvalue_from_numpy(f.logits)
        f.keep.append(logits)
        b.io.bind_ortvalue_output(d.logits, logits)
        f.cache, f.runs, f.binding, f.raw = d.cache, b.runs, b, b.raw
        f.run = session._sess.run_with_iobinding  # the C++ call under the Python wrapper
        self._fused[d.session] = f
        return f

    def _run(self, work: Run) -> dict[str, Any]:
        session = self.sessions.get(work.session) or self._kernel(work.session)
        try:
            if work.inplace:
                return self._run_bound(session, work)
            return dict(zip(work.outputs, session.run(work.outputs, work.feeds)))
        except Exception as e:
            shapes = ", ".join(f"{k} {list(getattr(v, 'shape', ()))}" for k, v in work.feeds.items())
            raise OrtpipeError(f'session "{work.session}" failed: {e}\n  inputs: {shapes}') from e

    def _kernel(self, name: str) -> Any:
        if not name.startswith(KERNEL):
            raise OrtpipeError(f'no session "{name}" is loaded')
        native = NATIVE_KERNELS.get(name[len(KERNEL):].rsplit("_", 1)[0])
        if native is not None:
            self.sessions[name] = NativeKernel(native)
            return self.sessions[name]
        options = ort.SessionOptions()
        options.intra_op_num_threads = 1  # kernels are tiny: a thread pool costs more than it saves
        session = ort.InferenceSession(str(KERNEL_DIR / f"{name[len(KERNEL):]}.onnx"), options,
                                       providers=["CPUExecutionProvider"])
        self.sessions[name] = session
        return session

    def _run_bound(self, session: ort.InferenceSession, work: Run) -> dict[str, Any]:
        # The hot path of shared-buffer decoders: onnxruntime's C++ binding is called directly (its
        # Python wrappers cost about 40 µs a step here), and an input whose shape did not change is
        # copied into the array already bound instead of being bound again.
        b = self._bindings.get(work.session)
        if b is None:
            b = self._bindings[work.session] = _Binding(session)
        for out, inp in work.inplace.items():
            if b.inplace.get(out) is not work.feeds[inp]:
                self._rebind_outputs(b, work)
                break
        raw = b.raw
        b.runs += 1
        for name in b.fresh:  # a bound output keeps its first shape: ask for fresh memory each run
            raw.bind_output(name, _CPU)
        for name, value in work.feeds.items():
            bound = b.inputs.get(name)
            if bound is value:
                continue
            if name in b.inplace_inputs:
                b.io.bind_ortvalue_input(name, b.inplace_inputs[name])
                b.inputs[name] = value
            elif bound is not None and bound.shape == value.shape and bound.dtype == value.dtype:
                np.copyto(bound, value)
            else:
                own = np.array(value)  # ours, so later values can be copied into it
                raw.bind_input(name, own)
                b.inputs[name] = own
        session._sess.run_with_iobinding(raw, None)
        values = raw.get_outputs()
        return {name: values[i].numpy() for i, name in enumerate(b.outputs) if name not in work.inplace}

    @staticmethod
    def _rebind_outputs(b: _Binding, work: Run) -> None:
        """Bind every output again: in-place ones to their input's buffer, the rest to fresh CPU memory."""
        b.io.clear_binding_outputs()
        b.inputs.clear()
        b.inplace = {out: work.feeds[inp] for out, inp in work.inplace.items()}
        b.inplace_inputs = {}
        for out, inp in work.inplace.items():
            value = ort.OrtValue.ortvalue_from_numpy(work.feeds[inp])  # shares the array's memory
            b.inplace_inputs[inp] = value
            b.io.bind_ortvalue_output(out, value)
        rest = [o for o in work.outputs if o not in work.inplace]
        for out in rest:
            b.raw.bind_output(out, _CPU)
        b.outputs = list(work.inplace) + rest
        b.fresh = rest


_CPU = ort.capi._pybind_state.OrtDevice(ort.capi._pybind_state.OrtDevice.cpu(),
                                         ort.capi._pybind_state.OrtDevice.default_memory(), 0)


class HFTokenizer:
    """Hugging Face `tokenizers` over the folder's tokenizer.json."""

    def __init__(self, path: Path):
        from tokenizers import Tokenizer

        self._tok = Tokenizer.from_file(str(path))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)


class JinjaChatTemplate:
    """The chat template of tokenizer_config.json, rendered with jinja2 in a sandbox."""

    def __init__(self, tokenizer_config: dict[str, Any]):
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        source = tokenizer_config.get("chat_template")
        if isinstance(source, list):  # named templates: take the default one
            source = next((t.get("template") for t in source if t.get("name") == "default"), None)
        if not isinstance(source, str):
            raise ConfigError("tokenizer_config.json has no chat_template; chat needs one")
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _template_error
        self._template = env.from_string(source)
        self._tokens = {k: _token_text(tokenizer_config.get(k)) for k in ("bos_token", "eos_token")}

    def render(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                     **self._tokens)


def _template_error(message: str) -> None:
    raise GenerationError(f"the chat template refused the conversation: {message}")


def _token_text(value: Any) -> str:
    return value.get("content", "") if isinstance(value, dict) else (value or "")


class StepGenerator:
    """The step-wise API: append tokens, ask for the next one, check whether it is done."""

    def __init__(self, core: TokenGenerator, driver: Driver):
        self.core, self.driver = core, driver

    @property
    def tokens(self) -> list[int]:
        return self.core.tokens

    @property
    def done(self) -> bool:
        return self.core.done

    def append_tokens(self, ids: list[int]) -> None:
        self.core.append_tokens(list(ids))

    def next_token(self) -> int:
        return self.driver.drive(self.core.next_tokens(1))[0]  # one generator less than core.next_token

    def interrupt(self) -> None:
        self.core.interrupted = True


class CpuPipeline:
    """A loaded model: `generate`, `stream`, and the step-wise `generator`.

    Generation settings (do_sample, temperature, top_k, top_p, min_p, repetition_penalty,
    no_repeat_ngram_size, min_length, min_new_tokens, suppress_tokens, seed, stop, ...) default to
    the config's and can be given per call.
    """

    def __init__(self, core: Pipeline, driver: Driver, load_ms: float, folder: Path):
        self.core, self.driver, self.load_ms, self.folder = core, driver, load_ms, folder
        self.plan: Plan = core.plan
        self.config = core.config
        self.tokenizer = core.tokenizer

    def generator(self, prompt_len: int = 0, max_new_tokens: int | None = None, max_length: int | None = None,
                  inputs: dict[str, Any] | None = None, **settings: Any) -> StepGenerator:
        return StepGenerator(self.core.generator(prompt_len, max_new_tokens, max_length, inputs, **settings),
                             self.driver)

    def request(self, prompt: str | None = None, *, prompt_ids: list[int] | None = None,
                max_new_tokens: int | None = None, max_length: int | None = None,
                inputs: dict[str, Any] | None = None, images: list[Any] | None = None,
                audios: list[Any] | None = None, **settings: Any) -> Request:
        """`images`: paths or uint8 [h, w, 3] arrays; `audios`: .wav paths or float32 mono arrays at the
        feature extractor's rate. They are preprocessed into the inputs the pipeline's sessions read."""
        ids = self.core.prompt_ids(prompt, prompt_ids)
        if images or audios:
            inputs = {**self.media_inputs(images or [], audios or []), **(inputs or {})}
        request = self.core.request(ids, max_new_tokens, max_length, inputs, **settings)
        request.timings.load_ms = self.load_ms
        return request

    def stream(self, prompt: str | None = None, *, trace: str | None = None, **options: Any) -> Iterator[Chunk]:
        """Chunks as they are generated; `trace` names a Chrome trace file to write at the end."""
        collected = Trace() if trace else None
        yield from self.drive(self.request(prompt, **options), collected)
        if collected:
            collected.write(trace)

    def drive(self, request: Request, trace: Trace | None = None) -> Iterator[Chunk]:
        """The chunks of a request, as its tokens are generated; `trace` collects its runs."""
        self.driver.trace = trace
        try:
            while not request.done:
                yield from self.driver.drive(request.step())
        finally:
            self.driver.trace = None

    def media_inputs(self, images: list[Any], audios: list[Any]) -> dict[str, np.ndarray]:
        decoded = [decode_image(i) if isinstance(i, (str, os.PathLike)) else np.asarray(i, np.uint8) for i in images]
        waves = [read_wav(a, self._sampling_rate()) if isinstance(a, (str, os.PathLike))
                 else np.asarray(a, np.float32) for a in audios]
        work = media_inputs(self.plan, LocalFolder(self.folder), self.core.backend,
                            [(d, d.shape[0], d.shape[1]) for d in decoded], waves)
        return self.driver.drive(work)

    def _sampling_rate(self) -> int:
        prep = self.config.pipeline.preprocessing.get("audio")
        name = prep.get("config") if isinstance(prep, dict) else None
        return load_audio_config(LocalFolder(self.folder), name).sampling_rate

    def chat(self, max_length: int | None = None, **settings: Any) -> CpuChat:
        """A multi-turn chat over one KV cache, with the folder's chat template."""
        config_path = Path(self.folder) / "tokenizer_config.json"
        if not config_path.is_file():
            raise ConfigError(f"{config_path} is missing: chat needs its chat_template")
        template = JinjaChatTemplate(json.loads(config_path.read_text(encoding="utf-8")))
        return CpuChat(Chat(self.core, template, max_length, **settings), self)

    def generate(self, prompt: str | None = None, *, trace: str | None = None, **options: Any) -> Result:
        request = self.request(prompt, **options)
        collected = Trace() if trace else None
        for _ in self.drive(request, collected):
            pass
        if collected:
            collected.write(trace)
        return request.result()


class CpuChat:
    """`say` streams a reply; `rewind` drops the last turn."""

    def __init__(self, core: Chat, pipe: CpuPipeline):
        self.core, self.pipe = core, pipe
        self.last: Request | None = None

    def say(self, content: str, max_new_tokens: int | None = None) -> Iterator[Chunk]:
        self.last = self.core.say(content, max_new_tokens)
        yield from self.pipe.drive(self.last)

    def rewind(self) -> None:
        self.pipe.driver.drive(self.core.rewind())

    @property
    def tokens(self) -> list[int]:
        return self.core.gen.tokens


def read_inputs(specs: list[str]) -> dict[str, np.ndarray]:
    """`NAME=FILE.npy` pairs (the CLI's --input) as arrays for named session inputs."""
    inputs = {}
    for spec in specs:
        name, sep, file = spec.partition("=")
        if not sep or not name or not file:
            raise GenerationError(f"--input takes NAME=FILE.npy, found {spec!r}")
        try:
            inputs[name] = np.load(file, allow_pickle=False)
        except (OSError, ValueError) as e:
            raise GenerationError(f"--input {name}: cannot read {file} as a .npy array: {e}") from None
    return inputs


Progress = Callable[[str], None]


def load(model_dir: str | os.PathLike[str], *, provider: str | None = None, threads: int | None = None,
         on_progress: Progress | None = None) -> CpuPipeline:
    """Load a model folder (genai_config.json v1 or v2, or a detected export) for onnxruntime.

    `on_progress` receives a line of text as each session starts and ends loading.
    """
    start = time.perf_counter()
    path = Path(model_dir)
    if not path.is_dir():
        raise ConfigError(f"model folder {path} does not exist or is not a directory")
    plan, sessions = build_plan(path, provider, threads, on_progress)
    tokenizer = HFTokenizer(path / "tokenizer.json") if (path / "tokenizer.json").is_file() else None
    core = Pipeline(plan, CpuBackend(), tokenizer)
    return CpuPipeline(core, Driver(sessions), (time.perf_counter() - start) * 1000, path)


def build_plan(path: Path, provider: str | None = None, threads: int | None = None,
               on_progress: Progress | None = None) -> tuple[Plan, dict[str, ort.InferenceSession]]:
    config = load_config(LocalFolder(path))
    used = {s.run for s in config.pipeline.flow}
    wanted = [(n, s) for n, s in config.pipeline.sessions.items() if n in used and (path / s.file).is_file()]
    sessions = {}
    for i, (name, spec) in enumerate(wanted, 1):
        start = time.perf_counter()
        if on_progress:
            size = _folder_bytes(path / spec.file) / 1e6
            on_progress(f"loading session {i}/{len(wanted)} {name} ({spec.file}, {size:.1f} MB)")
        sessions[name] = open_session(path, spec, provider, threads)
        if on_progress:
            on_progress(f"loaded {name} in {time.perf_counter() - start:.1f} s")
    plan = make_plan(config, {n: signature_of(s) for n, s in sessions.items()})
    return plan, sessions


def _folder_bytes(onnx_file: Path) -> int:
    """The graph file plus external data files beside it (a rough size for progress messages)."""
    data = [p for p in onnx_file.parent.glob(onnx_file.name + "*") if p.is_file()]
    data += [p for p in onnx_file.parent.glob("*.data") if p.is_file() and p not in data]
    return sum(p.stat().st_size for p in data)


__all__ = ["CpuPipeline", "Driver", "GenerationError", "load", "build_plan"]
