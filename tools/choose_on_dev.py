"""Choose a training setting on the dev sets, never on test: train the synth recipe once per
variant and seed, decode its three dev sets, print mean and spread, write JSON.

    python tools/choose_on_dev.py --variant base= \\
        --variant warp=data.augment.warp.prob=0.5 --seeds 0 1 2 --json exp/choice_warp.json
    python tools/choose_on_dev.py --learning-check exp/lc/data3 --variant base=data.augment.gain.prob=0.5 \\
        --variant "wide=data.augment.gain.prob=0.5 model.d_model=192 model.ffn_dim=768" --seeds 0 1 2

Each variant is "NAME=OVERRIDES" (section.key=value, separated by spaces; empty for the recipe as
shipped). For each variant and seed: recipes/synth/run.sh stages 3-4 (training and checkpoint
averaging, `training.seed=SEED` and the overrides) into recipes/synth/exp/choice_NAME_sSEED, then
`asr decode` of dev (unseen accents), dev_near (training accents, unseen voice variants) and
dev_synth (an unseen synthesizer) open vocabulary (no lexicon, no LM; conf/decode/synth.yaml at
beam 10, as the earlier tables were made: the recipe's stage 5 searches at 40, within 0.2 points
of 10 without an LM) into decode_<set>_open_beam10, apart from stage 5's folders. The test set is
not decoded. Finished runs and decodes are kept and reused, so an interrupted comparison resumes.
With --learning-check CORPUS, each variant and seed is instead `tools/learning_check.py --data
CORPUS` (conf/small.yaml and the overrides, 6,000 steps, its dev sets decoded by its own
conf/decode/small.yaml at beam 10) into --out-root/NAME_sSEED, every run after the first given
the first one's tokenizer, CMVN statistics and features where they were made the same way
(learning_check.py --prepared-from): the choices for conf/small.yaml. Otherwise
the data (stages 0-2) must exist:
`bash recipes/synth/run.sh --stop-stage 2` (or --data-dir). The table gives, per variant and dev
set, the mean open-vocabulary WER over seeds with its spread (max - min) and each seed's figure,
and the mean training time (stage 3's wall clock: side-by-side runs share the cores).
"""
from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes" / "synth"
DEV_SETS = ("dev", "dev_near", "dev_synth")


def parse_variant(text: str) -> tuple[str, list[str]]:
    name, _, rest = text.partition("=")
    if not re.fullmatch(r"[A-Za-z0-9_.-]+", name):
        raise argparse.ArgumentTypeError(f"variant name {name!r}: letters, digits, '_', '.', '-' only")
    overrides = rest.split()
    bad = [o for o in overrides if "=" not in o]
    if bad:
        raise argparse.ArgumentTypeError(f"variant {name}: {bad[0]!r} is not section.key=value")
    return name, overrides


def run(cmd: list[str], log: Path) -> None:
    with log.open("a") as f:
        done = subprocess.run([str(c) for c in cmd], stdout=f, stderr=subprocess.STDOUT, cwd=RECIPE)
    if done.returncode:
        sys.exit(f"choose_on_dev: {' '.join(map(str, cmd[:4]))} ... failed (exit {done.returncode}); see {log}")


def train_seconds(exp: Path) -> float | None:
    """Stage 3's wall clock from the recipe's run.log."""
    found = re.findall(r"stage 3 took (\d+) s", (exp / "run.log").read_text()) if (exp / "run.log").exists() else []
    return float(found[-1]) if found else None


def one_run(name: str, overrides: list[str], seed: int, data: Path, log: Path,
            dev_sets: tuple[str, ...] = DEV_SETS) -> dict:
    exp = RECIPE / "exp" / f"choice_{name}_s{seed}"
    model = exp / "model_avg.pt"
    if not model.exists():
        run(["bash", "run.sh", "--stage", "3", "--stop-stage", "4", "--name", exp.name, "--data-dir", data,
             f"training.seed={seed}", *overrides], log)
    result = {"exp": str(exp.relative_to(ROOT)), "train_seconds": train_seconds(exp)}
    for dev in dev_sets:
        manifest = data / f"{dev}.jsonl"
        if not manifest.exists():
            continue
        out = exp / f"decode_{dev}_open_beam10"  # not stage 5's decode_{dev}_open (beam 40), should it run here
        if not (out / "wer.json").exists():
            run([sys.executable, "-m", "asr.cli", "decode", "--model", model, "--manifest", manifest, "--out-dir", out,
                 "--config", ROOT / "conf" / "decode" / "synth.yaml", "--beam-size", "10"], log)
        result[dev] = json.loads((out / "wer.json").read_text())["wer"] * 100
    return result


def one_check(name: str, overrides: list[str], seed: int, corpus: Path, root: Path, first: Path, log: Path) -> dict:
    """One learning check (tools/learning_check.py) of the variant at training seed `seed`, made once;
    unless it is `first`, given `first`'s tokenizer, CMVN statistics and features."""
    out = root / f"{name}_s{seed}"
    report = out / "learning_check.json"
    if not report.is_file():
        run([sys.executable, ROOT / "tools" / "learning_check.py", "--out", out, "--data", corpus,
             *(["--prepared-from", first] if first != out else []), f"training.seed={seed}", *overrides], log)
    checked = json.loads(report.read_text())
    result = {"exp": str(out), "train_seconds": checked["train_minutes"] * 60}
    for dev in DEV_SETS:
        scores = checked["dev_sets"].get(dev, {})
        if "wer" in scores:
            result[dev] = scores["wer"] * 100
    return result


def summary(values: list[float]) -> str:
    if not values:
        return "-"
    spread = max(values) - min(values)
    each = " / ".join(f"{v:.1f}" for v in values)
    return f"{statistics.mean(values):.1f} ± {spread:.1f} ({each})" if len(values) > 1 else f"{values[0]:.1f}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variant", action="append", type=parse_variant, required=True, metavar="'NAME=K=V K=V'",
                   help="a setting to compare (repeat); NAME= alone: the recipe as shipped")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="training.seed values (default 0 1 2)")
    p.add_argument("--data-dir", type=Path, default=RECIPE / "data", help="the recipe's data (stages 0-2)")
    p.add_argument("--learning-check", type=Path, metavar="CORPUS",
                   help="compare conf/small.yaml's settings by tools/learning_check.py on this corpus folder "
                        "(train.jsonl, dev.jsonl, dev_near.jsonl, dev_synth.jsonl) instead of the synth recipe")
    p.add_argument("--out-root", type=Path, default=ROOT / "exp" / "choose_small",
                   help="with --learning-check: the checks' folders go here (default exp/choose_small)")
    p.add_argument("--extra-dev", action="append", default=[], metavar="SET",
                   help="also decode DATA_DIR/SET.jsonl (repeat; e.g. a reverberant copy of dev_near made by "
                        "tools/simulate_rirs.py); not with --learning-check")
    p.add_argument("--json", type=Path, help="write the results here")
    args = p.parse_args()
    if args.extra_dev and args.learning_check:
        p.error("--extra-dev is for the synth recipe's data, not --learning-check")
    dev_sets = DEV_SETS + tuple(d for d in args.extra_dev if d not in DEV_SETS)
    data = (args.learning_check or args.data_dir).resolve()
    if not (data / "train.jsonl").exists():
        sys.exit(f"choose_on_dev: {data}/train.jsonl is missing" + (
            "" if args.learning_check else ": run 'bash recipes/synth/run.sh --stop-stage 2' first"))
    log = ROOT / "exp" / "choose_on_dev.log"
    log.parent.mkdir(exist_ok=True)
    root = args.out_root.resolve()
    first = root / f"{args.variant[0][0]}_s{args.seeds[0]}"  # the learning check whose preparation the others reuse
    results: dict[str, list[dict]] = {}
    for seed in args.seeds:  # seed-major: every variant has a figure early
        for name, overrides in args.variant:
            if args.learning_check:
                r = one_check(name, overrides, seed, data, root, first, log)
            else:
                r = one_run(name, overrides, seed, data, log, dev_sets)
            results.setdefault(name, []).append({"seed": seed, **r})
            print(f"{name} seed {seed}: " + ", ".join(f"{d} {r[d]:.1f}%" for d in dev_sets if d in r), flush=True)
    header = ["variant", *(f"{d} WER %" for d in dev_sets), "training s"]
    rows = []
    for name, overrides in args.variant:
        runs = results[name]
        times = [r["train_seconds"] for r in runs if r["train_seconds"]]
        rows.append([f"{name} ({' '.join(overrides) or 'as shipped'})",
                     *(summary([r[d] for r in runs if d in r]) for d in dev_sets),
                     f"{statistics.mean(times):.0f}" if times else "-"])
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    for row in (header, *rows):
        print(" | ".join(str(x).ljust(w) for x, w in zip(row, widths)))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        variants = {name: {"overrides": overrides, "runs": results[name]} for name, overrides in args.variant}
        out = {"seeds": args.seeds, "data": str(data), "learning_check": bool(args.learning_check),
               "variants": variants}
        args.json.write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
