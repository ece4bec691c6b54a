"""tools/feed_rate.py: FLOPs counted on small models, the feed and worker arithmetic, the loaders
on real files, and the JSON written by a tiny run."""
from __future__ import annotations

import dataclasses
import json
import math
import sys
from pathlib import Path

import pytest

from asr.features import FeatureConfig
from asr.model import ModelConfig

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))  # the tools are scripts beside each other, not a package

import feed_rate  # noqa: E402
from bench_model import forward_flops  # noqa: E402

TINY = ModelConfig(vocab_size=31, n_mels=80, conv_channels=8, d_model=32, n_heads=4, ffn_dim=64,
                   encoder_layers=1, decoder_layers=1, dropout=0.0)


def test_counted_flops_equal_the_analytic_count_without_conformer_block(one_thread):
    flops = feed_rate.model_flops(TINY, 15.0, [2.0, 3.0])
    assert flops.forward > 0
    assert flops.forward == pytest.approx(flops.analytic, rel=1e-9)
    assert flops.training == pytest.approx(3 * flops.forward)
    frames, tokens = 300, 45
    assert flops.analytic == pytest.approx((forward_flops(TINY, 200, 30) + forward_flops(TINY, frames, tokens)) / 5)


def test_flops_grow_with_the_model_and_count_the_conformer_block(one_thread):
    base = feed_rate.model_flops(TINY, 15.0, [2.0]).forward
    wider = feed_rate.model_flops(dataclasses.replace(TINY, d_model=64, ffn_dim=128), 15.0, [2.0]).forward
    deeper = feed_rate.model_flops(dataclasses.replace(TINY, encoder_layers=2), 15.0, [2.0]).forward
    conformer = feed_rate.model_flops(dataclasses.replace(TINY, conv_kernel=15), 15.0, [2.0])
    assert base < wider and base < deeper
    assert conformer.forward > base
    assert conformer.analytic == pytest.approx(conformer.forward, rel=1e-9)  # bench_model's formula counts it too


def test_feed_and_workers_arithmetic():
    need = feed_rate.required_feed(5e9, 1000.0, 0.1)  # 10% of 1 PFLOP/s at 5 GFLOP per audio second
    assert need == pytest.approx(20000.0)
    assert feed_rate.workers_needed(need, 1000.0) == 20
    assert feed_rate.workers_needed(need, 999.0) == 21
    assert feed_rate.workers_needed(1.0, 1000.0) == 1
    assert feed_rate.mfu_ceiling(5e9, 1000.0, 1000.0, 20) == pytest.approx(0.1)
    assert feed_rate.DEVICES["h200"] == 989.0 and feed_rate.DEVICES["a100"] == 312.0


def test_training_configs_and_durations():
    names = [p.name for p in feed_rate.training_configs(ROOT / "conf")]
    assert {"librispeech_100h.yaml", "librispeech_960h.yaml", "tiny.yaml"} <= set(names)
    durations = feed_rate.flop_durations(4)
    assert durations == sorted(durations) and 8 < sum(durations) / 4 < 14  # LibriSpeech-like: mean about 12 s
    assert feed_rate.feature_label(FeatureConfig()) == "80 mels"
    assert feed_rate.feature_label(FeatureConfig(n_mels=40, dither=0.0)) == "40 mels, dither 0"


def test_tiny_run_writes_json(tmp_path, one_thread, capsys):
    out = tmp_path / "feed.json"
    report = feed_rate.main([str(ROOT / "conf/tiny.yaml"), "--files", "2", "--repeats", "1", "--durations", "1",
                             "--mfu", "10", "40", "--device", "a100", "--out", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(report))
    assert report["peak"]["tflops"] == 312.0
    rates = report["loading"]["audio_s_per_s"]
    augmented = {f"features + {a} (80 mels)" for a in ("noise", "reverb", "noise + reverb")}
    assert set(rates) == {"waveform", "waveform + sp", "features (80 mels)", "features + sp (80 mels)", *augmented}
    assert all(r > 0 for r in rates.values())
    assert all(a.noise.prob in (0.0, 1.0) and a.reverb.prob in (0.0, 1.0) and a.on_waves
               for a in feed_rate.AUGMENTS.values())  # every utterance augmented: the cost per augmented hour
    extra = report["loading"]["augment_core_s_per_audio_hour"]
    assert set(extra) == augmented
    for name in augmented:  # the extra core seconds an hour of audio takes, against the plain features
        assert extra[name] == pytest.approx(3600 / rates[name] - 3600 / rates["features (80 mels)"])
    tiny = report["configs"]["tiny.yaml"]
    for row in tiny["per_mfu"].values():
        assert row["required_audio_s_per_s"] == pytest.approx(row["mfu"] * 312e12 / tiny["training_flops_per_audio_s"])
        for kind, workers in row["workers"].items():
            assert workers == math.ceil(row["required_audio_s_per_s"] / tiny["per_worker_audio_s_per_s"][kind])
    assert "tiny.yaml" in capsys.readouterr().out


def test_real_files_from_a_folder_and_a_manifest(tmp_path, one_thread):
    utts = feed_rate.synthetic_utterances(tmp_path, 3)
    found = feed_rate.real_utterances(None, tmp_path, 2)
    assert len(found) == 2 and all(f.duration == pytest.approx(u.duration) for f, u in zip(found, utts[::2]))
    manifest = tmp_path / "m.jsonl"
    manifest.write_text("".join(json.dumps({"id": u.id, "audio": u.audio, "duration": u.duration, "text": u.text})
                                + "\n" for u in utts))
    assert [u.id for u in feed_rate.real_utterances(manifest, None, 5)] == [u.id for u in utts]
    rates = feed_rate.loader_rates(found, [FeatureConfig(n_mels=40)], repeats=1)
    assert {"waveform", "waveform + sp", "features (40 mels)", "features + sp (40 mels)"} <= set(rates)
