"""Conv2d subsampling front end: (feats, feat_lens) -> (x, x_lens) at 1/4, 1/6 or 1/8 of the frame rate.

The layers of ESPnet's and WeNet's Conv2dSubsampling4/6/8: valid (unpadded) convolutions over time
and frequency, each followed by ReLU, then a linear map of channels x remaining mel bins to d_model.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

# (kernel, stride) of each conv layer, by subsampling rate.
LAYERS: dict[int, tuple[tuple[int, int], ...]] = {
    4: ((3, 2), (3, 2)),
    6: ((3, 2), (5, 3)),
    8: ((3, 2), (3, 2), (3, 2)),
}
RATES = tuple(LAYERS)


def conv_output_length(n, rate: int):
    """Frames (or mel bins) left of `n` (int or long tensor) after the valid convs of `rate`, >= 0.

    Per layer n -> (n - kernel) // stride + 1, i.e. 4x: ((n - 1) // 2 - 1) // 2;
    6x: ((n - 1) // 2 - 2) // 3; 8x: (((n - 1) // 2 - 1) // 2 - 1) // 2. The map is monotonic,
    so clamping once at the end gives 0 for every input shorter than the receptive field.
    """
    for kernel, stride in LAYERS[rate]:
        n = (n - kernel) // stride + 1
    return n.clamp(min=0) if isinstance(n, torch.Tensor) else max(n, 0)


def right_context(rate: int) -> int:
    """Input frames after the first one that output frame 0 depends on: 6 (4x), 10 (6x), 14 (8x)."""
    context, stride = 0, 1
    for kernel, layer_stride in LAYERS[rate]:
        context += (kernel - 1) * stride
        stride *= layer_stride
    return context


class Conv2dSubsampling(nn.Module):
    """(feats (B, T, n_mels), feat_lens (B,)) -> (x (B, T', d_model), x_lens (B,)), T' ~ T / rate.

    Output frame i depends on input frames rate * i .. rate * i + right_context only, so valid
    output frames never see padding. A batch shorter than the receptive field is zero-padded up to
    it (never a conv error): its output has one frame and all its lengths are 0.
    """

    def __init__(self, *, n_mels: int, d_model: int, channels: int, rate: int = 4) -> None:
        super().__init__()
        if rate not in LAYERS:
            raise ValueError(f"subsampling rate {rate} is not one of {RATES}")
        freq = conv_output_length(n_mels, rate)
        if freq < 1:
            raise ValueError(f"{n_mels} mel bins are too few for {rate}x subsampling")
        layers: list[nn.Module] = []
        in_channels = 1
        for kernel, stride in LAYERS[rate]:
            layers += [nn.Conv2d(in_channels, channels, kernel, stride), nn.ReLU()]
            in_channels = channels
        self.rate, self.n_mels = rate, n_mels
        self.receptive_field = right_context(rate) + 1
        self.conv = nn.Sequential(*layers)
        self.out = nn.Linear(channels * freq, d_model)

    def output_lengths(self, feat_lens: torch.Tensor) -> torch.Tensor:
        """Output frames per utterance (B,) long, >= 0; see `conv_output_length`."""
        return conv_output_length(feat_lens, self.rate)

    def forward(self, feats: torch.Tensor, feat_lens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        short = self.receptive_field - feats.size(1)
        if short > 0:
            feats = F.pad(feats, (0, 0, 0, short))
        return self.frames(feats), self.output_lengths(feat_lens)

    def frames(self, feats: torch.Tensor) -> torch.Tensor:
        """The output frames (B, conv_output_length(T), d_model) of feats (B, T, n_mels), T at least
        the receptive field; frame i from input frames rate * i .. rate * i + right_context."""
        x = self.conv(feats.unsqueeze(1))  # (B, C, T', F')
        b, c, t, f = x.shape
        return self.out(x.transpose(1, 2).reshape(b, t, c * f))  # (B, T', d_model)
