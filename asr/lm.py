"""Word n-gram language models: trained on transcripts (interpolated Kneser-Ney), read and written
as ARPA files (gzip-compressed when the name ends in .gz), and used to rescore the beam search's
n-best lists. Pure Python, fine for LMs of a few million n-grams (`python tools/bench_lm.py`
measures training, reading and scoring).

An NgramLM holds, per order k, the log10 probability of every k-gram it knows and the log10
backoff weight of every (k)-gram that is a context, as an ARPA file does; the probability of a
word after a context it was not seen in is the backoff weight of that context times its
probability after the context's shorter suffix (log10: a sum). Any ARPA file of words reads the
same way (KenLM's `lmplz`, SRILM's `ngram-count`): its words are normalized as transcripts are
(asr.metrics.normalize_text), so a lower-case LM scores upper-case hypotheses (n-grams that become
one, "the" and "The", add their probabilities; a word that normalizes to several, "e-mail", stays
as it is and never matches). A word the LM does not know, in the context too, reads as `<unk>`,
or, in a file without `<unk>`, scores as its rarest word.

`train_ngram` estimates interpolated Kneser-Ney (Chen & Goodman 1998, one discount per order from
the counts of counts, D = n1 / (n1 + 2 n2)), written in backoff form, which is exact for an
interpolated model: a seen n-gram stores its interpolated probability and a context's backoff
weight is its interpolation weight. Lower orders count distinct left contexts, not occurrences,
except for n-grams that begin with <s> (nothing precedes <s>), as KenLM does.

Rescoring (asr.decoding.DecodingTask, when decoding.lm is set): beam search returns its whole beam of
ended hypotheses; each one's score becomes search score + lm_weight * ln P_LM(words, </s>) +
lm_word_bonus * len(words); the best `nbest` of them, by that score, are the result. The word
bonus offsets what each word costs in ln P_LM, which otherwise favours hypotheses that drop words
(Kaldi's word insertion penalty, negated). Fusion (decoding.lm_fusion, `WordLMScorer`): the LM
scores each word inside the search, as the hypothesis ends it, so that a hypothesis the LM
favours is kept in the beam rather than only re-ranked among those that survived; over a whole
hypothesis it adds the same lm_weight * ln P_LM(words, </s>) + lm_word_bonus * len(words).

    lm = train_ngram([t.split() for t in texts], order=3)
    lm.save("data/lm.arpa")
    lm = NgramLM.load("data/lm.arpa")
    lm.score("I WILL GO".split())   # natural log of P(I WILL GO </s> | <s>)
"""
from __future__ import annotations

import functools
import gzip
import io
import math
import os
import re
import zlib
from collections import Counter
from collections.abc import Iterable, Sequence
from itertools import chain
from typing import NamedTuple, TextIO

import torch

from asr.fileio import atomic_open
from asr.metrics import normalize_text
from asr.scorer import Selection
from asr.tokenizer import SPACE, Tokenizer
from asr.tokens import real_tokens

__all__ = ["BOS", "EOS", "UNK", "LMError", "NgramLM", "WordLMScorer", "rescore", "train_ngram"]

BOS, EOS, UNK = "<s>", "</s>", "<unk>"
NO_PROB = -99.0  # log10 "probability" of <s> (never predicted), as ARPA files write it
_LN10 = math.log(10.0)
_COUNT_LINE = re.compile(r"ngram\s+(\d+)\s*=\s*(\d+)$")
_MAX_LINE = 100_000  # characters in one line of an ARPA file
_MAX_UNUSED_LINES = 10_000  # blank lines and comments (text before \data\)
_MAX_ORDER = 100
_ROUNDING = 1e-4  # a log10 probability up to this far above 0 is a writer's rounding
_SECTION = re.compile(r"\\(\d+)-grams:$")


class LMError(ValueError):
    """A language model file that cannot be read or used, or text an LM cannot be trained on; the
    message names the file (and line)."""


class NgramLM:
    """A backoff word n-gram model (see the module docstring)."""

    def __init__(self, probs: Sequence[dict[tuple[str, ...], float]],
                 backoffs: dict[tuple[str, ...], float]) -> None:
        """probs[k - 1]: {k-gram: log10 probability} for k = 1..order; backoffs: {context: log10
        backoff weight} (a context missing has weight 1, log10 0). The unigrams must hold </s>."""
        self.probs = [dict(p) for p in probs]
        self.backoffs = dict(backoffs)
        self.order = len(self.probs)
        if self.order < 1 or (EOS,) not in self.probs[0]:
            raise LMError("an n-gram model needs unigrams, </s> among them")
        unigrams = {g: p for g, p in self.probs[0].items() if g != (BOS,)}
        self._unk = unigrams.get((UNK,), min(unigrams.values()))
        self._has_unk = (UNK,) in unigrams
        self._cache: dict[tuple[str, ...], float] = {}

    @property
    def vocab_size(self) -> int:
        """Words it knows (<s>, </s> and <unk> not counted)."""
        return sum(1 for (w,) in self.probs[0] if w not in (BOS, EOS, UNK))

    def log10_prob(self, context: Sequence[str], word: str) -> float:
        """log10 P(word | the last order-1 words of context), by backing off; unknown words, the
        context's included, read as <unk> when the model has it (as KenLM and SRILM read them)."""
        context = context[len(context) - self.order + 1:] if self.order > 1 else ()
        return self._log10(tuple(self._known(w) for w in context), self._known(word))

    def _known(self, word: str) -> str:
        return word if not self._has_unk or (word,) in self.probs[0] else UNK

    def _log10(self, context: tuple[str, ...], word: str) -> float:
        """log10_prob of words already mapped by _known, the context at most order-1 long."""
        key = context + (word,)
        cached = self._cache.get(key)
        if cached is not None:
            return cached
        weight = 0.0
        for start in range(len(context) + 1):
            gram = context[start:] + (word,)
            p = self.probs[len(gram) - 1].get(gram)
            if p is not None:
                value = weight + p
                break
            weight += self.backoffs.get(context[start:], 0.0)
        else:
            value = weight + self._unk  # a word missing from the unigrams (no <unk> in the file)
        if len(self._cache) < 1_000_000:
            self._cache[key] = value
        return value

    def score(self, words: Sequence[str]) -> float:
        """Natural log of P(words, then </s> | <s>): the sentence's log-probability."""
        seq = (BOS, *(self._known(w) for w in words), EOS)
        keep = self.order - 1
        total = sum(self._log10(seq[max(i - keep, 0):i] if keep else (), seq[i]) for i in range(1, len(seq)))
        return total * _LN10

    def perplexity(self, sentences: Iterable[Sequence[str]]) -> float:
        """exp(-mean log-probability per predicted token, </s> included)."""
        total, count = 0.0, 0
        for words in sentences:
            total += self.score(words)
            count += len(words) + 1
        return math.exp(-total / max(count, 1))

    # -- files ------------------------------------------------------------------------------

    def save(self, path: str | os.PathLike) -> None:
        """Write the model as an ARPA file (atomically; gzip-compressed when `path` ends in .gz)."""
        if os.fspath(path).endswith(".gz"):
            with atomic_open(path, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", mtime=0) as packed, \
                    io.TextIOWrapper(packed, encoding="utf-8") as f:
                self._write_arpa(f)
        else:
            with atomic_open(path) as f:
                self._write_arpa(f)

    def _write_arpa(self, f: TextIO) -> None:
        f.write("\\data\\\n")
        f.writelines(f"ngram {k + 1}={len(p)}\n" for k, p in enumerate(self.probs))
        for k, table in enumerate(self.probs):
            f.write(f"\n\\{k + 1}-grams:\n")
            for gram in sorted(table):
                bow = self.backoffs.get(gram) if k + 1 < self.order else None
                tail = f"\t{bow + 0.0:.6f}" if bow is not None else ""  # + 0.0: no "-0.0"
                f.write(f"{table[gram]:.6f}\t{' '.join(gram)}{tail}\n")
        f.write("\n\\end\\\n")

    @classmethod
    def load(cls, path: str | os.PathLike) -> NgramLM:
        """Read an ARPA file (gzip-compressed when its name ends in .gz, as published LMs are);
        LMError naming the file (and line) when it cannot be read or is not one. The work is
        bounded by what the file declares: reading stops at \\end\\, a section longer than its
        declared count, more than 10,000 blank or comment lines, or a line of over 100,000
        characters is refused where it is found (a small .gz of blank lines costs nothing)."""
        source = os.fspath(path)
        try:
            opener = gzip.open if source.endswith(".gz") else open
            with opener(path, "rt", encoding="utf-8-sig") as f:
                return cls._read_arpa(iter(functools.partial(f.readline, _MAX_LINE + 1), ""), source)
        except (OSError, EOFError, UnicodeDecodeError, zlib.error) as e:
            raise LMError(f"{source}: cannot read the language model ({e.__class__.__name__}: {e})") from None

    @classmethod
    def _read_arpa(cls, lines: Iterable[str], source: str) -> NgramLM:
        reader = _ArpaReader(source)
        for number, line in enumerate(lines, 1):
            try:
                if not reader.read(line, number):
                    break
            except LMError:
                raise
            except (ValueError, ArithmeticError) as e:  # anything the checks missed, still named
                raise LMError(f"{source}:{number}: {e.__class__.__name__}: {e}") from None
        return reader.model(cls)


class _ArpaReader:
    """The state of reading one ARPA file, line by line (NgramLM.load)."""

    def __init__(self, source: str) -> None:
        self.source = source
        self.declared: dict[int, int] = {}
        self.probs: list[dict[tuple[str, ...], float]] = []
        self.backoffs: dict[tuple[str, ...], float] = {}
        self.normalized: dict[str, str] = {}  # each distinct word normalized once
        self.section: str | int = "preamble"  # then "data", k (reading k-grams), "end"
        self.in_section = 0  # n-gram lines read in this section
        self.unused = 0  # blank and comment lines so far

    def read(self, line: str, number: int) -> bool:
        """Take one line (number `number`); False once \\end\\ is read (nothing after it is read)."""
        where = _Where(self.source, number)  # formatted only for an error
        if len(line) > _MAX_LINE:
            raise LMError(f"{where}: a line of over {_MAX_LINE:,} characters: not an ARPA file")
        line = line.strip()
        if not line or (self.section == "preamble" and line != "\\data\\"):  # text before \data\: comments
            self.unused += 1
            if self.unused > _MAX_UNUSED_LINES:
                raise LMError(f"{where}: more than {_MAX_UNUSED_LINES:,} blank or comment lines: not an ARPA file")
            return True
        if line == "\\data\\":
            self.section = "data"
        elif line == "\\end\\":
            self.section = "end"
            return False
        elif (m := _SECTION.match(line)) is not None:
            self._start_section(m.group(1), where)
        elif self.section == "data":
            m = _COUNT_LINE.match(line)
            if m is None:
                raise LMError(f"{where}: expected 'ngram N=COUNT' in \\data\\, got {line[:60]!r}")
            order, count = _count(m.group(1), "order", where), _count(m.group(2), "count", where)
            if not 1 <= order <= _MAX_ORDER:
                raise LMError(f"{where}: n-gram order {order}: this reader takes orders 1 to {_MAX_ORDER}")
            self.declared[order] = count
        else:
            self._ngram(line, where)
        return True

    def _start_section(self, text: str, where: _Where) -> None:
        order = _count(text, "order", where)
        if order != len(self.probs) + 1 or order not in self.declared:
            raise LMError(f"{where}: \\{order}-grams: out of order or not declared in \\data\\")
        self.section, self.in_section = order, 0
        self.probs.append({})

    def _ngram(self, line: str, where: _Where) -> None:
        k = int(self.section)
        self.in_section += 1
        if self.in_section > self.declared[k]:
            raise LMError(f"{where}: \\data\\ declares {self.declared[k]} {k}-grams, the file has more")
        fields = line.split()
        if len(fields) not in (k + 1, k + 2):
            raise LMError(f"{where}: a {k}-gram line needs a log10 probability, {k} words and "
                          f"an optional backoff weight, got {line[:60]!r}")
        try:
            numbers = [float(fields[0])] + ([float(fields[-1])] if len(fields) == k + 2 else [])
        except ValueError:
            raise LMError(f"{where}: not a number in {line[:60]!r}") from None
        if not all(math.isfinite(x) for x in numbers):
            raise LMError(f"{where}: not a finite number in {line[:60]!r}")
        if numbers[0] > _ROUNDING:
            raise LMError(f"{where}: log10 probability {fields[0][:20]} is above 0 (a probability over 1)")
        normalized = self.normalized
        gram = tuple(normalized.get(w) or normalized.setdefault(w, _normalize_word(w)) for w in fields[1:k + 1])
        table = self.probs[-1]
        if gram in table:  # words that normalize alike ("the", "The"): their probabilities add
            table[gram] = _log10_add(table[gram], numbers[0])
            return  # the first line's backoff weight stays
        table[gram] = numbers[0]
        if len(numbers) == 2:
            self.backoffs[gram] = numbers[1]

    def model(self, cls: type[NgramLM]) -> NgramLM:
        """The model read, once the lines are over."""
        if self.section != "end":
            raise LMError(f"{self.source}: not an ARPA file (no \\data\\ ... \\end\\)")
        if len(self.probs) != len(self.declared):
            raise LMError(f"{self.source}: \\data\\ declares orders up to {max(self.declared, default=0)}, "
                          f"the file has {len(self.probs)}")
        try:
            return cls(self.probs, self.backoffs)
        except LMError as e:
            raise LMError(f"{self.source}: {e}") from None


class _Where(NamedTuple):
    """file:line, for messages."""

    source: str
    line: int

    def __str__(self) -> str:
        return f"{self.source}:{self.line}"


def _count(digits: str, what: str, where: _Where) -> int:
    """A declared order or count: at most 15 digits (int() refuses 4,300 with its own words)."""
    if len(digits) > 15:
        raise LMError(f"{where}: an n-gram {what} of {len(digits):,} digits")
    return int(digits)


def _log10_add(a: float, b: float) -> float:
    """log10(10^a + 10^b) without overflow or underflow."""
    high, low = max(a, b), min(a, b)
    return high + math.log10(1.0 + 10.0 ** (low - high))


def _normalize_word(word: str) -> str:
    """An ARPA word as transcripts are normalized; the markers (<s>, </s>, <unk>) and words that do
    not normalize to one word stay as they are."""
    if word.startswith("<") and word.endswith(">"):
        return word.lower() if word.lower() in (BOS, EOS, UNK) else word
    normalized = normalize_text(word)
    return normalized if normalized and " " not in normalized else word


def train_ngram(sentences: Iterable[Sequence[str]], order: int = 3) -> NgramLM:
    """Interpolated Kneser-Ney of `order` over `sentences` (each a sequence of normalized words;
    see the module docstring). LMError when there is no word to learn from."""
    if order < 1:
        raise LMError(f"order {order}: must be at least 1")
    counts: list[Counter[tuple[str, ...]]] = [Counter() for _ in range(order)]  # [k - 1]: raw k-gram counts
    seqs = [(BOS, *words, EOS) for words in sentences]
    # every k-gram of <s> words </s> but the unigram <s>, counted in Counter's C loop
    counts[0].update(chain.from_iterable(zip(seq[1:]) for seq in seqs))
    for k in range(2, order + 1):
        counts[k - 1].update(chain.from_iterable(zip(*(seq[j:] for j in range(k))) for seq in seqs))
    if all(w == EOS for (w,) in counts[0]):
        raise LMError("no words to train a language model on")
    # adjusted counts: raw for the highest order and for n-grams that begin with <s>; otherwise the
    # number of distinct words seen before the n-gram (each (k+1)-gram is one of them)
    adjusted: list[Counter[tuple[str, ...]]] = [Counter() for _ in range(order)]
    adjusted[order - 1] = counts[order - 1]
    for k in range(1, order):
        adjusted[k - 1].update({g: c for g, c in counts[k - 1].items() if g[0] == BOS})
        adjusted[k - 1].update(gram[1:] for gram in counts[k])  # gram[1] is never <s>
    discounts = [_discount(a) for a in adjusted]
    totals: list[Counter[tuple[str, ...]]] = [Counter() for _ in range(order)]  # per context
    followers: list[Counter[tuple[str, ...]]] = [Counter() for _ in range(order)]  # distinct next words
    for k in range(order):
        for gram, a in adjusted[k].items():
            totals[k][gram[:-1]] += a
            followers[k][gram[:-1]] += 1
    vocab = [w for (w,) in adjusted[0] if w != BOS]
    vocab += [UNK] if UNK not in vocab else []
    # linear probabilities, lower orders first: each n-gram's suffix is a seen lower-order n-gram
    linear = {(w,): max(adjusted[0][(w,)] - discounts[0], 0.0) / totals[0][()] for w in vocab}
    floor = discounts[0] * followers[0][()] / totals[0][()] / len(vocab)  # the uniform distribution's share
    linear = {g: p + floor for g, p in linear.items()}
    backoffs: dict[tuple[str, ...], float] = {}
    for k in range(2, order + 1):
        d = discounts[k - 1]
        for context, total in totals[k - 1].items():
            backoffs[context] = math.log10(d * followers[k - 1][context] / total)
        for gram, a in adjusted[k - 1].items():
            total = totals[k - 1][gram[:-1]]
            linear[gram] = (a - d) / total + d * followers[k - 1][gram[:-1]] / total * linear[gram[1:]]
    probs: list[dict[tuple[str, ...], float]] = [{} for _ in range(order)]
    for gram, p in linear.items():
        probs[len(gram) - 1][gram] = math.log10(p)
    probs[0][(BOS,)] = NO_PROB
    return NgramLM(probs, backoffs)


def _discount(adjusted: Counter[tuple[str, ...]]) -> float:
    """D = n1 / (n1 + 2 n2) from the counts of counts, kept within [0.05, 0.95]."""
    n1 = sum(1 for a in adjusted.values() if a == 1)
    n2 = sum(1 for a in adjusted.values() if a == 2)
    return min(max(n1 / (n1 + 2 * n2), 0.05), 0.95) if n1 + n2 else 0.5


def rescore(nbest: Sequence[tuple[Sequence[str], float]], lm: NgramLM, weight: float,
            keep: int, word_bonus: float = 0.0) -> list[tuple[int, float]]:
    """The `keep` best of an n-best list of (words, search score) after adding weight * the LM's
    natural-log sentence probability + word_bonus per word: (index into nbest, new score), best
    first. Ties keep the search's order."""
    scored = [(score + weight * lm.score(words) + word_bonus * len(words), i) for i, (words, score) in enumerate(nbest)]
    scored.sort(key=lambda item: (-item[0], item[1]))
    return [(i, score) for score, i in scored[:keep]]


# WordLMScorer's state: per row, the last words (a tuple) and the word being spelled; after
# score_partial, also each row's ending score (R,) for final_score (None before)
_State = tuple[list, list, "torch.Tensor | None"]


class WordLMScorer:
    """A word LM inside beam search (shallow fusion at word ends), as a PartialScorer
    (asr.scorer): a candidate token whose piece begins a new word (starts with the word separator,
    sentencepiece's "▁") ends the word the hypothesis was spelling, and scores
    weight * ln P(that word | the words before) + word_bonus; other tokens score 0; ending
    (`final_score`, added to the eos candidate and to a hypothesis cut at the length limit) scores
    that last word likewise and weight * ln P(</s> | ...). Summed over a hypothesis this is
    weight * lm.score(words) + word_bonus * len(words), what `rescore` adds, so fused and rescored
    scores are on one scale (the search adds the scorer's output with weight 1). The state holds,
    per row, the last order-1 words and the word being spelled (Python lists: at most two LM
    look-ups per row and step, cached by the LM)."""

    def __init__(self, lm: NgramLM, pieces: Sequence[str | None], eos: int, *, weight: float = 1.0,
                 word_bonus: float = 0.0) -> None:
        """pieces[t]: the text of token t (None: never spells anything: blank, unk, sos/eos)."""
        self.lm, self.eos, self.weight, self.word_bonus = lm, eos, weight, word_bonus
        self._text = [p or "" for p in pieces]
        self._starts = torch.tensor([bool(p) and p.startswith(SPACE) for p in pieces])

    @classmethod
    def for_tokenizer(cls, lm: NgramLM, tokenizer: Tokenizer, *, weight: float = 1.0,
                      word_bonus: float = 0.0) -> WordLMScorer:
        """The scorer for `tokenizer`'s pieces (the real tokens spell text, as asr.lexicon reads them)."""
        size, spelling = tokenizer.vocab_size, real_tokens(tokenizer.vocab_size)
        return cls(lm, [tokenizer.piece(t) if t in spelling else None for t in range(size)], eos=tokenizer.eos,
                   weight=weight, word_bonus=word_bonus)

    def init_state(self, memory: torch.Tensor, memory_lens: torch.Tensor, group: int) -> _State:
        rows = memory.size(0) * group
        self._starts = self._starts.to(memory.device)
        return [(BOS,)] * rows, [""] * rows, None

    def _ln(self, context: tuple[str, ...], word: str) -> float:
        """weight * ln P(word | context)."""
        return self.lm.log10_prob(context, word) * _LN10 * self.weight

    def score_partial(self, state: _State, candidates: torch.Tensor) -> tuple[torch.Tensor, _State]:
        """The word-end scores of the candidates; the state keeps each row's ending score (its last
        word, if any, then </s>) for final_score, from the same look-ups."""
        history, spelling, _ = state
        word_end, sentence_end = [], []
        for context, word in zip(history, spelling):
            if word:
                ended = self._ln(context, word) + self.word_bonus
                word_end.append(ended)
                sentence_end.append(ended + self._ln((*context, word), EOS))
            else:  # nothing spelled since the last word (or at all)
                word_end.append(0.0)
                sentence_end.append(self._ln(context, EOS))
        ends = torch.tensor([word_end, sentence_end], device=candidates.device)  # (2, R)
        return torch.where(self._starts[candidates], ends[0, :, None], 0.0), (history, spelling, ends[1])

    def select_state(self, state: _State, selection: Selection) -> _State:
        history, spelling, _ = state
        keep = max(self.lm.order - 1, 0)
        new_history, new_spelling = [], []
        for row, token in zip(*torch.stack([selection.rows, selection.tokens]).tolist()):  # one host sync
            context, word, piece = history[row], spelling[row], self._text[token]
            if piece.startswith(SPACE):
                if word:
                    context = (*context, word)[-keep:] if keep else ()
                word = piece[len(SPACE):]
            else:
                word += piece
            new_history.append(context)
            new_spelling.append(word)
        return new_history, new_spelling, None

    def final_score(self, state: _State) -> torch.Tensor:
        """(R,): ending each hypothesis: its last word, if any, then </s> (score_partial found them)."""
        if state[2] is None:
            raise RuntimeError("WordLMScorer.final_score before score_partial")
        return state[2]
