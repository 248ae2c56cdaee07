"""What a loaded model is, independent of the target: plan, tokenizer, and requests.

A Request is one generation: the token generator, the text stream with stop strings, and timings.
Targets (targets/cpython.py, targets/pyodide.py) drive `Request.step()` with their own driver.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from .errors import GenerationError
from .execute.work import Backend, Handle, Work
from .loops.autoregressive import Limits, TokenGenerator
from .loops.beam import BeamSearch
from .plan import Plan
from .sampling.settings import SearchSettings, settings_for
from .tokenizer import TextStream, Tokenizer

DEFAULT_MAX_NEW_TOKENS = 256


@dataclass
class Timings:
    load_ms: float = 0.0
    prefill_ms: float = 0.0  # the first token: init phase, prefill run and selection
    decode_ms: float = 0.0  # every later token
    prompt_tokens: int = 0
    new_tokens: int = 0
    fused_steps: int = 0  # decode steps the target ran fused (plain greedy on one decoder session)

    @property
    def decode_tokens_per_s(self) -> float:
        n = self.new_tokens - 1
        return n * 1000.0 / self.decode_ms if n > 0 and self.decode_ms > 0 else 0.0

    def as_dict(self) -> dict[str, float]:
        return {"load_ms": round(self.load_ms, 3), "prefill_ms": round(self.prefill_ms, 3),
                "decode_ms": round(self.decode_ms, 3), "prompt_tokens": self.prompt_tokens,
                "new_tokens": self.new_tokens, "decode_tokens_per_s": round(self.decode_tokens_per_s, 2),
                "fused_steps": self.fused_steps}


@dataclass
class Result:
    tokens: list[int]  # generated ids, prompt excluded
    text: str
    timings: Timings = field(default_factory=Timings)
    finish_reason: str = "length"  # "eos", "length", "stop" or "interrupt"

    def as_dict(self) -> dict[str, object]:
        return {"tokens": self.tokens, "text": self.text, "finish_reason": self.finish_reason,
                "timings": self.timings.as_dict()}


@dataclass(frozen=True)
class Chunk:
    token: int
    text: str  # the text this token completes ("" while a character or a possible stop string is open)


class Request:
    """One generation, stepped by a target's driver: `while not r.done: chunks = drive(r.step())`."""

    def __init__(self, gen: TokenGenerator | None, settings: SearchSettings, tokenizer: Tokenizer | None,
                 prompt_len: int, max_new_tokens: int | None = None):
        if settings.stop and tokenizer is None:
            raise GenerationError("stop strings need the folder's tokenizer.json to decode text")
        self.gen, self.settings = gen, settings
        self.stream = _text_stream(tokenizer) if tokenizer else None
        self.timings = Timings(prompt_tokens=prompt_len)
        self.tokens: list[int] = []
        self.text = ""  # text sent so far
        self._held = ""  # decoded text not sent yet: it may start a stop string
        self.finish_reason: str | None = None
        self.max_new_tokens = max_new_tokens  # a budget for this request alone (a chat turn)

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    def step(self) -> Work:
        """The next token's chunk, or several: a burst of fused decode steps (see TokenGenerator)."""
        start = time.perf_counter()
        # A burst must not run past where this request may stop: its own budget, and any token while
        # stop strings are watched (the text decides).
        budget = 1 if self.settings.stop else (
            None if self.max_new_tokens is None else self.max_new_tokens - len(self.tokens))
        tokens = yield from self.gen.next_tokens(budget)
        elapsed = (time.perf_counter() - start) * 1000
        if self.timings.new_tokens == 0:
            self.timings.prefill_ms = elapsed
        else:
            self.timings.decode_ms += elapsed
        self.timings.new_tokens += len(tokens)
        self.timings.fused_steps = self.gen.fused_steps
        self.tokens.extend(tokens)
        if self.gen.done:
            self.finish_reason = "interrupt" if self.gen.interrupted else (
                "eos" if tokens[-1] in self.gen.limits.eos else "length")
        elif self.max_new_tokens is not None and len(self.tokens) >= self.max_new_tokens:
            self.finish_reason = "length"
        if self.stream is None:
            return [Chunk(token, "") for token in tokens]
        deltas = self.stream.push_many(tokens)
        if self.done:
            deltas[-1] += self.stream.flush()
        return [Chunk(token, self._text(delta)) for token, delta in zip(tokens, deltas, strict=True)]

    def interrupt(self) -> None:
        self.gen.interrupted = True
        self.finish_reason = self.finish_reason or "interrupt"

    def _text(self, delta: str) -> str:
        """What of the decoded `delta` can be sent: none of a stop string, nor what may start one."""
        if self.finish_reason == "stop":
            return ""  # a stop string ended the text (only one token a step while they are watched)
        self._held += delta
        for stop in self.settings.stop:
            at = self._held.find(stop)
            if at >= 0:
                self._held = self._held[:at]
                self.finish_reason = "stop"
        keep = 0 if self.done else _open_stop_prefix(self._held, self.settings.stop)
        out, self._held = self._held[:len(self._held) - keep], self._held[len(self._held) - keep:]
        self.text += out
        return out

    def result(self) -> Result:
        return Result(list(self.tokens), self.text, self.timings, self.finish_reason or "length")


class BeamRequest(Request):
    """Beam search: one step runs the whole search; its chunks are the best hypothesis's tokens."""

    def __init__(self, search: BeamSearch, prompt: list[int], settings: SearchSettings,
                 tokenizer: Tokenizer | None):
        super().__init__(None, settings, tokenizer, len(prompt))
        self.search, self.prompt = search, prompt
        self.sequences: list[list[int]] = []
        self.tokenizer = tokenizer

    def step(self) -> Work:
        start = time.perf_counter()
        best = yield from self.search.run(self.prompt)
        self.timings.prefill_ms = (time.perf_counter() - start) * 1000
        self.sequences = [h.tokens for h in best]
        tokens = self.sequences[0]
        self.timings.new_tokens = len(tokens)
        self.finish_reason = "eos" if tokens and tokens[-1] in self.search.eos else "length"
        self.tokens = list(tokens)
        text = self.tokenizer.decode(tokens) if self.tokenizer else ""
        self.text = text
        return [Chunk(t, text if i == len(tokens) - 1 else "") for i, t in enumerate(tokens)]

    def interrupt(self) -> None:
        self.finish_reason = self.finish_reason or "interrupt"


def _text_stream(tokenizer: Tokenizer) -> TextStream:
    """The tokenizer's own text stream when it has one (a target's faster twin), else the core's."""
    make = getattr(tokenizer, "text_stream", None)
    return make() if make is not None else TextStream(tokenizer)


def _open_stop_prefix(text: str, stops: tuple[str, ...]) -> int:
    """Length of the longest end of `text` that could still grow into a stop string."""
    longest = 0
    for stop in stops:
        for n in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:n]):
                longest = n
                break
    return longest


def check_inputs(plan: Plan, inputs: dict[str, Handle], backend: Backend) -> None:
    """Request inputs against the graphs that read them: known names, rank, element type, fixed dims."""
    readers = {f.input: s for level in plan.init for s in level for f in s.feeds if f.kind == "request"}
    controls = {s.step.dynamic_shape.source for level in plan.init for s in level if s.step.dynamic_shape}
    grid = plan.config.pipeline.state.position_ids.grid_source
    controls |= {grid.split(".", 1)[-1]} if grid else set()
    for name, value in inputs.items():
        s = readers.get(name)
        if s is None and name in controls:
            continue  # read by the executor itself (crop sizes, mRoPE grids)
        if s is None:
            known = ", ".join(sorted(readers)) or "none"
            raise GenerationError(f'no session reads a request input named "{name}" (request inputs: {known})')
        info = plan.signatures[s.session].input(name)
        shape, dtype = tuple(backend.shape(value)), backend.dtype(value)
        fixed_ok = len(shape) == info.rank and all(not isinstance(d, int) or d == n for d, n in zip(info.shape, shape))
        if not fixed_ok or dtype != info.dtype:
            raise GenerationError(f'input "{name}" of session "{s.session}": expected {info.dtype} {list(info.shape)}, '
                                  f"got {dtype} {list(shape)}")


class Pipeline:
    def __init__(self, plan: Plan, backend: Backend, tokenizer: Tokenizer | None):
        self.plan, self.backend, self.tokenizer = plan, backend, tokenizer
        self.config = plan.config

    def prompt_ids(self, prompt: str | None, prompt_ids: list[int] | None) -> list[int]:
        start = self.config.tokens.decoder_start
        if prompt is None and prompt_ids is None and start is not None:
            return [start]  # an encoder-decoder model starts from its decoder_start token
        if prompt is None and prompt_ids is None and self.config.pipeline.state.cross_cache:
            raise GenerationError("this encoder-decoder folder sets no decoder start token (tokens.decoder_start, "
                                  "or model.decoder_start_token_id in v1): pass prompt_ids")
        if (prompt is None) == (prompt_ids is None):
            raise GenerationError("give exactly one of prompt (text) and prompt_ids (token ids)")
        if prompt_ids is not None:
            return list(prompt_ids)
        if self.tokenizer is None:
            raise GenerationError("this model folder has no tokenizer.json: pass prompt_ids instead of a prompt")
        return self.tokenizer.encode(prompt)

    def generator(self, prompt_len: int = 0, max_new_tokens: int | None = None, max_length: int | None = None,
                  inputs: dict[str, Handle] | None = None, **settings: Any) -> TokenGenerator:
        """A step-wise generator sized for the request; its caches never exceed the requested length."""
        search = settings_for(self.config, settings)
        check_inputs(self.plan, inputs or {}, self.backend)
        limit = self.max_length(prompt_len, max_new_tokens, max_length)
        limits = Limits(limit, frozenset(self.config.tokens.eos), grows=max_length is None and max_new_tokens is not None)
        return TokenGenerator(self.plan, self.backend, limits, search, inputs)

    def request(self, prompt_ids: list[int], max_new_tokens: int | None = None, max_length: int | None = None,
                inputs: dict[str, Handle] | None = None, **settings: Any) -> Request:
        search = settings_for(self.config, settings)
        if search.num_beams > 1:
            return self._beam_request(prompt_ids, search, max_new_tokens, max_length, inputs)
        gen = self.generator(len(prompt_ids), max_new_tokens, max_length, inputs, **settings)
        gen.append_tokens(prompt_ids)
        return Request(gen, search, self.tokenizer, len(prompt_ids))

    def _beam_request(self, prompt_ids: list[int], search: SearchSettings, max_new_tokens: int | None,
                      max_length: int | None, inputs: dict[str, Handle] | None) -> BeamRequest:
        unsupported = [name for name, on in (
            ("repetition_penalty", search.repetition_penalty != 1.0), ("no_repeat_ngram_size", search.no_repeat_ngram_size),
            ("min_length", search.min_length), ("min_new_tokens", search.min_new_tokens),
            ("suppress_tokens", search.suppress_tokens), ("stop", search.stop)) if on]
        if unsupported:
            raise GenerationError(f"beam search does not apply {', '.join(unsupported)} yet; "
                                  "drop them or use num_beams 1")
        check_inputs(self.plan, inputs or {}, self.backend)
        limit = self.max_length(len(prompt_ids), max_new_tokens, max_length)
        beam = BeamSearch(self.plan, self.backend, search, limit, frozenset(self.config.tokens.eos), inputs)
        return BeamRequest(beam, list(prompt_ids), search, self.tokenizer)

    def max_length(self, prompt_len: int, max_new_tokens: int | None, max_length: int | None) -> int:
        for name, value in (("max_new_tokens", max_new_tokens), ("max_length", max_length)):
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise GenerationError(f"{name} must be a positive integer, found {value!r}")
        configured = self.config.generation.max_length
        if max_length is None:
            if max_new_tokens is not None:
                max_length = prompt_len + max_new_tokens
            else:
                max_length = configured or prompt_len + DEFAULT_MAX_NEW_TOKENS
        context = self.config.metadata.get("context_length")
        if isinstance(context, int) and max_length > context:
            raise GenerationError(f"max_length {max_length} is more than the model's context_length {context}; "
                                  "lower max_length or max_new_tokens")
        if max_length <= prompt_len:
            raise GenerationError(f"max_length {max_length} leaves no room to generate after a "
                                  f"{prompt_len}-token prompt; raise max_length or use max_new_tokens")
        return max_length
