"""What a training run is built from, before the loop: the experiment folder's config (completed
for the resume check), the tokenizer and CMVN statistics (given, or built in EXP by rank 0), the
feature archive, and the training targets' rate. Used by asr.trainer.train."""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from asr.checkpoint import TrainingError
from asr.config import ConfigError, from_dict, to_dict
from asr.distributed import Context
from asr.feature_archive import FeatureArchive, FeatureArchiveError
from asr.features import CMVNStats
from asr.loader import compute_cmvn
from asr.metrics import normalize_text
from asr.tokenizer import Tokenizer, load_tokenizer, train_tokenizer
from asr.train_config import ExperimentConfig

__all__ = ["check_mel_bins", "completed_config", "experiment_cmvn", "experiment_tokenizer", "feature_archive",
           "label_rate"]

log = logging.getLogger("asr.train")


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
