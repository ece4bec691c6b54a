"""Decoding: greedy and beam search with the cached attention decoder, joint CTC/attention scoring,
CTC greedy search, and CTC prefix beam search with attention rescoring.

Shape legend: B utterances, N hypotheses per utterance (beam), R = B * N rows (utterance b owns
rows b*N .. b*N + N - 1; greedy: N = 1, R = the utterances not finished), K pre-beam tokens per
row, C = K + 1 candidates per row (the pre-beam, then eos), V vocabulary, T encoder frames,
L tokens.

Every search takes the encoder output (memory (B, T, d), memory_lens (B,)); `decode_memory` and
`search_nbest` return, for each utterance in batch order, its n-best hypotheses, best first;
`search` the best one (and runs the encoder first). The score of a hypothesis y (tokens without
sos / eos) of the beam searches is

    (1 - ctc_weight) * log P_att(y, eos) + ctc_weight * log P_ctc(y) + length_bonus * len(y)

(attention: the decoder's log-probabilities of y's tokens and of the eos after them; CTC: of the
output being exactly y, summed over alignments). An utterance gets at most `max_lengths` tokens,
floor(max_len_ratio * encoder frames) and, when the model knows the label rate r of its training
data (tokens per second, ModelConfig.tokens_per_second), ceil(max_rate_factor * r * seconds) +
RATE_SLACK: a model that fails to end (a degenerate or badly matched one) then stops at a few
times the length it was trained on rather than at one token per encoder frame. A hypothesis cut
there ends without being charged for an eos (as in ESPnet and in greedy search), so its terms are
log P_att(y) and the CTC prefix probability of y. A decoding task (asr.decoding) adds its own
scorers to beam search by name, with their weights (`Scorers`): a lexicon's constraint, a word
LM fused into the search; LM rescoring of the ended beam happens there too, after the search.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from asr.ctc_prefix import CTCPrefixScorer, PrefixBeams, prefix_beam_search
from asr.inference import DecoderState, InferenceModel
from asr.scorer import CacheScorer, CountingScorer, FullScorer, PartialScorer, Selection
from asr.tokens import BLANK

MODES = ("attention", "greedy", "ctc_greedy", "ctc_rescore")  # keys of SEARCHES

__all__ = [
    "MODES", "RATE_SLACK", "SEARCHES", "BeamSearch", "DecoderScorer", "Hypothesis", "Scorers", "SearchOptions",
    "attention_greedy", "beam_search", "check_fields", "ctc_greedy", "ctc_rescore", "decode_memory", "length_limits",
    "max_lengths", "search", "search_nbest", "teacher_forced_scores",
]


@dataclass(frozen=True)
class SearchOptions:
    """How to search; validated once, here. The defaults are the recommended decoding: joint
    CTC/attention beam search, beam 10. `greedy` and `ctc_greedy` read only the length limits.
    asr.decoding.DecodingOptions adds what a decoding task does around the search (lexicon, LM)."""

    mode: str = "attention"  # attention: beam search, joint with CTC when ctc_weight > 0; greedy: the
    # decoder's best token at each step (what training validates with); ctc_greedy: the best CTC
    # path; ctc_rescore: CTC prefix beam search, its beam_size prefixes rescored by the decoder
    beam_size: int = 10
    ctc_weight: float = 0.3  # weight of the CTC score; the decoder's is 1 - ctc_weight
    length_bonus: float = 0.0  # added to the score per output token (eos not counted)
    max_len_ratio: float = 1.0  # at most floor(ratio * encoder frames) tokens per utterance
    max_rate_factor: float = 2.0  # and at most ceil(factor * training label rate * seconds) + RATE_SLACK
    # when the model knows that rate; 0 = no such cap
    pre_beam_ratio: float = 1.5  # CTC scores the int(ratio * beam_size) best tokens of the decoder + eos
    nbest: int = 1  # hypotheses returned per utterance, at most beam_size

    def __post_init__(self) -> None:
        checks = (
            ("mode", self.mode in MODES, f"must be one of {', '.join(MODES)}"),
            ("beam_size", self.beam_size >= 1, "must be at least 1"),
            ("ctc_weight", 0.0 <= self.ctc_weight <= 1.0, "must be in [0, 1]"),
            ("max_len_ratio", self.max_len_ratio > 0, "must be positive"),
            ("max_rate_factor", self.max_rate_factor == 0 or self.max_rate_factor >= 1, "must be 0 (off) or >= 1"),
            ("pre_beam_ratio", self.pre_beam_ratio >= 1.0, "must be at least 1"),
            ("nbest", 1 <= self.nbest <= self.beam_size, f"must be in [1, beam_size = {self.beam_size}]"),
        )
        check_fields(self, checks)


def check_fields(options: Any, checks: tuple[tuple[str, bool, str], ...]) -> None:
    """ValueError "decoding.NAME = VALUE REASON" for the first (name, ok, reason) not ok."""
    for name, ok, reason in checks:
        if not ok:
            raise ValueError(f"decoding.{name} = {getattr(options, name)!r} {reason}")


@dataclass(frozen=True)
class Hypothesis:
    """One decoded token sequence (no sos / eos / blank) and its score (see the module docstring;
    greedy: the decoder's log-probability of the tokens and of the eos when one was emitted;
    ctc_greedy: the best path's)."""

    tokens: tuple[int, ...]
    score: float


RATE_SLACK = 10  # tokens allowed beyond the label-rate cap: short utterances, bursts of fast speech


def max_lengths(memory_lens: torch.Tensor, ratio: float, *, tokens_per_frame: float = 0.0,
                rate_factor: float = 2.0) -> torch.Tensor:
    """Maximum tokens per utterance (B,) long: floor(ratio * encoder frames), and, given the
    training label rate in tokens per encoder frame (0: unknown; rate_factor 0: no cap), at most
    ceil(rate_factor * tokens_per_frame * frames) + RATE_SLACK."""
    frames = memory_lens.double()
    limits = (frames * ratio).floor()
    if tokens_per_frame > 0 and rate_factor > 0:
        limits = torch.minimum(limits, (frames * (rate_factor * tokens_per_frame)).ceil() + RATE_SLACK)
    return limits.long()


def length_limits(model: InferenceModel, memory_lens: torch.Tensor, ratio: float, rate_factor: float) -> torch.Tensor:
    """`max_lengths` (B,) with the model's training label rate."""
    config = model.config
    return max_lengths(memory_lens, ratio, tokens_per_frame=config.tokens_per_second / config.frames_per_second,
                       rate_factor=rate_factor)


# ---------------------------------------------------------------------------------------------
# which hypotheses go on, and where


def _fill_holes(stay: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """An order of the staying entries of stay (B,) bool that moves as few as possible: those of
    the first K = stay.sum() positions stay where they are, the others fill the holes there in
    order. Returns (order (B,): order[:K] the entries kept, K ()), both on the device."""
    kept = stay.sum()
    if stay.numel() == 1:  # it stays or not: nothing moves
        return torch.zeros(1, dtype=torch.long, device=stay.device), kept
    positions = torch.arange(stay.numel(), device=stay.device)
    below = positions < kept
    holes = below & ~stay
    behind = torch.argsort((below | ~stay).to(torch.int8), stable=True)  # the staying ones past K first
    return torch.where(holes, behind[holes.cumsum(0) - 1], positions), kept  # (index -1: a non-hole, unused)


def _stable_slots(parents: torch.Tensor) -> torch.Tensor:
    """Where the N hypotheses chosen for each utterance go: parents (B, N) the row (within its
    utterance) each continues, best first -> slot_of (B, N), slot s holding hypothesis slot_of[b, s].

    The best child of each parent takes the parent's own row; the other children take, in order,
    the rows of the parents without children. So a hypothesis moves only when it takes over the
    row of a dead branch, and no row is both read from and written to."""
    batch, n = parents.shape
    hypothesis = torch.arange(n, device=parents.device).expand(batch, n)
    best_child = torch.full_like(parents, n).scatter_reduce_(1, parents, hypothesis, "amin")  # (B, N) per row
    first = best_child.gather(1, parents) == hypothesis  # (B, N)
    free = torch.argsort((best_child < n).to(torch.int8), dim=1, stable=True)  # rows without a child first
    slot = torch.where(first, parents, free.gather(1, ((~first).cumsum(dim=1) - 1).clamp(min=0)))
    return torch.empty_like(slot).scatter_(1, slot, hypothesis)


# ---------------------------------------------------------------------------------------------
# scorers (the protocol: asr.scorer)


@dataclass(frozen=True)
class Scorers:
    """Scorers a decoding task adds to beam search, beside the decoder ("decoder") and the CTC
    prefix scorer ("ctc"), by name: each one's output is multiplied by its weight and added to the
    candidates' scores. `constraints` name full scorers of 0 (allowed) or -inf (not) per token that
    also keep forbidden tokens out of the pre-beam (a lexicon)."""

    full: Mapping[str, FullScorer] = field(default_factory=dict)
    partial: Mapping[str, PartialScorer] = field(default_factory=dict)
    weights: Mapping[str, float] = field(default_factory=dict)
    constraints: tuple[str, ...] = ()
    pre_beam: tuple[str, ...] = ()  # full scorers whose weighted scores join the decoder's in ranking
    # the pre-beam's tokens (a neural LM), so that they can offer a token the decoder ranks low

    def __bool__(self) -> bool:
        return bool(self.full or self.partial)


class DecoderScorer(CacheScorer):
    """The model's attention decoder as a FullScorer and a CountingScorer; its state is the model's
    DecoderState (asr.inference: cross-attention keys and values projected once per utterance,
    shared by the N rows of the utterance), made for `max_len` steps."""

    def __init__(self, model: InferenceModel, max_len: int = 64) -> None:
        self.model, self.max_len = model, max_len

    def init_state(self, memory: torch.Tensor, memory_lens: torch.Tensor, group: int) -> DecoderState:
        return self.model.init_cache(memory, memory_lens, rows=memory.size(0) * group, capacity=self.max_len)

    def score(self, state: DecoderState, last_tokens: torch.Tensor) -> tuple[torch.Tensor, DecoderState]:
        return self.model.step(last_tokens, state)

    def final_score(self, state: DecoderState) -> torch.Tensor:
        return torch.zeros(state.rows, device=self.model.device)  # ending is scored as the eos token


# ---------------------------------------------------------------------------------------------
# beam search


class BeamSearch:
    """Label-synchronous beam search over B utterances x N hypotheses at once.

    Each step: the full scorers score every token of the R hypotheses; the best K tokens of the
    `pre_beam` scorer (of the weighted sum of the `pre_beam` scorers, when several; eos and
    `excluded` aside, and those a `constraints` scorer gives -inf) and eos are each row's
    candidates; the partial scorers score those; weighted sums (weights by scorer name) plus
    `length_bonus` per token rank the N * C candidates of each utterance. Eos candidates
    among an utterance's best N end (kept, the best N per utterance); the best N others continue,
    each in its parent's row where it can (see _stable_slots: the order of the rows of an
    utterance means nothing). An utterance leaves the batch when it has N ended hypotheses, when
    it reached its maximum length (all cut), or when (with length_bonus <= 0, so scores only fall)
    its nbest-th ended hypothesis beats every running one; the utterances behind fill its rows.
    One host synchronization per step: how many utterances and rows stay and move.
    """

    def __init__(self, *, full: dict[str, FullScorer], partial: dict[str, PartialScorer], weights: dict[str, float],
                 pre_beam: str | tuple[str, ...], beam_size: int, pre_beam_size: int, eos: int,
                 excluded: tuple[int, ...] = (), length_bonus: float = 0.0, nbest: int = 1,
                 constraints: tuple[str, ...] = ()) -> None:
        self.full, self.partial, self.weights, self.constraints = full, partial, weights, constraints
        self.pre_beam = (pre_beam,) if isinstance(pre_beam, str) else tuple(pre_beam)
        self.beam, self.pre_beam_size, self.eos = beam_size, pre_beam_size, eos
        self.excluded = (eos, *excluded)  # never in the pre-beam (eos is every row's last candidate)
        self.length_bonus, self.nbest = length_bonus, nbest
        self.counting = {name: scorer for name, scorer in {**full, **partial}.items()
                         if isinstance(scorer, CountingScorer)}  # the scorers that add to the step's transfer

    @torch.no_grad()
    def __call__(self, memory: torch.Tensor, memory_lens: torch.Tensor,
                 limits: torch.Tensor) -> list[tuple[Hypothesis, ...]]:
        """n-best of each utterance; limits (B,) long: the most tokens each may get."""
        longest, shortest = torch.stack([limits.max(), limits.min()]).tolist()
        run = _Running.start(self, memory, memory_lens, limits, longest)
        ended = _Ended(memory.size(0), self.beam, run.history.size(1), memory.device)
        excluded = torch.tensor(self.excluded, device=memory.device)
        for t in range(longest + 1):
            cut = t >= shortest  # an utterance may be at its length limit (before, none is: skip the masks)
            candidates, scores = self._expand(run, t, excluded, cut)  # (R, C) each
            ended.add(run, candidates, scores, self.beam)
            best = self._best_running(scores)  # (B, N) each
            stay = self._staying(run, ended, best.values, t, cut)
            chosen = self._select(run, stay, best, candidates)  # the step's host sync
            if chosen is None:
                break
            run = self._advance(run, *chosen)
        return ended.hypotheses(self.nbest)

    def _expand(self, run: _Running, t: int, excluded: torch.Tensor, cut: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """Candidates (R, C) (pre-beam tokens, eos last) and their total scores (R, C); `cut`: an
        utterance may have reached its length limit."""
        full = {}
        for name, scorer in self.full.items():
            full[name], run.states[name] = scorer.score(run.states[name], run.last)  # (R, V)
        if len(self.pre_beam) == 1:
            pre = full[self.pre_beam[0]]
        else:
            pre = sum(self.weights[name] * full[name] for name in self.pre_beam)
        pre = pre.index_fill(1, excluded, float("-inf"))
        for name in self.constraints:  # 0 or -inf
            pre = pre + full[name]
        top = pre.topk(self.pre_beam_size, dim=1)  # (R, K) each
        tokens = top.indices
        candidates = torch.cat([tokens, tokens.new_full((tokens.size(0), 1), self.eos)], dim=1)  # (R, C)
        scores = run.scores[:, None] + sum(self.weights[name] * lp.gather(1, candidates) for name, lp in full.items())
        # fewer usable tokens than K (a constraint's -inf, or excluded ones): the rest is filler, never chosen
        scores[:, :-1].masked_fill_(top.values == float("-inf"), float("-inf"))
        final = torch.zeros_like(run.scores)
        for name, scorer in self.partial.items():
            partial, run.states[name] = scorer.score_partial(run.states[name], candidates)
            scores = scores + self.weights[name] * partial
        for name, scorer in {**self.full, **self.partial}.items():
            final = final + self.weights[name] * scorer.final_score(run.states[name])
        scores[:, -1] += final
        if self.length_bonus:
            scores[:, :-1] += self.length_bonus
        if cut:
            at_limit = (run.limits <= t).repeat_interleave(self.beam)  # (R,): cut, without an eos charge
            scores[:, -1] = torch.where(at_limit, run.scores + final, scores[:, -1])
            scores[:, :-1].masked_fill_(at_limit[:, None], float("-inf"))
        return candidates, scores

    def _best_running(self, scores: torch.Tensor) -> torch.return_types.topk:
        """The best N non-eos candidates of each utterance: values / indices (B, N) into its N * C."""
        scores = scores.clone()
        scores[:, -1] = float("-inf")
        return scores.view(-1, self.beam * scores.size(1)).topk(self.beam, dim=1)

    def _staying(self, run: _Running, ended: _Ended, best: torch.Tensor, t: int, cut: bool) -> torch.Tensor:
        """(B,) bool: the utterances that go on after step t (`cut`: one may be at its length limit)."""
        done_scores = ended.scores[run.utterances]  # (B, N), best first
        full = (done_scores > float("-inf")).sum(dim=1) >= self.beam
        done = full | (best[:, 0] == float("-inf"))
        if cut:
            done |= run.limits <= t
        if self.length_bonus <= 0:
            done |= done_scores[:, self.nbest - 1] >= best[:, 0]
        return ~done

    def _select(self, run: _Running, stay: torch.Tensor, best: torch.return_types.topk,
                candidates: torch.Tensor) -> tuple[Selection, dict[str, tuple[int, ...]], torch.Tensor] | None:
        """The best N running candidates (best (B, N) into each utterance's N * C candidates) of
        the staying utterances (stay (B,) bool): their Selection, the counting scorers' counts and
        the scores (R',); None when no utterance stays. Makes the step's one host synchronization:
        how many utterances stay, and the numbers the counting scorers asked for."""
        n, c = self.beam, candidates.size(1)
        slot_of = _stable_slots(best.indices // c)  # (B, N)
        index = best.indices.gather(1, slot_of)  # (B, N), by the row (within the utterance) each goes to
        parent, values = index // c, best.values.gather(1, slot_of)  # (B, N) each: the row each continues
        tokens = candidates.view(-1, n * c).gather(1, index)  # (B, N)
        order, kept = _fill_holes(stay)  # (B,) the staying utterances first; the utterances behind fill holes
        proposal = Selection((order[:, None] * n + parent[order]).flatten(), tokens[order].flatten(), order)
        asked = {name: scorer.selection_counts(run.states[name], proposal, kept)
                 for name, scorer in self.counting.items()}
        numbers = torch.cat([kept.view(1), *asked.values()]).tolist()  # the step's host sync
        count = numbers[0]
        if count == 0:
            return None
        counts, at = {}, 1
        for name, asked_counts in asked.items():
            counts[name], at = tuple(numbers[at:at + asked_counts.numel()]), at + asked_counts.numel()
        selection = Selection(proposal.rows[:count * n], proposal.tokens[:count * n], order[:count])
        return selection, counts, values[order[:count]].flatten()

    def _advance(self, run: _Running, selection: Selection, counts: dict[str, tuple[int, ...]],
                 scores: torch.Tensor) -> _Running:
        """The running hypotheses after this step's choices (scores (R',)); each counting scorer
        gets its counts in its Selection."""
        for name, scorer in {**self.full, **self.partial}.items():
            run.states[name] = scorer.select_state(run.states[name], selection._replace(counts=counts.get(name, ())))
        history = run.history[selection.rows]
        history[:, run.length] = selection.tokens
        return _Running(run.states, scores, selection.tokens, history, run.length + 1,
                        run.utterances[selection.utterances], run.limits[selection.utterances])


@dataclass
class _Running:
    """The hypotheses being extended: R = B * N rows of the B utterances still searched."""

    states: dict[str, Any]  # scorer name -> its state
    scores: torch.Tensor  # (R,) total score so far
    last: torch.Tensor  # (R,) long, last token (sos first)
    history: torch.Tensor  # (R, Lmax) long, the tokens, -1 past `length`
    length: int  # tokens of every hypothesis
    utterances: torch.Tensor  # (B,) long, index in the original batch
    limits: torch.Tensor  # (B,) long, most tokens

    @staticmethod
    def start(search: BeamSearch, memory: torch.Tensor, memory_lens: torch.Tensor, limits: torch.Tensor,
              longest: int) -> _Running:
        """The empty hypothesis, once per utterance: the N - 1 other rows start dead (-inf)."""
        batch, n = memory.size(0), search.beam
        states = {name: scorer.init_state(memory, memory_lens, n)
                  for name, scorer in {**search.full, **search.partial}.items()}
        scores = torch.full((batch, n), float("-inf"), device=memory.device)
        scores[:, 0] = 0.0
        last = torch.full((batch * n,), search.eos, dtype=torch.long, device=memory.device)  # sos = eos
        history = torch.full((batch * n, max(longest, 1)), -1, dtype=torch.long, device=memory.device)
        return _Running(states, scores.flatten(), last, history, 0, torch.arange(batch, device=memory.device), limits)


class _Ended:
    """The best N ended hypotheses of every utterance of the original batch, on the device."""

    def __init__(self, batch: int, n: int, max_len: int, device: torch.device) -> None:
        self.scores = torch.full((batch, n), float("-inf"), device=device)  # (B0, N), best first
        self.tokens = torch.full((batch, n, max_len), -1, dtype=torch.long, device=device)  # (B0, N, Lmax)

    def add(self, run: _Running, candidates: torch.Tensor, scores: torch.Tensor, n: int) -> None:
        """Keep the eos candidates that are among their utterance's best N candidates."""
        c = candidates.size(1)
        top = scores.view(-1, n * c).topk(n, dim=1)  # (B, N)
        ended = (top.indices % c == c - 1) & (top.values > float("-inf"))
        new_scores = top.values.masked_fill(~ended, float("-inf"))
        history = run.history.view(-1, n, run.history.size(1))  # (B, N, Lmax)
        new_tokens = history.gather(1, (top.indices // c)[..., None].expand_as(history))
        all_scores = torch.cat([self.scores[run.utterances], new_scores], dim=1)  # (B, 2N)
        all_tokens = torch.cat([self.tokens[run.utterances], new_tokens], dim=1)  # (B, 2N, Lmax)
        best = all_scores.topk(n, dim=1)
        self.scores[run.utterances] = best.values
        self.tokens[run.utterances] = all_tokens.gather(1, best.indices[..., None].expand_as(new_tokens))

    def hypotheses(self, nbest: int) -> list[tuple[Hypothesis, ...]]:
        return _nbest_lists(self.scores, self.tokens, nbest)


def _nbest_lists(scores: torch.Tensor, tokens: torch.Tensor, nbest: int) -> list[tuple[Hypothesis, ...]]:
    """The first `nbest` hypotheses with a finite score of each utterance: scores (B, N) best
    first, tokens (B, N, L) -1 padded. One transfer to the host."""
    out = []
    for row_scores, rows in zip(scores.tolist(), tokens.tolist()):
        found = tuple(Hypothesis(tuple(t for t in row if t >= 0), s)
                      for s, row in zip(row_scores[:nbest], rows) if s > float("-inf"))
        out.append(found or (Hypothesis((), float("-inf")),))
    return out


def beam_search(model: InferenceModel, memory: torch.Tensor, memory_lens: torch.Tensor,
                options: SearchOptions, scorers: Scorers | None = None) -> list[tuple[Hypothesis, ...]]:
    """Joint CTC/attention beam search (attention only when options.ctc_weight == 0; blank is
    then an ordinary token of the decoder, as in greedy search, else never a candidate), with the
    task's `scorers` besides (partial ones score the pre-beam's candidates; they do not widen it)."""
    eos, weight, scorers = model.config.eos, options.ctc_weight, scorers or Scorers()
    partial: dict[str, PartialScorer] = {}
    if weight > 0:
        partial["ctc"] = CTCPrefixScorer(model.ctc_log_probs, eos=eos, blank=BLANK)
    excluded = (BLANK,) if weight > 0 else ()
    pre_beam = options.beam_size if weight == 0 else int(options.pre_beam_ratio * options.beam_size)
    limits = length_limits(model, memory_lens, options.max_len_ratio, options.max_rate_factor)
    full: dict[str, FullScorer] = {"decoder": DecoderScorer(model, int(limits.max()) + 1), **scorers.full}
    search = BeamSearch(
        full=full, partial={**partial, **scorers.partial},
        weights={"decoder": 1.0 - weight, "ctc": weight, **scorers.weights},
        pre_beam=("decoder", *scorers.pre_beam), beam_size=options.beam_size,
        pre_beam_size=min(pre_beam, model.config.vocab_size - 1 - len(excluded)), eos=eos, excluded=excluded,
        length_bonus=options.length_bonus, nbest=options.nbest, constraints=scorers.constraints,
    )
    return search(memory, memory_lens, limits)


# ---------------------------------------------------------------------------------------------
# greedy searches


@torch.no_grad()
def attention_greedy(model: InferenceModel, memory: torch.Tensor, memory_lens: torch.Tensor, *,
                     max_len_ratio: float = 1.0, max_rate_factor: float = 2.0) -> list[Hypothesis]:
    """Greedy decoding with the cached decoder, all utterances at once.

    An utterance stops at eos or after length_limits(...) tokens (see SearchOptions), and leaves
    the batch then (the last rows fill its cache row). One host synchronization per step.
    """
    eos, batch = model.config.eos, memory.size(0)
    limits = length_limits(model, memory_lens, max_len_ratio, max_rate_factor)  # (B,)
    rows = (limits > 0).nonzero()[:, 0]  # (R,) utterance of each live row
    if rows.numel() == 0:
        return [Hypothesis((), 0.0) for _ in range(batch)]
    longest, shortest = torch.stack([limits.max(), limits[rows].min()]).tolist()
    tokens = limits.new_full((batch, longest), -1)  # (B, longest), -1 = not emitted
    scores = memory.new_zeros(batch, dtype=torch.float32)
    cache = model.init_cache(memory[rows], memory_lens[rows], rows=rows.numel(), capacity=longest)
    last = limits.new_full((rows.numel(),), model.config.sos)  # (R,)
    for t in range(longest):
        log_probs, cache = model.step(last, cache)  # (R, V)
        best_lp, last = log_probs.max(dim=-1)  # (R,)
        tokens[rows, t] = last
        scores[rows] += best_lp
        stay = last != eos  # (R,)
        if t + 1 >= shortest:  # a row may be at its length limit
            stay &= limits[rows] > t + 1
        order, kept = _fill_holes(stay)  # the staying rows first, those behind filling the holes
        asked = [cache.selection_counts(order, kept)] if rows.numel() > 1 else []  # one row stays or ends
        count, *counts = torch.cat([kept.view(1), *asked]).tolist()  # the step's host sync
        if count == 0:
            break
        if count < rows.numel():
            order = order[:count]
            rows, last, cache = rows[order], last[order], cache.select(order, counts)
    return [_hypothesis(row, eos, score) for row, score in zip(tokens.tolist(), scores.tolist())]


def _hypothesis(row: list[int], eos: int, score: float) -> Hypothesis:
    """Cut a row of emitted tokens (-1 = not emitted) at its first eos."""
    ended = row.index(eos) if eos in row else len(row)
    return Hypothesis(tuple(token for token in row[:ended] if token >= 0), score)


@torch.no_grad()
def ctc_greedy(model: InferenceModel, memory: torch.Tensor, memory_lens: torch.Tensor, *,
               max_len_ratio: float = 1.0, max_rate_factor: float = 2.0) -> list[Hypothesis]:
    """Best-path CTC decoding: the most likely token per frame, repeats merged, blanks removed,
    cut to length_limits(...) tokens (see SearchOptions)."""
    log_probs = model.ctc_log_probs(memory)  # (B, T, V)
    best_lp, best = log_probs.max(dim=-1)  # (B, T)
    valid = torch.arange(best.size(1), device=best.device) < memory_lens[:, None]  # (B, T)
    previous = torch.cat([best.new_full((best.size(0), 1), -1), best[:, :-1]], dim=1)
    emit = valid & (best != previous) & (best != BLANK)  # (B, T)
    scores = (best_lp * valid).sum(dim=1)
    limits = length_limits(model, memory_lens, max_len_ratio, max_rate_factor).tolist()
    best, emit = best.cpu(), emit.cpu()  # one transfer, then per-utterance selection on the host
    return [
        Hypothesis(tuple(row[keep].tolist()[:limit]), score)
        for row, keep, limit, score in zip(best, emit, limits, scores.tolist())
    ]


# ---------------------------------------------------------------------------------------------
# CTC prefix beam search + attention rescoring

_RESCORE_ELEMENTS = 1 << 26  # log-probabilities (rows x positions x V) per teacher-forced chunk


@torch.no_grad()
def ctc_rescore(model: InferenceModel, memory: torch.Tensor, memory_lens: torch.Tensor,
                options: SearchOptions) -> list[tuple[Hypothesis, ...]]:
    """CTC prefix beam search (beam_size prefixes per utterance), each prefix then scored by the
    teacher-forced decoder: (1 - ctc_weight) * attention + ctc_weight * CTC + length_bonus * len."""
    eos = model.config.eos
    log_probs = model.ctc_log_probs(memory).index_fill(2, torch.tensor([eos], device=memory.device), float("-inf"))
    limits = length_limits(model, memory_lens, options.max_len_ratio, options.max_rate_factor)
    beams = prefix_beam_search(log_probs, memory_lens, beam=options.beam_size, max_lens=limits, blank=BLANK)
    return rescore_prefixes(model, memory, memory_lens, beams, options)


def rescore_prefixes(model: InferenceModel, memory: torch.Tensor, memory_lens: torch.Tensor, beams: PrefixBeams,
                     options: SearchOptions) -> list[tuple[Hypothesis, ...]]:
    """The n-best of CTC prefixes (B, N) rescored by the teacher-forced decoder over their memory:
    (1 - ctc_weight) * attention + ctc_weight * CTC + length_bonus * len (`ctc_rescore`, and the
    streaming decoder at each endpoint)."""
    att = teacher_forced_scores(model, memory, memory_lens, beams.tokens, beams.lengths)  # (B, N)
    att = att.masked_fill((memory_lens == 0)[:, None], 0.0)  # no frames: the empty hypothesis scores 0
    w = options.ctc_weight
    scores = (1.0 - w) * att + w * beams.scores + options.length_bonus * beams.lengths
    scores = scores.masked_fill(beams.scores == float("-inf"), float("-inf"))
    order = scores.sort(dim=1, descending=True)
    tokens = beams.tokens.gather(1, order.indices[..., None].expand_as(beams.tokens))
    return _nbest_lists(order.values, tokens, options.nbest)


def teacher_forced_scores(model: InferenceModel, memory: torch.Tensor, memory_lens: torch.Tensor, tokens: torch.Tensor,
                          lengths: torch.Tensor) -> torch.Tensor:
    """log P_att(y, eos) (B, N) of N sequences per utterance: tokens (B, N, L) -1 padded, lengths (B, N).

    One teacher-forced decoder pass over the N sequences of several utterances at a time (the
    N share their utterance's cross-attention keys and values), in chunks of bounded size.
    """
    batch, n, width = tokens.shape
    sos = tokens.new_full((batch, n, 1), model.config.sos)
    inputs = torch.cat([sos, tokens], dim=2).view(batch * n, width + 1)  # sos y1 .. yL
    targets = torch.cat([tokens, tokens.new_full((batch, n, 1), -1)], dim=2)
    targets = targets.scatter(2, lengths[..., None], model.config.eos).view(batch * n, width + 1)  # y1 .. yL eos
    step = max(1, _RESCORE_ELEMENTS // (n * (width + 1) * model.config.vocab_size))  # utterances per chunk
    out = []
    for b in range(0, batch, step):
        rows = slice(b * n, (b + step) * n)
        log_probs = model.teacher_forced(inputs[rows], lengths.flatten()[rows] + 1, memory[b:b + step],
                                         memory_lens[b:b + step])  # (rows, L + 1, V)
        picked = log_probs.gather(2, targets[rows].clamp(min=0)[..., None])[..., 0]
        out.append(picked.masked_fill(targets[rows] < 0, 0.0).sum(dim=1))
    return torch.cat(out).view(batch, n)


# ---------------------------------------------------------------------------------------------
# entry points

def _greedy(model: InferenceModel, memory: torch.Tensor, memory_lens: torch.Tensor,
            options: SearchOptions) -> list[tuple[Hypothesis, ...]]:
    return [(h,) for h in attention_greedy(model, memory, memory_lens, max_len_ratio=options.max_len_ratio,
                                           max_rate_factor=options.max_rate_factor)]


def _ctc_greedy(model: InferenceModel, memory: torch.Tensor, memory_lens: torch.Tensor,
                options: SearchOptions) -> list[tuple[Hypothesis, ...]]:
    return [(h,) for h in ctc_greedy(model, memory, memory_lens, max_len_ratio=options.max_len_ratio,
                                     max_rate_factor=options.max_rate_factor)]


SEARCHES = {"attention": beam_search, "greedy": _greedy, "ctc_greedy": _ctc_greedy, "ctc_rescore": ctc_rescore}


@torch.no_grad()
def decode_memory(model: InferenceModel, memory: torch.Tensor, memory_lens: torch.Tensor,
                  options: SearchOptions, scorers: Scorers | None = None) -> list[tuple[Hypothesis, ...]]:
    """The n-best (at most options.nbest, best first) of each utterance of an encoder output;
    without encoder frames (input shorter than the subsampling's receptive field), the empty
    hypothesis with score 0. `scorers` (beam search only): what a decoding task adds (asr.decoding)."""
    task_fields = [name for name in ("lexicon", "lm") if getattr(options, name, "")]  # asr.decoding's
    if task_fields:
        raise ValueError(f"decoding.{task_fields[0]} needs a decoding task (asr.decoding.DecodingTask), "
                         "not the search alone")
    if scorers and options.mode != "attention":
        raise ValueError(f"decoding.mode = {options.mode!r}: scorers ({', '.join([*scorers.full, *scorers.partial])}) "
                         "apply to beam search (mode attention)")
    if memory.size(1) == 0:
        return [(Hypothesis((), 0.0),) for _ in range(memory.size(0))]
    if scorers:
        return beam_search(model, memory, memory_lens, options, scorers)
    return SEARCHES[options.mode](model, memory, memory_lens, options)


@torch.no_grad()
def search_nbest(model: InferenceModel, feats: torch.Tensor, feat_lens: torch.Tensor,
                 options: SearchOptions) -> list[tuple[Hypothesis, ...]]:
    """Encode feats (B, T, n_mels), feat_lens (B,) and search them as `options` say: the n-best
    of each utterance, best first (the search alone: a lexicon or an LM is asr.decoding.DecodingTask's).
    The model should be in eval mode."""
    memory, memory_lens = model.encode(feats, feat_lens)
    return decode_memory(model, memory, memory_lens, options)


@torch.no_grad()
def search(model: InferenceModel, feats: torch.Tensor, feat_lens: torch.Tensor,
           options: SearchOptions | None = None) -> list[Hypothesis]:
    """The best hypothesis of each utterance (options None: greedy attention decoding, what training
    validates with)."""
    return [nbest[0] for nbest in search_nbest(model, feats, feat_lens, options or SearchOptions(mode="greedy"))]
