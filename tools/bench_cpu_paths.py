"""The CPU paths side by side: float32 PyTorch, int8 PyTorch (asr.quantize), the exported model in
onnxruntime (asr.export) and its int8 graphs, on the same inputs in one run, at batch 1 and 32;
and (`--dev`) the WER of each on the synth recipe's dev set. Prints tables and writes JSON.

    python tools/bench_cpu_paths.py --threads 1 --dev          # -> exp/bench_cpu_paths.json
    python tools/bench_cpu_paths.py --threads 2 --models synth --utts 8 --alone 4 --out /tmp/b.json

Models: "synth" is the recipe's trained model (recipes/synth/exp/synth/model_avg.pt; `--synth-model`)
on the first `--utts` dev utterances' real audio; "librispeech_100h" is conf/librispeech_100h.yaml
(the transformer baseline, its 5,000-piece vocabulary) and "librispeech_100h_conformer"
conf/librispeech_100h_conformer.yaml (the LibriSpeech recipe's default) with random weights that never end a
hypothesis (eos suppressed), so each runs to the output length of 7.5 pieces per second that
`max_len_ratio` allows, as a trained model's would, on random normalized features of 5-8 s. Each
path decodes the same features with the default search (beam 10, CTC weight 0.3) through
asr.decoding.DecodingTask: batch 32 is one call on `--utts` utterances, batch 1 `--alone` calls of
one utterance (encoder and search each time). Each time is the best of `--repeat` runs after a
warm-up. torch and each onnxruntime session use `--threads` intra-op threads (asr.decoding.
thread_policy, as `asr decode --threads N` sets them: the same threads for every path and every
search). Export time is not counted.

`--dev` decodes all of recipes/synth/data/dev.jsonl (never the test set) with each path at batch
32 and scores it (asr.metrics.score): the WER change of int8 and of the export.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch

from asr.api import Recognizer, load_model
from asr.audio import load_audio
from asr.checkpoint import model_file, save_atomic
from asr.config import read_yaml, to_dict
from asr.decoding import DecodingOptions, thread_policy
from asr.export import export_model
from asr.features import CMVNStats, FeatureConfig
from asr.manifest import read_manifest
from asr.metrics import score
from asr.model import ASRModel, ModelConfig
from asr.onnx_model import load_exported
from asr.tokenizer import CharTokenizer

ROOT = Path(__file__).resolve().parents[1]
SYNTH_MODEL = ROOT / "recipes/synth/exp/synth/model_avg.pt"
DEV = ROOT / "recipes/synth/data/dev.jsonl"
PATHS = ("fp32", "int8", "onnx", "onnx_int8")  # torch float32, torch int8, onnxruntime float32, int8 graphs
KEYS = ["model", "path", "batch", "utts", "audio_s", "seconds", "rtf", "x_realtime", "speedup"]


RANDOM = {"librispeech_100h": "conf/librispeech_100h.yaml",  # the model sizes run with random weights
          "librispeech_100h_conformer": "conf/librispeech_100h_conformer.yaml"}


def random_model_file(folder: Path, name: str, vocab_size: int = 5000) -> Path:
    """RANDOM[name]'s model with random weights (eos never chosen) as a model file, with a
    character tokenizer of vocab_size tokens and unit CMVN statistics."""
    fields = read_yaml(ROOT / RANDOM[name])["model"]
    tokenizer = CharTokenizer([chr(0x4E00 + i) for i in range(vocab_size - 3)])
    config = dataclasses.replace(ModelConfig(**fields), vocab_size=tokenizer.vocab_size, dropout=0.0)
    torch.manual_seed(0)
    model = ASRModel(config).eval()
    with torch.no_grad():
        model.decoder.output.bias[config.eos] = -1e4
    features = FeatureConfig(n_mels=config.n_mels)
    stats = CMVNStats()
    stats.add(torch.randn(1000, config.n_mels, dtype=torch.float64))
    path = folder / f"{name}_random.pt"
    save_atomic(model_file(model=to_dict(config), tokenizer=tokenizer.to_dict(),
                           frontend={"features": to_dict(features), "cmvn": stats.to_dict()},
                           state_dict=model.state_dict()), path)
    return path


def recognizers(model_path: Path, folder: Path, threads: int,
                search_threads: int | None) -> dict[str, tuple[Recognizer, DecodingOptions]]:
    """Each path's recognizer and options (the export written into `folder` first)."""
    export_model(model_path, folder, int8=True)
    torch_model = load_model(model_path, search_threads=search_threads)
    exported = load_exported(folder, threads=threads)
    onnx_model = Recognizer(exported.model, exported.tokenizer, exported.features, exported.cmvn,
                            search_threads=search_threads)
    return {"fp32": (torch_model, DecodingOptions()), "int8": (torch_model, DecodingOptions(int8=True)),
            "onnx": (onnx_model, DecodingOptions()), "onnx_int8": (onnx_model, DecodingOptions(int8=True))}


def timed(fn, repeat: int) -> float:
    fn()  # warm-up
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def speed_rows(name: str, paths: dict, feats: list[torch.Tensor], seconds: list[float], options: dict,
               args: argparse.Namespace) -> list[dict]:
    rows = []
    for path, (recognizer, base) in paths.items():
        task = recognizer.task(dataclasses.replace(base, **options))
        batch_s = timed(lambda t=task: t.run(feats), args.repeat)
        alone_s = timed(lambda t=task: [t.run([f]) for f in feats[:args.alone]], args.repeat)
        for batch, utts, audio, total in ((1, args.alone, sum(seconds[:args.alone]), alone_s),
                                          (len(feats), len(feats), sum(seconds), batch_s)):
            rows.append({"model": name, "path": path, "batch": batch, "utts": utts, "audio_s": round(audio, 2),
                         "seconds": round(total, 3), "rtf": round(total / audio, 4),
                         "x_realtime": round(audio / total, 1)})
        print(f"  {name} {path}: batch 1 {alone_s:.2f} s, batch {len(feats)} {batch_s:.2f} s", file=sys.stderr)
    for row in rows:
        fp32 = next(r for r in rows if r["path"] == "fp32" and r["batch"] == row["batch"])
        row["speedup"] = round(fp32["seconds"] / row["seconds"], 2)
    return sorted(rows, key=lambda r: (r["batch"], PATHS.index(r["path"])))


def synth_inputs(recognizer: Recognizer,
                 count: int | None) -> tuple[list[str], list[torch.Tensor], list[float], list[str]]:
    """ids, features, seconds and texts of the first `count` dev utterances (all: None)."""
    utts = read_manifest(DEV)[:count]
    waves = [load_audio(u.audio, start=u.start or 0.0, end=u.end) for u in utts]
    return ([u.id for u in utts], [recognizer.feats(w) for w in waves], [w.numel() / 16000 for w in waves],
            [u.text for u in utts])


def random_inputs(model: ModelConfig, count: int) -> tuple[list[torch.Tensor], list[float]]:
    g = torch.Generator().manual_seed(1)
    seconds = [5.0 + 3.0 * float(u) for u in torch.rand(count, generator=g)]
    return [torch.randn(int(s * 100), model.n_mels, generator=g) for s in seconds], seconds


def dev_rows(paths: dict, args: argparse.Namespace) -> list[dict]:
    """Each path's WER on the whole synth dev set (batch 32)."""
    recognizer = paths["fp32"][0]
    ids, feats, _, texts = synth_inputs(recognizer, None)
    refs = dict(zip(ids, texts))
    rows = []
    for path, (rec, options) in paths.items():
        task = rec.task(options)
        nbests = [n for i in range(0, len(feats), 32) for n in task.run(feats[i:i + 32])]
        hyps = {i: rec.text(n[0].tokens) for i, n in zip(ids, nbests)}
        stats = score(refs, hyps).stats
        rows.append({"path": path, "utterances": stats.utterances, "words": stats.words, "wer": round(stats.wer, 4),
                     "cer": round(stats.cer, 4)})
    for row in rows:
        row["wer_change"] = round(row["wer"] - rows[0]["wer"], 4)
    return rows


def table(rows: list[dict], keys: list[str]) -> str:
    widths = [max(len(k), *(len(str(r[k])) for r in rows)) for k in keys]
    lines = ["  ".join(k.rjust(w) for k, w in zip(keys, widths))]
    lines += ["  ".join(str(r[k]).rjust(w) for k, w in zip(keys, widths)) for r in rows]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="synth,librispeech_100h,librispeech_100h_conformer",
                        help="comma-separated: synth, librispeech_100h, librispeech_100h_conformer")
    parser.add_argument("--utts", type=int, default=32, help="utterances of the batched run (default 32)")
    parser.add_argument("--alone", type=int, default=8, help="of them decoded one at a time (default 8)")
    parser.add_argument("--repeat", type=int, default=2, help="runs per measurement, the best kept (default 2)")
    parser.add_argument("--threads", type=int, default=1, help="torch and onnxruntime intra-op threads (default 1)")
    parser.add_argument("--dev", action="store_true", help="also the WER of each path on the synth dev set")
    parser.add_argument("--synth-model", type=Path, default=SYNTH_MODEL)
    parser.add_argument("--out", type=Path, default=ROOT / "exp/bench_cpu_paths.json", help="JSON results")
    args = parser.parse_args()
    search_threads = thread_policy(args.threads)
    speed, dev = [], []
    with tempfile.TemporaryDirectory() as tmp, torch.no_grad():
        for name in args.models.split(","):
            folder = Path(tmp) / name
            folder.mkdir()
            if name == "synth":
                paths = recognizers(args.synth_model, folder / "onnx", args.threads, search_threads)
                _, feats, seconds, _ = synth_inputs(paths["fp32"][0], args.utts)
                options = {}
            elif name in RANDOM:
                paths = recognizers(random_model_file(folder, name), folder / "onnx", args.threads, search_threads)
                config = paths["fp32"][0].model.config
                feats, seconds = random_inputs(config, args.utts)
                options = {"max_len_ratio": 7.5 / config.frames_per_second}
            else:
                raise SystemExit(f"unknown model {name!r}")
            speed += speed_rows(name, paths, feats, seconds, options, args)
            if args.dev and name == "synth":
                dev = dev_rows(paths, args)
    print(f"\nthreads {args.threads} (torch and each onnxruntime session), beam 10, CTC weight 0.3")
    print(table(speed, KEYS))
    if dev:
        print(f"\nsynth dev set ({DEV.relative_to(ROOT)}), batch 32")
        print(table(dev, ["path", "utterances", "words", "wer", "cer", "wer_change"]))
    result = {"speed": speed, "dev": dev, "threads": args.threads, "torch": torch.__version__,
              "machine": platform.processor() or platform.machine(), "args": {k: str(v) for k, v in vars(args).items()}}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
