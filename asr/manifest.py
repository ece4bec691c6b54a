"""The one reader, writer and validator of JSON Lines manifests (DESIGN.md "Manifest").

A manifest holds one utterance per line:
    {"id": "1089-134686-0000", "audio": "/abs/1089-134686-0000.flac", "duration": 10.43, "text": "HE HOPED ..."}
with optional "start" / "end" (seconds of the file), "speed" (speed perturbation) and "speaker".

One parser serves every reader: `read_manifest` takes whole utterances, `read_transcripts`
(what `asr wer` scores) only the id and text of each line, so that a hypothesis manifest without
audio or duration reads too. A malformed line is fatal either way, with the same message:
ManifestError "path:line: reason".

Standard library only, and of ours asr.fileio: reading a manifest does not import torch.
"""
from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from asr.fileio import TextFileError, atomic_open, numbered_lines, read_table

__all__ = [
    "LENGTH_TOLERANCE",
    "ManifestError",
    "Utterance",
    "manifest_errors",
    "read_manifest",
    "read_transcripts",
    "write_manifest",
]

LENGTH_TOLERANCE = 0.1  # seconds: the largest gap allowed between two lengths of one utterance (DESIGN.md)


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


# ---------------------------------------------------------------------------------------------
# reading and writing


def read_manifest(path: str | os.PathLike) -> list[Utterance]:
    """Read a JSON Lines manifest. Blank lines are allowed; unknown keys are ignored.

    Every malformed line is fatal: ManifestError "path:line: reason" for bad JSON, a line that is
    not an object, a missing or mistyped field, a string that is not valid Unicode (an escaped lone
    surrogate), a duration that is not a finite positive number, a duplicate id (naming the first
    line too), an invalid start/end, speed <= 0.
    Relative `audio` paths are resolved against the manifest's folder.
    """
    base = os.path.dirname(os.path.abspath(path))
    return _read_lines(path, lambda line: _utterance(line, base), lambda utt: utt.id)


def read_transcripts(path: str | os.PathLike) -> dict[str, str]:
    """id -> text of a Kaldi-style text file ("ID WORDS", one per line; an id alone is an empty
    transcript) or of a JSON Lines manifest (suffix .jsonl, or first non-blank character "{").

    A manifest is read in text-only mode: each line needs an id and a text, checked as by
    `read_manifest`, and nothing else (a hypothesis manifest has no audio or duration; other
    fields are not read). Texts are returned as written (scoring normalizes them); blank lines are
    skipped. A missing or non-UTF-8 file, a duplicate id or a malformed line raises ManifestError
    "path:line: reason" (the Kaldi form is asr.fileio.read_table)."""
    with manifest_errors():
        first = next(numbered_lines(path), None)
        if first is None:
            return {}
        if not (Path(path).suffix == ".jsonl" or first[1].startswith("{")):
            return {uid: text for uid, (_, text) in read_table(path).items()}
    return dict(_read_lines(path, lambda line: _id_and_text(_json_object(line)), lambda pair: pair[0]))


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
def manifest_errors() -> Iterator[None]:
    """Re-raise asr.fileio's TextFileError (missing file, not UTF-8, duplicate id) as ManifestError."""
    try:
        yield
    except TextFileError as e:
        raise ManifestError(str(e)) from None


_Item = TypeVar("_Item")


def _read_lines(path: str | os.PathLike, parse: Callable[[str], _Item], id_of: Callable[[_Item], str]) -> list[_Item]:
    """parse(line) of every non-blank line, in order; a _LineError or a duplicate id is fatal
    (ManifestError "path:line: reason")."""
    items: list[_Item] = []
    first_line: dict[str, int] = {}
    with manifest_errors():
        for n, line in numbered_lines(path):
            try:
                item = parse(line)
                uid = id_of(item)
                if uid in first_line:
                    raise _LineError(f"duplicate id {uid} (first on line {first_line[uid]})")
            except _LineError as e:
                raise ManifestError(f"{path}:{n}: {e}") from None
            first_line[uid] = n
            items.append(item)
    return items


# ---------------------------------------------------------------------------------------------
# the line parser


def _json_object(line: str) -> dict:
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise _LineError(f"bad JSON: {e.msg} (column {e.colno})") from None
    except RecursionError:
        raise _LineError("bad JSON: nested too deeply") from None
    if not isinstance(obj, dict):
        raise _LineError(f"expected a JSON object, got {_json_type(obj)}")
    return obj


def _id_and_text(obj: dict) -> tuple[str, str]:
    """The fields every manifest line has, even a hypothesis manifest's: id and text."""
    return _utt_id(obj), _str_field(obj, "text")


def _utt_id(obj: dict) -> str:
    utt_id = _str_field(obj, "id")
    if not utt_id or any(c.isspace() for c in utt_id):
        raise _LineError(f"id {utt_id!r} is empty or contains whitespace")
    return utt_id


def _utterance(line: str, base: str) -> Utterance:
    """The Utterance of one line; a relative audio path is taken from `base`. Fields are checked
    in the order id, audio, duration, text, start, end, speed, speaker (the first fault found is
    the one reported)."""
    obj = _json_object(line)
    utt_id = _utt_id(obj)
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
