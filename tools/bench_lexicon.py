"""The lexicon constraint's cost per search step (`asr.lexicon.Lexicon.allowed`) at a
LibriSpeech-sized word list, against the plain lookup it replaced. Prints a table, writes JSON.

    python tools/bench_lexicon.py                    # 94,000 words, BPE 5000 -> exp/bench_lexicon.json
    python tools/bench_lexicon.py --words 20000 --vocab 1000 --rows 20,640 --out /tmp/lex.json

The word list is invented (tools/bench_train.py's make_lexicon: 1-3 syllable words), and the BPE
tokenizer is trained on Zipf-distributed sentences of it plus every word once, so that its pieces
split the words as sentencepiece splits a real vocabulary. The states are those a search meets:
every state on the way while spelling 2,000 random words with the tokenizer's own pieces, each
step's `--rows` drawn from them at random. Each time is the median of `--steps` calls after 3
warm-up calls, on `--threads` threads.

- allowed_ms: `Lexicon.allowed` as it is: a gather of each state's transitions (a run of the sorted
  keys), dense rows for the few states with many.
- lookup_ms: the earlier lookup, kept here as the reference: a binary search of every (state,
  token) pair in the sorted keys, O(R * V log E). Both must give the same masks (checked).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_train import make_lexicon  # this script's folder

from asr.lexicon import Lexicon
from asr.tokenizer import train_tokenizer


def lookup(lexicon: Lexicon, states: torch.Tensor) -> torch.Tensor:
    """The reference: (R, V) bool by binary search of every (state, token) key."""
    v = lexicon.vocab_size
    tokens = torch.arange(v, device=states.device)
    keys = states[:, None] * v + tokens
    at = torch.searchsorted(lexicon._keys, keys).clamp(max=lexicon._keys.numel() - 1)
    found = lexicon._keys[at] == keys
    begins = lexicon._starts & lexicon._may_end[states][:, None]
    allowed = found | begins
    allowed[:, lexicon.eos] = lexicon._may_end[states]
    return allowed


def visited_states(lexicon: Lexicon, tokenizer, words: list[str]) -> torch.Tensor:
    """Every state met while spelling `words` (a space-led first piece each) from the start."""
    out = [0]
    for word in words:
        state = torch.zeros(1, dtype=torch.long)
        for token in tokenizer.encode(word):
            state = lexicon.advance(state, torch.tensor([token]))
            if int(state) < 0:
                break
            out.append(int(state))
    return torch.tensor(out)


def median_ms(fn, steps: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--words", type=int, default=94000)
    parser.add_argument("--vocab", type=int, default=5000, help="BPE pieces")
    parser.add_argument("--rows", default="20,640", help="hypotheses per step (utterances x beam), comma-separated")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("exp/bench_lexicon.json"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rng = np.random.default_rng(args.seed)

    words = make_lexicon(rng, args.words)
    zipf = 1.0 / np.arange(1, len(words) + 1)
    zipf /= zipf.sum()
    texts = [" ".join(rng.choice(words, size=20, p=zipf)) for _ in range(20000)]
    texts += [" ".join(words[i:i + 20]) for i in range(0, len(words), 20)]
    tokenizer = train_tokenizer(texts, "bpe", args.vocab)
    pieces: list[str | None] = [None] * tokenizer.vocab_size
    for t in range(2, tokenizer.vocab_size - 1):
        pieces[t] = tokenizer.piece(t)
    start = time.perf_counter()
    lexicon = Lexicon(words, pieces, eos=tokenizer.eos)
    compile_s = time.perf_counter() - start
    dense_mb = lexicon._dense.numel() / 2**20
    print(f"{lexicon.num_words} words, {tokenizer.vocab_size} tokens: {lexicon._keys.numel()} transitions, "
          f"compiled in {compile_s:.1f} s; {lexicon._dense.size(0) - 1} dense rows ({dense_mb:.1f} MB), "
          f"at most {lexicon._width} gathered keys per row")

    pool = visited_states(lexicon, tokenizer, list(rng.choice(words, size=2000)))
    rows = []
    for r in (int(x) for x in args.rows.split(",")):
        states = pool[torch.from_numpy(rng.integers(0, len(pool), size=r))]
        if not torch.equal(lexicon.allowed(states), lookup(lexicon, states)):
            raise SystemExit(f"rows {r}: Lexicon.allowed differs from the reference lookup")
        new = median_ms(lambda s=states: lexicon.allowed(s), args.steps)
        old = median_ms(lambda s=states: lookup(lexicon, s), args.steps)
        rows.append({"rows": r, "allowed_ms": round(new, 3), "lookup_ms": round(old, 3),
                     "speedup": round(old / new, 1)})

    keys = ["rows", "allowed_ms", "lookup_ms", "speedup"]
    print(" | ".join(keys))
    for row in rows:
        print(" | ".join(str(row[k]) for k in keys))
    result = {"words": lexicon.num_words, "vocab": tokenizer.vocab_size, "transitions": lexicon._keys.numel(),
              "compile_s": round(compile_s, 2), "dense_rows": lexicon._dense.size(0) - 1,
              "dense_mb": round(dense_mb, 2), "width": lexicon._width, "threads": args.threads, "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
