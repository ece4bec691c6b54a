#!/usr/bin/env python3
"""Stream an audio file to `asr serve`'s WebSocket (GET /stream) and print what comes back:
partial results on stderr (each over the last), final ones on stdout, one line each.

    python tools/stream_client.py --url ws://127.0.0.1:8000/stream FILE.wav [--realtime]

The file (anything soundfile reads; other rates than 16 kHz resampled by asr.audio) is sent as
16 kHz little-endian int16 frames of --frame-ms, as fast as the server takes them (it paces a
client that runs ahead), or with --realtime one frame per --frame-ms of the wall clock, as a
microphone would; then {"end": true}, and the client waits for the server's "done". The protocol
is in asr/serve_stream.py. Exit status: 0 after "done", 1 after an error message or a close
without "done" (the error on stderr).
"""
from __future__ import annotations

import argparse
import asyncio
import bisect
import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import soundfile as sf

RATE = 16000


def read_pcm16(path: str) -> bytes:
    """The file as 16 kHz mono little-endian int16 bytes."""
    samples, rate = sf.read(path, dtype="float32", always_2d=True)
    wave = samples.mean(axis=1)
    if rate != RATE:
        from asr.audio import to_mono_16k

        wave = to_mono_16k(wave, rate).numpy()
    return (np.clip(np.round(wave * 32768), -32768, 32767).astype("<i2")).tobytes()


@dataclass
class Session:
    """What one stream sent and received, with wall-clock times (time.perf_counter)."""

    sent: list[tuple[float, float]] = field(default_factory=list)  # (time, seconds of audio sent by then)
    messages: list[tuple[float, dict]] = field(default_factory=list)  # (time, JSON message)
    ended: float | None = None  # when {"end": true} was sent
    done: bool = False  # "done" came
    close_code: int | None = None

    def sent_at(self, seconds: float) -> float:
        """When the audio up to `seconds` had been sent (the end message's time past the last sample)."""
        at = bisect.bisect_left([s for _, s in self.sent], seconds - 1e-6)
        if at < len(self.sent):
            return self.sent[at][0]
        return self.ended if self.ended is not None else float("nan")


async def stream(url: str, pcm: bytes, *, realtime: bool = False, frame_ms: float = 100.0,
                 chunk_size: int | None = None, on_message: Callable[[dict], None] | None = None,
                 timeout: float = 60.0) -> Session:
    """Send `pcm` (16 kHz int16 bytes) over a WebSocket to `url`, in frames of `frame_ms`; with
    `realtime` each frame once the wall clock has passed its end, as a microphone sends it.
    `on_message` is called with every JSON message the server sends. The Session says what
    happened; aiohttp's errors (no connection, a refused upgrade) and a `timeout` without any
    message are raised."""
    import aiohttp

    frame = int(RATE * frame_ms / 1000) * 2
    first = {"rate": RATE} if chunk_size is None else {"rate": RATE, "chunk_size": chunk_size}
    session = Session()
    async with aiohttp.ClientSession() as client, client.ws_connect(url, heartbeat=30, max_msg_size=1 << 20) as ws:

        async def send() -> None:
            await ws.send_str(json.dumps(first))
            start = time.perf_counter()
            for at in range(0, len(pcm), frame):
                piece = pcm[at:at + frame]
                if realtime:
                    await asyncio.sleep(max(0.0, start + (at + len(piece)) / 2 / RATE - time.perf_counter()))
                await ws.send_bytes(piece)
                session.sent.append((time.perf_counter(), (at + len(piece)) / 2 / RATE))
            await ws.send_str(json.dumps({"end": True}))
            session.ended = time.perf_counter()

        sender = asyncio.create_task(send())
        try:
            while True:
                message = await ws.receive(timeout=timeout)
                if message.type != aiohttp.WSMsgType.TEXT:
                    break
                body = json.loads(message.data)
                session.messages.append((time.perf_counter(), body))
                session.done = session.done or body.get("type") == "done"
                if on_message is not None:
                    on_message(body)
        finally:
            if not sender.done():
                sender.cancel()
            await asyncio.gather(sender, return_exceptions=True)
        session.close_code = ws.close_code
    return session


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("audio", metavar="FILE", help="the audio file to stream")
    parser.add_argument("--url", default="ws://127.0.0.1:8000/stream", help="default ws://127.0.0.1:8000/stream")
    parser.add_argument("--realtime", action="store_true", help="send in real time, as a microphone would")
    parser.add_argument("--frame-ms", type=float, default=100.0, help="audio per message (default 100)")
    parser.add_argument("--chunk-size", type=int, help="the stream's chunk in encoder frames (default: the server's)")
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds to wait for a message (default 60)")
    args = parser.parse_args(argv)
    try:
        pcm = read_pcm16(args.audio)
    except (OSError, RuntimeError, ValueError) as e:
        print(f"stream_client: {args.audio}: {e}", file=sys.stderr)
        return 1
    failed = False
    partial_shown = False

    def show(message: dict) -> None:
        nonlocal failed, partial_shown
        kind = message.get("type")
        if kind == "partial":
            print(f"\r\x1b[K{message['text']}" if sys.stderr.isatty() else message["text"], end="" if
                  sys.stderr.isatty() else "\n", file=sys.stderr, flush=True)
            partial_shown = True
        elif kind == "final":
            if partial_shown and sys.stderr.isatty():
                print("\r\x1b[K", end="", file=sys.stderr, flush=True)
            partial_shown = False
            if message["text"]:
                print(message["text"], flush=True)
        elif kind == "error":
            failed = True
            print(f"stream_client: error: {message['error']}", file=sys.stderr)

    import aiohttp

    try:
        session = asyncio.run(stream(args.url, pcm, realtime=args.realtime, frame_ms=args.frame_ms,
                                     chunk_size=args.chunk_size, on_message=show, timeout=args.timeout))
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
        print(f"stream_client: {args.url}: {type(e).__name__ if not str(e) else e}", file=sys.stderr)
        return 1
    if not session.done and not failed:
        print(f"stream_client: the server closed the stream without \"done\" ({session.close_code})", file=sys.stderr)
    return 0 if session.done and not failed else 1


if __name__ == "__main__":
    sys.exit(main())
