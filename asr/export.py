"""`asr export`: a model file as ONNX graphs that onnxruntime runs (asr.onnx_model), in a folder.

    export_model("exp/synth/model_avg.pt", "exp/synth/onnx")     # then asr.load_model("exp/synth/onnx")

DIR holds (EXPORT_FILE says which graph is which and links them to the rest):
    encoder.onnx       feats (B, T, n_mels) float32, feat_lens (B,) int64
                       -> memory (B, T', d), memory_lens (B,) int64
    ctc.onnx           memory (B, T', d) -> ctc_log_probs (B, T', V)
    decoder_init.onnx  memory (B, S, d), memory_lens (B,) -> memory_kv (layers, 2, B, H, S, dh), the
                       cross-attention keys and values of every layer, and memory_mask (B, 1, 1, S)
                       (additive: 0 on valid frames, -inf on padding)
    decoder_step.onnx  tokens (B, N) int64, self_k_0, self_v_0, ... (B, N, H, C, dh) each layer's cache
                       buffers of capacity C whose positions [0, t) are filled, length () int64 = t,
                       memory_k_0, memory_v_0, ... (B, H, S, dh) (memory_kv's parts), memory_mask
                       -> log_probs (B, N, V), new_kv (layers, 2, B, N, H, dh), the keys and values of
                       position t (TransformerDecoder.step on an ExportedStepCache: the buffers are read in place, never
                       copied; the caller stores new_kv in them)
    *.int8.onnx        with int8=True: the same graphs with int8 weights (onnxruntime's dynamic
                       quantization of MatMul / Gemm weights, per output channel)
    stream_subsample.onnx, stream_chunk.onnx
                       with chunk_size > 0 and left_chunks >= 0 (a model with causal convolutions,
                       `asr export --streaming`): the streaming encoder, which asr.streaming's Stream
                       runs (asr.onnx_model.OnnxStreamingEncoder; float32 only)
                       stream_subsample: feats (B, T, n_mels), offset (B,) int64 -> x (B, T', d): the
                       subsampled frames as the first layer takes them, row b's from position offset[b]
                       stream_chunk: x (B, chunk_size, d) (row b's first chunk_len[b] frames valid),
                       kv_cache (layers, B, L, 2, H, dh) with L = left_chunks x chunk_size (row b's last
                       cache_len[b] valid), conv_cache (layers, B, k - 1, d), cache_len (B,), chunk_len
                       (B,) -> h (B, chunk_size, d), new_kv_cache, new_conv_cache, new_cache_len (B,)
                       (`_StreamChunk`: as StreamingEncoder._chunk_step, caches padded on the left)
    tokenizer.json     (+ tokenizer.model for sentencepiece): asr.tokenizer's files
    export.json        {"format": "asr-onnx", "version", "model": the model config, "frontend":
                       features + CMVN, "tokenizer": {"vocab_size", "fingerprint"}, "graphs": {name:
                       file}, "int8_graphs", "opset", and with the streaming graphs "streaming":
                       {"chunk_size", "left_chunks", "graphs": {name: file}}}
Every size but the layers, heads and widths (and the streaming graphs' chunk_size and L, fixed when
exported: unbounded left context cannot be a cache of fixed size) is a dynamic axis: B, N, T, T', S,
C (the names and sizes are asr.onnx_graphs.graph_io's; each graph written is checked as loading will
check it, asr.onnx_graphs.check_graph, so an exporter that writes other operators fails here). The
tokenizer's fingerprint (sha256 of its content, `tokenizer_fingerprint`) ties it to the graphs: a
tokenizer from another model, or one whose vocabulary is not the graphs' V, is refused on loading.

onnx, onnxscript and onnxruntime are the optional extra `pip install -e '.[export]'`, imported
here only when exporting (a one-line error names the extra when one is missing).
"""
from __future__ import annotations

import json
import math
import os
import tempfile
from pathlib import Path
from typing import Any

import torch
from torch import nn

from asr.checkpoint import CheckpointError, load_file
from asr.config import to_dict
from asr.fileio import atomic_open
from asr.model import (
    ASRModel,
    ConformerEncoder,
    ExportedStepCache,
    LayerCache,
    TransformerEncoder,
    sinusoidal_positions,
)
from asr.onnx_graphs import (
    EXPORT_FILE,
    GRAPHS,
    STREAM_GRAPHS,
    StreamShape,
    check_graph,
    graph_io,
    read_graph,
    stream_shape,
)
from asr.onnx_model import EXPORT_FORMAT, EXPORT_VERSION, require_extra, tokenizer_fingerprint

__all__ = ["export_model"]

class _CTC(nn.Module):
    def __init__(self, model: ASRModel) -> None:
        super().__init__()
        self.model = model

    def forward(self, memory: torch.Tensor) -> torch.Tensor:
        return self.model.ctc_log_probs(memory)


class _DecoderInit(nn.Module):
    """memory, memory_lens -> memory_kv, memory_mask: TransformerDecoder.init_cache's cross-attention part."""

    def __init__(self, model: ASRModel) -> None:
        super().__init__()
        self.decoder = model.decoder

    def forward(self, memory: torch.Tensor, memory_lens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cache = self.decoder.init_cache(memory, memory_lens, rows=memory.size(0), capacity=1)
        return cache.memory_kv, cache.memory_mask


class _DecoderStep(nn.Module):
    """The decoder's step over an ExportedStepCache: tokens (B, N), the cache buffers (B, N, H, C, dh)
    each, length, memory_kv's parts, memory_mask -> log_probs (B, N, V), new_kv (layers, 2, B, N, H, dh)."""

    def __init__(self, model: ASRModel) -> None:
        super().__init__()
        self.decoder = model.decoder

    def forward(self, tokens: torch.Tensor, self_kv: tuple[torch.Tensor, ...], length: torch.Tensor,
                memory_kv: tuple[torch.Tensor, ...], memory_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        b, n = tokens.shape
        heads, capacity, dh = self_kv[0].shape[2:]
        buffers = tuple(c.reshape(b * n, heads, capacity, dh) for c in self_kv)
        cache = ExportedStepCache(buffers, length, memory_kv, memory_mask, self.decoder.d_model)
        log_probs, _ = self.decoder.step(tokens.reshape(b * n), cache)
        layers = len(cache.new_kv)
        new_kv = torch.stack(cache.new_kv).view(layers, b, n, 2, heads, dh).permute(0, 3, 1, 2, 4, 5)
        return log_probs.view(b, n, -1), new_kv.contiguous()


class _StreamSubsample(nn.Module):
    """feats (B, T, n_mels), offset (B,) -> x (B, T', d): the subsampling's frames as the first layer
    takes them, row b's first frame at position offset[b] (StreamingEncoder._subsample's conv and
    `_embed`, with one offset per row: the host pads the rows' feature buffers on the right and
    keeps each row's own frames). `_embed` takes one int offset for all rows, so its two kinds are
    written here per row: the transformer's scaled frames plus sinusoidal absolute positions, the
    conformer's scaled frames (its positions are relative: the chunk graph's); another encoder is
    refused. tests/test_export_streaming.py holds both to forward_chunks, which calls `_embed`."""

    def __init__(self, encoder: TransformerEncoder | ConformerEncoder) -> None:
        super().__init__()
        embed = type(encoder)._embed
        if embed not in (TransformerEncoder._embed, ConformerEncoder._embed):
            raise ValueError(f"cannot export the streaming input of a {type(encoder).__name__}")
        self.encoder, self.absolute = encoder, embed is TransformerEncoder._embed

    def forward(self, feats: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
        x = self.encoder.subsampling.frames(feats)  # (B, T', d)
        if not self.absolute:
            return self.encoder._embed(x, 0)
        d = self.encoder.d_model
        positions = offset[:, None] + torch.arange(x.size(1))  # (B, T')
        return x * math.sqrt(d) + sinusoidal_positions(positions.flatten(), d).view(*positions.shape, d)


class _StreamChunk(nn.Module):
    """One chunk of B streams through the encoder's layers (StreamingEncoder._chunk_step with caches
    of a fixed size): x (B, C, d) the chunks, row b's first chunk_len[b] frames valid; kv_cache
    (layers, B, L, 2, H, dh) each layer's keys and values of the frames before, row b's last
    cache_len[b] valid (left padding: relative distances hold); conv_cache (layers, B, k - 1, d)
    -> h (B, C, d), the new caches (the last L keys and values, the last k - 1 convolution inputs)
    and new_cache_len = min(cache_len + chunk_len, L). C = chunk_size and L = left_chunks x
    chunk_size are fixed when exported.

    Only a stream's last chunk may be partial (chunk_len < C: StreamingEncoder.forward_chunks pads
    only the final streams' last chunks), so a row's new caches are those of a whole chunk, and
    unspecified after a partial one, which no chunk follows. (Picking a partial row's caches at its
    own length, as ConvModule.forward_chunk's `lengths` gather does, would export as an Expand to a
    constant shape, which asr.onnx_model refuses.)"""

    def __init__(self, encoder: TransformerEncoder | ConformerEncoder) -> None:
        super().__init__()
        self.encoder = encoder

    def forward(self, x: torch.Tensor, kv_cache: torch.Tensor, conv_cache: torch.Tensor, cache_len: torch.Tensor,
                chunk_len: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        n, c = kv_cache.size(2), x.size(1)
        keys = torch.arange(n + c)
        mask = ((keys >= n - cache_len[:, None]) & (keys < n + chunk_len[:, None]))[:, None, None]  # (B, 1, 1, L + C)
        kvs, convs = [], []
        for j, layer in enumerate(self.encoder.layers):
            # position 0: unused (the absolute positions are in x already, from the subsample graph)
            x, step = layer.forward_chunk(x, LayerCache(kv_cache[j], conv_cache[j]), n, 0, mask=mask)
            kvs.append(step.kv)
            convs.append(step.conv)
        return self.encoder.norm(x), torch.stack(kvs), torch.stack(convs), (cache_len + chunk_len).clamp(max=n)


def _stream_graphs(model: ASRModel, stream: StreamShape) -> dict[str, tuple[nn.Module, tuple, dict, list[str],
                                                                            list[str]]]:
    """The streaming encoder's graphs (as `_graphs`): only the batch is a dynamic axis of the chunk
    graph; the subsample graph's time is one too."""
    c, encoder = model.config, model.encoder
    heads, dh, layers = c.n_heads, c.d_model // c.n_heads, c.encoder_layers
    conv = encoder.init_state(1).layers[0].conv.size(1)  # k - 1 (0 without a convolution)
    chunk, left = stream.chunk_size, stream.cache_frames
    rows = next(n for n in range(3, 64) if n not in {chunk, left, conv, heads, dh, layers})  # unlike any fixed size
    batch, time = torch.export.Dim("batch"), torch.export.Dim("time", min=model.min_frames)
    names = {name: tuple([v.name for v in values] for values in graph_io(name, c, stream)) for name in STREAM_GRAPHS}
    feats, offset = torch.randn(rows, 230, c.n_mels), torch.arange(rows) * 7
    x = torch.randn(rows, chunk, c.d_model)
    kv, conv_cache = torch.randn(layers, rows, left, 2, heads, dh), torch.randn(layers, rows, conv, c.d_model)
    cache_len, chunk_len = torch.arange(rows) % (left + 1), torch.arange(rows) % chunk + 1
    return {
        "stream_subsample": (_StreamSubsample(encoder), (feats, offset), {"feats": {0: batch, 1: time},
                                                                          "offset": {0: batch}},
                             *names["stream_subsample"]),
        "stream_chunk": (_StreamChunk(encoder), (x, kv, conv_cache, cache_len, chunk_len),
                         {"x": {0: batch}, "kv_cache": {1: batch}, "conv_cache": {1: batch}, "cache_len": {0: batch},
                          "chunk_len": {0: batch}}, *names["stream_chunk"]),
    }


def _graphs(model: ASRModel) -> dict[str, tuple[nn.Module, tuple, dict, list[str], list[str]]]:
    """name -> (module, example inputs, dynamic shapes, input names, output names). The examples'
    sizes differ from each other and from 0 and 1, so that no dynamic axis is specialized."""
    c = model.config
    heads, dh, layers = c.n_heads, c.d_model // c.n_heads, c.decoder_layers
    dim = torch.export.Dim
    batch, rows, time, frames = dim("batch"), dim("beam"), dim("time", min=model.min_frames), \
        dim("frames")
    capacity = dim("capacity")
    names = {name: tuple([v.name for v in values] for values in graph_io(name, c)) for name in GRAPHS}  # (ins, outs)
    feats, feat_lens = torch.randn(3, 230, c.n_mels), torch.tensor([230, 180, 120])
    memory, memory_lens = model.encoder(feats, feat_lens)
    memory_kv, memory_mask = _DecoderInit(model)(memory, memory_lens)
    tokens = torch.randint(2, c.vocab_size - 1, (3, 5))
    buffer = tuple(torch.randn(3, 5, heads, 6, dh) for _ in range(2 * layers))  # capacity 6, 4 positions filled
    memory_parts = tuple(memory_kv.flatten(0, 1))
    return {
        "encoder": (model.encoder, (feats, feat_lens), {"feats": {0: batch, 1: time}, "feat_lens": {0: batch}},
                    *names["encoder"]),
        "ctc": (_CTC(model), (memory,), {"memory": {0: batch, 1: frames}}, *names["ctc"]),
        "decoder_init": (_DecoderInit(model), (memory, memory_lens),
                         {"memory": {0: batch, 1: frames}, "memory_lens": {0: batch}}, *names["decoder_init"]),
        "decoder_step": (_DecoderStep(model), (tokens, buffer, torch.tensor(4), memory_parts, memory_mask),
                         {"tokens": {0: batch, 1: rows}, "self_kv": ({0: batch, 1: rows, 3: capacity},) * 2 * layers,
                          "length": {}, "memory_kv": ({0: batch, 2: frames},) * 2 * layers,
                          "memory_mask": {0: batch, 3: frames}}, *names["decoder_step"]),
    }


def export_model(model_path: str | os.PathLike, out_dir: str | os.PathLike, *, int8: bool = False,
                 chunk_size: int = 0, left_chunks: int | None = None) -> Path:
    """Export the model file `model_path` into the folder `out_dir` (module docstring; created, or
    its export files replaced); int8: also the int8 graphs; chunk_size > 0: also the streaming
    encoder's graphs for chunks of chunk_size encoder frames attending to `left_chunks` (>= 0)
    chunks before. Returns out_dir's export.json. A bad model file raises CheckpointError; a
    missing extra ImportError naming it; streaming options this model or a graph cannot take
    ValueError (one line)."""
    require_extra("onnx", "onnxscript", "onnxruntime")
    from asr.api import load_model

    recognizer = load_model(model_path, device="cpu")
    model = recognizer.model.eval()
    stream = _stream_shape(model, chunk_size, left_chunks) if chunk_size else None
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    files, int8_files, stream_files, opset = {}, {}, {}, None
    graphs = {**_graphs(model), **(_stream_graphs(model, stream) if stream else {})}
    with tempfile.TemporaryDirectory(dir=out, prefix=".export-") as tmp, torch.no_grad():
        for name, (module, args, shapes, inputs, outputs) in graphs.items():
            program = torch.onnx.export(module.eval(), args, dynamic_shapes=shapes, input_names=inputs,
                                        output_names=outputs, dynamo=True, verbose=False)
            opset = program.model.opset_imports.get("", opset)
            program.save(os.path.join(tmp, f"{name}.onnx"))
            (stream_files if name in STREAM_GRAPHS else files)[name] = f"{name}.onnx"
            _check_written(Path(tmp, f"{name}.onnx"), name, model, stream)
            if int8 and name in GRAPHS:  # (a stream runs on the float32 graphs, as a PyTorch one on float weights)
                _quantize_graph(os.path.join(tmp, f"{name}.onnx"), os.path.join(tmp, f"{name}.int8.onnx"))
                int8_files[name] = f"{name}.int8.onnx"
                _check_written(Path(tmp, int8_files[name]), name, model, stream)
        for file in [*files.values(), *int8_files.values(), *stream_files.values()]:
            os.replace(os.path.join(tmp, file), out / file)
    recognizer.tokenizer.save(out)
    meta = _metadata(recognizer, load_file(model_path)["frontend"], files, int8_files, opset)
    if stream:
        meta["streaming"] = {"chunk_size": stream.chunk_size, "left_chunks": stream.left_chunks,
                             "graphs": stream_files}
    with atomic_open(out / EXPORT_FILE) as f:
        f.write(json.dumps(meta, indent=1) + "\n")
    written = {*files.values(), *int8_files.values(), *stream_files.values()}
    for stale in ({f"{g}.int8.onnx" for g in GRAPHS} | {f"{g}.onnx" for g in STREAM_GRAPHS}) - written:
        if (out / stale).exists():  # an earlier export's graphs would not match these
            (out / stale).unlink()
    return out / EXPORT_FILE


def _stream_shape(model: ASRModel, chunk_size: int, left_chunks: int | None) -> StreamShape:
    """The streaming graphs' fixed sizes, or ValueError (one line) for options or a model they cannot take."""
    if chunk_size < 1:
        raise ValueError(f"export: chunk_size must be >= 1 for the streaming graphs, got {chunk_size}")
    if left_chunks is None or left_chunks < 0:
        raise ValueError(f"export: left_chunks must be >= 0 for the streaming graphs, got "
                         f"{'none' if left_chunks is None else left_chunks}: the "
                         "attention cache is a graph input of a size fixed when exported (left_chunks x chunk_size "
                         "frames), so unbounded left context (-1) cannot be exported")
    if not model.encoder.can_stream:
        raise ValueError("export: this model cannot stream (its convolutions see future frames: a streaming model "
                         "is built with model.causal_conv: true)")
    return stream_shape(chunk_size, left_chunks)


def _check_written(path: Path, name: str, model: ASRModel, stream: StreamShape | None) -> None:
    """The graph just written is one that asr.onnx_model.load_exported takes (its operators, sizes
    and inputs): an exporter that writes another kind (a new torch version's) fails here, saying so."""
    try:
        check_graph(read_graph(path), path, name, model.config, stream)
    except CheckpointError as e:
        reason = str(e).removeprefix(f"{path}: ")
        raise RuntimeError(f"the {name} graph torch.onnx wrote would be refused when loaded ({reason}); "
                           "asr.onnx_model's checks (OPERATORS) need to learn what this exporter writes") from None


def _quantize_graph(source: str, target: str) -> None:
    """onnxruntime's dynamic int8 quantization of the weights of MatMul / Gemm nodes, per output channel."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    quantize_dynamic(source, target, weight_type=QuantType.QInt8, per_channel=True,
                     op_types_to_quantize=["MatMul", "Gemm"])


def _metadata(recognizer: Any, frontend: dict[str, Any], files: dict[str, str], int8_files: dict[str, str],
              opset: int | None) -> dict[str, Any]:
    """export.json's dict; `frontend`: the model file's (features and CMVN statistics, JSON-safe)."""
    return {
        "format": EXPORT_FORMAT,
        "version": EXPORT_VERSION,
        "model": to_dict(recognizer.model.config),
        "frontend": {"features": to_dict(recognizer.features), "cmvn": frontend["cmvn"]},
        "tokenizer": {"vocab_size": recognizer.tokenizer.vocab_size,
                      "fingerprint": tokenizer_fingerprint(recognizer.tokenizer)},
        "graphs": files,
        "int8_graphs": int8_files,
        "opset": opset,
    }

