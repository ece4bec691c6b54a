"""The measuring tools of issue 45 on the CPU: tools/bench_model.py's FLOP formula against torch's
FlopCounterMode, tools/gpu_check.py's batches, profile summary and dry run, and the device
scripts' dry run (tools/device_check.sh)."""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from asr.model import ModelConfig, build_model

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))  # the tools are scripts beside each other, not a package

import gpu_check  # noqa: E402
from bench_model import batch_forward_flops, forward_flops, position_flops, subsampling_flops  # noqa: E402

BASE = ModelConfig(vocab_size=31, n_mels=40, conv_channels=8, d_model=32, n_heads=4, ffn_dim=64, encoder_layers=2,
                   decoder_layers=2, dropout=0.0)
CONFIGS = {
    "transformer": BASE,
    "transformer with convolution block, own decoder ffn": dataclasses.replace(BASE, conv_kernel=7, decoder_ffn_dim=48),
    "conformer, own decoder ffn": dataclasses.replace(BASE, encoder="conformer", conv_kernel=7, decoder_ffn_dim=96),
}
if "interctc_layers" in {f.name for f in dataclasses.fields(ModelConfig)}:  # the CTC head on a middle layer too
    CONFIGS["conformer, intermediate CTC"] = dataclasses.replace(CONFIGS["conformer, own decoder ffn"],
                                                                 interctc_weight=0.5, interctc_layers=(1,))


def counted(config: ModelConfig, frames: list[int], tokens: list[int], *, backward: bool = False) -> int:
    """FlopCounterMode's FLOPs of the joint-loss forward (and backward) of a padded batch of
    utterances of `frames` feature frames and `tokens` targets, attention on its math path."""
    torch.manual_seed(0)
    model = build_model(config)
    feats = torch.randn(len(frames), max(frames), config.n_mels)
    targets = torch.randint(2, config.vocab_size - 1, (len(tokens), max(tokens)))
    counter = FlopCounterMode(display=False)
    with torch.set_grad_enabled(backward), sdpa_kernel(SDPBackend.MATH), counter:
        out = model(feats, torch.tensor(frames), targets, torch.tensor(tokens))
        if backward:
            out.loss.backward()
    return counter.get_total_flops()


# What the tolerances mean. FlopCounterMode counts matrix products (mm, addmm, bmm, baddbmm), the
# convolutions and the fused attention kernels it knows, 2 FLOPs per multiply-add; elementwise
# operations, softmax, norms, activations, GLU, dropout and the losses it does not count, and the
# formula leaves them out too. The forward must therefore agree exactly (rel 1e-9): any tolerance
# would hide a missing matrix product. On the CPU the fused attention kernel is not one it knows
# (it would count no attention products at all), hence the math path. The padded batch must agree
# exactly too: the Conformer's relative-position projection is made once per batch.
@pytest.mark.parametrize("name", CONFIGS)
def test_flop_formula_matches_flop_counter(one_thread, name):
    config = CONFIGS[name]
    for frames, tokens in [(97, 5), (230, 12)]:
        assert forward_flops(config, frames, tokens) == pytest.approx(counted(config, [frames], [tokens]), rel=1e-9)
    frames, tokens = [230, 97, 150], [12, 5, 9]
    padded = batch_forward_flops(config, frames, tokens, padded=True)
    assert padded == pytest.approx(counted(config, frames, tokens), rel=1e-9)
    useful = batch_forward_flops(config, frames, tokens)  # each at its own length, the projection once
    alone = sum(forward_flops(config, f, n) for f, n in zip(frames, tokens))
    s = [subsampling_flops(config, f)[1] for f in frames]
    once = config.encoder_layers * (position_flops(config, max(s)) - sum(position_flops(config, x) for x in s))
    assert useful == alone + once < padded
    assert (once < 0) == (config.encoder == "conformer")


# Training = 3 x forward in the formula (the backward pass costs two forwards). FlopCounterMode's
# count of forward + backward is a little under 3x on a model without a depthwise convolution (no
# gradient for the input features: the first convolution's backward is one product, not two; the
# embedding's backward is no matrix product): within [2.90, 3.00] x its forward. It cannot check a
# model with a depthwise convolution: its convolution backward ignores `groups`, so it counts a
# depthwise convolution's weight gradient d_model times over (the Conformer's training count of a
# d = 256 model comes out about twice the real one).
def test_training_flops_are_three_forwards_within_the_counters_backward(one_thread):
    frames, tokens = [230], [12]
    ratio = counted(BASE, frames, tokens, backward=True) / counted(BASE, frames, tokens)
    assert 2.90 <= ratio <= 3.00
    conv = CONFIGS["conformer, own decoder ffn"]
    assert counted(conv, frames, tokens, backward=True) / counted(conv, frames, tokens) > 3.0  # the overcount


def test_formula_counts_what_the_old_one_left_out():
    """The 100h Conformer's parts, by hand: the second macaron feed-forward, the relative positions,
    the convolution module and the decoder's own ffn width each add what they should."""
    conformer = ModelConfig(vocab_size=5002, encoder="conformer", d_model=256, n_heads=4, ffn_dim=1024,
                            decoder_ffn_dim=2048, encoder_layers=12, decoder_layers=6, conv_kernel=31)
    s, n, d = 299, 61, 256  # 12 s: 1,200 frames -> 299 encoder frames; 60 tokens + eos
    wide = dataclasses.replace(conformer, decoder_ffn_dim=4096)
    assert forward_flops(wide, 1200, 60) - forward_flops(conformer, 1200, 60) == 6 * 4 * n * d * 2048
    transformer = dataclasses.replace(conformer, encoder="transformer", conv_kernel=0)
    per_layer = (4 * s * d * 1024  # the second feed-forward
                 + 2 * (2 * s - 1) * d * d + 2 * s * (2 * s - 1) * d  # position projection, (q + v) P^T
                 + 2 * s * d * 2 * d + 2 * s * d * 31 + 2 * s * d * d)  # pointwise, depthwise, pointwise
    assert forward_flops(conformer, 1200, 60) - forward_flops(transformer, 1200, 60) == 12 * per_layer


def test_batches_are_never_reused_and_fit_the_cap():
    batches = gpu_check.sampler_batches(500.0, 60, seed=0)
    assert len(batches) == 60
    assert all(max(b) * len(b) <= 500.0 for b in batches)
    assert len({tuple(b) for b in batches}) == 60  # every step its own batch
    assert len({(len(b), round(max(b) * 100)) for b in batches}) > 40  # and nearly every one its own shape
    assert batches == gpu_check.sampler_batches(500.0, 60, seed=0)  # the same for every tree measured
    assert gpu_check.sampler_batches(2000.0, 5, seed=0) != gpu_check.sampler_batches(2000.0, 5, seed=1)


def test_profile_summary_per_step():
    E = gpu_check.ProfileEvent
    events = [
        E("aten::mm", False, 0, 100, 80), E("cudaLaunchKernel", False, 10, 15, 5),
        E("cudaStreamSynchronize", False, 100, 400, 300), E("cudaDeviceSynchronize", False, 900, 1000, 100),
        E("gemm_kernel", True, 50, 250, 0), E("gemm_kernel", True, 200, 300, 0), E("Memcpy DtoH", True, 350, 360, 0),
    ]
    p = gpu_check.summarize_profile(events, steps=2, wall_s=1e-3, own_syncs=1)
    assert p["gpu_ms_per_step"] == pytest.approx(0.26 / 2)  # union of 50-300 and 350-360 us
    assert p["gpu_busy"] == pytest.approx(0.26)
    assert p["host_wait_ms_per_step"] == pytest.approx(0.2) and p["host_ms_per_step"] == pytest.approx(0.3)
    assert p["op_cpu_ms_per_step"] == pytest.approx((485 - 400) / 2 / 1000)
    assert p["launches_per_step"] == 1 and p["launch_calls_per_step"] == 0.5 and p["host_syncs_per_step"] == 0.5
    assert [k["name"] for k in p["top_kernels"]] == ["gemm_kernel"] and p["top_kernels"][0]["calls_per_step"] == 1
    cpu = gpu_check.summarize_profile([E("aten::mm", False, 0, 100, 100)], steps=1, wall_s=1e-4)
    assert cpu["gpu_busy"] is None and cpu["launches_per_step"] is None and cpu["top_kernels"] == []


def test_gpu_check_dry_run_on_cpu(one_thread, tmp_path, capsys):
    out = tmp_path / "gpu_check.json"
    report = gpu_check.main(["--device", "cpu", "--config", str(ROOT / "conf/tiny.yaml"), "--batch-seconds", "6",
                             "--warmup", "1", "--steps", "1", "--profile-steps", "1", "--decode-batch", "2",
                             "--decode-batches", "1", "--decode-beam", "2", "--no-frontend", "--peak-tflops", "1",
                             "--label", "dry run", "--out", str(out)])
    saved = json.loads(out.read_text())
    assert saved == json.loads(json.dumps(report))
    run = saved["runs"][0]
    assert run["audio_s_per_s"] > 0 and run["mfu"] > 0 and run["steps"] == 1
    assert run["profile"]["top_cpu_ops"] and run["profile"]["gpu_busy"] is None
    assert saved["label"] == "dry run" and saved["asr"] == str(ROOT / "asr")
    assert saved["decoding"]["rtf"] > 0
    assert "top CPU operators" in capsys.readouterr().out


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_device_check_dry_run(tmp_path):
    """tools/device_check.sh --dry-run: every part on the CPU with conf/tiny.yaml, the summary last."""
    if not (ROOT / ".device/baseline/asr").is_dir():
        pytest.skip("no baseline tree: run bash tools/device_prepare.sh first")
    env = {**os.environ, "OUT": str(tmp_path), "PYTHON": sys.executable}
    done = subprocess.run(["bash", str(ROOT / "tools/device_check.sh"), "--dry-run"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=1900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert {"ours_100h", "base_100h"} <= set(summary["parts"])
    assert "this tree / baseline" in done.stdout


def test_count_syncs_names_the_line_each_sync_came_from(monkeypatch):
    """The sync-debug count of gpu_check says where each synchronization was reported (CUDA's
    warning stands in for a GPU here), and other warnings are not counted."""
    import warnings
    from collections import Counter

    mode = {"now": 0}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_sync_debug_mode", lambda: mode["now"])
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", lambda m: mode.update(now=0 if m == "default" else 1))

    def reads_twice():
        for _ in range(2):
            warnings.warn("called a synchronizing CUDA operation", UserWarning, stacklevel=1)
        warnings.warn("something else", UserWarning, stacklevel=1)

    sites, original = Counter(), warnings.showwarning
    assert gpu_check.count_syncs(reads_twice, sites) == 2
    assert mode["now"] == 0 and warnings.showwarning is original
    (site, n), = sites.items()
    assert n == 2 and site.startswith("test_bench_tools.py:") and "reads_twice" in site
