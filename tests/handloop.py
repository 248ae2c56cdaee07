"""Reference greedy decoding written by hand with onnxruntime and numpy: what ortpipe is tested against.

Batch of one, attention_mask all ones, position_ids = arange. Two loops:
- `hand_greedy`: the usual cached loop: prefill with zero-length pasts, then feed each run's
  presents back as the next pasts (windowed layers trimmed to their last `window` positions).
- `no_cache_greedy`: no cache at all: every step reruns the whole sequence with zero-length pasts.
On a graph whose cache is right, both give the same tokens.

Layouts: "separate" (`past_key_values.{i}.key/.value` -> `present.{i}.key/.value`), "sliding"
(the same names), "combined" (`past_{i}` -> `present_{i}`). In every layout the cache's
sequence axis is the second to last.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Sequence
from pathlib import Path

import numpy as np
import onnxruntime as ort

LAYOUTS = ("separate", "combined", "sliding")


def hand_greedy(model_dir: Path | str, prompt_ids: Sequence[int], max_new_tokens: int, *, layout: str,
                window: int | None = None, window_layers: Collection[int] = (),
                eos: Collection[int] = ()) -> list[int]:
    """Generated ids (prompt excluded), stopping after an eos id or `max_new_tokens`."""
    if window_layers and window is None:
        raise ValueError("window_layers without a window")
    session = _session(model_dir, layout)
    pasts = empty_pasts(session)
    ids = list(prompt_ids)
    new = list(prompt_ids)
    generated: list[int] = []
    while len(generated) < max_new_tokens:
        outputs = _run(session, _step_feeds(session, new, len(ids)) | pasts)
        token = int(np.argmax(outputs["logits"][0, -1]))
        generated.append(token)
        if token in eos:
            break
        ids.append(token)
        new = [token]
        pasts = {name: outputs[_present_name(name, layout)] for name in pasts}
        pasts = {name: past[..., -window:, :] if _layer(name) in window_layers else past
                 for name, past in pasts.items()}
    return generated


def no_cache_greedy(model_dir: Path | str, prompt_ids: Sequence[int], max_new_tokens: int, *, layout: str,
                    eos: Collection[int] = ()) -> list[int]:
    """The same as `hand_greedy`, rerunning the full sequence with empty pasts at every step."""
    session = _session(model_dir, layout)
    ids = list(prompt_ids)
    generated: list[int] = []
    while len(generated) < max_new_tokens:
        outputs = _run(session, _step_feeds(session, ids, len(ids)) | empty_pasts(session))
        token = int(np.argmax(outputs["logits"][0, -1]))
        generated.append(token)
        if token in eos:
            break
        ids.append(token)
    return generated


def empty_pasts(session: ort.InferenceSession) -> dict[str, np.ndarray]:
    """Every cache input with batch 1 and zero positions; heads and head sizes are fixed in the graph."""
    pasts = {}
    for i in session.get_inputs():
        if i.name.startswith("past"):
            shape = [d if isinstance(d, int) else 1 for d in i.shape]  # symbolic: batch, positions
            shape[-2] = 0
            pasts[i.name] = np.zeros(shape, dtype=np.float32)
    return pasts


def _session(model_dir: Path | str, layout: str) -> ort.InferenceSession:
    if layout not in LAYOUTS:
        raise ValueError(f"layout {layout!r} is not one of {LAYOUTS}")
    return ort.InferenceSession(str(Path(model_dir) / "model.onnx"), providers=["CPUExecutionProvider"])


def _run(session: ort.InferenceSession, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    names = [o.name for o in session.get_outputs()]
    return dict(zip(names, session.run(names, feeds), strict=True))


def _step_feeds(session: ort.InferenceSession, new: Sequence[int], total: int) -> dict[str, np.ndarray]:
    """input_ids for the `new` tokens, ending at position `total` - 1; only the inputs the graph has."""
    feeds = {
        "input_ids": np.array([new], dtype=np.int64),
        "attention_mask": np.ones((1, total), dtype=np.int64),
        "position_ids": np.arange(total - len(new), total, dtype=np.int64)[None, :],
    }
    names = {i.name for i in session.get_inputs()}
    return {name: value for name, value in feeds.items() if name in names}


def _present_name(past: str, layout: str) -> str:
    if layout == "combined":
        return "present_" + past.removeprefix("past_")
    return "present." + past.removeprefix("past_key_values.")


def _layer(name: str) -> int:
    return int(re.search(r"\d+", name).group())
