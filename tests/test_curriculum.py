"""The length curriculum's pieces (asr.curriculum): cut where the text says, covering the utterance."""
from __future__ import annotations

import pytest

from asr.curriculum import MARGIN, split_epochs, split_utterance, split_utterances
from asr.manifest import Utterance

TEXT = "THE QUICK BROWN FOX JUMPS OVER THE LAZY DOG AND RUNS AWAY INTO THE DARK GREEN WOODS"


def test_a_long_utterance_becomes_pieces_in_proportion_to_its_characters():
    utt = Utterance("u1", "/a/u1.flac", 20.0, TEXT)
    pieces = split_utterance(utt, 5.0)
    assert len(pieces) == 4
    assert [p.id for p in pieces] == ["u1@0", "u1@1", "u1@2", "u1@3"]
    assert " ".join(p.text for p in pieces) == TEXT  # every word once, in order
    assert all(p.audio == utt.audio and p.text for p in pieces)
    assert pieces[0].start == 0.0 and pieces[-1].end is None  # to the file's end, as the utterance
    assert pieces[-1].duration == pytest.approx(20.0 - pieces[-1].start, abs=1e-3)
    for p in pieces[:-1]:
        assert p.duration == pytest.approx(p.end - p.start, abs=1e-3)
        assert 3.0 < p.duration < 7.5
    total = len(TEXT) + 1
    done = 0
    for p, nxt in zip(pieces, pieces[1:]):  # each cut at its text's share of the time, +- the margin
        done += len(p.text) + 1
        cut = 20.0 * done / total
        assert p.end == pytest.approx(cut + MARGIN, abs=1e-3) and nxt.start == pytest.approx(cut - MARGIN, abs=1e-3)


def test_a_segment_of_a_speed_perturbed_file_keeps_its_frame_of_reference():
    utt = Utterance("u2", "/a/u2.flac", 10.0, TEXT, start=3.0, end=14.0, speed=1.1)
    pieces = split_utterance(utt, 5.0)
    assert len(pieces) == 2 and pieces[0].start == 3.0 and pieces[-1].end == pytest.approx(14.0)
    for p in pieces:
        assert p.speed == 1.1 and p.duration == pytest.approx((p.end - p.start) / 1.1, abs=1e-3)


@pytest.mark.parametrize("duration,text", [(7.4, TEXT), (30.0, "ONE"), (12.0, "ONE TWO")])
def test_short_utterances_and_few_words_stay_whole_or_get_a_word_per_piece(duration, text):
    utt = Utterance("u", "/a/u.flac", duration, text)
    pieces = split_utterance(utt, 5.0)
    assert " ".join(p.text for p in pieces) == text
    assert len(pieces) == min(round(duration / 5.0), len(text.split())) or pieces == [utt]
    if duration < 7.5 or len(text.split()) == 1:
        assert pieces == [utt]


def test_split_utterances_keeps_the_order():
    utts = [Utterance(f"u{i}", f"/a/{i}.flac", d, TEXT) for i, d in enumerate([3.0, 16.0, 6.0])]
    pieces = split_utterances(utts, 5.0)
    assert [p.id for p in pieces] == ["u0", "u1@0", "u1@1", "u1@2", "u2"]


def test_a_long_last_word_still_gets_a_piece_of_its_own():
    pieces = split_utterance(Utterance("u", "/a/u.flac", 11.0, "GOOD MORNINGSTARLIGHTS"), 5.0)
    assert [p.text for p in pieces] == ["GOOD", "MORNINGSTARLIGHTS"]


def test_the_curriculum_lasts_about_split_hours_of_audio():
    utts = [Utterance(f"u{i}", f"/a/{i}.flac", 36.0, TEXT) for i in range(1000)]  # 10 hours
    assert split_epochs(utts, 0.0) == 0
    assert split_epochs(utts, 20.0) == 2 and split_epochs(utts, 26.0) == 3
    assert split_epochs(utts, 1.0) == 1  # at least one


def test_the_last_piece_reads_when_the_file_is_a_little_shorter_than_the_manifest_says(tmp_path):
    import numpy as np
    import soundfile as sf

    from asr.audio import load_audio
    path = tmp_path / "u.wav"
    sf.write(path, np.zeros(int(16000 * 11.95), dtype=np.float32), 16000)  # 50 ms short of its duration
    pieces = split_utterance(Utterance("u", str(path), 12.0, TEXT), 5.0)
    assert len(pieces) == 2
    for p in pieces:
        wave = load_audio(p.audio, start=p.start or 0.0, end=p.end)
        assert abs(wave.numel() / 16000 - p.duration) < 0.1
