"""Multi-session pipelines (build/pipeline_graphs.py) against hand-written onnxruntime loops
(tests/pipeline_refs.py), following docs/pipelines.md.

First the references themselves: their cached loop equals a no-cache recomputation, and the graphs
notice the rules a runtime could get wrong (image order, mRoPE, crops, repeat counters). Then ortpipe:
its tokens equal the references', and its trace shows the sessions ran when the contract says.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from build import pipeline_graphs as pg

import ortpipe
from tests.pipeline_refs import (
    MROPE_RULES,
    phi3v_reference,
    pixtral_reference,
    qwen25vl_reference,
    reference_tokens,
    talker_reference,
)

NEW = 12
KINDS = tuple(pg.BUILDERS)
TEXT_ONLY = {"phi3v": "pixel_values", "qwen25vl": "pixel_values", "pixtral": "pixel_values",
             "speech": "input_features"}  # kinds whose encoder is optional -> the input it needs
TEXT_PROMPT = [5, 17, 42, 8, 23, 61, 3]
Folders = Callable[[str], Path]


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Folders:
    """kind -> its folder, built once per module (seed 0)."""
    built: dict[str, Path] = {}

    def get(kind: str) -> Path:
        if kind not in built:
            built[kind] = pg.BUILDERS[kind][0](tmp_path_factory.mktemp(kind), 0)
        return built[kind]

    return get


def request(kind: str) -> pg.Request:
    return pg.BUILDERS[kind][1](0)


def text_only(kind: str) -> pg.Request:
    return pg.Request(TEXT_PROMPT, {})


def trace_events(path: Path) -> list[dict]:
    """Complete ("X") events of a Chrome trace, a bare list or {"traceEvents": [...]}."""
    data = json.loads(path.read_text())
    events = data["traceEvents"] if isinstance(data, dict) else data
    return [e for e in events if e.get("ph") == "X"]


def spans(events: list[dict], name: str) -> list[tuple[float, float]]:
    return sorted((e["ts"], e["ts"] + e["dur"]) for e in events if e["name"] == name)


# (a) the references


@pytest.mark.parametrize("kind", KINDS)
def test_reference_cache_equals_recomputation(kind: str, folder: Folders) -> None:
    r = request(kind)
    cached = reference_tokens(folder(kind), r.prompt_ids, r.inputs, NEW)
    assert len(cached) == NEW
    assert cached == reference_tokens(folder(kind), r.prompt_ids, r.inputs, NEW, cache=False)


@pytest.mark.parametrize("kind", TEXT_ONLY)
def test_reference_text_only_cache_equals_recomputation(kind: str, folder: Folders) -> None:
    r = text_only(kind)
    cached = reference_tokens(folder(kind), r.prompt_ids, r.inputs, NEW)
    assert cached == reference_tokens(folder(kind), r.prompt_ids, r.inputs, NEW, cache=False)


@pytest.mark.parametrize("kind", KINDS)
def test_reference_depends_on_the_request_data(kind: str, folder: Folders) -> None:
    """Other pixels / audio (or, for the text-only talker, another prompt) give other tokens."""
    r = request(kind)
    rng = np.random.RandomState(7)
    other = {name: rng.standard_normal(a.shape).astype(a.dtype) if a.dtype == np.float32 else a
             for name, a in r.inputs.items()}
    prompt = r.prompt_ids if other else [*r.prompt_ids[:-1], 77]
    assert reference_tokens(folder(kind), prompt, other, NEW) != reference_tokens(folder(kind), r.prompt_ids,
                                                                                  r.inputs, NEW)


def test_reference_phi3v_image_order_matters(folder: Folders) -> None:
    r = request("phi3v")
    swapped = {"pixel_values": np.ascontiguousarray(r.inputs["pixel_values"][::-1])}
    assert phi3v_reference(folder("phi3v"), r.prompt_ids, swapped, NEW) != phi3v_reference(
        folder("phi3v"), r.prompt_ids, r.inputs, NEW)


@pytest.mark.parametrize("rule", [rule for rule in MROPE_RULES if rule != "doc"])
def test_reference_qwen_decoder_reads_all_three_position_rows(rule: str, folder: Folders) -> None:
    r = request("qwen25vl")
    right = qwen25vl_reference(folder("qwen25vl"), r.prompt_ids, r.inputs, NEW)
    assert qwen25vl_reference(folder("qwen25vl"), r.prompt_ids, r.inputs, NEW, mrope=rule) != right


def test_reference_pixtral_padding_is_invisible_only_when_cropped(folder: Folders) -> None:
    r = request("pixtral")
    right = pixtral_reference(folder("pixtral"), r.prompt_ids, r.inputs, NEW)
    repadded = r.inputs["pixel_values"].copy()
    for i, (height, width) in enumerate(pg.PIXTRAL_SIZES):
        noise = np.random.RandomState(i).standard_normal(repadded[i].shape).astype(np.float32)
        keep = repadded[i, :, :height, :width].copy()
        repadded[i] = noise
        repadded[i, :, :height, :width] = keep
    repadded_inputs = {**r.inputs, "pixel_values": repadded}
    assert pixtral_reference(folder("pixtral"), r.prompt_ids, repadded_inputs, NEW) == right
    assert pixtral_reference(folder("pixtral"), r.prompt_ids, r.inputs, NEW, crop=False) != right


@pytest.mark.parametrize("counters", [(0, 0, 0), (0, 1), (0, 1, 2, 2), (1, 2, 0)])
def test_reference_talker_needs_each_repeat_and_counter(counters: tuple[int, ...],
                                                        folder: Folders) -> None:
    r = request("talker")
    right = talker_reference(folder("talker"), r.prompt_ids, r.inputs, NEW)
    assert talker_reference(folder("talker"), r.prompt_ids, r.inputs, NEW, counters=counters) != right


# (b) ortpipe


@pytest.mark.parametrize("kind", KINDS)
def test_ortpipe_matches_the_reference(kind: str, folder: Folders) -> None:
    r = request(kind)
    expected = reference_tokens(folder(kind), r.prompt_ids, r.inputs, NEW)
    result = ortpipe.load(folder(kind), threads=1).generate(prompt_ids=r.prompt_ids, max_new_tokens=NEW,
                                                            inputs=dict(r.inputs))
    assert result.tokens == expected


@pytest.mark.parametrize("kind", TEXT_ONLY)
def test_ortpipe_text_only_prompt_skips_the_encoder(kind: str, folder: Folders,
                                                    tmp_path: Path) -> None:
    r = text_only(kind)
    expected = reference_tokens(folder(kind), r.prompt_ids, r.inputs, NEW)
    trace = tmp_path / "trace.json"
    result = ortpipe.load(folder(kind), threads=1).generate(prompt_ids=r.prompt_ids, max_new_tokens=NEW,
                                                            inputs={}, trace=str(trace))
    assert result.tokens == expected
    encoder = "speech" if kind == "speech" else "vision"
    assert spans(trace_events(trace), encoder) == []


def test_ortpipe_whisper_prompt_defaults_to_decoder_start(folder: Folders) -> None:
    r = request("whisper")
    expected = reference_tokens(folder("whisper"), None, r.inputs, NEW)
    result = ortpipe.load(folder("whisper"), threads=1).generate(max_new_tokens=NEW, inputs=dict(r.inputs))
    assert result.tokens == expected


def test_ortpipe_runs_init_once_and_the_embedding_every_step(folder: Folders, tmp_path: Path) -> None:
    """Vision once; embedding on the prompt, then on each new token; decoder once per token."""
    r = request("phi3v")
    trace = tmp_path / "trace.json"
    ortpipe.load(folder("phi3v"), threads=1).generate(prompt_ids=r.prompt_ids, max_new_tokens=NEW,
                                                      inputs=dict(r.inputs), trace=str(trace))
    events = trace_events(trace)
    assert [len(spans(events, name)) for name in ("vision", "embedding", "decoder")] == [1, NEW, NEW]


def test_ortpipe_whisper_encoder_runs_once(folder: Folders, tmp_path: Path) -> None:
    r = request("whisper")
    trace = tmp_path / "trace.json"
    ortpipe.load(folder("whisper"), threads=1).generate(prompt_ids=r.prompt_ids, max_new_tokens=NEW,
                                                        inputs=dict(r.inputs), trace=str(trace))
    events = trace_events(trace)
    assert [len(spans(events, name)) for name in ("encoder", "decoder")] == [1, NEW]


def test_ortpipe_per_image_vision_runs_once_per_image(folder: Folders, tmp_path: Path) -> None:
    for kind in ("qwen25vl", "pixtral"):
        r = request(kind)
        trace = tmp_path / f"{kind}.json"
        ortpipe.load(folder(kind), threads=1).generate(prompt_ids=r.prompt_ids, max_new_tokens=2,
                                                       inputs=dict(r.inputs), trace=str(trace))
        assert len(spans(trace_events(trace), "vision")) == len(r.inputs["pixel_values"])


def test_ortpipe_talker_repeats_per_step(folder: Folders, tmp_path: Path) -> None:
    r = request("talker")
    trace = tmp_path / "trace.json"
    ortpipe.load(folder("talker"), threads=1).generate(prompt_ids=r.prompt_ids, max_new_tokens=NEW,
                                                       inputs={}, trace=str(trace))
    events = trace_events(trace)
    assert [len(spans(events, name)) for name in ("decoder", "code_predictor")] == [NEW, pg.REPEAT * NEW]


def test_ortpipe_two_encoders_run_side_by_side(folder: Folders, tmp_path: Path) -> None:
    """The two encoders do not depend on each other: the core asks for them in one RunAll, which the
    CPython driver runs on its thread pool (whether the runs overlap in time is the machine's call)."""
    from ortpipe.execute.work import RunAll

    r = request("two_encoders")
    pipe = ortpipe.load(folder("two_encoders"))
    asked: list[object] = []
    execute = pipe.driver.execute
    pipe.driver.execute = lambda work: (asked.append(work), execute(work))[1]
    result = pipe.generate(prompt_ids=r.prompt_ids, max_new_tokens=NEW, inputs=dict(r.inputs))
    assert result.tokens == reference_tokens(folder("two_encoders"), r.prompt_ids, r.inputs, NEW)
    together = [sorted(run.session for run in work.runs) for work in asked if isinstance(work, RunAll)]
    assert together == [["speech", "vision"]]



def test_qwen_flat_patches_are_split_by_the_grid(tmp_path: Path) -> None:
    """Qwen2-VL preprocessing puts every image's patches in one [sum of t*h*w, dim] tensor: a vision
    graph reading that layout, looped per image, gives the tokens of the [n, patches, dim] layout."""
    import onnx
    from onnx import compose, helper

    folder = pg.qwen25vl_style(tmp_path / "qwen", seed=0)
    request = pg.qwen25vl_inputs(0)
    expected = ortpipe.load(folder, threads=1).generate(prompt_ids=request.prompt_ids, max_new_tokens=12,
                                                        inputs=request.inputs).tokens
    vision_path = folder / "vision_encoder" / "model.onnx"
    vision = onnx.load(str(vision_path))
    dim = request.inputs["pixel_values"].shape[-1]
    unsqueeze = helper.make_model(
        helper.make_graph(
            [
                helper.make_node(
                    "Constant",
                    [],
                    ["axis"],
                    value=helper.make_tensor("axis", onnx.TensorProto.INT64, [1], [0]),
                ),
                helper.make_node("Unsqueeze", ["flat", "axis"], ["batched"]),
            ],
            "flat",
            [helper.make_tensor_value_info("flat", onnx.TensorProto.FLOAT, ["patches", dim])],
            [helper.make_tensor_value_info("batched", onnx.TensorProto.FLOAT, [1, "patches", dim])],
        ),
        opset_imports=vision.opset_import,
        ir_version=vision.ir_version,
    )
    merged = compose.merge_models(unsqueeze, vision, io_map=[("batched", "pixel_values")])
    merged.graph.input[0].name = "pixel_values"
    for node in merged.graph.node:
        node.input[:] = ["pixel_values" if i == "flat" else i for i in node.input]
    onnx.save(merged, str(vision_path))
    flat = request.inputs["pixel_values"].reshape(-1, dim)
    ours = (
        ortpipe.load(folder, threads=1)
        .generate(
            prompt_ids=request.prompt_ids, max_new_tokens=12, inputs={**request.inputs, "pixel_values": flat}
        )
        .tokens
    )
    assert ours == expected
