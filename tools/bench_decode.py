"""Decoding speed: utterances per second and real-time factor per search mode, batch 32 against
one utterance at a time, and the step time of the decoder and the CTC prefix scorer against the
output position. Prints a table and writes JSON.

    python tools/bench_decode.py     # conf/synth.yaml and librispeech_100h.yaml -> exp/bench_decode.json
    python tools/bench_decode.py --models synth --utts 16 --alone 4 --out /tmp/bench.json

The models have random weights and never emit eos, so every hypothesis runs to its maximum
length, set to a realistic output rate (`--tokens-per-second`: 14 characters per second for the
synth model, 7.5 BPE pieces for librispeech_100h): each utterance costs what a trained model's
would. Inputs are random normalized features of `--seconds` (uniform in the range). The encoder
runs once per batch setting and its time is added to every mode's search time. Every time is the
best of `--repeat` runs (after a warm-up run of each mode), and every step time the median over
positions p - 4 .. p + 4: on a shared machine single runs are noisy.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

from asr.config import read_yaml
from asr.ctc_prefix import CTCPrefixScorer
from asr.model import ASRModel, ModelConfig
from asr.search import DecoderScorer, SearchOptions, decode_memory

ROOT = Path(__file__).resolve().parents[1]
CONF = ROOT / "conf"
MODELS = {  # name: (vocabulary, output tokens per second of audio)
    "synth": (31, 14.0),  # characters
    "librispeech_100h": (302, 7.5),  # 300 sentencepiece pieces
}
MODES = {
    "greedy": SearchOptions(mode="greedy"),
    "beam5": SearchOptions(mode="attention", beam_size=5, ctc_weight=0.0),
    "beam5+ctc0.3": SearchOptions(mode="attention", beam_size=5, ctc_weight=0.3),
    "beam10": SearchOptions(mode="attention", beam_size=10, ctc_weight=0.0),
    "beam10+ctc0.3": SearchOptions(mode="attention", beam_size=10, ctc_weight=0.3),
    "ctc_greedy": SearchOptions(mode="ctc_greedy"),
    "ctc_rescore10": SearchOptions(mode="ctc_rescore", beam_size=10, ctc_weight=0.3),
}
POSITIONS = (10, 50, 100, 200)


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
    """(the best wall time of `repeat` calls of fn, its result)."""
    best = float("inf")
    for _ in range(repeat):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        out = fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return best, out


@torch.no_grad()
def bench_modes(name: str, model: ASRModel, args: argparse.Namespace, device: torch.device) -> list[dict]:
    g = torch.Generator().manual_seed(1)
    lo, hi = args.seconds
    seconds = [lo + (hi - lo) * float(u) for u in torch.rand(args.utts, generator=g)]
    frames = torch.tensor([int(s * 100) for s in seconds])
    feats = torch.randn(args.utts, int(frames.max()), model.config.n_mels, generator=g).to(device)
    frames = frames.to(device)
    ratio = MODELS[name][1] / model.config.frames_per_second
    enc_batch, (memory, memory_lens) = timed(lambda: model.encoder(feats, frames), device, args.repeat)
    alone = []
    for i in range(args.alone):
        n = int(frames[i])
        alone.append(timed(lambda i=i, n=n: model.encoder(feats[i:i + 1, :n], frames[i:i + 1]), device, args.repeat))
    enc_alone = sum(t for t, _ in alone)
    audio_batch, audio_alone = sum(seconds), sum(seconds[: args.alone])
    rows = []
    for mode, options in MODES.items():
        options = dataclasses.replace(options, max_len_ratio=ratio)
        decode_memory(model, *alone[0][1], options)  # warm up
        search_batch, found = timed(lambda o=options: decode_memory(model, memory, memory_lens, o), device, args.repeat)
        search_alone = sum(timed(lambda m=m, o=options: decode_memory(model, m[0], m[1], o), device, args.repeat)[0]
                           for _, m in alone)
        tokens = statistics.mean(len(n[0].tokens) for n in found)
        for batch, utts, audio, total in ((32, args.utts, audio_batch, enc_batch + search_batch),
                                          (1, args.alone, audio_alone, enc_alone + search_alone)):
            rows.append({"model": name, "mode": mode, "batch": batch if batch == 1 else args.utts, "utts": utts,
                         "audio_s": round(audio, 2), "seconds": round(total, 3), "utts_per_s": round(utts / total, 3),
                         "rtf": round(total / audio, 4), "mean_tokens": round(tokens, 1)})
        print(f"  {name} {mode}: batch {search_batch + enc_batch:.2f} s, alone {search_alone + enc_alone:.2f} s",
              file=sys.stderr)
    return rows


@torch.no_grad()
def bench_steps(name: str, model: ASRModel, args: argparse.Namespace, device: torch.device) -> list[dict]:
    """Milliseconds per step of the decoder (step + reorder) and of the CTC prefix scorer
    (score_partial of 1.5 x beam + eos candidates, select_state) at output positions, for
    32 utterances x beam 10 = 320 rows over 8 s of encoder frames."""
    batch, beam, steps = 32, 10, max(POSITIONS) + 5
    frames = int(8 * model.config.frames_per_second)
    memory = torch.randn(batch, frames, model.config.d_model, device=device)
    lens = torch.full((batch,), frames, device=device)
    rows = batch * beam
    perm = torch.arange(rows, device=device).view(batch, beam).flip(1).flatten()  # reversed within each group
    decoder, ctc = DecoderScorer(model.decoder), CTCPrefixScorer(model.ctc_log_probs, eos=model.config.eos)
    dstate, cstate = decoder.init_state(memory, lens, beam), ctc.init_state(memory, lens, beam)
    last = torch.full((rows,), model.config.eos, device=device)
    candidates = torch.arange(2, 2 + int(1.5 * beam), device=device).repeat(rows, 1)
    candidates = torch.cat([candidates, torch.full((rows, 1), model.config.eos, device=device)], dim=1)
    times = []  # (decoder, ctc prefix) seconds per step
    for t in range(steps):
        dt, (_, dstate) = timed(lambda d=dstate: decoder.score(d, last), device)
        rt, dstate = timed(lambda d=dstate: decoder.select_state(d, perm, last), device)
        ct, (_, cstate) = timed(lambda c=cstate: ctc.score_partial(c, candidates), device)
        st, cstate = timed(lambda c=cstate, t=t: ctc.select_state(c, perm, candidates[:, t % 3]), device)
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=",".join(MODELS), help="comma-separated: " + ", ".join(MODELS))
    parser.add_argument("--utts", type=int, default=32, help="utterances of the batched runs (default 32)")
    parser.add_argument("--alone", type=int, default=8, help="of them decoded one at a time (default 8)")
    parser.add_argument("--seconds", type=float, nargs=2, default=(5.0, 8.0), metavar=("MIN", "MAX"))
    parser.add_argument("--repeat", type=int, default=2, help="runs per measurement, the best kept (default 2)")
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (default 0: torch's choice)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", type=Path, default=ROOT / "exp/bench_decode.json", help="JSON results")
    args = parser.parse_args()
    device = torch.device(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    modes, steps = [], []
    for name in args.models.split(","):
        model = build(name, device)
        modes += bench_modes(name, model, args, device)
        steps += bench_steps(name, model, args, device)
    print(table(modes, ["model", "mode", "batch", "utts", "audio_s", "seconds", "utts_per_s", "rtf", "mean_tokens"]))
    print()
    print(table(steps, ["model", "rows", "frames", "position", "decoder_ms", "ctc_prefix_ms"]))
    speedups = {}
    for name in args.models.split(","):
        rate = {(r["mode"], r["batch"]): r["utts_per_s"] for r in modes if r["model"] == name}
        speedups[name] = {m: round(rate[(m, args.utts)] / rate[(m, 1)], 2) for m in MODES}
        print(f"\n{name}: batch {args.utts} / batch 1 throughput: "
              + ", ".join(f"{m} {s}x" for m, s in speedups[name].items()))
    result = {"device": str(device), "threads": torch.get_num_threads(), "torch": torch.__version__,
              "repeat": args.repeat, "load_average": list(os.getloadavg()),
              "machine": platform.processor() or platform.machine(), "modes": modes, "steps": steps,
              "speedup_batch_over_alone": speedups}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
