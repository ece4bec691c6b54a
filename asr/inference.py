"""The inference-model contract: what decoding (asr.search, asr.decoding, asr.alignment) reads of a
model. The PyTorch model (asr.model.ASRModel) and the exported one run by onnxruntime
(asr.onnx_model.OnnxModel) both implement it, so one search drives either with no branch on the
kind. A leaf: it imports torch alone (other types are named by the Protocols below).

Shape legend: B utterances, N hypotheses per utterance, R = B * N rows (utterance b owns rows
b*N .. b*N + N - 1), T feature frames, S encoder frames, L tokens, V vocabulary.

A streaming encoder adds a chunk-by-chunk call beside `encode` (its output is the same memory the
search reads), so the search and the decoder's cache need nothing more for it.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

__all__ = ["DecoderState", "InferenceModel", "ModelDims"]


class ModelDims(Protocol):
    """What decoding reads of a model's configuration (asr.model.ModelConfig has these fields)."""

    vocab_size: int  # V, blank 0 and unk 1 included, sos = eos = V - 1
    subsampling: int  # feature frames per encoder frame
    frame_shift_ms: float  # of the feature frames the model is fed
    tokens_per_second: float  # the training data's label rate (0: unknown): the search's length cap

    @property
    def sos(self) -> int: ...

    @property
    def eos(self) -> int: ...

    @property
    def frames_per_second(self) -> float:
        """Encoder frames per second of audio."""


class DecoderState(Protocol):
    """The decoder's cache between steps: the R hypotheses' self-attention keys and values, and the
    memory's projections once per utterance. The search never looks inside: it selects rows.

    Selecting is in two halves around the one host synchronization a search step makes: the search
    asks for the numbers the state needs on the host (`selection_counts`, kept on the device, added
    to the search's own transfer), then selects with their values (`select`)."""

    @property
    def rows(self) -> int:
        """R, the hypotheses the state holds."""

    def selection_counts(self, rows: torch.Tensor, kept: torch.Tensor) -> torch.Tensor:
        """(k,) long on the device: what `select` will need to know on the host to keep the rows
        `rows` (R,) cut to their first `kept` (a () long tensor) utterances of N rows each. The search
        passes the R-row order it proposes before it knows how many utterances stay."""

    def select(self, rows: torch.Tensor, counts: Sequence[int]) -> DecoderState:
        """Keep rows `rows` (R',) long in that order: row i continues row rows[i]. R' == R: each row
        continues a row of its own utterance. R' < R: whole utterances dropped, rows in groups of N
        (group u continues utterance rows[u * N] // N). `counts`: the values of `selection_counts`
        of these rows. May update in place; returns the state."""


class InferenceModel(Protocol):
    """A model the search decodes with (module docstring). Eval mode; calls under torch.no_grad()."""

    config: ModelDims

    @property
    def device(self) -> torch.device:
        """Where the model's inputs go."""

    @property
    def chunked_attention(self) -> bool:
        """Whether `encode` takes chunk_size and left_chunks (decoding.chunk_size)."""

    @property
    def min_frames(self) -> int:
        """Feature frames the first encoder frame needs: a shorter input has no encoder output and
        decodes to the empty hypothesis without being encoded."""

    def encode(self, feats: torch.Tensor, feat_lens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """memory (B, S, d) and memory_lens (B,) long of feats (B, T, n_mels), feat_lens (B,) long,
        T >= min_frames. A model whose `chunked_attention` is true also takes chunk_size and
        left_chunks (keywords): the memory a streaming encoder gives (asr.model.StreamingEncoder)."""

    def ctc_log_probs(self, memory: torch.Tensor) -> torch.Tensor:
        """CTC log-probabilities (B, S, V) float32 of memory (B, S, d)."""

    def init_cache(self, memory: torch.Tensor, memory_lens: torch.Tensor, *, rows: int,
                   capacity: int = 64) -> DecoderState:
        """The empty hypotheses' state: `rows` = B * N rows over memory (B, S, d), memory_lens (B,);
        room for `capacity` steps (grown when exceeded)."""

    def step(self, last_tokens: torch.Tensor, cache: DecoderState) -> tuple[torch.Tensor, DecoderState]:
        """Log-probabilities (R, V) float32 of the token after each row's last token (R,) long (sos
        at the first step), and the state that has read them."""

    def teacher_forced(self, tokens: torch.Tensor, token_lens: torch.Tensor, memory: torch.Tensor,
                       memory_lens: torch.Tensor) -> torch.Tensor:
        """Log-probabilities (R, L, V) float32 of the token after each of tokens (R, L) (sos first,
        R a multiple of the B utterances of memory; positions >= token_lens unspecified)."""
