"""Closed-vocabulary decoding: a word list as a constraint on the beam search's tokens.

A Lexicon is a character trie of the words, compiled against a tokenizer's pieces into token
transitions: from each state (a trie node: the word typed so far), the tokens that keep the
hypothesis spelling a prefix of some word, and where they lead. A piece that starts with the
word separator (sentencepiece's "▁", the character tokenizer's space token) begins a new word
and is allowed only where a word has just ended (or nothing has been written yet); eos likewise.
So every hypothesis the constrained search returns is a sequence of lexicon words, however the
tokenizer happens to split them (a word spelled by any sequence of pieces is allowed, not only
the tokenizer's own segmentation).

Shapes: R hypotheses (rows), V tokens, E transitions. States are trie node indices; state 0 is
the start (nothing written), `sp` the state after a separator piece that carried no letters.
Transitions are held as sorted keys (state * V + token), so a state's transitions are one run of
them: a step gathers each row's run (at most a few keys for nearly every state) into its (V,)
mask, and the few states with many transitions (the start, `sp`, short prefixes) keep dense rows
of their allowed tokens (DENSE_BYTES at most). No host synchronization; memory is O(E) plus the
dense rows, whatever V is (a binary search of every (state, token) pair costs tens of times more
a step); `advance` looks each row's chosen token up by binary search. `tools/bench_lexicon.py`
measures compiling and the masks.

    lexicon = Lexicon.from_file("words.txt", tokenizer)   # one word per line, first field
    options = DecodingOptions(lexicon="words.txt")          # asr.decoding: the task compiles it
"""
from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from pathlib import Path

import torch

from asr.metrics import normalize_text
from asr.scorer import Selection
from asr.tokenizer import SPACE, Tokenizer
from asr.tokens import real_tokens

__all__ = ["Lexicon", "LexiconError", "LexiconScorer", "read_words"]

DENSE_BYTES = 32 * 2**20  # at most this much for the dense rows of the states with many transitions


class LexiconError(ValueError):
    """A word list that cannot be read or used; the message names the file."""


def read_words(path: str | os.PathLike) -> list[str]:
    """The words of a word list: the first field of every non-empty line, normalized as
    transcripts are (asr.metrics.normalize_text; a field that normalizes to several words gives
    each of them, one that normalizes to nothing is dropped), deduplicated, in file order.
    Kaldi's lexicon.txt (word, then its pronunciation) reads the same way."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise LexiconError(f"{path}: cannot read the word list ({e.__class__.__name__}: {e})") from None
    words = dict.fromkeys(w for line in text.splitlines() if line.split()
                          for w in normalize_text(line.split()[0]).split())
    if not words:
        raise LexiconError(f"{path}: no words")
    return list(words)


class Lexicon:
    """A word list compiled against a tokenizer's pieces (see the module docstring)."""

    def __init__(self, words: Iterable[str], pieces: Sequence[str | None], *, eos: int) -> None:
        """words: normalized words (no spaces); pieces[t]: the text of token t (None for tokens
        that never spell anything: blank, unk, sos/eos); eos: the end token. Words no sequence of
        pieces can spell are counted in `unspellable` and otherwise ignored."""
        self.vocab_size, self.eos = len(pieces), eos
        nodes: list[dict[str, int]] = [{}]  # trie: node -> {char: child}
        ends: list[bool] = [True]  # the start may end: an empty hypothesis
        words = list(dict.fromkeys(words))
        for word in words:
            node = 0
            for ch in word:
                if ch not in nodes[node]:
                    nodes[node][ch] = len(nodes)
                    nodes.append({})
                    ends.append(False)
                node = nodes[node][ch]
            ends[node] = True
        self.sp = len(nodes)  # after a bare separator piece: inside no word yet, may not end
        inner = {p: t for t, p in enumerate(pieces) if p and not p.startswith(SPACE)}
        initial = {p[1:]: t for t, p in enumerate(pieces) if p and p.startswith(SPACE)}
        longest = max(map(len, [*inner, *initial]), default=0)
        edges: dict[int, int] = {}  # state * V + token -> next state
        spelled = [False] * len(nodes)
        spelled[0] = True
        for word in words:  # each prefix of a word (a node) and each piece that continues it
            path = [0]
            for ch in word:
                path.append(nodes[path[-1]][ch])
            for i in range(len(word)):
                if not spelled[path[i]]:
                    continue
                for j in range(i + 1, min(len(word), i + longest) + 1):
                    token = inner.get(word[i:j])
                    if token is not None:
                        spelled[path[j]] = True
                        edges[path[i] * self.vocab_size + token] = path[j]
                        if i == 0:  # also from `sp`, a separator piece before it
                            edges[self.sp * self.vocab_size + token] = path[j]
                    if i == 0 and initial.get(word[:j]) is not None:
                        spelled[path[j]] = True
                        edges[initial[word[:j]]] = path[j]  # initial pieces: keyed as from state 0
        if "" in initial:
            edges[initial[""]] = self.sp
        self.unspellable = sum(not spelled[_node_of(nodes, w)] for w in words)
        self.num_words = len(words) - self.unspellable
        keys = sorted(edges)
        self._keys = torch.tensor(keys, dtype=torch.long)
        self._next = torch.tensor([edges[k] for k in keys], dtype=torch.long)
        self._starts = torch.zeros(self.vocab_size, dtype=torch.bool)  # the pieces that begin some word
        self._starts[[t for t in initial.values() if t in edges]] = True
        # (states,): a word has just ended, or nothing is written yet; sp (last) may not end
        self._may_end = torch.tensor([*ends, False], dtype=torch.bool)
        self._tables(len(nodes) + 1)

    def _tables(self, states: int) -> None:
        """The tables of `allowed`: a state's transitions are a run of the sorted keys, found by
        `_offsets`; the few states with more than `_width` of them (the start, `sp`, short
        prefixes) get a dense row of allowed tokens instead, so a step gathers at most `_width`
        keys per row."""
        v = self.vocab_size
        self._offsets = torch.searchsorted(self._keys, torch.arange(states + 1) * v)  # (states + 1,)
        degree = self._offsets[1:] - self._offsets[:-1]
        width = 16  # the smallest power of two whose dense rows fit in DENSE_BYTES
        while int((degree > width).sum()) * (v + 1) > DENSE_BYTES:
            width *= 2
        wide = (degree > width).nonzero()[:, 0]
        self._width = min(width, int(degree.max()))  # 0 when there are no transitions at all
        self._degree = degree.masked_fill(degree > width, 0)  # (states,) keys gathered per row
        self._columns = torch.arange(self._width)  # (W,) the gather's offsets, made once
        self._dense_row = torch.full((states,), len(wide), dtype=torch.long)  # (states,): the last row is empty
        self._dense_row[wide] = torch.arange(len(wide))
        self._dense = torch.zeros(len(wide) + 1, v + 1, dtype=torch.bool)  # column v: where unused gathers land
        for row, state in enumerate(wide.tolist()):
            lo, hi = int(self._offsets[state]), int(self._offsets[state + 1])
            self._dense[row, self._keys[lo:hi] - state * v] = True

    @classmethod
    def from_file(cls, path: str | os.PathLike, tokenizer: Tokenizer) -> Lexicon:
        """The word list at `path` (read_words) compiled for `tokenizer`; LexiconError when none
        of its words can be spelled by the tokenizer's pieces."""
        pieces: list[str | None] = [None] * tokenizer.vocab_size
        for t in real_tokens(tokenizer.vocab_size):
            pieces[t] = tokenizer.piece(t)
        lexicon = cls(read_words(path), pieces, eos=tokenizer.eos)
        if lexicon.num_words == 0:
            raise LexiconError(f"{path}: none of its words can be spelled by the tokenizer's pieces")
        return lexicon

    def to(self, device: torch.device | str) -> Lexicon:
        """This lexicon with its tables on `device` (a shallow copy; self when already there)."""
        if self._keys.device == torch.device(device):
            return self
        other = object.__new__(Lexicon)
        other.__dict__.update(self.__dict__)
        names = ("_keys", "_next", "_starts", "_may_end", "_offsets", "_degree", "_columns", "_dense_row", "_dense")
        other.__dict__.update({name: getattr(self, name).to(device) for name in names})
        return other

    def start(self, rows: int) -> torch.Tensor:
        """(rows,) the start state."""
        return torch.zeros(rows, dtype=torch.long, device=self._keys.device)

    def allowed(self, states: torch.Tensor) -> torch.Tensor:
        """(R, V) bool: the tokens (eos included) each state (R,) may take next."""
        v = self.vocab_size
        found = self._dense[self._dense_row[states]]  # (R, V + 1): a wide state's row, else empty
        if self._width:
            gather = self._offsets[states][:, None] + self._columns  # (R, W)
            tokens = self._keys[gather.clamp(max=self._keys.numel() - 1)] - states[:, None] * v
            unused = self._columns >= self._degree[states][:, None]
            found.scatter_(1, tokens.masked_fill(unused, v), True)
        found = found[:, :v]
        begins = self._starts & self._may_end[states][:, None]  # (R, V): a new word after an ended one
        allowed = found | begins
        allowed[:, self.eos] = self._may_end[states]
        return allowed

    def advance(self, states: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """(R,) the states after `tokens` (R,); -1 where a token is not allowed."""
        inner = self._find(states * self.vocab_size + tokens)
        begin = self._find(tokens)  # word-initial transitions are keyed as from state 0
        return torch.where(self._starts[tokens] & self._may_end[states], begin, inner)

    def _find(self, keys: torch.Tensor) -> torch.Tensor:
        """The next state of each transition key (any shape), -1 where there is none."""
        if self._keys.numel() == 0:
            return torch.full_like(keys, -1)
        at = torch.searchsorted(self._keys, keys).clamp(max=self._keys.numel() - 1)
        return torch.where(self._keys[at] == keys, self._next[at], -1)


def _node_of(nodes: list[dict[str, int]], word: str) -> int:
    """The trie node of `word` (which is in the trie)."""
    node = 0
    for ch in word:
        node = nodes[node][ch]
    return node


class LexiconScorer:
    """A Lexicon as a beam-search FullScorer: 0 for the allowed tokens, -inf for the others. Its
    state (R,) is each hypothesis's lexicon state; `select_state` reads the chosen tokens."""

    def __init__(self, lexicon: Lexicon) -> None:
        self.lexicon = lexicon

    def init_state(self, memory: torch.Tensor, memory_lens: torch.Tensor, group: int) -> torch.Tensor:
        self.lexicon = self.lexicon.to(memory.device)
        return self.lexicon.start(memory.size(0) * group)

    def score(self, state: torch.Tensor, last_tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        allowed = self.lexicon.allowed(state.clamp(min=0))
        return torch.zeros(allowed.shape, device=state.device).masked_fill_(~allowed, float("-inf")), state

    def select_state(self, state: torch.Tensor, selection: Selection) -> torch.Tensor:
        return self.lexicon.advance(state[selection.rows].clamp(min=0), selection.tokens)

    def final_score(self, state: torch.Tensor) -> torch.Tensor:
        """0 where a hypothesis may end (after a whole word), -inf elsewhere: the eos token is
        constrained the same way, and a hypothesis cut at the search's length limit is then never
        returned in the middle of a word (the utterance keeps its other hypotheses, or none)."""
        may_end = self.lexicon._may_end[state.clamp(min=0)] & (state >= 0)
        return torch.zeros(state.shape, device=state.device).masked_fill_(~may_end, float("-inf"))
