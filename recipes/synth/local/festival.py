"""A synthesizer the model never heard: dev's sentences spoken by Festival's `ked_diphone` voice
(Debian's festvox-kdlpc16k: a male American English diphone voice, residual-excited LPC at 16 kHz),
the third of the synth recipe's dev sets (beside dev, the unseen accents, and dev_near, the
training accents in voice variants never trained; synthesize.py).

    python local/festival.py dev-set --data DATA [--num N] [--festival-dir DIR] [--seed S] [--require]
    python local/festival.py say "SOME TEXT" OUT.flac [--festival-dir DIR]

`dev-set` reads DATA/dev.jsonl and speaks its first --num sentences (sorted by id; default all)
into DATA/wav/dev_synth/dev_synth-<n>.flac and DATA/dev_synth.jsonl (speaker "festival+ked_diphone"),
each given exactly the text eSpeak was given (synthesize.engine_text: the normalized transcript in
lower case, numbers already in words; Festival would otherwise expand digits and symbols its own
way), with a speed (Duration_Stretch) and a mean pitch drawn per utterance, and eSpeak's edge
silences and noise floor (synthesize.with_edges_and_noise), so that the synthesizer is what differs.
The seed is DATA/corpus.json's (else --seed). Festival comes from tools/festival.sh (downloaded and
unpacked into --festival-dir, default $ASR_FESTIVAL_DIR or ~/.cache/asr-festival, when missing).
When it cannot be had (no apt-get, no network), the dev set is skipped, not the run: the reason
goes to stderr and to DATA/dev_synth.skipped, any dev_synth.jsonl is removed, and the exit status
is 0 (1 with --require). A FLAC whose stored plan key matches is kept on a re-run, as synthesize.py
keeps its own. `say` speaks one text into a 16 kHz FLAC (no noise, no edges).
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
import unicodedata
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import soundfile as sf
from synthesize import (  # this script's folder
    EDGE_SILENCE,
    NOISE_SNR_DB,
    SAMPLE_RATE,
    at_corpus_rate,
    engine_text,
    existing_frames,
    with_edges_and_noise,
    write_flac,
)

from asr.fileio import atomic_open

VOICE = "ked_diphone"  # Festival's name (the voice_ked_diphone function selects it)
SPEAKER = f"festival+{VOICE}"
SPLIT = "dev_synth"
FESTIVAL_SH = Path(__file__).resolve().parents[3] / "tools" / "festival.sh"
# Festival's Duration_Stretch (ked's own: 1.1; larger is slower): ked at 1.1 speaks ~150 words per
# minute, so 0.85-1.2 spans about eSpeak's 130-200 (synthesize.RATE_WPM)
DURATION_STRETCH = (0.85, 1.2)
# the mean F0 in Hz that ked's intonation model aims at (its own: 105, a male voice)
F0_MEAN = (90, 125)


class FestivalError(RuntimeError):
    """A one-line reason: what is missing, or which text Festival failed on."""


def default_dir() -> Path:
    return Path(os.environ.get("ASR_FESTIVAL_DIR") or Path.home() / ".cache" / "asr-festival")


def fetch(folder: Path) -> Path:
    """A folder whose festival speaks with ked (tools/festival.sh fetch: unpacked there when missing,
    or the system's), or a FestivalError saying why not."""
    try:
        done = subprocess.run(["bash", str(FESTIVAL_SH), "fetch", str(folder)], capture_output=True, text=True,
                              timeout=600)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise FestivalError(f"{FESTIVAL_SH} fetch: {e}") from None
    if done.returncode:
        lines = done.stderr.strip().splitlines()
        raise FestivalError(lines[-1] if lines else f"{FESTIVAL_SH} fetch failed (exit {done.returncode})")
    return folder


def festival_text(text: str) -> str:
    """A manifest text as Festival is given it: eSpeak's (engine_text), in ASCII (Festival reads
    bytes: accents are dropped from letters) and safe inside a Scheme string."""
    ascii_text = unicodedata.normalize("NFKD", engine_text(text)).encode("ascii", "ignore").decode()
    return ascii_text.replace("\\", "").replace('"', "")


@dataclass(frozen=True)
class Line:
    """One utterance for Festival: what to say and how."""

    text: str  # the manifest text (normalized)
    stretch: float = 1.1  # Duration_Stretch
    f0_mean: int = 105  # Hz


def speak(lines: list[Line], folder: Path) -> list[np.ndarray]:
    """Each line spoken by ked, as (T,) float32 at SAMPLE_RATE in int16 units (resampled when the
    voice's rate differs), in one festival process."""
    if not lines:
        return []
    with tempfile.TemporaryDirectory(prefix="asr-festival-") as tmp:
        wavs = [Path(tmp) / f"{i}.wav" for i in range(len(lines))]
        script = [f"(voice_{VOICE})"]
        for line, wav in zip(lines, wavs):
            script += [f"(Parameter.set 'Duration_Stretch {line.stretch})",
                       f"(set! int_lr_params '((target_f0_mean {line.f0_mean}) (target_f0_std 15) "
                       "(model_f0_mean 170) (model_f0_std 34)))",  # ked's own but the mean
                       f"(utt.save.wave (SynthText \"{festival_text(line.text)}\") \"{wav}\" 'riff)"]
        (Path(tmp) / "speak.scm").write_text("\n".join(script) + "\n", encoding="ascii")
        try:
            done = subprocess.run(["bash", str(FESTIVAL_SH), "run", str(folder), "-b", str(Path(tmp) / "speak.scm")],
                                  capture_output=True, text=True, timeout=120 + 2 * len(lines))
        except (OSError, subprocess.TimeoutExpired) as e:
            raise FestivalError(f"festival: {e}") from None
        out = []
        for line, wav in zip(lines, wavs):
            if not wav.is_file():
                tail = (done.stderr.strip().splitlines() or [f"exit {done.returncode}"])[-1]
                raise FestivalError(f"festival wrote nothing for {line.text!r}: {tail}")
            samples, rate = sf.read(str(wav), dtype="int16")
            out.append(at_corpus_rate(samples, rate))
        return out


def say(text: str, out: Path, folder: Path) -> int:
    """Speak `text` with ked into a 16 kHz mono 16-bit FLAC at `out`; returns its frames."""
    (y,) = speak([Line(text)], folder)
    samples = np.clip(np.rint(y), -32768, 32767).astype(np.int16)
    write_flac(out, samples, key=f"{VOICE}:{hashlib.sha1(text.encode()).hexdigest()}")
    return len(samples)


# --- the dev set -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Utt:
    """One dev_synth utterance: its text, the source line of dev, and how it is spoken."""

    id: str
    text: str
    source: str  # the dev utterance of the same text
    stretch: float
    f0_mean: int
    lead: float  # seconds of silence before the speech
    tail: float  # and after
    snr_db: float  # noise floor, as synthesize.Utt's

    @property
    def audio(self) -> str:
        return f"wav/{SPLIT}/{self.id}.flac"

    @property
    def key(self) -> str:
        """Digest of everything that shapes the audio (and the voice), stored in the FLAC."""
        return hashlib.sha1(json.dumps({**asdict(self), "voice": VOICE}, sort_keys=True).encode()).hexdigest()


def plan(dev: list[dict], num: int | None, seed: int) -> list[Utt]:
    """The first `num` (None: all) utterances of dev (sorted by id), each a dev_synth utterance of
    the same text with its prosody, edges and noise drawn from the seed."""
    rng = random.Random(f"synth-voices:{SPLIT}:{seed}")
    chosen = sorted(dev, key=lambda u: u["id"])[:num]
    return [Utt(id=f"{SPLIT}-{i:06d}", text=u["text"], source=u["id"],
                stretch=round(rng.uniform(*DURATION_STRETCH), 3), f0_mean=rng.randint(*F0_MEAN),
                lead=round(rng.uniform(*EDGE_SILENCE), 3), tail=round(rng.uniform(*EDGE_SILENCE), 3),
                snr_db=round(rng.uniform(*NOISE_SNR_DB), 1))
            for i, u in enumerate(chosen)]


def make_dev_set(data: Path, folder: Path, num: int | None = None, seed: int | None = None) -> list[Utt]:
    """Write DATA/wav/dev_synth/*.flac and DATA/dev_synth.jsonl (module docstring); a FestivalError
    when Festival cannot be had or fails."""
    dev = [json.loads(line) for line in (data / "dev.jsonl").read_text(encoding="utf-8").splitlines() if line.strip()]
    if seed is None:
        card = data / "corpus.json"
        seed = json.loads(card.read_text(encoding="utf-8"))["seed"] if card.is_file() else 0
    utts = plan(dev, num, seed)
    frames = {u.id: existing_frames(data / u.audio, u.key) for u in utts}
    todo = [u for u in utts if frames[u.id] is None]
    if todo:
        fetch(folder)
        spoken = speak([Line(u.text, u.stretch, u.f0_mean) for u in todo], folder)
        for u, y in zip(todo, spoken):
            samples = with_edges_and_noise(y, u.lead, u.tail, u.snr_db, u.key)
            write_flac(data / u.audio, samples, u.key)
            frames[u.id] = len(samples)
    with atomic_open(data / f"{SPLIT}.jsonl") as f:
        for u in utts:  # ids in order: sorted
            f.write(json.dumps({"id": u.id, "audio": u.audio, "duration": frames[u.id] / SAMPLE_RATE,
                                "text": u.text, "speaker": SPEAKER}, ensure_ascii=False) + "\n")
    print(f"festival: {len(utts)} {SPLIT} utterances ({VOICE}) in {data}: {len(todo)} made, "
          f"{len(utts) - len(todo)} kept", file=sys.stderr)
    return utts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("dev-set", help="dev's sentences spoken by ked into DATA/dev_synth.jsonl")
    p.add_argument("--data", type=Path, required=True, help="the corpus folder (dev.jsonl)")
    p.add_argument("--num", type=int, help="the first N of dev's utterances (default: all)")
    p.add_argument("--seed", type=int, help="default: DATA/corpus.json's, else 0")
    p.add_argument("--require", action="store_true", help="fail (exit 1) when Festival cannot be had")
    q = sub.add_parser("say", help="speak one text into a 16 kHz FLAC")
    q.add_argument("text")
    q.add_argument("out", type=Path)
    for x in (p, q):
        x.add_argument("--festival-dir", type=Path, default=default_dir(),
                       help="where tools/festival.sh unpacks Festival (default $ASR_FESTIVAL_DIR or "
                            "~/.cache/asr-festival)")
    args = parser.parse_args(argv)
    if args.command == "say":
        try:
            fetch(args.festival_dir)
            frames = say(args.text, args.out, args.festival_dir)
        except (FestivalError, OSError) as e:
            print(f"festival: error: {e}", file=sys.stderr)
            return 1
        print(f"{args.out}: {frames / SAMPLE_RATE:.2f} s at {SAMPLE_RATE} Hz ({VOICE})")
        return 0
    if args.num is not None and args.num < 0:
        parser.error("--num must be >= 0")
    skipped = args.data / f"{SPLIT}.skipped"
    try:
        make_dev_set(args.data, args.festival_dir, args.num, args.seed)
    except (ValueError, KeyError) as e:  # dev.jsonl or corpus.json malformed: not Festival's absence
        print(f"festival: error: {args.data}: {e!r}", file=sys.stderr)
        return 1
    except (FestivalError, OSError) as e:
        (args.data / f"{SPLIT}.jsonl").unlink(missing_ok=True)
        if args.require:
            print(f"festival: error: {e}", file=sys.stderr)
            return 1
        skipped.write_text(f"{e}\n", encoding="utf-8")
        print(f"festival: the unseen-synthesizer dev set ({SPLIT}) is skipped: {e}", file=sys.stderr)
        return 0
    skipped.unlink(missing_ok=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
