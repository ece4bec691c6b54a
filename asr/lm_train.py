"""`asr lm --kind transformer`: a token-level transformer LM (asr.model.lm) trained on text by the
task-neutral loop (asr.trainer), counted in tokens (`TOKENS`), into the LM file of asr.neural_lm.

    asr lm --kind transformer --text corpus.txt.gz --tokenizer exp/lang --config conf/lm/synth.yaml \\
        --exp-dir exp/lm          # (under torchrun for several processes) -> exp/lm/lm_last.pt
    asr average --exp-dir exp/lm  # -> exp/lm/lm_avg.pt

The LM reads the ASR model's tokens: the same tokenizer (its ids, blank and unk included, sos/eos
V - 1), one normalized sentence per line (asr.metrics.normalize_text, as transcripts are), from
sos, predicting every token and then eos.

The text is tokenized once into EXP/text/ (rank 0; an int array memory-mapped by every rank, so a
corpus of a billion tokens costs no memory per process), cut into micro-batches of at most
data.max_batch_tokens padded tokens (asr.sampler's buckets by length; `TextLoader`),
data.global_batch_tokens per optimizer step over all processes, and trained by the loop (resume,
bf16, DDP, checkpoints, `asr average`, metrics.jsonl, curves) as `LMTask`: the loss is the
cross-entropy per token (eos included; no label smoothing); records give it and its perplexity,
and the log, the records and the messages count tokens.
"""
from __future__ import annotations

import dataclasses
import gzip
import json
import logging
import math
import os
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch
import torch.nn.functional as F

from asr.checkpoint import check_or_save_config, load_file
from asr.config import load_config, to_dict
from asr.distributed import Context
from asr.fileio import atomic_open
from asr.manifest import read_manifest
from asr.metrics import normalize_text
from asr.model import LMConfig, TransformerLM
from asr.neural_lm import lm_file
from asr.sampler import DurationBucketSampler
from asr.tokenizer import Tokenizer, load_tokenizer, tokenizer_from_dict
from asr.tokens import FIRST_TOKEN
from asr.train_config import BatchPlan, TrainingConfig, plan_batches
from asr.train_task import Unit
from asr.trainer import Loaders, Run, State, make_run, run_experiment

__all__ = ["TOKENS", "LMDataConfig", "LMExperimentConfig", "LMTask", "TextBatch", "TextLoader", "TokenizedText",
           "load_lm_config", "read_sentences", "tokenize_text", "train_lm"]

log = logging.getLogger("asr.train")

TOKENS = Unit(name="tokens", symbol="tokens", example="sentence", cap_setting="data.max_batch_tokens",
              step_setting="data.global_batch_tokens", speed_key="tokens_per_s", total_key="tokens",
              total_name="tokens")


# ---------------------------------------------------------------------------------------------
# the experiment config


@dataclass(frozen=True)
class LMDataConfig:
    """How the text is batched."""

    max_batch_tokens: int = 8192  # padded tokens (longest x sentences, sos/eos counted) per micro-batch
    global_batch_tokens: int = 0  # padded tokens of one optimizer step over all processes, a multiple
    # of max_batch_tokens; 0: each process accumulates training.accum_grad micro-batches
    max_sentence_tokens: int = 256  # longer sentences are left out of training (counted)


@dataclass(frozen=True)
class LMExperimentConfig:
    """An LM training config file: conf/lm/*.yaml (model, data, training; training as asr train's)."""

    model: LMConfig = field(default_factory=LMConfig)
    data: LMDataConfig = field(default_factory=LMDataConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)

    def __post_init__(self) -> None:
        data, tc = self.data, self.training
        if data.max_batch_tokens < 2 or data.max_sentence_tokens < 1:
            raise ValueError("data.max_batch_tokens must be >= 2 and data.max_sentence_tokens >= 1")
        if data.max_sentence_tokens + 1 > data.max_batch_tokens:
            raise ValueError(f"data.max_sentence_tokens ({data.max_sentence_tokens}) + 1 must fit in "
                             f"data.max_batch_tokens ({data.max_batch_tokens})")
        if tc.global_batch_seconds:
            raise ValueError("training.global_batch_seconds is for audio: an LM's step is data.global_batch_tokens")
        if data.global_batch_tokens and (data.global_batch_tokens % data.max_batch_tokens or tc.accum_grad != 1):
            raise ValueError(f"data.global_batch_tokens ({data.global_batch_tokens}) must be a multiple of "
                             f"data.max_batch_tokens ({data.max_batch_tokens}), without training.accum_grad")

    def plan(self, world_size: int) -> BatchPlan:
        return plan_batches(self.data.global_batch_tokens, self.data.max_batch_tokens, self.training.accum_grad,
                            world_size)


def load_lm_config(path: str | None, overrides: Sequence[str]) -> LMExperimentConfig:
    return load_config(LMExperimentConfig, path, overrides)


# ---------------------------------------------------------------------------------------------
# text


def read_sentences(path: str | os.PathLike) -> Iterator[str]:
    """The sentences of a text file (one per line; gzip when the name ends in .gz) or of a
    manifest's transcripts (.jsonl), normalized as transcripts are; empty ones left out."""
    name = os.fspath(path)
    if name.endswith(".jsonl"):
        texts: Iterable[str] = (u.text for u in read_manifest(name))
    else:
        opener = gzip.open if name.endswith(".gz") else open
        try:
            f = opener(name, "rt", encoding="utf-8")
        except OSError as e:
            raise ValueError(f"{name}: cannot read ({e.strerror or e})") from None
        texts = _lines(f, name)
    for text in texts:
        text = normalize_text(text)
        if text:
            yield text


def _lines(f, name: str) -> Iterator[str]:
    with f:
        try:
            yield from f
        except (OSError, EOFError, UnicodeDecodeError) as e:
            raise ValueError(f"{name}: cannot read ({type(e).__name__}: {e})") from None


class TokenizedText(NamedTuple):
    """Sentences as token ids: sentence i is tokens[offsets[i]:offsets[i] + lengths[i]]."""

    tokens: np.ndarray  # (total,) uint16 or int32, memory-mapped
    offsets: np.ndarray  # (N,) int64
    lengths: np.ndarray  # (N,) int64

    def __len__(self) -> int:
        return len(self.lengths)

    def sentence(self, i: int) -> np.ndarray:
        start = int(self.offsets[i])
        return self.tokens[start:start + int(self.lengths[i])]


def tokenize_text(paths: Sequence[str], tokenizer: Tokenizer, folder: Path, *,
                  max_tokens: int) -> dict[str, int]:
    """Write the sentences of `paths` as token ids into `folder` (tokens.bin, lengths.npy, then
    info.json last: a folder with info.json is complete); sentences of more than `max_tokens`
    tokens are left out and counted. Returns the counts (also in info.json)."""
    folder.mkdir(parents=True, exist_ok=True)
    dtype = np.uint16 if tokenizer.vocab_size <= np.iinfo(np.uint16).max + 1 else np.int32
    lengths: list[int] = []
    too_long = 0
    chunk: list[int] = []
    with atomic_open(folder / "tokens.bin", "wb") as out:
        for texts in _chunks((text for path in paths for text in read_sentences(path)), 10_000):
            for ids in tokenizer.encode_batch(texts):
                if len(ids) > max_tokens:
                    too_long += 1
                    continue
                lengths.append(len(ids))
                chunk.extend(ids)
            out.write(np.asarray(chunk, dtype=dtype).tobytes())
            chunk = []
    with atomic_open(folder / "lengths.npy", "wb") as f:
        np.save(f, np.asarray(lengths, dtype=np.int64))
    info = {"sentences": len(lengths), "tokens": int(sum(lengths)), "too_long": too_long,
            "dtype": np.dtype(dtype).name, "sources": [os.fspath(p) for p in paths]}
    with atomic_open(folder / "info.json") as f:
        json.dump(info, f, indent=1)
    return info


def _chunks(items: Iterable[str], size: int) -> Iterator[list[str]]:
    chunk: list[str] = []
    for item in items:
        chunk.append(item)
        if len(chunk) == size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


def open_tokenized(folder: Path) -> TokenizedText:
    info = json.loads((folder / "info.json").read_text(encoding="utf-8"))
    lengths = np.load(folder / "lengths.npy")
    tokens = (np.memmap(folder / "tokens.bin", dtype=info["dtype"], mode="r") if info["tokens"]
              else np.zeros(0, dtype=info["dtype"]))
    offsets = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64) if len(lengths) else lengths
    return TokenizedText(tokens, offsets, lengths)


class TextBatch(NamedTuple):
    """Sentences of one micro-batch."""

    ids: list[int]  # sentence indices
    tokens: torch.Tensor  # (B, L) long, -1 padded, no sos / eos
    token_lens: torch.Tensor  # (B,) long


def collate_text(text: TokenizedText, indices: Sequence[int]) -> TextBatch:
    lens = [int(text.lengths[i]) for i in indices]
    tokens = torch.full((len(indices), max(lens, default=0)), -1, dtype=torch.long)
    for row, i in enumerate(indices):
        tokens[row, :lens[row]] = torch.from_numpy(text.sentence(i).astype(np.int64))
    return TextBatch(list(indices), tokens, torch.tensor(lens, dtype=torch.long))


class TextLoader:
    """Micro-batches of sentences for the trainer's loop: `batches` (a DurationBucketSampler over
    the sentences' lengths in tokens, sos/eos counted, capped at `cap` padded tokens), `set_epoch`
    (epoch, position), len() what remains, iteration TextBatches; nothing is ever skipped."""

    def __init__(self, text: TokenizedText, cap: float, *, training: bool, seed: int, rank: int, world_size: int,
                 group: int | None = None) -> None:
        self.text = text
        self.batches = DurationBucketSampler(text.lengths + 1, max_batch_seconds=cap, shuffle=training, seed=seed,
                                             num_replicas=world_size, rank=rank, group=group)
        self.skipped: dict[str, str] = {}

    def set_epoch(self, epoch: int, start_batch: int = 0) -> None:
        self.batches.set_epoch(epoch, start_batch)

    def __len__(self) -> int:
        return len(self.batches)

    def __iter__(self) -> Iterator[TextBatch]:
        for indices in self.batches:
            yield collate_text(self.text, indices)


# ---------------------------------------------------------------------------------------------
# the task


class LMTask:
    """Language modelling for asr.trainer's loop (asr.train_task.Task): the cross-entropy of every
    token after sos (the sentence's tokens, then eos), summed and divided by the global batch's
    token count; records give it per token ("loss"), its perplexity and the next-token accuracy."""

    unit = TOKENS
    step_sums = ("loss", "correct")
    valid_sums = ("nll", "correct", "tokens")

    def __init__(self, model: TransformerLM, device: torch.device) -> None:
        self.model, self.device = model, device
        self.sos = self.eos = model.config.vocab_size - 1

    def _sums(self, model: torch.nn.Module, batch: TextBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(summed negative log-likelihood, correct argmax count, target count) of a batch. Padded
        targets are masked, not selected out: a selection is sized by the data, which on a GPU is a
        host synchronization."""
        batch = self.stage(batch)
        tokens, lens = batch.tokens, batch.token_lens
        sos = tokens.new_full((tokens.size(0), 1), self.sos)
        inputs = torch.cat([sos, tokens], dim=1)  # (B, L + 1)
        targets = torch.cat([tokens, tokens.new_full((tokens.size(0), 1), -1)], dim=1)
        targets = targets.scatter(1, lens[:, None], self.eos)  # (B, L + 1): y1 .. yn eos -1 ...
        log_probs = model(inputs)  # (B, L + 1, V)
        valid = targets >= 0
        nll = F.nll_loss(log_probs.flatten(0, 1), targets.flatten(), ignore_index=-1, reduction="sum")
        return nll, ((log_probs.argmax(-1) == targets) & valid).sum(), valid.sum()

    def counts(self, group: list[TextBatch]) -> list[float]:
        """(target tokens, eos included)."""
        return [sum(float(b.token_lens.sum()) + len(b.ids) for b in group)]

    def stage(self, batch: TextBatch) -> TextBatch:
        """The batch's tensors on the device, copied without blocking the host (a no-op for a staged one)."""
        return TextBatch(batch.ids, batch.tokens.to(self.device, non_blocking=True),
                         batch.token_lens.to(self.device, non_blocking=True))

    def loss(self, model: torch.nn.Module, batch: TextBatch, counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        nll, correct, _ = self._sums(model, batch)
        loss = nll / counts[0]
        return loss, torch.stack([loss.detach().double(), correct.double()])

    def summarize(self, sums: list[float], counts: list[float], steps: int) -> dict[str, float]:
        loss = sums[0] / steps
        return {"loss": loss, "ppl": math.exp(min(loss, 50.0)), "accuracy": sums[1] / max(counts[0], 1)}

    def not_learning(self, record: dict[str, Any], trained: float) -> None:
        return None

    def amount(self, group: list[TextBatch]) -> float:
        """Target tokens."""
        return self.counts(group)[0]

    def placeholder(self) -> TextBatch:
        return TextBatch([], torch.full((1, 1), FIRST_TOKEN), torch.tensor([1]))

    def describe(self, batch: TextBatch) -> str:
        return f"a batch of {len(batch.ids)} sentences (longest {int(batch.token_lens.max())} tokens)"

    def halves(self, batch: TextBatch, step: int) -> list[TextBatch]:
        if len(batch.ids) == 1:
            log.warning("sentence %d: out of memory even alone; skipped", batch.ids[0])
            return []
        log.warning("step %d: out of memory on %s; split in two halves", step, self.describe(batch))
        half = len(batch.ids) // 2
        return [_text_rows(batch, slice(0, half)), _text_rows(batch, slice(half, None))]

    def validation(self, model: torch.nn.Module, batch: TextBatch) -> torch.Tensor:
        nll, correct, count = self._sums(model, batch)
        return torch.stack([nll.double(), correct.double(), count.double()])

    def valid_metrics(self, sums: list[float]) -> dict[str, float]:
        nll, correct, tokens = sums
        loss = nll / max(tokens, 1)
        return {"loss": loss, "ppl": math.exp(min(loss, 50.0)), "accuracy": correct / max(tokens, 1)}

    def decode_metrics(self, model: torch.nn.Module, autocast) -> dict[str, float]:
        return {}

    def pictures(self, model: torch.nn.Module) -> dict[str, dict[str, np.ndarray]]:
        return {}


def _text_rows(batch: TextBatch, rows: slice) -> TextBatch:
    lens = batch.token_lens[rows]
    return TextBatch(batch.ids[rows], batch.tokens[rows, :int(lens.max())], lens)


# ---------------------------------------------------------------------------------------------
# the driver


def lm_tokenizer(given: str) -> Tokenizer:
    """The tokenizer of a tokenizer folder (`asr tokenizer`) or of an ASR model file."""
    if Path(given).is_dir():
        return load_tokenizer(given)
    return tokenizer_from_dict(load_file(given)["tokenizer"])


def train_lm(config: LMExperimentConfig, texts: Sequence[str], valid_texts: Sequence[str], exp_dir: str | Path, *,
             tokenizer: str) -> Path:
    """Train a transformer LM into `exp_dir` (resuming from its newest checkpoint) on the sentences
    of `texts`, validated on `valid_texts`, with the tokenizer of `tokenizer` (a folder or an ASR
    model file); returns EXP/lm_last.pt."""
    return run_experiment(TextExperiment(config, texts, valid_texts, Path(exp_dir), tokenizer))


class TextExperiment:
    """asr lm's experiment (asr.trainer.Experiment). `build` keeps what it reads and makes (the
    tokenizer, the tokenized text, the config with the vocabulary filled in) for `parts` and the
    LM file."""

    def __init__(self, config: LMExperimentConfig, texts: Sequence[str], valid_texts: Sequence[str], exp: Path,
                 tokenizer: str):
        self.config, self.training, self.exp = config, config.training, exp
        self.texts, self.valid_texts, self.tokenizer_path = texts, valid_texts, tokenizer

    def build(self, ctx: Context) -> Run:
        config, exp = self.config, self.exp
        check_or_save_config(exp, to_dict(config), save=ctx.main)
        self.tokenizer = lm_tokenizer(self.tokenizer_path)
        self.train_text = _experiment_text(exp / "text" / "train", self.texts, self.tokenizer, config, ctx)
        self.valid_text = _experiment_text(exp / "text" / "valid", self.valid_texts, self.tokenizer, config, ctx)
        torch.manual_seed(config.training.seed)
        model = TransformerLM(dataclasses.replace(config.model, vocab_size=self.tokenizer.vocab_size))
        self.config = dataclasses.replace(config, model=model.config)
        return make_run(self.training, model, exp, ctx, config.plan(ctx.world_size), unit=TOKENS,
                        envelope=self.envelope, final_name="lm_last.pt")

    def envelope(self, model: torch.nn.Module) -> dict[str, Any]:
        """The LM file (asr.neural_lm.lm_file) of `model`'s weights."""
        return lm_file(model=to_dict(self.config.model), tokenizer=self.tokenizer.to_dict(),
                       state_dict=model.state_dict())

    def parts(self, run: Run, state: State) -> tuple[LMTask, Loaders]:
        ctx, seed, plan = run.ctx, self.training.seed, run.plan
        train = TextLoader(self.train_text, plan.micro_batch, training=True, seed=seed, rank=ctx.rank,
                           world_size=ctx.world_size, group=plan.group)
        valid = TextLoader(self.valid_text, self.config.data.max_batch_tokens, training=False, seed=seed,
                           rank=ctx.rank, world_size=ctx.world_size)
        return LMTask(run.model, ctx.device), Loaders(train, valid)


def _experiment_text(folder: Path, paths: Sequence[str], tokenizer: Tokenizer, config: LMExperimentConfig,
                     ctx: Context) -> TokenizedText:
    """The sentences of `paths` tokenized into `folder` by rank 0 (once). The other ranks wait for
    its info.json on the file system, not in a collective: tokenizing a large corpus takes longer
    than a process group's timeout (torchrun stops them if rank 0 fails)."""
    done = folder / "info.json"
    if ctx.main and not done.is_file():
        info = tokenize_text(paths, tokenizer, folder, max_tokens=config.data.max_sentence_tokens)
        log.info("%s: %d sentences, %d tokens%s", folder, info["sentences"], info["tokens"],
                 f"; {info['too_long']} longer than data.max_sentence_tokens left out" if info["too_long"] else "")
    while not done.is_file():
        time.sleep(2.0)
    ctx.barrier()
    text = open_tokenized(folder)
    if not len(text):
        raise ValueError(f"{', '.join(paths)}: no sentences to train or validate the LM on")
    return text
