"""Benchmark the model on this machine: training throughput and decoder step time. Prints tables,
writes JSON.

    python tools/bench_model.py                                   # synth + librispeech_100h, CPU
    python tools/bench_model.py --configs conf/librispeech_100h.yaml --device cuda --out exp/bench_gpu.json

1. Forward + backward of the joint loss on a batch of equal-length utterances (no padding):
   seconds of audio per second, and achieved GFLOP/s. The FLOP count (see `forward_flops`) is
   2 per multiply-add of every convolution and matrix product of the model: the subsampling; in
   each encoder layer the attention projections, scores and weighted sums, the feed-forward(s)
   (a Conformer's two macaron ones), the Conformer's relative-position projection and position
   scores (q + v) P^T, and the convolution module (pointwise convolutions and the depthwise one);
   in each decoder layer causal self-attention (counted in full), cross-attention and the
   feed-forward at the decoder's own width (decoder_ffn_dim); the output layer and the CTC head
   (again on each intermediate CTC layer).
   Left out: norms, softmax, activations, GLU, dropout, the losses and the optimizer (elementwise
   work, which torch's FlopCounterMode does not count either). Training = 3 x forward (the
   backward pass costs two forwards; FlopCounterMode's count of a backward is a little under 2x:
   no gradient for the input features or the embedding lookup). It equals FlopCounterMode on the
   forward with attention held to its math path (tests/test_bench_tools.py), which on the CPU
   would otherwise skip the attention products inside the fused kernel.
2. The decoder's cached step (eval, no autograd) for B utterances x N hypotheses at positions
   10, 50 and 100, every row continuing a random row of its utterance at every step (the worst
   case for the cache: beam search moves few rows and tells the cache which), with the
   preallocated cache of asr/model/decoder.py and, for comparison, a cache appended with torch.cat.

Tokenizers assumed: characters for tiny/synth (V 31, 15 tokens per second), BPE for
librispeech_* (V 300, 5 tokens per second).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import time
from pathlib import Path

import torch
import yaml

from asr.config import from_dict
from asr.model import ASRModel, ModelConfig, MultiHeadAttention, build_model
from asr.model.decoder import DecoderCache
from asr.model.subsampling import LAYERS, conv_output_length
from asr.tokens import FIRST_TOKEN, sos_id

ROOT = Path(__file__).resolve().parents[1]
FRAMES_PER_SECOND = 100  # feature frames per second: the default frontend's 10 ms frames


def load(path: Path) -> tuple[ModelConfig, float]:
    """The model config of `path` with the vocabulary of its assumed tokenizer, and its token rate."""
    config = from_dict(ModelConfig, yaml.safe_load(path.read_text())["model"], source=str(path), prefix="model.")
    vocab, rate = (300, 5.0) if path.name.startswith("librispeech") else (31, 15.0)
    return dataclasses.replace(config, vocab_size=vocab), rate


def forward_flops(c: ModelConfig, frames: int, tokens: int) -> int:
    """FLOPs of one utterance's forward, alone: `frames` input frames, `tokens` targets (+ sos / eos).

    2 per multiply-add of every matrix product and convolution of asr/model (see the module
    docstring): the subsampling, each encoder layer (`encoder_layer_flops`), each decoder layer
    (`decoder_layer_flops`), the decoder's output layer and the CTC head. In a batch the relative
    position projection is made once for all utterances (`position_flops`; `batch_forward_flops`)."""
    total, s = subsampling_flops(c, frames)
    n = tokens + 1
    layers = c.encoder_layers * encoder_layer_flops(c, s) + c.decoder_layers * decoder_layer_flops(c, s, n)
    ctc_heads = 1 + len(getattr(c, "interctc_layers", ()))  # the CTC head on the last layer and on each
    # intermediate CTC layer (a field 37a736d's ModelConfig lacks)
    heads = 2 * n * c.d_model * c.vocab_size + ctc_heads * 2 * s * c.d_model * c.vocab_size  # decoder output + CTC
    return total + layers + heads


def subsampling_flops(c: ModelConfig, frames: int) -> tuple[int, int]:
    """(FLOPs of the conv2d subsampling of `frames` frames, the encoder frames s it leaves)."""
    t, f, channels, total = frames, c.n_mels, 1, 0
    for kernel, stride in LAYERS[c.subsampling]:  # valid convolutions
        t, f = (t - kernel) // stride + 1, (f - kernel) // stride + 1
        total += 2 * c.conv_channels * channels * kernel * kernel * t * f
        channels = c.conv_channels
    return total + 2 * t * channels * f * c.d_model, t  # + the linear map to d_model


def encoder_layer_flops(c: ModelConfig, s: int) -> int:
    """One encoder layer over s frames. Transformer: self-attention (q, k, v and output projections;
    scores QK^T and the weighted sum of V), one feed-forward, the convolution module when
    conv_kernel > 0. Conformer: two (macaron) feed-forwards of ffn_dim each, the relative-position
    self-attention (also the position projection of the 2s - 1 relative encodings and the
    position scores (q + v) P^T over them, before the shift), the convolution module."""
    d, f = c.d_model, c.ffn_dim
    attention = 2 * s * d * 4 * d + 4 * s * s * d
    ffn = 4 * s * d * f
    if c.encoder == "conformer":
        relative = position_flops(c, s) + 2 * s * (2 * s - 1) * d
        return attention + relative + 2 * ffn + conv_module_flops(c, s)
    return attention + ffn + (conv_module_flops(c, s) if c.conv_kernel > 0 else 0)


def conv_module_flops(c: ModelConfig, s: int) -> int:
    """The convolution module over s frames: pointwise d -> 2d (GLU after it), depthwise over time
    (kernel conv_kernel, one multiply-add per tap and channel), pointwise d -> d."""
    d = c.d_model
    return 2 * s * d * 2 * d + 2 * s * d * c.conv_kernel + 2 * s * d * d


def position_flops(c: ModelConfig, s: int) -> int:
    """The conformer's projection of the 2s - 1 relative encodings in one layer (bias-free d x d):
    made once per batch at its padded length, not per utterance; 0 for a transformer."""
    return 2 * (2 * s - 1) * c.d_model * c.d_model if c.encoder == "conformer" and s > 0 else 0


def decoder_layer_flops(c: ModelConfig, s: int, n: int) -> int:
    """One decoder layer over n positions and s memory frames: causal self-attention (counted in
    full, as the kernels compute it), cross-attention (query and output projections over n, key and
    value projections over s, scores and weighted sum n x s), the feed-forward of the decoder's own
    width (decoder_ffn_dim, else ffn_dim)."""
    d, f = c.d_model, c.decoder_ffn_dim or c.ffn_dim
    self_attn = 2 * n * d * 4 * d + 4 * n * n * d
    cross = 2 * n * d * 2 * d + 2 * s * d * 2 * d + 4 * n * s * d
    return self_attn + cross + 4 * n * d * f


def batch_forward_flops(c: ModelConfig, frames: list[int], tokens: list[int], *, padded: bool = False) -> int:
    """FLOPs of a batch's forward. Useful work (padded False): each utterance at its own length, the
    relative-position projection (made once for the batch) counted once, at the batch's length;
    padded: what the padded batch computes (B x the longest frames and tokens)."""
    shared = position_flops(c, subsampling_flops(c, max(frames))[1]) * c.encoder_layers
    if padded:
        frames, tokens = [max(frames)] * len(frames), [max(tokens)] * len(tokens)
    own = sum(forward_flops(c, f, n) - c.encoder_layers * position_flops(c, subsampling_flops(c, f)[1])
              for f, n in zip(frames, tokens))
    return own + shared


def bench_training(model: ASRModel, rate: float, *, batch: int, seconds: float, iters: int,
                   device: torch.device, dtype: torch.dtype | None) -> dict:
    frames, tokens = int(seconds * FRAMES_PER_SECOND), round(seconds * rate)
    g = torch.Generator().manual_seed(0)
    feats = torch.randn(batch, frames, model.config.n_mels, generator=g).to(device)
    feat_lens = torch.full((batch,), frames, device=device)
    targets = torch.randint(FIRST_TOKEN, sos_id(model.config.vocab_size), (batch, tokens), generator=g).to(device)
    target_lens = torch.full((batch,), tokens, device=device)
    model.train()
    times = []
    for i in range(iters + 1):  # the first is warm-up
        _sync(device)
        start = time.perf_counter()
        model.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
            loss = model(feats, feat_lens, targets, target_lens).loss
        loss.backward()
        _sync(device)
        if i:
            times.append(time.perf_counter() - start)
    step = min(times)  # the least disturbed by other processes
    flops = 3 * batch_forward_flops(model.config, [frames] * batch, [tokens] * batch)
    return {"batch": batch, "seconds_per_utt": seconds, "tokens_per_utt": tokens, "step_s": step,
            "audio_s_per_s": batch * seconds / step, "gflop_per_step": flops / 1e9, "gflop_per_s": flops / step / 1e9}


class AppendedCache(DecoderCache):
    """The alternative measured against: keys and values appended with torch.cat at every step."""

    def reorder(self, rows: torch.Tensor) -> DecoderCache:
        self.self_kv = self.self_kv.index_select(2, rows)
        return self

    def position_encoding(self) -> torch.Tensor:
        return self.positions[self.length:self.length + 1]  # (the table is made for every step)

    def attend_self(self, layer: int, attention: MultiHeadAttention, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        if layer == 0:
            self.grown = []
        grown = torch.cat([self.self_kv[layer], kv.permute(2, 0, 1, 3, 4)], dim=2)  # (2, R, t + 1, H, dh)
        self.grown.append(grown)
        if layer == self.self_kv.size(0) - 1:
            self.self_kv = torch.stack(self.grown)
        return attention.attend(q, grown[0].transpose(1, 2), grown[1].transpose(1, 2))

    def advance(self, last_tokens: torch.Tensor) -> None:
        self.length += 1


@torch.inference_mode()
def bench_steps(model: ASRModel, *, utterances: int, beam: int, frames: int, positions: list[int], appended: bool,
                device: torch.device, repeats: int = 2) -> dict[int, float]:
    """Step time (ms) at each position: the median of the 5 steps around it, the best of `repeats`
    decodings (reordering every step)."""
    runs = [_decode_once(model, utterances=utterances, beam=beam, frames=frames, steps=max(positions) + 3,
                         appended=appended, device=device) for _ in range(repeats)]
    return {p: 1e3 * min(statistics.median(times[p - 2:p + 3]) for times in runs) for p in positions}


def _decode_once(model: ASRModel, *, utterances: int, beam: int, frames: int, steps: int, appended: bool,
                 device: torch.device) -> list[float]:
    """Seconds of each of `steps` decoder steps (with a reorder each) of random memory."""
    model.eval()
    rows = utterances * beam
    memory = torch.randn(utterances, frames, model.config.d_model, device=device)
    memory_lens = torch.full((utterances,), frames, device=device)
    cache = model.decoder.init_cache(memory, memory_lens, rows=rows, capacity=steps)
    if appended:
        cache = AppendedCache(cache.self_kv[:, :, :, :0], cache.memory_kv, cache.memory_mask, cache.positions,
                              cache.inputs)
    last = torch.full((rows,), model.config.sos, device=device)
    base = torch.arange(rows, device=device) // beam * beam  # first row of each row's utterance
    times = []
    for _ in range(steps):
        _sync(device)
        start = time.perf_counter()
        cache = cache.reorder(base + torch.randint(0, beam, (rows,), device=device))
        log_probs, cache = model.decoder.step(last, cache)
        last = log_probs.argmax(dim=-1)
        _sync(device)
        times.append(time.perf_counter() - start)
    return times


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", nargs="+", type=Path,
                        default=[ROOT / "conf/synth.yaml", ROOT / "conf/librispeech_100h.yaml"])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--batch", type=int, default=8, help="utterances per training batch")
    parser.add_argument("--seconds", type=float, default=10.0, help="duration of each utterance")
    parser.add_argument("--iters", type=int, default=3, help="timed training steps after one warm-up (the best counts)")
    parser.add_argument("--bf16", action="store_true", help="train under bf16 autocast")
    parser.add_argument("--beam", type=int, default=10)
    parser.add_argument("--decode-batches", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--positions", type=int, nargs="+", default=[10, 50, 100])
    parser.add_argument("--out", type=Path, default=ROOT / "exp/bench_model.json")
    args = parser.parse_args()
    device = torch.device(args.device)
    report = {"device": str(device), "threads": torch.get_num_threads(), "torch": torch.__version__, "bf16": args.bf16,
              "load_average": os.getloadavg(), "configs": {}}
    print(f"device {device}, {torch.get_num_threads()} threads, load average {os.getloadavg()[0]:.1f}, "
          f"training in {'bf16 autocast' if args.bf16 else 'fp32'}")
    print(f"\n{'config':<24}{'params':>9}{'batch':>7}{'step s':>9}{'audio s/s':>11}{'GFLOP/step':>12}{'GFLOP/s':>9}")
    for path in args.configs:
        config, rate = load(path)
        torch.manual_seed(0)
        model = build_model(config).to(device)
        params = sum(p.numel() for p in model.parameters())
        train = bench_training(model, rate, batch=args.batch, seconds=args.seconds, iters=args.iters, device=device,
                               dtype=torch.bfloat16 if args.bf16 else None)
        print(f"{path.name:<24}{params / 1e6:>8.2f}M{train['batch']:>7}{train['step_s']:>9.2f}"
              f"{train['audio_s_per_s']:>11.1f}{train['gflop_per_step']:>12.1f}{train['gflop_per_s']:>9.1f}")
        report["configs"][path.name] = {"params": params, "vocab_size": config.vocab_size, "train": train,
                                        "decoder_step_ms": {}}
    header = "".join(f"{'t=' + str(p):>9}" for p in args.positions)
    print(f"\ndecoder step, ms (beam {args.beam}, memory of {args.seconds:g} s, hypotheses reordered every step)")
    print(f"{'config':<24}{'B x N':>9}{'cache':>14}{header}{'t_last/t_first':>16}")
    for path in args.configs:
        config, _ = load(path)
        torch.manual_seed(0)
        model = build_model(config).to(device)
        for utterances in args.decode_batches:
            for appended in (False, True):
                frames = conv_output_length(int(args.seconds * FRAMES_PER_SECOND), config.subsampling)
                ms = bench_steps(model, utterances=utterances, beam=args.beam, frames=frames,
                                 positions=args.positions, appended=appended, device=device)
                kind = "appended" if appended else "preallocated"
                ratio = ms[args.positions[-1]] / ms[args.positions[0]]
                print(f"{path.name:<24}{f'{utterances}x{args.beam}':>9}{kind:>14}"
                      + "".join(f"{ms[p]:>9.2f}" for p in args.positions) + f"{ratio:>16.2f}")
                report["configs"][path.name]["decoder_step_ms"][f"{utterances}x{args.beam}/{kind}"] = ms
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
