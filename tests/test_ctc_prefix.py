"""The CTC prefix scorer and CTC prefix beam search against brute-force sums over all alignments."""
from __future__ import annotations

import functools
import itertools
import math

import pytest
import torch

from asr.ctc_prefix import LOG_ZERO, CTCPrefixScorer, prefix_beam_search
from asr.scorer import Selection

BLANK, EOS = 0, 4  # vocabulary: blank, three tokens 1..3, eos
V = 5


@functools.cache
def _alignments(frames: int, vocab: int) -> tuple[torch.Tensor, list[tuple[int, ...]]]:
    """Every alignment (M, frames) over `vocab` labels and its collapsed output."""
    rows = list(itertools.product(range(vocab), repeat=frames))
    outputs = []
    for row in rows:
        merged = [label for i, label in enumerate(row) if i == 0 or label != row[i - 1]]
        outputs.append(tuple(label for label in merged if label != BLANK))
    return torch.tensor(rows, dtype=torch.long).view(len(rows), frames), outputs


def output_probs(log_probs: torch.Tensor) -> dict[tuple[int, ...], float]:
    """P(collapsed output == y) for every y, summing exp(log-prob) of every alignment: (T, V) float64."""
    frames, vocab = log_probs.shape
    rows, outputs = _alignments(frames, vocab)
    lp = log_probs.gather(1, rows.T).sum(dim=0) if frames else torch.zeros(1, dtype=torch.float64)
    probs: dict[tuple[int, ...], float] = {}
    for y, p in zip(outputs or [()], lp.exp().tolist()):
        probs[y] = probs.get(y, 0.0) + p
    return probs


def prefix_prob(probs: dict[tuple[int, ...], float], h: tuple[int, ...]) -> float:
    return sum(p for y, p in probs.items() if y[: len(h)] == h)


def random_log_probs(batch: int, frames: int, vocab: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (2.0 * torch.randn(batch, frames, vocab, generator=g, dtype=torch.float64)).log_softmax(dim=-1)


def assert_log_close(score: float, prob: float, what: str) -> None:
    if prob == 0.0:
        assert score <= LOG_ZERO / 2, what
    else:
        assert math.isclose(score, math.log(prob), rel_tol=1e-9, abs_tol=1e-9), (what, score, math.log(prob))


@pytest.mark.parametrize("seed", [0, 1])
def test_prefix_scores_equal_brute_force(seed):
    """Every candidate's prefix probability (and, for eos, the whole-output probability) equals
    the brute-force sum over alignments, along two hypotheses per utterance (with repeats),
    through reorders of rows and an utterance leaving the batch; lengths 7, 4, 1, 0 frames."""
    lengths = [7, 4, 1, 0]
    log_probs = random_log_probs(len(lengths), 7, V, seed)
    exact = [output_probs(log_probs[b, :n]) for b, n in enumerate(lengths)]
    scorer = CTCPrefixScorer(lambda m: m, eos=EOS, blank=BLANK)
    state = scorer.init_state(log_probs, torch.tensor(lengths), group=2)
    utts = list(range(len(lengths)))  # utterance of each group of 2 rows
    hyps = [() for _ in range(2 * len(utts))]
    candidates = torch.tensor([[1, 2, 3, EOS]] * len(hyps))
    for step in range(4):
        gains, state = scorer.score_partial(state, candidates)
        psi = state.prefix[:, None] + gains
        for row, h in enumerate(hyps):
            probs = exact[utts[row // 2]]
            for col, c in enumerate(candidates[row].tolist()):
                want = probs.get(h, 0.0) if c == EOS else prefix_prob(probs, h + (c,))
                assert_log_close(psi[row, col].item(), want, f"step {step} row {row} {h} + {c}")
        # next: swap the two rows of each utterance, the first repeating its last token, the
        # second appending another one; after step 1 utterance 1 leaves
        keep = [u for i, u in enumerate(utts) if not (step == 1 and i == 1)]
        rows = [2 * utts.index(u) + j for u in keep for j in (1, 0)]
        tokens = [(hyps[r][-1] if hyps[r] else 1) if i % 2 == 0 else (hyps[r][-1] % 3 + 1 if hyps[r] else 2)
                  for i, r in enumerate(rows)]
        state = scorer.select_state(state, Selection.of(torch.tensor(rows), torch.tensor(tokens), 2))
        hyps = [hyps[r] + (t,) for r, t in zip(rows, tokens)]
        utts, candidates = keep, candidates[: len(rows)]
        assert state.utterance.tolist() == [u for u in keep for _ in (0, 1)] and state.r.size(2) == len(rows)
    assert scorer.final_score(state).tolist() == [0.0] * len(hyps)


def test_gains_telescope_to_whole_sequence_probability():
    """Summed gains of a path ending in eos = log P(output == path), as ctc_loss computes it."""
    log_probs = random_log_probs(1, 30, V, 3).float()
    scorer = CTCPrefixScorer(lambda m: m, eos=EOS, blank=BLANK)
    state = scorer.init_state(log_probs, torch.tensor([30]), group=1)
    path, total = [3, 1, 1, 2, 3, EOS], 0.0
    for token in path:
        gains, state = scorer.score_partial(state, torch.tensor([[1, 2, 3, EOS]]))
        total += gains[0, [1, 2, 3, EOS].index(token)].item()
        if token != EOS:
            state = scorer.select_state(state, Selection.of(torch.tensor([0]), torch.tensor([token]), 1))
    nll = torch.nn.functional.ctc_loss(log_probs.transpose(0, 1), torch.tensor([path[:-1]]), torch.tensor([30]),
                                       torch.tensor([5]), blank=BLANK, reduction="sum")
    assert total == pytest.approx(-nll.item(), abs=1e-4)


@pytest.mark.parametrize("frames", [1, 3, 5])
def test_prefix_beam_search_without_pruning_is_exact(frames):
    """With a beam that holds every possible output, the n-best are exactly the most probable
    outputs with their brute-force probabilities; max_lens drops the longer outputs."""
    vocab = 4  # blank, tokens 1, 2, eos 3 (never emitted: -inf)
    log_probs = random_log_probs(2, frames, vocab, frames)
    log_probs[..., 3] = float("-inf")
    lengths = torch.tensor([frames, max(frames - 2, 0)])
    for max_len in (frames, 2):
        found = prefix_beam_search(log_probs, lengths, beam=64, max_lens=torch.tensor([max_len, max_len]), blank=0)
        for b in range(2):
            exact = {y: p for y, p in output_probs(log_probs[b, : lengths[b], :3]).items() if len(y) <= max_len}
            got = {tuple(found.tokens[b, i, : found.lengths[b, i]].tolist()): s
                   for i, s in enumerate(found.scores[b].tolist()) if s > float("-inf")}
            assert set(got) == {y for y, p in exact.items() if p > 0}
            for y, score in got.items():
                assert math.isclose(score, math.log(exact[y]), rel_tol=1e-9), y
            assert found.scores[b].tolist() == sorted(found.scores[b].tolist(), reverse=True)


def test_prefix_beam_search_batched_equals_alone():
    log_probs = random_log_probs(3, 40, 12, 7).float()
    lengths, max_lens = torch.tensor([40, 25, 9]), torch.tensor([40, 10, 9])
    batched = prefix_beam_search(log_probs, lengths, beam=4, max_lens=max_lens)
    for b in range(3):
        n = int(lengths[b])
        alone = prefix_beam_search(log_probs[b:b + 1, :n], lengths[b:b + 1], beam=4, max_lens=max_lens[b:b + 1])
        assert torch.allclose(alone.scores[0], batched.scores[b], atol=1e-5)
        assert alone.lengths[0].tolist() == batched.lengths[b].tolist()
        width = alone.tokens.size(2)
        assert alone.tokens[0].tolist() == batched.tokens[b, :, :width].tolist()
        assert (batched.lengths[b] <= max_lens[b]).all()
