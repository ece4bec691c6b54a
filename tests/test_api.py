"""The Python API: load_model, transcribe (files, waveforms, failures, long audio), formats."""
from __future__ import annotations

import dataclasses
import json
import math
import random
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
import torch
from test_beam_search import tiny_model

import asr
import asr.decoding
from asr.api import Recognizer, Result, Segment, load_model
from asr.audio import RawFormat
from asr.checkpoint import CheckpointError, model_file, save_atomic
from asr.config import to_dict
from asr.features import CMVNStats, FeatureConfig, fbank
from asr.formats import format_results
from asr.model import ASRModel
from asr.search import Hypothesis
from asr.segmentation import SegmentOptions, segment_audio
from asr.tokenizer import CharTokenizer

TOKENS = list("ABCDEFGH ")  # V = 12, the tiny model's vocabulary


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def speechlike(seconds: float, seed: int = 0, *, pauses: bool = True) -> np.ndarray:
    """(T,) float32 16 kHz: noisy harmonic bursts of 0.4-1.5 s, separated by 0.3-0.8 s pauses of faint noise."""
    rng = np.random.default_rng(seed)
    n = int(seconds * 16000)
    out = rng.normal(0, 1e-4, n).astype(np.float32)
    t = 0
    while t < n:
        burst = int(rng.uniform(0.4, 1.5) * 16000)
        k = np.arange(min(burst, n - t))
        f0 = rng.uniform(100, 250)
        voice = sum(np.sin(2 * np.pi * f0 * h * k / 16000) / h for h in range(1, 6)) * 0.1
        out[t:t + k.size] += (voice + rng.normal(0, 0.02, k.size)).astype(np.float32)
        t += burst + (int(rng.uniform(0.3, 0.8) * 16000) if pauses else 0)
    return out


def write_decode_files(folder: Path, text: str = "AB HE") -> Path:
    """Four speech-like WAVs u0..u3 in folder, test.jsonl listing them (each with `text`), and a
    model file (write_model_file, eos_bias 0); returns the model file."""
    lines = []
    for i, seconds in enumerate([1.2, 2.5, 0.7, 1.9]):
        sf.write(folder / f"u{i}.wav", speechlike(seconds, i), 16000)
        lines.append({"id": f"utt{i}", "audio": f"u{i}.wav", "duration": seconds, "text": text})
    (folder / "test.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    return write_model_file(folder / "model.pt", eos_bias=0.0)


def write_model_file(path: Path, *, seed: int = 0, eos_bias: float = 3.0, blank_bias: float = 0.0,
                     streaming: bool = False) -> Path:
    """A model file of a random tiny model (float32, character tokens A-H and space), CMVN from
    speech-like audio; `eos_bias` makes its decoder end hypotheses early, `blank_bias` its CTC
    head hear nothing; `streaming`: a conformer with causal convolutions (asr.streaming)."""
    model = tiny_model(seed, dtype=torch.float32)
    if streaming:
        torch.manual_seed(seed)
        model = ASRModel(dataclasses.replace(model.config, encoder="conformer", conv_kernel=5,
                                             causal_conv=True)).eval()
        with torch.no_grad():  # peaked outputs, as tiny_model's
            model.decoder.output.weight.mul_(4.0)
            model.ctc.weight.mul_(4.0)
    with torch.no_grad():
        model.decoder.output.bias[model.config.eos] += eos_bias
        model.ctc.bias[0] += blank_bias
    stats = CMVNStats()
    stats.add(fbank(torch.from_numpy(speechlike(5.0, seed)), FeatureConfig()))
    obj = model_file(model=to_dict(model.config), tokenizer=CharTokenizer(TOKENS).to_dict(),
                     frontend={"features": to_dict(FeatureConfig()), "cmvn": stats.to_dict()},
                     state_dict=model.state_dict())
    save_atomic(obj, path)
    return path


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> Path:
    return write_model_file(tmp_path_factory.mktemp("model") / "model.pt")


@pytest.fixture(scope="module")
def recognizer(model_path) -> Recognizer:
    return load_model(model_path)


@pytest.fixture(scope="module")
def talking(tmp_path_factory) -> Recognizer:
    """A recognizer whose model writes something (eos_bias 0): comparisons of its outputs are
    not of empty transcripts."""
    return load_model(write_model_file(tmp_path_factory.mktemp("talking") / "model.pt", eos_bias=0.0))


def test_load_model(model_path, tmp_path):
    rec = asr.load_model(str(model_path), device="cpu")
    assert isinstance(rec, Recognizer) and not rec.model.training
    assert rec.tokenizer.vocab_size == rec.model.config.vocab_size == 12
    (tmp_path / "junk.pt").write_bytes(b"not a model")
    with pytest.raises(CheckpointError, match="junk.pt"):
        load_model(tmp_path / "junk.pt")
    obj = torch.load(model_path, weights_only=True)
    obj["state_dict"].pop("ctc.weight")
    save_atomic(obj, tmp_path / "bad.pt")
    with pytest.raises(CheckpointError, match="bad.pt: weights do not fit"):
        load_model(tmp_path / "bad.pt")


def test_files_and_waveforms_give_the_same_result(talking, tmp_path):
    recognizer = talking
    wave = speechlike(3.0, 1)
    sf.write(tmp_path / "a.wav", wave, 16000, subtype="FLOAT")
    sf.write(tmp_path / "a48.flac", np.interp(np.arange(0, wave.size, 1 / 3), np.arange(wave.size), wave), 48000)
    (from_file,) = recognizer.transcribe(tmp_path / "a.wav")
    (from_array,) = recognizer.transcribe((wave, 16000))
    (from_tensor,) = recognizer.transcribe((torch.from_numpy(np.stack([wave, wave], axis=1)), 16000))
    assert from_file.path == str(tmp_path / "a.wav") and from_array.path is None
    assert from_file.error is None and from_file.text == from_array.text == from_tensor.text
    assert from_file.text and from_file.tokens  # not two empty outputs
    assert from_file.tokens == from_array.tokens and from_file.duration == pytest.approx(3.0)
    assert from_file.score == pytest.approx(from_array.score, abs=1e-4)
    (resampled,) = recognizer.transcribe(str(tmp_path / "a48.flac"))
    assert resampled.error is None and resampled.duration == pytest.approx(3.0, abs=1e-3)


def test_a_file_that_fails_is_reported_and_the_others_go_on(recognizer, tmp_path):
    good = tmp_path / "good.wav"
    sf.write(good, speechlike(2.0, 2), 16000)
    (tmp_path / "corrupt.wav").write_bytes(b"RIFF" + bytes(range(200)))
    results = recognizer.transcribe([tmp_path / "missing.wav", tmp_path / "corrupt.wav", good, ("x", 16000)])
    assert [r.error is None for r in results] == [False, False, True, False]
    assert results[0].error.startswith(str(tmp_path / "missing.wav") + ": ")
    assert results[1].error.startswith(str(tmp_path / "corrupt.wav") + ": ")
    assert "\n" not in results[1].error and results[3].error.startswith("<waveform>: ")
    with pytest.raises(TypeError, match="sample rate"):
        recognizer.transcribe(np.zeros(16000, np.float32))
    assert results[2].text == recognizer.transcribe(good)[0].text


def test_a_decoding_error_is_raised_not_blamed_on_the_input_being_read(recognizer, monkeypatch):
    """Reading the second input fills a batch whose decoding (of the first input's segment too)
    fails: that error is the decoding's, raised, not a read error of the second input; and the
    first input's segment is not left behind to be decoded again."""
    waves = [(speechlike(1.5, i), 16000) for i in range(3)]
    encoder, calls = recognizer.model.encoder, []

    def fails_once(*args):
        calls.append(args[0].size(0))
        if len(calls) == 1:
            raise ValueError("the encoder broke")
        return type(encoder).forward(encoder, *args)

    monkeypatch.setattr(encoder, "forward", fails_once)
    with pytest.raises(ValueError, match="the encoder broke"):
        recognizer.transcribe(waves, batch_size=2, beam_size=2)
    assert calls == [2]  # nothing decoded after the failure, nothing decoded twice
    monkeypatch.undo()
    assert all(r.error is None for r in recognizer.transcribe(waves, batch_size=2, beam_size=2))


def test_audio_too_short_or_silent_gives_empty_text(recognizer, monkeypatch):
    decoded = []
    original = asr.decoding.decode_memory
    monkeypatch.setattr(asr.decoding, "decode_memory", lambda *a: decoded.append(1) or original(*a))
    inputs = [(np.zeros(0, np.float32), 16000), (speechlike(0.02), 16000), (np.zeros(48000, np.int16), 16000),
              (speechlike(0.06), 16000)]
    results = recognizer.transcribe(inputs)
    assert [r.text for r in results] == ["", "", "", ""] and all(r.error is None for r in results)
    assert [r.duration for r in results] == pytest.approx([0.0, 0.02, 3.0, 0.06])
    assert decoded == []  # nothing held speech or an encoder frame


def test_batched_transcription_equals_one_at_a_time(talking):
    waves = [(speechlike(s, i), 16000) for i, s in enumerate([1.5, 3.0, 0.8, 2.2])]
    together = talking.transcribe(waves, batch_size=3, beam_size=4)
    assert all(result.text and result.tokens for result in together)  # not empty outputs compared
    for wave, result in zip(waves, together):
        (alone,) = talking.transcribe(wave, beam_size=4)
        assert (alone.text, alone.tokens) == (result.text, result.tokens)
        assert alone.score == pytest.approx(result.score, abs=1e-4)



class ContractOnly:
    """A model's inference contract (asr.inference.InferenceModel) and nothing more: no encoder, no
    decoder, no parameters to look at."""

    def __init__(self, model) -> None:
        self._model, self.config = model, model.config

    @property
    def device(self) -> torch.device:
        return self._model.device

    @property
    def min_frames(self) -> int:
        return self._model.min_frames

    @property
    def chunked_attention(self) -> bool:
        return self._model.chunked_attention

    def encode(self, feats, feat_lens, **chunks):
        return self._model.encode(feats, feat_lens, **chunks)

    def ctc_log_probs(self, memory):
        return self._model.ctc_log_probs(memory)

    def init_cache(self, memory, memory_lens, *, rows, capacity=64):
        return self._model.init_cache(memory, memory_lens, rows=rows, capacity=capacity)

    def step(self, last_tokens, cache):
        return self._model.step(last_tokens, cache)

    def teacher_forced(self, tokens, token_lens, memory, memory_lens):
        return self._model.teacher_forced(tokens, token_lens, memory, memory_lens)


@pytest.mark.parametrize("mode", ["attention", "ctc_rescore", "greedy"])
def test_the_decoding_task_reads_the_model_through_its_contract_alone(talking, mode):
    """DecodingTask drives anything that implements asr.inference.InferenceModel: a wrapper that
    has the contract's members and nothing else decodes (and aligns) as the model itself, the
    short-input rule included (min_frames)."""
    options = asr.decoding.DecodingOptions(mode=mode, beam_size=3)
    waves = [torch.from_numpy(speechlike(s, i)) for i, s in enumerate([1.5, 0.02, 2.2])]
    feats = [talking.feats(w) for w in waves]
    assert feats[1].size(0) < talking.model.min_frames <= feats[0].size(0)
    seconds = [w.numel() / 16000 for w in waves]
    want = asr.decoding.DecodingTask(talking.model, talking.tokenizer, options).run_aligned(feats, seconds)
    got = asr.decoding.DecodingTask(ContractOnly(talking.model), talking.tokenizer, options).run_aligned(feats, seconds)
    assert [n[0].tokens for n, _ in got] == [n[0].tokens for n, _ in want] and want[0][0][0].tokens
    assert [w for _, w in got] == [w for _, w in want] and got[1] == ((Hypothesis((), 0.0),), [])


def test_the_recognizer_gives_the_features_of_waveforms_and_of_manifests(talking, tmp_path):
    """Recognizer.dataset computes, in the loader's process, the features `feats` gives (the
    decode path and the transcribe path read the same numbers); unusable audio is Skipped."""
    from asr.dataset import Example, Skipped
    from asr.manifest import Utterance

    wave = speechlike(1.3, 7)
    sf.write(tmp_path / "a.wav", wave, 16000, subtype="FLOAT")
    utts = [Utterance("a", str(tmp_path / "a.wav"), 1.3, "AB"), Utterance("gone", str(tmp_path / "gone.wav"), 1.0, "")]
    dataset = talking.dataset(utts)
    first, missing = dataset[0], dataset[1]
    assert isinstance(first, Example) and isinstance(missing, Skipped) and missing.id == "gone"
    assert torch.equal(first.feats, talking.feats(torch.from_numpy(wave)).cpu())


def test_segments_cut_at_pauses_whatever_the_blocks():
    wave = torch.from_numpy(speechlike(30.0, 3))
    options = SegmentOptions(max_seconds=4.0, min_seconds=1.0)
    energy = torch.from_numpy(np.abs(speechlike(30.0, 3)))
    for block in (0.3, 7.0, 40.0):
        segments = list(segment_audio(wave.split(int(block * 16000)), options))
        starts = [s for s, _ in segments]
        assert torch.equal(torch.cat([w for _, w in segments]), wave)
        assert starts == sorted(starts) and starts[0] == 0
        assert all(1.0 * 16000 <= w.numel() <= 5.0 * 16000 for _, w in segments)
        assert all(w.numel() <= 4.0 * 16000 for _, w in segments[:-1])
        for s in starts[1:]:  # a cut inside a pause: faint noise around it
            assert float(energy[s - 800:s + 800].max()) < 1e-3
        if block == 0.3:
            first = segments
        assert [(s, w.numel()) for s, w in segments] == [(s, w.numel()) for s, w in first]


def test_a_tiny_last_piece_joins_the_segment_before():
    options = SegmentOptions(max_seconds=2.0, min_seconds=0.5)
    wave = torch.from_numpy(speechlike(2.3, 4, pauses=False))
    segments = list(segment_audio([wave], options))
    assert sum(w.numel() for _, w in segments) == wave.numel() and segments[-1][1].numel() >= 8000


def test_long_audio_gives_timed_segments(talking):
    wave = speechlike(50.0, 5)
    (result,) = talking.transcribe((wave, 16000), segmentation=SegmentOptions(max_seconds=8.0))
    assert sum(bool(s.text) for s in result.segments) >= 7  # the text joins non-empty pieces
    assert len(result.segments) >= 7 and result.duration == pytest.approx(50.0)
    assert result.segments[0].start == 0 and result.segments[-1].end == pytest.approx(50.0)
    assert all(a.end == b.start for a, b in zip(result.segments, result.segments[1:]))
    assert result.text == " ".join(s.text for s in result.segments if s.text)


@pytest.mark.parametrize("chunk,left,mode", [(4, -1, "ctc_rescore"), (6, 1, "ctc_rescore"), (4, -1, "attention"),
                                             (6, 1, "attention")])
def test_streaming_a_file_gives_the_final_text_of_a_chunked_transcribe(tmp_path, chunk, left, mode):
    """Recognizer.stream, a file's samples fed in random pieces, endpointing off: the final text is
    transcribe's of the same file with decoding chunk_size / left_chunks in the recognizer's mode
    (one segment), and partials come before it."""
    options = asr.decoding.DecodingOptions(mode=mode, beam_size=4, ctc_weight=0.5, chunk_size=chunk, left_chunks=left)
    recognizer = load_model(write_model_file(tmp_path / "model.pt", eos_bias=0.0, streaming=True), options=options)
    wave = speechlike(2.6, 5)
    sf.write(tmp_path / "a.wav", wave, 16000)
    one_segment = SegmentOptions(max_seconds=60.0, pause_db=1000.0)
    expected = recognizer.transcribe(str(tmp_path / "a.wav"), segmentation=one_segment)[0]
    assert len(expected.segments) == 1 and len(expected.text) > 3
    samples, _ = sf.read(tmp_path / "a.wav", dtype="float32")
    stream, events, start, rng = recognizer.stream(chunk, left), [], 0, random.Random(chunk)
    assert stream.options.beam_size == 4 and stream.options.ctc_weight == 0.5
    assert stream.options.final == ("rescore" if mode == "ctc_rescore" else "attention")
    while start < len(samples):
        size = rng.randint(1, 5000)
        events += stream.accept_waveform(samples[start:start + size])
        start += size
    events += stream.finish()
    assert [e.kind for e in events][-1] == "final" and "partial" in [e.kind for e in events]
    assert [e.text for e in events if e.kind == "final"] == [expected.text] == [stream.result()]


def test_streaming_needs_a_model_with_causal_convolutions(recognizer):
    with pytest.raises(ValueError, match="causal_conv"):
        noncausal = ASRModel(dataclasses.replace(recognizer.model.config, encoder="conformer", conv_kernel=3))
        Recognizer(noncausal, recognizer.tokenizer, recognizer.features, recognizer.cmvn).stream()
    with pytest.raises(ValueError, match="exported"):
        Recognizer(_NotATorchModel(), recognizer.tokenizer, recognizer.features, recognizer.cmvn).stream()
    recognizer.stream(4)  # a transformer without convolutions streams


class _NotATorchModel:
    """What an exported model looks like to Recognizer.stream: not an ASRModel."""

    def to(self, device):
        return self

    def eval(self):
        return self


def test_formats():
    one = Result("a.wav", "HI THERE", (3,), -1.5, (Segment(0.0, 1.25, "HI"), Segment(1.25, 3661.5, "THERE")), 3661.5)
    bad = Result("b.wav", "", error="b.wav: no such file")
    assert format_results([one], "txt") == "HI THERE\n"
    assert format_results([one, bad], "txt") == "a.wav\tHI THERE\n"
    parsed = json.loads(format_results([one, bad], "json"))
    assert parsed[0]["segments"][1] == {"start": 1.25, "end": 3661.5, "text": "THERE"}
    assert parsed[1]["error"] == "b.wav: no such file" and parsed[0]["error"] is None
    assert json.loads(format_results([Result(None, "", score=-math.inf)], "json"))[0]["score"] is None
    assert format_results([one], "srt") == (
        "1\n00:00:00,000 --> 00:00:01,250\nHI\n\n2\n00:00:01,250 --> 01:01:01,500\nTHERE\n\n")
    assert format_results([one, one], "srt").count("==> a.wav <==") == 2
    assert format_results([one], "vtt") == (
        "WEBVTT\n\n00:00:00.000 --> 00:00:01.250\nHI\n\n00:00:01.250 --> 01:01:01.500\nTHERE\n\n")
    assert format_results([one], "tsv") == "start\tend\ttext\n0\t1250\tHI\n1250\t3661500\tTHERE\n"
    with pytest.raises(ValueError, match="unknown format"):
        format_results([one], "ass")


REAL_FILES = [
    "LibriSpeech/test-clean/1089/134686/1089-134686-0000.flac",  # 16 kHz FLAC
    "LJSpeech-1.1/wavs/LJ001-0001.wav",  # 22.05 kHz WAV
    "vctk_hfdummy/wav48_silence_trimmed/p225/p225_001_mic1.flac",  # 48 kHz FLAC
    "jfk/jfk.flac",  # 44.1 kHz stereo 24-bit FLAC
    "pocketsphinx_testdata/goforward/goforward.wav",
]


def test_transcribe_real_recordings(recognizer, realspeech):
    paths = [realspeech / f for f in REAL_FILES]
    results = recognizer.transcribe(paths, mode="greedy")
    for path, result in zip(paths, results):
        assert result.error is None, result.error
        assert result.duration == pytest.approx(sf.info(path).duration, abs=1e-3)
        assert result.segments and result.segments[-1].end == pytest.approx(result.duration)
    raw = realspeech / "pocketsphinx_testdata/goforward/goforward.raw"
    (from_raw,) = recognizer.transcribe(raw, mode="greedy", raw=RawFormat(16000, "PCM_16"))
    assert from_raw.error is None and (from_raw.text, from_raw.duration) == (results[-1].text, results[-1].duration)


@pytest.mark.slow
def test_one_hour_recording_in_bounded_memory(tmp_path):
    """A generated one-hour recording, transcribed in a subprocess: peak RSS under 2 GB (a model
    that hears nothing, so that this measures reading, segmenting and batching)."""
    model_path = write_model_file(tmp_path / "model.pt", eos_bias=20.0, blank_bias=20.0)
    audio = tmp_path / "hour.wav"
    with sf.SoundFile(audio, "w", 16000, 1, "PCM_16") as f:
        for minute in range(60):
            f.write(speechlike(60.0, minute))
    script = textwrap.dedent(f"""
        import resource, asr
        model = asr.load_model({str(model_path)!r})
        (result,) = model.transcribe({str(audio)!r}, batch_size=8)
        assert result.error is None, result.error
        print(len(result.segments), result.duration, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=1200)
    assert out.returncode == 0, out.stderr[-2000:]
    segments, duration, peak_kib = out.stdout.split()
    assert float(duration) == pytest.approx(3600.0) and int(segments) >= 180
    assert int(peak_kib) * 1024 < 2e9, f"peak RSS {int(peak_kib) / 1024:.0f} MiB"
