"""Vision-language pipelines in Chromium give the tokens of ortpipe under CPython, images included.

The pipelines are build/pipeline_graphs.py's, with an image processor config: Qwen2.5-VL style
(per-image vision loop over Qwen2-VL patches, mRoPE positions) and Phi-3-V style (batched vision
over CLIP crops). The page passes PNG files (as URLs, Blobs, ImageBitmaps or ImageData); the worker
decodes them and the core's preprocessing kernels run on onnxruntime-web. CPython decodes the same
files with Pillow.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from build import pipeline_graphs as pg
from conftest import write_tokenizer  # tests/web/ has no __init__.py: pytest puts it on sys.path
from test_browser import assert_same_origin

import ortpipe

IMAGE = pg.IMAGE_TOKEN
PROMPT = [5, IMAGE, 17, 42, 8, IMAGE, 23]  # two images
NEW_TOKENS = 16
IMAGES = {"wide.png": (13, 19), "tall.png": (30, 21)}  # (height, width): both are resized
SAMPLING = {"doSample": True, "seed": 11, "temperature": 0.9, "topK": 30, "topP": 0.95}

# Runs in the page: load a model, stream each request in turn; images are given as {file, as}.
GENERATE_ALL = """async ({model, device, requests}) => {
  const {load} = await import('./ortpipe.js');
  async function source({file, as}) {
    if (as === 'url') return file;
    const blob = await (await fetch(file)).blob();
    if (as === 'blob') return blob;
    const bitmap = await createImageBitmap(blob, {colorSpaceConversion: 'none', premultiplyAlpha: 'none'});
    if (as === 'bitmap') return bitmap;
    const context = new OffscreenCanvas(bitmap.width, bitmap.height).getContext('2d');
    context.drawImage(bitmap, 0, 0);
    return context.getImageData(0, 0, bitmap.width, bitmap.height);
  }
  const pipe = await load(model, {device});
  try {
    const runs = [];
    for (const {images, ...options} of requests) {
      if (images) options.images = await Promise.all(images.map(source));
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


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The vision-language folders (with a tokenizer) and the PNG files, built once."""
    root = tmp_path_factory.mktemp("vlm")
    built = {"qwen-images": pg.qwen25vl_image_style(root / "qwen-images", seed=0),
             "phi3v-images": pg.phi3v_image_style(root / "phi3v-images", seed=0)}
    for folder in built.values():
        write_tokenizer(folder)
    from PIL import Image

    rng = np.random.default_rng(5)
    media = root / "media"
    media.mkdir()
    for name, (height, width) in IMAGES.items():
        Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)).save(media / name)
    return {**built, "media": media}


@pytest.fixture
def served(folders: dict[str, Path], serve_model: Callable[[str, Path], str],
           bundle: Path) -> dict[str, Path]:
    """The folders copied into the bundle: models/NAME/ and media/FILE."""
    for name in ("qwen-images", "phi3v-images"):
        serve_model(name, folders[name])
    shutil.copytree(folders["media"], bundle / "media", dirs_exist_ok=True)
    return folders


def cpython(folder: Path, images: list[str], media: Path, **options: Any) -> ortpipe.Result:
    pipe = ortpipe.load(folder, threads=1)
    return pipe.generate(prompt_ids=PROMPT, images=[str(media / name) for name in images], **options)


def in_page(page: Any, model: str, requests: list[dict[str, Any]], device: str = "wasm") -> dict[str, Any]:
    page.goto("/")
    return page.evaluate(GENERATE_ALL, {"model": f"models/{model}/", "device": device, "requests": requests})


def image_request(files: list[str], kinds: list[str], **options: Any) -> dict[str, Any]:
    images = [{"file": f"media/{f}", "as": k} for f, k in zip(files, kinds, strict=True)]
    return {"promptIds": PROMPT, "images": images, **options}


def test_decoded_pixels_equal_pillows(page: Any, served: dict[str, Path], bundle: Path) -> None:
    """web/images.js gives Pillow's RGB bytes for an opaque PNG, and within a level of CPython's
    for a PNG with transparency (laid over white)."""
    from PIL import Image

    from ortpipe.targets.cpython.media import decode_image

    rng = np.random.default_rng(9)
    rgba = rng.integers(0, 256, (7, 5, 4), dtype=np.uint8)
    rgba[0, :, 3], rgba[1, :, 3] = 255, 0
    Image.fromarray(rgba).save(bundle / "media" / "alpha.png")
    names = [*IMAGES, "alpha.png"]
    page.goto("/")
    got = page.evaluate("""async (urls) => {
      const {decodeImages} = await import('./images.js');
      const decoded = await decodeImages(urls);
      return decoded.map(({rgb, width, height}) => ({rgb: Array.from(rgb), width, height}));
    }""", [f"{page.url}media/{name}" for name in names])
    for name, image in zip(names, got, strict=True):
        expected = decode_image(bundle / "media" / name)
        assert (image["height"], image["width"]) == expected.shape[:2]
        pixels = np.array(image["rgb"], dtype=np.int16).reshape(expected.shape)
        difference = np.abs(pixels - expected.astype(np.int16)).max()
        assert difference == 0 if name in IMAGES else difference <= 1, name


@pytest.mark.parametrize("model", ["qwen-images", "phi3v-images"])
def test_greedy_tokens_with_images_equal_cpython(page: Any, requests_seen: list[str], served: dict[str, Path],
                                                 model: str) -> None:
    files = list(IMAGES)
    expected = cpython(served[model], files, served["media"], max_new_tokens=NEW_TOKENS)
    swapped = cpython(served[model], files[::-1], served["media"], max_new_tokens=NEW_TOKENS)
    assert expected.tokens != swapped.tokens  # the images, and their order, decide the tokens
    got = in_page(page, model, [image_request(files, ["url", "blob"], maxNewTokens=NEW_TOKENS)])
    assert got["info"]["device"] == "wasm"
    (run,) = got["runs"]
    assert run["result"]["tokens"] == expected.tokens
    assert run["chunks"] == expected.tokens
    assert run["result"]["finishReason"] == expected.finish_reason
    assert_same_origin(requests_seen, page)


def test_sampling_text_only_and_decoded_sources_equal_cpython(page: Any, served: dict[str, Path]) -> None:
    """On the Qwen2.5-VL style folder: seeded sampling with images; a text prompt (the vision step
    skipped); the images given already decoded, as ImageBitmap and ImageData."""
    files, folder = list(IMAGES), served["qwen-images"]
    snake = {"do_sample": True, "seed": 11, "temperature": 0.9, "top_k": 30, "top_p": 0.95}
    sampled = cpython(folder, files, served["media"], max_new_tokens=NEW_TOKENS, **snake).tokens
    assert sampled != cpython(folder, files, served["media"], max_new_tokens=NEW_TOKENS).tokens
    text = ortpipe.load(folder, threads=1).generate("x = 1", max_new_tokens=NEW_TOKENS)
    greedy = cpython(folder, files, served["media"], max_new_tokens=8).tokens
    got = in_page(page, "qwen-images", [
        image_request(files, ["url", "url"], maxNewTokens=NEW_TOKENS, **SAMPLING),
        {"prompt": "x = 1", "maxNewTokens": NEW_TOKENS},
        image_request(files, ["bitmap", "imagedata"], maxNewTokens=8),
    ])
    assert [r["result"]["tokens"] for r in got["runs"]] == [sampled, text.tokens, greedy]
    assert got["runs"][1]["result"]["text"] == text.text


PARTS_TEMPLATE = ("{% for m in messages %}<{{ m.role }}>{% if m.content is string %}{{ m.content }}{% else %}"
                  "{% for p in m.content %}{% if p.type == 'image' %}z{% else %}{{ p.text }}{% endif %}"
                  "{% endfor %}"
                  "{% endif %}\n{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}")  # z: id 90


def test_chat_messages_with_image_parts_equal_cpython(page: Any, served: dict[str, Path],
                                                      serve_model: Callable[[str, Path], str],
                                                      tmp_path: Path) -> None:
    """Messages with {"type": "image"} parts, rendered by @huggingface/jinja in the page and by jinja2 under
    CPython, place the images where the template says: the same tokens as the prompt ids they render to."""
    import json

    folder = Path(shutil.copytree(served["phi3v-images"], tmp_path / "parts"))
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": PARTS_TEMPLATE}))
    serve_model("phi3v-parts", folder)
    files = list(IMAGES)
    image = {"type": "image"}
    parts = [{"type": "text", "text": "ab"}, image, {"type": "text", "text": "c"}, image]
    messages = [{"role": "user", "content": parts}]
    pipe = ortpipe.load(folder, threads=1)
    paths = [str(served["media"] / name) for name in files]
    expected = pipe.generate(messages=messages, images=paths, max_new_tokens=NEW_TOKENS)
    rendered = pipe.tokenizer.encode("<user>abzcz\n<assistant>")
    assert rendered.count(IMAGE) == 2
    by_ids = pipe.generate(prompt_ids=rendered, images=paths, max_new_tokens=NEW_TOKENS)
    assert expected.tokens == by_ids.tokens
    got = in_page(page, "phi3v-parts", [{"messages": messages, "images": [{"file": f"media/{f}", "as": "url"}
                                                                         for f in files],
                                         "maxNewTokens": NEW_TOKENS}])
    assert got["runs"][0]["result"]["tokens"] == expected.tokens


def test_webgpu_greedy_and_sampled_tokens_with_images_equal_cpython(page: Any, requests_seen: list[str],
                                                 served: dict[str, Path]) -> None:
    files = list(IMAGES)
    expected = cpython(served["qwen-images"], files, served["media"], max_new_tokens=3).tokens
    assert expected != cpython(served["qwen-images"], files[::-1], served["media"], max_new_tokens=3).tokens
    sampled = cpython(served["qwen-images"], files, served["media"], max_new_tokens=3, do_sample=True, seed=1,
                      temperature=2.0, top_k=50).tokens
    assert sampled != expected
    hot = {"doSample": True, "seed": 1, "temperature": 2.0, "topK": 50}
    requests = [image_request(files, ["url", "url"], maxNewTokens=3),
                image_request(files, ["url", "url"], maxNewTokens=3, **hot)]
    got = in_page(page, "qwen-images", requests, "webgpu")
    assert got["info"]["device"] == "webgpu"
    assert [r["result"]["tokens"] for r in got["runs"]] == [expected, sampled]
    assert_same_origin(requests_seen, page)


def test_images_the_browser_cannot_use_are_named(page: Any, served: dict[str, Path]) -> None:
    page.goto("/")
    errors = page.evaluate("""async () => {
      const {load} = await import('./ortpipe.js');
      const pipe = await load('models/qwen-images/', {device: 'wasm'});
      const prompt = {promptIds: [5, 90, 17], maxNewTokens: 2};
      const errors = [];
      const text = new Blob(['not a picture'], {type: 'text/plain'});
      for (const images of [['media/missing.png'], [text], [42], 'x.png']) {
        try {
          await pipe.generate({...prompt, images});
          errors.push(null);
        } catch (e) {
          errors.push({name: e.name, message: e.message});
        }
      }
      const after = await pipe.generate({...prompt, images: ['media/wide.png']});
      pipe.dispose();
      return {errors, after: after.tokens.length};
    }""")
    missing, text, number, not_a_list = errors["errors"]
    assert all(e is not None and e["name"] == "GenerationError" for e in errors["errors"]), errors
    assert "image 1 of 1" in missing["message"] and "media/missing.png" in missing["message"]
    assert "HTTP 404" in missing["message"]
    assert "text/plain" in text["message"] and "cannot decode" in text["message"]
    assert "not a URL, Blob, ImageBitmap or ImageData" in number["message"]
    assert "must be an array" in not_a_list["message"]
    assert errors["after"] == 2  # the worker serves the next request


def test_demo_page_takes_images_from_its_file_picker(page: Any, served: dict[str, Path]) -> None:
    files = list(IMAGES)
    expected = cpython(served["qwen-images"], files, served["media"], max_new_tokens=8).tokens
    page.goto("/")
    page.fill("#model-url", "models/qwen-images/")
    page.select_option("#device", "wasm")
    page.check("#prompt-is-ids")
    page.fill("#prompt", ", ".join(map(str, PROMPT)))
    page.set_input_files("#images", [str(served["media"] / name) for name in files])
    page.fill("#max-new-tokens", "8")
    page.click("#generate")
    page.wait_for_selector("#output[data-tokens]", timeout=120_000)
    assert page.text_content("#error") == ""
    assert page.get_attribute("#output", "data-tokens") == ",".join(map(str, expected))
