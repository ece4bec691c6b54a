"""Where our beam search spends its time, on the peer benchmark's decoding workload: the share of
each of our functions (py-spy samples) and of each torch operator (torch.profiler).

    PY=~/.cache/asr-bench-peers/venv/bin/python
    $PY tools/bench_peers/profile_ours.py                  # beam 10 + CTC 0.3, batch 32 and batch 1
    $PY tools/bench_peers/profile_ours.py --ctc-weight 0 --batches 32 --no-py-spy

- functions: py-spy samples the decoding (encoder included) of a separate process running this
  script with --worker; `total` is the share of samples with the function anywhere on the stack,
  `self` the share where it is the innermost function of asr/ (its own lines and the torch
  calls it makes directly). Only samples inside the timed decode count.
- operators: torch.profiler's self CPU time of each aten operator over one decode, as a share
  of all operators' self time.
Prints both tables for each batch size and writes JSON (--out).
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

from report import write_json

ROOT = Path(__file__).resolve().parents[2]
MARK = "_timed_decode"  # the function whose samples count


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", default="32,1", help="batch sizes to profile (default 32,1)")
    p.add_argument("--utts", type=int, default=32, help="utterances of the batched run (default 32)")
    p.add_argument("--alone", type=int, default=4, help="utterances decoded one at a time for batch 1 (default 4)")
    p.add_argument("--seconds", type=float, nargs=2, default=(2.0, 4.0), metavar=("MIN", "MAX"),
                   help="utterance durations, uniform (default 2 4, as bench.py)")
    p.add_argument("--beam", type=int, default=10)
    p.add_argument("--ctc-weight", type=float, default=0.3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--top", type=int, default=15, help="rows per table (default 15)")
    p.add_argument("--rate", type=int, default=100, help="py-spy samples per second (default 100)")
    p.add_argument("--no-py-spy", action="store_true", help="operators only")
    p.add_argument("--worker", type=int, default=0, help=argparse.SUPPRESS)  # batch size, under py-spy
    p.add_argument("--out", type=Path, default=ROOT / "exp/profile_ours.json")
    return p.parse_args(argv)


def inputs(args: argparse.Namespace, batch: int) -> list:
    """The batches decoded for `batch`: all --utts at once, or --alone of them one by one."""
    import workload

    utts = workload.decode_utterances(args.utts, tuple(args.seconds))
    return [utts] if batch > 1 else [utts.subset(i, i + 1) for i in range(args.alone)]


def _decode(kit, batches: list, args: argparse.Namespace) -> None:
    for utts in batches:
        kit.decode(utts, beam_size=args.beam, ctc_weight=args.ctc_weight)


def _timed_decode(kit, batches: list, args: argparse.Namespace) -> None:
    """_decode under its own name: the py-spy samples that count are those below it."""
    _decode(kit, batches, args)


def prepared(args: argparse.Namespace, batch: int) -> tuple:
    """Our adapter, warmed up on the batches of `batch`."""
    import torch
    from ours import Ours

    torch.set_num_threads(args.threads)
    kit, batches = Ours(), inputs(args, batch)
    _decode(kit, batches[:1], args)  # warm-up
    return kit, batches


def operators(args: argparse.Namespace, batch: int) -> list[dict]:
    """Top aten operators by self CPU time over one decode of `batch`, with their shares."""
    from torch.profiler import ProfilerActivity, profile

    kit, batches = prepared(args, batch)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        _timed_decode(kit, batches, args)
    events = [e for e in prof.key_averages() if e.key.startswith("aten::")]
    total = sum(e.self_cpu_time_total for e in events)
    events.sort(key=lambda e: e.self_cpu_time_total, reverse=True)
    return [{"op": e.key, "self_share": round(e.self_cpu_time_total / total, 4), "calls": e.count,
             "self_ms": round(e.self_cpu_time_total / 1000, 1)} for e in events[:args.top]]


def functions(args: argparse.Namespace, batch: int) -> list[dict]:
    """Our functions' shares of py-spy samples over the decode of `batch` (in a child process)."""
    spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    with tempfile.TemporaryDirectory() as tmp:
        raw = Path(tmp) / "stacks.txt"
        here = [sys.executable, __file__, "--worker", str(batch), "--utts", str(args.utts), "--alone", str(args.alone),
                "--seconds", *map(str, args.seconds), "--beam", str(args.beam), "--ctc-weight", str(args.ctc_weight),
                "--threads", str(args.threads)]
        subprocess.run([spy, "record", "--rate", str(args.rate), "--format", "raw", "--output", str(raw), "--", *here],
                       check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        return shares(raw.read_text().splitlines(), args.top)


def shares(lines: list[str], top: int) -> list[dict]:
    """Aggregate py-spy raw stacks ("frame;frame;... count", outermost first; a frame is
    "function (path:line)") into total / self shares of the functions of asr/, over the samples
    whose stack holds MARK."""
    total, inclusive, own = 0, Counter(), Counter()
    for line in lines:
        stack, _, count = line.rpartition(" ")
        frames = [_function(f) for f in stack.split(";")]
        if not any(name.startswith(MARK) for name in frames):
            continue
        total += int(count)
        ours = [name for name in frames if " (asr/" in name]
        for name in set(ours):
            inclusive[name] += int(count)
        if ours:
            own[ours[-1]] += int(count)
    rows = [{"function": name, "total_share": round(n / total, 4), "self_share": round(own[name] / total, 4)}
            for name, n in inclusive.most_common(top)]
    return rows


def _function(frame: str) -> str:
    """'step (/home/user/asr/model/decoder.py:123)' or 'step (asr/model/decoder.py:123)' ->
    'step (asr/model/decoder.py)'; other files by their base name."""
    name, _, where = frame.partition(" (")
    path = "/" + where.rsplit(":", 1)[0]
    inside = path.rfind("/asr/")
    return f"{name} ({path[inside + 1:] if inside >= 0 else os.path.basename(path)})"


def print_tables(batch: int, ops: list[dict], funcs: list[dict] | None) -> None:
    print(f"\n== batch {batch}: torch operators, share of self CPU time")
    for r in ops:
        print(f"{r['self_share']:7.1%}  {r['calls']:8d} calls  {r['op']}")
    if funcs is not None:
        print(f"\n== batch {batch}: our functions, share of py-spy samples "
              "(total: on the stack; self: the innermost function of asr/)")
        for r in funcs:
            print(f"{r['total_share']:7.1%} total {r['self_share']:7.1%} self  {r['function']}")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as bench.py: before torch is imported
    if args.worker:
        kit, batches = prepared(args, args.worker)
        _timed_decode(kit, batches, args)
        return
    result = {"workload": {k: v for k, v in vars(args).items() if k not in ("out", "worker")}, "batches": {}}
    for batch in (int(b) for b in args.batches.split(",")):
        ops = operators(args, batch)
        funcs = None if args.no_py_spy else functions(args, batch)
        print_tables(batch, ops, funcs)
        result["batches"][str(batch)] = {"operators": ops, "functions": funcs}
    write_json(args.out, result)
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
