"""The OpenAI wire format: request bodies checked into `Completion`s, and replies built as OpenAI builds them.

No I/O and no model here: the app (app.py) hands a parsed JSON body in and sends the dicts out.

Parameters follow the OpenAI API reference for `POST /v1/chat/completions` and `POST /v1/completions`:
- served: model, messages / prompt, max_tokens, max_completion_tokens, temperature, top_p, seed, stop, n,
  frequency_penalty and presence_penalty (over the generated tokens, as OpenAI describes them), logit_bias,
  logprobs and top_logprobs, stream, stream_options.include_usage; and top_k, min_p, repetition_penalty,
  which vLLM and llama.cpp accept beside OpenAI's and clients send through `extra_body`, as they send
  ortpipe's `prompt_lookup_num_tokens` (speculative decoding by prompt lookup for this request; 0: none);
  and `prediction` (Predicted Outputs: the reply's expected text, drafted by prompt lookup; on
  /v1/completions too);
- accepted at their neutral value and refused otherwise, naming the parameter (OpenAI refuses what a model
  cannot do the same way): tools, response_format, echo, suffix;
- completions' `best_of`: that many candidates generated (rows of the batch, seeded in turn as `n`'s choices),
  the `n` with the highest mean log-probability a token returned; not streamed, as OpenAI has it;
- accepted and without effect here: user, metadata, store, service_tier and the other bookkeeping fields the
  `openai` package can send;
- anything else is refused as OpenAI refuses it: "Unrecognized request argument supplied: NAME".
The `openai` package sends only what its caller passed (it drops every omitted argument), so a plain
`client.chat.completions.create(model=..., messages=...)` body holds those two fields.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import re
import time
from dataclasses import dataclass, field
from typing import Any

from ..config.settings import BY_NAME, MAX_DRAFT

MAX_STOP = 4  # OpenAI: "up to 4 sequences"
MAX_N = 128  # OpenAI's most choices a request asks for
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool",
         "function": "function"}  # developer messages are the system prompt for models that predate the role


class InvalidRequest(ValueError):
    """A request the server refuses with a 400 (or `status`), in OpenAI's error object."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None, status: int = 400,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.message, self.param, self.code, self.status, self.kind = message, param, code, status, kind

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.kind, self.param, self.code)


def error_body(message: str, kind: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


@dataclass(frozen=True)
class Completion:
    """A checked request, in ortpipe's terms: what to prompt with, how much, and the generation settings."""

    endpoint: str  # "chat", "text" or "transcription"
    model: str
    messages: tuple[dict[str, Any], ...] = ()  # chat: rendered with the folder's chat template
    prompt: str | None = None  # text: a prompt string ...
    prompt_ids: tuple[int, ...] | None = None  # ... or token ids
    max_tokens: int | None = None  # None: until eos or the end of the context
    settings: dict[str, Any] = field(default_factory=dict)  # pipe.request's settings (temperature, stop, ...)
    stream: bool = False
    include_usage: bool = False
    n: int = 1  # choices: n rows of the batch, choice i seeded seed + i when the request gives a seed
    prediction: str | None = None  # chat: the text the reply is expected to be (OpenAI's Predicted Outputs)
    best_of: int = 1  # completions: candidates generated (at least n), the n best returned
    audio: tuple[str, bytes] | None = None  # transcriptions: the uploaded file's name and bytes (a WAV file)
    images: tuple[bytes, ...] = ()  # chat: the image files of the messages' image parts, in order
    audios: tuple[bytes, ...] = ()  # chat: the WAV files of the messages' audio parts, in order
    response_format: str = "json"  # transcriptions: "json" ({"text"}) or "text" (the text alone)
    language: str | None = None  # transcriptions: the decoder's language (a code; None: the model's choice)
    task: str | None = None  # transcriptions: the decoder's task (translations: "translate")

    @property
    def candidates(self) -> int:
        """The jobs the request runs: n choices, or best_of candidates."""
        return max(self.n, self.best_of)

    def choice(self, i: int) -> Completion:
        """The request of choice (or candidate) i: one choice, its seed seed + i; a candidate of best_of
        gives its tokens' log-probabilities, by which the best are chosen."""
        settings = self.settings
        if i and settings.get("seed") is not None:
            settings = {**settings, "seed": settings["seed"] + i}
        if self.best_of > self.n and settings.get("logprobs") is None:
            settings = {**settings, "logprobs": 0}
        return dataclasses.replace(self, settings=settings, n=1, best_of=1)


# --- checking values -------------------------------------------------------------------------------------

_TYPE_NAMES = {bool: "a boolean", int: "an integer", float: "a decimal", str: "a string", list: "an array",
               dict: "an object", type(None): "null"}


def _type_error(name: str, expected: str, value: Any) -> InvalidRequest:
    got = _TYPE_NAMES.get(type(value), type(value).__name__)
    return InvalidRequest(f"Invalid type for '{name}': expected {expected}, but got {got} instead.", name,
                          "invalid_type")


def _integer(value: Any, name: str, low: int | None = None, high: int | None = None) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise _type_error(name, "an integer", value)
    if low is not None and value < low:
        raise InvalidRequest(f"Invalid '{name}': integer below minimum value. Expected a value >= {low}, "
                             f"but got {value} instead.", name, "integer_below_min_value")
    if high is not None and value > high:
        raise InvalidRequest(f"Invalid '{name}': integer above maximum value. Expected a value <= {high}, "
                             f"but got {value} instead.", name, "integer_above_max_value")
    return value


def _decimal(value: Any, name: str, low: float, high: float) -> float:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or value != value:
        raise _type_error(name, "a decimal", value)
    if value < low:
        raise InvalidRequest(f"Invalid '{name}': decimal below minimum value. Expected a value >= {low}, "
                             f"but got {value} instead.", name, "decimal_below_min_value")
    if value > high:
        raise InvalidRequest(f"Invalid '{name}': decimal above maximum value. Expected a value <= {high}, "
                             f"but got {value} instead.", name, "decimal_above_max_value")
    return float(value)


def _boolean(value: Any, name: str) -> bool:
    if not isinstance(value, bool):
        raise _type_error(name, "a boolean", value)
    return value


def _missing(name: str) -> InvalidRequest:
    return InvalidRequest(f"Missing required parameter: '{name}'.", name, "missing_required_parameter")


def _unsupported(name: str, why: str = "is not supported by this server yet") -> InvalidRequest:
    return InvalidRequest(f"Unsupported parameter: '{name}' {why}.", name, "unsupported_parameter")


def _stop(value: Any) -> tuple[str, ...]:
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list):
        raise _type_error("stop", "a string or an array of strings", value)
    if len(stops) > MAX_STOP:
        raise InvalidRequest(f"Invalid 'stop': array too long. Expected an array with maximum length "
                             f"{MAX_STOP}, but got an array with length {len(stops)} instead.", "stop",
                             "array_above_max_length")
    for i, stop in enumerate(stops):
        if not isinstance(stop, str):
            raise _type_error(f"stop[{i}]", "a string", stop)
        if not stop:
            raise InvalidRequest(f"Invalid 'stop[{i}]': a stop sequence must not be empty.", f"stop[{i}]",
                                 "invalid_value")
    return tuple(stops)


# Parameters read the same way by both endpoints: name -> how the value becomes a pipe.request setting.
def _settings(body: dict[str, Any]) -> dict[str, Any]:
    settings: dict[str, Any] = {}
    if body.get("temperature") is not None:
        t = _decimal(body["temperature"], "temperature", 0.0, 2.0)
        settings.update(temperature=t, do_sample=t > 0)  # 0 is greedy, as OpenAI documents
    if body.get("top_p") is not None:
        settings["top_p"] = _decimal(body["top_p"], "top_p", 0.0, 1.0)
        if settings["top_p"] == 0:
            raise InvalidRequest("Invalid 'top_p': expected a value above 0 (1 turns it off).", "top_p",
                                 "decimal_below_min_value")
    if body.get("seed") is not None:
        settings["seed"] = _integer(body["seed"], "seed")
    if body.get("stop") is not None:
        settings["stop"] = _stop(body["stop"])
    if body.get("top_k") is not None:
        settings["top_k"] = _integer(body["top_k"], "top_k", low=0)
    if body.get("min_p") is not None:
        settings["min_p"] = _decimal(body["min_p"], "min_p", 0.0, 1.0)
    if body.get("repetition_penalty") is not None:
        settings["repetition_penalty"] = _decimal(body["repetition_penalty"], "repetition_penalty", 1e-6, 1e6)
    for name in ("frequency_penalty", "presence_penalty"):
        if body.get(name) is not None:
            settings[name] = _decimal(body[name], name, -2.0, 2.0)
    if body.get("logit_bias") is not None:
        settings["logit_bias"] = _logit_bias(body["logit_bias"])
    return _speculation(body, settings)


def _speculation(body: dict[str, Any], settings: dict[str, Any]) -> dict[str, Any]:
    """ortpipe's prompt_lookup_num_tokens: prompt lookup drafting for this request (0: no speculation)."""
    value = body.get("prompt_lookup_num_tokens")
    if value is not None:
        name = "prompt_lookup_num_tokens"
        settings[name] = _integer(value, name, low=0, high=MAX_DRAFT)
    return settings


def _logit_bias(bias: Any) -> dict[int, float]:
    """OpenAI's {"token id": bias} (-100 to 100), checked as the core checks its logit_bias setting."""
    if not isinstance(bias, dict):
        raise _type_error("logit_bias", "an object", bias)
    checked, why = BY_NAME["logit_bias"].check(bias)
    if why is not None:
        raise InvalidRequest(f"Invalid 'logit_bias': it {why}.", "logit_bias", "invalid_value")
    return dict(checked)


# Parameters accepted only at a value that changes nothing (null is always such a value).
NEUTRAL: dict[str, tuple[Any, ...]] = {
    "tools": ([],), "tool_choice": ("none", "auto"),
    "functions": ([],), "function_call": ("none", "auto"), "response_format": ({"type": "text"},),
    "modalities": (["text"],), "audio": (), "web_search_options": (), "echo": (False,),
    "suffix": ("",)}
WHY_NOT: dict[str, str] = {}


def _neutral(body: dict[str, Any], name: str) -> None:
    value = body.get(name)
    if value is not None and not any(value == v and type(value) is type(v) for v in NEUTRAL[name]):
        raise _unsupported(name, WHY_NOT.get(name, "is not supported by this server yet"))


# Fields each endpoint knows: served ones are read by the parsers; NEUTRAL ones by `_neutral`; IGNORED ones
# change nothing the server does.
COMMON = {"model", "max_tokens", "temperature", "top_p", "seed", "stop", "stream", "stream_options",
          "top_k", "min_p", "repetition_penalty", "logprobs", "frequency_penalty", "presence_penalty",
          "logit_bias", "n", "prompt_lookup_num_tokens"}

IGNORED = {"user", "metadata", "store", "service_tier", "safety_identifier", "prompt_cache_key",
           "prompt_cache_retention", "prompt_cache_options", "verbosity", "moderation", "reasoning_effort",
           "parallel_tool_calls"}
# The ignored fields' types, checked as OpenAI checks them: ignored, not unread.
IGNORED_TYPES: dict[str, tuple[type, str]] = {
    **{name: (str, "a string") for name in ("user", "service_tier", "safety_identifier", "prompt_cache_key",
                                            "prompt_cache_retention", "verbosity", "reasoning_effort")},
    **{name: (bool, "a boolean") for name in ("store", "parallel_tool_calls")},
    "metadata": (dict, "an object"),
}
CHAT_NEUTRAL = {
    "tools",
    "tool_choice",
    "functions",
    "function_call",
    "response_format",
    "modalities",
    "audio",
    "web_search_options",
}
TEXT_NEUTRAL = {"echo", "suffix"}


def _chat_logprobs(body: dict[str, Any]) -> int | None:
    """Chat: `logprobs` true gives the chosen tokens' log-probabilities, `top_logprobs` (0 to 20) as many
    alternatives for each; None when not asked."""
    wanted = body.get("logprobs")
    if wanted is not None and type(wanted) is not bool:
        raise _type_error("logprobs", "a boolean", wanted)
    top = body.get("top_logprobs")
    top = None if top is None else _integer(top, "top_logprobs", low=0, high=20)
    if top is not None and not wanted:
        raise InvalidRequest(
            "Invalid value for 'top_logprobs': 'logprobs' must be true to use it.",
            "top_logprobs",
            "invalid_value",
        )
    return (top or 0) if wanted else None


def _text_logprobs(body: dict[str, Any]) -> int | None:
    """Completions: `logprobs` N (0 to 5) gives the chosen tokens' and N alternatives' log-probabilities."""
    value = body.get("logprobs")
    return None if value is None else _integer(value, "logprobs", low=0, high=5)


def _check_names(body: Any, known: set[str]) -> dict[str, Any]:
    if not isinstance(body, dict):
        got = _TYPE_NAMES.get(type(body))
        raise InvalidRequest(f"Invalid request body: expected a JSON object, but got {got}.")
    for name, value in body.items():
        if name not in known:
            raise InvalidRequest(f"Unrecognized request argument supplied: {name}", name, "unknown_parameter")
        if name in IGNORED_TYPES and value is not None and not isinstance(value, IGNORED_TYPES[name][0]):
            raise _type_error(name, IGNORED_TYPES[name][1], value)
    metadata = body.get("metadata")
    if isinstance(metadata, dict):
        for key, value in metadata.items():
            if not isinstance(value, str):
                raise _type_error(f"metadata.{key}", "a string", value)
    model = body.get("model")
    if model is None:
        raise _missing("model")
    if not isinstance(model, str):
        raise _type_error("model", "a string", model)
    return body


def _stream(body: dict[str, Any]) -> tuple[bool, bool]:
    stream = _boolean(body["stream"], "stream") if body.get("stream") is not None else False
    options = body.get("stream_options")
    if options is None:
        return stream, False
    if not stream:
        raise InvalidRequest(
            "The 'stream_options' parameter is only allowed when 'stream' is enabled.",
            "stream_options",
            "invalid_value",
        )
    if not isinstance(options, dict):
        raise _type_error("stream_options", "an object", options)
    for name in options:
        if name not in ("include_usage", "include_obfuscation"):
            raise InvalidRequest(
                f"Unrecognized request argument supplied: stream_options.{name}",
                f"stream_options.{name}",
                "unknown_parameter",
            )
    usage = options.get("include_usage")
    return stream, _boolean(usage, "stream_options.include_usage") if usage is not None else False


def _max_tokens(body: dict[str, Any], names: tuple[str, ...]) -> int | None:
    for name in names:  # max_completion_tokens first: it replaced max_tokens in OpenAI's chat API
        if body.get(name) is not None:
            return _integer(body[name], name, low=1)
    return None


# --- chat ------------------------------------------------------------------------------------------------


@dataclass
class Media:
    """The files of a chat's image and audio parts, in the order the messages hold them."""

    images: list[bytes] = field(default_factory=list)
    audios: list[bytes] = field(default_factory=list)


def _content(value: Any, where: str, media: Media | None = None) -> str | list[dict[str, str]]:
    """A message's content: a string, or text parts (joined by newlines, as vLLM joins them); with `media`
    (a user message), image_url and input_audio parts too: their files appended to `media`, and the content
    the list of parts chat templates take ({"type": "text", "text"}, {"type": "image"}, {"type": "audio"})."""
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise _type_error(where, "a string or an array of content parts", value)
    parts: list[dict[str, str]] = []
    for i, part in enumerate(value):
        at = f"{where}[{i}]"
        if not isinstance(part, dict):
            raise _type_error(at, "an object", part)
        kind = part.get("type")
        if media is not None and kind == "image_url":
            media.images.append(_image_url(part, at))
            parts.append({"type": "image"})
        elif media is not None and kind == "input_audio":
            media.audios.append(_input_audio(part, at))
            parts.append({"type": "audio"})
        elif kind == "text":
            if not isinstance(part.get("text"), str):
                raise _type_error(f"{at}.text", "a string", part.get("text"))
            parts.append({"type": "text", "text": part["text"]})
        else:
            raise InvalidRequest(
                f"Invalid '{at}.type': content parts of type {kind!r} are not supported here; this server "
                "gives the model text, and images (image_url) and audio (input_audio) in user messages.",
                f"{at}.type",
                "unsupported_value",
            )
    if all(p["type"] == "text" for p in parts):
        return "\n".join(p["text"] for p in parts)
    return parts


DATA_URL = re.compile(r"data:image/[A-Za-z0-9.+-]+(;[A-Za-z0-9=.+-]+)*;base64,")


def _base64(data: str, where: str) -> bytes:
    try:
        return base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise InvalidRequest(f"Invalid '{where}': its base64 data does not decode.", where, "invalid_value") \
            from None


def _part_object(part: dict[str, Any], where: str, name: str, known: set[str]) -> dict[str, Any]:
    """A content part's object (`name`: "image_url", "input_audio"), with only the `known` fields."""
    value = part.get(name)
    if not isinstance(value, dict):
        raise _type_error(f"{where}.{name}", "an object", value)
    unknown = sorted(set(value) - known)
    if unknown:
        raise InvalidRequest(f"Unrecognized request argument supplied: {where}.{name}.{unknown[0]}",
                             f"{where}.{name}.{unknown[0]}", "unknown_parameter")
    return value


def _input_audio(part: dict[str, Any], where: str) -> bytes:
    """An input_audio part's audio: the bytes of its base64 data, a WAV file."""
    audio = _part_object(part, where, "input_audio", {"data", "format"})
    if audio.get("format") != "wav":
        raise _unsupported(f"{where}.input_audio.format", f"{audio.get('format')!r} is not read: this server "
                                                           "reads 'wav' (PCM) only")
    if not isinstance(audio.get("data"), str):
        raise _type_error(f"{where}.input_audio.data", "a string", audio.get("data"))
    return _base64(audio["data"], f"{where}.input_audio.data")


def _image_url(part: dict[str, Any], where: str) -> bytes:
    """An image_url part's image: the bytes of its data: URL (this server fetches nothing)."""
    image = _part_object(part, where, "image_url", {"url", "detail"})
    if image.get("detail") not in (None, "auto"):
        raise _unsupported(f"{where}.image_url.detail", f"{image['detail']!r} is not served: the model's "
                                                        "image processor decides the resolution; send 'auto'")
    url = image.get("url")
    if not isinstance(url, str):
        raise _type_error(f"{where}.image_url.url", "a string", url)
    head = DATA_URL.match(url)
    if head is None:
        shown = url if len(url) <= 60 else f"{url[:40]}..."
        raise InvalidRequest(f"Invalid '{where}.image_url.url': {shown!r} is no base64 data: URL of an "
                             "image; this server fetches nothing: send it as data:image/png;base64,...",
                             f"{where}.image_url.url", "invalid_value")
    return _base64(url[head.end():], f"{where}.image_url.url")


MESSAGE_FIELDS = {
    "role",
    "content",
    "name",
    "tool_call_id",
    "tool_calls",
    "refusal",
    "function_call",
    "audio",
}


def _message(message: Any, i: int, media: Media | None = None) -> dict[str, Any]:
    where = f"messages[{i}]"
    if not isinstance(message, dict):
        raise _type_error(where, "an object", message)
    for name in message:
        if name not in MESSAGE_FIELDS:
            raise InvalidRequest(
                f"Unrecognized request argument supplied: {where}.{name}",
                f"{where}.{name}",
                "unknown_parameter",
            )
    role = message.get("role")
    if role not in ROLES:
        raise InvalidRequest(
            f"Invalid value: {role!r}. Supported values are: {', '.join(map(repr, ROLES))}.",
            f"{where}.role",
            "invalid_value",
        )
    for name in ("tool_calls", "function_call", "audio"):
        if message.get(name):
            raise _unsupported(f"{where}.{name}")
    content = message.get("content")
    if content is None and role != "assistant":
        raise _missing(f"{where}.content")
    given = media if ROLES[role] == "user" else None  # images and audio come in user messages
    text = "" if content is None else _content(content, f"{where}.content", given)
    out: dict[str, Any] = {"role": ROLES[role], "content": text}
    if isinstance(message.get("name"), str):
        out["name"] = message["name"]
    return out


def _prediction(value: Any) -> str | None:
    """Predicted Outputs: {"type": "content", "content": text or text parts}, the reply's expected text."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise _type_error("prediction", "an object", value)
    if value.get("type") != "content":
        got = value.get("type")
        raise InvalidRequest(f"Invalid 'prediction.type': expected 'content', but got {got!r}.",
                             "prediction.type", "invalid_value")
    unknown = sorted(set(value) - {"type", "content"})
    if unknown:
        raise InvalidRequest(f"Unrecognized request argument supplied: prediction.{unknown[0]}",
                             f"prediction.{unknown[0]}", "unknown_parameter")
    if "content" not in value:
        raise _missing("prediction.content")
    return _content(value["content"], "prediction.content")


def parse_chat(body: Any) -> Completion:
    body = _check_names(
        body,
        COMMON | IGNORED | CHAT_NEUTRAL | {"messages", "max_completion_tokens", "top_logprobs", "prediction"},
    )

    messages = body.get("messages")
    if messages is None:
        raise _missing("messages")
    if not isinstance(messages, list):
        raise _type_error("messages", "an array", messages)
    if not messages:
        raise InvalidRequest(
            "Invalid 'messages': empty array. Expected an array with minimum length 1, but "
            "got an empty array instead.",
            "messages",
            "empty_array",
        )
    for name in sorted(CHAT_NEUTRAL):
        _neutral(body, name)
    stream, usage = _stream(body)
    media = Media()
    return Completion(
        "chat",
        body["model"],
        tuple(_message(m, i, media) for i, m in enumerate(messages)),
        images=tuple(media.images),
        audios=tuple(media.audios),
        max_tokens=_max_tokens(body, ("max_completion_tokens", "max_tokens")),
        settings=_with_logprobs(_settings(body), _chat_logprobs(body)),
        stream=stream,
        include_usage=usage,
        n=_choices(body),
        prediction=_predicted(_prediction(body.get("prediction")), body),
    )


def _predicted(prediction: str | None, body: dict[str, Any]) -> str | None:
    if prediction is not None and body.get("logprobs") not in (None, False):
        raise InvalidRequest("Invalid 'prediction': a request that asks for logprobs is generated one token "
                             "a run, and a prediction is checked several tokens a run; drop one of them.",
                             "prediction", "invalid_value")
    return prediction


# --- text completions ------------------------------------------------------------------------------------

DEFAULT_TEXT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


def _prompt(value: Any) -> tuple[str | None, tuple[int, ...] | None]:
    """A string or token ids; a batch of one is taken, larger batches are refused (n choices per prompt)."""
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], (str, list)):
        value = value[0]
    if isinstance(value, str):
        return value, None
    if isinstance(value, list) and value and all(type(t) is int for t in value):
        if any(t < 0 for t in value):
            raise InvalidRequest(
                "Invalid 'prompt': token ids must be non-negative.", "prompt", "invalid_value"
            )
        return None, tuple(value)
    if isinstance(value, list) and len(value) > 1 and all(isinstance(p, (str, list)) for p in value):
        raise _unsupported("prompt", "takes one prompt per request on this server (send others separately)")
    raise _type_error("prompt", "a string, an array of token ids, or an array of one of them", value)


def parse_text(body: Any) -> Completion:
    body = _check_names(body, COMMON | IGNORED | TEXT_NEUTRAL | {"prompt", "prediction", "best_of"})
    if "prompt" not in body:
        raise _missing("prompt")
    prompt, ids = _prompt(body["prompt"])
    for name in sorted(TEXT_NEUTRAL):
        _neutral(body, name)
    stream, usage = _stream(body)
    max_tokens = _max_tokens(body, ("max_tokens",))
    return Completion(
        "text",
        body["model"],
        prompt=prompt,
        prompt_ids=ids,
        max_tokens=DEFAULT_TEXT_MAX_TOKENS if max_tokens is None else max_tokens,
        settings=_with_logprobs(_settings(body), _text_logprobs(body)),
        stream=stream,
        include_usage=usage,
        n=_choices(body),
        prediction=_predicted(_prediction(body.get("prediction")), body),  # ortpipe's, as chat's
        best_of=_best_of(body, stream),
    )


def _best_of(body: dict[str, Any], stream: bool) -> int:
    """Completions' best_of: candidates to generate, at least n; not with a stream (OpenAI's rules)."""
    if body.get("best_of") is None:
        return _choices(body)
    best = _integer(body["best_of"], "best_of", low=1, high=MAX_N)
    if best < _choices(body):
        raise InvalidRequest(f"Invalid 'best_of': it must be at least n ({_choices(body)}), but got {best}.",
                             "best_of", "invalid_value")
    if best > 1 and stream:
        raise InvalidRequest("Invalid 'best_of': the best of several completions cannot be streamed; drop "
                             "stream or set best_of to 1.", "best_of", "invalid_value")
    if best > _choices(body) and (body.get("prediction") is not None or body.get("prompt_lookup_num_tokens")):
        raise InvalidRequest("Invalid 'best_of': its candidates are ranked by their tokens' "
                             "log-probabilities, given one token a run, and so do not speculate; drop "
                             "prediction and prompt_lookup_num_tokens, or best_of.", "best_of",
                             "invalid_value")
    return best


def _choices(body: dict[str, Any]) -> int:
    return 1 if body.get("n") is None else _integer(body["n"], "n", low=1, high=MAX_N)


def _with_logprobs(settings: dict[str, Any], logprobs: int | None) -> dict[str, Any]:
    if logprobs is not None and settings.get("prompt_lookup_num_tokens"):
        raise InvalidRequest(
            "Invalid 'prompt_lookup_num_tokens': a request that asks for logprobs is generated one token a "
            "run and does not speculate; drop one of them.",
            "prompt_lookup_num_tokens",
            "invalid_value",
        )
    return settings if logprobs is None else {**settings, "logprobs": logprobs}


# --- replies ---------------------------------------------------------------------------------------------

FINISH_REASONS = {"eos": "stop", "stop": "stop", "length": "length"}


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0
    accepted_prediction_tokens: int = 0  # a prediction's drafted tokens the model took, and those it did not
    rejected_prediction_tokens: int = 0

    def as_dict(self) -> dict[str, Any]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens, "audio_tokens": 0},
            "completion_tokens_details": {
                "reasoning_tokens": 0,
                "audio_tokens": 0,
                "accepted_prediction_tokens": self.accepted_prediction_tokens,
                "rejected_prediction_tokens": self.rejected_prediction_tokens,
            },
        }


@dataclass(frozen=True)
class TokenLogprob:
    """One generated token's log-probability and the most likely alternatives, with their text."""

    token: str
    logprob: float
    top: tuple[tuple[str, float], ...] = ()


Choice = tuple[str, str, "list[TokenLogprob] | None"]  # a choice's text, finish reason and logprobs


class Reply:
    """The objects of one completion: the whole response, or its stream chunks, in OpenAI's schema."""

    def __init__(self, request_id: str, completion: Completion, model: str, fingerprint: str):
        self.id, self.completion, self.model, self.fingerprint = request_id, completion, model, fingerprint
        self.created = int(time.time())
        self.chat = completion.endpoint == "chat"
        self._offsets = [0] * completion.n  # each choice's text_offset so far (the completions API)

    def _head(self, object_name: str) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": object_name,
            "created": self.created,
            "model": self.model,
            "system_fingerprint": self.fingerprint,
        }

    def transcription(self, text: str, usage: Usage) -> dict[str, Any]:
        """A transcription's JSON: its text, and its tokens as usage (the decoder's prompt as input)."""
        return {"text": text, "usage": {"type": "tokens", "input_tokens": usage.prompt_tokens,
                                        "output_tokens": usage.completion_tokens,
                                        "total_tokens": usage.prompt_tokens + usage.completion_tokens}}

    def response(self, choices: list[Choice], usage: Usage) -> dict[str, Any]:
        """The whole response: its choices in order (index i the i-th) and the request's usage."""
        out = []
        for i, (text, finish_reason, logprobs) in enumerate(choices):
            finish = FINISH_REASONS.get(finish_reason, "stop")
            if self.chat:
                out.append({
                    "index": i,
                    "message": {"role": "assistant", "content": text, "refusal": None, "annotations": []},
                    "logprobs": self._logprobs(logprobs, i),
                    "finish_reason": finish,
                })
            else:
                out.append({"index": i, "text": text, "logprobs": self._logprobs(logprobs, i),
                            "finish_reason": finish})
        if self.chat:
            return {
                **self._head("chat.completion"),
                "choices": out,
                "usage": usage.as_dict(),
                "service_tier": "default",
            }
        return {**self._head("text_completion"), "choices": out, "usage": usage.as_dict()}

    def chunk(
        self,
        text: str | None = None,
        finish_reason: str | None = None,
        first: bool = False,
        logprobs: list[TokenLogprob] | None = None,
        index: int = 0,
    ) -> dict[str, Any]:
        """A stream chunk of choice `index`: text, or its last one with a finish reason; a chat stream's
        first chunk of a choice opens the assistant's message."""
        finish = FINISH_REASONS.get(finish_reason, "stop") if finish_reason else None
        if self.chat:
            delta: dict[str, Any] = (
                {"role": "assistant", "content": "", "refusal": None}
                if first
                else ({"content": text} if text is not None else {})
            )
            out = {
                **self._head("chat.completion.chunk"),
                "service_tier": "default",
                "choices": [
                    {
                        "index": index,
                        "delta": delta,
                        "logprobs": self._logprobs(logprobs, index),
                        "finish_reason": finish,
                    }
                ],
            }
        else:
            out = {
                **self._head("text_completion"),
                "choices": [
                    {
                        "index": index,
                        "text": text or "",
                        "logprobs": self._logprobs(logprobs, index),
                        "finish_reason": finish,
                    }
                ],
            }

        if self.completion.include_usage:
            out["usage"] = None  # OpenAI: null on every chunk but the last
        return out

    def _logprobs(self, entries: list[TokenLogprob] | None, index: int) -> dict[str, Any] | None:
        """OpenAI's logprobs object: chat's `content` list, or the completions API's parallel lists (whose
        `text_offset` counts from the start of the completion, across the chunks of a stream)."""
        if entries is None:
            return None
        if self.chat:
            return {
                "content": [
                    {
                        "token": e.token,
                        "logprob": e.logprob,
                        "bytes": list(e.token.encode()),
                        "top_logprobs": [
                            {"token": t, "logprob": lp, "bytes": list(t.encode())} for t, lp in e.top
                        ],
                    }
                    for e in entries
                ],
                "refusal": None,
            }
        offsets = []
        for e in entries:
            offsets.append(self._offsets[index])
            self._offsets[index] += len(e.token)
        return {
            "tokens": [e.token for e in entries],
            "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [dict(e.top) for e in entries],
            "text_offset": offsets,
        }

    def usage_chunk(self, usage: Usage) -> dict[str, Any]:
        """stream_options.include_usage: a last chunk with no choices and the whole request's usage."""
        name = "chat.completion.chunk" if self.chat else "text_completion"
        extra = {"service_tier": "default"} if self.chat else {}
        return {**self._head(name), **extra, "choices": [], "usage": usage.as_dict()}
