"""Training speech from a fifth synthesizer: a fraction of the corpus's training utterances spoken
again by RHVoice's English voices (alan, Scottish male; bdl, American male; clb and slt, American
female: HMM-based, trained on the CMU ARCTIC speakers), through its library (ctypes), so that the
model hears the statistical parametric voices of yet another make, with its own front end.

    python local/rhvoice.py train --data DATA --fraction F [--pitch LO HI] [--add] [--voices V...]
        [--rhvoice-dir DIR] [--seed S] [--jobs J]
    python local/rhvoice.py say "SOME TEXT" OUT.flac [--voice V] [--rhvoice-dir DIR]

`train` is local/flite.py's with this engine (as local/pico.py's): its own seeded choice of the
corpus's own lines, ids "<id>-rhvoice" with --add, speakers "rhvoice+<voice>", FLACs in
DATA/wav/train_rhvoice, DATA/corpus.json's "rhvoice". A speed (duration stretch s) is RHVoice's
relative rate 1/s; --pitch's factor f its relative pitch f (stored as the percentage 100 f). RHVoice
comes from tools/rhvoice.sh (fetched into --rhvoice-dir, default $ASR_RHVOICE_DIR or
~/.cache/asr-rhvoice, when missing; Debian's non-free).
"""
from __future__ import annotations

import ctypes
import os
import sys
import tempfile
import threading
from pathlib import Path

import numpy as np
from flite import Engine, FliteError, fetch_by  # this script's folder
from flite import main as engine_main
from synthesize import at_corpus_rate, engine_text

VOICES = ("alan", "bdl", "clb", "slt")
RHVOICE_SH = Path(__file__).resolve().parents[3] / "tools" / "rhvoice.sh"

_RATE = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_int, ctypes.c_void_p)
_PLAY = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(ctypes.c_short), ctypes.c_uint, ctypes.c_void_p)


class _Callbacks(ctypes.Structure):  # RHVoice_callbacks (RHVoice.h): the optional ones left 0
    _fields_ = [("set_sample_rate", _RATE), ("play_speech", _PLAY)] + [
        (name, ctypes.c_void_p) for name in ("process_mark", "word_starts", "word_ends", "sentence_starts",
                                             "sentence_ends", "play_audio", "done")]


class _InitParams(ctypes.Structure):  # RHVoice_init_params
    _fields_ = [("data_path", ctypes.c_char_p), ("config_path", ctypes.c_char_p),
                ("resource_paths", ctypes.POINTER(ctypes.c_char_p)), ("callbacks", _Callbacks),
                ("options", ctypes.c_uint)]


class _SynthParams(ctypes.Structure):  # RHVoice_synth_params
    _fields_ = [("voice_profile", ctypes.c_char_p)] + [
        (name, ctypes.c_double) for name in ("absolute_rate", "absolute_pitch", "absolute_volume",
                                             "relative_rate", "relative_pitch", "relative_volume")] + [
        ("punctuation_mode", ctypes.c_int), ("punctuation_list", ctypes.c_char_p), ("capitals_mode", ctypes.c_int),
        ("flags", ctypes.c_int)]


def default_dir() -> Path:
    return Path(os.environ.get("ASR_RHVOICE_DIR") or Path.home() / ".cache" / "asr-rhvoice")


def fetch(folder: Path) -> Path:
    """A folder with RHVoice's library and voices (tools/rhvoice.sh fetch), or a FliteError saying why not."""
    return fetch_by(RHVOICE_SH, folder)


class _Synthesizer:
    """RHVoice's engine over a fetched folder: its libraries, data and an empty configuration (the
    engine reads no file of the user's)."""

    def __init__(self, folder: Path) -> None:
        root = folder / "root" / "usr"
        lib_dir = root / "lib" / "x86_64-linux-gnu"
        try:  # the core finds libsonic among the libraries already loaded
            for name in ("libsonic.so.0", "libRHVoice_core.so.7"):
                ctypes.CDLL(str(lib_dir / name), mode=ctypes.RTLD_GLOBAL)
            self.lib = lib = ctypes.CDLL(str(lib_dir / "libRHVoice.so.5"))
        except OSError as e:
            raise FliteError(f"rhvoice: {e}") from None
        lib.RHVoice_new_tts_engine.restype = ctypes.c_void_p
        lib.RHVoice_new_tts_engine.argtypes = [ctypes.POINTER(_InitParams)]
        lib.RHVoice_new_message.restype = ctypes.c_void_p
        lib.RHVoice_new_message.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_uint, ctypes.c_int,
                                            ctypes.POINTER(_SynthParams), ctypes.c_void_p]
        lib.RHVoice_speak.argtypes = [ctypes.c_void_p]
        lib.RHVoice_delete_message.argtypes = [ctypes.c_void_p]
        self.rate, self.chunks = 0, []
        # the callbacks are kept alive as long as the engine
        self._callbacks = _Callbacks(set_sample_rate=_RATE(self._set_rate), play_speech=_PLAY(self._play))
        self._config = tempfile.TemporaryDirectory(prefix="asr-rhvoice-")
        params = _InitParams(data_path=str(root / "share" / "RHVoice").encode(), config_path=self._config.name.encode(),
                             callbacks=self._callbacks, options=0)
        self.engine = lib.RHVoice_new_tts_engine(ctypes.byref(params))
        if not self.engine:
            raise FliteError(f"rhvoice: no engine from the data in {root / 'share' / 'RHVoice'}")

    def _set_rate(self, rate: int, user_data: int) -> int:
        self.rate = rate
        return 1

    def _play(self, samples: ctypes.Array, count: int, user_data: int) -> int:
        self.chunks.append(np.ctypeslib.as_array(samples, (count,)).copy())
        return 1

    def say(self, text: str, voice: str, rate: float, pitch: float) -> tuple[np.ndarray, int]:
        """(T,) int16 and its sample rate for `text` by `voice` at relative `rate` and `pitch`."""
        self.rate, self.chunks = 0, []
        params = _SynthParams(voice_profile=voice.capitalize().encode(), relative_rate=rate, relative_pitch=pitch,
                              relative_volume=1.0)
        data = text.encode()
        message = self.lib.RHVoice_new_message(self.engine, data, len(data), 0, ctypes.byref(params), None)
        if not message:
            raise FliteError(f"rhvoice ({voice}) refused the text {text!r}")
        try:
            self.lib.RHVoice_speak(message)
        finally:
            self.lib.RHVoice_delete_message(message)
        return (np.concatenate(self.chunks) if self.chunks else np.zeros(0, np.int16)), self.rate


_engines: dict[Path, _Synthesizer] = {}
_lock = threading.Lock()  # one message at a time: the engine's callbacks fill one buffer


def speak(text: str, voice: str, stretch: float, folder: Path, pitch: float = 0.0) -> np.ndarray:
    """`text` (a manifest text) spoken by RHVoice's `voice` at relative pitch `pitch` percent (0:
    the voice's own): (T,) float32 at SAMPLE_RATE in int16 units."""
    with _lock:
        if Path(folder) not in _engines:
            _engines[Path(folder)] = _Synthesizer(Path(folder))
        y, rate = _engines[Path(folder)].say(engine_text(text), voice, 1.0 / stretch, pitch / 100 if pitch else 1.0)
    if not y.size or not rate:
        raise FliteError(f"rhvoice ({voice}) gave no audio for {text!r}")
    return at_corpus_rate(y, rate)


RHVOICE = Engine("rhvoice", "RHVoice", VOICES, "train_rhvoice", "-rhvoice", fetch, speak,
                 lambda voice, factor: round(100 * factor))


if __name__ == "__main__":
    sys.exit(engine_main(engine=RHVOICE, doc=__doc__,
                         folder=("--rhvoice-dir", default_dir(), "tools/rhvoice.sh unpacks RHVoice")))
