"""`asr serve`'s WebSocket (GET /stream, asr.serve_stream): partial then final results over the
protocol, the Host and Origin checks, bad messages, limits (receive timeout, duration, busy), a
model that cannot stream, streams sharing a batched step; tools/stream_client.py and
tools/serve_load.py --streams; the page's "Live" button in headless Chromium with a fake
microphone (slow). The model is spoken_model's four sentences learned by a streaming model
(causal convolutions, dynamic chunks), saved as a model file."""
from __future__ import annotations

import asyncio
import contextlib
import difflib
import functools
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
import torch

pytest.importorskip("aiohttp")
import test_serve
from test_serve import Served, open_page

chromium = test_serve.chromium  # the fixture: Debian's chromium and chromedriver

ROOT = Path(__file__).resolve().parents[1]
RATE = 16000


class StreamModel:
    """The streaming spoken model's file, its FLAC files and their sentences, and a model file
    of the same weights whose convolutions see the future (it cannot stream)."""

    def __init__(self, model: Path, audio: list[Path], texts: list[str], still: Path) -> None:
        self.model, self.audio, self.texts, self.still = model, audio, texts, still

    def samples(self, index: int, silence: float = 0.0) -> np.ndarray:
        """File `index`'s 16 kHz int16 samples, with `silence` seconds more of its own last 0.1 s
        (its noise floor: digital zeros are nothing the model has heard) after them."""
        samples, rate = sf.read(self.audio[index], dtype="int16")
        assert rate == RATE
        tail = np.resize(samples[-RATE // 10:], int(silence * RATE))
        return np.concatenate([samples, tail])

    def pcm(self, index: int, silence: float = 0.0) -> bytes:
        """`samples` as little-endian bytes."""
        return self.samples(index, silence).astype("<i2").tobytes()


@pytest.fixture(scope="session")
def stream_model(tmp_path_factory) -> StreamModel:
    """tests/spoken_model.py's sentences learned by a transformer with causal convolutions of
    kernel 3 and dynamic chunk training (~20 s on one busy core)."""
    pytest.importorskip("espeakng_loader")
    import spoken_model

    from asr.model import ModelConfig

    folder = tmp_path_factory.mktemp("stream_spoken")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(spoken_model, "ModelConfig", functools.partial(ModelConfig, conv_kernel=3, causal_conv=True,
                                                                     dynamic_chunk=True, max_chunk=16))
        made = spoken_model.train_spoken_model(folder)
    obj = torch.load(made.model, weights_only=True)
    obj["model"]["causal_conv"] = False
    torch.save(obj, folder / "still.pt")
    return StreamModel(made.model, made.audio, made.texts, folder / "still.pt")


@pytest.fixture(scope="module")
def served(stream_model, tmp_path_factory):
    """`asr serve` of the streaming model, with another site allowed."""
    server = Served(stream_model.model, "--allow-origin", "http://app.example",
                    log=tmp_path_factory.mktemp("serve_stream") / "serve.log")
    yield server
    assert server.stop() == 0


class InProcess:
    """asr.serve.Server on a loopback port, in this process (its event loop in a thread), with
    any ServeOptions: what `asr serve` has no flag for, and what a test patches in."""

    def __init__(self, model: Path, **options) -> None:
        from asr.api import load_model
        from asr.serve import ServeOptions, Server

        self.server = Server(load_model(model), ServeOptions(**options))
        self.loop = asyncio.new_event_loop()
        started = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(started,), daemon=True)
        self.thread.start()
        assert started.wait(30)
        self.url = f"http://127.0.0.1:{self.port}"

    def _run(self, started: threading.Event) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_until_complete(self._start())
        started.set()
        self.loop.run_forever()

    async def _start(self) -> None:
        from aiohttp import web

        self.runner = web.AppRunner(self.server.app(), **self.server.runner_settings())
        await self.runner.setup()
        self.listener = await self.server.listen(self.runner.server, "127.0.0.1", 0)
        self.port = self.listener.sockets[0].getsockname()[1]

    def health(self) -> dict:
        import urllib.request

        with urllib.request.urlopen(f"{self.url}/api/health", timeout=10) as response:
            return json.load(response)

    def stop(self) -> None:
        async def cleanup() -> None:
            self.listener.close()
            await self.runner.cleanup()

        asyncio.run_coroutine_threadsafe(cleanup(), self.loop).result(60)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture
def in_process(one_thread):
    """InProcess servers made by the test (InProcess(model, **options)), stopped after it."""
    made = []

    def make(model: Path, **options) -> InProcess:
        made.append(InProcess(model, **options))
        return made[-1]

    yield make
    for server in made:
        server.stop()


async def talk(url: str, pcm: bytes = b"", *, first: dict | str | None = None, end: bool = True,
               frame: int = 3200, pace: float = 0.0, headers: dict | None = None,
               timeout: float = 60.0) -> tuple[list[dict], int | None]:
    """Stream `pcm` to ws URL (http:// -> ws://, /stream): `first` (a JSON object, or raw text),
    frames of `frame` bytes (`pace` seconds apart), then {"end": true} when `end`; (the server's
    messages, the close code)."""
    import aiohttp

    url = "ws" + url[len("http"):] + "/stream"
    messages = []
    async with aiohttp.ClientSession() as session, session.ws_connect(url, headers=headers) as ws:
        with contextlib.suppress(ConnectionError):  # the server may close first (a refusal)
            if first is not None:
                await ws.send_str(first if isinstance(first, str) else json.dumps(first))
            for at in range(0, len(pcm), frame):
                if ws.closed:
                    break
                await ws.send_bytes(pcm[at:at + frame])
                if pace:
                    await asyncio.sleep(pace)
            if end and not ws.closed:
                await ws.send_str(json.dumps({"end": True}))
        while (message := await ws.receive(timeout=timeout)).type == aiohttp.WSMsgType.TEXT:
            messages.append(json.loads(message.data))
    return messages, ws.close_code


def finals(messages: list[dict]) -> str:
    return " ".join(m["text"] for m in messages if m["type"] == "final" and m["text"])


def test_websocket_streams_partial_then_final_results(served, stream_model):
    """Over `asr serve`'s /stream: partials while the audio comes, then finals (at the endpoint in
    the trailing silence, and at the end), "done", a normal close; the finals are the sentence.
    Every result says the audio it covers, the step's compute and the audio queued."""
    for index in (1, 5, 9):
        messages, code = asyncio.run(talk(served.url, stream_model.pcm(index, silence=1.5), first={"rate": 16000},
                                          pace=0.01))
        kinds = [m["type"] for m in messages]
        assert code == 1000 and kinds[-1] == "done" and kinds.count("done") == 1, messages
        assert "partial" in kinds and kinds.index("partial") < kinds.index("final"), kinds
        assert finals(messages) == stream_model.texts[index]
        results = messages[:-1]
        assert all(set(m) == {"type", "text", "start", "end", "compute", "queued"} for m in results)
        assert all(0 <= m["start"] <= m["end"] and m["compute"] > 0 and m["queued"] >= 0 for m in results)
        assert [m["end"] for m in results] == sorted(m["end"] for m in results)
        first_final = kinds.index("final")
        assert messages[first_final]["end"] < len(stream_model.pcm(index, silence=1.5)) / 2 / RATE - 0.5, \
            "the first final should come at the endpoint, inside the trailing silence"
    health = served.health()
    assert health["streaming"]["available"] and health["streaming"]["open"] == 0
    assert health["streaming"]["streams"] >= 3 and health["limits"]["max_streams"] == 16


def test_websocket_checks_the_host_and_origin(served, stream_model):
    """The upgrade passes the HTTP API's checks: another site's page (Origin) is refused with 403
    unless --allow-origin names it, a Host that does not name the server with 421; the server's
    own page (same origin) and a client without an Origin are served."""
    import aiohttp

    pcm = stream_model.pcm(0)
    for headers, status in (({"Origin": "http://evil.example"}, 403), ({"Origin": "null"}, 403),
                            ({"Host": "evil.example"}, 421), ({"Host": f"evil.example:{served.port}"}, 421)):
        with pytest.raises(aiohttp.WSServerHandshakeError) as refused:
            asyncio.run(talk(served.url, pcm, headers=headers))
        assert refused.value.status == status, headers
    for headers in ({"Origin": f"http://127.0.0.1:{served.port}"}, {"Origin": "http://app.example"}, {}):
        messages, code = asyncio.run(talk(served.url, pcm, headers=headers))
        assert code == 1000 and finals(messages) == stream_model.texts[0], headers


def test_websocket_answers_bad_messages_with_an_error_and_a_close_code(served, stream_model):
    """Each protocol mistake: one {"type": "error"} message naming it, then the close code that
    says why (1003: data the server does not take; 1009: a message over max_message_kb, closed
    by aiohttp); the server goes on serving, tiny messages and a stream without audio too."""
    pcm = stream_model.pcm(2)
    cases = {
        "odd bytes": (dict(pcm=b"\x00" * 3201), 1003, "16-bit"),
        "not JSON": (dict(first="hello", pcm=pcm), 1003, "JSON object"),
        "unknown key": (dict(first={"rate": 16000, "format": "f32"}, pcm=pcm), 1003, "'format'"),
        "another rate": (dict(first={"rate": 8000}, pcm=pcm), 1003, "16000 Hz"),
        "a bad chunk": (dict(first={"chunk_size": 0}, pcm=pcm), 1003, "chunk_size"),
    }
    for case, (kwargs, code, words) in cases.items():
        messages, got = asyncio.run(talk(served.url, **kwargs))
        assert got == code and messages[-1]["type"] == "error" and words in messages[-1]["error"], (case, messages)
        assert "\n" not in messages[-1]["error"]

    async def late_configuration():  # audio, then the first message's keys
        import aiohttp

        url = "ws" + served.url[len("http"):] + "/stream"
        async with aiohttp.ClientSession() as session, session.ws_connect(url) as ws:
            await ws.send_bytes(pcm[:3200])
            await ws.send_str(json.dumps({"chunk_size": 8}))
            message = await ws.receive_json(timeout=30)
            await ws.receive(timeout=30)
            return message, ws.close_code

    message, code = asyncio.run(late_configuration())
    assert code == 1003 and "first message" in message["error"]
    messages, code = asyncio.run(talk(served.url, b"\x00" * (65 * 1024), frame=65 * 1024))  # > max_message_kb 64
    assert code in (1009, 1006) and not messages  # aiohttp's 1009, or the socket it dropped before the client
    # read that close frame (1006): closed either way, with no result
    messages, code = asyncio.run(talk(served.url, pcm, first={"rate": 16000, "chunk_size": 8}, frame=100))
    assert code == 1000 and finals(messages) == stream_model.texts[2]  # 50-sample messages: the same
    assert asyncio.run(talk(served.url)) == ([{"type": "done"}], 1000)  # {"end": true} alone


def test_websocket_limits_close_idle_long_and_surplus_streams(in_process, stream_model):
    """A stream that sends nothing for stream_receive_timeout_s (1 s here) is told so and closed
    (1008); one that sends more than max_stream_seconds (2 s) too, and one open longer than that
    and the receive timeout (3 s); past max_streams (1) a new stream is told busy (1013) while
    the first goes on."""
    server = in_process(stream_model.model, stream_receive_timeout_s=1.0, max_stream_seconds=2.0, max_streams=1)
    start = time.monotonic()
    messages, code = asyncio.run(talk(server.url, first={"rate": 16000}, end=False))
    assert code == 1008 and "nothing received for 1 s" in messages[-1]["error"] and time.monotonic() - start < 5
    messages, code = asyncio.run(talk(server.url, stream_model.pcm(3) * 2))
    assert code == 1008 and "more than 2 s of audio" in messages[-1]["error"], messages
    start = time.monotonic()  # 0.1 s of audio every 0.5 s: never idle, never 2 s of audio, but 3 s open
    messages, code = asyncio.run(talk(server.url, stream_model.pcm(3)[:25600], pace=0.5, end=False))
    assert code == 1008 and "open for more than 3 s" in messages[-1]["error"], messages
    assert time.monotonic() - start > 2.9

    async def two():
        first = asyncio.create_task(talk(server.url, stream_model.pcm(3)[:48000], pace=0.05))
        await asyncio.sleep(0.3)
        second = await talk(server.url, stream_model.pcm(3))
        return await first, second

    (messages, code), (busy, busy_code) = asyncio.run(two())
    assert busy_code == 1013 and "busy" in busy[-1]["error"], busy
    assert code == 1000 and messages[-1]["type"] == "done"
    assert server.health()["streaming"]["busy"] == 1


def test_websocket_of_a_model_that_cannot_stream(in_process, stream_model):
    """A model whose convolutions see the future: /api/health says streaming is not available and
    why (the page hides its Live button), and /stream answers that error and closes (1003)."""
    server = in_process(stream_model.still)
    streaming = server.health()["streaming"]
    assert streaming["available"] is False and "causal_conv" in streaming["reason"]
    messages, code = asyncio.run(talk(server.url, stream_model.pcm(0)))
    assert code == 1003 and messages == [{"type": "error", "error": streaming["reason"]}]


def test_websocket_of_an_exported_model_streams_its_own_chunks(in_process, stream_model, tmp_path):
    """An export made with --streaming --chunk-size 8 --left-chunks 2, served without chunk
    options: the streams take the export's chunks (/api/health says so) and give the PyTorch
    model's finals at those chunks; a client asking for another chunk_size is told why (1003)."""
    pytest.importorskip("onnxruntime")
    pytest.importorskip("onnxscript")
    from asr.export import export_model

    export_model(stream_model.model, tmp_path / "onnx", chunk_size=8, left_chunks=2)
    exported = in_process(tmp_path / "onnx")
    assert exported.health()["streaming"]["chunk_size"] == 8
    pytorch = in_process(stream_model.model, stream_chunk_size=8, stream_left_chunks=2)
    for index in (2, 6):
        messages, code = asyncio.run(talk(exported.url, stream_model.pcm(index, silence=1.0)))
        assert code == 1000 and finals(messages) == finals(asyncio.run(talk(pytorch.url, stream_model.pcm(
            index, silence=1.0)))[0]) == stream_model.texts[index]
    messages, code = asyncio.run(talk(exported.url, stream_model.pcm(2), first={"chunk_size": 4}))
    assert code == 1003 and "8" in messages[-1]["error"] and "not 4" in messages[-1]["error"], messages


def test_concurrent_streams_share_a_batched_step(in_process, stream_model, monkeypatch):
    """Two streams at once: their chunks are encoded in one advance (the batch sizes recorded by
    a wrapper around asr.streaming.advance, whose first call is held 0.5 s so that the second
    stream's audio is in by then); each gets the final text it gets alone."""
    from asr import streaming

    batches = []
    real = streaming.advance

    def recorded(streams):
        batches.append(len(streams))
        if len(batches) == 1:
            time.sleep(0.5)
        return real(streams)

    server = in_process(stream_model.model)
    alone = [asyncio.run(talk(server.url, stream_model.pcm(i)))[0] for i in (4, 7)]
    monkeypatch.setattr(streaming, "advance", recorded)

    async def together():
        return await asyncio.gather(talk(server.url, stream_model.pcm(4)), talk(server.url, stream_model.pcm(7)))

    both = asyncio.run(together())
    assert max(batches) == 2, batches
    assert [finals(messages) for messages, _ in both] == [finals(m) for m in alone] == \
        [stream_model.texts[4], stream_model.texts[7]]
    assert all(code == 1000 for _, code in both)
    assert server.health()["streaming"]["largest_step"] == 2


def test_stream_client_prints_partials_and_finals(served, stream_model):
    """tools/stream_client.py: the finals on stdout, the partials on stderr, status 0; 1 with the
    error for a server that refuses."""
    client = [sys.executable, str(ROOT / "tools" / "stream_client.py")]
    url = "ws" + served.url[len("http"):] + "/stream"
    done = subprocess.run([*client, "--url", url, str(stream_model.audio[6])], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout == stream_model.texts[6] + "\n"
    assert done.stderr.strip() and stream_model.texts[6].startswith(done.stderr.split("\n")[0].strip())
    refused = subprocess.run([*client, "--url", url, "--chunk-size", "100", str(stream_model.audio[6])],
                             capture_output=True, text=True, timeout=120)
    assert refused.returncode == 1 and "chunk_size" in refused.stderr and not refused.stdout


def test_load_tool_streams(served, stream_model, tmp_path):
    """tools/serve_load.py --streams against the module's server: 1 and 2 real-time streams for
    2 s each; a table, the most streams held in real time, the JSON."""
    out = tmp_path / "streams.json"
    done = subprocess.run([sys.executable, str(ROOT / "tools" / "serve_load.py"), "--url", served.url, "--audio",
                           *map(str, stream_model.audio[:2]), "--streams", "1,2", "--seconds", "2", "--json", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "| streams |" in done.stdout and "most streams held in real time:" in done.stdout
    runs = json.loads(out.read_text())["runs"]
    assert [run["streams"] for run in runs] == [1, 2]
    for run in runs:
        assert run["errors"] == 0 and run["sessions"] >= run["streams"] and run["chunk_ms"] == 640
        assert 0 < run["compute_p50_ms"] <= run["compute_p90_ms"] and run["queued_max_s"] >= run["queued_p90_s"] >= 0
        assert run["final_p50_ms"] > 0 and isinstance(run["real_time"], bool)


# ---------------------------------------------------------------------------------------------
# the page's Live button in a real browser


WATCH = """
window.liveLog = [];
new MutationObserver(() => {
  for (const span of document.querySelectorAll('#transcript .live')) {
    window.liveLog.push([span.className, getComputedStyle(span).color, span.textContent]);
  }
}).observe(document.getElementById('transcript'), {childList: true, subtree: true, characterData: true,
                                                   attributes: true});
"""


@pytest.mark.slow
def test_live_page_shows_partial_then_final_words(served, stream_model, chromium, tmp_path, in_process):
    """Chromium's fake microphone plays a sentence and 2 s of its noise floor; "Live" streams it
    through the AudioWorklet (44.1 or 48 kHz -> 16 kHz int16 frames) over the WebSocket: grey
    partial words appear, then black final ones (the endpoint in the silence); Stop ends the
    stream ("Done."). The words are the sentence's, near enough: this tiny model, which learned
    its twelve recordings by heart, writes a letter or two otherwise when the audio is shifted
    against its chunks by a fraction of one (as the browser's two resamplings and its start do).
    A server whose model cannot stream shows no Live button."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    index = 10
    samples, rate = sf.read(stream_model.audio[index], dtype="int16")
    sf.write(tmp_path / "speech.wav", stream_model.samples(index, silence=2.0), rate)
    browser = open_page(chromium, served.url, "--use-fake-ui-for-media-stream", "--use-fake-device-for-media-stream",
                        f"--use-file-for-fake-audio-capture={tmp_path / 'speech.wav'}%noloop")
    try:
        live = browser.find_element(By.ID, "live")
        WebDriverWait(browser, 10).until(lambda b: live.is_displayed())
        browser.execute_script(WATCH)
        live.click()
        WebDriverWait(browser, len(samples) / rate + 10).until(
            lambda b: b.find_elements(By.CSS_SELECTOR, "#transcript .live.final")
            or "error" in b.find_element(By.ID, "status").get_attribute("class"))
        assert live.text == "Stop", browser.find_element(By.ID, "status").text
        live.click()
        WebDriverWait(browser, 20).until(lambda b: b.find_element(By.ID, "live").text == "Live")
        status = browser.find_element(By.ID, "status")
        assert status.text == "Done." and "error" not in status.get_attribute("class"), status.text
        log = browser.execute_script("return window.liveLog")
        grey, black = "rgb(158, 158, 158)", "rgb(0, 0, 0)"
        partials = [i for i, (kind, color, text) in enumerate(log) if "partial" in kind and color == grey and text]
        final_at = [i for i, (kind, color, text) in enumerate(log) if "final" in kind and color == black and text]
        assert partials and final_at and partials[0] < final_at[0], log
        heard = " ".join(span.text for span in browser.find_elements(By.CSS_SELECTOR, "#transcript .live"))
        assert difflib.SequenceMatcher(None, heard, stream_model.texts[index]).ratio() > 0.7, heard
        assert all("final" in span.get_attribute("class")
                   for span in browser.find_elements(By.CSS_SELECTOR, "#transcript .live"))
    finally:
        browser.quit()
    still = in_process(stream_model.still)
    browser = open_page(chromium, still.url)
    try:
        WebDriverWait(browser, 10).until(lambda b: b.find_element(By.ID, "limits").text)
        assert not browser.find_element(By.ID, "live").is_displayed()
    finally:
        browser.quit()
