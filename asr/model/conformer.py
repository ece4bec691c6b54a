"""Conformer encoder (Gulati et al., 2020) with Transformer-XL relative positions, as ESPnet's
ConformerEncoder with `rel_pos_type: latest`, `pos_enc_layer_type: rel_pos`,
`selfattention_layer_type: rel_selfattn`, `macaron_style: true`, `activation_type: swish`,
`use_cnn_module: true`. (feats, feat_lens) -> (h, h_lens), like TransformerEncoder.

    conv2d subsampling -> x * sqrt(d) -> dropout; encodings of the 2T - 1 relative positions
    T - 1 ... -(T - 1) (sinusoidal, no parameters) -> dropout;
    each block:  x = x + 0.5 * drop(FFN_macaron(LN(x)))      FFN: Linear -> Swish -> drop -> Linear
                 x = x + drop(RelMHSA(LN(x), positions))
                 x = x + drop(Conv(LN(x)))                    padding zeroed, LayerNorm (see ConvModule)
                 x = x + 0.5 * drop(FFN(LN(x)))
                 x = LN(x)
    -> final LayerNorm.

Relative-position attention, per head (dh = d / H, u and v learned (H, dh) biases, P(r) the
encoding of relative position r = i - j through a bias-free Linear):

    score[i, j] = ((q_i + u) . k_j + (q_i + v) . P(i - j)) / sqrt(dh)

It runs on `scaled_dot_product_attention`: the query is q + u, and the position term becomes the
additive float `attn_mask`. SDPA adds the mask after its own 1/sqrt(dh) scaling of q k^T, so the
bias must be ((q + v) . P) / sqrt(dh): (q + v) is scaled before the product. (q + v) . P is made
for the 2T - 1 positions, (B, H, T, 2T - 1), and shifted into (B, H, T, T) by a strided view
(`rel_shift`); key padding is folded into the same tensor as the dtype's lowest finite value
(SDPA takes one mask). A row of a length-0 utterance keeps its first key (`key_mask`), so no row is
fully masked and no softmax sees only -inf.

Which SDPA kernel takes the float bias (its gradient is needed too: it depends on q, v and P):
- CUDA: the memory-efficient kernel, named by `attention.sdpa` (flash takes no mask; cuDNN's
  attention re-plans for every shape, see asr.model.attention), which takes an additive bias and
  returns its gradient (torch pads the bias's last dimension for alignment); the bias is made in
  the query's dtype (bf16 under autocast) and is contiguous (masked_fill writes a new tensor).
- CPU (measured, torch 2.14): without gradients and dropout (decoding) the flash-style CPU kernel
  takes the bias; in training (a bias that needs its gradient, or dropout) the math fallback runs.

Memory of the bias: H * T^2 elements per utterance and layer. LibriSpeech's longest utterances are
about 35 s: 3,500 frames of 10 ms, T = 874 after 4x subsampling, so per utterance and layer
    H = 4: 3,055,504 elements = 12.2 MB in fp32, 6.1 MB in bf16;
    H = 8: 6,111,008 elements = 24.4 MB in fp32, 12.2 MB in bf16;
the (B, H, T, 2T - 1) product before the shift is twice that while it lives. In training each layer
keeps its bias for the backward pass (x 12 layers: 147 MB fp32 / 73 MB bf16 per 35 s utterance at
H = 4), about what the math path keeps in probabilities; a 600 s micro-batch of such utterances
holds about 17 of them.

The weights for attention pictures (`forward_with_attention`) come from the explicit matmul-softmax
path (MultiHeadAttention.attend_with_weights) with the same query q + u and the same position bias,
padding as -inf there (exact zeros); the fused path above stays that of training and decoding.

Initialization follows ASRModel.reset_parameters (xavier-uniform matrices, zero biases, the
position projection too); u and v are xavier-uniform over their (H, dh) shape, as ESPnet does.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from asr.model.attention import MultiHeadAttention, key_mask, sdpa
from asr.model.encoder import ConvModule, FeedForward, LayerCache, StreamingEncoder, keep_last, sinusoidal_positions
from asr.model.subsampling import Conv2dSubsampling

__all__ = ["ConformerEncoder", "ConformerLayer", "RelPositionAttention", "rel_shift", "relative_encodings"]


def relative_encodings(length: int, d_model: int, device: torch.device | None = None) -> torch.Tensor:
    """Sinusoidal encodings (2T - 1, d_model) float32 of relative positions T - 1, T - 2, ..., -(T - 1)
    for T = `length`: row T - 1 - r holds position r."""
    return sinusoidal_positions(torch.arange(length - 1, -length, -1, device=device), d_model)


def rel_shift(scores: torch.Tensor) -> torch.Tensor:
    """(..., Tq, Tk + Tq - 1) scores against relative positions Tk - 1 ... -(Tq - 1) -> (..., Tq, Tk)
    scores against keys, the queries being the last Tq of the Tk keys (Tq = Tk: self-attention over
    a whole utterance; Tq < Tk: a chunk over its left context and itself): out[..., i, j] =
    scores[..., i, Tq - 1 - i + j], the entry of position (Tk - Tq) + i - j.

    A view, no copy: in a contiguous row-major tensor of width W = Tk + Tq - 1 that entry sits at
    (Tq - 1) + i (W - 1) + j, a stride of W - 1 between query rows and 1 between keys; made by
    reshapes and slices (no storage offset, which torch.compile would specialise on)."""
    scores = scores.contiguous()
    *lead, t, width = scores.shape
    if width < t:
        raise ValueError(f"rel_shift needs (..., Tq, Tk + Tq - 1) scores with Tk >= 1, got {tuple(scores.shape)}")
    if t == 1:  # one query: its row is already against the keys
        return scores
    flat = scores.reshape(*lead, t * width)[..., t - 1:t - 1 + t * (width - 1)]  # from (0, t - 1) on
    return flat.reshape(*lead, t, width - 1)[..., :width - t + 1]  # rows of width - 1: each one shifted


class RelPositionAttention(MultiHeadAttention):
    """Self-attention with relative positions (Transformer-XL, ESPnet's `rel_selfattn` with the
    `latest` encoding): the q, k, v and output projections of MultiHeadAttention, plus a bias-free
    projection of the position encodings and the per-head biases u (content) and v (position)."""

    def __init__(self, *, d_model: int, n_heads: int, dropout: float = 0.0) -> None:
        super().__init__(d_model=d_model, n_heads=n_heads, dropout=dropout)
        self.pos_proj = nn.Linear(d_model, d_model, bias=False)
        self.pos_bias_u = nn.Parameter(torch.empty(n_heads, d_model // n_heads))
        self.pos_bias_v = nn.Parameter(torch.empty(n_heads, d_model // n_heads))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """MultiHeadAttention's initialization, and xavier-uniform position projection, u and v."""
        super().reset_parameters()
        nn.init.xavier_uniform_(self.pos_proj.weight)
        nn.init.xavier_uniform_(self.pos_bias_u)
        nn.init.xavier_uniform_(self.pos_bias_v)

    def position_bias(self, q: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """((q + v) . P(i - j)) / sqrt(dh) as (B, H, T, T), for queries q (B, H, T, dh) and the
        encodings (2T - 1, d) of `relative_encodings` (or (B, H, Tq, Tk) for a chunk's queries over
        Tk keys, the encodings of positions Tk - 1 ... -(Tq - 1): `forward_chunk`)."""
        p = self._heads(self.pos_proj(positions)[None])  # (1, H, 2T - 1, dh)
        scale = q.size(-1) ** -0.5
        qv = (q + self.pos_bias_v.to(q.dtype)[:, None]) * scale  # (B, H, T, dh)
        return rel_shift(qv @ p.transpose(-2, -1).to(qv.dtype))  # (B, H, T, 2T - 1) -> (B, H, T, T)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        """x (B, T, d), positions (2T - 1, d), mask (B, 1, 1, T) True on valid keys -> (B, T, d)."""
        b, t, _ = x.shape
        q, k, v = self.qkv(x)  # (B, H, T, dh) each
        bias = self.position_bias(q, positions).masked_fill(~mask, torch.finfo(q.dtype).min)
        p = self.dropout if self.training else 0.0
        y = sdpa(q + self.pos_bias_u.to(q.dtype)[:, None], k, v, bias, dropout_p=p)  # (B, H, T, dh)
        return self.out_proj(y.transpose(1, 2).reshape(b, t, self.d_model))

    def forward_chunk(self, x: torch.Tensor, cache: torch.Tensor,
                      mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """A chunk x (B, C, d) attending to itself and to the L frames whose keys and values are in
        `cache` (B, L, 2, H, dh), relative positions as `forward`'s: (B, C, d), and the keys and
        values of the L + C frames. `mask` (B, 1, 1, L + C): True on the valid keys, for rows
        whose cache is padded on the left and chunk on the right (a relative position is a
        difference of indices, which left padding keeps)."""
        b, c, _ = x.shape
        q, kv = self.q_kv(x)  # (B, H, C, dh), (B, C, 2, H, dh)
        kv = torch.cat([cache, kv], dim=1)
        keys = kv.size(1)
        positions = sinusoidal_positions(torch.arange(keys - 1, -c, -1, device=x.device), self.d_model).to(x.dtype)
        bias = self.position_bias(q, positions)  # (B, H, C, L + C)
        if mask is not None:
            bias = bias.masked_fill(~mask, torch.finfo(q.dtype).min)
        k, v = kv[:, :, 0].transpose(1, 2), kv[:, :, 1].transpose(1, 2)
        y = sdpa(q + self.pos_bias_u.to(q.dtype)[:, None], k, v, bias)  # (B, H, C, dh)
        return self.out_proj(y.transpose(1, 2).reshape(b, c, self.d_model)), kv

    def forward_with_weights(self, x: torch.Tensor, positions: torch.Tensor,  # type: ignore[override]
                             mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`forward` on the explicit path (MultiHeadAttention.attend_with_weights, the position term
        as its additive bias): (B, T, d), the same to rounding, and the weights (B, H, T, T), exactly
        0 on padded keys."""
        q, k, v = self.qkv(x)  # (B, H, T, dh) each
        bias = self.position_bias(q, positions).masked_fill(~mask, float("-inf"))  # (B, H, T, T)
        return self.attend_with_weights(q + self.pos_bias_u.to(q.dtype)[:, None], k, v, mask=bias)


class ConformerLayer(nn.Module):
    """One macaron block: half-step FFN, relative-position self-attention, convolution, half-step
    FFN, each pre-LayerNorm with a residual, then a LayerNorm."""

    def __init__(self, *, d_model: int, n_heads: int, ffn_dim: int, dropout: float, attention_dropout: float,
                 conv_kernel: int, causal_conv: bool = False) -> None:
        super().__init__()
        self.norm_ffn_macaron = nn.LayerNorm(d_model)
        self.ffn_macaron = FeedForward(d_model=d_model, ffn_dim=ffn_dim, dropout=dropout, activation=nn.SiLU)
        self.norm_attn = nn.LayerNorm(d_model)
        self.self_attn = RelPositionAttention(d_model=d_model, n_heads=n_heads, dropout=attention_dropout)
        self.norm_conv = nn.LayerNorm(d_model)
        self.conv = ConvModule(d_model=d_model, kernel=conv_kernel, causal=causal_conv)
        self.norm_ffn = nn.LayerNorm(d_model)
        self.ffn = FeedForward(d_model=d_model, ffn_dim=ffn_dim, dropout=dropout, activation=nn.SiLU)
        self.norm_out = nn.LayerNorm(d_model)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor,
                valid: torch.Tensor) -> torch.Tensor:
        """x (B, T, d), positions (2T - 1, d), mask (B, 1, 1, T) True on valid frames (or (B, 1, T, T)
        with chunks), valid (B, T) -> (B, T, d)."""
        x = x + 0.5 * self.dropout(self.ffn_macaron(self.norm_ffn_macaron(x)))
        x = x + self.dropout(self.self_attn(self.norm_attn(x), positions, mask))
        return self._after_attention(x, valid)

    def _after_attention(self, x: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """The blocks after self-attention: the convolution, the second half-step FFN, the closing norm."""
        x = x + self.dropout(self.conv(self.norm_conv(x), valid))
        x = x + 0.5 * self.dropout(self.ffn(self.norm_ffn(x)))
        return self.norm_out(x)

    def forward_with_attention(self, x: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor,
                               valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`forward` with the self-attention on the explicit path (RelPositionAttention.forward_with_weights):
        (B, T, d), the same to rounding, and the weights (B, H, T, T)."""
        x = x + 0.5 * self.dropout(self.ffn_macaron(self.norm_ffn_macaron(x)))
        y, weights = self.self_attn.forward_with_weights(self.norm_attn(x), positions, mask)
        return self._after_attention(x + self.dropout(y), valid), weights

    def forward_chunk(self, x: torch.Tensor, cache: LayerCache, left: int, position: int,
                      mask: torch.Tensor | None = None,
                      lengths: torch.Tensor | None = None) -> tuple[torch.Tensor, LayerCache]:
        """The next chunk x (B, C, d) (eval mode), attending to itself and the frames in `cache`
        (relative positions need no `position`): (B, C, d) and the cache for the next chunk (its
        last `left` frames' keys and values, all when left < 0; the convolution's last inputs).
        `mask` and `lengths`: streams batched together, as EncoderLayer.forward_chunk's."""
        x = x + 0.5 * self.ffn_macaron(self.norm_ffn_macaron(x))
        y, kv = self.self_attn.forward_chunk(self.norm_attn(x), cache.kv, mask)
        x = x + y
        y, conv = self.conv.forward_chunk(self.norm_conv(x), cache.conv, lengths)
        x = x + y
        x = x + 0.5 * self.ffn(self.norm_ffn(x))
        return self.norm_out(x), LayerCache(keep_last(kv, left), conv)


class ConformerEncoder(StreamingEncoder):
    """(feats (B, T, n_mels), feat_lens (B,)) -> (h (B, T', d_model), h_lens (B,)).

    The constructor takes TransformerEncoder's arguments; `conv_kernel` (odd, > 0; ESPnet's
    LibriSpeech recipes use 31) is the depthwise kernel of every block's convolution. Frames of h
    at or beyond h_lens[b] are padding with unspecified values; valid frames do not depend on them
    (an utterance gives the same h alone and inside a padded batch, in training mode too). Chunked
    attention and chunk-by-chunk encoding: StreamingEncoder (with `causal_conv`).
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
        conv_kernel: int,
        causal_conv: bool = False,
    ) -> None:
        super().__init__()
        if conv_kernel <= 0 or conv_kernel % 2 == 0:
            raise ValueError(f"model.conv_kernel = {conv_kernel} must be positive and odd for a conformer encoder")
        self.d_model = d_model
        self.subsampling = Conv2dSubsampling(n_mels=n_mels, d_model=d_model, channels=conv_channels, rate=subsampling)
        self.dropout = nn.Dropout(dropout)  # ESPnet's positional dropout (= dropout in its recipes)
        self.layers = nn.ModuleList(
            ConformerLayer(d_model=d_model, n_heads=n_heads, ffn_dim=ffn_dim, dropout=dropout,
                           attention_dropout=attention_dropout, conv_kernel=conv_kernel, causal_conv=causal_conv)
            for _ in range(n_layers)
        )
        self.norm = nn.LayerNorm(d_model)

    def _inputs(self, feats: torch.Tensor,
                feat_lens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, tuple[torch.Tensor, ...]]:
        """The first layer's input (B, T', d), its lengths (B,), the key mask (B, 1, 1, T') and
        the relative encodings (2T' - 1, d)."""
        x, x_lens = self.subsampling(feats, feat_lens)  # (B, T', d), (B,)
        t = x.size(1)
        positions = self.dropout(relative_encodings(t, self.d_model, x.device).to(x.dtype))  # (2T' - 1, d)
        x = self.dropout(x * math.sqrt(self.d_model))
        return x, x_lens, key_mask(x_lens, t), (positions,)

    def _embed(self, x: torch.Tensor, offset: int) -> torch.Tensor:
        return x * math.sqrt(self.d_model)
