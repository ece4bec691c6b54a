"""Training speech from a fourth synthesizer: a fraction of the corpus's training utterances spoken
again by SVOX Pico's English voices (en-US and en-GB, both female; HMM-based), through its library
(ctypes), so that the model hears a statistical parametric synthesizer of another make than Flite's.

    python local/pico.py train --data DATA --fraction F [--pitch LO HI] [--add] [--voices V...] [--pico-dir DIR]
        [--seed S] [--jobs J]
    python local/pico.py say "SOME TEXT" OUT.flac [--voice V] [--pico-dir DIR]

`train` is local/flite.py's with this engine (as local/mbrola.py's): its own seeded choice of the
corpus's own lines, ids "<id>-pico" with --add, speakers "pico+<voice>", FLACs in
DATA/wav/train_pico, DATA/corpus.json's "pico". A speed (duration stretch s) is Pico's speed level
100/s percent; --pitch's factor f its pitch level 100 f percent. Pico comes from tools/pico.sh
(fetched into --pico-dir, default $ASR_PICO_DIR or ~/.cache/asr-pico, when missing; Debian's
non-free).
"""
from __future__ import annotations

import ctypes
import os
import sys
import threading
from pathlib import Path

import numpy as np
from flite import Engine, FliteError, fetch_by  # this script's folder
from flite import main as engine_main
from synthesize import at_corpus_rate, engine_text

VOICES = ("en-US", "en-GB")
PICO_SH = Path(__file__).resolve().parents[3] / "tools" / "pico.sh"
SPEAKER = {"en-US": "lh0", "en-GB": "kh0"}  # each voice's speaker resource
_MEMORY = 4_000_000  # bytes Pico works in, per voice (one voice's two resources need ~2.5 MB)
_BUSY = 201  # PICO_STEP_BUSY: more data to come
PICO_RATE = 16000  # the rate Pico speaks at


def default_dir() -> Path:
    return Path(os.environ.get("ASR_PICO_DIR") or Path.home() / ".cache" / "asr-pico")


def fetch(folder: Path) -> Path:
    """A folder with Pico's library and voices (tools/pico.sh fetch), or a FliteError saying why not."""
    return fetch_by(PICO_SH, folder)


class _Voice:
    """One voice's Pico system and engine (the library keeps no other state)."""

    def __init__(self, folder: Path, voice: str) -> None:
        root = folder / "root" / "usr"
        self.lib = lib = ctypes.CDLL(str(root / "lib" / "x86_64-linux-gnu" / "libttspico.so.0"))
        for name in ("pico_initialize", "pico_loadResource", "pico_getResourceName", "pico_createVoiceDefinition",
                     "pico_addResourceToVoiceDefinition", "pico_newEngine", "pico_putTextUtf8", "pico_getData"):
            getattr(lib, name).restype = ctypes.c_int16
        self.memory = ctypes.create_string_buffer(_MEMORY)  # kept alive as long as the system
        self.system, self.engine = ctypes.c_void_p(), ctypes.c_void_p()
        self._check(lib.pico_initialize(self.memory, ctypes.c_uint32(_MEMORY), ctypes.byref(self.system)), "initialize")
        name = voice.encode()
        self._check(lib.pico_createVoiceDefinition(self.system, name), "voice")
        for file in (f"{voice}_ta.bin", f"{voice}_{SPEAKER[voice]}_sg.bin"):
            resource, resource_name = ctypes.c_void_p(), ctypes.create_string_buffer(200)
            path = root / "share" / "pico" / "lang" / file
            self._check(lib.pico_loadResource(self.system, str(path).encode(), ctypes.byref(resource)), str(path))
            self._check(lib.pico_getResourceName(self.system, resource, resource_name), str(path))
            self._check(lib.pico_addResourceToVoiceDefinition(self.system, name, resource_name.value), str(path))
        self._check(lib.pico_newEngine(self.system, name, ctypes.byref(self.engine)), "engine")

    @staticmethod
    def _check(status: int, what: str) -> None:
        if status != 0:
            raise FliteError(f"pico: {what}: status {status}")

    def say(self, text: str) -> np.ndarray:
        """(T,) int16 at PICO_RATE for `text` (Pico's markup allowed)."""
        data = text.encode() + b"\0"
        put, received, kind = ctypes.c_int16(), ctypes.c_int16(), ctypes.c_int16()
        buffer = ctypes.create_string_buffer(1024)
        chunks, at = [], 0
        while at < len(data):
            piece = data[at:at + 16000]
            self._check(self.lib.pico_putTextUtf8(self.engine, piece, ctypes.c_int16(len(piece)), ctypes.byref(put)),
                        "text")
            at += put.value
            status = _BUSY
            while status == _BUSY:
                status = self.lib.pico_getData(self.engine, buffer, ctypes.c_int16(len(buffer)), ctypes.byref(received),
                                               ctypes.byref(kind))
                if received.value:
                    chunks.append(np.frombuffer(buffer.raw[:received.value], np.int16).copy())
        return np.concatenate(chunks) if chunks else np.zeros(0, np.int16)


_voices: dict[tuple[Path, str], _Voice] = {}
_lock = threading.Lock()  # one call at a time: an engine is not to be shared across threads


def speak(text: str, voice: str, stretch: float, folder: Path, pitch: float = 0.0) -> np.ndarray:
    """`text` (a manifest text) spoken by Pico's `voice` at pitch level `pitch` percent (0: the
    voice's own): (T,) float32 at SAMPLE_RATE in int16 units."""
    plain = "".join(c for c in engine_text(text) if c not in "<>&")
    markup = f'<speed level="{round(100 / stretch)}">{plain}</speed>'
    if pitch:
        markup = f'<pitch level="{round(pitch)}">{markup}</pitch>'
    with _lock:
        key = (Path(folder), voice)
        if key not in _voices:
            _voices[key] = _Voice(Path(folder), voice)
        y = _voices[key].say(markup)
    if not y.size:
        raise FliteError(f"pico ({voice}) gave no audio for {text!r}")
    return at_corpus_rate(y, PICO_RATE)


PICO = Engine("pico", "SVOX Pico", VOICES, "train_pico", "-pico", fetch, speak,
              lambda voice, factor: round(100 * factor))


if __name__ == "__main__":
    sys.exit(engine_main(engine=PICO, doc=__doc__, folder=("--pico-dir", default_dir(), "tools/pico.sh unpacks Pico")))
