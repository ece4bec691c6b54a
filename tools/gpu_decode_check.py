"""The sharded decode on one device: `torchrun --nproc_per_node 1 -m asr.cli decode` against the
plain `python -m asr.cli decode` of the same model and manifest, timed side by side, their
outputs compared byte for byte. Run by tools/gpu_check.sh after its measurements (it needs
soundfile: carry its wheel to a machine without it).

    python tools/gpu_decode_check.py [--config conf/librispeech_100h.yaml] [--utts 64] [--beam 10]
        [--device cuda] [--out exp/gpu_decode_check.json]

The model is the config's architecture with random weights and a character vocabulary (its
hypotheses mean nothing; the work per utterance is a real model's), the audio synthetic 2-15 s
tones and noise.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import soundfile as sf
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from asr.checkpoint import model_file, save_atomic  # noqa: E402
from asr.config import to_dict  # noqa: E402
from asr.features import CMVNStats, fbank  # noqa: E402
from asr.model import ModelConfig, build_model  # noqa: E402
from asr.tokenizer import CharTokenizer  # noqa: E402
from asr.train_setup import load_experiment_config  # noqa: E402

TEXT = "THE CAT SAT ON THE MAT"


def write_corpus(folder: Path, n: int, seed: int = 0) -> Path:
    rng = np.random.default_rng(seed)
    lines = []
    for i in range(n):
        seconds = float(rng.uniform(2.0, 15.0))
        t = np.arange(int(seconds * 16000)) / 16000
        wave = 0.1 * np.sin(2 * np.pi * rng.uniform(100, 300) * t) + rng.normal(0, 0.02, t.size)
        sf.write(folder / f"u{i}.flac", wave.astype(np.float32), 16000)
        lines.append(json.dumps({"id": f"u{i:04d}", "audio": f"u{i}.flac", "duration": t.size / 16000, "text": TEXT}))
    manifest = folder / "test.jsonl"
    manifest.write_text("\n".join(lines) + "\n")
    return manifest


def write_model(path: Path, config_path: Path) -> Path:
    experiment = load_experiment_config(str(config_path), [])
    tokenizer = CharTokenizer(sorted(set(TEXT.replace(" ", ""))))
    config = ModelConfig(**{**vars(experiment.model), "vocab_size": tokenizer.vocab_size})
    torch.manual_seed(0)
    model = build_model(config)
    features = experiment.data.features
    stats = CMVNStats()
    stats.add(fbank(torch.randn(16000 * 5) * 0.1, features))
    save_atomic(model_file(model=to_dict(config), tokenizer=tokenizer.to_dict(),
                           frontend={"features": to_dict(features), "cmvn": stats.to_dict()},
                           state_dict=model.state_dict()), path)
    return path


def decode(launcher: list[str], model: Path, manifest: Path, out: Path, args: argparse.Namespace) -> float:
    cmd = [*launcher, "decode", "--model", model, "--manifest", manifest, "--out-dir", out,
           "--beam-size", str(args.beam), "--device", args.device]
    start = time.perf_counter()
    done = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, env={**os.environ})
    if done.returncode:
        sys.exit(f"gpu_decode_check: {' '.join(map(str, launcher))} decode failed:\n{done.stderr[-3000:]}")
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", type=Path, default=ROOT / "conf/librispeech_100h.yaml")
    parser.add_argument("--utts", type=int, default=64)
    parser.add_argument("--beam", type=int, default=10)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", type=Path, default=ROOT / "exp/gpu_decode_check.json")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        manifest = write_corpus(folder, args.utts)
        model = write_model(folder / "model.pt", args.config)
        torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1",
                    "-m", "asr.cli"]
        seconds = {"plain": decode([sys.executable, "-m", "asr.cli"], model, manifest, folder / "plain", args),
                   "torchrun N=1": decode(torchrun, model, manifest, folder / "sharded", args)}
        same = {name: (folder / "plain" / name).read_bytes() == (folder / "sharded" / name).read_bytes()
                for name in ("hyp.txt", "ref.txt", "wer.json", "errors.txt")}
        audio = sum(json.loads(line)["duration"] for line in manifest.read_text().splitlines())
    report = {"config": args.config.name, "utterances": args.utts, "beam": args.beam, "device": args.device,
              "wall_seconds": seconds, "identical": same, "audio_seconds": audio}
    print(f"decode of {args.utts} utterances, beam {args.beam}, {args.device}: plain {seconds['plain']:.1f} s, "
          f"torchrun N=1 {seconds['torchrun N=1']:.1f} s (process start included); identical files: {same}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    if not all(same.values()):
        sys.exit(1)


if __name__ == "__main__":
    main()
