"""asr train's experiment, before the loop: its config file (`ExperimentConfig`: the model, data,
tokenizer and training sections; `batch_plan`, its steps for a number of processes), the
experiment folder's config completed for the resume check, the tokenizer and CMVN statistics
(given, or built in EXP by rank 0), the feature archive, and the training targets' rate. Used by
asr.train_asr.train.

    config = load_experiment_config("conf/synth.yaml", ["training.lr=1e-3"])
    plan = batch_plan(config, world_size=8)   # micro-batches per process and step, their cap
"""
from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from asr.checkpoint import TrainingError
from asr.config import ConfigError, from_dict, load_config, to_dict
from asr.corpora import speed_perturb
from asr.distributed import Context
from asr.feature_archive import FeatureArchive, FeatureArchiveError
from asr.features import CMVNStats
from asr.loader import DataConfig, compute_cmvn, select_by_duration
from asr.metrics import normalize_text
from asr.model import ModelConfig
from asr.tokenizer import Tokenizer, load_tokenizer, train_tokenizer
from asr.train_config import BatchPlan, TrainingConfig, plan_batches

__all__ = ["ExperimentConfig", "TokenizerConfig", "batch_plan", "check_mel_bins", "completed_config",
           "experiment_cmvn", "experiment_tokenizer", "feature_archive", "label_rate", "load_experiment_config",
           "longest_example"]

log = logging.getLogger("asr.train")


# ---------------------------------------------------------------------------------------------
# the config file


@dataclass(frozen=True)
class TokenizerConfig:
    """The tokenizer `asr train` builds when none is given."""

    kind: Literal["char", "bpe", "unigram"] = "char"
    vocab_size: int | None = None  # sentencepiece pieces (bpe, unigram)


@dataclass(frozen=True)
class ExperimentConfig:
    """A whole `asr train` config file: conf/*.yaml."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)

    def __post_init__(self) -> None:
        # the model's frame shift is the frontend's (derived, never written twice)
        shift = self.data.features.frame_shift_ms
        if self.model.frame_shift_ms != shift:
            object.__setattr__(self, "model", dataclasses.replace(self.model, frame_shift_ms=shift))
        tc, cap = self.training, self.data.max_batch_seconds
        if tc.split_hours < 0 or not tc.split_seconds > 0:
            raise ValueError(f"training.split_hours ({tc.split_hours:g}) must be >= 0 and training.split_seconds "
                             f"({tc.split_seconds:g}) positive")
        if tc.accum_grad < 1:
            raise ValueError(f"training.accum_grad must be >= 1, got {tc.accum_grad}")
        if tc.attention_plots < 0:
            raise ValueError(f"training.attention_plots must be >= 0 (0: no attention pictures), got "
                             f"{tc.attention_plots}")
        if cap == "auto":
            if not tc.global_batch_seconds:
                raise ValueError("data.max_batch_seconds 'auto' needs training.global_batch_seconds (the step's size, "
                                 "which the micro-batch found on the device divides)")
        elif tc.global_batch_seconds:
            micro = tc.global_batch_seconds / cap
            if tc.accum_grad != 1:
                raise ValueError("set training.global_batch_seconds or training.accum_grad, not both (the "
                                 "accumulation follows from the global batch and the number of processes)")
            if micro < 1 or abs(micro - round(micro)) > 1e-6:
                raise ValueError(f"training.global_batch_seconds ({tc.global_batch_seconds:g}) must be a whole "
                                 f"multiple of data.max_batch_seconds ({cap:g})")


def batch_plan(config: ExperimentConfig, world_size: int, cap: float | None = None) -> BatchPlan:
    """The steps of `world_size` processes (asr.train_config.plan_batches) in padded seconds of
    audio: training.global_batch_seconds in micro-batches of data.max_batch_seconds, or of `cap`
    (what "auto" found)."""
    tc = config.training
    cap = config.data.max_batch_seconds if cap is None else cap
    if cap == "auto":
        raise ValueError("batch_plan: data.max_batch_seconds is 'auto': pass the cap found on the device")
    return plan_batches(tc.global_batch_seconds, cap, tc.accum_grad, world_size)


def longest_example(config: ExperimentConfig, tokenizer: Tokenizer, utts: list) -> tuple[float, int]:
    """(seconds, target tokens) of the longest training utterance (data.speed_perturb's slowed
    copies and data.min/max_duration counted) and the most tokens of any: the batch the device
    must hold for data.max_batch_seconds "auto"."""
    data = config.data
    if data.speed_perturb:
        utts = speed_perturb(utts, data.speed_perturb)
    utts = select_by_duration(utts, data.min_duration, data.max_duration, report=False)
    if not utts:
        raise TrainingError("no training utterance is within data.min_duration and data.max_duration")
    tokens = max(len(tokenizer.encode(normalize_text(u.text))) for u in utts)
    return max(u.duration for u in utts), tokens


def load_experiment_config(path: str, overrides: list[str]) -> ExperimentConfig:
    return load_config(ExperimentConfig, path, overrides)


# ---------------------------------------------------------------------------------------------
# the experiment folder


def completed_config(saved: dict[str, Any]) -> dict[str, Any]:
    """A saved EXP/config.yaml with the keys it lacks at their defaults (as it is, when it no
    longer reads as a config: the diff then names what changed)."""
    try:
        return to_dict(from_dict(ExperimentConfig, saved, source="config.yaml"))
    except ConfigError:
        return saved


def experiment_tokenizer(exp: Path, config: ExperimentConfig, utts: list, given: str | None,
                         ctx: Context) -> Tokenizer:
    """The given tokenizer, or EXP/tokenizer built by rank 0 from the training text."""
    if given:
        return load_tokenizer(given)
    folder = exp / "tokenizer"
    if ctx.main and not (folder / "tokenizer.json").is_file():
        tc = config.tokenizer
        texts = [normalize_text(u.text) for u in utts]
        train_tokenizer(texts, tc.kind, tc.vocab_size).save(folder)
        log.info("built a %s tokenizer in %s", tc.kind, folder)
    ctx.barrier()
    return load_tokenizer(folder)


def experiment_cmvn(exp: Path, config: ExperimentConfig, utts: list, given: str | None, ctx: Context) -> CMVNStats:
    """The given CMVN statistics, or EXP/cmvn.json computed by rank 0."""
    path: str | Path
    if given:
        path = given
    else:
        path = exp / "cmvn.json"
        if ctx.main and not path.is_file():
            log.info("computing CMVN statistics over %d utterances", len(utts))
            computed = compute_cmvn(utts, config.data.features, num_workers=config.data.num_workers)
            if computed.count == 0:
                raise TrainingError(f"none of the {len(utts)} training utterances has usable audio "
                                    "(see the warnings above)")
            computed.save(path)
        ctx.barrier()
    stats = CMVNStats.load(path)
    check_mel_bins(config, stats.dim, str(path))
    return stats


def feature_archive(folder: str | None, config: ExperimentConfig) -> FeatureArchive | None:
    if folder is None:
        return None
    if config.data.frontend == "device":
        raise TrainingError(f"data.frontend 'device' computes the features from the audio: it cannot read the "
                            f"feature archive --feats-dir {folder} (drop one of the two)")
    try:
        return FeatureArchive(folder, config.data.features)
    except FeatureArchiveError as e:
        raise TrainingError(str(e)) from None


def check_mel_bins(config: ExperimentConfig, cmvn_dim: int | None, source: str) -> None:
    """One line naming the three numbers when the frontend, the model and the CMVN statistics
    disagree on the mel bins (otherwise a shape error deep in a loader worker)."""
    features, model = config.data.features.n_mels, config.model.n_mels
    if not features == model == cmvn_dim:
        raise TrainingError(f"mel bins disagree: data.features.n_mels = {features}, model.n_mels = {model}, "
                            f"{cmvn_dim} in the CMVN statistics {source}")


def label_rate(tokenizer: Tokenizer, utts: list) -> float:
    """Mean target tokens per second of the training set; logs symbols the tokenizer maps to unk."""
    texts = [normalize_text(u.text) for u in utts]
    unknown = tokenizer.count_unknown(texts)
    if unknown:
        top = ", ".join(f"{sym!r} x{n}" for sym, n in unknown.most_common(10))
        log.warning("%d symbols of the training text map to unk: %s", sum(unknown.values()), top)
    seconds = sum(u.duration for u in utts)
    return sum(len(tokenizer.encode(t)) for t in texts) / max(seconds, 1e-9)
