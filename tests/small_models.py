"""The small random-weight model shared by the model and search tests."""
from __future__ import annotations

import dataclasses

import torch

from asr.model import ASRModel, ModelConfig

SMALL = ModelConfig(vocab_size=13, n_mels=16, conv_channels=8, d_model=32, n_heads=4, ffn_dim=64,
                    encoder_layers=2, decoder_layers=2, dropout=0.0)


def small_model(seed: int = 0, **changes) -> ASRModel:
    """SMALL (with `changes`) initialized from `seed`, in eval mode."""
    torch.manual_seed(seed)
    return ASRModel(dataclasses.replace(SMALL, **changes)).eval()
