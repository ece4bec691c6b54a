"""Streaming recognition: words while the speaker talks (U2 style, as WeNet streams).

    stream = Stream(model, tokenizer, features, cmvn, StreamingOptions(chunk_size=16))
    for samples in microphone:                        # 16 kHz float32 pieces of any size
        for event in stream.accept_waveform(samples):
            print(event.kind, event.text)             # "partial" while talking, "final" at endpoints
    events = stream.finish()                          # the last final

Many streams at once (a server): `feed` buffers each stream's audio as features without encoder
work, `end` marks a stream's end, and `advance(streams)` encodes the ready chunks of all of them
in one batched encoder step (StreamingEncoder.forward_chunks) and returns each one's events:

    for stream, samples in arrivals():
        stream.feed(samples)
    for stream, events in zip(streams, advance(streams)):  # [] for the streams not ready
        ...

The waveform becomes filterbank frames as it arrives (the frames of the whole file: asr.features),
then CMVN; the encoder encodes each chunk of `chunk_size` encoder frames once they are all there
(StreamingEncoder.forward_chunk: the whole utterance's output under the same chunk mask); CTC
prefix beam search runs over the chunks (asr.ctc_prefix.StreamingPrefixSearch), its best prefix
the partial result; at an endpoint (trailing silence in the CTC output, or a segment grown to its
maximum length; both off by default) and at the end the segment's encoder output is searched
again for the final text: by the joint CTC/attention beam search (`final="attention"`, the default,
as `decoding.mode: attention` does) or by the decoder rescoring the CTC prefixes (`final="rescore"`,
search.rescore_prefixes, as `decoding.mode: ctc_rescore` does). With endpointing off, the final
text of a file is that of the non-streaming decode of the same chunked model in that mode.

The model must have been built with causal convolutions (`model.causal_conv: true`) and is best
trained with dynamic chunks (`model.dynamic_chunk: true`) so that any chunk size works. A chunk's
latency: chunk_size encoder frames (chunk_size x subsampling x frame shift: 640 ms for 16 at 4x
and 10 ms) plus the subsampling's right context (6 feature frames at 4x) and the window (25 ms).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from asr.audio import SAMPLE_RATE
from asr.ctc_prefix import StreamingPrefixSearch
from asr.features import FeatureConfig, GlobalCMVN, fbank, frame_sizes, num_frames
from asr.search import SearchOptions, decode_memory, rescore_prefixes
from asr.tokenizer import Tokenizer
from asr.tokens import BLANK

__all__ = ["Event", "Stream", "StreamingOptions", "advance"]


@dataclass(frozen=True)
class StreamingOptions:
    chunk_size: int = 16  # encoder frames per chunk (the partial results' step)
    left_chunks: int = -1  # chunks of left context each chunk attends to; -1: all
    beam_size: int = 10  # CTC prefixes kept (the partials), and the final's beam
    ctc_weight: float = 0.5  # of the CTC score in the final's search; the decoder's is 1 - ctc_weight
    length_bonus: float = 0.0  # per token, in the final's search
    endpoint_silence: float = 0.0  # seconds of trailing blank frames that end a segment; 0: off
    max_segment: float = 0.0  # seconds after which a segment ends; 0: off
    # a segment's final text: "attention", the joint CTC/attention beam search over the segment's encoder
    # output (decoding.mode attention); "rescore", the CTC prefixes of the partials rescored by the
    # decoder (decoding.mode ctc_rescore: cheaper, and weaker when the CTC head is: on the synth recipe's
    # streaming model, dev WER 46.7% against 29.4% at chunk 16, recipes/README.md)
    final: str = "attention"
    max_len_ratio: float = 1.0  # the final search's length caps (asr.search.SearchOptions)
    max_rate_factor: float = 2.0
    pre_beam_ratio: float = 1.5

    def __post_init__(self) -> None:
        checks = (("chunk_size", self.chunk_size >= 1), ("left_chunks", self.left_chunks >= -1),
                  ("beam_size", self.beam_size >= 1), ("ctc_weight", 0.0 <= self.ctc_weight <= 1.0),
                  ("endpoint_silence", self.endpoint_silence >= 0), ("max_segment", self.max_segment >= 0),
                  ("final", self.final in ("attention", "rescore")))
        for name, ok in checks:
            if not ok:
                raise ValueError(f"streaming: {name} = {getattr(self, name)!r} is out of range")


class Event(NamedTuple):
    """A result while streaming: "partial" (the best guess so far of the open segment; it may
    change) or "final" (a segment's text, which will not)."""

    kind: str
    text: str
    tokens: tuple[int, ...]
    start: float  # seconds from the start of the stream: the segment's start
    end: float  # and the end of the audio it has heard


class Stream:
    """One audio stream recognized as it arrives (see the module docstring). `model` is an
    ASRModel with a streaming encoder, in eval mode on its device, or an exported model with the
    streaming graphs (asr.onnx_model.OnnxModel of `asr export --streaming`: its chunk_size and
    left_chunks only), whose encoder has the same chunk-by-chunk calls.

    Two ways to drive it. One stream by itself: `accept_waveform` / `accept_feats` (buffer, then
    encode what is ready) and `finish`. Many streams (a server): `feed` each stream its audio as
    it comes (buffered as features, no encoder work), `end` one when its audio ends, and call
    `advance(streams)` for those that are `ready`, which encodes their chunks in one batched
    encoder step; a stream is `finished` once the advance after `end` has given its last final.
    Not thread-safe: feed a stream between advances, never during one that holds it."""

    def __init__(self, model: Any, tokenizer: Tokenizer, features: FeatureConfig, cmvn: GlobalCMVN | None,
                 options: StreamingOptions | None = None) -> None:
        self.model, self.tokenizer, self.features, self.cmvn = model, tokenizer, features, cmvn
        self.options = options or StreamingOptions()
        self.device = model.device
        self.dtype = _dtype(model)
        self._encoder = model.encoder
        self._state = self._encoder.init_state(1, device=self.device, dtype=self.dtype)
        self._samples = torch.zeros(0)  # waveform not yet framed
        self._feats = torch.zeros(0, features.n_mels, device=self.device, dtype=self.dtype)  # (F, n_mels):
        # features after CMVN that the encoder has not taken yet
        self._window, self._hop = frame_sizes(features)
        self._frame_seconds = 1.0 / model.config.frames_per_second  # of an encoder frame
        self._frames = 0  # encoder frames so far
        self._segment_start = 0  # encoder frame where the open segment starts
        self._memory: list[torch.Tensor] = []  # the open segment's encoder output
        self._search = self._new_search()
        self._partial: tuple[int, ...] = ()
        self.finals: list[Event] = []
        self._ended = False  # no more audio (`end`)
        self._finished = False  # and the last final given

    def _new_search(self) -> StreamingPrefixSearch:
        like = torch.zeros(0, dtype=torch.float32, device=self.device)
        return StreamingPrefixSearch(batch=1, beam=self.options.beam_size, like=like, blank=BLANK)

    @torch.no_grad()
    def feed(self, samples: torch.Tensor | Any, rate: int = SAMPLE_RATE) -> None:
        """Buffer the next samples (1-D, float in [-1, 1)) as filterbank frames after CMVN; no
        encoder work (`advance` does it). Other rates than 16 kHz are resampled piece by piece."""
        self._check_open()
        wave = torch.as_tensor(samples, dtype=torch.float32).flatten()
        if rate != SAMPLE_RATE:
            import torchaudio.functional

            wave = torchaudio.functional.resample(wave, rate, SAMPLE_RATE)
        self._samples = torch.cat([self._samples, wave])
        frames = num_frames(self._samples.numel(), self.features)
        if frames == 0:
            return
        used = (frames - 1) * self._hop + self._window
        feats = fbank(self._samples[:used], self.features)  # (frames, n_mels): the whole file's frames
        self._samples = self._samples[frames * self._hop:]
        self._queue(feats)

    @property
    def ready(self) -> bool:
        """Whether `advance` has work here: a whole chunk of features waits, or the stream was
        ended and has not given its last final yet."""
        if self._finished:
            return False
        return self._ended or self._encoder.frames_waiting(self._state, self._feats.size(0)) >= self.options.chunk_size

    def end(self) -> None:
        """The end of the audio: the next `advance` encodes the last partial chunk and gives the
        last final. No more audio may be fed; ending twice is ending once."""
        if self._finished:
            raise ValueError("the stream is finished")
        self._ended = True

    @property
    def finished(self) -> bool:
        """Whether the stream was ended and has given its last final."""
        return self._finished

    def accept_waveform(self, samples: torch.Tensor | Any, rate: int = SAMPLE_RATE) -> list[Event]:
        """The events the next samples bring (`feed`, then `advance` of this stream): a partial
        when the best guess changed, a final at an endpoint."""
        self.feed(samples, rate)
        return advance([self])[0]

    def accept_feats(self, feats: torch.Tensor, *, final: bool = False) -> list[Event]:
        """The events the next filterbank frames (F, n_mels) bring (before CMVN); `final`: the end."""
        self._check_open()
        self._queue(feats)
        if final:
            self.end()
        return advance([self])[0]

    def finish(self) -> list[Event]:
        """The end of the audio: the last chunk encoded, the last segment's final (if it heard any)."""
        self.end()
        return advance([self])[0]

    def result(self) -> str:
        """The final texts so far, joined by spaces."""
        return " ".join(e.text for e in self.finals if e.text)

    def _check_open(self) -> None:
        if self._ended:
            raise ValueError("the stream is finished: no audio after end()" if self._finished
                             else "the stream was ended: no audio after end()")

    @torch.no_grad()
    def _queue(self, feats: torch.Tensor) -> None:
        if self.cmvn is not None and feats.numel():
            feats = self.cmvn(feats.to(self.cmvn.mean.device))
        self._feats = torch.cat([self._feats, feats.to(self.device, self.dtype)])

    def _batch_key(self) -> tuple[Any, ...]:
        """Streams with equal keys share a batched encoder step."""
        o = self.options
        return id(self._encoder), o.chunk_size, o.left_chunks, self.dtype, self.device

    def _events(self, h: torch.Tensor) -> list[Event]:
        """The events of new encoder output h (1, n, d) (whole chunks; with the end, the last
        partial one), a result after each chunk; the last final once the stream has ended."""
        o = self.options
        events: list[Event] = []
        eos = torch.tensor([self.model.config.eos], device=h.device)
        log_probs = self.model.ctc_log_probs(h).index_fill(2, eos, float("-inf"))  # (1, n, V)
        for start in range(0, h.size(1), o.chunk_size):  # chunk by chunk: a result after each
            piece = slice(start, start + o.chunk_size)
            self._memory.append(h[:, piece])
            self._frames += self._memory[-1].size(1)
            self._search.feed(log_probs[:, piece])
            if self._endpoint():
                events.append(self._finish_segment())
                continue
            best = self._best()
            if best != self._partial:
                self._partial = best
                events.append(self._event("partial", best))
        if self._ended:
            self._finished = True
            if self._frames > self._segment_start:
                events.append(self._finish_segment())
        return events

    def _best(self) -> tuple[int, ...]:
        beams = self._search.prefixes()
        return tuple(beams.tokens[0, 0, :int(beams.lengths[0, 0])].tolist())

    def _endpoint(self) -> bool:
        o, frames = self.options, self._frames - self._segment_start
        if o.max_segment > 0 and frames * self._frame_seconds >= o.max_segment:
            return True
        if o.endpoint_silence > 0 and self._partial:
            return int(self._search.trailing_blanks[0]) * self._frame_seconds >= o.endpoint_silence
        return False

    def _finish_segment(self) -> Event:
        memory = torch.cat(self._memory, dim=1)  # (1, T, d)
        lens = torch.tensor([memory.size(1)], device=memory.device)
        o = self.options
        options = SearchOptions(mode="attention" if o.final == "attention" else "ctc_rescore", beam_size=o.beam_size,
                                ctc_weight=o.ctc_weight, length_bonus=o.length_bonus, max_len_ratio=o.max_len_ratio,
                                max_rate_factor=o.max_rate_factor, pre_beam_ratio=o.pre_beam_ratio)
        if o.final == "attention":
            best = decode_memory(self.model, memory, lens, options)[0][0]
        else:
            best = rescore_prefixes(self.model, memory, lens, self._search.prefixes(), options)[0][0]
        event = self._event("final", best.tokens)
        self.finals.append(event)
        self._segment_start, self._memory, self._partial = self._frames, [], ()
        self._search = self._new_search()
        return event

    def _event(self, kind: str, tokens: tuple[int, ...]) -> Event:
        text = self.tokenizer.decode(list(tokens)) if tokens else ""
        return Event(kind, text, tuple(tokens), self._segment_start * self._frame_seconds,
                     self._frames * self._frame_seconds)


def _dtype(model: Any) -> torch.dtype:
    """The dtype a stream's features and encoder state take: the weights' (float32 for an export,
    whose graphs run in float32)."""
    from asr.onnx_model import OnnxModel

    return torch.float32 if isinstance(model, OnnxModel) else next(model.parameters()).dtype


@torch.no_grad()
def advance(streams: Sequence[Stream]) -> list[list[Event]]:
    """Encode the ready chunks of the given streams (Stream.ready; with several chunks waiting,
    all of them) and return each stream's events, in order ([] for a stream that was not ready).

    Streams of the same model, dtype, device, chunk_size and left_chunks share the encoder:
    each round of StreamingEncoder.forward_chunks encodes one chunk of each of them as one batch
    (their attention caches padded on the left with validity masks, each stream's own positions
    and subsampler leftovers), with the same outputs as each stream alone. Streams whose model or
    chunk options differ are grouped: one batched encoder call per group, never an error. A stream
    may appear once."""
    if len({id(s) for s in streams}) != len(streams):
        raise ValueError("advance: a stream appears twice")
    events: list[list[Event]] = [[] for _ in streams]
    groups: dict[tuple[Any, ...], list[int]] = {}
    for i, s in enumerate(streams):
        if s.ready:
            groups.setdefault(s._batch_key(), []).append(i)
    for members in groups.values():
        group = [streams[i] for i in members]
        o = group[0].options
        h, states = group[0]._encoder.forward_chunks([s._feats[None] for s in group], [s._state for s in group],
                                                     chunk_size=o.chunk_size, left_chunks=o.left_chunks,
                                                     final=[s._ended for s in group])
        for i, s, h_i, state in zip(members, group, h, states):
            s._state, s._feats = state, s._feats[:0]
            events[i] = s._events(h_i)
    return events
