"""build/train_demo.py's second stage: the weights it starts from and the copy windows it trains on."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
import torch
from build import train_demo

DEMO = Path(__file__).resolve().parent.parent / "models" / "demo"


def test_the_weights_read_from_the_int4_graph_give_its_logits() -> None:
    # torch's LlamaForCausalLM with the state dict read back from the folder's int4 graph, against
    # onnxruntime running that graph: the same function up to float rounding, on every position.
    settings = train_demo.STAGES["pretrain"]
    model = train_demo.load_model(settings)
    model.load_state_dict(train_demo.weights_from_folder(DEMO, settings), strict=False)
    model.tie_weights()
    ids = np.random.default_rng(0).integers(3, settings.vocab_size, (1, 48))
    with torch.no_grad():
        expected = model(input_ids=torch.from_numpy(ids)).logits.numpy()
    session = ort.InferenceSession(str(DEMO / "onnx" / "model_q4.onnx"), providers=["CPUExecutionProvider"])
    empty = np.zeros((1, settings.kv_heads, 0, settings.head_dim), np.float32)
    feeds = {"input_ids": ids, "attention_mask": np.ones_like(ids),
             **{i.name: empty for i in session.get_inputs() if i.name.startswith("past_key_values.")}}
    logits = session.run(["logits"], feeds)[0]
    # the graph quantizes its activations to int8 (accuracy level 4); torch computes in float32
    assert np.abs(logits - expected).max() < 0.05 * np.abs(expected).max()
    assert (logits.argmax(-1) == expected.argmax(-1)).mean() > 0.95


def test_a_copy_window_shows_one_span_twice_around_the_separator() -> None:
    stream = torch.arange(1000, 11000)  # every token tells where it came from
    separator = torch.tensor([7, 8])
    generator = torch.Generator().manual_seed(3)
    for _ in range(50):
        window = train_demo.copy_window(stream, 513, generator, separator)
        assert len(window) == 513
        at = [i for i in range(len(window) - 1) if window[i] == 7 and window[i + 1] == 8]
        assert len(at) == 1
        middle = at[0]
        after = window[middle + 2:]
        span = next(n for n in range(len(after), 0, -1) if torch.equal(window[middle - n:middle], after[:n]))
        assert span >= 16
        # the span is consecutive text, and the text around it comes from elsewhere
        assert torch.equal(after[:span], torch.arange(after[0], after[0] + span))


@pytest.mark.parametrize("share", [0.0, 0.5])
def test_a_batch_is_windows_of_the_stage_s_length(share: float) -> None:
    settings = train_demo.replace(train_demo.STAGES["copy"], copy_share=share, batch_size=6)
    batch = train_demo.sample_batch(torch.arange(100_000), settings, torch.Generator().manual_seed(0),
                                    torch.tensor([5]))
    assert batch.shape == (6, settings.seq_len + 1)
    steps = (batch[:, 1:] - batch[:, :-1] != 1).sum(dim=1)  # where a window jumps elsewhere
    assert (steps == 0).all() if share == 0 else (steps > 0).any()
