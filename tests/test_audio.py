"""asr/audio.py: every format and rate to 16 kHz mono float32, raw PCM, segments, speed
perturbation, the block reader, and one clear AudioError for each kind of bad file.

Every file is written in tmp_path by the test itself: a sine whose phase on the 16 kHz grid is
known, so the content is checked by correlation with the expected 16 kHz sine."""
from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
import torch

from asr.audio import (
    SAMPLE_RATE,
    AudioError,
    AudioInfo,
    RawFormat,
    audio_info,
    iter_blocks,
    load_audio,
    resample,
    to_mono_16k,
)

FREQ = 440.0  # Hz, the test tone: below every Nyquist and every codec's low-pass
AMPLITUDES = (0.6, 0.2)  # of channels 0 and 1: a stereo file mixes to amplitude 0.4
EDGE = 320  # 16 kHz samples (20 ms) left out at each end, where resampling pads with zeros
RATES = [8000, 16000, 22050, 44100, 48000]
FORMATS = [  # (soundfile format, subtype, extension, lossy)
    ("WAV", "PCM_U8", "wav", False),
    ("WAV", "PCM_16", "wav", False),
    ("WAV", "PCM_24", "wav", False),
    ("WAV", "PCM_32", "wav", False),
    ("WAV", "FLOAT", "wav", False),
    ("FLAC", "PCM_16", "flac", False),
    ("FLAC", "PCM_24", "flac", False),
    ("OGG", "VORBIS", "ogg", True),
    ("MP3", "MPEG_LAYER_III", "mp3", True),
]
MP3_FRAME = 1152  # samples per MPEG-1 layer III frame: the padding a lossy decoder may add


def tone(rate: int, seconds: float, channels: int, freq: float = FREQ) -> np.ndarray:
    """(T, C) float32 sine, channel c at AMPLITUDES[c]."""
    t = np.arange(round(seconds * rate)) / rate
    return np.stack([a * np.sin(2 * np.pi * freq * t) for a in AMPLITUDES[:channels]], axis=1).astype(np.float32)


def expected(num_samples: int, channels: int, freq: float = FREQ) -> np.ndarray:
    """(num_samples,) the mono mix of `tone` on the 16 kHz grid."""
    return np.mean(AMPLITUDES[:channels]) * np.sin(2 * np.pi * freq * np.arange(num_samples) / SAMPLE_RATE)


def assert_sine(wave: torch.Tensor, channels: int, freq: float = FREQ, min_corr: float = 0.999) -> None:
    """`wave` is the expected 16 kHz mix: same phase (correlation) and level (within 3%)."""
    got = wave.numpy()[EDGE:-EDGE]
    ref = expected(len(wave), channels, freq)[EDGE:-EDGE]
    assert np.corrcoef(got, ref)[0, 1] > min_corr
    assert np.sqrt(np.mean(got**2)) == pytest.approx(np.sqrt(np.mean(ref**2)), rel=0.03)


def write(path, data: np.ndarray, rate: int, fmt: str = "WAV", subtype: str = "PCM_16") -> str:
    if fmt not in sf.available_formats():
        pytest.skip(f"this libsndfile cannot write {fmt}")
    sf.write(path, data, rate, format=fmt, subtype=subtype)
    return str(path)


def peak_frequency(wave: torch.Tensor) -> float:
    """Hz of the largest FFT bin of a 16 kHz waveform."""
    spectrum = np.abs(np.fft.rfft(wave.numpy() * np.hanning(len(wave))))
    return float(np.argmax(spectrum)) * SAMPLE_RATE / len(wave)


def assert_error(path, *words: str, **kwargs) -> None:
    """load_audio(path) raises one line "<path>: <reason>" whose reason holds every word."""
    with pytest.raises(AudioError) as info:
        load_audio(path, **kwargs)
    message = str(info.value)
    assert message.startswith(f"{path}: ") and "\n" not in message
    for word in words:
        assert word in message.lower(), message


# ---------------------------------------------------------------- formats, rates, channels


@pytest.mark.parametrize("rate", RATES)
@pytest.mark.parametrize("channels", [1, 2])
@pytest.mark.parametrize(("fmt", "subtype", "ext", "lossy"), FORMATS, ids=lambda v: str(v))
def test_every_format_and_rate_gives_16k_mono_float32(tmp_path, fmt, subtype, ext, lossy, channels, rate):
    data = tone(rate, 0.5, channels)
    path = write(tmp_path / f"a.{ext}", data, rate, fmt, subtype)
    wave = load_audio(path)
    assert wave.dtype == torch.float32 and wave.ndim == 1
    slack = math.ceil(MP3_FRAME * SAMPLE_RATE / rate) if lossy else 1
    assert abs(len(wave) - math.ceil(len(data) * SAMPLE_RATE / rate)) <= slack
    assert_sine(wave, channels, min_corr=0.99 if lossy else 0.999)


@pytest.mark.parametrize(("fmt", "subtype", "ext"),
                         [("WAV", "PCM_24", "wav"), ("FLAC", "PCM_16", "flac"), ("OGG", "VORBIS", "ogg")])
def test_audio_info_reads_the_header(tmp_path, fmt, subtype, ext):
    path = write(tmp_path / f"a.{ext}", tone(22050, 0.5, 2), 22050, fmt, subtype)
    info = audio_info(path)
    assert info == AudioInfo(22050, 11025, 2, fmt, subtype)
    assert info.duration == pytest.approx(0.5)


# ---------------------------------------------------------------- raw PCM


def test_raw_pcm16_little_endian_mono(tmp_path):
    data = tone(8000, 0.5, 1)[:, 0]
    path = tmp_path / "a.raw"
    path.write_bytes(np.round(data * 32767).astype("<i2").tobytes())
    raw = RawFormat(sample_rate=8000)
    assert audio_info(path, raw) == AudioInfo(8000, 4000, 1, "RAW", "PCM_16")
    wave = load_audio(path, raw=raw)
    assert len(wave) == 8000
    assert_sine(wave, 1)


def test_raw_float_stereo_and_pcm24_big_endian(tmp_path):
    data = tone(44100, 0.5, 2)
    floats = tmp_path / "a.f32"
    floats.write_bytes(data.astype("<f4").tobytes())
    assert_sine(load_audio(floats, raw=RawFormat(44100, "FLOAT", channels=2)), 2)
    big = tmp_path / "a.s24be"
    sf.write(big, data, 44100, format="RAW", subtype="PCM_24", endian="BIG")
    wave = load_audio(big, raw=RawFormat(44100, "PCM_24", channels=2, endian="BIG"))
    assert len(wave) == 8000
    assert_sine(wave, 2)


def test_raw_file_ending_inside_a_frame_is_truncated(tmp_path):
    path = tmp_path / "a.raw"
    path.write_bytes(b"\0" * 1001)
    with pytest.raises(AudioError, match="truncated"):
        audio_info(path, RawFormat(16000))


def test_raw_format_rejects_unknown_values():
    with pytest.raises(ValueError, match="subtype"):
        RawFormat(16000, "PCM_12")
    with pytest.raises(ValueError, match="endian"):
        RawFormat(16000, endian="MIDDLE")
    with pytest.raises(ValueError, match="sample_rate"):
        RawFormat(0)


# ---------------------------------------------------------------- segments and speed


@pytest.mark.parametrize(("fmt", "subtype", "ext"),
                         [("FLAC", "PCM_24", "flac"), ("OGG", "VORBIS", "ogg"), ("MP3", "MPEG_LAYER_III", "mp3")])
def test_segment_matches_the_slice_of_the_whole(tmp_path, fmt, subtype, ext):
    path = write(tmp_path / f"a.{ext}", tone(44100, 2.0, 2, freq=FREQ * 1.5), 44100, fmt, subtype)
    whole = load_audio(path)
    part = load_audio(path, start=0.5, end=1.25)
    assert abs(len(part) - 12000) <= 1
    inner = slice(EDGE, len(part) - EDGE)
    np.testing.assert_allclose(part[inner], whole[8000:20000][inner], atol=2e-3)
    assert len(load_audio(path, start=1.5)) == pytest.approx(8000, abs=1)


def test_segment_reads_only_its_frames(tmp_path, monkeypatch):
    path = write(tmp_path / "a.flac", tone(16000, 3.0, 1), 16000, "FLAC")
    requested = []
    original = sf.SoundFile.read

    def spy(self, frames=-1, *args, **kwargs):
        requested.append(frames)
        return original(self, frames, *args, **kwargs)

    monkeypatch.setattr(sf.SoundFile, "read", spy)
    assert len(load_audio(path, start=1.0, end=1.5)) == 8000
    assert requested == [8000]


def test_end_slightly_past_the_audio_is_clipped(tmp_path):
    path = write(tmp_path / "a.wav", tone(16000, 1.0, 1), 16000)
    assert len(load_audio(path, start=0.5, end=1.01)) == 8000


@pytest.mark.parametrize("rate", [16000, 44100])
@pytest.mark.parametrize("speed", [0.9, 1.1])
def test_speed_perturbation_changes_length_and_pitch(tmp_path, rate, speed):
    path = write(tmp_path / "a.wav", tone(rate, 1.0, 2), rate)
    wave = load_audio(path, speed=speed)
    assert abs(len(wave) - SAMPLE_RATE / speed) <= 2
    assert peak_frequency(wave) == pytest.approx(FREQ * speed, abs=2.0)
    assert_sine(wave, 2, freq=FREQ * speed)


# ---------------------------------------------------------------- block reader


@pytest.mark.parametrize(("rate", "ext", "fmt", "subtype"), [
    (16000, "wav", "WAV", "PCM_16"),
    (8000, "wav", "WAV", "FLOAT"),
    (22050, "flac", "FLAC", "PCM_16"),
    (44100, "flac", "FLAC", "PCM_24"),
    (48000, "ogg", "OGG", "VORBIS"),
])
def test_iter_blocks_concatenate_to_load_audio(tmp_path, rate, ext, fmt, subtype):
    rng = np.random.default_rng(rate)  # noise: every frequency, so any seam would show
    data = (0.3 * rng.standard_normal((round(1.37 * rate), 2))).astype(np.float32)
    path = write(tmp_path / f"a.{ext}", data, rate, fmt, subtype)
    blocks = list(iter_blocks(path, block_seconds=0.25))
    assert all(b.dtype == torch.float32 and b.ndim == 1 for b in blocks)
    # whole periods of 1 / gcd(rate, 16000) s: 20 ms at 22.05 kHz
    assert len({len(b) for b in blocks[:-1]}) == 1 and abs(len(blocks[0]) - 4000) <= 320
    torch.testing.assert_close(torch.cat(blocks), load_audio(path), atol=1e-4, rtol=0)


def test_iter_blocks_file_shorter_than_one_block(tmp_path):
    path = write(tmp_path / "a.wav", tone(44100, 0.3, 1), 44100)
    blocks = list(iter_blocks(path))
    assert len(blocks) == 1
    torch.testing.assert_close(blocks[0], load_audio(path), atol=1e-4, rtol=0)


# ---------------------------------------------------------------- bad files


def test_missing_file(tmp_path):
    assert_error(tmp_path / "nowhere.wav", "no such file")


def test_directory(tmp_path):
    assert_error(tmp_path, "directory")


def test_empty_file(tmp_path):
    (tmp_path / "empty.wav").write_bytes(b"")
    assert_error(tmp_path / "empty.wav", "empty")
    with pytest.raises(AudioError, match="empty"):
        audio_info(tmp_path / "empty.wav")


def test_wav_with_no_frames(tmp_path):
    path = write(tmp_path / "a.wav", np.zeros((0, 1), np.float32), 16000)
    assert_error(path, "no audio frames")


def test_wav_whose_header_says_zero_bytes(tmp_path):
    path = Path(write(tmp_path / "a.wav", tone(16000, 0.5, 1), 16000))
    head = bytearray(path.read_bytes())
    at = head.index(b"data") + 4
    head[at: at + 4] = bytes(4)  # what some streaming writers leave
    path.write_bytes(head)
    assert_error(path, "announces 0 bytes")


@pytest.mark.parametrize(("fmt", "ext", "words"), [
    ("WAV", "wav", ("truncated",)),
    ("FLAC", "flac", ("truncated",)),
    ("OGG", "ogg", ("malformed",)),
    ("MP3", "mp3", ("truncated",)),
])
def test_truncated_file(tmp_path, fmt, ext, words):
    subtype = {"OGG": "VORBIS", "MP3": "MPEG_LAYER_III"}.get(fmt, "PCM_16")
    path = Path(write(tmp_path / f"a.{ext}", tone(16000, 1.0, 1), 16000, fmt, subtype))
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    assert_error(path, *words)
    with pytest.raises(AudioError):
        list(iter_blocks(path))


def noise(seconds: float, rate: int = 16000) -> np.ndarray:
    """(T,) float32 noise: compresses to many Ogg pages and FLAC frames, unlike a tone."""
    return (0.1 * np.random.default_rng(0).standard_normal(round(seconds * rate))).astype(np.float32)


def cut(path: Path, at: int) -> Path:
    """A copy of `path` holding its first `at` bytes, beside it."""
    out = path.with_name(f"cut-{at}-{path.name}")
    out.write_bytes(path.read_bytes()[:at])
    return out


def cut_files(folder: Path) -> dict[str, tuple[Path, str]]:
    """name -> (a file cut short, what the message says): every container whose end can be told."""
    files = {}
    for fmt, subtype, ext in [("WAV", "PCM_16", "wav"), ("FLAC", "PCM_16", "flac"), ("MP3", "MPEG_LAYER_III", "mp3"),
                              ("OGG", "VORBIS", "ogg"), ("OGG", "OPUS", "opus")]:
        path = folder / f"a.{ext}"
        if fmt not in sf.available_formats() or subtype not in sf.available_subtypes(fmt):
            continue
        write(path, noise(3.0), 16000, fmt, subtype)
        size = path.stat().st_size
        reason = {"WAV": "truncated: the header announces", "FLAC": "truncated or damaged: decoding fails at",
                  "MP3": "truncated: decoding ends at frame"}.get(fmt, "truncated: the last ogg page")
        files[ext] = cut(path, int(size * 0.6)), reason.lower()
        if fmt == "OGG":  # cut where a page begins: every page whole, the last without end-of-stream
            page = path.read_bytes().rfind(b"OggS", 0, int(size * 0.6))
            files[f"{ext}-page"] = cut(path, page), "truncated: the ogg stream ends without"
    return files


def test_a_cut_file_is_read_as_far_as_it_goes_with_a_warning(tmp_path):
    """A file that ends before its container says it should (a WAV's data size, a FLAC's or MP3's
    frame count, an Ogg stream's pages) is an AudioError saying "truncated" for load_audio and
    iter_blocks; with on_truncated, iter_blocks yields the audio that is there (for a FLAC cut inside
    a frame, all but the damaged frame) and reports it once, in one line naming the file. Complete
    files, and segments that end before the cut, are not reported."""
    files = cut_files(tmp_path)
    assert {"wav", "flac", "mp3", "ogg", "ogg-page"} <= set(files)
    for name, (path, reason) in files.items():
        assert_error(path, "truncated")
        with pytest.raises(AudioError, match="truncated"):
            list(iter_blocks(path))
        messages = []
        got = torch.cat(list(iter_blocks(path, block_seconds=0.5, on_truncated=messages.append)))
        assert len(messages) == 1 and messages[0].lower().startswith(f"{path}: {reason}".lower()), (name, messages)
        assert 0.8 < len(got) / 16000 < 2.0, name  # 60% of 3 s, give or take a codec's frame and page
        if name == "wav":  # exactly what the whole file holds there
            assert torch.equal(got, load_audio(tmp_path / "a.wav", end=len(got) / 16000))
    assert load_audio(files["ogg-page"][0], end=0.5).shape == (8000,)  # short of the cut: nothing missing
    for ext in ("wav", "flac", "mp3", "ogg"):
        whole = tmp_path / f"a.{ext}"
        messages = []
        assert torch.cat(list(iter_blocks(whole, on_truncated=messages.append))).numel() and not messages


def test_the_content_picks_the_decoder_and_odd_names_are_named(tmp_path):
    """libsndfile reads an open descriptor: a WAV named .raw is a WAV, text named .vox is not audio
    (a name's suffix never picks a headerless decoder). A name that is not UTF-8 reads as bytes or
    as os.fsdecode's str; NUL and newlines in a name are one-line errors with the name escaped."""
    wave = noise(0.5)
    sf.write(tmp_path / "a.wav", wave, 16000)
    data = (tmp_path / "a.wav").read_bytes()
    (tmp_path / "a.raw").write_bytes(data)
    assert load_audio(tmp_path / "a.raw").shape == (8000,)
    (tmp_path / "a.vox").write_text("not the sounds you are looking for\n" * 40)
    assert_error(tmp_path / "a.vox", "not an audio file")
    name = bytes(tmp_path) + b"/caf\xe9-\xff.wav"
    with open(name, "wb") as f:
        f.write(data)
    assert torch.equal(load_audio(name), load_audio(os.fsdecode(name)))
    assert torch.equal(torch.cat(list(iter_blocks(os.fsdecode(name)))), load_audio(tmp_path / "a.wav"))
    (tmp_path / "cut.flac").write_bytes(b"")
    for path, shown, reason in [
        (os.fsdecode(bytes(tmp_path) + b"/gone-\xe9.wav"), f"{tmp_path}/gone-\\xe9.wav", "no such file"),
        (f"{tmp_path}/a\0.wav", f"{tmp_path}/a\\x00.wav", "a file name cannot hold a NUL character"),
        (f"{tmp_path}/line\nbreak.wav", f"{tmp_path}/line\\nbreak.wav", "no such file"),
    ]:
        with pytest.raises(AudioError) as err:
            load_audio(path)
        assert str(err.value) == f"{shown}: {reason}" and err.value.path == path


def test_corrupt_flac_frames_and_wav_header(tmp_path):
    noise = (0.3 * np.random.default_rng(0).standard_normal(48000)).astype(np.float32)
    flac = tmp_path / "a.flac"
    body = bytearray(Path(write(flac, noise, 16000, "FLAC")).read_bytes())
    body[len(body) // 2: len(body) // 2 + 200] = bytes(200)
    flac.write_bytes(body)
    assert_error(flac, "corrupt")
    wav = tmp_path / "a.wav"
    head = bytearray(Path(write(wav, noise, 16000)).read_bytes())
    head[20:36] = bytes(16)  # the 'fmt ' chunk
    wav.write_bytes(head)
    assert_error(wav, "malformed")


def test_random_bytes(tmp_path):
    path = tmp_path / "noise.flac"
    path.write_bytes(np.random.default_rng(0).integers(0, 256, 4000, dtype=np.uint8).tobytes())
    assert_error(path, "not an audio file")


def test_text_file(tmp_path):
    path = tmp_path / "notes.wav"
    path.write_text("this is not audio\n" * 50)
    assert_error(path, "not an audio file")
    with pytest.raises(AudioError, match="not an audio file"):
        audio_info(path)


@pytest.mark.parametrize(("bad", "word"), [(np.nan, "nan"), (np.inf, "infinite"), (-np.inf, "infinite")])
def test_non_finite_samples(tmp_path, bad, word):
    data = tone(16000, 1.0, 2)
    data[12000, 1] = bad
    path = write(tmp_path / "a.wav", data, 16000, "WAV", "FLOAT")
    assert_error(path, word, "0.750 s")
    with pytest.raises(AudioError, match=rf"(?i){word} samples \(the first at 0\.750 s\)"):
        list(iter_blocks(path, block_seconds=0.5))  # found in the second block


@pytest.mark.parametrize(("start", "end", "words"), [
    (2.0, None, ("start 2", "outside")),
    (0.0, 1.5, ("end 1.5", "beyond")),
    (0.5, 0.4, ("not after start",)),
    (-0.1, None, ("start -0.1", "outside")),
])
def test_segment_outside_the_file(tmp_path, start, end, words):
    path = write(tmp_path / "a.wav", tone(16000, 1.0, 1), 16000)
    assert_error(path, *words, start=start, end=end)


def test_audio_error_is_one_line_and_picklable(tmp_path):
    import pickle

    error = AudioError(tmp_path / "a.wav", "broken\nheader")
    assert str(error) == f"{tmp_path / 'a.wav'}: broken header"
    again = pickle.loads(pickle.dumps(error))
    assert str(again) == str(error) and again.path == error.path


# ---------------------------------------------------------------- in-memory waveforms


def test_to_mono_16k_numpy_time_by_channels():
    data = tone(48000, 0.5, 2).astype(np.float64)
    wave = to_mono_16k(data, 48000)
    assert wave.dtype == torch.float32 and wave.shape == (8000,)
    assert_sine(wave, 2)


def test_to_mono_16k_torch_and_int16():
    data = tone(16000, 0.5, 1)[:, 0]
    same = to_mono_16k(torch.from_numpy(data), 16000)
    torch.testing.assert_close(same, torch.from_numpy(data))
    pcm = to_mono_16k(np.round(data * 32767).astype(np.int16), 16000)
    torch.testing.assert_close(pcm, torch.from_numpy(data), atol=1e-4, rtol=0)
    stereo = to_mono_16k(torch.from_numpy(tone(22050, 0.5, 2)), 22050)
    assert stereo.shape == (8000,)
    assert_sine(stereo, 2)


def test_to_mono_16k_rejects_bad_input():
    with pytest.raises(ValueError, match="transpose"):
        to_mono_16k(np.zeros((2, 16000), np.float32), 16000)  # torchaudio's (C, T)
    with pytest.raises(ValueError, match="NaN"):
        to_mono_16k(np.array([0.0, np.nan]), 16000)
    with pytest.raises(ValueError, match="int64"):
        to_mono_16k(np.zeros(10, np.int64), 16000)
    with pytest.raises(TypeError):
        to_mono_16k([0.0, 0.1], 16000)


def test_resample_lengths():
    wave = torch.zeros(44100)
    assert resample(wave, 44100, 16000).shape == (16000,)
    assert resample(torch.zeros(1001), 22050, 16000).shape == (math.ceil(1001 * 16000 / 22050),)
    with pytest.raises(ValueError, match="orig_rate"):
        resample(wave, 0, 16000)


@pytest.mark.parametrize("orig, new", [(44100, 16000), (8000, 16000), (14400, 16000), (17600, 16000)])
def test_resample_kernel_cached_and_same_as_torchaudio(orig, new):
    import torchaudio.functional

    from asr.audio import _resampler

    wave = torch.randn(orig // 3, generator=torch.Generator().manual_seed(orig))
    resample(wave, orig, new)
    hits = _resampler.cache_info().hits
    out = resample(wave, orig, new)
    assert _resampler.cache_info().hits == hits + 1  # one kernel per rate pair, built once
    assert torch.equal(out, torchaudio.functional.resample(wave, orig, new))


def test_import_does_not_load_torchaudio():
    code = "import sys, asr.audio; sys.exit('torchaudio' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0


# ---------------------------------------------------------------- real speech


def test_jfk_stereo_24bit_flac(realspeech):
    path = realspeech / "jfk" / "jfk.flac"
    info = audio_info(path)
    assert (info.sample_rate, info.channels, info.format, info.subtype) == (44100, 2, "FLAC", "PCM_24")
    wave = load_audio(path)
    assert wave.dtype == torch.float32 and len(wave) == math.ceil(info.frames * SAMPLE_RATE / 44100)
    assert 0.01 < float(wave.abs().max()) <= 1.0
    torch.testing.assert_close(torch.cat(list(iter_blocks(path, block_seconds=4.0))), wave, atol=1e-4, rtol=0)
