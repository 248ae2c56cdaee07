"""Beam search equals transformers' generate(num_beams=...) and, where no beam meets eos,
onnxruntime-genai's beam search on the same builder folder."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from build.references import _hf_model, prompt_ids

import ortpipe

torch = pytest.importorskip("torch")


def hf_beams(hf_dir: Path, ids: list[int], new: int, eos: int | None = None, **search) -> list[int]:
    model = _hf_model(str(hf_dir))
    t = torch.tensor([ids])
    extra = {"eos_token_id": eos, "pad_token_id": eos} if eos is not None else {}
    with torch.no_grad():
        out = model.generate(
            input_ids=t,
            attention_mask=torch.ones_like(t),
            max_new_tokens=new,
            do_sample=False,
            **search,
            **extra,
        )
    return out[0, len(ids) :].tolist()


def genai_beams(folder: Path, ids: list[int], new: int, **search) -> list[int]:
    import onnxruntime_genai as og

    model = og.Model(og.Config(str(folder)))
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=len(ids) + new, do_sample=False, **search)
    generator = og.Generator(model, params)
    generator.append_tokens(np.asarray(ids, dtype=np.int32))
    while not generator.is_done():
        generator.generate_next_token()
    return [int(t) for t in generator.get_sequence(0)[len(ids) :]]


@pytest.mark.parametrize(
    "search",
    [
        {"num_beams": 4, "early_stopping": False, "length_penalty": 1.0},
        {"num_beams": 3, "early_stopping": True, "length_penalty": 0.5},
    ],
)
def test_beam_search_matches_transformers_and_genai(
    search: dict, llama_builder_fp32: Path, llama_hf: Path
) -> None:
    ids = prompt_ids(llama_builder_fp32)
    ours = ortpipe.load(llama_builder_fp32, threads=1).generate(prompt_ids=ids, max_new_tokens=24, **search)
    assert len(ours.tokens) == 24
    assert ours.tokens == hf_beams(llama_hf, ids, 24, **search)
    assert ours.tokens == genai_beams(llama_builder_fp32, ids, 24, **search)
    greedy = ortpipe.load(llama_builder_fp32, threads=1).generate(prompt_ids=ids, max_new_tokens=24).tokens
    assert ours.tokens != greedy  # the search found another sequence: beams were really followed


@pytest.mark.parametrize(
    "search",
    [
        {"num_beams": 4, "early_stopping": False},
        {"num_beams": 4, "early_stopping": True},
        {"num_beams": 3, "length_penalty": 2.0, "early_stopping": False},
    ],
)
def test_beams_that_meet_eos_match_transformers(
    search: dict, llama_builder_fp32: Path, llama_hf: Path, tmp_path: Path
) -> None:
    ids = prompt_ids(llama_builder_fp32)
    free = ortpipe.load(llama_builder_fp32, threads=1).generate(
        prompt_ids=ids, max_new_tokens=30, num_beams=4
    )
    eos = free.tokens[6]  # a token the beams do produce
    folder = tmp_path / "eos"
    shutil.copytree(llama_builder_fp32, folder)
    config = json.loads((folder / "genai_config.json").read_text())
    config["model"]["eos_token_id"] = eos
    (folder / "genai_config.json").write_text(json.dumps(config))
    ours = ortpipe.load(folder, threads=1).generate(prompt_ids=ids, max_new_tokens=30, **search)
    reference = hf_beams(llama_hf, ids, 30, eos=eos, **search)
    while len(reference) > len(ours.tokens) and reference[-1] == eos:  # transformers pads short rows with eos
        reference.pop()
    assert ours.tokens == reference
    if search.get("length_penalty", 1.0) <= 1.0:  # a strong length penalty rightly prefers a longer beam
        assert eos in ours.tokens


def test_num_return_sequences(llama_builder_fp32: Path) -> None:
    pipe = ortpipe.load(llama_builder_fp32, threads=1)
    request = pipe.request(
        prompt_ids=prompt_ids(llama_builder_fp32), max_new_tokens=10, num_beams=4, num_return_sequences=3
    )
    for _ in pipe.drive(request):
        pass
    assert len(request.sequences) == 3 and request.sequences[0] == request.tokens
    assert len({tuple(s) for s in request.sequences}) == 3


def test_beams_apply_bans_and_minimum_lengths_as_transformers(
    llama_builder_fp32: Path, llama_hf: Path, tmp_path: Path
) -> None:
    """Beam search bans what greedy search bans (n-gram repeats, eos before min_new_tokens, suppress_tokens,
    begin_suppress_tokens on the first token), each beam on its own text, at -inf after the log-softmax as
    transformers' logits processors ban them."""
    ids = prompt_ids(llama_builder_fp32)
    pipe = ortpipe.load(llama_builder_fp32, threads=1)
    free = pipe.generate(prompt_ids=ids, max_new_tokens=30, num_beams=4)
    eos = free.tokens[6]
    folder = tmp_path / "eos"
    shutil.copytree(llama_builder_fp32, folder)
    config = json.loads((folder / "genai_config.json").read_text())
    config["model"]["eos_token_id"] = eos
    (folder / "genai_config.json").write_text(json.dumps(config))
    pipe = ortpipe.load(folder, threads=1)
    plain = pipe.generate(prompt_ids=ids, max_new_tokens=30, num_beams=4, early_stopping=False).tokens
    for bans in ({"no_repeat_ngram_size": 2}, {"min_new_tokens": 26},
                 {"suppress_tokens": [free.tokens[1], 234], "begin_suppress_tokens": [17]}):
        search = {"num_beams": 4, "early_stopping": False, **bans}
        ours = pipe.generate(prompt_ids=ids, max_new_tokens=30, **search).tokens
        reference = hf_beams(llama_hf, ids, 30, eos=eos, **search)
        while len(reference) > len(ours) and reference[-1] == eos:
            reference.pop()
        assert ours == reference, search
        assert ours != plain, search  # each ban changed the search's result
