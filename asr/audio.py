"""Read any audio file as float32 mono at 16 kHz, with one clear error for every bad file.

Everything libsndfile reads (WAV 8/16/24/32-bit int and float, FLAC, OGG/Vorbis, MP3, AIFF, ...)
goes through soundfile; headerless PCM needs a `RawFormat`. The decoder is chosen by the file's
content, never by its name (libsndfile reads an open file descriptor: a `.raw` or `.vox` suffix
changes nothing, and names that are not UTF-8 work). Channels are averaged, the rate is converted
with torchaudio's windowed-sinc resampler (imported on first use, so that importing this module
stays light), and `iter_blocks` streams a long file block by block with the same result as
`load_audio`. Every problem with a file raises `AudioError`, whose text is "<path>: <reason>" on
one line; `iter_blocks(..., on_truncated=...)` reports a file that ends before its container says
it should (a cut WAV, FLAC, MP3 or Ogg file) and keeps the audio that is there instead.
"""
from __future__ import annotations

import functools
import math
import os
from collections.abc import Callable, Iterator
from contextlib import closing
from dataclasses import dataclass

import numpy as np
import soundfile as sf
import torch

__all__ = [
    "SAMPLE_RATE",
    "AudioError",
    "AudioInfo",
    "RawFormat",
    "audio_info",
    "check_speed",
    "iter_blocks",
    "load_audio",
    "resample",
    "shown_path",
    "to_mono_16k",
]

SAMPLE_RATE = 16000  # Hz, the rate of every waveform this module returns

# torchaudio.functional.resample defaults, mirrored to size the context of `iter_blocks`.
_LOWPASS_FILTER_WIDTH = 6
_ROLLOFF = 0.99
# An `end` up to this far past the end of the audio (rounded segment times) is clipped, not refused.
_END_SLACK_S = 0.02
# libsndfile's frame count for a stream that does not state its length (e.g. a FLAC written to a
# pipe): soundfile fails to read such a stream past its first block.
_UNKNOWN_FRAMES = 2**62
# A WAV data size from here up is a streaming writer's "length unknown", not a promise.
_RIFF_UNKNOWN_SIZE = 0x7FFFF000
_MAX_CHANNELS = 64  # more "channels" than this in a (T, C) array means a (C, T) array
_MIN_RATE = 4000  # Hz: a lower rate cannot hold the speech band (and would be inflated 4x or more)
# Elements of a resampling filter (64 MB of float32) beyond which a rate pair is refused: rates with
# no large common divisor (16001 Hz: a 16000 x 16013 filter, a gigabyte and a minute per file).
_MAX_FILTER = 2**24
# Samples (all channels) decoded per read: memory follows the data that is there, not a length the
# header only claims.
_READ_SAMPLES = 2**22
# Frames per read when what comes before a decoder error is read again (iter_blocks' on_truncated):
# about a FLAC frame, halved where a read fails, so that at most _SALVAGE_MIN_FRAMES of what decodes
# are lost.
_SALVAGE_FRAMES = 4096
_SALVAGE_MIN_FRAMES = 16
_RAW_SAMPLE_BYTES = {
    "PCM_S8": 1, "PCM_U8": 1, "PCM_16": 2, "PCM_24": 3, "PCM_32": 4,
    "FLOAT": 4, "DOUBLE": 8, "ULAW": 1, "ALAW": 1,
}
_RAW_ENDIANS = ("LITTLE", "BIG", "CPU", "FILE")
# integer sample types given to `to_mono_16k`: (offset, scale) to map them onto [-1, 1)
_INT_SCALE = {"int8": (0, 128), "uint8": (128, 128), "int16": (0, 32768), "int32": (0, 2**31)}


class AudioError(Exception):
    """A file that cannot be used as audio; str(e) == "<path>: <reason>" on one line, the path
    shown with its unprintable characters escaped (a newline as \\n, a byte of a name that is not
    UTF-8 as \\xNN); `path` is the path as given (str, bytes decoded as os.fsdecode does)."""

    def __init__(self, path: str | bytes | os.PathLike, reason: str):
        self.path = os.fsdecode(path)
        self.reason = " ".join(str(reason).split())  # one line, whatever libsndfile said
        super().__init__(f"{shown_path(self.path)}: {self.reason}")

    def __reduce__(self):  # picklable across DataLoader worker processes
        return (type(self), (self.path, self.reason))


def shown_path(path: str | bytes | os.PathLike) -> str:
    """`path` as one printable line: unchanged when it is one, else each unprintable character
    escaped (a newline as \\n, NUL as \\x00, a byte of a name that is not UTF-8, which
    os.fsdecode turned into a lone surrogate, as \\xNN)."""
    text = os.fsdecode(path)
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else f"\\x{ord(c) - 0xDC00:02x}" if 0xDC80 <= ord(c) <= 0xDCFF
                   else ascii(c)[1:-1] for c in text)


@dataclass(frozen=True)
class RawFormat:
    """How to read headerless PCM: rate (Hz), sample type (soundfile's name), channels, byte order.

    subtype: PCM_16, PCM_24, PCM_32, PCM_U8, PCM_S8, FLOAT, DOUBLE, ULAW or ALAW;
    endian: LITTLE, BIG, CPU or FILE (= LITTLE for raw files).
    """

    sample_rate: int
    subtype: str = "PCM_16"
    channels: int = 1
    endian: str = "LITTLE"

    def __post_init__(self):
        if not (isinstance(self.sample_rate, int) and self.sample_rate > 0):
            raise ValueError(f"RawFormat: sample_rate must be a positive int, got {self.sample_rate!r}")
        if self.subtype not in _RAW_SAMPLE_BYTES:
            raise ValueError(f"RawFormat: unknown subtype {self.subtype!r} (one of {', '.join(_RAW_SAMPLE_BYTES)})")
        if not (isinstance(self.channels, int) and self.channels > 0):
            raise ValueError(f"RawFormat: channels must be a positive int, got {self.channels!r}")
        if self.endian not in _RAW_ENDIANS:
            raise ValueError(f"RawFormat: unknown endian {self.endian!r} (one of {', '.join(_RAW_ENDIANS)})")

    @property
    def frame_bytes(self) -> int:
        """Bytes per frame (one sample of every channel)."""
        return _RAW_SAMPLE_BYTES[self.subtype] * self.channels


@dataclass(frozen=True)
class AudioInfo:
    """What a file's header says: rate (Hz), frames (samples per channel), channels, soundfile's
    format ("WAV", "FLAC", "OGG", "MP3", "RAW", ...) and subtype ("PCM_16", "VORBIS", ...)."""

    sample_rate: int
    frames: int
    channels: int
    format: str
    subtype: str

    @property
    def duration(self) -> float:
        """Seconds of audio: frames / sample_rate."""
        return self.frames / self.sample_rate


def audio_info(path: str | os.PathLike, raw: RawFormat | None = None) -> AudioInfo:
    """The header of `path` (no decoding).

    Raises AudioError for a missing, empty (0 bytes or 0 frames), non-audio or visibly truncated
    file (a WAV whose data chunk is longer than the file, a raw file that ends inside a frame).
    """
    with closing(_Source(path, raw)) as src:
        return src.info


def load_audio(
    path: str | os.PathLike,
    *,
    start: float = 0.0,
    end: float | None = None,
    speed: float = 1.0,
    raw: RawFormat | None = None,
) -> torch.Tensor:
    """Decode `path` to a (T,) float32 mono (channel mean) waveform at 16 kHz.

    start, end: seconds of the original file; only that segment is decoded (end None = to the
    end; an end at most 20 ms past the end of the audio is clipped to it).
    speed: speed perturbation by resampling; the result is about T / speed samples long, as if the
    file's rate were rate * speed (to 1/16000 of a unit: the 16 kHz audio is resampled from
    round(16000 * speed) Hz to 16000 Hz).
    raw: read the file as headerless PCM in this format.
    Raises AudioError "<path>: <reason>" for a missing, empty, truncated (fewer frames decoded than
    the header says, an Ogg stream without its last page), corrupt or non-audio file, NaN/inf
    samples, start/end outside the file, or a sample rate under 4000 Hz or too costly to resample
    (see `resample`); ValueError for a speed
    that is not positive or too costly to resample (use at most three decimals).
    Memory follows the audio actually decoded, whatever length the header claims.
    """
    check_speed(speed)
    with closing(_Source(path, raw)) as src:
        first, last = src.segment(start, end)
        if first:
            src.seek(first)
        samples = src.read_exactly(last - first)  # (T,) at the file's rate
        if last == src.info.frames:
            src.check_complete()  # the container's own account of its end (an Ogg stream's last page)
    wave = resample(torch.from_numpy(samples), src.info.sample_rate, SAMPLE_RATE)
    return _perturb_speed(wave, speed)


def iter_blocks(
    path: str | os.PathLike, *, block_seconds: float = 30.0, raw: RawFormat | None = None,
    on_truncated: Callable[[str], None] | None = None,
) -> Iterator[torch.Tensor]:
    """Yield (T_block,) float32 16 kHz mono blocks of `path`, `block_seconds` long each (rounded to
    whole periods of 1 / gcd(rate, 16000) s, e.g. 10 ms at 44.1 kHz) but the last.

    Memory is bounded by two blocks, not by the file. Each block is resampled with enough of its
    neighbours' samples around it that the concatenated blocks equal `load_audio(path)` (to float
    rounding). Errors as in `load_audio`; a truncation or a bad sample is raised when reached, after
    the blocks before it were yielded.

    on_truncated: called, instead of raising, with the one-line message ("<path>: truncated: ...")
    of a file that ends before its container says it should, once the audio that is there has
    been yielded: a WAV whose data chunk is longer than the file, a FLAC or MP3 decoding to fewer
    frames than its header announces, an Ogg stream without its last page, or a decoder error part
    way (the audio before it, read again in small pieces, is kept). A file of which nothing can be
    decoded is still an AudioError.
    """
    if not block_seconds > 0:
        raise ValueError(f"block_seconds must be positive, got {block_seconds!r}")
    with closing(_Source(path, raw, lenient=on_truncated is not None)) as src:
        rate = src.info.sample_rate
        down = _reduced_ratio(rate, SAMPLE_RATE)[0]
        step = down * max(1, round(block_seconds * rate / down))  # input frames per block
        context = _resample_context(rate)  # input frames needed on each side of a block
        before = np.zeros(context, np.float32)  # zeros before the file, as resample() pads
        block = src.read_upto(step)
        while block.size:
            after = src.read_upto(step)
            yield _resample_block(before, block, after[:context], rate)
            joined = np.concatenate([before, block])
            before = joined[len(joined) - context:]
            block = after
        problem = src.check_complete()
        if problem is not None and on_truncated is not None:
            on_truncated(str(src.error(problem)))


def resample(wave: torch.Tensor, orig_rate: int, new_rate: int) -> torch.Tensor:
    """(..., T) waveform at `orig_rate` Hz -> (..., ceil(T * new_rate / orig_rate)) float32 at
    `new_rate` Hz (torchaudio's windowed-sinc resampler, zero-padded at both ends).
    ValueError for a rate that is not a positive whole number, or a rate pair whose filter would
    exceed 64 MB (rates with no large common divisor, e.g. 16001 -> 16000 Hz)."""
    for name, rate in (("orig_rate", orig_rate), ("new_rate", new_rate)):
        if int(rate) != rate or rate <= 0:
            raise ValueError(f"{name} must be a positive whole number of Hz, got {rate!r}")
    wave = wave.to(torch.float32)
    if orig_rate == new_rate:
        return wave
    _check_filter(int(orig_rate), int(new_rate))
    return _resampler(int(orig_rate), int(new_rate))(wave)


def _filter_elements(orig_rate: int, new_rate: int) -> int:
    """Elements of torchaudio's resampling filter for this rate pair: (new, 2 * width + orig) in
    the reduced ratio, width as torchaudio computes it."""
    orig, new = _reduced_ratio(orig_rate, new_rate)
    width = math.ceil(_LOWPASS_FILTER_WIDTH * orig / (min(orig, new) * _ROLLOFF))
    return new * (2 * width + orig)


def _filter_problem(orig_rate: int, new_rate: int) -> str | None:
    """Why resampling orig_rate -> new_rate is refused (a filter over _MAX_FILTER elements), if it is."""
    if orig_rate == new_rate or _filter_elements(orig_rate, new_rate) <= _MAX_FILTER:
        return None
    megabytes = _filter_elements(orig_rate, new_rate) * 4 / 2**20
    return (f"resampling {orig_rate} Hz to {new_rate} Hz needs a {megabytes:,.0f} MB filter (the rates share no "
            f"large divisor); convert the audio to a common rate first, e.g. 'sox IN -r {new_rate} OUT.wav'")


def _check_filter(orig_rate: int, new_rate: int) -> None:
    problem = _filter_problem(orig_rate, new_rate)
    if problem:
        raise ValueError(problem)


def _rate_problem(rate: int) -> str | None:
    """Why audio at `rate` Hz is refused (too low for speech, or too costly to resample), if it is."""
    if rate < _MIN_RATE:
        return f"sample rate {rate} Hz is too low for speech (at least {_MIN_RATE} Hz)"
    return _filter_problem(rate, SAMPLE_RATE)


@functools.lru_cache(maxsize=16)
def _resampler(orig_rate: int, new_rate: int) -> torch.nn.Module:
    """torchaudio's Resample of one rate pair, its windowed-sinc kernel built once (float32, as
    torchaudio.functional.resample builds it for float32 input, so results are the same)."""
    import torchaudio.transforms  # lazy: a second or more to import, and only needed here

    return torchaudio.transforms.Resample(orig_rate, new_rate, dtype=torch.float32)


def to_mono_16k(wave: np.ndarray | torch.Tensor, sample_rate: int) -> torch.Tensor:
    """A waveform given in memory -> (T',) float32 16 kHz mono (channel mean).

    wave: numpy array or tensor, (T,) or (T, C) as soundfile returns it (not torchaudio's (C, T)),
    float in [-1, 1] or int8/uint8/int16/int32 PCM (scaled to [-1, 1)).
    Raises TypeError for another kind of object, ValueError for another shape or sample type,
    for NaN/inf samples, or for a rate under 4000 Hz or too costly to resample (see `resample`).
    """
    if isinstance(sample_rate, bool) or not isinstance(sample_rate, (int, np.integer)) or sample_rate <= 0:
        raise ValueError(f"sample rate must be a positive whole number of Hz, got {sample_rate!r}")
    problem = _rate_problem(int(sample_rate))
    if problem:
        raise ValueError(problem)
    x = _float_tensor(wave)
    if x.ndim == 2:
        if x.shape[1] > _MAX_CHANNELS:
            raise ValueError(
                f"waveform of shape {tuple(x.shape)}: expected (T,) or (T, C); transpose a (C, T) waveform"
            )
        x = x.mean(dim=1)
    elif x.ndim != 1:
        raise ValueError(f"waveform of shape {tuple(x.shape)}: expected (T,) or (T, C)")
    if not bool(torch.isfinite(x).all()):
        raise ValueError("waveform contains NaN or infinite samples")
    return resample(x, sample_rate, SAMPLE_RATE)


class _Source:
    """An open, checked audio file: its AudioInfo, and reads of mono float32 frames that raise
    AudioError on decoding errors, truncation and non-finite samples. `lenient` (iter_blocks'
    on_truncated): a truncation found by the header (a WAV's data size) or by a decoder error part
    way is kept to be reported by `check_complete`, and the audio before it is read."""

    def __init__(self, path: str | bytes | os.PathLike, raw: RawFormat | None, *, lenient: bool = False):
        self.path = os.fsdecode(path)  # a name that is not UTF-8 keeps its bytes (surrogateescape)
        self.raw, self.lenient = raw, lenient
        self.truncation: str | None = None  # what a lenient read found wrong at the end
        self.ended = False  # a lenient read stopped at a decoder error: nothing more is read
        self.file: sf.SoundFile | None = None
        self.fd = -1
        _check_file(self.path)
        self._open()
        try:
            self.info = self._read_info(raw)
        except BaseException:
            self.close()
            raise
        self.position = 0  # frame index of the next read

    def _open(self) -> None:
        """libsndfile on a file descriptor: the content picks the decoder, the name plays no part."""
        try:
            self.fd = os.open(os.fsencode(self.path), os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        except OSError as e:
            raise AudioError(self.path, e.strerror or "cannot be opened") from None
        try:
            self.file = _open_soundfile(self.fd, self.path, self.raw)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Close the file (again: nothing; a descriptor is never closed twice, its number may be reused)."""
        file, fd = self.file, self.fd
        self.file, self.fd = None, -1
        try:
            if file is not None:
                file.close()
        finally:
            if fd >= 0:
                os.close(fd)

    def error(self, reason: str) -> AudioError:
        return AudioError(self.path, reason)

    def segment(self, start: float, end: float | None) -> tuple[int, int]:
        """[first, last) frame range of start..end seconds, checked against the file."""
        rate, frames = self.info.sample_rate, self.info.frames
        span = f"the audio is {frames / rate:.3f} s long"
        first = round(start * rate) if start >= 0 else -1  # NaN fails every comparison
        if not 0 <= first < frames:
            raise self.error(f"start {start:g} s is outside the audio ({span})")
        if end is None:
            return first, frames
        if not end <= frames / rate + _END_SLACK_S:
            raise self.error(f"end {end:g} s is beyond the end of the audio ({span})")
        last = min(round(end * rate), frames)
        if last <= first:
            raise self.error(f"end {end:g} s is not after start {start:g} s")
        return first, last

    def seek(self, frame: int) -> None:
        try:
            self.file.seek(frame)
        except (sf.LibsndfileError, RuntimeError) as err:
            where = frame / self.info.sample_rate
            raise self.error(f"cannot seek to {where:.3f} s ({_libsndfile_message(err)})") from None
        self.position = frame

    def read_upto(self, frames: int) -> np.ndarray:
        """(n,) float32 mono, n = frames unless the file ends first (never past the header's end).
        Decoded _READ_SAMPLES at a time: a header claiming more than the file holds costs nothing."""
        left = min(frames, self.info.frames - self.position)
        piece = max(1, _READ_SAMPLES // self.info.channels)  # frames per read
        parts = []
        while left > 0:
            want = min(left, piece)
            parts.append(self._read(want))
            left -= len(parts[-1])
            if len(parts[-1]) < want:  # the data ends before the header says
                break
        if not parts:
            return np.zeros(0, np.float32)
        return parts[0] if len(parts) == 1 else np.concatenate(parts)

    def _read(self, frames: int) -> np.ndarray:
        """(n <= frames,) float32 mono from the current position, checked finite."""
        if self.ended:
            return np.zeros(0, np.float32)
        try:
            data = self.file.read(frames, dtype="float32", always_2d=True)  # (n, C)
        except (sf.LibsndfileError, RuntimeError) as err:
            reason = f"corrupt or truncated audio data ({_libsndfile_message(err)})"
            if not self.lenient:
                raise self.error(reason) from None
            data = self._salvage(frames)
            at, total = (self.position + len(data)) / self.info.sample_rate, self.info.duration
            self.truncation = (f"truncated or damaged: decoding fails at {at:.3f} s of the {total:.3f} s the header "
                               f"announces ({_libsndfile_message(err)})")
            self.ended = True
        self._check_finite(data)
        self.position += len(data)
        mono = data[:, 0] if data.shape[1] == 1 else data.mean(axis=1)
        return np.ascontiguousarray(mono, dtype=np.float32)

    def _salvage(self, frames: int) -> np.ndarray:
        """(n, C): what decodes of the `frames` from self.position, after a read of them failed: read
        again in pieces of _SALVAGE_FRAMES, halved at each failure down to _SALVAGE_MIN_FRAMES, the
        file opened again after each (libsndfile's state after an error is not to be trusted)."""
        parts = [np.zeros((0, self.info.channels), np.float32)]
        position, piece, failed = self.position, _SALVAGE_FRAMES, True
        while frames > 0 and piece >= _SALVAGE_MIN_FRAMES:
            want = min(frames, piece)
            try:
                if failed:
                    self.close()
                    self._open()
                    if position:
                        self.file.seek(position)
                    failed = False
                data = self.file.read(want, dtype="float32", always_2d=True)
            except (sf.LibsndfileError, RuntimeError):
                piece, failed = piece // 2, True
                continue
            except AudioError:  # it cannot be opened again (gone since): what was read is kept
                self.ended = True
                break
            parts.append(data)
            position += len(data)
            frames -= len(data)
            if len(data) < want:
                break
        return np.concatenate(parts)

    def read_exactly(self, frames: int) -> np.ndarray:
        """(frames,) float32 mono; AudioError when the file ends first."""
        samples = self.read_upto(frames)
        if len(samples) < frames:
            self.check_complete()
        return samples

    def check_complete(self) -> str | None:
        """After reading to the end: why the audio ended early (a header's frame count not reached,
        a WAV's data chunk longer than the file, a decoder error, an Ogg stream without its last
        page), raised as AudioError, or, when lenient, returned (None: complete). Nothing at all
        decoded is always raised."""
        problem = self.truncation
        if problem is None and self.position < self.info.frames:
            seconds = self.position / self.info.sample_rate
            problem = (f"truncated: decoding ends at frame {self.position} ({seconds:.3f} s) of the "
                       f"{self.info.frames} the header announces")
        if problem is None and self.info.format == "OGG":
            problem = _ogg_problem(self.fd)
        if problem is not None and (not self.lenient or self.position == 0):
            raise self.error(problem)
        return problem

    def _check_finite(self, data: np.ndarray) -> None:
        """data: (n, C) read from self.position."""
        bad = ~np.isfinite(data).all(axis=1)
        if bad.any():
            index = int(np.argmax(bad))
            kind = "NaN" if np.isnan(data[index]).any() else "infinite"
            at = (self.position + index) / self.info.sample_rate
            raise self.error(f"contains {kind} samples (the first at {at:.3f} s)")

    def _read_info(self, raw: RawFormat | None) -> AudioInfo:
        f = self.file
        frames = f.frames
        if frames >= _UNKNOWN_FRAMES:
            raise self.error(
                "the header does not state the length (a stream written to a pipe?), which soundfile "
                "cannot read; re-encode the file"
            )
        problem = _riff_problem(self.fd) if f.format in ("WAV", "WAVEX") else None
        if problem and self.lenient and problem.startswith("truncated"):
            self.truncation = problem  # libsndfile reads what is there
        elif problem:
            raise self.error(problem)
        if frames <= 0:
            raise self.error("no audio frames (empty)")
        problem = _rate_problem(f.samplerate)
        if problem:
            raise self.error(problem)
        size = os.fstat(self.fd).st_size
        if raw is not None and size % raw.frame_bytes:
            raise self.error(
                f"truncated: {size} bytes is not a whole number of "
                f"{raw.frame_bytes}-byte frames ({raw.subtype} x {raw.channels} channels)"
            )
        return AudioInfo(f.samplerate, frames, f.channels, f.format, f.subtype)


def _check_file(path: str) -> None:
    """Raise AudioError for what libsndfile would only call "System error" or "not recognised"."""
    if "\0" in path:
        raise AudioError(path, "a file name cannot hold a NUL character")
    if not os.path.exists(path):
        raise AudioError(path, "no such file")
    if os.path.isdir(path):
        raise AudioError(path, "is a directory, not an audio file")
    if not os.access(path, os.R_OK):
        raise AudioError(path, "permission denied")
    if os.path.getsize(path) == 0:
        raise AudioError(path, "empty file (0 bytes)")


def _open_soundfile(fd: int, path: str, raw: RawFormat | None) -> sf.SoundFile:
    """soundfile on the open descriptor `fd` of `path` (which names it in errors)."""
    if raw is None:
        options = {}
    else:
        options = {"format": "RAW", "samplerate": raw.sample_rate, "channels": raw.channels,
                   "subtype": raw.subtype, "endian": raw.endian}
    try:
        return sf.SoundFile(fd, "r", closefd=False, **options)
    except (sf.LibsndfileError, RuntimeError) as err:
        message = _libsndfile_message(err)
        if "not recognised" in message.lower():
            reason = f"not an audio file, or a format libsndfile cannot read ({message})"
        else:
            reason = f"corrupt or malformed audio file ({message})"
        raise AudioError(path, reason) from None


def _libsndfile_message(err: Exception) -> str:
    """libsndfile's own words for `err`, without its "Error :" prefix and final period."""
    message = getattr(err, "error_string", "") or str(err)
    message = " ".join(message.split()).removeprefix("Error :").strip().rstrip(".")
    return message or type(err).__name__


def _riff_problem(fd: int) -> str | None:
    """Why a RIFF/WAVE file's data chunk size disagrees with the file (open as `fd`), if it does.

    libsndfile silently shortens a cut file to what is there, and reads a data size of 0 as an
    empty file, so the header is read here (os.pread: libsndfile's offset in the file is left alone).
    """
    size = os.fstat(fd).st_size
    head = os.pread(fd, 12, 0)
    if head[:4] not in (b"RIFF", b"RIFX") or head[8:12] != b"WAVE":
        return None
    order = "little" if head[:4] == b"RIFF" else "big"
    position = 12
    while position + 8 <= size:
        chunk = os.pread(fd, 8, position)
        declared = int.from_bytes(chunk[4:8], order)
        if chunk[:4] == b"data":
            held = size - position - 8
            if declared == 0 and held > 0:
                return (f"the header announces 0 bytes of audio but the file holds {held} "
                        "(a WAV written to a pipe?); rewrite its header, e.g. with sox")
            if held < declared < _RIFF_UNKNOWN_SIZE:
                return f"truncated: the header announces {declared} bytes of audio, the file holds {held}"
            return None
        position += 8 + declared + (declared & 1)  # chunks are padded to even sizes
    return None


def _ogg_problem(fd: int) -> str | None:
    """Why an Ogg file (open as `fd`) ends before its streams do, if it does: its pages walked from
    the first (a 27-byte header each, a segment table and the sizes it lists), the last one cut
    short, or a stream whose last page lacks the end-of-stream flag. None when the pages are not
    all well formed (libsndfile has decoded the file: it is not for this check to refuse it)."""
    size = os.fstat(fd).st_size
    position, last_flags = 0, {}  # stream serial -> header flags of its last page
    while position < size:
        header = os.pread(fd, 27, position)
        if len(header) < 27 or header[:4] != b"OggS" or header[4] != 0:
            if size - position < 27 and b"OggS".startswith(header[:4]):
                return f"truncated: the file ends inside an Ogg page header at byte {position}"
            return None
        table = os.pread(fd, header[26], position + 27)
        end = position + 27 + header[26] + sum(table)
        if len(table) < header[26] or end > size:
            return (f"truncated: the last Ogg page (at byte {position}) is cut short, {end - size} bytes are "
                    "missing at least")
        last_flags[header[14:18]] = header[5]
        position = end
    if any(not flags & 0x04 for flags in last_flags.values()):
        return "truncated: the Ogg stream ends without its end-of-stream page (the file was cut)"
    return None


def _reduced_ratio(orig_rate: int, new_rate: int) -> tuple[int, int]:
    """(orig, new) divided by their gcd: every `orig` input frames give exactly `new` output."""
    g = math.gcd(orig_rate, new_rate)
    return orig_rate // g, new_rate // g


def _resample_context(rate: int) -> int:
    """Input frames on each side of a block that resampling it to 16 kHz reads: the filter's
    half-width (as torchaudio computes it), rounded up to a whole multiple of the reduced ratio."""
    if rate == SAMPLE_RATE:
        return 0
    down, up = _reduced_ratio(rate, SAMPLE_RATE)
    width = math.ceil(_LOWPASS_FILTER_WIDTH * down / (min(down, up) * _ROLLOFF))
    return down * math.ceil((width + 1) / down)


def _resample_block(before: np.ndarray, block: np.ndarray, after: np.ndarray, rate: int) -> torch.Tensor:
    """16 kHz samples of `block` (its first frame a multiple of the reduced ratio into the file),
    resampled with `before` / `after` (up to `context` frames; zeros past the end of the file)."""
    context = len(before)
    down, up = _reduced_ratio(rate, SAMPLE_RATE)
    padding = np.zeros(context - len(after), np.float32)
    chunk = torch.from_numpy(np.concatenate([before, block, after, padding]))
    skip = context // down * up
    return resample(chunk, rate, SAMPLE_RATE)[skip: skip + -(-len(block) * up // down)]


def check_speed(speed: float) -> None:
    """ValueError unless `speed` is a usable speed perturbation factor: positive, finite, and with
    a cheap resampling filter (three decimals or fewer always are: 0.9, 1.05, 0.913)."""
    if not (math.isfinite(speed) and speed > 0):
        raise ValueError(f"speed must be positive, got {speed!r}")
    problem = _filter_problem(_speed_rate(speed), SAMPLE_RATE)
    if problem:
        raise ValueError(f"speed {speed:g}: {problem.split(' (')[0]}; use a factor of at most three decimals")


def _speed_rate(speed: float) -> int:
    """The rate (Hz) the 16 kHz audio is taken to have for speed perturbation by `speed`."""
    return round(SAMPLE_RATE * speed)


def _perturb_speed(wave: torch.Tensor, speed: float) -> torch.Tensor:
    """Speed perturbation of a 16 kHz waveform: (T,) -> about (T / speed,)."""
    if speed == 1.0:
        return wave
    return resample(wave, _speed_rate(speed), SAMPLE_RATE)


def _float_tensor(wave: np.ndarray | torch.Tensor) -> torch.Tensor:
    """numpy or torch samples -> float32 tensor, integer PCM scaled to [-1, 1)."""
    if isinstance(wave, np.ndarray):
        wave = torch.from_numpy(wave if wave.flags.writeable else wave.copy())
    elif not isinstance(wave, torch.Tensor):
        raise TypeError(f"waveform must be a numpy array or a torch tensor, got {type(wave).__name__}")
    kind = str(wave.dtype).removeprefix("torch.")
    if kind in _INT_SCALE:
        offset, scale = _INT_SCALE[kind]
        return (wave.to(torch.float32) - offset) / scale
    if not wave.is_floating_point():
        raise ValueError(f"waveform samples of type {kind}: give floats or int8/uint8/int16/int32 PCM")
    return wave.to(torch.float32)
