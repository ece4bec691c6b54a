"""The synth recipe's results table (stage 6): dev beside test for each of the three decodes, and
each accent apart.

    python local/results.py --exp EXP --data DATA     # prints Markdown, writes EXP/results.json

Reads EXP/decode_{dev,test}{_open,_lexicon,}/hyp.txt and ref.txt (stage 5), the manifests'
speakers ("<accent>+<variant>"), DATA/corpus.json (the seed, the unseen words) and EXP/tune.json
(the LM weights chosen on dev). A decode that is missing is named, not guessed.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from asr.manifest import read_manifest, read_transcripts
from asr.metrics import score

DECODES = (("open", "_open", "open vocabulary (no lexicon, no LM)"),
           ("lexicon", "_lexicon", "the training words as a closed lexicon"),
           ("lexicon+lm", "", "the lexicon and the word LM (weights chosen on dev)"))
SETS = ("dev", "test")


def accent(speaker: str | None) -> str:
    return (speaker or "?").split("+")[0]


def rates(refs: dict[str, str], hyps: dict[str, str]) -> dict[str, Any]:
    stats = score(refs, {i: hyps.get(i, "") for i in refs}, normalize=False).stats
    return {"wer": stats.wer, "cer": stats.cer, "words": stats.words, "utterances": stats.utterances}


def collect(exp: Path, data: Path) -> dict[str, Any]:
    """{"corpus", "tune", "decodes": {decode: {set: {"all": rates, "<accent>": rates} | None}}}."""
    out: dict[str, Any] = {"decodes": {}}
    for name in ("corpus", "tune"):
        path = (data if name == "corpus" else exp) / f"{name}.json"
        out[name] = json.loads(path.read_text(encoding="utf-8")) if path.exists() else None
    speakers = {s: {u.id: accent(u.speaker) for u in read_manifest(data / f"{s}.jsonl")} for s in SETS}
    for key, suffix, _ in DECODES:
        out["decodes"][key] = {}
        for s in SETS:
            folder = exp / f"decode_{s}{suffix}"
            if not (folder / "hyp.txt").exists():
                out["decodes"][key][s] = None
                continue
            refs, hyps = read_transcripts(folder / "ref.txt"), read_transcripts(folder / "hyp.txt")
            entry = {"all": rates(refs, hyps)}
            for a in sorted(set(speakers[s].values())):
                entry[a] = rates({i: r for i, r in refs.items() if speakers[s].get(i) == a}, hyps)
            out["decodes"][key][s] = entry
    return out


def _cell(entry: dict[str, Any] | None) -> str:
    if entry is None:
        return "not decoded"
    r = entry["all"]
    return f"{100 * r['wer']:.2f}% / {100 * r['cer']:.2f}%"


def markdown(results: dict[str, Any]) -> str:
    lines = ["| decode | dev WER / CER | test WER / CER | test per accent (WER) | dev per accent (WER) |",
             "|---|---|---|---|---|"]
    for key, _, what in DECODES:
        sets = results["decodes"][key]
        per = {s: ", ".join(f"{a} {100 * r['wer']:.1f}%" for a, r in sets[s].items() if a != "all") if sets[s] else "-"
               for s in SETS}
        lines.append(f"| {what} | {_cell(sets['dev'])} | {_cell(sets['test'])} | {per['test']} | {per['dev']} |")
    notes = []
    corpus, tune = results["corpus"], results["tune"]
    if corpus:
        notes.append(f"corpus seed {corpus['seed']}")
        for s in SETS:
            split = corpus["splits"].get(s, {})
            if "unseen_words" in split:
                notes.append(f"{s}: {split['unseen_distinct_words']} of {split['distinct_words']} distinct words "
                             f"({100 * split['unseen_distinct_words'] / split['distinct_words']:.1f}%), "
                             f"{100 * split['unseen_words'] / split['words']:.1f}% of running words, "
                             "never in training or LM text")
    if tune:
        notes.append(f"LM weight {tune['chosen']['lm_weight']} and word bonus {tune['chosen']['lm_word_bonus']} "
                     f"chosen on dev ({100 * tune['dev_wer']:.2f}%)")
    return "\n".join(lines) + ("\n\n" + "; ".join(notes) if notes else "")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--exp", type=Path, required=True)
    parser.add_argument("--data", type=Path, required=True)
    args = parser.parse_args(argv)
    results = collect(args.exp, args.data)
    (args.exp / "results.json").write_text(json.dumps(results, indent=1) + "\n", encoding="utf-8")
    print(markdown(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
