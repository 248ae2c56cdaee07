"""Plugins (ortpipe/plugins.py): refused without the opt-in, run with it, and the example RNN
transducer (examples/plugins/rnnt) equals a loop written by hand over onnxruntime."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
from build.plugin_models import BLANK_ID, build_rnnt, features

import ortpipe
from ortpipe.errors import ConfigError

MAX_SYMBOLS = 4


@pytest.fixture(scope="module")
def rnnt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_rnnt(tmp_path_factory.mktemp("plugin") / "rnnt")


def hand_transducer(folder: Path, feats: np.ndarray, prompt: list[int], eos: int) -> list[int]:
    """Greedy RNNT decoding with numpy and three onnxruntime sessions."""
    run = {name: ort.InferenceSession(str(folder / f"{name}.onnx"), providers=["CPUExecutionProvider"])
           for name in ("encoder", "predictor", "joiner")}
    encoded = run["encoder"].run(None, {"features": feats})[0]
    state = np.zeros((1, 16), np.float32)

    def predict(token: int, state: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        prediction, state = run["predictor"].run(
            None, {"token": np.array([[token]], np.int64), "state": state}
        )
        return prediction, state

    for token in [BLANK_ID, *prompt]:
        prediction, state = predict(token, state)
    out: list[int] = []
    for t in range(encoded.shape[1]):
        for _ in range(MAX_SYMBOLS):
            logits = run["joiner"].run(
                None, {"encoder_frame": encoded[:, t : t + 1], "prediction": prediction}
            )[0]
            symbol = int(logits[0, -1].argmax())
            if symbol == BLANK_ID:
                break
            out.append(symbol)
            if symbol == eos:
                return out
            prediction, state = predict(symbol, state)
    return out


def test_a_plugin_is_refused_without_the_opt_in(rnnt: Path) -> None:
    with pytest.raises(
        ConfigError, match=r'runs code from "ortpipe_rnnt": load the folder with allow_plugins=True'
    ):
        ortpipe.load(rnnt)
    assert "ortpipe_rnnt" not in sys.modules  # nothing of it was imported


@pytest.mark.parametrize("frames,prompt", [(6, [BLANK_ID]), (9, [3, 5]), (1, [BLANK_ID])])
def test_the_transducer_plugin_equals_a_hand_written_loop(rnnt: Path, frames: int, prompt: list[int]) -> None:
    pipe = ortpipe.load(rnnt, allow_plugins=True)
    feats = features(frames, seed=frames)
    result = pipe.generate(prompt_ids=prompt, max_new_tokens=60, inputs={"features": feats})
    expected = hand_transducer(rnnt, feats, prompt, eos=11)
    assert result.tokens == expected
    assert len(expected) >= 1 or frames == 1
    assert result.finish_reason == ("eos" if expected and expected[-1] == 11 else "length")


def test_the_plugin_is_imported_from_the_folders_wheel(rnnt: Path) -> None:
    """The wheel in the folder is what runs: the example package is not installed in this environment."""
    import importlib.util

    ortpipe.load(rnnt, allow_plugins=True)
    spec = importlib.util.find_spec("ortpipe_rnnt")
    assert spec is not None and ".whl" in str(spec.origin)


def test_the_cli_runs_a_plugin_only_when_allowed(rnnt: Path, tmp_path: Path) -> None:
    np.save(tmp_path / "features.npy", features(6, seed=6))
    command = [
        sys.executable,
        "-m",
        "ortpipe.cli",
        "run",
        str(rnnt),
        "--prompt-ids",
        str(BLANK_ID),
        "--max-new-tokens",
        "60",
        "--input",
        f"features={tmp_path / 'features.npy'}",
        "--json",
    ]
    refused = subprocess.run(command, capture_output=True, text=True)
    assert refused.returncode == 2 and "allow_plugins=True (the CLI's --allow-plugins" in refused.stderr
    allowed = subprocess.run([*command, "--allow-plugins"], capture_output=True, text=True)
    assert allowed.returncode == 0, allowed.stderr
    assert json.loads(allowed.stdout)["tokens"] == hand_transducer(
        rnnt, features(6, seed=6), [BLANK_ID], eos=11
    )


def test_bad_plugin_entries_are_config_errors(rnnt: Path, tmp_path: Path) -> None:
    import shutil

    for plugin, message in (
        ({"module": "no such module"}, 'must name a factory as "package.module:factory"'),
        ({"module": "json:nothing"}, 'has no callable "nothing"'),
        ({"module": "not_a_module_here:f"}, "cannot be imported from the installed packages"),
        ({"module": "a:f", "wheel": "../x.whl"}, "wheel"),
        ({"module": "a:f", "run": 1}, 'Unknown key "run"'),
    ):
        folder = shutil.copytree(rnnt, tmp_path / str(len(list(tmp_path.iterdir()))))
        config = json.loads((folder / "genai_config.json").read_text())
        config["pipeline"]["plugin"] = plugin
        (folder / "genai_config.json").write_text(json.dumps(config))
        with pytest.raises(ConfigError, match=message):
            ortpipe.load(folder, allow_plugins=True)


def test_settings_the_plugin_does_not_read_are_refused(rnnt: Path, tmp_path: Path) -> None:
    """The example's factory reads no generation settings: a request or a config that sets one is refused,
    not passed to a loop that would ignore it."""
    import shutil

    from ortpipe.errors import GenerationError

    pipe = ortpipe.load(rnnt, allow_plugins=True)
    with pytest.raises(GenerationError, match=r"plugin loop does not read do_sample, temperature: drop them"):
        pipe.generate(prompt_ids=[BLANK_ID], inputs={"features": features(3, seed=3)}, temperature=0.5,
                      do_sample=True)
    folder = shutil.copytree(rnnt, tmp_path / "configured")
    config = json.loads((folder / "genai_config.json").read_text())
    config["generation"] = {"sampling": {"top_k": 5}}
    (folder / "genai_config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="generation sets top_k, which the plugin's loop does not read"):
        ortpipe.load(folder, allow_plugins=True)
