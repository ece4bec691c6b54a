"""Dumped features: the fbank of each utterance (no dither, before CMVN) in one float16 file and
an index, read through a memory map so that every loader process shares the page cache.

`asr cmvn --dump-feats DIR` writes an archive (asr.loader.compute_cmvn, through `ArchiveWriter`);
`asr train --feats DIR` reads it (`FeatureArchive`, given to asr.dataset.ASRDataset). An entry
is used only while the utterance's audio file, segment, speed and duration are as they were.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import secrets
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from asr.features import FeatureConfig
from asr.fileio import atomic_open
from asr.manifest import Utterance

__all__ = ["ARCHIVE_FORMAT", "ArchiveWriter", "FeatureArchive", "FeatureArchiveError"]

logger = logging.getLogger(__name__)


class FeatureArchiveError(ValueError):
    """A feature archive that cannot be used: "<folder>: <reason>", one line."""


ARCHIVE_FORMAT = "asr-feature-archive-1"


def _source_key(utt: Utterance) -> str:
    """What an utterance's features depend on besides the frontend: its audio file (path, size and
    modification time), segment, speed and manifest duration (the dataset's length check, which
    read features skip). A rewritten file no longer matches its dumped features."""
    try:
        st = os.stat(utt.audio)
        stamp = f"{st.st_size}|{st.st_mtime_ns}"
    except OSError:
        stamp = "missing"
    return f"{os.path.abspath(utt.audio)}|{utt.start}|{utt.end}|{utt.speed}|{utt.duration}|{stamp}"


def _archived_settings(features: FeatureConfig) -> dict:
    """The frontend settings dumped features depend on: all but dither (they have none)."""
    return {k: v for k, v in dataclasses.asdict(features).items() if k != "dither"}


class ArchiveWriter:
    """Writes the frames (float16, row after row) to DIR/feats-<token>.f16, a new file each dump,
    then DIR/index.json atomically, naming that file: the index's rename is the one commit point,
    so readers see the old archive or the new one, never an index over another dump's data. Data
    files no index names are removed after the commit. A dump without a single frame commits
    nothing (the previous archive stays)."""

    def __init__(self, folder: str | os.PathLike, features: FeatureConfig):
        self.folder, self.features = Path(folder), features
        self.entries: dict[str, list] = {}
        self.frames = 0

    def __enter__(self) -> ArchiveWriter:
        self.folder.mkdir(parents=True, exist_ok=True)
        self.name = f"feats-{secrets.token_hex(6)}.f16"
        self._file = open(self.folder / self.name, "xb")
        return self

    def add(self, utt: Utterance, feats: torch.Tensor) -> None:
        """Append the (T, D) features of `utt`."""
        rows = feats.to(torch.float16).numpy()
        self._file.write(rows.tobytes())
        self.entries[utt.id] = [self.frames, rows.shape[0], _source_key(utt)]
        self.frames += rows.shape[0]

    def __exit__(self, *exc: Any) -> None:
        data = self.folder / self.name
        try:
            self._file.flush()
            os.fsync(self._file.fileno())
        finally:
            self._file.close()
        if exc[0] is not None or self.frames == 0:
            data.unlink()
            if exc[0] is None:
                logger.warning("%s: no features to dump; the folder is left as it was", self.folder)
            return
        index = {"format": ARCHIVE_FORMAT, "features": _archived_settings(self.features), "data": self.name,
                 "frames": self.frames, "utterances": self.entries}
        with atomic_open(self.folder / "index.json") as f:
            json.dump(index, f)
        for old in self.folder.glob("feats-*.f16"):
            if old.name != self.name:
                old.unlink(missing_ok=True)
        logger.info("%s: features of %d utterances (%d frames, float16)", self.folder, len(self.entries),
                    self.frames)


class FeatureArchive:
    """Features dumped by `compute_cmvn(..., dump_dir=DIR)`: the fbank (no dither, before CMVN) of
    each utterance, read through a memory map (the page cache is shared by all loader processes).

    `rows(utts)` gives, per utterance, where its features are, or -1 when the archive does not
    have them as they are now (not dumped, or the audio file, segment, speed or duration changed
    since): those are computed as usual."""

    def __init__(self, folder: str | os.PathLike, features: FeatureConfig):
        self.folder = Path(folder)
        where = self.folder / "index.json"
        try:
            index = json.loads(where.read_text(encoding="utf-8"))
        except OSError as e:
            raise FeatureArchiveError(f"{self.folder}: no feature archive ({e.strerror or e})") from None
        except json.JSONDecodeError as e:
            raise FeatureArchiveError(f"{where}: not JSON (line {e.lineno}: {e.msg})") from None
        ok = (isinstance(index, dict) and index.get("format") == ARCHIVE_FORMAT
              and isinstance(index.get("features"), dict) and isinstance(index.get("data"), str)
              and isinstance(index.get("frames"), int) and isinstance(index.get("utterances"), dict))
        if not ok:
            raise FeatureArchiveError(f"{where}: not a feature archive index ({ARCHIVE_FORMAT})")
        wanted, have = _archived_settings(features), index["features"]
        if have != wanted:
            changed = sorted(k for k in wanted.keys() | have.keys() if have.get(k) != wanted.get(k))
            raise FeatureArchiveError(f"{self.folder}: dumped with other features ({', '.join(changed)} differ "
                                      "from data.features); dump them again")
        self.dim, self.frames = features.n_mels, index["frames"]
        self.data = self.folder / Path(index["data"]).name
        size = self.data.stat().st_size if self.data.is_file() else -1
        if size != self.frames * self.dim * 2:
            raise FeatureArchiveError(f"{self.data}: {size} bytes, the index says "
                                      f"{self.frames * self.dim * 2}; dump the features again")
        self._entries: dict[str, list] | None = index["utterances"]
        self._data: np.ndarray | None = None  # opened in the process that reads (loader workers)

    def rows(self, utts: Sequence[Utterance]) -> tuple[np.ndarray, np.ndarray]:
        """(offsets (N,) int64, -1 where not usable; frames (N,) int64) of `utts`."""
        if self._entries is None:
            raise RuntimeError("FeatureArchive.rows: the index is only kept in the process that opened it")
        offsets, frames = np.full(len(utts), -1, np.int64), np.zeros(len(utts), np.int64)
        for i, utt in enumerate(utts):
            entry = self._entries.get(utt.id)
            if (isinstance(entry, list) and len(entry) == 3 and entry[2] == _source_key(utt)
                    and 0 <= entry[0] and 0 < entry[1] and entry[0] + entry[1] <= self.frames):
                offsets[i], frames[i] = entry[0], entry[1]
        return offsets, frames

    def read(self, offset: int, frames: int) -> torch.Tensor:
        """(frames, D) float32 features starting at row `offset`."""
        if self._data is None:
            self._data = np.memmap(self.data, dtype=np.float16, mode="r", shape=(self.frames, self.dim))
        return torch.from_numpy(self._data[offset:offset + frames].astype(np.float32))

    def __getstate__(self) -> dict:
        # a worker maps the file itself, and needs no index: the dataset holds the rows
        return {**self.__dict__, "_data": None, "_entries": None}
