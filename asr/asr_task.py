"""Speech recognition as a training task (asr.train_task.Task): `ASRTask`, its work counted in
seconds of audio (`AUDIO`).

The loss of a Batch is the model's joint CTC-attention loss, normalized by the target tokens (eos
included) and utterances of the global batch; a validation sums the same losses and the token
accuracy, and decodes a fixed subset of the valid set greedily for CER and WER. Both report the
two losses per target token (so that training and validation curves compare, and a CTC loss near
ln V, chance, says the model is not learning: `not_learning`). Batches are Batches of features,
or WaveBatches of waveforms whose features its DeviceFrontend computes on the training device;
`stage` makes either a StagedBatch: features and targets on the device, lengths on the host (the
model copies them over itself, and its CTC reads them there without waiting for the device).
"""
from __future__ import annotations

import logging
import math
from typing import Any, NamedTuple

import numpy as np
import torch

from asr.audio import SAMPLE_RATE
from asr.dataset import Batch, WaveBatch
from asr.device_frontend import DeviceFrontend
from asr.features import FeatureConfig, frame_lengths
from asr.metrics import score
from asr.model import ctc_feasible
from asr.search import search
from asr.tokenizer import Tokenizer
from asr.tokens import FIRST_TOKEN
from asr.train_task import Autocast, Unit

__all__ = ["AUDIO", "ASRTask", "StagedBatch"]

log = logging.getLogger("asr.train")

AUDIO = Unit(name="seconds", symbol="s", example="utterance", cap_setting="data.max_batch_seconds",
             step_setting="training.global_batch_seconds", speed_key="audio_s_per_s", total_key="audio_hours",
             total_name="hours of audio", total_scale=1 / 3600)

# A CTC loss per token above this share of ln V (what guessing among V symbols costs) is near chance:
# the model has learned where labels go (blanks between them) and how often each label occurs, but
# not which labels it hears. That plateau sits at about 0.8 ln V; a model that learns falls below
# 0.5 ln V (recipes/README.md).
NEAR_CHANCE = 0.7


class StagedBatch(NamedTuple):
    """A micro-batch ready for the model (`ASRTask.stage`): what it computes with on the device,
    the lengths on the host."""

    ids: list[str]
    feats: torch.Tensor  # (B, T, D) float32, on the device
    feat_lens: torch.Tensor  # (B,) int64, on the host
    tokens: torch.Tensor  # (B, L) int64 padded with -1, on the device
    token_lens: torch.Tensor  # (B,) int64, on the host


class ASRTask:
    """Speech recognition: the joint CTC-attention loss of a Batch, normalized by the global
    batch's target tokens (eos included: attention) and utterances (CTC, as ESPnet and WeNet do);
    its records, training and validation alike, give both losses per target token and their
    weighted sum as "loss"; at validation also the token accuracy, and greedy CER/WER on a fixed
    subset of the valid set (rank 0, when given `decode_loader`: a loader of that subset, and
    `decode_text` its reference texts by id); its pictures are the attention pictures of the
    utterances of `picture_loader` (none without one). `not_learning` speaks once `check_after`
    seconds of audio are trained on (0: never).
    With `frontend` (data.frontend = "device"), batches are WaveBatches: their features are computed
    on `device` by it, in float32 (training features in `loss`, evaluation ones otherwise)."""

    unit = AUDIO
    step_sums = ("loss", "att_loss", "ctc_loss", "correct")
    valid_sums = ("att_loss", "ctc_loss", "correct", "tokens", "utts")

    def __init__(self, model: torch.nn.Module, tokenizer: Tokenizer, features: FeatureConfig, ctc_weight: float,
                 device: torch.device, *, decode_loader=None, decode_text: dict[str, str] | None = None,
                 frontend: DeviceFrontend | None = None, picture_loader=None, check_after: float = 0.0):
        self.model, self.tokenizer, self.device = model, tokenizer, device
        self.check_after = check_after
        self.features, self.ctc_weight = features, ctc_weight
        self.decode_loader, self.decode_text = decode_loader, decode_text or {}
        self.picture_loader = picture_loader
        self.figures: dict[str, Any] = {}  # utterance id -> its asr.attention_plot.AttentionFigure, laid out once
        self.frontend = None if frontend is None else frontend.to(device)
        self.ctc_reported: set[str] = set()

    def _inputs(self, batch: Batch | WaveBatch, *, training: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """(feats (B, T, D), feat_lens (B,)) on the device: a Batch's, or a WaveBatch's computed there."""
        if isinstance(batch, WaveBatch):
            return self._wave_feats(batch, training=training)
        return batch.feats.to(self.device, non_blocking=True), batch.feat_lens.to(self.device, non_blocking=True)

    def _wave_feats(self, batch: WaveBatch, *, training: bool) -> tuple[torch.Tensor, torch.Tensor]:
        if self.frontend is None:
            raise ValueError("ASRTask: a WaveBatch needs a DeviceFrontend (data.frontend = 'device')")
        waves = batch.waves.to(self.device, non_blocking=True)
        return self.frontend(waves, batch.wave_lens, batch.indices, batch.epoch, training)

    def _staged(self, batch: Batch | WaveBatch, *, training: bool) -> StagedBatch:
        """The batch as the model takes it: features and targets copied (or computed) on the device
        without blocking the host, the lengths left on the host."""
        if isinstance(batch, WaveBatch):
            feats = self._wave_feats(batch, training=training)[0]
        else:
            feats = batch.feats.to(self.device, non_blocking=True)
        tokens = batch.tokens.to(self.device, non_blocking=True)
        return StagedBatch(batch.ids, feats, self._feat_lens(batch), tokens, batch.token_lens)

    def _feat_lens(self, batch: Batch | WaveBatch) -> torch.Tensor:
        """(B,) frames, on the host."""
        return frame_lengths(batch.wave_lens, self.features) if isinstance(batch, WaveBatch) else batch.feat_lens

    def counts(self, group: list[Batch | WaveBatch]) -> list[float]:
        """(target tokens incl. eos, utterances)."""
        return [sum(float(b.token_lens.sum()) + len(b.ids) for b in group), sum(len(b.ids) for b in group)]

    def stage(self, batch: Batch | WaveBatch) -> StagedBatch:
        """The training micro-batch as `loss` takes it (asr.train_task.Task.stage): a WaveBatch's
        training features (dither, CMVN, SpecAugment) computed on the device; the utterances CTC
        cannot align reported (once per id, from the lengths on the host)."""
        if batch.ids:
            self._report_ctc_skips(batch)
        return self._staged(batch, training=True)

    def loss(self, model: torch.nn.Module, batch: StagedBatch | Batch | WaveBatch,
             counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The loss of a StagedBatch (a Batch or WaveBatch is staged here first)."""
        if not isinstance(batch, StagedBatch):
            batch = self.stage(batch)
        out = model(batch.feats, batch.feat_lens, batch.tokens, batch.token_lens, num_tokens=counts[0],
                    num_utts=counts[1])
        correct = out.accuracy.detach().double() * out.num_tokens
        ctc_per_token = out.ctc_loss.detach().double() * (counts[1] / counts[0])
        return out.loss, torch.stack([out.loss.detach().double(), out.att_loss.detach().double(), ctc_per_token,
                                      correct])

    def summarize(self, sums: list[float], counts: list[float], steps: int) -> dict[str, float]:
        """Losses per target token averaged over the steps ("loss": their weighted sum, as a
        validation's), the token accuracy over the tokens, and the objective as "objective" (its CTC
        per utterance)."""
        att, ctc = sums[1] / steps, sums[2] / steps
        return {"loss": self._weighted(att, ctc), "att_loss": att, "ctc_loss": ctc,
                "accuracy": sums[3] / max(counts[0], 1), "objective": sums[0] / steps}

    def _weighted(self, att: float, ctc: float) -> float:
        return self.ctc_weight * ctc + (1 - self.ctc_weight) * att

    def not_learning(self, record: dict[str, Any], trained: float) -> tuple[str, str, dict[str, float]] | None:
        """A CTC loss per token still above NEAR_CHANCE x ln V (unless CTC is not trained), once
        `check_after` seconds of audio are `trained` on."""
        if not self.check_after or trained < self.check_after:
            return None
        chance = math.log(self.model.config.vocab_size)
        ctc = record["ctc_loss"]
        if self.ctc_weight == 0.0 or ctc < NEAR_CHANCE * chance:
            return None
        return "ctc_plateau", (
            f"the CTC loss per token is {ctc:.2f}, near chance (ln V = {chance:.2f}): the model has not learned "
            "which tokens it hears. Likely causes: long utterances without a length curriculum (training.split_hours "
            "trains the first epochs on ~5 s pieces of them; recipes/README.md); transcripts that do not match their "
            "audio; labels almost as fast as the encoder frames (model.subsampling); a peak learning rate too high "
            "for the batch (training.lr, training.global_batch_seconds); too little data for the model"
        ), {"ctc_loss": ctc, "chance": chance}

    def _report_ctc_skips(self, batch: Batch | WaveBatch) -> None:
        """Log (once per id) the utterances CTC cannot align; computed on the CPU from the lengths,
        so no device synchronization. The model leaves them out of the CTC loss itself."""
        frames = self.model.encoder.subsampling.output_lengths(self._feat_lens(batch))
        for i in (~ctc_feasible(batch.tokens, batch.token_lens, frames)).nonzero().flatten().tolist():
            if batch.ids[i] not in self.ctc_reported:
                self.ctc_reported.add(batch.ids[i])
                log.warning("%s: more labels than encoder frames for CTC; left out of the CTC loss", batch.ids[i])

    def amount(self, group: list[Batch | WaveBatch]) -> float:
        """Seconds of audio."""
        return sum(float(self._durations(b).sum()) for b in group)

    def placeholder(self) -> Batch | WaveBatch:
        """One short utterance (1 s) with one token; a WaveBatch of silence with a frontend."""
        tokens, token_lens = torch.full((1, 1), FIRST_TOKEN), torch.tensor([1])
        if self.frontend is not None:
            return WaveBatch(ids=[], waves=torch.zeros(1, SAMPLE_RATE), wave_lens=torch.tensor([SAMPLE_RATE]),
                             tokens=tokens, token_lens=token_lens, indices=torch.tensor([0]), epoch=0)
        return Batch(ids=[], feats=torch.zeros(1, 100, self.features.n_mels), feat_lens=torch.tensor([100]),
                     tokens=tokens, token_lens=token_lens)

    def _durations(self, batch: Batch | WaveBatch) -> torch.Tensor:
        """(B,) float64 seconds of each utterance (of its samples, or of its frames)."""
        if isinstance(batch, WaveBatch):
            return batch.wave_lens.double() / SAMPLE_RATE
        return batch.feat_lens.double() * (self.features.frame_shift_ms / 1000)

    def _longest(self, batch: Batch | WaveBatch) -> float:
        return float(self._durations(batch).max())

    def describe(self, batch: Batch | WaveBatch) -> str:
        return f"a batch of {len(batch.ids)} utterances (longest {self._longest(batch):.1f} s)"

    def halves(self, batch: Batch | WaveBatch, step: int) -> list[Batch | WaveBatch]:
        """The two halves of a micro-batch that ran out of memory, or [] for one utterance (skipped,
        with a warning)."""
        if len(batch.ids) == 1:
            log.warning("%s (%.1f s): out of memory even alone; skipped", batch.ids[0], self._longest(batch))
            return []
        log.warning("step %d: out of memory on %s; split in two halves", step, self.describe(batch))
        half = len(batch.ids) // 2
        return [_rows(batch, slice(0, half)), _rows(batch, slice(half, None))]

    def validation(self, model: torch.nn.Module, batch: Batch | WaveBatch) -> torch.Tensor:
        one = torch.ones((), device=self.device)
        staged = self._staged(batch, training=False)
        out = model(staged.feats, staged.feat_lens, staged.tokens, staged.token_lens, num_tokens=one, num_utts=one)
        return torch.stack([out.att_loss.double(), out.ctc_loss.double(), out.accuracy.double() * out.num_tokens,
                            torch.as_tensor(out.num_tokens, dtype=torch.float64, device=self.device),
                            torch.as_tensor(out.num_utts, dtype=torch.float64, device=self.device)])

    def valid_metrics(self, sums: list[float]) -> dict[str, float]:
        att, ctc, correct, tokens, _utts = sums
        att, ctc, accuracy = (x / max(tokens, 1) for x in (att, ctc, correct))
        return {"loss": self._weighted(att, ctc), "att_loss": att, "ctc_loss": ctc, "accuracy": accuracy}

    def decode_metrics(self, model: torch.nn.Module, autocast: Autocast) -> dict[str, float]:
        """Greedy attention decoding of the decode subset: {"cer", "wer"}."""
        if self.decode_loader is None:
            return {}
        refs, hyps = {}, {}
        self.decode_loader.set_epoch(0)
        for batch in self.decode_loader:
            if not batch.ids:
                continue
            feats, feat_lens = self._inputs(batch, training=False)
            with autocast():
                found = search(model, feats, feat_lens)
            for utt_id, hyp in zip(batch.ids, found):
                refs[utt_id], hyps[utt_id] = self.decode_text[utt_id], self.tokenizer.decode(hyp.tokens)
        if not refs:
            return {}
        stats = score(refs, hyps).stats
        return {"cer": stats.cer, "wer": stats.wer}

    def pictures(self, model: torch.nn.Module) -> dict[str, dict[str, np.ndarray]]:
        """{"attention": the attention pictures of the utterances of `picture_loader` by file name
        (<id>.png)}, or {} without them."""
        if self.picture_loader is None:
            return {}
        from asr.attention_plot import picture_name

        return {"attention": {picture_name(utt_id): image for utt_id, image in self._attention(model).items()}}

    def _attention(self, model: torch.nn.Module) -> dict[str, np.ndarray]:
        """The attention pictures (asr.attention_plot) of the utterances of `picture_loader`, by id:
        each one's reference transcript (its target tokens) teacher-forced over its encoder output
        alone, in eval mode and float32. Each utterance's figure is laid out once and its heatmaps
        redrawn at every call: a few utterances cost about a validation batch each."""
        from asr.attention_plot import AttentionFigure, cross_attention, frame_ms, token_labels

        pictures, training = {}, model.training
        model.eval()
        try:
            with torch.no_grad():
                self.picture_loader.set_epoch(0)
                for batch in self.picture_loader:
                    feats, feat_lens = self._inputs(batch, training=False)
                    for i, utt_id in enumerate(batch.ids):
                        memory, memory_lens = model.encoder(feats[i:i + 1, :int(feat_lens[i])], feat_lens[i:i + 1])
                        if int(memory_lens[0]) == 0:  # too short for an encoder frame
                            continue
                        tokens = batch.tokens[i, :int(batch.token_lens[i])].tolist()
                        weights = cross_attention(model, memory[0], tokens)  # (layers, L + 1, S)
                        figure = self.figures.get(utt_id)
                        if figure is None or figure.shape != tuple(weights.shape):
                            figure = self.figures[utt_id] = AttentionFigure(
                                weights.shape, token_labels(self.tokenizer, tokens),
                                title=f"{utt_id}: {self.tokenizer.decode(tokens)}", frame_ms=frame_ms(model))
                        pictures[utt_id] = figure.draw(weights)
        finally:
            model.train(training)
        return pictures


def _rows(batch: Batch | WaveBatch, rows: slice) -> Batch | WaveBatch:
    """Some utterances of a padded batch, trimmed to their own longest features (or waveforms)
    and targets."""
    token_lens = batch.token_lens[rows]
    tokens = batch.tokens[rows, : int(token_lens.max())]
    if isinstance(batch, WaveBatch):
        wave_lens = batch.wave_lens[rows]
        waves = batch.waves[rows, : int(wave_lens.max())]
        return WaveBatch(batch.ids[rows], waves, wave_lens, tokens, token_lens, batch.indices[rows], batch.epoch)
    feat_lens = batch.feat_lens[rows]
    return Batch(batch.ids[rows], batch.feats[rows, : int(feat_lens.max())], feat_lens, tokens, token_lens)
