"""How a checked request becomes a row the engine can step: its prompt rendered and tokenized, a KV cache
taken from the prompt cache or made anew, and the core's Request over it. Engine thread only.

This is the one module that reaches under the pipeline's public API (load, request, drive, generator):
- `render_chat` renders messages with the folder's chat template (the model's, compiled at load), so the
  prompt's ids are known before a row is opened (the prompt cache compares them).
- `PromptCache` continues the generator of an earlier request, as chat.py continues a conversation: it
  rewinds the generator to the prefix the new prompt shares with it (`TokenGenerator.rewind`, driven by
  `pipe.driver`), gives it the new request's sampling settings (`TokenGenerator.resample`: a fresh sampler,
  a seed starting over) and builds a core `Request` over it (as `Chat.say` does). A generator's length is
  fixed when it is made, so every generator is made at the slot length (a draft model's cache starts over
  when a kept generator is taken); and a cache cannot be forked, so one
  conversation's cache serves one request at a time. A row of the batched scheduler prefills alone
  (from its cached prefix or anew) and then joins the batch (loops/batched.py), so cached prefixes and
  batching work together.
- A transcription (an uploaded WAV file) and a chat whose messages hold images or audio are no prompt to
  cache: their row is `pipe.request` with the media, decoded here (audio at the folder's sampling rate; a
  transcription's decoder starts from the folder's start token).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from ..config.settings import SearchSettings
from ..errors import GenerationError
from ..request import Chunk, Request
from ..sampling.settings import settings_for
from ..tokenizer import encode
from .protocol import Completion, InvalidRequest

DEFAULT_SLOT_LENGTH = 2048  # a row's tokens when neither the config nor the model says
MAX_IMAGE_SIDE = 4096  # the largest side of a chat message's image, in pixels (checked before it is decoded)
PREDICTION_DRAFTS = 16  # drafted tokens a round at most for a prediction, where the server sets no lookup


def slot_length(pipe: Any) -> int:
    """Prompt + completion tokens a row may hold: the config's max_length, within the model's context."""
    context = pipe.config.metadata.get("context_length")
    length = pipe.config.generation.max_length or context or DEFAULT_SLOT_LENGTH
    return min(length, context) if isinstance(context, int) else length


def chat_template(pipe: Any) -> Any | None:
    """The folder's chat template (compiled when the model loaded), or None when it has none."""
    return pipe.model.template


def render_chat(template: Any, messages: tuple[dict[str, str], ...]) -> str:
    return template.render(list(messages), True)


def prompt_ids(pipe: Any, template: Any | None, c: Completion) -> list[int]:
    if c.endpoint == "transcription":
        try:  # a folder that reads no audio says so first
            pipe.model.check_media(False, True)
        except GenerationError as e:
            raise InvalidRequest(f"This model does not transcribe: {e}.", "file", "invalid_value") from None
        start = pipe.config.tokens.decoder_start
        if start is None:
            raise InvalidRequest("This model folder sets no decoder start token, which a transcription "
                                 "starts from: add it to its config (genai_config.json: "
                                 "model.decoder_start_token_id, or tokens.decoder_start in v2).", status=500,
                                 kind="server_error")
        try:  # the start ids with the request's language and task (a None: the model chooses the language)
            return pipe.model.decoder_ids(c.language, c.task)
        except GenerationError as e:
            doing = "translate" if c.task == "translate" else "take this language"
            raise InvalidRequest(f"This model does not {doing}: {e}.", "language" if c.language else None,
                                 "invalid_value") from None
    _needs_no_audio(pipe)
    if c.prompt_ids is not None:
        return list(c.prompt_ids)
    if pipe.tokenizer is None:
        raise InvalidRequest("This model folder has no tokenizer.json: send the prompt as token ids.",
                             "prompt")
    if c.endpoint == "text":
        return encode(pipe.tokenizer, c.prompt)
    if template is None:
        raise InvalidRequest("This model folder has no chat template (tokenizer_config.json chat_template): "
                             "use /v1/completions.", "messages", "unsupported_value")
    return encode(pipe.tokenizer, render_chat(template, c.messages))


def _needs_no_audio(pipe: Any) -> None:
    """A folder whose every request needs audio (its encoder's input, which no text route gives) sends text
    requests to the route that takes audio."""
    plan = pipe.plan
    for s in plan.init_steps:
        required = not (s.step.optional or plan.config.pipeline.sessions[s.session].optional)
        heard = sorted({"input_features", "audio_features"} & set(s.request_inputs))
        if required and heard:
            raise InvalidRequest(f"Every request of this model needs audio (session {s.session!r} reads "
                                 f"{heard[0]}), which this route does not take: send the audio to POST "
                                 "/v1/audio/transcriptions.", code="unsupported_value")


@dataclass
class Row:
    """One request being generated: the core's Request over a generator, and the counts usage reports."""

    request: Request
    gen: Any  # the StepGenerator whose cache the request extends
    chunks: Iterator[Chunk]  # pipe.drive(request)
    prompt_tokens: int
    cached_tokens: int
    kept: bool  # whether the prompt cache may keep the generator for a later request
    sent: int = 0  # chunks handed out so far
    predicted: bool = False  # its drafts come from the request's prediction (usage counts them)

    def step(self) -> list[Chunk]:
        """The chunks of one step of the request: one token, or a burst of fused decode steps."""
        chunks = [next(self.chunks)]
        while self.sent + len(chunks) < len(self.request.tokens):  # the rest of a burst, already computed
            chunks.append(next(self.chunks))
        self.sent += len(chunks)
        return chunks

    def close(self) -> None:
        if not self.request.done:
            self.request.interrupt()
        self.chunks.close()  # type: ignore[attr-defined]


@dataclass
class _Entry:
    gen: Any


@dataclass
class PromptCache:
    """Generators of finished requests, kept so that a request continuing one reuses its KV cache.

    A new request takes the entry that shares the longest token prefix with its prompt, when that prefix
    is at least half of the prompt (llama.cpp's slot similarity, 0.5) or of the entry: a conversation's next
    turn continues its cache, and so does a repeated prompt; a short shared start (a system prompt) of two
    long conversations does not take one for the other.
    """

    pipe: Any
    size: int  # entries kept at most (each holds a slot-length KV cache)
    length: int  # every generator's max_length
    entries: list[_Entry] = field(default_factory=list)
    # the server's settings (its speculative decoding), under each request's own
    defaults: dict[str, Any] = field(default_factory=dict)

    def open(self, ids: list[int], c: Completion) -> Row:
        encoded = self.pipe.plan.text_encoder is not None  # the prompt is an encoder's: the decoder's is 1 id
        if (1 if encoded else len(ids)) + (c.max_tokens or 1) > self.length:
            raise _too_long(len(ids), c, self.length)
        if c.audio is not None:
            return self._heard(ids, c)
        if c.images or c.audios:
            return self._seen(ids, c)
        if encoded:
            if c.prediction is not None:
                raise InvalidRequest("Invalid 'prediction': a prediction drafts by prompt lookup, which this "
                                     "model (an encoder-decoder) does not run; leave it out.", "prediction",
                                     "invalid_value")
            return self._media_row(ids, c, [], [])
        asked = {**self.defaults, **c.settings}
        if "prompt_lookup_num_tokens" in c.settings:
            asked.update(self._own_lookup(c.settings["prompt_lookup_num_tokens"]))
        predicted = self._predicted(c, asked)
        settings = settings_for(self.pipe.config.generation.settings, asked)
        gen = self._take(ids, settings, asked)
        if gen is None:
            gen = self.pipe.generator(0, max_length=self.length, **asked)
            gen.append_tokens(ids)
        if predicted is not None:
            if gen.core.speculator is None:  # what the protocol lets through always speculates
                raise InvalidRequest("This request cannot speculate, which a prediction needs.", "prediction")
            gen.core.speculator.predict(predicted)
        pending = gen.core.prefill_length
        request = Request(gen.core, settings, self.pipe.tokenizer, pending, c.max_tokens)
        return Row(request, gen, self.pipe.drive(request), len(ids), len(ids) - pending, True,
                   predicted=predicted is not None)

    def _heard(self, ids: list[int], c: Completion) -> Row:
        """A transcription's row: the request over its audio file (a bad file names the "file" parameter)."""
        name, data = c.audio
        return self._media_row(ids, c, [], [self._samples(data, name)])

    def _seen(self, ids: list[int], c: Completion) -> Row:
        """A chat with images or audio: the request over them, decoded (such a prompt is not cached)."""
        from ..targets.cpython.media import decode_image_bytes  # the server runs the CPython target

        if c.prediction is not None:
            raise InvalidRequest("Invalid 'prediction': a prediction drafts by prompt lookup, which a "
                                 "request with images or audio does not run; leave it out.", "prediction",
                                 "invalid_value")
        try:  # a folder that reads no image (no audio) says so before any is decoded
            self.pipe.model.check_media(bool(c.images), bool(c.audios))
        except GenerationError as e:
            raise InvalidRequest(f"This model does not take the messages' media: {e}.", "messages",
                                 "invalid_value") from None
        images, audios = [], []
        for i, data in enumerate(c.images, 1):
            try:
                images.append(decode_image_bytes(data, f"image {i}", MAX_IMAGE_SIDE))
            except GenerationError as e:
                raise InvalidRequest(f"Invalid image {i} of the messages: {e}.", "messages",
                                     "invalid_image") from None
        for i, data in enumerate(c.audios, 1):
            try:
                audios.append(self._samples(data, f"audio {i}"))
            except GenerationError as e:
                raise InvalidRequest(f"Invalid audio {i} of the messages: {e}.", "messages",
                                     "invalid_value") from None
        return self._media_row(ids, c, images, audios)

    def _samples(self, data: bytes, name: str) -> Any:
        """A WAV file's samples at the folder's sampling rate, as far as its feature extractor reads."""
        from ..targets.cpython.media import wav_samples  # the server runs the CPython target

        config = self.pipe.model.audio_config()
        return wav_samples(data, name, config.sampling_rate, config.chunk_length)

    def _media_row(self, ids: list[Any], c: Completion, images: list[Any], audios: list[Any]) -> Row:
        limit = {"max_new_tokens": c.max_tokens} if c.max_tokens else {"max_length": self.length}
        # a transcription's decoder starts from the folder's start ids with its language and task
        prompt = ({"language": c.language, "task": c.task} if c.endpoint == "transcription"
                  else {"prompt_ids": ids})
        request = self.pipe.request(images=images, audios=audios, **prompt, **limit, **c.settings)
        return Row(request, None, self.pipe.drive(request), len(ids), 0, False)

    def _predicted(self, c: Completion, asked: dict[str, Any]) -> list[int] | None:
        """A request's prediction as token ids, and (in `asked`) the prompt lookup that drafts it: the
        server's, else PREDICTION_DRAFTS tokens a round at most."""
        if c.prediction is None:
            return None
        if self._drafts_with_model:
            raise InvalidRequest("This server drafts with a draft model (--draft-model, or its config's "
                                 "speculative.draft_model): it cannot draft a prediction.", "prediction",
                                 "unsupported_value")
        if c.settings.get("prompt_lookup_num_tokens") == 0:
            raise InvalidRequest("Invalid 'prompt_lookup_num_tokens': 0 turns off the drafting a prediction "
                                 "needs; drop one of them.", "prompt_lookup_num_tokens", "invalid_value")
        if self.pipe.tokenizer is None:
            raise InvalidRequest("This model folder has no tokenizer.json: a prediction cannot be tokenized.",
                                 "prediction")
        config = self.pipe.config.generation.settings
        if not (asked.get("prompt_lookup_num_tokens") or asked.get("ngram_size") or
                config.prompt_lookup_num_tokens or config.ngram_size):
            asked["prompt_lookup_num_tokens"] = PREDICTION_DRAFTS
        ids = encode(self.pipe.tokenizer, c.prediction) if c.prediction else []
        if len(ids) > self.length:  # more than a reply can hold: its drafts would index for nothing
            raise InvalidRequest(f"Invalid 'prediction': {len(ids)} tokens, more than this model's context "
                                 f"of {self.length} tokens can hold; predict the reply, not more.",
                                 "prediction", "invalid_value")
        return ids

    @property
    def _drafts_with_model(self) -> bool:
        """The server drafts with a draft model (its flag or its config's)."""
        return bool(self.defaults.get("draft_model") or self.pipe.config.generation.settings.draft_model)

    def _own_lookup(self, tokens: int) -> dict[str, Any]:
        """A request's prompt_lookup_num_tokens: prompt lookup drafting at most that many, or (0) no
        speculation, whatever the server drafts by; a server that drafts with a model keeps it."""
        if self._drafts_with_model:
            raise InvalidRequest(
                "This server drafts with a draft model (--draft-model, or its config's "
                "speculative.draft_model): 'prompt_lookup_num_tokens' cannot be set per request.",
                "prompt_lookup_num_tokens",
                "unsupported_value",
            )
        return {} if tokens else {"ngram_size": 0}

    def keep(self, row: Row) -> None:
        if self.size <= 0 or not row.kept:
            return
        self.entries.append(_Entry(row.gen))
        del self.entries[:-self.size]

    def _take(self, ids: list[int], settings: SearchSettings, asked: dict[str, Any]) -> Any | None:
        best, common = None, 0
        for entry in self.entries:
            n = _common_prefix(entry.gen.tokens, ids)
            if n > common and 2 * n >= min(len(ids), len(entry.gen.tokens)):
                best, common = entry, n
        if best is None:
            return None
        self.entries.remove(best)
        keep = min(common, len(ids) - 1)  # at least one id is run, to give the next token's logits
        self.pipe.driver.drive(best.gen.core.rewind(keep))
        self.pipe.driver.drive(self.pipe.model.prepare(asked))  # a draft model, loaded once
        best.gen.core.resample(settings, self.pipe.model.draft_plan(asked))
        best.gen.append_tokens(ids[keep:])
        return best.gen


def _too_long(prompt: int, c: Completion, length: int) -> InvalidRequest:
    asked = f"{prompt} in the prompt" + (f", {c.max_tokens} in the completion" if c.max_tokens else "")
    return InvalidRequest(f"This model's maximum context length is {length} tokens. However, you requested "
                          f"{prompt + (c.max_tokens or 0)} tokens ({asked}). Please reduce the length of the "
                          "prompt or the completion.", "messages" if c.endpoint == "chat" else "prompt",
                          "context_length_exceeded")


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n

