"""Text under CPython: Hugging Face `tokenizers` and chat templates in jinja2's sandbox.

Templates get what transformers gives them (loop controls, `tojson` keeping non-ASCII text,
`raise_exception`, `strftime_now`) and run under limits: a trace function stops a render that runs
past RENDER_SECONDS (a loop with no output never yields, so only tracing sees it), and the output
is collected chunk by chunk and stopped past MAX_RENDERED characters.
"""

from __future__ import annotations

import json
import sys
import time
from datetime import datetime
from typing import Any

from ...templates import MAX_RENDERED, RENDER_SECONDS, Renderer, TemplateFailure

TRACE_CHECK_EVERY = 1000  # trace events between two reads of the clock


class HFTokenizer:
    """Hugging Face `tokenizers` over the folder's tokenizer.json."""

    def __init__(self, tokenizer: Any):
        self._tok = tokenizer

    @classmethod
    def from_text(cls, text: str) -> HFTokenizer:
        from tokenizers import Tokenizer

        return cls(Tokenizer.from_str(text))

    @classmethod
    def from_file(cls, path: Any) -> HFTokenizer:
        from tokenizers import Tokenizer

        return cls(Tokenizer.from_file(str(path)))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """Each text's ids with the special tokens, encoded in parallel by the Rust library (one by one
        when tokenizer.json pads: a batch would be padded to its longest text)."""
        if self._tok.padding is not None:
            return [self.encode(text) for text in texts]
        return [e.ids for e in self._tok.encode_batch(texts, add_special_tokens=True)]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)


class _Refusal(Exception):
    """The template called raise_exception."""


def _raise(message: str) -> None:
    raise _Refusal(str(message))


def _tojson(value: Any, indent: int | None = None) -> str:
    return json.dumps(value, ensure_ascii=False, indent=indent)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def compile_template(source: str) -> Renderer:
    """A renderer for `source`; TemplateFailure("syntax") when it does not parse."""
    from jinja2 import TemplateError
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = _strftime_now
    try:
        template = env.from_string(source)
    except TemplateError as e:
        raise TemplateFailure("syntax", str(e)[:300]) from None
    except RecursionError:
        raise TemplateFailure("syntax", "the template nests too deeply") from None

    def render(context: dict[str, Any]) -> str:
        return _bounded(template, context)

    return render


def _bounded(template: Any, context: dict[str, Any]) -> str:
    from jinja2.exceptions import SecurityError, TemplateError

    deadline = time.perf_counter() + RENDER_SECONDS
    events = 0

    def tracer(frame: Any, event: str, arg: Any) -> Any:
        nonlocal events
        events += 1
        if events % TRACE_CHECK_EVERY == 0 and time.perf_counter() > deadline:
            raise TemplateFailure("limit", f"rendering took more than {RENDER_SECONDS:g} s")
        return tracer

    parts, size = [], 0
    previous = sys.gettrace()
    sys.settrace(tracer)
    try:
        for chunk in template.generate(**context):
            size += len(chunk)
            if size > MAX_RENDERED:
                raise TemplateFailure("limit", f"the output passed {MAX_RENDERED} characters")
            parts.append(chunk)
    except TemplateFailure:
        raise
    except _Refusal as e:
        raise TemplateFailure("refused", str(e)[:300]) from None
    except SecurityError as e:
        raise TemplateFailure("security", str(e)[:300]) from None
    except (TemplateError, TypeError, ValueError, AttributeError, KeyError, IndexError, ZeroDivisionError,
            OverflowError, RecursionError, MemoryError) as e:
        raise TemplateFailure("render", f"{type(e).__name__}: {str(e)[:300]}") from None
    finally:
        sys.settrace(previous)
    return "".join(parts)
