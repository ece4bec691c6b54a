"""What a training run reports: the progress bar, EXP/metrics.jsonl, TensorBoard and the curves.

EXP/metrics.jsonl holds one JSON record a line: {"kind": "train", "step", "epoch", ...} every
`log_every` optimizer steps (the task's metrics, the learning rate, the gradient norm, the
throughput and the amount trained on so far, in the task's unit: "audio_s_per_s" and
"audio_hours" for speech, "tokens_per_s" and "tokens" for a language model), {"kind": "valid",
"step", "epoch", ...} at each validation and {"kind": "warning", "step", "epoch", "what",
"message", ...} when the run looks wrong (a CTC loss stuck at chance).
TensorBoard (EXP/tensorboard) gets every number of those records as `<kind>/<key>`; `plot_curves`
draws them into a PNG at the end of training. Pictures of a validation (the attention pictures)
go to EXP/<folder>/epoch<k>/<name>.png and to TensorBoard as images `<folder>/<name>`.
What the numbers count is the task's (asr.train_task.Unit); this module knows no task.
"""
from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from asr.fileio import atomic_open
from asr.train_task import Unit

__all__ = ["TrainLog", "plot_curves", "progress", "read_records"]

log = logging.getLogger("asr.train")


# (the step sums summed over the steps since the last record and over the ranks, the loss
# normalizers summed likewise, the number of steps) -> the record's metrics, "loss" first
Summarize = Callable[[list[float], list[float], int], dict[str, float]]


class TrainLog:
    """EXP/metrics.jsonl and TensorBoard (rank 0). A run resumed from step S first drops what the
    interrupted run logged after S (and a line a kill cut short): the steps after S are logged
    again, so the logs read as those of one uninterrupted run.

    What a step's sums mean is the task's: `summarize` turns them into the train record's metrics;
    `unit` names the throughput and the amount trained on (e.g. audio seconds per second, hours)."""

    def __init__(self, exp: Path, enabled: bool, *, summarize: Summarize, unit: Unit, resumed_at: int = 0):
        self.enabled = enabled
        self.summarize, self.unit = summarize, unit
        self.exp, self.path = exp, exp / "metrics.jsonl"
        self.writer = None
        self.pending: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        self.last_step_end = time.perf_counter()
        if enabled:
            from torch.utils.tensorboard import SummaryWriter

            if self.path.is_file():
                kept = [r for r in read_records(self.path) if r.get("step", 0) <= resumed_at]
                with atomic_open(self.path) as f:
                    f.writelines(json.dumps(r) + "\n" for r in kept)
            self.writer = SummaryWriter(str(exp / "tensorboard"), purge_step=resumed_at + 1)

    def _write(self, record: dict[str, Any]) -> None:
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")
        for key, value in record.items():
            if key not in ("kind", "step", "epoch") and isinstance(value, (int, float)):
                self.writer.add_scalar(f"{record['kind']}/{key}", value, record["step"])
        self.writer.flush()

    def start_clock(self) -> None:
        """Throughput is measured from here (an epoch's start) to the end of the next step."""
        self.last_step_end = time.perf_counter()

    def throughput(self, amount: float) -> float:
        """`amount` (what a step processed, all ranks, in the unit) per wall second since the last
        step ended, data waits included."""
        now = time.perf_counter()
        speed, self.last_step_end = amount / max(now - self.last_step_end, 1e-9), now
        return speed

    def train_step(self, step: int, epoch: int, sums: torch.Tensor, norm: torch.Tensor, grad_norm: torch.Tensor,
                   bar, every: int, batches: int, *, lr: float, speed: float, trained: float,
                   skipped_steps: int) -> dict[str, Any] | None:
        """Every rank calls this after each step (`step` optimizer steps taken, `epoch` 1-based,
        `trained` the amount trained on so far, in the unit); every `every` steps the ranks' shares
        of the step `sums` are summed (one all-reduce, the same step on every rank) and rank 0
        writes the record, which it returns (else None)."""
        bar.update(batches)
        self.pending.append((sums, norm, grad_norm))
        if step % every:
            return None
        total = torch.stack([s for s, _, _ in self.pending]).sum(0)  # this rank's shares
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(total)
        total = total.tolist()  # host sync, every N steps
        counts = torch.stack([n for _, n, _ in self.pending]).sum(0).tolist()  # already global
        gnorm, n = float(self.pending[-1][2]), len(self.pending)
        self.pending = []
        if not self.enabled:
            return None
        unit = self.unit
        record = {"kind": "train", "step": step, "epoch": epoch, **self.summarize(total, counts, n), "lr": lr,
                  "grad_norm": gnorm, unit.speed_key: speed, unit.total_key: unit.total(trained),
                  "skipped_steps": skipped_steps}
        self._write(record)
        bar.set_postfix({"loss": f"{record['loss']:.3f}", "lr": f"{lr:.2e}", unit.speed_key: f"{speed:.0f}"})
        return record

    def warning(self, step: int, epoch: int, what: str, message: str, **values: float) -> None:
        """A warning about the run (`what` names it, e.g. "ctc_plateau"): a log line and a record
        {"kind": "warning", "step", "epoch", "what", "message", **values} (rank 0)."""
        if not self.enabled:
            return
        log.warning("step %d: %s", step, message)
        self._write({"kind": "warning", "step": step, "epoch": epoch, "what": what, "message": message, **values})

    def valid(self, result: dict[str, Any]) -> None:
        """One validation's results (with "epoch" and "step"): a record and a log line (rank 0)."""
        if not self.enabled:
            return
        self._write({"kind": "valid", **result})
        parts = ", ".join(f"{k} {v:.4f}" for k, v in result.items() if k not in ("epoch", "step"))
        log.info("epoch %d validation: %s", result["epoch"], parts)

    def pictures(self, folder: str, epoch: int, step: int, images: dict[str, np.ndarray]) -> None:
        """The pictures of a validation, (H, W, 3 or 4) uint8 by file name <name>.png (rank 0): PNG
        files EXP/<folder>/epoch<epoch>/<name>.png and TensorBoard images `<folder>/<name>` at `step`."""
        if not self.enabled or not images:
            return
        from matplotlib.image import imsave

        where = self.exp / folder / f"epoch{epoch}"
        where.mkdir(parents=True, exist_ok=True)
        for file_name, image in images.items():
            with atomic_open(where / file_name, "wb") as f:
                imsave(f, image, format="png")
            self.writer.add_image(f"{folder}/{Path(file_name).stem}", image[..., :3], step, dataformats="HWC")
        self.writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


def read_records(path: Path) -> list[dict[str, Any]]:
    """The records of EXP/metrics.jsonl, skipping a line a kill cut short."""
    records = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict):
            records.append(record)
    return records


def plot_curves(metrics: Path, path: Path) -> None:
    """A PNG of training and validation loss and validation CER/WER against the step, written whole
    (atomic_open). A Figure on its own Agg canvas, as asr.attention_plot draws: the process's
    matplotlib backend and pyplot state are left alone."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    records = read_records(metrics) if metrics.is_file() else []
    train = [r for r in records if r["kind"] == "train"]
    valid = [r for r in records if r["kind"] == "valid"]
    fig = Figure(figsize=(11, 4))
    FigureCanvasAgg(fig)
    ax1, ax2 = fig.subplots(1, 2)
    ax1.plot([r["step"] for r in train], [r["loss"] for r in train], label="train loss", lw=0.8)
    ax1.plot([r["step"] for r in valid], [r["loss"] for r in valid], "o-", label="valid loss")
    ax1.set_xlabel("optimizer step")
    ax1.set_yscale("log")
    ax1.legend()
    for key in ("cer", "wer"):
        ax2.plot([r["step"] for r in valid if key in r], [100 * r[key] for r in valid if key in r], "o-",
                 label=f"valid {key.upper()} (greedy)")
    ax2.set_xlabel("optimizer step")
    ax2.set_ylabel("%")
    ax2.legend()
    fig.tight_layout()
    with atomic_open(path, "wb") as f:  # a crash mid-write leaves the previous plot, not half a PNG
        fig.savefig(f, dpi=100, format="png")


def progress(enabled: bool, total: int, done: int, desc: str):
    """A tqdm bar of `total` batches, `done` of them already (shown on rank 0 only)."""
    from tqdm import tqdm

    return tqdm(total=total, initial=done, desc=desc, disable=not enabled, dynamic_ncols=True, leave=False,
                mininterval=1.0)
