"""Print the parameter counts of the model of each config file.

    python tools/count_params.py                          # every conf/*.yaml, V = 31 and 300
    python tools/count_params.py conf/synth.yaml --vocab-size 31

V is the tokenizer's vocabulary incl. blank, unk and sos/eos: 31 = characters (26 letters,
apostrophe, space + 3); 300 = the BPE size of the ESPnet / WeNet LibriSpeech-100h baseline.
Models are built on the meta device: no memory, no time.
"""
from __future__ import annotations

import argparse
from pathlib import Path

import torch
import yaml

from asr.config import from_dict
from asr.model import ModelConfig, build_model, count_parameters

ROOT = Path(__file__).resolve().parents[1]


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("configs", nargs="*", type=Path, help="YAML files (default: conf/*.yaml)")
    parser.add_argument("--vocab-size", type=int, action="append", help="V to count at (repeatable; default 31, 300)")
    args = parser.parse_args()
    paths = args.configs or sorted((ROOT / "conf").glob("*.yaml"))
    columns = ["subsampling", "encoder", "decoder", "ctc", "enc+dec", "total"]
    print(f"{'config':<24}{'V':>6}" + "".join(f"{c:>13}" for c in columns))
    for path in paths:
        config = from_dict(ModelConfig, yaml.safe_load(path.read_text())["model"], source=str(path), prefix="model.")
        for vocab in args.vocab_size or [31, 300]:
            row = counts(config, vocab)
            print(f"{path.name:<24}{vocab:>6}" + "".join(f"{row[c] / 1e6:>12.3f}M" for c in columns))


if __name__ == "__main__":
    main()
