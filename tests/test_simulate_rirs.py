"""tools/simulate_rirs.py: banks of impulse responses made again identically, rooms that decay
as drawn, a bank that training reads as its reverb folder, and a reverberant dev set made as
training reverberates."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
import torch

from asr.audio import load_audio
from asr.augment import AugmentConfig, Augmenter, ReverbConfig, derive_seed, reverberate, simulated_rir

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))  # the tools are scripts beside each other, not a package

import simulate_rirs  # noqa: E402


def _main(monkeypatch, *args: str) -> None:
    monkeypatch.setattr(sys, "argv", ["simulate_rirs.py", *args])
    simulate_rirs.main()


def _bank(monkeypatch, out: Path, simulator: str, count: int, seed: int, jobs: int = 1) -> Path:
    _main(monkeypatch, "bank", "--out", str(out), "--count", str(count), "--seed", str(seed),
          "--simulator", simulator, "--jobs", str(jobs))
    return out


def test_exponential_rooms_are_what_training_simulates():
    rir, drawn = simulate_rirs.one_room("exponential", 3, 7, (0.2, 0.8))
    rng = np.random.default_rng(derive_seed(3, 7))
    rt60 = float(rng.uniform(0.2, 0.8))
    expected = simulated_rir(rt60, torch.Generator().manual_seed(derive_seed(3, 7))).numpy()
    np.testing.assert_array_equal(rir, expected)
    assert drawn == {"rt60": round(rt60, 3)}


def test_shoebox_rooms_decay_longer_for_a_longer_rt60_and_are_reproducible():
    pytest.importorskip("pyroomacoustics")
    short, drawn_short = simulate_rirs.shoebox_rir(0.2, np.random.default_rng(11))
    long, drawn_long = simulate_rirs.shoebox_rir(0.7, np.random.default_rng(11))
    assert drawn_short["dims"] == drawn_long["dims"] and drawn_short["mic"] == drawn_long["mic"]
    assert drawn_short["rt60_measured"] < drawn_long["rt60_measured"]
    assert long.size > short.size
    with pytest.raises(ValueError, match="RT60 of 0.01 s"):  # too short for any room of the draw
        simulate_rirs.shoebox_rir(0.01, np.random.default_rng(11))
    again, _ = simulate_rirs.shoebox_rir(0.7, np.random.default_rng(11))
    np.testing.assert_array_equal(long, again)
    # the direct path arrives after distance / speed of sound, plus half pyroomacoustics' fractional-delay filter
    import pyroomacoustics as pra
    delay = drawn_long["distance"] / pra.constants.get("c") * 16000 + pra.constants.get("frac_delay_length") // 2
    assert abs(int(np.abs(long).argmax()) - delay) <= 2


def test_bank_is_the_same_in_any_number_of_processes_and_feeds_training(tmp_path, monkeypatch):
    bank = _bank(monkeypatch, tmp_path / "one", "exponential", 5, 4)
    other = _bank(monkeypatch, tmp_path / "two", "exponential", 5, 4, jobs=2)
    rooms = [json.loads(line) for line in (bank / "rooms.jsonl").read_text().splitlines()]
    assert [r["file"] for r in rooms] == [f"room_{i:05d}.wav" for i in range(5)]
    assert (other / "rooms.jsonl").read_text() == (bank / "rooms.jsonl").read_text()
    for i, room in enumerate(rooms):
        stored, rate = sf.read(bank / room["file"], dtype="float32")
        assert rate == 16000
        np.testing.assert_array_equal(stored, simulate_rirs.one_room("exponential", 4, i, (0.2, 0.8))[0])
        np.testing.assert_array_equal(sf.read(other / room["file"], dtype="float32")[0], stored)
    augmenter = Augmenter(AugmentConfig(reverb=ReverbConfig(prob=1.0, folder=str(bank))), seed=0)
    wave = torch.randn(8000, generator=torch.Generator().manual_seed(0))
    wet = augmenter.wave(wave, augmenter.draw(0, 3))
    assert wet.shape == wave.shape and not torch.allclose(wet, wave)


def test_reverberated_dev_set_is_made_as_training_reverberates(tmp_path, monkeypatch, capsys):
    bank = _bank(monkeypatch, tmp_path / "bank", "exponential", 3, 1)
    g = torch.Generator().manual_seed(2)
    lines = []
    for i, seconds in enumerate((0.5, 0.8)):
        path = tmp_path / f"u{i}.wav"
        sf.write(path, (0.1 * torch.randn(int(16000 * seconds), generator=g)).numpy(), 16000, subtype="PCM_16")
        lines.append(json.dumps({"id": f"u{i}", "audio": str(path), "duration": seconds, "text": f"WORD {i}"}))
    (tmp_path / "broken.wav").write_bytes(b"RIFF\x00\x00")
    lines.append(json.dumps({"id": "broken", "audio": str(tmp_path / "broken.wav"), "duration": 1.0, "text": "X"}))
    manifest = tmp_path / "dev.jsonl"
    manifest.write_text("\n".join(lines) + "\n")
    out = tmp_path / "dev_rev.jsonl"
    _main(monkeypatch, "reverberate", "--manifest", str(manifest), "--rirs", str(bank), "--out", str(out),
          "--seed", "9")
    assert "simulate_rirs: broken skipped: " in capsys.readouterr().err  # one line naming it; the rest made
    made = [json.loads(line) for line in out.read_text().splitlines()]
    assert [m["id"] for m in made] == ["u0", "u1"] and [m["text"] for m in made] == ["WORD 0", "WORD 1"]
    for index, (m, seconds) in enumerate(zip(made, (0.5, 0.8))):
        assert m["duration"] == pytest.approx(seconds)
        assert Path(m["rir"]).name == f"room_{derive_seed(9, index) % 3:05d}.wav"
        rir = torch.from_numpy(sf.read(m["rir"], dtype="float32")[0])
        expected = reverberate(load_audio(tmp_path / f"u{index}.wav"), rir, keep_power=True)
        np.testing.assert_allclose(load_audio(m["audio"]).numpy(), expected.numpy(), atol=2e-4)
