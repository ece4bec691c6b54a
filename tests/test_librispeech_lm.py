"""The LM text of the LibriSpeech recipe (stage 8, local/download_lm.py) on a small fake
librispeech-lm-norm.txt.gz: HTTP and local mirrors, a resumed .part, a transfer cut short, a
corrupt gzip fetched again, md5 failures in one line, a verified file skipped; run.sh's stage 8
(the corpus + the training transcripts without speed-perturbed copies); RESULTS_lm.md collecting
several decodings (local/results.py --merge). The LM stages end to end (9-12): the slow test of
tests/test_librispeech_recipe.py."""
from __future__ import annotations

import gzip
import hashlib
import importlib.util
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
from test_librispeech_download import archive_requests, http_mirror, md5sum_txt, serve  # noqa: F401 (a fixture)

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes" / "librispeech"
NAME = "librispeech-lm-norm.txt.gz"


def load_download_lm():
    """local/download_lm.py imports its neighbour download.py, as it does when run.sh runs it."""
    local = str(RECIPE / "local")
    sys.path.insert(0, local)
    try:
        return importlib.import_module("download_lm")
    finally:
        sys.path.remove(local)


download_lm = load_download_lm()


def load_results():
    spec = importlib.util.spec_from_file_location("librispeech_results", RECIPE / "local" / "results.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def lm_text(lines: int = 3000, seed: int = 0) -> bytes:
    """A gzip file shaped like the real one: upper-case sentences, one a line (~100 KB compressed)."""
    rng = random.Random(seed)
    words = ["".join(rng.choice("ABCDEFGHIJKLMNOPRSTUVWY'") for _ in range(rng.randint(1, 9))) for _ in range(500)]
    text = "".join(" ".join(rng.choices(words, k=rng.randint(3, 25))) + "\n" for _ in range(lines))
    return gzip.compress(text.encode(), compresslevel=6, mtime=0)  # the same bytes every call


def run(*args: str | Path) -> int:
    return download_lm.main([str(a) for a in args] + ["--retry-wait", "0"])


def fetched(folder: Path, data: bytes) -> bool:
    return (folder / NAME).read_bytes() == data and (folder / f".done-{NAME}").is_file() and \
        not (folder / f"{NAME}.part").exists()


def test_http_download_is_verified_then_skipped(tmp_path, http_mirror, capsys):  # noqa: F811 (the fixture)
    data = lm_text()
    serve(http_mirror, {NAME: [data]})
    assert run("--download-dir", tmp_path, "--mirror", http_mirror.url) == 0
    assert fetched(tmp_path, data) and archive_requests(http_mirror, NAME) == [None]
    out = capsys.readouterr().out
    assert "3,000 lines" in out and "verified" in out
    http_mirror.requests.clear()
    assert run("--download-dir", tmp_path, "--mirror", http_mirror.url) == 0
    assert "verified before, skipped" in capsys.readouterr().out
    assert http_mirror.requests == []  # not even md5sum.txt


def test_partial_file_is_resumed_and_a_cut_transfer_continued(tmp_path, http_mirror):  # noqa: F811
    data = lm_text()
    serve(http_mirror, {NAME: [data]})
    (tmp_path / f"{NAME}.part").write_bytes(data[:1000])
    http_mirror.drop_once.add(f"resources/12/{NAME}")  # the resumed transfer stops half-way once
    assert run("--download-dir", tmp_path, "--mirror", http_mirror.url) == 0
    half = 1000 + (len(data) - 1000) // 2
    assert archive_requests(http_mirror, NAME) == ["bytes=1000-", f"bytes={half}-"]
    assert fetched(tmp_path, data)


@pytest.mark.parametrize("damage", ["truncated", "flipped byte"])
def test_corrupt_gzip_is_deleted_and_fetched_again(tmp_path, http_mirror, capsys, monkeypatch, damage):  # noqa: F811
    monkeypatch.setattr(download_lm, "KNOWN_MD5", {})  # no md5 anywhere: the gzip check alone catches it
    data = lm_text()
    bad = bytearray(data[:-300] if damage == "truncated" else data)
    if damage == "flipped byte":
        bad[len(bad) // 2] ^= 0xFF
    serve(http_mirror, {NAME: [bytes(bad), data]}, md5_of={})
    assert run("--download-dir", tmp_path, "--mirror", http_mirror.url) == 0
    out = capsys.readouterr().out
    assert "broken gzip stream" in out and "no md5 known" in out
    assert archive_requests(http_mirror, NAME) == [None, None]  # fetched again from the start
    assert fetched(tmp_path, data)


def test_md5_mismatch_is_one_line_after_the_attempts(tmp_path, http_mirror, capsys):  # noqa: F811
    data = lm_text()
    serve(http_mirror, {NAME: [data]}, md5_of={NAME: lm_text(seed=1)})
    assert run("--download-dir", tmp_path, "--mirror", http_mirror.url, "--attempts", "2") == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert err.startswith(f"download_lm.py: error: {NAME}: giving up after 2 attempts")
    assert f"md5 {hashlib.md5(data).hexdigest()}, expected {hashlib.md5(lm_text(seed=1)).hexdigest()}" in err
    assert "md5sum.txt" in err
    assert len(archive_requests(http_mirror, NAME)) == 2
    assert not (tmp_path / NAME).exists() and not (tmp_path / f".done-{NAME}").exists()


def test_folder_mirror_without_md5sum_uses_the_known_sum(tmp_path, capsys):
    mirror = tmp_path / "mirror"
    mirror.mkdir()
    (mirror / NAME).write_bytes(lm_text())
    assert run("--download-dir", tmp_path / "dl", "--mirror", mirror, "--attempts", "1") == 1
    err = capsys.readouterr().err
    assert download_lm.KNOWN_MD5[NAME][0] in err and len(err.strip().splitlines()) == 1
    (mirror / "md5sum.txt").write_bytes(md5sum_txt({NAME: lm_text()}))  # the mirror's own sums come first
    assert run("--download-dir", tmp_path / "dl", "--mirror", mirror) == 0
    assert fetched(tmp_path / "dl", lm_text())


def test_run_sh_stage8_downloads_and_writes_the_transcripts(tmp_path):
    """Stage 8 through run.sh: --lm-mirror, --download-dir, the transcripts without speed copies."""
    mirror = tmp_path / "mirror"
    mirror.mkdir()
    (mirror / NAME).write_bytes(lm_text())
    (mirror / "md5sum.txt").write_bytes(md5sum_txt({NAME: lm_text()}))
    data = tmp_path / "data"
    mf = data / "dev-clean+train-clean-100_sp"
    mf.mkdir(parents=True)
    utts = [{"id": "19-198-0000", "audio": "a.flac", "duration": 1.0, "text": "NORTHANGER ABBEY"},
            {"id": "sp0.9-19-198-0000", "audio": "a.flac", "duration": 1.1, "text": "NORTHANGER ABBEY", "speed": 0.9},
            {"id": "19-198-0001", "audio": "b.flac", "duration": 1.0, "text": "CATHERINE  MORLAND"}]
    (mf / "train.jsonl").write_text("".join(json.dumps(u) + "\n" for u in utts))
    cmd = ["bash", str(RECIPE / "run.sh"), "--config", str(ROOT / "conf" / "tiny.yaml"), "--stage", "8",
           "--stop-stage", "8", "--parts", "dev-clean,train-clean-100", "--data-dir", str(data),
           "--download-dir", str(tmp_path / "dl"), "--exp-dir", str(tmp_path / "exp"), "--lm-mirror", str(mirror)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    first = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert first.returncode == 0, first.stdout[-2000:] + first.stderr[-2000:]
    assert fetched(tmp_path / "dl", lm_text())
    assert (mf / "lm_train.txt").read_text() == "NORTHANGER ABBEY\nCATHERINE MORLAND\n"
    assert "stage 8 took" in first.stdout and (mf / ".done-stage8").is_file()
    (mirror / NAME).unlink()  # a rerun needs nothing from the mirror
    again = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert again.returncode == 0, again.stdout[-2000:] + again.stderr[-2000:]
    assert "verified before, skipped" in again.stdout


def test_results_tables_merge_into_one_file(tmp_path):
    results = load_results()
    exp = tmp_path / "exp"
    wer = {"wer": 0.1, "cer": 0.05, "substitutions": 1, "deletions": 0, "insertions": 0, "words": 10,
           "utterances": 2, "skipped": 0}
    for name in ("decode_a_lmx_w0.3", "decode_a_lm_y_w0.6"):
        (exp / name / "dev-clean").mkdir(parents=True)
        (exp / name / "dev-clean" / "wer.json").write_text(json.dumps(wer))
    out = exp / "RESULTS_lm.md"

    def table(name: str, title: str) -> None:
        assert results.main(["--exp-dir", str(exp), "--decode-name", name, "--sets", "dev-clean", "--title", title,
                             "--out", str(out), "--merge"]) == 0

    table("decode_a_lmx_w0.3", "n-gram")
    table("decode_a_lm_y_w0.6", "transformer")
    wer["wer"] = 0.2
    (exp / "decode_a_lmx_w0.3" / "dev-clean" / "wer.json").write_text(json.dumps(wer))
    table("decode_a_lmx_w0.3", "n-gram again")  # replaced in place
    text = out.read_text()
    assert [line for line in text.splitlines() if line.startswith("# ")] == ["# n-gram again", "# transformer"]
    assert "| dev-clean | 2 | 10 | 20.00 |" in text and "| dev-clean | 2 | 10 | 10.00 |" in text

