"""Encoder-decoder folders as optimum exports them and transformers.js runs them (`encoder_model.onnx` and
`decoder_model_merged.onnx`, in the folder or `onnx/`; no genai_config.json): ortpipe detects them, feeds
the prompt's text to a text encoder (T5) or audio to a speech encoder (Whisper), starts the decoder from
`decoder_start_token_id`, and keeps the cross-attention cache of the decoder's first run. Tokens are compared
with transformers' generate on the weights optimum exported (build/seq2seq.py)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from build import hfmodels, seq2seq
from build.hfmodels import WHISPER_MELS, WHISPER_START_ID
from build.references import hf_whisper_greedy

import ortpipe
from ortpipe.targets.cpython import Pipeline

from .test_serve_transcriptions import clip
from .test_whisper import features

pytestmark = pytest.mark.slow
NEW = 20
PROMPTS = ["def bisect(a, x):", "import os, sys", "x", "return self._data[key] if key in self else default"]


@pytest.fixture(scope="module")
def t5_hf() -> Path:
    return seq2seq.get("t5-hf")


@pytest.fixture(scope="module")
def t5_optimum() -> Path:
    return seq2seq.get("t5-optimum")


@pytest.fixture(scope="module")
def whisper_optimum() -> Path:
    return seq2seq.get("whisper-optimum")


@pytest.fixture(scope="module")
def t5(t5_optimum: Path) -> Pipeline:
    return ortpipe.load(t5_optimum, threads=1)


def test_the_folder_is_detected_as_an_encoder_decoder(t5: Pipeline, t5_optimum: Path) -> None:
    assert not (t5_optimum / "genai_config.json").exists()
    assert (t5_optimum / "onnx/encoder_model.onnx").is_file()
    assert t5.plan.config.source == "detected"
    flow = [(s.run, s.when) for s in t5.plan.config.pipeline.flow]
    assert flow == [("encoder", "init"), ("decoder", "step")]
    assert t5.plan.text_encoder is not None and t5.plan.text_encoder.session == "encoder"
    [decoder] = t5.plan.step_phase
    cross = [e.past_input for e in decoder.kv.entries if e.frozen]
    assert cross and all(".encoder." in name for name in cross)
    assert t5.config.tokens.decoder_start == hfmodels.PAD_ID


@pytest.mark.parametrize("prompt", PROMPTS)
def test_t5_greedy_equals_transformers(prompt: str, t5: Pipeline, t5_hf: Path) -> None:
    ids = t5.tokenizer.encode(prompt)
    expected = seq2seq.hf_t5_greedy(t5_hf, ids, NEW)
    result = t5.generate(prompt, max_new_tokens=NEW)
    assert result.tokens == expected
    # every step after the first (which fills the cross-attention cache) runs fused, fed the encoder's
    # states and mask and the frozen cross-attention entries as fixed inputs
    assert t5.plan.fused is not None and "encoder_hidden_states" in t5.plan.fused.fixed
    assert result.timings.fused_steps == NEW - 1
    assert t5.generate(prompt_ids=ids, max_new_tokens=NEW).tokens == expected
    assert [c.token for c in t5.stream(prompt, max_new_tokens=NEW)] == expected


def test_the_prompt_decides_the_tokens_and_requests_stay_apart(t5: Pipeline) -> None:
    first, other, again = (t5.generate(p, max_new_tokens=NEW).tokens for p in (*PROMPTS[:2], PROMPTS[0]))
    assert first == again  # the frozen cross cache is per request
    assert first != other


def test_t5_beam_search_equals_transformers(t5: Pipeline, t5_hf: Path) -> None:
    import torch
    import transformers

    ids = t5.tokenizer.encode(PROMPTS[0])
    ours = t5.generate(prompt_ids=ids, max_new_tokens=12, num_beams=3, early_stopping=False).tokens
    model = transformers.T5ForConditionalGeneration.from_pretrained(t5_hf, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.generate(input_ids=torch.tensor([ids]), do_sample=False, num_beams=3,
                             early_stopping=False, max_new_tokens=12, length_penalty=1.0)
    assert ours == out[0, 1:].tolist()


@pytest.mark.parametrize("kind", ["beams", "greedy"])
def test_generation_config_is_read_as_transformers_generate_reads_it(
        kind: str, t5: Pipeline, t5_optimum: Path, t5_hf: Path, tmp_path: Path) -> None:
    """generation_config.json's search keys (beams, n-gram and token bans, bad_words_ids of one token, a
    minimum and a maximum length) are the folder's defaults, as transformers' generate takes them: a request
    that gives none equals transformers' generate given none, on the same generation_config.json."""
    import torch
    import transformers

    ids = t5.tokenizer.encode(PROMPTS[0])
    plain = t5.generate(prompt_ids=ids, max_new_tokens=15).tokens
    gen = json.loads((t5_optimum / "generation_config.json").read_text())
    gen.update({"max_length": 16, "begin_suppress_tokens": [plain[0]], "bad_words_ids": [[plain[2]]],
                "suppress_tokens": [plain[4]], "min_length": 12})
    if kind == "beams":
        gen.update({"num_beams": 3, "no_repeat_ngram_size": 2, "length_penalty": 0.8})
    folders = [Path(shutil.copytree(f, tmp_path / n)) for f, n in ((t5_optimum, "onnx"), (t5_hf, "hf"))]
    for folder in folders:
        (folder / "generation_config.json").write_text(json.dumps(gen))
    pipe = ortpipe.load(folders[0], threads=1)
    settings = pipe.config.generation.settings
    assert settings.suppress_tokens == (plain[4], plain[2]) and settings.begin_suppress_tokens == (plain[0],)
    ours = pipe.generate(prompt_ids=ids).tokens
    model = transformers.T5ForConditionalGeneration.from_pretrained(folders[1], dtype=torch.float32).eval()
    with torch.no_grad():
        given = torch.tensor([ids])
        out = model.generate(input_ids=given, attention_mask=torch.ones_like(given))
    assert ours == out[0, 1:].tolist()
    assert len(ours) == 15 and ours != plain and ours[0] != plain[0]
    assert not {plain[2], plain[4]} & set(ours)


def test_generation_config_keys_not_applied_are_warned_of(t5_optimum: Path, tmp_path: Path) -> None:
    folder = Path(shutil.copytree(t5_optimum, tmp_path / "t5"))
    gen = json.loads((folder / "generation_config.json").read_text())
    gen.update({"typical_p": 0.9, "forced_eos_token_id": [2, 3], "bad_words_ids": [[5], [6, 7]],
                "early_stopping": "never", "num_beam_groups": 1, "renormalize_logits": False})
    (folder / "generation_config.json").write_text(json.dumps(gen))
    with pytest.warns(UserWarning) as caught:
        pipe = ortpipe.load(folder, threads=1)
    said = sorted(str(w.message).split(",")[0].removeprefix("generation_config.json sets ") for w in caught)
    assert said == ["bad_words_ids [[6", 'early_stopping "never"', "forced_eos_token_id [2", "typical_p 0.9"]
    assert all("its tokens may differ from transformers' generate" in str(w.message) for w in caught)
    assert pipe.config.generation.settings.suppress_tokens == (5,)  # the one-token entry is banned
    (folder / "generation_config.json").write_text(json.dumps({**gen, "num_beams": 0}))
    with pytest.raises(ortpipe.ConfigError, match=r"generation_config.json: num_beams .*fix it there"):
        ortpipe.load(folder)
    (folder / "generation_config.json").write_text(json.dumps({"decoder_start_token_id": 0,
                                                               "suppress_tokens": [3, 99999]}))
    with pytest.raises(ortpipe.ConfigError, match="generation setting suppress_tokens names token 99999, "
                                                  "outside the decoder's vocabulary of 512: fix it in "
                                                  "generation_config"):
        ortpipe.load(folder)


def hf_bart_generate(ids: list[int], **options: object) -> list[int]:
    """transformers' generate of the test BART on its own generation_config.json (a summarizer's search), the
    decoder start token left out."""
    import torch
    import transformers

    model = transformers.BartForConditionalGeneration.from_pretrained(seq2seq.get("bart-hf"),
                                                                      dtype=torch.float32).eval()
    given = torch.tensor([ids])
    with torch.no_grad():
        out = model.generate(input_ids=given, attention_mask=torch.ones_like(given), **options)
    return out[0, 1:].tolist()


def test_bart_summarizer_equals_transformers() -> None:
    """A BART export with a summarizer's generation_config.json (as distilbart-cnn ships it: 4 beams, length
    penalty 2, no repeated trigram, minimum and maximum lengths, early stopping, bos forced first and eos at
    the last position): a request that gives nothing searches as transformers' generate does, and so does
    one that decodes greedily."""
    pipe = ortpipe.load(seq2seq.get("bart-optimum"), threads=1)
    settings = pipe.config.generation.settings
    assert (settings.num_beams, settings.forced_bos_token_id, settings.forced_eos_token_id) == (4, 1, 2)
    assert pipe.config.tokens.decoder_prompt == (hfmodels.EOS_ID,)
    results = []
    for prompt in PROMPTS[:3]:
        ids = pipe.tokenizer.encode(prompt)
        ours = pipe.generate(prompt_ids=ids)
        assert ours.tokens == hf_bart_generate(ids), prompt
        assert ours.tokens[0] == hfmodels.BOS_ID and ours.tokens[-1] == hfmodels.EOS_ID
        greedy = pipe.generate(prompt_ids=ids, num_beams=1)
        assert greedy.tokens == hf_bart_generate(ids, num_beams=1), prompt
        short = pipe.generate(prompt_ids=ids, num_beams=1, max_new_tokens=5)
        assert short.tokens == hf_bart_generate(ids, num_beams=1, max_new_tokens=5), prompt
        options = {"renormalize_logits": True, "length_penalty": 0.5}
        assert pipe.generate(prompt_ids=ids, **options).tokens == hf_bart_generate(ids, **options), prompt
        results.append((ours.tokens, greedy.tokens))
    assert all(beams != greedy for beams, greedy in results)  # the beams searched


def test_forced_tokens_equal_transformers_on_a_decoder(llama_builder_fp32: Path, llama_hf: Path) -> None:
    """forced_eos_token_id as a request setting on a decoder-only model: the token at the last position the
    length limit allows is the forced one, fused steps or not, as transformers' processor forces it; a
    forced_bos_token_id applies only after a one-token sequence (transformers' rule), so not here."""
    import torch
    from build.references import _hf_model, prompt_ids

    ids = prompt_ids(llama_builder_fp32)
    pipe = ortpipe.load(llama_builder_fp32, threads=1)
    model = _hf_model(str(llama_hf))
    given = torch.tensor([ids])
    for options in ({"forced_eos_token_id": 7}, {"forced_eos_token_id": 7, "forced_bos_token_id": 9},
                    {"forced_eos_token_id": 7, "num_beams": 3, "early_stopping": False}):
        ours = pipe.generate(prompt_ids=ids, max_new_tokens=12, **options)
        with torch.no_grad():
            out = model.generate(input_ids=given, attention_mask=torch.ones_like(given), max_new_tokens=12,
                                 do_sample=False, **options)
        assert ours.tokens == out[0, len(ids):].tolist(), options
        assert ours.tokens[-1] == 7
    with pytest.raises(ortpipe.GenerationError, match="speculative decoding does not force the last token"):
        pipe.generate(prompt_ids=ids, max_new_tokens=4, forced_eos_token_id=7, prompt_lookup_num_tokens=3)


def test_seeded_sampling_repeats_and_follows_the_seed(t5: Pipeline) -> None:
    runs = [t5.generate(PROMPTS[0], max_new_tokens=NEW, do_sample=True, temperature=0.9, seed=s).tokens
            for s in (3, 3, 4)]
    assert runs[0] == runs[1] and runs[0] != runs[2]


def test_what_an_encoder_decoder_request_refuses(t5: Pipeline) -> None:
    with pytest.raises(ortpipe.GenerationError, match='give a prompt: session "encoder" encodes it'):
        t5.generate(max_new_tokens=3)
    with pytest.raises(ortpipe.GenerationError, match="non-empty list"):
        t5.generate(prompt_ids=[], max_new_tokens=3)
    with pytest.raises(ortpipe.GenerationError, match="input_ids is made from the prompt"):
        t5.generate(PROMPTS[0], max_new_tokens=3, inputs={"input_ids": np.array([[5]], dtype=np.int64)})
    with pytest.raises(ortpipe.GenerationError, match="speculative decoding needs"):
        t5.generate(PROMPTS[0], max_new_tokens=3, prompt_lookup_num_tokens=3)


def test_a_prompt_longer_than_the_encoders_positions_is_refused(t5_optimum: Path, tmp_path: Path) -> None:
    folder = Path(shutil.copytree(t5_optimum, tmp_path / "t5"))
    config = json.loads((folder / "config.json").read_text())
    config.update(model_type="bart", max_position_embeddings=4)  # as a BART or Marian folder gives it
    (folder / "config.json").write_text(json.dumps(config))
    pipe = ortpipe.load(folder, threads=1)
    assert pipe.config.pipeline.preprocessing["text"]["max_length"] == 4
    assert pipe.config.generation.max_length == 4
    with pytest.raises(ortpipe.GenerationError, match="encoder reads at most 4"):
        pipe.generate(prompt_ids=[5, 6, 7, 8, 9], max_new_tokens=2)


def test_start_ids_outside_the_vocabulary_are_refused_at_load(t5_optimum: Path, tmp_path: Path) -> None:
    folder = Path(shutil.copytree(t5_optimum, tmp_path / "t5"))
    gen = json.loads((folder / "generation_config.json").read_text())
    (folder / "generation_config.json").write_text(json.dumps({**gen, "forced_decoder_ids": [[1, 99999]]}))
    with pytest.raises(ortpipe.ConfigError, match=r"starts from ids \[0, 99999\] .*forced_decoder_ids\), and "
                                                  "99999 is outside the decoder's vocabulary of 512"):
        ortpipe.load(folder)
    # what is no forced id (a string, a pair without an id, another shape) forces nothing
    (folder / "generation_config.json").write_text(json.dumps({**gen, "forced_decoder_ids": [[1, "x"], 5]}))
    assert ortpipe.load(folder).config.tokens.decoder_prompt == (hfmodels.PAD_ID,)


def test_a_decoder_without_its_encoder_is_refused(t5_optimum: Path, tmp_path: Path) -> None:
    folder = Path(shutil.copytree(t5_optimum, tmp_path / "t5"))
    (folder / "onnx/encoder_model.onnx").unlink()
    words = r"decoder_model_merged.onnx reads an encoder's states \(encoder_hidden_states\), and .* has no "
    with pytest.raises(ortpipe.ConfigError, match=words + "encoder_model.onnx"):
        ortpipe.load(folder)


def test_position_tables_that_bound_nothing_are_left_out(t5_optimum: Path, tmp_path: Path) -> None:
    folder = Path(shutil.copytree(t5_optimum, tmp_path / "t5"))
    config = json.loads((folder / "config.json").read_text())
    for value in ("x", True, -5, 10**12):
        (folder / "config.json").write_text(json.dumps({**config, "model_type": "bart",
                                                        "max_position_embeddings": value}))
        pipe = ortpipe.load(folder, threads=1)
        assert pipe.config.generation.max_length is None and "text" not in pipe.config.pipeline.preprocessing
        assert len(pipe.generate(PROMPTS[1], max_new_tokens=3).tokens) == 3


def test_split_decoders_are_refused_with_the_merge_to_run(t5_optimum: Path, tmp_path: Path) -> None:
    folder = Path(shutil.copytree(t5_optimum, tmp_path / "t5"))
    (folder / "onnx/decoder_model_merged.onnx").rename(folder / "onnx/decoder_model.onnx")
    with pytest.raises(ortpipe.ConfigError, match="has onnx/encoder_model.onnx, onnx/decoder_model.onnx "
                                                  "but no onnx/decoder_model_merged.onnx.*merge_decoders"):
        ortpipe.load(folder)


def test_cli_runs_the_folder_on_a_prompt(t5: Pipeline, t5_optimum: Path) -> None:
    expected = t5.generate(PROMPTS[1], max_new_tokens=8)
    proc = subprocess.run([sys.executable, "-m", "ortpipe.cli", "run", str(t5_optimum), PROMPTS[1],
                           "--max-new-tokens", "8", "--threads", "1", "--json"],
                          capture_output=True, text=True, check=False, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["tokens"] == expected.tokens


def test_whisper_export_equals_transformers_from_features_and_a_wav(whisper_optimum: Path,
                                                                    tmp_path: Path) -> None:
    import transformers

    pipe = ortpipe.load(whisper_optimum, threads=1)
    assert pipe.plan.text_encoder is None  # the encoder reads audio features
    whisper_hf = hfmodels.get("whisper-hf")
    feats = features(0)
    ours = pipe.generate(max_new_tokens=32, inputs={"input_features": feats}).tokens  # from decoder_start
    assert ours == hf_whisper_greedy(whisper_hf, feats, [WHISPER_START_ID], 32)
    path = clip(tmp_path / "a.wav", 2.0, 3)
    from ortpipe.targets.cpython.media import read_wav

    samples = read_wav(str(path), 16000)
    extractor = transformers.WhisperFeatureExtractor(feature_size=WHISPER_MELS)
    heard = extractor(np.asarray(samples, dtype=np.float32), sampling_rate=16000, return_tensors="np")
    assert pipe.generate(max_new_tokens=32, audios=[str(path)]).tokens == \
        hf_whisper_greedy(whisper_hf, heard["input_features"], [WHISPER_START_ID], 32)


def test_served_completions_and_transcriptions(t5: Pipeline, t5_optimum: Path, whisper_optimum: Path,
                                               tmp_path: Path) -> None:
    """`ortpipe serve` on both folders, driven by the openai client: a completion is the encoder's prompt
    answered (its usage counts the prompt's tokens); the Whisper export transcribes a WAV file with no config
    written for it (decoder_start_token_id from generation_config.json)."""
    pytest.importorskip("openai")
    pytest.importorskip("uvicorn")
    from .test_serve import served

    expected = [t5.generate(p, max_new_tokens=10) for p in PROMPTS[:2]]
    with served(t5_optimum, max_batch=4) as server:
        client = server.client()
        for prompt, result in zip(PROMPTS, expected, strict=False):
            got = client.completions.create(model="t5", prompt=prompt, max_tokens=10, temperature=0)
            assert got.choices[0].text == result.text
            usage = (got.usage.prompt_tokens, got.usage.completion_tokens)
            assert usage == (len(t5.tokenizer.encode(prompt)), 10)
    path = clip(tmp_path / "a.wav", 1.5, 4)
    heard = ortpipe.load(whisper_optimum, threads=1).generate(audios=[str(path)])
    with served(whisper_optimum) as server, path.open("rb") as f:
        assert server.client().audio.transcriptions.create(model="whisper", file=f).text == heard.text


def hf_whisper_generate(folder: Path, feats: np.ndarray, new: int, **options: str) -> list[int]:
    """transformers' Whisper generate (WhisperGenerationMixin: its start ids from generation_config.json, the
    request's language and task, the language detected where none is given) of the test Whisper's weights
    with the generation_config.json of `folder`: the new tokens."""
    import torch
    import transformers

    hf = Path(shutil.copytree(hfmodels.get("whisper-hf"), folder.parent / (folder.name + "-hf")))
    shutil.copy(folder / "generation_config.json", hf / "generation_config.json")
    model = transformers.WhisperForConditionalGeneration.from_pretrained(hf, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.generate(input_features=torch.as_tensor(feats), max_new_tokens=new, **options)
    shutil.rmtree(hf)
    return out[0].tolist()


def test_whisper_starts_from_the_ids_generation_config_forces(whisper_optimum: Path, tmp_path: Path) -> None:
    """forced_decoder_ids from index 1 on, while their indices follow each other (an English-only Whisper's
    no-timestamps token; a multilingual one's language and task), follow decoder_start_token_id as the
    decoder's first ids, as transformers' Whisper generate starts; without lang_to_id a null is left out, and
    no_timestamps_token_id ends them."""
    folder = Path(shutil.copytree(whisper_optimum, tmp_path / "whisper"))
    gen = json.loads((folder / "generation_config.json").read_text())
    feats = features(2)
    for forced, prompt in (([[1, 300], [2, 301]], [WHISPER_START_ID, 300, 301]),
                           ([[1, None], [2, 301]], [WHISPER_START_ID, 301]),
                           ([[2, 301]], [WHISPER_START_ID]),
                           ([[1, 301]], [WHISPER_START_ID, 301, 511])):
        quiet = {"no_timestamps_token_id": 511} if len(prompt) == 3 and prompt[-1] == 511 else {}
        config = {**gen, "forced_decoder_ids": forced, **quiet}
        (folder / "generation_config.json").write_text(json.dumps(config))
        pipe = ortpipe.load(folder, threads=1)
        assert pipe.config.tokens.decoder_prompt == tuple(prompt)
        given = {"input_features": feats}
        got = pipe.generate(max_new_tokens=8, inputs=given).tokens
        assert got == pipe.generate(prompt_ids=prompt, max_new_tokens=8, inputs=given).tokens
        assert got == hf_whisper_generate(folder, feats, 8)


MULTILINGUAL = {"lang_to_id": {"<|en|>": 505, "<|fr|>": 506, "<|de|>": 507, "<|es|>": 508},
                "task_to_id": {"transcribe": 509, "translate": 510}, "no_timestamps_token_id": 511,
                "forced_decoder_ids": [[1, None], [2, 509]], "is_multilingual": True}


@pytest.fixture(scope="module")
def multilingual(whisper_optimum: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The test Whisper with a multilingual Whisper's generation_config.json: languages, tasks, the
    no-timestamps token, and forced ids that leave the language to the model (ids at the top of the
    vocabulary, so that transformers takes no generated id for a timestamp)."""
    folder = Path(shutil.copytree(whisper_optimum, tmp_path_factory.mktemp("multilingual") / "whisper"))
    gen = json.loads((folder / "generation_config.json").read_text())
    (folder / "generation_config.json").write_text(json.dumps({**gen, **MULTILINGUAL}))
    return folder


def test_whisper_language_and_task_equal_transformers(multilingual: Path) -> None:
    """A request's language and task take their places in the decoder's start ids; without a language the
    model chooses it (its most likely language id after the start token), as transformers' Whisper generate
    detects it: the tokens equal transformers' for each, greedy and with beams (the language chosen first),
    and the result names the language."""
    pipe = ortpipe.load(multilingual, threads=1)
    tokens = pipe.config.tokens
    assert tokens.decoder_prompt == (WHISPER_START_ID, None, 509, 511)
    assert dict(tokens.languages) == {"en": 505, "fr": 506, "de": 507, "es": 508}
    assert dict(tokens.tasks) == {"transcribe": 509, "translate": 510}
    seen = {}
    for seed in (2, 3, 4):
        feats = features(seed)
        given = {"input_features": feats}
        for options in ({}, {"language": "de"}, {"language": "<|es|>", "task": "translate"},
                        {"task": "translate"}):
            result = pipe.generate(max_new_tokens=8, inputs=given, **options)
            assert result.tokens == hf_whisper_generate(multilingual, feats, 8, **options), options
            if "language" in options:
                assert result.language == options["language"].strip("<|>")
            seen[(seed, tuple(options))] = (result.language, tuple(result.tokens))
        for options in ({}, {"language": "fr"}):  # beam search: the language chosen first, as transformers'
            beams = pipe.generate(max_new_tokens=6, inputs=given, num_beams=2, **options)
            expected = hf_whisper_generate(multilingual, feats, 6, num_beams=2, **options)
            assert beams.tokens == expected, options
            assert beams.language == options.get("language", seen[(seed, ())][0])
        detected = seen[(seed, ())][0]
        assert detected in dict(tokens.languages)
        chosen = pipe.generate(max_new_tokens=8, inputs=given, language=detected).tokens
        assert chosen == list(seen[(seed, ())][1])  # the detected language is the one a request would name
    assert len({tokens for _, tokens in seen.values()}) > 6  # languages and tasks change what is said


def test_served_transcriptions_and_translations_take_the_language(multilingual: Path, tmp_path: Path) -> None:
    """POST /v1/audio/transcriptions with `language` and /v1/audio/translations (the "translate" task),
    driven by the openai client, give pipe.generate's text with the same language and task; the CLI's
    --language and --task give its tokens."""
    import openai

    from .test_serve import served

    path = clip(tmp_path / "a.wav", 2.0, 4)
    pipe = ortpipe.load(multilingual, threads=1)
    expected = {options: pipe.generate(audios=[str(path)], **dict(options))
                for options in ((), (("language", "de"),), (("task", "translate"),))}
    assert len({r.text for r in expected.values()}) == 3
    with served(multilingual) as server, path.open("rb") as f:
        client = server.client()
        for options, result in expected.items():
            f.seek(0)
            given = dict(options)
            if given.get("task") == "translate":
                got = client.audio.translations.create(model="whisper", file=f)
            else:
                got = client.audio.transcriptions.create(model="whisper", file=f, **given)
            assert got.text == result.text, options
        f.seek(0)
        with pytest.raises(openai.BadRequestError, match='language "xx" is not one of this folder'):
            client.audio.transcriptions.create(model="whisper", file=f, language="xx")
        f.seek(0)
        with pytest.raises(openai.BadRequestError, match="Unrecognized request argument supplied: language"):
            client.audio.translations.create(model="whisper", file=f, extra_body={"language": "de"})
    command = ["run", str(multilingual), "--audio", str(path), "--language", "de", "--task", "translate",
               "--max-new-tokens", "8", "--threads", "1", "--json"]
    proc = subprocess.run([sys.executable, "-m", "ortpipe.cli", *command], capture_output=True, text=True,
                          check=False, timeout=300)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["language"] == "de"
    assert out["tokens"] == pipe.generate(audios=[str(path)], max_new_tokens=8, language="de",
                                          task="translate").tokens


def test_whisper_language_and_task_are_refused_where_they_cannot_apply(multilingual: Path,
                                                                       t5: Pipeline) -> None:
    pipe = ortpipe.load(multilingual, threads=1)
    given = {"input_features": features(2)}
    with pytest.raises(ortpipe.GenerationError, match='language "klingon" is not one of this folder.s: en, '
                                                      "fr, de, es"):
        pipe.generate(max_new_tokens=2, inputs=given, language="klingon")
    with pytest.raises(ortpipe.GenerationError, match='task "summarize" is not one of this folder.s: '
                                                      "transcribe, translate"):
        pipe.generate(max_new_tokens=2, inputs=given, task="summarize")
    with pytest.raises(ortpipe.GenerationError, match="which a prompt gives itself: give one or the other"):
        pipe.generate(prompt_ids=[WHISPER_START_ID], max_new_tokens=2, inputs=given, language="fr")
    with pytest.raises(ortpipe.GenerationError, match=r"this folder names no languages \(tokens.languages; "
                                                      r"generation_config.json's lang_to_id\): drop "):
        t5.generate(PROMPTS[0], max_new_tokens=2, language="fr")


def test_language_tables_are_checked_at_load(multilingual: Path, tmp_path: Path) -> None:
    folder = Path(shutil.copytree(multilingual, tmp_path / "w"))
    gen = json.loads((folder / "generation_config.json").read_text())
    (folder / "generation_config.json").write_text(json.dumps({**gen, "lang_to_id": {"<|en|>": 505,
                                                                                      "<|xx|>": 9999}}))
    with pytest.raises(ortpipe.ConfigError, match=r"its languages name ids \(tokens.languages, from "
                                                  r"generation_config.json's lang_to_id\), and 9999 is "):
        ortpipe.load(folder)
    config = {"version": 2, "pipeline": {"extends": "encoder-decoder", "sessions": {
        "encoder": {"file": "encoder_model.onnx"}, "decoder": {"file": "decoder_model_merged.onnx"}}},
        "tokens": {"eos": [2], "decoder_start": [1, None, None]}}
    (folder / "genai_config.json").write_text(json.dumps(config))
    with pytest.raises(ortpipe.ConfigError, match="tokens.decoder_start holds null, the place of a language "
                                                  "id, more than once"):
        ortpipe.load(folder)
    config["tokens"]["decoder_start"] = [1, None]
    (folder / "genai_config.json").write_text(json.dumps(config))
    with pytest.raises(ortpipe.ConfigError, match="and tokens.languages names none"):
        ortpipe.load(folder)


def test_image_captioner_equals_transformers(tmp_path: Path) -> None:
    """A vision encoder-decoder (ViT, GPT-2; optimum's image-to-text-with-past export in transformers.js's
    layout): the image goes through the folder's ViTImageProcessor config to the encoder's pixel_values, and
    the caption is transformers' (its processor's pixels of the same file)."""
    from PIL import Image

    folder, hf = seq2seq.get("captioner-optimum"), seq2seq.get("captioner-hf")
    pipe = ortpipe.load(folder, threads=1)
    assert pipe.plan.text_encoder is None and [s.session for s in pipe.plan.init_steps] == ["encoder"]
    rng = np.random.default_rng(5)
    captions = []
    for i, (h, w) in enumerate(((40, 48), (64, 32), (32, 32))):
        path = tmp_path / f"image{i}.png"
        Image.fromarray((rng.random((h, w, 3)) * 255).astype(np.uint8)).save(path)
        ours = pipe.generate(images=[str(path)], max_new_tokens=12).tokens
        assert ours == seq2seq.hf_caption_greedy(hf, path, 12)
        captions.append(ours)
    assert len({tuple(c) for c in captions}) == 3  # the image decides the caption
    proc = subprocess.run([sys.executable, "-m", "ortpipe.cli", "run", str(folder), "--image", str(path),
                           "--max-new-tokens", "12", "--threads", "1", "--json"],
                          capture_output=True, text=True, check=False, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["tokens"] == captions[-1]
