#!/usr/bin/env python3
"""Load test of `asr serve` on loopback: N concurrent clients for a bounded time, a mix of good and
bad files; prints throughput, latency percentiles and errors, writes JSON.

    python tools/serve_load.py --model exp/synth/model_avg.pt --manifest data/dev.jsonl \\
        --clients 1,4,16 --seconds 30 --out load.json
    python tools/serve_load.py --url http://127.0.0.1:8000 --audio a.flac b.wav ...

With --model it starts `asr serve` on a free 127.0.0.1 port (--threads, --batch-size, --queue-size
passed on); with --url it uses a running server, which must be on this machine (127.0.0.1, ::1,
localhost). First every good file is sent alone, one after another: its transcript is the one
expected under load. Then, for each client count, the clients send files back to back (a fixed
cycle: about --bad-fraction of them bad: truncated, empty, not audio, too long) until --seconds
have passed. A good request must come back 200 with the text it had alone, a bad one 4xx with a
JSON error; anything else is an error and the exit status is 1. A 503 (queue full) is counted
and the request sent again after its Retry-After.

    python tools/serve_load.py --model exp/stream/model_avg.pt --manifest data/dev.jsonl --streams 1,4,16,32

--streams N[,N...] tests the WebSocket instead (GET /stream, a model that can stream): for each
N, N clients stream the good files one after another through tools/stream_client.py, each in
real time (a 100 ms frame once the wall clock has passed its end, as a microphone sends it),
until --seconds have passed (a file begun is streamed to its end). Every file is first streamed
alone, as fast as the server takes it: its final text is the one expected under load (a
difference is counted, not an error: batched steps equal lone ones only to rounding). Per N:
  - chunk compute p50 / p90: the seconds of the batched encoder step behind each result (the
    "compute" the server sends); the streams are held in real time when its p90 is under a
    chunk's duration, and the most streams held so is printed;
  - queued p90 / max: the audio received by the server and not yet covered by a result, per
    result (the server's "queued"; a chunk's duration and the subsampling's look-ahead of it
    are inherent, more is audio waiting for the decoding thread);
  - final latency p50 / p90: when a final came, minus when the audio up to its end had been sent;
    a final at an endpoint ends after stream_endpoint_silence seconds of silence, which its end
    includes, so this is the latency past the endpoint silence;
  - mean step: streams per batched step (the server's /api/health).
A stream that fails (an error message, a close without "done") is an error: exit status 1.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.parse
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import soundfile as sf
from stream_client import Session, read_pcm16, stream  # tools/stream_client.py

LOOPBACK = ("127.0.0.1", "::1", "localhost")


@dataclass
class Upload:
    name: str
    data: bytes
    good: bool
    expected: str | None = None  # the transcript alone (good files)
    seconds: float = 0.0  # audio seconds (good files)


@dataclass
class Answer:
    upload: Upload
    status: int
    seconds: float  # latency of the last try
    ok: bool
    busy: int  # 503s before it
    detail: str = ""


def bad_uploads(good: Upload, max_seconds: float, max_bytes: int, folder: Path) -> list[Upload]:
    """Truncated, empty, not audio, and (when it fits the size limit) too long."""
    sf.write(folder / "cut.wav", np.zeros(16000 * 3, np.int16), 16000)
    wav = (folder / "cut.wav").read_bytes()
    bad = [Upload("truncated.wav", wav[: len(wav) // 3], False), Upload("empty.wav", b"", False),
           Upload("notes.txt", b"not audio at all\n" * 100, False)]
    if (max_seconds + 1) * 32000 < max_bytes:
        sf.write(folder / "long.wav", np.zeros(int(16000 * (max_seconds + 1)), np.int16), 16000)
        bad.append(Upload("long.wav", (folder / "long.wav").read_bytes(), False))
    return bad


async def post(session, url: str, upload: Upload) -> tuple[int, dict, float, int]:
    """(status, JSON body, latency of the last try, 503s before it)."""
    import aiohttp

    busy = 0
    while True:
        form = aiohttp.FormData()
        form.add_field("file", upload.data, filename=upload.name, content_type="application/octet-stream")
        start = time.perf_counter()
        async with session.post(f"{url}/api/transcribe", data=form) as response:
            body = await response.json(content_type=None)
            spent = time.perf_counter() - start
            if response.status != 503:
                return response.status, body, spent, busy
            busy += 1
            await asyncio.sleep(float(response.headers.get("Retry-After", "1")))


def judge(upload: Upload, status: int, body: dict) -> tuple[bool, str]:
    if upload.good:
        if status != 200:
            return False, f"{upload.name}: HTTP {status} {body.get('error', '')}"
        if body["text"] != upload.expected:
            return False, f"{upload.name}: {body['text']!r} under load, {upload.expected!r} alone"
        return True, ""
    if 400 <= status < 500 and isinstance(body.get("error"), str) and body["error"]:
        return True, ""
    return False, f"{upload.name} (bad): HTTP {status} {body}"


async def load(url: str, cycle: list[Upload], clients: int, seconds: float) -> list[Answer]:
    import aiohttp

    answers: list[Answer] = []
    position = 0
    deadline = time.perf_counter() + seconds

    async def client(session) -> None:
        nonlocal position
        while time.perf_counter() < deadline:
            upload = cycle[position % len(cycle)]
            position += 1
            try:
                status, body, spent, busy = await post(session, url, upload)
                ok, detail = judge(upload, status, body)
            except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:
                status, spent, busy, ok, detail = 0, 0.0, 0, False, f"{upload.name}: {type(e).__name__}: {e}"
            answers.append(Answer(upload, status, spent, ok, busy, detail))

    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        await asyncio.gather(*(client(session) for _ in range(clients)))
    return answers


async def health(url: str) -> dict:
    import aiohttp

    async with aiohttp.ClientSession() as session, session.get(f"{url}/api/health") as response:
        return await response.json()


async def baseline(url: str, uploads: list[Upload]) -> list[float]:
    """Each good upload alone: sets its expected text and audio length; returns the latencies."""
    import aiohttp

    latencies = []
    async with aiohttp.ClientSession() as session:
        for upload in uploads:
            status, body, spent, _ = await post(session, url, upload)
            if status != 200:
                raise SystemExit(f"serve_load: {upload.name} fails alone: HTTP {status} {body}")
            upload.expected, upload.seconds = body["text"], body["duration"]
            latencies.append(spent)
    return latencies


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


def summarize(clients: int, seconds: float, answers: list[Answer], before: dict, after: dict) -> dict:
    good = [a for a in answers if a.upload.good]
    latencies = [a.seconds for a in good if a.ok]
    requests = after["requests"] - before["requests"]
    batches = after["batches"] - before["batches"]
    return {
        "clients": clients, "seconds": round(seconds, 1), "requests": len(answers), "good": len(good),
        "bad": len(answers) - len(good), "errors": sum(not a.ok for a in answers),
        "busy_503": sum(a.busy for a in answers),
        "requests_per_s": round(len(answers) / seconds, 2),
        "audio_s_per_s": round(sum(a.upload.seconds for a in good if a.ok) / seconds, 2),
        "p50_ms": round(1000 * percentile(latencies, 50)), "p90_ms": round(1000 * percentile(latencies, 90)),
        "p99_ms": round(1000 * percentile(latencies, 99)),
        "mean_batch": round(requests / batches, 2) if batches else 0.0,
        "error_examples": [a.detail for a in answers if not a.ok][:5],
    }


# ---------------------------------------------------------------------------------------------
# streams (--streams)


@dataclass
class Speech:
    name: str
    pcm: bytes  # 16 kHz int16
    expected: str = ""  # the final text streamed alone

    @property
    def seconds(self) -> float:
        return len(self.pcm) / 32000


def final_text(session: Session) -> str:
    return " ".join(m["text"] for _, m in session.messages if m.get("type") == "final" and m["text"])


def stream_failure(name: str, session: Session) -> str:
    """"" for a stream that ended with "done", else what went wrong."""
    errors = [m["error"] for _, m in session.messages if m.get("type") == "error"]
    if errors:
        return f"{name}: error: {errors[0]}"
    return "" if session.done else f"{name}: closed without \"done\" ({session.close_code})"


async def stream_baseline(url: str, speeches: list[Speech]) -> None:
    """Each file streamed alone, as fast as the server takes it: its final text."""
    for speech in speeches:
        session = await stream(url, speech.pcm)
        if failure := stream_failure(speech.name, session):
            raise SystemExit(f"serve_load: {failure} (streamed alone)")
        speech.expected = final_text(session)


async def stream_load(url: str, speeches: list[Speech], streams: int, seconds: float) -> list[tuple[Speech, Session]]:
    """`streams` clients, each streaming the files in real time one after another (client i
    from file i on) until `seconds` have passed."""
    import aiohttp

    deadline = time.perf_counter() + seconds
    done: list[tuple[Speech, Session]] = []

    async def client(i: int) -> None:
        while time.perf_counter() < deadline:
            speech = speeches[i % len(speeches)]
            i += 1
            try:
                session = await stream(url, speech.pcm, realtime=True)
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
                session = Session()
                session.messages.append((time.perf_counter(), {"type": "error", "error": f"{type(e).__name__}: {e}"}))
            done.append((speech, session))

    await asyncio.gather(*(client(i) for i in range(streams)))
    return done


def summarize_streams(streams: int, seconds: float, done: list[tuple[Speech, Session]], chunk_seconds: float,
                      before: dict, after: dict) -> dict:
    compute, queued, latency = [], [], []
    for _, session in done:
        for at, m in session.messages:
            if m.get("type") in ("partial", "final"):
                compute.append(m["compute"])
                queued.append(m["queued"])
            if m.get("type") == "final":
                latency.append(at - session.sent_at(m["end"]))
    failures = [f for f in (stream_failure(speech.name, session) for speech, session in done) if f]
    differ = sum(not stream_failure(speech.name, session) and final_text(session) != speech.expected
                 for speech, session in done)
    steps = after["streaming"]["steps"] - before["streaming"]["steps"]
    stepped = after["streaming"]["stepped"] - before["streaming"]["stepped"]
    p90 = percentile(compute, 90)
    return {
        "streams": streams, "seconds": round(seconds, 1), "sessions": len(done), "errors": len(failures),
        "differ": differ, "audio_s": round(sum(speech.seconds for speech, _ in done), 1),
        "chunk_ms": round(1000 * chunk_seconds), "compute_p50_ms": round(1000 * percentile(compute, 50), 1),
        "compute_p90_ms": round(1000 * p90, 1), "real_time": bool(compute) and p90 < chunk_seconds,
        "queued_p90_s": round(percentile(queued, 90), 3), "queued_max_s": round(max(queued, default=0.0), 3),
        "final_p50_ms": round(1000 * percentile(latency, 50)), "final_p90_ms": round(1000 * percentile(latency, 90)),
        "mean_step": round(stepped / steps, 2) if steps else 0.0,
        "error_examples": failures[:5],
    }


def print_stream_table(rows: list[dict]) -> None:
    head = ["streams", "sessions", "errors", "differ", "chunk ms", "compute p50 ms", "compute p90 ms", "real time",
            "queued p90 s", "queued max s", "final p50 ms", "final p90 ms", "mean step"]
    keys = ["streams", "sessions", "errors", "differ", "chunk_ms", "compute_p50_ms", "compute_p90_ms", "real_time",
            "queued_p90_s", "queued_max_s", "final_p50_ms", "final_p90_ms", "mean_step"]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for row in rows:
        print("| " + " | ".join(("yes" if row[k] else "no") if k == "real_time" else str(row[k]) for k in keys) + " |")
    held = [row["streams"] for row in rows if row["real_time"] and not row["errors"]]
    tried = ", ".join(str(row["streams"]) for row in rows)
    print(f"most streams held in real time: {max(held) if held else 'none'} (of {tried})")


def run_streams(url: str, args: argparse.Namespace, info: dict) -> tuple[list[dict], dict]:
    if not info.get("streaming", {}).get("available"):
        reason = info.get("streaming", {}).get("reason", "no streaming endpoint")
        raise SystemExit(f"serve_load: {url} cannot stream: {reason}")
    ws_url = "ws" + url[len("http"):] + "/stream"
    speeches = [Speech(p.name, read_pcm16(str(p))) for p in good_files(args)]
    asyncio.run(stream_baseline(ws_url, speeches))
    chunk_seconds = info["streaming"]["chunk_seconds"]
    print(f"server {url}: {len(speeches)} files ({sum(s.seconds for s in speeches):.1f} s of audio), chunks of "
          f"{1000 * chunk_seconds:.0f} ms, endpoint silence {info['streaming']['endpoint_silence']:g} s")
    rows = []
    for n in [int(c) for c in args.streams.split(",")]:
        before = asyncio.run(health(url))
        start = time.perf_counter()
        done = asyncio.run(stream_load(ws_url, speeches, n, args.seconds))
        rows.append(summarize_streams(n, time.perf_counter() - start, done, chunk_seconds, before,
                                      asyncio.run(health(url))))
        print(f"  {n} streams: {rows[-1]['sessions']} files streamed, {rows[-1]['errors']} errors", flush=True)
    return rows, {"url": url, "limits": info["limits"], "streaming": info["streaming"], "files": len(speeches),
                  "audio_seconds": round(sum(s.seconds for s in speeches), 2)}


def print_table(rows: list[dict]) -> None:
    head = ["clients", "requests", "good", "bad", "errors", "503s", "req/s", "audio s/s", "p50 ms", "p90 ms",
            "p99 ms", "mean batch"]
    keys = ["clients", "requests", "good", "bad", "errors", "busy_503", "requests_per_s", "audio_s_per_s", "p50_ms",
            "p90_ms", "p99_ms", "mean_batch"]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for row in rows:
        print("| " + " | ".join(str(row[k]) for k in keys) + " |")


def start_server(args: argparse.Namespace) -> tuple[subprocess.Popen, str]:
    command = [sys.executable, "-m", "asr.cli", "serve", "--model", args.model, "--host", "127.0.0.1", "--port", "0",
               "--batch-size", str(args.batch_size), "--queue-size", str(args.queue_size),
               "--max-seconds", str(args.max_seconds)]
    if args.threads:
        command += ["--threads", str(args.threads)]
    if args.beam_size:
        command += ["--beam-size", str(args.beam_size)]
    if args.streams:  # room for the largest run: the test is of the server's step, not of its limit
        command += ["--max-streams", str(max(int(c) for c in args.streams.split(",")))]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    line = process.stdout.readline()
    if not line.startswith("serving on "):
        process.kill()
        raise SystemExit(f"serve_load: asr serve did not start ({line.strip() or 'no output'})")
    return process, line.split()[-1]


def good_files(args: argparse.Namespace) -> list[Path]:
    if args.audio:
        return [Path(p) for p in args.audio]
    if not args.manifest:
        raise SystemExit("serve_load: give --manifest M.jsonl or --audio FILES")
    base = Path(args.manifest).resolve().parent
    paths = []
    with open(args.manifest, encoding="utf-8") as f:
        for line in f:
            audio = Path(json.loads(line)["audio"])
            paths.append(audio if audio.is_absolute() else base / audio)
            if len(paths) == args.num_files:
                break
    return paths


def run_uploads(url: str, args: argparse.Namespace, info: dict) -> tuple[list[dict], dict]:
    goods = [Upload(p.name, p.read_bytes(), True) for p in good_files(args)]
    with tempfile.TemporaryDirectory() as tmp:
        bads = bad_uploads(goods[0], info["limits"]["max_seconds"], int(info["limits"]["max_upload_mb"] * 2**20),
                           Path(tmp))
    alone = asyncio.run(baseline(url, goods))
    every = max(1, round((1 - args.bad_fraction) / args.bad_fraction)) if args.bad_fraction > 0 else 0
    cycle, bad_index = [], 0
    for i, upload in enumerate(goods * len(bads)):  # the good files in order, a bad one after every `every`
        cycle.append(upload)
        if every and i % every == every - 1:
            cycle.append(bads[bad_index % len(bads)])
            bad_index += 1
    print(f"server {url}: {len(goods)} good files ({sum(u.seconds for u in goods):.1f} s of audio), "
          f"{len(bads)} kinds of bad file; alone: median {1000 * statistics.median(alone):.0f} ms per file")
    rows = []
    for clients in [int(c) for c in args.clients.split(",")]:
        before = asyncio.run(health(url))
        start = time.perf_counter()
        answers = asyncio.run(load(url, cycle, clients, args.seconds))
        rows.append(summarize(clients, time.perf_counter() - start, answers, before, asyncio.run(health(url))))
        print(f"  {clients} clients: {rows[-1]['requests']} requests, {rows[-1]['errors']} errors", flush=True)
    return rows, {"url": url, "limits": info["limits"], "good_files": len(goods),
                  "good_audio_seconds": round(sum(u.seconds for u in goods), 2),
                  "alone_median_ms": round(1000 * statistics.median(alone))}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--model", help="start `asr serve --model MODEL` on a free loopback port")
    where.add_argument("--url", help="a running server on this machine, e.g. http://127.0.0.1:8000")
    parser.add_argument("--manifest", help="good files: the first --num-files utterances of this manifest")
    parser.add_argument("--num-files", type=int, default=32)
    parser.add_argument("--audio", nargs="+", help="good files (instead of --manifest)")
    parser.add_argument("--clients", default="1,4,16", help="client counts, one run each (default 1,4,16)")
    parser.add_argument("--streams", metavar="N[,N...]", help="test the WebSocket instead: N concurrent real-time "
                        "streams, one run each")
    parser.add_argument("--seconds", type=float, default=30.0, help="length of each run (default 30)")
    parser.add_argument("--bad-fraction", type=float, default=0.2, help="share of bad files sent (default 0.2)")
    parser.add_argument("--threads", type=int, help="the server's --threads")
    parser.add_argument("--batch-size", type=int, default=8, help="the server's --batch-size (default 8)")
    parser.add_argument("--queue-size", type=int, default=16, help="the server's --queue-size (default 16)")
    parser.add_argument("--max-seconds", type=float, default=30.0, help="the server's --max-seconds (default 30)")
    parser.add_argument("--beam-size", type=int, help="the server's --beam-size")
    parser.add_argument("--out", "--json", dest="out", help="write the results as JSON")
    args = parser.parse_args(argv)

    process = None
    if args.url:
        host = urllib.parse.urlsplit(args.url).hostname
        if host not in LOOPBACK:
            raise SystemExit(f"serve_load: {args.url} is not on this machine; this tool loads loopback servers only")
        url = args.url.rstrip("/")
    else:
        process, url = start_server(args)
    try:
        info = asyncio.run(health(url))
        if args.streams:
            rows, result = run_streams(url, args, info)
        else:
            rows, result = run_uploads(url, args, info)
    finally:
        if process is not None:
            process.terminate()
            process.wait(timeout=30)
    if args.streams:
        print_stream_table(rows)
        key = "streams"
    else:
        print_table(rows)
        key = "clients"
    for row in rows:
        for example in row["error_examples"]:
            print(f"error ({row[key]} {key}): {example}")
    if args.out:
        Path(args.out).write_text(json.dumps({**result, "runs": rows}, indent=2) + "\n")
        print(f"wrote {args.out}")
    return 1 if any(row["errors"] for row in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
