"""Multi-head attention on `scaled_dot_product_attention`, with the pieces a KV cache needs.

Mask convention (DESIGN.md): boolean, True = may attend, broadcast to (B, H, T_query, T_key).
Shape legend: B batch, H heads, T query length, S key length, dh = d_model / H.

Which fused kernel runs. On the CPU torch's own choice stands (one flash-style kernel takes every
case but a bias that needs its gradient, which goes to the math fallback). On CUDA torch would try
flash, then cuDNN, then memory-efficient, then math (torch 2.11); `sdpa` names the kernels each
call may use instead, and never cuDNN: cuDNN's attention builds an execution plan for every new
shape (batch size and length), and with a new padded length in nearly every batch the planning
took 11 ms of CPU per call on an H200, 61% of the CPU time of a training step, while its kernels
took <1% of the GPU time (`tools/gpu_check.py` profiles it; `SDPA_BACKENDS` is what to change
to measure another choice):
- no mask (the decoder's causal self-attention in training and rescoring, `is_causal=True`; its
  cached step, one query per row over the cache, which holds only valid steps): flash (fp16 /
  bf16; the keys and values are strided views of the cache buffer with the head dimension
  contiguous, which it reads in place), then memory-efficient (fp32), then math;
- a mask (encoder self-attention and all cross-attention, the key-padding mask (B, 1, 1, S):
  flash takes none; the conformer's additive relative-position bias (B, H, T, T), whose gradient
  the backward pass needs): memory-efficient, then math. A batch without padding would need no
  mask, but finding that out costs a host sync, so the mask is always passed. Beam search folds
  the N hypotheses of an utterance into N query positions over the utterance's keys (`attend`),
  so the keys are never copied per hypothesis.

The fused kernels never form the weights. `attend_with_weights` is the explicit matmul-softmax
reference path that returns them, and `forward_with_weights` the self-attention on it (attention
pictures: the encoders' and the decoder's `forward_with_attention`; the conformer's relative
positions go through it as an additive bias); it gives the same outputs to rounding and is used
only when the weights are asked for.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

# The kernels a call on CUDA may use, in torch's order (see the module docstring): by whether it
# passes a mask.
SDPA_BACKENDS = {
    "unmasked": [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH],
    "masked": [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH],
}


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None,
         dropout_p: float = 0.0, is_causal: bool = False) -> torch.Tensor:
    """`F.scaled_dot_product_attention(q, k, v, attn_mask=mask, ...)`, on CUDA restricted to the
    kernels of SDPA_BACKENDS (never cuDNN's, which re-plans for every shape); torch's own choice on
    other devices."""
    if q.device.type != "cuda":
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=is_causal)
    with sdpa_kernel(SDPA_BACKENDS["unmasked" if mask is None else "masked"]):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=is_causal)


def key_mask(lengths: torch.Tensor, max_len: int) -> torch.Tensor:
    """Key-padding mask (B, 1, 1, max_len), True on the first `lengths[b]` keys of row b.

    A row of length 0 keeps its first key: a fully masked softmax row is NaN on some fused
    kernels, and a sequence with no frames has no meaningful output anyway (its length says so).
    """
    positions = torch.arange(max_len, device=lengths.device)  # (S,)
    return (positions < lengths.clamp(min=1)[:, None])[:, None, None, :]


def chunk_mask(length: int, chunk: int, left_chunks: int = -1, device: torch.device | None = None) -> torch.Tensor:
    """(1, 1, T, T) bool for streaming: frame i may attend to frame j when j's chunk (of `chunk`
    frames, from frame 0) is i's or one of the `left_chunks` before it (all before: < 0)."""
    index = torch.arange(length, device=device) // chunk  # (T,) chunk of each frame
    allowed = index[None, :] <= index[:, None]
    if left_chunks >= 0:
        allowed &= index[None, :] >= index[:, None] - left_chunks
    return allowed[None, None]


IN_PARTS = ("qkv", "q", "kv")  # the parts of the packed in-projection the attention uses (MultiHeadAttention.in_rows)


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
        self.int8_in: nn.ModuleDict | None = None  # an int8 copy of the model (asr.quantize): the in-projection
        # prepacked by part (IN_PARTS), used instead of in_weight / in_bias
        MultiHeadAttention.reset_parameters(self)  # this class's own: a subclass adds parameters after

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

    def in_rows(self, part: str) -> slice:
        """The rows of in_weight / in_bias of `part` (IN_PARTS): "qkv" all, "q" the first third, "kv" the rest."""
        d = self.d_model
        return {"qkv": slice(0, 3 * d), "q": slice(0, d), "kv": slice(d, 3 * d)}[part]

    def _in_proj(self, x: torch.Tensor, part: str) -> torch.Tensor:
        """x (B, T, d) through the in-projection's rows of `part` (in_rows): (B, T, rows)."""
        if self.int8_in is not None:
            return self.int8_in[part](x)
        rows = self.in_rows(part)
        return F.linear(x, self.in_weight[rows], self.in_bias[rows])

    def qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Self-attention projections of x (B, T, d): q, k, v each (B, H, T, dh)."""
        q, k, v = self._in_proj(x, "qkv").chunk(3, dim=-1)
        return self._heads(q), self._heads(k), self._heads(v)

    def q_kv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Self-attention projections of x (B, T, d) for a cache: q (B, H, T, dh), and the keys
        and values side by side, (B, T, 2, H, dh) (one view: a cache stores them in one copy)."""
        b, t, _ = x.shape
        projected = self._in_proj(x, "qkv")  # (B, T, 3 d)
        return self._heads(projected[..., :self.d_model]), projected[..., self.d_model:].view(b, t, 2, self.n_heads, -1)

    def query(self, x: torch.Tensor) -> torch.Tensor:
        """Query projection of x (B, T, d) -> (B, H, T, dh)."""
        return self._heads(self._in_proj(x, "q"))

    def key_value(self, memory: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Key and value projections of memory (B, S, d): k, v each (B, H, S, dh)."""
        k, v = self._in_proj(memory, "kv").chunk(2, dim=-1)
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
        `mask` (B, 1, 1, S) or broadcastable to (B, H, T, S), boolean (True = may attend) or
        additive; `is_causal` needs R == B and T == S.
        """
        p = self.dropout if self.training else 0.0
        y = sdpa(self._fold(q, k.size(0)), k, v, mask, dropout_p=p, is_causal=is_causal)
        return self._unfold(y, q.shape)

    def attend_with_weights(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        mask: torch.Tensor | None = None,
        is_causal: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`attend` by an explicit matmul-softmax, for attention pictures: (its output (R, T, d), the
        same to rounding, and the attention weights (R, H, T, S)). A row's weights sum to 1 over the
        keys it may attend and are exactly 0 on the others. Dropout, in training mode, drops weights
        as `attend` does; the weights returned are those before it. Slower than `attend`, which
        stays the path of training and decoding.
        """
        rows, heads, t, _ = q.shape
        batch, keys = k.size(0), k.size(2)
        folded = self._fold(q, batch)  # (B, H, N * T, dh)
        scores = folded @ k.transpose(-2, -1) * folded.size(-1) ** -0.5  # (B, H, N * T, S)
        if is_causal:  # top-left aligned, as scaled_dot_product_attention's
            mask = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).tril()
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
        weights = scores.softmax(dim=-1)
        p = self.dropout if self.training else 0.0
        y = self._unfold((F.dropout(weights, p) if p else weights) @ v, q.shape)
        weights = weights.view(batch, heads, -1, t, keys).transpose(1, 2).reshape(rows, heads, t, keys)
        return y, weights

    def _fold(self, q: torch.Tensor, batch: int) -> torch.Tensor:
        """q (R, H, T, dh), R = N * batch -> (batch, H, N * T, dh): the N hypotheses of an utterance
        become query positions over its key row (a view of q when N == 1 or T == 1). No branch on the
        sizes, so that an exported graph keeps N and B apart (asr.export)."""
        _, heads, t, dh = q.shape
        return q.view(batch, -1, heads, t, dh).transpose(1, 2).reshape(batch, heads, -1, dh)

    def _unfold(self, y: torch.Tensor, shape: torch.Size) -> torch.Tensor:
        """y (B, H, N * T, dh) of queries folded from shape (R, H, T, dh) -> the output projection
        of its rows unfolded, (R, T, d)."""
        rows, heads, t, dh = shape
        y = y.view(y.size(0), heads, -1, t, dh).permute(0, 2, 3, 1, 4)  # (B, N, T, H, dh)
        return self.out_proj(y.reshape(rows, t, self.d_model))

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None, is_causal: bool = False) -> torch.Tensor:
        """Self-attention of x (B, T, d) -> (B, T, d); `mask` as in `attend`."""
        return self.attend(*self.qkv(x), mask=mask, is_causal=is_causal)

    def forward_with_weights(self, x: torch.Tensor, mask: torch.Tensor | None = None,
                             is_causal: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """`forward` on the explicit path (`attend_with_weights`), for attention pictures: its output
        (B, T, d), the same to rounding, and the weights (B, H, T, T), exactly 0 where `mask` or
        `is_causal` forbids a key."""
        return self.attend_with_weights(*self.qkv(x), mask=mask, is_causal=is_causal)

