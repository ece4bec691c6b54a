"""What the three toolkits of the peer benchmark build and do alike: the model's dimensions, the
token ids, the forced output lengths, and the interface each toolkit's adapter offers.

Standard library and torch only, so that the adapters (ours.py, espnet_model.py,
speechbrain_model.py) and the driver (bench.py) share it without importing each other.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

import torch

# The ESPnet / WeNet LibriSpeech-100h transformer (conf/librispeech_100h.yaml at 300 tokens).
VOCAB = 300  # blank 0, unk 1, real tokens 2 .. V - 2, sos = eos = V - 1 in all three
BLANK = 0
EOS = VOCAB - 1
N_MELS = 80
D_MODEL = 256
N_HEADS = 4
FFN_DIM = 2048
ENCODER_LAYERS = 12
DECODER_LAYERS = 6
CONV_CHANNELS = 256  # two 3x3 stride-2 valid convolutions (4x), ReLU, no norm
DROPOUT = 0.1
CTC_WEIGHT_TRAIN = 0.3
LABEL_SMOOTHING = 0.1
LEARNING_RATE = 1e-4  # AdamW, for the training step

# Decoding is made equal work: the decoder's output bias of eos is EOS_BIAS in every toolkit, so
# no hypothesis ends early, and every utterance ends after exactly forced_lengths() tokens, each
# toolkit being told so through its own length options (see README.md).
EOS_BIAS = -1e4
TOKENS_PER_FRAME = 0.3  # forced tokens per encoder frame: 7.5 per second at 25 frames per second
FRAME_RATE = 100.0  # fbank frames per second
SAMPLE_RATE = 16000


def encoder_frames(frames: torch.Tensor) -> torch.Tensor:
    """Encoder frames (B,) long after the 4x valid conv2d subsampling of all three: ((T - 1) // 2 - 1) // 2."""
    return ((frames - 1) // 2 - 1) // 2


def forced_lengths(frames: torch.Tensor) -> torch.Tensor:
    """Output tokens (B,) long of each utterance of `frames` (B,) fbank frames:
    floor(TOKENS_PER_FRAME * encoder frames), as our SearchOptions.max_len_ratio computes it."""
    return torch.tensor([math.floor(float(n) * TOKENS_PER_FRAME) for n in encoder_frames(frames).tolist()])


@dataclass(frozen=True)
class Utterances:
    """Inputs of a decoding run: feats (B, T, N_MELS) float32 (normalized, zero-padded),
    frames (B,) long valid frames, lengths (B,) long tokens each utterance must get."""

    feats: torch.Tensor
    frames: torch.Tensor
    lengths: torch.Tensor

    def __len__(self) -> int:
        return self.feats.size(0)

    def subset(self, start: int, stop: int) -> Utterances:
        """Utterances start .. stop - 1, cut to their own longest input."""
        frames = self.frames[start:stop]
        return Utterances(self.feats[start:stop, : int(frames.max())], frames, self.lengths[start:stop])


@dataclass(frozen=True)
class TrainBatch:
    """A training batch: feats (B, T, N_MELS), frames (B,), tokens (B, L) real token ids padded
    with -1, token_lens (B,)."""

    feats: torch.Tensor
    frames: torch.Tensor
    tokens: torch.Tensor
    token_lens: torch.Tensor


@dataclass(frozen=True)
class AudioFile:
    """A 16 kHz mono WAV file of the data-loading workload."""

    path: str
    seconds: float


class Toolkit(Protocol):
    """What bench.py asks of each toolkit's adapter. Every method runs the toolkit's own code."""

    name: str

    def parameters(self) -> dict[str, int]:
        """Parameter counts: 'subsampling', 'encoder' (subsampling included), 'decoder'
        (embedding and output layer included), 'ctc', 'total'."""

    def decode(self, utts: Utterances, *, beam_size: int, ctc_weight: float) -> list[list[int]]:
        """Encode and beam-search `utts` as one batch in the toolkit's fastest way; the best
        hypothesis of each utterance (token ids, no sos / eos)."""

    def train_step(self, batch: TrainBatch) -> float:
        """One forward + backward + AdamW step with the toolkit's joint CTC / attention loss
        (CTC weight CTC_WEIGHT_TRAIN, label smoothing LABEL_SMOOTHING, dropout DROPOUT); the loss."""

    def prepare_loading(self, files: list[AudioFile]) -> None:
        """Untimed set-up of the loading path: global CMVN statistics of `files`."""

    def load(self, files: list[AudioFile], batch_size: int) -> int:
        """Read, fbank, normalize and collate `files` in batches of `batch_size`, in order, as
        the toolkit's data pipeline does; the number of feature frames produced."""
