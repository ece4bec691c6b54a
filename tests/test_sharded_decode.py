"""`asr decode` in several processes (torchrun, gloo) and in bf16: the same files as one process,
resuming with another number of processes, and the precision option."""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import soundfile as sf
import torch
from small_models import SMALL
from test_api import TOKENS, speechlike, write_model_file
from torch.nn.utils.rnn import pad_sequence

import asr.decode
from asr import cli
from asr.checkpoint import model_file, save_atomic
from asr.config import ConfigError, to_dict
from asr.decode import JOURNAL, decode_manifest
from asr.decoding import DecodingConfig, DecodingOptions, load_decoding_config, resolve_precision
from asr.features import CMVNStats, FeatureConfig, GlobalCMVN, fbank
from asr.model import ASRModel
from asr.search import DecoderScorer
from asr.tokenizer import CharTokenizer

TORCHRUN = Path(sys.executable).parent / "torchrun"
OUTPUTS = ("hyp.txt", "ref.txt", "wer.json", "errors.txt")
# 9 utterances, 2 a batch: 5 batches, so 2 ranks get 3 and 2; one file is missing (a skipped record)
SECONDS = [1.2, 2.5, 0.7, 1.9, 3.1, 1.5, 0.9, 2.2]
DECODE = ["--beam-size", "3", "--batch-size", "2", "--device", "cpu", "decoding.num_workers=0"]

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py
needs_torchrun = pytest.mark.skipif(not TORCHRUN.exists(), reason="torchrun not found")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> tuple[Path, Path]:
    """(model file whose decoder writes something, manifest of 9 utterances: 8 readable, 1 missing)."""
    folder = tmp_path_factory.mktemp("corpus")
    lines = []
    for i, seconds in enumerate(SECONDS):
        sf.write(folder / f"u{i}.wav", speechlike(seconds, i), 16000)
        lines.append({"id": f"utt{i}", "audio": f"u{i}.wav", "duration": seconds, "text": f"ab c{i} he"})
    lines.append({"id": "lost", "audio": "gone.wav", "duration": 1.0, "text": "LOST WORDS"})
    manifest = folder / "test.jsonl"
    manifest.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return write_model_file(folder / "model.pt", eos_bias=0.0), manifest


@pytest.fixture(scope="module")
def one_process(corpus, tmp_path_factory) -> Path:
    """The folder of a whole one-process, one-thread decode of the corpus."""
    out = tmp_path_factory.mktemp("one")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert decode(corpus, out) == 0
    finally:
        torch.set_num_threads(threads)
    return out


def decode(corpus: tuple[Path, Path], out: Path, *extra: str) -> int:
    """`asr decode` of the corpus into `out` in this process."""
    model, manifest = corpus
    return cli.main(["decode", "--model", str(model), "--manifest", str(manifest), "--out-dir", str(out),
                     *extra, *DECODE])


def torchrun(corpus: tuple[Path, Path], out: Path, n: int, *,
             script: Path | None = None) -> subprocess.CompletedProcess:
    """`asr decode` of the corpus into `out` by `n` gloo ranks of one thread each (`script`: a
    Python file run instead of `-m asr.cli`, with the same arguments)."""
    model, manifest = corpus
    program = [str(script)] if script else ["-m", "asr.cli"]
    cmd = [str(TORCHRUN), "--standalone", "--nnodes", "1", "--nproc_per_node", str(n), *program, "decode",
           "--model", str(model), "--manifest", str(manifest), "--out-dir", str(out), *DECODE]
    return subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"},
                          timeout=300)


def journal(path: Path) -> tuple[dict, dict[str, dict]]:
    """(header, records by id) of a journal file."""
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    return lines[0]["header"], {r["id"]: r for r in lines[1:]}


def assert_same_files(a: Path, b: Path, names=OUTPUTS) -> None:
    for name in names:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name


@pytest.mark.slow
@needs_torchrun
def test_sharded_decode_equals_single_process(corpus, one_process, tmp_path):
    """2 ranks deal the one-process batches round-robin: the same outputs (and journal), byte for byte."""
    out = tmp_path / "two"
    run = torchrun(corpus, out, 2)
    assert run.returncode == 0, run.stderr[-3000:]
    assert_same_files(out, one_process, (*OUTPUTS, JOURNAL))
    assert sorted(p.name for p in out.iterdir()) == sorted([*OUTPUTS, JOURNAL])  # the ranks' journals merged
    assert run.stdout.count("WER ") == 1 and "by 2 processes" in run.stderr  # rank 0 reports



def decode_counting(corpus: tuple[Path, Path], out: Path) -> list[str]:
    """`decode(corpus, out)` in this process (it must succeed); the ids of the utterances it decoded."""
    decoded: list[str] = []
    original = asr.decode._decode_batch

    def counting(recognizer, task, batch):
        decoded.extend(batch.ids)
        return original(recognizer, task, batch)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(asr.decode, "_decode_batch", counting)
        assert decode(corpus, out) == 0
    return decoded

@pytest.mark.slow
@needs_torchrun
def test_a_resume_with_another_number_of_processes(corpus, one_process, tmp_path):
    """The journals a killed 3-rank job left (decode.jsonl, two ranks' journals, one cut short, one of
    other settings) resumed by 2 ranks and by 1 process: the journaled utterances are not decoded
    again, and both give the same files (those of a whole one-process run)."""
    header, records = journal(one_process / JOURNAL)
    other = {**header, "search": {**header["search"], "beam_size": 7}}
    kept = {**records["utt1"], "score": 12345.0}  # a score no decoding gives: shows it was not redone
    left = tmp_path / "left"
    left.mkdir()
    lines = {JOURNAL: [{"header": header}, records["utt0"], kept],
             "decode.rank0.jsonl": [{"header": header}, records["lost"]],
             "decode.rank2.jsonl": [{"header": header}, records["utt2"], records["utt3"]],
             "decode.rank1.jsonl": [{"header": other}, records["utt6"]]}
    for name, items in lines.items():
        (left / name).write_text("".join(json.dumps(r) + "\n" for r in items))
    with open(left / "decode.rank2.jsonl", "a") as f:
        f.write('{"id": "utt5", "te')  # cut short by the kill
    two, one = tmp_path / "two", tmp_path / "one"
    shutil.copytree(left, two)
    shutil.copytree(left, one)

    run = torchrun(corpus, two, 2)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "resuming, 5 of 9" in run.stderr and "other settings" in run.stderr
    decoded = decode_counting(corpus, one)
    assert sorted(decoded) == ["utt4", "utt5", "utt6", "utt7"]
    assert_same_files(two, one, (*OUTPUTS, JOURNAL))
    assert (two / "hyp.txt").read_text() == (one_process / "hyp.txt").read_text()
    assert sorted(p.name for p in two.iterdir()) == sorted([*OUTPUTS, JOURNAL])
    _, resumed = journal(two / JOURNAL)
    assert len(resumed) == 9 and resumed["utt1"]["score"] == 12345.0


@pytest.mark.slow
@needs_torchrun
def test_a_killed_sharded_run_resumes_in_one_process(corpus, one_process, tmp_path):
    """Rank 1 of 2 fails at its second batch (torchrun then stops rank 0): what the ranks
    journaled is kept, and one process decodes the rest only, to the files of a whole run."""
    script = tmp_path / "failing.py"
    script.write_text(textwrap.dedent("""\
        import os, sys
        import asr.decode
        from asr.cli import main

        original, seen = asr.decode._decode_batch, []

        def failing(recognizer, task, batch):
            seen.append(batch.ids)
            if os.environ["RANK"] == "1" and len(seen) == 2:
                raise RuntimeError("injected failure")
            return original(recognizer, task, batch)

        asr.decode._decode_batch = failing
        sys.exit(main(sys.argv[1:]))
        """))
    out = tmp_path / "dec"
    run = torchrun(corpus, out, 2, script=script)
    assert run.returncode != 0 and "injected failure" in run.stderr
    assert not (out / "wer.json").exists()
    journaled = {i for path in out.glob("decode.rank*.jsonl") for i in journal(path)[1]}
    assert journaled >= {"utt7", "utt3"}  # rank 1's first batch (the second longest pair)
    decoded = decode_counting(corpus, out)
    assert not journaled & set(decoded)  # none twice
    assert (journaled | set(decoded)) - {"lost"} == {f"utt{i}" for i in range(8)}
    assert_same_files(out, one_process)
    assert not list(out.glob("decode.rank*.jsonl"))


def test_one_gpu_named_for_several_processes_is_refused(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert asr.decode._rank_device("cuda") == "cuda:1" and asr.decode._rank_device("cpu") == "cpu"
    with pytest.raises(ValueError, match="names one GPU for 2 processes"):
        asr.decode._rank_device("cuda:0")


# ---------------------------------------------------------------------------------------------
# precision


def test_precision_is_a_decoding_option(tmp_path):
    assert DecodingConfig().precision == "auto"
    (tmp_path / "bf16.yaml").write_text("precision: bf16\n")
    assert load_decoding_config(str(tmp_path / "bf16.yaml")).decoding_options().precision == "bf16"
    assert load_decoding_config(None, ["decoding.precision=fp32"]).precision == "fp32"
    with pytest.raises(ConfigError, match="precision"):
        load_decoding_config(None, ["decoding.precision=fp16"])
    with pytest.raises(ValueError, match="decoding.precision = 'fp16'"):
        DecodingOptions(precision="fp16")


def test_auto_precision_is_bf16_only_on_gpus_that_have_it(monkeypatch):
    cpu, gpu = torch.device("cpu"), torch.device("cuda:0")
    assert resolve_precision("auto", cpu) == resolve_precision("fp32", cpu) == "fp32"
    assert resolve_precision("bf16", cpu) == "bf16"
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: True)
    assert resolve_precision("auto", gpu) == "bf16" and resolve_precision("fp32", gpu) == "fp32"
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: including_emulation)
    assert resolve_precision("auto", gpu) == "fp32" and resolve_precision("bf16", gpu) == "bf16"  # emulated
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: False)
    with pytest.raises(ValueError, match="does not support bf16"):
        resolve_precision("bf16", gpu)


def test_bf16_runs_through_on_the_cpu(corpus, tmp_path):
    """The fast suite's check of decoding.precision=bf16 (what it finds: the slow test below)."""
    (tmp_path / "bf16.yaml").write_text("precision: bf16\n")
    assert decode(corpus, tmp_path, "--mode", "greedy", "--config", str(tmp_path / "bf16.yaml")) == 0
    header, records = journal(tmp_path / JOURNAL)
    assert header["precision"] == "bf16" and len(records) == 9
    assert json.loads((tmp_path / "wer.json").read_text())["decoding"]["precision"] == "bf16"


@pytest.fixture(scope="module")
def overfit(tmp_path_factory) -> tuple[Path, Path]:
    """(model file of a small model trained on 4 utterances until it decodes them exactly, their manifest)."""
    folder = tmp_path_factory.mktemp("overfit")
    texts, seconds = ["AB HE", "CAFE", "BAD EGG", "HEAD"], [0.9, 1.3, 0.6, 1.1]
    features, tokenizer = FeatureConfig(n_mels=16), CharTokenizer(TOKENS)
    waves = [speechlike(s, i) for i, s in enumerate(seconds)]
    stats = CMVNStats()
    for wave in waves:
        stats.add(fbank(torch.from_numpy(wave), features))
    cmvn = GlobalCMVN(stats)
    feats = [cmvn(fbank(torch.from_numpy(wave), features)) for wave in waves]  # (T_i, 16) each
    ids = [torch.tensor(tokenizer.encode(t)) for t in texts]
    torch.manual_seed(0)
    model = ASRModel(dataclasses.replace(SMALL, vocab_size=tokenizer.vocab_size, encoder_layers=1, decoder_layers=1,
                                         lsm_weight=0.0, ctc_weight=0.5))
    batch = (pad_sequence(feats, batch_first=True), torch.tensor([f.size(0) for f in feats]),
             pad_sequence(ids, batch_first=True, padding_value=-1), torch.tensor([len(i) for i in ids]))
    optimizer = torch.optim.Adam(model.parameters(), lr=5e-3)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for _ in range(150):
            optimizer.zero_grad()
            model(*batch).loss.backward()
            optimizer.step()
    finally:
        torch.set_num_threads(threads)
    lines = []
    for i, (wave, text) in enumerate(zip(waves, texts)):
        sf.write(folder / f"u{i}.wav", wave, 16000)
        lines.append({"id": f"u{i}", "audio": f"u{i}.wav", "duration": len(wave) / 16000, "text": text})
    (folder / "train.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    save_atomic(model_file(model=to_dict(model.config), tokenizer=tokenizer.to_dict(),
                           frontend={"features": to_dict(features), "cmvn": stats.to_dict()},
                           state_dict=model.state_dict()), folder / "model.pt")
    return folder / "model.pt", folder / "train.jsonl"


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["attention", "ctc_rescore"])
def test_bf16_on_the_cpu_decodes_what_fp32_decodes(overfit, tmp_path, monkeypatch, capsys, mode):
    """precision auto on the CPU is fp32 (the Linear layers write fp32), bf16 runs the encoder and
    the search under bf16 autocast (they write bf16) while the decoder's log-probabilities that
    the beam scores add up stay fp32; the journal's header holds the precision, so bf16 after
    fp32 decodes again. Asserted: both precisions write the 4 transcripts the model was trained
    on (WER 0), hence the same hyp.txt. It would fail if the training did not reach them (the
    same in both precisions), or if bf16's rounding (about 0.4% of a logit) flipped a choice,
    which a model this sure of its outputs leaves nats of margin against."""
    model, manifest = overfit
    linear, scores = set(), set()
    load, score = asr.decode.load_model, DecoderScorer.score

    def hooked(*args, **kwargs):
        recognizer = load(*args, **kwargs)
        for m in recognizer.model.modules():
            if isinstance(m, torch.nn.Linear):
                m.register_forward_hook(lambda m, i, o: linear.add(o.dtype))
        return recognizer

    def recording(self, state, last_tokens):
        log_probs, state = score(self, state, last_tokens)
        scores.add(log_probs.dtype)
        return log_probs, state

    monkeypatch.setattr(asr.decode, "load_model", hooked)
    monkeypatch.setattr(DecoderScorer, "score", recording)
    hyps = {}
    for precision, want in (("auto", torch.float32), ("bf16", torch.bfloat16)):
        linear.clear()
        config = DecodingConfig(mode=mode, beam_size=3, num_workers=0, device="cpu", precision=precision)
        wer = decode_manifest(model, manifest, tmp_path, config)
        assert linear == {want} and wer["wer"] == 0.0 and wer["decoding"]["precision"] == precision
        header, records = journal(tmp_path / JOURNAL)
        assert header["precision"] == ("fp32" if precision == "auto" else "bf16") and len(records) == 4
        hyps[precision] = (tmp_path / "hyp.txt").read_text()
    err = capsys.readouterr().err
    assert "other settings" in err and "bf16 autocast on cpu" in err and "resuming" not in err
    assert hyps["bf16"] == hyps["auto"]
    assert scores == ({torch.float32} if mode == "attention" else set())


@pytest.mark.parametrize(("device", "local_rank", "expected"), [
    ("cuda", 0, "cuda:0"), ("cuda", 3, "cuda:3"), ("cuda:1", 3, "cuda:1"), ("cpu", 2, "cpu")])
def test_a_device_without_an_index_is_the_local_ranks_gpu(device, local_rank, expected):
    """`--device cuda` names cuda:LOCAL_RANK (torch.cuda.set_device refuses a device without an
    index: `asr decode --device cuda` failed on a GPU machine before)."""
    from asr.distributed import process_device

    assert process_device(device, local_rank) == torch.device(expected)
