"""A token-level transformer language model (decoder-only): the ASR model's tokens, one sentence at
a time from sos, predicting each next token and eos. `forward` is teacher-forced over whole
sequences (training, rescoring); `step` extends R hypotheses by one token with a KV cache (the
decoder's DecoderCache, without memory), so that beam search scores the whole vocabulary for every
row in one batched call.

Shape legend: R rows (utterances x beam), L tokens, V vocabulary, d model width.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from asr.model.attention import MultiHeadAttention
from asr.model.decoder import DecoderCache
from asr.model.encoder import FeedForward, sinusoidal_positions
from asr.tokens import MIN_VOCAB

__all__ = ["LMConfig", "TransformerLM"]


@dataclass(frozen=True)
class LMConfig:
    """The LM's dimensions; stored in LM files as a plain dict. Defaults: a small LM for a CPU."""

    vocab_size: int = 0  # V of the ASR model's tokenizer (blank, unk, sos/eos included); 0 = not set yet
    d_model: int = 256
    n_heads: int = 4
    ffn_dim: int = 1024
    n_layers: int = 4
    dropout: float = 0.1  # residual, feed-forward and input dropout
    attention_dropout: float = 0.0
    tie_embeddings: bool = True  # the output projection shares the embedding matrix

    def __post_init__(self) -> None:
        for name in ("d_model", "n_heads", "ffn_dim", "n_layers"):
            if getattr(self, name) <= 0:
                raise ValueError(f"model.{name} = {getattr(self, name)!r} must be positive")
        if self.vocab_size and self.vocab_size < MIN_VOCAB:
            raise ValueError(f"model.vocab_size = {self.vocab_size} must be 0 (set from the tokenizer) or at "
                             f"least {MIN_VOCAB}")
        if self.d_model % self.n_heads or self.d_model % 2:
            raise ValueError(f"model.d_model = {self.d_model} must be even and a multiple of n_heads ({self.n_heads})")
        for name in ("dropout", "attention_dropout"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f"model.{name} = {getattr(self, name)!r} must be in [0, 1)")


class LMLayer(nn.Module):
    """Pre-LayerNorm block: causal self-attention, then feed-forward."""

    def __init__(self, *, d_model: int, n_heads: int, ffn_dim: int, dropout: float, attention_dropout: float) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(d_model)
        self.self_attn = MultiHeadAttention(d_model=d_model, n_heads=n_heads, dropout=attention_dropout)
        self.norm2 = nn.LayerNorm(d_model)
        self.ffn = FeedForward(d_model=d_model, ffn_dim=ffn_dim, dropout=dropout)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (R, L, d) -> (R, L, d); position t sees positions <= t only."""
        x = x + self.dropout(self.self_attn(self.norm1(x), is_causal=True))
        return x + self.dropout(self.ffn(self.norm2(x)))

    def step(self, x: torch.Tensor, index: int, cache: DecoderCache) -> torch.Tensor:
        """One position: x (R, 1, d) -> (R, 1, d), reading and filling layer `index` of the cache."""
        q, kv = self.self_attn.q_kv(self.norm1(x))  # (R, H, 1, dh), (R, 1, 2, H, dh)
        x = x + cache.attend_self(index, self.self_attn, q, kv)
        return x + self.ffn(self.norm2(x))


class TransformerLM(nn.Module):
    """Token embedding x sqrt(d) + sinusoidal positions -> pre-LayerNorm causal blocks -> LayerNorm ->
    Linear to V. Xavier-uniform matrices, zero biases, embedding N(0, 1/d)."""

    def __init__(self, config: LMConfig) -> None:
        super().__init__()
        if not config.vocab_size:
            raise ValueError("model.vocab_size is not set: the LM takes it from its tokenizer")
        self.config = config
        d = config.d_model
        self.embed = nn.Embedding(config.vocab_size, d)
        self.dropout = nn.Dropout(config.dropout)
        self.layers = nn.ModuleList(
            LMLayer(d_model=d, n_heads=config.n_heads, ffn_dim=config.ffn_dim, dropout=config.dropout,
                    attention_dropout=config.attention_dropout)
            for _ in range(config.n_layers)
        )
        self.norm = nn.LayerNorm(d)
        self.output = nn.Linear(d, config.vocab_size)
        if config.tie_embeddings:
            self.output.weight = self.embed.weight
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.xavier_uniform_(module.weight)
                nn.init.zeros_(module.bias)
            elif isinstance(module, MultiHeadAttention):
                module.reset_parameters()
        nn.init.normal_(self.embed.weight, std=d ** -0.5)  # last: wins when tied

    def _embed(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """tokens (R, L) (negative = padding) with the encodings (L, d) of their positions -> (R, L, d)."""
        return self.dropout(self.embed(tokens.clamp(min=0)) * math.sqrt(self.config.d_model) + positions)

    def _positions(self, count: int, device: torch.device) -> torch.Tensor:
        return sinusoidal_positions(torch.arange(count, device=device), self.config.d_model)

    def _log_probs(self, x: torch.Tensor) -> torch.Tensor:
        return self.output(self.norm(x)).float().log_softmax(dim=-1)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Teacher-forced log-probabilities (R, L, V) float32 of the token after each of tokens (R, L)
        (sos first). Right padding needs no mask: causal attention keeps valid positions from it."""
        x = self._embed(tokens, self._positions(tokens.size(1), tokens.device))
        for layer in self.layers:
            x = layer(x)
        return self._log_probs(x)

    def init_cache(self, rows: int, group: int, *, capacity: int = 64, device: torch.device | None = None,
                   dtype: torch.dtype | None = None) -> DecoderCache:
        """An empty cache for `rows` hypotheses in groups of `group` (rows of one utterance: beam
        search reorders within them and drops whole groups), room for `capacity` steps."""
        if rows % group:
            raise ValueError(f"{rows} rows are not a multiple of the group {group}")
        weight = self.embed.weight
        device, dtype = device or weight.device, dtype or weight.dtype
        c = self.config
        heads, dh = c.n_heads, c.d_model // c.n_heads
        self_kv = torch.empty(c.n_layers, 2, rows, max(capacity, 1), heads, dh, device=device, dtype=dtype)
        no_memory = torch.empty(c.n_layers, 2, rows // group, heads, 0, dh, device=device, dtype=dtype)
        mask = torch.zeros(rows // group, 1, 1, 0, device=device, dtype=dtype)
        inputs = torch.zeros(rows, max(capacity, 1), dtype=torch.long, device=device)
        return DecoderCache(self_kv, no_memory, mask, self._positions(max(capacity, 1), device), inputs)

    def step(self, last_tokens: torch.Tensor, cache: DecoderCache) -> torch.Tensor:
        """Log-probabilities (R, V) float32 of the token after each row's last token (R,) (sos first),
        all at position cache.length; the cache is updated in place (decode under no_grad)."""
        x = self._embed(last_tokens[:, None], cache.position_encoding())  # (R, 1, d)
        for index, layer in enumerate(self.layers):
            x = layer.step(x, index, cache)
        cache.advance(last_tokens)
        return self._log_probs(x[:, 0])
