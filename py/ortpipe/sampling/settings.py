"""Generation settings for one request: the config's defaults with the caller's overrides, validated
before any model runs. The fields and their checks come from the settings table (config/settings.py)."""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

from ..config.settings import BY_NAME, SearchSettings
from ..errors import GenerationError, did_you_mean


def check_setting(name: str, value: Any) -> Any:
    """`value` as the runtime takes it; a GenerationError naming the setting when it is refused."""
    setting = BY_NAME.get(name)
    if setting is None:
        raise GenerationError(f'unknown generation setting "{name}".{did_you_mean(name, BY_NAME)} '
                              f"Known: {', '.join(BY_NAME)}")
    checked, problem = setting.check(value)
    if problem:
        raise GenerationError(f"{name} {problem}", setting=name)
    return checked


def settings_for(defaults: SearchSettings, overrides: dict[str, Any]) -> SearchSettings:
    """`defaults` (a SearchSettings, the config's) with non-None overrides laid over them, checked."""
    changes = {}
    for key, value in overrides.items():
        if value is None and key in BY_NAME:
            continue  # not given: the default holds
        checked = check_setting(key, value)
        if BY_NAME[key].search:
            changes[key] = checked
    settings = dataclasses.replace(defaults, **changes) if changes else defaults
    check_combination(settings)
    _warn_unsampled(settings, changes)
    return settings


SAMPLING_ONLY = ("temperature", "top_k", "top_p", "min_p")
# the values that ask for nothing a greedy request lacks: temperature 0 asks for greedy decoding, the others
# turn their filter off (OpenAI clients send top_p 1 beside temperature 0)
OFF = {"temperature": 0, "top_k": 0, "top_p": 1, "min_p": 0}


def warn_unreachable_minimums(s: SearchSettings, prompt_len: int, limit: int) -> None:
    """min_length or min_new_tokens beyond what the request's length limit lets it generate cannot hold
    eos back that far: generation ends at the limit first. Said, with the fix, rather than left unsaid."""
    most = limit - prompt_len
    if s.min_length > limit:
        warnings.warn(
            f"min_length {s.min_length} is more than this request's max_length {limit} (a {prompt_len}-token "
            f"prompt and at most {most} new): generation ends at {limit}; lower min_length or raise "
            "max_length or max_new_tokens",
            UserWarning,
            stacklevel=3,
        )
    if s.min_new_tokens > most:
        warnings.warn(
            f"min_new_tokens {s.min_new_tokens} is more than the {most} tokens this request can make "
            f"(max_length {limit}, a {prompt_len}-token prompt): generation ends there; lower "
            "min_new_tokens or raise max_length or max_new_tokens",
            UserWarning,
            stacklevel=3,
        )


def _warn_unsampled(s: SearchSettings, given: dict[str, Any]) -> None:
    """A request that sets how to sample but does not sample (the folder's default or its own
    do_sample false) is told so: those settings change nothing. A value in OFF asks for nothing."""
    if s.do_sample:
        return
    unused = [k for k in SAMPLING_ONLY if k in given and given[k] != OFF.get(k)]
    if unused:
        how = "with beam search" if s.num_beams > 1 else "greedily"
        verb = "applies" if len(unused) == 1 else "apply"
        warnings.warn(
            f"{', '.join(unused)} only {verb} when sampling, and this request decodes {how} (do_sample is "
            f"false{'' if 'do_sample' in given else ' in the model folder'}): set do_sample true to sample",
            UserWarning,
            stacklevel=2,
        )


def check_combination(s: SearchSettings) -> None:
    """What each setting allows alone, the table checks; these are the rules between settings."""
    if s.num_beams > 1 and s.do_sample:
        raise GenerationError(
            "beam search with sampling is not supported; set do_sample false or num_beams 1"
        )
    if s.num_beams > 1 and s.speculative:
        raise GenerationError(
            "beam search with speculative decoding is not supported; drop prompt_lookup_num_tokens, "
            "ngram_size and draft_model, or set num_beams 1"
        )
    if s.speculative and s.forced_eos_token_id is not None:
        raise GenerationError(
            "speculative decoding does not force the last token (forced_eos_token_id): drop the speculative "
            "settings, or set forced_eos_token_id to null", setting="forced_eos_token_id")
    if s.num_beams > 1 and s.logprobs is not None:
        raise GenerationError("beam search does not give logprobs; set num_beams 1 or drop logprobs")
    if s.num_return_sequences > s.num_beams:
        raise GenerationError(
            f"num_return_sequences ({s.num_return_sequences}) needs as many beams; raise "
            f"num_beams to at least {s.num_return_sequences} (sampling returns one sequence)"
        )


__all__ = ["SearchSettings", "check_combination", "check_setting", "settings_for"]
