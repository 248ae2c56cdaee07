"""ortpipe in Chromium (Pyodide + onnxruntime-web) gives the tokens of ortpipe under CPython.

Each test opens the demo page of a freshly built bundle and drives the embed API (ortpipe.js) or
the page itself; every request must stay on the page's origin.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
from build import references

import ortpipe

PROMPT = [5, 17, 42, 8, 23, 61, 30, 12, 77, 40, 9, 55, 33]  # 13 ids: longer than the sliding window
NEW_TOKENS = 24

# Runs in the page: load a model, stream one generation, return what came back.
GENERATE = """async ({model, device, options}) => {
  const {load} = await import('./ortpipe.js');
  const pipe = await load(model, {device});
  try {
    const chunks = [];
    const stream = pipe.stream(options);
    for (let step = await stream.next(); ; step = await stream.next()) {
      if (step.done) return {info: pipe.info, chunks, result: step.value};
      chunks.push(step.value);
    }
  } finally {
    pipe.dispose();
  }
}"""


def generate(page: Any, model: str, device: str = "wasm", **options: Any) -> dict[str, Any]:
    page.goto("/")
    return page.evaluate(GENERATE, {"model": f"models/{model}/", "device": device, "options": options})


def assert_same_origin(urls: list[str], page: Any) -> None:
    origin = urlsplit(page.url)[:2]
    assert urls, "no request was recorded"
    strays = [u for u in urls if urlsplit(u)[:2] != origin and not u.startswith(("data:", "blob:"))]
    assert not strays, f"requests left {origin}: {strays}"


@pytest.mark.parametrize("model", ["v2", "optimum", "v1-combined", "sliding"])
def test_wasm_greedy_tokens_equal_cpython(page: Any, requests_seen: list[str], models: dict[str, Path],
                                          model: str) -> None:
    expected = ortpipe.load(models[model]).generate(prompt_ids=PROMPT, max_new_tokens=NEW_TOKENS)
    got = generate(page, model, promptIds=PROMPT, maxNewTokens=NEW_TOKENS)
    assert got["info"]["device"] == "wasm"
    assert got["result"]["tokens"] == expected.tokens
    assert [c["token"] for c in got["chunks"]] == expected.tokens
    assert got["result"]["finishReason"] == expected.finish_reason
    # plain greedy: every step after the prefill ran fused in JS, except over a windowed concat cache
    fused = 0 if model == "sliding" else len(expected.tokens) - 1
    assert got["result"]["timings"]["fusedSteps"] == fused
    assert_same_origin(requests_seen, page)


# An n-gram ban longer than any sequence here bans nothing, and fused steps do not apply it: the
# request runs the generic path, the sampler's kernel graphs step by step.
GENERIC = {"noRepeatNgramSize": 10_000}
SAMPLED = {"doSample": True, "seed": 4, "temperature": 1.5, "topK": 50}


def test_webgpu_greedy_and_seeded_sampling_equal_cpython(page: Any, requests_seen: list[str],
                                                         models: dict[str, Path]) -> None:
    """Greedy and seeded sampling, fused (the cache on the GPU, the logits read back), and sampling
    by the generic path (the kernel graphs on WebGPU) in one page, a few tokens each: SwiftShader's
    WebGPU is slow."""
    pipe = ortpipe.load(models["v2"])
    sampled = {"do_sample": True, "seed": 4, "temperature": 1.5, "top_k": 50}
    expected = [pipe.generate(prompt_ids=PROMPT, max_new_tokens=4).tokens,
                pipe.generate(prompt_ids=PROMPT, max_new_tokens=4, **sampled).tokens]
    assert expected[0] != expected[1]
    expected.append(expected[1])
    page.goto("/")
    got = page.evaluate("""async (requests) => {
      const {load} = await import('./ortpipe.js');
      const pipe = await load('models/v2/', {device: 'webgpu'});
      const results = [];
      for (const r of requests) results.push(await pipe.generate(r));
      const info = pipe.info;
      pipe.dispose();
      return {info, results};
    }""", [{"promptIds": PROMPT, "maxNewTokens": 4}, {"promptIds": PROMPT, "maxNewTokens": 4, **SAMPLED},
           {"promptIds": PROMPT, "maxNewTokens": 4, **SAMPLED, **GENERIC}])
    assert got["info"]["device"] == "webgpu"
    assert [r["tokens"] for r in got["results"]] == expected
    assert [r["timings"]["fusedSteps"] for r in got["results"]] == [3, 3, 0]
    assert_same_origin(requests_seen, page)


def test_python_starts_from_the_snapshot_and_unseeded_sampling_differs_between_page_loads(
        page: Any, requests_seen: list[str]) -> None:
    """The worker restores Python from the bundle's memory snapshot, which is the same bytes on
    every page load: randomness must still come fresh from each page, not from the build."""
    options = {"promptIds": PROMPT, "maxNewTokens": 16, "doSample": True, "temperature": 1.5}
    first = generate(page, "v2", **options)["result"]["tokens"]
    second = generate(page, "v2", **options)["result"]["tokens"]
    assert len(first) == len(second) == 16
    assert first != second
    snapshots = [u for u in requests_seen if u.endswith("/pyodide/python-snapshot.bin")]
    assert len(snapshots) >= 1, "the worker did not fetch the Python snapshot"
    assert_same_origin(requests_seen, page)


def test_threaded_wasm_on_an_isolated_page_equals_cpython(page: Any, isolated_url: str,
                                                         models: dict[str, Path]) -> None:
    expected = ortpipe.load(models["v2"]).generate(prompt_ids=PROMPT, max_new_tokens=NEW_TOKENS).tokens
    page.goto(isolated_url)
    assert page.evaluate("crossOriginIsolated")
    got = page.evaluate(GENERATE, {"model": "models/v2/", "device": "wasm",
                                   "options": {"promptIds": PROMPT, "maxNewTokens": NEW_TOKENS}})
    assert got["result"]["tokens"] == expected


SETTINGS = [  # as the JS API names them
    {"doSample": True, "seed": 7, "temperature": 0.8, "topK": 20, "topP": 0.9},
    {"repetitionPenalty": 1.3, "noRepeatNgramSize": 2},
    {"numBeams": 3},
]


def snake_case(settings: dict[str, Any]) -> dict[str, Any]:
    return {re.sub(r"[A-Z]", lambda m: "_" + m.group().lower(), k): v for k, v in settings.items()}


def test_sampling_penalties_and_beams_equal_cpython(page: Any, models: dict[str, Path]) -> None:
    """Seeded sampling, logits processors and beam search: the kernel graphs in onnxruntime-web."""
    pipe = ortpipe.load(models["v2"])
    expected = [pipe.generate(prompt_ids=PROMPT, max_new_tokens=12, **snake_case(s)).tokens for s in SETTINGS]
    page.goto("/")
    got = page.evaluate("""async (settings) => {
      const {load} = await import('./ortpipe.js');
      const pipe = await load('models/v2/', {device: 'wasm'});
      const tokens = [];
      for (const s of settings) tokens.push((await pipe.generate(s)).tokens);
      pipe.dispose();
      return tokens;
    }""", [{"promptIds": PROMPT, "maxNewTokens": 12, **s} for s in SETTINGS])
    assert got == expected


def test_text_prompt_streams_the_text_of_cpython(page: Any, models: dict[str, Path]) -> None:
    pipe = ortpipe.load(models["v2"])
    expected = pipe.generate("x = 1", max_new_tokens=48)
    assert " ," in expected.text  # what tokenizers.js's clean-up would rewrite, and Rust's never does
    got = generate(page, "v2", prompt="x = 1", maxNewTokens=48)
    assert got["result"]["tokens"] == expected.tokens
    assert got["result"]["text"] == expected.text
    # token by token: the browser's text stream (bridge.js's twin, in bursts) against the core's
    assert [c["text"] for c in got["chunks"]] == [c.text for c in pipe.stream("x = 1", max_new_tokens=48)]
    assert got["result"]["timings"]["promptTokens"] == expected.timings.prompt_tokens


def test_chat_messages_render_like_jinja2(page: Any, models: dict[str, Path]) -> None:
    messages = [{"role": "user", "content": "Write def fib(n):"}]
    expected = ortpipe.load(models["v2"]).generate(messages=messages, max_new_tokens=8)  # rendered by jinja2
    got = generate(page, "v2", messages=messages, maxNewTokens=8)
    assert got["result"]["tokens"] == expected.tokens


def test_interrupt_stops_a_stream_and_what_is_queued(page: Any) -> None:
    page.goto("/")
    result = page.evaluate("""async () => {
      const {load} = await import('./ortpipe.js');
      const pipe = await load('models/v2/', {device: 'wasm'});
      // within the graph's 256 positions; a stop string that never comes makes every decode step its
      // own crossing into Python (no bursts), so the interrupt lands after a few tokens
      const options = {promptIds: [5, 17, 42], maxNewTokens: 250, stop: ['@@never@@']};
      const running = [];
      for await (const chunk of pipe.stream(options)) {
        running.push(chunk.token);
        if (running.length === 3) pipe.interrupt();
      }
      const queued = pipe.generate(options);  // asked for before the interrupt: never runs
      pipe.interrupt();
      let left = 0;
      for await (const chunk of pipe.stream(options)) if (++left === 2) break;  // interrupts it
      const after = await pipe.generate({...options, maxNewTokens: 5});
      const results = {running: running.length, queued: await queued, left, after};
      pipe.dispose();
      return results;
    }""")
    assert 3 <= result["running"] < 250

    assert result["queued"]["finishReason"] == "interrupt" and result["queued"]["tokens"] == []
    assert result["left"] == 2
    assert result["after"]["finishReason"] == "length" and len(result["after"]["tokens"]) == 5


def test_config_errors_reach_the_page_as_messages(page: Any) -> None:
    page.goto("/")
    error = page.evaluate("""async () => {
      const {load} = await import('./ortpipe.js');
      try {
        await load('models/broken/', {device: 'wasm'});
      } catch (e) {
        return {name: e.name, message: e.message};
      }
    }""")
    assert error["name"] == "ConfigError"
    assert 'Unknown key "sesions"' in error["message"] and 'Did you mean "sessions"?' in error["message"]
    assert "Traceback" not in error["message"]


@pytest.mark.parametrize("typing", [False, True])
def test_the_demo_page_fills_its_model_field_only_when_nobody_types_in_it(page: Any, typing: bool) -> None:
    """The page's start fills an empty model field with the first bundled model when its list arrives, but
    not while the field has the focus: a value set between a typist's select-all and their text had the text
    appended to it ("models/v2/models/vits-tiny/", seen once in CI from Playwright's fill)."""
    held: list[Any] = []
    page.route("**/models/index.json", lambda route: held.append(route))
    page.goto("/")
    for _ in range(200):  # the list is asked for once the page's start has begun
        if held:
            break
        page.wait_for_timeout(25)
    assert held, "the page did not ask for models/index.json"
    if typing:
        page.focus("#model-url")
    held[0].continue_()
    page.wait_for_function("() => document.querySelectorAll('#models option').length > 0")
    value = page.input_value("#model-url")
    assert value == ("" if typing else page.eval_on_selector("#models option", "(o) => o.value"))


def test_demo_page_streams_a_generation(page: Any, requests_seen: list[str], models: dict[str, Path]) -> None:
    expected = ortpipe.load(models["v2"]).generate(prompt_ids=PROMPT, max_new_tokens=NEW_TOKENS).tokens
    page.goto("/")
    page.fill("#model-url", "models/v2/")
    page.select_option("#device", "wasm")
    page.check("#prompt-is-ids")
    page.fill("#prompt", ", ".join(map(str, PROMPT)))
    page.fill("#max-new-tokens", str(NEW_TOKENS))
    page.click("#generate")
    page.wait_for_selector("#output[data-tokens]", timeout=120_000)
    assert page.get_attribute("#output", "data-tokens") == ",".join(map(str, expected))
    assert page.text_content("#error") == ""
    assert "tok/s" in page.text_content("#stat-speed")
    assert_same_origin(requests_seen, page)


@pytest.mark.parametrize("ort_device, new_tokens", [("wasm", 24), ("webgpu", 3)])
def test_builder_export_with_shared_buffer_cache_equals_onnxruntime_genai(
        page: Any, requests_seen: list[str], serve_model: Any, llama_builder_fp32: Path, ort_device: str,
        new_tokens: int) -> None:
    """onnxruntime-genai's model builder: v1 config, GroupQueryAttention over a shared past/present
    buffer, weights in model.onnx.data, a byte-level BPE tokenizer (tokenizers.js against Rust)."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(llama_builder_fp32 / "tokenizer.json"))
    prompt = "def count_words(path):\n    counts = {}\n"
    expected = references.genai_greedy(llama_builder_fp32, tokenizer.encode(prompt).ids, new_tokens)
    serve_model("llama-builder", llama_builder_fp32)
    got = generate(page, "llama-builder", ort_device, prompt=prompt, maxNewTokens=new_tokens)
    assert got["info"]["device"] == ort_device
    assert got["result"]["tokens"] == expected
    assert got["result"]["text"] == tokenizer.decode(expected)
    assert got["result"]["timings"]["fusedSteps"] == new_tokens - 1  # the JS Decoder, on either device
    assert_same_origin(requests_seen, page)


@pytest.mark.parametrize(("ort_device", "settings"), [
    ("wasm", {"doSample": True, "seed": 5, "temperature": 1.2, "topK": 40, "topP": 0.95}),
    ("wasm", {"doSample": True, "seed": 6, "temperature": 0.8, "topP": 0.7, "minP": 0.02,
              "repetitionPenalty": 1.3}),
    ("wasm", {"repetitionPenalty": 1.6, "suppressTokens": [11, 12]}),
    ("wasm", {"frequencyPenalty": 1.5, "presencePenalty": -0.5, "logitBias": {"11": 3.5, "40": -100}}),
    ("wasm", {"doSample": True, "seed": 7, "temperature": 0.9, "topK": 40, "frequencyPenalty": 0.8,
              "presencePenalty": 0.5}),
    ("webgpu", {"doSample": True, "seed": 6, "temperature": 0.8, "topP": 0.7, "minP": 0.02,
                "repetitionPenalty": 1.3}),
])
def test_builder_export_fused_sampling_equals_the_generic_path(
    page: Any, serve_model: Any, llama_builder_fp32: Path, ort_device: str, settings: dict
) -> None:
    """Sampled (and penalised) decode steps over a shared-buffer cache: fused in the JS Decoder
    (web/sampling.js), and by the generic path's kernel graphs; seeded, both give the same tokens
    (on wasm, CPython's)."""

    ids = references.prompt_ids(llama_builder_fp32)
    n = 24 if ort_device == "wasm" else 6  # SwiftShader's WebGPU is slow
    pipe = ortpipe.load(llama_builder_fp32, threads=1)
    snake = {re.sub("([A-Z])", lambda m: "_" + m[1].lower(), k): v for k, v in settings.items()}
    expected = pipe.generate(prompt_ids=ids, max_new_tokens=n, **snake).tokens
    assert expected != pipe.generate(prompt_ids=ids, max_new_tokens=n).tokens
    pipe.model.backend.fused_sampling = False
    assert expected == pipe.generate(prompt_ids=ids, max_new_tokens=n, **snake).tokens
    url = serve_model("llama-builder", llama_builder_fp32)
    page.goto("/")
    got = page.evaluate("""async ({url, device, requests}) => {
      const {load} = await import('./ortpipe.js');
      const pipe = await load(url, {device});
      const results = [];
      for (const r of requests) results.push({...(await pipe.generate(r)), device: pipe.info.device});
      pipe.dispose();
      return results;
    }""", {"url": url, "device": ort_device,
           "requests": [{"promptIds": ids, "maxNewTokens": n, **settings},
                        {"promptIds": ids, "maxNewTokens": n, **settings, **GENERIC}]})
    assert [r["device"] for r in got] == [ort_device, ort_device]
    # Fused and generic select alike on the device. On wasm the logits are CPython's to the bit; WebGPU's
    # kernels compute them in another order, and the near-uniform distributions of random weights
    # then rank tokens differently, so there the tokens are compared between the two paths only.
    assert got[0]["tokens"] == got[1]["tokens"]
    if ort_device == "wasm":
        assert got[0]["tokens"] == expected
    else:
        assert got[0]["tokens"] != pipe.generate(prompt_ids=ids, max_new_tokens=n).tokens  # it sampled
    assert [r["timings"]["fusedSteps"] for r in got] == [n - 1, 0]


CHAT = """async ({model, device, turns, reply}) => {
  const {load} = await import('./ortpipe.js');
  const pipe = await load(model, {device});
  const seen = (r) => ({tokens: r.tokens, prompt: r.timings.promptTokens, fused: r.timings.fusedSteps});
  try {
    const chat = await pipe.chat({maxLength: 200});
    const replies = [];
    for (const turn of turns.slice(0, 2)) {
      replies.push(seen(await chat.say(turn, {maxNewTokens: reply})));
    }
    const afterRewind = await chat.rewind();
    const streamed = [];
    for await (const chunk of chat.stream(turns[1], {maxNewTokens: reply})) streamed.push(chunk.token);
    replies.push(seen(await chat.say(turns[2], {maxNewTokens: reply})));
    const failures = [];
    for (const bad of [() => chat.say('x', {temperature: 2}), () => chat.say(7)]) {
      try { await bad(); } catch (e) { failures.push(`${e.name}: ${e.message}`); }
    }
    chat.dispose();
    try { await chat.say('x'); } catch (e) { failures.push(e.message); }
    return {replies, afterRewind, streamed, failures};
  } finally {
    pipe.dispose();
  }
}"""


CHAT_TURNS = {
    "v2": ["def f(a):", "def g(b):", "def h(c):"],
    "llama-chat": ["def count_words(path):", "Now sort the words by count.", "And print the top ten?"],
}
LLAMA_CHAT_TEMPLATE = ("{% for m in messages %}<s>{{ m['role'] }}\n{{ m['content'] }}</s>\n{% endfor %}"
                       "{% if add_generation_prompt %}<s>assistant\n{% endif %}")


@pytest.mark.parametrize("model, ort_device",
                         [("v2", "wasm"), ("llama-chat", "wasm"), ("llama-chat", "webgpu")])
def test_chat_turns_rewind_and_stream_equal_cpython(
        page: Any, requests_seen: list[str], models: dict[str, Path], serve_model: Any,
        llama_builder_fp32: Path, tmp_path: Path, model: str, ort_device: str) -> None:
    """A chat keeps its cache between turns: after a turn of fused steps (the JS Decoder holds the
    cache, concat or shared buffer), the next turn's prefill reads it back; a rewind narrows it."""
    if model == "llama-chat":
        folder = tmp_path / model
        shutil.copytree(llama_builder_fp32, folder)
        config = json.loads((folder / "tokenizer_config.json").read_text())
        config["chat_template"] = LLAMA_CHAT_TEMPLATE
        (folder / "tokenizer_config.json").write_text(json.dumps(config))
        serve_model(model, folder)
    else:
        folder = models[model]
    turns, reply = CHAT_TURNS[model], 6
    chat = ortpipe.load(folder, threads=1).chat(max_length=200)
    expected = [[c.token for c in chat.say(turns[0], max_new_tokens=reply)]]
    prompts = [chat.last.timings.prompt_tokens]
    after_first = list(chat.tokens)
    expected.append([c.token for c in chat.say(turns[1], max_new_tokens=reply)])
    prompts.append(chat.last.timings.prompt_tokens)
    chat.rewind()
    assert chat.tokens == after_first
    again = [c.token for c in chat.say(turns[1], max_new_tokens=reply)]
    assert again == expected[1]  # rewinding and saying the turn again gives the same reply
    expected.append([c.token for c in chat.say(turns[2], max_new_tokens=reply)])
    prompts.append(chat.last.timings.prompt_tokens)

    page.goto("/")
    got = page.evaluate(CHAT, {"model": f"models/{model}/", "device": ort_device, "turns": turns,
                               "reply": reply})
    assert [r["tokens"] for r in got["replies"]] == expected
    assert [r["prompt"] for r in got["replies"]] == prompts  # later turns prefill only their own tokens
    assert prompts[1] < len(after_first)
    assert got["replies"][0]["fused"] == len(expected[0]) - 1  # the JS Decoder held the cache
    assert got["afterRewind"] == after_first
    assert got["streamed"] == expected[1]
    assert got["failures"] == [
        "GenerationError: a chat turn takes content and max_new_tokens, not temperature; give the other "
        "settings when the chat is made",
        "GenerationError: a chat turn needs its content: a string",
        "this chat was disposed",
    ]
    assert_same_origin(requests_seen, page)


def test_chat_needs_a_tokenizer_and_a_template(page: Any, models: dict[str, Path], serve_model: Any,
                                               tmp_path: Path) -> None:
    untemplated = tmp_path / "untemplated"
    shutil.copytree(models["v2"], untemplated)
    config = json.loads((untemplated / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (untemplated / "tokenizer_config.json").write_text(json.dumps(config))
    page.goto("/")
    errors = page.evaluate("""async (models) => {
      const {load} = await import('./ortpipe.js');
      const errors = [];
      for (const model of models) {
        const pipe = await load(model, {device: 'wasm'});
        try { await pipe.chat(); } catch (e) { errors.push(`${e.name}: ${e.message}`); }
        pipe.dispose();
      }
      return errors;
    }""", ["models/sliding/", serve_model("untemplated", untemplated)])
    assert len(errors) == 2
    assert errors[0].startswith("GenerationError: ") and errors[0].endswith(
        "models/sliding/tokenizer.json is missing: chat needs the tokenizer")
    assert errors[1] == ("GenerationError: tokenizer_config.json has no chat_template, which messages and "
                         "chat need: give a prompt instead, or add the model's chat_template")
