"""Transformer decoder: a teacher-forced `forward` for training and a cached `step` for search.

Shape legend: B utterances, N hypotheses per utterance (beam; 1 for greedy), R = B * N rows,
L target length, S memory (encoder) frames, V vocabulary, H heads, dh head size, C cache capacity.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import nn

from asr.model.attention import MultiHeadAttention, key_mask
from asr.model.encoder import FeedForward, sinusoidal_positions


class ReorderPlan(NamedTuple):
    """What `DecoderCache.reorder` may leave alone, when the caller knows it without a host
    synchronization (a field left None is found by `reorder`, with one). In the cache's terms:
    rows, positions of rows, and groups (the N consecutive rows of one utterance)."""

    rows: torch.Tensor | None = None  # (M,) long, the rows i with index[i] != i, ascending: only those
    # are written
    start: torch.Tensor | None = None  # (M,) long, for each of those rows, the first position whose
    # inputs differ from what the row holds (the positions before it are left alone); None: whole rows
    copies: int = 0  # sum over those rows of (length - start): the (row, position) pairs to copy
    groups: torch.Tensor | None = None  # (U,) long, when rows are dropped: the groups u of the kept
    # rows whose utterance changes (index[u * N] // N != u), ascending


class DecoderAttention(NamedTuple):
    """What `TransformerDecoder.forward_with_attention` returns."""

    log_probs: torch.Tensor  # (B, L, V) float32, as `forward`'s
    cross_attention: torch.Tensor  # (layers, B, H, L, S): the weights of output position l over the
    # memory frames; each row sums to 1 over the valid frames memory_lens[b] and is 0 on the others


@dataclass(eq=False)
class DecoderCache:
    """What the decoder's `step` needs from earlier steps; updated in place by `step` and `reorder`.

    Self-attention keys and values live in a buffer preallocated to a capacity and filled in place
    (doubled when full): appending with torch.cat instead copies (and allocates) all t steps at
    every step. `reorder` moves data only where a row changes hands, and, given a ReorderPlan, only
    the positions where the row's new inputs differ from those it held: in beam search most
    hypotheses continue in their own row and the others differ from the hypothesis they replace in
    their last few tokens, so a step copies a few positions of a few rows instead of the whole
    filled buffer (a copy that grows with the position and, at large batch x beam, dominates the
    step). Dropped utterances leave holes that `reorder` fills with rows from the end (the
    caller's order), so dropping one utterance copies at most one utterance's rows.

    Cross-attention keys and values are projected from the encoder output once, per utterance
    (B rows, not R): the N hypotheses of an utterance share them (see `MultiHeadAttention.attend`).
    """

    self_kv: torch.Tensor  # (layers, 2, R, C, H, dh): keys [:, 0], values [:, 1]; steps [0, length) filled
    memory_kv: torch.Tensor  # (layers, 2, B, H, S, dh)
    memory_mask: torch.Tensor  # (B, 1, 1, S) additive: 0 on valid frames, -inf on padding (made once,
    # not converted from a boolean mask at every attention call)
    positions: torch.Tensor  # (C', d) float32 sinusoidal encodings of positions 0 .. C' - 1 (grown as needed)
    length: int = 0  # steps taken so far = position of the next token

    @property
    def rows(self) -> int:
        return self.self_kv.size(2)

    @property
    def capacity(self) -> int:
        """Steps the buffer holds before it grows."""
        return self.self_kv.size(3)

    @property
    def group(self) -> int:
        """Hypotheses per utterance, N = R // B, fixed when the cache is made."""
        return self.rows // self.memory_kv.size(2)

    def reorder(self, index: torch.Tensor, plan: ReorderPlan | None = None) -> DecoderCache:
        """Keep rows `index` (R',) long of this cache, in that order: row i continues row index[i].

        R' == R: each row must continue a row of its own utterance (beam search reordering).
        R' < R (finished utterances dropped): rows come in whole groups, the N consecutive rows of
        one utterance, and the memory keeps those utterances in that order.
        `plan`: what may be left alone (see ReorderPlan); None: every changed row is copied whole.
        Updates in place and returns self.
        """
        if plan is None:  # (a NamedTuple is always truthy: no `plan or ...`)
            plan = ReorderPlan()
        moved = plan.rows if plan.rows is not None else _changed(index)
        if index.numel() < self.rows:
            self._keep_groups(index.view(-1, self.group)[:, 0] // self.group, plan.groups)
        if plan.start is None:
            filled = self.self_kv[:, :, :, :self.length]  # (layers, 2, R, t, H, dh), rows copied whole
            filled.index_copy_(2, moved, filled.index_select(2, index[moved]))  # sources read first
        elif plan.copies:
            self._copy_positions(moved, index[moved], plan.start, plan.copies)
        self.self_kv = self.self_kv[:, :, :index.numel()]
        return self

    def _copy_positions(self, rows: torch.Tensor, sources: torch.Tensor, start: torch.Tensor, copies: int) -> None:
        """Copy positions start[i] .. length - 1 of row sources[i] to row rows[i] (M,) each; `copies`
        (row, position) pairs in all, no host synchronization."""
        layers, _, _, capacity, heads, dh = self.self_kv.shape
        counts = (self.length - start).clamp(min=0)  # (M,)
        first = counts.cumsum(0) - counts  # (M,) where each row's pairs begin
        pairs = torch.repeat_interleave(torch.stack([rows, sources, first - start]), counts, dim=1,
                                        output_size=copies)  # (3, copies): row, source, first - start
        flat = pairs[:2] * capacity + torch.arange(copies, device=rows.device) - pairs[2]  # (2, copies)
        kv = self.self_kv.view(layers, 2, -1, heads * dh)  # (layers, 2, R * C, d): one (row, position) each
        kv.index_copy_(2, flat[0], kv.index_select(2, flat[1]))

    def _keep_groups(self, utterances: torch.Tensor, moved: torch.Tensor | None) -> None:
        """Memory of utterances (B',) in that order: the moved ones (U,) are copied into place."""
        if moved is None:
            moved = _changed(utterances)
        if moved.numel():
            source = utterances[moved]
            self.memory_kv.index_copy_(2, moved, self.memory_kv.index_select(2, source))
            self.memory_mask.index_copy_(0, moved, self.memory_mask.index_select(0, source))
        self.memory_kv = self.memory_kv[:, :, :utterances.numel()]
        self.memory_mask = self.memory_mask[:utterances.numel()]

    def append(self, layer: int, kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store step `length`'s keys and values kv (R, 1, 2, H, dh) of `layer`; return all keys
        and values so far, (R, H, length + 1, dh) each (views of the buffer). The caller advances
        `length`."""
        t = self.length
        if t == self.capacity:  # full: double it
            self.self_kv = torch.cat([self.self_kv, torch.empty_like(self.self_kv)], dim=3)
        layer_kv = self.self_kv[layer]  # (2, R, C, H, dh)
        layer_kv[:, :, t] = kv[:, 0].transpose(0, 1)
        keys, values = layer_kv[:, :, :t + 1].transpose(2, 3)  # (R, H, t + 1, dh) each
        return keys, values


def _changed(index: torch.Tensor) -> torch.Tensor:
    """The positions i with index[i] != i (one host synchronization)."""
    return (index != torch.arange(index.numel(), device=index.device)).nonzero()[:, 0]


class DecoderLayer(nn.Module):
    """Pre-LayerNorm block: causal self-attention, cross-attention to the memory, feed-forward."""

    def __init__(self, *, d_model: int, n_heads: int, ffn_dim: int, dropout: float, attention_dropout: float) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(d_model)
        self.self_attn = MultiHeadAttention(d_model=d_model, n_heads=n_heads, dropout=attention_dropout)
        self.norm2 = nn.LayerNorm(d_model)
        self.cross_attn = MultiHeadAttention(d_model=d_model, n_heads=n_heads, dropout=attention_dropout)
        self.norm3 = nn.LayerNorm(d_model)
        self.ffn = FeedForward(d_model=d_model, ffn_dim=ffn_dim, dropout=dropout)
        self.dropout = nn.Dropout(dropout)

    def _cross_and_ffn(self, x: torch.Tensor, memory_k: torch.Tensor, memory_v: torch.Tensor,
                       memory_mask: torch.Tensor) -> torch.Tensor:
        """x (R, T, d) after self-attention; memory_k/v (B, H, S, dh), R a multiple of B."""
        q = self.cross_attn.query(self.norm2(x))
        x = x + self.dropout(self.cross_attn.attend(q, memory_k, memory_v, mask=memory_mask))
        return x + self.dropout(self.ffn(self.norm3(x)))

    def forward(self, x: torch.Tensor, memory_k: torch.Tensor, memory_v: torch.Tensor,
                memory_mask: torch.Tensor) -> torch.Tensor:
        """Teacher-forced: x (B, L, d) -> (B, L, d); position t sees positions <= t only."""
        x = x + self.dropout(self.self_attn(self.norm1(x), is_causal=True))
        return self._cross_and_ffn(x, memory_k, memory_v, memory_mask)

    def forward_with_attention(self, x: torch.Tensor, memory_k: torch.Tensor, memory_v: torch.Tensor,
                               memory_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`forward` with the cross-attention on the explicit path: (B, L, d) and its weights
        (B, H, L, S)."""
        x = x + self.dropout(self.self_attn(self.norm1(x), is_causal=True))
        q = self.cross_attn.query(self.norm2(x))
        y, weights = self.cross_attn.attend_with_weights(q, memory_k, memory_v, mask=memory_mask)
        x = x + self.dropout(y)
        return x + self.dropout(self.ffn(self.norm3(x))), weights

    def step(self, x: torch.Tensor, index: int, cache: DecoderCache) -> torch.Tensor:
        """One position: x (R, 1, d) -> (R, 1, d), reading and filling layer `index` of the cache."""
        q, kv = self.self_attn.q_kv(self.norm1(x))  # (R, H, 1, dh), (R, 1, 2, H, dh)
        keys, values = cache.append(index, kv)  # (R, H, t + 1, dh) each
        x = x + self.self_attn.attend(q, keys, values)
        memory_k, memory_v = cache.memory_kv[index]
        return self._cross_and_ffn(x, memory_k, memory_v, cache.memory_mask)


class TransformerDecoder(nn.Module):
    """Token embedding x sqrt(d) + sinusoidal positions -> pre-LayerNorm blocks -> LayerNorm -> Linear.

    `forward` is teacher-forced over whole sequences; `step` decodes one position for R rows with
    a DecoderCache; both give the same log-probabilities (float32) for the same prefix.
    `forward_with_attention` is `forward` that also returns the cross-attention weights (pictures).
    """

    def __init__(
        self,
        *,
        vocab_size: int,
        d_model: int,
        n_heads: int,
        ffn_dim: int,
        n_layers: int,
        dropout: float,
        attention_dropout: float,
        tie_embeddings: bool = False,
    ) -> None:
        super().__init__()
        self.d_model = d_model
        self.embed = nn.Embedding(vocab_size, d_model)
        self.dropout = nn.Dropout(dropout)
        self.layers = nn.ModuleList(
            DecoderLayer(d_model=d_model, n_heads=n_heads, ffn_dim=ffn_dim, dropout=dropout,
                         attention_dropout=attention_dropout)
            for _ in range(n_layers)
        )
        self.norm = nn.LayerNorm(d_model)
        self.output = nn.Linear(d_model, vocab_size)
        if tie_embeddings:
            self.output.weight = self.embed.weight

    def _embed(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """tokens (R, T) (negative = padding) with the encodings (T, d) of their positions -> (R, T, d)."""
        return self.dropout(self.embed(tokens.clamp(min=0)) * math.sqrt(self.d_model) + positions)

    def _positions(self, count: int, device: torch.device) -> torch.Tensor:
        """Encodings (count, d) of positions 0 .. count - 1."""
        return sinusoidal_positions(torch.arange(count, device=device), self.d_model)

    def _log_probs(self, x: torch.Tensor) -> torch.Tensor:
        return self.output(self.norm(x)).float().log_softmax(dim=-1)

    def forward(self, tokens: torch.Tensor, token_lens: torch.Tensor, memory: torch.Tensor,
                memory_lens: torch.Tensor) -> torch.Tensor:
        """Teacher-forced log-probabilities (B, L, V) float32 of the token after each input token.

        tokens (B, L) start with sos; positions >= token_lens[b] are padding (any id, -1 allowed)
        with unspecified outputs. Right padding needs no mask: under causal attention the valid
        positions never see it, so `token_lens` only states which outputs are meaningful.
        memory (B, S, d) from the encoder, memory_lens (B,) its valid frames.
        """
        mask = key_mask(memory_lens, memory.size(1))  # (B, 1, 1, S)
        x = self._embed(tokens, self._positions(tokens.size(1), tokens.device))
        for layer in self.layers:
            x = layer(x, *layer.cross_attn.key_value(memory), mask)
        return self._log_probs(x)

    def forward_with_attention(self, tokens: torch.Tensor, token_lens: torch.Tensor, memory: torch.Tensor,
                               memory_lens: torch.Tensor) -> DecoderAttention:
        """`forward` (the same log-probabilities, to rounding) and the cross-attention weights of
        every layer and head, from the explicit attention path (MultiHeadAttention.attend_with_weights):
        for attention pictures, never for training or search. Weights of padded frames are 0."""
        mask = key_mask(memory_lens, memory.size(1))  # (B, 1, 1, S)
        x = self._embed(tokens, self._positions(tokens.size(1), tokens.device))
        weights = []
        for layer in self.layers:
            x, layer_weights = layer.forward_with_attention(x, *layer.cross_attn.key_value(memory), mask)
            weights.append(layer_weights)
        return DecoderAttention(self._log_probs(x), torch.stack(weights))

    def init_cache(self, memory: torch.Tensor, memory_lens: torch.Tensor, *, rows: int,
                   capacity: int = 64) -> DecoderCache:
        """An empty cache for `rows` = B * N hypotheses over memory (B, S, d), memory_lens (B,):
        cross-attention keys and values projected once per utterance; self-attention buffers for
        `capacity` steps (grown when exceeded)."""
        memory_kv = torch.stack([torch.stack(layer.cross_attn.key_value(memory)) for layer in self.layers])
        _, _, batch, heads, _, dh = memory_kv.shape
        if rows % batch:
            raise ValueError(f"{rows} rows are not a multiple of the {batch} utterances of the memory")
        capacity = max(capacity, 1)
        self_kv = memory_kv.new_empty(len(self.layers), 2, rows, capacity, heads, dh)
        valid = key_mask(memory_lens, memory.size(1))  # (B, 1, 1, S)
        mask = torch.zeros(valid.shape, dtype=memory_kv.dtype, device=valid.device).masked_fill(~valid, float("-inf"))
        return DecoderCache(self_kv, memory_kv, mask, self._positions(capacity, memory.device))

    def step(self, last_tokens: torch.Tensor, memory: torch.Tensor, memory_lens: torch.Tensor,
             cache: DecoderCache | None = None) -> tuple[torch.Tensor, DecoderCache]:
        """Log-probabilities (R, V) float32 of the next token of R hypotheses, and the cache.

        last_tokens (R,): each hypothesis's latest token (sos at the first step), all at position
        cache.length. memory (B, S, d) and memory_lens (B,) are read only to make the cache when
        `cache` is None (R = B * N; the N hypotheses of utterance b are rows b*N .. b*N + N-1);
        afterwards the cache holds their projections. The cache is updated in place and returned,
        so decode under torch.no_grad() or torch.inference_mode().
        """
        if cache is None:
            cache = self.init_cache(memory, memory_lens, rows=last_tokens.size(0))
        t = cache.length
        if t == cache.positions.size(0):
            cache.positions = self._positions(2 * t, last_tokens.device)
        x = self._embed(last_tokens[:, None], cache.positions[t:t + 1])  # (R, 1, d)
        for index, layer in enumerate(self.layers):
            x = layer.step(x, index, cache)
        cache.length += 1
        return self._log_probs(x[:, 0]), cache

    def step_kv(self, tokens: torch.Tensor, self_kv: tuple[torch.Tensor, ...], length: torch.Tensor,
                memory_kv: tuple[torch.Tensor, ...], memory_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`step` with its cache as arguments and results, no state (the graph asr.export writes).

        tokens (B, N) long: the latest token of N hypotheses per utterance, all at position t;
        self_kv: 2 x layers tensors (B, N, H, C, dh), layer l's keys at 2 l and values at 2 l + 1,
        buffers of capacity C > t whose positions [0, t) hold the steps so far and whose other
        positions are finite (they are masked out); length: t, an int64 scalar; memory_kv: 2 x
        layers tensors (B, H, S, dh), the cross-attention keys and values in the same order, and
        memory_mask (B, 1, 1, S) additive, as `init_cache` makes them.
        Returns the log-probabilities (B, N, V) float32 and the new position's keys and values
        new_kv (layers, 2, B, N, H, dh), which the caller stores at position t of its buffers.

        The buffers are only read: the new position is attended separately (its score joins the
        buffer's in the softmax), so a step neither concatenates nor returns the cache; each layer's
        keys and values are inputs of their own in the (H, C, dh) layout the attention matmuls
        take, so the graph slices (copies) none of them.
        """
        b, n = tokens.shape
        heads, capacity, dh = self_kv[0].shape[2:]
        x = self._embed(tokens.reshape(b * n, 1), sinusoidal_positions(length.view(1), self.d_model))  # (R, 1, d)
        past = torch.arange(capacity, device=tokens.device) < length  # (C,) the filled positions
        past_mask = torch.zeros(capacity, device=tokens.device).masked_fill(~past, float("-inf"))
        scale = dh ** -0.5
        new_kv = []
        for index, layer in enumerate(self.layers):
            q, kv = layer.self_attn.q_kv(layer.norm1(x))  # (R, H, 1, dh), (R, 1, 2, H, dh)
            new = kv.reshape(b * n, 2, heads, 1, dh)
            new_kv.append(new)
            keys, values = (c.reshape(b * n, heads, capacity, dh) for c in self_kv[2 * index:2 * index + 2])
            scores = torch.cat([q @ keys.transpose(-2, -1) * scale + past_mask,  # (R, H, 1, C + 1)
                                q @ new[:, 0].transpose(-2, -1) * scale], dim=-1)
            weights = scores.softmax(dim=-1)
            y = weights[..., :capacity] @ values + weights[..., capacity:] * new[:, 1]  # (R, H, 1, dh)
            x = x + layer.self_attn.out_proj(y.transpose(1, 2).reshape(b * n, 1, -1))
            x = layer._cross_and_ffn(x, memory_kv[2 * index], memory_kv[2 * index + 1], memory_mask)
        new_kv = torch.stack(new_kv).view(len(self.layers), b, n, 2, heads, dh).permute(0, 3, 1, 2, 4, 5)
        return self._log_probs(x[:, 0]).view(b, n, -1), new_kv.contiguous()
