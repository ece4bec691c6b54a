"""An exported model (asr.export) run by onnxruntime, behind the interface the search drives.

`OnnxModel` implements the inference contract (asr.inference.InferenceModel) that ASRModel
implements: `config`, `device`, `min_frames`, `encode`, `ctc_log_probs`, `init_cache`, `step` and
`teacher_forced` (run step by step: ctc_rescore). The search is the same code for both: only the
cache differs, behind asr.inference.DecoderState. `OnnxCache` holds the self-attention keys and
values in a buffer preallocated to a capacity (doubled when full), as DecoderCache does: each
step's graph reads it in place (each layer's keys and values are an input of their own, a
contiguous view that onnxruntime takes without a copy; the positions not yet filled are masked)
and returns only the new position's keys and values, which the cache writes into the buffer. A
graph that returned the cache one position longer copied all of it at every step, which at batch
x beam 320 cost more than the graph saved. `select` moves the rows a step's selection changed,
over the filled positions.

An export with the streaming graphs (`asr export --streaming`: export.json's "streaming" names them
and the chunk_size and left_chunks they were made for) streams too: `encoder` is then an
OnnxStreamingEncoder, with the chunk-by-chunk calls of asr.model's StreamingEncoder that
asr.streaming's Stream and advance make (init_state, frames_waiting, forward_chunks), so a Stream
runs on either model. The host keeps each stream's leftover features, offset and caches (of the
fixed sizes the chunk graph takes, padded on the left); each round of `forward_chunks` is one call
of the subsample graph and one of the chunk graph per chunk, over all the streams advanced together.

Tensors cross to onnxruntime as numpy arrays on the CPU without copies where they are contiguous.
Each graph gets its own session with `threads` intra-op threads (SessionOptions; no process-wide
setting) and sequential execution.

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

    recognizer = asr.load_model("exp/synth/onnx", options=DecodingOptions(int8=True))  # asr.api builds it
"""
from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

from asr.checkpoint import CheckpointError
from asr.features import FeatureConfig, GlobalCMVN
from asr.model import ModelConfig, conv_output_length, right_context
from asr.model_parts import read_parts, usable
from asr.tokenizer import JSON_FILE, Tokenizer, load_tokenizer

__all__ = ["EXPORT_FILE", "EXPORT_FORMAT", "EXPORT_VERSION", "GRAPHS", "OPERATORS", "STREAM_GRAPHS", "Exported",
           "GraphValue", "OnnxCache", "OnnxModel", "OnnxStreamState", "StreamShape", "check_graph", "graph_io",
           "load_exported", "read_graph", "require_extra", "stream_shape", "tokenizer_fingerprint"]

EXPORT_FILE = "export.json"
EXPORT_FORMAT = "asr-onnx"
EXPORT_VERSION = 2  # 2: decoder_step reads a cache buffer and returns the new position only
GRAPHS = ("encoder", "ctc", "decoder_init", "decoder_step")
STREAM_GRAPHS = ("stream_subsample", "stream_chunk")  # an export's streaming encoder, when it has one
EXTRA = "pip install -e '.[export]'"
FIRST_CAPACITY = 16  # steps an OnnxCache's buffer holds at first
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


def require_extra(*modules: str) -> None:
    """ImportError (one line naming the extra) when one of `modules` is not installed."""
    import importlib.util

    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if missing:
        raise ImportError(f"exported models need {', '.join(missing)}: {EXTRA}")


def tokenizer_fingerprint(tokenizer: Tokenizer) -> str:
    """sha256 of the tokenizer's content (its kind and tokens, or its sentencepiece model)."""
    d = tokenizer.to_dict()
    digest = hashlib.sha256(str(d.get("kind")).encode())
    model = d.get("model")
    digest.update(model if isinstance(model, bytes) else json.dumps(d.get("tokens"), ensure_ascii=False).encode())
    return digest.hexdigest()


def _run(session: Any, names: list[str], *inputs: torch.Tensor) -> list[torch.Tensor]:
    """The graph's outputs, as torch tensors sharing onnxruntime's arrays."""
    feed = {name: x.detach().contiguous().numpy() for name, x in zip(names, inputs)}
    return [torch.from_numpy(y) for y in session.run(None, feed)]


class _Graph:
    """One onnxruntime session and its input names, of the graph `data` read from `path` (and
    checked: `check_graph`)."""

    def __init__(self, path: Path, data: bytes, threads: int) -> None:
        import onnxruntime as ort

        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
        options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        try:  # from the bytes checked, not the file again
            self.session = ort.InferenceSession(data, options, providers=["CPUExecutionProvider"])
        except Exception as e:  # onnxruntime raises its own types (Fail, InvalidGraph, NoSuchFile)
            raise CheckpointError(f"{path}: not a usable graph ({' '.join(str(e).split())[:200]})") from None
        self.inputs = [i.name for i in self.session.get_inputs()]
        self.output_shapes = [o.shape for o in self.session.get_outputs()]

    def __call__(self, *inputs: torch.Tensor) -> list[torch.Tensor]:
        return _run(self.session, self.inputs, *inputs)


class OnnxEncoder:
    """(feats (B, T, n_mels), feat_lens (B,)) -> (memory (B, T', d), memory_lens (B,)), as the
    model's encoder; T at least `min_frames` frames (the graph's smallest input). Whole utterances
    only (an export with the streaming graphs has an OnnxStreamingEncoder)."""

    can_stream = False

    def __init__(self, graph: _Graph, config: ModelConfig) -> None:
        self.graph = graph
        self.min_frames = right_context(config.subsampling) + 1  # the subsampling's receptive field

    def __call__(self, feats: torch.Tensor, feat_lens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        memory, memory_lens = self.graph(feats.float(), feat_lens.long())
        return memory, memory_lens


class OnnxStreamState(NamedTuple):
    """A stream's state between calls of OnnxStreamingEncoder.forward_chunks (`init_state` makes the
    first): asr.model.encoder.EncoderState's, with the caches in the chunk graph's fixed sizes."""

    feats: torch.Tensor  # (1, F, n_mels): feature frames the subsampling has not consumed yet
    pending: torch.Tensor  # (1, P, d): subsampled, embedded frames waiting for their chunk to fill
    offset: int  # subsampled frames made so far (their positions)
    kv: torch.Tensor  # (layers, 1, L, 2, H, dh): each layer's keys and values of the frames before, the
    # last cache_len of them valid (the rest is never attended to)
    conv: torch.Tensor  # (layers, 1, k - 1, d): each layer's causal convolution's last inputs
    cache_len: int


class OnnxStreamingEncoder(OnnxEncoder):
    """The exported encoder, and chunk by chunk on the streaming graphs (asr.export with chunk_size):
    StreamingEncoder's `init_state`, `frames_waiting` and `forward_chunks` (what asr.streaming's
    Stream and advance call), for the export's chunk_size and left_chunks only. The host keeps
    each stream's leftover features, pending frames, offset and caches; a round encodes one chunk
    of every ready stream in one call of the chunk graph (a final partial chunk padded to
    chunk_size, `chunk_len` saying how much is valid), as StreamingEncoder._chunk_step does."""

    can_stream = True

    def __init__(self, graph: _Graph, subsample: _Graph, chunk: _Graph, config: ModelConfig,
                 stream: StreamShape) -> None:
        super().__init__(graph, config)
        self.subsample, self.chunk, self.stream = subsample, chunk, stream
        self.rate, self.n_mels, self.d_model = config.subsampling, config.n_mels, config.d_model
        self._cache = (config.encoder_layers, stream.cache_frames, 2, config.n_heads, config.d_model // config.n_heads)
        self._conv = (config.encoder_layers, max(config.conv_kernel - 1, 0), config.d_model)

    def init_state(self, batch: int = 1, *, device: torch.device | str | None = None,
                   dtype: torch.dtype = torch.float32) -> OnnxStreamState:
        """The state of one stream before its first chunk (float32 on the CPU, as the graphs run)."""
        if batch != 1 or dtype != torch.float32 or torch.device(device or "cpu").type != "cpu":
            raise ValueError("an exported stream's state is one row of float32 on the CPU")
        layers, *cache = self._cache
        return OnnxStreamState(torch.zeros(1, 0, self.n_mels), torch.zeros(1, 0, self.d_model), 0,
                               torch.zeros(layers, 1, *cache), torch.zeros(self._conv[0], 1, *self._conv[1:]), 0)

    def frames_waiting(self, state: OnnxStreamState, new_feats: int = 0) -> int:
        """As StreamingEncoder.frames_waiting: the pending frames and those the subsampling will make."""
        return state.pending.size(1) + conv_output_length(state.feats.size(1) + new_feats, self.rate)

    def forward_chunks(self, feats: Sequence[torch.Tensor], states: Sequence[OnnxStreamState], *, chunk_size: int,
                       left_chunks: int = -1,
                       final: Sequence[bool] | None = None) -> tuple[list[torch.Tensor], list[OnnxStreamState]]:
        """StreamingEncoder.forward_chunks on the graphs: stream i's new features feats[i] (1, F_i,
        n_mels) after states[i] -> its output (1, n_i, d) and next state. ValueError unless
        chunk_size and left_chunks are the export's."""
        if (chunk_size, left_chunks) != tuple(self.stream):
            raise ValueError(f"this export streams chunks of {self.stream.chunk_size} frames with "
                             f"{self.stream.left_chunks} left chunks (fixed when exported), not {chunk_size} and "
                             f"{left_chunks}")
        if len(feats) != len(states) or any(f.size(0) != 1 for f in feats):
            raise ValueError("forward_chunks takes one state per stream's features (1, F, n_mels)")
        final = list(final) if final is not None else [False] * len(states)
        buffers = [torch.cat([state.feats, f.float()], dim=1) for state, f in zip(states, feats)]
        pending, offsets = self._subsample(buffers, states)
        buffers = [b[:, (o - s.offset) * self.rate:] for b, o, s in zip(buffers, offsets, states)]
        caches = [(s.kv, s.conv, s.cache_len) for s in states]
        out: list[list[torch.Tensor]] = [[] for _ in states]
        c = chunk_size
        while rows := [i for i, p in enumerate(pending) if p.size(1) >= c or (final[i] and p.size(1) > 0)]:
            h, new = self._chunk_step([pending[i][:, :c] for i in rows], [caches[i] for i in rows])
            for i, h_i, cache in zip(rows, h, new):
                pending[i], caches[i] = pending[i][:, c:], cache
                out[i].append(h_i)
        outputs = [torch.cat(o, dim=1) if o else p.new_zeros(1, 0, self.d_model) for o, p in zip(out, pending)]
        return outputs, [OnnxStreamState(b, p, o, *cache) for b, p, o, cache in zip(buffers, pending, offsets, caches)]

    def _subsample(self, buffers: list[torch.Tensor],
                   states: Sequence[OnnxStreamState]) -> tuple[list[torch.Tensor], list[int]]:
        """Each stream's pending frames once the subsampling has made what its buffer allows, and its
        new offset: one call of the subsample graph over the buffers padded on the right."""
        made = [conv_output_length(b.size(1), self.rate) for b in buffers]
        pending, offsets = [s.pending for s in states], [s.offset for s in states]
        rows = [i for i, n in enumerate(made) if n > 0]
        if not rows:
            return pending, offsets
        longest = max(buffers[i].size(1) for i in rows)
        padded = torch.cat([F.pad(buffers[i], (0, 0, 0, longest - buffers[i].size(1))) for i in rows])
        (x,) = self.subsample(padded, torch.tensor([offsets[i] for i in rows]))  # (R, T', d)
        for row, i in enumerate(rows):
            pending[i] = torch.cat([pending[i], x[row:row + 1, :made[i]]], dim=1)
            offsets[i] += made[i]
        return pending, offsets

    def _chunk_step(self, chunks: list[torch.Tensor], caches: list[tuple[torch.Tensor, torch.Tensor, int]]
                    ) -> tuple[list[torch.Tensor], list[tuple[torch.Tensor, torch.Tensor, int]]]:
        """One chunk of each of R streams, chunks[r] (1, c_r, d), through the chunk graph as one
        batch (padded to chunk_size on the right): their outputs (1, c_r, d) and new caches."""
        sizes = [chunk.size(1) for chunk in chunks]
        x = torch.cat([F.pad(chunk, (0, 0, 0, self.stream.chunk_size - n)) for chunk, n in zip(chunks, sizes)])
        kv, conv, held = zip(*caches)
        h, kv, conv, held = self.chunk(x, torch.cat(kv, dim=1), torch.cat(conv, dim=1), torch.tensor(held),
                                       torch.tensor(sizes))
        return ([h[r:r + 1, :n] for r, n in enumerate(sizes)],
                list(zip(kv.split(1, dim=1), conv.split(1, dim=1), held.tolist())))


@dataclass(eq=False)
class OnnxCache:
    """The decoder's state between exported steps (asr.inference.DecoderState)."""

    self_kv: torch.Tensor  # (layers, 2, R, H, C, dh) zero-initialized: keys [:, 0], values [:, 1]; steps
    # [0, length) filled, the others 0 (finite: the graph masks them, and 0 x NaN would not be 0)
    memory_kv: torch.Tensor  # (layers, 2, B, H, S, dh)
    memory_mask: torch.Tensor  # (B, 1, 1, S) additive
    length: int = 0  # steps taken so far = position of the next token

    @property
    def rows(self) -> int:
        return self.self_kv.size(2)

    @property
    def capacity(self) -> int:
        return self.self_kv.size(4)

    @property
    def group(self) -> int:
        return self.rows // self.memory_kv.size(2)

    def selection_counts(self, rows: torch.Tensor, kept: torch.Tensor) -> torch.Tensor:
        """(1,) long: the rows that move when keeping rows (R,) cut to `kept` utterances
        (asr.inference.DecoderState); no host synchronization."""
        new = torch.arange(rows.numel())
        return ((rows != new) & (new < kept * self.group)).sum().view(1)

    def select(self, rows: torch.Tensor, counts: Sequence[int]) -> OnnxCache:
        """Keep rows (R',) in that order (asr.inference.DecoderState.select); in place, returns self."""
        if rows.numel() < self.rows:  # whole utterances dropped: their memory goes too
            utterances = rows.view(-1, self.group)[:, 0] // self.group
            self.memory_kv = self.memory_kv.index_select(2, utterances)
            self.memory_mask = self.memory_mask.index_select(0, utterances)
            self.self_kv = self.self_kv.index_select(2, rows)  # a new buffer: the graph takes it contiguous
            return self
        if counts[0]:
            moved = torch.argsort((rows == torch.arange(rows.numel())).to(torch.int8), stable=True)[:counts[0]]
            filled = self.self_kv[..., :self.length, :]  # (layers, 2, R, H, t, dh)
            filled.index_copy_(2, moved, filled.index_select(2, rows[moved]))  # sources read first
        return self

    def reorder(self, rows: torch.Tensor) -> OnnxCache:
        """`select` with its counts found here: for callers outside a search."""
        return self.select(rows, self.selection_counts(rows, torch.tensor(rows.numel() // self.group)).tolist())

    def append(self, new_kv: torch.Tensor) -> None:
        """Store step `length`'s keys and values new_kv (layers, 2, R, H, dh) and advance `length`."""
        self.self_kv[..., self.length, :] = new_kv
        self.length += 1

    def reserve(self) -> None:
        """Room for one more step: the buffer doubled (zeros) when full."""
        if self.length == self.capacity:
            self.self_kv = torch.cat([self.self_kv, torch.zeros_like(self.self_kv)], dim=4)


class OnnxDecoder:
    """The decoder's init_cache / step over the exported graphs, and its teacher-forced call."""

    def __init__(self, init: _Graph, step: _Graph, config: ModelConfig) -> None:
        self.init, self.graph = init, step
        self.layers, self.heads, self.dh = config.decoder_layers, config.n_heads, config.d_model // config.n_heads

    def init_cache(self, memory: torch.Tensor, memory_lens: torch.Tensor, *, rows: int,
                   capacity: int = 64) -> OnnxCache:
        """An empty cache for `rows` = B * N hypotheses over memory (B, S, d), its buffer for
        `capacity` steps but at most FIRST_CAPACITY (doubled when exceeded): the graph attends over
        the whole buffer (masked), so one sized for the search's max_len would waste work on
        hypotheses that end much sooner."""
        if rows % memory.size(0):
            raise ValueError(f"{rows} rows are not a multiple of the {memory.size(0)} utterances of the memory")
        memory_kv, memory_mask = self.init(memory.float(), memory_lens.long())
        capacity = min(max(capacity, 1), FIRST_CAPACITY)
        self_kv = memory_kv.new_zeros(self.layers, 2, rows, self.heads, capacity, self.dh)
        return OnnxCache(self_kv, memory_kv, memory_mask)

    def step(self, last_tokens: torch.Tensor, cache: OnnxCache) -> tuple[torch.Tensor, OnnxCache]:
        """Log-probabilities (R, V) of the next token of R hypotheses (TransformerDecoder.step)."""
        cache.reserve()
        batch, rows = cache.memory_kv.size(2), cache.rows
        buffers = cache.self_kv.view(-1, batch, rows // batch, self.heads, cache.capacity, self.dh)  # (layers x 2, ...)
        log_probs, new_kv = self.graph(last_tokens.long().view(batch, -1), *buffers, torch.tensor(cache.length),
                                       *cache.memory_kv.flatten(0, 1), cache.memory_mask)
        cache.append(new_kv.view(self.layers, 2, rows, self.heads, self.dh))
        return log_probs.view(rows, -1), cache

    def __call__(self, tokens: torch.Tensor, token_lens: torch.Tensor, memory: torch.Tensor,
                 memory_lens: torch.Tensor) -> torch.Tensor:
        """Teacher-forced log-probabilities (R, L, V) of tokens (R, L) (sos first; R a multiple of
        the B utterances of memory, as in ctc_rescore), one step per position."""
        cache = self.init_cache(memory, memory_lens, rows=tokens.size(0))
        out = []
        for position in range(tokens.size(1)):
            log_probs, cache = self.step(tokens[:, position].clamp(min=0), cache)
            out.append(log_probs)
        return torch.stack(out, dim=1)


class OnnxModel:
    """An exported model's graphs in onnxruntime, read as asr.search reads an ASRModel (module
    docstring). CPU only. `graphs`: the float32 graphs by name (GRAPHS, and STREAM_GRAPHS with
    `stream`: then `encoder` streams too, OnnxStreamingEncoder), loaded now; `int8_graphs`: the int8
    ones ({} when the export has none), loaded by `int8_model` (which does not stream)."""

    def __init__(self, folder: Path, config: ModelConfig, graphs: dict[str, str], int8_graphs: dict[str, str], *,
                 threads: int, int8: bool = False, stream: StreamShape | None = None) -> None:
        self.folder, self.config, self.threads, self.int8 = folder, config, threads, int8
        self.int8_graphs = int8_graphs
        self._int8: OnnxModel | None = None
        self.device = torch.device("cpu")
        checked = {}  # every graph read and checked before onnxruntime sees any
        for name in (*GRAPHS, *(STREAM_GRAPHS if stream else ())):
            checked[name] = read_graph(folder / graphs[name])
            check_graph(checked[name], folder / graphs[name], name, config, stream)
        loaded = {name: _Graph(folder / graphs[name], data, threads) for name, data in checked.items()}
        self.encoder = (OnnxStreamingEncoder(loaded["encoder"], loaded["stream_subsample"], loaded["stream_chunk"],
                                             config, stream) if stream else OnnxEncoder(loaded["encoder"], config))
        self.ctc = loaded["ctc"]
        self.decoder = OnnxDecoder(loaded["decoder_init"], loaded["decoder_step"], config)
        self.vocab_size = self.decoder.graph.output_shapes[0][-1]  # the exported output layer's V

    def ctc_log_probs(self, memory: torch.Tensor) -> torch.Tensor:
        """CTC log-probabilities (B, T, V) float32 of memory (B, T, d)."""
        return self.ctc(memory.float())[0]

    # the inference contract (asr.inference.InferenceModel)

    chunked_attention = False  # the exported encoder attends over whole utterances

    @property
    def min_frames(self) -> int:
        return self.encoder.min_frames

    def encode(self, feats: torch.Tensor, feat_lens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.encoder(feats, feat_lens)

    def init_cache(self, memory: torch.Tensor, memory_lens: torch.Tensor, *, rows: int,
                   capacity: int = 64) -> OnnxCache:
        return self.decoder.init_cache(memory, memory_lens, rows=rows, capacity=capacity)

    def step(self, last_tokens: torch.Tensor, cache: OnnxCache) -> tuple[torch.Tensor, OnnxCache]:
        return self.decoder.step(last_tokens, cache)

    def teacher_forced(self, tokens: torch.Tensor, token_lens: torch.Tensor, memory: torch.Tensor,
                       memory_lens: torch.Tensor) -> torch.Tensor:
        return self.decoder(tokens, token_lens, memory, memory_lens)

    def int8_model(self) -> OnnxModel:
        """The same model on its int8 graphs (loaded once); CheckpointError when the export has none."""
        if self.int8:
            return self
        if not self.int8_graphs:
            raise CheckpointError(f"{self.folder}: no int8 graphs (export with --int8 for decoding.int8)")
        if self._int8 is None:
            self._int8 = OnnxModel(self.folder, self.config, self.int8_graphs, {}, threads=self.threads, int8=True)
        return self._int8

    def to(self, device: torch.device | str) -> OnnxModel:
        if torch.device(device).type != "cpu":
            raise ValueError(f"an exported model runs on the CPU (onnxruntime), not on {device}")
        return self

    def eval(self) -> OnnxModel:
        return self


def _read_metadata(folder: Path) -> dict[str, Any]:
    path = folder / EXPORT_FILE
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except OSError as e:
        raise CheckpointError(f"{path}: {e.strerror} (not an export folder: asr export writes one)") from None
    except ValueError as e:
        raise CheckpointError(f"{path}: not an export description ({e})") from None
    if not isinstance(meta, dict) or meta.get("format") != EXPORT_FORMAT:
        raise CheckpointError(f"{path}: not an export description (format is not {EXPORT_FORMAT!r})")
    if not isinstance(meta.get("version"), int) or meta["version"] > EXPORT_VERSION:
        raise CheckpointError(f"{path}: export version {meta.get('version')!r}, this toolkit reads up to "
                              f"{EXPORT_VERSION}")
    if meta["version"] < EXPORT_VERSION:  # its decoder_step graph has another signature
        raise CheckpointError(f"{path}: exported by an older version ({meta['version']}, this toolkit reads "
                              f"{EXPORT_VERSION}): run asr export again")
    return meta


def _tokenizer(folder: Path, meta: dict[str, Any]) -> Tokenizer:
    """The folder's tokenizer, refused (CheckpointError naming its file) unless it is the one exported."""
    path = folder / JSON_FILE
    try:
        tokenizer = load_tokenizer(folder)
    except ValueError as e:
        raise CheckpointError(str(e)) from None
    expected = meta["tokenizer"]
    if tokenizer_fingerprint(tokenizer) != expected["fingerprint"]:
        raise CheckpointError(f"{path}: not the tokenizer this model was exported with (its fingerprint differs "
                              f"from {EXPORT_FILE}'s); export the model again")
    if tokenizer.vocab_size != expected["vocab_size"]:
        raise CheckpointError(f"{path}: {tokenizer.vocab_size} tokens, the exported model has {expected['vocab_size']}")
    return tokenizer


class Exported(NamedTuple):
    """What an export folder holds, loaded (asr.api.load_model makes a Recognizer of it)."""

    model: OnnxModel
    tokenizer: Tokenizer
    features: FeatureConfig
    cmvn: GlobalCMVN


def load_exported(path: str | os.PathLike, *, int8: bool = False, threads: int | None = None) -> Exported:
    """The export folder `path` (asr.export) loaded. CheckpointError (one line naming the file)
    for a folder that is not a usable export, a tokenizer that is not the exported one, or graphs
    whose vocabulary is not the tokenizer's; ImportError naming the extra when onnxruntime is
    missing. `threads`: onnxruntime's intra-op threads per graph (default: torch's intra-op thread
    count). `int8`: decoding.int8 will be asked for, so the export must have int8 graphs. Every
    graph is checked before onnxruntime sees it (module docstring: `check_graph`)."""
    require_extra("onnx", "onnxruntime")
    folder = Path(path)
    meta = _read_metadata(folder)
    source = str(folder / EXPORT_FILE)
    with usable(source, "export description"):
        graphs, int8_graphs = dict(meta["graphs"]), dict(meta.get("int8_graphs") or {})
        if not {"fingerprint", "vocab_size"} <= set(meta["tokenizer"]):
            raise ValueError("the tokenizer's fingerprint or vocab_size is missing")
        stream, stream_graphs = _streaming(meta.get("streaming"))
    for key, files, names, required in (("graphs", graphs, GRAPHS, True),
                                        ("int8_graphs", int8_graphs, GRAPHS, bool(int8_graphs)),
                                        ("streaming.graphs", stream_graphs, STREAM_GRAPHS, stream is not None)):
        _check_graph_names(files, key, source, names, required=required)
    parts = read_parts(meta, source, what="export description", tokenizer=_tokenizer(folder, meta))
    if int8 and not int8_graphs:
        raise CheckpointError(f"{folder}: no int8 graphs (export with --int8 for decoding.int8)")
    if parts.config.vocab_size != parts.tokenizer.vocab_size:  # (the graphs are checked to output the config's)
        raise CheckpointError(f"{folder / JSON_FILE}: {parts.tokenizer.vocab_size} tokens, the exported graphs output "
                              f"{parts.config.vocab_size}")
    model = OnnxModel(folder, parts.config, {**graphs, **stream_graphs}, int8_graphs,
                      threads=threads or torch.get_num_threads(), stream=stream)
    return Exported(model, parts.tokenizer, parts.features, parts.cmvn)


# ---------------------------------------------------------------------------------------------
# what a graph may be


def _streaming(entry: Any) -> tuple[StreamShape | None, dict[str, str]]:
    """export.json's "streaming" ({"chunk_size", "left_chunks", "graphs"}, absent when the export does
    not stream): the graphs' sizes and files; ValueError (usable() makes it one line) when malformed."""
    if entry is None:
        return None, {}
    return stream_shape(entry["chunk_size"], entry["left_chunks"]), dict(entry["graphs"])


def _check_graph_names(files: Any, key: str, source: str, names: tuple[str, ...] = GRAPHS, *,
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
