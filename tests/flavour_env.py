"""Helpers for the tests that run ortpipe in a flavour's own virtualenv (build/flavours.py) through
tests/flavour_probe.py: test_openvino.py and test_qnn.py."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
from build import flavours

REPO = Path(__file__).resolve().parent.parent
PROBE = REPO / "tests" / "flavour_probe.py"


def flavour_python(flavour: str) -> Path:
    """The flavour's virtualenv python, or a skip that says why there is none."""
    reason = flavours.unsupported(flavour)
    if reason:
        pytest.skip(reason)
    try:
        return flavours.ensure_venv(flavour)
    except RuntimeError as e:
        pytest.skip(f"the {flavour} virtualenv could not be made: {str(e).splitlines()[0]}")


def probe(python: Path, request: dict[str, Any], tmp_path: Path) -> dict[str, Any]:
    """One request answered by tests/flavour_probe.py in the flavour's virtualenv."""
    out = tmp_path / "answer.json"
    env = {**os.environ, "PYTHONPATH": str(REPO / "py")}
    proc = subprocess.run([str(python), str(PROBE), str(out)], input=json.dumps(request), text=True,
                          capture_output=True, env=env, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text())


def flavour_cli(python: Path, *args: str) -> subprocess.CompletedProcess:
    """`ortpipe ARGS` from this checkout in the flavour's virtualenv."""
    env = {**os.environ, "PYTHONPATH": str(REPO / "py")}
    return subprocess.run([str(python), "-m", "ortpipe.cli", *args], capture_output=True, text=True, env=env,
                          check=False)


def session_request(folder: Path, name: str, override: list[str] | None = None) -> dict[str, Any]:
    """The `open` request for one session of a folder, from its genai_config.json."""
    raw = json.loads((folder / "genai_config.json").read_text())["pipeline"]["sessions"][name]
    session = {"name": name, "file": raw["file"], "providers": raw.get("execution_provider", "cpu"),
               "provider_options": raw.get("provider_options", {}),
               "session_options": raw.get("session_options", {})}
    if isinstance(session["providers"], str):
        session["providers"] = [session["providers"]]
    return {"open": str(folder / raw["file"]), "session": session, "override": override}


def with_config(src: Path, dst: Path, config: dict[str, Any]) -> Path:
    shutil.copytree(src, dst)
    (dst / "genai_config.json").write_text(json.dumps(config))
    return dst
