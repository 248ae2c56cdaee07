"""Tokenizers ortpipe runs itself: CLIP's byte-level BPE for folders without a tokenizer.json (vocab.json
+ merges.txt, as diffusers folders have it) and VITS's characters in every VITS folder (vocab.json as
transformers saves a VitsTokenizer, or the vocabulary of transformers.js's converted tokenizer.json).
Pure Python, so both targets give the same ids by construction.

- `ClipTokenizer` follows the tokenizer.json transformers makes of a CLIPTokenizer (what diffusers runs
  with transformers 5): NFC, runs of white space folded to one space, lower case; the special tokens split
  out; CLIP's pre-tokenizer pattern (contractions, runs of letters, single numbers, runs of other
  characters); byte-level BPE by merge rank with `</w>` ending each word.
- `VitsTokenizer` follows transformers' VitsTokenizer without phonemizer or uroman: the vocabulary's entries
  kept as written and other characters lower-cased, characters outside the vocabulary dropped, stripped,
  and (add_blank) the blank id 0 put before, between and after them.
"""

from __future__ import annotations

import unicodedata
from typing import Any

from .errors import ConfigError
from .folder import Folder
from .jsonfile import parse_json

CONTRACTIONS = ("'s", "'t", "'re", "'ve", "'m", "'ll", "'d")  # CLIP's pattern, in its order


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's and CLIP's map of the 256 bytes to printable characters."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    codes = list(keep)
    extra = [byte for byte in range(256) if byte not in keep]
    return dict(zip(keep + extra, map(chr, codes + [256 + i for i in range(len(extra))]), strict=True))


BYTE_CHARS = _bytes_to_unicode()


# Unicode's White_Space characters: what the Rust tokenizers' \\s matches (str.isspace() also takes
# \\x1c-\\x1f)
WHITE_SPACE = frozenset(
    "\t\n\x0b\x0c\r \x85\xa0\u1680\u2000\u2001\u2002\u2003\u2004\u2005\u2006\u2007\u2008"
    "\u2009\u200a\u2028\u2029\u202f\u205f\u3000"
)
SPECIALS = ("<|startoftext|>", "<|endoftext|>")


def clip_normalize(text: str) -> str:
    """NFC, every run of white space one space, lower case (CLIP's tokenizer.json normalizer)."""
    text = unicodedata.normalize("NFC", text)
    out, space = [], False
    for char in text:
        if char in WHITE_SPACE:
            if not space:
                out.append(" ")
            space = True
        else:
            out.append(char)
            space = False
    return "".join(out).lower()


def _kind(char: str) -> str:
    category = unicodedata.category(char)
    return (
        "space"
        if char in WHITE_SPACE
        else "letter"
        if category[0] == "L"
        else "number"
        if category[0] == "N"
        else "other"
    )


def clip_words(text: str) -> list[str]:
    """CLIP's pre-tokenizer: the special tokens, then in the text between them the matches of its pattern
    (contractions, runs of letters, single numbers, runs of other characters), left to right."""
    words: list[str] = []
    for piece in _split_specials(text):
        if piece in SPECIALS:
            words.append(piece)
            continue
        i = 0
        while i < len(piece):
            kind = _kind(piece[i])
            contraction = next((c for c in CONTRACTIONS if piece.startswith(c, i)), None)
            if contraction:
                word = contraction
            elif kind == "space":
                i += 1
                continue
            elif kind == "number":
                word = piece[i]
            else:
                end = i + 1
                while end < len(piece) and _kind(piece[end]) == kind:
                    end += 1
                word = piece[i:end]
            words.append(word)
            i += len(word)
    return words


def _split_specials(text: str) -> list[str]:
    pieces, start, i = [], 0, 0
    while i < len(text):
        special = next((s for s in SPECIALS if text.startswith(s, i)), None)
        if special:
            pieces += [text[start:i], special]
            i = start = i + len(special)
        else:
            i += 1
    return [p for p in [*pieces, text[start:]] if p]


class ClipTokenizer:
    """CLIP's BPE over vocab.json and merges.txt; encode gives [bos, ..., eos] (the Tokenizer protocol)."""

    def __init__(
        self, vocab: dict[str, int], merges: list[tuple[str, str]], config: dict[str, Any], where: str
    ):
        self.vocab = vocab
        self.ranks = {pair: i for i, pair in enumerate(merges)}
        self.words: dict[str, list[str]] = {}
        self.specials = {}
        for key in ("bos_token", "eos_token", "pad_token", "unk_token"):
            token = _token_text(config.get(key))
            if token is not None and token not in vocab:
                raise ConfigError(f"{where}: the {key} {token!r} is not in vocab.json")
            self.specials[key] = vocab.get(token) if token else None
        if self.specials["bos_token"] is None or self.specials["eos_token"] is None:
            raise ConfigError(f"{where}: tokenizer_config.json names no bos_token and eos_token")
        self.bos, self.eos = self.specials["bos_token"], self.specials["eos_token"]
        self.pad_id = self.specials["pad_token"] if self.specials["pad_token"] is not None else self.eos
        self.unk = self.specials["unk_token"]
        self.max_length = _max_length(config)
        self.pad_to_max = True  # CLIP text encoders read a fixed length (diffusers pads to it)
        self.decoder = {i: t for t, i in vocab.items()}
        self.byte_decoder = {c: b for b, c in BYTE_CHARS.items()}

    def _bpe(self, word: str) -> list[str]:
        if word in self.words:
            return self.words[word]
        parts = [*word[:-1], word[-1] + "</w>"]
        while len(parts) > 1:
            pairs = {(a, b) for a, b in zip(parts, parts[1:], strict=False)}
            best = min(pairs, key=lambda p: self.ranks.get(p, len(self.ranks)))
            if best not in self.ranks:
                break
            merged, i = [], 0
            while i < len(parts):
                if i < len(parts) - 1 and (parts[i], parts[i + 1]) == best:
                    merged.append(parts[i] + parts[i + 1])
                    i += 2
                else:
                    merged.append(parts[i])
                    i += 1
            parts = merged
        self.words[word] = parts
        return parts

    def _id(self, token: str) -> int:
        found = self.vocab.get(token, self.unk)
        if found is None:
            raise ConfigError(f"CLIP token {token!r} is not in vocab.json and the tokenizer has no unk_token")
        return found

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = []
        for word in clip_words(clip_normalize(text)):
            if word in SPECIALS and word in self.vocab:
                ids.append(self.vocab[word])
                continue
            ids += [self._id(t) for t in self._bpe("".join(BYTE_CHARS[b] for b in word.encode()))]
        return [self.bos, *ids, self.eos] if add_special_tokens else ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        skip = {self.bos, self.eos, self.pad_id} if skip_special_tokens else set()
        text = "".join(self.decoder.get(i, "") for i in ids if i not in skip)
        data = bytes(self.byte_decoder[c] for c in text if c in self.byte_decoder)
        return data.decode("utf-8", errors="replace").replace("</w>", " ").strip()


class VitsTokenizer:
    """VITS's character vocabulary (vocab.json and tokenizer_config.json)."""

    def __init__(self, vocab: dict[str, int], config: dict[str, Any], where: str):
        for key in ("phonemize", "is_uroman"):
            if config.get(key):
                raise ConfigError(
                    f"{where}: a VITS tokenizer with {key} true needs an external tool (phonemizer, "
                    "uroman); give a tokenizer.json, or text already in the vocabulary's characters"
                )
        self.vocab, self.config = vocab, config
        # normalisation tries the entries in the file's order, as transformers does: by first character
        self.starting: dict[str, list[str]] = {}
        for word in vocab:
            if word:
                self.starting.setdefault(word[0], []).append(word)
        self.pad_id = vocab.get(_token_text(config.get("pad_token")) or "", 0)
        self.max_length = None
        self.pad_to_max = False
        self.decoder = {i: t for t, i in vocab.items()}

    def _normalize(self, text: str) -> str:
        out, i = [], 0
        while i < len(text):
            word = next((w for w in self.starting.get(text[i], ()) if text.startswith(w, i)), None)
            out.append(word if word is not None else text[i].lower())
            i += len(word) if word is not None else 1
        return "".join(out)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if self.config.get("normalize", True):
            text = self._normalize(text)
        if self.config.get("language") == "ron":
            text = text.replace("ț", "ţ")
        ids = [self.vocab[c] for c in "".join(c for c in text if c in self.vocab).strip()]
        if ids and self.config.get("add_blank", True):  # no characters: no ids at all, as transformers gives
            ids = [i for token in ids for i in (0, token)] + [0]
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(self.decoder.get(i, "") for i in ids if not (skip_special_tokens and i == self.pad_id))


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _max_length(config: dict[str, Any]) -> int | None:
    value = config.get("model_max_length")
    return value if isinstance(value, int) and 0 < value < 1 << 20 else None


def _json(folder: Folder, name: str) -> Any:
    return parse_json(folder.read_text(name), folder.describe(name))


def load_vits_tokenizer(folder: Folder, where: str) -> VitsTokenizer | None:
    """The tokenizer of a folder whose tokenizer_config.json names VitsTokenizer, else None: transformers'
    rule (`VitsTokenizer` above) over vocab.json, or, without one, over tokenizer.json's vocabulary.
    transformers.js's converted VITS folders have only the tokenizer.json, whose model is a bare
    vocabulary (tokenizers.js reads it as its legacy model, the Rust tokenizers cannot) and whose
    normalizers restate that rule; the core runs the rule itself, so both targets give transformers' ids."""
    prefix = f"{where}/" if where else ""
    config_file = prefix + "tokenizer_config.json"
    if not folder.exists(config_file):
        return None
    config = _json(folder, config_file)
    if not isinstance(config, dict) or config.get("tokenizer_class") != "VitsTokenizer":
        return None
    found = {}  # file -> its vocabulary
    if folder.exists(prefix + "vocab.json"):
        found[folder.describe(prefix + "vocab.json")] = _json(folder, prefix + "vocab.json")
    if folder.exists(prefix + "tokenizer.json"):
        model = _json(folder, prefix + "tokenizer.json")
        model = model.get("model") if isinstance(model, dict) else None
        found[f"{folder.describe(prefix + 'tokenizer.json')}'s model.vocab"] = (
            model.get("vocab") if isinstance(model, dict) else None
        )
    if not found:
        raise ConfigError(
            f"{folder.describe(config_file)} names VitsTokenizer, and neither vocab.json nor tokenizer.json "
            "is beside it: add the vocab.json transformers saves with the tokenizer"
        )
    for shown, vocab in found.items():
        _check_vocab(vocab, shown)
    (shown, vocab), *others = found.items()
    if others and others[0][1] != vocab:  # one tokenizer read, the other file must not say otherwise
        raise ConfigError(
            f"{shown} and {others[0][0]} map tokens to different ids: keep the files of one tokenizer"
        )
    return VitsTokenizer(vocab, config, shown)


def _check_vocab(vocab: Any, shown: str) -> None:
    if not isinstance(vocab, dict) or not all(
        isinstance(t, str) and isinstance(i, int) and not isinstance(i, bool) for t, i in vocab.items()
    ):
        raise ConfigError(f"{shown} must map tokens to ids (an object of token: integer)")


def load_vocab_tokenizer(folder: Folder, where: str) -> ClipTokenizer | VitsTokenizer | None:
    """The tokenizer of `where` (a folder inside the model folder, "" for its root) from its vocab.json, or
    None
    when it has none."""
    prefix = f"{where}/" if where else ""
    if not folder.exists(prefix + "vocab.json"):
        return None
    vocab = _json(folder, prefix + "vocab.json")
    config = (
        _json(folder, prefix + "tokenizer_config.json")
        if folder.exists(prefix + "tokenizer_config.json")
        else {}
    )
    shown = folder.describe(prefix + "vocab.json")
    _check_vocab(vocab, shown)
    kind = config.get("tokenizer_class") if isinstance(config, dict) else None
    if kind in ("CLIPTokenizer", "CLIPTokenizerFast") or folder.exists(prefix + "merges.txt"):
        if kind not in ("CLIPTokenizer", "CLIPTokenizerFast"):
            raise ConfigError(
                f"{shown} and merges.txt are a {kind or 'byte-level BPE'} tokenizer; without a "
                "tokenizer.json ortpipe reads CLIP's (tokenizer_class CLIPTokenizer)"
            )
        lines = folder.read_text(prefix + "merges.txt").splitlines()
        merges = [tuple(line.split()) for line in lines if line and not line.startswith("#version")]
        if not all(len(m) == 2 for m in merges):
            raise ConfigError(f"{folder.describe(prefix + 'merges.txt')} must hold two tokens a line")
        return ClipTokenizer(vocab, merges, config, shown)
    if "add_blank" in config:  # a VITS tokenizer_config.json that does not name its class
        return VitsTokenizer(vocab, config, shown)
    raise ConfigError(
        f"{shown} has no tokenizer.json beside it, and tokenizer_config.json names a "
        f"{kind or 'tokenizer'} ortpipe does not run from a vocabulary (it runs CLIPTokenizer and "
        "VitsTokenizer): add the tokenizer.json that transformers' fast tokenizer saves"
    )
