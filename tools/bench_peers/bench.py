"""This toolkit against ESPnet and SpeechBrain on this CPU, side by side: beam-search decoding,
a training step and the data-loading path, with the same transformer (d_model 256, 12 / 6
layers, 4 heads, ffn 2048, 4x conv2d with 256 channels, 300 tokens, 80 mels) in each.
Prints the parameter counts and one table; writes JSON.

    bash tools/bench_peers/setup.sh                      # once: ESPnet + SpeechBrain + asr in their own venv
    PY=~/.cache/asr-bench-peers/venv/bin/python
    $PY tools/bench_peers/bench.py                       # everything -> exp/bench_peers.json
    $PY tools/bench_peers/bench.py --quick               # a small workload, one repeat: a check that all runs
    $PY tools/bench_peers/bench.py --toolkits ours,espnet --tasks decode --seconds 5 10
    $PY tools/bench_peers/bench.py --variants none       # without our int8 / exported rows

Our fast CPU paths (--variants, default int8,onnx,onnx-int8; ours_fast.py): the same model's int8
copy (`--int8`) and its export in onnxruntime (`asr export`, float32 and int8 graphs) decode the
same inputs in the same rounds; each gets a row after the setting's own, its rate in the "ours"
column against the same runs of the peers (and its speed-up over our float32 in the JSON,
"over_fp32"). A variant that cannot be built here (no onnxruntime: the `export` extra) is left
out with a note. Decoding only: training and loading rows have none.

Equal work (README.md has the details): the same inputs go to every toolkit; decoding runs
every utterance for exactly the same number of output tokens (eos made impossible by the output
bias, then forced at the utterance's length through each toolkit's own length options) and every
returned hypothesis is checked to have that length (a rate marked (!) failed the check). Each
measurement is the median of its runs after a warm-up; the toolkits take turns within each
repeat (in an order rotated from one repeat to the next), so that load from other processes
falls on all of them alike.

Size: SpeechBrain's search recomputes the whole decoder prefix every step and ESPnet's loops
over utterances, both projecting the encoder output again at every step: at 32 utterances of
5-10 s one decoding run of theirs takes 10-30 minutes on this machine. The defaults (32
utterances of 2-4 s, one run per decoding setting, 3 per training / loading setting) made a
full run 33 minutes on 2 cores shared with other jobs (load average 5), 23 of them the peers'
decoding; --seconds 5 10 --decode-repeats 3 is the LibriSpeech-like workload, for a quiet
machine and several hours. Short utterances favour the peers (their per-step cost grows with the
prefix and the encoder length), so the ratios are lower bounds for longer speech.

Threads: --threads (default 2), with OMP_WAIT_POLICY=PASSIVE unless set otherwise: on this shared
2-core machine spinning OpenMP threads slowed a decoding run 8x when other processes held the cores.
"""
from __future__ import annotations

import argparse
import datetime
import functools
import importlib
import importlib.metadata
import logging
import os
import platform
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path

from report import format_parameters, format_table, summarize, write_json

ROOT = Path(__file__).resolve().parents[2]
ADAPTERS = {"ours": ("ours", "Ours"), "espnet": ("espnet_model", "ESPnet"),
            "speechbrain": ("speechbrain_model", "SpeechBrain")}
TASKS = ("decode", "train", "data")
MODES = {"beam 10": (10, 0.0), "beam 10 + CTC 0.3": (10, 0.3)}  # name: (beam size, CTC weight)
TRAIN_TOKENS_PER_SECOND = 7.5  # 300-token BPE on LibriSpeech-like speech
QUICK = {"utts": 4, "alone": 2, "seconds": (1.0, 2.0), "decode_repeats": 1, "repeats": 1, "train_utts": 2,
         "train_seconds": 2.0, "files": 4}
VERSIONS = ("torch", "torchaudio", "numpy", "espnet", "speechbrain", "asr", "onnxruntime")
VARIANTS = "int8,onnx,onnx-int8"  # our fast decoding paths (ours_fast.VARIANTS) measured by default


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--toolkits", default=",".join(ADAPTERS), help="comma-separated: " + ", ".join(ADAPTERS))
    p.add_argument("--tasks", default=",".join(TASKS), help="comma-separated: " + ", ".join(TASKS))
    p.add_argument("--utts", type=int, default=32, help="utterances of the batched decoding run (default 32)")
    p.add_argument("--alone", type=int, default=4, help="of them decoded one at a time (default 4)")
    p.add_argument("--seconds", type=float, nargs=2, default=(2.0, 4.0), metavar=("MIN", "MAX"),
                   help="decoding utterance durations, uniform (default 2 4: see the module docstring)")
    p.add_argument("--decode-repeats", type=int, default=1, help="timed runs per decoding measurement (default 1)")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per training / loading measurement (default 3)")
    p.add_argument("--train-utts", type=int, default=8, help="training batch: utterances (default 8)")
    p.add_argument("--train-seconds", type=float, default=10.0, help="training batch: seconds each (default 10)")
    p.add_argument("--files", type=int, default=32, help="WAV files of the loading path, 5-10 s (default 32)")
    p.add_argument("--load-batch", type=int, default=8, help="utterances per loaded batch (default 8)")
    p.add_argument("--threads", type=int, default=2, help="torch.set_num_threads (default 2)")
    p.add_argument("--variants", default=VARIANTS,
                   help=f"our fast decoding paths beside ours, comma-separated (default {VARIANTS}; none: none)")
    p.add_argument("--quick", action="store_true", help="tiny workload, one repeat: " + str(QUICK))
    p.add_argument("--out", type=Path, default=ROOT / "exp/bench_peers.json", help="JSON results")
    args = p.parse_args(argv)
    if args.quick:
        for key, value in QUICK.items():
            setattr(args, key, value)
    return args


def load_toolkits(names: list[str]) -> list:
    """The adapters (spec.Toolkit) of `names`, each imported only when asked for."""
    kits = []
    for name in names:
        if name not in ADAPTERS:
            sys.exit(f"bench_peers: unknown toolkit {name!r}; known: {', '.join(ADAPTERS)}")
        module, cls = ADAPTERS[name]
        try:
            kits.append(getattr(importlib.import_module(module), cls)())
        except ImportError as e:
            sys.exit(f"bench_peers: cannot import {name} ({e}); run bash tools/bench_peers/setup.sh and use its python")
    return kits


Timings = dict[str, dict[str, list[float]]]  # setting -> toolkit -> wall seconds of each run


def interleaved(settings: dict[str, dict[str, Callable[[], object]]], repeats: int) -> Timings:
    """Wall seconds of every function, settings[setting][toolkit], over `repeats` rounds. Each
    round runs each setting's toolkits one after another, in an order rotated by the round."""
    times = {s: {name: [] for name in fns} for s, fns in settings.items()}
    for r in range(repeats):
        for setting, fns in settings.items():
            names = list(fns)
            for name in names[r % len(names):] + names[:r % len(names)]:
                start = time.perf_counter()
                fns[name]()
                times[setting][name].append(time.perf_counter() - start)
                print(f"  [{r + 1}/{repeats}] {setting}: {name} {times[setting][name][-1]:.2f} s", file=sys.stderr)
    return times


def recording(outputs: dict, key: tuple, fn: Callable[[], object]) -> Callable[[], object]:
    """fn, keeping its latest result in outputs[key]."""
    def run() -> object:
        outputs[key] = fn()
        return outputs[key]
    return run


def load_variants(kits: list, names: str) -> list:
    """Our variants (ours_fast.py) of `names` ("int8,onnx"; "" or "none": none) built on the "ours"
    kit's model; one that cannot be built here is left out, with the reason on stderr."""
    ours = next((kit for kit in kits if kit.name == "ours"), None)
    wanted = [n for n in names.split(",") if n and n != "none"]
    if ours is None or not wanted:
        return []
    import ours_fast

    variants = []
    for name in wanted:
        try:
            variants.append(ours_fast.variant(name, ours))
        except ValueError as e:
            sys.exit(f"bench_peers: {e}")
        except Exception as e:  # an extra missing, an export that fails: the rest still runs
            print(f"bench_peers: no 'ours {name}' rows ({type(e).__name__}: {e})", file=sys.stderr)
    return variants


def decode_all(kit, inputs: list, beam: int, ctc: float) -> list[list[int]]:
    """The best hypotheses of every utterance of the batches `inputs`, decoded batch by batch."""
    return [h for utts in inputs for h in kit.decode(utts, beam_size=beam, ctc_weight=ctc)]


def bench_decode(kits: list, args: argparse.Namespace, variants: list = ()) -> list[dict]:
    """utterances / s of each mode at batch --utts (one batch) and batch 1 (--alone of them, one by one);
    each setting's row, then one row per variant of ours (see the module docstring)."""
    import spec
    import workload

    utts = workload.decode_utterances(args.utts, tuple(args.seconds))
    alone = [utts.subset(i, i + 1) for i in range(min(args.alone, len(utts)))]
    warm = workload.decode_utterances(2, (1.0, 1.5), seed=9)
    kits = [*kits, *variants]
    for kit in kits:
        for beam, ctc in MODES.values():
            kit.decode(warm, beam_size=beam, ctc_weight=ctc)
    settings, outputs, expected = {}, {}, {}
    for mode, (beam, ctc) in MODES.items():
        for batch, inputs in ((len(utts), [utts]), (1, alone)):
            setting = f"{mode}, batch {batch}"
            expected[setting] = [n for u in inputs for n in u.lengths.tolist()]
            settings[setting] = {kit.name: recording(outputs, (setting, kit.name),
                                                     functools.partial(decode_all, kit, inputs, beam, ctc))
                                 for kit in kits}
    times = interleaved(settings, args.decode_repeats)
    rows = []
    audio = {len(utts): float(utts.frames.sum()), 1: float(sum(u.frames.sum() for u in alone))}
    extra = {v.name for v in variants}
    for setting, by_kit in times.items():
        checks = {name: [len(h) for h in outputs[(setting, name)]] == expected[setting] for name in by_kit}
        peers = {name: t for name, t in by_kit.items() if name not in extra}
        found = [summarize("decode", setting, "utt/s", len(expected[setting]), peers, checks)]
        for v in variants:  # the variant's runs in the "ours" column, against the same runs of the peers
            runs = {**peers, "ours": by_kit[v.name]}
            row = summarize("decode", f"{setting}, {v.name}", "utt/s", len(expected[setting]), runs,
                            {**checks, "ours": checks[v.name]})
            row["variant"] = v.variant
            if "ours" in peers:
                row["over_fp32"] = round(row["toolkits"]["ours"]["rate"] / found[0]["toolkits"]["ours"]["rate"], 3)
            found.append(row)
        for row in found:
            row["audio_s"] = audio[int(setting.rsplit(" ", 1)[1])] / spec.FRAME_RATE
            row["tokens"] = sum(expected[setting])
        rows += found
    return rows


def bench_train(kits: list, args: argparse.Namespace) -> list[dict]:
    """audio seconds / s of one training step on the same batch."""
    import math

    import workload

    batch = workload.train_batch(args.train_utts, args.train_seconds, TRAIN_TOKENS_PER_SECOND)
    for kit in kits:
        kit.train_step(batch)  # warm-up; also makes AdamW's state
    setting = f"{args.train_utts} x {args.train_seconds:g} s, fwd + bwd + AdamW"
    losses: dict = {}
    fns = {kit.name: recording(losses, kit.name, lambda k=kit: k.train_step(batch)) for kit in kits}
    times = interleaved({setting: fns}, args.repeats)
    checks = {name: math.isfinite(loss) for name, loss in losses.items()}
    return [summarize("train step", setting, "audio-s/s", args.train_utts * args.train_seconds, times[setting], checks)]


def bench_data(kits: list, args: argparse.Namespace) -> tuple[list[dict], dict[str, int]]:
    """audio seconds / s of reading + fbank + CMVN + collating the same WAV files; and the
    feature frames each toolkit made of them."""
    import workload

    with tempfile.TemporaryDirectory(prefix="bench-peers-") as tmp:
        files = workload.write_wavs(Path(tmp), args.files, (5.0, 10.0))
        for kit in kits:
            kit.prepare_loading(files)
            kit.load(files[:2], args.load_batch)  # warm-up
        setting = f"{args.files} WAV files, batches of {args.load_batch}"
        frames: dict = {}
        fns = {kit.name: recording(frames, kit.name, lambda k=kit: k.load(files, args.load_batch)) for kit in kits}
        times = interleaved({setting: fns}, args.repeats)
        audio = sum(f.seconds for f in files)
    row = summarize("data", f"{setting}: read, fbank, CMVN, collate", "audio-s/s", round(audio, 2), times[setting])
    return [row], frames


def environment() -> dict:
    """What the figures depend on: versions, threads, OpenMP wait policy, CPU, load."""
    import torch

    versions = {}
    for name in VERSIONS:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    return {"threads": torch.get_num_threads(), "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
            "python": platform.python_version(), "versions": versions, "cpu": _cpu_name(),
            "cores": os.cpu_count(), "load_average": list(os.getloadavg())}


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def run(args: argparse.Namespace, kits: list | None = None) -> dict:
    """Build the toolkits of --toolkits (or take `kits`), run the tasks, print the tables; the
    JSON-ready result."""
    import spec
    import torch

    torch.set_num_threads(args.threads)
    tasks = args.tasks.split(",")
    unknown = set(tasks) - set(TASKS)
    if unknown:
        sys.exit(f"bench_peers: unknown task(s) {', '.join(sorted(unknown))}; known: {', '.join(TASKS)}")
    date = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    start, env = time.perf_counter(), environment()
    kits = kits or load_toolkits(args.toolkits.split(","))
    variants = load_variants(kits, args.variants) if "decode" in tasks else []
    names = [kit.name for kit in kits]
    params = {kit.name: kit.parameters() for kit in kits}
    print(format_parameters(params) + "\n")
    rows, frames = [], {}
    if "decode" in tasks:
        rows += bench_decode(kits, args, variants)
    if "train" in tasks:
        rows += bench_train(kits, args)
    if "data" in tasks:
        data_rows, frames = bench_data(kits, args)
        rows += data_rows
    print(format_table(rows, names))
    env["load_average_end"] = list(os.getloadavg())
    workload = {"decode_utts": args.utts, "decode_alone": args.alone, "decode_seconds": list(args.seconds),
                "forced_tokens_per_encoder_frame": spec.TOKENS_PER_FRAME, "train_utts": args.train_utts,
                "train_seconds": args.train_seconds, "train_tokens_per_second": TRAIN_TOKENS_PER_SECOND,
                "files": args.files, "load_batch": args.load_batch, "decode_repeats": args.decode_repeats,
                "variants": [v.variant for v in variants],
                "repeats": args.repeats}
    return {"date": date,
            "command": " ".join(["python", *sys.argv]), "wall_s": round(time.perf_counter() - start, 1),
            "environment": env, "workload": workload, "parameters": params, "load_frames": frames, "rows": rows}


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # read when torch loads OpenMP: before any import of it
    warnings.filterwarnings("ignore", category=FutureWarning)  # espnet's torch.cuda.amp.autocast
    logging.getLogger("espnet").setLevel(logging.ERROR)  # "best hypo length == max output length": on purpose
    result = run(args)
    write_json(args.out, result)
    print(f"\nwall {result['wall_s']:.0f} s; wrote {args.out}")


if __name__ == "__main__":
    main()
