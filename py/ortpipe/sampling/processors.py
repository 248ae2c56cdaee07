"""Logits processors that are integer logic over token ids: they decide which ids to ban.

The scores themselves never reach Python: banned ids go to the `process` kernel.
"""

from __future__ import annotations

from collections import Counter

from ..config.settings import SearchSettings


def banned_ids(s: SearchSettings, tokens: list[int], generated: int, eos: frozenset[int]) -> list[int]:
    banned = list(s.suppress_tokens)
    if generated == 0:
        banned.extend(s.begin_suppress_tokens)
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


def penalty_counts(s: SearchSettings, tokens: list[int], generated: int) -> dict[int, int]:
    """How often each id was generated (the last `generated` of `tokens`), for the frequency and
    presence penalties; empty when neither is on."""
    if not s.counts_tokens or generated <= 0:
        return {}
    return dict(Counter(tokens[len(tokens) - generated:]))


def lowered_by(s: SearchSettings, count: int) -> float:
    """What a score loses for an id generated `count` times: count * frequency + presence, in Python's
    floats (each target rounds it to float32 once, then subtracts it in float32)."""
    return count * s.frequency_penalty + s.presence_penalty
