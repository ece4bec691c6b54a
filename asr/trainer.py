"""The training loop of any task: one process on a CPU or GPU, or DDP through torchrun, resumable
after any crash. It knows no task: speech recognition (asr.train_asr) and language modelling
(asr.lm_train) each give it an `Experiment`, and

    run_experiment(experiment)

reads like its table of contents: set up the process, let the experiment prepare its folder and
build the `Run` (the model and optimizer, the batch plan, the unit its work is counted in),
resume from the newest checkpoint, take the experiment's task and loaders, then `fit`: epochs of
`train_one_epoch` (a `train_step` per group of micro-batches), each followed by
`compute_validation_loss` and a checkpoint, until a stop condition; then the final model file and
the curves.

The loop knows batches only through a `Task` (asr.train_task): how a batch is staged on the
device, the loss of a batch and its normalizers, the validation's metrics, what to do with a batch
that runs out of memory, and the unit of its work (seconds of audio, tokens), in which the batch
plan, the throughput, the amount trained on and the messages speak.

Keeping a GPU busy: a step reads one value back from the device, the gradient norm (the
non-finite check); everything else is queued without waiting, so the host runs ahead. Each
micro-batch is staged (`Task.stage`: its copies from pinned memory, speech's frontend) on a side
CUDA stream while the micro-batch before it computes (`Stager`). The next epoch's loader starts
reading while the validation runs, so no epoch's first step waits for its data. With
training.compile the repeated blocks are compiled (`compile_blocks`). A micro-batch cap found on
the device when the run starts (`AutoMicroBatch`, speech's data.max_batch_seconds: auto) is kept
in the checkpoints, so a resumed run cuts its steps as before.

The global batch: a step's worth of padded work (training.global_batch_seconds of audio,
data.global_batch_tokens of text) makes one optimizer step, cut into micro-batches of at most the
task's cap (what one device holds), dealt to the ranks and accumulated (asr.train_config.BatchPlan).
The sampler's epoch is a list of micro-batches that does not depend on the number of processes,
so 1 process accumulating 8, 2 accumulating 4 and 8 taking one each make the same steps over the
same data under the same learning-rate sequence; the training position is counted in
micro-batches of all ranks, and the schedule's length is fixed once, from the first epoch's steps.
Losses are normalized by the counts of the global batch, so a batch split over ranks gives the
gradient of one process. Every skip decision is taken from all-reduced values, so no rank waits
forever in a collective. Each rank draws its own dropout; all ranks' random states go into rank
0's checkpoints, so a resumed run draws what an uninterrupted one would.
"""
from __future__ import annotations

import contextlib
import functools
import logging
import math
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch
from torch.utils._pytree import tree_leaves

from asr.checkpoint import TrainingError, clean_experiment, resume, resume_hint, rng_state, save_atomic, save_checkpoint
from asr.distributed import Context, collective_errors, end_process, setup_process, sigterm_stops
from asr.train_config import BatchPlan, TrainingConfig, learning_rate, total_steps
from asr.train_log import TrainLog, plot_curves, progress
from asr.train_task import Task, Unit

__all__ = ["AutoMicroBatch", "Experiment", "Loaders", "Run", "Stager", "State", "compile_blocks",
           "compiled_graphs", "compute_validation_loss", "finish_run", "fit", "make_run", "resume_run",
           "run_experiment", "train_one_epoch", "train_step"]

log = logging.getLogger("asr.train")

# the bare model -> its model file (DESIGN.md: format, config, weights, ...): what the run saves
Envelope = Callable[[torch.nn.Module], dict[str, Any]]


# ---------------------------------------------------------------------------------------------
# the driver


class Experiment(Protocol):
    """What a task's driver gives `run_experiment`."""

    exp: Path  # the experiment folder
    training: TrainingConfig

    def build(self, ctx: Context) -> Run:
        """The experiment folder checked (its config) and prepared (what the data needs), the
        model built after torch.manual_seed(training.seed): `make_run`'s run, not resumed yet."""

    def parts(self, run: Run, state: State) -> tuple[Task, Loaders]:
        """The task and the loaders, for training on from `state`."""


def run_experiment(experiment: Experiment) -> Path:
    """Train `experiment` (resuming from its newest checkpoint); returns the final model file.

    Whatever stops it (SIGKILL, SIGTERM, a full disk, a lost rank), running it again resumes
    from the last checkpoint and ends with the same weights as an uninterrupted run."""
    tc, exp = experiment.training, experiment.exp
    ctx = setup_process(device=tc.device, num_threads=tc.num_threads)
    hint = functools.partial(resume_hint, exp)
    try:
        with sigterm_stops(ctx, hint), collective_errors(ctx, hint):
            run = experiment.build(ctx)
            state = resume_run(run)
            task, loaders = experiment.parts(run, state)
            logger = TrainLog(exp, ctx.main, summarize=task.summarize, unit=run.unit, resumed_at=state.step)
            fit(run, state, task, loaders, logger)
            return finish_run(run, logger)
    finally:
        end_process(ctx)


@dataclass
class Loaders:
    """The valid loader, and the training loader of each epoch: `first` for the first
    `first_epochs` (speech's length curriculum: pieces of the utterances), then `train`."""

    train: Any
    valid: Any
    first: Any = None
    first_epochs: int = 0

    def of(self, epoch: int):
        return self.first if self.first is not None and epoch < self.first_epochs else self.train


# ---------------------------------------------------------------------------------------------
# model, optimizer, schedule, precision, resume


@dataclass(frozen=True)
class AutoMicroBatch:
    """A micro-batch cap chosen for the device when a run starts (speech: data.max_batch_seconds
    auto), in place of one the config gives: `probe(run)` is this process's (the largest its device
    holds, lowered to divide the step: asr.train_config.auto_micro_batch; the loop takes the
    smallest over the processes), `plan(cap)` the batch plan of a cap. A resumed run keeps the cap
    of its checkpoint (State.micro_batch) and probes nothing."""

    probe: Callable[[Run], float]
    plan: Callable[[float], BatchPlan]


@dataclass
class Run:
    """What the loop works with, built once: the model and its optimizer, and where they run."""

    training: TrainingConfig
    exp: Path
    ctx: Context
    model: torch.nn.Module  # the bare model (its blocks compiled in place with training.compile)
    wrapped: torch.nn.Module  # the model, or its DDP wrapper: what a training forward calls
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler
    autocast_dtype: torch.dtype | None
    plan: BatchPlan | None  # in `unit`; None until `resume_run` chooses it, with `auto`
    unit: Unit  # the task's
    envelope: Envelope  # the model file of the current weights
    final_name: str  # EXP/<final_name>: the model file `fit` ends with
    auto: AutoMicroBatch | None = None

    def autocast(self) -> AbstractContextManager:
        """The run's precision for a forward (bf16 / fp16 autocast, or nothing for fp32)."""
        dtype = self.autocast_dtype
        return torch.autocast(self.ctx.device.type, dtype=dtype, enabled=dtype is not None)


@dataclass
class State:
    """Where training is; saved in every checkpoint."""

    epoch: int = 0
    batch: int = 0  # micro-batches of all ranks consumed in `epoch` (whole steps)
    step: int = 0  # optimizer steps taken
    total_steps: int = 0  # the schedule's length, fixed at the start (0: not yet)
    step_group: int = 0  # micro-batches of a step, all ranks (0: not recorded)
    micro_batch: float = 0.0  # their cap, in the unit
    processes: int = 1  # the processes that wrote the state
    bad_steps: int = 0  # non-finite steps in a row
    skipped_steps: int = 0  # non-finite steps in all
    best_loss: float = math.inf
    epochs_without_gain: int = 0
    trained: float = 0.0  # the amount trained on, in the unit (all ranks, rank 0's estimate)
    plateau_reported: bool = False  # the not-learning warning was given (once per run)
    history: list = field(default_factory=list)  # validation results, one dict per epoch

    @classmethod
    def saved(cls, state: dict[str, Any]) -> State:
        """The state of a checkpoint; one of a version that counted in audio reads as its
        successor (audio_hours were the amount / 3600, for tokens too; micro_batch_seconds)."""
        state = dict(state)
        if "audio_hours" in state:
            state["trained"] = state.pop("audio_hours") * 3600
        if "micro_batch_seconds" in state:
            state["micro_batch"] = state.pop("micro_batch_seconds")
        return cls(**state)


def make_run(training: TrainingConfig, model: torch.nn.Module, exp: Path, ctx: Context,
             plan: BatchPlan | AutoMicroBatch, *, unit: Unit, envelope: Envelope, final_name: str) -> Run:
    """The run of `model` (built after torch.manual_seed(training.seed)): moved to the device,
    its blocks compiled (training.compile), wrapped in DDP, with its optimizer, gradient scaler and
    precision; the plan logged (an AutoMicroBatch's once `resume_run` has chosen it)."""
    tc = training
    model = model.to(ctx.device)
    if ctx.rank > 0:  # the same initial weights (DDP copies rank 0's anyway), dropout of its own
        ctx.seed_torch(tc.seed)
    if tc.compile:
        blocks = compile_blocks(model)
        log.info("torch.compile: %d blocks compiled in place (dynamic shapes); their graphs are made at first "
                 "use and counted after each epoch", blocks)
    wrapped = model
    if ctx.distributed:
        # device_ids None: with them DDP would copy every input to the device first, blocking, the
        # lengths the model reads on the host too (the module is on one device either way)
        wrapped = torch.nn.parallel.DistributedDataParallel(model, device_ids=None)
    opt_cls = torch.optim.AdamW if tc.optimizer == "adamw" else torch.optim.Adam
    # fused: one kernel over all parameters instead of a chain of ops per tensor (the same update
    # to rounding), on a CPU as on a GPU
    fused = ctx.device.type in ("cpu", "cuda")
    optimizer = opt_cls(parameter_groups(model, tc.weight_decay, tc.decay_norms_and_biases), lr=tc.lr,
                        betas=tc.betas, eps=tc.eps, weight_decay=tc.weight_decay, fused=fused or None)
    dtype = _autocast_dtype(tc.precision, ctx.device)
    scaler = torch.amp.GradScaler(ctx.device.type, enabled=dtype == torch.float16)
    n_params = sum(p.numel() for p in model.parameters())
    log.info("model: %.2fM parameters, device %s, precision %s, %d process(es)", n_params / 1e6, ctx.device,
             dtype or "fp32", ctx.world_size)
    if isinstance(plan, AutoMicroBatch):
        return Run(tc, exp, ctx, model, wrapped, optimizer, scaler, dtype, None, unit, envelope, final_name, plan)
    _log_plan(plan, unit)
    return Run(tc, exp, ctx, model, wrapped, optimizer, scaler, dtype, plan, unit, envelope, final_name)


def compile_blocks(model: torch.nn.Module) -> int:
    """torch.compile, in place, the blocks of the model's layer stacks (each module of each
    nn.ModuleList: encoder and decoder layers) that hold no convolution; returns how many.

    Each is compiled with dynamic shapes (batch size and lengths symbolic from the first graph), and
    the blocks of one class share their graphs, so a run compiles a handful (per block class: one
    for training, one for evaluation, and each again for a batch of one, which torch specializes)
    however many lengths its batches have. Left eager: what lies outside the blocks (subsampling,
    losses: compiled whole, a model breaks its graph at CTC, whose output size depends on the data,
    and recompiles for new lengths until torch gives up), and blocks holding a convolution (the
    Conformer's, and a transformer's with model.conv_kernel): torch 2.14's inductor fixes the
    length in the gradient of a convolution's input (guard_int_seq on its strides in
    convolution_backward's lowering), so such a block would compile again for every new length.
    The weights' names do not change (checkpoints and model files are the same)."""
    blocks = [block for stack in model.modules() if isinstance(stack, torch.nn.ModuleList) for block in stack]
    compiled = [block for block in blocks if not _holds_convolution(block)]
    for block in compiled:
        block.compile(dynamic=True)
    if len(compiled) < len(blocks):
        kinds = sorted({type(b).__name__ for b in blocks if _holds_convolution(b)})
        log.info("torch.compile: %d blocks (%s) hold a convolution and stay eager: compiled, they would recompile "
                 "for every new length (torch.compile fixes a convolution's input length in its gradient)",
                 len(blocks) - len(compiled), ", ".join(kinds))
    return len(compiled)


def _holds_convolution(module: torch.nn.Module) -> bool:
    return any(isinstance(m, torch.nn.modules.conv._ConvNd) for m in module.modules())


def compiled_graphs() -> int:
    """The graphs torch.compile has made in this process so far (TorchDynamo's count)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def parameter_groups(model: torch.nn.Module, weight_decay: float, decay_norms_and_biases: bool) -> list[dict]:
    """The optimizer's parameter groups: all with `weight_decay`, or (decay_norms_and_biases false)
    the 1-D parameters (biases, LayerNorm scales and shifts) in a group of their own without it."""
    params = list(model.parameters())
    if decay_norms_and_biases:
        return [{"params": params}]
    return [{"params": [p for p in params if p.ndim >= 2]},
            {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]


def _log_plan(plan: BatchPlan, unit: Unit) -> None:
    log.info("a step: %d micro-batches of at most %g padded %s (%g %s), %d process(es) accumulating %d each",
             plan.group, plan.micro_batch, unit.name, plan.step_size, unit.symbol, plan.world_size, plan.accum)
    if plan.micro_batch < plan.cap:
        micro = round(plan.step_size / plan.cap)
        log.warning("%d processes do not divide the %d micro-batches of %s: each accumulates %d of at most "
                    "%.4g %s (not %s %g), so the steps are cut differently from a run on a number of processes "
                    "that divides %d", plan.world_size, micro, unit.step_setting, plan.accum, plan.micro_batch,
                    unit.symbol, unit.cap_setting, plan.cap, micro)


def _autocast_dtype(precision: str, device: torch.device) -> torch.dtype | None:
    if precision == "fp32" or (precision == "auto" and device.type != "cuda"):
        return None
    if precision == "bf16" or (precision == "auto" and torch.cuda.is_bf16_supported()):
        return torch.bfloat16
    return torch.float16


def resume_run(run: Run) -> State:
    """The state of the newest checkpoint in EXP, its weights, optimizer, scaler and RNG states
    loaded; a fresh state when there is none. Rank 0 first removes the temporary files of writes
    a kill interrupted."""
    ctx = run.ctx
    if ctx.main:
        clean_experiment(run.exp)
    found = resume(run.exp, run.model, run.optimizer, run.scaler, map_location=ctx.device, rank=ctx.rank,
                   world_size=ctx.world_size)
    state = State() if found is None else State.saved(found.state)
    if run.auto is not None:
        _choose_micro_batch(run, state)
    if found is None:
        return state
    log.info("resumed from %s (epoch %d, micro-batch %d, step %d)", found.path, state.epoch + 1, state.batch,
             state.step)
    if found.processes != ctx.world_size:
        ctx.seed_torch(run.training.seed, state.step)
        log.warning("the checkpoint holds the random states of %d process(es), this run has %d: the dropout "
                    "draws from here on differ from an uninterrupted run's", found.processes, ctx.world_size)
    _check_position(run, state)
    return state


def _choose_micro_batch(run: Run, state: State) -> None:
    """run.plan of its AutoMicroBatch: the checkpoint's cap, or the smallest that the processes'
    probes found (the same on every rank)."""
    assert run.auto is not None
    if state.micro_batch:
        cap = state.micro_batch
        log.info("%s auto: %g %s, the cap the run started with (from its checkpoint)", run.unit.cap_setting, cap,
                 run.unit.symbol)
    else:
        cap = min(run.ctx.all_gather_object(run.auto.probe(run)))
        log.info("%s auto: %g %s (the smallest over %d process(es))", run.unit.cap_setting, cap, run.unit.symbol,
                 run.ctx.world_size)
    run.plan = run.auto.plan(cap)
    _log_plan(run.plan, run.unit)


def _check_position(run: Run, state: State) -> None:
    """Refuse, in one line, to resume mid-epoch when this run's steps are cut otherwise than the
    checkpoint's (another cap or step size: another number of processes without a global batch
    they divide); at an epoch's end any number of processes continues."""
    plan, unit = run.plan, run.unit
    saved = (state.step_group or plan.group, state.micro_batch or plan.micro_batch)
    if state.batch == 0 or saved == (plan.group, plan.micro_batch):
        return
    raise TrainingError(
        f"{run.exp}: the newest checkpoint (step {state.step}) stopped mid-epoch, its steps {saved[0]} micro-batches "
        f"of at most {saved[1]:g} {unit.symbol} written by {state.processes} process(es); with {plan.world_size} "
        f"this run cuts them as {plan.group} of {plan.micro_batch:g} {unit.symbol} and would not continue at the "
        f"same data: resume with {state.processes} process(es), or set {unit.step_setting} to a multiple of "
        f"{unit.cap_setting} that both numbers of processes divide")


def _save_checkpoint(run: Run, state: State, *, valid_loss: float | None) -> None:
    """Rank 0 writes EXP/checkpoints/ckpt-<step>.pt and prunes old ones; the others wait."""
    tc = run.training
    state.step_group, state.micro_batch = run.plan.group, run.plan.micro_batch
    state.processes = run.ctx.world_size
    rngs = run.ctx.all_gather_object(rng_state(run.ctx.device))
    if run.ctx.main:
        save_checkpoint(run.exp, run.envelope(run.model), optimizer=run.optimizer, scaler=run.scaler,
                        state=vars(state), valid_loss=valid_loss, keep_last=tc.keep_last, keep_best=tc.keep_best,
                        rng=rngs)
    run.ctx.barrier()


def finish_run(run: Run, logger: TrainLog) -> Path:
    """Write EXP/<final_name> (the model file) and the curves (rank 0)."""
    path = run.exp / run.final_name
    if run.ctx.main:
        save_atomic(run.envelope(run.model), path)
        plot_curves(logger.path, run.exp / "curves.png")
        logger.close()
    run.ctx.barrier()
    return path


# ---------------------------------------------------------------------------------------------
# the loop: epochs, steps, validation


def fit(run: Run, state: State, task: Task, loaders: Loaders, logger: TrainLog) -> None:
    """Epochs of training, each followed by validation and a checkpoint, until a stop condition."""
    tc = run.training
    if not state.total_steps:  # every epoch counted at the whole training set's length
        loaders.train.set_epoch(0)
        state.total_steps = total_steps(tc, loaders.train.batches.epoch_batches() // run.plan.group)
        log.info("learning-rate schedule over %d steps", state.total_steps)
    started = None
    while not _why_stop(tc, state):
        train_loader = loaders.of(state.epoch)
        finished = train_one_epoch(run, state, task, train_loader, logger, started)  # False: max_steps reached
        _report_skipped(run, train_loader)
        if tc.compile:
            log.info("torch.compile: %d graphs compiled so far", compiled_graphs())
        # the next epoch's first batches load while the validation runs (and its checkpoint is written)
        started = _start_epoch(loaders.of(state.epoch + 1), state.epoch + 1) if finished and (
            state.epoch + 1 < tc.epochs) else None
        _validate_and_checkpoint(run, state, task, loaders.valid, logger, end_of_epoch=finished)
    log.info("training stopped: %s (%d steps, %s)", _why_stop(tc, state), state.step, run.unit.describe(state.trained))


def _start_epoch(loader, epoch: int, start_batch: int = 0) -> tuple[int, Iterator]:
    """(epoch, the loader's iterator from `start_batch` of it): a loader with worker processes
    starts loading its first batches now."""
    loader.set_epoch(epoch, start_batch)
    return epoch, iter(loader)


def _why_stop(tc: TrainingConfig, state: State) -> str:
    """Why training is over, or "": from the saved state alone, so that a run resumed from its
    last checkpoint (killed while writing the final model) stops where it stopped."""
    if _max_steps_reached(tc, state):
        return "max_steps reached"
    if tc.patience and state.epochs_without_gain >= tc.patience:
        return f"no better validation loss for {tc.patience} epochs"
    return f"{state.epoch} epochs done" if state.epoch >= tc.epochs else ""


def _max_steps_reached(tc: TrainingConfig, state: State) -> bool:
    return tc.max_steps > 0 and state.step >= tc.max_steps


def _report_skipped(run: Run, loader) -> None:
    """Count the training examples skipped so far, over all ranks (each was reported once, with
    its reason, when first met)."""
    ctx = run.ctx
    count = ctx.all_reduce(torch.tensor([float(len(loader.skipped))], device=ctx.device))
    if count.item():
        log.warning("%d training %ss skipped so far (each reported above, with its reason)", count.item(),
                    run.unit.example)


def train_one_epoch(run: Run, state: State, task: Task, loader, logger: TrainLog,
                    started: tuple[int, Iterator] | None = None) -> bool:
    """Optimizer steps from the saved position to the end of the epoch; False when max_steps
    stopped it early. `started`: (epoch, the loader's iterator) when `fit` started reading this
    epoch from its beginning already."""
    tc, world = run.training, run.ctx.world_size
    done = state.batch // world  # this rank's micro-batches (the position is a whole number of steps)
    if started is None or started[0] != state.epoch or done:
        started = _start_epoch(loader, state.epoch, done)
    total = done + len(loader)
    run.model.train()
    logger.start_clock()
    stager = Stager(task, run.ctx.device)
    group: list = []
    # closed however the epoch ends, so that an error message starts on a line of its own
    with progress(run.ctx.main, total, done, f"epoch {state.epoch + 1}/{tc.epochs}") as bar:
        for batch in started[1]:
            group.append(batch)
            if len(group) < run.plan.accum and state.batch // world + len(group) < total:
                continue
            train_step(run, state, task, group, logger, bar, stager)
            group = []
            if _max_steps_reached(tc, state):
                return False
            # not at the epoch's last step: its validation's checkpoint, of the same step, follows
            # (writing the step's file twice would let a kill between a file and the index leave
            # the index describing the other one)
            if tc.checkpoint_every and state.step % tc.checkpoint_every == 0 and state.batch // world < total:
                _save_checkpoint(run, state, valid_loss=None)
    return True


def train_step(run: Run, state: State, task: Task, group: list, logger: TrainLog, bar,
               stager: Stager | None = None) -> None:
    """One optimizer step over the micro-batches `group`, or a skipped one when the gradient
    norm is not finite or every micro-batch ran out of memory; then its log. One host
    synchronization (the gradient norm's), and the log's every training.log_every steps."""
    for g in run.optimizer.param_groups:
        g["lr"] = learning_rate(run.training, state.step, state.total_steps)
    consumed = len(group)
    norm, sums, group, bad_loss = _accumulate(run, state, task, group, stager or Stager(task, run.ctx.device))
    if group:  # without a backward there is nothing to unscale (fp16's scaler would refuse)
        run.scaler.unscale_(run.optimizer)
    grad_norm = torch.nn.utils.clip_grad_norm_(run.model.parameters(), run.training.grad_clip)
    state.batch += consumed * run.ctx.world_size
    # The one host synchronization of a step: skipping is decided from the gradient norm,
    # which is the same on every rank after DDP's all-reduce.
    if not group:
        _skip_step(run, state, f"every {run.unit.example} of the batch ran out of memory alone")
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
    _log_step(run, state, task, group, consumed, sums, norm, grad_norm, logger, bar)


def _log_step(run: Run, state: State, task: Task, group: list, consumed: int, sums: torch.Tensor,
              norm: torch.Tensor, grad_norm: torch.Tensor, logger: TrainLog, bar) -> None:
    """Count the step's work and log it; a train record may say the model is not learning."""
    amount = task.amount(group) * run.ctx.world_size  # this rank's share times the ranks: near enough
    state.trained += amount
    record = logger.train_step(state.step, state.epoch + 1, sums, norm, grad_norm, bar, run.training.log_every,
                               consumed, lr=run.optimizer.param_groups[0]["lr"], speed=logger.throughput(amount),
                               trained=state.trained, skipped_steps=state.skipped_steps)
    if record is not None:
        _check_learning(run, state, task, record, logger)


def _check_learning(run: Run, state: State, task: Task, record: dict, logger: TrainLog) -> None:
    """Once per run (rank 0), past the warmup: the task's warning when a train record says the
    model is not learning (for speech, a CTC loss per token still near chance)."""
    if state.plateau_reported or state.step < run.training.warmup_steps:
        return
    warning = task.not_learning(record, state.trained)
    if warning is not None:
        state.plateau_reported = True
        what, message, values = warning
        logger.warning(state.step, state.epoch + 1, what,
                       f"after {state.step} steps ({run.unit.describe(state.trained)}): {message}", **values)


def _accumulate(run: Run, state: State, task: Task, group: list,
                stager: Stager) -> tuple[torch.Tensor, torch.Tensor, list, torch.Tensor]:
    """Forward and backward of the micro-batches of one step: (the global counts, the summed
    `step_sums`, the micro-batches used, how many of their losses were not finite: a tensor, read
    only when the gradients are not finite). In one process, a micro-batch that runs out of memory
    is split in halves and the step started again (one that holds a single example is left out);
    under DDP the ranks cannot retry alone, so running out of memory ends the job."""
    while True:
        counts = run.ctx.all_reduce(_to_device(task.counts(group), run.ctx.device))
        norm = counts.clamp(min=1.0)
        sums, bad_loss, failed = _forward_backward_all(run, state, task, group, norm, stager)
        if failed is None:
            return norm, sums, group, bad_loss
        run.optimizer.zero_grad(set_to_none=True)  # the failed backward may have added some
        if run.ctx.device.type == "cuda":
            torch.cuda.empty_cache()  # the failed step's blocks, for the halves to fit
        group = group[:failed] + task.halves(group[failed], state.step + 1) + group[failed + 1:]


def _to_device(values: list[float], device: torch.device) -> torch.Tensor:
    """float64 `values` on `device`, without blocking the host (copied from pinned memory on CUDA)."""
    host = torch.tensor(values, dtype=torch.float64)
    return (host.pin_memory() if device.type == "cuda" else host).to(device, non_blocking=True)


def _forward_backward_all(run: Run, state: State, task: Task, group: list, norm: torch.Tensor,
                          stager: Stager) -> tuple[torch.Tensor, torch.Tensor, int | None]:
    """(the summed `step_sums` of the group, the count of non-finite losses, the index of the
    micro-batch that ran out of memory or None). Each micro-batch after the first is staged as
    soon as the one before it is queued, to overlap it."""
    sums = torch.zeros(len(task.step_sums), device=run.ctx.device, dtype=torch.float64)
    bad_loss = torch.zeros((), device=run.ctx.device)
    ahead = None
    for i, batch in enumerate(group):
        try:
            staged = stager.take(ahead if ahead is not None else stager.issue(batch))
            ahead = None
            batch_sums, finite = _forward_backward(run, task, batch, staged, norm, sync=i == len(group) - 1)
            sums += batch_sums
            bad_loss += ~finite
        except torch.OutOfMemoryError:
            if run.ctx.distributed:
                raise TrainingError(
                    f"rank {run.ctx.rank}: out of memory at step {state.step + 1} on {task.describe(batch)}; under "
                    f"DDP the ranks cannot retry alone, so the job stops: {resume_hint(run.exp)} (or start a new "
                    f"--exp-dir with a smaller {run.unit.cap_setting})") from None
            return sums, bad_loss, i  # leaving the handler frees the failed step's tensors
        if i + 1 < len(group):
            try:
                ahead = stager.issue(group[i + 1])
            except torch.OutOfMemoryError:  # staged again at its turn, where running out of memory is its own
                ahead = None
    return sums, bad_loss, None


def _forward_backward(run: Run, task: Task, batch, staged, norm: torch.Tensor, *,
                      sync: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The task's loss of one micro-batch (`staged`: its Task.stage), backward (DDP's gradient
    all-reduce on the last of a step, `sync`); returns its detached `step_sums` and whether the
    loss is finite (a tensor: no host synchronization)."""
    ctx = run.ctx
    empty = len(batch.ids) == 0  # this rank's batch emptied: the placeholder's zero-loss step, so
    # that DDP's all-reduce still happens (Stager stages it)
    with run.wrapped.no_sync() if ctx.distributed and not sync else contextlib.nullcontext():
        with run.autocast():
            loss, sums = task.loss(run.wrapped, staged, norm)
        loss = loss * (0.0 if empty else ctx.world_size)  # DDP averages gradients over ranks
        run.scaler.scale(loss).backward()
    return (torch.zeros_like(sums) if empty else sums), torch.isfinite(loss.detach())


class Stager:
    """Stages training micro-batches (Task.stage) for the step: on CUDA on a side stream, so that
    a batch's copies to the device (and the task's work on it there: speech's frontend) run while
    the micro-batch before it computes; on other devices in line, the same batches. A batch whose
    examples were all skipped is staged as the task's placeholder. One per epoch: it is made after
    the work its batches read on the device (the task's constants: CMVN) is queued."""

    def __init__(self, task: Task, device: torch.device):
        self.task = task
        self.stream = None
        if device.type == "cuda":
            self.stream = torch.cuda.Stream(device)
            self.stream.wait_stream(torch.cuda.current_stream(device))

    def issue(self, batch) -> tuple[Any, Any]:
        """Stage `batch`: (what Task.stage returned, the CUDA event its side-stream work ends with
        or None); hand it to `take` before use."""
        batch = batch if batch.ids else self.task.placeholder()
        if self.stream is None:
            return self.task.stage(batch), None
        with torch.cuda.stream(self.stream):
            staged = self.task.stage(batch)
            done = torch.cuda.Event()
            done.record(self.stream)
        return staged, done

    def take(self, issued: tuple[Any, Any]) -> Any:
        """The staged batch of `issue`, ready for the current stream: that stream waits (on the
        device, not the host) for the staging, and the allocator learns that it uses the staged
        tensors (allocated on the side stream), so they outlive its work on them."""
        staged, done = issued
        if done is not None:
            current = torch.cuda.current_stream(self.stream.device)
            current.wait_event(done)
            for leaf in tree_leaves(staged):
                if isinstance(leaf, torch.Tensor) and leaf.device.type == "cuda":
                    leaf.record_stream(current)
        return staged


def _scaler_overflow(run: Run, bad_loss: torch.Tensor) -> bool:
    """Whether non-finite gradients are fp16's scaled gradients overflowing (the loss finite on
    every rank, the gradient scaler on and its scale above 1: it halves it in `update`) rather
    than a bad step.
    All ranks decide alike: they reach this together, and the loss check is all-reduced."""
    if not run.scaler.is_enabled() or run.scaler.get_scale() <= 1.0:  # at scale 1 it is the gradients
        return False
    return float(run.ctx.all_reduce(bad_loss)) == 0.0


def _skip_step(run: Run, state: State, reason: str) -> None:
    state.bad_steps += 1
    state.skipped_steps += 1
    log.warning("step %d: %s; step skipped (%d in a row, %d in all)", state.step + 1, reason, state.bad_steps,
                state.skipped_steps)
    if state.bad_steps >= run.training.max_bad_steps:
        raise TrainingError(f"{state.bad_steps} steps in a row skipped, the last for {reason}: training stopped "
                            f"(lower the learning rate or {run.unit.cap_setting}, or check the data); "
                            f"{resume_hint(run.exp)}")


def _validate_and_checkpoint(run: Run, state: State, task: Task, loader, logger: TrainLog, *,
                             end_of_epoch: bool) -> None:
    result = compute_validation_loss(run, task, loader)
    result.update(epoch=state.epoch + 1, step=state.step)
    state.history.append(result)
    logger.valid(result)
    if run.ctx.main:  # EXP/<folder>/epoch<k>/<name>.png and TensorBoard (speech: the attention pictures)
        for folder, images in task.pictures(run.model).items():
            logger.pictures(folder, result["epoch"], state.step, images)
    if result["loss"] < state.best_loss - 1e-6:
        state.best_loss, state.epochs_without_gain = result["loss"], 0
    else:
        state.epochs_without_gain += 1
    if end_of_epoch:
        state.epoch, state.batch = state.epoch + 1, 0
    _save_checkpoint(run, state, valid_loss=result["loss"])


@torch.no_grad()
def compute_validation_loss(run: Run, task: Task, loader) -> dict[str, float]:
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
