"""The torch side of build/musicgen.py: the tiny random MusicGen and transformers' references.

    <venv>/bin/python -m build.musicgen_torch make|refs SPEC.json
`make` runs in the export environment (transformers 4.57): a MusicgenForConditionalGeneration of tiny random
parts (T5 text encoder, decoder over 4 codebooks, EnCodec with random codebooks: PITFALLS) and a word-level
tokenizer that appends </s> as T5's does. `refs` runs in the reference environment (transformers 5): greedy
`generate` per guidance scale, the codes EnCodec decodes and the audio.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

SEED = 0


def make(spec: dict) -> None:
    import torch
    import transformers
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors

    out = Path(spec["out"])
    out.mkdir(parents=True, exist_ok=True)
    vocab = {"<pad>": 0, "</s>": 1, "<unk>": 2, **{w: 3 + i for i, w in enumerate(spec["words"])}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 1)])
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>",
                                         unk_token="<unk>").save_pretrained(out)
    config = transformers.MusicgenConfig.from_sub_models_config(
        transformers.T5Config(vocab_size=len(vocab), **spec["text_encoder"]),
        transformers.EncodecConfig(**spec["audio_encoder"]),
        transformers.MusicgenDecoderConfig(**spec["decoder"]))
    torch.manual_seed(SEED)
    model = transformers.MusicgenForConditionalGeneration(config)
    gen = torch.Generator().manual_seed(SEED)
    with torch.no_grad():
        for _, param in sorted(model.named_parameters()):
            if param.ndim == 1:  # norms and biases start constant
                param.add_(0.1 * torch.randn(param.shape, generator=gen))
        for name, buffer in sorted(model.named_buffers()):
            if name.endswith("codebook.embed"):  # zeros at init: every code would decode alike
                buffer.copy_(torch.randn(buffer.shape, generator=gen))
            elif name.endswith("codebook.inited"):
                buffer.fill_(1.0)
    model.generation_config = transformers.GenerationConfig(**spec["generation"])
    model.save_pretrained(out, safe_serialization=True)


def refs(spec: dict) -> None:
    import numpy as np
    import torch
    import transformers

    hf, out = spec["hf"], Path(spec["out"])
    model, info = transformers.MusicgenForConditionalGeneration.from_pretrained(hf, output_loading_info=True)
    bad = {k: v for k, v in info.items() if k in ("missing_keys", "unexpected_keys", "mismatched_keys") and v}
    if bad:
        raise RuntimeError(f"MusicGen did not load exactly: {bad}")
    model.eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(hf)
    seen = []
    decode = model.audio_encoder.decode

    def keep(codes, *args, **kwargs):  # the codes generate hands EnCodec
        seen.append(codes.clone())
        return decode(codes, *args, **kwargs)

    model.audio_encoder.decode = keep
    out.mkdir(parents=True, exist_ok=True)
    cases = []
    for i, case in enumerate(spec["cases"]):
        encoded = tokenizer([case["prompt"]], return_tensors="pt")
        with torch.no_grad():
            audio = model.generate(**encoded, do_sample=False, guidance_scale=case["guidance_scale"],
                                   max_new_tokens=case["max_new_tokens"])
        np.save(out / f"audio_{i}.npy", audio.numpy().astype(np.float32))
        cases.append({**case, "input_ids": encoded["input_ids"][0].tolist(), "codes": seen[-1][0].tolist(),
                      "audio": f"audio_{i}.npy"})
    (out / "cases.json").write_text(json.dumps({"cases": cases}, indent=1) + "\n")


if __name__ == "__main__":
    {"make": make, "refs": refs}[sys.argv[1]](json.loads(Path(sys.argv[2]).read_text()))
