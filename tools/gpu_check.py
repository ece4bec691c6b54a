"""GPU check: train a config's model on synthetic batches under bf16 autocast and report
audio-seconds/s, steps/s, peak GPU memory, model FLOP utilization (MFU), the share of the step the
GPU is busy and a profile (top kernels by GPU time, host time per step, kernel launches and host
synchronizations per step); then the device frontend, and decoding (beam 10 + CTC weight 0.3, 32
utterances per batch, bf16): real-time factor, utterances/s, host synchronizations per step.

    bash tools/gpu_check.sh                                  # conf/librispeech_100h_conformer.yaml
    python tools/gpu_check.py --config conf/librispeech_960h_conformer.yaml --batch-seconds 550 --no-decode
    python tools/gpu_check.py --device cpu --config conf/tiny.yaml --batch-seconds 10 --warmup 1 --steps 2 \\
        --profile-steps 1 --decode-batch 2 --decode-batches 1          # dry run on the CPU

Runs where only torch and pyyaml are installed (no audio files, no soundfile, no network): it
imports asr.config, asr.model, asr.search and asr.device_frontend, and whichever `asr` comes first
on PYTHONPATH is the one measured (tools/device_check.sh measures this tree and the baseline's
`asr` with this same harness; the report names the package's folder). Exits with status 2 and one
line when there is no CUDA device (or it lacks bf16).

Batches: never reused. Each measured step gets its own batch, cut as the training sampler
(asr/sampler.py) cuts them: a pool of LibriSpeech-like durations (gamma, mean 12 s, clipped to
1-35 s, as tools/bench_data.py) split into duration buckets (quantiles), shuffled within each
bucket, cut greedily into batches of at most --batch-seconds padded seconds (utterances x
longest), and the batches shuffled; the pool is made large enough that warm-up, timed, profiled
and sync-counted steps all get distinct batches (every step a new (B, T), as in training: a
harness that cycles through a few batches flatters every per-shape cache: cuDNN plans, the
allocator, torch.compile). The same --seed gives the same batches on every tree. Each batch is
random features (B, T, n_mels) at 100 frames per second and random targets, made on the device
before the clock starts. Vocabulary: the config's sentencepiece size + 2 (blank and sos/eos),
else bench_model.load's assumption (31 characters); token rate: bench_model.load's (5 per second
for librispeech_*, 15 otherwise).

Step: the trainer's (asr/trainer.py): Adam or AdamW as the config's training section says (betas,
eps, weight decay; fused, as the trainer makes it; lr 1e-4, see LR), forward under bf16 autocast,
backward, gradient clipping at the config's grad_clip, the step's one host synchronization (the
non-finite check of the gradient norm), optimizer step. The lengths go to the model on the host
where it takes them there (asr/model/asr_model.py: CTC then reads them without waiting for the
GPU), else on the device (37a736d's model builds its masks on the lengths' device): --lengths,
"auto" tries the host in one untimed step; the report says which. No learning-rate schedule, no
loader, no host-to-device copy of the features: the model's and the optimizer's work only (the
recipe's stage 4 measures the rest). --warmup steps first (with --compile they absorb the first
compilations; later shapes may compile again, as in training), then --steps steps timed between two
device synchronizations (median and slowest step shown), then --profile-steps steps under
torch.profiler, then one step under torch.cuda.set_sync_debug_mode to count its host
synchronizations.

MFU = model FLOPs per second / the device's dense bf16 peak (PEAK_TFLOPS by device name, or
--peak-tflops). The model FLOPs of a step are 3 x tools/bench_model.py's batch_forward_flops of the
batch's utterances at their own lengths (useful work: padding earns nothing; every matrix product
and convolution of the model counted, the Conformer's included, checked against FlopCounterMode
in tests/test_bench_tools.py); "MFU padded" counts what the padded batch computes.

Profile (torch.profiler over --profile-steps steps): GPU busy = the time at least one GPU kernel
or copy runs / the wall time of the profiled steps (the profiler slows the host a little, so this
is a lower bound; "busy vs timed" divides the same GPU time per step by the unprofiled mean step);
host ms per step = wall time less the time the host waits in CUDA synchronizations; op CPU ms per
step = the self CPU time of torch's operators and CUDA runtime calls, waits excluded; launches per
step = GPU kernels run; host syncs per step = cudaStreamSynchronize / cudaDeviceSynchronize /
cudaEventSynchronize / blocking cudaMemcpy calls (the harness's own closing synchronization not
counted), and, separately, the synchronizations torch.cuda.set_sync_debug_mode reports in one
step. Top kernels by GPU time and top operators by self CPU time, per step.

Peak memory: torch.cuda.max_memory_allocated over the warm-up and timed steps, less the
pre-made batches other than the largest (they stay on the device until their turn).

Decoding: the trained model's weights never end a hypothesis (its eos logit is pushed down), so
every utterance runs to a realistic length (the token rate above x its duration, through
max_len_ratio), as tools/bench_decode.py does; --decode-batches batches of --decode-batch
utterances of the same LibriSpeech-like durations (at most 20 s), random features, encoder and
search under bf16 autocast (fp32 with --decode-fp32), one untimed warm-up batch first. RTF =
seconds of decoding / seconds of audio. Host synchronizations are counted on CUDA with
torch.cuda.set_sync_debug_mode on one more batch; the search promises at most one per step.

Prints tables as it goes and rewrites the JSON (--out) after each measurement, so a run cut short
keeps what it measured. A batch size that runs out of device memory gets a row saying so.
"""
from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
import math
import random
import statistics
import sys
import time
import traceback
import warnings
from collections import Counter, defaultdict
from pathlib import Path
from typing import NamedTuple

import torch
import yaml
from bench_model import FRAMES_PER_SECOND, batch_forward_flops, load

import asr
from asr.model import ASRModel, ModelConfig, build_model, count_parameters
from asr.search import SearchOptions, decode_memory, max_lengths

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_BATCH_SECONDS = 200.0  # DataConfig.max_batch_seconds (asr.loader needs soundfile: not imported here)
LARGE_BATCH_SECONDS = 2000.0  # the second micro-batch measured by default: what an H200 holds easily
NUM_BUCKETS = 30  # the training sampler's default (asr/sampler.py)
# The trainer's optimizer defaults (asr/train_config.py) where the config's training section says nothing
OPTIMIZER_DEFAULTS = {"optimizer": "adamw", "betas": (0.9, 0.98), "eps": 1e-9, "weight_decay": 1e-2, "grad_clip": 5.0}
LR = 1e-4  # every step at a warm-up's small rate: random data at the peak rate could go non-finite (a skipped
# update is less work); the rate does not change the work of a step
DECODE_MAX_SECONDS = 20.0  # longest utterance of the decoding batches
SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cuStreamSynchronize",
              "cuCtxSynchronize", "cudaMemcpy")  # runtime calls that block the host until the GPU is done
LAUNCH_MARKERS = ("LaunchKernel", "LaunchCooperativeKernel", "cudaGraphLaunch")  # runtime launch calls
TOP = 12  # rows of the profile tables

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
    host_lens: tuple[torch.Tensor, torch.Tensor]  # feat_lens and token_lens on the host (see --lengths)
    audio_s: float  # sum of the utterances' durations
    padded_s: float  # B x the longest
    flops: float  # training FLOPs (3 x forward) of the utterances at their own lengths
    padded_flops: float  # training FLOPs of the padded batch
    nbytes: int  # device memory the batch's tensors hold


# ---------------------------------------------------------------------------------------------
# synthetic batches


def librispeech_durations(n: int, rng: random.Random) -> list[float]:
    """n durations in seconds: gamma (shape 6, scale 2: mean 12 s), clipped to 1-35 s."""
    return [min(max(rng.gammavariate(6.0, 2.0), 1.0), 35.0) for _ in range(n)]


def cut_batches(durations: list[float], cap: float, rng: random.Random,
                num_buckets: int = NUM_BUCKETS) -> list[list[float]]:
    """The training sampler's cut: `durations` (those <= cap) split into `num_buckets` duration
    buckets (quantiles), shuffled within each bucket, cut greedily into batches of longest x count
    <= cap, the batches shuffled."""
    kept = sorted(d for d in durations if d <= cap)
    size = max(1, math.ceil(len(kept) / num_buckets))
    batches: list[list[float]] = []
    for start in range(0, len(kept), size):
        bucket = kept[start:start + size]
        rng.shuffle(bucket)
        batch: list[float] = []
        for d in bucket:
            if batch and max(max(batch), d) * (len(batch) + 1) > cap:
                batches.append(batch)
                batch = []
            batch.append(d)
        if batch:
            batches.append(batch)
    rng.shuffle(batches)
    return batches


def sampler_batches(cap: float, count: int, seed: int) -> list[list[float]]:
    """`count` distinct batches (durations in seconds) of at most `cap` padded seconds, cut by
    `cut_batches` from a pool large enough to give them all (never one batch twice)."""
    if cap < 1.0:
        raise ValueError(f"--batch-seconds {cap:g} is shorter than the shortest utterance (1 s)")
    pool = max(64, int(1.3 * count * cap / 12.0))  # about the utterances `count` batches hold (mean 12 s)
    while True:
        rng = random.Random(seed)
        batches = cut_batches(librispeech_durations(pool, rng), cap, rng)
        if len(batches) >= count:
            return batches[:count]
        pool *= 2


def make_batch(durations: list[float], config: ModelConfig, rate: float, device: torch.device) -> SyntheticBatch:
    """Random features and targets for utterances of `durations` (seconds), on `device`."""
    frames = [int(d * FRAMES_PER_SECOND) for d in durations]
    counts = [max(1, round(d * rate)) for d in durations]
    feats = torch.randn(len(frames), max(frames), config.n_mels, device=device)
    tokens = torch.randint(2, config.vocab_size - 1, (len(counts), max(counts)), device=device)  # no blank/unk/sos
    lens = torch.tensor(counts, device=device)
    tokens = tokens.masked_fill(torch.arange(max(counts), device=device) >= lens[:, None], -1)
    feat_lens = torch.tensor(frames, device=device)
    host_lens = (torch.tensor(frames), torch.tensor(counts))
    if device.type == "cuda":  # as the training loader gives them (pin_memory)
        host_lens = tuple(t.pin_memory() for t in host_lens)
    flops = 3.0 * batch_forward_flops(config, frames, counts)
    padded = 3.0 * batch_forward_flops(config, frames, counts, padded=True)
    nbytes = sum(_allocated(t) for t in (feats, tokens, lens, feat_lens))
    return SyntheticBatch(feats, feat_lens, tokens, lens, host_lens, sum(durations), len(durations) * max(durations),
                          flops, padded, nbytes)


def _allocated(t: torch.Tensor) -> int:
    """Bytes the caching allocator gives a tensor (blocks of 512 bytes)."""
    return -(-t.numel() * t.element_size() // 512) * 512


def make_batches(config: ModelConfig, rate: float, cap: float, count: int, device: torch.device,
                 seed: int) -> list[SyntheticBatch]:
    """`count` distinct batches of at most `cap` padded seconds (see `sampler_batches`)."""
    torch.manual_seed(seed)
    return [make_batch(d, config, rate, device) for d in sampler_batches(cap, count, seed)]


# ---------------------------------------------------------------------------------------------
# training steps


def training_settings(config_path: Path) -> dict:
    """The optimizer settings of the config's training section, with the trainer's defaults."""
    training = yaml.safe_load(config_path.read_text()).get("training") or {}
    settings = {key: training.get(key, value) for key, value in OPTIMIZER_DEFAULTS.items()}
    settings["betas"] = tuple(settings["betas"])
    return {**settings, "lr": LR}


def make_optimizer(model: torch.nn.Module, settings: dict, device: torch.device) -> torch.optim.Optimizer:
    """The trainer's optimizer (asr/trainer.py make_run): Adam or AdamW, fused on the CPU and CUDA."""
    cls = torch.optim.AdamW if settings["optimizer"] == "adamw" else torch.optim.Adam
    return cls(model.parameters(), lr=settings["lr"], betas=settings["betas"], eps=settings["eps"],
               weight_decay=settings["weight_decay"], fused=device.type in ("cpu", "cuda") or None)


LENGTHS = {"host": False}  # where the step passes the lengths: on the host when True (see resolve_lengths)


def train_step(model: torch.nn.Module, params: list[torch.nn.Parameter], optimizer: torch.optim.Optimizer,
               batch: SyntheticBatch, device: torch.device, grad_clip: float) -> bool:
    """One optimizer step as asr.trainer takes it; False when skipped for a non-finite gradient norm."""
    feat_lens, token_lens = batch.host_lens if LENGTHS["host"] else (batch.feat_lens, batch.token_lens)
    with torch.autocast(device.type, dtype=torch.bfloat16):
        out = model(batch.feats, feat_lens, batch.tokens, token_lens)
    out.loss.backward()
    grad_norm = torch.nn.utils.clip_grad_norm_(params, grad_clip)
    finite = math.isfinite(float(grad_norm))  # the step's one host synchronization
    if finite:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return finite


def run_steps(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batches: list[SyntheticBatch],
              device: torch.device, grad_clip: float) -> tuple[int, list[float]]:
    """Train on `batches` in order; (skipped non-finite steps, host seconds of each step). The
    step's host synchronization makes each time close to the device's (its optimizer update
    runs on into the next step)."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    skipped, times = 0, []
    for batch in batches:
        start = time.perf_counter()
        skipped += not train_step(model, params, optimizer, batch, device, grad_clip)
        times.append(time.perf_counter() - start)
    return skipped, times


def resolve_lengths(wanted: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: SyntheticBatch,
                    device: torch.device, grad_clip: float) -> str:
    """Where the steps pass feat_lens and token_lens ("host" or "device"), set in LENGTHS. "auto":
    on the host when the model takes them there (the trainer keeps them on the host, so that CTC
    reads them without waiting for the GPU), found by one step on `batch`; else on the device (a
    tree whose model builds its masks on the lengths' device, 37a736d's, fails that step with a
    device mismatch)."""
    if wanted == "auto":
        if device.type != "cuda":
            wanted = "device"  # the same place
        else:
            LENGTHS["host"] = True
            params = [p for group in optimizer.param_groups for p in group["params"]]
            try:
                train_step(model, params, optimizer, batch, device, grad_clip)
                wanted = "host"
            except torch.OutOfMemoryError:
                raise
            except RuntimeError as e:
                if "device" not in str(e):
                    raise
                optimizer.zero_grad(set_to_none=True)
                wanted = "device"
    LENGTHS["host"] = wanted == "host"
    return wanted


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batches: list[SyntheticBatch], warmup: int,
            device: torch.device, grad_clip: float) -> dict:
    """Warm up on the first `warmup` batches, then time the rest."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    skipped, _ = run_steps(model, optimizer, batches[:warmup], device, grad_clip)
    synchronize(device)
    start = time.perf_counter()
    timed = batches[warmup:]
    timed_skipped, times = run_steps(model, optimizer, timed, device, grad_clip)
    synchronize(device)
    elapsed = time.perf_counter() - start
    audio, padded = sum(b.audio_s for b in timed), sum(b.padded_s for b in timed)
    return {"steps": len(timed), "elapsed_s": elapsed, "steps_per_s": len(timed) / elapsed,
            "audio_s_per_s": audio / elapsed, "utts_per_batch": sum(b.feats.shape[0] for b in timed) / len(timed),
            "padded_s_per_batch": padded / len(timed), "padding": 1 - audio / padded,
            "distinct_shapes": len({tuple(b.feats.shape) for b in timed}),
            "tflops": sum(b.flops for b in timed) / elapsed / 1e12,
            "tflops_padded": sum(b.padded_flops for b in timed) / elapsed / 1e12,
            "median_step_ms": 1e3 * statistics.median(times), "slowest_step_ms": 1e3 * max(times),
            "skipped_steps": skipped + timed_skipped}


# ---------------------------------------------------------------------------------------------
# the profile


class ProfileEvent(NamedTuple):
    """One torch.profiler event, reduced to what the summary reads."""

    name: str
    on_device: bool  # a GPU kernel, copy or set (else a CPU operator or CUDA runtime call)
    start_us: float
    end_us: float
    self_cpu_us: float  # host time in the event itself, children excluded (0 on the device)


def profile_events(prof: torch.profiler.profile) -> list[ProfileEvent]:
    """The profiler's events as ProfileEvents: CPU operators and CUDA runtime calls, and the GPU's
    kernels, copies and sets; not the GPU-side mirrors of record_function ranges (user annotations,
    e.g. "Optimizer.step#AdamW.step", which span gaps between kernels) nor synchronization spans."""
    from torch.autograd import DeviceType

    events = list(prof.events())
    host_names = {e.name for e in events if e.device_type == DeviceType.CPU}
    out = []
    for e in events:
        on_device = e.device_type != DeviceType.CPU
        # (torch without the flag: a GPU event named as a host one is taken for an annotation)
        annotation = e.is_user_annotation if hasattr(e, "is_user_annotation") else e.name in host_names
        if on_device and (annotation or "Sync" in e.name):
            continue
        out.append(ProfileEvent(e.name, on_device, float(e.time_range.start), float(e.time_range.end),
                                0.0 if on_device else float(e.self_cpu_time_total)))
    return out


def busy_us(intervals: list[tuple[float, float]]) -> float:
    """Microseconds covered by the union of (start, end) intervals."""
    total, end = 0.0, -math.inf
    for s, e in sorted(intervals):
        if e > end:
            total += e - max(s, end)
            end = e
    return total


def summarize_profile(events: list[ProfileEvent], steps: int, wall_s: float, own_syncs: int = 0) -> dict:
    """Per-step figures of `steps` profiled steps that took `wall_s` (see the module docstring);
    `own_syncs`: the harness's own synchronizations among the events, not counted."""
    device = [e for e in events if e.on_device]
    host = [e for e in events if not e.on_device]
    kernels = [e for e in device if not e.name.startswith(("Memcpy", "Memset"))]
    waits = [e for e in host if e.name in SYNC_CALLS]
    wait_us = sum(e.end_us - e.start_us for e in waits)
    gpu_us = busy_us([(e.start_us, e.end_us) for e in device])
    per_step = 1e-3 / steps  # us in all -> ms per step
    return {
        "steps": steps, "wall_ms_per_step": 1e3 * wall_s / steps,
        "gpu_ms_per_step": gpu_us * per_step, "gpu_busy": gpu_us / (1e6 * wall_s) if device else None,
        "host_ms_per_step": (1e6 * wall_s - wait_us) * per_step, "host_wait_ms_per_step": wait_us * per_step,
        "op_cpu_ms_per_step": (sum(e.self_cpu_us for e in host) - wait_us) * per_step,
        "launches_per_step": len(kernels) / steps if device else None,
        "launch_calls_per_step": sum(any(m in e.name for m in LAUNCH_MARKERS) for e in host) / steps,
        "host_syncs_per_step": (len(waits) - own_syncs) / steps if device else None,
        "top_kernels": _top(kernels, steps, lambda e: e.end_us - e.start_us),
        "top_cpu_ops": _top([e for e in host if e.name not in SYNC_CALLS], steps, lambda e: e.self_cpu_us),
    }


def _top(events: list[ProfileEvent], steps: int, cost) -> list[dict]:
    """The TOP names by summed cost (us): calls and ms per step, share of all the events' cost."""
    total, calls = defaultdict(float), defaultdict(int)
    for e in events:
        total[e.name] += cost(e)
        calls[e.name] += 1
    whole = sum(total.values()) or 1.0
    ranked = sorted(total, key=total.get, reverse=True)[:TOP]
    return [{"name": name, "calls_per_step": calls[name] / steps, "ms_per_step": 1e-3 * total[name] / steps,
             "share": total[name] / whole} for name in ranked]


def profile_steps(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batches: list[SyntheticBatch],
                  device: torch.device, grad_clip: float) -> dict:
    """summarize_profile of training on `batches` under torch.profiler."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    synchronize(device)
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        run_steps(model, optimizer, batches, device, grad_clip)
        synchronize(device)
        wall = time.perf_counter() - start
    return summarize_profile(profile_events(prof), len(batches), wall, own_syncs=int(device.type == "cuda"))


def count_syncs(fn, sites: Counter | None = None) -> int | None:
    """Host synchronizations CUDA reports while fn() runs (None on the CPU); `sites` counts the
    line of this repository each was reported from (with its two callers, innermost first)."""
    if not torch.cuda.is_available() or torch.cuda.get_sync_debug_mode() != 0:
        return None
    count = 0

    def show(message, *args, **kwargs) -> None:
        nonlocal count
        if "synchroniz" not in str(message):
            return
        count += 1
        if sites is not None:
            frames = [f for f in traceback.extract_stack()[:-1] if f.filename.startswith(str(ROOT))][-3:]
            sites[" <- ".join(f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in reversed(frames))] += 1

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = show  # restored when the block ends
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return count


# ---------------------------------------------------------------------------------------------
# decoding


def decode_batches(config: ModelConfig, args: argparse.Namespace, device: torch.device) -> list[tuple]:
    """--decode-batches + 2 batches (warm-up, sync count) of (feats, feat_lens, audio seconds) on the device."""
    rng, generator = random.Random(args.seed + 1), torch.Generator().manual_seed(args.seed + 1)
    out = []
    for _ in range(args.decode_batches + 2):
        durations = [min(d, DECODE_MAX_SECONDS) for d in librispeech_durations(args.decode_batch, rng)]
        frames = torch.tensor([int(d * FRAMES_PER_SECOND) for d in durations], device=device)
        feats = torch.randn(len(durations), int(frames.max()), config.n_mels, generator=generator).to(device)
        out.append((feats, frames, sum(durations)))
    return out


def decode_once(model: ASRModel, batch: tuple, options: SearchOptions, dtype: torch.dtype | None) -> None:
    feats, frames, _ = batch
    with torch.no_grad(), torch.autocast(feats.device.type, dtype=dtype, enabled=dtype is not None):
        decode_memory(model, *model.encoder(feats, frames), options)  # (encoder: 37a736d's ASRModel has no encode)


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
            "host_syncs": syncs, "search_steps": steps,
            "host_syncs_per_step": None if syncs is None else syncs / steps}


def print_decoding(r: dict) -> None:
    mem = f"{r['peak_memory_gib']:.1f} GiB" if r["peak_memory_gib"] is not None else "n/a"
    syncs = "n/a" if r["host_syncs"] is None else \
        f"{r['host_syncs']} in ~{r['search_steps']} steps ({r['host_syncs_per_step']:.2f} per step)"
    print(f"\ndecoding: beam {r['beam']} + CTC {r['ctc_weight']:g}, {r['batch']} utterances x {r['batches']} batches, "
          f"{r['autocast']}: RTF {r['rtf']:.4f}, {r['utts_per_s']:.1f} utterances/s, peak {mem}, "
          f"host syncs {syncs}", flush=True)


# ---------------------------------------------------------------------------------------------
# the driver


def measure_frontend(cap: float, device: torch.device, repeats: int = 10) -> dict:
    """The device frontend (asr.device_frontend: batched fbank, CMVN, SpecAugment of padded 16 kHz
    waveforms, as `data.frontend: device` runs it in the training step) on synthetic batches of
    `cap` padded seconds: audio seconds per second and host synchronizations per call, as shipped
    and, where the measured tree has them, with the feature augmentations on (data.augment's warp,
    gain and equaliser at prob 0.5: their draws are made on the host, their rows copied without a
    wait)."""
    from asr.device_frontend import DeviceFrontend
    from asr.features import CMVNStats, FeatureConfig, SpecAugmentConfig

    features = FeatureConfig()
    stats = CMVNStats(features.n_mels)
    stats.add(torch.randn(100, features.n_mels))
    batches = [sorted(b, reverse=True) for b in sampler_batches(cap, repeats + 3, seed=0)]
    prepared = []
    for b in batches:
        lens = torch.tensor([int(d * 16000) for d in b])
        waves = torch.randn(len(b), int(lens.max())) * 0.1
        waves[torch.arange(waves.shape[1]) >= lens[:, None]] = 0.0
        prepared.append((waves.to(device), lens, torch.arange(len(b))))
    audio = sum(sum(b) for b in batches[2:-1])

    def measure(frontend) -> dict:
        for waves, lens, idx in prepared[:2]:  # warm-up
            frontend(waves, lens, idx, 0, training=True)
        synchronize(device)
        start = time.perf_counter()
        for waves, lens, idx in prepared[2:-1]:
            frontend(waves, lens, idx, 0, training=True)
        synchronize(device)
        seconds = time.perf_counter() - start
        waves, lens, idx = prepared[-1]
        return {"audio_s_per_s": audio / seconds,
                "host_syncs_per_call": count_syncs(lambda: frontend(waves, lens, idx, 0, training=True))}

    report = {"batch_seconds": cap, "batches": len(prepared) - 3, "audio_seconds": audio,
              **measure(DeviceFrontend(features, stats, SpecAugmentConfig(), seed=0).to(device))}
    try:  # a tree whose frontend has no data.augment (or no equaliser): measured as shipped only
        from asr.augment import AugmentConfig, EqConfig, GainConfig, WarpConfig
    except ImportError:
        return report
    if "augment" not in inspect.signature(DeviceFrontend).parameters:
        return report
    augment = AugmentConfig(warp=WarpConfig(prob=0.5), gain=GainConfig(prob=0.5), eq=EqConfig(prob=0.5))
    report["augmented"] = measure(DeviceFrontend(features, stats, SpecAugmentConfig(), seed=0,
                                                 augment=augment).to(device))
    return report


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
    """--batch-seconds, else the config's data.max_batch_seconds (when a number) and LARGE_BATCH_SECONDS."""
    if given:
        return given
    data = yaml.safe_load(config_path.read_text()).get("data") or {}
    cap = data.get("max_batch_seconds", DEFAULT_BATCH_SECONDS)
    caps = [float(cap)] if isinstance(cap, (int, float)) else []  # "auto" is probed in training, not here
    return sorted(set(caps + [LARGE_BATCH_SECONDS]))


def print_header(args: argparse.Namespace, device: torch.device, config: ModelConfig, params: int,
                 peak: tuple[float | None, str]) -> None:
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    cuda = f", CUDA {torch.version.cuda}" if device.type == "cuda" else ""
    print(f"device {name} ({device}), torch {torch.__version__}{cuda}; asr from {Path(asr.__file__).parent}"
          + (f" ({args.label})" if args.label else ""))
    print(f"model {args.config.name}: {params / 1e6:.2f}M parameters, vocabulary {config.vocab_size}; "
          f"bf16 autocast; torch.compile {'on' if args.compile else 'off'}; {args.warmup} warm-up + {args.steps} "
          f"timed + {args.profile_steps} profiled steps per batch size, every step a new batch")
    print(f"peak {peak[0] or 'n/a'} TFLOPS dense bf16 ({peak[1]})")


TABLE_HEADER = (f"{'cap s':>6}{'utts/batch':>11}{'padded s':>9}{'padding':>8}{'steps/s':>9}{'step ms':>16}"
                f"{'audio s/s':>11}{'peak GiB':>9}{'TFLOP/s':>9}{'MFU':>7}{'MFU padded':>11}{'GPU busy':>9}")


def _percent(value: float | None) -> str:
    return "n/a" if value is None else f"{100 * value:.1f}%"


def _num(value: float | None, spec: str = ".1f") -> str:
    return "n/a" if value is None else format(value, spec)


def print_row(r: dict) -> None:
    if "error" in r:
        print(f"{r['batch_seconds']:>6g}  {r['error']}")
        return
    mem = f"{r['peak_memory_gib']:.1f}" if r["peak_memory_gib"] is not None else "n/a"
    step = f"{r['median_step_ms']:.0f} (max {r['slowest_step_ms']:.0f})"
    busy = (r.get("profile") or {}).get("gpu_busy")
    print(f"{r['batch_seconds']:>6g}{r['utts_per_batch']:>11.1f}{r['padded_s_per_batch']:>9.1f}"
          f"{100 * r['padding']:>7.1f}%{r['steps_per_s']:>9.2f}{step:>16}{r['audio_s_per_s']:>11.0f}{mem:>9}"
          f"{r['tflops']:>9.2f}{_percent(r['mfu']):>7}{_percent(r['mfu_padded']):>11}{_percent(busy):>9}", flush=True)


def print_profile(r: dict) -> None:
    """The profile of one batch cap: per-step figures, then the top kernels and CPU operators."""
    p = r.get("profile")
    if not p:
        return
    if "error" in p:
        print(f"  profile: {p['error']}")
        return
    print(f"  profile at {r['batch_seconds']:g} s, {p['steps']} steps: wall {p['wall_ms_per_step']:.1f} ms/step, "
          f"GPU {p['gpu_ms_per_step']:.1f} ms/step (busy {_percent(p['gpu_busy'])}, "
          f"vs timed {_percent(p.get('gpu_busy_vs_timed'))}), host {p['host_ms_per_step']:.1f} ms/step "
          f"(ops {p['op_cpu_ms_per_step']:.1f}, waiting {p['host_wait_ms_per_step']:.1f}), "
          f"launches {_num(p['launches_per_step'], '.0f')}/step, host syncs {_num(p['host_syncs_per_step'])}/step "
          f"(sync debug mode: {_num(r.get('sync_debug_syncs_per_step'), '.0f')})")
    for site, n in (r.get("sync_sites") or {}).items():
        print(f"    sync x{n}: {site}")
    for title, rows in (("GPU kernels", p["top_kernels"]), ("CPU operators (self time)", p["top_cpu_ops"])):
        if rows:
            print(f"    {'top ' + title:<72}{'calls/step':>11}{'ms/step':>9}{'share':>7}")
            for k in rows:
                print(f"    {k['name'][:70]:<72}{k['calls_per_step']:>11.1f}{k['ms_per_step']:>9.2f}"
                      f"{100 * k['share']:>6.1f}%")


def run_cap(model: torch.nn.Module, optimizer: torch.optim.Optimizer, config: ModelConfig, rate: float, cap: float,
            args: argparse.Namespace, device: torch.device, peak: float | None, grad_clip: float) -> dict:
    """The measurements at one batch cap; {"batch_seconds", "error"} when the device runs out of memory."""
    count = args.warmup + args.steps + args.profile_steps + 1
    try:
        batches = make_batches(config, rate, cap, count, device, args.seed)
        timed = batches[:args.warmup + args.steps]
        row = {"batch_seconds": cap, **measure(model, optimizer, timed, args.warmup, device, grad_clip)}
        row["peak_memory_gib"] = _peak_gib(device, batches)
    except torch.OutOfMemoryError:
        optimizer.zero_grad(set_to_none=True)
        return {"batch_seconds": cap, "error": "out of memory (try a smaller --batch-seconds)"}
    row["mfu"] = row["tflops"] / peak if peak else None
    row["mfu_padded"] = row["tflops_padded"] / peak if peak else None
    rest = batches[args.warmup + args.steps:]  # profiled steps, then the sync-counted one
    if args.profile_steps:
        row["profile"] = _guarded(lambda: profile_steps(model, optimizer, rest[:-1], device, grad_clip))
        if device.type == "cuda" and "error" not in row["profile"]:  # the same GPU time over the unprofiled step
            timed_ms = 1e3 * row["elapsed_s"] / row["steps"]
            row["profile"]["gpu_busy_vs_timed"] = row["profile"]["gpu_ms_per_step"] / timed_ms
    params = [p for group in optimizer.param_groups for p in group["params"]]
    sites = Counter()
    row["sync_debug_syncs_per_step"] = count_syncs(
        lambda: train_step(model, params, optimizer, rest[-1], device, grad_clip), sites)
    row["sync_sites"] = dict(sites.most_common())
    return row


def _peak_gib(device: torch.device, batches: list[SyntheticBatch]) -> float | None:
    """Peak device memory of the steps (GiB), less the pre-made batches other than the largest."""
    if device.type != "cuda":
        return None
    waiting = sum(b.nbytes for b in batches) - max(b.nbytes for b in batches)
    return (torch.cuda.max_memory_allocated(device) - waiting) / 2**30


def _guarded(fn) -> dict:
    """fn(), or {"error": ...} when it raises: a failing profile must not lose the measurements."""
    try:
        return fn()
    except Exception as e:  # reported in the JSON and the table
        return {"error": f"{type(e).__name__}: {e}"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", type=Path, default=ROOT / "conf/librispeech_100h_conformer.yaml")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--batch-seconds", type=float, nargs="+",
                        help=f"padded seconds per batch, one run each (default: the config's, {LARGE_BATCH_SECONDS:g})")
    parser.add_argument("--warmup", type=int, default=10, help="untimed steps first (compilation included)")
    parser.add_argument("--steps", type=int, default=40, help="timed optimizer steps per batch size")
    parser.add_argument("--profile-steps", type=int, default=3, help="steps under torch.profiler (0: none)")
    parser.add_argument("--compile", action="store_true", help="torch.compile the model")
    parser.add_argument("--lengths", choices=("auto", "host", "device"), default="auto",
                        help="where the step passes the lengths (auto: the host when the model takes them there)")
    parser.add_argument("--peak-tflops", type=float, help="the device's dense bf16 peak (overrides the table)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--label", default="", help="a name for the tree measured, kept in the JSON")
    parser.add_argument("--no-decode", action="store_true", help="skip the decoding measurement")
    parser.add_argument("--decode-batch", type=int, default=32, help="utterances per decoding batch")
    parser.add_argument("--decode-batches", type=int, default=3, help="timed decoding batches")
    parser.add_argument("--decode-beam", type=int, default=10)
    parser.add_argument("--decode-ctc", type=float, default=0.3, help="CTC weight of the joint beam search")
    parser.add_argument("--decode-fp32", action="store_true", help="decode without bf16 autocast")
    parser.add_argument("--no-frontend", action="store_true", help="skip the device frontend measurement")
    parser.add_argument("--out", type=Path, default=ROOT / "exp/gpu_check.json")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    device = pick_device(args.device)
    config, rate = model_config(args.config)
    settings = training_settings(args.config)
    torch.manual_seed(args.seed)
    bare = build_model(config).to(device).train()
    model = torch.compile(bare) if args.compile else bare
    optimizer = make_optimizer(bare, settings, device)
    peak = peak_tflops(device, args.peak_tflops)
    print_header(args, device, config, count_parameters(bare), peak)
    report = {"label": args.label, "asr": str(Path(asr.__file__).parent), "config": args.config.name,
              "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "torch": torch.__version__, "cuda": torch.version.cuda, "model": dataclasses.asdict(config),
              "params": count_parameters(bare), "vocab_size": config.vocab_size, "tokens_per_second": rate,
              "optimizer": {**settings, "fused": device.type in ("cpu", "cuda")}, "compile": args.compile,
              "autocast": "bf16", "peak_tflops": peak[0], "peak_source": peak[1], "warmup_steps": args.warmup,
              "seed": args.seed, "runs": []}
    args.out.parent.mkdir(parents=True, exist_ok=True)

    def save() -> None:  # after each part: a run cut short keeps what it measured
        args.out.write_text(json.dumps(report, indent=2) + "\n")

    probe = make_batches(config, rate, min(batch_caps(args.config, args.batch_seconds)), 1, device, args.seed + 7)[0]
    report["lengths"] = resolve_lengths(args.lengths, model, optimizer, probe, device, settings["grad_clip"])
    del probe
    print(f"lengths passed on the {report['lengths']}")
    print(f"\n{TABLE_HEADER}", flush=True)
    for cap in batch_caps(args.config, args.batch_seconds):
        report["runs"].append(run_cap(model, optimizer, config, rate, cap, args, device, peak[0],
                                      settings["grad_clip"]))
        print_row(report["runs"][-1])
        print_profile(report["runs"][-1])  # at once: a run cut short keeps it in the log too
        save()
    if not args.no_frontend:
        report["frontend"] = _guarded(lambda: measure_frontend(min(batch_caps(args.config, args.batch_seconds)),
                                                               device))
        if "error" in report["frontend"]:
            print(f"\ndevice frontend: {report['frontend']['error']}", flush=True)
        else:
            r = report["frontend"]
            line = f"{r['audio_s_per_s']:,.0f} audio-s/s, host syncs per call {r['host_syncs_per_call']}"
            if "augmented" in r:
                a = r["augmented"]
                line += (f"; with warp, gain and equaliser at 0.5: {a['audio_s_per_s']:,.0f} audio-s/s, "
                         f"host syncs per call {a['host_syncs_per_call']}")
            print(f"\ndevice frontend (fbank + CMVN + SpecAugment), {r['batch_seconds']:g} s batches: {line}",
                  flush=True)
        save()
    if not args.no_decode:
        report["decoding"] = _guarded(lambda: measure_decoding(bare, config, rate, args, device))
        if "error" in report["decoding"]:
            print(f"\ndecoding: {report['decoding']['error']}", flush=True)
        else:
            print_decoding(report["decoding"])
        save()
    print(f"\nwrote {args.out}")
    return report


def failed(report: dict) -> bool:
    """Whether a part of `report` ended in an error (other than running out of memory)."""
    parts = [report.get("frontend"), report.get("decoding"), *(r.get("profile") for r in report["runs"])]
    return any(isinstance(p, dict) and "error" in p for p in parts)


if __name__ == "__main__":
    sys.exit(1 if failed(main()) else 0)
