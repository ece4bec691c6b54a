"""Training speech from a third synthesizer: a fraction of the corpus's training utterances spoken
again by MBROLA's diphone voices (us1 female, us2 and us3 male American, en1 male British), with
eSpeak NG choosing the phonemes and prosody (its mb-* voices), so that the model hears
concatenated recorded diphones as well as eSpeak's formants and Flite's voices.

    python local/mbrola.py train --data DATA --fraction F [--pitch LO HI] [--add] [--voices V...] [--mbrola-dir DIR]
        [--seed S] [--jobs J]
    python local/mbrola.py say "SOME TEXT" OUT.flac [--voice V] [--mbrola-dir DIR]

`train` is local/flite.py's with this engine: the same choice of lines (a seed stream of its own),
voice decks, speeds, edges and noise, ids "<id>-mbrola" with --add, speakers "mbrola+<voice>",
FLACs in DATA/wav/train_mbrola, DATA/corpus.json's "mbrola"; it plans among the corpus's own lines
and leaves the other engines' as they are (with --add, the engines may run in any order). A speed
(duration stretch s) is eSpeak's rate 170/s words per minute; --pitch's factor f is eSpeak's pitch
50 + 75 log2(f) (measured on the male voices: 25, 50 and 75 give a mean F0 of 0.79, 1 and 1.25
times the voice's own). Festival's ked, the unseen synthesizer of dev_synth, is neither engine nor
voice here: MBROLA is a separate program (Mons), and its voices are other speakers' diphone
databases. MBROLA comes from tools/mbrola.sh (fetched into --mbrola-dir, default $ASR_MBROLA_DIR or
~/.cache/asr-mbrola, when missing); its voices' licence forbids selling them, or a product with
them, without their owner's permission (tools/mbrola.sh).
"""
from __future__ import annotations

import math
import os
import sys
from pathlib import Path

import numpy as np
from flite import Engine, fetch_by, spoken_wav  # this script's folder
from flite import main as engine_main
from synthesize import engine_text

VOICES = ("us1", "us2", "us3", "en1")
MBROLA_SH = Path(__file__).resolve().parents[3] / "tools" / "mbrola.sh"
WPM_AT_STRETCH_1 = 170  # eSpeak's words per minute at duration stretch 1: 136-200 over flite.DURATION_STRETCH


def default_dir() -> Path:
    return Path(os.environ.get("ASR_MBROLA_DIR") or Path.home() / ".cache" / "asr-mbrola")


def fetch(folder: Path) -> Path:
    """A folder whose espeak-ng speaks with the voices (tools/mbrola.sh fetch), or a FliteError saying why not."""
    return fetch_by(MBROLA_SH, folder)


def espeak_pitch(factor: float) -> int:
    """eSpeak's pitch setting (0-100, 50: the voice's own) for a voice's pitch times `factor`."""
    return min(100, max(0, round(50 + 75 * math.log2(factor))))


def speak(text: str, voice: str, stretch: float, folder: Path, pitch: float = 0.0) -> np.ndarray:
    """`text` (a manifest text) spoken by MBROLA's `voice` at eSpeak's pitch `pitch` (0: the
    voice's own): (T,) float32 at SAMPLE_RATE in int16 units."""
    settings = ["-s", str(round(WPM_AT_STRETCH_1 / stretch)), *(["-p", str(round(pitch))] if pitch else [])]
    return spoken_wav(lambda wav: ["bash", str(MBROLA_SH), "run", str(folder), "-v", f"mb-{voice}", *settings,
                                   "-w", str(wav), "--", engine_text(text)], f"mbrola ({voice})", text)


MBROLA = Engine("mbrola", "MBROLA", VOICES, "train_mbrola", "-mbrola", fetch, speak,
                lambda voice, factor: espeak_pitch(factor))


if __name__ == "__main__":
    sys.exit(engine_main(engine=MBROLA, doc=__doc__,
                         folder=("--mbrola-dir", default_dir(), "tools/mbrola.sh unpacks MBROLA")))
