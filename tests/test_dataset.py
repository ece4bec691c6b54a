"""asr.dataset: the Dataset (features, tokens, skipped utterances, dither) and collate."""
from __future__ import annotations

import torch
from data_helpers import FEATURES, RATE

from asr.corpora import speed_perturb
from asr.dataset import ASRDataset, Batch, Example, Skipped, collate, split_skipped
from asr.features import SpecAugmentConfig, fbank, num_frames
from asr.metrics import normalize_text


def test_dataset_examples(corpus, tokenizer):
    dataset = ASRDataset(corpus, tokenizer, features=FEATURES)
    for i, utt in enumerate(corpus[:4]):
        example = dataset[i]
        assert isinstance(example, Example) and example.id == utt.id
        assert example.feats.dtype == torch.float32
        assert example.feats.shape == (num_frames(round(utt.duration * RATE)), 80)
        assert example.tokens.dtype == torch.long
        assert example.tokens.tolist() == tokenizer.encode(normalize_text(utt.text))


def test_dataset_skips_bad_audio_with_reasons(corpus, tokenizer):
    dataset = ASRDataset(corpus, tokenizer, features=FEATURES, training=True)
    skipped = {s.id: s.reason for s in (dataset[i] for i in range(4, 8))}
    assert all(isinstance(dataset[i], Skipped) for i in range(4, 8))
    assert "missing.wav" in skipped["missing"] and "corrupt.wav" in skipped["corrupt"]
    assert skipped["wronglen"] == "decoded length 1.000 s differs from duration 3.000 s"
    assert skipped["tiny"].startswith("too short for one frame")


def test_dither_from_seed_epoch_index(corpus):
    def feats(training: bool, seed: int = 0, epoch: int = 0, index: int = 0) -> torch.Tensor:
        dataset = ASRDataset(corpus, None, features=FEATURES, training=training, seed=seed)
        dataset.set_epoch(epoch)
        return dataset[index].feats

    assert torch.equal(feats(True), feats(True))
    assert not torch.equal(feats(True), feats(True, epoch=1))
    assert not torch.equal(feats(True), feats(True, seed=1))
    from asr.audio import load_audio

    plain = fbank(load_audio(corpus[0].audio), FEATURES)
    assert torch.equal(feats(False), plain) and not torch.equal(feats(True), plain)


def test_dataset_is_compact_and_round_trips(corpus, tokenizer):
    """The dataset keeps numpy arrays, not a list of Utterance objects (forked workers would
    copy every object they touch), and gives the utterances back unchanged (speaker aside)."""
    utts = speed_perturb(corpus, (0.9, 1.1))
    dataset = ASRDataset(utts, tokenizer, features=FEATURES)
    assert [dataset.utterance(i) for i in range(len(utts))] == utts
    assert dataset.durations.tolist() == [u.duration for u in utts]
    lists = [v for v in vars(dataset).values() if isinstance(v, (list, tuple))]
    assert lists == []



# ---------------------------------------------------------------------------------- collate


def example(utt_id: str, frames: int, tokens: list[int], dim: int = 4) -> Example:
    return Example(utt_id, torch.randn(frames, dim) + 5, torch.tensor(tokens, dtype=torch.long))


def test_collate_shapes_and_padding():
    items = [example("a", 3, [2, 3]), Skipped("s", "why"), example("b", 5, []), example("c", 1, [4, 4, 4])]
    batch = collate(items)
    assert isinstance(batch, Batch) and Batch._fields == ("ids", "feats", "feat_lens", "tokens", "token_lens")
    assert batch.ids == ["a", "b", "c"]
    kept, skipped = split_skipped(items)
    assert [e.id for e in kept] == ["a", "b", "c"] and skipped == [Skipped("s", "why")]
    assert batch.feats.shape == (3, 5, 4) and batch.feats.dtype == torch.float32
    assert batch.feat_lens.tolist() == [3, 5, 1] and batch.token_lens.tolist() == [2, 0, 3]
    assert batch.tokens.tolist() == [[2, 3, -1], [-1, -1, -1], [4, 4, 4]]
    assert batch.feats[0, 3:].abs().sum() == 0 and batch.feats[2, 1:].abs().sum() == 0
    assert batch.feat_lens.dtype == batch.tokens.dtype == batch.token_lens.dtype == torch.long


def test_collate_all_skipped():
    batch = collate([Skipped("a", "r1"), Skipped("b", "r2")], feat_dim=80)
    assert batch.ids == [] and len(batch) == 5
    assert batch.feats.shape == (0, 0, 80) and batch.tokens.shape == (0, 0)
    assert batch.feat_lens.shape == batch.token_lens.shape == (0,)


def test_collate_specaug_within_lengths():
    examples = [example("a", 100, [2], dim=40), example("b", 60, [3], dim=40)]
    config = SpecAugmentConfig(freq_masks=2, freq_width=10, time_masks=4, max_time_width=10)
    plain = collate(examples)
    one = collate(examples, specaug=config, generator=torch.Generator().manual_seed(1))
    two = collate(examples, specaug=config, generator=torch.Generator().manual_seed(1))
    assert torch.equal(one.feats, two.feats)
    assert (one.feats[:, :, :] == 0).any()  # masked somewhere
    assert one.feats[1, 60:].abs().sum() == 0 and torch.equal(one.feats[1, 60:], plain.feats[1, 60:])
