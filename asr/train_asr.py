"""`asr train`: speech recognition trained by the task-neutral loop (asr.trainer).

    train(config, train_manifest, valid_manifest, exp_dir)

hands asr.trainer.run_experiment a `SpeechExperiment`, whose `build` reads like its table of
contents: read the manifests, check or save EXP/config.yaml, take the tokenizer and the CMVN
statistics (given, or built in EXP: asr.train_setup), build the model (with training.init_from,
another model's weights: asr.init_from) and its run, counted in
seconds of audio (asr.asr_task.AUDIO), its micro-batch data.max_batch_seconds or, for "auto", the
largest a GPU holds (`probe_micro_batch`; AUTO_CPU_SECONDS elsewhere). Its `parts` are the loop's:
the task (asr.asr_task.ASRTask, with a fixed subset of the valid set to decode and the utterances
whose attention pictures are drawn), the loaders (asr.loader: micro-batches of the run's batch
plan), and, for the first epochs of the length curriculum (training.split_hours, asr.curriculum), a
loader of the utterances cut into pieces. The model file it saves is DESIGN.md's (config, frontend
with CMVN, tokenizer).
"""
from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any

import torch

from asr.asr_task import AUDIO, ASRTask
from asr.checkpoint import TrainingError, check_or_save_config, model_file
from asr.config import to_dict
from asr.corpora import speed_perturb
from asr.curriculum import split_epochs, split_utterances
from asr.device_frontend import DeviceFrontend
from asr.distributed import Context
from asr.feature_archive import FeatureArchive
from asr.features import GlobalCMVN
from asr.init_from import init_from
from asr.loader import AUTO_CPU_SECONDS, make_loader
from asr.manifest import read_manifest
from asr.model import build_model
from asr.tokens import FIRST_TOKEN
from asr.train_config import auto_micro_batch, dividing_cap
from asr.train_setup import (
    ExperimentConfig,
    batch_plan,
    completed_config,
    experiment_cmvn,
    experiment_tokenizer,
    feature_archive,
    label_rate,
    longest_example,
)
from asr.trainer import AutoMicroBatch, Loaders, Run, State, make_run, run_experiment

__all__ = ["SpeechExperiment", "probe_micro_batch", "train"]

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
        if self.training.init_from:  # a resumed run's checkpoint replaces these weights
            try:
                log.info(init_from(model, self.training.init_from, self.training.init_modules, self.tokenizer))
            except ValueError as e:
                raise TrainingError(str(e)) from None
        plan: Any = batch_plan(self.config, ctx.world_size) if config.data.max_batch_seconds != "auto" else (
            AutoMicroBatch(probe=self._probe, plan=lambda cap: batch_plan(self.config, ctx.world_size, cap)))
        return make_run(self.training, model, exp, ctx, plan, unit=AUDIO, envelope=self.envelope,
                        final_name="model_last.pt")

    def _probe(self, run: Run) -> float:
        """data.max_batch_seconds "auto": this process's micro-batch, probed on a GPU, else
        AUTO_CPU_SECONDS; either lowered to divide the step."""
        global_batch, world = self.training.global_batch_seconds, run.ctx.world_size
        longest, tokens = longest_example(self.config, self.tokenizer, self.train_utts)
        if run.ctx.device.type != "cuda":
            cap = dividing_cap(AUTO_CPU_SECONDS, global_batch, world)
            log.info("data.max_batch_seconds auto: no GPU to probe on %s: AUTO_CPU_SECONDS (%g s) lowered to divide "
                     "the step", run.ctx.device, AUTO_CPU_SECONDS)
            if cap < longest:
                raise TrainingError(f"data.max_batch_seconds auto: {cap:g} s on {run.ctx.device} is less than the "
                                    f"longest training utterance ({longest:.1f} s); set data.max_batch_seconds by hand")
            return cap
        log.info("data.max_batch_seconds auto: probing %s with batches of the longest utterance (%.1f s, %d tokens)",
                 run.ctx.device, longest, tokens)
        try:
            return probe_micro_batch(run, longest=longest, tokens=tokens, global_batch=global_batch)
        except ValueError as e:
            raise TrainingError(f"data.max_batch_seconds auto: {e} (seconds); set a smaller data.max_duration, or "
                                "data.max_batch_seconds by hand") from None

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
        else:  # the config's cap, or the one "auto" found
            data = dataclasses.replace(data, max_batch_seconds=run.plan.cap)
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
        frontend = (DeviceFrontend(data.features, self.cmvn, data.specaug, seed=tc.seed, augment=data.augment)
                    if data.frontend == "device" else None)
        return ASRTask(run.model, self.tokenizer, data.features, self.config.model.ctc_weight, run.ctx.device,
                       decode_loader=loader, decode_text={u.id: u.text for u in subset}, frontend=frontend,
                       picture_loader=pictures, check_after=tc.plateau_check_hours * 3600)


def probe_micro_batch(run: Run, *, longest: float, tokens: int, global_batch: float) -> float:
    """The micro-batch cap (asr.train_config.auto_micro_batch) of run.ctx.device (CUDA): a forward
    and backward of the run's model under its precision, on n utterances of `longest` seconds and
    `tokens` targets each (random features), fits when it does not run out of memory. Torch's random
    states are left as they were (the probe draws dropout); the gradients it made are dropped."""
    device, model = run.ctx.device, run.model
    n_mels, vocab = model.config.n_mels, model.config.vocab_size
    frames = int(longest * 1000 / model.config.frame_shift_ms)

    def step(n: int) -> None:
        feats = torch.randn(n, frames, n_mels, device=device)
        targets = torch.randint(FIRST_TOKEN, vocab - 1, (n, tokens), device=device)
        with run.autocast():
            out = model(feats, torch.full((n,), frames), targets, torch.full((n,), tokens))
        out.loss.backward()
        torch.cuda.synchronize(device)

    def attempt(n: int) -> bool:
        try:
            step(n)
            return True
        except torch.OutOfMemoryError:
            return False

    def fits(seconds: float) -> bool:
        ok = attempt(max(1, int(seconds / longest + 1e-9)))  # its tensors are freed once it has returned
        model.zero_grad(set_to_none=True)
        torch.cuda.empty_cache()  # the probe's blocks, of sizes no step asks for again
        return ok

    with torch.random.fork_rng(devices=[device]):
        model.train()
        cap = auto_micro_batch(fits, longest=longest, global_batch=global_batch, world_size=run.ctx.world_size)
    log.info("data.max_batch_seconds auto: %g s per micro-batch on %s (%.1f GiB)", cap, device,
             torch.cuda.get_device_properties(device).total_memory / 2**30)
    return cap


def _spaced(utts: list, n: int) -> list:
    """`n` utterances evenly spaced in id order (all when there are fewer; none for n = 0)."""
    if n <= 0:
        return []
    utts = sorted(utts, key=lambda u: u.id)
    return utts[::max(1, len(utts) // n)][:n]
