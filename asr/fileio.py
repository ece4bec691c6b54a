"""Small file helpers shared by the library: atomic writes and line-numbered text tables.

Standard library only and imports nothing of ours, so that every module (config, metrics,
tokenizer and audio included, which DESIGN.md lets import nothing else of ours) may use it.

    with atomic_open("out/cmvn.json") as f:      # readers see the old file or the whole new one
        f.write(text)
    table = read_table("data/train/text")         # {"utt1": (1, "HELLO WORLD"), ...}
"""
from __future__ import annotations

import logging
import os
import re
import secrets
from collections.abc import Iterator
from contextlib import contextmanager
from typing import IO

__all__ = ["TextFileError", "atomic_open", "numbered_lines", "read_table", "remove_stale_temporaries"]

log = logging.getLogger("asr.fileio")

# The temporary file of atomic_open: ".<name>.<writer's pid>.<8 hex digits>.tmp" beside the target.
_TEMPORARY = re.compile(r"\.(?P<name>.+)\.(?P<pid>[0-9]+)\.[0-9a-f]{8}\.tmp")


@contextmanager
def atomic_open(path: str | os.PathLike, mode: str = "w", encoding: str | None = "utf-8") -> Iterator[IO]:
    """Open a temporary file beside `path` for writing; on a clean exit flush it, fsync it and
    rename it over `path` (os.replace), so that readers see either the old file or the whole new
    one, even after a crash. On an exception the temporary file is removed and `path` untouched.
    A writer killed outright (SIGKILL, power loss) leaves its ".<name>.<pid>.<hex>.tmp"; the next
    atomic_open in the folder removes it (`remove_stale_temporaries`).

    mode: "w" (text, `encoding`) or "wb" (binary; `encoding` ignored). The folder must exist.
    The file gets the permissions of a plain open() (0o666 less the umask).
    """
    if mode not in ("w", "wb"):
        raise ValueError(f"atomic_open: mode must be 'w' or 'wb', got {mode!r}")
    path = os.fspath(path)
    folder, name = os.path.split(path)
    remove_stale_temporaries(folder or ".")
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


def remove_stale_temporaries(folder: str | os.PathLike) -> list[str]:
    """Remove the temporary files of `atomic_open` writers that were killed before renaming them:
    ".<name>.<pid>.<8 hex digits>.tmp" whose pid is no live process of this machine (a zombie
    counts as dead). Returns the names removed; a missing folder or a file that cannot be removed
    is left alone (never an error). Meant for folders written from one machine, as the toolkit's
    are (rank 0 writes for every rank): a pid says nothing about other machines' processes."""
    try:
        entries = [e.name for e in os.scandir(folder) if e.name.endswith(".tmp") and e.name.startswith(".")]
    except OSError:
        return []
    removed = []
    for name in entries:
        match = _TEMPORARY.fullmatch(name)
        if match is None or _alive(int(match["pid"])):
            continue
        try:
            os.unlink(os.path.join(folder, name))
        except OSError:
            continue
        log.info("removed %s, left in %s by a writer that was killed (pid %s)", name, folder, match["pid"])
        removed.append(name)
    return removed


def _alive(pid: int) -> bool:
    """Whether `pid` is a running (not zombie) process of this machine; ours always is."""
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    except OverflowError:  # not a pid at all
        return False
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[-1].split()[0]  # after "pid (command)"
    except OSError:  # no /proc (not Linux): os.kill found it
        return True
    return state != b"Z"


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
