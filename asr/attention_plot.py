"""Attention pictures: where the decoder looks in the audio while it writes each token.

A picture is a heatmap per decoder layer of the cross-attention weights, mean over heads, of one
teacher-forced decoder pass over a token sequence (sos + tokens in, tokens + eos predicted) with
the encoder output of that utterance alone (no padding): one row per output token (its piece on
the y axis, eos last), one column per encoder frame. A model that has learned to align draws a
bright diagonal from the top left to the bottom right; a blurred or vertical band says it has not.

`asr decode --plot-attention N` draws the best hypotheses (asr.decode); training draws the
reference transcripts of a few validation utterances at each validation (asr.train_task).

The weights come from the decoder's explicit attention path (TransformerDecoder.
forward_with_attention), in the model's dtype (float32) without autocast. matplotlib is imported
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

__all__ = ["AttentionFigure", "attention_picture", "cross_attention", "draw_attention", "frame_ms", "picture_name",
           "token_labels", "write_png"]

MAX_LABELS = 60  # y-axis labels drawn at most (every k-th token beyond)
MAX_TITLE = 120  # characters of the title (the id and the text) at most
DPI = 80


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


def token_labels(tokenizer: Tokenizer, tokens: Sequence[int]) -> list[str]:
    """The y-axis labels of `tokens` + eos: their pieces, a space as "▁" (sentencepiece's word
    mark), eos as "<eos>"."""
    pieces = [tokenizer.piece(int(t)) for t in tokens]
    return [p if p.strip() else "▁" for p in pieces] + ["<eos>"]


class AttentionFigure:
    """The picture of cross-attention weights of one shape (layers, L, S): one panel per layer,
    output tokens `labels` (L) down, encoder frames across (`frame_ms` of audio each, when given,
    in the axis label), each panel scaled from 0 to its largest weight.

    Axes, labels and title are drawn once; `draw` with new weights then redraws the heatmaps alone
    (blitting, about ten times cheaper than drawing the figure): training redraws the same
    utterances and tokens at every validation."""

    def __init__(self, shape: Sequence[int], labels: Sequence[str], *, title: str = "",
                 frame_ms: float | None = None) -> None:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure

        self.shape = layers, steps, frames = tuple(shape)
        every = math.ceil(steps / MAX_LABELS)
        shown = [labels[i] for i in range(0, steps, every)]
        left = 0.4 + 0.07 * max(len(label) for label in shown)  # inches for the labels
        width = min(max(frames / 40, 2.5), 7.0, 24.0 / layers)  # inches per panel
        height = min(max(steps * 0.16, 1.5), 10.0) + 1.0
        self.figure = Figure(figsize=(left + 0.2 + width * layers, height), dpi=DPI)
        self.canvas = FigureCanvasAgg(self.figure)
        axes = self.figure.subplots(1, layers, sharey=True, squeeze=False)[0]
        self.images = [ax.imshow(np.zeros((steps, frames)), aspect="auto", interpolation="nearest", cmap="viridis")
                       for ax in axes]
        for layer, ax in enumerate(axes):
            ax.set_title(f"layer {layer + 1}", fontsize=9)
            ax.set_xlabel("encoder frame" + (f" ({frame_ms:g} ms)" if frame_ms else ""), fontsize=8)
            ax.tick_params(labelsize=7)
        axes[0].set_yticks(range(0, steps, every), shown)
        axes[0].set_ylabel("output token", fontsize=8)
        if title:
            self.figure.suptitle(title if len(title) <= MAX_TITLE else title[:MAX_TITLE - 3] + "...", fontsize=9)
        total = self.figure.get_figwidth()
        self.figure.subplots_adjust(left=left / total, right=1 - 0.2 / total, bottom=0.7 / height,
                                    top=1 - (0.55 if title else 0.35) / height, wspace=0.08)
        self.background = None  # the canvas without the panels (heatmaps and their frames), once drawn

    def draw(self, weights: torch.Tensor) -> np.ndarray:
        """The picture (H, W, 4) uint8 RGBA of weights (layers, L, S) of this figure's shape."""
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


def draw_attention(weights: torch.Tensor, labels: Sequence[str], *, title: str = "",
                   frame_ms: float | None = None) -> np.ndarray:
    """The picture (H, W, 4) uint8 RGBA of weights (layers, L, S): `AttentionFigure` drawn once."""
    return AttentionFigure(weights.shape, labels, title=title, frame_ms=frame_ms).draw(weights)


def attention_picture(model: ASRModel, tokenizer: Tokenizer, memory: torch.Tensor, tokens: Sequence[int], *,
                      title: str = "") -> np.ndarray:
    """`draw_attention` of `cross_attention(model, memory, tokens)`, labelled with the pieces."""
    weights = cross_attention(model, memory, tokens)
    return draw_attention(weights, token_labels(tokenizer, tokens), title=title, frame_ms=frame_ms(model))


def frame_ms(model: ASRModel) -> float:
    """Milliseconds of audio per encoder frame."""
    return 1000.0 / model.config.frames_per_second


def picture_name(utt_id: str) -> str:
    """The file name of an utterance's picture: <id>.png, path separators in the id as "_"."""
    return utt_id.replace("/", "_").replace(os.sep, "_") + ".png"


def write_png(image: np.ndarray, path: str | os.PathLike) -> Path:
    """Write an (H, W, 3 or 4) uint8 image as a PNG (atomically; the folder is made); the path."""
    from matplotlib.image import imsave

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_open(path, "wb") as f:
        imsave(f, image, format="png")
    return path
