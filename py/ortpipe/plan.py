"""Config + session signatures -> an executable Plan.

The plan says, for every flow step, where each graph input comes from (a generation role, the KV
cache, a dataflow value, or the request) and which outputs to keep. Everything that needs the
graphs' signatures is validated here, at load time, and reported as one ConfigError.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

from .config.schema import TOKENS_OUTPUT, Config, FlowStep, KVCacheSpec, OutputSpec
from .errors import Problems, did_you_mean, one_of
from .execute.work import FusedStep
from .graphfacts import AttentionSite, DecoderFacts
from .signature import Signature, TensorInfo

# Feed kinds: where a graph input's value comes from on each run. The generation roles (input ids,
# attention mask, position ids, the cache branch flag, a repeat counter) are made by the executor;
# KV_PAST: the KV cache; FROM_OUTPUT: another session's output ("session.output" in Feed.source);
# CARRIED: the session's own output of the previous iteration (zeros at first); FROM_REQUEST: the
# request's own inputs; EMPTY: no rows (the producer was skipped).
INPUT_IDS, ATTENTION_MASK, POSITION_IDS, CACHE_BRANCH, COUNTER = (
    "input_ids", "attention_mask", "position_ids", "use_cache_branch", "counter")
KV_PAST, FROM_OUTPUT, CARRIED, FROM_REQUEST, EMPTY = (
    "kv_past",
    "from_output",
    "carried",
    "from_request",
    "empty",
)
# LOOP: what a loop that makes no tokens supplies itself, named by Feed.source: the denoising loop's model
# input ("sample") and timestep ("timestep") for its step session, its final latents ("latents") for a final
# session wired to the step session's output.
LOOP = "loop"
PHASES = ("init", "step", "final")  # the order flow steps run in
STREAM = "stream:"  # a LOOP feed of rows streamed from an earlier stage: "stream:SESSION.OUTPUT"
DENOISING_ROLES = ("sample", "timestep")
# step inputs the denoising loop feeds when the graph has them: Stable Diffusion XL's size conditioning, a
# latent consistency model's guidance embedding
DENOISING_OPTIONAL = ("time_ids", "timestep_cond")
# JOINED: init sessions' outputs joined along the last axis (a wire of several sources, Feed.parts), computed
# once the init phase has run; Feed.source names the joined value
JOINED = "joined"
ENCODER_MASK = "encoder_attention_mask"  # a decoder's mask over its encoder's positions
CODEBOOK_ROLES = ("input_ids", ENCODER_MASK)  # the codebook loop's step inputs (loops/codebooks)

# (past key, present key, past value, present value) name patterns tried by format "auto".
SEPARATE_PATTERNS = (
    (
        "past_key_values.{layer}.key",
        "present.{layer}.key",
        "past_key_values.{layer}.value",
        "present.{layer}.value",
    ),
    (
        "past_key_values.{layer}.key",
        "present_key_values.{layer}.key",
        "past_key_values.{layer}.value",
        "present_key_values.{layer}.value",
    ),
    ("past_key_{layer}", "present_key_{layer}", "past_value_{layer}", "present_value_{layer}"),
    (
        "past_key_self_{layer}",
        "present_key_self_{layer}",
        "past_value_self_{layer}",
        "present_value_self_{layer}",
    ),
    ("past.{layer}.key", "present.{layer}.key", "past.{layer}.value", "present.{layer}.value"),
    (  # optimum's merged encoder-decoder graphs (MusicGen): self and cross entries, presents carried
        "past_key_values.{layer}.decoder.key",
        "present.{layer}.decoder.key",
        "past_key_values.{layer}.decoder.value",
        "present.{layer}.decoder.value",
        "past_key_values.{layer}.encoder.key",
        "present.{layer}.encoder.key",
        "past_key_values.{layer}.encoder.value",
        "present.{layer}.encoder.value",
    ),
)
COMBINED_PATTERNS = (("past_{layer}", "present_{layer}"), ("past.{layer}", "present.{layer}"))


@dataclass(frozen=True)
class Feed:
    input: str
    kind: str
    source: str = ""  # FROM_OUTPUT / CARRIED: "session.output"
    dtype: str = "int64"
    parts: tuple[str, ...] = ()  # JOINED: the sources joined, in order
    groups: tuple[int, ...] = ()  # JOINED: Wire.groups
    zeros: tuple[int, ...] = ()  # JOINED: Wire.zeros
    width: int | None = None  # JOINED: the input's static last dimension, the groups' padded width


@dataclass(frozen=True)
class CacheEntry:
    """One past input fed back from one present output."""

    past_input: str
    present_output: str
    layer: int
    dtype: str
    shape: tuple[int | None, ...]  # batch and sequence axes are None, filled in per request
    batch_axis: int
    seq_axis: int
    window: int | None = None  # sliding-window layers keep only the last `window` positions
    frozen: bool = False  # a cross-attention entry of a merged graph: its first present is kept for good


@dataclass(frozen=True)
class KVPlan:
    format: str  # "separate" or "combined"
    share_buffer: bool
    entries: tuple[CacheEntry, ...]

    @property
    def layers(self) -> list[int]:
        return sorted({e.layer for e in self.entries})


@dataclass(frozen=True)
class FlowStepPlan:
    step: FlowStep
    session: str
    feeds: tuple[Feed, ...]
    outputs: tuple[str, ...]
    kv: KVPlan | None = None
    logits: str | None = None
    positions: str = "default"  # "default" or "mrope_3d", when the session takes position ids
    after_prefill: bool = False  # an embedding stage re-run per step: the prompt's pass was in init
    placeholder: str | None = None  # "image_token" / "audio_token": prompt ids this encoder's items expand
    features: tuple[str, ...] = ()  # outputs whose rows belong to the items, in order

    @property
    def request_inputs(self) -> list[str]:
        return [f.input for f in self.feeds if f.kind == FROM_REQUEST]


@dataclass(frozen=True)
class Plan:
    config: Config
    signatures: dict[str, Signature]
    init_levels: tuple[tuple[FlowStepPlan, ...], ...]  # the steps of one level may run side by side
    step_phase: tuple[FlowStepPlan, ...]  # run at every iteration (every token)
    final_phase: tuple[FlowStepPlan, ...]  # run once after the loop
    fused: FusedStep | None = None  # the step phase as one fused greedy decode step, when it can be
    facts: dict[str, DecoderFacts] = dataclasses.field(default_factory=dict)  # what each graph says

    @property
    def generator(self) -> FlowStepPlan | None:
        """The step whose logits drive generation: the last step-phase step with logits."""
        return next((s for s in reversed(self.step_phase) if s.logits), None)

    @property
    def max_positions(self) -> int | None:
        """The most positions the generator's graph can run (its rotary or position tables), if it says."""
        gen = self.generator
        facts = self.facts.get(gen.session) if gen else None
        return facts.max_positions if facts else None

    @property
    def vocab_size(self) -> int | None:
        """The generator's vocabulary: its logits' last dim, else what its graph shows."""
        gen = self.generator
        if gen is None:
            return None
        shape = self.signatures[gen.session].output(gen.logits).shape
        if shape and isinstance(shape[-1], int):
            return shape[-1]
        facts = self.facts.get(gen.session)
        return facts.vocab_size if facts else None

    @property
    def text_encoder(self) -> FlowStepPlan | None:
        """The init step that reads the request's text in an encoder-decoder pipeline (T5, BART, Marian: the
        prompt is the encoder's, the decoder starts from tokens.decoder_start); None for the others."""
        if self.config.pipeline.state.cross_cache is None or self.config.generation.loop != "autoregressive":
            return None
        for s in self.init_steps:
            ids = self.config.pipeline.sessions[s.session].inputs.get(INPUT_IDS, INPUT_IDS)
            if any(f.kind == FROM_REQUEST and f.input == ids for f in s.feeds):
                return s
        return None

    @property
    def init_steps(self) -> list[FlowStepPlan]:
        return [s for level in self.init_levels for s in level]

    @property
    def all_steps(self) -> list[FlowStepPlan]:
        return [*self.init_steps, *self.step_phase, *self.final_phase]


def make_plan(config: Config, signatures: dict[str, Signature],
              facts: dict[str, DecoderFacts] | None = None) -> Plan:
    """The plan of `config` over the sessions' signatures; `facts`: what each graph's nodes say of its
    heads, head size, positions and vocabulary (graphfacts), for what the signatures leave symbolic."""
    facts = facts or {}
    problems = Problems()
    _check_wires(config, signatures, problems)
    loaded = [s for s in config.pipeline.flow if s.run in signatures]
    plans = {id(s): _step_plan(config, s, loaded, signatures, facts.get(s.run), problems) for s in loaded}
    by_phase = {w: [plans[id(s)] for s in loaded if s.when == w] for w in ("init", "step", "final")}
    init = [_with_placeholder(config, s, by_phase["init"]) for s in by_phase["init"]]
    step = _embedding_stages(init, by_phase["step"]) + by_phase["step"]
    plan = Plan(
        config,
        signatures,
        _levels(init),
        tuple(step),
        tuple(by_phase["final"]),
        _fused_step(step, by_phase["final"], signatures, config.pipeline.outputs),
        facts,
    )
    _check_outputs(config, signatures, problems)
    _check_generated(plan, problems)
    _check_joined(config, plan, problems)
    _check_tokenizers(config, plan, problems)
    if config.generation.loop == "denoising":
        _check_denoising(config, plan, problems)
    if config.generation.loop == "autoregressive" and plan.generator is None and not config.pipeline.plugin:
        steps = [s.run for s in config.pipeline.flow if s.when == "step"]
        problems.add(
            'generation.loop is "autoregressive" but no step-phase session has a logits output '
            f"(step sessions: {one_of(steps) or 'none'}). Add a decoder step with "
            '"when": "step", or name its logits output in sessions.NAME.outputs.logits'
        )
    problems.raise_if_any()
    return plan


GENERATED_IDS = "generated.ids"  # the dataflow source of the whole generated sequence (final steps)


def _check_generated(plan: Plan, problems: Problems) -> None:
    """"generated.ids" feeds only final steps, integer inputs of a rank that holds the sequence: [batch,
    length], or [batch, codebooks, frames] with generation.codebooks (leading dims of 1 added)."""
    codebooks = plan.config.generation.codebooks is not None
    for s in plan.all_steps:
        for f in s.feeds:
            if f.kind != FROM_OUTPUT or f.source != GENERATED_IDS:
                continue
            info = plan.signatures[s.session].input(f.input)
            rank, dims = (3, "codebooks, frames") if codebooks else (2, "length")
            if s.step.when != "final":
                problems.add(f'"{GENERATED_IDS}" is the whole generated sequence, made after the loop: it '
                             f'feeds "when": "final" steps only, not "{s.session}" ({s.step.when})')
            elif info.rank < rank or info.dtype not in ("int64", "int32"):
                problems.add(f'"{GENERATED_IDS}" is integer ids [batch, {dims}] (leading dims of 1 added to '
                             f'fit); session "{s.session}" input "{f.input}" is {info.dtype} '
                             f"{list(info.shape)}")


# The ranks each kind of named output may have (OutputSpec.kind).
OUTPUT_RANKS = {"audio": (1, 2, 3), "image": (4,), "embedding": (3,)}


def _check_outputs(config: Config, sigs: dict[str, Signature], problems: Problems) -> None:
    """Each named output is an output of a session the flow runs, of a shape its kind can take."""
    for o in config.pipeline.outputs:
        sig = sigs.get(o.session)
        if sig is None:
            if o.session in config.pipeline.sessions and not config.pipeline.sessions[o.session].optional:
                problems.add(f'pipeline.output names session "{o.session}", which no flow step runs')
            continue
        info = sig.output(o.name)
        if info is None:
            problems.add(f'pipeline.output names "{o.name}", but session "{o.session}" has no such output '
                         f"(outputs: {one_of(sig.output_names)}).{did_you_mean(o.name, sig.output_names)}")
            continue
        ranks = OUTPUT_RANKS.get(o.kind)
        if ranks and info.rank not in ranks:
            problems.add(f'pipeline.output "{o.name}" is {o.kind} ("as": "{o.kind}"), which needs rank '
                         f"{' or '.join(map(str, ranks))}; session \"{o.session}\" gives {list(info.shape)}")
        elif o.kind == "audio" and info.rank == 3 and info.shape[1] not in (1, None):
            problems.add(f'pipeline.output "{o.name}" is mono audio: [batch, samples] or [batch, 1, '
                         'samples]; '
                         f'session "{o.session}" gives {list(info.shape)}')
        elif o.kind == "image" and info.shape[1] not in (3, None) and isinstance(info.shape[1], int):
            problems.add(
                f'pipeline.output "{o.name}" is an image: [batch, 3, height, width] in [-1, 1]; session '
                f'"{o.session}" gives {list(info.shape)}'
            )
        if o.kind != "tensor" and info.dtype not in ("float32", "float16"):
            problems.add(
                f'pipeline.output "{o.name}" is {o.kind}, which needs float32 or float16 values; '
                f'session "{o.session}" gives {info.dtype}'
            )


def _check_denoising(config: Config, plan: Plan, problems: Problems) -> None:
    """The denoising session takes the loop's sample and timestep; a final session reads its latents."""
    for s in plan.step_phase:
        fed = {f.source for f in s.feeds if f.kind == LOOP}
        spec = config.pipeline.sessions[s.session]
        for role in DENOISING_ROLES:
            if role not in fed:
                name = spec.inputs.get(role, role)
                inputs = plan.signatures[s.session].input_names
                problems.add(
                    f'generation.loop is "denoising", but session "{s.session}" has no input "{name}" '
                    f"for the loop's {role} (inputs: {one_of(inputs)}).{did_you_mean(name, inputs)} "
                    f"Name it in sessions.{s.session}.inputs.{role}"
                )
    final = [f for s in plan.final_phase for f in s.feeds if f.kind == LOOP]
    if plan.final_phase and not final:
        names = [s.session for s in plan.final_phase]
        problems.add(
            f'generation.loop is "denoising", but no final session ({one_of(names)}) reads the latents: '
            'wire the step session\'s output to it, e.g. {"from": "unet.out_sample", "to": '
            '"vae_decoder.latent_sample"}'
        )


def _fused_step(
    step: list[FlowStepPlan], final: list[FlowStepPlan], sigs: dict[str, Signature],
    outputs: tuple[OutputSpec, ...] = (),
) -> FusedStep | None:
    """The step phase as one fused greedy decode step (execute/work.py), when its shape allows: one
    decoder session run once per iteration, fed only input ids, an attention mask, 1D position ids
    and a KV cache (a concat cache with no window a kernel trims, or a shared buffer), and, with a concat
    cache, values fixed for the request (an encoder-decoder's encoder states and mask, its cache-branch
    flag and its frozen cross-attention entries: FusedStep.fixed), giving logits
    of a fixed vocabulary and nothing another step reads. Whether a request uses it depends on its
    settings (plain greedy) and on the target (Backend.fused_layouts)."""
    if len(step) != 1:
        return None
    s = step[0]
    if s.step.repeat != 1 or s.after_prefill or not s.kv or not s.logits or s.positions != "default":
        return None
    if s.step.accumulate or any(o.session == s.session for o in outputs):  # kept at every step
        return None
    read = {
        f.source.split(".")[0]
        for other in (*step, *final)
        for f in other.feeds
        if f.kind in (FROM_OUTPUT, CARRIED)
    }
    if s.session in read:
        return None
    layout = "shared" if s.kv.share_buffer else "concat"
    if layout == "concat" and any(e.window is not None for e in s.kv.entries):
        return None
    found = _fused_feeds(s)
    if found is None:
        return None
    roles, fixed = found
    if fixed and layout != "concat":
        return None
    sig = sigs[s.session]
    info = sig.output(s.logits)
    vocab = info.shape[-1] if info.shape else None
    if INPUT_IDS not in roles or not isinstance(vocab, int) or info.rank not in (2, 3):
        return None
    if POSITION_IDS in roles and sig.input(roles[POSITION_IDS][0]).rank != 2:
        return None
    return FusedStep(
        s.session,
        roles[INPUT_IDS],
        roles.get(ATTENTION_MASK),
        roles.get(POSITION_IDS),
        {e.present_output: e.past_input for e in s.kv.entries if not e.frozen},
        layout,
        s.outputs,
        s.logits,
        (1, 1, vocab) if info.rank == 3 else (1, vocab),
        tuple(fixed),
    )


def _fused_feeds(s: FlowStepPlan) -> tuple[dict[str, tuple[str, str]], list[str]] | None:
    """A fused step's roles (input ids, mask, positions: their input and dtype) and the inputs fixed for a
    request (what the init phase made, the request's, the cache-branch flag, frozen cross-attention
    entries); None when another feed (a carried output, ...) keeps it from fusing."""
    roles: dict[str, tuple[str, str]] = {}
    frozen = {e.past_input for e in s.kv.entries if e.frozen}
    fixed = []
    for f in s.feeds:
        if f.kind in (FROM_OUTPUT, FROM_REQUEST, CACHE_BRANCH) or f.input in frozen:
            fixed.append(f.input)
        elif f.kind != KV_PAST:
            if f.kind not in (INPUT_IDS, ATTENTION_MASK, POSITION_IDS) or f.kind in roles:
                return None
            roles[f.kind] = (f.input, f.dtype)
    return roles, fixed


def _embedding_stages(init: list[FlowStepPlan], step: list[FlowStepPlan]) -> list[FlowStepPlan]:
    """Init sessions that take input_ids and feed a step session run again at every later step,
    on the new tokens, with what they got from other sessions or the request left empty."""
    feeding = {f.source.split(".")[0] for s in step for f in s.feeds if f.kind == FROM_OUTPUT}
    stages = []
    for s in init:
        if s.session in feeding and any(f.kind == INPUT_IDS for f in s.feeds):
            feeds = tuple(
                Feed(f.input, EMPTY, f.source, f.dtype) if f.kind in (FROM_OUTPUT, FROM_REQUEST) else f
                for f in s.feeds
            )
            stages.append(dataclasses.replace(s, feeds=feeds, after_prefill=True))
    return stages


def _with_placeholder(config: Config, s: FlowStepPlan, init: list[FlowStepPlan]) -> FlowStepPlan:
    """An encoder of request data whose outputs another init session reads: its items (images,
    audio clips) stand in the prompt as placeholder tokens to expand."""
    requests = [f.input for f in s.feeds if f.kind == FROM_REQUEST]
    consumed = {f.source for other in init for f in other.feeds if f.kind == FROM_OUTPUT and other is not s}
    features = tuple(o for o in s.outputs if f"{s.session}.{o}" in consumed)
    if not requests or not features:
        return s
    kind = "image_token" if any("pixel" in n or "image" in n for n in requests) else "audio_token"
    if getattr(config.tokens, kind) is None:
        return s
    return dataclasses.replace(s, placeholder=kind, features=features)


def _check_wires(config: Config, sigs: dict[str, Signature], problems: Problems) -> None:
    for w in config.pipeline.stage_inputs:
        if w.joined:
            problems.add(f"the wire {w} joins several sources across stages: join them inside one stage")
    for w in (*config.pipeline.dataflow, *config.pipeline.stage_inputs):  # a stage's: the other end elsewhere
        dst = sigs.get(w.to_session)
        for source in w.sources:
            session, output = source.split(".", 1)
            src = sigs.get(session)
            if src and output not in src.output_names:
                problems.add(
                    f'Dataflow wire references output "{output}" but session "{session}" has '
                    f"no such output (available outputs: {one_of(src.output_names)})."
                    f"{did_you_mean(output, src.output_names)}"
                )
        if dst and w.to_input not in dst.input_names:
            problems.add(
                f'Dataflow wire references input "{w.to_input}" but session "{w.to_session}" has '
                f"no such input (available inputs: {one_of(dst.input_names)})."
                f"{did_you_mean(w.to_input, dst.input_names)}"
            )


def _step_plan(
    config: Config,
    step: FlowStep,
    flow: list[FlowStep],
    sigs: dict[str, Signature],
    facts: DecoderFacts | None,
    problems: Problems,
) -> FlowStepPlan:
    spec, sig = config.session_of(step), sigs[step.run]
    kv = _kv_plan(config, step.run, sig, facts, problems)
    cache_inputs = {e.past_input for e in kv.entries} if kv else set()
    roles = {
        INPUT_IDS: spec.inputs.get("input_ids", "input_ids"),
        ATTENTION_MASK: spec.inputs.get("attention_mask", "attention_mask"),
        POSITION_IDS: spec.inputs.get("position_ids", config.pipeline.state.position_ids.input_name),
        CACHE_BRANCH: "use_cache_branch",
    }
    if step.counter:
        roles[COUNTER] = step.counter
    loop = config.generation.loop
    codebooks = config.generation.codebooks is not None
    if loop != "autoregressive":  # a loop that makes no tokens feeds its sessions itself (LOOP, FROM_REQUEST)
        roles = {}
    elif codebooks:  # the codebook loop makes the text inputs and the step's ids itself
        roles = {CACHE_BRANCH: "use_cache_branch"} if step.when == "step" else {}
    elif config.pipeline.state.cross_cache is not None and step.when == "init":
        # an encoder-decoder's encoder reads the request's text (Model.request makes it); the decoder's ids
        # start from tokens.decoder_start
        roles = {}
    by_name = {name: role for role, name in roles.items()}
    # the text's mask for an encoder-decoder's cross-attention, given with the request (Model.request)
    request_roles = (
        {spec.inputs.get(ENCODER_MASK, ENCODER_MASK)}
        if config.pipeline.state.cross_cache is not None and step.when == "step" and loop == "autoregressive"
        and not codebooks else set()
    )
    loop_roles = (
        {spec.inputs.get(r, r): r for r in (*DENOISING_ROLES, *DENOISING_OPTIONAL)}
        if loop == "denoising" and step.when == "step"
        else {spec.inputs.get(r, r): r for r in CODEBOOK_ROLES}
        if codebooks and step.when == "step"
        else {}
    )
    feeds = []
    positions = "default"
    for t in sig.inputs:
        if t.name in cache_inputs:
            feeds.append(Feed(t.name, KV_PAST, dtype=t.dtype))
            continue
        feed = (
            (Feed(t.name, LOOP, loop_roles[t.name], t.dtype) if t.name in loop_roles else None)
            or _stage_input(config, step, t)
            or _explicit_wire(config, step, t)
            or (Feed(t.name, by_name[t.name], dtype=t.dtype) if t.name in by_name else None)
            or _same_name_output(config, step, flow, sigs, t)
        )
        if feed is None and (step.when == "init" or t.name in request_roles):
            feed = Feed(t.name, FROM_REQUEST, dtype=t.dtype)
        if loop == "denoising" and step.when == "final" and _from_step(feed, flow):
            feed = Feed(t.name, LOOP, "latents", t.dtype)  # the step session's wire carries the final latents
        if feed is None:
            problems.add(_unfed_message(step.run, t))
            continue
        if feed.kind == POSITION_IDS:
            positions = _position_strategy(config, step.run, t, problems)
        feeds.append(feed)
    _check_loop(step, sig, problems)
    _check_accumulate(step, sig, problems)
    logits = spec.outputs.get("logits", "logits")
    logits = logits if logits in sig.output_names else None
    outputs = tuple(t.name for t in sig.outputs)
    return FlowStepPlan(step, step.run, tuple(feeds), outputs, kv, logits, positions)


def _from_step(feed: Feed | None, flow: list[FlowStep]) -> bool:
    """Whether `feed` takes a step-phase session's output."""
    producer = feed.source.split(".")[0] if feed is not None and feed.kind == FROM_OUTPUT else None
    return any(s.run == producer and s.when == "step" for s in flow)


def _check_loop(step: FlowStep, sig: Signature, problems: Problems) -> None:
    if step.loop != "per_image" or not step.loop_over:
        return
    info = sig.input(step.loop_over)
    if info is None:
        problems.add(
            f'Flow step "{step.run}" loops over "{step.loop_over}", but session "{step.run}" has no such '
            "input "
            f"(inputs: {one_of(sig.input_names)}).{did_you_mean(step.loop_over, sig.input_names)}"
        )
    elif step.dynamic_shape and any(d >= info.rank for d in step.dynamic_shape.apply_to_dims):
        problems.add(
            f'Flow step "{step.run}" crops dims {list(step.dynamic_shape.apply_to_dims)} of '
            f'"{step.loop_over}", '
            f"which has only {info.rank} dims {list(info.shape)}"
        )


def _stage_input(config: Config, step: FlowStep, t: TensorInfo) -> Feed | None:
    """An input an earlier stage feeds. A step input of an autoregressive stage fed an accumulated output
    takes the rows of its run's positions, which the stage runner supplies before each run (LOOP, source
    "stream:SESSION.OUTPUT"); any other is given with the request."""
    for w in config.pipeline.stage_inputs:
        if w.to_session != step.run or w.to_input != t.name:
            continue
        rows = step.when == "step" and config.generation.loop == "autoregressive"
        if rows and w.from_output != TOKENS_OUTPUT:
            return Feed(t.name, LOOP, f"{STREAM}{w.source}", t.dtype)
        return Feed(t.name, FROM_REQUEST, dtype=t.dtype)
    return None


def _check_accumulate(step: FlowStep, sig: Signature, problems: Problems) -> None:
    for name in step.accumulate:
        info = sig.output(name)
        if info is None:
            problems.add(
                f'Flow step "{step.run}" accumulates "{name}", which session "{step.run}" does not output '
                f"(outputs: {one_of(sig.output_names)}).{did_you_mean(name, sig.output_names)}"
            )
        elif info.rank is not None and info.rank < 2:
            problems.add(
                f'Flow step "{step.run}" accumulates "{name}" ({list(info.shape)}), which has no sequence '
                "axis: outputs are joined along axis 1 ([batch, sequence, ...])"
            )


def _explicit_wire(config: Config, step: FlowStep, t: TensorInfo) -> Feed | None:
    for w in config.pipeline.dataflow:
        if w.to_session == step.run and w.to_input == t.name:
            if w.joined:
                width = t.shape[-1] if t.shape and isinstance(t.shape[-1], int) and t.shape[-1] > 0 else None
                return Feed(t.name, JOINED, w.from_text, t.dtype, w.sources, w.groups, w.zeros, width)
            kind = CARRIED if w.from_session == step.run else FROM_OUTPUT
            return Feed(t.name, kind, f"{w.from_session}.{w.from_output}", t.dtype)
    return None


def _check_tokenizers(config: Config, plan: Plan, problems: Problems) -> None:
    """A session's own tokenizer is for an init session of the denoising loop that reads token ids (the token
    loops' ids are one tokenizer's; single_pass batches texts through one)."""
    loop = config.generation.loop
    for name, spec in config.pipeline.sessions.items():
        if spec.tokenizer is None:
            continue
        if loop != "denoising":
            problems.add(f'sessions.{name}.tokenizer is for the "denoising" loop\'s text encoders; this '
                         f'config\'s loop is "{loop}": drop it (preprocessing.text.tokenizer names the one '
                         "tokenizer)")
            continue
        ids = spec.inputs.get("input_ids", "input_ids")
        if not any(s.session == name and any(f.kind == FROM_REQUEST and f.input == ids for f in s.feeds)
                   for s in plan.init_steps):
            problems.add(f'sessions.{name}.tokenizer names the tokenizer of its token ids, but session '
                         f'"{name}" is not an init session that takes "{ids}" from the request: drop it')


def _check_joined(config: Config, plan: Plan, problems: Problems) -> None:
    """A wire of several sources joins init sessions' outputs of the input's type, for a later phase."""
    when = {s.run: s.when for s in config.pipeline.flow}
    for s in plan.all_steps:
        for f in s.feeds:
            if f.kind != JOINED:
                continue
            wire = f"{f.source} -> {s.session}.{f.input}"
            if s.step.when == "init":
                problems.add(f"the wire {wire} joins outputs into an init session: the joined value is made "
                             "after the init phase, for step and final sessions")
            for part in f.parts:
                session, output = part.split(".", 1)
                info = plan.signatures[session].output(output) if session in plan.signatures else None
                if when.get(session) != "init":
                    problems.add(f'the wire {wire} joins "{part}", which is not an init session\'s output: '
                                 "joined wires take outputs of the init phase")
                elif info is not None and info.dtype != f.dtype:
                    problems.add(f'the wire {wire} joins {info.dtype} "{part}" into a {f.dtype} input: '
                                 "joined outputs have the input's type")


def _same_name_output(
    config: Config, step: FlowStep, flow: list[FlowStep], sigs: dict[str, Signature], t: TensorInfo
) -> Feed | None:
    """Dataflow auto-matching: another session's output of the same name (its own: carried state), of a
    session that runs before it (an init session reads no step or final session's output)."""
    phase = PHASES.index(step.when) if step.when in PHASES else len(PHASES)
    producers = [s.run for s in flow if t.name in sigs[s.run].output_names
                 and (s.run == step.run or s.when not in PHASES or PHASES.index(s.when) <= phase)]
    if not producers:
        return _cross_cache(config, step, sigs, t)
    others = [p for p in producers if p != step.run]
    source = others[0] if others else step.run
    return Feed(t.name, CARRIED if source == step.run else FROM_OUTPUT, f"{source}.{t.name}", t.dtype)


def _cross_cache(config: Config, step: FlowStep, sigs: dict[str, Signature], t: TensorInfo) -> Feed | None:
    """A cross-attention cache input, fed from the source session's present of the same name."""
    cross = config.pipeline.state.cross_cache
    if cross is None or cross.source not in sigs or "past" not in t.name:
        return None
    name = t.name.replace("past", "present", 1)
    if name not in sigs[cross.source].output_names:
        return None
    return Feed(t.name, FROM_OUTPUT, f"{cross.source}.{name}", t.dtype)


def _unfed_message(session: str, t: TensorInfo) -> str:
    return (
        f'Session "{session}" input "{t.name}" ({t.dtype} {list(t.shape)}) cannot be fed: it is not a KV '
        "cache input, not input_ids / attention_mask / position_ids, and no dataflow wire or other "
        f'session output provides it. Add a wire {{"from": "SESSION.OUTPUT", "to": "{session}.{t.name}"}} '
        "to pipeline.dataflow, or rename the role in sessions.NAME.inputs"
    )


def _position_strategy(config: Config, session: str, t: TensorInfo, problems: Problems) -> str:
    spec = config.pipeline.state.position_ids
    strategy = spec.strategy
    if strategy == "auto":
        strategy = "mrope_3d" if t.rank == 3 else "default"
    if strategy not in ("default", "mrope_3d"):
        problems.add(
            f'position_ids strategy "{strategy}" (session "{session}" input "{t.name}") is not '
            "supported by this version yet; supported: auto, default, mrope_3d"
        )
    elif strategy == "mrope_3d" and t.rank != 3:
        problems.add(
            f'position_ids strategy "mrope_3d" needs a rank-3 input [3, batch, sequence], but session '
            f'"{session}" input "{t.name}" has shape {list(t.shape)}. Use "default"'
        )
    elif strategy == "mrope_3d" and not spec.grid_source:
        problems.add(
            'position_ids strategy "mrope_3d" needs "grid_source": the "session.input" holding each '
            'image\'s (t, h, w) grid, e.g. "vision.image_grid_thw"'
        )
    return strategy


def _kv_plan(
    config: Config, session: str, sig: Signature, facts: DecoderFacts | None, problems: Problems
) -> KVPlan | None:
    spec = config.pipeline.state.kv_cache
    pairs, fmt = _match_cache(spec, sig)
    if not pairs:
        if spec.format != "auto" and any("past" in n for n in sig.input_names):
            problems.add(
                f'kv_cache format "{spec.format}" was asked for, but session "{session}" inputs '
                f"({one_of(sig.input_names)}) match none of its name patterns. Set "
                'state.kv_cache.past_key_pattern etc., or use "format": "auto"'
            )
        return None
    window = spec.sliding_window
    sites = {past: facts.for_cache(past) if facts else None for _, past, _ in pairs}
    entries = []
    for layer, past, present in pairs:
        p_info, o_info = sig.input(past), sig.output(present)
        if o_info is None:
            problems.add(
                f'Session "{session}" has cache input "{past}" but no matching output "{present}" '
                f"(outputs: {one_of(sig.output_names)}). Set state.kv_cache.present_*_pattern"
            )
            continue
        batch_axis, seq_axis = (1, 3) if fmt == "combined" else (0, 2)
        shape = _cache_shape(config, p_info, batch_axis, seq_axis, facts, problems)
        if window is not None:
            size = window.window_size if window.layers is None or layer in window.layers else None
        else:  # the graph's attention says which layers slide (GroupQueryAttention's local_window_size)
            size = getattr(sites[past], "sliding_window", None)
        frozen = ".encoder." in past  # optimum's merged graphs return it only from the no-cache branch
        entries.append(
            CacheEntry(past, present, layer, p_info.dtype, shape, batch_axis, seq_axis, size, frozen)
        )
    share = spec.share_buffer
    if share is None:  # the builder's GroupQueryAttention graphs write presents into their pasts' buffers
        share = all(site is not None and site.op.endswith("GroupQueryAttention") for site in sites.values())
    joined = sorted(past for _, past, _ in pairs if facts is not None and past in facts.concatenated)
    if share and joined:
        if config.source == "v1":
            # the builder's past_present_share_buffer speaks of its own GroupQueryAttention graph; a
            # variant exported otherwise (dtype) concatenates, and its cache grows by concatenation
            share = False
        else:
            problems.add(
                f'kv_cache "share_buffer" is true, but session "{session}" concatenates its cache: a Concat '
                f'node joins "{joined[0]}" with the new positions into a graph output, which cannot be '
                'written into the past\'s buffer. Set "share_buffer": false (or leave it out: it is detected)'
            )
    return KVPlan(fmt, share and fmt == "separate", tuple(entries))


def _match_cache(spec: KVCacheSpec, sig: Signature) -> tuple[list[tuple[int, str, str]], str]:
    """[(layer, past input, present output)] for the first pattern family that matches any input."""
    separate = [
        (spec.past_key_pattern, spec.present_key_pattern, spec.past_value_pattern, spec.present_value_pattern)
    ]
    combined = [(spec.past_pattern, spec.present_pattern)]
    families: list[tuple[str, tuple[str | None, ...]]] = []
    if spec.format in ("auto", "separate"):
        families += [("separate", p) for p in (separate if separate[0][0] else SEPARATE_PATTERNS)]
    if spec.format in ("auto", "combined"):
        families += [("combined", p) for p in (combined if combined[0][0] else COMBINED_PATTERNS)]
    for fmt, patterns in families:
        pairs = []
        for past_pat, present_pat in zip(patterns[::2], patterns[1::2], strict=True):
            if past_pat is None or present_pat is None:
                continue
            regex = re.compile(re.escape(past_pat).replace(re.escape("{layer}"), r"(\d+)") + "$")
            for name in sig.input_names:
                m = regex.match(name)
                if m:
                    pairs.append((int(m.group(1)), name, present_pat.replace("{layer}", m.group(1))))
        if pairs:
            return sorted(pairs), fmt
    return [], "separate"


def _cache_shape(
    config: Config,
    t: TensorInfo,
    batch_axis: int,
    seq_axis: int,
    facts: DecoderFacts | None,
    problems: Problems,
) -> tuple[int | None, ...]:
    """The cache's dims: fixed ones from the signature; the heads and head size it leaves symbolic
    from the graph's attention nodes (graphfacts), else from the config's metadata."""
    site = facts.for_cache(t.name) if facts else None
    found = {
        seq_axis - 1: ("num_key_value_heads", _fact(site, facts, "kv_num_heads", "num_key_value_heads")),
        seq_axis + 1: ("head_size", _fact(site, facts, "head_size", "head_size")),
    }
    shape: list[int | None] = []
    for axis, dim in enumerate(t.shape):
        if axis in (batch_axis, seq_axis):
            shape.append(None)
            continue
        key, graph = found.get(axis, (None, None))
        declared = config.metadata.get(key) if key else None
        size = dim if isinstance(dim, int) else graph if graph is not None else declared
        if isinstance(declared, int) and isinstance(size, int) and declared != size:
            problems.add(
                f'metadata.{key} is {declared}, but the graph\'s cache input "{t.name}" has {size} '
                f"there; fix or drop metadata.{key} (ortpipe reads it from the graph)"
            )
        if not isinstance(size, int):
            problems.add(
                f'Cache input "{t.name}" has a symbolic dimension {axis} ({dim!r}) that neither the '
                "graph's attention nodes nor the config size. Export the graph with fixed head counts and "
                "sizes, or set metadata.num_key_value_heads and metadata.head_size in genai_config.json"
            )
            size = 0
        shape.append(size)
    return tuple(shape)


def _fact(site: AttentionSite | None, facts: DecoderFacts | None, site_key: str, key: str) -> int | None:
    """A size the attention site that reads the cache shows, else the graph's agreed one."""
    value = getattr(site, site_key, None) if site else None
    return value if value is not None else getattr(facts, key, None) if facts else None


def _levels(steps: list[FlowStepPlan]) -> tuple[tuple[FlowStepPlan, ...], ...]:
    """Init steps grouped into levels: a step runs after every step it depends on (after or data)."""
    deps = {
        s.session: set(s.step.after) | {f.source.split(".")[0] for f in s.feeds if f.kind == FROM_OUTPUT}
        for s in steps
    }
    names = {s.session for s in steps}
    levels: list[tuple[FlowStepPlan, ...]] = []
    done: set[str] = set()
    remaining = list(steps)
    while remaining:
        ready = [s for s in remaining if (deps[s.session] & names) <= done] or remaining[:1]
        levels.append(tuple(ready))
        done |= {s.session for s in ready}
        remaining = [s for s in remaining if s not in ready]
    return tuple(levels)
