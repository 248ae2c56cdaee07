"""Images and audio in chat messages through `ortpipe serve`, driven by the official `openai` client: a
vision-language folder and a speech-language one (build/pipeline_graphs.py's Phi-3-vision and speech-language
styles, with a word-level tokenizer and a chat template that renders image and audio parts, as transformers'
processors pass them) answer a message with an image_url part (a base64 PNG) or an input_audio part (a base64
WAV) with the tokens `pipe.generate` makes from the prompt ids the template should give and the same pixels or
samples (the pipelines' media paths are checked against transformers' preprocessing in
test_media_requests.py); what the server does not take is refused naming the part."""

from __future__ import annotations

import base64
import io
import json
from pathlib import Path

import numpy as np
import pytest
from build import pipeline_graphs as pg

openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn")
tokenizers = pytest.importorskip("tokenizers")
Image = pytest.importorskip("PIL.Image")

import ortpipe  # noqa: E402

from .test_serve import served  # noqa: E402

USER, ASSISTANT = 10, 11  # the ids of the template's role words
TEMPLATE = ("{% for m in messages %}{{ m.role }}: {% if m.content is string %}{{ m.content }} {% else %}"
            "{% for p in m.content %}{% if p.type == 'image' %}<image> {% elif p.type == 'audio' %}<audio> "
            "{% else %}{{ p.text }} {% endif %}"
            "{% endfor %}{% endif %}{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}")
CLIP = {"image_processor_type": "CLIPImageProcessor", "do_resize": True, "size": {"shortest_edge": 8},
        "resample": 3, "do_center_crop": True, "crop_size": {"height": 8, "width": 8}, "do_rescale": True,
        "rescale_factor": 1 / 255, "do_normalize": True, "image_mean": [0.48145466, 0.4578275, 0.40821073],
        "image_std": [0.26862954, 0.26130258, 0.27577711]}


WORDS = {pg.BOS: "<s>", pg.EOS: "</s>", pg.IMAGE_TOKEN: "<image>", pg.AUDIO_TOKEN: "<audio>", USER: "user:",
         ASSISTANT: "assistant:"}


def word(i: int) -> str:
    return WORDS.get(i, f"t{i}")


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = pg.phi3v_style(tmp_path_factory.mktemp("vision") / "vlm", seed=0)
    (out / "image_processor.json").write_text(json.dumps(CLIP))
    return chatting(out)


def chatting(out: Path) -> Path:
    """The folder with a word-level tokenizer of its 96 ids and the chat template above."""
    vocab = {word(i): i for i in range(96)}
    tokenizer = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="t3"))
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    tokenizer.decoder = tokenizers.decoders.WordPiece(prefix="##")  # words joined by spaces
    tokenizer.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({"chat_template": TEMPLATE, "bos_token": "<s>",
                                                           "eos_token": "</s>"}))
    return out


def png(pixels: np.ndarray) -> str:
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def test_an_image_in_a_chat_message_gives_the_pipelines_tokens(folder: Path) -> None:
    pixels = np.random.default_rng(0).integers(0, 256, (30, 41, 3), dtype=np.uint8)
    other = np.full((20, 20, 3), 255, np.uint8)
    pipe = ortpipe.load(folder, threads=1)
    ids = [USER, 5, 17, pg.IMAGE_TOKEN, 42, ASSISTANT]  # what the template renders the message to
    expected = pipe.generate(prompt_ids=ids, images=[pixels], max_new_tokens=8, do_sample=False)
    assert expected.tokens != pipe.generate(prompt_ids=ids, images=[other], max_new_tokens=8,
                                            do_sample=False).tokens  # the image decides the tokens
    content = [{"type": "text", "text": "t5 t17"}, {"type": "image_url", "image_url": {"url": png(pixels)}},
               {"type": "text", "text": "t42"}]
    with served(folder) as server:
        client = server.client()
        reply = client.chat.completions.create(model="vlm", messages=[{"role": "user", "content": content}],
                                               max_tokens=8, temperature=0)
        assert reply.choices[0].message.content == expected.text
        assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (len(ids), len(expected.tokens))
        with pytest.raises(openai.BadRequestError, match="Invalid 'prediction'"):
            client.chat.completions.create(model="vlm", messages=[{"role": "user", "content": content}],
                                           max_tokens=2, prediction={"type": "content", "content": "t5"})
        text_only = client.chat.completions.create(  # a folder whose vision step is optional takes text alone
            model="vlm", messages=[{"role": "user", "content": "t5 t17 t42"}], max_tokens=4, temperature=0)
        assert text_only.choices[0].message.content == pipe.generate(
            prompt_ids=[USER, 5, 17, 42, ASSISTANT], max_new_tokens=4, do_sample=False).text

        image = {"type": "image_url", "image_url": {"url": png(pixels)}}
        for messages, param, words in [
            ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "https://x/cat.png"}}]}],
             "messages[0].content[0].image_url.url", "this server fetches nothing"),
            ([{"role": "user", "content": [{"type": "image_url",
                                            "image_url": {"url": "data:image/png;base64,@@"}}]}],
             "messages[0].content[0].image_url.url", "does not decode"),
            ([{"role": "user", "content": [{"type": "image_url",
                                            "image_url": {"url": png(pixels), "detail": "high"}}]}],
             "messages[0].content[0].image_url.detail", "send 'auto'"),
            ([{"role": "system", "content": [image]}, {"role": "user", "content": "t5"}],
             "messages[0].content[0].type", "images (image_url) and audio (input_audio) in user messages"),
            ([{"role": "user", "content": [{"type": "input_audio",
                                            "input_audio": {"data": "", "format": "wav"}}]}],
             "messages", "no session of this pipeline reads input_features or audio_features"),
            ([{"role": "user", "content": [{"type": "image_url",
                                            "image_url": {"url": "data:image/png;base64,aGVsbG8="}}]}],
             "messages", "Invalid image 1 of the messages"),
        ]:
            with pytest.raises(openai.BadRequestError) as error:
                client.chat.completions.create(model="vlm", messages=messages, max_tokens=2)
            body = error.value.body
            assert body["param"] == param and words in body["message"], body


def test_messages_with_image_parts_through_the_library(folder: Path) -> None:
    """The core takes transformers' content parts: the template places the images, one for each part."""
    pixels = np.random.default_rng(0).integers(0, 256, (30, 41, 3), dtype=np.uint8)
    pipe = ortpipe.load(folder, threads=1)
    parts = [{"type": "text", "text": "t5 t17"}, {"type": "image"}, {"type": "text", "text": "t42"}]
    messages = [{"role": "user", "content": parts}]
    got = pipe.generate(messages=messages, images=[pixels], max_new_tokens=8, do_sample=False)
    ids = [USER, 5, 17, pg.IMAGE_TOKEN, 42, ASSISTANT]
    expected = pipe.generate(prompt_ids=ids, images=[pixels], max_new_tokens=8, do_sample=False)
    assert got.tokens == expected.tokens
    two = [{"role": "user", "content": [*parts, {"type": "image"}]}]
    with pytest.raises(ortpipe.GenerationError, match=r'2 \{"type": "image"\} part\(s\) and the request 1'):
        pipe.generate(messages=two, images=[pixels])
    with pytest.raises(ortpipe.GenerationError, match="a list of parts"):
        pipe.generate(messages=[{"role": "user", "content": [{"type": "image", "url": "x"}]}],
                      images=[pixels])


def test_an_image_for_a_folder_that_reads_none_is_refused(tmp_path: Path) -> None:
    import shutil

    shipped = Path(__file__).resolve().parent.parent / "models" / "demo"
    demo = Path(shutil.copytree(shipped, tmp_path / "demo"))
    config = json.loads((demo / "tokenizer_config.json").read_text())
    (demo / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": TEMPLATE}))
    black = png(np.zeros((8, 8, 3), np.uint8))
    content = [{"type": "text", "text": "def"}, {"type": "image_url", "image_url": {"url": black}}]
    with served(demo) as server:
        client = server.client()
        with pytest.raises(openai.BadRequestError) as error:
            client.chat.completions.create(model="demo", max_tokens=2,
                                           messages=[{"role": "user", "content": content}])
        assert error.value.body["param"] == "messages", error.value.body
        assert "no session of this pipeline reads" in error.value.body["message"], error.value.body
        reply = client.chat.completions.create(model="demo", max_tokens=2, messages=[{"role": "user",
                                                                                      "content": "def"}])
        assert reply.choices[0].finish_reason == "length"  # the server goes on


def test_audio_in_a_chat_message_gives_the_pipelines_tokens(tmp_path: Path) -> None:
    import wave

    transformers = pytest.importorskip("transformers")
    out = pg.speech_language_style(tmp_path / "speech", seed=0)
    mels = pg.speech_language_inputs(0).inputs["input_features"].shape[1]
    extractor = transformers.WhisperFeatureExtractor(feature_size=mels, sampling_rate=16000, hop_length=160,
                                                     chunk_length=1, n_fft=400)
    (out / "preprocessor_config.json").write_text(extractor.to_json_string())
    folder = chatting(out)
    clips = []
    for seed in (1, 2):
        path = tmp_path / f"clip{seed}.wav"
        with wave.open(str(path), "wb") as w:
            w.setnchannels(1), w.setsampwidth(2), w.setframerate(16000)
            samples = np.random.default_rng(seed).standard_normal(4000) * (0.1 if seed == 1 else 0.8)
            w.writeframes((np.clip(samples, -1, 1) * 32767).astype("<i2").tobytes())
        clips.append(path)
    pipe = ortpipe.load(folder, threads=1)
    ids = [USER, 5, pg.AUDIO_TOKEN, 42, ASSISTANT]
    expected = pipe.generate(prompt_ids=ids, audios=[str(clips[0])], max_new_tokens=8, do_sample=False)
    assert expected.tokens != pipe.generate(prompt_ids=ids, audios=[str(clips[1])], max_new_tokens=8,
                                            do_sample=False).tokens  # the audio decides the tokens
    data = base64.b64encode(clips[0].read_bytes()).decode()
    audio = {"type": "input_audio", "input_audio": {"data": data, "format": "wav"}}
    content = [{"type": "text", "text": "t5"}, audio, {"type": "text", "text": "t42"}]
    with served(folder) as server:
        client = server.client()
        user = [{"role": "user", "content": content}]
        reply = client.chat.completions.create(model="speech", messages=user, max_tokens=8, temperature=0)
        assert reply.choices[0].message.content == expected.text
        mp3 = [{"type": "input_audio", "input_audio": {"data": data, "format": "mp3"}}]
        with pytest.raises(openai.BadRequestError) as error:
            client.chat.completions.create(model="speech", max_tokens=2,
                                           messages=[{"role": "user", "content": mp3}])
        assert error.value.body["param"] == "messages[0].content[0].input_audio.format"
        noise = [{"type": "input_audio", "input_audio": {"data": "aGVsbG8=", "format": "wav"}}]
        with pytest.raises(openai.BadRequestError, match="Invalid audio 1 of the messages"):
            client.chat.completions.create(model="speech", max_tokens=2,
                                           messages=[{"role": "user", "content": noise}])
