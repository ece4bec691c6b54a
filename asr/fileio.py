"""Small file helpers shared by the library: atomic writes and line-numbered text tables.

Standard library only and imports nothing of ours, so that every module (config, metrics,
tokenizer and audio included, which DESIGN.md lets import nothing else of ours) may use it.

    with atomic_open("out/cmvn.json") as f:      # readers see the old file or the whole new one
        f.write(text)
    table = read_table("data/train/text")         # {"utt1": (1, "HELLO WORLD"), ...}
"""
from __future__ import annotations

import os
import secrets
from collections.abc import Iterator
from contextlib import contextmanager
from typing import IO

__all__ = ["TextFileError", "atomic_open", "numbered_lines", "read_table"]


@contextmanager
def atomic_open(path: str | os.PathLike, mode: str = "w", encoding: str | None = "utf-8") -> Iterator[IO]:
    """Open a temporary file beside `path` for writing; on a clean exit flush it, fsync it and
    rename it over `path` (os.replace), so that readers see either the old file or the whole new
    one, even after a crash. On an exception the temporary file is removed and `path` untouched.

    mode: "w" (text, `encoding`) or "wb" (binary; `encoding` ignored). The folder must exist.
    The file gets the permissions of a plain open() (0o666 less the umask).
    """
    if mode not in ("w", "wb"):
        raise ValueError(f"atomic_open: mode must be 'w' or 'wb', got {mode!r}")
    path = os.fspath(path)
    folder, name = os.path.split(path)
    tmp = os.path.join(folder, f".{name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with open(fd, mode, encoding=None if "b" in mode else encoding) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


class TextFileError(ValueError):
    """A text file or table that cannot be read: one line, "path:line: reason" or "path: reason"."""


def numbered_lines(path: str | os.PathLike) -> Iterator[tuple[int, str]]:
    """(line number from 1, stripped line) of the non-blank lines of a UTF-8 text file (a BOM
    is allowed). Lines end at "\\n" only (not at U+2028, which JSON text may hold).
    TextFileError for a missing or unreadable file or bytes that are not UTF-8 (naming the line)."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        raise TextFileError(f"{path}: no such file") from None
    except OSError as e:
        raise TextFileError(f"{path}: cannot read: {e.strerror or e}") from None
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line_no = data[: e.start].count(b"\n") + 1
        raise TextFileError(f"{path}:{line_no}: not UTF-8 text") from None
    for n, line in enumerate(text.split("\n"), 1):
        if line.strip():
            yield n, line.strip()


def read_table(path: str | os.PathLike) -> dict[str, tuple[int, str]]:
    """A Kaldi-style "ID REST" file (text, wav.scp, segments, utt2spk, trans.txt) ->
    {id: (line number, rest)}, in file order; `rest` is "" for an id alone on its line.
    Errors as `numbered_lines`, and TextFileError "path:line: duplicate id X (first on line N)"."""
    table: dict[str, tuple[int, str]] = {}
    for n, line in numbered_lines(path):
        key, *rest = line.split(maxsplit=1)
        if key in table:
            raise TextFileError(f"{path}:{n}: duplicate id {key} (first on line {table[key][0]})")
        table[key] = (n, rest[0] if rest else "")
    return table
