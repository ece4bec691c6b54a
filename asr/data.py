"""Manifests, corpus import, the training Dataset, the duration-bucketed batch sampler and collate.

A manifest is JSON Lines, one utterance per line (DESIGN.md "Manifest"):
    {"id": "1089-134686-0000", "audio": "/abs/1089-134686-0000.flac", "duration": 10.43, "text": "HE HOPED ..."}
with optional "start" / "end" (seconds of the file), "speed" (speed perturbation) and "speaker".

Error policy ("Nothing is lost"): a malformed manifest or corpus-list line is fatal (ManifestError
"path:line: reason"); a well-formed utterance whose audio cannot be used is returned as
`Skipped(id, reason)` by the Dataset, recorded in `ASRDataLoader.skipped` and logged once per
process by the loader of `make_loader`, never raised out of the loader. Every report goes to the logger
`asr.data`. Randomness (shuffling, dither, SpecAugment) is derived from (seed, epoch, index or
batch) only, so that a resumed run sees the same data in the same order.
"""
from __future__ import annotations

import dataclasses
import gc
import json
import logging
import math
import os
import secrets
import shlex
import zlib
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, ClassVar, NamedTuple

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from asr.audio import SAMPLE_RATE, AudioError, AudioInfo, audio_info, check_speed, load_audio
from asr.features import (
    CMVNStats,
    FeatureConfig,
    GlobalCMVN,
    SpecAugmentConfig,
    fbank,
    spec_augment,
)
from asr.fileio import TextFileError, atomic_open, numbered_lines, read_table
from asr.metrics import normalize_text
from asr.tokenizer import Tokenizer

__all__ = [
    "ASRDataLoader",
    "ASRDataset",
    "Batch",
    "DataConfig",
    "DurationBucketSampler",
    "Example",
    "FeatureArchive",
    "FeatureArchiveError",
    "ManifestError",
    "Skipped",
    "Utterance",
    "collate",
    "compute_cmvn",
    "derive_seed",
    "make_loader",
    "prepare_kaldi",
    "prepare_librispeech",
    "read_manifest",
    "select_by_duration",
    "speed_perturb",
    "split_skipped",
    "write_manifest",
]

logger = logging.getLogger("asr.data")

LENGTH_TOLERANCE = 0.1  # seconds: decoded length vs manifest duration (DESIGN.md)
KALDI_MAX_OVERSHOOT = 0.5  # seconds a segment may end past its recording (Kaldi extract-segments default)
_HEADER_THREADS = 8  # header reads are I/O bound: a few threads hide file-system latency


# ---------------------------------------------------------------------------------------------
# Manifest


@dataclass(frozen=True)
class Utterance:
    """One manifest line. `audio` is absolute once read; `duration` (s) is what is used:
    (end - start) / speed for a segment of a speed-perturbed file."""

    id: str
    audio: str
    duration: float
    text: str
    start: float | None = None
    end: float | None = None
    speed: float = 1.0
    speaker: str | None = None

    def to_json(self, base_dir: str | os.PathLike | None = None) -> dict[str, Any]:
        """The manifest dict; optional keys only when set. With `base_dir`, `audio` is written
        relative to it (for a manifest stored in base_dir)."""
        audio = os.path.relpath(self.audio, base_dir) if base_dir is not None else self.audio
        d: dict[str, Any] = {"id": self.id, "audio": audio, "duration": self.duration, "text": self.text}
        if self.start is not None:
            d["start"] = self.start
        if self.end is not None:
            d["end"] = self.end
        if self.speed != 1.0:
            d["speed"] = self.speed
        if self.speaker is not None:
            d["speaker"] = self.speaker
        return d


class ManifestError(ValueError):
    """A manifest or corpus list (wav.scp, segments, text, trans.txt) that cannot be used:
    one line, "path:line: reason" (or "path: reason")."""


class _LineError(ValueError):
    """A reason without its location; the reader adds "path:line: "."""


def read_manifest(path: str | os.PathLike) -> list[Utterance]:
    """Read a JSON Lines manifest. Blank lines are allowed; unknown keys are ignored.

    Every malformed line is fatal: ManifestError "path:line: reason" for bad JSON, a line that is
    not an object, a missing or mistyped field, a string that is not valid Unicode (an escaped lone
    surrogate), a duration that is not a finite positive number, a duplicate id (naming the first
    line too), an invalid start/end, speed <= 0.
    Relative `audio` paths are resolved against the manifest's folder.
    """
    base = os.path.dirname(os.path.abspath(path))
    utts: list[Utterance] = []
    first_line: dict[str, int] = {}
    with _manifest_errors():
        for n, line in numbered_lines(path):
            try:
                utt = _parse_manifest_line(line, base)
                if utt.id in first_line:
                    raise _LineError(f"duplicate id {utt.id} (first on line {first_line[utt.id]})")
            except _LineError as e:
                raise ManifestError(f"{path}:{n}: {e}") from None
            first_line[utt.id] = n
            utts.append(utt)
    return utts


def write_manifest(utts: Iterable[Utterance], path: str | os.PathLike) -> None:
    """Write a manifest atomically (temporary file + rename), one line per utterance, in the
    given order; audio paths as they are. A duplicate id is refused (ValueError): the file
    would not read back."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    seen: set[str] = set()
    with atomic_open(path) as f:
        for utt in utts:
            if utt.id in seen:
                raise ValueError(f"{path}: duplicate id '{utt.id}'")
            seen.add(utt.id)
            f.write(json.dumps(utt.to_json(), ensure_ascii=False) + "\n")


@contextmanager
def _manifest_errors() -> Iterator[None]:
    """Re-raise asr.fileio's TextFileError (missing file, not UTF-8, duplicate id) as ManifestError."""
    try:
        yield
    except TextFileError as e:
        raise ManifestError(str(e)) from None


def _parse_manifest_line(line: str, base: str) -> Utterance:
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise _LineError(f"bad JSON: {e.msg} (column {e.colno})") from None
    except RecursionError:
        raise _LineError("bad JSON: nested too deeply") from None
    if not isinstance(obj, dict):
        raise _LineError(f"expected a JSON object, got {_json_type(obj)}")
    utt_id = _str_field(obj, "id")
    if not utt_id or any(c.isspace() for c in utt_id):
        raise _LineError(f"id {utt_id!r} is empty or contains whitespace")
    audio = _str_field(obj, "audio")
    if not audio or "\0" in audio:
        raise _LineError("audio is empty" if not audio else "audio holds a NUL character")
    utt = Utterance(
        id=utt_id,
        audio=audio if os.path.isabs(audio) else os.path.normpath(os.path.join(base, audio)),
        duration=_num_field(obj, "duration"),
        text=_str_field(obj, "text"),
        start=_num_field(obj, "start", required=False),
        end=_num_field(obj, "end", required=False),
        speed=_num_field(obj, "speed", required=False, default=1.0),
        speaker=_str_field(obj, "speaker", required=False),
    )
    _check_times(utt)
    return utt


def _check_times(utt: Utterance) -> None:
    """duration > 0, speed > 0, 0 <= start < end, duration == (end - start) / speed (+- tolerance)."""
    if utt.duration <= 0:
        raise _LineError(f"duration must be positive, got {utt.duration}")
    if utt.speed <= 0:
        raise _LineError(f"speed must be positive, got {utt.speed}")
    if utt.start is not None and utt.start < 0:
        raise _LineError(f"start must be >= 0, got {utt.start}")
    if utt.end is None:
        return
    start = utt.start or 0.0
    if utt.end <= start:
        raise _LineError(f"end ({utt.end}) must be after start ({start})")
    used = (utt.end - start) / utt.speed
    if abs(used - utt.duration) > LENGTH_TOLERANCE:
        raise _LineError(f"duration {utt.duration} disagrees with (end - start) / speed = {used:.3f}")


def _str_field(obj: dict, name: str, *, required: bool = True) -> str | None:
    value = obj.get(name)
    if value is None:
        if required:
            raise _LineError(f"missing field '{name}'" if name not in obj else f"field '{name}' is null")
        return None
    if not isinstance(value, str):
        raise _LineError(f"field '{name}' must be a string, got {_json_type(value)} {_short(value)}")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise _LineError(f"field '{name}' is not valid Unicode (a lone surrogate at character {e.start})") from None
    return value


def _num_field(obj: dict, name: str, *, required: bool = True, default: float | None = None) -> float | None:
    value = obj.get(name)
    if value is None:
        if required:
            raise _LineError(f"missing field '{name}'" if name not in obj else f"field '{name}' is null")
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _LineError(f"field '{name}' must be a number, got {_json_type(value)} {_short(value)}")
    try:
        number = float(value)
    except OverflowError:  # a JSON integer of hundreds of digits
        number = math.inf
    if not math.isfinite(number):
        raise _LineError(f"field '{name}' must be finite, got {_short(value)}")
    return number


def _json_type(value: Any) -> str:
    names = {dict: "an object", list: "an array", str: "a string", bool: "a boolean", type(None): "null"}
    return names.get(type(value), "a number")


def _short(value: Any) -> str:
    text = json.dumps(value, ensure_ascii=False)
    return text if len(text) <= 40 else text[:37] + "..."


# ---------------------------------------------------------------------------------------------
# Corpus import: LibriSpeech and Kaldi data directories


def prepare_librispeech(
    root: str | os.PathLike, out_dir: str | os.PathLike, parts: Sequence[str] | None = None
) -> dict[str, int]:
    """Write out_dir/<part>.jsonl for each LibriSpeech part; returns {part: utterances written}.

    `root` is the folder holding `LibriSpeech/`, `LibriSpeech/` itself, or one part folder.
    Layout: <part>/<spk>/<chapter>/<spk>-<chapter>-<utt>.flac + <spk>-<chapter>.trans.txt.
    `parts` defaults to every part present. Durations come from the file headers; texts are
    normalized (asr.metrics.normalize_text); lines are sorted by id. Partial chapters are fine:
    a transcript line without its file, a file without a transcript line, or an unreadable
    header is logged as a warning naming it, skipped and counted in the part's summary line.
    """
    found = _librispeech_parts(Path(root))
    wanted = sorted(found) if parts is None else list(parts)
    missing = [p for p in wanted if p not in found]
    if missing:
        raise ManifestError(f"{root}: no LibriSpeech part {', '.join(missing)} (found: {', '.join(sorted(found))})")
    counts = {}
    for part in wanted:
        utts = _librispeech_part(found[part])
        write_manifest(utts, Path(out_dir) / f"{part}.jsonl")
        counts[part] = len(utts)
    return counts


def _librispeech_parts(root: Path) -> dict[str, Path]:
    """{part name: folder} under root (see prepare_librispeech for what root may be)."""
    base = root / "LibriSpeech" if (root / "LibriSpeech").is_dir() else root
    if not base.is_dir():
        raise ManifestError(f"{root}: no such folder")
    parts = {d.name: d for d in sorted(base.iterdir()) if d.is_dir() and _is_librispeech_part(d)}
    if not parts and _is_librispeech_part(base):
        parts = {base.name: base}
    if not parts:
        raise ManifestError(f"{root}: no LibriSpeech parts (<part>/<speaker>/<chapter>/*.trans.txt)")
    return parts


def _is_librispeech_part(folder: Path) -> bool:
    return next(folder.glob("*/*/*.trans.txt"), None) is not None


def _librispeech_part(part: Path) -> list[Utterance]:
    """The utterances of one part, sorted by id; partial chapters reported and skipped."""
    texts: dict[str, str] = {}
    lines: dict[str, str] = {}  # id -> "trans.txt path:line", for reports
    for trans in sorted(part.glob("*/*/*.trans.txt")):
        for utt_id, (n, words) in _read_table(trans).items():
            texts[utt_id], lines[utt_id] = words, f"{trans}:{n}"
    files = {p.name[: -len(".flac")]: p for p in part.glob("*/*/*.flac")}
    no_audio = sorted(texts.keys() - files.keys())
    no_text = sorted(files.keys() - texts.keys())
    for utt_id in no_audio:
        logger.warning("%s: %s: transcript line but no audio file; skipped", lines[utt_id], utt_id)
    for utt_id in no_text:
        logger.warning("%s: audio file with no transcript line; skipped", files[utt_id])
    ids = sorted(texts.keys() & files.keys())
    infos = _header_infos([str(files[i]) for i in ids])
    utts = []
    for utt_id, info in zip(ids, infos):
        if isinstance(info, AudioError):
            logger.warning("%s: %s; skipped", utt_id, info)
            continue
        path = os.path.abspath(files[utt_id])
        text = normalize_text(texts[utt_id])
        utts.append(Utterance(utt_id, path, info.duration, text, speaker=utt_id.split("-")[0]))
    skipped = len(no_audio) + len(no_text) + len(ids) - len(utts)
    logger.info(
        "%s: %d utterances; %d skipped (%d without audio, %d without transcript, %d unreadable)",
        part, len(utts), skipped, len(no_audio), len(no_text), len(ids) - len(utts),
    )
    return utts


def _header_infos(paths: Sequence[str]) -> list[AudioInfo | AudioError]:
    """audio_info of each path (header reads, a few threads), or the AudioError it raised."""

    def info(path: str) -> AudioInfo | AudioError:
        try:
            return audio_info(path)
        except AudioError as e:
            return e

    with ThreadPoolExecutor(_HEADER_THREADS) as pool:
        return list(pool.map(info, paths))


def _read_table(path: Path) -> dict[str, tuple[int, str]]:
    """asr.fileio.read_table ({key: (line number, rest)}; a duplicate key is fatal) raising ManifestError."""
    with _manifest_errors():
        return read_table(path)


@dataclass(frozen=True)
class _Recording:
    path: str  # absolute
    info: AudioInfo | AudioError  # the header, or why it could not be read
    where: str  # "wav.scp path:line" for reports


@dataclass(frozen=True)
class _Segment:
    rec: str
    start: float | None
    end: float | None  # None: to the end of the recording
    where: str  # "path:line" of the line that defines the utterance, for reports


def prepare_kaldi(data_dir: str | os.PathLike, out_path: str | os.PathLike) -> int:
    """Convert a Kaldi data directory to a manifest; returns the number of utterances written.

    wav.scp: "ID PATH" (a relative PATH is looked up from the current folder as Kaldi does, then
    from data_dir; written absolute) or "ID COMMAND |" where only `flac -c -d -s PATH |` and
    `sox PATH -t wav - |` are understood (PATH read directly); any other pipe is fatal
    ("wav.scp:LINE: pipe not supported: ..."). Optional `segments` ("UTT REC START END", END -1 =
    to the end of the recording), `text` (normalized; when absent every text is "") and
    `utt2spk`. Durations come from the headers and segments; lines are sorted by id.
    An unreadable recording, a segment outside its recording, or an utterance missing from an
    existing `text` is logged (id and reason), skipped and counted; a malformed line is fatal
    (ManifestError naming the file and line).
    """
    data_dir = Path(data_dir)
    recordings = _kaldi_recordings(data_dir / "wav.scp", data_dir)
    segments = _kaldi_segments(data_dir / "segments", recordings)
    texts = _optional_table(data_dir / "text")
    speakers = _optional_table(data_dir / "utt2spk") or {}
    if texts is None:
        logger.info("%s: no text file; empty transcripts", data_dir)
    utts = []
    for utt_id in sorted(segments):
        seg = segments[utt_id]
        utt = _kaldi_utterance(utt_id, seg, recordings[seg.rec], texts)
        if utt is not None:
            speaker = speakers.get(utt_id, "").split()
            utts.append(replace(utt, speaker=speaker[0]) if speaker else utt)
    extra = sorted((texts or {}).keys() - segments.keys())
    if extra:
        logger.warning("%s: %d lines for unknown utterances ignored, e.g. %s", data_dir / "text", len(extra), extra[0])
    write_manifest(utts, out_path)
    logger.info("%s: %d utterances; %d skipped", data_dir, len(utts), len(segments) - len(utts))
    return len(utts)


def _kaldi_utterance(utt_id: str, seg: _Segment, rec: _Recording, texts: dict[str, str] | None) -> Utterance | None:
    """The utterance of one segment, or None (reported) when it cannot be used."""
    info = rec.info
    if isinstance(info, AudioError):
        logger.warning("%s: %s: %s; skipped", seg.where, utt_id, info)
        return None
    if texts is not None and utt_id not in texts:
        logger.warning("%s: %s: no line in text; skipped", seg.where, utt_id)
        return None
    start, end = seg.start or 0.0, info.duration if seg.end is None else seg.end
    if end > info.duration + KALDI_MAX_OVERSHOOT or start >= info.duration:
        logger.warning(
            "%s: %s: segment %.2f-%.2f s outside recording %s (%.2f s); skipped",
            seg.where, utt_id, start, end, rec.path, info.duration,
        )
        return None
    end = min(end, info.duration)
    text = normalize_text(texts[utt_id]) if texts is not None else ""
    seg_end = None if end == info.duration else end
    return Utterance(utt_id, rec.path, end - start, text, start=seg.start or None, end=seg_end)


def _kaldi_recordings(wav_scp: Path, data_dir: Path) -> dict[str, _Recording]:
    """{recording id: _Recording} from wav.scp, headers read."""
    paths, wheres = {}, {}
    for rec, (n, rest) in _read_table(wav_scp).items():
        wheres[rec] = f"{wav_scp}:{n}"
        if not rest:
            raise ManifestError(f"{wheres[rec]}: expected 'ID PATH' or 'ID COMMAND |'")
        path = rest
        if rest.endswith("|"):
            path = _pipe_input(rest[:-1].strip())
            if path is None:
                raise ManifestError(f"{wheres[rec]}: pipe not supported: {rest}")
        paths[rec] = _resolve_kaldi_path(path, data_dir)
    infos = _header_infos(list(paths.values()))
    return {rec: _Recording(paths[rec], info, wheres[rec]) for rec, info in zip(paths, infos)}


def _pipe_input(command: str) -> str | None:
    """PATH of `flac -c -d -s PATH` (flags in any order, combined or long) or
    `sox PATH -t wav -`; None for any other command."""
    try:
        words = shlex.split(command)
    except ValueError:
        return None
    if not words:
        return None
    program, args = os.path.basename(words[0]), words[1:]
    if program == "sox" and len(args) == 4 and args[1:] == ["-t", "wav", "-"]:
        return args[0]
    if program != "flac":
        return None
    flags = [a for a in args if a.startswith("-")]
    paths = [a for a in args if not a.startswith("-")]
    letters = {c for f in flags if not f.startswith("--") for c in f[1:]}
    letters |= {{"--stdout": "c", "--decode": "d", "--silent": "s"}.get(f, "?") for f in flags if f.startswith("--")}
    if len(paths) != 1 or not {"c", "d"} <= letters or not letters <= {"c", "d", "s"}:
        return None
    return paths[0]


def _resolve_kaldi_path(path: str, data_dir: Path) -> str:
    """Absolute path: as given, else from the current folder (Kaldi), else from data_dir.
    When neither exists, the current-folder one (its header read reports it missing)."""
    if os.path.isabs(path):
        return path
    from_cwd = os.path.abspath(path)
    from_data = os.path.abspath(data_dir / path)
    return from_data if not os.path.exists(from_cwd) and os.path.exists(from_data) else from_cwd


def _kaldi_segments(path: Path, recordings: dict[str, _Recording]) -> dict[str, _Segment]:
    """{utterance id: segment}; without a segments file, one whole-recording utterance each."""
    if not path.is_file():
        return {rec: _Segment(rec, None, None, r.where) for rec, r in recordings.items()}
    segments = {}
    for utt_id, (n, rest) in _read_table(path).items():
        where = f"{path}:{n}"
        fields = rest.split()
        if len(fields) != 3:
            raise ManifestError(f"{where}: expected 'UTT REC START END'")
        rec = fields[0]
        if rec not in recordings:
            raise ManifestError(f"{where}: recording '{rec}' is not in wav.scp")
        try:
            start, end = float(fields[1]), float(fields[2])
        except ValueError:
            raise ManifestError(f"{where}: START and END must be numbers, got '{fields[1]}' '{fields[2]}'") from None
        if not (math.isfinite(start) and math.isfinite(end)) or start < 0 or (end != -1 and end <= start):
            raise ManifestError(f"{where}: invalid times {fields[1]} {fields[2]} (need 0 <= START < END, or END -1)")
        segments[utt_id] = _Segment(rec, start, None if end == -1 else end, where)
    return segments


def _optional_table(path: Path) -> dict[str, str] | None:
    """{key: rest} of a Kaldi "KEY REST" file, or None when the file does not exist."""
    if not path.is_file():
        return None
    return {key: rest for key, (_, rest) in _read_table(path).items()}


# ---------------------------------------------------------------------------------------------
# Manifest transforms


def speed_perturb(utts: Sequence[Utterance], speeds: Iterable[float] = (0.9, 1.1)) -> list[Utterance]:
    """The originals, then for each speed s != 1 a copy of every unperturbed utterance (speed 1)
    with id `sp<s>-<id>`, speed s and duration / s (DESIGN.md); applied by resampling when the
    audio is loaded. Copies already present (same id) are not added again, so perturbing a
    perturbed manifest changes nothing."""
    speeds = [float(s) for s in speeds]
    for s in speeds:
        check_speed(s)
    out = list(utts)
    present = {u.id for u in out}
    base = [u for u in out if u.speed == 1.0]
    for s in (s for s in speeds if s != 1.0):
        copies = (replace(u, id=f"sp{s:g}-{u.id}", speed=s, duration=u.duration / s) for u in base)
        out += [u for u in copies if u.id not in present]
    return out


def select_by_duration(
    utts: Sequence[Utterance], min_duration: float = 0.0, max_duration: float | None = None, *, report: bool = True
) -> list[Utterance]:
    """The utterances with min_duration <= duration <= max_duration (None: no upper bound);
    the others are left out, and logged (count and first ids) when `report`."""
    hi = math.inf if max_duration is None else max_duration
    kept = [u for u in utts if min_duration <= u.duration <= hi]
    if report and len(kept) < len(utts):
        out = [u.id for u in utts if not min_duration <= u.duration <= hi]
        logger.warning(
            "%d utterances outside %.2f-%s s left out: %s%s",
            len(out), min_duration, max_duration, ", ".join(out[:10]), " ..." if len(out) > 10 else "",
        )
    return kept


# ---------------------------------------------------------------------------------------------
# Dataset


class Example(NamedTuple):
    """One loaded utterance."""

    id: str
    feats: torch.Tensor  # (T, D) float32, after CMVN when the dataset has one
    tokens: torch.Tensor  # (L,) int64


class Skipped(NamedTuple):
    """An utterance that could not be used, with a one-line reason."""

    id: str
    reason: str


def derive_seed(*keys: int) -> int:
    """A 63-bit seed from non-negative integer keys (e.g. seed, epoch, index); well mixed, so
    neighbouring keys give unrelated streams."""
    state = np.random.SeedSequence(list(keys)).generate_state(2, dtype=np.uint32)
    return (int(state[0]) << 31) ^ int(state[1])


class _PackedStrings:
    """A read-only list of str kept as unique UTF-8 strings in one numpy byte array, offsets and
    one int32 code per row: no Python object per row, so that a forked DataLoader worker reads
    it without copying it (reading a list of str writes each one's reference count, dirtying
    its page), and repeated values (the audio and text of speed-perturbed copies) stored once."""

    def __init__(self, strings: Iterable[str]):
        codes: dict[str, int] = {}
        self._codes = np.array([codes.setdefault(x, len(codes)) for x in strings], dtype=np.int32)  # (N,)
        encoded = [x.encode("utf-8") for x in codes]
        self._offsets = np.zeros(len(encoded) + 1, dtype=np.int64)  # (unique + 1,) byte offsets
        np.cumsum([len(b) for b in encoded], out=self._offsets[1:])
        self._bytes = np.frombuffer(b"".join(encoded), dtype=np.uint8)

    def __len__(self) -> int:
        return len(self._codes)

    def __getitem__(self, index: int) -> str:
        code = self._codes[index]
        return self._bytes[self._offsets[code] : self._offsets[code + 1]].tobytes().decode("utf-8")

    @property
    def nbytes(self) -> int:
        return self._codes.nbytes + self._offsets.nbytes + self._bytes.nbytes


class _UtteranceTable:
    """Utterances in numpy arrays (see _PackedStrings): id, audio and text packed, duration,
    speed, start and end (NaN for None) as float64. `speaker` is not kept (loading needs none)."""

    def __init__(self, utts: Sequence[Utterance]):
        self.ids = _PackedStrings(u.id for u in utts)
        self.audio = _PackedStrings(u.audio for u in utts)
        self.text = _PackedStrings(u.text for u in utts)
        self.duration = np.array([u.duration for u in utts], dtype=np.float64)  # (N,) seconds
        self.speed = np.array([u.speed for u in utts], dtype=np.float64)  # (N,)
        self.start = np.array([math.nan if u.start is None else u.start for u in utts], dtype=np.float64)
        self.end = np.array([math.nan if u.end is None else u.end for u in utts], dtype=np.float64)

    def __len__(self) -> int:
        return len(self.duration)

    def __getitem__(self, index: int) -> Utterance:
        start, end = float(self.start[index]), float(self.end[index])
        return Utterance(
            self.ids[index], self.audio[index], float(self.duration[index]), self.text[index],
            start=None if math.isnan(start) else start, end=None if math.isnan(end) else end,
            speed=float(self.speed[index]),
        )

    @property
    def nbytes(self) -> int:
        arrays = (self.duration, self.speed, self.start, self.end)
        return sum(x.nbytes for x in (self.ids, self.audio, self.text, *arrays))


class ASRDataset(Dataset):
    """Utterances -> Example(id, feats, tokens), or Skipped(id, reason); never raises for a bad file.

    feats: fbank (asr.features) of the 16 kHz waveform (start/end/speed applied), then CMVN.
    tokens: tokenizer.encode(normalize_text(text)); empty when `tokenizer` is None.
    Skipped when the audio cannot be read, its decoded length differs from `duration` by more
    than 0.1 s, or it is too short for one frame; reporting is the caller's (the loader of
    `make_loader` logs each once). Training dither comes from a generator seeded by
    (seed, epoch, index): `dataset[i]` uses the epoch of `set_epoch`, `get(i, epoch)` the one given
    (what loader workers use: set_epoch does not reach persistent worker processes).
    With `archive`, the features it holds for an utterance (as its audio is now) are read from it
    instead: computed once without dither, so no dither in training either.
    The utterances are kept compactly (numpy arrays, no Python object per utterance);
    `utterance(i)` rebuilds one (without its speaker).
    """

    def __init__(
        self,
        utts: Sequence[Utterance],
        tokenizer: Tokenizer | None,
        *,
        features: FeatureConfig,
        cmvn: GlobalCMVN | None = None,
        training: bool = False,
        seed: int = 0,
        archive: FeatureArchive | None = None,
    ):
        self.archive = archive
        if archive is not None:
            self._archived, self._archived_frames = archive.rows(utts)
            found = int((self._archived >= 0).sum())
            logger.info("features of %d of %d utterances from %s%s", found, len(utts), archive.folder,
                        "" if found == len(utts) else "; the others computed from their audio")
        self._utts = _UtteranceTable(utts)
        self.tokenizer = tokenizer
        self.features = features
        self.cmvn = cmvn
        self.training = training
        self.seed = seed
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return len(self._utts)

    @property
    def durations(self) -> np.ndarray:
        """(N,) float64 seconds, read-only view."""
        view = self._utts.duration.view()
        view.flags.writeable = False
        return view

    def utterance(self, index: int) -> Utterance:
        return self._utts[index]

    def utt_id(self, index: int) -> str:
        return self._utts.ids[index]

    def __getitem__(self, index: int) -> Example | Skipped:
        return self.get(index, self.epoch)

    def get(self, index: int, epoch: int) -> Example | Skipped:
        """Utterance `index` with the training randomness of `epoch`."""
        utt = self._utts[index]
        if self.archive is not None and self._archived[index] >= 0:
            feats = self.archive.read(int(self._archived[index]), int(self._archived_frames[index]))
        else:
            wave = self._load(utt)
            if isinstance(wave, Skipped):
                return wave
            generator = torch.Generator().manual_seed(derive_seed(self.seed, epoch, index)) if self.training else None
            feats = fbank(wave, self.features, training=self.training, generator=generator)  # (T, D)
            if feats.shape[0] == 0:
                return Skipped(utt.id, f"too short for one frame ({wave.numel() / SAMPLE_RATE:.3f} s)")
        if self.cmvn is not None:
            with torch.no_grad():
                feats = self.cmvn(feats)
        return Example(utt.id, feats, self._tokens(utt.text))

    def _load(self, utt: Utterance) -> torch.Tensor | Skipped:
        """(N,) float32 16 kHz waveform, or Skipped when unreadable or of the wrong length."""
        try:
            wave = load_audio(utt.audio, start=utt.start or 0.0, end=utt.end, speed=utt.speed)
        except AudioError as e:
            return Skipped(utt.id, str(e))
        except Exception as e:  # reported with the id, never raised out of the loader
            return Skipped(utt.id, f"{utt.audio}: {type(e).__name__}: {e}")
        decoded = wave.numel() / SAMPLE_RATE
        if abs(decoded - utt.duration) > LENGTH_TOLERANCE:
            return Skipped(utt.id, f"decoded length {decoded:.3f} s differs from duration {utt.duration:.3f} s")
        return wave

    def _tokens(self, text: str) -> torch.Tensor:
        if self.tokenizer is None:
            return torch.zeros(0, dtype=torch.long)
        return torch.tensor(self.tokenizer.encode(normalize_text(text)), dtype=torch.long)


# ---------------------------------------------------------------------------------------------
# Sampler


class DurationBucketSampler(Sampler[list[int]]):
    """Batches of dataset indices whose padded duration (longest x count) stays <= max_batch_seconds.

    Shuffled (training): the utterances are split into duration buckets (quantiles; `num_buckets`,
    fewer for a small set so that each bucket holds about 4 batches or more), shuffled within each
    bucket, cut greedily into batches, and the batches shuffled; all of it from a generator seeded
    by (seed, epoch). Not shuffled: sorted by duration, then cut.
    Sharding: all ranks build the same batch list; while its length is not a multiple of
    num_replicas the largest batch is split in two (so nothing is dropped); only when no batch can
    be split are the last (len % num_replicas <= num_replicas - 1) batches dropped (logged).
    Rank r takes batches r, r + W, r + 2W, ...: distinct, the same count on every rank.
    An utterance longer than the cap is left out. Reports go to rank 0's log only, once: the
    left-out utterances when built, the dropped batches for the first epoch that drops some.
    `set_epoch(epoch, start_batch)` selects the epoch and resumes after `start_batch` of this
    rank's batches; `len()` is what remains.
    """

    def __init__(
        self,
        durations: Sequence[float],
        *,
        max_batch_seconds: float,
        shuffle: bool = True,
        seed: int = 0,
        num_replicas: int = 1,
        rank: int = 0,
        num_buckets: int = 30,
        epoch: int = 0,
        start_batch: int = 0,
        ids: Sequence[str] | None = None,
    ):
        d = np.asarray(durations, dtype=np.float64)  # (N,) seconds
        if d.ndim != 1 or not np.all(np.isfinite(d)) or np.any(d <= 0):
            raise ValueError("durations must be a 1-D sequence of finite positive seconds")
        if not max_batch_seconds > 0:
            raise ValueError(f"max_batch_seconds must be positive, got {max_batch_seconds}")
        if not 0 <= rank < num_replicas:
            raise ValueError(f"rank {rank} outside 0..{num_replicas - 1}")
        if num_buckets < 1:
            raise ValueError(f"num_buckets must be >= 1, got {num_buckets}")
        self.durations = d
        self.max_batch_seconds = float(max_batch_seconds)
        self.shuffle, self.seed = shuffle, seed
        self.num_replicas, self.rank = num_replicas, rank
        self._kept = self._drop_too_long(ids)
        # At least ~4 full batches per bucket, so that the part-filled last batch of each bucket
        # stays a small share (a small set gets fewer buckets).
        batches_worth = int(d[self._kept].sum() / self.max_batch_seconds)
        self._buckets = _quantile_buckets(self._kept, d, max(1, min(num_buckets, batches_worth // 4)))
        self._cache: tuple[int, list[list[int]]] | None = None  # (epoch, this rank's batches)
        self._drop_reported = rank != 0  # report dropped batches once, on rank 0
        self.set_epoch(epoch, start_batch)

    def _drop_too_long(self, ids: Sequence[str] | None) -> np.ndarray:
        """Indices of the utterances that fit in a batch; the others are logged."""
        too_long = np.flatnonzero(self.durations > self.max_batch_seconds)
        if len(too_long) and self.rank == 0:
            names = [ids[i] if ids is not None else str(i) for i in too_long[:10]]
            logger.warning(
                "%d utterances longer than the batch cap (%.1f s) left out: %s%s",
                len(too_long), self.max_batch_seconds, ", ".join(names), " ..." if len(too_long) > 10 else "",
            )
        return np.flatnonzero(self.durations <= self.max_batch_seconds)

    def set_epoch(self, epoch: int, start_batch: int = 0) -> None:
        """Select the epoch (the order depends on (seed, epoch)) and resume after `start_batch`."""
        self.epoch = epoch
        self.set_start(start_batch)

    def set_start(self, start_batch: int) -> None:
        """Skip the first `start_batch` batches of this rank in the current epoch (0..len)."""
        total = len(self.rank_batches())
        if not 0 <= start_batch <= total:
            raise ValueError(f"start_batch {start_batch} outside 0..{total} (epoch {self.epoch}, rank {self.rank})")
        self.start_batch = start_batch

    def rank_batches(self) -> list[list[int]]:
        """All of this rank's batches of the current epoch, from the first."""
        if self._cache is None or self._cache[0] != self.epoch:
            self._cache = (self.epoch, self._all_batches()[self.rank :: self.num_replicas])
        return self._cache[1]

    def __iter__(self) -> Iterator[list[int]]:
        yield from self.rank_batches()[self.start_batch :]

    def __len__(self) -> int:
        return len(self.rank_batches()) - self.start_batch

    def _all_batches(self) -> list[list[int]]:
        """Every rank's batches of the epoch, in order, a multiple of num_replicas long."""
        cap, d = self.max_batch_seconds, self.durations
        if not self.shuffle:
            batches = _greedy_batches(self._kept[np.argsort(d[self._kept], kind="stable")], d, cap)
        else:
            rng = np.random.default_rng([self.seed, self.epoch])
            batches = [b for bucket in self._buckets for b in _greedy_batches(rng.permutation(bucket), d, cap)]
            batches = [batches[i] for i in rng.permutation(len(batches))]
        return self._divisible(batches)

    def _divisible(self, batches: list[list[int]]) -> list[list[int]]:
        """Split the largest batches until the count divides by num_replicas; drop the rest."""
        w = self.num_replicas
        for _ in range(-len(batches) % w):
            j = max(range(len(batches)), key=lambda k: len(batches[k]), default=None)
            if j is None or len(batches[j]) < 2:
                break
            half = len(batches[j]) // 2
            batches[j : j + 1] = [batches[j][:half], batches[j][half:]]
        extra = len(batches) % w
        if extra:
            if not self._drop_reported:
                lost = sum(len(b) for b in batches[-extra:])
                logger.warning(
                    "epoch %d: %d batches (%d utterances) dropped to give %d ranks equal shares "
                    "(at most %d per epoch; reported once)", self.epoch, extra, lost, w, w - 1,
                )
                self._drop_reported = True
            batches = batches[:-extra]
        return batches


def _quantile_buckets(indices: np.ndarray, durations: np.ndarray, num_buckets: int) -> list[np.ndarray]:
    """`indices` grouped by duration quantile (<= num_buckets non-empty groups, shortest first)."""
    if len(indices) == 0:
        return []
    d = durations[indices]
    edges = np.quantile(d, np.linspace(0, 1, num_buckets + 1)[1:-1])
    which = np.searchsorted(edges, d, side="right")  # bucket of each index
    return [indices[which == b] for b in range(num_buckets) if np.any(which == b)]


def _greedy_batches(order: np.ndarray, durations: np.ndarray, cap: float) -> list[list[int]]:
    """Cut `order` into consecutive batches with max duration x count <= cap."""
    batches: list[list[int]] = []
    batch: list[int] = []
    longest = 0.0
    for i, d in zip(order.tolist(), durations[order].tolist()):
        if batch and max(longest, d) * (len(batch) + 1) > cap:
            batches.append(batch)
            batch, longest = [], 0.0
        batch.append(i)
        longest = max(longest, d)
    if batch:
        batches.append(batch)
    return batches


# ---------------------------------------------------------------------------------------------
# Collate


class Batch(NamedTuple):
    """A padded batch. B = utterances, T = frames, D = feature bins, L = tokens."""

    ids: list[str]
    feats: torch.Tensor  # (B, T, D) float32, zero-padded
    feat_lens: torch.Tensor  # (B,) int64
    tokens: torch.Tensor  # (B, L) int64, padded with -1
    token_lens: torch.Tensor  # (B,) int64


def split_skipped(items: Iterable[Example | Skipped]) -> tuple[list[Example], list[Skipped]]:
    """(the Examples, the Skipped entries), each in the given order."""
    items = list(items)
    return [e for e in items if isinstance(e, Example)], [e for e in items if isinstance(e, Skipped)]


def collate(
    examples: Sequence[Example | Skipped],
    *,
    specaug: SpecAugmentConfig | None = None,
    generator: torch.Generator | None = None,
    feat_dim: int | None = None,
) -> Batch:
    """Pad the Examples into a Batch (order kept). Skipped entries are left out: take them first
    with `split_skipped` to report them (the loader of `make_loader` does).
    With `specaug`, SpecAugment (asr.features.spec_augment) is applied within each length.
    `feat_dim` gives D for a batch without Examples (else D = 0)."""
    kept, _ = split_skipped(examples)
    dim = kept[0].feats.shape[1] if kept else (feat_dim or 0)
    feat_lens = torch.tensor([e.feats.shape[0] for e in kept], dtype=torch.long)
    token_lens = torch.tensor([e.tokens.numel() for e in kept], dtype=torch.long)
    feats = torch.zeros(len(kept), max(feat_lens.tolist(), default=0), dim)
    tokens = torch.full((len(kept), max(token_lens.tolist(), default=0)), -1, dtype=torch.long)
    for b, e in enumerate(kept):
        feats[b, : e.feats.shape[0]] = e.feats
        tokens[b, : e.tokens.numel()] = e.tokens
    if specaug is not None and kept:
        feats = spec_augment(feats, feat_lens, specaug, generator=generator)
    return Batch([e.id for e in kept], feats, feat_lens, tokens, token_lens)


# ---------------------------------------------------------------------------------------------
# CMVN statistics


# Utterances a loader worker of compute_cmvn hands over at a time, their features as numpy arrays:
# pickled by value through the worker's pipe. A tensor would go as a shared-memory file descriptor,
# one connection and handshake each (~1.5 ms in the main process, which had become the bottleneck:
# `asr cmvn --dump-feats` of 4,000 synth utterances with 2 workers took 13.3-13.7 s, now 7.1-8.9 s,
# the same output).
_CMVN_CHUNK = 32


def _features_as_numpy(items: list[Example | Skipped]) -> list[Example | Skipped]:
    return [item._replace(feats=item.feats.numpy()) if isinstance(item, Example) else item for item in items]


def compute_cmvn(utts: Sequence[Utterance], features: FeatureConfig, *, num_workers: int = 0,
                 dump_dir: str | os.PathLike | None = None) -> CMVNStats:
    """Global CMVN statistics of the fbank features (no dither) of `utts`. An utterance that
    cannot be used (see ASRDataset) is logged with its id and reason, skipped and counted in the
    summary line; `num_workers` processes decode in parallel. With `dump_dir`, the same features
    are also written there as a FeatureArchive (float16), for training to read instead of decoding
    and computing them every epoch."""
    dataset = ASRDataset(utts, None, features=features)
    chunks = [range(i, min(i + _CMVN_CHUNK, len(utts))) for i in range(0, len(utts), _CMVN_CHUNK)]
    loader = DataLoader(dataset, batch_sampler=chunks, num_workers=num_workers, collate_fn=_features_as_numpy)
    stats, skipped = CMVNStats(), 0
    writer = _ArchiveWriter(Path(dump_dir), features, dataset) if dump_dir is not None else None
    with writer or nullcontext():
        for indices, items in zip(chunks, loader):
            for index, item in zip(indices, items):
                if isinstance(item, Skipped):
                    logger.warning("%s: %s; skipped", item.id, item.reason)
                    skipped += 1
                else:
                    feats = torch.from_numpy(item.feats)
                    stats.add(feats)
                    if writer:
                        writer.add(index, feats)
    logger.info("cmvn: %d utterances, %d frames, %d skipped", len(utts) - skipped, int(stats.count), skipped)
    return stats


# ---------------------------------------------------------------------------------------------
# Dumped features


class FeatureArchiveError(ValueError):
    """A feature archive that cannot be used: "<folder>: <reason>", one line."""


ARCHIVE_FORMAT = "asr-feature-archive-1"


def _source_key(utt: Utterance) -> str:
    """What an utterance's features depend on besides the frontend: its audio file (path, size and
    modification time), segment, speed and manifest duration (the length check of `_load`, which
    read features skip). A rewritten file no longer matches its dumped features."""
    try:
        st = os.stat(utt.audio)
        stamp = f"{st.st_size}|{st.st_mtime_ns}"
    except OSError:
        stamp = "missing"
    return f"{os.path.abspath(utt.audio)}|{utt.start}|{utt.end}|{utt.speed}|{utt.duration}|{stamp}"


def _archived_settings(features: FeatureConfig) -> dict:
    """The frontend settings dumped features depend on: all but dither (they have none)."""
    return {k: v for k, v in dataclasses.asdict(features).items() if k != "dither"}


class _ArchiveWriter:
    """Writes the frames (float16, row after row) to DIR/feats-<token>.f16, a new file each dump,
    then DIR/index.json atomically, naming that file: the index's rename is the one commit point,
    so readers see the old archive or the new one, never an index over another dump's data. Data
    files no index names are removed after the commit. A dump without a single frame commits
    nothing (the previous archive stays)."""

    def __init__(self, folder: Path, features: FeatureConfig, dataset: ASRDataset):
        self.folder, self.features, self.dataset = folder, features, dataset
        self.entries: dict[str, list] = {}
        self.frames = 0

    def __enter__(self) -> _ArchiveWriter:
        self.folder.mkdir(parents=True, exist_ok=True)
        self.name = f"feats-{secrets.token_hex(6)}.f16"
        self._file = open(self.folder / self.name, "xb")
        return self

    def add(self, index: int, feats: torch.Tensor) -> None:
        utt = self.dataset.utterance(index)
        rows = feats.to(torch.float16).numpy()
        self._file.write(rows.tobytes())
        self.entries[utt.id] = [self.frames, rows.shape[0], _source_key(utt)]
        self.frames += rows.shape[0]

    def __exit__(self, *exc: Any) -> None:
        data = self.folder / self.name
        try:
            self._file.flush()
            os.fsync(self._file.fileno())
        finally:
            self._file.close()
        if exc[0] is not None or self.frames == 0:
            data.unlink()
            if exc[0] is None:
                logger.warning("%s: no features to dump; the folder is left as it was", self.folder)
            return
        index = {"format": ARCHIVE_FORMAT, "features": _archived_settings(self.features), "data": self.name,
                 "frames": self.frames, "utterances": self.entries}
        with atomic_open(self.folder / "index.json") as f:
            json.dump(index, f)
        for old in self.folder.glob("feats-*.f16"):
            if old.name != self.name:
                old.unlink(missing_ok=True)
        logger.info("%s: features of %d utterances (%d frames, float16)", self.folder, len(self.entries),
                    self.frames)


class FeatureArchive:
    """Features dumped by `compute_cmvn(..., dump_dir=DIR)`: the fbank (no dither, before CMVN) of
    each utterance, read through a memory map (the page cache is shared by all loader processes).

    `rows(utts)` gives, per utterance, where its features are, or -1 when the archive does not
    have them as they are now (not dumped, or the audio file, segment, speed or duration changed
    since): those are computed as usual."""

    def __init__(self, folder: str | os.PathLike, features: FeatureConfig):
        self.folder = Path(folder)
        where = self.folder / "index.json"
        try:
            index = json.loads(where.read_text(encoding="utf-8"))
        except OSError as e:
            raise FeatureArchiveError(f"{self.folder}: no feature archive ({e.strerror or e})") from None
        except json.JSONDecodeError as e:
            raise FeatureArchiveError(f"{where}: not JSON (line {e.lineno}: {e.msg})") from None
        ok = (isinstance(index, dict) and index.get("format") == ARCHIVE_FORMAT
              and isinstance(index.get("features"), dict) and isinstance(index.get("data"), str)
              and isinstance(index.get("frames"), int) and isinstance(index.get("utterances"), dict))
        if not ok:
            raise FeatureArchiveError(f"{where}: not a feature archive index ({ARCHIVE_FORMAT})")
        wanted, have = _archived_settings(features), index["features"]
        if have != wanted:
            changed = sorted(k for k in wanted.keys() | have.keys() if have.get(k) != wanted.get(k))
            raise FeatureArchiveError(f"{self.folder}: dumped with other features ({', '.join(changed)} differ "
                                      "from data.features); dump them again")
        self.dim, self.frames = features.n_mels, index["frames"]
        self.data = self.folder / Path(index["data"]).name
        size = self.data.stat().st_size if self.data.is_file() else -1
        if size != self.frames * self.dim * 2:
            raise FeatureArchiveError(f"{self.data}: {size} bytes, the index says "
                                      f"{self.frames * self.dim * 2}; dump the features again")
        self._entries: dict[str, list] | None = index["utterances"]
        self._data: np.ndarray | None = None  # opened in the process that reads (loader workers)

    def rows(self, utts: Sequence[Utterance]) -> tuple[np.ndarray, np.ndarray]:
        """(offsets (N,) int64, -1 where not usable; frames (N,) int64) of `utts`."""
        if self._entries is None:
            raise RuntimeError("FeatureArchive.rows: the index is only kept in the process that opened it")
        offsets, frames = np.full(len(utts), -1, np.int64), np.zeros(len(utts), np.int64)
        for i, utt in enumerate(utts):
            entry = self._entries.get(utt.id)
            if (isinstance(entry, list) and len(entry) == 3 and entry[2] == _source_key(utt)
                    and 0 <= entry[0] and 0 < entry[1] and entry[0] + entry[1] <= self.frames):
                offsets[i], frames[i] = entry[0], entry[1]
        return offsets, frames

    def read(self, offset: int, frames: int) -> torch.Tensor:
        """(frames, D) float32 features starting at row `offset`."""
        if self._data is None:
            self._data = np.memmap(self.data, dtype=np.float16, mode="r", shape=(self.frames, self.dim))
        return torch.from_numpy(self._data[offset:offset + frames].astype(np.float32))

    def __getstate__(self) -> dict:
        # a worker maps the file itself, and needs no index: the dataset holds the rows
        return {**self.__dict__, "_data": None, "_entries": None}


def _identity(item: Any) -> Any:
    return item


# ---------------------------------------------------------------------------------------------
# Config and loader


@dataclass(frozen=True)
class DataConfig:
    """Batching and augmentation knobs (the `data` section of a training config)."""

    max_batch_seconds: float = 200.0  # padded seconds per batch and rank (longest x count)
    num_buckets: int = 30  # duration buckets of the sampler
    num_workers: int = 2  # loader processes (0: load in the training process)
    min_duration: float = 0.0  # shorter utterances left out (logged), seconds
    max_duration: float | None = None  # longer ones left out (logged); None: only the batch cap
    speed_perturb: list[float] | None = None  # e.g. [0.9, 1.1]: extra copies in training
    features: FeatureConfig = field(default_factory=FeatureConfig)
    specaug: SpecAugmentConfig = field(default_factory=SpecAugmentConfig)  # training only


class _BatchKey(NamedTuple):
    """What the loader's sampler yields and its workers receive: a batch of one epoch."""

    epoch: int
    indices: list[int]  # dataset indices


class _Collated(NamedTuple):
    """What a loader worker returns: the Batch and the (id, reason) of what it left out."""

    batch: Batch
    skipped: list[tuple[str, str]]


class _EpochBatches(Sampler[_BatchKey]):
    """The batches of a DurationBucketSampler tagged with its epoch, so that persistent workers
    (which never see the main process's set_epoch) derive the epoch's randomness from the key."""

    def __init__(self, batches: DurationBucketSampler):
        self.batches = batches

    def __iter__(self) -> Iterator[_BatchKey]:
        epoch = self.batches.epoch
        return (_BatchKey(epoch, b) for b in self.batches)

    def __len__(self) -> int:
        return len(self.batches)


class _BatchLoading(Dataset):
    """_BatchKey -> _Collated: loads the utterances of a batch (dither of its epoch) and collates
    them, with SpecAugment seeded by (seed, epoch, the batch's ids): the batch is itself a
    function of (seed, epoch, batch index), so a resumed run replays the same masks."""

    def __init__(self, dataset: ASRDataset, specaug: SpecAugmentConfig | None, seed: int, feat_dim: int):
        self.dataset, self.specaug, self.seed, self.feat_dim = dataset, specaug, seed, feat_dim

    def __getitem__(self, key: _BatchKey) -> _Collated:
        kept, skipped = split_skipped(self.dataset.get(i, key.epoch) for i in key.indices)
        generator = None
        if self.specaug is not None:
            ids = "\n".join(self.dataset.utt_id(i) for i in key.indices)
            generator = torch.Generator().manual_seed(derive_seed(self.seed, key.epoch, zlib.crc32(ids.encode())))
        batch = collate(kept, specaug=self.specaug, generator=generator, feat_dim=self.feat_dim)
        return _Collated(batch, [(s.id, s.reason) for s in skipped])

    def __len__(self) -> int:
        return len(self.dataset)


def _worker_init(worker_id: int) -> None:
    """Freeze the objects a forked worker inherits out of the garbage collector's sight: a full
    collection would otherwise write to every one of them (the parent's manifest lists, ...) and
    copy their pages into the worker. O(1): the collector's lists are spliced, not walked."""
    gc.freeze()


class ASRDataLoader(DataLoader):
    """The loader of `make_loader`, built once for a whole run: Batches of this rank for the epoch
    and resume point chosen by `set_epoch`. Worker processes (config.num_workers) persist from
    one epoch to the next. Each skipped utterance is recorded in `skipped` {id: reason} and
    logged the first time this process sees it (with id and reason)."""

    _reported: ClassVar[set[str]] = set()  # ids already logged in this process, over all loaders

    def __init__(self, dataset: _BatchLoading, batches: DurationBucketSampler, *, num_workers: int, pin_memory: bool):
        super().__init__(
            dataset,
            sampler=_EpochBatches(batches),
            batch_size=None,  # each key is a whole batch, collated in the worker
            collate_fn=_identity,
            num_workers=num_workers,
            persistent_workers=num_workers > 0,
            worker_init_fn=_worker_init if num_workers > 0 else None,
            pin_memory=pin_memory,
            # Its own generator: starting an iterator then draws no number from the global RNG
            # (dropout's), so a resumed run consumes that RNG exactly as an uninterrupted one.
            generator=torch.Generator().manual_seed(0),
        )
        self.batches = batches
        self.skipped: dict[str, str] = {}

    @property
    def epoch(self) -> int:
        return self.batches.epoch

    def set_epoch(self, epoch: int, start_batch: int = 0) -> None:
        """Select the epoch (its order, dither and SpecAugment) and skip this rank's first
        `start_batch` batches of it (0..number of batches; to resume mid-epoch)."""
        self.batches.set_epoch(epoch, start_batch)

    def __len__(self) -> int:
        """The batches left in this rank's epoch after `start_batch`."""
        return len(self.batches)

    def __iter__(self) -> Iterator[Batch]:
        for batch, skipped in super().__iter__():
            for utt_id, reason in skipped:
                self.skipped[utt_id] = reason
                if utt_id not in self._reported:
                    self._reported.add(utt_id)
                    logger.warning("%s: %s; skipped", utt_id, reason)
            yield batch


def make_loader(
    utts: Sequence[Utterance],
    tokenizer: Tokenizer | None,
    config: DataConfig,
    *,
    training: bool,
    cmvn: GlobalCMVN | None = None,
    seed: int = 0,
    rank: int = 0,
    world_size: int = 1,
    pin_memory: bool = False,
    archive: FeatureArchive | None = None,
) -> ASRDataLoader:
    """The loader of one rank for the whole run, at epoch 0 from its first batch; choose the
    epoch (and a resume point) with `loader.set_epoch(epoch, start_batch)` before iterating.

    Training: speed perturbation (config.speed_perturb; copies already in `utts` are not added
    again), shuffled buckets, dither and SpecAugment, all derived from (seed, epoch, index /
    batch). Otherwise: batches sorted by duration, no augmentation. Utterances outside
    [min_duration, max_duration] or longer than the batch cap are left out (logged once, on
    rank 0). With `archive`, features it holds are read from it (see ASRDataset)."""
    if training and config.speed_perturb:
        utts = speed_perturb(utts, config.speed_perturb)
    utts = select_by_duration(utts, config.min_duration, config.max_duration, report=rank == 0)
    dataset = ASRDataset(utts, tokenizer, features=config.features, cmvn=cmvn, training=training, seed=seed,
                         archive=archive)
    batches = DurationBucketSampler(
        dataset.durations,
        max_batch_seconds=config.max_batch_seconds,
        shuffle=training,
        seed=seed,
        num_replicas=world_size,
        rank=rank,
        num_buckets=config.num_buckets,
        ids=[u.id for u in utts],
    )
    specaug = config.specaug if training else None
    loading = _BatchLoading(dataset, specaug, seed, config.features.n_mels)
    return ASRDataLoader(loading, batches, num_workers=config.num_workers, pin_memory=pin_memory)
