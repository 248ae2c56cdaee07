"""The one table of generation settings.

Each row names a setting once: its kind, default, allowed range, where genai_config.json keeps it
(under `generation` in v2, under `search` in onnxruntime-genai's v1), whether the command line has
a flag for it, and its help. Everything else is derived from the table: the config parser
(config/parse.py), v1 translation (config/v1.py), `SearchSettings` and the per-request checks
(sampling/settings.py), the CLI flags (cli.py) and the TypeScript declarations of the embed API
(web/ortpipe.d.ts, checked by tests/test_settings.py).

To add a setting: add a row here; the setting is then read from configs, accepted by requests on
both targets and by the CLI. Then make the code that uses it read `settings.NAME`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from ..jsonfile import quote

# Kinds of value: a Python type check and a TypeScript type.
KINDS = {
    "bool": "boolean",
    "int": "number",
    "float": "number",
    "ids": "number[]",
    "strings": "string | string[]",
    "string": "string",
    "path": "string",
    "bias": "Record<number, number>",
}

TOKEN_LOOP = ("autoregressive",)
DENOISING_LOOP = ("denoising",)


@dataclass(frozen=True)
class Setting:
    name: str  # the request option (the embed API takes it in camelCase)
    kind: str  # a key of KINDS
    default: Any
    help: str
    low: float | None = None  # the allowed range; None: unbounded
    high: float | None = None
    low_open: bool = False  # low itself is not allowed
    v2: str | None = None  # the key under `generation` in a v2 config ("sampling.top_p")
    v1: str | None = None  # the key under `search` in a v1 config; "block.key": under the top-level block
    cli: bool = True  # `ortpipe run` and `chat` have --NAME
    search: bool = True  # a field of SearchSettings (the lengths are the request's own)
    loops: tuple[str, ...] = TOKEN_LOOP  # the generation loops that read it; others refuse it

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def camel(self) -> str:
        head, *rest = self.name.split("_")
        return head + "".join(part.title() for part in rest)

    def check(self, value: Any) -> tuple[Any, str | None]:
        """(the value as the runtime takes it, None), or (None, why it is refused)."""
        kind = self.kind
        if value is None:
            return (None, None) if self.default is None else (None, "must not be null")
        if kind == "bool":
            return (
                (value, None)
                if isinstance(value, bool)
                else (None, f"must be true or false, found {quote(value)}")
            )
        if kind == "strings":
            return _strings(value)
        if kind == "string":
            return (
                (value, None) if isinstance(value, str) else (None, f"must be a string, found {quote(value)}")
            )

        if kind == "path":
            ok = isinstance(value, str) and value.strip() != "" and "\x00" not in value
            return (value, None) if ok else (None, f"must be a folder's path or URL, found {quote(value)}")
        if kind == "bias":
            return _bias(value)
        if kind == "ids":
            ok = isinstance(value, (list, tuple)) and all(_is_int(v) and v >= 0 for v in value)
            return (
                (tuple(value), None) if ok else (None, f"must be a list of token ids, found {quote(value)}")
            )
        if kind == "int" and not _is_int(value):
            return None, f"must be an integer, found {quote(value)}"
        if kind == "float":
            if not isinstance(value, (int, float)) or isinstance(value, bool):
                return None, f"must be a number, found {quote(value)}"
            if not math.isfinite(value):
                return None, f"must be a finite number, found {quote(value)}"
            value = float(value)
        return (
            (value, None)
            if self._in_range(value)
            else (None, f"{quote(value)} is out of range: {self.range_text}")
        )

    def _in_range(self, value: float) -> bool:
        if self.low is not None and (value <= self.low if self.low_open else value < self.low):
            return False
        return self.high is None or value <= self.high

    @property
    def range_text(self) -> str:
        if self.low is None and self.high is None:
            return "any value"
        low = (
            "" if self.low is None else f"{'more than' if self.low_open else 'at least'} {_number(self.low)}"
        )
        high = "" if self.high is None else f"at most {_number(self.high)}"
        return f"{low}{' and ' if low and high else ''}{high}" + (f" ({self.help})" if self.help else "")


def _number(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


MAX_BIAS = 100.0  # OpenAI's range of a logit bias


def _bias(value: Any) -> tuple[Any, str | None]:
    """A logit bias: {token id: bias}, the ids integers from 0 (or their decimal strings, as JSON keys
    are), each bias a number from -100 to 100; ((id, bias), ...) sorted by id."""
    if not isinstance(value, dict):
        return None, f"must be an object mapping token ids to biases, found {quote(value)}"
    pairs = {}
    for key, bias in value.items():
        token = int(key) if isinstance(key, str) and key.isascii() and key.isdigit() else key
        if not _is_int(token) or token < 0:
            return None, f"must map token ids (integers from 0) to biases; {quote(key)} is no token id"
        ok = isinstance(bias, (int, float)) and not isinstance(bias, bool) and math.isfinite(bias)
        if not ok or not -MAX_BIAS <= bias <= MAX_BIAS:
            return None, f"must give each token a bias from -100 to 100; token {token} has {quote(bias)}"
        if token in pairs:
            return None, f"names token {token} twice"
        pairs[token] = float(bias)
    return tuple(sorted(pairs.items())), None


def _strings(value: Any) -> tuple[Any, str | None]:
    """Stop strings: one string, or a list of non-empty strings."""
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, (list, tuple)) or not all(isinstance(s, str) and s for s in value):
        return None, f"must be a non-empty string or a list of them, found {quote(value)}"
    return tuple(value), None


# the settings that pick each codebook's token in the codebook loop (loops/codebooks.py), from the config or a
# request (a penalty or a ban per codebook is not read)
CODEBOOK_SAMPLING = ("do_sample", "temperature", "top_k", "top_p", "min_p", "seed")
MAX_BEAMS = 64  # beams multiply the batch: each holds its own KV cache
MAX_DRAFT = 32  # drafted tokens checked in one run at most
LARGE = 1e4  # the bound of settings that are otherwise unbounded: beyond it float32 kernels overflow

SETTINGS: tuple[Setting, ...] = (
    Setting("max_new_tokens", "int", None, "tokens to generate at most", low=1, search=False),
    Setting(
        "max_length",
        "int",
        None,
        "prompt and generated tokens together, at most",
        low=1,
        v2="max_length",
        v1="max_length",
        search=False,
    ),
    Setting(
        "do_sample",
        "bool",
        False,
        "sample instead of taking the most likely token",
        v2="sampling.do_sample",
        v1="do_sample",
    ),
    Setting(
        "temperature",
        "float",
        1.0,
        "0 is greedy",
        low=0.0,
        high=LARGE,
        v2="sampling.temperature",
        v1="temperature",
    ),
    Setting(
        "top_k",
        "int",
        0,
        "keep the k most likely tokens; 0 turns it off",
        low=0,
        v2="sampling.top_k",
        v1="top_k",
    ),
    Setting(
        "top_p",
        "float",
        1.0,
        "keep the most likely tokens up to this probability; 1 turns it off",
        low=0.0,
        high=1.0,
        low_open=True,
        v2="sampling.top_p",
        v1="top_p",
    ),
    Setting(
        "min_p",
        "float",
        0.0,
        "drop tokens less likely than this times the most likely; 0 turns it off",
        low=0.0,
        high=1.0,
        v2="sampling.min_p",
    ),
    Setting(
        "repetition_penalty",
        "float",
        1.0,
        "divide the scores of tokens seen so far; 1 turns it off",
        low=0.0,
        high=LARGE,
        low_open=True,
        v2="sampling.repetition_penalty",
        v1="repetition_penalty",
    ),
    Setting(
        "frequency_penalty",
        "float",
        0.0,
        "subtract this times the number of times a token was generated so far from its score (OpenAI's "
        "frequency_penalty; the prompt is not counted); 0 turns it off",
        low=-2.0,
        high=2.0,
    ),
    Setting(
        "presence_penalty",
        "float",
        0.0,
        "subtract this from the score of every token generated so far (OpenAI's presence_penalty; the "
        "prompt is not counted); 0 turns it off",
        low=-2.0,
        high=2.0,
    ),
    Setting(
        "logit_bias",
        "bias",
        None,
        "add a bias to the scores of token ids, {id: bias} with each bias from -100 to 100 (OpenAI's "
        "logit_bias: -100 bans a token, 100 all but forces it)",
    ),
    Setting(
        "seed",
        "int",
        None,
        "the seed of the sampler and of the initial noise: the same seed gives the "
        "same tokens or image on every target",
        v2="sampling.seed",
        v1="random_seed",
        loops=TOKEN_LOOP + DENOISING_LOOP,
    ),
    Setting(
        "no_repeat_ngram_size",
        "int",
        0,
        "never repeat an n-gram of this size; 0 turns it off",
        low=0,
        v2="no_repeat_ngram_size",
        v1="no_repeat_ngram_size",
    ),
    Setting(
        "min_length",
        "int",
        0,
        "no eos before prompt and generated tokens reach this length",
        low=0,
        v2="min_length",
        v1="min_length",
    ),
    Setting(
        "min_new_tokens",
        "int",
        0,
        "no eos before this many tokens were generated",
        low=0,
        v2="min_new_tokens",
    ),
    Setting("suppress_tokens", "ids", (), "token ids never generated", v2="suppress_tokens"),
    Setting("begin_suppress_tokens", "ids", (), "token ids not generated first (the first token after the "
            "prompt)", v2="begin_suppress_tokens"),
    Setting("forced_bos_token_id", "int", None, "the first generated token is this id (BART's and mBART's, "
            "whose target language it names)", low=0, v2="forced_bos_token_id"),
    Setting("forced_eos_token_id", "int", None, "the token at the last position the length limit allows is "
            "this id (an end of sequence there, as BART's and Marian's searches end)", low=0,
            v2="forced_eos_token_id"),
    Setting(
        "stop",
        "strings",
        (),
        "generation ends before any of these strings, which are not returned",
        v2="stop",
    ),
    Setting(
        "num_beams",
        "int",
        1,
        "beam search with this many beams; 1 turns it off",
        low=1,
        high=MAX_BEAMS,
        v2="num_beams",
        v1="num_beams",
    ),
    Setting(
        "length_penalty",
        "float",
        1.0,
        "beam scores are divided by length to this power",
        low=-LARGE,
        high=LARGE,
        v2="length_penalty",
        v1="length_penalty",
    ),
    Setting(
        "early_stopping",
        "bool",
        False,
        "beam search ends once num_beams hypotheses are finished",
        v2="early_stopping",
        v1="early_stopping",
    ),
    Setting(
        "renormalize_logits",
        "bool",
        False,
        "beam search: each beam's scores are log-softmaxed again after its bans (transformers' "
        "renormalize_logits; greedy and sampled selections are the same either way)",
        v2="renormalize_logits",
    ),
    Setting(
        "num_return_sequences",
        "int",
        1,
        "hypotheses returned by beam search (result.sequences)",
        low=1,
        high=MAX_BEAMS,
        v2="num_return_sequences",
        v1="num_return_sequences",
    ),
    Setting(
        "logprobs",
        "int",
        None,
        "give each generated token's log-probability and this many most likely "
        "alternatives (chunk.logprob, chunk.top_logprobs)",
        low=0,
        high=20,
    ),
    Setting(
        "num_steps", "int", 50, "denoising steps", low=1, high=1000, v2="num_steps", loops=DENOISING_LOOP
    ),
    Setting(
        "guidance_scale",
        "float",
        7.5,
        "classifier-free guidance: above 1 runs a conditional and an unconditional row",
        low=0.0,
        high=LARGE,
        v2="guidance_scale",
        loops=DENOISING_LOOP,
    ),
    Setting(
        "guidance_rescale",
        "float",
        0.0,
        "with guidance: mix in the guided prediction rescaled to the conditional one's standard deviation "
        "(diffusers' guidance_rescale, for zero terminal SNR models; 0 keeps it as it is)",
        low=0.0,
        high=1.0,
        v2="guidance_rescale",
        loops=DENOISING_LOOP,
    ),
    Setting(
        "eta",
        "float",
        0.0,
        "the noise DDIMScheduler's and TCDScheduler's steps add, 0 (none) to 1 (diffusers' eta: DDIM's share "
        "of each step's variance, TCD's gamma; other schedulers refuse it)",
        low=0.0,
        high=1.0,
        v2="eta",
        loops=DENOISING_LOOP,
    ),
    Setting(
        "negative_prompt",
        "string",
        None,
        "what the image should not show (the unconditional row's text)",
        v2="negative_prompt",
        loops=DENOISING_LOOP,
    ),
    Setting(
        "strength",
        "float",
        0.8,
        "image-to-image: how far the image is noised, 0 to 1 (the last int(num_steps * strength) steps run; "
        "1 keeps nothing of it)",
        low=0.0,
        low_open=True,
        high=1.0,
        v2="strength",
        loops=DENOISING_LOOP,
    ),
    Setting(
        "force_zeros_for_empty_prompt",
        "bool",
        False,
        "with guidance and no negative prompt: the unconditional row's text states are zeros, the text "
        "encoders run on the prompt alone (diffusers' Stable Diffusion XL folders say so in "
        "model_index.json)",
        v2="force_zeros_for_empty_prompt",
        loops=DENOISING_LOOP,
    ),
    # speculative decoding (loops/speculative.py): onnxruntime-genai's `speculative` block, and transformers'
    # prompt_lookup_num_tokens
    Setting(
        "prompt_lookup_num_tokens",
        "int",
        0,
        "speculative decoding with drafts looked up in the prompt "
        "and the text so far, at most this many tokens a step (transformers' name); 0 turns it off",
        low=0,
        high=MAX_DRAFT,
        v2="prompt_lookup_num_tokens",
    ),
    Setting(
        "ngram_size",
        "int",
        0,
        "speculative decoding with drafts that continue an earlier occurrence of "
        "the last this-many tokens (onnxruntime-genai's speculative.ngram_size); 0 turns it off",
        low=0,
        high=16,
        v2="speculative.ngram_size",
        v1="speculative.ngram_size",
    ),
    Setting(
        "max_draft_tokens",
        "int",
        4,
        "drafted tokens checked in one run at most (speculative decoding; the draft length adapts below it)",
        low=1,
        high=MAX_DRAFT,
        v2="speculative.max_draft_tokens",
        v1="speculative.max_draft_tokens",
    ),
    Setting(
        "draft_model",
        "path",
        None,
        "speculative decoding with drafts from this smaller model folder (a "
        "path; in the browser a URL; in a config a folder inside the model folder), which must have the "
        "model's tokenizer",
        v2="speculative.draft_model",
    ),
)

BY_NAME = {s.name: s for s in SETTINGS}
SEARCH = tuple(s for s in SETTINGS if s.search)
# v1 `search` keys that are not generation settings: what onnxruntime-genai reads there besides.
V1_OTHER_SEARCH_KEYS = ("past_present_share_buffer", "diversity_penalty", "batch_size")


class _Derived:
    """What follows from the settings; `SearchSettings` below adds the table's fields."""

    do_sample: bool
    temperature: float
    repetition_penalty: float
    frequency_penalty: float
    presence_penalty: float
    logit_bias: tuple[tuple[int, float], ...] | None
    suppress_tokens: tuple[int, ...]
    begin_suppress_tokens: tuple[int, ...]
    forced_bos_token_id: int | None
    renormalize_logits: bool
    forced_eos_token_id: int | None
    no_repeat_ngram_size: int
    min_length: int
    min_new_tokens: int
    prompt_lookup_num_tokens: int
    ngram_size: int
    draft_model: str | None
    logprobs: int | None

    @property
    def sampling(self) -> bool:
        return self.do_sample and self.temperature > 0

    @property
    def argmax_only(self) -> bool:
        """Token selection is the argmax of the scores, which no penalty changes."""
        return (not self.sampling and self.repetition_penalty == 1.0 and not self.counts_tokens
                and not self.logit_bias)

    @property
    def counts_tokens(self) -> bool:
        """The frequency or presence penalty lowers the scores of the tokens generated so far."""
        return bool(self.frequency_penalty or self.presence_penalty)

    @property
    def speculative(self) -> bool:
        """Drafted tokens are checked in one run (loops/speculative.py)."""
        return bool(self.prompt_lookup_num_tokens or self.ngram_size or self.draft_model)

    @property
    def plain_greedy(self) -> bool:
        """The argmax of the raw logits at every step: no penalty and no ban could change it."""
        return (
            self.argmax_only
            and not self.suppress_tokens
            and not self.begin_suppress_tokens
            and self.forced_bos_token_id is None
            and self.forced_eos_token_id is None
            and not self.no_repeat_ngram_size
            and not self.min_length
            and not self.min_new_tokens
            and self.logprobs is None  # they are read from the logits, which a fused step keeps to itself
        )


SearchSettings = dataclasses.make_dataclass(
    "SearchSettings",
    [(s.name, Any, dataclasses.field(default=s.default)) for s in SEARCH],
    bases=(_Derived,),
    frozen=True,
)
SearchSettings.__module__ = __name__
SearchSettings.__doc__ = "A request's generation settings (see config/settings.py for each field)."


def by_v2(section: str = "") -> Iterator[tuple[str, Setting]]:
    """(key, setting) for the settings kept directly under `generation` (section "") or under
    `generation.SECTION`."""
    for s in SETTINGS:
        if s.v2 is not None and s.v2.rpartition(".")[0] == section:
            yield s.v2.rpartition(".")[2], s


def typescript_options() -> str:
    """The generation settings of the embed API's GenerateOptions, as web/ortpipe.d.ts declares them."""
    lines = []
    for s in SETTINGS:
        lines.append(f"  /** {s.help[0].upper()}{s.help[1:]}. */")
        lines.append(f"  {s.camel}?: {KINDS[s.kind]};")
    return "\n".join(lines)
