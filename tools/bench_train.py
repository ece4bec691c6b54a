"""Benchmark training on this CPU: throughput of the whole training step, padding and peak memory.
Prints a table, writes JSON.

    python tools/bench_train.py                       # synth + librispeech_100h: about 2 minutes on 2 idle cores
    python tools/bench_train.py --configs conf/synth.yaml --steps 20 --workdir /tmp/bt --out exp/bench_synth.json

For each config the real trainer (`asr.train_asr.train`) runs in a fresh process (so that its peak
memory is its own) on a synthetic corpus, with these overrides: training.max_steps = warmup +
steps, no global batch and accum_grad 1 (one batch per optimizer step), no greedy decoding, no mid-epoch checkpoint,
a metrics.jsonl record every step, and data.max_batch_seconds = --batch-seconds (default 100: the
configs' caps, 240 s for synth and 600 s per GPU with accumulation 2 for LibriSpeech, would make
a CPU step take a minute or more, and a CPU's cost per audio second hardly depends on the cap
above 100 s). Everything else
is the config's: its tokenizer, the trainer's loader (data.num_workers worker processes doing FLAC
decoding, fbank with dither, CMVN and SpecAugment), torch's default threads, fp32 on the CPU.

- audio s/s: audio seconds of the timed steps over their wall time. Each step's time comes from
  its metrics.jsonl record (audio_s_per_s is measured from the end of the previous step, so data
  waits count). The first `--warmup` steps (worker start-up, allocator warm-up) are left out.
- padded s/s: the same with padded seconds (utterances x longest): the compute rate, which
  carries over to a corpus that pads differently.
- best step: the highest audio s/s of a single timed step (the least disturbed by other processes).
- padding: padded frames / all frames of the timed batches; the batches are read again through
  `make_loader` with the trainer's seed (the loader is deterministic given seed and epoch).
- cores, load: CPU seconds of the training process (all its threads, workers not included) per
  wall second of the timed steps (sampled every 0.2 s), and the 1-minute load average before and
  after train(). The figures are steady-state only on an otherwise idle machine: a process that
  takes one of two cores slows the step's OpenMP regions by far more than its share, so a
  warning follows the table when the training process got under 80% of its threads.
- memory: peak RSS of the training process (getrusage, the kernel's high-water mark) and peak PSS
  of the training process plus its loader workers (sampled from /proc every 0.2 s; PSS splits
  shared pages between the processes, so the sum is the real footprint).

Corpus: a few 40 s FLAC files of speech-like noise and a manifest of `--utterances` segments of
them with LibriSpeech-like durations (tools/bench_data.py: gamma, mean 12 s, 1-35 s) and
pseudo-English text (a Zipf-distributed lexicon of invented words, 2.7 words and about 15.5
characters per second, spaces included). There are enough utterances for the duration-bucketing
sampler to batch as it does on LibriSpeech (30 buckets), and only the batches trained on are
decoded. CMVN statistics come from the source files. (The lexicon is small: BPE 5000 makes about one token per word, 2.7
per second, where LibriSpeech's splits its rarer words; the decoder is a small share of the work.)
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from itertools import islice
from pathlib import Path

import numpy as np
import torch
from bench_data import librispeech_durations, write_flacs

from asr.features import FeatureConfig
from asr.loader import compute_cmvn, make_loader
from asr.manifest import Utterance, read_manifest, write_manifest
from asr.tokenizer import load_tokenizer
from asr.train_asr import train
from asr.train_setup import ExperimentConfig, load_experiment_config

ROOT = Path(__file__).resolve().parents[1]
SOURCE_SECONDS = 40.0  # length of each source FLAC: longer than any segment (35 s)
WORDS_PER_SECOND = 2.7  # LibriSpeech's speaking rate
LEXICON_SIZE = 2000


# ---------------------------------------------------------------------------------------------
# the synthetic corpus


def make_lexicon(rng: np.random.Generator, size: int) -> list[str]:
    """`size` distinct invented words of 1-3 syllables."""
    onsets = "B C D F G H K L M N P R S T V W Y BR CH SH ST TH TR".split()
    vowels = "A E I O U A E I O U EA OU AI".split()
    codas = ["", "", "", "", "N", "R", "S", "T", "L", "ND", "NG"]
    words: set[str] = set()
    while len(words) < size:
        syllables = rng.choice([1, 2, 3], p=[0.75, 0.20, 0.05])
        words.add("".join(rng.choice(onsets) + rng.choice(vowels) + rng.choice(codas) for _ in range(syllables)))
    return sorted(words)


def make_texts(durations: np.ndarray, lexicon: list[str], rng: np.random.Generator) -> list[str]:
    """One sentence per duration (seconds): WORDS_PER_SECOND words drawn with Zipf frequencies."""
    zipf = 1.0 / np.arange(1, len(lexicon) + 1)
    zipf /= zipf.sum()
    counts = np.maximum(1, np.round(durations * WORDS_PER_SECOND)).astype(int)
    return [" ".join(rng.choice(lexicon, size=n, p=zipf)) for n in counts]


def segments(sources: list[Utterance], durations: np.ndarray, texts: list[str],
             rng: np.random.Generator) -> list[Utterance]:
    """Utterances cut at random offsets from random source files (start/end in seconds)."""
    utts = []
    for k, (seconds, text) in enumerate(zip(durations.tolist(), texts)):
        source = sources[rng.integers(len(sources))]
        start = round(float(rng.uniform(0.0, source.duration - seconds)), 3)
        end = round(start + seconds, 3)
        utts.append(Utterance(f"seg{k:06d}", source.audio, end - start, text, start=start, end=end))
    return utts


def make_corpus(folder: Path, num_utts: int, num_sources: int, seed: int = 0) -> dict[str, str]:
    """Write the corpus into `folder`: train.jsonl, valid.jsonl, cmvn.json; returns their paths."""
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True, exist_ok=True)
    sources = write_flacs(folder, np.full(num_sources, SOURCE_SECONDS), seed=seed)
    lexicon = make_lexicon(rng, LEXICON_SIZE)
    durations = librispeech_durations(num_utts, seed=seed)
    train_utts = segments(sources, durations, make_texts(durations, lexicon, rng), rng)
    valid_durations = np.array([3.0, 5.0])
    valid_utts = segments(sources, valid_durations, make_texts(valid_durations, lexicon, rng), rng)
    valid_utts = [Utterance(f"valid{k}", u.audio, u.duration, u.text, u.start, u.end) for k, u in enumerate(valid_utts)]
    paths = corpus_paths(folder)
    write_manifest(train_utts, paths["train"])
    write_manifest(valid_utts, paths["valid"])
    compute_cmvn(sources, FeatureConfig()).save(paths["cmvn"])
    return paths


# ---------------------------------------------------------------------------------------------
# one config, in its own process


class ProcessSampler(threading.Thread):
    """Every `interval` s: the PSS of this process plus its children (the peak is kept), and
    (time, CPU seconds of this process, train records in `metrics`) for the cores of the steps."""

    def __init__(self, metrics: Path, interval: float = 0.2):
        super().__init__(daemon=True)
        self.metrics, self.interval, self.peak_mib = metrics, interval, 0.0
        self.ticks: list[tuple[float, float, int]] = []
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.wait(self.interval):
            pids = [os.getpid(), *_children(os.getpid())]
            self.peak_mib = max(self.peak_mib, sum(_pss_kib(p) for p in pids) / 1024)
            self.ticks.append((time.perf_counter(), _cpu_seconds(), _train_records(self.metrics)))

    def stop(self) -> float:
        """Stop sampling; the peak PSS in MiB."""
        self.done.set()
        self.join()
        return self.peak_mib

    def cores(self, first: int, last: int) -> float:
        """CPU seconds per wall second of this process from the end of step `first` to the end of
        step `last` (as seen by the sampling, to `interval`)."""
        a = next((t for t in self.ticks if t[2] >= first), None)
        b = next((t for t in self.ticks if t[2] >= last), None)
        if a is None or b is None or b[0] <= a[0]:
            return float("nan")
        return (b[1] - a[1]) / (b[0] - a[0])


def _train_records(metrics: Path) -> int:
    try:
        return metrics.read_text().count('"kind": "train"')
    except OSError:
        return 0


def _children(pid: int) -> list[int]:
    """Child process ids of `pid` (all its threads), from /proc."""
    found = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            found += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            continue
    return found


def _pss_kib(pid: int) -> int:
    """Proportional set size of `pid` in KiB (0 when it is gone)."""
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def _cpu_seconds() -> float:
    """CPU seconds (user + system) of this process, all threads."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def experiment_overrides(*, steps: int, batch_seconds: float) -> list[str]:
    """The benchmark's overrides of a training config (see the module docstring)."""
    return [f"training.max_steps={steps}", "training.global_batch_seconds=0", "training.accum_grad=1",
            "training.valid_decode_utts=0",
            "training.checkpoint_every=0", "training.log_every=1", f"data.max_batch_seconds={batch_seconds}"]


def step_times(exp: Path, audio_seconds: list[float]) -> list[float]:
    """Wall seconds of each optimizer step: its audio seconds over its logged audio_s_per_s."""
    records = [json.loads(line) for line in (exp / "metrics.jsonl").read_text().splitlines()]
    speeds = [r["audio_s_per_s"] for r in records if r["kind"] == "train"]
    if len(speeds) != len(audio_seconds):
        raise RuntimeError(f"{exp / 'metrics.jsonl'}: {len(speeds)} train records for {len(audio_seconds)} steps "
                           "(a skipped step?)")
    return [a / s for a, s in zip(audio_seconds, speeds)]


def trained_batches(config: ExperimentConfig, paths: dict[str, str], exp: Path, count: int) -> list[dict]:
    """Utterances, audio / padded seconds and target tokens of the first `count` training batches
    (epoch 0), read again through the trainer's loader (in this process: the batches do not
    depend on the worker count)."""
    data = dataclasses.replace(config.data, num_workers=0)
    loader = make_loader(read_manifest(paths["train"]), load_tokenizer(exp / "tokenizer"), data,
                         training=True, seed=config.training.seed)
    loader.set_epoch(0)
    shift = config.data.features.frame_shift_ms / 1000
    return [{"utts": len(b.ids), "audio_s": float(b.feat_lens.sum()) * shift,
             "padded_s": b.feats.shape[0] * b.feats.shape[1] * shift, "tokens": int(b.token_lens.sum())}
            for b in islice(loader, count)]


def bench_one(config_path: Path, paths: dict[str, str], *, warmup: int, steps: int, batch_seconds: float) -> dict:
    """Train `warmup + steps` optimizer steps of `config_path`; the measurements (see the docstring)."""
    overrides = experiment_overrides(steps=warmup + steps, batch_seconds=batch_seconds)
    config = load_experiment_config(str(config_path), overrides)
    exp = Path(paths["train"]).parent / f"exp-{config_path.stem}"
    shutil.rmtree(exp, ignore_errors=True)  # a fresh run, never a resume
    sampler = ProcessSampler(exp / "metrics.jsonl")
    sampler.start()
    load, start = os.getloadavg()[0], time.perf_counter()
    train(config, paths["train"], paths["valid"], exp, cmvn_path=paths["cmvn"])
    wall = time.perf_counter() - start
    peak_pss, peak_rss = sampler.stop(), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    batches = trained_batches(config, paths, exp, warmup + steps)
    times = step_times(exp, [b["audio_s"] for b in batches])
    timed, timed_s = batches[warmup:], sum(times[warmup:])
    audio, padded = sum(b["audio_s"] for b in timed), sum(b["padded_s"] for b in timed)
    model = torch.load(exp / "model_last.pt", weights_only=True)
    return {
        "config": config_path.name, "overrides": overrides,
        "params": sum(t.numel() for t in model["state_dict"].values()),
        "vocab_size": model["model"]["vocab_size"], "tokenizer": config.tokenizer.kind,
        "num_workers": config.data.num_workers, "threads": torch.get_num_threads(),
        "warmup_steps": warmup, "timed_steps": steps, "step_s": timed_s / steps,
        "audio_s_per_s": audio / timed_s, "padded_s_per_s": padded / timed_s, "padding": 1 - audio / padded,
        "best_step_audio_s_per_s": max(b["audio_s"] / t for b, t in zip(timed, times[warmup:])),
        "utts_per_batch": sum(b["utts"] for b in timed) / steps, "padded_s_per_batch": padded / steps,
        "tokens_per_audio_s": sum(b["tokens"] for b in timed) / audio,
        "peak_rss_mib": peak_rss,
        "peak_pss_with_workers_mib": peak_pss, "train_wall_s": wall,
        "timed_cores_used": sampler.cores(warmup, warmup + steps),
        "load_average": [load, os.getloadavg()[0]],
        "steps": [dict(b, step_s=t) for b, t in zip(batches, times)],
    }


# ---------------------------------------------------------------------------------------------
# the driver


def run_isolated(config_path: Path, paths: dict[str, str], args: argparse.Namespace) -> dict:
    """bench_one in a fresh Python process (its own peak memory); its log goes to a file."""
    result = Path(paths["train"]).parent / f"result-{config_path.stem}.json"
    log = Path(paths["train"]).parent / f"log-{config_path.stem}.txt"
    command = [sys.executable, __file__, "--single", str(config_path), "--corpus", str(Path(paths["train"]).parent),
               "--warmup", str(args.warmup), "--steps", str(args.steps), "--batch-seconds", str(args.batch_seconds)]
    with open(log, "w") as f:
        done = subprocess.run(command, stdout=f, stderr=subprocess.STDOUT, check=False)
    if done.returncode != 0:
        tail = log.read_text()[-4000:]
        sys.exit(f"bench_train: {config_path.name} failed (exit {done.returncode}); the end of its log:\n{tail}")
    return json.loads(result.read_text())


def corpus_paths(folder: Path) -> dict[str, str]:
    return {"train": str(folder / "train.jsonl"), "valid": str(folder / "valid.jsonl"),
            "cmvn": str(folder / "cmvn.json")}


COLUMNS = [  # (header, width, format of one result)
    ("config", -24, lambda r: r["config"]),
    ("params", 8, lambda r: f"{r['params'] / 1e6:.2f}M"),
    ("V", 6, lambda r: r["vocab_size"]),
    ("utts/batch", 11, lambda r: f"{r['utts_per_batch']:.1f}"),
    ("padded s", 9, lambda r: f"{r['padded_s_per_batch']:.1f}"),
    ("step s", 8, lambda r: f"{r['step_s']:.2f}"),
    ("audio s/s", 10, lambda r: f"{r['audio_s_per_s']:.2f}"),
    ("best step", 10, lambda r: f"{r['best_step_audio_s_per_s']:.2f}"),
    ("padded s/s", 11, lambda r: f"{r['padded_s_per_s']:.2f}"),
    ("padding", 8, lambda r: f"{100 * r['padding']:.1f}%"),
    ("RSS MiB", 8, lambda r: f"{r['peak_rss_mib']:.0f}"),
    ("PSS+wk MiB", 11, lambda r: f"{r['peak_pss_with_workers_mib']:.0f}"),
    ("cores", 6, lambda r: f"{r['timed_cores_used']:.2f}"),
    ("load", 10, lambda r: "{:.1f}-{:.1f}".format(*r["load_average"])),
]


def print_table(results: list[dict]) -> None:
    def line(cells: list) -> str:
        return "".join(f"{str(c):<{-w}}" if w < 0 else f"{str(c):>{w}}" for c, (_, w, _) in zip(cells, COLUMNS))

    print("\n" + line([name for name, _, _ in COLUMNS]))
    for r in results:
        print(line([fmt(r) for _, _, fmt in COLUMNS]))
    for r in results:
        if r["timed_cores_used"] < 0.8 * r["threads"]:
            print(f"warning: {r['config']}: the training process got {r['timed_cores_used']:.2f} cores for "
                  f"{r['threads']} threads (load average {r['load_average'][1]:.1f}): other processes were "
                  "running, the figures are below the machine's")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", nargs="+", type=Path,
                        default=[ROOT / "conf/synth.yaml", ROOT / "conf/librispeech_100h.yaml"])
    parser.add_argument("--warmup", type=int, default=2, help="optimizer steps left out of the figures")
    parser.add_argument("--steps", type=int, default=8, help="timed optimizer steps after the warm-up")
    parser.add_argument("--batch-seconds", type=float, default=100.0,
                        help="data.max_batch_seconds (padded seconds per batch; the configs' default is 200)")
    parser.add_argument("--utterances", type=int, default=5000, help="segments in the training manifest")
    parser.add_argument("--sources", type=int, default=8, help="40 s FLAC files the segments are cut from")
    parser.add_argument("--out", type=Path, default=ROOT / "exp/bench_train.json")
    parser.add_argument("--workdir", type=Path, help="keep the corpus, experiments and logs here (default: a "
                        "temporary folder, removed)")
    parser.add_argument("--single", type=Path, help=argparse.SUPPRESS)  # internal: one config, in this process
    parser.add_argument("--corpus", type=Path, help=argparse.SUPPRESS)
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    if args.single:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
        paths = corpus_paths(args.corpus)
        result = bench_one(args.single, paths, warmup=args.warmup, steps=args.steps, batch_seconds=args.batch_seconds)
        (args.corpus / f"result-{args.single.stem}.json").write_text(json.dumps(result, indent=2))
        return
    load = os.getloadavg()[0]
    print(f"{os.cpu_count()} CPUs, torch {torch.__version__} ({torch.get_num_threads()} threads), load average "
          f"{load:.1f}; {args.warmup} warm-up + {args.steps} timed steps per config, batches of <= "
          f"{args.batch_seconds:g} padded s")
    with tempfile.TemporaryDirectory(prefix="bench_train-") as tmp:
        folder = args.workdir or Path(tmp)
        start = time.perf_counter()
        paths = make_corpus(folder, args.utterances, args.sources)
        print(f"corpus: {args.utterances} segments of {args.sources} FLAC files ({time.perf_counter() - start:.1f} s)")
        results = []
        for path in args.configs:
            results.append(run_isolated(path.resolve(), paths, args))
            r = results[-1]
            print(f"  {path.name}: {r['train_wall_s']:.0f} s in train() (setup, {args.warmup + args.steps} steps, "
                  f"final validation and save)")
    print_table(results)
    report = {"cpus": os.cpu_count(), "threads": torch.get_num_threads(), "torch": torch.__version__,
              "load_average_start": load, "load_average_end": os.getloadavg()[0], "batch_seconds": args.batch_seconds,
              "utterances": args.utterances, "configs": {r["config"]: r for r in results}}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
