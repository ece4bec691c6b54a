"""What a model carries besides its weights, read the same way for both kinds: the model's config,
its frontend (fbank settings and CMVN statistics) and its tokenizer, from a model file's dict
(asr.api.load_model) or an export's description, export.json (asr.onnx_model.load_exported), which
share that layout (DESIGN.md "The model file"), and checked to agree with each other.

    parts = read_parts(load_file(path), str(path), what="model file")
"""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, NamedTuple

from asr.checkpoint import CheckpointError, check_sizes
from asr.config import from_dict
from asr.features import CMVNStats, FeatureConfig, GlobalCMVN
from asr.model import ModelConfig
from asr.tokenizer import Tokenizer, tokenizer_from_dict

__all__ = ["ModelParts", "read_parts", "usable"]


class ModelParts(NamedTuple):
    """A model's config, tokenizer and frontend."""

    config: ModelConfig
    tokenizer: Tokenizer
    features: FeatureConfig
    cmvn: GlobalCMVN


@contextmanager
def usable(source: str, what: str) -> Iterator[None]:
    """A KeyError, TypeError or ValueError inside the block becomes the one-line CheckpointError
    "source: not a usable <what> (reason)"."""
    try:
        yield
    except (KeyError, TypeError, ValueError) as e:
        reason = f"missing {e}" if isinstance(e, KeyError) else str(e).removeprefix(f"{source}: ")
        raise CheckpointError(f"{source}: not a usable {what} ({reason})") from None


def read_parts(obj: dict[str, Any], source: str, *, what: str, tokenizer: Tokenizer | None = None) -> ModelParts:
    """The parts of `obj` ("model": the config, "frontend": {"features", "cmvn"}, "tokenizer": its
    dict), read from `source` (a `what`: "model file", "export description"). `tokenizer`: one the
    caller has read and checked itself (an export's, checked against its graphs), instead of
    obj["tokenizer"]'s. CheckpointError (one line naming `source`) for a part that cannot be read,
    sizes beyond asr.checkpoint.SIZE_LIMITS or frontend values beyond FeatureConfig's bounds, a
    tokenizer read here whose vocabulary is not the model's, or mel bins on which the frontend, its
    CMVN statistics and the model disagree."""
    with usable(source, what):
        config = from_dict(ModelConfig, obj["model"], source=source, prefix="model.")
    check_sizes(config, source)
    with usable(source, what):
        features = from_dict(FeatureConfig, obj["frontend"]["features"], source=source, prefix="frontend.features.")
        cmvn = GlobalCMVN(CMVNStats.from_dict(obj["frontend"]["cmvn"]))
        own = tokenizer is None
        tokenizer = tokenizer_from_dict(obj["tokenizer"]) if own else tokenizer
    if own and tokenizer.vocab_size != config.vocab_size:
        raise CheckpointError(f"{source}: a tokenizer of {tokenizer.vocab_size} tokens for a model of "
                              f"{config.vocab_size}")
    if not features.n_mels == config.n_mels == cmvn.mean.numel():
        raise CheckpointError(f"{source}: {features.n_mels} mel bins in the frontend, {cmvn.mean.numel()} in its "
                              f"CMVN statistics, {config.n_mels} in the model")
    return ModelParts(config, tokenizer, features, cmvn)
