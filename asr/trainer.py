"""Training: one process on a CPU or GPU, or DDP through torchrun, resumable after any crash.

    train(config, train_manifest, valid_manifest, exp_dir)

reads like its table of contents: set up the process, prepare the experiment folder (config,
tokenizer, CMVN), build the model and optimizer, resume from the newest checkpoint, then `fit`:
epochs of `train_one_epoch` (a `train_step` per group of micro-batches), each followed by
`compute_validation_loss` and a checkpoint, until a stop condition; then the final model and the
curves.

The loop knows batches only through a `Task`: the loss of a batch and its normalizers, the
validation's metrics, what to do with a batch that runs out of memory. `ASRTask` is speech
recognition's; a language model would bring its own and train through the same loop.

The global batch: `training.global_batch_seconds` of padded audio make one optimizer step,
cut into micro-batches of at most `data.max_batch_seconds` (what one device holds), dealt to the
ranks and accumulated (`batch_plan`). The sampler's epoch is a list of micro-batches that does not
depend on the number of processes, so 1 process accumulating 8, 2 accumulating 4 and 8 taking one
each make the same steps over the same data under the same learning-rate sequence; the training
position is counted in micro-batches of all ranks, and the schedule's length is fixed once, from
the first epoch's steps. Losses are normalized by the counts of the global batch, so a batch split
over ranks gives the gradient of one process. Every skip decision is taken from all-reduced
values, so no rank waits forever in a collective. Each rank draws its own dropout; all ranks'
random states go into rank 0's checkpoints, so a resumed run draws what an uninterrupted one would.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import math
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from asr.checkpoint import (
    TrainingError,
    check_or_save_config,
    clean_experiment,
    model_file,
    resume,
    resume_hint,
    rng_state,
    save_atomic,
    save_checkpoint,
)
from asr.config import to_dict
from asr.corpora import speed_perturb
from asr.curriculum import split_epochs, split_utterances
from asr.dataset import derive_seed
from asr.device_frontend import DeviceFrontend
from asr.distributed import Context, collective_errors, end_process, setup_process, sigterm_stops
from asr.feature_archive import FeatureArchive
from asr.features import CMVNStats, GlobalCMVN
from asr.loader import make_loader
from asr.manifest import read_manifest
from asr.model import build_model
from asr.tokenizer import Tokenizer
from asr.train_config import (
    BatchPlan,
    ExperimentConfig,
    TrainingConfig,
    batch_plan,
    learning_rate,
    total_steps,
)
from asr.train_log import TrainLog, plot_curves, progress
from asr.train_setup import completed_config, experiment_cmvn, experiment_tokenizer, feature_archive, label_rate
from asr.train_task import ASRTask, Task

log = logging.getLogger("asr.train")

# the model -> pictures of it by name, (H, W, 3 or 4) uint8 each (drawn at each validation, rank 0)
Pictures = Callable[[torch.nn.Module], dict[str, np.ndarray]]


# ---------------------------------------------------------------------------------------------
# the driver


def train(config: ExperimentConfig, train_manifest: str, valid_manifest: str, exp_dir: str | Path, *,
          tokenizer_dir: str | None = None, cmvn_path: str | None = None, feats_dir: str | None = None) -> Path:
    """Train into `exp_dir` (resuming from its newest checkpoint); returns the final model file.

    Whatever stops it (SIGKILL, SIGTERM, a full disk, a lost rank), running the same call again
    resumes from the last checkpoint and ends with the same weights as an uninterrupted run.
    `feats_dir`: a FeatureArchive of training features (`compute_cmvn(..., dump_dir=...)`)."""
    tc = config.training
    ctx = setup_process(device=tc.device, num_threads=tc.num_threads)
    exp = Path(exp_dir)
    hint = functools.partial(resume_hint, exp)
    try:
        with sigterm_stops(ctx, hint), collective_errors(ctx, hint):
            train_utts, valid_utts = read_manifest(train_manifest), read_manifest(valid_manifest)
            check_or_save_config(exp, to_dict(config), save=ctx.main, complete=completed_config)
            ctx.barrier()
            tokenizer = experiment_tokenizer(exp, config, train_utts, tokenizer_dir, ctx)
            cmvn = experiment_cmvn(exp, config, train_utts, cmvn_path, ctx)
            run = _build(config, tokenizer, cmvn, label_rate(tokenizer, train_utts), exp, ctx)
            state = resume_run(run)
            archive = feature_archive(feats_dir, config)
            task = _asr_task(run, valid_utts)
            logger = TrainLog(exp, ctx.main, summarize=task.summarize, speed_key=task.speed_key,
                              resumed_at=state.step)
            train_loader = _loader(run, train_utts, training=True, archive=archive)
            valid_loader = _loader(run, valid_utts, training=False)
            loaders = EpochLoaders(train_loader, *(_split_loader(run, state, train_utts, archive) or ()))
            fit(run, state, task, loaders, valid_loader, logger, pictures=task.attention_pictures)
            return finish_run(run, logger)
    finally:
        end_process(ctx)


# ---------------------------------------------------------------------------------------------
# loaders, the length curriculum, the task


def _loader(run: _Run, utts: list, *, training: bool, sharded: bool = True, archive: FeatureArchive | None = None,
            workers: int | None = None):
    """A loader built once (persistent workers: data.num_workers, or `workers`); `set_epoch`
    selects the epoch and position. Training: micro-batches of the run's plan, whole steps of them."""
    ctx, data, group = run.ctx, run.config.data, None
    if workers is not None:
        data = dataclasses.replace(data, num_workers=workers)
    if training:
        data = dataclasses.replace(data, max_batch_seconds=run.plan.micro_batch_seconds)
        group = run.plan.group
    return make_loader(utts, run.tokenizer, data, training=training, cmvn=run.cmvn,
                       seed=run.config.training.seed, rank=ctx.rank if sharded else 0,
                       world_size=ctx.world_size if sharded else 1, pin_memory=ctx.device.type == "cuda",
                       archive=archive, step_group=group)


def _split_loader(run: _Run, state: _State, utts: list, archive: FeatureArchive | None) -> tuple[Any, int] | None:
    """The length curriculum (training.split_hours): the loader of the training utterances cut
    into pieces, and for how many epochs (asr.curriculum.split_epochs); None when there are no
    such epochs left or no utterance is long enough to split. The hours are those an epoch trains on
    (data.speed_perturb's copies counted). The pieces' features come from their audio (an archive
    holds whole utterances)."""
    tc, speeds = run.config.training, run.config.data.speed_perturb
    epochs = split_epochs(speed_perturb(utts, speeds) if speeds else utts, tc.split_hours)
    if state.epoch >= epochs:
        return None
    pieces = split_utterances(utts, tc.split_seconds)
    if len(pieces) == len(utts):
        return None
    log.info("epochs 1-%d: the %d training utterances as %d pieces of about %g s (training.split_hours %g); "
             "whole utterances from epoch %d", epochs, len(utts), len(pieces), tc.split_seconds, tc.split_hours,
             epochs + 1)
    return _loader(run, pieces, training=True, archive=archive), epochs


@dataclass
class EpochLoaders:
    """The training loader of each epoch: the curriculum's pieces (`split`) for its first
    `split_epochs`, then the whole utterances."""

    whole: Any
    split: Any = None
    split_epochs: int = 0

    def of(self, epoch: int):
        return self.split if self.split is not None and epoch < self.split_epochs else self.whole


def _asr_task(run: _Run, valid_utts: list) -> ASRTask:
    """The task, with an evenly spaced, fixed subset of the valid set to decode on rank 0, and the
    first training.attention_plots of it to draw (evenly spaced ones of their own when the subset
    is smaller), read in this process (two utterances are not worth worker processes)."""
    tc = run.config.training
    subset = _spaced(valid_utts, tc.valid_decode_utts) if run.ctx.main else []
    drawn = []
    if run.ctx.main and tc.attention_plots:
        drawn = (subset if len(subset) >= tc.attention_plots else _spaced(valid_utts, tc.attention_plots))
        drawn = drawn[:tc.attention_plots]
    loader = _loader(run, subset, training=False, sharded=False) if subset else None
    pictures = _loader(run, drawn, training=False, sharded=False, workers=0) if drawn else None
    data = run.config.data
    frontend = (DeviceFrontend(data.features, run.cmvn, data.specaug, seed=tc.seed)
                if data.frontend == "device" else None)
    return ASRTask(run.model, run.tokenizer, data.features, run.config.model.ctc_weight, run.ctx.device,
                   decode_loader=loader, decode_text={u.id: u.text for u in subset}, frontend=frontend,
                   picture_loader=pictures)


def _spaced(utts: list, n: int) -> list:
    """`n` utterances evenly spaced in id order (all when there are fewer; none for n = 0)."""
    if n <= 0:
        return []
    utts = sorted(utts, key=lambda u: u.id)
    return utts[::max(1, len(utts) // n)][:n]


# ---------------------------------------------------------------------------------------------
# model, optimizer, schedule, precision, resume


@dataclass
class _Run:
    """What the loop works with, built once: the model and its optimizer, and where they run."""

    config: ExperimentConfig  # with model.vocab_size filled in from the tokenizer
    exp: Path
    ctx: Context
    model: torch.nn.Module  # the bare model
    wrapped: torch.nn.Module  # DDP / compiled wrapper used for forward
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler
    autocast_dtype: torch.dtype | None
    tokenizer: Tokenizer
    cmvn_stats: CMVNStats | None  # None: a task without audio (a language model)
    cmvn: GlobalCMVN | None
    plan: BatchPlan
    envelope: Callable[[_Run], dict[str, Any]] | None = None  # the model file of the current weights;
    # None: the ASR model file (DESIGN.md)
    final_name: str = "model_last.pt"  # EXP/<final_name>: the model file `fit` ends with

    def autocast(self) -> AbstractContextManager:
        """The run's precision for a forward (bf16 / fp16 autocast, or nothing for fp32)."""
        dtype = self.autocast_dtype
        return torch.autocast(self.ctx.device.type, dtype=dtype, enabled=dtype is not None)


@dataclass
class _State:
    """Where training is; saved in every checkpoint."""

    epoch: int = 0
    batch: int = 0  # micro-batches of all ranks consumed in `epoch` (whole steps)
    step: int = 0  # optimizer steps taken
    total_steps: int = 0  # the schedule's length, fixed at the start (0: not yet)
    step_group: int = 0  # micro-batches of a step, all ranks (0: not recorded)
    micro_batch_seconds: float = 0.0  # their cap
    processes: int = 1  # the processes that wrote the state
    bad_steps: int = 0  # non-finite steps in a row
    skipped_steps: int = 0  # non-finite steps in all
    best_loss: float = math.inf
    epochs_without_gain: int = 0
    audio_hours: float = 0.0  # of training audio consumed (all ranks, rank 0's estimate)
    plateau_reported: bool = False  # the not-learning warning was given (once per run)
    history: list = field(default_factory=list)  # validation results, one dict per epoch


def _build(config: ExperimentConfig, tokenizer: Tokenizer, stats: CMVNStats, label_rate: float, exp: Path,
           ctx: Context) -> _Run:
    torch.manual_seed(config.training.seed)
    config = dataclasses.replace(config, model=dataclasses.replace(config.model, vocab_size=tokenizer.vocab_size))
    model = build_model(config.model, tokens_per_second=label_rate)
    return make_run(config, model, tokenizer, exp, ctx, _plan(config, ctx), cmvn_stats=stats)


def make_run(config: Any, model: torch.nn.Module, tokenizer: Tokenizer, exp: Path, ctx: Context, plan: BatchPlan, *,
             cmvn_stats: CMVNStats | None = None, envelope: Callable[[_Run], dict[str, Any]] | None = None,
             final_name: str = "model_last.pt") -> _Run:
    """The run of `model` (built after torch.manual_seed(training.seed)): moved to the device,
    wrapped (compile, DDP), with its optimizer, gradient scaler and precision. `config` has a
    `training` section (TrainingConfig); `envelope` and `final_name` as in _Run."""
    tc = config.training
    model = model.to(ctx.device)
    if ctx.rank > 0:  # the same initial weights (DDP copies rank 0's anyway), dropout of its own
        _seed_rank(tc.seed, ctx.rank)
    wrapped = model
    if tc.compile:
        wrapped = torch.compile(wrapped)
    if ctx.distributed:
        ids = [ctx.device.index] if ctx.device.type == "cuda" else None
        wrapped = torch.nn.parallel.DistributedDataParallel(wrapped, device_ids=ids)
    opt_cls = torch.optim.AdamW if tc.optimizer == "adamw" else torch.optim.Adam
    # fused: one kernel over all parameters instead of a chain of ops per tensor (the same update
    # to rounding), on a CPU as on a GPU
    fused = ctx.device.type in ("cpu", "cuda")
    optimizer = opt_cls(model.parameters(), lr=tc.lr, betas=tc.betas, eps=tc.eps, weight_decay=tc.weight_decay,
                        fused=fused or None)
    dtype = _autocast_dtype(tc.precision, ctx.device)
    scaler = torch.amp.GradScaler(ctx.device.type, enabled=dtype == torch.float16)
    n_params = sum(p.numel() for p in model.parameters())
    log.info("model: %.2fM parameters, vocabulary %d, device %s, precision %s, %d process(es)",
             n_params / 1e6, tokenizer.vocab_size, ctx.device, dtype or "fp32", ctx.world_size)
    cmvn = GlobalCMVN(cmvn_stats) if cmvn_stats is not None else None
    return _Run(config, exp, ctx, model, wrapped, optimizer, scaler, dtype, tokenizer, cmvn_stats, cmvn, plan,
                envelope, final_name)


def _seed_rank(seed: int, rank: int, *keys: int) -> None:
    """Seed this process's torch (CPU and CUDA) generator from (seed, rank, keys)."""
    torch.manual_seed(derive_seed(seed, rank, *keys))


def _plan(config: ExperimentConfig, ctx: Context) -> BatchPlan:
    plan = batch_plan(config, ctx.world_size)
    cap = config.data.max_batch_seconds
    log.info("a step: %d micro-batches of at most %g padded seconds (%g s), %d process(es) accumulating %d each",
             plan.group, plan.micro_batch_seconds, plan.step_seconds, plan.world_size, plan.accum)
    if plan.micro_batch_seconds < cap:
        log.warning("%d processes do not divide the %d micro-batches of training.global_batch_seconds: each "
                    "accumulates %d of at most %.4g s (not data.max_batch_seconds %g), so the steps are cut "
                    "differently from a run on a number of processes that divides %d", plan.world_size,
                    round(config.training.global_batch_seconds / cap), plan.accum, plan.micro_batch_seconds,
                    cap, round(config.training.global_batch_seconds / cap))
    return plan


def _autocast_dtype(precision: str, device: torch.device) -> torch.dtype | None:
    if precision == "fp32" or (precision == "auto" and device.type != "cuda"):
        return None
    if precision == "bf16" or (precision == "auto" and torch.cuda.is_bf16_supported()):
        return torch.bfloat16
    return torch.float16


def resume_run(run: _Run) -> _State:
    """The state of the newest checkpoint in EXP, its weights, optimizer, scaler and RNG states
    loaded; a fresh state when there is none. Rank 0 first removes the temporary files of writes
    a kill interrupted."""
    ctx = run.ctx
    if ctx.main:
        clean_experiment(run.exp)
    found = resume(run.exp, run.model, run.optimizer, run.scaler, map_location=ctx.device, rank=ctx.rank,
                   world_size=ctx.world_size)
    if found is None:
        return _State()
    state = _State(**found.state)
    log.info("resumed from %s (epoch %d, micro-batch %d, step %d)", found.path, state.epoch + 1, state.batch,
             state.step)
    if found.processes != ctx.world_size:
        _seed_rank(run.config.training.seed, ctx.rank, state.step)
        log.warning("the checkpoint holds the random states of %d process(es), this run has %d: the dropout "
                    "draws from here on differ from an uninterrupted run's", found.processes, ctx.world_size)
    _check_position(run, state)
    return state


def _check_position(run: _Run, state: _State) -> None:
    """Refuse, in one line, to resume mid-epoch when this run's steps are cut otherwise than the
    checkpoint's (another cap or step size: another number of processes without a global batch
    they divide); at an epoch's end any number of processes continues."""
    plan = run.plan
    saved = (state.step_group or plan.group, state.micro_batch_seconds or plan.micro_batch_seconds)
    if state.batch == 0 or saved == (plan.group, plan.micro_batch_seconds):
        return
    raise TrainingError(
        f"{run.exp}: the newest checkpoint (step {state.step}) stopped mid-epoch, its steps {saved[0]} micro-batches "
        f"of at most {saved[1]:g} s written by {state.processes} process(es); with {plan.world_size} this run cuts "
        f"them as {plan.group} of {plan.micro_batch_seconds:g} s and would not continue at the same data: resume "
        f"with {state.processes} process(es), or set training.global_batch_seconds to a multiple of "
        f"data.max_batch_seconds that both numbers of processes divide")


def _model_envelope(run: _Run) -> dict[str, Any]:
    """The model file of the current weights (a checkpoint adds training state): the run's own
    envelope, or DESIGN.md's ASR model file."""
    if run.envelope is not None:
        return run.envelope(run)
    frontend = {"features": to_dict(run.config.data.features), "cmvn": run.cmvn_stats.to_dict()}
    return model_file(model=to_dict(run.config.model), frontend=frontend, tokenizer=run.tokenizer.to_dict(),
                      state_dict=run.model.state_dict())


def _save_checkpoint(run: _Run, state: _State, *, valid_loss: float | None) -> None:
    """Rank 0 writes EXP/checkpoints/ckpt-<step>.pt and prunes old ones; the others wait."""
    tc = run.config.training
    state.step_group, state.micro_batch_seconds = run.plan.group, run.plan.micro_batch_seconds
    state.processes = run.ctx.world_size
    rngs = run.ctx.all_gather_object(rng_state(run.ctx.device))
    if run.ctx.main:
        save_checkpoint(run.exp, _model_envelope(run), optimizer=run.optimizer, scaler=run.scaler, state=vars(state),
                        valid_loss=valid_loss, keep_last=tc.keep_last, keep_best=tc.keep_best, rng=rngs)
    run.ctx.barrier()


def finish_run(run: _Run, logger: TrainLog) -> Path:
    """Write EXP/model_last.pt (the run's final_name) and the curves (rank 0)."""
    path = run.exp / run.final_name
    if run.ctx.main:
        save_atomic(_model_envelope(run), path)
        plot_curves(logger.path, run.exp / "curves.png")
        logger.close()
    run.ctx.barrier()
    return path


# ---------------------------------------------------------------------------------------------
# the loop: epochs, steps, validation


def fit(run: _Run, state: _State, task: Task, loaders: EpochLoaders, valid_loader, logger: TrainLog, *,
        pictures: Pictures | None = None) -> None:
    """Epochs of training, each followed by validation and a checkpoint, until a stop condition.
    `pictures`: what to draw of the model at each validation (rank 0; ASRTask.attention_pictures)."""
    tc = run.config.training
    if not state.total_steps:  # every epoch counted at the whole utterances' length
        loaders.whole.set_epoch(0)
        state.total_steps = total_steps(tc, loaders.whole.batches.epoch_batches() // run.plan.group)
        log.info("learning-rate schedule over %d steps", state.total_steps)
    while not _why_stop(tc, state):
        train_loader = loaders.of(state.epoch)
        finished = train_one_epoch(run, state, task, train_loader, logger)  # False: max_steps reached mid-epoch
        _report_skipped(run.ctx, train_loader)
        _validate_and_checkpoint(run, state, task, valid_loader, logger, end_of_epoch=finished, pictures=pictures)
    log.info("training stopped: %s", _why_stop(tc, state))


def _why_stop(tc: TrainingConfig, state: _State) -> str:
    """Why training is over, or "": from the saved state alone, so that a run resumed from its
    last checkpoint (killed while writing the final model) stops where it stopped."""
    if _max_steps_reached(tc, state):
        return "max_steps reached"
    if tc.patience and state.epochs_without_gain >= tc.patience:
        return f"no better validation loss for {tc.patience} epochs"
    return f"{state.epoch} epochs done" if state.epoch >= tc.epochs else ""


def _max_steps_reached(tc: TrainingConfig, state: _State) -> bool:
    return tc.max_steps > 0 and state.step >= tc.max_steps


def _report_skipped(ctx: Context, loader) -> None:
    """Count the training utterances skipped so far, over all ranks (each was reported once,
    with its reason, when first met)."""
    count = ctx.all_reduce(torch.tensor([float(len(loader.skipped))], device=ctx.device))
    if count.item():
        log.warning("%d training utterances skipped so far (their audio cannot be used: see above)", count.item())


def train_one_epoch(run: _Run, state: _State, task: Task, loader, logger: TrainLog) -> bool:
    """Optimizer steps from the saved position to the end of the epoch; False when max_steps
    stopped it early."""
    tc, world = run.config.training, run.ctx.world_size
    done = state.batch // world  # this rank's micro-batches (the position is a whole number of steps)
    loader.set_epoch(state.epoch, done)
    total = done + len(loader)
    run.model.train()
    logger.start_clock()
    group: list = []
    # closed however the epoch ends, so that an error message starts on a line of its own
    with progress(run.ctx.main, total, done, f"epoch {state.epoch + 1}/{tc.epochs}") as bar:
        for batch in loader:
            group.append(batch)
            if len(group) < run.plan.accum and state.batch // world + len(group) < total:
                continue
            train_step(run, state, task, group, logger, bar)
            group = []
            if _max_steps_reached(tc, state):
                return False
            if tc.checkpoint_every and state.step % tc.checkpoint_every == 0:
                _save_checkpoint(run, state, valid_loss=None)
    return True


def train_step(run: _Run, state: _State, task: Task, group: list, logger: TrainLog, bar) -> None:
    """One optimizer step over the micro-batches `group`, or a skipped one when the gradient
    norm is not finite or every micro-batch ran out of memory; then its log."""
    tc = run.config.training
    for g in run.optimizer.param_groups:
        g["lr"] = learning_rate(tc, state.step, state.total_steps)
    consumed = len(group)
    norm, sums, group, bad_loss = _accumulate(run, state, task, group)
    if group:  # without a backward there is nothing to unscale (fp16's scaler would refuse)
        run.scaler.unscale_(run.optimizer)
    grad_norm = torch.nn.utils.clip_grad_norm_(run.model.parameters(), tc.grad_clip)
    state.batch += consumed * run.ctx.world_size
    # The one host synchronization of a step: skipping is decided from the gradient norm,
    # which is the same on every rank after DDP's all-reduce.
    if not group:
        _skip_step(run, state, "every utterance of the batch ran out of memory alone")
    elif not math.isfinite(float(grad_norm)):  # a non-finite loss makes the gradients non-finite too
        if _scaler_overflow(run, bad_loss):
            state.skipped_steps += 1  # the scaler lowered its scale; a step like this is not a bad one
            log.info("step %d: fp16 gradients overflowed; the loss scale drops to %g and the step is skipped",
                     state.step + 1, run.scaler.get_scale() / 2)
        else:
            _skip_step(run, state, f"non-finite loss or gradient norm ({float(grad_norm)})")
    else:
        run.scaler.step(run.optimizer)
        state.step += 1
        state.bad_steps = 0
    if group:
        run.scaler.update()
    run.optimizer.zero_grad(set_to_none=True)
    amount = task.amount(group) * run.ctx.world_size  # this rank's share times the ranks: near enough
    state.audio_hours += amount / 3600
    speed = logger.throughput(amount)
    record = logger.train_step(state.step, state.epoch + 1, state.skipped_steps, sums, norm, grad_norm,
                               run.optimizer.param_groups[0]["lr"], speed, bar, tc.log_every, consumed)
    if record is not None:
        _check_learning(run, state, task, record, logger)


def _check_learning(run: _Run, state: _State, task: Task, record: dict, logger: TrainLog) -> None:
    """Once per run (rank 0), past the warmup and training.plateau_check_hours of training audio:
    the task's warning when a train record says the model is not learning (a CTC loss per token
    still near chance)."""
    tc = run.config.training
    hours = state.audio_hours
    if state.plateau_reported or not tc.plateau_check_hours or hours < tc.plateau_check_hours \
            or state.step < tc.warmup_steps:
        return
    warning = task.not_learning(record)
    if warning is not None:
        state.plateau_reported = True
        what, message, values = warning
        logger.warning(state.step, state.epoch + 1, what,
                       f"after {state.step} steps ({hours:.3g} hours of audio): {message}", **values)


def _accumulate(run: _Run, state: _State, task: Task,
                group: list) -> tuple[torch.Tensor, torch.Tensor, list, torch.Tensor]:
    """Forward and backward of the micro-batches of one step: (the global counts, the summed
    `step_sums`, the micro-batches used, how many of their losses were not finite: a tensor, read
    only when the gradients are not finite). In one process, a micro-batch that runs out of memory
    is split in halves and the step started again (one that holds a single example is left out);
    under DDP the ranks cannot retry alone, so running out of memory ends the job."""
    while True:
        counts = run.ctx.all_reduce(torch.tensor(task.counts(group), dtype=torch.float64, device=run.ctx.device))
        norm = counts.clamp(min=1.0)
        sums, bad_loss, failed = _forward_backward_all(run, state, task, group, norm)
        if failed is None:
            return norm, sums, group, bad_loss
        run.optimizer.zero_grad(set_to_none=True)  # the failed backward may have added some
        if run.ctx.device.type == "cuda":
            torch.cuda.empty_cache()  # the failed step's blocks, for the halves to fit
        group = group[:failed] + task.halves(group[failed], state.step + 1) + group[failed + 1:]


def _forward_backward_all(run: _Run, state: _State, task: Task, group: list,
                          norm: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int | None]:
    """(the summed `step_sums` of the group, the count of non-finite losses, the index of the
    micro-batch that ran out of memory or None)."""
    sums = torch.zeros(len(task.step_sums), device=run.ctx.device, dtype=torch.float64)
    bad_loss = torch.zeros((), device=run.ctx.device)
    for i, batch in enumerate(group):
        try:
            batch_sums, finite = _forward_backward(run, task, batch, norm, sync=i == len(group) - 1)
            sums += batch_sums
            bad_loss += ~finite
        except torch.OutOfMemoryError:
            if run.ctx.distributed:
                raise TrainingError(
                    f"rank {run.ctx.rank}: out of memory at step {state.step + 1} on {task.describe(batch)}; under "
                    f"DDP the ranks cannot retry alone, so the job stops: {resume_hint(run.exp)} (or start a new "
                    f"--exp-dir with a smaller data.max_batch_seconds)") from None
            return sums, bad_loss, i  # leaving the handler frees the failed step's tensors
    return sums, bad_loss, None


def _forward_backward(run: _Run, task: Task, batch, norm: torch.Tensor, *,
                      sync: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The task's loss of one micro-batch, backward (DDP's gradient all-reduce on the last of a
    step, `sync`); returns its detached `step_sums` and whether the loss is finite (a tensor: no
    host synchronization)."""
    ctx = run.ctx
    empty = len(batch.ids) == 0
    if empty:  # this rank's batch emptied: a zero-loss step so DDP's all-reduce still happens
        batch = task.placeholder()
    with run.wrapped.no_sync() if ctx.distributed and not sync else contextlib.nullcontext():
        with run.autocast():
            loss, sums = task.loss(run.wrapped, batch, norm)
        loss = loss * (0.0 if empty else ctx.world_size)  # DDP averages gradients over ranks
        run.scaler.scale(loss).backward()
    return (torch.zeros_like(sums) if empty else sums), torch.isfinite(loss.detach())


def _scaler_overflow(run: _Run, bad_loss: torch.Tensor) -> bool:
    """Whether non-finite gradients are fp16's scaled gradients overflowing (the loss finite on
    every rank, the gradient scaler on and its scale above 1: it halves it in `update`) rather
    than a bad step.
    All ranks decide alike: they reach this together, and the loss check is all-reduced."""
    if not run.scaler.is_enabled() or run.scaler.get_scale() <= 1.0:  # at scale 1 it is the gradients
        return False
    return float(run.ctx.all_reduce(bad_loss)) == 0.0


def _skip_step(run: _Run, state: _State, reason: str) -> None:
    state.bad_steps += 1
    state.skipped_steps += 1
    log.warning("step %d: %s; step skipped (%d in a row, %d in all)", state.step + 1, reason, state.bad_steps,
                state.skipped_steps)
    if state.bad_steps >= run.config.training.max_bad_steps:
        raise TrainingError(f"{state.bad_steps} steps in a row skipped, the last for {reason}: training stopped "
                            f"(lower the learning rate or data.max_batch_seconds, or check the data); "
                            f"{resume_hint(run.exp)}")


def _validate_and_checkpoint(run: _Run, state: _State, task: Task, loader, logger: TrainLog, *,
                             end_of_epoch: bool, pictures: Pictures | None = None) -> None:
    result = compute_validation_loss(run, task, loader)
    result.update(epoch=state.epoch + 1, step=state.step)
    state.history.append(result)
    logger.valid(result)
    if pictures is not None and run.ctx.main:  # EXP/attention/epoch<k>/<id>.png and TensorBoard
        logger.pictures("attention", result["epoch"], state.step, pictures(run.model))
    if result["loss"] < state.best_loss - 1e-6:
        state.best_loss, state.epochs_without_gain = result["loss"], 0
    else:
        state.epochs_without_gain += 1
    if end_of_epoch:
        state.epoch, state.batch = state.epoch + 1, 0
    _save_checkpoint(run, state, valid_loss=result["loss"])


@torch.no_grad()
def compute_validation_loss(run: _Run, task: Task, loader) -> dict[str, float]:
    """The task's validation metrics over the whole valid set (sharded over ranks), and its
    decoding metrics (rank 0)."""
    model = run.model
    model.eval()
    sums = torch.zeros(len(task.valid_sums), dtype=torch.float64, device=run.ctx.device)
    loader.set_epoch(0)
    for batch in loader:
        if not batch.ids:
            continue
        with run.autocast():
            sums += task.validation(model, batch)
    result = task.valid_metrics(run.ctx.all_reduce(sums).tolist())
    result.update(task.decode_metrics(model, run.autocast))
    model.train()
    return result


__all__ = ["EpochLoaders", "TrainingError", "compute_validation_loss", "finish_run", "fit", "make_run", "resume_run",
           "train", "train_one_epoch", "train_step"]
