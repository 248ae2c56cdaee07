"""What preprocessing hands to a model."""

from __future__ import annotations

from dataclasses import dataclass

from ..execute.work import Handle


@dataclass(frozen=True)
class Features:
    """Model inputs by name, and the values of the small integer ones (prompts and position ids need them)."""

    tensors: dict[str, Handle]
    values: dict[str, tuple[int, ...]]
