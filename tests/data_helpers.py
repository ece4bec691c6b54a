"""Audio files, corpus lists and a small corpus of good and bad utterances, shared by the tests
of the data modules (manifest, corpora, dataset, feature archive, loader)."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import soundfile as sf

from asr.features import FeatureConfig
from asr.loader import DataConfig
from asr.manifest import Utterance

RATE = 16000
FEATURES = FeatureConfig()


def write_audio(path: Path, seconds: float, rate: int = RATE, seed: int = 0) -> Path:
    """A sine plus noise, 16-bit, in the format the suffix says (WAV / FLAC)."""
    rng = np.random.default_rng(seed)
    t = np.arange(round(seconds * rate)) / rate
    wave = 0.3 * np.sin(2 * np.pi * (200 + 50 * seed) * t) + 0.05 * rng.standard_normal(t.size)
    path.parent.mkdir(parents=True, exist_ok=True)
    sf.write(path, wave.astype(np.float32), rate, subtype="PCM_16")
    return path


def write_lines(path: Path, lines: list[str]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


def make_corpus(tmp_path: Path) -> list[Utterance]:
    """Four good utterances (WAV and FLAC) and four bad ones: missing, corrupt, wrong duration,
    too short for one frame."""
    good = [
        Utterance("g1", str(write_audio(tmp_path / "g1.wav", 1.0)), 1.0, "ONE"),
        Utterance("g2", str(write_audio(tmp_path / "g2.flac", 1.5, seed=1)), 1.5, "TWO TWO"),
        Utterance("g3", str(write_audio(tmp_path / "g3.wav", 0.7, rate=8000, seed=2)), 0.7, "Three!"),
        Utterance("g4", str(write_audio(tmp_path / "g4.flac", 2.0, seed=3)), 1.0, "FOUR", start=0.5, end=1.5),
    ]
    (tmp_path / "corrupt.wav").write_bytes(b"RIFF\x00\x00garbage" * 10)
    bad = [
        Utterance("missing", str(tmp_path / "missing.wav"), 1.0, "X"),
        Utterance("corrupt", str(tmp_path / "corrupt.wav"), 1.0, "X"),
        Utterance("wronglen", str(write_audio(tmp_path / "w.wav", 1.0)), 3.0, "X"),
        Utterance("tiny", str(write_audio(tmp_path / "t.wav", 0.01)), 0.01, "X"),
    ]
    return good + bad


def loader_config(**changes) -> DataConfig:
    return DataConfig(**({"max_batch_seconds": 3.0, "num_workers": 0} | changes))
