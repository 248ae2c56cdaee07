"""The thinker -> talker -> code2wav loop of build/stage_graphs.py written by hand over onnxruntime: what
ortpipe's stages must give. Greedy, batch of one, attention mask all ones, caches fed back.

The thinker runs to its max_length; its hidden_states rows (the prompt's, then one per token it ran on)
condition the talker: talker position p gets thinker row p, zeros past the last row. The talker starts
from [decoder_start]; its generated ids (a final eos left out) are code2wav's codes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
from build import stage_graphs as sg

from tests.pipeline_refs import decoder_present, run, session, zero_pasts


def greedy(s, prompt: Sequence[int], max_length: int, eos: Sequence[int],
           extra: Callable[[int, int], dict[str, np.ndarray]], keep: str | None = None
           ) -> tuple[list[int], np.ndarray | None]:
    """Generated ids; and `keep`'s rows of every run joined along axis 1."""
    pasts = zero_pasts(s, "past_key_values.")
    tokens, new, kept = list(prompt), list(prompt), []
    generated: list[int] = []
    while True:
        past = len(tokens) - len(new)
        feeds = {"input_ids": np.array([new], dtype=np.int64),
                 "attention_mask": np.ones((1, len(tokens)), dtype=np.int64),
                 "position_ids": np.arange(past, len(tokens), dtype=np.int64)[None], **pasts,
                 **extra(past, len(new))}
        out = run(s, feeds)
        if keep:
            kept.append(out[keep])
        pasts = {name: out[decoder_present(name)] for name in pasts}
        token = int(np.argmax(out["logits"][0, -1]))
        tokens.append(token)
        generated.append(token)
        new = [token]
        if token in eos or len(tokens) >= max_length:
            return generated, (np.concatenate(kept, axis=1) if keep else None)


def omni_reference(folder: Path | str, prompt: Sequence[int], thinker_max: int, talker_max: int
                   ) -> tuple[list[int], list[int], np.ndarray]:
    """(thinker ids, talker ids, waveform)."""
    think, states = greedy(session(folder, sg.FILES["thinker"]), prompt, thinker_max, [sg.EOS],
                           lambda past, n: {}, keep="hidden_states")

    def rows(past: int, n: int) -> dict[str, np.ndarray]:
        part = states[:, past:past + n]
        pad = np.zeros((1, n - part.shape[1], states.shape[2]), dtype=np.float32)
        return {"thinker_states": np.concatenate([part, pad], axis=1)}

    talk, _ = greedy(session(folder, sg.FILES["talker"]), [sg.DECODER_START], talker_max, [sg.EOS], rows)
    codes = talk[:-1] if talk[-1] == sg.EOS else talk
    code2wav = session(folder, sg.FILES["code2wav"])
    wave = run(code2wav, {"codes": np.array([codes], dtype=np.int64)})["waveform"]
    return think, talk, wave
