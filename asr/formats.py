"""The output formats of transcripts (asr.api.Result): txt, json, srt, vtt, tsv. What `asr
transcribe --format` writes and `asr serve` answers (the json format's objects).

    sys.stdout.write(format_results(results, "srt"))
"""
from __future__ import annotations

import json
import math
from collections.abc import Sequence
from typing import Any

from asr.api import Result, Segment

__all__ = ["FORMATS", "format_results", "result_dict"]

FORMATS = ("txt", "json", "srt", "vtt", "tsv")


def format_results(results: Sequence[Result], fmt: str) -> str:
    """Results as text: "txt" (the transcript; "path<TAB>transcript" lines for several inputs),
    "json" (a list of objects with path, text, duration, score, segments (with their words and
    confidence when word timings were asked for), error), "srt" / "vtt" (subtitles: a cue per
    segment, or per word when the results have word timings) or "tsv" (start, end in integer
    milliseconds, text: a row per segment, or per word). For several inputs, srt, vtt and tsv put
    "==> path <==" before each input's. Inputs with an error are left out of all but json (report
    them separately)."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown format {fmt!r} (one of {', '.join(FORMATS)})")
    if fmt == "json":
        return json.dumps([result_dict(r) for r in results], indent=2, ensure_ascii=False) + "\n"
    good = [r for r in results if r.error is None]
    several = len(results) > 1
    if fmt == "txt":
        return "".join(f"{r.path or '<waveform>'}\t{r.text}\n" if several else f"{r.text}\n" for r in good)
    write = {"srt": _srt, "vtt": _vtt, "tsv": _tsv}[fmt]
    return "\n".join((f"==> {r.path or '<waveform>'} <==\n" if several else "") + write(r) for r in good)


def result_dict(r: Result) -> dict[str, Any]:
    """A Result as the plain dict of the json format (one element of its list)."""
    def ms(seconds: float) -> float:  # the millisecond the srt / vtt / tsv clocks show
        return round(seconds * 1000) / 1000

    def segment(s: Segment) -> dict[str, Any]:
        out: dict[str, Any] = {"start": ms(s.start), "end": ms(s.end), "text": s.text}
        if s.words:
            out["words"] = [{"word": w.text, "start": ms(w.start), "end": ms(w.end),
                             "confidence": round(w.confidence, 4)} for w in s.words]
        return out

    return {
        "path": r.path, "text": r.text, "duration": round(r.duration, 3),
        "score": r.score if math.isfinite(r.score) else None,
        "segments": [segment(s) for s in r.segments],
        "error": r.error,
    }


def _cues(r: Result) -> list[tuple[float, float, str]]:
    """(start, end, text) of the subtitle cues: the words when there are word timings, else the
    segments that hold text."""
    if r.words:
        return [(w.start, w.end, w.text) for w in r.words]
    return [(s.start, s.end, s.text) for s in r.segments if s.text]


def _srt(r: Result) -> str:
    return "".join(f"{i}\n{_clock(a, ',')} --> {_clock(b, ',')}\n{text}\n\n"
                   for i, (a, b, text) in enumerate(_cues(r), 1))


def _vtt(r: Result) -> str:
    return "WEBVTT\n\n" + "".join(f"{_clock(a, '.')} --> {_clock(b, '.')}\n{text}\n\n" for a, b, text in _cues(r))


def _tsv(r: Result) -> str:
    return "start\tend\ttext\n" + "".join(f"{round(a * 1000)}\t{round(b * 1000)}\t{text}\n" for a, b, text in _cues(r))


def _clock(seconds: float, mark: str) -> str:
    """HH:MM:SS<mark>mmm (srt: ",", vtt: ".")."""
    ms = round(seconds * 1000)
    return f"{ms // 3_600_000:02d}:{ms // 60_000 % 60:02d}:{ms // 1000 % 60:02d}{mark}{ms % 1000:03d}"
