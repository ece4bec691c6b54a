"""The synth recipe's decoding choices, made on dev only: the word LM's weight and word bonus for
rescoring a beam (every run, stage 5), and by hand (too slow for every run), the search's CTC weight
and length bonus (`search`) and the weight and word bonus of the LM fused into the open-vocabulary
search (`fusion`: conf/decode/synth_open_lm.yaml's values).

    python local/tune.py choose --beam EXP/decode_dev_lexicon --manifest DATA/dev.jsonl --lm DATA/lm.arpa \\
        --config conf/decode/synth.yaml --out EXP/decode.yaml [--weights 0,0.1,...] [--bonuses 0,0.5,...] \\
        [--then BEAM MANIFEST OUT_DIR ...]
    python local/tune.py rescore --beam EXP/decode_test_lexicon --manifest DATA/test.jsonl --lm DATA/lm.arpa \\
        --config EXP/decode.yaml --out-dir EXP/decode_test
    python local/tune.py search --model EXP/model_avg.pt --manifest DATA/dev.jsonl --lexicon DATA/words.txt \\
        --config conf/decode/synth.yaml --out-dir EXP/tune_search [--ctc-weights 0.1,0.2] [--length-bonuses 0.5,1]
    python local/tune.py fusion --model EXP_S0/model_avg.pt EXP_S1/model_avg.pt ... --manifest DATA/dev.jsonl \\
        --lm DATA/lm.arpa --config conf/decode/synth.yaml --out-dir DIR [--weights 0.2,0.3] [--bonuses 1.5,2.5]

`choose` and `rescore` read the journal (decode.jsonl) of an `asr decode` run with decoding.nbest =
beam_size, with the lexicon or without it (open vocabulary: a word the LM does not know scores as
its <unk>): the whole beam of each utterance, with the search's scores. That is the list `asr
decode` with decoding.lm rescores (asr.decoding.DecodingTask keeps the whole beam
when an LM rescores it), so rescoring it here gives the same hypotheses as decoding again with the
LM, without searching again.

`choose` rescores dev's beam with every lm_weight x lm_word_bonus of the grid, picks the lowest
dev WER (ties: the smaller weight, then the smaller bonus), and writes the decoding config with
those two values and the beam's size to --out (the other values are --config's), and the whole
grid to tune.json beside it; each --then rescores another beam with the chosen values,
as `rescore` does, in the same process (the LM is read once). `rescore` applies a config's
lm_weight and lm_word_bonus to a beam and writes hyp.txt, ref.txt, wer.json and errors.txt as
`asr decode` does: the test set is rescored once, with the values chosen on dev. `search` decodes
dev with the lexicon at every ctc_weight x length_bonus of its grid, `fusion` open vocabulary with
the LM inside the search (decoding.lm_fusion) at every lm_weight x lm_word_bonus (the rest from
--config), each by every --model (several training seeds: their mean WER), and print the WERs,
lowest mean first (search.json / fusion.json in --out-dir).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from asr.config import ConfigError, to_dict
from asr.decode import JOURNAL, decode_manifest, write_outputs
from asr.decoding import DecodingConfig, load_decoding_config
from asr.fileio import atomic_open
from asr.lm import LMError, NgramLM, rescore
from asr.manifest import ManifestError, read_manifest
from asr.metrics import normalize_text, score

WEIGHTS = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.8, 1.0)
BONUSES = (0.0, 0.5, 1.0, 1.5, 2.0, 2.5, 3.0)

Beam = dict[str, list[tuple[list[str], float]]]  # utterance id -> [(words, search score)], best first


class TuneError(RuntimeError):
    """A one-line reason naming the file at fault."""


def read_beam(folder: Path, ids: Sequence[str]) -> tuple[Beam, dict]:
    """The n-best lists of an `asr decode` journal (folder/decode.jsonl) for `ids`, and the search it
    was decoded with (its "lexicon", "" for none, and "beam_size"); an utterance decoded to nothing
    (skipped, or too short) is one empty hypothesis."""
    path = folder / JOURNAL
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as e:
        raise TuneError(f"{path}: cannot read the decoding journal: {e}") from None
    header = json.loads(lines[0]).get("header", {}) if lines else {}
    search = header.get("search", {})
    if search.get("lm") or search.get("nbest", 1) < search.get("beam_size", 1):
        raise TuneError(f"{path}: decoded with an LM or without the whole beam "
                        "(decoding.nbest = beam_size, no decoding.lm)")
    beam: Beam = {}
    for number, line in enumerate(lines[1:], 2):
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            raise TuneError(f"{path}:{number}: not JSON") from None
        nbest = record.get("nbest") or [{"text": record.get("text", ""), "score": record.get("score")}]
        beam[record["id"]] = [(normalize_text(h["text"]).split(), float("-inf") if h["score"] is None else h["score"])
                              for h in nbest]
    missing = [i for i in ids if i not in beam]
    if missing:
        raise TuneError(f"{path}: {len(missing)} utterances of the manifest not decoded (first: {missing[0]})")
    return {i: beam[i] for i in ids}, search


class CachedLM:
    """An LM whose sentence scores are kept: a grid rescores the same hypotheses many times."""

    def __init__(self, lm: NgramLM) -> None:
        self.lm, self._scores = lm, {}

    def score(self, words: Sequence[str]) -> float:
        key = tuple(words)
        if key not in self._scores:
            self._scores[key] = self.lm.score(words)
        return self._scores[key]


def best_texts(beam: Beam, lm: NgramLM | CachedLM, weight: float, bonus: float) -> dict[str, str]:
    """Each utterance's best hypothesis after adding weight * ln P_LM + bonus per word (asr.lm.rescore)."""
    out = {}
    for utt_id, nbest in beam.items():
        (i, _), = rescore(nbest, lm, weight, 1, bonus)
        out[utt_id] = " ".join(nbest[i][0])
    return out


def choose(beam: Beam, refs: dict[str, str], lm: NgramLM, weights: Sequence[float],
           bonuses: Sequence[float]) -> tuple[dict[str, float], list[dict[str, float]]]:
    """The (weight, bonus) of the lowest WER on `refs` (ties: smaller weight, then smaller bonus),
    and every point of the grid: [{"lm_weight", "lm_word_bonus", "wer", "cer"}]."""
    grid, lm = [], CachedLM(lm)
    for weight in sorted(weights):
        for bonus in sorted(bonuses):
            stats = score(refs, best_texts(beam, lm, weight, bonus), normalize=False).stats
            grid.append({"lm_weight": weight, "lm_word_bonus": bonus, "wer": stats.wer, "cer": stats.cer})
    best = min(grid, key=lambda g: (g["wer"], g["lm_weight"], g["lm_word_bonus"]))
    return {"lm_weight": best["lm_weight"], "lm_word_bonus": best["lm_word_bonus"]}, grid


def decode_grid(models: Sequence[Path], manifest: Path, config_path: Path, out: Path,
                points: Sequence[dict[str, Any]], fixed: Sequence[str] = ()) -> list[dict[str, Any]]:
    """`manifest` decoded by each model at every point of the grid (decoding.key: value; `fixed`:
    decoding.key=value overrides of every point), the rest from `config_path`: [{**point, "wer",
    "cer" (means over the models), "wers" (each model's)}], lowest mean WER first (ties: the point's
    smaller values, in order); each decode in out/<model number>_<key><value>_.../."""
    grid = []
    for point in points:
        name = "_".join(f"{k.split('_')[-1]}{v}" for k, v in point.items())
        config = load_decoding_config(str(config_path), [*fixed, *(f"decoding.{k}={v}" for k, v in point.items())])
        stats = [decode_manifest(model, manifest, out / f"{number}_{name}", config)
                 for number, model in enumerate(models)]
        grid.append({**point, "wer": statistics.mean(w["wer"] for w in stats),
                     "cer": statistics.mean(w["cer"] for w in stats), "wers": [w["wer"] for w in stats]})
    grid.sort(key=lambda g: (g["wer"], *(g[k] for k in points[0])))
    return grid


def write_grid(path: Path, models: Sequence[Path], manifest: Path, config_path: Path, grid: list[dict]) -> None:
    with atomic_open(path) as f:
        f.write(json.dumps({"manifest": str(manifest), "config": str(config_path),
                            "models": [str(m) for m in models], "grid": grid}, indent=1) + "\n")


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x]


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    return _grid(args) if args.command in ("search", "fusion") else _choose_or_rescore(args)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    for name in ("choose", "rescore"):
        p = sub.add_parser(name)
        p.add_argument("--beam", type=Path, required=True,
                       help="an `asr decode` folder decoded with decoding.nbest = beam_size")
        p.add_argument("--manifest", type=Path, required=True, help="the manifest it decoded (the references)")
        p.add_argument("--lm", type=Path, required=True, help="the ARPA word LM")
        p.add_argument("--config", type=Path, required=True, help="a decoding config (conf/decode/*.yaml)")
        if name == "choose":
            p.add_argument("--out", type=Path, required=True,
                           help="the decoding config to write (the chosen values, the beam's size)")
            p.add_argument("--weights", type=_floats, default=list(WEIGHTS))
            p.add_argument("--bonuses", type=_floats, default=list(BONUSES))
            p.add_argument("--then", nargs=3, action="append", default=[], metavar=("BEAM", "MANIFEST", "OUT_DIR"),
                           help="then rescore this beam with the chosen values into OUT_DIR (repeatable)")
        else:
            p.add_argument("--out-dir", type=Path, required=True)
    for name in ("search", "fusion"):
        p = sub.add_parser(name)
        p.add_argument("--model", type=Path, nargs="+", required=True, help="one model, or several (the mean WER)")
        p.add_argument("--manifest", type=Path, required=True, help="dev")
        p.add_argument("--config", type=Path, required=True)
        p.add_argument("--out-dir", type=Path, required=True)
        if name == "search":
            p.add_argument("--lexicon", type=Path, required=True)
            p.add_argument("--ctc-weights", type=_floats, default=[0.1, 0.2, 0.3])
            p.add_argument("--length-bonuses", type=_floats, default=[0.5, 1.0, 1.5])
        else:
            p.add_argument("--lm", type=Path, required=True, help="the ARPA word LM")
            p.add_argument("--weights", type=_floats, default=[0.2, 0.3, 0.4, 0.5])
            p.add_argument("--bonuses", type=_floats, default=[1.5, 2.5, 3.5])
    return parser


def _grid(args: argparse.Namespace) -> int:
    """search / fusion: decode dev over a grid of two decoding values."""
    args.out_dir.mkdir(parents=True, exist_ok=True)
    if args.command == "search":
        keys, fixed = ("ctc_weight", "length_bonus"), [f"decoding.lexicon={args.lexicon}"]
        values = [(w, b) for w in args.ctc_weights for b in args.length_bonuses]
    else:
        keys, fixed = ("lm_weight", "lm_word_bonus"), [f"decoding.lm={args.lm}", "decoding.lm_fusion=true"]
        values = [(w, b) for w in args.weights for b in args.bonuses]
    grid = decode_grid(args.model, args.manifest, args.config, args.out_dir,
                       [dict(zip(keys, v)) for v in values], fixed)
    write_grid(args.out_dir / f"{args.command}.json", args.model, args.manifest, args.config, grid)
    for g in grid:
        each = f" ({' / '.join(f'{100 * w:.2f}' for w in g['wers'])})" if len(g["wers"]) > 1 else ""
        print(f"{keys[0]} {g[keys[0]]}, {keys[1]} {g[keys[1]]}: WER {100 * g['wer']:.2f}%{each} "
              f"CER {100 * g['cer']:.2f}%")
    return 0


def _choose_or_rescore(args: argparse.Namespace) -> int:
    """choose: the LM weight and word bonus with the best dev WER on an n-best; rescore: apply them."""
    try:
        config = load_decoding_config(str(args.config))
        lm = NgramLM.load(args.lm)
        if args.command == "rescore":
            apply(args.beam, args.manifest, lm, config, args.lm, args.out_dir)
            return 0
        refs = {u.id: normalize_text(u.text) for u in read_manifest(args.manifest)}
        beam, search = read_beam(args.beam, list(refs))
    except (TuneError, ConfigError, ManifestError, LMError, OSError) as e:
        print(f"tune: error: {e}", file=sys.stderr)
        return 1
    chosen, grid = choose(beam, refs, lm, args.weights, args.bonuses)
    best = next(g for g in grid if {k: g[k] for k in chosen} == chosen)
    without = next((g for g in grid if g["lm_weight"] == 0.0 and g["lm_word_bonus"] == 0.0), None)
    values = {**to_dict(config), **chosen}
    values["beam_size"] = search.get("beam_size", config.beam_size)  # the beam that was rescored
    for key in ("lexicon", "lm"):  # the recipe passes these on the command line
        values.pop(key, None)
    comment = (f"# {args.config.name} with lm_weight and lm_word_bonus chosen on dev by recipes/synth/local/tune.py\n"
               f"# ({len(refs)} utterances of {args.manifest}, the beam of {args.beam}):\n"
               f"# dev WER {100 * best['wer']:.2f}%\n")
    with atomic_open(args.out) as f:
        f.write(comment + yaml.safe_dump(values, sort_keys=False))
    with atomic_open(args.out.with_name("tune.json")) as f:
        f.write(json.dumps({"manifest": str(args.manifest), "beam": str(args.beam), "chosen": chosen,
                            "dev_wer": best["wer"], "grid": grid}, indent=1) + "\n")
    print(f"tune: chose lm_weight {chosen['lm_weight']}, lm_word_bonus {chosen['lm_word_bonus']} on dev: "
          f"WER {100 * best['wer']:.2f}%" + (f" (without the LM {100 * without['wer']:.2f}%)" if without else "")
          + f" -> {args.out}")
    tuned = dataclasses.replace(config, **chosen)
    for beam_dir, manifest, out_dir in args.then:
        try:
            apply(Path(beam_dir), Path(manifest), lm, tuned, args.lm, Path(out_dir))
        except (TuneError, ManifestError, OSError) as e:
            print(f"tune: error: {e}", file=sys.stderr)
            return 1
    return 0


def apply(beam_dir: Path, manifest: Path, lm: NgramLM, config: DecodingConfig, lm_path: Path, out: Path) -> None:
    """The beam of `beam_dir` rescored with config's lm_weight and lm_word_bonus, written to `out`
    by asr.decode.write_outputs, as `asr decode` with that config, its lexicon and the LM writes."""
    utts = read_manifest(manifest)
    beam, search = read_beam(beam_dir, [u.id for u in utts])
    hyps = best_texts(beam, lm, config.lm_weight, config.lm_word_bonus)
    out.mkdir(parents=True, exist_ok=True)
    wer = write_outputs(out, utts, {i: {"text": text} for i, text in hyps.items()},
                        dataclasses.replace(config, lexicon=search.get("lexicon", ""), lm=str(lm_path)))
    print(f"tune: {out}: lm_weight {config.lm_weight}, lm_word_bonus {config.lm_word_bonus}: "
          f"WER {100 * wer['wer']:.2f}% CER {100 * wer['cer']:.2f}% ({wer['utterances']} utterances)")


if __name__ == "__main__":
    sys.exit(main())
