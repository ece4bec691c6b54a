"""Injected faults lose no work: SIGKILL at random points of training, a full disk while a
checkpoint is written, a batch that runs out of memory, a DDP rank that dies or runs out of
memory, a killed `asr decode`, and the temporary files killed writers leave behind.

The training runs use conf/tiny.yaml as tools/reliability_report.py does (dropout, SpecAugment
and dither on: the randomness a resume must replay) and compare with one uninterrupted run:
bit-identical weights, the same logged losses, the same checkpoints kept.
"""
from __future__ import annotations

import errno
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import soundfile as sf
import torch

from asr import fileio
from asr.checkpoint import load_file, save_atomic
from asr.fileio import atomic_open, remove_stale_temporaries

ROOT = Path(__file__).resolve().parents[1]
TOOL = ROOT / "tools" / "reliability_report.py"
TORCHRUN = Path(sys.executable).parent / "torchrun"
FAULT_LAUNCH = ROOT / "tests" / "fault_launch.py"
sys.path.insert(0, str(ROOT / "tools"))
from reliability_report import KILL_OVERRIDES, TINY, write_corpus  # noqa: E402

# ---------------------------------------------------------------------------------------------
# temporary files of killed writers


def dead_pid() -> int:
    """The pid of a process that has ended and been reaped."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_stale_temporaries_of_dead_writers_are_removed_by_the_next_write(tmp_path):
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    zombie = subprocess.Popen([sys.executable, "-c", "pass"])  # ends, not reaped: a zombie
    try:
        deadline = time.time() + 30
        while Path(f"/proc/{zombie.pid}").exists() and b") Z " not in Path(f"/proc/{zombie.pid}/stat").read_bytes():
            assert time.time() < deadline
            time.sleep(0.01)
        names = {
            f".ckpt-00000009.pt.{dead_pid()}.0123abcd.tmp": "removed",
            f".index.json.{zombie.pid}.89abcdef.tmp": "removed",
            f".cmvn.json.{os.getpid()}.00000000.tmp": "kept",  # ours: being written now
            f".model.pt.{sleeper.pid}.deadbeef.tmp": "kept",  # a live writer
            ".notes.tmp": "kept", "results.123.abcdef01.tmp": "kept", ".a.123.xyz.tmp": "kept", "ckpt.pt": "kept",
        }
        for name in names:
            (tmp_path / name).write_bytes(b"half a file")
        with atomic_open(tmp_path / "new.txt") as f:
            f.write("x")
        left = {p.name for p in tmp_path.iterdir()}
        assert left == {name for name, fate in names.items() if fate == "kept"} | {"new.txt"}
        assert remove_stale_temporaries(tmp_path / "absent") == []
    finally:
        sleeper.kill()
        sleeper.wait()
        zombie.wait()


def test_a_killed_writer_leaves_a_temporary_that_the_next_save_removes(tmp_path):
    save_atomic({"format": "asr-model", "version": 1, "w": torch.ones(3)}, tmp_path / "model.pt")
    before = (tmp_path / "model.pt").read_bytes()
    writer = ("import sys, time\nfrom asr.fileio import atomic_open\n"
              "with atomic_open(sys.argv[1], 'wb') as f:\n"
              "    f.write(b'x' * 100000); f.flush(); print('writing', flush=True); time.sleep(60)\n")
    proc = subprocess.Popen([sys.executable, "-c", writer, str(tmp_path / "model.pt")], stdout=subprocess.PIPE,
                            text=True)
    assert proc.stdout.readline().strip() == "writing"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    (left,) = [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")]
    assert left.startswith(f".model.pt.{proc.pid}.")
    assert (tmp_path / "model.pt").read_bytes() == before  # readers never see the half-written file
    save_atomic({"format": "asr-model", "version": 1, "w": torch.zeros(3)}, tmp_path / "other.pt")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.pt", "other.pt"]


# ---------------------------------------------------------------------------------------------
# a full disk


class FullDisk(io.FileIO):
    """A file on a disk that fills after `room` bytes: write raises ENOSPC, as the kernel does."""

    room = 0

    def write(self, data) -> int:
        if self.tell() + len(data) > self.room:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return super().write(data)


def fill_disk_after(monkeypatch, room: int) -> None:
    """Every atomic_open from now on writes to a disk with `room` bytes left."""
    FullDisk.room = room

    def full_open(fd, mode, encoding=None):
        raw = FullDisk(fd, "w")
        return raw if "b" in mode else io.TextIOWrapper(raw, encoding=encoding)

    monkeypatch.setattr(fileio, "open", full_open, raising=False)


@pytest.mark.parametrize("room", [0, 1000, 300_000])
def test_a_full_disk_during_save_keeps_the_previous_file(tmp_path, monkeypatch, room):
    old = {"format": "asr-checkpoint", "version": 1, "w": torch.arange(100_000.0)}
    save_atomic(old, tmp_path / "ckpt.pt")
    before = (tmp_path / "ckpt.pt").read_bytes()
    fill_disk_after(monkeypatch, room)
    new = {"format": "asr-checkpoint", "version": 1, "w": torch.zeros(100_000)}
    for target in ("ckpt.pt", "ckpt-next.pt"):
        with pytest.raises(OSError) as err:
            save_atomic(new, tmp_path / target)
        assert err.value.errno == errno.ENOSPC
        assert str(err.value) == f"[Errno 28] No space left on device: '{tmp_path / target}'"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt.pt"]  # no temporary, nothing new
    assert (tmp_path / "ckpt.pt").read_bytes() == before
    assert torch.equal(load_file(tmp_path / "ckpt.pt", "asr-checkpoint")["w"], old["w"])


def test_a_full_disk_while_plotting_keeps_the_previous_curves(tmp_path, monkeypatch):
    from asr.train_log import plot_curves

    metrics, png = tmp_path / "metrics.jsonl", tmp_path / "curves.png"
    lines = [{"kind": "train", "step": s, "loss": 5.0 / s} for s in range(1, 50)]
    lines += [{"kind": "valid", "step": 25, "loss": 0.4, "cer": 0.3, "wer": 0.5}]
    metrics.write_text("".join(json.dumps(r) + "\n" for r in lines))
    plot_curves(metrics, png)
    before = png.read_bytes()
    assert before.startswith(b"\x89PNG")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["curves.png", "metrics.jsonl"]
    with metrics.open("a") as f:
        f.write(json.dumps({"kind": "valid", "step": 49, "loss": 0.3, "cer": 0.2, "wer": 0.4}) + "\n")
    fill_disk_after(monkeypatch, 1000)
    with pytest.raises(OSError):
        plot_curves(metrics, png)
    assert png.read_bytes() == before  # the previous plot whole, no temporary left
    assert sorted(p.name for p in tmp_path.iterdir()) == ["curves.png", "metrics.jsonl"]


def test_plotting_the_curves_leaves_the_process_matplotlib_backend_alone(tmp_path):
    import matplotlib

    from asr.train_log import plot_curves

    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(json.dumps({"kind": "train", "step": s, "loss": 1.0 / s}) + "\n" for s in range(1, 9)))
    before = matplotlib.get_backend()
    matplotlib.use("pdf")  # a user's choice, which a library call must not switch
    try:
        plot_curves(metrics, tmp_path / "curves.png")
        assert matplotlib.get_backend() == "pdf"
    finally:
        matplotlib.use(before)
    assert (tmp_path / "curves.png").read_bytes().startswith(b"\x89PNG")


# ---------------------------------------------------------------------------------------------
# training runs (slow): one uninterrupted run, then faulty ones compared with it


def train(corpus: tuple[Path, Path], exp: Path, *extra: str, launcher: list[str] | None = None,
          wrapper: str | None = None, faults: list[str] | None = None,
          timeout: float = 300) -> subprocess.CompletedProcess:
    """`asr train` on the corpus with conf/tiny.yaml and KILL_OVERRIDES (+ extra) in a subprocess
    (under `launcher`, e.g. torchrun); `wrapper`: Python code run first in that process (a fault
    injected by monkeypatching); `faults`: options of tests/fault_launch.py (e.g. ["--oom", "0:5:0"]),
    which then runs it with those faults patched into the trainer."""
    train_manifest, valid_manifest = corpus
    args = ["train", "--config", TINY, "--train", train_manifest, "--valid", valid_manifest, "--exp-dir", exp,
            *KILL_OVERRIDES, "data.num_workers=0", *extra]
    if faults:
        cmd = [*(launcher or [sys.executable]), FAULT_LAUNCH, *faults, "--", *args]
    elif launcher:
        cmd = [*launcher, "-m", "asr.cli", *args]
    else:
        code = (wrapper or "") + "\nimport sys\nfrom asr.cli import main\nsys.exit(main(sys.argv[1:]))"
        cmd = [sys.executable, "-c", code, *args]
    return subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})


def outcome(exp: Path) -> dict:
    from asr.checkpoint import read_index
    from asr.train_log import read_records

    records = [{k: v for k, v in r.items() if k != "audio_s_per_s"} for r in read_records(exp / "metrics.jsonl")]
    return {"weights": load_file(exp / "model_last.pt")["state_dict"], "records": records,
            "checkpoints": [(e["file"], e["valid_loss"]) for e in read_index(exp / "checkpoints")]}


def assert_same_run(a: dict, b: dict) -> None:
    for k in a["weights"]:
        assert torch.equal(a["weights"][k], b["weights"][k]), k
    assert a["records"] == b["records"] and a["checkpoints"] == b["checkpoints"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> tuple[Path, Path]:
    return write_corpus(tmp_path_factory.mktemp("corpus"))


@pytest.fixture(scope="module")
def straight(corpus, tmp_path_factory) -> tuple[Path, dict]:
    exp = tmp_path_factory.mktemp("straight") / "exp"
    out = train(corpus, exp)
    assert out.returncode == 0, out.stderr[-3000:]
    return exp, outcome(exp)


@pytest.mark.slow
def test_sigkill_at_random_points_always_resumes_to_identical_weights(tmp_path):
    """20 trials, each killed 1-3 times at random moments (startup, steps, validation, checkpoint
    writes, the final model), then resumed: every one ends as the uninterrupted run did."""
    report = tmp_path / "kill.json"
    out = subprocess.run([sys.executable, TOOL, "kill", "--trials", "20", "--seed", "0", "--workdir", tmp_path / "w",
                          "--out", report], capture_output=True, text=True, timeout=600,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    result = json.loads(report.read_text()) if report.exists() else {}
    logs = "\n".join(f"{f['log']}:\n" + Path(f["log"]).read_text(errors="replace")[-2000:]
                     for f in result.get("failures", []))
    assert out.returncode == 0 and result["failures"] == [], (out.stderr[-3000:], result.get("failures"), logs)
    assert result["identical"] == result["trials"] == 20 and result["kills"] >= 20
    assert len(result["phases"]) >= 3, result["phases"]  # the kills landed in different places


@pytest.mark.slow
def test_resuming_a_finished_run_changes_nothing(corpus, straight, tmp_path):
    """Killed after the last checkpoint but before the final model: the rerun takes no extra step."""
    exp, reference = straight
    copy = tmp_path / "exp"
    shutil.copytree(exp, copy)
    (copy / "model_last.pt").unlink()
    out = train(corpus, copy)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "resumed from" in out.stderr and "training stopped: max_steps reached" in out.stderr
    assert_same_run(reference, outcome(copy))


@pytest.mark.slow
def test_sigterm_stops_training_with_a_clear_message_and_the_run_resumes(corpus, straight, tmp_path):
    """A scheduler's SIGTERM: one line saying so and where a rerun resumes; nothing lost."""
    exp = tmp_path / "exp"
    args = ["train", "--config", TINY, "--train", corpus[0], "--valid", corpus[1], "--exp-dir", exp,
            *KILL_OVERRIDES, "data.num_workers=0"]
    job = subprocess.Popen([sys.executable, "-m", "asr.cli", *map(str, args)], stdout=subprocess.DEVNULL,
                           stderr=subprocess.PIPE, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    index = exp / "checkpoints" / "index.json"
    deadline = time.time() + 120
    while time.time() < deadline and job.poll() is None and not index.exists():
        time.sleep(0.02)
    job.send_signal(signal.SIGTERM)
    _, err = job.communicate(timeout=60)
    assert job.returncode == 1, err[-2000:]
    last = err.strip().splitlines()[-1]
    assert last.startswith("asr train: error: stopped by SIGTERM; rerun the same command to resume from "), last
    out = train(corpus, exp)
    assert out.returncode == 0, out.stderr[-3000:]
    assert_same_run(straight[1], outcome(exp))


FULL_DISK_AT = """
import errno, os, asr.checkpoint
real_save = asr.checkpoint.torch.save
def save(obj, f, *args, **kwargs):
    if obj.get("format") == "asr-checkpoint" and obj["state"]["step"] == {step}:
        f.write(b"PK" + os.urandom(5000))  # part of the file fits, then the disk is full
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    return real_save(obj, f, *args, **kwargs)
asr.checkpoint.torch.save = save
"""


@pytest.mark.slow
def test_a_full_disk_stops_training_with_a_clear_message_and_the_run_resumes(corpus, straight, tmp_path):
    exp = tmp_path / "exp"
    out = train(corpus, exp, wrapper=FULL_DISK_AT.format(step=6))
    assert out.returncode == 1
    last = out.stderr.strip().splitlines()[-1]
    ckpts = exp / "checkpoints"
    assert last == (f"asr train: error: cannot write checkpoint {ckpts / 'ckpt-00000006.pt'}: No space left on "
                    f"device; training stopped, nothing saved is lost: once fixed, rerun the same command to resume "
                    f"from {ckpts / 'ckpt-00000003.pt'}"), out.stderr[-2000:]
    assert sorted(p.name for p in ckpts.iterdir()) == ["ckpt-00000003.pt", "index.json"]
    assert load_file(ckpts / "ckpt-00000003.pt", "asr-checkpoint")["state"]["step"] == 3
    out = train(corpus, exp)
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"resumed from {ckpts / 'ckpt-00000003.pt'}" in out.stderr
    assert_same_run(straight[1], outcome(exp))


@pytest.mark.slow
def test_out_of_memory_in_one_process_splits_the_batch_or_skips_the_utterance(corpus, straight, tmp_path):
    """--oom 0:1:1: every micro-batch of 2+ utterances runs out of memory, so each is
    split in halves: the same loss and gradient (dropout off: the halves draw other masks; later
    steps drift apart by rounding only). --oom 0:5:0: from step attempt 5 even one utterance does not
    fit: each is skipped with a warning, and after max_bad_steps such steps in a row training
    stops, to resume (without the fault) exactly where it was."""
    logged = {}
    for name, faults in (("whole", []), ("split", ["--oom", "0:1:1"])):
        out = train(corpus, tmp_path / name, "model.dropout=0.0", faults=faults)
        assert out.returncode == 0, out.stderr[-3000:]
        logged[name] = [r for r in outcome(tmp_path / name)["records"] if r["kind"] == "train"]
    assert "out of memory on a batch of 2 utterances (longest" in out.stderr and "split in two halves" in out.stderr
    whole, split = logged["whole"], logged["split"]
    assert [r["step"] for r in whole] == [r["step"] for r in split] == list(range(1, 15))
    assert split[0]["loss"] == pytest.approx(whole[0]["loss"], rel=1e-6)
    assert split[0]["grad_norm"] == pytest.approx(whole[0]["grad_norm"], rel=1e-6)
    assert [r["loss"] for r in split] == pytest.approx([r["loss"] for r in whole], rel=1e-3)

    exp = tmp_path / "exp"
    out = train(corpus, exp, "training.max_bad_steps=2", faults=["--oom", "0:5:0"])
    assert out.returncode == 1
    assert "out of memory even alone; skipped" in out.stderr
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("asr train: error: 2 steps in a row skipped, the last for every utterance of the batch "
                           "ran out of memory alone: training stopped") and last.endswith("ckpt-00000003.pt")
    out = train(corpus, exp, "training.max_bad_steps=2")  # max_bad_steps changes nothing else
    assert out.returncode == 0, out.stderr[-3000:]
    assert_same_run(straight[1], outcome(exp))


@pytest.mark.slow
def test_fp16_steps_where_every_utterance_runs_out_of_memory_are_skipped(corpus, tmp_path):
    """Under fp16 (a gradient scaler) a step with no backward at all is skipped like the others:
    the scaler is neither asked to unscale nor to update (it refuses both without gradients)."""
    out = train(corpus, tmp_path / "exp", "training.precision=fp16", faults=["--oom", "0:5:0"])
    assert out.returncode == 1
    assert "out of memory even alone; skipped" in out.stderr and "Traceback" not in out.stderr
    assert out.stderr.strip().splitlines()[-1].startswith(
        "asr train: error: 20 steps in a row skipped, the last for every utterance of the batch ran out of memory")


@pytest.mark.slow
def test_fp16_overflows_of_the_gradient_scaler_are_not_bad_steps(corpus, tmp_path):
    """fp16's gradient scaler starts at a loss scale of 65,536 and the first steps' scaled gradients
    overflow: those steps lower the scale and are skipped, but are not bad steps, so
    max_bad_steps=2 does not stop the run; a non-finite loss under fp16 still is one."""
    out = train(corpus, tmp_path / "exp", "training.precision=fp16", "training.max_bad_steps=2")
    assert out.returncode == 0, out.stderr[-3000:]
    steps = [r for r in outcome(tmp_path / "exp")["records"] if r["kind"] == "train"]
    assert steps[-1]["step"] == 14 and steps[-1]["skipped_steps"] >= 2  # the overflows happened
    assert "fp16 gradients overflowed" in out.stderr and "step skipped (" not in out.stderr
    out = train(corpus, tmp_path / "nan", "training.precision=fp16", "training.max_bad_steps=2",
                faults=["--nonfinite", "0:1,0:2"])
    assert out.returncode == 1 and "2 steps in a row skipped" in out.stderr.strip().splitlines()[-1]


# run before `asr train` in its process: the dtypes of every Linear output, printed at exit
LINEAR_DTYPES = """
import atexit, sys, torch
seen = set()
def _record(module, args, output):
    if isinstance(module, torch.nn.Linear) and isinstance(output, torch.Tensor):
        seen.add(str(output.dtype))
torch.nn.modules.module.register_module_forward_hook(_record)
atexit.register(lambda: print("linear outputs:", ",".join(sorted(seen)), file=sys.stderr))
"""


@pytest.mark.slow
def test_bf16_training_step_matches_fp32(corpus, tmp_path):
    """The first optimizer step under bf16 autocast on the CPU gives fp32's loss within 1% and its
    gradient norm within 10% (bf16 rounds at 2^-8 relative; the model-level tolerances are in
    test_model), and its Linear layers really wrote bf16 (a no-op autocast fails here)."""
    first, dtypes = {}, {}
    for precision in ("fp32", "bf16"):
        exp = tmp_path / precision
        out = train(corpus, exp, f"training.precision={precision}", "training.max_steps=1", wrapper=LINEAR_DTYPES)
        assert out.returncode == 0, out.stderr[-3000:]
        first[precision] = next(r for r in outcome(exp)["records"] if r["kind"] == "train")
        dtypes[precision] = next(line for line in out.stderr.splitlines() if line.startswith("linear outputs:"))
    assert "torch.bfloat16" in dtypes["bf16"] and "torch.bfloat16" not in dtypes["fp32"]
    assert first["bf16"]["step"] == first["fp32"]["step"] == 1
    assert first["bf16"]["loss"] == pytest.approx(first["fp32"]["loss"], rel=1e-2)
    assert first["bf16"]["grad_norm"] == pytest.approx(first["fp32"]["grad_norm"], rel=0.1)


def rank_pid(launcher: subprocess.Popen, rank: int) -> int | None:
    """The pid of torchrun's worker of this rank, if it runs yet (from /proc: its RANK variable)."""
    for child in Path(f"/proc/{launcher.pid}/task").glob("*/children"):
        for pid in child.read_text().split():
            try:
                environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            except OSError:
                continue
            if f"RANK={rank}".encode() in environ:
                return int(pid)
    return None


@pytest.mark.slow
@pytest.mark.skipif(not TORCHRUN.exists(), reason="torchrun not found")
def test_ddp_failures_end_the_job_with_a_clear_message_and_the_run_resumes(corpus, tmp_path):
    """Two gloo ranks on the CPU: rank 1 runs out of memory (the job ends, saying so); resumed,
    rank 1 is SIGKILLed (the job ends, rank 0 saying why); resumed again, the run finishes."""
    exp = tmp_path / "exp"
    launcher = [str(TORCHRUN), "--nproc_per_node", "2", "--master_port", "29531"]
    out = train(corpus, exp, faults=["--oom", "1:5:0"], launcher=launcher, timeout=180)
    assert out.returncode != 0
    ckpt = exp / "checkpoints" / "ckpt-00000004.pt"  # two ranks: 4 steps an epoch, a checkpoint at its end
    assert ("asr train: error: rank 1: out of memory at step 5 on a batch of 1 utterances (longest"
            in out.stderr), out.stderr[-3000:]
    assert f"the job stops: rerun the same command to resume from {ckpt}" in out.stderr

    index = exp / "checkpoints" / "index.json"
    args = ["train", "--config", TINY, "--train", corpus[0], "--valid", corpus[1], "--exp-dir", exp,
            *KILL_OVERRIDES, "data.num_workers=0"]
    job = subprocess.Popen([str(a) for a in [*launcher, "-m", "asr.cli", *args]], stdout=subprocess.DEVNULL,
                           stderr=subprocess.PIPE, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        deadline = time.time() + 180
        while time.time() < deadline and job.poll() is None:
            if any(e["step"] >= 6 for e in json.loads(index.read_text() or "[]")):
                break
            time.sleep(0.05)
        victim = rank_pid(job, 1)
        assert job.poll() is None and victim, "the job ended before rank 1 could be killed"
        os.kill(victim, signal.SIGKILL)
        _, err = job.communicate(timeout=120)  # no hang: rank 0 learns at once
    finally:
        job.kill()
    assert job.returncode != 0
    assert ("asr train: error: rank 0: lost contact with another rank" in err
            or "asr train: error: rank 0: stopped by SIGTERM (torchrun stops every rank when one fails" in err), err
    out = train(corpus, exp, launcher=launcher, timeout=180)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "resumed from" in out.stderr and (exp / "model_last.pt").exists()


@pytest.mark.slow
def test_a_killed_decode_resumes_without_redoing_finished_work(tmp_path):
    from test_api import speechlike, write_model_file

    model = write_model_file(tmp_path / "model.pt")
    lines = []
    for i in range(24):
        sf.write(tmp_path / f"u{i}.wav", speechlike(1.0 + 0.1 * (i % 5), i), 16000)
        lines.append(json.dumps({"id": f"u{i:02d}", "audio": f"u{i}.wav", "duration": 1.0 + 0.1 * (i % 5),
                                 "text": "AB CD"}))
    manifest = tmp_path / "test.jsonl"
    manifest.write_text("\n".join(lines) + "\n")

    def decode(out_dir: Path, **kwargs):
        cmd = [sys.executable, "-m", "asr.cli", "decode", "--model", model, "--manifest", manifest, "--out-dir",
               out_dir, "--batch-size", "2", "--beam-size", "3", "--device", "cpu", "decoding.num_workers=0"]
        return subprocess.Popen([str(c) for c in cmd], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env={**os.environ, "OMP_NUM_THREADS": "1"}, **kwargs)

    fresh = decode(tmp_path / "fresh")
    assert fresh.wait(timeout=300) == 0
    job = decode(tmp_path / "dec", start_new_session=True)
    journal = tmp_path / "dec" / "decode.jsonl"
    deadline = time.time() + 300
    while time.time() < deadline and job.poll() is None:
        if journal.exists() and len(journal.read_text().splitlines()) >= 7:
            break
        time.sleep(0.02)
    assert job.poll() is None, "decoding ended before it could be killed"
    os.killpg(job.pid, signal.SIGKILL)
    job.wait()
    done = len(journal.read_text().splitlines()) - 1
    rest = decode(tmp_path / "dec")
    _, err = rest.communicate(timeout=300)
    assert rest.returncode == 0, err
    assert f"decode: resuming, {done} of 24 utterances already decoded" in err
    assert f"decode: {24 - done} utterances," in err  # only the others were decoded
    for name in ("hyp.txt", "ref.txt", "wer.json", "errors.txt"):
        assert (tmp_path / "dec" / name).read_text() == (tmp_path / "fresh" / name).read_text(), name

