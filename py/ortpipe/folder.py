"""Where a model's files come from: a local directory, or (in the browser) a URL prefix.

The core reads small text files (configs, tokenizer) through this protocol and hands ONNX file
names to the target, which loads them its own way.
"""

from __future__ import annotations

import os
import posixpath
from typing import Protocol


class Folder(Protocol):
    """A model folder. Names are relative POSIX paths inside it."""

    def exists(self, name: str) -> bool: ...

    def read_text(self, name: str) -> str: ...

    def describe(self, name: str = "") -> str:
        """A human-readable location for messages (a path or a URL)."""
        ...


def inside(name: str) -> bool:
    """True when a relative file name stays inside its folder ("../x.onnx" does not)."""
    if not name or name.startswith(("/", "\\")) or (len(name) > 1 and name[1] == ":"):
        return False
    normal = posixpath.normpath(name.replace("\\", "/"))
    return normal != ".." and not normal.startswith("../")


class LocalFolder:
    """A model folder on the local file system."""

    def __init__(self, path: str | os.PathLike[str]):
        self.path = os.fspath(path)

    def exists(self, name: str) -> bool:
        return os.path.isfile(os.path.join(self.path, name))

    def read_text(self, name: str) -> str:
        with open(os.path.join(self.path, name), encoding="utf-8") as f:
            return f.read()

    def describe(self, name: str = "") -> str:
        return os.path.join(self.path, name) if name else self.path
