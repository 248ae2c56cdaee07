"""build/web.py's failures name what is missing and what to run."""

from __future__ import annotations

from pathlib import Path

import pytest
from build import web


def test_a_bundle_needs_node_for_the_python_snapshot(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(web.shutil, "which", lambda name: None)
    with pytest.raises(web.BuildError, match="node is not on PATH.*Python snapshot.*install Node.js"):
        web._python_snapshot(tmp_path)


def test_a_failed_snapshot_shows_node_s_message(tmp_path: Path) -> None:
    # No Pyodide in tmp_path: the script fails, and its stderr reaches the error.
    (tmp_path / "pyodide").mkdir()
    with pytest.raises(web.BuildError, match=r"making the Python snapshot failed(.|\n)*python_snapshot: "):
        web._python_snapshot(tmp_path)
