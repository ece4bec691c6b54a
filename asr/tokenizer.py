"""Character and sentencepiece (BPE, unigram) tokenizers with the toolkit's token ids.

Imports nothing of ours but the leaves asr.tokens and asr.fileio.
Ids (DESIGN.md, defined in asr.tokens): BLANK = 0 (CTC), UNK = 1, real tokens from FIRST_TOKEN = 2,
sos = eos = vocab_size - 1. Text given to `encode` is already normalized (asr.metrics).
"""
from __future__ import annotations

import io
import json
import re
from collections import Counter
from collections.abc import Iterable
from pathlib import Path

import sentencepiece as spm

from asr.fileio import atomic_open
from asr.tokens import BLANK, FIRST_TOKEN, UNK, eos_id, sos_id

__all__ = [
    "KINDS",
    "SPACE",
    "CharTokenizer",
    "SentencePieceTokenizer",
    "Tokenizer",
    "load_tokenizer",
    "tokenizer_from_dict",
    "train_tokenizer",
]

SPACE = "\u2581"  # "▁", how the character tokenizer (like sentencepiece) writes the space
KINDS = ("char", "bpe", "unigram")
JSON_FILE = "tokenizer.json"
MODEL_FILE = "tokenizer.model"


class Tokenizer:
    """Base class: text <-> token ids. Stateless once built: `encode` is a pure function (safe in
    DataLoader workers); `count_unknown` reports what it would map to UNK."""

    kind: str

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size  # V: every id, blank, unk and sos/eos included

    @property
    def sos(self) -> int:
        return sos_id(self.vocab_size)

    @property
    def eos(self) -> int:
        return eos_id(self.vocab_size)

    def encode(self, text: str) -> list[int]:
        """Ids in [FIRST_TOKEN, sos) for normalized `text`, UNK for unknown symbols."""
        raise NotImplementedError

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """`encode` of each of `texts` (sentencepiece: in one call, on all its threads)."""
        return [self.encode(text) for text in texts]

    def count_unknown(self, texts: Iterable[str]) -> Counter[str]:
        """Character -> how many times `encode` maps it to UNK over `texts` (normalized);
        empty when every character is known. Run it in the calling process (e.g. once on the
        training text) to report what the tokenizer cannot represent."""
        raise NotImplementedError

    def decode(self, ids: Iterable[int]) -> str:
        """Text of `ids` (a list or a 1-D tensor); blank, unk, sos/eos and ids out of range are
        dropped; white space collapsed."""
        if hasattr(ids, "tolist"):
            ids = ids.tolist()
        return " ".join(self._decode([i for i in ids if FIRST_TOKEN <= i < self.sos]).split())

    def _decode(self, ids: list[int]) -> str:
        raise NotImplementedError

    def piece(self, id: int) -> str:
        """The printable token of `id`: "<blank>", "<unk>", "<sos/eos>" or the piece itself."""
        if not 0 <= id < self.vocab_size:
            raise ValueError(f"token id {id} is outside 0..{self.vocab_size - 1}")
        if id == BLANK:
            return "<blank>"
        if id == UNK:
            return "<unk>"
        return "<sos/eos>" if id == self.sos else self._piece(id)

    def _piece(self, id: int) -> str:
        raise NotImplementedError

    def to_dict(self) -> dict:
        """The model-file form (only str, list, bytes and int: loads with weights_only=True)."""
        raise NotImplementedError

    def save(self, directory: str | Path) -> None:
        """Write directory/tokenizer.json (+ tokenizer.model for sentencepiece), atomically."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        meta = self.to_dict()
        if isinstance(meta.get("model"), bytes):  # sentencepiece: the model beside the JSON
            with atomic_open(directory / MODEL_FILE, "wb") as f:
                f.write(meta["model"])
            meta["model"] = MODEL_FILE
        meta["vocab_size"] = self.vocab_size
        with atomic_open(directory / JSON_FILE) as f:
            f.write(json.dumps(meta, ensure_ascii=False) + "\n")

    def __repr__(self) -> str:
        return f"{type(self).__name__}(kind={self.kind!r}, vocab_size={self.vocab_size})"


class CharTokenizer(Tokenizer):
    """One token per character. `tokens` lists the characters (ids FIRST_TOKEN...); the space may be
    given as " " or SPACE and is stored as SPACE. V = len(tokens) + 3."""

    kind = "char"

    def __init__(self, tokens: list[str]) -> None:
        self.tokens = [SPACE if t == " " else t for t in tokens]
        bad = [t for t in self.tokens if not isinstance(t, str) or len(t) != 1]
        if bad:
            raise ValueError(f"char tokenizer: token {bad[0]!r} is not one character")
        if len(set(self.tokens)) != len(self.tokens):
            raise ValueError("char tokenizer: duplicate tokens")
        super().__init__(FIRST_TOKEN + len(self.tokens) + 1)  # blank, unk, the characters, sos/eos
        self._chars = [" " if t == SPACE else t for t in self.tokens]  # as they appear in text
        self._ids = {c: i for i, c in enumerate(self._chars, FIRST_TOKEN)}

    def encode(self, text: str) -> list[int]:
        return [self._ids.get(c, UNK) for c in text]

    def count_unknown(self, texts: Iterable[str]) -> Counter[str]:
        known = self._ids
        return Counter(c for text in texts for c in text if c not in known)

    def _decode(self, ids: list[int]) -> str:
        return "".join(self._chars[i - FIRST_TOKEN] for i in ids)

    def _piece(self, id: int) -> str:
        return self.tokens[id - FIRST_TOKEN]

    def to_dict(self) -> dict:
        return {"kind": "char", "tokens": list(self.tokens)}


class SentencePieceTokenizer(Tokenizer):
    """A sentencepiece BPE or unigram model with unk id 0 and no bos/eos/pad. Our id = its id + 1
    (its <unk> -> UNK, its pieces -> FIRST_TOKEN...); V = its piece count + 2."""

    def __init__(self, kind: str, model_bytes: bytes) -> None:
        if kind not in ("bpe", "unigram"):
            raise ValueError(f"sentencepiece tokenizer kind {kind!r} is not bpe or unigram")
        self.kind = kind
        self.model_bytes = bytes(model_bytes)
        try:
            self._sp = spm.SentencePieceProcessor(model_proto=self.model_bytes)
        except RuntimeError as e:
            raise ValueError(f"not a sentencepiece model ({_sp_reason(str(e))})") from None
        if self._sp.unk_id() != 0 or max(self._sp.bos_id(), self._sp.eos_id(), self._sp.pad_id()) >= 0:
            raise ValueError("sentencepiece model must have unk id 0 and no bos, eos or pad pieces")
        super().__init__(self._sp.get_piece_size() + 2)

    def encode(self, text: str) -> list[int]:
        return [i + 1 for i in self._sp.encode(text)]

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [[i + 1 for i in ids] for ids in self._sp.encode(texts)]

    def count_unknown(self, texts: Iterable[str]) -> Counter[str]:
        """The characters under sentencepiece's <unk> pieces (a run of unknown characters is one
        piece: each of its characters is counted). Ids first; pieces only for texts with an unk."""
        unknown: Counter[str] = Counter()
        for text in texts:
            if 0 in self._sp.encode(text):
                pieces = self._sp.encode(text, return_type="proto").pieces
                unknown.update("".join(p.surface for p in pieces if p.id == 0))
        return unknown

    def _decode(self, ids: list[int]) -> str:
        return self._sp.decode([i - 1 for i in ids])

    def _piece(self, id: int) -> str:
        return self._sp.id_to_piece(id - 1)

    def to_dict(self) -> dict:
        return {"kind": self.kind, "model": self.model_bytes}


# ---------------------------------------------------------------------------------------------
# training


def train_tokenizer(texts: Iterable[str], kind: str, vocab_size: int | None = None) -> Tokenizer:
    """Train a tokenizer on normalized `texts` (empty ones ignored).

    char: every character seen, the space first, then in code point order; `vocab_size` must be
    None. bpe / unigram: sentencepiece with `vocab_size` pieces (its <unk> included; required),
    trained in memory with bos/eos/pad disabled, identity normalization, character coverage 1.0.
    A vocabulary too large (or too small) for the text is a one-line ValueError giving the limit.
    """
    if kind not in KINDS:
        raise ValueError(f"unknown tokenizer kind {kind!r} (choose from {', '.join(KINDS)})")
    if kind == "char":
        if vocab_size is not None:
            raise ValueError("a char tokenizer takes its vocabulary from the text: give no vocab size")
        chars: set[str] = set()
        for text in texts:
            chars.update(text)
        if not chars - {" "}:
            raise ValueError("no text to train the tokenizer on")
        return CharTokenizer([SPACE, *sorted(chars - {" "})])
    if vocab_size is None:
        raise ValueError(f"a {kind} tokenizer needs a vocab size")
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 1:
        raise ValueError(f"vocab size must be a positive whole number, got {vocab_size!r}")
    model = io.BytesIO()
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=(t for t in texts if t), model_writer=model,
            model_type=kind, vocab_size=vocab_size, bos_id=-1, eos_id=-1, pad_id=-1, unk_id=0,
            normalization_rule_name="identity", character_coverage=1.0,
            max_sentence_length=1 << 20,  # bytes; longer lines would be dropped silently
            minloglevel=2,  # errors only
        )
    except RuntimeError as e:
        raise ValueError(_train_error(str(e), kind, vocab_size)) from None
    return SentencePieceTokenizer(kind, model.getvalue())


def _train_error(message: str, kind: str, vocab_size: int) -> str:
    """sentencepiece's C++ check failure as one line a user can act on."""
    if m := re.search(r"value <= (\d+)", message):
        return f"vocab size {vocab_size} is too large for this text: {kind} allows at most {m[1]}"
    if m := re.search(r"required_chars\. \d+ vs (\d+)", message):
        return (f"vocab size {vocab_size} is too small for this text: {kind} needs at least {m[1]} "
                "(one piece per distinct character, and <unk>)")
    if "sentences_.empty()" in message:
        return "no text to train the tokenizer on"
    return f"sentencepiece training failed: {_sp_reason(message)}"


def _sp_reason(message: str) -> str:
    """The human part of a sentencepiece error: after the "[check]" prefix, on one line."""
    return " ".join(message.rsplit("] ", 1)[-1].split()) or message.strip()


# ---------------------------------------------------------------------------------------------
# loading and saving


def tokenizer_from_dict(d: dict) -> Tokenizer:
    """Rebuild a tokenizer from its `to_dict()` form (as stored in a model file)."""
    kind = d.get("kind") if isinstance(d, dict) else None
    if kind == "char":
        tokens = d.get("tokens")
        if not isinstance(tokens, list):
            raise ValueError("char tokenizer: 'tokens' is not a list")
        return CharTokenizer(tokens)
    if kind in ("bpe", "unigram"):
        if not isinstance(d.get("model"), bytes):
            raise ValueError(f"{kind} tokenizer: 'model' is not sentencepiece model bytes")
        return SentencePieceTokenizer(kind, d["model"])
    raise ValueError(f"unknown tokenizer kind {kind!r} (choose from {', '.join(KINDS)})")


def load_tokenizer(directory: str | Path) -> Tokenizer:
    """Read a tokenizer written by `Tokenizer.save`; errors name the file and the reason."""
    path = Path(directory) / JSON_FILE
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
        if isinstance(meta, dict) and isinstance(meta.get("model"), str):
            if Path(meta["model"]).name != meta["model"]:
                raise ValueError(f"'model' must name a file beside tokenizer.json, got {meta['model']!r}")
            meta["model"] = (path.parent / meta["model"]).read_bytes()
        tokenizer = tokenizer_from_dict(meta)
    except OSError as e:
        raise ValueError(f"{e.filename}: {e.strerror}") from None
    except ValueError as e:  # JSONDecodeError included
        raise ValueError(f"{path}: not a tokenizer ({e})") from None
    if meta.get("vocab_size", tokenizer.vocab_size) != tokenizer.vocab_size:
        raise ValueError(f"{path}: vocab_size {meta['vocab_size']} does not match the tokens ({tokenizer.vocab_size})")
    return tokenizer
