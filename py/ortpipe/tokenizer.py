"""The Tokenizer protocol; implementations live with the targets (HF tokenizers, tokenizers.js)."""

from __future__ import annotations

from typing import Protocol


class Tokenizer(Protocol):
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...


class ChatTemplate(Protocol):
    """The folder's chat template (tokenizer_config.json `chat_template`), rendered to text."""

    def render(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str: ...


class TextStream:
    """Turns a growing list of token ids into text deltas that never end inside a character.

    Decoding the whole generated span each time keeps merges (a space owned by the next token,
    a multi-byte character split over tokens) right; a delta is held back while the text ends in
    U+FFFD, the mark of an incomplete UTF-8 sequence.
    """

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.sent = ""

    def push(self, token: int) -> str:
        self.ids.append(token)
        text = self.tokenizer.decode(self.ids)
        if text.endswith("\ufffd") or not text.startswith(self.sent):
            return ""
        delta, self.sent = text[len(self.sent):], text
        return delta

    def flush(self) -> str:
        text = self.tokenizer.decode(self.ids)
        delta = text[len(self.sent):] if text.startswith(self.sent) else ""
        self.sent = text
        return delta
