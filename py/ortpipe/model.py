"""A loaded model, whatever the target: loading a folder, and turning what a caller asks into requests.

This is the part of a target that is the same everywhere (micropip's _compat is the model): a
target supplies a `Platform` (tensors, a tokenizer, a chat-template compiler) and a driver that
carries out work items; `load_model` and `Model` do the rest, so both targets behave the same by
construction. The public APIs (targets/cpython.py's Pipeline, the browser worker) are thin.
"""

from __future__ import annotations

import dataclasses
import json
import posixpath
import time
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple, Protocol

from .chat import Chat
from .config import Config, load_config
from .config.profiles import Profile
from .config.schema import TOKENS_OUTPUT
from .detect import detect_config, encoder_embeddings
from .errors import ONE_PROMPT, ConfigError, GenerationError, OrtpipeError
from .execute.work import Backend, Handle, Open, Opened, ReadGraph, ReadWheel, Work
from .folder import Folder
from .graphfacts import decoder_facts
from .jsonfile import quote, read_json
from .loops.autoregressive import Limits, TokenGenerator, check_ids
from .loops.beam import BeamSearch
from .loops.setup import LoopSetup, embed_request, loop_setup, output_request
from .loops.single_pass import DEFAULT_BATCH
from .loops.speculative import cannot_verify
from .loops.stages import StagedModel
from .onnxinfo import Model as OnnxModel
from .onnxinfo import read_model
from .outputs import OutputRequest
from .plan import ENCODER_MASK, FROM_REQUEST, Plan, make_plan
from .plugins import Context, Factory, load_factory, unread_settings
from .preprocess import AudioConfig, load_audio_config
from .preprocess.request import Image, check_media, media_inputs
from .request import BeamRequest, PluginRequest, Request
from .sampling.sampler import named_ids
from .sampling.settings import SearchSettings, check_setting, settings_for, warn_unreachable_minimums
from .templates import ChatTemplate, Compiler, load_chat_template, media_parts, missing_template
from .tokenizer import Tokenizer, encode
from .variants import OPTIMIZED_FOR, check_dtype, choose, present
from .vocab_tokenizers import load_vits_tokenizer, load_vocab_tokenizer

TOKENIZER_FILE = "tokenizer.json"
DEFAULT_MAX_NEW_TOKENS = 256
MASK_REFUSED = "a mask is inpainting's: it goes with an image to a denoising folder"


class Platform(Protocol):
    """What a target supplies besides its driver."""

    name: str  # "cpython" or "pyodide", for messages
    backend: Backend

    def tokenizer(self, tokenizer_json: str, tokenizer_config: str | None) -> Tokenizer: ...

    @property
    def compile_template(self) -> Compiler: ...

    def folder(self, location: str) -> Folder:
        """The model folder a caller names (a draft model): a local path, or a URL in the browser."""
        ...


Progress = Callable[[str], None]


def load_model(
    folder: Folder,
    platform: Platform,
    profile: str | Profile | None = None,
    allow_plugins: bool = False,
    prefix: str = "",
    dtype: str | dict[str, str] | None = None,
    device: str | Mapping[str | None, str] | None = None,
    f16: bool = True,
    config: Config | None = None,
) -> Work:
    """Load a model folder (genai_config.json v1 or v2, or a detected export): the config, one
    `Open` per session the flow runs (every session, for a plugin's loop), the plan, the tokenizer
    and the chat template. `profile`: a device profile layered over the config's sessions
    (config/profiles.py); `allow_plugins`: run the config's plugin, if it has one (plugins.py).
    `prefix` goes before every session name (a draft model's sessions beside the model's). Returns
    (Model, {session name: the target's session}).

    Each session runs the variant of its graph (variants.py) that `dtype` names (one for all, or
    per session), else its config's "dtype", else the first of `device`'s defaults the folder has
    (`device`: the target's, or None for each session's first execution provider; `f16`: whether
    the device runs float16 graphs). `config`: the config to run instead of the folder's (a stage's).

    A config of pipeline.stages loads each stage as a model of its own: a StagedModel (loops/stages.py)."""
    start = time.perf_counter()
    config = config or load_config(folder, profile=profile)
    if config.pipeline.stages:
        return (yield from _load_stages(config, folder, platform, profile, allow_plugins, dtype, device, f16))
    config = with_variants(config, folder, check_dtype(dtype), device, f16)
    if prefix:
        config = _prefixed(config, prefix)
    plugin = config.pipeline.plugin
    factory = None
    if plugin:
        wheel = plugin.get("wheel")
        local = (
            (yield ReadWheel(folder.locate(wheel), folder.describe(wheel)))
            if wheel and allow_plugins
            else None
        )
        factory = load_factory(plugin, allow_plugins, local)
        configured = [
            f.name for f in dataclasses.fields(SearchSettings)
            if getattr(config.generation.settings, f.name) != f.default
        ]
        unread = unread_settings(factory, configured)
        if unread:
            raise ConfigError(
                f"generation sets {', '.join(unread)}, which the plugin's loop does not read: drop them "
                f"from the config (the plugin's factory lists what it reads in its `settings`)"
            )

    used = set(config.pipeline.sessions) if plugin else {s.run for s in config.pipeline.flow}
    wanted = [s for n, s in config.pipeline.sessions.items() if n in used and folder.exists(s.file)]
    sessions, signatures, facts = {}, {}, {}
    for spec in wanted:
        path, shown = folder.locate(spec.file), folder.describe(spec.file)
        graph = read_model((yield ReadGraph(path, shown)), shown)
        check_external_data(folder, spec.file, graph)  # before onnxruntime opens what it names
        if config.source == "detected" and not prefix and spec.name == "decoder":
            names = ([v.name for v in graph.graph.outputs], [v.name for v in graph.graph.inputs])
            if "encoder_hidden_states" in names[1] and set(config.pipeline.sessions) == {"decoder"}:
                raise ConfigError(
                    f"{shown} reads an encoder's states (encoder_hidden_states), and {folder.describe()} has "
                    "no encoder_model.onnx beside it: an encoder-decoder export holds both (optimum writes "
                    "encoder_model.onnx and decoder_model_merged.onnx); add the encoder's graph"
                )
            raw = encoder_embeddings(detect_config(folder), *names)
            if raw is not None:  # the graph is an encoder: the folder's detected config is the embeddings'
                config = load_config(folder, warn=False, profile=profile, detected=raw)
                config = with_variants(config, folder, check_dtype(dtype), device, f16)
                spec = config.pipeline.sessions["encoder"]
        opened: Opened = yield Open(spec, path, shown, graph.metadata.get(OPTIMIZED_FOR))
        sessions[spec.name], signatures[spec.name] = opened.session, opened.signature
        facts[spec.name] = decoder_facts(graph)
    plan = make_plan(config, signatures, facts)
    text = config.pipeline.preprocessing.get("text", {})
    tokenizer = load_tokenizer(folder, platform, text.get("tokenizer", ""))
    template = load_chat_template(folder, platform.compile_template)
    model = Model(folder, plan, platform.backend, tokenizer, template)
    model.plugin = factory
    own = {name: load_tokenizer(folder, platform, spec.tokenizer)
           for name, spec in config.pipeline.sessions.items() if spec.tokenizer is not None}
    model.loop = loop_setup(plan, folder, tokenizer, own)
    model.platform, model.profile, model.device = platform, profile, (device, f16)
    why = cannot_verify(plan) if config.generation.settings.speculative else None
    if why:
        raise ConfigError(f"the config asks for speculative decoding, which this model cannot run: {why}")
    if config.generation.settings.draft_model is not None:  # the config's draft model is part of the model
        try:
            yield from model.prepare({})
        except GenerationError as e:
            raise ConfigError(f"generation.speculative.draft_model: {e}") from None
    model.load_ms = (time.perf_counter() - start) * 1000
    return model, sessions


def _load_stages(config: Config, folder: Folder, platform: Platform, profile: Any, allow_plugins: bool,
                 dtype: Any, device: Any, f16: bool) -> Work:
    start = time.perf_counter()
    models, sessions = {}, {}
    for stage in config.pipeline.stages:
        mine = {k: v for k, v in dtype.items() if k in stage.sessions} if isinstance(dtype, dict) else dtype
        model, opened = yield from load_model(folder, platform, profile, allow_plugins, dtype=mine,
                                              device=device, f16=f16, config=stage.config)
        models[stage.name] = model
        sessions.update(opened)
    check_stage_wires(config, {n: m.plan for n, m in models.items()})
    staged = StagedModel(config, models)
    staged.load_ms = (time.perf_counter() - start) * 1000
    return staged, sessions


def check_stage_wires(config: Config, plans: dict[str, Plan]) -> None:
    """The wires between stages name outputs and inputs the graphs have ("SESSION.tokens": the ids of a
    stage's generator); a later autoregressive stage starts from its tokens.decoder_start."""
    problems = []
    signatures = {n: sig for plan in plans.values() for n, sig in plan.signatures.items()}
    for stage in config.pipeline.stages[1:]:
        if stage.config.generation.loop == "autoregressive" and stage.config.tokens.decoder_start is None:
            problems.append(f'pipeline.stages.{stage.name}: a later autoregressive stage starts from '
                            '[tokens.decoder_start]: set it in its "tokens"')
    for w in (w for stage in config.pipeline.stages for w in stage.config.pipeline.stage_inputs):
        src = signatures.get(w.from_session)
        if src is None:
            continue
        producer = next(s for s in config.pipeline.stages if w.from_session in s.sessions)
        generator = plans[producer.name].generator
        if w.from_output == TOKENS_OUTPUT and (generator is None or generator.session != w.from_session):
            problems.append(f'pipeline.dataflow: {w} reads the ids of "{w.from_session}", which is not the '
                            f'session whose logits stage "{producer.name}" generates from')
        elif w.from_output != TOKENS_OUTPUT and w.from_output not in src.output_names:
            problems.append(f'pipeline.dataflow: {w}: session "{w.from_session}" has no output '
                            f'"{w.from_output}" (outputs: {", ".join(src.output_names)})')
    if problems:
        raise ConfigError(problems)


def with_variants(
    config: Any,
    folder: Folder,
    dtype: str | dict[str, str] | None,
    device: str | Mapping[str | None, str] | None,
    f16: bool = True,
) -> Any:
    """`config` with each session's file replaced by the variant it runs. `device`: one for every
    session, or {session name: device} (the key None: every other session)."""
    sessions = {}
    for name, spec in config.pipeline.sessions.items():
        wanted = dtype.get(name, spec.dtype) if isinstance(dtype, dict) else dtype or spec.dtype
        where = device.get(name, device.get(None)) if isinstance(device, Mapping) else device
        if present(folder, spec.file):
            file = choose(folder, spec.file, where or spec.providers[0], wanted, name, f16)

            spec = dataclasses.replace(spec, file=file)
        sessions[name] = spec
    if isinstance(dtype, dict) and set(dtype) - set(sessions):
        unknown = ", ".join(sorted(set(dtype) - set(sessions)))
        raise ConfigError(f"dtype names sessions this model does not have: {unknown} (its sessions: "
                          f"{', '.join(sessions)})")
    return dataclasses.replace(config, pipeline=dataclasses.replace(config.pipeline, sessions=sessions))


def _prefixed(config: Config, prefix: str) -> Config:
    """The config with `prefix` before every session name, wherever one is named."""
    p = config.pipeline

    def name(session: str | None) -> str | None:
        return None if session is None else prefix + session

    def dotted(ref: str | None) -> str | None:
        return None if ref is None else prefix + ref

    sessions = {prefix + n: dataclasses.replace(s, name=prefix + s.name) for n, s in p.sessions.items()}
    flow = tuple(dataclasses.replace(s, run=prefix + s.run, after=tuple(prefix + a for a in s.after),
                                     cross_attention_from=name(s.cross_attention_from)) for s in p.flow)
    wires = tuple(dataclasses.replace(w, from_session=prefix + w.from_session,
                                      to_session=prefix + w.to_session) for w in p.dataflow)
    state = p.state
    if state.cross_cache is not None:
        state = dataclasses.replace(state, cross_cache=dataclasses.replace(
            state.cross_cache, source=prefix + state.cross_cache.source))
    positions = dataclasses.replace(state.position_ids, grid_source=dotted(state.position_ids.grid_source))
    state = dataclasses.replace(state, position_ids=positions)
    outputs = tuple(dataclasses.replace(o, session=prefix + o.session) for o in p.outputs)
    pipeline = dataclasses.replace(
        p, sessions=sessions, flow=flow, dataflow=wires, state=state, outputs=outputs
    )


    return dataclasses.replace(config, pipeline=pipeline)


def same_vocabulary(a: Folder, b: Folder) -> str | None:
    """Why the tokenizers of two folders may give different ids to the same token, or None: their
    tokenizer.json must map the same tokens to the same ids (vocabulary and added tokens)."""
    for folder in (a, b):
        if not folder.exists(TOKENIZER_FILE):
            return f"{folder.describe()} has no {TOKENIZER_FILE} to compare"

    def ids(folder: Folder) -> tuple[Any, Any]:
        raw = read_json(folder, TOKENIZER_FILE)
        model = raw.get("model") if isinstance(raw.get("model"), Mapping) else {}
        added = raw.get("added_tokens") if isinstance(raw.get("added_tokens"), list) else []
        pairs = sorted((t.get("id"), t.get("content")) for t in added if isinstance(t, Mapping))
        return model.get("vocab"), pairs

    (vocab_a, added_a), (vocab_b, added_b) = ids(a), ids(b)
    if vocab_a != vocab_b:
        return "their tokenizer.json vocabularies differ"
    if added_a != added_b:
        return "their tokenizer.json added tokens differ"
    return None


def check_external_data(folder: Folder, file: str, graph: OnnxModel) -> None:
    """Every external data file the graph names must lie inside the folder (links followed)."""
    base = posixpath.dirname(file)
    for location in sorted({t.location for t in graph.graph.initializers if t.external and t.location}):
        try:
            folder.locate(posixpath.normpath(posixpath.join(base, location)))
        except ConfigError as e:
            raise ConfigError(
                f"{folder.describe(file)} keeps weights in {location!r}, which ortpipe does not open: {e}"
            ) from None


def load_tokenizer(folder: Folder, platform: Platform, where: str = "") -> Tokenizer | None:
    """The tokenizer in `where` (a folder inside the model folder; preprocessing.text.tokenizer): a VITS
    tokenizer (transformers' rule, run by the core, tokenizer.json or not), else its tokenizer.json, else
    the vocabulary of a CLIP or VITS tokenizer (vocab_tokenizers.py), else None."""
    prefix = f"{where}/" if where else ""
    vits = load_vits_tokenizer(folder, where)
    if vits is not None:
        return vits
    if not folder.exists(prefix + TOKENIZER_FILE):
        return load_vocab_tokenizer(folder, where)
    text = folder.read_text(prefix + TOKENIZER_FILE)
    config_file = prefix + "tokenizer_config.json"
    config = folder.read_text(config_file) if folder.exists(config_file) else None
    try:
        return platform.tokenizer(text, config)
    except Exception as e:  # the tokenizer library's own errors, whatever their type
        raise ConfigError(
            f"{folder.describe(prefix + TOKENIZER_FILE)} cannot be read as a tokenizer: {str(e)[:300]}"
        ) from None


class Model:
    """A loaded model: its config, plan and tokenizer; makes requests and chats."""

    def __init__(
        self,
        folder: Folder,
        plan: Plan,
        backend: Backend,
        tokenizer: Tokenizer | None,
        template: ChatTemplate | None,
    ):
        self.folder, self.plan, self.backend = folder, plan, backend
        self.config = plan.config
        self.tokenizer, self.template = tokenizer, template
        self.load_ms = 0.0
        self.vocab = plan.vocab_size
        _check_start_ids(folder, self.config, self.vocab)
        self.plugin: Factory | None = None
        self.loop: LoopSetup | None = None  # what a single_pass or denoising loop reads from the folder
        self.platform: Platform | None = None  # set by load_model: draft models load through it, with
        self.profile: str | Profile | None = None  # the model's device profile
        self.device: tuple[Any, bool] = (None, True)  # load_model's device and f16: a draft's variants
        self.drafts: dict[str, Model] = {}  # draft models by location, loaded once

    # requests

    def check_media(self, images: bool, audios: bool, mask: bool = False) -> None:
        """Refuse images, audio or a mask this folder does not read, before the target decodes any (a path
        is then never opened); a folder with a loop of its own or a plugin refuses the rest in `request`."""
        if mask and (self.loop is None or self.loop.denoising is None):
            raise GenerationError(MASK_REFUSED)
        if self.loop is None and self.plugin is None:
            check_media(self.plan, images, audios)

    def request(
        self,
        prompt: str | None = None,
        *,
        prompt_ids: list[int] | None = None,
        messages: list[dict[str, str]] | None = None,
        max_new_tokens: int | None = None,
        max_length: int | None = None,
        inputs: dict[str, Handle] | None = None,
        images: list[Image] | None = None,
        audios: list[Handle] | None = None,
        mask: Image | None = None,
        language: str | None = None,
        task: str | None = None,
        **settings: Any,
    ) -> Work:
        """A Request for what the caller asks (work: images and audio are preprocessed by kernels).
        `images`: decoded uint8 [h, w, 3] images with their height and width; `audios`: float32
        waveforms at the folder's sampling rate; `inputs`: raw tensors for named session inputs;
        `language`, `task`: the decoder's start ids' language and task (tokens.languages, tokens.tasks).
        A single_pass or denoising folder makes an OutputRequest (loops/setup.py)."""
        if mask is not None and (self.loop is None or self.loop.denoising is None):
            raise GenerationError(MASK_REFUSED)
        if self.loop is not None:
            _no_language(language, task)
            if messages is not None or audios or (images and self.loop.denoising is None):
                raise GenerationError(
                    "messages, images and audios are for the autoregressive loop (an image also for "
                    f'image-to-image); this folder\'s loop is "{self.config.generation.loop}"'
                )

            check_inputs(self.plan, {k: v for k, v in (inputs or {}).items() if k != "latents"}, self.backend)
            made = output_request(
                self.plan,
                self.backend,
                self.loop,
                self.tokenizer,
                prompt,
                prompt_ids,
                inputs,
                list(images or []),
                mask,
                max_new_tokens=max_new_tokens,
                max_length=max_length,
                **settings,
            )
            made.timings.load_ms = self.load_ms
            return made
        if messages is not None:
            if prompt is not None or prompt_ids is not None:
                raise GenerationError("give one of prompt, prompt_ids and messages")
            prompt = self._rendered(messages, {"image": len(images or ()), "audio": len(audios or ())})
        ids, encoded, prompt_tokens = self._encoded(prompt, prompt_ids, language, task)
        search = settings_for(self.config.generation.settings, settings)
        draft = yield from self.prepare(settings)
        if images or audios:
            made = yield from media_inputs(
                self.plan, self.folder, self.backend, list(images or []), list(audios or [])
            )
            inputs = {**made, **(inputs or {})}
        check_inputs(self.plan, inputs or {}, self.backend)
        inputs = _with_encoded(inputs, encoded)
        limit = self.max_length(len(ids), max_new_tokens, max_length)
        warn_unreachable_minimums(search, len(ids), limit)
        if self.plugin is not None:
            unread = unread_settings(self.plugin, [k for k, v in settings.items() if v is not None])
            if unread:
                raise GenerationError(
                    f"this folder's plugin loop does not read {', '.join(unread)}: drop them (what it "
                    f"reads: {', '.join(sorted(getattr(self.plugin, 'settings', ()))) or 'no settings'})"
                )
            check_ids(ids, self.vocab)
            eos = frozenset(self.config.tokens.eos)
            loop = self.plugin(Context(self.plan, self.backend, search, limit, eos, inputs or {}))
            request = PluginRequest(loop, ids, search, self.tokenizer, limit, eos)
            request.timings.load_ms = self.load_ms
            return request
        if self.plan.final_phase and search.num_beams > 1:
            raise GenerationError(
                "this folder's final steps run on one generated sequence: set num_beams to 1"
            )
        kept = [s.session for s in self.plan.step_phase if s.step.accumulate]
        if kept and (search.num_beams > 1 or search.speculative):
            raise GenerationError(
                f"{', '.join(kept)} accumulate outputs step by step, which beam search and speculative "
                "decoding do not keep: drop num_beams and the speculative settings"
            )
        if search.num_beams > 1:
            return (yield from self._beam_request(ids, search, limit, inputs))
        gen = TokenGenerator(
            self.plan, self.backend, self._limits(limit, max_new_tokens, max_length), search, inputs, draft
        )
        language = yield from self._start(gen, ids)
        request = Request(gen, search, self.tokenizer, prompt_tokens)
        request.language = language
        request.timings.load_ms = self.load_ms
        return request

    def _start(self, gen: TokenGenerator, ids: list[Any]) -> Work:
        """Append the prompt `ids`; a None among them is the language's place, which the model fills with
        its most likely language after the ids before it (a run of the decoder over them). The prompt's
        language's code, or None."""
        languages = dict(self.config.tokens.languages)
        if None in ids:
            at = ids.index(None)
            gen.append_tokens(ids[:at])
            chosen = yield from gen.choose(list(languages.values()))
            ids = [*ids[:at], chosen, *ids[at + 1:]]
            gen.append_tokens(ids[at:])
        else:
            gen.append_tokens(ids)
        return self._language(ids)

    def _language(self, ids: list[Any]) -> str | None:
        """The code of the language among a decoder prompt's ids, or None."""
        return next((code for code, i in self.config.tokens.languages if i in ids), None)

    def embed(self, texts: Any, batch_size: int = DEFAULT_BATCH, pooling: str | None = None,
              normalize: bool | None = None) -> OutputRequest:
        """A request for the embeddings of `texts` (a string or a list of them), in batches; `pooling` and
        `normalize` override the folder's."""
        made = embed_request(self.plan, self.backend, self.loop, self.tokenizer, texts, batch_size, pooling,
                             normalize)
        made.timings.load_ms = self.load_ms
        return made

    def generator(
        self,
        prompt_len: int = 0,
        max_new_tokens: int | None = None,
        max_length: int | None = None,
        inputs: dict[str, Handle] | None = None,
        **settings: Any,
    ) -> TokenGenerator:
        """A step-wise generator sized for the request; its caches never exceed the requested length."""
        self._token_loop("the step-wise generator")
        search = settings_for(self.config.generation.settings, settings)
        check_inputs(self.plan, inputs or {}, self.backend)
        limit = self.max_length(prompt_len, max_new_tokens, max_length)
        warn_unreachable_minimums(search, prompt_len, limit)
        draft = self.draft_plan(settings)
        return TokenGenerator(
            self.plan, self.backend, self._limits(limit, max_new_tokens, max_length), search, inputs, draft
        )

    # draft models (speculative decoding)

    def prepare(self, settings: Mapping[str, Any]) -> Work:
        """Load what the settings need before a request or generator is made: the draft model that
        draft_model names, once. Returns its plan, or None."""
        location = self._draft_location(settings)
        if location is None:
            return None
        if location not in self.drafts:
            self.drafts[location] = yield from self._load_draft(location)
        return self.drafts[location].plan

    def draft_plan(self, settings: Mapping[str, Any]) -> Plan | None:
        """The plan of the draft model the settings name (the request's, else the config's), loaded by
        `prepare`; None when they name none."""
        location = self._draft_location(settings)
        return None if location is None else self._loaded_draft(location)

    def _draft_location(self, settings: Mapping[str, Any]) -> str | None:
        """Where the draft model is: the request's draft_model as given (a path, or in the browser a
        URL), or the config's, a folder inside the model folder."""
        given = check_setting("draft_model", settings.get("draft_model"))
        if given is not None:
            return given
        configured = self.config.generation.settings.draft_model
        return None if configured is None else self.folder.locate(configured)

    def _loaded_draft(self, location: str) -> Plan:
        if location not in self.drafts:
            raise OrtpipeError(f"the draft model {location} is not loaded: Model.prepare loads it")
        return self.drafts[location].plan

    def _load_draft(self, location: str) -> Work:
        """Load a draft model folder with its sessions named apart from this model's; it must share
        the tokenizer, check drafts this model can take and be rolled back."""
        if self.platform is None:
            raise OrtpipeError("this model was not made by load_model: it cannot load a draft model")
        folder = self.platform.folder(location)
        if not any(folder.exists(name) for name in ("genai_config.json", "config.json", TOKENIZER_FILE)):
            # a URL the browser cannot list: nothing there (a path that is no folder failed above)
            raise GenerationError(
                f"the draft model {folder.describe()} is not a model folder: it has no genai_config.json, "
                f"config.json or {TOKENIZER_FILE}"
            )
        why = same_vocabulary(self.folder, folder)
        if why:
            raise GenerationError(
                f"the draft model {folder.describe()} must have the model's tokenizer: {why}"
            )
        draft, _ = yield from load_model(
            folder,
            self.platform,
            self.profile,
            prefix=f"draft{len(self.drafts) + 1}/",
            device=self.device[0],
            f16=self.device[1],

        )
        why = cannot_verify(draft.plan)
        if why:
            raise GenerationError(f"the draft model {folder.describe()} cannot draft: {why}")
        if draft.vocab is not None and self.vocab is not None and draft.vocab > self.vocab:
            raise GenerationError(
                f"the draft model {folder.describe()} has {draft.vocab} token ids, more "
                f"than the model's {self.vocab}"
            )
        return draft

    def chat(self, max_length: int | None = None, **settings: Any) -> Chat:
        """A multi-turn chat over one KV cache, with the folder's chat template (see chat.py)."""
        self._token_loop("chat")
        if self.tokenizer is None:
            raise GenerationError(
                f"{self.folder.describe(TOKENIZER_FILE)} is missing: chat needs the tokenizer"
            )
        return Chat(self, self.chat_template(), max_length, **settings)

    def _token_loop(self, what: str) -> None:
        if self.loop is None and self.plan.final_phase:
            raise GenerationError(
                f"{what} makes tokens turn by turn; this folder's final steps run once on the whole "
                "generated sequence: use generate"
            )
        if self.loop is not None:
            raise GenerationError(
                f"{what} makes tokens; this folder's loop is "
                f'"{self.config.generation.loop}": '
                "use generate (or embed)"
            )

    def chat_template(self) -> ChatTemplate:
        if self.template is None:
            raise missing_template()
        return self.template

    def _rendered(self, messages: list[dict[str, Any]], given: dict[str, int]) -> str:
        """The messages rendered by the chat template; their image and audio parts, if any, one for each
        image or clip the request gives."""
        prompt = self.chat_template().render(messages)
        for kind, count in given.items():
            parts = media_parts(messages, kind)
            if parts and parts != count:
                raise GenerationError(f'the messages hold {parts} {{"type": "{kind}"}} part(s) and the '
                                      f"request {count} {kind}(s): give one {kind} for each part, in order")
        return prompt

    def decoder_ids(self, language: str | None = None, task: str | None = None) -> list[int | None]:
        """An encoder-decoder's start ids for a request (tokens.decoder_start) with its `language` and `task`
        (tokens.languages' and tokens.tasks' names) in the places of the ids of their kind, else the language
        after the start token and the task after the language. None: the language's place, for the model
        to fill (Model.request)."""
        tokens = self.config.tokens
        ids: list[int | None] = list(tokens.decoder_prompt)
        languages = set(dict(tokens.languages).values())
        for name, value in (("language", language), ("task", task)):
            if value is None:
                continue
            table = dict(getattr(tokens, name + "s"))
            if not table:
                raise GenerationError(
                    f"this folder names no {name}s (tokens.{name}s; generation_config.json's "
                    f"{'lang' if name == 'language' else 'task'}_to_id): drop {name}", setting=name)
            key = value.removeprefix("<|").removesuffix("|>") if isinstance(value, str) else None
            if key not in table:
                raise GenerationError(f"{name} {quote(value)} is not one of this folder's: "
                                      f"{self._names(name + 's')}", setting=name)
            kind = languages | {None} if name == "language" else set(table.values())
            at = next((i for i, x in enumerate(ids) if i and x in kind), None)
            if at is None:  # a language after the start token, a task after the language
                lang = next((i for i, x in enumerate(ids) if i and (x is None or x in languages)), 0)
                at = 1 if name == "language" else lang + 1
                ids.insert(at, None)
            ids[at] = table[key]
        return ids

    def _decoder_prompt(self, prompt: str | None, prompt_ids: list[int] | None, language: str | None,
                        task: str | None) -> list[Any]:
        """The decoder's prompt where no encoder reads it: the prompt's ids, or an encoder-decoder's start
        ids with the request's language and task."""
        chosen = language is not None or task is not None
        if chosen and (prompt is not None or prompt_ids is not None):
            raise GenerationError("language and task choose the decoder's start ids (tokens.decoder_start), "
                                  "which a prompt gives itself: give one or the other", setting="language")
        if prompt is None and prompt_ids is None and self.config.tokens.decoder_start is not None:
            return self.decoder_ids(language, task)
        if chosen:
            self.decoder_ids(language, task)  # the folder's refusal: it names no languages or tasks
        return self.prompt_ids(prompt, prompt_ids)

    def _names(self, kind: str) -> str:
        names = [name for name, _ in getattr(self.config.tokens, kind)]
        return ", ".join(names[:20]) + (f" ({len(names) - 20} more)" if len(names) > 20 else "")

    def prompt_ids(self, prompt: str | None, prompt_ids: list[int] | None) -> list[int]:
        if prompt is None and prompt_ids is None and self.config.pipeline.state.cross_cache:
            raise GenerationError(
                "this encoder-decoder folder sets no decoder start token (tokens.decoder_start, "
                "or model.decoder_start_token_id in v1): pass prompt_ids"
            )
        if (prompt is None) == (prompt_ids is None):
            raise GenerationError(ONE_PROMPT)
        if prompt_ids is not None:
            if not isinstance(prompt_ids, (list, tuple)):
                raise GenerationError(f"prompt_ids must be a list of token ids, found {quote(prompt_ids)}")
            return list(prompt_ids)
        if not isinstance(prompt, str):
            raise GenerationError(f"prompt must be a string, found {quote(prompt)}")
        if self.tokenizer is None:
            raise GenerationError(
                "this model folder has no tokenizer.json: pass prompt_ids instead of a prompt"
            )
        ids = encode(self.tokenizer, prompt)
        if not ids:
            raise GenerationError(f"the prompt {quote(prompt)} encodes to no tokens (this folder's tokenizer "
                                  "adds no start token): give some text, or prompt_ids", setting="prompt_ids")
        return ids

    def _encoded(self, prompt: str | None, prompt_ids: list[int] | None, language: str | None = None,
                 task: str | None = None) -> tuple[list[Any], dict[str, Any], int]:
        """The decoder's prompt ids, the request inputs an encoder makes of the prompt, and the prompt's
        token count: for an encoder-decoder whose encoder reads text (T5, BART, Marian) the prompt's ids and
        mask are that encoder's inputs (and the decoder's mask over them), and the decoder starts from
        tokens.decoder_start; for the others the prompt is the decoder's, and no inputs are made. The
        decoder's start ids hold the request's language and task (a None: the model's to choose)."""
        step = self.plan.text_encoder
        if step is None:
            ids = self._decoder_prompt(prompt, prompt_ids, language, task)
            return ids, {}, len(ids)
        start = self.config.tokens.decoder_start
        if start is None:
            raise GenerationError(
                f'session "{step.session}" encodes the prompt, and the decoder needs a start token: set '
                'tokens.decoder_start (decoder_start_token_id in generation_config.json)'
            )
        if prompt is None and prompt_ids is None:
            raise GenerationError(f'give a prompt: session "{step.session}" encodes it, and the decoder '
                                  "writes the answer from its start token")
        ids = self.prompt_ids(prompt, prompt_ids)
        check_ids(ids, self.vocab)
        most = self.config.pipeline.preprocessing.get("text", {}).get("max_length")
        if isinstance(most, int) and len(ids) > most:
            raise GenerationError(
                f"the prompt is {len(ids)} tokens; this folder's encoder reads at most {most} "
                "(preprocessing.text.max_length): shorten it", setting="prompt"
            )
        b, n = self.backend, len(ids)
        spec = self.config.pipeline.sessions[step.session]
        roles = {(step.session, spec.inputs.get(r, r)): r for r in ("input_ids", "attention_mask")}
        for s in self.plan.step_phase:  # the decoder's mask over the encoder's positions: the same ones
            name = self.config.pipeline.sessions[s.session].inputs.get(ENCODER_MASK, ENCODER_MASK)
            roles[(s.session, name)] = "attention_mask"
        made = {}
        for s in (step, *self.plan.step_phase):
            for f in s.feeds:
                role = roles.get((s.session, f.input)) if f.kind == FROM_REQUEST else None
                if role == "input_ids":
                    made[f.input] = b.tensor(ids, (1, n), f.dtype)
                elif role == "attention_mask":
                    made[f.input] = b.full((1, n), 1, f.dtype)
        return self.decoder_ids(language, task), made, n

    def max_length(self, prompt_len: int, max_new_tokens: int | None, max_length: int | None) -> int:
        """The request's length limit: max_length, or the prompt plus max_new_tokens, or the config's."""
        check_setting("max_new_tokens", max_new_tokens)
        check_setting("max_length", max_length)
        if max_new_tokens is not None and max_length is not None:
            raise GenerationError("give max_new_tokens or max_length, not both")
        configured = self.config.generation.max_length
        if max_length is None:
            if max_new_tokens is not None:
                max_length = prompt_len + max_new_tokens
            else:
                max_length = configured or prompt_len + DEFAULT_MAX_NEW_TOKENS
        context = self.config.metadata.get("context_length")
        if isinstance(context, int) and max_length > context:
            raise GenerationError(
                f"max_length {max_length} is more than the model's context_length {context}; "
                "lower max_length or max_new_tokens"
            )
        positions = self.plan.max_positions
        if positions is not None and max_length > positions:
            raise GenerationError(
                f"max_length {max_length} is more than the {positions} positions the "
                "model's graph can run (the size of its position tables); lower max_length "
                "or max_new_tokens"
            )

        if max_length <= prompt_len:
            raise GenerationError(
                f"max_length {max_length} leaves no room to generate after a "
                f"{prompt_len}-token prompt; raise max_length or use max_new_tokens"
            )
        return max_length

    def audio_config(self) -> AudioConfig:
        """The folder's audio feature extractor config (its sampling rate, the seconds of a clip it reads)."""
        prep = self.config.pipeline.preprocessing.get("audio")
        return load_audio_config(self.folder, prep.get("config") if prep else None)

    def sampling_rate(self) -> int:
        return self.audio_config().sampling_rate

    def _limits(self, limit: int, max_new_tokens: int | None, max_length: int | None) -> Limits:
        return Limits(
            limit,
            frozenset(self.config.tokens.eos),
            grows=max_length is None and max_new_tokens is not None,
            vocab=self.vocab,
        )

    def _beam_request(
        self, prompt_ids: list[Any], search: SearchSettings, limit: int, inputs: dict[str, Handle] | None
    ) -> Work:
        """A BeamRequest (work: a prompt with the language's place open first has the model choose the
        language, on a one-row run of its own, as transformers detects it before its beams)."""
        language = self._language(prompt_ids)
        if None in prompt_ids:
            probe = TokenGenerator(self.plan, self.backend, Limits(limit, frozenset(self.config.tokens.eos),
                                                                   vocab=self.vocab), None, inputs)
            language = yield from self._start(probe, prompt_ids)
            prompt_ids = list(probe.tokens)
        check_ids(prompt_ids, self.vocab)
        unsupported = [
            name
            for name, on in (
                ("repetition_penalty", search.repetition_penalty != 1.0),
                ("frequency_penalty", search.frequency_penalty),
                ("presence_penalty", search.presence_penalty),
                ("logit_bias", search.logit_bias),
                ("stop", search.stop),
            )
            if on
        ]
        if unsupported:
            raise GenerationError(
                f"beam search does not apply {', '.join(unsupported)} yet; drop them or use num_beams 1"
            )
        beam = BeamSearch(self.plan, self.backend, search, limit, frozenset(self.config.tokens.eos), inputs)
        request = BeamRequest(beam, list(prompt_ids), search, self.tokenizer)
        request.language = language
        request.timings.load_ms = self.load_ms
        return request


def _check_start_ids(folder: Folder, config: Config, vocab: int | None) -> None:
    """The ids a token loop's decoder starts from, and those its languages and tasks name, are checked as a
    prompt's are (a codebook loop's start, a pad beyond the codes, is its own: MusicGen's embeddings hold
    one row more than its logits)."""
    tokens = config.tokens
    token_loop = config.generation.codebooks is None
    starts = [i for i in tokens.decoder_prompt if i is not None] if token_loop else []
    shown = json.dumps(list(tokens.decoder_prompt))
    for ids, what, found in (
        (starts, f"the decoder starts from ids {shown} (tokens.decoder_start",
         "decoder_start_token_id and forced_decoder_ids"),
        ([i for _, i in tokens.languages], "its languages name ids (tokens.languages", "lang_to_id"),
        ([i for _, i in tokens.tasks], "its tasks name ids (tokens.tasks", "task_to_id"),
    ):
        outside = [i for i in ids if vocab is not None and i >= vocab]
        if outside:
            source = f"generation_config.json's {found}" if config.source == "detected" else "its config"
            raise ConfigError(f"{folder.describe()}: {what}, from {source}), and {outside[0]} is outside the "
                              f"decoder's vocabulary of {vocab}: fix the id there")
    for name, ids in named_ids(config.generation.settings):  # as a request's are (Sampler.check_ids)
        outside = [i for i in ids if vocab is not None and i >= vocab]
        if outside and token_loop:
            where = "generation_config.json" if config.source == "detected" else "its config"
            raise ConfigError(f"{folder.describe()}: generation setting {name} names token {outside[0]}, "
                              f"outside the decoder's vocabulary of {vocab}: fix it in {where}")


def _no_language(language: str | None, task: str | None) -> None:
    for name, value in (("language", language), ("task", task)):
        if value is not None:
            raise GenerationError(f"{name} chooses an encoder-decoder's start ids (tokens.{name}s); this "
                                  "folder's loop reads none: drop it", setting=name)


class _Reader(NamedTuple):
    session: str


def _with_encoded(inputs: dict[str, Handle] | None, encoded: dict[str, Handle]) -> dict[str, Handle] | None:
    """A request's inputs and those its encoder's text makes (Model._encoded), which it may not give."""
    if not encoded:
        return inputs
    taken = sorted(set(encoded) & set(inputs or {}))
    if taken:
        raise GenerationError(f"{', '.join(taken)} {'are' if len(taken) > 1 else 'is'} made from the prompt "
                              "for this folder's encoder: drop it from inputs")
    return {**(inputs or {}), **encoded}


def check_inputs(plan: Plan, inputs: dict[str, Handle], backend: Backend) -> None:
    """Request inputs against the graphs that read them: known names, rank, element type, fixed dims.
    A plugin's loop feeds its sessions itself: any session's input name is a request input there."""
    if plan.config.pipeline.plugin:
        readers = {t.name: _Reader(n) for n, sig in plan.signatures.items() for t in sig.inputs}
    else:
        readers = {f.input: s for s in plan.init_steps for f in s.feeds if f.kind == FROM_REQUEST}
    controls = {s.step.dynamic_shape.source for s in plan.init_steps if s.step.dynamic_shape}
    grid = plan.config.pipeline.state.position_ids.grid_source
    controls |= {grid.split(".", 1)[-1]} if grid else set()
    for name, value in inputs.items():
        s = readers.get(name)
        if s is None and name in controls:
            continue  # read by the executor itself (crop sizes, mRoPE grids)
        if s is None:
            known = ", ".join(sorted(readers)) or "none"
            raise GenerationError(
                f'no session reads a request input named "{name}" (request inputs: {known})'
            )
        info = plan.signatures[s.session].input(name)
        shape, dtype = tuple(backend.shape(value)), backend.dtype(value)
        fixed_ok = len(shape) == info.rank and all(
            not isinstance(d, int) or d == n for d, n in zip(info.shape, shape, strict=True)
        )
        if not fixed_ok or dtype != info.dtype:
            raise GenerationError(
                f'input "{name}" of session "{s.session}": expected {info.dtype} {list(info.shape)}, '
                f"got {dtype} {list(shape)}"
            )
