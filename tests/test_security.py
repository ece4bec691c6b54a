"""Untrusted files run no code: model files and checkpoints only ever load with weights_only=True,
a crafted pickle is refused before anything in it runs, configs are safe YAML, corpus lists run
no commands; files of other kinds and inconsistent model files get one clear line.

Every crafted file here would create MARKER if any of its code ran; each test checks it did not.
"""
from __future__ import annotations

import ast
import json
import os
import pickle
import signal
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
import torch
from test_api import write_model_file
from test_reliability_inputs import cli_session

import asr
from asr.audio import AudioError, load_audio
from asr.checkpoint import VERSION, CheckpointError, load_file, save_atomic
from asr.tokenizer import SentencePieceTokenizer, load_tokenizer, train_tokenizer

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


# ---------------------------------------------------------------------------------------------
# the code itself: one way to load a model file, no shell, no unsafe deserializers


def calls(folder: Path):
    """(file, ast.Call) of every call in the Python files under `folder`."""
    for path in sorted(folder.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Call):
                yield path, node


def dotted(node: ast.AST) -> str:
    """"torch.load" for the callee `torch.load`, "" for anything not a plain dotted name."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = dotted(node.value)
        return f"{base}.{node.attr}" if base else ""
    return ""


def test_every_torch_load_is_weights_only():
    found = 0
    for folder in (ROOT / "asr", ROOT / "tools", ROOT / "recipes"):
        for path, call in calls(folder):
            if dotted(call.func) == "torch.load":
                found += 1
                flags = {k.arg: k.value for k in call.keywords}
                assert isinstance(flags.get("weights_only"), ast.Constant) and flags["weights_only"].value is True, \
                    f"{path}:{call.lineno}: torch.load without weights_only=True"
    assert found >= 1  # asr/checkpoint.py: the one loader of model files


UNSAFE = {
    "pickle.load", "pickle.loads", "pickle.Unpickler", "marshal.loads", "shelve.open", "torch.jit.load",
    "yaml.load", "yaml.unsafe_load", "yaml.full_load", "eval", "exec", "os.system", "os.popen",
    "subprocess.run", "subprocess.Popen", "subprocess.call", "subprocess.check_call", "subprocess.check_output",
}


def test_the_library_has_no_unsafe_loader_and_runs_no_shell():
    for path, call in calls(ROOT / "asr"):
        name = dotted(call.func)
        assert name not in UNSAFE, f"{path}:{call.lineno}: {name}"
        if name.endswith("np.load") or name.endswith("numpy.load"):
            flags = {k.arg: k.value for k in call.keywords}
            assert "allow_pickle" not in flags, f"{path}:{call.lineno}: np.load with allow_pickle"
    for path in (ROOT / "asr").rglob("*.py"):
        imports = {alias.name for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.Import)
                   for alias in node.names}
        assert not imports & {"pickle", "marshal", "shelve", "subprocess", "dill"}, path


# ---------------------------------------------------------------------------------------------
# crafted model files and checkpoints


class RunsCode:
    """Unpickling this calls os.system: the classic malicious checkpoint."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def crafted(folder: Path, marker: Path) -> dict[str, Path]:
    """Malicious files in every container torch.load accepts, with a valid-looking envelope."""
    folder.mkdir(parents=True, exist_ok=True)
    payload = {"format": "asr-model", "version": 1, "model": RunsCode(marker)}
    files = {"zip": folder / "zip.pt", "legacy": folder / "legacy.pt", "pickle": folder / "raw.pt"}
    torch.save(payload, files["zip"])
    torch.save(payload, files["legacy"], _use_new_zipfile_serialization=False)
    files["pickle"].write_bytes(pickle.dumps(payload, protocol=2))
    for ckpt in ("checkpoint", "checkpoint-zip"):
        payload = {"format": "asr-checkpoint", "version": 1, "state": RunsCode(marker)}
        files[ckpt] = folder / f"{ckpt}.pt"
        torch.save(payload, files[ckpt], _use_new_zipfile_serialization=ckpt.endswith("zip"))
    return files


@pytest.fixture
def asr_cli(capsys):
    with cli_session(capsys) as run:
        yield run


@pytest.fixture
def marker(tmp_path) -> Path:
    path = tmp_path / "MARKER"
    yield path
    assert not path.exists(), "code in a crafted file ran"


def test_crafted_pickles_are_refused_by_every_loader(tmp_path, marker):
    files = crafted(tmp_path / "evil", marker)
    for kind in ("zip", "legacy", "pickle"):
        for load in (load_file, asr.load_model):
            with pytest.raises(CheckpointError) as err:
                load(files[kind])
            message = str(err.value)
            assert message.startswith(f"{files[kind]}: refused: holds Python objects") and "\n" not in message
            assert "weights_only" not in message  # no advice to load it the unsafe way
    with pytest.raises(CheckpointError, match="refused"):
        load_file(files["checkpoint"], "asr-checkpoint")


def test_commands_refuse_crafted_files_in_one_line(tmp_path, marker, asr_cli):
    files = crafted(tmp_path / "evil", marker)
    sf.write(tmp_path / "a.wav", np.zeros(16000, np.float32), 16000)
    manifest = tmp_path / "m.jsonl"
    manifest.write_text(json.dumps({"id": "a", "audio": "a.wav", "duration": 1.0, "text": "A"}) + "\n")
    code, _, err = asr_cli("transcribe", "--model", files["zip"], tmp_path / "a.wav")
    assert code == 1 and err.startswith(f"asr transcribe: error: {files['zip']}: refused") and err.count("\n") == 1
    code, _, err = asr_cli("decode", "--model", files["legacy"], "--manifest", manifest, "--out-dir", tmp_path / "d")
    assert code == 1 and err.startswith(f"asr decode: error: {files['legacy']}: refused") and err.count("\n") == 1
    exp = tmp_path / "exp"
    (exp / "checkpoints").mkdir(parents=True)
    for step, kind in ((1, "checkpoint"), (2, "checkpoint-zip")):
        os.replace(files[kind], exp / "checkpoints" / f"ckpt-{step:08d}.pt")
    (exp / "checkpoints" / "index.json").write_text(json.dumps(
        [{"file": f"ckpt-{s:08d}.pt", "step": s, "epoch": 0, "valid_loss": 1.0} for s in (1, 2)]))
    code, _, err = asr_cli("average", "--exp-dir", exp, "--num", "2")
    assert code == 1 and err.startswith("asr average: error: ") and "ckpt-00000001.pt: refused" in err
    assert err.count("\n") == 1


@pytest.mark.parametrize(("make", "reason"), [
    (lambda p: p.write_text("hello, I am a README\n"), "not a file written by torch.save"),
    (lambda p: p.write_bytes(b""), "empty file (0 bytes)"),
    (lambda p: zipfile.ZipFile(p, "w").writestr("weights.bin", b"\x00" * 10), "a zip archive, but not one"),
    (lambda p: np.save(open(p, "wb"), np.zeros(3)), "a numpy array file"),
    (lambda p: p.mkdir(), "is a directory"),
    (lambda p: torch.save(torch.zeros(3), p), "not an asr-model file (no format field)"),
    (lambda p: torch.save({"format": "asr-model", "version": VERSION + 1}, p), "newer than this toolkit reads"),
    (lambda p: torch.save({"format": "asr-checkpoint", "version": 1}, p), "is an 'asr-checkpoint' file"),
], ids=["text", "empty", "zip", "numpy", "directory", "tensor", "newer", "checkpoint"])
def test_files_of_another_kind_get_one_clear_line(tmp_path, asr_cli, make, reason):
    path = tmp_path / "model.pt"
    make(path)
    with pytest.raises(CheckpointError) as info:
        load_file(path)
    message = str(info.value)
    assert message.startswith(f"{path}: ") and reason in message and "\n" not in message
    code, _, err = asr_cli("transcribe", "--model", path, tmp_path / "a.wav")
    assert code == 1 and err == f"asr transcribe: error: {message}\n"


def test_a_truncated_or_torchscript_model_file(tmp_path):
    model = write_model_file(tmp_path / "model.pt")
    (tmp_path / "cut.pt").write_bytes(model.read_bytes()[: model.stat().st_size // 2])
    with pytest.raises(CheckpointError, match="cut.pt: a damaged or truncated zip archive"):
        asr.load_model(tmp_path / "cut.pt")
    with pytest.warns(FutureWarning):  # torch.jit is deprecated, and still around
        torch.jit.save(torch.jit.script(torch.nn.Linear(2, 2)), tmp_path / "script.pt")
    with pytest.raises(CheckpointError, match="script.pt: a TorchScript archive"):
        asr.load_model(tmp_path / "script.pt")


# ---------------------------------------------------------------------------------------------
# model files whose parts do not agree, and tokenizers from users


def edited_model(tmp_path: Path, edit) -> Path:
    obj = torch.load(write_model_file(tmp_path / "model.pt"), weights_only=True)
    edit(obj)
    save_atomic(obj, tmp_path / "edited.pt")
    return tmp_path / "edited.pt"


@pytest.mark.parametrize(("edit", "reason"), [
    (lambda o: o["tokenizer"].update(tokens=list("ABCDEFGH ")[:-1] + ["A"]), "char tokenizer: duplicate tokens"),
    (lambda o: o["tokenizer"].update(tokens=list("ABCDEFG") + [7, " "]), "token 7 is not one character"),
    (lambda o: o.update(tokenizer={"kind": "bpe", "model": b"\x0a\x05garbage"}), "not a sentencepiece model"),
    (lambda o: o["tokenizer"].update(tokens=list("ABCDEFG ")), "a tokenizer of 11 tokens for a model of 12"),
    (lambda o: o["frontend"]["features"].update(n_mels=40), "40 mel bins in the frontend"),
    (lambda o: o["model"].update(encoder_layers=10**6), "model.encoder_layers = 1000000 is more than this toolkit"),
    (lambda o: o["model"].update(decoder_layers=3), "model.decoder_layers = 3 disagrees with the weights, which "
                                                     "hold 2 decoder layers"),
    (lambda o: o["model"].update(d_model=2**40, n_heads=1), "model.d_model = 1099511627776 is more than"),
    (lambda o: o["model"].update(ffn_dim=128), "model.ffn_dim = 128 disagrees with the weights ('encoder.layers.0."),
    (lambda o: o["model"].update(dropout="high"), "'model.dropout' must be a number"),
    (lambda o: o.pop("frontend"), "missing 'frontend'"),
    (lambda o: o["frontend"]["features"].update(frame_shift_ms=0.0625), "frame_shift_ms must be in [5, 100]"),
    (lambda o: o["state_dict"].update({"ctc.weight": torch.zeros(3)}), "'ctc.weight' is (3,) in the weights, (12, 32)"),
    (lambda o: o["state_dict"].pop("ctc.bias"), "weights do not fit the model: they lack 'ctc.bias'"),
    (lambda o: o["state_dict"].update({"extra": torch.zeros(1)}), "weights do not fit the model: they hold 'extra'"),
    (lambda o: o.update(state_dict=[1, 2]), "state_dict is not a dict of tensors"),
], ids=["duplicate-tokens", "non-char-token", "sentencepiece-bytes", "vocab-size", "n_mels", "layers", "layer-count",
        "d_model", "ffn_dim", "type", "frontend", "frame-shift", "shape", "missing", "extra", "not-tensors"])
def test_inconsistent_model_files_are_refused_before_use(tmp_path, edit, reason):
    path = edited_model(tmp_path, edit)
    with pytest.raises(CheckpointError) as err:
        asr.load_model(path)
    assert str(err.value).startswith(f"{path}: ") and reason in str(err.value) and "\n" not in str(err.value)


HUGE = {"d_model": 2048, "n_heads": 8, "ffn_dim": 8192}  # per layer ~50 M parameters: 200 MB of float32

LOAD_AND_MEASURE = """
import resource, sys
import asr
from asr.neural_lm import load_neural_lm
asr.load_model(sys.argv[1])  # what a load imports, in memory before measuring
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
for load, path in [(asr.load_model, p) for p in sys.argv[2:4]] + [(load_neural_lm, p) for p in sys.argv[4:]]:
    try:
        load(path)
        print("loaded", path)
    except Exception as e:
        print(type(e).__name__, str(e).replace(chr(10), "|"))
print("grew_mb", (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) // 1024)
"""


def test_small_file_cannot_ask_for_a_huge_model(tmp_path):
    """Model and LM files whose configs ask for gigabytes of network (the files: a few kB) are refused
    in one line naming the file and the config field, and loading them allocates nothing: the
    network is built on the meta device and compared with the weights first (its layer counts
    before even that). Measured in a fresh process: its peak memory grows by under 100 MB, where
    building these networks would take 1 to 3 GB."""
    from test_neural_lm import tiny_lm

    from asr.config import to_dict
    from asr.neural_lm import lm_file
    from asr.tokenizer import CharTokenizer

    obj = torch.load(write_model_file(tmp_path / "model.pt"), weights_only=True)
    files = [tmp_path / name for name in ("asr_weights.pt", "asr_none.pt", "lm_weights.pt", "lm_none.pt")]
    save_atomic(dict(obj, model=dict(obj["model"], **HUGE)), files[0])  # the tiny model's weights, 2 + 2 layers
    save_atomic(dict(obj, model=dict(obj["model"], encoder_layers=6, decoder_layers=6, **HUGE),
                     state_dict={f"w{i}": torch.zeros(1) for i in range(12)}), files[1])
    tokenizer = CharTokenizer(list("ABCDEFGH ")).to_dict()
    lm = tiny_lm(0, dtype=torch.float32)
    save_atomic(lm_file(model=dict(to_dict(lm.config), **HUGE), tokenizer=tokenizer, state_dict=lm.state_dict()),
                files[2])
    save_atomic(lm_file(model=dict(to_dict(lm.config), **HUGE, n_layers=12), tokenizer=tokenizer, state_dict={}),
                files[3])
    assert files[1].stat().st_size < 16_000 and files[3].stat().st_size < 4_000
    done = subprocess.run([sys.executable, "-c", LOAD_AND_MEASURE, str(tmp_path / "model.pt"), *map(str, files)],
                          capture_output=True, text=True,
                          timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr
    *lines, grew = done.stdout.splitlines()
    assert lines == [
        f"CheckpointError {files[0]}: model.d_model = 2048 disagrees with the weights "
        "('encoder.subsampling.out.weight' is (32, 152) in the weights, (2048, 152) for the config)",
        f"CheckpointError {files[1]}: model.encoder_layers = 6 disagrees with the weights, which hold 0 encoder layers",
        f"CheckpointError {files[2]}: model.d_model = 2048 disagrees with the weights "
        "('embed.weight' is (12, 32) in the weights, (12, 2048) for the config)",
        f"CheckpointError {files[3]}: model.n_layers = 12 disagrees with the weights, which hold 0 layers",
    ]
    assert int(grew.split()[1]) < 100, grew


def test_weights_are_the_files_own_tensors(tmp_path):
    """Loading gives the model the file's float32 tensors without a copy, keeps tied weights tied,
    and converts other float types to float32 as before."""
    path = write_model_file(tmp_path / "model.pt")
    model = asr.load_model(path).model
    obj = torch.load(path, weights_only=True)
    assert all(p.device.type == "cpu" and p.dtype == torch.float32 and not p.is_meta for p in model.parameters())
    assert all(torch.equal(model.state_dict()[k], v) for k, v in obj["state_dict"].items())
    obj["state_dict"] = {k: v.half() for k, v in obj["state_dict"].items()}
    save_atomic(obj, tmp_path / "half.pt")
    assert all(p.dtype == torch.float32 for p in asr.load_model(tmp_path / "half.pt").model.parameters())

    from test_neural_lm import save_lm, tiny_lm

    from asr.neural_lm import load_neural_lm

    loaded = load_neural_lm(save_lm(tmp_path / "lm.pt", tiny_lm(0, dtype=torch.float32))).model
    assert loaded.output.weight is loaded.embed.weight and loaded.config.tie_embeddings


def test_tokenizer_folders_from_users_are_checked(tmp_path):
    folder = tmp_path / "tok"
    train_tokenizer(["HELLO WORLD"] * 4, "bpe", 12).save(folder)
    meta = json.loads((folder / "tokenizer.json").read_text())
    (tmp_path / "secret").write_bytes(b"\x00" * 64)
    cases = [
        ({**meta, "model": "../secret"}, "'model' must name a file beside tokenizer.json"),
        ({"kind": "char", "tokens": ["A", "B", "A"]}, "duplicate tokens"),
        ({"kind": "char", "tokens": ["AB"]}, "not one character"),
        ({"kind": "words"}, "unknown tokenizer kind 'words'"),
        ([1, 2, 3], "unknown tokenizer kind None"),
    ]
    for content, reason in cases:
        (folder / "tokenizer.json").write_text(json.dumps(content))
        with pytest.raises(ValueError) as err:
            load_tokenizer(folder)
        assert str(err.value).startswith(f"{folder / 'tokenizer.json'}: ") and reason in str(err.value)
    (folder / "tokenizer.json").write_text(json.dumps(meta))
    (folder / "tokenizer.model").write_bytes((folder / "tokenizer.model").read_bytes()[:40])
    with pytest.raises(ValueError, match="tokenizer.json: not a tokenizer .not a sentencepiece model"):
        load_tokenizer(folder)


def test_mutated_sentencepiece_models_give_value_errors_or_work():
    """Random byte mutations of a real model: refused with ValueError, or a tokenizer that works."""
    import sys

    sys.path.insert(0, str(ROOT / "tools"))
    from reliability_report import mutate

    good = train_tokenizer(["HELLO WORLD", "GOOD MORNING", "SEE YOU SOON"] * 10, "bpe", 25).model_bytes
    outcomes = {"refused": 0, "works": 0}
    for i in range(300):
        data = mutate(good, np.random.default_rng([7, i]))
        try:
            tokenizer = SentencePieceTokenizer("bpe", data)
        except ValueError:
            outcomes["refused"] += 1
            continue
        tokenizer.decode(tokenizer.encode("HELLO ÜBER") + [3, 5, 7])
        tokenizer.count_unknown(["HELLO Ü"])
        outcomes["works"] += 1
    assert outcomes["refused"] > 100


# ---------------------------------------------------------------------------------------------
# configs and corpus lists


@pytest.mark.parametrize("tag", ["!!python/object/apply:os.system", "!!python/name:os.system",
                                 "!!python/object/new:subprocess.Popen"])
def test_configs_are_safe_yaml(tmp_path, marker, asr_cli, tag):
    manifest = tmp_path / "m.jsonl"
    manifest.write_text(json.dumps({"id": "a", "audio": "a.wav", "duration": 1.0, "text": "A"}) + "\n")
    (tmp_path / "evil.yaml").write_text(f"training:\n  lr: {tag} ['touch {marker}']\n")
    code, _, err = asr_cli("train", "--config", tmp_path / "evil.yaml", "--train", manifest, "--valid", manifest,
                           "--exp-dir", tmp_path / "exp")
    assert code == 1 and "evil.yaml:2: invalid YAML" in err and len(err.strip().splitlines()) == 1
    code, _, err = asr_cli("decode", "--model", tmp_path / "m.pt", "--manifest", manifest, "--out-dir", tmp_path,
                           "--config", tmp_path / "evil.yaml")
    assert code == 1 and "invalid YAML" in err
    code, _, err = asr_cli("decode", "--model", tmp_path / "m.pt", "--manifest", manifest, "--out-dir", tmp_path,
                           f"decoding.mode={tag} ['touch {marker}']")
    assert code == 1 and "decoding.mode" in err  # an override is YAML too: its text is kept as a string


@pytest.mark.parametrize("command", [
    "touch {marker} |",
    "flac -c -d -s a.flac; touch {marker} |",
    "sox a.wav -t wav - | touch {marker} |",
    "$(touch {marker}) |",
    "flac -c -d -s `touch {marker}` |",
])
def test_kaldi_pipes_never_run(tmp_path, marker, asr_cli, command):
    data = tmp_path / "data"
    data.mkdir()
    sf.write(tmp_path / "a.wav", np.zeros(16000, np.float32), 16000)
    (data / "wav.scp").write_text(f"a {command.format(marker=marker)}\n")
    code, _, err = asr_cli("prepare", "kaldi", data, tmp_path / "out.jsonl")
    assert code == 1 and f"{data / 'wav.scp'}:1: pipe not supported" in err and "Traceback" not in err


def test_device_files_and_fifos_as_audio_do_not_hang(tmp_path):
    """A manifest may name /dev/zero, /dev/urandom or a FIFO: refused at once, never read forever."""
    fifo = tmp_path / "fifo.wav"
    os.mkfifo(fifo)
    previous = signal.signal(signal.SIGALRM, lambda *_: pytest.fail("reading hung"))
    signal.alarm(20)
    try:
        for path in ("/dev/zero", "/dev/urandom", fifo):
            with pytest.raises(AudioError, match="empty file"):
                load_audio(path)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)

