"""Acoustic augmentation on the fly: additive noise, reverberation, spectral warping, gain and
equalisation, each drawn per utterance from (seed, epoch, index), so that an utterance gets the same
draw in any batch, on any rank and after a resume (as SpecAugment's masks and the dither do).

    augmenter = Augmenter(AugmentConfig(noise=NoiseConfig(prob=0.5)), seed=0, other=wave_of, size=n)
    draw = augmenter.draw(epoch, index)            # what happens to utterance `index` this epoch
    wave = augmenter.wave(wave, draw)              # (N,) 16 kHz: reverberation, then noise
    feats = augmenter.features(feats, draw)        # (..., T, n_mels) log-mels warped and shifted, before CMVN

ASRDataset (asr.dataset) applies it in training when `data.augment` turns something on.

- noise: at an SNR drawn uniformly in `snr_db`, from the audio files below `noise.folder` when
  given (MUSAN's layout, or any tree of audio files), else generated: white, pink or brown noise,
  or babble (the sum of `babble_speakers` other utterances of the corpus, chosen by the draw);
- reverberation: an impulse response from the files below `reverb.folder` (RIRS_NOISES' layout, or
  shoebox rooms simulated by pyroomacoustics: tools/simulate_rirs.py) or simulated on the fly
  (exponentially decaying noise after a direct path, RT60 drawn in `rt60`), applied
  by FFT convolution, aligned at the direct path, at the dry signal's power;
- warp: the log-mel bins resampled so that a tone at f Hz appears at factor x f (vocal-tract
  length perturbation on the mel axis), the factor drawn in `factor` and quantised to `step`;
  it works on features computed on the fly and on dumped ones alike;
- gain: the level changed by a gain drawn in `gain.db` decibels, as the log-mels shifted by it
  (what scaling the waveform does to them, but for the dither and the energy floor): the model
  hears speech louder or softer than its corpus's, on dumped features too;
- eq: the spectral balance changed by a smooth curve along the mel axis, the sum of `eq.terms`
  cosines (1: a tilt; more: broad bumps and dips) with amplitudes drawn in +-`eq.db` decibels,
  added to the log-mels (a filter's response, as another microphone or synthesizer imposes); the
  curve's mean is zero, so the level is the gain's alone.
All are off (probability 0) unless a config turns them on.
"""
from __future__ import annotations

import functools
import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch

from asr.audio import SAMPLE_RATE, load_audio

_STREAM = 0xA06  # the augmentation's own random stream beside the dither's and SpecAugment's
_EQ_STREAM = 0xE0  # the equaliser's, drawn apart so that turning it on leaves the other draws alone
NOISE_KINDS = ("white", "pink", "brown", "babble")
_AUDIO_SUFFIXES = (".wav", ".flac", ".ogg", ".mp3", ".sph")  # files read from the noise and RIR folders


def derive_seed(*keys: int) -> int:
    """A 63-bit seed from non-negative integer keys (e.g. seed, epoch, index); well mixed, so
    neighbouring keys give unrelated streams. Every per-utterance draw of training (dither,
    SpecAugment, the augmentations here) is seeded by it."""
    state = np.random.SeedSequence(list(keys)).generate_state(2, dtype=np.uint32)
    return (int(state[0]) << 31) ^ int(state[1])


@dataclass(frozen=True)
class NoiseConfig:
    prob: float = 0.0  # chance that an utterance gets noise
    snr_db: tuple[float, float] = (5.0, 20.0)  # signal-to-noise ratio drawn uniformly in this range
    folder: str = ""  # audio files of noise (searched recursively); "" = generated kinds
    kinds: tuple[str, ...] = ("white", "pink", "brown", "babble")  # generated noise, drawn uniformly
    babble_speakers: int = 3  # other utterances summed into babble

    def __post_init__(self) -> None:
        _check_prob("noise", self.prob)
        _check_range("noise.snr_db", self.snr_db)
        bad = sorted(set(self.kinds) - set(NOISE_KINDS))
        if bad or not self.kinds:
            raise ValueError(f"augment.noise.kinds: {bad or 'empty'} (known: {', '.join(NOISE_KINDS)})")
        if self.babble_speakers < 1:
            raise ValueError(f"augment.noise.babble_speakers must be >= 1, got {self.babble_speakers}")


@dataclass(frozen=True)
class ReverbConfig:
    prob: float = 0.0  # chance that an utterance is reverberated
    folder: str = ""  # impulse responses (audio files, searched recursively); "" = simulated
    rt60: tuple[float, float] = (0.2, 0.8)  # simulated: seconds for the tail to decay by 60 dB

    def __post_init__(self) -> None:
        _check_prob("reverb", self.prob)
        _check_range("reverb.rt60", self.rt60, low=1e-3)


@dataclass(frozen=True)
class WarpConfig:
    prob: float = 0.0  # chance that an utterance's spectrum is warped
    factor: tuple[float, float] = (0.9, 1.1)  # frequency factor drawn uniformly in this range
    step: float = 0.02  # factors are multiples of this (few distinct interpolation tables)

    def __post_init__(self) -> None:
        _check_prob("warp", self.prob)
        _check_range("warp.factor", self.factor, low=0.5, high=2.0)
        if not self.step > 0:
            raise ValueError(f"augment.warp.step must be > 0, got {self.step}")


@dataclass(frozen=True)
class GainConfig:
    prob: float = 0.0  # chance that an utterance's level is changed
    db: tuple[float, float] = (-10.0, 10.0)  # gain in decibels drawn uniformly in this range

    def __post_init__(self) -> None:
        _check_prob("gain", self.prob)
        _check_range("gain.db", self.db, low=-60.0, high=60.0)


@dataclass(frozen=True)
class EqConfig:
    prob: float = 0.0  # chance that an utterance's spectral balance is changed
    db: float = 4.0  # each cosine's amplitude in decibels, drawn uniformly in [-db, db]
    terms: int = 4  # cosines along the mel axis (1: a tilt); fewer is smoother

    def __post_init__(self) -> None:
        _check_prob("eq", self.prob)
        if not 0.0 <= self.db <= 30.0 or not 1 <= self.terms <= 8:
            raise ValueError(f"augment.eq needs 0 <= db <= 30 and 1 <= terms <= 8, got db {self.db}, "
                             f"terms {self.terms}")


@dataclass(frozen=True)
class AugmentConfig:
    """The `data.augment` section (training only)."""

    noise: NoiseConfig = field(default_factory=NoiseConfig)
    reverb: ReverbConfig = field(default_factory=ReverbConfig)
    warp: WarpConfig = field(default_factory=WarpConfig)
    gain: GainConfig = field(default_factory=GainConfig)
    eq: EqConfig = field(default_factory=EqConfig)

    @property
    def on_waves(self) -> bool:
        """Noise or reverberation may apply: they need the waveform (not dumped features)."""
        return self.noise.prob > 0 or self.reverb.prob > 0

    @property
    def enabled(self) -> bool:
        return self.on_waves or self.on_features

    @property
    def on_features(self) -> bool:
        """Warp, gain or eq may apply: they act on the log-mels (dumped ones too)."""
        return self.warp.prob > 0 or self.gain.prob > 0 or self.eq.prob > 0


def _check_prob(name: str, p: float) -> None:
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"augment.{name}.prob must be in [0, 1], got {p}")


def _check_range(name: str, pair: tuple[float, float], low: float = -math.inf, high: float = math.inf) -> None:
    if len(pair) != 2 or not low <= pair[0] <= pair[1] <= high:
        raise ValueError(f"augment.{name} must be [lo, hi] with {low:g} <= lo <= hi <= {high:g}, got {list(pair)}")


class Draw(NamedTuple):
    """What happens to one utterance in one epoch; None / 1.0: that augmentation is off for it."""

    seed: int  # of the generator that makes the noise and the simulated impulse response
    noise: str | None  # "file", a generated kind, or None
    snr_db: float
    noise_pick: float  # [0, 1): which noise file, or the babble's utterances, and where to start
    rt60: float | None  # simulated reverberation's RT60; None: no reverberation
    rir_pick: float  # [0, 1): which impulse-response file (reverb.folder)
    warp: float  # frequency factor, 1.0 = none
    gain_db: float = 0.0  # level change in decibels, 0.0 = none
    eq_db: tuple[float, ...] = ()  # the equaliser's cosine amplitudes in decibels, () = none


class Augmenter:
    """Draws and applies `config` per utterance. `other(index) -> (N,) waveform or None` gives
    another utterance of the corpus for babble (None: unreadable, that speaker is left out);
    `size` is the corpus's number of utterances."""

    def __init__(self, config: AugmentConfig, seed: int, *, other: Callable[[int], torch.Tensor | None] | None = None,
                 size: int = 0) -> None:
        self.config, self.seed, self.other, self.size = config, seed, other, size
        noise = config.noise
        self._noise_files = audio_files(noise.folder) if noise.folder else ()
        self._rir_files = audio_files(config.reverb.folder) if config.reverb.folder else ()
        kinds = noise.kinds if other is not None and size > 1 else tuple(k for k in noise.kinds if k != "babble")
        self._kinds = kinds or ("white",)

    def draw(self, epoch: int, index: int) -> Draw:
        """Utterance `index`'s draw in `epoch`: a function of (seed, epoch, index) alone."""
        seed = derive_seed(self.seed, epoch, index, _STREAM)
        u = torch.rand(11, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).tolist()
        c = self.config
        noise = None
        if u[0] < c.noise.prob:
            kinds = self._kinds
            noise = "file" if self._noise_files else kinds[min(int(u[1] * len(kinds)), len(kinds) - 1)]
        rt60 = None
        if u[3] < c.reverb.prob:
            rt60 = c.reverb.rt60[0] + u[4] * (c.reverb.rt60[1] - c.reverb.rt60[0])
        warp = 1.0
        if u[6] < c.warp.prob:
            lo, hi = c.warp.factor
            warp = round((lo + u[7] * (hi - lo)) / c.warp.step) * c.warp.step
            warp = min(max(warp, lo), hi)
        gain = 0.0
        if u[9] < c.gain.prob:
            gain = c.gain.db[0] + u[10] * (c.gain.db[1] - c.gain.db[0])
        snr = c.noise.snr_db[0] + u[2] * (c.noise.snr_db[1] - c.noise.snr_db[0])
        eq: tuple[float, ...] = ()
        if c.eq.prob > 0:
            v = torch.rand(1 + c.eq.terms, generator=torch.Generator().manual_seed(derive_seed(seed, _EQ_STREAM)),
                           dtype=torch.float64).tolist()
            if v[0] < c.eq.prob:
                eq = tuple(c.eq.db * (2.0 * x - 1.0) for x in v[1:])
        return Draw(seed, noise, snr, u[5], rt60, u[8], warp, gain, eq)

    def wave(self, wave: torch.Tensor, draw: Draw) -> torch.Tensor:
        """(N,) float32 16 kHz: reverberated, then with noise added, as the draw says."""
        if draw.rt60 is None and draw.noise is None:
            return wave
        g = torch.Generator().manual_seed(draw.seed)
        if draw.rt60 is not None:
            rir = _pick_file(self._rir_files, draw.rir_pick) if self._rir_files else simulated_rir(draw.rt60, g)
            wave = reverberate(wave, rir, keep_power=True)
        if draw.noise is not None:
            wave = add_noise(wave, self._noise(draw, wave.numel(), g), draw.snr_db)
        return wave

    def features(self, feats: torch.Tensor, draw: Draw) -> torch.Tensor:
        """Log-mel features (..., T, n_mels) warped, then shifted by the gain and the equaliser as
        the draw says (`warp_mels`, `shift`)."""
        feats = warp_mels(feats, draw.warp)
        shift = self.shift(draw, feats.size(-1))
        return feats if shift is None else feats + shift.to(feats.device, feats.dtype)

    @staticmethod
    def shift(draw: Draw, n_mels: int) -> torch.Tensor | None:
        """(n_mels,) float32: what the draw's gain and equaliser add to each log-mel bin
        (`gain_offset`, `eq_curve`); None when neither applies."""
        if not draw.gain_db and not draw.eq_db:
            return None
        return (eq_curve(draw.eq_db, n_mels) + gain_offset(draw.gain_db)).float()

    def _noise(self, draw: Draw, n: int, g: torch.Generator) -> torch.Tensor:
        if draw.noise == "file":
            return _fit(_pick_file(self._noise_files, draw.noise_pick), n, draw.noise_pick)
        if draw.noise == "babble":
            picks = torch.randint(0, self.size, (self.config.noise.babble_speakers,), generator=g).tolist()
            voices = [w for w in (self.other(i) for i in picks) if w is not None and w.numel()]
            if voices:
                return sum(_fit(w, n, draw.noise_pick) for w in voices)
            return colored_noise(n, "pink", g)
        return colored_noise(n, draw.noise, g)


def audio_files(folder: str | os.PathLike) -> tuple[Path, ...]:
    """The audio files below `folder` (recursively, sorted): what noise.folder and reverb.folder
    draw from. ValueError naming the folder when it is not one or holds none."""
    root = Path(folder)
    if not root.is_dir():
        raise ValueError(f"{folder}: not a folder (data.augment)")
    files = tuple(sorted(p for p in root.rglob("*") if p.suffix.lower() in _AUDIO_SUFFIXES and p.is_file()))
    if not files:
        raise ValueError(f"{folder}: no audio files below it (data.augment)")
    return files


@functools.lru_cache(maxsize=64)
def _read(path: Path) -> torch.Tensor:
    return load_audio(path)


def _pick_file(files: tuple[Path, ...], u: float) -> torch.Tensor:
    return _read(files[min(int(u * len(files)), len(files) - 1)])


def _fit(noise: torch.Tensor, n: int, u: float) -> torch.Tensor:
    """n samples of `noise`, from a start drawn by u in [0, 1), repeated when it is too short."""
    if noise.numel() >= n:
        start = int(u * (noise.numel() - n + 1))
        return noise[start:start + n]
    return noise.repeat(n // noise.numel() + 1)[:n]


# ---------------------------------------------------------------------------------------------
# the operations


def colored_noise(n: int, kind: str, generator: torch.Generator) -> torch.Tensor:
    """(n,) float32 noise of unit power: white (flat), pink (power ~ 1/f) or brown (~ 1/f^2).
    The coloured kinds are shaped at a power-of-two length and cut to n: the FFT of an
    arbitrary length (an utterance's) can take several times longer."""
    if kind == "white" or n < 2:
        noise = torch.randn(n, generator=generator)
    else:
        size = 1 << (n - 1).bit_length()
        exponent = {"pink": 0.5, "brown": 1.0}[kind]  # of the amplitude
        spectrum = torch.fft.rfft(torch.randn(size, generator=generator))
        f = torch.arange(spectrum.numel(), dtype=torch.float32)
        spectrum = spectrum / f.clamp(min=1.0).pow(exponent)
        spectrum[0] = 0
        noise = torch.fft.irfft(spectrum, n=size)[:n]
    return noise / noise.square().mean().sqrt().clamp(min=1e-12)


def add_noise(wave: torch.Tensor, noise: torch.Tensor, snr_db: float) -> torch.Tensor:
    """wave (N,) plus noise (N,) scaled so that 10 log10(P_wave / P_noise) = snr_db (P: mean
    square); a silent wave or silent noise is returned unchanged."""
    p_wave, p_noise = wave.double().square().mean(), noise.double().square().mean()
    if not (p_wave > 0 and p_noise > 0):
        return wave
    scale = torch.sqrt(p_wave / (p_noise * 10.0 ** (snr_db / 10.0)))
    return (wave.double() + scale * noise.double()).float()


def simulated_rir(rt60: float, generator: torch.Generator, rate: int = SAMPLE_RATE) -> torch.Tensor:
    """An impulse response: a unit direct path, then from 1 ms on Gaussian noise whose amplitude
    decays by 60 dB in rt60 seconds (a diffuse tail; at most 1 s long)."""
    n = max(int(min(rt60, 1.0) * rate), 2)
    t = torch.arange(n, dtype=torch.float64) / rate
    tail = torch.randn(n, generator=generator, dtype=torch.float64) * torch.exp(-3.0 * math.log(10.0) * t / rt60)
    tail[: int(0.001 * rate) + 1] = 0.0
    rir = 0.3 * tail
    rir[0] = 1.0
    return rir.float()


def reverberate(wave: torch.Tensor, rir: torch.Tensor, *, keep_power: bool = False) -> torch.Tensor:
    """wave (N,) convolved with rir (K,) by FFT, the N samples from the direct path (rir's largest
    magnitude) on: full_convolution[d : d + N]; `keep_power`: scaled to the wave's mean square."""
    n, k = wave.numel(), rir.numel()
    if n == 0 or k == 0:
        return wave
    d = int(rir.abs().argmax())
    size = 1 << (n + k - 2).bit_length()
    full = torch.fft.irfft(torch.fft.rfft(wave.float(), size) * torch.fft.rfft(rir.float(), size), size)
    out = full[d:d + n].clone()  # not a view that holds the whole FFT buffer
    if keep_power:
        p_out = out.double().square().mean()
        if p_out > 0:
            out *= float(torch.sqrt(wave.double().square().mean() / p_out))
    return out


def gain_offset(db: float) -> float:
    """What a gain of `db` decibels adds to a log (natural) power: ln(10^(db / 10))."""
    return db * math.log(10.0) / 10.0


def eq_curve(amplitudes_db: tuple[float, ...], n_mels: int) -> torch.Tensor:
    """(n_mels,) float64: what an equaliser adds to log (natural) power in each mel bin i, the sum
    over k = 1.. of gain_offset(amplitudes_db[k-1]) x cos(pi k (i + 1/2) / n_mels): a smooth curve
    (k = 1 a tilt from the low bins to the high ones) whose mean over the bins is zero; () gives zeros."""
    amps = torch.tensor([gain_offset(a) for a in amplitudes_db], dtype=torch.float64)
    return amps @ _eq_basis(len(amplitudes_db), n_mels)


@functools.lru_cache(maxsize=16)
def _eq_basis(terms: int, n_mels: int) -> torch.Tensor:
    """(terms, n_mels) float64: cos(pi k (i + 1/2) / n_mels) for k = 1..terms (made once per shape:
    the device frontend asks for a curve per utterance per step)."""
    k = torch.arange(1, terms + 1, dtype=torch.float64)[:, None]
    return torch.cos(math.pi * k * (torch.arange(n_mels, dtype=torch.float64) + 0.5) / n_mels)


def _mel(f: torch.Tensor) -> torch.Tensor:
    return 1127.0 * torch.log1p(f / 700.0)


def _hz(m: torch.Tensor) -> torch.Tensor:
    return 700.0 * torch.expm1(m / 1127.0)


@functools.lru_cache(maxsize=64)
def _warp_table(n_mels: int, factor: float, low: float, high: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(left bin (n_mels,) long, weight of the right one (n_mels,)) for `warp_mels`."""
    edges = torch.linspace(float(_mel(torch.tensor(low))), float(_mel(torch.tensor(high))), n_mels + 2,
                           dtype=torch.float64)
    centres = _hz(edges[1:-1])  # (n_mels,) Hz, the centre of each bin (kaldi's mel banks)
    source = (_mel(centres / factor) - edges[1]) / (edges[2] - edges[1])  # fractional input bin
    source = source.clamp(0.0, n_mels - 1.0)
    left = source.floor().long().clamp(max=max(n_mels - 2, 0))
    return left, (source - left).float()


def warp_rows(feats: torch.Tensor, factors: list[float], *, low: float = 20.0,
              high: float = SAMPLE_RATE / 2) -> torch.Tensor:
    """`warp_mels` of each row of feats (B, T, n_mels) by its own factor (factors[b]; 1.0 leaves
    the row as it is), in one gather on feats' device: the tables are made on the host and copied
    without waiting (the device frontend's batch)."""
    n_mels = feats.size(-1)
    if len(factors) != feats.size(0):
        raise ValueError(f"warp_rows: {len(factors)} factors for {feats.size(0)} rows")
    if n_mels < 2 or all(f == 1.0 for f in factors):
        return feats
    identity = (torch.arange(n_mels).clamp(max=n_mels - 2), (torch.arange(n_mels) == n_mels - 1).float())
    tables = [identity if f == 1.0 else _warp_table(n_mels, float(f), float(low), float(high)) for f in factors]
    left = torch.stack([t[0] for t in tables]).to(feats.device, non_blocking=True)[:, None].expand(feats.shape)
    weight = torch.stack([t[1] for t in tables]).to(feats.device, feats.dtype, non_blocking=True)[:, None]
    return feats.gather(-1, left) * (1 - weight) + feats.gather(-1, left + 1) * weight


def warp_mels(feats: torch.Tensor, factor: float, *, low: float = 20.0, high: float = SAMPLE_RATE / 2) -> torch.Tensor:
    """Log-mel features (..., T, n_mels) (bins between `low` and `high` Hz, as asr.features makes
    them) with the frequency axis scaled by `factor`: output bin i reads the input at the
    frequency centre_i / factor (linear interpolation between bins, edge bins repeated), so what
    was at f Hz appears at factor x f. factor 1 returns feats itself."""
    n_mels = feats.size(-1)
    if factor == 1.0 or n_mels < 2:
        return feats
    left, weight = _warp_table(n_mels, float(factor), float(low), float(high))
    left, weight = left.to(feats.device), weight.to(feats.device, feats.dtype)
    return feats[..., left] * (1 - weight) + feats[..., left + 1] * weight
