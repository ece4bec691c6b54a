"""Bad inputs from users, through the library and through `asr <command>` (asr.cli.main).

Each gives one clear line naming the file, the line or the utterance: fatal where DESIGN.md says
(a malformed manifest line, a bad config, a broken corpus list), reported, counted and skipped
where it says (audio that cannot be used). Audio that is only unusual (8 or 96 kHz, six
channels, a single sample) works. The reader's own cases are in test_audio.py, the manifest
reader's in test_manifest.py; here they meet the commands users run.
"""
from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
import torch
from test_api import speechlike, write_model_file

from asr import cli
from asr.audio import SAMPLE_RATE, AudioError, iter_blocks, load_audio
from asr.dataset import ASRDataset, Example, Skipped, collate
from asr.features import FeatureConfig
from asr.manifest import Utterance
from asr.tokenizer import CharTokenizer
from asr.tokens import UNK

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@contextlib.contextmanager
def cli_session(capsys):
    """run(*args) -> (exit code, stdout, stderr) of `asr ARGS` run in this process; the logging
    handlers and torch threads that cli.main sets are put back afterwards."""
    root = logging.getLogger()
    handlers, level, threads = root.handlers[:], root.level, torch.get_num_threads()

    def run(*args) -> tuple[int, str, str]:
        code = cli.main([str(a) for a in args])
        out = capsys.readouterr()
        return code, out.out, out.err

    try:
        yield run
    finally:
        root.handlers[:] = handlers
        root.setLevel(level)
        torch.set_num_threads(threads)


@pytest.fixture
def asr_cli(capsys):
    with cli_session(capsys) as run:
        yield run


def one_error_line(err: str, command: str) -> str:
    """The reason of the one line `asr COMMAND: error: REASON` that ends stderr (no traceback)."""
    assert "Traceback" not in err, err
    last = err.strip().splitlines()[-1]
    assert last.startswith(f"asr {command}: error: "), err
    return last.removeprefix(f"asr {command}: error: ")


# ---------------------------------------------------------------------------------------------
# audio files: unusual ones work, broken ones are one AudioError naming the file


def tone(rate: int, seconds: float, channels: int = 1) -> np.ndarray:
    """(T, C) float32: a 440 Hz sine at amplitude 0.1 * (c + 1) in channel c."""
    t = np.arange(round(rate * seconds)) / rate
    return np.stack([0.1 * (c + 1) * np.sin(2 * np.pi * 440 * t) for c in range(channels)], 1).astype(np.float32)


def chunk_offset(data: bytes, name: bytes) -> int:
    """Offset of the RIFF chunk `name` (its 4-byte id) in a WAV file."""
    position = 12
    while position + 8 <= len(data):
        size = int.from_bytes(data[position + 4:position + 8], "little")
        if data[position:position + 4] == name:
            return position
        position += 8 + size + (size & 1)
    raise ValueError(f"no {name!r} chunk")


def patched_wav(path: Path, *, rate: int | None = None, data_size: int | None = None) -> Path:
    """Rewrite the 'fmt ' sample rate or the 'data' size of a WAV file's header (a lying header)."""
    data = bytearray(path.read_bytes())
    if rate is not None:
        at = chunk_offset(data, b"fmt ") + 12
        data[at:at + 4] = struct.pack("<I", rate)
    if data_size is not None:
        at = chunk_offset(data, b"data") + 4
        data[at:at + 4] = struct.pack("<I", data_size)
    path.write_bytes(data)
    return path


def flac_claiming(path: Path, total_samples: int) -> Path:
    """Rewrite the 36-bit total-samples field of a FLAC file's STREAMINFO block."""
    data = bytearray(path.read_bytes())
    at = 4 + 4 + 10  # "fLaC", the block header, then 10 bytes of block sizes
    field = int.from_bytes(data[at:at + 8], "big")
    field = (field & ~(2**36 - 1)) | total_samples
    data[at:at + 8] = field.to_bytes(8, "big")
    path.write_bytes(data)
    return path


@pytest.mark.parametrize(("rate", "channels", "fmt", "subtype"), [
    (8000, 1, "WAV", "PCM_16"),
    (96000, 1, "FLAC", "PCM_24"),
    (96000, 2, "WAV", "FLOAT"),
    (48000, 6, "WAVEX", "PCM_16"),
    (44100, 6, "FLAC", "PCM_16"),
])
def test_unusual_rates_and_channels_are_resampled_and_mixed_down(tmp_path, rate, channels, fmt, subtype):
    path = tmp_path / f"a.{'flac' if fmt == 'FLAC' else 'wav'}"
    sf.write(path, tone(rate, 0.5, channels), rate, format=fmt, subtype=subtype)
    wave = load_audio(path)
    assert wave.dtype == torch.float32 and wave.shape == (math.ceil(round(rate * 0.5) * SAMPLE_RATE / rate),)
    t = np.arange(len(wave)) / SAMPLE_RATE
    mean_amplitude = 0.1 * (channels + 1) / 2  # the channels' mean
    expected = mean_amplitude * np.sin(2 * np.pi * 440 * t)
    inner = slice(320, -320)  # resampling pads the ends with zeros
    np.testing.assert_allclose(wave.numpy()[inner], expected[inner], atol=2e-3)


def test_zero_and_one_sample(tmp_path):
    sf.write(tmp_path / "zero.wav", np.zeros((0, 1), np.float32), 16000)
    with pytest.raises(AudioError, match="zero.wav: no audio frames"):
        load_audio(tmp_path / "zero.wav")
    sf.write(tmp_path / "one.wav", np.full(1, 0.5, np.float32), 8000)
    assert load_audio(tmp_path / "one.wav").shape == (2,)
    assert torch.cat(list(iter_blocks(tmp_path / "one.wav"))).shape == (2,)
    dataset = ASRDataset([Utterance("one", str(tmp_path / "one.wav"), 0.000125, "A")], None,
                         features=FeatureConfig())
    assert dataset[0] == Skipped("one", "too short for one frame (0.000 s)")


def test_lying_headers_are_one_line_errors_and_cost_nothing(tmp_path):
    """A header that claims more than the file holds, or a rate nothing can use, is refused
    before any allocation its numbers would ask for (a 2^36-sample FLAC: 256 GB of floats)."""
    sf.write(tmp_path / "a.flac", tone(16000, 1.0), 16000)
    huge = flac_claiming(tmp_path / "a.flac", 2**36 - 1)
    cases = {
        huge: "truncated",
        patched_wav(sf.write(tmp_path / "b.wav", tone(16000, 1.0), 16000) or tmp_path / "b.wav",
                    data_size=0x70000000): "truncated: the header announces",
        patched_wav(sf.write(tmp_path / "c.wav", tone(16000, 0.2), 16000) or tmp_path / "c.wav",
                    rate=16001): "resampling 16001 Hz to 16000 Hz needs a",
        patched_wav(sf.write(tmp_path / "d.wav", tone(16000, 0.2), 16000) or tmp_path / "d.wav",
                    rate=64): "sample rate 64 Hz is too low",
    }
    for path, reason in cases.items():
        for read in (load_audio, lambda p: list(iter_blocks(p))):
            with pytest.raises(AudioError) as err:
                read(path)
            assert str(err.value).startswith(f"{path}: ") and reason in str(err.value)
            assert "\n" not in str(err.value)
    # a streaming writer's "size unknown" (0xFFFFFFFF) is no lie: what is there is read
    streamed = patched_wav(sf.write(tmp_path / "e.wav", tone(16000, 0.5), 16000) or tmp_path / "e.wav",
                           data_size=0xFFFFFFFF)
    assert load_audio(streamed).shape == (8000,)


def test_waveforms_in_memory_at_unusable_rates_are_refused():
    from asr.audio import to_mono_16k

    with pytest.raises(ValueError, match="too low for speech"):
        to_mono_16k(np.zeros(100, np.float32), 100)
    with pytest.raises(ValueError, match="needs a .* MB filter"):
        to_mono_16k(np.zeros(100, np.float32), 16001)
    with pytest.raises(ValueError, match="positive whole number"):
        to_mono_16k(np.zeros(100, np.float32), 16000.5)


def fuzzer():
    """tools/reliability_report.py: mutated WAV / FLAC files through every reader."""
    sys.path.insert(0, str(ROOT / "tools"))
    import reliability_report

    return reliability_report


def test_mutated_files_only_ever_raise_audio_error(tmp_path):
    """A couple of seconds of the fuzzing run, in this process (no address-space cap)."""
    report = fuzzer().fuzz(2.0, seed=1234, workdir=tmp_path, cap_memory=False)
    assert report["failures"] == [], report["failures"]
    assert report["cases"] >= 100 and report["read"] > 0 and report["refused"] > 0


@pytest.mark.slow
def test_fuzzing_the_audio_reader(tmp_path):
    """30 s of mutated files in a process of its own: a crash of libsndfile fails the test and
    names its case; an allocation sized by a lying header fails it as a MemoryError."""
    out = subprocess.run([sys.executable, ROOT / "tools" / "reliability_report.py", "fuzz", "--seconds", "30",
                          "--seed", "0", "--workdir", tmp_path, "--out", tmp_path / "fuzz.json"],
                         capture_output=True, text=True, timeout=300)
    case = (tmp_path / "case.txt").read_text() if (tmp_path / "case.txt").exists() else "none"
    assert out.returncode == 0, f"exit {out.returncode}, last case (seed index) {case}: {out.stderr[-2000:]}"
    report = json.loads((tmp_path / "fuzz.json").read_text())
    assert report["failures"] == [] and report["cases"] >= 1000


# ---------------------------------------------------------------------------------------------
# a manifest of good and bad audio through asr decode, asr transcribe and asr cmvn


@pytest.fixture(scope="module")
def mixed(tmp_path_factory) -> tuple[Path, Path, dict[str, str]]:
    """(model file, manifest, {bad id: words its reason must hold}): 5 good utterances of unusual
    formats and 9 bad ones, one of each kind."""
    folder = tmp_path_factory.mktemp("mixed")
    good = speechlike(1.0, 3)
    lines, bad = [], {}

    def add(utt_id: str, path: Path, duration: float, why: str | None = None) -> None:
        lines.append({"id": utt_id, "audio": path.name, "duration": duration, "text": "AB CD"})
        if why:
            bad[utt_id] = why

    sf.write(folder / "g16.wav", good, 16000)
    add("good16k", folder / "g16.wav", 1.0)
    sf.write(folder / "g8.wav", good[::2], 8000)
    add("good8k", folder / "g8.wav", 1.0)
    sf.write(folder / "g96.flac", np.repeat(good, 6), 96000, subtype="PCM_24")
    add("good96k", folder / "g96.flac", 1.0)
    sf.write(folder / "g6.wav", np.stack([good] * 6, 1), 16000, format="WAVEX")
    add("good6ch", folder / "g6.wav", 1.0)
    sf.write(folder / "long.flac", speechlike(2.0, 4), 16000)
    add("good2s", folder / "long.flac", 2.0)

    sf.write(folder / "cut.wav", good, 16000)
    (folder / "cut.wav").write_bytes((folder / "cut.wav").read_bytes()[:9000])
    add("truncated", folder / "cut.wav", 1.0, "truncated")
    nan = good.copy()
    nan[8000] = np.nan
    sf.write(folder / "nan.wav", nan, 16000, subtype="FLOAT")
    add("nan", folder / "nan.wav", 1.0, "nan samples")
    sf.write(folder / "huge.flac", good, 16000)
    add("huge", flac_claiming(folder / "huge.flac", 2**36 - 1), 1.0, "truncated")
    sf.write(folder / "odd.wav", good, 16000)
    add("oddrate", patched_wav(folder / "odd.wav", rate=16001), 1.0, "needs a")
    (folder / "empty.wav").write_bytes(b"")
    add("empty", folder / "empty.wav", 1.0, "empty file")
    sf.write(folder / "one.wav", good[:1], 16000)
    add("onesample", folder / "one.wav", 0.0625, "too short for one frame")
    add("missing", folder / "gone.flac", 1.0, "no such file")
    (folder / "notes.wav").write_text("not audio at all\n" * 20)
    add("text", folder / "notes.wav", 1.0, "not an audio file")
    sf.write(folder / "short.wav", good[:8000], 16000)
    add("wronglen", folder / "short.wav", 1.0, "differs from duration")

    manifest = folder / "test.jsonl"
    manifest.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return write_model_file(folder / "model.pt"), manifest, bad


def test_decode_reports_counts_and_skips_every_bad_utterance(mixed, tmp_path, asr_cli):
    model, manifest, bad = mixed
    code, out, err = asr_cli("decode", "--model", model, "--manifest", manifest, "--out-dir", tmp_path,
                             "--beam-size", "2", "decoding.num_workers=0", "--device", "cpu")
    assert code == 0, err
    assert "Traceback" not in err
    wer = json.loads((tmp_path / "wer.json").read_text())
    assert (wer["utterances"], wer["skipped"]) == (14, len(bad))
    assert f"({len(bad)} skipped: empty hypotheses)" in out.strip().splitlines()[-1]
    warnings = [line for line in err.splitlines() if "skipped (empty hypothesis)" in line]
    assert len(warnings) == len(bad)
    for utt_id, words in bad.items():
        (line,) = [w for w in warnings if w.startswith(f"{utt_id}: ")]
        assert words in line.lower(), line
    hyps = dict((line.split(" ", 1) + [""])[:2] for line in (tmp_path / "hyp.txt").read_text().splitlines())
    assert set(hyps) == {json.loads(line)["id"] for line in manifest.read_text().splitlines()}
    assert all(hyps[utt_id] == "" for utt_id in bad)


def test_transcribe_goes_on_past_bad_files_and_fails_at_the_end(mixed, asr_cli):
    model, manifest, bad = mixed
    folder = manifest.parent
    files = [folder / name for name in ("g8.wav", "cut.wav", "g96.flac", "huge.flac", "odd.wav", "one.wav",
                                         "gone.flac", "g6.wav")]
    code, out, err = asr_cli("transcribe", "--model", model, "--device", "cpu", "--beam-size", "2", *files)
    assert code == 1 and "Traceback" not in err
    assert [line.split("\t")[0] for line in out.splitlines()] == [
        str(folder / n) for n in ("g8.wav", "cut.wav", "g96.flac", "huge.flac", "one.wav", "g6.wav")]
    errors = err.strip().splitlines()
    assert errors[-1] == "asr transcribe: 2 of 8 inputs failed"
    for name in ("odd.wav", "gone.flac"):
        assert sum(line.startswith(f"asr transcribe: error: {folder / name}: ") for line in errors) == 1
    for name in ("cut.wav", "huge.flac"):  # cut short: transcribed as far as they go, with a warning
        assert sum(line.startswith(f"{folder / name}: truncated") for line in errors) == 1, err


def test_non_utf8_file_names_transcribe(tmp_path):
    """A file whose name is not UTF-8 transcribes, through the API (given as bytes or as os.fsdecode's
    str, which Result.path keeps, so os.fsencode gives the name back) and through `asr transcribe`
    (its argument as Python decodes argv); so does a WAV named .raw (libsndfile picks the decoder by
    the content). A NUL in a name is a one-line error, the name escaped."""
    from asr.api import load_model

    model = write_model_file(tmp_path / "model.pt", eos_bias=0.0)
    name = bytes(tmp_path) + b"/caf\xe9 \xff.wav"
    sf.write(tmp_path / "plain.wav", speechlike(1.5, 3), 16000)
    with open(name, "wb") as f:
        f.write((tmp_path / "plain.wav").read_bytes())
    (tmp_path / "plain.raw").write_bytes((tmp_path / "plain.wav").read_bytes())
    recognizer = load_model(model)
    inputs = [name, os.fsdecode(name), str(tmp_path / "plain.raw"), str(tmp_path / "plain.wav"), f"{tmp_path}/a\0.wav"]
    results = recognizer.transcribe(inputs, beam_size=2)
    assert [r.error for r in results[:4]] == [None] * 4
    assert len({r.text for r in results[:4]}) == 1 and results[0].text
    assert results[0].path == results[1].path == os.fsdecode(name) and os.fsencode(results[0].path) == name
    assert results[0].duration == pytest.approx(1.5)
    assert results[4].error == f"{tmp_path}/a\\x00.wav: a file name cannot hold a NUL character"

    done = subprocess.run([sys.executable, "-m", "asr.cli", "transcribe", "--model", model, "--beam-size", "2",
                           name, tmp_path / "plain.raw"], capture_output=True, timeout=300)
    assert done.returncode == 0 and b"Traceback" not in done.stderr, done.stderr
    text = results[0].text.encode()
    assert done.stdout.splitlines() == [name + b"\t" + text, bytes(tmp_path / "plain.raw") + b"\t" + text]


def test_a_cut_file_is_transcribed_with_a_warning(tmp_path, caplog):
    """A file cut short (here an Ogg file cut at a page boundary, which decodes without error) is
    transcribed as far as it goes, and its Result says so in a warning naming the file, also logged
    (the command prints it)."""
    from asr.api import load_model

    sf.write(tmp_path / "whole.ogg", speechlike(3.0, 4), 16000, format="OGG", subtype="VORBIS")
    data = (tmp_path / "whole.ogg").read_bytes()
    (tmp_path / "half.ogg").write_bytes(data[:data.rfind(b"OggS", 0, len(data) // 2)])
    recognizer = load_model(write_model_file(tmp_path / "model.pt", eos_bias=0.0))
    with caplog.at_level(logging.WARNING, logger="asr.api"):
        half, whole = recognizer.transcribe([tmp_path / "half.ogg", tmp_path / "whole.ogg"], beam_size=2)
    assert half.error is None and 0.5 < half.duration < 2.0 and whole.duration == pytest.approx(3.0)
    message = (f"{tmp_path / 'half.ogg'}: truncated: the Ogg stream ends without its end-of-stream page "
               "(the file was cut)")
    assert half.warnings == (message,) and whole.warnings == ()
    assert [r.getMessage() for r in caplog.records] == [message]


def test_cmvn_counts_what_it_skips(mixed, tmp_path, asr_cli):
    _, manifest, bad = mixed
    code, out, err = asr_cli("cmvn", "--manifest", manifest, "--out", tmp_path / "cmvn.json", "--num-workers", "0")
    assert code == 0 and "Traceback" not in err
    assert f"cmvn: 5 utterances, 590 frames, {len(bad)} skipped" in err  # 98 frames a second, 198 for 2 s
    assert "global CMVN over 590 frames of 14 utterances" in out


# ---------------------------------------------------------------------------------------------
# text: empty, not UTF-8, outside the vocabulary


def test_empty_transcripts_train(one_thread):
    """An utterance with an empty transcript is a valid target (eos alone), even a whole batch of them."""
    from small_models import small_model

    model = small_model().train()
    examples = [Example("a", torch.randn(60, 16), torch.tensor([2, 3])), Example("b", torch.randn(40, 16),
                                                                                 torch.zeros(0, dtype=torch.long))]
    for batch in (collate(examples), collate(examples[1:])):
        out = model(batch.feats, batch.feat_lens, batch.tokens, batch.token_lens, num_tokens=3.0, num_utts=2.0)
        assert torch.isfinite(out.loss)
        out.loss.backward()
        assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
        model.zero_grad()


def test_text_outside_the_vocabulary_maps_to_unk_and_is_reported(tmp_path, caplog):
    from asr.train_setup import label_rate

    tokenizer = CharTokenizer(list(" ABCDEFGHIJKLMNOPQRSTUVWXYZ'"))
    sf.write(tmp_path / "a.wav", speechlike(1.0), 16000)
    utts = [Utterance("u1", str(tmp_path / "a.wav"), 1.0, "Hello мир, 你好!"), Utterance("u2", "x", 1.0, "ÉTÉ")]
    example = ASRDataset(utts, tokenizer, features=FeatureConfig())[0]
    assert example.tokens.tolist().count(UNK) == 5 and tokenizer.decode(example.tokens) == "HELLO"
    with caplog.at_level(logging.WARNING, logger="asr.train"):
        label_rate(tokenizer, utts)
    assert "7 symbols of the training text map to unk: 'É' x2" in caplog.text and "'М' x1" in caplog.text


def test_text_files_that_are_not_utf8_name_the_file_and_line(tmp_path, asr_cli):
    manifest = tmp_path / "m.jsonl"
    manifest.write_bytes(b'{"id": "a", "audio": "a.wav", "duration": 1, "text": "A"}\n'
                         b'{"id": "b", "audio": "b.wav", "duration": 1, "text": "caf\xe9"}\n')
    kaldi = tmp_path / "kaldi"
    kaldi.mkdir()
    sf.write(tmp_path / "a.wav", tone(16000, 0.5), 16000)
    (kaldi / "wav.scp").write_text(f"a {tmp_path / 'a.wav'}\n")
    (kaldi / "text").write_bytes(b"a HELLO\nb W\xffRLD\n")
    chapter = tmp_path / "ls" / "dev-clean" / "1" / "10"
    chapter.mkdir(parents=True)
    sf.write(chapter / "1-10-0000.flac", tone(16000, 0.5), 16000)
    (chapter / "1-10.trans.txt").write_bytes(b"1-10-0000 \xc3\x28\n")
    runs = {
        "decode": (["--model", tmp_path / "none.pt", "--manifest", manifest, "--out-dir", tmp_path / "d"],
                   f"{manifest}:2: not UTF-8 text"),
        "cmvn": (["--manifest", manifest, "--out", tmp_path / "c.json"], f"{manifest}:2: not UTF-8 text"),
        "tokenizer": (["--manifest", manifest, "--kind", "char", "--out", tmp_path / "t"],
                      f"{manifest}:2: not UTF-8 text"),
        "prepare": (["kaldi", kaldi, tmp_path / "k.jsonl"], f"{kaldi / 'text'}:2: not UTF-8 text"),
        "wer": ([kaldi / "text", kaldi / "text"], f"{kaldi / 'text'}:2: not UTF-8 text"),
    }
    for command, (args, reason) in runs.items():
        code, _, err = asr_cli(command, *args)
        assert code == 1 and one_error_line(err, command) == reason, err
    code, _, err = asr_cli("prepare", "librispeech", tmp_path / "ls", tmp_path / "out")
    assert code == 1
    assert one_error_line(err, "prepare") == f"{chapter / '1-10.trans.txt'}:1: not UTF-8 text"


# ---------------------------------------------------------------------------------------------
# manifests and configs: fatal, one line naming the file and line / key


def manifest_line(**changes) -> str:
    return json.dumps({"id": "a", "audio": "a.wav", "duration": 1.0, "text": "A"} | changes)


BAD_MANIFEST_LINES = [
    ('{"id": "b", "audio": "b.wav",', "bad JSON: Expecting property name enclosed in double quotes (column 30)"),
    (manifest_line(id="b", duration=None), "field 'duration' is null"),
    ('{"id": "b", "audio": "b.wav", "text": "B"}', "missing field 'duration'"),
    (manifest_line(id="b", duration=-2.5), "duration must be positive, got -2.5"),
    (manifest_line(), "duplicate id a (first on line 1)"),
    ('{"id": "b", "audio": "b.wav", "duration": 1' + "0" * 400 + ', "text": "B"}', "field 'duration' must be finite"),
    ("[" * 100_000 + "]" * 100_000, "bad JSON: nested too deeply"),
    ('{"id": "b", "audio": "b.wav", "duration": 1, "text": "\\ud83d"}', "field 'text' is not valid Unicode"),
    ('{"id": "b", "audio": "b\\u0000.wav", "duration": 1, "text": "B"}', "audio holds a NUL character"),
]


@pytest.mark.parametrize(("line", "reason"), BAD_MANIFEST_LINES, ids=[r for _, r in BAD_MANIFEST_LINES])
def test_every_command_stops_at_a_malformed_manifest_line(tmp_path, asr_cli, line, reason):
    manifest = tmp_path / "m.jsonl"
    manifest.write_text(manifest_line() + "\n\n" + line + "\n" + manifest_line(id="c") + "\n")
    conf = ROOT / "conf" / "tiny.yaml"
    runs = {
        "decode": ["--model", tmp_path / "none.pt", "--manifest", manifest, "--out-dir", tmp_path / "d"],
        "cmvn": ["--manifest", manifest, "--out", tmp_path / "c.json"],
        "tokenizer": ["--manifest", manifest, "--kind", "char", "--out", tmp_path / "t"],
        "train": ["--config", conf, "--train", manifest, "--valid", manifest, "--exp-dir", tmp_path / "exp"],
    }
    for command, args in runs.items():
        code, _, err = asr_cli(command, *args)
        assert code == 1, (command, err)
        message = one_error_line(err, command)
        assert message.startswith(f"{manifest}:3: ") and reason in message, (command, message)
        assert len(err.strip().splitlines()) == 1, (command, err)
    assert not any((tmp_path / name).exists() for name in ("d", "c.json", "t", "exp"))
    if any(word in reason for word in ("JSON", "duplicate", "text")):  # what `asr wer` reads: id and text
        code, _, err = asr_cli("wer", manifest, manifest)
        assert code == 1 and one_error_line(err, "wer").startswith(f"{manifest}:3: ")


@pytest.mark.parametrize(("yaml_text", "reason"), [
    ("model:\n  d_modl: 64\n", "unknown key 'model.d_modl'"),
    ("training:\n  lr: fast\n", "'training.lr' must be a number, got str 'fast'"),
    ("training:\n  epochs: 2.5\n", "'training.epochs' must be an integer, got float 2.5"),
    ("data:\n  speed_perturb: 0.9\n", "'data.speed_perturb' must be a list"),
    ("training:\n  lr: [1\n", "bad.yaml:3: invalid YAML"),
    ("- just\n- a list\n", "the top level must be a mapping of sections"),
])
def test_a_bad_training_config_is_one_line_naming_the_key(tmp_path, asr_cli, yaml_text, reason):
    (tmp_path / "bad.yaml").write_text(yaml_text)
    manifest = tmp_path / "m.jsonl"
    manifest.write_text(manifest_line() + "\n")
    code, _, err = asr_cli("train", "--config", tmp_path / "bad.yaml", "--train", manifest, "--valid", manifest,
                           "--exp-dir", tmp_path / "exp")
    assert code == 1 and reason in one_error_line(err, "train")
    assert len(err.strip().splitlines()) == 1 and not (tmp_path / "exp").exists()


def test_bad_overrides_and_decoding_configs_name_the_key(tmp_path, asr_cli):
    conf = ROOT / "conf" / "tiny.yaml"
    manifest = tmp_path / "m.jsonl"
    manifest.write_text(manifest_line() + "\n")
    train = ["train", "--config", conf, "--train", manifest, "--valid", manifest, "--exp-dir", tmp_path / "exp"]
    for override, reason in [("training.epochs=many", "'training.epochs' must be an integer"),
                             ("training.nope=1", "unknown key 'training.nope'"),
                             ("lr", "override 'lr': expected section.key=value")]:
        code, _, err = asr_cli(*train, override)
        assert code == 1 and reason in one_error_line(err, "train"), err
    (tmp_path / "dec.yaml").write_text("beam_size: ten\n")
    decode = ["decode", "--model", tmp_path / "none.pt", "--manifest", manifest, "--out-dir", tmp_path / "d"]
    code, _, err = asr_cli(*decode, "--config", tmp_path / "dec.yaml")
    assert code == 1 and "'beam_size' must be an integer" in one_error_line(err, "decode")
    code, _, err = asr_cli(*decode, "decoding.mode=fastest")
    assert code == 1 and "decoding.mode = 'fastest' must be one of" in one_error_line(err, "decode")


def test_a_speed_factor_too_costly_to_resample_is_refused(tmp_path, asr_cli):
    """0.9137 means resampling 14619 Hz to 16 kHz: a 893 MB filter for every copy."""
    sf.write(tmp_path / "a.wav", tone(16000, 0.5), 16000)
    (tmp_path / "kaldi").mkdir()
    (tmp_path / "kaldi" / "wav.scp").write_text(f"a {tmp_path / 'a.wav'}\n")
    code, _, err = asr_cli("prepare", "kaldi", tmp_path / "kaldi", tmp_path / "m.jsonl",
                           "--speed-perturb", "0.9,0.9137")
    assert code == 1
    assert one_error_line(err, "prepare") == ("speed 0.9137: resampling 14619 Hz to 16000 Hz needs a 893 MB filter; "
                                              "use a factor of at most three decimals")


# ---------------------------------------------------------------------------------------------
# corpus trees with stray files and missing transcripts


def test_librispeech_tree_with_stray_files_and_missing_transcripts(tmp_path, asr_cli):
    root = tmp_path / "LibriSpeech"
    part = root / "dev-clean"
    for name in ("README.TXT", "LICENSE.TXT", "SPEAKERS.TXT", ".DS_Store"):
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text("stray\n")
    chapter = part / "1" / "10"
    chapter.mkdir(parents=True)
    for i in range(2):
        sf.write(chapter / f"1-10-{i:04d}.flac", tone(16000, 0.5 + 0.25 * i), 16000)
    (chapter / "1-10.trans.txt").write_text("1-10-0000 HELLO THERE\n1-10-0001 general kenobi!\n")
    (chapter / "notes.txt").write_text("not a transcript\n")
    (chapter / ".DS_Store").write_bytes(b"\x00\x01")
    sf.write(chapter / "1-10-0002.wav", tone(16000, 0.5), 16000)  # not a .flac: not LibriSpeech's
    (part / "1" / "11").mkdir()  # a chapter folder left empty
    untranscribed = part / "2" / "20"
    untranscribed.mkdir(parents=True)
    sf.write(untranscribed / "2-20-0000.flac", tone(16000, 0.5), 16000)  # a chapter without trans.txt
    (part / "3").mkdir()  # a speaker without chapters
    (part / "stray.flac").write_bytes(b"fLaC")
    code, out, err = asr_cli("prepare", "librispeech", tmp_path, tmp_path / "out")
    assert code == 0 and "Traceback" not in err
    lines = [json.loads(line) for line in (tmp_path / "out" / "dev-clean.jsonl").read_text().splitlines()]
    assert [(u["id"], u["text"], u["duration"]) for u in lines] == [
        ("1-10-0000", "HELLO THERE", 0.5), ("1-10-0001", "GENERAL KENOBI", 0.75)]
    assert f"{untranscribed / '2-20-0000.flac'}: audio file with no transcript line; skipped" in err
    assert "2 utterances; 1 skipped (0 without audio, 1 without transcript, 0 unreadable)" in err
    assert out.strip() == f"{tmp_path / 'out' / 'dev-clean.jsonl'}: 2 utterances"


@pytest.mark.slow
def test_training_reports_counts_and_skips_unusable_audio(mixed, tmp_path, asr_cli):
    _, manifest, bad = mixed
    conf = ROOT / "conf" / "tiny.yaml"
    code, _, err = asr_cli("train", "--config", conf, "--train", manifest, "--valid", manifest, "--exp-dir",
                           tmp_path / "exp", "training.epochs=1", "training.valid_decode_utts=0",
                           "data.max_batch_seconds=4")
    assert code == 0 and "Traceback" not in err, err[-3000:]
    for utt_id, words in bad.items():
        assert sum(line.startswith(f"{utt_id}: ") and words in line.lower() for line in err.splitlines()) >= 1, utt_id
    assert f"{len(bad)} training utterances skipped so far" in err
