"""ModelConfig and ASRModel: encoder, attention decoder and CTC head trained with the joint loss.

Token ids (DESIGN.md, defined in asr.tokens): blank 0, unk 1, real tokens from 2, sos = eos = V - 1,
target padding -1.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from asr.model.attention import MultiHeadAttention
from asr.model.conformer import ConformerEncoder
from asr.model.decoder import DecoderCache, TransformerDecoder
from asr.model.encoder import TransformerEncoder
from asr.model.subsampling import RATES, conv_output_length
from asr.tokens import BLANK, IGNORE_ID, MIN_VOCAB, eos_id, sos_id

__all__ = [
    "ASRModel", "ModelConfig", "ModelOutput", "build_model", "check_ctc_feasible", "count_parameters",
    "ctc_feasible", "smoothed_cross_entropy",
]

ENCODERS = {"transformer": TransformerEncoder, "conformer": ConformerEncoder}
CTC_MARGIN = 1.25  # headroom of the encoder frame rate over the mean token rate (see check_ctc_feasible)


@dataclass(frozen=True)
class ModelConfig:
    """The network's dimensions and loss weights; stored in model files as a plain dict
    (`dataclasses.asdict`). Defaults: the ESPnet / WeNet LibriSpeech-100h transformer baseline."""

    vocab_size: int = 0  # V incl. blank, unk and sos/eos; 0 = not set yet: build_model takes the tokenizer's
    encoder: Literal["transformer", "conformer"] = "transformer"  # model files without the key: transformer
    n_mels: int = 80  # input feature dimension
    subsampling: int = 4  # time reduction of the conv front end: 4, 6 or 8
    conv_channels: int = 256  # channels of the subsampling convs (independent of d_model)
    d_model: int = 256
    n_heads: int = 4
    ffn_dim: int = 2048  # the encoder's feed-forward width (each of a conformer block's two), and the decoder's
    decoder_ffn_dim: int = 0  # > 0: the decoder's feed-forward width instead of ffn_dim
    encoder_layers: int = 12
    decoder_layers: int = 6
    dropout: float = 0.1  # residual, position-wise feed-forward and input (after positions) dropout
    attention_dropout: float = 0.0  # on attention weights
    conv_kernel: int = 0  # the conformer's convolution kernel (odd, > 0; ESPnet: 31); a transformer with
    # conv_kernel > 0 gets a convolution block of this kernel in every layer
    causal_conv: bool = False  # the encoder's convolutions see no future frame (streaming models)
    dynamic_chunk: bool = False  # training draws a chunk size per batch (U2's dynamic chunk training):
    # full context with probability 1/2, else uniform in [1, max_chunk] encoder frames, so that one
    # model serves any chunk size at decoding time (StreamingEncoder)
    max_chunk: int = 25  # the largest chunk dynamic_chunk draws
    ctc_weight: float = 0.3  # loss = ctc_weight * CTC + (1 - ctc_weight) * attention
    interctc_weight: float = 0.0  # intermediate CTC (Lee and Watanabe, 2021): CTC = (1 - w) * the final
    # layer's + w * the mean over interctc_layers of the CTC head on those layers' outputs
    interctc_layers: tuple[int, ...] = ()  # encoder layers (1-based, below the last) for interctc_weight > 0
    lsm_weight: float = 0.1  # label smoothing e of the attention loss
    tie_embeddings: bool = False  # share the decoder's embedding and output projection matrix
    tokens_per_second: float = 0.0  # mean target rate of the training data (tokens / seconds of audio);
    # 0 = unknown; build_model takes it from the trainer (search caps output lengths with it)
    frame_shift_ms: float = 10.0  # of the feature frames the model is fed: the frontend's
    # (FeatureConfig.frame_shift_ms, set by the trainer); model files without it are 10 ms ones

    def __post_init__(self) -> None:
        positive = ("n_mels", "conv_channels", "d_model", "n_heads", "ffn_dim", "encoder_layers", "decoder_layers")
        for name in positive:
            _require(self, name, getattr(self, name) > 0, "must be positive")
        _require(self, "vocab_size", self.vocab_size == 0 or self.vocab_size >= MIN_VOCAB,
                 f"must be 0 (set from the tokenizer) or at least {MIN_VOCAB}")
        _require(self, "subsampling", self.subsampling in RATES, f"must be one of {RATES}")
        _require(self, "n_mels", conv_output_length(self.n_mels, self.subsampling) >= 1,
                 f"is too small for {self.subsampling}x subsampling")
        _require(self, "d_model", self.d_model % self.n_heads == 0 and self.d_model % 2 == 0,
                 f"must be even and a multiple of n_heads ({self.n_heads})")
        for name in ("dropout", "attention_dropout", "lsm_weight"):
            _require(self, name, 0.0 <= getattr(self, name) < 1.0, "must be in [0, 1)")
        _require(self, "ctc_weight", 0.0 <= self.ctc_weight <= 1.0, "must be in [0, 1]")
        _require(self, "max_chunk", self.max_chunk >= 1, "must be >= 1")
        _require(self, "interctc_weight", 0.0 <= self.interctc_weight < 1.0, "must be in [0, 1)")
        layers = self.interctc_layers
        _require(self, "interctc_layers", list(layers) == sorted(set(layers))
                 and all(1 <= i < self.encoder_layers for i in layers),
                 f"must be ascending encoder layers in [1, {self.encoder_layers - 1}]")
        _require(self, "interctc_layers", bool(layers) == (self.interctc_weight > 0),
                 "must be given exactly when interctc_weight > 0")
        _require(self, "encoder", self.encoder in ENCODERS, f"must be one of {', '.join(map(repr, ENCODERS))}")
        _require(self, "decoder_ffn_dim", self.decoder_ffn_dim >= 0, "must be 0 (= ffn_dim) or positive")
        odd = self.conv_kernel > 0 and self.conv_kernel % 2 == 1
        if self.encoder == "conformer":
            _require(self, "conv_kernel", odd, "must be positive and odd for a conformer encoder (ESPnet uses 31)")
        _require(self, "conv_kernel", self.conv_kernel == 0 or odd, "must be 0 (no convolution block) or odd")
        _require(self, "tokens_per_second", self.tokens_per_second >= 0.0, "must be 0 (unknown) or positive")
        _require(self, "frame_shift_ms", self.frame_shift_ms > 0.0, "must be positive")

    @property
    def sos(self) -> int:
        return sos_id(self.vocab_size)

    @property
    def eos(self) -> int:
        return eos_id(self.vocab_size)

    @property
    def frames_per_second(self) -> float:
        """Encoder frames per second of audio."""
        return encoder_frame_rate(self.subsampling, self.frame_shift_ms)


def _require(config: ModelConfig, name: str, ok: bool, reason: str) -> None:
    if not ok:
        raise ValueError(f"model.{name} = {getattr(config, name)!r} {reason}")


class ModelOutput(NamedTuple):
    """What `ASRModel.forward` returns; losses are already divided by their normalizers."""

    loss: torch.Tensor  # () ctc_weight * ctc_loss + (1 - ctc_weight) * att_loss
    att_loss: torch.Tensor  # () label-smoothed cross-entropy summed over target tokens / num_tokens normalizer
    ctc_loss: torch.Tensor  # () CTC summed over (feasible) utterances / num_utts normalizer (with intermediate
    # CTC: the weighted sum of the final and intermediate layers', ModelConfig.interctc_weight)
    accuracy: torch.Tensor  # () fraction of this batch's target tokens the teacher-forced argmax gets right
    num_tokens: torch.Tensor  # () long, target tokens in this batch, one eos per utterance included
    num_utts: torch.Tensor  # () long, utterances in this batch
    ctc_skipped: torch.Tensor  # (B,) bool, utterances left out of the CTC loss: labels + repeats > frames


def encoder_frame_rate(subsampling: int, frame_shift_ms: float) -> float:
    """Encoder frames per second of audio: feature frames every `frame_shift_ms`, `subsampling` to one."""
    return 1000.0 / frame_shift_ms / subsampling


def check_ctc_feasible(subsampling: int, tokens_per_second: float, *, frame_shift_ms: float = 10.0,
                       margin: float = CTC_MARGIN) -> None:
    """Raise a one-line ValueError when `subsampling` leaves too few encoder frames for CTC.

    CTC needs a frame per label plus one per repeated label. `tokens_per_second` is the mean
    rate of the training targets (tokens / seconds of audio); fast speech and repeats run above
    the mean, so the frame rate must exceed it by `margin`. Characters (about 14 per second in
    LibriSpeech) fail at 8x (12.5 frames per second of 10 ms features) and pass at 4x (25).
    """
    frames = encoder_frame_rate(subsampling, frame_shift_ms)
    if tokens_per_second * margin > frames:
        raise ValueError(
            f"{subsampling}x subsampling gives {frames:.1f} encoder frames per second, too few for CTC on "
            f"{tokens_per_second:.1f} tokens per second (needs {tokens_per_second * margin:.1f}: {margin:g}x for fast "
            "speech and repeated tokens); use a lower subsampling rate or larger tokens (BPE)"
        )


def ctc_feasible(tokens: torch.Tensor, token_lens: torch.Tensor, frame_lens: torch.Tensor) -> torch.Tensor:
    """(B,) bool: True where CTC can align tokens (B, L) (-1 padded) to frame_lens (B,) frames,
    i.e. frames >= labels + repeated neighbouring labels (and at least one frame)."""
    valid = torch.arange(tokens.size(1), device=tokens.device) < token_lens[:, None]  # (B, L)
    repeats = ((tokens[:, 1:] == tokens[:, :-1]) & valid[:, 1:]).sum(dim=1)  # (B,)
    return (token_lens + repeats <= frame_lens) & (frame_lens > 0)


def smoothed_cross_entropy(log_probs: torch.Tensor, targets: torch.Tensor, smoothing: float) -> torch.Tensor:
    """Per-token label-smoothed cross-entropy (N,) of log_probs (N, V) against targets (N,):
    the target has weight 1 - e, every other token e / (V - 1)."""
    other = smoothing / (log_probs.size(-1) - 1)
    target_lp = log_probs.gather(-1, targets[:, None])[:, 0]  # (N,)
    return -((1.0 - smoothing - other) * target_lp + other * log_probs.sum(dim=-1))


class ASRModel(nn.Module):
    """Transformer or conformer encoder (`config.encoder`), attention decoder and CTC head (a Linear
    on the encoder output)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        if config.vocab_size == 0:
            raise ValueError("model.vocab_size is not set: build the model with build_model(config, vocab_size=...)")
        self.config = config
        self.encoder = ENCODERS[config.encoder](
            n_mels=config.n_mels, d_model=config.d_model, n_heads=config.n_heads, ffn_dim=config.ffn_dim,
            n_layers=config.encoder_layers, conv_channels=config.conv_channels, subsampling=config.subsampling,
            dropout=config.dropout, attention_dropout=config.attention_dropout, conv_kernel=config.conv_kernel,
            causal_conv=config.causal_conv,
        )
        self.decoder = TransformerDecoder(
            vocab_size=config.vocab_size, d_model=config.d_model, n_heads=config.n_heads,
            ffn_dim=config.decoder_ffn_dim or config.ffn_dim, n_layers=config.decoder_layers, dropout=config.dropout,
            attention_dropout=config.attention_dropout, tie_embeddings=config.tie_embeddings,
        )
        self.ctc = nn.Linear(config.d_model, config.vocab_size)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Xavier-uniform matrices (attention q, k, v each on its own), zero biases, LayerNorm (1, 0),
        embedding N(0, 1/d) so that the sqrt(d)-scaled embedding has unit variance; the conformer's
        relative-position biases u, v xavier-uniform (RelPositionAttention.reset_parameters)."""
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Conv2d)):
                nn.init.xavier_uniform_(module.weight)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, MultiHeadAttention):
                module.reset_parameters()
            elif isinstance(module, nn.LayerNorm):
                module.reset_parameters()
        nn.init.normal_(self.decoder.embed.weight, std=self.config.d_model ** -0.5)  # last: wins when tied

    def ctc_log_probs(self, h: torch.Tensor) -> torch.Tensor:
        """CTC log-probabilities (B, T, V) float32 of encoder output h (B, T, d)."""
        return self.ctc(h).float().log_softmax(dim=-1)

    # the inference contract (asr.inference.InferenceModel): what decoding reads

    @property
    def device(self) -> torch.device:
        return self.decoder.embed.weight.device  # (an embedding: int8 copies keep it, asr.quantize)

    @property
    def min_frames(self) -> int:
        """Feature frames the first encoder frame needs (the subsampling's receptive field)."""
        return self.encoder.subsampling.receptive_field

    chunked_attention = True  # `encode` takes chunk_size and left_chunks (StreamingEncoder)

    def encode(self, feats: torch.Tensor, feat_lens: torch.Tensor, *, chunk_size: int = 0,
               left_chunks: int = -1) -> tuple[torch.Tensor, torch.Tensor]:
        """(memory (B, S, d), memory_lens (B,)) of feats (B, T, n_mels), feat_lens (B,); with
        chunk_size > 0, each frame attends to its chunk and `left_chunks` before (StreamingEncoder)."""
        if chunk_size == 0:
            return self.encoder(feats, feat_lens)
        return self.encoder(feats, feat_lens, chunk_size=chunk_size, left_chunks=left_chunks)

    def init_cache(self, memory: torch.Tensor, memory_lens: torch.Tensor, *, rows: int,
                   capacity: int = 64) -> DecoderCache:
        return self.decoder.init_cache(memory, memory_lens, rows=rows, capacity=capacity)

    def step(self, last_tokens: torch.Tensor, cache: DecoderCache) -> tuple[torch.Tensor, DecoderCache]:
        return self.decoder.step(last_tokens, cache)

    def teacher_forced(self, tokens: torch.Tensor, token_lens: torch.Tensor, memory: torch.Tensor,
                       memory_lens: torch.Tensor) -> torch.Tensor:
        return self.decoder(tokens, token_lens, memory, memory_lens)

    def forward(
        self,
        feats: torch.Tensor,
        feat_lens: torch.Tensor,
        tokens: torch.Tensor,
        token_lens: torch.Tensor,
        *,
        num_tokens: torch.Tensor | float | None = None,
        num_utts: torch.Tensor | float | None = None,
    ) -> ModelOutput:
        """Joint loss of feats (B, T, n_mels), feat_lens (B,), tokens (B, L) padded with -1, token_lens (B,).

        tokens hold the targets only: sos and eos are added here. The attention loss is divided
        by `num_tokens` (default: this batch's sum(token_lens + 1), eos included) and the CTC loss
        by `num_utts` (default: this batch's B, infeasible utterances included); a DDP trainer
        passes the global batch's counts so that the ranks' gradients sum to the whole batch's.
        Utterances CTC cannot align (labels + repeats > encoder frames) add 0 to the CTC loss and
        are flagged in `ctc_skipped`; the loss is never infinite. feat_lens and token_lens may be
        on the host while feats are on a GPU (a trainer has them there): CTC then reads its lengths
        without waiting for the device.
        """
        lens = (feat_lens, token_lens)  # where the caller has them: on the host, CTC reads them there
        feat_lens, token_lens = (x.to(feats.device, non_blocking=True) for x in lens)
        h, h_lens, inter = self.encoder.forward_intermediate(feats, feat_lens, self.config.interctc_layers,
                                                             chunk_size=self._training_chunk())
        ctc_lens = (self.encoder.subsampling.output_lengths(lens[0]), lens[1])
        ctc_sum, skipped = self._ctc_sum(h, h_lens, tokens, token_lens, ctc_lens)
        if inter:
            w = self.config.interctc_weight
            inter_sum = sum(self._ctc_sum(x, h_lens, tokens, token_lens, ctc_lens)[0] for x in inter)
            ctc_sum = (1.0 - w) * ctc_sum + w * inter_sum / len(inter)
        att_sum, correct, count = self._attention_sum(h, h_lens, tokens, token_lens)
        num_tokens = count if num_tokens is None else num_tokens
        num_utts = token_lens.new_tensor(tokens.size(0)) if num_utts is None else num_utts
        att_loss, ctc_loss = att_sum / num_tokens, ctc_sum / num_utts
        weight = self.config.ctc_weight
        loss = weight * ctc_loss + (1.0 - weight) * att_loss
        return ModelOutput(loss, att_loss, ctc_loss, correct / count.clamp(min=1), count,
                           token_lens.new_tensor(tokens.size(0)), skipped)

    def _training_chunk(self) -> int:
        """This batch's chunk size (0: full context): drawn from torch's generator in training with
        `dynamic_chunk`, else 0."""
        if not (self.training and self.config.dynamic_chunk) or torch.rand(()) < 0.5:
            return 0
        return int(torch.randint(1, self.config.max_chunk + 1, ()))

    def _ctc_sum(self, h: torch.Tensor, h_lens: torch.Tensor, tokens: torch.Tensor, token_lens: torch.Tensor,
                 ctc_lens: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """CTC loss summed over the feasible utterances, and the (B,) mask of the others. `ctc_lens`:
        (h_lens, token_lens) where the caller had them; torch's CTC reads its lengths on the host,
        which for lengths on a GPU is a synchronization."""
        log_probs = self.ctc_log_probs(h).transpose(0, 1)  # (T, B, V), T >= 1
        # an utterance without frames is infeasible; one (padding) frame keeps every kernel happy
        per_utt = F.ctc_loss(log_probs, tokens.clamp(min=0), ctc_lens[0].clamp(min=1), ctc_lens[1], blank=BLANK,
                             reduction="none", zero_infinity=True)  # (B,)
        feasible = ctc_feasible(tokens, token_lens, h_lens)
        return torch.where(feasible, per_utt, 0.0).sum(), ~feasible

    def _attention_sum(self, h: torch.Tensor, h_lens: torch.Tensor, tokens: torch.Tensor,
                       token_lens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Label-smoothed CE summed over targets + eos, correct argmax count, target count."""
        eos = self.config.eos
        sos_column = tokens.new_full((tokens.size(0), 1), self.config.sos)
        inputs = torch.cat([sos_column, tokens], dim=1)  # (B, L + 1): sos y1 .. yn [-1 ...]
        padding = tokens.new_full((tokens.size(0), 1), IGNORE_ID)
        targets = torch.cat([tokens, padding], dim=1)  # (B, L + 1): y1 .. yn -1 [-1 ...]
        targets = targets.scatter(1, token_lens[:, None], eos)  # y1 .. yn eos [-1 ...]
        log_probs = self.decoder(inputs, token_lens + 1, h, h_lens)  # (B, L + 1, V)
        valid = targets != IGNORE_ID  # masked rather than selected: selecting would size a tensor by
        # the data, a host synchronization on a GPU
        per_token = smoothed_cross_entropy(log_probs.flatten(0, 1), targets.clamp(min=0).flatten(),
                                           self.config.lsm_weight).view_as(targets)  # (B, L + 1)
        loss = torch.where(valid, per_token, 0.0).sum()
        correct = ((log_probs.argmax(dim=-1) == targets) & valid).sum()
        return loss, correct, valid.sum()


def build_model(config: ModelConfig, *, vocab_size: int | None = None,
                tokens_per_second: float | None = None) -> ASRModel:
    """The model of `config`, with `vocab_size` (the tokenizer's V) filled in when given.

    With `tokens_per_second` (mean target rate of the training data), a subsampling rate that
    leaves CTC too few frames (of `config.frame_shift_ms` features) is refused with a one-line
    ValueError (see check_ctc_feasible), and the rate is kept in the model's config
    (`model.config.tokens_per_second`, saved with it).
    """
    if vocab_size is not None:
        config = dataclasses.replace(config, vocab_size=vocab_size)
    if tokens_per_second is not None:
        check_ctc_feasible(config.subsampling, tokens_per_second, frame_shift_ms=config.frame_shift_ms)
        config = dataclasses.replace(config, tokens_per_second=tokens_per_second)
    return ASRModel(config)


def count_parameters(module: nn.Module) -> int:
    """Distinct parameters of `module` (a tied matrix counts once)."""
    return sum(p.numel() for p in module.parameters())

