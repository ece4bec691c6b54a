"""Throughput on paper, before a GPU: the audio seconds per second the data path must feed one GPU
for a model to reach a given MFU, and the CPU loader workers per GPU that takes. Prints a table,
writes JSON.

    python tools/feed_rate.py                                        # every training config in conf/, H200
    python tools/feed_rate.py conf/librispeech_960h.yaml --device a100 --mfu 10 40
    python tools/feed_rate.py --manifest data/train_clean_100.jsonl  # per-worker rates on real files

1. Model FLOPs per second of audio. The forward FLOPs of one utterance at each of --durations
   LibriSpeech-like lengths (the midpoint quantiles of tools/bench_data.py's durations: gamma, mean
   12 s, 1-35 s), each alone (no padding: useful work only), counted by torch's FlopCounterMode on
   the CPU with scaled_dot_product_attention held to its math path: the counter does not see inside
   the fused CPU kernel, and would miss the attention products. Counted: 2 FLOPs per multiply-add
   of every convolution (the conv2d subsampler, the Conformer block where a config has one) and
   matrix product: projections and feed-forward of the encoder at its subsampled frame rate,
   attention scores and weighted sums (the decoder's causal self-attention in full), the decoder
   at the label rate, its output projection and the CTC head. Not counted: norms, softmax,
   activations, the losses, the optimizer. Sum over the utterances / their seconds. Training =
   3 x forward (the backward costs two forwards; counting librispeech_960h's backward too gives
   2.997x), the definition of tools/gpu_check.py's MFU. Vocabulary and token rate as gpu_check.py
   takes them (the config's sentencepiece size + 2 and 5 tokens per second for librispeech_*;
   else 31 characters, 15 per second). The analytic count of tools/bench_model.py's forward_flops
   is reported beside it.
2. Required feed per GPU = MFU x peak / training FLOPs per audio second (--peak-tflops, or the
   dense bf16 peak of --device from gpu_check.py's table; default H200, 989 TFLOP/s).
3. Feed rate per CPU worker on this machine, one process, one thread: --files FLAC files at 16 kHz
   of LibriSpeech-like lengths clipped to 2-20 s (or real ones: --manifest, --audio-dir), loaded
   (a) as waveforms, asr.audio.load_audio, and (b) as features, ASRDataset.get (read, training
   dither, fbank, CMVN, tokens), each without and with speed perturbation (the LibriSpeech
   recipe's copies at 0.9 and 1.1 beside the originals: resampled when loaded). Audio seconds
   (of what the model sees: duration / speed) per wall second: each utterance's fastest load of
   --repeats rounds, summed (the machine is shared: this keeps the undisturbed speed).
   The collate and SpecAugment of a loader worker's batch are not included (tools/bench_data.py).
   And (c) features with on-the-fly augmentation of every utterance (asr.augment, probability 1):
   noise (the default kinds: white, pink, brown, babble of 3 other utterances), reverberation (a
   simulated impulse response), both: what they cost per epoch, since they need the audio rather
   than dumped features. An epoch at probability p costs p times the extra seconds per audio hour.
4. CPU workers per GPU = ceil(required feed / per-worker feed), per loader kind; and the MFU
   ceiling of each loader kind with --cores-per-gpu cores per GPU (default 16, the project's H200
   machine), one of them for the training process and the rest loader workers.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import platform
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch
from bench_data import librispeech_durations, write_flacs
from bench_model import forward_flops
from gpu_check import PEAK_TFLOPS, model_config
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from asr.audio import audio_info, load_audio
from asr.augment import AugmentConfig, NoiseConfig, ReverbConfig
from asr.config import load_config, read_yaml
from asr.corpora import speed_perturb
from asr.dataset import ASRDataset, Skipped
from asr.features import FeatureConfig, GlobalCMVN
from asr.loader import compute_cmvn
from asr.manifest import Utterance, read_manifest
from asr.model import ASRModel, ModelConfig, build_model, count_parameters
from asr.tokenizer import train_tokenizer
from asr.tokens import FIRST_TOKEN, sos_id
from asr.train_setup import ExperimentConfig

ROOT = Path(__file__).resolve().parents[1]
TRAINING_FACTOR = 3.0  # training FLOPs / forward FLOPs
SPEEDS = (0.9, 1.1)  # the LibriSpeech recipe's speed perturbation copies
FILE_SECONDS = (2.0, 20.0)  # synthetic file lengths are clipped to this range
# --device presets: gpu_check.py's dense bf16 peaks (TFLOP/s), named in lower case ("h100-pcie").
DEVICES = {name.lower().replace(" ", "-"): tflops for name, tflops in PEAK_TFLOPS}
TEXT = "THE QUICK BROWN FOX JUMPS OVER THE LAZY DOG"
# on-the-fly augmentation timed on every utterance (asr.augment's defaults but the probability)
AUGMENTS = {"noise": AugmentConfig(noise=NoiseConfig(prob=1.0)),
            "reverb": AugmentConfig(reverb=ReverbConfig(prob=1.0)),
            "noise + reverb": AugmentConfig(noise=NoiseConfig(prob=1.0), reverb=ReverbConfig(prob=1.0))}


# ---------------------------------------------------------------------------------------------
# model FLOPs


class ModelFlops(NamedTuple):
    """FLOPs per second of audio of one model."""

    forward: float  # counted by FlopCounterMode
    analytic: float  # tools/bench_model.py's forward_flops

    @property
    def training(self) -> float:
        return TRAINING_FACTOR * self.forward


def flop_durations(count: int) -> list[float]:
    """`count` utterance lengths (s): midpoint quantiles of LibriSpeech-like durations."""
    pool = librispeech_durations(20000, seed=0)
    return [float(q) for q in np.quantile(pool, (np.arange(count) + 0.5) / count)]


def counted_forward_flops(model: ASRModel, frames: int, tokens: int) -> int:
    """FlopCounterMode's FLOPs of the joint-loss forward of one utterance of `frames` feature
    frames and `tokens` targets, attention on its math path (see the module docstring)."""
    g = torch.Generator().manual_seed(0)
    feats = torch.randn(1, frames, model.config.n_mels, generator=g)  # (1, T, n_mels)
    targets = torch.randint(FIRST_TOKEN, sos_id(model.config.vocab_size), (1, tokens), generator=g)  # (1, L)
    counter = FlopCounterMode(display=False)
    with torch.no_grad(), sdpa_kernel(SDPBackend.MATH), counter:
        model(feats, torch.tensor([frames]), targets, torch.tensor([tokens]))
    return counter.get_total_flops()


def model_flops(config: ModelConfig, tokens_per_second: float, durations: Sequence[float],
                frame_shift_ms: float = 10.0) -> ModelFlops:
    """Forward FLOPs per audio second over utterances of `durations` seconds, each alone."""
    torch.manual_seed(0)
    model = build_model(config).train()
    counted = analytic = 0
    for seconds in durations:
        frames, tokens = int(seconds * 1000 / frame_shift_ms), max(1, round(seconds * tokens_per_second))
        counted += counted_forward_flops(model, frames, tokens)
        analytic += forward_flops(config, frames, tokens)
    total = float(sum(durations))
    return ModelFlops(counted / total, analytic / total)


def required_feed(training_flops_per_audio_s: float, peak_tflops: float, mfu: float) -> float:
    """Audio seconds per second one GPU consumes at `mfu` (a fraction) of `peak_tflops`."""
    return mfu * peak_tflops * 1e12 / training_flops_per_audio_s


def mfu_ceiling(training_flops_per_audio_s: float, peak_tflops: float, per_worker: float, workers: int) -> float:
    """The MFU (a fraction) `workers` loader workers of `per_worker` audio s/s each can feed."""
    return workers * per_worker * training_flops_per_audio_s / (peak_tflops * 1e12)


def workers_needed(required: float, per_worker: float) -> int:
    """Loader workers that together feed `required` audio s/s at `per_worker` audio s/s each."""
    return math.ceil(required / per_worker)


def training_configs(folder: Path) -> list[Path]:
    """The YAML files of `folder` that are training configs (a `training` section; not conf/decode)."""
    return [p for p in sorted(folder.glob("*.yaml")) if "training" in read_yaml(p)]


# ---------------------------------------------------------------------------------------------
# loader feed rates


def feature_label(features: FeatureConfig) -> str:
    """'80 mels', plus the settings that differ from FeatureConfig's defaults."""
    default = FeatureConfig()
    others = [f"{f.name} {getattr(features, f.name):g}" for f in dataclasses.fields(features)
              if f.name != "n_mels" and getattr(features, f.name) != getattr(default, f.name)]
    return ", ".join([f"{features.n_mels} mels", *others])


def synthetic_utterances(folder: Path, count: int, seed: int = 0) -> list[Utterance]:
    """`count` 16 kHz FLAC files of speech-like noise, LibriSpeech-like lengths clipped to 2-20 s."""
    return write_flacs(folder, np.clip(librispeech_durations(count, seed), *FILE_SECONDS), seed)


def spread(items: Sequence, count: int) -> list:
    """`count` items evenly spaced over `items` (all of them when there are fewer)."""
    if len(items) <= count:
        return list(items)
    return [items[i] for i in np.linspace(0, len(items) - 1, count).round().astype(int)]


def real_utterances(manifest: Path | None, audio_dir: Path | None, count: int) -> list[Utterance]:
    """`count` unperturbed utterances of a manifest, or `count` audio files of a folder (recursive)."""
    if manifest is not None:
        return spread([u for u in read_manifest(manifest) if u.speed == 1.0], count)
    paths = sorted(p for p in audio_dir.rglob("*") if p.suffix.lower() in (".flac", ".wav"))
    return [Utterance(p.stem, str(p), audio_info(p).duration, TEXT) for p in spread(paths, count)]


def usable(utts: list[Utterance], features: FeatureConfig) -> list[Utterance]:
    """The utterances ASRDataset loads (real data may hold unreadable or mislabelled files)."""
    dataset = ASRDataset(utts, None, features=features)
    kept = [u for i, u in enumerate(utts) if not isinstance(dataset.get(i, 0), Skipped)]
    if not kept:
        raise SystemExit("feed_rate: none of the utterances could be loaded")
    return kept


def best_item_times(loaders: dict[str, Callable[[int], object]], counts: dict[str, int],
                    repeats: int) -> dict[str, float]:
    """Per loader, the sum over its items of each item's shortest wall time over `repeats` rounds
    (`loaders[name](i)` loads item i of `counts[name]`). The rounds go through every loader in
    turn, and a burst of load from the other users of the machine spoils single items, not a whole
    loader; the first round also warms the file cache."""
    best = {name: np.full(counts[name], np.inf) for name in loaders}
    for _ in range(repeats):
        for name, load in loaders.items():
            for i in range(counts[name]):
                start = time.perf_counter()
                load(i)
                best[name][i] = min(best[name][i], time.perf_counter() - start)
    return {name: float(t.sum()) for name, t in best.items()}


def loader_rates(utts: list[Utterance], feature_sets: Sequence[FeatureConfig], repeats: int) -> dict[str, float]:
    """Audio seconds per wall second of each loader kind (see the module docstring); run it on one
    thread (torch.set_num_threads(1)), as a loader worker runs."""
    sets = {"": utts, " + sp": speed_perturb(utts, SPEEDS)}
    tokenizer = train_tokenizer([u.text for u in utts], "char")
    loaders, chosen = {}, {}
    for suffix, group in sets.items():
        loaders[f"waveform{suffix}"] = lambda i, g=group: load_audio(g[i].audio, start=g[i].start or 0.0,
                                                                     end=g[i].end, speed=g[i].speed)
        chosen[f"waveform{suffix}"] = group
    for features in feature_sets:
        cmvn = GlobalCMVN(compute_cmvn(utts[:4], features))
        for suffix, group in sets.items():
            dataset = ASRDataset(group, tokenizer, features=features, cmvn=cmvn, training=True)
            name = f"features{suffix} ({feature_label(features)})"
            loaders[name] = lambda i, d=dataset: d.get(i, 0)
            chosen[name] = group
        if features is feature_sets[0]:
            for label, augment in AUGMENTS.items():
                dataset = ASRDataset(utts, tokenizer, features=features, cmvn=cmvn, training=True, augment=augment)
                name = f"features + {label} ({feature_label(features)})"
                loaders[name] = lambda i, d=dataset: d.get(i, 0)
                chosen[name] = utts
    times = best_item_times(loaders, {name: len(group) for name, group in chosen.items()}, repeats)
    return {name: sum(u.duration for u in chosen[name]) / t for name, t in times.items()}


# ---------------------------------------------------------------------------------------------
# report


def config_report(path: Path, durations: Sequence[float], peak: float, mfus: Sequence[float],
                  rates: dict[str, float], cores_per_gpu: int) -> dict:
    """FLOPs, required feed and workers per GPU of the training config at `path`."""
    config, tokens_per_second = model_config(path)
    features = load_config(ExperimentConfig, path).data.features
    flops = model_flops(config, tokens_per_second, durations, features.frame_shift_ms)
    label = feature_label(features)
    kinds = {"waveform": rates["waveform"], "waveform + sp": rates["waveform + sp"],
             "features": rates[f"features ({label})"], "features + sp": rates[f"features + sp ({label})"]}
    per_mfu = {}
    for mfu in mfus:
        need = required_feed(flops.training, peak, mfu)
        per_mfu[f"{100 * mfu:g}%"] = {"mfu": mfu, "required_audio_s_per_s": need,
                                      "workers": {k: workers_needed(need, r) for k, r in kinds.items()}}
    with torch.device("meta"):
        params = count_parameters(build_model(config))
    return {"params": params, "vocab_size": config.vocab_size, "tokens_per_second": tokens_per_second,
            "features": label, "forward_flops_per_audio_s": flops.forward,
            "training_flops_per_audio_s": flops.training, "analytic_forward_flops_per_audio_s": flops.analytic,
            "per_worker_audio_s_per_s": kinds, "per_mfu": per_mfu,
            "mfu_ceiling": {k: mfu_ceiling(flops.training, peak, r, cores_per_gpu - 1) for k, r in kinds.items()}}


def print_report(report: dict) -> None:
    d = report["flop_durations_s"]
    print(f"Model FLOPs per audio second: forward counted by FlopCounterMode (SDPA math path) on {len(d)} "
          f"utterances of {', '.join(f'{x:.1f}' for x in d)} s, each alone; training = 3 x forward")
    print(f"{'config':<22}{'params':>9}{'V':>6}{'tok/s':>6}{'fwd GFLOP':>10}{'train GFLOP':>12}"
          f"{'analytic/counted':>17}")
    for name, c in report["configs"].items():
        print(f"{name:<22}{c['params'] / 1e6:>8.2f}M{c['vocab_size']:>6}{c['tokens_per_second']:>6g}"
              f"{c['forward_flops_per_audio_s'] / 1e9:>10.3f}{c['training_flops_per_audio_s'] / 1e9:>12.3f}"
              f"{c['analytic_forward_flops_per_audio_s'] / c['forward_flops_per_audio_s']:>17.3f}")
    loading = report["loading"]
    print(f"\nFeed rate per CPU worker (1 process, 1 thread), {loading['files']} {loading['source']} files, "
          f"{loading['audio_s'] / 60:.1f} min (x3 with sp {'/'.join(map(str, SPEEDS))}), best of {loading['repeats']}")
    for name, rate in loading["audio_s_per_s"].items():
        extra = loading["augment_core_s_per_audio_hour"].get(name)
        print(f"  {name:<40}{rate:>10.0f} audio-s/s" + (f"   +{extra:,.0f} core-s per audio hour" if extra else ""))
    p = report["peak"]
    print(f"\nRequired feed per GPU ({p['device']}, {p['tflops']:g} TFLOP/s dense bf16, {p['source']}) "
          f"and CPU loader workers per GPU (ceil(required / per worker))")
    kinds = ["waveform", "waveform + sp", "features", "features + sp"]
    print(f"{'config':<22}{'MFU':>5}{'audio-s/s':>11}" + "".join(f"{k:>15}" for k in kinds))
    for name, c in report["configs"].items():
        for key, row in c["per_mfu"].items():
            print(f"{name:<22}{key:>5}{row['required_audio_s_per_s']:>11,.0f}"
                  + "".join(f"{row['workers'][k]:>15,}" for k in kinds))
    cores = report["cores_per_gpu"]
    print(f"\nMFU ceiling of each loader with {cores} CPU cores per GPU ({cores - 1} loader workers, 1 training "
          f"process)\n{'config':<38}" + "".join(f"{k:>15}" for k in kinds))
    for name, c in report["configs"].items():
        print(f"{name:<38}" + "".join(f"{100 * c['mfu_ceiling'][k]:>14.1f}%" for k in kinds))


def peak_of(args: argparse.Namespace) -> dict:
    if args.peak_tflops:
        return {"device": args.device if args.device_given else "custom", "tflops": args.peak_tflops,
                "source": "--peak-tflops"}
    return {"device": args.device.upper(), "tflops": DEVICES[args.device], "source": "gpu_check.PEAK_TFLOPS"}


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("configs", nargs="*", type=Path, help="training YAML files (default: those in conf/)")
    parser.add_argument("--device", choices=sorted(DEVICES), help="GPU whose dense bf16 peak to use (default h200)")
    parser.add_argument("--peak-tflops", type=float, help="the peak, TFLOP/s (overrides --device)")
    parser.add_argument("--mfu", type=float, nargs="+", default=[5, 10, 20, 30, 40], help="MFUs, percent")
    parser.add_argument("--durations", type=int, default=4,
                        help="utterance lengths the FLOPs are counted at (4: within 0.5%% of 5,000 lengths)")
    parser.add_argument("--files", type=int, default=32, help="audio files the loaders are timed on")
    parser.add_argument("--repeats", type=int, default=5, help="timed rounds per loader kind; the fastest counts")
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--manifest", type=Path, help="time the loaders on --files utterances of this manifest")
    source.add_argument("--audio-dir", type=Path, help="... or on --files FLAC/WAV files under this folder")
    parser.add_argument("--cores-per-gpu", type=int, default=16,
                        help="CPU cores per GPU for the MFU ceiling (one runs the training process)")
    parser.add_argument("--out", type=Path, default=ROOT / "exp/feed_rate.json", help="JSON results")
    args = parser.parse_args(argv)
    args.device_given = args.device is not None
    args.device = args.device or "h200"
    args.configs = args.configs or training_configs(ROOT / "conf")
    return args


def measure_loading(args: argparse.Namespace, feature_sets: Sequence[FeatureConfig]) -> dict:
    """Per-worker feed rates on synthetic files in a temporary folder, or on the real ones asked for."""
    with tempfile.TemporaryDirectory() as tmp:
        if args.manifest or args.audio_dir:
            utts, source = usable(real_utterances(args.manifest, args.audio_dir, args.files), feature_sets[0]), "real"
        else:
            utts, source = synthetic_utterances(Path(tmp), args.files), "synthetic FLAC"
        rates = loader_rates(utts, feature_sets, args.repeats)
    label = feature_label(feature_sets[0])
    extra = {name: 3600 / rates[name] - 3600 / rates[f"features ({label})"]
             for name in (f"features + {a} ({label})" for a in AUGMENTS)}
    return {"source": source, "files": len(utts), "audio_s": sum(u.duration for u in utts), "threads": 1,
            "repeats": args.repeats, "speeds": [1.0, *SPEEDS], "audio_s_per_s": rates,
            "augment_core_s_per_audio_hour": extra}


def main(argv: Sequence[str] | None = None) -> dict:
    args = parse_args(argv)
    load_before = os.getloadavg()  # the machine may be shared: the load says how much to trust the rates
    torch.set_num_threads(1)  # the loaders' measure; and on a shared CPU, counting FLOPs is no faster with more
    feature_sets = list(dict.fromkeys(load_config(ExperimentConfig, p).data.features for p in args.configs))
    loading = measure_loading(args, feature_sets)
    peak = peak_of(args)
    durations = flop_durations(args.durations)
    command = " ".join(["python tools/feed_rate.py", *(sys.argv[1:] if argv is None else argv)])
    report = {"date": time.strftime("%Y-%m-%d"), "command": command,
              "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                          "torch": torch.__version__, "load_average_before": load_before,
                          "load_average_after_loading": os.getloadavg()},
              "peak": peak, "mfu": [m / 100 for m in args.mfu], "flop_durations_s": durations,
              "cores_per_gpu": args.cores_per_gpu,
              "flops_method": "FlopCounterMode forward (SDPA math path), utterances alone; training = 3 x forward",
              "loading": loading, "configs": {}}
    for path in args.configs:
        report["configs"][path.name] = config_report(path, durations, peak["tflops"], report["mfu"],
                                                     loading["audio_s_per_s"], args.cores_per_gpu)
    print_report(report)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"\nwrote {args.out}")
    return report


if __name__ == "__main__":
    main()
