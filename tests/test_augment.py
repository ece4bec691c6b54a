"""Augmentation on the fly (asr.augment): per-utterance reproducible draws, and each operation
against its definition."""
from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch

from asr.augment import (
    AugmentConfig,
    Augmenter,
    EqConfig,
    GainConfig,
    NoiseConfig,
    ReverbConfig,
    WarpConfig,
    add_noise,
    colored_noise,
    eq_curve,
    gain_offset,
    reverberate,
    simulated_rir,
    warp_mels,
)
from asr.config import ConfigError, from_dict
from asr.features import FeatureConfig, fbank

ALL_ON = AugmentConfig(noise=NoiseConfig(prob=0.7), reverb=ReverbConfig(prob=0.5), warp=WarpConfig(prob=0.6),
                       gain=GainConfig(prob=0.5), eq=EqConfig(prob=0.5, db=4.0, terms=3))


def _voice(index: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + index)
    return 0.1 * torch.randn(8000 + 100 * index, generator=g)


def test_augmentation_draws_are_per_utterance_and_reproducible():
    """A draw is a function of (seed, epoch, index): the same in any order of asking (any batch,
    any rank), in a new Augmenter (a resumed run); another epoch or index draws anew; the
    augmented waveform is the same too, babble included."""
    one = Augmenter(ALL_ON, seed=3, other=_voice, size=50)
    forward = [one.draw(2, i) for i in range(40)]
    backward = [Augmenter(ALL_ON, seed=3, other=_voice, size=50).draw(2, i) for i in reversed(range(40))][::-1]
    assert forward == backward
    assert forward != [one.draw(3, i) for i in range(40)]
    assert forward != [Augmenter(ALL_ON, seed=4).draw(2, i) for i in range(40)]
    kinds = {d.noise for d in forward}
    assert {None, "babble"} <= kinds and len(kinds) >= 3, kinds  # each probability acts
    assert any(d.rt60 is None for d in forward) and any(d.rt60 is not None for d in forward)
    assert any(d.warp == 1.0 for d in forward) and len({d.warp for d in forward}) > 2
    assert any(d.gain_db == 0.0 for d in forward) and all(-10 <= d.gain_db <= 10 for d in forward)
    assert len({d.gain_db for d in forward}) > 10
    assert any(d.eq_db == () for d in forward) and len({d.eq_db for d in forward}) > 10
    assert all(len(d.eq_db) in (0, 3) and all(-4 <= a <= 4 for a in d.eq_db) for d in forward)
    for i in range(12):
        draw = forward[i]
        a = one.wave(_voice(i), draw)
        b = Augmenter(ALL_ON, seed=3, other=_voice, size=50).wave(_voice(i), draw)
        assert torch.equal(a, b)
        assert a.shape == _voice(i).shape
        assert torch.equal(a, _voice(i)) == (draw.noise is None and draw.rt60 is None)
    off = Augmenter(AugmentConfig(), seed=3)
    assert all(d.noise is None and d.rt60 is None and d.warp == 1.0 and d.gain_db == 0.0 and d.eq_db == ()
               for d in (off.draw(0, i) for i in range(20)))
    # turning the gain and the equaliser on leaves the other draws as they were
    no_gain = Augmenter(AugmentConfig(noise=ALL_ON.noise, reverb=ALL_ON.reverb, warp=ALL_ON.warp), seed=3,
                        other=_voice, size=50)
    assert [d._replace(gain_db=0.0, eq_db=()) for d in forward] == [no_gain.draw(2, i) for i in range(40)]
    no_eq = Augmenter(dataclasses.replace(ALL_ON, eq=EqConfig()), seed=3, other=_voice, size=50)
    assert [d._replace(eq_db=()) for d in forward] == [no_eq.draw(2, i) for i in range(40)]


def test_warp_factors_are_quantised_within_the_range():
    augmenter = Augmenter(AugmentConfig(warp=WarpConfig(prob=1.0, factor=(0.9, 1.1), step=0.05)), seed=0)
    factors = {round(augmenter.draw(0, i).warp, 6) for i in range(200)}
    assert factors <= {0.9, 0.95, 1.0, 1.05, 1.1} and len(factors) >= 4


@pytest.mark.parametrize("factor", [0.9, 1.1, 1.2])
def test_spectral_warp_moves_a_tone_by_the_factor(factor):
    """A 1 kHz tone's filterbank peak, warped by `factor`, is at the bin of factor x 1 kHz (a
    tone at that frequency peaks there too), to one bin."""
    t = torch.arange(16000) / 16000.0

    def peak(freq: float, warp: float = 1.0) -> float:
        feats = fbank((0.3 * torch.sin(2 * math.pi * freq * t)).float(), FeatureConfig(dither=0.0))
        return float(warp_mels(feats, warp)[20:-20].mean(0).argmax())

    assert peak(1000.0) != peak(1000.0 * factor)  # the factor moves the tone by bins
    assert abs(peak(1000.0, factor) - peak(1000.0 * factor)) <= 1
    feats = fbank((0.3 * torch.sin(2 * math.pi * 700.0 * t)).float(), FeatureConfig(dither=0.0))
    assert warp_mels(feats, 1.0) is feats


@pytest.mark.parametrize("kind", ["white", "pink", "brown"])
@pytest.mark.parametrize("snr_db", [-5.0, 0.0, 10.0, 30.0])
def test_noise_is_added_at_the_requested_snr(kind, snr_db):
    g = torch.Generator().manual_seed(1)
    wave = 0.2 * torch.randn(16000, generator=g)
    noise = colored_noise(16000, kind, g)
    noisy = add_noise(wave, noise, snr_db)
    added = (noisy.double() - wave.double())
    measured = 10 * math.log10(float(wave.double().square().mean() / added.square().mean()))
    assert measured == pytest.approx(snr_db, abs=1e-3)
    assert torch.equal(add_noise(torch.zeros(100), noise[:100], snr_db), torch.zeros(100))  # silence stays


def test_coloured_noise_has_its_slope():
    """The power density of pink noise falls by ~3 dB per octave, of brown noise by ~6 dB, of
    white noise not at all (mean power per FFT bin, the octaves above 354 and 707 Hz)."""
    g = torch.Generator().manual_seed(2)
    for kind, slope in (("white", 0.0), ("pink", -3.0), ("brown", -6.0)):
        power = torch.fft.rfft(colored_noise(160000, kind, g).double()).abs().square()
        hz = torch.fft.rfftfreq(160000, 1 / 16000)
        low = power[(hz >= 354) & (hz < 707)].mean()
        high = power[(hz >= 707) & (hz < 1414)].mean()
        assert 10 * math.log10(float(high / low)) == pytest.approx(slope, abs=0.6), kind


def test_reverberation_matches_direct_convolution():
    """The FFT convolution against numpy's direct one, aligned at the direct path (a delayed
    impulse response too), and `keep_power` keeps the wave's mean square."""
    g = torch.Generator().manual_seed(5)
    wave = torch.randn(3001, generator=g)
    for rir in (simulated_rir(0.3, g), torch.cat([torch.zeros(17), simulated_rir(0.05, g)])):
        direct = np.convolve(wave.double().numpy(), rir.double().numpy())
        d = int(rir.abs().argmax())
        out = reverberate(wave, rir)
        np.testing.assert_allclose(out.double().numpy(), direct[d:d + wave.numel()], atol=1e-4, rtol=1e-5)
        kept = reverberate(wave, rir, keep_power=True)
        assert float(kept.double().square().mean()) == pytest.approx(float(wave.double().square().mean()), rel=1e-5)


def test_simulated_rir_decays_by_60_db_in_rt60():
    rir = simulated_rir(0.4, torch.Generator().manual_seed(0)).double()
    energy = rir[1:].square()
    early, late = energy[16:800].mean(), energy[6400 - 400:6400 + 400].mean()  # around 1-50 ms and 0.4 s
    assert 10 * math.log10(float(early / late)) == pytest.approx(60.0 * (0.4 - 0.025) / 0.4, abs=4.0)
    assert rir[0] == 1.0 and rir.numel() == 6400


def test_babble_and_files(tmp_path):
    """Babble sums other utterances of the corpus; a noise folder is used when given; a folder
    without audio is a one-line error naming it."""
    import soundfile as sf

    babble = AugmentConfig(noise=NoiseConfig(prob=1.0, kinds=("babble",), snr_db=(0.0, 0.0)))
    asked = []

    def other(i: int) -> torch.Tensor:
        asked.append(i)
        return _voice(i)

    augmenter = Augmenter(babble, seed=0, other=other, size=10)
    draw = augmenter.draw(0, 1)
    out = augmenter.wave(_voice(1), draw)
    assert draw.noise == "babble" and len(asked) == 3 and all(0 <= i < 10 for i in asked)
    assert not torch.equal(out, _voice(1))
    folder = tmp_path / "noise" / "sub"
    folder.mkdir(parents=True)
    sf.write(folder / "hum.wav", (0.1 * np.sin(np.arange(4000) * 0.3)).astype(np.float32), 16000)
    files = Augmenter(AugmentConfig(noise=NoiseConfig(prob=1.0, folder=str(tmp_path / "noise"))), seed=0)
    draw = files.draw(0, 0)
    assert draw.noise == "file"
    assert files.wave(_voice(0), draw).shape == _voice(0).shape
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="empty: no audio files"):
        Augmenter(AugmentConfig(reverb=ReverbConfig(prob=1.0, folder=str(tmp_path / "empty"))), seed=0)


@pytest.mark.parametrize("db", [-9.0, 6.0])
def test_gain_shifts_the_log_mels_as_scaling_the_waveform_does(db):
    """A tone scaled by `db` decibels has log-mels `gain_offset(db)` above the tone's (no dither; to
    float rounding in the quiet bins), and the augmenter's gain is that shift."""
    t = torch.arange(16000) / 16000.0
    tone = (0.1 * torch.sin(2 * math.pi * 440 * t) + 0.05 * torch.sin(2 * math.pi * 2500 * t)).float()
    plain = fbank(tone, FeatureConfig(dither=0.0))
    louder = fbank(tone * 10 ** (db / 20), FeatureConfig(dither=0.0))
    assert gain_offset(db) == pytest.approx(db / 10 * math.log(10))
    torch.testing.assert_close(louder - plain, torch.full_like(plain, gain_offset(db)), rtol=0, atol=0.02)
    augmenter = Augmenter(AugmentConfig(gain=GainConfig(prob=1.0, db=(db, db))), seed=0)
    draw = augmenter.draw(0, 0)
    assert draw.gain_db == db and draw.warp == 1.0
    torch.testing.assert_close(augmenter.features(plain, draw), louder, rtol=0, atol=0.02)


def test_eq_shifts_the_log_mels_as_filtering_the_waveform_does():
    """The equaliser's curve is smooth, zero on average (the level is the gain's) and a tilt with one
    term; noise filtered by a response that follows the curve along the mel axis has log-mels that
    curve above the noise's (to the triangular filters' smoothing), and the augmenter adds it."""
    n_mels, amps = 40, (5.0, -3.0, 2.0)
    curve = eq_curve(amps, n_mels)
    assert abs(float(curve.mean())) < 1e-12 and float(curve.abs().max()) > 1.0
    tilt = eq_curve((6.0,), n_mels)
    assert bool((tilt[1:] < tilt[:-1]).all()) and float(tilt[0]) == pytest.approx(gain_offset(6.0), rel=0.01)

    noise = torch.randn(32000, generator=torch.Generator().manual_seed(0), dtype=torch.float64) * 0.05
    f = torch.fft.rfftfreq(noise.numel(), 1 / 16000).double()
    mel = 1127.0 * torch.log1p(f / 700.0)
    lo, hi = 1127.0 * math.log1p(20.0 / 700.0), 1127.0 * math.log1p(8000.0 / 700.0)
    x = (mel - lo) / ((hi - lo) / (n_mels + 1)) - 1.0  # fractional bin: 0 at bin 0's centre
    k = torch.arange(1, len(amps) + 1, dtype=torch.float64)[:, None]
    db = (torch.tensor(amps, dtype=torch.float64)[:, None] * torch.cos(math.pi * k * (x + 0.5) / n_mels)).sum(0)
    filtered = torch.fft.irfft(torch.fft.rfft(noise) * 10 ** (db / 20), n=noise.numel())
    config = FeatureConfig(n_mels=n_mels, dither=0.0)
    plain, shaped = fbank(noise.float(), config), fbank(filtered.float(), config)
    torch.testing.assert_close((shaped - plain).mean(0), curve.float(), rtol=0, atol=0.05)

    augmenter = Augmenter(AugmentConfig(eq=EqConfig(prob=1.0, db=5.0, terms=3), gain=GainConfig(prob=1.0)), seed=0)
    draw = augmenter.draw(0, 0)
    assert len(draw.eq_db) == 3 and draw.gain_db != 0.0
    expected = plain + (eq_curve(draw.eq_db, n_mels) + gain_offset(draw.gain_db)).float()
    torch.testing.assert_close(augmenter.features(plain, draw), expected, rtol=0, atol=1e-5)
    assert Augmenter.shift(Augmenter(AugmentConfig(), seed=0).draw(0, 0), n_mels) is None


def test_augment_config_reads_and_checks_its_values():
    config = from_dict(AugmentConfig, {"noise": {"prob": 0.5, "snr_db": [0, 15], "kinds": ["pink"]},
                                       "warp": {"prob": 0.3}}, source="c.yaml", prefix="data.augment.")
    assert config.noise.snr_db == (0, 15) and config.noise.kinds == ("pink",) and config.enabled
    assert not AugmentConfig().enabled
    for bad in ({"noise": {"prob": 2}}, {"noise": {"kinds": ["rain"]}}, {"warp": {"factor": [1.2, 1.1]}},
                {"reverb": {"rt60": [0, 1]}}, {"gain": {"db": [5, -5]}}, {"gain": {"prob": -0.1}},
                {"eq": {"terms": 0}}, {"eq": {"db": -1}}):
        with pytest.raises(ConfigError, match="c.yaml"):
            from_dict(AugmentConfig, bad, source="c.yaml", prefix="data.augment.")


def test_the_dataset_augments_training_utterances_per_epoch_and_index(tmp_path):
    """ASRDataset with data.augment: each utterance's features are a function of (seed, epoch,
    index) in any dataset instance (another worker, a resumed run), differ from the clean ones
    when a draw applies, and validation (training False) is never augmented."""
    from data_helpers import write_audio  # tests/data_helpers.py

    from asr.dataset import ASRDataset
    from asr.manifest import Utterance

    utts = [Utterance(f"u{i}", str(write_audio(tmp_path / f"u{i}.wav", 1.0 + 0.1 * i, seed=i)), 1.0 + 0.1 * i,
                      "a b") for i in range(6)]
    plain = FeatureConfig(dither=0.0)

    def dataset(augment=ALL_ON, training=True):
        return ASRDataset(utts, None, features=plain, training=training, seed=7, augment=augment)

    a, b = dataset(), dataset()
    for epoch in (0, 1):
        for i in reversed(range(6)):
            assert torch.equal(a.get(i, epoch).feats, b.get(i, epoch).feats)
            assert torch.equal(a.waveform(i, epoch).wave, b.waveform(i, epoch).wave)
    clean = dataset(augment=None)
    changed = [not torch.equal(a.get(i, 0).feats, clean.get(i, 0).feats) for i in range(6)]
    draws = [a.augmenter.draw(0, i) for i in range(6)]
    assert changed == [d.noise is not None or d.rt60 is not None or d.warp != 1.0 or d.gain_db != 0 or d.eq_db != ()
                       for d in draws]
    assert any(changed)
    assert dataset(training=False).augmenter is None


def test_data_augment_reaches_the_training_loader_only(tmp_path):
    """`data.augment` in a config: the training loader's dataset augments, the validation one not."""
    from data_helpers import loader_config, write_audio  # tests/data_helpers.py

    from asr.loader import DataConfig, make_loader
    from asr.manifest import Utterance

    config = from_dict(DataConfig, {"augment": {"noise": {"prob": 0.5}}, "max_batch_seconds": 3.0,
                                    "num_workers": 0}, source="c.yaml", prefix="data.")
    assert config.augment.noise.prob == 0.5 and not loader_config().augment.enabled
    utts = [Utterance("u0", str(write_audio(tmp_path / "u0.wav", 1.0)), 1.0, "a b")]
    assert make_loader(utts, None, config, training=True).dataset.dataset.augmenter is not None
    assert make_loader(utts, None, config, training=False).dataset.dataset.augmenter is None
