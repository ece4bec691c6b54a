"""The network: conv2d subsampling, transformer or conformer encoder, cached transformer decoder, CTC head;
and the token-level transformer LM.

Network math only: no I/O, no decoding policy, nothing imported from the rest of `asr` but the
token ids of the leaf `asr.tokens`.
"""
from __future__ import annotations

from asr.model.asr_model import (
    ASRModel,
    ModelConfig,
    ModelOutput,
    build_model,
    check_ctc_feasible,
    count_parameters,
    ctc_feasible,
)
from asr.model.attention import IN_PARTS, MultiHeadAttention, key_mask
from asr.model.conformer import ConformerEncoder, RelPositionAttention
from asr.model.decoder import DecoderCache, ExportedStepCache, TransformerDecoder
from asr.model.encoder import EncoderAttention, EncoderState, LayerCache, TransformerEncoder, sinusoidal_positions
from asr.model.lm import LMConfig, TransformerLM
from asr.model.subsampling import Conv2dSubsampling, conv_output_length, right_context

__all__ = [
    "IN_PARTS",
    "ASRModel",
    "ConformerEncoder",
    "Conv2dSubsampling",
    "DecoderCache",
    "EncoderAttention",
    "EncoderState",
    "LayerCache",
    "LMConfig",
    "ModelConfig",
    "ModelOutput",
    "ExportedStepCache",
    "MultiHeadAttention",
    "RelPositionAttention",
    "TransformerDecoder",
    "TransformerEncoder",
    "TransformerLM",
    "build_model",
    "check_ctc_feasible",
    "conv_output_length",
    "count_parameters",
    "ctc_feasible",
    "key_mask",
    "right_context",
    "sinusoidal_positions",
]
