"""The transformer LM (asr.model.lm, asr.neural_lm): cached scoring == forward, fusion adds exactly
weight x the LM's log-probabilities, batched == alone, its file, training (resumed bit-exact) and
the commands."""
from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from test_api import TOKENS, write_decode_files
from test_beam_search import JOINT, LENGTHS, attention_log_prob, ctc_log_prob, random_memory, tiny_model

from asr.checkpoint import CheckpointError, average, load_file
from asr.model.decoder import ReorderPlan
from asr.model.lm import LMConfig, TransformerLM
from asr.neural_lm import (
    LMExperimentConfig,
    NeuralLM,
    is_neural_lm,
    lm_file,
    load_neural_lm,
    read_sentences,
)
from asr.search import Scorers, decode_memory
from asr.tokenizer import CharTokenizer

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

ROOT = Path(__file__).resolve().parents[1]
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
    """Stepping 6 rows token by token through the cache (reordered within groups of 3 midway, with and
    without a plan, and with the buffer growing past its capacity) gives the forward's log-probabilities."""
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
        if t == 6:  # row 1 <- row 0 through a plan that copies every position (shared 0)
            index = torch.tensor([0, 0, 2, 3, 4, 5])
            cache.reorder(index, ReorderPlan(rows=torch.tensor([1]), start=torch.tensor([0]), copies=6))
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
    with pytest.raises(ValueError, match="max_sentence_tokens"):
        LMExperimentConfig(data=dataclasses.replace(LMExperimentConfig().data, max_batch_tokens=100,
                                                    max_sentence_tokens=100))
    with pytest.raises(ValueError, match="global_batch_seconds"):
        LMExperimentConfig(training=dataclasses.replace(LMExperimentConfig().training, global_batch_seconds=10.0))


@pytest.mark.parametrize("name", ["synth.yaml", "librispeech_transformer.yaml"])
def test_lm_configs_build_a_model(name):
    from asr.neural_lm import load_lm_config

    config = load_lm_config(str(ROOT / "conf" / "lm" / name), [])
    lm = TransformerLM(dataclasses.replace(config.model, vocab_size=258))
    assert sum(p.numel() for p in lm.parameters()) > 0
    assert config.plan(1).group >= 1


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


# -- training ---------------------------------------------------------------------------------


def write_text(folder: Path, n: int = 300) -> tuple[Path, Path]:
    import gzip
    import random

    rng = random.Random(0)
    words = ["ABE", "BEAD", "CAFE", "DEAF", "FADE", "HEAD", "BAG", "CAGE"]
    lines = [" ".join(rng.choice(words) for _ in range(rng.randint(2, 6))) for _ in range(n)]
    with gzip.open(folder / "train.txt.gz", "wt") as f:
        f.write("\n".join(lines) + "\n")
    (folder / "valid.txt").write_text("\n".join(lines[:20]).lower() + "\n\n")  # normalized when read
    return folder / "train.txt.gz", folder / "valid.txt"


def tokenizer_dir(folder: Path) -> Path:
    CharTokenizer(TOKENS).save(folder / "lang")
    return folder / "lang"


LM_OVERRIDES = ["model.d_model=32", "model.n_heads=4", "model.ffn_dim=64", "model.n_layers=2", "model.dropout=0.1",
                "data.max_batch_tokens=256", "data.global_batch_tokens=512", "training.epochs=6",
                "training.warmup_steps=5", "training.lr=5e-3", "training.checkpoint_every=3", "training.num_threads=1",
                "training.log_every=2"]


def asr_lm(text: Path, valid: Path, lang: Path, exp: Path, *extra: str, wait: bool = True):
    cmd = [sys.executable, "-m", "asr.cli", "lm", "--kind", "transformer", "--text", text, "--valid", valid,
           "--tokenizer", lang, "--config", ROOT / "conf" / "lm" / "synth.yaml", "--exp-dir", exp,
           *LM_OVERRIDES, *extra]
    cmd = [str(c) for c in cmd]
    if not wait:
        return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                start_new_session=True)
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600)


def test_read_sentences_normalizes_and_skips_empty_lines(tmp_path):
    text, valid = write_text(tmp_path, 30)
    sentences = list(read_sentences(valid))
    assert len(sentences) == 20 and all(s == s.upper() and s for s in sentences)
    assert len(list(read_sentences(text))) == 30


def test_asr_lm_trains_an_lm_that_learns_and_averages(tmp_path):
    text, valid = write_text(tmp_path)
    done = asr_lm(text, valid, tokenizer_dir(tmp_path), tmp_path / "exp")
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "exp" / "lm_last.pt").is_file()
    records = [json.loads(line) for line in (tmp_path / "exp" / "metrics.jsonl").read_text().splitlines()]
    valids = [r for r in records if r.get("kind") == "valid"]
    assert len(valids) == 6 and valids[-1]["ppl"] < 0.6 * valids[0]["ppl"] and valids[-1]["ppl"] < 5  # uniform: 12
    path = average(tmp_path / "exp", num=2)
    assert path.name == "lm_avg.pt" and load_file(path, "asr-lm")["model"]["n_layers"] == 2
    lm = load_neural_lm(path)
    good, bad = lm.score([CharTokenizer(TOKENS).encode("BEAD HEAD"), CharTokenizer(TOKENS).encode("HHHH GGGG")])
    assert good > bad


def test_asr_lm_usage_errors_are_one_line(tmp_path):
    text, valid = write_text(tmp_path, 10)
    for args, message in [(["--kind", "transformer", "--text", text], "needs --exp-dir"),
                          (["--text", text, "--exp-dir", tmp_path / "x"], "--kind ngram takes --out")]:
        done = subprocess.run([sys.executable, "-m", "asr.cli", "lm", *map(str, args)], capture_output=True, text=True)
        assert done.returncode != 0 and message in done.stderr
        assert len(done.stderr.strip().splitlines()) == 1


@pytest.mark.slow
def test_lm_training_resumes_bit_exact(tmp_path):
    """SIGKILL `asr lm` mid-epoch (after its first mid-epoch checkpoint), resume: the final weights equal
    an uninterrupted run's, bit for bit (dropout on, so the random states must be restored too)."""
    text, valid = write_text(tmp_path)
    lang = tokenizer_dir(tmp_path)
    done = asr_lm(text, valid, lang, tmp_path / "whole")
    assert done.returncode == 0, done.stderr
    exp = tmp_path / "killed"
    proc = asr_lm(text, valid, lang, exp, wait=False)
    index = exp / "checkpoints" / "index.json"
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None:
        if index.is_file() and any(e["valid_loss"] is None for e in json.loads(index.read_text() or "[]")):
            break
        time.sleep(0.05)
    assert proc.poll() is None, "the run ended before it could be killed"
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not (exp / "lm_last.pt").exists()
    done = asr_lm(text, valid, lang, exp)
    assert done.returncode == 0, done.stderr
    assert "resumed from" in done.stderr
    want, got = load_file(tmp_path / "whole" / "lm_last.pt", "asr-lm"), load_file(exp / "lm_last.pt", "asr-lm")
    assert want["state_dict"].keys() == got["state_dict"].keys()
    for key, value in want["state_dict"].items():
        assert torch.equal(value, got["state_dict"][key]), key


def test_tokenized_text_holds_each_sentence_as_encode_gives_it(tmp_path):
    """tokenize_text (batched encoding, chunked writes) keeps every sentence's ids, in order; too long ones out."""
    from asr.neural_lm import open_tokenized, tokenize_text
    from asr.tokenizer import train_tokenizer

    text, _ = write_text(tmp_path, 500)
    sentences = list(read_sentences(text))
    bpe = train_tokenizer(sentences, "bpe", 20)
    info = tokenize_text([str(text)], bpe, tmp_path / "tok", max_tokens=12)
    kept = [bpe.encode(s) for s in sentences if len(bpe.encode(s)) <= 12]
    assert info["sentences"] == len(kept) and info["too_long"] == len(sentences) - len(kept) > 0
    loaded = open_tokenized(tmp_path / "tok")
    assert [loaded.sentence(i).tolist() for i in range(len(loaded))] == kept
