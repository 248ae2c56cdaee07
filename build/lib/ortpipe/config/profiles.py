"""Device profiles: a small JSON layered over a model's config (`ortpipe run --profile raspberry-pi`).

A profile names execution providers and their options for a class of device; the model folder stays
as it is. The built-in profiles are `edge/profiles/*.json` (shipped as ortpipe/profiles/); a path to a
JSON file works too. A profile holds:

    {"description": "...",
     "session": {"execution_provider": ..., "provider_options": ..., "session_options": ...},
     "sessions": {"decoder": {...the same keys...}}}

`session` is layered over every session of the pipeline, then `sessions.NAME` over the session of
that name (names the model lacks are skipped: one profile serves many models). Layering replaces
`execution_provider`, and merges `provider_options` and `session_options` key by key, the profile's
value winning. A provider option value that starts with "~/" is expanded to the user's home (cache
directories).
"""

from __future__ import annotations

import copy
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import ConfigError, Problems, did_you_mean, one_of
from . import ep, presets

PROFILE_DIR = Path(__file__).resolve().parent.parent / "profiles"
LAYER_KEYS = ("execution_provider", "provider_options", "session_options")


@dataclass(frozen=True)
class Profile:
    name: str
    description: str = ""
    session: dict[str, Any] = field(default_factory=dict)  # a validated layer for every session
    sessions: dict[str, dict[str, Any]] = field(default_factory=dict)  # session name -> a layer


def profile_names() -> list[str]:
    """The built-in profiles."""
    return sorted(p.stem for p in PROFILE_DIR.glob("*.json"))


def load_profile(name: str) -> Profile:
    """A built-in profile by name, or a profile file by path; a ConfigError names every problem."""
    path = Path(name).expanduser()
    if not (path.suffix == ".json" and path.is_file()):
        path = PROFILE_DIR / f"{name}.json"
        if not path.is_file():
            names = profile_names()
            raise ConfigError(f'Unknown profile "{name}". Built-in profiles: {one_of(names)}.'
                              f"{did_you_mean(name, names)} A profile can also be the path of a .json file")
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"profile {path} cannot be read: {e}") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"profile {path} is not valid JSON: {e.msg} at line {e.lineno}, "
                          f"column {e.colno}") from None
    return parse_profile(raw, path.stem)


def parse_profile(raw: Any, name: str) -> Profile:
    """Validate a profile mapping; every problem is reported in one ConfigError."""
    problems = Problems()
    where = f"profile {name}"
    if not isinstance(raw, dict):
        raise ConfigError(f"{where} must be a JSON object, found {type(raw).__name__}")
    _allow(raw, ("description", "session", "sessions"), where, problems)
    description = raw.get("description", "")
    if not isinstance(description, str):
        problems.add(f"{where}.description must be a string, found {description!r}")
    session = _layer(raw.get("session", {}), f"{where}.session", problems)
    named = raw.get("sessions", {})
    if not isinstance(named, dict):
        problems.add(f"{where}.sessions must be an object of session names, found {named!r}")
        named = {}
    sessions = {n: _layer(layer, f"{where}.sessions.{n}", problems) for n, layer in named.items()}
    problems.raise_if_any()
    return Profile(name, description if isinstance(description, str) else "", session, sessions)


def _allow(raw: dict[str, Any], keys: tuple[str, ...], where: str, problems: Problems) -> None:
    for key in raw:
        if key not in keys:
            problems.add(f'Unknown key "{key}" in {where}.{did_you_mean(key, keys)} '
                         f"Allowed keys: {one_of(keys)}")


def _layer(raw: Any, where: str, problems: Problems) -> dict[str, Any]:
    if not isinstance(raw, dict):
        problems.add(f"{where} must be an object with {one_of(LAYER_KEYS)}, found {raw!r}")
        return {}
    _allow(raw, LAYER_KEYS, where, problems)
    layer: dict[str, Any] = {}
    if "execution_provider" in raw:
        layer["execution_provider"] = list(ep.provider_names(raw["execution_provider"],
                                                             f"{where}.execution_provider", problems))
    if "provider_options" in raw:
        options = ep.check_provider_options(raw["provider_options"], f"{where}.provider_options", problems)
        layer["provider_options"] = {p: {k: _expand(v) for k, v in o.items()} for p, o in options.items()}
    if "session_options" in raw:
        layer["session_options"] = ep.check_session_options(raw["session_options"],
                                                            f"{where}.session_options", problems)
    return layer


def _expand(value: str) -> str:
    return os.path.expanduser(value) if value.startswith("~/") else value


def layer_profile(raw_config: dict[str, Any], profile: Profile) -> dict[str, Any]:
    """A copy of a raw v2 config (v1 already translated) with the profile layered over its sessions."""
    config = copy.deepcopy(raw_config)
    pipeline = config.get("pipeline")
    if not isinstance(pipeline, dict):
        return config  # parse_config reports the missing pipeline
    sessions = pipeline.get("sessions")
    if sessions is None and pipeline.get("extends") in presets.PRESETS:
        sessions = pipeline["sessions"] = copy.deepcopy(presets.PRESETS[pipeline["extends"]]["sessions"])
    if not isinstance(sessions, dict):
        return config
    for name, session in sessions.items():
        if isinstance(session, dict):
            for layer in (profile.session, profile.sessions.get(name, {})):
                session.update(_merged(session, layer))
    return config


def _merged(session: dict[str, Any], layer: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if "execution_provider" in layer:
        out["execution_provider"] = list(layer["execution_provider"])
    for key in ("provider_options", "session_options"):
        if key in layer:
            out[key] = _deep_merge(_keyed(session.get(key)), layer[key])
    return out


def _keyed(options: Any) -> dict[str, Any]:
    """The model's options with provider names as provider keys, so that "OpenVINO" and "openvino" merge."""
    if not isinstance(options, dict):
        return {}
    return {ep.provider_key(name) or name: value for name, value in options.items()}


def _deep_merge(base: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in top.items():
        both = isinstance(value, dict) and isinstance(out.get(key), dict)
        out[key] = _deep_merge(out[key], value) if both else copy.deepcopy(value)
    return out
