"""Training a transformer LM (asr.lm_train): its config, the text tokenized once, `asr lm --kind
transformer` (learns, averages, resumes bit-exact, one-line usage errors), and a run that counts
tokens in its log, records and checkpoints."""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from asr.checkpoint import average, load_file
from asr.lm_train import LMExperimentConfig, load_lm_config, open_tokenized, read_sentences, tokenize_text, train_lm
from asr.model import TransformerLM
from asr.neural_lm import load_neural_lm
from asr.tokenizer import CharTokenizer

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

ROOT = Path(__file__).resolve().parents[1]
TOKENS = list("ABCDEFGH ")  # the characters of write_text's words


def test_lm_experiment_config_is_validated():
    with pytest.raises(ValueError, match="max_sentence_tokens"):
        LMExperimentConfig(data=dataclasses.replace(LMExperimentConfig().data, max_batch_tokens=100,
                                                    max_sentence_tokens=100))
    with pytest.raises(ValueError, match="global_batch_seconds"):
        LMExperimentConfig(training=dataclasses.replace(LMExperimentConfig().training, global_batch_seconds=10.0))


@pytest.mark.parametrize("name", ["synth.yaml", "librispeech_transformer.yaml"])
def test_lm_configs_build_a_model(name):
    config = load_lm_config(str(ROOT / "conf" / "lm" / name), [])
    lm = TransformerLM(dataclasses.replace(config.model, vocab_size=258))
    assert sum(p.numel() for p in lm.parameters()) > 0
    assert config.plan(1).group >= 1


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
    from asr.tokenizer import train_tokenizer

    text, _ = write_text(tmp_path, 500)
    sentences = list(read_sentences(text))
    bpe = train_tokenizer(sentences, "bpe", 20)
    info = tokenize_text([str(text)], bpe, tmp_path / "tok", max_tokens=12)
    kept = [bpe.encode(s) for s in sentences if len(bpe.encode(s)) <= 12]
    assert info["sentences"] == len(kept) and info["too_long"] == len(sentences) - len(kept) > 0
    loaded = open_tokenized(tmp_path / "tok")
    assert [loaded.sentence(i).tolist() for i in range(len(loaded))] == kept


def test_lm_training_reports_tokens(tmp_path, caplog, capsys):
    """An LM's run counts its work in tokens: the step plan, the progress bar's throughput, the
    train records (throughput and tokens trained on), the closing summary and the checkpoints'
    state; no log line or record speaks of hours, seconds or audio."""
    text, valid = write_text(tmp_path, 100)
    config = load_lm_config(str(ROOT / "conf" / "lm" / "synth.yaml"), [*LM_OVERRIDES, "training.epochs=2"])
    exp = tmp_path / "exp"
    with caplog.at_level(logging.INFO, logger="asr"):
        train_lm(config, [str(text)], [str(valid)], exp, tokenizer=str(tokenizer_dir(tmp_path)))
    info = json.loads((exp / "text" / "train" / "info.json").read_text())
    per_epoch = info["tokens"] + info["sentences"]  # every sentence's tokens, then its eos
    state = load_file(sorted((exp / "checkpoints").glob("ckpt-*.pt"))[-1], "asr-checkpoint")["state"]
    assert state["trained"] == 2 * per_epoch and state["micro_batch"] == 256
    assert not {"audio_hours", "micro_batch_seconds"} & set(state)

    records = [json.loads(line) for line in (exp / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["kind"] == "train"]
    assert train and all(r["tokens_per_s"] > 0 and 0 < r["tokens"] <= 2 * per_epoch for r in train)
    assert [r["tokens"] for r in train] == sorted(r["tokens"] for r in train)
    assert not [key for r in records for key in r if "audio" in key or "hour" in key or "second" in key]

    log = caplog.text
    assert "micro-batches of at most 256 padded tokens (512 tokens)" in log
    assert f"training stopped: 2 epochs done ({state['step']} steps, {2 * per_epoch:,} tokens)" in log
    assert "tokens_per_s=" in capsys.readouterr().err  # the progress bar
    assert not [word for word in ("hour", "second", "audio", "utterance") if word in log.lower()], log
