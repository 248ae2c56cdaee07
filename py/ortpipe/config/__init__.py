"""Reading genai_config.json (v2, or v1 translated to v2) into a validated Config."""

from __future__ import annotations

import warnings
from typing import Any

from ..detect import detect_config
from ..errors import ConfigError
from ..folder import Folder
from ..jsonfile import read_json
from . import v1
from .parse import parse_config
from .presets import PRESETS
from .profiles import Profile, layer_profile, load_profile
from .schema import Config

CONFIG_FILE = "genai_config.json"

__all__ = ["CONFIG_FILE", "PRESETS", "Config", "load_config", "raw_config"]


def raw_config(folder: Folder) -> tuple[dict[str, Any], str, tuple[str, ...]] | None:
    """The folder's config as a raw v2 mapping, its source ("v2" or "v1") and the translation's
    notes; None without a genai_config.json."""
    if not folder.exists(CONFIG_FILE):
        return None
    raw = read_json(folder, CONFIG_FILE)
    if v1.is_v1(raw):
        translated, notes = v1.translate(raw)
        return translated, "v1", notes
    if raw.get("version") != 2:
        raise ConfigError(
            f'{folder.describe(CONFIG_FILE)} has "version": {raw.get("version")!r:.40}; ortpipe '
            'reads version 2 (the pipeline schema) or the v1 layout with a "model" object'
        )
    return raw, "v2", ()


def load_config(folder: Folder, warn: bool = True, profile: str | Profile | None = None,
                detected: dict[str, Any] | None = None) -> Config:
    """The folder's Config; without genai_config.json, one detected from the folder's files (or
    `detected`, a detected config the graphs corrected). `profile`: a device profile (a built-in name, a
    .json path, or a Profile) layered over its sessions before the config is checked
    (config/profiles.py). `warn`: show the config's notes (unknown v1 keys, ...) as Python warnings."""
    found = None if detected is not None else raw_config(folder)
    raw, source, notes = found if found else (detected or detect_config(folder), "detected", ())
    if source == "detected":  # what detection read and does not apply (generation_config.json's keys, ...)
        notes = tuple(raw.get("metadata", {}).get("notes", ()))
    if profile is not None:
        raw = layer_profile(raw, profile if isinstance(profile, Profile) else load_profile(profile))
    config = parse_config(raw, folder, source, notes)
    if warn:
        for note in config.notes:
            warnings.warn(note, stacklevel=2)
    return config
