"""Shared fixtures: the test models of build/hfmodels.py and build/paradigms.py, built once into build/cache/
(or $ORTPIPE_CACHE).

A cold cache takes about a minute to build the first, plus a one-off virtualenv for Optimum; the second
about a minute more, plus two virtualenvs of their own (another minute). Tests that use one of these
fixtures are marked `slow` automatically (`-m "not slow"` skips them).
"""

from __future__ import annotations

import sys
from pathlib import Path
from types import ModuleType

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repo root: `import build.hfmodels`

from build import hfmodels, paradigms  # noqa: E402

MODEL_FIXTURES = {
    "llama_hf": "llama-hf", "qwen2_hf": "qwen2-hf", "phi3_hf": "phi3-hf", "gemma_hf": "gemma2-hf",
    "gpt2_hf": "gpt2-hf",
    "llama_builder_fp32": "llama-builder-fp32", "llama_builder_int4": "llama-builder-int4",
    "qwen2_builder": "qwen2-builder-fp32", "phi3_builder": "phi3-builder-fp32",
    "gemma_builder": "gemma2-builder-fp32",
    "llama_concat": "llama-concat", "gpt2_optimum": "gpt2-optimum",
    "whisper_hf": "whisper-hf", "whisper_builder": "whisper-builder-fp32",
}
PARADIGM_FIXTURES = {
    "st_minilm": "st-minilm", "st_minilm_cls": "st-minilm-cls", "st_minilm_nonorm": "st-minilm-nonorm",
    "vits_tiny": "vits-tiny", "sd_tiny": "sd-tiny", "sdxl_tiny": "sdxl-tiny", "sd3_tiny": "sd3-tiny",
    "lcm_tiny": "lcm-tiny",
}


@pytest.hookimpl(tryfirst=True)  # before -m selects on the markers
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        built = MODEL_FIXTURES.keys() | PARADIGM_FIXTURES.keys() | {"llama_variants"}
        if built & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)


def _model_fixture(fixture_name: str, model: str, builder: ModuleType = hfmodels):
    def fixture() -> Path:
        return builder.get(model)

    fixture.__doc__ = f"The folder of the {model!r} test model ({builder.__name__.replace('.', '/')}.py)."
    return pytest.fixture(fixture, scope="session", name=fixture_name)


for _fixture_name, _model in MODEL_FIXTURES.items():
    globals()[_fixture_name] = _model_fixture(_fixture_name, _model)
for _fixture_name, _model in PARADIGM_FIXTURES.items():
    globals()[_fixture_name] = _model_fixture(_fixture_name, _model, paradigms)


@pytest.fixture(scope="session")
def llama_variants(llama_builder_fp32: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The fp32 builder Llama with its variants beside it (build/variants.py): model_quantized.onnx
    (q8), model_q4.onnx (accuracy level 0), model_fp16.onnx and model_q4f16.onnx."""
    import shutil

    from build.variants import write_variants

    folder = shutil.copytree(llama_builder_fp32, tmp_path_factory.mktemp("variants") / "llama")
    write_variants(folder / "model.onnx", ["q8", "q4", "fp16", "q4f16"])
    return folder


@pytest.fixture(scope="session")
def optimized_q8(llama_variants: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """llama_variants with its q8 graph optimized ahead for CPUs (build/variants.py optimize_ahead)."""
    import shutil

    from build.variants import optimize_ahead

    folder = shutil.copytree(llama_variants, tmp_path_factory.mktemp("ahead") / "llama")
    optimize_ahead(folder / "model_quantized.onnx", folder / "model_quantized.onnx")
    return folder


@pytest.fixture(scope="session")
def vits_tjs(vits_tiny: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """vits-tiny in transformers.js's layout (build/tjs_layout.py): its converted tokenizer.json, no
    vocab.json; the references stay in vits-tiny."""
    from build import tjs_layout

    return tjs_layout.vits(vits_tiny, tmp_path_factory.mktemp("tjs") / "vits-tjs")


@pytest.fixture(scope="session")
def st_tjs(st_minilm_nonorm: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """st-minilm-nonorm's graph and tokenizer in transformers.js's feature-extraction layout (no
    modules.json, no pooling modules); the references (mean pooling, not normalised) stay in
    st-minilm-nonorm."""
    from build import tjs_layout

    return tjs_layout.feature_extraction(st_minilm_nonorm, tmp_path_factory.mktemp("tjs") / "st-tjs")
