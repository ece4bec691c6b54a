"""`asr decode` as a library call: the files of the contract, resuming, the decoding configs."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import soundfile as sf
import torch
from test_api import speechlike, write_model_file

import asr.api
import asr.decode
from asr.config import ConfigError
from asr.decode import JOURNAL, decode_manifest, format_wer
from asr.decoding import DecodingConfig, DecodingOptions, load_decoding_config
from asr.manifest import ManifestError
from asr.sampler import greedy_batches, longest_first

CONF = Path(__file__).resolve().parents[1] / "conf" / "decode"
FAST = DecodingConfig(beam_size=4, batch_size=2, num_workers=0, device="cpu")
WER_KEYS = {"wer", "cer", "substitutions", "deletions", "insertions", "words", "utterances", "skipped"}


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> tuple[Path, Path]:
    """(model file, manifest of 6 utterances: 5 readable, 1 missing), listed out of id order."""
    folder = tmp_path_factory.mktemp("corpus")
    lines = []
    for i, seconds in enumerate([1.2, 2.5, 0.7, 1.9, 3.1]):
        sf.write(folder / f"u{i}.wav", speechlike(seconds, i), 16000)
        lines.append({"id": f"utt{4 - i}", "audio": f"u{i}.wav", "duration": seconds, "text": f"ab c{i} d"})
    lines.append({"id": "utt9", "audio": "gone.wav", "duration": 1.0, "text": "LOST WORDS"})
    manifest = folder / "test.jsonl"
    manifest.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return write_model_file(folder / "model.pt"), manifest


def read_table(path: Path) -> list[tuple[str, str]]:
    return [tuple((line.split(" ", 1) + [""])[:2]) for line in path.read_text().splitlines()]


def test_decode_writes_the_files_of_the_contract(corpus, tmp_path, capsys):
    model, manifest = corpus
    wer = decode_manifest(model, manifest, tmp_path / "dec", FAST)
    out = tmp_path / "dec"
    assert json.loads((out / "wer.json").read_text()) == wer
    assert WER_KEYS <= set(wer) and wer["utterances"] == 6 and wer["skipped"] == 1
    assert wer["words"] == 5 * 3 + 2 and wer["deletions"] >= 2  # the missing file: all deletions
    refs, hyps = read_table(out / "ref.txt"), read_table(out / "hyp.txt")
    ids = ["utt0", "utt1", "utt2", "utt3", "utt4", "utt9"]
    assert [i for i, _ in refs] == [i for i, _ in hyps] == ids
    assert refs[0] == ("utt0", "AB C4 D") and hyps[-1] == ("utt9", "")
    assert "WER" in (out / "errors.txt").read_text() and "utt9" in (out / "errors.txt").read_text()
    assert "real-time factor" in capsys.readouterr().err
    assert format_wer(wer).startswith("WER ") and "1 skipped" in format_wer(wer)


def test_an_interrupted_decode_resumes_where_it_stopped(corpus, tmp_path, monkeypatch, capsys):
    model, manifest = corpus
    decode_manifest(model, manifest, tmp_path / "fresh", FAST)
    decoded: list[str] = []
    original = asr.decode._decode_batch

    def interrupted(recognizer, task, batch):
        if decoded:
            raise KeyboardInterrupt
        decoded.extend(batch.ids)
        return original(recognizer, task, batch)

    monkeypatch.setattr(asr.decode, "_decode_batch", interrupted)
    with pytest.raises(KeyboardInterrupt):
        decode_manifest(model, manifest, tmp_path / "dec", FAST)
    assert len(decoded) == 2 and not (tmp_path / "dec" / "wer.json").exists()
    with open(tmp_path / "dec" / JOURNAL, "a") as f:
        f.write('{"id": "utt0", "te')  # a line cut short by the interruption

    def counting(recognizer, task, batch):
        decoded.extend(batch.ids)
        return original(recognizer, task, batch)

    monkeypatch.setattr(asr.decode, "_decode_batch", counting)
    wer = decode_manifest(model, manifest, tmp_path / "dec", FAST)
    assert "resuming, 2 of 6" in capsys.readouterr().err
    assert len(decoded) == 5 and len(set(decoded)) == 5  # the 3 readable others, none twice
    for name in ("hyp.txt", "ref.txt", "wer.json", "errors.txt"):
        assert (tmp_path / "dec" / name).read_text() == (tmp_path / "fresh" / name).read_text(), name
    assert wer["utterances"] == 6
    decoded.clear()
    decode_manifest(model, manifest, tmp_path / "dec", FAST)  # all done: nothing decoded again
    assert decoded == []
    decode_manifest(model, manifest, tmp_path / "dec", DecodingConfig(mode="greedy", num_workers=0))
    assert "other settings" in capsys.readouterr().err and len(decoded) == 5


@pytest.mark.parametrize("mode", ["greedy", "ctc_greedy", "ctc_rescore"])
def test_every_mode_decodes(corpus, tmp_path, mode):
    model, manifest = corpus
    config = DecodingConfig(mode=mode, beam_size=3, nbest=2 if mode == "ctc_rescore" else 1, num_workers=0)
    wer = decode_manifest(model, manifest, tmp_path, config)
    assert wer["utterances"] == 6 and wer["decoding"]["mode"] == mode
    records = [json.loads(line) for line in (tmp_path / JOURNAL).read_text().splitlines()[1:]]
    assert len(records) == 6 and all(len(r.get("nbest", [0, 0])) == 2 for r in records if not r.get("skipped"))


def test_a_broken_manifest_fails_before_decoding(corpus, tmp_path):
    model, manifest = corpus
    broken = tmp_path / "broken.jsonl"
    broken.write_text("".join(manifest.read_text().splitlines(keepends=True)[:2]) + '{"id": "x", "audio": \n')
    with pytest.raises(ManifestError, match=":3: "):
        decode_manifest(model, broken, tmp_path / "dec", FAST)
    assert not (tmp_path / "dec").exists()


def test_decoding_configs(tmp_path):
    with_lm = {"synth_open_lm"}  # presets that fuse an LM given on the command line, and refuse to run without it
    presets = {p.stem: load_decoding_config(str(p), ["decoding.lm=lm.arpa"] if p.stem in with_lm else [])
               for p in sorted(CONF.glob("*.yaml"))}
    for name in with_lm:
        assert presets[name].lm_fusion
        with pytest.raises(ConfigError, match="lm_fusion = True needs decoding.lm"):
            load_decoding_config(str(CONF / f"{name}.yaml"))
        assert load_decoding_config(str(CONF / f"{name}.yaml"), lm="lm.arpa") == presets[name]  # as --lm gives it
    assert {"default", "greedy", "ctc_greedy", "ctc_rescore"} <= set(presets)
    default = DecodingConfig()
    assert presets["default"] == default
    assert (default.mode, default.beam_size, default.ctc_weight) == ("attention", 10, 0.3)
    config = load_decoding_config(str(CONF / "default.yaml"), ["decoding.beam_size=4", "decoding.length_bonus=0.5"],
                                  mode="ctc_rescore", beam_size=None, ctc_weight=0.5, batch_size=None, device="cpu")
    assert (config.mode, config.beam_size, config.length_bonus, config.ctc_weight, config.device) == \
        ("ctc_rescore", 4, 0.5, 0.5, "cpu")
    assert config.decoding_options().beam_size == 4
    with pytest.raises(ConfigError, match="decoding.key=value"):
        load_decoding_config(None, ["beam_size=4"])
    with pytest.raises(ConfigError, match="unknown key 'beams'"):
        load_decoding_config(None, ["decoding.beams=4"])
    with pytest.raises(ConfigError, match="decoding.beam_size = 0"):
        load_decoding_config(None, [], beam_size=0)
    (tmp_path / "bad.yaml").write_text("mode: fast\n")
    with pytest.raises(ConfigError, match="bad.yaml.*decoding.mode = 'fast'"):
        load_decoding_config(str(tmp_path / "bad.yaml"))



def test_the_decoding_options_live_in_decoding_and_refuse_lm_options_without_an_lm(tmp_path):
    """DecodingConfig and its loader are asr.decoding's (what transcribe and serve import, without
    asr.decode); an LM option given on the command line without an LM is refused there, once for
    every command, while the same field in a preset (conf/decode/synth.yaml's lm_weight) is not."""
    assert DecodingConfig.__module__ == load_decoding_config.__module__ == "asr.decoding"
    for name, value in (("lm_weight", 0.5), ("lm_fusion", True), ("lm_word_bonus", 1.0)):
        with pytest.raises(ConfigError, match=f"^--{name.replace('_', '-')} needs --lm LM$"):
            load_decoding_config(None, [], **{name: value})
        assert getattr(load_decoding_config(None, [], lm="x.arpa", **{name: value}), name) == value
        assert getattr(load_decoding_config(None, ["decoding.lm=x.arpa"], **{name: value}), name) == value
    assert load_decoding_config(str(CONF / "synth.yaml"), lm_weight=None).lm_weight == 0.35
    with pytest.raises(ConfigError, match="lm_fusion.*needs decoding.lm"):
        load_decoding_config(None, ["decoding.lm_fusion=true"])


def test_the_thread_policy(monkeypatch):
    """asr.decoding.thread_policy decides the threads of every decoding run: --threads N sets torch's
    count for the process (every search on N threads); without it, torch's count is left alone and
    only a CPU search of at most FEW_ROWS rows runs on one thread (search_threads_for), the count
    restored after it."""
    from asr.decoding import FEW_ROWS, search_threads_for, thread_policy
    from asr.search import SearchOptions

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert thread_policy(None) == 1 and torch.get_num_threads() == 2
        memory = torch.zeros(2, 5, 4)  # (B, T, d) on the CPU
        for options, search_threads, inside in ((SearchOptions(beam_size=FEW_ROWS // 2), 1, 1),
                                                (SearchOptions(beam_size=FEW_ROWS // 2 + 1), 1, 2),
                                                (SearchOptions(mode="greedy", beam_size=FEW_ROWS), 1, 1),
                                                (SearchOptions(beam_size=2), None, 2)):
            with search_threads_for(search_threads, options, memory):
                assert torch.get_num_threads() == inside, options
            assert torch.get_num_threads() == 2
        assert thread_policy(1) is None and torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_the_commands_and_benchmarks_leave_the_thread_count_to_the_policy():
    """No decoding entry point sets torch's thread count itself: asr/ sets it in
    asr.decoding.thread_policy (and intra_op_threads under it) and for training (asr.distributed),
    and the decoding benchmarks call thread_policy."""
    root = Path(__file__).resolve().parents[1]
    setters = {p.relative_to(root).as_posix() for p in (root / "asr").rglob("*.py")
               if "set_num_threads" in p.read_text(encoding="utf-8")}
    assert setters == {"asr/decoding.py", "asr/distributed.py"}
    for tool in ("tools/bench_decode.py", "tools/bench_cpu_paths.py"):
        assert "thread_policy(" in (root / tool).read_text(encoding="utf-8"), tool


def test_decoding_batches_longest_first_with_a_count_cap():
    durations = [3.0, 10.0, 1.0, 2.0, 9.0, 2.5, 30.0]
    batches = greedy_batches(longest_first(durations), durations, 20.0, max_count=3)
    assert sorted(i for b in batches for i in b) == list(range(7))
    assert batches[0] == [6]  # longer than the cap: alone
    for b in batches:
        assert len(b) <= 3 and (len(b) == 1 or max(durations[i] for i in b) * len(b) <= 20.0)
        assert [durations[i] for i in b] == sorted((durations[i] for i in b), reverse=True)


@pytest.mark.parametrize("mode", ["attention", "greedy"])
def test_a_model_that_never_ends_stops_at_the_length_limit(tmp_path, mode):
    """A decoder whose eos never wins: every hypothesis stops at floor(max_len_ratio x encoder
    frames) tokens, through the API and through `asr decode`."""
    from asr.decoding import DecodingOptions

    model = write_model_file(tmp_path / "model.pt", eos_bias=-100.0)
    recognizer = asr.decode.load_model(model)
    options = DecodingOptions(mode=mode, beam_size=3, max_len_ratio=0.5)
    waves = [speechlike(seconds, i) for i, seconds in enumerate([0.8, 1.7])]
    feats = [recognizer.feats(torch.from_numpy(w)) for w in waves]
    frames = recognizer.model.encoder.subsampling.output_lengths(torch.tensor([f.shape[0] for f in feats]))
    found = recognizer.decode(feats, options)
    assert [len(nbest[0].tokens) for nbest in found] == [int(n) // 2 for n in frames]
    lines = []
    for i, wave in enumerate(waves):
        sf.write(tmp_path / f"{i}.wav", wave, 16000)
        lines.append(json.dumps({"id": f"u{i}", "audio": f"{i}.wav", "duration": len(wave) / 16000, "text": "A"}))
    (tmp_path / "m.jsonl").write_text("\n".join(lines) + "\n")
    config = DecodingConfig(mode=mode, beam_size=3, max_len_ratio=0.5, num_workers=0, device="cpu")
    decode_manifest(model, tmp_path / "m.jsonl", tmp_path / "out", config)
    hyps = [line.split(" ", 1)[1] for line in (tmp_path / "out" / "hyp.txt").read_text().splitlines()]
    assert all(0 < len(h.replace(" ", "")) <= int(n) // 2 for h, n in zip(hyps, frames))


def test_running_out_of_memory_splits_the_batch_then_skips_the_utterance(corpus, tmp_path, monkeypatch, caplog):
    """A batch that does not fit is decoded one utterance at a time; one that does not fit alone
    is an empty hypothesis, reported and counted, never a crash that every rerun would meet."""
    model, manifest = corpus
    fresh = decode_manifest(model, manifest, tmp_path / "fresh", FAST)
    original = asr.decode.DecodingTask.run

    def tight(self, feats):
        if len(feats) > 1:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")
        if feats[0].shape[0] > 300:  # the 3.1 s utterance (utt0)
            raise RuntimeError("[enforce fail at alloc_cpu.cpp:127] DefaultCPUAllocator: can't allocate memory")
        return original(self, feats)

    monkeypatch.setattr(asr.decode.DecodingTask, "run", tight)
    wer = decode_manifest(model, manifest, tmp_path / "dec", FAST)
    assert wer["skipped"] == fresh["skipped"] + 1 and wer["utterances"] == 6
    assert "ran out of memory; decoding them one at a time" in caplog.text
    assert "utt0: out of memory even alone" in caplog.text
    fresh_hyps = (tmp_path / "fresh" / "hyp.txt").read_text().splitlines()
    hyps = (tmp_path / "dec" / "hyp.txt").read_text().splitlines()
    assert hyps[0] == "utt0" and hyps[1:] == fresh_hyps[1:]

    def bug(self, feats):
        raise RuntimeError("mat1 and mat2 shapes cannot be multiplied (2x3 and 4x5)")

    monkeypatch.setattr(asr.decode.DecodingTask, "run", bug)  # a bug is not hidden as a skip
    with pytest.raises(RuntimeError, match="shapes cannot be multiplied"):
        decode_manifest(model, manifest, tmp_path / "bug", FAST)


def test_every_decoding_option_is_one_definition_reachable_by_key(tmp_path):
    """DecodingConfig declares the search's and the task's fields once (by inheritance), with one
    default (beam search), and decoding.key=value and YAML reach every one of them."""
    import dataclasses

    from asr.decoding import DecodingOptions
    from asr.search import SearchOptions

    names = [f.name for f in dataclasses.fields(DecodingConfig)]
    assert len(names) == len(set(names))
    assert {f.name for f in dataclasses.fields(SearchOptions)} <= {f.name for f in dataclasses.fields(DecodingOptions)}
    assert SearchOptions().mode == DecodingOptions().mode == DecodingConfig().mode == "attention"
    values = {"max_rate_factor": "3.5", "pre_beam_ratio": "2.0", "nbest": "2", "lm_word_bonus": "0.5"}
    config = load_decoding_config(None, [f"decoding.{k}={v}" for k, v in values.items()])
    assert (config.max_rate_factor, config.pre_beam_ratio, config.nbest, config.lm_word_bonus) == (3.5, 2.0, 2, 0.5)
    assert config.decoding_options() == DecodingOptions(max_rate_factor=3.5, pre_beam_ratio=2.0, nbest=2,
                                                        lm_word_bonus=0.5)
    (tmp_path / "rate.yaml").write_text("max_rate_factor: 0\nmode: greedy\n")
    assert load_decoding_config(str(tmp_path / "rate.yaml")).decoding_options().max_rate_factor == 0


def test_transcribe_reads_the_decoding_config_and_overrides(corpus, tmp_path, capsys):
    """`asr transcribe --config X.yaml ... decoding.key=value` decodes as the API does with those
    options; the small search runs on one thread without changing the process's thread count."""
    from asr import cli

    model, manifest = corpus
    audio = manifest.parent / "u1.wav"
    (tmp_path / "greedy.yaml").write_text("mode: greedy\nbatch_size: 4\n")
    threads = torch.get_num_threads()
    code = cli.main(["transcribe", "--model", str(model), "--config", str(tmp_path / "greedy.yaml"), str(audio),
                     "decoding.max_len_ratio=0.3", "decoding.max_rate_factor=0", "--device", "cpu"])
    assert code == 0 and torch.get_num_threads() == threads
    want = asr.api.load_model(model).transcribe(audio, mode="greedy")  # max_len_ratio 1: other lengths
    short = asr.api.load_model(model, options=DecodingOptions(mode="greedy", max_len_ratio=0.3,
                                                              max_rate_factor=0)).transcribe(audio)
    assert capsys.readouterr().out == f"{short[0].text}\n" and want[0].text != short[0].text
    assert cli.main(["transcribe", "--model", str(model), "decoding.beams=3", str(audio)]) == 1
    assert "unknown key 'beams'" in capsys.readouterr().err
