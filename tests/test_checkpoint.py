"""Model files: the DESIGN.md envelope, weights-only loading, atomic writes, averaging; the
checkpoints of an experiment folder: index, pruning, resume, the saved config."""
from __future__ import annotations

import pickle

import pytest
import torch

from asr.checkpoint import (
    VERSION,
    CheckpointError,
    TrainingError,
    average,
    average_state_dicts,
    check_or_save_config,
    checkpoint_dir,
    load_file,
    model_file,
    read_index,
    resume,
    resume_hint,
    save_atomic,
    save_checkpoint,
)


def example(tmp_path):
    obj = model_file(model={"d_model": 4, "dropout": 0.1}, frontend={"n_mels": 80, "count": 3.0},
                     tokenizer={"kind": "bpe", "model": b"\x00\x01"},
                     state_dict={"w": torch.ones(2, 2, requires_grad=True), "n": torch.tensor(3)})
    path = tmp_path / "model.pt"
    save_atomic(obj, path)
    return path


def test_model_file_round_trip_weights_only(tmp_path):
    path = example(tmp_path)
    raw = torch.load(path, weights_only=True)
    assert raw["format"] == "asr-model" and raw["version"] == VERSION
    obj = load_file(path)
    assert obj["tokenizer"]["model"] == b"\x00\x01"
    assert torch.equal(obj["state_dict"]["w"], torch.ones(2, 2))
    assert [p.name for p in tmp_path.iterdir()] == ["model.pt"]  # no temporary left behind


def test_refuses_other_formats_and_newer_versions(tmp_path):
    path = tmp_path / "x.pt"
    torch.save({"format": "something-else", "version": 1}, path)
    with pytest.raises(CheckpointError, match="something-else"):
        load_file(path)
    torch.save({"format": "asr-model", "version": VERSION + 1}, path)
    with pytest.raises(CheckpointError, match="newer"):
        load_file(path)
    torch.save({"format": "asr-model"}, path)
    with pytest.raises(CheckpointError, match="no valid format version"):
        load_file(path)
    path.write_bytes(b"not a torch file")
    with pytest.raises(CheckpointError, match=str(path)):
        load_file(path)
    with pytest.raises(CheckpointError, match="no such file"):
        load_file(tmp_path / "missing.pt")


def test_refuses_pickled_objects(tmp_path):
    class Evil:
        def __reduce__(self):
            return (print, ("pwned",))

    path = tmp_path / "evil.pt"
    with open(path, "wb") as f:
        torch.save({"format": "asr-model", "version": 1, "x": Evil()}, f, pickle_module=pickle)
    with pytest.raises(CheckpointError, match="refused: holds Python objects"):
        load_file(path)


def test_failed_save_keeps_old_file(tmp_path, monkeypatch):
    path = example(tmp_path)
    before = path.read_bytes()

    def boom(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", boom)
    with pytest.raises(OSError):
        save_atomic({"format": "asr-model"}, path)
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["model.pt"]


def test_refuses_to_save_what_weights_only_cannot_load(tmp_path):
    import numpy as np

    with pytest.raises(TypeError, match="float64 at 'model.lr'"):
        save_atomic({"format": "asr-model", "model": {"lr": np.float64(1.0)}}, tmp_path / "x.pt")
    assert not list(tmp_path.iterdir())


def test_average_state_dicts():
    a = {"w": torch.tensor([1.0, 2.0]), "step": torch.tensor(1)}
    b = {"w": torch.tensor([3.0, 6.0]), "step": torch.tensor(2)}
    avg = average_state_dicts([a, b])
    assert torch.allclose(avg["w"], torch.tensor([2.0, 4.0])) and avg["step"].item() == 2
    with pytest.raises(ValueError):
        average_state_dicts([a, {"v": torch.zeros(2)}])


def test_sigkill_while_writing_leaves_the_previous_file(tmp_path):
    import signal
    import subprocess
    import sys
    import time

    path = example(tmp_path)
    before = path.read_bytes()
    writer = (
        "import sys, time, torch\n"
        "from asr.fileio import atomic_open\n"
        "with atomic_open(sys.argv[1], 'wb') as f:\n"
        "    torch.save({'format': 'asr-model', 'version': 1, 'w': torch.zeros(10**6)}, f)\n"
        "    f.flush(); print('writing', flush=True); time.sleep(60)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", writer, str(path)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "writing"  # the new file is half-way through
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    time.sleep(0.1)
    assert path.read_bytes() == before
    assert torch.equal(load_file(path)["state_dict"]["w"], torch.ones(2, 2))


# ---------------------------------------------------------------------------------------------
# the checkpoints of an experiment folder


def training_objects(seed: int = 0):
    torch.manual_seed(seed)
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(4, 3)).sum().backward()
    optimizer.step()
    return model, optimizer, torch.amp.GradScaler("cpu", enabled=False)


def envelope(model: torch.nn.Module, d_model: int = 4) -> dict:
    return model_file(model={"d_model": d_model}, frontend={"n_mels": 80}, tokenizer={"kind": "char"},
                      state_dict=model.state_dict())


def save_steps(exp, model, optimizer, scaler, losses, *, keep_last: int, keep_best: int) -> None:
    for step, loss in enumerate(losses, start=1):
        save_checkpoint(exp, envelope(model), optimizer=optimizer, scaler=scaler,
                        state={"step": step, "epoch": step // 2, "history": []}, valid_loss=loss,
                        keep_last=keep_last, keep_best=keep_best)


def test_checkpoints_are_indexed_and_pruned_to_the_newest_and_the_best(tmp_path):
    model, optimizer, scaler = training_objects()
    save_steps(tmp_path, model, optimizer, scaler, [None, 3.0, None, 1.0, 2.0, None], keep_last=2, keep_best=1)
    index = read_index(checkpoint_dir(tmp_path))
    assert [(e["file"], e["step"], e["valid_loss"]) for e in index] == [
        ("ckpt-00000004.pt", 4, 1.0), ("ckpt-00000005.pt", 5, 2.0), ("ckpt-00000006.pt", 6, None)]
    assert sorted(p.name for p in checkpoint_dir(tmp_path).iterdir()) == [e["file"] for e in index] + ["index.json"]
    newest = checkpoint_dir(tmp_path) / "ckpt-00000006.pt"
    assert resume_hint(tmp_path) == f"rerun the same command to resume from {newest}"
    assert resume_hint(tmp_path / "new") == "rerun the same command to start again (no checkpoint yet)"


def test_resume_restores_weights_optimizer_position_and_random_state(tmp_path):
    model, optimizer, scaler = training_objects(seed=0)
    save_steps(tmp_path, model, optimizer, scaler, [None, 0.5], keep_last=5, keep_best=5)
    expected_draw = torch.rand(3)
    other, other_optimizer, other_scaler = training_objects(seed=1)
    assert resume(tmp_path / "none", other, other_optimizer, other_scaler) is None
    path, state, processes = resume(tmp_path, other, other_optimizer, other_scaler)
    assert path == checkpoint_dir(tmp_path) / "ckpt-00000002.pt" and state == {"step": 2, "epoch": 1, "history": []}
    assert processes == 1
    assert torch.equal(torch.rand(3), expected_draw)  # the RNG as it was when the checkpoint was written
    for a, b in zip(model.parameters(), other.parameters()):
        assert torch.equal(a, b)
    assert str(other_optimizer.state_dict()) == str(optimizer.state_dict())


def test_a_damaged_index_is_a_one_line_training_error(tmp_path):
    folder = checkpoint_dir(tmp_path)
    folder.mkdir()
    (folder / "index.json").write_text('[{"step": 1}]')
    with pytest.raises(TrainingError, match="not a checkpoint index .*remove it to start from scratch"):
        read_index(folder)


def test_average_of_the_best_or_the_last_checkpoints(tmp_path):
    model, optimizer, scaler = training_objects()
    for step, loss in enumerate([3.0, 1.0, 2.0], start=1):
        with torch.no_grad():
            model.weight.fill_(float(step))
        save_checkpoint(tmp_path, envelope(model), optimizer=optimizer, scaler=scaler,
                        state={"step": step, "epoch": step, "history": []}, valid_loss=loss, keep_last=5, keep_best=5)
    best = load_file(average(tmp_path, by="best", num=2, out=tmp_path / "best.pt"))
    assert torch.equal(best["state_dict"]["weight"], torch.full((2, 3), 2.5))  # steps 2 and 3
    assert best["format"] == "asr-model" and best["model"] == {"d_model": 4} and best["tokenizer"] == {"kind": "char"}
    last = load_file(average(tmp_path, by="last", num=1))
    assert torch.equal(last["state_dict"]["weight"], torch.full((2, 3), 3.0))
    assert (tmp_path / "model_avg.pt").is_file()
    with pytest.raises(TrainingError, match="no validated checkpoints to average"):
        average(tmp_path / "empty")


def test_a_saved_config_refuses_another(tmp_path):
    check_or_save_config(tmp_path, {"training": {"lr": 0.1}}, save=False)
    assert not (tmp_path / "config.yaml").exists()  # only rank 0 writes it
    check_or_save_config(tmp_path, {"training": {"lr": 0.1}}, save=True)
    check_or_save_config(tmp_path, {"training": {"lr": 0.1}}, save=True)  # the same: resumes
    with pytest.raises(TrainingError, match=r"trained with another config.*training\.lr"):
        check_or_save_config(tmp_path, {"training": {"lr": 0.5}}, save=False)


def test_a_saved_config_without_a_newer_key_still_resumes(tmp_path):
    """A key added to the configs since an EXP was saved takes its default there, not '<unset>'."""
    check_or_save_config(tmp_path, {"model": {"d_model": 4}}, save=True)
    now = {"model": {"d_model": 4, "frame_shift_ms": 10.0}}
    with pytest.raises(TrainingError, match=r"model\.frame_shift_ms: '<unset>' -> 10\.0"):
        check_or_save_config(tmp_path, now, save=False)

    def complete(saved):
        return {"model": {"frame_shift_ms": 10.0, **saved["model"]}}

    check_or_save_config(tmp_path, now, save=False, complete=complete)
    with pytest.raises(TrainingError, match=r"model\.d_model: 4 -> 8"):
        check_or_save_config(tmp_path, {"model": {"d_model": 8, "frame_shift_ms": 10.0}}, save=False,
                             complete=complete)
