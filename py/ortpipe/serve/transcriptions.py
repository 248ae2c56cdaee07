"""POST /v1/audio/transcriptions and /v1/audio/translations: OpenAI's multipart forms as a Completion, for a
folder whose decoder reads speech through an audio encoder (Whisper's encoder-decoder).

- served: `file` (a PCM WAV file; the engine decodes it at the folder's sampling rate, rows.py), `model`,
  `response_format` `json` (`{"text", "usage"}`) or `text` (the text alone), `temperature` (0, the default:
  greedy; above 0: sampled at that temperature); transcriptions' `language` (a code of the folder's
  tokens.languages, e.g. "en": the decoder's language; without it the model chooses). A translation is a
  transcription whose decoder starts from the folder's "translate" task (into English, for Whisper);
- refused, naming the parameter: `prompt` (nothing here writes a previous text before the decoder's start
  ids), `stream` true, the formats with timestamps (`verbose_json`, `srt`, `vtt`) and what asks for them
  (`timestamp_granularities[]`, `include[]`), `chunking_strategy` (a clip longer than the encoder's window
  is refused: its transcript would leave the rest out; rows.py);
- anything else: "Unrecognized request argument supplied", as OpenAI refuses it.
"""

from __future__ import annotations

from typing import Any

from .forms import Form, Upload
from .protocol import Completion, InvalidRequest, _decimal, _missing, _type_error, _unsupported

FORMATS = ("json", "text")
TIMESTAMPED = ("verbose_json", "srt", "vtt")
REFUSED = {
    "prompt": "is not supported by this server yet: the decoder starts from the model folder's start ids, "
              "and nothing writes a previous text before them",
    "timestamp_granularities[]": "is not supported: this server makes no timestamps",
    "timestamp_granularities": "is not supported: this server makes no timestamps",
    "include[]": "is not supported: this server makes no log-probabilities of transcriptions",
    "include": "is not supported: this server makes no log-probabilities of transcriptions",
    "chunking_strategy": "is not supported: send clips no longer than the model's window (30 s for Whisper)",
    "known_speaker_names[]": "is not supported: this server does not tell speakers apart",
    "known_speaker_references[]": "is not supported: this server does not tell speakers apart",
}
KNOWN = {"file", "model", "response_format", "temperature", "stream", "language", *REFUSED}


def parse_transcription(form: Form) -> Completion:
    return _parse(form, KNOWN, None)


def parse_translation(form: Form) -> Completion:
    """A translation: OpenAI's form has no `language` (the text is English); the decoder's task is
    "translate"."""
    return _parse(form, KNOWN - {"language"}, "translate")


def _parse(form: Form, known: set[str], task: str | None) -> Completion:
    fields: dict[str, str | Upload] = {}
    for name, values in form.fields.items():
        if name not in known:
            raise InvalidRequest(f"Unrecognized request argument supplied: {name}", name, "unknown_parameter")
        if len(values) > 1:
            raise InvalidRequest(f"The form field '{name}' is given {len(values)} times: send it once.", name)
        fields[name] = values[0]
    upload = fields.get("file")
    if upload is None:
        raise _missing("file")
    if not isinstance(upload, Upload):
        raise _type_error("file", "a file (a form part with a filename)", upload)
    text = {name: value for name, value in fields.items() if name != "file"}
    for name, value in text.items():
        if isinstance(value, Upload):
            raise _type_error(name, "a form field (text), not a file", value)
    model = text.get("model")
    if not model:
        raise _missing("model")
    for name, why in REFUSED.items():
        if text.get(name):
            raise _unsupported(name, why)
    return Completion("transcription", str(model), audio=(upload.filename or "file", upload.data),
                      settings=_temperature(text.get("temperature")), stream=_stream(text.get("stream")),
                      response_format=_format(text.get("response_format")),
                      language=str(text["language"]) if text.get("language") else None, task=task)


def _format(value: Any) -> str:
    if value is None or value == "":
        return "json"
    if value in TIMESTAMPED:
        raise _unsupported("response_format", f"{value!r} is not supported: this server makes no timestamps; "
                                              f"send {' or '.join(map(repr, FORMATS))}")
    if value not in FORMATS:
        raise InvalidRequest(f"Invalid value for 'response_format': {value!r}. Supported values are: "
                             f"{', '.join(map(repr, FORMATS + TIMESTAMPED))}; this server makes "
                             f"{' and '.join(map(repr, FORMATS))}.", "response_format", "invalid_value")
    return str(value)


def _temperature(value: Any) -> dict[str, Any]:
    """OpenAI's temperature, 0 to 1 (0 when not given): 0 decodes greedily, more samples at it."""
    if value is None or value == "":
        return {"do_sample": False}
    try:
        number = float(value)
    except ValueError:
        raise _type_error("temperature", "a decimal", value) from None
    if number != number:  # "nan": float() takes it, and it is no temperature
        raise _type_error("temperature", "a decimal", value)
    t = _decimal(number, "temperature", 0.0, 1.0)
    return {"do_sample": True, "temperature": t} if t > 0 else {"do_sample": False}


def _stream(value: Any) -> bool:
    if value in (None, "", "false", "False"):
        return False
    if value in ("true", "True"):
        raise _unsupported("stream", "is not supported for transcriptions by this server: send false")
    raise _type_error("stream", "a boolean", value)
