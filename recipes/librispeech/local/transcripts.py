"""Write the transcripts of a manifest as LM text: one sentence a line (stage 8 of run.sh).

    python local/transcripts.py TRAIN.jsonl OUT.txt

Speed-perturbed copies (a "speed" other than 1) are left out, so each utterance's text counts once.
The output is written to OUT.txt.tmp and renamed. A line that is not a JSON object with a "text"
is a one-line error naming the file and the line.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path


def transcripts(manifest: Path) -> list[str]:
    texts = []
    with manifest.open(encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                entry = json.loads(line)
                text, speed = entry["text"], entry.get("speed", 1.0)
            except (ValueError, TypeError, KeyError, AttributeError) as e:
                raise ValueError(f"{manifest}:{number}: not a manifest line with a text ({e})") from None
            words = str(text).split()
            if speed == 1.0 and words:
                texts.append(" ".join(words))
    return texts


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: transcripts.py MANIFEST.jsonl OUT.txt", file=sys.stderr)
        return 2
    manifest, out = Path(argv[0]), Path(argv[1])
    try:
        texts = transcripts(manifest)
        tmp = out.with_name(out.name + ".tmp")
        tmp.write_text("".join(f"{t}\n" for t in texts), encoding="utf-8")
        tmp.replace(out)
    except (OSError, ValueError) as e:
        print(f"transcripts.py: error: {e}", file=sys.stderr)
        return 1
    print(f"{out}: {len(texts)} sentences from {manifest}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
