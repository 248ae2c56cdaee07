"""The worker's early downloads (web/prefetch.js): they guess the graphs the core will open, and
the core takes them instead of downloading again; a wrong guess changes nothing."""

from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import Any

import pytest
from test_browser import PROMPT, generate

import ortpipe
from ortpipe.detect import DECODER_FILES

ROOT = Path(__file__).resolve().parents[2]
SOURCE = ROOT / "web" / "prefetch.js"


def external_data() -> tuple[str, ...]:
    """pyodide.py's EXTERNAL_DATA (the module imports `js`, so it is read, not imported)."""
    tree = ast.parse((ROOT / "py" / "ortpipe" / "targets" / "pyodide.py").read_text())
    value = next(node.value for node in tree.body if isinstance(node, ast.Assign)
                 and any(getattr(t, "id", None) == "EXTERNAL_DATA" for t in node.targets))
    return ast.literal_eval(value)


def js_list(name: str) -> list[str]:
    body = re.search(rf"export const {name} = \[(.*?)\];", SOURCE.read_text(), re.S)
    assert body, f"{name} is not in {SOURCE}"
    return re.findall(r"'([^']*)'", body.group(1))


def test_the_guesses_follow_the_core() -> None:
    assert js_list("DECODER_FILES") == list(DECODER_FILES)  # detection's candidates, in its order
    assert js_list("EXTERNAL_DATA") == [p.format(file="") for p in external_data()]


@pytest.mark.parametrize("model, graphs", [
    ("v2", {"model.onnx": 1}),  # named by genai_config.json
    ("optimum", {"onnx/model.onnx": 1}),  # no config: detection's first candidate that exists
    ("decoy", {"model.onnx": 1, "unused.onnx": None}),  # unused.onnx: downloaded on a guess, or not
])
def test_each_graph_is_downloaded_once(page: Any, models: dict[str, Path], model: str,
                                       graphs: dict[str, int | None]) -> None:
    requests: list[tuple[str, str]] = []
    page.context.on("request", lambda r: requests.append((r.method, r.url)))
    got = generate(page, model, promptIds=PROMPT, maxNewTokens=8)
    expected = ortpipe.load(models[model]).generate(prompt_ids=PROMPT, max_new_tokens=8)
    assert got["result"]["tokens"] == expected.tokens
    for graph, count in graphs.items():
        gets = [i for i, (method, url) in enumerate(requests)
                if method == "GET" and url.endswith(f"/models/{model}/{graph}")]
        assert len(gets) == count if count is not None else len(gets) <= 1, (graph, requests)
    # the small files the core reads come from the prefetch's reads: each is asked for once
    small = [url for method, url in requests if method == "GET" and url.endswith(".json")
             and f"/models/{model}/" in url]
    assert len(small) == len(set(small)) and any(u.endswith("/tokenizer.json") for u in small), small
    heads = [url for method, url in requests if method == "HEAD"]
    assert len(heads) == len(set(heads)), "the core asked again what the prefetch had probed"
