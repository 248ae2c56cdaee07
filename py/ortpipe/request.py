"""A request: one generation, as the user sees it.

A Request wraps the token generator with the text stream (stop strings held back and honoured on
the decoded text), timings and the finish reason. Targets drive `Request.advance()` with their
driver until `done`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from .config.settings import SearchSettings
from .errors import GenerationError, OrtpipeError
from .execute.work import Work
from .lifecycle import ERROR
from .loops.autoregressive import TokenGenerator
from .loops.beam import BeamSearch
from .tokenizer import TextStream, Tokenizer


@dataclass
class Timings:
    load_ms: float = 0.0
    prefill_ms: float = 0.0  # the first token: init phase, prefill run and selection
    decode_ms: float = 0.0  # every later token
    prompt_tokens: int = 0
    new_tokens: int = 0
    fused_steps: int = 0  # decode steps the target ran fused (plain greedy on one decoder session)
    # the loops that make no tokens: prefill_ms is their init phase, then `steps` denoising steps, and the
    # final phase
    steps: int = 0
    steps_ms: float = 0.0
    final_ms: float = 0.0
    drafted_tokens: int = 0  # speculative decoding: tokens drafted and checked
    accepted_tokens: int = 0  # of those, the ones the model accepted

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        n = self.new_tokens - 1
        return n * 1000.0 / self.decode_ms if n > 0 and self.decode_ms > 0 else 0.0

    @property
    def step_ms(self) -> float:
        """The mean time of a denoising step (its UNet run and its scheduler kernel)."""
        return self.steps_ms / self.steps if self.steps else 0.0

    def as_dict(self) -> dict[str, float]:
        out = {"load_ms": round(self.load_ms, 3), "prefill_ms": round(self.prefill_ms, 3),
               "decode_ms": round(self.decode_ms, 3), "prompt_tokens": self.prompt_tokens,
               "new_tokens": self.new_tokens, "decode_tokens_per_s": round(self.decode_tokens_per_s, 2),
               "fused_steps": self.fused_steps, "drafted_tokens": self.drafted_tokens,
               "accepted_tokens": self.accepted_tokens}
        if self.steps or self.final_ms:
            out.update(steps=self.steps, step_ms=round(self.step_ms, 3), final_ms=round(self.final_ms, 3))
        return out


@dataclass
class Result:
    tokens: list[int]  # generated ids, prompt excluded
    text: str
    timings: Timings = field(default_factory=Timings)
    finish_reason: str = "length"  # "eos", "length", "stop", "interrupt"; "error" for a failure's partial
    sequences: list[list[int]] = field(default_factory=list)  # beam search: num_return_sequences, best first
    # named outputs (pipeline.output): name -> the target's tensor, and name -> {"kind", "sampling_rate"}
    outputs: dict[str, Any] = field(default_factory=dict)
    kinds: dict[str, dict[str, Any]] = field(default_factory=dict)
    stages: dict[str, Result] = field(default_factory=dict)  # pipeline.stages: each stage's own result
    language: str | None = None  # the decoder prompt's language (tokens.languages' code): given or chosen

    def output_of(self, kind: str) -> Any:
        """The first named output of `kind` ("audio", "image", "embedding", "tensor"), or None."""
        names = [n for n, k in self.kinds.items() if k["kind"] == kind and n in self.outputs]
        return self.outputs[names[0]] if names else None

    @property
    def image(self) -> Any:
        return self.output_of("image")

    @property
    def audio(self) -> Any:
        return self.output_of("audio")

    def as_dict(self, describe: Any = None) -> dict[str, object]:
        """The result as JSON values; named outputs are described by `describe(name, tensor)` (a target's
        {"dtype", "shape", ...}), never inlined."""
        out = {"tokens": self.tokens, "text": self.text, "finish_reason": self.finish_reason,
               "timings": self.timings.as_dict()}
        if self.sequences:
            out["sequences"] = self.sequences
        if self.language is not None:
            out["language"] = self.language
        if self.stages:
            out["stages"] = {name: {"tokens": r.tokens, "finish_reason": r.finish_reason}
                             for name, r in self.stages.items()}
        if self.outputs:
            out["outputs"] = {
                name: {**self.kinds.get(name, {}), **(describe(name, value) if describe else {})}
                for name, value in self.outputs.items()
            }
        return out


@dataclass(frozen=True)
class Chunk:
    token: int
    text: str  # the text this token completes ("" while a character or a possible stop string is open)
    logprob: float | None = None  # with the logprobs setting: the token's log-probability
    top_logprobs: tuple[tuple[int, float], ...] = ()  # and the most likely tokens with theirs



class Request:
    """One generation, advanced by a target's driver: `while not r.done: chunks = drive(r.advance())`."""

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
        self.outputs: dict[str, Any] = {}  # the named outputs of the final steps, once done
        self.language: str | None = None  # the decoder prompt's language (Result.language)

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    @property
    def failed(self) -> bool:
        """A step raised (lifecycle ERROR): the request cannot go on."""
        return self.gen is not None and self.gen.state == ERROR

    @property
    def budget(self) -> int | None:
        """How many tokens the next step may make (None: no limit). A burst must not run past where this
        request may stop: its own budget, and any token while stop strings are watched (the text
        decides), unless it speculates: then the tokens after a stop string are taken back."""
        if self.settings.stop and self.gen.speculator is None:
            return 1
        return None if self.max_new_tokens is None else self.max_new_tokens - len(self.tokens)

    def advance(self) -> Work:
        """The next token's chunk, or several: a burst of fused decode steps (see TokenGenerator)."""
        start = time.perf_counter()
        try:
            tokens = yield from self.gen.next_tokens(self.budget)
            chunks = self.accept(tokens, (time.perf_counter() - start) * 1000)
            if len(chunks) < len(tokens):
                yield from self.gen.take_back(len(tokens) - len(chunks))
            if self.done and self.finish_reason != "interrupt" and self.gen.plan.final_phase:
                yield from self._final()
        except OrtpipeError as e:
            if self.tokens and e.partial is None:  # what was generated before the failure is the caller's
                e.partial = Result(list(self.tokens), self.text + self._held, self.timings, "error")
            raise
        return chunks

    def accept(self, tokens: list[int], elapsed: float) -> list[Chunk]:
        """The chunks of tokens the generator just took, `elapsed` ms after they were asked for: the
        text so far, the finish reason, the timings. `advance` calls it; a loop that steps the
        generator itself (a batch row) calls it after each step. Tokens after a stop string get no
        chunk: they are not the request's (the generator takes them back)."""
        if self.timings.new_tokens == 0:
            self.timings.prefill_ms = elapsed
        else:
            self.timings.decode_ms += elapsed
        self.timings.fused_steps = self.gen.fused_steps
        spec = self.gen.speculator
        if spec is not None:
            self.timings.drafted_tokens, self.timings.accepted_tokens = spec.drafted, spec.accepted
        deltas = self.stream.push_many(tokens) if self.stream is not None else None
        asked = self.settings.logprobs is not None
        probs = self.gen.logprobs[-len(tokens):] if asked else [None] * len(tokens)
        chunks = []
        for i, token in enumerate(tokens):
            self.tokens.append(token)
            last = i == len(tokens) - 1
            if last:
                self._finish(token)
            text = ""
            if deltas is not None:
                text = self._text(deltas[i] + (self.stream.flush() if last and self.done else ""))
            chunks.append(Chunk(token, text, *(probs[i] or (None, ()))))
            if self.finish_reason == "stop":
                break
        self.timings.new_tokens += len(chunks)
        return chunks

    def _finish(self, token: int) -> None:
        """The finish reason after the last token of a step, if it ends the request."""
        if self.gen.done:
            self.finish_reason = "interrupt" if self.gen.interrupted else (
                "eos" if token in self.gen.limits.eos else "length")
        elif self.max_new_tokens is not None and len(self.tokens) >= self.max_new_tokens:
            self.finish_reason = "length"

    def interrupt(self) -> None:
        self.gen.interrupted = True
        self.finish_reason = self.finish_reason or "interrupt"

    def _text(self, delta: str) -> str:
        """What of the decoded `delta` can be sent: none of a stop string, nor what may start one."""
        if self.finish_reason == "stop":
            return ""  # a stop string ended the text
        self._held += delta
        for stop in self.settings.stop:
            at = self._held.find(stop)
            if at >= 0:
                self._held = self._held[:at]
                self.finish_reason = "stop"
        keep = 0 if self.done else _open_stop_prefix(self._held, self.settings.stop)
        out, self._held = self._held[: len(self._held) - keep], self._held[len(self._held) - keep :]
        self.text += out
        return out

    def _final(self) -> Work:
        """The final steps on the generated sequence ("generated.ids", [1, length]); the named outputs."""
        from .outputs import finish_outputs  # outputs.py builds on this module

        start, flow = time.perf_counter(), self.gen.flow
        flow.set_generated(list(self.tokens), (1, len(self.tokens)))
        yield from flow.run_final()
        self.outputs = yield from finish_outputs(self.gen.plan, self.gen.backend, flow.values)
        self.timings.final_ms += (time.perf_counter() - start) * 1000

    def result(self) -> Result:
        if self.outputs:  # the final steps' named outputs
            from .outputs import describe

            kinds = {n: k for n, k in describe(self.gen.plan).items() if n in self.outputs}
            outputs = dict(self.outputs)
        else:  # pipeline.output from the steps (an accumulated output's rows of the whole loop)
            outputs, kinds = self.gen.named_outputs() if self.gen is not None else ({}, {})
        return Result(list(self.tokens), self.text, self.timings, self.finish_reason or "length",
                      outputs=outputs, kinds=kinds, language=self.language)


class WholeRequest(Request):
    """A loop that runs whole in one advance (beam search, a plugin's): its chunks are the tokens it
    gave, the text on the last."""

    def __init__(self, prompt: list[int], settings: SearchSettings, tokenizer: Tokenizer | None,
                 eos: frozenset[int]):
        super().__init__(None, settings, tokenizer, len(prompt))
        self.prompt, self.tokenizer, self.eos = prompt, tokenizer, eos

    def finished(self, tokens: list[int], start: float) -> list[Chunk]:
        self.timings.prefill_ms = (time.perf_counter() - start) * 1000
        self.timings.new_tokens = len(tokens)
        self.finish_reason = "eos" if tokens and tokens[-1] in self.eos else "length"
        self.tokens = list(tokens)
        self.text = self.tokenizer.decode(tokens) if self.tokenizer else ""
        return [Chunk(t, self.text if i == len(tokens) - 1 else "") for i, t in enumerate(tokens)]

    def interrupt(self) -> None:
        self.finish_reason = self.finish_reason or "interrupt"


class BeamRequest(WholeRequest):
    """Beam search: one advance runs the whole search; its chunks are the best hypothesis's tokens."""

    def __init__(
        self, search: BeamSearch, prompt: list[int], settings: SearchSettings, tokenizer: Tokenizer | None
    ):
        super().__init__(prompt, settings, tokenizer, search.eos)
        self.search = search
        self.sequences: list[list[int]] = []

    def advance(self) -> Work:
        start = time.perf_counter()
        best = yield from self.search.run(self.prompt)
        self.sequences = [h.tokens for h in best]
        return self.finished(self.sequences[0], start)


    def result(self) -> Result:
        result = super().result()
        result.sequences = [list(s) for s in self.sequences]
        return result


class PluginRequest(WholeRequest):
    """A plugin's loop (plugins.py), run whole in one advance; what it returns is checked."""

    def __init__(self, loop: Any, prompt: list[int], settings: SearchSettings, tokenizer: Tokenizer | None,
                 max_length: int, eos: frozenset[int]):
        super().__init__(prompt, settings, tokenizer, eos)
        self.loop, self.max_length = loop, max_length

    def advance(self) -> Work:
        start = time.perf_counter()
        tokens = yield from self.loop.run(list(self.prompt))
        room = self.max_length - len(self.prompt)
        ids = isinstance(tokens, list) and all(type(t) is int and t >= 0 for t in tokens)
        if not ids or len(tokens) > room:
            raise GenerationError(
                f"the plugin's loop must return at most {room} token ids (max_length less the "
                f"prompt), found {str(tokens)[:200]}"
            )
        return self.finished(tokens, start)


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
