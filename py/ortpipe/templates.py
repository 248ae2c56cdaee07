"""The folder's chat template: found in tokenizer_config.json, compiled by the target, rendered here.

What both targets share lives here: where the template comes from, the special tokens it sees,
the shape of the messages, what each failure means and the limits. The target only supplies a
compiler (jinja2's sandbox under CPython, @huggingface/jinja in the browser) whose renderer raises
`TemplateFailure`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .errors import ConfigError, GenerationError
from .folder import Folder
from .jsonfile import quote, read_json

TOKENIZER_CONFIG = "tokenizer_config.json"
MAX_RENDERED = 1 << 20  # characters a rendered conversation may have (a long chat is a few hundred KB)
RENDER_SECONDS = 2.0  # a chat template renders in well under a millisecond; a runaway loop is stopped
MAX_MESSAGES = 10_000


class TemplateFailure(Exception):
    """Raised by a target's renderer: `kind` is "syntax", "security" (the sandbox blocked it),
    "refused" (the template's raise_exception), "limit" (time or size) or "render" (anything else)."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


Renderer = Callable[[dict[str, Any]], str]
Compiler = Callable[[str], Renderer]


class ChatTemplate:
    """Renders conversations with the folder's template."""

    def __init__(self, source: str, special_tokens: dict[str, str], compile_template: Compiler, where: str):
        self.where = where
        self._tokens = special_tokens
        try:
            self._render = compile_template(source)
        except TemplateFailure as e:
            raise ConfigError(f"{where}: the chat template does not compile ({e.kind}): {e}") from None

    def render(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        check_messages(messages)
        context = {"messages": messages, "add_generation_prompt": add_generation_prompt, **self._tokens}
        try:
            text = self._render(context)
        except TemplateFailure as e:
            raise _failure(e, self.where) from None
        if not isinstance(text, str) or len(text) > MAX_RENDERED:
            raise GenerationError(
                f"the chat template rendered more than {MAX_RENDERED} characters; shorten the "
                "conversation, or check the template for a runaway loop"
            )
        return text


def _failure(e: TemplateFailure, where: str) -> Exception:
    if e.kind == "refused":
        return GenerationError(f"the chat template refused the conversation: {e}")
    if e.kind == "security":
        return ConfigError(
            f"{where}: the chat template tried something the sandbox blocks ({e}); the template "
            "is not safe to run"
        )
    if e.kind == "limit":
        return GenerationError(
            f"the chat template ran past its limits ({e}); shorten the conversation, or "
            "check the template for a runaway loop"
        )
    return GenerationError(f"the chat template failed on this conversation: {e}")


def check_messages(messages: Any) -> None:
    """Messages as chat templates take them: a role and a content, which is a string or a list of parts
    ({"type": "text", "text": ...}, or {"type": "image"} / {"type": "audio"} where the request's next image
    or audio clip goes, as transformers' processors pass them to a multimodal model's template)."""
    if not isinstance(messages, list) or not messages or len(messages) > MAX_MESSAGES:
        raise GenerationError(
            f"messages must be a non-empty list of {{role, content}} objects, found {quote(messages)}"
        )
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not _content_ok(m.get("content")):
            raise GenerationError(
                f"messages[{i}] must be an object with a string role and a content that is a string or a "
                f'list of parts ({{"type": "text", "text": ...}}, {{"type": "image"}} or '
                f'{{"type": "audio"}}), found {quote(m)}'
            )


def _content_ok(content: Any) -> bool:
    if isinstance(content, str):
        return True
    return isinstance(content, list) and all(
        isinstance(p, dict) and (p in (IMAGE_PART, AUDIO_PART) or _text_part(p)) for p in content)


IMAGE_PART, AUDIO_PART = {"type": "image"}, {"type": "audio"}


def _text_part(part: dict[str, Any]) -> bool:
    return part.keys() == {"type", "text"} and part["type"] == "text" and isinstance(part["text"], str)


def media_parts(messages: list[dict[str, Any]], kind: str) -> int:
    """How many {"type": kind} parts ("image", "audio") the messages hold."""
    return sum(p == {"type": kind} for m in messages if isinstance(m["content"], list) for p in m["content"])


def load_chat_template(folder: Folder, compile_template: Compiler) -> ChatTemplate | None:
    """The folder's chat template, compiled; None when tokenizer_config.json has none."""
    if not folder.exists(TOKENIZER_CONFIG):
        return None
    config = read_json(folder, TOKENIZER_CONFIG)
    source = config.get("chat_template")
    if isinstance(source, list):  # named templates: take the default one
        source = next(
            (t.get("template") for t in source if isinstance(t, dict) and t.get("name") == "default"), None
        )
    if source is None:
        return None
    where = folder.describe(TOKENIZER_CONFIG)
    if not isinstance(source, str):
        raise ConfigError(
            f"{where}: chat_template must be a string (or a list of named templates), found {quote(source)}"
        )
    tokens = {k: _token_text(config.get(k)) for k in ("bos_token", "eos_token")}
    return ChatTemplate(source, tokens, compile_template, where)


def missing_template() -> GenerationError:
    return GenerationError(
        f"{TOKENIZER_CONFIG} has no chat_template, which messages and chat need: give a prompt "
        "instead, or add the model's chat_template"
    )


def _token_text(value: Any) -> str:
    if isinstance(value, dict):
        value = value.get("content", "")
    return value if isinstance(value, str) else ""
