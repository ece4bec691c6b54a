"""The synth recipe's results table (stage 6): the three dev sets beside test for each of the four
decodes, and each accent apart.

    python local/results.py --exp EXP --data DATA     # prints Markdown, writes EXP/results.json

The dev sets speak the same held-out sentences and differ in the voice, so each measures one gap:
dev, the unseen accents (pronunciation); dev_near, the training accents in voice variants training
never used (acoustics, near); dev_synth, Festival's ked voice (a synthesizer never heard).
Reads EXP/decode_<set>{_open,_open_lm,_lexicon,}/hyp.txt and ref.txt (stage 5), the manifests'
speakers ("<accent>+<variant>"), DATA/corpus.json (the seed, the unseen words),
DATA/dev_synth.skipped (why there is no dev_synth), EXP/tune.json (the LM weights chosen on dev's
lexicon beam) and decode_dev_open_lm/wer.json (the LM weights of the open-vocabulary search). A set
not made and a decode that is missing are named, not guessed.
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
           ("open+lm", "_open_lm", "open vocabulary with the word LM in the search (weights chosen on dev)"),
           ("lexicon", "_lexicon", "the training words as a closed lexicon"),
           ("lexicon+lm", "", "the lexicon and the word LM (weights chosen on dev)"))
SETS = ("dev", "dev_near", "dev_synth", "test")
EXTRA = ("dev_near", "dev_synth")  # the sets beside dev that stage 5 decodes open vocabulary unless asked
TITLES = {"dev": "dev: unseen accents", "dev_near": "dev_near: unseen voices",
          "dev_synth": "dev_synth: unseen synthesizer", "test": "test"}


def accent(speaker: str | None) -> str:
    return (speaker or "?").split("+")[0]


def rates(refs: dict[str, str], hyps: dict[str, str]) -> dict[str, Any]:
    stats = score(refs, {i: hyps.get(i, "") for i in refs}, normalize=False).stats
    return {"wer": stats.wer, "cer": stats.cer, "words": stats.words, "utterances": stats.utterances}


def collect(exp: Path, data: Path) -> dict[str, Any]:
    """{"corpus", "tune", "open_lm", "sets": {set: "made" | "not made" | "skipped: <why>"},
    "decodes": {decode: {set: {"all": rates, "<accent>": rates} | None}}}."""
    out: dict[str, Any] = {"decodes": {}, "sets": {}}
    for name, path in (("corpus", data / "corpus.json"), ("tune", exp / "tune.json"),
                       ("open_lm", exp / "decode_dev_open_lm" / "wer.json")):
        out[name] = json.loads(path.read_text(encoding="utf-8")) if path.exists() else None
    speakers: dict[str, dict[str, str]] = {}
    for s in SETS:
        manifest, skipped = data / f"{s}.jsonl", data / f"{s}.skipped"
        speakers[s] = {u.id: accent(u.speaker) for u in read_manifest(manifest)} if manifest.exists() else {}
        out["sets"][s] = ("made" if manifest.exists() else
                          "skipped: " + skipped.read_text(encoding="utf-8").strip() if skipped.exists() else "not made")
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


def _cell(entry: dict[str, Any] | None, made: str = "made") -> str:
    if entry is None:
        return "not decoded" if made == "made" else made.split(":")[0]
    r = entry["all"]
    return f"{100 * r['wer']:.2f}% / {100 * r['cer']:.2f}%"


def markdown(results: dict[str, Any]) -> str:
    made = results.get("sets", {})
    lines = ["| decode | " + " | ".join(f"{TITLES[s]} WER / CER" for s in SETS)
             + " | test per accent (WER) | dev per accent (WER) |",
             "|---" * (len(SETS) + 3) + "|"]
    for key, _, what in DECODES:
        sets = results["decodes"][key]
        per = {s: ", ".join(f"{a} {100 * r['wer']:.1f}%" for a, r in sets[s].items() if a != "all") if sets[s] else "-"
               for s in ("dev", "test")}
        cells = [_cell(sets.get(s), made.get(s, "made")) for s in SETS]
        for i, s in enumerate(SETS):  # run.sh decodes dev_near and dev_synth open vocabulary by default
            if s in EXTRA and key != "open" and sets.get(s) is None and results["decodes"]["open"].get(s):
                cells[i] = "-"
        lines.append(f"| {what} | {' | '.join(cells)} | {per['test']} | {per['dev']} |")
    notes = [f"{s} {why}" for s, why in made.items() if why.startswith("skipped")]
    if any(results["decodes"]["open"].get(s) and not results["decodes"]["lexicon"].get(s) for s in EXTRA):
        notes.append("-: decoded open vocabulary only (run.sh --extra-dev-decodes all: the lexicon and the LM too)")
    corpus = results["corpus"]
    if corpus:
        notes.append(f"corpus seed {corpus['seed']}")
        near = corpus["splits"].get("dev_near")
        if near:
            notes.append(f"dev_near: {near['sentences']} of dev's sentences in the training accents by voice variants "
                         f"training never used ({', '.join(near['variants'])})")
        if made.get("dev_synth") == "made":
            notes.append("dev_synth: dev's sentences spoken by Festival's ked_diphone voice")
        for s in ("dev", "test"):
            split = corpus["splits"].get(s, {})
            if "unseen_words" in split:
                notes.append(f"{s}: {split['unseen_distinct_words']} of {split['distinct_words']} distinct words "
                             f"({100 * split['unseen_distinct_words'] / split['distinct_words']:.1f}%), "
                             f"{100 * split['unseen_words'] / split['words']:.1f}% of running words, "
                             "never in training or LM text")
    search = (results.get("open_lm") or {}).get("decoding")
    if search:
        notes.append(f"open vocabulary with the LM: weight {search['lm_weight']} and word bonus "
                     f"{search['lm_word_bonus']} (conf/decode/synth_open_lm.yaml, chosen on dev over three "
                     "training seeds)")
    tune = results.get("tune")
    if tune:
        notes.append(f"with the lexicon: LM weight {tune['chosen']['lm_weight']} and word bonus "
                     f"{tune['chosen']['lm_word_bonus']} chosen on dev's beam ({100 * tune['dev_wer']:.2f}%)")
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
