"""The CPython driver: the core's work items carried out by onnxruntime, tensors as numpy arrays.

Plain `run()` is zero-copy on CPU. Sessions whose cache is one shared past/present buffer run
through an IOBinding kept between steps: the buffers are bound once, and only the inputs that
changed are bound again. Fused greedy decode steps (`Decode`) skip the generic step's feeds dict
and kernel runs: the id is written into a bound input, and the argmax is taken of logits that
onnxruntime wrote into a preallocated array.
"""

from __future__ import annotations

import math
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import onnxruntime as ort

from ...errors import OrtpipeError
from ...execute.work import Decode, Decoded, Open, Opened, ReadGraph, ReadWheel, Run, RunAll, Select, drive
from ...kernels import kernel_file, kernel_kind
from ...trace import Span, Trace
from . import providers
from .sampling import Picker
from .sessions import ORT_TYPES, signature_of
from .speculate import speculate

# A burst of fused decode steps (one `Decode`) stops once it has run this long, so that a stream's
# chunks keep coming and an interrupt lands soon: on a model whose step takes longer, a burst is one step.
BURST_SECONDS = 0.02


def _argmax_last(logits: np.ndarray) -> list[np.ndarray]:
    rows = logits[:, -1]
    tokens = rows.argmax(-1)
    if not np.isfinite(rows[np.arange(len(rows)), tokens]).all():
        raise FloatingPointError(NON_FINITE)
    return [tokens]


NON_FINITE = "the model's logits are NaN or infinite"


def _argmax_all(logits: np.ndarray) -> list[np.ndarray]:
    tokens = logits.argmax(-1)
    if not np.isfinite(np.take_along_axis(logits, tokens[..., None], -1)).all():
        raise FloatingPointError(NON_FINITE)
    return [tokens]


def _gather_seq(x: np.ndarray, index: np.ndarray) -> list[np.ndarray]:
    y = np.empty((x.shape[0], x.shape[1], index.shape[1], x.shape[3]), x.dtype)
    for r in range(x.shape[0]):  # a take a row: twenty times numpy's take_along_axis here
        np.take(x[r], index[r], axis=1, out=y[r])
    return [y]


def _checked(row: np.ndarray, session: str, position: int) -> int:
    """The argmax of a row of logits, which must be finite there (NaN wins numpy's argmax)."""
    token = int(row.argmax())
    if not math.isfinite(row.item(token)):  # a Python float: numpy's ufunc on a scalar costs µs a step
        raise OrtpipeError(f'session "{session}" gave NaN or infinite logits on the decode step at position '
                           f"{position}: the model's weights or inputs are broken")
    return token


def _narrow(x: np.ndarray, start: np.ndarray, end: np.ndarray, axis: np.ndarray) -> list[np.ndarray]:
    index = [slice(None)] * x.ndim
    index[int(axis[0])] = slice(int(start[0]), int(end[0]))
    return [np.ascontiguousarray(x[tuple(index)])]


def _put_rows(x: np.ndarray, rows: np.ndarray, values: np.ndarray, length: np.ndarray) -> list[np.ndarray]:
    end = int(length[0])
    x[rows, :, :end] = values[:, :, :end]  # in place: the batch's buffer, which its rows' runs are bound to
    return [x]


def _selected(row: np.ndarray, session: str, position: int, picker: Picker | None) -> int:
    return _checked(row, session, position) if picker is None else picker.select(row, session, position)


# numpy twins of kernel graphs whose onnxruntime call costs more than the work (about 50 µs a run
# here, against 3 µs for an argmax); tests/test_kernels.py checks each twin against its graph.
# put_rows copies only the positions a row has seen, in place.
NATIVE_KERNELS = {"argmax_last": _argmax_last, "argmax_all": _argmax_all, "narrow": _narrow,
                  "put_rows": _put_rows, "gather_seq": _gather_seq}


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
    """What fused decode steps of one session keep between steps besides the cache: for a shared
    buffer, the input id (and position) written in place, attention masks as views of one row of
    ones, logits into a preallocated array, all bound; for a concat cache, the row of ones, where
    the presents and logits are among the outputs, and the run."""

    def __init__(self) -> None:
        self.buffer: Any = None  # shared: the first cache buffer it is bound for
        self.step: Any = None  # the FusedStep it was made for
        self.runs = -1  # the binding's generic run count when it was bound
        self.ids = self.positions = self.logits = self.flat = self.ones = np.empty(0)
        self.keep: list[Any] = []  # OrtValues the binding refers to
        self.values: dict[str, Any] = {}  # shared: the OrtValues bound to the ids, positions and logits
        self.widths: dict[int, Any] = {}  # shared: arrays bound for runs of several tokens (speculate.py)
        self.presents: list[tuple[str, int]] = []  # concat: (past input, its present's index in the outputs)
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
    """Carries out the core's work on onnxruntime sessions: one work generator at a time (a lock
    makes a second thread wait for the step being run, so requests from several threads interleave
    step by step)."""

    def __init__(self, overrides: providers.Overrides | None = None, threads: int | None = None,
                 on_progress: Any = None):
        self.overrides, self.threads, self.on_progress = overrides or {}, threads, on_progress
        self.sessions: dict[str, Any] = {}
        self.assignments: dict[str, providers.Assignment] = {}  # session -> where onnxruntime placed it
        self._bindings: dict[str, _Binding] = {}
        self._fused: dict[str, _Fused] = {}
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.RLock()
        self.trace: Trace | None = None  # set while a traced request runs
        self._label = ""

    def drive(self, work: Any, trace: Trace | None = None) -> Any:
        """Carry out a core generator's work until it returns; its return value. `trace` collects
        the runs (each thread's request its own: the lock holds for the whole work)."""
        with self._lock:
            self.trace = trace
            try:
                return drive(work, self.execute)
            finally:
                self.trace = None


    def execute(self, work: Any) -> Any:
        kind = type(work)
        if kind is Decode:
            return self.decode(work)
        if kind is Run:
            return self.run(work)
        if kind is RunAll:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="ortpipe")
            return list(self._pool.map(self.run, work.runs))  # onnxruntime releases the GIL in run()
        if kind is Open:
            return self.open(work)
        if kind is Select:
            row = np.asarray(work.logits)
            vocab = row.shape[-1]
            try:
                return Picker(work.pick, vocab).select(row.reshape(-1, vocab)[-1], work.step, work.position)
            except OrtpipeError:  # the Picker's words are a decode step's
                raise OrtpipeError(work.non_finite()) from None
        if kind is ReadGraph or kind is ReadWheel:
            return work.path  # a checked path: the core reads the graph, Python imports the wheel
        raise OrtpipeError(f"the CPython driver got work it does not know: {type(work).__name__}")

    def open(self, work: Open) -> Opened:
        spec = work.spec
        start = time.perf_counter()
        if self.on_progress:
            self.on_progress(f"loading session {spec.name} ({spec.file})")
        override = providers.override_for(self.overrides, spec.name)
        session, assignment = providers.open_session(work.path, spec, override, threads=self.threads,
                                                     optimized_for=work.optimized_for)
        self.sessions[spec.name], self.assignments[spec.name] = session, assignment
        if self.on_progress:
            self.on_progress(f"loaded {spec.name} in {time.perf_counter() - start:.1f} s")
        return Opened(session, signature_of(session))

    def run(self, work: Run) -> dict[str, Any]:
        if self.trace is None:
            return self._run(work)
        start = time.perf_counter_ns()
        out = self._run(work)
        shapes = {k: list(getattr(v, "shape", ())) for k, v in work.feeds.items()}
        self._label = work.label or self._label  # kernels run inside the step that asked for them
        self.trace.add(
            Span(
                work.session,
                self._label,
                start / 1000,
                time.perf_counter_ns() / 1000,
                threading.get_ident(),
                shapes,
            )
        )
        return out

    # fused decode steps

    def decode(self, d: Decode) -> Decoded:
        """`d.limit` decode steps at most, stopping after an eos or once BURST_SECONDS have passed;
        each selects the argmax, or as `d.pick` says. A traced request runs one step per Decode, so
        that every step has its own label. A Decode that speculates runs speculative rounds instead
        (speculate.py)."""
        if d.speculation is not None:
            return speculate(self, d, BURST_SECONDS)
        picker = Picker(d.pick, d.step.logits_shape[-1]) if d.pick is not None else None
        if d.step.layout == "shared":
            f, cache = self._shared(d), d.cache
        else:  # the core's cache stays as it was until the answer hands this one over
            f, cache = self._concat(d), dict(d.cache)
        burst = d.limit > 1 and self.trace is None
        end = time.perf_counter() + BURST_SECONDS if burst else 0.0  # one step: no clock read
        step = self._stepper(d, f, cache, picker)
        return Decoded(self._steps(step, d.token, d.position, d.limit if burst else 1, d.eos, end), cache)

    def _stepper(self, d: Decode, f: _Fused, cache: dict[str, Any], picker: Picker | None) -> Any:
        """The fused step of `d` over `f` (a concat cache's runs replace the pasts in `cache`):
        (token, position) -> the token it selects."""
        if d.step.layout == "shared":
            return lambda token, position: self._shared_step(d, f, picker, token, position)
        return lambda token, position: self._concat_step(d, f, cache, picker, token, position)

    @staticmethod
    def _steps(step: Any, token: int, position: int, n: int, eos: frozenset[int], end: float) -> list[int]:
        """Up to n steps from `token` at `position`, stopping after an eos or at `end` (the first always
        runs): the tokens they selected."""
        tokens = [step(token, position)]
        while len(tokens) < n and tokens[-1] not in eos and time.perf_counter() < end:
            tokens.append(step(tokens[-1], position + len(tokens)))
        return tokens

    def _shared_step(self, d: Decode, f: _Fused, picker: Picker | None, token: int, position: int) -> int:
        """A step over a shared buffer: the id written into the bound input array, a ready mask
        bound, and the argmax of logits that onnxruntime wrote into a preallocated array."""
        f.ids[0, 0] = token
        if f.positions.size:
            f.positions[0, 0] = position
        if f.mask_name is not None:
            f.raw.bind_ortvalue_input(f.mask_name, f.mask(position + 1))
        self._fused_run(d, position, f.run, f.raw, None)
        return _selected(f.flat, d.step.session, position, picker)

    def _concat_step(
        self, d: Decode, f: _Fused, cache: dict[str, Any], picker: Picker | None, token: int, position: int
    ) -> int:
        """A step over a concat cache: a plain run whose presents replace the pasts in `cache`."""
        ids, mask, positions = d.step.ids, d.step.mask, d.step.positions
        feeds = dict(cache)
        if d.fixed:
            feeds.update(d.fixed)
        feeds[ids[0]] = np.full((1, 1), token, ids[1])
        if mask:
            feeds[mask[0]] = f.ones[:, : position + 1]
        if positions:
            feeds[positions[0]] = np.full((1, 1), position, positions[1])
        values = self._fused_run(d, position, f.run, d.step.outputs, feeds, None)
        for past, i in f.presents:
            cache[past] = values[i]
        logits = values[f.logits_at]
        return _selected(logits.reshape(-1, logits.shape[-1])[-1], d.step.session, position, picker)

    def _fused_run(self, d: Decode, position: int, run: Any, *args: Any) -> Any:
        """`run(*args)`, the run of a fused step: its failure named, its span traced."""
        start = time.perf_counter_ns() if self.trace is not None else 0
        try:
            values = run(*args)
        except Exception as e:
            raise OrtpipeError(
                f'session "{d.step.session}" failed on a decode step at position {position}: {e}'
            ) from e
        if start:
            self._label = d.label
            self.trace.add(
                Span(
                    d.step.session,
                    self._label,
                    start / 1000,
                    time.perf_counter_ns() / 1000,
                    threading.get_ident(),
                    {d.step.ids[0]: [1, 1]},
                )
            )
        return values

    def _concat(self, d: Decode) -> _Fused:
        f = self._fused.get(d.step.session)
        if f is not None and f.step is d.step and f.ones.shape[-1] >= d.capacity:
            return f
        f = self._fused[d.step.session] = _Fused()
        f.step, f.run = d.step, self.sessions[d.step.session]._sess.run  # the C++ call under the wrapper
        if d.step.mask:
            f.ones = np.ones((1, d.capacity), d.step.mask[1])
        outputs = d.step.outputs
        f.presents = [(past, outputs.index(present)) for present, past in d.step.presents.items()]
        f.logits_at = outputs.index(d.step.logits)
        return f

    def _shared(self, d: Decode) -> _Fused:
        """The session bound for fused steps over `d.cache` (bound again after any generic run on it,
        or for another request's buffers)."""
        f = self._fused.get(d.step.session)
        first = d.cache[next(iter(d.step.presents.values()))]
        if f is not None and f.buffer is first and f.runs == f.binding.runs:
            return f
        step = d.step
        session = self.sessions[step.session]
        b = self._bindings.get(step.session)
        if b is None:
            b = self._bindings[step.session] = _Binding(session)
        if any(b.inplace.get(out) is not d.cache[inp] for out, inp in step.presents.items()):
            self._rebind_outputs(b, Run(step.session, dict(d.cache), step.outputs, dict(step.presents)))
        for inp in step.presents.values():
            if b.inputs.get(inp) is not d.cache[inp]:
                b.io.bind_ortvalue_input(inp, b.inplace_inputs[inp])
                b.inputs[inp] = d.cache[inp]
        f = self._fused.get(step.session) or _Fused()
        f.keep, f.values, f.widths = [], {}, {}

        def bind_array(name: str, array: np.ndarray) -> np.ndarray:
            value = f.values[name] = ort.OrtValue.ortvalue_from_numpy(array)
            f.keep.append(value)
            b.io.bind_ortvalue_input(name, value)
            b.inputs[name] = array  # a generic run of the same shape copies into it
            return array

        f.ids = bind_array(step.ids[0], np.zeros((1, 1), step.ids[1]))
        f.positions = (
            bind_array(step.positions[0], np.zeros((1, 1), step.positions[1]))
            if step.positions
            else np.empty(0)
        )
        f.mask_name = step.mask[0] if step.mask else None
        if step.mask:
            b.inputs.pop(step.mask[0], None)
            if f.ones.shape != (1, d.capacity) or f.ones.dtype != np.dtype(step.mask[1]):
                f.ones = np.ones((1, d.capacity), step.mask[1])
                f.masks = [None] * (d.capacity + 1)
        types = {o.name: o.type for o in session.get_outputs()}
        f.logits = np.empty(step.logits_shape, ORT_TYPES[types[step.logits]])
        f.flat = f.logits.reshape(-1)
        logits = f.values[step.logits] = ort.OrtValue.ortvalue_from_numpy(f.logits)
        f.keep.append(logits)
        b.io.bind_ortvalue_output(step.logits, logits)
        f.step, f.buffer, f.runs, f.binding, f.raw = step, first, b.runs, b, b.raw
        f.run = session._sess.run_with_iobinding  # the C++ call under the Python wrapper
        self._fused[step.session] = f
        return f

    # generic runs

    def _run(self, work: Run) -> dict[str, Any]:
        session = self.sessions.get(work.session) or self._kernel(work.session)
        try:
            if work.inplace and not isinstance(session, NativeKernel):  # a native kernel writes in place
                return self._run_bound(session, work)
            return dict(zip(work.outputs, session.run(work.outputs, work.feeds), strict=True))
        except Exception as e:
            shapes = ", ".join(f"{k} {list(getattr(v, 'shape', ()))}" for k, v in work.feeds.items())
            where = f" ({work.label})" if work.label else ""
            raise OrtpipeError(f'session "{work.session}" failed{where}: {e}\n  inputs: {shapes}') from e

    def _kernel(self, name: str) -> Any:
        native = NATIVE_KERNELS.get(kernel_kind(name))
        if native is not None:
            self.sessions[name] = NativeKernel(native)
            return self.sessions[name]
        options = ort.SessionOptions()
        options.intra_op_num_threads = 1  # kernels are tiny: a thread pool costs more than it saves
        session = ort.InferenceSession(str(kernel_file(name)), options, providers=["CPUExecutionProvider"])
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


_CPU = ort.capi._pybind_state.OrtDevice(
    ort.capi._pybind_state.OrtDevice.cpu(), ort.capi._pybind_state.OrtDevice.default_memory(), 0
)
