"""The schedulers of the denoising loop (py/ortpipe/loops/schedulers.py) against the numpy ports of
diffusers 0.42's in tests/paradigm_refs.py (shown equal to diffusers in test_paradigm_models.py): the same
timesteps, initial sigma and input scales, and each step's kernel coefficients applied to random latents
give the port's step, for every scheduler of the test cases, every spacing and many step counts.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import numpy as np
import pytest

from ortpipe.errors import ConfigError, GenerationError
from ortpipe.loops.schedulers import make_schedule, scheduler_config
from tests import paradigm_refs as refs

STEPS = (1, 2, 3, 4, 5, 7, 11, 20, 25, 33, 49)


def _step(coefficients: tuple[float, ...], x: np.ndarray, output: np.ndarray, noise: np.ndarray,
          previous: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """What the denoise_step kernel computes from a step's coefficients (guidance aside)."""
    a, b, low, high, from_x, from_x0, from_output, from_noise, *from_previous = coefficients
    x0 = np.clip(a * x + b * output, low, high)
    after = from_x * x + from_x0 * x0 + from_output * output + from_noise * noise
    for weight, value in zip(from_previous, previous, strict=True):
        after = after + weight * value
    return after, x0


def _compare(config: dict, steps: int, rng: np.random.Generator, strength: float | None = None,
             eta: float = 0.0) -> float:
    """The largest difference of the latents after a step, relative to their largest, over the schedule;
    with `strength`, image-to-image's part of it, from the latents the port's add_noise makes; `eta`,
    DDIM's."""
    port = refs.make_scheduler(config, steps, eta=eta)
    schedule = make_schedule(scheduler_config(config, None, "test"), steps, strength, eta)
    start = 0 if strength is None else refs.strength_start(port, steps, strength)
    assert [s.timestep for s in schedule.steps] == [float(t) for t in port.timesteps[start:]]
    x = rng.normal(size=8) * 5
    if strength is None:
        assert schedule.init_noise_sigma == pytest.approx(port.init_noise_sigma, rel=1e-12)
    else:  # the clean latents noised to the first step's level (a, b in float32 where diffusers keeps them)
        clean, noise = x, rng.normal(size=8)
        x = port.add_noise(clean, noise, start)
        a, b = schedule.noised
        assert np.abs(a * clean + b * noise - x).max() <= 1e-6 * np.abs(x).max()
    ours, previous, worst = x.copy(), (np.zeros(8),) * 3, 0.0
    for k, step in enumerate(schedule.steps):
        i = start + k
        assert step.input_scale == pytest.approx(port.scale_model_input(np.ones(1), i)[0], rel=1e-12)
        assert not step.noise or i in port.noise_steps
        output, noise = rng.normal(size=8), rng.normal(size=8)
        x = port.step(output, i, x, noise if i in port.noise_steps else None)
        ours, x0 = _step(step.coefficients, ours, output, noise, previous)
        if step.remember:  # the memory: the x0 of the last three steps that keep theirs
            previous = (x0, *previous[:2])
        worst = max(worst, float(np.abs(ours - x).max() / np.abs(x).max()))
    return worst


@pytest.mark.slow
def test_schedules_equal_the_numpy_ports(sd_tiny: Path) -> None:
    rng = np.random.default_rng(0)
    cases = json.loads((sd_tiny / "references" / "cases.json").read_text())["cases"]
    worst, deis = 0.0, 0.0
    for case in cases:
        for spacing in ("linspace", "leading", "trailing"):
            config = {**case["scheduler"], "timestep_spacing": spacing}
            for steps in STEPS:
                difference = _compare(config, steps, rng)
                if config["_class_name"] == "DEISMultistepScheduler":
                    deis = max(deis, difference)
                else:
                    worst = max(worst, difference)
    ddim = next(c["scheduler"] for c in cases if c["scheduler"]["_class_name"] == "DDIMScheduler")
    for steps in (2, 5):  # clipping the predicted clean latents
        worst = max(worst, _compare({**ddim, "clip_sample": True, "clip_sample_range": 0.5}, steps, rng))
    tcd = next(c["scheduler"] for c in cases if c["scheduler"]["_class_name"] == "TCDScheduler")
    # eta: DDIM's noise every step and its shorter direction; TCD's noise and its intermediate timestep
    for base, spacings in ((ddim, ("linspace", "leading", "trailing")), (tcd, ("leading",))):
        for spacing, prediction in itertools.product(spacings, ("epsilon", "v_prediction")):
            config = {**base, "timestep_spacing": spacing, "prediction_type": prediction}
            for steps, eta in itertools.product(STEPS, (0.3, 0.75, 1.0)):
                worst = max(worst, _compare(config, steps, rng, eta=eta))
                for strength in (0.5, 1.0):
                    if int(steps * strength) >= 1:
                        worst = max(worst, _compare(config, steps, rng, strength, eta))
    print(f"max relative difference of the latents after every step: {worst:.1e} (DEIS {deis:.1e})")
    assert worst < 1e-12
    # DEIS's weights are differences of antiderivatives at two close sigmas (diffusers' closed forms in the
    # port, ortpipe's own expansion): each side loses about 1e-11 to the cancellation
    assert 0 < deis < 1e-10


@pytest.mark.slow
def test_image_to_image_schedules_equal_the_numpy_ports(sd_tiny: Path) -> None:
    """Entered part-way at every strength: the steps from there (DPM-Solver's and PNDM's multistep starts
    counted from there) and the add_noise of the first, for each scheduler that builds one."""
    rng = np.random.default_rng(1)
    cases = json.loads((sd_tiny / "references" / "cases.json").read_text())["cases"]
    worst, compared = 0.0, 0
    for case in cases:
        if case["scheduler"]["_class_name"] in ("LCMScheduler", "FlowMatchEulerDiscreteScheduler"):
            continue
        for spacing in ("linspace", "leading", "trailing"):
            config = {**case["scheduler"], "timestep_spacing": spacing}
            for steps in (2, 5, 11, 20):
                for strength in (0.3, 0.5, 0.75, 1.0):
                    if int(steps * strength) < 1:
                        continue
                    worst = max(worst, _compare(config, steps, rng, strength))
                    compared += 1
    print(f"{compared} image-to-image schedules, max relative difference of the latents: {worst:.1e}")
    assert worst < 1e-6


def test_a_class_name_switches_the_scheduler_and_defaults_fill_the_rest() -> None:
    """As diffusers' Cls.from_config(config): the file's fields, another class; fields the file lacks take
    the class's defaults; the seed's snake-case names work."""
    euler = {"_class_name": "EulerDiscreteScheduler", "beta_schedule": "scaled_linear",
             "beta_start": 0.00085, "beta_end": 0.012, "steps_offset": 1, "timestep_spacing": "leading"}
    ddim = scheduler_config(euler, "DDIMScheduler", "x")
    assert ddim["_class_name"] == "DDIMScheduler" and ddim["beta_start"] == 0.00085
    assert ddim["clip_sample"] is True
    assert scheduler_config({}, "lcm", "x")["original_inference_steps"] == 50
    assert scheduler_config({}, "euler_discrete", "x")["timestep_spacing"] == "linspace"


def test_what_a_schedule_cannot_do_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"DPMSolverMultistepScheduler with solver_order 4 is not run by "
                                          r"ortpipe \(it runs 1, 2, 3\)"):
        scheduler_config({"_class_name": "DPMSolverMultistepScheduler", "solver_order": 4}, None, "x")
    with pytest.raises(ConfigError, match="algorithm_type"):
        scheduler_config({"algorithm_type": "sde-dpmsolver"}, "DPMSolverMultistepScheduler", "x")
    with pytest.raises(ConfigError, match="use_karras_sigmas and use_exponential_sigmas are set together: "
                                          "diffusers takes one at most"):
        scheduler_config({"use_karras_sigmas": True, "use_exponential_sigmas": True}, "euler", "x")
    with pytest.raises(ConfigError, match="DPMSolverMultistepScheduler with use_exponential_sigmas True is "
                                          "not run by ortpipe"):  # diffusers truncates float32 timesteps
        scheduler_config({"use_exponential_sigmas": True}, "DPMSolverMultistepScheduler", "x")
    with pytest.raises(ConfigError, match="thresholding"):
        scheduler_config({"thresholding": True}, "DDIMScheduler", "x")
    with pytest.raises(GenerationError, match="num_steps 51 is more than the TCD scheduler's "
                                              "original_inference_steps 50; lower num_steps"):
        make_schedule(scheduler_config({}, "tcd", "x"), 51)
    zero_snr = scheduler_config({"rescale_betas_zero_snr": True, "timestep_spacing": "trailing"},
                                "DDIMScheduler", "x")
    refusal = "no signal left at its last training timestep, where an epsilon prediction gives no clean"
    with pytest.raises(GenerationError, match=refusal + " latents: use a v_prediction"):
        make_schedule(zero_snr, 4)  # trailing starts at 999, where the rescaled alpha product is 0
    assert make_schedule({**zero_snr, "timestep_spacing": "leading"}, 4).steps[0].timestep == 750.0
    # Karras sigmas end at the smallest training sigma, and final_sigmas_type sigma_min repeats it: a
    # third-order or heun update there divides by zero (diffusers' image is NaN); the midpoint's D1 is 0
    ending = {"use_karras_sigmas": True, "final_sigmas_type": "sigma_min", "lower_order_final": False}
    for order, solver in ((3, "midpoint"), (2, "heun"), (3, "heun")):
        with pytest.raises(GenerationError, match=f"step 5 of 5 goes from sigma 0.01 to the same sigma, "
                                                  f"where an order-{order} {solver} step divides by zero"):
            config = {**ending, "solver_order": order, "solver_type": solver}
            make_schedule(scheduler_config(config, "DPMSolverMultistepScheduler", "x"), 5)
    midpoint = make_schedule(scheduler_config(ending, "DPMSolverMultistepScheduler", "x"), 5).steps[-1]
    assert midpoint.coefficients[8:] == (0.0, 0.0, 0.0)
    lower = scheduler_config({**ending, "lower_order_final": True}, "DPMSolverMultistepScheduler", "x")
    assert make_schedule(lower, 5).steps[-1].coefficients[8] == 0.0  # first order there: no x0_prev
    assert make_schedule({**zero_snr, "prediction_type": "v_prediction"}, 4).steps[0].timestep == 999.0
    with pytest.raises(GenerationError, match="more than the LCM scheduler's original_inference_steps 50"):
        make_schedule(scheduler_config({}, "LCMScheduler", "x"), 51)
    with pytest.raises(GenerationError, match="num_steps 1000 gives DPMSolverMultistepScheduler with leading "
                                              "spacing repeated timesteps"):
        dpm = scheduler_config({"timestep_spacing": "leading"}, "DPMSolverMultistepScheduler", "x")
        make_schedule(dpm, 1000)


def test_what_unipc_cannot_do_is_refused() -> None:
    """UniPC's fields ortpipe does not follow, and the schedules diffusers turns into NaN or infinite
    latents (checked with diffusers 0.42.1: bh1 onto sigma 0 multiplies an infinite B(h) by zero; an order-2
    last step onto sigma 0 divides by a zero log-SNR ratio)."""
    def config(**fields: object) -> dict:
        return scheduler_config(fields, "UniPCMultistepScheduler", "x")

    for field, value, allowed in (("predict_x0", False, "True"), ("solver_order", 4, "1, 2, 3"),
                                  ("solver_type", "bh3", '"bh1", "bh2"'), ("thresholding", True, "False"),
                                  ("use_exponential_sigmas", True, "False"),
                                  ("use_flow_sigmas", True, "False"), ("sigma_min", 0.1, "None")):
        with pytest.raises(ConfigError, match=f"UniPCMultistepScheduler with {field} .* is not run by "
                                              rf"ortpipe \(it runs {allowed}"):
            config(**{field: value})
    for bad in ("1", [-1], [True], None):
        with pytest.raises(ConfigError, match="disable_corrector must be a list of step indices"):
            config(disable_corrector=bad)
    with pytest.raises(GenerationError, match="solver_type bh1 and final_sigmas_type \"zero\" multiplies an "
                                              "infinite B"):
        make_schedule(config(solver_type="bh1"), 5)
    with pytest.raises(GenerationError, match=r"step 5 of 5 \(order 2\) divides by a log-SNR gap of zero"):
        make_schedule(config(lower_order_final=False), 5)
    assert make_schedule(config(solver_type="bh1", final_sigmas_type="sigma_min"), 5).steps
    assert config(solver_type="midpoint")["solver_type"] == "midpoint"  # diffusers runs it as bh2
    bh2 = make_schedule(config(), 5).steps
    assert make_schedule(config(solver_type="midpoint"), 5).steps == bh2
    # the corrector matters: left out after every step, the steps' weights differ
    assert make_schedule(config(disable_corrector=[0, 1, 2, 3]), 5).steps[1:] != bh2[1:]


def test_hostile_scheduler_configs_give_clear_errors_or_finite_schedules() -> None:
    """Fields at and past their edges, alone and together, for every class and several step counts: a
    ConfigError or GenerationError, or a schedule whose every number is a finite float; never another
    exception (an IndexError, a ZeroDivisionError, a complex number from a negative square root)."""
    import itertools
    import math
    import random

    from ortpipe.loops.schedulers import SCHEDULERS

    edges = {
        "num_train_timesteps": [0, 1, 2, 3, 10, 1000],
        "beta_start": [0.0, 0.5, 0.99, 1.0, 1.5],
        "beta_end": [0.0, 0.02, 0.999, 1.0, 2.0],
        "beta_schedule": ["linear", "scaled_linear"],
        "steps_offset": [0, 1, 999, 5000],
        "timestep_spacing": ["linspace", "leading", "trailing"],
        "prediction_type": ["epsilon", "v_prediction"],
        "rescale_betas_zero_snr": [False, True],
        "use_karras_sigmas": [False, True],
        "use_exponential_sigmas": [False, True],
        "sigma_min": [None, 1e-30, 0.5, 50.0],
        "sigma_max": [None, 1e-30, 0.5, 1e30],
        "final_sigmas_type": ["zero", "sigma_min"],
        "set_alpha_to_one": [False, True],
        "solver_order": [1, 2, 3],
        "solver_type": ["midpoint", "heun"],
        "lower_order_final": [False, True],
        "algorithm_type": ["dpmsolver++", "sde-dpmsolver++"],
        "original_inference_steps": [1, 50, 5000, 10.5, 50.0],
        "skip_prk_steps": [True],
        "clip_sample": [False, True],
    }
    rng = random.Random(0)
    outcomes = {"schedule": 0, "refused": 0}
    # 300 configs a class (one draw of 60 once found none of the divisions by a sigma that underflowed)
    for name, _ in itertools.product(SCHEDULERS, range(300)):
        fields = {k: rng.choice(v) for k, v in edges.items() if rng.random() < 0.35}
        eta = rng.choice([0.0, 0.0, 0.3, 1.0])  # DDIM's and TCD's; the others refuse it
        for steps, strength in itertools.product((1, 2, 7, 50), (None, 0.5)):
            try:
                schedule = make_schedule(scheduler_config(fields, name, "x"), steps, strength, eta=eta)
            except (ConfigError, GenerationError):
                outcomes["refused"] += 1
                continue
            outcomes["schedule"] += 1
            numbers = [schedule.init_noise_sigma]
            numbers += [v for s in schedule.steps for v in (s.timestep, s.input_scale)]
            numbers += [v for s in schedule.steps for i, v in enumerate(s.coefficients) if i not in (2, 3)]
            clips = [v for s in schedule.steps for v in s.coefficients[2:4]]  # may be -inf, inf: no clipping
            assert all(isinstance(v, float) and math.isfinite(v) for v in numbers), (name, fields, steps)
            assert all(isinstance(v, float) and not math.isnan(v) for v in clips), (name, fields, steps)
    assert outcomes["schedule"] > 100 and outcomes["refused"] > 100, outcomes
