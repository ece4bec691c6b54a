"""Human speech in training (recipes/synth/local/human.py): Asterisk's prompts appended to a
corpus's training lines K times, with their transcripts normalized, the untrustworthy ones left out,
an unreadable recording skipped in one line, re-runs that replace; and the learning check's --human.
The fixture is a folder laid out as tools/asterisk.sh unpacks it, its G.722 files encoded here by
PyAV; the real prompts are fetched by the slow test."""
from __future__ import annotations

import gzip
import json
import sys
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

av = pytest.importorskip("av")

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "recipes" / "synth" / "local"))  # the recipe's helpers are scripts
sys.path.insert(0, str(ROOT / "tools"))

import flite  # noqa: E402
import human  # noqa: E402
import learning_check  # noqa: E402
from test_synth_flite import check_args, corpus, fake_flite  # noqa: E402

RATE = 16000
TRANSCRIPTS = """; Core Asterisk Sounds in English

hello-world: Hello world.
digits/5: 5
ascending-2tone: [ascending tones]
demo-echotest: Dial 600 to test.
conf-menu: Press * to mute yourself, or # to leave. It's 3D!
no-recording: This one was never recorded.
empty: Silence.
"""
KEPT = {"hello-world": "HELLO WORLD", "digits/5": "FIVE", "conf-menu": "PRESS STAR TO MUTE YOURSELF OR POUND TO "
        "LEAVE IT'S THREE D", "empty": "SILENCE"}


def write_g722(path: Path, seconds: float, hz: float) -> np.ndarray:
    """A tone encoded as raw G.722 at `path`; the int16 samples it was made from."""
    path.parent.mkdir(parents=True, exist_ok=True)
    t = np.arange(int(seconds * RATE)) / RATE
    x = (8000 * np.sin(2 * np.pi * hz * t)).astype(np.int16)
    with av.open(str(path), "w", format="g722") as out:
        stream = out.add_stream("g722", rate=RATE)
        stream.layout = "mono"
        frame = av.AudioFrame.from_ndarray(x.reshape(1, -1), format="s16", layout="mono")
        frame.sample_rate = RATE
        for packet in [*stream.encode(frame), *stream.encode(None)]:
            out.mux(packet)
    return x


@pytest.fixture
def asterisk(tmp_path):
    folder = tmp_path / "asterisk"
    doc = folder / human.TRANSCRIPTS
    doc.parent.mkdir(parents=True)
    with gzip.open(doc, "wt", encoding="utf-8") as f:
        f.write(TRANSCRIPTS)
    sounds = folder / human.SOUNDS
    for i, name in enumerate(("hello-world", "digits/5", "ascending-2tone", "demo-echotest", "conf-menu")):
        write_g722(sounds / f"{name}.g722", 0.5 + 0.25 * i, 300 + 100 * i)
    (sounds / "empty.g722").write_bytes(b"")
    return folder


def lines_of(data: Path) -> list[dict]:
    return [json.loads(line) for line in (data / "train.jsonl").read_text().splitlines()]


def test_prompts_are_appended_k_times_with_normalized_transcripts(asterisk, tmp_path, capsys):
    data = corpus(tmp_path, 3)
    before = lines_of(data)
    assert human.add_to_train(data, 2, asterisk) == 6
    rows = lines_of(data)
    assert rows[:3] == before  # the corpus's own lines stay, first
    added = rows[3:]
    assert [u["id"] for u in added] == [f"human-{i:04d}-{k}" for i in range(3) for k in range(2)]
    assert [u["text"] for u in added[::2]] == [KEPT["hello-world"], KEPT["digits/5"], KEPT["conf-menu"]]
    assert {u["speaker"] for u in added} == {human.SPEAKER}
    err = capsys.readouterr().err
    assert "skipped no-recording: no recording" in err and "skipped empty:" in err  # one line each
    assert "ascending" not in err and "demo-echotest" not in err  # left out by their transcripts, quietly
    decoded = human.read_g722(asterisk / human.SOUNDS / "hello-world.g722").astype(float)
    assert len(decoded) == 0.5 * RATE and np.abs(decoded).max() > 7000  # the tone, decoded at 16 kHz
    for u in added[:2]:  # each copy: the recording, within its own edges and noise floor
        y, rate = sf.read(str(data / u["audio"]), dtype="int16")
        assert rate == RATE and u["duration"] == len(y) / RATE
        assert len(decoded) <= len(y) <= len(decoded) + 2 * max(human.EDGE_SILENCE) * RATE + 2
        corr = np.correlate(y.astype(float), decoded, "valid")  # at the lead's offset
        assert corr.max() > 0.99 * float(np.dot(decoded, decoded))
    first, second = (sf.read(str(data / u["audio"]), dtype="int16")[0] for u in added[:2])
    assert len(first) != len(second) or not np.array_equal(first, second)  # copies differ in edges or noise
    card = json.loads((data / "corpus.json").read_text())
    assert card["human"]["copies"] == 2 and card["human"]["utterances"] == 6


def test_a_rerun_replaces_the_lines_and_keeps_its_files(asterisk, tmp_path):
    data = corpus(tmp_path, 3)
    human.add_to_train(data, 2, asterisk)
    made = {p: p.stat().st_mtime_ns for p in (data / "wav" / human.FOLDER).iterdir()}
    snapshot = (data / "train.jsonl").read_text()
    human.add_to_train(data, 2, asterisk)
    assert (data / "train.jsonl").read_text() == snapshot  # the same lines, not twice
    assert {p: p.stat().st_mtime_ns for p in made} == made  # each FLAC kept: its key matched
    human.add_to_train(data, 1, asterisk)
    assert [u["id"] for u in lines_of(data)[3:]] == ["human-0000-0", "human-0001-0", "human-0002-0"]
    assert sorted(p.name for p in (data / "wav" / human.FOLDER).iterdir()) == [  # the second copies' removed
        "human-0000-0.flac", "human-0001-0.flac", "human-0002-0.flac"]
    human.add_to_train(data, 0, asterisk)
    assert len(lines_of(data)) == 3 and not list((data / "wav" / human.FOLDER).iterdir())


def test_an_engine_run_after_them_never_speaks_a_prompt_again(asterisk, tmp_path, monkeypatch):
    calls = fake_flite(tmp_path, monkeypatch)
    data = corpus(tmp_path, 3)
    human.add_to_train(data, 1, asterisk)
    prompts = lines_of(data)[3:]
    assert flite.main(["train", "--data", str(data), "--fraction", "1", "--flite-dir", "DIR", "--add"]) == 0
    rows = lines_of(data)
    assert [u["id"] for u in rows if u["speaker"].startswith("flite+")] == [f"train-{i:06d}-flite" for i in range(3)]
    assert [u for u in rows if u["speaker"] == human.SPEAKER] == prompts  # each as it was, none spoken
    assert len(calls.read_text().splitlines()) == 3
    assert flite.main(["train", "--data", str(data), "--fraction", "1", "--flite-dir", "DIR"]) == 0  # replacing
    assert [u for u in lines_of(data) if u["speaker"] == human.SPEAKER] == prompts


def test_learning_check_adds_human_lines_last_to_a_copy(asterisk, tmp_path, monkeypatch):
    data = corpus(tmp_path, 4)
    (data / "dev.jsonl").write_text('{"id": "dev-000000"}\n')
    ran = []

    def run(cmd, log, env=None):  # the step in this process, on the fixture's prompts
        ran.append(Path(cmd[1]).name)
        assert human.main([*map(str, cmd[2:]), "--asterisk-dir", str(asterisk)]) == 0
    monkeypatch.setattr(learning_check, "run", run)
    out = tmp_path / "check" / "data"
    assert learning_check.make_data(check_args(data, human=3), out, tmp_path / "log") == out
    assert ran == ["human.py"]
    assert len(lines_of(out)) == 4 + 3 * 3 and len(lines_of(data)) == 4  # the given folder as it was


@pytest.mark.slow
def test_the_real_prompts_are_fetched_and_read(tmp_path):
    folder = tmp_path / "asterisk"
    try:
        human.fetch_by(human.ASTERISK_SH, folder)
    except human.FliteError as e:
        pytest.skip(f"Asterisk's prompts cannot be fetched here: {e}")
    kept = human.prompts(folder)
    assert len(kept) > 500 and ("digits/5", "FIVE") in kept
    y = human.read_g722(folder / human.SOUNDS / "hello-world.g722")
    assert 0.5 * RATE < len(y) < 3 * RATE and np.abs(y).max() > 1000  # speech, at 16 kHz
