"""Logits processors that are integer logic over token ids: they decide which ids to ban.

The scores themselves never reach Python: banned ids go to the `process` kernel.
"""

from __future__ import annotations

from ..config.settings import SearchSettings


def banned_ids(s: SearchSettings, tokens: list[int], generated: int, eos: frozenset[int]) -> list[int]:
    banned = list(s.suppress_tokens)
    if eos and (len(tokens) < s.min_length or generated < s.min_new_tokens):
        banned.extend(sorted(eos))
    if s.no_repeat_ngram_size:
        banned.extend(ngram_bans(tokens, s.no_repeat_ngram_size))
    return banned


def ngram_bans(tokens: list[int], n: int) -> list[int]:
    """Tokens that would complete an n-gram already present in `tokens`."""
    if len(tokens) < n:
        return []
    prefix = tokens[len(tokens) - n + 1:] if n > 1 else []
    bans = []
    for start in range(len(tokens) - n + 1):
        if tokens[start:start + n - 1] == prefix:
            bans.append(tokens[start + n - 1])
    return bans
