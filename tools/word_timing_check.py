"""Word timings against eSpeak's truth: how far the start times that `transcribe(...,
word_timestamps=True)` gives are from where eSpeak NG started each word. Prints a table, writes JSON.

    python tools/word_timing_check.py --model exp/synth/model_avg.pt --manifest data/dev.jsonl \\
        --words data/dev_words.jsonl [--limit N] [--beam-size B] [--device D] [--out word_timing.json]

The truth is the synth recipe's <split>_words.jsonl (recipes/synth/local/synthesize.py): for each
utterance, the words eSpeak gave a word event, with their index in the manifest text and their
start in seconds of the FLAC. Most words have one; a short word run into the next may not.

Each utterance is transcribed whole (one path per utterance; a manifest line with start / end or a
speed is refused). The hypothesis words (normalized as WER scores them, asr.metrics) are aligned to
the reference words the way `asr wer` aligns them (asr.metrics.score); a word aligned as correct
whose reference word has an event is matched, and its error is the hypothesis start minus the
event's start. Reported: the reference words, those with an event, the hypothesis words, the
matched words, the median and 90th percentile of the absolute start error in ms, and the median of
the signed error (a constant lag shows there). Unreadable audio is counted and skipped.
"""
from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from asr.manifest import Utterance, read_manifest
from asr.metrics import normalize_text, score


class Match(NamedTuple):
    """A hypothesis word aligned as correct to a reference word with an event."""

    id: str
    index: int  # the word's index in the reference text
    word: str
    ref_start: float  # seconds
    hyp_start: float

    @property
    def error_ms(self) -> float:
        return 1000.0 * (self.hyp_start - self.ref_start)


class UttCheck(NamedTuple):
    ref_words: int
    timed_ref_words: int
    hyp_words: int
    matches: list[Match]


def read_words(path: Path) -> dict[str, dict[int, dict[str, Any]]]:
    """{id: {word index: {"index", "word", "start"}}} of a <split>_words.jsonl; a malformed line
    is an error naming the file and line."""
    out: dict[str, dict[int, dict[str, Any]]] = {}
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            entry = json.loads(line)
            out[entry["id"]] = {int(w["index"]): {"index": int(w["index"]), "word": str(w["word"]),
                                                  "start": float(w["start"])} for w in entry["words"]}
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{path}:{number}: not a word-start line ({e})") from None
    return out


def hypothesis_words(words: Sequence[Any]) -> list[tuple[str, float | None]]:
    """(normalized word, start) of each hypothesis word (objects with .text and .start): a word
    that normalizes to nothing is left out; one that normalizes to several keeps its start on the
    first only."""
    out: list[tuple[str, float | None]] = []
    for w in words:
        for k, piece in enumerate(normalize_text(w.text).split()):
            out.append((piece, float(w.start) if k == 0 else None))
    return out


def match_words(uid: str, ref_text: str, timed: Mapping[int, Mapping[str, Any]], hyp: Sequence[Any],
                ops: str | None = None) -> UttCheck:
    """Align the hypothesis words `hyp` (objects with .text and .start) to `ref_text` (a
    normalized manifest text; its words are indexed as in the words file) and keep the hits whose
    reference word has an event in `timed` ({index: {"word", "start"}}). `ops`: the alignment's
    letters (C, S, D, I) when already computed (asr.metrics.score), else computed here."""
    refs = ref_text.split()
    hyps = hypothesis_words(hyp)
    for index, entry in timed.items():
        if not 0 <= index < len(refs) or refs[index] != entry["word"]:
            raise ValueError(f"{uid}: the words file's word {index} {entry['word']!r} is not the manifest's "
                             f"({refs[index] if 0 <= index < len(refs) else 'none'!r})")
    if ops is None:
        ops = score({uid: ref_text}, {uid: " ".join(w for w, _ in hyps)}, normalize=False).utterances[0].ops
    matches = []
    i = j = 0  # reference and hypothesis word indices
    for op in ops:
        if op == "C" and i in timed and hyps[j][1] is not None:
            matches.append(Match(uid, i, refs[i], float(timed[i]["start"]), hyps[j][1]))
        i += op != "I"
        j += op != "D"
    return UttCheck(len(refs), len(timed), len(hyps), matches)


def summarize(checks: Sequence[UttCheck]) -> dict[str, Any]:
    """Totals and start-error statistics (ms) of the matched words; the statistics are None when
    nothing matched."""
    errors = np.array([m.error_ms for c in checks for m in c.matches], dtype=np.float64)
    stats: dict[str, Any] = {
        "utterances": len(checks),
        "ref_words": sum(c.ref_words for c in checks),
        "timed_ref_words": sum(c.timed_ref_words for c in checks),
        "hyp_words": sum(c.hyp_words for c in checks),
        "matched": int(errors.size),
    }
    absolute = np.abs(errors)
    for name, value in (("median_abs_ms", lambda: np.median(absolute)),
                        ("p90_abs_ms", lambda: np.percentile(absolute, 90)),
                        ("mean_abs_ms", lambda: absolute.mean()),
                        ("median_signed_ms", lambda: np.median(errors))):
        stats[name] = round(float(value()), 2) if errors.size else None
    return stats


def check(utts: Sequence[Utterance], words: Mapping[str, Mapping[int, Mapping[str, Any]]],
          results: Sequence[Any]) -> tuple[list[UttCheck], list[str]]:
    """Match each utterance's result (an object with .words and .error) against its word starts:
    (the checks, the ids skipped for an error)."""
    readable = [(u, r) for u, r in zip(utts, results) if getattr(r, "error", None) is None]
    skipped = [u.id for u, r in zip(utts, results) if getattr(r, "error", None) is not None]
    hyps = {u.id: " ".join(w for w, _ in hypothesis_words(r.words)) for u, r in readable}
    report = score({u.id: u.text for u, _ in readable}, hyps, normalize=False)
    checks = [match_words(u.id, u.text, words.get(u.id, {}), r.words, e.ops)
              for (u, r), e in zip(readable, report.utterances)]
    return checks, skipped


def format_table(stats: Mapping[str, Any], title: str) -> str:
    def ms(value: float | None) -> str:
        return "-" if value is None else f"{value:.1f} ms"

    rows = [("utterances", str(stats["utterances"])), ("reference words", str(stats["ref_words"])),
            ("  with an eSpeak event", str(stats["timed_ref_words"])), ("hypothesis words", str(stats["hyp_words"])),
            ("matched (correct, with an event)", str(stats["matched"])),
            ("|start error| median", ms(stats["median_abs_ms"])),
            ("|start error| 90th percentile", ms(stats["p90_abs_ms"])),
            ("|start error| mean", ms(stats["mean_abs_ms"])),
            ("start error median (signed)", ms(stats["median_signed_ms"]))]
    return "\n".join([title] + [f"  {name:<34}{value:>12}" for name, value in rows])


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, required=True, help="model file (asr train / asr average)")
    parser.add_argument("--manifest", type=Path, required=True, help="the utterances (a synth split's manifest)")
    parser.add_argument("--words", type=Path, required=True, help="their word starts (<split>_words.jsonl)")
    parser.add_argument("--limit", type=int, help="only the first N utterances of the manifest")
    parser.add_argument("--beam-size", type=int, help="the model's decoding options' beam unless given")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--out", type=Path, default=Path("word_timing.json"), help="JSON results")
    args = parser.parse_args(argv)
    if args.limit is not None and args.limit < 1:
        parser.error("--limit must be >= 1")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        utts = read_manifest(args.manifest)[:args.limit]
        words = read_words(args.words)
        bad = [u.id for u in utts if u.start is not None or u.end is not None or u.speed != 1.0]
        if bad:
            raise ValueError(f"{args.manifest}: {bad[0]} is a segment or speed-perturbed copy: word starts are "
                             "of whole files")
        import asr

        recognizer = asr.load_model(args.model, device=args.device)
        results = recognizer.transcribe([u.audio for u in utts], word_timestamps=True, beam_size=args.beam_size,
                                        batch_size=args.batch_size)
        checks, skipped = check(utts, words, results)
    except (OSError, ValueError) as e:
        print(f"word_timing_check: error: {e}", file=sys.stderr)
        return 1
    stats = summarize(checks)
    stats["skipped"] = len(skipped)
    for uid in skipped:
        print(f"word_timing_check: skipped {uid}: unreadable audio", file=sys.stderr)
    print(format_table(stats, f"word start error against eSpeak's word events: {args.manifest} ({args.model})"))
    report = {"model": str(args.model), "manifest": str(args.manifest), "words": str(args.words), **stats}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
