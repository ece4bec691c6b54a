"""Features: fbank frame counts and dither, CMVN statistics and files, SpecAugment on padded batches."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from torchaudio.compliance import kaldi

from asr.features import (
    CMVNError,
    CMVNStats,
    FeatureConfig,
    GlobalCMVN,
    SpecAugmentConfig,
    fbank,
    frame_sizes,
    num_frames,
    spec_augment,
)

CONFIGS = [FeatureConfig(), FeatureConfig(n_mels=40, frame_length_ms=20.0, frame_shift_ms=12.5)]
LENGTHS = [0, 1, 2, 319, 320, 399, 400, 401, 519, 520, 521, 559, 560, 561, 16000, 16001, 16159, 16160, 23457]


def _wave(n: int, seed: int = 0) -> torch.Tensor:
    """(n,) float32 noise at about -20 dBFS."""
    return 0.1 * torch.randn(n, generator=torch.Generator().manual_seed(seed))


# ---------------------------------------------------------------------------------- fbank


def test_frame_sizes_default():
    assert frame_sizes(FeatureConfig()) == (400, 160)
    assert num_frames(16000) == 98  # 1 + (16000 - 400) // 160


@pytest.mark.parametrize("config", CONFIGS, ids=["25ms-10ms", "20ms-12.5ms"])
@pytest.mark.parametrize("n", LENGTHS)
def test_num_frames_equals_fbank_frames(config, n):
    window, hop = frame_sizes(config)
    feats = fbank(_wave(n), config)
    assert feats.shape == (num_frames(n, config), config.n_mels)
    assert feats.dtype == torch.float32
    assert num_frames(n, config) == (0 if n < window else 1 + (n - window) // hop)


@pytest.mark.parametrize("n", [0, 1, 200, 399])
def test_short_input_gives_empty(n):
    feats = fbank(_wave(n), FeatureConfig(), training=True, generator=torch.Generator().manual_seed(0))
    assert feats.shape == (0, 80) and feats.dtype == torch.float32


def test_fbank_is_kaldi_fbank_in_int16_units():
    wave = _wave(8000)
    expected = kaldi.fbank(wave[None] * 32768, num_mel_bins=80, dither=0.0, energy_floor=0.0)
    torch.testing.assert_close(fbank(wave, FeatureConfig()), expected)


def _speech_like(n: int, seed: int) -> torch.Tensor:
    """(n,) float32: a low tone (where DC removal and pre-emphasis nearly cancel) plus noise."""
    g = torch.Generator().manual_seed(seed)
    t = torch.arange(n, dtype=torch.float64) / 16000
    return (0.3 * torch.sin(2 * torch.pi * 90 * t) + 0.01 * torch.randn(n, generator=g, dtype=torch.float64)).float()


@pytest.mark.parametrize("config", CONFIGS + [FeatureConfig(n_mels=23)], ids=["80", "40-20ms-12.5ms", "23"])
@pytest.mark.parametrize("n", [400, 401, 561, 16000, 23457, 160000])
def test_fbank_matches_kaldi_fbank_to_1e4(config, n):
    """Our fbank (cached window and mel matrix) against torchaudio's kaldi.fbank itself."""
    for wave in (_wave(n, seed=n), _speech_like(n, seed=n), torch.full((n,), 1e-4)):
        expected = kaldi.fbank(
            wave[None] * 32768, num_mel_bins=config.n_mels, frame_length=config.frame_length_ms,
            frame_shift=config.frame_shift_ms, dither=0.0, snip_edges=True,
        )
        torch.testing.assert_close(fbank(wave, config), expected, atol=1e-4, rtol=0)


def test_fbank_accepts_other_float_dtypes():
    wave = _wave(4000)
    torch.testing.assert_close(fbank(wave.double(), FeatureConfig()), fbank(wave, FeatureConfig()))


def test_fbank_rejects_non_1d():
    with pytest.raises(ValueError, match="1-D"):
        fbank(torch.zeros(1, 16000), FeatureConfig())


def test_fbank_deterministic_without_training():
    wave, config = _wave(16000), FeatureConfig(dither=1.0)
    a = fbank(wave, config)
    b = fbank(wave, config, generator=torch.Generator().manual_seed(5))  # generator unused
    assert torch.equal(a, b)


def test_dither_only_in_training_and_reproducible():
    wave, config = _wave(16000), FeatureConfig(dither=1.0)
    clean = fbank(wave, config)
    a = fbank(wave, config, training=True, generator=torch.Generator().manual_seed(1))
    b = fbank(wave, config, training=True, generator=torch.Generator().manual_seed(1))
    c = fbank(wave, config, training=True, generator=torch.Generator().manual_seed(2))
    assert torch.equal(a, b)
    assert not torch.equal(a, c) and not torch.equal(a, clean)
    # one int16 unit of noise barely moves -20 dBFS speech-level features
    torch.testing.assert_close(a, clean, atol=0.05, rtol=0)


def test_dither_matters_on_digital_silence():
    silence = torch.zeros(8000)
    clean = fbank(silence, FeatureConfig())
    dithered = fbank(silence, FeatureConfig(), training=True, generator=torch.Generator().manual_seed(0))
    assert torch.isfinite(clean).all() and torch.isfinite(dithered).all()
    assert dithered.mean() > clean.mean() + 5  # log(eps) floor vs. the noise's energy


def test_zero_dither_in_training_is_deterministic():
    wave, config = _wave(8000), FeatureConfig(dither=0.0)
    assert torch.equal(fbank(wave, config, training=True), fbank(wave, config))


@pytest.mark.parametrize("kwargs", [{"n_mels": 0}, {"frame_shift_ms": 0.0}, {"dither": -1.0}])
def test_feature_config_validation(kwargs):
    with pytest.raises(ValueError):
        FeatureConfig(**kwargs)


# ----------------------------------------------------------------------------------- CMVN


def _utterances(seed: int = 0, dim: int = 6) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    scale, shift = torch.rand(dim, generator=g) * 3 + 0.5, torch.randn(dim, generator=g) * 10
    return [torch.randn(n, dim, generator=g) * scale + shift for n in (17, 1, 0, 250, 63)]


def _stats(utts: list[torch.Tensor]) -> CMVNStats:
    stats = CMVNStats()
    for feats in utts:
        stats.add(feats)
    return stats


def test_cmvn_equals_numpy():
    utts = _utterances()
    stats = _stats(utts)
    every = torch.cat(utts).double().numpy()
    assert stats.count == every.shape[0] and stats.dim == 6
    np.testing.assert_allclose(stats.mean.numpy(), every.mean(0), rtol=1e-10, atol=1e-10)
    np.testing.assert_allclose(stats.std.numpy(), every.std(0), rtol=1e-8)
    assert stats.mean.dtype == stats.std.dtype == torch.float64


def test_cmvn_merge_equals_all():
    utts = _utterances()
    merged = _stats(utts[:2]).merge(_stats(utts[2:])).merge(CMVNStats())
    every = _stats(utts)
    assert merged.count == every.count
    torch.testing.assert_close(merged.sum, every.sum)
    torch.testing.assert_close(merged.sum_sq, every.sum_sq)


def test_cmvn_dimension_mismatch():
    stats = CMVNStats(6)
    with pytest.raises(ValueError, match="dimension"):
        stats.add(torch.zeros(3, 5))
    with pytest.raises(ValueError, match="dimension"):
        stats.merge(_stats([torch.zeros(2, 4)]))


def test_cmvn_rejects_non_finite_and_empty():
    with pytest.raises(ValueError, match="NaN"):
        CMVNStats().add(torch.tensor([[float("nan")]]))
    with pytest.raises(ValueError, match="no frames"):
        _ = CMVNStats(3).mean


def test_global_cmvn_normalizes():
    utts = _utterances()
    cmvn = GlobalCMVN(_stats(utts))
    assert cmvn.mean.dtype == cmvn.inv_std.dtype == torch.float32
    out = cmvn(torch.cat(utts))  # (T, D)
    torch.testing.assert_close(out.mean(0), torch.zeros(6), atol=1e-5, rtol=0)
    torch.testing.assert_close(out.std(0, unbiased=False), torch.ones(6), atol=1e-5, rtol=0)
    batch = torch.stack([utts[0], utts[0]])  # (B, T, D)
    torch.testing.assert_close(cmvn(batch)[1], cmvn(utts[0]))
    assert set(cmvn.state_dict()) == {"mean", "inv_std"}


def test_variance_floor_keeps_constant_bins_finite():
    stats = _stats([torch.full((10, 3), 4.0)])
    torch.testing.assert_close(stats.std, torch.full((3,), 1e-5, dtype=torch.float64).sqrt())
    assert torch.isfinite(GlobalCMVN(stats)(torch.full((2, 3), 4.0))).all()


def test_cmvn_save_load_round_trip(tmp_path):
    stats = _stats(_utterances())
    path = tmp_path / "sub" / "cmvn.json"
    stats.save(path)
    stats.save(path)  # overwrite
    assert [p.name for p in path.parent.iterdir()] == ["cmvn.json"]  # no temporary left behind
    loaded = CMVNStats.load(path)
    assert loaded.count == stats.count
    assert torch.equal(loaded.sum, stats.sum) and torch.equal(loaded.sum_sq, stats.sum_sq)  # exact float64
    assert json.loads(path.read_text()) == stats.to_dict()


def test_cmvn_dict_is_plain_and_weights_only_safe(tmp_path):
    d = _stats(_utterances()).to_dict()
    assert type(d["count"]) is float and all(type(v) is float for v in d["sum"] + d["sum_sq"])
    torch.save({"frontend": {"cmvn": d}}, tmp_path / "m.pt")
    back = torch.load(tmp_path / "m.pt", weights_only=True)["frontend"]["cmvn"]
    assert CMVNStats.from_dict(back).to_dict() == d


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ("{not json", "not a JSON"),
        ("[1, 2]", "must be a dict"),
        ('{"count": 3, "sum": [1.0]}', "missing key 'sum_sq'"),
        ('{"count": 3, "sum": [1.0, 2.0], "sum_sq": [1.0]}', "one length"),
        ('{"count": 0, "sum": [1.0], "sum_sq": [1.0]}', "count must be > 0"),
        ('{"count": 3, "sum": ["a"], "sum_sq": [1.0]}', "finite numbers"),
        ('{"count": 3, "sum": 1.0, "sum_sq": [1.0]}', "must be a list"),
    ],
)
def test_cmvn_bad_file_one_line_error(tmp_path, text, reason):
    path = tmp_path / "cmvn.json"
    path.write_text(text)
    with pytest.raises(CMVNError, match=reason) as e:
        CMVNStats.load(path)
    assert str(e.value).startswith(f"{path}: ") and "\n" not in str(e.value)


def test_cmvn_missing_file(tmp_path):
    path = tmp_path / "absent.json"
    with pytest.raises(CMVNError) as e:
        CMVNStats.load(path)
    assert str(e.value).startswith(f"{path}: ") and "\n" not in str(e.value)


# ---------------------------------------------------------------------------- SpecAugment

SENTINEL = 123.0
LENS_GRID = [0, 1, 2, 3, 5, 11, 12, 13, 40, 100, 299, 300]


def _padded(lens: list[int], dim: int = 40, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, T, D) features in [1, 2) (never 0, so masks are visible), padding = SENTINEL."""
    lens_t = torch.tensor(lens)
    T = max(lens, default=0)
    feats = 1 + torch.rand(len(lens), T, dim, generator=torch.Generator().manual_seed(seed))
    feats[torch.arange(T)[None, :] >= lens_t[:, None]] = SENTINEL
    return feats, lens_t


def _augment(feats, lens, config, seed=0):
    return spec_augment(feats, lens, config, generator=torch.Generator().manual_seed(seed))


def _padding(feats: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
    return feats[torch.arange(feats.shape[1])[None, :] >= lens[:, None]]  # (frames, D)


WARP_CONFIGS = [SpecAugmentConfig(), SpecAugmentConfig(time_warp=5), SpecAugmentConfig(time_warp=80)]


@pytest.mark.parametrize("config", WARP_CONFIGS, ids=["masks", "warp5", "warp80"])
@pytest.mark.parametrize("seed", range(3))
def test_padding_untouched_over_length_grid(config, seed):
    feats, lens = _padded(LENS_GRID, seed=seed)
    out = _augment(feats, lens, config, seed)
    assert out.shape == feats.shape and out.dtype == feats.dtype
    assert (_padding(out, lens) == SENTINEL).all()
    assert not torch.equal(out, feats)  # something happened inside
    assert (_padding(feats, lens) == SENTINEL).all() and (feats >= 1).all()  # input not modified


def test_masks_are_zero_and_inside():
    feats, lens = _padded([300, 200, 120])
    out = _augment(feats, lens, SpecAugmentConfig())
    valid = torch.arange(300)[None, :] < lens[:, None]  # (B, T)
    changed = out != feats
    assert (out[changed] == 0).all()
    assert changed[valid].any(dim=-1).sum() > 0
    assert not changed[~valid].any()


def test_freq_masks_bounded_and_on_every_valid_frame():
    config = SpecAugmentConfig(freq_masks=1, freq_width=7, time_masks=0)
    feats, lens = _padded([50, 30, 9, 1] * 4)
    out = _augment(feats, lens, config)
    for b, n in enumerate(lens.tolist()):
        bins = (out[b, :n] == 0)  # (n, D)
        assert (bins == bins[0]).all()  # the same bins in every valid frame
        masked = bins[0].nonzero().flatten()
        assert len(masked) <= 7
        if len(masked):
            assert masked.max() - masked.min() + 1 == len(masked)  # one contiguous band


def test_time_masks_scale_with_length():
    config = SpecAugmentConfig(freq_masks=0, time_masks=1, time_width_ratio=0.05, max_time_width=40)
    lens_list = [1000, 400, 100, 19, 20, 1]
    for seed in range(5):
        feats, lens = _padded(lens_list, seed=seed)
        out = _augment(feats, lens, config, seed)
        for b, n in enumerate(lens_list):
            frames = (out[b, :n] == 0).all(dim=-1)  # (n,) masked frames
            assert frames.sum() <= min(40, int(0.05 * n))
            assert ((out[b, :n] == 0).any(dim=-1) == frames).all()  # whole frames only


def test_reproducible_with_same_seed():
    feats, lens = _padded(LENS_GRID)
    config = SpecAugmentConfig(time_warp=5)
    assert torch.equal(_augment(feats, lens, config, 7), _augment(feats, lens, config, 7))
    assert not torch.equal(_augment(feats, lens, config, 7), _augment(feats, lens, config, 8))


def test_everything_off_is_identity_copy():
    feats, lens = _padded([10, 4])
    config = SpecAugmentConfig(freq_masks=0, time_masks=0, time_warp=0)
    out = _augment(feats, lens, config)
    assert torch.equal(out, feats) and out.data_ptr() != feats.data_ptr()


@pytest.mark.parametrize("lens_list", [[0], [1], [0, 0], [1, 0, 2]])
def test_tiny_batches_do_not_crash(lens_list):
    feats, lens = _padded(lens_list)
    for config in WARP_CONFIGS:
        out = _augment(feats, lens, config)
        assert out.shape == feats.shape and (_padding(out, lens) == SENTINEL).all()


def test_empty_batch():
    empty_lens = torch.zeros(0, dtype=torch.long)
    out = spec_augment(torch.zeros(0, 0, 80), empty_lens, SpecAugmentConfig(time_warp=5))
    assert out.shape == (0, 0, 80)


def test_time_warp_keeps_ends_and_stays_in_range():
    config = SpecAugmentConfig(freq_masks=0, time_masks=0, time_warp=10)
    feats, lens = _padded([200, 100, 22, 21, 5])
    out = _augment(feats, lens, config)
    for b, n in enumerate(lens.tolist()):
        torch.testing.assert_close(out[b, 0], feats[b, 0])
        torch.testing.assert_close(out[b, n - 1], feats[b, n - 1])
        lo, hi = feats[b, :n].min(0).values, feats[b, :n].max(0).values
        assert ((out[b, :n] >= lo - 1e-6) & (out[b, :n] <= hi + 1e-6)).all()  # interpolation only
    assert not torch.equal(out[:2], feats[:2])  # long enough: warped
    assert torch.equal(out[3:], feats[3:])  # shorter than 2 * warp + 2: left as they are


def test_time_warp_of_a_ramp_is_monotonic():
    n = 100
    ramp = torch.arange(n, dtype=torch.float32)[None, :, None].expand(1, n, 4).clone()
    out = _augment(ramp, torch.tensor([n]), SpecAugmentConfig(freq_masks=0, time_masks=0, time_warp=10))
    assert (out[0, 1:, 0] >= out[0, :-1, 0]).all()
    assert (out[0, :, 0] - ramp[0, :, 0]).abs().max() <= 10 + 1e-4  # moved by at most the warp


def test_bad_lengths_rejected():
    feats, _ = _padded([5, 3])
    with pytest.raises(ValueError, match="feat_lens"):
        spec_augment(feats, torch.tensor([6, 3]), SpecAugmentConfig())
    with pytest.raises(ValueError):
        spec_augment(feats, torch.tensor([5]), SpecAugmentConfig())


def test_specaug_config_validation():
    with pytest.raises(ValueError, match="time_width_ratio"):
        SpecAugmentConfig(time_width_ratio=1.5)
    with pytest.raises(ValueError, match="freq_masks"):
        SpecAugmentConfig(freq_masks=-1)
