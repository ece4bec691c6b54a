"""One decoding run: the options, the thread policy, and the task that carries them out.

- `DecodingOptions`: the one definition of the decoding options, validated once, that `asr decode`,
  `asr transcribe`, `asr serve` and the Python API read; `DecodingConfig` adds a run's batching and
  device, and `load_decoding_config` reads it (defaults, a conf/decode/*.yaml file, `decoding.key=
  value` overrides, then the command-line values; an LM option given without an LM is refused here).
- `thread_policy`: the CPU threads of a decoding run, decided here for the commands, the server and
  the benchmarks; `search_threads_for` applies it to one search.
- `DecodingTask`: encoder, search with the scorers the options ask for (a lexicon's constraint, a
  word LM fused into the search), then LM rescoring of the beam when the LM is not fused. It drives
  any asr.inference.InferenceModel (the PyTorch model or the exported one) through that contract
  alone. The encoder and the search run in the options' precision (bf16 autocast or fp32); the
  search's scores are summed in fp32 either way (the decoder's and CTC's log-probabilities are
  computed in fp32).

    task = DecodingTask(model, tokenizer, DecodingOptions(beam_size=20), lexicon=lexicon, lm=lm)  # lm: loaded
    nbest_lists = task.run([feats_1, feats_2])   # (T_i, n_mels) normalized features each

decoding.lm names either LM, told apart by the file's content (asr.neural_lm.is_neural_lm): an ARPA
word n-gram model (text, or gzip) rescores the ended beam, or with lm_fusion scores each word as it
ends (asr.lm.WordLMScorer), lm_word_bonus per word against the cost of each word; a neural LM file
(format "asr-lm", a torch file) is always fused, token by token, as a full scorer
(asr.neural_lm.TransformerLMScorer): lm_weight x its log-probability of every token and of eos,
and the pre-beam ranks tokens on the decoder's and the LM's weighted scores; its per-token
counterpart of the word bonus is decoding.length_bonus: lm_word_bonus (a preset's, for an n-gram
LM) is not used with it.

`run_aligned` adds the words of each best hypothesis with their times and confidence, aligned by
the CTC head (asr.alignment) to the encoder output the search read.

Where the next pieces go: attention weights are a step after `search` that reads the encoder
output and the chosen tokens; decoding one shard of a manifest is
asr.decode's choice of utterances, not the task's.
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any, Literal

import torch

from asr.alignment import Word, align_words
from asr.config import ConfigError, load_config
from asr.inference import InferenceModel
from asr.lexicon import Lexicon, LexiconScorer
from asr.lm import NgramLM, WordLMScorer, rescore
from asr.metrics import normalize_text
from asr.neural_lm import NeuralLM, TransformerLMScorer
from asr.quantize import int8_model
from asr.search import Hypothesis, Scorers, SearchOptions, check_fields, decode_memory
from asr.tokenizer import Tokenizer

__all__ = ["FEW_ROWS", "LM_OPTIONS", "PRECISIONS", "DecodingConfig", "DecodingOptions", "DecodingTask",
           "intra_op_threads", "load_decoding_config", "resolve_precision", "search_threads_for", "thread_policy"]

# A search over at most this many rows (utterances x beam) has operators too small to share among
# threads (a LayerNorm of 10 x 256, a 10-row matmul): waking a second thread for each costs more
# than it saves. `DecodingTask(search_threads=1)` runs such searches on one CPU thread.
FEW_ROWS = 16
PRECISIONS = ("auto", "fp32", "bf16")
LM_OPTIONS = ("lm_weight", "lm_fusion", "lm_word_bonus")  # mean something only with decoding.lm


@dataclass(frozen=True)
class DecodingOptions(SearchOptions):
    """The search (asr.search.SearchOptions, whose defaults are the recommended beam search) and what
    the task adds around it; validated once, here. conf/decode/*.yaml and `decoding.key=value`
    set these fields by name."""

    lexicon: str = ""  # a word list (asr.lexicon): beam search writes only its words; "" = any text
    lm: str = ""  # an ARPA word n-gram model (asr.lm) rescoring the beam's ended hypotheses, or a
    # neural LM file (asr.neural_lm, `asr lm --kind transformer`) fused into the search; "" = none
    lm_weight: float = 0.3  # score + lm_weight * ln P_LM(words) (a neural LM's: of the tokens and eos)
    lm_fusion: bool = False  # the n-gram LM scores each word inside the search as it ends
    # (asr.lm.WordLMScorer) instead of rescoring the ended hypotheses; a neural LM is always fused
    lm_word_bonus: float = 0.0  # with an n-gram lm: + lm_word_bonus per word, beside lm_weight *
    # ln P_LM(words) (each word costs -ln P of the LM, so without it the LM favours dropping words);
    # unused without lm and with a neural LM (decoding.length_bonus is its per-token bonus)
    precision: Literal["auto", "fp32", "bf16"] = "auto"  # bf16: the encoder and the search under bf16
    # autocast; auto: bf16 on a CUDA GPU that supports it natively, fp32 elsewhere (the CPU)
    int8: bool = False  # CPU: every weight matmul in int8, activations quantized per call (asr.quantize;
    # an exported model: its int8 graphs); the precision is then fp32 for the rest
    chunk_size: int = 0  # > 0: the encoder attends in chunks of this many encoder frames (and their left
    # context), as a streaming model hears the audio (asr.streaming); 0: the whole utterance
    left_chunks: int = -1  # with chunk_size: the chunks before its own that a frame attends to; -1: all

    def __post_init__(self) -> None:
        super().__post_init__()
        check_fields(self, (
            ("precision", self.precision in PRECISIONS, f"must be one of {', '.join(PRECISIONS)}"),
            ("lexicon", not self.lexicon or self.mode == "attention",
             f"applies to beam search (mode attention), not to mode {self.mode}"),
            ("lm", not self.lm or self.mode == "attention",
             f"applies to beam search (mode attention), not to mode {self.mode}"),
            ("lm_weight", math.isfinite(self.lm_weight) and self.lm_weight >= 0, "must be finite and >= 0"),
            ("lm_fusion", not self.lm_fusion or bool(self.lm), "needs decoding.lm"),
            ("lm_word_bonus", math.isfinite(self.lm_word_bonus), "must be finite"),
            ("int8", not (self.int8 and self.precision == "bf16"), "and precision bf16 do not go together"),
            ("chunk_size", self.chunk_size >= 0, "must be >= 0 (0: the whole utterance)"),
            ("left_chunks", self.left_chunks >= -1, "must be >= -1 (-1: all)"),
        ))


@dataclass(frozen=True)
class DecodingConfig(DecodingOptions):
    """What a decoding run reads: the decoding (DecodingOptions: the search, the lexicon, the LM, the
    precision), the device, and for `asr decode` the batching of a manifest. conf/decode/*.yaml
    hold these fields at the top level; nbest hypotheses per utterance go to decode's journal, the
    best to hyp.txt."""

    batch_size: int = 32  # utterances per batch at most (asr decode)
    max_batch_seconds: float = 600.0  # padded seconds (longest x count) per batch at most (asr decode)
    num_workers: int = 2  # processes reading audio and computing features (asr decode)
    device: str = "auto"  # auto: cuda when available, else cpu; under torchrun auto and cuda: cuda:LOCAL_RANK

    def __post_init__(self) -> None:
        super().__post_init__()
        for name, ok in (("batch_size", self.batch_size >= 1), ("max_batch_seconds", self.max_batch_seconds > 0),
                         ("num_workers", self.num_workers >= 0)):
            if not ok:
                raise ValueError(f"decoding.{name} = {getattr(self, name)!r} must be positive")

    def decoding_options(self) -> DecodingOptions:
        """The decoding fields alone (what the results depend on)."""
        return DecodingOptions(**{f.name: getattr(self, f.name) for f in dataclasses.fields(DecodingOptions)})


def load_decoding_config(path: str | None, overrides: Sequence[str] = (), **cli_values: Any) -> DecodingConfig:
    """Defaults, then the YAML file `path` (None: none), then `decoding.key=value` overrides (any
    field), then the command-line values given (a field's name = value; None keeps). Unknown keys
    and bad values raise ConfigError naming them; so does a command-line value of an LM option
    (LM_OPTIONS) when there is no LM ("--lm-weight needs --lm LM")."""
    keys = []
    for item in overrides:
        key, sep, _ = item.partition("=")
        if not sep or not key.startswith("decoding."):
            raise ConfigError(f"override '{item}': expected decoding.key=value")
        keys.append(item[len("decoding."):])
    flags = {k: v for k, v in cli_values.items() if v is not None}
    unknown = sorted(set(flags) - {f.name for f in dataclasses.fields(DecodingConfig)})
    if unknown:
        raise ConfigError(f"unknown decoding option '{unknown[0]}'")
    # the command line's LM is there when the file's options are checked (a preset that fuses an LM
    # given on the command line, conf/decode/synth_open_lm.yaml)
    config = load_config(DecodingConfig, path, keys, {"lm": flags["lm"]} if "lm" in flags else None)
    without_lm = [name for name in LM_OPTIONS if name in flags and not flags.get("lm", config.lm)]
    if without_lm:
        raise ConfigError(f"--{without_lm[0].replace('_', '-')} needs --lm LM")
    try:
        return dataclasses.replace(config, **flags)
    except ValueError as e:
        raise ConfigError(f"command line: {e}") from None


class DecodingTask:
    """A model decoding with `options`: the scorers they ask for are built once, from the compiled
    `lexicon` (required when options.lexicon is set) and the loaded `lm` (required when options.lm
    is). The model is any asr.inference.InferenceModel in eval mode (the PyTorch model or an
    exported one), read through that contract alone. With options.int8 the task decodes with
    asr.quantize.int8_model(model), on the CPU only (pass that model to quantize once for many
    tasks). `search_threads`: torch's intra-op threads while a CPU search has at most FEW_ROWS rows
    (None: torch's setting is left alone; `thread_policy` says which to pass). `precision`: "fp32"
    or "bf16", what options.precision means on the model's device (resolve_precision)."""

    def __init__(self, model: InferenceModel, tokenizer: Tokenizer, options: DecodingOptions, *,
                 lexicon: Lexicon | None = None, lm: NgramLM | NeuralLM | None = None,
                 search_threads: int | None = None) -> None:
        if bool(options.lexicon) != (lexicon is not None):
            raise ValueError(f"decoding.lexicon = {options.lexicon!r} and the compiled lexicon go together")
        if bool(options.lm) != (lm is not None):
            raise ValueError(f"decoding.lm = {options.lm!r} and the loaded LM go together")
        if isinstance(lm, NeuralLM):
            lm.check_tokenizer(tokenizer)
        self.device = model.device
        if options.chunk_size and not model.chunked_attention:
            raise ValueError("decoding.chunk_size: this model encodes whole utterances (an exported model)")
        if options.int8:
            if self.device.type != "cpu":
                raise ValueError(f"decoding.int8 runs on the CPU, not on {self.device}")
            model = int8_model(model)
        self.model, self.tokenizer, self.options = model, tokenizer, options
        self.search_threads = search_threads
        self.precision = resolve_precision(options.precision, self.device)
        self.rescorer = lm if isinstance(lm, NgramLM) and not options.lm_fusion else None
        # rescoring ranks the whole beam; the search then returns all of it
        search = {f.name: getattr(options, f.name) for f in dataclasses.fields(SearchOptions)}
        if self.rescorer:
            search["nbest"] = options.beam_size
        self.search_options = SearchOptions(**search)  # the search's fields alone: the rest is the task's
        fused = lm if isinstance(lm, NeuralLM) or options.lm_fusion else None
        self.scorers = self._scorers(lexicon, fused)

    def _scorers(self, lexicon: Lexicon | None, fused: NgramLM | NeuralLM | None) -> Scorers:
        """What the search adds to the decoder and CTC: the lexicon's constraint, the fused LM (an
        n-gram one applies lm_weight and lm_word_bonus itself, so it weighs 1; a neural one weighs
        lm_weight and ranks the pre-beam with the decoder)."""
        full, partial, weights, pre_beam = {}, {}, {}, ()
        if lexicon is not None:
            full["lexicon"], weights["lexicon"] = LexiconScorer(lexicon), 1.0
        if isinstance(fused, NeuralLM):
            full["lm"], weights["lm"], pre_beam = TransformerLMScorer(fused), self.options.lm_weight, ("lm",)
        elif fused is not None:
            partial["lm"] = WordLMScorer.for_tokenizer(fused, self.tokenizer, weight=self.options.lm_weight,
                                                       word_bonus=self.options.lm_word_bonus)
            weights["lm"] = 1.0
        return Scorers(full, partial, weights, ("lexicon",) if lexicon is not None else (), pre_beam)

    @torch.no_grad()
    def run(self, feats: Sequence[torch.Tensor]) -> list[tuple[Hypothesis, ...]]:
        """The n-best (at most options.nbest, best first) of each utterance's features (T_i, n_mels);
        those too short for one encoder frame get the empty hypothesis without decoding. With an LM
        that is not fused, the scores are the rescored ones."""
        return [nbest for nbest, _ in self._run(feats)]

    @torch.no_grad()
    def run_aligned(self, feats: Sequence[torch.Tensor], durations: Sequence[float], *,
                    frame_length_ms: float = 25.0) -> list[tuple[tuple[Hypothesis, ...], list[Word]]]:
        """`run`, and the words of each best hypothesis with their times (seconds from the start
        of the utterance, within its duration in `durations`) and confidence (asr.alignment).
        `frame_length_ms`: the features' window."""
        return self._run(feats, (durations, frame_length_ms))

    def _run(self, feats: Sequence[torch.Tensor],
             align: tuple[Sequence[float], float] | None = None) -> list[tuple[tuple[Hypothesis, ...], list[Word]]]:
        out: list[tuple[tuple[Hypothesis, ...], list[Word]]] = [((Hypothesis((), 0.0),), [])] * len(feats)
        usable = [i for i, f in enumerate(feats) if f.size(0) >= self.model.min_frames]
        if not usable:
            return out
        memory, memory_lens = self.encode([feats[i] for i in usable])
        nbests = self.decode_memory(memory, memory_lens)
        words: list[list[Word]] = [[] for _ in usable]
        if align is not None:
            durations, frame_length_ms = align
            words = align_words(self.model, memory.float(), memory_lens, [n[0].tokens for n in nbests],
                                self.tokenizer, [durations[i] for i in usable], frame_length_ms=frame_length_ms)
        for i, nbest, found in zip(usable, nbests, words):
            out[i] = (nbest, found)
        return out

    def encode(self, feats: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """The encoder output (B, T, d) and its lengths (B,) of features (T_i, n_mels) each."""
        lens = torch.tensor([f.size(0) for f in feats], device=feats[0].device)
        padded = torch.nn.utils.rnn.pad_sequence(list(feats), batch_first=True)  # (B, T, D)
        chunks = {"chunk_size": self.options.chunk_size, "left_chunks": self.options.left_chunks}
        with self._autocast():
            return self.model.encode(padded, lens, **(chunks if self.options.chunk_size else {}))

    def search(self, memory: torch.Tensor, memory_lens: torch.Tensor) -> list[tuple[Hypothesis, ...]]:
        """The search's n-best lists of an encoder output (the whole beam when it is rescored)."""
        with search_threads_for(self.search_threads, self.search_options, memory), self._autocast():
            return decode_memory(self.model, memory, memory_lens, self.search_options, self.scorers)

    def decode_memory(self, memory: torch.Tensor, memory_lens: torch.Tensor) -> list[tuple[Hypothesis, ...]]:
        """What `run` gives for an encoder output: the search's n-best lists, rescored when an LM
        rescores them."""
        nbests = self.search(memory, memory_lens)
        return [self.rescore(n) for n in nbests] if self.rescorer is not None else nbests

    def _autocast(self) -> AbstractContextManager:
        """bf16 autocast on the model's device when the precision is bf16; nothing for fp32."""
        return torch.autocast(self.device.type, dtype=torch.bfloat16) if self.precision == "bf16" else nullcontext()

    def rescore(self, nbest: tuple[Hypothesis, ...]) -> tuple[Hypothesis, ...]:
        """The best options.nbest of `nbest` after adding lm_weight * ln P_LM(words) +
        lm_word_bonus * len(words) (asr.lm.rescore)."""
        words = [normalize_text(self.tokenizer.decode(list(h.tokens))).split() for h in nbest]
        best = rescore([(w, h.score) for w, h in zip(words, nbest)], self.rescorer, self.options.lm_weight,
                       self.options.nbest, self.options.lm_word_bonus)
        return tuple(Hypothesis(nbest[i].tokens, score) for i, score in best)


def resolve_precision(precision: str, device: torch.device) -> str:
    """"fp32" or "bf16": what decoding.precision (PRECISIONS) means on `device`. auto is bf16 on a
    CUDA GPU with native bf16, fp32 elsewhere; bf16 on a GPU without it is a ValueError."""
    if device.type == "cuda":
        native = torch.cuda.is_bf16_supported(including_emulation=False)
        if precision == "bf16" and not torch.cuda.is_bf16_supported():
            raise ValueError(f"decoding.precision = 'bf16': {device} does not support bf16")
        return "bf16" if precision == "bf16" or (precision == "auto" and native) else "fp32"
    return "bf16" if precision == "bf16" else "fp32"


def thread_policy(threads: int | None) -> int | None:
    """The CPU threads of a decoding run, decided here for every caller (asr decode, transcribe and
    serve, the benchmarks; the API's load_model takes what it returns): `threads` N sets torch's
    intra-op threads to N for the whole process, and every search uses them; None leaves torch's
    count alone, except that a CPU search of at most FEW_ROWS rows (utterances x beam) runs on one
    thread, its operators being too small to share. Returns the `search_threads` of DecodingTask
    (asr.api.load_model) that carries it out: None, or 1."""
    if threads is None:
        return 1
    if threads < 1:
        raise ValueError(f"threads must be at least 1, got {threads}")
    torch.set_num_threads(threads)
    return None


def search_threads_for(search_threads: int | None, options: SearchOptions,
                       memory: torch.Tensor) -> AbstractContextManager:
    """Where a search of `options` over the encoder output `memory` (B, T, d) runs: on
    `search_threads` intra-op threads when it is a CPU search of at most FEW_ROWS rows (B x beam for
    the beam searches, B otherwise), on torch's count otherwise (and always when search_threads is
    None)."""
    rows = memory.size(0) * (options.beam_size if options.mode in ("attention", "ctc_rescore") else 1)
    few = search_threads is not None and rows <= FEW_ROWS and memory.device.type == "cpu"
    return intra_op_threads(search_threads if few else None)


@contextmanager
def intra_op_threads(count: int | None) -> Iterator[None]:
    """torch's intra-op thread count set to `count` inside the block (None: left alone). It is
    process-wide: DecodingTask uses it only when its caller asks (search_threads)."""
    before = torch.get_num_threads()
    if count is None or count == before:
        yield
        return
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)
