"""Training speech from a third, fourth and fifth synthesizer (recipes/synth/local/mbrola.py,
pico.py and rhvoice.py, on local/flite.py's machinery): MBROLA's lines beside eSpeak's and Flite's,
each engine choosing among the corpus's own lines, eSpeak's, Pico's and RHVoice's speed and pitch
settings, --voices, the learning check's --mbrola, and the real engines when they can be fetched."""
from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "recipes" / "synth" / "local"))  # the recipe's helpers are scripts
sys.path.insert(0, str(ROOT / "tools"))

import flite  # noqa: E402
import learning_check  # noqa: E402
import mbrola  # noqa: E402
import pico  # noqa: E402
import rhvoice  # noqa: E402
from test_synth_flite import check_args, corpus, fake_flite, fake_tool  # noqa: E402

# a fake tools/mbrola.sh: `run DIR -v mb-V -s WPM [-p P] -w OUT -- TEXT` writes a tone of 0.1 s per
# character (at 22,050 Hz for en1, to be resampled; else 16 kHz) and logs the call (voice, wpm,
# pitch or "-", text)
FAKE = """\
import sys
import numpy as np, soundfile as sf
args = sys.argv[1:]
assert args[0] == 'run' and args[2] == '-v' and args[4] == '-s' and args[-4] == '-w' and args[-2] == '--'
pitch = args[7] if args[6] == '-p' else '-'
open(__file__ + '.calls', 'a').write(' '.join([args[3], args[5], pitch, args[-1]]) + '\\n')
rate = 22050 if args[3] == 'mb-en1' else 16000
t = np.arange(int(0.1 * rate * len(args[-1]))) / rate
sf.write(args[-3], (6000 * np.sin(2 * np.pi * 200 * t)).astype(np.int16), rate)
"""


def fake_mbrola(tmp_path: Path, monkeypatch) -> Path:
    return fake_tool(tmp_path, monkeypatch, mbrola, "mbrola", FAKE)


def median_f0(y: np.ndarray) -> float:
    """Median pitch (Hz) of int16-scaled 16 kHz speech (torchaudio's detector)."""
    import torch
    import torchaudio
    pitch = torchaudio.functional.detect_pitch_frequency(torch.from_numpy(y / 32768.0).float(), 16000,
                                                         freq_low=60, freq_high=500)
    return float(pitch.median())


def train(data: Path, *extra: str) -> int:
    """local/mbrola.py train --prosody espeak, as its command line runs it."""
    return flite.main(["train", "--data", str(data), "--mbrola-dir", "DIR", *extra], engine=mbrola.MBROLA,
                      doc=mbrola.__doc__, folder=("--mbrola-dir", mbrola.default_dir(), "MBROLA"))


def lines_of(data: Path) -> list[dict]:
    return [json.loads(line) for line in (data / "train.jsonl").read_text().splitlines()]


def test_mbrola_lines_join_flite_ones_and_each_engine_plans_among_the_corpus_own_lines(tmp_path, monkeypatch):
    fake_flite(tmp_path, monkeypatch)
    calls = fake_mbrola(tmp_path, monkeypatch)
    data = corpus(tmp_path, 20)
    before = lines_of(data)
    flite_args = ["train", "--data", str(data), "--fraction", "0.5", "--flite-dir", "DIR", "--add"]
    assert flite.main(flite_args) == 0
    with_flite = lines_of(data)
    assert train(data, "--fraction", "0.5", "--add") == 0
    after = lines_of(data)
    assert [u for u in after if not u["id"].endswith("-mbrola")] == with_flite  # Flite's lines as they were
    planned = {u.id: u for u in flite.plan(before, 0.5, seed=3, suffix="-mbrola", engine=mbrola.MBROLA)}
    added = [(i, u) for i, u in enumerate(after) if u["id"].endswith("-mbrola")]
    assert [u["id"] for _, u in added] == sorted(planned) and len(added) == 10
    assert {u.id for u in planned.values()} != {u.id for u in flite.plan(before, 0.5, seed=3, suffix="-mbrola")}
    for i, u in added:
        own = after[i - 1] if not after[i - 1]["id"].endswith("-flite") else after[i - 2]
        assert u["id"] == own["id"] + "-mbrola" and u["text"] == own["text"] and own in before
        assert u["speaker"] == f"mbrola+{planned[u['id']].voice}"
        assert u["audio"] == f"wav/train_mbrola/{u['id']}.flac"
        info = sf.info(str(data / u["audio"]))
        assert (info.samplerate, info.channels) == (16000, 1) and u["duration"] == info.frames / 16000
    assert {planned[u["id"]].voice for _, u in added} == set(mbrola.VOICES)
    card = json.loads((data / "corpus.json").read_text())
    assert card["mbrola"] == {"fraction": 0.5, "voices": list(mbrola.VOICES), "utterances": 10, "added": True}
    assert card["flite"]["added"] is True
    text = (data / "train.jsonl").read_text()
    assert train(data, "--fraction", "0.5", "--add") == 0 and flite.main(flite_args) == 0
    assert (data / "train.jsonl").read_text() == text  # either engine again: nothing changes
    assert len(calls.read_text().splitlines()) == 10  # every FLAC kept, none spoken again


def test_mbrola_speed_and_pitch_are_espeak_rate_and_pitch_settings(tmp_path, monkeypatch):
    calls = fake_mbrola(tmp_path, monkeypatch)
    assert [mbrola.espeak_pitch(f) for f in (1.0, 2 ** (1 / 3), 2 ** (-1 / 3), 4.0, 0.1)] == [50, 75, 25, 100, 0]
    data = corpus(tmp_path, 12)
    before = lines_of(data)
    assert train(data, "--fraction", "1", "--pitch", "0.75", "1.35", "--jobs", "1") == 0
    planned = {u.text: u for u in flite.plan(before, 1.0, seed=3, pitch=(0.75, 1.35), engine=mbrola.MBROLA)}
    logged = [line.split(" ", 3) for line in calls.read_text().splitlines()]
    assert len(logged) == 12
    for voice, wpm, pitch, text in logged:
        u = planned[text.rstrip(".").upper()]  # eSpeak's text: lower case, ended as a sentence
        assert voice == f"mb-{u.voice}" and int(wpm) == round(170 / u.stretch) and 136 <= int(wpm) <= 200
        assert int(pitch) == u.f0 and 19 <= u.f0 <= 82  # 50 + 75 log2 of [0.75, 1.35]
    assert len({u.f0 for u in planned.values()}) > 5
    assert all(u["speaker"].startswith("mbrola+") for u in lines_of(data))  # swapped, ids kept
    assert [u["id"] for u in lines_of(data)] == [u["id"] for u in before]


def test_mbrola_f0_tracker_finds_the_pitch_of_a_pulse_train_and_not_silence():
    rate = 16000
    t = np.arange(rate) / rate
    f0 = np.where(t < 0.5, 110.0, 180.0)  # a step from 110 to 180 Hz
    y = np.sin(2 * np.pi * np.cumsum(f0) / rate) + 0.4 * np.sin(4 * np.pi * np.cumsum(f0) / rate)
    track = mbrola.track_f0(np.concatenate([y, np.zeros(rate // 2)]), rate)
    assert len(track) == round(1.5 / mbrola.F0_HOP) + 1  # frame i centred at i x F0_HOP
    assert np.allclose(track[5:45], 110.0, rtol=0.02) and np.allclose(track[55:95], 180.0, rtol=0.02)
    assert (track[105:] == 0).all()  # silence: unvoiced


def test_flite_prosody_gives_each_voice_its_phonemes_kal16s_durations_and_a_scaled_contour():
    segments = [("pau", 0.2), ("dh", 0.25), ("ax", 0.3), ("k", 0.4), ("ae", 0.5), ("t", 0.6), ("er", 0.7),
                ("pau", 0.9)]
    f0 = np.zeros(100)
    f0[20:70] = np.linspace(120.0, 80.0, 50)  # falling, voiced over 0.2-0.7 s
    f0[45] = 200.0  # an octave error, left out
    for voice, vowels in (("us2", ["@", "{", "r="]), ("en1", ["@", "{", "3:"])):
        lines = [line.split() for line in mbrola.pho(segments, f0, voice, 100.0).splitlines()]
        assert [x[0] for x in lines] == ["_", "D", vowels[0], "k", vowels[1], "t", vowels[2], "_"]
        assert [int(x[1]) for x in lines] == [30, 50, 50, 100, 100, 100, 100, 30]  # edges' pauses cut to 30 ms
        assert lines[0][2:] == [] and lines[-1][2:] == []  # no pitch in pauses
        points = [(int(x[2]), float(x[3])) for x in lines[1:-1]]
        assert all(at == 20 for at, _ in points)
        hz = [float(v) for x in lines[1:-1] for v in x[3::2]]
        assert hz == sorted(hz, reverse=True) and max(hz) < 130  # falling; the 200 Hz frame not followed
        median = float(np.median(f0[f0 > 0]))  # of every voiced frame
        assert lines[2][3] == str(round(f0[26] * 100.0 / median))  # scaled so the median is 100 Hz
    with pytest.raises(flite.FliteError, match="'xx'"):
        mbrola.pho([("xx", 0.1)], f0, "us1", 200.0)


def test_prosody_flite_plans_mbrolas_lines_with_keys_and_card_of_its_own(tmp_path, monkeypatch):
    spoken = []

    def speak(text, voice, stretch, folder, f0=0.0):
        spoken.append((text, voice, f0))
        return np.full(8000, 1000.0, np.float32)
    fake = dataclasses.replace(mbrola.MBROLA_FLITE, speak=speak, fetch=lambda folder: folder)
    monkeypatch.setitem(mbrola.PROSODY[1], "flite", fake)
    data = corpus(tmp_path, 10)
    before = lines_of(data)
    assert flite.main(["train", "--data", str(data), "--fraction", "0.5", "--pitch", "0.8", "1.2", "--add",
                       "--jobs", "1", "--prosody", "flite"], engine=mbrola.MBROLA, doc=mbrola.__doc__,
                      folder=("--mbrola-dir", tmp_path, "MBROLA"), variants=mbrola.PROSODY) == 0
    espeak_plan = flite.plan(before, 0.5, seed=3, pitch=(0.8, 1.2), suffix="-mbrola", engine=mbrola.MBROLA)
    flite_plan = flite.plan(before, 0.5, seed=3, pitch=(0.8, 1.2), suffix="-mbrola", engine=fake)
    assert [(u.id, u.voice, u.stretch) for u in flite_plan] == [(u.id, u.voice, u.stretch) for u in espeak_plan]
    assert sorted(spoken) == sorted((u.text, u.voice, u.f0) for u in flite_plan)
    assert all(0.8 * mbrola.VOICE_F0[v] - 1 <= f0 <= 1.2 * mbrola.VOICE_F0[v] + 1 for _, v, f0 in spoken)
    assert {u.key for u in flite_plan}.isdisjoint(u.key for u in espeak_plan)  # eSpeak's FLACs are not kept
    assert json.loads((data / "corpus.json").read_text())["mbrola"]["variant"] == "flite-prosody"
    assert sum(u["id"].endswith("-mbrola") for u in lines_of(data)) == 5


def test_learning_check_gives_mbrola_lines_after_flite_ones_to_a_copy(tmp_path, monkeypatch):
    fake_flite(tmp_path, monkeypatch)
    fake_mbrola(tmp_path, monkeypatch)
    data = corpus(tmp_path, 10)
    (data / "dev.jsonl").write_text('{"id": "dev-000000"}\n')
    ran = []

    def run(cmd, log, env=None):  # each step in this process, with the fakes
        ran.append(Path(cmd[1]).name)
        if Path(cmd[1]) == learning_check.MBROLA:  # eSpeak's prosody asked for: the faked engine
            rest = [str(c) for c in cmd[5:]]
            at = rest.index("--prosody")
            assert rest[at + 1] == "espeak"
            assert train(Path(cmd[4]), *rest[:at], *rest[at + 2:]) == 0
        else:
            assert flite.main([str(c) for c in cmd[2:]]) == 0
    monkeypatch.setattr(learning_check, "run", run)
    args = check_args(data, flite=0.4, flite_add=True, mbrola=0.6, mbrola_pitch=[0.8, 1.2], mbrola_add=True,
                      mbrola_voices=["us2", "en1"], mbrola_prosody="espeak")
    out = tmp_path / "check" / "data"
    assert learning_check.make_data(args, out, tmp_path / "log") == out
    assert ran == ["flite.py", "mbrola.py"]
    speakers = [u["speaker"].split("+")[0] for u in lines_of(out)]
    assert speakers.count("flite") == 4 and speakers.count("mbrola") == 6 and len(speakers) == 20
    assert {u["speaker"] for u in lines_of(out) if u["speaker"].startswith("mbrola+")} == {"mbrola+us2", "mbrola+en1"}
    assert not (data / "wav" / "train_mbrola").exists()  # the given folder as it was
    only = check_args(data, mbrola=0.5, mbrola_prosody="espeak")
    other = tmp_path / "only" / "data"
    assert learning_check.make_data(only, other, tmp_path / "log") == other  # --mbrola alone: a copy too


def test_learning_check_gives_mbrola_py_its_prosody(tmp_path, monkeypatch):
    ran = []
    monkeypatch.setattr(learning_check, "run", lambda cmd, log, env=None: ran.append([str(c) for c in cmd]))
    data = corpus(tmp_path, 4)
    parsed = learning_check.parse_args(["--out", "o", "--data", str(data), "--flite", "0.5", "--mbrola", "0.5",
                                        "--mbrola-prosody", "flite"])
    learning_check.with_flite(check_args(data, flite=0.5, mbrola=0.5, mbrola_prosody=parsed.mbrola_prosody),
                              data, tmp_path / "log")
    assert [Path(cmd[1]).name for cmd in ran] == ["flite.py", "mbrola.py"]
    assert "--prosody" not in ran[0] and ran[1][ran[1].index("--prosody") + 1] == "flite"
    assert learning_check.parse_args(["--out", "o"]).mbrola_prosody == "flite"  # chosen on dev over 3 seeds


def test_learning_check_voices_leave_the_overrides_after_them_to_the_config():
    args = learning_check.parse_args(["--out", "o", "--data", "d", "--flite", "1", "--flite-voices", "kal16", "awb",
                                      "training.seed=0", "data.augment.gain.prob=0.5"])
    assert args.flite_voices == ["kal16", "awb"]
    assert args.overrides == ["training.seed=0", "data.augment.gain.prob=0.5"]
    before = learning_check.parse_args(["--out", "o", "model.d_model=96", "--pico", "1", "--pico-voices", "en-US"])
    assert before.pico_voices == ["en-US"] and before.overrides == ["model.d_model=96"]


def test_added_copies_follow_their_line_in_engine_order_whichever_engine_ran_last():
    ids = ["a", "a-rhvoice", "a-pico", "a-flite", "b", "a-mbrola", "c-flite", "b-mbrola", "b-flite", "c"]
    rows = [{"id": i, "speaker": f"{i.split('-')[1]}+v" if "-" in i else "en-us+m1"} for i in ids]
    rows[6]["speaker"] = "en-us+m1"  # the corpus's own id "c-flite": no copy
    assert [r["id"] for r in flite.in_engine_order(rows)] == [
        "a", "a-flite", "a-mbrola", "a-pico", "a-rhvoice", "b", "b-flite", "b-mbrola", "c-flite", "c"]
    assert [flite.added_by(r) for r in rows] == ["", "rhvoice", "pico", "flite", "", "mbrola", "", "mbrola", "flite",
                                                 ""]


def test_pico_speed_and_pitch_are_its_markup_levels(tmp_path, monkeypatch):
    said = []

    class FakeVoice:  # the library's engine: 0.1 s of tone per character of the markup's text
        def __init__(self, folder, voice):
            self.voice = voice

        def say(self, markup):
            said.append((self.voice, markup))
            return np.full(int(1600 * len(markup)), 1000, np.int16)
    monkeypatch.setattr(pico, "_Voice", FakeVoice)
    monkeypatch.setattr(pico, "_voices", {})
    data = corpus(tmp_path, 8)
    before = lines_of(data)
    args = ["train", "--data", str(data), "--pico-dir", "DIR", "--fraction", "1", "--pitch", "0.8", "1.25", "--add"]
    monkeypatch.setattr(pico, "PICO_SH", tmp_path / "nothing.sh")
    (tmp_path / "nothing.sh").write_text("exit 0\n")
    assert flite.main(args, engine=pico.PICO, doc=pico.__doc__, folder=("--pico-dir", pico.default_dir(), "Pico")) == 0
    planned = {u.text: u for u in flite.plan(before, 1.0, seed=3, pitch=(0.8, 1.25), suffix="-pico", engine=pico.PICO)}
    assert len(said) == 8 and {v for v, _ in said} == set(pico.VOICES)
    for voice, markup in said:
        text = markup.split(">")[2].split("<")[0]
        u = planned[text.rstrip(".").upper()]
        assert markup == (f'<pitch level="{u.f0}"><speed level="{round(100 / u.stretch)}">{text}</speed></pitch>')
        assert voice == u.voice and 80 <= u.f0 <= 125
    assert sum(u["speaker"].startswith("pico+") for u in lines_of(data)) == 8


def test_rhvoice_speed_and_pitch_are_its_relative_rate_and_pitch(tmp_path, monkeypatch):
    said = []

    class FakeSynthesizer:  # the library's engine: 0.1 s of tone per character at 24 kHz
        def __init__(self, folder):
            pass

        def say(self, text, voice, rate, pitch):
            said.append((text, voice, rate, pitch))
            return np.full(int(2400 * len(text)), 1000, np.int16), 24000
    monkeypatch.setattr(rhvoice, "_Synthesizer", FakeSynthesizer)
    monkeypatch.setattr(rhvoice, "_engines", {})
    data = corpus(tmp_path, 8)
    before = lines_of(data)
    monkeypatch.setattr(rhvoice, "RHVOICE_SH", tmp_path / "nothing.sh")
    (tmp_path / "nothing.sh").write_text("exit 0\n")
    args = ["train", "--data", str(data), "--rhvoice-dir", "DIR", "--fraction", "1", "--pitch", "0.8", "1.25",
            "--add", "--voices", "bdl", "slt"]
    assert flite.main(args, engine=rhvoice.RHVOICE, doc=rhvoice.__doc__,
                      folder=("--rhvoice-dir", rhvoice.default_dir(), "RHVoice")) == 0
    only = dataclasses.replace(rhvoice.RHVOICE, voices=("bdl", "slt"))
    planned = {u.text: u for u in flite.plan(before, 1.0, seed=3, pitch=(0.8, 1.25), suffix="-rhvoice", engine=only)}
    assert len(said) == 8 and {v for _, v, _, _ in said} == {"bdl", "slt"}  # --voices: those alone
    for text, voice, rate, pitch in said:
        u = planned[text.rstrip(".").upper()]
        assert voice == u.voice and rate == pytest.approx(1 / u.stretch) and pitch == pytest.approx(u.f0 / 100)
        assert 0.8 <= pitch <= 1.25
    rows = [u for u in lines_of(data) if u["speaker"].startswith("rhvoice+")]
    assert len(rows) == 8 and all(u["id"].endswith("-rhvoice") for u in rows)
    for row in rows:  # 24 kHz resampled to the corpus's 16 kHz: 0.1 s a character still, and the edges
        u = planned[row["text"]]
        assert row["duration"] == pytest.approx(0.1 * len(u.text + ".") + u.lead + u.tail, abs=0.01)
    card = json.loads((data / "corpus.json").read_text())
    assert card["rhvoice"]["voices"] == ["bdl", "slt"]


@pytest.mark.slow
@pytest.mark.parametrize("module", [mbrola, pico, rhvoice], ids=["mbrola", "pico", "rhvoice"])
def test_engine_voices_speak_a_line_slower_and_higher_when_asked(module, tmp_path):
    """The engine fetched (tools/mbrola.sh: Debian's espeak-ng, mbrola and its voices; tools/pico.sh:
    two Debian packages; tools/rhvoice.sh: four; into the user's cache, a network download:
    slow-marked for that); each
    voice speaks a line into a 16 kHz FLAC, slower with a larger stretch, higher with a larger
    pitch factor."""
    engine = {mbrola: mbrola.MBROLA, pico: pico.PICO, rhvoice: rhvoice.RHVOICE}[module]
    try:
        folder = module.fetch(module.default_dir())
    except flite.FliteError as e:
        pytest.skip(f"{engine.label} cannot be fetched here: {e}")
    line = "A MAN WHO WAS WALKING ALONG THE ROAD SAW MANY ANIMALS THERE"
    for voice in engine.voices:
        out = tmp_path / f"{voice}.flac"
        option = f"--{engine.name}-dir"
        assert flite.main(["say", line, str(out), "--voice", voice, option, str(folder)], engine=engine,
                          doc=module.__doc__, folder=(option, folder, engine.label)) == 0
        info = sf.info(str(out))
        assert (info.samplerate, info.channels, info.format, info.subtype) == (16000, 1, "FLAC", "PCM_16")
        samples = sf.read(str(out), dtype="int16")[0]
        assert 1.5 < len(samples) / 16000 < 8.0 and np.abs(samples).max() > 3000  # speech, not silence
        assert len(module.speak(line, voice, 1.25, folder)) > 1.1 * len(samples)
        if voice != "us1":  # (MBROLA's female voice: the pitch tracker errs by octaves on it)
            low, high = (median_f0(module.speak(line, voice, 1.0, folder, engine.pitch(voice, f))) for f in (0.8, 1.25))
            assert 1.3 < high / low < 1.9, voice  # 1.56 asked


@pytest.mark.slow
def test_mbrola_with_flite_prosody_keeps_kal16s_timing_at_the_pitch_asked(tmp_path):
    """MBROLA fetched with Flite (tools/mbrola.sh, tools/flite.sh: network downloads into the user's
    cache, slow-marked for that); each voice speaks kal16's phones for as long as kal16 does, at
    the mean pitch asked."""
    engine = mbrola.MBROLA_FLITE
    try:
        folder = engine.fetch(mbrola.default_dir())
    except flite.FliteError as e:
        pytest.skip(f"{engine.label} cannot be fetched here: {e}")
    line = "A MAN WHO WAS WALKING ALONG THE ROAD SAW MANY ANIMALS THERE"
    segments = mbrola.flite_segments(line, 1.1, tmp_path / "kal16.wav")
    spoken = segments[-1][1] - (segments[0][1] if segments[0][0] == "pau" else 0.0)  # kal16's, its pauses aside
    for voice in engine.voices:
        y = engine.speak(line, voice, 1.1, folder)
        assert 0.9 * spoken < len(y) / 16000 < spoken + 0.2 and np.abs(y).max() > 3000, voice
        if voice != "us1":  # (MBROLA's female voice: the pitch tracker errs by octaves on it)
            low, high = (median_f0(engine.speak(line, voice, 1.0, folder, engine.pitch(voice, f))) for f in (0.8, 1.25))
            assert 1.3 < high / low < 1.9, voice  # 1.56 asked
            assert 0.8 < low / (0.8 * mbrola.VOICE_F0[voice]) < 1.25, voice
