"""Acoustic frontend: Kaldi-compatible log-mel filterbanks, global CMVN and SpecAugment.

    feats = fbank(wave, FeatureConfig())                 # (T,) 16 kHz float32 -> (num_frames, 80)
    stats = CMVNStats(); stats.add(feats); stats.save("cmvn.json")
    cmvn = GlobalCMVN(CMVNStats.load("cmvn.json"))       # (T, D) or (B, T, D) -> normalized
    feats = spec_augment(padded, feat_lens, SpecAugmentConfig(), generator=g)   # training only
    feats, feat_lens = batched_fbank(waves, wave_lens, FeatureConfig())   # (B, N) padded -> (B, T, 80)
    feats = spec_augment_utterances(feats, feat_lens, SpecAugmentConfig(), generators)   # one per row

Shape legend: B = batch, N = samples, T = frames (10 ms each by default), D = feature bins (n_mels).
"""
from __future__ import annotations

import functools
import json
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torchaudio.compliance import kaldi

from asr.audio import SAMPLE_RATE  # 16 kHz: the only rate the frontend takes
from asr.fileio import atomic_open

__all__ = [
    "CMVNError",
    "CMVNStats",
    "FeatureConfig",
    "GlobalCMVN",
    "SpecAugmentConfig",
    "batched_fbank",
    "fbank",
    "frame_lengths",
    "frame_sizes",
    "num_frames",
    "spec_augment",
    "spec_augment_utterances",
]

INT16_SCALE = 32768.0  # float [-1, 1) waveform -> int16 range, as Kaldi's fbank expects
_MS = 0.001  # the same milliseconds-to-seconds factor as torchaudio, so the frame sizes agree
# FeatureConfig's sane ranges (the frame shift bounds the frames per second of audio, so the cost)
_FEATURE_BOUNDS = {"n_mels": (1, 512), "frame_length_ms": (1.0, 200.0), "frame_shift_ms": (5.0, 100.0)}


# ---------------------------------------------------------------------------------- fbank


@dataclass(frozen=True)
class FeatureConfig:
    """Log-mel filterbank settings. `dither` is in int16 units and applied in training only."""

    n_mels: int = 80
    frame_length_ms: float = 25.0
    frame_shift_ms: float = 10.0
    dither: float = 1.0

    def __post_init__(self) -> None:
        if self.n_mels < 1:
            raise ValueError(f"features: n_mels must be >= 1, got {self.n_mels}")
        if self.frame_length_ms <= 0 or self.frame_shift_ms <= 0:
            raise ValueError("features: frame_length_ms and frame_shift_ms must be > 0")
        if self.dither < 0:
            raise ValueError(f"features: dither must be >= 0, got {self.dither}")
        # bounds on what a model file may ask of the frontend: a 0.0625 ms shift gave 160 times the
        # frames of a 10 ms one, and a 2.4 s clip took minutes to decode
        for name, (low, high) in _FEATURE_BOUNDS.items():
            if not low <= getattr(self, name) <= high:
                raise ValueError(f"features: {name} must be in [{low:g}, {high:g}], got {getattr(self, name)!r}")


DEFAULT_FEATURES = FeatureConfig()


def frame_sizes(config: FeatureConfig = DEFAULT_FEATURES, sample_rate: int = SAMPLE_RATE) -> tuple[int, int]:
    """(window, hop) in samples, computed exactly as torchaudio's kaldi.fbank computes them."""
    window = int(sample_rate * config.frame_length_ms * _MS)
    hop = int(sample_rate * config.frame_shift_ms * _MS)
    if window < 2 or hop < 1:
        raise ValueError(f"features: window {window} / hop {hop} samples at {sample_rate} Hz; "
                         "need at least 2 / 1")
    return window, hop


def num_frames(num_samples: int, config: FeatureConfig = DEFAULT_FEATURES,
               sample_rate: int = SAMPLE_RATE) -> int:
    """Frames `fbank` gives for `num_samples` samples (snip_edges: only whole windows).

    0 when shorter than one window, else 1 + (num_samples - window) // hop.
    """
    window, hop = frame_sizes(config, sample_rate)
    if num_samples < window:
        return 0
    return 1 + (num_samples - window) // hop


def frame_lengths(wave_lens: torch.Tensor, config: FeatureConfig = DEFAULT_FEATURES) -> torch.Tensor:
    """`num_frames` of each length: (B,) int samples -> (B,) int64 frames, on the same device."""
    window, hop = frame_sizes(config)
    lens = wave_lens.to(torch.long)
    return (lens - window).div(hop, rounding_mode="floor").add_(1).clamp_(min=0)


def fbank(
    wave: torch.Tensor,
    config: FeatureConfig,
    *,
    training: bool = False,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Log-mel filterbank of a 16 kHz mono waveform: (N,) float -> (num_frames(N), n_mels) float32.

    The waveform is scaled to int16 range first (Kaldi convention). Gaussian dither of
    `config.dither` int16 units is added only when `training`, drawn from `generator` (the global
    RNG when None; added to the waveform, not per frame as Kaldi does), so training features are
    reproducible from the generator's seed; evaluation features are deterministic. Input shorter
    than one window gives an empty (0, n_mels) tensor.
    Kaldi defaults otherwise: povey window, pre-emphasis 0.97, DC removal, 20 Hz low cut, power
    spectrum, log floored at float32 eps (`energy_floor` only matters with use_energy, unused).
    Computed as torchaudio's kaldi.fbank computes it (tested equal to 1e-4), about twice as fast:
    the window and mel matrix are built once per configuration.
    """
    if wave.dim() != 1:
        raise ValueError(f"fbank: expected a 1-D waveform, got shape {tuple(wave.shape)}")
    window, hop = frame_sizes(config)
    if wave.numel() < window:
        return torch.empty(0, config.n_mels, dtype=torch.float32, device=wave.device)
    x = wave.to(torch.float32) * INT16_SCALE  # (N,) int16 units
    if training and config.dither > 0:
        x = x + config.dither * _randn(tuple(x.shape), generator, x.device)
    return _log_mel(x.unfold(0, window, hop), config)


def batched_fbank(
    waves: torch.Tensor,
    wave_lens: torch.Tensor,
    config: FeatureConfig,
    *,
    training: bool = False,
    generators: Sequence[torch.Generator] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`fbank` of a zero-padded batch on its own device: waves (B, N) float, wave_lens (B,) int ->
    (feats (B, T, n_mels) float32, feat_lens (B,) int64), T = num_frames(N), both on the waves' device.

    Row b's first feat_lens[b] frames are fbank(waves[b, :wave_lens[b]], config) to float rounding
    (the batched FFT and matmul may round differently): every step of fbank (DC removal,
    pre-emphasis, window, log floor) works within one frame and a frame inside the length reads
    no padding. Frames past feat_lens[b] are zero. Dither (when `training`) is drawn for each row as
    fbank draws it, from generators[b] (on the waves' device or the CPU; the global RNG when
    None): the same noise as fbank with a generator of the same seed on the same device.
    wave_lens are read on the host (keep them on the CPU: no synchronization then).
    """
    if waves.dim() != 2 or wave_lens.shape != (waves.shape[0],):
        raise ValueError(f"batched_fbank: expected waves (B, N) and wave_lens (B,), got {tuple(waves.shape)} "
                         f"and {tuple(wave_lens.shape)}")
    B, N = waves.shape
    lens = wave_lens.tolist()
    if B and not 0 <= min(lens) <= max(lens) <= N:
        raise ValueError(f"batched_fbank: wave_lens must lie in [0, {N}], got {lens}")
    if generators is not None and len(generators) != B:
        raise ValueError(f"batched_fbank: {len(generators)} generators for {B} waveforms")
    window, hop = frame_sizes(config)
    feat_lens = frame_lengths(wave_lens.to(waves.device, non_blocking=True), config)  # (B,)
    if N < window or B == 0:
        return torch.zeros(B, num_frames(N, config), config.n_mels, device=waves.device), feat_lens
    x = waves.to(torch.float32) * INT16_SCALE  # (B, N) int16 units, a new tensor
    if training and config.dither > 0:
        for b, n in enumerate(lens):
            if n >= window:  # fbank draws nothing for a waveform without a frame
                g = None if generators is None else generators[b]
                x[b, :n] += config.dither * _randn((n,), g, x.device)
    frames = x.unfold(1, window, hop)  # (B, T, window) view
    T = frames.shape[1]
    rows = max(1, _CPU_FRAMES_PER_CALL // T) if x.device.type == "cpu" else B  # rows per _log_mel call
    feats = torch.cat([_log_mel(frames[b : b + rows], config) for b in range(0, B, rows)])  # (B, T, n_mels)
    padded = torch.arange(T, device=x.device) >= feat_lens[:, None]  # (B, T)
    return feats.masked_fill_(padded[:, :, None], 0.0), feat_lens


# On a CPU, a whole batch's frames overflow the caches and every stage of _log_mel runs at memory
# speed (batched_fbank measured at half fbank's speed per frame): rows go through it in groups of
# about this many frames. Other devices take the whole batch in one call.
_CPU_FRAMES_PER_CALL = 2048


def _log_mel(frames: torch.Tensor, config: FeatureConfig) -> torch.Tensor:
    """kaldi.fbank(x[None], num_mel_bins, frame_length, frame_shift, dither=0, snip_edges=True) with
    its constants (window, mel matrix) cached and no wasted work (it also computes each frame's
    log energy, and |X| before squaring it), over the frames of one or several waveforms:
    (..., T, window) int16-scale float32 frames -> (..., T, n_mels)."""
    window = frames.shape[-1]
    povey, mel_t = _fbank_constants(window, config.n_mels, frames.device)  # (window,), (F, n_mels)
    frames = frames - frames.mean(dim=-1, keepdim=True)  # DC removal, per frame
    padded = frames.new_zeros(*frames.shape[:-1], _fft_size(window))  # (..., T, n_fft)
    # pre-emphasis y[j] = x[j] - 0.97 x[j - 1] (x[-1] := x[0]), then the window, into the FFT buffer;
    # multiply, then subtract, as kaldi.fbank does (a fused multiply-subtract rounds differently,
    # which the lowest bins, near 20 Hz where DC removal and pre-emphasis cancel, magnify)
    torch.sub(frames[..., 1:], frames[..., :-1] * _PREEMPHASIS, out=padded[..., 1:window])
    padded[..., 0] = frames[..., 0] - frames[..., 0] * _PREEMPHASIS
    padded[..., :window] *= povey
    spectrum = torch.fft.rfft(padded)  # (..., T, F) complex, F = n_fft // 2 + 1
    power = spectrum.real.square().add_(spectrum.imag.square())  # (..., T, F), |X|^2 without the sqrt
    return torch.matmul(power, mel_t).clamp_(min=_EPSILON).log_()  # (..., T, n_mels)


_PREEMPHASIS = 0.97  # Kaldi's default
_EPSILON = torch.finfo(torch.float32).eps  # kaldi.fbank's floor before the log


def _fft_size(window: int) -> int:
    """Kaldi's round_to_power_of_two: the smallest power of two >= window."""
    return 1 << (window - 1).bit_length()


@functools.lru_cache(maxsize=16)
def _fbank_constants(window: int, n_mels: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(povey window (window,), transposed mel matrix (n_fft // 2 + 1, n_mels)) as kaldi.fbank
    builds them (low 20 Hz, high Nyquist; the Nyquist bin gets weight 0), float32."""
    povey = torch.hann_window(window, periodic=False, dtype=torch.float32).pow(0.85)
    banks, _ = kaldi.get_mel_banks(n_mels, _fft_size(window), float(SAMPLE_RATE), 20.0, 0.0, 100.0, -500.0, 1.0)
    mel = torch.nn.functional.pad(banks.to(torch.float32), (0, 1))  # (n_mels, F)
    return povey.to(device), mel.t().contiguous().to(device)


def _rand_device(generator: torch.Generator | None, device: torch.device) -> torch.device:
    """Draw on the generator's device (a CPU generator cannot fill a CUDA tensor)."""
    return generator.device if generator is not None else device


def _randn(shape: tuple[int, ...], generator: torch.Generator | None, device: torch.device) -> torch.Tensor:
    """Standard normal float32."""
    return torch.randn(shape, generator=generator, device=_rand_device(generator, device)).to(device)


def _rand(shape: tuple[int, ...], generator: torch.Generator | None, device: torch.device) -> torch.Tensor:
    """Uniform [0, 1) float64 (float64 so that floor(u * (n + 1)) <= n holds for any realistic n)."""
    u = torch.rand(shape, generator=generator, device=_rand_device(generator, device), dtype=torch.float64)
    return u.to(device)


# ----------------------------------------------------------------------------------- CMVN


class CMVNError(ValueError):
    """A CMVN statistics file that cannot be read: str(e) == "<path>: <reason>"."""


class CMVNStats:
    """Global mean / variance statistics accumulated in float64 over frames.

    `count` (frames, float), `sum` (D,) and `sum_sq` (D,) float64 tensors; D is fixed by the
    constructor or by the first `add`. `std` floors the variance at `var_floor`.
    """

    def __init__(self, dim: int | None = None, *, var_floor: float = 1e-5) -> None:
        self.count = 0.0
        self.sum: torch.Tensor | None = None  # (D,) float64
        self.sum_sq: torch.Tensor | None = None  # (D,) float64
        self.var_floor = var_floor
        if dim is not None:
            self._init(dim)

    def _init(self, dim: int) -> None:
        self.sum = torch.zeros(dim, dtype=torch.float64)
        self.sum_sq = torch.zeros(dim, dtype=torch.float64)

    @property
    def dim(self) -> int | None:
        return None if self.sum is None else self.sum.numel()

    def _check_dim(self, dim: int) -> None:
        if self.sum is None:
            self._init(dim)
        elif dim != self.dim:
            raise ValueError(f"CMVN: features of dimension {dim} added to statistics of dimension "
                             f"{self.dim}")

    def add(self, feats: torch.Tensor) -> None:
        """Accumulate the frames of one utterance, feats (T, D); T may be 0."""
        if feats.dim() != 2:
            raise ValueError(f"CMVN: expected (T, D) features, got shape {tuple(feats.shape)}")
        self._check_dim(feats.shape[1])
        x = feats.detach().to("cpu", torch.float64)  # (T, D)
        if not torch.isfinite(x).all():
            raise ValueError("CMVN: features contain NaN or inf")
        self.count += float(x.shape[0])
        self.sum += x.sum(0)
        self.sum_sq += (x * x).sum(0)

    def merge(self, other: CMVNStats) -> CMVNStats:
        """Add `other`'s statistics into these (in place, like `add`); returns self."""
        if other.sum is None:
            return self
        self._check_dim(other.dim)
        self.count += other.count
        self.sum += other.sum
        self.sum_sq += other.sum_sq
        return self

    def _require_frames(self) -> None:
        if self.count <= 0:
            raise ValueError("CMVN: no frames accumulated")

    @property
    def mean(self) -> torch.Tensor:
        """(D,) float64."""
        self._require_frames()
        return self.sum / self.count

    @property
    def std(self) -> torch.Tensor:
        """(D,) float64, sqrt(max(E[x^2] - mean^2, var_floor))."""
        mean = self.mean
        var = self.sum_sq / self.count - mean * mean
        return var.clamp(min=self.var_floor).sqrt()

    def to_dict(self) -> dict:
        """{"count": float, "sum": [float] * D, "sum_sq": [float] * D}: plain Python, JSON-safe."""
        self._require_frames()
        return {"count": float(self.count), "sum": self.sum.tolist(), "sum_sq": self.sum_sq.tolist()}

    @classmethod
    def from_dict(cls, d: dict) -> CMVNStats:
        """Inverse of `to_dict`; TypeError / ValueError (one line) on a missing key or a bad value."""
        if not isinstance(d, dict):
            raise TypeError(f"CMVN statistics must be a dict, got {type(d).__name__}")
        for key in ("count", "sum", "sum_sq"):
            if key not in d:
                raise ValueError(f"CMVN statistics: missing key '{key}'")
        count = _finite_float(d["count"], "count")
        total, total_sq = _float_list(d["sum"], "sum"), _float_list(d["sum_sq"], "sum_sq")
        if count <= 0:
            raise ValueError(f"CMVN statistics: count must be > 0, got {count}")
        if not total or len(total) != len(total_sq):
            raise ValueError(f"CMVN statistics: 'sum' ({len(total)}) and 'sum_sq' ({len(total_sq)}) "
                             "must be non-empty lists of one length")
        stats = cls()
        stats.count = count
        stats.sum = torch.tensor(total, dtype=torch.float64)
        stats.sum_sq = torch.tensor(total_sq, dtype=torch.float64)
        return stats

    def save(self, path: str | os.PathLike) -> None:
        """Write JSON atomically (temporary file in the same folder, then rename)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        text = json.dumps(self.to_dict()) + "\n"
        with atomic_open(path) as f:
            f.write(text)

    @classmethod
    def load(cls, path: str | os.PathLike) -> CMVNStats:
        """Read a file written by `save`; CMVNError "<path>: <reason>" when missing or malformed."""
        try:
            text = Path(path).read_text(encoding="utf-8")
        except OSError as e:
            raise CMVNError(f"{path}: cannot read CMVN statistics ({e.strerror or e})") from None
        try:
            return cls.from_dict(json.loads(text))
        except json.JSONDecodeError as e:
            raise CMVNError(f"{path}: not a JSON CMVN file (line {e.lineno}: {e.msg})") from None
        except (TypeError, ValueError) as e:
            raise CMVNError(f"{path}: {e}") from None


def _finite_float(value: object, key: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"CMVN statistics: '{key}' must hold finite numbers, got {value!r}")
    return float(value)


def _float_list(value: object, key: str) -> list[float]:
    if not isinstance(value, list):
        raise TypeError(f"CMVN statistics: '{key}' must be a list, got {type(value).__name__}")
    return [_finite_float(v, key) for v in value]


class GlobalCMVN(torch.nn.Module):
    """(feats - mean) / std with the statistics' float64 mean / std stored as float32 buffers.

    Works on (T, D) and (B, T, D); padded frames are transformed too, so apply it before padding
    (or re-mask after).
    """

    def __init__(self, stats: CMVNStats) -> None:
        super().__init__()
        self.register_buffer("mean", stats.mean.to(torch.float32))  # (D,)
        self.register_buffer("inv_std", (1.0 / stats.std).to(torch.float32))  # (D,)

    def forward(self, feats: torch.Tensor) -> torch.Tensor:
        return (feats - self.mean) * self.inv_std


# ---------------------------------------------------------------------------- SpecAugment


@dataclass(frozen=True)
class SpecAugmentConfig:
    """SpecAugment on CMVN-normalized features (masks set to 0 = the mean). 0 masks = off.

    Frequency masks: width uniform in [0, freq_width] bins. Time masks: width uniform in
    [0, min(max_time_width, time_width_ratio * length)] frames, scaled to each utterance.
    Time warp: the frame at a random point moves by up to `time_warp` frames (0 = off).
    """

    freq_masks: int = 2
    freq_width: int = 27
    time_masks: int = 10
    time_width_ratio: float = 0.05
    max_time_width: int = 40
    time_warp: int = 0

    def __post_init__(self) -> None:
        for name in ("freq_masks", "freq_width", "time_masks", "max_time_width", "time_warp"):
            if getattr(self, name) < 0:
                raise ValueError(f"specaug: {name} must be >= 0, got {getattr(self, name)}")
        if not 0.0 <= self.time_width_ratio <= 1.0:
            raise ValueError(f"specaug: time_width_ratio must be in [0, 1], got {self.time_width_ratio}")


def spec_augment(
    feats: torch.Tensor,
    feat_lens: torch.Tensor,
    config: SpecAugmentConfig,
    *,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Augmented copy of a padded batch: feats (B, T, D), feat_lens (B,) -> (B, T, D).

    Only frames t < feat_lens[b] change; padded frames keep their values exactly. Deterministic
    given `generator`'s state (the global RNG when None). Vectorized over batch and masks.
    """
    lens = _check_augment_input(feats, feat_lens)
    return _augment(feats, lens, config, _draws(feats.shape[0], config, generator, feats.device))


def spec_augment_utterances(
    feats: torch.Tensor,
    feat_lens: torch.Tensor,
    config: SpecAugmentConfig,
    generators: Sequence[torch.Generator],
) -> torch.Tensor:
    """`spec_augment` with row b's random numbers drawn from generators[b] alone (any device:
    CPU generators give the same masks on every device), so an utterance gets the same masks
    whatever batch it is in, its row and its padding. feats (B, T, D), feat_lens (B,) -> (B, T, D);
    with CPU generators and feat_lens on the CPU, no device synchronization.
    """
    lens = _check_augment_input(feats, feat_lens)
    if len(generators) != feats.shape[0]:
        raise ValueError(f"spec_augment: {len(generators)} generators for {feats.shape[0]} utterances")
    rows = [_draws(1, config, g, g.device) for g in generators]  # B x (1, K)
    u = torch.cat(rows) if rows else torch.zeros(0, sum(_draw_sizes(config)), dtype=torch.float64)  # (B, K)
    return _augment(feats, lens, config, u.to(feats.device, non_blocking=True))


def _check_augment_input(feats: torch.Tensor, feat_lens: torch.Tensor) -> torch.Tensor:
    """feat_lens as (B,) long on the features' device, after checking the shapes and range (where
    feat_lens are: on the host, no device synchronization)."""
    if feats.dim() != 3 or feat_lens.shape != (feats.shape[0],):
        raise ValueError(f"spec_augment: expected feats (B, T, D) and feat_lens (B,), "
                         f"got {tuple(feats.shape)} and {tuple(feat_lens.shape)}")
    B, T, _ = feats.shape
    if B and (feat_lens.min() < 0 or feat_lens.max() > T):
        raise ValueError(f"spec_augment: feat_lens must lie in [0, {T}], got {feat_lens.tolist()}")
    return feat_lens.to(feats.device, torch.long, non_blocking=True)  # (B,)


def _draws(B: int, config: SpecAugmentConfig, generator: torch.Generator | None,
           device: torch.device) -> torch.Tensor:
    """(B, K) uniform [0, 1) float64 on `device`, drawn block after block: the time warp's (B, 2),
    the frequency masks' (B, 2 Mf), the time masks' (B, 2 Mt) (`_draw_sizes`; none for what is off)."""
    blocks = [_rand((B, k), generator, device) for k in _draw_sizes(config) if k]
    return torch.cat(blocks, dim=1) if blocks else torch.zeros(B, 0, dtype=torch.float64, device=device)


def _draw_sizes(config: SpecAugmentConfig) -> tuple[int, int, int]:
    """Uniforms per utterance for (time warp, frequency masks, time masks): 2 per warp or mask."""
    return 2 if config.time_warp else 0, 2 * config.freq_masks, 2 * config.time_masks


def _augment(feats: torch.Tensor, lens: torch.Tensor, config: SpecAugmentConfig, u: torch.Tensor) -> torch.Tensor:
    """SpecAugment of feats (B, T, D) within lens (B,) from the uniforms u (B, K) of `_draws`."""
    B, T, D = feats.shape
    valid = torch.arange(T, device=feats.device) < lens[:, None]  # (B, T)
    warp, freq, time = u.split(_draw_sizes(config), dim=1)  # (B, 2 or 0), (B, 2 Mf), (B, 2 Mt)
    out = _time_warp(feats, lens, valid, config.time_warp, warp) if config.time_warp else feats
    masked = valid[:, :, None] & (  # (B, T, D)
        _freq_mask(B, D, config, freq.reshape(B, config.freq_masks, 2), feats.device)[:, None, :]
        | _time_mask(lens, T, config, time.reshape(B, config.time_masks, 2))[:, :, None]
    )
    return out.masked_fill(masked, 0.0)  # a new tensor, even when nothing is masked


def _band_mask(size: int, max_width: torch.Tensor, limit: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """M bands per row over `size` positions: (R, size) bool, True = masked.

    Row r's band m has width floor(u[r, m, 0] * (max_width[r] + 1)) ~ U{0..max_width[r]} and start
    ~ U{0..limit[r] - width} (from u[r, m, 1]), so it lies inside [0, limit[r]).
    max_width, limit: (R,) long with max_width <= limit; u: (R, M, 2) uniform [0, 1).
    """
    device = max_width.device
    width = (u[..., 0] * (max_width[:, None] + 1)).long()  # (R, M)
    start = (u[..., 1] * (limit[:, None] - width + 1)).long()  # (R, M)
    pos = torch.arange(size, device=device)[None, None, :]  # (1, 1, size)
    inside = (pos >= start[..., None]) & (pos < (start + width)[..., None])  # (R, M, size)
    return inside.any(dim=1)


def _freq_mask(B: int, D: int, config: SpecAugmentConfig, u: torch.Tensor, device: torch.device) -> torch.Tensor:
    """(B, D) bool: the frequency bins masked in each utterance; u (B, freq_masks, 2)."""
    if not config.freq_masks:
        return torch.zeros(B, D, dtype=torch.bool, device=device)
    limit = torch.full((B,), D, dtype=torch.long, device=device)
    return _band_mask(D, limit.clamp(max=config.freq_width), limit, u)


def _time_mask(lens: torch.Tensor, T: int, config: SpecAugmentConfig, u: torch.Tensor) -> torch.Tensor:
    """(B, T) bool: the frames masked in each utterance, all below its length; u (B, time_masks, 2)."""
    if not config.time_masks:
        return torch.zeros(lens.shape[0], T, dtype=torch.bool, device=lens.device)
    max_width = (lens * config.time_width_ratio).long().clamp(max=config.max_time_width)  # (B,)
    return _band_mask(T, max_width, lens, u)


def _time_warp(
    feats: torch.Tensor, lens: torch.Tensor, valid: torch.Tensor, warp: int, u: torch.Tensor
) -> torch.Tensor:
    """Piecewise-linear time warp of each utterance's valid frames (linear interpolation); u (B, 2).

    A centre c uniform in [warp, L - 1 - warp] moves to c' = c + U(-warp, warp); output frame t
    reads source position t * c / c' before c' and c + (t - c') (L-1-c) / (L-1-c') after, so the
    first and last valid frames stay put. Utterances with L < 2 * warp + 2 are left as they are.
    """
    B, T, D = feats.shape
    warped = lens >= 2 * warp + 2  # (B,) which utterances are long enough
    hi = (lens - 1).clamp(min=0)  # (B,) index of the last valid frame
    last = torch.where(warped, hi, 2 * warp + 1).to(torch.float64)  # (B,) a safe dummy where not warped
    centre = warp + u[:, 0] * (last - 2 * warp)  # (B,) in [warp, last - warp]
    moved = (centre + (2 * u[:, 1] - 1) * warp).clamp(min=1.0)  # (B,) c' = c + U(-warp, warp)
    moved = torch.minimum(moved, last - 1)  # in [1, last - 1]: both pieces have positive length
    t = torch.arange(T, device=feats.device, dtype=torch.float64)[None, :]  # (1, T)
    left = t * (centre / moved)[:, None]  # (B, T)
    right = centre[:, None] + (t - moved[:, None]) * ((last - centre) / (last - moved))[:, None]
    src = torch.where(t <= moved[:, None], left, right)  # (B, T) source positions
    src = torch.minimum(src.clamp(min=0.0), hi[:, None].to(torch.float64))
    i0 = src.floor().long()  # (B, T)
    i1 = torch.minimum(i0 + 1, hi[:, None])
    frac = (src - i0).to(feats.dtype)[:, :, None]  # (B, T, 1)
    rows = feats.reshape(B * T, D)  # whole-row selection is much faster than gather over D
    offset = torch.arange(B, device=feats.device)[:, None] * T  # (B, 1)
    x0 = rows.index_select(0, (i0 + offset).reshape(-1)).view(B, T, D)
    x1 = rows.index_select(0, (i1 + offset).reshape(-1)).view(B, T, D)
    keep = (valid & warped[:, None])[:, :, None]  # (B, T, 1)
    return torch.where(keep, torch.lerp(x0, x1, frac), feats)
