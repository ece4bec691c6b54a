"""Neural language models: the file of a token-level transformer LM (asr.model.lm), and its fusion
into beam search. Training one on text is asr.lm_train's.

    asr lm --kind transformer --text corpus.txt.gz --tokenizer exp/lang --config conf/lm/synth.yaml \\
        --exp-dir exp/lm          # (under torchrun for several processes) -> exp/lm/lm_last.pt
    asr average --exp-dir exp/lm  # -> exp/lm/lm_avg.pt
    asr decode --model exp/asr/model_avg.pt --manifest dev.jsonl --out-dir d --lm exp/lm/lm_avg.pt --lm-weight 0.3

The LM reads the ASR model's tokens: the same tokenizer (its ids, blank and unk included, sos/eos
V - 1), one normalized sentence per line (asr.metrics.normalize_text, as transcripts are), from
sos, predicting every token and then eos. Its file, format "asr-lm", holds the LM's config, the
tokenizer it was trained with, its hash, and the weights (nothing but dicts, strings, numbers,
bytes and tensors: it loads with weights_only=True); decoding with an LM of another tokenizer is
refused in one line.

Fusion (`TransformerLMScorer`, a full scorer of asr.scorer): every step the LM scores the whole
vocabulary for all rows (utterances x beam) in one batched call with its own KV cache (the
decoder's DecoderCache without memory, reordered as the decoder's is), and beam search adds
lm_weight x its log-probabilities to each candidate: over a hypothesis, lm_weight x ln P_LM(tokens,
eos) (eos is scored when the hypothesis ends; a hypothesis cut at the length limit is not charged
for it, as with the decoder). The pre-beam ranks tokens on the decoder's and the LM's weighted
scores together, so the LM can bring in a token the decoder alone would not have offered.
"""
from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from asr.checkpoint import LM_FORMAT, VERSION, CheckpointError, check_sizes, load_file, load_weights
from asr.model import DecoderCache, LMConfig, TransformerLM
from asr.scorer import CacheScorer
from asr.tokenizer import Tokenizer, tokenizer_from_dict

__all__ = ["NeuralLM", "TransformerLMScorer", "is_neural_lm", "lm_file", "load_neural_lm", "tokenizer_hash"]


# ---------------------------------------------------------------------------------------------
# the file


def tokenizer_hash(tokenizer: dict) -> str:
    """sha256 (hex) of a tokenizer's `to_dict()`: its kind and its pieces (sentencepiece model bytes
    or the character list)."""
    digest = hashlib.sha256(str(tokenizer.get("kind")).encode())
    for key in sorted(tokenizer):
        value = tokenizer[key]
        digest.update(key.encode())
        digest.update(value if isinstance(value, bytes) else json.dumps(value, sort_keys=True).encode())
    return digest.hexdigest()


def lm_file(*, model: dict, tokenizer: dict, state_dict: dict) -> dict[str, Any]:
    """The LM file's dict (tensors moved to the CPU)."""
    return {"format": LM_FORMAT, "version": VERSION, "model": dict(model), "tokenizer": dict(tokenizer),
            "tokenizer_sha256": tokenizer_hash(tokenizer),
            "state_dict": {k: v.detach().cpu() for k, v in state_dict.items()}}


def is_neural_lm(path: str | os.PathLike) -> bool:
    """Whether `path` is a torch file (a zip archive: an LM file, or another torch file that
    `load_neural_lm` refuses in one line) rather than an ARPA text (plain or gzip)."""
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"PK\x03\x04"
    except OSError:
        return False


@dataclass
class NeuralLM:
    """A loaded LM: the network (eval mode) and the tokenizer it was trained with."""

    model: TransformerLM
    tokenizer: dict
    path: str

    @property
    def config(self) -> LMConfig:
        return self.model.config

    def check_tokenizer(self, tokenizer: Tokenizer, model_path: str = "the model") -> None:
        """ValueError in one line unless `tokenizer` is the one the LM was trained with."""
        if tokenizer_hash(tokenizer.to_dict()) != tokenizer_hash(self.tokenizer):
            raise ValueError(f"{self.path}: this LM was trained with another tokenizer ({self.tokenizer.get('kind')}, "
                             f"{self.config.vocab_size} ids) than {model_path} ({tokenizer.to_dict().get('kind')}, "
                             f"{tokenizer.vocab_size} ids); train the LM with the model's tokenizer")

    @torch.no_grad()
    def score(self, token_lists: Sequence[Sequence[int]]) -> list[float]:
        """ln P_LM(tokens, eos | sos) of each token sequence."""
        device = self.model.embed.weight.device
        sos = eos = self.config.vocab_size - 1
        out = []
        for tokens in token_lists:
            inputs = torch.tensor([[sos, *tokens]], device=device)
            targets = torch.tensor([*tokens, eos], device=device)
            out.append(float(self.model(inputs)[0].gather(1, targets[:, None]).sum()))
        return out


def load_neural_lm(path: str | os.PathLike, device: str | torch.device = "cpu") -> NeuralLM:
    """Read an LM file; CheckpointError naming the file when it is not one (or is newer), when its
    config asks for sizes beyond asr.checkpoint.SIZE_LIMITS, or when its config and weights
    disagree (checked before anything is allocated: asr.checkpoint.load_weights)."""
    obj = load_file(path, LM_FORMAT)
    source = os.fspath(path)
    try:
        if not isinstance(obj.get("model"), dict):
            raise TypeError("'model' is not a dict")
        config = LMConfig(**obj["model"])
        tokenizer = dict(obj["tokenizer"])
        tokenizer_from_dict(tokenizer)
        if obj.get("tokenizer_sha256", tokenizer_hash(tokenizer)) != tokenizer_hash(tokenizer):
            raise ValueError("its tokenizer does not match the hash it was saved with")
    except (KeyError, TypeError, ValueError) as e:
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise CheckpointError(f"{source}: not a usable LM file ({reason})") from None
    check_sizes(config, source)
    model = load_weights(lambda: TransformerLM(config), obj.get("state_dict"), source, config,
                         layers={"layers.": "n_layers"}, what="LM file")
    return NeuralLM(model.to(device).eval(), tokenizer, source)


# ---------------------------------------------------------------------------------------------
# fusion


class TransformerLMScorer(CacheScorer):
    """A NeuralLM as a FullScorer and a CountingScorer (asr.scorer): log-probabilities (R, V) of
    every next token for all rows, from a KV cache of the rows' tokens so far (made for `max_len`
    steps, grown when needed). The search weighs it (decoding.lm_weight)."""

    def __init__(self, lm: NeuralLM, max_len: int = 64) -> None:
        self.lm, self.max_len = lm, max_len

    def init_state(self, memory: torch.Tensor, memory_lens: torch.Tensor, group: int) -> DecoderCache:
        rows = memory.size(0) * group
        return self.lm.model.init_cache(rows, group, capacity=self.max_len, device=memory.device, dtype=memory.dtype)

    def score(self, state: DecoderCache, last_tokens: torch.Tensor) -> tuple[torch.Tensor, DecoderCache]:
        return self.lm.model.step(last_tokens, state), state

    def final_score(self, state: DecoderCache) -> torch.Tensor:
        return torch.zeros(state.rows, device=state.self_kv.device)  # ending is scored as the eos token
