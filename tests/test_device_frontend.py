"""asr.device_frontend and the waveform path: batched fbank + CMVN equal the per-utterance CPU
features, SpecAugment masks keyed by (seed, epoch, index), WaveBatches from the loader train to
the CPU frontend's loss, and ASRTask's halves of a WaveBatch."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from data_helpers import FEATURES, loader_config
from small_models import small_model

from asr.asr_task import ASRTask
from asr.augment import AugmentConfig, EqConfig, GainConfig, WarpConfig
from asr.dataset import ASRDataset, Batch, Skipped, WaveBatch, WaveExample, collate_waves, derive_seed
from asr.device_frontend import DeviceFrontend
from asr.feature_archive import FeatureArchive
from asr.features import (
    CMVNStats,
    FeatureConfig,
    GlobalCMVN,
    SpecAugmentConfig,
    batched_fbank,
    fbank,
    frame_lengths,
    num_frames,
)
from asr.loader import compute_cmvn, make_loader

# Batched features equal per-utterance ones to a relative 1e-4 in each filterbank energy, i.e. 1e-4
# in its log, i.e. 1e-4 * inv_std after CMVN. Each frame is computed alone in both paths; only the
# batched FFT and mel matmul may round differently (on the CPU they do not: the features are
# bit-identical), and the matmul sums non-negative terms, so its relative error stays near n eps.
LOG_TOL = 1e-4
NO_DITHER = FeatureConfig(n_mels=16, dither=0.0)
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def waveforms(lens: list[int], silent: tuple[int, ...] = (), seed: int = 0) -> list[torch.Tensor]:
    """Speech-like noise of each length (all-zero digital silence for the rows in `silent`)."""
    rng = np.random.default_rng(seed)
    out = []
    for b, n in enumerate(lens):
        t = np.arange(n) / 16000
        wave = 0.2 * np.sin(2 * np.pi * (120 + 40 * b) * t) + 0.05 * rng.standard_normal(n)
        out.append(torch.zeros(n) if b in silent else torch.from_numpy(wave.astype(np.float32)))
    return out


def pad(waves: list[torch.Tensor], extra: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(waves (B, N) zero-padded to the longest plus `extra`, wave_lens (B,))."""
    lens = torch.tensor([w.numel() for w in waves])
    out = torch.zeros(len(waves), int(lens.max()) + extra)
    for b, w in enumerate(waves):
        out[b, : w.numel()] = w
    return out, lens


def cmvn_of(waves: list[torch.Tensor], config: FeatureConfig) -> CMVNStats:
    stats = CMVNStats()
    for w in waves:
        stats.add(fbank(w, config))
    return stats


@pytest.mark.parametrize("device", DEVICES)
def test_device_frontend_matches_per_utterance_fbank(device, one_thread):
    # 2 s, 1 s of digital silence, exactly one frame, one sample short of it, two frames, odd lengths
    lens = [32000, 16000, 400, 399, 560, 12345, 7001]
    waves = waveforms(lens, silent=(1,))
    stats = cmvn_of(waves, NO_DITHER)
    cmvn = GlobalCMVN(stats)
    frontend = DeviceFrontend(NO_DITHER, stats, None, seed=0).to(device)
    padded, wave_lens = pad(waves, extra=300)  # padding past the longest too
    feats, feat_lens = frontend(padded.to(device), wave_lens, torch.arange(len(lens)), 0, training=True)
    assert feats.device.type == device and feats.dtype == torch.float32
    assert feat_lens.tolist() == [num_frames(n) for n in lens] == frame_lengths(wave_lens, NO_DITHER).tolist()
    assert feats.shape == (len(lens), num_frames(padded.shape[1]), 16)
    tol = LOG_TOL * float(cmvn.inv_std.max())
    for b, w in enumerate(waves):
        expected = cmvn(fbank(w, NO_DITHER))  # the CPU frontend: per utterance, unpadded
        n = int(feat_lens[b])
        torch.testing.assert_close(feats[b, :n].cpu(), expected, rtol=0.0, atol=tol)
        assert not feats[b, n:].any()  # padded frames are zero
    # digital silence: every energy at the log floor, the same in both
    assert torch.equal(feats[1, : feat_lens[1]].cpu(), cmvn(fbank(waves[1], NO_DITHER)))


def test_batched_fbank_ignores_what_lies_in_the_padding():
    waves = waveforms([8000, 3000, 500])
    padded, lens = pad(waves)
    clean, clean_lens = batched_fbank(padded, lens, NO_DITHER)
    noisy = padded.clone()
    for b, n in enumerate(lens.tolist()):
        noisy[b, n:] = 0.9  # what a frame past the length would read
    got, got_lens = batched_fbank(noisy, lens, NO_DITHER)
    assert torch.equal(got, clean) and torch.equal(got_lens, clean_lens)


def test_batched_fbank_rejects_bad_lengths():
    with pytest.raises(ValueError, match="wave_lens must lie in"):
        batched_fbank(torch.zeros(2, 800), torch.tensor([800, 801]), NO_DITHER)
    with pytest.raises(ValueError, match="expected waves"):
        batched_fbank(torch.zeros(800), torch.tensor([800]), NO_DITHER)


def test_dither_on_the_cpu_is_the_datasets(corpus, one_thread):
    """The same generator seeds as ASRDataset's dither: on the CPU, the same training features."""
    features = dataclasses.replace(FEATURES, dither=1.0)
    stats = compute_cmvn(corpus[:4], features)
    dataset = ASRDataset(corpus[:4], None, features=features, cmvn=GlobalCMVN(stats), training=True, seed=3)
    items = [dataset.waveform(i) for i in range(4)]
    batch = collate_waves(items, epoch=2)
    frontend = DeviceFrontend(features, stats, None, seed=3)
    feats, feat_lens = frontend(batch.waves, batch.wave_lens, batch.indices, batch.epoch, training=True)
    for b in range(4):
        expected = dataset.get(b, 2).feats
        torch.testing.assert_close(feats[b, : feat_lens[b]], expected, rtol=0.0, atol=1e-5)
    evaluation, _ = frontend(batch.waves, batch.wave_lens, batch.indices, batch.epoch, training=False)
    assert not torch.allclose(evaluation, feats)  # no dither outside training


def test_the_device_frontends_warp_is_the_datasets(corpus, one_thread):
    """data.augment.warp and .gain on the waveform path: each utterance warped by the factor and
    shifted by the gain ASRDataset draws for it (same seed, epoch, index), before CMVN: the same
    training features."""
    features = dataclasses.replace(FEATURES, dither=0.0)
    stats = compute_cmvn(corpus[:4], features)
    augment = AugmentConfig(warp=WarpConfig(prob=0.7, factor=(0.8, 1.2), step=0.05), gain=GainConfig(prob=0.5),
                            eq=EqConfig(prob=0.5))
    dataset = ASRDataset(corpus[:4], None, features=features, cmvn=GlobalCMVN(stats), training=True, seed=3,
                         augment=augment)
    batch = collate_waves([dataset.waveform(i) for i in range(4)], epoch=2)
    frontend = DeviceFrontend(features, stats, None, seed=3, augment=augment)
    feats, feat_lens = frontend(batch.waves, batch.wave_lens, batch.indices, batch.epoch, training=True)
    factors = [dataset.augmenter.draw(2, i).warp for i in range(4)]
    gains = [dataset.augmenter.draw(2, i).gain_db for i in range(4)]
    eqs = [dataset.augmenter.draw(2, i).eq_db for i in range(4)]
    assert 1.0 in factors and len(set(factors)) >= 2  # warped rows and a plain one in the batch
    assert 0.0 in gains and len(set(gains)) >= 2
    for b in range(4):
        torch.testing.assert_close(feats[b, : feat_lens[b]], dataset.get(b, 2).feats, rtol=0.0, atol=1e-5)
    plain, _ = DeviceFrontend(features, stats, None, seed=3)(batch.waves, batch.wave_lens, batch.indices, 2, True)
    assert () in eqs and any(eqs)
    for b, (f, g, e) in enumerate(zip(factors, gains, eqs)):
        assert torch.equal(feats[b], plain[b]) == (f == 1.0 and g == 0.0 and e == ())
    evaluation, _ = frontend(batch.waves, batch.wave_lens, batch.indices, batch.epoch, training=False)
    assert torch.equal(evaluation, plain)  # no warp outside training (and no dither: 0 here)
    bare, bare_lens = DeviceFrontend(features, None, None, seed=3, augment=augment)(
        batch.waves, batch.wave_lens, batch.indices, 2, True)  # no CMVN: padded frames are zero all the same
    assert all(not bare[b, bare_lens[b]:].any() for b in range(4)) and (bare_lens < bare.shape[1]).any()


# ----------------------------------------------------------------------------- SpecAugment


SPECAUG = SpecAugmentConfig(freq_masks=2, freq_width=5, time_masks=3, time_width_ratio=0.2, max_time_width=8,
                            time_warp=3)


def augmented(waves: list[torch.Tensor], indices: list[int], epoch: int = 0, extra: int = 0,
              specaug: SpecAugmentConfig = SPECAUG) -> tuple[torch.Tensor, torch.Tensor]:
    frontend = DeviceFrontend(NO_DITHER, None, specaug, seed=7)
    padded, lens = pad(waves, extra)
    return frontend(padded, lens, torch.tensor(indices), epoch, training=True)


@pytest.mark.parametrize("time_warp", [0, 3])
def test_specaug_masks_follow_the_utterance_not_the_batch(time_warp):
    """Masks keyed by (seed, epoch, dataset index): the same alone, in another row, beside other
    utterances and with other padding; inside the utterance's length."""
    specaug = dataclasses.replace(SPECAUG, time_warp=time_warp)
    u, v, w = waveforms([9000, 16000, 4000], seed=1)
    alone, alone_lens = augmented([u], [42], specaug=specaug)
    first, _ = augmented([u, w], [42, 5], extra=700, specaug=specaug)
    second, _ = augmented([v, u], [9, 42], specaug=specaug)
    n = int(alone_lens[0])
    assert (alone[0] == 0).any()  # something is masked
    for feats in (first[0], second[1]):
        torch.testing.assert_close(feats[:n], alone[0, :n], rtol=0.0, atol=LOG_TOL)
        assert torch.equal(feats[:n] == 0, alone[0, :n] == 0)  # the same masks
        assert not feats[n:].any()  # nothing past the length
    plain, _ = augmented([u, v], [42, 9], specaug=SpecAugmentConfig(freq_masks=0, time_masks=0))
    assert (plain[0, :n] != 0).all()  # every zero above is a mask
    other_epoch, _ = augmented([u], [42], epoch=1, specaug=specaug)
    other_index, _ = augmented([u], [43], specaug=specaug)
    assert not torch.equal(other_epoch, alone) and not torch.equal(other_index, alone)


def test_time_masks_stay_inside_the_length():
    specaug = SpecAugmentConfig(freq_masks=0, time_masks=10, time_width_ratio=1.0, max_time_width=50)
    waves = waveforms([16000, 3000, 1200])
    feats, lens = augmented(waves, [0, 1, 2], extra=4000, specaug=specaug)
    for b, n in enumerate(lens.tolist()):
        masked = (feats[b] == 0).all(dim=1)  # (T,) whole frames zeroed
        assert masked[:n].any() and masked[n:].all()
        assert (feats[b, :n][~masked[:n]] != 0).all()


# ------------------------------------------------------------------- loader, task, halves


def test_wave_loader_gives_the_cpu_frontends_loss(corpus, tokenizer, one_thread):
    """dither 0, no SpecAugment, speed perturbation in the workers: the same batches, the same
    skipped utterances and the same losses from WaveBatches as from the CPU frontend's Batches."""
    features = NO_DITHER
    stats = compute_cmvn(corpus[:4], features)
    off = SpecAugmentConfig(freq_masks=0, time_masks=0)
    config = loader_config(features=features, specaug=off, speed_perturb=[0.9], max_batch_seconds=2.5)
    cpu = make_loader(corpus, tokenizer, config, training=True, cmvn=GlobalCMVN(stats), seed=4)
    dev = make_loader(corpus, tokenizer, dataclasses.replace(config, frontend="device"), training=True,
                      cmvn=GlobalCMVN(stats), seed=4)
    cpu.set_epoch(1)
    dev.set_epoch(1)
    cpu_batches, wave_batches = list(cpu), list(dev)
    assert all(type(b) is WaveBatch and b.epoch == 1 for b in wave_batches)
    assert [b.ids for b in cpu_batches] == [b.ids for b in wave_batches]
    assert dev.skipped == cpu.skipped and len(dev.skipped) == 6  # 3 bad ones and their copies (wronglen: too long)
    model = small_model(vocab_size=tokenizer.vocab_size, n_mels=16)
    task = ASRTask(model, tokenizer, features, 0.3, torch.device("cpu"),
                   frontend=DeviceFrontend(features, stats, config.specaug, seed=4))
    counts = torch.tensor(task.counts(cpu_batches), dtype=torch.float64)
    assert task.counts(wave_batches) == task.counts(cpu_batches)
    assert sum(bool(b.ids) for b in wave_batches) >= 3
    for a, b in zip(cpu_batches, wave_batches):
        if not b.ids:  # every utterance skipped: the trainer runs its placeholder
            continue
        assert [dev.dataset.dataset.utt_id(i) for i in b.indices.tolist()] == b.ids
        loss_a, sums_a = task.loss(model, a, counts)
        loss_b, sums_b = task.loss(model, b, counts)
        torch.testing.assert_close(loss_b, loss_a, rtol=1e-5, atol=0.0)
        torch.testing.assert_close(sums_b, sums_a, rtol=1e-5, atol=1e-9)
        torch.testing.assert_close(task.validation(model, b), task.validation(model, a), rtol=1e-5, atol=1e-9)
        assert task.amount([b]) == pytest.approx(b.wave_lens.sum().item() / 16000)
    loss, _ = task.loss(model, task.placeholder(), counts)
    assert type(task.placeholder()) is WaveBatch and torch.isfinite(loss)


def test_halves_of_a_wave_batch(tokenizer):
    lens = [16000, 4000, 9000]
    items = [WaveExample(f"u{k}", w, torch.tensor([2] * (k + 1)), 10 + k) for k, w in enumerate(waveforms(lens))]
    batch = collate_waves([items[0], Skipped("bad", "unreadable"), items[1], items[2]], epoch=3)
    assert batch.ids == ["u0", "u1", "u2"] and batch.indices.tolist() == [10, 11, 12]
    task = ASRTask(small_model(vocab_size=tokenizer.vocab_size, n_mels=16), tokenizer, NO_DITHER, 0.3,
                   torch.device("cpu"), frontend=DeviceFrontend(NO_DITHER, None))
    assert task.describe(batch) == "a batch of 3 utterances (longest 1.0 s)"
    first, second = task.halves(batch, step=1)
    assert type(first) is WaveBatch and type(second) is WaveBatch
    assert first.ids == ["u0"] and second.ids == ["u1", "u2"]
    assert first.indices.tolist() == [10] and second.indices.tolist() == [11, 12]
    assert first.epoch == second.epoch == 3
    assert first.waves.shape == (1, 16000) and second.waves.shape == (2, 9000)  # trimmed to their longest
    assert torch.equal(second.waves[0, :4000], items[1].wave) and not second.waves[0, 4000:].any()
    assert second.wave_lens.tolist() == [4000, 9000] and second.tokens.shape == (2, 3)
    assert task.halves(first, step=1) == []


def test_waveforms_skip_what_features_skip(corpus, tokenizer):
    dataset = ASRDataset(corpus, tokenizer, features=FEATURES)
    for i in range(len(corpus)):
        wave, feats = dataset.waveform(i), dataset[i]
        if isinstance(feats, Skipped):
            assert wave == feats
        else:
            assert isinstance(wave, WaveExample) and wave.index == i and wave.id == feats.id
            assert torch.equal(wave.tokens, feats.tokens)
            assert torch.equal(fbank(wave.wave, FEATURES), feats.feats)


def test_a_feature_archive_and_the_device_frontend_exclude_each_other(corpus, tokenizer, tmp_path):
    compute_cmvn(corpus[:1], FEATURES, dump_dir=tmp_path / "feats")
    archive = FeatureArchive(tmp_path / "feats", FEATURES)
    with pytest.raises(ValueError, match="cannot read a feature archive"):
        make_loader(corpus[:1], tokenizer, loader_config(frontend="device"), training=True, archive=archive)


def test_a_batch_of_features_still_works_without_a_frontend(tokenizer):
    task = ASRTask(small_model(vocab_size=tokenizer.vocab_size, n_mels=16), tokenizer, NO_DITHER, 0.3,
                   torch.device("cpu"))
    assert type(task.placeholder()) is Batch
    with pytest.raises(ValueError, match="needs a DeviceFrontend"):
        task.validation(task.model, collate_waves([], epoch=0))


def test_specaug_seeds_differ_from_dither_seeds():
    assert derive_seed(7, 0, 42) != derive_seed(7, 0, 42, 1)
