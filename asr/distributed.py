"""The process a training run lives in: one process, or one rank of a torchrun job.

    ctx = setup_process(device="auto", num_threads=0)
    with sigterm_stops(ctx, hint), collective_errors(ctx, hint):
        ...

`Context` says which rank this is and on which device it computes; `sigterm_stops` and
`collective_errors` turn a SIGTERM and a collective that failed because another rank died into
a one-line TrainingError that ends with `hint()` (where a rerun resumes).
"""
from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from asr.checkpoint import TrainingError

__all__ = ["Context", "collective_errors", "end_process", "setup_process", "sigterm_stops"]


@dataclass
class Context:
    """This process's place in the job."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def main(self) -> bool:
        return self.rank == 0

    def barrier(self) -> None:
        if self.distributed:
            dist.barrier()

    def all_gather_object(self, obj: object) -> list:
        """Every rank's `obj` (picklable), in rank order; [obj] in one process."""
        if not self.distributed:
            return [obj]
        gathered: list = [None] * self.world_size
        dist.all_gather_object(gathered, obj)
        return gathered

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum `tensor` over the ranks in place (nothing to do in one process); returns it."""
        if self.distributed:
            dist.all_reduce(tensor)
        return tensor

    def seed_torch(self, seed: int, *keys: int) -> None:
        """Seed this process's torch generators (CPU and CUDA) from (seed, rank, keys): a stream
        of its own for each rank (dropout). The keys are mixed by numpy's SeedSequence into 63
        bits, as asr.dataset.derive_seed mixes the data's."""
        state = np.random.SeedSequence([seed, self.rank, *keys]).generate_state(2, dtype=np.uint32)
        torch.manual_seed((int(state[0]) << 31) ^ int(state[1]))


def process_device(device: str, local_rank: int) -> torch.device:
    """The device of the process with `local_rank`: "auto" is cuda:LOCAL_RANK when CUDA is
    available, else the CPU; "cuda" without an index is cuda:LOCAL_RANK (each rank of a torchrun
    job its own GPU; torch.cuda.set_device needs an index); anything else as given."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    where = torch.device(device)
    if where.type == "cuda" and where.index is None:
        where = torch.device("cuda", local_rank)
    return where


def setup_process(*, device: str = "auto", num_threads: int = 0) -> Context:
    """One process, or one rank of a torchrun job (env://: RANK, WORLD_SIZE, LOCAL_RANK).

    `device` "auto": cuda:LOCAL_RANK when CUDA is available, else the CPU; `num_threads` > 0 sets
    torch's CPU threads. Ranks other than 0 log warnings and errors only."""
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    local = int(os.environ.get("LOCAL_RANK", 0))
    where = process_device(device, local)
    if where.type == "cuda":
        torch.cuda.set_device(where)
    if num_threads > 0:
        torch.set_num_threads(num_threads)
    if world > 1:
        dist.init_process_group("nccl" if where.type == "cuda" else "gloo", init_method="env://")
    if rank != 0:
        logging.getLogger("asr").setLevel(logging.WARNING)
    return Context(rank, world, local, where)


def end_process(ctx: Context) -> None:
    """Leave the process group, if there is one."""
    if ctx.distributed:
        dist.destroy_process_group()


@contextlib.contextmanager
def sigterm_stops(ctx: Context, hint: Callable[[], str]) -> Iterator[None]:
    """SIGTERM (a scheduler's preemption, or torchrun stopping the other ranks of a job whose
    rank failed) raises a TrainingError that says so, instead of ending the process silently.
    Only in the main thread, where Python can install signal handlers."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    pid = os.getpid()

    def stop(signum, frame):
        if os.getpid() != pid:  # a forked DataLoader worker: die as before
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)
            return
        raise _SigTerm

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    except _SigTerm:
        who = f"rank {ctx.rank}: " if ctx.distributed else ""
        why = " (torchrun stops every rank when one fails: see the first error above)" if ctx.distributed else ""
        raise TrainingError(f"{who}stopped by SIGTERM{why}; {hint()}") from None
    finally:
        signal.signal(signal.SIGTERM, previous)


class _SigTerm(BaseException):
    """What the SIGTERM handler raises: not an Exception (as KeyboardInterrupt is not), so code on
    its way out that skips a bad utterance or retries (`except Exception`) cannot take it for an
    ordinary error; `sigterm_stops` turns it into a TrainingError at its edge."""


@contextlib.contextmanager
def collective_errors(ctx: Context, hint: Callable[[], str]) -> Iterator[None]:
    """Under DDP, a collective that fails because another rank died (gloo: "Connection closed by
    peer", NCCL errors) becomes a one-line TrainingError saying so."""
    try:
        yield
    except TrainingError:
        raise
    except RuntimeError as e:
        if not ctx.distributed or isinstance(e, torch.OutOfMemoryError) or not _is_collective_error(e):
            raise
        reason = " ".join(str(e).split())
        reason = reason.split("] ", 1)[-1][:160]  # without gloo's source location
        raise TrainingError(f"rank {ctx.rank}: lost contact with another rank ({reason}); the job stops: "
                            f"{hint()}") from None


def _is_collective_error(e: RuntimeError) -> bool:
    text = str(e).lower()
    return isinstance(e, dist.DistError) or any(w in text for w in ("gloo", "nccl", "connection", "peer"))
