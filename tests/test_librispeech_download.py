"""Stage 0 of the LibriSpeech recipe on tiny fake archives: local and HTTP mirrors, resume with a
Range request, md5 checks and refetch, broken and unsafe archives, --parts, done markers."""
from __future__ import annotations

import hashlib
import importlib.util
import io
import os
import random
import subprocess
import tarfile
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes" / "librispeech"


def load_download():
    spec = importlib.util.spec_from_file_location("librispeech_download", RECIPE / "local" / "download.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


download = load_download()


def make_archive(part: str, extra: dict[str, bytes] | None = None, seed: int = 0) -> bytes:
    """A .tar.gz shaped like the official ones: LibriSpeech/README.TXT + LibriSpeech/<part>/..."""
    audio = random.Random(f"{part}{seed}").randbytes(1 << 16)  # 64 KiB that gzip cannot shrink
    members = {"LibriSpeech/README.TXT": b"fake LibriSpeech\n",
               f"LibriSpeech/{part}/19/198/19-198.trans.txt": b"19-198-0000 NORTHANGER ABBEY\n",
               f"LibriSpeech/{part}/19/198/19-198-0000.flac": audio, **(extra or {})}
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def md5sum_txt(archives: dict[str, bytes]) -> bytes:
    return "".join(f"{hashlib.md5(data).hexdigest()}  {name}\n" for name, data in archives.items()).encode()


def folder_mirror(folder: Path, archives: dict[str, bytes], with_md5: bool = True) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for name, data in archives.items():
        (folder / name).write_bytes(data)
    if with_md5:
        (folder / "md5sum.txt").write_bytes(md5sum_txt(archives))
    return folder


def run(*args: str | Path) -> int:
    return download.main([str(a) for a in args] + ["--retry-wait", "0"])


def installed(data: Path, part: str) -> bool:
    return (data / "LibriSpeech" / f".done-{part}").is_file() and \
        (data / "LibriSpeech" / part / "19" / "198" / "19-198-0000.flac").is_file()


# ---------------------------------------------------------------------------------------------
# an HTTP mirror with Range support that can serve a sequence of versions and drop a connection


class Mirror:
    def __init__(self):
        self.files: dict[str, list[bytes]] = {}  # name -> versions, served in turn (the last one stays)
        self.requests: list[tuple[str, str | None]] = []  # (name, Range header)
        self.drop_once: set[str] = set()  # names whose next response stops half-way
        self.url = ""


def handler_for(state: Mirror) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):  # http.server calls do_<METHOD>
            name, byte_range = self.path.lstrip("/"), self.headers.get("Range")
            state.requests.append((name, byte_range))
            versions = state.files.get(name)
            if not versions:
                self.send_error(404)
                return
            body = versions.pop(0) if len(versions) > 1 else versions[0]
            start = int(byte_range.split("=")[1].split("-")[0]) if byte_range else 0
            if start >= len(body) and byte_range:
                self.send_error(416)
                return
            self.send_response(206 if byte_range else 200)
            if byte_range:
                self.send_header("Content-Range", f"bytes {start}-{len(body) - 1}/{len(body)}")
            self.send_header("Content-Length", str(len(body) - start))
            self.end_headers()
            payload = body[start:]
            if name in state.drop_once:
                state.drop_once.discard(name)
                payload = payload[: len(payload) // 2]
            self.wfile.write(payload)

        def log_message(self, *args):
            pass

    return Handler


@pytest.fixture
def http_mirror() -> Iterator[Mirror]:
    state = Mirror()
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler_for(state))
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    state.url = f"http://127.0.0.1:{server.server_address[1]}/resources/12"
    try:
        yield state
    finally:
        server.shutdown()
        server.server_close()


def serve(state: Mirror, archives: dict[str, list[bytes]], md5_of: dict[str, bytes] | None = None) -> None:
    """Serve the versions under /resources/12/, with an md5sum.txt of `md5_of` (default: last versions)."""
    for name, versions in archives.items():
        state.files[f"resources/12/{name}"] = list(versions)
    sums = md5_of if md5_of is not None else {name: versions[-1] for name, versions in archives.items()}
    state.files["resources/12/md5sum.txt"] = [md5sum_txt(sums)]


def archive_requests(state: Mirror, name: str) -> list[str | None]:
    return [r for n, r in state.requests if n == f"resources/12/{name}"]


# ---------------------------------------------------------------------------------------------
# tests


def test_folder_mirror_installs_parts_and_skips_them_afterwards(tmp_path, capsys):
    archives = {f"{p}.tar.gz": make_archive(p) for p in ("dev-clean", "test-clean")}
    mirror = folder_mirror(tmp_path / "mirror", archives)
    data = tmp_path / "data"
    assert run("--parts", "dev-clean,test-clean", "--data-dir", data, "--mirror", mirror) == 0
    assert installed(data, "dev-clean") and installed(data, "test-clean")
    assert (data / "downloads" / "dev-clean.tar.gz").read_bytes() == archives["dev-clean.tar.gz"]
    for name in archives:
        (mirror / name).unlink()  # a second run needs nothing from the mirror
    capsys.readouterr()
    assert run("--parts", "dev-clean,test-clean", "--data-dir", data, "--mirror", mirror) == 0
    assert capsys.readouterr().out.count("skipped") == 2


def test_parts_restrict_what_is_fetched_and_unknown_parts_are_refused(tmp_path, capsys):
    mirror = folder_mirror(tmp_path / "mirror", {"dev-clean.tar.gz": make_archive("dev-clean")})
    data = tmp_path / "data"
    assert run("--parts", "dev-clean", "--data-dir", data, "--mirror", mirror) == 0
    assert installed(data, "dev-clean") and not (data / "LibriSpeech" / "test-clean").exists()
    capsys.readouterr()
    assert run("--parts", "dev-clean,train-clean-99", "--data-dir", data, "--mirror", mirror) == 1
    assert "unknown part(s) train-clean-99" in capsys.readouterr().err
    assert run("--parts", "test-clean", "--data-dir", data, "--mirror", mirror) == 1
    err = capsys.readouterr().err.strip()
    assert "test-clean.tar.gz: no such archive" in err and len(err.splitlines()) == 1


def test_archive_already_in_the_download_dir_is_verified_and_used(tmp_path):
    data, archive = tmp_path / "data", make_archive("dev-other")
    (data / "downloads").mkdir(parents=True)
    (data / "downloads" / "dev-other.tar.gz").write_bytes(archive)
    mirror = folder_mirror(tmp_path / "mirror", {"dev-other.tar.gz": archive})
    (mirror / "dev-other.tar.gz").unlink()  # only its md5sum.txt is left
    assert run("--parts", "dev-other", "--data-dir", data, "--mirror", mirror) == 0
    assert installed(data, "dev-other")


def test_http_mirror_download(tmp_path, http_mirror):
    archive = make_archive("test-other")
    serve(http_mirror, {"test-other.tar.gz": [archive]})
    data = tmp_path / "data"
    assert run("--parts", "test-other", "--data-dir", data, "--mirror", http_mirror.url) == 0
    assert installed(data, "test-other")
    assert archive_requests(http_mirror, "test-other.tar.gz") == [None]
    assert not (data / "downloads" / "test-other.tar.gz.part").exists()


def test_partial_file_is_resumed_with_a_range_request(tmp_path, http_mirror):
    archive = make_archive("dev-clean")
    serve(http_mirror, {"dev-clean.tar.gz": [archive]})
    data = tmp_path / "data"
    (data / "downloads").mkdir(parents=True)
    (data / "downloads" / "dev-clean.tar.gz.part").write_bytes(archive[:1000])
    assert run("--parts", "dev-clean", "--data-dir", data, "--mirror", http_mirror.url) == 0
    assert archive_requests(http_mirror, "dev-clean.tar.gz") == ["bytes=1000-"]
    assert (data / "downloads" / "dev-clean.tar.gz").read_bytes() == archive
    assert installed(data, "dev-clean")


def test_dropped_connection_is_retried_from_where_it_stopped(tmp_path, http_mirror):
    archive = make_archive("dev-clean")
    serve(http_mirror, {"dev-clean.tar.gz": [archive]})
    http_mirror.drop_once.add("resources/12/dev-clean.tar.gz")
    data = tmp_path / "data"
    assert run("--parts", "dev-clean", "--data-dir", data, "--mirror", http_mirror.url) == 0
    assert archive_requests(http_mirror, "dev-clean.tar.gz") == [None, f"bytes={len(archive) // 2}-"]
    assert installed(data, "dev-clean")


def test_md5_mismatch_is_fetched_again(tmp_path, http_mirror, capsys):
    good = make_archive("dev-clean")
    bad = bytearray(good)
    bad[len(bad) // 2] ^= 0xFF
    serve(http_mirror, {"dev-clean.tar.gz": [bytes(bad), good]})
    data = tmp_path / "data"
    assert run("--parts", "dev-clean", "--data-dir", data, "--mirror", http_mirror.url) == 0
    assert "md5" in capsys.readouterr().out
    assert archive_requests(http_mirror, "dev-clean.tar.gz") == [None, None]  # the bad copy is not resumed
    assert installed(data, "dev-clean")


def test_persistent_corruption_is_one_clear_error_after_the_attempts(tmp_path, http_mirror, capsys):
    good = make_archive("dev-clean")
    serve(http_mirror, {"dev-clean.tar.gz": [good[:-10] + b"0123456789"]}, md5_of={"dev-clean.tar.gz": good})
    data = tmp_path / "data"
    assert run("--parts", "dev-clean", "--data-dir", data, "--mirror", http_mirror.url, "--attempts", "2") == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("download.py: error: dev-clean.tar.gz: giving up after 2")
    assert "md5" in err
    assert len(archive_requests(http_mirror, "dev-clean.tar.gz")) == 2
    assert not (data / "downloads" / "dev-clean.tar.gz").exists() and not installed(data, "dev-clean")


def test_broken_tar_with_matching_md5_is_detected(tmp_path, capsys):
    broken = make_archive("dev-clean")[:-200]  # truncated gzip stream, listed with its own md5
    mirror = folder_mirror(tmp_path / "mirror", {"dev-clean.tar.gz": broken})
    data = tmp_path / "data"
    assert run("--parts", "dev-clean", "--data-dir", data, "--mirror", mirror, "--attempts", "2") == 1
    captured = capsys.readouterr()
    assert captured.out.count("broken archive") == 2
    assert "giving up after 2 attempts" in captured.err and "broken archive" in captured.err
    assert not (data / "LibriSpeech" / ".done-dev-clean").exists()


def test_mirror_without_md5sum_uses_the_official_sums(tmp_path, capsys):
    mirror = folder_mirror(tmp_path / "mirror", {"dev-clean.tar.gz": make_archive("dev-clean")}, with_md5=False)
    assert run("--parts", "dev-clean", "--data-dir", tmp_path / "data", "--mirror", mirror, "--attempts", "1") == 1
    err = capsys.readouterr().err
    assert download.OFFICIAL_MD5["dev-clean"] in err and "official" in err


@pytest.mark.parametrize("member", ["../evil.txt", "/tmp/evil.txt", "LibriSpeech/../../evil.txt", "other/evil.txt",
                                    "symlink"])
def test_unsafe_member_is_refused(tmp_path, capsys, member):
    if member == "symlink":
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w:gz") as tar:
            link = tarfile.TarInfo("LibriSpeech/dev-clean/escape")
            link.type, link.linkname = tarfile.SYMTYPE, "../../../outside"
            tar.addfile(link)
        archive = buf.getvalue()
    else:
        archive = make_archive("dev-clean", extra={member: b"owned\n"})
    work = tmp_path / "work"
    mirror = folder_mirror(work / "mirror", {"dev-clean.tar.gz": archive})
    data = work / "deep" / "data"
    assert run("--parts", "dev-clean", "--data-dir", data, "--mirror", mirror) == 1
    err = capsys.readouterr().err.strip()
    assert "unsafe member" in err and len(err.splitlines()) == 1
    assert not list(tmp_path.rglob("evil.txt")) and not (work / "outside").exists()
    assert not (data / "LibriSpeech" / ".done-dev-clean").exists()


def test_http_404_fails_at_once(tmp_path, http_mirror, capsys):
    serve(http_mirror, {})
    assert run("--parts", "dev-other", "--data-dir", tmp_path / "data", "--mirror", http_mirror.url) == 1
    assert "HTTP 404" in capsys.readouterr().err
    assert len(archive_requests(http_mirror, "dev-other.tar.gz")) == 1


def test_run_sh_stage0_then_skipped(tmp_path):
    """The recipe's stage 0 wiring (--mirror, --parts, --data-dir, --exp-dir) and its done marker."""
    mirror = folder_mirror(tmp_path / "mirror", {f"{p}.tar.gz": make_archive(p)
                                                 for p in ("dev-clean", "train-clean-100")})
    cmd = ["bash", str(RECIPE / "run.sh"), "--config", str(ROOT / "conf" / "tiny.yaml"), "--stop-stage", "0",
           "--mirror", str(mirror), "--data-dir", str(tmp_path / "data"), "--exp-dir", str(tmp_path / "exp"),
           "--parts", "dev-clean,train-clean-100"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    first = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert first.returncode == 0, first.stdout[-2000:] + first.stderr[-2000:]
    assert installed(tmp_path / "data", "dev-clean") and installed(tmp_path / "data", "train-clean-100")
    second = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert second.returncode == 0 and "stage 0 (download and unpack" in second.stdout
    assert "done before, skipped" in second.stdout
    assert "stage 0 (download" in (tmp_path / "exp" / "run.log").read_text()
