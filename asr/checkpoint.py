"""Model files and training checkpoints: one self-contained file each, written atomically.

A model file (DESIGN.md) is a plain dict

    {"format": "asr-model", "version": 1, "model": {...}, "frontend": {...},
     "tokenizer": {...}, "state_dict": {...}}

holding only dicts, lists, strings, numbers, bytes and tensors, so that it loads with
`torch.load(..., weights_only=True)`, the only way we ever load one. Training checkpoints use
the same rules with format "asr-checkpoint".
"""
from __future__ import annotations

import re
import warnings
import zipfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from asr.fileio import atomic_open

MODEL_FORMAT = "asr-model"
CHECKPOINT_FORMAT = "asr-checkpoint"
VERSION = 1

__all__ = ["MODEL_FORMAT", "CHECKPOINT_FORMAT", "VERSION", "CheckpointError", "save_atomic", "load_file",
           "model_file", "average_state_dicts"]


class CheckpointError(ValueError):
    """A model or checkpoint file that cannot be used; the message names the file."""


def save_atomic(obj: Mapping[str, Any], path: str | Path) -> None:
    """torch.save to a temporary file in the same folder, fsync, then rename over `path`:
    a reader (or a crash) never sees a half-written file. A write that fails (a full disk)
    raises OSError "[Errno N] reason: 'path'", leaving the previous `path` as it was and no
    temporary file."""
    _check_plain(obj, "")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        with atomic_open(path, "wb") as f:
            torch.save(dict(obj), f)
    except RuntimeError as e:  # torch.save reports a failed write as "unexpected pos ..."
        cause = e.__context__
        if not isinstance(cause, OSError) or cause.errno is None:
            raise
        raise OSError(cause.errno, cause.strerror, str(path)) from None
    except OSError as e:
        if e.errno is None or e.filename is not None:
            raise
        raise OSError(e.errno, e.strerror, str(path)) from None


_PLAIN = (str, int, float, bool, bytes, type(None), torch.Size)  # exact types: np.float64 is a float


def _check_plain(obj: Any, where: str) -> None:
    """Refuse, at save time, anything torch.load(weights_only=True) would refuse at load time."""
    if isinstance(obj, dict):
        for k, v in obj.items():
            if not isinstance(k, (str, int)):
                raise TypeError(f"cannot save key {k!r} at '{where}': keys must be str or int")
            _check_plain(v, f"{where}.{k}" if where else str(k))
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            _check_plain(v, f"{where}[{i}]")
    elif type(obj) not in _PLAIN and not isinstance(obj, torch.Tensor):
        raise TypeError(f"cannot save {type(obj).__name__} at '{where}': model files hold only dicts, lists, "
                        "strings, numbers, bytes and tensors")


def load_file(path: str | Path, expected_format: str = MODEL_FORMAT, map_location: Any = "cpu") -> dict[str, Any]:
    """Load a model file or checkpoint with weights_only=True and check its envelope.

    CheckpointError "path: reason" (one line) for a missing file, a directory, an empty file, a
    file of another kind (text, a zip archive, numpy, TorchScript), a damaged one, one holding
    Python objects other than tensors and plain data (refused: nothing in it runs), another
    format or a newer version.
    """
    path = Path(path)
    problem = _file_problem(path)
    if problem:
        raise CheckpointError(f"{path}: {problem}")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch's notes on pickle protocols and archives
            obj = torch.load(path, map_location=map_location, weights_only=True)
    except Exception as e:  # pickle / zip errors, or objects weights_only refuses
        raise CheckpointError(f"{path}: {_load_problem(e, expected_format)}") from None
    if not isinstance(obj, dict) or "format" not in obj:
        raise CheckpointError(f"{path}: not an {expected_format} file (no format field)")
    if obj["format"] != expected_format:
        raise CheckpointError(f"{path}: is an '{obj['format']}' file, expected '{expected_format}'")
    version = obj.get("version")
    if not isinstance(version, int) or isinstance(version, bool) or version < 1:
        raise CheckpointError(f"{path}: has no valid format version ({version!r})")
    if version > VERSION:
        raise CheckpointError(f"{path}: format version {version!r} is newer than this toolkit reads "
                              f"({VERSION}); upgrade the toolkit")
    return obj


def _file_problem(path: Path) -> str | None:
    """What is wrong with `path` before torch.load reads it, if visible from its first bytes."""
    if not path.exists():
        return "no such file"
    if not path.is_file():
        return "is a directory, not a model file" if path.is_dir() else "not a regular file"
    if path.stat().st_size == 0:
        return "empty file (0 bytes)"
    with open(path, "rb") as f:
        head = f.read(8)
    if head.startswith(b"PK\x03\x04"):
        return _zip_problem(path)
    if head.startswith(b"\x93NUMPY"):
        return "a numpy array file, not a model file"
    if head[:1] != b"\x80":  # the PROTO opcode every pickle and torch.save file begins with
        return "not a file written by torch.save (text or another format)"
    return None


def _zip_problem(path: Path) -> str | None:
    """Why a zip archive is not a torch.save file, if it is not."""
    try:
        with zipfile.ZipFile(path) as archive:
            names = archive.namelist()
    except (zipfile.BadZipFile, OSError, ValueError) as e:
        return f"a damaged or truncated zip archive ({e})"
    if not any(name.endswith("/data.pkl") for name in names):
        return "a zip archive, but not one written by torch.save"
    if any(name.endswith("/constants.pkl") or "/code/" in name for name in names):
        return "a TorchScript archive (torch.jit.save), not a model file written by asr train / asr average"
    return None


def _load_problem(e: Exception, expected_format: str) -> str:
    """One line for what torch.load(weights_only=True) raised."""
    text = " ".join(str(e).split())
    if "Weights only load failed" in text:
        found = re.search(r"GLOBAL ([\w.]+)", text) or re.search(r"(Unsupported operand \d+)", text)
        what = f" ({found[1]})" if found else ""
        return (f"refused: holds Python objects other than tensors and plain data{what}, which loading could run; "
                f"an {expected_format} file never does, so nothing in it was loaded")
    if isinstance(e, EOFError) or "failed reading zip archive" in text or "failed finding central directory" in text:
        return f"damaged or truncated ({text[:160] or type(e).__name__})"
    return f"not a loadable {expected_format} file ({text[:200] or type(e).__name__})"


def model_file(*, model: Mapping[str, Any], frontend: Mapping[str, Any], tokenizer: Mapping[str, Any],
               state_dict: Mapping[str, torch.Tensor]) -> dict[str, Any]:
    """The DESIGN.md model-file dict (configs as plain dicts, tensors moved to the CPU)."""
    return {
        "format": MODEL_FORMAT,
        "version": VERSION,
        "model": dict(model),
        "frontend": dict(frontend),
        "tokenizer": dict(tokenizer),
        "state_dict": {k: v.detach().cpu() for k, v in state_dict.items()},
    }


def average_state_dicts(state_dicts: Sequence[Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Element-wise mean of floating-point tensors (accumulated in float64); other tensors
    (step counters, integer buffers) are taken from the last state dict."""
    if not state_dicts:
        raise ValueError("no state dicts to average")
    keys = list(state_dicts[-1].keys())
    for i, sd in enumerate(state_dicts):
        if list(sd.keys()) != keys:
            missing = sorted(set(keys) ^ set(sd.keys()))
            raise ValueError(f"state dict {i} has different parameters: {missing[:3]}")
    out = {}
    for k in keys:
        last = state_dicts[-1][k]
        if last.is_floating_point():
            total = sum(sd[k].double() for sd in state_dicts)
            out[k] = (total / len(state_dicts)).to(last.dtype)
        else:
            out[k] = last.clone()
    return out
