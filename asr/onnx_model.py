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

An export folder is read as untrusted input: a graph reaches onnxruntime only once
asr.onnx_graphs says it is one asr export writes (`check_graph`).

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
from asr.onnx_graphs import (
    EXPORT_FILE,
    GRAPHS,
    STREAM_GRAPHS,
    StreamShape,
    check_graph,
    check_graph_names,
    read_graph,
    streaming_entry,
)
from asr.tokenizer import JSON_FILE, Tokenizer, load_tokenizer

__all__ = ["EXPORT_FORMAT", "EXPORT_VERSION", "Exported", "OnnxCache", "OnnxModel", "OnnxStreamState", "load_exported",
           "require_extra", "tokenizer_fingerprint"]

EXPORT_FORMAT = "asr-onnx"
EXPORT_VERSION = 2  # 2: decoder_step reads a cache buffer and returns the new position only
EXTRA = "pip install -e '.[export]'"
FIRST_CAPACITY = 16  # steps an OnnxCache's buffer holds at first


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
        stream, stream_graphs = streaming_entry(meta.get("streaming"))
    for key, files, names, required in (("graphs", graphs, GRAPHS, True),
                                        ("int8_graphs", int8_graphs, GRAPHS, bool(int8_graphs)),
                                        ("streaming.graphs", stream_graphs, STREAM_GRAPHS, stream is not None)):
        check_graph_names(files, key, source, names, required=required)
    parts = read_parts(meta, source, what="export description", tokenizer=_tokenizer(folder, meta))
    if int8 and not int8_graphs:
        raise CheckpointError(f"{folder}: no int8 graphs (export with --int8 for decoding.int8)")
    if parts.config.vocab_size != parts.tokenizer.vocab_size:  # (the graphs are checked to output the config's)
        raise CheckpointError(f"{folder / JSON_FILE}: {parts.tokenizer.vocab_size} tokens, the exported graphs output "
                              f"{parts.config.vocab_size}")
    model = OnnxModel(folder, parts.config, {**graphs, **stream_graphs}, int8_graphs,
                      threads=threads or torch.get_num_threads(), stream=stream)
    return Exported(model, parts.tokenizer, parts.features, parts.cmvn)
