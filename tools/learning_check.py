"""Does a config learn a corpus it was not tuned for? Trains it for a fixed number of steps on text
spoken by eSpeak NG voices (or on a corpus folder you have), then says whether the CTC loss left
its plateau and what the model scores on its three dev sets, one gap each. Prints a table, writes
OUT/learning_check.json.

    python tools/learning_check.py --out exp/check_long --ids \\
        --text ../shared/realspeech/librispeech_text/train-clean-100.txt --num-dev 150
    python tools/learning_check.py --out exp/check_long_char --data exp/check_long/data \\
        tokenizer.kind=char model.subsampling=4
    python tools/learning_check.py --out exp/check_synth --data recipes/synth/data --steps 3600

1. Data: with --text, every line but --num-dev of them spoken by the training accents' voices
   (recipes/synth/local/synthesize.py, test split empty), into OUT/data; the --num-dev held-out lines
   make three dev sets that differ only in the voice: dev.jsonl in the synth recipe's dev accents,
   en-029 and en-gb-x-gbcwmd (unseen accents: pronunciation), dev_near.jsonl in the training accents
   by voice variants training never uses (synthesize.NEAR_VARIANTS: acoustics, near) and
   dev_synth.jsonl by Festival's ked_diphone voice (recipes/synth/local/festival.py: a synthesizer
   never heard; skipped, not failed, when Festival cannot be fetched); with --flite F, a fraction F
   of the training lines spoken again by Flite's voices (recipes/synth/local/flite.py, as the synth
   recipe's --flite; --flite-pitch LO HI draws each line's mean pitch; --flite-add keeps the eSpeak
   lines and adds the Flite ones; --flite-voices V... has those voices alone speak); with --mbrola
   F, --pico F and --rhvoice F, and their -pitch, -add and -voices, the same by MBROLA's, SVOX
   Pico's and RHVoice's voices (recipes/synth/local/mbrola.py, pico.py, rhvoice.py), after Flite's
   (Flite's kal16 chooses MBROLA's phonemes, durations and intonation; --mbrola-prosody espeak: eSpeak);
   with --human K, Asterisk's English prompts, read by a person, added K times (local/human.py), last.
   With --data, that folder's train.jsonl and dev.jsonl, and its dev_near.jsonl and dev_synth.jsonl
   when it has them; with --data and any of them, a hard-linked copy of the folder in OUT/data is
   given the new lines (the folder itself is left as it is). Made once.
2. The config's tokenizer (after the overrides) on the training text, CMVN statistics and dumped
   training features, as recipes/synth/run.sh makes them; with the config's data.speed_perturb
   (conf/small.yaml: 0.9, 1.1) the features of the speed-perturbed copies too. None dumped when
   the overrides add noise or reverberation (data.augment.noise, reverb): training then computes
   the features from the audio, which they need (slower). OUT/prepared.json says what made them;
   --prepared-from DIR hard-links another check's instead when its prepared.json matches (a
   comparison of training settings on one corpus: tools/choose_on_dev.py --learning-check).
3. Training: --steps optimizer steps (training.max_steps: the schedule spans them) with --nproc
   processes (default 2, one thread each: the synth recipe's way on 2 cores), then the last 5
   checkpoints averaged.
4. Each dev set decoded open vocabulary (no lexicon, no LM) with --decode-config
   (conf/decode/small.yaml: beam 10, CTC weight 0.4) into OUT/decode_<set>.

The plateau: CTC loss per token near ln V (chance, V = the tokenizer's vocabulary). The table
gives the first logged training step, and the first validation (at each epoch's end), whose CTC
loss per token is below --below x ln V, and that step's share of the run.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from asr.checkpoint import load_file  # noqa: E402
from asr.corpora import speed_perturb  # noqa: E402
from asr.fileio import atomic_open  # noqa: E402
from asr.manifest import read_manifest, write_manifest  # noqa: E402
from asr.train_log import read_records  # noqa: E402
from asr.train_setup import load_experiment_config  # noqa: E402

SYNTHESIZE = ROOT / "recipes" / "synth" / "local" / "synthesize.py"
FESTIVAL = ROOT / "recipes" / "synth" / "local" / "festival.py"
FLITE = ROOT / "recipes" / "synth" / "local" / "flite.py"
MBROLA = ROOT / "recipes" / "synth" / "local" / "mbrola.py"
PICO = ROOT / "recipes" / "synth" / "local" / "pico.py"
RHVOICE = ROOT / "recipes" / "synth" / "local" / "rhvoice.py"
HUMAN = ROOT / "recipes" / "synth" / "local" / "human.py"
# the other synthesizers, each option --NAME F [--NAME-pitch LO HI] [--NAME-add] [--NAME-voices V...], run in
# this order
ENGINES = {"flite": (FLITE, "Flite's voices"), "mbrola": (MBROLA, "MBROLA's voices"),
           "pico": (PICO, "SVOX Pico's voices"), "rhvoice": (RHVOICE, "RHVoice's voices")}
# the dev sets: the same held-out lines, one gap each (module docstring)
DEV_SETS = {"dev": "unseen accents", "dev_near": "unseen voices", "dev_synth": "unseen synthesizer"}
PREPARED = "prepared.json"  # what the tokenizer, CMVN statistics and features in a check's folder were made from


def run(cmd: list, log: Path, env: dict | None = None) -> None:
    """Run `cmd`, its output appended to `log`; exit with the log's tail when it fails."""
    with open(log, "a", encoding="utf-8") as f:
        f.write(f"$ {' '.join(map(str, cmd))}\n")
        f.flush()
        done = subprocess.run([str(c) for c in cmd], stdout=f, stderr=subprocess.STDOUT, env=env)
    if done.returncode:
        tail = log.read_text(encoding="utf-8", errors="replace").splitlines()[-15:]
        sys.exit(f"learning_check: {cmd[0]} {cmd[1] if len(cmd) > 1 else ''} failed (see {log}):\n" + "\n".join(tail))


def make_data(args: argparse.Namespace, data: Path, log: Path) -> Path:
    if args.data:
        folder = Path(args.data)
        for name in ("train.jsonl", "dev.jsonl"):
            if not (folder / name).is_file():
                sys.exit(f"learning_check: {folder / name}: no such manifest")
        if not any(getattr(args, name) for name in ENGINES) and not args.human:
            return folder
        if not (data / "train.jsonl").is_file():  # they rewrite train.jsonl: a copy, not the given folder
            linked_copy(folder, data)
        return with_flite(args, data, log)
    if (data / "train.jsonl").is_file() and (data / "dev.jsonl").is_file():
        if not (data / "dev_synth.jsonl").is_file() and not (data / "dev_synth.skipped").is_file():
            run([sys.executable, FESTIVAL, "dev-set", "--data", data], log)  # a folder made before it
        return with_flite(args, data, log)
    if not args.text:
        sys.exit("learning_check: give --text FILE (sentences to speak) or --data DIR (a corpus folder)")
    text = Path(args.text)
    lines = [line for line in text.read_text(encoding="utf-8").splitlines() if line.strip()]
    if args.ids:  # "103-1240-0001 THAT HAD ITS SOURCE ...": the id is not spoken
        text = data.parent / "text.txt"
        text.write_text("".join(line.split(maxsplit=1)[-1] + "\n" for line in lines), encoding="utf-8")
    num_train = args.num_train or max(len(lines) - args.num_dev, 1)
    run([sys.executable, SYNTHESIZE, "--out-dir", data, "--text", text, "--num-train", num_train,
         "--num-dev", args.num_dev, "--num-test", 0, "--seed", args.seed, "--jobs", args.jobs], log)
    run([sys.executable, FESTIVAL, "dev-set", "--data", data], log)  # exits 0 when it skips (said in the log)
    return with_flite(args, data, log)


def linked_copy(src: Path, dst: Path) -> None:
    """src (a file, or a tree) at dst, its files hard-linked (copied across file systems): what is
    rewritten later (train.jsonl, a FLAC) is replaced by a rename, never written through a link into src."""
    def link(a: str, b: str) -> None:
        try:
            os.link(a, b)
        except OSError:
            shutil.copy2(a, b)
    tmp = dst.with_name(f".{dst.name}.{os.getpid()}.tmp")
    if tmp.is_dir():
        shutil.rmtree(tmp)
    tmp.unlink(missing_ok=True)
    if src.is_dir():
        shutil.copytree(src, tmp, copy_function=link)
    else:
        link(str(src), str(tmp))
    if dst.is_dir():
        shutil.rmtree(dst)
    os.replace(tmp, dst)


def with_flite(args: argparse.Namespace, data: Path, log: Path) -> Path:
    """--flite F: that fraction of the training lines spoken again by Flite (kept when made before),
    with --flite-pitch LO HI at a pitch drawn per line, with --flite-add beside the eSpeak lines,
    with --flite-voices by those voices alone;
    then --mbrola F, --pico F and --rhvoice F (and their -pitch, -add; --mbrola-prosody) by those
    engines' voices; last,
    --human K: Asterisk's human prompts added K times."""
    for name, (script, _) in ENGINES.items():
        fraction, pitch, add, voices = (getattr(args, name + k) for k in ("", "_pitch", "_add", "_voices"))
        if fraction:
            prosody = getattr(args, "mbrola_prosody", "flite") if name == "mbrola" else None
            run([sys.executable, script, "train", "--data", data, "--fraction", fraction,
                 *(["--pitch", *pitch] if pitch else []), *(["--add"] if add else []),
                 *(["--voices", *voices] if voices else []), *(["--prosody", prosody] if prosody else []),
                 "--jobs", args.jobs], log)
    if args.human:
        run([sys.executable, HUMAN, "train", "--data", data, "--copies", args.human], log)
    return data


def dev_sets(corpus: Path) -> dict[str, Path | str]:
    """{set: its manifest, or why there is none} for DEV_SETS."""
    out: dict[str, Path | str] = {}
    for name in DEV_SETS:
        manifest, skipped = corpus / f"{name}.jsonl", corpus / f"{name}.skipped"
        if manifest.is_file() and manifest.stat().st_size:
            out[name] = manifest
        elif skipped.is_file():
            out[name] = "skipped: " + skipped.read_text(encoding="utf-8").strip()
        elif manifest.is_file():
            out[name] = f"empty ({manifest})"
        else:
            out[name] = f"not made ({corpus} has no {manifest.name})"
    return out


def training_manifest(corpus: Path, out: Path, speeds: list[float] | None) -> Path:
    """corpus/train.jsonl, or with the config's data.speed_perturb OUT/train_sp<speeds>.jsonl: it and
    a copy of every utterance at each speed (asr.corpora.speed_perturb; the trainer adds none again),
    so that the dumped features cover the copies."""
    train = corpus / "train.jsonl"
    if not speeds:
        return train
    path = out / f"train_sp{'_'.join(f'{s:g}' for s in speeds)}.jsonl"
    if not path.is_file():
        write_manifest(speed_perturb(read_manifest(train), speeds), path)  # audio paths absolute
    return path


def prepare(config, corpus: Path, train: Path, out: Path, log: Path,
            reuse: Path | None = None) -> tuple[Path, Path, Path | None]:
    """(tokenizer folder, CMVN file, features folder) for the config and the training manifest
    `train`, made once; the tokenizer learns corpus/train.jsonl's text. No features folder when
    the config adds noise or reverberation (data.augment.on_waves): those need the audio, so
    training computes every utterance's features from it, as the synth recipe does then.
    With `reuse`, another check's folder: its three, hard-linked, when its PREPARED file says
    they were made from the same corpus with the same settings (else made here, said in a line)."""
    t = config.tokenizer
    lang = out / (f"lang_{t.kind}" + ("" if t.kind == "char" else str(t.vocab_size)))
    n_mels = config.data.features.n_mels
    tag = "" if train.name == "train.jsonl" else "_" + train.stem.removeprefix("train_")
    cmvn, feats = out / f"cmvn{n_mels}{tag}.json", out / f"feats{n_mels}{tag}"
    dump = not config.data.augment.on_waves
    stamp = {"corpus": str(corpus.resolve()), "train": train.name, "tokenizer": asdict(t),
             "features": asdict(config.data.features), "features_dumped": dump}
    if reuse is not None and not cmvn.is_file():
        link_prepared(reuse, stamp, [lang, *([feats] if dump else []), cmvn])  # the CMVN file last: the rest is done
    if not (lang / "tokenizer.json").is_file():
        size = [] if t.kind == "char" else ["--vocab-size", t.vocab_size]
        run(["asr", "tokenizer", "--manifest", corpus / "train.jsonl", "--kind", t.kind, *size, "--out", lang], log)
    if not cmvn.is_file() or (dump and not feats.is_dir()):
        run(["asr", "cmvn", "--manifest", train, "--n-mels", n_mels, "--out", cmvn,
             *(["--dump-feats", feats] if dump else [])], log)
    out.mkdir(parents=True, exist_ok=True)
    with atomic_open(out / PREPARED) as f:
        f.write(json.dumps(stamp, indent=1) + "\n")
    return lang, cmvn, feats if dump else None


def link_prepared(reuse: Path, stamp: dict, paths: list[Path]) -> None:
    """Hard-link `paths` (by name) from the check folder `reuse` when its PREPARED file matches
    `stamp` (features dumped there too, if they are wanted here); else say in a line why not.
    What `reuse` lacks is left for the caller to make."""
    made = reuse / PREPARED
    theirs = json.loads(made.read_text()) if made.is_file() else None
    if theirs is None:
        why = f"it has no {PREPARED}"
    elif {**theirs, "features_dumped": stamp["features_dumped"]} != stamp:
        why = "another corpus, or other tokenizer or feature settings"
    elif stamp["features_dumped"] and not theirs["features_dumped"]:
        why = "no features dumped there"
    else:
        for path in paths:
            if not path.exists() and (reuse / path.name).exists():
                linked_copy(reuse / path.name, path)
        return
    print(f"learning_check: {reuse}'s tokenizer, CMVN and features not reused: {why}", flush=True)


def plateau_steps(records: list[dict], chance: float, below: float) -> dict:
    """The first training record and the first validation below `below` x chance (CTC per token)."""
    def first(kind: str) -> int | None:
        return next((r["step"] for r in records if r["kind"] == kind and r["ctc_loss"] < below * chance), None)
    return {"train": first("train"), "valid": first("valid")}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, type=Path, help="the check's folder (data, experiment, report)")
    p.add_argument("--text", help="sentences to speak, one per line")
    p.add_argument("--ids", action="store_true",
                   help="each line of --text starts with an utterance id, not spoken (LibriSpeech, Kaldi)")
    p.add_argument("--data", help="a corpus folder with train.jsonl and dev.jsonl instead of --text")
    p.add_argument("--num-dev", type=int, default=150, help="held-out sentences of --text for dev")
    p.add_argument("--num-train", type=int, default=0, help="training utterances (default: every other line once)")
    p.add_argument("--config", default=str(ROOT / "conf" / "small.yaml"))
    p.add_argument("--steps", type=int, default=6000, help="optimizer steps (the run's budget)")
    p.add_argument("--decode-config", default=str(ROOT / "conf" / "decode" / "small.yaml"))
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--below", type=float, default=0.5, help="off the plateau: CTC loss per token < this x ln V")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--jobs", type=int, default=2, help="synthesis processes")
    for name, (script, label) in ENGINES.items():
        p.add_argument(f"--{name}", type=float, default=0.0, metavar="F",
                       help=f"this fraction of the training lines spoken again by {label} "
                            f"(recipes/synth/local/{script.name}, as recipes/synth/run.sh --{name}); with "
                            "--data, in a hard-linked copy of that folder")
        p.add_argument(f"--{name}-pitch", type=float, nargs=2, metavar=("LO", "HI"),
                       help=f"with --{name}: each line at its voice's pitch times a factor drawn in [LO, HI] "
                            f"({script.name} train --pitch)")
        p.add_argument(f"--{name}-add", action="store_true",
                       help=f"with --{name}: those lines added beside the others, which all stay "
                            f"({script.name} train --add)")
        p.add_argument(f"--{name}-voices", nargs="+", metavar="VOICE",
                       help=f"with --{name}: those of its voices alone speak ({script.name} train --voices)")
    p.add_argument("--mbrola-prosody", choices=("flite", "espeak"), default="flite",
                   help="with --mbrola: who chooses its lines' phonemes, durations and intonation (mbrola.py "
                        "train --prosody; flite, the default: Flite's kal16; espeak: eSpeak NG)")
    p.add_argument("--human", type=int, default=0, metavar="K",
                   help="Asterisk's English prompts (one human speaker, ~26 min) added K times to the training "
                        "lines, after the other engines' (recipes/synth/local/human.py); with --data, in a "
                        "hard-linked copy of that folder")
    p.add_argument("--prepared-from", type=Path, metavar="DIR",
                   help="another check's folder (--out) whose tokenizer, CMVN statistics and dumped features "
                        "to hard-link, when its prepared.json says the same corpus and settings made them")
    p.add_argument("overrides", nargs="*", help="section.key=value for the config")
    args = p.parse_args(argv)
    for name in ENGINES:  # `--flite-voices kal16 training.seed=0`: a voice list takes what follows it
        voices = getattr(args, f"{name}_voices") or []
        cut = next((i for i, v in enumerate(voices) if "=" in v), len(voices))  # no voice has an "="
        if cut < len(voices):
            if not cut:
                p.error(f"--{name}-voices: no voice before {voices[0]}")
            setattr(args, f"{name}_voices", voices[:cut])
            args.overrides = [*voices[cut:], *args.overrides]
    return args


def main() -> None:
    args = parse_args()

    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    log = out / "learning_check.log"
    # the budget is the steps: as many epochs as they take (the schedule spans them)
    overrides = [*args.overrides, f"training.max_steps={args.steps}", "training.epochs=100000"]
    config = load_experiment_config(args.config, overrides)
    corpus = make_data(args, out / "data", log)
    train = training_manifest(corpus, out, config.data.speed_perturb)
    lang, cmvn, feats = prepare(config, corpus, train, out, log, args.prepared_from)
    exp = out / "exp"
    env = dict(os.environ, OMP_WAIT_POLICY=os.environ.get("OMP_WAIT_POLICY", "PASSIVE"))
    threads = max(1, len(os.sched_getaffinity(0)) // args.nproc)
    started = time.time()
    run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes", 1, "--nproc-per-node", args.nproc,
         "-m", "asr.cli", "train", "--config", args.config, "--train", train,
         "--valid", corpus / "dev.jsonl", "--exp-dir", exp, "--tokenizer", lang, "--cmvn", cmvn,
         *(["--feats", feats] if feats else []),
         f"training.num_threads={threads}", *overrides], log, env)
    train_seconds = time.time() - started
    run(["asr", "average", "--exp-dir", exp, "--by", "last", "--num", 5], log)
    sets = decode_dev_sets(exp / "model_avg.pt", corpus, out, args.decode_config, log)

    records = read_records(exp / "metrics.jsonl")
    chance = math.log(load_file(exp / "model_last.pt")["model"]["vocab_size"])  # ln V
    plateau = plateau_steps(records, chance, args.below)
    valid = [r for r in records if r["kind"] == "valid"]
    report = {
        "config": args.config, "overrides": args.overrides, "decode_config": args.decode_config,
        "corpus": str(corpus), "train": str(train), "steps": args.steps,
        "train_minutes": round(train_seconds / 60, 1), "chance": chance, "below": args.below,
        "plateau_left_at": plateau, "warnings": [r for r in records if r["kind"] == "warning"],
        "dev": {k: sets["dev"][k] for k in ("cer", "wer", "utterances")}, "dev_sets": sets,
        "valid": [{k: r[k] for k in ("step", "ctc_loss", "att_loss", "accuracy") if k in r} for r in valid],
    }
    (out / "learning_check.json").write_text(json.dumps(report, indent=1) + "\n")
    print_report(report, args.nproc, out / "learning_check.json")


def decode_dev_sets(model: Path, corpus: Path, out: Path, decode_config: str, log: Path) -> dict[str, dict]:
    """Each dev set decoded into OUT/decode_<name>: its manifest, CER, WER and utterances, or why it is missing."""
    sets: dict[str, dict] = {}
    for name, manifest in dev_sets(corpus).items():
        if isinstance(manifest, str):
            sets[name] = {"missing": manifest}
            continue
        decoded = out / f"decode_{name}"
        run(["asr", "decode", "--model", model, "--manifest", manifest, "--out-dir", decoded,
             "--config", decode_config], log)
        scores = json.loads((decoded / "wer.json").read_text())
        sets[name] = {"manifest": str(manifest), **{k: scores[k] for k in ("cer", "wer", "utterances")}}
    return sets


def print_report(report: dict, nproc: int, path: Path) -> None:
    """The check's table on stdout (`path`: where the report was written)."""
    plateau, below, steps = report["plateau_left_at"], report["below"], report["steps"]

    def share(step: int | None) -> str:
        return "never" if step is None else f"step {step} ({100 * step / steps:.0f}%)"

    print(f"\n{'check':<42} {'value'}")
    print(f"{'config':<42} {Path(report['config']).name} {' '.join(report['overrides'])}")
    print(f"{'training':<42} {steps} steps, {report['train_minutes']} min, {nproc} process(es)")
    print(f"{'CTC < ' + f'{below:g} ln V, train':<42} {share(plateau['train'])}")
    print(f"{'CTC < ' + f'{below:g} ln V, dev':<42} {share(plateau['valid'])}")
    print(f"{'plateau warning':<42} {'yes' if report['warnings'] else 'no'}")
    for name, what in DEV_SETS.items():
        r = report["dev_sets"][name]
        value = f"{100 * r['cer']:.1f}% / {100 * r['wer']:.1f}%" if "wer" in r else r["missing"]
        print(f"{name + ' (' + what + ') CER / WER':<42} {value}")
    print(f"report: {path}")


if __name__ == "__main__":
    main()
