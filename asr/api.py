"""The Python API: load a model file, transcribe audio files and waveforms of any length.

    import asr
    model = asr.load_model("exp/synth/model_avg.pt", device="cpu")
    for result in model.transcribe(["a.flac", "b.wav"], beam_size=10):
        print(result.path, result.error or result.text)

Every input is read block by block (asr.audio.iter_blocks), cut into segments at pauses
(energy-based, at most `SegmentOptions.max_seconds` long, a tiny last piece joined to the one
before), and the segments of all inputs are decoded in batches, so memory is bounded by the
segment and batch sizes, never by the length of a recording. A segment too short or too quiet
to hold speech gives "" without being decoded.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np
import torch

from asr.alignment import Word
from asr.audio import SAMPLE_RATE, AudioError, RawFormat, iter_blocks, to_mono_16k
from asr.checkpoint import CheckpointError, load_file
from asr.config import from_dict
from asr.decoding import DecodingOptions, DecodingTask
from asr.features import CMVNStats, FeatureConfig, GlobalCMVN, fbank
from asr.lexicon import Lexicon
from asr.lm import LMError, NgramLM
from asr.model import ASRModel, ModelConfig
from asr.neural_lm import NeuralLM, is_neural_lm, load_neural_lm
from asr.quantize import int8_model
from asr.search import Hypothesis
from asr.tokenizer import Tokenizer, tokenizer_from_dict

__all__ = ["FORMATS", "Recognizer", "Result", "Segment", "SegmentOptions", "Word", "format_results", "load_model",
           "resolve_device", "result_dict", "segment_audio"]

FORMATS = ("txt", "json", "srt", "vtt", "tsv")
FRAME = SAMPLE_RATE // 100  # 10 ms: the frame of the energy measure
_INPUT_ERRORS = (AudioError, OSError, TypeError, ValueError)  # what a bad input raises

AudioInput = str | os.PathLike | tuple[Any, int]  # a path, or (waveform, sample_rate)


@dataclass(frozen=True)
class SegmentOptions:
    """How long inputs are cut (energy-based voice activity, no model)."""

    max_seconds: float = 20.0  # longest segment decoded at once
    min_seconds: float = 1.0  # no cut closer than this to a segment's start; a shorter last piece joins the previous
    pause_db: float = 30.0  # frames this much quieter than the loud frames (95th percentile) are pauses
    speech_db: float = -50.0  # dBFS: a segment whose loudest 10 ms frame is quieter holds no speech
    block_seconds: float = 30.0  # audio read at a time

    def __post_init__(self) -> None:
        if not 0 < self.min_seconds < self.max_seconds:
            raise ValueError(f"segmentation: need 0 < min_seconds ({self.min_seconds}) "
                             f"< max_seconds ({self.max_seconds})")
        if self.block_seconds <= 0 or self.pause_db <= 0:
            raise ValueError("segmentation: block_seconds and pause_db must be positive")


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
    read; the other fields are then empty."""

    path: str | None  # None for a waveform given in memory
    text: str
    tokens: tuple[int, ...] = ()
    score: float = 0.0  # sum of the segments' search scores
    segments: tuple[Segment, ...] = ()
    duration: float = 0.0  # seconds of audio
    error: str | None = None

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
    asr.decoding.DecodingTask."""
    from asr.onnx_model import EXPORT_FILE

    if os.path.isfile(os.path.join(path, EXPORT_FILE)):  # another folder: load_file says it is one
        return _load_exported(path, device, options, search_threads)
    obj = load_file(path)
    source = os.fspath(path)
    try:
        config = from_dict(ModelConfig, obj["model"], source=source, prefix="model.")
        features = from_dict(FeatureConfig, obj["frontend"]["features"], source=source, prefix="frontend.features.")
        cmvn = GlobalCMVN(CMVNStats.from_dict(obj["frontend"]["cmvn"]))
        tokenizer = tokenizer_from_dict(obj["tokenizer"])
    except (KeyError, TypeError, ValueError) as e:
        reason = f"missing {e}" if isinstance(e, KeyError) else str(e).removeprefix(f"{source}: ")
        raise CheckpointError(f"{source}: not a usable model file ({reason})") from None
    if tokenizer.vocab_size != config.vocab_size:
        raise CheckpointError(f"{source}: a tokenizer of {tokenizer.vocab_size} tokens for a model of "
                              f"{config.vocab_size}")
    if not features.n_mels == config.n_mels == cmvn.mean.numel():
        raise CheckpointError(f"{source}: {features.n_mels} mel bins in the frontend, {cmvn.mean.numel()} in its "
                              f"CMVN statistics, {config.n_mels} in the model")
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
    """The model of `config` with the file's weights. A config asking for more layers than the
    file has tensors, or for more memory than there is, is refused before or while building."""
    if not isinstance(state_dict, dict) or not all(isinstance(v, torch.Tensor) for v in state_dict.values()):
        raise CheckpointError(f"{source}: not a usable model file (state_dict is not a dict of tensors)")
    if config.encoder_layers + config.decoder_layers > len(state_dict):
        raise CheckpointError(f"{source}: the config's {config.encoder_layers} + {config.decoder_layers} layers "
                              f"cannot fit in {len(state_dict)} weight tensors")
    try:
        model = ASRModel(config)
    except (RuntimeError, MemoryError) as e:  # sizes a crafted config may ask for
        reason = " ".join(str(e).split())[:160]
        raise CheckpointError(f"{source}: the model's config cannot be built ({reason})") from None
    try:
        model.load_state_dict(state_dict)
    except (KeyError, RuntimeError) as e:
        raise CheckpointError(f"{source}: weights do not fit the model ({' '.join(str(e).split())[:200]})") from None
    return model


class Recognizer:
    """A model with its frontend (fbank + CMVN) and tokenizer, ready to decode; eval mode. It keeps
    the word lists and LMs it has loaded, and makes the decoding task of a set of options."""

    def __init__(self, model: ASRModel, tokenizer: Tokenizer, features: FeatureConfig, cmvn: GlobalCMVN, *,
                 device: torch.device | None = None, options: DecodingOptions | None = None,
                 search_threads: int | None = None) -> None:
        self.device = device or torch.device("cpu")
        self.model = model.to(self.device).eval()
        self.tokenizer, self.features, self.cmvn = tokenizer, features, cmvn.to(self.device)
        self.options = options or DecodingOptions()
        self.search_threads = search_threads
        self._lexicons: dict[str, tuple[tuple[int, ...] | None, Lexicon]] = {}  # path: (file stamp, compiled)
        self._lms: dict[str, tuple[tuple[int, ...] | None, NgramLM | NeuralLM]] = {}  # path: (file stamp, model)
        self._int8: ASRModel | None = None  # the int8 copy of the model, made by the first int8 task

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
        An input that cannot be read gives a Result with `error` set; the others go on. An error
        while decoding is not an input's: it is raised."""
        segmentation = segmentation or SegmentOptions()
        overrides = {"mode": mode, "beam_size": beam_size, "ctc_weight": ctc_weight, "length_bonus": length_bonus,
                     "lexicon": None if lexicon is None else os.fspath(lexicon),
                     "lm": None if lm is None else os.fspath(lm), "lm_weight": lm_weight, "lm_fusion": lm_fusion,
                     "lm_word_bonus": lm_word_bonus}
        options = dataclasses.replace(self.options, **{k: v for k, v in overrides.items() if v is not None})
        task = self.task(options)  # a bad word list or LM fails here, before any audio is read
        inputs = _as_list(audio)
        jobs = [_Job(os.fspath(item) if isinstance(item, (str, os.PathLike)) else None) for item in inputs]
        batches = _Batches(self, task, jobs, batch_size, word_timestamps)
        for index, item in enumerate(inputs):
            pieces = self._pieces(item, raw, segmentation)
            while (piece := _next_piece(pieces, jobs[index])) is not None:
                batches.add(index, *piece)  # may decode a full batch: its errors are not this input's
            if jobs[index].error is not None:
                batches.drop(index)
        batches.flush()
        return [job.result() for job in jobs]

    def _pieces(self, item: AudioInput, raw: RawFormat | None,
                segmentation: SegmentOptions) -> Iterator[tuple[int, int, torch.Tensor | None]]:
        """(first sample, samples, features; None when it holds no speech) of each segment of an input."""
        for start, wave in segment_audio(_blocks(item, raw, segmentation.block_seconds), segmentation):
            yield start, wave.numel(), self.feats(wave) if _has_speech(wave, segmentation.speech_db) else None

    def feats(self, wave: torch.Tensor) -> torch.Tensor:
        """(T,) 16 kHz waveform -> (frames, n_mels) normalized features on the device."""
        return self.cmvn(fbank(wave.to(self.device), self.features))

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

    def result(self) -> Result:
        if self.error is not None:
            return Result(self.path, "", error=self.error)
        texts = [segment.text for segment, _ in self.pieces if segment.text]
        tokens = tuple(t for _, hyp in self.pieces for t in hyp.tokens)
        score = sum(hyp.score for _, hyp in self.pieces)
        segments = tuple(segment for segment, _ in self.pieces)
        return Result(self.path, " ".join(texts), tokens, score, segments, self.samples / SAMPLE_RATE)


def _next_piece(pieces: Iterator[tuple[int, int, torch.Tensor | None]],
                job: _Job) -> tuple[int, int, torch.Tensor | None] | None:
    """The next segment of the input of `job`; None at its end, or when it cannot be read (the
    job's error then says why)."""
    try:
        piece = next(pieces, None)
    except _INPUT_ERRORS as e:
        job.error = str(e) if isinstance(e, AudioError) else f"{job.path or '<waveform>'}: {e}"
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
    if isinstance(audio, (str, os.PathLike)):
        return [audio]
    if isinstance(audio, tuple) and len(audio) == 2 and not isinstance(audio[0], (str, os.PathLike, tuple)):
        return [audio]
    return list(audio)


def _blocks(item: AudioInput, raw: RawFormat | None, block_seconds: float) -> Iterator[torch.Tensor]:
    """16 kHz mono float32 blocks of a path or of a (waveform, sample_rate) pair."""
    if isinstance(item, (str, os.PathLike)):
        yield from iter_blocks(item, block_seconds=block_seconds, raw=raw)
        return
    if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[1], (int, np.integer))):
        raise TypeError(f"expected a path or a (waveform, sample_rate) pair, got {type(item).__name__}")
    wave = to_mono_16k(item[0], int(item[1]))
    yield from wave.split(max(1, int(block_seconds * SAMPLE_RATE)))


# ---------------------------------------------------------------------------------------------
# segmentation


def frame_db(wave: torch.Tensor) -> torch.Tensor:
    """Energy (F,) in dBFS of the whole 10 ms frames of a (T,) waveform in [-1, 1]."""
    frames = wave[: wave.numel() // FRAME * FRAME].view(-1, FRAME)
    return 10.0 * torch.log10(frames.square().mean(dim=1) + 1e-10)


def _has_speech(wave: torch.Tensor, speech_db: float) -> bool:
    db = frame_db(wave)
    return db.numel() > 0 and float(db.max()) >= speech_db


def segment_audio(blocks: Iterable[torch.Tensor], options: SegmentOptions) -> Iterator[tuple[int, torch.Tensor]]:
    """Consecutive segments (first sample, (T,) waveform) of the 16 kHz stream `blocks`.

    Whenever max_seconds are buffered, a segment is cut at the middle of the longest pause that
    starts at least min_seconds in (the quietest frame when there is no pause). A last piece
    shorter than min_seconds joins the segment before it. Memory: max_seconds plus one block.
    """
    longest, shortest = int(options.max_seconds * SAMPLE_RATE), int(options.min_seconds * SAMPLE_RATE)
    buffer, offset = torch.zeros(0), 0  # offset: first sample of the buffer
    held: tuple[int, torch.Tensor] | None = None  # the last segment, until we know no tiny piece follows
    for block in blocks:
        buffer = torch.cat([buffer, block])
        while buffer.numel() >= longest:
            cut = _cut_point(buffer[:longest], shortest, options.pause_db)
            if held is not None:
                yield held
            held, buffer, offset = (offset, buffer[:cut]), buffer[cut:], offset + cut
    if held is not None and 0 < buffer.numel() < shortest:
        held = (held[0], torch.cat([held[1], buffer]))
    elif buffer.numel():
        if held is not None:
            yield held
        held = (offset, buffer)
    if held is not None:
        yield held


def _cut_point(window: torch.Tensor, shortest: int, pause_db: float) -> int:
    """Sample where a segment beginning `window` ends: the middle of the longest run of pause
    frames after `shortest` samples (the latest of equal runs), else the quietest frame there."""
    db = frame_db(window)  # (F,)
    first = -(-shortest // FRAME)  # first frame allowed
    quiet = db < torch.quantile(db, 0.95) - pause_db
    quiet[:first] = False
    if not bool(quiet.any()):
        return (first + int(db[first:].argmin())) * FRAME
    edges = torch.diff(torch.cat([quiet.new_zeros(1), quiet, quiet.new_zeros(1)]).int())  # +1 run starts, -1 ends
    starts, ends = (edges == 1).nonzero()[:, 0], (edges == -1).nonzero()[:, 0]
    best = int(((ends - starts) * db.numel() + starts).argmax())  # longest run; among equals the latest
    return int(starts[best] + ends[best]) // 2 * FRAME


# ---------------------------------------------------------------------------------------------
# output formats


def format_results(results: Sequence[Result], fmt: str) -> str:
    """Results as text: "txt" (the transcript; "path<TAB>transcript" lines for several inputs),
    "json" (a list of objects with path, text, duration, score, segments (with their words and
    confidence when word timings were asked for), error), "srt" / "vtt" (subtitles: a cue per
    segment, or per word when the results have word timings) or "tsv" (start, end in integer
    milliseconds, text: a row per segment, or per word). For several inputs, srt, vtt and tsv put
    "==> path <==" before each input's. Inputs with an error are left out of all but json (report
    them separately)."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown format {fmt!r} (one of {', '.join(FORMATS)})")
    if fmt == "json":
        return json.dumps([result_dict(r) for r in results], indent=2, ensure_ascii=False) + "\n"
    good = [r for r in results if r.error is None]
    several = len(results) > 1
    if fmt == "txt":
        return "".join(f"{r.path or '<waveform>'}\t{r.text}\n" if several else f"{r.text}\n" for r in good)
    write = {"srt": _srt, "vtt": _vtt, "tsv": _tsv}[fmt]
    return "\n".join((f"==> {r.path or '<waveform>'} <==\n" if several else "") + write(r) for r in good)


def result_dict(r: Result) -> dict[str, Any]:
    """A Result as the plain dict of the json format (one element of its list)."""
    def ms(seconds: float) -> float:  # the millisecond the srt / vtt / tsv clocks show
        return round(seconds * 1000) / 1000

    def segment(s: Segment) -> dict[str, Any]:
        out: dict[str, Any] = {"start": ms(s.start), "end": ms(s.end), "text": s.text}
        if s.words:
            out["words"] = [{"word": w.text, "start": ms(w.start), "end": ms(w.end),
                             "confidence": round(w.confidence, 4)} for w in s.words]
        return out

    return {
        "path": r.path, "text": r.text, "duration": round(r.duration, 3),
        "score": r.score if math.isfinite(r.score) else None,
        "segments": [segment(s) for s in r.segments],
        "error": r.error,
    }


def _cues(r: Result) -> list[tuple[float, float, str]]:
    """(start, end, text) of the subtitle cues: the words when there are word timings, else the
    segments that hold text."""
    if r.words:
        return [(w.start, w.end, w.text) for w in r.words]
    return [(s.start, s.end, s.text) for s in r.segments if s.text]


def _srt(r: Result) -> str:
    return "".join(f"{i}\n{_clock(a, ',')} --> {_clock(b, ',')}\n{text}\n\n"
                   for i, (a, b, text) in enumerate(_cues(r), 1))


def _vtt(r: Result) -> str:
    return "WEBVTT\n\n" + "".join(f"{_clock(a, '.')} --> {_clock(b, '.')}\n{text}\n\n" for a, b, text in _cues(r))


def _tsv(r: Result) -> str:
    return "start\tend\ttext\n" + "".join(f"{round(a * 1000)}\t{round(b * 1000)}\t{text}\n" for a, b, text in _cues(r))


def _clock(seconds: float, mark: str) -> str:
    """HH:MM:SS<mark>mmm (srt: ",", vtt: ".")."""
    ms = round(seconds * 1000)
    return f"{ms // 3_600_000:02d}:{ms // 60_000 % 60:02d}:{ms // 1000 % 60:02d}{mark}{ms % 1000:03d}"
