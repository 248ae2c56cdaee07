"""Plain onnxruntime loops over the folders of build/paradigms.py, written by hand with numpy: what ortpipe's
single_pass and denoising loops are tested against (issue 16).

- `embed`: a sentence-transformers folder's onnx/model.onnx, then its pooling (mean or CLS) and optional
  Normalize, as sentence-transformers computes them.
- `speak`: a VITS folder's onnx/model.onnx, one run; `vits_ids` tokenizes as transformers' VitsTokenizer.
- `generate_image`: Stable Diffusion over optimum's folder: the text encoder, the UNet once per step with
  classifier-free guidance as one batch [unconditional, conditional], a scheduler, the VAE decoder.
  The schedulers are numpy ports of diffusers 0.42's (`make_scheduler`): Euler, Euler ancestral, DDIM
  and TCD (eta 0 to 1), LCM and DPM-Solver++ multistep (orders 1-2), with epsilon and v_prediction and the
  three timestep spacings. The ancestral and LCM schedulers take their per-step noise as an argument.
- `image_to_image`: StableDiffusionImg2ImgPipeline over the same folder: the VAE encoder's latents of an
  image, noised to the first timestep that `strength` keeps, then the same loop from there on.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import numpy as np
import onnxruntime as ort

Arrays = Mapping[str, np.ndarray]


def session(path: Path | str) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def run(s: ort.InferenceSession, feeds: Arrays) -> dict[str, np.ndarray]:
    """Runs with the feeds the graph takes (others are dropped); every output by name."""
    names = {i.name for i in s.get_inputs()}
    outputs = [o.name for o in s.get_outputs()]
    return dict(zip(outputs, s.run(outputs, {k: v for k, v in feeds.items() if k in names}), strict=True))


# --- sentence embeddings -------------------------------------------------------------------------

def pooling_mode(folder: Path) -> str:
    """"mean" or "cls" from 1_Pooling/config.json, in sentence-transformers' current or legacy keys."""
    modules = json.loads((folder / "modules.json").read_text())
    pooling = next(m for m in modules if m["type"].endswith("Pooling"))
    config = json.loads((folder / pooling["path"] / "config.json").read_text())
    mode = config.get("pooling_mode")
    if mode is None:  # legacy: one boolean per mode
        mode = [k.removeprefix("pooling_mode_") for k, v in config.items()
                if k.startswith("pooling_mode_") and v]
        mode = {"mean_tokens": "mean", "cls_token": "cls"}.get(mode[0], mode[0]) if len(mode) == 1 else mode
    if mode not in ("mean", "cls"):
        raise ValueError(f"pooling {mode!r} is not written by hand here")
    return mode


def normalizes(folder: Path) -> bool:
    return any(m["type"].endswith("Normalize") for m in json.loads((folder / "modules.json").read_text()))


def embed(folder: Path | str, inputs: Arrays) -> np.ndarray:
    """Pooled (and normalised, if the folder says so) embeddings [batch, hidden] of a padded batch."""
    folder = Path(folder)
    hidden = run(session(folder / "onnx" / "model.onnx"), inputs)["last_hidden_state"].astype(np.float64)
    mask = np.asarray(inputs["attention_mask"], dtype=np.float64)[:, :, None]
    if pooling_mode(folder) == "mean":
        pooled = (hidden * mask).sum(axis=1) / np.maximum(mask.sum(axis=1), 1e-9)
    else:
        pooled = hidden[:, 0]
    if normalizes(folder):  # torch.nn.functional.normalize: x / max(||x||, 1e-12)
        pooled = pooled / np.maximum(np.linalg.norm(pooled, axis=1, keepdims=True), 1e-12)
    return pooled.astype(np.float32)


# --- VITS ----------------------------------------------------------------------------------------

def vits_ids(folder: Path | str, text: str) -> list[int]:
    """transformers' VitsTokenizer without phonemizer or uroman: lower-case, keep the characters in the
    vocabulary, strip, then (add_blank) the blank id 0 before, between and after them."""
    folder = Path(folder)
    vocab = json.loads((folder / "vocab.json").read_text())
    config = json.loads((folder / "tokenizer_config.json").read_text())
    if config.get("phonemize") or config.get("is_uroman"):
        raise ValueError("phonemized or romanised VITS tokenizers are not written by hand here")
    if config.get("normalize", True):
        text = "".join(c for c in text.lower() if c in vocab).strip()
    ids = [vocab[c] for c in text]
    if config.get("add_blank", True):
        ids = [i for token in ids for i in (0, token)] + [0]
    return ids


def speak(folder: Path | str, input_ids: Sequence[int]) -> np.ndarray:
    """The waveform [1, samples] of one text."""
    ids = np.array([input_ids], dtype=np.int64)
    feeds = {"input_ids": ids, "attention_mask": np.ones_like(ids)}
    return run(session(Path(folder) / "onnx" / "model.onnx"), feeds)["waveform"]


# --- schedulers (numpy ports of diffusers 0.42) --------------------------------------------------

def alphas_cumprod(config: Mapping) -> np.ndarray:
    start, end, count = config["beta_start"], config["beta_end"], config["num_train_timesteps"]
    if config.get("trained_betas"):
        betas = np.asarray(config["trained_betas"], dtype=np.float64)
    elif config["beta_schedule"] == "scaled_linear":
        betas = np.linspace(start**0.5, end**0.5, count) ** 2
    elif config["beta_schedule"] == "linear":
        betas = np.linspace(start, end, count)
    else:
        raise ValueError(f"beta_schedule {config['beta_schedule']!r} is not written by hand here")
    cumprod = np.cumprod(1.0 - betas)
    if config.get("rescale_betas_zero_snr"):  # the last timestep's signal shifted to zero, the first kept
        root = np.sqrt(cumprod)
        root = (root - root[-1]) * root[0] / (root[0] - root[-1])
        bar = root**2
        cumprod = np.cumprod(np.concatenate([bar[:1], bar[1:] / bar[:-1]]))
        if config["_class_name"] in ("EulerDiscreteScheduler", "EulerAncestralDiscreteScheduler",
                                     "DPMSolverMultistepScheduler"):
            cumprod[-1] = 2.0**-24
    return cumprod


def spaced(config: Mapping, steps: int, spacing: str | None = None) -> np.ndarray:
    """diffusers' timestep spacings (Table 2 of arXiv 2305.08891), float, descending, not rounded."""
    count, spacing = config["num_train_timesteps"], spacing or config["timestep_spacing"]
    if spacing == "linspace":
        return np.linspace(0, count - 1, steps)[::-1].copy()
    if spacing == "leading":
        return (np.arange(steps) * (count // steps)).round()[::-1] + config.get("steps_offset", 0)
    if spacing == "trailing":
        return np.arange(count, 0, -count / steps).round() - 1
    raise ValueError(f"timestep_spacing {spacing!r}; expected linspace, leading or trailing")


def _check(config: Mapping, **allowed) -> None:
    """Refuse a config field this port does not follow (diffusers' default first in each tuple)."""
    for key, values in allowed.items():
        if config.get(key, values[0]) not in values:
            raise ValueError(f"{config['_class_name']}: {key}={config[key]!r} is not written by hand here")


def karras_sigmas(sigma_max: float, sigma_min: float, steps: int) -> np.ndarray:
    """Karras et al.'s (arXiv 2206.00364) noise levels, rho 7: even steps in sigma ** (1 / rho)."""
    rho = 7.0
    ramp = np.linspace(0.0, 1.0, steps)
    return (sigma_max ** (1 / rho) + ramp * (sigma_min ** (1 / rho) - sigma_max ** (1 / rho))) ** rho


def exponential_sigmas(sigma_max: float, sigma_min: float, steps: int) -> np.ndarray:
    """Noise levels evenly spaced in log sigma."""
    return np.exp(np.linspace(math.log(sigma_max), math.log(sigma_min), steps))


def beta_sigmas(sigma_max: float, sigma_min: float, steps: int, shape: float = 0.6) -> np.ndarray:
    """Noise levels at the quantiles 1 ... 0 (evenly spaced) of Beta(shape, shape) (arXiv 2407.12173), the
    distribution function summed as its power series, B_x(a, b) = sum (1 - b)_n x^(a + n) / (n! (a + n))
    (for x up to 1/2; above, by the symmetry of a = b), and inverted by bisection."""
    a = b = shape
    whole = math.exp(math.lgamma(a) + math.lgamma(b) - math.lgamma(a + b))

    def cdf(x: float) -> float:
        if x > 0.5:
            return 1.0 - cdf(1.0 - x)
        n = np.arange(200)
        rising = np.concatenate([[1.0], np.cumprod((1 - b + n[:-1]) / (n[:-1] + 1))])  # (1 - b)_n / n!
        return float(np.sum(rising * x ** (a + n) / (a + n))) / whole

    def quantile(p: float) -> float:
        low, high = 0.0, 1.0
        for _ in range(100):
            middle = (low + high) / 2
            low, high = (middle, high) if cdf(middle) < p else (low, middle)
        return (low + high) / 2

    return np.array([sigma_min + quantile(p) * (sigma_max - sigma_min) for p in 1 - np.linspace(0, 1, steps)])


def sigma_to_t(sigmas: np.ndarray, all_sigmas: np.ndarray) -> np.ndarray:
    """The fractional training timesteps of `sigmas`: linear interpolation of t in log sigma between the
    two training sigmas around each (clipped to the table's ends), as diffusers maps Karras sigmas."""
    logs = np.log(all_sigmas)
    wanted = np.log(np.maximum(sigmas, 1e-10))
    low = np.clip(np.searchsorted(logs, wanted, side="right") - 1, 0, len(logs) - 2)
    weight = np.clip((logs[low] - wanted) / (logs[low] - logs[low + 1]), 0.0, 1.0)
    return low + weight


def _x0_from_sigma(config: Mapping, output: np.ndarray, x: np.ndarray, sigma: float) -> np.ndarray:
    """The denoised sample in the sigma (variance-exploding) parametrisation of Euler."""
    if config["prediction_type"] == "epsilon":
        return x - sigma * output
    if config["prediction_type"] == "v_prediction":
        return output * (-sigma / (sigma**2 + 1) ** 0.5) + x / (sigma**2 + 1)
    raise ValueError(f"prediction_type {config['prediction_type']!r}")


def _x0_from_alpha(config: Mapping, output: np.ndarray, x: np.ndarray, alpha_prod: float) -> np.ndarray:
    """The denoised sample in the alpha (variance-preserving) parametrisation of DDIM and LCM."""
    if config["prediction_type"] == "epsilon":
        return (x - (1 - alpha_prod) ** 0.5 * output) / alpha_prod**0.5
    if config["prediction_type"] == "v_prediction":
        return alpha_prod**0.5 * x - (1 - alpha_prod) ** 0.5 * output
    raise ValueError(f"prediction_type {config['prediction_type']!r}")


def _noised_by_alpha(cumprod: np.ndarray, t: int, sample: np.ndarray, noise: np.ndarray) -> np.ndarray:
    """The forward process of the alpha (variance-preserving) schedulers at training timestep t."""
    return cumprod[t] ** 0.5 * sample + (1 - cumprod[t]) ** 0.5 * noise


class _AlphaSteps:
    """What DDIM and TCD share: one run a step on the unscaled latents, the alpha schedulers' forward process,
    and the model's own epsilon."""

    order = 1

    def scale_model_input(self, x: np.ndarray, i: int) -> np.ndarray:
        return x

    def add_noise(self, sample: np.ndarray, noise: np.ndarray, i: int) -> np.ndarray:
        return _noised_by_alpha(self.cumprod, self.timesteps[i], sample, noise)

    def epsilon(self, output: np.ndarray, x: np.ndarray, alpha_prod: float) -> np.ndarray:
        if self.config["prediction_type"] == "v_prediction":
            return alpha_prod**0.5 * output + (1 - alpha_prod) ** 0.5 * x
        return output


class Euler:
    """EulerDiscreteScheduler (s_churn 0) and, with `ancestral`, EulerAncestralDiscreteScheduler.

    Every scheduler here has `order` (UNet runs per step, what an image-to-image start index is counted
    in) and `add_noise(sample, noise, i)`: the sample noised to the level of run i of the schedule."""

    order = 1

    def __init__(self, config: Mapping, steps: int, ancestral: bool = False) -> None:
        _check(config, interpolation_type=("linear",), use_karras_sigmas=(False, True),
               final_sigmas_type=("zero", "sigma_min"), timestep_type=("discrete",),
               use_exponential_sigmas=(False, True), use_beta_sigmas=(False, True))
        if ancestral and config.get("use_karras_sigmas"):
            raise ValueError("EulerAncestralDiscreteScheduler has no Karras sigmas")
        self.config, self.ancestral = config, ancestral
        cumprod = alphas_cumprod(config)
        self.timesteps = spaced(config, steps).astype(np.float32).astype(np.float64)
        all_sigmas = ((1 - cumprod) / cumprod) ** 0.5
        sigmas = np.interp(self.timesteps, np.arange(len(all_sigmas)), all_sigmas)
        spread = karras_sigmas if config.get("use_karras_sigmas") else (
            exponential_sigmas if config.get("use_exponential_sigmas") else (
                beta_sigmas if config.get("use_beta_sigmas") else None))
        if spread:  # between the spaced ends, unless the config names its own
            high, low = config.get("sigma_max"), config.get("sigma_min")
            high, low = sigmas[0] if high is None else high, sigmas[-1] if low is None else low
            sigmas = spread(high, low, steps)
            self.timesteps = sigma_to_t(sigmas, all_sigmas).astype(np.float32).astype(np.float64)
        last = all_sigmas[0] if config.get("final_sigmas_type", "zero") == "sigma_min" else 0.0
        self.sigmas = np.append(sigmas, last)
        top = self.sigmas.max()
        # PITFALLS: linspace and trailing start from the largest sigma itself, leading from sqrt(sigma^2 + 1)
        exact = config["timestep_spacing"] in ("linspace", "trailing")
        self.init_noise_sigma = top if exact else (top**2 + 1) ** 0.5
        self.noise_steps = list(range(steps)) if ancestral else []

    def scale_model_input(self, x: np.ndarray, i: int) -> np.ndarray:
        return x / (self.sigmas[i] ** 2 + 1) ** 0.5

    def add_noise(self, sample: np.ndarray, noise: np.ndarray, i: int) -> np.ndarray:
        return sample + self.sigmas[i] * noise

    def step(self, output: np.ndarray, i: int, x: np.ndarray, noise: np.ndarray | None) -> np.ndarray:
        sigma, sigma_next = self.sigmas[i], self.sigmas[i + 1]
        derivative = (x - _x0_from_sigma(self.config, output, x, sigma)) / sigma
        if not self.ancestral:
            return x + derivative * (sigma_next - sigma)
        up = (sigma_next**2 * (sigma**2 - sigma_next**2) / sigma**2) ** 0.5
        down = (sigma_next**2 - up**2) ** 0.5
        return x + derivative * (down - sigma) + noise * up


class DDIM(_AlphaSteps):
    """DDIMScheduler; with eta above 0, every step adds noise, eta times the square root of its variance."""

    def __init__(self, config: Mapping, steps: int, eta: float = 0.0) -> None:
        _check(config, thresholding=(False,))
        self.config, self.steps, self.eta = config, steps, eta
        self.cumprod = alphas_cumprod(config)
        self.final = 1.0 if config.get("set_alpha_to_one", True) else self.cumprod[0]
        self.timesteps = spaced(config, steps).round().astype(np.int64)
        self.init_noise_sigma = 1.0
        self.noise_steps = list(range(steps)) if eta > 0 else []  # diffusers draws at every step then

    def step(self, output: np.ndarray, i: int, x: np.ndarray, noise: np.ndarray | None) -> np.ndarray:
        t = self.timesteps[i]
        prev = t - self.config["num_train_timesteps"] // self.steps  # whatever the spacing, as diffusers does
        a_t = self.cumprod[t]
        a_prev = self.cumprod[prev] if prev >= 0 else self.final
        x0 = _x0_from_alpha(self.config, output, x, a_t)
        if self.config.get("clip_sample", True):
            limit = self.config.get("clip_sample_range", 1.0)
            x0 = np.clip(x0, -limit, limit)
        # the model's own epsilon, even after clipping (the pipeline never asks for use_clipped_model_output)
        eps = self.epsilon(output, x, a_t)
        variance = (1 - a_prev) / (1 - a_t) * (1 - a_t / a_prev)
        std = self.eta * variance**0.5
        x_prev = a_prev**0.5 * x0 + (1 - a_prev - std**2) ** 0.5 * eps
        if self.eta > 0:
            if noise is None:
                raise ValueError(f"DDIM step {i} with eta {self.eta} needs its noise")
            x_prev = x_prev + std * noise
        return x_prev


class TCD(_AlphaSteps):
    """TCDScheduler: LCM's timesteps; each step to x0 noised to s = floor((1 - eta) * the next timestep) (0
    after the last; float32's product, as torch computes it), then, but at the last, forward to the next
    timestep with noise."""

    def __init__(self, config: Mapping, steps: int, eta: float = 0.0) -> None:
        _check(config, prediction_type=("epsilon", "v_prediction"))
        self.config, self.steps, self.eta = config, steps, eta
        self.cumprod = alphas_cumprod(config)
        original = config.get("original_inference_steps", 50)
        stride = config["num_train_timesteps"] // original
        origin = (np.arange(1, original + 1) * stride - 1)[::-1]
        picked = np.floor(np.linspace(0, len(origin), num=steps, endpoint=False)).astype(np.int64)
        self.timesteps = origin[picked]
        self.init_noise_sigma = 1.0
        self.noise_steps = list(range(steps - 1)) if eta > 0 else []  # every step but the last draws

    def step(self, output: np.ndarray, i: int, x: np.ndarray, noise: np.ndarray | None) -> np.ndarray:
        t = self.timesteps[i]
        after = self.timesteps[i + 1] if i + 1 < self.steps else 0
        s = int(np.floor(np.float32(1 - self.eta) * np.float32(after)))
        a_t, a_after, a_s = self.cumprod[t], self.cumprod[after], self.cumprod[s]
        x0 = _x0_from_alpha(self.config, output, x, a_t)
        x_s = a_s**0.5 * x0 + (1 - a_s) ** 0.5 * self.epsilon(output, x, a_t)
        if self.eta > 0 and i != self.steps - 1:
            if noise is None:
                raise ValueError(f"TCD step {i} with eta {self.eta} needs its noise")
            return (a_after / a_s) ** 0.5 * x_s + (1 - a_after / a_s) ** 0.5 * noise
        return x_s


class DDPM:
    """DDPMScheduler over a spaced schedule, fixed variances (small or large): noise at every timestep
    above 0."""

    order = 1

    def __init__(self, config: Mapping, steps: int) -> None:
        _check(config, thresholding=(False,), variance_type=("fixed_small", "fixed_small_log", "fixed_large"))
        self.config, self.steps = config, steps
        self.cumprod = alphas_cumprod(config)
        count = config["num_train_timesteps"]
        spacing = config.get("timestep_spacing", "leading")
        if spacing == "linspace":
            self.timesteps = np.linspace(0, count - 1, steps).round()[::-1].astype(np.int64)
        elif spacing == "leading":
            self.timesteps = (np.arange(steps) * (count // steps)).round()[::-1].astype(np.int64)
            self.timesteps += config.get("steps_offset", 0)
        else:
            self.timesteps = np.round(np.arange(count, 0, -count / steps)).astype(np.int64) - 1
        self.init_noise_sigma = 1.0
        self.noise_steps = [i for i, t in enumerate(self.timesteps) if t > 0]

    def scale_model_input(self, x: np.ndarray, i: int) -> np.ndarray:
        return x

    def add_noise(self, sample: np.ndarray, noise: np.ndarray, i: int) -> np.ndarray:
        return _noised_by_alpha(self.cumprod, self.timesteps[i], sample, noise)

    def step(self, output: np.ndarray, i: int, x: np.ndarray, noise: np.ndarray | None) -> np.ndarray:
        t = self.timesteps[i]
        prev = self.timesteps[i + 1] if i + 1 < len(self.timesteps) else -1
        a_t = self.cumprod[t]
        a_prev = self.cumprod[prev] if prev >= 0 else 1.0
        beta_t = 1 - a_t / a_prev
        x0 = _x0_from_alpha(self.config, output, x, a_t)
        if self.config.get("clip_sample", True):
            limit = self.config.get("clip_sample_range", 1.0)
            x0 = np.clip(x0, -limit, limit)
        mean = (a_prev**0.5 * beta_t / (1 - a_t)) * x0 + ((1 - beta_t) ** 0.5 * (1 - a_prev) / (1 - a_t)) * x
        if t == 0:
            return mean
        if noise is None:
            raise ValueError(f"DDPM step {i} (timestep {t}) needs its noise")
        if self.config.get("variance_type", "fixed_small") == "fixed_large":
            return mean + beta_t**0.5 * noise
        return mean + max((1 - a_prev) / (1 - a_t) * beta_t, 1e-20) ** 0.5 * noise


class LCM:
    """LCMScheduler: the timesteps are a subset of its `original_inference_steps` schedule (no spacing)."""

    order = 1

    def __init__(self, config: Mapping, steps: int, strength: float = 1.0) -> None:
        """`strength`: image-to-image's schedule, picked from the first int(original * strength) of the
        original schedule's timesteps (set_timesteps(strength=...), as LatentConsistencyModelImg2ImgPipeline
        calls it)."""
        _check(config, thresholding=(False,), clip_sample=(False,))
        self.config, self.steps = config, steps
        self.cumprod = alphas_cumprod(config)
        self.final = 1.0 if config.get("set_alpha_to_one", True) else self.cumprod[0]
        original = config.get("original_inference_steps", 50)
        kept = int(original * strength)
        origin = (np.arange(1, kept + 1) * (config["num_train_timesteps"] // original) - 1)[::-1]
        self.timesteps = origin[np.floor(np.linspace(0, len(origin), steps, endpoint=False)).astype(np.int64)]
        self.init_noise_sigma = 1.0
        self.noise_steps = list(range(steps - 1))  # no noise after the last step

    def scale_model_input(self, x: np.ndarray, i: int) -> np.ndarray:
        return x

    def add_noise(self, sample: np.ndarray, noise: np.ndarray, i: int) -> np.ndarray:
        return _noised_by_alpha(self.cumprod, self.timesteps[i], sample, noise)

    def step(self, output: np.ndarray, i: int, x: np.ndarray, noise: np.ndarray | None) -> np.ndarray:
        t = self.timesteps[i]
        prev = self.timesteps[i + 1] if i + 1 < self.steps else t
        a_t, a_prev = self.cumprod[t], (self.cumprod[prev] if prev >= 0 else self.final)
        scaled = t * self.config.get("timestep_scaling", 10.0)
        c_skip, c_out = 0.25 / (scaled**2 + 0.25), scaled / (scaled**2 + 0.25) ** 0.5  # sigma_data 0.5
        denoised = c_out * _x0_from_alpha(self.config, output, x, a_t) + c_skip * x
        if i == self.steps - 1:
            return denoised
        return a_prev**0.5 * denoised + (1 - a_prev) ** 0.5 * noise


class DPMSolverMultistep:
    """DPMSolverMultistepScheduler, algorithm dpmsolver++ of order 1 or 2 (midpoint or heun), no noise.

    Started at a later run (image to image), its order warms up again from there (it counts the outputs
    it has been given), while its lower orders at the end still look at the whole schedule's length."""

    order = 1

    def __init__(self, config: Mapping, steps: int) -> None:
        _check(config, algorithm_type=("dpmsolver++", "sde-dpmsolver++"), solver_order=(2, 1, 3),
               solver_type=("midpoint", "heun"),
               final_sigmas_type=("zero", "sigma_min"), thresholding=(False,),
               use_karras_sigmas=(False, True), use_lu_lambdas=(False,), use_exponential_sigmas=(False,),
               use_beta_sigmas=(False,), use_flow_sigmas=(False,), lambda_min_clipped=(-math.inf, None),
               variance_type=(None,))
        self.config, self.steps = config, steps
        cumprod = alphas_cumprod(config)
        count = config["num_train_timesteps"]
        if config["timestep_spacing"] == "linspace":  # steps + 1 points, the last (0) dropped
            self.timesteps = np.linspace(0, count - 1, steps + 1).round()[::-1][:-1].astype(np.int64)
        elif config["timestep_spacing"] == "leading":
            ratio = count // (steps + 1)
            self.timesteps = (np.arange(steps + 1) * ratio).round()[::-1][:-1].astype(np.int64)
            self.timesteps += config.get("steps_offset", 0)
        else:
            self.timesteps = spaced(config, steps).astype(np.int64)
        all_sigmas = ((1 - cumprod) / cumprod) ** 0.5
        last = all_sigmas[0] if config.get("final_sigmas_type", "zero") == "sigma_min" else 0.0
        if config.get("use_karras_sigmas"):  # over the whole training range, whatever the spacing
            sigmas = karras_sigmas(all_sigmas[-1], all_sigmas[0], steps)
            self.timesteps = sigma_to_t(sigmas, all_sigmas).round().astype(np.int64)
        else:
            sigmas = np.interp(self.timesteps, np.arange(count), all_sigmas)
        self.sigmas = np.append(sigmas, last)
        self.sde = config.get("algorithm_type", "dpmsolver++") == "sde-dpmsolver++"
        self.init_noise_sigma = 1.0
        self.noise_steps = list(range(steps)) if self.sde else []  # the SDE draws at every step
        self.outputs: list[np.ndarray] = []

    def scale_model_input(self, x: np.ndarray, i: int) -> np.ndarray:
        return x

    def add_noise(self, sample: np.ndarray, noise: np.ndarray, i: int) -> np.ndarray:
        alpha, sigma = self._alpha_sigma_lambda(self.sigmas[i])[:2]
        return alpha * sample + sigma * noise

    @staticmethod
    def _alpha_sigma_lambda(sigma: float) -> tuple[float, float, float]:
        alpha = 1 / (sigma**2 + 1) ** 0.5
        return alpha, sigma * alpha, (math.inf if sigma == 0 else math.log(alpha) - math.log(sigma * alpha))

    def _order(self, i: int) -> int:
        """The solver's order at step i: lower at the start, and at the end as the config says."""
        config = self.config
        few = config.get("lower_order_final", True) and self.steps < 15
        if i == self.steps - 1 and (config.get("euler_at_final", False) or few
                                    or config.get("final_sigmas_type", "zero") == "zero"):
            return 1
        order = min(config.get("solver_order", 2), len(self.outputs))
        return min(order, 2) if i == self.steps - 2 and few else order

    def _differences(self, order: int, i: int, h: float, lambda_s0: float) -> tuple[np.ndarray, np.ndarray]:
        """D1 and D2 of the multistep update from the clean latents of this step and the ones before."""
        x0 = self.outputs[-1]
        d1 = d2 = np.zeros_like(x0)
        if order >= 2:
            lambda_s1 = self._alpha_sigma_lambda(self.sigmas[i - 1])[2]
            r0 = (lambda_s0 - lambda_s1) / h
            d1 = (x0 - self.outputs[-2]) / r0
        if order == 3:
            r1 = (lambda_s1 - self._alpha_sigma_lambda(self.sigmas[i - 2])[2]) / h
            d1_1 = (self.outputs[-2] - self.outputs[-3]) / r1
            d1, d2 = d1 + r0 / (r0 + r1) * (d1 - d1_1), (d1 - d1_1) / (r0 + r1)
        return d1, d2

    def step(self, output: np.ndarray, i: int, x: np.ndarray, noise: np.ndarray | None) -> np.ndarray:
        config = self.config
        alpha_s0, sigma_s0, lambda_s0 = self._alpha_sigma_lambda(self.sigmas[i])
        alpha_t, sigma_t, lambda_t = self._alpha_sigma_lambda(self.sigmas[i + 1])
        if config["prediction_type"] == "epsilon":
            x0 = (x - sigma_s0 * output) / alpha_s0
        elif config["prediction_type"] == "v_prediction":
            x0 = alpha_s0 * x - sigma_s0 * output
        else:
            raise ValueError(f"prediction_type {config['prediction_type']!r}")
        self.outputs.append(x0)
        order = self._order(i)
        decay = math.exp(-(lambda_t - lambda_s0))  # exp(-h); 0 when the next sigma is 0
        h = lambda_t - lambda_s0
        d1, d2 = self._differences(order, i, h, lambda_s0)
        midpoint = config.get("solver_type", "midpoint") == "midpoint"
        if self.sde:  # exp(-2h) for exp(-h), x decayed by exp(-h) more, noise sigma_t sqrt(1 - exp(-2h))
            if noise is None:
                raise ValueError(f"sde-dpmsolver++ step {i} needs its noise")
            kept = 1.0 - decay * decay
            out = (sigma_t / sigma_s0 * decay) * x + alpha_t * kept * x0 + sigma_t * kept**0.5 * noise
            if order == 2 and midpoint:
                return out + 0.5 * alpha_t * kept * d1
            if order >= 2:
                out = out + alpha_t * (kept / (-2.0 * h) + 1.0) * d1
            if order == 3:
                out = out + alpha_t * ((kept - 2.0 * h) / (2.0 * h) ** 2 - 0.5) * d2
            return out
        out = (sigma_t / sigma_s0) * x - alpha_t * (decay - 1.0) * x0
        if order == 2 and midpoint:
            return out - 0.5 * alpha_t * (decay - 1.0) * d1
        if order >= 2:
            out = out + alpha_t * ((decay - 1.0) / h + 1.0) * d1
        if order == 3:
            out = out - alpha_t * ((decay - 1.0 + h) / h**2 - 0.5) * d2
        return out


class DPMSolverSinglestep(DPMSolverMultistep):
    """DPMSolverSinglestepScheduler, dpmsolver++ (midpoint or heun) of order 1 to 3, as diffusers' step: the
    order list of its set_timesteps (groups 1, 2, ...), each step of a group updating from the sample the
    group began with (kept here) and the group's x0s; DPM-Solver's linspace timesteps whatever the
    spacing. Started at a later run (image to image), a group cut there starts lower (no x0s before)."""

    def __init__(self, config: Mapping, steps: int) -> None:
        _check(config, algorithm_type=("dpmsolver++",), rescale_betas_zero_snr=(False, None))
        super().__init__({**config, "timestep_spacing": "linspace"}, steps)
        order = config.get("solver_order", 2)
        final_zero = config.get("final_sigmas_type", "zero") == "zero"
        lower = config.get("lower_order_final", False) or steps % order != 0 or final_zero
        if not lower:
            orders = [1, 2, 3][:order] * (steps // order)
        elif order == 3:
            orders = {0: [1, 2, 3] * (steps // 3 - 1) + [1, 2, 1], 1: [1, 2, 3] * (steps // 3) + [1],
                      2: [1, 2, 3] * (steps // 3) + [1, 2]}[steps % 3]
        elif order == 2:
            orders = [1, 2] * (steps // 2 - 1) + [1, 1] if steps % 2 == 0 else [1, 2] * (steps // 2) + [1]
        else:
            orders = [1] * steps
        if final_zero:
            orders[-1] = 1
        self.orders, self.group_sample = orders, None

    def step(self, output: np.ndarray, i: int, x: np.ndarray, noise: np.ndarray | None) -> np.ndarray:
        lam = [self._alpha_sigma_lambda(self.sigmas[k]) for k in range(max(i - 2, 0), i + 2)]
        (alpha_s0, sigma_s0, lambda_s0), (alpha_t, sigma_t, lambda_t) = lam[-2], lam[-1]
        if self.config["prediction_type"] == "epsilon":
            x0 = (x - sigma_s0 * output) / alpha_s0
        else:
            x0 = alpha_s0 * x - sigma_s0 * output
        self.outputs.append(x0)
        order = min(self.orders[i], len(self.outputs))  # no outputs before a later start
        if order == 1:
            self.group_sample = x
        sample, m = self.group_sample, self.outputs
        heun = self.config.get("solver_type", "midpoint") == "heun"
        if order == 1:
            return (sigma_t / sigma_s0) * sample - alpha_t * (np.exp(-(lambda_t - lambda_s0)) - 1.0) * m[-1]
        if order == 2:
            sigma_s1, lambda_s1 = lam[-3][1], lam[-3][2]
            h = lambda_t - lambda_s1
            r0 = (lambda_s0 - lambda_s1) / h
            d0, d1 = m[-2], (m[-1] - m[-2]) / r0
            out = (sigma_t / sigma_s1) * sample - alpha_t * (np.exp(-h) - 1.0) * d0
            if heun:
                return out + alpha_t * ((np.exp(-h) - 1.0) / h + 1.0) * d1
            return out - 0.5 * alpha_t * (np.exp(-h) - 1.0) * d1
        sigma_s2, lambda_s2, lambda_s1 = lam[-4][1], lam[-4][2], lam[-3][2]
        h, h0, h1 = lambda_t - lambda_s2, lambda_s0 - lambda_s2, lambda_s1 - lambda_s2
        r0, r1 = h0 / h, h1 / h
        d0 = m[-3]
        d1_0, d1_1 = (m[-2] - m[-3]) / r1, (m[-1] - m[-3]) / r0
        out = (sigma_t / sigma_s2) * sample - alpha_t * (np.exp(-h) - 1.0) * d0
        if not heun:
            return out + alpha_t * ((np.exp(-h) - 1.0) / h + 1.0) * d1_1
        d1 = (r0 * d1_0 - r1 * d1_1) / (r0 - r1)
        d2 = 2.0 * (d1_1 - d1_0) / (r0 - r1)
        return (out + alpha_t * ((np.exp(-h) - 1.0) / h + 1.0) * d1
                - alpha_t * ((np.exp(-h) - 1.0 + h) / h**2 - 0.5) * d2)


class UniPC:
    """UniPCMultistepScheduler in its data-prediction form (predict_x0), B(h) bh1 or bh2, orders 1 to 3, no
    noise: each step first corrects the latents it was given (UniC, from the sample the step before started
    from and the new clean latents), then predicts the next ones from the corrected latents (UniP). Started
    at a later run (image to image), it warms up and corrects from there, as it counts what it was given."""

    order = 1

    def __init__(self, config: Mapping, steps: int) -> None:
        _check(config, solver_order=(2, 1, 3), predict_x0=(True,), solver_type=("bh2", "bh1"),
               final_sigmas_type=("zero", "sigma_min"), thresholding=(False,),
               use_karras_sigmas=(False, True), use_exponential_sigmas=(False,), use_beta_sigmas=(False,),
               use_flow_sigmas=(False,))
        shared = ("num_train_timesteps", "beta_start", "beta_end", "beta_schedule", "trained_betas",
                  "prediction_type", "steps_offset", "rescale_betas_zero_snr", "timestep_spacing",
                  "use_karras_sigmas", "final_sigmas_type")
        port = DPMSolverMultistep({"_class_name": "DPMSolverMultistepScheduler",
                                   **{k: v for k, v in config.items() if k in shared}}, steps)
        self.timesteps, self.sigmas = port.timesteps, port.sigmas  # the same timesteps and sigmas
        self.config, self.steps = config, steps
        self.init_noise_sigma, self.noise_steps = 1.0, []
        self.x0s: list[np.ndarray] = []  # the clean latents of the steps run so far
        self.started: np.ndarray | None = None  # the (corrected) latents the step before started from
        self.last_order = 0

    def scale_model_input(self, x: np.ndarray, i: int) -> np.ndarray:
        return x

    def add_noise(self, sample: np.ndarray, noise: np.ndarray, i: int) -> np.ndarray:
        alpha, sigma = DPMSolverMultistep._alpha_sigma_lambda(self.sigmas[i])[:2]
        return alpha * sample + sigma * noise

    def _level(self, i: int) -> tuple[float, float, float]:
        return DPMSolverMultistep._alpha_sigma_lambda(self.sigmas[i])

    def _system(self, i: int, order: int) -> tuple[float, float, list[float], np.ndarray]:
        """From level i to i + 1 with the x0s of levels i, i - 1, ...: (h phi_1, B(h), the r_k of the levels
        behind, the right-hand side b of the order's system)."""
        h = self._level(i + 1)[2] - self._level(i)[2]
        hh = -h
        ratios = [(self._level(i - k)[2] - self._level(i)[2]) / h for k in range(1, order)]
        b_h = hh if self.config.get("solver_type", "bh2") == "bh1" else math.expm1(hh)
        phi = math.expm1(hh) / hh - 1  # h phi_2 / h ..., each next one phi_k / hh - 1 / k!
        rhs = []
        for k in range(1, order + 1):
            rhs.append(phi * math.factorial(k) / b_h)
            phi = phi / hh - 1 / math.factorial(k + 1)
        return math.expm1(hh), b_h, ratios, np.array(rhs)

    def _differences(self, ratios: list[float], newest: int) -> list[np.ndarray]:
        """(x0 of k levels before `newest` - x0 of `newest`) / r_k; `newest` indexes self.x0s."""
        return [(self.x0s[newest - k] - self.x0s[newest]) / r for k, r in enumerate(ratios, 1)]

    def step(self, output: np.ndarray, i: int, x: np.ndarray, noise: np.ndarray | None) -> np.ndarray:
        config = self.config
        alpha, sigma = self._level(i)[:2]
        epsilon = config["prediction_type"] == "epsilon"
        x0 = (x - sigma * output) / alpha if epsilon else alpha * x - sigma * output
        skipped = config.get("disable_corrector", [])
        if self.started is not None and i - 1 not in skipped:  # UniC of the order the step before used
            order = self.last_order
            h_phi_1, b_h, ratios, rhs = self._system(i - 1, order)
            if order == 1:
                rhos = np.array([0.5])
            else:
                powers = np.array([[r**p for r in [*ratios, 1.0]] for p in range(order)])
                rhos = np.linalg.solve(powers, rhs)
            terms = self._differences(ratios, -1)
            alpha_t = self._level(i)[0]
            sigma_t, sigma_s = self._level(i)[1], self._level(i - 1)[1]
            correction = sum((w * d for w, d in zip(rhos[:-1], terms, strict=True)), np.zeros_like(x))
            x = (sigma_t / sigma_s * self.started - alpha_t * h_phi_1 * self.x0s[-1]
                 - alpha_t * b_h * (correction + rhos[-1] * (x0 - self.x0s[-1])))
        self.x0s.append(x0)
        order = config.get("solver_order", 2)
        if config.get("lower_order_final", True):
            order = min(order, len(self.timesteps) - i)
        order = min(order, len(self.x0s))  # no more x0s than it has
        h_phi_1, b_h, ratios, rhs = self._system(i, order)
        terms = self._differences(ratios, -1)
        if order == 1:
            rhos = np.array([])
        elif order == 2:
            rhos = np.array([0.5])
        else:
            powers = np.array([[r**p for r in ratios] for p in range(order - 1)])
            rhos = np.linalg.solve(powers, rhs[:-1])
        alpha_t = self._level(i + 1)[0]
        sigma_t, sigma_s = self._level(i + 1)[1], sigma
        prediction = sum((w * d for w, d in zip(rhos, terms, strict=True)), np.zeros_like(x))
        self.started, self.last_order = x, order
        return sigma_t / sigma_s * x - alpha_t * h_phi_1 * x0 - alpha_t * b_h * prediction


class PNDM:
    """PNDMScheduler with skip_prk_steps (PLMS): the second timestep run twice, a linear multistep
    combination of the past noise predictions (`ets`) in a DDIM-like update.

    What it does at a run follows from how many runs it has made (diffusers' `counter`), not from where
    the run is in the schedule: started part-way (image to image), its first run there steps as the
    schedule's first does, and its second averages the two outputs and steps again from the first run's
    sample, though the second timestep then is not the first's repeat."""

    order = 1

    def __init__(self, config: Mapping, steps: int) -> None:
        _check(config, skip_prk_steps=(True,), set_alpha_to_one=(False, True))
        self.config, self.steps = config, steps
        self.cumprod = alphas_cumprod({**config, "rescale_betas_zero_snr": False})
        count = config["num_train_timesteps"]
        self.ratio = count // steps
        spacing = config.get("timestep_spacing", "leading")
        if spacing == "linspace":
            base = np.linspace(0, count - 1, steps).round().astype(np.int64)
        elif spacing == "leading":
            base = (np.arange(steps) * self.ratio).round().astype(np.int64) + config.get("steps_offset", 0)
        else:
            base = np.round(np.arange(count, 0, -count / steps))[::-1].astype(np.int64) - 1
        self.timesteps = np.concatenate([base[:-1], base[-2:-1], base[-1:]])[::-1].copy()
        self.final = 1.0 if config.get("set_alpha_to_one", False) else self.cumprod[0]
        self.init_noise_sigma, self.noise_steps = 1.0, []
        self.ets: list[np.ndarray] = []
        self.first_sample: np.ndarray | None = None
        self.start: int | None = None  # the first run made

    def scale_model_input(self, x: np.ndarray, i: int) -> np.ndarray:
        return x

    def add_noise(self, sample: np.ndarray, noise: np.ndarray, i: int) -> np.ndarray:
        return _noised_by_alpha(self.cumprod, self.timesteps[i], sample, noise)

    def step(self, output: np.ndarray, i: int, x: np.ndarray, noise: np.ndarray | None) -> np.ndarray:
        t = int(self.timesteps[i])
        if self.start is None:
            self.start = i
        made = i - self.start  # runs made before this one
        if made == 1:  # the repeated timestep: from the first run's sample, the two outputs averaged
            at, previous = t + self.ratio, t
            combined, x = (output + self.ets[-1]) / 2, self.first_sample
        else:
            at, previous = t, t - self.ratio
            self.ets = [*self.ets[-3:], output]
            e = self.ets[::-1]  # latest first
            if len(e) == 1:
                combined = e[0]
            elif len(e) == 2:
                combined = (3 * e[0] - e[1]) / 2
            elif len(e) == 3:
                combined = (23 * e[0] - 16 * e[1] + 5 * e[2]) / 12
            else:
                combined = (55 * e[0] - 59 * e[1] + 37 * e[2] - 9 * e[3]) / 24
            if made == 0:
                self.first_sample = x
        a = self.cumprod[at]
        a_prev = self.cumprod[previous] if previous >= 0 else self.final
        if self.config["prediction_type"] == "v_prediction":
            combined = a**0.5 * combined + (1 - a) ** 0.5 * x
        denominator = a * (1 - a_prev) ** 0.5 + (a * (1 - a) * a_prev) ** 0.5
        return (a_prev / a) ** 0.5 * x - (a_prev - a) * combined / denominator


class Heun:
    """HeunDiscreteScheduler as diffusers writes it: every timestep but the first twice, the sigmas likewise;
    an Euler step to the next sigma (keeping the slope, the step and the sample), then at that sigma the
    average of the two slopes applied to the kept sample; the last run an Euler step to 0."""

    order = 2

    def __init__(self, config: Mapping, steps: int) -> None:
        _check(config, use_karras_sigmas=(False, True), use_exponential_sigmas=(False, True),
               use_beta_sigmas=(False, True))
        euler = Euler({**config, "final_sigmas_type": "zero", "sigma_min": None, "sigma_max": None}, steps)
        self.config = config
        self.timesteps = np.concatenate([euler.timesteps[:1], np.repeat(euler.timesteps[1:], 2)])
        sigmas = euler.sigmas  # with the final 0
        self.sigmas = np.concatenate([sigmas[:1], np.repeat(sigmas[1:-1], 2), sigmas[-1:]])
        self.init_noise_sigma, self.noise_steps = euler.init_noise_sigma, []
        self.kept: tuple[np.ndarray, float, np.ndarray] | None = None  # slope, step, sample

    def scale_model_input(self, x: np.ndarray, i: int) -> np.ndarray:
        return x / (self.sigmas[i] ** 2 + 1) ** 0.5

    def add_noise(self, sample: np.ndarray, noise: np.ndarray, i: int) -> np.ndarray:
        return sample + self.sigmas[i] * noise

    def step(self, output: np.ndarray, i: int, x: np.ndarray, noise: np.ndarray | None) -> np.ndarray:
        limit = self.config.get("clip_sample_range", 1.0) if self.config.get("clip_sample") else np.inf
        if self.kept is None:  # the Euler step
            sigma, sigma_next = self.sigmas[i], self.sigmas[i + 1]
            x0 = np.clip(_x0_from_sigma(self.config, output, x, sigma), -limit, limit)
            slope, dt = (x - x0) / sigma, sigma_next - sigma
            self.kept = (slope, dt, x)
            return x + slope * dt
        sigma_next = self.sigmas[i]
        x0 = np.clip(_x0_from_sigma(self.config, output, x, sigma_next), -limit, limit)
        first, dt, sample = self.kept
        self.kept = None
        return sample + (first + (x - x0) / sigma_next) / 2 * dt


class KDPM2:
    """KDPM2DiscreteScheduler as diffusers writes it (its sigmas in float32): every step but the last an
    Euler step to the geometric mean of its sigma and the next, keeping the sample, then a run at that
    middle sigma (its timestep interpolated in log sigma) whose slope carries the kept sample to the next
    sigma; the last an Euler step to 0. Karras timesteps rounded.

    KDPM2AncestralDiscreteScheduler (`ancestral`): the middle between the sigma and the ancestral step's down
    sigma, the second run carrying the kept sample to down and adding noise times up (one draw each)."""

    order = 2

    def __init__(self, config: Mapping, steps: int, ancestral: bool = False) -> None:
        _check(config, use_karras_sigmas=(False, True), use_exponential_sigmas=(False, True),
               use_beta_sigmas=(False, True))
        euler = Euler({**config, "final_sigmas_type": "zero", "sigma_min": None, "sigma_max": None}, steps)
        self.config = config
        sigmas = euler.sigmas.astype(np.float32).astype(np.float64)
        now, after = sigmas[:-1], sigmas[1:]
        self.ups = np.sqrt(after**2 * (now**2 - after**2) / now**2) if ancestral else np.zeros_like(after)
        self.downs = np.sqrt(after**2 - self.ups**2)
        middles = np.sqrt(now * self.downs)  # the last: 0
        cumprod = alphas_cumprod(config)
        table = ((1 - cumprod) / cumprod) ** 0.5
        ticks = euler.timesteps.round() if config.get("use_karras_sigmas") else euler.timesteps
        between = sigma_to_t(middles[:-1], table).astype(np.float32).astype(np.float64)
        self.timesteps = np.concatenate([ticks[:1], np.stack([between, ticks[1:]], axis=1).ravel()])
        # the sigma of each run: s0, then (middle, sigma) pairs; what each step moves between
        self.inputs = np.concatenate([sigmas[:1], np.stack([middles[:-1], sigmas[1:-1]], axis=1).ravel()])
        self.sigmas, self.middles = sigmas, middles
        top = sigmas.max()
        exact = config["timestep_spacing"] in ("linspace", "trailing")
        self.init_noise_sigma = top if exact else (top**2 + 1) ** 0.5
        self.noise_steps = list(range(1, len(self.timesteps), 2)) if ancestral else []  # the second runs
        self.kept: np.ndarray | None = None

    def scale_model_input(self, x: np.ndarray, i: int) -> np.ndarray:
        return x / (self.inputs[i] ** 2 + 1) ** 0.5

    def add_noise(self, sample: np.ndarray, noise: np.ndarray, i: int) -> np.ndarray:
        """At the noise level diffusers gives run i: its sigmas after the first each twice (the middle
        sigmas are not among them)."""
        return sample + self.sigmas[(i + 1) // 2] * noise

    def step(self, output: np.ndarray, i: int, x: np.ndarray, noise: np.ndarray | None) -> np.ndarray:
        j = (i + 1) // 2  # the step this run belongs to
        if self.kept is None:  # the Euler step to the middle sigma
            sigma, middle = self.sigmas[j], self.middles[j]
            self.kept = x
            return x + (x - _x0_from_sigma(self.config, output, x, sigma)) / sigma * (middle - sigma)
        sigma, middle = self.sigmas[j - 1], self.middles[j - 1]
        sample, self.kept = self.kept, None
        slope = (x - _x0_from_sigma(self.config, output, x, middle)) / middle
        moved = sample + slope * (self.downs[j - 1] - sigma)
        return moved if noise is None else moved + noise * self.ups[j - 1]


class LMS(Euler):
    """LMSDiscreteScheduler as diffusers writes it (its sigmas in float32; step's default order 4): the
    slopes (x - x0) / sigma of the last runs, up to four, each weighted by the integral of its Lagrange
    polynomial through those runs' sigmas over this step's sigma interval (Gauss-Legendre quadrature here,
    scipy's quad in diffusers); as many weights used as there are slopes since the first run."""

    def __init__(self, config: Mapping, steps: int) -> None:
        _check(config, use_karras_sigmas=(False, True), use_exponential_sigmas=(False, True),
               use_beta_sigmas=(False, True))
        super().__init__({**config, "final_sigmas_type": "zero", "sigma_min": None, "sigma_max": None}, steps)
        self.config = config
        self.sigmas = self.sigmas.astype(np.float32).astype(np.float64)
        top = self.sigmas.max()
        exact = config["timestep_spacing"] in ("linspace", "trailing")
        self.init_noise_sigma = top if exact else (top**2 + 1) ** 0.5
        self.slopes: list[np.ndarray] = []

    def step(self, output: np.ndarray, i: int, x: np.ndarray, noise: np.ndarray | None) -> np.ndarray:
        sigma, sigma_next = self.sigmas[i], self.sigmas[i + 1]
        self.slopes = [*self.slopes[-3:], (x - _x0_from_sigma(self.config, output, x, sigma)) / sigma]
        order = min(i + 1, 4)
        nodes, weights = np.polynomial.legendre.leggauss(8)
        taus = (sigma_next - sigma) / 2 * nodes + (sigma_next + sigma) / 2
        for j, slope in zip(range(order), reversed(self.slopes), strict=False):
            basis = np.ones_like(taus)
            for k in range(order):
                if k != j:
                    basis *= (taus - self.sigmas[i - k]) / (self.sigmas[i - j] - self.sigmas[i - k])
            x = x + (sigma_next - sigma) / 2 * float(weights @ basis) * slope
        return x


class DEIS(DPMSolverMultistep):
    """DEISMultistepScheduler (log-rho DEIS) as diffusers writes it: DPM-Solver's timesteps and order rule,
    the last sigma the smallest training one; each step converts the output to a noise prediction and
    moves x with the closed-form integrals of the Lagrange polynomials in log rho (rho = sigma / alpha)
    through the last one to three steps."""

    def __init__(self, config: Mapping, steps: int) -> None:
        _check(config, algorithm_type=("deis",), solver_type=("logrho",), solver_order=(1, 2, 3),
               thresholding=(False,), use_karras_sigmas=(False, True), use_exponential_sigmas=(False,),
               use_beta_sigmas=(False,), use_flow_sigmas=(False,))
        super().__init__({**config, "algorithm_type": "dpmsolver++", "solver_type": "midpoint",
                          "final_sigmas_type": "sigma_min", "euler_at_final": False}, steps)
        self.config = {**config, "final_sigmas_type": "sigma_min", "euler_at_final": False}

    def step(self, output: np.ndarray, i: int, x: np.ndarray, noise: np.ndarray | None) -> np.ndarray:
        alpha_s0, sigma_s0, _ = self._alpha_sigma_lambda(self.sigmas[i])
        alpha_t, sigma_t, _ = self._alpha_sigma_lambda(self.sigmas[i + 1])
        if self.config["prediction_type"] == "epsilon":
            x0 = (x - sigma_s0 * output) / alpha_s0
        else:
            x0 = alpha_s0 * x - sigma_s0 * output
        self.outputs.append((x - alpha_s0 * x0) / sigma_s0)  # the noise prediction
        order = self._order(i)
        m = self.outputs[::-1]
        rho = [self.sigmas[i + 1], *(self.sigmas[i - k] for k in range(order))]  # t, s0, s1, s2
        if order == 1:
            h = math.log(alpha_t / sigma_t) - math.log(alpha_s0 / sigma_s0)
            return alpha_t / alpha_s0 * x - sigma_t * (math.exp(h) - 1.0) * m[0]
        log = np.log
        if order == 2:
            def integral(t: float, b: float, c: float) -> float:
                return t * (-log(c) + log(t) - 1) / (log(b) - log(c))

            t, s0, s1 = rho
            coefficients = [integral(t, s0, s1) - integral(s0, s0, s1),
                            integral(t, s1, s0) - integral(s0, s1, s0)]
        else:
            def integral(t: float, b: float, c: float, d: float) -> float:  # type: ignore[misc]
                top = t * (log(c) * (log(d) - log(t) + 1) - log(d) * log(t) + log(d) + log(t) ** 2
                           - 2 * log(t) + 2)
                return top / ((log(b) - log(c)) * (log(b) - log(d)))

            t, s0, s1, s2 = rho
            coefficients = [integral(t, s0, s1, s2) - integral(s0, s0, s1, s2),
                            integral(t, s1, s2, s0) - integral(s0, s1, s2, s0),
                            integral(t, s2, s0, s1) - integral(s0, s2, s0, s1)]
        return alpha_t * (x / alpha_s0 + sum(c * e for c, e in zip(coefficients, m, strict=False)))


class EDMEuler:
    """EDMEulerScheduler as diffusers writes it (s_churn 0): sigmas from sigma_max to sigma_min (Karras of
    its rho, or even in log sigma) in float32, the UNet's timestep 0.25 log sigma and its input
    x / sqrt(sigma^2 + sigma_data^2), an Euler step on EDM's preconditioned clean latents."""

    order = 1

    def __init__(self, config: Mapping, steps: int) -> None:
        _check(config, sigma_schedule=("karras", "exponential"), final_sigmas_type=("zero", "sigma_min"))
        self.config = config
        low, high = config.get("sigma_min", 0.002), config.get("sigma_max", 80.0)
        rho = config.get("rho", 7.0)
        ramp = np.linspace(0.0, 1.0, steps)
        if config.get("sigma_schedule", "karras") == "karras":
            sigmas = (high ** (1 / rho) + ramp * (low ** (1 / rho) - high ** (1 / rho))) ** rho
        else:
            sigmas = np.exp(np.linspace(math.log(low), math.log(high), steps))[::-1]
        sigmas = sigmas.astype(np.float32)
        # diffusers takes the log in float32 (torch's): within one float32 step of this
        self.timesteps = (0.25 * np.log(sigmas.astype(np.float64))).astype(np.float32).astype(np.float64)
        last = sigmas[-1] if config.get("final_sigmas_type", "zero") == "sigma_min" else 0.0
        self.sigmas = np.append(sigmas.astype(np.float64), last)
        self.init_noise_sigma, self.noise_steps = (high**2 + 1) ** 0.5, []

    def scale_model_input(self, x: np.ndarray, i: int) -> np.ndarray:
        return x / (self.sigmas[i] ** 2 + self.config.get("sigma_data", 0.5) ** 2) ** 0.5

    def add_noise(self, sample: np.ndarray, noise: np.ndarray, i: int) -> np.ndarray:
        return sample + self.sigmas[i] * noise

    def step(self, output: np.ndarray, i: int, x: np.ndarray, noise: np.ndarray | None) -> np.ndarray:
        sigma, data = self.sigmas[i], self.config.get("sigma_data", 0.5)
        sign = 1.0 if self.config.get("prediction_type", "epsilon") == "epsilon" else -1.0
        c_skip, c_out = data**2 / (sigma**2 + data**2), sign * sigma * data / (sigma**2 + data**2) ** 0.5
        denoised = c_skip * x + c_out * output
        return x + (x - denoised) / sigma * (self.sigmas[i + 1] - sigma)


SCHEDULERS = {
    "EulerDiscreteScheduler": Euler,
    "EDMEulerScheduler": EDMEuler,
    "DEISMultistepScheduler": DEIS,
    "KDPM2AncestralDiscreteScheduler": lambda config, steps: KDPM2(config, steps, ancestral=True),
    "LMSDiscreteScheduler": LMS,
    "HeunDiscreteScheduler": Heun,
    "KDPM2DiscreteScheduler": KDPM2,
    "EulerAncestralDiscreteScheduler": lambda config, steps: Euler(config, steps, ancestral=True),
    "DDIMScheduler": DDIM,
    "TCDScheduler": TCD,
    "DDPMScheduler": DDPM,
    "LCMScheduler": LCM,
    "DPMSolverMultistepScheduler": DPMSolverMultistep,
    "DPMSolverSinglestepScheduler": DPMSolverSinglestep,
    "PNDMScheduler": PNDM,
    "UniPCMultistepScheduler": UniPC,
}


def make_scheduler(config: Mapping, steps: int, strength: float | None = None, eta: float = 0.0):
    """A scheduler of SCHEDULERS from a diffusers scheduler_config.json (its `_class_name` and fields);
    `strength` for LCM's image-to-image schedule (the others enter theirs part-way: strength_start); `eta`,
    the pipeline's, for DDIM (the pipelines pass it to the schedulers whose step takes it)."""
    name = config["_class_name"]
    if name not in SCHEDULERS:
        raise ValueError(f"scheduler {name!r} is not written by hand here; known: {', '.join(SCHEDULERS)}")
    if strength is not None and name == "LCMScheduler":
        return LCM(config, steps, strength)
    if eta and name not in ("DDIMScheduler", "TCDScheduler"):
        raise ValueError(f"eta is DDIM's and TCD's here, not {name}'s")
    return SCHEDULERS[name](config, steps, eta) if eta else SCHEDULERS[name](config, steps)


# --- Stable Diffusion ----------------------------------------------------------------------------

def encode_prompt(folder: Path, ids: Sequence[int]) -> np.ndarray:
    return run(session(folder / "text_encoder" / "model.onnx"),
               {"input_ids": np.array([ids], dtype=np.int64)})["last_hidden_state"]


def _conditioning(folder: Path, prompt_ids: Sequence[int], negative_prompt_ids: Sequence[int] | None,
                  guided: bool) -> np.ndarray:
    """The text encoder's states of the prompt, after the negative prompt's when guided (one batch)."""
    embeddings = encode_prompt(folder, prompt_ids)
    if guided:
        embeddings = np.concatenate([encode_prompt(folder, negative_prompt_ids), embeddings])
    return embeddings


def _denoise(folder: Path, scheduler, x: np.ndarray, embeddings: np.ndarray, *, start: int = 0,
             guidance_scale: float = 1.0, guidance_rescale: float = 0.0, noise: np.ndarray | None = None,
             timestep_cond: np.ndarray | None = None, added: Arrays | None = None,
             after: Callable[[int, np.ndarray], np.ndarray] | None = None,
             extra: np.ndarray | None = None) -> np.ndarray:
    """The latents (float64, each step's result rounded to float32) after the UNet and `scheduler` ran from
    run `start` of its schedule to the end from latents `x`; `noise[k]` is the k-th noise a run from there
    draws (diffusers' draws, in order: every run draws for an ancestral or SDE scheduler, KDPM2Ancestral's
    second runs only);
    `added`: more UNet inputs, the same each run (Stable Diffusion XL's text_embeds and time_ids);
    `after(i, x)`: the latents after run i's step (inpainting's blend); `extra`: more input channels after
    the latents' (an inpainting UNet's mask and masked image's latents), one row repeated for each row."""
    guided = guidance_scale > 1
    drawing = [i for i in scheduler.noise_steps if i >= start]
    if drawing and noise is None:
        raise ValueError(f"{scheduler.config['_class_name']} adds noise at steps {drawing}: give `noise`")
    unet = session(folder / "unet" / "model.onnx")
    drawn = 0  # the noises drawn so far
    for i in range(start, len(scheduler.timesteps)):
        batch = np.concatenate([x, x]) if guided else x
        sample = scheduler.scale_model_input(batch, i).astype(np.float32)
        if extra is not None:
            rows = np.repeat(extra.astype(np.float32), len(sample), axis=0)
            sample = np.concatenate([sample, rows], axis=1)
        feeds = {"sample": sample, "timestep": np.array(scheduler.timesteps[i], dtype=np.float32),
                 "encoder_hidden_states": embeddings}
        if timestep_cond is not None:
            feeds["timestep_cond"] = timestep_cond
        output = run(unet, {**feeds, **(added or {})})["out_sample"].astype(np.float64)
        if guided:
            uncond, cond = np.split(output, 2)
            output = uncond + guidance_scale * (cond - uncond)
            if guidance_rescale > 0:  # per row, over every latent value, unbiased (torch.std's default)
                axes = tuple(range(1, output.ndim))
                cond_std = cond.std(axis=axes, ddof=1, keepdims=True)
                ratio = cond_std / output.std(axis=axes, ddof=1, keepdims=True)
                output = guidance_rescale * output * ratio + (1 - guidance_rescale) * output
        step_noise = None
        if i in scheduler.noise_steps:  # past the noises given: a draw whose weight is 0 (ortpipe skips it)
            step_noise = noise[drawn].astype(np.float64) if drawn < len(noise) else np.zeros_like(x)
            drawn += 1
        x = scheduler.step(output, i, x, step_noise).astype(np.float32).astype(np.float64)
        if after is not None:
            x = after(i, x)
    return x


def _decode(folder: Path, x: np.ndarray) -> np.ndarray:
    """The VAE decoder's image [batch, height, width, 3] in [0, 1] (before uint8) of latents x."""
    scaling = json.loads((folder / "vae_decoder" / "config.json").read_text())["scaling_factor"]
    decoded = run(session(folder / "vae_decoder" / "model.onnx"),
                  {"latent_sample": (x / scaling).astype(np.float32)})["sample"]
    return np.clip(decoded / 2 + 0.5, 0.0, 1.0).transpose(0, 2, 3, 1).astype(np.float32)


def generate_image(folder: Path | str, scheduler_config: Mapping, steps: int, latents: np.ndarray, *,
                   prompt_ids: Sequence[int], negative_prompt_ids: Sequence[int] | None = None,
                   guidance_scale: float = 1.0, guidance_rescale: float = 0.0,
                   noise: np.ndarray | None = None, timestep_cond: np.ndarray | None = None,
                   eta: float = 0.0) -> tuple[np.ndarray, np.ndarray]:
    """(image [batch, height, width, 3] in [0, 1] before uint8, final latents), as StableDiffusionPipeline
    computes them from the same initial `latents` (before scaling by init_noise_sigma).

    Guidance above 1 runs the UNet on [unconditional, conditional] in one batch; `guidance_rescale` mixes
    in the guided output rescaled to the conditional one's standard deviation (arXiv 2305.08891, 3.4);
    `noise[k]` is the k-th noise a step draws (an ancestral, LCM or SDE scheduler's); `timestep_cond`, the
    guidance embedding a latent consistency model's UNet takes (guidance_scale then stays 1: no CFG); `eta`,
    DDIM's noise (the pipeline's argument).
    """
    folder = Path(folder)
    embeddings = _conditioning(folder, prompt_ids, negative_prompt_ids, guidance_scale > 1)
    scheduler = make_scheduler(scheduler_config, steps, eta=eta)
    x = _denoise(folder, scheduler, latents.astype(np.float64) * scheduler.init_noise_sigma, embeddings,
                 guidance_scale=guidance_scale, guidance_rescale=guidance_rescale, noise=noise,
                 timestep_cond=timestep_cond)
    return _decode(folder, x), x.astype(np.float32)


def strength_start(scheduler, steps: int, strength: float) -> int:
    """The first run of the schedule that image to image keeps: the last int(steps * strength) steps of
    `steps` are kept, each `scheduler.order` runs (LCM: its schedule made with the strength, all of it)."""
    if isinstance(scheduler, LCM):
        return 0
    kept = min(int(steps * strength), steps)
    if kept < 1:
        raise ValueError(f"strength {strength} keeps no step of {steps}")
    return (steps - kept) * scheduler.order


def encode_image(folder: Path | str, image: np.ndarray, encode_noise: np.ndarray) -> np.ndarray:
    """The scaled latents [1, 4, height / f, width / f] of a uint8 RGB image [height, width, 3]: its pixels
    to [-1, 1] (x / 255 * 2 - 1, float32), the VAE encoder's mean and log variance (clamped to [-30, 20]), a
    sample mean + exp(logvar / 2) * `encode_noise`, minus the VAE's shift factor, times its scaling factor."""
    folder = Path(folder)
    config = json.loads((folder / "vae_encoder" / "config.json").read_text())
    factor = 2 ** (len(config["block_out_channels"]) - 1)
    if image.dtype != np.uint8 or image.ndim != 3 or image.shape[2] != 3:
        raise ValueError(f"expected a uint8 RGB image [height, width, 3], got {image.dtype} {image.shape}")
    if image.shape[0] % factor or image.shape[1] % factor:  # diffusers would resize it first
        raise ValueError(f"image sides {image.shape[:2]} are not multiples of the VAE's factor {factor}")
    pixels = (image.astype(np.float32) / np.float32(255.0)) * np.float32(2.0) - np.float32(1.0)
    return _encode_pixels(folder, pixels.transpose(2, 0, 1)[None].copy(), encode_noise)


def _encode_pixels(folder: Path, pixels: np.ndarray, encode_noise: np.ndarray) -> np.ndarray:
    """encode_image's latents of float32 pixels [1, 3, height, width] in [-1, 1]."""
    config = json.loads((folder / "vae_encoder" / "config.json").read_text())
    encoder = session(folder / "vae_encoder" / "model.onnx")
    parameters = run(encoder, {"sample": pixels})["latent_parameters"]
    mean, logvar = np.split(parameters, 2, axis=1)
    std = np.exp(np.float32(0.5) * np.clip(logvar, np.float32(-30.0), np.float32(20.0)))
    shift = np.float32(config.get("shift_factor") or 0.0)  # Stable Diffusion 3's VAE shifts before scaling
    return (mean + std * encode_noise.astype(np.float32) - shift) * np.float32(config["scaling_factor"])


def image_to_image(folder: Path | str, scheduler_config: Mapping, steps: int, strength: float,
                   image: np.ndarray, *, encode_noise: np.ndarray, add_noise: np.ndarray,
                   prompt_ids: Sequence[int], negative_prompt_ids: Sequence[int] | None = None,
                   guidance_scale: float = 1.0, noise: np.ndarray | None = None,
                   timestep_cond: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(image [1, height, width, 3] in [0, 1] before uint8, final latents), as StableDiffusionImg2ImgPipeline
    (LatentConsistencyModelImg2ImgPipeline with LCMScheduler and `timestep_cond`, the guidance embedded)
    computes them from the uint8 RGB `image` [height, width, 3] with the same noises.

    The image's latents (`encode_image`, with `encode_noise`) are noised with `add_noise` to the level of
    the first run `strength` keeps (`strength_start`; not scaled by init_noise_sigma), then the UNet and
    scheduler run from there to the end of the `steps` schedule, with guidance as in generate_image;
    `noise[k]` is the k-th noise a kept run draws.
    """
    folder = Path(folder)
    embeddings = _conditioning(folder, prompt_ids, negative_prompt_ids, guidance_scale > 1)
    scheduler = make_scheduler(scheduler_config, steps, strength)
    start = strength_start(scheduler, steps, strength)
    latents = encode_image(folder, image, encode_noise).astype(np.float64)
    x = scheduler.add_noise(latents, add_noise.astype(np.float64), start)
    x = x.astype(np.float32).astype(np.float64)  # diffusers' latents are float32
    x = _denoise(folder, scheduler, x, embeddings, start=start, guidance_scale=guidance_scale, noise=noise,
                 timestep_cond=timestep_cond)
    return _decode(folder, x), x.astype(np.float32)


def inpaint_mask(mask: np.ndarray, factor: int) -> np.ndarray:
    """StableDiffusionInpaintPipeline's mask at the latents' size, [1, 1, h / factor, w / factor]: Pillow's
    luminance of the uint8 RGB mask over 255, binarized at 0.5, resized by nearest interpolation (torch's
    picks the first pixel of each factor x factor block)."""
    from PIL import Image

    luminance = np.asarray(Image.fromarray(mask).convert("L")).astype(np.float32) / np.float32(255.0)
    binary = (luminance >= 0.5).astype(np.float32)
    return binary[::factor, ::factor][None, None]


def inpaint(folder: Path | str, scheduler_config: Mapping, steps: int, strength: float, image: np.ndarray,
            mask: np.ndarray, *, encode_noise: np.ndarray, add_noise: np.ndarray, prompt_ids: Sequence[int],
            negative_prompt_ids: Sequence[int] | None = None, guidance_scale: float = 1.0,
            noise: np.ndarray | None = None, masked_noise: np.ndarray | None = None,
            zero_negative: bool | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(image, final latents) as StableDiffusionInpaintPipeline computes them. At strength 1 the first
    latents are the noise times init_noise_sigma, else the image's latents noised as image_to_image's.
    With a UNet of the latents' channels, after each step the region the mask keeps (black) is set back to
    the image's latents noised by add_noise to the next run's level (clean after the last run); an
    inpainting UNet (2 * channels + 1 inputs) instead reads the mask and the latents of the image with the
    repainted pixels at 0 (drawn with `masked_noise`) beside the latents at every run. `zero_negative` not
    None: StableDiffusionXLInpaintPipeline's (Stable Diffusion XL's conditioning, `prompt_ids` a row per
    tokenizer)."""
    folder = Path(folder)
    added = None
    if zero_negative is None:
        embeddings = _conditioning(folder, prompt_ids, negative_prompt_ids, guidance_scale > 1)
    else:
        vae = json.loads((folder / "vae_decoder" / "config.json").read_text())
        pixels = 2 ** (len(vae["block_out_channels"]) - 1)
        shape = (1, 1, image.shape[0] // pixels, image.shape[1] // pixels)  # its sides: size conditioning
        embeddings, added = _xl_conditioning(folder, shape, prompt_ids, negative_prompt_ids,
                                             guidance_scale > 1, zero_negative)
    scheduler = make_scheduler(scheduler_config, steps)
    latents = encode_image(folder, image, encode_noise).astype(np.float64)
    e = add_noise.astype(np.float64)
    if strength == 1.0:
        start, x = 0, e * scheduler.init_noise_sigma
    else:
        start = strength_start(scheduler, steps, strength)
        x = scheduler.add_noise(latents, e, start)
    x = x.astype(np.float32).astype(np.float64)
    config = json.loads((folder / "vae_encoder" / "config.json").read_text())
    repaint = inpaint_mask(mask, 2 ** (len(config["block_out_channels"]) - 1)).astype(np.float64)
    last = len(scheduler.timesteps) - 1
    unet = json.loads((folder / "unet" / "config.json").read_text())
    if unet["in_channels"] == 2 * config["latent_channels"] + 1:
        keep = 1 - inpaint_mask(mask, 1)[0]  # [1, height, width]: the pixels kept
        pixels = (image.astype(np.float32) / np.float32(255.0)) * np.float32(2.0) - np.float32(1.0)
        masked = (pixels.transpose(2, 0, 1) * keep)[None].astype(np.float32)
        extra = np.concatenate([repaint, _encode_pixels(folder, masked, masked_noise)], axis=1)
        x = _denoise(folder, scheduler, x, embeddings, start=start, guidance_scale=guidance_scale,
                     noise=noise, extra=extra)
        return _decode(folder, x), x.astype(np.float32)

    def blend(i: int, x: np.ndarray) -> np.ndarray:
        kept = latents if i == last else scheduler.add_noise(latents, e, i + 1).astype(np.float32)
        return ((1 - repaint) * kept + repaint * x).astype(np.float32).astype(np.float64)

    x = _denoise(folder, scheduler, x, embeddings, start=start, guidance_scale=guidance_scale, noise=noise,
                 after=blend, added=added)
    return _decode(folder, x), x.astype(np.float32)


def encode_prompt_xl(folder: Path, ids: Sequence[Sequence[int]]) -> tuple[np.ndarray, np.ndarray]:
    """Stable Diffusion XL's text conditioning, as StableDiffusionXLPipeline.encode_prompt makes it: each text
    encoder's last layer but one (its graph's hidden_states outputs, the embeddings' and each layer's) side by
    side, and the second encoder's pooled projection (text_embeds); `ids`: one row per encoder's tokenizer."""
    states, pooled = [], None
    for k, encoder in enumerate(("text_encoder", "text_encoder_2")):
        out = run(session(folder / encoder / "model.onnx"), {"input_ids": np.array([ids[k]], np.int64)})
        layers = sorted((n for n in out if n.startswith("hidden_states.")),
                        key=lambda n: int(n.split(".")[1]))
        states.append(out[layers[-2]])
        pooled = out.get("text_embeds")
    return np.concatenate(states, axis=-1), pooled


def generate_image_xl(folder: Path | str, scheduler_config: Mapping, steps: int, latents: np.ndarray, *,
                      prompt_ids: Sequence[Sequence[int]],
                      negative_prompt_ids: Sequence[Sequence[int]] | None,
                      guidance_scale: float = 1.0, zero_negative: bool = False) -> np.ndarray:
    """The image [batch, height, width, 3] StableDiffusionXLPipeline computes from the same initial `latents`,
    by hand: the two encoders' conditioning (zeros for the unconditional row with `zero_negative`), the size
    conditioning (the image's size in pixels as original and target size, the crop corner at 0, 0), the UNet
    over [unconditional, conditional] rows with guidance, the scheduler's step, the VAE."""
    folder = Path(folder)
    states, added = _xl_conditioning(folder, latents.shape, prompt_ids, negative_prompt_ids,
                                     guidance_scale > 1, zero_negative)
    scheduler = make_scheduler(scheduler_config, steps)
    if scheduler.noise_steps:
        raise ValueError("this loop takes the deterministic schedulers only")
    x = latents.astype(np.float64) * scheduler.init_noise_sigma
    x = _denoise(folder, scheduler, x, states, guidance_scale=guidance_scale, added=added)
    return _decode(folder, x)


def _xl_conditioning(folder: Path, shape: Sequence[int], prompt_ids: Sequence[Sequence[int]],
                     negative_prompt_ids: Sequence[Sequence[int]] | None, guided: bool,
                     zero_negative: bool) -> tuple[np.ndarray, Arrays]:
    """Stable Diffusion XL's UNet conditioning for latents of `shape`: the encoders' states (the
    unconditional rows first when guided: zeros with `zero_negative`), and text_embeds and time_ids (the
    image's size in pixels as original and target size, the crop corner at 0, 0)."""
    states, pooled = encode_prompt_xl(folder, prompt_ids)
    if guided:
        negative = ((np.zeros_like(states), np.zeros_like(pooled)) if zero_negative
                    else encode_prompt_xl(folder, negative_prompt_ids))
        states, pooled = np.concatenate([negative[0], states]), np.concatenate([negative[1], pooled])
    vae = json.loads((folder / "vae_decoder" / "config.json").read_text())
    pixels = 2 ** (len(vae["block_out_channels"]) - 1)  # diffusers' vae_scale_factor
    height, width = shape[2] * pixels, shape[3] * pixels
    time_ids = np.array([[height, width, 0, 0, height, width]] * len(states), np.float32)
    return states, {"text_embeds": pooled, "time_ids": time_ids}


def image_to_image_xl(folder: Path | str, scheduler_config: Mapping, steps: int, strength: float,
                      image: np.ndarray, *, encode_noise: np.ndarray, add_noise: np.ndarray,
                      prompt_ids: Sequence[Sequence[int]],
                      negative_prompt_ids: Sequence[Sequence[int]] | None = None,
                      guidance_scale: float = 1.0, zero_negative: bool = False,
                      noise: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(image, final latents) as StableDiffusionXLImg2ImgPipeline (a base model's: no aesthetic score)
    computes them: image_to_image's start, the draw and add_noise, with Stable Diffusion XL's conditioning
    (its size conditioning the image's size)."""
    folder = Path(folder)
    scheduler = make_scheduler(scheduler_config, steps)
    start = strength_start(scheduler, steps, strength)
    latents = encode_image(folder, image, encode_noise).astype(np.float64)
    x = scheduler.add_noise(latents, add_noise.astype(np.float64), start)
    x = x.astype(np.float32).astype(np.float64)  # diffusers' latents are float32
    states, added = _xl_conditioning(folder, x.shape, prompt_ids, negative_prompt_ids, guidance_scale > 1,
                                     zero_negative)
    x = _denoise(folder, scheduler, x, states, start=start, guidance_scale=guidance_scale, noise=noise,
                 added=added)
    return _decode(folder, x), x.astype(np.float32)


def flow_match_sigmas(config: Mapping, steps: int) -> np.ndarray:
    """FlowMatchEulerDiscreteScheduler's sigmas (without dynamic shifting), then 0: training times evenly
    spaced between the shifted table's ends (its table made in float32), each shifted, kept in float32."""
    count, shift = config["num_train_timesteps"], np.float32(config.get("shift", 1.0))
    table = np.linspace(1, count, count, dtype=np.float32)[::-1] / np.float32(count)
    table = shift * table / (1 + (shift - 1) * table)
    times = np.linspace(float(table[0]) * count, float(table[-1]) * count, steps)
    sigmas = (float(shift) * (times / count) / (1 + (float(shift) - 1) * (times / count))).astype(np.float32)
    return np.append(sigmas, np.float32(0.0))


def encode_prompt_sd3(folder: Path, ids: Sequence[Sequence[int]]) -> tuple[np.ndarray, np.ndarray]:
    """StableDiffusion3Pipeline.encode_prompt's result by hand: both CLIP encoders' last layer but one side by
    side, zero-padded on the last axis to T5's width, T5's states after them along the sequence; the CLIP
    encoders' pooled projections side by side. `ids`: one row per tokenizer; two rows (a pipeline loaded
    without T5): T5's states are zeros, 256 rows as wide as the transformer's joint_attention_dim
    (config.json)."""
    clip, pooled = [], []
    for k, encoder in enumerate(("text_encoder", "text_encoder_2")):
        out = run(session(folder / encoder / "model.onnx"), {"input_ids": np.array([ids[k]], np.int64)})
        layers = sorted((n for n in out if n.startswith("hidden_states.")),
                        key=lambda n: int(n.split(".")[1]))
        clip.append(out[layers[-2]])
        pooled.append(out["text_embeds"])
    if len(ids) == 2:
        width = json.loads((folder / "transformer" / "config.json").read_text())["joint_attention_dim"]
        t5 = np.zeros((1, 256, width), np.float32)
    else:
        t5 = run(session(folder / "text_encoder_3" / "model.onnx"),
                 {"input_ids": np.array([ids[2]], np.int64)})["last_hidden_state"]
    joined = np.concatenate(clip, axis=-1)
    joined = np.pad(joined, ((0, 0), (0, 0), (0, t5.shape[-1] - joined.shape[-1])))
    return np.concatenate([joined, t5], axis=1), np.concatenate(pooled, axis=-1)


def generate_image_sd3(folder: Path | str, scheduler_config: Mapping, steps: int, latents: np.ndarray, *,
                       prompt_ids: Sequence[Sequence[int]],
                       negative_prompt_ids: Sequence[Sequence[int]] | None,
                       guidance_scale: float = 1.0) -> np.ndarray:
    """The image StableDiffusion3Pipeline computes from the same initial `latents`, by hand: the conditioning
    above, the transformer over [unconditional, conditional] rows with guidance, flow matching's Euler steps
    (x + (sigma_next - sigma) * velocity), the VAE on the latents unscaled and shifted."""
    folder = Path(folder)
    sigmas = flow_match_sigmas(scheduler_config, steps)
    return _flow_denoise(folder, scheduler_config, sigmas, latents.astype(np.float32), 0, prompt_ids,
                         negative_prompt_ids, guidance_scale)[0]


def _flow_denoise(folder: Path, scheduler_config: Mapping, sigmas: np.ndarray, x: np.ndarray, start: int,
                  prompt_ids: Sequence[Sequence[int]], negative_prompt_ids: Sequence[Sequence[int]] | None,
                  guidance_scale: float, after: Callable[[int, np.ndarray], np.ndarray] | None = None
                  ) -> tuple[np.ndarray, np.ndarray]:
    """generate_image_sd3's loop from step `start` on, and its VAE: (image, final latents); `after(i, x)`:
    the latents after step i (inpainting's blend)."""
    guided = guidance_scale > 1
    states, pooled = encode_prompt_sd3(folder, prompt_ids)
    if guided:
        negative = encode_prompt_sd3(folder, negative_prompt_ids)
        states, pooled = np.concatenate([negative[0], states]), np.concatenate([negative[1], pooled])
    transformer = session(folder / "transformer" / "model.onnx")
    for i in range(start, len(sigmas) - 1):
        batch = np.concatenate([x, x]) if guided else x
        t = np.full((len(batch),), sigmas[i] * np.float32(scheduler_config["num_train_timesteps"]),
                    np.float32)
        output = run(transformer, {"hidden_states": batch, "timestep": t, "encoder_hidden_states": states,
                                   "pooled_projections": pooled})["out_hidden_states"]
        if guided:
            uncond, cond = np.split(output, 2)
            output = uncond + np.float32(guidance_scale) * (cond - uncond)
        x = x + (sigmas[i + 1] - sigmas[i]) * output
        if after is not None:
            x = after(i, x)
    vae = json.loads((folder / "vae_decoder" / "config.json").read_text())
    unscaled = (x / np.float32(vae["scaling_factor"]) + np.float32(vae["shift_factor"])).astype(np.float32)
    decoded = run(session(folder / "vae_decoder" / "model.onnx"), {"latent_sample": unscaled})["sample"]
    return np.clip(decoded / 2 + 0.5, 0.0, 1.0).transpose(0, 2, 3, 1).astype(np.float32), x


def flow_strength_start(steps: int, strength: float) -> int:
    """The first step StableDiffusion3Img2ImgPipeline runs: int(max(steps - steps * strength, 0)), the
    float product (StableDiffusionImg2ImgPipeline's rounds the steps kept down instead)."""
    return int(max(steps - min(steps * strength, steps), 0))


def image_to_image_sd3(folder: Path | str, scheduler_config: Mapping, steps: int, strength: float,
                       image: np.ndarray, *, encode_noise: np.ndarray, add_noise: np.ndarray,
                       prompt_ids: Sequence[Sequence[int]],
                       negative_prompt_ids: Sequence[Sequence[int]] | None = None,
                       guidance_scale: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
    """(image, final latents) as StableDiffusion3Img2ImgPipeline computes them from the uint8 RGB `image`
    with the same noises: its latents (encode_image: the VAE's shift subtracted before scaling) noised by
    flow matching's scale_noise at the first step run, sigma * noise + (1 - sigma) * latents, then the
    flow loop from there."""
    folder = Path(folder)
    sigmas = flow_match_sigmas(scheduler_config, steps)
    start = flow_strength_start(steps, strength)
    latents = encode_image(folder, image, encode_noise)
    sigma = sigmas[start]
    x = (sigma * add_noise.astype(np.float32) + (np.float32(1.0) - sigma) * latents).astype(np.float32)
    return _flow_denoise(folder, scheduler_config, sigmas, x, start, prompt_ids, negative_prompt_ids,
                         guidance_scale)


def guidance_embedding(scale: float, width: int) -> np.ndarray:
    """LatentConsistencyModelPipeline.get_guidance_scale_embedding in float32 numpy: sinusoids of
    (scale - 1) * 1000 at width / 2 geometric frequencies from 1 to 1 / 10000, sines then cosines."""
    half = width // 2
    w = np.float32(scale - 1) * np.float32(1000.0)
    exponents = np.arange(half, dtype=np.float32) * -(np.float32(np.log(10000.0)) / (half - 1))
    # exp rounded from float64: torch's float32 exp is correctly rounded there, numpy's may be an ulp off,
    # and the angles reach thousands of radians (an ulp of a frequency moves a sine by ~1e-4)
    frequencies = np.exp(exponents.astype(np.float64)).astype(np.float32)
    angles = (w * frequencies).astype(np.float32)
    embedding = np.concatenate([np.sin(angles), np.cos(angles)]).astype(np.float32)
    return np.pad(embedding, (0, width % 2))[None, :]


def with_scheduler(folder: Path | str, config: Mapping, out: Path | str) -> Path:
    """A copy of a diffusers folder whose scheduler/scheduler_config.json is `config` (the rest linked):
    how a user switches schedulers, and how a test runs one folder under every case's scheduler."""
    folder, out = Path(folder), Path(out)
    out.mkdir(parents=True, exist_ok=True)
    for item in folder.iterdir():
        if item.name not in ("scheduler", "references"):
            os.symlink(item.resolve(), out / item.name)
    (out / "scheduler").mkdir()
    (out / "scheduler" / "scheduler_config.json").write_text(json.dumps(dict(config), indent=2) + "\n")
    return out


def inpaint_sd3(folder: Path | str, scheduler_config: Mapping, steps: int, strength: float, image: np.ndarray,
                mask: np.ndarray, *, encode_noise: np.ndarray, add_noise: np.ndarray,
                prompt_ids: Sequence[Sequence[int]],
                negative_prompt_ids: Sequence[Sequence[int]] | None = None,
                guidance_scale: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
    """(image, final latents) as StableDiffusion3InpaintPipeline computes them with a transformer of the
    latents' channels: the start of image_to_image_sd3 (at strength 1 the noise alone), and after each step
    the region the mask keeps set back to the image's latents noised by scale_noise to the next step's
    sigma, sigma * noise + (1 - sigma) * latents (clean after the last step)."""
    folder = Path(folder)
    sigmas = flow_match_sigmas(scheduler_config, steps)
    latents = encode_image(folder, image, encode_noise)
    e = add_noise.astype(np.float32)
    start = 0 if strength == 1.0 else flow_strength_start(steps, strength)
    x = e if strength == 1.0 else (sigmas[start] * e + (np.float32(1.0) - sigmas[start]) * latents)
    config = json.loads((folder / "vae_encoder" / "config.json").read_text())
    repaint = inpaint_mask(mask, 2 ** (len(config["block_out_channels"]) - 1))
    last = len(sigmas) - 2

    def blend(i: int, x: np.ndarray) -> np.ndarray:
        sigma = sigmas[i + 1]
        kept = latents if i == last else sigma * e + (np.float32(1.0) - sigma) * latents
        return ((1 - repaint) * kept + repaint * x).astype(np.float32)

    return _flow_denoise(folder, scheduler_config, sigmas, x.astype(np.float32), start, prompt_ids,
                         negative_prompt_ids, guidance_scale, blend)
