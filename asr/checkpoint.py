"""Model files and training checkpoints: one self-contained file each, written atomically; the
checkpoint index of an experiment folder, pruning, resuming and averaging.

A model file (DESIGN.md) is a plain dict

    {"format": "asr-model", "version": 1, "model": {...}, "frontend": {...},
     "tokenizer": {...}, "state_dict": {...}}

holding only dicts, lists, strings, numbers, bytes and tensors, so that it loads with
`torch.load(..., weights_only=True)`, the only way we ever load one. A language model file
(asr.neural_lm) is the same kind of dict of format "asr-lm" (model config, tokenizer, weights).
`load_weights` builds the network a file's config describes and gives it the file's weights,
checking the one against the other before any memory is allocated (on the meta device), so a
small file asking for a huge network costs nothing. Training checkpoints use the same rules with
format "asr-checkpoint": the model file they hold (its format in "model_format"), plus the
optimizer, scaler, random and loop states.

A training run keeps its checkpoints in EXP/checkpoints/ckpt-<step>.pt with an index,
EXP/checkpoints/index.json = [{"file", "step", "epoch", "valid_loss"}], oldest first: the newest
is where a rerun resumes, the best validated ones are what `average` averages.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import random
import re
import warnings
import zipfile
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch

from asr.config import config_diff, read_yaml
from asr.fileio import atomic_open, remove_stale_temporaries

MODEL_FORMAT = "asr-model"
CHECKPOINT_FORMAT = "asr-checkpoint"
LM_FORMAT = "asr-lm"  # a language model file (asr.neural_lm)
# what a checkpoint adds to the model file it holds
_TRAINING_KEYS = ("format", "version", "model_format", "optimizer", "scaler", "state", "valid_loss", "rng")
VERSION = 1

__all__ = ["MODEL_FORMAT", "CHECKPOINT_FORMAT", "LM_FORMAT", "VERSION", "SIZE_LIMITS", "CheckpointError",
           "TrainingError", "save_atomic", "load_file", "check_sizes", "load_weights", "model_file",
           "average_state_dicts", "average", "checkpoint_dir",
           "clean_experiment", "check_or_save_config", "read_index", "resume", "resume_hint", "rng_state",
           "save_checkpoint", "set_rng_state", "Resumed"]

log = logging.getLogger("asr.train")


class CheckpointError(ValueError):
    """A model or checkpoint file that cannot be used; the message names the file."""


class TrainingError(RuntimeError):
    """Training cannot go on (a refused resume, too many non-finite steps, a checkpoint that cannot
    be written, a lost rank, running out of memory under DDP); one line."""


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


# ---------------------------------------------------------------------------------------------
# the network a file describes, built to its weights


# The largest sizes a model or LM file's config may ask for: far beyond any model this toolkit
# trains (conf/librispeech_*: d_model 512, 18 layers), small enough that building the network on
# the meta device and comparing it with the weights stays instant.
SIZE_LIMITS = {"vocab_size": 2**20, "n_mels": 512, "conv_channels": 8192, "d_model": 16384, "n_heads": 256,
               "ffn_dim": 131072, "decoder_ffn_dim": 131072, "encoder_layers": 256, "decoder_layers": 256,
               "n_layers": 256, "conv_kernel": 1023, "max_chunk": 100_000}


def check_sizes(config: Any, source: str) -> None:
    """CheckpointError "source: model.<field> = N is more than this toolkit loads (at most M)" for a
    size of `config` (a ModelConfig or LMConfig) beyond SIZE_LIMITS."""
    for name, limit in SIZE_LIMITS.items():
        value = getattr(config, name, None)
        if isinstance(value, int) and value > limit:
            raise CheckpointError(f"{source}: model.{name} = {value} is more than this toolkit loads "
                                  f"(at most {limit})")


def load_weights(build: Callable[[], torch.nn.Module], state_dict: Any, source: str, config: Any, *,
                 layers: Mapping[str, str], what: str = "model file") -> torch.nn.Module:
    """The network `build()` makes from `config`, holding the file's weights `state_dict`.

    Nothing is allocated before the two are known to agree: `layers` ({"encoder.layers.":
    "encoder_layers", ...}: where the weights of each stack of layers are, and the config field
    that counts them) is compared with the weights' names first, then the network is built on the
    meta device (no storage) and its parameters' names and shapes compared with the weights'; only
    then do the file's tensors become its parameters (float32, as the network was built; no copy of
    float32 weights). So memory is what the file holds, whatever its config asks for.
    CheckpointError "source: ..." (one line, naming the config field where it can be told, else
    the tensor) for weights that are not a dict of tensors (a `what` file's), or that do not fit
    the config."""
    if not isinstance(state_dict, dict) or not all(isinstance(k, str) and isinstance(v, torch.Tensor)
                                                   for k, v in state_dict.items()):
        raise CheckpointError(f"{source}: not a usable {what} (state_dict is not a dict of tensors)")
    for prefix, field in layers.items():
        held = {int(k[len(prefix):].split(".", 1)[0]) for k in state_dict
                if k.startswith(prefix) and k[len(prefix):].split(".", 1)[0].isdigit()}
        count = getattr(config, field)
        if held != set(range(count)):
            stack = prefix.rstrip(".").replace(".", " ")
            what = f"{len(held)} {stack}" if len(held) != count else f"{stack} numbered {sorted(held)[:4]}..."
            raise CheckpointError(f"{source}: model.{field} = {count} disagrees with the weights, which hold {what}")
    try:
        with torch.device("meta"):
            model = build()
    except (RuntimeError, ValueError) as e:  # a config its own checks let through
        reason = " ".join(str(e).split())[:160]
        raise CheckpointError(f"{source}: the model's config cannot be built ({reason})") from None
    expected = model.state_dict()
    _check_names(expected, state_dict, source)
    tensors = {}
    for key, want in expected.items():
        tensor = state_dict[key]
        if tuple(tensor.shape) != tuple(want.shape):
            raise CheckpointError(f"{source}: {_disagreement(config, key, tuple(tensor.shape), tuple(want.shape))}")
        if tensor.layout != torch.strided or tensor.device.type != "cpu" or tensor.is_quantized or tensor.is_complex():
            raise CheckpointError(f"{source}: weight '{key}' is not a plain real-valued tensor")
        tensors[key] = tensor.to(want.dtype)
    tied = _tied_parameters(model)
    model.load_state_dict(tensors, assign=True)
    for name, first in tied.items():  # assign=True gave each name its own tensor: share them again
        owner, _, attribute = name.rpartition(".")
        setattr(model.get_submodule(owner), attribute, model.get_parameter(first))
    left = [name for name, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:
        raise RuntimeError(f"{type(model).__name__}: {left[0]} is not in its state_dict, so it cannot be loaded")
    return model


def _check_names(expected: Mapping[str, torch.Tensor], state_dict: Mapping[str, torch.Tensor], source: str) -> None:
    missing = [k for k in expected if k not in state_dict]
    extra = [k for k in state_dict if k not in expected]
    for keys, what in ((missing, "lack"), (extra, "hold")):
        if keys:
            more = f" (and {len(keys) - 1} more)" if len(keys) > 1 else ""
            raise CheckpointError(f"{source}: weights do not fit the model: they {what} '{keys[0]}'{more}, which "
                                  f"its config {'asks for' if what == 'lack' else 'has no place for'}")


def _disagreement(config: Any, key: str, held: tuple[int, ...], wanted: tuple[int, ...]) -> str:
    """Which config field makes tensor `key` `wanted` where the file holds `held`: the integer
    fields equal to the first size that differs (the tensor alone when none is)."""
    where = f"'{key}' is {held} in the weights, {wanted} for the config"
    if len(held) != len(wanted):
        return f"weights do not fit the model: {where}"
    size = next(w for h, w in zip(held, wanted) if h != w)
    fields = [f"model.{f.name}" for f in dataclasses.fields(config)
              if type(getattr(config, f.name)) is int and getattr(config, f.name) == size]
    if not fields:
        return f"weights do not fit the model: {where}"
    return f"{' or '.join(fields)} = {size} disagrees with the weights ({where})"


def _tied_parameters(model: torch.nn.Module) -> dict[str, str]:
    """{name: the first name of the same parameter} for every parameter reachable by two names."""
    first: dict[int, str] = {}
    tied = {}
    for name, parameter in model.named_parameters(remove_duplicate=False):
        if id(parameter) in first:
            tied[name] = first[id(parameter)]
        else:
            first[id(parameter)] = name
    return tied


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


# ---------------------------------------------------------------------------------------------
# the checkpoints of an experiment folder


def checkpoint_dir(exp: str | Path) -> Path:
    return Path(exp) / "checkpoints"


def _index_path(folder: Path) -> Path:
    return folder / "index.json"


def read_index(folder: Path) -> list[dict[str, Any]]:
    """EXP/checkpoints/index.json: [{"file", "step", "epoch", "valid_loss"}] of the checkpoints kept."""
    path = _index_path(folder)
    try:
        entries = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else []
        return [e for e in entries if (folder / e["file"]).is_file()]
    except (ValueError, TypeError, KeyError) as e:  # edited by hand
        raise TrainingError(f"{path}: not a checkpoint index ({e}); remove it to start from scratch") from None


def resume_hint(exp: Path) -> str:
    """Where a rerun of the same command resumes from."""
    last = read_index(checkpoint_dir(exp))
    if not last:
        return "rerun the same command to start again (no checkpoint yet)"
    return f"rerun the same command to resume from {checkpoint_dir(exp) / last[-1]['file']}"


def rng_state(device: torch.device | None = None) -> dict[str, Any]:
    """This process's random states: torch's CPU generator, its own CUDA device's (None on a CPU),
    numpy's and python's global generators."""
    cuda = device is not None and device.type == "cuda"
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    numpy = {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
             "has_gauss": int(has_gauss), "gauss": float(gauss)}  # tensors and scalars: weights_only loads them
    return {"torch": torch.get_rng_state(), "cuda": torch.cuda.get_rng_state(device) if cuda else None,
            "numpy": numpy, "python": random.getstate()}


def set_rng_state(states: Mapping[str, Any], device: torch.device | None = None) -> None:
    """Restore what `rng_state` returned (the CUDA state onto `device`, when both have one)."""
    torch.set_rng_state(states["torch"].cpu())
    random.setstate(_as_tuple(states["python"]))
    numpy = states.get("numpy")
    if numpy is not None:
        keys = numpy["keys"].cpu().numpy().astype(np.uint32)
        np.random.set_state((numpy["kind"], keys, numpy["pos"], numpy["has_gauss"], numpy["gauss"]))
    cuda = states.get("cuda")
    if isinstance(cuda, list):  # written by one process holding every device's state
        if cuda and torch.cuda.is_available():
            torch.cuda.set_rng_state_all([s.cpu() for s in cuda])
    elif cuda is not None and device is not None and device.type == "cuda":
        torch.cuda.set_rng_state(cuda.cpu(), device)


def save_checkpoint(exp: Path, envelope: Mapping[str, Any], *, optimizer: torch.optim.Optimizer,
                    scaler: torch.amp.GradScaler, state: Mapping[str, Any], valid_loss: float | None,
                    keep_last: int, keep_best: int, rng: Sequence[Mapping[str, Any]] | None = None) -> Path:
    """Write EXP/checkpoints/ckpt-<step>.pt atomically: the model file `envelope` (`model_file`)
    with the optimizer, scaler, random states and the loop's `state` (a dict holding "step" and
    "epoch"); then index it and prune old ones. `rng`: every rank's `rng_state()`, in rank order
    (None: this process's alone). A failed write (a full disk) is a TrainingError; the checkpoints
    written before are intact."""
    obj = dict(envelope)
    obj.update(
        format=CHECKPOINT_FORMAT, version=VERSION, model_format=envelope["format"],
        optimizer=optimizer.state_dict(), scaler=scaler.state_dict(),
        state=dict(state),
        valid_loss=valid_loss,
        rng=list(rng) if rng is not None else [rng_state()],
    )
    folder = checkpoint_dir(exp)
    path = folder / f"ckpt-{state['step']:08d}.pt"
    try:
        save_atomic(obj, path)
        _write_index(folder, state["step"], state["epoch"], valid_loss)
        _prune(folder, keep_last, keep_best)
    except OSError as e:
        raise TrainingError(f"cannot write checkpoint {path}: {e.strerror or e}; training stopped, "
                            f"nothing saved is lost: once fixed, {resume_hint(exp)}") from None
    return path


def _write_index(folder: Path, step: int, epoch: int, valid_loss: float | None) -> None:
    name = f"ckpt-{step:08d}.pt"
    entries = [e for e in read_index(folder) if e["file"] != name]
    entries.append({"file": name, "step": step, "epoch": epoch, "valid_loss": valid_loss})
    with atomic_open(_index_path(folder)) as f:
        f.write(json.dumps(sorted(entries, key=lambda e: e["step"]), indent=1))


def _prune(folder: Path, keep_last: int, keep_best: int) -> None:
    """Keep the newest `keep_last` checkpoints and the `keep_best` best validated ones."""
    entries = read_index(folder)
    keep = {e["file"] for e in entries[-keep_last:]} if keep_last > 0 else set()
    validated = sorted((e for e in entries if e["valid_loss"] is not None), key=lambda e: e["valid_loss"])
    keep |= {e["file"] for e in validated[:keep_best]}
    keep.add(entries[-1]["file"])
    for e in entries:
        if e["file"] not in keep:
            (folder / e["file"]).unlink(missing_ok=True)
    with atomic_open(_index_path(folder)) as f:
        f.write(json.dumps([e for e in entries if e["file"] in keep], indent=1))


def check_or_save_config(exp: Path, config: dict[str, Any], *, save: bool,
                         complete: Callable[[dict[str, Any]], dict[str, Any]] | None = None) -> None:
    """Refuse to resume into an EXP trained with another config (EXP/config.yaml); when there is
    none yet, write `config` there if `save` (rank 0). `complete` fills the saved config's missing
    keys with their defaults, so that a key added to the configs since does not refuse an old EXP."""
    path = exp / "config.yaml"
    if path.is_file():
        saved = read_yaml(path)
        diff = config_diff(complete(saved) if complete else saved, config)
        if diff:
            raise TrainingError(f"{exp} was trained with another config; use a new --exp-dir or the same "
                                f"config. Differences (saved -> now): {'; '.join(diff)}")
    elif save:
        import yaml

        exp.mkdir(parents=True, exist_ok=True)
        with atomic_open(path) as f:
            f.write(yaml.safe_dump(config, sort_keys=False))


def clean_experiment(exp: Path) -> None:
    """Remove the temporary files of writes a kill interrupted (EXP, its tokenizer, its checkpoints)."""
    for folder in (exp, exp / "tokenizer", checkpoint_dir(exp)):
        remove_stale_temporaries(folder)


class Resumed(NamedTuple):
    """What `resume` found: the checkpoint, the loop state it saved, and how many processes wrote
    it (how many ranks' random states it holds)."""

    path: Path
    state: dict[str, Any]
    processes: int


def resume(exp: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler, *,
           map_location: Any = "cpu", rank: int = 0, world_size: int = 1) -> Resumed | None:
    """Load the newest checkpoint of EXP into the model, optimizer and scaler and restore rank
    `rank`'s random states (only when it was written by `world_size` processes: the caller seeds
    otherwise); None when there is no checkpoint yet."""
    entries = read_index(checkpoint_dir(exp))
    if not entries:
        return None
    path = checkpoint_dir(exp) / entries[-1]["file"]
    ckpt = load_file(path, CHECKPOINT_FORMAT, map_location=map_location)
    model.load_state_dict(ckpt["state_dict"])
    optimizer.load_state_dict(ckpt["optimizer"])
    scaler.load_state_dict(ckpt["scaler"])
    rngs = ckpt["rng"]
    if not isinstance(rngs, list):  # an older version's: one process's states
        rngs = [rngs]
    if len(rngs) == world_size:
        device = map_location if isinstance(map_location, torch.device) else None
        set_rng_state(rngs[rank], device)
    return Resumed(path, ckpt["state"], len(rngs))


def _as_tuple(x: Any) -> Any:
    return tuple(_as_tuple(v) for v in x) if isinstance(x, (list, tuple)) else x


def average(exp_dir: str | Path, *, by: str = "best", num: int = 5, out: str | Path | None = None) -> Path:
    """Average the `num` best (validation loss) or last checkpoints of EXP into one model file."""
    folder = checkpoint_dir(exp_dir)
    entries = read_index(folder)
    if by == "best":
        entries = sorted((e for e in entries if e["valid_loss"] is not None), key=lambda e: e["valid_loss"])
    else:
        entries = sorted(entries, key=lambda e: e["step"], reverse=True)
    if not entries:
        raise TrainingError(f"{folder}: no {'validated ' if by == 'best' else ''}checkpoints to average")
    chosen = entries[:num]
    if len(chosen) < num:
        log.warning("only %d checkpoint(s) available (asked for %d): averaging those", len(chosen), num)
    ckpts = [load_file(folder / e["file"], CHECKPOINT_FORMAT) for e in chosen]
    # every checkpoint of one EXP holds the same model file around its weights (an ASR model's, or
    # a language model's: LM_FORMAT)
    obj = {key: value for key, value in ckpts[0].items() if key not in _TRAINING_KEYS}
    obj.update(format=ckpts[0].get("model_format", MODEL_FORMAT), version=VERSION,
               state_dict=average_state_dicts([c["state_dict"] for c in ckpts]))
    out = Path(out) if out else Path(exp_dir) / ("lm_avg.pt" if obj["format"] == LM_FORMAT else "model_avg.pt")
    save_atomic(obj, out)
    names = ", ".join(f"{e['file']} (valid loss {e['valid_loss']:.4f})" if e["valid_loss"] is not None
                      else e["file"] for e in chosen)
    log.info("averaged %d checkpoint(s) by %s: %s", len(chosen), by, names)
    return out
