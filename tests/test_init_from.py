"""Starting from another model (asr.init_from, `asr train --init-from`)."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from asr.checkpoint import CheckpointError, model_file, save_atomic
from asr.config import to_dict
from asr.init_from import init_from
from asr.tokenizer import train_tokenizer
from tests.small_models import SMALL, small_model
from tests.test_trainer import QUIET, TINY, asr_train, make_corpus, weights

TOKENS_A = train_tokenizer(["ONE TWO THREE"], "char")  # 11 symbols
TOKENS_B = train_tokenizer(["FIVE SIX SEVEN EIGHT"], "char")  # others, and more of them


def saved(tmp_path, model, tokenizer):
    path = tmp_path / "source.pt"
    save_atomic(model_file(model=to_dict(model.config), frontend={}, tokenizer=tokenizer.to_dict(),
                         state_dict=model.state_dict()), path)
    return path


def same(a: torch.nn.Module, b: torch.nn.Module, prefix: str) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    names = [n for n in sa if n.startswith(prefix)]
    assert names, prefix
    return all(torch.equal(sa[n], sb[n]) for n in names)


def test_init_from_loads_named_modules_and_reinitialises_a_new_vocabulary(tmp_path):
    source = small_model(seed=1, vocab_size=TOKENS_A.vocab_size)
    path = saved(tmp_path, source, TOKENS_A)

    # a new tokenizer: everything of the named modules but the layers whose rows are tokens
    fresh = small_model(seed=2, vocab_size=TOKENS_B.vocab_size)
    model = small_model(seed=2, vocab_size=TOKENS_B.vocab_size)
    line = init_from(model, path, ("encoder", "decoder", "ctc"), TOKENS_B)
    assert same(model, source, "encoder.") and same(model, source, "decoder.layers.")
    assert same(model, source, "decoder.norm.")
    for layer in ("decoder.embed.", "decoder.output.", "ctc."):  # their shapes differ from the source's
        assert same(model, fresh, layer)
    assert "re-initialised" in line and "ctc" in line and f"{TOKENS_A.vocab_size} -> {TOKENS_B.vocab_size}" in line

    # the same tokenizer: the output layers come too; modules not named keep their own weights
    model = small_model(seed=2, vocab_size=TOKENS_A.vocab_size)
    untouched = small_model(seed=2, vocab_size=TOKENS_A.vocab_size)
    line = init_from(model, path, ["encoder", "ctc"], TOKENS_A)
    assert same(model, source, "encoder.") and same(model, source, "ctc.")
    assert same(model, untouched, "decoder.") and not same(model, source, "decoder.")
    assert "re-initialised" not in line


def test_init_from_refuses_other_shapes_and_names_and_loads_nothing(tmp_path):
    path = saved(tmp_path, small_model(seed=1, vocab_size=TOKENS_A.vocab_size), TOKENS_A)
    model = small_model(seed=2, vocab_size=TOKENS_A.vocab_size, encoder_layers=SMALL.encoder_layers + 1)
    before = {n: t.clone() for n, t in model.state_dict().items()}
    with pytest.raises(ValueError, match="encoder.layers.2.* is not in it"):
        init_from(model, path, ("encoder",), TOKENS_A)
    assert all(torch.equal(before[n], t) for n, t in model.state_dict().items())
    wide = small_model(seed=2, vocab_size=TOKENS_A.vocab_size, ffn_dim=2 * SMALL.ffn_dim)
    with pytest.raises(ValueError, match=r"is \(64, 32\) there, \(128, 32\) here"):
        init_from(wide, path, ("encoder",), TOKENS_A)
    with pytest.raises(ValueError, match="choose from encoder, decoder, ctc"):
        init_from(model, path, ("frontend",), TOKENS_A)
    with pytest.raises(CheckpointError, match="missing.pt"):
        init_from(model, tmp_path / "missing.pt", ("encoder",), TOKENS_A)


def train_from(manifest, exp, flags, *overrides):
    cmd = [sys.executable, "-m", "asr.cli", "train", "--config", TINY, "--train", manifest, "--valid", manifest,
           "--exp-dir", exp, *flags, *QUIET, *overrides]
    return subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=600)


def test_asr_train_init_from_starts_from_the_other_model(tmp_path):
    """`asr train --init-from`: with a learning rate of 0 the fine-tuned run's weights are the
    other model's encoder and decoder layers, and its own fresh output layers (another corpus,
    another character set)."""
    first = make_corpus(tmp_path / "a", n=2)
    out = asr_train(first, tmp_path / "exp_a", "training.epochs=1", "data.num_workers=0")
    assert out.returncode == 0, out.stderr[-2000:]
    second = make_corpus(tmp_path / "b", n=3)  # TEXTS[2] brings letters the first corpus lacks
    out = train_from(second, tmp_path / "exp_b", ["--init-from", tmp_path / "exp_a" / "model_last.pt"],
                     "training.epochs=1", "training.lr=0.0", "data.num_workers=0")
    assert out.returncode == 0, out.stderr[-2000:]
    assert "re-initialised: its tokenizer is not this run's" in out.stderr
    a, b = weights(tmp_path / "exp_a" / "model_last.pt"), weights(tmp_path / "exp_b" / "model_last.pt")
    assert all(torch.equal(a[n], b[n]) for n in a if n.startswith(("encoder.", "decoder.layers.")))
    assert a["ctc.weight"].shape != b["ctc.weight"].shape

    bad = train_from(second, tmp_path / "exp_c", ["--init-from", tmp_path / "exp_a" / "model_last.pt",
                                                  "--init-modules", "encoder,frontend"], "training.epochs=1")
    assert bad.returncode != 0 and "choose from encoder, decoder, ctc" in bad.stderr.strip().splitlines()[-1]
