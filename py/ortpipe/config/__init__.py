"""Reading genai_config.json (v2, or v1 translated to v2) into a validated Config."""

from __future__ import annotations

import json
from typing import Any

from ..errors import ConfigError
from ..folder import Folder
from . import v1
from .parse import parse_config
from .presets import PRESETS
from .schema import Config

CONFIG_FILE = "genai_config.json"

__all__ = ["CONFIG_FILE", "PRESETS", "Config", "load_config", "parse_json", "raw_config"]


def parse_json(text: str, where: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{where} is not valid JSON: {e.msg} at line {e.lineno}, column {e.colno}") from None


def raw_config(folder: Folder) -> tuple[dict[str, Any], str] | None:
    """The folder's config as a raw v2 mapping and its source ("v2" or "v1"), or None without one."""
    if not folder.exists(CONFIG_FILE):
        return None
    raw = parse_json(folder.read_text(CONFIG_FILE), folder.describe(CONFIG_FILE))
    if not isinstance(raw, dict):
        raise ConfigError(f"{folder.describe(CONFIG_FILE)} must hold a JSON object, found {type(raw).__name__}")
    if v1.is_v1(raw):
        return v1.translate(raw), "v1"
    if raw.get("version") != 2:
        raise ConfigError(f'{folder.describe(CONFIG_FILE)} has "version": {raw.get("version")!r}; ortpipe reads '
                          'version 2 (the pipeline schema) or the v1 layout with a "model" object')
    return raw, "v2"


def load_config(folder: Folder) -> Config:
    """The folder's Config; without genai_config.json, one detected from the folder's files."""
    from ..detect import detect_config  # detect builds on config; imported here to keep the cycle out

    found = raw_config(folder)
    raw, source = found if found else (detect_config(folder), "detected")
    return parse_config(raw, folder, source)
