"""asr.manifest: reading, writing and validating manifests, and the transcripts `asr wer` reads."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from data_helpers import write_lines

from asr.manifest import ManifestError, Utterance, read_manifest, read_transcripts, write_manifest
from asr.metrics import score


def good_line(utt_id: str = "a", **extra) -> str:
    return json.dumps({"id": utt_id, "audio": "a.wav", "duration": 1.5, "text": "HELLO"} | extra)


# ---------------------------------------------------------------------------------- manifests


def test_manifest_round_trip(tmp_path):
    utts = [
        Utterance("b", str(tmp_path / "b.flac"), 2.5, "B TEXT", speaker="s1"),
        Utterance("a", str(tmp_path / "a.wav"), 1.0, "", start=0.5, end=2.5, speed=2.0),
    ]
    path = tmp_path / "sub" / "m.jsonl"
    write_manifest(utts, path)
    assert read_manifest(path) == utts  # order kept, every field back
    assert not [p for p in path.parent.iterdir() if p.name != "m.jsonl"]  # no temporary left
    first = json.loads(path.read_text().splitlines()[0])
    assert first == {"id": "b", "audio": str(tmp_path / "b.flac"), "duration": 2.5, "text": "B TEXT", "speaker": "s1"}


def test_relative_audio_resolved_against_manifest_folder(tmp_path, monkeypatch):
    write_lines(tmp_path / "data" / "m.jsonl", [good_line(audio="../wav/a.wav"), good_line("b", audio="/x/b.wav")])
    monkeypatch.chdir(tmp_path / "data")
    utts = read_manifest("m.jsonl")
    assert utts[0].audio == str(tmp_path / "wav" / "a.wav")
    assert utts[1].audio == "/x/b.wav"
    assert utts[0].to_json(base_dir=tmp_path / "data")["audio"] == os.path.join("..", "wav", "a.wav")


def test_write_refuses_duplicate_ids(tmp_path):
    utt = Utterance("a", "/a.wav", 1.0, "")
    with pytest.raises(ValueError, match="duplicate id 'a'"):
        write_manifest([utt, utt], tmp_path / "m.jsonl")
    assert not (tmp_path / "m.jsonl").exists()


DROP = object()


def line_with(**changes) -> str:
    """A manifest line: id a, audio a.wav, duration 1.5, text "" with `changes` (DROP removes)."""
    obj = {"id": "a", "audio": "a.wav", "duration": 1.5, "text": ""} | changes
    return json.dumps({k: v for k, v in obj.items() if v is not DROP})


BAD_LINES = [
    ("{not json", "bad JSON"),
    ('["a", 1.5]', "expected a JSON object, got an array"),
    ('"a"', "expected a JSON object, got a string"),
    (line_with(id=DROP), "missing field 'id'"),
    (line_with(audio=DROP), "missing field 'audio'"),
    (line_with(duration=DROP), "missing field 'duration'"),
    (line_with(text=DROP), "missing field 'text'"),
    (line_with(text=None), "field 'text' is null"),
    (line_with(id=7), "field 'id' must be a string, got a number 7"),
    (line_with(audio=["a.wav"]), "field 'audio' must be a string, got an array"),
    (line_with(duration="1.5"), "field 'duration' must be a number, got a string \"1.5\""),
    (line_with(duration=True), "field 'duration' must be a number, got a boolean"),
    (line_with(text=5), "field 'text' must be a string"),
    (line_with(duration=-1.5), "duration must be positive"),
    (line_with(duration=0), "duration must be positive"),
    (line_with(duration=float("nan")), "field 'duration' must be finite"),
    (line_with(duration=float("inf")), "field 'duration' must be finite"),
    (line_with(id=""), "id '' is empty or contains whitespace"),
    (line_with(id="a b"), "id 'a b' is empty or contains whitespace"),
    (line_with(audio=""), "audio is empty"),
    (line_with(start=-1), "start must be >= 0"),
    (line_with(start="0"), "field 'start' must be a number"),
    (line_with(start=3, end=2), "end (2.0) must be after start (3.0)"),
    (line_with(end=0), "end (0.0) must be after start (0.0)"),
    (line_with(start=1, end=5), "duration 1.5 disagrees with (end - start) / speed = 4.000"),
    (line_with(speed=0), "speed must be positive"),
    (line_with(speed=-0.9), "speed must be positive"),
    (line_with(speed="fast"), "field 'speed' must be a number"),
    (line_with(speaker=12), "field 'speaker' must be a string"),
    (good_line("x"), "duplicate id x (first on line 1)"),
]


@pytest.mark.parametrize("line, reason", BAD_LINES, ids=[r for _, r in BAD_LINES])
def test_malformed_line_is_fatal_with_path_and_line(tmp_path, line, reason):
    path = write_lines(tmp_path / "m.jsonl", [good_line("x"), "", line, good_line("z")])
    with pytest.raises(ManifestError) as err:
        read_manifest(path)
    message = str(err.value)
    assert message.startswith(f"{path}:3: ") and reason in message
    assert "\n" not in message


def test_manifest_not_utf8_and_missing(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_bytes(good_line().encode() + b"\n" + b'{"id": "\xff"}\n')
    with pytest.raises(ManifestError, match=r"m\.jsonl:2: not UTF-8"):
        read_manifest(path)
    with pytest.raises(ManifestError, match="no such file"):
        read_manifest(tmp_path / "absent.jsonl")


def test_manifest_extras_ignored_and_segment_accepted(tmp_path):
    line = good_line(start=1.0, end=2.5, speed=1.0, speaker="s", lang="en")
    [utt] = read_manifest(write_lines(tmp_path / "m.jsonl", [line]))
    assert (utt.start, utt.end, utt.speed, utt.speaker) == (1.0, 2.5, 1.0, "s")


# ---------------------------------------------------------------------------------------------
# read_transcripts


def test_read_kaldi_text(tmp_path):
    path = tmp_path / "text"
    path.write_text("u1 A B C\nu2\n\nu3   hello, world \nu4\tTAB SEPARATED\r\n", encoding="utf-8")
    assert read_transcripts(path) == {"u1": "A B C", "u2": "", "u3": "hello, world", "u4": "TAB SEPARATED"}


def test_read_jsonl_manifest(tmp_path):
    lines = [{"id": "a", "audio": "a.flac", "duration": 1.0, "text": "Hello"},
             {"id": "b", "audio": "b.flac", "duration": 2.0, "text": ""}]
    body = "\n".join(json.dumps(x) for x in lines) + "\n"
    (tmp_path / "m.jsonl").write_text(body, encoding="utf-8")
    (tmp_path / "m.txt").write_text("\n" + body, encoding="utf-8")  # detected by its first "{"
    assert read_transcripts(tmp_path / "m.jsonl") == {"a": "Hello", "b": ""}
    assert read_transcripts(tmp_path / "m.txt") == {"a": "Hello", "b": ""}


@pytest.mark.parametrize("name, body, message", [
    ("text", "u1 A\nu1 B\n", r"text:2: duplicate id u1 \(first on line 1\)"),
    ("text", b"u1 A\nu2 \xff\n", r"text:2: not UTF-8 text"),
    ("m.jsonl", '{"id": "u1", "text": "A"}\n{"id": "u1", "text": "B"}\n', r"m.jsonl:2: duplicate id u1"),
    ("m.jsonl", '{"id": "u1", "text": "A"}\n{"id": "u2", "text": \n', r"m.jsonl:2: bad JSON"),
    ("m.jsonl", '{"id": "u1"}\n', r"m.jsonl:1: missing field 'text'"),
    ("m.jsonl", '{"id": 7, "text": "A"}\n', r"m.jsonl:1: field 'id' must be a string, got a number 7"),
    ("m.jsonl", '["u1", "A"]\n', r"m.jsonl:1: expected a JSON object, got an array"),
    ("m.jsonl", '{"id": "u 1", "text": "A"}\n', r"m.jsonl:1: id 'u 1' is empty or contains whitespace"),
])
def test_read_transcripts_errors(tmp_path, name, body, message):
    if isinstance(body, bytes):
        (tmp_path / name).write_bytes(body)
    else:
        (tmp_path / name).write_text(body, encoding="utf-8")
    with pytest.raises(ValueError, match=message):
        read_transcripts(tmp_path / name)


def test_read_transcripts_missing_file_is_one_line_value_error(tmp_path):
    with pytest.raises(ValueError, match=r"absent: no such file$"):
        read_transcripts(tmp_path / "absent")


def test_read_then_score(tmp_path):
    (tmp_path / "ref").write_text("u1 A B C D\nu2 HELLO WORLD\n")
    (tmp_path / "hyp").write_text("u1 A X C\nu2 HELLO WORLD\n")
    stats = score(read_transcripts(tmp_path / "ref"), read_transcripts(tmp_path / "hyp")).stats
    assert (stats.substitutions, stats.deletions, stats.insertions, stats.words) == (1, 1, 0, 6)


def test_hypothesis_manifest_needs_only_id_and_text(tmp_path):
    """Text-only mode: a hypothesis manifest has no audio or duration, and the other fields are
    not read (a reference manifest's are checked by read_manifest when it is used for training)."""
    lines = [{"id": "a", "text": "Hello", "score": -1.5}, {"id": "b", "text": "", "duration": -1}]
    write_lines(tmp_path / "hyp.jsonl", [json.dumps(x) for x in lines])
    assert read_transcripts(tmp_path / "hyp.jsonl") == {"a": "Hello", "b": ""}


TEXT_FAULTS = [(line, reason) for line, reason in BAD_LINES
               if any(word in reason for word in ("JSON", "'id'", "id '", "'text'", "duplicate"))]


@pytest.mark.parametrize("line, reason", TEXT_FAULTS, ids=[r for _, r in TEXT_FAULTS])
def test_one_parser_one_message(tmp_path, line, reason):
    """A fault of the JSON, the id or the text is reported alike by both readers."""
    path = write_lines(tmp_path / "m.jsonl", [good_line("x"), "", line, good_line("z")])
    with pytest.raises(ManifestError) as full:
        read_manifest(path)
    with pytest.raises(ManifestError) as text_only:
        read_transcripts(path)
    assert str(text_only.value) == str(full.value) and reason in str(full.value)


def test_reading_a_manifest_does_not_import_torch():
    """`asr wer`, `asr tokenizer` and `asr lm` read manifests without the cost of importing torch."""
    code = "import sys, asr.manifest; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
