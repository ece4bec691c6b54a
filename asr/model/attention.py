"""Multi-head attention on `scaled_dot_product_attention`, with the pieces a KV cache needs.

Mask convention (DESIGN.md): boolean, True = may attend, broadcast to (B, H, T_query, T_key).
Shape legend: B batch, H heads, T query length, S key length, dh = d_model / H.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def key_mask(lengths: torch.Tensor, max_len: int) -> torch.Tensor:
    """Key-padding mask (B, 1, 1, max_len), True on the first `lengths[b]` keys of row b.

    A row of length 0 keeps its first key: a fully masked softmax row is NaN on some fused
    kernels, and a sequence with no frames has no meaningful output anyway (its length says so).
    """
    positions = torch.arange(max_len, device=lengths.device)  # (S,)
    return (positions < lengths.clamp(min=1)[:, None])[:, None, None, :]


class MultiHeadAttention(nn.Module):
    """Multi-head attention: `forward` is self-attention; `query`, `key_value`, `qkv` and `attend`
    are the parts the decoder's cached step and its cross-attention combine.

    The query, key and value projections are one (3 d, d) matrix so that self-attention makes one
    matmul; cross-attention uses its first third for queries and the rest for keys and values.
    """

    def __init__(self, *, d_model: int, n_heads: int, dropout: float = 0.0) -> None:
        super().__init__()
        if d_model % n_heads:
            raise ValueError(f"d_model {d_model} is not divisible by n_heads {n_heads}")
        self.d_model, self.n_heads, self.dropout = d_model, n_heads, dropout
        self.in_weight = nn.Parameter(torch.empty(3 * d_model, d_model))  # rows: q, k, v
        self.in_bias = nn.Parameter(torch.empty(3 * d_model))
        self.out_proj = nn.Linear(d_model, d_model)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Xavier-uniform on each of the q, k, v and output matrices (as if separate), zero biases."""
        for chunk in self.in_weight.data.chunk(3):
            nn.init.xavier_uniform_(chunk)
        nn.init.zeros_(self.in_bias)
        nn.init.xavier_uniform_(self.out_proj.weight)
        nn.init.zeros_(self.out_proj.bias)

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        """(B, T, H * dh) -> (B, H, T, dh)."""
        b, t, _ = x.shape
        return x.view(b, t, self.n_heads, -1).transpose(1, 2)

    def qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Self-attention projections of x (B, T, d): q, k, v each (B, H, T, dh)."""
        q, k, v = F.linear(x, self.in_weight, self.in_bias).chunk(3, dim=-1)
        return self._heads(q), self._heads(k), self._heads(v)

    def query(self, x: torch.Tensor) -> torch.Tensor:
        """Query projection of x (B, T, d) -> (B, H, T, dh)."""
        d = self.d_model
        return self._heads(F.linear(x, self.in_weight[:d], self.in_bias[:d]))

    def key_value(self, memory: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Key and value projections of memory (B, S, d): k, v each (B, H, S, dh)."""
        d = self.d_model
        k, v = F.linear(memory, self.in_weight[d:], self.in_bias[d:]).chunk(2, dim=-1)
        return self._heads(k), self._heads(v)

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        mask: torch.Tensor | None = None,
        is_causal: bool = False,
    ) -> torch.Tensor:
        """Attention of q (R, H, T, dh) over k, v (B, H, S, dh), then the output projection: (R, T, d).

        R may be a multiple N of B (beam search): query rows b * N .. b * N + N - 1 then attend to
        key row b, so that keys and values are kept once per utterance, never per hypothesis.
        `mask` (B, 1, 1, S) or broadcastable to (B, H, T, S); `is_causal` needs R == B and T == S.
        """
        rows, heads, t, dh = q.shape
        group = rows // k.size(0)
        if group > 1:  # fold the N hypotheses of an utterance into its query positions
            q = q.view(-1, group, heads, t, dh).transpose(1, 2).reshape(-1, heads, group * t, dh)
        p = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p, is_causal=is_causal)
        if group > 1:  # (B, H, N * T, dh) -> (R, H, T, dh)
            y = y.view(-1, heads, group, t, dh).transpose(1, 2).reshape(rows, heads, t, dh)
        return self.out_proj(y.transpose(1, 2).reshape(rows, t, self.d_model))

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None, is_causal: bool = False) -> torch.Tensor:
        """Self-attention of x (B, T, d) -> (B, T, d); `mask` as in `attend`."""
        return self.attend(*self.qkv(x), mask=mask, is_causal=is_causal)

