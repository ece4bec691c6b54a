"""Training: schedule, overfitting, exact resume after SIGKILL, DDP equivalence, skips, averaging, logs."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
import torch

from asr.checkpoint import load_file
from asr.features import CMVNStats
from asr.trainer import TrainingConfig, learning_rate

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "conf" / "tiny.yaml"
TEXTS = ["HELLO WORLD", "GOOD MORNING", "SEE YOU SOON", "THANK YOU", "ONE TWO", "RED SKY", "BLUE SEA", "OLD TREE"]

# Deterministic, fast runs: no dropout, no augmentation, one thread.
QUIET = ["model.dropout=0.0", "data.specaug.freq_masks=0", "data.specaug.time_masks=0",
         "data.features.dither=0.0", "training.num_threads=1", "training.valid_decode_utts=2"]


def make_corpus(folder: Path, n: int = 2, seconds: float = 1.0, step: float = 0.1) -> Path:
    """`n` distinct signals (harmonic tones of different pitch and rhythm) with transcripts."""
    folder.mkdir(parents=True, exist_ok=True)
    rate = 16000
    lines = []
    for i in range(n):
        t = np.arange(int(rate * (seconds + step * i))) / rate
        f0 = 150 + 60 * i
        wave = sum(np.sin(2 * np.pi * f0 * k * t) / k for k in range(1, 6))
        wave *= 0.5 + 0.5 * np.sin(2 * np.pi * (2 + i) * t)  # a syllable-like rhythm
        path = folder / f"u{i}.wav"
        sf.write(path, (0.1 * wave).astype(np.float32), rate)
        lines.append(json.dumps({"id": f"u{i}", "audio": path.name, "duration": len(t) / rate,
                                 "text": TEXTS[i % len(TEXTS)]}))
    manifest = folder / "all.jsonl"
    manifest.write_text("\n".join(lines) + "\n")
    return manifest


FAULT_LAUNCH = ROOT / "tests" / "fault_launch.py"


def asr_train(manifest: Path, exp: Path, *overrides: str, env=None, launcher=(), faults=()):
    """`asr train` in a subprocess (under `launcher`, e.g. torchrun); `faults`: options of
    tests/fault_launch.py (e.g. ["--nonfinite", "0:2"]), which then runs it with them patched in."""
    if faults:
        cmd = [*(launcher or [sys.executable]), FAULT_LAUNCH, *faults, "--"]
    else:
        cmd = [*launcher, "-m", "asr.cli"] if launcher else [sys.executable, "-m", "asr.cli"]
    cmd += ["train", "--config", TINY, "--train", manifest, "--valid", manifest, "--exp-dir", exp, *QUIET, *overrides]
    return subprocess.run([str(c) for c in cmd], capture_output=True, text=True, env=env, timeout=600)


def weights(path: Path) -> dict[str, torch.Tensor]:
    return load_file(path)["state_dict"]


def test_learning_rate_schedules():
    noam = TrainingConfig(lr=1e-3, warmup_steps=10, scheduler="noam")
    assert learning_rate(noam, 0, 100) == pytest.approx(1e-4)
    assert learning_rate(noam, 9, 100) == pytest.approx(1e-3)  # the peak at the end of warmup
    assert learning_rate(noam, 39, 100) == pytest.approx(1e-3 * (10 / 40) ** 0.5)
    cosine = TrainingConfig(lr=1e-3, warmup_steps=10, scheduler="cosine", min_lr=1e-5)
    assert learning_rate(cosine, 9, 100) == pytest.approx(1e-3)
    assert learning_rate(cosine, 99, 100) == pytest.approx(1e-5)
    mid = learning_rate(cosine, 54, 100)
    assert 1e-5 < mid < 1e-3


@pytest.mark.slow
def test_overfits_two_utterances(tmp_path):
    manifest = make_corpus(tmp_path / "data", n=2)
    exp = tmp_path / "exp"
    out = asr_train(manifest, exp, "training.epochs=150", "training.lr=3e-3", "training.warmup_steps=20",
                    "data.num_workers=0", "training.checkpoint_every=0", "training.valid_decode_utts=2")
    assert out.returncode == 0, out.stderr[-2000:]
    valid = [json.loads(line) for line in (exp / "metrics.jsonl").read_text().splitlines()]
    last = [r for r in valid if r["kind"] == "valid"][-1]
    assert last["wer"] == 0.0, last  # greedy decoding reproduces both transcripts exactly
    for thing in ("curves.png", "model_last.pt", "config.yaml", "cmvn.json", "tokenizer/tokenizer.json"):
        assert (exp / thing).exists(), thing
    assert list((exp / "tensorboard").glob("events.out.tfevents*"))


def test_resume_after_sigkill_gives_identical_weights(tmp_path):
    manifest = make_corpus(tmp_path / "data", n=8, seconds=0.6)
    args = ["training.max_steps=24", "training.epochs=100", "training.checkpoint_every=3", "data.num_workers=2",
            "data.max_batch_seconds=1.5", "model.dropout=0.1"]
    straight = tmp_path / "straight"
    out = asr_train(manifest, straight, *args)
    assert out.returncode == 0, out.stderr[-2000:]

    killed = tmp_path / "killed"
    cmd = [sys.executable, "-m", "asr.cli", "train", "--config", TINY, "--train", manifest, "--valid", manifest,
           "--exp-dir", killed, *QUIET, *args]
    proc = subprocess.Popen([str(c) for c in cmd], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            start_new_session=True)
    index = killed / "checkpoints" / "index.json"
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None:
        if index.is_file() and any(e["step"] >= 9 for e in json.loads(index.read_text() or "[]")):
            break
        time.sleep(0.05)
    assert proc.poll() is None, "training ended before it could be killed"
    os.killpg(proc.pid, signal.SIGKILL)  # the trainer and its data workers
    proc.wait()
    assert not (killed / "model_last.pt").exists()
    out = asr_train(manifest, killed, *args)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "resumed from" in out.stderr
    a, b = weights(straight / "model_last.pt"), weights(killed / "model_last.pt")
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_refuses_resume_with_another_config(tmp_path):
    manifest = make_corpus(tmp_path / "data", n=2)
    exp = tmp_path / "exp"
    assert asr_train(manifest, exp, "training.max_steps=1", "data.num_workers=0").returncode == 0
    out = asr_train(manifest, exp, "training.max_steps=1", "data.num_workers=0", "training.lr=0.5")
    assert out.returncode == 1
    assert "training.lr" in out.stderr and len(out.stderr.strip().splitlines()) == 1


def test_an_exp_saved_before_frame_shift_ms_existed_resumes(tmp_path):
    """EXP/config.yaml of a run before model.frame_shift_ms existed: the same command resumes."""
    import yaml

    manifest = make_corpus(tmp_path / "data", n=2)
    exp = tmp_path / "exp"
    assert asr_train(manifest, exp, "training.max_steps=1", "data.num_workers=0").returncode == 0
    saved = yaml.safe_load((exp / "config.yaml").read_text())
    del saved["model"]["frame_shift_ms"]
    (exp / "config.yaml").write_text(yaml.safe_dump(saved, sort_keys=False))
    out = asr_train(manifest, exp, "training.max_steps=1", "data.num_workers=0")
    assert out.returncode == 0, out.stderr


def test_the_model_frame_shift_is_the_frontends():
    from asr.trainer import ExperimentConfig, load_experiment_config

    config = load_experiment_config(str(ROOT / "conf" / "tiny.yaml"), ["data.features.frame_shift_ms=20"])
    assert config.model.frame_shift_ms == 20.0
    assert ExperimentConfig().model.frame_shift_ms == 10.0


def test_mel_bins_that_disagree_stop_with_one_line(tmp_path):
    """CMVN statistics of another frontend (or a model of other n_mels) are refused before any step."""
    manifest = make_corpus(tmp_path / "data", n=2)
    stats = CMVNStats()
    stats.add(torch.randn(50, 40))
    stats.save(tmp_path / "cmvn40.json")
    out = asr_train(manifest, tmp_path / "exp", "training.max_steps=1", "data.num_workers=0",
                    "--cmvn", tmp_path / "cmvn40.json")
    assert out.returncode == 1
    last = out.stderr.strip().splitlines()[-1]  # after the tokenizer's line
    assert last.startswith("asr train: ")
    assert "data.features.n_mels = 80, model.n_mels = 80, 40 in the CMVN statistics" in last
    out = asr_train(manifest, tmp_path / "exp2", "training.max_steps=1", "data.num_workers=0", "model.n_mels=40")
    assert out.returncode == 1 and "model.n_mels = 40" in out.stderr, out.stderr


def test_training_reads_dumped_features(tmp_path):
    """'asr cmvn --dump-feats' then 'asr train --feats': the steps read the archive; an archive of
    other mel bins is refused in one line."""
    manifest = make_corpus(tmp_path / "data", n=2)
    for n_mels in (80, 40):
        done = subprocess.run([sys.executable, "-m", "asr.cli", "cmvn", "--manifest", str(manifest), "--out",
                               str(tmp_path / f"cmvn{n_mels}.json"), "--n-mels", str(n_mels), "--dump-feats",
                               str(tmp_path / f"feats{n_mels}"), "--num-workers", "0"],
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
    out = asr_train(manifest, tmp_path / "exp", "training.max_steps=2", "data.num_workers=0",
                    "--cmvn", tmp_path / "cmvn80.json", "--feats", tmp_path / "feats80")
    assert out.returncode == 0, out.stderr
    assert "features of 2 of 2 utterances from" in out.stderr
    out = asr_train(manifest, tmp_path / "exp40", "training.max_steps=2", "data.num_workers=0",
                    "--cmvn", tmp_path / "cmvn80.json", "--feats", tmp_path / "feats40")
    assert out.returncode == 1
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("asr train: ") and "dumped with other features (n_mels differ" in last


def test_average_and_nonfinite_skip(tmp_path):
    manifest = make_corpus(tmp_path / "data", n=4)
    exp = tmp_path / "exp"
    out = asr_train(manifest, exp, "training.epochs=3", "data.num_workers=0", "data.max_batch_seconds=2.5",
                    faults=["--nonfinite", "0:2"])  # rank 0, optimizer step 2
    assert out.returncode == 0, out.stderr[-2000:]
    assert "non-finite" in out.stderr
    records = [json.loads(line) for line in (exp / "metrics.jsonl").read_text().splitlines()]
    assert max(r.get("skipped_steps", 0) for r in records) == 1

    avg = tmp_path / "avg.pt"
    out = subprocess.run([sys.executable, "-m", "asr.cli", "average", "--exp-dir", exp, "--num", "5", "--out", avg],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "only 3" in out.stderr  # three epoch checkpoints with a validation loss
    model = torch.load(avg, weights_only=True)
    assert model["format"] == "asr-model" and set(model) >= {"model", "frontend", "tokenizer", "state_dict"}


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("torchrun") is None and not (Path(sys.executable).parent / "torchrun").exists(),
                    reason="torchrun not found")
def test_ddp_two_ranks_equal_one_process(tmp_path):
    """Two gloo ranks with one batch each == one process accumulating the same two batches."""
    manifest = make_corpus(tmp_path / "data", n=8, seconds=0.75, step=0.0)  # 2 a batch: 4 batches, even
    # eps >> |g| makes Adam's update proportional to the gradient, so a wrong scale would show.
    common = ["training.max_steps=3", "training.epochs=10", "data.num_workers=0", "data.max_batch_seconds=1.5",
              "training.eps=100.0", "training.lr=1.0", "training.warmup_steps=1", "training.scheduler=constant",
              "training.checkpoint_every=0", "training.valid_decode_utts=0", "training.log_every=1"]
    one = tmp_path / "one"
    out = asr_train(manifest, one, *common, "training.accum_grad=2")
    assert out.returncode == 0, out.stderr[-2000:]
    two = tmp_path / "two"
    torchrun = [str(Path(sys.executable).parent / "torchrun"), "--nproc_per_node", "2", "--master_port", "29517"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = asr_train(manifest, two, *common, env=env, launcher=torchrun)
    assert out.returncode == 0, out.stderr[-3000:]
    a, b = weights(one / "model_last.pt"), weights(two / "model_last.pt")
    start = weights_at_init(tmp_path)
    moved = max(float((a[k].double() - start[k].double()).abs().max()) for k in a if a[k].is_floating_point())
    assert moved > 1e-4
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-6)
    logged = [[json.loads(line)["loss"] for line in (e / "metrics.jsonl").read_text().splitlines()
               if json.loads(line)["kind"] == "train"] for e in (one, two)]
    assert logged[0] == pytest.approx(logged[1], rel=1e-5)  # rank 0 logs the whole batch's loss


def weights_at_init(tmp_path: Path) -> dict[str, torch.Tensor]:
    from asr.model import ModelConfig, build_model
    from asr.trainer import load_experiment_config

    config = load_experiment_config(str(TINY), QUIET)
    vocab = load_file(tmp_path / "one" / "model_last.pt")["model"]["vocab_size"]
    torch.manual_seed(config.training.seed)
    model = build_model(ModelConfig(**{**vars(config.model), "vocab_size": vocab}))
    return model.state_dict()


@pytest.mark.slow
def test_nonfinite_on_one_rank_of_two_is_skipped_without_a_hang(tmp_path):
    manifest = make_corpus(tmp_path / "data", n=8, seconds=0.75, step=0.0)
    exp = tmp_path / "exp"
    torchrun = [str(Path(sys.executable).parent / "torchrun"), "--nproc_per_node", "2", "--master_port", "29519"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = asr_train(manifest, exp, "training.max_steps=4", "training.epochs=10", "data.num_workers=0",
                    "data.max_batch_seconds=1.5", "training.checkpoint_every=0", env=env, launcher=torchrun,
                    faults=["--nonfinite", "1:2"])  # rank 1 only, attempt 2
    assert out.returncode == 0, out.stderr[-3000:]
    records = [json.loads(line) for line in (exp / "metrics.jsonl").read_text().splitlines()]
    assert max(r.get("skipped_steps", 0) for r in records) == 1
    assert max(r["step"] for r in records) == 4  # both ranks skipped the same step and went on


@pytest.mark.parametrize("path", sorted((ROOT / "conf").glob("*.yaml")), ids=lambda p: p.name)
def test_every_config_loads_whole(path):
    """Every section of every training config is known and typed (the model test builds them)."""
    from asr.trainer import load_experiment_config

    config = load_experiment_config(str(path), [])
    assert config.training.epochs > 0 and config.data.max_batch_seconds > 0


def test_early_stopping_and_checkpoint_retention(tmp_path):
    manifest = make_corpus(tmp_path / "data", n=2)
    exp = tmp_path / "exp"
    # lr 0: the validation loss never improves, so patience 2 stops after epoch 3 of 10.
    out = asr_train(manifest, exp, "training.epochs=10", "training.lr=0.0", "training.patience=2",
                    "training.keep_last=1", "training.keep_best=1", "data.num_workers=0",
                    "training.valid_decode_utts=0")
    assert out.returncode == 0, out.stderr[-2000:]
    assert "no better validation loss for 2 epochs" in out.stderr
    valid = [json.loads(line) for line in (exp / "metrics.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in valid if r["kind"] == "valid"] == [1, 2, 3]
    kept = sorted(p.name for p in (exp / "checkpoints").glob("ckpt-*.pt"))
    assert kept == ["ckpt-00000001.pt", "ckpt-00000003.pt"]  # the best (first) and the last


def test_metrics_of_a_resumed_run_read_as_one_run(tmp_path):
    """A run resumed from step 2 drops what the interrupted run logged after it (and a line a
    kill cut short); read_records skips such a line."""
    from asr.train_log import TrainLog, read_records

    metrics = tmp_path / "metrics.jsonl"
    lines = [json.dumps({"kind": "train", "step": s, "loss": 1.0}) for s in (1, 2, 3)]
    metrics.write_text("\n".join(lines) + '\n{"kind": "tra')
    assert [r["step"] for r in read_records(metrics)] == [1, 2, 3]
    logger = TrainLog(tmp_path, True, summarize=lambda sums, counts, n: {"loss": sums[0] / n}, speed_key="x_per_s",
                      resumed_at=2)
    logger.valid({"loss": 0.5, "epoch": 1, "step": 2})
    logger.close()
    assert read_records(metrics) == [json.loads(lines[0]), json.loads(lines[1]),
                                     {"kind": "valid", "loss": 0.5, "epoch": 1, "step": 2}]


def test_a_collective_that_lost_a_rank_is_one_line():
    from asr.checkpoint import TrainingError
    from asr.distributed import Context, collective_errors

    two = Context(rank=1, world_size=2, local_rank=1, device=torch.device("cpu"))
    with pytest.raises(TrainingError, match=r"^rank 1: lost contact with another rank \(Connection closed by peer\); "
                                            "the job stops: resume here$"):
        with collective_errors(two, lambda: "resume here"):
            raise RuntimeError("[/src/gloo/transport.cc:123] Connection closed by peer")
    one = Context(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
    with pytest.raises(RuntimeError, match="Connection closed"):  # one process: left as it is
        with collective_errors(one, lambda: "resume here"):
            raise RuntimeError("Connection closed by peer")
