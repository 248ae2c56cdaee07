"""Independent references for conformance tests: what onnxruntime-genai and transformers generate.

Neither path shares code with ortpipe. Token ids in, generated ids out (prompt excluded), greedy.
"""

from __future__ import annotations

import copy
import functools
import json
from dataclasses import dataclass
from pathlib import Path

# A fixed text, plain English and Python, long enough for 60+ tokens with any of the test tokenizers.
PROMPT_TEXT = (
    "The parser reads each line of the file, splits it on commas and keeps the fields it needs.\n"
    "def count_words(path):\n"
    "    \"\"\"Return a dictionary that maps every word in the file to its number of occurrences.\"\"\"\n"
    "    counts = {}\n"
    "    with open(path, encoding='utf-8') as handle:\n"
    "        for line in handle:\n"
    "            for word in line.split():\n"
    "                counts[word] = counts.get(word, 0) + 1\n"
    "    return counts\n"
)


def prompt_ids(tokenizer_dir: str | Path, n: int = 60) -> list[int]:
    """The first n ids of PROMPT_TEXT under the folder's tokenizer.json."""
    from tokenizers import Tokenizer

    ids = Tokenizer.from_file(str(Path(tokenizer_dir) / "tokenizer.json")).encode(PROMPT_TEXT).ids
    if len(ids) < n:
        raise ValueError(f"the prompt text is only {len(ids)} tokens under {tokenizer_dir}, {n} asked")
    return ids[:n]


def genai_greedy(model_dir: str | Path, prompt_ids: list[int], max_new_tokens: int,
                 threads: int | None = None) -> list[int]:
    """Greedy generation with onnxruntime-genai; it stops at the model's eos as genai does.

    append_tokens() runs the prefill and already picks the first new token from its logits.
    """
    import numpy as np
    import onnxruntime_genai as og

    config = og.Config(str(model_dir))
    if threads is not None:
        options = {"intra_op_num_threads": threads}
        config.overlay(json.dumps({"model": {"decoder": {"session_options": options}}}))
    model = og.Model(config)
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=len(prompt_ids) + max_new_tokens, do_sample=False)
    generator = og.Generator(model, params)
    generator.append_tokens(np.asarray(prompt_ids, dtype=np.int32))
    while not generator.is_done():
        generator.generate_next_token()
    return [int(t) for t in generator.get_sequence(0)[len(prompt_ids):]]


@functools.lru_cache(maxsize=8)
def _hf_model(hf_dir: str):
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    return model.eval()


def hf_greedy(hf_dir: str | Path, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """Greedy generation with transformers' generate(do_sample=False); stops at eos like genai."""
    import torch

    model = _hf_model(str(hf_dir))
    ids = torch.tensor([prompt_ids], dtype=torch.int64)
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                             max_new_tokens=max_new_tokens, do_sample=False, num_beams=1)
    return out[0, len(prompt_ids):].tolist()


@dataclass(frozen=True)
class Step:
    """One generation step under the Hugging Face model: its two best tokens and their logit gap."""
    first: int
    second: int
    margin: float


def hf_logit_margins(hf_dir: str | Path, prompt_ids: list[int], generated: list[int]) -> list[Step]:
    """For each generated token, the HF model's top-1 / top-2 at that step (one teacher-forced pass).

    A divergence between two implementations at a step with a tiny margin is a near-tie, not a bug.
    """
    import torch

    model = _hf_model(str(hf_dir))
    ids = torch.tensor([list(prompt_ids) + list(generated[:-1])], dtype=torch.int64)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits[0]
    steps = []
    for pos in range(len(prompt_ids) - 1, ids.shape[1]):
        top = torch.topk(logits[pos].float(), 2)
        steps.append(Step(int(top.indices[0]), int(top.indices[1]), float(top.values[0] - top.values[1])))
    return steps


def first_divergence(expected: list[int], actual: list[int]) -> int | None:
    """The first step where two generations differ (a length difference counts), or None."""
    for step, (a, b) in enumerate(zip(expected, actual, strict=False)):
        if a != b:
            return step
    return None if len(expected) == len(actual) else min(len(expected), len(actual))


def explain_divergence(hf_dir: str | Path, prompt_ids: list[int], expected: list[int],
                       actual: list[int]) -> str:
    """A one-line account of where `actual` leaves the HF reference `expected`, with the margin there."""
    step = first_divergence(expected, actual)
    if step is None:
        return "identical"
    if step >= len(expected) or step >= len(actual):
        return f"lengths differ: {len(expected)} vs {len(actual)} tokens, equal up to step {step}"
    margin = hf_logit_margins(hf_dir, prompt_ids, expected)[step]
    return (f"diverges at step {step}: reference {expected[step]}, got {actual[step]}; "
            f"HF top-2 there {margin.first}/{margin.second}, margin {margin.margin:.6f}")


# --- encoder-decoder (Whisper) -----------------------------------------------------------------

@functools.lru_cache(maxsize=2)
def _hf_whisper(hf_dir: str):
    import torch
    import transformers

    model = transformers.WhisperForConditionalGeneration.from_pretrained(hf_dir, dtype=torch.float32)
    return model.eval()


def _plain_greedy_config(model, max_new_tokens: int):
    """The model's generation_config with Whisper's extras off: nothing forced, nothing suppressed."""
    config = copy.deepcopy(model.generation_config)
    for key in ("forced_decoder_ids", "suppress_tokens", "begin_suppress_tokens"):
        setattr(config, key, None)
    config.do_sample, config.num_beams, config.max_new_tokens = False, 1, max_new_tokens
    return config


def hf_whisper_greedy(hf_dir: str | Path, input_features, decoder_prompt: list[int],
                      max_new_tokens: int) -> list[int]:
    """Greedy generation of a Whisper model from raw log-mel features [1, mels, frames] and a decoder
    prompt; stops at eos. Runs transformers' generic generate(), not WhisperGenerationMixin's, whose
    language / task / timestamp logic would rewrite the prompt."""
    import torch
    import transformers

    model = _hf_whisper(str(hf_dir))
    features = torch.as_tensor(input_features, dtype=torch.float32)
    prompt = torch.tensor([decoder_prompt], dtype=torch.int64)
    config = _plain_greedy_config(model, max_new_tokens)
    with torch.no_grad():
        out = transformers.GenerationMixin.generate(model, input_features=features, decoder_input_ids=prompt,
                                                    generation_config=config)
    return out[0, len(decoder_prompt):].tolist()


def genai_whisper_greedy(model_dir: str | Path, input_features, decoder_prompt: list[int],
                         max_new_tokens: int, threads: int | None = None) -> list[int]:
    """Greedy generation with onnxruntime-genai from raw features, fed as the encoder's "audio_features"."""
    import numpy as np
    import onnxruntime_genai as og

    config = og.Config(str(model_dir))
    if threads is not None:
        options = {"intra_op_num_threads": threads}
        config.overlay(json.dumps({"model": {"encoder": {"session_options": options},
                                             "decoder": {"session_options": options}}}))
    model = og.Model(config)
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=len(decoder_prompt) + max_new_tokens, do_sample=False)
    generator = og.Generator(model, params)
    inputs = og.NamedTensors()
    inputs["audio_features"] = np.ascontiguousarray(input_features, dtype=np.float32)
    generator.set_inputs(inputs)
    generator.append_tokens(np.asarray(decoder_prompt, dtype=np.int32))
    while not generator.is_done():
        generator.generate_next_token()
    return [int(t) for t in generator.get_sequence(0)[len(decoder_prompt):]]


def hf_whisper_margins(hf_dir: str | Path, input_features, decoder_prompt: list[int],
                       generated: list[int]) -> list[Step]:
    """hf_logit_margins for Whisper: top-1 / top-2 and their gap at each generated token."""
    import torch

    model = _hf_whisper(str(hf_dir))
    ids = torch.tensor([list(decoder_prompt) + list(generated[:-1])], dtype=torch.int64)
    with torch.no_grad():
        logits = model(input_features=torch.as_tensor(input_features, dtype=torch.float32),
                       decoder_input_ids=ids).logits[0]
    steps = []
    for pos in range(len(decoder_prompt) - 1, ids.shape[1]):
        top = torch.topk(logits[pos].float(), 2)
        steps.append(Step(int(top.indices[0]), int(top.indices[1]), float(top.values[0] - top.values[1])))
    return steps
