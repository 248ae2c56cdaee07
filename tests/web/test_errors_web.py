"""Both targets run one core (model.py): the same bad folder or request is the same error, of the
same class and with the same message (but for where the folder is), in CPython and in the browser."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path
from typing import Any

import pytest

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
    ("v2", "chat", {"maxLength": {}}),
    ("v2", "chat", {"maxLength": 0}),
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


NOT_MEDIA = [{"images": ""}, {"images": 0}, {"images": "a.png"}, {"inputs": 0}, {"inputs": ""},
             {"inputs": [1, 2]}, {"latents": 0}, {"latents": False}, {"latents": [1, 2]}]
NONE_GIVEN = [{"images": None}, {"inputs": None}, {"latents": None}, {"mask": None}]


def test_values_that_are_no_images_inputs_or_latents_are_refused_and_null_is_none(
        page: Any, models: dict[str, Path]) -> None:
    """A value of the wrong kind for images, inputs or latents is a GenerationError on both targets,
    never taken as none (0, false and "" were dropped in the browser); null (None) is none on both.
    A draft model URL with nothing there says so (CPython: the path is no folder)."""
    asked = {"promptIds": [5, 6], "maxNewTokens": 2}
    absent = {**asked, "draftModel": "models/no-such-folder/"}
    requests = [["v2", "generate", {**asked, **given}] for given in [*NOT_MEDIA, *NONE_GIVEN]]
    page.goto("/")
    everything = [*requests, ["v2", "generate", absent]]
    seen = page.evaluate(TRY_ALL, {"folders": [], "requests": [
        [f"models/{name}/", kind, options] for name, kind, options in everything]})
    words = {"images": "images must be", "inputs": "inputs must", "latents": "latents"}
    for (_, kind, options), got in zip(requests, seen, strict=False):
        want = cpython_error(models["v2"], kind, options)
        key = next(k for k in ("images", "inputs", "latents", "mask") if k in options)
        if options[key] is None:
            assert want is None and got is None, (options, want, got)
        else:
            for error in (want, got):
                assert error is not None and error[0] == "GenerationError", (options, error)
                assert words[key] in error[1], (options, error)
    url = f"{page.url.rstrip('/')}/models/no-such-folder/"
    assert seen[-1] == ["GenerationError", f"the draft model {url} is not a model folder: it has no "
                        "genai_config.json, config.json or tokenizer.json"], seen[-1]


def test_options_json_cannot_carry_are_refused_and_typed_ids_are_numbers(page: Any,
                                                                         models: dict[str, Path]) -> None:
    """Settings travel to Python as JSON: a function, a symbol, NaN, a Date or a BigInt beyond 2^53 is
    a GenerationError naming the option (JSON dropped NaN to null, a default, and a page's function
    or symbol threw the browser's DataCloneError); token ids in a typed array, or as BigInts, are
    taken as numbers. embed() passes every key to the core, which refuses those it does not take."""
    expected = ortpipe.load(models["v2"]).generate(prompt_ids=[5, 6], max_new_tokens=3).tokens
    page.goto("/")
    got = page.evaluate("""async () => {
      const {load} = await import('./ortpipe.js');
      const pipe = await load('models/v2/', {device: 'wasm'});
      const asked = {promptIds: [5, 6], maxNewTokens: 3};
      const tries = [{temperature: () => 1}, {stop: [Symbol('x')]}, {maxNewTokens: NaN}, {topP: Infinity},
                     {stop: [new Date(0)]}, {seed: 2n ** 60n}, {promptIds: new BigInt64Array([5n, 6n])},
                     {promptIds: new Int32Array([5, 6])}, {maxNewTokens: 3n}];
      const out = [];
      for (const t of tries) {
        try { out.push((await pipe.generate({...asked, ...t})).tokens); }
        catch (e) { out.push([e.name, e.message]); }
      }
      try { await pipe.embed(['a'], {batchsize: 8}); out.push(null); }
      catch (e) { out.push([e.name, e.message]); }
      pipe.dispose();
      return out;
    }""")
    refused = [("temperature", "a function"), ("stop", "a symbol"), ("max_new_tokens", "NaN"),
               ("top_p", "Infinity"), ("stop", "a Date"), ("seed", "the BigInt 1152921504606846976")]
    plain = "must be plain data (finite numbers, strings, booleans, null, arrays and objects of them)"
    for (name, what), error in zip(refused, got, strict=False):
        assert error == ["GenerationError", f"{name} {plain}, not {what}"], error
    assert got[6:9] == [expected] * 3, (got[6:9], expected)
    unknown = "embed takes texts, batchSize, pooling and normalize, not batchsize"
    assert got[9] == ["GenerationError", unknown], got[9]


def test_a_device_load_does_not_know_is_an_ortpipe_error(page: Any) -> None:
    page.goto("/")
    got = page.evaluate("""async () => {
      const {load} = await import('./ortpipe.js');
      const out = [];
      for (const device of ['cpu', 5n, () => 'wasm', {}, null]) {
        try { (await load('models/v2/', {device})).dispose(); out.push(null); }
        catch (e) { out.push([e.constructor.name, e.name, e.message]); }
      }
      return out;
    }""")
    names = ['"cpu"', "bigint", "function", "object"]
    words = 'device must be "auto", "webgpu" or "wasm", not'
    refused = [["OrtpipeError", "OrtpipeError", f"{words} {n}"] for n in names]
    assert got == [*refused, None]  # null: the default, "auto"


def test_calls_given_no_options_object_are_refused(page: Any) -> None:
    """Options that are no object (a number spread to nothing, a string to its characters' indexes), an
    onProgress that is no function and the text given twice (in the options too, where the argument won)
    are refused, naming the call; a URL object is a folder's URL."""
    page.goto("/")
    got = page.evaluate("""async () => {
      const {load} = await import('./ortpipe.js');
      const out = [];
      const attempt = async (f) => {
        try { await f(); out.push(null); } catch (e) { out.push([e.constructor.name, e.name, e.message]); }
      };
      const pipe = await load(new URL('models/v2/', location.href), {device: 'wasm'});
      const chat = await pipe.chat(null);
      await attempt(() => pipe.generate(5));
      await attempt(() => pipe.generate('hello'));
      await attempt(async () => { for await (const c of pipe.stream([])) {} });
      await attempt(() => pipe.chat('x'));
      await attempt(() => chat.say('hi', 5));
      await attempt(() => chat.say('hi', {content: 'ho'}));
      await attempt(() => pipe.generate({promptIds: [5], maxNewTokens: 1, onProgress: 'log'}));
      await attempt(() => load(5));
      await attempt(() => load('models/v2/', 5));
      pipe.dispose();
      return out;
    }""")
    assert got == [
        ["OrtpipeError", "GenerationError", "generate() takes an options object, {...}, not a number"],
        ["OrtpipeError", "GenerationError",
         'generate() takes an options object, {...}, not a string (a prompt is {prompt: "hello"})'],
        ["OrtpipeError", "GenerationError", "stream() takes an options object, {...}, not an array"],
        ["OrtpipeError", "GenerationError", "chat() takes an options object, {...}, not a string"],
        ["OrtpipeError", "GenerationError", "say() takes an options object, {...}, not a number"],
        ["OrtpipeError", "GenerationError",
         "say() takes its text as its first argument, not content in its options"],
        ["OrtpipeError", "GenerationError", "generate(): onProgress must be a function, not a string"],
        ["OrtpipeError", "OrtpipeError",
         "load() takes the model folder's URL (a string or URL), not a number"],
        ["OrtpipeError", "OrtpipeError", "load() takes an options object, {...}, not a number"],
    ], got


def test_a_lone_surrogate_is_the_same_error(page: Any, models: dict[str, Path]) -> None:
    """A JS string may hold half of a UTF-16 pair; JSON carries it to Python, which refuses it as CPython
    does."""
    want = cpython_error(models["v2"], "generate", {"prompt": "ab\ud800c", "maxNewTokens": 1})
    page.goto("/")
    [got] = page.evaluate("""async () => {
      const {load} = await import('./ortpipe.js');
      const pipe = await load('models/v2/', {device: 'wasm'});
      try { await pipe.generate({prompt: 'ab\\ud800c', maxNewTokens: 1}); return [null]; }
      catch (e) { return [[e.name, e.message]]; } finally { pipe.dispose(); }
    }""")
    assert want is not None and "lone surrogate" in want[1]
    assert got == want


# Values a page might pass by mistake, and the settings they land in (the embed API's names).
ODD_VALUES = [None, True, False, 0, -1, 1, 3, 2**53, -(2**53), 1e308, 0.5, "", "x", "é", [], {}, [1, 2],
              {"a": 1}, [[]], [None], "9" * 50, [5, 6], {"data": [1], "dims": [1]}, ["x"], [{}], {"5": 2.5},
              {"9": "x"}]
ODD_KEYS = ["prompt", "promptIds", "messages", "maxNewTokens", "maxLength", "temperature", "topK", "topP",
            "minP", "doSample", "seed", "stop", "repetitionPenalty", "numBeams", "numReturnSequences",
            "logprobs", "images", "mask", "inputs", "latents", "promptLookupNumTokens", "maxDraftTokens",
            "ngramSize", "eta", "numSteps", "guidanceScale", "negativePrompt", "strength",
            "noRepeatNgramSize", "minNewTokens", "eosTokenId", "frequencyPenalty", "presencePenalty",
            "logitBias"]
# Where the targets word a refusal their own way: the kinds of value each language has
TARGET_WORDS = ("images must be", "inputs must", 'input "', "latents must")


def test_random_mistakes_are_refused_alike(page: Any, models: dict[str, Path]) -> None:
    """250 requests with one or two settings given odd values (a fixed seed): each works on both targets
    or is refused on both, with the same error but where a value's kind is worded in each language's
    terms (a list or an array, a tensor as {data, dims} or a numpy array). A value one target took as
    none and the other refused fails it."""
    rng = random.Random(20261128)
    requests = []
    for _ in range(250):
        options: dict[str, Any] = {"promptIds": [5, 6], "maxNewTokens": 2}
        for _ in range(rng.randint(1, 2)):
            options[rng.choice(ODD_KEYS)] = rng.choice(ODD_VALUES)
        requests.append(["v2", "generate", options])
    page.goto("/")
    seen = page.evaluate(TRY_ALL, {"folders": [], "requests": [
        [f"models/{name}/", kind, options] for name, kind, options in requests]})
    pipe = ortpipe.load(models["v2"])
    pipe_errors = []
    for _, _, options in requests:
        try:
            pipe.generate(**snake(options))
            pipe_errors.append(None)
        except OrtpipeError as e:
            pipe_errors.append([type(e).__name__, str(e)])
    differ = []
    for (_, _, options), want, got in zip(requests, pipe_errors, seen, strict=True):
        refused = [e is not None and e[0] == "GenerationError" for e in (want, got)]
        # a value of a kind only one language has ({data, dims} is a tensor in JS, a dict in Python)
        # may be refused by one target before the core refuses another setting on the other
        worded = any(e is not None and e[1].startswith(TARGET_WORDS) for e in (want, got))
        if want != got and not (all(refused) and worded):
            differ.append((options, want, got))
    assert sum(e is None for e in seen) > 10 and sum(e is not None for e in seen) > 100  # both kinds drawn
    assert not differ, differ[:5]


CHAT_RUN = """async ({requests}) => {
  const {load} = await import('./ortpipe.js');
  const pipe = await load('models/v2/', {device: 'wasm'});
  const seen = [];
  for (const [settings, turn] of requests) {
    try {
      const chat = await pipe.chat(settings);
      seen.push((await chat.say('hi', turn)).tokens);
      chat.dispose();
    } catch (e) { seen.push([e.name, e.message]); }
  }
  pipe.dispose();
  return seen;
}"""


def test_random_chat_settings_are_taken_or_refused_alike(page: Any, models: dict[str, Path]) -> None:
    """100 chats with odd settings, and turns with odd lengths (a fixed seed), give the same tokens or the
    same error on both targets; a turn's max_new_tokens that is no positive whole number is refused (0, -1
    and 0.5 ran one step before)."""
    rng = random.Random(3)
    keys = [k for k in ODD_KEYS if k not in ("prompt", "promptIds", "messages", "images", "mask", "inputs",
                                             "latents")]
    requests = []
    for _ in range(100):
        settings = {rng.choice(keys): rng.choice(ODD_VALUES) for _ in range(rng.randint(0, 2))}
        turn = {"maxNewTokens": 2 if rng.random() < 0.6 else rng.choice(ODD_VALUES)}
        requests.append([settings, turn])
    page.goto("/")
    seen = page.evaluate(CHAT_RUN, {"requests": requests})
    pipe = ortpipe.load(models["v2"])
    differ = []
    for (settings, turn), got in zip(requests, seen, strict=True):
        try:
            chat = pipe.chat(**snake(settings))
            want: Any = [c.token for c in chat.say("hi", **snake(turn))]
        except OrtpipeError as e:
            want = [type(e).__name__, str(e)]
        if want != got:
            differ.append((settings, turn, want, got))
    assert sum(isinstance(g[0], int) for g in seen if g) > 10, seen  # chats that ran, and refusals
    assert not differ, differ[:5]
    for (_, turn), got in zip(requests, seen, strict=True):
        length = turn["maxNewTokens"]
        if length is not None and not (type(length) is int and length >= 1):
            assert got and got[0] == "GenerationError", (turn, got)  # refused, never run for a step


def test_nan_logits_before_a_sampled_first_token_are_the_same_error(page: Any, serve_model: Any,
                                                                    tmp_path: Path) -> None:
    """The first token of a sampled request is chosen by web/sampling.js's Picker (the core's `Select`):
    NaN logits there are CPython's error, word for word."""
    from build import graphs
    from conftest import write_tokenizer  # tests/web/ has no __init__.py: pytest puts it on sys.path
    from tests.test_hostile import nan_model

    folder = graphs.build_separate(tmp_path / "model", seed=0, config=True)
    write_tokenizer(folder)
    broken = nan_model(folder)
    pipe = ortpipe.load(broken, threads=1)
    want = []
    for logprobs in (None, 2):  # the Picker's path, and the kernels' (logprobs are read from the logits)
        with pytest.raises(OrtpipeError) as error:
            pipe.generate(prompt_ids=[5, 6, 7], max_new_tokens=4, do_sample=True, seed=1, logprobs=logprobs)
        want.append(["OrtpipeError", str(error.value)])
    url = serve_model("nan-model", broken)
    page.goto("/")
    got = page.evaluate("""async (url) => {
      const {load} = await import('./ortpipe.js');
      const pipe = await load(url, {device: 'wasm'});
      const errors = [];
      for (const logprobs of [null, 2]) {
        const request = {promptIds: [5, 6, 7], maxNewTokens: 4, doSample: true, seed: 1, logprobs};
        try { await pipe.generate(request); } catch (e) { errors.push([e.name, e.message]); }
      }
      pipe.dispose();
      return errors;
    }""", url)
    assert got == want
