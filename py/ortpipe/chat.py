"""A chat over one KV cache: each turn appends only its new tokens (continuous decoding).

The cache holds the rendered conversation so far: the template's text up to the last assistant
turn, then the generated tokens as they were generated. A new turn renders the whole conversation
and, when it extends that text, appends the tokens of the difference; otherwise (a template that
rewrites history) it starts over from the full rendering.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .errors import GenerationError
from .execute.work import Work
from .pipeline import Pipeline, Request
from .sampling.settings import settings_for
from .tokenizer import ChatTemplate


@dataclass(frozen=True)
class Turn:
    tokens_before: int  # ids in the conversation before this turn
    messages_before: int
    text_before: str


DEFAULT_MAX_LENGTH = 2048  # a conversation's length when neither the caller nor the config sets one


class Chat:
    def __init__(self, pipeline: Pipeline, template: ChatTemplate, max_length: int | None = None,
                 **settings: Any):
        if pipeline.tokenizer is None:
            raise GenerationError("chat needs the folder's tokenizer.json")
        self.pipeline, self.template = pipeline, template
        self.settings = settings_for(pipeline.config, settings)
        limit = max_length or pipeline.config.generation.max_length or DEFAULT_MAX_LENGTH
        self._options = {"max_length": limit, **settings}
        self.gen = pipeline.generator(0, **self._options)
        self.messages: list[dict[str, str]] = []
        self.turns: list[Turn] = []
        self.text = ""  # what the ids in the conversation render to
        self._open: tuple[Request, str] | None = None  # the last turn's request and its rendered prompt

    def say(self, content: str, max_new_tokens: int | None = None) -> Request:
        """Queue a user turn; drive the returned Request to get the reply."""
        self._close_turn()
        rendered = self.template.render([*self.messages, {"role": "user", "content": content}], True)
        tokenizer = self.pipeline.tokenizer
        self.turns.append(Turn(len(self.gen.tokens), len(self.messages), self.text))
        if self.text and rendered.startswith(self.text):
            ids = tokenizer.encode(rendered[len(self.text):], add_special_tokens=False)
        else:  # first turn, or a template that rewrites earlier turns
            self.gen = self.pipeline.generator(0, **self._options)
            ids = tokenizer.encode(rendered)
        self.messages.append({"role": "user", "content": content})
        self.gen.append_tokens(ids)
        request = Request(self.gen, self.settings, tokenizer, self.gen.prefill_length, max_new_tokens)
        self._open = (request, rendered)
        return request

    def rewind(self) -> Work:
        """Drop the last turn (the user's message and the reply); drive it like any work."""
        self._close_turn()
        if not self.turns:
            raise GenerationError("there is no turn to rewind")
        turn = self.turns.pop()
        yield from self.gen.rewind(turn.tokens_before)
        del self.messages[turn.messages_before:]
        self.text = turn.text_before

    def _close_turn(self) -> None:
        if self._open is None:
            return
        request, rendered = self._open
        self._open = None
        tokenizer = self.pipeline.tokenizer
        reply = tokenizer.decode(request.tokens, skip_special_tokens=True)
        self.messages.append({"role": "assistant", "content": reply})
        self.text = rendered + tokenizer.decode(request.tokens, skip_special_tokens=False)

