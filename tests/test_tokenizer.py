"""Tokenizers: ids of DESIGN.md, round trips, unknown counting, training errors, saving and loading."""
from __future__ import annotations

import io

import pytest
import torch

from asr.metrics import normalize_text
from asr.tokenizer import (
    SPACE,
    CharTokenizer,
    SentencePieceTokenizer,
    load_tokenizer,
    tokenizer_from_dict,
    train_tokenizer,
)
from asr.tokens import BLANK, FIRST_TOKEN, MIN_VOCAB, UNK, eos_id, real_tokens, sos_id

RAW = [
    "He hoped there would be stew for dinner, turnips and carrots and bruised potatoes.",
    "Stuff it into you, his belly counselled him.",
    "After early nightfall the yellow lamps would light up, here and there, the squalid quarter.",
    "Hello Bertie, any good in your mind?",
    "Number ten, fresh nelly is waiting on you; good night husband!",
    "The music came nearer and he recalled the words, the words of Shelley's fragment upon the moon.",
    "We don't know 'tis the 80's co-op and/or the brothel-keeper's house.",
    "Their piety would be like their names, like their faces, like their clothes.",
]
TEXTS = [normalize_text(t) for t in RAW] * 3
SP_SIZE = {"bpe": 80, "unigram": 60}  # sentencepiece pieces, <unk> included


@pytest.fixture(scope="module", params=["char", "bpe", "unigram"])
def tokenizer(request):
    kind = request.param
    return train_tokenizer(TEXTS, kind, SP_SIZE.get(kind))


def test_special_ids(tokenizer):
    V = tokenizer.vocab_size
    assert (BLANK, UNK, FIRST_TOKEN) == (0, 1, 2) and MIN_VOCAB == 4  # DESIGN.md
    assert tokenizer.sos == tokenizer.eos == sos_id(V) == eos_id(V) == V - 1
    assert list(real_tokens(V)) == list(range(2, V - 1))
    assert tokenizer.piece(BLANK) == "<blank>" and tokenizer.piece(UNK) == "<unk>"
    assert tokenizer.piece(V - 1) == "<sos/eos>"
    with pytest.raises(ValueError, match="outside"):
        tokenizer.piece(V)
    if tokenizer.kind == "char":
        assert V == len(tokenizer.tokens) + 3 and tokenizer.piece(FIRST_TOKEN) == SPACE
    else:
        assert V == SP_SIZE[tokenizer.kind] + 2


def test_round_trip(tokenizer):
    for text in set(TEXTS):
        ids = tokenizer.encode(text)
        assert all(FIRST_TOKEN <= i < tokenizer.sos for i in ids), text
        assert tokenizer.decode(ids) == text
    assert tokenizer.count_unknown(TEXTS) == {}
    assert tokenizer.encode("") == [] and tokenizer.decode([]) == ""


def test_decode_drops_specials_and_out_of_range(tokenizer):
    text = TEXTS[0]
    ids = tokenizer.encode(text)
    noisy = [BLANK, *ids[:3], BLANK, UNK, *ids[3:], tokenizer.sos, tokenizer.vocab_size + 5, -1]
    assert tokenizer.decode(noisy) == text
    assert tokenizer.decode(torch.tensor(ids)) == text


def test_unknown_characters_are_counted(tokenizer):
    texts = ["THE \u0416\u0416 \u00c5\u00c5 HE", "HE", "\u00c5"]  # Ж and Å never seen in training
    ids = tokenizer.encode(texts[0])
    assert UNK in ids
    assert tokenizer.decode(ids).split()[0] == "THE"
    assert tokenizer.count_unknown(iter(texts)) == {"\u0416": 2, "\u00c5": 3}


def test_encode_is_pure(tokenizer):
    """No state changes in encode: a counter mutated inside DataLoader workers was lost."""
    before = dict(vars(tokenizer))
    tokenizer.encode("THE \u0416 HE")
    assert vars(tokenizer) == before and not hasattr(tokenizer, "unknown")


def test_to_dict_loads_with_weights_only(tokenizer):
    d = tokenizer.to_dict()
    assert d["kind"] == tokenizer.kind
    buffer = io.BytesIO()
    torch.save({"tokenizer": d}, buffer)
    buffer.seek(0)
    loaded = tokenizer_from_dict(torch.load(buffer, weights_only=True)["tokenizer"])
    assert type(loaded) is type(tokenizer) and loaded.vocab_size == tokenizer.vocab_size
    assert loaded.encode(TEXTS[1]) == tokenizer.encode(TEXTS[1])


def test_save_and_load(tokenizer, tmp_path):
    tokenizer.save(tmp_path / "tok")
    files = sorted(p.name for p in (tmp_path / "tok").iterdir())
    assert files == (["tokenizer.json"] if tokenizer.kind == "char" else ["tokenizer.json", "tokenizer.model"])
    loaded = load_tokenizer(tmp_path / "tok")
    assert (loaded.kind, loaded.vocab_size) == (tokenizer.kind, tokenizer.vocab_size)
    pieces = [tokenizer.piece(i) for i in range(tokenizer.vocab_size)]
    assert [loaded.piece(i) for i in range(loaded.vocab_size)] == pieces
    assert loaded.encode(TEXTS[2]) == tokenizer.encode(TEXTS[2])


def test_char_tokens():
    tok = train_tokenizer(["AB BA", "", "CAB"], "char")
    assert tok.tokens == [SPACE, "A", "B", "C"] and tok.vocab_size == 7
    assert tok.encode("AB C") == [3, 4, 2, 5]
    assert CharTokenizer([" ", "A"]).tokens == [SPACE, "A"]  # the space may be given as " "
    with pytest.raises(ValueError, match="duplicate"):
        CharTokenizer([" ", SPACE])
    with pytest.raises(ValueError, match="one character"):
        CharTokenizer(["AB"])


@pytest.mark.parametrize("kind", ["bpe", "unigram"])
def test_vocab_too_large_is_one_line_error(kind):
    with pytest.raises(ValueError, match=r"too large .* at most \d+") as info:
        train_tokenizer(TEXTS, kind, 5000)
    assert "\n" not in str(info.value)
    limit = int(str(info.value).rsplit(" ", 1)[-1])
    assert train_tokenizer(TEXTS, kind, limit).vocab_size == limit + 2


def test_vocab_too_small_is_one_line_error():
    with pytest.raises(ValueError, match=r"too small .* at least \d+"):
        train_tokenizer(TEXTS, "bpe", 5)


@pytest.mark.parametrize("texts, kind, size, message", [
    (TEXTS, "wordpiece", None, "unknown tokenizer kind"),
    (TEXTS, "bpe", None, "needs a vocab size"),
    (TEXTS, "char", 50, "give no vocab size"),
    (TEXTS, "bpe", 0, "vocab size must be a positive whole number, got 0"),
    (TEXTS, "unigram", -5, "vocab size must be a positive whole number, got -5"),
    (["", ""], "bpe", 50, "no text"),
    (["", ""], "char", None, "no text"),
])
def test_training_errors(texts, kind, size, message):
    with pytest.raises(ValueError, match=message):
        train_tokenizer(texts, kind, size)


def test_training_is_deterministic():
    a = train_tokenizer(TEXTS, "bpe", 60)
    b = train_tokenizer(TEXTS, "bpe", 60)
    assert a.to_dict() == b.to_dict()


def test_bad_inputs(tmp_path):
    with pytest.raises(ValueError, match="tokenizer.json"):
        load_tokenizer(tmp_path / "absent")
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ValueError, match="tokenizer.json: not a tokenizer"):
        load_tokenizer(tmp_path)
    with pytest.raises(ValueError, match="unknown tokenizer kind"):
        tokenizer_from_dict({"kind": "words"})
    with pytest.raises(ValueError, match="not a sentencepiece model"):
        SentencePieceTokenizer("bpe", b"garbage")
