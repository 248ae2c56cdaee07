"""Texts as the inputs of the sessions that read them, for the loops that make no tokens (single_pass,
denoising): token ids truncated to the folder's length and padded into one batch, the attention mask,
zero token types and positions, by the role names of the sessions' inputs (sessions.NAME.inputs)."""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

from ..errors import GenerationError
from ..execute.work import Backend, Handle
from ..folder import Folder
from ..jsonfile import optional_json
from ..plan import FROM_REQUEST, Plan
from ..tokenizer import Tokenizer, encode

ROLES = ("input_ids", "attention_mask", "token_type_ids", "position_ids")
MAX_TEXTS = 100_000  # texts in one request


@dataclass(frozen=True)
class TextSetup:
    """How a folder's texts become rows: the pad id, the most tokens a row keeps (special tokens included),
    and whether every row is padded to that length (CLIP's text encoders read a fixed length)."""

    pad_id: int
    max_length: int | None
    pad_to_max: bool


def text_setup(folder: Folder, where: str, tokenizer: Tokenizer | None, configured: int | None) -> TextSetup:
    """The folder's TextSetup: `configured` (preprocessing.text.max_length) or the tokenizer's length, and its
    pad id (tokenizer_config.json's pad_token in tokenizer.json's added tokens, else 0)."""
    own = getattr(tokenizer, "pad_id", None)
    length = configured or getattr(tokenizer, "max_length", None)
    if own is not None:
        return TextSetup(own, length, bool(getattr(tokenizer, "pad_to_max", False)))
    prefix = f"{where}/" if where else ""
    config = optional_json(folder, prefix + "tokenizer_config.json")
    if length is None:
        value = config.get("model_max_length")
        length = value if isinstance(value, int) and 0 < value < 1 << 20 else None
    pad = config.get("pad_token")
    pad = pad.get("content") if isinstance(pad, dict) else pad
    pad_id = 0
    if isinstance(pad, str) and folder.exists(prefix + "tokenizer.json"):
        added = optional_json(folder, prefix + "tokenizer.json").get("added_tokens") or []
        pad_id = next((t["id"] for t in added if isinstance(t, dict) and t.get("content") == pad), 0)
    return TextSetup(pad_id, length, False)


def encode_texts(tokenizer: Tokenizer | None, texts: list[Any], max_length: int | None) -> list[list[int]]:
    """Each text's ids with the tokenizer's special tokens, truncated to max_length keeping them."""
    if tokenizer is None:
        raise GenerationError("this model folder has no tokenizer: pass prompt_ids instead of text")
    if not isinstance(texts, list) or not texts or len(texts) > MAX_TEXTS:
        raise GenerationError(f"texts must be a list of 1 to {MAX_TEXTS} strings")
    for text in texts:
        if not isinstance(text, str):
            raise GenerationError(f"each text must be a string, found {type(text).__name__}")
    rows = []
    for text, ids in zip(texts, _encode_all(tokenizer, texts), strict=True):
        if not ids:
            raise GenerationError(
                f"the text {text[:40]!r} gives no tokens (the tokenizer keeps none of its characters)"
            )
        if max_length is not None and len(ids) > max_length:
            ids = _truncated(tokenizer, text, ids, max_length)
        rows.append(ids)
    return rows


def _encode_all(tokenizer: Tokenizer, texts: list[str]) -> list[list[int]]:
    """Each text's ids: in one call when the tokenizer has `encode_batch` (a target's, which may encode
    them in parallel), else one by one."""
    batch = getattr(tokenizer, "encode_batch", None)
    if batch is None:
        return [encode(tokenizer, text) for text in texts]
    try:
        return batch(texts)
    except Exception as e:  # the tokenizer library's own errors, whatever their type
        raise GenerationError(
            f"the tokenizer cannot encode these texts: {type(e).__name__}: {str(e)[:200]}"
        ) from None


def _truncated(tokenizer: Tokenizer, text: str, ids: list[int], max_length: int) -> list[int]:
    """The special tokens the tokenizer puts around the text's own ids kept, its own ids cut."""
    plain = encode(tokenizer, text, add_special_tokens=False)
    start = next((i for i in range(len(ids) - len(plain) + 1) if ids[i : i + len(plain)] == plain), None)
    if start is None:  # no contiguous run: cut the end
        return ids[:max_length]
    head, tail = ids[:start], ids[start + len(plain) :]
    keep = max(0, max_length - len(head) - len(tail))
    return (head + plain[:keep] + tail)[:max_length]


def text_inputs(
    plan: Plan, backend: Backend, rows: list[list[int]], setup: TextSetup,
    own: dict[str, tuple[list[list[int]], TextSetup]] | None = None,
) -> tuple[dict[str, Handle], Handle | None]:
    """The request inputs of the init sessions' text roles (input_ids, attention_mask, token_type_ids,
    position_ids) for `rows`, padded on the right to the longest row (or to max_length); and the attention
    mask as an int64 tensor (what pooling reads; None without rows). A session in `own` (one with its own
    tokenizer) takes its rows there instead, as inputs named "session.input"."""
    inputs, mask = {}, None
    shared = _padded(rows, setup) if rows else {}  # the rows of every session without its own tokenizer
    for s in plan.init_steps:
        session_rows, session_setup = (own or {}).get(s.session, (rows, setup))
        if not session_rows:
            continue
        values = _padded(session_rows, session_setup) if s.session in (own or {}) else shared
        shape = (len(session_rows), len(values["input_ids"]) // len(session_rows))
        spec = plan.config.pipeline.sessions[s.session]
        names = {spec.inputs.get(role, role): role for role in ROLES}
        for f in s.feeds:
            if f.kind == FROM_REQUEST and f.input in names:
                key = f"{s.session}.{f.input}" if s.session in (own or {}) else f.input
                inputs[key] = backend.tensor(values[names[f.input]], shape, f.dtype)
    if rows:
        flat = shared["attention_mask"]
        mask = backend.tensor(flat, (len(rows), len(flat) // len(rows)), "int64")
    return inputs, mask


def _padded(rows: list[list[int]], setup: TextSetup) -> dict[str, list[int]]:
    """Each role's values for `rows` padded on the right to the longest row (or to max_length), row-major."""
    width = setup.max_length if setup.pad_to_max and setup.max_length else max(len(r) for r in rows)
    return {
        "input_ids": [i for r in rows for i in r + [setup.pad_id] * (width - len(r))],
        "attention_mask": [m for r in rows for m in [1] * len(r) + [0] * (width - len(r))],
        "token_type_ids": [0] * (len(rows) * width),
        "position_ids": [p for _ in rows for p in range(width)],
    }


def reads_text(plan: Plan, besides: Collection[str] = ()) -> bool:
    """Whether an init session (not one of `besides`) takes token ids from the request."""
    return any(
        f.kind == FROM_REQUEST
        and f.input == plan.config.pipeline.sessions[s.session].inputs.get("input_ids", "input_ids")
        for s in plan.init_steps
        if s.session not in besides
        for f in s.feeds
    )
