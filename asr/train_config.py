"""A training config (conf/*.yaml): its sections, how its steps are cut for a number of processes
(`batch_plan`) and the learning rate of each step.

    config = load_experiment_config("conf/synth.yaml", ["training.lr=1e-3"])
    plan = batch_plan(config, world_size=8)   # micro-batches per process and step, their cap
    lr = learning_rate(config.training, step, total_steps(config.training, steps_per_epoch))
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Literal

from asr.config import load_config
from asr.loader import DataConfig
from asr.model import ModelConfig

__all__ = ["BatchPlan", "ExperimentConfig", "TokenizerConfig", "TrainingConfig", "batch_plan", "learning_rate",
           "load_experiment_config", "plan_batches", "total_steps"]


@dataclass(frozen=True)
class TokenizerConfig:
    """The tokenizer `asr train` builds when none is given."""

    kind: Literal["char", "bpe", "unigram"] = "char"
    vocab_size: int | None = None  # sentencepiece pieces (bpe, unigram)


@dataclass(frozen=True)
class TrainingConfig:
    seed: int = 0
    epochs: int = 50
    max_steps: int = 0  # stop after this many optimizer steps (0: no limit)
    optimizer: Literal["adam", "adamw"] = "adamw"
    lr: float = 1e-3  # peak learning rate
    betas: tuple[float, float] = (0.9, 0.98)
    eps: float = 1e-9
    weight_decay: float = 1e-2
    scheduler: Literal["noam", "cosine", "constant"] = "noam"
    warmup_steps: int = 25000  # optimizer steps
    min_lr: float = 0.0  # the floor of the cosine schedule
    grad_clip: float = 5.0
    # padded audio seconds of one optimizer step over all processes, a multiple of
    # data.max_batch_seconds (the micro-batch); 0: each process accumulates accum_grad micro-batches
    global_batch_seconds: float = 0.0
    accum_grad: int = 1  # micro-batches per process and optimizer step, without global_batch_seconds
    precision: Literal["auto", "fp32", "bf16", "fp16"] = "auto"  # auto: bf16 on GPUs that have it
    compile: bool = False  # torch.compile the model
    checkpoint_every: int = 1000  # optimizer steps between mid-epoch checkpoints (0: epoch ends only)
    keep_last: int = 5  # checkpoints kept by recency
    keep_best: int = 10  # epoch checkpoints kept by validation loss (for `asr average`)
    valid_decode_utts: int = 50  # utterances greedily decoded for CER/WER at each validation
    # validation utterances (the first of that decode subset) whose attention pictures (asr.attention_plot:
    # the reference transcript teacher-forced) are drawn at each validation into EXP/attention/epoch<k>/<id>.png
    # and TensorBoard (0: none)
    attention_plots: int = 2
    patience: int = 0  # stop after this many epochs without a better validation loss (0: never)
    max_bad_steps: int = 20  # stop after this many non-finite steps in a row
    log_every: int = 10  # optimizer steps between log lines / TensorBoard points
    # a length curriculum (asr.curriculum): the first epochs, as many as make about split_hours of
    # audio (at least one), train on the training utterances cut into pieces of about split_seconds,
    # the words dealt in proportion to time; utterances shorter than 1.5 x split_seconds stay whole
    # (0: whole utterances from the start)
    split_hours: float = 0.0
    split_seconds: float = 5.0
    # hours of training audio (all processes) after which, once past the warmup, a CTC loss per token
    # still near chance (ln V) is reported, once, in the log and metrics.jsonl (0: never)
    plateau_check_hours: float = 20.0
    device: str = "auto"  # auto: cuda:LOCAL_RANK when available, else cpu
    num_threads: int = 0  # torch CPU threads per process (0: torch's default)


@dataclass(frozen=True)
class ExperimentConfig:
    """A whole training config file: conf/*.yaml."""

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
        if tc.global_batch_seconds:
            micro = tc.global_batch_seconds / cap
            if tc.accum_grad != 1:
                raise ValueError("set training.global_batch_seconds or training.accum_grad, not both (the "
                                 "accumulation follows from the global batch and the number of processes)")
            if micro < 1 or abs(micro - round(micro)) > 1e-6:
                raise ValueError(f"training.global_batch_seconds ({tc.global_batch_seconds:g}) must be a whole "
                                 f"multiple of data.max_batch_seconds ({cap:g})")


@dataclass(frozen=True)
class BatchPlan:
    """How one process of `world_size` takes its part of each optimizer step."""

    world_size: int
    accum: int  # micro-batches per process and step
    micro_batch_seconds: float  # padded seconds of one micro-batch at most (a language model's: padded tokens)

    @property
    def group(self) -> int:
        """Micro-batches of one step, all processes."""
        return self.world_size * self.accum

    @property
    def step_seconds(self) -> float:
        """Padded seconds of one step at most, all processes."""
        return self.group * self.micro_batch_seconds


def batch_plan(config: ExperimentConfig, world_size: int) -> BatchPlan:
    """The accumulation and micro-batch cap of each of `world_size` processes. With a global batch
    of G micro-batches and W processes dividing G: G / W micro-batches each, at data.max_batch_seconds,
    so every such W makes the same steps. Otherwise each process accumulates ceil(G / W) micro-batches
    under a lower cap, so the step keeps its size (but is cut differently). Without a global batch:
    accum_grad micro-batches per process (the step grows with W)."""
    tc = config.training
    return plan_batches(tc.global_batch_seconds, config.data.max_batch_seconds, tc.accum_grad, world_size)


def plan_batches(global_batch: float, cap: float, accum_grad: int, world_size: int) -> BatchPlan:
    """batch_plan in any unit (padded seconds of audio, padded tokens of text): a global batch of
    `global_batch` (0: none, each process accumulates `accum_grad`) in micro-batches of `cap`."""
    if not global_batch:
        return BatchPlan(world_size, accum_grad, cap)
    micro = round(global_batch / cap)
    if micro % world_size == 0:
        return BatchPlan(world_size, micro // world_size, cap)
    accum = math.ceil(micro / world_size)
    return BatchPlan(world_size, accum, global_batch / (world_size * accum))


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


def load_experiment_config(path: str, overrides: list[str]) -> ExperimentConfig:
    return load_config(ExperimentConfig, path, overrides)
