"""Human speech in training: Asterisk's core English prompts (one speaker, Allison Smith; 568
telephone-system prompts, ~26 min of G.722 wideband audio at 16 kHz) added to a corpus's training
lines, so that a model trained on synthesizers hears a human voice too.

    python local/human.py train --data DATA [--copies K] [--asterisk-dir DIR] [--seed S]

`train` appends each prompt that has a plain transcript K times to DATA/train.jsonl (ids
"human-<i>-<k>" for the i-th prompt kept, in the transcript file's order; speaker
"asterisk+allison"; FLACs in DATA/wav/train_human), each copy with its own edges and noise floor
drawn from the seed (DATA/corpus.json's, else --seed) as the synthesizers' lines get them
(synthesize.TRIMMED_EDGE, with_edges_and_noise); K 0 removes them.
A re-run replaces the lines an earlier one added, keeps a FLAC whose stored key matches and removes
those no line names any more (fewer copies).
Transcripts are normalized as the corpus's (synthesize.speakable; "*" is "star", "#" "pound");
prompts without words ([tones]) or with a number of three digits or more or a decimal (how she
reads "1234" or "28.8" is not written down) are left out, and an unreadable recording is left out
with one line naming it. DATA/corpus.json records what was added. The prompts come from
tools/asterisk.sh (fetched into --asterisk-dir, default $ASR_ASTERISK_DIR or ~/.cache/asr-asterisk,
when missing); G.722 is decoded by PyAV (`pip install -e '.[human]'`). They are CC-BY-SA 3.0.
"""
from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import os
import random
import re
import sys
from pathlib import Path

import numpy as np
from flite import RECORDED, FliteError, fetch_by, manifest_lines  # this script's folder
from synthesize import (
    EDGE_SILENCE,
    NOISE_SNR_DB,
    SAMPLE_RATE,
    TRIMMED_EDGE,
    existing_frames,
    speakable,
    with_edges_and_noise,
    write_flac,
)

from asr.fileio import atomic_open

ASTERISK_SH = Path(__file__).resolve().parents[3] / "tools" / "asterisk.sh"
SOUNDS = Path("root/usr/share/asterisk/sounds/en_US_f_Allison")  # under the fetched folder
TRANSCRIPTS = Path("root/usr/share/doc/asterisk-core-sounds-en/core-sounds-en.txt.gz")
FOLDER = "train_human"  # under DATA/wav
PREFIX = "human-"  # of the ids this module adds
SPEAKER = f"{RECORDED[0]}+allison"  # no engine speaks these lines again
_UNREAD = re.compile(r"\d{3}|\d[.,]\d|\[")  # numbers read in an unknown way, [non-speech]


def default_dir() -> Path:
    return Path(os.environ.get("ASR_ASTERISK_DIR") or Path.home() / ".cache" / "asr-asterisk")


def prompts(folder: Path) -> list[tuple[str, str]]:
    """(prompt name, transcript) of every prompt whose transcript can be trusted word for word,
    in the transcript file's order; the name is the recording's path below SOUNDS, without .g722."""
    path = folder / TRANSCRIPTS
    out = []
    with gzip.open(path, "rt", encoding="utf-8") as f:
        for line in f:
            name, sep, text = line.partition(":")
            if line.startswith(";") or not sep:
                continue
            text = text.strip().replace("*", " star ").replace("#", " pound ")
            if _UNREAD.search(text) or not (words := speakable(text)):
                continue
            out.append((name.strip(), words))
    return out


def read_g722(path: Path) -> np.ndarray:
    """A raw G.722 file as (T,) float32 at 16 kHz in int16 units."""
    try:
        import av
    except ImportError:
        raise FliteError("decoding G.722 needs PyAV: pip install -e '.[human]'") from None
    try:
        with av.open(str(path), format="g722") as container:
            frames = [frame.to_ndarray().reshape(-1) for frame in container.decode(audio=0)]
    except (av.error.FFmpegError, OSError) as e:
        raise FliteError(f"{path}: cannot be read as G.722 ({e})") from None
    if not frames:
        raise FliteError(f"{path}: no audio")
    return np.concatenate(frames).astype(np.float32)


def add_to_train(data: Path, copies: int, folder: Path, seed: int | None = None) -> int:
    """Append the prompts `copies` times to DATA/train.jsonl (module docstring); the lines added."""
    manifest = data / "train.jsonl"
    rows = [x for x in manifest_lines(manifest) if not (x["id"].startswith(PREFIX) and x.get("speaker") == SPEAKER)]
    card_path = data / "corpus.json"
    card = json.loads(card_path.read_text(encoding="utf-8")) if card_path.is_file() else {}
    if seed is None:
        seed = card.get("seed", 0)
    added = []
    if copies > 0:
        fetch_by(ASTERISK_SH, folder)
        entries = []
        for name, text in prompts(folder):
            if (folder / SOUNDS / f"{name}.g722").is_file():
                entries.append((name, text))
            else:
                print(f"human: skipped {name}: no recording {SOUNDS / name}.g722 in {folder}", file=sys.stderr)
        rng = random.Random(seed)
        for i, (name, text) in enumerate(entries):
            try:
                y = read_g722(folder / SOUNDS / f"{name}.g722")
            except FliteError as e:
                print(f"human: skipped {name}: {e}", file=sys.stderr)
                continue
            for k in range(copies):
                uid = f"{PREFIX}{i:04d}-{k}"
                noise = hashlib.sha256(f"{uid}|{seed}".encode()).hexdigest()  # the noise floor's seed
                lead, tail = (0.0 if rng.random() < TRIMMED_EDGE else round(rng.uniform(*EDGE_SILENCE), 3)
                              for _ in range(2))
                snr = round(rng.uniform(*NOISE_SNR_DB), 1)
                key = hashlib.sha1(json.dumps([name, text, lead, tail, snr, noise]).encode()).hexdigest()
                audio = f"wav/{FOLDER}/{uid}.flac"
                frames = existing_frames(data / audio, key)
                if frames is None:
                    samples = with_edges_and_noise(y, lead, tail, snr, noise)
                    write_flac(data / audio, samples, key)
                    frames = len(samples)
                added.append({"id": uid, "audio": audio, "duration": frames / SAMPLE_RATE, "text": text,
                              "speaker": SPEAKER})
    with atomic_open(manifest) as f:
        f.writelines(json.dumps(x, ensure_ascii=False) + "\n" for x in rows + added)
    named = {Path(x["audio"]).name for x in added}
    for flac in (data / "wav" / FOLDER).glob("*.flac"):  # an earlier run's with more copies
        if flac.name not in named:
            flac.unlink()
    if card:
        card["human"] = {"source": "asterisk-core-sounds-en-g722 (Allison Smith, CC-BY-SA 3.0)",
                         "copies": copies, "utterances": len(added),
                         "seconds": round(sum(x["duration"] for x in added), 1)}
        with atomic_open(card_path) as f:
            f.write(json.dumps(card, indent=1) + "\n")
    print(f"human: {len(added)} lines of Asterisk's prompts ({copies} copies, "
          f"{sum(x['duration'] for x in added) / 60:.1f} min) in {manifest}", file=sys.stderr)
    return len(added)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("train", help="append the prompts to DATA/train.jsonl")
    p.add_argument("--data", type=Path, required=True, help="the corpus folder (train.jsonl)")
    p.add_argument("--copies", type=int, default=1, help="times each prompt is added (0: remove them)")
    p.add_argument("--seed", type=int, help="default: DATA/corpus.json's, else 0")
    p.add_argument("--asterisk-dir", type=Path, default=default_dir(),
                   help=f"where tools/asterisk.sh unpacks the prompts (default {default_dir()})")
    args = parser.parse_args(argv)
    if args.copies < 0:
        parser.error("--copies must be at least 0")
    try:
        add_to_train(args.data, args.copies, args.asterisk_dir, args.seed)
    except (FliteError, OSError, ValueError, KeyError) as e:
        print(f"human: error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
