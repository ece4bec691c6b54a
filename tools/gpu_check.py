"""GPU check: train a config for a fixed number of steps on synthetic batches under bf16 autocast
and report steps/s, audio-seconds/s, peak GPU memory and model FLOP utilization (MFU); then time
decoding (beam search, beam 10 + CTC weight 0.3, 32 utterances per batch, bf16 autocast): real-time
factor, utterances/s, peak memory and host synchronizations per decoding step.

    bash tools/gpu_check.sh                                  # conf/librispeech_100h.yaml, eager
    bash tools/gpu_check.sh --compile --out exp/gpu_check_compiled.json
    bash tools/gpu_check.sh --device cpu --config conf/tiny.yaml --warmup 1 --steps 2 --decode-batch 4   # dry run

Runs where only torch and pyyaml are installed (no audio files, no soundfile, no network): it
imports asr.config and asr.model only, through tools/bench_model.py, and gpu_check.sh puts the
repository on PYTHONPATH. Exits with status 2 and one line when there is no CUDA device (or it
lacks bf16).

Batches: LibriSpeech-like durations (gamma, mean 12 s, clipped to 1-35 s, as tools/bench_data.py)
batched as the trainer's sampler does: a pool sorted by duration is cut greedily into batches of at
most --batch-seconds padded seconds (utterances x longest; default: the config's
data.max_batch_seconds, and 4 times it), and the batches are shuffled. Each batch is random
features (B, T, n_mels) at 100 frames per second and random targets, made on the device before
the clock starts. Vocabulary: the config's sentencepiece size + 2 (blank and sos/eos; V
5002 for librispeech_100h.yaml), else bench_model.load's assumption (31 characters); token rate:
bench_model.load's (5 per second for librispeech_*, 15 otherwise).

Step: the trainer's: AdamW (its default betas, eps and weight decay; lr 1e-4), forward under bf16
autocast, backward, gradient clipping at 5, the one host synchronization of a step (the non-finite
check of the gradient norm), optimizer step. --steps steps are timed between two device
synchronizations after --warmup steps (with --compile the warm-up absorbs compilation, and the
recompilation for dynamic shapes); the median and the slowest step show whether it did.

MFU = model FLOPs per second / the device's dense bf16 peak. The model FLOPs of a step are 3 x the
forward FLOPs of tools/bench_model.py's forward_flops, summed over the batch's utterances at their
own lengths (useful work: padding earns nothing); "MFU padded" counts what the padded batch computes
(B x the longest). The peak comes from PEAK_TFLOPS by device name, or --peak-tflops.

Decoding: the trained model's weights never end a hypothesis (its eos logit is pushed down), so
every utterance runs to a realistic length (the token rate above x its duration, through
max_len_ratio), as tools/bench_decode.py does; --decode-batches batches of --decode-batch
utterances of the same LibriSpeech-like durations (at most 20 s), random features, encoder and
search under bf16 autocast (fp32 with --decode-fp32), one untimed warm-up batch first. RTF =
seconds of decoding / seconds of audio. Host synchronizations are counted on CUDA with
torch.cuda.set_sync_debug_mode on one more batch; the search promises at most one per step.
--no-decode skips it.

Prints a table, one row per batch size as it completes, and rewrites the JSON (--out) after each
row, so a run cut short keeps what it measured. A batch size that runs out of device memory gets
a row saying so.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import random
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import NamedTuple

import torch
import yaml
from bench_model import FRAMES_PER_SECOND, forward_flops, load

from asr.model import ASRModel, ModelConfig, build_model, count_parameters
from asr.search import SearchOptions, decode_memory, max_lengths

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_BATCH_SECONDS = 200.0  # DataConfig.max_batch_seconds (asr.loader needs soundfile: not imported here)
POOL_UTTERANCES = 4000  # durations drawn; the batches are cut from them
GRAD_CLIP = 5.0
LR = 1e-4
DECODE_MAX_SECONDS = 20.0  # longest utterance of the decoding batches

# Dense (no sparsity) bf16 tensor-core peaks, TFLOPS, by a substring of torch.cuda.get_device_name();
# the first match wins, so longer names come before their prefixes ("L40S" before "L40" before "L4").
PEAK_TFLOPS: list[tuple[str, float]] = [
    ("GH200", 989.0),
    ("H200", 989.0),
    ("H100 PCIe", 756.0),
    ("H100", 989.0),  # SXM ("H100 80GB HBM3")
    ("B200", 2250.0),
    ("A100", 312.0),
    ("L40S", 362.0),
    ("L40", 181.0),
    ("L4", 121.0),
]


class SyntheticBatch(NamedTuple):
    feats: torch.Tensor  # (B, T, n_mels) float32
    feat_lens: torch.Tensor  # (B,) long, frames
    tokens: torch.Tensor  # (B, L) long, padded with -1
    token_lens: torch.Tensor  # (B,) long
    audio_s: float  # sum of the utterances' durations
    padded_s: float  # B x the longest
    flops: float  # training FLOPs (3 x forward) of the utterances at their own lengths
    padded_flops: float  # training FLOPs of the padded batch


# ---------------------------------------------------------------------------------------------
# synthetic batches


def librispeech_durations(n: int) -> list[float]:
    """n durations in seconds: gamma (shape 6, scale 2: mean 12 s), clipped to 1-35 s."""
    return torch.distributions.Gamma(6.0, 0.5).sample((n,)).clamp(1.0, 35.0).tolist()


def cut_batches(durations: list[float], cap: float, rng: random.Random) -> list[list[float]]:
    """The durations sorted and cut greedily into batches of longest x count <= cap, shuffled."""
    batches: list[list[float]] = [[]]
    for d in sorted(durations):
        if batches[-1] and d * (len(batches[-1]) + 1) > cap:
            batches.append([])
        batches[-1].append(d)
    rng.shuffle(batches)
    return batches


def make_batch(durations: list[float], config: ModelConfig, rate: float, device: torch.device) -> SyntheticBatch:
    """Random features and targets for utterances of `durations` (seconds), on `device`."""
    frames = [int(d * FRAMES_PER_SECOND) for d in durations]
    counts = [max(1, round(d * rate)) for d in durations]
    feats = torch.randn(len(frames), max(frames), config.n_mels, device=device)
    tokens = torch.randint(2, config.vocab_size - 1, (len(counts), max(counts)), device=device)  # no blank/unk/sos
    lens = torch.tensor(counts, device=device)
    tokens = tokens.masked_fill(torch.arange(max(counts), device=device) >= lens[:, None], -1)
    flops = 3.0 * sum(forward_flops(config, f, n) for f, n in zip(frames, counts))
    padded = 3.0 * len(frames) * forward_flops(config, max(frames), max(counts))
    return SyntheticBatch(feats, torch.tensor(frames, device=device), tokens, lens, sum(durations),
                          len(durations) * max(durations), flops, padded)


def make_batches(config: ModelConfig, rate: float, cap: float, count: int, device: torch.device,
                 seed: int) -> list[SyntheticBatch]:
    """`count` batches (cycling through the cut pool if it holds fewer) of at most `cap` padded seconds."""
    torch.manual_seed(seed)
    cut = cut_batches(librispeech_durations(POOL_UTTERANCES), cap, random.Random(seed))
    distinct = [make_batch(d, config, rate, device) for d in cut[:count]]
    return [distinct[i % len(distinct)] for i in range(count)]


# ---------------------------------------------------------------------------------------------
# training steps


def train_step(model: torch.nn.Module, params: list[torch.nn.Parameter], optimizer: torch.optim.Optimizer,
               batch: SyntheticBatch, device: torch.device) -> bool:
    """One optimizer step as asr.trainer takes it; False when skipped for a non-finite gradient norm."""
    with torch.autocast(device.type, dtype=torch.bfloat16):
        out = model(batch.feats, batch.feat_lens, batch.tokens, batch.token_lens)
    out.loss.backward()
    grad_norm = torch.nn.utils.clip_grad_norm_(params, GRAD_CLIP)
    finite = math.isfinite(float(grad_norm))  # the step's one host synchronization
    if finite:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return finite


def run_steps(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batches: list[SyntheticBatch],
              device: torch.device) -> tuple[int, list[float]]:
    """Train on `batches` in order; (skipped non-finite steps, host seconds of each step). The
    step's host synchronization makes each time close to the device's (its optimizer update
    runs on into the next step)."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    skipped, times = 0, []
    for batch in batches:
        start = time.perf_counter()
        skipped += not train_step(model, params, optimizer, batch, device)
        times.append(time.perf_counter() - start)
    return skipped, times


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batches: list[SyntheticBatch], warmup: int,
            device: torch.device) -> dict:
    """Warm up on the first `warmup` batches, then time the rest."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    skipped, _ = run_steps(model, optimizer, batches[:warmup], device)
    synchronize(device)
    start = time.perf_counter()
    timed = batches[warmup:]
    timed_skipped, times = run_steps(model, optimizer, timed, device)
    synchronize(device)
    elapsed = time.perf_counter() - start
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    audio, padded = sum(b.audio_s for b in timed), sum(b.padded_s for b in timed)
    return {"steps": len(timed), "elapsed_s": elapsed, "steps_per_s": len(timed) / elapsed,
            "audio_s_per_s": audio / elapsed, "utts_per_batch": sum(b.feats.shape[0] for b in timed) / len(timed),
            "padded_s_per_batch": padded / len(timed), "padding": 1 - audio / padded,
            "tflops": sum(b.flops for b in timed) / elapsed / 1e12,
            "tflops_padded": sum(b.padded_flops for b in timed) / elapsed / 1e12,
            "median_step_ms": 1e3 * statistics.median(times), "slowest_step_ms": 1e3 * max(times),
            "peak_memory_gib": peak, "skipped_steps": skipped + timed_skipped}


# ---------------------------------------------------------------------------------------------
# decoding


def decode_batches(config: ModelConfig, args: argparse.Namespace, device: torch.device) -> list[tuple]:
    """--decode-batches + 2 batches (warm-up, sync count) of (feats, feat_lens, audio seconds) on the device."""
    torch.manual_seed(args.seed + 1)
    out = []
    for _ in range(args.decode_batches + 2):
        durations = [min(d, DECODE_MAX_SECONDS) for d in librispeech_durations(args.decode_batch)]
        frames = torch.tensor([int(d * FRAMES_PER_SECOND) for d in durations], device=device)
        feats = torch.randn(len(durations), int(frames.max()), config.n_mels, device=device)
        out.append((feats, frames, sum(durations)))
    return out


def decode_once(model: ASRModel, batch: tuple, options: SearchOptions, dtype: torch.dtype | None) -> None:
    feats, frames, _ = batch
    with torch.no_grad(), torch.autocast(feats.device.type, dtype=dtype, enabled=dtype is not None):
        decode_memory(model, *model.encode(feats, frames), options)


def count_syncs(fn) -> int | None:
    """Host synchronizations CUDA reports while fn() runs (None on the CPU)."""
    if not torch.cuda.is_available() or torch.cuda.get_sync_debug_mode() != 0:
        return None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught)


def measure_decoding(model: ASRModel, config: ModelConfig, rate: float, args: argparse.Namespace,
                     device: torch.device) -> dict:
    """Decoding speed of `model` (see the module docstring)."""
    model.eval()
    with torch.no_grad():
        model.decoder.output.bias[config.eos] = -1e4  # never ends: every utterance runs to its length
    options = SearchOptions(mode="attention", beam_size=args.decode_beam, ctc_weight=args.decode_ctc,
                            max_len_ratio=rate / config.frames_per_second)
    dtype = None if args.decode_fp32 else torch.bfloat16
    warmup, *timed, last = decode_batches(config, args, device)
    decode_once(model, warmup, options, dtype)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    synchronize(device)
    start = time.perf_counter()
    for batch in timed:
        decode_once(model, batch, options, dtype)
    synchronize(device)
    elapsed = time.perf_counter() - start
    audio = sum(b[2] for b in timed)
    utterances = sum(b[0].size(0) for b in timed)
    steps = int(max_lengths(model.encoder.subsampling.output_lengths(last[1]), options.max_len_ratio).max()) + 1
    syncs = count_syncs(lambda: decode_once(model, last, options, dtype))
    return {"batch": args.decode_batch, "batches": len(timed), "beam": args.decode_beam, "ctc_weight": args.decode_ctc,
            "autocast": "fp32" if dtype is None else "bf16", "audio_s": audio, "elapsed_s": elapsed,
            "rtf": elapsed / audio, "utts_per_s": utterances / elapsed, "tokens_per_second": rate,
            "peak_memory_gib": torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None,
            "host_syncs": syncs, "search_steps": steps}


def print_decoding(r: dict) -> None:
    mem = f"{r['peak_memory_gib']:.1f} GiB" if r["peak_memory_gib"] is not None else "n/a"
    syncs = "n/a" if r["host_syncs"] is None else f"{r['host_syncs']} in ~{r['search_steps']} steps"
    print(f"\ndecoding: beam {r['beam']} + CTC {r['ctc_weight']:g}, {r['batch']} utterances x {r['batches']} batches, "
          f"{r['autocast']}: RTF {r['rtf']:.4f}, {r['utts_per_s']:.1f} utterances/s, peak {mem}, "
          f"host syncs {syncs}", flush=True)


# ---------------------------------------------------------------------------------------------
# the driver


def measure_frontend(cap: float, device: torch.device, repeats: int = 10) -> dict:
    """The device frontend (asr.device_frontend: batched fbank, CMVN, SpecAugment of padded 16 kHz
    waveforms, as `data.frontend: device` runs it in the training step) on synthetic batches of
    `cap` padded seconds: audio seconds per second, against one worker's CPU feed."""
    from asr.device_frontend import DeviceFrontend
    from asr.features import CMVNStats, FeatureConfig, SpecAugmentConfig

    features = FeatureConfig()
    stats = CMVNStats(features.n_mels)
    stats.add(torch.randn(100, features.n_mels))
    frontend = DeviceFrontend(features, stats, SpecAugmentConfig(), seed=0).to(device)
    rng = random.Random(0)
    batches = [sorted(b, reverse=True) for b in cut_batches(librispeech_durations(400), cap, rng)][:repeats + 2]
    prepared = []
    for b in batches:
        lens = torch.tensor([int(d * 16000) for d in b])
        waves = torch.randn(len(b), int(lens.max())) * 0.1
        waves[torch.arange(waves.shape[1]) >= lens[:, None]] = 0.0
        prepared.append((waves.to(device), lens, torch.arange(len(b))))
    for waves, lens, idx in prepared[:2]:  # warm-up
        frontend(waves, lens, idx, 0, training=True)
    synchronize(device)
    start = time.perf_counter()
    for waves, lens, idx in prepared[2:]:
        frontend(waves, lens, idx, 0, training=True)
    synchronize(device)
    seconds = time.perf_counter() - start
    audio = sum(sum(b) for b in batches[2:])
    return {"batch_seconds": cap, "batches": len(prepared) - 2, "audio_seconds": audio,
            "audio_s_per_s": audio / seconds}


def pick_device(name: str) -> torch.device:
    """The device to run on; exits with status 2 and one line when CUDA (with bf16) is missing."""
    device = torch.device(name)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            print("gpu_check: no CUDA device (torch.cuda.is_available() is False); for a dry run on the CPU "
                  "pass --device cpu", file=sys.stderr)
            sys.exit(2)
        if not torch.cuda.is_bf16_supported():
            print(f"gpu_check: {torch.cuda.get_device_name(device)} has no bf16 support", file=sys.stderr)
            sys.exit(2)
    return device


def peak_tflops(device: torch.device, override: float | None) -> tuple[float | None, str]:
    """(dense bf16 peak TFLOPS or None, where it came from)."""
    if override:
        return override, "--peak-tflops"
    if device.type != "cuda":
        return None, "unknown for the CPU (pass --peak-tflops)"
    name = torch.cuda.get_device_name(device)
    for key, value in PEAK_TFLOPS:
        if key in name:
            return value, f"table entry '{key}'"
    return None, f"'{name}' not in the table (pass --peak-tflops)"


def model_config(path: Path) -> tuple[ModelConfig, float]:
    """The model config of `path` with its vocabulary (see the module docstring), and its token rate."""
    config, rate = load(path)
    tokenizer = yaml.safe_load(path.read_text()).get("tokenizer") or {}
    if tokenizer.get("kind") in ("bpe", "unigram"):
        config = dataclasses.replace(config, vocab_size=tokenizer["vocab_size"] + 2)
    return config, rate


def batch_caps(config_path: Path, given: list[float] | None) -> list[float]:
    """--batch-seconds, else the config's data.max_batch_seconds and 4 times it."""
    if given:
        return given
    data = yaml.safe_load(config_path.read_text()).get("data") or {}
    cap = float(data.get("max_batch_seconds", DEFAULT_BATCH_SECONDS))
    return [cap, 4 * cap]


def print_header(args: argparse.Namespace, device: torch.device, config: ModelConfig, params: int,
                 peak: tuple[float | None, str]) -> None:
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    cuda = f", CUDA {torch.version.cuda}" if device.type == "cuda" else ""
    print(f"device {name} ({device}), torch {torch.__version__}{cuda}")
    print(f"model {args.config.name}: {params / 1e6:.2f}M parameters, vocabulary {config.vocab_size}; "
          f"bf16 autocast; torch.compile {'on' if args.compile else 'off'}; "
          f"{args.warmup} warm-up + {args.steps} timed steps per batch size")
    print(f"peak {peak[0] or 'n/a'} TFLOPS dense bf16 ({peak[1]})")


TABLE_HEADER = (f"{'cap s':>6}{'utts/batch':>11}{'padded s':>9}{'padding':>8}{'steps/s':>9}{'step ms':>16}"
                f"{'audio s/s':>11}{'peak GiB':>9}{'TFLOP/s':>9}{'MFU':>7}{'MFU padded':>11}")


def print_row(r: dict) -> None:
    if "error" in r:
        print(f"{r['batch_seconds']:>6g}  {r['error']}")
        return
    mem = f"{r['peak_memory_gib']:.1f}" if r["peak_memory_gib"] is not None else "n/a"
    mfu = f"{100 * r['mfu']:.1f}%" if r["mfu"] is not None else "n/a"
    mfu_padded = f"{100 * r['mfu_padded']:.1f}%" if r["mfu_padded"] is not None else "n/a"
    step = f"{r['median_step_ms']:.0f} (max {r['slowest_step_ms']:.0f})"
    print(f"{r['batch_seconds']:>6g}{r['utts_per_batch']:>11.1f}{r['padded_s_per_batch']:>9.1f}"
          f"{100 * r['padding']:>7.1f}%{r['steps_per_s']:>9.2f}{step:>16}{r['audio_s_per_s']:>11.0f}{mem:>9}"
          f"{r['tflops']:>9.2f}{mfu:>7}{mfu_padded:>11}", flush=True)


def run_cap(model: torch.nn.Module, optimizer: torch.optim.Optimizer, config: ModelConfig, rate: float, cap: float,
            args: argparse.Namespace, device: torch.device, peak: float | None) -> dict:
    """The measurements at one batch cap; {"batch_seconds", "error"} when the device runs out of memory."""
    try:
        batches = make_batches(config, rate, cap, args.warmup + args.steps, device, args.seed)
        row = {"batch_seconds": cap, **measure(model, optimizer, batches, args.warmup, device)}
    except torch.OutOfMemoryError:
        optimizer.zero_grad(set_to_none=True)
        return {"batch_seconds": cap, "error": "out of memory (try a smaller --batch-seconds)"}
    row["mfu"] = row["tflops"] / peak if peak else None
    row["mfu_padded"] = row["tflops_padded"] / peak if peak else None
    return row


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", type=Path, default=ROOT / "conf/librispeech_100h.yaml")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--batch-seconds", type=float, nargs="+",
                        help="padded seconds per batch, one run each (default: the config's cap and 4x it)")
    parser.add_argument("--warmup", type=int, default=20, help="untimed steps first (compilation included)")
    parser.add_argument("--steps", type=int, default=100, help="timed optimizer steps per batch size")
    parser.add_argument("--compile", action="store_true", help="torch.compile the model")
    parser.add_argument("--peak-tflops", type=float, help="the device's dense bf16 peak (overrides the table)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-decode", action="store_true", help="skip the decoding measurement")
    parser.add_argument("--decode-batch", type=int, default=32, help="utterances per decoding batch")
    parser.add_argument("--decode-batches", type=int, default=3, help="timed decoding batches")
    parser.add_argument("--decode-beam", type=int, default=10)
    parser.add_argument("--decode-ctc", type=float, default=0.3, help="CTC weight of the joint beam search")
    parser.add_argument("--decode-fp32", action="store_true", help="decode without bf16 autocast")
    parser.add_argument("--no-frontend", action="store_true", help="skip the device frontend measurement")
    parser.add_argument("--out", type=Path, default=ROOT / "exp/gpu_check.json")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    device = pick_device(args.device)
    config, rate = model_config(args.config)
    torch.manual_seed(args.seed)
    bare = build_model(config).to(device).train()
    model = torch.compile(bare) if args.compile else bare
    optimizer = torch.optim.AdamW(bare.parameters(), lr=LR, betas=(0.9, 0.98), eps=1e-9, weight_decay=1e-2)
    peak = peak_tflops(device, args.peak_tflops)
    print_header(args, device, config, count_parameters(bare), peak)
    report = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "torch": torch.__version__, "cuda": torch.version.cuda, "config": args.config.name,
              "params": count_parameters(bare), "vocab_size": config.vocab_size, "tokens_per_second": rate,
              "compile": args.compile, "autocast": "bf16", "peak_tflops": peak[0], "peak_source": peak[1],
              "warmup_steps": args.warmup, "runs": []}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    print(f"\n{TABLE_HEADER}", flush=True)
    for cap in batch_caps(args.config, args.batch_seconds):
        report["runs"].append(run_cap(model, optimizer, config, rate, cap, args, device, peak[0]))
        print_row(report["runs"][-1])
        args.out.write_text(json.dumps(report, indent=2) + "\n")  # after each run: a timeout keeps the rest
    if not args.no_frontend:
        report["frontend"] = measure_frontend(min(batch_caps(args.config, args.batch_seconds)), device)
        print(f"\ndevice frontend (fbank + CMVN + SpecAugment), {report['frontend']['batch_seconds']:g} s batches: "
              f"{report['frontend']['audio_s_per_s']:,.0f} audio-s/s", flush=True)
        args.out.write_text(json.dumps(report, indent=2) + "\n")
    if not args.no_decode:
        report["decoding"] = measure_decoding(bare, config, rate, args, device)
        print_decoding(report["decoding"])
        args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
