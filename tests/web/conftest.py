"""Browser tests: the bundle (build/web.py) with tiny test models, served on 127.0.0.1, in Chromium.

Needs Chromium (/usr/bin/chromium, or the path in $ORTPIPE_CHROMIUM), node_modules (npm ci) and
pytest-playwright; `tests/web/setup.sh` installs all three. Without them every test here is
skipped, with the reason.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from build import graphs, web

CHROMIUM = Path(os.environ.get("ORTPIPE_CHROMIUM", "/usr/bin/chromium"))
CHROMIUM_ARGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
    "--enable-unsafe-webgpu",  # a SwiftShader WebGPU adapter: correct, and very slow
]
HERE = Path(__file__).resolve().parent

# A character-level tokenizer for the 96-token test graphs: bos and eos, three merges, 91 characters.
SPECIALS = ("<s>", "</s>")
MERGES = (("d", "e"), ("de", "f"), (" ", " "))
CHARACTERS = [chr(c) for c in range(32, 127) if chr(c) not in "`~|^"]
CHAT_TEMPLATE = ("{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<assistant>{% endif %}")


def missing_requirements() -> str | None:
    if not CHROMIUM.is_file():
        return f"{CHROMIUM} is missing (run tests/web/setup.sh)"
    for package in ("pyodide", "onnxruntime-web", "@huggingface/tokenizers", "@huggingface/jinja"):
        if not (web.NODE_MODULES / package).is_dir():
            return f"node_modules/{package} is missing (run `npm ci`, or tests/web/setup.sh)"
    if importlib.util.find_spec("pytest_playwright") is None:
        return "pytest-playwright is not installed (run tests/web/setup.sh)"
    return None


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    reason = missing_requirements()
    if reason is None:
        return
    for item in items:
        if HERE in Path(str(item.path)).parents:
            item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture(scope="session")
def browser_type_launch_args(browser_type_launch_args: dict) -> dict:
    return {**browser_type_launch_args, "executable_path": str(CHROMIUM), "args": CHROMIUM_ARGS}


def write_tokenizer(folder: Path) -> None:
    """tokenizer.json (+ tokenizer_config.json with a chat template) over the graphs' 96 ids."""
    from tokenizers import Tokenizer, decoders, models, processors

    vocab = {token: i for i, token in enumerate([*SPECIALS, *CHARACTERS, *("".join(m) for m in MERGES)])}
    assert len(vocab) == graphs.VOCAB
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=list(MERGES)))
    tokenizer.add_special_tokens(list(SPECIALS))
    tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    tokenizer.decoder = decoders.Fuse()
    tokenizer.save(str(folder / "tokenizer.json"))
    # clean_up_tokenization_spaces: tokenizers.js would clean up; the Rust tokenizers never do.
    config = {"bos_token": "<s>", "eos_token": "</s>", "chat_template": CHAT_TEMPLATE,
              "clean_up_tokenization_spaces": True}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))


def optimum_layout(folder: Path) -> Path:
    """No genai_config.json: onnx/model.onnx beside config.json and generation_config.json."""
    graphs.build_separate(folder / "onnx", seed=1)
    (folder / "config.json").write_text(json.dumps({"model_type": "tiny", "max_position_embeddings": 256}))
    generation = {"eos_token_id": graphs.EOS, "bos_token_id": graphs.BOS}
    (folder / "generation_config.json").write_text(json.dumps(generation))
    return folder


def v1_combined(folder: Path) -> Path:
    """What onnxruntime-genai's model builder writes (v1), over a GPT-2 style combined cache."""
    graphs.build_combined(folder, seed=2)
    names = {"past_names": "past_%d", "present_names": "present_%d"}
    config = {
        "model": {
            "type": "tiny_gpt", "context_length": 256,
            "eos_token_id": graphs.EOS, "bos_token_id": graphs.BOS, "pad_token_id": graphs.PAD,
            "decoder": {"filename": "model.onnx", "session_options": {"provider_options": []},
                        "inputs": {"input_ids": "input_ids", "attention_mask": "attention_mask",
                                   "position_ids": "position_ids", "past_names": names["past_names"]},
                        "outputs": {"logits": "logits", "present_names": names["present_names"]}},
        },
        "search": {"max_length": 128, "do_sample": False, "past_present_share_buffer": False},
    }
    (folder / "genai_config.json").write_text(json.dumps(config, indent=2))
    return folder


@pytest.fixture(scope="session")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The test model folders by the name they are served under (models/NAME/)."""
    root = tmp_path_factory.mktemp("web-models")
    v2 = graphs.build_separate(root / "v2", seed=0, config=True)
    write_tokenizer(v2)
    broken = root / "broken"
    broken.mkdir()
    (broken / "genai_config.json").write_text(json.dumps({"version": 2, "pipeline": {"sesions": {}}}))
    # v2 with a graph that genai_config.json names and no flow step runs: the worker's prefetch
    # (web/prefetch.js) downloads it on a guess, and the core never asks for it
    decoy = shutil.copytree(v2, root / "decoy")
    shutil.copy2(decoy / "model.onnx", decoy / "unused.onnx")
    config = json.loads((decoy / "genai_config.json").read_text())
    config["pipeline"]["sessions"]["spare"] = {"file": "unused.onnx"}
    (decoy / "genai_config.json").write_text(json.dumps(config))
    return {
        "v2": v2,
        "decoy": decoy,
        "optimum": optimum_layout(root / "optimum"),
        "v1-combined": v1_combined(root / "v1-combined"),
        "sliding": graphs.build_sliding(root / "sliding", seed=3, window=8, window_layers=(1,), config=True),
        "broken": broken,
    }


@pytest.fixture(scope="session")
def bundle(tmp_path_factory: pytest.TempPathFactory, models: dict[str, Path]) -> Path:
    return web.build(tmp_path_factory.mktemp("dist") / "web", list(models.items()))


@pytest.fixture(scope="session")
def base_url(bundle: Path) -> Iterator[str]:
    """pytest-playwright's base URL: `page.goto("/")` opens the bundle's demo page."""
    from ortpipe.static_server import serve_in_thread

    server, url = serve_in_thread(bundle)
    yield url
    server.shutdown()
    server.server_close()


@pytest.fixture(scope="session")
def isolated_url(bundle: Path) -> Iterator[str]:
    """The bundle served with COOP/COEP headers: a cross-origin isolated page, threaded wasm."""
    from ortpipe.static_server import serve_in_thread

    server, url = serve_in_thread(bundle, coop=True)
    yield url
    server.shutdown()
    server.server_close()


@pytest.fixture
def requests_seen(context) -> list[str]:  # noqa: ANN001 (pytest-playwright's BrowserContext)
    """Every URL the page and its workers request, in order."""
    urls: list[str] = []
    context.on("request", lambda request: urls.append(request.url))
    return urls


@pytest.fixture
def serve_model(bundle: Path):  # noqa: ANN201
    """Copy a model folder into the served bundle; returns its URL path."""
    def serve(name: str, folder: Path) -> str:
        shutil.copytree(folder, bundle / "models" / name, dirs_exist_ok=True)
        return f"models/{name}/"

    return serve
