"""Search against the model itself: beam 1 == greedy, batched == alone, scores == teacher-forced
log-probabilities + length term + CTC part, the maximum length, the options."""
from __future__ import annotations

import dataclasses
import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from host_syncs import HostSyncs  # tests/host_syncs.py

from asr.model import ASRModel, ModelConfig
from asr.scorer import CountingScorer, Selection
from asr.search import (
    RATE_SLACK,
    Hypothesis,
    Scorers,
    SearchOptions,
    _fill_holes,
    _stable_slots,
    decode_memory,
    length_limits,
    search,
    search_nbest,
    teacher_forced_scores,
)

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


TINY = ModelConfig(vocab_size=12, n_mels=80, conv_channels=8, d_model=32, n_heads=4, ffn_dim=64,
                   encoder_layers=1, decoder_layers=2, dropout=0.0)


def tiny_model(seed: int = 0, *, vocab: int = 12, sharpness: float = 4.0, dtype=torch.float64) -> ASRModel:
    """A random tiny model with peaked output distributions (scaled output layers), in eval mode."""
    torch.manual_seed(seed)
    model = ASRModel(dataclasses.replace(TINY, vocab_size=vocab)).eval()
    with torch.no_grad():
        model.decoder.output.weight.mul_(sharpness)
        model.ctc.weight.mul_(sharpness)
    return model.to(dtype)


def random_memory(model: ASRModel, lengths: list[int], seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Encoder output (B, T, d) in the model's dtype; frames past each length are random too,
    so that anything reading padding shows."""
    g = torch.Generator().manual_seed(seed)
    dtype = next(model.parameters()).dtype
    memory = torch.randn(len(lengths), max(lengths), model.config.d_model, generator=g, dtype=torch.float64)
    return memory.to(dtype), torch.tensor(lengths)


LENGTHS = [17, 9, 30, 4, 12]
GREEDY = SearchOptions(mode="greedy")
JOINT = SearchOptions(mode="attention", beam_size=4, ctc_weight=0.3, length_bonus=0.5, nbest=3)


def test_beam_size_one_equals_greedy():
    for seed in range(3):
        model = tiny_model(seed)
        memory, lens = random_memory(model, LENGTHS, seed)
        greedy = decode_memory(model, memory, lens, GREEDY)
        beam = decode_memory(model, memory, lens, SearchOptions(mode="attention", beam_size=1, ctc_weight=0.0))
        for (g,), (b,) in zip(greedy, beam):
            assert g.tokens == b.tokens
            assert g.score == pytest.approx(b.score, abs=1e-5)


@pytest.mark.parametrize("options", [
    SearchOptions(mode="attention", beam_size=4, ctc_weight=0.0, nbest=4),
    JOINT,
    SearchOptions(mode="attention", beam_size=3, ctc_weight=1.0, length_bonus=-0.2),
    SearchOptions(mode="ctc_rescore", beam_size=4, ctc_weight=0.4, nbest=2),
    GREEDY,
    SearchOptions(mode="ctc_greedy"),
], ids=["beam", "joint", "ctc-only", "ctc_rescore", "greedy", "ctc_greedy"])
def test_batched_equals_alone(options):
    """Every utterance gets the same n-best (tokens and scores to 1e-4) alone and in a batch."""
    model = tiny_model(1)
    memory, lens = random_memory(model, LENGTHS, 1)
    batched = decode_memory(model, memory, lens, options)
    assert len(batched) == len(LENGTHS)
    for b, n in enumerate(LENGTHS):
        alone = decode_memory(model, memory[b:b + 1, :n], lens[b:b + 1], options)[0]
        assert [h.tokens for h in alone] == [h.tokens for h in batched[b]]
        assert [h.score for h in alone] == pytest.approx([h.score for h in batched[b]], abs=1e-4)
        assert 1 <= len(alone) <= options.nbest


def attention_log_prob(model: ASRModel, memory: torch.Tensor, memory_lens: torch.Tensor, b: int,
                       tokens: tuple[int, ...]) -> float:
    """log P_att(tokens, eos) of utterance b, teacher-forced."""
    t = torch.tensor([[list(tokens)]], dtype=torch.long).view(1, 1, len(tokens))
    return teacher_forced_scores(model, memory[b:b + 1], memory_lens[b:b + 1], t, torch.tensor([[len(tokens)]])).item()


def ctc_log_prob(model: ASRModel, memory: torch.Tensor, memory_lens: torch.Tensor, b: int,
                 tokens: tuple[int, ...]) -> float:
    """log P_ctc(output == tokens) of utterance b (torch's ctc_loss)."""
    log_probs = model.ctc_log_probs(memory[b:b + 1]).transpose(0, 1)  # (T, 1, V)
    nll = F.ctc_loss(log_probs, torch.tensor([list(tokens)]).view(1, -1), memory_lens[b:b + 1],
                     torch.tensor([len(tokens)]), reduction="sum")
    return -nll.item()


def test_teacher_forced_scores_equal_the_decoder_forward():
    model = tiny_model(2)
    memory, lens = random_memory(model, [8, 5], 2)
    tokens = torch.tensor([[[3, 4, -1], [5, -1, -1]], [[2, 2, 7], [-1, -1, -1]]])
    lengths = torch.tensor([[2, 1], [3, 0]])
    got = teacher_forced_scores(model, memory, lens, tokens, lengths)
    eos = model.config.eos
    for b in range(2):
        for i in range(2):
            y = tokens[b, i, : lengths[b, i]].tolist()
            inputs = torch.tensor([[eos] + y])
            log_probs = model.decoder(inputs, torch.tensor([len(y) + 1]), memory[b:b + 1], lens[b:b + 1])[0]
            want = sum(log_probs[j, t].item() for j, t in enumerate(y + [eos]))
            assert got[b, i].item() == pytest.approx(want, abs=1e-5)


@pytest.mark.parametrize("seed", [0, 3])
def test_hypothesis_score_is_attention_plus_ctc_plus_length_term(seed):
    """score == (1 - w) * teacher-forced log P_att(y, eos) + w * log P_ctc(y) + bonus * len(y)."""
    model = tiny_model(seed)
    memory, lens = random_memory(model, LENGTHS, seed)
    w, bonus = JOINT.ctc_weight, JOINT.length_bonus
    checked = 0
    for b, nbest in enumerate(decode_memory(model, memory, lens, JOINT)):
        assert [h.score for h in nbest] == sorted((h.score for h in nbest), reverse=True)
        assert len({h.tokens for h in nbest}) == len(nbest)
        for h in nbest:
            if len(h.tokens) == LENGTHS[b]:
                continue  # cut at the maximum length: no eos, see test_a_model_that_never_ends...
            want = ((1 - w) * attention_log_prob(model, memory, lens, b, h.tokens)
                    + w * ctc_log_prob(model, memory, lens, b, h.tokens) + bonus * len(h.tokens))
            assert h.score == pytest.approx(want, abs=1e-4, rel=1e-6), (b, h.tokens)
            checked += 1
    assert checked >= 8


def test_ctc_rescore_score_is_attention_plus_ctc_beam_plus_length_term():
    """ctc_rescore: the CTC part is the prefix beam's probability, at most the exact one, and equal
    to it when no alignment was pruned (a beam of 64 holds every output of 3 tokens in 3 frames)."""
    model = tiny_model(4, vocab=5)
    for lengths, beam in (([3, 2], 64), ([12, 9], 3)):
        memory, lens = random_memory(model, lengths, 4)
        options = SearchOptions(mode="ctc_rescore", beam_size=beam, ctc_weight=0.5, length_bonus=0.3, nbest=3)
        for b, nbest in enumerate(decode_memory(model, memory, lens, options)):
            for h in nbest:
                want = (0.5 * attention_log_prob(model, memory, lens, b, h.tokens)
                        + 0.5 * ctc_log_prob(model, memory, lens, b, h.tokens) + 0.3 * len(h.tokens))
                if beam == 64:
                    assert h.score == pytest.approx(want, abs=1e-4)
                else:
                    assert h.score <= want + 1e-4


def test_a_model_that_never_ends_stops_at_the_maximum_length():
    """Hypotheses are cut at floor(max_len_ratio * frames) tokens, not charged for an eos: beam 1
    still equals greedy, and the score is log P_att(y) + the length term."""
    model = tiny_model(5)
    with torch.no_grad():
        model.decoder.output.bias[model.config.eos] = -1e4  # eos never wins
    memory, lens = random_memory(model, LENGTHS, 5)
    greedy = decode_memory(model, memory, lens, GREEDY)
    beams = [SearchOptions(mode="attention", beam_size=1, ctc_weight=0.0),
             SearchOptions(mode="attention", beam_size=3, ctc_weight=0.0),
             SearchOptions(mode="attention", beam_size=3, max_len_ratio=0.5, length_bonus=1.0)]
    for options in beams:
        limits = [int(n * options.max_len_ratio) for n in LENGTHS]
        for b, ((best, *_), limit) in enumerate(zip(decode_memory(model, memory, lens, options), limits)):
            assert len(best.tokens) == limit
            if options.ctc_weight == 0:
                with_eos = attention_log_prob(model, memory, lens, b, best.tokens)
                assert best.score > with_eos + 1e3  # no eos charged
            if options.beam_size == 1:
                assert (best.tokens, best.score) == (greedy[b][0].tokens, pytest.approx(greedy[b][0].score, abs=1e-5))
    for mode in ("ctc_greedy", "ctc_rescore"):
        options = SearchOptions(mode=mode, beam_size=3, max_len_ratio=0.2)
        for (best, *_), n in zip(decode_memory(model, memory, lens, options), LENGTHS):
            assert len(best.tokens) <= int(n * 0.2)


def test_the_training_label_rate_caps_the_length():
    """A model that never ends, knowing its training label rate r (tokens per second), stops at
    min(floor(max_len_ratio * frames), ceil(max_rate_factor * r * seconds) + RATE_SLACK) tokens
    in every mode (CTC modes: at most that); max_rate_factor 0 turns the cap off."""
    model = tiny_model(5)
    with torch.no_grad():
        model.decoder.output.bias[model.config.eos] = -1e4  # eos never wins
    model.config = dataclasses.replace(model.config, tokens_per_second=2.0)
    memory, lens = random_memory(model, LENGTHS, 5)
    seconds = [n / model.config.frames_per_second for n in LENGTHS]  # 25 encoder frames per second
    capped = [min(n, math.ceil(2.0 * 2.0 * s) + RATE_SLACK) for n, s in zip(LENGTHS, seconds)]
    assert capped != LENGTHS
    for mode in ("greedy", "attention", "ctc_greedy", "ctc_rescore"):
        for factor, want in ((2.0, capped), (0.0, LENGTHS)):
            options = SearchOptions(mode=mode, beam_size=3, ctc_weight=0.0, max_rate_factor=factor)
            got = [len(nbest[0].tokens) for nbest in decode_memory(model, memory, lens, options)]
            if mode.startswith("ctc"):
                assert all(g <= w for g, w in zip(got, want)), (mode, factor)
            else:
                assert got == want, (mode, factor)


def test_stable_slots_keep_each_parents_best_child_in_its_row():
    """The best child of a parent row takes that row; the others take, in order, rows without children."""
    g = torch.Generator().manual_seed(0)
    parents = torch.randint(0, 6, (300, 6), generator=g)
    for row_parents, slot_of in zip(parents.tolist(), _stable_slots(parents).tolist()):
        assert sorted(slot_of) == list(range(6))
        others = [slot for slot, i in enumerate(slot_of) if row_parents.index(row_parents[i]) != i]
        for slot, i in enumerate(slot_of):
            if row_parents.index(row_parents[i]) == i:  # the best child of its parent
                assert slot == row_parents[i]
            else:
                assert slot not in row_parents
        assert [slot_of[slot] for slot in others] == sorted(slot_of[slot] for slot in others)


def test_fill_holes_moves_only_what_stays_past_the_kept_count():
    g = torch.Generator().manual_seed(1)
    for _ in range(100):
        stay = torch.rand(7, generator=g) < 0.5
        order, kept = _fill_holes(stay)
        k = int(stay.sum())
        assert int(kept) == k and sorted(order[:k].tolist()) == stay.nonzero()[:, 0].tolist()
        for i in range(k):
            assert (order[i] == i) == bool(stay[i])
        filled = [int(order[i]) for i in range(k) if not stay[i]]  # the holes take, in order, those past k
        assert filled == stay[k:].nonzero()[:, 0].add(k).tolist()


@pytest.mark.parametrize("mode", ["attention", "greedy", "ctc_rescore"])
def test_search_under_bf16_autocast(mode):
    """Under CPU bf16 autocast (what the GPU path runs) every search runs, scores in float32, and
    finds what float32 finds: the same hypotheses, but for a near tie now and then, with scores
    within bf16's rounding."""
    model = tiny_model(9, dtype=torch.float32)
    memory, lens = random_memory(model, LENGTHS, 9)
    options = dataclasses.replace(JOINT, mode=mode)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        found = decode_memory(model, memory, lens, options)
    assert len(found) == len(LENGTHS)
    assert all(math.isfinite(h.score) and len(h.tokens) <= n for nbest, n in zip(found, LENGTHS) for h in nbest)
    fp32 = decode_memory(model, memory, lens, options)
    pairs = [(h, want) for nbest, wanted in zip(found, fp32) for h, want in zip(nbest, wanted)]
    same = [(h.score, want.score) for h, want in pairs if h.tokens == want.tokens]
    assert len(same) >= 0.75 * len(pairs) and len(pairs) >= len(LENGTHS)
    assert [s for s, _ in same] == pytest.approx([w for _, w in same], rel=0.01, abs=0.2)


def test_empty_encoder_output_gives_an_empty_hypothesis():
    model = tiny_model(6)
    memory, _ = random_memory(model, [5, 5], 6)
    lens = torch.tensor([0, 5])
    for mode in ("attention", "greedy", "ctc_greedy", "ctc_rescore"):
        found = decode_memory(model, memory, lens, SearchOptions(mode=mode, beam_size=2))
        assert found[0] == (Hypothesis((), 0.0),), mode


def test_search_runs_the_encoder_and_defaults_to_greedy():
    model = tiny_model(7)
    g = torch.Generator().manual_seed(7)
    feats = torch.randn(3, 60, 80, generator=g, dtype=torch.float64)
    feat_lens = torch.tensor([60, 41, 25])
    memory, memory_lens = model.encoder(feats, feat_lens)
    best = search(model, feats, feat_lens)
    assert best == [n[0] for n in decode_memory(model, memory, memory_lens, GREEDY)]
    assert [n[0] for n in search_nbest(model, feats, feat_lens, JOINT)] == search(model, feats, feat_lens, JOINT)


@pytest.mark.parametrize("field, value", [
    ("mode", "beam"), ("beam_size", 0), ("ctc_weight", 1.5), ("max_len_ratio", 0.0), ("pre_beam_ratio", 0.5),
    ("nbest", 11), ("max_rate_factor", 0.5),
])
def test_options_are_validated(field, value):
    with pytest.raises(ValueError, match=f"decoding.{field} = "):
        SearchOptions(**{field: value})


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["attention", "greedy", "ctc_rescore"])
def test_cuda_equals_cpu(mode):
    model = tiny_model(8, dtype=torch.float32)
    memory, lens = random_memory(model, LENGTHS, 8)
    options = dataclasses.replace(JOINT, mode=mode)
    cpu = decode_memory(model, memory, lens, options)
    cuda = decode_memory(model.cuda(), memory.cuda(), lens.cuda(), options)
    assert [[h.tokens for h in n] for n in cpu] == [[h.tokens for h in n] for n in cuda]
    assert [h.score for n in cpu for h in n] == pytest.approx([h.score for n in cuda for h in n], abs=1e-3)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["attention", "greedy"])
def test_at_most_one_host_sync_per_step_on_cuda(mode):
    """CUDA's sync debug mode counts the host synchronizations of a search: one per step, plus a
    few to start (the longest limit) and to end (the results)."""
    model = tiny_model(8, dtype=torch.float32).cuda()
    memory, lens = random_memory(model, LENGTHS, 8)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            decode_memory(model, memory.cuda(), lens.cuda(), dataclasses.replace(JOINT, mode=mode))
        finally:
            torch.cuda.set_sync_debug_mode("default")
    syncs = sum("synchroniz" in str(w.message) for w in caught)
    assert syncs <= max(LENGTHS) + 1 + 8, syncs


@pytest.mark.parametrize("mode", ["attention", "greedy", "ctc_greedy", "ctc_rescore"])
def test_search_makes_one_host_transfer_per_step(mode):
    """The operations that would make the host wait for a GPU (tests/host_syncs.py), counted on
    the CPU: one per decoding step, plus two to start (the limits, the longest) and one to end
    (the results); this is the CUDA promise that test_at_most_one_host_sync_per_step_on_cuda
    checks on a device, kept in CI."""
    model = tiny_model(8, dtype=torch.float32)
    memory, lens = random_memory(model, LENGTHS, 8)
    options = dataclasses.replace(JOINT, mode=mode)
    limits = length_limits(model, lens, options.max_len_ratio, options.max_rate_factor)
    with HostSyncs() as syncs:
        decode_memory(model, memory, lens, options)
    steps = int(limits.max()) + 1
    assert 0 < syncs.count <= steps + 4, (syncs.count, steps, syncs.where.most_common(5), syncs.kinds)
    per_site = syncs.where.most_common(2)
    assert len(per_site) < 2 or per_site[1][1] <= 3, syncs.where  # one site per step, the rest a few in all


class _RowSpy:
    """A FullScorer of 0 for every token whose state is each row's tokens, kept by selecting rows
    and appending the selected tokens alone: it records every Selection it gets, and checks at
    every step that the search feeds each row the token its state says it chose."""

    def __init__(self) -> None:
        self.selections: list[Selection] = []

    def init_state(self, memory: torch.Tensor, memory_lens: torch.Tensor, group: int) -> torch.Tensor:
        return torch.full((memory.size(0) * group, 1), TINY.vocab_size - 1)  # (R, tokens) sos first

    def score(self, state: torch.Tensor, last_tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        assert torch.equal(last_tokens, state[:, -1])
        return torch.zeros(state.size(0), TINY.vocab_size), state

    def select_state(self, state: torch.Tensor, selection: Selection) -> torch.Tensor:
        self.selections.append(selection)
        return torch.cat([state[selection.rows], selection.tokens[:, None]], dim=1)

    def final_score(self, state: torch.Tensor) -> torch.Tensor:
        return torch.zeros(state.size(0))


def test_scorers_receive_rows_only():
    """A scorer's selection is rows, tokens and utterances (and, for a CountingScorer alone, the
    counts it asked for): nothing of the decoder cache's bookkeeping. Selecting rows alone keeps
    a scorer's state right (the spy checks the tokens it is fed), and the spy, which scores 0,
    changes nothing."""
    assert Selection._fields == ("rows", "tokens", "utterances", "counts")
    model = tiny_model(3)
    memory, lens = random_memory(model, LENGTHS, 3)
    spy = _RowSpy()
    assert not isinstance(spy, CountingScorer)
    options = dataclasses.replace(JOINT, length_bonus=0.0)
    with_spy = decode_memory(model, memory, lens, options, Scorers({"spy": spy}, weights={"spy": 1.0}))
    assert with_spy == decode_memory(model, memory, lens, options)
    assert spy.selections and all(s.counts == () for s in spy.selections)
    dropped = [s for s in spy.selections if s.rows.numel() < spy.selections[0].rows.numel()]
    assert dropped, "no utterance left the batch early: the test does not cover dropping"
    for s in spy.selections:  # rows in groups of N per kept utterance, each of its own utterance
        groups = s.rows.view(-1, options.beam_size) // options.beam_size
        assert (groups == s.utterances[:, None]).all()
