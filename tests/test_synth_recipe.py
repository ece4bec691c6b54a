"""recipes/synth/run.sh: stages run once, are skipped when done, and rerun from --stage on."""
from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import yaml

from asr.lm import NgramLM

pytest.importorskip("espeakng_loader")

ROOT = Path(__file__).resolve().parents[1]
RUN = ROOT / "recipes" / "synth" / "run.sh"


def run(tmp: Path, *args: str) -> str:
    """Run the data stages of the recipe on a tiny corpus in tmp; returns its output."""
    cmd = ["bash", str(RUN), "--num-train", "12", "--num-dev", "4", "--num-test", "4",
           "--lm-sentences", "30", "--lm-clauses", "10", "--data-dir", str(tmp / "data"),
           "--exp-dir", str(tmp / "exp"), *args,
           "tokenizer.kind=char"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


@pytest.mark.slow
def test_stages_are_skipped_when_done_and_rerun_from_stage(tmp_path):
    out = run(tmp_path, "--stop-stage", "2")
    for n in (0, 1, 2):
        assert f"stage {n} took" in out
    data = tmp_path / "data"
    assert len((data / "train.jsonl").read_text().splitlines()) == 12
    assert json.loads((data / "lang_char" / "tokenizer.json").read_text())["kind"] == "char"
    # the training words, the lexicon stage 5 decodes with
    texts = [json.loads(line)["text"] for line in (data / "train.jsonl").read_text().splitlines()]
    train_words = {w for text in texts for w in text.split()}
    assert (data / "words.txt").read_text().split() == sorted(train_words)
    # the word trigram LM of those transcripts and of the 30 + 10 sentences of lm_text.txt, which
    # rescores stage 5's beam
    more = (data / "lm_text.txt").read_text().splitlines()
    assert len(more) == 40
    lm = NgramLM.load(data / "lm.arpa")
    assert lm.order == 3 and lm.vocab_size == len(train_words | {w for s in more for w in s.split()})
    for sentence in (texts[0], more[0]):
        assert lm.score(sentence.split()) > lm.score(sentence.split()[::-1] + ["ZZZ"])
    # CMVN with the config's mel bins (conf/synth.yaml: 40), and the training features dumped beside it
    assert len(json.loads((data / "cmvn.json").read_text())["sum"]) == 40
    index = json.loads((data / "feats_train" / "index.json").read_text())
    assert index["features"]["n_mels"] == 40 and len(index["utterances"]) == 12
    stamps = {p: p.stat().st_mtime_ns for p in (data / "train.jsonl", data / "cmvn.json")}

    out = run(tmp_path, "--stop-stage", "2")
    for n in (0, 1, 2):
        assert f"stage {n} (" in out and "done before, skipped" in out
    assert "took" not in out
    assert all(p.stat().st_mtime_ns == t for p, t in stamps.items())

    out = run(tmp_path, "--stage", "2", "--stop-stage", "2")
    assert "stage 2 took" in out and "stage 0" not in out and "stage 1" not in out
    assert (data / "train.jsonl").stat().st_mtime_ns == stamps[data / "train.jsonl"]
    assert (data / "cmvn.json").stat().st_mtime_ns != stamps[data / "cmvn.json"]
    assert "stage 2" in (tmp_path / "exp" / "run.log").read_text()


def test_a_bad_override_stops_before_any_stage(tmp_path):
    cmd = ["bash", str(RUN), "--data-dir", str(tmp_path / "data"), "--exp-dir", str(tmp_path / "exp"),
           "--stage", "1", "tokenizer.kind=words"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert "stage 1" not in done.stdout
    assert "tokenizer" in done.stderr


@pytest.mark.slow
def test_stage_5_chooses_on_dev_then_decodes_dev_and_test_four_ways(tmp_path):
    """Stages 0-6 on a tiny corpus: dev and test decoded with neither lexicon nor LM, with the LM
    inside the open search (conf/decode/synth_open_lm.yaml), with the lexicon (the whole beam kept),
    and with the lexicon and the LM, its weights chosen by local/tune.py on dev's beam; stage 6's
    table gives dev beside test, per accent."""
    out = run(tmp_path, "--config", str(ROOT / "conf" / "tiny.yaml"), "--nproc", "1", "training.epochs=2")
    exp = tmp_path / "exp"
    for s in ("dev", "test"):
        for suffix in ("_open", "_open_lm", "_lexicon", ""):
            assert json.loads((exp / f"decode_{s}{suffix}" / "wer.json").read_text())["utterances"] == 4
        search = {name: json.loads((exp / f"decode_{s}_{name}" / "decode.jsonl").read_text().splitlines()[0])
                  ["header"]["search"] for name in ("open", "open_lm", "lexicon")}
        assert search["lexicon"]["nbest"] == search["lexicon"]["beam_size"] and search["lexicon"]["lexicon"]
        assert not search["open"]["lexicon"] and not search["open"]["lm"]
        shipped = yaml.safe_load((ROOT / "conf" / "decode" / "synth_open_lm.yaml").read_text())
        assert search["open_lm"]["lm"].endswith("lm.arpa") and search["open_lm"]["lm_fusion"]
        fields = {k: v for k, v in shipped.items() if k in search["open_lm"]}  # (the search's, not batching)
        assert {"beam_size", "lm_weight", "lm_word_bonus", "lm_fusion"} <= set(fields)
        assert {k: search["open_lm"][k] for k in fields} == fields and not search["open_lm"]["lexicon"]
    tuned, grid = yaml.safe_load((exp / "decode.yaml").read_text()), json.loads((exp / "tune.json").read_text())
    assert {k: tuned[k] for k in ("lm_weight", "lm_word_bonus")} == grid["chosen"]
    assert grid["manifest"].endswith("dev.jsonl") and len(grid["grid"]) > 10
    assert grid["beam"].endswith("decode_dev_lexicon")
    results = json.loads((exp / "results.json").read_text())
    assert results["corpus"]["seed"] == 0
    assert set(results["decodes"]) == {"open", "open+lm", "lexicon", "lexicon+lm"}
    assert "| open vocabulary (no lexicon, no LM) |" in out and "not decoded" not in out
    assert "en-gb-scotland" in out and "nearest training accent" in out  # the per-accent WERs, the accents' table
    assert (exp / "accents.json").exists() and "stage 6 took" in out
    # the dev sets beside dev (issue 47): dev_near always, dev_synth when Festival could be had (else
    # stage 0 said why and went on); open vocabulary only by default
    data = tmp_path / "data"
    assert json.loads((exp / "decode_dev_near_open" / "wer.json").read_text())["utterances"] == 4
    if (data / "dev_synth.jsonl").exists():
        assert json.loads((exp / "decode_dev_synth_open" / "wer.json").read_text())["utterances"] == 4
    else:
        assert (data / "dev_synth.skipped").exists() and "dev_synth) is skipped" in out
    assert not (exp / "decode_dev_near_lexicon").exists() and results["sets"]["dev_near"] == "made"
    assert "| dev: unseen accents WER / CER | dev_near: unseen voices WER / CER |" in out
