"""Greedy selection: the argmax of the last position's logits, computed by a kernel graph."""

from __future__ import annotations

from ..execute.work import Backend, Handle, Run, Work, kernel


class Greedy:
    def __init__(self, backend: Backend, logits_dtype: str):
        self.backend = backend
        self.kernel = kernel("argmax_last", logits_dtype)

    def select(self, logits: Handle, tokens: list[int]) -> Work:
        out = yield Run(self.kernel, {"logits": logits}, ("token",))
        return self.backend.to_list(out["token"])[0]
