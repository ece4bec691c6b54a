"""`asr serve`: an HTTP API and a web page that transcribe uploads with one Recognizer.

    POST /api/transcribe   multipart/form-data with the audio in a field "file" (or the audio as
                           the whole body); any format `asr transcribe` reads. 200 with
                           {"name", "text", "duration", "segments": [{"start", "end", "text",
                           "words"}], "words": [{"word", "start", "end", "confidence"}]}; 400 for
                           an empty or missing upload, 413 for one too big or too long, 415 for
                           audio that cannot be read, 503 with Retry-After when the queue is full.
                           Every error is {"error": "<one line naming the upload>"}.
    GET  /api/health       {"status": "ok", "queued", "requests", "batches", "largest_batch", limits}
    GET  /                 the web page (asr/web/): upload a file or record the microphone, see the
                           words with their times, click one to play the audio from there.

Built on aiohttp: one asyncio loop reads uploads and answers while a single worker thread decodes.
Requests that arrive together are decoded together: the worker takes what is waiting (up to
`batch_size` requests, after waiting `batch_wait_ms` for more) and runs one
`Recognizer.transcribe` over all of them, whose segments share the batched search. Uploads are read
and checked before they queue, so a bad file never reaches the model and the queue holds only
waveforms (at most queue_size x max_seconds of 16 kHz float32). The server sets no thread count:
`asr serve` decides it once, at start-up, as the other decoding commands do
(asr.decoding.thread_policy), and the Recognizer's tasks apply it.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import signal
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from asr.api import Recognizer, Result
from asr.audio import SAMPLE_RATE, AudioError, audio_info, iter_blocks
from asr.formats import result_dict

__all__ = ["ServeOptions", "Server", "UploadError", "run"]

log = logging.getLogger(__name__)
WEB = Path(__file__).resolve().parent / "web"
PAGES = {"/": ("index.html", "text/html"), "/recorder.js": ("recorder.js", "text/javascript")}


@dataclass(frozen=True)
class ServeOptions:
    """Limits and batching of the server."""

    max_upload_mb: float = 50.0  # bytes of one upload
    max_seconds: float = 600.0  # seconds of audio in one upload
    queue_size: int = 16  # uploads read and waiting for the model; one more is answered 503
    batch_size: int = 8  # uploads decoded together
    batch_wait_ms: float = 10.0  # after the first upload, how long the worker waits for others
    word_timestamps: bool = True

    def __post_init__(self) -> None:
        if not (self.max_upload_mb > 0 and self.max_seconds > 0):
            raise ValueError("serve: the upload limits must be positive")
        if self.queue_size < 1 or self.batch_size < 1 or self.batch_wait_ms < 0:
            raise ValueError("serve: queue_size and batch_size must be at least 1, batch_wait_ms at least 0")

    @property
    def max_bytes(self) -> int:
        return int(self.max_upload_mb * 1024 * 1024)


class UploadError(Exception):
    """A request the server refuses: its HTTP status and one line saying why."""

    def __init__(self, status: int, message: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.headers = status, headers or {}


@dataclass
class _Job:
    name: str
    wave: torch.Tensor  # (T,) 16 kHz
    future: asyncio.Future


class Server:
    """The aiohttp application around a Recognizer (`app()`), its queue and its decoding worker."""

    def __init__(self, recognizer: Recognizer, options: ServeOptions | None = None) -> None:
        self.recognizer, self.options = recognizer, options or ServeOptions()
        self.queue: asyncio.Queue[_Job] | None = None  # made in the loop that serves
        self.stats = {"requests": 0, "batches": 0, "largest_batch": 0}
        self._seconds_per_request = 1.0  # running estimate, for Retry-After
        self._decoder = ThreadPoolExecutor(1, thread_name_prefix="asr-decode")  # the model's one thread
        self._uploads = tempfile.TemporaryDirectory(prefix="asr-serve-")
        self._pages = {route: (WEB / name).read_bytes() for route, (name, _) in PAGES.items()}  # read once

    def app(self) -> Any:
        from aiohttp import web

        app = web.Application(client_max_size=self.options.max_bytes + 1024 * 1024,
                              middlewares=[_json_errors_middleware()])
        app.router.add_post("/api/transcribe", self.handle_transcribe)
        app.router.add_get("/api/health", self.handle_health)
        for route in PAGES:
            app.router.add_get(route, self.handle_page)
        app.on_startup.append(self._start)
        app.on_cleanup.append(self._stop)
        return app

    async def _start(self, app: Any) -> None:
        self.queue = asyncio.Queue(self.options.queue_size)
        app["asr.worker"] = asyncio.create_task(self._worker())

    async def _stop(self, app: Any) -> None:
        app["asr.worker"].cancel()
        self._decoder.shutdown(wait=True)
        self._uploads.cleanup()

    # -- handlers -------------------------------------------------------------------------------

    async def handle_page(self, request: Any) -> Any:
        from aiohttp import web

        return web.Response(body=self._pages[request.path], content_type=PAGES[request.path][1], charset="utf-8",
                            headers={"Cache-Control": "no-cache"})

    async def handle_health(self, request: Any) -> Any:
        from aiohttp import web

        queued = self.queue.qsize() if self.queue is not None else 0
        return web.json_response({"status": "ok", "queued": queued, **self.stats, "limits": asdict(self.options)})

    async def handle_transcribe(self, request: Any) -> Any:
        from aiohttp import web

        try:
            self._check_room()
            name, path = await self._receive(request)
            try:
                wave = await asyncio.get_running_loop().run_in_executor(None, self._read, name, path)
            finally:
                path.unlink(missing_ok=True)
            self._check_room()
            job = _Job(name, wave, asyncio.get_running_loop().create_future())
            self.queue.put_nowait(job)
            result: Result = await job.future
        except UploadError as e:
            log.info("refused %s: %s", request.remote, e)
            return web.json_response({"error": str(e)}, status=e.status, headers=e.headers)
        if result.error is not None:
            return web.json_response({"error": f"{name}: {result.error}"}, status=415)
        body = result_dict(result)
        del body["path"], body["error"]
        body.update(name=name, words=[w for s in body["segments"] for w in s.get("words", [])])
        return web.json_response(body, dumps=_dumps)

    def _check_room(self) -> None:
        """503 with Retry-After (the seconds the waiting uploads should take) when the queue is full."""
        if self.queue is not None and self.queue.full():
            wait = math.ceil(self.queue.qsize() * self._seconds_per_request)
            raise UploadError(503, f"busy: {self.queue.qsize()} uploads are waiting; retry in {wait} s",
                              {"Retry-After": str(max(1, wait))})

    async def _receive(self, request: Any) -> tuple[str, Path]:
        """The upload's name and a file holding its bytes (the "file" field of a multipart form, or
        the body); 400 when there is none or it is empty, 413 past max_upload_mb."""
        limit = self.options.max_bytes
        if request.content_length is not None and request.content_length > limit + 64 * 1024:
            raise UploadError(413, f"upload of {request.content_length / 2**20:.1f} MB: this server takes at most "
                              f"{self.options.max_upload_mb:g} MB")
        if request.content_type.startswith("multipart/"):
            reader = await request.multipart()
            while (part := await reader.next()) is not None:
                if part.name == "file":
                    return await self._save(part.filename or "upload", part.read_chunk)
            raise UploadError(400, "no audio: send the file in a form field named 'file', or as the body")
        return await self._save(request.query.get("name", "upload"), request.content.readany)

    async def _save(self, name: str, read: Any) -> tuple[str, Path]:
        name = os.path.basename(name)[:200] or "upload"
        fd, tmp = tempfile.mkstemp(suffix=Path(name).suffix[:16], dir=self._uploads.name)
        size = 0
        try:
            with os.fdopen(fd, "wb") as f:
                while chunk := await read():
                    size += len(chunk)
                    if size > self.options.max_bytes:
                        raise UploadError(413, f"{name}: larger than {self.options.max_upload_mb:g} MB, the most "
                                          "this server takes")
                    f.write(chunk)
            if size == 0:
                raise UploadError(400, f"{name}: empty upload (0 bytes)")
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        return name, Path(tmp)

    def _read(self, name: str, path: Path) -> torch.Tensor:
        """The upload's 16 kHz waveform; 415 when it is not audio we can read, 413 when too long."""
        try:
            seconds = audio_info(path).duration
            if seconds > self.options.max_seconds:
                raise UploadError(413, f"{name}: {seconds:.1f} s of audio; this server takes at most "
                                  f"{self.options.max_seconds:g} s")
            blocks = list(iter_blocks(path))
        except AudioError as e:
            raise UploadError(415, f"{name}: {e.reason}") from None
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
                except TimeoutError:
                    break
            jobs = [job for job in jobs if not job.future.done()]  # a client that left
            if not jobs:
                continue
            start = time.perf_counter()
            try:
                results = await loop.run_in_executor(self._decoder, self._decode, [job.wave for job in jobs])
            except Exception as e:  # a decoding error is the server's: every request of the batch is told
                log.exception("decoding failed")
                for job in jobs:
                    if not job.future.done():
                        job.future.set_exception(UploadError(500, f"{job.name}: decoding failed ({e})"))
                continue
            spent = time.perf_counter() - start
            self._seconds_per_request = 0.8 * self._seconds_per_request + 0.2 * spent / len(jobs)
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


def _json_errors_middleware() -> Any:
    from aiohttp import web

    @web.middleware
    async def json_errors(request: Any, handler: Any) -> Any:
        """aiohttp's own refusals (404, 405, a body past client_max_size) as JSON errors too."""
        try:
            return await handler(request)
        except web.HTTPException as e:
            if e.status < 400:
                raise
            return web.json_response({"error": f"{request.method} {request.path}: {e.reason}"}, status=e.status)

    return json_errors


def _dumps(obj: Any) -> str:
    import json

    return json.dumps(obj, ensure_ascii=False)


def run(recognizer: Recognizer, host: str = "127.0.0.1", port: int = 8000, options: ServeOptions | None = None,
        *, announce: Any = print) -> None:
    """Serve until interrupted (Ctrl-C) or told to stop (SIGTERM: the requests being decoded are
    answered and the uploads' folder removed, then it returns). `port` 0 picks a free one;
    `announce` is told the address once the socket is bound ("serving on http://HOST:PORT")."""
    from aiohttp import web

    async def serve() -> None:
        runner = web.AppRunner(Server(recognizer, options).app(), access_log=log)
        await runner.setup()
        site = web.TCPSite(runner, host, port)
        await site.start()
        stop = asyncio.Event()
        with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):  # not the main thread, Windows
            asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
        bound = runner.addresses[0][:2]
        announce(f"serving on http://{_url_host(bound[0])}:{bound[1]}")
        try:
            await stop.wait()
        finally:
            await runner.cleanup()

    asyncio.run(serve())


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host
