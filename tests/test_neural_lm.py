"""The transformer LM (asr.model.lm, asr.neural_lm): cached scoring == forward, fusion adds exactly
weight x the LM's log-probabilities, batched == alone, its file, and decoding with it (training it
is tests/test_lm_train.py's)."""
from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_api import TOKENS, write_decode_files
from test_beam_search import JOINT, LENGTHS, attention_log_prob, ctc_log_prob, random_memory, tiny_model

from asr.checkpoint import CheckpointError
from asr.model.lm import LMConfig, TransformerLM
from asr.neural_lm import NeuralLM, is_neural_lm, lm_file, load_neural_lm
from asr.search import Scorers, decode_memory
from asr.tokenizer import CharTokenizer

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

TINY_LM = LMConfig(vocab_size=12, d_model=32, n_heads=4, ffn_dim=64, n_layers=2, dropout=0.0)


def tiny_lm(seed: int = 0, *, dtype=torch.float64, sharpness: float = 3.0, **changes) -> TransformerLM:
    torch.manual_seed(seed)
    lm = TransformerLM(dataclasses.replace(TINY_LM, **changes)).eval()
    with torch.no_grad():
        lm.embed.weight.mul_(sharpness)  # (tied) peaked next-token distributions
    return lm.to(dtype)


def neural(lm: TransformerLM, tokens=TOKENS) -> NeuralLM:
    return NeuralLM(lm, CharTokenizer(list(tokens)).to_dict(), "lm.pt")


def lm_log_prob(lm: TransformerLM, tokens: tuple[int, ...]) -> float:
    """ln P_LM(tokens, eos | sos), teacher-forced."""
    eos = lm.config.vocab_size - 1
    log_probs = lm(torch.tensor([[eos, *tokens]]))[0]
    return sum(log_probs[j, t].item() for j, t in enumerate([*tokens, eos]))


# -- the network --------------------------------------------------------------------------------


def test_lm_cached_scoring_matches_forward():
    """Stepping 6 rows token by token through the cache (reordered within groups of 3 midway, by
    `reorder` and by `select` with counts, and with the buffer growing past its capacity) gives the
    forward's log-probabilities."""
    lm = tiny_lm(1)
    g = torch.Generator().manual_seed(0)
    eos = lm.config.vocab_size - 1
    steps = 9
    tokens = torch.cat([torch.full((6, 1), eos), torch.randint(2, 11, (6, steps - 1), generator=g)], 1)
    cache = lm.init_cache(6, 3, capacity=4)
    rows = torch.arange(6)  # which original row each cache row now holds
    for t in range(steps):
        if t == 4:  # rows 0 <- 2 and 4 <- 3 (within their groups): copy whole rows
            index = torch.tensor([2, 1, 2, 3, 3, 5])
            cache.reorder(index)
            rows = rows[index]
        if t == 6:  # row 1 <- row 0, the counts found on the device first, as beam search does
            index = torch.tensor([0, 0, 2, 3, 4, 5])
            cache.select(index, cache.selection_counts(index, torch.tensor(2)).tolist())
            rows = rows[index]
        step = lm.step(tokens[rows, t], cache)
        want = lm(tokens[rows, :t + 1])[:, -1]
        torch.testing.assert_close(step, want, atol=1e-9, rtol=0)
    assert cache.capacity >= steps


def test_lm_forward_is_causal_and_ignores_right_padding():
    lm = tiny_lm(2)
    tokens = torch.tensor([[11, 3, 4, 5, 6]])
    full = lm(tokens)
    padded = lm(torch.tensor([[11, 3, 4, -1, -1]]))
    torch.testing.assert_close(full[:, :3], padded[:, :3], atol=1e-12, rtol=0)


def test_lm_config_is_validated():
    with pytest.raises(ValueError, match="model.d_model"):
        LMConfig(d_model=30, n_heads=4)


# -- fusion ---------------------------------------------------------------------------------------


def fused(lm: TransformerLM, weight: float) -> Scorers:
    from asr.neural_lm import TransformerLMScorer

    return Scorers({"lm": TransformerLMScorer(neural(lm))}, {}, {"lm": weight}, (), ("lm",))


@pytest.mark.parametrize("seed", [0, 3])
def test_fused_score_is_am_plus_weighted_lm(seed):
    """score == (1 - w) log P_att(y, eos) + w log P_ctc(y) + bonus len(y) + lm_weight ln P_LM(y, eos)."""
    model, lm, weight = tiny_model(seed), tiny_lm(seed + 10), 0.7
    memory, lens = random_memory(model, LENGTHS, seed)
    w, bonus = JOINT.ctc_weight, JOINT.length_bonus
    with_lm = decode_memory(model, memory, lens, JOINT, fused(lm, weight))
    without = decode_memory(model, memory, lens, JOINT)
    checked = 0
    for b, nbest in enumerate(with_lm):
        for h in nbest:
            if len(h.tokens) == LENGTHS[b]:
                continue  # cut at the maximum length: no eos charge
            want = ((1 - w) * attention_log_prob(model, memory, lens, b, h.tokens)
                    + w * ctc_log_prob(model, memory, lens, b, h.tokens) + bonus * len(h.tokens)
                    + weight * lm_log_prob(lm, h.tokens))
            assert h.score == pytest.approx(want, abs=1e-4, rel=1e-6), (b, h.tokens)
            checked += 1
    assert checked >= 8
    assert [n[0].tokens for n in with_lm] != [n[0].tokens for n in without]  # the LM changed something


def test_batched_search_with_lm_equals_one_at_a_time():
    model, lm = tiny_model(1), tiny_lm(4)
    memory, lens = random_memory(model, LENGTHS, 1)
    batched = decode_memory(model, memory, lens, JOINT, fused(lm, 0.5))
    for b, n in enumerate(LENGTHS):
        alone = decode_memory(model, memory[b:b + 1, :n], lens[b:b + 1], JOINT, fused(lm, 0.5))[0]
        assert [h.tokens for h in alone] == [h.tokens for h in batched[b]]
        assert [h.score for h in alone] == pytest.approx([h.score for h in batched[b]], abs=1e-4)


def test_lm_weight_zero_decodes_as_without_lm():
    model, lm = tiny_model(2), tiny_lm(5)
    memory, lens = random_memory(model, LENGTHS, 2)
    options = dataclasses.replace(JOINT, pre_beam_ratio=100.0)  # the whole vocabulary: the pre-beam cannot differ
    plain = decode_memory(model, memory, lens, options)
    zero = decode_memory(model, memory, lens, options, fused(lm, 0.0))
    assert [[h.tokens for h in n] for n in plain] == [[h.tokens for h in n] for n in zero]


# -- the file and decoding options ------------------------------------------------------------


def save_lm(path: Path, lm: TransformerLM, tokens=TOKENS) -> Path:
    from asr.checkpoint import save_atomic
    from asr.config import to_dict

    save_atomic(lm_file(model=to_dict(lm.config), tokenizer=CharTokenizer(list(tokens)).to_dict(),
                        state_dict=lm.float().state_dict()), path)
    return path


def test_lm_file_round_trips_and_is_told_from_arpa(tmp_path):
    lm = tiny_lm(0, dtype=torch.float32)
    path = save_lm(tmp_path / "lm.pt", lm)
    loaded = load_neural_lm(path)
    assert is_neural_lm(path) and loaded.config == lm.config
    tokens = torch.tensor([[11, 2, 3]])
    torch.testing.assert_close(loaded.model(tokens), lm(tokens))
    assert loaded.score([(2, 3)])[0] == pytest.approx(lm_log_prob(lm.double(), (2, 3)), abs=1e-4)
    (tmp_path / "lm.arpa").write_text("\\data\\\nngram 1=1\n\n\\1-grams:\n-1.0\t</s>\n\n\\end\\\n")
    assert not is_neural_lm(tmp_path / "lm.arpa")
    with pytest.raises(CheckpointError, match="expected 'asr-lm'"):
        load_neural_lm(write_decode_files(tmp_path))  # an ASR model file


def test_an_lm_of_another_tokenizer_is_refused_in_one_line(tmp_path):
    from asr.api import load_model

    model_path = write_decode_files(tmp_path)
    other = save_lm(tmp_path / "other.pt", tiny_lm(0, dtype=torch.float32), tokens="ABCDEFGHI")
    recognizer = load_model(model_path)
    with pytest.raises(ValueError, match="another tokenizer") as err:
        recognizer.transcribe(tmp_path / "u0.wav", lm=other)
    assert "\n" not in str(err.value) and "other.pt" in str(err.value)
    same = save_lm(tmp_path / "same.pt", tiny_lm(0, dtype=torch.float32, sharpness=6.0))
    wavs = sorted(tmp_path.glob("u*.wav"))
    with_bonus = recognizer.transcribe(wavs, lm=same, lm_weight=2.0, lm_word_bonus=5.0)  # an n-gram LM's: unused
    assert [r.text for r in with_bonus] == [r.text for r in recognizer.transcribe(wavs, lm=same, lm_weight=2.0)]


def test_decode_and_transcribe_with_a_neural_lm(tmp_path):
    """`asr decode --lm` and `asr transcribe --lm` with an LM file; a large weight changes the output."""
    from asr.api import load_model

    model_path = write_decode_files(tmp_path)
    lm_path = save_lm(tmp_path / "lm.pt", tiny_lm(3, dtype=torch.float32, sharpness=6.0))
    recognizer = load_model(model_path)
    plain = [r.text for r in recognizer.transcribe(sorted(tmp_path.glob("u*.wav")), beam_size=4)]
    heavy = [r.text for r in recognizer.transcribe(sorted(tmp_path.glob("u*.wav")), beam_size=4, lm=lm_path,
                                                    lm_weight=5.0)]
    assert plain != heavy
    out = tmp_path / "dec"
    done = subprocess.run([sys.executable, "-m", "asr.cli", "decode", "--model", model_path, "--manifest",
                           tmp_path / "test.jsonl", "--out-dir", out, "--beam-size", "4", "--lm", lm_path,
                           "--lm-weight", "5.0", "--device", "cpu"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "transformer" in done.stderr and "fused" in done.stderr
    hyps = dict(line.split(" ", 1) if " " in line else (line, "") for line in
                (out / "hyp.txt").read_text().splitlines())
    assert [hyps[f"utt{i}"].strip() for i in range(4)] == [h.strip() for h in heavy]
