"""Our fast CPU decoding paths as extra rows of the peer benchmark (decoding only): the same
weights as `Ours` (the same random model, eos bias included), the same search, the same forced
lengths, through

- "int8": asr.quantize's int8 copy of the model (every weight matmul in fbgemm's dynamic int8
  linear), what `asr decode / transcribe --int8` runs on a model file;
- "onnx": the exported model (asr.export: `asr export`, float32 graphs) in onnxruntime
  (asr.onnx_model), what `--model DIR` runs;
- "onnx-int8": the exported model's int8 graphs (`asr export --int8`, then `--int8`).

Export needs the `export` extra (onnx, onnxscript, onnxruntime); `variant(...)` raises ImportError
naming it where it is missing, and bench.py then leaves the variant's rows out. The export (and
quantization) happens once per model, when the first exported variant is built (one export with
int8 graphs serves both), and is not timed.
"""
from __future__ import annotations

import atexit
import logging
import shutil
import tempfile
import warnings
from pathlib import Path

import spec
import torch
from ours import Ours

from asr.checkpoint import model_file, save_atomic
from asr.config import to_dict
from asr.features import CMVNStats, FeatureConfig
from asr.tokenizer import CharTokenizer

VARIANTS = ("int8", "onnx", "onnx-int8")


def variant(name: str, ours: Ours) -> Ours:
    """The toolkit adapter (spec.Toolkit, decoding only) of our variant `name` (VARIANTS) of `ours`'s model."""
    if name not in VARIANTS:
        raise ValueError(f"unknown variant {name!r}; known: {', '.join(VARIANTS)}")
    if name == "int8":
        from asr.quantize import quantize_int8

        return _Variant(ours, name, quantize_int8(ours.model))
    if getattr(ours, "exported", None) is None:  # one export (float32 and int8 graphs) per model
        ours.exported = _export(ours)
    return _Variant(ours, name, ours.exported.int8_model() if name == "onnx-int8" else ours.exported)


class _Variant(Ours):
    """`Ours` whose decoding runs on another model of the same weights (`search_model`)."""

    def __init__(self, ours: Ours, name: str, search_model) -> None:
        self.model, self.optimizer, self.cmvn = ours.model, None, None
        self.name = f"ours {name}"
        self.variant = name
        self.search_model = search_model

    def train_step(self, batch: spec.TrainBatch) -> float:
        raise NotImplementedError(f"{self.name} decodes only")


def _export(ours: Ours):
    """`ours`'s model written as a model file and exported (asr.export, with int8 graphs) into a
    temporary folder (removed at exit); the loaded OnnxModel, its sessions on torch's intra-op
    thread count. The exporter's and quantizer's notes are silenced, as `asr export` does."""
    from asr.export import export_model
    from asr.onnx_model import load_exported, require_extra

    require_extra("onnx", "onnxscript", "onnxruntime")
    folder = Path(tempfile.mkdtemp(prefix="bench-peers-export-"))
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    config = ours.model.config
    tokenizer = CharTokenizer([chr(0x4E00 + i) for i in range(config.vocab_size - 3)])  # V = spec.VOCAB
    stats = CMVNStats()
    stats.add(torch.randn(100, config.n_mels, dtype=torch.float64))
    features = FeatureConfig(n_mels=config.n_mels)
    path = folder / "model.pt"
    save_atomic(model_file(model=to_dict(config), tokenizer=tokenizer.to_dict(),
                           frontend={"features": to_dict(features), "cmvn": stats.to_dict()},
                           state_dict=ours.model.state_dict()), path)
    levels = {name: logging.getLogger(name).level for name in ("", "torch.onnx")}
    try:
        for name in levels:
            logging.getLogger(name).setLevel(logging.ERROR)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", module="torch.onnx")
            export_model(path, folder / "export", int8=True)
    finally:
        for name, level in levels.items():
            logging.getLogger(name).setLevel(level)
    return load_exported(folder / "export", int8=True, threads=torch.get_num_threads()).model
