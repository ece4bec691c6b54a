"""The training Dataset (utterance -> features and tokens) and collate (Examples -> a padded Batch);
for a frontend on the training device, the same Dataset's waveforms (`ASRDataset.waveform`) and
`collate_waves` (WaveExamples -> a padded WaveBatch).

A well-formed utterance whose audio cannot be used is returned as `Skipped(id, reason)`, never
raised (DESIGN.md "Nothing is lost"); reporting it is the caller's. Training randomness (dither)
comes from (seed, epoch, index) only, so that a resumed run sees the same features.
"""
from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Sequence
from typing import NamedTuple

import numpy as np
import torch
from torch.utils.data import Dataset

from asr.audio import SAMPLE_RATE, AudioError, load_audio
from asr.augment import AugmentConfig, Augmenter, derive_seed
from asr.feature_archive import FeatureArchive
from asr.features import FeatureConfig, GlobalCMVN, SpecAugmentConfig, fbank, num_frames, spec_augment
from asr.manifest import LENGTH_TOLERANCE, Utterance
from asr.metrics import normalize_text
from asr.tokenizer import Tokenizer
from asr.tokens import IGNORE_ID

__all__ = ["ASRDataset", "Batch", "Example", "Skipped", "WaveBatch", "WaveExample", "collate", "collate_waves",
           "derive_seed", "split_skipped"]

logger = logging.getLogger(__name__)


class Example(NamedTuple):
    """One loaded utterance."""

    id: str
    feats: torch.Tensor  # (T, D) float32, after CMVN when the dataset has one
    tokens: torch.Tensor  # (L,) int64


class WaveExample(NamedTuple):
    """One loaded utterance's waveform, for a frontend on the training device."""

    id: str
    wave: torch.Tensor  # (N,) float32 16 kHz, start/end and speed applied
    tokens: torch.Tensor  # (L,) int64
    index: int  # in the dataset: keys the frontend's dither and SpecAugment


class Skipped(NamedTuple):
    """An utterance that could not be used, with a one-line reason."""

    id: str
    reason: str


class _PackedStrings:
    """A read-only list of str kept as unique UTF-8 strings in one numpy byte array, offsets and
    one int32 code per row: no Python object per row, so that a forked DataLoader worker reads
    it without copying it (reading a list of str writes each one's reference count, dirtying
    its page), and repeated values (the audio and text of speed-perturbed copies) stored once."""

    def __init__(self, strings: Iterable[str]):
        codes: dict[str, int] = {}
        self._codes = np.array([codes.setdefault(x, len(codes)) for x in strings], dtype=np.int32)  # (N,)
        encoded = [x.encode("utf-8") for x in codes]
        self._offsets = np.zeros(len(encoded) + 1, dtype=np.int64)  # (unique + 1,) byte offsets
        np.cumsum([len(b) for b in encoded], out=self._offsets[1:])
        self._bytes = np.frombuffer(b"".join(encoded), dtype=np.uint8)

    def __len__(self) -> int:
        return len(self._codes)

    def __getitem__(self, index: int) -> str:
        code = self._codes[index]
        return self._bytes[self._offsets[code] : self._offsets[code + 1]].tobytes().decode("utf-8")

    @property
    def nbytes(self) -> int:
        return self._codes.nbytes + self._offsets.nbytes + self._bytes.nbytes


class _UtteranceTable:
    """Utterances in numpy arrays (see _PackedStrings): id, audio and text packed, duration,
    speed, start and end (NaN for None) as float64. `speaker` is not kept (loading needs none)."""

    def __init__(self, utts: Sequence[Utterance]):
        self.ids = _PackedStrings(u.id for u in utts)
        self.audio = _PackedStrings(u.audio for u in utts)
        self.text = _PackedStrings(u.text for u in utts)
        self.duration = np.array([u.duration for u in utts], dtype=np.float64)  # (N,) seconds
        self.speed = np.array([u.speed for u in utts], dtype=np.float64)  # (N,)
        self.start = np.array([math.nan if u.start is None else u.start for u in utts], dtype=np.float64)
        self.end = np.array([math.nan if u.end is None else u.end for u in utts], dtype=np.float64)

    def __len__(self) -> int:
        return len(self.duration)

    def __getitem__(self, index: int) -> Utterance:
        start, end = float(self.start[index]), float(self.end[index])
        return Utterance(
            self.ids[index], self.audio[index], float(self.duration[index]), self.text[index],
            start=None if math.isnan(start) else start, end=None if math.isnan(end) else end,
            speed=float(self.speed[index]),
        )

    @property
    def nbytes(self) -> int:
        arrays = (self.duration, self.speed, self.start, self.end)
        return sum(x.nbytes for x in (self.ids, self.audio, self.text, *arrays))


class ASRDataset(Dataset):
    """Utterances -> Example(id, feats, tokens), or Skipped(id, reason); never raises for a bad file.

    feats: fbank (asr.features) of the 16 kHz waveform (start/end/speed applied), then CMVN.
    tokens: tokenizer.encode(normalize_text(text)); empty when `tokenizer` is None.
    Skipped when the audio cannot be read, its decoded length differs from `duration` by more
    than 0.1 s, or it is too short for one frame; reporting is the caller's (the loader of
    `make_loader` logs each once). Training dither comes from a generator seeded by
    (seed, epoch, index): `dataset[i]` uses the epoch of `set_epoch`, `get(i, epoch)` the one given
    (what loader workers use: set_epoch does not reach persistent worker processes).
    With `archive`, the features it holds for an utterance (as its audio is now) are read from it
    instead: computed once without dither, so no dither in training either.
    `waveform(i)` gives the waveform instead of the features (WaveExample; same Skipped rules; no
    archive, dither or CMVN: a frontend on the training device adds them, see asr.device_frontend).
    The utterances are kept compactly (numpy arrays, no Python object per utterance);
    `utterance(i)` rebuilds one (without its speaker).
    `augment` (training only; asr.augment): noise and reverberation of the waveform (not of
    features read from the archive), and spectral warping of the features, drawn per (seed,
    epoch, index); for `waveform(i)` the noise and reverberation alone (the frontend warps).
    """

    def __init__(
        self,
        utts: Sequence[Utterance],
        tokenizer: Tokenizer | None,
        *,
        features: FeatureConfig,
        cmvn: GlobalCMVN | None = None,
        training: bool = False,
        seed: int = 0,
        archive: FeatureArchive | None = None,
        augment: AugmentConfig | None = None,
    ):
        self.archive = archive
        if archive is not None:
            self._archived, self._archived_frames = archive.rows(utts)
            found = int((self._archived >= 0).sum())
            logger.info("features of %d of %d utterances from %s%s", found, len(utts), archive.folder,
                        "" if found == len(utts) else "; the others computed from their audio")
        self._utts = _UtteranceTable(utts)
        self.tokenizer = tokenizer
        self.features = features
        self.cmvn = cmvn
        self.training = training
        self.seed = seed
        self.epoch = 0
        self.augmenter = None
        if training and augment is not None and augment.enabled:
            self.augmenter = Augmenter(augment, seed, other=self._other_wave, size=len(utts))
            archived = 0 if archive is None else int((self._archived >= 0).sum())
            if augment.on_waves and archived:
                logger.warning("data.augment: noise and reverberation apply to the utterances computed from "
                               "their audio, not to the %d read from %s", archived, archive.folder)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return len(self._utts)

    @property
    def durations(self) -> np.ndarray:
        """(N,) float64 seconds, read-only view."""
        view = self._utts.duration.view()
        view.flags.writeable = False
        return view

    def utterance(self, index: int) -> Utterance:
        return self._utts[index]

    def utt_id(self, index: int) -> str:
        return self._utts.ids[index]

    def __getitem__(self, index: int) -> Example | Skipped:
        return self.get(index, self.epoch)

    def get(self, index: int, epoch: int) -> Example | Skipped:
        """Utterance `index` with the training randomness of `epoch`."""
        utt = self._utts[index]
        draw = None if self.augmenter is None else self.augmenter.draw(epoch, index)
        if self.archive is not None and self._archived[index] >= 0:
            feats = self.archive.read(int(self._archived[index]), int(self._archived_frames[index]))
        else:
            wave = self._load(utt)
            if isinstance(wave, Skipped):
                return wave
            if draw is not None:
                wave = self.augmenter.wave(wave, draw)
            generator = torch.Generator().manual_seed(derive_seed(self.seed, epoch, index)) if self.training else None
            feats = fbank(wave, self.features, training=self.training, generator=generator)  # (T, D)
            if feats.shape[0] == 0:
                return self._too_short(utt.id, wave)
        if draw is not None:
            feats = self.augmenter.features(feats, draw)
        if self.cmvn is not None:
            with torch.no_grad():
                feats = self.cmvn(feats)
        return Example(utt.id, feats, self._tokens(utt.text))

    def waveform(self, index: int, epoch: int | None = None) -> WaveExample | Skipped:
        """Utterance `index` as its waveform, Skipped as `get` skips it (unreadable, wrong length,
        too short for one frame); the noise and reverberation of `epoch` (default: set_epoch's)."""
        utt = self._utts[index]
        wave = self._load(utt)
        if isinstance(wave, Skipped):
            return wave
        if num_frames(wave.numel(), self.features) == 0:
            return self._too_short(utt.id, wave)
        if self.augmenter is not None:
            wave = self.augmenter.wave(wave, self.augmenter.draw(self.epoch if epoch is None else epoch, index))
        return WaveExample(utt.id, wave, self._tokens(utt.text), index)

    def _other_wave(self, index: int) -> torch.Tensor | None:
        """Utterance `index`'s waveform for babble; None when it cannot be read."""
        wave = self._load(self._utts[index])
        return None if isinstance(wave, Skipped) else wave

    @staticmethod
    def _too_short(utt_id: str, wave: torch.Tensor) -> Skipped:
        return Skipped(utt_id, f"too short for one frame ({wave.numel() / SAMPLE_RATE:.3f} s)")

    def _load(self, utt: Utterance) -> torch.Tensor | Skipped:
        """(N,) float32 16 kHz waveform, or Skipped when unreadable or of the wrong length."""
        try:
            wave = load_audio(utt.audio, start=utt.start or 0.0, end=utt.end, speed=utt.speed)
        except AudioError as e:
            return Skipped(utt.id, str(e))
        except Exception as e:  # reported with the id, never raised out of the loader
            return Skipped(utt.id, f"{utt.audio}: {type(e).__name__}: {e}")
        decoded = wave.numel() / SAMPLE_RATE
        if abs(decoded - utt.duration) > LENGTH_TOLERANCE:
            return Skipped(utt.id, f"decoded length {decoded:.3f} s differs from duration {utt.duration:.3f} s")
        return wave

    def _tokens(self, text: str) -> torch.Tensor:
        if self.tokenizer is None:
            return torch.zeros(0, dtype=torch.long)
        return torch.tensor(self.tokenizer.encode(normalize_text(text)), dtype=torch.long)


# ---------------------------------------------------------------------------------------------
# Collate


class Batch(NamedTuple):
    """A padded batch. B = utterances, T = frames, D = feature bins, L = tokens."""

    ids: list[str]
    feats: torch.Tensor  # (B, T, D) float32, zero-padded
    feat_lens: torch.Tensor  # (B,) int64
    tokens: torch.Tensor  # (B, L) int64, padded with IGNORE_ID (-1)
    token_lens: torch.Tensor  # (B,) int64


class WaveBatch(NamedTuple):
    """A padded batch of waveforms, for a frontend on the training device (asr.device_frontend).
    B = utterances, N = samples, L = tokens."""

    ids: list[str]
    waves: torch.Tensor  # (B, N) float32 16 kHz, zero-padded
    wave_lens: torch.Tensor  # (B,) int64 samples
    tokens: torch.Tensor  # (B, L) int64, padded with IGNORE_ID (-1)
    token_lens: torch.Tensor  # (B,) int64
    indices: torch.Tensor  # (B,) int64 dataset indices: with `epoch`, key dither and SpecAugment
    epoch: int


def split_skipped(items: Iterable[Example | WaveExample | Skipped]) -> tuple[list, list[Skipped]]:
    """(the Examples or WaveExamples, the Skipped entries), each in the given order."""
    items = list(items)
    return [e for e in items if not isinstance(e, Skipped)], [e for e in items if isinstance(e, Skipped)]


def collate(
    examples: Sequence[Example | Skipped],
    *,
    specaug: SpecAugmentConfig | None = None,
    generator: torch.Generator | None = None,
    feat_dim: int | None = None,
) -> Batch:
    """Pad the Examples into a Batch (order kept). Skipped entries are left out: take them first
    with `split_skipped` to report them (the loader of `make_loader` does).
    With `specaug`, SpecAugment (asr.features.spec_augment) is applied within each length.
    `feat_dim` gives D for a batch without Examples (else D = 0)."""
    kept, _ = split_skipped(examples)
    dim = kept[0].feats.shape[1] if kept else (feat_dim or 0)
    feat_lens = torch.tensor([e.feats.shape[0] for e in kept], dtype=torch.long)
    feats = torch.zeros(len(kept), max(feat_lens.tolist(), default=0), dim)
    for b, e in enumerate(kept):
        feats[b, : e.feats.shape[0]] = e.feats
    tokens, token_lens = _pad_tokens([e.tokens for e in kept])
    if specaug is not None and kept:
        feats = spec_augment(feats, feat_lens, specaug, generator=generator)
    return Batch([e.id for e in kept], feats, feat_lens, tokens, token_lens)


def collate_waves(examples: Sequence[WaveExample | Skipped], *, epoch: int) -> WaveBatch:
    """Pad the WaveExamples of `epoch` into a WaveBatch (order kept); Skipped entries are left out
    (take them first with `split_skipped` to report them)."""
    kept, _ = split_skipped(examples)
    wave_lens = torch.tensor([e.wave.numel() for e in kept], dtype=torch.long)
    waves = torch.zeros(len(kept), max(wave_lens.tolist(), default=0))
    for b, e in enumerate(kept):
        waves[b, : e.wave.numel()] = e.wave
    tokens, token_lens = _pad_tokens([e.tokens for e in kept])
    indices = torch.tensor([e.index for e in kept], dtype=torch.long)
    return WaveBatch([e.id for e in kept], waves, wave_lens, tokens, token_lens, indices, epoch)


def _pad_tokens(seqs: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens (B, L) padded with IGNORE_ID, token_lens (B,)) of B token sequences."""
    token_lens = torch.tensor([t.numel() for t in seqs], dtype=torch.long)
    tokens = torch.full((len(seqs), max(token_lens.tolist(), default=0)), IGNORE_ID, dtype=torch.long)
    for b, t in enumerate(seqs):
        tokens[b, : t.numel()] = t
    return tokens, token_lens
