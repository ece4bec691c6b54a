"""eSpeak NG's word events as the synth recipe records them (recipes/synth/local/synthesize.py),
carried to seconds of the written FLAC, and tools/word_timing_check.py's matching and statistics."""
from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "recipes" / "synth" / "local"))  # recipe helpers and tools are scripts
sys.path.insert(0, str(ROOT / "tools"))

import synthesize  # noqa: E402
import word_timing_check as wtc  # noqa: E402
from synthesize import Utt, WordEvent  # noqa: E402

SENTENCES = ("THE QUICK BROWN FOX JUMPED OVER SEVEN LAZY DOGS",
             "NATHAN SHOULD HAVE LENT THE GATE IN THE EVENING",
             "IT ISN'T TOO DRY TO GO OUT EVERY WINTER")


def utt(text: str, voice: str = "en-us", lead: float = 0.2, tail: float = 0.1, wpm: int = 175) -> Utt:
    return Utt(id="dev-000000", split="dev", text=text, voice=voice, wpm=wpm, pitch=50, pitch_range=50,
               volume=100, lead=lead, tail=tail, snr_db=40.0)


@pytest.fixture(scope="module")
def engine() -> synthesize.ESpeak:
    return synthesize.ESpeak()


# --- the events of real synthesis ----------------------------------------------------------------------


@pytest.mark.parametrize("voice, wpm", [("en-us", 175), ("en-gb-scotland+f2", 130), ("en-029+klatt", 200)])
def test_rendered_words_are_in_order_inside_the_audio_and_cover_most_words(engine, voice, wpm):
    resampler = synthesize.Resampler(engine.sample_rate, synthesize.SAMPLE_RATE)
    timed = total = 0
    for text in SENTENCES:
        u = utt(text, voice, wpm=wpm)
        samples, words = synthesize.render(u, engine, resampler)
        duration = len(samples) / synthesize.SAMPLE_RATE
        indices, starts = [w["index"] for w in words], [w["start"] for w in words]
        assert indices == sorted(set(indices)) and all(w["word"] == text.split()[w["index"]] for w in words)
        assert all(a < b for a, b in zip(starts, starts[1:])), words
        assert u.lead - 1e-9 <= starts[0] and starts[-1] < duration - u.tail
        if "'" not in text:  # short words run into the next may have no event ("SHOULD HAVE", "IN THE")
            assert len(words) > 0.5 * len(text.split()), (voice, text, words)
            timed, total = timed + len(words), total + len(text.split())
        else:  # ISN'T has its event (its span stops at the apostrophe)
            assert 1 in indices, (voice, text, words)
    assert timed >= 0.8 * total


def test_positions_restart_at_every_call(engine):
    """eSpeak NG 1.52 keeps no count between calls: the same text gives the same positions first,
    after another text and again (so nothing cumulative needs subtracting)."""
    first = engine.speak("hello there my friend.", "en-us")
    engine.speak(SENTENCES[0].lower() + ". " + SENTENCES[1].lower() + ".", "en-gb-scotland")
    again = engine.speak("hello there my friend.", "en-us")
    assert [w.text_position for w in first.words] == [w.text_position for w in again.words] == [1, 7, 13, 16]
    assert first.words[0].sample == again.words[0].sample == 0
    assert [w.sample for w in first.words] == pytest.approx([w.sample for w in again.words], abs=50)
    assert all(0 <= w.sample <= len(again.samples) for w in again.words)


def test_a_second_sentence_in_one_call_keeps_counting(engine):
    """Positions are of the whole call: a text of two sentences gives the second sentence's words
    after the first's, in characters and in samples (the second's first word pointed at the space
    before it)."""
    text = "one two three. four five six."
    speech = engine.speak(text, "en-us")
    words = synthesize.word_starts("ONE TWO THREE FOUR FIVE SIX", text, speech.words, engine.sample_rate, 0.0,
                                   len(speech.samples))
    assert [w["word"] for w in words] == ["ONE", "TWO", "THREE", "FOUR", "FIVE", "SIX"]
    assert all(a["start"] < b["start"] for a, b in zip(words, words[1:]))


# --- the mapping to seconds of the FLAC ------------------------------------------------------------------


class ClickEngine:
    """A stand-in for ESpeak: silence with a click where each event says its word starts."""

    sample_rate = 22050

    def __init__(self, samples: int, events: list[WordEvent]) -> None:
        self.events = events
        self.samples = np.zeros(samples, np.int16)
        for e in events:
            self.samples[e.sample] = 20000

    def speak(self, text: str, *_: object) -> synthesize.Speech:
        return synthesize.Speech(self.samples, tuple(self.events))


@pytest.mark.parametrize("lead", [0.0, 0.123, 0.3])
def test_word_starts_land_on_their_sound_after_resampling_and_the_lead_silence(lead):
    """The clicks at the events' samples (22.05 kHz) are where the recorded starts say in the
    FLAC's samples (16 kHz, after the lead silence, under noise): within one output sample."""
    events = [WordEvent(1, 3, 1000), WordEvent(5, 5, 7777), WordEvent(11, 5, 15001), WordEvent(17, 3, 30011)]
    engine = ClickEngine(33000, events)
    u = utt("THE QUICK BROWN FOX", lead=lead, tail=0.05)
    samples, words = synthesize.render(u, engine, synthesize.Resampler(22050, synthesize.SAMPLE_RATE))
    assert [w["word"] for w in words] == ["THE", "QUICK", "BROWN", "FOX"]
    lead_frames = round(lead * synthesize.SAMPLE_RATE)
    assert len(samples) == lead_frames + int(np.ceil(33000 * 16000 / 22050)) + round(0.05 * 16000)
    for w in words:
        at = w["start"] * synthesize.SAMPLE_RATE
        window = np.abs(samples[int(at) - 30:int(at) + 30].astype(np.float64))
        assert abs(int(at) - 30 + np.argmax(window) - at) <= 1.0, w
    assert words[0]["start"] == pytest.approx(lead_frames / 16000 + 1000 / 22050, abs=1e-4)


def test_word_starts_map_character_positions_to_manifest_words():
    text = "DON'T PANIC ÉTIENNE SAID A B"
    spoken = text.lower() + "."
    events = (WordEvent(1, 3, 0),       # "don" of "don't"
              WordEvent(5, 1, 100),     # "t" of "don't": a second event of a word is dropped
              WordEvent(7, 5, 200),     # "panic"
              WordEvent(12, 1, 250),    # the space before "étienne": its event
              WordEvent(13, 7, 300),    # "étienne" (positions are characters, not bytes): a second event
              WordEvent(21, 4, 240),    # "said" before the previous word's sample: dropped
              WordEvent(28, 1, 400),    # "b."
              WordEvent(40, 2, 500))    # past the text
    words = synthesize.word_starts(text, spoken, events, 100, 1.5, 1000)
    assert words == [{"index": 0, "word": "DON'T", "start": 1.5}, {"index": 1, "word": "PANIC", "start": 3.5},
                     {"index": 2, "word": "ÉTIENNE", "start": 4.0}, {"index": 5, "word": "B", "start": 5.5}]
    late = synthesize.word_starts("A B", "a b.", (WordEvent(1, 1, 10), WordEvent(3, 1, 2000)), 100, 0.0, 1000)
    assert late == [{"index": 0, "word": "A", "start": 0.1}]  # an event beyond the call's audio is dropped


def test_kept_files_keep_or_respeak_their_word_starts(tmp_path, capsys):
    """A rerun keeps the words file's entries of kept FLACs; a corpus made before the words files
    has them re-spoken, the same as when made (FLACs and manifests untouched)."""
    num = {"train": 1, "dev": 1, "test": 1}
    synthesize.synthesize_corpus(tmp_path, num, seed=2, jobs=1, lm_count=0, lm_clause_count=0)
    made = {s: (tmp_path / f"{s}_words.jsonl").read_text() for s in synthesize.SPLITS}
    flacs = {p: p.read_bytes() for p in tmp_path.glob("wav/*/*.flac")}
    for s in synthesize.SPLITS:
        (tmp_path / f"{s}_words.jsonl").unlink()
    capsys.readouterr()
    synthesize.synthesize_corpus(tmp_path, num, seed=2, jobs=1, lm_count=0, lm_clause_count=0)
    assert "0 made, 3 kept (3 re-spoken for their word starts)" in capsys.readouterr().err
    again = {s: (tmp_path / f"{s}_words.jsonl").read_text() for s in synthesize.SPLITS}
    for s in synthesize.SPLITS:
        old, new = json.loads(made[s]), json.loads(again[s])
        assert [w["index"] for w in old["words"]] == [w["index"] for w in new["words"]]
        assert [w["start"] for w in old["words"]] == pytest.approx([w["start"] for w in new["words"]], abs=0.005)
    synthesize.synthesize_corpus(tmp_path, num, seed=2, jobs=1, lm_count=0, lm_clause_count=0)
    assert "0 made, 3 kept," in capsys.readouterr().err
    assert flacs == {p: p.read_bytes() for p in tmp_path.glob("wav/*/*.flac")}


# --- tools/word_timing_check.py ----------------------------------------------------------------------------


def hyp(*words: tuple[str, float]) -> list[SimpleNamespace]:
    return [SimpleNamespace(text=t, start=s, end=s + 0.2, confidence=0.9) for t, s in words]


def test_only_correct_words_with_an_event_are_matched():
    ref = "THE CAT SAT ON THE MAT"
    timed = {0: {"word": "THE", "start": 0.10}, 1: {"word": "CAT", "start": 0.30}, 2: {"word": "SAT", "start": 0.60},
             5: {"word": "MAT", "start": 1.20}}  # ON and the second THE have no event
    # SAT substituted (BAT), ON deleted, an inserted UH; the hypothesis is not yet normalized
    words = hyp(("the", 0.12), ("cat", 0.26), ("bat", 0.61), ("uh", 0.7), ("the", 0.95), ("mat.", 1.25))
    check = wtc.match_words("u1", ref, timed, words)
    assert [(m.index, m.word) for m in check.matches] == [(0, "THE"), (1, "CAT"), (5, "MAT")]
    assert [m.error_ms for m in check.matches] == pytest.approx([20.0, -40.0, 50.0])
    assert (check.ref_words, check.timed_ref_words, check.hyp_words) == (6, 4, 6)


def test_statistics_are_of_the_absolute_start_errors_in_ms():
    timed = {i: {"word": w, "start": float(i)} for i, w in enumerate("A B C D E F G H I J".split())}
    errors = [10, -20, 30, -40, 50, 60, -70, 80, 90, -100]  # ms
    words = hyp(*((w["word"], w["start"] + e / 1000) for w, e in zip(timed.values(), errors)))
    checks = [wtc.match_words("u", "A B C D E F G H I J", timed, words), wtc.match_words("v", "A", {}, [])]
    stats = wtc.summarize(checks)
    assert stats["matched"] == 10 and stats["utterances"] == 2 and stats["ref_words"] == 11
    assert stats["median_abs_ms"] == pytest.approx(55.0)
    assert stats["p90_abs_ms"] == pytest.approx(np.percentile(np.abs(errors), 90))
    assert stats["mean_abs_ms"] == pytest.approx(55.0)
    assert stats["median_signed_ms"] == pytest.approx(np.median(errors))
    empty = wtc.summarize([wtc.match_words("v", "A B", {0: {"word": "A", "start": 0.0}}, hyp(("C", 0.0)))])
    assert empty["matched"] == 0 and empty["median_abs_ms"] is None
    assert "|start error| median" in wtc.format_table(empty, "t")


def test_check_uses_the_corpus_alignment_skips_errors_and_reads_words_files(tmp_path):
    manifest = tmp_path / "dev.jsonl"
    manifest.write_text("".join(json.dumps({"id": f"u{i}", "audio": f"u{i}.flac", "duration": 1.0, "text": t}) + "\n"
                                for i, t in enumerate(["A B C", "D E"])))
    words_file = tmp_path / "dev_words.jsonl"
    words_file.write_text(json.dumps({"id": "u0", "words": [{"index": 0, "word": "A", "start": 0.5},
                                                             {"index": 2, "word": "C", "start": 0.9}], "key": "k"})
                          + "\n" + json.dumps({"id": "u1", "words": []}) + "\n")
    utts = wtc.read_manifest(manifest)
    words = wtc.read_words(words_file)
    results = [SimpleNamespace(words=hyp(("A", 0.51), ("C", 0.93)), error=None),
               SimpleNamespace(words=(), error="u1.flac: cannot read")]
    checks, skipped = wtc.check(utts, words, results)
    assert skipped == ["u1"] and [m.index for m in checks[0].matches] == [0, 2]
    assert wtc.summarize(checks)["median_abs_ms"] == pytest.approx(20.0)
    with pytest.raises(ValueError, match="is not the manifest's"):
        wtc.match_words("u0", "A B C", {1: {"word": "X", "start": 0.0}}, [])
    words_file.write_text('{"id": "u0"}\n')
    with pytest.raises(ValueError, match="dev_words.jsonl:1"):
        wtc.read_words(words_file)


def test_main_prints_the_table_and_writes_json(tmp_path, monkeypatch, capsys):
    import asr

    manifest = tmp_path / "dev.jsonl"
    manifest.write_text(json.dumps({"id": "u0", "audio": "u0.flac", "duration": 1.0, "text": "A B"}) + "\n")
    words_file = tmp_path / "dev_words.jsonl"
    words_file.write_text(json.dumps({"id": "u0", "words": [{"index": 1, "word": "B", "start": 0.5}]}) + "\n")
    asked = {}

    class Recognizer:
        def transcribe(self, paths, **options):
            asked.update(options, paths=paths)
            return [SimpleNamespace(words=hyp(("A", 0.1), ("B", 0.53)), error=None)]

    monkeypatch.setattr(asr, "load_model", lambda path, device: Recognizer())
    out = tmp_path / "wt.json"
    assert wtc.main(["--model", "m.pt", "--manifest", str(manifest), "--words", str(words_file),
                     "--out", str(out)]) == 0
    assert asked["word_timestamps"] is True and asked["paths"] == [str(tmp_path / "u0.flac")]
    report = json.loads(out.read_text())
    assert report["matched"] == 1 and report["median_abs_ms"] == pytest.approx(30.0) and report["skipped"] == 0
    assert "|start error| median" in capsys.readouterr().out
    assert wtc.main(["--model", "m.pt", "--manifest", str(manifest), "--words", str(tmp_path / "none.jsonl"),
                     "--out", str(out)]) == 1
    assert "none.jsonl" in capsys.readouterr().err
