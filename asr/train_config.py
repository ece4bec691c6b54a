"""The `training:` section of a config file, which every task's config shares (asr train's
asr.train_setup.ExperimentConfig, asr lm's asr.lm_train.LMExperimentConfig); how a step is cut
into micro-batches for a number of processes (`plan_batches`), and the micro-batch a device holds
(`auto_micro_batch`); and the learning rate of each step. Sizes are in the task's unit
(asr.train_task.Unit): padded seconds of audio, padded tokens of text.

    plan = plan_batches(global_batch=480.0, cap=60.0, accum_grad=1, world_size=8)  # 1 micro-batch each
    cap = auto_micro_batch(fits, longest=35.0, global_batch=4000.0, world_size=1)  # fits(seconds) -> bool
    lr = learning_rate(config.training, step, total_steps(config.training, steps_per_epoch))
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

__all__ = ["AUTO_MARGIN", "BatchPlan", "TrainingConfig", "auto_micro_batch", "dividing_cap", "learning_rate",
           "plan_batches", "total_steps"]

# The share of the largest micro-batch that fitted which `auto_micro_batch` keeps: room for what the
# probe's forward and backward do not hold (the optimizer's state, made at the first step; the next
# micro-batch, staged while one computes; the allocator's fragmentation over many shapes).
AUTO_MARGIN = 0.85


@dataclass(frozen=True)
class TrainingConfig:
    """The optimizer, schedule, precision, checkpoints and stop conditions of a run. The keys
    marked (speech) are asr train's: an LM config leaves them at rest."""

    seed: int = 0
    epochs: int = 50
    max_steps: int = 0  # stop after this many optimizer steps (0: no limit)
    optimizer: Literal["adam", "adamw"] = "adamw"
    lr: float = 1e-3  # peak learning rate
    betas: tuple[float, float] = (0.9, 0.98)
    eps: float = 1e-9
    weight_decay: float = 1e-2
    decay_norms_and_biases: bool = True  # false: no weight decay on 1-D parameters (biases, LayerNorm
    # scales and shifts), as ESPnet's exclude_weight_decay
    scheduler: Literal["noam", "cosine", "constant"] = "noam"
    warmup_steps: int = 25000  # optimizer steps
    min_lr: float = 0.0  # the floor of the cosine schedule
    grad_clip: float = 5.0
    # (speech) padded audio seconds of one optimizer step over all processes, a multiple of
    # data.max_batch_seconds (the micro-batch); 0: each process accumulates accum_grad micro-batches
    global_batch_seconds: float = 0.0
    accum_grad: int = 1  # micro-batches per process and optimizer step, without global_batch_seconds
    precision: Literal["auto", "fp32", "bf16", "fp16"] = "auto"  # auto: bf16 on GPUs that have it
    compile: bool = False  # torch.compile the model's blocks (asr.trainer.compile_blocks)
    checkpoint_every: int = 1000  # optimizer steps between mid-epoch checkpoints (0: epoch ends only)
    keep_last: int = 5  # checkpoints kept by recency
    keep_best: int = 10  # epoch checkpoints kept by validation loss (for `asr average`)
    valid_decode_utts: int = 50  # (speech) utterances greedily decoded for CER/WER at each validation
    # (speech) validation utterances (the first of that decode subset) whose attention pictures (asr.attention_plot:
    # the reference transcript teacher-forced) are drawn at each validation into EXP/attention/epoch<k>/<id>.png
    # and TensorBoard (0: none)
    attention_plots: int = 2
    patience: int = 0  # stop after this many epochs without a better validation loss (0: never)
    max_bad_steps: int = 20  # stop after this many non-finite steps in a row
    log_every: int = 10  # optimizer steps between log lines / TensorBoard points
    # (speech) a length curriculum (asr.curriculum): the first epochs, as many as make about split_hours of
    # audio (at least one), train on the training utterances cut into pieces of about split_seconds,
    # the words dealt in proportion to time; utterances shorter than 1.5 x split_seconds stay whole
    # (0: whole utterances from the start)
    split_hours: float = 0.0
    split_seconds: float = 5.0
    # (speech) hours of training audio (all processes) after which, once past the warmup, a CTC loss per token
    # still near chance (ln V) is reported, once, in the log and metrics.jsonl (0: never)
    plateau_check_hours: float = 20.0
    # (speech) start from this model file's weights (fine-tuning: `asr train --init-from`): the modules named in
    # init_modules (of encoder, decoder, ctc) are loaded; the output layers (the decoder's embedding and output, the
    # CTC head) are re-initialised when the model file's tokenizer differs from this run's; "" = from scratch
    init_from: str = ""
    init_modules: tuple[str, ...] = ("encoder", "decoder", "ctc")
    device: str = "auto"  # auto: cuda:LOCAL_RANK when available, else cpu
    num_threads: int = 0  # torch CPU threads per process (0: torch's default)


@dataclass(frozen=True)
class BatchPlan:
    """How one process of `world_size` takes its part of each optimizer step, in the task's unit."""

    world_size: int
    accum: int  # micro-batches per process and step
    micro_batch: float  # padded size of one micro-batch at most (seconds of audio, tokens)
    cap: float  # the config's micro-batch cap: micro_batch is lower when the processes do not divide
    # the global batch's micro-batches

    @property
    def group(self) -> int:
        """Micro-batches of one step, all processes."""
        return self.world_size * self.accum

    @property
    def step_size(self) -> float:
        """Padded size of one step at most, all processes."""
        return self.group * self.micro_batch


def plan_batches(global_batch: float, cap: float, accum_grad: int, world_size: int) -> BatchPlan:
    """The accumulation and micro-batch cap of each of `world_size` processes, for a global batch
    of `global_batch` (0: none) in micro-batches of `cap`. With a global batch of G micro-batches
    and W processes dividing G: G / W micro-batches each, at `cap`, so every such W makes the same
    steps. Otherwise each process accumulates ceil(G / W) micro-batches under a lower cap, so the
    step keeps its size (but is cut differently). Without a global batch: `accum_grad`
    micro-batches per process (the step grows with W)."""
    if not global_batch:
        return BatchPlan(world_size, accum_grad, cap, cap)
    micro = round(global_batch / cap)
    if micro % world_size == 0:
        return BatchPlan(world_size, micro // world_size, cap, cap)
    accum = math.ceil(micro / world_size)
    return BatchPlan(world_size, accum, global_batch / (world_size * accum), cap)


def auto_micro_batch(fits: Callable[[float], bool], *, longest: float, global_batch: float, world_size: int,
                     margin: float = AUTO_MARGIN) -> float:
    """The micro-batch cap for a device: the largest padded size n x `longest` (n >= 1 examples of
    the longest length, the worst case for memory, which grows with the square of the length) for
    which `fits(size)` holds (n doubled from 1 until it fails, then bisected; never beyond a
    process's share of the global batch), times `margin`, lowered to divide that share (the
    global batch over world_size x k micro-batches, k >= 1), so that the global batch, and with it
    the schedule, is the same on any device. `fits` must be monotonic (what fits, fits smaller).
    ValueError when the result is below `longest` (such examples would be left out)."""
    share = global_batch / world_size
    most = max(1, math.ceil(share / (margin * longest) - 1e-9))  # examples: more is never needed
    if not fits(longest):
        raise ValueError(f"one example of the longest length ({longest:g}) does not fit on the device")
    good, bad = 1, None
    while bad is None and good < most:
        n = min(2 * good, most)
        good, bad = (n, None) if fits(n * longest) else (good, n)
    while bad is not None and bad - good > 1:
        n = (good + bad) // 2
        good, bad = (n, bad) if fits(n * longest) else (good, n)
    cap = dividing_cap(margin * good * longest, global_batch, world_size)
    if cap < longest:
        raise ValueError(f"{good} example(s) of the longest length ({longest:g}) fit on the device, which leaves "
                         f"{cap:g} with the {margin:g} margin, less than the longest example")
    return cap


def dividing_cap(most: float, global_batch: float, world_size: int) -> float:
    """The largest micro-batch cap at most `most` that divides a process's share of the global
    batch: global_batch / (world_size x k) for the smallest k >= 1."""
    share = global_batch / world_size
    return share / math.ceil(share / most - 1e-9)


def total_steps(tc: TrainingConfig, steps_per_epoch: int) -> int:
    """The length of the learning-rate schedule: max_steps, else every epoch at `steps_per_epoch`."""
    return tc.max_steps or steps_per_epoch * tc.epochs


def learning_rate(tc: TrainingConfig, step: int, total_steps: int) -> float:
    """Learning rate for optimizer step `step` (0-based): linear warmup to `lr`, then inverse
    square root (noam) or cosine to `min_lr` over `total_steps`, or constant."""
    warm = max(tc.warmup_steps, 1)
    s = step + 1
    if tc.scheduler == "constant":
        return tc.lr * min(1.0, s / warm)
    if s <= warm:
        return tc.lr * s / warm
    if tc.scheduler == "noam":
        return tc.lr * math.sqrt(warm / s)
    progress = min(1.0, (s - warm) / max(1, total_steps - warm))
    return tc.min_lr + (tc.lr - tc.min_lr) * 0.5 * (1 + math.cos(math.pi * progress))
