"""Attention pictures: where the decoder looks in the audio while it writes each token, and where
the encoder's frames and the decoder's positions look among themselves.

Three kinds of picture (KINDS), each a heatmap per layer of the attention weights, mean over heads,
of one utterance alone (no padding):
- "cross": the decoder's cross-attention of one teacher-forced pass over a token sequence (sos +
  tokens in, tokens + eos predicted): one row per output token (its piece on the y axis, eos
  last), one column per encoder frame. A model that has learned to align draws a bright diagonal
  from the top left to the bottom right; a blurred or vertical band says it has not.
- "encoder_self": the encoder's self-attention, encoder frame over encoder frame (a band along
  the diagonal: local context; vertical stripes: frames every query reads, often silence).
- "decoder_self": the decoder's causal self-attention of the same pass, output token over input
  token (sos + tokens): the lower triangle, often bright on the diagonal and just below it.

`asr decode --plot-attention N` draws the three kinds for the best hypotheses (asr.decode:
`attention_pictures`, files named by `picture_name`); training draws the cross-attention of the
reference transcripts of a few validation utterances at each validation (asr.asr_task:
`cross_attention` and `AttentionFigure`).

The weights come from the explicit attention path (the encoders' and TransformerDecoder's
`forward_with_attention`), in the model's dtype (float32) without autocast. matplotlib is imported
when a picture is drawn, and pyplot never: a Figure drawn on its own Agg canvas leaves the
process's backend alone.
"""
from __future__ import annotations

import math
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from asr.fileio import atomic_open
from asr.model import ASRModel
from asr.tokenizer import Tokenizer

__all__ = ["KINDS", "AttentionFigure", "attention_picture", "attention_pictures", "attention_weights",
           "cross_attention", "draw_attention", "frame_ms", "picture_name", "token_labels", "write_png"]

KINDS = {  # kind -> (what the picture shows, its rows, its columns), in the order decode draws them
    "cross": ("cross-attention", "output token", "encoder frame"),
    "encoder_self": ("encoder self-attention", "encoder frame", "encoder frame"),
    "decoder_self": ("decoder self-attention", "output token", "input token"),
}
MAX_LABELS = 60  # token labels drawn on an axis at most (every k-th token beyond)
MAX_TITLE = 120  # characters of the title (the id and the text) at most
DPI = 80
INCHES = {"token": 0.16, "frame": 1 / 40}  # the length of an axis entry, by what the axis counts
LABEL_INCHES = 0.13  # room a token label (7 points) needs along its axis


@torch.no_grad()
def cross_attention(model: ASRModel, memory: torch.Tensor, tokens: Sequence[int]) -> torch.Tensor:
    """The decoder's cross-attention (layers, L + 1, S) float32 on the CPU, mean over heads, of
    the tokens (L ids, no sos / eos) teacher-forced over one utterance's encoder output memory
    (S, d): row l is the step that predicts token l (the last: eos). Computed in the model's
    dtype without autocast; the model should be in eval mode (dropout would blur the pictures)."""
    device, dtype = memory.device, model.decoder.output.weight.dtype  # the model's (a bf16 memory: float32)
    inputs = torch.tensor([[model.config.sos, *tokens]], device=device)  # (1, L + 1)
    lengths = torch.tensor([inputs.size(1), memory.size(0)], device=device)
    with torch.autocast(device.type, enabled=False):
        out = model.decoder.forward_with_attention(inputs, lengths[:1], memory[None].to(dtype), lengths[1:])
    return out.cross_attention[:, 0].mean(dim=1).float().cpu()  # (layers, L + 1, S)


@torch.no_grad()
def attention_weights(model: ASRModel, feats: torch.Tensor, tokens: Sequence[int]) -> dict[str, torch.Tensor]:
    """The weights of each kind (KINDS) for one utterance, float32 on the CPU, mean over heads: its
    features feats (T, n_mels) (normalized as the model expects, at least its receptive field)
    encoded, and the tokens (L ids, no sos / eos) teacher-forced over that encoder output:
    "cross" (layers, L + 1, S), "encoder_self" (layers, S, S), "decoder_self" (layers, L + 1, L + 1).
    One pass of each, in the model's dtype without autocast; the model should be in eval mode."""
    device, dtype = feats.device, model.decoder.output.weight.dtype
    inputs = torch.tensor([[model.config.sos, *tokens]], device=device)  # (1, L + 1)
    lengths = torch.tensor([feats.size(0), inputs.size(1)], device=device)
    with torch.autocast(device.type, enabled=False):
        encoded = model.encoder.forward_with_attention(feats[None].to(dtype), lengths[:1])
        decoded = model.decoder.forward_with_attention(inputs, lengths[1:], encoded.memory, encoded.memory_lens)
    weights = {"cross": decoded.cross_attention, "encoder_self": encoded.self_attention,
               "decoder_self": decoded.self_attention}  # (layers, 1, H, rows, columns) each
    return {kind: weights[kind][:, 0].mean(dim=1).float().cpu() for kind in KINDS}


def token_labels(tokenizer: Tokenizer, tokens: Sequence[int]) -> list[str]:
    """The y-axis labels of `tokens` + eos: their pieces, a space as "▁" (sentencepiece's word
    mark), eos as "<eos>"."""
    pieces = [tokenizer.piece(int(t)) for t in tokens]
    return [p if p.strip() else "▁" for p in pieces] + ["<eos>"]


class AttentionFigure:
    """The picture of attention weights of one shape (layers, rows, columns) of one kind (KINDS,
    default "cross"): one panel per layer, each scaled from 0 to its largest weight. `labels` (one
    per row) and `columns` (one per column) label token axes; None numbers the entries (frames).
    `frame_ms`, when given, is written beside the name of a frame axis.

    Axes, labels and title are drawn once; `draw` with new weights then redraws the heatmaps alone
    (blitting, about ten times cheaper than drawing the figure): training redraws the same
    utterances and tokens at every validation."""

    def __init__(self, shape: Sequence[int], labels: Sequence[str] | None, *, title: str = "",
                 frame_ms: float | None = None, kind: str = "cross", columns: Sequence[str] | None = None) -> None:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure

        if kind not in KINDS:
            raise ValueError(f"attention picture kind {kind!r} is not one of {', '.join(KINDS)}")
        what, row_axis, column_axis = KINDS[kind]
        self.shape = layers, steps, frames = tuple(shape)
        width = min(max(_inches(frames, column_axis), 2.5), 7.0, 24.0 / layers)  # inches per panel
        square = _unit(row_axis) == _unit(column_axis)  # self-attention: square panels
        panel = width if square else min(max(_inches(steps, row_axis), 1.5), 10.0)  # a panel's height
        row_ticks, column_ticks = _ticks(labels, steps, panel), _ticks(columns, frames, width)
        left = 0.4 + 0.07 * max(len(label) for label in row_ticks[1] or [str(steps)])  # inches for the labels
        below = 0.07 * max(map(len, column_ticks[1])) if column_ticks[1] else 0.0  # rotated column labels
        height = panel + 1.0 + below
        self.figure = Figure(figsize=(left + 0.2 + width * layers, height), dpi=DPI)
        self.canvas = FigureCanvasAgg(self.figure)
        axes = self.figure.subplots(1, layers, sharey=True, squeeze=False)[0]
        self.images = [ax.imshow(np.zeros((steps, frames)), aspect="auto", interpolation="nearest", cmap="viridis")
                       for ax in axes]
        for layer, ax in enumerate(axes):
            ax.set_title(f"layer {layer + 1}", fontsize=9)
            ax.set_xlabel(_axis_name(column_axis, frame_ms), fontsize=8)
            ax.tick_params(labelsize=7)
            if columns is not None:
                ax.set_xticks(*column_ticks, rotation=90)
        if labels is not None:
            axes[0].set_yticks(*row_ticks)
        axes[0].set_ylabel(_axis_name(row_axis, frame_ms), fontsize=8)
        self.figure.suptitle(_title(title, what), fontsize=9)
        total = self.figure.get_figwidth()
        self.figure.subplots_adjust(left=left / total, right=1 - 0.2 / total, bottom=(0.7 + below) / height,
                                    top=1 - 0.55 / height, wspace=0.08)
        self.background = None  # the canvas without the panels (heatmaps and their frames), once drawn

    def draw(self, weights: torch.Tensor) -> np.ndarray:
        """The picture (H, W, 4) uint8 RGBA of weights (layers, rows, columns) of this figure's shape."""
        if tuple(weights.shape) != self.shape:
            raise ValueError(f"attention weights of shape {tuple(weights.shape)} in a figure of {self.shape}")
        panels = [(image, *image.axes.spines.values()) for image in self.images]  # drawn in this order
        if self.background is None:  # everything but the panels, once
            for artist in (a for panel in panels for a in panel):
                artist.set_visible(False)
            self.canvas.draw()
            self.background = self.canvas.copy_from_bbox(self.figure.bbox)
            for artist in (a for panel in panels for a in panel):
                artist.set_visible(True)
        self.canvas.restore_region(self.background)
        for panel, layer in zip(panels, weights.float().numpy()):
            panel[0].set_data(layer)
            panel[0].set_clim(0.0, max(float(layer.max()), 1e-9))
            for artist in panel:
                panel[0].axes.draw_artist(artist)
        return np.asarray(self.canvas.buffer_rgba()).copy()


def _ticks(labels: Sequence[str] | None, count: int, inches: float) -> tuple[range, list[str]]:
    """The tick positions and labels of an axis of `count` entries and `inches` long: every k-th of
    `labels`, at most MAX_LABELS and one per LABEL_INCHES; no labels (None): no positions either
    (matplotlib numbers the axis)."""
    if labels is None:
        return range(0), []
    every = math.ceil(count / max(1, min(MAX_LABELS, int(inches / LABEL_INCHES))))
    return range(0, count, every), [labels[i] for i in range(0, count, every)]


def _unit(axis: str) -> str:
    """What an axis counts: the last word of its name (INCHES' keys)."""
    return axis.rsplit(" ", 1)[-1]


def _inches(count: int, axis: str) -> float:
    """The natural length of an axis of `count` tokens or frames."""
    return count * INCHES[_unit(axis)]


def _axis_name(axis: str, frame_ms: float | None) -> str:
    """The axis's name, with the milliseconds of a frame when it counts frames and they are known."""
    return axis + (f" ({frame_ms:g} ms)" if frame_ms and axis.endswith("frame") else "")


def _title(title: str, what: str) -> str:
    """`title` (cut to MAX_TITLE characters) followed by what the picture shows, in brackets."""
    if not title:
        return what
    return (title if len(title) <= MAX_TITLE else title[:MAX_TITLE - 3] + "...") + f"  [{what}]"


def draw_attention(weights: torch.Tensor, labels: Sequence[str] | None, *, title: str = "",
                   frame_ms: float | None = None, kind: str = "cross",
                   columns: Sequence[str] | None = None) -> np.ndarray:
    """The picture (H, W, 4) uint8 RGBA of weights (layers, rows, columns): `AttentionFigure` drawn once."""
    figure = AttentionFigure(weights.shape, labels, title=title, frame_ms=frame_ms, kind=kind, columns=columns)
    return figure.draw(weights)


def attention_picture(model: ASRModel, tokenizer: Tokenizer, memory: torch.Tensor, tokens: Sequence[int], *,
                      title: str = "") -> np.ndarray:
    """`draw_attention` of `cross_attention(model, memory, tokens)`, labelled with the pieces."""
    weights = cross_attention(model, memory, tokens)
    return draw_attention(weights, token_labels(tokenizer, tokens), title=title, frame_ms=frame_ms(model))


def attention_pictures(model: ASRModel, tokenizer: Tokenizer, feats: torch.Tensor, tokens: Sequence[int], *,
                       title: str = "") -> dict[str, np.ndarray]:
    """The picture (H, W, 4) uint8 RGBA of each kind (KINDS, in that order) of `attention_weights(model,
    feats, tokens)`: token axes labelled with the pieces (outputs: tokens + eos; inputs: sos + tokens),
    frame axes numbered."""
    weights = attention_weights(model, feats, tokens)
    outputs = token_labels(tokenizer, tokens)
    inputs = ["<sos>", *outputs[:-1]]
    labels = {"cross": (outputs, None), "encoder_self": (None, None), "decoder_self": (outputs, inputs)}  # rows, cols
    return {kind: draw_attention(weights[kind], labels[kind][0], columns=labels[kind][1], title=title,
                                 frame_ms=frame_ms(model), kind=kind) for kind in KINDS}


def frame_ms(model: ASRModel) -> float:
    """Milliseconds of audio per encoder frame."""
    return 1000.0 / model.config.frames_per_second


def picture_name(utt_id: str, kind: str = "cross") -> str:
    """The file name of an utterance's picture of `kind` (KINDS): <id>.png for the cross-attention
    (the name it has always had), <id>.<kind>.png for the others; path separators in the id as "_"."""
    if kind not in KINDS:
        raise ValueError(f"attention picture kind {kind!r} is not one of {', '.join(KINDS)}")
    stem = utt_id.replace("/", "_").replace(os.sep, "_")
    return f"{stem}.png" if kind == "cross" else f"{stem}.{kind}.png"


def write_png(image: np.ndarray, path: str | os.PathLike) -> Path:
    """Write an (H, W, 3 or 4) uint8 image as a PNG (atomically; the folder is made); the path."""
    from matplotlib.image import imsave

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_open(path, "wb") as f:
        imsave(f, image, format="png")
    return path
