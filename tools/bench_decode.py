"""Decoding speed: utterances per second and real-time factor per search mode, batch 32 against
one utterance at a time, and the step time of the decoder and the CTC prefix scorer against the
output position. Prints a table and writes JSON.

    python tools/bench_decode.py --threads 1     # conf/synth.yaml and librispeech_100h.yaml -> exp/bench_decode.json
    python tools/bench_decode.py --models synth --utts 16 --alone 4 --out /tmp/bench.json
    python tools/bench_decode.py --threads 1 --baseline HEAD --modes beam10,beam10+ctc0.3
    python tools/bench_decode.py --threads 1 --modes beam10+ctc0.3,beam10+ctc0.3+lm0.3   # the LM's cost

The models have random weights and never emit eos, so every hypothesis runs to its maximum
length, set to a realistic output rate (`--tokens-per-second`: 14 characters per second for the
synth model, 7.5 BPE pieces for librispeech_100h): each utterance costs what a trained model's
would. Inputs are random normalized features of `--seconds` (uniform in the range). The encoder
runs once per batch setting and its time is added to every mode's search time. Every time is the
best of `--repeat` runs (after a warm-up run of each mode), and every step time the median over
positions p - 4 .. p + 4: on a shared machine single runs are noisy. Besides wall time, the
process's CPU time is kept: with one thread (`--threads 1`) it is what the work costs, whatever
else the machine runs.

An LM mode (beam10+ctc0.3+lm0.3) fuses the model's transformer LM (conf/lm/: synth.yaml for
synth, librispeech_transformer.yaml for librispeech_100h) into that beam search
at weight 0.3, its output made uniform (its final LayerNorm's weight zeroed): the search finds the
same hypotheses as without it, computing all of the LM, so the difference is what the LM costs.

`--baseline GIT_REF` times the `asr` package of that revision too (extracted with `git archive`,
git state untouched), side by side: two child processes, one importing each tree, time each
(model, mode) in turn, `--repeat` rounds (alternating which goes first), each time the best over
the rounds; the table then has both trees' times and the speed-ups (baseline / working tree).
The step-time table covers the working tree only.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import torch

from asr.config import read_yaml
from asr.model import ASRModel, ModelConfig
from asr.search import SearchOptions
from asr.search import decode_memory as _decode_memory

try:  # the decoding commands' thread policy (asr.decoding.thread_policy)
    from asr.decoding import search_threads_for, thread_policy
except ImportError:  # a baseline tree from before it: torch's threads (--threads) for every search
    search_threads_for = thread_policy = None

SEARCH_THREADS = None  # what thread_policy decided (main): the search_threads of the commands' DecodingTask


def decode_memory(model: ASRModel, memory: torch.Tensor, memory_lens: torch.Tensor, options: SearchOptions,
                  scorers=None):
    """asr.search.decode_memory under the commands' thread policy (asr.decoding.search_threads_for)."""
    extra = (scorers,) if scorers is not None else ()
    if search_threads_for is None:
        return _decode_memory(model, memory, memory_lens, options, *extra)
    with search_threads_for(SEARCH_THREADS, options, memory):
        return _decode_memory(model, memory, memory_lens, options, *extra)


ROOT = Path(__file__).resolve().parents[1]
CONF = ROOT / "conf"
MODELS = {  # name: (vocabulary, output tokens per second of audio)
    "synth": (31, 14.0),  # characters
    "librispeech_100h": (302, 7.5),  # 300 sentencepiece pieces
}
LMS = {"synth": "synth.yaml", "librispeech_100h": "librispeech_transformer.yaml"}  # conf/lm/: each model's LM
MODES = {
    "greedy": SearchOptions(mode="greedy"),
    "beam5": SearchOptions(mode="attention", beam_size=5, ctc_weight=0.0),
    "beam5+ctc0.3": SearchOptions(mode="attention", beam_size=5, ctc_weight=0.3),
    "beam10": SearchOptions(mode="attention", beam_size=10, ctc_weight=0.0),
    "beam10+ctc0.3": SearchOptions(mode="attention", beam_size=10, ctc_weight=0.3),
    "ctc_greedy": SearchOptions(mode="ctc_greedy"),
    "ctc_rescore10": SearchOptions(mode="ctc_rescore", beam_size=10, ctc_weight=0.3),
}
LM_MODES = {  # beam search with the model's transformer LM (LMS, random weights) fused at this weight
    "beam10+ctc0.3+lm0.3": ("beam10+ctc0.3", 0.3),
}
POSITIONS = (10, 50, 100, 200)
MODE_KEYS = ["model", "mode", "batch", "utts", "audio_s", "seconds", "cpu_s", "utts_per_s", "rtf", "cpu_rtf",
             "mean_tokens"]


def build(name: str, device: torch.device) -> ASRModel:
    """The model of conf/<name>.yaml with random weights that never ends a hypothesis."""
    vocab, _ = MODELS[name]
    fields = read_yaml(CONF / f"{name}.yaml")["model"]
    config = dataclasses.replace(ModelConfig(**fields), vocab_size=vocab, dropout=0.0)
    torch.manual_seed(0)
    model = ASRModel(config).eval().to(device)
    with torch.no_grad():
        model.decoder.output.bias[config.eos] = -1e4
    return model


def timed(fn, device: torch.device, repeat: int = 1):
    """(the best wall time of `repeat` calls of fn, the best CPU time of this process, the result)."""
    best, best_cpu = float("inf"), float("inf")
    for _ in range(repeat):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start, cpu = time.perf_counter(), time.process_time()
        out = fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        best, best_cpu = min(best, time.perf_counter() - start), min(best_cpu, time.process_time() - cpu)
    return best, best_cpu, out


class Workload:
    """One model's inputs (`--utts` utterances, the first `--alone` of them also one at a time),
    their encoder outputs and the encoder's times, shared by the modes timed on them."""

    @torch.no_grad()
    def __init__(self, name: str, args: argparse.Namespace, device: torch.device) -> None:
        self.name, self.args, self.device = name, args, device
        self.model = model = build(name, device)
        g = torch.Generator().manual_seed(1)
        lo, hi = args.seconds
        seconds = [lo + (hi - lo) * float(u) for u in torch.rand(args.utts, generator=g)]
        frames = torch.tensor([int(s * 100) for s in seconds])
        feats = torch.randn(args.utts, int(frames.max()), model.config.n_mels, generator=g).to(device)
        frames = frames.to(device)
        self.ratio = MODELS[name][1] / model.config.frames_per_second
        self.enc_batch = timed(lambda: model.encoder(feats, frames), device, args.repeat)  # (wall, cpu, memory)
        self.alone = [timed(lambda i=i: model.encoder(feats[i:i + 1, :int(frames[i])], frames[i:i + 1]), device,
                            args.repeat) for i in range(args.alone)]
        self.audio_batch, self.audio_alone = sum(seconds), sum(seconds[: args.alone])

    def search(self, mode: str):
        """(SearchOptions, scorers or None) of `mode` (MODES or LM_MODES)."""
        if mode not in LM_MODES:
            return dataclasses.replace(MODES[mode], max_len_ratio=self.ratio), None
        try:
            from asr.lm_train import load_lm_config
        except ImportError:  # a baseline tree from before the LM's training had a module of its own
            from asr.neural_lm import load_lm_config
        from asr.model import TransformerLM
        from asr.neural_lm import NeuralLM, TransformerLMScorer
        from asr.search import Scorers

        base, weight = LM_MODES[mode]
        config = load_lm_config(str(CONF / "lm" / LMS[self.name]), [])
        torch.manual_seed(0)
        lm = TransformerLM(dataclasses.replace(config.model, vocab_size=self.model.config.vocab_size, dropout=0.0))
        with torch.no_grad():  # a uniform LM: the search keeps the hypotheses it finds without one
            lm.norm.weight.zero_()
        scorer = TransformerLMScorer(NeuralLM(lm.eval().to(self.device), {}, "random"))
        return (dataclasses.replace(MODES[base], max_len_ratio=self.ratio),
                Scorers({"lm": scorer}, {}, {"lm": weight}, (), ("lm",)))

    @torch.no_grad()
    def rows(self, mode: str) -> list[dict]:
        """The batch row and the one-at-a-time row of `mode`: encoder + search times."""
        args, device, model = self.args, self.device, self.model
        options, scorers = self.search(mode)
        decode_memory(model, *self.alone[0][2], options, scorers)  # warm up
        wall, cpu, found = timed(lambda: decode_memory(model, *self.enc_batch[2], options, scorers), device,
                                 args.repeat)
        each = [timed(lambda m=m: decode_memory(model, m[0], m[1], options, scorers), device, args.repeat)[:2]
                for _, _, m in self.alone]
        alone_wall = sum(t for t, _, _ in self.alone) + sum(w for w, _ in each)
        alone_cpu = sum(c for _, c, _ in self.alone) + sum(c for _, c in each)
        tokens = statistics.mean(len(n[0].tokens) for n in found)
        rows = []
        for batch, utts, audio, total, total_cpu in (
                (args.utts, args.utts, self.audio_batch, self.enc_batch[0] + wall, self.enc_batch[1] + cpu),
                (1, args.alone, self.audio_alone, alone_wall, alone_cpu)):
            rows.append({"model": self.name, "mode": mode, "batch": batch, "utts": utts, "audio_s": round(audio, 2),
                         "seconds": round(total, 3), "cpu_s": round(total_cpu, 3),
                         "utts_per_s": round(utts / total, 3), "rtf": round(total / audio, 4),
                         "cpu_rtf": round(total_cpu / audio, 4), "mean_tokens": round(tokens, 1)})
        print(f"  {self.name} {mode}: batch {rows[0]['seconds']:.2f} s (cpu {rows[0]['cpu_s']:.2f}), "
              f"alone {rows[1]['seconds']:.2f} s (cpu {rows[1]['cpu_s']:.2f})", file=sys.stderr)
        return rows


def bench_modes(args: argparse.Namespace, device: torch.device) -> list[dict]:
    """The rows of every model and mode, in this process."""
    rows = []
    for name in args.models.split(","):
        workload = Workload(name, args, device)
        rows += [row for mode in args.modes.split(",") for row in workload.rows(mode)]
    return rows


@torch.no_grad()
def bench_steps(name: str, model: ASRModel, args: argparse.Namespace, device: torch.device) -> list[dict]:
    """Milliseconds per step of the decoder (step + reorder) and of the CTC prefix scorer
    (score_partial of 1.5 x beam + eos candidates, select_state) at output positions, for
    32 utterances x beam 10 = 320 rows over 8 s of encoder frames. Every step reverses the order
    of the hypotheses of each utterance (every row but the middle ones moves, nothing shared):
    the worst case of a beam search step, which usually moves a few rows."""
    from asr.ctc_prefix import CTCPrefixScorer
    from asr.scorer import Selection
    from asr.search import DecoderScorer

    batch, beam, steps = 32, 10, max(POSITIONS) + 5
    frames = int(8 * model.config.frames_per_second)
    memory = torch.randn(batch, frames, model.config.d_model, device=device)
    lens = torch.full((batch,), frames, device=device)
    rows = batch * beam
    perm = torch.arange(rows, device=device).view(batch, beam).flip(1).flatten()  # reversed within each group
    decoder, ctc = DecoderScorer(model.decoder, steps), CTCPrefixScorer(model.ctc_log_probs, eos=model.config.eos)
    dstate, cstate = decoder.init_state(memory, lens, beam), ctc.init_state(memory, lens, beam)
    last = torch.full((rows,), model.config.eos, device=device)
    candidates = torch.arange(2, 2 + int(1.5 * beam), device=device).repeat(rows, 1)
    candidates = torch.cat([candidates, torch.full((rows, 1), model.config.eos, device=device)], dim=1)
    times = []  # (decoder, ctc prefix) seconds per step
    for t in range(steps):
        chosen = Selection.of(perm, candidates[:, t % 3], beam)
        dt, _, (_, dstate) = timed(lambda d=dstate: decoder.score(d, last), device)
        rt, _, dstate = timed(lambda d=dstate, s=chosen: decoder.select_state(d, s), device)
        ct, _, (_, cstate) = timed(lambda c=cstate: ctc.score_partial(c, candidates), device)
        st, _, cstate = timed(lambda c=cstate, s=chosen: ctc.select_state(c, s), device)
        times.append((dt + rt, ct + st))
    return [{"model": name, "rows": rows, "frames": frames, "position": p,
             "decoder_ms": round(1000 * statistics.median(d for d, _ in times[p - 4:p + 5]), 2),
             "ctc_prefix_ms": round(1000 * statistics.median(c for _, c in times[p - 4:p + 5]), 2)}
            for p in POSITIONS]


def table(rows: list[dict], keys: list[str]) -> str:
    widths = [max(len(k), *(len(str(r[k])) for r in rows)) for k in keys]
    lines = ["  ".join(k.rjust(w) for k, w in zip(keys, widths))]
    lines += ["  ".join(str(r[k]).rjust(w) for k, w in zip(keys, widths)) for r in rows]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# side by side with another revision


def extract(ref: str, into: Path) -> Path:
    """The `asr` package of git revision `ref`, unpacked under `into` (returned: the folder to
    put on PYTHONPATH)."""
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", ref, "asr"], check=True, capture_output=True).stdout
    path = into / "tree"
    path.mkdir()
    with tempfile.TemporaryFile() as f:
        f.write(archive)
        f.seek(0)
        tarfile.open(fileobj=f).extractall(path, filter="data")
    return path


class Child:
    """A child process that imports `asr` from `tree` and times what it is asked (see `serve`)."""

    def __init__(self, tree: Path, args: argparse.Namespace) -> None:
        command = [sys.executable, __file__, "--worker", "--models", args.models, "--modes", args.modes,
                   "--utts", str(args.utts), "--alone", str(args.alone), "--seconds", *map(str, args.seconds),
                   "--repeat", "1", "--threads", str(args.threads), "--device", args.device]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tree), os.environ.get("PYTHONPATH", "")])}
        self.process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)

    def rows(self, model: str, mode: str) -> list[dict]:
        self.process.stdin.write(f"{model} {mode}\n")
        self.process.stdin.flush()
        line = self.process.stdout.readline()
        if not line:
            raise SystemExit(f"bench_decode: the child for {model} {mode} died (its stderr is above)")
        return json.loads(line)

    def close(self) -> None:
        self.process.stdin.close()
        self.process.wait()


def serve(args: argparse.Namespace, device: torch.device) -> None:
    """--worker: for each line "MODEL MODE" of stdin, one line of JSON rows (Workload.rows)."""
    workloads: dict[str, Workload] = {}
    for line in sys.stdin:
        name, mode = line.split()
        if name not in workloads:
            workloads[name] = Workload(name, args, device)
        print(json.dumps(workloads[name].rows(mode)), flush=True)


def side_by_side(args: argparse.Namespace) -> list[dict]:
    """Rows of both trees with the speed-ups: each (model, mode) is timed in both trees in turn
    (alternating which goes first), `--repeat` rounds, the best of each kept."""
    best: dict[str, dict[tuple, dict]] = {"baseline": {}, "current": {}}
    with tempfile.TemporaryDirectory() as tmp:
        children = {"baseline": Child(extract(args.baseline, Path(tmp)), args), "current": Child(ROOT, args)}
        try:
            for round_ in range(args.repeat):
                for model in args.models.split(","):
                    for mode in args.modes.split(","):
                        for name in (("baseline", "current") if round_ % 2 == 0 else ("current", "baseline")):
                            for row in children[name].rows(model, mode):
                                key, old = (model, mode, row["batch"]), best[name].get((model, mode, row["batch"]))
                                best[name][key] = row if old is None else {
                                    **row, "seconds": min(row["seconds"], old["seconds"]),
                                    "cpu_s": min(row["cpu_s"], old["cpu_s"])}
        finally:
            for child in children.values():
                child.close()
    rows = []
    for key, new in best["current"].items():
        old = best["baseline"][key]
        rows.append({"model": key[0], "mode": key[1], "batch": key[2], "audio_s": new["audio_s"],
                     "base_s": old["seconds"], "new_s": new["seconds"],
                     "speedup": round(old["seconds"] / new["seconds"], 2),
                     "base_cpu_s": old["cpu_s"], "new_cpu_s": new["cpu_s"],
                     "cpu_speedup": round(old["cpu_s"] / new["cpu_s"], 2),
                     "new_cpu_rtf": round(new["cpu_s"] / new["audio_s"], 4)})
    return rows


# ---------------------------------------------------------------------------------------------


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=",".join(MODELS), help="comma-separated: " + ", ".join(MODELS))
    parser.add_argument("--modes", default=",".join(MODES),
                        help="comma-separated: " + ", ".join([*MODES, *LM_MODES]) + " (default: all but the LM's)")
    parser.add_argument("--utts", type=int, default=32, help="utterances of the batched runs (default 32)")
    parser.add_argument("--alone", type=int, default=8, help="of them decoded one at a time (default 8)")
    parser.add_argument("--seconds", type=float, nargs=2, default=(5.0, 8.0), metavar=("MIN", "MAX"))
    parser.add_argument("--repeat", type=int, default=2, help="runs per measurement, the best kept (default 2)")
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads, as `asr decode --threads` sets "
                        "them (default 0: torch's choice, and one thread for a search of at most 16 rows)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--baseline", metavar="GIT_REF", help="also time this revision's asr, side by side")
    parser.add_argument("--no-steps", action="store_true", help="skip the step-time table")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)  # a child of --baseline
    parser.add_argument("--out", type=Path, default=ROOT / "exp/bench_decode.json", help="JSON results")
    args = parser.parse_args()
    unknown = set(args.modes.split(",")) - {*MODES, *LM_MODES} or set(args.models.split(",")) - set(MODELS)
    if unknown:
        parser.error(f"unknown mode or model: {', '.join(sorted(unknown))}")
    return args


def main() -> None:
    global SEARCH_THREADS
    args = parse_args()
    device = torch.device(args.device)
    if thread_policy is not None:  # as `asr decode --threads N` (0: without --threads)
        SEARCH_THREADS = thread_policy(args.threads or None)
    elif args.threads:
        torch.set_num_threads(args.threads)
    if args.worker:
        serve(args, device)
        return
    result = {"device": str(device), "threads": torch.get_num_threads(), "torch": torch.__version__,
              "repeat": args.repeat, "load_average": list(os.getloadavg()),
              "machine": platform.processor() or platform.machine()}
    if args.baseline:
        rows = side_by_side(args)
        print(table(rows, ["model", "mode", "batch", "audio_s", "base_s", "new_s", "speedup", "base_cpu_s",
                           "new_cpu_s", "cpu_speedup", "new_cpu_rtf"]))
        result.update(baseline=args.baseline, side_by_side=rows)
    else:
        modes = bench_modes(args, device)
        print(table(modes, MODE_KEYS))
        speedups = {}
        for name in args.models.split(","):
            rate = {(r["mode"], r["batch"]): r["utts_per_s"] for r in modes if r["model"] == name}
            speedups[name] = {m: round(rate[(m, args.utts)] / rate[(m, 1)], 2) for m in args.modes.split(",")}
            print(f"\n{name}: batch {args.utts} / batch 1 throughput: "
                  + ", ".join(f"{m} {s}x" for m, s in speedups[name].items()))
        result.update(modes=modes, speedup_batch_over_alone=speedups)
    if not args.no_steps:
        steps = [row for name in args.models.split(",") for row in bench_steps(name, build(name, device), args, device)]
        print()
        print(table(steps, ["model", "rows", "frames", "position", "decoder_ms", "ctc_prefix_ms"]))
        result["steps"] = steps
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
