"""The peer benchmark's harness (tools/bench_peers) on our side alone: ESPnet and SpeechBrain are
not installed here (they live in the venv of tools/bench_peers/setup.sh), so these tests run our
adapter on a small model, the workload, the equal-work length rule, and the table / JSON writer."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pytest
import soundfile as sf
import torch

from asr.model import ModelConfig
from asr.model.subsampling import conv_output_length
from asr.search import max_lengths

BENCH = Path(__file__).resolve().parents[1] / "tools" / "bench_peers"
sys.path.insert(0, str(BENCH))  # the benchmark's modules are scripts beside each other, not a package

import bench  # noqa: E402
import report  # noqa: E402
import spec  # noqa: E402
import workload  # noqa: E402
from ours import Ours  # noqa: E402

SMALL = ModelConfig(vocab_size=spec.VOCAB, n_mels=spec.N_MELS, conv_channels=8, d_model=32, n_heads=4, ffn_dim=64,
                    encoder_layers=1, decoder_layers=1)


def test_forced_lengths_are_our_max_len_ratio_cut():
    frames = torch.arange(0, 1200, 7)
    assert torch.equal(spec.encoder_frames(frames).clamp(min=0), conv_output_length(frames, 4))
    enc = conv_output_length(frames, 4)
    assert torch.equal(spec.forced_lengths(frames).clamp(min=0), max_lengths(enc, spec.TOKENS_PER_FRAME))


def test_workload_inputs():
    utts = workload.decode_utterances(3, (1.0, 2.0))
    assert utts.feats.shape == (3, int(utts.frames.max()), spec.N_MELS)
    for feats, n in zip(utts.feats, utts.frames.tolist()):
        assert feats[n:].abs().sum() == 0 and feats[:n].abs().sum() > 0
    one = utts.subset(1, 2)
    assert one.feats.shape[1] == int(one.frames[0]) and torch.equal(one.lengths, utts.lengths[1:2])
    batch = workload.train_batch(2, 1.0, 7.5)
    assert batch.tokens.shape == (2, 8) and int(batch.tokens.min()) >= 2 and int(batch.tokens.max()) < spec.EOS


def test_wavs_have_their_durations(tmp_path):
    files = workload.write_wavs(tmp_path, 2, (0.5, 1.0))
    for f in files:
        info = sf.info(f.path)
        assert info.samplerate == spec.SAMPLE_RATE and abs(info.frames / info.samplerate - f.seconds) < 1e-3


def test_full_size_model_has_the_baseline_parameter_count():
    with torch.device("meta"):
        counts = Ours().parameters()
    assert counts["encoder"] + counts["decoder"] == 27_246_380


@pytest.mark.parametrize("ctc_weight", [0.0, 0.3])
def test_our_side_decodes_exactly_the_forced_lengths(one_thread, ctc_weight):
    utts = workload.decode_utterances(3, (1.0, 2.0))
    found = bench.decode_all(Ours(SMALL), [utts, utts.subset(0, 1)], 3, ctc_weight)
    assert [len(h) for h in found] == [*utts.lengths.tolist(), int(utts.lengths[0])]


def test_run_writes_table_and_json_for_our_side(one_thread, tmp_path, capsys):
    args = bench.parse_args(["--quick", "--toolkits", "ours", "--variants", "none", "--out", str(tmp_path / "r.json")])
    args = argparse.Namespace(**{**vars(args), "utts": 2, "alone": 1, "train_utts": 1, "train_seconds": 1.0,
                                 "files": 2, "threads": 1})
    result = bench.run(args, kits=[Ours(SMALL)])
    report.write_json(args.out, result)
    saved = json.loads(args.out.read_text())
    tasks = [row["task"] for row in saved["rows"]]
    assert tasks == ["decode"] * 4 + ["train step", "data"]
    assert all(row["toolkits"]["ours"]["equal_work"] for row in saved["rows"])
    assert saved["environment"]["threads"] == 1 and saved["workload"]["decode_repeats"] == 1
    out = capsys.readouterr().out
    assert "beam 10 + CTC 0.3, batch 2" in out and "audio-s/s" in out


def test_our_fast_paths_get_rows_at_batch_1_and_32(one_thread, tmp_path, capsys):
    """--variants: our int8 model and the exported one (float32 and int8 graphs) decode the same
    inputs to exactly the forced lengths, each with a row after every decoding setting's own."""
    pytest.importorskip("onnxruntime")
    args = bench.parse_args(["--quick", "--toolkits", "ours", "--tasks", "decode", "--variants", "int8,onnx,onnx-int8",
                             "--out", str(tmp_path / "r.json")])
    args = argparse.Namespace(**{**vars(args), "utts": 2, "alone": 1, "threads": 1})
    result = bench.run(args, kits=[Ours(SMALL)])
    settings = [row["setting"] for row in result["rows"]]
    assert len(settings) == 4 * 4 and result["workload"]["variants"] == ["int8", "onnx", "onnx-int8"]
    for batch in (1, 2):
        for variant in ("int8", "onnx", "onnx-int8"):
            assert f"beam 10 + CTC 0.3, batch {batch}, ours {variant}" in settings
    for row in result["rows"]:
        assert row["toolkits"]["ours"]["equal_work"], row["setting"]
        assert ("variant" in row) == ("over_fp32" in row) == (", ours " in row["setting"])
    assert "batch 1, ours onnx-int8" in capsys.readouterr().out


def test_a_variant_that_cannot_be_built_is_left_out(monkeypatch, capsys):
    import ours_fast

    def broken(name, ours):
        raise ImportError("no onnxruntime")
    monkeypatch.setattr(ours_fast, "variant", broken)
    assert bench.load_variants([Ours(SMALL)], "onnx") == []
    assert "no 'ours onnx' rows (ImportError: no onnxruntime)" in capsys.readouterr().err
    assert bench.load_variants([Ours(SMALL)], "none") == [] and bench.load_variants([], "int8") == []


def test_summary_ratios_and_table():
    times = {"ours": [1.0, 3.0, 2.0], "espnet": [4.0, 4.0, 5.0], "speechbrain": [1.0, 1.0, 1.0]}
    row = report.summarize("decode", "beam 10, batch 32", "utt/s", 32, times, {"speechbrain": False})
    assert row["toolkits"]["ours"]["median_s"] == 2.0 and row["toolkits"]["ours"]["rate"] == 16.0
    assert row["ours_over"] == {"espnet": 2.0, "speechbrain": 0.5}
    table = report.format_table([row], ["ours", "espnet", "speechbrain"])
    header, line = table.splitlines()
    assert header.split()[-2:] == ["ours/espnet", "ours/speechbrain"]
    assert line.split()[-3:] == ["(!)", "2.00x", "0.50x"]  # speechbrain's rate flagged: not equal work
    params = {"ours": {"subsampling": 1, "encoder": 10, "decoder": 5, "ctc": 2, "total": 17},
              "espnet": {"subsampling": 1, "encoder": 11, "decoder": 5, "ctc": 2, "total": 18}}
    assert report.format_parameters(params).splitlines()[2].split()[-2:] == ["16", "+1"]
