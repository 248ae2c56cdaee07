"""Tiny random encoder-decoder models in optimum's export layout, with transformers' references.

    python -m build.seq2seq t5-optimum whisper-optimum     # builds (once; cached like build/hfmodels.py)

- `t5-hf`: a T5ForConditionalGeneration of random weights (2 + 2 layers, hidden 64) over the test tokenizer
  (build/hfmodels.py's byte-level BPE), saved by transformers 5.
- `t5-optimum`: its text2text-generation-with-past export by optimum in transformers.js's layout: the
  graphs in `onnx/` (`encoder_model.onnx`, `decoder_model_merged.onnx`), config.json,
  generation_config.json and the tokenizer beside them; no genai_config.json.
- `captioner-hf`, `captioner-optimum`: a VisionEncoderDecoderModel (ViT encoder, GPT-2 decoder) and its
  image-to-text-with-past export in transformers.js's layout, with its ViTImageProcessor config.
- `bart-hf`, `bart-optimum`: a BartForConditionalGeneration of random weights and its text2text-generation-
  with-past export in transformers.js's layout, with a summarizer's generation_config.json (beams, a length
  penalty, n-gram bans, minimum and maximum lengths, forced bos and eos tokens), as distilbart-cnn ships it.
- `whisper-optimum`: build/hfmodels.py's `whisper-hf` exported by optimum for automatic-speech-recognition-
  with-past, in optimum's own flat layout, with the preprocessor_config.json of WhisperFeatureExtractor
  (80 mels) that a Whisper folder ships.

optimum runs in build/hfmodels.py's Optimum virtualenv (transformers 4.57), which reads the saved config.json
in its legacy keys. The references (`hf_t5_greedy`) run transformers 5 on the saved weights.
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
from pathlib import Path

from build import hfmodels

# random weights make a decoder repeat one token whatever the text: sharper relative-position biases,
# a larger final norm and smaller embeddings make the tokens follow the prompt and the position
T5 = {"d_model": hfmodels.HIDDEN, "d_kv": 16, "d_ff": 128, "num_layers": 2, "num_decoder_layers": 2,
      "num_heads": 4, "relative_attention_num_buckets": 32, "relative_attention_max_distance": 128,
      "dropout_rate": 0.0, "feed_forward_proj": "gated-gelu"}
# the logits are the last norm's output times d_model ** -0.5 (T5's tied head, in transformers 4 and 5 alike)
BIAS_GAIN, LOGIT_GAIN, EMBED_GAIN = 30.0, 64.0, 0.5
KEEP = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
        "special_tokens_map.json", "preprocessor_config.json")
IMAGE_SIDE = 32  # the captioner's ViT: 32 x 32 pixels in patches of 8
GRAPHS = ("encoder_model.onnx", "decoder_model_merged.onnx")


def make_t5_hf(out: Path, seed: int = 0) -> Path:
    import torch
    import transformers

    hfmodels.train_tokenizer(out)
    vocab = json.loads((out / "tokenizer.json").read_text())["model"]["vocab"]
    pad, eos = hfmodels.PAD_ID, hfmodels.EOS_ID
    config = transformers.T5Config(vocab_size=len(vocab), pad_token_id=pad, eos_token_id=eos,
                                   decoder_start_token_id=pad, **T5)
    torch.manual_seed(seed)
    model = transformers.T5ForConditionalGeneration(config).to(torch.float32)
    hfmodels._redraw(model, seed)
    with torch.no_grad():
        for stack in (model.encoder, model.decoder):
            stack.block[0].layer[0].SelfAttention.relative_attention_bias.weight.mul_(BIAS_GAIN)
        model.decoder.final_layer_norm.weight.mul_(LOGIT_GAIN)
        model.shared.weight.mul_(EMBED_GAIN)
        model.shared.weight[eos] = 0.0  # tied to the head: eos is never likely, and runs go to length
    model.generation_config = transformers.GenerationConfig(decoder_start_token_id=pad, eos_token_id=eos,
                                                            pad_token_id=pad, do_sample=False)
    model.save_pretrained(out, safe_serialization=True)
    return out


BART = {"d_model": hfmodels.HIDDEN, "encoder_layers": 2, "decoder_layers": 2, "encoder_attention_heads": 4,
        "decoder_attention_heads": 4, "encoder_ffn_dim": 128, "decoder_ffn_dim": 128,
        "max_position_embeddings": 128, "dropout": 0.0, "attention_dropout": 0.0, "activation_dropout": 0.0}
# a summarizer's search (distilbart-cnn's keys, smaller lengths): transformers' generate applies each
SUMMARIZER = {"num_beams": 4, "length_penalty": 2.0, "no_repeat_ngram_size": 3, "min_length": 8,
              "max_length": 30, "early_stopping": True}


def make_bart_hf(out: Path, seed: int = 0) -> Path:
    """A BART summarizer of random weights over the test tokenizer: the decoder starts from eos, forces bos
    first and eos at the last position (BART's forced_bos_token_id and forced_eos_token_id)."""
    import torch
    import transformers

    hfmodels.train_tokenizer(out)
    vocab = json.loads((out / "tokenizer.json").read_text())["model"]["vocab"]
    bos, eos, pad = hfmodels.BOS_ID, hfmodels.EOS_ID, hfmodels.PAD_ID
    tokens = {"bos_token_id": bos, "eos_token_id": eos, "pad_token_id": pad, "decoder_start_token_id": eos,
              "forced_bos_token_id": bos, "forced_eos_token_id": eos}
    config = transformers.BartConfig(vocab_size=len(vocab), **tokens, **BART)
    torch.manual_seed(seed)
    model = transformers.BartForConditionalGeneration(config).to(torch.float32)
    hfmodels._redraw(model, seed)
    model.generation_config = transformers.GenerationConfig(**tokens, **SUMMARIZER)
    model.save_pretrained(out, safe_serialization=True)
    return out


def make_captioner_hf(out: Path, seed: int = 0) -> Path:
    """A VisionEncoderDecoderModel (a ViT encoder, a GPT-2 decoder with cross-attention) of random weights,
    its ViTImageProcessor and the test tokenizer: an image captioner of the shape transformers.js's
    image-to-text pipeline runs (vit-gpt2-image-captioning)."""
    import torch
    import transformers

    hfmodels.train_tokenizer(out)
    vocab = json.loads((out / "tokenizer.json").read_text())["model"]["vocab"]
    bos, eos, pad = hfmodels.BOS_ID, hfmodels.EOS_ID, hfmodels.PAD_ID
    encoder = transformers.ViTConfig(hidden_size=hfmodels.HIDDEN, num_hidden_layers=2, num_attention_heads=4,
                                     intermediate_size=128, image_size=IMAGE_SIDE, patch_size=8)
    decoder = transformers.GPT2Config(vocab_size=len(vocab), n_embd=hfmodels.HIDDEN, n_layer=2, n_head=4,
                                      n_inner=128, n_positions=128, add_cross_attention=True, is_decoder=True,
                                      bos_token_id=bos, eos_token_id=eos, pad_token_id=pad)
    config = transformers.VisionEncoderDecoderConfig.from_encoder_decoder_configs(encoder, decoder)
    config.decoder_start_token_id, config.pad_token_id, config.eos_token_id = bos, pad, eos
    torch.manual_seed(seed)
    model = transformers.VisionEncoderDecoderModel(config).to(torch.float32)
    hfmodels._redraw(model, seed)
    with torch.no_grad():
        model.decoder.lm_head.weight[eos] = 0.0  # never eos: runs to length
    model.generation_config = transformers.GenerationConfig(
        decoder_start_token_id=bos, bos_token_id=bos, eos_token_id=eos, pad_token_id=pad, do_sample=False)
    model.save_pretrained(out, safe_serialization=True)
    transformers.ViTImageProcessor(size={"height": IMAGE_SIDE, "width": IMAGE_SIDE}).save_pretrained(out)
    return out


def _export(hf: Path, out: Path, task: str, graphs_in: str) -> Path:
    python = hfmodels.ensure_optimum_venv()
    with tempfile.TemporaryDirectory(prefix="ortpipe-seq2seq-") as scratch:
        legacy, onnx = Path(scratch) / "hf", Path(scratch) / "onnx"
        shutil.copytree(hf, legacy)
        config = hfmodels._legacy_config(json.loads((legacy / "config.json").read_text()))
        for part in ("encoder", "decoder"):  # a VisionEncoderDecoder's own configs
            if isinstance(config.get(part), dict):
                config[part] = hfmodels._legacy_config(config[part])
        (legacy / "config.json").write_text(json.dumps(config, indent=2))
        hfmodels._run([str(python), "-m", "optimum.exporters.onnx", "--model", str(legacy), "--task", task,
                       str(onnx)], f"optimum export ({task})")
        (out / graphs_in).mkdir(parents=True, exist_ok=True)
        for name in KEEP:
            if (onnx / name).is_file():
                shutil.copy2(onnx / name, out / name)
        for name in GRAPHS:
            shutil.copy2(onnx / name, out / graphs_in / name)
    return out


def make_t5_optimum(out: Path) -> Path:
    return _export(get("t5-hf"), out, "text2text-generation-with-past", "onnx")


def make_bart_optimum(out: Path) -> Path:
    return _export(get("bart-hf"), out, "text2text-generation-with-past", "onnx")


def make_whisper_optimum(out: Path) -> Path:
    import transformers

    _export(hfmodels.get("whisper-hf"), out, "automatic-speech-recognition-with-past", "")
    extractor = transformers.WhisperFeatureExtractor(feature_size=hfmodels.WHISPER_MELS)
    extractor.save_pretrained(out)  # preprocessor_config.json
    return out


def make_captioner_optimum(out: Path) -> Path:
    hf = get("captioner-hf")
    _export(hf, out, "image-to-text-with-past", "onnx")
    shutil.copy2(hf / "preprocessor_config.json", out / "preprocessor_config.json")
    return out


RECIPES = {"t5-hf": make_t5_hf, "t5-optimum": make_t5_optimum, "whisper-optimum": make_whisper_optimum,
           "captioner-hf": make_captioner_hf, "captioner-optimum": make_captioner_optimum,
           "bart-hf": make_bart_hf, "bart-optimum": make_bart_optimum}


def get(name: str) -> Path:
    recipe = Path(__file__).read_text(encoding="utf-8") + "".join(hfmodels.OPTIMUM_REQUIREMENTS)
    return hfmodels.cached(name, RECIPES[name], recipe=recipe)


def hf_t5_greedy(hf_dir: Path, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """transformers' greedy generate of the T5 on the encoder ids `prompt_ids`: the new tokens (the decoder
    start token left out)."""
    import torch
    import transformers

    model = transformers.T5ForConditionalGeneration.from_pretrained(hf_dir, dtype=torch.float32).eval()
    ids = torch.tensor([prompt_ids], dtype=torch.int64)
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False, num_beams=1,
                             max_new_tokens=max_new_tokens)
    return out[0, 1:].tolist()


def hf_caption_greedy(hf_dir: Path, image: Path, max_new_tokens: int) -> list[int]:
    """transformers' greedy generate of the captioner on the pixels its own ViTImageProcessor makes of the
    image file (PIL's bilinear resize): the new tokens."""
    import torch
    import transformers
    from PIL import Image

    processor = transformers.ViTImageProcessor.from_pretrained(hf_dir)
    with Image.open(image) as picture:
        pixels = processor(picture.convert("RGB"), return_tensors="pt")["pixel_values"]
    model = transformers.VisionEncoderDecoderModel.from_pretrained(hf_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.generate(pixel_values=pixels, do_sample=False, num_beams=1, max_new_tokens=max_new_tokens)
    return out[0, 1:].tolist()


if __name__ == "__main__":
    for name in sys.argv[1:] or list(RECIPES):
        print(get(name))
