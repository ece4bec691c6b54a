"""CTC prefix scores for joint CTC/attention beam search, and CTC prefix beam search.

Shape legend: B utterances, N hypotheses per utterance (beam), R rows (hypotheses; the scorer
starts with R = B * N, utterance b owning rows b*N .. b*N + N-1, and then follows the search's
selections, keeping each row's utterance), C candidate tokens per row, T encoder frames, V
vocabulary, K tokens tried per frame.

The prefix probability of a token sequence h is the probability that the CTC output (repeats
merged, blanks removed) starts with h; the probability of "h then eos" is that of the output
being exactly h (Watanabe et al. 2017, "Hybrid CTC/attention architecture for end-to-end speech
recognition", Algorithm 2). Frames at or past an utterance's length are padding that emits blank
with probability 1, which changes no probability, so utterances of any lengths share a batch.

Imports nothing of ours but the scorer protocol (asr.scorer): the search hands in the CTC head
and the token ids.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch

from asr.scorer import Selection

__all__ = ["LOG_ZERO", "CTCPrefixScorer", "CTCPrefixState", "PrefixBeams", "padded_log_probs", "prefix_beam_search"]

# log(0) of the prefix scorer: finite, so that differences of impossible scores stay finite (no NaN)
LOG_ZERO = -1e10
_HASH_PRIME = 1_000_003  # prefix hashes: h(y + c) = h(y) * prime + c + 1, wrapping in int64


def padded_log_probs(log_probs: torch.Tensor, lengths: torch.Tensor, *, blank: int,
                     zero: float = LOG_ZERO) -> torch.Tensor:
    """CTC log-probabilities (B, T, V) -> time-major (T, B, V), floored at `zero`, where frames
    t >= lengths[b] emit blank with probability 1 (log 0) and anything else with log `zero`."""
    pad = torch.arange(log_probs.size(1), device=log_probs.device) >= lengths[:, None]  # (B, T)
    x = log_probs.clamp(min=zero).masked_fill(pad[..., None], zero)
    x[..., blank] = x[..., blank].masked_fill(pad, 0.0)
    return x.transpose(0, 1).contiguous()


@dataclass(frozen=True)
class CTCPrefixState:
    """The CTC side of R hypotheses of `length` tokens each (the search is label-synchronous)."""

    x: torch.Tensor  # (T, B, V) padded log-probabilities of every utterance of the batch (never reordered)
    utterance: torch.Tensor  # (R,) long, the column of x of each hypothesis
    r: torch.Tensor  # (T, 2, R): log P(hypothesis emitted by frame t, frame t emitting [0] its last token, [1] blank)
    prefix: torch.Tensor  # (R,) log prefix probability of each hypothesis
    last: torch.Tensor  # (R,) long, last token of each hypothesis, -1 when empty
    length: int  # tokens in every hypothesis
    candidates: torch.Tensor | None = None  # (R, C) the tokens `score_partial` scored last
    candidate_prefix: torch.Tensor | None = None  # (R, C) their prefix probabilities


class CTCPrefixScorer:
    """CTC prefix scores of candidate tokens: a partial scorer of the batch-first protocol in
    asr.scorer (init_state, score_partial, select_state, final_score).

    `ctc_log_probs` maps the encoder output (B, T, d) to CTC log-probabilities (B, T, V); the
    candidates it scores are never blank.
    """

    def __init__(self, ctc_log_probs: Callable[[torch.Tensor], torch.Tensor], *, eos: int, blank: int = 0) -> None:
        self.ctc_log_probs, self.eos, self.blank = ctc_log_probs, eos, blank

    def init_state(self, memory: torch.Tensor, memory_lens: torch.Tensor, group: int) -> CTCPrefixState:
        """The empty hypothesis in each of the `group` rows of every utterance."""
        x = padded_log_probs(self.ctc_log_probs(memory), memory_lens, blank=self.blank)  # (T, B, V)
        utterance = torch.arange(x.size(1) * group, device=x.device) // group  # (R,)
        blanks = x[:, :, self.blank].cumsum(dim=0).index_select(1, utterance)  # (T, R): all blank so far
        r = torch.stack([torch.full_like(blanks, LOG_ZERO), blanks], dim=1)  # (T, 2, R)
        last = torch.full_like(utterance, -1)
        return CTCPrefixState(x, utterance, r, blanks.new_zeros(utterance.numel()), last, 0)

    def score_partial(self, state: CTCPrefixState, candidates: torch.Tensor) -> tuple[torch.Tensor, CTCPrefixState]:
        """Gain in log prefix probability (R, C) of appending each candidate token to its row's
        hypothesis (for eos: log P(output == hypothesis) - log prefix probability)."""
        start = state.length  # a token after `length` tokens is emitted at frame `length` at the earliest
        r = state.r[max(start - 1, 0):state.x.size(0) - 1]  # (T', 2, R), frames start-1 .. T-2
        ready = torch.logaddexp(r[:, 0], r[:, 1])  # (T', R): emitted by frame t, any token but the last may follow
        after_blank = r[:, 1]  # (T', R): the same, a blank last: the last token may follow (a repeat)
        if start == 0:  # before frame 0 the empty hypothesis is emitted with probability 1
            ready = after_blank = torch.cat([ready.new_zeros(1, ready.size(1)), ready])
        x = state.x[start:]  # (T - start, B, V)
        psi = _log_inner(ready, _gather_tokens(x, candidates, state.utterance))  # (R, C)
        x_last = _gather_tokens(x, state.last.clamp(min=0)[:, None], state.utterance)[:, :, 0]  # (T - start, R)
        repeat = torch.logsumexp(after_blank + x_last, dim=0)  # (R,): one token per row, in log space
        psi = torch.where(candidates == state.last[:, None], repeat[:, None], psi).clamp(min=LOG_ZERO)
        whole = torch.logaddexp(state.r[-1, 0], state.r[-1, 1])  # (R,): output == hypothesis
        psi = torch.where(candidates == self.eos, whole[:, None], psi)
        return psi - state.prefix[:, None], dataclasses.replace(state, candidates=candidates, candidate_prefix=psi)

    def select_state(self, state: CTCPrefixState, selection: Selection) -> CTCPrefixState:
        """The hypotheses selection.rows[i] + selection.tokens[i] (R',), each token one of its
        row's last candidates (see asr.scorer.Selection; the other fields are not needed here)."""
        rows, tokens = selection.rows, selection.tokens
        column = (state.candidates[rows] == tokens[:, None]).int().argmax(dim=1)  # (R',)
        prefix = state.candidate_prefix[rows].gather(1, column[:, None])[:, 0]
        utterance = state.utterance[rows]
        r = self._extend(state.x, utterance, state.r[:, :, rows], state.last[rows], tokens, state.length)
        return CTCPrefixState(state.x, utterance, r, prefix, tokens, state.length + 1)

    def final_score(self, state: CTCPrefixState) -> torch.Tensor:
        """(R,) zeros: ending is scored as the eos candidate."""
        return state.prefix.new_zeros(state.r.size(2))

    def _extend(self, x: torch.Tensor, utterance: torch.Tensor, r: torch.Tensor, last: torch.Tensor,
                tokens: torch.Tensor, length: int) -> torch.Tensor:
        """Forward variables (T, 2, R) of hypotheses (r (T, 2, R), last (R,), `length` tokens, of
        utterances (R,) = columns of x) extended by `tokens` (R,).

        The recursion over frames t (r_token[-1] = r_blank[-1] = log 0)
            r_token[t] = logaddexp(r_token[t-1], phi[t-1]) + x_token[t]
            r_blank[t] = logaddexp(r_token[t-1], r_blank[t-1]) + x_blank[t]
        (phi[t]: log P(the hypothesis is emitted by frame t and the token may follow); phi[-1] =
        log 1 for the empty hypothesis) is linear in probabilities, so it is solved for all frames
        at once with cumulative sums: r[t] = X[t] + logcumsumexp_{s<=t}(input[s] - X[s-1]), X the
        cumulative sum of the emissions, in float64 (X reaches thousands of nats)."""
        x_c = _gather_tokens(x, tokens[:, None], utterance)[:, :, 0].double()  # (T, R)
        x_b = x[:, :, self.blank].index_select(1, utterance).double()  # (T, R)
        r = r.double()
        phi = torch.logaddexp(r[:, 1], torch.where(tokens == last, LOG_ZERO, r[:, 0]))  # (T, R)
        r_token = _linear_recursion(_shift(phi, 0.0 if length == 0 else LOG_ZERO), x_c)
        r_blank = _linear_recursion(_shift(r_token, float("-inf")), x_b)
        return torch.stack([r_token, r_blank], dim=1).clamp(min=LOG_ZERO).to(x.dtype)


def _log_inner(ready: torch.Tensor, emit: torch.Tensor) -> torch.Tensor:
    """log sum_t exp(ready[t, r] + emit[t, r, c]) (R, C) of ready (T, R) and emit (T, R, C) <= 0:
    the probability that the token is first emitted at some frame t (ready by frame t - 1, emitted
    at t). Summed as probabilities in float64 with each row scaled by its largest ready value, so
    that only terms more than ~700 nats below that underflow (to -inf; the caller floors at LOG_ZERO):
    one pass of products over (T, R, C), where a log-space sum takes several of exp and log."""
    if emit.size(0) == 0:  # no frames left to emit in
        return emit.new_full(emit.shape[1:], float("-inf"))
    top = ready.max(dim=0).values  # (R,)
    weights = (ready - top).double().exp()  # (T, R) in [0, 1]
    total = torch.einsum("tr,trc->rc", weights, emit.double().exp())
    return (total.log() + top.double()[:, None]).to(emit.dtype)


def _shift(a: torch.Tensor, first: float) -> torch.Tensor:
    """a (T, R) one frame later: [first, a[0], .., a[T-2]]."""
    return torch.cat([a.new_full((1, a.size(1)), first), a[:-1]])


def _linear_recursion(inputs: torch.Tensor, emissions: torch.Tensor) -> torch.Tensor:
    """y (T, R) with y[t] = logaddexp(y[t-1], inputs[t]) + emissions[t], y[-1] = log 0."""
    total = emissions.cumsum(dim=0)  # X[t]
    return total + torch.logcumsumexp(inputs - _shift(total, 0.0), dim=0)


def _gather_tokens(x: torch.Tensor, tokens: torch.Tensor, utterance: torch.Tensor) -> torch.Tensor:
    """x (T, B, V), tokens (R, C) of rows of utterances (R,) -> (T, R, C) x[t, utterance[r], tokens[r, c]]."""
    frames, batch, vocab = x.shape
    flat = (utterance[:, None] * vocab + tokens).flatten()  # (R * C,)
    return x.reshape(frames, batch * vocab).index_select(1, flat).view(frames, *tokens.shape)


class PrefixBeams(NamedTuple):
    """What `prefix_beam_search` returns: N prefixes per utterance, best first."""

    tokens: torch.Tensor  # (B, N, L) long, -1 past each prefix's length
    lengths: torch.Tensor  # (B, N) long
    scores: torch.Tensor  # (B, N) log P(output == prefix) summed over the alignments kept; -inf: no prefix


def prefix_beam_search(log_probs: torch.Tensor, lengths: torch.Tensor, *, beam: int, max_lens: torch.Tensor,
                       blank: int = 0) -> PrefixBeams:
    """Frame-synchronous CTC prefix beam search over log_probs (B, T, V), lengths (B,), vectorized
    over utterances and prefixes (no host synchronization inside the frame loop).

    Keeps the `beam` most probable prefixes per utterance after every frame, each with its
    probability of ending in blank and in its last token; at each frame only the `beam` most
    probable non-blank tokens extend prefixes (the repeat of a prefix's own last token is always
    counted). A prefix that reaches another one in the beam is merged into it. Prefixes are cut
    at max_lens (B,) tokens. Tokens the caller must never emit (eos) get log-probability -inf.
    """
    x = padded_log_probs(log_probs, lengths, blank=blank, zero=float("-inf"))  # (T, B, V)
    frames, batch, vocab = x.shape
    n, k = beam, min(beam, vocab - 1)
    tried = x.index_fill(2, torch.tensor([blank], device=x.device), float("-inf")).topk(k, dim=2)  # (T, B, K)
    cap = max(int(max_lens.max()), 1) if batch else 1
    beams = _Beams.make(batch, n, cap, x)
    for t in range(frames):
        beams = beams.advance(x[t], tried.values[t], tried.indices[t], max_lens, blank)
    order = beams.total().sort(dim=1, descending=True)
    pick = order.indices
    tokens = beams.hist.gather(1, pick[..., None].expand(-1, -1, cap))
    return PrefixBeams(tokens, beams.lens.gather(1, pick), order.values)


class StreamingPrefixSearch:
    """`prefix_beam_search` over frames that arrive in pieces, without a length cap: after any
    frames, `prefixes()` is what prefix_beam_search returns on all of them so far (the same beams,
    frame by frame). For B streams that advance together (every frame valid for all of them).

        search = StreamingPrefixSearch(batch=1, beam=10, like=log_probs)
        search.feed(log_probs)                 # (B, t, V), eos already -inf
        best = search.prefixes().tokens[:, 0]  # a partial result
    """

    def __init__(self, *, batch: int, beam: int, like: torch.Tensor, blank: int = 0) -> None:
        self.beam, self.blank = beam, blank
        self._beams = _Beams.make(batch, beam, 1, like)
        self._no_cap = torch.full((batch,), torch.iinfo(torch.long).max, dtype=torch.long, device=like.device)
        self.frames = 0  # fed so far
        self.trailing_blanks = torch.zeros(batch, dtype=torch.long, device=like.device)  # (B,) frames since the
        # last one whose most probable token was not blank (endpointing)

    def feed(self, log_probs: torch.Tensor) -> None:
        """The next frames' log-probabilities (B, t, V)."""
        x = log_probs.transpose(0, 1)  # (t, B, V)
        k = min(self.beam, x.size(2) - 1)
        tried = x.index_fill(2, torch.tensor([self.blank], device=x.device), float("-inf")).topk(k, dim=2)
        beams = self._beams
        grow = self.frames + x.size(0) + 1 - beams.hist.size(2)  # a prefix gains a token a frame at most
        if grow > 0:
            beams = dataclasses.replace(beams, hist=torch.nn.functional.pad(beams.hist, (0, grow), value=-1))
        for t in range(x.size(0)):
            beams = beams.advance(x[t], tried.values[t], tried.indices[t], self._no_cap, self.blank)
        self._beams, self.frames = beams, self.frames + x.size(0)
        spoken = x.argmax(dim=2) != self.blank  # (t, B): a frame whose best token is not blank
        since = spoken.flip(0).int().argmax(dim=0)  # (B,) frames after the last spoken one
        self.trailing_blanks = torch.where(spoken.any(dim=0), since, self.trailing_blanks + x.size(0))

    def prefixes(self) -> PrefixBeams:
        """The beam so far, best first (prefix_beam_search's result)."""
        beams = self._beams
        order = beams.total().sort(dim=1, descending=True)
        tokens = beams.hist.gather(1, order.indices[..., None].expand(-1, -1, beams.hist.size(2)))
        return PrefixBeams(tokens, beams.lens.gather(1, order.indices), order.values)


@dataclass(frozen=True)
class _Beams:
    """The prefixes of `prefix_beam_search` (B, N each) after some frames."""

    pb: torch.Tensor  # (B, N) log P(prefix, last frame blank)
    pnb: torch.Tensor  # (B, N) log P(prefix, last frame its last token)
    last: torch.Tensor  # (B, N) long, last token, -1 when empty
    lens: torch.Tensor  # (B, N) long, tokens
    hashes: torch.Tensor  # (B, N) int64 hash of the tokens
    hist: torch.Tensor  # (B, N, L) long, the tokens, -1 past lens

    @staticmethod
    def make(batch: int, n: int, cap: int, like: torch.Tensor) -> _Beams:
        """The empty prefix with probability 1 in slot 0; the other slots are dead (-inf)."""
        pb = torch.full((batch, n), float("-inf"), dtype=like.dtype, device=like.device)
        pb[:, 0] = 0.0
        ids = torch.zeros((batch, n), dtype=torch.long, device=like.device)
        hist = torch.full((batch, n, cap), -1, dtype=torch.long, device=like.device)
        return _Beams(pb, torch.full_like(pb, float("-inf")), ids - 1, ids, ids.clone(), hist)

    def total(self) -> torch.Tensor:
        return torch.logaddexp(self.pb, self.pnb)

    def advance(self, x: torch.Tensor, values: torch.Tensor, tokens: torch.Tensor, max_lens: torch.Tensor,
                blank: int) -> _Beams:
        """One frame: x (B, V) its log-probabilities, tokens / values (B, K) its best non-blank tokens."""
        batch, n = self.pb.shape
        k = tokens.size(1)
        total = self.total()
        stay_b = total + x[:, blank, None]  # (B, N): the frame is blank
        repeat_lp = x.gather(1, self.last.clamp(min=0)).masked_fill(self.last < 0, float("-inf"))
        stay_nb = self.pnb + repeat_lp  # (B, N): the frame repeats the last token
        c = tokens[:, None, :]  # (B, 1, K)
        ext = torch.where(c == self.last[..., None], self.pb[..., None], total[..., None]) + values[:, None, :]
        ext = ext.masked_fill((self.lens >= max_lens[:, None])[..., None], float("-inf"))  # (B, N, K)
        ext_hash = self.hashes[..., None] * _HASH_PRIME + c + 1  # (B, N, K)
        # an extension equal to a live prefix of the beam adds its probability there and goes
        same = ((ext_hash.view(batch, -1, 1) == self.hashes[:, None, :])
                & ((self.lens + 1).repeat_interleave(k, dim=1)[..., None] == self.lens[:, None, :])
                & (total > float("-inf"))[:, None, :])  # (B, N * K, N)
        stay_nb = torch.logaddexp(stay_nb, ext.view(batch, -1, 1).masked_fill(~same, float("-inf")).logsumexp(dim=1))
        ext = ext.view(batch, -1).masked_fill(same.any(dim=2), float("-inf"))  # (B, N * K)
        cand_pb = torch.cat([stay_b, torch.full_like(ext, float("-inf"))], dim=1)  # (B, N + N * K)
        cand_pnb = torch.cat([stay_nb, ext], dim=1)
        pick = torch.logaddexp(cand_pb, cand_pnb).topk(n, dim=1).indices  # (B, N)
        return self._take(pick, cand_pb, cand_pnb, tokens, ext_hash.view(batch, -1))

    def _take(self, pick: torch.Tensor, cand_pb: torch.Tensor, cand_pnb: torch.Tensor, tokens: torch.Tensor,
              ext_hash: torch.Tensor) -> _Beams:
        """The beam of candidates `pick` (B, N): index < N stays prefix `index`, else extends
        prefix (index - N) // K by its token (index - N) % K."""
        n, k = self.pb.size(1), tokens.size(1)
        pb, pnb = cand_pb.gather(1, pick), cand_pnb.gather(1, pick)
        ext_index = (pick - n).clamp(min=0)  # (B, N)
        parent = torch.where(pick >= n, ext_index // k, pick)
        is_ext = (pick >= n) & (torch.logaddexp(pb, pnb) > float("-inf"))  # a dead pick copies its parent
        token = torch.where(is_ext, tokens.gather(1, ext_index % k), -1)
        hist = self.hist.gather(1, parent[..., None].expand_as(self.hist))  # (B, N, L)
        pos = self.lens.gather(1, parent).clamp(max=hist.size(2) - 1)[..., None]  # (B, N, 1)
        hist.scatter_(2, pos, torch.where(is_ext[..., None], token[..., None], hist.gather(2, pos)))
        return _Beams(
            pb, pnb,
            torch.where(is_ext, token, self.last.gather(1, parent)),
            self.lens.gather(1, parent) + is_ext.long(),
            torch.where(is_ext, ext_hash.gather(1, ext_index), self.hashes.gather(1, parent)),
            hist,
        )
