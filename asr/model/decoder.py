"""Transformer decoder: a teacher-forced `forward` for training and a cached `step` for search.

Shape legend: B utterances, N hypotheses per utterance (beam; 1 for greedy), R = B * N rows,
L target length, S memory (encoder) frames, V vocabulary, H heads, dh head size, C cache capacity.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import nn

from asr.model.attention import MultiHeadAttention, key_mask
from asr.model.encoder import FeedForward, sinusoidal_positions


class DecoderAttention(NamedTuple):
    """What `TransformerDecoder.forward_with_attention` returns."""

    log_probs: torch.Tensor  # (B, L, V) float32, as `forward`'s
    cross_attention: torch.Tensor  # (layers, B, H, L, S): the weights of output position l over the
    # memory frames; each row sums to 1 over the valid frames memory_lens[b] and is 0 on the others
    self_attention: torch.Tensor  # (layers, B, H, L, L): the weights of position l over the input
    # positions; each row sums to 1 over positions 0 .. l and is exactly 0 above the diagonal (so
    # padding inputs, which come after a row's valid ones, get 0 from every valid row)


@dataclass(eq=False)
class DecoderCache:
    """What the decoder's `step` needs from earlier steps (asr.inference.DecoderState); updated in
    place by `step` and `select`.

    Self-attention keys and values live in a buffer preallocated to a capacity and filled in place
    (doubled when full): appending with torch.cat instead copies (and allocates) all t steps at
    every step. `select` moves data only where a row changes hands, and only the positions where
    the row's new inputs differ from those it held (the cache keeps the inputs, sos then tokens, to
    tell): in beam search most hypotheses continue in their own row and the others differ from the
    hypothesis they replace in their last few tokens, so a step copies a few positions of a few
    rows instead of the whole filled buffer (a copy that grows with the position and, at large
    batch x beam, dominates the step). Dropped utterances leave holes that the caller fills with
    rows from the end, so dropping one utterance copies at most one utterance's rows.

    Cross-attention keys and values are projected from the encoder output once, per utterance
    (B rows, not R): the N hypotheses of an utterance share them (see `MultiHeadAttention.attend`).
    """

    self_kv: torch.Tensor  # (layers, 2, R, C, H, dh): keys [:, 0], values [:, 1]; steps [0, length) filled
    memory_kv: torch.Tensor  # (layers, 2, B, H, S, dh)
    memory_mask: torch.Tensor  # (B, 1, 1, S) additive: 0 on valid frames, -inf on padding (made once,
    # not converted from a boolean mask at every attention call)
    positions: torch.Tensor  # (C, d) float32 sinusoidal encodings of positions 0 .. C - 1
    inputs: torch.Tensor  # (R, C) long: the inputs read so far (sos, then tokens), positions [0, length)
    length: int = 0  # steps taken so far = position of the next token
    _found: tuple[torch.Tensor, ...] | None = None  # what selection_counts found, for select

    @property
    def rows(self) -> int:
        return self.self_kv.size(2)

    @property
    def capacity(self) -> int:
        """Steps the buffers hold before they grow."""
        return self.self_kv.size(3)

    @property
    def group(self) -> int:
        """Hypotheses per utterance, N = R // B, fixed when the cache is made."""
        return self.rows // self.memory_kv.size(2)

    # what a decoder layer's step reads and writes (see also ExportedStepCache)

    def position_encoding(self) -> torch.Tensor:
        """(1, d): the encoding of position `length`, the one this step writes; the buffers doubled
        first when full."""
        if self.length == self.capacity:
            t = self.length
            self.self_kv = torch.cat([self.self_kv, torch.empty_like(self.self_kv)], dim=3)
            self.inputs = torch.cat([self.inputs, torch.empty_like(self.inputs)], dim=1)
            doubled = torch.arange(2 * t, device=self.inputs.device)
            self.positions = sinusoidal_positions(doubled, self.positions.size(1))
        return self.positions[self.length:self.length + 1]

    def attend_self(self, layer: int, attention: MultiHeadAttention, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        """`attention` of q (R, H, 1, dh) over layer `layer`'s steps so far and this one, whose keys
        and values kv (R, 1, 2, H, dh) are stored at position `length`: (R, 1, d)."""
        layer_kv = self.self_kv[layer]  # (2, R, C, H, dh)
        layer_kv[:, :, self.length] = kv[:, 0].transpose(0, 1)
        keys, values = layer_kv[:, :, :self.length + 1].transpose(2, 3)  # (R, H, t + 1, dh) each
        return attention.attend(q, keys, values)

    def memory(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer `layer`'s cross-attention keys and values, (B, H, S, dh) each."""
        return self.memory_kv[layer][0], self.memory_kv[layer][1]

    def advance(self, last_tokens: torch.Tensor) -> None:
        """The step that read last_tokens (R,) is done."""
        self.inputs[:, self.length] = last_tokens
        self.length += 1

    # selection (asr.inference.DecoderState)

    def selection_counts(self, rows: torch.Tensor, kept: torch.Tensor) -> torch.Tensor:
        """(3,) long: the rows that move, the (row, position) pairs to copy, the utterances that move,
        when keeping rows (R,) cut to `kept` utterances; no host synchronization. What it finds is
        kept for `select` of these rows (or of their first groups)."""
        moved, start, utterances_moved = self._changes(rows, kept * self.group)
        self._found = (rows, moved, start, utterances_moved)
        n_moved = moved.sum()
        if self.group == 1:  # the rows that move are whole utterances, copied whole
            return torch.stack([n_moved, n_moved * self.length, n_moved])
        copies = ((self.length - start) * moved).sum()
        return torch.stack([n_moved, copies, utterances_moved.sum()])

    def select(self, rows: torch.Tensor, counts: Sequence[int]) -> DecoderCache:
        """Keep rows (R',) in that order (asr.inference.DecoderState.select); `counts`: the values of
        `selection_counts`. In place; returns self."""
        n_moved, copies, n_groups = counts
        moved, start, utterances_moved = self._changes_of(rows)
        if rows.numel() < self.rows:
            groups = rows.view(-1, self.group)[:, 0] // self.group  # (B',) the utterance of each group
            self._keep_groups(groups, _true_positions(utterances_moved, n_groups))
        moved = _true_positions(moved, n_moved)
        if copies:
            self._copy_positions(moved, rows[moved], start[moved], copies)
        self.self_kv = self.self_kv[:, :, :rows.numel()]
        self.inputs = self.inputs[rows]
        return self

    def reorder(self, rows: torch.Tensor) -> DecoderCache:
        """`select` with its counts found here (one host synchronization): for callers outside a search."""
        return self.select(rows, self.selection_counts(rows, rows.new_tensor(rows.numel() // self.group)).tolist())

    def _changes_of(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`_changes` of rows (R',), from what `selection_counts` found when they are its rows' first
        R' (a view of them: the search cuts its proposal to the utterances that stay)."""
        found, self._found = self._found, None
        if found is not None and rows.data_ptr() == found[0].data_ptr() and rows.numel() <= found[0].numel():
            size = rows.numel()
            return found[1][:size], found[2][:size], found[3][:size // self.group]
        return self._changes(rows, rows.numel())

    def _changes(self, rows: torch.Tensor, live: int | torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """For the first `live` of rows (R',): which rows move (R',) bool; from which position their
        inputs differ from those the row held (R',) long (0 when the row changes utterance: nothing
        is shared then); which groups take another utterance's rows (R' // N,) bool."""
        n, t = self.group, self.length
        new = torch.arange(rows.numel(), device=rows.device)
        alive = new < live
        moved = (rows != new) & alive
        if n == 1:  # a row that moves takes another utterance's hypothesis
            return moved, torch.zeros_like(rows), moved
        same = rows // n == new // n  # (R',) the row stays in its utterance
        differ = self.inputs[rows, :t] != self.inputs[:rows.numel(), :t]  # (R', t)
        start = (differ.cumsum(dim=1) == 0).sum(dim=1) * same  # the inputs both share, from the first
        return moved, start, ~same[::n] & alive[::n]

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

    def _keep_groups(self, utterances: torch.Tensor, moved: torch.Tensor) -> None:
        """Memory of utterances (B',) in that order: the moved ones (U,) are copied into place."""
        if moved.numel():
            source = utterances[moved]
            self.memory_kv.index_copy_(2, moved, self.memory_kv.index_select(2, source))
            self.memory_mask.index_copy_(0, moved, self.memory_mask.index_select(0, source))
        self.memory_kv = self.memory_kv[:, :, :utterances.numel()]
        self.memory_mask = self.memory_mask[:utterances.numel()]


def _true_positions(mask: torch.Tensor, count: int) -> torch.Tensor:
    """The positions of the True entries of mask (n,), ascending, given their `count`: no host sync."""
    return torch.argsort((~mask).to(torch.int8), stable=True)[:count]


class ExportedStepCache:
    """The decoder's step with its cache as tensors in and out, no state: the graph asr.export writes
    (decoder_step.onnx). The layers run the same `DecoderLayer.step` as with a DecoderCache; only
    the self-attention over the past differs.

    self_kv: 2 x layers tensors (R, H, C, dh), layer l's keys at 2 l and values at 2 l + 1, buffers
    of capacity C > t whose positions [0, t) hold the steps so far and whose other positions are
    finite (they are masked out); length: t, an int64 scalar; memory_kv: 2 x layers tensors
    (B, H, S, dh) in the same order, memory_mask (B, 1, 1, S) additive, as `init_cache` makes them.
    The buffers are only read: the new position is attended separately (its score joins the
    buffer's in one softmax), so a step neither concatenates nor returns the cache; each layer's
    keys and values are inputs of their own in the (H, C, dh) layout the attention matmuls take,
    so the graph slices (copies) none of them. `new_kv` collects each layer's new keys and values
    (R, 2, H, 1, dh) for the caller to store at position t.
    """

    def __init__(self, self_kv: tuple[torch.Tensor, ...], length: torch.Tensor, memory_kv: tuple[torch.Tensor, ...],
                 memory_mask: torch.Tensor, d_model: int) -> None:
        self.self_kv, self.length, self.memory_kv, self.memory_mask = self_kv, length, memory_kv, memory_mask
        self.d_model = d_model
        capacity = self_kv[0].size(2)
        past = torch.arange(capacity, device=length.device) < length  # (C,) the filled positions
        self.past_mask = torch.zeros(capacity, device=length.device).masked_fill(~past, float("-inf"))
        self.new_kv: list[torch.Tensor] = []

    def position_encoding(self) -> torch.Tensor:
        return sinusoidal_positions(self.length.view(1), self.d_model)  # (1, d)

    def attend_self(self, layer: int, attention: MultiHeadAttention, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        """As DecoderCache.attend_self, by an explicit softmax over the buffer's scores and the new one."""
        rows, heads, _, dh = q.shape
        new = kv.reshape(rows, 2, heads, 1, dh)
        self.new_kv.append(new)
        keys, values = self.self_kv[2 * layer], self.self_kv[2 * layer + 1]  # (R, H, C, dh) each
        scale = dh ** -0.5
        scores = torch.cat([q @ keys.transpose(-2, -1) * scale + self.past_mask,  # (R, H, 1, C + 1)
                            q @ new[:, 0].transpose(-2, -1) * scale], dim=-1)
        weights = scores.softmax(dim=-1)
        capacity = keys.size(2)
        y = weights[..., :capacity] @ values + weights[..., capacity:] * new[:, 1]  # (R, H, 1, dh)
        return attention.out_proj(y.transpose(1, 2).reshape(rows, 1, -1))

    def memory(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.memory_kv[2 * layer], self.memory_kv[2 * layer + 1]

    def advance(self, last_tokens: torch.Tensor) -> None:
        """Nothing to keep: the caller stores `new_kv`."""


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
                               memory_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`forward` with both attentions on the explicit path (MultiHeadAttention.attend_with_weights):
        (B, L, d), the same to rounding, the causal self-attention weights (B, H, L, L) and the
        cross-attention weights (B, H, L, S)."""
        y, self_weights = self.self_attn.forward_with_weights(self.norm1(x), is_causal=True)
        x = x + self.dropout(y)
        q = self.cross_attn.query(self.norm2(x))
        y, cross_weights = self.cross_attn.attend_with_weights(q, memory_k, memory_v, mask=memory_mask)
        x = x + self.dropout(y)
        return x + self.dropout(self.ffn(self.norm3(x))), self_weights, cross_weights

    def step(self, x: torch.Tensor, index: int, cache: DecoderCache | ExportedStepCache) -> torch.Tensor:
        """One position: x (R, 1, d) -> (R, 1, d), reading and filling layer `index` of the cache."""
        q, kv = self.self_attn.q_kv(self.norm1(x))  # (R, H, 1, dh), (R, 1, 2, H, dh)
        x = x + cache.attend_self(index, self.self_attn, q, kv)
        return self._cross_and_ffn(x, *cache.memory(index), cache.memory_mask)


class TransformerDecoder(nn.Module):
    """Token embedding x sqrt(d) + sinusoidal positions -> pre-LayerNorm blocks -> LayerNorm -> Linear.

    `forward` is teacher-forced over whole sequences; `step` decodes one position for R rows with
    a DecoderCache; both give the same log-probabilities (float32) for the same prefix.
    `forward_with_attention` is `forward` that also returns the self- and cross-attention weights
    (pictures).
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
        """`forward` (the same log-probabilities, to rounding) and the self- and cross-attention
        weights of every layer and head, from the explicit attention path
        (MultiHeadAttention.attend_with_weights): for attention pictures, never for training or
        search. Weights of padded frames and of later positions are exactly 0."""
        mask = key_mask(memory_lens, memory.size(1))  # (B, 1, 1, S)
        x = self._embed(tokens, self._positions(tokens.size(1), tokens.device))
        self_weights, cross_weights = [], []
        for layer in self.layers:
            x, layer_self, layer_cross = layer.forward_with_attention(x, *layer.cross_attn.key_value(memory), mask)
            self_weights.append(layer_self)  # (B, H, L, L)
            cross_weights.append(layer_cross)  # (B, H, L, S)
        return DecoderAttention(self._log_probs(x), torch.stack(cross_weights), torch.stack(self_weights))

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
        inputs = torch.zeros(rows, capacity, dtype=torch.long, device=memory.device)
        return DecoderCache(self_kv, memory_kv, mask, self._positions(capacity, memory.device), inputs)

    def step(self, last_tokens: torch.Tensor,
             cache: DecoderCache | ExportedStepCache) -> tuple[torch.Tensor, DecoderCache | ExportedStepCache]:
        """Log-probabilities (R, V) float32 of the next token of R hypotheses, and the cache.

        last_tokens (R,): each hypothesis's latest token (sos at the first step), all at position
        cache.length; the N hypotheses of utterance b are rows b*N .. b*N + N-1 (init_cache). The
        cache is updated in place and returned, so decode under torch.no_grad() or
        torch.inference_mode(). An ExportedStepCache runs the same layers for the exported graph.
        """
        x = self._embed(last_tokens[:, None], cache.position_encoding())  # (R, 1, d)
        for index, layer in enumerate(self.layers):
            x = layer.step(x, index, cache)
        cache.advance(last_tokens)
        return self._log_probs(x[:, 0]), cache
