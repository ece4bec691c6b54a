#!/usr/bin/env python3
"""Attack `asr serve` on loopback the way issue 46 probed it, and print what the server held.

    python tools/serve_attack.py --model exp/synth/model_avg.pt [--audio good.flac] [--out attack.json]
    python tools/serve_attack.py --model MODEL.pt --quick        # small sizes, about a minute
    python tools/serve_attack.py --url http://127.0.0.1:8000 ... # a running server on this machine

With --model it starts `asr serve` on a free 127.0.0.1 port allowed --fd-limit open files (1024: as
under `ulimit -n 1024`, soft and hard, so that it cannot raise them), with its temporary folder in a
private place (whose bytes are counted) and its log kept (read for forged lines). With --url it
uses a running server, which must be on this machine (127.0.0.1, ::1, localhost); what it holds is
then what its /api/health says, without its RSS.

Each probe runs while a watcher samples the server every 0.25 s (its open sockets from /proc, its
temporary bytes, its RSS) and sends a good upload after another on a new connection: the slowest
of those is the "good request" column. The probes (issue 46's table, sizes by flag):

    stalled uploads      --stall-uploads 20 uploads send --stall-mb 45 MB of a longer body, then nothing
    stalled, every slot  the server's max_uploads + 4 uploads stall at 1 MB, and for 10 s those refused or
                         closed try again at once: a good upload waits for a stalled one to give way
                         (give_way_s) and for a turn in which no attacker takes the slot first
    idle sockets         --idle-sockets 1100 connections that send nothing, held past the idle timeout
    slowloris            --slowloris 1000 connections sending a header line every 10 s for
                         --slowloris-seconds 90 s, reconnecting when closed
    clients that leave   --leavers 16 clients upload --leaver-seconds 60 s of audio and close --leave-after
                         0.5 s: those not yet decoded must not be
    malformed forms      boundaries missing, empty, 80 characters; a nested part; cut; a preamble only; ...
    odd names            NUL, not UTF-8, 10 kB and 6 kB names, a .raw suffix, filename*= with %0A
    ?name=x.vox          a text body named .vox
    other host, other site   Host: evil.example; a cross-origin POST
    concurrent uploads   --concurrent 60 good uploads at once: 503s and their Retry-After
    a big field          a --big-field-mb 150 MB field before the file, with a Content-Length and chunked

A good request answered 503 is sent again after its Retry-After, and its time runs from the first
try; the table says whether every one was served within 1 s. A row passes when no answer is a 500
(every refusal a 4xx or a 503 with a JSON error), the server held at most its limits (open sockets:
max_connections + the accept backlog; temporary disk: max_temp_mb + one upload, being removed), and
every good request was served: within 1 s, or the idle timeout + 1 s for the idle and slowloris
rows, or 2 x give_way_s + 1.5 s for the stalled uploads (the temporary disk full until they give
way); in any time for the row whose attackers take every slot and race the good client for each
one that frees (one address: a cap per client would not tell them apart). The concurrent row's
good requests queue behind 60 real ones: its check is that Retry-After is at most 2 s past the
time the queue took to drain. The leavers' good requests wait for the batch that was
being decoded when the clients left, which runs to its end: its check is that no more than that
batch was decoded. Exit status 1 when a row fails.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import json
import math
import os
import resource
import subprocess
import sys
import tempfile
import time
import urllib.parse
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import soundfile as sf

LOOPBACK = ("127.0.0.1", "::1", "localhost")
BOUNDARY = b"AttackBoundary"
BACKLOG = 128  # asr.serve.BACKLOG: connections accepted in one round beyond the cap


@dataclass
class Answer:
    status: int  # 0: the server closed the connection without an answer
    headers: dict[str, str] = field(default_factory=dict)
    body: bytes = b""

    @property
    def json_error(self) -> bool:
        """Whether the body is the documented one-line JSON error."""
        try:
            return (self.headers.get("content-type", "").startswith("application/json") and b"\n" not in
                    self.body.strip() and list(json.loads(self.body)) == ["error"])
        except ValueError:
            return False


class Target:
    """The server: where it listens, and (when this tool started it) its process, folder and log."""

    def __init__(self, url: str, process: subprocess.Popen | None = None, tmp: Path | None = None,
                 log: Path | None = None) -> None:
        parts = urllib.parse.urlsplit(url)
        self.url, self.host, self.port = url, parts.hostname, parts.port
        self.process, self.tmp, self.log = process, tmp, log

    async def send(self, data: bytes, *, timeout: float = 60.0, close_after_send: bool = False) -> Answer:
        """Write `data` on a new connection and read the answer."""
        reader, writer = await asyncio.open_connection(self.host, self.port)
        try:
            writer.write(data)
            await writer.drain()
            if close_after_send:
                return Answer(0)
            return await asyncio.wait_for(read_answer(reader), timeout)
        except (ConnectionError, asyncio.TimeoutError):
            return Answer(0)
        finally:
            writer.close()

    async def health(self) -> dict:
        answer = await self.send(b"GET /api/health HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
        return json.loads(answer.body) if answer.status == 200 else {}

    def held(self, health: dict) -> tuple[int, int, float]:
        """(open sockets, temporary bytes, RSS in MB) now: from /proc and the folder when this tool
        started the server, else from /api/health (RSS unknown)."""
        if self.process is None:
            return health.get("connections", 0), health.get("temp_bytes", 0), float("nan")
        pid = self.process.pid
        sockets = 0
        with contextlib.suppress(OSError):
            for fd in os.listdir(f"/proc/{pid}/fd"):
                with contextlib.suppress(OSError):
                    sockets += os.readlink(f"/proc/{pid}/fd/{fd}").startswith("socket:")
        temp = 0
        for folder, _, files in os.walk(self.tmp):
            for name in files:
                with contextlib.suppress(OSError):
                    temp += os.path.getsize(os.path.join(folder, name))
        rss = float("nan")
        with contextlib.suppress(OSError), open(f"/proc/{pid}/status") as f:
            rss = next(int(line.split()[1]) / 1024 for line in f if line.startswith("VmRSS:"))
        return sockets, temp, rss


async def read_answer(reader: asyncio.StreamReader) -> Answer:
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
        return Answer(0)
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:] if line)}
    length = int(headers.get("content-length", 0))
    try:
        body = await reader.readexactly(length)
    except (asyncio.IncompleteReadError, ConnectionError):
        body = b""
    return Answer(int(lines[0].split()[1]), headers, body)


def post_head(length: int | None, content_type: bytes = b"multipart/form-data; boundary=" + BOUNDARY,
              extra: bytes = b"", query: bytes = b"") -> bytes:
    size = b"Content-Length: %d\r\n" % length if length is not None else b"Transfer-Encoding: chunked\r\n"
    return (b"POST /api/transcribe" + query + b" HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n"
            b"Content-Type: " + content_type + b"\r\n" + size + extra + b"\r\n")


def part(data: bytes, filename: bytes = b"a.flac", name: bytes = b"file", extra: bytes = b"") -> bytes:
    return (b"--" + BOUNDARY + b"\r\nContent-Disposition: form-data; name=\"" + name + b"\"; filename=\"" + filename
            + b"\"\r\n" + extra + b"\r\n" + data + b"\r\n")


END = b"--" + BOUNDARY + b"--\r\n"


def upload(data: bytes, filename: bytes = b"a.flac", extra: bytes = b"") -> bytes:
    body = part(data, filename) + END
    return post_head(len(body), extra=extra) + body


# ---------------------------------------------------------------------------------------------
# the watcher


class Watch:
    """Samples what the server holds and sends good uploads, one after another, while a probe runs."""

    def __init__(self, target: Target, good: bytes) -> None:
        self.target, self.good = target, good
        self.sockets = self.temp = 0
        self.rss = 0.0
        self.latencies: list[float] = []
        self.statuses: Counter = Counter()
        self.busy = 0  # 503s before a good request got in
        self.stopped = False  # the loops end at their next turn (Python 3.11's wait_for can swallow a cancel)

    async def __aenter__(self) -> Watch:
        self.tasks = [asyncio.create_task(self._sample()), asyncio.create_task(self._good())]
        return self

    async def __aexit__(self, *exc: object) -> None:
        deadline = time.monotonic() + 60
        while not self.statuses and time.monotonic() < deadline:  # at least one good request per probe
            await asyncio.sleep(0.05)
        self.stopped = True
        for task in self.tasks:
            task.cancel()
        await asyncio.wait(self.tasks, timeout=60)

    async def _sample(self) -> None:
        while not self.stopped:
            health = await self.target.health() if self.target.process is None else {}
            sockets, temp, rss = await asyncio.to_thread(self.target.held, health)
            self.sockets, self.temp = max(self.sockets, sockets), max(self.temp, temp)
            self.rss = max(self.rss, rss) if not math.isnan(rss) else rss
            await asyncio.sleep(0.25)

    async def _good(self) -> None:
        """A good upload after another; one answered 503 is sent again after its Retry-After (as a
        well-behaved client does), and its latency runs from the first try to the answer."""
        request = upload(self.good, b"good.flac")
        while not self.stopped:
            start = time.perf_counter()
            while (answer := await self.target.send(request, timeout=30)).status == 503:
                self.busy += 1
                await asyncio.sleep(float(answer.headers.get("retry-after", 1)))
            self.latencies.append(time.perf_counter() - start)
            self.statuses[answer.status] += 1
            await asyncio.sleep(0.25)


# ---------------------------------------------------------------------------------------------
# the probes: each returns (what was sent, Counter of answers, a note)


async def probe_stall(target: Target, uploads: int, megabytes: float, limits: dict,
                      persist: float = 0.0) -> tuple[str, Counter, str]:
    """Uploads that send `megabytes` of a FLAC-looking file, of a body declared 1 MB longer, then
    nothing; for `persist` seconds, one refused or closed tries again at once (an attacker's)."""
    size = int(megabytes * 2**20)
    form_head = part(b"fLaC")[:-2]  # the part's headers and the first bytes of its file
    request = post_head(len(form_head) + size + 2**20) + form_head
    piece = bytes(min(size, 2**20))
    wait = limits["read_timeout_s"] + limits["give_way_s"] + 10
    end = time.monotonic() + persist
    statuses: Counter = Counter()

    async def once() -> int:
        try:
            reader, writer = await asyncio.open_connection(target.host, target.port)
        except OSError:
            return -1
        answer = asyncio.create_task(read_answer(reader))
        try:
            writer.write(request)
            for _ in range(math.ceil(size / len(piece))):
                if answer.done():  # refused: stop sending
                    break
                writer.write(piece)
                await writer.drain()
            return (await asyncio.wait_for(answer, wait)).status
        except (ConnectionError, asyncio.TimeoutError):
            return 0
        finally:
            answer.cancel()
            writer.close()

    async def one() -> None:
        while True:
            status = await once()
            statuses[status] += 1
            if status not in (0, 503) or time.monotonic() >= end:
                return
            await asyncio.sleep(0.2)

    await asyncio.gather(*(one() for _ in range(uploads)))
    note = "408: stalled; 503: disk or uploads full" + ("; 0: closed to make room" if statuses[0] else "")
    if persist:
        note += f"; refused ones try again for {persist:g} s"
    return f"{uploads} uploads stall at {megabytes:g} MB", statuses, note


async def probe_idle(target: Target, args: argparse.Namespace, limits: dict) -> tuple[str, Counter, str]:
    opened = await asyncio.gather(*(asyncio.open_connection(target.host, target.port)
                                    for _ in range(args.idle_sockets)), return_exceptions=True)
    streams = [s for s in opened if not isinstance(s, BaseException)]
    hold = limits["idle_timeout_s"] + 2
    await asyncio.sleep(hold)
    closed = 0
    for reader, _ in streams:  # read what came while nobody read: a 503, or the end
        with contextlib.suppress(asyncio.TimeoutError, ConnectionError):
            await asyncio.wait_for(reader.read(), 0.02)
        closed += reader.at_eof()
    statuses = Counter({"closed by the server": closed, "still open": len(streams) - closed,
                        "refused at connect": len(opened) - len(streams)})
    for _, writer in streams:
        writer.close()
    return f"{args.idle_sockets} idle sockets", statuses, f"held {hold:g} s"


async def probe_slowloris(target: Target, args: argparse.Namespace, limits: dict) -> tuple[str, Counter, str]:
    tick, end = 10.0, time.monotonic() + args.slowloris_seconds
    counts: Counter = Counter()

    async def one(i: int) -> None:
        await asyncio.sleep(i * tick / args.slowloris)  # spread over one tick
        while (left := end - time.monotonic()) > 0:
            try:
                reader, writer = await asyncio.open_connection(target.host, target.port)
            except OSError:
                counts["refused at connect"] += 1
                await asyncio.sleep(min(tick, left))
                continue
            counts["connections"] += 1
            try:
                writer.write(b"POST /api/transcribe HTTP/1.1\r\nHost: 127.0.0.1\r\n")
                while (left := end - time.monotonic()) > 0:
                    try:
                        await asyncio.wait_for(reader.read(4096), min(tick, left))
                    except asyncio.TimeoutError:
                        writer.write(b"X-Slow: a\r\n")
                        continue
                    counts["closed by the server"] += 1  # closed, or answered (a 4xx or 503): let go
                    break
            except ConnectionError:
                counts["closed by the server"] += 1
            finally:
                writer.close()
            await asyncio.sleep(max(0.0, min(tick, end - time.monotonic())))  # reconnect at the next tick

    await asyncio.gather(*(one(i) for i in range(args.slowloris)))
    return f"{args.slowloris} slowloris, {args.slowloris_seconds:g} s", counts, "a header line / 10 s; reconnect"


async def probe_leavers(target: Target, args: argparse.Namespace, watch: Watch) -> tuple[str, Counter, str, bool]:
    wave = 0.1 * np.sin(np.arange(int(16000 * args.leaver_seconds)) * 0.05).astype(np.float32)
    buffer = io.BytesIO()
    sf.write(buffer, wave, 16000, format="WAV", subtype="PCM_16")
    request = upload(buffer.getvalue(), b"long.wav")
    before = await target.health()

    async def one() -> None:
        reader, writer = await asyncio.open_connection(target.host, target.port)
        writer.write(request)
        await writer.drain()
        await asyncio.sleep(args.leave_after)  # long enough to be queued, not to be answered
        writer.close()

    await asyncio.gather(*(one() for _ in range(args.leavers)))
    await quiet(target, 60)
    after = await target.health()
    good = watch.statuses[200]
    decoded = after["requests"] - before["requests"] - good  # the watcher's good uploads aside
    skipped = after["skipped"] - before["skipped"]
    decoded = max(0, decoded)
    dropped = after["left"] - before["left"] - skipped - decoded
    answers = Counter({"dropped while received or read": dropped, "dropped from the queue": skipped,
                       "decoded (a batch begun)": decoded,
                       "not seen leaving": args.leavers - dropped - skipped - decoded})
    batch = after["limits"]["batch_size"]
    return (f"{args.leavers} clients upload {args.leaver_seconds:g} s and leave after {args.leave_after:g} s", answers,
            f"{decoded} of {args.leavers} decoded (at most a batch of {batch} begun before they left)",
            decoded <= batch)


def malformed_requests(good: bytes) -> dict[str, tuple[bytes, set[int]]]:
    """{case: (request, statuses expected)} of malformed forms and requests."""
    form_type = b"multipart/form-data; boundary=" + BOUNDARY

    def form(body: bytes, content_type: bytes = form_type) -> bytes:
        return post_head(len(body), content_type) + body
    nested = (b"--" + BOUNDARY + b"\r\nContent-Disposition: form-data; name=\"file\"\r\nContent-Type: multipart/mixed; "
              b"boundary=in\r\n\r\n--in\r\nContent-Disposition: file; filename=\"a.flac\"\r\n\r\n" + good +
              b"\r\n--in--\r\n" + END)
    return {
        "no boundary": (form(part(good) + END, b"multipart/form-data"), {400}),
        "empty boundary": (form(part(good) + END, b"multipart/form-data; boundary="), {400}),
        "80-character boundary": (form(part(good) + END, b"multipart/form-data; boundary=" + b"b" * 80), {400}),
        "nested part": (form(nested), {400}),
        "truncated form": (form(part(good)[: len(good) // 2]), {400}),
        "no closing boundary": (form(part(good)), {400}),
        "preamble only": (form(b"a preamble and nothing else\r\n" * 20), {400}),
        "closing boundary only": (form(END), {400}),
        "part without a disposition": (form(b"--" + BOUNDARY + b"\r\nContent-Type: text/plain\r\n\r\nhi\r\n" + END),
                                       {400}),
        "200 part headers": (form(b"--" + BOUNDARY + b"\r\n" + b"X-A: b\r\n" * 200 + part(good)[len(BOUNDARY) + 4:]
                                  + END), {400}),
        "malformed chunked body": (post_head(None, b"audio/flac") + b"zz\r\nnot hex\r\n", {400}),
        "bad request line": (b"GET /\x01 HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n", {400}),
        "control bytes in a header": (form(part(good) + END, b"multipart/\x01; boundary=\"open"), {400}),
    }


def odd_name_requests(good: bytes) -> dict[str, tuple[bytes, set[int]]]:
    forged = (b"--" + BOUNDARY + b"\r\nContent-Disposition: form-data; name=\"file\"; filename*=UTF-8''ok%0A"
              b"INFO%20forged.flac\r\n\r\n" + good + b"\r\n" + END)
    return {
        "NUL in the name": (upload(good, b"a\x00b.flac"), {400}),  # aiohttp refuses NUL in a header
        "a .raw suffix (FLAC inside)": (upload(good, b"x.raw"), {200}),
        "a name not UTF-8": (upload(good, b"\xff\xfe.flac"), {200}),
        "a 6 kB name": (upload(good, b"n" * 6000 + b".flac"), {200}),
        "a 10 kB name": (upload(good, b"n" * 10000 + b".flac"), {400}),  # past aiohttp's 8190-byte header line
        "filename*= with %0A": (post_head(len(forged)) + forged, {200}),
        "?name=x.vox, a text body": (post_head(len(b"not audio\n" * 50), b"application/octet-stream",
                                               query=b"?name=x.vox") + b"not audio\n" * 50, {415}),
        "Host: evil.example": (upload(good).replace(b"Host: 127.0.0.1", b"Host: evil.example"), {421}),
        "cross-origin POST": (upload(good, extra=b"Origin: http://evil.example\r\nSec-Fetch-Site: cross-site\r\n"),
                              {403}),
    }


async def probe_requests(target: Target, cases: dict[str, tuple[bytes, set[int]]]) -> tuple[Counter, list[str]]:
    """Each request once: the answers, and the cases answered otherwise than expected or without
    the JSON error."""
    answers, wrong = Counter(), []
    for case, (request, expected) in cases.items():
        answer = await target.send(request)
        answers[answer.status] += 1
        if answer.status not in expected or (answer.status >= 400 and not answer.json_error):
            wrong.append(f"{case}: {answer.status} {answer.body[:120]!r}")
    return answers, wrong


async def probe_concurrent(target: Target, args: argparse.Namespace, good: bytes) -> tuple[str, Counter, str, bool]:
    request = upload(good)
    start = time.perf_counter()

    async def one() -> tuple[Answer, float]:
        answer = await target.send(request, timeout=120)
        return answer, time.perf_counter() - start

    timed = await asyncio.gather(*(one() for _ in range(args.concurrent)))
    answers = [a for a, _ in timed]
    done = max((t for a, t in timed if a.status == 200), default=0.0)
    waits = [int(a.headers.get("retry-after", 0)) for a in answers if a.status == 503]
    ok = all(a.status in (200, 503) for a in answers) and all(w <= done + 2 for w in waits)
    note = (f"Retry-After {min(waits, default=0)}-{max(waits, default=0)} s; the last 200 after {done:.1f} s")
    return f"{args.concurrent} uploads at once", Counter(a.status for a in answers), note, ok


async def probe_big_field(target: Target, args: argparse.Namespace) -> tuple[str, Counter, str]:
    size = int(args.big_field_mb * 2**20)
    field_head = b"--" + BOUNDARY + b"\r\nContent-Disposition: form-data; name=\"junk\"\r\n\r\n"
    rest = b"\r\n" + part(b"fLaC" + bytes(1000)) + END
    answers: Counter = Counter()
    for chunked in (False, True):
        reader, writer = await asyncio.open_connection(target.host, target.port)
        answer = asyncio.create_task(read_answer(reader))
        try:
            writer.write(post_head(None if chunked else len(field_head) + size + len(rest)))
            piece = b"j" * 2**20
            for data in [field_head] + [piece] * (size // len(piece)) + [rest]:
                if answer.done():  # the server has answered: stop sending
                    break
                writer.write(b"%x\r\n%s\r\n" % (len(data), data) if chunked else data)
                await writer.drain()
            else:
                if chunked:
                    writer.write(b"0\r\n\r\n")
            answers[(await asyncio.wait_for(answer, 60)).status] += 1
        except (ConnectionError, asyncio.TimeoutError):
            answers[0] += 1
        finally:
            answer.cancel()
            writer.close()
    return f"a {args.big_field_mb:g} MB field before the file", answers, "with a Content-Length, then chunked"


# ---------------------------------------------------------------------------------------------
# running them


@dataclass
class Row:
    probe: str
    answers: Counter
    note: str
    ok: bool  # the probe's own check (the answers, and what it measured)
    sockets: int = 0
    temp_mb: float = 0.0
    rss_mb: float = 0.0
    good: str = ""  # the good requests: how many, and the slowest
    good_ok: bool = True  # every one served, within the row's bound
    within_1s: bool = True  # every one served within 1 s
    held_ok: bool = True  # sockets and temporary disk within the limits

    def verdict(self) -> bool:
        return self.ok and self.good_ok and self.held_ok and 500 not in self.answers


async def quiet(target: Target, seconds: float) -> None:
    """Wait (at most `seconds`) until the server receives, holds and queues nothing."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        health = await target.health()
        if health and not (health["receiving"] or health["temp_bytes"] or health["queued_audio_s"]):
            return
        await asyncio.sleep(0.25)


async def run_probe(target: Target, good: bytes, name: str, probe, bound: float | None, limits: dict) -> Row:
    """Run `probe(watch)` under a Watch; `bound`: the seconds a good request may take (None: any, as long
    as every one is served)."""
    await quiet(target, 60)
    async with Watch(target, good) as watch:
        sent, answers, note, ok = await probe(watch)
        await asyncio.sleep(0.3)  # a last sample after the probe
    served = watch.statuses[200]
    slowest = max(watch.latencies, default=float("nan"))
    others = {s: n for s, n in watch.statuses.items() if s != 200}
    good = (f"{served} of {sum(watch.statuses.values())}, slowest {slowest:.2f} s" + (f" ({others})" if others else "")
            + (f", after {watch.busy} x 503" if watch.busy else ""))
    good_ok = served > 0 and not others and (bound is None or slowest <= bound)
    print(f"  {name}: {dict(answers)}; good requests {good}", flush=True)
    held_ok = (watch.sockets <= limits["max_connections"] + BACKLOG + 16
               and watch.temp <= (limits["max_temp_mb"] + limits["max_upload_mb"]) * 2**20)
    return Row(sent, answers, note, ok, watch.sockets, watch.temp / 2**20, watch.rss, good, good_ok,
               served > 0 and not others and slowest <= 1.0, held_ok)


async def attack(target: Target, args: argparse.Namespace, good: bytes) -> list[Row]:
    health = await target.health()
    if not health:
        raise SystemExit(f"serve_attack: {target.url}/api/health does not answer")
    limits = health["limits"]
    idle = limits["idle_timeout_s"]
    rows = []

    def requests(cases, label):
        async def probe(watch):
            answers, wrong = await probe_requests(target, cases)
            return f"{label} ({len(cases)} kinds)", answers, "; ".join(wrong) or "each as expected, JSON errors", \
                not wrong
        return probe

    plan = [
        ("malformed", requests(malformed_requests(good), "malformed forms and requests"), 1.0),
        ("odd names", requests(odd_name_requests(good), "odd names, other host and site"), 1.0),
        ("concurrent", lambda watch: probe_concurrent(target, args, good), None),
        ("leavers", lambda watch: probe_leavers(target, args, watch), None),  # behind the batch begun
        ("big field", lambda watch: _with_ok(probe_big_field(target, args), {413}), 1.0),
        ("stall", lambda watch: _with_ok(probe_stall(target, args.stall_uploads, args.stall_mb, limits),
                                         {0, 408, 503}), 2 * limits["give_way_s"] + 1.5),
        ("stall slots", lambda watch: _with_ok(probe_stall(target, limits["max_uploads"] + 4, 1.0, limits, persist=10),
                                               {0, 408, 503}), None),
        ("idle", lambda watch: _with_ok(probe_idle(target, args, limits), None), idle + 1),
        ("slowloris", lambda watch: _with_ok(probe_slowloris(target, args, limits), None), idle + 1),
    ]
    for name, probe, bound in plan:
        if name in args.skip:
            continue
        rows.append(await run_probe(target, good, name, probe, bound, limits))
        if name == "odd names" and target.log is not None:  # filename*= ...%0AINFO%20forged.flac
            log = target.log.read_text(errors="replace").splitlines()
            forged = [line for line in log if line.startswith("INFO forged")]
            rows[-1].note += f"; forged log lines: {len(forged)}"
            rows[-1].ok &= not forged
    return rows


async def _with_ok(probe, statuses: set[int] | None) -> tuple[str, Counter, str, bool]:
    sent, answers, note = await probe
    return sent, answers, note, statuses is None or set(answers) <= statuses


def print_table(rows: list[Row]) -> None:
    head = ["probe", "answers", "note", "sockets", "temp MB", "RSS MB", "good requests", "all within 1 s", "pass"]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for r in rows:
        answers = ", ".join(f"{n} x {s}" for s, n in sorted(r.answers.items(), key=lambda kv: str(kv[0])))
        print(f"| {r.probe} | {answers} | {r.note} | {r.sockets} | {r.temp_mb:.1f} | {r.rss_mb:.0f} | {r.good} | "
              f"{'yes' if r.within_1s else 'no'} | {'yes' if r.verdict() else 'NO'} |")


# ---------------------------------------------------------------------------------------------
# the server and the command line


def start_server(args: argparse.Namespace, folder: Path) -> Target:
    (folder / "tmp").mkdir()

    def limit_files() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (args.fd_limit, args.fd_limit))

    command = [sys.executable, "-m", "asr.cli", "serve", "--model", args.model, "--host", "127.0.0.1", "--port", "0",
               "--threads", str(args.threads), *args.server_flag]
    log = folder / "serve.log"
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=open(log, "w"), text=True,
                               env={**os.environ, "TMPDIR": str(folder / "tmp")}, preexec_fn=limit_files)
    line = process.stdout.readline()
    if not line.startswith("serving on "):
        process.kill()
        raise SystemExit(f"serve_attack: asr serve did not start ({line.strip() or log.read_text()[-300:]})")
    return Target(line.split()[-1], process, folder / "tmp", log)


def good_audio(args: argparse.Namespace) -> bytes:
    if args.audio:
        return Path(args.audio).read_bytes()
    t = np.arange(16000 * 3) / 16000
    buffer = io.BytesIO()
    sf.write(buffer, (0.2 * np.sin(2 * np.pi * (200 + 100 * t) * t)).astype(np.float32), 16000, format="FLAC")
    return buffer.getvalue()


def raise_own_fd_limit(needed: int) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else max(soft, needed)
    if soft < target:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    if target < needed:
        raise SystemExit(f"serve_attack: needs {needed} open files, and may have only {target} (ulimit -Hn)")


QUICK = {"stall_uploads": 4, "stall_mb": 5.0, "idle_sockets": 200, "slowloris": 100, "slowloris_seconds": 15.0,
         "leavers": 4, "leaver_seconds": 20.0, "concurrent": 24, "big_field_mb": 60.0}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--model", help="start `asr serve --model MODEL` on a free loopback port")
    where.add_argument("--url", help="a running server on this machine, e.g. http://127.0.0.1:8000")
    parser.add_argument("--audio", help="a good audio file (default: a generated 3 s chirp)")
    parser.add_argument("--fd-limit", type=int, default=1024, help="open files the server may have (default 1024)")
    parser.add_argument("--threads", type=int, default=1, help="the server's --threads (default 1)")
    parser.add_argument("--server-flag", action="append", default=[], metavar="FLAG",
                        help="more flags for `asr serve` (repeat; e.g. --server-flag=--idle-timeout=5)")
    parser.add_argument("--stall-uploads", type=int, default=20)
    parser.add_argument("--stall-mb", type=float, default=45.0)
    parser.add_argument("--idle-sockets", type=int, default=1100)
    parser.add_argument("--slowloris", type=int, default=1000)
    parser.add_argument("--slowloris-seconds", type=float, default=90.0)
    parser.add_argument("--leavers", type=int, default=16)
    parser.add_argument("--leaver-seconds", type=float, default=60.0)
    parser.add_argument("--leave-after", type=float, default=0.5, help="seconds the leavers wait (default 0.5)")
    parser.add_argument("--concurrent", type=int, default=60)
    parser.add_argument("--big-field-mb", type=float, default=150.0)
    parser.add_argument("--quick", action="store_true", help="small sizes: " + ", ".join(f"{k}={v:g}"
                                                                                         for k, v in QUICK.items()))
    parser.add_argument("--skip", default="", help="probes to leave out, by name, comma-separated (malformed, odd "
                        "names, concurrent, leavers, big field, stall, idle, slowloris)")
    parser.add_argument("--out", help="write the rows as JSON")
    parser.add_argument("--log", help="keep the log of the server it started here")
    args = parser.parse_args(argv)
    if args.quick:
        for key, value in QUICK.items():
            if getattr(args, key) == parser.get_default(key):
                setattr(args, key, type(parser.get_default(key))(value))
    args.skip = {name.strip() for name in args.skip.split(",") if name.strip()}
    raise_own_fd_limit(max(args.idle_sockets, args.slowloris, args.concurrent) + 256)
    good = good_audio(args)
    with tempfile.TemporaryDirectory(prefix="serve-attack-") as folder:
        if args.url:
            if urllib.parse.urlsplit(args.url).hostname not in LOOPBACK:
                raise SystemExit(f"serve_attack: {args.url} is not on this machine; this tool attacks loopback "
                                 "servers only")
            target = Target(args.url.rstrip("/"))
        else:
            target = start_server(args, Path(folder))
        try:
            print(f"attacking {target.url}" + (f" (at most {args.fd_limit} open files)" if target.process else ""),
                  flush=True)
            rows = asyncio.run(attack(target, args, good))
            limits = asyncio.run(target.health()).get("limits", {})
        finally:
            if target.process is not None:
                target.process.terminate()
                target.process.wait(timeout=60)
                if args.log:
                    Path(args.log).write_bytes(target.log.read_bytes())
    print_table(rows)
    if args.out:
        Path(args.out).write_text(json.dumps({"limits": limits, "fd_limit": args.fd_limit, "rows": [
            {**vars(r), "answers": {str(k): v for k, v in r.answers.items()}, "pass": r.verdict()} for r in rows]},
            indent=2) + "\n")
        print(f"wrote {args.out}")
    return 0 if all(r.verdict() for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
