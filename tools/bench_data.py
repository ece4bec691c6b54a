"""Benchmark the data pipeline: loading speed per core, and padding with and without bucketing.

    python tools/bench_data.py [--files 60] [--durations 28000] [--cap 200] [--out bench_data.json]

1. Loading path, one thread (torch.set_num_threads(1)), no worker processes: FLAC files of
   LibriSpeech-like lengths are generated in a temporary folder, then read -> 16 kHz -> fbank
   (training dither) -> CMVN -> collate, batch by batch as the training loader does; reported in
   times real time per core (audio seconds / wall seconds), with each stage timed on its own so
   that a shortfall can be located (decode, resample, fbank, CMVN, collate).
2. Padding: the share of padded frames in batches of DurationBucketSampler versus random
   batching (the same cap, one bucket) on LibriSpeech-like durations (mean about 12 s, 1-35 s).
3. Resampling: torchaudio.functional.resample (kernel built per call) versus asr.audio.resample
   (kernel cached per rate pair), per call, for 1 s and 12 s inputs.
4. Worker memory (Linux): the private memory a forked DataLoader worker adds by reading every
   utterance of a LibriSpeech-960-sized manifest (--lines, speed-perturbed x3) and running a
   full garbage collection, for a plain list of Utterance objects
   versus ASRDataset's packed arrays; and the cost of the manifest list the trainer keeps in
   the parent, with and without the gc.freeze() of the loader's workers.
Prints a table and writes JSON (targets: >= 1,000x real time per core; padding <= 5%).
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import soundfile as sf
import torch
from torchaudio.compliance import kaldi

from asr.audio import SAMPLE_RATE, load_audio, resample
from asr.corpora import speed_perturb
from asr.dataset import ASRDataset, collate
from asr.features import CMVNStats, FeatureConfig, GlobalCMVN, SpecAugmentConfig, fbank
from asr.manifest import Utterance
from asr.sampler import DurationBucketSampler
from asr.tokenizer import train_tokenizer

TARGET_SPEED = 1000.0  # x real time per core
TARGET_PADDING = 0.05  # share of padded frames with bucketing
TEXT = "THE QUICK BROWN FOX JUMPS OVER THE LAZY DOG"


def librispeech_durations(n: int, seed: int = 0) -> np.ndarray:
    """(n,) seconds: gamma with mean 12 s, clipped to 1-35 s (LibriSpeech-like)."""
    return np.clip(np.random.default_rng(seed).gamma(6.0, 2.0, n), 1.0, 35.0)


def write_flacs(folder: Path, durations: np.ndarray, seed: int = 0) -> list[Utterance]:
    """16 kHz 16-bit FLAC files of speech-like noise (amplitude-modulated, some tones)."""
    rng = np.random.default_rng(seed)
    utts = []
    for k, seconds in enumerate(durations):
        n = round(seconds * SAMPLE_RATE)
        t = np.arange(n) / SAMPLE_RATE
        envelope = 0.5 + 0.5 * np.sin(2 * np.pi * 3.0 * t + rng.uniform(0, 6.3))
        wave = envelope * (0.1 * rng.standard_normal(n) + 0.2 * np.sin(2 * np.pi * rng.uniform(100, 300) * t))
        path = folder / f"utt{k:03d}.flac"
        sf.write(path, np.clip(wave, -1, 1).astype(np.float32), SAMPLE_RATE, subtype="PCM_16")
        utts.append(Utterance(f"utt{k:03d}", str(path), n / SAMPLE_RATE, TEXT))
    return utts


def best_times(fns: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """The shortest wall time of each function over `repeats` rounds. The rounds go through all
    the functions in turn, so that a burst of load from elsewhere hits every stage alike; the
    first round also warms the file cache."""
    best = dict.fromkeys(fns, float("inf"))
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - start)
    return best


def bench_loading(num_files: int, repeats: int, cap: float) -> dict:
    """x real time per core of the whole path and of each stage."""
    torch.set_num_threads(1)
    features = FeatureConfig()
    with tempfile.TemporaryDirectory() as tmp:
        utts = write_flacs(Path(tmp), librispeech_durations(num_files, seed=1))
        audio_seconds = sum(u.duration for u in utts)
        waves = [load_audio(u.audio) for u in utts]
        feats = [fbank(w, features, training=True, generator=torch.Generator().manual_seed(0)) for w in waves]
        stats = CMVNStats()
        for f in feats:
            stats.add(f)
        cmvn = GlobalCMVN(stats)
        tokenizer = train_tokenizer([TEXT], "char")
        dataset = ASRDataset(utts, tokenizer, features=features, cmvn=cmvn, training=True)
        sampler = DurationBucketSampler([u.duration for u in utts], max_batch_seconds=cap)
        batches = list(sampler)
        examples = [dataset[i] for i in range(len(utts))]
        specaug = SpecAugmentConfig()

        def whole_path(augment: SpecAugmentConfig | None = None) -> None:
            for batch in batches:
                collate([dataset[i] for i in batch], specaug=augment, generator=torch.Generator().manual_seed(0))

        stages = {
            "whole path: FLAC -> fbank -> CMVN -> collate": lambda: whole_path(),
            "whole path + SpecAugment": lambda: whole_path(specaug),
            "  decode FLAC (16 kHz, no resampling)": lambda: [load_audio(u.audio) for u in utts],
            "  decode + resample (speed 0.9)": lambda: [load_audio(u.audio, speed=0.9) for u in utts],
            "  fbank (with dither)": lambda: [
                fbank(w, features, training=True, generator=torch.Generator().manual_seed(0)) for w in waves
            ],
            "  fbank (no dither)": lambda: [fbank(w, features) for w in waves],
            "  torchaudio kaldi.fbank (reference)": lambda: [
                kaldi.fbank(w[None] * 32768, num_mel_bins=features.n_mels, dither=0.0) for w in waves
            ],
            "  CMVN": lambda: [cmvn(f) for f in feats],
            "  tokens + collate": lambda: [collate([examples[i] for i in b]) for b in batches],
        }
        times = best_times(stages, repeats)
        rows = {name: {"wall_s": t, "x_real_time": audio_seconds / t} for name, t in times.items()}
    return {"files": num_files, "audio_s": audio_seconds, "threads": 1, "batches": len(batches), "stages": rows}


def padding_share(batches: list[list[int]], durations: np.ndarray) -> float:
    """Padded frames / all frames (padding to the longest utterance of each batch)."""
    real = sum(durations[b].sum() for b in batches)
    total = sum(durations[b].max() * len(b) for b in batches)
    return float(1 - real / total)


def bench_padding(num_utts: int, caps: list[float]) -> dict:
    durations = librispeech_durations(num_utts, seed=2)
    rows = {}
    for cap in caps:
        for name, buckets in (("bucketed", 30), ("random", 1)):
            start = time.perf_counter()
            sampler = DurationBucketSampler(durations, max_batch_seconds=cap, seed=0, num_buckets=buckets)
            batches = list(sampler)
            seconds = time.perf_counter() - start
            rows[f"{name} cap {cap:g} s"] = {
                "padding": padding_share(batches, durations),
                "batches": len(batches),
                "mean_batch_size": num_utts / len(batches),
                "epoch_build_s": seconds,
            }
    stats = {"mean_s": durations.mean(), "min_s": durations.min(), "max_s": durations.max()}
    return {"durations": {"n": num_utts} | {k: float(v) for k, v in stats.items()}, "samplers": rows}


def bench_resample(repeats: int = 20) -> dict:
    """ms per call: torchaudio.functional.resample (kernel built each call) vs asr.audio.resample."""
    import torchaudio.functional

    torch.set_num_threads(1)
    rows = {}
    for orig in (44100, 14400, 8000):  # 14400 -> 16000: speed perturbation 0.9
        for seconds in (1, 12):
            wave = torch.randn(orig * seconds)
            fns = {
                "torchaudio": lambda w=wave, r=orig: torchaudio.functional.resample(w, r, SAMPLE_RATE),
                "cached": lambda w=wave, r=orig: resample(w, r, SAMPLE_RATE),
            }
            times = best_times(fns, repeats)
            rows[f"{orig} Hz, {seconds} s"] = {k: 1000 * t for k, t in times.items()}
    return rows


def fake_manifest(lines: int, seed: int = 0) -> list[Utterance]:
    """LibriSpeech-like manifest lines (ids, absolute paths, ~190-character texts); no audio."""
    rng = np.random.default_rng(seed)
    words = ["THE", "AND", "OF", "TO", "A", "IN", "HE", "WAS", "THAT", "HIS", "WITH", "HAD", "SHOULD", "NEVER"]
    utts = []
    for k, seconds in enumerate(librispeech_durations(lines, seed)):
        spk, chapter = 100 + k // 1000, 2000 + k // 100
        utt_id = f"{spk}-{chapter}-{k % 100:04d}"
        path = f"/data/corpora/LibriSpeech/train-other-500/{spk}/{chapter}/{utt_id}.flac"
        text = " ".join(rng.choice(words, size=int(seconds * 2.8)))
        utts.append(Utterance(utt_id, path, float(seconds), text, speaker=str(spk)))
    return utts


def _private_dirty_kb() -> int:
    with open("/proc/self/smaps_rollup") as f:
        return sum(int(line.split()[1]) for line in f if line.startswith("Private_Dirty:"))


def forked_private_mb(work) -> float:
    """MB of private (copied) memory a forked child adds by running `work()` then a full gc."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: measure, report, leave without running the parent's cleanup
        before = _private_dirty_kb()
        work()
        gc.collect()
        os.write(write, str(_private_dirty_kb() - before).encode())
        os._exit(0)
    os.close(write)
    with os.fdopen(read) as f:
        kb = int(f.read() or 0)
    os.waitpid(pid, 0)
    return kb / 1024


def bench_worker_memory(lines: int) -> dict:
    """Copy-on-read cost per worker of the dataset's utterances, and of the parent's manifest list."""
    manifest = fake_manifest(lines)
    held = {"utts": speed_perturb(manifest, (0.9, 1.1))}  # a plain list of Utterance objects

    def read_list() -> None:
        for u in held["utts"]:
            _ = (u.id, u.audio, u.text, u.duration, u.start, u.end, u.speed)

    rows = {"list of Utterance": forked_private_mb(read_list)}
    dataset = ASRDataset(held["utts"], None, features=FeatureConfig())
    n = len(held.pop("utts"))
    gc.collect()

    def read_dataset(freeze: bool) -> None:
        if freeze:
            gc.freeze()  # what make_loader's workers do first
        for i in range(n):
            dataset.utterance(i)

    rows["ASRDataset, worker gc.freeze()"] = forked_private_mb(lambda: read_dataset(True))
    rows["ASRDataset, no gc.freeze()"] = forked_private_mb(lambda: read_dataset(False))
    rows["  of which the parent's manifest list"] = forked_private_mb(lambda: None)
    return {"manifest_lines": lines, "utterances": n, "dataset_bytes": dataset._utts.nbytes,
            "worker_private_mb": rows, "manifest_kept": len(manifest)}


def print_report(loading: dict, padding: dict) -> None:
    print(f"Loading, 1 thread, {loading['files']} FLAC files, {loading['audio_s'] / 60:.1f} min of audio")
    print(f"{'stage':48s} {'wall s':>8s} {'x real time':>12s}")
    for name, row in loading["stages"].items():
        print(f"{name:48s} {row['wall_s']:8.3f} {row['x_real_time']:12.0f}")
    d = padding["durations"]
    print(f"\nPadding, {d['n']} durations, mean {d['mean_s']:.1f} s, range {d['min_s']:.1f}-{d['max_s']:.1f} s")
    print(f"{'sampler':24s} {'padding':>8s} {'batches':>8s} {'utts/batch':>10s} {'build ms':>9s}")
    for name, row in padding["samplers"].items():
        print(
            f"{name:24s} {row['padding']:8.2%} {row['batches']:8d} {row['mean_batch_size']:10.1f}"
            f" {row['epoch_build_s'] * 1000:9.1f}"
        )


def print_extra(resampling: dict, memory: dict | None) -> None:
    print(f"\nResampling to 16 kHz, ms per call (1 thread)\n{'input':18s} {'torchaudio':>10s} {'cached':>8s}")
    for name, row in resampling.items():
        print(f"{name:18s} {row['torchaudio']:10.3f} {row['cached']:8.3f}")
    if memory is None:
        return
    print(f"\nWorker memory, {memory['manifest_lines']} manifest lines x3 speeds = {memory['utterances']} "
          f"utterances (packed dataset {memory['dataset_bytes'] / 2**20:.0f} MB, shared)")
    for name, mb in memory["worker_private_mb"].items():
        print(f"{name:44s} {mb:8.1f} MB private per worker")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--files", type=int, default=60, help="FLAC files generated for the loading benchmark")
    parser.add_argument("--repeats", type=int, default=7, help="runs per stage; the fastest counts")
    parser.add_argument("--durations", type=int, default=28000, help="durations drawn for the padding benchmark")
    parser.add_argument("--cap", type=float, default=200.0, help="max_batch_seconds (padded seconds per batch)")
    parser.add_argument("--lines", type=int, default=281241, help="manifest lines for the worker memory benchmark")
    parser.add_argument("--out", type=Path, default=Path("bench_data.json"), help="JSON results")
    args = parser.parse_args()
    loading = bench_loading(args.files, args.repeats, args.cap)
    padding = bench_padding(args.durations, sorted({100.0, args.cap, 400.0}))
    resampling = bench_resample()
    memory = bench_worker_memory(args.lines) if os.path.exists("/proc/self/smaps_rollup") and args.lines else None
    print_report(loading, padding)
    print_extra(resampling, memory)
    whole = loading["stages"]["whole path: FLAC -> fbank -> CMVN -> collate"]["x_real_time"]
    bucketed = padding["samplers"][f"bucketed cap {args.cap:g} s"]["padding"]
    result = {
        "machine": {"cpu": platform.processor() or platform.machine(), "torch": torch.__version__},
        "loading": loading,
        "padding": padding,
        "resample_ms": resampling,
        "worker_memory": memory,
        "targets": {
            "x_real_time_per_core": {"target": TARGET_SPEED, "value": whole, "met": whole >= TARGET_SPEED},
            "padding_bucketed": {"target": TARGET_PADDING, "value": bucketed, "met": bucketed <= TARGET_PADDING},
        },
    }
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nwhole path {whole:.0f}x real time per core (target {TARGET_SPEED:.0f}x); "
          f"padding {bucketed:.2%} bucketed (target <= {TARGET_PADDING:.0%}); JSON: {args.out}")


if __name__ == "__main__":
    main()
