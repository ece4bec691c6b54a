"""The scorer protocol that beam search combines (batch-first ESPnet scorers): the attention
decoder, CTC prefix scores, the lexicon and word LMs each implement it, and the search weighs
their scores by name. A leaf: it imports nothing of ours, so the scorers and the search import it
and not each other.

Shape legend: B utterances, N hypotheses per utterance (the group), R = B * N rows (utterance b
owns rows b*N .. b*N + N - 1), C candidates per row, V vocabulary.
"""
from __future__ import annotations

from typing import Any, NamedTuple, Protocol, runtime_checkable

import torch

from asr.inference import DecoderState

__all__ = ["CacheScorer", "CountingScorer", "FullScorer", "PartialScorer", "Selection"]


class Selection(NamedTuple):
    """The hypotheses that go on after a step: row i of the new states continues row rows[i] with
    tokens[i]. R' < R drops utterances: rows then come in whole groups, N per kept utterance, and
    group u of the new rows is utterance utterances[u] of the old ones. `counts`: for a
    CountingScorer, the values of what its `selection_counts` asked for; () for the others."""

    rows: torch.Tensor  # (R',) long
    tokens: torch.Tensor  # (R',) long
    utterances: torch.Tensor  # (B',) long
    counts: tuple[int, ...] = ()

    @staticmethod
    def of(rows: torch.Tensor, tokens: torch.Tensor, group: int) -> Selection:
        """The Selection of rows (R',) and tokens (R',) alone, N = group rows per utterance."""
        return Selection(rows, tokens, rows.view(-1, group)[:, 0] // group)


class FullScorer(Protocol):
    """Scores every token of the vocabulary (the attention decoder, a lexicon; a neural LM)."""

    def init_state(self, memory: torch.Tensor, memory_lens: torch.Tensor, group: int) -> Any:
        """The state of the empty hypothesis in `group` rows per utterance (R = B * group)."""

    def score(self, state: Any, last_tokens: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """Log-probabilities (R, V) of the next token after each row's last token (R,) (sos
        first), and the state that has read those tokens."""

    def select_state(self, state: Any, selection: Selection) -> Any:
        """The state of the hypotheses `selection` keeps (see Selection)."""

    def final_score(self, state: Any) -> torch.Tensor:
        """(R,) added to a hypothesis when it ends."""


class PartialScorer(Protocol):
    """Scores only the candidates the pre-beam chose (the CTC prefix scorer, a word n-gram LM)."""

    def init_state(self, memory: torch.Tensor, memory_lens: torch.Tensor, group: int) -> Any: ...

    def score_partial(self, state: Any, candidates: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """Scores (R, C) of appending candidates (R, C) (eos: of ending), and the state that knows them."""

    def select_state(self, state: Any, selection: Selection) -> Any: ...

    def final_score(self, state: Any) -> torch.Tensor: ...


@runtime_checkable
class CountingScorer(Protocol):
    """A scorer whose `select_state` needs a few numbers on the host (the decoder's cache: how many
    rows and positions to copy). The search gets them without a host synchronization of their own:
    it asks for them on the device before its one transfer per step, adds them to that transfer and
    passes their values in Selection.counts."""

    def selection_counts(self, state: Any, proposal: Selection, kept: torch.Tensor) -> torch.Tensor:
        """(k,) long on the device: what select_state will need to keep `proposal` (all B utterances,
        the kept ones first) cut to its first `kept` (a () long tensor) utterances."""


class CacheScorer:
    """What a full scorer whose state is a decoder cache (asr.inference.DecoderState: the attention
    decoder's, a neural LM's) does to select: it is a CountingScorer that hands the rows to its
    cache, and the cache's counts back to it."""

    def selection_counts(self, state: DecoderState, proposal: Selection, kept: torch.Tensor) -> torch.Tensor:
        return state.selection_counts(proposal.rows, kept)

    def select_state(self, state: DecoderState, selection: Selection) -> DecoderState:
        return state.select(selection.rows, selection.counts)
