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
from asr.train_config import TrainingConfig, learning_rate

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


def plan_steps(config, world: int, epoch: int) -> list[list[tuple[int, ...]]]:
    """The micro-batches of each optimizer step of `epoch`, as the ranks of a `world`-process run
    take them (rank r: its micro-batches k*accum .. (k+1)*accum - 1 of step k), sorted."""
    from asr.sampler import DurationBucketSampler
    from asr.train_setup import batch_plan

    plan = batch_plan(config, world)
    ranks = [DurationBucketSampler(DURATIONS, max_batch_seconds=plan.micro_batch, seed=3, epoch=epoch,
                                   num_replicas=world, rank=r, group=plan.group).rank_batches() for r in range(world)]
    steps = len(ranks[0]) // plan.accum
    assert all(len(r) == steps * plan.accum for r in ranks)
    return [sorted(tuple(b) for r in ranks for b in r[k * plan.accum:(k + 1) * plan.accum]) for k in range(steps)]


DURATIONS = np.random.default_rng(0).uniform(1.0, 16.0, 3000)


def test_schedule_is_world_size_invariant():
    """With a global batch of 8 micro-batches, (1 process, accum 8), (2, 4) and (8, 1) make the same
    optimizer steps over the same data, with the same learning rates; the schedule's length is fixed
    from the first epoch; 64 processes keep the step's size under a lower micro-batch cap."""
    from asr.train_config import total_steps
    from asr.train_setup import batch_plan, load_experiment_config

    config = load_experiment_config(str(TINY), ["data.max_batch_seconds=60", "training.global_batch_seconds=480",
                                                "training.scheduler=cosine", "training.warmup_steps=20",
                                                "training.epochs=3"])
    assert [(batch_plan(config, w).accum, batch_plan(config, w).micro_batch) for w in (1, 2, 8)] == [
        (8, 60.0), (4, 60.0), (1, 60.0)]
    for epoch in (0, 1):
        runs = {w: plan_steps(config, w, epoch) for w in (1, 2, 8)}
        assert len(runs[1]) > 20
        assert runs[1] == runs[2] == runs[8]
        assert sorted(i for step in runs[1] for b in step for i in b) == list(range(len(DURATIONS)))
    tc = config.training
    lengths = {w: total_steps(tc, len(plan_steps(config, w, 0))) for w in (1, 2, 8)}
    assert lengths[1] == lengths[2] == lengths[8] == 3 * len(runs[1])
    rates = {w: [learning_rate(tc, s, lengths[w]) for s in range(lengths[w])] for w in (1, 2, 8)}
    assert rates[1] == rates[2] == rates[8]
    assert rates[1][19] == tc.lr and rates[1][-1] == pytest.approx(tc.min_lr)
    wide = batch_plan(config, 64)  # more processes than micro-batches: each one, at 480 / 64 s
    assert (wide.accum, wide.micro_batch, wide.step_size, wide.cap) == (1, 7.5, 480.0, 60.0)
    # without a global batch each process accumulates accum_grad: the step grows with the processes
    legacy = load_experiment_config(str(TINY), ["data.max_batch_seconds=60", "training.accum_grad=2"])
    assert [batch_plan(legacy, w).step_size for w in (1, 8)] == [120.0, 960.0]


def test_a_global_batch_that_is_no_multiple_of_the_micro_batch_is_a_config_error():
    from asr.config import ConfigError
    from asr.train_setup import load_experiment_config

    with pytest.raises(ConfigError, match=r"global_batch_seconds \(100\) must be a whole multiple of "
                                          r"data.max_batch_seconds \(60\)"):
        load_experiment_config(str(TINY), ["data.max_batch_seconds=60", "training.global_batch_seconds=100"])
    with pytest.raises(ConfigError, match="global_batch_seconds or training.accum_grad, not both"):
        load_experiment_config(str(TINY), ["data.max_batch_seconds=60", "training.global_batch_seconds=120",
                                           "training.accum_grad=2"])


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


def test_a_step_that_ends_an_epoch_is_checkpointed_once_with_its_validation(tmp_path, monkeypatch):
    """checkpoint_every=1: every step is checkpointed, the epoch's last one only by its
    validation (one file a step: a kill between a file and the index cannot leave the index
    describing another write of the same file)."""
    import asr.trainer
    from asr import cli

    manifest = make_corpus(tmp_path / "data", n=4, seconds=0.6)
    saved = []
    original = asr.trainer.save_checkpoint

    def recording(exp, envelope, **kw):
        saved.append((kw["state"]["step"], kw["state"]["epoch"], kw["valid_loss"]))
        return original(exp, envelope, **kw)

    monkeypatch.setattr(asr.trainer, "save_checkpoint", recording)
    threads = torch.get_num_threads()  # training in this process sets its own (training.num_threads)
    try:
        code = cli.main(["train", "--config", str(TINY), "--train", str(manifest), "--valid", str(manifest),
                         "--exp-dir", str(tmp_path / "exp"), *QUIET, "training.epochs=2", "training.max_steps=0",
                         "training.checkpoint_every=1", "data.num_workers=0", "data.max_batch_seconds=1.5",
                         "training.valid_decode_utts=0"])
    finally:
        torch.set_num_threads(threads)
    assert code == 0
    steps = [step for step, _, _ in saved]
    assert len(steps) == len(set(steps)) and steps == list(range(1, steps[-1] + 1)), saved
    validated = [(step, epoch) for step, epoch, loss in saved if loss is not None]
    assert len(validated) == 2 and validated[-1] == (steps[-1], 2), saved
    index = json.loads((tmp_path / "exp" / "checkpoints" / "index.json").read_text())
    assert index[-1]["step"] == steps[-1] and index[-1]["valid_loss"] is not None


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
    from asr.train_setup import ExperimentConfig, load_experiment_config

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


TORCHRUN = Path(sys.executable).parent / "torchrun"
needs_torchrun = pytest.mark.skipif(shutil.which("torchrun") is None and not TORCHRUN.exists(),
                                    reason="torchrun not found")


def torchrun(n: int, port: int) -> list[str]:
    return [str(TORCHRUN), "--nproc_per_node", str(n), "--master_port", str(port)]


@pytest.mark.slow
@needs_torchrun
def test_ddp_two_ranks_equal_one_process(tmp_path):
    """Two gloo ranks taking one micro-batch each == one process accumulating the same two, under
    a warmup and a cosine schedule whose length comes from the data (2 epochs of 2 steps)."""
    manifest = make_corpus(tmp_path / "data", n=8, seconds=0.75, step=0.0)  # 2 a batch: 4 batches, even
    # eps >> |g| makes Adam's update proportional to the gradient, so a wrong scale would show.
    common = ["training.epochs=2", "data.num_workers=0", "data.max_batch_seconds=1.5",
              "training.global_batch_seconds=3.0", "training.eps=100.0", "training.lr=1.0",
              "training.warmup_steps=2", "training.scheduler=cosine", "training.min_lr=0.1",
              "training.checkpoint_every=0", "training.valid_decode_utts=0", "training.log_every=1"]
    one = tmp_path / "one"
    out = asr_train(manifest, one, *common)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "2 micro-batches of at most 1.5 padded seconds (3 s), 1 process(es) accumulating 2 each" in out.stderr
    two = tmp_path / "two"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = asr_train(manifest, two, *common, env=env, launcher=torchrun(2, 29517))
    assert out.returncode == 0, out.stderr[-3000:]
    a, b = weights(one / "model_last.pt"), weights(two / "model_last.pt")
    start = weights_at_init(tmp_path)
    moved = max(float((a[k].double() - start[k].double()).abs().max()) for k in a if a[k].is_floating_point())
    assert moved > 1e-4
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-6)
    records = [[json.loads(line) for line in (e / "metrics.jsonl").read_text().splitlines()] for e in (one, two)]
    train = [[r for r in rs if r["kind"] == "train"] for rs in records]
    lrs = [1.0 * 0.5, 1.0, 0.1 + 0.9 * 0.5 * (1 + np.cos(np.pi * 1 / 2)), 0.1]  # warmup 2, then cosine to 4 steps
    for rs in train:
        assert [r["step"] for r in rs] == [1, 2, 3, 4]
        assert [r["lr"] for r in rs] == pytest.approx(lrs)
    assert [r["loss"] for r in train[0]] == pytest.approx([r["loss"] for r in train[1]], rel=1e-5)


def kill_tree(pid: int) -> None:
    """SIGKILL a process and all its descendants (found through /proc), at once."""
    family, todo = [], [pid]
    while todo:
        p = todo.pop()
        family.append(p)
        for children in Path(f"/proc/{p}/task").glob("*/children"):
            try:
                todo += [int(c) for c in children.read_text().split()]
            except OSError:
                pass
    for p in family:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass


def newest_step(index: Path) -> int:
    return max((e["step"] for e in json.loads(index.read_text() or "[]")), default=0) if index.is_file() else 0


def train_killed(manifest: Path, exp: Path, args: list[str], kill_steps: list[int], n: int, port: int) -> list[str]:
    """`asr train` under torchrun (n processes), SIGKILLed (the whole job) once a checkpoint of
    each step of `kill_steps` (or a later one, past the one it resumed from) is indexed, resumed
    each time; then run to its end. The stderr of each resumed start."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [*torchrun(n, port), FAULT_LAUNCH, "--rank-weights", "--", "train", "--config", TINY, "--train", manifest,
           "--valid", manifest, "--exp-dir", exp, *QUIET, *args]
    index, logs = exp / "checkpoints" / "index.json", []
    for i, at in enumerate(kill_steps):
        log_path = exp.parent / f"{exp.name}.start{i}.log"  # a file: a pipe could fill and stall the job
        with open(log_path, "w") as log_file:
            job = subprocess.Popen([str(c) for c in cmd], stdout=subprocess.DEVNULL, stderr=log_file, env=env,
                                   start_new_session=True)
            at = max(at, newest_step(index) + 1)  # past the checkpoint it resumes from
            deadline = time.time() + 300
            while time.time() < deadline and job.poll() is None and newest_step(index) < at:
                time.sleep(0.02)
            alive = job.poll() is None
            kill_tree(job.pid)  # torchrun, both ranks (torchrun starts them in sessions of their own), their workers
            job.wait()
        logs.append(log_path.read_text())
        assert alive, f"training ended before step {at}: {logs[-1][-2000:]}"
    out = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return logs[1:] + [out.stderr]


@pytest.mark.slow
@needs_torchrun
def test_ddp_sigkill_resume_is_bit_exact(tmp_path):
    """2 gloo ranks with dropout (each rank its own draws) and loader workers, SIGKILLed at two
    seeded checkpoints (mid-epoch) and resumed: both ranks end with the weights of the run never
    killed, bit for bit."""
    import random

    manifest = make_corpus(tmp_path / "data", n=16, seconds=0.6, step=0.05)
    args = ["training.max_steps=14", "training.epochs=100", "training.checkpoint_every=2", "data.num_workers=1",
            "data.max_batch_seconds=1.5", "training.global_batch_seconds=3.0", "model.dropout=0.1",
            "training.valid_decode_utts=0", "training.warmup_steps=4"]
    first = random.Random(0).choice([4, 6])
    kills = [first, first + random.Random(1).choice([2, 4])]
    killed = tmp_path / "killed"
    logs = train_killed(manifest, killed, args, kills, 2, 29521)
    assert all("resumed from" in log for log in logs), logs
    straight = tmp_path / "straight"
    train_killed(manifest, straight, args, [], 2, 29523)
    ranks = [torch.load(e / f"weights.rank{r}.pt") for e in (straight, killed) for r in (0, 1)]
    for k in ranks[0]:
        assert all(torch.equal(ranks[0][k], other[k]) for other in ranks[1:]), k
    a = weights(straight / "model_last.pt")
    assert all(torch.equal(a[k], ranks[0][k]) for k in a)


@pytest.mark.slow
@needs_torchrun
def test_resume_on_another_number_of_processes(tmp_path):
    """Killed mid-epoch with 2 processes and resumed with 1: with a global batch both divide, the
    one process continues at the same data (weights equal to the run of 2 never killed, to the
    rounding of an all-reduce)."""
    manifest = make_corpus(tmp_path / "data", n=16, seconds=0.6, step=0.05)
    args = ["training.max_steps=10", "training.epochs=100", "training.checkpoint_every=2", "data.num_workers=0",
            "data.max_batch_seconds=1.5", "training.valid_decode_utts=0", "training.warmup_steps=4"]
    straight = tmp_path / "straight"
    train_killed(manifest, straight, [*args, "training.global_batch_seconds=3.0"], [], 2, 29525)
    moved = tmp_path / "moved"
    train_killed(manifest, moved, [*args, "training.global_batch_seconds=3.0"], [4], 2, 29527)
    (moved / "model_last.pt").unlink()  # finish it again from its step-4 checkpoint, in one process
    for ckpt in sorted((moved / "checkpoints").glob("ckpt-*.pt"))[2:]:  # keep steps 2 and 4
        ckpt.unlink()
    entries = json.loads((moved / "checkpoints" / "index.json").read_text())
    (moved / "checkpoints" / "index.json").write_text(json.dumps([e for e in entries if e["step"] <= 4]))
    out = asr_train(manifest, moved, *args, "training.global_batch_seconds=3.0", "data.num_workers=0")
    assert out.returncode == 0, out.stderr[-2000:]
    assert "resumed from" in out.stderr and "holds the random states of 2 process(es), this run has 1" in out.stderr
    a, b = weights(straight / "model_last.pt"), weights(moved / "model_last.pt")
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-6)



def test_a_mid_epoch_resume_cut_otherwise_is_refused_in_one_line(tmp_path):
    """Without a global batch, 2 processes took one micro-batch each a step; 1 process would cut
    the epoch's list into other steps: mid-epoch it refuses, at an epoch's end it continues."""
    from types import SimpleNamespace

    from asr.asr_task import AUDIO
    from asr.checkpoint import TrainingError
    from asr.train_config import BatchPlan
    from asr.trainer import State, _check_position

    saved = State(epoch=0, batch=6, step=3, step_group=2, micro_batch=1.5, processes=2)
    run = SimpleNamespace(plan=BatchPlan(world_size=1, accum=1, micro_batch=1.5, cap=1.5), exp=tmp_path, unit=AUDIO)
    with pytest.raises(TrainingError, match=r"stopped mid-epoch, its steps 2 micro-batches of at most 1.5 s written "
                                            r"by 2 process\(es\); with 1 this run cuts them as 1 of 1.5 s .*resume "
                                            r"with 2 process\(es\)"):
        _check_position(run, saved)
    _check_position(run, State(epoch=1, batch=0, step_group=2, micro_batch=1.5, processes=2))
    same = SimpleNamespace(plan=BatchPlan(world_size=1, accum=2, micro_batch=1.5, cap=1.5), exp=tmp_path, unit=AUDIO)
    _check_position(same, saved)  # a global batch of 2 micro-batches: 1 process accumulating 2 continues


def weights_at_init(tmp_path: Path, exp: str = "one") -> dict[str, torch.Tensor]:
    from asr.model import ModelConfig, build_model
    from asr.train_setup import load_experiment_config

    config = load_experiment_config(str(TINY), QUIET)
    vocab = load_file(tmp_path / exp / "model_last.pt")["model"]["vocab_size"]
    torch.manual_seed(config.training.seed)
    model = build_model(ModelConfig(**{**vars(config.model), "vocab_size": vocab}))
    return model.state_dict()


@pytest.mark.slow
def test_nonfinite_on_one_rank_of_two_is_skipped_without_a_hang(tmp_path):
    manifest = make_corpus(tmp_path / "data", n=8, seconds=0.75, step=0.0)
    exp = tmp_path / "exp"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = asr_train(manifest, exp, "training.max_steps=4", "training.epochs=10", "data.num_workers=0",
                    "data.max_batch_seconds=1.5", "training.checkpoint_every=0", env=env, launcher=torchrun(2, 29519),
                    faults=["--nonfinite", "1:2"])  # rank 1 only, attempt 2
    assert out.returncode == 0, out.stderr[-3000:]
    records = [json.loads(line) for line in (exp / "metrics.jsonl").read_text().splitlines()]
    assert max(r.get("skipped_steps", 0) for r in records) == 1
    assert max(r["step"] for r in records) == 4  # both ranks skipped the same step and went on


@pytest.mark.parametrize("path", sorted((ROOT / "conf").glob("*.yaml")), ids=lambda p: p.name)
def test_every_config_loads_whole(path):
    """Every section of every training config is known and typed (the model test builds them)."""
    from asr.train_setup import load_experiment_config

    config = load_experiment_config(str(path), [])
    cap = config.data.max_batch_seconds
    assert config.training.epochs > 0 and (cap == "auto" or cap > 0)
    if path.name.startswith("librispeech_"):  # GPU configs: the micro-batch found on the device
        assert cap == "auto" and config.training.global_batch_seconds > 0


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
    from asr.lm_train import TOKENS
    from asr.train_log import TrainLog, read_records

    metrics = tmp_path / "metrics.jsonl"
    lines = [json.dumps({"kind": "train", "step": s, "loss": 1.0}) for s in (1, 2, 3)]
    metrics.write_text("\n".join(lines) + '\n{"kind": "tra')
    assert [r["step"] for r in read_records(metrics)] == [1, 2, 3]
    logger = TrainLog(tmp_path, True, summarize=lambda sums, counts, n: {"loss": sums[0] / n}, unit=TOKENS,
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


def test_sigterm_is_not_taken_for_an_ordinary_error_on_its_way_out():
    """A SIGTERM that lands inside code skipping bad utterances (`except Exception`, as audio
    loading does) still stops the run with its one line."""
    from asr.checkpoint import TrainingError
    from asr.distributed import Context, sigterm_stops

    before = signal.getsignal(signal.SIGTERM)
    one = Context(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
    swallowed = []
    with pytest.raises(TrainingError, match=r"^stopped by SIGTERM; resume here$"):
        with sigterm_stops(one, lambda: "resume here"):
            try:
                os.kill(os.getpid(), signal.SIGTERM)
                for _ in range(1000):
                    time.sleep(0.001)
            except Exception as e:  # a per-utterance handler
                swallowed.append(e)
    assert swallowed == []
    assert signal.getsignal(signal.SIGTERM) is before


def test_training_with_the_device_frontend_equals_the_cpu_frontend(tmp_path):
    """data.frontend=device (workers load waveforms, the training step computes fbank and CMVN)
    trains the same weights as the CPU frontend without dither and SpecAugment."""
    manifest = make_corpus(tmp_path / "data", n=4, seconds=0.6)
    common = ["training.max_steps=3", "data.num_workers=1", "data.max_batch_seconds=1.5",
              "training.checkpoint_every=0"]
    runs = {}
    for frontend in ("cpu", "device"):
        exp = tmp_path / frontend
        out = asr_train(manifest, exp, *common, f"data.frontend={frontend}")
        assert out.returncode == 0, out.stderr[-2000:]
        runs[frontend] = weights(exp / "model_last.pt")
    start = weights_at_init(tmp_path, "cpu")
    assert any(not torch.equal(runs["cpu"][k], start[k]) for k in start)
    for k in runs["cpu"]:
        torch.testing.assert_close(runs["cpu"][k], runs["device"][k], rtol=1e-4, atol=1e-5)
    out = asr_train(manifest, tmp_path / "both", *common, "data.frontend=device", "--feats", tmp_path)
    assert out.returncode != 0 and "cannot read the feature archive" in out.stderr


def train_two_utterances(tmp_path: Path, *overrides: str) -> tuple[subprocess.CompletedProcess, list[dict]]:
    """A tiny run on two utterances with the plateau check due at once: (its process, its records)."""
    manifest = make_corpus(tmp_path / "data", n=2)
    exp = tmp_path / "exp"
    out = asr_train(manifest, exp, *overrides, "training.plateau_check_hours=0.001", "training.checkpoint_every=0")
    assert out.returncode == 0, out.stderr[-2000:]
    return out, [json.loads(line) for line in (exp / "metrics.jsonl").read_text().splitlines()]


def test_plateau_warning_is_logged(tmp_path):
    """A model held at chance by a zero learning rate: one warning, in the log and in
    metrics.jsonl, with the CTC loss per token it saw; train and valid losses are per token."""
    import math

    exp = tmp_path / "exp"
    out, records = train_two_utterances(tmp_path, "training.epochs=6", "training.lr=0.0", "training.warmup_steps=1")
    warnings = [r for r in records if r["kind"] == "warning"]
    assert len(warnings) == 1 and warnings[0]["what"] == "ctc_plateau", warnings
    w = warnings[0]
    vocab = load_file(exp / "model_last.pt")["model"]["vocab_size"]
    assert w["chance"] == pytest.approx(math.log(vocab)) and w["ctc_loss"] >= 0.7 * w["chance"]
    assert out.stderr.count("near chance") == 1, out.stderr[-3000:]
    assert "training.lr" in w["message"]  # the likely causes are named
    # the same normalization in both: at lr 0 the training (no augmentation here) and validation
    # CTC losses per token are the same model on the same utterances
    train = [r for r in records if r["kind"] == "train"]
    valid = [r for r in records if r["kind"] == "valid"]
    assert train[-1]["ctc_loss"] == pytest.approx(valid[-1]["ctc_loss"], rel=0.05)
    assert train[-1]["att_loss"] == pytest.approx(valid[-1]["att_loss"], rel=0.05)


def test_a_learning_run_gives_no_plateau_warning(tmp_path):
    """... and speaks of audio: its train records give the throughput and the hours trained on,
    its last line the steps and the hours."""
    out, records = train_two_utterances(tmp_path, "training.epochs=60", "training.lr=3e-3",
                                        "training.warmup_steps=20")
    assert not [r for r in records if r["kind"] == "warning"]
    assert "near chance" not in out.stderr
    import re

    train = [r for r in records if r["kind"] == "train"]
    assert all(r["audio_s_per_s"] > 0 for r in train)
    hours = [r["audio_hours"] for r in train]
    assert hours == sorted(hours) and hours[0] > 0
    steps, said = re.search(r"training stopped: 60 epochs done \((\d+) steps, ([\d.]+) hours of audio\)",
                            out.stderr).groups()
    assert float(said) == pytest.approx(60 * (1.0 + 1.1) / 3600, rel=0.05)  # make_corpus's 2 utterances (frames)
    assert float(said) == pytest.approx(hours[-1] * int(steps) / train[-1]["step"], rel=0.01)


def test_the_loop_imports_nothing_of_a_task():
    """asr.trainer, and all it imports (inside functions too), knows no task: no audio, features,
    tokenizer, corpora, curriculum or model; the tasks' drivers import it, never the reverse."""
    from test_imports import import_graph

    graph = import_graph(ROOT)
    reached, todo = set(), ["asr.trainer"]
    while todo:
        name = todo.pop()
        if name not in reached:
            reached.add(name)
            todo += graph[name]
    assert reached == {"asr.trainer", "asr.train_task", "asr.train_config", "asr.train_log", "asr.checkpoint",
                       "asr.distributed", "asr.config", "asr.fileio"}


def test_a_checkpoint_that_counted_in_audio_hours_resumes():
    """The state of a checkpoint written before the loop counted in the task's unit reads as its
    successor's: audio_hours (the amount / 3600) as the amount, micro_batch_seconds as the cap."""
    from asr.trainer import State

    state = State.saved({"epoch": 2, "step": 40, "micro_batch_seconds": 60.0, "audio_hours": 1.5,
                         "plateau_reported": True})
    assert (state.epoch, state.step, state.micro_batch, state.trained, state.plateau_reported) == (
        2, 40, 60.0, 5400.0, True)
    assert State.saved(vars(state)) == state


def test_the_length_curriculum_trains_on_pieces_first(tmp_path):
    """training.split_hours: the first epochs (here 2: about split_hours of audio) on the
    utterances cut into pieces, then whole ones; a run resumed after them builds no pieces."""
    manifest = make_corpus(tmp_path / "data", n=2)  # 1.0 and 1.1 s, two words each
    exp = tmp_path / "exp"
    hours = (1.0 + 1.1) / 3600
    args = ("training.split_seconds=0.4", f"training.split_hours={2 * hours}", "training.checkpoint_every=0")
    out = asr_train(manifest, exp, "training.epochs=3", *args)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "epochs 1-2: the 2 training utterances as 4 pieces of about 0.4 s" in out.stderr, out.stderr[-2000:]
    assert "whole utterances from epoch 3" in out.stderr
    again = asr_train(manifest, exp, "training.epochs=3", *args)  # resumed when done: no pieces left to train
    assert again.returncode == 0 and "pieces" not in again.stderr, again.stderr[-2000:]


def test_the_curriculum_counts_the_speed_perturbed_copies(tmp_path):
    """With data.speed_perturb an epoch trains on the copies too: split_hours of audio is fewer epochs."""
    manifest = make_corpus(tmp_path / "data", n=2)
    heard = (1.0 + 1.1) * (1 / 0.9 + 1 + 1 / 1.1) / 3600  # one epoch, the copies included
    out = asr_train(manifest, tmp_path / "exp", "training.epochs=2", "training.split_seconds=0.4",
                    f"training.split_hours={heard}", "data.speed_perturb=[0.9,1.1]", "training.checkpoint_every=0")
    assert out.returncode == 0, out.stderr[-2000:]
    assert "epochs 1-1: the 2 training utterances as 4 pieces" in out.stderr, out.stderr[-2000:]
    assert "whole utterances from epoch 2" in out.stderr


def test_records_give_both_losses_per_target_token():
    """Training and validation records normalize CTC as attention: per target token (eos included),
    whatever the utterances' length; "loss" is their weighted sum in both."""
    from asr.asr_task import ASRTask
    from asr.features import FeatureConfig
    from asr.model import ModelConfig, build_model

    model = build_model(ModelConfig(n_mels=8, d_model=16, ffn_dim=32, encoder_layers=1, decoder_layers=1,
                                    conv_channels=4, ctc_weight=0.3), vocab_size=10)
    task = ASRTask(model, None, FeatureConfig(n_mels=8), 0.3, torch.device("cpu"))
    # valid sums: attention 40, CTC 120 (summed), 30 correct, over 40 tokens of 4 utterances
    valid = task.valid_metrics([40.0, 120.0, 30.0, 40.0, 4.0])
    assert valid == pytest.approx({"loss": 0.3 * 3.0 + 0.7 * 1.0, "att_loss": 1.0, "ctc_loss": 3.0, "accuracy": 0.75})
    # train sums of 2 steps: each step's objective, attention per token, CTC per token, correct
    train = task.summarize([20.0, 2.0, 6.0, 30.0], [40.0, 4.0], 2)
    assert train == pytest.approx({"loss": 0.3 * 3.0 + 0.7 * 1.0, "att_loss": 1.0, "ctc_loss": 3.0, "accuracy": 0.75,
                                   "objective": 10.0})
