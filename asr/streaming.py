"""Streaming recognition: words while the speaker talks (U2 style, as WeNet streams).

    stream = Stream(model, tokenizer, features, cmvn, StreamingOptions(chunk_size=16))
    for samples in microphone:                        # 16 kHz float32 pieces of any size
        for event in stream.accept_waveform(samples):
            print(event.kind, event.text)             # "partial" while talking, "final" at endpoints
    events = stream.finish()                          # the last final

The waveform becomes filterbank frames as it arrives (the frames of the whole file: asr.features),
then CMVN; the encoder encodes each chunk of `chunk_size` encoder frames once they are all there
(StreamingEncoder.forward_chunk: the whole utterance's output under the same chunk mask); CTC
prefix beam search runs over the chunks (asr.ctc_prefix.StreamingPrefixSearch), its best prefix
the partial result; at an endpoint (trailing silence in the CTC output, or a segment grown to its
maximum length; both off by default) and at the end the attention decoder rescores the prefixes
over the segment's encoder output (search.rescore_prefixes, as `decoding.mode: ctc_rescore` does),
and that is the final text. With endpointing off, the final text of a file is that of the
non-streaming ctc_rescore decode of the same chunked model without length caps.

The model must have been built with causal convolutions (`model.causal_conv: true`) and is best
trained with dynamic chunks (`model.dynamic_chunk: true`) so that any chunk size works. A chunk's
latency: chunk_size encoder frames (chunk_size x subsampling x frame shift: 640 ms for 16 at 4x
and 10 ms) plus the subsampling's right context (6 feature frames at 4x) and the window (25 ms).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from asr.audio import SAMPLE_RATE
from asr.ctc_prefix import StreamingPrefixSearch
from asr.features import FeatureConfig, GlobalCMVN, fbank, frame_sizes, num_frames
from asr.search import SearchOptions, rescore_prefixes
from asr.tokenizer import Tokenizer
from asr.tokens import BLANK

__all__ = ["Event", "Stream", "StreamingOptions"]


@dataclass(frozen=True)
class StreamingOptions:
    chunk_size: int = 16  # encoder frames per chunk (the partial results' step)
    left_chunks: int = -1  # chunks of left context each chunk attends to; -1: all
    beam_size: int = 10  # CTC prefixes kept, and rescored at an endpoint
    ctc_weight: float = 0.5  # of the CTC score in the rescoring; the decoder's is 1 - ctc_weight
    length_bonus: float = 0.0  # per token, in the rescoring
    endpoint_silence: float = 0.0  # seconds of trailing blank frames that end a segment; 0: off
    max_segment: float = 0.0  # seconds after which a segment ends; 0: off

    def __post_init__(self) -> None:
        checks = (("chunk_size", self.chunk_size >= 1), ("left_chunks", self.left_chunks >= -1),
                  ("beam_size", self.beam_size >= 1), ("ctc_weight", 0.0 <= self.ctc_weight <= 1.0),
                  ("endpoint_silence", self.endpoint_silence >= 0), ("max_segment", self.max_segment >= 0))
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
    ASRModel with a streaming encoder, in eval mode on its device."""

    def __init__(self, model: Any, tokenizer: Tokenizer, features: FeatureConfig, cmvn: GlobalCMVN | None,
                 options: StreamingOptions | None = None) -> None:
        self.model, self.tokenizer, self.features, self.cmvn = model, tokenizer, features, cmvn
        self.options = options or StreamingOptions()
        self.device = model.device
        self.dtype = next(model.parameters()).dtype
        self._encoder = model.encoder
        self._state = self._encoder.init_state(1, device=self.device, dtype=self.dtype)
        self._samples = torch.zeros(0)  # waveform not yet framed
        self._window, self._hop = frame_sizes(features)
        self._frame_seconds = 1.0 / model.config.frames_per_second  # of an encoder frame
        self._frames = 0  # encoder frames so far
        self._segment_start = 0  # encoder frame where the open segment starts
        self._memory: list[torch.Tensor] = []  # the open segment's encoder output
        self._search = self._new_search()
        self._partial: tuple[int, ...] = ()
        self.finals: list[Event] = []
        self._finished = False

    def _new_search(self) -> StreamingPrefixSearch:
        like = torch.zeros(0, dtype=torch.float32, device=self.device)
        return StreamingPrefixSearch(batch=1, beam=self.options.beam_size, like=like, blank=BLANK)

    @torch.no_grad()
    def accept_waveform(self, samples: torch.Tensor | Any, rate: int = SAMPLE_RATE) -> list[Event]:
        """The events the next samples (1-D, float in [-1, 1)) bring: a partial when the best guess
        changed, a final at an endpoint. Other rates than 16 kHz are resampled piece by piece."""
        wave = torch.as_tensor(samples, dtype=torch.float32).flatten()
        if rate != SAMPLE_RATE:
            import torchaudio.functional

            wave = torchaudio.functional.resample(wave, rate, SAMPLE_RATE)
        self._samples = torch.cat([self._samples, wave])
        frames = num_frames(self._samples.numel(), self.features)
        if frames == 0:
            return []
        used = (frames - 1) * self._hop + self._window
        feats = fbank(self._samples[:used], self.features)  # (frames, n_mels): the whole file's frames
        self._samples = self._samples[frames * self._hop:]
        return self.accept_feats(feats)

    @torch.no_grad()
    def accept_feats(self, feats: torch.Tensor, *, final: bool = False) -> list[Event]:
        """The events the next filterbank frames (F, n_mels) bring (before CMVN); `final`: the end."""
        if self._finished:
            raise ValueError("the stream is finished")
        if self.cmvn is not None and feats.numel():
            feats = self.cmvn(feats.to(self.cmvn.mean.device))
        feats = feats.to(self.device, self.dtype)[None]
        o = self.options
        h, self._state = self._encoder.forward_chunk(feats, self._state, chunk_size=o.chunk_size,
                                                     left_chunks=o.left_chunks, final=final)
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
        if final:
            self._finished = True
            if self._frames > self._segment_start:
                events.append(self._finish_segment())
        return events

    def finish(self) -> list[Event]:
        """The end of the audio: the last chunk encoded, the last segment's final (if it heard any)."""
        return self.accept_feats(torch.zeros(0, self.features.n_mels), final=True)

    def result(self) -> str:
        """The final texts so far, joined by spaces."""
        return " ".join(e.text for e in self.finals if e.text)

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
        o = self.options
        options = SearchOptions(mode="ctc_rescore", beam_size=o.beam_size, ctc_weight=o.ctc_weight,
                                 length_bonus=o.length_bonus)
        best = rescore_prefixes(self.model, memory, torch.tensor([memory.size(1)], device=memory.device),
                                self._search.prefixes(), options)[0][0]
        event = self._event("final", best.tokens)
        self.finals.append(event)
        self._segment_start, self._memory, self._partial = self._frames, [], ()
        self._search = self._new_search()
        return event

    def _event(self, kind: str, tokens: tuple[int, ...]) -> Event:
        text = self.tokenizer.decode(list(tokens)) if tokens else ""
        return Event(kind, text, tuple(tokens), self._segment_start * self._frame_seconds,
                     self._frames * self._frame_seconds)
