"""asr.fileio: atomic writes and the one Kaldi "ID REST" table reader (shared by data and metrics)."""
from __future__ import annotations

import os
import stat

import pytest

from asr import fileio
from asr.fileio import TextFileError, atomic_open, numbered_lines, read_table
from asr.manifest import read_transcripts


def test_atomic_open_writes_text_and_bytes(tmp_path, monkeypatch):
    synced = []
    real_fsync = os.fsync
    monkeypatch.setattr(fileio.os, "fsync", lambda fd: (synced.append(fd), real_fsync(fd)))
    with atomic_open(tmp_path / "a.txt") as f:
        f.write("héllo\n")
    with atomic_open(tmp_path / "b.bin", "wb") as f:
        f.write(b"\x00\x01")
    assert (tmp_path / "a.txt").read_text(encoding="utf-8") == "héllo\n"
    assert (tmp_path / "b.bin").read_bytes() == b"\x00\x01"
    assert len(synced) == 2 and sorted(p.name for p in tmp_path.iterdir()) == ["a.txt", "b.bin"]


def test_atomic_open_failure_keeps_the_old_file(tmp_path):
    path = tmp_path / "keep.json"
    path.write_text("old")
    with pytest.raises(RuntimeError, match="boom"):
        with atomic_open(path) as f:
            f.write("half a ne")
            raise RuntimeError("boom")
    assert path.read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["keep.json"]


def test_atomic_open_permissions_like_open(tmp_path):
    with open(tmp_path / "plain", "w") as f:
        f.write("x")
    with atomic_open(tmp_path / "atomic") as f:
        f.write("x")
    mode = [stat.S_IMODE(os.stat(tmp_path / name).st_mode) for name in ("plain", "atomic")]
    assert mode[0] == mode[1]


def test_atomic_open_bad_mode(tmp_path):
    with pytest.raises(ValueError, match="mode"):
        with atomic_open(tmp_path / "x", "a"):
            pass


def test_numbered_lines(tmp_path):
    path = tmp_path / "t"
    path.write_bytes("\ufeffa 1\n\n  b 2 \r\nc \u2028 3\n".encode())
    assert list(numbered_lines(path)) == [(1, "a 1"), (3, "b 2"), (4, "c \u2028 3")]
    path.write_bytes(b"ok\nbad \xff\n")
    with pytest.raises(TextFileError, match=r"t:2: not UTF-8 text"):
        list(numbered_lines(path))
    with pytest.raises(TextFileError, match="absent: no such file"):
        list(numbered_lines(tmp_path / "absent"))


def test_read_table_and_duplicates(tmp_path):
    path = tmp_path / "text"
    path.write_text("u1 A B\nu2\n\nu3\t C  D \n")
    assert read_table(path) == {"u1": (1, "A B"), "u2": (2, ""), "u3": (4, "C  D")}
    path.write_text("u1 A\nu2 B\nu1 C\n")
    with pytest.raises(TextFileError, match=r"text:3: duplicate id u1 \(first on line 1\)"):
        read_table(path)


def test_one_reader_for_data_and_metrics(tmp_path):
    """manifest.read_transcripts (asr wer) and the Kaldi import of asr.corpora read tables alike."""
    from asr.corpora import _read_table
    from asr.manifest import ManifestError

    path = tmp_path / "text"
    path.write_text("u1 HELLO  WORLD\nu2\n")
    assert read_transcripts(path) == {uid: rest for uid, (_, rest) in _read_table(path).items()}
    path.write_text("u1 A\nu1 B\n")
    for reader, error in ((read_transcripts, ValueError), (_read_table, ManifestError)):
        with pytest.raises(error, match=r"text:2: duplicate id u1 \(first on line 1\)"):
            reader(path)
