"""How far apart the synth recipe's accents are: eSpeak NG's own phonemes for a word list, compared.

    python recipes/synth/local/accents.py [--manifests DATA/dev.jsonl,DATA/test.jsonl] [--seed S] [--json OUT.json]

For each English accent of synthesize.ACCENTS, eSpeak NG writes the phonemes of every word of the
word list (`espeak_TextToPhonemes`, the same library and ctypes binding as the synthesis). Two
accents differ on a word by the edit distance between their phoneme sequences; the table gives,
for each pair, the differing phonemes over all words as a share of the phonemes (the mean length
of the two sequences), and the share of words spoken differently at all. The word list is the
words of the dev and test sentences (of --manifests, or of the generator's with --seed), so the
table says how far the held-out accents are from the training ones on the words they are tested on.

This helper needs only espeakng-loader (not the toolkit).
"""
from __future__ import annotations

import argparse
import ctypes
import json
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path

from synthesize import (  # this script's folder
    _CHARS_UTF8,
    ACCENTS,
    DEV_ACCENTS,
    TEST_ACCENTS,
    SynthError,
    generated_texts,
    open_espeak,
    set_voice,
)

_SEPARATOR = "_"  # between phonemes: bits 8-23 of phonememode
_PHONEME_MODE = ord(_SEPARATOR) << 8  # eSpeak's ASCII phoneme names


class Phonemizer:
    """eSpeak NG's phonemes of words (the synthesis's library, synthesize.open_espeak)."""

    def __init__(self) -> None:
        self._lib, _ = open_espeak()

    def phonemes(self, text: str, voice: str) -> tuple[str, ...]:
        """The phonemes of `text` in `voice`, stress marks dropped: ("h", "@", "l", "oU")."""
        set_voice(self._lib, voice)
        buffer = ctypes.c_char_p(text.lower().encode() + b"\0")
        pointer = ctypes.pointer(buffer)
        out = []
        while pointer.contents.value:  # one clause per call; the pointer moves past it
            clause = self._lib.espeak_TextToPhonemes(pointer, _CHARS_UTF8, _PHONEME_MODE)
            if clause is None:
                break
            out.append(clause.decode("utf-8", "replace"))
        names = " ".join(out).replace(" ", _SEPARATOR).split(_SEPARATOR)
        return tuple(p for p in (n.strip("',") for n in names) if p)


def edit_distance(a: Sequence[str], b: Sequence[str]) -> int:
    """Levenshtein distance between two sequences (substitutions, insertions, deletions cost 1)."""
    row = list(range(len(b) + 1))
    for i, x in enumerate(a, 1):
        diagonal, row[0] = row[0], i
        for j, y in enumerate(b, 1):
            diagonal, row[j] = row[j], min(row[j] + 1, row[j - 1] + 1, diagonal + (x != y))
    return row[-1]


Table = dict[str, dict[str, dict[str, float]]]


def distances(words: Iterable[str], accents: Sequence[str], phonemizer: Phonemizer) -> Table:
    """{a: {b: {"phonemes": share of differing phonemes, "words": share of words spoken differently}}}."""
    words = sorted(set(words))
    spoken = {a: [phonemizer.phonemes(w, a) for w in words] for a in accents}
    table: Table = {a: {} for a in accents}
    for a in accents:
        for b in accents:
            edits = [edit_distance(x, y) for x, y in zip(spoken[a], spoken[b])]
            length = sum((len(x) + len(y)) / 2 for x, y in zip(spoken[a], spoken[b]))
            table[a][b] = {"phonemes": sum(edits) / max(length, 1.0),
                           "words": sum(e > 0 for e in edits) / max(len(words), 1)}
    return table


def role(accent: str) -> str:
    return "test" if accent in TEST_ACCENTS else "dev" if accent in DEV_ACCENTS else "train"


def markdown(table: Table, num_words: int) -> str:
    """The table as Markdown: differing phonemes (and words) in percent, each accent against each."""
    accents = list(table)
    head = "| accent (role) | " + " | ".join(accents) + " | nearest training accent |"
    lines = [head, "|" + "---|" * (len(accents) + 2)]
    train = [a for a in accents if role(a) == "train"]
    for a in accents:
        cells = [f"{100 * table[a][b]['phonemes']:.1f} ({100 * table[a][b]['words']:.0f})" for b in accents]
        others = [b for b in train if b != a]
        near = min(others, key=lambda b: table[a][b]["phonemes"]) if others else "-"
        near_cell = f"{near} {100 * table[a][near]['phonemes']:.1f}" if others else "-"
        lines.append(f"| {a} ({role(a)}) | " + " | ".join(cells) + f" | {near_cell} |")
    return (f"Differing phonemes in % of phonemes (words spoken differently in %), over the {num_words} "
            "distinct words of the dev and test sentences:\n\n" + "\n".join(lines))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--manifests", help="comma-separated manifests whose words to compare (default: the "
                        "generator's dev and test sentences)")
    parser.add_argument("--seed", type=int, default=0, help="without --manifests: the corpus seed (synthesize.py)")
    parser.add_argument("--num-dev", type=int, default=200)
    parser.add_argument("--num-test", type=int, default=400)
    parser.add_argument("--json", type=Path, help="also write the table here")
    args = parser.parse_args(argv)
    if args.manifests:
        lines = [line for m in args.manifests.split(",") for line in Path(m).read_text(encoding="utf-8").splitlines()]
        sentences = [json.loads(line)["text"] for line in lines if line.strip()]
    else:
        texts = generated_texts({"train": 0, "dev": args.num_dev, "test": args.num_test}, args.seed)
        sentences = texts["dev"] + texts["test"]
    words = {w for s in sentences for w in s.split()}
    try:
        table = distances(words, ACCENTS, Phonemizer())
    except SynthError as e:
        print(f"accents: error: {e}", file=sys.stderr)
        return 1
    print(markdown(table, len(words)))
    if args.json:
        args.json.write_text(json.dumps({"words": len(words), "table": table}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
