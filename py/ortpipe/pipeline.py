"""What a loaded model is, independent of the target: plan, tokenizer, and request set-up.

Targets (targets/cpython.py, targets/pyodide.py) build a Pipeline and drive its generators.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .errors import GenerationError
from .execute.work import Backend, Handle
from .loops.autoregressive import Limits, TokenGenerator
from .plan import Plan
from .tokenizer import Tokenizer

DEFAULT_MAX_NEW_TOKENS = 256


@dataclass
class Timings:
    load_ms: float = 0.0
    prefill_ms: float = 0.0  # the first token: init phase, prefill run and selection
    decode_ms: float = 0.0  # every later token
    prompt_tokens: int = 0
    new_tokens: int = 0

    @property
    def decode_tokens_per_s(self) -> float:
        n = self.new_tokens - 1
        return n * 1000.0 / self.decode_ms if n > 0 and self.decode_ms > 0 else 0.0

    def as_dict(self) -> dict[str, float]:
        return {"load_ms": round(self.load_ms, 3), "prefill_ms": round(self.prefill_ms, 3),
                "decode_ms": round(self.decode_ms, 3), "prompt_tokens": self.prompt_tokens,
                "new_tokens": self.new_tokens, "decode_tokens_per_s": round(self.decode_tokens_per_s, 2)}


@dataclass
class Result:
    tokens: list[int]  # generated ids, prompt excluded
    text: str
    timings: Timings = field(default_factory=Timings)
    finish_reason: str = "length"  # "eos", "length" or "interrupt"

    def as_dict(self) -> dict[str, object]:
        return {"tokens": self.tokens, "text": self.text, "finish_reason": self.finish_reason,
                "timings": self.timings.as_dict()}


@dataclass(frozen=True)
class Chunk:
    token: int
    text: str  # the text this token completes (may be "" while a character is incomplete)


class Pipeline:
    def __init__(self, plan: Plan, backend: Backend, tokenizer: Tokenizer | None):
        self.plan, self.backend, self.tokenizer = plan, backend, tokenizer
        self.config = plan.config

    def prompt_ids(self, prompt: str | None, prompt_ids: list[int] | None) -> list[int]:
        if (prompt is None) == (prompt_ids is None):
            raise GenerationError("give exactly one of prompt (text) and prompt_ids (token ids)")
        if prompt_ids is not None:
            return list(prompt_ids)
        if self.tokenizer is None:
            raise GenerationError("this model folder has no tokenizer.json: pass prompt_ids instead of a prompt")
        return self.tokenizer.encode(prompt)

    def generator(self, prompt_len: int, max_new_tokens: int | None = None, max_length: int | None = None,
                  inputs: dict[str, Handle] | None = None) -> TokenGenerator:
        """A step-wise generator sized for the request; its caches never exceed the requested length."""
        limit = self.max_length(prompt_len, max_new_tokens, max_length)
        return TokenGenerator(self.plan, self.backend, Limits(limit, frozenset(self.config.tokens.eos)), inputs)

    def max_length(self, prompt_len: int, max_new_tokens: int | None, max_length: int | None) -> int:
        for name, value in (("max_new_tokens", max_new_tokens), ("max_length", max_length)):
            if value is not None and (not isinstance(value, int) or value < 1):
                raise GenerationError(f"{name} must be a positive integer, found {value!r}")
        configured = self.config.generation.max_length
        if max_length is None:
            if max_new_tokens is not None:
                max_length = prompt_len + max_new_tokens
            else:
                max_length = configured or prompt_len + DEFAULT_MAX_NEW_TOKENS
        if max_length <= prompt_len:
            raise GenerationError(f"max_length {max_length} leaves no room to generate after a "
                                  f"{prompt_len}-token prompt; raise max_length or use max_new_tokens")
        return max_length

    def finish_reason(self, gen: TokenGenerator) -> str:
        if gen.interrupted:
            return "interrupt"
        return "eos" if gen.generated and gen.tokens[-1] in gen.limits.eos else "length"
