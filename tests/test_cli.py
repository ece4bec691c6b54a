"""The `asr` command from the outside: help, exit codes, one-line errors, the data commands."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import soundfile as sf

COMMANDS = ["prepare", "tokenizer", "cmvn", "train", "average", "decode", "transcribe", "wer"]


def asr(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "asr.cli", *map(str, args)], capture_output=True,
                          text=True, cwd=cwd)


def test_help_lists_every_subcommand():
    out = asr("--help")
    assert out.returncode == 0
    for command in COMMANDS:
        assert command in out.stdout


@pytest.mark.parametrize("command", COMMANDS + ["prepare librispeech", "prepare kaldi"])
def test_every_subcommand_has_help(command):
    out = asr(*command.split(), "--help")
    assert out.returncode == 0 and "usage: asr" in out.stdout


def test_help_is_instant():
    # `asr --help` must not import torch: check in a fresh interpreter.
    code = "import sys; from asr.cli import build_parser; build_parser(); print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.stdout.strip() == "False"


@pytest.mark.parametrize("preset, torch_first, expected", [
    (None, False, "PASSIVE"), ("ACTIVE", False, "ACTIVE"), (None, True, None)])
def test_the_program_makes_openmp_threads_sleep_unless_told_otherwise(tmp_path, preset, torch_first, expected):
    # set at the program's start, before torch loads OpenMP; the user's own setting wins, and a process
    # that imported torch before calling main (where it could no longer act) is left as it is
    (tmp_path / "ref.txt").write_text("u1 a b\n")
    code = ("import os, sys\n" + ("import torch\n" if torch_first else "") +
            "from asr.cli import main\n"
            f"assert main(['wer', {str(tmp_path / 'ref.txt')!r}, {str(tmp_path / 'ref.txt')!r}]) == 0\n"
            "print(os.environ.get('OMP_WAIT_POLICY'))")
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    if preset:
        env["OMP_WAIT_POLICY"] = preset
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == str(expected)


def test_the_mode_choices_are_the_searchs():
    """cli.MODES is written out so that `asr --help` needs no torch; it must be search.MODES."""
    from asr.cli import MODES
    from asr.search import MODES as SEARCH_MODES

    assert sorted(MODES) == sorted(SEARCH_MODES)


def test_the_precision_choices_are_the_decodings():
    from asr.cli import PRECISIONS
    from asr.decoding import PRECISIONS as DECODING_PRECISIONS

    assert list(PRECISIONS) == list(DECODING_PRECISIONS)


@pytest.mark.parametrize("command", ["decode", "transcribe", "serve"])
def test_threads_must_be_positive(command):
    out = asr(command, "--threads", "0", "--help")
    assert out.returncode == 2 and "--threads: must be an integer of at least 1" in out.stderr


DECODING_COMMANDS = ("decode", "transcribe", "serve")


def subparsers() -> dict:
    from asr.cli import build_parser

    (sub,) = [a for a in build_parser()._actions if a.dest == "command"]
    return sub.choices


def test_decode_transcribe_and_serve_take_the_same_decoding_flags():
    """One add_decoding_flags for the three decoding commands: the same decoding flags (any flag
    of one that sets a DecodingConfig field is in all three), each with its help text, and the
    same command line gives the same DecodingConfig in each."""
    import argparse
    import dataclasses

    from asr.cli import add_decoding_flags
    from asr.commands import DECODING_FIELDS, _decoding_config
    from asr.decoding import DecodingConfig

    reference = argparse.ArgumentParser()
    add_decoding_flags(reference)
    flags = {o for a in reference._actions for o in a.option_strings} - {"-h", "--help"}
    assert {"--config", "--mode", "--beam-size", "--ctc-weight", "--length-bonus", "--lexicon", "--lm", "--lm-weight",
            "--lm-fusion", "--lm-word-bonus", "--precision", "--int8", "--device", "--threads"} <= flags
    fields = {f.name for f in dataclasses.fields(DecodingConfig)}
    assert set(DECODING_FIELDS) <= fields
    assert set(DECODING_FIELDS) == {a.dest for a in reference._actions} - {"help", "config", "threads"}
    parsers = subparsers()
    line = ["--mode", "attention", "--beam-size", "3", "--ctc-weight", "0.4", "--length-bonus", "0.5", "--lexicon",
            "w.txt", "--lm", "lm.arpa", "--lm-weight", "0.2", "--lm-fusion", "--lm-word-bonus", "1.5", "--precision",
            "fp32", "--int8", "--device", "cpu", "--threads", "2"]
    configs = []
    for command in DECODING_COMMANDS:
        actions = parsers[command]._actions
        options = {o for a in actions for o in a.option_strings}
        assert flags <= options, (command, flags - options)
        decoding = {o for a in actions for o in a.option_strings if a.dest in fields}
        assert decoding - {"--batch-size"} <= flags, (command, decoding - flags)  # batch sizes: each command's own
        assert all(a.help for a in actions), (command, [a.dest for a in actions if not a.help])
        args = parsers[command].parse_args(["--model", "m.pt", *line] + {
            "decode": ["--manifest", "t.jsonl", "--out-dir", "d"], "transcribe": ["a.wav"], "serve": []}[command])
        configs.append(_decoding_config(args, []))
    assert configs[0] == configs[1] == configs[2]
    first = configs[0]
    assert (first.beam_size, first.lm_fusion, first.int8, first.length_bonus) == (3, True, True, 0.5)


@pytest.mark.parametrize("command", DECODING_COMMANDS)
def test_an_lm_option_without_an_lm_is_one_line_in_every_decoding_command(command, tmp_path):
    """Checked once, by asr.decoding.load_decoding_config, before any model or manifest is read."""
    extra = {"decode": ["--manifest", tmp_path / "t.jsonl", "--out-dir", tmp_path / "d"],
             "transcribe": [tmp_path / "a.wav"], "serve": []}[command]
    out = asr(command, "--model", tmp_path / "absent.pt", "--lm-weight", "0.5", *extra)
    assert out.returncode == 1 and out.stderr == f"asr {command}: error: --lm-weight needs --lm LM\n"


def test_transcribe_and_serve_do_not_import_the_manifest_decoder():
    """`asr transcribe` and `asr serve` (and the modules they use) never import asr.decode (its
    DataLoader and process groups): their handlers import none of it, nor does anything they reach."""
    import ast
    from pathlib import Path

    from test_imports import import_graph, imports

    root = Path(__file__).resolve().parents[1]
    tree = ast.parse((root / "asr" / "commands.py").read_text(encoding="utf-8"))
    handlers = {node.name: node for node in tree.body if isinstance(node, ast.FunctionDef)}
    graph = import_graph(root)
    for name in ("cmd_transcribe", "cmd_serve", "_decoding_config", "_write_outputs"):
        reached = [m for m, _ in imports(handlers[name], "asr.commands", False) if m.startswith("asr")]
        seen, todo = set(), list(reached)
        while todo:
            module = todo.pop()
            if module not in seen:
                seen.add(module)
                todo.extend(graph.get(module, ()))
        assert reached and "asr.decode" not in seen, name


def test_wer_command(tmp_path):
    (tmp_path / "ref").write_text("u1 A B C D\nu2 HELLO WORLD\n")
    (tmp_path / "hyp").write_text("u1 a x c\nu2 Hello, world!\n")
    out = asr("wer", tmp_path / "ref", tmp_path / "hyp", "--json", "--errors", tmp_path / "errors.txt")
    assert out.returncode == 0, out.stderr
    counts = json.loads(out.stdout.splitlines()[0])
    assert (counts["substitutions"], counts["deletions"], counts["insertions"], counts["words"]) == (1, 1, 0, 6)
    assert "33.3" in out.stdout.strip().splitlines()[-1]
    assert (tmp_path / "errors.txt").read_text().index("u1") < (tmp_path / "errors.txt").read_text().index("u2")


def test_wer_id_only_in_hyp_is_an_error(tmp_path):
    (tmp_path / "ref").write_text("u1 A\n")
    (tmp_path / "hyp").write_text("u1 A\nu9 B\n")
    out = asr("wer", tmp_path / "ref", tmp_path / "hyp")
    assert out.returncode != 0
    assert "u9" in out.stderr and len(out.stderr.strip().splitlines()) == 1


def test_errors_are_one_line_and_nonzero(tmp_path):
    out = asr("tokenizer", "--manifest", tmp_path / "missing.jsonl", "--kind", "char", "--out", tmp_path / "t")
    assert out.returncode == 1
    assert len(out.stderr.strip().splitlines()) == 1 and "missing.jsonl" in out.stderr


def write_corpus(tmp_path, n=4):
    """A tiny Kaldi data dir and manifest of tones (real audio files, generated here)."""
    rng = np.random.default_rng(0)
    data = tmp_path / "kaldi"
    data.mkdir()
    texts = ["HELLO WORLD", "GOOD MORNING", "SPEECH RECOGNITION", "ONE TWO THREE"]
    with open(data / "wav.scp", "w") as scp, open(data / "text", "w") as text:
        for i in range(n):
            path = tmp_path / f"utt{i}.wav"
            sf.write(path, (0.1 * rng.standard_normal(16000 + 4000 * i)).astype(np.float32), 16000)
            scp.write(f"utt{i} {path}\n")
            text.write(f"utt{i} {texts[i % len(texts)].lower()}!\n")
    return data


def test_prepare_kaldi_tokenizer_cmvn_pipeline(tmp_path):
    data = write_corpus(tmp_path)
    manifest = tmp_path / "train.jsonl"
    out = asr("prepare", "kaldi", data, manifest, "--speed-perturb", "0.9,1.1")
    assert out.returncode == 0, out.stderr
    utts = [json.loads(line) for line in manifest.read_text().splitlines()]
    assert len(utts) == 12
    assert {u["id"] for u in utts} >= {"utt0", "sp0.9-utt0", "sp1.1-utt3"}
    assert next(u for u in utts if u["id"] == "utt0")["text"] == "HELLO WORLD"

    out = asr("tokenizer", "--manifest", manifest, "--kind", "char", "--out", tmp_path / "tok",
              "--words", tmp_path / "words.txt")
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "tok" / "tokenizer.json").is_file()
    words = (tmp_path / "words.txt").read_text().split("\n")
    assert "HELLO" in words and "WORLD" in words and words == sorted(set(words) - {""}) + [""]
    out = asr("tokenizer", "--manifest", manifest, "--kind", "bpe", "--vocab-size", "10000", "--out", tmp_path / "b")
    assert out.returncode == 1 and len(out.stderr.strip().splitlines()) == 1

    out = asr("cmvn", "--manifest", manifest, "--out", tmp_path / "cmvn.json", "--num-workers", "2")
    assert out.returncode == 0, out.stderr
    from asr.audio import load_audio
    from asr.features import CMVNStats, FeatureConfig, num_frames
    from asr.manifest import read_manifest

    stats = CMVNStats.load(tmp_path / "cmvn.json")
    utts = read_manifest(manifest)
    frames = sum(num_frames(len(load_audio(u.audio, speed=u.speed))) for u in utts)
    assert stats.count == frames
    assert stats.mean.shape == (FeatureConfig().n_mels,) and bool((stats.std > 0).all())


def test_prepare_librispeech_real(realspeech, tmp_path):
    out = asr("prepare", "librispeech", realspeech / "LibriSpeech", tmp_path, "--parts", "dev-clean,test-clean")
    assert out.returncode == 0, out.stderr
    assert len((tmp_path / "dev-clean.jsonl").read_text().splitlines()) == 4
    assert len((tmp_path / "test-clean.jsonl").read_text().splitlines()) == 8
    assert not (tmp_path / "train-clean-100.jsonl").exists()


def test_transcribe_continues_after_an_unwritable_output(spoken_model, tmp_path):
    """One output that cannot be written (out/b.txt is a folder) is reported by its own name, not
    the temporary file's; the other inputs are still transcribed and written; exit status 1."""
    names = ["a", "b", "c"]
    for name, audio in zip(names, spoken_model.audio[::4]):
        (tmp_path / f"{name}.flac").write_bytes(audio.read_bytes())
    out = tmp_path / "out"
    (out / "b.txt").mkdir(parents=True)
    done = asr("transcribe", "--model", spoken_model.model, *(tmp_path / f"{n}.flac" for n in names),
               "--output-dir", out, "--threads", "1")
    assert done.returncode == 1, done.stderr
    texts = [(out / f"{n}.txt").read_text().strip() for n in ("a", "c")]
    assert texts == [spoken_model.texts[0], spoken_model.texts[8]]
    assert f"cannot write {out / 'b.txt'}: Is a directory" in done.stderr and ".tmp" not in done.stderr
    assert done.stdout.split() == [str(out / "a.txt"), str(out / "c.txt")]
    assert sorted(p.name for p in out.iterdir()) == ["a.txt", "b.txt", "c.txt"]  # no temporary file left


def test_serve_says_what_binding_every_interface_means():
    from asr.commands import binding_note

    assert binding_note("127.0.0.1", 8000, []) is None and binding_note("localhost", 8000, []) is None
    note = binding_note("0.0.0.0", 8000, [])
    assert "every network interface" in note and "port 8000" in note and "--allowed-host" in note
    assert "no authentication" in note and "\n" not in note
    assert "--allowed-host" not in binding_note("::", 8000, ["asr.example"])
    assert "192.168.1.5" in binding_note("192.168.1.5", 8000, [])


# ---------------------------------------------------------------------------------------------
# transcribe --streaming


@pytest.fixture(scope="module")
def streaming_files(tmp_path_factory):
    """A model file of a tiny conformer with causal convolutions, one of a conformer without, and
    two speech-like WAVs (tests/test_api.py)."""
    from test_api import speechlike, write_model_file

    folder = tmp_path_factory.mktemp("streaming")
    for i, seconds in enumerate((2.2, 1.3)):
        sf.write(folder / f"a{i}.wav", speechlike(seconds, 5 + i), 16000)
    return (write_model_file(folder / "model.pt", eos_bias=0.0, streaming=True), folder / "a0.wav",
            folder / "a1.wav")


def test_transcribe_streaming_prints_partials_and_the_transcripts_of_the_whole_files(streaming_files, tmp_path):
    """Each file fed in 0.1 s pieces: partial and final lines on stderr as they come; on stdout the
    format of transcribe, with the texts of Recognizer.stream fed the same way (its equality with a
    chunked ctc_rescore transcribe: tests/test_api.py); --output-dir and --format json write one
    file per input, a segment per final."""
    import torch

    from asr.api import load_model
    from asr.decoding import DecodingOptions

    model, *files = streaming_files
    flags = ["--streaming", "--chunk-size", "4", "--left-chunks", "2", "--beam-size", "4", "--ctc-weight", "0.5",
             "--threads", "1"]
    done = asr("transcribe", "--model", model, *files, *flags)
    assert done.returncode == 0, done.stderr
    recognizer = load_model(model, options=DecodingOptions(beam_size=4, ctc_weight=0.5))
    expected = []
    for path in files:
        samples, _ = sf.read(path, dtype="float32")
        stream = recognizer.stream(4, 2)
        for piece in torch.from_numpy(samples).split(1600):
            stream.accept_waveform(piece)
        stream.finish()
        expected.append(stream.result())
    assert all(expected) and done.stdout == "".join(f"{p}\t{t}\n" for p, t in zip(files, expected))
    lines = done.stderr.splitlines()
    for path, text in zip(files, expected):
        mine = [line for line in lines if line.split(":")[0].split(" ")[-1] == str(path)]
        assert mine[-1] == f"final {path}: {text}" and mine[0].startswith(f"partial {path}: ")
    out = tmp_path / "out"
    done = asr("transcribe", "--model", model, files[0], *flags, "--max-segment", "1.0", "--output-dir", out,
               "--format", "json")
    assert done.returncode == 0, done.stderr
    written = json.loads((out / "a0.json").read_text())[0]
    finals = [line.split(": ", 1)[1] for line in done.stderr.splitlines() if line.startswith("final ")]
    assert len(written["segments"]) == len(finals) >= 2 and [s["text"] for s in written["segments"]] == finals
    assert written["text"] == " ".join(t for t in finals if t) and written["duration"] == 2.2


def test_transcribe_streaming_refuses_what_does_not_apply_in_one_line(streaming_files, capsys):
    from asr.cli import main

    model, audio, _ = streaming_files
    for args, message in [(["--chunk-size", "4"], "--chunk-size needs --streaming"),
                          (["--left-chunks", "1", "--max-segment", "2"], "--left-chunks, --max-segment need"),
                          (["--streaming", "--word-timestamps"], "--word-timestamps does not apply"),
                          (["--streaming", "--lm", "x.arpa", "--int8"], "--lm, --int8 do not apply")]:
        assert main(["transcribe", "--model", str(model), str(audio), *args]) == 1
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and message in err, err


def test_partials_overwrite_one_line_on_a_terminal():
    from asr.commands import _event_lines
    from asr.streaming import Event

    events = [Event("partial", "a", (5,), 0.0, 0.6), Event("partial", "ab", (5, 6), 0.0, 1.2),
              Event("final", "abc", (5, 6, 7), 0.0, 1.5)]
    assert _event_lines(events, "x.wav", tty=True) == ("\r\x1b[Kpartial x.wav: a\r\x1b[Kpartial x.wav: ab"
                                                      "\r\x1b[Kfinal x.wav: abc\n")
    assert _event_lines(events, "x.wav", tty=False) == "partial x.wav: a\npartial x.wav: ab\nfinal x.wav: abc\n"


def test_serve_flags_are_the_serve_options():
    """`asr serve`'s defaults are ServeOptions' and each streaming flag reaches its field."""
    from asr.cli import build_parser
    from asr.commands import serve_options
    from asr.serve import ServeOptions

    parse = build_parser().parse_args
    assert serve_options(parse(["serve", "--model", "m.pt"])) == ServeOptions()
    given = serve_options(parse(["serve", "--model", "m.pt", "--chunk-size", "8", "--left-chunks", "4",
                                 "--endpoint-silence", "0.3", "--max-segment", "12", "--max-streams", "3",
                                 "--max-stream-seconds", "60", "--stream-receive-timeout", "5", "--heartbeat", "0"]))
    assert given == ServeOptions(stream_chunk_size=8, stream_left_chunks=4, stream_endpoint_silence=0.3,
                                 stream_max_segment=12.0, max_streams=3, max_stream_seconds=60.0,
                                 stream_receive_timeout_s=5.0, heartbeat_s=0.0)



@pytest.mark.parametrize("field", [{"stream_chunk_size": 0}, {"stream_chunk_size": 65}, {"stream_left_chunks": -2}])
def test_serve_options_refuse_stream_chunks_out_of_range(field):
    """Unset chunk options mean the model's own; a set one out of range is refused, 0 included."""
    from asr.serve import ServeOptions

    ServeOptions(stream_chunk_size=None, stream_left_chunks=None)
    with pytest.raises(ValueError, match="stream_chunk_size from 1 to 64"):
        ServeOptions(**field)

@pytest.mark.slow  # two exports and two transcriptions: a minute
def test_export_streaming_flags_in_one_line(streaming_files, tmp_path):
    """asr export --streaming writes the stream graphs, and `asr transcribe --streaming` on the
    export gives the PyTorch model's transcript; the chunk flags alone, or no --left-chunks, are
    one-line errors."""
    model, audio = streaming_files[0], streaming_files[1]
    for flags, said in ((["--chunk-size", "4"], "--chunk-size needs --streaming"),
                        (["--streaming"], "left_chunks")):
        out = asr("export", "--model", model, "--out", tmp_path / "bad", *flags)
        assert out.returncode != 0 and len(out.stderr.strip().splitlines()) == 1 and said in out.stderr, out.stderr
    out = asr("export", "--model", model, "--out", tmp_path / "onnx", "--streaming", "--chunk-size", "4",
              "--left-chunks", "2")
    assert out.returncode == 0, out.stderr[-2000:]
    assert (tmp_path / "onnx" / "stream_chunk.onnx").exists()
    exported = asr("transcribe", "--model", tmp_path / "onnx", "--streaming", audio)
    torch_model = asr("transcribe", "--model", model, "--streaming", "--chunk-size", "4", "--left-chunks", "2", audio)
    assert exported.returncode == 0 and torch_model.returncode == 0, exported.stderr[-2000:]
    assert exported.stdout.strip() and exported.stdout == torch_model.stdout
