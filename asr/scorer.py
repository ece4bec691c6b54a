"""The scorer protocol that beam search combines (batch-first ESPnet scorers): the attention
decoder, CTC prefix scores, the lexicon and word LMs each implement it, and the search weighs
their scores by name. A leaf: it imports nothing of ours, so the scorers and the search import it
and not each other.

Shape legend: B utterances, N hypotheses per utterance (the group), R = B * N rows (utterance b
owns rows b*N .. b*N + N - 1), C candidates per row, V vocabulary.
"""
from __future__ import annotations

from typing import Any, NamedTuple, Protocol

import torch

__all__ = ["FullScorer", "PartialScorer", "Selection"]


class Selection(NamedTuple):
    """The hypotheses that go on after a step: row i of the new states continues row rows[i] with
    tokens[i]. R' < R drops utterances: rows then come in whole groups, N per kept utterance, and
    group u of the new rows is utterance utterances[u] of the old ones. The other fields tell a
    scorer which rows it may leave where they are (the search knows them without a host sync;
    None: unknown, for the scorer to find)."""

    rows: torch.Tensor  # (R',) long
    tokens: torch.Tensor  # (R',) long
    utterances: torch.Tensor  # (B',) long
    moved: torch.Tensor | None = None  # (M,) long, the rows i with rows[i] != i, ascending
    shared: torch.Tensor | None = None  # (M,) long: the decoder inputs (sos, then tokens), counted
    # from the first, that the hypothesis moved into row i shares with the one row i held, of the
    # same utterance (else 0)
    copies: int = 0  # sum over the moved rows of (inputs so far - shared): the inputs that differ
    moved_utterances: torch.Tensor | None = None  # (U,) long, the u with utterances[u] != u, ascending

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
