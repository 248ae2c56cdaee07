"""Denoising schedulers, read from diffusers' scheduler_config.json by class name and fields.

A scheduler here is the schedule of one request: each step's timestep, the scale of the UNet's input and the
coefficients of the `denoise_step` kernel (build/loop_kernels.py), which does the arithmetic on the latents.
The coefficients are computed in float64 from the config as diffusers 0.42 computes them (EulerDiscrete,
EulerAncestralDiscrete, DDIM and TCD (eta 0 to 1), DDPM, LCM, PNDM's PLMS, DPMSolverMultistep's dpmsolver++
and sde-dpmsolver++ of order 1 to 3, DPMSolverSinglestep's dpmsolver++ of order 1 to 3, UniPCMultistep's bh1
and bh2 of order 1 to 3, HeunDiscrete, KDPM2Discrete and KDPM2AncestralDiscrete, LMSDiscrete's linear
multistep of order 4, DEISMultistep's log-rho DEIS of order 1 to 3, EDMEuler's preconditioned Euler;
FlowMatchEulerDiscrete's flow matching, whose output is a velocity), for epsilon and v_prediction and the
three timestep spacings (arXiv 2305.08891, table 2), and Karras, exponential or beta sigmas
(`use_karras_sigmas`, arXiv 2206.00364; `use_exponential_sigmas`; `use_beta_sigmas`, arXiv 2407.12173) for
EulerDiscrete, HeunDiscrete, KDPM2Discrete (and its ancestral variant) and LMSDiscrete, Karras also for
DPMSolverMultistep, UniPCMultistep and DEISMultistep. A field whose value changes what diffusers computes and
that is not followed here is a ConfigError at load.

Each step is linear in the latents x, the guided model output, the predicted clean latents x0 (clipped
when the config says so), the step's noise and the x0 of up to three steps before (DPM-Solver's second and
third orders, UniPC's predictor and corrector; PNDM's past outputs, its x0 being the output itself):

    x0 = clip(x0_from_x * x + x0_from_output * output)
    x_next = from_x * x + from_x0 * x0 + from_output * output + from_noise * noise
             + from_previous_x0 * x0_prev + from_previous2_x0 * x0_prev2 + from_previous3_x0 * x0_prev3
"""

from __future__ import annotations

import math
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..errors import ConfigError, GenerationError
from ..jsonfile import quote

INF = math.inf
ALIASES = {  # the seed's snake-case names (section 12.3)
    "euler_discrete": "EulerDiscreteScheduler",
    "euler": "EulerDiscreteScheduler",
    "euler_ancestral_discrete": "EulerAncestralDiscreteScheduler",
    "euler_ancestral": "EulerAncestralDiscreteScheduler",
    "ddim": "DDIMScheduler",
    "lcm": "LCMScheduler",
    "tcd": "TCDScheduler",
    "dpm_solver_multistep": "DPMSolverMultistepScheduler",
    "dpmsolver_multistep": "DPMSolverMultistepScheduler",
    "dpm_solver_singlestep": "DPMSolverSinglestepScheduler",
    "dpmsolver_singlestep": "DPMSolverSinglestepScheduler",
    "pndm": "PNDMScheduler",
    "ddpm": "DDPMScheduler",
    "heun_discrete": "HeunDiscreteScheduler",
    "heun": "HeunDiscreteScheduler",
    "k_dpm_2_discrete": "KDPM2DiscreteScheduler",
    "kdpm2": "KDPM2DiscreteScheduler",
    "k_dpm_2_ancestral_discrete": "KDPM2AncestralDiscreteScheduler",
    "kdpm2_ancestral": "KDPM2AncestralDiscreteScheduler",
    "deis_multistep": "DEISMultistepScheduler",
    "deis": "DEISMultistepScheduler",
    "edm_euler": "EDMEulerScheduler",
    "lms_discrete": "LMSDiscreteScheduler",
    "lms": "LMSDiscreteScheduler",
    "flow_match_euler_discrete": "FlowMatchEulerDiscreteScheduler",
    "flow_match_euler": "FlowMatchEulerDiscreteScheduler",
    "unipc_multistep": "UniPCMultistepScheduler",
    "unipc": "UniPCMultistepScheduler",
}
_BETAS = {
    "num_train_timesteps": 1000,
    "beta_start": 0.0001,
    "beta_end": 0.02,
    "beta_schedule": "linear",
    "trained_betas": None,
    "prediction_type": "epsilon",
    "steps_offset": 0,
    "rescale_betas_zero_snr": False,
}
_KDPM2 = {  # KDPM2Discrete's and KDPM2AncestralDiscrete's
    **{k: v for k, v in _BETAS.items() if k != "rescale_betas_zero_snr"},
    "beta_start": 0.00085,
    "beta_end": 0.012,
    "use_karras_sigmas": False,
    "use_exponential_sigmas": False,
    "use_beta_sigmas": False,
    "timestep_spacing": "linspace",
}
_CONSISTENCY = {  # LCMScheduler's and TCDScheduler's
    **_BETAS,
    "beta_start": 0.00085,
    "beta_end": 0.012,
    "beta_schedule": "scaled_linear",
    "original_inference_steps": 50,
    "clip_sample": False,
    "clip_sample_range": 1.0,
    "set_alpha_to_one": True,
    "thresholding": False,
    "timestep_spacing": "leading",
    "timestep_scaling": 10.0,
}
_SOLVER = {  # DPM-Solver singlestep's and UniPC's: no thresholding, training sigmas, a last sigma of 0
    "thresholding": False,
    "use_karras_sigmas": False,
    "use_exponential_sigmas": False,
    "use_beta_sigmas": False,
    "use_flow_sigmas": False,
    "final_sigmas_type": "zero",
}
# diffusers' defaults of each class: what a field the config leaves out means.
DEFAULTS: dict[str, dict[str, Any]] = {
    "EulerDiscreteScheduler": {
        **_BETAS,
        "timestep_spacing": "linspace",
        "interpolation_type": "linear",
        "use_karras_sigmas": False,
        "use_exponential_sigmas": False,
        "use_beta_sigmas": False,
        "timestep_type": "discrete",
        "final_sigmas_type": "zero",
        "sigma_min": None,  # the ends of Karras or exponential sigmas (None: the spaced schedule's)
        "sigma_max": None,
    },
    "EulerAncestralDiscreteScheduler": {**_BETAS, "timestep_spacing": "linspace"},
    "DDIMScheduler": {
        **_BETAS,
        "timestep_spacing": "leading",
        "clip_sample": True,
        "clip_sample_range": 1.0,
        "set_alpha_to_one": True,
        "thresholding": False,
    },
    "LCMScheduler": _CONSISTENCY,
    "TCDScheduler": _CONSISTENCY,
    "DDPMScheduler": {
        **_BETAS,
        "variance_type": "fixed_small",
        "clip_sample": True,
        "clip_sample_range": 1.0,
        "thresholding": False,
        "timestep_spacing": "leading",
    },
    "PNDMScheduler": {
        **{k: v for k, v in _BETAS.items() if k != "rescale_betas_zero_snr"},
        "skip_prk_steps": False,
        "set_alpha_to_one": False,
        "timestep_spacing": "leading",
    },
    "DPMSolverMultistepScheduler": {
        **_BETAS,
        "timestep_spacing": "linspace",
        "solver_order": 2,
        "algorithm_type": "dpmsolver++",
        "solver_type": "midpoint",
        "lower_order_final": True,
        "euler_at_final": False,
        "thresholding": False,
        "use_karras_sigmas": False,
        "use_exponential_sigmas": False,
        "use_beta_sigmas": False,
        "use_lu_lambdas": False,
        "use_flow_sigmas": False,
        "final_sigmas_type": "zero",
        "lambda_min_clipped": -INF,
        "variance_type": None,
    },
    "DPMSolverSinglestepScheduler": {
        **{k: v for k, v in _BETAS.items() if k != "steps_offset"},
        "timestep_spacing": "linspace",  # no field of its own: its timesteps are spaced so whatever it says
        "solver_order": 2,
        "algorithm_type": "dpmsolver++",
        "solver_type": "midpoint",
        "lower_order_final": False,
        **_SOLVER,
        "lambda_min_clipped": -INF,
        "variance_type": None,
        "use_dynamic_shifting": False,
    },
    "HeunDiscreteScheduler": {
        **{k: v for k, v in _BETAS.items() if k != "rescale_betas_zero_snr"},
        "beta_start": 0.00085,
        "beta_end": 0.012,
        "use_karras_sigmas": False,
        "use_exponential_sigmas": False,
        "use_beta_sigmas": False,
        "clip_sample": False,
        "clip_sample_range": 1.0,
        "timestep_spacing": "linspace",
    },
    "KDPM2DiscreteScheduler": _KDPM2,
    "DEISMultistepScheduler": {
        **{k: v for k, v in _BETAS.items() if k != "rescale_betas_zero_snr"},
        "solver_order": 2,
        "thresholding": False,
        "algorithm_type": "deis",
        "solver_type": "logrho",
        "lower_order_final": True,
        "use_karras_sigmas": False,
        "use_exponential_sigmas": False,
        "use_beta_sigmas": False,
        "use_flow_sigmas": False,
        "timestep_spacing": "linspace",
        "use_dynamic_shifting": False,
    },
    "KDPM2AncestralDiscreteScheduler": _KDPM2,
    "LMSDiscreteScheduler": {
        **{k: v for k, v in _BETAS.items() if k != "rescale_betas_zero_snr"},
        "use_karras_sigmas": False,
        "use_exponential_sigmas": False,
        "use_beta_sigmas": False,
        "timestep_spacing": "linspace",
    },
    "UniPCMultistepScheduler": {
        **_BETAS,
        "timestep_spacing": "linspace",
        "solver_order": 2,
        "predict_x0": True,
        "solver_type": "bh2",
        "lower_order_final": True,
        "disable_corrector": [],
        **_SOLVER,
        "use_dynamic_shifting": False,
        "sigma_min": None,
        "sigma_max": None,
        "shift_terminal": None,
    },
    # EDM (Karras et al., arXiv 2206.00364): no betas; sigmas between sigma_max and sigma_min, preconditioned
    "EDMEulerScheduler": {
        "num_train_timesteps": 1000,
        "sigma_min": 0.002,
        "sigma_max": 80.0,
        "sigma_data": 0.5,
        "sigma_schedule": "karras",
        "prediction_type": "epsilon",
        "rho": 7.0,
        "final_sigmas_type": "zero",
    },
    # flow matching (Stable Diffusion 3): no betas; sigma runs from 1 (noise) to 0 along a straight line
    "FlowMatchEulerDiscreteScheduler": {
        "num_train_timesteps": 1000,
        "shift": 1.0,
        "use_dynamic_shifting": False,
        "base_shift": 0.5,
        "max_shift": 1.15,
        "base_image_seq_len": 256,
        "max_image_seq_len": 4096,
        "invert_sigmas": False,
        "shift_terminal": None,
        "use_karras_sigmas": False,
        "use_exponential_sigmas": False,
        "use_beta_sigmas": False,
        "time_shift_type": "exponential",  # read by the dynamic shifting only
        "stochastic_sampling": False,
    },
}
SCHEDULERS = tuple(DEFAULTS)
FLOW = ("FlowMatchEulerDiscreteScheduler",)  # flow matching (its image-to-image keeps its own step count)
BETALESS = (*FLOW, "EDMEulerScheduler")  # the classes without a beta schedule
# The values of the fields this module follows, per class (None: any value of the right kind).
_COMMON: dict[str, tuple[Any, ...] | None] = {
    "beta_schedule": ("linear", "scaled_linear"),
    "prediction_type": ("epsilon", "v_prediction"),
    "timestep_spacing": ("linspace", "leading", "trailing"),
    "rescale_betas_zero_snr": (False, True),
}
# the sigma schedules' classes without a zero-SNR rescale: Karras, exponential or beta sigmas
_SPREAD: dict[str, tuple[Any, ...] | None] = {
    **{k: v for k, v in _COMMON.items() if k != "rescale_betas_zero_snr"},
    "use_karras_sigmas": (False, True),
    "use_exponential_sigmas": (False, True),
    "use_beta_sigmas": (False, True),
}
ALLOWED: dict[str, dict[str, tuple[Any, ...] | None]] = {
    "EulerDiscreteScheduler": {
        **_COMMON,
        "interpolation_type": ("linear",),
        "use_karras_sigmas": (False, True),
        "use_exponential_sigmas": (False, True),
        "use_beta_sigmas": (False, True),
        "timestep_type": ("discrete",),
        "final_sigmas_type": ("zero", "sigma_min"),
    },
    "EulerAncestralDiscreteScheduler": dict(_COMMON),
    "DDIMScheduler": {**_COMMON, "thresholding": (False,)},
    "DDPMScheduler": {
        **_COMMON,
        "thresholding": (False,),
        # the variance of each step's noise; "learned" ones read a second half of the UNet's output
        "variance_type": ("fixed_small", "fixed_small_log", "fixed_large"),
    },
    "PNDMScheduler": {
        **{k: v for k, v in _COMMON.items() if k != "rescale_betas_zero_snr"},
        "skip_prk_steps": (True,),  # PLMS; the Runge-Kutta warm-up is not run
    },
    "LCMScheduler": {**_COMMON, "thresholding": (False,)},
    # its step neither clips nor thresholds (whatever the config says, as diffusers' step)
    "TCDScheduler": {**_COMMON, "thresholding": (False, True)},
    "DPMSolverMultistepScheduler": {
        **_COMMON,
        "algorithm_type": ("dpmsolver++", "sde-dpmsolver++"),
        "solver_order": (1, 2, 3),
        "solver_type": ("midpoint", "heun"),
        "thresholding": (False,),
        "use_karras_sigmas": (False, True),
        "use_exponential_sigmas": (False,),  # diffusers truncates its float32 timesteps: not followed
        "use_beta_sigmas": (False,),
        "use_lu_lambdas": (False,),
        "use_flow_sigmas": (False,),
        "final_sigmas_type": ("zero", "sigma_min"),
        "variance_type": (None,),
        "lambda_min_clipped": (-INF,),
    },
    # its timesteps are DPM-Solver's linspace ones whatever the spacing; it has no zero-SNR rescale
    "DPMSolverSinglestepScheduler": {
        **_COMMON,
        "rescale_betas_zero_snr": (False,),
        "algorithm_type": ("dpmsolver++",),
        "solver_order": (1, 2, 3),
        "solver_type": ("midpoint", "heun"),
        "thresholding": (False,),
        "use_karras_sigmas": (False, True),
        "use_exponential_sigmas": (False,),  # float timesteps, as DPM-Solver's multistep ones: not followed
        "use_beta_sigmas": (False,),
        "use_flow_sigmas": (False,),
        "final_sigmas_type": ("zero", "sigma_min"),
        "lower_order_final": (False, True),
        "variance_type": (None,),
        "lambda_min_clipped": (-INF,),
        "use_dynamic_shifting": (False,),
    },
    "HeunDiscreteScheduler": dict(_SPREAD),
    "KDPM2DiscreteScheduler": dict(_SPREAD),
    "DEISMultistepScheduler": {
        **{k: v for k, v in _COMMON.items() if k != "rescale_betas_zero_snr"},
        "solver_order": (1, 2, 3),
        "algorithm_type": ("deis",),  # diffusers runs only its log-rho DEIS
        "solver_type": ("logrho",),
        "lower_order_final": (False, True),
        "thresholding": (False,),
        "use_karras_sigmas": (False, True),
        "use_exponential_sigmas": (False,),  # diffusers truncates its float timesteps, as DPM-Solver's
        "use_beta_sigmas": (False,),
        "use_flow_sigmas": (False,),
        "use_dynamic_shifting": (False,),
    },
    "KDPM2AncestralDiscreteScheduler": dict(_SPREAD),
    "LMSDiscreteScheduler": dict(_SPREAD),
    "UniPCMultistepScheduler": {
        **_COMMON,
        "solver_order": (1, 2, 3),
        "predict_x0": (True,),  # the data-prediction form (diffusers' default)
        # diffusers registers midpoint, heun and logrho as bh2
        "solver_type": ("bh1", "bh2", "midpoint", "heun", "logrho"),
        "lower_order_final": (False, True),
        "disable_corrector": None,  # a list of step indices, checked with the numbers
        "thresholding": (False,),
        "use_karras_sigmas": (False, True),
        "use_exponential_sigmas": (False,),  # diffusers truncates its float32 timesteps: not followed
        "use_beta_sigmas": (False,),
        "use_flow_sigmas": (False,),
        "final_sigmas_type": ("zero", "sigma_min"),
        "use_dynamic_shifting": (False,),
        "sigma_min": (None,),  # Karras sigmas between other ends than the training schedule's
        "sigma_max": (None,),
        "shift_terminal": (None,),
    },
    "EDMEulerScheduler": {
        "prediction_type": ("epsilon", "v_prediction"),
        "sigma_schedule": ("karras", "exponential"),
        "final_sigmas_type": ("zero", "sigma_min"),
    },
    "FlowMatchEulerDiscreteScheduler": {
        "use_dynamic_shifting": (False,),  # its shift depends on the image's size (mu): not followed
        "invert_sigmas": (False,),
        "shift_terminal": (None,),
        "use_karras_sigmas": (False,),
        "use_exponential_sigmas": (False,),
        "use_beta_sigmas": (False,),
        "stochastic_sampling": (False,),
        "time_shift_type": ("exponential", "linear"),
    },
}
NUMBERS = (
    "num_train_timesteps",
    "beta_start",
    "beta_end",
    "steps_offset",
    "clip_sample_range",
    "original_inference_steps",
    "timestep_scaling",
)


def scheduler_config(raw: Mapping[str, Any], name: str | None, where: str) -> dict[str, Any]:
    """The scheduler's config: `raw` (a scheduler_config.json, or {}) with its class's defaults under it,
    the class `name` if given (as diffusers' `Cls.from_config(config)` switches schedulers) else the file's
    `_class_name`. A ConfigError names every field this module does not follow."""
    wanted = ALIASES.get(name, name) if name else raw.get("_class_name")
    if wanted not in DEFAULTS:
        found = quote(name if name else wanted)
        raise ConfigError(
            f"{where}: scheduler {found} is not run by ortpipe; it runs "
            f"{', '.join(SCHEDULERS)} (or {', '.join(ALIASES)})"
        )
    config = {
        **DEFAULTS[wanted],
        **{k: v for k, v in raw.items() if not k.startswith("_")},
        "_class_name": wanted,
    }
    if config.get("lambda_min_clipped") is None or config.get("lambda_min_clipped") == "-inf":
        config["lambda_min_clipped"] = -INF
    problems = []
    spreads = ("use_karras_sigmas", "use_exponential_sigmas", "use_beta_sigmas")
    chosen = [k for k in spreads if config.get(k) is True]
    if len(chosen) > 1:
        problems.append(f"{where}: {' and '.join(chosen)} are set together: diffusers takes one at most")
    for key, allowed in ALLOWED[wanted].items():
        if allowed is not None and config.get(key) not in allowed:
            problems.append(
                f"{where}: {wanted} with {key} {quote(config.get(key))} is not run by ortpipe "
                f"(it runs {', '.join(map(quote, allowed))})"
            )
    problems += _field_problems(config, wanted, where)
    if not problems and wanted not in BETALESS:
        problems += _schedule_problems(config, where)
    if problems:
        raise ConfigError(problems)
    return config


def _field_problems(config: Mapping[str, Any], wanted: str, where: str) -> list[str]:
    """The numeric fields' problems: their types and ranges."""
    problems = []
    for key in NUMBERS:
        value = config.get(key)
        if key in config and (not isinstance(value, (int, float)) or isinstance(value, bool) or value < 0):
            problems.append(f"{where}: {key} must be a number of 0 or more, found {quote(value)}")
    edm = wanted == "EDMEulerScheduler"  # its ends, data scale and rho are numbers it needs
    for key in ("sigma_min", "sigma_max", "sigma_data", "rho"):  # EulerDiscrete's and UniPC's ends, EDM's
        value = config.get(key) if key in DEFAULTS[wanted] else None
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if (value is not None or edm) and (not number or not 0 < value < INF):
            problems.append(f"{where}: {key} must be a positive number{'' if edm else ' or null'}, found "
                            f"{quote(value)}")
    skipped = config.get("disable_corrector", [])
    if not isinstance(skipped, list) or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0
                                                for i in skipped):
        problems.append(f"{where}: disable_corrector must be a list of step indices (integers of 0 or more), "
                        f"found {quote(skipped)}")
    betas = config.get("trained_betas")
    if betas is not None and (
        not isinstance(betas, list)
        or len(betas) != config["num_train_timesteps"]
        or not all(isinstance(b, (int, float)) and 0 <= b < 1 for b in betas)
    ):
        problems.append(f"{where}: trained_betas must be num_train_timesteps numbers in [0, 1)")
    count = config["num_train_timesteps"]
    if not isinstance(count, int) or isinstance(count, bool) or count < 2:
        problems.append(f"{where}: num_train_timesteps must be an integer of 2 or more, found {quote(count)}")
    for key in ("beta_start", "beta_end"):
        if isinstance(config.get(key), (int, float)) and not 0 <= config[key] < 1:
            problems.append(f"{where}: {key} must be in [0, 1), found {quote(config[key])}")
    shift = config.get("shift", 1.0)
    if not isinstance(shift, (int, float)) or isinstance(shift, bool) or not 0 < shift < INF:
        problems.append(f"{where}: shift must be a positive number, found {quote(shift)}")
    return problems


def _schedule_problems(config: Mapping[str, Any], where: str) -> list[str]:
    """What makes the noise schedule unusable: an alpha product of 0 or 1 (a sigma of 0 or infinity) before
    any zero-SNR rescale, which every scheduler here divides by somewhere."""
    betas = _betas(config)
    products = _cumprod(betas)
    bad = next((t for t, a in enumerate(products) if not 0 < a < 1), None)
    if bad is None and config.get("rescale_betas_zero_snr") and "rescale_betas_zero_snr" in DEFAULTS[
            config["_class_name"]]:
        if betas[-1] <= 0:
            return [f"{where}: rescale_betas_zero_snr needs a last beta above 0 (it is {betas[-1]:.3g})"]
        rescaled = alphas_cumprod(config)
        bad = next((t for t, a in enumerate(rescaled[:-1]) if not 0 < a < 1), None)
        products = rescaled
    if bad is not None:
        return [
            f"{where}: the betas make the alpha product {products[bad]:.3g} at timestep {bad} (it must stay "
            "strictly between 0 and 1: every beta above 0, and not so large that the product vanishes); "
            "check beta_start, beta_end, beta_schedule or trained_betas"
        ]
    return []


@dataclass(frozen=True)
class Step:
    timestep: float  # what the UNet's timestep input gets
    input_scale: float  # the UNet's input is x times this
    coefficients: tuple[float, ...]  # x0_from_x ... from_previous3_x0, in denoise_step's order
    noise: bool  # the step adds fresh noise
    # clean latents z noised to this step's level are a * z + b * noise (the scheduler's add_noise: where
    # image-to-image starts, what inpainting's blend goes back to)
    noised: tuple[float, float]
    remember: bool = True  # its x0 joins the memory the next steps read (previous_x0 ...)


@dataclass(frozen=True)
class Schedule:
    name: str
    init_noise_sigma: float  # the initial latents are standard normal noise times this
    steps: tuple[Step, ...]
    # image-to-image: the steps are the schedule's last ones, and the first latents are the image's
    # latents z noised as a * z + b * noise (noised's (a, b)); None: from noise alone (init_noise_sigma)
    noised: tuple[float, float] | None = None


def f32(x: float) -> float:
    """x rounded to float32, as diffusers keeps its timesteps (past float32's range: infinite, as a cast)."""
    try:
        return struct.unpack("<f", struct.pack("<f", x))[0]
    except OverflowError:
        return math.copysign(INF, x)


def _linspace(start: float, stop: float, count: int) -> list[float]:
    """numpy.linspace's values."""
    if count == 1:
        return [float(start)]
    step = (stop - start) / (count - 1)
    values = [start + i * step for i in range(count)]
    values[-1] = float(stop)
    return values


# the classes that keep the zero-SNR schedule's last alpha product at 2**-24, not 0 (their sigmas divide
# by it)
ZERO_SNR_FLOOR = ("EulerDiscreteScheduler", "EulerAncestralDiscreteScheduler", "DPMSolverMultistepScheduler",
                  "UniPCMultistepScheduler")


def _betas(config: Mapping[str, Any]) -> list[float]:
    count, start, end = config["num_train_timesteps"], config["beta_start"], config["beta_end"]
    if config.get("trained_betas"):
        return [float(b) for b in config["trained_betas"]]
    if config["beta_schedule"] == "scaled_linear":
        return [b * b for b in _linspace(start**0.5, end**0.5, count)]
    return _linspace(start, end, count)


def alphas_cumprod(config: Mapping[str, Any]) -> list[float]:
    count = config["num_train_timesteps"]
    out = _cumprod(_betas(config))
    if config.get("rescale_betas_zero_snr") and "rescale_betas_zero_snr" in DEFAULTS[config["_class_name"]]:
        # arXiv 2305.08891: the last timestep's signal made zero
        roots = [a**0.5 for a in out]
        first, last = roots[0], roots[-1]
        bars = [((r - last) * first / (first - last)) ** 2 for r in roots]
        out = _cumprod([1.0 - bars[0]] + [1.0 - bars[i] / bars[i - 1] for i in range(1, count)])
        if config["_class_name"] in ZERO_SNR_FLOOR:
            out[-1] = 2.0**-24  # close to 0, so that the first sigma is finite
    return out


def _alpha(cumprod: list[float], t: int, config: Mapping[str, Any], steps: int) -> float:
    """The alpha product at training timestep t; a GenerationError past the table (steps_offset too big)."""
    if not 0 <= t < len(cumprod):
        raise GenerationError(
            f"num_steps {steps} gives {config['_class_name']} timestep {t}, outside its "
            f"{len(cumprod)} training timesteps (steps_offset {config.get('steps_offset')}): lower "
            "steps_offset or change num_steps"
        )
    return cumprod[t]


def _cumprod(betas: list[float]) -> list[float]:
    product, out = 1.0, []
    for beta in betas:
        product *= 1.0 - beta
        out.append(product)
    return out


def spaced(config: Mapping[str, Any], steps: int) -> list[float]:
    """diffusers' timestep spacings: float, descending, not rounded."""
    count, spacing = config["num_train_timesteps"], config["timestep_spacing"]
    if spacing == "linspace":
        return _linspace(0, count - 1, steps)[::-1]
    if spacing == "leading":
        ratio = count // steps
        return [float(round(i * ratio)) + config["steps_offset"] for i in range(steps)][::-1]
    # trailing: numpy.arange(count, 0, -ratio).round() - 1, whose values numpy computes as start + i * delta
    ratio = count / steps
    delta = (count - ratio) - count
    length = math.ceil(count / ratio)
    return [float(round(count + i * delta)) - 1 for i in range(length)]


def _interp(x: float, table: list[float]) -> float:
    """numpy.interp(x, arange(len(table)), table)."""
    if x <= 0:
        return table[0]
    if x >= len(table) - 1:
        return table[-1]
    i = int(math.floor(x))
    return table[i] + (x - i) * (table[i + 1] - table[i])


def _x0_sigma(config: Mapping[str, Any], sigma: float) -> tuple[float, float]:
    """(from x, from output) of the clean latents in the sigma parametrisation (Euler)."""
    if config["prediction_type"] == "epsilon":
        return 1.0, -sigma
    return 1.0 / (sigma * sigma + 1), -sigma / (sigma * sigma + 1) ** 0.5


def _x0_alpha(config: Mapping[str, Any], alpha_prod: float) -> tuple[float, float]:
    """(from x, from output) of the clean latents in the alpha parametrisation (DDIM, LCM)."""
    if config["prediction_type"] == "epsilon":
        if alpha_prod == 0:  # diffusers divides by zero here and makes a NaN image
            raise GenerationError(
                f"{config['_class_name']} with rescale_betas_zero_snr has no signal left at its last "
                "training timestep, where an epsilon prediction gives no clean latents: use a "
                "v_prediction model, or a spacing or step count that does not start there"
            )
        return 1.0 / alpha_prod**0.5, -((1 - alpha_prod) ** 0.5) / alpha_prod**0.5
    return alpha_prod**0.5, -((1 - alpha_prod) ** 0.5)


def _step(
    timestep: float,
    scale: float,
    x0: tuple[float, float],
    clip: float = INF,
    *,
    x: float = 0.0,
    from_x0: float = 0.0,
    output: float = 0.0,
    noise: float = 0.0,
    previous: float = 0.0,
    previous2: float = 0.0,
    previous3: float = 0.0,
    remember: bool = True,
    noised: tuple[float, float],
    draws: bool | None = None,
) -> Step:
    """A step; it draws noise when its noise has a weight, or when `draws` says so (diffusers draws there
    even at weight 0: the draws after it keep their order)."""
    coefficients = (x0[0], x0[1], -clip, clip, x, from_x0, output, noise, previous, previous2, previous3)
    return Step(timestep, scale, coefficients, noise != 0.0 if draws is None else draws, noised, remember)


def _noised_sigma(sigma: float) -> tuple[float, float]:
    """add_noise of the sigma schedulers: z + sigma * noise (sigma in float32, as diffusers keeps it)."""
    return 1.0, f32(sigma)


def _noised_alpha(alpha_prod: float) -> tuple[float, float]:
    """add_noise of the alpha schedulers: sqrt(alpha_prod) z + sqrt(1 - alpha_prod) noise."""
    a = f32(alpha_prod)
    return a**0.5, (1.0 - a) ** 0.5


def exponential(sigma_max: float, sigma_min: float, steps: int) -> list[float]:
    """`steps` noise levels from sigma_max to sigma_min, evenly spaced in log sigma."""
    return [math.exp(v) for v in _linspace(math.log(sigma_max), math.log(sigma_min), steps)]


def karras(sigma_max: float, sigma_min: float, steps: int) -> list[float]:
    """Karras et al.'s noise levels (rho 7): `steps` values from sigma_max to sigma_min, evenly spaced in
    sigma ** (1 / rho)."""
    rho = 7.0
    high, low = sigma_max ** (1 / rho), sigma_min ** (1 / rho)
    return [(high + ramp * (low - high)) ** rho for ramp in _linspace(0.0, 1.0, steps)]


BETA_SHAPE = 0.6  # diffusers' beta sigmas: the Beta(0.6, 0.6) distribution's quantiles (arXiv 2407.12173)


def beta(sigma_max: float, sigma_min: float, steps: int) -> list[float]:
    """`steps` noise levels from sigma_max to sigma_min at the quantiles 1 ... 0 (evenly spaced) of the
    Beta(0.6, 0.6) distribution."""
    return [sigma_min + _beta_quantile(1.0 - q, BETA_SHAPE, BETA_SHAPE) * (sigma_max - sigma_min)
            for q in _linspace(0.0, 1.0, steps)]


def _beta_quantile(p: float, a: float, b: float) -> float:
    """The x in [0, 1] where the regularized incomplete beta function I_x(a, b) reaches p, by bisection (to
    the last bit)."""
    if p <= 0.0:
        return 0.0
    if p >= 1.0:
        return 1.0
    low, high = 0.0, 1.0
    while True:
        middle = (low + high) / 2
        if middle in (low, high):
            return middle
        if _incomplete_beta(middle, a, b) < p:
            low = middle
        else:
            high = middle


def _incomplete_beta(x: float, a: float, b: float) -> float:
    """I_x(a, b): x^a (1 - x)^b / (a B(a, b)) times the continued fraction 1 / (1 + d1 / (1 + d2 / ...)),
    d(2m + 1) = -(a + m)(a + b + m) x / ((a + 2m)(a + 2m + 1)), d(2m) = m (b - m) x / ((a + 2m - 1)(a + 2m)),
    evaluated from the front (modified Lentz); past its fast region, 1 - I_(1 - x)(b, a)."""
    if x > (a + 1) / (a + b + 2):
        return 1.0 - _incomplete_beta(1.0 - x, b, a)
    logs = math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)
    front = math.exp(logs)
    # the fraction 1 / (1 + d1 / (1 + d2 / ...)) by Lentz's method: numerators 1, d1, d2 ..., denominators 1
    tiny = 1e-300
    fraction, c, d = tiny, tiny, 0.0
    for j in range(1, 400):
        n = j - 1  # this numerator is d(n); the first, 1
        m = n // 2
        if n == 0:
            numerator = 1.0
        elif n % 2:
            numerator = -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1))
        else:
            numerator = m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m))
        d = 1.0 + numerator * d
        d = 1.0 / (d if abs(d) > tiny else tiny)
        c = 1.0 + numerator / c
        c = c if abs(c) > tiny else tiny
        fraction *= c * d
        if abs(c * d - 1.0) < 1e-16:
            break
    return front * fraction / a


def sigmas_to_t(sigmas: list[float], table: list[float]) -> list[float]:
    """The fractional training timesteps of `sigmas` (`table`: the training sigmas)."""
    logs = [math.log(s) if s > 0 else -INF for s in table]
    return [_sigma_to_t(sigma, logs) for sigma in sigmas]


def _sigma_to_t(sigma: float, logs: list[float]) -> float:
    """t interpolated linearly in log sigma between the last training sigma at or below `sigma` and the
    next (the table's first two below it, its last two above it), the weight clipped to [0, 1], as
    diffusers maps sigmas back to timesteps."""
    wanted = math.log(max(sigma, 1e-10))
    at_or_below = [i for i, value in enumerate(logs) if value <= wanted]
    low = min(at_or_below[-1] if at_or_below else 0, len(logs) - 2)
    if logs[low] == logs[low + 1]:  # two equal training sigmas: diffusers divides by zero (a NaN timestep)
        return math.nan  # make_schedule refuses the schedule as not finite
    weight = min(max((logs[low] - wanted) / (logs[low] - logs[low + 1]), 0.0), 1.0)
    return (1 - weight) * low + weight * (low + 1)


def _sigma_schedule(config: Mapping[str, Any], steps: int, spreads: bool) -> tuple[list[float], list[float],
                                                                                     list[float]]:
    """The spaced timesteps (float32), their sigmas (Karras or exponential ones when `spreads` and the config
    asks, between the spaced ends or the config's sigma_min/sigma_max), and the training sigmas."""
    cumprod = alphas_cumprod(config)
    timesteps = [f32(t) for t in spaced(config, steps)]
    table = [((1 - a) / a) ** 0.5 for a in cumprod]
    sigmas = [_interp(t, table) for t in timesteps]
    spread = None
    if spreads and config["use_karras_sigmas"]:
        spread = karras
    elif spreads and config["use_exponential_sigmas"]:
        spread = exponential
    elif spreads and config["use_beta_sigmas"]:
        spread = beta
    if spread:  # between the spaced ends, or the config's own
        high, low = config.get("sigma_max"), config.get("sigma_min")
        sigmas = spread(sigmas[0] if high is None else high, sigmas[-1] if low is None else low, steps)
        timesteps = [f32(t) for t in sigmas_to_t(sigmas, table)]
    _distinct(timesteps, config)
    return timesteps, sigmas, table


def _init_sigma(config: Mapping[str, Any], sigmas: list[float]) -> float:
    """The initial noise's scale: the largest sigma (linspace, trailing) or sqrt(sigma^2 + 1) (leading)."""
    top = max(sigmas)
    return top if config["timestep_spacing"] in ("linspace", "trailing") else (top * top + 1) ** 0.5


def euler(config: Mapping[str, Any], steps: int, ancestral: bool) -> Schedule:
    timesteps, sigmas, table = _sigma_schedule(config, steps, not ancestral)
    sigmas.append(table[0] if not ancestral and config["final_sigmas_type"] == "sigma_min" else 0.0)
    init = _init_sigma(config, sigmas)
    out = []
    for i, t in enumerate(timesteps):
        sigma, after = sigmas[i], sigmas[i + 1]
        noise = 0.0
        if ancestral:  # x + d * (down - sigma) + noise * up
            up = (after**2 * (sigma**2 - after**2) / sigma**2) ** 0.5
            after, noise = (after**2 - up**2) ** 0.5, up
        dt = after - sigma  # x + (x - x0) / sigma * dt
        out.append(
            _step(
                t,
                1 / (sigma * sigma + 1) ** 0.5,
                _x0_sigma(config, sigma),
                x=1 + dt / sigma,
                from_x0=-dt / sigma,
                noise=noise,
                noised=_noised_sigma(sigmas[i]),
            )
        )
    return Schedule(config["_class_name"], init, tuple(out))


def heun(config: Mapping[str, Any], steps: int) -> Schedule:
    """HeunDiscreteScheduler: 2 * steps - 1 model runs. Each timestep but the first is run twice: an Euler
    step to the next sigma (its x0 kept), then, at that sigma, the average of the two slopes from the first
    run's sample; the last run is an Euler step to 0. With x_mid the Euler step's result and s, s' the two
    sigmas, the correction is x_mid + (s' - s) / (2 s') * (x0_first - x0_mid): linear in what the kernel
    holds (derived from diffusers' sample + (d_first + d_mid) / 2 * (s' - s))."""
    timesteps, sigmas, _ = _sigma_schedule(config, steps, True)
    sigmas.append(0.0)
    clip = config["clip_sample_range"] if config["clip_sample"] else INF
    out = []
    for j, t in enumerate(timesteps):
        sigma, after = sigmas[j], sigmas[j + 1]
        dt = after - sigma
        euler_step = _step(t, 1 / (sigma * sigma + 1) ** 0.5, _x0_sigma(config, sigma), clip,
                           x=1 + dt / sigma, from_x0=-dt / sigma, noised=_noised_sigma(sigma))
        out.append(euler_step)
        if after > 0:  # the correction, run at the next timestep and sigma
            half = dt / (2 * after)
            # noised: diffusers' add_noise after this run's predecessor (inpainting's blend) reads the
            # run's sigma in its interleaved sigmas, here the next one
            out.append(_step(timesteps[j + 1], 1 / (after * after + 1) ** 0.5, _x0_sigma(config, after), clip,
                             x=1.0, from_x0=-half, previous=half, remember=False,
                             noised=_noised_sigma(after)))
    return Schedule(config["_class_name"], _init_sigma(config, sigmas), tuple(out))


def kdpm2(config: Mapping[str, Any], steps: int, ancestral: bool = False) -> Schedule:
    """KDPM2DiscreteScheduler: 2 * steps - 1 model runs. Each step but the last is an Euler step to the
    geometric mean si of its sigma s and the next s' (x0 kept), then a run there whose slope carries the first
    run's sample to s'; the last is an Euler step to 0. With x_mid the first step's result, the second is
    (s' x_mid + (si - s) x0_first - (s' - s) x0_mid) / si: linear in what the kernel holds (from diffusers'
    sample + (x_mid - x0_mid) / si * (s' - s)). Karras timesteps are rounded, as diffusers rounds them.

    KDPM2AncestralDiscreteScheduler (`ancestral`): the second run carries the sample to the ancestral step's
    down = sqrt(s'^2 - up^2) instead of s', the middle is the geometric mean of s and down, and noise times
    up = s' sqrt(s^2 - s'^2) / s is added (drawn at each second run, as diffusers draws it)."""
    timesteps, sigmas, table = _sigma_schedule(config, steps, True)
    if config["use_karras_sigmas"]:  # rounded; diffusers runs a repeated one as any other (by step index)
        # numpy's round: half to even, as Python's (a NaN one, from sigmas that overflow, stays for the check)
        timesteps = [float(round(t)) if math.isfinite(t) else t for t in timesteps]
    sigmas = [f32(s) for s in sigmas] + [0.0]  # diffusers keeps them in float32
    logs = [math.log(s) if s > 0 else -INF for s in table]
    out = []
    for j, t in enumerate(timesteps):
        sigma, after = sigmas[j], sigmas[j + 1]
        if sigma == 0:  # a sigma below float32's range (hostile betas): diffusers divides by it
            raise GenerationError(
                f"num_steps {steps} gives {config['_class_name']} a sigma of 0 at step {j + 1} (below "
                "float32's range): check beta_start, beta_end and trained_betas"
            )
        up = 0.0
        if ancestral:  # sigmas that grow (hostile betas): NaN, which make_schedule refuses, as diffusers' is
            up = (after**2 * (sigma**2 - after**2) / sigma**2) ** 0.5 if after <= sigma else math.nan
        # below 0 only by rounding, on sigmas hostile betas make: NaN, refused as diffusers' NaN would be
        down = ((after**2 - up**2) ** 0.5 if after**2 >= up**2 else math.nan) if ancestral else after
        middle = (sigma * down) ** 0.5  # 0 before the last sigma, 0
        dt = middle - sigma
        out.append(_step(t, 1 / (sigma * sigma + 1) ** 0.5, _x0_sigma(config, sigma), x=1 + dt / sigma,
                         from_x0=-dt / sigma, noised=_noised_sigma(sigma)))
        if middle > 0:
            out.append(_step(f32(_sigma_to_t(middle, logs)), 1 / (middle * middle + 1) ** 0.5,
                             _x0_sigma(config, middle), x=down / middle, from_x0=-(down - sigma) / middle,
                             previous=(middle - sigma) / middle, noise=up, remember=False,
                             noised=_noised_sigma(after)))  # diffusers' add_noise: its sigmas, not the mean
    return Schedule(config["_class_name"], _init_sigma(config, sigmas), tuple(out))


LMS_ORDER = 4  # LMSDiscreteScheduler.step's default order, which StableDiffusionPipeline keeps


def lms(config: Mapping[str, Any], steps: int, begin: int = 0) -> Schedule:
    """LMSDiscreteScheduler: each step moves x along the slopes d = (x - x0) / sigma of this run and the
    three before it, x + c0 d + c1 d_prev + ..., the coefficients the integrals of the Lagrange
    polynomials through those steps' sigmas from this sigma to the next (order min(step + 1, 4)).

    The kernel's x0 is the slope here (x0_from_x (1 - c_skip) / sigma, x0_from_output -c_out / sigma), so
    the memory holds past slopes. `begin`: the first run (image-to-image), from which diffusers keeps slopes:
    a step uses as many of its coefficients as it has slopes."""
    timesteps, sigmas, _ = _sigma_schedule(config, steps, True)
    sigmas = [f32(s) for s in sigmas] + [0.0]  # diffusers keeps them in float32
    out = []
    for i in range(begin, steps):
        sigma = sigmas[i]
        order = min(i + 1, LMS_ORDER)
        weights = [_lms_weight(sigmas, i, order, j) for j in range(min(i - begin + 1, order))]
        c = [*weights, 0.0, 0.0, 0.0][:LMS_ORDER]
        keep, scale = _x0_sigma(config, sigma)
        out.append(_step(timesteps[i], 1 / (sigma * sigma + 1) ** 0.5, ((1 - keep) / sigma, -scale / sigma),
                         x=1.0, from_x0=c[0], previous=c[1], previous2=c[2], previous3=c[3],
                         noised=_noised_sigma(sigma)))
    return Schedule(config["_class_name"], _init_sigma(config, sigmas), tuple(out))


def _lms_weight(sigmas: list[float], i: int, order: int, j: int) -> float:
    """The integral from sigmas[i] to sigmas[i + 1] of the Lagrange polynomial that is 1 at sigmas[i - j]
    and 0 at the other sigmas[i - k], k < order: in u = (tau - sigmas[i]) / (sigmas[i + 1] - sigmas[i]),
    whose factors' coefficients stay of the order of 1 however close the sigmas, expanded (ascending
    powers of u) and integrated exactly over [0, 1]."""
    low, width = sigmas[i], sigmas[i + 1] - sigmas[i]
    poly = [1.0]
    for k in range(order):
        if k != j:  # (tau - s_k) / (s_j - s_k) = ((low - s_k) + width * u) / (s_j - s_k)
            scale = sigmas[i - j] - sigmas[i - k]
            if scale == 0:  # two runs at one float32 sigma: diffusers divides by zero; make_schedule refuses
                return math.nan
            constant, slope = (low - sigmas[i - k]) / scale, width / scale
            poly = [(poly[p] if p < len(poly) else 0.0) * constant + (poly[p - 1] * slope if p else 0.0)
                    for p in range(len(poly) + 1)]
    return width * sum(c / (p + 1) for p, c in enumerate(poly))


def edm_euler(config: Mapping[str, Any], steps: int) -> Schedule:
    """EDMEulerScheduler (s_churn 0, as the pipelines call it): Karras sigmas of its rho, or sigmas even in
    log sigma, from sigma_max to sigma_min (float32, as diffusers keeps them); the UNet's timestep is
    0.25 log sigma, its input x / sqrt(sigma^2 + sigma_data^2), and the clean latents
    c_skip x + c_out output with sigma_data's preconditioning (c_out's sign is the prediction type's)."""
    low, high, rho, data = config["sigma_min"], config["sigma_max"], config["rho"], config["sigma_data"]
    if config["sigma_schedule"] == "karras":
        sigmas = [(high ** (1 / rho) + r * (low ** (1 / rho) - high ** (1 / rho))) ** rho
                  for r in _linspace(0.0, 1.0, steps)]
    else:
        sigmas = [math.exp(v) for v in _linspace(math.log(low), math.log(high), steps)][::-1]
    sigmas = [f32(sigma) for sigma in sigmas]
    timesteps = [f32(0.25 * math.log(sigma)) for sigma in sigmas]
    _distinct(timesteps, config)
    sigmas.append(sigmas[-1] if config["final_sigmas_type"] == "sigma_min" else 0.0)
    sign = 1.0 if config["prediction_type"] == "epsilon" else -1.0
    out = []
    for i, t in enumerate(timesteps):
        sigma, after = sigmas[i], sigmas[i + 1]
        x0 = (data**2 / (sigma**2 + data**2), sign * sigma * data / (sigma**2 + data**2) ** 0.5)
        dt = after - sigma
        out.append(_step(t, 1 / (sigma**2 + data**2) ** 0.5, x0, x=1 + dt / sigma, from_x0=-dt / sigma,
                         noised=_noised_sigma(sigma)))
    return Schedule(config["_class_name"], (high**2 + 1) ** 0.5, tuple(out))


def ddim(config: Mapping[str, Any], steps: int, eta: float = 0.0) -> Schedule:
    """DDIMScheduler's steps; with `eta` above 0, each adds noise of standard deviation eta times the
    square root of its variance (1 - a_prev) / (1 - a) (1 - a / a_prev), and its direction to the next
    latents shrinks to sqrt(1 - a_prev - that squared), as diffusers' step does."""
    cumprod = alphas_cumprod(config)
    final = 1.0 if config["set_alpha_to_one"] else cumprod[0]
    clip = config["clip_sample_range"] if config["clip_sample"] else INF
    out = []
    timesteps = [int(round(t)) for t in spaced(config, steps)]
    _distinct(timesteps, config)
    for t in timesteps:
        prev = t - config["num_train_timesteps"] // steps  # whatever the spacing, as diffusers does
        a, a_prev = _alpha(cumprod, t, config, steps), (cumprod[prev] if prev >= 0 else final)
        # x_prev = sqrt(a_prev) x0 + sqrt(1 - a_prev - std^2) eps + std noise, eps the model's own (before
        # any clipping)
        if config["prediction_type"] == "epsilon":
            eps = (0.0, 1.0)
        else:
            eps = ((1 - a) ** 0.5, a**0.5)
        std = eta * ((1 - a_prev) / (1 - a) * (1 - a / a_prev)) ** 0.5 if eta else 0.0
        direction = (1 - a_prev - std**2) ** 0.5
        out.append(
            _step(
                float(t),
                1.0,
                _x0_alpha(config, a),
                clip,
                x=direction * eps[0],
                from_x0=a_prev**0.5,
                output=direction * eps[1],
                noise=std,
                noised=_noised_alpha(a),
                draws=eta > 0,
            )
        )
    return Schedule(config["_class_name"], 1.0, tuple(out))


def ddpm(config: Mapping[str, Any], steps: int) -> Schedule:
    """DDPMScheduler over a spaced schedule: the posterior mean of the clean latents (clipped as the config
    says) and the latents, plus noise of the fixed variance at every timestep above 0."""
    cumprod = alphas_cumprod(config)
    timesteps = [int(round(t)) for t in spaced(config, steps)]  # as DDIM's
    _distinct(timesteps, config)
    clip = config["clip_sample_range"] if config["clip_sample"] else INF
    out = []
    for i, t in enumerate(timesteps):
        previous = timesteps[i + 1] if i + 1 < len(timesteps) else -1  # the schedule's next, as diffusers
        a = _alpha(cumprod, t, config, steps)
        a_prev = _alpha(cumprod, previous, config, steps) if previous >= 0 else 1.0
        kept = a / a_prev  # the alpha of this stride
        noise = 0.0
        if t > 0:
            small = max((1 - a_prev) / (1 - a) * (1 - kept), 1e-20)
            noise = (1 - kept) ** 0.5 if config["variance_type"] == "fixed_large" else small**0.5
        out.append(_step(float(t), 1.0, _x0_alpha(config, a), clip, x=kept**0.5 * (1 - a_prev) / (1 - a),
                         from_x0=a_prev**0.5 * (1 - kept) / (1 - a), noise=noise, noised=_noised_alpha(a)))
    return Schedule(config["_class_name"], 1.0, tuple(out))


def _original_steps(config: Mapping[str, Any]) -> int:
    """LCM's and TCD's original_inference_steps: the schedule they pick their timesteps from, every
    num_train_timesteps // it training timesteps."""
    original, count = config["original_inference_steps"], config["num_train_timesteps"]
    if isinstance(original, float) and original.is_integer():  # 50.0: the whole number it writes
        original = int(original)
    if isinstance(original, bool) or not isinstance(original, int) or not 1 <= original <= count:
        raise GenerationError(
            f"{config['_class_name']}'s original_inference_steps must be a whole number from 1 to "
            f"num_train_timesteps {count}, found {quote(original)}"
        )
    return original


def lcm(config: Mapping[str, Any], steps: int, strength: float = 1.0) -> Schedule:
    """LCMScheduler's steps: `steps` timesteps evenly picked from its original_inference_steps schedule;
    image-to-image (LatentConsistencyModelImg2ImgPipeline) picks them from the schedule's first
    int(original_inference_steps * strength) timesteps, the lowest ones, and runs them all."""
    original = _original_steps(config)
    if steps > original:
        raise GenerationError(
            f"num_steps {steps} is more than the LCM scheduler's original_inference_steps "
            f"{original}; lower num_steps"
        )
    cumprod = alphas_cumprod(config)
    final = 1.0 if config["set_alpha_to_one"] else cumprod[0]
    count = config["num_train_timesteps"]
    origin = [(i + 1) * (count // original) - 1 for i in range(int(original * strength))][::-1]
    if len(origin) < steps:
        raise GenerationError(
            f"strength {strength} leaves LCMScheduler {len(origin)} of its original_inference_steps "
            f"{original} timesteps, fewer than num_steps {steps}: raise strength or lower num_steps"
        )
    stride = len(origin) / steps  # numpy.linspace(0, len, steps, endpoint=False), floored
    timesteps = [origin[int(math.floor(i * stride))] for i in range(steps)]
    clip = config["clip_sample_range"] if config["clip_sample"] else INF
    out = []
    for i, t in enumerate(timesteps):
        prev = timesteps[i + 1] if i + 1 < steps else t
        a, a_prev = _alpha(cumprod, t, config, steps), (cumprod[prev] if prev >= 0 else final)
        scaled = t * config["timestep_scaling"]
        c_skip, c_out = 0.25 / (scaled**2 + 0.25), scaled / (scaled**2 + 0.25) ** 0.5  # sigma_data 0.5
        last = (
            i == steps - 1
        )  # denoised = c_out x0 + c_skip x; then sqrt(a_prev) denoised + sqrt(1 - a_prev) noise
        keep = 1.0 if last else a_prev**0.5
        out.append(
            _step(
                float(t),
                1.0,
                _x0_alpha(config, a),
                clip,
                x=keep * c_skip,
                from_x0=keep * c_out,
                noise=0.0 if last else (1 - a_prev) ** 0.5,
                noised=_noised_alpha(a),
            )
        )
    return Schedule(config["_class_name"], 1.0, tuple(out))


def tcd(config: Mapping[str, Any], steps: int, eta: float = 0.0) -> Schedule:
    """TCDScheduler's steps (trajectory consistency distillation, arXiv 2402.19159), with the pipeline's eta
    (TCD's gamma): LCMScheduler's timesteps; each step goes to the noised x0 at s = floor((1 - eta) t')
    (t' the next timestep, 0 after the last, the product in float32 as diffusers computes it), then, but at
    the last, forward to t' with noise: sqrt(a' / a_s) x_s + sqrt(1 - a' / a_s) noise. It never clips."""
    original, count = _original_steps(config), config["num_train_timesteps"]
    if steps > original:
        raise GenerationError(
            f"num_steps {steps} is more than the TCD scheduler's original_inference_steps {original}; lower "
            "num_steps"
        )
    cumprod = alphas_cumprod(config)
    origin = [(i + 1) * (count // original) - 1 for i in range(original)][::-1]
    stride = len(origin) / steps  # numpy.linspace(0, len, steps, endpoint=False), floored
    timesteps = [origin[int(math.floor(i * stride))] for i in range(steps)]
    _distinct(timesteps, config)
    out = []
    for i, t in enumerate(timesteps):
        last = i == steps - 1
        after = 0 if last else timesteps[i + 1]
        s = math.floor(f32(f32(1 - eta) * float(after)))
        a, a_after, a_s = _alpha(cumprod, t, config, steps), cumprod[after], cumprod[s]
        if config["prediction_type"] == "epsilon":
            eps = (0.0, 1.0)
        else:
            eps = ((1 - a) ** 0.5, a**0.5)
        # x_s = sqrt(a_s) x0 + sqrt(1 - a_s) eps, eps the model's own
        forward = eta > 0 and not last
        keep = (a_after / a_s) ** 0.5 if forward else 1.0
        direction = keep * (1 - a_s) ** 0.5
        out.append(
            _step(
                float(t),
                1.0,
                _x0_alpha(config, a),
                x=direction * eps[0],
                from_x0=keep * a_s**0.5,
                output=direction * eps[1],
                noise=(1 - a_after / a_s) ** 0.5 if forward else 0.0,
                noised=_noised_alpha(a),
                draws=forward,
            )
        )
    return Schedule(config["_class_name"], 1.0, tuple(out))


def _alpha_sigma_lambda(sigma: float) -> tuple[float, float, float]:
    alpha = 1 / (sigma * sigma + 1) ** 0.5
    return alpha, sigma * alpha, (INF if sigma == 0 else math.log(alpha) - math.log(sigma * alpha))


def _x0_dpm(config: Mapping[str, Any], alpha: float, sigma: float) -> tuple[float, float]:
    """(from x, from output) of the clean latents at (alpha, sigma), DPM-Solver's family's parametrisation."""
    return (1 / alpha, -sigma / alpha) if config["prediction_type"] == "epsilon" else (alpha, -sigma)


def _noised_dpm(sigma: float) -> tuple[float, float]:
    """add_noise of DPM-Solver's family: alpha z + sigma_t noise at sigma (float32, as diffusers keeps it)."""
    sigma = f32(sigma)
    return 1 / (sigma**2 + 1) ** 0.5, sigma / (sigma**2 + 1) ** 0.5


def _dpm_timesteps(config: Mapping[str, Any], steps: int, table: list[float]
                   ) -> tuple[list[int], list[float]]:
    """DPM-Solver's timesteps and their sigmas (the final sigma appended)."""
    count = config["num_train_timesteps"]
    if config["use_karras_sigmas"]:  # over the whole training range, whatever the spacing
        sigmas = karras(table[-1], table[0], steps)
        timesteps = [round(t) for t in sigmas_to_t(sigmas, table)]  # round half to even, as numpy
        if timesteps.count(timesteps[0]) > 1:
            _distinct(timesteps, config)  # diffusers would start from the repeat
    else:
        if config["timestep_spacing"] == "linspace":  # steps + 1 points, the last (0) dropped
            timesteps = [int(round(t)) for t in _linspace(0, count - 1, steps + 1)][::-1][:-1]
        elif config["timestep_spacing"] == "leading":
            ratio = count // (steps + 1)
            timesteps = [i * ratio + config["steps_offset"] for i in range(steps + 1)][::-1][:-1]
        else:
            timesteps = [int(t) for t in spaced(config, steps)]
        _distinct(timesteps, config)
        sigmas = [_interp(t, table) for t in timesteps]
    sigmas.append(table[0] if config["final_sigmas_type"] == "sigma_min" else 0.0)
    return timesteps, sigmas


def _dpm_order(config: Mapping[str, Any], i: int, steps: int, begin: int = 0) -> int:
    """The solver's order at step i: lower at the start (the first run is step `begin`), and at the end as
    the config says."""
    few = config["lower_order_final"] and steps < 15
    if i == steps - 1 and (config["euler_at_final"] or few or config["final_sigmas_type"] == "zero"):
        return 1
    order = min(config["solver_order"], i - begin + 1)  # the steps run before it so far
    return min(order, 2) if i == steps - 2 and few else order


def dpm_solver(config: Mapping[str, Any], steps: int, begin: int = 0) -> Schedule:
    """DPMSolverMultistepScheduler; `begin`: the first step run (image-to-image), where its lower-order start
    counts from."""
    table = [((1 - a) / a) ** 0.5 for a in alphas_cumprod(config)]
    timesteps, sigmas = _dpm_timesteps(config, steps, table)
    sde = config["algorithm_type"] == "sde-dpmsolver++"
    lambdas = [_alpha_sigma_lambda(s)[2] for s in sigmas]
    out = []
    for i, t in enumerate(timesteps):
        if i < begin:
            continue
        alpha_s, sigma_s, lambda_s = _alpha_sigma_lambda(sigmas[i])
        alpha_t, sigma_t, lambda_t = _alpha_sigma_lambda(sigmas[i + 1])
        x0 = _x0_dpm(config, alpha_s, sigma_s)
        decay = math.exp(-(lambda_t - lambda_s))  # exp(-h); 0 when the next sigma is 0
        if sde:  # the SDE variant: exp(-h) more decay of x, fresh noise of sigma_t sqrt(1 - exp(-2h))
            ratio, from_x0 = sigma_t / sigma_s * decay, alpha_t * (1.0 - decay * decay)
            noise = sigma_t * (1.0 - decay * decay) ** 0.5
        else:
            ratio, from_x0, noise = sigma_t / sigma_s, -alpha_t * (decay - 1.0), 0.0
        order = _dpm_order(config, i, steps, begin)
        noised = _noised_dpm(sigmas[i])
        if order == 1:
            out.append(_step(float(t), 1.0, x0, x=ratio, from_x0=from_x0, noise=noise, noised=noised))
            continue
        if abs(lambda_t - lambda_s) < 1e-6:  # Karras sigmas ending at sigma_min, then sigma_min again
            if order == 3 or config["solver_type"] == "heun":  # diffusers divides by zero: a NaN image
                raise GenerationError(
                    f"DPMSolverMultistepScheduler's step {i + 1} of {steps} goes from sigma {sigmas[i]:.4g} "
                    f"to the same sigma, where an order-{order} {config['solver_type']} step divides by "
                    'zero: set lower_order_final or euler_at_final true, or final_sigmas_type "zero"'
                )
            weights = [0.0, 0.0, 0.0]  # the midpoint's D1 term vanishes there
        else:
            behind = lambdas[i - order + 1 : i + 2]  # the steps behind, this one and the next
            weights = _multistep_weights(config, order, behind, alpha_t)
        out.append(_step(float(t), 1.0, x0, x=ratio, from_x0=from_x0 + weights[0], previous=weights[1],
                         previous2=weights[2], noise=noise, noised=noised))
    return Schedule(config["_class_name"], 1.0, tuple(out))


def _singlestep_orders(config: Mapping[str, Any], steps: int) -> list[int]:
    """DPMSolverSinglestepScheduler's order at each step: groups 1, 2, ... up to solver_order, each step of
    a group updating from the sample its group began with; lower at the end when lower_order_final, which
    diffusers' set_timesteps turns on when the steps do not divide into groups or the last sigma is 0."""
    order = config["solver_order"]
    lower = config["lower_order_final"] or steps % order != 0 or config["final_sigmas_type"] == "zero"
    group = list(range(1, order + 1))
    if not lower:
        orders = group * (steps // order)
    elif order == 1:
        orders = [1] * steps
    elif steps % order == 0:
        orders = group * (steps // order - 1) + group[:-1] + [1]
    else:
        orders = group * (steps // order) + group[: steps % order]
    if config["final_sigmas_type"] == "zero":
        orders[-1] = 1
    return orders


def _singlestep_update(config: Mapping[str, Any], order: int, lambdas: list[float], alpha_t: float
                       ) -> list[float]:
    """The weights of (this step's x0, the one before's, the one before that's) in an order-2 or 3 singlestep
    update from its group's first sample; `lambdas`: log(alpha / sigma) of the group's steps and the next."""
    heun = config["solver_type"] == "heun"
    lambda_t, first = lambdas[-1], lambdas[0]
    h = lambda_t - first
    decay = math.expm1(-h)  # exp(-h) - 1
    if order == 2:  # D0 = m1, D1 = (m0 - m1) / r0
        r0 = (lambdas[1] - first) / h
        d1 = alpha_t * (decay / h + 1.0) if heun else -0.5 * alpha_t * decay
        return [d1 / r0, -alpha_t * decay - d1 / r0, 0.0]
    r0, r1 = (lambdas[2] - first) / h, (lambdas[1] - first) / h  # D0 = m2; m0 this step's, m1, m2 before
    d1_0 = [0.0, 1.0 / r1, -1.0 / r1]  # (m1 - m2) / r1, over (m0, m1, m2)
    d1_1 = [1.0 / r0, 0.0, -1.0 / r0]  # (m0 - m2) / r0
    weights = [0.0, 0.0, -alpha_t * decay]
    if heun:
        d1 = [(r0 * a - r1 * b) / (r0 - r1) for a, b in zip(d1_0, d1_1, strict=True)]
        d2 = [2.0 * (b - a) / (r0 - r1) for a, b in zip(d1_0, d1_1, strict=True)]
        w1, w2 = alpha_t * (decay / h + 1.0), -alpha_t * ((decay + h) / h**2 - 0.5)
        return [w + w1 * a + w2 * b for w, a, b in zip(weights, d1, d2, strict=True)]
    w1 = alpha_t * (decay / h + 1.0)
    return [w + w1 * a for w, a in zip(weights, d1_1, strict=True)]


def dpm_singlestep(config: Mapping[str, Any], steps: int, begin: int = 0) -> Schedule:
    """DPMSolverSinglestepScheduler (dpmsolver++, orders 1 to 3): DPM-Solver's linspace timesteps (Karras
    sigmas if asked), each step of an order-k group an update from the sample the group began with and the
    group's x0s. That sample is the step's own latents undone by the group's earlier updates, so each step is
    still linear in its latents and the last three x0s. `begin`: image-to-image's first step (a group cut
    there starts lower, as diffusers' model outputs are empty there)."""
    table = [((1 - a) / a) ** 0.5 for a in alphas_cumprod(config)]
    timesteps, sigmas = _dpm_timesteps({**config, "timestep_spacing": "linspace"}, steps, table)
    levels = [_alpha_sigma_lambda(s) for s in sigmas]
    orders = _singlestep_orders(config, steps)
    out, before = [], (1.0, [0.0, 0.0, 0.0])  # the step before's update: (from its group's sample, x0s)
    for i in range(begin, steps):
        order = min(orders[i], i - begin + 1)
        start = i - order + 1  # the group's first step
        alpha_s, sigma_s, lambda_s = levels[i]
        alpha_t, sigma_t, lambda_t = levels[i + 1]
        if order == 1:
            weights = [-alpha_t * math.expm1(-(lambda_t - lambda_s)), 0.0, 0.0]
        else:
            weights = _singlestep_update(config, order, [levels[k][2] for k in range(start, i + 2)], alpha_t)
        from_sample = sigma_t / levels[start][1]
        ratio, kernel = from_sample, weights
        if order > 1:  # the group's sample = (x - the step before's x0 weights) / its from_sample
            kept, earlier = before
            ratio = from_sample / kept
            kernel = [weights[0], weights[1] - ratio * earlier[0], weights[2] - ratio * earlier[1]]
        before = (from_sample, weights)
        x0 = _x0_dpm(config, alpha_s, sigma_s)
        out.append(_step(float(timesteps[i]), 1.0, x0, x=ratio, from_x0=kernel[0], previous=kernel[1],
                         previous2=kernel[2], noised=_noised_dpm(sigmas[i])))
    return Schedule(config["_class_name"], 1.0, tuple(out))


def deis(config: Mapping[str, Any], steps: int, begin: int = 0) -> Schedule:
    """DEISMultistepScheduler (log-rho DEIS, orders 1 to 3): DPM-Solver's timesteps, its last sigma the
    smallest training one, and its order rule. The memory holds each step's noise prediction eps (the
    kernel's x0 slot: the output itself for epsilon models, sigma x + alpha v for v_prediction); a step
    is x_next = alpha_t (x / alpha_s + sum_j c_j eps_j), c_j the integral over rho = sigma / alpha, from
    this step's to the next's, of the Lagrange polynomial in log rho through the steps' own (1 at step j,
    0 at the others). `begin`: the first run (image-to-image), where the lower orders start."""
    internal = {**config, "final_sigmas_type": "sigma_min", "euler_at_final": False}
    table = [((1 - a) / a) ** 0.5 for a in alphas_cumprod(config)]
    timesteps, sigmas = _dpm_timesteps(internal, steps, table)
    out = []
    for i in range(begin, len(timesteps)):
        alpha_s, sigma_s, _ = _alpha_sigma_lambda(sigmas[i])
        alpha_t, _, _ = _alpha_sigma_lambda(sigmas[i + 1])
        eps = (0.0, 1.0) if config["prediction_type"] == "epsilon" else (sigma_s, alpha_s)
        order = _dpm_order(internal, i, steps, begin)
        nodes = [math.log(sigmas[i - j]) for j in range(order)]  # log rho of this step and those before
        c = [alpha_t * _log_lagrange_integral(nodes, j, sigmas[i], sigmas[i + 1]) for j in range(order)]
        c += [0.0] * (3 - order)
        noised = _noised_dpm(sigmas[i])
        out.append(_step(float(timesteps[i]), 1.0, eps, x=alpha_t / alpha_s, from_x0=c[0], previous=c[1],
                         previous2=c[2], noised=noised))
    return Schedule(config["_class_name"], 1.0, tuple(out))


def _log_lagrange_integral(nodes: list[float], j: int, low: float, high: float) -> float:
    """The integral over rho from `low` to `high` of P(log rho), P the Lagrange polynomial that is 1 at
    nodes[j] and 0 at the other nodes: with u = log rho, the integral of P(u) e^u du is
    e^u (P - P' + P'' - ...)(u) between the ends."""
    poly = [1.0]  # ascending powers of u
    for k, node in enumerate(nodes):
        if k != j:
            scale = nodes[j] - node
            if scale == 0:  # two steps at one sigma: diffusers divides by zero; make_schedule refuses
                return math.nan
            poly = [((poly[p - 1] if p else 0.0) - node * (poly[p] if p < len(poly) else 0.0)) / scale
                    for p in range(len(poly) + 1)]
    alternating, term, sign = [0.0] * len(poly), poly, 1.0
    while term:  # P - P' + P'' - ...
        alternating = [a + sign * (term[p] if p < len(term) else 0.0) for p, a in enumerate(alternating)]
        term, sign = [p * term[p] for p in range(1, len(term))], -sign

    def antiderivative(rho: float) -> float:
        u = math.log(rho)
        return rho * sum(a * u**p for p, a in enumerate(alternating))

    return antiderivative(high) - antiderivative(low)


def _multistep_weights(config: Mapping[str, Any], order: int, lambdas: list[float], alpha_t: float
                       ) -> list[float]:
    """The weights of (x0, the step before's x0, the one before that's) in an order-2 or 3 update's D1 and
    D2 terms; `lambdas`: log(alpha / sigma) of the steps behind, this step and the next."""
    lambda_s, lambda_t = lambdas[-2], lambdas[-1]
    h = lambda_t - lambda_s
    decay = math.exp(-h)
    r0 = (lambda_s - lambdas[-3]) / h
    if order == 2:
        d1, d2 = (1 / r0, -1 / r0, 0.0), (0.0, 0.0, 0.0)
    else:
        r1 = (lambdas[-3] - lambdas[-4]) / h
        d10, d11 = (1 / r0, -1 / r0, 0.0), (0.0, 1 / r1, -1 / r1)
        apart = tuple(a - b for a, b in zip(d10, d11, strict=True))
        d1 = tuple(a + r0 / (r0 + r1) * b for a, b in zip(d10, apart, strict=True))
        d2 = tuple(b / (r0 + r1) for b in apart)
    kept = 1.0 - decay * decay  # 1 - exp(-2h)
    midpoint = order == 2 and config["solver_type"] == "midpoint"
    if config["algorithm_type"] == "sde-dpmsolver++":
        w1 = 0.5 * alpha_t * kept if midpoint else alpha_t * (kept / (-2.0 * h) + 1.0)
        w2 = alpha_t * ((kept - 2.0 * h) / (2.0 * h) ** 2 - 0.5)
    else:
        w1 = -0.5 * alpha_t * (decay - 1.0) if midpoint else alpha_t * ((decay - 1.0) / h + 1.0)
        w2 = -alpha_t * ((decay - 1.0 + h) / h**2 - 0.5)
    return [w1 * a + w2 * b for a, b in zip(d1, d2, strict=True)]


def unipc(config: Mapping[str, Any], steps: int, begin: int = 0) -> Schedule:
    """UniPCMultistepScheduler (data prediction, B(h) bh1 or bh2, orders 1 to 3): at each step after the first
    run, the corrector (UniC) remakes the latents the step before's predictor (UniP) made, from the new x0;
    then the predictor steps on from them. Both are linear in x0 memories over the same log-SNR gap, so the
    corrected latents are the uncorrected ones plus a combination of x0s (the predictor's term minus the
    corrector's, the -alpha h phi_1 x0 terms cancelling), and each step is one denoise_step: x_next = r x +
    weights of x0 and up to three x0s before. `begin`: the first step run (image-to-image), where the
    warm-up of lower orders and the corrector count from, as diffusers' counters do."""
    table = [((1 - a) / a) ** 0.5 for a in alphas_cumprod(config)]
    timesteps, sigmas = _dpm_timesteps(config, steps, table)
    bh1 = config["solver_type"] == "bh1"
    if bh1 and sigmas[-1] == 0:
        raise GenerationError(
            "UniPCMultistepScheduler with solver_type bh1 and final_sigmas_type \"zero\" multiplies an "
            "infinite B(h) by zero on its last step (diffusers makes a NaN image): use bh2 or "
            'final_sigmas_type "sigma_min"'
        )
    vp = [_alpha_sigma_lambda(s) for s in sigmas]  # (alpha, sigma, lambda) of each level
    skipped = set(config["disable_corrector"])
    out: list[Step] = []
    before: int | None = None  # the order of the step before's predictor (its corrector's order)
    for i in range(begin, len(timesteps)):
        alpha_s, sigma_s, lambda_s = vp[i]
        order = config["solver_order"]
        if config["lower_order_final"]:
            order = min(order, steps - i)
        order = min(order, i - begin + 1)  # the warm-up: no more x0s than the steps run so far
        weights = [0.0, 0.0, 0.0, 0.0]  # of x0 at this step, the step before, ... (the kernel's memory)
        try:
            if before is not None and i - 1 not in skipped:  # the corrector: weights of the corrected x
                gap = _unipc_terms(vp, i - 1, before, bh1)
                rhos_p, rhos_c = _unipc_rhos(gap, before, predictor=True), _unipc_rhos(gap, before)
                scale = vp[i][0] * gap["b_h"]
                for k, r in enumerate(gap["rks"], 1):  # D1_k = (m[i-1-k] - m[i-1]) / r_k
                    w = scale * (rhos_p[k - 1] - rhos_c[k - 1]) / r
                    weights[1 + k] += w
                    weights[1] -= w
                weights[0] -= scale * rhos_c[-1]  # - alpha B(h) rho (m_i - m_{i-1})
                weights[1] += scale * rhos_c[-1]
            gap = _unipc_terms(vp, i, order, bh1)
            alpha_t, sigma_t = vp[i + 1][0], vp[i + 1][1]
            ratio = sigma_t / sigma_s
            weights = [ratio * w for w in weights]
            weights[0] -= alpha_t * gap["h_phi_1"]
            rhos_p = _unipc_rhos(gap, order, predictor=True)
            for k, r in enumerate(gap["rks"], 1):  # D1_k = (m[i-k] - m[i]) / r_k
                w = alpha_t * gap["b_h"] * rhos_p[k - 1] / r
                weights[k] -= w
                weights[0] += w
        except ZeroDivisionError:
            raise GenerationError(
                f"UniPCMultistepScheduler's step {i + 1} of {steps} (order {order}) divides by a log-SNR gap "
                "of zero (two equal noise levels, or an order above 1 onto sigma 0, where diffusers' latents "
                "become infinite): set lower_order_final true, or choose another number of steps"
            ) from None
        x0 = _x0_dpm(config, alpha_s, sigma_s)
        noised = _noised_dpm(sigmas[i])
        out.append(_step(float(timesteps[i]), 1.0, x0, x=ratio, from_x0=weights[0], previous=weights[1],
                         previous2=weights[2], previous3=weights[3], noised=noised))
        before = order
    return Schedule(config["_class_name"], 1.0, tuple(out))


def _unipc_terms(vp: list[tuple[float, float, float]], i: int, order: int, bh1: bool) -> dict[str, Any]:
    """The terms of a UniPC update from level i to i + 1 of `order`: the log-SNR ratios r_k of the x0s behind
    (k = 1 .. order - 1), h phi_1(h), B(h) and the b vector of its linear system."""
    h = vp[i + 1][2] - vp[i][2]
    hh = -h  # data prediction
    rks = [(vp[i - k][2] - vp[i][2]) / h for k in range(1, order)]
    h_phi_1 = math.expm1(hh)
    h_phi_k = h_phi_1 / hh - 1
    b_h = hh if bh1 else math.expm1(hh)
    factorial, b = 1, []
    for j in range(1, order + 1):
        b.append(h_phi_k * factorial / b_h)
        factorial *= j + 1
        h_phi_k = h_phi_k / hh - 1 / factorial
    return {"rks": rks, "h_phi_1": h_phi_1, "b_h": b_h, "b": b}


def _unipc_rhos(gap: dict[str, Any], order: int, predictor: bool = False) -> list[float]:
    """The predictor's weights of its D1 terms (order 2: 1/2; 3: the system without its last row and column),
    or the corrector's of its D1 terms and the new x0's (order 1: 1/2; else the whole system)."""
    rks = [*gap["rks"], 1.0]
    size = order - 1 if predictor else order
    if size <= 1:  # diffusers' simplified low orders: no term (order-1 predictor), or 1/2
        return [0.5] * size
    matrix = [[rk**j for rk in rks[:size]] for j in range(size)]
    return _solve(matrix, gap["b"][:size])


def _solve(matrix: list[list[float]], values: list[float]) -> list[float]:
    """The solution of a small linear system (Gaussian elimination with partial pivoting)."""
    n = len(values)
    rows = [[*row, value] for row, value in zip(matrix, values, strict=True)]
    for c in range(n):
        pivot = max(range(c, n), key=lambda r: abs(rows[r][c]))
        rows[c], rows[pivot] = rows[pivot], rows[c]
        if rows[c][c] == 0:
            raise ZeroDivisionError
        for r in range(c + 1, n):
            factor = rows[r][c] / rows[c][c]
            rows[r] = [a - factor * b for a, b in zip(rows[r], rows[c], strict=True)]
    out = [0.0] * n
    for r in reversed(range(n)):
        out[r] = (rows[r][n] - sum(rows[r][c] * out[c] for c in range(r + 1, n))) / rows[r][r]
    return out


# PLMS's combinations of its last outputs, by how many it has (diffusers' PNDMScheduler.step_plms)
PLMS = {1: (1.0,), 2: (1.5, -0.5), 3: (23 / 12, -16 / 12, 5 / 12), 4: (55 / 24, -59 / 24, 37 / 24, -9 / 24)}


def pndm(config: Mapping[str, Any], steps: int, begin: int = 0) -> Schedule:
    """PNDMScheduler with skip_prk_steps (PLMS), as Stable Diffusion 1.x's folders carry it: steps + 1 UNet
    runs (the second timestep twice: the second run averages its output with the first's and restarts from
    the first run's sample), each a DDIM-like step of a linear multistep combination of the past outputs.

    The kernel's x0 is the guided output itself here (x0_from_output 1), so the memory holds past outputs;
    the second run's is left out of it, as diffusers keeps it out of its `ets`. `begin`: the first run
    (image-to-image): the multistep start counts from there, as diffusers' counter does."""
    cumprod = alphas_cumprod(config)
    count = config["num_train_timesteps"]
    final = 1.0 if config["set_alpha_to_one"] else cumprod[0]
    ratio = count // steps
    base = [int(round(t)) for t in spaced(config, steps)][::-1]  # ascending
    timesteps = (base[:-1] + base[-2:-1] + base[-1:])[::-1]
    v = config["prediction_type"] == "v_prediction"
    out: list[Step] = []
    first: tuple[float, float] = (1.0, 0.0)  # the first run: x_1 = first[0] * x_0 + first[1] * output_0
    for i, t in enumerate(timesteps[begin:]):
        at, previous = (t + ratio, t) if i == 1 else (t, t - ratio)
        a = _alpha(cumprod, at, config, steps)
        a_prev = cumprod[previous] if previous >= 0 else final
        keep = (a_prev / a) ** 0.5
        drop = (a_prev - a) / (a * (1 - a_prev) ** 0.5 + (a * (1 - a) * a_prev) ** 0.5)
        # x_next = keep * x - drop * eps, eps = combination (epsilon) or a^0.5 combination + (1 - a)^0.5 x (v)
        from_x = keep - drop * ((1 - a) ** 0.5 if v else 0.0)
        scale = drop * (a**0.5 if v else 1.0)
        if i == 1:  # from the first run's sample x_0 = (x - first[1] * output_0) / first[0], outputs averaged
            step = _step(float(t), 1.0, (0.0, 1.0), x=from_x / first[0], from_x0=-scale * 0.5,
                         previous=-from_x * first[1] / first[0] - scale * 0.5, remember=False,
                         noised=_noised_alpha(_alpha(cumprod, t, config, steps)))
        else:  # the outputs so far, the second run's left out: 1 at the first run, i after it
            weights = (*PLMS[min(max(i, 1), 4)], 0.0, 0.0, 0.0)[:4]
            past = [-scale * w for w in weights]
            step = _step(float(t), 1.0, (0.0, 1.0), x=from_x, from_x0=past[0], previous=past[1],
                         previous2=past[2], previous3=past[3],
                         noised=_noised_alpha(_alpha(cumprod, t, config, steps)))
        if i == 0:
            first = (from_x, -scale)
        out.append(step)
    return Schedule(config["_class_name"], 1.0, tuple(out))


def flow_match(config: Mapping[str, Any], steps: int) -> Schedule:
    """Flow matching's Euler steps (FlowMatchEulerDiscreteScheduler without dynamic shifting): sigmas evenly
    spaced in training time between the shifted schedule's ends, each shifted (s * sigma / (1 + (s - 1) *
    sigma)), kept in float32 as diffusers keeps them, then 0; the model's output is the velocity, and a step
    is x + (sigma_next - sigma) * output. The model's input is the latents unscaled; the initial noise is
    not scaled either."""
    count, shift = config["num_train_timesteps"], float(config["shift"])

    def shifted32(sigma: float) -> float:  # the init's table, in float32 arithmetic as diffusers builds it
        return f32(f32(shift * sigma) / f32(1 + f32((shift - 1) * sigma)))

    sigma_max, sigma_min = shifted32(f32(count / count)), shifted32(f32(1 / count))
    times = _linspace(sigma_max * count, sigma_min * count, steps)
    sigmas = [f32(shift * s / (1 + (shift - 1) * s)) for s in (t / count for t in times)]
    timesteps = [f32(s * count) for s in sigmas]
    _distinct(timesteps, config)
    sigmas.append(0.0)
    out = [  # noised: scale_noise's sigma * noise + (1 - sigma) * z, in float32 as diffusers computes it
        _step(t, 1.0, (1.0, -sigmas[i]), x=1.0, output=f32(sigmas[i + 1] - sigmas[i]),
              noised=(f32(1.0 - sigmas[i]), sigmas[i]))
        for i, t in enumerate(timesteps)
    ]
    return Schedule(config["_class_name"], 1.0, tuple(out))


MAKERS: dict[str, Any] = {  # each class's schedule, from (config, steps)
    "EulerDiscreteScheduler": lambda config, steps: euler(config, steps, ancestral=False),
    "EulerAncestralDiscreteScheduler": lambda config, steps: euler(config, steps, ancestral=True),
    "DDIMScheduler": ddim,
    "DDPMScheduler": ddpm,
    "LCMScheduler": lcm,
    "TCDScheduler": tcd,
    "PNDMScheduler": pndm,
    "DPMSolverMultistepScheduler": dpm_solver,
    "DPMSolverSinglestepScheduler": dpm_singlestep,
    "HeunDiscreteScheduler": heun,
    "KDPM2DiscreteScheduler": kdpm2,
    "KDPM2AncestralDiscreteScheduler": lambda config, steps: kdpm2(config, steps, ancestral=True),
    "LMSDiscreteScheduler": lms,
    "DEISMultistepScheduler": deis,
    "EDMEulerScheduler": edm_euler,
    "FlowMatchEulerDiscreteScheduler": flow_match,
    "UniPCMultistepScheduler": unipc,
}


# The classes whose steps take the pipelines' eta: their schedules from (config, steps, eta)
ETA = {"DDIMScheduler": ddim, "TCDScheduler": tcd}
# The classes whose steps start at a begin index for image-to-image: the steps from there (the others'
# steps are the whole schedule's last ones as they are)
BEGUN = {"DPMSolverMultistepScheduler": dpm_solver, "DPMSolverSinglestepScheduler": dpm_singlestep,
         "PNDMScheduler": pndm, "UniPCMultistepScheduler": unipc, "LMSDiscreteScheduler": lms,
         "DEISMultistepScheduler": deis}
# two runs a timestep: diffusers' order 2
ORDER_2 = ("HeunDiscreteScheduler", "KDPM2DiscreteScheduler", "KDPM2AncestralDiscreteScheduler")
# The classes whose image-to-image schedule is another one, made from (config, steps, strength), run whole
SHORTENED = {"LCMScheduler": lcm}


def kept_steps(name: str, steps: int, strength: float) -> int:
    """How many of `steps` steps image-to-image at `strength` runs, by the rule of the pipelines of
    scheduler class `name`: the flow-matching classes' (Stable Diffusion 3's and Flux's image-to-image
    pipelines) keep steps - int(steps - steps * strength), the others' int(steps * strength)."""
    if name in FLOW:
        return steps - int(max(steps - min(steps * strength, steps), 0))
    return min(int(steps * strength), steps)


def make_schedule(config: Mapping[str, Any], steps: int, strength: float | None = None,
                  eta: float = 0.0) -> Schedule:
    """The schedule of `steps` steps for a config scheduler_config() made; with `strength`, image-to-image's
    (diffusers' StableDiffusionImg2ImgPipeline, StableDiffusion3Img2ImgPipeline): the last kept_steps() of
    the steps, run from the image's latents noised to the first of them; LCMScheduler's (SHORTENED), all the
    steps of the schedule it makes with the strength. `eta`: DDIMScheduler's noise (the pipelines' eta, which
    the other classes' steps do not take: refused for them)."""
    if eta and config["_class_name"] not in ETA:
        raise GenerationError(
            f"eta is DDIMScheduler's and TCDScheduler's (the noise their steps add); this folder's scheduler "
            f"is {config['_class_name']}: drop eta, or use one of those"
        )
    schedule = _whole_schedule(config, steps, strength if config["_class_name"] in SHORTENED else None, eta)
    if strength is None:
        return schedule
    name = config["_class_name"]
    if name in SHORTENED:  # every step of a schedule the strength shortened, from its first
        return Schedule(name, 1.0, schedule.steps, schedule.steps[0].noised)
    kept = kept_steps(name, steps, strength)
    if kept < 1:
        raise GenerationError(
            f"strength {strength} of num_steps {steps} runs no step (int(num_steps * strength) is 0): raise "
            "strength or num_steps"
        )
    begin = (steps - kept) * (2 if name in ORDER_2 else 1)
    first = schedule.steps[begin]
    picked = _computed(BEGUN[name], config, steps, begin).steps if name in BEGUN else schedule.steps[begin:]
    return Schedule(name, 1.0, tuple(picked), first.noised)


def _whole_schedule(config: Mapping[str, Any], steps: int, strength: float | None = None,
                    eta: float = 0.0) -> Schedule:
    name = config["_class_name"]
    if steps > config["num_train_timesteps"]:
        raise GenerationError(
            f"num_steps {steps} is more than the scheduler's num_train_timesteps "
            f"{config['num_train_timesteps']}"
        )
    if eta:
        schedule = _computed(ETA[name], config, steps, eta)
    elif strength is None:
        schedule = _computed(MAKERS[name], config, steps)
    else:
        schedule = _computed(SHORTENED[name], config, steps, strength)
    runs = steps + 1 if name == "PNDMScheduler" and steps > 1 else steps  # PLMS: the 2nd timestep twice
    if name in ORDER_2:
        runs = 2 * steps - 1  # two runs a step, but the last
    if len(schedule.steps) != runs:
        raise GenerationError(
            f"num_steps {steps} gives {name}{_spacing(config)} {len(schedule.steps)} timesteps; choose "
            "another number of steps"
        )
    for i, step in enumerate(schedule.steps):  # clipping bounds may be infinite; nothing else may
        numbers = (schedule.init_noise_sigma, step.timestep, step.input_scale, *step.coefficients[:2],
                   *step.coefficients[4:])
        if not all(isinstance(v, float) and math.isfinite(v) for v in numbers):
            raise GenerationError(
                f"num_steps {steps} gives {name} a step {i + 1} that is not a finite real number (its noise "
                "schedule's sigmas overflow or stop decreasing): check beta_start, beta_end, trained_betas "
                "and rescale_betas_zero_snr"
            )
    return schedule


def _computed(make: Any, config: Mapping[str, Any], steps: int, *args: Any) -> Schedule:
    """make(config, steps, *args); arithmetic that fails on the config's numbers (a division by a sigma that
    underflowed to 0, a NaN timestep rounded, an overflow) is a GenerationError naming the fields that make
    them, where diffusers would compute NaN latents or fail inside its set_timesteps."""
    try:
        return make(config, steps, *args)
    except (ConfigError, GenerationError):
        raise  # the makers' own refusals, with what to change
    except (ArithmeticError, ValueError) as e:
        raise GenerationError(
            f"num_steps {steps} gives {config['_class_name']} a schedule that cannot be computed ({e}: its "
            "noise schedule's sigmas underflow, overflow or stop decreasing): check beta_start, beta_end, "
            "trained_betas, rescale_betas_zero_snr and sigma_min / sigma_max"
        ) from e


def _distinct(timesteps: list[Any], config: Mapping[str, Any]) -> None:
    """diffusers runs repeated timesteps (or divides by zero on them): refuse the step count instead."""
    if len(set(timesteps)) != len(timesteps):
        raise GenerationError(
            f"num_steps {len(timesteps)} gives {config['_class_name']}{_spacing(config)} repeated "
            "timesteps; choose fewer steps"
        )


def _spacing(config: Mapping[str, Any]) -> str:
    spacing = config.get("timestep_spacing")
    return f" with {spacing} spacing" if spacing else ""
