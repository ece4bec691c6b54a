"""Corpus import into manifests: LibriSpeech folders and Kaldi data directories, and the
speed-perturbed copies of a manifest's utterances (DESIGN.md "Manifest", "The `asr` command").

A malformed corpus-list line (wav.scp, segments, text, trans.txt) is fatal: ManifestError
"path:line: reason". An utterance that cannot be used (no audio file, no transcript, an
unreadable header, a segment outside its recording) is logged (id and reason), skipped and
counted in a summary line.
"""
from __future__ import annotations

import logging
import math
import os
import shlex
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path

from asr.audio import AudioError, AudioInfo, audio_info, check_speed
from asr.fileio import read_table
from asr.manifest import ManifestError, Utterance, manifest_errors, write_manifest
from asr.metrics import normalize_text

__all__ = ["prepare_kaldi", "prepare_librispeech", "speed_perturb"]

logger = logging.getLogger(__name__)

KALDI_MAX_OVERSHOOT = 0.5  # seconds a segment may end past its recording (Kaldi extract-segments default)
_HEADER_THREADS = 8  # header reads are I/O bound: a few threads hide file-system latency


# ---------------------------------------------------------------------------------------------
# LibriSpeech


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


# ---------------------------------------------------------------------------------------------
# Kaldi data directories


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
# Headers and tables, for both


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
    with manifest_errors():
        return read_table(path)


# ---------------------------------------------------------------------------------------------
# Speed perturbation


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

