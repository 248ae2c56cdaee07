"""A seeded fuzz run: thousands of mutated configs, broken model folders, chat templates and requests.

Each case is either accepted (and then runs) or refused with a ConfigError or GenerationError whose
message is bounded in size; nothing else may come out: no other exception, no hang, no read outside
the folder. The seed is fixed, so a failure replays; ORTPIPE_FUZZ_SEED and ORTPIPE_FUZZ_SCALE
explore further. Each test prints its counts (pytest -s shows them).
"""

from __future__ import annotations

import copy
import json
import os
import random
import shutil
import signal
import sys
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import onnxruntime  # noqa: F401 -- imported before any case: its first import reads /etc/os-release
import pytest
from build import graphs

import ortpipe
from ortpipe.config import load_config
from ortpipe.errors import ConfigError, GenerationError, OrtpipeError
from ortpipe.folder import LocalFolder
from tests.web.conftest import CHAT_TEMPLATE, write_tokenizer

SEED = int(os.environ.get("ORTPIPE_FUZZ_SEED", "20261124"))
SCALE = float(os.environ.get("ORTPIPE_FUZZ_SCALE", "1"))
MAX_MESSAGE = 4000  # characters: errors quote what they found, cut short

# Values a hostile config may hold anywhere.
ODD = [None, True, False, 0, -1, 1, 2**31, 2**63, -(2**63), 1e308, -1e-308, 0.5, float("nan"), float("inf"),
       "", "x", "auto", "../x.onnx", "/etc/passwd", "model.onnx", "\x00", "é" * 3, "A" * 5000, [], [1, "a"],
       [None], {}, {"a": 1}, {"file": "model.onnx"}, [[[[]]]]]


HANG_SECONDS = 60  # a case still running after this is a hang (the slowest take well under a second)

# Every file Python opens while a case runs must be inside the case's folder, or Python's and
# ortpipe's own files (modules, kernel graphs); an audit hook records the others. onnxruntime's own
# reads (C++) are not seen: ortpipe checks every path before it hands one over (tests/test_hostile.py).
_WATCH: dict[str, Any] = {"roots": None, "outside": []}
_OWN = tuple(
    os.path.realpath(p) + os.sep
    for p in {sys.prefix, sys.base_prefix, sys.exec_prefix, os.path.dirname(ortpipe.__file__), "/dev"}
)


def _audit(event: str, args: tuple) -> None:
    if event == "open" and _WATCH["roots"] is not None and isinstance(args[0], (str, bytes, os.PathLike)):
        real = os.path.realpath(os.fsdecode(args[0]))
        if not (real + os.sep).startswith(_WATCH["roots"]):
            _WATCH["outside"].append(real)


sys.addaudithook(_audit)


class Hang(Exception):
    pass


def _hang(signum: int, frame: Any) -> None:
    raise Hang(f"the case ran for more than {HANG_SECONDS} s")


def outcome(run: Callable[[], Any], *folders: Path) -> str:
    """"ok", or the class of a refusal; anything else fails the test with the case: another
    exception, a hang, or a file opened outside `folders` (and Python's and ortpipe's own)."""
    _WATCH["roots"], _WATCH["outside"] = (*_OWN, *(os.path.realpath(f) + os.sep for f in folders)), []
    previous = signal.signal(signal.SIGALRM, _hang)
    signal.alarm(HANG_SECONDS)
    try:
        run()
    except (ConfigError, GenerationError) as e:
        assert len(str(e)) <= MAX_MESSAGE, f"a {len(str(e))}-character message"
        return type(e).__name__
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
        outside, _WATCH["roots"] = _WATCH["outside"], None
        assert not outside, f"opened outside the folder: {sorted(set(outside))}"
    return "ok"


def paths(value: Any, prefix: tuple = ()) -> Iterator[tuple]:
    """Every path to a value inside nested dicts and lists."""
    yield prefix
    if isinstance(value, dict):
        for key, item in value.items():
            yield from paths(item, (*prefix, key))
    elif isinstance(value, list):
        for i, item in enumerate(value):
            yield from paths(item, (*prefix, i))


def mutate(config: dict, rng: random.Random) -> dict:
    """One to three changes: a value replaced by an odd one, a key dropped, renamed or added."""
    config = copy.deepcopy(config)
    for _ in range(rng.randint(1, 3)):
        candidates = [p for p in paths(config) if p]
        if not candidates:  # earlier changes left nothing to change (an emptied config)
            break
        path = rng.choice(candidates)
        parent = config
        for step in path[:-1]:
            parent = parent[step]
        key = path[-1]
        kind = rng.random()
        if kind < 0.6:
            parent[key] = copy.deepcopy(rng.choice(ODD))
        elif kind < 0.75 and isinstance(parent, dict):
            del parent[key]
        elif kind < 0.9 and isinstance(parent, dict):
            parent[_typo(str(key), rng)] = parent.pop(key)
        elif isinstance(parent, dict):
            parent[rng.choice(["extra", "eos_toen_id", "filenam", "temprature", "type"])] = copy.deepcopy(
                rng.choice(ODD))  # a copy: later changes must not reach ODD's own lists
    return config


def _typo(key: str, rng: random.Random) -> str:
    if len(key) < 2:
        return key + "_"
    i = rng.randrange(len(key) - 1)
    return key[:i] + key[i + 1] + key[i] + key[i + 2:]


def write_json(path: Path, value: Any) -> None:
    path.write_text(json.dumps(value, allow_nan=True))


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = graphs.build_separate(tmp_path_factory.mktemp("fuzz") / "base", seed=0, config=True)
    write_tokenizer(folder)
    return folder


def v1_config() -> dict:
    return {
        "model": {
            "type": "tiny",
            "context_length": 128,
            "eos_token_id": graphs.EOS,
            "bos_token_id": graphs.BOS,
            "pad_token_id": graphs.PAD,
            "vocab_size": graphs.VOCAB,
            "decoder": {
                "filename": "model.onnx",
                "head_size": 8,
                "num_key_value_heads": 2,
                "session_options": {"log_id": "x", "provider_options": []},
                "inputs": {
                    "input_ids": "input_ids",
                    "attention_mask": "attention_mask",
                    "position_ids": "position_ids",
                    "past_key_names": "past_key_values.%d.key",
                    "past_value_names": "past_key_values.%d.value",
                },
                "outputs": {
                    "logits": "logits",
                    "present_key_names": "present.%d.key",
                    "present_value_names": "present.%d.value",
                },
            },
        },
        "search": {"max_length": 64, "do_sample": False, "top_k": 5, "temperature": 1.0},
    }


def test_mutated_configs(base: Path, tmp_path: Path) -> None:
    """Mutations of a v2 and a v1 config: every one is validated when the folder loads (parsing
    only for most; a full load and a short generation for a share of them)."""
    rng = random.Random(SEED)
    originals = {"v2": json.loads((base / "genai_config.json").read_text()), "v1": v1_config()}
    folder = shutil.copytree(base, tmp_path / "mutated")
    counts: Counter = Counter()
    for i in range(int(2000 * SCALE)):
        kind = "v2" if i % 2 else "v1"
        write_json(folder / "genai_config.json", mutate(originals[kind], rng))
        if i % 8:
            result = outcome(lambda: load_config(LocalFolder(folder), warn=False), folder)
        else:
            result = outcome(
                lambda: ortpipe.load(folder, threads=1).generate(prompt_ids=[5, 6], max_new_tokens=2), folder
            )
        counts[f"{kind} {result}"] += 1
    print("mutated configs:", dict(counts))
    assert sum(counts.values()) == int(2000 * SCALE)


@pytest.mark.slow
def test_mutated_encoder_decoder_folders(tmp_path: Path) -> None:
    """Mutations of optimum's encoder-decoder exports' JSON files (a T5's config.json and
    generation_config.json; a BART summarizer's, whose generation_config.json sets its search; a multilingual
    Whisper's and its preprocessor_config.json), one file at a time: each folder loads and answers a short
    request (a prompt; a WAV file), or is refused. Found a hang before: a sampling_rate of 2 ** 31 Hz
    resampled a clip to billions of samples."""
    from build import seq2seq

    from tests.test_seq2seq import MULTILINGUAL
    from tests.test_serve_transcriptions import clip

    rng = random.Random(SEED)
    wav = clip(tmp_path / "clip.wav", 1.0, 2)
    counts: Counter = Counter()
    jsons = ("config.json", "generation_config.json")
    for name, files in (("t5-optimum", jsons), ("bart-optimum", jsons),
                        ("whisper-optimum", (*jsons, "preprocessor_config.json"))):
        source = seq2seq.get(name)
        folder = Path(shutil.copytree(source, tmp_path / name))
        originals = {f: json.loads((source / f).read_text()) for f in files}
        if name == "whisper-optimum":
            originals["generation_config.json"].update(MULTILINGUAL)
        asked = {"audios": [str(wav)]} if name == "whisper-optimum" else {"prompt": "import os"}

        def run(folder: Path = folder, asked: dict = asked) -> Any:
            return ortpipe.load(folder, threads=1).generate(max_new_tokens=2, **asked)

        for _ in range(int(60 * SCALE)):
            for f in files:
                write_json(folder / f, originals[f])
            changed = rng.choice(files)
            write_json(folder / changed, mutate(originals[changed], rng))
            counts[f"{name} {outcome(run, folder, tmp_path)}"] += 1
    print("mutated encoder-decoder folders:", dict(counts))
    assert counts["t5-optimum ok"] and counts["bart-optimum ok"] and counts["whisper-optimum ok"]


BROKEN_FILES: dict[str, Callable[[Path], None]] = {
    "empty graph": lambda f: (f / "model.onnx").write_bytes(b""),
    "truncated graph": lambda f: (f / "model.onnx").write_bytes((f / "model.onnx").read_bytes()[:500]),
    "random graph": lambda f: (f / "model.onnx").write_bytes(random.Random(1).randbytes(4000)),
    "json as graph": lambda f: (f / "model.onnx").write_text('{"a": 1}'),
    "graph is a folder": lambda f: ((f / "model.onnx").unlink(), (f / "model.onnx").mkdir()),
    "utf-16 config": lambda f: (f / "genai_config.json").write_bytes(
        (f / "genai_config.json").read_text().encode("utf-16")
    ),
    "bad utf-8 config": lambda f: (f / "genai_config.json").write_bytes(b'{"version": 2, "\xc3(": 1}'),
    "deep config": lambda f: (f / "genai_config.json").write_text("[" * 100_000 + "]" * 100_000),
    "config is a list": lambda f: (f / "genai_config.json").write_text("[1, 2]"),
    "not json": lambda f: (f / "genai_config.json").write_text("version: 2"),
    "50 MB config": lambda f: write_json(
        f / "genai_config.json",
        {
            **json.loads((f / "genai_config.json").read_text()),
            "metadata": ["x" * 1000] * 50_000,
            "tokens": {"eos": "x" * 50_000_000},
        },
    ),
    "corrupt tokenizer": lambda f: (f / "tokenizer.json").write_text(
        '{"model": {"type": "BPE", "vocab": 3}}'
    ),
    "tokenizer not json": lambda f: (f / "tokenizer.json").write_text("<html>"),
    "tokenizer config list": lambda f: (f / "tokenizer_config.json").write_text("[]"),
    "deep tokenizer config": lambda f: (f / "tokenizer_config.json").write_text(
        "[" * 100_000 + "]" * 100_000
    ),
    "template syntax": lambda f: _template(f, "{% for m in messages %}"),
    "template not a string": lambda f: _template(f, {"a": 1}),
    "template list": lambda f: _template(f, [{"name": "default", "template": "{{ 1 + }}"}]),
    "unreadable config": lambda f: (
        (f / "genai_config.json").chmod(0) if os.getuid() else (f / "genai_config.json").write_text("")
    ),
}


def _template(folder: Path, template: Any) -> None:
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = template
    write_json(folder / "tokenizer_config.json", config)


@pytest.mark.parametrize("case", list(BROKEN_FILES))
def test_broken_model_folders(base: Path, tmp_path: Path, case: str) -> None:
    folder = shutil.copytree(base, tmp_path / "broken")
    BROKEN_FILES[case](folder)
    assert outcome(lambda: ortpipe.load(folder, threads=1), folder) == "ConfigError"


# Templates that try to escape the sandbox, run away, or render too much: each is refused cleanly.
HOSTILE_TEMPLATES = [
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ messages.__class__.__init__.__globals__ }}",
    "{{ cycler.__init__.__globals__.os.popen('id').read() }}",
    "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
    "{% set x = range(100000) | list %}{% for i in x %}{% for j in x %}{% endfor %}{% endfor %}",
    "{% for i in range(100000) %}{{ 'x' * 100000 }}{% endfor %}",
    "{{ raise_exception('no system message') }}",
    "{{ messages[10].content }}",
    "{{ 1 / 0 }}",
    "{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}",
]


@pytest.mark.parametrize("template", HOSTILE_TEMPLATES)
def test_hostile_chat_templates(base: Path, tmp_path: Path, template: str) -> None:
    folder = shutil.copytree(base, tmp_path / "template")
    _template(folder, template)
    pipe = ortpipe.load(folder, threads=1)
    result = outcome(lambda: pipe.generate(messages=[{"role": "user", "content": "hi"}], max_new_tokens=2),
                     folder)
    assert result in ("GenerationError", "ConfigError")


def random_value(rng: random.Random) -> Any:
    return copy.deepcopy(rng.choice([*ODD, 3, 0.7, [5, 6], ["\n"], "def", 10**12, -5]))


def random_request(rng: random.Random, settings: list[str]) -> dict[str, Any]:
    request: dict[str, Any] = {}
    pick = rng.random()
    if pick < 0.5:
        request["prompt_ids"] = rng.choice(
            [[5, 6, 7], [], [95], [96], [10**12], [-1], [True], [1.5], "abc", list(range(90)), [5] * 200]
        )
    elif pick < 0.8:
        request["prompt"] = rng.choice(["def f(", "", "\ud800", "é🙂" * 50, "x" * 300, "\x00"])
    else:
        request["messages"] = rng.choice(
            [
                [{"role": "user", "content": "hi"}],
                [],
                [{"role": 1}],
                "hi",
                [{"role": "user", "content": None}],
            ]
        )
    for name in rng.sample(settings, rng.randint(0, 4)):
        request[name] = random_value(rng)
    if rng.random() < 0.2:
        request[rng.choice(["temprature", "max_tokens", "images", "inputs"])] = random_value(rng)
    request.setdefault("max_new_tokens", rng.choice([1, 2, 3]))
    return request


def test_random_requests(base: Path) -> None:
    from ortpipe.config.settings import SETTINGS

    rng = random.Random(SEED + 1)
    pipe = ortpipe.load(base, threads=1)
    names = [s.name for s in SETTINGS]
    counts: Counter = Counter()
    for _ in range(int(3000 * SCALE)):
        request = random_request(rng, names)
        counts[outcome(lambda: pipe.generate(**request), base)] += 1  # noqa: B023 (called at once)
    print("random requests:", dict(counts))
    assert counts["ok"] > 100 and counts["GenerationError"] > 100  # both kinds were really exercised
    # after all of it the pipeline still serves a plain request
    assert pipe.generate(prompt_ids=[5, 6, 7], max_new_tokens=4).tokens


def test_chat_turns_after_refusals(base: Path) -> None:
    """Refused turns leave the chat usable; the conversation equals one that never had them."""
    pipe = ortpipe.load(base, threads=1)
    chat = pipe.chat(max_length=200)
    for bad in (None, 5, ["x"]):
        with pytest.raises(GenerationError):
            list(chat.say(bad, max_new_tokens=3))
    reply = [c.token for c in chat.say("def f(", max_new_tokens=5)]
    clean = pipe.chat(max_length=200)
    assert reply == [c.token for c in clean.say("def f(", max_new_tokens=5)]
    assert CHAT_TEMPLATE  # the folder's template (tests/web/conftest.py)


def test_refusals_do_not_depend_on_running(base: Path) -> None:
    """Settings that validate refuses are refused by a config too (validate catches what run would)."""
    from ortpipe.config.settings import SETTINGS

    rng = random.Random(SEED + 2)
    original = json.loads((base / "genai_config.json").read_text())
    counts: Counter = Counter()
    folder = base.parent / "refusals"
    shutil.copytree(base, folder, dirs_exist_ok=True)
    pipe = ortpipe.load(base, threads=1)
    for _ in range(int(600 * SCALE)):
        setting = rng.choice([s for s in SETTINGS if s.v2])
        value = random_value(rng)
        config = copy.deepcopy(original)
        head, _, key = setting.v2.rpartition(".")
        (config["generation"].setdefault(head, {}) if head else config["generation"])[key] = value
        write_json(folder / "genai_config.json", config)
        at_load = outcome(lambda: load_config(LocalFolder(folder), warn=False), folder)
        if at_load == "ok" and setting.search:
            at_run = outcome(lambda: pipe.generate(prompt_ids=[5, 6], max_new_tokens=2,  # noqa: B023 (run at once)
                                                   **{setting.name: value}), base)  # noqa: B023

            ids = setting.kind == "ids" or setting.name.endswith("_token_id")
            if at_run == "GenerationError" and ids:  # ids past the vocabulary: the model's load refuses them
                at_load = outcome(lambda: ortpipe.load(folder, threads=1), folder)  # noqa: B023
                assert at_load == "ConfigError", (setting.name, value)
            else:
                assert at_run == "ok" or setting.name in ("num_return_sequences", "do_sample"), (
                    setting.name,
                    value,
                )
        counts[at_load] += 1
    print("config settings:", dict(counts))
    assert counts["ConfigError"] > 50


def test_errors_are_one_family() -> None:
    assert issubclass(ConfigError, OrtpipeError) and issubclass(GenerationError, OrtpipeError)


def test_the_watch_sees_a_read_outside_the_folder_and_a_hang(base: Path, tmp_path: Path) -> None:
    """The fuzz cases' checks can fail: a file opened outside the folder, and a case that never ends."""
    outside = tmp_path / "outside.txt"
    outside.write_text("secret")
    with pytest.raises(AssertionError, match="opened outside the folder"):
        outcome(lambda: outside.read_text(), base)
    assert outcome(lambda: (base / "genai_config.json").read_text(), base) == "ok"
    global HANG_SECONDS
    HANG_SECONDS, before = 1, HANG_SECONDS
    try:
        with pytest.raises(Hang):
            outcome(lambda: any(False for _ in iter(int, 1)), base)  # an endless loop
    finally:
        HANG_SECONDS = before


def test_image_paths_the_file_system_refuses() -> None:
    """A path too long for the file system (or a NUL byte in it) is a GenerationError, not an OSError."""
    from ortpipe.targets.cpython.media import decode_image

    refusal = (r"the image path .*\.\.\. \(\d+ characters\) cannot be a file here \(File name too long\); "
               r"give the path of an existing file")
    for path in ("A" * 5000, "a/" * 3000 + "x.png"):
        with pytest.raises(GenerationError, match=refusal):
            decode_image(path)
    with pytest.raises(GenerationError, match="the image file .* does not exist"):
        decode_image("a\x00b.png")


def test_media_a_folder_does_not_read_is_refused_before_any_file_is_opened(base: Path) -> None:
    """A text folder given images, audio or a mask as paths refuses them without opening the files."""
    pipe = ortpipe.load(base, threads=1)
    outside = str(Path(__file__).resolve())  # a file that exists, outside the folder
    for request, message in [
        ({"images": [outside]}, "the request has images, but no session of this pipeline reads pixel_val"),
        ({"audios": [outside]}, "the request has audio, but no session of this pipeline reads input_feat"),
        ({"mask": outside}, "a mask is inpainting's"),
    ]:
        result = outcome(lambda: pipe.generate("x", max_new_tokens=1, **request), base)  # noqa: B023
        assert result == "GenerationError", request
        with pytest.raises(GenerationError, match=message):
            pipe.generate("x", max_new_tokens=1, **request)
