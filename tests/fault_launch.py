"""Run `asr` with a fault injected into the trainer's steps, for the fault tests: a process of
its own, or each rank of a torchrun job.

    python tests/fault_launch.py --nonfinite 0:2 -- train --config ... --exp-dir EXP
    torchrun --nproc_per_node 2 tests/fault_launch.py --oom 1:5:0 -- train ...

--nonfinite RANK:N[,RANK:N...]  RANK's loss is NaN at its N-th optimizer step attempt (1-based:
                                optimizer steps taken + steps skipped + 1)
--oom RANK:N:U                  from its N-th attempt on, RANK runs out of memory
                                (torch.OutOfMemoryError) in every micro-batch of more than U
                                utterances
--rank-weights                  each rank writes its final weights to EXP/weights.rank<RANK>.pt
                                (what DDP keeps equal on every rank, seen from outside)

The faults are patched in (asr.trainer.train_step tells which attempt runs; ASRTask.loss fails),
then asr.cli.main runs the given arguments.
"""
from __future__ import annotations

import argparse
import functools
import os
import sys

import torch

import asr.trainer
from asr.asr_task import ASRTask
from asr.cli import main


def dump_rank_weights() -> None:
    """Patch the trainer's last step: each rank saves its model's weights beside model_last.pt."""
    finish = asr.trainer.finish_run

    @functools.wraps(finish)
    def finish_and_dump(run, logger):
        torch.save(run.model.state_dict(), run.exp / f"weights.rank{os.environ.get('RANK', 0)}.pt")
        return finish(run, logger)

    asr.trainer.finish_run = finish_and_dump


def inject(nonfinite: str | None, oom: str | None) -> None:
    """Patch the trainer: the faults of rank RANK (the torchrun variable; 0 alone)."""
    rank = int(os.environ.get("RANK", 0))
    nan_at = {int(n) for r, n in (spec.split(":") for spec in (nonfinite or "").split(",") if spec) if int(r) == rank}
    oom_rank, oom_from, oom_most = (int(x) for x in oom.split(":")) if oom else (-1, 0, 0)
    attempt = 0
    step = asr.trainer.train_step
    loss = ASRTask.loss

    @functools.wraps(step)
    def train_step(run, state, *args, **kwargs):
        nonlocal attempt
        attempt = state.step + state.skipped_steps + 1
        return step(run, state, *args, **kwargs)

    @functools.wraps(loss)
    def faulty_loss(self, model, batch, counts):
        if rank == oom_rank and attempt >= oom_from and len(batch.ids) > oom_most:
            raise torch.OutOfMemoryError(f"out of memory (injected by {__file__})")
        value, sums = loss(self, model, batch, counts)
        return (value * float("nan") if attempt in nan_at else value), sums

    asr.trainer.train_step = train_step
    ASRTask.loss = faulty_loss


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nonfinite", metavar="RANK:N[,RANK:N...]")
    parser.add_argument("--oom", metavar="RANK:N:U")
    parser.add_argument("--rank-weights", action="store_true")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="-- then the asr command line")
    options = parser.parse_args()
    inject(options.nonfinite, options.oom)
    if options.rank_weights:
        dump_rank_weights()
    sys.exit(main(options.args[1:] if options.args[:1] == ["--"] else options.args))
