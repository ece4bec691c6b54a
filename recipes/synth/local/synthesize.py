"""Stage 0 of the synthetic-speech recipe: a corpus spoken by eSpeak NG (PyPI `espeakng-loader`).

    python recipes/synth/local/synthesize.py --out-dir DATA --num-train N --num-dev M --num-test K \\
        [--num-dev-near M'] [--seed S] [--text FILE] [--jobs J] [--dev-accents en-029,en-gb-x-gbcwmd]
        [--test-accents en-gb-scotland,en-us-nyc] [--spliced F] [--random-words F] [--lm-sentences N]
        [--lm-clauses N]

writes DATA/wav/<split>/<id>.flac (16 kHz mono 16-bit FLAC) and DATA/{train,dev,test,dev_near}.jsonl,
manifests in the DESIGN.md format: {"id", "audio" (relative to DATA), "duration" (frames / 16000,
exact), "text" (normalized), "speaker" ("<accent>+<variant>")}, sorted by id; with the generator,
also DATA/lm_text.txt: more sentences of the training templates, then sentences of a clause grammar
(make_text.clauses), one per line, for the word LM; and DATA/corpus.json, what the worlds are (the
seed, the accents and templates of each split, the unseen words' share of dev and test).

Beside each manifest, DATA/<split>_words.jsonl: when each word starts in its FLAC, as eSpeak NG
says (its word events), the truth for measuring word timings (tools/word_timing_check.py): one
line per utterance, sorted by id, {"id", "words": [{"index": the word's index in the manifest
text, "word", "start": seconds from the start of the FLAC}], "key": the plan key}. eSpeak gives
most words an event, not all: a short word run into the next (AN in "OF AN OLD") may have none,
and those words are absent. The time is the word's boundary where eSpeak puts it (before a stop
consonant's silent closure: the audible onset may come some tens of ms later), carried to the
FLAC: seconds = lead silence + eSpeak's sample / its sample rate (nothing is trimmed, and the
resampling keeps times; timed_words).

Three worlds that share no sentence template, no voice and no unseen word. train: sentences of the
training templates, a fraction of them (--spliced) replaced by sentences spliced from runs of words
of the others, then a fraction (--random-words) by random words of the training vocabulary, spoken
in the training accents. dev: sentences of the dev templates (training templates held out with the
seed, make_text.dev_templates), spoken only in the dev accents, with dev's unseen words. test:
sentences of the test templates, spoken only in the test accents, with test's unseen words
(make_text.unseen_words: words that no training, dev or LM sentence holds). The accents are whole
eSpeak language voices, not variants of trained ones; local/accents.py measures how far apart they
are. Beside dev, dev_near: dev's sentences (the first --num-dev-near) spoken in the training
accents by voice variants that training never uses (NEAR_VARIANTS): the gap of a new voice alone,
where dev adds new pronunciations (local/festival.py makes the third dev set, dev_synth: a
synthesizer never heard). Every utterance draws its voice variant, speed (words per minute),
pitch, pitch range, volume and edge silences at random; the plan is deterministic given the seed
(the samples are not bit-exact: eSpeak keeps state between utterances).

Re-running is cheap: a FLAC whose stored plan key matches is kept; files are written to a
temporary name and renamed, and manifests are written last, atomically. A kept FLAC keeps its
word starts from the words file of the run that made it (the same plan key), or has them re-spoken
(eSpeak alone, no audio written: a small fraction of the synthesis time). eSpeak is not
thread-safe: each worker process initializes its own engine.

This helper needs only numpy, soundfile and espeakng-loader (not the toolkit).
"""
from __future__ import annotations

import argparse
import ctypes
import hashlib
import json
import math
import multiprocessing
import os
import random
import re
import sys
import time
import unicodedata
from bisect import bisect_right
from dataclasses import asdict, dataclass
from pathlib import Path
from types import ModuleType
from typing import Any, NamedTuple

# One BLAS thread per process: the work is spread over processes, and OpenBLAS threads spinning
# against each other on a busy 2-core machine make the resampler 10-50x slower. Set before numpy
# loads (and inherited by the spawned workers).
for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import numpy as np  # noqa: E402
import soundfile as sf  # noqa: E402
from make_text import (  # noqa: E402 (this script's folder)
    DEV_TEMPLATE_COUNT,
    TEST_TEMPLATES,
    TRAIN_TEMPLATES,
    clauses,
    make_sentences,
    number_words,
    ordinal_words,
    random_words_some,
    splice_some,
    unseen_words,
)

from asr.fileio import atomic_open  # noqa: E402

SAMPLE_RATE = 16000
SPLITS = ("train", "dev", "test")  # the three worlds
# and dev's sentences (its first --num-dev-near) again, spoken in the training accents by the voice
# variants training never uses (NEAR_VARIANTS): the acoustic gap alone, beside dev's unseen accents
NEAR = "dev_near"

# English language voices of eSpeak NG 1.52 (espeak-ng-data/lang/gmw). en-shaw is left out: it is
# "en" meant for the Shavian alphabet and sounds the same on Latin text.
ACCENTS = ("en-us", "en", "en-gb-x-rp", "en-gb-x-gbclan", "en-gb-x-gbcwmd", "en-029",
           "en-gb-scotland", "en-us-nyc")
# Held-out accents, each split its own (the rest train): one far from every training accent and
# one near one, for dev as for test (local/accents.py and recipes/README.md give the distances).
DEV_ACCENTS = ("en-029", "en-gb-x-gbcwmd")
TEST_ACCENTS = ("en-gb-scotland", "en-us-nyc")
# Voice variants (espeak-ng-data/voices/!v) that sound like people; "" is the accent's own voice.
# Left out: whisper, robots, echo-heavy and novelty variants (croak, Demonic, zac, ...).
VARIANTS = ("", "m1", "m2", "m3", "m4", "m5", "m6", "m7", "m8", "f1", "f2", "f3", "f4", "f5",
            "klatt", "klatt2", "klatt3", "klatt4", "Alex", "Andy", "Annie", "Denis", "Gene",
            "Mike", "Michael", "Mario", "adam", "benjamin", "david", "edward", "linda", "belinda",
            "aunty", "steph", "paul", "robert", "quincy", "rob", "travis", "victor", "max",
            "boris", "gustave", "ed", "grandpa", "grandma", "shelby")
# Variants held out of training, for dev_near (the training accents in voices never trained): two
# male, two female (formant and pitch shifts of the kind training has plenty of) and one of the Klatt
# engine's four. dev and test use every variant of their own accents, as before.
NEAR_VARIANTS = ("m3", "Andy", "f2", "linda", "klatt3")
TRAIN_VARIANTS = tuple(v for v in VARIANTS if v not in NEAR_VARIANTS)
RATE_WPM = (130, 200)      # espeakRATE, words per minute (eSpeak's default is 175)
PITCH = (25, 75)           # espeakPITCH, 0-100 (default 50)
PITCH_RANGE = (20, 80)     # espeakRANGE, 0-100 (default 50)
VOLUME = (50, 100)         # espeakVOLUME, percent (default 100; louder variants clip above it)
EDGE_SILENCE = (0.05, 0.3)  # seconds of silence added before and after the speech
# Training only: each edge of a training utterance is left without silence with this probability,
# so that the model hears speech that starts or stops at the first or last sample (tightly trimmed
# audio): a model trained only on silent edges loses the first and last words of trimmed audio.
TRIMMED_EDGE = 0.2
# Background noise, white, at this signal-to-noise ratio (dB: RMS of the nonzero speech samples
# over the noise RMS). eSpeak writes exact zeros between words and we add silent edges: 15-30% of
# the frames. Without noise their log-mel values sit at the floor (-15.9) when decoding but at the
# dither's level (+4.5) in training (dither is training-only), a mismatch no recording has; and a
# model that never heard a noise floor meets one in every real file.
NOISE_SNR_DB = (30.0, 50.0)
# Training sentences replaced by spliced ones (runs of words from other training sentences, no
# template frame; see make_text.splice_some), so that the model does not learn the templates as a
# language model.
SPLICED = 0.8
# Training sentences then replaced by random words of the vocabulary (make_text.random_words_some):
# new word orders for the acoustic model.
RANDOM_WORDS = 0.1
# Sentences of the training templates written to lm_text.txt for the recipe's word LM (run.sh stage
# 1, beside the training transcripts): the training stream continued past the training sentences.
LM_SENTENCES = 300_000
# Sentences of make_text's clause grammar written to lm_text.txt after those: word sequences of the
# training vocabulary that the templates lack (WE WILL, SHOULD HAVE, IF IT).
LM_CLAUSES = 100_000

# speak_lib.h
_AUDIO_OUTPUT_SYNCHRONOUS = 2
_INITIALIZE_DONT_EXIT = 0x8000
_POS_CHARACTER = 1
_CHARS_UTF8 = 1
_RATE, _VOLUME, _PITCH, _RANGE = 1, 2, 3, 4
_SYNTH_CALLBACK = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(ctypes.c_short), ctypes.c_int, ctypes.c_void_p)
_EVENT_LIST_TERMINATED, _EVENT_WORD = 0, 1  # espeak_EVENT_TYPE


class _Event(ctypes.Structure):
    """espeak_EVENT; the callback's third argument is an array of them ended by LIST_TERMINATED."""

    _fields_ = [("type", ctypes.c_int), ("unique_identifier", ctypes.c_uint),
                ("text_position", ctypes.c_int),  # 1-based, in characters (code points) of the text
                ("length", ctypes.c_int),  # characters of a WORD event's span
                ("audio_position", ctypes.c_int),  # ms of the call's audio (= sample * 1000 // rate)
                ("sample", ctypes.c_int),  # samples of the call's audio before the event
                ("user_data", ctypes.c_void_p),
                ("id", ctypes.c_char * 8)]  # union {int number; const char *name; char string[8]}


class SynthError(RuntimeError):
    """A one-line reason naming the utterance, voice or file at fault."""


# --- plan -------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Utt:
    """One utterance to synthesize: its text and how to speak it."""

    id: str
    split: str
    text: str  # normalized, as in the manifest
    voice: str  # "<accent>+<variant>" or "<accent>"
    wpm: int  # speed, words per minute
    pitch: int
    pitch_range: int
    volume: int
    lead: float  # seconds of silence before the speech
    tail: float  # seconds of silence after
    snr_db: float  # background noise level (see NOISE_SNR_DB)

    @property
    def audio(self) -> str:
        """Path of the FLAC relative to the output folder."""
        return f"wav/{self.split}/{self.id}.flac"

    @property
    def key(self) -> str:
        """Digest of everything that shapes the audio, stored in the FLAC to recognize it."""
        return hashlib.sha1(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()


def voices(accents: tuple[str, ...], variants: tuple[str, ...] = VARIANTS) -> list[str]:
    """Every accent with every variant: ["en-us", "en-us+m1", ...]."""
    return [f"{a}+{v}" if v else a for a in accents for v in variants]


def split_variants(split: str) -> tuple[str, ...]:
    """The variants a split's voices use: train, all but NEAR_VARIANTS; dev_near, those only; dev
    and test, every one."""
    return {"train": TRAIN_VARIANTS, NEAR: NEAR_VARIANTS}.get(split, VARIANTS)


def split_voices(split: str, accents: tuple[str, ...]) -> list[str]:
    """The voices a split's utterances are dealt from: its accents in its variants (split_variants);
    dev_near's accents are the training ones."""
    return voices(accents, split_variants(split))


def plan_split(split: str, texts: list[str], voice_list: list[str], seed: int) -> list[Utt]:
    """Utterances of a split: voices dealt evenly (shuffled decks), prosody drawn per utterance."""
    rng = random.Random(f"synth-voices:{split}:{seed}")

    def edge() -> float:
        if split == "train" and rng.random() < TRIMMED_EDGE:
            return 0.0
        return round(rng.uniform(*EDGE_SILENCE), 3)

    deck: list[str] = []
    utts = []
    for i, text in enumerate(texts):
        if not deck:
            deck = rng.sample(voice_list, len(voice_list))
        utts.append(Utt(
            id=f"{split}-{i:06d}", split=split, text=text, voice=deck.pop(),
            wpm=rng.randint(*RATE_WPM), pitch=rng.randint(*PITCH), pitch_range=rng.randint(*PITCH_RANGE),
            volume=rng.randint(*VOLUME),
            lead=edge(), tail=edge(),
            snr_db=round(rng.uniform(*NOISE_SNR_DB), 1),
        ))
    return utts


def generated_texts(num: dict[str, int], seed: int, spliced: float = SPLICED,
                    random_words: float = RANDOM_WORDS) -> dict[str, list[str]]:
    """Sentences of the built-in generator, each split from its own templates (make_text): a
    `spliced` fraction of train is replaced by sentences spliced from the others
    (make_text.splice_some, never a dev or test sentence), then a `random_words` fraction by random
    words of the training vocabulary (make_text.random_words_some)."""
    dev = make_sentences(num["dev"], "dev", seed)
    test = make_sentences(num["test"], "test", seed)
    train = splice_some(make_sentences(num["train"], "train", seed), spliced, seed, avoid=set(dev) | set(test))
    return {"train": random_words_some(train, random_words, seed), "dev": dev, "test": test}


def lm_sentences(num: dict[str, int], seed: int, count: int = LM_SENTENCES) -> list[str]:
    """`count` sentences of the training templates for the word LM: the training stream of
    generated_texts continued past its training sentences (so distinct from them)."""
    start = num["train"]
    return make_sentences(start + count, "train", seed)[start:]


def lm_clauses(count: int, seed: int) -> list[str]:
    """`count` sentences of the clause grammar (make_text.clauses) for the word LM."""
    return clauses(count, seed)


def corpus_card(texts: dict[str, list[str]], seed: int, accents: dict[str, tuple[str, ...]],
                generated: bool) -> dict[str, Any]:
    """What the corpus is, for DATA/corpus.json and the results: the seed, each split's accents,
    sentences and words, and (generated text) its templates and the share of its words that no
    training or LM sentence holds."""
    card: dict[str, Any] = {"seed": seed, "text": "generated" if generated else "file", "splits": {}}
    for split, sentences in texts.items():
        tokens = [w for s in sentences for w in s.split()]
        entry: dict[str, Any] = {"accents": list(accents[split]), "sentences": len(sentences),
                                 "words": len(tokens), "distinct_words": len(set(tokens))}
        entry["variants"] = list(split_variants(split))
        if generated:
            entry["templates"] = {"train": len(TRAIN_TEMPLATES) - DEV_TEMPLATE_COUNT, "dev": DEV_TEMPLATE_COUNT,
                                  NEAR: DEV_TEMPLATE_COUNT, "test": len(TEST_TEMPLATES)}[split]
            if split != "train":
                unseen = unseen_words("dev" if split == NEAR else split, seed)  # dev_near: dev's sentences
                entry["unseen_words"] = sum(w in unseen for w in tokens)
                entry["unseen_distinct_words"] = len(unseen & set(tokens))
        card["splits"][split] = entry
    return card


def file_texts(path: Path, num: dict[str, int], seed: int) -> dict[str, list[str]]:
    """Sentences of a text file (one per line), normalized and de-duplicated, shuffled with the seed:
    test and dev take distinct held-out sentences, train cycles through the rest."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise SynthError(f"{path}: cannot read the text file: {e}") from e
    sentences = list(dict.fromkeys(s for s in map(speakable, lines) if s))
    random.Random(f"synth-file:{seed}").shuffle(sentences)
    held_out = num["test"] + num["dev"]
    rest = sentences[held_out:]
    if len(sentences) < held_out or (not rest and num["train"] > 0):
        raise SynthError(f"{path}: {len(sentences)} distinct sentences, need more than "
                         f"--num-test + --num-dev = {held_out}")
    train = [rest[i % len(rest)] for i in range(num["train"])]
    return {"test": sentences[:num["test"]], "dev": sentences[num["test"]:held_out], "train": train}


# --- text ---------------------------------------------------------------------------------------------

_HYPHENS_SLASHES = re.compile(r"[-\u2010-\u2015\u2212/]")
_NUMBER = re.compile(r"(\d+(?:,\d{3})*)(?:\.(\d+))?(ST|ND|RD|TH)?")


def normalize(text: str) -> str:
    """The toolkit's normalization rule (DESIGN.md; asr.metrics.normalize_text) without the toolkit:
    NFKC, curly apostrophes to ', upper-case, hyphens and slashes to spaces, every other character
    that is not a letter, digit, apostrophe inside a word or space removed, whitespace collapsed."""
    text = unicodedata.normalize("NFKC", text).replace("\u2019", "'").replace("\u2018", "'").upper()
    text = _HYPHENS_SLASHES.sub(" ", text)
    kept = []
    for i, c in enumerate(text):
        inside = 0 < i < len(text) - 1 and text[i - 1].isalnum() and text[i + 1].isalnum()
        if c.isalnum() or c.isspace() or (c == "'" and inside):
            kept.append(" " if c.isspace() else c)
    return " ".join("".join(kept).split())


def _number_as_words(m: re.Match[str]) -> str:
    whole, decimals, suffix = m.group(1).replace(",", ""), m.group(2), m.group(3)
    n = int(whole)
    if suffix and 0 < n < 100 and not decimals:
        words = ordinal_words(n)
    elif n == 0 or (n < 10**9 and not whole.startswith("0")):
        words = number_words(n)
    else:  # codes and long numbers: digit by digit
        words = " ".join(number_words(int(d)) for d in whole)
    if decimals:
        words += " POINT " + " ".join(number_words(int(d)) for d in decimals)
    return f" {words} "


def speakable(line: str) -> str:
    """A line of user text as a normalized transcript with numbers in words (eSpeak says
    "42" as "forty two", so the transcript must too)."""
    upper = unicodedata.normalize("NFKC", line).upper()
    return normalize(_NUMBER.sub(_number_as_words, upper))


# --- audio --------------------------------------------------------------------------------------------


class Resampler:
    """Band-limited resampling with a Hann-windowed sinc, the same kernel as torchaudio's
    functional.resample (lowpass_filter_width=6, rolloff=0.99), in numpy."""

    def __init__(self, orig_rate: int, new_rate: int, lowpass_filter_width: int = 6, rolloff: float = 0.99) -> None:
        g = math.gcd(orig_rate, new_rate)
        self.orig, self.new = orig_rate // g, new_rate // g
        base = min(self.orig, self.new) * rolloff
        self.width = math.ceil(lowpass_filter_width * self.orig / base)
        idx = np.arange(-self.width, self.width + self.orig) / self.orig  # (K,), K = 2 width + orig
        t = (np.arange(0, -self.new, -1)[:, None] / self.new + idx[None, :]) * base  # (new, K)
        t = np.clip(t, -lowpass_filter_width, lowpass_filter_width)
        window = np.cos(t * np.pi / lowpass_filter_width / 2) ** 2
        t *= np.pi
        sinc = np.where(t == 0, 1.0, np.sin(t) / np.where(t == 0, 1.0, t))
        self.kernels = np.ascontiguousarray((sinc * window * base / self.orig).T, np.float32)  # (K, new)

    def __call__(self, x: np.ndarray) -> np.ndarray:
        """(T,) float32 at orig_rate -> (ceil(T * new / orig),) float32 at new_rate."""
        padded = np.pad(x.astype(np.float32), (self.width, self.width + self.orig))
        windows = np.lib.stride_tricks.sliding_window_view(padded, self.kernels.shape[0])[:: self.orig]
        y = (np.ascontiguousarray(windows) @ self.kernels).reshape(-1)  # (num_blocks * new,); BLAS wants contiguous
        return y[: math.ceil(self.new * len(x) / self.orig)]


def at_corpus_rate(samples: np.ndarray, rate: int) -> np.ndarray:
    """Another synthesizer's (T,) samples at `rate` -> float32 at SAMPLE_RATE, in the same units."""
    y = samples.astype(np.float32)
    return y if rate == SAMPLE_RATE else Resampler(rate, SAMPLE_RATE)(y)


def _loader() -> ModuleType:
    """The espeakng_loader package (libespeak-ng and its data), or a clear error."""
    try:
        import espeakng_loader
    except ImportError as e:
        raise SynthError("espeakng-loader is not installed: pip install -e '.[synth]'") from e
    return espeakng_loader


def open_espeak() -> tuple[ctypes.CDLL, int]:
    """libespeak-ng initialized in synchronous retrieval mode (once per process): (the library with
    the argument types of the calls this recipe makes, its sample rate), or a SynthError."""
    espeakng_loader = _loader()
    lib = ctypes.CDLL(espeakng_loader.get_library_path())
    lib.espeak_Initialize.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_char_p, ctypes.c_int]
    lib.espeak_SetVoiceByName.argtypes = [ctypes.c_char_p]
    lib.espeak_SetParameter.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int]
    lib.espeak_Synth.argtypes = [ctypes.c_char_p, ctypes.c_size_t, ctypes.c_uint, ctypes.c_int,
                                 ctypes.c_uint, ctypes.c_uint, ctypes.c_void_p, ctypes.c_void_p]
    lib.espeak_TextToPhonemes.argtypes = [ctypes.POINTER(ctypes.c_char_p), ctypes.c_int, ctypes.c_int]
    lib.espeak_TextToPhonemes.restype = ctypes.c_char_p
    data = espeakng_loader.get_data_path()
    sample_rate = lib.espeak_Initialize(_AUDIO_OUTPUT_SYNCHRONOUS, 0, data.encode(), _INITIALIZE_DONT_EXIT)
    if sample_rate <= 0:
        raise SynthError(f"{data}: eSpeak NG failed to initialize (error {sample_rate})")
    return lib, sample_rate


def set_voice(lib: ctypes.CDLL, voice: str) -> None:
    if lib.espeak_SetVoiceByName(voice.encode()) != 0:
        raise SynthError(f"eSpeak NG has no voice {voice!r}")


class WordEvent(NamedTuple):
    """One espeakEVENT_WORD: where eSpeak starts speaking a word of the text it was given."""

    text_position: int  # 1-based character position in that text
    length: int  # characters of the span (it stops at an apostrophe: "isn" of "isn't")
    sample: int  # samples (at the engine's rate) from the start of the call's audio


class Speech(NamedTuple):
    samples: np.ndarray  # (T,) int16 at the engine's rate
    words: tuple[WordEvent, ...]


class Rendered(NamedTuple):
    samples: np.ndarray  # (T,) int16 at SAMPLE_RATE: the FLAC's samples
    words: list[dict[str, Any]]  # [{"index", "word", "start"}] (word_starts)


class ESpeak:
    """One eSpeak NG engine (one per process) in synchronous retrieval mode."""

    def __init__(self) -> None:
        lib, self.sample_rate = open_espeak()
        self._lib = lib
        self._chunks: list[np.ndarray] = []
        self._words: list[WordEvent] = []
        self._callback = _SYNTH_CALLBACK(self._collect)  # kept alive as long as the engine

    def _collect(self, wav: Any, num_samples: int, events: Any) -> int:
        if wav and num_samples > 0:
            self._chunks.append(np.ctypeslib.as_array(wav, shape=(num_samples,)).copy())
        if events:
            array = ctypes.cast(events, ctypes.POINTER(_Event))
            i = 0
            while array[i].type != _EVENT_LIST_TERMINATED:
                e = array[i]
                if e.type == _EVENT_WORD:
                    self._words.append(WordEvent(e.text_position, e.length, e.sample))
                i += 1
        return 0  # 0 = go on

    def speak(self, text: str, voice: str, wpm: int = 175, pitch: int = 50, pitch_range: int = 50,
              volume: int = 100) -> Speech:
        """The samples at self.sample_rate (22050 Hz), as eSpeak writes them (its own few ms of
        silence at the edges included), and its word events.

        wpm: speed in words per minute; pitch, pitch_range: eSpeak's 0-100 scales (50 = the voice's
        own); volume: percent.

        The events' positions are the call's own: eSpeak NG 1.52 (espeakng-loader 0.2.4) restarts
        both its sample count and its text positions at every espeak_Synth, whatever came before
        (the same text spoken twice, or after another, gets the same positions; tests check it),
        so nothing cumulative is subtracted. `sample` is used rather than `audio_position`, its
        value in whole ms. A text too long for one clause keeps counting across its clauses.
        """
        set_voice(self._lib, voice)
        for parameter, value in ((_RATE, wpm), (_PITCH, pitch), (_RANGE, pitch_range), (_VOLUME, volume)):
            self._lib.espeak_SetParameter(parameter, value, 0)
        data = text.encode() + b"\0"
        self._chunks, self._words = [], []
        # the library holds one callback per process: this engine's, set for each call (another
        # engine made in this process since, then freed, would leave its dangling one: a crash)
        self._lib.espeak_SetSynthCallback(self._callback)
        status = self._lib.espeak_Synth(data, len(data), 0, _POS_CHARACTER, 0, _CHARS_UTF8, None, None)
        if status != 0 or not self._chunks:
            raise SynthError(f"eSpeak NG failed on {text!r} with voice {voice} (error {status})")
        return Speech(np.concatenate(self._chunks), tuple(self._words))

    def synthesize(self, text: str, voice: str, wpm: int = 175, pitch: int = 50, pitch_range: int = 50,
                   volume: int = 100) -> np.ndarray:
        """speak()'s samples only."""
        return self.speak(text, voice, wpm, pitch, pitch_range, volume).samples


def spoken_text(utt: Utt) -> str:
    """What eSpeak is given: the manifest text in lower case, ended as a sentence. The same words
    as the manifest's, one for one (no number or symbol is left to expand: speakable spelled them
    out before the manifest), so an event's word is found by its character position here.
    local/festival.py gives Festival the same text."""
    return engine_text(utt.text)


def engine_text(text: str) -> str:
    """A manifest text as a synthesizer is given it (spoken_text)."""
    return text.lower() + "."


def speak(utt: Utt, engine: ESpeak) -> Speech:
    return engine.speak(spoken_text(utt), utt.voice, utt.wpm, utt.pitch, utt.pitch_range, utt.volume)


def timed_words(utt: Utt, speech: Speech, engine_rate: int) -> list[dict[str, Any]]:
    """The word starts of `speech` in seconds of the FLAC render() writes from it: eSpeak's sample
    / its rate, plus the lead silence. Nothing else moves the speech: render trims nothing, the
    resampler is zero-phase (a sound at t seconds stays at t: same kernel as torchaudio's, centred),
    the rate (wpm) is eSpeak's own (its events are of the audio at that rate), the tail silence and
    the noise come after or on top."""
    lead = round(utt.lead * SAMPLE_RATE) / SAMPLE_RATE
    return word_starts(utt.text, spoken_text(utt), speech.words, engine_rate, lead, len(speech.samples))


def render(utt: Utt, engine: ESpeak, resampler: Resampler) -> Rendered:
    """The utterance's 16 kHz int16 waveform: speech resampled, with its edge silences, under white
    noise at utt.snr_db below the speech's RMS (drawn from a generator seeded by the plan key); and
    when its words start in it (timed_words)."""
    speech = speak(utt, engine)
    samples = with_edges_and_noise(resampler(speech.samples.astype(np.float32)), utt.lead, utt.tail, utt.snr_db,
                                   utt.key)
    return Rendered(samples, timed_words(utt, speech, engine.sample_rate))


def with_edges_and_noise(y: np.ndarray, lead: float, tail: float, snr_db: float, key: str) -> np.ndarray:
    """(T,) float32 speech at SAMPLE_RATE in int16 units -> int16: `lead` and `tail` seconds of
    silence around it, under white noise snr_db below the RMS of its nonzero samples, drawn from a
    generator seeded by the plan key (hex)."""
    before, after = (np.zeros(round(s * SAMPLE_RATE), np.float32) for s in (lead, tail))
    y = np.concatenate([before, y, after])
    voiced = y[np.abs(y) > 0]
    rms = float(np.sqrt(np.mean(np.square(voiced, dtype=np.float64)))) if voiced.size else 0.0
    noise = np.random.default_rng(int(key[:16], 16)).standard_normal(y.size)
    y = y + noise * (rms * 10.0 ** (-snr_db / 20.0))
    return np.clip(np.rint(y), -32768, 32767).astype(np.int16)


def word_starts(text: str, spoken: str, events: tuple[WordEvent, ...], rate: int, offset: float,
                num_samples: int) -> list[dict[str, Any]]:
    """The words of `text` (split at spaces) that an event of eSpeak speaking `spoken` (the same
    words in eSpeak's spelling) starts: [{"index", "word", "start": offset + sample / rate
    seconds}], in word order. An event counts for the word whose characters hold its position,
    or for the next word when it points between words (eSpeak points the first word of a second
    sentence in one call at the space before it); the first event of a word only. Events past the
    last word or the call's num_samples, or before the previous word's, are dropped."""
    words = text.split()
    ends = [m.end() for m in re.finditer(r"\S+", spoken)]  # 0-based, exclusive
    timed: list[dict[str, Any]] = []
    last_sample = -1
    for event in events:
        i = bisect_right(ends, event.text_position - 1)  # the word ending after the position
        if (i >= min(len(words), len(ends)) or (timed and i <= timed[-1]["index"])
                or not last_sample <= event.sample <= num_samples):
            continue
        timed.append({"index": i, "word": words[i], "start": round(offset + event.sample / rate, 4)})
        last_sample = event.sample
    return timed


def existing_frames(path: Path, key: str) -> int | None:
    """Frames of a finished FLAC made from the same plan (its comment holds the key), else None."""
    try:
        with sf.SoundFile(path) as f:
            ok = f.comment == key and f.samplerate == SAMPLE_RATE and f.channels == 1 and f.frames > 0
            return f.frames if ok else None
    except (sf.LibsndfileError, RuntimeError, OSError):
        return None


def write_flac(path: Path, samples: np.ndarray, key: str) -> None:
    """16-bit mono FLAC written under a temporary name, then renamed (never a partial file)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with sf.SoundFile(tmp, "w", SAMPLE_RATE, 1, "PCM_16", format="FLAC") as f:
            f.comment = key
            f.write(samples)
        os.replace(tmp, path)
    except (OSError, sf.LibsndfileError) as e:
        raise SynthError(f"{path}: cannot write: {e}") from None


# --- workers --------------------------------------------------------------------------------------------

_worker: tuple[ESpeak, Resampler] | None = None  # this process's engine


def _init_worker() -> None:
    global _worker
    engine = ESpeak()
    _worker = (engine, Resampler(engine.sample_rate, SAMPLE_RATE))


class Done(NamedTuple):
    """One utterance synthesized or kept: its frames, its word starts (timed_words) and whether
    its FLAC was kept, and then whether its word starts were re-spoken."""

    id: str
    frames: int
    words: list[dict[str, Any]]
    reused: bool
    respoken: bool


def _synthesize_one(task: tuple[Utt, str, list[dict[str, Any]] | None]) -> Done:
    """(utterance, output folder, its word starts from an earlier run or None) -> Done, in a worker."""
    utt, out_dir, earlier_words = task
    path = Path(out_dir) / utt.audio
    frames = existing_frames(path, utt.key)
    if frames is not None and earlier_words is not None:
        return Done(utt.id, frames, earlier_words, True, False)
    if _worker is None:
        _init_worker()
    engine, resampler = _worker
    try:
        if frames is not None:  # a kept FLAC without its word starts (made before they were written)
            return Done(utt.id, frames, timed_words(utt, speak(utt, engine), engine.sample_rate), True, True)
        samples, words = render(utt, engine, resampler)
    except SynthError as e:
        raise SynthError(f"{utt.id}: {e}") from None
    write_flac(path, samples, utt.key)
    return Done(utt.id, len(samples), words, False, False)


def run_plan(utts: list[Utt], out_dir: Path, jobs: int,
             earlier_words: dict[str, tuple[str, list[dict[str, Any]]]] | None = None) -> dict[str, Done]:
    """Synthesize (or reuse) every utterance: {id: Done}. earlier_words: {id: (plan key, word
    starts)} of an earlier run (read_words), used for the FLACs kept from it."""
    earlier_words = earlier_words or {}

    def earlier(u: Utt) -> list[dict[str, Any]] | None:
        key, words = earlier_words.get(u.id, ("", []))
        return words if key == u.key else None

    tasks = [(u, str(out_dir), earlier(u)) for u in utts]
    done, started = {}, time.time()
    if jobs <= 1:
        results = map(_synthesize_one, tasks)
        pool = None
    else:  # spawn: eSpeak is not fork-safe once initialized; each worker starts its own engine on
        # its first task (an engine that fails there is a task error, not a pool respawning forever)
        pool = multiprocessing.get_context("spawn").Pool(jobs)
        results = pool.imap_unordered(_synthesize_one, tasks, chunksize=16)
    try:
        for n, result in enumerate(results, 1):
            done[result.id] = result
            if n % 1000 == 0:
                print(f"  {n}/{len(tasks)} utterances, {time.time() - started:.0f} s", file=sys.stderr)
    finally:
        if pool is not None:
            pool.terminate()
    return done


# --- main ------------------------------------------------------------------------------------------------


def write_manifest(path: Path, utts: list[Utt], frames: dict[str, int]) -> None:
    """JSON Lines manifest sorted by id, written atomically (asr.fileio.atomic_open)."""
    with atomic_open(path) as f:
        for u in sorted(utts, key=lambda u: u.id):
            line = {"id": u.id, "audio": u.audio, "duration": frames[u.id] / SAMPLE_RATE,
                    "text": u.text, "speaker": u.voice}
            f.write(json.dumps(line, ensure_ascii=False) + "\n")


def words_path(out_dir: Path, split: str) -> Path:
    return out_dir / f"{split}_words.jsonl"


def write_words(path: Path, utts: list[Utt], done: dict[str, Done]) -> None:
    """The split's word starts (module docstring), sorted by id, written atomically."""
    with atomic_open(path) as f:
        for u in sorted(utts, key=lambda u: u.id):
            f.write(json.dumps({"id": u.id, "words": done[u.id].words, "key": u.key}, ensure_ascii=False) + "\n")


def read_words(path: Path) -> dict[str, tuple[str, list[dict[str, Any]]]]:
    """{id: (plan key, word starts)} of a words file an earlier run wrote; {} when there is none.
    A line that does not read is left out (its utterance's word starts are re-spoken)."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError):
        return {}
    earlier = {}
    for line in lines:
        try:
            entry = json.loads(line)
            earlier[entry["id"]] = (entry["key"], entry["words"])
        except (ValueError, KeyError, TypeError):
            continue
    return earlier


def check_voices(test_accents: tuple[str, ...], dev_accents: tuple[str, ...] = DEV_ACCENTS) -> None:
    """Refuse unknown or shared accents, or none left for training, and unknown variants, before
    starting (eSpeak silently ignores an unknown variant)."""
    for flag, chosen in (("--test-accents", test_accents), ("--dev-accents", dev_accents)):
        if not chosen or any(a not in ACCENTS for a in chosen):
            raise SynthError(f"{flag} {','.join(chosen)}: choose some of {', '.join(ACCENTS)}")
    if set(test_accents) & set(dev_accents) or len(set(test_accents) | set(dev_accents)) == len(ACCENTS):
        raise SynthError(f"--dev-accents {','.join(dev_accents)} and --test-accents {','.join(test_accents)} "
                         f"must be disjoint and leave some of {', '.join(ACCENTS)} for training")
    variant_dir = Path(_loader().get_data_path()) / "voices" / "!v"
    missing = [v for v in VARIANTS if v and not (variant_dir / v).is_file()]
    if missing:
        raise SynthError(f"{variant_dir}: no voice variants {', '.join(missing)}")


class CorpusPlan(NamedTuple):
    texts: dict[str, list[str]]  # split -> its sentences
    accents: dict[str, tuple[str, ...]]  # split -> the accents its voices speak
    utts: dict[str, list[Utt]]  # split -> its utterances (plan_split)


def plan_corpus(num: dict[str, int | None], *, seed: int = 0, text_file: Path | None = None,
                test_accents: tuple[str, ...] = TEST_ACCENTS, dev_accents: tuple[str, ...] = DEV_ACCENTS,
                spliced: float = SPLICED, random_words: float = RANDOM_WORDS) -> CorpusPlan:
    """Every split's sentences, accents and utterances (SPLITS and NEAR). num: utterances of
    "train", "dev" and "test", and of "dev_near" (absent or None: none; the command line's default
    is as many as dev): dev's first sentences again, in the training accents with NEAR_VARIANTS only
    (split_voices)."""
    check_voices(test_accents, dev_accents)
    near = num.get(NEAR) or 0
    if not 0 <= near <= num["dev"]:
        raise SynthError(f"--num-dev-near {near}: dev_near speaks dev's sentences, "
                         f"choose 0 to --num-dev = {num['dev']}")
    texts = file_texts(text_file, num, seed) if text_file else generated_texts(num, seed, spliced, random_words)
    texts[NEAR] = texts["dev"][:near]
    train_accents = tuple(a for a in ACCENTS if a not in test_accents + dev_accents)
    accents = {"train": train_accents, "dev": dev_accents, "test": test_accents, NEAR: train_accents}
    return CorpusPlan(texts, accents,
                      {s: plan_split(s, texts[s], split_voices(s, accents[s]), seed) for s in (*SPLITS, NEAR)})


def synthesize_corpus(out_dir: Path, num: dict[str, int | None], *, seed: int = 0, text_file: Path | None = None,
                      jobs: int = 1, test_accents: tuple[str, ...] = TEST_ACCENTS,
                      dev_accents: tuple[str, ...] = DEV_ACCENTS,
                      spliced: float = SPLICED, random_words: float = RANDOM_WORDS,
                      lm_count: int = LM_SENTENCES, lm_clause_count: int = LM_CLAUSES) -> dict[str, list[Utt]]:
    """Plan (plan_corpus), synthesize and write the corpus; returns the plan of each split. dev_near
    is written when num asks for it (else an earlier run's is removed). With the generator (no
    text_file), also writes lm_count sentences of the training templates (lm_sentences) and
    lm_clause_count of the clause grammar (lm_clauses) for the word LM to lm_text.txt."""
    texts, accents, plan = plan_corpus(num, seed=seed, text_file=text_file, test_accents=test_accents,
                                       dev_accents=dev_accents, spliced=spliced, random_words=random_words)
    out_dir.mkdir(parents=True, exist_ok=True)
    splits = SPLITS + ((NEAR,) if plan[NEAR] else ())
    if not plan[NEAR]:
        for stale in (out_dir / f"{NEAR}.jsonl", words_path(out_dir, NEAR)):
            stale.unlink(missing_ok=True)
    all_utts = [u for s in splits for u in plan[s]]
    earlier = {}
    for split in splits:
        earlier.update(read_words(words_path(out_dir, split)))
    started = time.time()
    done = run_plan(all_utts, out_dir, jobs, earlier)
    elapsed = time.time() - started
    frames = {uid: d.frames for uid, d in done.items()}
    for split in splits:
        write_words(words_path(out_dir, split), plan[split], done)
        write_manifest(out_dir / f"{split}.jsonl", plan[split], frames)
    with atomic_open(out_dir / "corpus.json") as f:
        card = corpus_card({s: texts[s] for s in splits}, seed, accents, text_file is None)
        f.write(json.dumps(card, indent=1) + "\n")
    lm_text = out_dir / "lm_text.txt"
    if text_file or not lm_count + lm_clause_count:
        lm_text.unlink(missing_ok=True)  # not one of an earlier run with the generator
    else:
        with atomic_open(lm_text) as f:  # written without looking at dev or test
            f.writelines(f"{line}\n" for line in lm_sentences(num, seed, lm_count))
            f.writelines(f"{line}\n" for line in lm_clauses(lm_clause_count, seed))
    reused = sum(d.reused for d in done.values())
    respoken = sum(d.respoken for d in done.values())
    made = len(all_utts) - reused
    seconds = sum(frames.values()) / SAMPLE_RATE
    print(f"synthesize: {len(all_utts)} utterances ({seconds / 3600:.2f} h) in {out_dir}: {made} made, "
          f"{reused} kept" + (f" ({respoken} re-spoken for their word starts)" if respoken else "")
          + f", {elapsed:.1f} s with {jobs} process(es)"
          + (f", {made / elapsed:.1f} utterances/s" if made and elapsed > 0 else ""), file=sys.stderr)
    return plan


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out-dir", type=Path, required=True, help="corpus folder (manifests and wav/)")
    parser.add_argument("--num-train", type=int, required=True)
    parser.add_argument("--num-dev", type=int, required=True)
    parser.add_argument("--num-test", type=int, required=True)
    parser.add_argument("--num-dev-near", type=int,
                        help="dev sentences (the first of them) also spoken in the training accents by the "
                             f"voice variants training never uses ({', '.join(NEAR_VARIANTS)}) into "
                             "dev_near.jsonl (default: all of dev's; 0: none)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--text", type=Path, help="sentences to speak instead of the generator's, one per line")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="worker processes")
    parser.add_argument("--dev-accents", default=",".join(DEV_ACCENTS),
                        help=f"held-out accents, spoken only in dev (of {', '.join(ACCENTS)})")
    parser.add_argument("--test-accents", default=",".join(TEST_ACCENTS),
                        help=f"held-out accents, spoken only in test (of {', '.join(ACCENTS)})")
    parser.add_argument("--spliced", type=float, default=SPLICED,
                        help="fraction of the generated training sentences spliced from runs of words of others")
    parser.add_argument("--random-words", type=float, default=RANDOM_WORDS,
                        help="fraction of the generated training sentences then made of random vocabulary words")
    parser.add_argument("--lm-sentences", type=int, default=LM_SENTENCES,
                        help="generated training-template sentences written to lm_text.txt for the word LM "
                             "(not with --text)")
    parser.add_argument("--lm-clauses", type=int, default=LM_CLAUSES,
                        help="sentences of the clause grammar then written to lm_text.txt (not with --text)")
    args = parser.parse_args(argv)
    num = {"train": args.num_train, "dev": args.num_dev, "test": args.num_test,
           "dev_near": args.num_dev if args.num_dev_near is None else args.num_dev_near}
    if min(num.values()) < 0 or min(args.lm_sentences, args.lm_clauses) < 0:
        parser.error("utterance and sentence counts must be >= 0")
    for name in ("spliced", "random_words"):
        if not 0.0 <= getattr(args, name) <= 1.0:
            parser.error(f"--{name.replace('_', '-')} must be within [0, 1]")
    try:
        synthesize_corpus(args.out_dir, num, seed=args.seed, text_file=args.text, jobs=args.jobs,
                          test_accents=tuple(filter(None, args.test_accents.split(","))),
                          dev_accents=tuple(filter(None, args.dev_accents.split(","))), spliced=args.spliced,
                          random_words=args.random_words, lm_count=args.lm_sentences,
                          lm_clause_count=args.lm_clauses)
    except (SynthError, OSError) as e:
        print(f"synthesize: error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
