"""Batches of utterances by padded duration: the duration-bucketed training sampler (one shard
per DDP rank) and the greedy cut that it and decoding share.

Randomness comes from (seed, epoch) only, so that a resumed run sees the same batches in the
same order (DESIGN.md "Nothing is lost").
"""
from __future__ import annotations

import logging
import math
from collections.abc import Iterator, Sequence

import numpy as np
from torch.utils.data import Sampler

__all__ = ["DurationBucketSampler", "greedy_batches", "longest_first"]

logger = logging.getLogger(__name__)


class DurationBucketSampler(Sampler[list[int]]):
    """Batches of dataset indices whose padded duration (longest x count) stays <= max_batch_seconds.

    Shuffled (training): the utterances are split into duration buckets (quantiles; `num_buckets`,
    fewer for a small set so that each bucket holds about 4 batches or more), shuffled within each
    bucket, cut greedily into batches, and the batches shuffled; all of it from a generator seeded
    by (seed, epoch). Not shuffled: sorted by duration, then cut.
    Steps and sharding: `group` batches (all ranks' micro-batches of one optimizer step; a
    multiple of num_replicas, num_replicas by default) make a step. All ranks build the same batch
    list; while its length is not a multiple of `group` the largest batch is split in two (so
    nothing is dropped and every step is whole); only when no batch can be split are the last
    (len % group) batches dropped (logged). The list depends on (seed, epoch, cap, group) and not
    on the number of ranks: with the same group, 1 rank or 8 see the same steps.
    Rank r takes batches r, r + W, r + 2W, ...: distinct, the same count on every rank.
    An utterance longer than the cap is left out. Reports go to rank 0's log only, once: the
    left-out utterances when built, the dropped batches for the first epoch that drops some.
    `set_epoch(epoch, start_batch)` selects the epoch and resumes after `start_batch` of this
    rank's batches; `len()` is what remains.
    """

    def __init__(
        self,
        durations: Sequence[float],
        *,
        max_batch_seconds: float,
        shuffle: bool = True,
        seed: int = 0,
        num_replicas: int = 1,
        rank: int = 0,
        num_buckets: int = 30,
        epoch: int = 0,
        start_batch: int = 0,
        ids: Sequence[str] | None = None,
        group: int | None = None,
    ):
        d = np.asarray(durations, dtype=np.float64)  # (N,) seconds
        if d.ndim != 1 or not np.all(np.isfinite(d)) or np.any(d <= 0):
            raise ValueError("durations must be a 1-D sequence of finite positive seconds")
        if not max_batch_seconds > 0:
            raise ValueError(f"max_batch_seconds must be positive, got {max_batch_seconds}")
        if not 0 <= rank < num_replicas:
            raise ValueError(f"rank {rank} outside 0..{num_replicas - 1}")
        if num_buckets < 1:
            raise ValueError(f"num_buckets must be >= 1, got {num_buckets}")
        group = num_replicas if group is None else group
        if group < 1 or group % num_replicas:
            raise ValueError(f"group {group} is not a positive multiple of num_replicas {num_replicas}")
        self.group = group
        self.durations = d
        self.max_batch_seconds = float(max_batch_seconds)
        self.shuffle, self.seed = shuffle, seed
        self.num_replicas, self.rank = num_replicas, rank
        self._kept = self._drop_too_long(ids)
        # At least ~4 full batches per bucket, so that the part-filled last batch of each bucket
        # stays a small share (a small set gets fewer buckets).
        batches_worth = int(d[self._kept].sum() / self.max_batch_seconds)
        self._buckets = _quantile_buckets(self._kept, d, max(1, min(num_buckets, batches_worth // 4)))
        self._cache: tuple[int, list[list[int]], int] | None = None  # (epoch, this rank's batches, all ranks')
        self._drop_reported = rank != 0  # report dropped batches once, on rank 0
        self.set_epoch(epoch, start_batch)

    def _drop_too_long(self, ids: Sequence[str] | None) -> np.ndarray:
        """Indices of the utterances that fit in a batch; the others are logged."""
        too_long = np.flatnonzero(self.durations > self.max_batch_seconds)
        if len(too_long) and self.rank == 0:
            names = [ids[i] if ids is not None else str(i) for i in too_long[:10]]
            logger.warning(
                "%d utterances longer than the batch cap (%.1f s) left out: %s%s",
                len(too_long), self.max_batch_seconds, ", ".join(names), " ..." if len(too_long) > 10 else "",
            )
        return np.flatnonzero(self.durations <= self.max_batch_seconds)

    def set_epoch(self, epoch: int, start_batch: int = 0) -> None:
        """Select the epoch (the order depends on (seed, epoch)) and resume after `start_batch`."""
        self.epoch = epoch
        self.set_start(start_batch)

    def set_start(self, start_batch: int) -> None:
        """Skip the first `start_batch` batches of this rank in the current epoch (0..len)."""
        total = len(self.rank_batches())
        if not 0 <= start_batch <= total:
            raise ValueError(f"start_batch {start_batch} outside 0..{total} (epoch {self.epoch}, rank {self.rank})")
        self.start_batch = start_batch

    def rank_batches(self) -> list[list[int]]:
        """All of this rank's batches of the current epoch, from the first."""
        if self._cache is None or self._cache[0] != self.epoch:
            batches = self._all_batches()
            self._cache = (self.epoch, batches[self.rank :: self.num_replicas], len(batches))
        return self._cache[1]

    def epoch_batches(self) -> int:
        """The batches of all ranks in the current epoch (a multiple of `group`)."""
        self.rank_batches()
        assert self._cache is not None
        return self._cache[2]

    def __iter__(self) -> Iterator[list[int]]:
        yield from self.rank_batches()[self.start_batch :]

    def __len__(self) -> int:
        return len(self.rank_batches()) - self.start_batch

    def _all_batches(self) -> list[list[int]]:
        """Every rank's batches of the epoch, in order, a multiple of num_replicas long."""
        cap, d = self.max_batch_seconds, self.durations
        if not self.shuffle:
            batches = greedy_batches(self._kept[np.argsort(d[self._kept], kind="stable")], d, cap)
        else:
            rng = np.random.default_rng([self.seed, self.epoch])
            batches = [b for bucket in self._buckets for b in greedy_batches(rng.permutation(bucket), d, cap)]
            batches = [batches[i] for i in rng.permutation(len(batches))]
        return self._divisible(batches)

    def _divisible(self, batches: list[list[int]]) -> list[list[int]]:
        """Split the largest batches until the count divides by `group`; drop the rest."""
        w = self.group
        for _ in range(-len(batches) % w):
            j = max(range(len(batches)), key=lambda k: len(batches[k]), default=None)
            if j is None or len(batches[j]) < 2:
                break
            half = len(batches[j]) // 2
            batches[j : j + 1] = [batches[j][:half], batches[j][half:]]
        extra = len(batches) % w
        if extra:
            if not self._drop_reported:
                lost = sum(len(b) for b in batches[-extra:])
                logger.warning(
                    "epoch %d: %d batches (%d utterances) dropped to make whole steps of %d batches "
                    "(at most %d per epoch; reported once)", self.epoch, extra, lost, w, w - 1,
                )
                self._drop_reported = True
            batches = batches[:-extra]
        return batches


def _quantile_buckets(indices: np.ndarray, durations: np.ndarray, num_buckets: int) -> list[np.ndarray]:
    """`indices` grouped by duration quantile (<= num_buckets non-empty groups, shortest first)."""
    if len(indices) == 0:
        return []
    d = durations[indices]
    edges = np.quantile(d, np.linspace(0, 1, num_buckets + 1)[1:-1])
    which = np.searchsorted(edges, d, side="right")  # bucket of each index
    return [indices[which == b] for b in range(num_buckets) if np.any(which == b)]



def greedy_batches(
    order: Sequence[int] | np.ndarray, durations: Sequence[float] | np.ndarray, max_seconds: float,
    *, max_count: int | None = None,
) -> list[list[int]]:
    """Cut `order` (indices into `durations`, seconds) into consecutive batches, each filled while
    its padded duration (longest x count) stays <= max_seconds and, with `max_count`, its count
    <= max_count. An utterance longer than max_seconds makes a batch alone."""
    order = np.asarray(order, dtype=np.int64)
    durations = np.asarray(durations, dtype=np.float64)
    most = math.inf if max_count is None else max_count
    batches: list[list[int]] = []
    batch: list[int] = []
    longest = 0.0
    for i, d in zip(order.tolist(), durations[order].tolist()):
        if batch and (len(batch) >= most or max(longest, d) * (len(batch) + 1) > max_seconds):
            batches.append(batch)
            batch, longest = [], 0.0
        batch.append(i)
        longest = max(longest, d)
    if batch:
        batches.append(batch)
    return batches


def longest_first(durations: Sequence[float]) -> list[int]:
    """Indices of `durations`, longest first; equal durations in index order."""
    return sorted(range(len(durations)), key=lambda i: -durations[i])
