"""What a graph of an asr export may be: the graphs' names and inputs and outputs (`graph_io`), and
the check (`check_graph`) that every graph passes before onnxruntime sees it, when asr.export
writes it and when asr.onnx_model loads it.

An export folder is read as untrusted input, and a graph reaches onnxruntime only once it is known
to be one asr export writes (`check_graph`, parsed with the onnx package first), because
onnxruntime computes constant expressions while it loads a graph, with no memory cap: a 450-byte
graph of four ConstantOfShape nodes took 6 GB and 22 s. The graphs' files are named in
export.json by plain file names in the folder (never a path: the same error for a file that is
missing and one that cannot be read); each graph's inputs and outputs must be those of
`graph_io` for the config in export.json; its operators must be among OPERATORS, in the default
domain, without subgraphs, functions or external data; no constant may be larger than the
model's largest weight, nor a graph's constants together larger than twice its weights, counting
what onnxruntime computes from constants while loading (a node whose inputs are all constants:
its outputs' sizes must be known from the graph, as they are for the Transpose of a weight that
the exporter leaves); no Expand may have a constant shape. What remains is the graphs' own
arithmetic when they run: run an export folder from others as you would run their code.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, NamedTuple

import torch

from asr.checkpoint import CheckpointError
from asr.model import ModelConfig

__all__ = ["EXPORT_FILE", "GRAPHS", "MAX_STREAM_FRAMES", "OPERATORS", "STREAM_GRAPHS", "GraphValue", "StreamShape",
           "check_graph", "check_graph_names", "graph_io", "read_graph", "stream_shape", "streaming_entry"]

EXPORT_FILE = "export.json"
GRAPHS = ("encoder", "ctc", "decoder_init", "decoder_step")
STREAM_GRAPHS = ("stream_subsample", "stream_chunk")  # an export's streaming encoder, when it has one
MAX_STREAM_FRAMES = 4096  # the most frames a streaming graph's chunk attends to (chunk and cache): 164 s at 40 ms
# The operators (default ONNX domain) of the graphs asr export writes, float32 and int8 (onnxruntime's
# dynamic quantization), transformer and conformer encoders (tests/test_fast_cpu.py exports them), and
# a few elementwise ones an exporter may choose instead; none makes a tensor of a size given by a
# constant (ConstantOfShape, Tile, Pad, Resize), none holds a subgraph (If, Loop, Scan).
OPERATORS = frozenset("""
    Abs Add And Cast Ceil Clip Concat Constant Conv Cos Div DynamicQuantizeLinear Equal Erf Exp Expand
    Flatten Floor Gather Gemm Greater GreaterOrEqual Identity IsNaN LayerNormalization Less LessOrEqual Log
    LogSoftmax MatMul MatMulInteger Max Min Mod Mul Neg Not Or Pow Range Reciprocal ReduceMax ReduceMean
    ReduceSum Relu Reshape Shape Sigmoid Sin Slice Softmax Split Sqrt Squeeze Sub Tanh Transpose Unsqueeze
    Where""".split())
_FLOAT, _INT64 = 1, 7  # onnx.TensorProto element types


def streaming_entry(entry: Any) -> tuple[StreamShape | None, dict[str, str]]:
    """export.json's "streaming" ({"chunk_size", "left_chunks", "graphs"}, absent when the export does
    not stream): the graphs' sizes and files; ValueError (usable() makes it one line) when malformed."""
    if entry is None:
        return None, {}
    return stream_shape(entry["chunk_size"], entry["left_chunks"]), dict(entry["graphs"])


def check_graph_names(files: Any, key: str, source: str, names: tuple[str, ...] = GRAPHS, *,
                       required: bool) -> None:
    """export.json's `key` ({graph: file}): every graph of `names` named by a plain file name in the
    folder (no path, so nothing outside the folder is ever opened)."""
    if not isinstance(files, dict) or (required and set(files) != set(names)):
        raise CheckpointError(f"{source}: '{key}' must name the files of the graphs {', '.join(names)}")
    for name, file in files.items():
        if (not isinstance(file, str) or os.path.basename(file) != file or file in ("", ".", "..")
                or "\0" in file or not file.endswith(".onnx")):
            raise CheckpointError(f"{source}: {key}.{name} must name a .onnx file beside {EXPORT_FILE}, "
                                  f"got {file!r}")


def read_graph(path: Path) -> bytes:
    """The bytes of the graph file `path`; CheckpointError in the same words whether it is missing or
    cannot be read (nothing is told about files one may not read)."""
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError:
        raise CheckpointError(f"{path}: cannot read this graph file (missing or unreadable)") from None


class GraphValue(NamedTuple):
    """An input or output of an exported graph: name, element type (onnx.TensorProto: 1 float32,
    7 int64) and sizes (None: a dynamic axis)."""

    name: str
    dtype: int
    dims: tuple[int | None, ...]


class StreamShape(NamedTuple):
    """The sizes an export's streaming graphs are fixed to: chunks of `chunk_size` encoder frames,
    each attending to the `left_chunks` (>= 0) chunks before."""

    chunk_size: int
    left_chunks: int

    @property
    def cache_frames(self) -> int:
        """L: the frames a stream's attention cache holds."""
        return self.chunk_size * self.left_chunks


def stream_shape(chunk_size: Any, left_chunks: Any) -> StreamShape:
    """StreamShape(chunk_size, left_chunks), or ValueError (one line) unless they are ints >= 1 and
    >= 0 whose chunk and cache together hold at most MAX_STREAM_FRAMES frames (an export folder's
    sizes are untrusted: they size each stream's state)."""
    if type(chunk_size) is not int or type(left_chunks) is not int or chunk_size < 1 or left_chunks < 0:
        raise ValueError(f"streaming: chunk_size must be an int >= 1 and left_chunks an int >= 0, got {chunk_size!r} "
                         f"and {left_chunks!r}")
    if chunk_size * (left_chunks + 1) > MAX_STREAM_FRAMES:
        raise ValueError(f"streaming: a chunk of {chunk_size} frames with {left_chunks} left chunks attends to more "
                         f"than {MAX_STREAM_FRAMES} frames")
    return StreamShape(chunk_size, left_chunks)


def graph_io(name: str, config: ModelConfig,
             stream: StreamShape | None = None) -> tuple[tuple[GraphValue, ...], tuple[GraphValue, ...]]:
    """(inputs, outputs) of the graph `name` of an export of `config` (a streaming graph's: of
    `stream`'s sizes): the contract asr.export writes (its module docstring) and load_exported checks."""
    d, h, layers, v = config.d_model, config.n_heads, config.decoder_layers, config.vocab_size
    dh = d // h
    if name in STREAM_GRAPHS:
        return _stream_io(name, config, stream)
    memory, memory_lens = GraphValue("memory", _FLOAT, (None, None, d)), GraphValue("memory_lens", _INT64, (None,))
    memory_mask = GraphValue("memory_mask", _FLOAT, (None, 1, 1, None))
    if name == "encoder":
        return ((GraphValue("feats", _FLOAT, (None, None, config.n_mels)), GraphValue("feat_lens", _INT64, (None,))),
                (memory, memory_lens))
    if name == "ctc":
        return (memory,), (GraphValue("ctc_log_probs", _FLOAT, (None, None, v)),)
    if name == "decoder_init":
        return (memory, memory_lens), (GraphValue("memory_kv", _FLOAT, (layers, 2, None, h, None, dh)), memory_mask)
    if name != "decoder_step":
        raise ValueError(f"no graph {name!r} (one of {', '.join(GRAPHS)})")
    parts = [f"{part}_{layer}" for layer in range(layers) for part in ("k", "v")]
    inputs = (GraphValue("tokens", _INT64, (None, None)),
              *(GraphValue(f"self_{p}", _FLOAT, (None, None, h, None, dh)) for p in parts),
              GraphValue("length", _INT64, ()),
              *(GraphValue(f"memory_{p}", _FLOAT, (None, h, None, dh)) for p in parts), memory_mask)
    return inputs, (GraphValue("log_probs", _FLOAT, (None, None, v)),
                    GraphValue("new_kv", _FLOAT, (layers, 2, None, None, h, dh)))


def _stream_io(name: str, config: ModelConfig,
               stream: StreamShape | None) -> tuple[tuple[GraphValue, ...], tuple[GraphValue, ...]]:
    """graph_io of the streaming graphs: stream_subsample (feats, offset) -> x; stream_chunk (x, kv_cache,
    conv_cache, cache_len, chunk_len) -> (h, new_kv_cache, new_conv_cache, new_cache_len)."""
    if stream is None:
        raise ValueError(f"the {name} graph's sizes need the export's chunk_size and left_chunks")
    d, h, layers = config.d_model, config.n_heads, config.encoder_layers
    conv = max(config.conv_kernel - 1, 0)  # a layer's convolution cache (none without a convolution)
    if name == "stream_subsample":
        return ((GraphValue("feats", _FLOAT, (None, None, config.n_mels)), GraphValue("offset", _INT64, (None,))),
                (GraphValue("x", _FLOAT, (None, None, d)),))
    chunk, cache = (None, stream.chunk_size, d), stream.cache_frames
    state = [(f"{prefix}{part}", dims) for prefix in ("", "new_") for part, dims in (
        ("kv_cache", (layers, None, cache, 2, h, d // h)), ("conv_cache", (layers, None, conv, d)))]
    kv, conv_cache, new_kv, new_conv = (GraphValue(n, _FLOAT, dims) for n, dims in state)
    return ((GraphValue("x", _FLOAT, chunk), kv, conv_cache, GraphValue("cache_len", _INT64, (None,)),
             GraphValue("chunk_len", _INT64, (None,))),
            (GraphValue("h", _FLOAT, chunk), new_kv, new_conv, GraphValue("new_cache_len", _INT64, (None,))))


def check_graph(data: bytes, path: Path, name: str, config: ModelConfig, stream: StreamShape | None = None) -> None:
    """CheckpointError "path: ..." (one line) unless `data` is a graph asr export writes as graph
    `name` of a model of `config` (a streaming graph's of `stream`'s sizes; the module docstring says
    what that allows), checked without running anything of it."""
    import onnx

    try:
        model = onnx.load_from_string(data)
    except Exception as e:  # protobuf's DecodeError, and whatever else a damaged file raises
        raise CheckpointError(f"{path}: not an ONNX graph ({' '.join(str(e).split())[:120]})") from None
    graph = model.graph
    if model.functions or graph.sparse_initializer or model.training_info:
        raise CheckpointError(f"{path}: holds functions, sparse initializers or training steps, which asr export "
                              "never writes")
    _check_io(graph, path, name, config, stream)
    limits = _limits(config)
    held = _check_initializers(graph, path, limits)
    _check_nodes(graph, path)
    _check_folding(model, path, limits, held)


def _check_io(graph: Any, path: Path, name: str, config: ModelConfig, stream: StreamShape | None) -> None:
    """The graph's inputs and outputs are graph_io's: names, element types, static sizes."""
    initialized = {i.name for i in graph.initializer}
    inputs, outputs = graph_io(name, config, stream)
    for kind, declared, wanted in (("inputs", graph.input, inputs), ("outputs", graph.output, outputs)):
        declared = [value for value in declared if value.name not in initialized]  # (an old style's weights)
        if [value.name for value in declared] != [value.name for value in wanted]:
            got = ", ".join(value.name for value in declared)[:200]
            raise CheckpointError(f"{path}: its {kind} are ({got}), the {name} graph's are "
                                  f"({', '.join(value.name for value in wanted)})")
        for value, want in zip(declared, wanted):
            tensor = value.type.tensor_type
            dims = tuple(d.dim_value if d.HasField("dim_value") else None for d in tensor.shape.dim)
            if (tensor.elem_type != want.dtype or not tensor.HasField("shape") or len(dims) != len(want.dims)
                    or any(g != w for g, w in zip(dims, want.dims))):
                raise CheckpointError(f"{path}: '{value.name}' is {_shown(dims)} of element type {tensor.elem_type}, "
                                      f"the model of {EXPORT_FILE} makes it {_shown(want.dims)} of type {want.dtype}")


def _shown(dims: tuple[int | None, ...]) -> str:
    return "(" + ", ".join("?" if d is None else str(d) for d in dims) + ")"


def _check_initializers(graph: Any, path: Path, limits: tuple[int, int]) -> int:
    """No initializer (nor Constant node) larger than the model's largest weight; all of them
    together at most twice the model's weights (an int8 graph holds its scales too). Returns how
    many elements they hold."""
    largest, total = limits
    held = 0
    constants = [a.t for node in graph.node if node.op_type == "Constant" for a in node.attribute if a.type == a.TENSOR]
    for tensor in [*graph.initializer, *constants]:
        if tensor.data_location == tensor.EXTERNAL:
            raise CheckpointError(f"{path}: '{tensor.name}' is external data, which asr export never writes")
        count = _elements(tensor.dims)
        held += count
        if count > largest or held > total:
            raise CheckpointError(f"{path}: constant '{tensor.name}' of {count:,} elements ({held:,} so far): more "
                                  f"than the model of {EXPORT_FILE} has in its largest weight or twice in all its "
                                  f"weights ({largest:,}, {total:,}, with room for small constants)")
    return held


def _elements(dims: Any) -> int:
    count = 1
    for d in dims:
        count *= max(int(d), 0)
    return count


def _limits(config: ModelConfig) -> tuple[int, int]:
    """(largest, total) elements a graph's constants may hold: the largest weight of a model of
    `config` (built on the meta device), and twice all its weights, each with room for the small
    constants (shapes, scales, zero points)."""
    from asr.model import ASRModel

    with torch.device("meta"):
        sizes = [p.numel() for p in ASRModel(config).parameters()]
    return max(sizes) + 4096, 2 * sum(sizes) + 65536


def _check_nodes(graph: Any, path: Path) -> None:
    """Every node one of OPERATORS, in the default domain, without subgraphs."""
    for index, node in enumerate(graph.node):
        if node.domain not in ("", "ai.onnx") or node.op_type not in OPERATORS:
            raise CheckpointError(f"{path}: {_node(node, index)}: an operator asr export never writes")
        for attribute in node.attribute:
            if attribute.type in (attribute.GRAPH, attribute.GRAPHS, attribute.SPARSE_TENSOR,
                                  attribute.SPARSE_TENSORS) or attribute.ref_attr_name:
                raise CheckpointError(f"{path}: {_node(node, index)} has an attribute asr export never writes")


def _node(node: Any, index: int) -> str:
    """"node 3 (ConstantOfShape 'name')", for messages."""
    op = f"{node.domain}.{node.op_type}" if node.domain else node.op_type
    return f"node {index} ({op}{f' {node.name[:60]!r}' if node.name else ''})"


def _check_folding(model: Any, path: Path, limits: tuple[int, int], held: int) -> None:
    """What onnxruntime computes while loading, it computes within the limits of the constants: a
    node whose inputs are all constants (initializers, Constant nodes, what such nodes compute, the
    Shape of a tensor whose sizes are all known) must have outputs of sizes known from the graph
    (by onnx's shape inference, or as no larger than its first input, for the operators of
    _NOT_LARGER), none larger than the model's largest weight, and all of them with the graph's
    constants no more than twice its weights (the exporter leaves such nodes: the Transpose or a
    Slice of a weight). An Expand to a constant shape is refused outright (its size would come
    at run time)."""
    largest, total = limits
    sizes = {i.name: _elements(i.dims) for i in model.graph.initializer}  # the constants' elements
    shapes = _static_shapes(model)
    for index, node in enumerate(model.graph.node):
        inputs = [i for i in node.input if i]
        if node.op_type == "Constant":
            sizes.update((o, _elements(shapes.get(o, ()))) for o in node.output)
            continue
        if node.op_type == "Shape" and inputs and (inputs[0] in sizes or inputs[0] in shapes):
            sizes[node.output[0]] = 8  # a rank: small
            continue
        if node.op_type == "Expand" and len(inputs) > 1 and inputs[1] in sizes and inputs[0] not in sizes:
            raise CheckpointError(f"{path}: {_node(node, index)} expands to a constant shape; asr export never "
                                  "writes one")
        if not all(i in sizes for i in inputs):
            continue
        known = [_elements(shapes[o]) if o in shapes else sizes[inputs[0]] if node.op_type in _NOT_LARGER and inputs
                 else None for o in node.output if o]
        held += sum(size or 0 for size in known)
        if None in known or max(known, default=0) > largest or held > total:
            size = "of a size not known before it runs" if None in known else f"of {max(known):,} elements"
            raise CheckpointError(f"{path}: {_node(node, index)} computes from constants alone (onnxruntime would "
                                  f"compute it while loading the graph) a tensor {size}, more than the constants "
                                  f"of the model of {EXPORT_FILE} may hold")
        sizes.update(zip([o for o in node.output if o], known))


# operators whose every output has at most as many elements as their first input
_NOT_LARGER = frozenset("""
    Abs Cast Ceil Clip Cos Erf Exp Flatten Floor Identity IsNaN Log Neg Not Reciprocal ReduceMax ReduceMean
    ReduceSum Relu Reshape Sigmoid Sin Slice Split Sqrt Squeeze Tanh Transpose Unsqueeze""".split())


def _static_shapes(model: Any) -> dict[str, tuple[int, ...]]:
    """The sizes of the graph's values that onnx's shape inference finds all known (onnxruntime knows
    those while loading), initializers included; inferred on a copy without the initializers' data."""
    import onnx
    from onnx import helper

    light = onnx.ModelProto()
    light.ir_version = model.ir_version
    light.opset_import.extend(model.opset_import)
    graph = light.graph
    graph.node.extend(model.graph.node)
    graph.input.extend(model.graph.input)
    graph.output.extend(model.graph.output)
    declared = {value.name for value in graph.input}
    graph.input.extend(helper.make_tensor_value_info(i.name, i.data_type, list(i.dims))
                       for i in model.graph.initializer if i.name not in declared)
    try:
        inferred = onnx.shape_inference.infer_shapes(light).graph
    except Exception:  # a graph onnx cannot infer: only its declarations are known
        inferred = graph
    shapes = {}
    for value in [*inferred.value_info, *inferred.input, *inferred.output]:
        tensor = value.type.tensor_type
        if tensor.HasField("shape") and all(d.HasField("dim_value") for d in tensor.shape.dim):
            shapes[value.name] = tuple(d.dim_value for d in tensor.shape.dim)
    return shapes
