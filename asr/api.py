"""The Python API: load a model file, transcribe audio files and waveforms of any length.

    import asr
    model = asr.load_model("exp/synth/model_avg.pt", device="cpu")
    for result in model.transcribe(["a.flac", "b.wav"], beam_size=10):
        print(result.path, result.error or result.text)

Every input is read block by block (asr.audio.iter_blocks), cut into segments at pauses
(asr.segmentation: energy-based, at most `SegmentOptions.max_seconds` long, a tiny last piece
joined to the one before), and the segments of all inputs are decoded in batches, so memory is
bounded by the segment and batch sizes, never by the length of a recording. A segment too short or
too quiet to hold speech gives "" without being decoded. asr.formats writes the results as text,
json or subtitles.

A model file and an export folder are read by one helper (asr.model_parts.read_parts); either
model decodes through the same asr.decoding.DecodingTask (the inference contract,
asr.inference.InferenceModel).
"""
from __future__ import annotations

import copy
import dataclasses
import logging
import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np
import torch

from asr.alignment import Word
from asr.audio import SAMPLE_RATE, AudioError, RawFormat, iter_blocks, shown_path, to_mono_16k
from asr.checkpoint import CheckpointError, load_file, load_weights
from asr.dataset import ASRDataset
from asr.decoding import DecodingOptions, DecodingTask
from asr.features import FeatureConfig, GlobalCMVN, fbank
from asr.inference import InferenceModel
from asr.lexicon import Lexicon
from asr.lm import LMError, NgramLM
from asr.manifest import Utterance
from asr.model import ASRModel, ModelConfig
from asr.model_parts import read_parts
from asr.neural_lm import NeuralLM, is_neural_lm, load_neural_lm
from asr.quantize import int8_model
from asr.search import Hypothesis
from asr.segmentation import SegmentOptions, has_speech, segment_audio
from asr.streaming import Stream, StreamingOptions
from asr.tokenizer import Tokenizer

__all__ = ["Recognizer", "Result", "Segment", "Word", "load_model", "resolve_device"]

_INPUT_ERRORS = (AudioError, OSError, TypeError, ValueError)  # what a bad input raises

AudioInput = str | bytes | os.PathLike | tuple[Any, int]  # a path, or (waveform, sample_rate)
_PATHS = (str, bytes, os.PathLike)
log = logging.getLogger("asr.api")


class Segment(NamedTuple):
    """A decoded stretch of an input: seconds from its start, its text, and (with word timings)
    its words, their times also in seconds from the input's start."""

    start: float
    end: float
    text: str
    words: tuple[Word, ...] = ()


@dataclass(frozen=True)
class Result:
    """The transcript of one input. `error` (one line naming the input) when it could not be
    read; the other fields are then empty. `warnings`: one line each (naming the input) about an
    input transcribed all the same: a file that ends before its container says it should (cut
    short: what is there is transcribed; asr.audio.iter_blocks' on_truncated); also logged."""

    path: str | None  # None for a waveform given in memory; a name that is not UTF-8 as os.fsdecode gives it
    text: str
    tokens: tuple[int, ...] = ()
    score: float = 0.0  # sum of the segments' search scores
    segments: tuple[Segment, ...] = ()
    duration: float = 0.0  # seconds of audio
    error: str | None = None
    warnings: tuple[str, ...] = ()

    @property
    def words(self) -> tuple[Word, ...]:
        """The words of all segments (transcribe(..., word_timestamps=True); () without)."""
        return tuple(w for segment in self.segments for w in segment.words)


def resolve_device(device: str | torch.device) -> torch.device:
    """"auto" -> cuda when available, else cpu; anything else as torch.device reads it."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        return torch.device(device)
    except RuntimeError as e:
        raise ValueError(f"device {device!r}: {e}") from None


def load_model(path: str | os.PathLike, device: str | torch.device = "cpu", options: DecodingOptions | None = None,
               *, search_threads: int | None = None) -> Recognizer:
    """A Recognizer from a model file written by `asr train` / `asr average` (loaded with
    weights_only=True; a file that is not a usable model raises CheckpointError naming it), or from
    a folder written by `asr export` (run by onnxruntime on the CPU: asr.onnx_model.load_exported).
    `options`: the default decoding of `transcribe` (default DecodingOptions(): beam search, beam
    10, CTC weight 0.3; int8=True: int8 weights, asr.quantize); `search_threads`: see
    asr.decoding.DecodingTask (asr.decoding.thread_policy(threads) gives the commands' policy)."""
    from asr.onnx_graphs import EXPORT_FILE

    if os.path.isfile(os.path.join(path, EXPORT_FILE)):  # another folder: load_file says it is one
        return _load_exported(path, device, options, search_threads)
    obj = load_file(path)
    source = os.fspath(path)
    config, tokenizer, features, cmvn = read_parts(obj, source, what="model file")
    return Recognizer(_model(config, obj["state_dict"], source), tokenizer, features, cmvn,
                      device=resolve_device(device), options=options, search_threads=search_threads)


def _load_exported(path: str | os.PathLike, device: str | torch.device, options: DecodingOptions | None,
                   search_threads: int | None) -> Recognizer:
    """load_model of an export folder: onnxruntime on the CPU, its threads torch's intra-op count."""
    from asr.onnx_model import load_exported

    device = resolve_device(device)
    if device.type != "cpu":
        raise ValueError(f"an exported model runs on the CPU (onnxruntime), not on {device}")
    exported = load_exported(path, int8=bool(options and options.int8))
    return Recognizer(exported.model, exported.tokenizer, exported.features, exported.cmvn, device=device,
                      options=options, search_threads=search_threads)


def _model(config: ModelConfig, state_dict: Any, source: str) -> ASRModel:
    """The model of `config` with the file's weights, built only once the two agree (on the meta
    device: asr.checkpoint.load_weights), so a small file asking for a huge network costs nothing."""
    return load_weights(lambda: ASRModel(config), state_dict, source, config, layers=_LAYERS)


_LAYERS = {"encoder.layers.": "encoder_layers", "decoder.layers.": "decoder_layers"}  # weights of each stack


class Recognizer:
    """A model (asr.inference.InferenceModel: a PyTorch ASRModel or an exported OnnxModel, each with
    `to` and `eval`) with its frontend (fbank + CMVN) and tokenizer, ready to decode; eval mode. It turns audio into the
    model's normalized features (`feats`, `dataset`), keeps the word lists and LMs it has loaded,
    and makes the decoding task of a set of options."""

    def __init__(self, model: InferenceModel, tokenizer: Tokenizer, features: FeatureConfig, cmvn: GlobalCMVN, *,
                 device: torch.device | None = None, options: DecodingOptions | None = None,
                 search_threads: int | None = None) -> None:
        self.device = device or torch.device("cpu")
        self.model = model.to(self.device).eval()
        self.tokenizer, self.features, self.cmvn = tokenizer, features, cmvn.to(self.device)
        self.options = options or DecodingOptions()
        self.search_threads = search_threads
        self._lexicons: dict[str, tuple[tuple[int, ...] | None, Lexicon]] = {}  # path: (file stamp, compiled)
        self._lms: dict[str, tuple[tuple[int, ...] | None, NgramLM | NeuralLM]] = {}  # path: (file stamp, model)
        self._int8: InferenceModel | None = None  # the int8 copy of the model, made by the first int8 task
        self._cpu_cmvn: GlobalCMVN | None = None  # for loader workers (`dataset`)

    def transcribe(
        self,
        audio: AudioInput | Sequence[AudioInput],
        *,
        mode: str | None = None,
        beam_size: int | None = None,
        ctc_weight: float | None = None,
        length_bonus: float | None = None,
        lexicon: str | os.PathLike | None = None,
        lm: str | os.PathLike | None = None,
        lm_weight: float | None = None,
        lm_fusion: bool | None = None,
        lm_word_bonus: float | None = None,
        raw: RawFormat | None = None,
        batch_size: int = 8,
        segmentation: SegmentOptions | None = None,
        word_timestamps: bool = False,
    ) -> list[Result]:
        """One Result per input, in order. `audio`: a path, a (waveform, sample_rate) pair
        (numpy or torch, (T,) or (T, C)), or a list of them. `raw` reads every path as headerless
        PCM of that format. mode / beam_size / ctc_weight / length_bonus / lexicon (a word list:
        beam search writes only its words; asr.lexicon) / lm, lm_weight (an ARPA word n-gram model
        rescoring the beam, asr.lm; or a neural LM file fused into the search, asr.neural_lm) /
        lm_fusion (the n-gram LM inside the search instead; asr.lm.WordLMScorer) / lm_word_bonus
        (added per word with an n-gram LM) override this recognizer's DecodingOptions.
        Segments of all inputs (cut as `segmentation` says, default SegmentOptions()) are decoded
        `batch_size` at a time. `word_timestamps`: each segment's words, with their start and end
        (seconds from the input's start) and confidence, aligned by the CTC head (asr.alignment).
        An input that cannot be read gives a Result with `error` set; the others go on. A file cut
        short is transcribed as far as it goes, with a Result warning saying so. Paths may be
        bytes, and names that are not UTF-8 work (Result.path: os.fsdecode's str, which
        os.fsencode turns back into the name). An error while decoding is not an input's: it is
        raised."""
        segmentation = segmentation or SegmentOptions()
        overrides = {"mode": mode, "beam_size": beam_size, "ctc_weight": ctc_weight, "length_bonus": length_bonus,
                     "lexicon": None if lexicon is None else os.fspath(lexicon),
                     "lm": None if lm is None else os.fspath(lm), "lm_weight": lm_weight, "lm_fusion": lm_fusion,
                     "lm_word_bonus": lm_word_bonus}
        options = dataclasses.replace(self.options, **{k: v for k, v in overrides.items() if v is not None})
        task = self.task(options)  # a bad word list or LM fails here, before any audio is read
        inputs = _as_list(audio)
        jobs = [_Job(os.fsdecode(item) if isinstance(item, _PATHS) else None) for item in inputs]
        batches = _Batches(self, task, jobs, batch_size, word_timestamps)
        for index, item in enumerate(inputs):
            pieces = self._pieces(item, raw, segmentation, jobs[index].warn)
            while (piece := _next_piece(pieces, jobs[index])) is not None:
                batches.add(index, *piece)  # may decode a full batch: its errors are not this input's
            if jobs[index].error is not None:
                batches.drop(index)
        batches.flush()
        return [job.result() for job in jobs]

    def _pieces(self, item: AudioInput, raw: RawFormat | None, segmentation: SegmentOptions,
                warn: Callable[[str], None]) -> Iterator[tuple[int, int, torch.Tensor | None]]:
        """(first sample, samples, features; None when it holds no speech) of each segment of an
        input; `warn` is told of a file cut short."""
        for start, wave in segment_audio(_blocks(item, raw, segmentation.block_seconds, warn), segmentation):
            yield start, wave.numel(), self.feats(wave) if has_speech(wave, segmentation.speech_db) else None

    def stream(self, chunk_size: int | None = None, left_chunks: int | None = None, *, endpoint_silence: float = 0.0,
               max_segment: float = 0.0, beam_size: int | None = None, ctc_weight: float | None = None,
               length_bonus: float | None = None, final: str | None = None) -> Stream:
        """A Stream (asr.streaming) of this recognizer's model, tokenizer, features and CMVN, which
        encodes chunks of `chunk_size` encoder frames attending to `left_chunks` chunks before
        (-1: all; defaults 16 and -1, and for an exported model those it was exported with, the
        only ones it takes) and ends segments after `endpoint_silence` seconds of trailing blanks or
        `max_segment` seconds (0: off). beam_size, ctc_weight, length_bonus and the length caps
        are this recognizer's decoding options unless given, and so is how a segment's final text
        is searched (`final`: "rescore" when its mode is ctc_rescore, else "attention", the joint
        beam search; its lexicon, LM and int8 do not apply). With endpointing off, a stream's
        final text is that of `transcribe` in that mode with decoding chunk_size / left_chunks set,
        on one segment. ValueError for a model whose convolutions see the future, an export
        without the streaming graphs (`asr export --streaming`), or chunk options an export does
        not have."""
        chunk_size, left_chunks = self._chunk_options(chunk_size, left_chunks)
        o = self.options
        options = StreamingOptions(
            chunk_size=chunk_size, left_chunks=left_chunks, endpoint_silence=endpoint_silence, max_segment=max_segment,
            beam_size=o.beam_size if beam_size is None else beam_size,
            ctc_weight=o.ctc_weight if ctc_weight is None else ctc_weight,
            length_bonus=o.length_bonus if length_bonus is None else length_bonus,
            final=final or ("rescore" if o.mode == "ctc_rescore" else "attention"), max_len_ratio=o.max_len_ratio,
            max_rate_factor=o.max_rate_factor, pre_beam_ratio=o.pre_beam_ratio)
        return Stream(self.model, self.tokenizer, self.features, self.cmvn, options)

    def _chunk_options(self, chunk_size: int | None, left_chunks: int | None) -> tuple[int, int]:
        """`stream`'s chunk_size and left_chunks with their defaults, or ValueError (one line) when
        this model cannot stream with them."""
        if isinstance(self.model, ASRModel):
            if not self.model.encoder.can_stream:
                raise ValueError("streaming needs a model built with model.causal_conv: true (this one's "
                                 "convolutions see future frames)")
            return 16 if chunk_size is None else chunk_size, -1 if left_chunks is None else left_chunks
        from asr.onnx_model import OnnxModel

        if not isinstance(self.model, OnnxModel) or not self.model.encoder.can_stream:
            raise ValueError("this exported model encodes whole utterances: export it with asr export --streaming "
                             "--chunk-size N --left-chunks L to stream")
        fixed = self.model.encoder.stream  # (asr.onnx_graphs.StreamShape)
        wanted = (fixed.chunk_size if chunk_size is None else chunk_size,
                  fixed.left_chunks if left_chunks is None else left_chunks)
        if wanted != tuple(fixed):
            raise ValueError(f"this exported model streams chunks of {fixed.chunk_size} encoder frames with "
                             f"{fixed.left_chunks} left chunks (fixed by asr export), not {wanted[0]} and {wanted[1]}")
        return wanted

    def feats(self, wave: torch.Tensor) -> torch.Tensor:
        """(T,) 16 kHz waveform -> (frames, n_mels) normalized features on the device (frames =
        0 for a waveform shorter than one window)."""
        return self.cmvn(fbank(wave.to(self.device), self.features))

    def dataset(self, utts: Sequence[Utterance]) -> ASRDataset:
        """The manifest utterances' normalized features, as `feats` gives them but computed on the
        CPU where the dataset is read (a DataLoader's workers): index i -> asr.dataset.Example (feats
        (frames, n_mels), no tokens) or Skipped (unusable audio, with the reason). Move the features
        to `self.device` to decode them."""
        if self._cpu_cmvn is None:
            self._cpu_cmvn = copy.deepcopy(self.cmvn).cpu()
        return ASRDataset(utts, None, features=self.features, cmvn=self._cpu_cmvn)

    def task(self, options: DecodingOptions | None = None) -> DecodingTask:
        """The decoding task of `options` (default: this recognizer's) with this model, its word
        list and LM loaded (LexiconError / LMError when they cannot be read or used)."""
        options = options or self.options
        model = self.model
        if options.int8 and self.device.type == "cpu":  # (elsewhere the task refuses int8)
            if self._int8 is None:
                self._int8 = int8_model(self.model)
            model = self._int8
        return DecodingTask(model, self.tokenizer, options,
                            lexicon=self.lexicon(options.lexicon) if options.lexicon else None,
                            lm=self.language_model(options.lm) if options.lm else None,
                            search_threads=self.search_threads)

    def decode(self, feats: Sequence[torch.Tensor],
               options: DecodingOptions | None = None) -> list[tuple[Hypothesis, ...]]:
        """n-best of each of the utterances' features (T_i, n_mels): `self.task(options).run(feats)`."""
        return self.task(options).run(feats)

    def lexicon(self, path: str | os.PathLike) -> Lexicon:
        """The word list at `path` compiled for this model's tokenizer: once per path, and again when
        the file has changed (its size, modification time or inode); LexiconError when it cannot be
        read or used."""
        return _cached(self._lexicons, path, lambda key: Lexicon.from_file(key, self.tokenizer).to(self.device))

    def language_model(self, path: str | os.PathLike) -> NgramLM | NeuralLM:
        """The LM at `path`, an ARPA word n-gram model or a neural LM file (asr.neural_lm, told apart
        by the content): read once per path, and again when the file has changed; LMError when it
        cannot be read."""
        return _cached(self._lms, path, self._load_lm)

    def _load_lm(self, path: str) -> NgramLM | NeuralLM:
        if not is_neural_lm(path):
            return NgramLM.load(path)
        try:
            return load_neural_lm(path, self.device)
        except CheckpointError as e:
            raise LMError(str(e)) from None

    def text(self, tokens: Iterable[int]) -> str:
        return self.tokenizer.decode(list(tokens))


def _cached(cache: dict[str, tuple[tuple[int, ...] | None, Any]], path: str | os.PathLike,
            load: Callable[[str], Any]) -> Any:
    """cache[path]'s object, loaded again when the file's size, modification time or inode has
    changed (a file replaced by a rename is a new inode), or when it cannot be stat'ed (`load`
    then says why, naming the file)."""
    key = os.fspath(path)
    try:
        stat = os.stat(key)
        stamp: tuple[int, ...] | None = (stat.st_size, stat.st_mtime_ns, stat.st_ino)
    except OSError:
        stamp = None
    cached = cache.get(key)
    if cached is None or stamp is None or cached[0] != stamp:
        cache[key] = (stamp, load(key))
    return cache[key][1]


@dataclass
class _Job:
    """What one input has given so far."""

    path: str | None  # None: a waveform given in memory
    samples: int = 0  # 16 kHz samples read
    pieces: list[tuple[Segment, Hypothesis]] = field(default_factory=list)
    error: str | None = None
    warnings: list[str] = field(default_factory=list)

    def warn(self, message: str) -> None:
        log.warning("%s", message)
        self.warnings.append(message)

    def result(self) -> Result:
        if self.error is not None:
            return Result(self.path, "", error=self.error)
        texts = [segment.text for segment, _ in self.pieces if segment.text]
        tokens = tuple(t for _, hyp in self.pieces for t in hyp.tokens)
        score = sum(hyp.score for _, hyp in self.pieces)
        segments = tuple(segment for segment, _ in self.pieces)
        return Result(self.path, " ".join(texts), tokens, score, segments, self.samples / SAMPLE_RATE,
                      warnings=tuple(self.warnings))


def _next_piece(pieces: Iterator[tuple[int, int, torch.Tensor | None]],
                job: _Job) -> tuple[int, int, torch.Tensor | None] | None:
    """The next segment of the input of `job`; None at its end, or when it cannot be read (the
    job's error then says why)."""
    try:
        piece = next(pieces, None)
    except _INPUT_ERRORS as e:
        job.error = str(e) if isinstance(e, AudioError) else f"{shown_path(job.path or '<waveform>')}: {e}"
        return None
    if piece is not None:
        job.samples = piece[0] + piece[1]
    return piece


class _Batches:
    """Segments waiting to be decoded, `size` at a time; results go to their jobs in order."""

    def __init__(self, recognizer: Recognizer, task: DecodingTask, jobs: list[_Job], size: int,
                 words: bool = False) -> None:
        if size < 1:
            raise ValueError(f"batch_size must be at least 1, got {size}")
        self.recognizer, self.task, self.jobs, self.size, self.words = recognizer, task, jobs, size, words
        self.waiting: list[tuple[int, int, int, torch.Tensor | None]] = []  # (job, start, samples, features)

    def add(self, job: int, start: int, samples: int, feats: torch.Tensor | None) -> None:
        """A segment of `job`: its first sample, length, and features (None: no speech, "" without decoding)."""
        self.waiting.append((job, start, samples, feats))
        if sum(f is not None for *_, f in self.waiting) >= self.size:
            self.flush()

    def drop(self, job: int) -> None:
        self.waiting = [w for w in self.waiting if w[0] != job]

    def flush(self) -> None:
        """Decode the waiting segments; they leave the queue first, so a failed decode (raised)
        leaves nothing half done to decode again."""
        waiting, self.waiting = self.waiting, []
        feats = [f for *_, f in waiting if f is not None]
        if self.words:
            durations = [samples / SAMPLE_RATE for _, _, samples, f in waiting if f is not None]
            decoded = iter(self.task.run_aligned(feats, durations,
                                                 frame_length_ms=self.recognizer.features.frame_length_ms))
        else:
            decoded = iter((nbest, []) for nbest in self.task.run(feats))
        pieces = []
        for job, start, samples, feats in waiting:
            nbest, words = next(decoded) if feats is not None else ((Hypothesis((), 0.0),), [])
            hyp, offset = nbest[0], start / SAMPLE_RATE
            timed = tuple(Word(w.text, offset + w.start, offset + w.end, w.confidence) for w in words)
            segment = Segment(offset, (start + samples) / SAMPLE_RATE, self.recognizer.text(hyp.tokens), timed)
            pieces.append((job, (segment, hyp)))
        for job, piece in pieces:
            self.jobs[job].pieces.append(piece)


def _as_list(audio: AudioInput | Sequence[AudioInput]) -> list[AudioInput]:
    """A single input (a path, or a (waveform, rate) pair) -> [it]; a list stays a list."""
    if isinstance(audio, (np.ndarray, torch.Tensor)):
        raise TypeError("a waveform needs its sample rate: pass (waveform, sample_rate)")
    if isinstance(audio, _PATHS):
        return [audio]
    if isinstance(audio, tuple) and len(audio) == 2 and not isinstance(audio[0], (*_PATHS, tuple)):
        return [audio]
    return list(audio)


def _blocks(item: AudioInput, raw: RawFormat | None, block_seconds: float,
            on_truncated: Callable[[str], None]) -> Iterator[torch.Tensor]:
    """16 kHz mono float32 blocks of a path (a file cut short: what is there, and `on_truncated`
    told) or of a (waveform, sample_rate) pair."""
    if isinstance(item, _PATHS):
        yield from iter_blocks(item, block_seconds=block_seconds, raw=raw, on_truncated=on_truncated)
        return
    if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[1], (int, np.integer))):
        raise TypeError(f"expected a path or a (waveform, sample_rate) pair, got {type(item).__name__}")
    wave = to_mono_16k(item[0], int(item[1]))
    yield from wave.split(max(1, int(block_seconds * SAMPLE_RATE)))
