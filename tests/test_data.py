"""asr.data: manifests, LibriSpeech / Kaldi import, speed perturbation, Dataset, collate, loader."""
from __future__ import annotations

import json
import logging
import os
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
import torch

import asr.data
from asr.data import (
    ASRDataLoader,
    ASRDataset,
    Batch,
    DataConfig,
    Example,
    FeatureArchive,
    FeatureArchiveError,
    ManifestError,
    Skipped,
    Utterance,
    collate,
    compute_cmvn,
    make_loader,
    prepare_kaldi,
    prepare_librispeech,
    read_manifest,
    speed_perturb,
    split_skipped,
    write_manifest,
)
from asr.features import FeatureConfig, GlobalCMVN, SpecAugmentConfig, fbank, num_frames
from asr.metrics import normalize_text
from asr.tokenizer import train_tokenizer

RATE = 16000
FEATURES = FeatureConfig()


def write_audio(path: Path, seconds: float, rate: int = RATE, seed: int = 0) -> Path:
    """A sine plus noise, 16-bit, in the format the suffix says (WAV / FLAC)."""
    rng = np.random.default_rng(seed)
    t = np.arange(round(seconds * rate)) / rate
    wave = 0.3 * np.sin(2 * np.pi * (200 + 50 * seed) * t) + 0.05 * rng.standard_normal(t.size)
    path.parent.mkdir(parents=True, exist_ok=True)
    sf.write(path, wave.astype(np.float32), rate, subtype="PCM_16")
    return path


def write_lines(path: Path, lines: list[str]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


def good_line(utt_id: str = "a", **extra) -> str:
    return json.dumps({"id": utt_id, "audio": "a.wav", "duration": 1.5, "text": "HELLO"} | extra)


# ---------------------------------------------------------------------------------- manifests


def test_manifest_round_trip(tmp_path):
    utts = [
        Utterance("b", str(tmp_path / "b.flac"), 2.5, "B TEXT", speaker="s1"),
        Utterance("a", str(tmp_path / "a.wav"), 1.0, "", start=0.5, end=2.5, speed=2.0),
    ]
    path = tmp_path / "sub" / "m.jsonl"
    write_manifest(utts, path)
    assert read_manifest(path) == utts  # order kept, every field back
    assert not [p for p in path.parent.iterdir() if p.name != "m.jsonl"]  # no temporary left
    first = json.loads(path.read_text().splitlines()[0])
    assert first == {"id": "b", "audio": str(tmp_path / "b.flac"), "duration": 2.5, "text": "B TEXT", "speaker": "s1"}


def test_relative_audio_resolved_against_manifest_folder(tmp_path, monkeypatch):
    write_lines(tmp_path / "data" / "m.jsonl", [good_line(audio="../wav/a.wav"), good_line("b", audio="/x/b.wav")])
    monkeypatch.chdir(tmp_path / "data")
    utts = read_manifest("m.jsonl")
    assert utts[0].audio == str(tmp_path / "wav" / "a.wav")
    assert utts[1].audio == "/x/b.wav"
    assert utts[0].to_json(base_dir=tmp_path / "data")["audio"] == os.path.join("..", "wav", "a.wav")


def test_write_refuses_duplicate_ids(tmp_path):
    utt = Utterance("a", "/a.wav", 1.0, "")
    with pytest.raises(ValueError, match="duplicate id 'a'"):
        write_manifest([utt, utt], tmp_path / "m.jsonl")
    assert not (tmp_path / "m.jsonl").exists()


DROP = object()


def line_with(**changes) -> str:
    """A manifest line: id a, audio a.wav, duration 1.5, text "" with `changes` (DROP removes)."""
    obj = {"id": "a", "audio": "a.wav", "duration": 1.5, "text": ""} | changes
    return json.dumps({k: v for k, v in obj.items() if v is not DROP})


BAD_LINES = [
    ("{not json", "bad JSON"),
    ('["a", 1.5]', "expected a JSON object, got an array"),
    ('"a"', "expected a JSON object, got a string"),
    (line_with(id=DROP), "missing field 'id'"),
    (line_with(audio=DROP), "missing field 'audio'"),
    (line_with(duration=DROP), "missing field 'duration'"),
    (line_with(text=DROP), "missing field 'text'"),
    (line_with(text=None), "field 'text' is null"),
    (line_with(id=7), "field 'id' must be a string, got a number 7"),
    (line_with(audio=["a.wav"]), "field 'audio' must be a string, got an array"),
    (line_with(duration="1.5"), "field 'duration' must be a number, got a string \"1.5\""),
    (line_with(duration=True), "field 'duration' must be a number, got a boolean"),
    (line_with(text=5), "field 'text' must be a string"),
    (line_with(duration=-1.5), "duration must be positive"),
    (line_with(duration=0), "duration must be positive"),
    (line_with(duration=float("nan")), "field 'duration' must be finite"),
    (line_with(duration=float("inf")), "field 'duration' must be finite"),
    (line_with(id=""), "id '' is empty or contains whitespace"),
    (line_with(id="a b"), "id 'a b' is empty or contains whitespace"),
    (line_with(audio=""), "audio is empty"),
    (line_with(start=-1), "start must be >= 0"),
    (line_with(start="0"), "field 'start' must be a number"),
    (line_with(start=3, end=2), "end (2.0) must be after start (3.0)"),
    (line_with(end=0), "end (0.0) must be after start (0.0)"),
    (line_with(start=1, end=5), "duration 1.5 disagrees with (end - start) / speed = 4.000"),
    (line_with(speed=0), "speed must be positive"),
    (line_with(speed=-0.9), "speed must be positive"),
    (line_with(speed="fast"), "field 'speed' must be a number"),
    (line_with(speaker=12), "field 'speaker' must be a string"),
    (good_line("x"), "duplicate id x (first on line 1)"),
]


@pytest.mark.parametrize("line, reason", BAD_LINES, ids=[r for _, r in BAD_LINES])
def test_malformed_line_is_fatal_with_path_and_line(tmp_path, line, reason):
    path = write_lines(tmp_path / "m.jsonl", [good_line("x"), "", line, good_line("z")])
    with pytest.raises(ManifestError) as err:
        read_manifest(path)
    message = str(err.value)
    assert message.startswith(f"{path}:3: ") and reason in message
    assert "\n" not in message


def test_manifest_not_utf8_and_missing(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_bytes(good_line().encode() + b"\n" + b'{"id": "\xff"}\n')
    with pytest.raises(ManifestError, match=r"m\.jsonl:2: not UTF-8"):
        read_manifest(path)
    with pytest.raises(ManifestError, match="no such file"):
        read_manifest(tmp_path / "absent.jsonl")


def test_manifest_extras_ignored_and_segment_accepted(tmp_path):
    line = good_line(start=1.0, end=2.5, speed=1.0, speaker="s", lang="en")
    [utt] = read_manifest(write_lines(tmp_path / "m.jsonl", [line]))
    assert (utt.start, utt.end, utt.speed, utt.speaker) == (1.0, 2.5, 1.0, "s")


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
    with caplog.at_level(logging.INFO, logger="asr.data"):
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
    with caplog.at_level(logging.WARNING, logger="asr.data"):
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
    with caplog.at_level(logging.WARNING, logger="asr.data"):
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
    with caplog.at_level(logging.WARNING, logger="asr.data"):
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
    with caplog.at_level(logging.WARNING, logger="asr.data"):
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


# ---------------------------------------------------------------------------------- Dataset


@pytest.fixture
def corpus(tmp_path) -> list[Utterance]:
    """Four good utterances (WAV and FLAC) and four bad ones: missing, corrupt, wrong duration,
    too short for one frame."""
    good = [
        Utterance("g1", str(write_audio(tmp_path / "g1.wav", 1.0)), 1.0, "ONE"),
        Utterance("g2", str(write_audio(tmp_path / "g2.flac", 1.5, seed=1)), 1.5, "TWO TWO"),
        Utterance("g3", str(write_audio(tmp_path / "g3.wav", 0.7, rate=8000, seed=2)), 0.7, "Three!"),
        Utterance("g4", str(write_audio(tmp_path / "g4.flac", 2.0, seed=3)), 1.0, "FOUR", start=0.5, end=1.5),
    ]
    (tmp_path / "corrupt.wav").write_bytes(b"RIFF\x00\x00garbage" * 10)
    bad = [
        Utterance("missing", str(tmp_path / "missing.wav"), 1.0, "X"),
        Utterance("corrupt", str(tmp_path / "corrupt.wav"), 1.0, "X"),
        Utterance("wronglen", str(write_audio(tmp_path / "w.wav", 1.0)), 3.0, "X"),
        Utterance("tiny", str(write_audio(tmp_path / "t.wav", 0.01)), 0.01, "X"),
    ]
    return good + bad


@pytest.fixture
def tokenizer():
    return train_tokenizer(["ONE TWO THREE FOUR X"], "char")


def test_dataset_examples(corpus, tokenizer):
    dataset = ASRDataset(corpus, tokenizer, features=FEATURES)
    for i, utt in enumerate(corpus[:4]):
        example = dataset[i]
        assert isinstance(example, Example) and example.id == utt.id
        assert example.feats.dtype == torch.float32
        assert example.feats.shape == (num_frames(round(utt.duration * RATE)), 80)
        assert example.tokens.dtype == torch.long
        assert example.tokens.tolist() == tokenizer.encode(normalize_text(utt.text))


def test_dataset_skips_bad_audio_with_reasons(corpus, tokenizer):
    dataset = ASRDataset(corpus, tokenizer, features=FEATURES, training=True)
    skipped = {s.id: s.reason for s in (dataset[i] for i in range(4, 8))}
    assert all(isinstance(dataset[i], Skipped) for i in range(4, 8))
    assert "missing.wav" in skipped["missing"] and "corrupt.wav" in skipped["corrupt"]
    assert skipped["wronglen"] == "decoded length 1.000 s differs from duration 3.000 s"
    assert skipped["tiny"].startswith("too short for one frame")


def test_dither_from_seed_epoch_index(corpus):
    def feats(training: bool, seed: int = 0, epoch: int = 0, index: int = 0) -> torch.Tensor:
        dataset = ASRDataset(corpus, None, features=FEATURES, training=training, seed=seed)
        dataset.set_epoch(epoch)
        return dataset[index].feats

    assert torch.equal(feats(True), feats(True))
    assert not torch.equal(feats(True), feats(True, epoch=1))
    assert not torch.equal(feats(True), feats(True, seed=1))
    from asr.audio import load_audio

    plain = fbank(load_audio(corpus[0].audio), FEATURES)
    assert torch.equal(feats(False), plain) and not torch.equal(feats(True), plain)


def test_compute_cmvn_and_normalized_dataset(corpus, caplog):
    with caplog.at_level(logging.WARNING, logger="asr.data"):
        stats = compute_cmvn(corpus, FEATURES)
    frames = sum(num_frames(round(u.duration * RATE)) for u in corpus[:4])
    assert stats.count == frames
    for utt_id in ("missing", "corrupt", "wronglen", "tiny"):
        assert f"{utt_id}: " in caplog.text
    dataset = ASRDataset(corpus[:4], None, features=FEATURES, cmvn=GlobalCMVN(stats))
    normalized = torch.cat([dataset[i].feats for i in range(4)])
    assert normalized.mean(0).abs().max() < 1e-3
    assert (normalized.std(0) - 1).abs().max() < 1e-2


# --------------------------------------------------------------------------- dumped features


def test_dumped_features_are_the_computed_ones(corpus, tokenizer, tmp_path, caplog):
    """compute_cmvn(dump_dir=) gives the same statistics, and an archive of every usable utterance
    (the bad ones skipped) whose features equal fbank without dither to float16 precision; a
    training Dataset reads them (the same after CMVN, with or without loader workers)."""
    plain = compute_cmvn(corpus, FEATURES)
    stats = compute_cmvn(corpus, FEATURES, num_workers=2, dump_dir=tmp_path / "feats")
    assert torch.equal(stats.sum, plain.sum) and stats.count == plain.count
    with caplog.at_level(logging.INFO, logger="asr.data"):
        archive = FeatureArchive(tmp_path / "feats", FEATURES)
        cmvn = GlobalCMVN(stats)
        computed = ASRDataset(corpus, tokenizer, features=FEATURES, cmvn=cmvn)
        read = ASRDataset(corpus, tokenizer, features=FEATURES, cmvn=cmvn, training=True, archive=archive)
    assert "features of 4 of 8 utterances from" in caplog.text
    offsets, frames = archive.rows(corpus)
    assert (offsets[:4] >= 0).all() and (offsets[4:] == -1).all() and frames.sum() == stats.count
    for i in range(4):
        want = computed[i]
        got = read[i]
        assert got.id == want.id and torch.equal(got.tokens, want.tokens)
        torch.testing.assert_close(got.feats, want.feats, atol=0.02, rtol=0.0)  # float16 of log-mels < 32
        assert not torch.equal(got.feats, want.feats)  # really read from the archive
        torch.testing.assert_close(got.feats, read.get(i, epoch=3).feats, atol=0, rtol=0)  # no dither
    assert [type(read[i]) for i in range(4, 8)] == [Skipped] * 4
    no_masks = SpecAugmentConfig(freq_masks=0, time_masks=0)
    batches = [b for b in make_loader(corpus, tokenizer, loader_config(num_workers=2, specaug=no_masks),
                                      training=True, cmvn=cmvn, archive=archive)]
    assert sorted(i for b in batches for i in b.ids) == ["g1", "g2", "g3", "g4"]
    for batch in batches:  # what the workers read is the archive's (no dither: equal, not close)
        for b, utt_id in enumerate(batch.ids):
            want = read[[u.id for u in corpus].index(utt_id)].feats
            assert torch.equal(batch.feats[b, : batch.feat_lens[b]], want)


def test_cmvn_chunks_keep_each_utterance_with_its_features(corpus, tmp_path, monkeypatch):
    """Loader workers hand compute_cmvn its utterances in chunks: with good and bad utterances
    across several chunk edges, each good one is archived under its own id with its own features,
    and the statistics are those of one pass in this process."""
    monkeypatch.setattr(asr.data, "_CMVN_CHUNK", 3)
    mixed = [corpus[i] for i in (4, 0, 5, 6, 1, 2, 7, 3)]  # chunks: bad good bad | bad good good | bad good
    stats = compute_cmvn(mixed, FEATURES, num_workers=2, dump_dir=tmp_path / "feats")
    plain = compute_cmvn(corpus, FEATURES)
    assert stats.count == plain.count
    torch.testing.assert_close(stats.sum, plain.sum, rtol=1e-12, atol=0.0)  # another order of summation
    archive = FeatureArchive(tmp_path / "feats", FEATURES)
    read = ASRDataset(corpus[:4], None, features=FEATURES, training=True, archive=archive)
    computed = ASRDataset(corpus[:4], None, features=FEATURES)
    for i in range(4):
        assert read[i].feats.shape == computed[i].feats.shape
        torch.testing.assert_close(read[i].feats, computed[i].feats, atol=0.02, rtol=0.0)


def test_archive_entries_of_changed_audio_are_computed_again(corpus, tmp_path):
    compute_cmvn(corpus[:3], FEATURES, dump_dir=tmp_path / "feats")  # g4 not dumped
    write_audio(Path(corpus[1].audio), 1.5, seed=7)  # g2 rewritten after the dump
    shifted = replace(corpus[2], start=0.1, end=0.7, duration=0.6)  # g3, another segment
    utts = [corpus[0], corpus[1], shifted, corpus[3]]
    offsets, _ = FeatureArchive(tmp_path / "feats", FEATURES).rows(utts)
    assert offsets[0] >= 0 and (offsets[1:] == -1).all()
    dataset = ASRDataset(utts, None, features=FEATURES, archive=FeatureArchive(tmp_path / "feats", FEATURES))
    fresh = ASRDataset(utts, None, features=FEATURES)
    for i in (1, 2, 3):
        assert torch.equal(dataset[i].feats, fresh[i].feats)


def test_archive_errors_are_one_line(corpus, tmp_path):
    with pytest.raises(FeatureArchiveError, match="no feature archive") as e:
        FeatureArchive(tmp_path / "nowhere", FEATURES)
    compute_cmvn(corpus[:2], FEATURES, dump_dir=tmp_path / "feats")
    with pytest.raises(FeatureArchiveError, match=r"dumped with other features \(n_mels differ") as e:
        FeatureArchive(tmp_path / "feats", replace(FEATURES, n_mels=40))
    assert "\n" not in str(e.value)
    [data] = (tmp_path / "feats").glob("feats-*.f16")
    data.write_bytes(data.read_bytes()[:-2])
    with pytest.raises(FeatureArchiveError, match=r"feats-[0-9a-f]+\.f16: \d+ bytes, the index says \d+; dump"):
        FeatureArchive(tmp_path / "feats", FEATURES)
    index = json.loads((tmp_path / "feats" / "index.json").read_text())
    for broken in ({}, {**index, "features": 3}, {**index, "frames": "many"}, {**index, "utterances": []}):
        (tmp_path / "feats" / "index.json").write_text(json.dumps(broken))
        with pytest.raises(FeatureArchiveError, match="not a feature archive index"):
            FeatureArchive(tmp_path / "feats", FEATURES)


def test_a_failed_dump_leaves_the_previous_archive(corpus, tmp_path, monkeypatch):
    compute_cmvn(corpus[:2], FEATURES, dump_dir=tmp_path / "feats")
    before = {p.name: p.read_bytes() for p in (tmp_path / "feats").iterdir()}

    def broken(self, index, feats):
        raise OSError("disk full")

    monkeypatch.setattr("asr.data._ArchiveWriter.add", broken)
    with pytest.raises(OSError, match="disk full"):
        compute_cmvn(corpus[:4], FEATURES, dump_dir=tmp_path / "feats")
    assert {p.name: p.read_bytes() for p in (tmp_path / "feats").iterdir()} == before
    monkeypatch.undo()

    # the data of a new dump is written, but its index is not: the old index still reads the old data
    def no_index(*args, **kwargs):
        raise OSError("killed before the index")

    monkeypatch.setattr("asr.data.json.dump", no_index)
    with pytest.raises(OSError, match="killed before the index"):
        compute_cmvn(list(reversed(corpus[:2])), FEATURES, dump_dir=tmp_path / "feats")
    monkeypatch.undo()
    archive = FeatureArchive(tmp_path / "feats", FEATURES)
    fresh = ASRDataset(corpus[:2], None, features=FEATURES)
    read = ASRDataset(corpus[:2], None, features=FEATURES, archive=archive)
    for i in range(2):
        torch.testing.assert_close(read[i].feats, fresh[i].feats, atol=0.02, rtol=0.0)

    # a dump in which no utterance has usable audio commits nothing
    compute_cmvn(corpus[4:], FEATURES, dump_dir=tmp_path / "feats")
    assert FeatureArchive(tmp_path / "feats", FEATURES).rows(corpus[:2])[0].min() >= 0

    # a good new dump replaces the old one and leaves one data file
    compute_cmvn(corpus[:3], FEATURES, dump_dir=tmp_path / "feats")
    assert len(list((tmp_path / "feats").glob("feats-*.f16"))) == 1
    assert (FeatureArchive(tmp_path / "feats", FEATURES).rows(corpus[:3])[0] >= 0).all()


# ---------------------------------------------------------------------------------- collate


def example(utt_id: str, frames: int, tokens: list[int], dim: int = 4) -> Example:
    return Example(utt_id, torch.randn(frames, dim) + 5, torch.tensor(tokens, dtype=torch.long))


def test_collate_shapes_and_padding():
    items = [example("a", 3, [2, 3]), Skipped("s", "why"), example("b", 5, []), example("c", 1, [4, 4, 4])]
    batch = collate(items)
    assert isinstance(batch, Batch) and Batch._fields == ("ids", "feats", "feat_lens", "tokens", "token_lens")
    assert batch.ids == ["a", "b", "c"]
    kept, skipped = split_skipped(items)
    assert [e.id for e in kept] == ["a", "b", "c"] and skipped == [Skipped("s", "why")]
    assert batch.feats.shape == (3, 5, 4) and batch.feats.dtype == torch.float32
    assert batch.feat_lens.tolist() == [3, 5, 1] and batch.token_lens.tolist() == [2, 0, 3]
    assert batch.tokens.tolist() == [[2, 3, -1], [-1, -1, -1], [4, 4, 4]]
    assert batch.feats[0, 3:].abs().sum() == 0 and batch.feats[2, 1:].abs().sum() == 0
    assert batch.feat_lens.dtype == batch.tokens.dtype == batch.token_lens.dtype == torch.long


def test_collate_all_skipped():
    batch = collate([Skipped("a", "r1"), Skipped("b", "r2")], feat_dim=80)
    assert batch.ids == [] and len(batch) == 5
    assert batch.feats.shape == (0, 0, 80) and batch.tokens.shape == (0, 0)
    assert batch.feat_lens.shape == batch.token_lens.shape == (0,)


def test_collate_specaug_within_lengths():
    examples = [example("a", 100, [2], dim=40), example("b", 60, [3], dim=40)]
    config = SpecAugmentConfig(freq_masks=2, freq_width=10, time_masks=4, max_time_width=10)
    plain = collate(examples)
    one = collate(examples, specaug=config, generator=torch.Generator().manual_seed(1))
    two = collate(examples, specaug=config, generator=torch.Generator().manual_seed(1))
    assert torch.equal(one.feats, two.feats)
    assert (one.feats[:, :, :] == 0).any()  # masked somewhere
    assert one.feats[1, 60:].abs().sum() == 0 and torch.equal(one.feats[1, 60:], plain.feats[1, 60:])


# ---------------------------------------------------------------------------------- loader


def loader_config(**changes) -> DataConfig:
    return DataConfig(**({"max_batch_seconds": 3.0, "num_workers": 0} | changes))


def test_make_loader_end_to_end(corpus, tokenizer, caplog, monkeypatch):
    monkeypatch.setattr(ASRDataLoader, "_reported", set())  # what earlier tests logged
    with caplog.at_level(logging.WARNING, logger="asr.data"):
        loader = make_loader(corpus, tokenizer, loader_config(), training=True, seed=3)
        batches = list(loader)
    assert len(batches) == len(loader)
    assert all(type(b) is Batch for b in batches)  # the 5 fields only, skips kept by the loader
    ids = sorted(i for b in batches for i in b.ids)
    assert ids == ["g1", "g2", "g3", "g4"]
    assert sorted(loader.skipped) == ["corrupt", "missing", "tiny", "wronglen"]
    for utt_id in loader.skipped:
        assert sum(f"{utt_id}: " in r.getMessage() for r in caplog.records) == 1  # logged once
    for b in batches:
        assert b.feats.shape[0] == len(b.ids) and b.feats.shape[2] == 80
        assert max(b.feat_lens.tolist(), default=0) == b.feats.shape[1]
    # The next epoch of the same loader reports nothing new, but still counts its skips.
    caplog.clear()
    loader.skipped.clear()
    loader.set_epoch(1)
    with caplog.at_level(logging.WARNING, logger="asr.data"):
        list(loader)
    assert len(loader.skipped) == 4 and not caplog.records


def run_epochs(loader: ASRDataLoader, epochs: list[tuple[int, int]]) -> list[list[Batch]]:
    """The batches of each (epoch, start_batch) in turn, from one loader."""
    out = []
    for epoch, start in epochs:
        loader.set_epoch(epoch, start)
        out.append(list(loader))
        assert len(out[-1]) == len(loader)
    return out


def same_batches(a: list[Batch], b: list[Batch]) -> bool:
    return len(a) == len(b) and all(
        x.ids == y.ids and torch.equal(x.feats, y.feats) and torch.equal(x.tokens, y.tokens) for x, y in zip(a, b)
    )


def test_make_loader_deterministic_and_resumable(corpus, tokenizer):
    config = loader_config(speed_perturb=[0.9, 1.1], max_batch_seconds=4.0)
    loader = make_loader(corpus[:4], tokenizer, config, training=True, seed=1)
    full, tail, again = run_epochs(loader, [(2, 0), (2, 2), (2, 0)])
    assert len(full) >= 3
    ids = sorted(i for b in full for i in b.ids)
    assert ids == sorted(f"{p}{u}" for p in ("", "sp0.9-", "sp1.1-") for u in ("g1", "g2", "g3", "g4"))
    assert same_batches(full[2:], tail) and same_batches(full, again)
    fresh = make_loader(corpus[:4], tokenizer, config, training=True, seed=1)
    fresh.set_epoch(2)
    assert same_batches(full, list(fresh))


def test_persistent_workers_follow_the_epoch(corpus, tokenizer):
    """Workers started once get each epoch's randomness (dither, SpecAugment) from the sampler's
    keys: a 2-worker loader gives what a fresh in-process loader gives, epoch by epoch."""
    config = loader_config(max_batch_seconds=3.0, speed_perturb=[0.9])
    workers = make_loader(corpus[:4], tokenizer, replace(config, num_workers=2), training=True, seed=5)
    assert workers.persistent_workers
    got = run_epochs(workers, [(0, 0), (1, 0), (1, 1)])
    # Loader workers run one thread each, and some operators' results depend on the thread count
    # (the resampler's convolution differs in the last bits at 1 and 2 threads on some CPUs): the
    # in-process reference runs with one thread too.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for (epoch, start), batches in zip([(0, 0), (1, 0), (1, 1)], got):
            inline = make_loader(corpus[:4], tokenizer, config, training=True, seed=5)
            inline.set_epoch(epoch, start)
            assert same_batches(batches, list(inline)), (epoch, start)
    finally:
        torch.set_num_threads(threads)
    assert not same_batches(got[0], got[1])


def test_make_loader_workers_and_ranks(corpus, tokenizer):
    config = loader_config(num_workers=2, max_batch_seconds=2.0)
    shards = [list(make_loader(corpus, tokenizer, config, training=False, rank=r, world_size=2)) for r in range(2)]
    assert len(shards[0]) == len(shards[1])
    ids = [i for s in shards for b in s for i in b.ids]
    assert sorted(ids) == ["g1", "g2", "g3", "g4"]
    # Evaluation: no dither, no SpecAugment: features equal the plain ones.
    dataset = ASRDataset(corpus, tokenizer, features=FEATURES)
    for b in (b for s in shards for b in s):
        for k, utt_id in enumerate(b.ids):
            feats = dataset[[u.id for u in corpus].index(utt_id)].feats
            assert torch.equal(b.feats[k, : len(feats)], feats)


def test_reports_once_and_on_rank_0_only(corpus, tokenizer, caplog):
    """Left-out and dropped-for-sharding reports: at build time / the first epoch, rank 0 only."""
    config = loader_config(min_duration=0.8, max_batch_seconds=1.2)
    for rank in (1, 0):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="asr.data"):
            loader = make_loader(corpus[:4], tokenizer, config, training=True, rank=rank, world_size=3)
            run_epochs(loader, [(0, 0), (1, 0), (2, 0)])
        text = caplog.text
        if rank:
            assert text == ""
        else:
            assert text.count("outside 0.80") == 1 and text.count("longer than the batch cap") == 1
            assert text.count("dropped to give 3 ranks equal shares") == 1


def test_dataset_is_compact_and_round_trips(corpus, tokenizer):
    """The dataset keeps numpy arrays, not a list of Utterance objects (forked workers would
    copy every object they touch), and gives the utterances back unchanged (speaker aside)."""
    utts = speed_perturb(corpus, (0.9, 1.1))
    dataset = ASRDataset(utts, tokenizer, features=FEATURES)
    assert [dataset.utterance(i) for i in range(len(utts))] == utts
    assert dataset.durations.tolist() == [u.duration for u in utts]
    lists = [v for v in vars(dataset).values() if isinstance(v, (list, tuple))]
    assert lists == []


def test_make_loader_filters_by_duration(corpus, tokenizer, caplog):
    with caplog.at_level(logging.WARNING, logger="asr.data"):
        loader = make_loader(corpus[:4], tokenizer, loader_config(min_duration=0.8, max_duration=1.2), training=False)
    assert sorted(i for b in loader for i in b.ids) == ["g1", "g4"]
    assert "2 utterances outside 0.80-1.2 s left out: g2, g3" in caplog.text
