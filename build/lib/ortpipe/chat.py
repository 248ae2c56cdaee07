"""A chat over one KV cache: each turn appends only its new tokens (continuous decoding).

The cache holds the rendered conversation so far: the template's text up to the last assistant
turn, then the generated tokens as they were generated. A new turn renders the whole conversation
and, when it extends that text, appends the tokens of the difference; otherwise (a template that
rewrites history) it starts over from the full rendering.

A turn whose generation failed (the target raised, Ctrl-C) is dropped: the next turn or rewind
first rewinds the cache to the last complete turn, so the chat goes on as if it had not been said.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .errors import GenerationError
from .execute.work import Work
from .request import Request
from .sampling.settings import check_setting, settings_for
from .tokenizer import ChatTemplate, encode

if TYPE_CHECKING:
    from .model import Model


@dataclass(frozen=True)
class Turn:
    tokens_before: int  # ids in the conversation before this turn
    messages_before: int
    text_before: str


DEFAULT_MAX_LENGTH = 2048  # a conversation's length when neither the caller nor the config sets one


class Chat:
    def __init__(self, model: Model, template: ChatTemplate, max_length: int | None = None, **settings: Any):
        if model.tokenizer is None:
            raise GenerationError("chat needs the folder's tokenizer.json")
        self.model, self.template = model, template
        self.settings = settings_for(model.config.generation.settings, settings)
        check_setting("max_length", max_length)  # 0 or {} would read as "not given" below
        limit = max_length or model.config.generation.max_length or DEFAULT_MAX_LENGTH
        self._options = {"max_length": limit, **settings}
        self.gen = model.generator(0, **self._options)
        self.messages: list[dict[str, str]] = []
        self.turns: list[Turn] = []
        self.text = ""  # what the ids in the conversation render to
        self._open: tuple[Request, str] | None = None  # the last turn's request and its rendered prompt

    @property
    def tokens(self) -> list[int]:
        return self.gen.tokens

    def say(self, content: str, max_new_tokens: int | None = None) -> Request:
        """Queue a user turn; drive the returned Request to get the reply. Its first advance rewinds
        a failed turn before it, if there is one."""
        if not isinstance(content, str):
            raise GenerationError("a chat turn needs its content: a string")
        check_setting("max_new_tokens", max_new_tokens)
        recovery = self._close_turn()
        length = len(self.gen.tokens) if recovery is None else recovery[1]
        rendered = self.template.render([*self.messages, {"role": "user", "content": content}], True)
        tokenizer = self.model.tokenizer
        self.turns.append(Turn(length, len(self.messages), self.text))
        if self.text and rendered.startswith(self.text):
            ids = encode(tokenizer, rendered[len(self.text):], add_special_tokens=False)
        else:  # first turn, or a template that rewrites earlier turns
            self.gen = self.model.generator(0, **self._options)
            recovery = None
            ids = encode(tokenizer, rendered)
        self.messages.append({"role": "user", "content": content})
        request = TurnRequest(self, ids, recovery[0] if recovery else None, max_new_tokens)
        self._open = (request, rendered)
        return request

    def rewind(self) -> Work:
        """Drop the last turn (the user's message and the reply); drive it like any work."""
        recovery = self._close_turn()
        if recovery is None:
            if not self.turns:
                raise GenerationError("there is no turn to rewind")
            recovery = self._drop_last_turn()
        yield from recovery[0]

    def _drop_last_turn(self) -> tuple[Work, int]:
        """Forget the last turn now; (the work that rewinds the cache to before it, that length)."""
        turn = self.turns.pop()
        del self.messages[turn.messages_before:]
        self.text = turn.text_before
        return self.gen.rewind(turn.tokens_before), turn.tokens_before

    def _close_turn(self) -> tuple[Work, int] | None:
        """Record the last turn's reply; a turn that failed or never ran is dropped instead (see
        _drop_last_turn)."""
        if self._open is None:
            return None
        request, rendered = self._open
        self._open = None
        if request.failed or not request.started:
            return self._drop_last_turn()
        tokenizer = self.model.tokenizer
        reply = tokenizer.decode(request.tokens, skip_special_tokens=True)
        self.messages.append({"role": "assistant", "content": reply})
        self.text = rendered + tokenizer.decode(request.tokens, skip_special_tokens=False)
        return None


class TurnRequest(Request):
    """A chat turn: appends its ids to the chat's sequence when it first advances (after rewinding a
    failed turn before it), then generates like any request."""

    def __init__(self, chat: Chat, ids: list[int], recovery: Work | None, max_new_tokens: int | None):
        super().__init__(chat.gen, chat.settings, chat.model.tokenizer, len(ids), max_new_tokens)
        self._ids, self._recovery = ids, recovery
        self.timings.load_ms = chat.model.load_ms

    def advance(self) -> Work:
        if self._ids is not None:
            if self._recovery is not None:
                yield from self._recovery
                self._recovery = None
            self.gen.append_tokens(self._ids)
            self._ids = None
            self.timings.prompt_tokens = self.gen.prefill_length
        return (yield from super().advance())

    @property
    def started(self) -> bool:
        return self._ids is None
