"""The small config learns long utterances: conf/small.yaml on eSpeak NG speech of ~14 s lines
takes its CTC loss off the plateau (about 0.8 ln V: chance) within a stated number of steps."""
from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("espeakng_loader")

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "recipes" / "synth" / "local"))  # the recipe's helpers are scripts

import make_text  # noqa: E402
import synthesize  # noqa: E402

LINES = 48  # long utterances (~14 s), each five generated training sentences: 11 minutes of audio
STEPS = 320  # the budget, in steps of 80 s (one process)
BELOW = 0.7  # off the plateau (~0.8 ln V, where the warning's threshold is 0.7): the CTC loss per token below


@pytest.mark.slow
def test_small_config_learns_long_utterances(tmp_path):
    sentences = make_text.make_sentences(5 * LINES, "train", seed=7)
    text = tmp_path / "text.txt"
    text.write_text("\n".join(" ".join(sentences[i:i + 5]) for i in range(0, 5 * LINES, 5)) + "\n")
    data = tmp_path / "data"
    synthesize.synthesize_corpus(data, {"train": LINES, "dev": 0, "test": 0}, text_file=text, jobs=2)
    utts = [json.loads(line) for line in (data / "train.jsonl").read_text().splitlines()]
    assert len(utts) == LINES and sum(u["duration"] for u in utts) / LINES > 10.0  # long ones
    valid = tmp_path / "valid.jsonl"  # a few of them, whole, for the validations at each epoch's end
    valid.write_text("".join(json.dumps(u | {"audio": str(data / u["audio"])}) + "\n" for u in utts[:4]))
    exp = tmp_path / "exp"
    done = subprocess.run(
        [sys.executable, "-m", "asr.cli", "train", "--config", str(ROOT / "conf" / "small.yaml"),
         "--train", str(data / "train.jsonl"), "--valid", str(valid), "--exp-dir", str(exp),
         f"training.max_steps={STEPS}", "training.epochs=100000", "training.num_threads=2",
         "training.global_batch_seconds=80", "training.split_hours=8",  # the pieces all along (speed copies counted)
         "training.valid_decode_utts=0", "training.checkpoint_every=0", "training.log_every=5",
         "tokenizer.vocab_size=128"],
        capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "pieces of about 5 s" in done.stderr  # the curriculum ran
    records = [json.loads(line) for line in (exp / "metrics.jsonl").read_text().splitlines()]
    vocab = json.loads((exp / "tokenizer" / "tokenizer.json").read_text())["vocab_size"]
    chance = math.log(vocab)
    valid = [r for r in records if r["kind"] == "valid"]  # whole utterances
    first = next((r["step"] for r in valid if r["ctc_loss"] < BELOW * chance), None)
    print(f"whole utterances' CTC per token below {BELOW} ln V at step {first} of {STEPS}: "
          + " ".join(f"{r['step']}:{r['ctc_loss'] / chance:.2f}" for r in valid[::3]))
    assert first is not None, [(r["step"], round(r["ctc_loss"] / chance, 2)) for r in valid]
    assert not [r for r in records if r["kind"] == "warning"]
