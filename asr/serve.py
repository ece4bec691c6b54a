"""`asr serve`: an HTTP API and a web page that transcribe uploads with one Recognizer.

    POST /api/transcribe   multipart/form-data with the audio in a field "file" (or the audio as
                           the whole body, its name in ?name=); WAV (RIFF, RF64, W64), FLAC, OGG
                           (Vorbis, Opus), MP3, AIFF, AU, CAF, NIST or VOC, told by the first bytes
                           (the client's file name never picks the decoder). 200 with
                           {"name", "text", "duration", "segments": [{"start", "end", "text",
                           "words"}], "words": [{"word", "start", "end", "confidence"}]}; 400 for
                           an empty, missing or malformed upload, 403 for a request another web
                           site made, 408 for an upload that stalls, 413 for one too big or too
                           long, 415 for audio that cannot be read, 421 for a Host that does not
                           name this server, 503 with Retry-After when busy. Every error is
                           {"error": "<one line naming the upload>"}.
    GET  /api/health       {"status": "ok", "queued", "requests", "batches", "largest_batch", what is
                           held now (connections, uploads, temporary bytes), "limits", "streaming":
                           {"available" (or "reason" why not), "open", "chunk_seconds", ...}}
    GET  /stream           a WebSocket: 16 kHz PCM in, partial and final results out as JSON, the
                           chunks of all open streams encoded together (asr.serve_stream, which
                           documents the protocol; tools/stream_client.py is a client)
    GET  /                 the web page (asr/web/): upload a file or record the microphone, see the
                           words with their times, click one to play the audio from there; or
                           "Live": the microphone streamed, words grey while partial, black once final.

Built on aiohttp: one asyncio loop reads uploads and answers while a single worker thread decodes.
Requests that arrive together are decoded together: the worker takes what is waiting (up to
`batch_size` requests, after waiting `batch_wait_ms` for more) and runs one
`Recognizer.transcribe` over all of them, whose segments share the batched search. Uploads are read
and checked before they queue, so a bad file never reaches the model and the queue holds only
waveforms (at most queue_size x max_seconds of 16 kHz float32). The server sets no thread count:
`asr serve` decides it once, at start-up, as the other decoding commands do
(asr.decoding.thread_policy), and the Recognizer's tasks apply it.

What a client can hold is bounded (ServeOptions): open connections (below the file-descriptor
limit; past the cap the oldest connection that is not inside a request, and past its first second,
is closed), connections that send no request (idle_timeout_s, which also closes one still sending
its headers), uploads being received and the temporary disk they fill (503 with Retry-After before
the body is read, until an upload that sends less than 64 kB in give_way_s gives way), the time an
upload may take (read_timeout_s without a byte, upload_timeout_s in all), and every byte of a form
counts against max_upload_mb. A client that leaves is not decoded for (a batch begun runs to its
end). The Host
header must name this server (loopback names, the bound address, `allowed_hosts`) and a request
another site's page makes (Origin, Sec-Fetch-Site) is refused unless `allow_origins` names it:
a web page cannot use a server on this machine by DNS rebinding or a cross-site form post.
The WebSocket (which CORS does not cover) passes the same checks before its upgrade; what a stream
may hold is bounded too (max_streams, max_stream_seconds, a heartbeat, a receive timeout, a message
size, and audio waiting for the encoder: asr.serve_stream).
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import math
import os
import signal
import tempfile
import time
import warnings
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from asr.api import Recognizer, Result
from asr.audio import SAMPLE_RATE, AudioError, audio_info, iter_blocks
from asr.formats import result_dict
from asr.serve_guard import (
    BACKLOG,
    GRACE_S,
    KNOWN_CONTAINERS,
    SNIFF_BYTES,
    Connections,
    Gate,
    UploadError,
    clean_name,
    connection_cap,
    dumps,
    error_response,
    one_line,
    raise_fd_limit,
    sniff_audio,
)
from asr.serve_stream import StreamHub

__all__ = ["ServeOptions", "Server", "UploadError", "run", "sniff_audio", "clean_name"]

log = logging.getLogger(__name__)
WEB = Path(__file__).resolve().parent / "web"
PAGES = {"/": ("index.html", "text/html"), "/recorder.js": ("recorder.js", "text/javascript"),
         "/live.js": ("live.js", "text/javascript")}
CHUNK = 64 * 1024  # bytes read from an upload at a time
FORM_SLACK = 64 * 1024  # bytes of a form beyond its file (boundaries, part headers, small fields)
PROGRESS_BYTES = 64 * 1024  # an upload that does not send this much in give_way_s gives way when the server is full


@dataclass(frozen=True)
class ServeOptions:
    """Limits, batching and who may call the server. Every limit bounds what clients can hold."""

    max_upload_mb: float = 50.0  # bytes of one request body (every form field counts)
    max_seconds: float = 600.0  # seconds of audio in one upload
    queue_size: int = 16  # uploads read and waiting for the model; one more is answered 503
    batch_size: int = 8  # uploads decoded together
    batch_wait_ms: float = 10.0  # after the first upload, how long the worker waits for others
    word_timestamps: bool = True
    max_uploads: int = 16  # uploads being received at once; one more is answered 503 before its body
    max_temp_mb: float = 512.0  # temporary disk held by the uploads being received and read
    max_connections: int = 1000  # open connections (lowered below the process's file-descriptor limit)
    idle_timeout_s: float = 15.0  # a connection without a request (or still sending headers) is closed
    read_timeout_s: float = 15.0  # an upload that sends nothing for this long is answered 408
    upload_timeout_s: float = 300.0  # an upload not received in this time is answered 408
    give_way_s: float = 2.0  # when full, an upload that sent no 64 kB for this long is closed for a new one (0: never)
    allowed_hosts: tuple[str, ...] = ()  # Host names beside the loopback ones and the bound address; "*": any
    allow_origins: tuple[str, ...] = ()  # other sites' origins ("https://app.example") whose pages may call; "*": any
    # streaming (GET /stream, asr.serve_stream)
    max_streams: int = 16  # WebSocket streams open at once; one more is told busy (1013)
    max_stream_seconds: float = 600.0  # seconds of audio one stream may send (and of the wall clock, with
    # stream_receive_timeout_s more, that it may stay open before its end)
    stream_chunk_size: int | None = None  # encoder frames per chunk (a client may ask for 1 to 64); None: the
    # model's own (16; an export's, fixed when it was exported)
    stream_left_chunks: int | None = None  # chunks of left context a chunk attends to; -1: all (the attention
    # cache then grows with the stream, up to max_stream_seconds); None: the model's own (-1; an export's)
    stream_endpoint_silence: float = 0.5  # seconds of silence after words that make a final; 0: only at the end
    stream_max_segment: float = 30.0  # seconds after which a segment is made final; 0: no limit
    stream_ahead_s: float = 10.0  # audio of a stream waiting for the encoder past which its socket is not read
    stream_receive_timeout_s: float = 10.0  # a stream that sends nothing for this long (before its end) is closed
    heartbeat_s: float = 20.0  # a ping after this long without data; closed without a pong in half of it (0: none)
    max_message_kb: float = 64.0  # the largest WebSocket message (2 s of 16 kHz int16)

    def __post_init__(self) -> None:
        if not (self.max_upload_mb > 0 and self.max_seconds > 0 and self.max_temp_mb > 0):
            raise ValueError("serve: the upload limits must be positive")
        if self.queue_size < 1 or self.batch_size < 1 or self.batch_wait_ms < 0:
            raise ValueError("serve: queue_size and batch_size must be at least 1, batch_wait_ms at least 0")
        if self.max_uploads < 1 or self.max_connections < 1:
            raise ValueError("serve: max_uploads and max_connections must be at least 1")
        if not (self.idle_timeout_s > 0 and self.read_timeout_s > 0 and self.upload_timeout_s > 0):
            raise ValueError("serve: the timeouts must be positive")
        if not self.give_way_s >= 0:
            raise ValueError("serve: give_way_s must be at least 0")
        if (self.max_streams < 1 or (self.stream_chunk_size is not None and not 1 <= self.stream_chunk_size <= 64)
                or (self.stream_left_chunks is not None and self.stream_left_chunks < -1)):
            raise ValueError("serve: max_streams must be at least 1, stream_chunk_size from 1 to 64, "
                             "stream_left_chunks at least -1")
        if not (self.max_stream_seconds > 0 and self.stream_ahead_s > 0 and self.stream_receive_timeout_s > 0
                and self.max_message_kb > 0):
            raise ValueError("serve: the stream limits must be positive")
        if not (self.stream_endpoint_silence >= 0 and self.stream_max_segment >= 0 and self.heartbeat_s >= 0):
            raise ValueError("serve: stream_endpoint_silence, stream_max_segment and heartbeat_s must be at least 0")
        object.__setattr__(self, "allowed_hosts", tuple(h.strip().lower().rstrip(".") for h in self.allowed_hosts))
        object.__setattr__(self, "allow_origins", tuple(o.strip().lower().rstrip("/") for o in self.allow_origins))

    @property
    def max_bytes(self) -> int:
        return int(self.max_upload_mb * 1024 * 1024)

    @property
    def max_temp_bytes(self) -> int:
        return int(self.max_temp_mb * 1024 * 1024)

    def limits(self) -> dict[str, Any]:
        """The numeric limits (what /api/health shows; who may call stays private)."""
        return {k: v for k, v in asdict(self).items() if k not in ("allowed_hosts", "allow_origins")}




# ---------------------------------------------------------------------------------------------
# the server


@dataclass(eq=False)
class _Slot:
    """An upload being received or read: its name, its temporary file, and when it last sent
    PROGRESS_BYTES (what decides whether it gives way to others when the server is full)."""

    request: Any
    progress: float  # loop time of the start, or of the last PROGRESS_BYTES of the body received
    name: str = "upload"  # clean_name of the client's
    path: Path | None = None  # the temporary file, its suffix from sniff_audio
    held: int = 0  # bytes in it
    reading: bool = False  # received, being read as audio: it no longer waits for the client
    evicted: bool = False  # closed to make room
    marked: int = 0  # bytes of the body received at `progress`

    def touch(self, now: float) -> None:
        """Mark the progress made by `now`."""
        received = self.request.content.total_bytes
        if received - self.marked >= PROGRESS_BYTES:
            self.marked, self.progress = received, now

    def stalled(self, now: float, give_way_s: float) -> bool:
        """Whether it has gone give_way_s (> 0) without PROGRESS_BYTES of body."""
        self.touch(now)
        return give_way_s > 0 and not self.reading and now - self.progress >= give_way_s


@dataclass(eq=False)
class _Job:
    name: str
    wave: torch.Tensor  # (T,) 16 kHz
    future: asyncio.Future
    gone: Callable[[], bool]  # whether the client has left
    seconds: float = field(init=False)

    def __post_init__(self) -> None:
        self.seconds = len(self.wave) / SAMPLE_RATE


class Server:
    """The aiohttp application around a Recognizer (`app()`), its queue and its decoding worker,
    and the WebSocket streams (`streams`: asr.serve_stream.StreamHub, whose steps run on the same
    decoding thread); `listen()` opens the socket with the connection cap."""

    def __init__(self, recognizer: Recognizer, options: ServeOptions | None = None, host: str = "127.0.0.1") -> None:
        self.recognizer, self.options = recognizer, options or ServeOptions()
        self.queue: asyncio.Queue[_Job] | None = None  # made in the loop that serves
        self._worker_task: asyncio.Task | None = None  # the decoding worker, in that loop
        self.stats = {"requests": 0, "batches": 0, "largest_batch": 0, "left": 0, "skipped": 0, "gave_way": 0}
        self.gate = Gate(host, self.options.allowed_hosts, self.options.allow_origins)
        grace = min(GRACE_S, self.options.idle_timeout_s / 2)
        self.connections = Connections(self.options.max_connections, grace, {
            "keepalive_timeout": self.options.idle_timeout_s,  # armed at connect: closes a slow header too
            "lingering_time": min(5.0, self.options.read_timeout_s),  # reading the body of a refused upload
            "max_headers": 64, "access_log": log})
        self._slots: set[_Slot] = set()  # the uploads being received or read
        self._queued_audio = 0.0  # seconds of audio queued or being decoded
        self._rate: float | None = None  # seconds of audio decoded per second (running), for Retry-After
        self._decoder = ThreadPoolExecutor(1, thread_name_prefix="asr-decode")  # the model's one thread
        self._reader = ThreadPoolExecutor(2, thread_name_prefix="asr-read")  # uploads to waveforms
        self._uploads = tempfile.TemporaryDirectory(prefix="asr-serve-")
        self._pages = {route: (WEB / name).read_bytes() for route, (name, _) in PAGES.items()}  # read once
        self.streams = StreamHub(recognizer, self.options, self._decoder)

    def app(self) -> Any:
        from aiohttp import web

        app = web.Application(client_max_size=self.options.max_bytes + FORM_SLACK, middlewares=[self._middleware()])
        app.router.add_post("/api/transcribe", self.handle_transcribe, expect_handler=self._expect)
        app.router.add_get("/api/health", self.handle_health)
        app.router.add_get("/stream", self.streams.handle)
        for route in PAGES:
            app.router.add_get(route, self.handle_page)
        app.on_startup.extend([self._start, self.streams.start])
        app.on_shutdown.append(self.streams.shutdown)
        app.on_cleanup.extend([self.streams.stop, self._stop])
        return app

    def runner_settings(self) -> dict[str, Any]:
        """The keyword arguments of aiohttp's AppRunner: a handler is cancelled when its client leaves."""
        return {"handler_cancellation": True, "shutdown_timeout": 10.0, **self.connections.settings}

    async def listen(self, web_server: Any, host: str, port: int) -> asyncio.AbstractServer:
        """Open the listening socket(s) with aiohttp's protocol factory under the connection cap."""
        self.connections.server = web_server
        return await asyncio.get_running_loop().create_server(self.connections, host, port, backlog=BACKLOG)

    async def _start(self, app: Any) -> None:
        self.queue = asyncio.Queue(self.options.queue_size)
        self._worker_task = asyncio.create_task(self._worker())

    async def _stop(self, app: Any) -> None:
        self._worker_task.cancel()
        self._decoder.shutdown(wait=True)
        self._reader.shutdown(wait=True)
        self._uploads.cleanup()

    def _middleware(self) -> Any:
        from aiohttp import web

        @web.middleware
        async def guard(request: Any, handler: Any) -> Any:
            """The Host and Origin checks, the connection marked busy while inside, and every refusal
            (ours and aiohttp's: 404, 405, ...) as a one-line JSON error, never a traceback."""
            protocol = request.protocol
            self.connections.busy.add(protocol)
            origin = None
            try:
                origin = self.gate.check(request)
                response = await handler(request)
            except UploadError as e:
                log.info("refused %s: %s", request.remote, e)
                response = error_response(e.status, str(e), e.headers)
            except web.HTTPException as e:
                if e.status < 400:
                    raise
                response = error_response(e.status, f"{request.method} {one_line(request.path, 80)}: {e.reason}")
            except asyncio.CancelledError:
                raise
            except ConnectionError:  # the client left: the answer is never delivered
                response = error_response(499, "the client closed the connection")
            except Exception:  # a bug of ours: logged with its traceback, answered in one line
                log.exception("%s %s failed", request.method, one_line(request.path, 80))
                response = error_response(500, "internal server error (logged)")
            finally:
                self.connections.busy.discard(protocol)
            if origin is not None and not response.prepared:  # (a WebSocket's headers are sent)
                response.headers["Access-Control-Allow-Origin"] = origin
                response.headers["Vary"] = "Origin"
            return response

        return guard

    async def _expect(self, request: Any) -> Any:
        """`Expect: 100-continue`: the checks that need no body run before the client sends it."""
        from aiohttp import HttpVersion11

        try:
            self.gate.check(request)
            self._admit(request)
        except UploadError as e:
            log.info("refused %s: %s", request.remote, e)
            return error_response(e.status, str(e), {**e.headers, "Connection": "close"})
        if request.headers.get("Expect", "").lower() != "100-continue":
            return error_response(417, f"unknown Expect: {one_line(request.headers['Expect'], 40)}")
        if request.version >= HttpVersion11:
            await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            request.writer.output_size = 0
        return None

    # -- handlers -------------------------------------------------------------------------------

    async def handle_page(self, request: Any) -> Any:
        from aiohttp import web

        return web.Response(body=self._pages[request.path], content_type=PAGES[request.path][1], charset="utf-8",
                            headers={"Cache-Control": "no-cache"})

    async def handle_health(self, request: Any) -> Any:
        from aiohttp import web

        queued = self.queue.qsize() if self.queue is not None else 0
        return web.json_response({"status": "ok", "queued": queued, **self.stats,
                                  "queued_audio_s": round(self._queued_audio, 3),
                                  "connections": len(self.connections.open), "evicted": self.connections.evicted,
                                  "refused_connections": self.connections.refused, "receiving": len(self._slots),
                                  "temp_bytes": self._held(), "limits": self.options.limits(),
                                  "streaming": self.streams.health()})

    async def handle_transcribe(self, request: Any) -> Any:
        from aiohttp import web

        slot = None
        try:
            self._admit(request)
            slot = _Slot(request, asyncio.get_running_loop().time())
            self._slots.add(slot)
            try:
                await self._receive(request, slot)
                slot.reading = True
                _check_present(request)
                wave = await asyncio.get_running_loop().run_in_executor(self._reader, self._read, slot)
            finally:
                self._discard(slot)
                self._slots.discard(slot)
            self._check_room()
            _check_present(request)
            job = _Job(slot.name, wave, asyncio.get_running_loop().create_future(), lambda: _gone(request))
            self.queue.put_nowait(job)
            self._queued_audio += job.seconds
            result: Result = await job.future
        except (asyncio.CancelledError, ConnectionError) as e:  # the client left, or its upload gave way
            self.stats["gave_way" if slot is not None and slot.evicted else "left"] += 1
            if isinstance(e, asyncio.CancelledError):  # aiohttp cancels the handler of a closed connection
                raise
            return error_response(499, "the client closed the connection")  # never delivered
        if result.error is not None:
            return error_response(415, f"{slot.name}: {one_line(result.error)}")
        body = result_dict(result)
        del body["path"], body["error"]
        body.update(name=slot.name, words=[w for s in body["segments"] for w in s.get("words", [])])
        return web.json_response(body, dumps=dumps)

    def _admit(self, request: Any) -> None:
        """The checks made before any byte of the body is read: room in the queue, the declared
        size, an upload slot and the temporary disk it would take (made by closing stalled
        uploads, see _make_room)."""
        self._check_room()
        length = request.content_length
        if length is not None and length > self.options.max_bytes + FORM_SLACK:
            raise UploadError(413, f"upload of {length / 2**20:.1f} MB: this server takes at most "
                              f"{self.options.max_upload_mb:g} MB")
        if self._make_room(1, min(length or 0, self.options.max_bytes)):
            return
        if len(self._slots) >= self.options.max_uploads:
            wait = self._room_retry_after()
            raise UploadError(503, f"busy: {len(self._slots)} uploads are being received; retry in {wait} s",
                              {"Retry-After": str(wait)})
        raise self._disk_full()

    def _make_room(self, slots: int, size: int, me: _Slot | None = None) -> bool:
        """Whether `slots` more uploads and `size` more bytes of temporary disk fit, after closing
        (oldest first) the uploads that have not sent 64 kB in give_way_s while this is wanted."""
        now = asyncio.get_running_loop().time()
        while len(self._slots) + slots > self.options.max_uploads or self._held() + size > self.options.max_temp_bytes:
            stalled = [s for s in self._slots if s is not me and s.stalled(now, self.options.give_way_s)]
            if not stalled:
                return False
            victim = min(stalled, key=lambda s: s.progress)
            log.info("closed the upload of %s from %s: nothing for %.1f s while others waited", victim.name,
                     victim.request.remote, now - victim.progress)
            victim.evicted = True
            self._slots.discard(victim)
            victim.request.protocol.force_close()  # its handler is cancelled and removes its file
        return True

    def _held(self) -> int:
        return sum(slot.held for slot in self._slots)

    def _check_room(self) -> None:
        """503 with Retry-After when the queue is full."""
        if self.queue is not None and self.queue.full():
            wait = self._retry_after()
            raise UploadError(503, f"busy: {self.queue.qsize()} uploads are waiting; retry in {wait} s",
                              {"Retry-After": str(wait)})

    def _disk_full(self) -> UploadError:
        wait = self._room_retry_after()
        return UploadError(503, f"busy: the uploads being received hold {self._held() / 2**20:.1f} MB of the "
                           f"{self.options.max_temp_mb:g} MB of temporary disk; retry in {wait} s",
                           {"Retry-After": str(wait)})

    def _retry_after(self) -> int:
        """Seconds until the audio queued now is decoded, at the decoding rate measured so far
        (1 before the first batch)."""
        if self._rate is None:
            return 1
        return max(1, math.ceil(self._queued_audio / self._rate))

    def _room_retry_after(self) -> int:
        """Seconds until an upload being received could give way (give_way_s after its last 64 kB)."""
        now = asyncio.get_running_loop().time()
        waits = [self.options.give_way_s - (now - s.progress) for s in self._slots if not s.reading]
        if not waits or not self.options.give_way_s:
            return max(1, math.ceil(self.options.read_timeout_s))
        return max(1, math.ceil(min(waits)))

    # -- receiving an upload --------------------------------------------------------------------

    async def _receive(self, request: Any, slot: _Slot) -> None:
        """The upload, into `slot`: the "file" field of a multipart form, or the body. 400 when
        there is none, it is empty or the form is malformed; 413 past max_upload_mb (every field
        counts); 408 when it stalls; 415 when it does not begin as an audio container the server
        reads; 503 when the temporary disk is full."""
        from aiohttp.http_exceptions import HttpProcessingError

        deadline = asyncio.get_running_loop().time() + self.options.upload_timeout_s
        form = request.content_type.startswith("multipart/")
        try:
            if form:
                await self._receive_form(request, slot, deadline)
            else:
                slot.name = clean_name(request.query.get("name"))
                await self._save(request, slot, request.content.readany, deadline)
        except (ValueError, LookupError, AssertionError, RuntimeError, HttpProcessingError) as e:  # aiohttp's parsers
            kind = "multipart/form-data body" if form else "request body"
            raise UploadError(400, f"malformed {kind} ({one_line(e, 100)})") from None

    async def _receive_form(self, request: Any, slot: _Slot, deadline: float) -> None:
        """The first "file" field of a multipart form, read to its closing boundary: the other
        fields are dropped, their bytes counted against the limit; a nested multipart is refused."""
        from aiohttp import BodyPartReader

        reader = await request.multipart()
        while (part := await self._timed(reader.next(), deadline, "upload")) is not None:
            if not isinstance(part, BodyPartReader):
                raise UploadError(400, "a nested multipart part: send the audio in a form field named 'file'")
            if part.name == "file" and slot.path is None:
                slot.name = clean_name(part.filename)
                await self._save(request, slot, lambda: part.read_chunk(CHUNK), deadline)
                continue
            while await self._timed(part.read_chunk(CHUNK), deadline, slot.name):
                self._check_body(request, slot.name)
        if slot.path is None:
            raise UploadError(400, "no audio: send the file in a form field named 'file', or as the body")

    async def _save(self, request: Any, slot: _Slot, read: Callable[[], Any], deadline: float) -> None:
        """Stream an upload into a temporary file, named by the container its first bytes show."""
        head, name = b"", slot.name
        while len(head) < SNIFF_BYTES and (chunk := await self._timed(read(), deadline, name)):
            head += chunk
            self._check_body(request, name, len(head))
        if not head:
            raise UploadError(400, f"{name}: empty upload (0 bytes)")
        suffix = sniff_audio(head)
        if suffix is None:
            raise UploadError(415, f"{name}: not an audio file, or not one this server reads ({KNOWN_CONTAINERS})")
        fd, tmp = tempfile.mkstemp(suffix=suffix, dir=self._uploads.name)
        slot.path = Path(tmp)  # removed by _discard, whatever happens
        with os.fdopen(fd, "wb") as f:
            self._hold(slot, head, f)
            while chunk := await self._timed(read(), deadline, name):
                self._check_body(request, name, slot.held + len(chunk))
                self._hold(slot, chunk, f)

    def _hold(self, slot: _Slot, chunk: bytes, f: Any) -> None:
        if self._held() + len(chunk) > self.options.max_temp_bytes and not self._make_room(0, len(chunk), slot):
            raise self._disk_full()
        f.write(chunk)
        slot.held += len(chunk)
        slot.touch(asyncio.get_running_loop().time())

    def _discard(self, slot: _Slot) -> None:
        if slot.path is not None:
            slot.path.unlink(missing_ok=True)
        slot.held = 0

    def _check_body(self, request: Any, name: str, size: int = 0) -> None:
        """413 once the upload, or the whole body (every form field), is past the limit."""
        limit = self.options.max_bytes
        if size > limit or request.content.total_bytes > limit + FORM_SLACK:
            raise UploadError(413, f"{name}: larger than {self.options.max_upload_mb:g} MB, the most this server "
                              "takes (every field of the form counts)")

    async def _timed(self, awaitable: Any, deadline: float, name: str) -> Any:
        """`awaitable`'s result; 408 when it takes read_timeout_s, or passes the upload's deadline."""
        loop = asyncio.get_running_loop()
        try:
            return await asyncio.wait_for(awaitable, max(0.0, min(self.options.read_timeout_s, deadline - loop.time())))
        except asyncio.TimeoutError:
            if loop.time() >= deadline:
                raise UploadError(408, f"{name}: not received within {self.options.upload_timeout_s:g} s") from None
            raise UploadError(408, f"{name}: the upload stalled (nothing for {self.options.read_timeout_s:g} s)") \
                from None

    def _read(self, slot: _Slot) -> torch.Tensor:
        """The upload's 16 kHz waveform; 415 when it is not audio we can read, 413 when too long."""
        name = slot.name
        try:
            seconds = audio_info(slot.path).duration
            if seconds > self.options.max_seconds:
                raise UploadError(413, f"{name}: {seconds:.1f} s of audio; this server takes at most "
                                  f"{self.options.max_seconds:g} s")
            blocks = list(iter_blocks(slot.path))
        except AudioError as e:
            raise UploadError(415, f"{name}: {one_line(e.reason)}") from None
        except (TypeError, ValueError, RuntimeError, OSError, EOFError) as e:  # soundfile's own, past audio.py's
            raise UploadError(415, f"{name}: cannot be read as audio ({one_line(e, 100)})") from None
        return torch.cat(blocks) if blocks else torch.zeros(0)

    # -- the decoding worker ------------------------------------------------------------------

    async def _worker(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            jobs = [await self.queue.get()]
            deadline = loop.time() + self.options.batch_wait_ms / 1000
            while len(jobs) < self.options.batch_size:
                try:
                    jobs.append(await asyncio.wait_for(self.queue.get(), max(0.0, deadline - loop.time())))
                except asyncio.TimeoutError:
                    break
            left = [job for job in jobs if job.future.done() or job.gone()]  # clients that left: not decoded
            jobs = [job for job in jobs if not (job.future.done() or job.gone())]
            self.stats["skipped"] += len(left)
            self._queued_audio -= sum(job.seconds for job in left)
            if jobs:
                await self._decode_batch(jobs)

    async def _decode_batch(self, jobs: list[_Job]) -> None:
        start = time.perf_counter()
        try:
            results = await asyncio.get_running_loop().run_in_executor(self._decoder, self._decode,
                                                                       [job.wave for job in jobs])
        except Exception as e:  # a decoding error is the server's: every request of the batch is told
            log.exception("decoding failed")
            for job in jobs:
                if not job.future.done():
                    job.future.set_exception(UploadError(500, f"{job.name}: decoding failed ({one_line(e)})"))
            return
        finally:
            self._queued_audio = max(0.0, self._queued_audio - sum(job.seconds for job in jobs))
        rate = sum(job.seconds for job in jobs) / max(time.perf_counter() - start, 1e-3)
        self._rate = rate if self._rate is None else 0.7 * self._rate + 0.3 * rate
        self.stats["requests"] += len(jobs)
        self.stats["batches"] += 1
        self.stats["largest_batch"] = max(self.stats["largest_batch"], len(jobs))
        for job, result in zip(jobs, results):
            if not job.future.done():
                job.future.set_result(result)

    def _decode(self, waves: list[torch.Tensor]) -> list[Result]:
        with torch.inference_mode():
            return self.recognizer.transcribe([(w, SAMPLE_RATE) for w in waves], batch_size=self.options.batch_size,
                                              word_timestamps=self.options.word_timestamps)


def _gone(request: Any) -> bool:
    """Whether the client of `request` has closed its connection."""
    transport = request.transport
    return transport is None or transport.is_closing()


def _check_present(request: Any) -> None:
    if _gone(request):
        raise ConnectionResetError("the client left")


def run(recognizer: Recognizer, host: str = "127.0.0.1", port: int = 8000, options: ServeOptions | None = None,
        *, announce: Any = print) -> None:
    """Serve until interrupted (Ctrl-C) or told to stop (SIGTERM: the requests being decoded are
    answered and the uploads' folder removed, then it returns). `port` 0 picks a free one;
    `announce` is told the address once the socket is bound ("serving on http://HOST:PORT").
    The soft limit on open files is raised to the hard one, and the connection cap set below it."""
    from aiohttp import web
    from aiohttp.multipart import BadContentDispositionHeader, BadContentDispositionParam

    options = options or ServeOptions()
    for category in (BadContentDispositionHeader, BadContentDispositionParam):  # a client's text on stderr
        warnings.filterwarnings("ignore", category=category)
    fd_limit = raise_fd_limit()
    cap = connection_cap(options.max_connections, fd_limit)
    if cap < options.max_connections:
        log.info("asr serve: at most %d open connections (%d files may be open)", cap, fd_limit)
        options = dataclasses.replace(options, max_connections=cap)

    async def serve() -> None:
        server = Server(recognizer, options, host)
        runner = web.AppRunner(server.app(), **server.runner_settings())
        await runner.setup()
        listener = await server.listen(runner.server, host, port)
        stop = asyncio.Event()
        with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):  # not the main thread, Windows
            asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
        bound = listener.sockets[0].getsockname()[:2]
        announce(f"serving on http://{_url_host(bound[0])}:{bound[1]}")
        try:
            await stop.wait()
        finally:
            listener.close()
            await runner.cleanup()

    asyncio.run(serve())


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host
