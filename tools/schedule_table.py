"""The learning-rate schedule of a training config on 1 to 64 GPUs, on paper: optimizer steps per
epoch and in all, the share of them in warmup, and the peak learning rate reached, for each number
of processes. The epoch is the sampler's own cut (DurationBucketSampler of the config's batch
plan) of LibriSpeech-like durations (tools/bench_data.py) adding up to the corpus's hours.

    python tools/schedule_table.py [--config conf/librispeech_100h.yaml:302 ...] [--gpus 1 4 8 64]
        [--set training.accum_grad=2 ...] [--out FILE]

`--config PATH:HOURS`: the config and the hours of audio one epoch holds (speed-perturbed copies
included: LibriSpeech 100 h x 3 = 302); `--set` overrides every config (e.g. to see an older one).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_data import librispeech_durations

from asr.sampler import DurationBucketSampler
from asr.train_config import learning_rate, total_steps
from asr.train_setup import batch_plan, load_experiment_config

DEFAULT = ["conf/librispeech_100h.yaml:302", "conf/librispeech_960h.yaml:2883"]


def schedule(config_path: str, hours: float, gpus: list[int], overrides: list[str]) -> list[dict]:
    config = load_experiment_config(config_path, overrides)
    mean = float(librispeech_durations(10000, seed=5).mean())
    durations = librispeech_durations(int(hours * 3600 / mean), seed=5)
    tc, rows = config.training, []
    for w in gpus:
        plan = batch_plan(config, w)
        sampler = DurationBucketSampler(durations, max_batch_seconds=plan.micro_batch, seed=tc.seed,
                                        num_replicas=w, rank=0, num_buckets=config.data.num_buckets, group=plan.group)
        per_epoch = sampler.epoch_batches() // plan.group
        total = total_steps(tc, per_epoch)
        peak = max(learning_rate(tc, s, total) for s in range(0, total, max(1, total // 2000)))
        rows.append({"config": config_path, "gpus": w, "accum": plan.accum, "micro_batch_s": plan.micro_batch,
                     "step_s": plan.step_size, "steps_per_epoch": per_epoch, "steps": total,
                     "warmup_share": min(1.0, tc.warmup_steps / total), "peak_lr": peak, "lr": tc.lr})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", nargs="+", default=DEFAULT, metavar="PATH:HOURS")
    parser.add_argument("--gpus", nargs="+", type=int, default=[1, 4, 8, 64])
    parser.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE")
    parser.add_argument("--out", help="write the rows as JSON here")
    args = parser.parse_args()
    rows = []
    for item in args.config:
        path, _, hours = item.rpartition(":")
        rows += schedule(path, float(hours), args.gpus, args.set)
    print(f"{'config':32} {'GPUs':>4} {'accum':>5} {'step s':>7} {'steps/epoch':>11} {'steps':>7} "
          f"{'warmup':>7} {'peak lr':>9}")
    for r in rows:
        print(f"{r['config']:32} {r['gpus']:4d} {r['accum']:5d} {r['step_s']:7.0f} {r['steps_per_epoch']:11d} "
              f"{r['steps']:7d} {r['warmup_share']:7.1%} {r['peak_lr']:9.2e}")
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
