"""Transformer decoder: a teacher-forced `forward` for training and a cached `step` for search.

Shape legend: B utterances, N hypotheses per utterance (beam; 1 for greedy), R = B * N rows,
L target length, S memory (encoder) frames, V vocabulary, H heads, dh head size, C cache capacity.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from asr.model.attention import MultiHeadAttention, key_mask
from asr.model.encoder import FeedForward, sinusoidal_positions


@dataclass(eq=False)
class DecoderCache:
    """What the decoder's `step` needs from earlier steps; updated in place by `step` and `reorder`.

    Self-attention keys and values live in a buffer preallocated to a capacity and filled in place
    (doubled when full); `reorder` copies the filled steps into a spare buffer. Appending with
    torch.cat instead copies (and allocates) all t steps at every step. Measured on the 2-core
    CPU, decoder of librispeech_100h.yaml (d 256, 6 layers), ms per step at position 10 / 50 / 100:
      tools/bench_model.py, 250 memory frames, rows reordered every step as in beam search:
        1 x 10 rows:   appended 7.1 / 9.2 / 10.7    preallocated 7.0 / 8.0 / 7.8
        32 x 10 rows:  appended 72 / 173 / 451      preallocated 65 / 85 / 129
      no reordering (greedy), 320 rows, 100 memory frames (position 200: 688 against 122):
        appended 84 / 196 / 382                     preallocated 53 / 68 / 81
    so the cache is preallocated.

    Cross-attention keys and values are projected from the encoder output once, per utterance
    (B rows, not R): the N hypotheses of an utterance share them (see `MultiHeadAttention.attend`).
    """

    self_kv: torch.Tensor  # (layers, 2, R, H, C, dh): keys [:, 0], values [:, 1]; steps [0, length) filled
    memory_kv: torch.Tensor  # (layers, 2, B, H, S, dh)
    memory_mask: torch.Tensor  # (B, 1, 1, S) bool, True on valid frames
    length: int = 0  # steps taken so far = position of the next token
    spare: torch.Tensor | None = None  # like self_kv: where `reorder` copies to, then swapped in

    @property
    def rows(self) -> int:
        return self.self_kv.size(2)

    @property
    def group(self) -> int:
        """Hypotheses per utterance, N = R // B, fixed when the cache is made."""
        return self.rows // self.memory_kv.size(2)

    def _copy_rows(self, index: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """Copy the filled steps of rows `index` into `out` (layers, 2, R', H, C', dh); return out."""
        t = self.length
        torch.index_select(self.self_kv[:, :, :, :, :t], 2, index, out=out[:, :, :, :, :t])
        return out

    def reorder(self, index: torch.Tensor) -> DecoderCache:
        """Keep rows `index` (R',) long of this cache, in that order: row r' continues row index[r'].

        R' == R (beam search reordering): each new row must come from a row of the same utterance,
        so the memory is unchanged; one copy of the filled steps into a spare buffer, no allocation.
        R' < R (finished utterances dropped): rows come in whole groups, the N consecutive rows of
        one utterance; the memory keeps those utterances. Updates in place and returns self.
        """
        if index.numel() == self.rows:
            spare = self.spare if self.spare is not None else torch.empty_like(self.self_kv)
            self.spare, self.self_kv = self.self_kv, self._copy_rows(index, spare)
            return self
        utterances = index.view(-1, self.group)[:, 0] // self.group  # (B',)
        layers, _, _, heads, capacity, dh = self.self_kv.shape
        out = self.self_kv.new_empty(layers, 2, index.numel(), heads, capacity, dh)
        self.self_kv, self.spare = self._copy_rows(index, out), None
        self.memory_kv = self.memory_kv.index_select(2, utterances)
        self.memory_mask = self.memory_mask.index_select(0, utterances)
        return self

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store step `length`'s k, v (R, H, 1, dh) of `layer`; return all keys and values so far,
        (R, H, length + 1, dh) each (views of the buffer). The caller advances `length`."""
        t = self.length
        if t == self.self_kv.size(4):  # full: double the capacity
            self.self_kv = torch.cat([self.self_kv, torch.empty_like(self.self_kv)], dim=4)
            self.spare = None
        self.self_kv[layer, 0, :, :, t:t + 1] = k
        self.self_kv[layer, 1, :, :, t:t + 1] = v
        return self.self_kv[layer, 0, :, :, :t + 1], self.self_kv[layer, 1, :, :, :t + 1]


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

    def step(self, x: torch.Tensor, index: int, cache: DecoderCache) -> torch.Tensor:
        """One position: x (R, 1, d) -> (R, 1, d), reading and filling layer `index` of the cache."""
        q, k, v = self.self_attn.qkv(self.norm1(x))  # (R, H, 1, dh) each
        keys, values = cache.append(index, k, v)  # (R, H, t + 1, dh)
        x = x + self.self_attn.attend(q, keys, values)
        memory_k, memory_v = cache.memory_kv[index]
        return self._cross_and_ffn(x, memory_k, memory_v, cache.memory_mask)


class TransformerDecoder(nn.Module):
    """Token embedding x sqrt(d) + sinusoidal positions -> pre-LayerNorm blocks -> LayerNorm -> Linear.

    `forward` is teacher-forced over whole sequences; `step` decodes one position for R rows with
    a DecoderCache; both give the same log-probabilities (float32) for the same prefix.
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

    def _embed(self, tokens: torch.Tensor, start: int) -> torch.Tensor:
        """tokens (R, T) (negative = padding) at positions start.. -> (R, T, d)."""
        positions = torch.arange(start, start + tokens.size(1), device=tokens.device)
        x = self.embed(tokens.clamp(min=0)) * math.sqrt(self.d_model) + sinusoidal_positions(positions, self.d_model)
        return self.dropout(x)

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
        x = self._embed(tokens, 0)
        for layer in self.layers:
            x = layer(x, *layer.cross_attn.key_value(memory), mask)
        return self._log_probs(x)

    def init_cache(self, memory: torch.Tensor, memory_lens: torch.Tensor, *, rows: int,
                   capacity: int = 64) -> DecoderCache:
        """An empty cache for `rows` = B * N hypotheses over memory (B, S, d), memory_lens (B,):
        cross-attention keys and values projected once per utterance; self-attention buffers for
        `capacity` steps (grown when exceeded)."""
        memory_kv = torch.stack([torch.stack(layer.cross_attn.key_value(memory)) for layer in self.layers])
        _, _, batch, heads, _, dh = memory_kv.shape
        if rows % batch:
            raise ValueError(f"{rows} rows are not a multiple of the {batch} utterances of the memory")
        self_kv = memory_kv.new_empty(len(self.layers), 2, rows, heads, max(capacity, 1), dh)
        return DecoderCache(self_kv, memory_kv, key_mask(memory_lens, memory.size(1)))

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
        x = self._embed(last_tokens[:, None], cache.length)  # (R, 1, d)
        for index, layer in enumerate(self.layers):
            x = layer.step(x, index, cache)
        cache.length += 1
        return self._log_probs(x[:, 0]), cache
