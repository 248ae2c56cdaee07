"""The engine: one thread that owns the loaded pipeline, a bounded queue in front of it, and a scheduler
that steps the rows being generated.

A loaded pipeline is used from one thread at a time, so every model call (chat template, tokenizer,
prefill, decode) runs on the engine thread. The event loop hands a `Job` in with `submit` (refused with
`QueueFull` once `max_batch` rows and `max_queue` waiting jobs are taken) and receives its events on the
job's asyncio queue. `cancel` (a client that left) takes a job out of the queue, or has its row
interrupted at the next step boundary, which frees the row.

The engine drives a `Scheduler`: `room()` free rows, `admit(job)` opens a row (prompt, cache, events),
`step()` advances every open row once and lets finished or cancelled rows leave, `close(error)` ends them
all. `Batched` is continuous batching (loops/batched.py): requests admitted together with fresh prompts
prefill together at the next step (one continuing a cached prompt prefills alone when admitted), their rows
join the batch, and every step is one batched decoder run for all rows, so N streams cost far less than N
times one. It serves the plans `batchable` accepts (a shared past/present buffer, or a concat cache with a
mask and position ids); for other pipelines `TimeSliced` advances the rows one after another (one burst
of fused decode steps each), so a long generation does not hold back a short one. A folder that makes
outputs (embeddings, speech, images: outputs.py) is served by `Outputs`, which advances its requests in
turn one step each.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from ..config.settings import BY_NAME
from ..errors import ConfigError, GenerationError
from ..execute.work import Work
from ..loops.batched import Batch, batchable
from ..loops.speculative import cannot_verify
from ..sampling.settings import settings_for
from .metrics import Gauges, Metrics
from .outputs import ENDPOINTS, KINDS, OutputQuery, OutputReply, OutputRow, served
from .protocol import Completion, InvalidRequest, TokenLogprob, Usage
from .rows import PromptCache, Row, chat_template, prompt_ids, slot_length

log = logging.getLogger("ortpipe.serve")
SHUTTING_DOWN = InvalidRequest("The server is shutting down.", status=503, kind="server_error")


# --- what a job receives ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class Started:
    prompt_tokens: int
    cached_tokens: int


@dataclass(frozen=True)
class Delta:
    text: str  # the text of one step (one token, or a burst); never part of a stop string
    logprobs: list[TokenLogprob] | None = None  # when the request asked for them: one per token of the step


@dataclass(frozen=True)
class Finished:
    finish_reason: str  # eos, stop, length or interrupt
    usage: Usage


@dataclass(frozen=True)
class Failed:
    error: InvalidRequest  # status and OpenAI error object


@dataclass(frozen=True)
class Made:
    reply: OutputReply  # an output endpoint's whole answer


Event = Started | Delta | Finished | Failed | Made


class Job:
    """One request's passage through the engine. Made on the event loop, which reads `events`."""

    def __init__(self, job_id: str, completion: Completion | OutputQuery, loop: asyncio.AbstractEventLoop):
        self.id, self.completion, self._loop = job_id, completion, loop
        self.events: asyncio.Queue[Event] = asyncio.Queue()
        self.cancelled = False  # set by the event loop; the engine reads it between steps
        self.arrived = time.monotonic()
        self.first_token = 0.0

    def emit(self, event: Event) -> None:
        """Called on the engine thread."""
        self._loop.call_soon_threadsafe(self.events.put_nowait, event)


class QueueFull(Exception):
    def __init__(self, retry_after: int):
        super().__init__(f"retry after {retry_after} s")
        self.retry_after = retry_after


class NotReady(Exception):
    """The model is still loading, or the engine is stopping."""


# --- schedulers ------------------------------------------------------------------------------------------

class Scheduler(Protocol):
    def room(self) -> int: ...

    def admit(self, job: Job) -> None: ...

    def step(self) -> None: ...

    def close(self, error: InvalidRequest) -> None: ...

    @property
    def rows(self) -> int: ...


class Slots:
    """What schedulers share: up to `max_rows` open requests (in admission order, the order they are stepped
    in), their metrics, and how a job leaves or fails."""

    def __init__(self, pipe: Any, max_rows: int, metrics: Metrics, leave: Callable[[Job], None]):
        self.pipe, self.max_rows, self.metrics, self._leave = pipe, max_rows, metrics, leave
        self.open: dict[Job, Any] = {}

    @property
    def rows(self) -> int:
        return len(self.open)

    def room(self) -> int:
        return self.max_rows - len(self.open)

    def _fail(self, job: Job, e: Exception) -> None:
        """Tell a job why it failed (a refused request is a 400, a bug a 500), count it, let it leave."""
        if isinstance(e, InvalidRequest):
            error = e
        elif isinstance(e, GenerationError):
            param = _param(e.setting, job.completion)
            error = InvalidRequest(str(e), param, "invalid_value" if param else None)
        else:
            log.exception("%s failed", job.id)
            error = InvalidRequest(
                f"The server failed on this request: {type(e).__name__}: {e}", status=500, kind="server_error"
            )
        job.emit(Failed(error))
        self.metrics.finish("error", 0, 0, time.monotonic() - job.arrived)
        log.info("%s error=%d %s", job.id, error.status, error.message)
        self._leave(job)


class TimeSliced(Slots):
    """Up to `max_rows` requests, each with its own KV cache, stepped in turn on one pipeline."""

    def __init__(self, pipe: Any, max_rows: int, cache_size: int, metrics: Metrics,
                 leave: Callable[[Job], None], defaults: dict[str, Any] | None = None):
        super().__init__(pipe, max_rows, metrics, leave)
        self.template = chat_template(pipe)
        self.cache = PromptCache(pipe, cache_size, slot_length(pipe), defaults=dict(defaults or {}))

    def admit(self, job: Job) -> None:
        if job.cancelled:
            self._leave(job)
            return
        try:
            row = self.cache.open(prompt_ids(self.pipe, self.template, job.completion), job.completion)
        except Exception as e:  # a refused request, a template that refused the messages, or a bug
            self._fail(job, e)
            return
        self.open[job] = row
        job.emit(Started(row.prompt_tokens, row.cached_tokens))

    def step(self) -> None:
        self.metrics.step(len(self.open))
        for job, row in list(self.open.items()):
            if job.cancelled:
                self._finish(job, row, "interrupt")
                continue
            try:
                chunks = row.step()
            except Exception as e:  # a failing run ends its own request only
                self._drop(job, row, e)
                continue
            self._advanced(job, row, chunks)

    def _advanced(self, job: Job, row: Row, chunks: list[Any]) -> None:
        """Send the chunks of a step of the row; a row that is done leaves."""
        self._emit(job, chunks)

        if row.request.done:
            self._finish(job, row, row.request.finish_reason)

    def _drop(self, job: Job, row: Row, error: Exception) -> None:
        del self.open[job]
        row.close()
        self._fail(job, error)

    def close(self, error: InvalidRequest) -> None:
        for job, row in list(self.open.items()):
            del self.open[job]
            row.close()
            self._fail(job, error)

    def _emit(self, job: Job, chunks: list[Any]) -> None:
        if not job.first_token:
            job.first_token = time.monotonic()
            self.metrics.first_token(job.first_token - job.arrived)
        self.metrics.tokens(len(chunks))
        text = "".join(c.text for c in chunks)
        logprobs = None
        if job.completion.settings.get("logprobs") is not None:
            name = self._token_text
            logprobs = [
                TokenLogprob(name(c.token), c.logprob, tuple((name(t), lp) for t, lp in c.top_logprobs))
                for c in chunks
            ]
        if text or logprobs:
            job.emit(Delta(text, logprobs))

    def _token_text(self, token: int) -> str:
        tokenizer = self.pipe.tokenizer
        return tokenizer.decode([token], skip_special_tokens=False) if tokenizer else str(token)

    def _finish(self, job: Job, row: Row, reason: str) -> None:
        del self.open[job]
        row.close()
        self.cache.keep(row)
        t = row.request.timings
        spec = row.request.gen.speculator if row.predicted else None
        accepted, drafted = (spec.predicted_accepted, spec.predicted_drafted) if spec else (0, 0)
        usage = Usage(row.prompt_tokens, len(row.request.tokens), row.cached_tokens, accepted,
                      drafted - accepted)
        job.emit(Finished(reason, usage))
        now = time.monotonic()
        self.metrics.finish(reason, usage.prompt_tokens, usage.cached_tokens, now - job.arrived,
                            t.drafted_tokens, t.accepted_tokens)
        _log_line(job, usage, reason, now, t.drafted_tokens, t.accepted_tokens)
        self._leave(job)


class Batched(TimeSliced):
    """Up to `max_rows` requests as rows of one batched decoder run: continuous batching. Requests admitted
    together with fresh prompts prefill together, in one run, at the next step; one that continues a cached
    prompt prefills alone and joins.

    Requests that speculate (prompt lookup or a draft model) check their drafts in the batch's runs where it
    checks them together (a concat cache: Batch.speculate), and run their own speculative rounds out of the
    batch, several tokens a run, a burst each a step: one that is the only one open; and all of them, when
    every open request speculates and, measured alone, they made more tokens a second than the batch
    makes for all its rows (extractive work: a prompt or a prediction the text copies; rows not measured
    yet go by those that are). Otherwise they are rows of the batch (one token a run each on a shared
    buffer), and one of them runs a burst alone FIRST_PROBE batched steps after none is measured and every
    PROBE_EVERY after that, so that their rates are known. A row that ran alone joins the batch again
    before the batch steps. Either way a request's tokens are the ones it makes alone (speculation keeps
    greedy and seeded sampled tokens), on graphs whose runs compute each row as alone (not q8 graphs, which
    quantize a run's activations with one scale: README, "Serve")."""

    def __init__(
        self, pipe: Any, max_rows: int, cache_size: int, metrics: Metrics, leave: Callable[[Job], None],
        defaults: dict[str, Any] | None = None,
    ):
        super().__init__(pipe, max_rows, cache_size, metrics, leave, defaults)
        self.batch = self._new_batch()
        self.fresh: list[Job] = []  # admitted, to prefill together at the next step
        self.batch_rate = 0.0  # tokens a second of the batched steps, all rows together (a moving average)
        self.alone_rates: dict[Job, float] = {}  # tokens a second of a speculating row's bursts alone
        self.since_probe = 0  # batched steps since a speculating row last ran alone
        self.probed: dict[Job, int] = {}  # the engine step at which each row last ran alone (probes in turn)

    def admit(self, job: Job) -> None:
        """Open the row; a fresh prompt waits to prefill with the others, a cached one prefills alone now and
        joins the batch, unless it is done already."""
        super().admit(job)
        row = self.open.get(job)
        if row is None:
            return
        if self.batch.prefills_together and row.gen.core.flow.iterations == 0:
            self.fresh.append(job)
            return
        try:
            chunks = self.pipe.driver.drive(row.request.advance())
            if not row.request.done:
                self.pipe.driver.drive(self.batch.join(row.gen.core))
        except Exception as e:  # a failing prefill ends its own request only
            self._drop(job, row, e)
            return
        self._advanced(job, row, chunks)

    def step(self) -> None:
        self.metrics.step(len(self.open))
        self._cancel()
        turn = self._speculating_turn()
        if turn:
            for job, row in turn:
                self._step_alone(job, row)
            return
        if self.fresh:
            self._prefill_fresh()
        if not self.open:
            return
        self._rejoin()
        if not self.open:
            return
        rows = {row.gen.core: (job, row) for job, row in self.open.items()}
        start = time.perf_counter()
        try:
            new = self.pipe.driver.drive(self._batch_step([rows[gen][1] for gen in self.batch.rows]))
        except Exception as e:  # every row of the failed run ends; the next requests start a new batch
            self.batch = self._new_batch()
            for job, row in list(self.open.items()):
                self._drop(job, row, e)
            return
        elapsed = (time.perf_counter() - start) * 1000
        self.batch_rate = _average(self.batch_rate, sum(map(len, new)) / max(elapsed / 1000, 1e-6))
        self.since_probe += 1
        for gen, tokens in zip(list(self.batch.rows), new, strict=True):
            job, row = rows[gen]
            chunks = row.request.accept(tokens, elapsed)
            if row.request.done:
                self._leave_batch(row)
                if len(chunks) < len(tokens):  # a stop string before the last: the rest is not the request's
                    self._take_back(job, row, len(tokens) - len(chunks))
            self._advanced(job, row, chunks)

    def _batch_step(self, rows: list[Row]) -> Work:
        """A step of the batch: speculating rows check their drafts in it where the batch checks them
        together (a concat cache), else one token a row. Each row's new tokens."""
        if self.batch.verifies_together and any(row.request.gen.speculator is not None for row in rows):
            return (yield from self.batch.speculate([row.request.budget for row in rows]))
        return [[token] for token in (yield from self.batch.step())]

    def _take_back(self, job: Job, row: Row, n: int) -> None:
        try:
            self.pipe.driver.drive(row.gen.core.take_back(n))
        except Exception as e:  # its cache cannot be trusted: not kept for a later prompt
            row.kept = False
            log.warning("%s: taking back %d tokens after a stop string failed: %s", job.id, n, e)

    def _new_batch(self) -> Batch:
        return Batch(self.pipe.plan, self.pipe.model.backend, self.cache.length, self.max_rows)

    def _cancel(self) -> None:
        """Rows whose clients left end, and leave the batch."""
        for job, row in list(self.open.items()):
            if job.cancelled:
                if job in self.fresh:  # never ran: nothing for the prompt cache
                    self.fresh.remove(job)
                    row.kept = False
                self._leave_batch(row)
                self._finish(job, row, "interrupt")

    def _speculating_turn(self) -> list[tuple[Job, Row]]:
        """The rows to run alone this step, a burst of speculative rounds each (see the class), or none."""
        rows = list(self.open.items())
        if not rows or self.fresh or any(row.request.gen.speculator is None for _, row in rows):
            return []
        rates = [self.alone_rates.get(job) for job, _ in rows]
        # the first probe comes as soon as the batch's rate is known: until one row is measured, there is
        # nothing to choose by
        due = FIRST_PROBE if all(rate is None for rate in rates) else PROBE_EVERY
        choice = alone_or_batched(rates, self.batch_rate, self.since_probe >= due)
        if choice == "probe":  # the row measured longest ago (or never) runs alone once
            self.since_probe = 0
            return [min(rows, key=lambda item: (item[0] in self.alone_rates, self.probed.get(item[0], 0)))]
        return rows if choice == "alone" else []

    def _step_alone(self, job: Job, row: Row) -> None:
        """A burst of the request's speculative rounds on its own cache, out of the batch."""
        if job not in self.open:  # a row of this turn that ended in an earlier one's
            return
        self.probed[job] = self.metrics.steps
        try:
            if row.gen.core in self.batch.rows:
                self.pipe.driver.drive(self.batch.leave(row.gen.core))
        except Exception as e:  # its cache may be half copied: it ends, and a new batch starts
            self.batch = self._new_batch()
            self._drop(job, row, e)
            return
        start = time.perf_counter()  # the rate of its bursts, not of copying its cache out of the batch
        try:
            chunks = self.pipe.driver.drive(row.request.advance())
        except Exception as e:  # a failing run ends its own request only
            self._drop(job, row, e)
            return
        rate = len(chunks) / max(time.perf_counter() - start, 1e-6)
        self.alone_rates[job] = _average(self.alone_rates.get(job, 0.0), rate)
        self._advanced(job, row, chunks)

    def _finish(self, job: Job, row: Row, reason: str) -> None:
        self._forget(job)
        super()._finish(job, row, reason)

    def _drop(self, job: Job, row: Row, error: Exception) -> None:
        self._forget(job)
        super()._drop(job, row, error)

    def _forget(self, job: Job) -> None:
        self.alone_rates.pop(job, None)
        self.probed.pop(job, None)

    def _rejoin(self) -> None:
        """Rows that ran alone (speculating) join the batch again before it steps."""
        for job, row in list(self.open.items()):
            if row.gen.core in self.batch.rows:
                continue
            try:
                self.pipe.driver.drive(self.batch.join(row.gen.core))
            except Exception as e:  # a row that cannot join ends alone
                self._drop(job, row, e)

    def _prefill_fresh(self) -> None:
        """The fresh rows' prompts in one run; each row's first token; rows that are done leave."""
        jobs, self.fresh = self.fresh, []
        rows = [self.open[job] for job in jobs]
        start = time.perf_counter()
        try:
            tokens = self.pipe.driver.drive(self.batch.prefill([row.gen.core for row in rows]))
        except Exception as e:  # the rows of the failed prefill end; the batch goes on without them
            for job, row in zip(jobs, rows, strict=True):
                self._drop(job, row, e)
            return
        elapsed = (time.perf_counter() - start) * 1000
        for job, row, token in zip(jobs, rows, tokens, strict=True):
            chunks = row.request.accept([token], elapsed)
            if row.request.done:
                self._leave_batch(row)
            self._advanced(job, row, chunks)

    def _leave_batch(self, row: Row) -> None:
        if row.gen.core in self.batch.rows:
            self.pipe.driver.drive(self.batch.leave(row.gen.core))


class Outputs(Slots):
    """Up to `max_rows` requests of an output endpoint (embeddings, speech, images), advanced in turn one
    step each (a batch of texts, a denoising step), so that a long one does not hold back the others."""

    def __init__(self, pipe: Any, max_rows: int, metrics: Metrics, leave: Callable[[Job], None], model: str):
        super().__init__(pipe, max_rows, metrics, leave)
        self.model = model

    def admit(self, job: Job) -> None:
        if job.cancelled:
            self._leave(job)
            return
        try:
            assert isinstance(job.completion, OutputQuery)
            self.open[job] = OutputRow(self.pipe, job.completion)
        except Exception as e:  # a refused request (a size the model does not make, a bad setting), or a bug
            self._fail(job, e)

    def step(self) -> None:
        self.metrics.step(len(self.open))
        for job, row in list(self.open.items()):
            if job.cancelled:
                del self.open[job]
                self.metrics.finish("interrupt", 0, 0, time.monotonic() - job.arrived)
                self._leave(job)
                continue
            try:
                if not row.step():
                    continue
                reply = row.reply(self.model)
            except Exception as e:  # a failing run ends its own request only
                del self.open[job]
                self._fail(job, e)
                continue
            del self.open[job]
            job.emit(Made(reply))
            seconds = time.monotonic() - job.arrived
            self.metrics.finish("done", reply.tokens, 0, seconds)
            log.info(
                "%s %s inputs=%d tokens=%d %.1fms",
                job.id,
                row.query.endpoint,
                row.query.count * len(row.query.texts),
                reply.tokens,
                seconds * 1000,
            )
            self._leave(job)

    def close(self, error: InvalidRequest) -> None:
        for job in list(self.open):
            del self.open[job]
            self._fail(job, error)


PROBE_EVERY = 16  # batched steps of speculating rows between one of them running a burst alone
FIRST_PROBE = 2  # batched steps before the first, while no row's rate alone is known


def alone_or_batched(rates: list[float | None], batch_rate: float, probe_due: bool) -> str:
    """How rows that all speculate run this step, from each one's tokens a second alone (None: not measured
    yet) and the batch's for all its rows: "alone" (each its own burst), "probe" (one runs alone, to
    measure it), or "batched". Rows not measured yet go by the others: run alone, they are measured."""
    if len(rates) == 1:
        return "alone"
    measured = [rate for rate in rates if rate is not None]
    if measured and batch_rate and sum(measured) / len(measured) > batch_rate:
        return "alone"
    return "probe" if probe_due else "batched"


def _note_run_scale(pipe: Any) -> None:
    """Log it when the decoder quantizes a run's activations with one scale (onnxruntime's dynamic int8
    quantization): rows batched together then round one another's activations."""
    facts = pipe.plan.facts.get(pipe.plan.fused.session)
    if facts is not None and facts.run_scaled:
        log.info("the model quantizes a run's activations with one scale for all its rows (%s): a request "
                 "batched with others may choose otherwise than alone where two logits are near; "
                 "--max-batch 1 gives every request its tokens alone", facts.run_scaled)


def _average(mean: float, value: float) -> float:
    """A moving average that follows the last few values (the first one sets it)."""
    return value if mean == 0.0 else 0.5 * mean + 0.5 * value


def _log_line(job: Job, usage: Usage, reason: str, now: float, drafted: int = 0, accepted: int = 0) -> None:
    ttft = (job.first_token - job.arrived) * 1000 if job.first_token else 0.0
    decode = now - job.first_token if job.first_token else 0.0
    rate = (usage.completion_tokens - 1) / decode if usage.completion_tokens > 1 and decode > 0 else 0.0
    log.info(
        "%s prompt=%d cached=%d completion=%d ttft=%.1fms %.1f tokens/s finish=%s%s",
        job.id,
        usage.prompt_tokens,
        usage.cached_tokens,
        usage.completion_tokens,
        ttft,
        rate,
        reason,
        f" drafted={drafted} accepted={accepted}" if drafted else "",
    )


def _param(setting: str | None, completion: Any) -> str | None:
    """The request parameter a core setting the request refused stands for (the prompt's ids: its prompt)."""
    if setting == "prompt_ids":
        return "messages" if getattr(completion, "endpoint", None) == "chat" else "prompt"
    return {"max_new_tokens": "max_tokens"}.get(setting or "", setting)


# --- the engine ------------------------------------------------------------------------------------------


def _flags(settings: dict[str, Any]) -> str:
    """The command's flags that gave these settings (the settings table's)."""
    return ", ".join(BY_NAME[name].flag for name in sorted(settings))


def check_speculation(pipe: Any, settings: dict[str, Any]) -> None:
    """The server's speculative decoding settings, checked against the model before any request: values,
    a model whose decoder can check drafts, one drafter; the draft model loaded."""
    if not settings:
        return
    named = _flags(settings)
    try:
        search = settings_for(pipe.config.generation.settings, settings)
    except GenerationError as e:
        raise ConfigError(f"{named}: {e}") from None
    why = cannot_verify(pipe.plan) if search.speculative else None
    if why:
        raise ConfigError(f"{named}: this model cannot decode speculatively: {why}")
    if (search.prompt_lookup_num_tokens or search.ngram_size) and search.draft_model:
        raise ConfigError("give --draft-model, or --prompt-lookup-num-tokens / --ngram-size, not both "
                          "(with the config's speculative block: only what it lacks)")
    try:
        pipe.driver.drive(pipe.model.prepare(settings))
    except (GenerationError, ConfigError) as e:
        raise ConfigError(f"--draft-model {settings.get('draft_model')}: {e}") from None


class Engine:
    """Loads the model on its own thread, then admits queued jobs into the scheduler and steps it."""

    def __init__(
        self,
        load: Callable[[], Any],
        *,
        max_batch: int = 1,
        max_queue: int = 16,
        prompt_cache: int = 4,
        settings: dict[str, Any] | None = None,
        on_fatal: Callable[[BaseException], None] | None = None,
    ):
        """`settings`: generation settings every request starts from, under its own (the command's
        speculative decoding flags); checked, and a draft model loaded, with the model."""
        if max_batch < 1 or max_queue < 0 or prompt_cache < 0:
            raise ValueError("max_batch must be at least 1; max_queue and prompt_cache at least 0")
        self.max_batch, self.max_queue, self.prompt_cache = max_batch, max_queue, prompt_cache
        self.settings = dict(settings or {})
        self.model = "model"  # the id responses name (create_app sets the folder's)
        self.serves = ""  # once loaded: "completions", "embeddings", "speech" or "images" (outputs.served)
        self.metrics = Metrics()
        self.pipe: Any = None
        self.scheduler: Scheduler | None = None
        self.error: BaseException | None = None
        self._load, self._on_fatal = load, on_fatal
        self._waiting: deque[Job] = deque()
        self._in_flight = 0  # jobs submitted and not yet left: waiting or in a row
        self._stopping = False
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="ortpipe-engine", daemon=True)

    @property
    def loaded(self) -> bool:
        return self.scheduler is not None

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def submit(self, job: Job) -> None:
        with self._cond:
            if self._stopping or self.scheduler is None:
                raise NotReady()
            self.check_endpoint(
                job.completion.endpoint if isinstance(job.completion, OutputQuery) else "completions"
            )
            if self._in_flight >= self.max_batch + self.max_queue:
                self.metrics.rejected += 1
                raise QueueFull(self.metrics.retry_after(len(self._waiting), self.max_batch))
            self._in_flight += 1
            self._waiting.append(job)
            self._cond.notify()

    def check_endpoint(self, endpoint: str) -> None:
        """A 404 when the loaded model does not answer `endpoint` (outputs.ENDPOINTS), naming what it does."""
        if self.serves and endpoint != self.serves:
            raise InvalidRequest(
                f"This server's model is {KINDS[self.serves]} model: it answers {ENDPOINTS[self.serves]} "
                "only.",
                code="unsupported_endpoint",
                status=404,
            )

    def cancel(self, job: Job) -> None:
        """The client left: drop the job from the queue, or have its row interrupted at the next step."""
        job.cancelled = True
        with self._cond:
            if job in self._waiting:
                self._waiting.remove(job)
                self._in_flight -= 1

    def gauges(self) -> Gauges:
        scheduler = self.scheduler  # read once: the engine thread may drop it
        return Gauges(
            scheduler is not None,
            len(self._waiting),
            scheduler.rows if scheduler else 0,
            self.max_batch,
            self.max_queue,
        )

    def _leave(self, job: Job) -> None:
        with self._cond:
            self._in_flight -= 1

    def _run(self) -> None:
        try:
            pipe = self._load()
            serves = served(pipe)
            scheduler: Scheduler
            if serves != "completions":
                if self.settings:
                    raise ConfigError(f"{_flags(self.settings)}: this server's model makes {serves}, not "
                                      "text, and has no tokens to draft")
                scheduler = Outputs(pipe, self.max_batch, self.metrics, self._leave, self.model)
            else:
                check_speculation(pipe, self.settings)
                kind = Batched if batchable(pipe.plan) is None else TimeSliced
                scheduler = kind(pipe, self.max_batch, self.prompt_cache, self.metrics, self._leave,
                                 self.settings)
                if kind is Batched and self.max_batch > 1:
                    _note_run_scale(pipe)
            self.serves = serves
        except BaseException as e:  # a folder that cannot be loaded ends the server
            self.error = e
            if self._on_fatal:
                self._on_fatal(e)
            return
        self.pipe, self.scheduler = pipe, scheduler
        ending = SHUTTING_DOWN
        try:
            self._loop(scheduler)
        except Exception as e:  # a bug in the engine: every job is told, /health turns 503, nobody waits
            log.exception("the engine stopped")
            self.error = e
            ending = InvalidRequest(
                f"The engine stopped: {type(e).__name__}: {e}", status=500, kind="server_error"
            )
        finally:
            with self._cond:
                self.scheduler, self._stopping = None, True
                waiting, self._waiting = list(self._waiting), deque()
            scheduler.close(ending)
            for job in waiting:
                job.emit(Failed(ending))

    def _loop(self, scheduler: Scheduler) -> None:
        while True:
            with self._cond:
                while not self._stopping and not self._waiting and not scheduler.rows:
                    self._cond.wait()
                if self._stopping:
                    return
                admitted = [self._waiting.popleft() for _ in range(min(len(self._waiting), scheduler.room()))]
            for job in admitted:
                scheduler.admit(job)
            if scheduler.rows:
                scheduler.step()
