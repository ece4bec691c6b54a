"""Print what the data stages of run.sh need from a training config, after overrides.

    python local/config_info.py CONF.yaml [section.key=value ...]   ->  "bpe 5000 80"

Three words: tokenizer kind, vocabulary size ("-" for characters), mel bins. A config error is
one line on stderr and exit status 1.
"""
from __future__ import annotations

import sys

from asr.train_setup import load_experiment_config


def main(argv: list[str]) -> int:
    if not argv:
        print("usage: config_info.py CONF.yaml [section.key=value ...]", file=sys.stderr)
        return 2
    try:
        config = load_experiment_config(argv[0], argv[1:])
    except (OSError, ValueError) as e:
        print(f"config_info.py: error: {str(e).strip().splitlines()[0]}", file=sys.stderr)
        return 1
    tokenizer = config.tokenizer
    vocab = tokenizer.vocab_size if tokenizer.kind != "char" else "-"
    print(tokenizer.kind, vocab, config.model.n_mels)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
