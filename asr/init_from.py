"""Start a training run from another model's weights (`asr train --init-from MODEL.pt`), as
ESPnet's init_param and icefall's fine-tuning do.

    summary = init_from(model, "exp/synth/model_avg.pt", ("encoder", "decoder", "ctc"), tokenizer)

The named modules of `model` (a freshly built ASRModel) take the model file's weights, parameter
by parameter. Their shapes must agree (the same dimensions, layers and encoder kind): a mismatch is
a ValueError naming the first parameters that differ, nothing is loaded. When the model file's
tokenizer is not this run's, the layers whose rows are tokens (the decoder's embedding and output
projection, the CTC head) keep their fresh initialisation: the token ids mean other things. The
returned line says what was loaded and what was not. The frontend (filterbank settings and CMVN
statistics) is the run's own: a fine-tuned model normalises its features with the statistics of
the data it is tuned on.
"""
from __future__ import annotations

from pathlib import Path

import torch

from asr.checkpoint import load_file
from asr.tokenizer import Tokenizer

__all__ = ["INIT_MODULES", "TOKEN_LAYERS", "init_from"]

INIT_MODULES = ("encoder", "decoder", "ctc")  # the model's parts that can be loaded
TOKEN_LAYERS = ("decoder.embed.", "decoder.output.", "ctc.")  # parameters with a row (or an entry) per token


def init_from(model: torch.nn.Module, path: str | Path, modules: tuple[str, ...] | list[str],
              tokenizer: Tokenizer) -> str:
    """Load `modules` of `model` from the model file at `path` (see the module docstring); returns
    a one-line summary for the log. CheckpointError for an unreadable file, ValueError for an
    unknown module name or parameters whose shapes differ."""
    unknown = sorted(set(modules) - set(INIT_MODULES))
    if unknown or not modules:
        raise ValueError(f"training.init_modules: {unknown or 'empty'}; choose from {', '.join(INIT_MODULES)}")
    obj = load_file(path)
    source, own = obj["state_dict"], model.state_dict()
    same_tokens = obj.get("tokenizer") == tokenizer.to_dict()
    prefixes = tuple(f"{m}." for m in modules)
    loaded, fresh, problems = {}, [], []
    for name, tensor in own.items():
        if not name.startswith(prefixes):
            continue
        if not same_tokens and name.startswith(TOKEN_LAYERS):
            fresh.append(name)
            continue
        theirs = source.get(name)
        if theirs is None:
            problems.append(f"{name} is not in it")
        elif theirs.shape != tensor.shape:
            problems.append(f"{name} is {tuple(theirs.shape)} there, {tuple(tensor.shape)} here")
        else:
            loaded[name] = theirs
    if problems:
        more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
        raise ValueError(f"{path}: cannot initialise {', '.join(modules)} from it: {'; '.join(problems[:3])}{more}; "
                         "the model sections must agree (dimensions, layers, encoder kind)")
    with torch.no_grad():
        for name, value in loaded.items():
            own[name].copy_(value)  # state_dict tensors share the parameters' storage
    line = f"init from {path}: {', '.join(modules)} loaded ({len(loaded)} tensors)"
    if fresh:
        layers = sorted({n.rsplit(".", 1)[0] for n in fresh})
        old = (obj.get("model") or {}).get("vocab_size", "?")
        line += (f"; {', '.join(layers)} re-initialised: its tokenizer is not this run's "
                 f"({old} -> {tokenizer.vocab_size} symbols)")
    return line
