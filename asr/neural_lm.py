"""Neural language models: a token-level transformer LM (asr.model.lm) trained on text with the
ASR trainer's loop, saved as its own kind of file, and fused into beam search.

    asr lm --kind transformer --text corpus.txt.gz --tokenizer exp/lang --config conf/lm/synth.yaml \\
        --exp-dir exp/lm          # (under torchrun for several processes) -> exp/lm/lm_last.pt
    asr average --exp-dir exp/lm  # -> exp/lm/lm_avg.pt
    asr decode --model exp/asr/model_avg.pt --manifest dev.jsonl --out-dir d --lm exp/lm/lm_avg.pt --lm-weight 0.3

The LM reads the ASR model's tokens: the same tokenizer (its ids, blank and unk included, sos/eos
V - 1), one normalized sentence per line (asr.metrics.normalize_text, as transcripts are), from
sos, predicting every token and then eos. Its file, format "asr-lm", holds the LM's config, the
tokenizer it was trained with, its hash, and the weights (nothing but dicts, strings, numbers,
bytes and tensors: it loads with weights_only=True); decoding with an LM of another tokenizer is
refused in one line.

Training: the text is tokenized once into EXP/text/ (rank 0; an int array memory-mapped by every
rank, so a corpus of a billion tokens costs no memory per process), cut into micro-batches of at
most data.max_batch_tokens padded tokens (asr.sampler's buckets by length), data.global_batch_tokens
per optimizer step over all processes, and trained by asr.trainer's loop (resume, bf16, DDP,
checkpoints, `asr average`, metrics.jsonl, curves). The loss is the cross-entropy per token (eos
included; no label smoothing); records give it and its perplexity.

Fusion (`TransformerLMScorer`, a full scorer of asr.scorer): every step the LM scores the whole
vocabulary for all rows (utterances x beam) in one batched call with its own KV cache (the
decoder's DecoderCache without memory, reordered as the decoder's is), and beam search adds
lm_weight x its log-probabilities to each candidate: over a hypothesis, lm_weight x ln P_LM(tokens,
eos) (eos is scored when the hypothesis ends; a hypothesis cut at the length limit is not charged
for it, as with the decoder). The pre-beam ranks tokens on the decoder's and the LM's weighted
scores together, so the LM can bring in a token the decoder alone would not have offered.
"""
from __future__ import annotations

import dataclasses
import gzip
import hashlib
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

from asr.checkpoint import LM_FORMAT, VERSION, CheckpointError, load_file, resume_hint
from asr.config import load_config, to_dict
from asr.fileio import atomic_open
from asr.manifest import read_manifest
from asr.metrics import normalize_text
from asr.model import DecoderCache, LMConfig, TransformerLM
from asr.sampler import DurationBucketSampler
from asr.scorer import Selection
from asr.search import select_cache
from asr.tokenizer import Tokenizer, load_tokenizer, tokenizer_from_dict
from asr.tokens import FIRST_TOKEN
from asr.train_config import BatchPlan, TrainingConfig, plan_batches

__all__ = [
    "LMDataConfig", "LMExperimentConfig", "LMTask", "NeuralLM", "TextBatch", "TextLoader", "TokenizedText",
    "TransformerLMScorer", "is_neural_lm", "lm_file", "load_neural_lm", "tokenize_text", "tokenizer_hash",
    "train_lm",
]

log = logging.getLogger("asr.train")


# ---------------------------------------------------------------------------------------------
# the file


def tokenizer_hash(tokenizer: dict) -> str:
    """sha256 (hex) of a tokenizer's `to_dict()`: its kind and its pieces (sentencepiece model bytes
    or the character list)."""
    digest = hashlib.sha256(str(tokenizer.get("kind")).encode())
    for key in sorted(tokenizer):
        value = tokenizer[key]
        digest.update(key.encode())
        digest.update(value if isinstance(value, bytes) else json.dumps(value, sort_keys=True).encode())
    return digest.hexdigest()


def lm_file(*, model: dict, tokenizer: dict, state_dict: dict) -> dict[str, Any]:
    """The LM file's dict (tensors moved to the CPU)."""
    return {"format": LM_FORMAT, "version": VERSION, "model": dict(model), "tokenizer": dict(tokenizer),
            "tokenizer_sha256": tokenizer_hash(tokenizer),
            "state_dict": {k: v.detach().cpu() for k, v in state_dict.items()}}


def is_neural_lm(path: str | os.PathLike) -> bool:
    """Whether `path` is a torch file (a zip archive: an LM file, or another torch file that
    `load_neural_lm` refuses in one line) rather than an ARPA text (plain or gzip)."""
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"PK\x03\x04"
    except OSError:
        return False


@dataclass
class NeuralLM:
    """A loaded LM: the network (eval mode) and the tokenizer it was trained with."""

    model: TransformerLM
    tokenizer: dict
    path: str

    @property
    def config(self) -> LMConfig:
        return self.model.config

    def check_tokenizer(self, tokenizer: Tokenizer, model_path: str = "the model") -> None:
        """ValueError in one line unless `tokenizer` is the one the LM was trained with."""
        if tokenizer_hash(tokenizer.to_dict()) != tokenizer_hash(self.tokenizer):
            raise ValueError(f"{self.path}: this LM was trained with another tokenizer ({self.tokenizer.get('kind')}, "
                             f"{self.config.vocab_size} ids) than {model_path} ({tokenizer.to_dict().get('kind')}, "
                             f"{tokenizer.vocab_size} ids); train the LM with the model's tokenizer")

    @torch.no_grad()
    def score(self, token_lists: Sequence[Sequence[int]]) -> list[float]:
        """ln P_LM(tokens, eos | sos) of each token sequence."""
        device = self.model.embed.weight.device
        sos = eos = self.config.vocab_size - 1
        out = []
        for tokens in token_lists:
            inputs = torch.tensor([[sos, *tokens]], device=device)
            targets = torch.tensor([*tokens, eos], device=device)
            out.append(float(self.model(inputs)[0].gather(1, targets[:, None]).sum()))
        return out


def load_neural_lm(path: str | os.PathLike, device: str | torch.device = "cpu") -> NeuralLM:
    """Read an LM file; CheckpointError naming the file when it is not one (or is newer)."""
    obj = load_file(path, LM_FORMAT)
    try:
        config = LMConfig(**obj["model"])
        tokenizer = dict(obj["tokenizer"])
        tokenizer_from_dict(tokenizer)
        if obj.get("tokenizer_sha256", tokenizer_hash(tokenizer)) != tokenizer_hash(tokenizer):
            raise ValueError("its tokenizer does not match the hash it was saved with")
        model = TransformerLM(config)
        model.load_state_dict(obj["state_dict"])
    except (KeyError, TypeError, ValueError, RuntimeError) as e:
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise CheckpointError(f"{path}: not a usable LM file ({reason})") from None
    return NeuralLM(model.to(device).eval(), tokenizer, os.fspath(path))


# ---------------------------------------------------------------------------------------------
# fusion


class TransformerLMScorer:
    """A NeuralLM as a FullScorer (asr.scorer): log-probabilities (R, V) of every next token for
    all rows, from a KV cache of the rows' tokens so far (made for `max_len` steps, grown when
    needed). The search weighs it (decoding.lm_weight)."""

    def __init__(self, lm: NeuralLM, max_len: int = 64) -> None:
        self.lm, self.max_len = lm, max_len

    def init_state(self, memory: torch.Tensor, memory_lens: torch.Tensor, group: int) -> DecoderCache:
        rows = memory.size(0) * group
        return self.lm.model.init_cache(rows, group, capacity=self.max_len, device=memory.device, dtype=memory.dtype)

    def score(self, state: DecoderCache, last_tokens: torch.Tensor) -> tuple[torch.Tensor, DecoderCache]:
        return self.lm.model.step(last_tokens, state), state

    def select_state(self, state: DecoderCache, selection: Selection) -> DecoderCache:
        return select_cache(state, selection)  # the rows' inputs are the decoder's: the same sharing

    def final_score(self, state: DecoderCache) -> torch.Tensor:
        return torch.zeros(state.rows, device=state.self_kv.device)  # ending is scored as the eos token


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
    """Language modelling for asr.trainer's loop: the cross-entropy of every token after sos (the
    sentence's tokens, then eos), summed and divided by the global batch's token count; records give
    it per token ("loss"), its perplexity and the next-token accuracy."""

    speed_key = "tokens_per_s"
    step_sums = ("loss", "correct")
    valid_sums = ("nll", "correct", "tokens")

    def __init__(self, model: TransformerLM, device: torch.device) -> None:
        self.model, self.device = model, device
        self.sos = self.eos = model.config.vocab_size - 1

    def _sums(self, model: torch.nn.Module, batch: TextBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(summed negative log-likelihood, correct argmax count, target count) of a batch."""
        tokens, lens = batch.tokens.to(self.device, non_blocking=True), batch.token_lens.to(self.device)
        sos = tokens.new_full((tokens.size(0), 1), self.sos)
        inputs = torch.cat([sos, tokens], dim=1)  # (B, L + 1)
        targets = torch.cat([tokens, tokens.new_full((tokens.size(0), 1), -1)], dim=1)
        targets = targets.scatter(1, lens[:, None], self.eos)  # (B, L + 1): y1 .. yn eos -1 ...
        log_probs = model(inputs)  # (B, L + 1, V)
        valid = targets >= 0
        log_probs, targets = log_probs[valid], targets[valid]
        nll = F.nll_loss(log_probs, targets, reduction="sum")
        return nll, (log_probs.argmax(-1) == targets).sum(), valid.sum()

    def counts(self, group: list[TextBatch]) -> list[float]:
        """(target tokens, eos included)."""
        return [sum(float(b.token_lens.sum()) + len(b.ids) for b in group)]

    def loss(self, model: torch.nn.Module, batch: TextBatch, counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        nll, correct, _ = self._sums(model, batch)
        loss = nll / counts[0]
        return loss, torch.stack([loss.detach().double(), correct.double()])

    def summarize(self, sums: list[float], counts: list[float], steps: int) -> dict[str, float]:
        loss = sums[0] / steps
        return {"loss": loss, "ppl": math.exp(min(loss, 50.0)), "accuracy": sums[1] / max(counts[0], 1)}

    def not_learning(self, record: dict[str, Any]) -> None:
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
    from asr.checkpoint import check_or_save_config
    from asr.distributed import collective_errors, end_process, setup_process, sigterm_stops
    from asr.train_log import TrainLog
    from asr.trainer import EpochLoaders, finish_run, fit, make_run, resume_run

    tc = config.training
    ctx = setup_process(device=tc.device, num_threads=tc.num_threads)
    exp = Path(exp_dir)
    try:
        with sigterm_stops(ctx, lambda: resume_hint(exp)), collective_errors(ctx, lambda: resume_hint(exp)):
            check_or_save_config(exp, to_dict(config), save=ctx.main)
            tok = lm_tokenizer(tokenizer)
            train_text = _experiment_text(exp / "text" / "train", texts, tok, config, ctx)
            valid_text = _experiment_text(exp / "text" / "valid", valid_texts, tok, config, ctx)
            torch.manual_seed(tc.seed)
            model = TransformerLM(dataclasses.replace(config.model, vocab_size=tok.vocab_size))
            plan = config.plan(ctx.world_size)
            log.info("a step: %d micro-batches of at most %g padded tokens, %d process(es) accumulating %d each",
                     plan.group, plan.micro_batch_seconds, plan.world_size, plan.accum)
            envelope = lambda run: lm_file(model=to_dict(run.config.model), tokenizer=run.tokenizer.to_dict(),  # noqa: E731
                                           state_dict=run.model.state_dict())
            config = dataclasses.replace(config, model=model.config)
            run = make_run(config, model, tok, exp, ctx, plan, envelope=envelope, final_name="lm_last.pt")
            state = resume_run(run)
            task = LMTask(run.model, ctx.device)
            logger = TrainLog(exp, ctx.main, summarize=task.summarize, speed_key=task.speed_key, resumed_at=state.step)
            train_loader = TextLoader(train_text, plan.micro_batch_seconds, training=True, seed=tc.seed,
                                      rank=ctx.rank, world_size=ctx.world_size, group=plan.group)
            valid_loader = TextLoader(valid_text, config.data.max_batch_tokens, training=False, seed=tc.seed,
                                      rank=ctx.rank, world_size=ctx.world_size)
            fit(run, state, task, EpochLoaders(train_loader), valid_loader, logger)
            return finish_run(run, logger)
    finally:
        end_process(ctx)


def _experiment_text(folder: Path, paths: Sequence[str], tokenizer: Tokenizer, config: LMExperimentConfig,
                     ctx) -> TokenizedText:
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
