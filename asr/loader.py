"""The loaders: `make_loader` (one rank's training or validation Batches for a whole run) and
`compute_cmvn` (one pass over a manifest for the global CMVN statistics, dumping the features
on request), with the `data` section of a training config.

Each skipped utterance is recorded in `ASRDataLoader.skipped` and logged once per process (id and
reason), never raised out of the loader. Randomness (shuffling, dither, SpecAugment) is derived
from (seed, epoch, index or batch) only, so that a resumed run sees the same data in the same
order (DESIGN.md "Nothing is lost").
"""
from __future__ import annotations

import gc
import logging
import math
import os
import zlib
from collections.abc import Iterator, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal, NamedTuple

import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from asr.augment import AugmentConfig
from asr.corpora import speed_perturb
from asr.dataset import ASRDataset, Batch, Example, Skipped, collate, collate_waves, derive_seed, split_skipped
from asr.feature_archive import ArchiveWriter, FeatureArchive
from asr.features import CMVNStats, FeatureConfig, GlobalCMVN, SpecAugmentConfig
from asr.manifest import Utterance
from asr.sampler import DurationBucketSampler
from asr.tokenizer import Tokenizer

__all__ = ["AUTO_CPU_SECONDS", "ASRDataLoader", "DataConfig", "compute_cmvn", "make_loader", "select_by_duration"]

logger = logging.getLogger(__name__)

AUTO_CPU_SECONDS = 200.0  # data.max_batch_seconds "auto" where there is no GPU to probe: the default cap


@dataclass(frozen=True)
class DataConfig:
    """Batching and augmentation knobs (the `data` section of a training config)."""

    # padded seconds per batch and rank (longest x count); "auto" (training, with a global batch): the
    # largest micro-batch the training GPU holds for the longest utterances, probed when a run starts
    # and kept for its resumes (asr.train_config.auto_micro_batch); AUTO_CPU_SECONDS on other devices;
    # either lowered to divide training.global_batch_seconds per process
    max_batch_seconds: float | Literal["auto"] = 200.0
    num_buckets: int = 30  # duration buckets of the sampler
    num_workers: int = 2  # loader processes (0: load in the training process)
    min_duration: float = 0.0  # shorter utterances left out (logged), seconds
    max_duration: float | None = None  # longer ones left out (logged); None: only the batch cap
    speed_perturb: list[float] | None = None  # e.g. [0.9, 1.1]: extra copies in training
    features: FeatureConfig = field(default_factory=FeatureConfig)
    specaug: SpecAugmentConfig = field(default_factory=SpecAugmentConfig)  # training only
    augment: AugmentConfig = field(default_factory=AugmentConfig)  # training only: noise, reverberation,
    # spectral warping per utterance (asr.augment); all off by default
    # where fbank, CMVN and SpecAugment run: "cpu" in the loader workers (Batches of features), or
    # "device" on the training device in the training step (workers give WaveBatches of waveforms,
    # asr.device_frontend computes the features); "device" excludes a feature archive
    frontend: Literal["cpu", "device"] = "cpu"


def select_by_duration(
    utts: Sequence[Utterance], min_duration: float = 0.0, max_duration: float | None = None, *, report: bool = True
) -> list[Utterance]:
    """The utterances with min_duration <= duration <= max_duration (None: no upper bound);
    the others are left out, and logged (count and first ids) when `report`."""
    hi = math.inf if max_duration is None else max_duration
    kept = [u for u in utts if min_duration <= u.duration <= hi]
    if report and len(kept) < len(utts):
        out = [u.id for u in utts if not min_duration <= u.duration <= hi]
        logger.warning(
            "%d utterances outside %.2f-%s s left out: %s%s",
            len(out), min_duration, max_duration, ", ".join(out[:10]), " ..." if len(out) > 10 else "",
        )
    return kept


# ---------------------------------------------------------------------------------------------
# Training and validation batches


class _BatchKey(NamedTuple):
    """What the loader's sampler yields and its workers receive: a batch of one epoch."""

    epoch: int
    indices: list[int]  # dataset indices


class _Collated(NamedTuple):
    """What a loader worker returns: the Batch and the (id, reason) of what it left out."""

    batch: Batch
    skipped: list[tuple[str, str]]


class _EpochBatches(Sampler[_BatchKey]):
    """The batches of a DurationBucketSampler tagged with its epoch, so that persistent workers
    (which never see the main process's set_epoch) derive the epoch's randomness from the key."""

    def __init__(self, batches: DurationBucketSampler):
        self.batches = batches

    def __iter__(self) -> Iterator[_BatchKey]:
        epoch = self.batches.epoch
        return (_BatchKey(epoch, b) for b in self.batches)

    def __len__(self) -> int:
        return len(self.batches)


class _BatchLoading(Dataset):
    """_BatchKey -> _Collated: loads the utterances of a batch (dither of its epoch) and collates
    them, with SpecAugment seeded by (seed, epoch, the batch's ids): the batch is itself a
    function of (seed, epoch, batch index), so a resumed run replays the same masks.
    With frontend "device", loads and collates their waveforms alone, into a WaveBatch of the
    epoch (the training step adds fbank, dither, CMVN and SpecAugment: asr.device_frontend)."""

    def __init__(self, dataset: ASRDataset, specaug: SpecAugmentConfig | None, seed: int, feat_dim: int,
                 frontend: str = "cpu"):
        if frontend not in ("cpu", "device"):
            raise ValueError(f"data.frontend must be 'cpu' or 'device', got {frontend!r}")
        if frontend == "device" and dataset.archive is not None:
            raise ValueError("data.frontend 'device' computes features from the audio: it cannot read a feature "
                             "archive (drop one of the two)")
        self.dataset, self.specaug, self.seed, self.feat_dim = dataset, specaug, seed, feat_dim
        self.waveforms = frontend == "device"

    def __getitem__(self, key: _BatchKey) -> _Collated:
        if self.waveforms:
            kept, skipped = split_skipped(self.dataset.waveform(i, key.epoch) for i in key.indices)
            return _Collated(collate_waves(kept, epoch=key.epoch), [(s.id, s.reason) for s in skipped])
        kept, skipped = split_skipped(self.dataset.get(i, key.epoch) for i in key.indices)
        generator = None
        if self.specaug is not None:
            ids = "\n".join(self.dataset.utt_id(i) for i in key.indices)
            generator = torch.Generator().manual_seed(derive_seed(self.seed, key.epoch, zlib.crc32(ids.encode())))
        batch = collate(kept, specaug=self.specaug, generator=generator, feat_dim=self.feat_dim)
        return _Collated(batch, [(s.id, s.reason) for s in skipped])

    def __len__(self) -> int:
        return len(self.dataset)


def _identity(item: Any) -> Any:
    return item


def _worker_init(worker_id: int) -> None:
    """Freeze the objects a forked worker inherits out of the garbage collector's sight: a full
    collection would otherwise write to every one of them (the parent's manifest lists, ...) and
    copy their pages into the worker. O(1): the collector's lists are spliced, not walked."""
    gc.freeze()


class ASRDataLoader(DataLoader):
    """The loader of `make_loader`, built once for a whole run: Batches of this rank for the epoch
    and resume point chosen by `set_epoch`. Worker processes (config.num_workers) persist from
    one epoch to the next, and start on an epoch when it is iterated. Each skipped utterance is
    recorded in `skipped` {id: reason} and logged the first time this process sees it (with id and
    reason)."""

    _reported: ClassVar[set[str]] = set()  # ids already logged in this process, over all loaders

    def __init__(self, dataset: _BatchLoading, batches: DurationBucketSampler, *, num_workers: int, pin_memory: bool):
        super().__init__(
            dataset,
            sampler=_EpochBatches(batches),
            batch_size=None,  # each key is a whole batch, collated in the worker
            collate_fn=_identity,
            num_workers=num_workers,
            persistent_workers=num_workers > 0,
            worker_init_fn=_worker_init if num_workers > 0 else None,
            pin_memory=pin_memory,
            # Its own generator: starting an iterator then draws no number from the global RNG
            # (dropout's), so a resumed run consumes that RNG exactly as an uninterrupted one.
            generator=torch.Generator().manual_seed(0),
        )
        self.batches = batches
        self.skipped: dict[str, str] = {}

    @property
    def epoch(self) -> int:
        return self.batches.epoch

    def set_epoch(self, epoch: int, start_batch: int = 0) -> None:
        """Select the epoch (its order, dither and SpecAugment) and skip this rank's first
        `start_batch` batches of it (0..number of batches; to resume mid-epoch)."""
        self.batches.set_epoch(epoch, start_batch)

    def __len__(self) -> int:
        """The batches left in this rank's epoch after `start_batch`."""
        return len(self.batches)

    def __iter__(self) -> Iterator[Batch]:
        """The epoch's batches; the worker processes start loading the first ones at this call
        (not at the first `next`), so an iterator made ahead of time (the trainer makes the next
        epoch's during validation) has them ready."""
        return self._reporting(super().__iter__())

    def _reporting(self, collated: Iterator[_Collated]) -> Iterator[Batch]:
        for batch, skipped in collated:
            for utt_id, reason in skipped:
                self.skipped[utt_id] = reason
                if utt_id not in self._reported:
                    self._reported.add(utt_id)
                    logger.warning("%s: %s; skipped", utt_id, reason)
            yield batch


def make_loader(
    utts: Sequence[Utterance],
    tokenizer: Tokenizer | None,
    config: DataConfig,
    *,
    training: bool,
    cmvn: GlobalCMVN | None = None,
    seed: int = 0,
    rank: int = 0,
    world_size: int = 1,
    pin_memory: bool = False,
    archive: FeatureArchive | None = None,
    step_group: int | None = None,
) -> ASRDataLoader:
    """The loader of one rank for the whole run, at epoch 0 from its first batch; choose the
    epoch (and a resume point) with `loader.set_epoch(epoch, start_batch)` before iterating.

    Training: speed perturbation (config.speed_perturb; copies already in `utts` are not added
    again), shuffled buckets, dither and SpecAugment, all derived from (seed, epoch, index /
    batch). Otherwise: batches sorted by duration, no augmentation. Utterances outside
    [min_duration, max_duration] or longer than the batch cap are left out (logged once, on
    rank 0). With `archive`, features it holds are read from it (see ASRDataset). `step_group`:
    the micro-batches of one optimizer step over all ranks (see DurationBucketSampler). The cap is
    a number here: a run resolves "auto" (asr.train_asr, asr.trainer) and passes its value."""
    if config.max_batch_seconds == "auto":
        raise ValueError("make_loader: data.max_batch_seconds 'auto' is the trainer's to resolve; pass the number")
    if training and config.speed_perturb:
        utts = speed_perturb(utts, config.speed_perturb)
    utts = select_by_duration(utts, config.min_duration, config.max_duration, report=rank == 0)
    dataset = ASRDataset(utts, tokenizer, features=config.features, cmvn=cmvn, training=training, seed=seed,
                         archive=archive, augment=config.augment if training else None)
    batches = DurationBucketSampler(
        dataset.durations,
        max_batch_seconds=config.max_batch_seconds,
        shuffle=training,
        seed=seed,
        num_replicas=world_size,
        rank=rank,
        num_buckets=config.num_buckets,
        ids=[u.id for u in utts],
        group=step_group,
    )
    specaug = config.specaug if training else None
    loading = _BatchLoading(dataset, specaug, seed, config.features.n_mels, config.frontend)
    return ASRDataLoader(loading, batches, num_workers=config.num_workers, pin_memory=pin_memory)


# ---------------------------------------------------------------------------------------------
# CMVN statistics


# Utterances a loader worker of compute_cmvn hands over at a time, their features as numpy arrays,
# pickled by value through the worker's pipe: a tensor would go as a shared-memory file descriptor,
# a connection and handshake each in the main process, which would then bound the whole pass.
_CMVN_CHUNK = 32


def _features_as_numpy(items: list[Example | Skipped]) -> list[Example | Skipped]:
    return [item._replace(feats=item.feats.numpy()) if isinstance(item, Example) else item for item in items]


def compute_cmvn(utts: Sequence[Utterance], features: FeatureConfig, *, num_workers: int = 0,
                 dump_dir: str | os.PathLike | None = None) -> CMVNStats:
    """Global CMVN statistics of the fbank features (no dither) of `utts`. An utterance that
    cannot be used (see ASRDataset) is logged with its id and reason, skipped and counted in the
    summary line; `num_workers` processes decode in parallel. With `dump_dir`, the same features
    are also written there as a FeatureArchive (float16), for training to read instead of decoding
    and computing them every epoch."""
    dataset = ASRDataset(utts, None, features=features)
    chunks = [range(i, min(i + _CMVN_CHUNK, len(utts))) for i in range(0, len(utts), _CMVN_CHUNK)]
    loader = DataLoader(dataset, batch_sampler=chunks, num_workers=num_workers, collate_fn=_features_as_numpy)
    stats, skipped = CMVNStats(), 0
    writer = ArchiveWriter(dump_dir, features) if dump_dir is not None else None
    with writer or nullcontext():
        for indices, items in zip(chunks, loader):
            for index, item in zip(indices, items):
                if isinstance(item, Skipped):
                    logger.warning("%s: %s; skipped", item.id, item.reason)
                    skipped += 1
                else:
                    feats = torch.from_numpy(item.feats)
                    stats.add(feats)
                    if writer:
                        writer.add(dataset.utterance(index), feats)
    logger.info("cmvn: %d utterances, %d frames, %d skipped", len(utts) - skipped, int(stats.count), skipped)
    return stats
