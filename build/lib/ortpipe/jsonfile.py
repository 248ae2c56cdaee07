"""Reading the JSON files of a model folder, with errors that name the file and stay short.

A leaf module: config parsing, detection and preprocessing all read JSON through it.
"""

from __future__ import annotations

import json
from typing import Any

from .errors import ConfigError
from .folder import Folder

MAX_QUOTE = 200  # characters of a value or of a file quoted in a message, at most


def quote(value: Any) -> str:
    """A value as a message shows it (strings in double quotes, as in JSON), cut to MAX_QUOTE
    characters: a message never grows with the input."""
    text = json.dumps(value, ensure_ascii=False) if isinstance(value, str) else repr(value)
    return text if len(text) <= MAX_QUOTE else f"{text[:MAX_QUOTE]}... ({len(text)} characters)"


def parse_json(text: str, where: str) -> Any:
    """The JSON value of `text`; a ConfigError naming `where` when it is not JSON."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(
            f"{where} is not valid JSON: {e.msg} at line {e.lineno}, column {e.colno}"
        ) from None
    except RecursionError:
        raise ConfigError(f"{where} nests its JSON too deeply to be a config") from None


def read_json(folder: Folder, name: str, kind: type = dict) -> Any:
    """The JSON value of the folder's file `name`, which must be of type `kind` (an object by default)."""
    value = parse_json(folder.read_text(name), folder.describe(name))
    if not isinstance(value, kind):
        raise ConfigError(
            f"{folder.describe(name)} must hold a JSON {_KINDS.get(kind, kind.__name__)}, "
            f"found {type(value).__name__}"
        )
    return value


def optional_json(folder: Folder, name: str) -> dict[str, Any]:
    """The JSON object in `name`, or {} when the folder has no such file."""
    return read_json(folder, name) if folder.exists(name) else {}


_KINDS = {dict: "object", list: "list"}
