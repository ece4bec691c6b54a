"""Model files: the DESIGN.md envelope, weights-only loading, atomic writes, averaging."""
from __future__ import annotations

import pickle

import pytest
import torch

from asr.checkpoint import VERSION, CheckpointError, average_state_dicts, load_file, model_file, save_atomic


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
