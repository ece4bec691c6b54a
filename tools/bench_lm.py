"""What a word n-gram LM costs (`asr.lm`): training, writing and reading its ARPA file, its memory,
and scoring sentences as the n-best rescoring does. Prints a table, writes JSON.

    python tools/bench_lm.py                                 # 300,000 sentences -> exp/bench_lm.json
    python tools/bench_lm.py --sentences 50000 --order 4 --out /tmp/lm.json

The text is invented: sentences of 4-16 words drawn from a Zipf distribution (exponent 1.1) over
an invented vocabulary of `--vocab` words (tools/bench_train.py's make_lexicon), so the n-gram
counts grow as a real corpus's do. Scoring runs over `--score` sentences of the same kind, each
new to the LM's cache (its memo of (context, word) lookups is cleared first), as 20-best lists of
one utterance are.
"""
from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_train import make_lexicon  # this script's folder

from asr.lm import NgramLM, train_ngram


def sentences(words: list[str], count: int, seed: int) -> list[list[str]]:
    rng = np.random.default_rng(seed)
    ranks = np.arange(1, len(words) + 1)
    p = ranks ** -1.1
    p /= p.sum()
    lengths = rng.integers(4, 17, size=count)
    drawn = rng.choice(len(words), size=int(lengths.sum()), p=p)
    out, at = [], 0
    for n in lengths:
        out.append([words[i] for i in drawn[at:at + n]])
        at += n
    return out


def rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def read_in_a_new_process(path: Path) -> tuple[float, float]:
    """(seconds, peak RSS growth in MB) of NgramLM.load(path) in a fresh interpreter."""
    # VmHWM, not ru_maxrss: a child's ru_maxrss starts at its parent's peak when forked
    code = """if True:
        import sys, time
        from asr.lm import NgramLM
        def hwm():
            return next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmHWM"))
        before = hwm()
        t = time.perf_counter()
        NgramLM.load(sys.argv[1])
        print(time.perf_counter() - t, (hwm() - before) / 1024)
    """
    out = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, check=True)
    seconds, mb = out.stdout.split()
    return float(seconds), float(mb)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sentences", type=int, default=300_000)
    parser.add_argument("--vocab", type=int, default=20_000)
    parser.add_argument("--order", type=int, default=3)
    parser.add_argument("--score", type=int, default=20_000, help="sentences scored")
    parser.add_argument("--out", default="exp/bench_lm.json")
    args = parser.parse_args()

    words = make_lexicon(np.random.default_rng(0), args.vocab)
    text = sentences(words, args.sentences, seed=1)
    start_rss = rss_mb()  # the peak so far
    t = time.perf_counter()
    lm = train_ngram(text, args.order)
    train_s = time.perf_counter() - t
    ngrams = sum(len(p) for p in lm.probs)
    training_rss = rss_mb() - start_rss
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "lm.arpa"
        t = time.perf_counter()
        lm.save(path)
        save_s = time.perf_counter() - t
        size_mb = path.stat().st_size / 2**20
        del lm
        load_s, load_rss = read_in_a_new_process(path)
        lm = NgramLM.load(path)
    probe = sentences(words, args.score, seed=2)
    lm._cache.clear()
    t = time.perf_counter()
    for s in probe:
        lm.score(s)
    score_s = time.perf_counter() - t
    result = {
        "sentences": args.sentences, "words": sum(len(s) for s in text), "vocab": lm.vocab_size,
        "order": args.order, "ngrams": ngrams, "arpa_mb": round(size_mb, 1),
        "train_s": round(train_s, 2), "save_s": round(save_s, 2), "load_s": round(load_s, 2),
        "load_ngrams_per_s": round(ngrams / load_s), "peak_rss_mb_training": round(training_rss),
        "peak_rss_mb_growth_loading": round(load_rss),
        "score_sentences_per_s": round(args.score / score_s),
    }
    rows = [("training text", f"{result['sentences']:,} sentences, {result['words']:,} words, "
                              f"{result['vocab']:,} distinct"),
            ("n-grams (order " + str(args.order) + ")", f"{ngrams:,} ({size_mb:.1f} MB of ARPA)"),
            ("train / write / read", f"{train_s:.1f} s / {save_s:.1f} s / {load_s:.1f} s "
                                     f"({result['load_ngrams_per_s']:,} n-grams/s read)"),
            ("peak RSS growth: training / reading (a new process)", f"{result['peak_rss_mb_training']:,} MB / "
                                                    f"{result['peak_rss_mb_growth_loading']:,} MB"),
            ("scoring (cache cleared)", f"{result['score_sentences_per_s']:,} sentences/s")]
    width = max(len(r[0]) for r in rows)
    for name, value in rows:
        print(f"{name:<{width}}  {value}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"-> {args.out}")


if __name__ == "__main__":
    main()
