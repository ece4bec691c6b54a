"""Word timings and confidence: the decoded tokens of each segment aligned to the encoder frames by
the CTC head (a batched Viterbi over the CTC topology), grouped into words, mapped to seconds.

    words = align_words(model, memory, memory_lens, token_lists, tokenizer)   # one list per utterance

The alignment: the best CTC path (blanks between the tokens, a token's frames contiguous) that emits
exactly the hypothesis's tokens, found for all utterances at once (`ctc_viterbi`). A token's frames
are those where the path is on it; a word is the tokens from one that begins a word (sentencepiece's
"▁" pieces; a character after a space) to the next.

Time: encoder frame i sees feature frames rate * i .. rate * i + right_context (asr.model.subsampling),
and feature frame j the samples of [j * shift, j * shift + window); so frame i is centred at
i * rate * shift + (right_context * shift + window) / 2. A word starts half a frame step (rate * shift
/ 2) before the centre of its first token's first frame and ends half a step after the centre of its
last token's last frame (not after the next word's start), inside the segment.

Confidence: for each token, the largest CTC posterior of that token over its aligned frames; a
word's confidence is the geometric mean over its tokens (in [0, 1]). A hypothesis CTC cannot emit
in its frames (more tokens and repeats than frames: a decoder that ran past what the audio holds)
has no alignment: its words share the segment's span in proportion to their characters, with
confidence 0.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import torch

from asr.inference import InferenceModel
from asr.model import ctc_feasible
from asr.tokenizer import SPACE, Tokenizer
from asr.tokens import BLANK, real_tokens

__all__ = ["Word", "align_words", "ctc_viterbi", "frame_centres", "word_groups"]


class Word(NamedTuple):
    """A word of a transcript: its text, start and end (seconds from the start of its segment, or
    of the file in a Result), and confidence in [0, 1]."""

    text: str
    start: float
    end: float
    confidence: float


def ctc_viterbi(log_probs: torch.Tensor, lengths: torch.Tensor, targets: torch.Tensor,
                target_lens: torch.Tensor) -> torch.Tensor:
    """The best CTC path of each utterance that emits exactly its targets.

    log_probs (B, T, V), lengths (B,) frames, targets (B, L) (-1 padded, no blank), target_lens (B,):
    (B, T) long, the index k of the target the path is on at each frame, -1 on blank frames and past
    the utterance's length. Every utterance must be feasible (asr.model.ctc_feasible).
    """
    b, t_max, _ = log_probs.shape
    device = log_probs.device
    width = 2 * targets.size(1) + 1
    ext = torch.full((b, width), BLANK, dtype=torch.long, device=device)  # blank y1 blank y2 ... blank
    if targets.size(1):
        ext[:, 1::2] = targets.clamp(min=0)
    states = torch.arange(width, device=device)
    valid = states[None] < 2 * target_lens[:, None] + 1  # (B, S)
    skip = torch.zeros(b, width, dtype=torch.bool, device=device)  # s - 2 -> s allowed
    skip[:, 2:] = (ext[:, 2:] != BLANK) & (ext[:, 2:] != ext[:, :-2])
    neg = torch.tensor(float("-inf"), device=device)
    emit = log_probs.float().gather(2, ext[:, None, :].expand(b, t_max, width))  # (B, T, S)
    score = torch.where(states[None] < 2, emit[:, 0], neg)  # start on the first blank or the first token
    score = torch.where(valid, score, neg)
    back = torch.zeros(t_max, b, width, dtype=torch.uint8, device=device)  # 0 stay, 1 from s-1, 2 from s-2
    for t in range(1, t_max):
        one = torch.cat([neg.expand(b, 1), score[:, :-1]], dim=1)
        two = torch.where(skip, torch.cat([neg.expand(b, 2), score[:, :-2]], dim=1), neg)
        best, step = torch.stack([score, one, two]).max(dim=0)
        running = (t < lengths)[:, None]
        score = torch.where(running, torch.where(valid, best + emit[:, t], neg), score)
        back[t] = torch.where(running, step, 0).to(torch.uint8)
    last = 2 * target_lens  # the final blank; the final token is one before it
    rows = torch.arange(b, device=device)
    end_token = (last - 1).clamp(min=0)
    state = torch.where((target_lens > 0) & (score[rows, end_token] > score[rows, last]), end_token, last)
    path = torch.full((b, t_max), -1, dtype=torch.long, device=device)
    for t in range(t_max - 1, -1, -1):
        inside = t < lengths
        path[:, t] = torch.where(inside & (state % 2 == 1), state // 2, -1)
        state = torch.where(inside, state - back[t, rows, state].long(), state)
    return path


def frame_centres(model: InferenceModel, frames: int, frame_length_ms: float) -> torch.Tensor:
    """Seconds (frames,) float64: the centre of what each encoder frame sees (see the module
    docstring), for feature frames of `frame_length_ms` every model.config.frame_shift_ms."""
    rate, shift = model.config.subsampling, model.config.frame_shift_ms
    right_context = model.min_frames - 1  # feature frames beyond the first
    offset = (right_context * shift + frame_length_ms) / 2
    return (torch.arange(frames, dtype=torch.float64) * rate * shift + offset) / 1000.0


def word_groups(tokens: Sequence[int], tokenizer: Tokenizer) -> list[tuple[str, list[int]]]:
    """The words of `tokens`: (text, the indices into tokens that spell it), in order. A token whose
    piece begins with the word separator (or a character after a space) begins a word; tokens that
    spell nothing (blank, unk, sos/eos) join the word they are in."""
    spelling = real_tokens(tokenizer.vocab_size)
    chars = tokenizer.kind == "char"
    words: list[tuple[str, list[int]]] = []
    after_space = True
    for i, token in enumerate(tokens):
        piece = tokenizer.piece(token) if token in spelling else ""
        if chars and piece in (" ", SPACE):  # a character tokenizer's space: ends the word
            after_space = True
            continue
        starts = piece.startswith(SPACE) or (chars and after_space and bool(piece))
        text = piece.removeprefix(SPACE)
        if starts or not words:
            words.append((text, [i]))
        else:
            words[-1] = (words[-1][0] + text, words[-1][1] + [i])
        after_space = False
    return [(text, idx) for text, idx in words if text]


@torch.no_grad()
def align_words(model: InferenceModel, memory: torch.Tensor, memory_lens: torch.Tensor,
                token_lists: Sequence[Sequence[int]], tokenizer: Tokenizer, durations: Sequence[float], *,
                frame_length_ms: float = 25.0) -> list[list[Word]]:
    """The words of each utterance's tokens with their times (seconds from the utterance's start,
    within [0, durations[b]]) and confidence; see the module docstring. `frame_length_ms`: the
    feature window (FeatureConfig.frame_length_ms)."""
    b = memory.size(0)
    log_probs = model.ctc_log_probs(memory)  # (B, T, V) float32
    groups = [word_groups(tokens, tokenizer) for tokens in token_lists]
    kept = [[i for _, idx in g for i in idx if token_lists[u][i] != BLANK] for u, g in enumerate(groups)]
    targets = torch.full((b, max((len(k) for k in kept), default=0)), -1, dtype=torch.long)
    for u, k in enumerate(kept):
        targets[u, :len(k)] = torch.tensor([token_lists[u][i] for i in k], dtype=torch.long)
    target_lens = torch.tensor([len(k) for k in kept])
    lens = memory_lens.cpu()
    feasible = ctc_feasible(targets, target_lens, lens) | (target_lens == 0)
    path = ctc_viterbi(log_probs.cpu(), lens, targets, target_lens)  # infeasible rows: read below, not used
    centres = frame_centres(model, log_probs.size(1), frame_length_ms)
    half = model.config.subsampling * model.config.frame_shift_ms / 2000.0
    out = []
    for u in range(b):
        if not groups[u]:
            out.append([])
        elif not bool(feasible[u]):
            out.append(_proportional(groups[u], durations[u]))
        else:
            out.append(_timed(groups[u], kept[u], path[u], log_probs[u].cpu(), token_lists[u], centres, half,
                              durations[u]))
    return out


def _timed(groups: list[tuple[str, list[int]]], kept: list[int], path: torch.Tensor, log_probs: torch.Tensor,
           tokens: Sequence[int], centres: torch.Tensor, half: float, duration: float) -> list[Word]:
    """Words from one utterance's path (T,) over its kept token indices."""
    position = {token_index: k for k, token_index in enumerate(kept)}  # token index -> target index
    frames: dict[int, list[int]] = {}
    for t, k in enumerate(path.tolist()):
        if k >= 0:
            frames.setdefault(k, []).append(t)
    spans = []
    for text, idx in groups:
        ks = [position[i] for i in idx if i in position]
        first = min(frames[k][0] for k in ks)
        last = max(frames[k][-1] for k in ks)
        logs = [max(float(log_probs[t, tokens[kept[k]]]) for t in frames[k]) for k in ks]
        confidence = math.exp(sum(logs) / len(logs))
        spans.append((text, float(centres[first]) - half, float(centres[last]) + half, confidence))
    words = []
    for n, (text, start, end, confidence) in enumerate(spans):
        following = spans[n + 1][1] if n + 1 < len(spans) else duration
        start = min(max(start, 0.0), duration)
        words.append(Word(text, start, min(max(end, start), following, duration), confidence))
    return words


def _proportional(groups: list[tuple[str, list[int]]], duration: float) -> list[Word]:
    """The segment's span shared by the words in proportion to their characters, confidence 0."""
    total = sum(len(text) for text, _ in groups)
    words, at = [], 0.0
    for text, _ in groups:
        end = at + duration * len(text) / total
        words.append(Word(text, at, end, 0.0))
        at = end
    return words
