"""Generation settings for one request: the config's defaults with the caller's overrides, validated
before any model runs."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from ..config.schema import Config
from ..errors import GenerationError


@dataclass(frozen=True)
class SearchSettings:
    do_sample: bool = False
    temperature: float = 1.0  # 0 means greedy
    top_k: int = 0  # 0: off
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    no_repeat_ngram_size: int = 0
    min_length: int = 0  # eos is suppressed while prompt + generated is shorter
    min_new_tokens: int = 0  # eos is suppressed while fewer tokens were generated
    suppress_tokens: tuple[int, ...] = ()
    seed: int | None = None
    num_beams: int = 1
    length_penalty: float = 1.0
    early_stopping: bool = False
    num_return_sequences: int = 1
    stop: tuple[str, ...] = ()  # stop strings, matched on decoded text

    @property
    def sampling(self) -> bool:
        return self.do_sample and self.temperature > 0

    @property
    def plain_greedy(self) -> bool:
        """The argmax of the raw logits, with no processor that could change it."""
        return (not self.sampling and self.repetition_penalty == 1.0 and not self.suppress_tokens
                and not self.no_repeat_ngram_size and not self.min_length and not self.min_new_tokens)


def settings_for(config: Config, overrides: dict[str, Any]) -> SearchSettings:
    """The config's generation settings with non-None overrides laid over them, checked."""
    gen, samp = config.generation, config.generation.sampling
    base = dict(do_sample=samp.do_sample, temperature=samp.temperature, top_k=samp.top_k, top_p=samp.top_p,
                min_p=samp.min_p, repetition_penalty=samp.repetition_penalty, seed=samp.seed,
                no_repeat_ngram_size=gen.no_repeat_ngram_size, min_length=gen.min_length,
                suppress_tokens=gen.suppress_tokens, num_beams=gen.num_beams, length_penalty=gen.length_penalty,
                early_stopping=gen.early_stopping, num_return_sequences=gen.num_return_sequences, stop=gen.stop)
    names = {f.name for f in dataclasses.fields(SearchSettings)}
    for key, value in overrides.items():
        if key not in names:
            raise GenerationError(f'unknown generation setting "{key}"; known: {", ".join(sorted(names))}')
        if value is not None:
            base[key] = tuple(value) if key in ("stop", "suppress_tokens") else value
    settings = SearchSettings(**base)
    check(settings)
    return settings


def check(s: SearchSettings) -> None:
    _number(s.temperature, "temperature", low=0.0, hint="use 0 for greedy, or a positive value like 0.7")
    if not isinstance(s.top_k, int) or isinstance(s.top_k, bool) or s.top_k < 0:
        raise GenerationError(f"top_k must be a non-negative integer (0 turns it off), found {s.top_k!r}")
    _number(s.top_p, "top_p", low=0.0, high=1.0, low_open=True, hint="top_p must be in (0, 1]; 1 turns it off")
    _number(s.min_p, "min_p", low=0.0, high=1.0, hint="min_p must be in [0, 1]; 0 turns it off")
    _number(s.repetition_penalty, "repetition_penalty", low=0.0, low_open=True, hint="1.0 turns it off")
    _number(s.length_penalty, "length_penalty")
    for name in ("no_repeat_ngram_size", "min_length", "min_new_tokens"):
        value = getattr(s, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise GenerationError(f"{name} must be a non-negative integer, found {value!r}")
    for name in ("num_beams", "num_return_sequences"):
        value = getattr(s, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise GenerationError(f"{name} must be a positive integer, found {value!r}")
    if s.num_return_sequences > s.num_beams and not s.sampling:
        raise GenerationError(f"num_return_sequences ({s.num_return_sequences}) cannot exceed num_beams "
                              f"({s.num_beams}); raise num_beams")
    if s.num_beams > 1 and s.do_sample:
        raise GenerationError("beam search with sampling is not supported; set do_sample false or num_beams 1")
    if s.seed is not None and (not isinstance(s.seed, int) or isinstance(s.seed, bool)):
        raise GenerationError(f"seed must be an integer, found {s.seed!r}")
    if not all(isinstance(t, int) and t >= 0 for t in s.suppress_tokens):
        raise GenerationError(f"suppress_tokens must be token ids, found {list(s.suppress_tokens)!r}")
    for stop in s.stop:
        if not isinstance(stop, str) or not stop:
            raise GenerationError(f"stop strings must be non-empty strings, found {stop!r}")


def _number(value: Any, name: str, low: float | None = None, high: float | None = None,
            low_open: bool = False, hint: str = "") -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and value == value
    if ok and low is not None:
        ok = value > low if low_open else value >= low
    if ok and high is not None:
        ok = value <= high
    if not ok:
        raise GenerationError(f"{name} {value!r} is out of range" + (f": {hint}" if hint else ""))
