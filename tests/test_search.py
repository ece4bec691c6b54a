"""Greedy decoding: batched equals one at a time, equals an uncached reference, stops in time,
and reproduces two utterances a tiny model has overfit."""
from __future__ import annotations

import dataclasses

import pytest
import torch
from small_models import SMALL, small_model

from asr.model import ASRModel
from asr.search import Hypothesis, SearchOptions, attention_greedy, ctc_greedy, max_lengths, search

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def eos_after(model: ASRModel, bias: float) -> None:
    """Shift the decoder's eos logit by `bias` (so greedy stops at once, or never)."""
    with torch.no_grad():
        model.decoder.output.bias[model.config.eos] += bias


def batch(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    feat_lens = torch.tensor([83, 40, 121, 61])
    return torch.randn(4, 121, 16, generator=g), feat_lens


@pytest.mark.parametrize("mode", ["attention", "ctc_greedy"])
def test_batched_search_equals_one_at_a_time(mode):
    model = small_model()
    feats, feat_lens = batch()
    options = SearchOptions(mode=mode, max_len_ratio=0.7)
    together = search(model, feats, feat_lens, options)
    for b, hyp in enumerate(together):
        alone = search(model, feats[b:b + 1, : feat_lens[b]], feat_lens[b:b + 1], options)[0]
        assert alone.tokens == hyp.tokens
        assert alone.score == pytest.approx(hyp.score, abs=1e-4)


@torch.no_grad()
def test_attention_greedy_equals_uncached_reference():
    """The cached, batched search picks what re-running the teacher-forced decoder picks."""
    model = small_model(seed=2)
    eos_after(model, 2.0)  # some utterances end early, others run to the limit
    feats, feat_lens = batch(seed=3)
    memory, memory_lens = model.encoder(feats, feat_lens)
    found = attention_greedy(model, memory, memory_lens, max_len_ratio=0.8)
    limits = max_lengths(memory_lens, 0.8).tolist()
    eos = model.config.eos
    for b, hyp in enumerate(found):
        prefix, score = [model.config.sos], 0.0
        while len(prefix) <= limits[b]:
            tokens = torch.tensor([prefix])
            log_probs = model.decoder(tokens, torch.tensor([len(prefix)]), memory[b:b + 1], memory_lens[b:b + 1])
            best_lp, best = log_probs[0, -1].max(dim=-1)
            prefix.append(best.item())
            score += best_lp.item()
            if best.item() == eos:
                break
        assert hyp.tokens == tuple(t for t in prefix[1:] if t != eos)
        assert hyp.score == pytest.approx(score, abs=1e-4)


def test_search_stops_at_the_length_limit():
    model = small_model()
    eos_after(model, -100.0)  # never ends by itself
    feats, feat_lens = batch()
    memory_lens = model.encoder.subsampling.output_lengths(feat_lens)
    for ratio in (0.3, 1.0):
        limits = max_lengths(memory_lens, ratio).tolist()
        found = search(model, feats, feat_lens, SearchOptions(mode="greedy", max_len_ratio=ratio))
        assert [len(h.tokens) for h in found] == limits
        ctc = search(model, feats, feat_lens, SearchOptions(mode="ctc_greedy", max_len_ratio=ratio))
        assert all(len(h.tokens) <= n for h, n in zip(ctc, limits))


def test_immediate_eos_gives_empty_hypotheses():
    model = small_model()
    eos_after(model, 100.0)
    found = search(model, *batch())
    assert all(h.tokens == () and -1e-3 < h.score <= 0 for h in found)


@torch.no_grad()
def test_ctc_greedy_merges_repeats_and_drops_blanks():
    model = small_model()
    model.ctc.weight.zero_()
    model.ctc.weight[:13, :13] = 10 * torch.eye(13)  # frame with one-hot memory k -> token k
    model.ctc.bias.zero_()
    frames = [[0, 2, 2, 0, 2, 3, 3, 3, 0, 0, 5], [4, 4, 0, 4, 1, 9, 7, 7]]
    memory = torch.zeros(2, 11, 32)
    for b, path in enumerate(frames):
        memory[b, torch.arange(len(path)), torch.tensor(path)] = 1.0
    memory[1, 8:, 6] = 1.0  # padding frames that would emit tokens if they were read
    found = ctc_greedy(model, memory, torch.tensor([11, 8]))
    assert [h.tokens for h in found] == [(2, 2, 3, 5), (4, 4, 1, 9, 7)]
    frame_lp = torch.log_softmax(torch.tensor([10.0] + [0.0] * 12), 0)[0].item()  # each frame's best
    assert found[1].score == pytest.approx(8 * frame_lp, rel=1e-3)
    assert ctc_greedy(model, memory, torch.tensor([11, 8]), max_len_ratio=0.25)[0].tokens == (2, 2)


def test_input_shorter_than_receptive_field_gives_empty_hypotheses():
    model = small_model()
    feats, feat_lens = torch.randn(2, 6, 16), torch.tensor([6, 2])
    for mode in ("attention", "ctc_greedy"):
        assert search(model, feats, feat_lens, SearchOptions(mode=mode)) == [Hypothesis((), 0.0)] * 2


@pytest.mark.parametrize("changes", [{"mode": "beam"}, {"max_len_ratio": 0.0}])
def test_options_are_validated(changes):
    with pytest.raises(ValueError, match=r"^decoding\."):
        SearchOptions(**changes)


def test_the_search_alone_refuses_a_lexicon_or_an_lm():
    """A lexicon or an LM is a decoding task's (asr.decoding): the search alone would drop it."""
    from asr.decoding import DecodingOptions

    model = small_model()
    feats, feat_lens = torch.randn(1, 40, 16), torch.tensor([40])
    for changes in ({"lexicon": "words.txt"}, {"lm": "lm.arpa"}):
        with pytest.raises(ValueError, match=r"decoding\.(lexicon|lm) needs a decoding task"):
            search(model, feats, feat_lens, DecodingOptions(**changes))


def test_overfit_two_utterances_then_greedy_reproduces_them():
    """A tiny model trained on two utterances of random features decodes both exactly, with the
    attention decoder and with CTC."""
    torch.manual_seed(0)
    config = dataclasses.replace(SMALL, vocab_size=12, encoder_layers=1, decoder_layers=1, lsm_weight=0.0,
                                 ctc_weight=0.5)
    model = ASRModel(config)
    feats, feat_lens = torch.randn(2, 64, 16), torch.tensor([64, 50])
    targets = [[2, 5, 5, 9, 3, 10, 7], [8, 4, 6, 2]]
    tokens = torch.tensor([targets[0], targets[1] + [-1] * 3])
    token_lens = torch.tensor([7, 4])
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    for _ in range(300):
        optimizer.zero_grad()
        model(feats, feat_lens, tokens, token_lens).loss.backward()
        optimizer.step()
    model.eval()
    for mode in ("attention", "ctc_greedy"):
        found = search(model, feats, feat_lens, SearchOptions(mode=mode))
        assert [list(h.tokens) for h in found] == targets, mode


@pytest.mark.parametrize("utterances, beam, inside", [(1, 10, 1), (4, 10, None), (4, 1, 1)])
def test_small_searches_run_on_the_threads_asked_for_and_restore_the_count(monkeypatch, utterances, beam, inside):
    """With search_threads=1 a search over few rows (utterances x beam <= FEW_ROWS) runs on one
    intra-op thread; the caller's thread count is back afterwards, also when the search raises.
    Without search_threads the library leaves torch's thread count alone."""
    import asr.search as search_module
    from asr.decoding import DecodingOptions, DecodingTask
    from asr.tokenizer import CharTokenizer

    model = small_model()
    feats, feat_lens = batch()
    seen = []

    def spy(*args):
        seen.append(torch.get_num_threads())
        raise RuntimeError("stop")

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        monkeypatch.setitem(search_module.SEARCHES, "attention", spy)
        tokenizer = CharTokenizer(list("ABCDEFGH "))
        for threads, want in ((1, inside or 2), (None, 2)):
            task = DecodingTask(model.eval(), tokenizer, DecodingOptions(beam_size=beam), search_threads=threads)
            with pytest.raises(RuntimeError, match="stop"):
                task.run([f[:n] for f, n in zip(feats[:utterances], feat_lens[:utterances].tolist())])
            assert seen.pop() == want and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)

