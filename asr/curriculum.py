"""A length curriculum for corpora of long utterances: the first epochs train on pieces of them.

CTC learns which tokens it hears from where its alignments put them; with a model that knows
nothing yet, the alignment of a long utterance is spread over seconds of audio around each
token's place, so a long utterance says little about any one frame. On 14 s utterances (eSpeak NG
speaking LibriSpeech sentences) the small config's CTC loss stayed on its plateau, near chance,
for 5,000 steps, while the same text spoken in 5 s pieces left it within 500 (recipes/README.md).
Transcripts carry no times, so the pieces are cut where the text says: an utterance of d seconds
becomes round(d / piece_seconds) pieces, the words dealt in proportion to their characters, each
piece's audio the same share of the utterance's time, widened by `margin` seconds on both sides
so that a word at a cut is heard whole in at least one piece. The cut is approximate (speech
does not keep a constant rate): the pieces are a start, and training goes on to whole utterances.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from asr.manifest import Utterance

__all__ = ["split_epochs", "split_utterance", "split_utterances"]

MARGIN = 0.15  # seconds added to each side of a piece (within the utterance)


def split_utterance(utt: Utterance, piece_seconds: float, margin: float = MARGIN) -> list[Utterance]:
    """`utt` as round(duration / piece_seconds) pieces (ids "<id>@<k>"), or [utt] when that is
    one piece or its text has fewer words than pieces. The pieces' texts are the utterance's words
    in order, split where the characters (a space counted with each word) reach k / pieces of the
    whole; piece k's audio spans the same share of the utterance's time, +- margin."""
    words = utt.text.split()
    pieces = min(round(utt.duration / piece_seconds), len(words))
    if pieces <= 1:
        return [utt]
    cum = [0]  # characters before each word, a space counted with each
    for word in words:
        cum.append(cum[-1] + len(word) + 1)
    total = cum[-1]
    bounds = [0]
    for k in range(1, pieces):  # the cut nearest k / pieces of the characters, a word at least each side
        lo, hi = bounds[-1] + 1, len(words) - (pieces - k)
        bounds.append(min(range(lo, hi + 1), key=lambda i: abs(cum[i] * pieces - k * total)))
    bounds.append(len(words))
    speed = utt.speed
    start = utt.start or 0.0
    file_seconds = utt.duration * speed  # of the file the utterance spans
    out = []
    for k in range(len(bounds) - 1):
        a, b = bounds[k], bounds[k + 1]
        lo = max(0.0, file_seconds * cum[a] / total - margin * speed)
        hi = min(file_seconds, file_seconds * cum[b] / total + margin * speed)
        # the last piece ends where the utterance does: its own end, or the file's (a manifest's
        # duration may be a little off the file's length, which a segment's end may not pass)
        end = utt.end if k == len(bounds) - 2 else round(start + hi, 4)
        out.append(dataclasses.replace(
            utt, id=f"{utt.id}@{k}", text=" ".join(words[a:b]), start=round(start + lo, 4),
            end=end, duration=round(hi - lo, 4) / speed))
    return out


def split_utterances(utts: Sequence[Utterance], piece_seconds: float, margin: float = MARGIN) -> list[Utterance]:
    """Every utterance split by `split_utterance`, in order."""
    return [piece for utt in utts for piece in split_utterance(utt, piece_seconds, margin)]


def split_epochs(utts: Sequence[Utterance], split_hours: float) -> int:
    """The epochs of pieces that make about `split_hours` of audio: round(split_hours / the hours
    of `utts`), at least one; 0 without a curriculum (split_hours 0)."""
    if not split_hours:
        return 0
    hours = sum(u.duration for u in utts) / 3600
    return max(1, round(split_hours / max(hours, 1e-9)))
