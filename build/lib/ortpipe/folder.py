"""Where a model's files come from: a local directory, or (in the browser) a URL prefix.

The core reads small text files (configs, tokenizer) through this protocol and hands ONNX file
names to the target, which loads them its own way. Every file of a local folder is opened by its
real path, and only when that path lies inside the folder: a name with "..", an absolute name, or
a symbolic link that leads elsewhere is a ConfigError naming the link and where it leads.
"""

from __future__ import annotations

import os
import posixpath
from typing import Protocol

from .errors import ConfigError

MAX_TEXT_BYTES = 256 << 20  # the largest text file read (a big tokenizer.json is about 35 MB)


class Folder(Protocol):
    """A model folder. Names are relative POSIX paths inside it."""

    def exists(self, name: str) -> bool: ...

    def read_text(self, name: str) -> str: ...

    def locate(self, name: str) -> str:
        """Where the target opens the file `name` itself (an ONNX graph): a path or a URL."""
        ...

    def describe(self, name: str = "") -> str:
        """A human-readable location for messages (a path or a URL)."""
        ...


def inside(name: str) -> bool:
    """True when a relative file name stays inside its folder ("../x.onnx" does not)."""
    if (
        not isinstance(name, str)
        or not name
        or name.startswith(("/", "\\"))
        or (len(name) > 1 and name[1] == ":")
    ):
        return False
    if "\x00" in name:
        return False
    normal = posixpath.normpath(name.replace("\\", "/"))
    return normal != ".." and not normal.startswith("../")


class LocalFolder:
    """A model folder on the local file system."""

    def __init__(self, path: str | os.PathLike[str]):
        self.path = os.fspath(path)
        self.root = os.path.realpath(self.path)

    def resolve(self, name: str) -> str:
        """The real path of `name`, which must stay inside the folder, links followed."""
        if not inside(name):
            raise ConfigError(
                f'"{name}" is not a path inside the model folder {self.path}: use a relative '
                'path like "model.onnx" or "decoder/model.onnx"'
            )
        shown = os.path.join(self.path, name)
        real = os.path.realpath(shown)
        if real != self.root and not real.startswith(self.root + os.sep):
            raise ConfigError(
                f"{shown} is a link that leads outside the model folder (to {real}); ortpipe reads "
                "only files inside the folder: copy the file in instead of linking it"
            )
        return real

    def exists(self, name: str) -> bool:
        return os.path.isfile(self.resolve(name))

    def locate(self, name: str) -> str:
        return self.resolve(name)

    def read_text(self, name: str) -> str:
        return read_text_file(self.resolve(name), self.describe(name))

    def read_bytes(self, name: str) -> bytes:
        path = self.resolve(name)
        try:
            with open(path, "rb") as f:
                return f.read()
        except OSError as e:
            raise ConfigError(f"cannot read {self.describe(name)}: {e.strerror}") from None

    def describe(self, name: str = "") -> str:
        return os.path.join(self.path, name) if name else self.path


def read_text_file(path: str, shown: str) -> str:
    """A UTF-8 text file; a ConfigError when it is missing, too large or not UTF-8."""
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_TEXT_BYTES + 1)
    except OSError as e:
        raise ConfigError(f"cannot read {shown}: {e.strerror}") from None
    if len(data) > MAX_TEXT_BYTES:
        raise ConfigError(
            f"{shown} is larger than {MAX_TEXT_BYTES >> 20} MB, too large for a text file of a model"
        )
    return decode_text(data, shown)


def decode_text(data: bytes, shown: str) -> str:
    if data.startswith((b"\xff\xfe", b"\xfe\xff")):
        raise ConfigError(f"{shown} is UTF-16 text; save it as UTF-8")
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise ConfigError(
            f"{shown} is not UTF-8 text (byte 0x{data[e.start]:02x} at offset {e.start}); save it as UTF-8"
        ) from None
