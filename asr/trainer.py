"""Training: one process on a CPU or GPU, or DDP through torchrun, resumable after any crash.

    train(config, train_manifest, valid_manifest, exp_dir)

reads like its table of contents: set up the process group, prepare the experiment folder
(config, tokenizer, CMVN), build the model and optimizer, resume from the newest checkpoint,
then loop over epochs (train, validate, checkpoint, early stop) and write the curves.

Losses are normalized by the token and utterance counts of the global batch (all ranks, all
accumulation steps), so a batch split over ranks gives the gradient of one process. Every skip
decision is taken from all-reduced values, so no rank waits forever in a collective.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import os
import random
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist

from asr.checkpoint import CHECKPOINT_FORMAT, VERSION, load_file, model_file, save_atomic
from asr.config import config_diff, load_config, read_yaml, to_dict
from asr.data import Batch, DataConfig, FeatureArchive, FeatureArchiveError, compute_cmvn, make_loader, read_manifest
from asr.features import CMVNStats, GlobalCMVN
from asr.fileio import atomic_open, remove_stale_temporaries
from asr.metrics import normalize_text, score
from asr.model.asr_model import ModelConfig, build_model, ctc_feasible
from asr.search import search
from asr.tokenizer import Tokenizer, load_tokenizer, train_tokenizer

log = logging.getLogger("asr.train")


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
    accum_grad: int = 1  # micro-batches per optimizer step
    precision: Literal["auto", "fp32", "bf16", "fp16"] = "auto"  # auto: bf16 on GPUs that have it
    compile: bool = False  # torch.compile the model
    checkpoint_every: int = 1000  # optimizer steps between mid-epoch checkpoints (0: epoch ends only)
    keep_last: int = 5  # checkpoints kept by recency
    keep_best: int = 10  # epoch checkpoints kept by validation loss (for `asr average`)
    valid_decode_utts: int = 50  # utterances greedily decoded for CER/WER at each validation
    patience: int = 0  # stop after this many epochs without a better validation loss (0: never)
    max_bad_steps: int = 20  # stop after this many non-finite steps in a row
    log_every: int = 10  # optimizer steps between log lines / TensorBoard points
    device: str = "auto"  # auto: cuda:LOCAL_RANK when available, else cpu
    num_threads: int = 0  # torch CPU threads per process (0: torch's default)


@dataclass(frozen=True)
class ExperimentConfig:
    """A whole training config file: conf/*.yaml."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)


class TrainingError(RuntimeError):
    """Training cannot go on (a refused resume, too many non-finite steps, a checkpoint that cannot
    be written, a lost rank, running out of memory under DDP); one line."""


# ---------------------------------------------------------------------------------------------
# the driver


def train(config: ExperimentConfig, train_manifest: str, valid_manifest: str, exp_dir: str | Path, *,
          tokenizer_dir: str | None = None, cmvn_path: str | None = None, feats_dir: str | None = None) -> Path:
    """Train into `exp_dir` (resuming from its newest checkpoint); returns the final model file.

    Whatever stops it (SIGKILL, SIGTERM, a full disk, a lost rank), running the same call again
    resumes from the last checkpoint and ends with the same weights as an uninterrupted run.
    `feats_dir`: a FeatureArchive of training features (`compute_cmvn(..., dump_dir=...)`)."""
    ctx = _setup_process(config.training)
    exp = Path(exp_dir)
    try:
        with _sigterm_stops(exp, ctx), _collective_errors(exp, ctx):
            train_utts, valid_utts = read_manifest(train_manifest), read_manifest(valid_manifest)
            _check_or_save_config(exp, config, ctx)
            tokenizer = _tokenizer(exp, config, train_utts, tokenizer_dir, ctx)
            cmvn = _cmvn(exp, config, train_utts, cmvn_path, ctx)
            run = _build(config, tokenizer, cmvn, _label_rate(tokenizer, train_utts), ctx)
            state = _resume(exp, run, ctx)
            archive = _archive(feats_dir, config)
            loop = _Loop(config, exp, run, state, train_utts, valid_utts, ctx, archive)
            loop.run()
            return loop.finish()
    finally:
        if ctx.distributed:
            dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------
# process, experiment folder, tokenizer, CMVN


@dataclass
class _Context:
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


def _setup_process(tc: TrainingConfig) -> _Context:
    """One process, or one rank of a torchrun job (env://: RANK, WORLD_SIZE, LOCAL_RANK)."""
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    local = int(os.environ.get("LOCAL_RANK", 0))
    if tc.device == "auto":
        device = torch.device(f"cuda:{local}" if torch.cuda.is_available() else "cpu")
    else:
        device = torch.device(tc.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if tc.num_threads > 0:
        torch.set_num_threads(tc.num_threads)
    if world > 1:
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method="env://")
    if rank != 0:
        logging.getLogger("asr").setLevel(logging.WARNING)
    return _Context(rank, world, local, device)


def _resume_hint(exp: Path) -> str:
    """Where a rerun of the same command resumes from."""
    last = read_index(_checkpoint_dir(exp))
    if not last:
        return "rerun the same command to start again (no checkpoint yet)"
    return f"rerun the same command to resume from {_checkpoint_dir(exp) / last[-1]['file']}"


@contextlib.contextmanager
def _sigterm_stops(exp: Path, ctx: _Context):
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
        who = f"rank {ctx.rank}: " if ctx.distributed else ""
        why = " (torchrun stops every rank when one fails: see the first error above)" if ctx.distributed else ""
        raise TrainingError(f"{who}stopped by SIGTERM{why}; {_resume_hint(exp)}")

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextlib.contextmanager
def _collective_errors(exp: Path, ctx: _Context):
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
                            f"{_resume_hint(exp)}") from None


def _is_collective_error(e: RuntimeError) -> bool:
    text = str(e).lower()
    return isinstance(e, dist.DistError) or any(w in text for w in ("gloo", "nccl", "connection", "peer"))


def _check_or_save_config(exp: Path, config: ExperimentConfig, ctx: _Context) -> None:
    """Save the resolved config in EXP; refuse to resume into an EXP trained with another."""
    path = exp / "config.yaml"
    new = to_dict(config)
    if path.is_file():
        diff = config_diff(read_yaml(path), new)
        if diff:
            raise TrainingError(f"{exp} was trained with another config; use a new --exp-dir or the same "
                                f"config. Differences (saved -> now): {'; '.join(diff)}")
    elif ctx.main:
        import yaml

        exp.mkdir(parents=True, exist_ok=True)
        with atomic_open(path) as f:
            f.write(yaml.safe_dump(new, sort_keys=False))
    ctx.barrier()


def _tokenizer(exp: Path, config: ExperimentConfig, utts: list, given: str | None, ctx: _Context) -> Tokenizer:
    """The given tokenizer, or EXP/tokenizer built by rank 0 from the training text."""
    if given:
        return load_tokenizer(given)
    folder = exp / "tokenizer"
    if ctx.main and not (folder / "tokenizer.json").is_file():
        tc = config.tokenizer
        texts = [normalize_text(u.text) for u in utts]
        train_tokenizer(texts, tc.kind, tc.vocab_size).save(folder)
        log.info("built a %s tokenizer in %s", tc.kind, folder)
    ctx.barrier()
    return load_tokenizer(folder)


def _cmvn(exp: Path, config: ExperimentConfig, utts: list, given: str | None, ctx: _Context) -> CMVNStats:
    """The given CMVN statistics, or EXP/cmvn.json computed by rank 0."""
    path: str | Path
    if given:
        path = given
    else:
        path = exp / "cmvn.json"
        if ctx.main and not path.is_file():
            log.info("computing CMVN statistics over %d utterances", len(utts))
            computed = compute_cmvn(utts, config.data.features, num_workers=config.data.num_workers)
            if computed.count == 0:
                raise TrainingError(f"none of the {len(utts)} training utterances has usable audio "
                                    "(see the warnings above)")
            computed.save(path)
        ctx.barrier()
    stats = CMVNStats.load(path)
    _check_mel_bins(config, stats.dim, str(path))
    return stats


def _archive(folder: str | None, config: ExperimentConfig) -> FeatureArchive | None:
    if folder is None:
        return None
    try:
        return FeatureArchive(folder, config.data.features)
    except FeatureArchiveError as e:
        raise TrainingError(str(e)) from None


def _check_mel_bins(config: ExperimentConfig, cmvn_dim: int | None, source: str) -> None:
    """One line naming the three numbers when the frontend, the model and the CMVN statistics
    disagree on the mel bins (otherwise a shape error deep in a loader worker)."""
    features, model = config.data.features.n_mels, config.model.n_mels
    if not features == model == cmvn_dim:
        raise TrainingError(f"mel bins disagree: data.features.n_mels = {features}, model.n_mels = {model}, "
                            f"{cmvn_dim} in the CMVN statistics {source}")


# ---------------------------------------------------------------------------------------------
# model, optimizer, schedule, precision


@dataclass
class _Run:
    """Everything the loop updates, and what a checkpoint holds."""

    model: torch.nn.Module  # the bare model
    wrapped: torch.nn.Module  # DDP / compiled wrapper used for forward
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler
    autocast_dtype: torch.dtype | None
    tokenizer: Tokenizer
    cmvn_stats: CMVNStats
    cmvn: GlobalCMVN
    config: ExperimentConfig  # with model.vocab_size filled in from the tokenizer


def _label_rate(tokenizer: Tokenizer, utts: list) -> float:
    """Mean target tokens per second of the training set; logs symbols the tokenizer maps to unk."""
    texts = [normalize_text(u.text) for u in utts]
    unknown = tokenizer.count_unknown(texts)
    if unknown:
        top = ", ".join(f"{sym!r} x{n}" for sym, n in unknown.most_common(10))
        log.warning("%d symbols of the training text map to unk: %s", sum(unknown.values()), top)
    seconds = sum(u.duration for u in utts)
    return sum(len(tokenizer.encode(t)) for t in texts) / max(seconds, 1e-9)


def _build(config: ExperimentConfig, tokenizer: Tokenizer, stats: CMVNStats, label_rate: float,
           ctx: _Context) -> _Run:
    tc = config.training
    torch.manual_seed(tc.seed)
    config = dataclasses.replace(config, model=dataclasses.replace(config.model, vocab_size=tokenizer.vocab_size))
    model = build_model(config.model, tokens_per_second=label_rate).to(ctx.device)
    wrapped = model
    if tc.compile:
        wrapped = torch.compile(wrapped)
    if ctx.distributed:
        ids = [ctx.device.index] if ctx.device.type == "cuda" else None
        wrapped = torch.nn.parallel.DistributedDataParallel(wrapped, device_ids=ids)
    opt_cls = torch.optim.AdamW if tc.optimizer == "adamw" else torch.optim.Adam
    # fused: one kernel over all parameters; on a CPU the default (one op chain per tensor) took
    # 7 ms of a 50-80 ms synth step (1 thread), fused 1.2 ms (the same update to 1e-7)
    fused = ctx.device.type in ("cpu", "cuda")
    optimizer = opt_cls(model.parameters(), lr=tc.lr, betas=tc.betas, eps=tc.eps, weight_decay=tc.weight_decay,
                        fused=fused or None)
    dtype = _autocast_dtype(tc.precision, ctx.device)
    scaler = torch.amp.GradScaler(ctx.device.type, enabled=dtype == torch.float16)
    n_params = sum(p.numel() for p in model.parameters())
    log.info("model: %.2fM parameters, vocabulary %d, device %s, precision %s, %d process(es)",
             n_params / 1e6, tokenizer.vocab_size, ctx.device, dtype or "fp32", ctx.world_size)
    return _Run(model, wrapped, optimizer, scaler, dtype, tokenizer, stats, GlobalCMVN(stats), config)


def _autocast_dtype(precision: str, device: torch.device) -> torch.dtype | None:
    if precision == "fp32" or (precision == "auto" and device.type != "cuda"):
        return None
    if precision == "bf16" or (precision == "auto" and torch.cuda.is_bf16_supported()):
        return torch.bfloat16
    return torch.float16


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


# ---------------------------------------------------------------------------------------------
# checkpoints


@dataclass
class _State:
    epoch: int = 0
    batch: int = 0  # this rank's batches consumed in `epoch` (all ranks consume the same count)
    step: int = 0  # optimizer steps taken
    bad_steps: int = 0  # non-finite steps in a row
    skipped_steps: int = 0  # non-finite steps in all
    best_loss: float = math.inf
    epochs_without_gain: int = 0
    history: list = field(default_factory=list)  # validation results, one dict per epoch


def _checkpoint_dir(exp: Path) -> Path:
    return exp / "checkpoints"


def _save_checkpoint(exp: Path, run: _Run, state: _State, ctx: _Context, *, valid_loss: float | None) -> None:
    """Rank 0 writes EXP/checkpoints/ckpt-<step>.pt atomically, then prunes old ones."""
    if ctx.main:
        obj = _model_envelope(run)
        obj.update(
            format=CHECKPOINT_FORMAT, version=VERSION,
            optimizer=run.optimizer.state_dict(), scaler=run.scaler.state_dict(),
            state={k: v for k, v in vars(state).items()},
            valid_loss=valid_loss,
            rng={"torch": torch.get_rng_state(), "python": random.getstate(),
                 "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []},
        )
        folder = _checkpoint_dir(exp)
        path = folder / f"ckpt-{state.step:08d}.pt"
        try:
            save_atomic(obj, path)
            _write_index(folder, state.step, state.epoch, valid_loss)
            _prune(folder, run)
        except OSError as e:  # a full disk: the previous checkpoints are intact
            raise TrainingError(f"cannot write checkpoint {path}: {e.strerror or e}; training stopped, "
                                f"nothing saved is lost: once fixed, {_resume_hint(exp)}") from None
    ctx.barrier()


def _model_envelope(run: _Run) -> dict[str, Any]:
    """The DESIGN.md model file of the current weights (a checkpoint adds training state)."""
    frontend = {"features": to_dict(run.config.data.features), "cmvn": run.cmvn_stats.to_dict()}
    return model_file(model=to_dict(run.config.model), frontend=frontend, tokenizer=run.tokenizer.to_dict(),
                      state_dict=run.model.state_dict())


def _index_path(folder: Path) -> Path:
    return folder / "index.json"


def read_index(folder: Path) -> list[dict[str, Any]]:
    """EXP/checkpoints/index.json: [{"file", "step", "epoch", "valid_loss"}] of the checkpoints kept."""
    path = _index_path(folder)
    try:
        entries = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else []
        return [e for e in entries if (folder / e["file"]).is_file()]
    except (ValueError, TypeError, KeyError) as e:  # edited by hand
        raise TrainingError(f"{path}: not a checkpoint index ({e}); remove it to start from scratch") from None


def _write_index(folder: Path, step: int, epoch: int, valid_loss: float | None) -> None:
    name = f"ckpt-{step:08d}.pt"
    entries = [e for e in read_index(folder) if e["file"] != name]
    entries.append({"file": name, "step": step, "epoch": epoch, "valid_loss": valid_loss})
    with atomic_open(_index_path(folder)) as f:
        f.write(json.dumps(sorted(entries, key=lambda e: e["step"]), indent=1))


def _prune(folder: Path, run: _Run) -> None:
    """Keep the newest `keep_last` checkpoints and the `keep_best` best validated ones."""
    tc = run.config.training
    entries = read_index(folder)
    keep = {e["file"] for e in entries[-tc.keep_last:]} if tc.keep_last > 0 else set()
    validated = sorted((e for e in entries if e["valid_loss"] is not None), key=lambda e: e["valid_loss"])
    keep |= {e["file"] for e in validated[:tc.keep_best]}
    keep.add(entries[-1]["file"])
    for e in entries:
        if e["file"] not in keep:
            (folder / e["file"]).unlink(missing_ok=True)
    with atomic_open(_index_path(folder)) as f:
        f.write(json.dumps([e for e in entries if e["file"] in keep], indent=1))


def _resume(exp: Path, run: _Run, ctx: _Context) -> _State:
    """Load the newest checkpoint in EXP, if any: weights, optimizer, scaler, RNG, position.
    Rank 0 first removes the temporary files of writes a kill interrupted."""
    if ctx.main:
        for folder in (exp, exp / "tokenizer", _checkpoint_dir(exp)):
            remove_stale_temporaries(folder)
    entries = read_index(_checkpoint_dir(exp))
    if not entries:
        return _State()
    path = _checkpoint_dir(exp) / entries[-1]["file"]
    ckpt = load_file(path, CHECKPOINT_FORMAT, map_location=ctx.device)
    run.model.load_state_dict(ckpt["state_dict"])
    run.optimizer.load_state_dict(ckpt["optimizer"])
    run.scaler.load_state_dict(ckpt["scaler"])
    rng = ckpt["rng"]
    torch.set_rng_state(rng["torch"].cpu())
    random.setstate(_as_tuple(rng["python"]))
    if rng["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([s.cpu() for s in rng["cuda"]])
    state = _State(**ckpt["state"])
    log.info("resumed from %s (epoch %d, batch %d, step %d)", path, state.epoch + 1, state.batch, state.step)
    return state


def _as_tuple(x: Any) -> Any:
    return tuple(_as_tuple(v) for v in x) if isinstance(x, (list, tuple)) else x


# ---------------------------------------------------------------------------------------------
# the loop


class _Loop:
    """Epochs of optimizer steps, validation, checkpoints and logs."""

    def __init__(self, config: ExperimentConfig, exp: Path, run: _Run, state: _State,
                 train_utts: list, valid_utts: list, ctx: _Context, archive: FeatureArchive | None = None):
        self.config, self.tc, self.exp, self.run_, self.state, self.ctx = config, config.training, exp, run, state, ctx
        self.train_utts, self.valid_utts = train_utts, valid_utts
        self.log = _Logger(exp, ctx.main, resumed_at=state.step)
        self.ctc_reported: set[str] = set()
        self.train_loader = self._loader(train_utts, training=True, archive=archive)
        self.valid_loader = self._loader(valid_utts, training=False)
        subset = self._decode_subset() if ctx.main and self.tc.valid_decode_utts > 0 else []
        self.decode_text = {u.id: u.text for u in subset}
        self.decode_loader = self._loader(subset, training=False, sharded=False) if subset else None

    # -- the outer loop ------------------------------------------------------------------------
    def run(self) -> None:
        while not self._why_stop():
            finished = self._train_epoch()  # False: max_steps reached mid-epoch
            self._report_skipped()
            self._validate_and_checkpoint(end_of_epoch=finished)
        log.info("training stopped: %s", self._why_stop())

    def _report_skipped(self) -> None:
        """Count the training utterances skipped so far, over all ranks (each was reported once,
        with its reason, when first met)."""
        count = torch.tensor([float(len(self.train_loader.skipped))], device=self.ctx.device)
        if self.ctx.distributed:
            dist.all_reduce(count)
        if count.item():
            log.warning("%d training utterances skipped so far (their audio cannot be used: see above)", count.item())

    def _why_stop(self) -> str:
        """Why training is over, or "": from the saved state alone, so that a run resumed from its
        last checkpoint (killed while writing the final model) stops where it stopped."""
        st, tc = self.state, self.tc
        if self._max_steps_reached():
            return "max_steps reached"
        if tc.patience and st.epochs_without_gain >= tc.patience:
            return f"no better validation loss for {tc.patience} epochs"
        return f"{st.epoch} epochs done" if st.epoch >= tc.epochs else ""

    def finish(self) -> Path:
        """Write EXP/model_last.pt and the curves (rank 0)."""
        path = self.exp / "model_last.pt"
        if self.ctx.main:
            save_atomic(_model_envelope(self.run_), path)
            self.log.plot(self.exp / "curves.png")
            self.log.close()
        self.ctx.barrier()
        return path

    def _max_steps_reached(self) -> bool:
        return self.tc.max_steps > 0 and self.state.step >= self.tc.max_steps

    # -- one epoch -----------------------------------------------------------------------------
    def _loader(self, utts: list, *, training: bool, sharded: bool = True, archive: FeatureArchive | None = None):
        """A loader built once (persistent workers); `set_epoch` selects the epoch and position."""
        ctx = self.ctx
        return make_loader(utts, self.run_.tokenizer, self.config.data, training=training, cmvn=self.run_.cmvn,
                           seed=self.tc.seed, rank=ctx.rank if sharded else 0,
                           world_size=ctx.world_size if sharded else 1, pin_memory=ctx.device.type == "cuda",
                           archive=archive)

    def _train_epoch(self) -> bool:
        """Optimizer steps from the saved position to the end of the epoch; False when max_steps
        stopped it early."""
        st, tc = self.state, self.tc
        loader = self.train_loader
        loader.set_epoch(st.epoch, st.batch)
        total = st.batch + len(loader)
        self.total_steps = tc.max_steps or math.ceil(total / tc.accum_grad) * tc.epochs
        self.run_.model.train()
        self.last_step_end = time.perf_counter()
        group: list[Batch] = []
        # closed however the epoch ends, so that an error message starts on a line of its own
        with _progress(self.ctx.main, total, st.batch, f"epoch {st.epoch + 1}/{tc.epochs}") as bar:
            for batch in loader:
                group.append(batch)
                if len(group) < tc.accum_grad and st.batch + len(group) < total:
                    continue
                self._optimizer_step(group, bar)
                group = []
                if self._max_steps_reached():
                    return False
                if tc.checkpoint_every and st.step % tc.checkpoint_every == 0:
                    _save_checkpoint(self.exp, self.run_, st, self.ctx, valid_loss=None)
        return True

    # -- one optimizer step --------------------------------------------------------------------
    def _optimizer_step(self, group: list[Batch], bar) -> None:
        run, st, tc, ctx = self.run_, self.state, self.tc, self.ctx
        for g in run.optimizer.param_groups:
            g["lr"] = learning_rate(tc, st.step, self.total_steps)
        consumed = len(group)
        norm, sums, group = self._accumulate(group)
        if group:  # without a backward there is nothing to unscale (fp16's scaler would refuse)
            run.scaler.unscale_(run.optimizer)
        grad_norm = torch.nn.utils.clip_grad_norm_(run.model.parameters(), tc.grad_clip)
        st.batch += consumed
        # The one host synchronization of a step: skipping is decided from the gradient norm,
        # which is the same on every rank after DDP's all-reduce.
        if not group:
            self._skip_step("every utterance of the batch ran out of memory alone")
        elif not math.isfinite(float(grad_norm)):  # a non-finite loss makes the gradients non-finite too
            self._skip_step(f"non-finite loss or gradient norm ({float(grad_norm)})")
        else:
            run.scaler.step(run.optimizer)
            st.step += 1
            st.bad_steps = 0
        if group:
            run.scaler.update()
        run.optimizer.zero_grad(set_to_none=True)
        seconds = sum(float(b.feat_lens.sum()) for b in group) * self.config.data.features.frame_shift_ms / 1000
        now = time.perf_counter()  # audio seconds per wall second, data waits included
        speed, self.last_step_end = seconds * ctx.world_size / max(now - self.last_step_end, 1e-9), now
        self.log.train_step(st, sums, norm, grad_norm, run.optimizer.param_groups[0]["lr"], speed, bar,
                            tc.log_every, consumed)

    def _accumulate(self, group: list[Batch]) -> tuple[torch.Tensor, torch.Tensor, list[Batch]]:
        """Forward and backward of the micro-batches of one step: (global (tokens, utterances),
        (loss, att, ctc, correct tokens) sums, the micro-batches used). In one process, a
        micro-batch that runs out of memory is split in halves and the step started again (an
        utterance that does not fit alone is left out, with a warning); under DDP the ranks cannot
        retry alone, so running out of memory ends the job with a TrainingError."""
        while True:
            norm = self._global_counts(group)  # (tokens, utterances) of the global batch
            sums, failed = self._forward_backward_all(group, norm)
            if failed is None:
                return norm, sums, group
            self.run_.optimizer.zero_grad(set_to_none=True)  # the failed backward may have added some
            group = group[:failed] + self._split_after_oom(group[failed]) + group[failed + 1:]

    def _forward_backward_all(self, group: list[Batch], norm: torch.Tensor) -> tuple[torch.Tensor, int | None]:
        """(the sums of `_forward_backward` over the group, the index of the micro-batch that ran
        out of memory or None)."""
        sums = torch.zeros(4, device=self.ctx.device, dtype=torch.float64)
        for i, batch in enumerate(group):
            try:
                sums += self._forward_backward(batch, norm, sync=i == len(group) - 1)
            except torch.OutOfMemoryError:
                if self.ctx.distributed:
                    raise TrainingError(self._oom_message(batch)) from None
                return sums, i  # leaving the handler frees the failed step's tensors
        return sums, None

    def _split_after_oom(self, batch: Batch) -> list[Batch]:
        """The two halves of a micro-batch that ran out of memory, or [] for one utterance."""
        if self.ctx.device.type == "cuda":
            torch.cuda.empty_cache()  # the failed step's blocks, for the halves to fit
        seconds = float(batch.feat_lens.max()) * self.config.data.features.frame_shift_ms / 1000
        if len(batch.ids) == 1:
            log.warning("%s (%.1f s): out of memory even alone; skipped", batch.ids[0], seconds)
            return []
        log.warning("step %d: out of memory on a batch of %d utterances (longest %.1f s); split in two halves",
                    self.state.step + 1, len(batch.ids), seconds)
        half = len(batch.ids) // 2
        return [_rows(batch, slice(0, half)), _rows(batch, slice(half, None))]

    def _oom_message(self, batch: Batch) -> str:
        seconds = float(batch.feat_lens.max()) * self.config.data.features.frame_shift_ms / 1000
        return (f"rank {self.ctx.rank}: out of memory at step {self.state.step + 1} on a batch of {len(batch.ids)} "
                f"utterances (longest {seconds:.1f} s); under DDP the ranks cannot retry alone, so the job stops: "
                f"{_resume_hint(self.exp)} (or start a new --exp-dir with a smaller data.max_batch_seconds)")

    def _global_counts(self, group: list[Batch]) -> torch.Tensor:
        """(target tokens incl. eos, utterances) over all micro-batches of all ranks."""
        counts = torch.tensor([sum(float(b.token_lens.sum()) + len(b.ids) for b in group),
                               sum(len(b.ids) for b in group)], dtype=torch.float64, device=self.ctx.device)
        if self.ctx.distributed:
            dist.all_reduce(counts)
        return counts.clamp(min=1.0)

    def _forward_backward(self, batch: Batch, norm: torch.Tensor, *, sync: bool) -> torch.Tensor:
        """Loss of one micro-batch normalized by the global counts, backward; returns the
        detached (loss, att_loss, ctc_loss, correct tokens) sums of this micro-batch."""
        run, ctx = self.run_, self.ctx
        empty = len(batch.ids) == 0
        if not empty:
            self._report_ctc_skips(batch)
        else:  # this rank's batch emptied: a zero-loss step so DDP's all-reduce still happens
            batch = _dummy_batch(self.config.data.features.n_mels)
        feats, feat_lens = batch.feats.to(ctx.device, non_blocking=True), batch.feat_lens.to(ctx.device)
        tokens, token_lens = batch.tokens.to(ctx.device, non_blocking=True), batch.token_lens.to(ctx.device)
        attempt = self.state.step + self.state.skipped_steps + 1
        if not empty and _inject_oom(ctx.rank, attempt, len(batch.ids)):
            raise torch.OutOfMemoryError("out of memory (injected by ASR_INJECT_OOM)")
        no_sync = ctx.distributed and not sync
        with run.wrapped.no_sync() if no_sync else contextlib.nullcontext():
            with torch.autocast(ctx.device.type, dtype=run.autocast_dtype, enabled=run.autocast_dtype is not None):
                out = run.wrapped(feats, feat_lens, tokens, token_lens,
                                  num_tokens=norm[0], num_utts=norm[1])
            loss = out.loss * (0.0 if empty else ctx.world_size)  # DDP averages gradients over ranks
            if _inject_nonfinite(ctx.rank, attempt):
                loss = loss * float("nan")
            run.scaler.scale(loss).backward()
        if empty:
            return torch.zeros(4, device=ctx.device, dtype=torch.float64)
        correct = out.accuracy.detach().double() * out.num_tokens
        return torch.stack([out.loss.detach().double(), out.att_loss.detach().double(),
                            out.ctc_loss.detach().double(), correct])

    def _report_ctc_skips(self, batch: Batch) -> None:
        """Log (once per id) the utterances CTC cannot align; computed on the CPU from the lengths,
        so no device synchronization. The model leaves them out of the CTC loss itself."""
        frames = self.run_.model.encoder.subsampling.output_lengths(batch.feat_lens)
        for i in (~ctc_feasible(batch.tokens, batch.token_lens, frames)).nonzero().flatten().tolist():
            if batch.ids[i] not in self.ctc_reported:
                self.ctc_reported.add(batch.ids[i])
                log.warning("%s: more labels than encoder frames for CTC; left out of the CTC loss", batch.ids[i])

    def _skip_step(self, reason: str) -> None:
        st = self.state
        st.bad_steps += 1
        st.skipped_steps += 1
        log.warning("step %d: %s; step skipped (%d in a row, %d in all)", st.step + 1, reason, st.bad_steps,
                    st.skipped_steps)
        if st.bad_steps >= self.tc.max_bad_steps:
            raise TrainingError(f"{st.bad_steps} steps in a row skipped, the last for {reason}: training stopped "
                                f"(lower the learning rate or data.max_batch_seconds, or check the data); "
                                f"{_resume_hint(self.exp)}")

    # -- validation ----------------------------------------------------------------------------
    def _validate_and_checkpoint(self, *, end_of_epoch: bool) -> None:
        st = self.state
        result = self._validate()
        result.update(epoch=st.epoch + 1, step=st.step)
        st.history.append(result)
        self.log.valid(result)
        if result["loss"] < st.best_loss - 1e-6:
            st.best_loss, st.epochs_without_gain = result["loss"], 0
        else:
            st.epochs_without_gain += 1
        if end_of_epoch:
            st.epoch, st.batch = st.epoch + 1, 0
        _save_checkpoint(self.exp, self.run_, st, self.ctx, valid_loss=result["loss"])

    @torch.no_grad()
    def _validate(self) -> dict[str, float]:
        """Validation loss and token accuracy over the whole valid set (sharded over ranks), and
        greedy CER/WER on a bounded subset (rank 0)."""
        run, ctx = self.run_, self.ctx
        model = run.model
        model.eval()
        sums = torch.zeros(5, dtype=torch.float64, device=ctx.device)  # att, ctc, correct, tokens, utts
        one = torch.ones((), device=ctx.device)
        self.valid_loader.set_epoch(0)
        for batch in self.valid_loader:
            if not batch.ids:
                continue
            with torch.autocast(ctx.device.type, dtype=run.autocast_dtype, enabled=run.autocast_dtype is not None):
                out = model(batch.feats.to(ctx.device), batch.feat_lens.to(ctx.device), batch.tokens.to(ctx.device),
                            batch.token_lens.to(ctx.device), num_tokens=one, num_utts=one)
            sums += torch.stack([out.att_loss.double(), out.ctc_loss.double(), out.accuracy.double() * out.num_tokens,
                                 torch.as_tensor(out.num_tokens, dtype=torch.float64, device=ctx.device),
                                 torch.as_tensor(out.num_utts, dtype=torch.float64, device=ctx.device)])
        if ctx.distributed:
            dist.all_reduce(sums)
        att, ctc, correct, tokens, utts = sums.tolist()
        w = run.config.model.ctc_weight
        result = {"loss": w * ctc / max(utts, 1) + (1 - w) * att / max(tokens, 1), "att_loss": att / max(tokens, 1),
                  "ctc_loss": ctc / max(utts, 1), "accuracy": correct / max(tokens, 1)}
        if self.decode_loader is not None:
            result.update(self._greedy_error_rates())
        model.train()
        return result

    def _decode_subset(self) -> list:
        """An evenly spaced, fixed subset of the valid set for greedy CER/WER."""
        utts = sorted(self.valid_utts, key=lambda u: u.id)
        stride = max(1, len(utts) // self.tc.valid_decode_utts)
        return utts[::stride][: self.tc.valid_decode_utts]

    def _greedy_error_rates(self) -> dict[str, float]:
        """Greedy attention decoding of the decode subset (rank 0)."""
        run, ctx = self.run_, self.ctx
        refs, hyps = {}, {}
        text = self.decode_text
        self.decode_loader.set_epoch(0)
        for batch in self.decode_loader:
            if not batch.ids:
                continue
            with torch.autocast(ctx.device.type, dtype=run.autocast_dtype, enabled=run.autocast_dtype is not None):
                found = search(run.model, batch.feats.to(ctx.device), batch.feat_lens.to(ctx.device))
            for utt_id, hyp in zip(batch.ids, found):
                refs[utt_id], hyps[utt_id] = text[utt_id], run.tokenizer.decode(hyp.tokens)
        if not refs:
            return {}
        stats = score(refs, hyps).stats
        return {"cer": stats.cer, "wer": stats.wer}


def _inject_nonfinite(rank: int, attempt: int) -> bool:
    """Fault injection for tests: ASR_INJECT_NONFINITE="RANK:N,..." makes RANK's loss NaN at its
    N-th optimizer step attempt (1-based)."""
    spec = os.environ.get("ASR_INJECT_NONFINITE")
    return bool(spec) and f"{rank}:{attempt}" in spec.split(",")


def _inject_oom(rank: int, attempt: int, utterances: int) -> bool:
    """Fault injection for tests: ASR_INJECT_OOM="RANK:N:U" makes RANK run out of memory in the
    forward of every micro-batch of more than U utterances from its N-th optimizer step attempt on."""
    spec = os.environ.get("ASR_INJECT_OOM")
    if not spec:
        return False
    oom_rank, first, most = (int(x) for x in spec.split(":"))
    return rank == oom_rank and attempt >= first and utterances > most


def _rows(batch: Batch, rows: slice) -> Batch:
    """Some utterances of a padded batch, trimmed to their own longest features and targets."""
    feat_lens, token_lens = batch.feat_lens[rows], batch.token_lens[rows]
    frames, tokens = int(feat_lens.max()), int(token_lens.max())
    return Batch(batch.ids[rows], batch.feats[rows, :frames], feat_lens, batch.tokens[rows, :tokens], token_lens)


def _dummy_batch(n_mels: int) -> Batch:
    """One short utterance with one token: the forward of a rank whose batch emptied."""
    return Batch(ids=[], feats=torch.zeros(1, 100, n_mels), feat_lens=torch.tensor([100]),
                 tokens=torch.full((1, 1), 2), token_lens=torch.tensor([1]))


def _progress(enabled: bool, total: int, done: int, desc: str):
    from tqdm import tqdm

    return tqdm(total=total, initial=done, desc=desc, disable=not enabled, dynamic_ncols=True, leave=False,
                mininterval=1.0)


# ---------------------------------------------------------------------------------------------
# logs: progress bar, metrics.jsonl, TensorBoard, curves


class _Logger:
    """EXP/metrics.jsonl and TensorBoard (rank 0). A run resumed from step S first drops what the
    interrupted run logged after S (and a line a kill cut short): the steps after S are logged
    again, so the logs read as those of one uninterrupted run."""

    def __init__(self, exp: Path, enabled: bool, resumed_at: int = 0):
        self.enabled = enabled
        self.path = exp / "metrics.jsonl"
        self.writer = None
        self.pending: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
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

    def train_step(self, st: _State, sums: torch.Tensor, norm: torch.Tensor, grad_norm: torch.Tensor, lr: float,
                   audio_per_s: float, bar, every: int, batches: int) -> None:
        """Every rank calls this after each step; every `every` steps the ranks' shares of the
        loss are summed (one all-reduce, the same step on every rank) and rank 0 writes them."""
        bar.update(batches)
        self.pending.append((sums, norm, grad_norm))
        if st.step % every:
            return
        total = torch.stack([s for s, _, _ in self.pending]).sum(0)  # (4,) this rank's shares
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(total)
        total = total.tolist()  # host sync, every N steps
        counts = torch.stack([n for _, n, _ in self.pending]).sum(0).tolist()  # already global
        gnorm, n = float(self.pending[-1][2]), len(self.pending)
        self.pending = []
        if not self.enabled:
            return
        record = {"kind": "train", "step": st.step, "epoch": st.epoch + 1, "loss": total[0] / n,
                  "att_loss": total[1] / n, "ctc_loss": total[2] / n, "accuracy": total[3] / max(counts[0], 1),
                  "lr": lr, "grad_norm": gnorm, "audio_s_per_s": audio_per_s, "skipped_steps": st.skipped_steps}
        self._write(record)
        bar.set_postfix(loss=f"{record['loss']:.3f}", lr=f"{lr:.2e}", audio_s_per_s=f"{audio_per_s:.0f}")

    def valid(self, result: dict[str, Any]) -> None:
        if not self.enabled:
            return
        self._write({"kind": "valid", **result})
        parts = ", ".join(f"{k} {v:.4f}" for k, v in result.items() if k not in ("epoch", "step"))
        log.info("epoch %d validation: %s", result["epoch"], parts)

    def plot(self, path: Path) -> None:
        """A PNG of training and validation loss and validation CER/WER against the step."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        records = read_records(self.path) if self.path.is_file() else []
        train = [r for r in records if r["kind"] == "train"]
        valid = [r for r in records if r["kind"] == "valid"]
        fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
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
        fig.savefig(path, dpi=100)
        plt.close(fig)

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


# ---------------------------------------------------------------------------------------------
# entry points for the CLI


def load_experiment_config(path: str, overrides: list[str]) -> ExperimentConfig:
    return load_config(ExperimentConfig, path, overrides)


def average(exp_dir: str | Path, *, by: str = "best", num: int = 5, out: str | Path | None = None) -> Path:
    """Average the `num` best (validation loss) or last checkpoints of EXP into one model file."""
    from asr.checkpoint import average_state_dicts

    folder = _checkpoint_dir(Path(exp_dir))
    entries = read_index(folder)
    if by == "best":
        entries = sorted((e for e in entries if e["valid_loss"] is not None), key=lambda e: e["valid_loss"])
    else:
        entries = sorted(entries, key=lambda e: e["step"], reverse=True)
    if not entries:
        raise TrainingError(f"{folder}: no {'validated ' if by == 'best' else ''}checkpoints to average")
    chosen = entries[:num]
    if len(chosen) < num:
        log.warning("only %d checkpoint(s) available (asked for %d): averaging those", len(chosen), num)
    ckpts = [load_file(folder / e["file"], CHECKPOINT_FORMAT) for e in chosen]
    last = ckpts[0]
    obj = model_file(model=last["model"], frontend=last["frontend"], tokenizer=last["tokenizer"],
                     state_dict=average_state_dicts([c["state_dict"] for c in ckpts]))
    out = Path(out) if out else Path(exp_dir) / "model_avg.pt"
    save_atomic(obj, out)
    names = ", ".join(f"{e['file']} (valid loss {e['valid_loss']:.4f})" if e["valid_loss"] is not None
                      else e["file"] for e in chosen)
    log.info("averaged %d checkpoint(s) by %s: %s", len(chosen), by, names)
    return out


__all__ = ["ExperimentConfig", "TokenizerConfig", "TrainingConfig", "TrainingError", "average", "learning_rate",
           "load_experiment_config", "read_index", "read_records", "train"]
