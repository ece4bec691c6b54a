"""Transformer encoder: conv2d subsampling -> scaled input + sinusoidal positions -> pre-LayerNorm
blocks -> final LayerNorm. (feats, feat_lens) -> (h, h_lens); masks come from the lengths after
subsampling. `forward_with_attention` is `forward` that also returns the self-attention weights
(pictures), as the conformer's does (EncoderAttention). Also the pieces the decoder shares:
positions and the feed-forward block.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from asr.model.attention import MultiHeadAttention, chunk_mask, key_mask
from asr.model.subsampling import Conv2dSubsampling, conv_output_length


class LayerCache(NamedTuple):
    """What a streaming encoder layer keeps between chunks (`forward_chunk`)."""

    kv: torch.Tensor  # (B, L, 2, H, dh): the keys and values of the frames the next chunk attends to
    conv: torch.Tensor  # (B, k - 1, d): the causal convolution's last inputs ((B, 0, d) without one)


class EncoderState(NamedTuple):
    """A streaming encoder's state between calls of `forward_chunk` (`init_state` makes the first)."""

    feats: torch.Tensor  # (B, F, n_mels): feature frames the subsampling has not consumed yet
    pending: torch.Tensor  # (B, P, d): subsampled, embedded frames waiting for their chunk to fill
    offset: int  # subsampled frames made so far (their positions)
    layers: tuple[LayerCache, ...]


def keep_last(x: torch.Tensor, frames: int) -> torch.Tensor:
    """x (B, T, ...) cut to its last `frames` frames along dim 1 (all when frames < 0)."""
    return x if frames < 0 else x[:, max(x.size(1) - frames, 0):]


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
    The depthwise kernel keeps torch's default initialization (kaiming-uniform over its k taps).

    `causal` (ModelConfig.causal_conv, for streaming): the window is the frame and the k - 1 before
    it (zeros before the first), so no frame sees the future; `forward_chunk` then runs it chunk by
    chunk with the last k - 1 inputs as its cache. The weights are the same either way."""

    def __init__(self, *, d_model: int, kernel: int, causal: bool = False) -> None:
        super().__init__()
        if kernel % 2 == 0:
            raise ValueError(f"model.conv_kernel = {kernel} must be odd (a centred window)")
        self.kernel, self.causal = kernel, causal
        self.pointwise_in = nn.Linear(d_model, 2 * d_model)
        self.depthwise = nn.Conv1d(d_model, d_model, kernel, padding=0 if causal else kernel // 2, groups=d_model)
        self.norm = nn.LayerNorm(d_model)
        self.pointwise_out = nn.Linear(d_model, d_model)

    def forward(self, x: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """x (B, T, d), valid (B, T) bool -> (B, T, d)."""
        x = F.glu(self.pointwise_in(x), dim=-1).masked_fill(~valid[..., None], 0.0).transpose(1, 2)  # (B, d, T)
        if self.causal:
            x = F.pad(x, (self.kernel - 1, 0))
        return self.pointwise_out(F.silu(self.norm(self.depthwise(x).transpose(1, 2))))

    def forward_chunk(self, x: torch.Tensor, cache: torch.Tensor,
                      lengths: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """A causal module on the next C frames x (B, C, d) after the k - 1 inputs of the depthwise
        conv in `cache` (B, k - 1, d) (zeros at the start): (B, C, d) and the new cache. All C
        frames are valid, or the first lengths[b] (B,) of row b: its cache then ends with its last
        valid frame (its outputs beyond lengths[b] mean nothing; valid ones never see them)."""
        x = torch.cat([cache, F.glu(self.pointwise_in(x), dim=-1)], dim=1)  # (B, k - 1 + C, d)
        y = self.depthwise(x.transpose(1, 2)).transpose(1, 2)  # (B, C, d)
        if lengths is None:
            kept = x[:, x.size(1) - cache.size(1):]
        else:  # row b's inputs lengths[b] .. lengths[b] + k - 2
            index = lengths[:, None] + torch.arange(cache.size(1), device=x.device)  # (B, k - 1)
            kept = x.gather(1, index[..., None].expand(-1, -1, x.size(2)))
        return self.pointwise_out(F.silu(self.norm(y))), kept


class EncoderLayer(nn.Module):
    """Pre-LayerNorm block: x + drop(self_attn(LN(x))), [x + drop(conv(LN(x))) with conv_kernel > 0],
    then x + drop(ffn(LN(x)))."""

    def __init__(self, *, d_model: int, n_heads: int, ffn_dim: int, dropout: float, attention_dropout: float,
                 conv_kernel: int = 0, causal_conv: bool = False) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(d_model)
        self.self_attn = MultiHeadAttention(d_model=d_model, n_heads=n_heads, dropout=attention_dropout)
        if conv_kernel > 0:
            self.norm_conv = nn.LayerNorm(d_model)
            self.conv = ConvModule(d_model=d_model, kernel=conv_kernel, causal=causal_conv)
        self.norm2 = nn.LayerNorm(d_model)
        self.ffn = FeedForward(d_model=d_model, ffn_dim=ffn_dim, dropout=dropout)
        self.dropout = nn.Dropout(dropout)
        self.conv_kernel = conv_kernel

    def forward(self, x: torch.Tensor, mask: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """x (B, T, d), mask (B, 1, 1, T) True on valid frames (or (B, 1, T, T) with chunks),
        valid (B, T) -> (B, T, d)."""
        return self._after_attention(x + self.dropout(self.self_attn(self.norm1(x), mask=mask)), valid)

    def _after_attention(self, x: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """The blocks after self-attention: the convolution (when there is one), the feed-forward."""
        if self.conv_kernel > 0:
            x = x + self.dropout(self.conv(self.norm_conv(x), valid))
        return x + self.dropout(self.ffn(self.norm2(x)))

    def forward_with_attention(self, x: torch.Tensor, mask: torch.Tensor,
                               valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`forward` with the self-attention on the explicit path (MultiHeadAttention.forward_with_weights):
        (B, T, d), the same to rounding, and the weights (B, H, T, T)."""
        y, weights = self.self_attn.forward_with_weights(self.norm1(x), mask=mask)
        return self._after_attention(x + self.dropout(y), valid), weights

    def forward_chunk(self, x: torch.Tensor, cache: LayerCache, left: int, position: int,
                      mask: torch.Tensor | None = None,
                      lengths: torch.Tensor | None = None) -> tuple[torch.Tensor, LayerCache]:
        """The next chunk x (B, C, d) (eval mode; `position`: of its first frame, which the input's
        absolute positions already hold), attending to itself and the frames in `cache`: (B, C, d)
        and the cache for the next chunk (its last `left` frames' keys and values; all when
        left < 0). Streams batched together (StreamingEncoder.forward_chunks): `mask` (B, 1, 1,
        L + C) True on the valid keys (a cache padded on the left, a chunk on the right), `lengths`
        (B,) the valid frames of each row's chunk (ConvModule.forward_chunk)."""
        q, kv = self.self_attn.q_kv(self.norm1(x))  # (B, H, C, dh), (B, C, 2, H, dh)
        kv = torch.cat([cache.kv, kv], dim=1)  # (B, L + C, 2, H, dh)
        x = x + self.self_attn.attend(q, kv[:, :, 0].transpose(1, 2), kv[:, :, 1].transpose(1, 2), mask=mask)
        conv = cache.conv
        if self.conv_kernel > 0:
            y, conv = self.conv.forward_chunk(self.norm_conv(x), cache.conv, lengths)
            x = x + y
        return x + self.ffn(self.norm2(x)), LayerCache(keep_last(kv, left), conv)


class StreamingEncoder(nn.Module):
    """What the transformer and conformer encoders share: chunked attention and chunk-by-chunk
    encoding (dynamic chunk training, U2 style; streaming recognition).

    `forward(feats, feat_lens, chunk_size=C, left_chunks=L)`: every frame attends to the frames of
    its chunk of C (from frame 0) and of the L chunks before (all before: L < 0); C = 0 is full
    context. `forward_chunk` gives the same output (to rounding) from features that arrive in
    pieces of any size, for a model whose convolutions are causal (ModelConfig.causal_conv): a
    chunk is encoded once its C frames are there (or at the end, `final`). The latency of a chunk:
    C encoder frames (C x subsampling feature frames) plus the subsampling's right context
    (`right_context`: 6 feature frames at 4x). `forward_chunks` encodes several streams that started
    at different times together, a chunk of each per batched step, each with forward_chunk's output."""

    d_model: int
    subsampling: Conv2dSubsampling
    layers: nn.ModuleList
    norm: nn.LayerNorm

    def forward(self, feats: torch.Tensor, feat_lens: torch.Tensor, *, chunk_size: int = 0,
                left_chunks: int = -1) -> tuple[torch.Tensor, torch.Tensor]:
        h, h_lens, _ = self.forward_intermediate(feats, feat_lens, (), chunk_size=chunk_size, left_chunks=left_chunks)
        return h, h_lens

    def forward_intermediate(self, feats: torch.Tensor, feat_lens: torch.Tensor, layers: tuple[int, ...], *,
                             chunk_size: int = 0,
                             left_chunks: int = -1) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
        """`forward`, and the outputs of `layers` (1-based, ascending) through the final LayerNorm,
        each (B, T', d) (intermediate CTC, ModelConfig.interctc_layers)."""
        x, x_lens, mask, extra = self._inputs(feats, feat_lens)
        valid = mask[:, 0, 0, :]  # (B, T')
        if chunk_size > 0:
            mask = mask & chunk_mask(x.size(1), chunk_size, left_chunks, x.device)  # (B, 1, T', T')
        kept = []
        for i, layer in enumerate(self.layers, 1):
            x = layer(x, *extra, mask, valid)
            if i in layers:
                kept.append(self.norm(x))
        return self.norm(x), x_lens, kept

    def forward_with_attention(self, feats: torch.Tensor, feat_lens: torch.Tensor) -> EncoderAttention:
        """`forward` (the same output, to rounding) and the self-attention weights of every layer and
        head, from the explicit attention path: for attention pictures, never for training or search."""
        x, x_lens, mask, extra = self._inputs(feats, feat_lens)
        weights = []
        for layer in self.layers:
            x, layer_weights = layer.forward_with_attention(x, *extra, mask, mask[:, 0, 0, :])
            weights.append(layer_weights)  # (B, H, T', T')
        return EncoderAttention(self.norm(x), x_lens, torch.stack(weights))

    def _inputs(self, feats: torch.Tensor,
                feat_lens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, tuple[torch.Tensor, ...]]:
        """The first layer's input (B, T', d), its lengths (B,), the key mask (B, 1, 1, T') and
        what else every layer takes before the masks (the conformer's relative encodings)."""
        raise NotImplementedError

    def _embed(self, x: torch.Tensor, offset: int) -> torch.Tensor:
        """Subsampled frames (B, n, d) from position `offset` on as the first layer takes them (eval)."""
        raise NotImplementedError

    def init_state(self, batch: int = 1, *, device: torch.device | str | None = None,
                   dtype: torch.dtype = torch.float32) -> EncoderState:
        """The state before the first chunk of `batch` streams (that advance together)."""
        attention = self.layers[0].self_attn
        heads, d = attention.n_heads, self.d_model
        conv = self.layers[0].conv.kernel - 1 if hasattr(self.layers[0], "conv") else 0
        layers = tuple(LayerCache(torch.zeros(batch, 0, 2, heads, d // heads, device=device, dtype=dtype),
                                  torch.zeros(batch, conv, d, device=device, dtype=dtype)) for _ in self.layers)
        n_mels = self.subsampling.n_mels
        return EncoderState(torch.zeros(batch, 0, n_mels, device=device, dtype=dtype),
                            torch.zeros(batch, 0, d, device=device, dtype=dtype), 0, layers)

    def forward_chunk(self, feats: torch.Tensor, state: EncoderState, *, chunk_size: int, left_chunks: int = -1,
                      final: bool = False) -> tuple[torch.Tensor, EncoderState]:
        """The encoder output (B, n, d) of the chunks that features feats (B, F, n_mels) complete
        (with `final`, the last partial chunk too), and the next state: `forward` under the same
        chunk_size and left_chunks, on the frames so far. Eval mode, causal convolutions. The B
        rows advance together (the same frames so far); streams that do not: `forward_chunks`."""
        self._check_streaming(chunk_size)
        buffer = torch.cat([state.feats, feats], dim=1)
        pending, offset, layers = state.pending, state.offset, state.layers
        made = conv_output_length(buffer.size(1), self.subsampling.rate)
        if made > 0:
            pending = torch.cat([pending, self._embed(self.subsampling.frames(buffer), offset)], dim=1)
            buffer, offset = buffer[:, made * self.subsampling.rate:], offset + made
        left = left_chunks * chunk_size if left_chunks >= 0 else -1
        out = []
        while pending.size(1) >= chunk_size or (final and pending.size(1) > 0):
            x, pending = pending[:, :chunk_size], pending[:, chunk_size:]
            position = offset - pending.size(1) - x.size(1)  # of the chunk's first frame
            new = []
            for layer, cache in zip(self.layers, layers):
                x, cache = layer.forward_chunk(x, cache, left, position)
                new.append(cache)
            layers = tuple(new)
            out.append(self.norm(x))
        h = torch.cat(out, dim=1) if out else pending.new_zeros(pending.size(0), 0, self.d_model)
        return h, EncoderState(buffer, pending, offset, layers)

    def forward_chunks(self, feats: Sequence[torch.Tensor], states: Sequence[EncoderState], *, chunk_size: int,
                       left_chunks: int = -1,
                       final: Sequence[bool] | None = None) -> tuple[list[torch.Tensor], list[EncoderState]]:
        """`forward_chunk` of several streams at once: stream i has its own state states[i] (of
        one row, `init_state(1)`'s), new features feats[i] (1, F_i, n_mels) and `final[i]`
        (default: none final); its output (1, n_i, d) and next state are those forward_chunk
        gives it alone (to rounding), whatever its neighbours.

        The subsampling runs once over all the buffers (padded on the right: an output frame sees
        only its own window); the transformer's absolute positions are added per stream, from its
        own offset. Then, while any stream has a chunk ready, one batched step encodes one chunk
        of each such stream (`_chunk_step`): their attention caches padded on the left to the
        longest (at most left_chunks x chunk_size frames) under a key mask, the last partial chunks
        of final streams padded on the right. All streams share chunk_size and left_chunks."""
        self._check_streaming(chunk_size)
        if len(feats) != len(states) or any(state.feats.size(0) != 1 for state in states):
            raise ValueError("forward_chunks takes one state of one row (init_state(1)) per stream's features")
        final = list(final) if final is not None else [False] * len(states)
        buffers = [torch.cat([state.feats, f], dim=1) for state, f in zip(states, feats)]
        pending, offsets = self._subsample(buffers, states)
        rate = self.subsampling.rate
        made = [offset - state.offset for offset, state in zip(offsets, states)]
        buffers = [buffer[:, n * rate:] for buffer, n in zip(buffers, made)]
        caches = [state.layers for state in states]
        left = left_chunks * chunk_size if left_chunks >= 0 else -1
        out: list[list[torch.Tensor]] = [[] for _ in states]
        while rows := [i for i, p in enumerate(pending) if p.size(1) >= chunk_size or (final[i] and p.size(1) > 0)]:
            chunks = [pending[i][:, :chunk_size] for i in rows]
            h, new = self._chunk_step(chunks, [caches[i] for i in rows], left)
            for i, h_i, cache in zip(rows, h, new):
                pending[i], caches[i] = pending[i][:, chunk_size:], cache
                out[i].append(h_i)
        outputs = [torch.cat(o, dim=1) if o else p.new_zeros(1, 0, self.d_model) for o, p in zip(out, pending)]
        return outputs, [EncoderState(*parts) for parts in zip(buffers, pending, offsets, caches)]

    def frames_waiting(self, state: EncoderState, new_feats: int = 0) -> int:
        """The subsampled frames that wait for their chunk once `new_feats` more feature frames have
        joined `state`: the pending ones and those the subsampling will make (a chunk of C is
        encoded when C wait)."""
        return state.pending.size(1) + conv_output_length(state.feats.size(1) + new_feats, self.subsampling.rate)

    @property
    def can_stream(self) -> bool:
        """Whether chunk-by-chunk encoding applies: every convolution is causal (or there is none)."""
        return all(getattr(getattr(layer, "conv", None), "causal", True) for layer in self.layers)

    def _check_streaming(self, chunk_size: int) -> None:
        if self.training:
            raise ValueError("forward_chunk runs in eval mode (no dropout)")
        if chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1 for chunk-by-chunk encoding, got {chunk_size}")
        if not self.can_stream:
            raise ValueError("chunk-by-chunk encoding needs causal convolutions (a model built with "
                             "model.causal_conv: true)")

    def _subsample(self, buffers: list[torch.Tensor],
                   states: Sequence[EncoderState]) -> tuple[list[torch.Tensor], list[int]]:
        """Each stream's pending frames (1, P_i, d) once the subsampling has made what its buffer
        (1, F_i, n_mels) allows, and its new offset: one conv over the buffers padded on the right."""
        rate = self.subsampling.rate
        made = [conv_output_length(buffer.size(1), rate) for buffer in buffers]
        pending, offsets = [state.pending for state in states], [state.offset for state in states]
        rows = [i for i, n in enumerate(made) if n > 0]
        if not rows:
            return pending, offsets
        longest = max(buffers[i].size(1) for i in rows)
        frames = self.subsampling.frames(torch.cat([F.pad(buffers[i], (0, 0, 0, longest - buffers[i].size(1)))
                                                    for i in rows]))  # (R, T', d)
        for row, i in enumerate(rows):
            pending[i] = torch.cat([pending[i], self._embed(frames[row:row + 1, :made[i]], offsets[i])], dim=1)
            offsets[i] += made[i]
        return pending, offsets

    def _chunk_step(self, chunks: list[torch.Tensor], caches: list[tuple[LayerCache, ...]],
                    left: int) -> tuple[list[torch.Tensor], list[tuple[LayerCache, ...]]]:
        """One chunk of each of R streams, chunks[r] (1, c_r, d), through the layers as one batch:
        their outputs (1, c_r, d) and new caches (each row's own, its last `left` frames).

        Shapes: C = max c_r; L = the longest cache; row r's cache of L_r frames sits at the end of
        L (left padding), its chunk at the start of C (right padding); keys (R, L + C), valid on
        L - L_r .. L + c_r - 1. Left padding keeps each row's distances between queries and keys,
        so the conformer's relative positions hold."""
        sizes, held = [chunk.size(1) for chunk in chunks], [cache[0].kv.size(1) for cache in caches]  # c_r, L_r
        c, n = max(sizes), max(held)
        lengths = torch.tensor(sizes, device=chunks[0].device)  # (R,)
        cached = torch.tensor(held, device=lengths.device)  # (R,)
        x = torch.cat([F.pad(chunk, (0, 0, 0, c - chunk.size(1))) for chunk in chunks])  # (R, C, d)
        keys = torch.arange(n + c, device=x.device)
        mask = ((keys >= n - cached[:, None]) & (keys < n + lengths[:, None]))[:, None, None]  # (R, 1, 1, L + C)
        new: list[list[LayerCache]] = [[] for _ in chunks]
        for j, layer in enumerate(self.layers):
            kv = torch.cat([F.pad(cache[j].kv, (0, 0, 0, 0, 0, 0, n - cache[j].kv.size(1), 0)) for cache in caches])
            conv = torch.cat([cache[j].conv for cache in caches])
            # position 0: unused (each row's absolute positions are in x already, from its own offset)
            x, step = layer.forward_chunk(x, LayerCache(kv, conv), -1, 0, mask=mask, lengths=lengths)
            for r, row in enumerate(new):  # (L + C) keys and values -> the row's own, valid ones
                kept = step.kv[r:r + 1, n - held[r]:n + sizes[r]]
                row.append(LayerCache(keep_last(kept, left), step.conv[r:r + 1]))
        h = self.norm(x)
        return [h[r:r + 1, :sizes[r]] for r in range(len(chunks))], [tuple(row) for row in new]


class TransformerEncoder(StreamingEncoder):
    """(feats (B, T, n_mels), feat_lens (B,)) -> (h (B, T', d_model), h_lens (B,)).

    Frames of h at or beyond h_lens[b] are padding with unspecified values; valid frames do not
    depend on them (an utterance gives the same h alone and inside a padded batch). Chunked
    attention and chunk-by-chunk encoding: StreamingEncoder.
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
        causal_conv: bool = False,
    ) -> None:
        super().__init__()
        self.d_model = d_model
        self.subsampling = Conv2dSubsampling(n_mels=n_mels, d_model=d_model, channels=conv_channels, rate=subsampling)
        self.dropout = nn.Dropout(dropout)
        self.layers = nn.ModuleList(
            EncoderLayer(d_model=d_model, n_heads=n_heads, ffn_dim=ffn_dim, dropout=dropout,
                         attention_dropout=attention_dropout, conv_kernel=conv_kernel, causal_conv=causal_conv)
            for _ in range(n_layers)
        )
        self.norm = nn.LayerNorm(d_model)

    def _inputs(self, feats: torch.Tensor,
                feat_lens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, tuple[torch.Tensor, ...]]:
        x, x_lens = self.subsampling(feats, feat_lens)  # (B, T', d), (B,)
        positions = sinusoidal_positions(torch.arange(x.size(1), device=x.device), self.d_model)
        x = self.dropout(x * math.sqrt(self.d_model) + positions)
        return x, x_lens, key_mask(x_lens, x.size(1)), ()

    def _embed(self, x: torch.Tensor, offset: int) -> torch.Tensor:
        positions = sinusoidal_positions(torch.arange(offset, offset + x.size(1), device=x.device), self.d_model)
        return x * math.sqrt(self.d_model) + positions
