"""Which onnxruntime flavour is installed, read from package metadata without importing onnxruntime.

onnxruntime, onnxruntime-gpu, onnxruntime-openvino, onnxruntime-directml (and onnxruntime-qnn before
2.0) all install the same `onnxruntime` module: with two in one environment the second overwrote the
first's files, and what runs is a mix. The CPython target calls `warn_if_mixed()` before importing
onnxruntime. Plugin EP packages (onnxruntime-qnn 2.x, onnxruntime-ep-openvino) ship their own module
and sit beside one flavour.
"""

from __future__ import annotations

import importlib.util
import re
import warnings
from dataclasses import dataclass
from importlib.metadata import PathDistribution
from pathlib import Path

# the extra of ortpipe that installs each flavour; flavours not listed are named without one
EXTRAS = {"onnxruntime": "cpu", "onnxruntime-openvino": "openvino", "onnxruntime-directml": "directml",
          "onnxruntime-gpu": "cuda", "onnxruntime-qnn": "qnn"}
_PACKAGE_NAME = re.compile(r"""^package_name\s*=\s*['"]([^'"]+)['"]""", re.M)


class FlavourWarning(UserWarning):
    """Two onnxruntime flavours in one environment."""


@dataclass(frozen=True)
class Flavour:
    name: str  # the distribution: "onnxruntime-openvino"
    version: str


def _normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def module_dir() -> Path | None:
    """Where `import onnxruntime` would load from, found without importing it."""
    spec = importlib.util.find_spec("onnxruntime")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def installed(site: Path | None = None) -> list[Flavour]:
    """The distributions beside the `onnxruntime` module that install that module's files."""
    site = site or (module_dir() or Path()).parent
    found = []
    for info in sorted(site.glob("onnxruntime*.dist-info")):
        dist = PathDistribution(info)
        top = (dist.read_text("top_level.txt") or "").split()
        record = dist.read_text("RECORD") or ""
        if "onnxruntime" in top or record.startswith("onnxruntime/") or "\nonnxruntime/" in record:
            found.append(Flavour(_normalize(dist.metadata["Name"]), dist.version))
    return found


def live(module: Path | None = None) -> str | None:
    """The flavour whose files `onnxruntime/` holds now (the last one installed)."""
    module = module or module_dir()
    info = module / "capi" / "build_and_package_info.py" if module else None
    if info is None or not info.is_file():
        return None
    match = _PACKAGE_NAME.search(info.read_text(errors="replace"))
    return _normalize(match.group(1)) if match else None


def mixed_message(flavours: list[Flavour], current: str | None) -> str | None:
    """What to do when more than one flavour is installed, else None."""
    if len(flavours) < 2:
        return None
    names = [f.name for f in flavours]
    listed = " and ".join(f"{f.name} {f.version}" for f in flavours)
    now = f" (the files there now are {current}'s)" if current else ""
    extras = " or ".join(f'"ortpipe[{EXTRAS[n]}]"' for n in names if n in EXTRAS) or "the flavour you want"
    # uninstalling only one would delete files the other one needs: remove all, then install one
    return (f"{listed} are installed in one environment: they install the same `onnxruntime` module and "
            f"overwrite each other's files{now}. Keep one flavour: pip uninstall -y {' '.join(names)}, "
            f"then pip install {extras}.")


def warn_if_mixed() -> str | None:
    """Warn (FlavourWarning) when two flavours share this environment; returns the message, or None."""
    module = module_dir()
    if module is None:
        return None
    message = mixed_message(installed(module.parent), live(module))
    if message:
        warnings.warn(message, FlavourWarning, stacklevel=2)
    return message
