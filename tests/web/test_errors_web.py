"""Both targets run one core (model.py): the same bad folder or request is the same error, of the
same class and with the same message (but for where the folder is), in CPython and in the browser."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import ortpipe
from ortpipe.errors import OrtpipeError

# Runs in the page: load each folder and make each request; the errors as [name, message] (null when
# it worked).
TRY_ALL = """async ({folders, requests}) => {
  const {load} = await import('./ortpipe.js');
  const seen = [];
  for (const folder of folders) {
    try { (await load(folder, {device: 'wasm'})).dispose(); seen.push(null); }
    catch (e) { seen.push([e.name, e.message]); }
  }
  for (const [folder, kind, options] of requests) {
    const pipe = await load(folder, {device: 'wasm'});
    try {
      if (kind === 'chat') await pipe.chat(options); else await pipe.generate(options);
      seen.push(null);
    } catch (e) { seen.push([e.name, e.message]); }
    pipe.dispose();
  }
  return seen;
}"""

# (what the folder gets wrong, a change to a copy of the v2 test folder)
BAD_FOLDERS = {
    "unknown key": lambda f: _config(f, lambda c: c["pipeline"].update(sesions={})),
    "missing graph": lambda f: _config(f, lambda c: c["pipeline"]["sessions"].update(
        extra={"file": "nope.onnx"})),
    "null provider": lambda f: _config(f, lambda c: c["pipeline"]["sessions"]["decoder"].update(
        execution_provider=None)),
    "template syntax": lambda f: _tokenizer_config(f, chat_template="{% for m in messages %}{{ m.content }"),
    "template type": lambda f: _tokenizer_config(f, chat_template=42),
    "not utf-8": lambda f: (f / "genai_config.json").write_bytes(b'{"version": 2, "x": "\xff"}'),
}

# (folder, "generate" or "chat", the request's options in the embed API's names)
BAD_REQUESTS = [
    ("v2", "generate", {"promptIds": [5, 6], "temperature": -1}),
    ("v2", "generate", {"promptIds": [5, 6], "temprature": 0.5}),
    ("v2", "generate", {"promptIds": [5, 200], "maxNewTokens": 4}),
    ("v2", "generate", {"promptIds": [5, 6], "doSample": "false"}),
    ("v2", "generate", {"promptIds": [5, 6], "maxNewTokens": 0}),
    ("v2", "generate", {"promptIds": [5, 6], "maxNewTokens": 4, "maxLength": 9}),
    ("v2", "generate", {"promptIds": [5, 6], "numReturnSequences": 2}),
    ("v2", "generate", {"prompt": "hi", "promptIds": [5]}),
    ("v2", "generate", {"messages": [{"role": "user"}]}),
    ("v2", "generate", {"promptIds": [5, 6], "topP": 0}),
    ("v2", "chat", {"numBeams": 0}),
    ("untemplated", "generate", {"messages": [{"role": "user", "content": "hi"}]}),
    ("optimum", "chat", {}),
    ("optimum", "generate", {"prompt": "hi"}),
]


def _config(folder: Path, change: Any) -> None:
    config = json.loads((folder / "genai_config.json").read_text())
    change(config)
    (folder / "genai_config.json").write_text(json.dumps(config))


def _tokenizer_config(folder: Path, **values: Any) -> None:
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config.update(values)
    (folder / "tokenizer_config.json").write_text(json.dumps(config))


def snake(options: dict[str, Any]) -> dict[str, Any]:
    return {"".join(f"_{c.lower()}" if c.isupper() else c for c in k): v for k, v in options.items()}


def cpython_error(folder: Path, kind: str | None = None,
                  options: dict[str, Any] | None = None) -> list[str] | None:
    try:
        pipe = ortpipe.load(folder)
        if kind == "chat":
            pipe.chat(**snake(options))
        elif kind == "generate":
            pipe.generate(**snake(options))
    except OrtpipeError as e:
        return [type(e).__name__, str(e)]
    return None


def engine_free(message: str) -> str:
    return message.split("(syntax): ")[0]


def test_the_same_mistakes_are_the_same_errors(page: Any, models: dict[str, Path], serve_model: Any,
                                               tmp_path: Path) -> None:
    served, expected = [], []
    for name, spoil in BAD_FOLDERS.items():
        folder = shutil.copytree(models["v2"], tmp_path / name.replace(" ", "-"))
        spoil(folder)
        served.append(serve_model(folder.name, folder))
        expected.append((folder, cpython_error(folder)))
    untemplated = shutil.copytree(models["v2"], tmp_path / "untemplated")
    _tokenizer_config(untemplated, chat_template=None)
    serve_model("untemplated", untemplated)
    folders = {**models, "untemplated": untemplated}
    for name, kind, options in BAD_REQUESTS:
        expected.append((folders[name], cpython_error(folders[name], kind, options)))
    page.goto("/")
    got = page.evaluate(TRY_ALL, {"folders": served, "requests": [
        [f"models/{name}/", kind, options] for name, kind, options in BAD_REQUESTS]})
    assert len(got) == len(expected)
    for (folder, want), seen in zip(expected, got, strict=True):
        assert want is not None and seen is not None, (folder, want, seen)
        assert seen[0] == want[0], (want, seen)
        # the same words, but for where the folder is (a path here, a URL there) and for what each
        # template engine says of a syntax error (jinja2 and @huggingface/jinja word it their own way)
        url = f"{page.url.rstrip('/')}/models/{folder.name}"
        assert engine_free(seen[1].replace(url, str(folder))) == engine_free(want[1]), (want, seen)


def test_a_refusing_template_is_the_same_error(page: Any, models: dict[str, Path], serve_model: Any,
                                               tmp_path: Path) -> None:
    """A template that refuses the conversation (raise_exception) is a GenerationError in both."""
    folder = shutil.copytree(models["v2"], tmp_path / "refusing")
    _tokenizer_config(folder, chat_template="{% if messages[0].role != 'system' %}{{ raise_exception('"
                                            "a system message must come first') }}{% endif %}ok")
    serve_model(folder.name, folder)
    request = ["generate", {"messages": [{"role": "user", "content": "hi"}], "maxNewTokens": 2}]
    want = cpython_error(folder, *request)
    page.goto("/")
    [seen] = page.evaluate(TRY_ALL, {"folders": [], "requests": [[f"models/{folder.name}/", *request]]})
    assert want == ["GenerationError",
                    "the chat template refused the conversation: a system message must come first"]
    assert seen == want


def test_images_for_a_text_folder_are_refused_before_they_are_fetched(page: Any, models: dict[str, Path],
                                                                       requests_seen: list[str]) -> None:
    """The worker asks the core before it decodes a request's images or mask: a folder that reads none
    refuses them as CPython does (which never opens such a path), and the image's URL is never fetched."""
    asked = {"promptIds": [5, 6], "maxNewTokens": 2}
    requests = [["v2", "generate", {**asked, "images": ["never-fetched.png"]}],
                ["v2", "generate", {**asked, "mask": "never-fetched-mask.png"}]]
    want = [cpython_error(models[name], kind, options) for name, kind, options in requests]
    page.goto("/")
    seen = page.evaluate(TRY_ALL, {"folders": [], "requests": [
        [f"models/{name}/", kind, options] for name, kind, options in requests]})
    assert want[0] is not None and want[0][0] == "GenerationError" and "pixel_values" in want[0][1], want
    assert want[1] is not None and "inpainting" in want[1][1], want
    assert seen == want
    assert not [url for url in requests_seen if "never-fetched" in url], requests_seen
