"""Does the word confidence mean something? Transcribes a manifest with word timings (the Python
API, `word_timestamps=True`), labels every hypothesis word right (aligned to the same reference
word) or wrong (a substitution or an insertion), and reports how the errors sit along the
confidence: the share of wrong words below and above thresholds, and how many of all the wrong
words the least confident 10% (and 20%) of the words hold. Prints a table, writes JSON.

    python tools/confidence_check.py --model exp/synth/model_avg.pt --manifest data/dev.jsonl \\
        [--config conf/decode/synth.yaml] [--beam-size 10] [--out exp/confidence_dev.json]

Deletions have no hypothesis word and so no confidence: they are counted apart.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from asr.api import load_model  # noqa: E402
from asr.audio import load_audio  # noqa: E402
from asr.decoding import load_decoding_config  # noqa: E402
from asr.manifest import read_manifest  # noqa: E402
from asr.metrics import score  # noqa: E402


def labelled_words(model: str, manifest: str, config: str | None, beam_size: int | None,
                   limit: int | None) -> tuple[list[tuple[float, bool]], int, int]:
    """((confidence, right) of every hypothesis word, reference words, deletions)."""
    options = load_decoding_config(config, beam_size=beam_size).decoding_options()
    recognizer = load_model(model, options=options)
    utts = read_manifest(manifest)[:limit]
    inputs = [(load_audio(u.audio, start=u.start or 0.0, end=u.end), 16000) for u in utts]
    results = recognizer.transcribe(inputs, word_timestamps=True)
    labelled, ref_words, deletions = [], 0, 0
    for utt, result in zip(utts, results):
        words = result.words
        report = score({utt.id: utt.text}, {utt.id: " ".join(w.text for w in words)})
        ops = [op for op in report.utterances[0].ops if op != "D"]
        if len(ops) != len(words):  # normalization changed the word count: leave the utterance out
            continue
        labelled += [(w.confidence, op == "C") for w, op in zip(words, ops)]
        ref_words += report.stats.words
        deletions += report.stats.deletions
    return labelled, ref_words, deletions


def summary(labelled: list[tuple[float, bool]]) -> dict:
    """Error shares below / above thresholds, and the errors the least confident words hold."""
    ordered = sorted(labelled)  # least confident first
    wrong = sum(not right for _, right in ordered)
    out: dict = {"words": len(ordered), "wrong": wrong, "thresholds": [], "lowest": []}
    for share in (0.1, 0.2):
        k = round(share * len(ordered))
        caught = sum(not right for _, right in ordered[:k])
        out["lowest"].append({"share": share, "words": k, "wrong": caught,
                              "of_all_wrong": caught / wrong if wrong else 0.0,
                              "wrong_rate": caught / k if k else 0.0})
    for threshold in (0.3, 0.5, 0.7, 0.9):
        below = [right for c, right in ordered if c < threshold]
        above = [right for c, right in ordered if c >= threshold]
        out["thresholds"].append({
            "threshold": threshold, "below": len(below), "above": len(above),
            "wrong_rate_below": sum(not r for r in below) / len(below) if below else None,
            "wrong_rate_above": sum(not r for r in above) / len(above) if above else None})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--manifest", required=True)
    parser.add_argument("--config", help="decoding options (conf/decode/*.yaml)")
    parser.add_argument("--beam-size", type=int)
    parser.add_argument("--limit", type=int, help="the first N utterances only")
    parser.add_argument("--out", type=Path, default=ROOT / "exp" / "confidence.json")
    args = parser.parse_args()
    labelled, ref_words, deletions = labelled_words(args.model, args.manifest, args.config, args.beam_size, args.limit)
    result = {"model": args.model, "manifest": args.manifest, "reference_words": ref_words,
              "deletions": deletions, **summary(labelled)}
    print(f"{result['words']} hypothesis words, {result['wrong']} wrong (substituted or inserted); "
          f"{deletions} deletions of {ref_words} reference words")
    print(f"{'threshold':>9}  {'below':>6}  {'wrong below':>11}  {'above':>6}  {'wrong above':>11}")
    for row in result["thresholds"]:
        fmt = lambda x: "-" if x is None else f"{100 * x:.1f}%"  # noqa: E731
        print(f"{row['threshold']:>9}  {row['below']:>6}  {fmt(row['wrong_rate_below']):>11}  {row['above']:>6}  "
              f"{fmt(row['wrong_rate_above']):>11}")
    for row in result["lowest"]:
        print(f"the least confident {100 * row['share']:.0f}% ({row['words']} words) hold {row['wrong']} of the "
              f"{result['wrong']} wrong words ({100 * row['of_all_wrong']:.1f}%); {100 * row['wrong_rate']:.1f}% of "
              "them are wrong")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
