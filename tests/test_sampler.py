"""asr.sampler: DurationBucketSampler (coverage, cap, determinism, resumption, sharding over ranks) and
the greedy cut it shares with decoding; both give the batches recorded before asr/data.py was split."""
from __future__ import annotations

import hashlib
import json
import logging

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from asr.sampler import DurationBucketSampler, greedy_batches, longest_first


def librispeech_like(n: int, seed: int = 0) -> list[float]:
    """Durations in seconds, mean about 12 s, within 1-35 s."""
    rng = np.random.default_rng(seed)
    return np.clip(rng.gamma(6.0, 2.0, n), 1.0, 35.0).round(3).tolist()


def padded(batch: list[int], durations: list[float]) -> float:
    return max(durations[i] for i in batch) * len(batch)


def flat(batches: list[list[int]]) -> list[int]:
    return [i for b in batches for i in b]


DURATIONS = librispeech_like(2000)


@pytest.mark.parametrize("shuffle", [True, False])
def test_every_utterance_once_and_cap_respected(shuffle):
    sampler = DurationBucketSampler(DURATIONS, max_batch_seconds=120.0, shuffle=shuffle, seed=3)
    batches = list(sampler)
    assert sorted(flat(batches)) == list(range(len(DURATIONS)))
    assert all(padded(b, DURATIONS) <= 120.0 for b in batches)
    assert len(sampler) == len(batches)


def test_similar_lengths_together():
    sampler = DurationBucketSampler(DURATIONS, max_batch_seconds=200.0, seed=1)
    real = sum(DURATIONS)
    total = sum(padded(b, DURATIONS) for b in sampler)
    assert 1 - real / total < 0.05  # padding share


def test_deterministic_and_epoch_dependent():
    def order(epoch: int, seed: int = 7) -> list[list[int]]:
        sampler = DurationBucketSampler(DURATIONS, max_batch_seconds=100.0, seed=seed)
        sampler.set_epoch(epoch)
        return list(sampler)

    assert order(0) == order(0)
    assert order(1) == order(1)
    assert order(0) != order(1)
    assert order(0, seed=8) != order(0)
    # Not only the batch order: the groups themselves change from epoch to epoch.
    assert {tuple(sorted(b)) for b in order(0)} != {tuple(sorted(b)) for b in order(1)}


def test_unshuffled_is_sorted_by_duration():
    batches = list(DurationBucketSampler(DURATIONS, max_batch_seconds=100.0, shuffle=False))
    durations = [DURATIONS[i] for i in flat(batches)]
    assert durations == sorted(durations)


@pytest.mark.parametrize("start", [0, 1, 17])
def test_resume_gives_the_tail(start):
    full = list(DurationBucketSampler(DURATIONS, max_batch_seconds=100.0, seed=2, epoch=4))
    resumed = DurationBucketSampler(DURATIONS, max_batch_seconds=100.0, seed=2, epoch=4, start_batch=start)
    assert list(resumed) == full[start:]
    assert len(resumed) == len(full) - start
    later = DurationBucketSampler(DURATIONS, max_batch_seconds=100.0, seed=2)
    later.set_epoch(4, start)
    assert list(later) == full[start:]


def test_resume_at_the_end_and_past_it():
    sampler = DurationBucketSampler(DURATIONS, max_batch_seconds=100.0)
    n = len(sampler)
    sampler.set_start(n)
    assert list(sampler) == [] and len(sampler) == 0
    with pytest.raises(ValueError, match="start_batch"):
        sampler.set_start(n + 1)


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("n", [2000, 37, 5])
def test_shards_are_disjoint_equal_and_complete(world, n):
    durations = DURATIONS[:n]
    shards = [
        list(DurationBucketSampler(durations, max_batch_seconds=60.0, seed=5, num_replicas=world, rank=r))
        for r in range(world)
    ]
    assert len({len(s) for s in shards}) == 1
    used = [i for s in shards for i in flat(s)]
    assert len(used) == len(set(used))  # disjoint
    # Batches are split (not dropped) while one holds two utterances: nothing is lost here.
    assert sorted(used) == list(range(n))
    assert all(padded(b, durations) <= 60.0 for s in shards for b in s)


def test_drops_at_most_world_minus_one_batches_when_nothing_can_be_split(caplog):
    durations = [10.0] * 7  # one utterance per batch: 7 batches, nothing to split
    with caplog.at_level(logging.WARNING, logger="asr.sampler"):
        shards = [
            list(DurationBucketSampler(durations, max_batch_seconds=15.0, num_replicas=4, rank=r)) for r in range(4)
        ]
    assert [len(s) for s in shards] == [1, 1, 1, 1]
    assert len(set(flat([b for s in shards for b in s]))) == 4  # 3 batches dropped = W - 1
    assert "3 batches (3 utterances) dropped" in caplog.text


def test_longer_than_cap_filtered_and_logged(caplog):
    durations = [5.0, 50.0, 6.0, 70.0]
    with caplog.at_level(logging.WARNING, logger="asr.sampler"):
        sampler = DurationBucketSampler(durations, max_batch_seconds=20.0, ids=["a", "b", "c", "d"])
    assert sorted(flat(list(sampler))) == [0, 2]
    assert "2 utterances longer than the batch cap" in caplog.text and "b, d" in caplog.text


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"max_batch_seconds": 0.0}, "max_batch_seconds"),
        ({"max_batch_seconds": 10.0, "rank": 2, "num_replicas": 2}, "rank 2"),
        ({"max_batch_seconds": 10.0, "num_buckets": 0}, "num_buckets"),
    ],
)
def test_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        DurationBucketSampler([1.0, 2.0], **kwargs)


def test_bad_durations():
    with pytest.raises(ValueError, match="durations"):
        DurationBucketSampler([1.0, float("nan")], max_batch_seconds=10.0)


def test_empty():
    sampler = DurationBucketSampler([], max_batch_seconds=10.0, num_replicas=2, rank=1)
    assert list(sampler) == [] and len(sampler) == 0


@settings(max_examples=60, deadline=None)
@given(
    durations=st.lists(st.floats(0.1, 30.0), min_size=0, max_size=120),
    cap=st.floats(1.0, 120.0),
    world=st.integers(1, 4),
    seed=st.integers(0, 2**31),
    epoch=st.integers(0, 50),
    buckets=st.integers(1, 12),
    shuffle=st.booleans(),
)
def test_properties(durations, cap, world, seed, epoch, buckets, shuffle):
    def shard(rank: int) -> DurationBucketSampler:
        return DurationBucketSampler(
            durations, max_batch_seconds=cap, shuffle=shuffle, seed=seed, epoch=epoch,
            num_replicas=world, rank=rank, num_buckets=buckets,
        )

    shards = [list(shard(r)) for r in range(world)]
    fits = [i for i, d in enumerate(durations) if d <= cap]
    used = [i for s in shards for i in flat(s)]
    assert len({len(s) for s in shards}) == 1
    assert len(used) == len(set(used)) and set(used) <= set(fits)
    assert all(b and padded(b, durations) <= cap for s in shards for b in s)
    # Batches are dropped only when none can be split, i.e. all hold one utterance: <= W - 1 lost.
    missing = len(fits) - len(used)
    assert missing <= world - 1
    assert missing == 0 or all(len(b) == 1 for s in shards for b in s)
    assert shards[0] == list(shard(0))  # deterministic


# ---------------------------------------------------------------------------------------------
# The batches are those of the code before asr/data.py was split into modules (commit bf5fa68):
# sha256 (first 16 hex digits) of the JSON of every rank's batches, epoch after epoch.


def digest(batches: list) -> str:
    return hashlib.sha256(json.dumps(batches, separators=(",", ":")).encode()).hexdigest()[:16]


def recorded_durations(kind: str) -> list[float]:
    rng = np.random.default_rng(20261202)
    if kind == "gamma2000":
        return np.clip(rng.gamma(6.0, 2.0, 2000), 1.0, 35.0).round(3).tolist()
    if kind == "ties300":  # many equal durations: the stable sort decides their order
        return (rng.integers(2, 20, 300) / 2).tolist()
    assert kind == "uniform37"
    return rng.uniform(0.5, 30.0, 37).tolist()


# (durations, max_batch_seconds, shuffle, seed, epochs, world size, num_buckets) -> digest
SAMPLER_BATCHES = [
    (("gamma2000", 200.0, True, 0, (0, 1, 7), 1, 30), "6092109432188e3e"),
    (("gamma2000", 120.0, True, 3, (0, 5), 4, 30), "f983640a03131f79"),
    (("gamma2000", 60.0, False, 0, (0, 2), 2, 30), "7d3e68e74acccf18"),
    (("ties300", 40.0, True, 11, (0, 3), 3, 8), "5ee8c49ad84bd4e8"),
    (("ties300", 40.0, False, 11, (0,), 3, 8), "6096b62d9782e76b"),
    (("uniform37", 45.0, True, 5, (0, 1, 2), 2, 30), "633ffa0fdfd3b815"),
    (("uniform37", 25.0, True, 9, (4,), 4, 1), "7812a2cf00601cd1"),  # some longer than the cap
]


@pytest.mark.parametrize("setting, expected", SAMPLER_BATCHES, ids=[str(s) for s, _ in SAMPLER_BATCHES])
def test_training_batches_are_those_recorded(setting, expected):
    kind, cap, shuffle, seed, epochs, world, buckets = setting
    durations = recorded_durations(kind)
    batches = [
        list(DurationBucketSampler(durations, max_batch_seconds=cap, shuffle=shuffle, seed=seed, num_replicas=world,
                                   rank=rank, num_buckets=buckets, epoch=epoch))
        for epoch in epochs for rank in range(world)
    ]
    assert digest(batches) == expected


# (durations, batch_size, max_seconds) -> digest of asr.decode.duration_batches
DECODE_BATCHES = [
    (("gamma2000", 16, 200.0), "92571eab8a4a5ad6"),
    (("gamma2000", 1000, 300.0), "f13b73b5bf92cf6d"),
    (("ties300", 5, 30.0), "08338e6072b92bb3"),
    (("ties300", 1, 30.0), "7f54ad30d292c74f"),
    (("uniform37", 4, 20.0), "79949b2bd2ef62d8"),  # some longer than max_seconds: alone
]


def decoding_batches(durations: list[float], batch_size: int, max_seconds: float) -> list[list[int]]:
    """What asr decode batches (asr.decode.decode_manifest): longest first, at most batch_size
    per batch; before the split, asr.decode.duration_batches."""
    return greedy_batches(longest_first(durations), durations, max_seconds, max_count=batch_size)


@pytest.mark.parametrize("setting, expected", DECODE_BATCHES, ids=[str(s) for s, _ in DECODE_BATCHES])
def test_decoding_batches_are_those_recorded(setting, expected):
    kind, batch_size, max_seconds = setting
    durations = recorded_durations(kind)
    assert digest(decoding_batches(durations, batch_size, max_seconds)) == expected


def test_decoding_batches_small_cases():
    durations = [3.0, 1.0, 2.0, 3.0, 0.5, 9.0, 1.0]
    assert decoding_batches(durations, 2, 6.0) == [[5], [0, 3], [2, 1], [6, 4]]
    assert decoding_batches(durations, 10, 6.0) == [[5], [0, 3], [2, 1, 6], [4]]
    assert decoding_batches(durations, 0, 6.0) == [[5], [0], [3], [2], [1], [6], [4]]
    assert decoding_batches([], 4, 6.0) == []


def test_greedy_batches_keeps_the_given_order():
    durations = [1.0, 4.0, 2.0, 2.0, 7.0, 0.5]
    assert greedy_batches([5, 0, 2, 3, 1, 4], durations, 8.0) == [[5, 0, 2, 3], [1], [4]]
    assert greedy_batches([5, 0, 2, 3, 1, 4], durations, 8.0, max_count=2) == [[5, 0], [2, 3], [1], [4]]
    assert greedy_batches([4, 1], durations, 3.0) == [[4], [1]]  # each longer than the cap: alone
    assert greedy_batches(np.array([], dtype=np.int64), np.array(durations), 8.0) == []
    assert longest_first([1.0, 3.0, 2.0, 3.0]) == [1, 3, 2, 0]  # ties in index order
