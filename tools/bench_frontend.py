"""Benchmark the two feature frontends: fbank in the loader workers versus on the training device.

    python tools/bench_frontend.py [--files 40] [--repeats 5] [--cap 200] [--device cpu] [--out bench_frontend.json]
                                   [--manifest TRAIN.jsonl]

One thread (torch.set_num_threads(1)), no worker processes; FLAC files of LibriSpeech-like lengths
are generated in a temporary folder (or the first --files utterances of --manifest are read),
batched by DurationBucketSampler (--cap padded seconds; sorted by duration, not shuffled: a few
files shuffled would fill few buckets and pad a third of each batch, where a corpus's buckets pad
about 5%; the padding is reported), and each path is timed batch by batch as
a loader worker and the training step run it; all rows are measured in the same rounds, so that
a burst of load from elsewhere hits them alike (the fastest round counts):
1. worker, frontend "cpu": decode -> fbank (dither) -> CMVN -> collate + SpecAugment (a Batch);
2. worker, frontend "device": decode -> collate_waves (a WaveBatch of padded waveforms);
3. the training step's DeviceFrontend on --device: batched fbank (dither) + CMVN + SpecAugment;
4. speed perturbation's cost in the worker: decode + resample of the sp0.9 and sp1.1 copies, and
   the extra worker time per audio second over decoding at speed 1.
Speeds are audio seconds per wall second on one core (x real time); on a GPU the device row is
per GPU, not per core. Prints a table and writes JSON.
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from asr.audio import SAMPLE_RATE
from asr.corpora import speed_perturb
from asr.dataset import ASRDataset, collate, collate_waves, derive_seed
from asr.device_frontend import DeviceFrontend
from asr.features import CMVNStats, FeatureConfig, GlobalCMVN, SpecAugmentConfig, fbank
from asr.manifest import Utterance, read_manifest
from asr.sampler import DurationBucketSampler

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_data import librispeech_durations, write_flacs  # this script's folder

SPEEDS = (0.9, 1.1)


def round_times(fns: dict[str, Callable[[], object]], repeats: int, sync: Callable[[], None]) -> dict[str, float]:
    """The shortest wall time of each function over `repeats` rounds through all of them in turn
    (the first round also warms the file cache and the device); `sync` waits for the device."""
    best = dict.fromkeys(fns, float("inf"))
    for _ in range(repeats):
        for name, fn in fns.items():
            sync()
            start = time.perf_counter()
            fn()
            sync()
            best[name] = min(best[name], time.perf_counter() - start)
    return best


def bench(utts: list[Utterance], repeats: int, cap: float, device: torch.device) -> dict:
    torch.set_num_threads(1)
    features, specaug, seed, epoch = FeatureConfig(), SpecAugmentConfig(), 0, 0
    stats = CMVNStats()
    for u in utts[:8]:
        stats.add(fbank(ASRDataset([u], None, features=features).waveform(0).wave, features))
    dataset = ASRDataset(utts, None, features=features, cmvn=GlobalCMVN(stats), training=True, seed=seed)
    perturbed = ASRDataset([u for u in speed_perturb(utts, SPEEDS) if u.speed != 1.0], None, features=features)
    batches = list(DurationBucketSampler(dataset.durations, max_batch_seconds=cap, shuffle=False))
    sp_batches = list(DurationBucketSampler(perturbed.durations, max_batch_seconds=cap, shuffle=False))
    frontend = DeviceFrontend(features, stats, specaug, seed=seed).to(device)
    wave_batches = [collate_waves([dataset.waveform(i) for i in b], epoch=epoch) for b in batches]
    on_device = [(b.waves.to(device), b.wave_lens, b.indices) for b in wave_batches]

    def cpu_worker() -> None:  # what _BatchLoading does with frontend "cpu"
        for k, b in enumerate(batches):
            g = torch.Generator().manual_seed(derive_seed(seed, epoch, k))
            collate([dataset.get(i, epoch) for i in b], specaug=specaug, generator=g)

    def wave_worker(data: ASRDataset, keys: list[list[int]]) -> None:  # frontend "device"
        for b in keys:
            collate_waves([data.waveform(i) for i in b], epoch=epoch)

    def device_step() -> None:
        for waves, lens, indices in on_device:
            frontend(waves, lens, indices, epoch, training=True)

    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    fns = {
        "worker, cpu frontend: decode + fbank + CMVN + SpecAugment": cpu_worker,
        "worker, device frontend: decode + collate waveforms": lambda: wave_worker(dataset, batches),
        f"training step: DeviceFrontend on {device.type}": device_step,
        "worker, device frontend, sp0.9 + sp1.1 copies": lambda: wave_worker(perturbed, sp_batches),
    }
    times = round_times(fns, repeats, sync)
    audio = float(dataset.durations.sum())
    sp_audio = float(perturbed.durations.sum())
    seconds = dict.fromkeys(fns, audio) | {"worker, device frontend, sp0.9 + sp1.1 copies": sp_audio}
    rows = {name: {"wall_s": t, "audio_s": seconds[name], "x_real_time": seconds[name] / t}
            for name, t in times.items()}
    names = list(fns)
    if device.type == "cpu":  # the device path's whole cost when the device is this CPU
        total = times[names[1]] + times[names[2]]
        rows["device frontend on this CPU: worker + training step"] = {"wall_s": total, "audio_s": audio,
                                                                       "x_real_time": audio / total}
    plain_ms = 1000 * times[names[1]] / audio  # worker ms per audio second at speed 1
    sp_ms = 1000 * times[names[3]] / sp_audio
    padding = 1 - sum(int(b.wave_lens.sum()) for b in wave_batches) / sum(b.waves.numel() for b in wave_batches)
    return {"files": len(utts), "audio_s": audio, "threads": 1, "batches": len(batches), "device": str(device),
            "padding": padding,
            "rows": rows, "speed_perturb_ms_per_audio_s": {"speed 1": plain_ms, "sp0.9 + sp1.1": sp_ms,
                                                           "extra": sp_ms - plain_ms}}


def print_report(result: dict) -> None:
    print(f"Frontends, 1 thread, {result['files']} files, {result['audio_s'] / 60:.1f} min of audio, "
          f"{result['batches']} batches ({result['padding']:.1%} padding), device {result['device']}")
    print(f"{'path':62s} {'wall s':>8s} {'audio s':>8s} {'x real time':>12s}")
    for name, row in result["rows"].items():
        print(f"{name:62s} {row['wall_s']:8.3f} {row['audio_s']:8.1f} {row['x_real_time']:12.0f}")
    sp = result["speed_perturb_ms_per_audio_s"]
    print(f"\nworker ms per audio second: speed 1 {sp['speed 1']:.3f}, sp0.9 + sp1.1 {sp['sp0.9 + sp1.1']:.3f} "
          f"(speed perturbation adds {sp['extra']:.3f})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--files", type=int, default=40, help="FLAC files generated (or utterances read)")
    parser.add_argument("--repeats", type=int, default=5, help="rounds; the fastest of each row counts")
    parser.add_argument("--cap", type=float, default=200.0, help="max_batch_seconds (padded seconds per batch)")
    parser.add_argument("--device", default="cpu", help="where the DeviceFrontend runs (cpu, cuda)")
    parser.add_argument("--manifest", type=Path, help="read these utterances instead of synthetic audio")
    parser.add_argument("--out", type=Path, default=Path("bench_frontend.json"), help="JSON results")
    args = parser.parse_args()
    device = torch.device(args.device)
    with tempfile.TemporaryDirectory() as tmp:
        if args.manifest is not None:
            utts = read_manifest(args.manifest)[: args.files]
        else:
            utts = write_flacs(Path(tmp), librispeech_durations(args.files, seed=1))
        result = bench(utts, args.repeats, args.cap, device)
    print_report(result)
    result["machine"] = {"cpu": platform.processor() or platform.machine(), "torch": torch.__version__,
                         "sample_rate": SAMPLE_RATE}
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"JSON: {args.out}")


if __name__ == "__main__":
    main()
