"""Transformer encoder: conv2d subsampling -> scaled input + sinusoidal positions -> pre-LayerNorm
blocks -> final LayerNorm. (feats, feat_lens) -> (h, h_lens); masks come from the lengths after
subsampling. `forward_with_attention` is `forward` that also returns the self-attention weights
(pictures), as the conformer's does (EncoderAttention). Also the pieces the decoder shares:
positions and the feed-forward block.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from asr.model.attention import MultiHeadAttention, key_mask
from asr.model.subsampling import Conv2dSubsampling


class EncoderAttention(NamedTuple):
    """What the encoders' `forward_with_attention` returns (TransformerEncoder, ConformerEncoder)."""

    memory: torch.Tensor  # (B, T', d): `forward`'s h, the same to rounding
    memory_lens: torch.Tensor  # (B,) long: `forward`'s h_lens
    self_attention: torch.Tensor  # (layers, B, H, T', T'): the weights of frame i over frames j; each
    # row sums to 1 over the valid frames memory_lens[b] (the first one for a length 0) and is exactly
    # 0 on the others (the rows of padding frames too, which mean nothing)


def sinusoidal_positions(positions: torch.Tensor, d_model: int) -> torch.Tensor:
    """Sinusoidal encodings (T, d_model) float32 of positions (T,): sin at even, cos at odd dims.

    PE[p, 2i] = sin(p / 10000^(2i/d)), PE[p, 2i+1] = cos(p / 10000^(2i/d)). Computed on the fly
    (no buffer, so no length limit); the same positions give bit-identical rows, which keeps the
    decoder's cached step equal to its teacher-forced forward.
    """
    freqs = torch.exp(torch.arange(0, d_model, 2, device=positions.device) * (-math.log(10000.0) / d_model))
    angles = positions.float()[:, None] * freqs  # (T, d/2)
    return torch.stack([angles.sin(), angles.cos()], dim=-1).flatten(1)  # (T, d)


class FeedForward(nn.Module):
    """Position-wise feed-forward: Linear(d, ffn) -> activation (ReLU; the conformer's SiLU = Swish) ->
    dropout -> Linear(ffn, d)."""

    def __init__(self, *, d_model: int, ffn_dim: int, dropout: float,
                 activation: type[nn.Module] = nn.ReLU) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(d_model, ffn_dim), activation(), nn.Dropout(dropout), nn.Linear(ffn_dim, d_model)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class ConvModule(nn.Module):
    """The convolution block of a Conformer layer, with LayerNorm where Conformer has BatchNorm:
    pointwise (d -> 2d) -> GLU -> depthwise conv over time (kernel k, same length) -> LayerNorm ->
    SiLU -> pointwise (d -> d). Padding frames are zeroed before the depthwise conv, so a valid
    frame sees the same zeros beyond the utterance's end alone and inside a padded batch.

    Why LayerNorm: BatchNorm's training statistics are taken over every frame of the batch, padding
    included, so in training mode an utterance's output depends on its neighbours and on how much
    padding the batch has (and eval mode uses running averages of those batch statistics).
    LayerNorm normalizes each frame by itself: the same output alone and inside any batch, in
    training and in evaluation. Same parameter count as BatchNorm (a scale and a shift per channel).
    The depthwise kernel keeps torch's default initialization (kaiming-uniform over its k taps)."""

    def __init__(self, *, d_model: int, kernel: int) -> None:
        super().__init__()
        if kernel % 2 == 0:
            raise ValueError(f"model.conv_kernel = {kernel} must be odd (a centred window)")
        self.pointwise_in = nn.Linear(d_model, 2 * d_model)
        self.depthwise = nn.Conv1d(d_model, d_model, kernel, padding=kernel // 2, groups=d_model)
        self.norm = nn.LayerNorm(d_model)
        self.pointwise_out = nn.Linear(d_model, d_model)

    def forward(self, x: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """x (B, T, d), valid (B, T) bool -> (B, T, d)."""
        x = F.glu(self.pointwise_in(x), dim=-1).masked_fill(~valid[..., None], 0.0)
        x = self.depthwise(x.transpose(1, 2)).transpose(1, 2)
        return self.pointwise_out(F.silu(self.norm(x)))


class EncoderLayer(nn.Module):
    """Pre-LayerNorm block: x + drop(self_attn(LN(x))), [x + drop(conv(LN(x))) with conv_kernel > 0],
    then x + drop(ffn(LN(x)))."""

    def __init__(self, *, d_model: int, n_heads: int, ffn_dim: int, dropout: float, attention_dropout: float,
                 conv_kernel: int = 0) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(d_model)
        self.self_attn = MultiHeadAttention(d_model=d_model, n_heads=n_heads, dropout=attention_dropout)
        if conv_kernel > 0:
            self.norm_conv = nn.LayerNorm(d_model)
            self.conv = ConvModule(d_model=d_model, kernel=conv_kernel)
        self.norm2 = nn.LayerNorm(d_model)
        self.ffn = FeedForward(d_model=d_model, ffn_dim=ffn_dim, dropout=dropout)
        self.dropout = nn.Dropout(dropout)
        self.conv_kernel = conv_kernel

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """x (B, T, d), mask (B, 1, 1, T) True on valid frames -> (B, T, d)."""
        return self._after_attention(x + self.dropout(self.self_attn(self.norm1(x), mask=mask)), mask)

    def _after_attention(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """The blocks after self-attention: the convolution (when there is one), the feed-forward."""
        if self.conv_kernel > 0:
            x = x + self.dropout(self.conv(self.norm_conv(x), mask[:, 0, 0, :]))
        return x + self.dropout(self.ffn(self.norm2(x)))

    def forward_with_attention(self, x: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`forward` with the self-attention on the explicit path (MultiHeadAttention.forward_with_weights):
        (B, T, d), the same to rounding, and the weights (B, H, T, T)."""
        y, weights = self.self_attn.forward_with_weights(self.norm1(x), mask=mask)
        return self._after_attention(x + self.dropout(y), mask), weights


class TransformerEncoder(nn.Module):
    """(feats (B, T, n_mels), feat_lens (B,)) -> (h (B, T', d_model), h_lens (B,)).

    Frames of h at or beyond h_lens[b] are padding with unspecified values; valid frames do not
    depend on them (an utterance gives the same h alone and inside a padded batch).
    """

    def __init__(
        self,
        *,
        n_mels: int,
        d_model: int,
        n_heads: int,
        ffn_dim: int,
        n_layers: int,
        conv_channels: int,
        subsampling: int,
        dropout: float,
        attention_dropout: float,
        conv_kernel: int = 0,
    ) -> None:
        super().__init__()
        self.d_model = d_model
        self.subsampling = Conv2dSubsampling(n_mels=n_mels, d_model=d_model, channels=conv_channels, rate=subsampling)
        self.dropout = nn.Dropout(dropout)
        self.layers = nn.ModuleList(
            EncoderLayer(d_model=d_model, n_heads=n_heads, ffn_dim=ffn_dim, dropout=dropout,
                         attention_dropout=attention_dropout, conv_kernel=conv_kernel)
            for _ in range(n_layers)
        )
        self.norm = nn.LayerNorm(d_model)

    def forward(self, feats: torch.Tensor, feat_lens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h, h_lens, _ = self.forward_intermediate(feats, feat_lens, ())
        return h, h_lens

    def forward_intermediate(self, feats: torch.Tensor, feat_lens: torch.Tensor,
                             layers: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
        """`forward`, and the outputs of `layers` (1-based, ascending) through the final LayerNorm,
        each (B, T', d) (intermediate CTC, ModelConfig.interctc_layers)."""
        x, x_lens, mask = self._inputs(feats, feat_lens)
        kept = []
        for i, layer in enumerate(self.layers, 1):
            x = layer(x, mask)
            if i in layers:
                kept.append(self.norm(x))
        return self.norm(x), x_lens, kept

    def _inputs(self, feats: torch.Tensor, feat_lens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The first layer's input (B, T', d), its lengths (B,) and key mask (B, 1, 1, T')."""
        x, x_lens = self.subsampling(feats, feat_lens)  # (B, T', d), (B,)
        positions = sinusoidal_positions(torch.arange(x.size(1), device=x.device), self.d_model)
        x = self.dropout(x * math.sqrt(self.d_model) + positions)
        return x, x_lens, key_mask(x_lens, x.size(1))

    def forward_with_attention(self, feats: torch.Tensor, feat_lens: torch.Tensor) -> EncoderAttention:
        """`forward` (the same output, to rounding) and the self-attention weights of every layer and
        head, from the explicit attention path: for attention pictures, never for training or search."""
        x, x_lens, mask = self._inputs(feats, feat_lens)
        weights = []
        for layer in self.layers:
            x, layer_weights = layer.forward_with_attention(x, mask)  # (B, T', d), (B, H, T', T')
            weights.append(layer_weights)
        return EncoderAttention(self.norm(x), x_lens, torch.stack(weights))
