"""`asr serve`'s WebSocket endpoint: words while the speaker talks (asr.streaming), many streams
sharing the batched encoder step.

    GET /stream   (WebSocket upgrade)

The protocol. The client sends:

  - optionally first, a text message {"rate": 16000, "chunk_size": C}, both keys optional:
    "rate" must be 16000 (resample on the client); "chunk_size" is the stream's chunk in encoder
    frames (1 to MAX_CHUNK; default the server's stream_chunk_size, e.g. 16 = 640 ms at 4x and
    10 ms frames): smaller chunks give earlier words and cost more compute; an exported model
    streams only the chunk_size it was exported with;
  - binary messages: mono PCM at 16 kHz, little-endian signed 16-bit samples (an even number of
    bytes), of any length up to max_message_kb (100 ms = 3,200 bytes is a good frame);
  - the text message {"end": true} when the audio ends.

The server sends text messages, JSON objects:

  - {"type": "partial", "text", "start", "end", "compute", "queued"}: the best guess so far of
    the open segment (it may change); "start" and "end" are seconds of the stream's audio (the
    segment's start, the end of the audio heard), "compute" the seconds of the batched encoder
    step that brought it (shared by the streams stepped with it), "queued" the seconds of this
    stream's audio received and not yet covered by a result when it was sent;
  - {"type": "final", ...the same keys}: a segment's text, which will not change (at an endpoint:
    stream_endpoint_silence seconds of silence, or stream_max_segment seconds of segment; and at
    the end);
  - {"type": "done"} after the last final once the client has sent {"end": true}; the server then
    closes the socket (1000);
  - {"type": "error", "error": "<one line>"}, then it closes the socket with the code that says
    why: 1003 for data the server does not take (a text message that is not this protocol's, an
    odd number of bytes, audio after the end, a rate other than 16000; and a model that cannot
    stream), 1008 for a limit (more audio than max_stream_seconds, or open longer than that and
    stream_receive_timeout_s; nothing received for stream_receive_timeout_s before the end),
    1011 when decoding failed, 1013 when max_streams streams are open (busy: try again later),
    1001 when the server shuts down. A message larger than max_message_kb is closed by aiohttp
    with 1009 and no message.

Before the upgrade the request passes the server's Host and Origin checks (asr.serve_guard.Gate):
WebSockets are not covered by CORS, so a page of another site (Origin) is refused (403) unless
--allow-origin names it, and a Host that does not name this server (DNS rebinding) gets 421.
The socket has a heartbeat (a ping after heartbeat_s without data; closed when no pong comes in
heartbeat_s / 2), a receive timeout, a message size limit and a duration limit. A client that
sends faster than the server decodes is paced: while more than stream_ahead_s of its audio waits
for the encoder, its socket is not read (TCP holds the rest back).

The decoding. Each stream is an asr.streaming.Stream (Recognizer.stream). Audio is fed to its
stream on the event loop as it arrives, 20 ms or more at a time (filterbank frames, no encoder
work). A stepper task wakes when a stream is ready (a whole chunk waits, or it ended) and runs
asr.streaming.advance over every ready stream at once on the server's single decoding thread
(shared with the upload batches, so a large upload batch delays the streams): the chunks of
different streams are encoded together, in one batched encoder step, and each stream's chunks
that wait are all encoded by it. Audio that arrives for a stream inside a step waits beside it,
and is fed after the step. A stream whose client leaves is dropped at once (a step it is in
runs to its end).
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from asr import streaming
from asr.audio import SAMPLE_RATE

if TYPE_CHECKING:
    from concurrent.futures import Executor

    from asr.api import Recognizer

__all__ = ["MAX_CHUNK", "StreamHub"]

log = logging.getLogger("asr.serve")
MAX_CHUNK = 64  # the largest chunk_size a client may ask for (encoder frames)
FEED_SAMPLES = 320  # audio is fed to a stream 20 ms or more at a time (a flood of tiny messages costs little)
CLOSE_TIMEOUT_S = 5.0  # how long a close waits for the client's close frame

# close codes (RFC 6455, 7.4.1)
NORMAL, GOING_AWAY, UNSUPPORTED, POLICY, SERVER_ERROR, TRY_LATER = 1000, 1001, 1003, 1008, 1011, 1013


class _Refused(Exception):
    """What a client sent that ends its stream: one line, and the close code."""

    def __init__(self, message: str, code: int) -> None:
        super().__init__(message)
        self.code = code


@dataclass(eq=False)
class _Live:
    """One open WebSocket stream: its socket, its Stream (once the first message came), what it
    has sent, and the messages waiting to be sent to it (in order, by its sender task)."""

    ws: Any
    remote: str
    outbox: asyncio.Queue = field(default_factory=asyncio.Queue)  # dicts; (code, reason) closes
    stream: Any = None  # asr.streaming.Stream
    chunk_seconds: float = 0.0  # of its chunk_size
    received: float = 0.0  # seconds of audio received
    stepped: float = 0.0  # of them, those received before its last step began (all but a partial chunk encoded)
    heard: float = 0.0  # seconds of audio its results cover (the last event's end)
    ended: bool = False  # the client sent {"end": true}
    stepping: bool = False  # inside an advance: what comes meanwhile waits, fed after it
    waiting: list[np.ndarray] = field(default_factory=list)  # int16 samples not fed yet
    waiting_samples: int = 0
    closing: bool = False  # an error or the close is queued: nothing more is read, fed or sent
    stepped_event: asyncio.Event = field(default_factory=asyncio.Event)  # set after each of its steps

    def send(self, message: dict[str, Any]) -> None:
        if not self.closing:
            self.outbox.put_nowait(message)

    def close(self, code: int, error: str | None = None) -> None:
        """Queue the error (if any) and the close; later messages are dropped."""
        if self.closing:
            return
        if error is not None:
            self.outbox.put_nowait({"type": "error", "error": error})
        self.outbox.put_nowait((code, error or ""))
        self.closing = True
        self.stepped_event.set()


class StreamHub:
    """The streams of GET /stream and the stepper that advances them together (see the module
    docstring). `decoder` is the server's one decoding thread; `handle` is the route's handler
    (after the server's Host and Origin middleware), `start` / `shutdown` / `stop` the app's
    startup, shutdown and cleanup steps."""

    def __init__(self, recognizer: Recognizer, options: Any, decoder: Executor) -> None:
        # options: asr.serve.ServeOptions (asr.serve imports this module: no import back)
        self.recognizer, self.options, self._decoder = recognizer, options, decoder
        self.chunk_size: int = 0  # the streams' defaults, set by _check_model when the model streams
        self.left_chunks: int = -1
        self.unavailable = self._check_model()  # None, or why this model cannot stream
        self._open: set[_Live] = set()
        self._wake: asyncio.Event | None = None  # made in the serving loop
        self._stepper: asyncio.Task | None = None
        self.stats = {"streams": 0, "busy": 0, "steps": 0, "stepped": 0, "largest_step": 0}

    def _check_model(self) -> str | None:
        """None when the model streams with the options' chunk settings (then taken as the streams'
        defaults: the model's own where the options leave them unset), else why not."""
        o = self.options
        try:
            probe = self.recognizer.stream(o.stream_chunk_size, o.stream_left_chunks)
        except (ValueError, AttributeError, NotImplementedError) as e:  # a model without chunked encoding
            return f"this server's model cannot stream ({e}); send the audio to POST /api/transcribe"
        self.chunk_size, self.left_chunks = probe.options.chunk_size, probe.options.left_chunks
        return None

    def _new_stream(self, chunk_size: int) -> Any:
        o = self.options
        return self.recognizer.stream(chunk_size, self.left_chunks, endpoint_silence=o.stream_endpoint_silence,
                                      max_segment=o.stream_max_segment)

    @property
    def chunk_seconds(self) -> float:
        """Seconds of audio in a chunk of the default chunk_size."""
        return self._seconds(self.chunk_size)

    def _seconds(self, chunk_size: int) -> float:
        return chunk_size / self.recognizer.model.config.frames_per_second

    def health(self) -> dict[str, Any]:
        """What /api/health shows under "streaming": "available" (else "reason"), the streams
        "open" now, "streams" opened and refused ("busy") so far, batched "steps", the streams
        "stepped" in all (stepped / steps: the mean batch), the "largest_step"; and the
        defaults: "chunk_size", "chunk_seconds", "endpoint_silence"."""
        info: dict[str, Any] = {"available": self.unavailable is None, "open": len(self._open), **self.stats}
        if self.unavailable is None:
            info.update(chunk_size=self.chunk_size, chunk_seconds=round(self.chunk_seconds, 4),
                        endpoint_silence=self.options.stream_endpoint_silence)
        else:
            info["reason"] = self.unavailable
        return info

    # -- the app's lifetime ---------------------------------------------------------------------

    async def start(self, app: Any) -> None:
        self._wake = asyncio.Event()
        self._stepper = asyncio.create_task(self._step_loop())

    async def shutdown(self, app: Any) -> None:
        """Tell every open stream the server is going away (before aiohttp closes the connections)."""
        for live in list(self._open):
            live.close(GOING_AWAY, "the server is shutting down")
        await asyncio.sleep(0)  # the senders run

    async def stop(self, app: Any) -> None:
        if self._stepper is not None:
            self._stepper.cancel()
            await asyncio.gather(self._stepper, return_exceptions=True)

    # -- one stream -----------------------------------------------------------------------------

    async def handle(self, request: Any) -> Any:
        """GET /stream: the WebSocket, from the upgrade to the close."""
        from aiohttp import web

        o = self.options
        ws = web.WebSocketResponse(heartbeat=o.heartbeat_s or None, max_msg_size=int(o.max_message_kb * 1024),
                                   timeout=CLOSE_TIMEOUT_S, compress=False)
        await ws.prepare(request)
        live = _Live(ws, str(request.remote))
        sender = asyncio.create_task(self._send_loop(live))
        try:
            if self.unavailable is not None:
                live.close(UNSUPPORTED, self.unavailable)
            elif len(self._open) >= o.max_streams:
                self.stats["busy"] += 1
                live.close(TRY_LATER, f"busy: {len(self._open)} streams are open, the most this server takes; "
                           "retry in a few seconds")
            else:
                self._open.add(live)
                self.stats["streams"] += 1
                try:
                    await self._receive_loop(live)
                except Exception as e:  # a bug of ours: logged, the client told in one line
                    log.exception("stream from %s failed", live.remote)
                    live.close(SERVER_ERROR, f"internal server error ({type(e).__name__}, logged)")
                live.close(NORMAL)  # the client closed, or left: nothing more to send
            await sender
        finally:
            self._open.discard(live)
            live.closing = True
            sender.cancel()
        return ws

    async def _receive_loop(self, live: _Live) -> None:
        """Read the client's messages until the socket closes or the stream is refused."""
        from aiohttp import WSMsgType

        ws, o = live.ws, self.options
        loop = asyncio.get_running_loop()
        deadline = loop.time() + o.max_stream_seconds + o.stream_receive_timeout_s  # of the wall clock
        while not live.closing:
            ahead = max(o.stream_ahead_s, 2 * live.chunk_seconds)
            if live.received - live.stepped > ahead:  # the encoder is behind this stream: TCP holds the rest
                live.stepped_event.clear()
                await live.stepped_event.wait()
                continue
            try:
                wait = max(0.001, min(o.stream_receive_timeout_s, deadline - loop.time()))
                message = await ws.receive(timeout=None if live.ended else wait)
            except asyncio.TimeoutError:
                if loop.time() >= deadline:
                    live.close(POLICY, f"open for more than {o.max_stream_seconds + o.stream_receive_timeout_s:g} s: "
                               "the longest a stream may last here")
                else:
                    live.close(POLICY, f"nothing received for {o.stream_receive_timeout_s:g} s: send audio as it "
                               "comes, then {\"end\": true}")
                return
            if message.type == WSMsgType.ERROR:  # aiohttp has closed the socket (1009: too big)
                log.info("stream from %s: %s", live.remote, message.data)
            if message.type not in (WSMsgType.BINARY, WSMsgType.TEXT):  # closed by either side
                return
            try:
                if message.type == WSMsgType.BINARY:
                    self._audio(live, message.data)
                else:
                    self._control(live, message.data)
            except _Refused as e:
                log.info("stream from %s refused: %s", live.remote, e)
                live.close(e.code, str(e))

    def _control(self, live: _Live, text: str) -> None:
        """A text message: the first one may set "rate" and "chunk_size"; {"end": true} ends."""
        try:
            message = json.loads(text)
        except ValueError:
            message = None
        if not isinstance(message, dict) or not message:
            raise _Refused("a text message must be a JSON object: {\"rate\": 16000, \"chunk_size\": C} first, "
                           "or {\"end\": true}", UNSUPPORTED)
        unknown = sorted(set(message) - {"rate", "chunk_size", "end"})
        if unknown:
            raise _Refused(f"unknown keys {', '.join(map(repr, unknown))[:100]}: the protocol's are rate, "
                           "chunk_size and end", UNSUPPORTED)
        if "rate" in message or "chunk_size" in message:
            self._configure(live, message)
        if "end" in message:
            if message["end"] is not True:
                raise _Refused("\"end\" must be true", UNSUPPORTED)
            self._begin(live)
            if not live.ended:
                live.ended = True
                if not live.stepping:  # else after the step (_after_step)
                    self._feed(live, everything=True)
                    live.stream.end()
                    self._wake.set()

    def _configure(self, live: _Live, message: dict[str, Any]) -> None:
        if live.stream is not None:
            raise _Refused("\"rate\" and \"chunk_size\" come in the first message, before any audio", UNSUPPORTED)
        rate = message.get("rate", SAMPLE_RATE)
        if rate != SAMPLE_RATE or isinstance(rate, bool):
            raise _Refused(f"rate {str(rate)[:20]}: this server takes 16000 Hz audio only (resample it before "
                           "sending)", UNSUPPORTED)
        chunk = message.get("chunk_size", self.chunk_size)
        if not isinstance(chunk, int) or isinstance(chunk, bool) or not 1 <= chunk <= MAX_CHUNK:
            raise _Refused(f"chunk_size {str(chunk)[:20]}: an integer from 1 to {MAX_CHUNK} (encoder frames)",
                           UNSUPPORTED)
        self._begin(live, chunk)

    def _begin(self, live: _Live, chunk_size: int | None = None) -> None:
        """The live's Stream, made by its first message."""
        if live.stream is None:
            chunk_size = chunk_size or self.chunk_size
            try:
                live.stream = self._new_stream(chunk_size)
            except ValueError as e:  # a chunk_size an exported model was not exported with
                raise _Refused(str(e), UNSUPPORTED) from None
            live.chunk_seconds = self._seconds(chunk_size)

    def _audio(self, live: _Live, data: bytes) -> None:
        """A binary message: int16 samples, fed to the stream (or kept beside it during its step)."""
        self._begin(live)
        if live.ended:
            raise _Refused("audio after {\"end\": true}", UNSUPPORTED)
        if len(data) % 2:
            raise _Refused(f"a binary message of {len(data)} bytes: audio is 16-bit samples (an even number of "
                           "bytes)", UNSUPPORTED)
        if not data:
            return
        seconds = len(data) / 2 / SAMPLE_RATE
        if live.received + seconds > self.options.max_stream_seconds:
            raise _Refused(f"more than {self.options.max_stream_seconds:g} s of audio: the most one stream may "
                           "send here", POLICY)
        live.received += seconds
        live.waiting.append(np.frombuffer(data, dtype="<i2"))
        live.waiting_samples += len(data) // 2
        if not live.stepping:  # else after the step
            self._feed(live)
            if live.stream.ready:
                self._wake.set()

    @staticmethod
    def _feed(live: _Live, everything: bool = False) -> None:
        """Feed the live's waiting samples to its stream: FEED_SAMPLES or more, or `everything`."""
        if live.waiting and (everything or live.waiting_samples >= FEED_SAMPLES):
            samples = np.concatenate(live.waiting).astype(np.float32) / 32768.0
            live.waiting, live.waiting_samples = [], 0
            live.stream.feed(torch.from_numpy(samples))

    async def _send_loop(self, live: _Live) -> None:
        """Send the live's messages in order; a (code, reason) item closes the socket."""
        ws = live.ws
        while True:
            item = await live.outbox.get()
            if isinstance(item, tuple):
                code, reason = item
                await ws.close(code=code, message=reason.encode()[:120].decode("utf-8", "ignore").encode())
                return
            if ws.closed:
                continue
            try:
                await ws.send_str(json.dumps(item, ensure_ascii=False))
            except (ConnectionError, RuntimeError):  # the client left
                continue

    # -- the stepper ----------------------------------------------------------------------------

    async def _step_loop(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            ready = [live for live in self._open if not live.closing and live.stream is not None and live.stream.ready]
            if ready:
                await self._step(ready)

    async def _step(self, lives: list[_Live]) -> None:
        """One batched advance of `lives` on the decoding thread; then each is sent its events,
        fed what came meanwhile, and told "done" once finished."""
        for live in lives:
            live.stepping, live.stepped = True, live.received
        start = time.perf_counter()
        try:
            results = await asyncio.get_running_loop().run_in_executor(self._decoder, streaming.advance,
                                                                       [live.stream for live in lives])
        except Exception as e:  # the server's failure: every stream of the step is told
            log.exception("streaming step failed")
            for live in lives:
                live.stepping = False
                live.close(SERVER_ERROR, f"decoding failed ({type(e).__name__}, logged)")
            return
        compute = time.perf_counter() - start
        self.stats["steps"] += 1
        self.stats["stepped"] += len(lives)
        self.stats["largest_step"] = max(self.stats["largest_step"], len(lives))
        for live, events in zip(lives, results):
            live.stepping = False
            for event in events:
                live.heard = max(live.heard, event.end)
                live.send({"type": event.kind, "text": event.text, "start": round(event.start, 3),
                           "end": round(event.end, 3), "compute": round(compute, 4),
                           "queued": round(max(0.0, live.received - live.heard), 3)})
            self._after_step(live)
        if any(live.stream is not None and live.stream.ready for live in self._open if not live.closing):
            self._wake.set()

    def _after_step(self, live: _Live) -> None:
        live.stepped_event.set()
        if live.closing:
            return
        if live.stream.finished:
            live.send({"type": "done"})
            live.close(NORMAL)
            return
        self._feed(live, everything=live.ended)
        if live.ended:
            live.stream.end()
