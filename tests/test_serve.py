"""`asr serve`: the HTTP API (uploads, bad files, batching, a full queue) against a real server
process, and the web page in a real browser (Debian's chromium and chromium-driver through
selenium; slow). The model is the spoken_model fixture: it writes its four sentences back."""
from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

pytest.importorskip("aiohttp")
ROOT = Path(__file__).resolve().parents[1]


class Served:
    """An `asr serve` process on a free loopback port."""

    def __init__(self, model: Path, *flags: str) -> None:
        self.process = subprocess.Popen([sys.executable, "-m", "asr.cli", "serve", "--model", str(model), "--port", "0",
                                         "--threads", "1", *flags], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                        text=True)
        line = self.process.stdout.readline()
        if not line.startswith("serving on "):
            self.process.kill()
            raise RuntimeError(f"asr serve did not start: {line!r}")
        self.url = line.split()[-1]

    def post(self, data: bytes, name: str = "audio.flac", field: str = "file") -> tuple[int, dict, dict]:
        """(status, JSON body, headers) of a multipart upload."""
        boundary = uuid.uuid4().hex
        body = (f"--{boundary}\r\nContent-Disposition: form-data; name=\"{field}\"; filename=\"{name}\"\r\n"
                f"Content-Type: application/octet-stream\r\n\r\n").encode() + data + f"\r\n--{boundary}--\r\n".encode()
        request = urllib.request.Request(f"{self.url}/api/transcribe", data=body, method="POST",
                                         headers={"Content-Type": f"multipart/form-data; boundary={boundary}"})
        try:
            with urllib.request.urlopen(request, timeout=60) as response:
                return response.status, json.load(response), dict(response.headers)
        except urllib.error.HTTPError as e:
            return e.code, json.load(e), dict(e.headers)

    def health(self) -> dict:
        with urllib.request.urlopen(f"{self.url}/api/health", timeout=10) as response:
            return json.load(response)

    def stop(self) -> int:
        """SIGTERM; the exit status (0: it stopped cleanly)."""
        self.process.terminate()
        return self.process.wait(timeout=10)


@pytest.fixture(scope="module")
def server(spoken_model):
    served = Served(spoken_model.model, "--max-upload-mb", "0.25", "--max-seconds", "6", "--batch-wait-ms", "300")
    yield served
    served.stop()


def test_serve_transcribes_an_upload(server, spoken_model):
    path = spoken_model.audio[4]
    status, body, _ = server.post(path.read_bytes(), path.name)
    cli = subprocess.run([sys.executable, "-m", "asr.cli", "transcribe", "--model", str(spoken_model.model), str(path)],
                         capture_output=True, text=True, check=True)
    assert status == 200, body
    assert server.url.startswith("http://127.0.0.1:")  # loopback unless --host says otherwise
    assert body["text"] == cli.stdout.strip() == spoken_model.texts[4]
    assert body["name"] == path.name and body["duration"] == pytest.approx(sf.info(path).duration, abs=1e-3)
    assert [w["word"] for w in body["words"]] == body["text"].split()
    assert all(0 <= w["start"] < w["end"] <= body["duration"] and 0 < w["confidence"] <= 1 for w in body["words"])
    assert body["segments"][0]["words"] == body["words"]


def test_serve_rejects_bad_files_and_keeps_serving(server, spoken_model, tmp_path):
    good = spoken_model.audio[0].read_bytes()
    sf.write(tmp_path / "wav.wav", sf.read(spoken_model.audio[0])[0], 16000)
    wav = (tmp_path / "wav.wav").read_bytes()
    sf.write(tmp_path / "long.wav", np.zeros(16000 * 7, np.int16), 16000)  # 7 s > --max-seconds 6
    cases = {
        "truncated.wav": (wav[: len(wav) // 2], 415, "truncated"),
        "empty.flac": (b"", 400, "empty"),
        "notes.txt": (b"these are not the sounds you are looking for\n" * 20, 415, "not an audio file"),
        "long.wav": ((tmp_path / "long.wav").read_bytes(), 413, "7.0 s of audio"),
        "big.flac": (good * 8, 413, "0.25 MB"),  # > --max-upload-mb 0.25
    }
    assert len(good) * 8 > 0.25 * 2**20 > len((tmp_path / "long.wav").read_bytes())
    for name, (data, code, words) in cases.items():
        status, body, _ = server.post(data, name)
        assert status == code and words in body["error"], (name, status, body)
        assert "\n" not in body["error"]
    status, body, _ = server.post(good, "other-field.flac", field="audio")
    assert status == 400 and "'file'" in body["error"]
    status, body, _ = server.post(good, "good.flac")
    assert status == 200 and body["text"] == spoken_model.texts[0]


def test_serve_batches_concurrent_requests(server, spoken_model):
    files = [p.read_bytes() for p in spoken_model.audio]
    alone = [server.post(data)[1]["text"] for data in files]
    assert alone == spoken_model.texts
    before = server.health()
    with ThreadPoolExecutor(len(files)) as pool:
        together = list(pool.map(lambda data: server.post(data), files))
    assert [status for status, _, _ in together] == [200] * len(files)
    assert [body["text"] for _, body, _ in together] == alone
    after = server.health()
    assert after["requests"] - before["requests"] == len(files)
    assert after["batches"] - before["batches"] < len(files) and after["largest_batch"] > 1


def test_serve_answers_busy_when_the_queue_is_full(spoken_model):
    served = Served(spoken_model.model, "--queue-size", "1", "--batch-size", "1", "--batch-wait-ms", "0")
    try:
        data = spoken_model.audio[1].read_bytes()
        with ThreadPoolExecutor(8) as pool:
            answers = list(pool.map(lambda _: served.post(data), range(8)))
        busy = [(body, headers) for status, body, headers in answers if status == 503]
        assert busy and all(int(headers["Retry-After"]) >= 1 and "busy" in body["error"] for body, headers in busy)
        assert all(body["text"] == spoken_model.texts[1] for status, body, _ in answers if status == 200)
        assert served.post(data)[0] == 200
    finally:
        assert served.stop() == 0


def test_load_tool_finds_no_errors(server, spoken_model, tmp_path):
    """tools/serve_load.py against the module's server: 2 clients for 2 s, good and bad files."""
    out = tmp_path / "load.json"
    done = subprocess.run([sys.executable, str(ROOT / "tools" / "serve_load.py"), "--url", server.url, "--audio",
                           *map(str, spoken_model.audio[:3]), "--clients", "2", "--seconds", "2", "--out", str(out)],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    run = json.loads(out.read_text())["runs"][0]
    assert run["good"] > 0 and run["bad"] > 0 and run["errors"] == 0 and "| clients |" in done.stdout
    refused = subprocess.run([sys.executable, str(ROOT / "tools" / "serve_load.py"), "--url", "http://10.1.2.3:8000",
                              "--audio", str(spoken_model.audio[0])], capture_output=True, text=True)
    assert refused.returncode != 0 and "not on this machine" in refused.stderr


# ---------------------------------------------------------------------------------------------
# the web page in a real browser


@pytest.fixture(scope="module")
def chromium():
    """Paths of Debian's chromium and chromedriver, installed by tools/install_browser.sh when
    they are missing and this is root with apt; skipped otherwise."""
    pytest.importorskip("selenium")
    browser, driver = Path("/usr/bin/chromium"), Path("/usr/bin/chromedriver")
    if not (browser.exists() and driver.exists()):
        done = subprocess.run(["bash", str(ROOT / "tools" / "install_browser.sh")], capture_output=True, text=True)
        if done.returncode:
            pytest.skip(f"no chromium and chromium-driver: {done.stderr.strip().splitlines()[-1]}")
    return browser, driver


def open_page(chromium, url: str, *flags: str):
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = str(chromium[0])
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                 "--autoplay-policy=no-user-gesture-required", *flags):
        options.add_argument(flag)
    browser = webdriver.Chrome(options=options, service=Service(executable_path=str(chromium[1])))
    browser.get(url)
    return browser


def shown_words(browser, timeout: float = 60.0) -> list[str]:
    """The words the page shows once it has a transcript (or fails with its status line)."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    WebDriverWait(browser, timeout).until(
        lambda b: b.find_elements(By.CSS_SELECTOR, "#transcript .word") or "error" in
        b.find_element(By.ID, "status").get_attribute("class"))
    assert "error" not in browser.find_element(By.ID, "status").get_attribute("class"), \
        browser.find_element(By.ID, "status").text
    return [span.text for span in browser.find_elements(By.CSS_SELECTOR, "#transcript .word")]


@pytest.mark.slow
def test_web_page_shows_the_transcript(server, spoken_model, chromium):
    from selenium.webdriver.common.by import By

    browser = open_page(chromium, server.url)
    try:
        browser.find_element(By.ID, "file").send_keys(str(spoken_model.audio[7]))
        assert " ".join(shown_words(browser)) == spoken_model.texts[7]
        word = browser.find_elements(By.CSS_SELECTOR, "#transcript .word")[2]
        word.click()  # plays the upload from that word's start
        time.sleep(0.3)
        position = browser.execute_script("return document.getElementById('player').currentTime")
        assert float(word.get_attribute("data-start")) <= position < float(word.get_attribute("data-start")) + 1.0
        assert "0.25 MB" in browser.find_element(By.ID, "limits").text  # what /api/health says
    finally:
        browser.quit()


@pytest.mark.slow
def test_web_page_records_from_the_microphone(server, spoken_model, chromium, tmp_path):
    """Chromium's fake microphone plays a WAV once; the page records it, uploads it as a WAV and
    shows what the model heard. The recording stops inside the WAV's trailing silence: what the
    fake device gives after the file's end differs between Chromium versions."""
    from selenium.webdriver.common.by import By

    samples, rate = sf.read(spoken_model.audio[10], dtype="int16")
    sf.write(tmp_path / "speech.wav", np.concatenate([samples, np.zeros(3 * rate, np.int16)]), rate)
    browser = open_page(chromium, server.url, "--use-fake-ui-for-media-stream", "--use-fake-device-for-media-stream",
                        f"--use-file-for-fake-audio-capture={tmp_path / 'speech.wav'}%noloop")
    try:
        record = browser.find_element(By.ID, "record")
        record.click()
        time.sleep(len(samples) / rate + 1.0)
        assert record.text == "Stop"
        record.click()
        assert " ".join(shown_words(browser)) == spoken_model.texts[10]
        assert browser.execute_script("return document.getElementById('player').duration") > len(samples) / rate
    finally:
        browser.quit()
