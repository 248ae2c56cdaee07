"""Write the generation settings of web/ortpipe.d.ts from the settings table (py/ortpipe/config/settings.py).

    python -m build.typescript          # rewrite the block between the markers
    python -m build.typescript --check  # exit 1 when the file disagrees with the table
"""

from __future__ import annotations

import sys
from pathlib import Path

from ortpipe.config.settings import typescript_options

DECLARATIONS = Path(__file__).resolve().parent.parent / "web" / "ortpipe.d.ts"
BEGIN = (
    "  // generation settings: written by `python -m build.typescript` from py/ortpipe/config/settings.py\n"
)
END = "  // end of the generation settings\n"


def declared(text: str) -> str:
    """The settings block of the declarations file, between its markers."""
    start, end = text.index(BEGIN) + len(BEGIN), text.index(END)
    return text[start:end].rstrip("\n")


def written(text: str) -> str:
    start, end = text.index(BEGIN) + len(BEGIN), text.index(END)
    return text[:start] + typescript_options() + "\n" + text[end:]


def main(argv: list[str]) -> int:
    text = DECLARATIONS.read_text(encoding="utf-8")
    if argv == ["--check"]:
        return 0 if declared(text) == typescript_options() else 1
    DECLARATIONS.write_text(written(text), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
