"""What the training loop (asr.trainer) asks of a task: `Task`, and the `Unit` its work is counted in.

The loop knows a batch only as something with `ids` (its examples); the task knows the rest: how
a batch is made ready on the device (`stage`), the loss of a batch and its normalizers, what is
logged, what a validation measures, how a batch that ran out of memory is split, and what its work
is counted in (seconds of audio, tokens). The steps, accumulation, skipping, validation and
checkpoints of the loop are the same for any task.

Host and device: `counts`, `amount`, `halves` and `describe` read the batches as the loader gave
them, on the host; `stage` issues a batch's copies to the device without waiting for them (and the
task's own work there); `loss` reads nothing back. So a training step waits for the device once,
for the loop's non-finite check.

Speech recognition's task is asr.asr_task.ASRTask (seconds of audio), language modelling's
asr.lm_train.LMTask (tokens).
"""
from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch

__all__ = ["Autocast", "Task", "Unit"]

Autocast = Callable[[], AbstractContextManager]  # the run's precision for a forward


@dataclass(frozen=True)
class Unit:
    """What a task's work is counted in, as the log, the records and the messages say it: the
    micro-batch cap, a step's size, the throughput and the total trained on."""

    name: str  # the sizes, plural: "seconds" ("micro-batches of at most 60 padded seconds")
    symbol: str  # after a number: "s" ("(480 s)")
    example: str  # one example of a batch: "utterance"
    cap_setting: str  # the config key that caps a micro-batch: "data.max_batch_seconds"
    step_setting: str  # the config key of a step's size over all processes: "training.global_batch_seconds"
    speed_key: str  # the throughput in train records, units per wall second: "audio_s_per_s"
    total_key: str  # the amount trained on so far in train records: "audio_hours"
    total_name: str  # the same in words: "hours of audio"
    total_scale: float = 1.0  # the total's value per unit: 1 / 3600 for hours of audio

    def total(self, amount: float) -> float:
        """`amount` (in the unit) as total_key counts it."""
        return amount * self.total_scale

    def describe(self, amount: float) -> str:
        """`amount` as the log says it: "0.25 hours of audio", "12,288 tokens"."""
        value = self.total(amount)
        return f"{value:,.0f} {self.total_name}" if value >= 1000 else f"{value:.3g} {self.total_name}"


class Task(Protocol):
    """What the loop asks of the batches it trains on. A batch has `ids` (its examples; none on
    a rank whose batch emptied); everything else about it is the task's. The loop calls `loss`
    and `validation` under the run's autocast."""

    unit: Unit  # what `amount` counts; the run's sizes are in it
    step_sums: tuple[str, ...]  # what `loss` sums over a micro-batch, for the log
    valid_sums: tuple[str, ...]  # what `validation` sums over a batch

    def counts(self, group: list) -> list[float]:
        """The loss normalizers of a step's micro-batches on this rank (the loop sums them over ranks)."""

    def stage(self, batch: Any) -> Any:
        """A training micro-batch made ready for `loss`: its tensors copied to the device without
        blocking the host (`non_blocking=True`; the loader pins them on CUDA), and the task's own
        work on it done or queued there. It reads nothing of the device's, and draws nothing from
        torch's global generator (dropout's), so the loop may stage a batch while the one before it
        computes: on CUDA it runs on a side stream (asr.trainer), one micro-batch ahead. What it
        returns has the batch's `ids`."""

    def loss(self, model: torch.nn.Module, batch: Any, counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(the loss of one micro-batch, staged (`stage`), divided by the global `counts`, its
        `step_sums` detached in float64); no host synchronization."""

    def summarize(self, sums: list[float], counts: list[float], steps: int) -> dict[str, float]:
        """The metrics of a train record from `step_sums` and counts summed over `steps` steps."""

    def amount(self, group: list) -> float:
        """What a step's micro-batches hold, in `unit` (seconds of audio, tokens)."""

    def placeholder(self) -> Any:
        """A small batch whose zero-weighted loss keeps an emptied rank in DDP's all-reduce."""

    def halves(self, batch: Any, step: int) -> list:
        """The halves of a micro-batch that ran out of memory, or [] when it holds one example."""

    def describe(self, batch: Any) -> str:
        """The batch in a message: "a batch of N utterances (longest S s)"."""

    def validation(self, model: torch.nn.Module, batch: Any) -> torch.Tensor:
        """The `valid_sums` of one batch, in float64."""

    def valid_metrics(self, sums: list[float]) -> dict[str, float]:
        """The validation's results ("loss" first) from `valid_sums` summed over the valid set."""

    def decode_metrics(self, model: torch.nn.Module, autocast: Autocast) -> dict[str, float]:
        """Metrics that decode (error rates), on rank 0; {} for none."""

    def pictures(self, model: torch.nn.Module) -> dict[str, dict[str, np.ndarray]]:
        """Pictures of the model drawn at each validation (rank 0): (H, W, 3 or 4) uint8 images by
        folder, then by file name ("attention" -> "u0.png" -> image); {} for none."""

    def not_learning(self, record: dict[str, Any], trained: float) -> tuple[str, str, dict[str, float]] | None:
        """(what, a one-line message with the likely causes, the numbers behind it) when a train
        record, `trained` (in `unit`) into the run, says the model is not learning; None when it is
        (or it is too early to tell)."""
