"""The core is pure: every module outside targets/ imports with numpy, onnxruntime and js blocked."""

from __future__ import annotations

import pkgutil
import subprocess
import sys
from pathlib import Path

import ortpipe

BLOCKED = ("numpy", "onnxruntime", "onnx", "js", "pyodide", "tokenizers", "jinja2")

CHECK = """
import importlib, importlib.abc, sys
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in {blocked!r}:
            raise ImportError(f'blocked: {{name}}')
sys.meta_path.insert(0, Block())
for name in {modules!r}:
    importlib.import_module(name)
print('imported', len({modules!r}))
"""


def core_modules() -> list[str]:
    root = Path(ortpipe.__file__).parent
    names = ["ortpipe"]
    for info in pkgutil.walk_packages([str(root)], prefix="ortpipe."):
        if not info.name.startswith("ortpipe.targets."):
            names.append(info.name)
    return names


def test_core_imports_with_target_libraries_blocked() -> None:
    modules = core_modules()
    assert "ortpipe.plan" in modules and "ortpipe.execute.flow" in modules
    code = CHECK.format(blocked=BLOCKED, modules=modules)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert f"imported {len(modules)}" in result.stdout


def test_the_block_catches_an_impure_module(tmp_path: Path) -> None:
    (tmp_path / "impure.py").write_text("import numpy\n")
    code = f"import sys; sys.path.insert(0, {str(tmp_path)!r})\n" + CHECK.format(
        blocked=BLOCKED, modules=["impure"]
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode != 0 and "blocked: numpy" in result.stderr
