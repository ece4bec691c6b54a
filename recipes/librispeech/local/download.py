"""Download, verify and unpack LibriSpeech archives (stage 0 of recipes/librispeech/run.sh).

    python local/download.py --parts dev-clean,train-clean-100 --data-dir DATA
                             [--download-dir DIR] [--mirror URL_OR_FOLDER] [--attempts 3]

For each part, DIR/<part>.tar.gz is fetched from the mirror (an HTTP(S) URL base, by default the
official one, or a local folder holding the archives), resuming DIR/<part>.tar.gz.part where an
earlier transfer stopped (an HTTP Range request, or a seek in a local file). Its md5 is checked
against the mirror's md5sum.txt, or against the official sums below when the mirror has none,
and it is unpacked into DATA/LibriSpeech/<part>; DATA/LibriSpeech/.done-<part> then marks the part
as installed, and a later run skips it without touching the network. An archive already in DIR is
verified and used as it is.

A corrupt archive (md5 mismatch, or a gzip/tar stream that breaks while unpacking) is deleted and
fetched again; a transfer that fails is resumed; after --attempts tries in all the part fails with
one line naming the archive and the last reason. Unpacking is safe: a member outside LibriSpeech/
(an absolute path, a '..' component, a link leaving the folder, a device file) is refused.

The mirrors, the transfer and `obtain` (fetch, verify, retry) serve local/download_lm.py too.
"""
from __future__ import annotations

import argparse
import gzip
import hashlib
import http.client
import shutil
import sys
import tarfile
import time
import urllib.error
import urllib.request
import zlib
from collections.abc import Callable
from functools import cached_property
from pathlib import Path, PurePosixPath
from typing import BinaryIO

OFFICIAL_MIRROR = "https://www.openslr.org/resources/12"
# The publisher's md5sum.txt (https://www.openslr.org/resources/12/md5sum.txt), used when a
# mirror has none.
OFFICIAL_MD5 = {
    "dev-clean": "42e2234ba48799c1f50f24a7926300a1",
    "dev-other": "c8d0bcc9cca99d4f8b62fcc847357931",
    "test-clean": "32fa31d27d2e1cad72775fee3f4849a9",
    "test-other": "fb5a50374b501bb3bac4815ee91d3135",
    "train-clean-100": "2a93770f6d5c6c964bc36631d331a522",
    "train-clean-360": "c0e676e450a7ff2f54aeade5171606fa",
    "train-other-500": "d1a0fd59409feb2c614ce4d30c387708",
}
PARTS = tuple(OFFICIAL_MD5)
OFFICIAL_SUMS = {f"{part}.tar.gz": (md5, "the official md5sum.txt") for part, md5 in OFFICIAL_MD5.items()}
CHUNK = 1 << 20  # bytes per read
TIMEOUT = 60.0  # seconds without data before a transfer counts as failed


class DownloadError(Exception):
    """A failure to report and stop on (no retry helps)."""


class TransferError(DownloadError):
    """The transfer broke off: retry, resuming the .part file."""


class CorruptArchive(DownloadError):
    """The archive's bytes are wrong: delete it and fetch it again."""


# ---------------------------------------------------------------------------------------------
# mirrors: an HTTP(S) URL base or a local folder, each with an optional md5sum.txt


class Mirror:
    """Where the archives come from; `fetch` writes <dest>.part and renames it to <dest>.
    `known` holds the md5 sums to use when the mirror has no md5sum.txt: {name: (md5, source)}."""

    location: str
    known: dict[str, tuple[str, str]]

    def fetch(self, name: str, dest: Path) -> None:
        raise NotImplementedError

    def read_md5sum_txt(self) -> str | None:
        """The text of the mirror's md5sum.txt, None when it has none."""
        raise NotImplementedError

    @cached_property
    def md5sums(self) -> dict[str, tuple[str, str]]:
        """{archive name: (md5, where the sum comes from)}: the mirror's, else the known ones."""
        sums = dict(self.known)
        try:
            text = self.read_md5sum_txt()
        except DownloadError as e:
            print(f"warning: {e}; using the md5 sums known beforehand", flush=True)
            text = None
        if text is None:
            return sums
        source = f"{self.location}/md5sum.txt"
        for line in text.splitlines():
            fields = line.split()
            if len(fields) == 2 and len(fields[0]) == 32:
                sums[fields[1].lstrip("*")] = (fields[0].lower(), source)
        return sums


class HttpMirror(Mirror):
    def __init__(self, url: str, known: dict[str, tuple[str, str]], timeout: float = TIMEOUT):
        self.location, self.known, self.timeout = url.rstrip("/"), known, timeout

    def read_md5sum_txt(self) -> str | None:
        url = f"{self.location}/md5sum.txt"
        try:
            with urllib.request.urlopen(url, timeout=self.timeout) as resp:
                return resp.read().decode("utf-8", errors="replace")
        except urllib.error.HTTPError as e:
            if e.code == 404:
                return None
            raise DownloadError(f"{url}: HTTP {e.code} {e.reason}") from None
        except (urllib.error.URLError, OSError, http.client.HTTPException) as e:
            raise DownloadError(f"{url}: {one_line(e)}") from None

    def fetch(self, name: str, dest: Path) -> None:
        url, part = f"{self.location}/{name}", _part_file(dest)
        offset = part.stat().st_size if part.exists() else 0
        headers = {"Range": f"bytes={offset}-"} if offset else {}
        try:
            resp = urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=self.timeout)
        except urllib.error.HTTPError as e:
            if e.code == 416 and offset:  # nothing after `offset`: the .part already holds it all
                part.rename(dest)
                return
            if e.code in (401, 403, 404, 410):
                raise DownloadError(f"{url}: HTTP {e.code} {e.reason}") from None
            raise TransferError(f"{url}: HTTP {e.code} {e.reason}") from None
        except (urllib.error.URLError, OSError, http.client.HTTPException) as e:
            raise TransferError(f"{url}: {one_line(e)}") from None
        with resp:
            if resp.status != 206 or not _range_starts_at(resp.headers.get("Content-Range", ""), offset):
                offset = 0  # the server sent the whole file
            length = resp.headers.get("Content-Length")
            total = offset + int(length) if length and length.isdigit() else None
            print(f"{url}: {'resuming at ' + human_size(offset) if offset else 'downloading'}"
                  f"{' of ' + human_size(total) if total else ''}", flush=True)
            _check_space(part, (total or 0) - offset)
            with part.open("ab" if offset else "wb") as out:
                _copy(resp.read, out, offset, total, url)
        if total is not None and part.stat().st_size != total:
            raise TransferError(f"{url}: the transfer stopped at {part.stat().st_size} of {total} bytes")
        part.rename(dest)


class FolderMirror(Mirror):
    def __init__(self, folder: Path, known: dict[str, tuple[str, str]]):
        self.folder, self.location, self.known = folder, str(folder), known

    def read_md5sum_txt(self) -> str | None:
        path = self.folder / "md5sum.txt"
        return path.read_text(encoding="utf-8", errors="replace") if path.is_file() else None

    def fetch(self, name: str, dest: Path) -> None:
        src, part = self.folder / name, _part_file(dest)
        if not src.is_file():
            raise DownloadError(f"{src}: no such archive in the mirror folder")
        total = src.stat().st_size
        offset = part.stat().st_size if part.exists() else 0
        offset = offset if offset <= total else 0
        print(f"{src}: {'resuming at ' + human_size(offset) if offset else 'copying'} of {human_size(total)}",
              flush=True)
        _check_space(part, total - offset)
        with src.open("rb") as f, part.open("ab" if offset else "wb") as out:
            f.seek(offset)
            _copy(f.read, out, offset, total, str(src))
        if part.stat().st_size != total:  # the source changed or the disk lost bytes meanwhile
            raise TransferError(f"{src}: copied {part.stat().st_size} of {total} bytes")
        part.rename(dest)


def open_mirror(location: str, known: dict[str, tuple[str, str]] | None = None) -> Mirror:
    """An HTTP(S) URL base or an existing local folder (a one-line error otherwise); `known`:
    the md5 sums used where the mirror has no md5sum.txt (default: the official ones of the parts)."""
    known = OFFICIAL_SUMS if known is None else known
    if location.startswith(("http://", "https://")):
        return HttpMirror(location, known)
    folder = Path(location.removeprefix("file://")).expanduser()
    if not folder.is_dir():
        raise DownloadError(f"--mirror {location}: neither an http(s):// URL nor an existing folder")
    return FolderMirror(folder, known)


def _part_file(dest: Path) -> Path:
    return dest.with_name(dest.name + ".part")


def _range_starts_at(content_range: str, offset: int) -> bool:
    """Whether 'bytes START-END/TOTAL' starts at `offset`."""
    unit, _, spec = content_range.partition(" ")
    return unit == "bytes" and spec.split("-")[0].strip() == str(offset)


def _copy(read: Callable[[int], bytes], out: BinaryIO, done: int, total: int | None, label: str) -> None:
    """Copy read() to out until EOF, printing progress every 10 %; read failures -> TransferError."""
    next_report = _next_tenth(done, total)
    t0, start = time.monotonic(), done
    while True:
        try:
            chunk = read(CHUNK)
        except (OSError, http.client.HTTPException) as e:
            out.flush()
            raise TransferError(f"{label}: {one_line(e)} after {human_size(done)}") from None
        if not chunk:
            break
        out.write(chunk)
        done += len(chunk)
        if done >= next_report:
            rate = (done - start) / max(time.monotonic() - t0, 1e-3)
            print(f"  {label}: {human_size(done)}{f' ({100 * done // total} %)' if total else ''}, "
                  f"{human_size(rate)}/s", flush=True)
            next_report = _next_tenth(done, total)


def _next_tenth(done: int, total: int | None) -> int:
    step = max(total // 10, CHUNK) if total else 512 * CHUNK
    return (done // step + 1) * step


def _check_space(path: Path, need: int) -> None:
    free = shutil.disk_usage(path.parent).free
    if need > free:
        raise DownloadError(f"{path.parent}: {human_size(need)} needed, only {human_size(free)} free")


def human_size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError


def one_line(e: BaseException) -> str:
    """The reason of an exception on one line (its first)."""
    reason = getattr(e, "reason", None) or e
    return str(reason).strip().splitlines()[0] if str(reason).strip() else type(e).__name__


# ---------------------------------------------------------------------------------------------
# verification and unpacking


def md5_of(path: Path) -> str:
    digest = hashlib.md5()
    with path.open("rb") as f:
        while chunk := f.read(CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def check_md5(archive: Path, want: tuple[str, str] | None) -> str:
    """The file's md5, checked against `want` = (md5, its source) when one is known."""
    got = md5_of(archive)
    if want is None:
        print(f"{archive}: no md5 known for it (md5 {got}), not checked", flush=True)
    elif got != want[0]:
        raise CorruptArchive(f"{archive}: md5 {got}, expected {want[0]} ({want[1]})")
    return got


def _member_filter(member: tarfile.TarInfo, dest: str) -> tarfile.TarInfo | None:
    """Only LibriSpeech/... members, then tarfile's 'data' filter (links, devices, modes)."""
    name = PurePosixPath(member.name)
    if name.is_absolute() or ".." in name.parts or name.parts[:1] != ("LibriSpeech",):
        raise DownloadError(f"unsafe member '{member.name}' (outside LibriSpeech/); refusing to unpack")
    return tarfile.data_filter(member, dest)


def unpack(archive: Path, part: str, data_dir: Path) -> None:
    """Unpack archive into data_dir (it holds LibriSpeech/<part>/...); a broken stream -> CorruptArchive."""
    if not hasattr(tarfile, "data_filter"):
        raise DownloadError("safe unpacking needs Python >= 3.10.12 (tarfile extraction filters)")
    target = data_dir / "LibriSpeech" / part
    if target.exists():  # a partial earlier attempt
        shutil.rmtree(target)
    print(f"{archive}: unpacking into {data_dir}", flush=True)
    try:
        with tarfile.open(archive, "r:gz") as tar:
            tar.extractall(data_dir, filter=_member_filter)
    except tarfile.FilterError as e:
        raise DownloadError(f"{archive}: unsafe member ({e}); refusing to unpack") from None
    except DownloadError as e:
        raise DownloadError(f"{archive}: {e}") from None
    except (tarfile.TarError, EOFError, zlib.error, gzip.BadGzipFile) as e:
        raise CorruptArchive(f"{archive}: broken archive ({one_line(e)})") from None
    if not target.is_dir():
        raise DownloadError(f"{archive}: holds no LibriSpeech/{part}/ folder")


# ---------------------------------------------------------------------------------------------
# one file from wherever it is to verified; one part from there to unpacked


def obtain(name: str, mirror: Mirror, download_dir: Path, attempts: int, wait: float,
           verify: Callable[[Path], None]) -> Path:
    """download_dir/name, fetched from the mirror unless it is there (resuming its .part), then
    verify(path)ed. A broken transfer (TransferError) is resumed after `wait` seconds; a corrupt
    file (verify raises CorruptArchive) is deleted and fetched again; after `attempts` tries in all,
    a DownloadError naming the file and the last reason."""
    download_dir.mkdir(parents=True, exist_ok=True)
    path, last = download_dir / name, ""
    for attempt in range(1, attempts + 1):
        try:
            if not path.exists():
                mirror.fetch(name, path)
            verify(path)
        except TransferError as e:
            last = str(e)
            print(f"attempt {attempt}/{attempts}: {e}", flush=True)
            if attempt < attempts:
                time.sleep(wait)
            continue
        except CorruptArchive as e:
            last = str(e)
            print(f"attempt {attempt}/{attempts}: {e}; deleting it", flush=True)
            path.unlink(missing_ok=True)
            continue
        return path
    raise DownloadError(f"{name}: giving up after {attempts} attempts; last: {last}")


def install(part: str, mirror: Mirror, download_dir: Path, data_dir: Path, attempts: int, wait: float) -> None:
    """Fetch (resuming), verify and unpack one part; a done marker makes a second call free."""
    marker = data_dir / "LibriSpeech" / f".done-{part}"
    if marker.exists():
        print(f"{part}: installed before ({marker.parent / part}), skipped", flush=True)
        return

    def verify(archive: Path) -> None:
        check_md5(archive, mirror.md5sums.get(archive.name))
        unpack(archive, part, data_dir)

    obtain(f"{part}.tar.gz", mirror, download_dir, attempts, wait, verify)
    marker.touch()
    print(f"{part}: installed in {marker.parent / part}", flush=True)


def parse_parts(text: str) -> list[str]:
    parts = [p.strip() for p in text.split(",") if p.strip()]
    unknown = [p for p in parts if p not in PARTS]
    if unknown or not parts:
        raise DownloadError(f"--parts: unknown part(s) {', '.join(unknown) or '(none given)'} "
                            f"(LibriSpeech has {', '.join(PARTS)})")
    return parts


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--parts", required=True, help="comma-separated parts, e.g. dev-clean,train-clean-100")
    p.add_argument("--data-dir", required=True, type=Path, help="LibriSpeech/<part> is unpacked here")
    p.add_argument("--download-dir", type=Path, help="archives (default: DATA_DIR/downloads)")
    p.add_argument("--mirror", default=OFFICIAL_MIRROR, help="URL base or local folder (default: %(default)s)")
    p.add_argument("--attempts", type=int, default=3, help="tries per part in all (default: %(default)s)")
    p.add_argument("--retry-wait", type=float, default=10.0, help="seconds before retrying a broken transfer")
    args = p.parse_args(argv)
    try:
        parts = parse_parts(args.parts)
        mirror = open_mirror(args.mirror)
        for part in parts:
            install(part, mirror, args.download_dir or args.data_dir / "downloads", args.data_dir,
                    max(args.attempts, 1), args.retry_wait)
    except (DownloadError, OSError) as e:
        print(f"download.py: error: {one_line(e)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("download.py: interrupted (a rerun resumes)", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
