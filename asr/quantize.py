"""int8 weights for CPU decoding: dynamic quantization of every matmul with a weight.

`quantize_int8(model)` returns a copy of an ASRModel whose weight matmuls run in int8: each
weight matrix is quantized once, symmetrically per output channel (row), to int8 and prepacked;
each activation is quantized at every call (dynamic quantization: its range measured then, 7 bits
(see below), asymmetric), and the int32 products are rescaled to float32 with the bias added. Covered: the
attention's packed in-projection (MultiHeadAttention.in_weight, used through F.linear in three
parts: q, k, v together, q alone, k and v together; each part is packed on its own), the attention
output projections, the feed-forward layers, the conformer's position projection and pointwise
convolutions, the subsampling's output Linear, the decoder's output layer and the CTC head. Not
covered (float32): the convolutions, the embedding, LayerNorms, and the attention itself (SDPA of
activations by activations).

The kernel: fbgemm's dynamic int8 linear (`quantized::linear_dynamic` on weights prepacked by
`quantized::linear_prepack`), what `torch.ao.quantization.quantize_dynamic` runs, called directly:
- quantize_dynamic replaces nn.Linear modules only, so the attention's in-projection (a Parameter
  used through F.linear: half of the decoder step's weight matmuls) would stay float32; and it is
  deprecated with the rest of torch.ao.quantization;
- torchao (its successor; 0.18, Int8DynamicActivationInt8WeightConfig) leaves a Parameter used
  through F.linear alone too, and in eager mode runs torch._int_mm, which on a CPU without AMX is
  a reference loop: 16-24x slower than float32 here (measured, 1 thread, AVX2 CPU);
- onednn's qlinear_pointwise takes a per-tensor activation scale only and was slower than fbgemm.
fbgemm was 1.9-4.7x faster than float32 at the decoder step's sizes (10 rows: beam 10) and 1.3-1.5x
at the encoder's (250+ rows), on an AVX2 CPU (2 threads or 1). Activations use 7 bits
(reduce_range), as quantize_dynamic does on x86: without VNNI the kernel's u8 x s8 products are
summed in pairs into int16, which 8-bit activations could overflow.

What outlives the deprecation: only the two ops above are used, in `_prepack` and
`Int8Linear.forward`; torch warns that quantized tensors (the qint8 weight handed to the prepack)
are deprecated. When they go, those two functions change (to the successor's kernel), nothing
else. The exported model (asr.export) has its own int8 path in onnxruntime.

CPU only: the prepacked weights live on the CPU (a CUDA model is refused with a one-line error).
"""
from __future__ import annotations

import copy
import warnings

import torch
from torch import nn

from asr.inference import InferenceModel
from asr.model import IN_PARTS, ASRModel, MultiHeadAttention

__all__ = ["Int8Linear", "int8_model", "is_int8", "quantize_int8"]

REDUCE_RANGE = True  # 7-bit activations: see the module docstring


def _prepack(weight: torch.Tensor, bias: torch.Tensor | None) -> torch.ScriptObject:
    """weight (out, in) float -> int8 per output channel (symmetric, scale = max |w| / 127), prepacked
    with the float bias for fbgemm."""
    weight = weight.detach().float().contiguous()
    scale = (weight.abs().amax(dim=1) / 127.0).clamp(min=1e-12).double()
    zero = torch.zeros(weight.size(0), dtype=torch.long)
    with warnings.catch_warnings():  # the qint8 tensor the prepack takes is deprecated (module docstring)
        warnings.simplefilter("ignore", UserWarning)
        qweight = torch.quantize_per_channel(weight, scale, zero, 0, torch.qint8)
    return torch.ops.quantized.linear_prepack(qweight, None if bias is None else bias.detach().float())


class Int8Linear(nn.Module):
    """y = x W^T + b with W int8 per output channel and x quantized per call; x (..., in) float32
    -> (..., out) float32. No parameters: inference only."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.in_features, self.out_features = weight.size(1), weight.size(0)
        self.packed = _prepack(weight, bias)

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> Int8Linear:
        return cls(linear.weight, linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.quantized.linear_dynamic(x.float(), self.packed, REDUCE_RANGE)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8"

    def __deepcopy__(self, memo: dict) -> Int8Linear:  # the packed weights are immutable: share them
        return self


def quantize_int8(model: ASRModel) -> ASRModel:
    """A copy of `model` (left as it is) whose weight matmuls run in int8 (module docstring), in eval
    mode, for decoding on the CPU. ValueError for a model on another device."""
    device = next(model.parameters()).device
    if device.type != "cpu":
        raise ValueError(f"decoding.int8 runs on the CPU, not on {device}")
    quantized = copy.deepcopy(model).eval()
    for module in list(quantized.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, nn.Linear):
                setattr(module, name, Int8Linear.from_linear(child))
        if isinstance(module, MultiHeadAttention):
            module.int8_in = nn.ModuleDict({
                part: Int8Linear(module.in_weight[module.in_rows(part)], module.in_bias[module.in_rows(part)])
                for part in IN_PARTS})
            # the float in-projection stays (a Parameter the decoder's state_dict names), unused
    return quantized


def is_int8(model: object) -> bool:
    """Whether `model` decodes with int8 weights: a quantize_int8 copy, or an exported model's int8
    graphs (asr.onnx_model.OnnxModel.int8)."""
    if isinstance(model, nn.Module):
        return any(isinstance(m, Int8Linear) for m in model.modules())
    return bool(getattr(model, "int8", False))


def int8_model(model: InferenceModel) -> InferenceModel:
    """`model` with int8 weights: itself when it has them, a quantize_int8 copy of an ASRModel, or an
    exported model's int8 graphs (OnnxModel.int8_model). The one place that tells the two kinds
    apart for int8: asr.decoding.DecodingTask and asr.api.Recognizer ask it, and never look."""
    if is_int8(model):
        return model
    if isinstance(model, ASRModel):
        return quantize_int8(model)
    return model.int8_model()
