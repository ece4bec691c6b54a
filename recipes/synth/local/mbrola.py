"""Training speech from a third synthesizer: a fraction of the corpus's training utterances spoken
again by MBROLA's diphone voices (us1 female, us2 and us3 male American, en1 male British), with
Flite's kal16 (or eSpeak NG, --prosody espeak) choosing the phonemes and prosody, so that the model hears
concatenated recorded diphones as well as eSpeak's formants and Flite's voices.

    python local/mbrola.py train --data DATA --fraction F [--pitch LO HI] [--add] [--voices V...] [--mbrola-dir DIR]
        [--seed S] [--jobs J] [--prosody flite|espeak]
    python local/mbrola.py say "SOME TEXT" OUT.flac [--voice V] [--mbrola-dir DIR] [--prosody flite|espeak]

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

By default (--prosody flite) Flite's kal16 chooses the phonemes, durations and intonation in eSpeak's
place (Festival's front end: CMU's lexicon, duration and F0 models): kal16 speaks the line at the
drawn speed, its phones and their durations (flite -psdur) and its F0, tracked on that speech, are
given to the MBROLA program as a .pho file, the contour scaled to the voice's own mean F0 (times
--pitch's factor). Flite comes from tools/flite.sh (into $ASR_FLITE_DIR or ~/.cache/asr-flite).
The lines are planned as eSpeak-driven MBROLA's are (the same lines, voices, speeds and pitches).
It was chosen on the learning check's three dev sets over three training seeds (recipes/README.md,
"MBROLA with Flite's prosody"); --prosody espeak has eSpeak choose them (its mb-* voices).
"""
from __future__ import annotations

import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import soundfile as sf
from festival import festival_text  # this script's folder
from flite import FLITE_SH, Engine, FliteError, fetch_by, spoken_wav
from flite import default_dir as flite_dir
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

# Flite's phones (CMU's) as each voice's phonemes: us1-3 American SAMPA, en1 British
VOWELS_US = {"aa": "A", "ae": "{", "ah": "V", "ao": "O", "aw": "aU", "ax": "@", "ay": "AI", "eh": "E", "er": "r=",
             "ey": "EI", "ih": "I", "iy": "i", "ow": "@U", "oy": "OI", "uh": "U", "uw": "u"}
VOWELS_EN1 = {"aa": "A:", "ae": "{", "ah": "V", "ao": "O:", "aw": "aU", "ax": "@", "ay": "aI", "eh": "e",
              "er": "3:", "ey": "eI", "ih": "I", "iy": "i:", "ow": "@U", "oy": "OI", "uh": "U", "uw": "u:"}
CONSONANTS = {"b": "b", "ch": "tS", "d": "d", "dh": "D", "f": "f", "g": "g", "hh": "h", "jh": "dZ", "k": "k",
              "l": "l", "m": "m", "n": "n", "ng": "N", "p": "p", "r": "r", "s": "s", "sh": "S", "t": "t", "th": "T",
              "v": "v", "w": "w", "y": "j", "z": "z", "zh": "Z", "pau": "_"}
VOICE_F0 = {"us1": 200.0, "us2": 100.0, "us3": 100.0, "en1": 105.0}  # measured: eSpeak's mb-* at pitch 50
EDGE_PAUSE = 0.03  # seconds kept of kal16's pauses at either end (the engine adds its own edges)
F0_HOP = 0.01  # seconds between F0 estimates


def track_f0(x: np.ndarray, rate: int, lo: float = 60.0, hi: float = 300.0) -> np.ndarray:
    """F0 (Hz; 0 where unvoiced or quiet) every F0_HOP seconds of `x`, frame i centred at i x F0_HOP,
    by the normalised cross-correlation of 30 ms frames: its first peak within 10% of the best (no
    octave drops), voiced where the best is over 0.6."""
    n, hop = int(0.03 * rate), int(F0_HOP * rate)
    lags = np.arange(int(rate / hi), int(rate / lo) + 1)
    x = np.concatenate([np.zeros(n // 2), np.asarray(x, np.float64), np.zeros(n + lags[-1])])
    floor = (0.02 * (np.abs(x).max() or 1.0)) ** 2 * n
    out = np.zeros((len(x) - n - lags[-1] - n // 2) // hop + 1)
    for i in range(len(out)):
        a = x[i * hop:i * hop + n]
        energy = a @ a
        if energy < floor:
            continue
        b = x[i * hop + lags[:, None] + np.arange(n)[None, :]]
        r = (b @ a) / np.sqrt(energy * (b * b).sum(1) + 1e-9)
        peaks = np.flatnonzero((r[1:-1] >= r[:-2]) & (r[1:-1] >= r[2:]) & (r[1:-1] >= 0.9 * r.max())) + 1
        if r.max() > 0.6 and len(peaks):
            out[i] = rate / lags[peaks[0]]
    return out


def flite_segments(text: str, stretch: float, wav: Path) -> list[tuple[str, float]]:
    """kal16's phones and their end times (s) for `text` at duration stretch `stretch`; its speech
    in `wav`. A FliteError says why not."""
    cmd = ["bash", str(FLITE_SH), "run", str(flite_dir()), "-voice", "kal16", "--setf", f"duration_stretch={stretch}",
           "-psdur", "-t", festival_text(text), "-o", str(wav)]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise FliteError(f"flite (kal16): {e}") from None
    segments = []
    for item in done.stdout.split():
        phone, _, end = item.rpartition(":")
        try:
            segments.append((phone, float(end)))
        except ValueError:
            segments = []
            break
    if done.returncode or not segments:
        tail = (done.stderr.strip().splitlines() or [f"exit {done.returncode}"])[-1]
        raise FliteError(f"flite (kal16) gave no segments for {text!r}: {tail}")
    return segments


def pho(segments: list[tuple[str, float]], f0: np.ndarray, voice: str, mean_f0: float) -> str:
    """MBROLA's input for `voice`: each phone, its duration (ms) and pitch points at 20% and 80% of
    it where `f0` (track_f0's, of the same speech) is voiced, the contour scaled to `mean_f0`
    (its median there) and octave errors (outside 0.6-1.7 of the median) left out."""
    names = {**CONSONANTS, **(VOWELS_EN1 if voice == "en1" else VOWELS_US)}
    voiced = f0[f0 > 0]
    median = float(np.median(voiced)) if len(voiced) else 0.0
    f0 = np.where((f0 > 0.6 * median) & (f0 < 1.7 * median), f0, 0.0)
    lines, start = [], 0.0
    for i, (phone, end) in enumerate(segments):
        if phone not in names:
            raise FliteError(f"Flite's phone {phone!r} has no {voice} phoneme")
        duration = min(end - start, EDGE_PAUSE) if phone == "pau" and i in (0, len(segments) - 1) else end - start
        points = []
        for at in (0.2, 0.8) if phone != "pau" else ():
            k = round((start + at * (end - start)) / F0_HOP)
            near = f0[max(0, k - 1):k + 2]
            if (near > 0).any():
                points.append(f"{round(100 * at)} {np.median(near[near > 0]) * mean_f0 / median:.0f}")
        if duration > 0:
            lines.append(" ".join([names[phone], str(max(1, round(1000 * duration))), *points]))
        start = end
    return "\n".join(lines) + "\n"


def speak_with_flite_prosody(text: str, voice: str, stretch: float, folder: Path, f0: float = 0.0) -> np.ndarray:
    """`text` spoken by MBROLA's `voice` with kal16's phones, durations and intonation (module
    docstring), at mean F0 `f0` Hz (0: the voice's own): (T,) float32 at SAMPLE_RATE in int16 units."""
    with tempfile.TemporaryDirectory(prefix="asr-mbrola-") as tmp:
        kal16, script = Path(tmp) / "kal16.wav", Path(tmp) / "in.pho"
        segments = flite_segments(text, stretch, kal16)
        x, rate = sf.read(str(kal16), dtype="float32")
        script.write_text(pho(segments, track_f0(x, rate), voice, f0 or VOICE_F0[voice]), encoding="utf-8")
        database = folder / "root" / "usr" / "share" / "mbrola" / voice / voice
        # -e: a diphone the database lacks (a rare pair of phonemes) is skipped rather than fatal
        return spoken_wav(lambda wav: ["bash", str(MBROLA_SH), "mbrola", str(folder), "-e", str(database), str(script),
                                       str(wav)], f"mbrola ({voice}, Flite's prosody)", text)


def fetch_with_flite(folder: Path) -> Path:
    """fetch(folder), with Flite fetched too (tools/flite.sh, into its own default folder)."""
    fetch_by(FLITE_SH, flite_dir())
    return fetch(folder)


MBROLA_FLITE = Engine("mbrola", "MBROLA with Flite's prosody", VOICES, "train_mbrola", "-mbrola", fetch_with_flite,
                      speak_with_flite_prosody, lambda voice, factor: round(VOICE_F0[voice] * factor),
                      variant="flite-prosody")
PROSODY = ("--prosody", {"flite": MBROLA_FLITE, "espeak": MBROLA},
           "who chooses phonemes, durations and intonation (default flite: Flite's kal16; espeak: eSpeak NG's "
           "mb-* voices)")


if __name__ == "__main__":
    sys.exit(engine_main(engine=MBROLA, doc=__doc__,
                         folder=("--mbrola-dir", default_dir(), "tools/mbrola.sh unpacks MBROLA"), variants=PROSODY))
