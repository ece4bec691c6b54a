"""Energy-based segmentation of long audio (no model): a 16 kHz stream cut at pauses into pieces
of at most `SegmentOptions.max_seconds`, a tiny last piece joined to the one before, and a test of
whether a piece is loud enough to hold speech. asr.api decodes the pieces.

    for start, wave in segment_audio(blocks, SegmentOptions(max_seconds=20.0)):   # (first sample, (T,))
        ...
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch

from asr.audio import SAMPLE_RATE

__all__ = ["FRAME", "SegmentOptions", "frame_db", "has_speech", "segment_audio"]

FRAME = SAMPLE_RATE // 100  # 10 ms: the frame of the energy measure


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


def frame_db(wave: torch.Tensor) -> torch.Tensor:
    """Energy (F,) in dBFS of the whole 10 ms frames of a (T,) waveform in [-1, 1]."""
    frames = wave[: wave.numel() // FRAME * FRAME].view(-1, FRAME)
    return 10.0 * torch.log10(frames.square().mean(dim=1) + 1e-10)


def has_speech(wave: torch.Tensor, speech_db: float) -> bool:
    """Whether the loudest 10 ms frame of a (T,) waveform reaches `speech_db` dBFS."""
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
