"""Download and verify LibriSpeech's LM text (stage 8 of recipes/librispeech/run.sh).

    python local/download_lm.py --download-dir DIR [--mirror URL_OR_FOLDER] [--attempts 3]

DIR/librispeech-lm-norm.txt.gz (about 1.4 GB: upper-case normalized text, one sentence a line,
~800 million words from ~14,500 public-domain books, those of the dev and test sets left out) comes
from the mirror: an HTTP(S) URL base, by default the official one (openslr.org/resources/11), or a local
folder holding the file. local/download.py's machinery does the transfer: a partial
DIR/<name>.part is resumed (HTTP Range, or a seek in a local file), and the bytes received are
checked against the Content-Length (or the local file's size). Then the md5 is checked against
the mirror's md5sum.txt, or, when the mirror has none, against the sum below, and the whole gzip
stream is read through. A corrupt file (md5 mismatch, broken gzip stream) is deleted and fetched
again, a broken transfer resumed, within --attempts tries in all; then one line names the file and
the last reason. DIR/.done-<name> records the verified file's size and md5: a later run with that
file in place skips it without touching the network.
"""
from __future__ import annotations

import argparse
import gzip
import sys
import zlib
from pathlib import Path

from download import CHUNK, CorruptArchive, DownloadError, check_md5, human_size, obtain, one_line, open_mirror

OFFICIAL_MIRROR = "https://www.openslr.org/resources/11"
LM_TEXT = "librispeech-lm-norm.txt.gz"
# Used when the mirror has no md5sum.txt. Not read from openslr.org here: the sum that several
# independent LibriSpeech recipes check the official file against (the same tables give the
# resources/12 archives the sums of local/download.py).
KNOWN_MD5 = {LM_TEXT: ("c83c64c726a1aedfe65f80aa311de402", "the sum LibriSpeech recipes check")}


def check_gzip(path: Path) -> tuple[int, int]:
    """(lines, bytes) of the text after reading the whole gzip stream; a broken one -> CorruptArchive."""
    lines = size = 0
    try:
        with gzip.open(path, "rb") as f:
            while chunk := f.read(CHUNK):
                lines += chunk.count(b"\n")
                size += len(chunk)
    except (OSError, EOFError, zlib.error) as e:  # gzip.BadGzipFile is an OSError
        raise CorruptArchive(f"{path}: broken gzip stream ({one_line(e)})") from None
    if not lines:
        raise CorruptArchive(f"{path}: holds no text")
    return lines, size


def verified_before(path: Path, marker: Path) -> bool:
    """Whether the marker records the file that is there (its size)."""
    if not (path.is_file() and marker.is_file()):
        return False
    fields = marker.read_text(encoding="utf-8").split()
    return bool(fields) and fields[0] == str(path.stat().st_size)


def fetch_lm_text(mirror_location: str, download_dir: Path, attempts: int, wait: float) -> Path:
    """DIR/librispeech-lm-norm.txt.gz fetched and verified, or verified before (a marker)."""
    path, marker = download_dir / LM_TEXT, download_dir / f".done-{LM_TEXT}"
    if verified_before(path, marker):
        print(f"{path}: verified before, skipped", flush=True)
        return path
    marker.unlink(missing_ok=True)
    mirror = open_mirror(mirror_location, known=KNOWN_MD5)
    md5 = ""

    def verify(p: Path) -> None:
        nonlocal md5
        md5 = check_md5(p, mirror.md5sums.get(p.name))
        print(f"{p}: reading the gzip stream through", flush=True)
        lines, size = check_gzip(p)
        print(f"{p}: {lines:,} lines, {human_size(size)} of text", flush=True)

    obtain(LM_TEXT, mirror, download_dir, attempts, wait, verify)
    marker.write_text(f"{path.stat().st_size} {md5}\n", encoding="utf-8")
    print(f"{path}: verified", flush=True)
    return path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--download-dir", required=True, type=Path, help="where the file goes")
    p.add_argument("--mirror", default=OFFICIAL_MIRROR, help="URL base or local folder (default: %(default)s)")
    p.add_argument("--attempts", type=int, default=3, help="tries in all (default: %(default)s)")
    p.add_argument("--retry-wait", type=float, default=10.0, help="seconds before retrying a broken transfer")
    args = p.parse_args(argv)
    try:
        fetch_lm_text(args.mirror, args.download_dir, max(args.attempts, 1), args.retry_wait)
    except (DownloadError, OSError) as e:
        print(f"download_lm.py: error: {one_line(e)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("download_lm.py: interrupted (a rerun resumes)", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
