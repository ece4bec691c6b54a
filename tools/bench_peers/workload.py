"""The inputs every toolkit of the peer benchmark gets alike: decoding features with forced output
lengths, a training batch, and WAV files for the loading path. All random, from fixed seeds.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import soundfile as sf
import spec
import torch


def durations(count: int, seconds: tuple[float, float], seed: int) -> list[float]:
    """`count` durations uniform in [seconds[0], seconds[1]], rounded to the 10 ms frame."""
    lo, hi = seconds
    u = np.random.default_rng(seed).uniform(lo, hi, count)
    return [round(float(s), 2) for s in u]


def decode_utterances(count: int, seconds: tuple[float, float], seed: int = 1) -> spec.Utterances:
    """Random normalized features of `count` utterances, zero-padded, with their forced lengths."""
    frames = torch.tensor([int(round(s * spec.FRAME_RATE)) for s in durations(count, seconds, seed)])
    g = torch.Generator().manual_seed(seed)
    feats = torch.randn(count, int(frames.max()), spec.N_MELS, generator=g)
    feats = feats * (torch.arange(feats.size(1))[None, :, None] < frames[:, None, None])  # zero padding
    return spec.Utterances(feats, frames, spec.forced_lengths(frames))


def train_batch(count: int, seconds: float, tokens_per_second: float, seed: int = 2) -> spec.TrainBatch:
    """`count` utterances of `seconds` of random features with round(tokens_per_second * seconds)
    random real tokens (ids 2 .. V - 2) each."""
    g = torch.Generator().manual_seed(seed)
    frames = int(round(seconds * spec.FRAME_RATE))
    length = max(1, round(tokens_per_second * seconds))
    feats = torch.randn(count, frames, spec.N_MELS, generator=g)
    tokens = torch.randint(2, spec.VOCAB - 1, (count, length), generator=g)
    return spec.TrainBatch(feats, torch.full((count,), frames), tokens, torch.full((count,), length))


def write_wavs(folder: Path, count: int, seconds: tuple[float, float], seed: int = 3) -> list[spec.AudioFile]:
    """16 kHz 16-bit WAV files of speech-like noise (noise and a tone under a 3 Hz envelope)."""
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True, exist_ok=True)
    files = []
    for k, s in enumerate(durations(count, seconds, seed)):
        n = int(round(s * spec.SAMPLE_RATE))
        t = np.arange(n) / spec.SAMPLE_RATE
        envelope = 0.5 + 0.5 * np.sin(2 * np.pi * 3.0 * t + rng.uniform(0, 6.3))
        wave = envelope * (0.1 * rng.standard_normal(n) + 0.2 * np.sin(2 * np.pi * rng.uniform(100, 300) * t))
        path = folder / f"utt{k:03d}.wav"
        sf.write(path, np.clip(wave, -1, 1).astype(np.float32), spec.SAMPLE_RATE, subtype="PCM_16")
        files.append(spec.AudioFile(str(path), n / spec.SAMPLE_RATE))
    return files
