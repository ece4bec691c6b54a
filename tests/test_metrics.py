"""Text normalization, WER / CER against hand-counted cases, alignments, reports (the transcript
files `asr wer` reads: tests/test_manifest.py)."""
from __future__ import annotations

import json
import unicodedata

import jiwer
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from asr.metrics import (
    ErrorStats,
    UttErrors,
    format_errors,
    format_summary,
    normalize_text,
    score,
)

# ---------------------------------------------------------------------------------------------
# normalize_text


@pytest.mark.parametrize("text, want", [
    # punctuation and case
    ("Hello, world!", "HELLO WORLD"),
    ('He said: "Stop." (Then left...)', "HE SAID STOP THEN LEFT"),
    ("<unk> [noise] a_b #1 @home 50% $5", "UNK NOISE AB 1 HOME 50 5"),
    # white space
    ("  many   spaces\tand\nnew\r\nlines  ", "MANY SPACES AND NEW LINES"),
    ("a\u00a0b\u2003c", "A B C"),
    # apostrophes: kept only between two letters or digits; curly ones straightened
    ("don't", "DON'T"),
    ("Don\u2019t", "DON'T"),
    ("DON\u2018T", "DON'T"),
    ("don\u02bct", "DON'T"),
    ("'Tis", "TIS"),
    ("James'", "JAMES"),
    ("the 80's", "THE 80'S"),
    ("rock 'n' roll", "ROCK N ROLL"),
    ("\u2018quoted\u2019 'twice'", "QUOTED TWICE"),
    ("o''neil", "O'NEIL"),
    ("x.'y", "XY"),
    ("a-'b", "A B"),
    # hyphens, dashes, slashes
    ("co-op", "CO OP"),
    ("a\u2010b\u2011c\u2012d\u2013e\u2014f\u2015g\u2212h", "A B C D E F G H"),
    ("well--known -- yes", "WELL KNOWN YES"),
    ("and/or a\\b x\u2044y", "AND OR A B X Y"),
    ("co\u00adop", "COOP"),  # soft hyphen: invisible, removed
    # Unicode
    ("caf\u00e9 cafe\u0301", "CAF\u00c9 CAF\u00c9"),  # composed either way
    ("na\u00efve r\u00e9sum\u00e9", "NA\u00cfVE R\u00c9SUM\u00c9"),
    ("\ufb01ne stra\u00dfe", "FINE STRASSE"),  # ligature (NFKC), sharp s upper-cased
    ("\uff21\uff22\uff23\uff11\uff12\uff13", "ABC123"),  # full width
    ("\u0445\u043e\u0440\u043e\u0448\u043e", "\u0425\u041e\u0420\u041e\u0428\u041e"),
    ("\u65e5\u672c\u8a9e\u3002", "\u65e5\u672c\u8a9e"),
    ("\u0939\u093f\u0928\u094d\u0926\u0940", "\u0939\u093f\u0928\u094d\u0926\u0940"),  # vowel signs kept
    ("\U0001f600 smile \u2122", "SMILE TM"),
    # digits
    ("3.5 million in 1999", "35 MILLION IN 1999"),
    ("x\u00b2 \u00bd \u2460", "X2 1 2 1"),
    # empty results
    ("", ""),
    ("   ", ""),
    ("...!?", ""),
    ("'", ""),
])
def test_normalize_text(text, want):
    assert normalize_text(text) == want


_KEPT_CATEGORIES = ("L", "N", "M")


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=40) | st.text(alphabet="ab1 '-\u2019/.,", max_size=20))
def test_normalize_text_is_idempotent_and_clean(text):
    out = normalize_text(text)
    assert normalize_text(out) == out
    assert out == out.strip() and "  " not in out
    assert unicodedata.is_normalized("NFC", out)
    for i, c in enumerate(out):
        if c == "'":  # only inside a word
            assert out[i - 1].isalnum() and out[i + 1].isalnum()
        else:
            assert c == " " or c.isalnum() or unicodedata.category(c)[0] == "M"


# ---------------------------------------------------------------------------------------------
# score


def counts(report):
    s = report.stats
    return s.substitutions, s.deletions, s.insertions, s.words


def test_contract_case():
    report = score({"u1": "A B C D", "u2": "HELLO WORLD"}, {"u1": "A X C", "u2": "HELLO WORLD"})
    assert counts(report) == (1, 1, 0, 6)
    assert report.stats.wer == pytest.approx(2 / 6)
    # characters: "A B C D" vs "A X C": B->X, " D" deleted; spaces between words count
    assert (report.stats.char_errors, report.stats.chars) == (3, 18)
    assert report.stats.cer == pytest.approx(3 / 18)
    u1, u2 = report.utterances
    assert (u1.id, u1.substitutions, u1.deletions, u1.insertions, u1.words, u1.errors) == ("u1", 1, 1, 0, 4, 2)
    assert u1.ops == "CSCD" and u2.ops == "CC" and u2.errors == 0
    assert report.confusions == [("B", "X", 1)]
    assert "33.33%" in format_summary(report.stats)


def test_all_correct():
    report = score({"a": "THE CAT", "b": "SAT"}, {"a": "the cat.", "b": "Sat!"})
    assert counts(report) == (0, 0, 0, 3)
    assert report.stats.wer == 0 and report.stats.cer == 0 and report.confusions == []


def test_insertions_and_deletions():
    report = score({"a": "A B", "b": "C D E"}, {"a": "A X B Y", "b": "D"})
    assert counts(report) == (0, 2, 2, 5)
    assert report.stats.wer == pytest.approx(4 / 5)
    assert [u.ops for u in report.utterances] == ["CICI", "DCD"]


def test_empty_hypothesis_is_all_deletions():
    report = score({"a": "A B C"}, {"a": ""})
    assert counts(report) == (0, 3, 0, 3)
    assert report.stats.wer == 1.0
    assert (report.stats.char_errors, report.stats.chars) == (5, 5)


def test_hypothesis_emptied_by_normalization():
    report = score({"a": "A B"}, {"a": "... !"})
    assert counts(report) == (0, 2, 0, 2)


def test_empty_reference():
    both_empty = score({"a": ""}, {"a": ""})
    assert counts(both_empty) == (0, 0, 0, 0) and both_empty.stats.wer == 0 and both_empty.stats.cer == 0
    # no reference words at all: the rate is the insertion count (errors / max(words, 1))
    only_hyp = score({"a": ""}, {"a": "X Y"})
    assert counts(only_hyp) == (0, 0, 2, 0) and only_hyp.stats.wer == 2.0
    assert only_hyp.utterances[0].ops == "II"
    mixed = score({"a": "A B", "b": ""}, {"a": "A B", "b": "X"})
    assert counts(mixed) == (0, 0, 1, 2) and mixed.stats.wer == 0.5
    assert (mixed.stats.char_errors, mixed.stats.chars) == (1, 3)


def test_id_only_in_reference_counts_as_deletions():
    report = score({"a": "A B", "b": "C D E"}, {"a": "A B"})
    assert counts(report) == (0, 3, 0, 5) and report.stats.utterances == 2
    assert report.utterances[1].hyp == ""


def test_id_only_in_hypothesis_is_an_error():
    with pytest.raises(ValueError, match="'ghost'"):
        score({"a": "A"}, {"a": "A", "ghost": "B"})


def test_normalize_flag():
    refs, hyps = {"a": "Hello, World"}, {"a": "hello   world"}
    assert counts(score(refs, hyps)) == (0, 0, 0, 2)
    assert counts(score(refs, hyps, normalize=False)) == (2, 0, 0, 2)


def test_cer_counts_spaces():
    report = score({"a": "AB CD"}, {"a": "ABCD"})
    assert (report.stats.char_errors, report.stats.chars) == (1, 5)
    assert counts(report) == (1, 1, 0, 2)  # words: AB -> ABCD, CD deleted


def test_totals_agree_with_jiwer():
    refs = {"a": "THE CAT SAT ON THE MAT", "b": "A B C D E F", "c": "ONE TWO THREE"}
    hyps = {"a": "THE CAT SAT ON MAT", "b": "A C C D F F G", "c": "ONE TOO THREE FOUR"}
    report = score(refs, hyps)
    want = jiwer.process_words(list(refs.values()), list(hyps.values()))
    assert counts(report)[:3] == (want.substitutions, want.deletions, want.insertions)
    assert report.stats.wer == pytest.approx(want.wer)
    assert report.stats.cer == pytest.approx(jiwer.cer(list(refs.values()), list(hyps.values())))


def test_confusions_most_frequent_first():
    refs = {"a": "THE CAT SAT", "b": "THE CAT RAN", "c": "A DOG"}
    hyps = {"a": "A CAT SAT", "b": "A CAT RUN", "c": "A FROG"}
    assert score(refs, hyps).confusions == [("THE", "A", 2), ("DOG", "FROG", 1), ("RAN", "RUN", 1)]


def test_to_dict_is_the_wer_json():
    d = score({"u1": "A B C D"}, {"u1": "A X C"}).stats.to_dict(skipped=3)
    for key, kind in [("wer", float), ("cer", float), ("substitutions", int), ("deletions", int),
                      ("insertions", int), ("words", int), ("utterances", int), ("skipped", int)]:
        assert type(d[key]) is kind, key
    assert d["skipped"] == 3 and d["words"] == 4
    assert json.loads(json.dumps(d)) == d


# ---------------------------------------------------------------------------------------------
# reports


def test_alignment_lines():
    u = score({"u1": "A BIG CAT D"}, {"u1": "A X CAT D E"}).utterances[0]
    assert u.alignment() == (
        "REF: A BIG CAT D ***\n"
        "HYP: A X   CAT D E\n"
        "OPS:   S         I"
    )
    # built by hand without ops: the alignment is computed
    assert UttErrors("u1", u.ref, u.hyp, 1, 0, 1, 4).alignment() == u.alignment()
    assert UttErrors("e", "A B", "", 0, 2, 0, 2).alignment() == "REF: A   B\nHYP: *** ***\nOPS: D   D"


def test_format_summary():
    stats = ErrorStats(wer=2 / 6, cer=3 / 18, substitutions=1, deletions=1, insertions=0,
                       words=6, chars=18, char_errors=3, utterances=2)
    assert format_summary(stats) == "WER 33.33% [2 / 6: 1 sub, 1 del, 0 ins] CER 16.67% [3 / 18] over 2 utterances"


def test_format_errors_worst_first():
    refs = {"ok": "A B", "one": "A B", "three": "A B C", "two": "A B"}
    hyps = {"ok": "A B", "one": "A X", "three": "", "two": "X Y"}
    text = format_errors(score(refs, hyps))
    positions = [text.index(f"\n{uid}: ") for uid in ("three", "two", "one", "ok")]
    assert positions == sorted(positions)
    assert text.startswith("WER ") and "three: 3 errors / 3 words" in text
    assert "most frequent substitutions" in text and "A -> X" in text and text.endswith("\n")
