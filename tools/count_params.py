"""Print the parameter counts of the model of each config file; with --espnet, beside ESPnet's.

    python tools/count_params.py                          # every conf/*.yaml, V = 31 and 300
    python tools/count_params.py conf/synth.yaml --vocab-size 31
    python tools/count_params.py --espnet ~/.cache/asr-espnet-count/venv/bin/python --out exp/count_params.json

V is the tokenizer's vocabulary incl. blank, unk and sos/eos: 31 = characters (26 letters,
apostrophe, space + 3); 300 = the BPE size of the ESPnet / WeNet LibriSpeech-100h baseline.
Models are built on the meta device: no memory, no time.

--espnet PYTHON: a Python with espnet installed (see tools/bench_peers/espnet_params.py) counts
ESPnet's models of the recipes our configs follow (tools/bench_peers/espnet_params.py RECIPES),
at each config's own V (its sentencepiece size + 2) unless --vocab-size is given; the table puts
ours and ESPnet's side by side with the difference, and --out writes it all as JSON.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import yaml

from asr.config import from_dict
from asr.model import ModelConfig, build_model, count_parameters

ROOT = Path(__file__).resolve().parents[1]
COLUMNS = ["subsampling", "encoder", "decoder", "ctc", "enc+dec", "total"]
ESPNET_SCRIPT = ROOT / "tools" / "bench_peers" / "espnet_params.py"


def counts(config: ModelConfig, vocab_size: int) -> dict[str, int]:
    """Parameters of the parts of the model of `config` at vocabulary `vocab_size`."""
    with torch.device("meta"):
        model = build_model(config, vocab_size=vocab_size)
    parts = {
        "subsampling": count_parameters(model.encoder.subsampling),
        "encoder": count_parameters(model.encoder),
        "decoder": count_parameters(model.decoder),
        "ctc": count_parameters(model.ctc),
    }
    return {**parts, "enc+dec": parts["encoder"] + parts["decoder"], "total": count_parameters(model)}


def read_config(path: Path) -> tuple[ModelConfig, int | None]:
    """The model config of a YAML file, and the V of its sentencepiece tokenizer (None: characters)."""
    data = yaml.safe_load(path.read_text())
    config = from_dict(ModelConfig, data["model"], source=str(path), prefix="model.")
    tokenizer = data.get("tokenizer") or {}
    size = tokenizer.get("vocab_size") if tokenizer.get("kind") in ("bpe", "unigram") else None
    return config, None if size is None else size + 2  # + blank and sos/eos (its <unk> is a piece)


def espnet_counts(python: str, vocab_size: int) -> dict:
    """tools/bench_peers/espnet_params.py's JSON at `vocab_size`, run by `python`."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "espnet.json"
        run = subprocess.run([python, str(ESPNET_SCRIPT), "--vocab-size", str(vocab_size), "--out", str(out)],
                             capture_output=True, text=True)
        if run.returncode != 0:
            sys.exit(f"{ESPNET_SCRIPT.name} failed under {python}: {run.stderr.strip().splitlines()[-1:]}")
        return json.loads(out.read_text())


def print_counts(paths: list[Path], vocab_sizes: list[int]) -> None:
    print(f"{'config':<32}{'V':>6}" + "".join(f"{c:>13}" for c in COLUMNS))
    for path in paths:
        config, _ = read_config(path)
        for vocab in vocab_sizes:
            row = counts(config, vocab)
            print(f"{path.name:<32}{vocab:>6}" + "".join(f"{row[c] / 1e6:>12.3f}M" for c in COLUMNS))


def compare_with_espnet(paths: list[Path], python: str, vocab_sizes: list[int] | None) -> list[dict]:
    """Rows of ours vs ESPnet's counts for the configs that follow an ESPnet recipe; printed as a table."""
    names = {p.name: p for p in paths}
    rows, cache = [], {}
    print(f"{'config':<32}{'V':>6}{'toolkit':>9}" + "".join(f"{c:>13}" for c in COLUMNS))
    for path in names.values():
        config, own_vocab = read_config(path)
        for vocab in vocab_sizes or [own_vocab or 300]:
            if vocab not in cache:
                cache[vocab] = espnet_counts(python, vocab)
            theirs = cache[vocab]["configs"].get(path.name)
            if theirs is None:
                continue
            ours = counts(config, vocab)
            diff = {c: (ours[c] - theirs[c]) / theirs[c] for c in COLUMNS}
            rows.append({"config": path.name, "vocab_size": vocab, "recipe": theirs["recipe"], "ours": ours,
                         "espnet": {c: theirs[c] for c in COLUMNS}, "relative_difference": diff,
                         "espnet_version": cache[vocab]["espnet"], "espnet_torch": cache[vocab]["torch"]})
            for name, row in (("ours", ours), ("espnet", theirs)):
                print(f"{path.name:<32}{vocab:>6}{name:>9}" + "".join(f"{row[c]:>13,}" for c in COLUMNS))
            print(f"{'':<32}{'':>6}{'diff':>9}" + "".join(f"{diff[c]:>+13.3%}" for c in COLUMNS))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("configs", nargs="*", type=Path, help="YAML files (default: conf/*.yaml)")
    parser.add_argument("--vocab-size", type=int, action="append", help="V to count at (repeatable; default 31, 300)")
    parser.add_argument("--espnet", metavar="PYTHON", help="compare with ESPnet, counted by this Python")
    parser.add_argument("--out", type=Path, help="write the counts as JSON")
    args = parser.parse_args()
    paths = args.configs or sorted((ROOT / "conf").glob("*.yaml"))
    if args.espnet:
        rows = compare_with_espnet(paths, args.espnet, args.vocab_size)
    else:
        print_counts(paths, args.vocab_size or [31, 300])
        rows = [{"config": p.name, "vocab_size": v, "ours": counts(read_config(p)[0], v)}
                for p in paths for v in args.vocab_size or [31, 300]] if args.out else []
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
