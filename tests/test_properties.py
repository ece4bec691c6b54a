"""Properties over generated inputs (hypothesis): the manifest reader, the tokenizers, WER.

The normalizer's own properties (idempotent, output alphabet) are in test_metrics.py.
"""
from __future__ import annotations

import json
import math

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from asr.manifest import ManifestError, Utterance, read_manifest, write_manifest
from asr.metrics import normalize_text, score
from asr.tokenizer import train_tokenizer
from asr.tokens import FIRST_TOKEN, UNK

SETTINGS = settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])

# ---------------------------------------------------------------------------------------------
# manifests

ids = st.text(min_size=1, max_size=12).filter(lambda s: not any(c.isspace() for c in s))
texts = st.text(max_size=30)  # any Unicode but lone surrogates: quotes, newlines, U+2028 included
seconds = st.floats(min_value=1e-3, max_value=1e5, allow_nan=False, allow_infinity=False)


@st.composite
def utterance(draw, utt_id: str) -> Utterance:
    """An utterance of any valid shape: a whole file or a segment, speed-perturbed or not."""
    audio = "/" + draw(st.text(min_size=1, max_size=20).filter(lambda s: "\0" not in s))
    speed = draw(st.sampled_from([1.0, 0.9, 1.1]))
    speaker = draw(st.none() | ids)
    if not draw(st.booleans()):
        return Utterance(utt_id, audio, draw(seconds), draw(texts), speed=speed, speaker=speaker)
    start = draw(st.floats(min_value=0.0, max_value=100.0))
    end = start + draw(seconds)
    assume(end > start)
    return Utterance(utt_id, audio, (end - start) / speed, draw(texts), start=start or None, end=end, speed=speed,
                     speaker=speaker)


manifests = st.lists(ids, unique=True, max_size=8).flatmap(lambda xs: st.tuples(*map(utterance, xs)))


@settings(SETTINGS, max_examples=40)  # each writes and fsyncs a file
@given(manifests)
def test_manifest_write_read_round_trip(tmp_path, utts):
    path = tmp_path / "m.jsonl"
    write_manifest(utts, path)
    assert read_manifest(path) == list(utts)
    assert len(path.read_bytes().splitlines()) == len(utts)  # one line each, whatever the text holds


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=8,
)
FIELDS = ["id", "audio", "duration", "text", "start", "end", "speed", "speaker"]
objects = st.dictionaries(st.sampled_from(FIELDS) | st.text(max_size=5), json_values, max_size=9)
garbage_lines = (
    st.text(max_size=60).map(lambda s: s.replace("\n", " "))
    | objects.map(lambda o: json.dumps(o, allow_nan=True))
    | objects.map(lambda o: json.dumps(o)[: max(1, len(json.dumps(o)) // 2)])  # cut short
    | st.integers(1, 5000).map(lambda n: "[" * n + "]" * n)
)


@SETTINGS
@given(garbage_lines)
def test_manifest_garbage_line_is_accepted_or_one_line_error_with_its_number(tmp_path, line):
    path = tmp_path / "m.jsonl"
    good = json.dumps({"id": "first", "audio": "/a.wav", "duration": 1.0, "text": ""})
    path.write_text(f"{good}\n{line}\n", encoding="utf-8")
    try:
        utts = read_manifest(path)
    except ManifestError as e:
        message = str(e)
        assert message.startswith(f"{path}:2: ") and "\n" not in message, message
        return
    assert utts[0].id == "first" and len(utts) <= 2  # a line that happened to be valid, or blank
    for u in utts:
        assert u.duration > 0 and math.isfinite(u.duration) and u.speed > 0


# ---------------------------------------------------------------------------------------------
# tokenizers: decode(encode(x)) == x for text in the vocabulary

CORPUS = [normalize_text(t) for t in [
    "the quick brown fox jumps over the lazy dog", "pack my box with five dozen liquor jugs",
    "how vexingly quick daft zebras jump", "sphinx of black quartz judge my vow", "don't stop, it's 1984",
    "ÉTÉ À PARIS", "ÜBER GRÖẞE",
]] * 4


@pytest.fixture(scope="module", params=["char", "bpe", "unigram"])
def trained(request):
    sizes = {"bpe": 70, "unigram": 60}
    return train_tokenizer(CORPUS, request.param, sizes.get(request.param))


@SETTINGS
@given(st.data())
def test_tokenizer_round_trip_of_in_vocabulary_text(trained, data):
    alphabet = sorted(set("".join(CORPUS)) - {" "})
    words = data.draw(st.lists(st.text(alphabet=alphabet, min_size=1, max_size=8), max_size=6))
    text = normalize_text(" ".join(words))
    ids = trained.encode(text)
    assert all(FIRST_TOKEN <= i < trained.sos for i in ids), (text, ids)
    assert trained.decode(ids) == text


@SETTINGS
@given(st.text(max_size=20))
def test_tokenizer_never_fails_on_any_text(trained, text):
    """Anything (unknown scripts, emoji, controls) encodes to valid ids: unknown symbols to UNK."""
    ids = trained.encode(normalize_text(text))
    assert all(i == UNK or FIRST_TOKEN <= i < trained.sos for i in ids)
    assert isinstance(trained.decode(ids), str)


# ---------------------------------------------------------------------------------------------
# WER

sentences = st.lists(st.sampled_from(["A", "B", "C", "DD", "E"]), max_size=7).map(" ".join)
corpora = st.lists(st.tuples(sentences, sentences), min_size=1, max_size=5)


def as_dicts(pairs: list[tuple[str, str]]) -> tuple[dict[str, str], dict[str, str]]:
    return {f"u{i}": r for i, (r, _) in enumerate(pairs)}, {f"u{i}": h for i, (_, h) in enumerate(pairs)}


@settings(max_examples=60, deadline=None)
@given(corpora)
def test_wer_of_identical_texts_is_zero(pairs):
    refs, _ = as_dicts(pairs)
    stats = score(refs, refs).stats
    assert stats.wer == stats.cer == 0.0 and stats.errors == 0 and stats.utterances == len(refs)


@settings(max_examples=60, deadline=None)
@given(corpora)
def test_wer_error_count_is_symmetric(pairs):
    """Swapping the sides keeps the edit distance (how it splits into S, D and I may differ
    between alignments of equal cost) and mirrors deletions minus insertions."""
    refs, hyps = as_dicts(pairs)
    forward, backward = score(refs, hyps).stats, score(hyps, refs).stats
    assert forward.errors == backward.errors and forward.char_errors == backward.char_errors
    assert forward.deletions - forward.insertions == backward.insertions - backward.deletions


@settings(max_examples=60, deadline=None)
@given(corpora)
def test_wer_counts_are_bounded(pairs):
    refs, hyps = as_dicts(pairs)
    report = score(refs, hyps)
    for u in report.utterances:
        n_ref, n_hyp = len(u.ref.split()), len(u.hyp.split())
        assert u.substitutions + u.deletions <= n_ref and u.substitutions + u.insertions <= n_hyp
        assert abs(n_ref - n_hyp) <= u.errors <= max(n_ref, n_hyp)
        assert u.deletions - u.insertions == n_ref - n_hyp
    stats = report.stats
    assert stats.words == sum(len(r.split()) for r in refs.values())
    assert stats.wer == stats.errors / max(stats.words, 1) >= 0.0
    assert 0.0 <= stats.cer and stats.char_errors <= sum(max(len(r), len(h)) for r, h in pairs)



def levenshtein(ref: list[str] | str, hyp: list[str] | str) -> int:
    """Edit distance (substitutions, deletions, insertions, each 1) by dynamic programming over
    the prefixes: written here, independent of jiwer and of asr.metrics."""
    previous = list(range(len(hyp) + 1))  # distance of ref[:0] to each hyp prefix
    for i, r in enumerate(ref, 1):
        current = [i]
        for j, h in enumerate(hyp, 1):
            current.append(min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (r != h)))
        previous = current
    return previous[-1]


def test_levenshtein_by_hand():
    assert levenshtein("KITTEN", "SITTING") == 3 and levenshtein("", "ABC") == levenshtein("ABC", "") == 3
    assert levenshtein("A B".split(), "A X B".split()) == 1 and levenshtein("AB CD", "AB  CD") == 1


# already normalized: upper-case words of a small alphabet, so that words and characters repeat
plain_sentences = st.lists(st.text(alphabet="ABC", min_size=1, max_size=3), max_size=8).map(" ".join)
plain_corpora = st.lists(st.tuples(plain_sentences, plain_sentences), min_size=1, max_size=5)


@settings(max_examples=150, deadline=None)
@given(plain_corpora)
def test_wer_and_cer_equal_an_independent_edit_distance(pairs):
    """Per utterance, S + D + I is the word edit distance and the alignment is a valid one of that
    cost; over the corpus, WER = word distance / reference words and CER = character distance /
    reference characters, the single spaces between words counted as characters (DESIGN.md)."""
    refs, hyps = as_dicts(pairs)
    report = score(refs, hyps)
    for u, (ref, hyp) in zip(report.utterances, pairs):
        assert (u.ref, u.hyp) == (ref, hyp)
        assert u.errors == levenshtein(ref.split(), hyp.split()), (ref, hyp, u)
        assert len(u.ops) - u.ops.count("I") == len(ref.split()) == u.words
        assert len(u.ops) - u.ops.count("D") == len(hyp.split())
        for op, r, h in zip(u.ops, *_aligned(ref.split(), hyp.split(), u.ops)):
            assert (op == "C") == (r == h), (ref, hyp, u.ops)  # C pairs equal words, S different ones
    stats = report.stats
    word_errors = sum(levenshtein(r.split(), h.split()) for r, h in pairs)
    char_errors = sum(levenshtein(r, h) for r, h in pairs)
    words, chars = sum(len(r.split()) for r, _ in pairs), sum(len(r) for r, _ in pairs)
    assert (stats.errors, stats.words, stats.char_errors, stats.chars) == (word_errors, words, char_errors, chars)
    assert stats.wer == pytest.approx(word_errors / max(words, 1))
    assert stats.cer == pytest.approx(char_errors / max(chars, 1))


def _aligned(ref: list[str], hyp: list[str], ops: str) -> tuple[list[str | None], list[str | None]]:
    """The words of each alignment column (None in a gap)."""
    ref_iter, hyp_iter = iter(ref), iter(hyp)
    refs = [None if op == "I" else next(ref_iter) for op in ops]
    hyps = [None if op == "D" else next(hyp_iter) for op in ops]
    return refs, hyps
