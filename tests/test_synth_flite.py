"""Training speech from a second synthesizer (recipes/synth/local/flite.py): which training lines
Flite speaks, with which voices, that the manifest's other lines and a re-run are left as they
were, and the real Flite when it can be fetched."""
from __future__ import annotations

import hashlib
import json
import sys
from collections import Counter
from dataclasses import asdict, replace
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "recipes" / "synth" / "local"))  # the recipe's helpers are scripts
sys.path.insert(0, str(ROOT / "tools"))

import flite  # noqa: E402

# a fake tools/flite.sh: `run DIR -voice V --setf duration_stretch=S -t TEXT -o OUT` writes a tone
# of 0.1 s per character at 16 kHz (8 kHz for the voice "rms", to be resampled) and logs the call
# (voice, stretch, the F0 setting when given, text)
FAKE = """\
import sys
import numpy as np, soundfile as sf
args = sys.argv[1:]
pitch = args[6:8] if args[6] == '--setf' else []
if pitch:
    assert pitch[1].startswith('int_f0_target_mean=')
    del args[6:8]
assert args[0] == 'run' and args[2] == '-voice' and args[4] == '--setf' and args[6] == '-t' and args[8] == '-o'
open(__file__ + '.calls', 'a').write(' '.join([args[3], args[5], *pitch[1:], args[7]]) + '\\n')
rate = 8000 if args[3] == 'rms' else 16000
t = np.arange(int(0.1 * rate * len(args[7]))) / rate
sf.write(args[9], (6000 * np.sin(2 * np.pi * 300 * t)).astype(np.int16), rate)
"""


def fake_tool(tmp_path: Path, monkeypatch, module, name: str, source: str) -> Path:
    """tools/<name>.sh replaced by one whose `fetch` succeeds and whose `run` runs the Python
    `source`, for module.<NAME>_SH; the file `source` logs its calls to."""
    script = tmp_path / f"fake_{name}.py"
    script.write_text(source)
    (tmp_path / f"{name}.sh").write_text(f'[ "$1" = fetch ] && exit 0\nexec {sys.executable} {script} "$@"\n')
    monkeypatch.setattr(module, f"{name.upper()}_SH", tmp_path / f"{name}.sh")
    return Path(str(script) + ".calls")


def fake_flite(tmp_path: Path, monkeypatch) -> Path:
    return fake_tool(tmp_path, monkeypatch, flite, "flite", FAKE)


def corpus(tmp_path: Path, n: int) -> Path:
    data = tmp_path / "data"
    data.mkdir()
    lines = [{"id": f"train-{i:06d}", "audio": f"wav/train/train-{i:06d}.flac", "duration": 1.5,
              "text": f"WORD NUMBER {i}", "speaker": "en-us+m1"} for i in range(n)]
    (data / "train.jsonl").write_text("".join(json.dumps(u) + "\n" for u in lines))
    (data / "corpus.json").write_text(json.dumps({"seed": 3, "splits": {}}) + "\n")
    return data


def test_plan_chooses_the_fraction_with_the_seed_and_deals_every_voice():
    train = [{"id": f"train-{i:06d}", "text": f"T {i}"} for i in range(400)]
    a, b = flite.plan(train, 0.25, seed=0), flite.plan(list(reversed(train)), 0.25, seed=0)
    assert a == b and len(a) == 100  # the manifest's order does not matter
    assert [u.id for u in a] == sorted(u.id for u in a)
    assert {u.id for u in a} != {u.id for u in flite.plan(train, 0.25, seed=1)}
    assert Counter(u.voice for u in a) == {v: 25 for v in flite.VOICES}  # shuffled decks: dealt evenly
    assert all(lo <= u.stretch <= hi for u in a for lo, hi in [flite.DURATION_STRETCH])
    assert 0 < sum(u.lead == 0.0 for u in a) < 50  # some trimmed edges, as eSpeak's training lines
    assert flite.plan(train, 0.0, 0) == [] and len(flite.plan(train, 1.0, 0)) == 400
    assert "ked" not in " ".join(flite.VOICES)  # dev_synth's voice stays unheard


def test_pitch_draws_a_mean_f0_per_line_and_leaves_the_other_draws_and_keys_alone(tmp_path, monkeypatch):
    train = [{"id": f"train-{i:06d}", "text": f"T {i}"} for i in range(200)]
    plain, pitched = flite.plan(train, 0.5, seed=0), flite.plan(train, 0.5, seed=0, pitch=(0.75, 1.35))
    assert [replace(u, f0=0.0) for u in pitched] == plain  # the same lines, voices, speeds, edges, noise
    assert all(u.f0 == 0.0 for u in plain) and all(u.f0 == 0.0 for u in pitched if u.voice == "rms")
    for u in (u for u in pitched if u.voice != "rms"):
        assert 0.75 * flite.VOICE_F0[u.voice] - 0.5 <= u.f0 <= 1.35 * flite.VOICE_F0[u.voice] + 0.5
    assert len({u.f0 for u in pitched}) > 20 and pitched == flite.plan(train, 0.5, seed=0, pitch=(0.75, 1.35))
    # a key without --pitch is the one of before the option: FLACs made then are kept
    u = plain[0]
    old = json.dumps({k: v for k, v in asdict(u).items() if k != "f0"} | {"engine": "flite"}, sort_keys=True)
    assert u.key == hashlib.sha1(old.encode()).hexdigest() != replace(u, f0=100.0).key

    calls = fake_flite(tmp_path, monkeypatch)
    data = corpus(tmp_path, 8)
    args = ["train", "--data", str(data), "--fraction", "1", "--flite-dir", "DIR", "--jobs", "1"]
    assert flite.main([*args, "--pitch", "0.8", "1.2"]) == 0
    said = calls.read_text().splitlines()
    assert sum("int_f0_target_mean=" in line for line in said) == 6  # 2 of the 8 lines are rms's
    assert json.loads((data / "corpus.json").read_text())["flite"]["pitch"] == [0.8, 1.2]
    with pytest.raises(SystemExit):
        flite.main([*args, "--pitch", "1.2", "0.8"])


def test_train_lines_are_rewritten_to_flite_and_a_rerun_changes_nothing(tmp_path, monkeypatch, capsys):
    calls = fake_flite(tmp_path, monkeypatch)
    data = corpus(tmp_path, 20)
    before = [json.loads(line) for line in (data / "train.jsonl").read_text().splitlines()]
    assert flite.main(["train", "--data", str(data), "--fraction", "0.5", "--flite-dir", "DIR", "--jobs", "2"]) == 0
    after = [json.loads(line) for line in (data / "train.jsonl").read_text().splitlines()]
    plan = {u.id: u for u in flite.plan(before, 0.5, seed=3)}  # corpus.json's seed
    assert len(plan) == 10 and [u["id"] for u in after] == [u["id"] for u in before]
    for old, new in zip(before, after):
        if old["id"] not in plan:
            assert new == old
            continue
        u = plan[old["id"]]
        assert new["text"] == old["text"] and new["audio"] == f"wav/train_flite/{u.id}.flac"
        assert new["speaker"] == f"flite+{u.voice}"
        info = sf.info(str(data / new["audio"]))
        assert (info.samplerate, info.channels) == (16000, 1) and new["duration"] == info.frames / 16000
        spoken = 0.1 * len(flite.festival_text(u.text))  # the fake's tone, whatever the voice's rate
        assert new["duration"] == pytest.approx(spoken + u.lead + u.tail, abs=2e-3)
    assert json.loads((data / "corpus.json").read_text())["flite"] == {
        "fraction": 0.5, "voices": list(flite.VOICES), "utterances": 10}
    assert len(calls.read_text().splitlines()) == 10
    text = (data / "train.jsonl").read_text()
    assert flite.main(["train", "--data", str(data), "--fraction", "0.5", "--flite-dir", "DIR"]) == 0
    assert (data / "train.jsonl").read_text() == text
    assert len(calls.read_text().splitlines()) == 10  # every FLAC kept, none spoken again
    assert "10 of 20 training utterances spoken by Flite" in capsys.readouterr().err


def test_added_flite_lines_follow_their_espeak_lines_and_a_rerun_changes_nothing(tmp_path, monkeypatch):
    """--add keeps every eSpeak line and follows each chosen one with its Flite line (id <id>-flite,
    the same text, the same choice and voices as without --add); a re-run changes nothing."""
    calls = fake_flite(tmp_path, monkeypatch)
    data = corpus(tmp_path, 20)
    before = [json.loads(line) for line in (data / "train.jsonl").read_text().splitlines()]
    args = ["train", "--data", str(data), "--fraction", "0.5", "--flite-dir", "DIR", "--add"]
    assert flite.main(args) == 0
    after = [json.loads(line) for line in (data / "train.jsonl").read_text().splitlines()]
    replaced = {u.id: u for u in flite.plan(before, 0.5, seed=3)}
    assert [u for u in after if not u["id"].endswith("-flite")] == before
    added = [(i, u) for i, u in enumerate(after) if u["id"].endswith("-flite")]
    assert len(added) == 10
    for i, u in added:
        original = after[i - 1]
        assert u["id"] == original["id"] + "-flite" and u["text"] == original["text"]
        assert u["speaker"] == f"flite+{replaced[original['id']].voice}"  # the same deal as without --add
        assert u["audio"] == f"wav/train_flite/{u['id']}.flac" and (data / u["audio"]).is_file()
    assert json.loads((data / "corpus.json").read_text())["flite"]["added"] is True
    text = (data / "train.jsonl").read_text()
    assert flite.main(args) == 0
    assert (data / "train.jsonl").read_text() == text
    assert len(calls.read_text().splitlines()) == 10  # every FLAC kept, none spoken again


def test_without_flite_the_training_step_fails_in_one_line(tmp_path, monkeypatch, capsys):
    data = corpus(tmp_path, 4)
    fake = tmp_path / "flite.sh"
    fake.write_text('echo "flite.sh: cannot fetch Flite into $2: no apt-get" >&2; exit 1\n')
    monkeypatch.setattr(flite, "FLITE_SH", fake)
    text = (data / "train.jsonl").read_text()
    assert flite.main(["train", "--data", str(data), "--fraction", "0.5", "--flite-dir", str(tmp_path / "f")]) == 1
    assert capsys.readouterr().err.strip() == "flite: error: flite.sh: cannot fetch Flite into " \
        f"{tmp_path / 'f'}: no apt-get"
    assert (data / "train.jsonl").read_text() == text  # nothing half-changed
    with pytest.raises(SystemExit):
        flite.main(["train", "--data", str(data), "--fraction", "1.5"])


@pytest.mark.slow
def test_flite_voices_speak_a_line_into_a_16khz_flac(tmp_path):
    """Flite fetched (tools/flite.sh: apt-get download and dpkg-deb -x into the user's cache, a network
    download: slow-marked for that); each voice speaks a line, slower with a larger stretch."""
    try:
        folder = flite.fetch(flite.default_dir())
    except flite.FliteError as e:
        pytest.skip(f"Flite cannot be fetched here: {e}")
    line = "WE FOUND TWENTY ONE WINDOWS IN DETROIT"
    for voice in flite.VOICES:
        out = tmp_path / f"{voice}.flac"
        assert flite.main(["say", line, str(out), "--voice", voice, "--flite-dir", str(folder)]) == 0
        info = sf.info(str(out))
        assert (info.samplerate, info.channels, info.format, info.subtype) == (16000, 1, "FLAC", "PCM_16")
        samples = sf.read(str(out), dtype="int16")[0]
        assert 1.0 < len(samples) / 16000 < 6.0 and np.abs(samples).max() > 3000  # speech, not silence
        slow = flite.speak(line, voice, 1.25, folder)
        assert len(slow) > 1.1 * len(samples)


def check_args(data: Path, **given):
    """learning_check's arguments for make_data: the corpus folder, no other synthesizer (nor human
    speech) but those given."""
    import argparse

    import learning_check
    args = {"data": str(data), "jobs": 1, "human": 0}
    for name in learning_check.ENGINES:
        args.update({name: 0.0, f"{name}_pitch": None, f"{name}_add": False, f"{name}_voices": None})
    return argparse.Namespace(**{**args, **given})


def test_learning_check_gives_flite_lines_to_a_copy_of_a_given_corpus(tmp_path, monkeypatch):
    import learning_check

    calls = fake_flite(tmp_path, monkeypatch)
    data = corpus(tmp_path, 10)
    (data / "dev.jsonl").write_text('{"id": "dev-000000"}\n')
    for u in (json.loads(line) for line in (data / "train.jsonl").read_text().splitlines()):
        flite.write_flac(data / u["audio"], np.zeros(1600, np.int16), key="espeak")
    before = {p: p.read_bytes() for p in data.rglob("*") if p.is_file()}

    def run(cmd, log, env=None):  # the Flite step in this process, with the fake Flite
        assert Path(cmd[1]) == learning_check.FLITE
        assert flite.main([str(c) for c in cmd[2:]]) == 0
    monkeypatch.setattr(learning_check, "run", run)
    args = check_args(data, flite=0.5)
    out = tmp_path / "check" / "data"
    assert learning_check.make_data(args, out, tmp_path / "log") == out
    assert before == {p: p.read_bytes() for p in data.rglob("*") if p.is_file()}  # the given folder as it was
    assert not (data / "wav" / "train_flite").exists()
    lines = [json.loads(line) for line in (out / "train.jsonl").read_text().splitlines()]
    assert sum(u["speaker"].startswith("flite+") for u in lines) == 5 == len(calls.read_text().splitlines())
    assert all((out / u["audio"]).is_file() for u in lines) and (out / "dev.jsonl").is_file()
    assert learning_check.make_data(args, out, tmp_path / "log") == out  # made once: nothing spoken again
    assert len(calls.read_text().splitlines()) == 5
    plain = check_args(data, flite=0.0)
    assert learning_check.make_data(plain, out, tmp_path / "log") == data  # without --flite: the folder itself
    pitched = check_args(data, flite=0.5, flite_pitch=[0.8, 1.2], flite_add=True)
    other = tmp_path / "pitched" / "data"
    assert learning_check.make_data(pitched, other, tmp_path / "log") == other
    assert sum("int_f0_target_mean=" in line for line in calls.read_text().splitlines()[5:]) > 0
    assert json.loads((other / "corpus.json").read_text())["flite"]["pitch"] == [0.8, 1.2]
    added = [json.loads(line) for line in (other / "train.jsonl").read_text().splitlines()]
    assert len(added) == 15 and sum(u["id"].endswith("-flite") for u in added) == 5  # --flite-add


def test_a_smaller_fraction_leaves_no_stray_flac_or_is_refused_when_lines_were_rewritten(tmp_path, monkeypatch,
                                                                                         capsys):
    fake_flite(tmp_path, monkeypatch)
    data = corpus(tmp_path, 20)
    folder = data / "wav" / "train_flite"
    assert flite.main(["train", "--data", str(data), "--fraction", "0.5", "--add", "--flite-dir", "D"]) == 0
    assert len(list(folder.glob("*.flac"))) == 10
    assert flite.main(["train", "--data", str(data), "--fraction", "0.2", "--add", "--flite-dir", "D"]) == 0
    named = {Path(u["audio"]).name for u in map(json.loads, (data / "train.jsonl").read_text().splitlines())
             if u["speaker"].startswith("flite+")}
    assert len(named) == 4 and {f.name for f in folder.glob("*.flac")} == named
    assert flite.main(["train", "--data", str(data), "--fraction", "0.5", "--flite-dir", "D"]) == 0  # in place
    text = (data / "train.jsonl").read_text()
    assert flite.main(["train", "--data", str(data), "--fraction", "0.2", "--flite-dir", "D"]) == 1
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("flite: error: ") and "lines (e.g. train-" in last and "make the corpus again" in last
    assert (data / "train.jsonl").read_text() == text and len(list(folder.glob("*.flac"))) == 10
