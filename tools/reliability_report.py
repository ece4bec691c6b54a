"""Reliability runs: fuzz the audio reader, and SIGKILL training at random points then resume.

    python tools/reliability_report.py fuzz --seconds 30 --seed 0 [--out fuzz.json]
    python tools/reliability_report.py kill --trials 20 --seed 0 [--out kill.json]

fuzz: random byte mutations (bit flips, overwritten header fields, cuts, insertions, deletions,
duplicated runs) of small valid WAV, WAVEX and FLAC files at several rates and channel counts,
each read with `audio_info`, `load_audio` and `iter_blocks`. Only AudioError may come out, every
waveform read must be finite float32, and the blocks must add up to the whole. The address space
is capped a little above what the warm-up needed, so an allocation sized by a lying header shows
as a MemoryError instead of swapping. The case being read is written to WORKDIR/case.txt first,
so a crash of the process (libsndfile) names it; `--case N` replays one case and keeps its bytes.

kill: an uninterrupted run of conf/tiny.yaml (dropout, SpecAugment and dither on), then TRIALS
runs of the same config that are each killed with SIGKILL (the trainer and its loader workers)
one to three times at random moments, then resumed to the end. Every trial must end with
weights bit-identical to the uninterrupted run's, the same logged training losses, and no
temporary file left. The runs are forked from this process after the imports, so each costs
seconds rather than the interpreter's start-up.

Both print a two-column summary (and write the whole report as JSON with --out); the exit status
is 1 when anything failed.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import re
import resource
import signal
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import soundfile as sf

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "conf" / "tiny.yaml"

# ---------------------------------------------------------------------------------------------
# audio fuzzing

# (name, soundfile format, subtype, rate Hz, channels, seconds)
SEEDS = [
    ("pcm16.wav", "WAV", "PCM_16", 16000, 1, 0.25),
    ("float.wav", "WAV", "FLOAT", 44100, 2, 0.2),
    ("six.wav", "WAVEX", "PCM_24", 48000, 6, 0.1),
    ("pcm8k.wav", "WAV", "PCM_U8", 8000, 1, 0.3),
    ("pcm16.flac", "FLAC", "PCM_16", 16000, 1, 0.25),
    ("pcm24.flac", "FLAC", "PCM_24", 96000, 2, 0.1),
]
INTERESTING_32 = [0, 1, 0x7F, 0x80, 0xFF, 0x7FFF, 0x8000, 0xFFFF, 0x7FFFFFFF, 0x80000000, 0xFFFFFFFF, 0x7FFFF000]
MEMORY_HEADROOM = 1536 * 2**20  # bytes of address space allowed above the warm-up's


def seed_files() -> dict[str, bytes]:
    """{name: file bytes} of the valid files that mutations start from."""
    out = {}
    for name, fmt, subtype, rate, channels, seconds in SEEDS:
        n = round(rate * seconds)
        t = np.arange(n) / rate
        wave = np.stack([0.3 * np.sin(2 * np.pi * (220 + 110 * c) * t) for c in range(channels)], axis=1)
        path = Path(tempfile.mkdtemp()) / name
        sf.write(path, wave.astype(np.float32), rate, format=fmt, subtype=subtype)
        out[name] = path.read_bytes()
        path.unlink()
        path.parent.rmdir()
    return out


def mutate(data: bytes, rng: np.random.Generator) -> bytes:
    """One to four random mutations of `data`; header bytes (the first 64) are hit half the time."""
    buf = bytearray(data)
    for _ in range(int(rng.integers(1, 5))):
        if not buf:
            break
        kind = int(rng.integers(7))
        at = int(rng.integers(min(64, len(buf)))) if rng.random() < 0.5 else int(rng.integers(len(buf)))
        if kind == 0:  # flip a few bits
            for _ in range(int(rng.integers(1, 9))):
                i = int(rng.integers(len(buf)))
                buf[i] ^= 1 << int(rng.integers(8))
        elif kind == 1:  # one byte
            buf[at] = int(rng.choice([0, 0x7F, 0x80, 0xFF, int(rng.integers(256))]))
        elif kind == 2:  # a 32-bit field, either byte order
            value = int(rng.choice(INTERESTING_32)) if rng.random() < 0.7 else int(rng.integers(2**32))
            buf[at:at + 4] = value.to_bytes(4, "little" if rng.random() < 0.5 else "big")
        elif kind == 3:  # cut
            del buf[int(rng.integers(len(buf))):]
        elif kind == 4:  # insert random bytes
            buf[at:at] = rng.integers(0, 256, int(rng.integers(1, 64)), dtype=np.uint8).tobytes()
        elif kind == 5:  # delete a run
            del buf[at:at + int(rng.integers(1, 64))]
        else:  # duplicate a run
            buf[at:at] = buf[at:at + int(rng.integers(1, 256))]
    return bytes(buf)


def fuzz_case(seeds: dict[str, bytes], seed: int, index: int) -> tuple[str, bytes]:
    """(seed file name, mutated bytes) of case `index`: a pure function of (seed, index)."""
    rng = np.random.default_rng([seed, index])
    names = sorted(seeds)
    name = names[int(rng.integers(len(names)))]
    return name, mutate(seeds[name], rng)


def read_case(path: Path) -> str:
    """Read `path` with every reader; the outcome ("ok" or "AudioError") or raise what escaped."""
    import torch

    from asr.audio import AudioError, audio_info, iter_blocks, load_audio

    try:
        audio_info(path)
        wave = load_audio(path)
        blocks = list(iter_blocks(path, block_seconds=0.05))
    except AudioError as e:
        if "\n" in str(e) or not str(e).startswith(f"{path}: "):
            raise AssertionError(f"AudioError not one line naming the file: {e!r}") from None
        return "AudioError: " + " ".join(re.sub(r"[\d.]+", "N", e.reason.split(" (")[0]).split()[:6])
    if wave.dtype != torch.float32 or wave.ndim != 1 or not bool(torch.isfinite(wave).all()):
        raise AssertionError(f"load_audio gave {wave.dtype} {tuple(wave.shape)} with non-finite samples")
    joined = torch.cat(blocks) if blocks else torch.zeros(0)
    # The resampler sums each output over its neighbours, in another order for a block than for the
    # whole file: the rounding error scales with the loudest samples (a mutated float WAV can hold
    # 1e37), so the tolerance does too; for audio within [-1, 1] it is 1e-4.
    peak = float(wave.abs().max()) if wave.numel() else 0.0
    if joined.shape != wave.shape or not torch.allclose(joined, wave, atol=1e-4 * max(1.0, peak)):
        raise AssertionError(f"iter_blocks gave {tuple(joined.shape)} samples, load_audio {tuple(wave.shape)}")
    return "ok"


def fuzz(seconds: float, seed: int, workdir: Path, *, cap_memory: bool = True) -> dict[str, Any]:
    """Mutated files for `seconds` of wall time; {"cases", "outcomes", "failures", ...}."""
    import torch

    torch.set_num_threads(1)
    seeds = seed_files()
    workdir.mkdir(parents=True, exist_ok=True)
    path, progress = workdir / "case.bin", workdir / "case.txt"
    for name, data in seeds.items():  # warm-up: imports, resampling kernels of the seed rates
        path.write_bytes(data)
        if read_case(path) != "ok":
            raise RuntimeError(f"seed file {name} does not read back")
    if cap_memory:
        _cap_address_space(MEMORY_HEADROOM)
    outcomes: Counter[str] = Counter()  # "ok", or "AudioError: " and the first words of its reason
    failures = []
    index, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        name, data = fuzz_case(seeds, seed, index)
        progress.write_text(f"{seed} {index}\n")
        path.write_bytes(data)
        try:
            outcomes[read_case(path)] += 1
        except Exception as e:  # anything but AudioError: a finding
            failures.append({"case": index, "seed_file": name, "error": f"{type(e).__name__}: {str(e)[:300]}"})
            (workdir / f"failure-{index}.bin").write_bytes(data)
        index += 1
    progress.unlink(missing_ok=True)
    return {"seed": seed, "cases": index, "seconds": round(time.perf_counter() - start, 1),
            "read": outcomes["ok"], "refused": index - outcomes["ok"] - len(failures),
            "reasons": dict(outcomes.most_common()), "failures": failures, "seed_files": sorted(seeds)}


def replay(seed: int, index: int, workdir: Path) -> str:
    """Read case `index` again (its bytes kept in WORKDIR/case-<index>.bin); its outcome."""
    name, data = fuzz_case(seed_files(), seed, index)
    path = workdir / f"case-{index}.bin"
    path.write_bytes(data)
    return f"{name}: {read_case(path)}"


def _cap_address_space(headroom: int) -> None:
    """RLIMIT_AS = the current virtual size + headroom (bytes)."""
    with open("/proc/self/status") as f:
        vm = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
    resource.setrlimit(resource.RLIMIT_AS, (vm + headroom, resource.getrlimit(resource.RLIMIT_AS)[1]))


# ---------------------------------------------------------------------------------------------
# SIGKILL during training

TEXTS = ["HELLO WORLD", "GOOD MORNING", "SEE YOU SOON", "THANK YOU", "ONE TWO", "RED SKY", "BLUE SEA", "OLD TREE"]
# conf/tiny.yaml with dropout, SpecAugment and dither left on: the randomness a resume must replay.
KILL_OVERRIDES = ["training.max_steps=14", "training.epochs=100", "training.checkpoint_every=3",
                  "training.keep_last=2", "training.valid_decode_utts=1", "training.log_every=1",
                  "training.num_threads=1", "data.max_batch_seconds=1.5"]
TIMING_KEYS = ("audio_s_per_s",)  # logged values that depend on the clock


def write_corpus(folder: Path, n: int = 8, seconds: float = 0.6) -> tuple[Path, Path]:
    """(train manifest, valid manifest): `n` harmonic tones of different pitch and rhythm."""
    folder.mkdir(parents=True, exist_ok=True)
    rate, lines = 16000, []
    for i in range(n):
        t = np.arange(int(rate * (seconds + 0.1 * i))) / rate
        wave = sum(np.sin(2 * np.pi * (150 + 60 * i) * k * t) / k for k in range(1, 6))
        wave *= 0.5 + 0.5 * np.sin(2 * np.pi * (2 + i) * t)
        sf.write(folder / f"u{i}.wav", (0.1 * wave).astype(np.float32), rate)
        lines.append(json.dumps({"id": f"u{i}", "audio": f"u{i}.wav", "duration": len(t) / rate, "text": TEXTS[i]}))
    (folder / "train.jsonl").write_text("\n".join(lines) + "\n")
    (folder / "valid.jsonl").write_text("\n".join(lines[:2]) + "\n")
    return folder / "train.jsonl", folder / "valid.jsonl"


def _preimport() -> None:
    """What a training run imports on the way (seconds of it): once here, before the forks."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot
    import torch
    import torch._dynamo  # the optimizers import it
    from torch.utils.tensorboard import SummaryWriter  # noqa: F401

    import asr.cli
    import asr.train_asr  # noqa: F401

    torch.set_num_threads(1)


def _start_training(args: list[str], log: Path) -> int:
    """Fork `asr train ARGS` (asr.cli.main) in its own process group, output appended to `log`."""
    pid = os.fork()
    if pid:
        try:  # the child does the same: the group exists before either goes on, whoever runs first
            os.setpgid(pid, pid)
        except (PermissionError, ProcessLookupError):
            pass  # the child has set it already (or has ended)
        return pid
    code = 70
    try:
        os.setpgrp()
        fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        from asr import cli

        code = cli.main(["train", *args])
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _wait(pid: int) -> int:
    """Exit status of child `pid` (-N for a signal)."""
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


def _phase(exp: Path) -> str:
    """Where a run was when killed, from what it left on disk."""
    if any(exp.rglob("*.tmp")):
        return "writing a file"
    if (exp / "model_last.pt").exists():
        return "after the final model"
    if not (exp / "checkpoints" / "index.json").exists():
        return "before the first checkpoint" if (exp / "config.yaml").exists() else "starting"
    return "between checkpoints"


def _outcome(exp: Path) -> dict[str, Any]:
    """What a finished run leaves: final weights, logged records (clock-free), kept checkpoints."""
    import torch

    from asr.checkpoint import read_index
    from asr.train_log import read_records

    records = [{k: v for k, v in r.items() if k not in TIMING_KEYS} for r in read_records(exp / "metrics.jsonl")]
    state = torch.load(exp / "model_last.pt", weights_only=True)["state_dict"]
    return {"weights": state, "records": records,
            "checkpoints": [(e["file"], e["valid_loss"]) for e in read_index(exp / "checkpoints")]}


def _differences(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    import torch

    out = [f"weights of {k} differ" for k in a["weights"] if not torch.equal(a["weights"][k], b["weights"][k])]
    if a["records"] != b["records"]:
        out.append("logged records differ")
    if a["checkpoints"] != b["checkpoints"]:
        out.append(f"checkpoints differ: {a['checkpoints']} vs {b['checkpoints']}")
    return out


def kill_trials(trials: int, seed: int, workdir: Path) -> dict[str, Any]:
    """TRIALS runs killed 1-3 times each at random moments, resumed, and compared to one
    uninterrupted run; {"trials", "kills", "phases", "identical", "failures", ...}."""
    _preimport()
    train, valid = write_corpus(workdir / "data")

    def args(exp: Path, workers: int) -> list[str]:
        return ["--config", str(TINY), "--train", str(train), "--valid", str(valid), "--exp-dir", str(exp),
                *KILL_OVERRIDES, f"data.num_workers={workers}"]

    start = time.perf_counter()
    straight = workdir / "straight"
    if _wait(_start_training(args(straight, 0), workdir / "straight.log")) != 0:
        raise RuntimeError(f"the uninterrupted run failed: see {workdir / 'straight.log'}")
    run_seconds = time.perf_counter() - start
    reference = _outcome(straight)
    phases: Counter[str] = Counter()
    kills, finished_first, removed, failures = 0, 0, 0, []
    for trial in range(trials):
        rng = random.Random(f"{seed}-{trial}")
        exp, log = workdir / f"trial-{trial:03d}", workdir / f"trial-{trial:03d}.log"
        workers = 2 if trial % 4 == 3 else 0  # loader worker processes die with the trainer
        history = []  # where each start ended: the phase it was killed in, or "finished"
        for k in range(rng.randint(1, 3)):
            pid = _start_training(args(exp, workers), log)
            time.sleep(rng.uniform(0.0, run_seconds * (1.0 if k == 0 else 0.6)))  # a resumed run has less to do
            if _wait_nohang(pid):
                finished_first += 1
                history.append("finished")
                continue
            os.killpg(pid, signal.SIGKILL)
            _wait(pid)
            kills += 1
            history.append(_phase(exp))
            phases[history[-1]] += 1
        code = _wait(_start_training(args(exp, workers), log))
        text = log.read_text(errors="replace")
        removed += text.count("by a writer that was killed")
        problems = [f"exit status {code}"] if code else _differences(reference, _outcome(exp))
        problems += [f"left {p.relative_to(exp)}" for p in exp.rglob("*.tmp")]
        if problems:
            failures.append({"trial": trial, "problems": problems, "workers": workers, "starts": history,
                             "log": str(log)})
    return {"trials": trials, "seed": seed, "kills": kills, "finished_before_the_kill": finished_first,
            "phases": dict(phases),
            "identical": trials - len(failures), "failures": failures, "temporaries_removed": removed,
            "uninterrupted_run_seconds": round(run_seconds, 1), "seconds": round(time.perf_counter() - start, 1)}


def _wait_nohang(pid: int) -> bool:
    """Whether child `pid` has ended (reaped if so)."""
    done, _ = os.waitpid(pid, os.WNOHANG)
    return done != 0


# ---------------------------------------------------------------------------------------------
# command line


def summary(report: dict[str, Any]) -> str:
    """The report as "name  value" lines; a dict value as one line per entry, most frequent first."""
    lines = []
    for key, value in report.items():
        if isinstance(value, dict):
            lines += [f"{key}: {name:<52} {n:>8}" for name, n in sorted(value.items(), key=lambda kv: -kv[1])]
        elif isinstance(value, list) and key == "failures":
            lines += [f"failure: {json.dumps(f)}" for f in value] or ["failures: none"]
        else:
            lines.append(f"{key:<61} {value!s:>8}" if not isinstance(value, list) else f"{key}: {', '.join(value)}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="what", required=True)
    p = sub.add_parser("fuzz", help="mutated WAV / FLAC files through the audio reader")
    p.add_argument("--seconds", type=float, default=30.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--case", type=int, help="replay this one case")
    p.add_argument("--workdir", type=Path)
    p.add_argument("--out", type=Path)
    p = sub.add_parser("kill", help="SIGKILL training at random moments, resume, compare")
    p.add_argument("--trials", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workdir", type=Path)
    p.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="asr-reliability-"))
    if args.what == "fuzz" and args.case is not None:
        print(replay(args.seed, args.case, workdir))
        return 0
    if args.what == "fuzz":
        report = fuzz(args.seconds, args.seed, workdir)
    else:
        report = kill_trials(args.trials, args.seed, workdir)
    print(summary(report))
    if args.out:
        args.out.write_text(json.dumps(report, indent=1) + "\n")
    return 1 if report["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
