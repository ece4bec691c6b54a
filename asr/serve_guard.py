"""What `asr serve` lets in, apart from the server's own queue and limits (asr.serve): a client's
file name and container made safe to show and to read, the Host and Origin checks of every request
(DNS rebinding, cross-site pages), and the open connections under a cap below the file-descriptor
limit. Every refusal is an UploadError: an HTTP status and one line."""
from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import unicodedata
from typing import Any

LOOPBACK = ("localhost", "127.0.0.1", "::1")
WILDCARD = ("", "0.0.0.0", "::")
BACKLOG = 128  # connections the kernel queues before they are accepted
NAME_CHARS = 100  # the longest upload name shown in a message or a log line
GRACE_S = 1.0  # a connection is not closed to make room for another in its first second (Connections)


class UploadError(Exception):
    """A request the server refuses: its HTTP status and one line saying why."""

    def __init__(self, status: int, message: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.headers = status, headers or {}


# ---------------------------------------------------------------------------------------------
# what a client sends, made safe: names, containers


def clean_name(raw: str | None) -> str:
    """A client's file name as the server shows it, in messages and log lines: its last path
    component, without control or format characters (newlines, NUL, bidi overrides) or lone
    surrogates, at most NAME_CHARS characters; "upload" when nothing is left. The server never
    opens or creates a file by this name."""
    if not raw:
        return "upload"
    text = one_line(raw.replace("\\", "/").rsplit("/", 1)[-1], limit=len(raw))
    if len(text) > NAME_CHARS:
        text = text[: NAME_CHARS - 21] + "…" + text[-20:]
    return text or "upload"


def one_line(text: Any, limit: int = 160) -> str:
    """Any text (an exception's, a header's) as one printable line of at most `limit` characters:
    bytes that were not UTF-8 as U+FFFD, control and format characters as spaces, runs of spaces
    as one."""
    text = str(text)
    try:  # undecodable bytes, as Python keeps them (surrogateescape)
        text = text.encode("utf-8", "surrogateescape").decode("utf-8", "replace")
    except UnicodeEncodeError:  # other lone surrogates
        text = text.encode("utf-8", "replace").decode("utf-8")
    text = " ".join("".join(" " if unicodedata.category(c).startswith("C") else c for c in text).split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


def sniff_audio(head: bytes) -> str | None:
    """The suffix of the audio container whose file begins with `head` (at least 16 bytes of it,
    unless the file is shorter): ".wav" (RIFF/RIFX/RF64 WAVE), ".w64", ".flac", ".ogg" (Vorbis,
    Opus, FLAC in Ogg), ".mp3" (an ID3 tag or an MPEG audio frame), ".aiff", ".au", ".caf",
    ".nist", ".voc"; None for anything else. libsndfile reads all of these by their content."""
    if head[:4] in (b"RIFF", b"RIFX", b"RF64", b"BW64") and head[8:12] == b"WAVE":
        return ".wav"
    if head[:16] == b"riff\x2e\x91\xcf\x11\xa5\xd6\x28\xdb\x04\xc1\x00\x00":
        return ".w64"
    if head[:4] == b"fLaC":
        return ".flac"
    if head[:4] == b"OggS":
        return ".ogg"
    if head[:3] == b"ID3" or (len(head) >= 2 and head[0] == 0xFF and head[1] & 0xE0 == 0xE0 and head[1] & 0x06):
        return ".mp3"  # an MPEG frame: 11 sync bits and a layer (0 would be AAC's ADTS)
    if head[:4] == b"FORM" and head[8:12] in (b"AIFF", b"AIFC"):
        return ".aiff"
    if head[:4] in (b".snd", b"dns."):
        return ".au"
    if head[:4] == b"caff":
        return ".caf"
    if head[:7] == b"NIST_1A":
        return ".nist"
    if head[:16] == b"Creative Voice F":
        return ".voc"
    return None


SNIFF_BYTES = 16
KNOWN_CONTAINERS = "WAV, W64, FLAC, OGG, MP3, AIFF, AU, CAF, NIST, VOC"


# ---------------------------------------------------------------------------------------------
# who may call: the Host and the Origin


class Gate:
    """The Host and Origin checks of every request (asr.serve's docstring says what they let in)."""

    def __init__(self, bound_host: str, allowed_hosts: tuple[str, ...], allow_origins: tuple[str, ...]) -> None:
        """allowed_hosts and allow_origins: ServeOptions'."""
        self.any_host = "*" in allowed_hosts
        self.hosts = {*LOOPBACK, *allowed_hosts}
        self.wildcard = bound_host.strip("[]") in WILDCARD
        if not self.wildcard:
            self.hosts.add(bound_host.strip("[]").lower())
        self.any_origin = "*" in allow_origins
        self.origins = set(allow_origins)

    def check(self, request: Any) -> str | None:
        """None, or the origin of another site this server lets call it (for the CORS header).
        Raises UploadError 421 for a Host that names another server, 403 for another site's page."""
        host = request.headers.get("Host")
        if host is not None and not self._host_allowed(host):
            raise UploadError(421, f"this server does not answer to the host {one_line(host, 80)!r} (start it with "
                              "--allowed-host NAME to answer to NAME)")
        origin = request.headers.get("Origin")
        if origin is not None:
            origin = origin.strip().lower().rstrip("/")
            if host is not None and origin.split("://", 1)[-1] == host.strip().lower():
                return None  # the same origin: the server's own page
            if self.any_origin or origin in self.origins:
                return origin
            raise UploadError(403, f"a request from the web page of {one_line(origin, 80)!r}, another site, is "
                              "refused (start the server with --allow-origin ORIGIN to allow one)")
        site = request.headers.get("Sec-Fetch-Site", "").lower()
        navigation = request.method == "GET" and request.headers.get("Sec-Fetch-Mode", "").lower() == "navigate"
        if site in ("cross-site", "same-site") and not navigation and not self.any_origin:
            raise UploadError(403, f"a {site} request from another site's page is refused (start the server with "
                              "--allow-origin ORIGIN to allow one)")
        return None

    def _host_allowed(self, header: str) -> bool:
        value = header.strip().lower()
        if value.startswith("["):  # [v6]:port
            name = value[1:value.find("]")] if "]" in value else value
        else:
            name = value.rsplit(":", 1)[0] if value.count(":") == 1 else value
        name = name.rstrip(".")
        if self.any_host or name in self.hosts or name.endswith(".localhost"):
            return True
        if self.wildcard:  # any address of this machine; DNS rebinding needs a name
            with contextlib.suppress(ValueError):
                ipaddress.ip_address(name)
                return True
        return False


# ---------------------------------------------------------------------------------------------
# open connections under a cap


class Connections:
    """The protocol factory of the listening socket: aiohttp's (web.Server) with a cap on open
    connections. Past the cap, a new connection closes the oldest open one that is not inside a
    request (waiting for its first request or between keep-alive requests, or still sending its
    headers) and is past its grace time (GRACE_S, or half the idle timeout if shorter: time for a
    client to send its request, even in a flood of connections); when there is none, the new one
    is answered 503 and closed. `busy` holds the connections inside a request (Server's middleware
    keeps it)."""

    def __init__(self, cap: int, grace: float, settings: dict[str, Any]) -> None:
        self.cap, self.grace, self.settings = cap, grace, settings  # settings: of each connection's handler
        self.open: dict[Any, None] = {}  # the handlers of the open connections, oldest first
        self.busy: set[Any] = set()
        self.server: Any = None  # aiohttp's web.Server, once the runner is set up
        self.evicted = self.refused = 0
        self._handler = _handler_class()

    def __call__(self) -> asyncio.Protocol:
        now = asyncio.get_running_loop().time()
        if len(self.open) >= self.cap:
            victim = None
            for handler in self.open:  # oldest first
                if now - handler.asr_since < self.grace:
                    break  # this one and all after it are in their grace time: none is closed for another
                if handler not in self.busy:
                    victim = handler
                    break
            if victim is None:
                self.refused += 1
                return _Refusal()
            del self.open[victim]
            victim.evict()
            self.evicted += 1
        handler = self._handler(self, self.server, loop=asyncio.get_running_loop(), **self.settings)
        handler.asr_since = now
        self.open[handler] = None
        return handler


def _handler_class() -> type:
    from aiohttp import web

    class _Handler(web.RequestHandler):
        """aiohttp's handler of one connection, which leaves `connections.open` when the connection
        closes, and whose answers to requests it cannot parse (a bad request line or header) are
        one-line JSON errors like the server's own."""

        def __init__(self, connections: Connections, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.asr_connections, self.asr_evicted, self.asr_since = connections, False, 0.0

        def evict(self) -> None:
            """Close the connection, now or (accepted in the same round, not connected yet) when it connects."""
            if self.transport is not None:
                self.force_close()
            self.asr_evicted = True

        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            super().connection_made(transport)
            if self.asr_evicted:
                self.force_close()

        def connection_lost(self, exc: BaseException | None) -> None:
            self.asr_connections.open.pop(self, None)
            super().connection_lost(exc)

        def handle_error(self, request: Any, status: int = 500, exc: BaseException | None = None,
                         message: str | None = None) -> Any:
            if status >= 500:
                return super().handle_error(request, status, exc, message)
            self.logger.debug("bad request from %s: %s", request.remote, exc)
            if request.writer.output_size > 0:
                raise ConnectionError("the answer has begun: no error can be sent")
            reason = getattr(exc, "message", None) or message or exc or "bad request"
            response = error_response(status, f"malformed HTTP request ({one_line(reason, 100)})")
            response.force_close()
            return response

    return _Handler


class _Refusal(asyncio.Protocol):
    """A connection past the cap when no open one may be closed for it (each is inside a request or
    in its grace time): one 503, then closed."""

    BODY = b'{"error": "busy: too many open connections; retry in 1 s"}\n'

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        transport.write(b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json; charset=utf-8\r\n"
                        b"Retry-After: 1\r\nConnection: close\r\nContent-Length: %d\r\n\r\n%s"
                        % (len(self.BODY), self.BODY))
        transport.close()


def raise_fd_limit() -> int:
    """Raise the soft limit on open files to the hard one; returns the soft limit now (a large
    number where there is none, e.g. Windows)."""
    try:
        import resource
    except ImportError:
        return 1 << 20
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or hard > soft:
        target = 1 << 20 if hard == resource.RLIM_INFINITY else hard
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
    return soft if soft != resource.RLIM_INFINITY else 1 << 20


def connection_cap(wanted: int, fd_limit: int) -> int:
    """Open connections allowed under `fd_limit` file descriptors: one each, and a reserve for
    the connections being accepted (BACKLOG), the temporary files, the model's files and threads."""
    reserve = min(2 * BACKLOG, fd_limit // 4)
    return max(1, min(wanted, fd_limit - reserve))


# ---------------------------------------------------------------------------------------------
# refusals as the server answers them


def error_response(status: int, message: str, headers: dict[str, str] | None = None) -> Any:
    """{"error": message} as JSON with `status` (every refusal of the server and of its connections)."""
    from aiohttp import web

    return web.json_response({"error": message}, status=status, headers=headers, dumps=dumps)


def dumps(obj: Any) -> str:
    import json

    return json.dumps(obj, ensure_ascii=False)
