"""Every complete v2 config the README and docs/pipelines.md show parses as written: the docs cannot drift
from the schema (a renamed key or a refused value fails here). Files the configs name are empty stand-ins:
parsing checks that they exist, the graphs are read later."""

from __future__ import annotations

import json
import re
import warnings
from pathlib import Path
from typing import Any

import pytest

from ortpipe.config.parse import parse_config
from ortpipe.folder import LocalFolder

ROOT = Path(__file__).resolve().parent.parent
DOCS = ("README.md", "docs/pipelines.md")


def _configs(doc: str) -> list[dict[str, Any]]:
    blocks = re.findall(r"```json\n(.*?)```", (ROOT / doc).read_text(encoding="utf-8"), re.S)
    configs = []
    for block in blocks:
        try:
            raw = json.loads(block)
        except json.JSONDecodeError:  # a fragment (a key or two), not a config
            continue
        if isinstance(raw, dict) and raw.get("version") == 2:
            configs.append(raw)
    return configs


def _files(raw: Any) -> list[str]:
    if isinstance(raw, dict):
        named = [v for k, v in raw.items() if k in ("file", "wheel") and isinstance(v, str)]
        return named + [f for v in raw.values() for f in _files(v)]
    if isinstance(raw, list):
        return [f for v in raw for f in _files(v)]
    return []


CASES = [(doc, i, raw) for doc in DOCS for i, raw in enumerate(_configs(doc))]


def test_the_docs_show_complete_configs() -> None:
    for doc in DOCS:
        assert len(_configs(doc)) >= 3, doc
    shown = json.dumps([raw for _, _, raw in CASES])
    for key in ('"stages"', '"accumulate"', '"codebooks"', '"plugin"', '"generated.ids"'):
        assert key in shown, f"no complete config in {DOCS} shows {key}"


@pytest.mark.parametrize(("doc", "index", "raw"), CASES, ids=[f"{d}#{i}" for d, i, _ in CASES])
def test_a_documented_config_parses(doc: str, index: int, raw: dict[str, Any], tmp_path: Path) -> None:
    for file in _files(raw):
        (tmp_path / file).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / file).write_bytes(b"")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # an unknown key is a warning: here it fails
        parse_config(raw, LocalFolder(tmp_path))
