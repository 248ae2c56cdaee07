"""Virtual environments of one onnxruntime flavour each, for the tests that need one, made on demand.

onnxruntime's flavours install the same `onnxruntime` module, so OpenVINO (and the QNN plugin, which
brings its own onnxruntime version) cannot share .venv with the test suite's onnxruntime. The tests run
ortpipe from this checkout in `.venv-<flavour>` (requirements/<flavour>.txt) as a subprocess.

    python -m build.flavours openvino qnn
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# where PyPI has the flavour's wheels (the README's edge section lists them)
PLATFORMS = {"openvino": {("Linux", "x86_64"), ("Windows", "AMD64")},
             "qnn": {("Linux", "x86_64"), ("Linux", "aarch64"), ("Windows", "AMD64"), ("Windows", "ARM64")}}


def venv_dir(flavour: str) -> Path:
    return Path(os.environ.get(f"ORTPIPE_{flavour.upper()}_VENV", REPO / f".venv-{flavour}"))


def unsupported(flavour: str) -> str | None:
    """Why this machine cannot have the flavour's environment, or None."""
    here = (platform.system(), platform.machine())
    if here not in PLATFORMS[flavour]:
        return f"PyPI has no {flavour} wheels for {here[0]} {here[1]}"
    if flavour == "qnn" and sys.version_info < (3, 11):
        return "onnxruntime-qnn 2.x needs Python 3.11 or later"
    return None


def ensure_venv(flavour: str) -> Path:
    """The python of the flavour's virtualenv, created (once per requirements file) with this interpreter."""
    requirements = REPO / "requirements" / f"{flavour}.txt"
    venv = venv_dir(flavour)
    python = venv / ("Scripts/python.exe" if os.name == "nt" else "bin/python")
    stamp = venv / ".ortpipe-requirements"
    wanted = requirements.read_text()
    if python.is_file() and stamp.is_file() and stamp.read_text() == wanted:
        return python
    pip = [str(python), "-m", "pip", "install", "--disable-pip-version-check", "-q", "-r", str(requirements)]
    for cmd in ([sys.executable, "-m", "venv", "--clear", str(venv)], pip):
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            output = (proc.stdout + proc.stderr)[-4000:]
            raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{output}")
    stamp.write_text(wanted)
    return python


def main(argv: list[str] | None = None) -> int:
    for flavour in argv if argv is not None else sys.argv[1:]:
        reason = unsupported(flavour)
        print(f"{flavour}: {reason}" if reason else f"{flavour}: {ensure_venv(flavour)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
