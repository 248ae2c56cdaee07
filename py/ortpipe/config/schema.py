"""The v2 pipeline schema as frozen dataclasses.

Key names follow the pipeline-as-config proposal (seed 000, sections 3.2 to 3.10). A Config is
built and validated once by `config.parse`; the rest of the runtime trusts it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .settings import SearchSettings

WHEN = ("init", "step", "final")
WHEN_ALIASES = {"once": "init", "prompt": "init", "always": "step"}
LOOP_MODES = ("batched", "per_image")
KV_FORMATS = ("auto", "separate", "combined")
POSITION_STRATEGIES = ("auto", "default", "mrope_3d", "windowed")
GENERATION_LOOPS = ("autoregressive", "single_pass", "denoising")
# What a named output is (pipeline.output[].as): a plain tensor, mono audio [batch, samples], an image from a
# VAE ([batch, 3, height, width] in [-1, 1]), or token states pooled into one embedding per text.
OUTPUT_KINDS = ("tensor", "audio", "image", "embedding")
POOLING_MODES = ("mean", "cls", "max", "lasttoken")
MAX_FLOW_STEPS = 10


@dataclass(frozen=True)
class SessionSpec:
    name: str
    file: str
    # provider keys (config/ep.py), tried in order: the first that is installed and compiles the graph wins
    providers: tuple[str, ...] = ("cpu",)
    provider_options: dict[str, dict[str, str]] = field(default_factory=dict)  # provider key -> options
    # onnxruntime-genai's session options (config/ep.py's table), a provider's own under its key
    session_options: dict[str, Any] = field(default_factory=dict)
    optional: bool = False
    inputs: dict[str, str] = field(default_factory=dict)  # role -> graph input name
    outputs: dict[str, str] = field(default_factory=dict)  # role -> graph output name
    dtype: str | None = None  # the model variant to run (variants.py); None: the device's default
    # the folder of the tokenizer whose ids this session's text inputs take (the loops that make no tokens);
    # None: preprocessing.text.tokenizer's
    tokenizer: str | None = None
    max_length: int | None = None  # with its own tokenizer: its rows truncated and padded to this many ids


@dataclass(frozen=True)
class DynamicShape:
    source: str
    apply_to_dims: tuple[int, ...]


@dataclass(frozen=True)
class FlowStep:
    run: str
    when: str
    loop: str = "batched"
    loop_over: str | None = None
    dynamic_shape: DynamicShape | None = None
    repeat: int = 1
    counter: str | None = None
    optional: bool = False
    after: tuple[str, ...] = ()
    cross_attention_from: str | None = None  # the session whose cross cache this step reads
    # outputs kept over the whole loop, joined along the sequence axis (1): the prefill's rows, then each
    # decode step's; read by final steps and later stages (an autoregressive loop's step sessions only)
    accumulate: tuple[str, ...] = ()


@dataclass(frozen=True)
class Wire:
    from_session: str
    from_output: str
    to_session: str
    to_input: str
    # between stages: the consumer's run over positions [p, p + n) takes rows [p, p + n) of an accumulated
    # output as they are made (zeros past its end once its stage is done)
    stream: bool = False
    # more sources after the first ("session.output" each): the wire carries all of them joined along the
    # last axis, in order (two text encoders' states side by side)
    more: tuple[str, ...] = ()
    # with groups, the sizes of consecutive runs of the sources: each run joined along the last axis, the
    # runs then joined along axis 1 (the sequence), each zero-padded on its last axis to the input's width
    # (its static last dimension, else the widest)
    groups: tuple[int, ...] = ()
    # per group, the rows of zeros it stands for ({"zeros": N}: a text encoder left out, as diffusers'
    # StableDiffusion3Pipeline without T5); 0 for a group of sources. Empty: no such group.
    zeros: tuple[int, ...] = ()

    def __str__(self) -> str:
        return f"{self.from_text} -> {self.to_session}.{self.to_input}"

    @property
    def from_text(self) -> str:
        """What the wire carries, as one name: its sources (and its zeros' rows) in order."""
        if not self.zeros:
            return " + ".join(self.sources)
        sources, out = iter(self.sources), []
        for size, rows in zip(self.groups, self.zeros, strict=True):
            out += [f"zeros({rows})"] if rows else [next(sources) for _ in range(size)]
        return " + ".join(out)

    @property
    def source(self) -> str:
        return f"{self.from_session}.{self.from_output}"

    @property
    def sources(self) -> tuple[str, ...]:
        return (self.source, *self.more)

    @property
    def joined(self) -> bool:
        """Whether the wire joins several values (sources, or sources and zeros)."""
        return bool(self.more or self.groups)


@dataclass(frozen=True)
class SlidingWindow:
    window_size: int
    layers: tuple[int, ...] | None = None  # None: every layer


@dataclass(frozen=True)
class KVCacheSpec:
    format: str = "auto"
    past_key_pattern: str | None = None
    present_key_pattern: str | None = None
    past_value_pattern: str | None = None
    present_value_pattern: str | None = None
    past_pattern: str | None = None  # combined format: key and value stacked in one tensor
    present_pattern: str | None = None
    # past and present are one buffer sized to max_length, updated in place; None: as the graph's
    # attention nodes say (GroupQueryAttention, the model builder's, writes in place)
    share_buffer: bool | None = None

    sliding_window: SlidingWindow | None = None


@dataclass(frozen=True)
class PositionIdsSpec:
    strategy: str = "auto"
    input_name: str = "position_ids"
    grid_source: str | None = None  # "session.input" holding each image's (t, h, w) grid, for mrope_3d
    spatial_merge_size: int = 2  # mrope_3d: patches merged per side into one token


@dataclass(frozen=True)
class CrossCacheSpec:
    source: str
    frozen: bool = True


@dataclass(frozen=True)
class StateSpec:
    kv_cache: KVCacheSpec = field(default_factory=KVCacheSpec)
    position_ids: PositionIdsSpec = field(default_factory=PositionIdsSpec)
    cross_cache: CrossCacheSpec | None = None


@dataclass(frozen=True)
class OutputSpec:
    """A tensor a request returns (pipeline.output): `name` of session `session`, and what it is."""

    session: str
    name: str
    kind: str = "tensor"  # one of OUTPUT_KINDS
    sampling_rate: int | None = None  # audio
    pooling: str | None = None  # embedding: one of POOLING_MODES
    normalize: bool = False  # embedding: divided by its L2 norm

    @property
    def source(self) -> str:
        return f"{self.session}.{self.name}"


@dataclass(frozen=True)
class PipelineSpec:
    sessions: dict[str, SessionSpec]
    flow: tuple[FlowStep, ...]
    dataflow: tuple[Wire, ...] = ()
    state: StateSpec = field(default_factory=StateSpec)
    preprocessing: dict[str, Any] = field(default_factory=dict)
    plugin: dict[str, Any] | None = None
    extends: str | None = None
    outputs: tuple[OutputSpec, ...] = ()  # pipeline.output, in the config's order
    stages: tuple[Stage, ...] = ()  # pipeline.stages, in run order; then flow is empty
    # a stage's own config: the wires from earlier stages into its sessions (fed as request inputs, or
    # streamed rows)
    stage_inputs: tuple[Wire, ...] = ()
    exported: tuple[str, ...] = ()  # "session.output" of init steps that later stages read: kept


# The generated ids of a stage's generator session, as a dataflow source: "SESSION.tokens" (int64 [1, n],
# a final eos left out).
TOKENS_OUTPUT = "tokens"


@dataclass(frozen=True)
class Stage:
    """One stage of a multi-stage pipeline (pipeline.stages.NAME): its own sessions, flow, loop and tokens,
    as a config of its own."""

    name: str
    config: Config

    @property
    def sessions(self) -> tuple[str, ...]:
        return tuple(self.config.pipeline.sessions)


@dataclass(frozen=True)
class Tokens:
    eos: tuple[int, ...] = ()
    pad: int | None = None
    bos: int | None = None
    image_token: int | None = None
    audio_token: int | None = None
    # the ids an encoder-decoder's decoder starts from (`tokens.decoder_start`: one id, or a list): its start
    # token, then those generation_config.json forces after it (Whisper's language, task, timestamp tokens);
    # None: the language's place, filled by a request's `language` or else by the model (`languages`' id it
    # makes most likely after the ids before it)
    decoder_prompt: tuple[int | None, ...] = ()
    # (code, id): the language ids a request's `language` names (generation_config.json's lang_to_id)
    languages: tuple[tuple[str, int], ...] = ()
    # (name, id): the task ids a request's `task` names (generation_config.json's task_to_id)
    tasks: tuple[tuple[str, int], ...] = ()

    @property
    def decoder_start(self) -> int | None:
        return self.decoder_prompt[0] if self.decoder_prompt else None


GENERATED = "generated"  # the dataflow source of the generated ids: "generated.ids" (not a session name)


@dataclass(frozen=True)
class Codebooks:
    """generation.codebooks: a step whose logits hold `count` codebooks ([batch * count, seq, vocab]), one
    token of each per step, codebook k delayed by `delay[k]` steps (MusicGen's pattern: k), the delay's slots
    filled with tokens.pad; `guidance_scale` above 1 runs an unconditional row beside each conditional one."""

    count: int
    delay: tuple[int, ...]
    guidance_scale: float = 1.0


@dataclass(frozen=True)
class Generation:
    loop: str = "autoregressive"
    max_length: int | None = None
    settings: SearchSettings = field(default_factory=SearchSettings)  # the request defaults (settings.py)
    scheduler: str | None = None  # denoising: a scheduler class (loops/schedulers.py); None: the folder's
    codebooks: Codebooks | None = None  # autoregressive: several token streams per step


@dataclass(frozen=True)
class Config:
    pipeline: PipelineSpec
    tokens: Tokens = field(default_factory=Tokens)
    generation: Generation = field(default_factory=Generation)
    metadata: dict[str, Any] = field(default_factory=dict)
    source: str = "v2"  # where it came from: "v2", "v1" (translated) or "detected"
    version: int = 2
    notes: tuple[str, ...] = ()  # warnings for the user (a v1 key ortpipe does not know, ...)

    def session_of(self, step: FlowStep) -> SessionSpec:
        return self.pipeline.sessions[step.run]
