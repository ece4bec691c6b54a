"""asr.feature_archive: dumped features read instead of computed, their commit point and errors."""
from __future__ import annotations

import json
import logging
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from data_helpers import FEATURES, loader_config, write_audio

from asr.dataset import ASRDataset, Skipped
from asr.feature_archive import FeatureArchive, FeatureArchiveError
from asr.features import GlobalCMVN, SpecAugmentConfig
from asr.loader import compute_cmvn, make_loader


def test_dumped_features_are_the_computed_ones(corpus, tokenizer, tmp_path, caplog):
    """compute_cmvn(dump_dir=) gives the same statistics, and an archive of every usable utterance
    (the bad ones skipped) whose features equal fbank without dither to float16 precision; a
    training Dataset reads them (the same after CMVN, with or without loader workers)."""
    plain = compute_cmvn(corpus, FEATURES)
    stats = compute_cmvn(corpus, FEATURES, num_workers=2, dump_dir=tmp_path / "feats")
    assert torch.equal(stats.sum, plain.sum) and stats.count == plain.count
    with caplog.at_level(logging.INFO, logger="asr.dataset"):
        archive = FeatureArchive(tmp_path / "feats", FEATURES)
        cmvn = GlobalCMVN(stats)
        computed = ASRDataset(corpus, tokenizer, features=FEATURES, cmvn=cmvn)
        read = ASRDataset(corpus, tokenizer, features=FEATURES, cmvn=cmvn, training=True, archive=archive)
    assert "features of 4 of 8 utterances from" in caplog.text
    offsets, frames = archive.rows(corpus)
    assert (offsets[:4] >= 0).all() and (offsets[4:] == -1).all() and frames.sum() == stats.count
    for i in range(4):
        want = computed[i]
        got = read[i]
        assert got.id == want.id and torch.equal(got.tokens, want.tokens)
        torch.testing.assert_close(got.feats, want.feats, atol=0.02, rtol=0.0)  # float16 of log-mels < 32
        assert not torch.equal(got.feats, want.feats)  # really read from the archive
        torch.testing.assert_close(got.feats, read.get(i, epoch=3).feats, atol=0, rtol=0)  # no dither
    assert [type(read[i]) for i in range(4, 8)] == [Skipped] * 4
    no_masks = SpecAugmentConfig(freq_masks=0, time_masks=0)
    batches = [b for b in make_loader(corpus, tokenizer, loader_config(num_workers=2, specaug=no_masks),
                                      training=True, cmvn=cmvn, archive=archive)]
    assert sorted(i for b in batches for i in b.ids) == ["g1", "g2", "g3", "g4"]
    for batch in batches:  # what the workers read is the archive's (no dither: equal, not close)
        for b, utt_id in enumerate(batch.ids):
            want = read[[u.id for u in corpus].index(utt_id)].feats
            assert torch.equal(batch.feats[b, : batch.feat_lens[b]], want)


def test_archive_entries_of_changed_audio_are_computed_again(corpus, tmp_path):
    compute_cmvn(corpus[:3], FEATURES, dump_dir=tmp_path / "feats")  # g4 not dumped
    write_audio(Path(corpus[1].audio), 1.5, seed=7)  # g2 rewritten after the dump
    shifted = replace(corpus[2], start=0.1, end=0.7, duration=0.6)  # g3, another segment
    utts = [corpus[0], corpus[1], shifted, corpus[3]]
    offsets, _ = FeatureArchive(tmp_path / "feats", FEATURES).rows(utts)
    assert offsets[0] >= 0 and (offsets[1:] == -1).all()
    dataset = ASRDataset(utts, None, features=FEATURES, archive=FeatureArchive(tmp_path / "feats", FEATURES))
    fresh = ASRDataset(utts, None, features=FEATURES)
    for i in (1, 2, 3):
        assert torch.equal(dataset[i].feats, fresh[i].feats)


def test_archive_errors_are_one_line(corpus, tmp_path):
    with pytest.raises(FeatureArchiveError, match="no feature archive") as e:
        FeatureArchive(tmp_path / "nowhere", FEATURES)
    compute_cmvn(corpus[:2], FEATURES, dump_dir=tmp_path / "feats")
    with pytest.raises(FeatureArchiveError, match=r"dumped with other features \(n_mels differ") as e:
        FeatureArchive(tmp_path / "feats", replace(FEATURES, n_mels=40))
    assert "\n" not in str(e.value)
    [data] = (tmp_path / "feats").glob("feats-*.f16")
    data.write_bytes(data.read_bytes()[:-2])
    with pytest.raises(FeatureArchiveError, match=r"feats-[0-9a-f]+\.f16: \d+ bytes, the index says \d+; dump"):
        FeatureArchive(tmp_path / "feats", FEATURES)
    index = json.loads((tmp_path / "feats" / "index.json").read_text())
    for broken in ({}, {**index, "features": 3}, {**index, "frames": "many"}, {**index, "utterances": []}):
        (tmp_path / "feats" / "index.json").write_text(json.dumps(broken))
        with pytest.raises(FeatureArchiveError, match="not a feature archive index"):
            FeatureArchive(tmp_path / "feats", FEATURES)


def test_a_failed_dump_leaves_the_previous_archive(corpus, tmp_path, monkeypatch):
    compute_cmvn(corpus[:2], FEATURES, dump_dir=tmp_path / "feats")
    before = {p.name: p.read_bytes() for p in (tmp_path / "feats").iterdir()}

    def broken(self, index, feats):
        raise OSError("disk full")

    monkeypatch.setattr("asr.feature_archive.ArchiveWriter.add", broken)
    with pytest.raises(OSError, match="disk full"):
        compute_cmvn(corpus[:4], FEATURES, dump_dir=tmp_path / "feats")
    assert {p.name: p.read_bytes() for p in (tmp_path / "feats").iterdir()} == before
    monkeypatch.undo()

    # the data of a new dump is written, but its index is not: the old index still reads the old data
    def no_index(*args, **kwargs):
        raise OSError("killed before the index")

    monkeypatch.setattr("asr.feature_archive.json.dump", no_index)
    with pytest.raises(OSError, match="killed before the index"):
        compute_cmvn(list(reversed(corpus[:2])), FEATURES, dump_dir=tmp_path / "feats")
    monkeypatch.undo()
    archive = FeatureArchive(tmp_path / "feats", FEATURES)
    fresh = ASRDataset(corpus[:2], None, features=FEATURES)
    read = ASRDataset(corpus[:2], None, features=FEATURES, archive=archive)
    for i in range(2):
        torch.testing.assert_close(read[i].feats, fresh[i].feats, atol=0.02, rtol=0.0)

    # a dump in which no utterance has usable audio commits nothing
    compute_cmvn(corpus[4:], FEATURES, dump_dir=tmp_path / "feats")
    assert FeatureArchive(tmp_path / "feats", FEATURES).rows(corpus[:2])[0].min() >= 0

    # a good new dump replaces the old one and leaves one data file
    compute_cmvn(corpus[:3], FEATURES, dump_dir=tmp_path / "feats")
    assert len(list((tmp_path / "feats").glob("feats-*.f16"))) == 1
    assert (FeatureArchive(tmp_path / "feats", FEATURES).rows(corpus[:3])[0] >= 0).all()
