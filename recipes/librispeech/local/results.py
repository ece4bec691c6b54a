"""Write the results table of a LibriSpeech experiment from its decoding folders' wer.json.

    python local/results.py --exp-dir EXP --decode-name decode_default_beam20 \
        --sets dev-clean,dev-other,test-clean,test-other [--out EXP/RESULTS.md] [--merge]

Reads EXP/<decode-name>/<set>/wer.json (written by `asr decode`) for each set and writes a
Markdown table (WER, its substitutions / deletions / insertions, CER) to --out and stdout.
With --merge, the other tables already in --out are kept (that of the same decoding is replaced),
so that one file collects several decodings (RESULTS_lm.md: each LM, each weight).
A set without its wer.json is a one-line error.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

HEADER = ("| test set | utterances | words | WER % | sub | del | ins | CER % | skipped |\n"
          "|---|---:|---:|---:|---:|---:|---:|---:|---:|")


def row(name: str, wer: dict) -> str:
    """One table line from an `asr decode` wer.json."""
    return (f"| {name} | {wer['utterances']} | {wer['words']} | {100 * wer['wer']:.2f} | "
            f"{wer['substitutions']} | {wer['deletions']} | {wer['insertions']} | {100 * wer['cer']:.2f} | "
            f"{wer.get('skipped', 0)} |")


def table(exp: Path, decode_name: str, sets: list[str], title: str) -> str:
    lines = [f"# {title}", "",
             f"Experiment `{exp}`, decoding `{decode_name}` (error rates in %, counts in words).", "",
             HEADER]
    for name in sets:
        path = exp / decode_name / name / "wer.json"
        if not path.is_file():
            raise FileNotFoundError(f"{path}: missing (run the decoding stage first)")
        lines.append(row(name, json.loads(path.read_text(encoding="utf-8"))))
    return "\n".join(lines) + "\n"


def merge(old: str, new: str, decode_name: str) -> str:
    """The tables of `old` (each from its '# ' title line) with that of decode_name replaced by
    `new` in place, or `new` appended."""
    key = f"decoding `{decode_name}`"
    tables = [t.rstrip("\n") + "\n" for t in re.split(r"(?m)^(?=# )", old) if t.strip()]
    merged = [new if key in t else t for t in tables]
    if new not in merged:
        merged.append(new)
    return "\n".join(merged)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--exp-dir", required=True, type=Path)
    p.add_argument("--decode-name", required=True)
    p.add_argument("--sets", required=True, help="comma-separated test sets")
    p.add_argument("--title", default="LibriSpeech results")
    p.add_argument("--out", type=Path, help="default: EXP/RESULTS.md")
    p.add_argument("--merge", action="store_true", help="keep the other decodings' tables in --out")
    args = p.parse_args(argv)
    try:
        text = table(args.exp_dir, args.decode_name, [s for s in args.sets.split(",") if s], args.title)
    except (OSError, ValueError, KeyError) as e:
        print(f"results.py: error: {e}", file=sys.stderr)
        return 1
    out = args.out or args.exp_dir / "RESULTS.md"
    whole = merge(out.read_text(encoding="utf-8"), text, args.decode_name) if args.merge and out.is_file() else text
    out.write_text(whole, encoding="utf-8")
    sys.stdout.write(text)
    print(f"written to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
