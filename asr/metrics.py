"""Text normalization, word and character error rates, alignments and confusions.

A leaf: imports nothing of ours (the REF / HYP files of `asr wer` are read by
asr.manifest.read_transcripts).

One normalization function (`normalize_text`) serves training text, `asr decode` and `asr wer`.
Error rates are corpus-level (total errors over total reference words or characters) and come
from jiwer; utterances with an empty side are scored here, without jiwer.
"""
from __future__ import annotations

import re
import unicodedata
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass

import jiwer

__all__ = [
    "ErrorStats",
    "Report",
    "UttErrors",
    "format_errors",
    "format_summary",
    "normalize_text",
    "score",
]

# ---------------------------------------------------------------------------------------------
# text normalization

# Apostrophe look-alikes left after NFKC (which already maps the full-width one to "'").
_APOSTROPHES = re.compile("['\u2018\u2019\u201b\u02bc]+")
# Characters that separate words like a space: slashes and the minus sign; every dash of
# Unicode category Pd (- \u2010 \u2012 \u2013 \u2014 \u2015 ...) is added by _CharMap.
_SEPARATORS = frozenset("/\\\u2044\u2215\u29f8\u2212")


class _CharMap(dict):
    """str.translate table, filled the first time each character is seen: keep it (letters,
    digits and other numerals, combining marks, the apostrophe), turn it into a space (white
    space, dashes, slashes) or drop it (everything else)."""

    def __missing__(self, code: int) -> int | None:
        char = chr(code)
        category = unicodedata.category(char)
        if char.isalnum() or char == "'" or category[0] == "M":
            value = code
        elif char.isspace() or char in _SEPARATORS or category == "Pd":
            value = 32
        else:
            value = None
        self[code] = value
        return value


_CHAR_MAP = _CharMap()


def _inner_apostrophe(match: re.Match) -> str:
    """A run of apostrophes between two letters or digits becomes one "'"; any other goes."""
    text, start, end = match.string, match.start(), match.end()
    inside = start > 0 and end < len(text) and text[start - 1].isalnum() and text[end].isalnum()
    return "'" if inside else ""


def normalize_text(text: str) -> str:
    """The toolkit's one text normalization (DESIGN.md), used for training text, decode and wer.

    Unicode NFKC; upper-case; curly apostrophes (\u2018 \u2019 \u201b \u02bc) to "'"; an apostrophe is
    kept only inside a word, between two letters or digits ("DON'T" stays, "'TIS" -> "TIS",
    "JAMES'" -> "JAMES"; a run of them there becomes one); hyphens and dashes (Unicode category Pd
    and the minus sign) and slashes (/ \\ \u2044 \u2215) to spaces; every other character that is not a
    letter, a digit (str.isalnum) or a combining mark (so that Devanagari, Thai or Arabic vowel
    signs survive) is removed; whitespace collapsed to single spaces, stripped; the result is NFC.
    Idempotent: normalize_text(normalize_text(t)) == normalize_text(t).
    """
    text = unicodedata.normalize("NFKC", text).upper()
    text = _APOSTROPHES.sub(_inner_apostrophe, text)
    text = " ".join(text.translate(_CHAR_MAP).split())
    # upper() may decompose a few letters (e.g. U+0390 -> 3 code points): compose them again.
    return unicodedata.normalize("NFC", text)


def _collapse(text: str) -> str:
    """Whitespace-collapsed text: the only cleaning `score(..., normalize=False)` does."""
    return " ".join(text.split())


# ---------------------------------------------------------------------------------------------
# results


@dataclass(frozen=True)
class ErrorStats:
    """Corpus-level totals. wer = (S + D + I) / max(words, 1) and cer = char_errors / max(chars, 1):
    with an empty reference corpus the rates are the insertion counts (0 when the hypotheses are
    empty too), as jiwer has it, never a division by zero."""

    wer: float
    cer: float
    substitutions: int
    deletions: int
    insertions: int
    words: int
    chars: int
    char_errors: int
    utterances: int

    @property
    def errors(self) -> int:
        return self.substitutions + self.deletions + self.insertions

    def to_dict(self, skipped: int = 0) -> dict:
        """The wer.json dict of DESIGN.md: rates as fractions, counts as ints, plus `skipped`."""
        return {
            "wer": self.wer, "cer": self.cer,
            "substitutions": self.substitutions, "deletions": self.deletions,
            "insertions": self.insertions, "words": self.words, "utterances": self.utterances,
            "skipped": skipped, "chars": self.chars, "char_errors": self.char_errors,
        }


@dataclass(frozen=True)
class UttErrors:
    """One scored utterance (texts as scored, i.e. normalized). `ops` has one letter per column
    of the word alignment: C correct, S substitution, D deletion, I insertion."""

    id: str
    ref: str
    hyp: str
    substitutions: int
    deletions: int
    insertions: int
    words: int
    ops: str = ""

    @property
    def errors(self) -> int:
        return self.substitutions + self.deletions + self.insertions

    def alignment(self) -> str:
        """Three aligned lines, Kaldi / sclite style ("***" fills a gap; OPS blank when correct):

            REF: A B C D
            HYP: A X C ***
            OPS:   S   D
        """
        ops = self.ops or _word_ops([self.ref], [self.hyp])[0]
        rows: tuple[list[str], list[str], list[str]] = ([], [], [])
        for op, ref, hyp in _columns(self.ref.split(), self.hyp.split(), ops):
            ref, hyp = ref or "***", hyp or "***"
            width = max(len(ref), len(hyp))
            for row, cell in zip(rows, (ref, hyp, "" if op == "C" else op)):
                row.append(cell.ljust(width))
        return "\n".join(f"{name}: {' '.join(row)}".rstrip() for name, row in zip(("REF", "HYP", "OPS"), rows))


@dataclass(frozen=True)
class Report:
    """Everything `score` finds: totals, per-utterance errors (in the order of the references)
    and the substitution pairs, most frequent first: (ref word, hyp word, count)."""

    stats: ErrorStats
    utterances: list[UttErrors]
    confusions: list[tuple[str, str, int]]


# ---------------------------------------------------------------------------------------------
# scoring


def _columns(ref_words: list[str], hyp_words: list[str], ops: str):
    """Yield (op, ref word or None, hyp word or None) for each alignment column."""
    i = j = 0
    for op in ops:
        ref = ref_words[i] if op != "I" else None
        hyp = hyp_words[j] if op != "D" else None
        i += op != "I"
        j += op != "D"
        yield op, ref, hyp


_OP_LETTER = {"equal": "C", "substitute": "S", "delete": "D", "insert": "I"}


def _word_ops(refs: list[str], hyps: list[str]) -> list[str]:
    """Word alignment ops per utterance (see UttErrors.ops); one jiwer call for the pairs where
    both sides have words (jiwer may refuse empty strings), the others scored here."""
    ops = ["D" * len(r.split()) if not h else "I" * len(h.split()) for r, h in zip(refs, hyps)]
    both = [k for k, (r, h) in enumerate(zip(refs, hyps)) if r and h]
    if both:
        out = jiwer.process_words([refs[k] for k in both], [hyps[k] for k in both])
        for k, chunks in zip(both, out.alignments):
            ops[k] = "".join(
                _OP_LETTER[c.type] * max(c.ref_end_idx - c.ref_start_idx, c.hyp_end_idx - c.hyp_start_idx)
                for c in chunks
            )
    return ops


def _char_errors(refs: list[str], hyps: list[str]) -> int:
    """Total character edits (spaces between words count as characters, as in jiwer)."""
    errors = sum(len(h) if not r else len(r) for r, h in zip(refs, hyps) if not (r and h))
    both = [(r, h) for r, h in zip(refs, hyps) if r and h]
    if both:
        out = jiwer.process_characters([r for r, _ in both], [h for _, h in both])
        errors += out.substitutions + out.deletions + out.insertions
    return errors


def score(refs: Mapping[str, str], hyps: Mapping[str, str], *, normalize: bool = True) -> Report:
    """Corpus-level WER / CER of `hyps` against `refs` (id -> text).

    An id only in `hyps` raises ValueError naming it; an id only in `refs` is scored as an empty
    hypothesis (all deletions). Both sides go through `normalize_text` unless `normalize` is
    False (then whitespace is only collapsed). Rates: see ErrorStats.
    """
    extra = [uid for uid in hyps if uid not in refs]
    if extra:
        raise ValueError(f"hypothesis id {extra[0]!r} is not in the reference "
                         f"({len(extra)} such id{'s' if len(extra) > 1 else ''})")
    clean = normalize_text if normalize else _collapse
    ids = list(refs)
    ref_texts = [clean(refs[uid]) for uid in ids]
    hyp_texts = [clean(hyps.get(uid, "")) for uid in ids]
    utts = [
        UttErrors(uid, r, h, ops.count("S"), ops.count("D"), ops.count("I"), len(r.split()), ops)
        for uid, r, h, ops in zip(ids, ref_texts, hyp_texts, _word_ops(ref_texts, hyp_texts))
    ]
    subs, dels, ins, words = (sum(getattr(u, f) for u in utts)
                              for f in ("substitutions", "deletions", "insertions", "words"))
    chars, char_errors = sum(map(len, ref_texts)), _char_errors(ref_texts, hyp_texts)
    stats = ErrorStats(
        wer=(subs + dels + ins) / max(words, 1), cer=char_errors / max(chars, 1),
        substitutions=subs, deletions=dels, insertions=ins, words=words,
        chars=chars, char_errors=char_errors, utterances=len(utts),
    )
    return Report(stats, utts, _confusions(utts))


def _confusions(utts: list[UttErrors]) -> list[tuple[str, str, int]]:
    """Substitution pairs over all utterances, most frequent first (ties by the words)."""
    pairs = Counter(
        (ref, hyp)
        for u in utts if u.substitutions
        for op, ref, hyp in _columns(u.ref.split(), u.hyp.split(), u.ops) if op == "S"
    )
    return [(ref, hyp, n) for (ref, hyp), n in sorted(pairs.items(), key=lambda kv: (-kv[1], kv[0]))]


# ---------------------------------------------------------------------------------------------
# reports


def format_summary(stats: ErrorStats) -> str:
    """One line: "WER 33.33% [2 / 6: 1 sub, 1 del, 0 ins] CER 16.67% [3 / 18] over 2 utterances"."""
    return (f"WER {100 * stats.wer:.2f}% [{stats.errors} / {stats.words}: {stats.substitutions} sub, "
            f"{stats.deletions} del, {stats.insertions} ins] CER {100 * stats.cer:.2f}% "
            f"[{stats.char_errors} / {stats.chars}] over {stats.utterances} utterances")


def format_errors(report: Report, top_confusions: int = 30) -> str:
    """The text of errors.txt: the summary, every utterance's alignment worst first (most word
    errors; ties by id), then the `top_confusions` most frequent substitutions."""
    blocks = [format_summary(report.stats)]
    for u in sorted(report.utterances, key=lambda u: (-u.errors, u.id)):
        blocks.append(f"{u.id}: {u.errors} errors / {u.words} words "
                      f"({u.substitutions} sub, {u.deletions} del, {u.insertions} ins)\n{u.alignment()}")
    lines = [f"{n:6d}  {ref} -> {hyp}" for ref, hyp, n in report.confusions[:top_confusions]]
    blocks.append("most frequent substitutions (count  REF -> HYP):\n" + ("\n".join(lines) or "  none"))
    return "\n\n".join(blocks) + "\n"

