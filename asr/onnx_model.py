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

Tensors cross to onnxruntime as numpy arrays on the CPU without copies where they are contiguous.
Each graph gets its own session with `threads` intra-op threads (SessionOptions; no process-wide
setting) and sequential execution.

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

from asr.checkpoint import CheckpointError
from asr.features import FeatureConfig, GlobalCMVN
from asr.model import ModelConfig, right_context
from asr.model_parts import read_parts, usable
from asr.tokenizer import JSON_FILE, Tokenizer, load_tokenizer

__all__ = ["EXPORT_FILE", "EXPORT_FORMAT", "EXPORT_VERSION", "GRAPHS", "Exported", "OnnxCache", "OnnxModel",
           "load_exported", "require_extra", "tokenizer_fingerprint"]

EXPORT_FILE = "export.json"
EXPORT_FORMAT = "asr-onnx"
EXPORT_VERSION = 2  # 2: decoder_step reads a cache buffer and returns the new position only
GRAPHS = ("encoder", "ctc", "decoder_init", "decoder_step")
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
    """One onnxruntime session and its input names."""

    def __init__(self, path: Path, threads: int) -> None:
        import onnxruntime as ort

        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
        options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        try:
            self.session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
        except Exception as e:  # onnxruntime raises its own types (Fail, InvalidGraph, NoSuchFile)
            raise CheckpointError(f"{path}: not a usable graph ({' '.join(str(e).split())[:200]})") from None
        self.inputs = [i.name for i in self.session.get_inputs()]
        self.output_shapes = [o.shape for o in self.session.get_outputs()]

    def __call__(self, *inputs: torch.Tensor) -> list[torch.Tensor]:
        return _run(self.session, self.inputs, *inputs)


class OnnxEncoder:
    """(feats (B, T, n_mels), feat_lens (B,)) -> (memory (B, T', d), memory_lens (B,)), as the
    model's encoder; T at least `min_frames` frames (the graph's smallest input)."""

    def __init__(self, graph: _Graph, config: ModelConfig) -> None:
        self.graph = graph
        self.min_frames = right_context(config.subsampling) + 1  # the subsampling's receptive field

    def __call__(self, feats: torch.Tensor, feat_lens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        memory, memory_lens = self.graph(feats.float(), feat_lens.long())
        return memory, memory_lens


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
    docstring). CPU only. `graphs`: the float32 graphs by name (asr.export.GRAPHS), loaded now;
    `int8_graphs`: the int8 ones ({} when the export has none), loaded by `int8_model`."""

    def __init__(self, folder: Path, config: ModelConfig, graphs: dict[str, str], int8_graphs: dict[str, str], *,
                 threads: int, int8: bool = False) -> None:
        self.folder, self.config, self.threads, self.int8 = folder, config, threads, int8
        self.int8_graphs = int8_graphs
        self._int8: OnnxModel | None = None
        self.device = torch.device("cpu")
        loaded = {name: _Graph(folder / graphs[name], threads) for name in GRAPHS}
        self.encoder = OnnxEncoder(loaded["encoder"], config)
        self.ctc = loaded["ctc"]
        self.decoder = OnnxDecoder(loaded["decoder_init"], loaded["decoder_step"], config)
        self.vocab_size = self.decoder.graph.output_shapes[0][-1]  # the exported output layer's V

    def ctc_log_probs(self, memory: torch.Tensor) -> torch.Tensor:
        """CTC log-probabilities (B, T, V) float32 of memory (B, T, d)."""
        return self.ctc(memory.float())[0]

    # the inference contract (asr.inference.InferenceModel)

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
    count). `int8`: decoding.int8 will be asked for, so the export must have int8 graphs."""
    require_extra("onnxruntime")
    folder = Path(path)
    meta = _read_metadata(folder)
    source = str(folder / EXPORT_FILE)
    with usable(source, "export description"):
        graphs, int8_graphs = dict(meta["graphs"]), dict(meta.get("int8_graphs") or {})
        if not {"fingerprint", "vocab_size"} <= set(meta["tokenizer"]):
            raise ValueError("the tokenizer's fingerprint or vocab_size is missing")
    parts = read_parts(meta, source, what="export description", tokenizer=_tokenizer(folder, meta))
    if int8 and not int8_graphs:
        raise CheckpointError(f"{folder}: no int8 graphs (export with --int8 for decoding.int8)")
    model = OnnxModel(folder, parts.config, graphs, int8_graphs, threads=threads or torch.get_num_threads())
    if model.vocab_size != parts.tokenizer.vocab_size:
        raise CheckpointError(f"{folder / JSON_FILE}: {parts.tokenizer.vocab_size} tokens, the exported graphs "
                              f"output {model.vocab_size}")
    return Exported(model, parts.tokenizer, parts.features, parts.cmvn)
