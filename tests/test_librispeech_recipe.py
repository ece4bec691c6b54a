"""The LibriSpeech recipe end to end on the real LibriSpeech utterances of ../shared/realspeech,
packed as official-looking archives in a local mirror: stages 0-7 with conf/tiny.yaml, a rerun that
skips them, an n-gram LM (--lm) in stages 6-7, then the LM stages 8-12 with a fake LM corpus (the
training transcripts) and conf/lm/synth.yaml for a few steps."""
from __future__ import annotations

import gzip
import hashlib
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RUN = ROOT / "recipes" / "librispeech" / "run.sh"
OFFICIAL = ("dev-clean", "dev-other", "test-clean", "test-other", "train-clean-100", "train-clean-360",
            "train-other-500")
# tiny.yaml with BPE and a few optimizer steps: the pipeline, not a model
OVERRIDES = ["tokenizer.kind=bpe", "tokenizer.vocab_size=200", "training.epochs=1", "training.max_steps=8",
             "training.valid_decode_utts=2"]


def pack_mirror(realspeech: Path, mirror: Path) -> list[str]:
    """<part>.tar.gz (top folder LibriSpeech/) + md5sum.txt for each part present; returns the parts."""
    mirror.mkdir()
    parts = [p for p in OFFICIAL if (realspeech / "LibriSpeech" / p).is_dir()]
    sums = []
    for part in parts:
        archive = mirror / f"{part}.tar.gz"
        with tarfile.open(archive, "w:gz", compresslevel=1) as tar:
            tar.add(realspeech / "LibriSpeech" / part, arcname=f"LibriSpeech/{part}")
        sums.append(f"{hashlib.md5(archive.read_bytes()).hexdigest()}  {archive.name}\n")
    (mirror / "md5sum.txt").write_text("".join(sums))
    return parts


@pytest.mark.slow
def test_every_stage_then_a_rerun_skips_them(realspeech, tmp_path):
    parts = pack_mirror(realspeech, tmp_path / "mirror")
    assert any(p.startswith("train-") for p in parts) and any(p.startswith("dev-") for p in parts)
    data, exp = tmp_path / "data", tmp_path / "exp"
    base = ["bash", str(RUN), "--config", str(ROOT / "conf" / "tiny.yaml"), "--mirror", str(tmp_path / "mirror"),
            "--parts", ",".join(parts), "--data-dir", str(data), "--exp-dir", str(exp), "--beam-size", "4",
            "--average-num", "2", *OVERRIDES]
    cmd = [*base, "--stop-stage", "7"]  # the acoustic model; the LM stages come last
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    first = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1500)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    for n in range(8):
        assert f"stage {n} took" in first.stdout

    sets = [p for p in parts if p.startswith(("dev-", "test-"))]
    rows = [line for line in (exp / "RESULTS.md").read_text().splitlines() if line.startswith("| ")]
    assert [row.split("|")[1].strip() for row in rows[1:]] == sets
    for name in sets:
        wer = json.loads((exp / "decode_default_beam4" / name / "wer.json").read_text())
        assert wer["utterances"] > 0 and wer["skipped"] == 0
    manifests = data / f"{'+'.join(parts)}_sp"
    train_ids = [json.loads(line)["id"] for line in (manifests / "train.jsonl").read_text().splitlines()]
    assert sum(i.startswith("sp0.9-") for i in train_ids) == sum(i.startswith("sp1.1-") for i in train_ids) > 0
    assert (exp / "model_avg.pt").is_file() and "stage 7" in (exp / "run.log").read_text()

    again = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert again.stdout.count("done before, skipped") == 8
    assert " took " not in again.stdout

    # a word LM of the training transcripts (gzip-compressed, as published LMs are): stages 6-7
    # again, into their own folders, the run without it kept
    lm = tmp_path / "train.3gram.arpa.gz"
    made = subprocess.run([sys.executable, "-m", "asr.cli", "lm", "--manifest", str(manifests / "train.jsonl"),
                           "--out", str(lm)], capture_output=True, text=True)
    assert made.returncode == 0, made.stderr
    with_lm = subprocess.run([*cmd, "--lm", str(lm), "--lm-weight", "0.5"], capture_output=True, text=True, env=env,
                             timeout=600)
    assert with_lm.returncode == 0, with_lm.stdout[-3000:] + with_lm.stderr[-3000:]
    assert "stage 6 took" in with_lm.stdout and "stage 7 took" in with_lm.stdout
    assert with_lm.stdout.count("done before, skipped") == 6
    for name in sets:
        wer = json.loads((exp / "decode_default_beam4_lmtrain.3gram_w0.5" / name / "wer.json").read_text())
        assert wer["decoding"]["lm"] == str(lm) and wer["decoding"]["lm_weight"] == 0.5
    assert "LM train.3gram.arpa.gz (weight 0.5)" in (exp / "RESULTS_lm.md").read_text()
    assert "LM" not in (exp / "RESULTS.md").read_text()

    # the LM stages: a fake LM corpus (the training transcripts) in a local mirror, a small
    # transformer LM for a few steps, decoding with it fused; RESULTS_lm.md then holds both tables
    lm_mirror = tmp_path / "lm_mirror"
    lm_mirror.mkdir()
    texts = [json.loads(line)["text"] for line in (manifests / "train.jsonl").read_text().splitlines()]
    corpus = gzip.compress("".join(f"{t}\n" for t in texts).encode())
    (lm_mirror / "librispeech-lm-norm.txt.gz").write_bytes(corpus)
    (lm_mirror / "md5sum.txt").write_text(f"{hashlib.md5(corpus).hexdigest()}  librispeech-lm-norm.txt.gz\n")
    lm_cmd = [*base, "--lm-mirror", str(lm_mirror), "--lm-config", str(ROOT / "conf" / "lm" / "synth.yaml"),
              "--lm-override", "training.max_steps=4", "--lm-override", "data.max_batch_tokens=2048"]
    lm_run = subprocess.run(lm_cmd, capture_output=True, text=True, env=env, timeout=900)
    assert lm_run.returncode == 0, lm_run.stdout[-3000:] + lm_run.stderr[-3000:]
    assert lm_run.stdout.count("done before, skipped") == 8
    for n in range(8, 13):
        assert f"stage {n} took" in lm_run.stdout
    lm_exp = tmp_path / f"lm_synth_{manifests.name}_lang_bpe200"
    assert (lm_exp / "lm_avg.pt").is_file()
    for name in sets:
        wer = json.loads((exp / f"decode_default_beam4_{lm_exp.name}_w0.6" / name / "wer.json").read_text())
        assert wer["utterances"] > 0 and wer["decoding"]["lm"] == str(lm_exp / "lm_avg.pt")
        assert wer["decoding"]["lm_weight"] == 0.6
    titles = [line for line in (exp / "RESULTS_lm.md").read_text().splitlines() if line.startswith("# ")]
    assert len(titles) == 2 and "train.3gram.arpa.gz" in titles[0] and f"transformer LM {lm_exp.name}" in titles[1]
    lm_again = subprocess.run(lm_cmd, capture_output=True, text=True, env=env, timeout=300)
    assert lm_again.returncode == 0 and lm_again.stdout.count("done before, skipped") == 13
