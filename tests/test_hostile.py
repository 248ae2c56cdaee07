"""Hostile inputs: files outside the model folder are never opened, a pipeline shared by threads gives
each request what it gives alone, and Ctrl-C ends the command without a traceback."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from build import graphs

import ortpipe
from ortpipe.errors import ConfigError, GenerationError
from tests.handloop import hand_greedy

PROMPT = [5, 17, 42, 8, 23, 61, 3, 77]


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    model = graphs.build_separate(tmp_path / "model", seed=0, config=True)
    from tests.web.conftest import write_tokenizer

    write_tokenizer(model)
    return model


@pytest.fixture
def outside(tmp_path: Path) -> Path:
    """A directory beside the model folder holding what a link may point at."""
    out = tmp_path / "outside"
    out.mkdir()
    (out / "secret.json").write_text(json.dumps({"chat_template": "SECRET-CONTENT"}))
    return out


class Opened:
    """Every file Python opens while it is active (an audit hook: sys.addaudithook)."""

    def __init__(self) -> None:
        self.paths: list[str] = []
        self.active = False
        sys.addaudithook(self._hook)

    def _hook(self, event: str, args: tuple) -> None:
        if self.active and event == "open" and isinstance(args[0], (str, bytes, os.PathLike)):
            self.paths.append(os.path.realpath(os.fsdecode(args[0])))

    def __enter__(self) -> Opened:
        self.paths.clear()
        self.active = True
        return self

    def __exit__(self, *exc: object) -> None:
        self.active = False


OPENED = Opened()


def load_refused(folder: Path, outside: Path, *names: str) -> str:
    with OPENED, pytest.raises(ConfigError) as info:
        ortpipe.load(folder, threads=1)
    message = str(info.value)
    assert not [p for p in OPENED.paths if p.startswith(str(outside))], "a file outside the folder was opened"
    assert "SECRET" not in message
    for name in names:
        assert name in message, message
    return message


@pytest.mark.parametrize(
    "name", ["model.onnx", "tokenizer.json", "genai_config.json", "tokenizer_config.json"]
)
def test_a_file_that_links_out_of_the_folder_is_refused(folder: Path, outside: Path, name: str) -> None:
    shutil.move(folder / name, outside / name)
    (folder / name).symlink_to(outside / name)
    message = load_refused(folder, outside, str(folder / name), "leads outside the model folder")
    assert str(outside / name) in message  # the link and where it leads


def test_a_sub_folder_that_links_out_is_refused(folder: Path, outside: Path) -> None:
    (outside / "sub").mkdir()
    shutil.move(folder / "model.onnx", outside / "sub" / "model.onnx")
    (folder / "sub").symlink_to(outside / "sub")
    config = json.loads((folder / "genai_config.json").read_text())
    config["pipeline"]["sessions"]["decoder"]["file"] = "sub/model.onnx"
    (folder / "genai_config.json").write_text(json.dumps(config))
    load_refused(folder, outside, "sub/model.onnx", "leads outside the model folder")


def test_external_data_that_links_out_is_refused_before_onnxruntime_reads_it(
    folder: Path, outside: Path
) -> None:
    import onnx

    model = onnx.load(folder / "model.onnx")
    onnx.save(
        model,
        folder / "model.onnx",
        save_as_external_data=True,
        location="model.onnx.data",
        size_threshold=256,
    )  # weights out, small shape constants in
    assert ortpipe.load(folder, threads=1).generate(prompt_ids=PROMPT, max_new_tokens=4).tokens
    shutil.move(folder / "model.onnx.data", outside / "model.onnx.data")
    (folder / "model.onnx.data").symlink_to(outside / "model.onnx.data")
    load_refused(folder, outside, "model.onnx.data", "leads outside the model folder")


@pytest.mark.parametrize("config", ["/etc/passwd", "../outside/secret.json", "link.json"])
def test_preprocessing_configs_stay_in_the_folder(folder: Path, outside: Path, config: str) -> None:
    (folder / "link.json").symlink_to(outside / "secret.json")
    raw = json.loads((folder / "genai_config.json").read_text())
    raw["pipeline"]["preprocessing"] = {"image": {"config": config}}
    (folder / "genai_config.json").write_text(json.dumps(raw))
    message = load_refused(folder, outside, "pipeline.preprocessing.image.config")
    assert "passwd" not in message or "/etc/passwd" in message  # named, never read


def test_a_link_inside_the_folder_is_fine(folder: Path) -> None:
    shutil.move(folder / "model.onnx", folder / "real.onnx")
    (folder / "model.onnx").symlink_to(folder / "real.onnx")
    result = ortpipe.load(folder, threads=1).generate(prompt_ids=PROMPT, max_new_tokens=6)
    assert result.tokens == hand_greedy(folder, PROMPT, 6, layout="separate")


@pytest.mark.parametrize("model", ["llama_builder_fp32", "llama_concat"])
def test_eight_threads_on_one_pipeline_get_what_each_gets_alone(
    model: str, request: pytest.FixtureRequest
) -> None:
    pipe = ortpipe.load(request.getfixturevalue(model), threads=1)
    jobs = [
        dict(
            prompt_ids=[5 + i, 17, 42, 8 + i],
            max_new_tokens=24 + i,
            **({"do_sample": True, "seed": i, "top_k": 20} if i % 2 else {}),
        )
        for i in range(8)
    ]
    alone = [pipe.generate(**job).tokens for job in jobs]
    results: list[list[int] | None] = [None] * len(jobs)
    errors: list[BaseException] = []
    start = threading.Barrier(len(jobs))

    def run(i: int) -> None:
        try:
            start.wait()
            for _ in range(3):  # several rounds, so the steps of different threads interleave
                tokens = pipe.generate(**jobs[i]).tokens
                assert results[i] in (None, tokens)
                results[i] = tokens
        except BaseException as e:  # noqa: BLE001 (collected for the assertion below)
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert results == alone


def _wait_for_library(pid: int, name: str, timeout: float = 60.0) -> None:
    """Until the process has mapped a shared library whose path holds `name` (/proc's maps): numpy's
    while the command imports its target, onnxruntime's once the model's load begins. A fixed delay
    cannot tell those apart from Python's own start on a loaded machine (Ctrl-C there is Python's
    traceback, before any of the command's code runs)."""
    maps = Path(f"/proc/{pid}/maps")
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if name in maps.read_text():
                return
        except OSError:  # the process ended
            break
        time.sleep(0.002)
    raise AssertionError(f"process {pid} did not load {name} in {timeout} s")


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="needs /proc to see where the command is")
@pytest.mark.parametrize("when", ["importing", "loading", "generating"])
def test_ctrl_c_ends_the_command_without_a_traceback(when: str) -> None:
    """Importing: while numpy is (the command's own imports come before, the model's load after);
    loading: once onnxruntime is mapped; generating: after the first text came out, far from the end."""
    demo = Path(__file__).resolve().parent.parent / "models" / "demo"
    command = [
        sys.executable,
        "-m",
        "ortpipe.cli",
        "run",
        str(demo),
        "--prompt",
        "def f(",
        "--max-new-tokens",
        "480",
        "--repetition-penalty",
        "1.01",
        "--no-do-sample",  # greedy: its 480 tokens, never an early eos before the interrupt lands
        "--threads",
        "1",
    ]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    if when == "importing":
        _wait_for_library(process.pid, "_multiarray_umath")
    elif when == "loading":
        _wait_for_library(process.pid, "onnxruntime_pybind11_state")
    else:
        process.stdout.read(len("def f(") + 1)  # the prompt, then the first generated text
    process.send_signal(signal.SIGINT)
    _, err = process.communicate(timeout=60)
    assert process.returncode == 130, err.decode()
    assert "Traceback" not in err.decode()


def test_ctrl_c_in_chat_drops_the_turn_and_the_chat_goes_on(tmp_path: Path) -> None:
    """After the load, Ctrl-C is a KeyboardInterrupt: the reply stops, the chat goes on."""
    demo = tmp_path / "demo"
    shutil.copytree(Path(__file__).resolve().parent.parent / "models" / "demo", demo)
    tokenizer_config = json.loads((demo / "tokenizer_config.json").read_text())
    tokenizer_config["chat_template"] = "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"
    (demo / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    command = [sys.executable, "-m", "ortpipe.cli", "chat", str(demo), "--max-new-tokens", "480",
               "--repetition-penalty", "1.01", "--no-do-sample", "--threads", "1"]  # greedy: no early eos
    process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    process.stdin.write(b"def f(\n")
    process.stdin.flush()
    assert process.stdout.read(3) not in (b"", None)  # the prompt "> ", then the reply's first text
    process.send_signal(signal.SIGINT)
    out, err = process.communicate(b"import os\n/quit\n", timeout=60)
    assert process.returncode == 0, err.decode()
    err = err.decode()
    assert "Traceback" not in err
    assert err.count("[interrupted: the turn is dropped]") == 1
    assert err.count(" tokens/s, ") == 1  # the second turn's summary: it ran to its end


def nan_model(folder: Path) -> Path:
    """The test decoder with a NaN in its output bias: every logit is NaN."""
    import numpy as np
    import onnx
    from onnx import numpy_helper

    model = onnx.load(folder / "model.onnx")
    for init in model.graph.initializer:
        if init.dims == [graphs.VOCAB]:
            init.CopyFrom(numpy_helper.from_array(np.full(graphs.VOCAB, np.nan, np.float32), init.name))
            break
    else:
        raise AssertionError("no output bias found")
    onnx.save(model, folder / "model.onnx")
    return folder


def test_nan_logits_stop_generation_with_an_error_naming_the_step(folder: Path) -> None:
    pipe = ortpipe.load(nan_model(folder), threads=1)
    with pytest.raises(ortpipe.OrtpipeError, match=r"\(step 0\): the model's logits are NaN or infinite"):
        pipe.generate(prompt_ids=PROMPT, max_new_tokens=4)


def test_nan_logits_in_a_fused_step_name_the_session_and_position() -> None:
    import numpy as np

    from ortpipe.targets.cpython.driver import _checked

    assert _checked(np.array([0.0, 2.0, 1.0], np.float32), "decoder", 7) == 1
    for bad in ([0.0, np.nan, 1.0], [0.0, np.inf, 1.0], [-np.inf, -np.inf, -np.inf]):
        with pytest.raises(
            ortpipe.OrtpipeError,
            match='session "decoder" gave NaN or infinite logits on the decode step at position 7',
        ):
            _checked(np.array(bad, np.float32), "decoder", 7)


@pytest.mark.parametrize(("given", "found"),
                         [(5, "int"), (None, "NoneType"), ("", '""'), (b"models", "bytes")])
def test_a_folder_that_is_no_path_is_a_config_error(given: object, found: str) -> None:
    with pytest.raises(ConfigError) as error:
        ortpipe.load(given)  # type: ignore[arg-type]
    assert str(error.value) == f"load() takes the model folder's path (a str or os.PathLike), not {found}"


def test_a_file_given_as_the_folder_names_the_folder_that_holds_it(folder: Path) -> None:
    given = folder / "genai_config.json"
    with pytest.raises(ConfigError) as error:
        ortpipe.load(given)
    assert str(error.value) == (f"model folder {given} is a file, not a directory: give the folder that "
                                f"holds the model's files ({folder})")


def test_a_prompt_with_a_lone_surrogate_is_refused_naming_it(folder: Path) -> None:
    with pytest.raises(GenerationError) as error:
        ortpipe.load(folder).generate("ab\ud800c", max_new_tokens=1)
    assert str(error.value) == ("the text is not valid Unicode: character 2 is a lone surrogate ('\\ud800', "
                                "half of a UTF-16 pair); remove it or complete the pair")


def test_an_empty_prompt_on_a_tokenizer_without_a_start_token_says_so() -> None:
    """The demo's tokenizer adds no start token: "" is no token at all, said as a prompt, not as ids."""
    demo = Path(__file__).resolve().parent.parent / "models" / "demo"
    with pytest.raises(GenerationError) as error:
        ortpipe.load(demo, threads=1).generate("", max_new_tokens=1)
    assert str(error.value) == ('the prompt "" encodes to no tokens (this folder\'s tokenizer adds no start '
                                "token): give some text, or prompt_ids")
    assert error.value.setting == "prompt_ids"  # a server names its prompt parameter


def test_a_suppressed_token_outside_the_vocabulary_is_refused_before_any_run(folder: Path) -> None:
    """An id past the logits' width used to reach the `process` kernel, whose ScatterElements failed with
    onnxruntime's bounds message; greedy, sampled and streamed alike, the request now names the setting."""
    pipe = ortpipe.load(folder, threads=1)
    vocab = pipe.model.vocab
    assert vocab
    for settings in ({}, {"do_sample": True, "seed": 1}):
        with pytest.raises(GenerationError) as error:
            pipe.generate(prompt_ids=[5, 6], max_new_tokens=2, suppress_tokens=[3, vocab], **settings)
        assert str(error.value) == (f"suppress_tokens: token id {vocab} is not below the vocabulary size "
                                    f"{vocab} of this model's logits; drop it")
        with pytest.raises(GenerationError):
            next(iter(pipe.stream(prompt_ids=[5, 6], max_new_tokens=2, suppress_tokens=[10**9])))
    assert len(pipe.generate(prompt_ids=[5, 6], max_new_tokens=2, suppress_tokens=[vocab - 1]).tokens) == 2
    with pytest.raises(GenerationError) as error:
        pipe.generate(prompt_ids=[5, 6], max_new_tokens=2, logit_bias={vocab + 5: 1.0})
    assert str(error.value).startswith(f"logit_bias: token id {vocab + 5} is not below the vocabulary size")


def test_the_bundle_server_answers_a_nul_byte_in_a_path_with_400(tmp_path: Path) -> None:
    import http.client

    from ortpipe.static_server import serve_in_thread

    (tmp_path / "index.html").write_text("<p>hi</p>")
    server, url = serve_in_thread(tmp_path)
    try:
        host, port = server.server_address[:2]
        answers = []
        for path in ("/index.html%00.png", "/index.html", "/../../etc/passwd"):
            connection = http.client.HTTPConnection(host, port, timeout=10)
            connection.request("GET", path)
            response = connection.getresponse()
            answers.append((response.status, response.read()))
            connection.close()
    finally:
        server.shutdown()
    assert answers[0][0] == 400 and b"NUL byte" in answers[0][1]  # the connection was dropped before
    assert answers[1] == (200, b"<p>hi</p>")
    assert answers[2][0] == 404


def test_nan_logits_before_a_sampled_first_token_are_an_error_naming_the_step(folder: Path) -> None:
    """A sampled (or banned) first token is selected as the fused steps select theirs: NaN logits there
    are an error naming the step and position, not a token drawn from NaN."""
    pipe = ortpipe.load(nan_model(folder), threads=1)
    for settings in ({"do_sample": True, "seed": 1}, {"suppress_tokens": [3]}):
        with pytest.raises(ortpipe.OrtpipeError) as error:
            pipe.generate(prompt_ids=PROMPT, max_new_tokens=4, **settings)
        assert str(error.value) == (f"selecting the token after step 0 failed: the model's logits are NaN or "
                                    f"infinite at position {len(PROMPT) - 1}; the model's weights or inputs "
                                    "are broken")


def test_nan_logits_on_the_kernels_path_are_an_error_not_token_zero(folder: Path) -> None:
    """The generic path (the sampler's kernel graphs: logprobs, n-gram bans, a target without fused
    sampling) drew token 0 from NaN scores; its argmax and sample kernels now mark such a row, and the
    request fails naming the step."""
    pipe = ortpipe.load(nan_model(folder), threads=1)
    pipe.model.backend.fused_sampling = False
    for settings in ({"do_sample": True, "seed": 1}, {"suppress_tokens": [3]},
                     {"do_sample": True, "logprobs": 2}, {"no_repeat_ngram_size": 2, "do_sample": True}):
        with pytest.raises(ortpipe.OrtpipeError, match="the model's logits are NaN or infinite at position"):
            pipe.generate(prompt_ids=PROMPT, max_new_tokens=4, **settings)
