"""asr.corpora: LibriSpeech and Kaldi import, speed perturbation."""
from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest
import soundfile as sf
from data_helpers import FEATURES, write_audio, write_lines

from asr.corpora import prepare_kaldi, prepare_librispeech, speed_perturb
from asr.dataset import ASRDataset, Example
from asr.manifest import ManifestError, Utterance, read_manifest, write_manifest
from asr.metrics import normalize_text

# ---------------------------------------------------------------------------------- LibriSpeech


def test_prepare_librispeech_real(realspeech, tmp_path):
    counts = prepare_librispeech(realspeech / "LibriSpeech", tmp_path)
    assert counts == {"dev-clean": 4, "test-clean": 8, "train-clean-100": 252}
    for part, count in counts.items():
        utts = read_manifest(tmp_path / f"{part}.jsonl")
        assert len(utts) == count
        assert [u.id for u in utts] == sorted(u.id for u in utts)
        for u in utts:
            info = sf.info(u.audio)
            assert os.path.isabs(u.audio) and u.id == Path(u.audio).stem
            assert u.duration == info.frames / info.samplerate
            assert u.text and u.text == normalize_text(u.text) and u.speaker == u.id.split("-")[0]


def make_librispeech(root: Path) -> Path:
    """A partial tree: chapter 1-10 lists 0002 without its file and has 0003 without a line."""
    chapter = root / "LibriSpeech" / "dev-clean" / "1" / "10"
    for i, seconds in [(0, 1.25), (1, 0.5), (3, 0.75)]:
        write_audio(chapter / f"1-10-{i:04d}.flac", seconds, seed=i)
    transcript = ["1-10-0001 SECOND, ONE", "1-10-0000 it's the FIRST-ONE!", "1-10-0002 GONE"]
    write_lines(chapter / "1-10.trans.txt", transcript)
    other = root / "LibriSpeech" / "test-clean" / "22" / "20"
    write_audio(other / "22-20-0000.flac", 1.0)
    write_lines(other / "22-20.trans.txt", ["22-20-0000 A TEST"])
    return root


def test_prepare_librispeech_partial_chapters(tmp_path, caplog):
    root = make_librispeech(tmp_path / "corpus")
    with caplog.at_level(logging.INFO, logger="asr.corpora"):
        counts = prepare_librispeech(root, tmp_path / "out")
    assert counts == {"dev-clean": 2, "test-clean": 1}
    utts = read_manifest(tmp_path / "out" / "dev-clean.jsonl")
    assert [(u.id, u.duration, u.text) for u in utts] == [
        ("1-10-0000", 1.25, "IT'S THE FIRST ONE"),
        ("1-10-0001", 0.5, "SECOND ONE"),
    ]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("1-10-0002" in w and "no audio file" in w for w in warnings)
    assert any("1-10-0003.flac" in w and "no transcript line" in w for w in warnings)
    assert "2 utterances; 2 skipped (1 without audio, 1 without transcript, 0 unreadable)" in caplog.text


def test_prepare_librispeech_roots_and_parts(tmp_path):
    root = make_librispeech(tmp_path / "corpus")
    assert prepare_librispeech(root / "LibriSpeech", tmp_path / "o1", parts=["test-clean"]) == {"test-clean": 1}
    assert prepare_librispeech(root / "LibriSpeech" / "dev-clean", tmp_path / "o2") == {"dev-clean": 2}
    with pytest.raises(ManifestError, match="no LibriSpeech part train-other-500 .found: dev-clean, test-clean"):
        prepare_librispeech(root, tmp_path / "o3", parts=["train-other-500"])
    with pytest.raises(ManifestError, match="no LibriSpeech parts"):
        prepare_librispeech(tmp_path / "o1", tmp_path / "o4")


def test_prepare_librispeech_unreadable_header(tmp_path, caplog):
    root = make_librispeech(tmp_path / "corpus")
    (root / "LibriSpeech" / "test-clean" / "22" / "20" / "22-20-0000.flac").write_bytes(b"not audio at all")
    with caplog.at_level(logging.WARNING, logger="asr.corpora"):
        assert prepare_librispeech(root, tmp_path / "out", parts=["test-clean"]) == {"test-clean": 0}
    assert "22-20-0000" in caplog.text


# ---------------------------------------------------------------------------------- Kaldi


def test_prepare_kaldi_real(realspeech, tmp_path, monkeypatch):
    monkeypatch.chdir(realspeech / "pocketsphinx_testdata")
    assert prepare_kaldi("cards", tmp_path / "cards.jsonl") == 5
    utts = read_manifest(tmp_path / "cards.jsonl")
    assert [u.id for u in utts] == ["001", "002", "003", "004", "005"]
    assert utts[0].text == "TEN OF CLUBS"
    for u in utts:
        info = sf.info(u.audio)
        assert os.path.isabs(u.audio) and u.duration == info.frames / info.samplerate


def make_kaldi(tmp_path: Path) -> Path:
    """data/ with wav.scp (plain path relative to data/, flac pipe, sox pipe relative to the
    current folder), segments, text and utt2spk; the current folder is tmp_path."""
    data = tmp_path / "data"
    write_audio(data / "rec1.wav", 3.0)
    flac = write_audio(tmp_path / "audio" / "rec2.flac", 2.0, seed=1)
    write_audio(tmp_path / "audio" / "rec3.wav", 1.0, seed=2)
    write_lines(data / "wav.scp", [
        "rec1 rec1.wav", f"rec2 flac -c -d -s {flac} |", "rec3 sox audio/rec3.wav -t wav - |",
    ])
    write_lines(data / "segments", [
        "u1 rec1 0.0 1.5", "u2 rec1 1.5 -1", "u3 rec2 0.5 1.25", "u4 rec2 1.0 9.0", "u5 rec3 0 -1", "u6 rec2 0 2.3",
    ])
    write_lines(data / "text", [
        "u1 Hello, world", "u2 SECOND", "u3 third-one", "u4 LOST", "u5 FIVE", "u6 SIX", "u9 NOBODY",
    ])
    write_lines(data / "utt2spk", ["u1 spkA", "u2 spkA", "u3 spkB"])
    return data


def test_prepare_kaldi_segments_pipes_text(tmp_path, monkeypatch, caplog):
    data = make_kaldi(tmp_path)
    monkeypatch.chdir(tmp_path)
    with caplog.at_level(logging.WARNING, logger="asr.corpora"):
        assert prepare_kaldi("data", tmp_path / "out.jsonl") == 5
    utts = {u.id: u for u in read_manifest(tmp_path / "out.jsonl")}
    assert utts["u1"] == Utterance("u1", str(data / "rec1.wav"), 1.5, "HELLO WORLD", end=1.5, speaker="spkA")
    assert utts["u2"] == Utterance("u2", str(data / "rec1.wav"), 1.5, "SECOND", start=1.5, speaker="spkA")
    rec2 = str(tmp_path / "audio" / "rec2.flac")
    assert utts["u3"] == Utterance("u3", rec2, 0.75, "THIRD ONE", start=0.5, end=1.25, speaker="spkB")
    assert utts["u5"] == Utterance("u5", str(tmp_path / "audio" / "rec3.wav"), 1.0, "FIVE")
    assert utts["u6"].duration == 2.0 and utts["u6"].end is None  # 0.3 s overshoot clipped
    assert "u4" not in utts and "u4: segment 1.00-9.00 s outside recording" in caplog.text
    assert "u9" in caplog.text  # a text line for no utterance is reported
    # The segments load with the lengths the manifest states.
    dataset = ASRDataset(list(utts.values()), None, features=FEATURES)
    assert all(isinstance(dataset[i], Example) for i in range(len(dataset)))


def test_prepare_kaldi_cwd_before_data_dir_and_missing(tmp_path, monkeypatch, caplog):
    data = tmp_path / "data"
    write_audio(data / "a.wav", 1.0)
    write_audio(tmp_path / "a.wav", 2.0)  # the same relative path from the current folder wins
    write_lines(data / "wav.scp", ["a a.wav", "b nowhere.wav"])
    monkeypatch.chdir(tmp_path)
    with caplog.at_level(logging.WARNING, logger="asr.corpora"):
        assert prepare_kaldi(data, tmp_path / "out.jsonl") == 1
    [utt] = read_manifest(tmp_path / "out.jsonl")
    assert (utt.audio, utt.duration, utt.text) == (str(tmp_path / "a.wav"), 2.0, "")
    assert f"{data / 'wav.scp'}:2: b: {tmp_path / 'nowhere.wav'}" in caplog.text


def test_prepare_kaldi_utterance_without_text_skipped(tmp_path, monkeypatch, caplog):
    data = tmp_path / "data"
    write_audio(data / "a.wav", 1.0)
    write_audio(data / "b.wav", 1.0)
    write_lines(data / "wav.scp", ["a a.wav", "b b.wav"])
    write_lines(data / "text", ["a AYE"])
    monkeypatch.chdir(tmp_path)
    with caplog.at_level(logging.WARNING, logger="asr.corpora"):
        assert prepare_kaldi(data, tmp_path / "out.jsonl") == 1
    assert "b: no line in text; skipped" in caplog.text


@pytest.mark.parametrize(
    "wav_scp, segments, message",
    [
        (["a a.wav", "b gunzip -c b.wav.gz |"], None, r"wav\.scp:2: pipe not supported: gunzip -c b\.wav\.gz \|"),
        (["a flac -d a.flac |"], None, r"wav\.scp:1: pipe not supported"),
        (["a sox a.wav -r 8000 -t wav - |"], None, r"wav\.scp:1: pipe not supported"),
        (["a a.wav", "", "a a.wav"], None, r"wav\.scp:3: duplicate id a \(first on line 1\)"),
        (["a"], None, r"wav\.scp:1: expected 'ID PATH'"),
        (["a a.wav"], ["u1 a 0 1", "u2 a 0"], r"segments:2: expected 'UTT REC START END'"),
        (["a a.wav"], ["u1 b 0 1"], r"segments:1: recording 'b' is not in wav\.scp"),
        (["a a.wav"], ["u1 a zero 1"], r"segments:1: START and END must be numbers"),
        (["a a.wav"], ["u1 a 1 0.5"], r"segments:1: invalid times 1 0\.5"),
        (["a a.wav"], ["u1 a -1 2"], r"segments:1: invalid times"),
        (["a a.wav"], ["u1 a 0 -2"], r"segments:1: invalid times"),
    ],
)
def test_prepare_kaldi_bad_lines(tmp_path, monkeypatch, wav_scp, segments, message):
    data = tmp_path / "data"
    write_audio(data / "a.wav", 1.0)
    write_lines(data / "wav.scp", wav_scp)
    if segments is not None:
        write_lines(data / "segments", segments)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ManifestError, match=message) as err:
        prepare_kaldi(data, tmp_path / "out.jsonl")
    assert str(err.value).startswith(str(data)) and "\n" not in str(err.value)
    assert not (tmp_path / "out.jsonl").exists()


# ---------------------------------------------------------------------------------- speed perturbation


def test_speed_perturb(tmp_path):
    audio = write_audio(tmp_path / "a.wav", 2.0)
    utts = [Utterance("a", str(audio), 2.0, "A"), Utterance("b", str(audio), 1.0, "B", start=0.5, end=1.5)]
    out = speed_perturb(utts, (0.9, 1.0, 1.1))
    assert [u.id for u in out] == ["a", "b", "sp0.9-a", "sp0.9-b", "sp1.1-a", "sp1.1-b"]
    assert out[2] == Utterance("sp0.9-a", str(audio), 2.0 / 0.9, "A", speed=0.9)
    assert out[5].duration == pytest.approx(1.0 / 1.1) and (out[5].start, out[5].end) == (0.5, 1.5)
    assert speed_perturb(out, (0.9, 1.1)) == out  # a perturbed list is left as it is
    write_manifest(out, tmp_path / "sp.jsonl")
    assert read_manifest(tmp_path / "sp.jsonl") == out
    dataset = ASRDataset(out, None, features=FEATURES)
    for i, u in enumerate(out):
        example = dataset[i]
        assert isinstance(example, Example), example
        assert abs(example.feats.shape[0] - u.duration * 100) <= 3  # 10 ms frames
    with pytest.raises(ValueError, match="positive"):
        speed_perturb(utts, (0.0,))

