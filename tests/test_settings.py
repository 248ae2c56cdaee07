"""The settings table (config/settings.py) is the one list of generation settings: configs, v1
translation, requests, the CLI and the embed API's declarations all follow it."""

from __future__ import annotations

import json
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
from build import typescript

from ortpipe.config import load_config
from ortpipe.config.settings import SETTINGS, SearchSettings
from ortpipe.errors import ConfigError, GenerationError
from ortpipe.folder import LocalFolder
from ortpipe.sampling.settings import settings_for

# A value other than the default for each kind, and one the table refuses.
GOOD = {"bool": True, "int": 3, "float": 0.5, "ids": [4, 7], "strings": ["\n\n"], "string": "blurry",
        "path": "draft", "bias": {4: 1.5, "7": -100}}
BAD = {
    "bool": "false",
    "int": 2.5,
    "float": float("inf"),
    "ids": [-1],
    "strings": [""],
    "string": 3,
    "path": "",
    "bias": {4: 101},
}
CHECKED = {"bias": ((4, 1.5), (7, -100.0))}  # what the check makes of a GOOD value, where it is not the value


def write(folder: Path, config: dict) -> LocalFolder:
    folder.mkdir(exist_ok=True)
    (folder / "model.onnx").write_bytes(b"")
    (folder / "genai_config.json").write_text(json.dumps(config))
    return LocalFolder(folder)


def v2(generation: dict, loop: str = "autoregressive") -> dict:
    if loop == "denoising":
        pipeline = {
            "sessions": {"unet": {"file": "model.onnx"}},
            "flow": [{"run": "unet", "when": "step"}],
            "output": {"session": "unet", "name": "out_sample"},
        }
        return {"version": 2, "pipeline": pipeline, "generation": {"loop": "denoising", **generation}}
    return {"version": 2, "pipeline": {"extends": "autoregressive-decoder"}, "generation": generation}


def loop_of(setting) -> str:
    return setting.loops[0]


def nested(path: str, value: object) -> dict:
    head, _, key = path.rpartition(".")
    return {head: {key: value}} if head else {key: value}


def test_typescript_declarations_follow_the_table() -> None:
    text = typescript.DECLARATIONS.read_text()
    assert typescript.declared(text) == typescript.typescript_options()
    for s in SETTINGS:
        assert f"  {s.camel}?: " in text


@pytest.mark.parametrize("setting", [s for s in SETTINGS if s.v2], ids=lambda s: s.name)
def test_each_v2_key_reaches_the_request_defaults(tmp_path: Path, setting) -> None:
    value = GOOD[setting.kind]
    if setting.kind == "path":  # a folder inside the model folder, with a tokenizer
        (tmp_path / value).mkdir()
        (tmp_path / value / "tokenizer.json").write_text("{}")
    config = load_config(write(tmp_path, v2(nested(setting.v2, value), loop_of(setting))))
    got = (
        config.generation.max_length
        if setting.name == "max_length"
        else getattr(config.generation.settings, setting.name)
    )
    assert got == (tuple(value) if isinstance(value, list) else value)
    with pytest.raises(ConfigError, match=f"generation.{setting.v2} "):
        load_config(write(tmp_path, v2(nested(setting.v2, BAD[setting.kind]), loop_of(setting))))


@pytest.mark.parametrize("setting", [s for s in SETTINGS if s.v2 and len(s.loops) == 1], ids=lambda s: s.name)
def test_a_setting_of_another_loop_is_refused(tmp_path: Path, setting) -> None:
    """A key the config's loop does not read is an error, not a key accepted and ignored."""
    other = "denoising" if setting.loops == ("autoregressive",) else "autoregressive"
    with pytest.raises(
        ConfigError,
        match=f"generation.{setting.v2} is a setting of the "
        f'"{setting.loops[0]}" loop; this config\'s loop is "{other}"',
    ):
        load_config(write(tmp_path, v2(nested(setting.v2, GOOD[setting.kind]), other)))


@pytest.mark.parametrize(
    "setting", [s for s in SETTINGS if s.v1 and s.kind in ("bool", "int", "float")], ids=lambda s: s.name
)
def test_each_v1_search_key_is_translated(tmp_path: Path, setting) -> None:
    """A v1 key is under `search`, or under the top-level block it names (genai's `speculative`)."""
    value = GOOD[setting.kind]
    block, _, key = setting.v1.rpartition(".")
    v1 = {
        "model": {"type": "x", "eos_token_id": 2, "decoder": {"filename": "model.onnx"}},
        block or "search": {key: value},
    }
    config = load_config(write(tmp_path, v1))
    got = (
        config.generation.max_length
        if setting.name == "max_length"
        else getattr(config.generation.settings, setting.name)
    )
    assert got == value


@pytest.mark.parametrize("setting", [s for s in SETTINGS if s.search], ids=lambda s: s.name)
def test_each_request_setting_is_checked(setting) -> None:
    value = GOOD[setting.kind]
    beams = {"num_beams": 3} if setting.name == "num_return_sequences" else {}  # a rule between settings
    got = getattr(settings_for(SearchSettings(), {setting.name: value, **beams}), setting.name)
    assert got == CHECKED.get(setting.kind, tuple(value) if isinstance(value, list) else value)
    with pytest.raises(GenerationError, match=f"^{setting.name} "):
        settings_for(SearchSettings(), {setting.name: BAD[setting.kind]})


def test_unknown_settings_name_the_closest() -> None:
    with pytest.raises(
        GenerationError, match='unknown generation setting "temprature". Did you mean "temperature"'
    ):
        settings_for(SearchSettings(), {"temprature": 0.5})


def test_the_cli_has_a_flag_per_setting() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "ortpipe.cli", "run", "--help"], capture_output=True, text=True
    )
    assert out.returncode == 0
    for s in SETTINGS:
        assert s.flag in out.stdout, s.name


def test_sampling_settings_on_a_greedy_request_are_said_to_change_nothing(tmp_path) -> None:
    from build import graphs

    import ortpipe

    folder = graphs.build_separate(tmp_path / "m", seed=0, config=True)
    pipe = ortpipe.load(folder, threads=1)
    greedy = pipe.generate(prompt_ids=[5, 6], max_new_tokens=4).tokens
    with pytest.warns(UserWarning, match=r"temperature, top_p only apply when sampling.*in the model folder"):
        assert pipe.generate(prompt_ids=[5, 6], max_new_tokens=4, temperature=0.5, top_p=0.5).tokens == greedy
    with pytest.warns(UserWarning, match=r"top_k only applies when sampling.*do_sample is false\)"):
        pipe.generate(prompt_ids=[5, 6], max_new_tokens=4, do_sample=False, top_k=3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        pipe.generate(prompt_ids=[5, 6], max_new_tokens=4, temperature=0)  # greedy, as asked
        pipe.generate(prompt_ids=[5, 6], max_new_tokens=4, temperature=0, top_p=1, top_k=0, min_p=0)  # off
        pipe.generate(prompt_ids=[5, 6], max_new_tokens=4, do_sample=True, top_k=3, seed=1)


def test_minimums_the_length_limit_cuts_short_are_said(tmp_path) -> None:
    """min_length and min_new_tokens hold eos back; past the request's length limit they cannot, and the
    request says so (the tokens are the limit's)."""
    from build import graphs

    import ortpipe

    folder = graphs.build_separate(tmp_path / "m", seed=0, config=True)
    pipe = ortpipe.load(folder, threads=1)
    plain = pipe.generate(prompt_ids=[5, 6], max_new_tokens=4).tokens
    with pytest.warns(UserWarning, match=r"min_length 9 is more than this request's max_length 6 "):
        assert pipe.generate(prompt_ids=[5, 6], max_new_tokens=4, min_length=9).tokens == plain
    with pytest.warns(UserWarning, match=r"min_new_tokens 5 is more than the 4 tokens this request can make"):
        pipe.generate(prompt_ids=[5, 6], max_length=6, min_new_tokens=5)
    with pytest.warns(UserWarning, match=r"min_new_tokens 5 is more than the 4 tokens"):
        pipe.generator(prompt_len=2, max_new_tokens=4, min_new_tokens=5)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        pipe.generate(prompt_ids=[5, 6], max_new_tokens=4, min_length=6, min_new_tokens=4)  # reachable
