"""Speculative decoding in Chromium: the JS Speculator (web/speculate.js) drafts and checks inside the
worker's bursts; greedy results are CPython's plain greedy tokens, and seeded speculative sampling
(the JS Speculator's rounds, drawn by web/sampling.js as CPython's driver draws them with numpy)
gives CPython's plain sampled tokens."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from build import draft_models, graphs
from build.references import prompt_ids
from conftest import write_tokenizer  # tests/web/ has no __init__.py: pytest puts it on sys.path
from test_browser import assert_same_origin

import ortpipe

NEW = 32
TIE = 0.5  # log-probability: q8's noise between targets (below)


# Runs in the page: load a model, run each request in turn (streamed), return what came back.
RUN_ALL = """async ({model, device, requests}) => {
  const {load} = await import('./ortpipe.js');
  const pipe = await load(model, {device});
  try {
    const runs = [];
    for (const options of requests) {
      const chunks = [];
      const stream = pipe.stream(options);
      for (let step = await stream.next(); ; step = await stream.next()) {
        if (step.done) { runs.push({chunks, result: step.value}); break; }
        chunks.push(step.value.token);
      }
    }
    return {info: pipe.info, runs};
  } finally {
    pipe.dispose();
  }
}"""


def run_all(page: Any, model: str, device: str, requests: list[dict[str, Any]]) -> dict[str, Any]:
    page.goto("/")
    return page.evaluate(RUN_ALL, {"model": f"models/{model}/", "device": device, "requests": requests})


def looping(folder: Path) -> list[int]:
    """A prompt after which the tiny test model repeats itself (tests/test_speculative.py)."""
    ids = prompt_ids(folder)
    return ids + ids[:20]


@pytest.fixture(scope="module")
def graph_draft(models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A draft for the 96-token test graphs: another graph (another seed), the same tokenizer."""
    folder = graphs.build_separate(tmp_path_factory.mktemp("graph-draft") / "draft", seed=7, config=True)
    write_tokenizer(folder)
    return folder


@pytest.mark.parametrize("model", ["v2", "optimum", "v1-combined"])
def test_wasm_graph_models_with_prompt_lookup_and_a_draft(page: Any, requests_seen: list[str],
                                                         models: dict[str, Path], serve_model: Any,
                                                         graph_draft: Path, model: str) -> None:
    prompt = [5, 17, 42, 8, 23, 61, 30, 12, 77, 40, 9, 55, 33] * 3
    pipe = ortpipe.load(models[model])
    expected = pipe.generate(prompt_ids=prompt, max_new_tokens=NEW).tokens
    serve_model("graph-draft", graph_draft)
    requests = [{"promptIds": prompt, "maxNewTokens": NEW, "promptLookupNumTokens": 4}]
    if model == "v2":  # the others have no tokenizer.json to check a draft model's against
        requests += [{"promptIds": prompt, "maxNewTokens": NEW, "draftModel": "models/graph-draft"},
                     {"promptIds": prompt, "maxNewTokens": NEW, "draftModel": f"models/{model}/"}]
    got = run_all(page, model, "wasm", requests)
    for run in got["runs"]:
        assert run["result"]["tokens"] == expected and run["chunks"] == expected
        assert run["result"]["timings"]["fusedSteps"] == NEW - 1
        assert run["result"]["timings"]["draftedTokens"] > 0
    if model == "v2":
        itself = got["runs"][2]["result"]["timings"]
        assert itself["acceptedTokens"] == itself["draftedTokens"], "the model as its own draft"
    assert_same_origin(requests_seen, page)


@pytest.mark.parametrize("ort_device", ["wasm", "webgpu"])
def test_builder_and_concat_exports_with_speculation_equal_cpython(
        page: Any, requests_seen: list[str], serve_model: Any, llama_builder_fp32: Path, llama_concat: Path,
        ort_device: str) -> None:
    """The model builder's shared buffer and Optimum's concat cache (narrowed by a kernel on the GPU);
    prompt lookup, and a draft model (the one-layer cut, and the model itself)."""
    new = NEW if ort_device == "wasm" else 6  # SwiftShader's WebGPU is slow
    draft = draft_models.get("llama-draft-builder")
    serve_model("llama-draft", draft)
    for name, folder in (("llama-builder", llama_builder_fp32), ("llama-concat", llama_concat)):
        # on SwiftShader's WebGPU the builder's attention drifts from CPython's past some 30 positions,
        # speculation or not: a short prompt there
        ids = looping(folder) if ort_device == "wasm" else prompt_ids(folder)[:10] * 2
        expected = ortpipe.load(folder, threads=1).generate(prompt_ids=ids, max_new_tokens=new).tokens
        serve_model(name, folder)
        requests = [{"promptIds": ids, "maxNewTokens": new, "ngramSize": 3, "maxDraftTokens": 8},
                    {"promptIds": ids, "maxNewTokens": new, "draftModel": "models/llama-draft/"},
                    {"promptIds": ids, "maxNewTokens": new, "draftModel": f"models/{name}/"}]
        got = run_all(page, name, ort_device, requests)
        assert got["info"]["device"] == ort_device
        for run in got["runs"]:
            assert run["result"]["tokens"] == expected, (name, run["result"]["timings"])
            assert run["result"]["timings"]["draftedTokens"] > 0
        itself = got["runs"][2]["result"]["timings"]
        assert itself["acceptedTokens"] == itself["draftedTokens"], "the model as its own draft"
        if ort_device == "wasm":
            assert got["runs"][0]["result"]["timings"]["acceptedTokens"] > 0
    assert_same_origin(requests_seen, page)


@pytest.mark.parametrize("ort_device", ["wasm", "webgpu"])
def test_demo_model_with_speculation_equals_cpython(page: Any, serve_model: Any, ort_device: str) -> None:
    demo = Path(__file__).resolve().parent.parent.parent / "models" / "demo"
    prompt = "def insort(a, x):\n    lo, hi = 0, len(a)\n    while lo < hi:\n"
    new = NEW if ort_device == "wasm" else 5  # SwiftShader's WebGPU is slow
    serve_model("demo", demo)
    serve_model("demo-draft", draft_models.get("demo-draft-builder"))
    greedy = {"prompt": prompt, "maxNewTokens": new, "doSample": False}
    got = run_all(page, "demo", ort_device, [greedy, {**greedy, "promptLookupNumTokens": 4},
                                             {**greedy, "draftModel": "models/demo-draft/"}])
    assert got["info"]["device"] == ort_device
    assert got["runs"][0]["result"]["timings"]["draftedTokens"] == 0
    for run in got["runs"][1:]:
        assert run["result"]["timings"]["draftedTokens"] > 0
    # Every run gives CPython's tokens on the variant the browser chose for this device (q8 on wasm),
    # up to a near tie. q8 quantizes activations per run: a check of several drafted tokens rounds
    # them differently from one token at a time; and its one-token steps differ between this CPU's
    # kernels and wasm's (by up to 0.26 in a logit over 30 steps of this prompt; a prefill's logits
    # are the same). Where CPython's two best tokens are within TIE, a run may take the other one,
    # and the rest follows from it.
    pipe = ortpipe.load(demo, threads=1, dtype=got["info"]["dtypes"]["decoder"])
    chunks = list(pipe.stream(prompt, max_new_tokens=new, do_sample=False, logprobs=2))
    expected = [c.token for c in chunks]
    for run in got["runs"]:
        tokens = run["result"]["tokens"]
        apart = next((i for i, (a, b) in enumerate(zip(tokens, expected, strict=False)) if a != b), None)
        if apart is None:
            assert tokens == expected and run["result"]["text"] == "".join(c.text for c in chunks)
        else:
            top = dict(chunks[apart].top_logprobs)
            assert tokens[apart] in top, (apart, tokens, expected)
            assert top[expected[apart]] - top[tokens[apart]] < TIE, (apart, top)


PENALTIES = {"frequency_penalty": 0.1, "presence_penalty": 0.05}


def test_seeded_speculative_sampling_and_stop_strings_equal_cpython(page: Any, serve_model: Any,
                                                                    llama_builder_fp32: Path) -> None:
    """Speculative sampling runs in the JS Speculator's bursts (the draws of web/sampling.js, with the
    uniforms of their positions from the seeded generator): plain sampling's tokens, as CPython's
    driver gives them. The model as its own draft model draws what it draws, so its drafts are
    taken. A stop string inside an accepted run is cut there."""
    ids = looping(llama_builder_fp32)
    pipe = ortpipe.load(llama_builder_fp32, threads=1)
    sampled = {"do_sample": True, "seed": 3, "temperature": 0.7, "top_k": 8}
    # nearly greedy for prompt lookup, so that its proposals are taken often enough to be drafted
    cold = {**sampled, "temperature": 0.05}
    expected = [pipe.generate(prompt_ids=ids, max_new_tokens=NEW, **cold, prompt_lookup_num_tokens=4),
                pipe.generate(prompt_ids=ids, max_new_tokens=NEW, **sampled, repetition_penalty=1.2,
                              draft_model=str(llama_builder_fp32)),
                pipe.generate(prompt_ids=ids, max_new_tokens=NEW, **cold, **PENALTIES,
                              prompt_lookup_num_tokens=4)]
    # (the third's drafts are not asserted: its penalties make lookup pay less, and whether a round drafts
    # follows each target's clock; the driver's rounds with penalties: tests/test_speculative.py)
    assert all(r.timings.accepted_tokens > 0 for r in expected[:2])
    assert all(r.timings.fused_steps == NEW - 1 for r in expected)
    plain = pipe.generate(prompt_ids=ids, max_new_tokens=NEW)
    stop = plain.text[20:23]
    stopped = pipe.generate(prompt_ids=ids, max_new_tokens=NEW, stop=stop)
    assert stopped.finish_reason == "stop"
    serve_model("llama-builder", llama_builder_fp32)
    js = {"doSample": True, "seed": 3, "temperature": 0.7, "topK": 8}
    got = run_all(page, "llama-builder", "wasm", [
        {"promptIds": ids, "maxNewTokens": NEW, **js, "temperature": 0.05, "promptLookupNumTokens": 4},
        {"promptIds": ids, "maxNewTokens": NEW, **js, "repetitionPenalty": 1.2,
         "draftModel": "models/llama-builder/"},
        {"promptIds": ids, "maxNewTokens": NEW, "stop": stop, "promptLookupNumTokens": 8},
        {"promptIds": ids, "maxNewTokens": NEW, **js, "temperature": 0.05, "frequencyPenalty": 0.1,
         "presencePenalty": 0.05, "promptLookupNumTokens": 4},
    ])
    assert [r["result"]["tokens"] for r in got["runs"][:2] + got["runs"][3:]] == [r.tokens for r in expected]
    # the penalties over the generated tokens and the drafts before each checked position
    assert expected[2].tokens == pipe.generate(prompt_ids=ids, max_new_tokens=NEW, **cold, **PENALTIES).tokens
    assert expected[2].tokens != expected[0].tokens
    # plain sampling's tokens, whatever was drafted (the draft lengths follow each target's clock)
    assert expected[0].tokens == pipe.generate(prompt_ids=ids, max_new_tokens=NEW, **cold).tokens
    assert expected[1].tokens == pipe.generate(prompt_ids=ids, max_new_tokens=NEW, **sampled,
                                               repetition_penalty=1.2).tokens
    for run in got["runs"][:2] + got["runs"][3:]:
        timings = run["result"]["timings"]
        assert timings["fusedSteps"] == NEW - 1
        assert timings["draftedTokens"] > 0 or run is got["runs"][3]
    last = got["runs"][2]["result"]
    assert (last["tokens"], last["text"], last["finishReason"]) == (stopped.tokens, stopped.text, "stop")


def test_a_draft_model_with_another_tokenizer_is_refused(page: Any, serve_model: Any,
                                                         llama_builder_fp32: Path) -> None:
    serve_model("llama-builder", llama_builder_fp32)
    serve_model("demo-draft", draft_models.get("demo-draft-builder"))
    page.goto("/")
    error = page.evaluate("""async ({model, options}) => {
      const {load} = await import('./ortpipe.js');
      const pipe = await load(model, {device: 'wasm'});
      try { await pipe.generate(options); return null; }
      catch (e) { return {name: e.name, message: e.message}; }
      finally { pipe.dispose(); }
    }""", {"model": "models/llama-builder/",
           "options": {"promptIds": [5, 6, 7], "maxNewTokens": 4, "draftModel": "models/demo-draft/"}})
    assert error["name"] == "GenerationError"
    assert "must have the model's tokenizer" in error["message"]
