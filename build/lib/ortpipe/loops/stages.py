"""Multi-stage pipelines (pipeline.stages): each stage a model of its own, their work interleaved.

A `StagedModel` holds one loaded `Model` per stage (config/stages.py). A `StagedRequest` runs the first
stage on what the caller asks and each later stage on what earlier stages made, as the wires between
them say: the ids a stage generated ("SESSION.tokens"), an output its step accumulated, an init output.
A later stage starts once every stage it reads is done, except through streamed wires: then it starts
as soon as its first run's rows exist, and before each of its runs the rows its positions need are cut
from the accumulated output (zeros past its end once the producing stage is done).

Each advance runs one step of one stage: the latest stage that can run (what it reads exists), so a
downstream stage runs as soon as it can (the talker's first token comes right after the thinker's
prefill), and an upstream stage runs when a later one waits for it. It is all one sans-IO work
generator, so both targets drive it unchanged; each run's trace label starts with its stage's name.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from ..config.schema import TOKENS_OUTPUT, Config, Stage, Wire
from ..errors import GenerationError
from ..execute.work import Handle, Run, RunAll, Work, kernel
from ..plan import LOOP, STREAM
from ..request import Result


@dataclass(frozen=True)
class StageChunk:
    """What one advance of a staged request made: a stage's chunk (a token `Chunk`, or a `Progress` of a
    loop that makes no tokens)."""

    stage: str
    chunk: Any

    @property
    def token(self) -> int | None:
        return getattr(self.chunk, "token", None)

    @property
    def text(self) -> str:
        """The first stage's text (what the caller reads); later stages' chunks have none."""
        return getattr(self.chunk, "text", "") or ""


class StagedModel:
    """The loaded stages of a pipeline.stages config; `request` makes a StagedRequest."""

    def __init__(self, config: Config, models: dict[str, Any]):
        self.config, self.models = config, models
        first = models[config.pipeline.stages[0].name]
        self.plan, self.tokenizer, self.folder = first.plan, first.tokenizer, first.folder
        self.backend = first.backend
        self.load_ms = 0.0
        self.loop = None
        self.drafts: dict[str, Any] = {}

    @property
    def stages(self) -> tuple[Stage, ...]:
        return self.config.pipeline.stages

    def request(self, prompt: str | None = None, **options: Any) -> Work:
        """The first stage's request as the caller asks (its settings), the later stages' as their configs
        say."""
        first = yield from self.models[self.stages[0].name].request(prompt, **options)
        gen = getattr(first, "gen", None)
        if self.config.pipeline.stages[0].config.generation.loop == "autoregressive" and (
                gen is None or gen.speculator is not None):
            raise GenerationError("the first stage of a pipeline of stages runs one sequence step by step: "
                                  "beam search and speculative decoding are not run here; drop them")
        made = StagedRequest(self, first)
        made.timings.load_ms = self.load_ms
        return made

    def prepare(self, settings: Any) -> Work:
        return (yield from self.models[self.stages[0].name].prepare(settings))

    def check_media(self, images: bool, audios: bool, mask: bool = False) -> None:
        """The first stage's: the request's images, audio and mask go to it."""
        self.models[self.stages[0].name].check_media(images, audios, mask)

    def _only_requests(self, *_: Any, **__: Any) -> Any:
        raise GenerationError("a pipeline of stages runs requests (generate, stream), not chats, step-wise "
                              "generators or embeddings")

    chat = generator = embed = _only_requests


class _Runner:
    """One stage of a request: its request once started, and what it reads of earlier stages."""

    def __init__(self, stage: Stage, model: Any):
        self.stage, self.model = stage, model
        self.request: Any = None
        wires = stage.config.pipeline.stage_inputs
        fed = {f.source for s in model.plan.all_steps for f in s.feeds if f.kind == LOOP}
        # rows cut before each run, as they are made (streamed) or once the producer is done
        self.streams = [w for w in wires if f"{STREAM}{w.source}" in fed]
        self.waits = [w for w in wires if not w.stream]  # what must be done before this stage runs

    @property
    def name(self) -> str:
        return self.stage.name

    @property
    def done(self) -> bool:
        return self.request is not None and self.request.done


class StagedRequest:
    """A request over every stage, advanced like a token Request; each advance returns StageChunks."""

    def __init__(self, model: StagedModel, first: Any):
        self.model = model
        self.runners = [_Runner(s, model.models[s.name]) for s in model.stages]
        self.runners[0].request = first
        self.by_session = {session: r for r in self.runners for session in r.stage.sessions}
        self.timings = first.timings
        self.settings = getattr(first, "settings", None)
        self._interrupted = False

    @property
    def done(self) -> bool:
        """Every stage is done (after an interrupt: every stage that started)."""
        return all(r.done or (self._interrupted and r.request is None) for r in self.runners)

    @property
    def failed(self) -> bool:
        return any(getattr(r.request, "failed", False) for r in self.runners if r.request is not None)

    @property
    def finish_reason(self) -> str | None:
        return self.runners[0].request.finish_reason

    def interrupt(self) -> None:
        self._interrupted = True  # a stage not started yet does not start
        for r in self.runners:
            if r.request is not None:
                r.request.interrupt()

    def advance(self) -> Work:
        """One step of the latest stage that can run."""
        for runner in reversed(self.runners):
            if runner.done or not self._ready(runner) or (self._interrupted and runner.request is None):
                continue
            if runner.request is None:
                yield from self._start(runner)
            if runner.streams:
                yield from self._stream_rows(runner)
            chunks = yield from _labelled(runner.name, runner.request.advance())
            return [StageChunk(runner.name, c) for c in chunks]
        raise GenerationError("no stage of this request can run: a stage waits for one that cannot start")

    # what a stage reads

    def _ready(self, runner: _Runner) -> bool:
        if any(not self.by_session[w.from_session].done for w in runner.waits):
            return False
        if runner.request is None:
            return all(self.by_session[w.from_session].request is not None for w in runner.streams) and (
                all(self._rows_ready(runner, w, 1) for w in runner.streams))
        need = runner.request.gen.flow.position + len(runner.request.gen.pending)
        return all(self._rows_ready(runner, w, need) for w in runner.streams)

    def _rows_ready(self, runner: _Runner, w: Wire, need: int) -> bool:
        producer = self.by_session[w.from_session]
        if producer.done:
            return True
        value = producer.request.gen.flow.accumulated.get(w.source) if producer.request else None
        return value is not None and producer.model.backend.shape(value)[1] >= need

    def _start(self, runner: _Runner) -> Work:
        inputs = {w.to_input: self._value(runner, w) for w in runner.waits if w not in runner.streams}
        runner.request = yield from runner.model.request(inputs=inputs or None)

    def _value(self, runner: _Runner, w: Wire) -> Handle:
        producer = self.by_session[w.from_session]
        backend = runner.model.backend
        if w.from_output == TOKENS_OUTPUT:
            tokens = list(producer.request.tokens)
            if tokens and tokens[-1] in producer.model.config.tokens.eos:
                tokens = tokens[:-1]
            if not tokens:
                raise GenerationError(f'stage "{producer.name}" generated no ids for {w}')
            dtype = runner.model.plan.signatures[w.to_session].input(w.to_input).dtype
            return backend.tensor(tokens, (1, len(tokens)), dtype)
        flow = producer.request.gen.flow
        value = flow.accumulated.get(w.source, flow.values.get(w.source))
        if value is None:
            raise GenerationError(f'{w}: stage "{producer.name}" made no "{w.from_output}" (was it skipped?)')
        return value

    def _stream_rows(self, runner: _Runner) -> Work:
        """Before a run over positions [p, p + n): rows [p, p + n) of each streamed output."""
        gen = runner.request.gen
        start, n = gen.flow.position, len(gen.pending)
        for w in runner.streams:
            producer = self.by_session[w.from_session]
            value = producer.request.gen.flow.accumulated.get(w.source)
            rows = yield from _rows(runner.model.backend, value, start, n, runner.name)
            gen.flow.loop_inputs[f"{STREAM}{w.source}"] = rows

    def result(self) -> Result:
        results = {r.name: r.request.result() for r in self.runners if r.request is not None}
        first = results[self.runners[0].name]
        for result in results.values():
            first.outputs.update(result.outputs)
            first.kinds.update(result.kinds)
        first.stages = results
        return first


def _rows(backend: Any, value: Handle, start: int, n: int, label: str) -> Work:
    """value[:, start:start + n], with zero rows where it is shorter."""
    shape = backend.shape(value)
    dtype = backend.dtype(value)
    have = max(0, min(shape[1], start + n) - start)
    parts = []
    if have:
        ends = {"x": value, "start": backend.tensor([start], (1,), "int64"),
                "end": backend.tensor([start + have], (1,), "int64"),
                "axis": backend.tensor([1], (1,), "int64")}
        parts.append((yield Run(kernel("narrow", dtype), ends, ("y",), None, f"{label} rows"))["y"])
    if have < n:
        parts.append(backend.full((shape[0], n - have, *shape[2:]), 0, dtype))
    if len(parts) == 1:
        return parts[0]
    feeds = {"a": parts[0], "b": parts[1]}
    joined = yield Run(kernel("concat1", dtype), feeds, ("y",), None, f"{label} rows")
    return joined["y"]


def _labelled(stage: str, work: Work) -> Work:
    """`work` with every run's trace label led by the stage's name ("talker step 3")."""
    try:
        item = next(work)
        while True:
            try:
                answer = yield _relabel(stage, item)
            except BaseException as e:  # a driver's failure goes where the stage asked
                item = work.throw(e)
            else:
                item = work.send(answer)
    except StopIteration as stop:
        return stop.value


def _relabel(stage: str, item: Any) -> Any:
    if type(item) is RunAll:
        return dataclasses.replace(item, runs=[_relabel(stage, r) for r in item.runs])
    label = getattr(item, "label", None)
    if isinstance(label, str):
        return dataclasses.replace(item, label=f"{stage} {label}".rstrip())
    return item
