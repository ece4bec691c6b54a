"""Training speech from a second synthesizer: a fraction of the corpus's training utterances spoken
again by CMU Flite (Debian's flite: kal16, a diphone voice, and awb, rms and slt, statistical
parametric voices), so that the model does not learn eSpeak's formant sound as speech itself.

    python local/flite.py train --data DATA --fraction F [--pitch LO HI] [--add] [--voices V...]
        [--flite-dir DIR] [--seed S] [--jobs J]
    python local/flite.py say "SOME TEXT" OUT.flac [--voice V] [--flite-dir DIR]

`train` reads DATA/train.jsonl (as synthesize.py wrote it), chooses round(F x N) of its utterances
with the seed (DATA/corpus.json's, else --seed), speaks each with a Flite voice dealt from shuffled
decks of them (of --voices' alone when given) and a speed (duration_stretch) drawn per utterance
(with --pitch, a mean F0 as well), with the training edges and noise floor (synthesize.TRIMMED_EDGE,
with_edges_and_noise), into DATA/wav/train_flite/<id>.flac, and rewrites those lines of
train.jsonl (audio, duration, speaker "flite+<voice>"); the text and id stay. It chooses among the
corpus's own lines: those another engine spoke (local/mbrola.py, pico.py and rhvoice.py run this
module's machinery) and recorded speech (local/human.py) stay as they are.
With --add, the eSpeak lines stay too and each chosen one is followed by its Flite line, id
"<id>-flite" (the corpus grows by F). Each is given the text eSpeak was given
(festival.festival_text). train_words.jsonl keeps eSpeak's word starts of wav/train: it is
not the truth of a Flite line. DATA/corpus.json records the fraction and the voices. A FLAC whose
stored plan key matches is kept on a re-run, and applying the same fraction again to a train.jsonl
it already rewrote changes nothing; a smaller fraction removes the FLACs no line names any more (with
--add), or is refused when lines it would not choose were rewritten (eSpeak's audio is then named no
more: make the corpus again). Festival's ked, the unseen synthesizer of dev_synth
(local/festival.py), is not one of these voices, nor is Festival (the program) run: Flite is a
separate engine; its kal16 is a diphone voice as ked is, of another speaker and database. Flite
comes from tools/flite.sh (downloaded and unpacked into --flite-dir, default $ASR_FLITE_DIR or
~/.cache/asr-flite, when missing); unlike the dev set, training speech that cannot be had fails the
run (exit 1) rather than change what the model trains on.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import subprocess
import sys
import tempfile
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np
import soundfile as sf
from festival import festival_text  # this script's folder
from synthesize import (
    EDGE_SILENCE,
    NOISE_SNR_DB,
    SAMPLE_RATE,
    TRIMMED_EDGE,
    at_corpus_rate,
    existing_frames,
    with_edges_and_noise,
    write_flac,
)

from asr.fileio import atomic_open

VOICES = ("kal16", "awb", "rms", "slt")
FOLDER = "train_flite"  # under DATA/wav
ADDED = "-flite"  # the id suffix of a line --add gives
FLITE_SH = Path(__file__).resolve().parents[3] / "tools" / "flite.sh"
# duration_stretch (larger is slower; 1 is the voice's own, ~160-180 words per minute), spanning
# about eSpeak's 130-200 (synthesize.RATE_WPM)
DURATION_STRETCH = (0.85, 1.25)
# each voice's own mean F0 (Hz, measured) for --pitch, which sets int_f0_target_mean to it times a
# drawn factor; rms keeps its own pitch (it ignores the setting)
VOICE_F0 = {"kal16": 95.0, "awb": 120.0, "slt": 165.0}


class FliteError(RuntimeError):
    """A one-line reason: what is missing, or which text Flite failed on."""


def default_dir() -> Path:
    return Path(os.environ.get("ASR_FLITE_DIR") or Path.home() / ".cache" / "asr-flite")


def fetch_by(script: Path, folder: Path) -> Path:
    """A folder that `script fetch` filled (tools/flite.sh, mbrola.sh, pico.sh, rhvoice.sh), or a FliteError
    saying why not."""
    try:
        done = subprocess.run(["bash", str(script), "fetch", str(folder)], capture_output=True, text=True,
                              timeout=600)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise FliteError(f"{script} fetch: {e}") from None
    if done.returncode:
        lines = done.stderr.strip().splitlines()
        raise FliteError(lines[-1] if lines else f"{script} fetch failed (exit {done.returncode})")
    return folder


def fetch(folder: Path) -> Path:
    """A folder whose flite has the voices (tools/flite.sh fetch), or a FliteError saying why not."""
    return fetch_by(FLITE_SH, folder)


def spoken_wav(command: Callable[[Path], list[str]], who: str, text: str) -> np.ndarray:
    """Run `command(wav)` (a synthesizer writing a WAV file there) and read what it wrote: (T,)
    float32 at SAMPLE_RATE in int16 units, or a FliteError naming `who` and the text."""
    with tempfile.TemporaryDirectory(prefix="asr-synth-") as tmp:
        wav = Path(tmp) / "out.wav"
        try:
            done = subprocess.run(command(wav), capture_output=True, text=True, timeout=120)
        except (OSError, subprocess.TimeoutExpired) as e:
            raise FliteError(f"{who}: {e}") from None
        if done.returncode or not wav.is_file() or wav.stat().st_size <= 44:  # 44: a WAV header alone
            tail = (done.stderr.strip().splitlines() or [f"exit {done.returncode}"])[-1]
            raise FliteError(f"{who} wrote nothing for {text!r}: {tail}")
        samples, rate = sf.read(str(wav), dtype="int16")
    return at_corpus_rate(samples, rate)


def speak(text: str, voice: str, stretch: float, folder: Path, f0: float = 0.0) -> np.ndarray:
    """`text` (a manifest text) spoken by `voice` (at mean F0 `f0` Hz, 0: the voice's own): (T,)
    float32 at SAMPLE_RATE in int16 units."""
    pitch = ["--setf", f"int_f0_target_mean={f0:g}"] if f0 else []
    return spoken_wav(lambda wav: ["bash", str(FLITE_SH), "run", str(folder), "-voice", voice,
                                   "--setf", f"duration_stretch={stretch}", *pitch, "-t", festival_text(text),
                                   "-o", str(wav)], f"flite ({voice})", text)


@dataclass(frozen=True)
class Engine:
    """A synthesizer that speaks training lines again: Flite here, MBROLA, Pico and RHVoice in
    local/mbrola.py, pico.py and rhvoice.py."""

    name: str  # in the plan's seed, the FLAC keys, corpus.json and the speakers ("<name>+<voice>")
    label: str  # the synthesizer's name in messages
    voices: tuple[str, ...]
    folder: str  # under DATA/wav
    suffix: str  # the id suffix of a line --add gives
    fetch: Callable[[Path], Path]  # (folder) -> folder, or an error naming what is missing
    speak: Callable[..., np.ndarray]  # (text, voice, stretch, folder, f0) -> (T,) float32 at SAMPLE_RATE
    pitch: Callable[[str, float], float]  # (voice, drawn factor) -> Utt.f0 (0: the voice's own)
    variant: str = ""  # another way of speaking under the same name (in the FLAC keys and corpus.json)


FLITE = Engine("flite", "Flite", VOICES, FOLDER, ADDED, fetch, speak,
               lambda voice, factor: round(VOICE_F0[voice] * factor) if voice in VOICE_F0 else 0.0)


ENGINES = ("flite", "mbrola", "pico", "rhvoice")  # every engine's name; "-<name>" is its --add suffix


RECORDED = ("asterisk",)  # sources of recorded speech (local/human.py): no engine speaks it again


def _source(line: dict) -> str:
    """The <name> of a train.jsonl line's speaker "<name>+<voice>", else ""."""
    name, plus, _ = str(line.get("speaker", "")).partition("+")
    return name if plus else ""


def spoken_by(line: dict) -> str:
    """The engine that spoke this train.jsonl line (its speaker "<name>+<voice>"), else ""."""
    return name if (name := _source(line)) in ENGINES else ""


def other_engine(line: dict, engine: Engine) -> bool:
    """Did another engine than `engine` speak this train.jsonl line, or is it a recording?"""
    return spoken_by(line) not in ("", engine.name) or _source(line) in RECORDED


def added_by(line: dict) -> str:
    """The engine whose --add made this line (its speaker and its id "<id>-<name>" say so), else ""."""
    name = spoken_by(line)
    return name if name and line["id"].endswith(f"-{name}") else ""


def in_engine_order(rows: list[dict]) -> list[dict]:
    """Manifest lines with each line's added copies right after it in ENGINES' order, whichever
    engine ran last (the manifest is the same after any order of re-runs)."""
    def base_and_rank(row: dict) -> tuple[str, int]:
        name = added_by(row)
        return (row["id"].removesuffix(f"-{name}"), ENGINES.index(name) + 1) if name else (row["id"], 0)
    first: dict[str, int] = {}
    for row in rows:
        first.setdefault(base_and_rank(row)[0], len(first))
    return sorted(rows, key=lambda row: (first[base_and_rank(row)[0]], base_and_rank(row)[1]))


@dataclass(frozen=True)
class Utt:
    """One training utterance spoken again: its id and text (train.jsonl's) and how it is spoken."""

    id: str
    text: str
    voice: str
    stretch: float
    lead: float  # seconds of silence before the speech
    tail: float  # and after
    snr_db: float  # noise floor, as synthesize.Utt's
    # the engine's pitch (--pitch): Flite's F0 (Hz), eSpeak's 0-100 (MBROLA; Hz with Flite's prosody),
    # Pico's %; 0: own
    f0: float = 0.0
    engine: Engine = FLITE

    @property
    def audio(self) -> str:
        return f"wav/{self.engine.folder}/{self.id}.flac"

    @property
    def key(self) -> str:
        """Digest of everything that shapes the audio, stored in the FLAC."""
        # without --pitch, the keys of before
        shape = {k: v for k, v in asdict(self).items() if (k != "f0" or v) and k != "engine"}
        variant = {"variant": self.engine.variant} if self.engine.variant else {}
        return hashlib.sha1(json.dumps({**shape, "engine": self.engine.name, **variant},
                                       sort_keys=True).encode()).hexdigest()


def plan(train: list[dict], fraction: float, seed: int, pitch: tuple[float, float] | None = None,
         suffix: str = "", engine: Engine = FLITE) -> list[Utt]:
    """round(fraction x len(train)) of the training utterances (a seeded choice, in id order), each
    with its voice (shuffled decks of the engine's voices), speed, edges and noise drawn from the
    seed; with `pitch` (lo, hi), each voice speaks at its own pitch times a factor drawn in it (from
    a stream of its own: the other draws are those made without it; engine.pitch turns it into the
    engine's setting); `suffix` is added to each id (--add's lines)."""
    rng = random.Random(f"synth-{engine.name}:{seed}")
    pitch_rng = random.Random(f"synth-{engine.name}-pitch:{seed}")
    ordered = sorted(train, key=lambda u: u["id"])
    chosen = sorted(rng.sample(range(len(ordered)), round(fraction * len(ordered))))

    def edge() -> float:
        return 0.0 if rng.random() < TRIMMED_EDGE else round(rng.uniform(*EDGE_SILENCE), 3)

    deck: list[str] = []
    utts = []
    for i in chosen:
        if not deck:
            deck = rng.sample(engine.voices, len(engine.voices))
        u = Utt(id=ordered[i]["id"] + suffix, text=ordered[i]["text"], voice=deck.pop(),
                stretch=round(rng.uniform(*DURATION_STRETCH), 3), lead=edge(), tail=edge(),
                snr_db=round(rng.uniform(*NOISE_SNR_DB), 1), engine=engine)
        if pitch:
            u = replace(u, f0=engine.pitch(u.voice, pitch_rng.uniform(*pitch)))
        utts.append(u)
    return utts


def _render(data: Path, folder: Path, u: Utt) -> int:
    """Speak one utterance into its FLAC (kept when its key matches); its frames."""
    frames = existing_frames(data / u.audio, u.key)
    if frames is None:
        try:
            y = u.engine.speak(u.text, u.voice, u.stretch, folder, u.f0)
        except FliteError as e:
            raise FliteError(f"{u.id}: {e}") from None
        samples = with_edges_and_noise(y, u.lead, u.tail, u.snr_db, u.key)
        write_flac(data / u.audio, samples, u.key)
        frames = len(samples)
    return frames


def manifest_lines(manifest: Path) -> list[dict]:
    """The JSON lines of a manifest (blank lines skipped), or a FliteError naming the bad line."""
    lines = []
    for n, line in enumerate(manifest.read_text(encoding="utf-8").splitlines(), 1):
        if line.strip():
            try:
                lines.append(json.loads(line))
            except ValueError as e:
                raise FliteError(f"{manifest}:{n}: not a JSON line ({e})") from None
    return lines


def mix_into_train(data: Path, fraction: float, folder: Path, seed: int | None = None, jobs: int = 1,
                   pitch: tuple[float, float] | None = None, add: bool = False, engine: Engine = FLITE) -> list[Utt]:
    """Speak the plan's utterances and rewrite their lines of DATA/train.jsonl, or with `add`
    follow each with the engine's line (module docstring). The plan chooses among the corpus's own
    lines: another engine's lines and recorded speech (local/human.py) stay as they are, and this
    engine's earlier added ones are made again from the plan."""
    manifest = data / "train.jsonl"
    # an earlier --add's lines are made again from the plan
    lines = [x for x in manifest_lines(manifest) if added_by(x) != engine.name]
    card_path = data / "corpus.json"
    card = json.loads(card_path.read_text(encoding="utf-8")) if card_path.is_file() else {}
    if seed is None:
        seed = card.get("seed", 0)
    own = [x for x in lines if not other_engine(x, engine)]
    utts = plan(own, fraction, seed, pitch, engine.suffix if add else "", engine)
    # lines an earlier run without --add rewrote: their eSpeak audio is no longer in the manifest
    kept = {x["id"] for x in own if spoken_by(x) == engine.name} - {u.id.removesuffix(engine.suffix) for u in utts}
    if kept:
        raise FliteError(f"{manifest}: {len(kept)} lines (e.g. {min(kept)}) were spoken by {engine.label} in place of "
                         f"eSpeak's by an earlier run that this plan (--fraction {fraction:g}) would not choose; "
                         "make the corpus again (synthesize.py) to speak fewer")
    todo = [u for u in utts if existing_frames(data / u.audio, u.key) is None]
    if todo:
        engine.fetch(folder)
    # Flite, MBROLA: a process per call (Pico, RHVoice: one call at a time)
    with ThreadPoolExecutor(max(1, jobs)) as pool:
        frames = dict(zip((u.id for u in utts), pool.map(lambda u: _render(data, folder, u), utts)))
    by_id = {u.id.removesuffix(engine.suffix) if add else u.id: u for u in utts}
    rows = []
    for line in lines:
        u = by_id.get(line["id"])
        if u is not None:
            spoken = {**line, "id": u.id, "audio": u.audio, "duration": frames[u.id] / SAMPLE_RATE,
                      "speaker": f"{engine.name}+{u.voice}"}
            rows += [line, spoken] if add else [spoken]
        else:
            rows.append(line)
    with atomic_open(manifest) as f:
        f.writelines(json.dumps(x, ensure_ascii=False) + "\n" for x in in_engine_order(rows))
    planned = {Path(u.audio).name for u in utts}
    for flac in (data / "wav" / engine.folder).glob("*.flac"):  # an earlier, larger plan's
        if flac.name not in planned:
            flac.unlink()
    if card:
        card[engine.name] = {"fraction": fraction, "voices": list(engine.voices), "utterances": len(utts),
                             **({"pitch": list(pitch)} if pitch else {}), **({"added": True} if add else {}),
                             **({"variant": engine.variant} if engine.variant else {})}
        with atomic_open(card_path) as f:
            f.write(json.dumps(card, indent=1) + "\n")
    print(f"{engine.name}: {len(utts)} of {len(own)} training utterances spoken by {engine.label} "
          f"({', '.join(engine.voices)}"
          f"{'; added beside them' if add else ''}) in "
          f"{data}: {len(todo)} made, {len(utts) - len(todo)} kept", file=sys.stderr)
    return utts


def main(argv: list[str] | None = None, engine: Engine = FLITE, doc: str = __doc__,
         folder: tuple[str, Path, str] = ("--flite-dir", default_dir(), "tools/flite.sh unpacks Flite"),
         variants: tuple[str, dict[str, Engine], str] | None = None) -> int:
    """The command line of an engine's script: `doc` its docstring, `folder` (option, default, what
    the folder holds), `variants` (option, {choice: engine}, help) ways of speaking to choose among
    (the first the default, `engine` ignored then)."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("train", help=f"a fraction of DATA/train.jsonl spoken again by {engine.label}")
    p.add_argument("--data", type=Path, required=True, help="the corpus folder (train.jsonl)")
    p.add_argument("--fraction", type=float, required=True, help="of the training utterances, in [0, 1]")
    p.add_argument("--seed", type=int, help="default: DATA/corpus.json's, else 0")
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="synthesizer processes at a time")
    p.add_argument("--pitch", type=float, nargs=2, metavar=("LO", "HI"),
                   help="each voice's pitch: its own times a factor drawn per line in [LO, HI]")
    p.add_argument("--add", action="store_true",
                   help=f"keep the eSpeak lines and add the {engine.label} ones beside them (ids <id>{engine.suffix})")
    p.add_argument("--voices", nargs="+", choices=engine.voices, metavar="VOICE",
                   help=f"the voices that speak, in turn (default all: {' '.join(engine.voices)})")
    q = sub.add_parser("say", help="speak one text into a 16 kHz FLAC")
    q.add_argument("text")
    q.add_argument("out", type=Path)
    q.add_argument("--voice", choices=engine.voices, default=engine.voices[0])
    option, default, holds = folder
    for x in (p, q):
        x.add_argument(option, dest="folder", type=Path, default=default, help=f"where {holds} (default {default})")
        if variants:
            x.add_argument(variants[0], dest="variant", choices=list(variants[1]), default=next(iter(variants[1])),
                           help=variants[2])
    args = parser.parse_args(argv)
    if variants:
        engine = variants[1][args.variant]
    try:
        if args.command == "say":
            y = engine.speak(args.text, args.voice, 1.0, engine.fetch(args.folder), 0.0)
            samples = np.clip(np.rint(y), -32768, 32767).astype(np.int16)
            write_flac(args.out, samples,
                       key=f"{engine.name}:{args.voice}:{hashlib.sha1(args.text.encode()).hexdigest()}")
            print(f"{args.out}: {len(samples) / SAMPLE_RATE:.2f} s at {SAMPLE_RATE} Hz ({args.voice})")
            return 0
        if not 0.0 <= args.fraction <= 1.0:
            parser.error("--fraction must be within [0, 1]")
        if args.pitch and not 0 < args.pitch[0] <= args.pitch[1]:
            parser.error("--pitch LO HI: 0 < LO <= HI")
        pitch = tuple(args.pitch) if args.pitch else None
        if args.voices:
            engine = replace(engine, voices=tuple(dict.fromkeys(args.voices)))
        mix_into_train(args.data, args.fraction, args.folder, args.seed, args.jobs, pitch, args.add, engine)
    except (FliteError, OSError, ValueError, KeyError) as e:
        print(f"{engine.name}: error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
