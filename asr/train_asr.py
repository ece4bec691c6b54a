"""`asr train`: speech recognition trained by the task-neutral loop (asr.trainer).

    train(config, train_manifest, valid_manifest, exp_dir)

hands asr.trainer.run_experiment a `SpeechExperiment`, whose `build` reads like its table of
contents: read the manifests, check or save EXP/config.yaml, take the tokenizer and the CMVN
statistics (given, or built in EXP: asr.train_setup), build the model and its run, counted in
seconds of audio (asr.asr_task.AUDIO). Its `parts` are the loop's: the task (asr.asr_task.ASRTask,
with a fixed subset of the valid set to decode and the utterances whose attention pictures are
drawn), the loaders (asr.loader: micro-batches of the run's batch plan), and, for the first epochs
of the length curriculum (training.split_hours, asr.curriculum), a loader of the utterances cut
into pieces. The model file it saves is DESIGN.md's (config, frontend with CMVN, tokenizer).
"""
from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any

import torch

from asr.asr_task import AUDIO, ASRTask
from asr.checkpoint import check_or_save_config, model_file
from asr.config import to_dict
from asr.corpora import speed_perturb
from asr.curriculum import split_epochs, split_utterances
from asr.device_frontend import DeviceFrontend
from asr.distributed import Context
from asr.feature_archive import FeatureArchive
from asr.features import GlobalCMVN
from asr.loader import make_loader
from asr.manifest import read_manifest
from asr.model import build_model
from asr.train_setup import (
    ExperimentConfig,
    batch_plan,
    completed_config,
    experiment_cmvn,
    experiment_tokenizer,
    feature_archive,
    label_rate,
)
from asr.trainer import Loaders, Run, State, make_run, run_experiment

__all__ = ["SpeechExperiment", "train"]

log = logging.getLogger("asr.train")


def train(config: ExperimentConfig, train_manifest: str, valid_manifest: str, exp_dir: str | Path, *,
          tokenizer_dir: str | None = None, cmvn_path: str | None = None, feats_dir: str | None = None) -> Path:
    """Train into `exp_dir` (resuming from its newest checkpoint); returns the final model file.

    Whatever stops it (SIGKILL, SIGTERM, a full disk, a lost rank), running the same call again
    resumes from the last checkpoint and ends with the same weights as an uninterrupted run.
    `feats_dir`: a FeatureArchive of training features (`compute_cmvn(..., dump_dir=...)`)."""
    return run_experiment(SpeechExperiment(config, train_manifest, valid_manifest, Path(exp_dir),
                                           tokenizer_dir=tokenizer_dir, cmvn_path=cmvn_path, feats_dir=feats_dir))


class SpeechExperiment:
    """asr train's experiment (asr.trainer.Experiment). `build` keeps what it reads and makes
    (the utterances, the tokenizer, CMVN, the config with the vocabulary filled in) for `parts`
    and the model file."""

    def __init__(self, config: ExperimentConfig, train_manifest: str, valid_manifest: str, exp: Path, *,
                 tokenizer_dir: str | None = None, cmvn_path: str | None = None, feats_dir: str | None = None):
        self.config, self.training, self.exp = config, config.training, exp
        self.manifests = (train_manifest, valid_manifest)
        self.tokenizer_dir, self.cmvn_path, self.feats_dir = tokenizer_dir, cmvn_path, feats_dir

    def build(self, ctx: Context) -> Run:
        config, exp = self.config, self.exp
        self.train_utts, self.valid_utts = read_manifest(self.manifests[0]), read_manifest(self.manifests[1])
        check_or_save_config(exp, to_dict(config), save=ctx.main, complete=completed_config)
        ctx.barrier()
        self.tokenizer = experiment_tokenizer(exp, config, self.train_utts, self.tokenizer_dir, ctx)
        self.cmvn_stats = experiment_cmvn(exp, config, self.train_utts, self.cmvn_path, ctx)
        self.cmvn = GlobalCMVN(self.cmvn_stats)
        rate = label_rate(self.tokenizer, self.train_utts)
        torch.manual_seed(config.training.seed)
        self.config = dataclasses.replace(config, model=dataclasses.replace(config.model,
                                                                            vocab_size=self.tokenizer.vocab_size))
        model = build_model(self.config.model, tokens_per_second=rate)
        return make_run(self.training, model, exp, ctx, batch_plan(self.config, ctx.world_size), unit=AUDIO,
                        envelope=self.envelope, final_name="model_last.pt")

    def envelope(self, model: torch.nn.Module) -> dict[str, Any]:
        """The model file (DESIGN.md) of `model`'s weights."""
        frontend = {"features": to_dict(self.config.data.features), "cmvn": self.cmvn_stats.to_dict()}
        return model_file(model=to_dict(self.config.model), frontend=frontend, tokenizer=self.tokenizer.to_dict(),
                          state_dict=model.state_dict())

    def parts(self, run: Run, state: State) -> tuple[ASRTask, Loaders]:
        archive = feature_archive(self.feats_dir, self.config)
        task = self._task(run)
        train_loader = self._loader(run, self.train_utts, training=True, archive=archive)
        valid_loader = self._loader(run, self.valid_utts, training=False)
        return task, Loaders(train_loader, valid_loader, *(self._split_loader(run, state, archive) or ()))

    def _loader(self, run: Run, utts: list, *, training: bool, sharded: bool = True,
                archive: FeatureArchive | None = None, workers: int | None = None):
        """A loader built once (persistent workers: data.num_workers, or `workers`); `set_epoch`
        selects the epoch and position. Training: micro-batches of the run's plan, whole steps of them."""
        ctx, data, group = run.ctx, self.config.data, None
        if workers is not None:
            data = dataclasses.replace(data, num_workers=workers)
        if training:
            data = dataclasses.replace(data, max_batch_seconds=run.plan.micro_batch)
            group = run.plan.group
        return make_loader(utts, self.tokenizer, data, training=training, cmvn=self.cmvn,
                           seed=self.training.seed, rank=ctx.rank if sharded else 0,
                           world_size=ctx.world_size if sharded else 1, pin_memory=ctx.device.type == "cuda",
                           archive=archive, step_group=group)

    def _split_loader(self, run: Run, state: State, archive: FeatureArchive | None) -> tuple[Any, int] | None:
        """The length curriculum (training.split_hours): the loader of the training utterances cut
        into pieces, and for how many epochs (asr.curriculum.split_epochs); None when there are no
        such epochs left or no utterance is long enough to split. The hours are those an epoch
        trains on (data.speed_perturb's copies counted). The pieces' features come from their audio
        (an archive holds whole utterances)."""
        tc, speeds, utts = self.training, self.config.data.speed_perturb, self.train_utts
        epochs = split_epochs(speed_perturb(utts, speeds) if speeds else utts, tc.split_hours)
        if state.epoch >= epochs:
            return None
        pieces = split_utterances(utts, tc.split_seconds)
        if len(pieces) == len(utts):
            return None
        log.info("epochs 1-%d: the %d training utterances as %d pieces of about %g s (training.split_hours %g); "
                 "whole utterances from epoch %d", epochs, len(utts), len(pieces), tc.split_seconds,
                 tc.split_hours, epochs + 1)
        return self._loader(run, pieces, training=True, archive=archive), epochs

    def _task(self, run: Run) -> ASRTask:
        """The task, with an evenly spaced, fixed subset of the valid set to decode on rank 0, and
        the first training.attention_plots of it to draw (evenly spaced ones of their own when the
        subset is smaller), read in this process (two utterances are not worth worker processes);
        the plateau check after training.plateau_check_hours of audio."""
        tc, data, main = self.training, self.config.data, run.ctx.main
        subset = _spaced(self.valid_utts, tc.valid_decode_utts) if main else []
        drawn = []
        if main and tc.attention_plots:
            drawn = subset if len(subset) >= tc.attention_plots else _spaced(self.valid_utts, tc.attention_plots)
            drawn = drawn[:tc.attention_plots]
        loader = self._loader(run, subset, training=False, sharded=False) if subset else None
        pictures = self._loader(run, drawn, training=False, sharded=False, workers=0) if drawn else None
        frontend = (DeviceFrontend(data.features, self.cmvn, data.specaug, seed=tc.seed)
                    if data.frontend == "device" else None)
        return ASRTask(run.model, self.tokenizer, data.features, self.config.model.ctc_weight, run.ctx.device,
                       decode_loader=loader, decode_text={u.id: u.text for u in subset}, frontend=frontend,
                       picture_loader=pictures, check_after=tc.plateau_check_hours * 3600)


def _spaced(utts: list, n: int) -> list:
    """`n` utterances evenly spaced in id order (all when there are fewer; none for n = 0)."""
    if n <= 0:
        return []
    utts = sorted(utts, key=lambda u: u.id)
    return utts[::max(1, len(utts) // n)][:n]
