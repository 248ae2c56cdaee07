"""The Tokenizer protocol; implementations live with the targets (HF tokenizers, tokenizers.js)."""

from __future__ import annotations

from typing import Protocol

from .errors import GenerationError


class Tokenizer(Protocol):
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...

    # A tokenizer may also have `text_stream()`, giving an object that behaves like `TextStream(self)`
    # in what Request calls (push_many, flush) at less cost: the browser's runs in JS, next to
    # tokenizers.js; and `encode_batch(texts)`, each text's ids with the special tokens in one call
    # (CPython's encodes them in parallel).


def encode(tokenizer: Tokenizer, text: str, add_special_tokens: bool = True) -> list[int]:
    """`tokenizer.encode`, with what its library refuses (a lone surrogate, ...) a GenerationError."""
    if not isinstance(text, str):
        raise GenerationError(f"text to encode must be a string, found {type(text).__name__}")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:  # a lone surrogate: half of a UTF-16 pair, no character
        raise GenerationError(
            f"the text is not valid Unicode: character {e.start} is a lone surrogate "
            f"({text[e.start]!r}, half of a UTF-16 pair); remove it or complete the pair"
        ) from None
    try:
        return tokenizer.encode(text, add_special_tokens=add_special_tokens)
    except Exception as e:  # the tokenizer library's own errors, whatever their type
        raise GenerationError(
            f"the tokenizer cannot encode this text: {type(e).__name__}: {str(e)[:200]}"
        ) from None


class ChatTemplate(Protocol):
    """The folder's chat template (tokenizer_config.json `chat_template`), rendered to text."""

    def render(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str: ...


class TextStream:
    """Turns a growing list of token ids into text deltas that never end inside a character.

    It decodes a window of the latest ids, not the whole generated span, so a token costs the
    same at the end of a long generation as at its start. Decoding from a window's first id on
    keeps merges inside the window right (a space owned by the next token, a multi-byte
    character split over tokens); a delta is held back while the text ends in U+FFFD, the mark of
    an incomplete UTF-8 sequence. When the window grows past `WINDOW` ids it restarts at its last
    `CONTEXT` ids, whose text was already sent, so the next token still sees its left context.
    """

    WINDOW = 24
    CONTEXT = 6

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.start = 0  # the window: ids[start:]
        self.sent = ""  # the text of the window sent so far

    def push(self, token: int) -> str:
        self.ids.append(token)
        text = self.tokenizer.decode(self.ids[self.start :])
        if text.endswith("\ufffd") or not text.startswith(self.sent):
            return ""
        delta, self.sent = text[len(self.sent) :], text
        if len(self.ids) - self.start > self.WINDOW:
            self.start = len(self.ids) - self.CONTEXT
            self.sent = self.tokenizer.decode(self.ids[self.start :])
        return delta

    def push_many(self, tokens: list[int]) -> list[str]:
        return [self.push(token) for token in tokens]

    def flush(self) -> str:
        text = self.tokenizer.decode(self.ids[self.start :])
        delta = text[len(self.sent) :] if text.startswith(self.sent) else ""
        self.sent = text
        return delta
