"""The single_pass and denoising loops in Chromium give CPython's outputs: sentence embeddings (tokenizers.js
on the folder's tokenizer.json), speech (the core's VITS tokenizer) and images (the core's CLIP tokenizer,
seeded noise from the core's generator) on onnxruntime-web; WebGPU within a stated tolerance. The demo page
plays the audio and shows the image (screenshots in build/cache/screenshots/).

Tolerances against CPython: wasm 1e-5 (embeddings, waveforms) and 1e-4 (images: the UNet, scheduler and
VAE kernels of wasm and of the CPU provider round differently, a few ulps); WebGPU 1e-3 (its kernels
compute attention and normalisation in another order and with other approximations).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import ortpipe

ROOT = Path(__file__).resolve().parents[2]
SCREENSHOTS = ROOT / "build" / "cache" / "screenshots"
WASM, WEBGPU = {"embedding": 1e-5, "audio": 1e-5, "image": 1e-4}, 1e-3

# Runs in the page: load a folder, run each request (embed, speak or generate), return what came back.
RUN = """async ({model, device, requests}) => {
  const {load} = await import('./ortpipe.js');
  const pipe = await load(model, {device});
  const plain = (a) => Array.from(a, Number);
  try {
    const runs = [];
    for (const {kind, args} of requests) {
      if (kind === 'embed') {
        const {data, dims} = await pipe.embed(...args);
        runs.push({data: plain(data), dims});
      } else if (kind === 'speak') {
        const {audio, samplingRate} = await pipe.speak(...args);
        runs.push({data: plain(audio), samplingRate});
      } else {
        const steps = [];
        const options = {...args[0], onProgress: (p) => steps.push(p)};
        const given = options.latents;
        if (given) options.latents = {data: new Float32Array(given.data), dims: given.dims};
        const result = await pipe.generate(options);
        const image = Object.values(result.outputs).find((o) => o.kind === 'image');
        runs.push({data: plain(image.data), dims: image.dims, rgba: plain(image.image.data), steps,
                   timings: result.timings, finishReason: result.finishReason});
      }
    }
    return {info: pipe.info, runs};
  } finally {
    pipe.dispose();
  }
}"""


def in_page(page: Any, model: str, requests: list[dict[str, Any]], device: str = "wasm") -> dict[str, Any]:
    page.goto("/")
    return page.evaluate(RUN, {"model": f"models/{model}/", "device": device, "requests": requests})


def _json(path: Path) -> dict:
    return json.loads(path.read_text())


@pytest.fixture(scope="module")
def sd_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """sd-tiny with a scheduler of its cases that adds noise (EulerAncestral), its references aside."""
    from build import paradigms

    source = paradigms.get("sd-tiny")
    folder = Path(shutil.copytree(source, tmp_path_factory.mktemp("web-sd") / "sd",
                                  ignore=shutil.ignore_patterns("references")))
    cases = {c["name"]: c for c in _json(source / "references" / "cases.json")["cases"]}
    scheduler = cases["euler_a-v-trailing-cfg"]["scheduler"]
    (folder / "scheduler" / "scheduler_config.json").write_text(json.dumps(scheduler))
    return folder


def test_wasm_embeddings_equal_cpython(page: Any, serve_model: Any, st_minilm: Path) -> None:
    texts = _json(st_minilm / "references" / "inputs.json")["texts"]
    pipe = ortpipe.load(st_minilm)
    expected = pipe.embed(texts)
    serve_model("st-minilm", st_minilm)
    got = in_page(page, "st-minilm", [{"kind": "embed", "args": [texts]},
                                      {"kind": "embed", "args": [texts, {"batchSize": 2}]}])
    assert got["info"]["loop"] == "single_pass"
    assert got["info"]["outputs"] == {"last_hidden_state": "embedding"}
    reference = np.load(st_minilm / "references" / "embeddings.npy")
    for run in got["runs"]:
        data = np.array(run["data"], np.float32).reshape(run["dims"])
        assert data.shape == (5, 32)
        assert np.abs(data - expected).max() <= WASM["embedding"]
        assert np.abs(data - reference).max() <= WASM["embedding"]


def test_wasm_speech_equals_cpython(page: Any, serve_model: Any, vits_tiny: Path) -> None:
    cases = _json(vits_tiny / "references" / "inputs.json")["cases"]
    pipe = ortpipe.load(vits_tiny)
    serve_model("vits-tiny", vits_tiny)
    got = in_page(page, "vits-tiny", [{"kind": "speak", "args": [case["text"]]} for case in cases])
    for case, run in zip(cases, got["runs"], strict=True):
        expected = pipe.speak(case["text"]).samples
        assert run["samplingRate"] == 16000 and len(run["data"]) == case["samples"]
        assert np.abs(np.array(run["data"]) - expected).max() <= WASM["audio"]


@pytest.fixture
def transformers_js(bundle: Path) -> None:
    """transformers.js (its browser build) served at tjs/ in the bundle, beside ortpipe."""
    from build import bench_web

    (bundle / "tjs").mkdir(exist_ok=True)
    shutil.copy2(bench_web.TRANSFORMERS_JS / "dist" / "transformers.min.js", bundle / "tjs")


# transformers.js's text-to-speech or feature-extraction pipeline (what tjs.pipeline(...) makes, built from
# the folder's files: its existence check skips local files given by http URL) over the onnxruntime-web
# build ortpipe bundles; then ortpipe's speak or embed on the same folder, in the same page.
TJS_SETUP = """
  const here = (path) => new URL(path, location.href).href;
  globalThis[Symbol.for('onnxruntime')] = await import('./ort/ort.wasm.min.mjs');
  const tjs = await import('./tjs/transformers.min.js');
  Object.assign(tjs.env, {allowRemoteModels: false, allowLocalModels: true, useBrowserCache: false,
                          localModelPath: here('./models/')});
  tjs.env.backends.onnx.wasm.wasmPaths = here('./ort/');
  const [json, config] = await Promise.all(['tokenizer.json', 'tokenizer_config.json'].map(
    (file) => fetch(here(`./models/${model}/${file}`)).then((r) => r.json())));
  const graph = await tjs.AutoModel.from_pretrained(model, {
    device: 'auto', session_options: {executionProviders: ['wasm']}, dtype: 'fp32'});
  const {load} = await import('./ortpipe.js');
"""
BOTH_SPEAK = """async ({model, texts}) => {""" + TJS_SETUP + """
  const tokenizer = new tjs.VitsTokenizer(json, config);
  const synth = new tjs.TextToAudioPipeline({task: 'text-to-speech', model: graph, tokenizer});
  const theirs = [];
  for (const text of texts) {
    const {audio, sampling_rate} = await synth(text);
    theirs.push({data: Array.from(audio), samplingRate: sampling_rate,
                 ids: Array.from(tokenizer(text).input_ids.data, Number)});
  }
  const pipe = await load(`models/${model}/`, {device: 'wasm'});
  const ours = [];
  for (const text of texts) {
    const {audio, samplingRate} = await pipe.speak(text);
    ours.push({data: Array.from(audio), samplingRate});
  }
  pipe.dispose();
  return {theirs, ours};
}"""
BOTH_EMBED = """async ({model, texts}) => {""" + TJS_SETUP + """
  const extract = new tjs.FeatureExtractionPipeline({task: 'feature-extraction', model: graph,
                                                     tokenizer: new tjs.PreTrainedTokenizer(json, config)});
  const pipe = await load(`models/${model}/`, {device: 'wasm'});
  const plain = ({data, dims}) => ({data: Array.from(data), dims});
  const runs = [];
  for (const options of [{}, {pooling: 'cls', normalize: true}]) {  // the folder's; a request's
    const theirs = await extract(texts, {pooling: 'mean', normalize: false, ...options});
    runs.push({theirs: plain(theirs), ours: plain(await pipe.embed(texts, options))});
  }
  const info = pipe.info;
  pipe.dispose();
  return {runs, info};
}"""


def test_wasm_speech_equals_transformers_js(page: Any, serve_model: Any, transformers_js: None,
                                            vits_tiny: Path, vits_tjs: Path) -> None:
    """transformers.js's converted VITS layout (tokenizer.json, no vocab.json) in one page: transformers.js's
    text-to-speech pipeline and ortpipe's speak give the same waveforms, and transformers' (the
    references)."""
    serve_model("vits-tjs", vits_tjs)
    cases = _json(vits_tiny / "references" / "inputs.json")["cases"]
    page.goto("/")
    got = page.evaluate(BOTH_SPEAK, {"model": "vits-tjs", "texts": [case["text"] for case in cases]})
    for case, theirs, ours in zip(cases, got["theirs"], got["ours"], strict=True):
        assert theirs["ids"] == case["input_ids"]
        expected = np.load(vits_tiny / "references" / case["waveform"])[0]
        assert theirs["samplingRate"] == ours["samplingRate"] == 16000
        assert len(theirs["data"]) == len(ours["data"]) == case["samples"]
        worst = float(np.abs(np.array(ours["data"]) - np.array(theirs["data"])).max())
        print(f"{case['text']!r}: max |ortpipe - transformers.js| = {worst:.1e}")
        assert worst <= WASM["audio"]
        assert np.abs(np.array(ours["data"]) - expected).max() <= 1e-4  # the issue's, against transformers


def test_wasm_feature_extraction_folder_equals_transformers_js(page: Any, serve_model: Any,
                                                               transformers_js: None, st_minilm_nonorm: Path,
                                                               st_minilm_cls: Path, st_tjs: Path) -> None:
    """transformers.js's feature-extraction layout (no modules.json): ortpipe detects the encoder and
    mean-pools, as transformers.js's pipeline does asked for mean pooling, and as sentence-transformers
    (the references); asked for CLS pooling and normalisation, both give st-minilm-cls's references."""
    serve_model("st-tjs", st_tjs)
    texts = _json(st_minilm_nonorm / "references" / "inputs.json")["texts"]
    page.goto("/")
    got = page.evaluate(BOTH_EMBED, {"model": "st-tjs", "texts": texts})
    assert got["info"]["loop"] == "single_pass"
    for run, folder in zip(got["runs"], (st_minilm_nonorm, st_minilm_cls), strict=True):
        theirs, ours = (np.array(run[k]["data"], np.float32).reshape(run[k]["dims"])
                        for k in ("theirs", "ours"))
        expected = np.load(folder / "references" / "embeddings.npy")
        print(f"{folder.name}: max |ortpipe - transformers.js| = {np.abs(ours - theirs).max():.1e}")
        assert ours.shape == theirs.shape == expected.shape
        assert np.abs(ours - theirs).max() <= WASM["embedding"]
        assert np.abs(ours - expected).max() <= WASM["embedding"]


def test_wasm_images_equal_cpython(page: Any, serve_model: Any, sd_folder: Path) -> None:
    """A seeded image (latents and each step's noise from the core's generator) with guidance and a negative
    prompt, and one from given latents: CPython's, within 1e-4; the RGBA bytes within one level."""
    pipe = ortpipe.load(sd_folder)
    latents = np.random.default_rng(3).standard_normal((1, 4, 8, 8)).astype(np.float32)
    requests = [{"prompt": "a red cube on a wooden table", "negativePrompt": "blurry", "numSteps": 3,
                 "guidanceScale": 5.0, "seed": 21},
                {"prompt": "a blue sphere", "numSteps": 2, "guidanceScale": 1.0, "seed": 5,
                 "latents": {"data": latents.ravel().tolist(), "dims": [1, 4, 8, 8]}}]
    expected = [pipe.generate("a red cube on a wooden table", negative_prompt="blurry", num_steps=3,
                              guidance_scale=5.0, seed=21).image,
                pipe.generate("a blue sphere", num_steps=2, guidance_scale=1.0, seed=5,
                              latents=latents).image]
    serve_model("sd-tiny", sd_folder)
    got = in_page(page, "sd-tiny", [{"kind": "generate", "args": [r]} for r in requests])
    assert got["info"]["loop"] == "denoising"
    for run, image, request in zip(got["runs"], expected, requests, strict=True):
        data = np.array(run["data"], np.float32).reshape(run["dims"])
        print(f"wasm image: max |browser - CPython| = {np.abs(data - image).max():.1e}")
        assert np.abs(data - image).max() <= WASM["image"]
        rgba = np.array(run["rgba"]).reshape(32, 32, 4)
        assert np.abs(rgba[..., :3] - np.round(image[0] * 255)).max() <= 1 and (rgba[..., 3] == 255).all()
        steps = request["numSteps"]
        assert [(p["phase"], p["step"], p["steps"]) for p in run["steps"]] == [
            ("step", i, steps) for i in range(steps + 1)]
        assert run["timings"]["steps"] == steps and run["finishReason"] == "done"


# Stable Diffusion XL (two tokenizers, joined encoder states, the size conditioning): guided with zeroed
# unconditional states, with a negative prompt, and unguided. Stable Diffusion 3 (three tokenizers, T5's
# through tokenizers.js on its tokenizer.json, the grouped join of the encoders' states, flow matching, the
# shifted VAE latents): guided with a negative prompt, and unguided. A latent consistency model (its guidance
# embedded, LCM's noise from the core's generator): seeded, 4 steps and 1.
FAMILIES = {
    "lcm-tiny": [{"prompt": "a red cube", "numSteps": 4, "guidanceScale": 8.5, "seed": 4},
                 {"prompt": "a blue sphere", "numSteps": 1, "guidanceScale": 3.0, "seed": 6}],
    "sdxl-tiny": [{"prompt": "a red cube", "numSteps": 3, "guidanceScale": 5.0, "seed": 4},
                  {"prompt": "a red cube", "negativePrompt": "blurry", "numSteps": 2, "guidanceScale": 6.0,
                   "seed": 5},
                  {"prompt": "a blue sphere", "numSteps": 2, "guidanceScale": 1.0, "seed": 6}],
    "sd3-tiny": [{"prompt": "a red cube on a wooden table", "negativePrompt": "blurry", "numSteps": 3,
                  "guidanceScale": 5.0, "seed": 4},
                 {"prompt": "a blue sphere", "numSteps": 2, "guidanceScale": 1.0, "seed": 6}],
    # sd3-tiny saved without T5: zero rows in place of T5's states (a grouped wire's {"zeros": 256})
    "sd3-tiny-no-t5": [{"prompt": "a red cube", "negativePrompt": "blurry", "numSteps": 2,
                        "guidanceScale": 5.0, "seed": 7}],
}


@pytest.mark.parametrize("model", FAMILIES)
def test_wasm_sdxl_sd3_lcm_images_equal_cpython(page: Any, serve_model: Any, tmp_path: Path,
                                                model: str) -> None:
    """Each request's image in the browser is CPython's within 1e-4."""
    from build import paradigms

    folder = Path(shutil.copytree(paradigms.get(model.removesuffix("-no-t5")), tmp_path / model,
                                  ignore=shutil.ignore_patterns("references")))
    if model.endswith("-no-t5"):
        from tests.test_sd3 import without_t5

        without_t5(folder)
    requests = FAMILIES[model]
    pipe = ortpipe.load(folder)
    expected = [pipe.generate(r["prompt"], negative_prompt=r.get("negativePrompt"), num_steps=r["numSteps"],
                              guidance_scale=r["guidanceScale"], seed=r["seed"]).image for r in requests]
    serve_model(model, folder)
    got = in_page(page, model, [{"kind": "generate", "args": [r]} for r in requests])
    for run, image in zip(got["runs"], expected, strict=True):
        data = np.array(run["data"], np.float32).reshape(run["dims"])
        print(f"wasm {model} image: max |browser - CPython| = {np.abs(data - image).max():.1e}")
        assert np.abs(data - image).max() <= WASM["image"]


@pytest.mark.parametrize(("case", "rescale"), [("dpm-sde-karras-eps-cfg", 0.5),
                                               ("pndm-eps-leading-cfg", 0.0),
                                               ("heun-v-leading-cfg", 0.0),
                                               ("kdpm2-karras-eps-trailing", 0.0),
                                               ("unipc3-karras-eps-leading", 0.0),
                                               ("lms-v-leading-cfg", 0.0),
                                               ("kdpm2-beta-eps-trailing", 0.0),
                                               ("kdpm2_a-v-leading-cfg", 0.0),
                                               ("deis3-v-leading", 0.0),
                                               ("edm-eps-range", 0.0),
                                               ("ddim-eta-eps-leading-cfg", 0.0),
                                               ("tcd-eps-cfg", 0.0),
                                               ("dpms3-heun-v-min", 0.0)])
def test_wasm_scheduler_images_equal_cpython(page: Any, serve_model: Any, sd_folder: Path, tmp_path: Path,
                                             case: str, rescale: float) -> None:
    """DPM-Solver++ (2M) SDE with Karras sigmas, guided and rescaled, seeded; PNDM (PLMS, Stable Diffusion
    1.x's own, its memory of past outputs); Heun and KDPM2 (two UNet runs a step); UniPC of order 3 (its
    corrector folded into the step's weights); LMS (its memory of past slopes); beta sigmas (the incomplete
    beta function inverted in Python); KDPM2Ancestral (noise at each second run); DEIS of order 3 (its memory
    of noise predictions); EDM Euler (its timesteps 0.25 log sigma); DDIM with eta (noise every step, the
    request's eta), TCD (eta 0.3, its gamma) and DPM-Solver singlestep of order 3 (each step from its group's
    first sample): the schedule is the core's
    arithmetic and each step's noise the core's generator, the same in Pyodide; the image is CPython's within
    1e-4."""
    from build import paradigms

    cases = {c["name"]: c for c in _json(paradigms.get("sd-tiny") / "references" / "cases.json")["cases"]}
    folder = Path(shutil.copytree(sd_folder, tmp_path / "sd-scheduler"))
    scheduler = cases[case]["scheduler"]
    (folder / "scheduler" / "scheduler_config.json").write_text(json.dumps(scheduler))
    eta = cases[case]["eta"]
    request = {"prompt": "a red cube", "negativePrompt": "blurry", "numSteps": 4, "guidanceScale": 5.0,
               "guidanceRescale": rescale, "seed": 9, **({"eta": eta} if eta else {})}
    expected = ortpipe.load(folder).generate("a red cube", negative_prompt="blurry", num_steps=4,
                                             guidance_scale=5.0, guidance_rescale=rescale, seed=9,
                                             eta=eta).image
    serve_model(case, folder)
    (run,) = in_page(page, case, [{"kind": "generate", "args": [request]}])["runs"]
    data = np.array(run["data"], np.float32).reshape(run["dims"])
    print(f"wasm {case} image: max |browser - CPython| = {np.abs(data - expected).max():.1e}")
    assert np.abs(data - expected).max() <= WASM["image"]


def test_wasm_image_to_image_equals_cpython(page: Any, serve_model: Any, tmp_path: Path) -> None:
    """Image-to-image (the PNG decoded by the worker, the VAE encoder in the init phase, the image_latents
    kernel, the schedule entered at strength's step): Stable Diffusion with PNDM guided and DPM-Solver++
    unguided, Stable Diffusion 3 (flow matching) guided, each the image CPython makes within 1e-4."""
    from build import paradigms

    guided = {"prompt": "a red cube", "negativePrompt": "blurry"}
    requests = [
        ("sd-tiny", "PNDMScheduler",
         {**guided, "numSteps": 5, "guidanceScale": 6.0, "strength": 0.6, "seed": 3}),
        ("sd-tiny", "DPMSolverMultistepScheduler",
         {"prompt": "a blue sphere", "numSteps": 6, "guidanceScale": 1.0, "strength": 0.7, "seed": 4}),
        ("sd3-tiny", "FlowMatchEulerDiscreteScheduler",
         {**guided, "numSteps": 6, "guidanceScale": 5.0, "strength": 0.75, "seed": 5}),
        ("lcm-tiny", "LCMScheduler",  # the guidance embedded; noise added after each step but the last
         {"prompt": "a red cube", "numSteps": 4, "guidanceScale": 8.5, "strength": 0.6, "seed": 6}),
    ]
    for source_name, name, request in requests:
        source = paradigms.get(source_name)
        folder = tmp_path / f"{source_name}-img2img"
        if not folder.exists():
            shutil.copytree(source, folder, ignore=shutil.ignore_patterns("references"))
        index = _json(source / "references" / "img2img.json")
        cases = {c["scheduler"]["_class_name"]: c for c in index["cases"]}
        shutil.copy(source / "references" / cases[name]["init_image"], folder / "init.png")
        (folder / "scheduler" / "scheduler_config.json").write_text(json.dumps(cases[name]["scheduler"]))
        expected = ortpipe.load(folder).generate(
            request["prompt"], images=[folder / "init.png"], negative_prompt=request.get("negativePrompt"),
            num_steps=request["numSteps"], guidance_scale=request["guidanceScale"],
            strength=request["strength"], seed=request["seed"])
        model = f"img2img-{name}"
        serve_model(model, folder)
        given = {**request, "images": [f"models/{model}/init.png"]}
        (run,) = in_page(page, model, [{"kind": "generate", "args": [given]}])["runs"]
        data = np.array(run["data"], np.float32).reshape(run["dims"])
        assert run["timings"]["steps"] == expected.timings.steps < request["numSteps"] + 1
        difference = float(np.abs(data - expected.image).max())
        print(f"wasm image-to-image {name}: max |browser - CPython| = {difference:.1e}")
        assert difference <= WASM["image"]


def test_wasm_inpainting_equals_cpython(page: Any, serve_model: Any, tmp_path: Path) -> None:
    """Inpainting in the browser (the mask decoded by the worker beside the image, the inpaint_mask and
    inpaint_blend kernels): Euler from noise (strength 1, guided) and DDIM at strength 0.6, an inpainting
    UNet, Stable Diffusion XL and 3 at their pipelines' default strengths, each the image CPython makes within
    1e-4; a mask of the wrong kind is refused."""
    from build import paradigms

    source = paradigms.get("sd-tiny")
    folder = Path(shutil.copytree(source, tmp_path / "sd-inpaint",
                                  ignore=shutil.ignore_patterns("references")))
    for name in ("init.png", "mask.png"):
        shutil.copy(source / "references" / name, folder / name)
    cases = {c["name"]: c for c in _json(source / "references" / "inpaint.json")["cases"]}
    for case, request in [
        ("inp-euler-eps-leading-cfg", {"prompt": "a red cube", "negativePrompt": "blurry", "numSteps": 4,
                                       "guidanceScale": 6.0, "seed": 3}),
        ("inp-ddim-v-linspace", {"prompt": "a red cube", "numSteps": 5, "guidanceScale": 1.0,
                                 "strength": 0.6, "seed": 4}),
    ]:
        (folder / "scheduler" / "scheduler_config.json").write_text(json.dumps(cases[case]["scheduler"]))
        expected = ortpipe.load(folder).generate(
            request["prompt"], images=[folder / "init.png"], mask=folder / "mask.png",
            negative_prompt=request.get("negativePrompt"), num_steps=request["numSteps"],
            guidance_scale=request["guidanceScale"], strength=request.get("strength"), seed=request["seed"])
        model = f"inpaint-{case}"
        serve_model(model, folder)
        given = {**request, "images": [f"models/{model}/init.png"], "mask": f"models/{model}/mask.png"}
        (run,) = in_page(page, model, [{"kind": "generate", "args": [given]}])["runs"]
        data = np.array(run["data"], np.float32).reshape(run["dims"])
        difference = float(np.abs(data - expected.image).max())
        print(f"wasm inpainting {case}: max |browser - CPython| = {difference:.1e}")
        assert run["timings"]["steps"] == expected.timings.steps and difference <= WASM["image"]
    # an inpainting UNet (9 input channels: the mask and the masked image's latents beside the latents)
    nine = Path(shutil.copytree(paradigms.get("sd-inpaint-tiny"), tmp_path / "sd-inpaint9",
                                ignore=shutil.ignore_patterns("references")))
    for name in ("init.png", "mask.png"):
        shutil.copy(source / "references" / name, nine / name)
    expected = ortpipe.load(nine).generate("a red cube", images=[nine / "init.png"], mask=nine / "mask.png",
                                           negative_prompt="blurry", num_steps=4, guidance_scale=6.0,
                                           strength=0.75, seed=5)
    serve_model("inpaint9", nine)
    given = {"prompt": "a red cube", "negativePrompt": "blurry", "numSteps": 4, "guidanceScale": 6.0,
             "strength": 0.75, "seed": 5, "images": ["models/inpaint9/init.png"],
             "mask": "models/inpaint9/mask.png"}
    (run,) = in_page(page, "inpaint9", [{"kind": "generate", "args": [given]}])["runs"]
    difference = float(np.abs(np.array(run["data"], np.float32).reshape(run["dims"]) - expected.image).max())
    print(f"wasm inpainting UNet: max |browser - CPython| = {difference:.1e}")
    assert difference <= WASM["image"]
    # Stable Diffusion XL (the size conditioning; the pipeline's default strength 0.9999 with a mask)
    xl = Path(shutil.copytree(paradigms.get("sdxl-tiny"), tmp_path / "sdxl-inpaint",
                              ignore=shutil.ignore_patterns("references")))
    for name in ("init.png", "mask.png"):
        shutil.copy(source / "references" / name, xl / name)
    expected = ortpipe.load(xl).generate("a red cube", images=[xl / "init.png"], mask=xl / "mask.png",
                                         num_steps=3, guidance_scale=5.0, seed=7)
    serve_model("inpaint-xl", xl)
    given = {"prompt": "a red cube", "numSteps": 3, "guidanceScale": 5.0, "seed": 7,
             "images": ["models/inpaint-xl/init.png"], "mask": "models/inpaint-xl/mask.png"}
    (run,) = in_page(page, "inpaint-xl", [{"kind": "generate", "args": [given]}])["runs"]
    difference = float(np.abs(np.array(run["data"], np.float32).reshape(run["dims"]) - expected.image).max())
    print(f"wasm inpainting, Stable Diffusion XL: max |browser - CPython| = {difference:.1e}")
    assert run["timings"]["steps"] == expected.timings.steps == 2 and difference <= WASM["image"]
    # Stable Diffusion 3 (flow matching's scale_noise in the blend; the pipeline's default strength 0.6)
    sd3 = Path(shutil.copytree(paradigms.get("sd3-tiny"), tmp_path / "sd3-inpaint",
                               ignore=shutil.ignore_patterns("references")))
    for name in ("init.png", "mask.png"):
        shutil.copy(source / "references" / name, sd3 / name)
    expected = ortpipe.load(sd3).generate("a red cube", images=[sd3 / "init.png"], mask=sd3 / "mask.png",
                                          negative_prompt="blurry", num_steps=5, guidance_scale=5.0, seed=8)
    serve_model("inpaint-sd3", sd3)
    given = {"prompt": "a red cube", "negativePrompt": "blurry", "numSteps": 5, "guidanceScale": 5.0,
             "seed": 8, "images": ["models/inpaint-sd3/init.png"], "mask": "models/inpaint-sd3/mask.png"}
    (run,) = in_page(page, "inpaint-sd3", [{"kind": "generate", "args": [given]}])["runs"]
    difference = float(np.abs(np.array(run["data"], np.float32).reshape(run["dims"]) - expected.image).max())
    print(f"wasm inpainting, Stable Diffusion 3: max |browser - CPython| = {difference:.1e}")
    assert run["timings"]["steps"] == expected.timings.steps == 3 and difference <= WASM["image"]
    errors = page.evaluate("""async (model) => {
      const {load} = await import('./ortpipe.js');
      const sd = await load(model, {device: 'wasm'});
      const errors = [];
      for (const mask of [42, `${model}mask.png`]) {
        try {
          const images = mask === 42 ? {images: [`${model}init.png`]} : {};
          await sd.generate({prompt: 'x', numSteps: 2, mask, ...images});
          errors.push(null);
        } catch (e) { errors.push(e.name + ': ' + e.message); }
      }
      sd.dispose();
      return errors;
    }""", "models/inpaint-inp-ddim-v-linspace/")
    assert errors[0].startswith("GenerationError") and "URL, Blob, ImageBitmap or ImageData" in errors[0]
    assert errors[1].startswith("GenerationError: a mask says which part of an image to repaint")


def test_webgpu_outputs_equal_cpython_within_tolerance(page: Any, serve_model: Any, st_minilm: Path,
                                                       vits_tiny: Path, sd_folder: Path) -> None:
    serve_model("st-minilm", st_minilm)
    serve_model("vits-tiny", vits_tiny)
    serve_model("sd-tiny", sd_folder)
    texts = ["Hello world.", "Sorting is stable: equal keys keep their original order."]
    got = in_page(page, "st-minilm", [{"kind": "embed", "args": [texts]}], "webgpu")
    assert got["info"]["device"] == "webgpu"
    embeddings = np.array(got["runs"][0]["data"]).reshape(got["runs"][0]["dims"])
    assert np.abs(embeddings - ortpipe.load(st_minilm).embed(texts)).max() <= WEBGPU
    speech = in_page(page, "vits-tiny", [{"kind": "speak", "args": ["Hello world."]}], "webgpu")["runs"][0]
    expected = ortpipe.load(vits_tiny).speak("Hello world.").samples
    assert np.abs(np.array(speech["data"]) - expected).max() <= WEBGPU
    request = {"prompt": "a red cube", "numSteps": 2, "guidanceScale": 3.0, "seed": 8}
    image = in_page(page, "sd-tiny", [{"kind": "generate", "args": [request]}], "webgpu")["runs"][0]
    expected_image = ortpipe.load(sd_folder).generate("a red cube", num_steps=2, guidance_scale=3.0,
                                                      seed=8).image
    difference = np.abs(np.array(image["data"]).reshape(image["dims"]) - expected_image).max()
    print(f"webgpu image: max |browser - CPython| = {difference:.1e}")
    assert difference <= WEBGPU


FLOAT16_IMAGE = 5e-3  # float16 kernels of wasm and of the CPU provider round apart: about one level of 255


@pytest.mark.parametrize("ort_device", ["wasm", "webgpu"])
def test_float16_images_equal_cpython(page: Any, serve_model: Any, sd_folder: Path, ort_device: str,
                                      tmp_path: Path) -> None:
    """sd-tiny's graphs in float16 (as fp16 exports for WebGPU are made; onnxruntime's float16 converter,
    Resize kept in float32): a seeded, guided image equals CPython's float16 one within float16 rounding. A
    WebGPU adapter without shader-f16 (SwiftShader's) cannot open the graphs: the page gets the ConfigError
    naming it."""
    import onnx
    from onnxruntime.transformers.float16 import DEFAULT_OP_BLOCK_LIST, convert_float_to_float16

    folder = Path(shutil.copytree(sd_folder, tmp_path / "sd-fp16"))
    for part in ("text_encoder", "unet", "vae_decoder", "vae_encoder"):
        path = folder / part / "model.onnx"
        onnx.save(convert_float_to_float16(onnx.load(path), keep_io_types=False,
                                           op_block_list=[*DEFAULT_OP_BLOCK_LIST, "Resize"]), path)
    serve_model("sd-fp16", folder)
    request = {"prompt": "a red cube", "negativePrompt": "blurry", "numSteps": 3, "guidanceScale": 4.0,
               "seed": 9}
    half = ort_device == "wasm" or page.evaluate(
        "async () => !!(await navigator.gpu?.requestAdapter())?.features.has('shader-f16')")
    if not half:
        with pytest.raises(Exception, match=r"ConfigError: session .* on webgpu: .*requires f16 but the"):
            in_page(page, "sd-fp16", [{"kind": "generate", "args": [request]}], ort_device)
        return
    run = in_page(page, "sd-fp16", [{"kind": "generate", "args": [request]}], ort_device)["runs"][0]
    expected = ortpipe.load(folder).generate("a red cube", negative_prompt="blurry", num_steps=3,
                                             guidance_scale=4.0, seed=9).image
    difference = float(np.abs(np.array(run["data"], np.float32).reshape(run["dims"]) - expected).max())
    print(f"{ort_device} float16 image: max |browser - CPython| = {difference:.1e}")
    assert difference <= FLOAT16_IMAGE


def test_refusals_reach_the_page(page: Any, serve_model: Any, vits_tiny: Path, sd_folder: Path) -> None:
    serve_model("vits-tiny", vits_tiny)
    serve_model("sd-tiny", sd_folder)
    page.goto("/")
    errors = page.evaluate("""async () => {
      const {load} = await import('./ortpipe.js');
      const errors = [];
      const attempt = async (f) => {
        try { await f(); errors.push(null); } catch (e) { errors.push(e.name + ': ' + e.message); }
      };
      const tts = await load('models/vits-tiny/', {device: 'wasm'});
      await attempt(() => tts.generate({prompt: 'hi', numSteps: 3}));
      await attempt(() => tts.embed(['hi']));
      tts.dispose();
      const sd = await load('models/sd-tiny/', {device: 'wasm'});
      await attempt(() => sd.generate({prompt: 'x', latents: {data: [1, 2], dims: [1, 4, 8, 8]}}));
      await attempt(() => sd.generate({prompt: 'x', numSteps: 0}));
      await attempt(() => sd.generate({prompt: 'x', images: [new ImageData(8, 8)], mask: 'no-mask.png'}));
      sd.dispose();
      return errors;
    }""")
    assert errors[0].startswith("GenerationError: num_steps is a setting of the denoising loop")
    assert errors[1].startswith("GenerationError: embed needs a folder whose outputs are embeddings")
    assert errors[2].startswith('GenerationError: input "latents" must be {data, dims}: a typed array')
    assert errors[3].startswith("GenerationError: num_steps 0 is out of range")
    missing = f"{page.url.rstrip('/')}/no-mask.png"
    assert errors[4] == f"GenerationError: the mask ({missing}): cannot fetch it (HTTP 404)"


def test_demo_page_plays_speech_and_shows_an_image(page: Any, serve_model: Any, vits_tiny: Path,
                                                   sd_folder: Path) -> None:
    serve_model("vits-tiny", vits_tiny)
    serve_model("sd-tiny", sd_folder)
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    page.set_viewport_size({"width": 1100, "height": 900})
    page.goto("/")
    for model, prompt, shot in [("models/vits-tiny/", "Hello world.", "demo-speech.png"),
                                ("models/sd-tiny/", "a red cube on a wooden table", "demo-image.png")]:
        page.fill("#model-url", model)
        page.select_option("#device", "wasm")
        page.fill("#prompt", prompt)
        page.click("#generate")
        page.wait_for_selector("#output[data-finish-reason], #error:not(:empty)", state="attached",
                           timeout=120_000)
        assert page.text_content("#error") == ""
        if "vits" in model:
            duration = page.eval_on_selector("#media audio", """async (audio) => {
              if (!audio.duration) {
                await new Promise((resolve) => audio.addEventListener('loadedmetadata', resolve));
              }
              return audio.duration;
            }""")
            assert duration == pytest.approx(464 / 16000, abs=1e-3)
            assert not page.is_visible("#denoising")
        else:
            assert page.is_visible("#denoising") and not page.is_visible("#max-new-tokens")
            size = page.eval_on_selector("#media canvas", "(c) => [c.width, c.height]")
            assert size == [32, 32]
        page.screenshot(path=str(SCREENSHOTS / shot), full_page=True)
        page.evaluate("() => delete document.getElementById('output').dataset.finishReason")


def test_demo_page_edits_an_image(page: Any, serve_model: Any, sd_folder: Path) -> None:
    """The demo page's image field and Strength box on a denoising folder: image-to-image, the canvas the
    pixels CPython makes of the same request (uint8, within one level of rounding)."""
    from build import paradigms

    init = paradigms.get("sd-tiny") / "references" / "init.png"
    serve_model("sd-tiny", sd_folder)
    expected = ortpipe.load(sd_folder).generate("a blue cube", images=[init], strength=0.5, num_steps=4,
                                                guidance_scale=3.0, negative_prompt="blurry", seed=6)
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    page.goto("/")
    page.fill("#model-url", "models/sd-tiny/")
    page.select_option("#device", "wasm")
    page.click("#load")  # the denoising fields show once the folder is loaded
    page.wait_for_selector("#denoising:not([hidden]), #error:not(:empty)", timeout=120_000)
    assert page.text_content("#error") == ""
    page.fill("#prompt", "a blue cube")
    page.set_input_files("#images", [str(init)])
    for field, value in (("#num-steps", "4"), ("#guidance-scale", "3"), ("#negative-prompt", "blurry"),
                         ("#image-seed", "6"), ("#strength", "0.5")):
        page.fill(field, value)
    page.click("#generate")
    page.wait_for_selector("#output[data-finish-reason], #error:not(:empty)", state="attached",
                           timeout=120_000)
    assert page.text_content("#error") == ""
    assert page.is_visible("#strength") and page.text_content("#status").startswith("2 steps")
    pixels = page.eval_on_selector("#media canvas", """(c) => Array.from(
      c.getContext('2d').getImageData(0, 0, c.width, c.height).data)""")
    shown = np.array(pixels, np.int32).reshape(32, 32, 4)
    made = np.round(expected.image[0] * 255).astype(np.int32)
    assert expected.timings.steps == 2 and (shown[..., 3] == 255).all()
    assert np.abs(shown[..., :3] - made).max() <= 1
    assert not page.is_visible("#output")  # the image alone: no empty text box under it
    page.screenshot(path=str(SCREENSHOTS / "demo-image-to-image.png"), full_page=True)

    # the mask field: inpainting (white repainted), the strength box's 0.5 with it
    mask = init.with_name("mask.png")
    inpainted = ortpipe.load(sd_folder).generate("a blue cube", images=[init], mask=mask, strength=0.5,
                                                 num_steps=4, guidance_scale=3.0, negative_prompt="blurry",
                                                 seed=6)
    page.evaluate("() => { delete document.getElementById('output').dataset.finishReason; "
                  "document.getElementById('media').replaceChildren(); }")
    page.set_input_files("#mask", [str(mask)])
    page.click("#generate")
    page.wait_for_selector("#output[data-finish-reason], #error:not(:empty)", state="attached",
                           timeout=120_000)
    assert page.text_content("#error") == ""
    pixels = page.eval_on_selector("#media canvas", """(c) => Array.from(
      c.getContext('2d').getImageData(0, 0, c.width, c.height).data)""")
    shown = np.array(pixels, np.int32).reshape(32, 32, 4)[..., :3]
    assert np.abs(shown - np.round(inpainted.image[0] * 255).astype(np.int32)).max() <= 1
    assert np.abs(inpainted.image - expected.image).max() > 1e-2  # the mask made another image
    page.screenshot(path=str(SCREENSHOTS / "demo-inpainting.png"), full_page=True)


def test_wasm_musicgen_equals_transformers(page: Any, serve_model: Any) -> None:
    """The detected MusicGen folder in the browser: transformers' codes and audio (within 1e-4), with and
    without guidance; seeded sampling gives CPython's codes."""
    from build import musicgen

    folder = musicgen.get()
    cases = _json(folder / "references" / "cases.json")["cases"]
    sampled = {**cases[-1], "extra": {"doSample": True, "seed": 5, "topK": 50, "temperature": 1.2}}
    serve_model("musicgen-tiny", folder)
    page.goto("/")
    runs = page.evaluate("""async ({model, cases}) => {
      const {load} = await import('./ortpipe.js');
      const pipe = await load(model, {device: 'wasm'});
      try {
        const runs = [];
        for (const c of cases) {
          const result = await pipe.generate({prompt: c.prompt, maxNewTokens: c.max_new_tokens,
                                              guidanceScale: c.guidance_scale, ...(c.extra || {})});
          const out = result.outputs;
          runs.push({codes: Array.from(out.codes.data, Number), dims: out.codes.dims,
                     audio: Array.from(out.audio_values.audio), rate: out.audio_values.samplingRate,
                     finishReason: result.finishReason});
        }
        return runs;
      } finally {
        pipe.dispose();
      }
    }""", {"model": "models/musicgen-tiny/", "cases": [*cases, sampled]})
    expected = ortpipe.load(folder).generate(sampled["prompt"], max_new_tokens=sampled["max_new_tokens"],
                                             guidance_scale=sampled["guidance_scale"], do_sample=True, seed=5,
                                             top_k=50, temperature=1.2).outputs["codes"].tolist()
    assert expected != sampled["codes"]  # sampling changed the codes: the comparison can fail
    assert np.array(runs[-1]["codes"]).reshape(runs[-1]["dims"]).tolist() == expected
    for case, run in zip(cases, runs[:-1], strict=True):
        assert np.array(run["codes"]).reshape(run["dims"]).tolist() == case["codes"]
        reference = np.load(folder / "references" / case["audio"]).reshape(-1)
        difference = float(np.abs(np.array(run["audio"], np.float32) - reference).max())
        print(f"wasm musicgen, guidance {case['guidance_scale']}: max |browser - transformers| = "
              f"{difference:.1e}")
        assert run["rate"] == 800 and run["finishReason"] == "done" and difference <= 1e-4


def test_wasm_final_step_after_the_token_loop(page: Any, serve_model: Any,
                                              tmp_path_factory: pytest.TempPathFactory) -> None:
    """A plain decoder with a final vocoder on "generated.ids": the browser's tokens and waveform are
    CPython's (which tests/test_final_steps.py checks against hand-written loops)."""
    from build import graphs
    from tests.test_final_steps import _config, _vocoder

    folder = graphs.build_separate(tmp_path_factory.mktemp("web-final") / "tts")
    _vocoder(folder / "vocoder.onnx")
    (folder / "genai_config.json").write_text(json.dumps(_config()))
    prompt = [graphs.BOS, 5, 9, 14]
    expected = ortpipe.load(folder).generate(prompt_ids=prompt, max_new_tokens=7)
    serve_model("final-tts", folder)
    page.goto("/")
    got = page.evaluate("""async ({model, prompt}) => {
      const {load} = await import('./ortpipe.js');
      const pipe = await load(model, {device: 'wasm'});
      try {
        const result = await pipe.generate({promptIds: prompt, maxNewTokens: 7});
        const out = result.outputs.waveform;
        return {tokens: result.tokens, audio: Array.from(out.audio), rate: out.samplingRate};
      } finally {
        pipe.dispose();
      }
    }""", {"model": "models/final-tts/", "prompt": prompt})
    assert got["tokens"] == expected.tokens and got["rate"] == 16000
    assert np.abs(np.array(got["audio"], np.float32) - expected.outputs["waveform"].reshape(-1)).max() <= 1e-6
