"""Room impulse responses to train and test with, and reverberant copies of a dev set.

    python tools/simulate_rirs.py bank --out exp/rirs/pra_train --count 400 --seed 1
    python tools/simulate_rirs.py bank --out exp/rirs/exp_dev --count 200 --seed 2 --simulator exponential
    python tools/simulate_rirs.py reverberate --manifest data/dev_near.jsonl --rirs exp/rirs/exp_dev \\
        --out data/dev_near_rev_exp.jsonl --seed 3

bank: COUNT impulse responses as 16 kHz float WAV files in OUT (room_00000.wav, ...; any tree of
audio files is what `data.augment.reverb.folder` reads) and OUT/rooms.jsonl, one line per room: what
was drawn, and for pyroomacoustics the RT60 measured on the response. Room i is a function of
(seed, i) alone, so a bank is made again identically, in any number of processes.
- pyroomacoustics (`pip install -e '.[rir]'`; the default): a shoebox room by the image-source
  method, its walls' absorption set by Sabine's formula for an RT60 drawn in --rt60; length and
  width drawn in 3-10 m, height in 2.5-4 m, source and microphone anywhere 0.5 m from the walls, at
  least 0.5 m apart (so the direct-to-reverberant ratio varies with their distance);
- exponential: asr.augment.simulated_rir, what training simulates on the fly when
  `data.augment.reverb.folder` is empty (a direct path, then decaying noise).
Each response is cut 1 s after its direct path, as the simulated ones are.

reverberate: each utterance of MANIFEST convolved with a response of RIRS drawn by (seed, its index),
as training does it (asr.augment.reverberate: aligned at the direct path, at the dry signal's
power; scaled down where it would clip), written as FLAC beside OUT (OUT's name without .jsonl, a
folder) and listed in OUT; the response used is named in each line's "rir" field; an utterance
whose audio or response cannot be read is left out, in one line on stderr naming it. A dev set that
separates the room from the voice.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np
import soundfile as sf
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from asr.audio import SAMPLE_RATE, AudioError, load_audio  # noqa: E402
from asr.augment import ReverbConfig, audio_files, derive_seed, reverberate, simulated_rir  # noqa: E402
from asr.fileio import atomic_open  # noqa: E402
from asr.manifest import ManifestError, Utterance, read_manifest  # noqa: E402

SIMULATORS = ("pyroomacoustics", "exponential")
_ROOM = ((3.0, 10.0), (3.0, 10.0), (2.5, 4.0))  # metres: length, width, height
_MARGIN, _MIN_DISTANCE = 0.5, 0.5  # metres from the walls; between source and microphone
_ATTEMPTS = 100  # rooms drawn for one response before its RT60 is called impossible


def shoebox_rir(rt60: float, rng: np.random.Generator) -> tuple[np.ndarray, dict]:
    """A pyroomacoustics shoebox room's response (float32, 16 kHz) and what was drawn for it; rooms
    whose walls cannot give `rt60` (Sabine's formula out of range) are drawn again."""
    import pyroomacoustics as pra

    for _ in range(_ATTEMPTS):
        dims = np.array([rng.uniform(lo, hi) for lo, hi in _ROOM])
        try:
            absorption, max_order = pra.inverse_sabine(rt60, dims)
        except ValueError:
            continue
        source, mic = (rng.uniform(_MARGIN, dims - _MARGIN) for _ in range(2))
        if np.linalg.norm(source - mic) < _MIN_DISTANCE:
            continue
        room = pra.ShoeBox(dims, fs=SAMPLE_RATE, materials=pra.Material(absorption), max_order=max_order)
        room.add_source(source)
        room.add_microphone(mic)
        room.compute_rir()
        rir = np.asarray(room.rir[0][0], dtype=np.float64)
        drawn = {"dims": dims, "source": source, "mic": mic, "distance": np.linalg.norm(source - mic),
                 "rt60_measured": pra.experimental.measure_rt60(rir, fs=SAMPLE_RATE)}
        return rir.astype(np.float32), {k: np.round(v, 3).tolist() for k, v in drawn.items()}
    raise ValueError(f"no room of {_ROOM} m gives an RT60 of {rt60:g} s by Sabine's formula in {_ATTEMPTS} draws")


def one_room(simulator: str, seed: int, index: int, rt60_range: tuple[float, float]) -> tuple[np.ndarray, dict]:
    """Room `index` of a bank: (its response cut 1 s after the direct path, what was drawn)."""
    key = derive_seed(seed, index)
    rng = np.random.default_rng(key)
    rt60 = float(rng.uniform(*rt60_range))
    if simulator == "exponential":
        rir, drawn = simulated_rir(rt60, torch.Generator().manual_seed(key)).numpy(), {}
    else:
        rir, drawn = shoebox_rir(rt60, rng)
    direct = int(np.abs(rir).argmax())
    return rir[: direct + SAMPLE_RATE], {"rt60": round(rt60, 3), **drawn}


def _write_room(args: tuple[str, int, int, tuple[float, float], str]) -> dict:
    simulator, seed, index, rt60_range, out = args
    rir, drawn = one_room(simulator, seed, index, rt60_range)
    name = f"room_{index:05d}.wav"
    with atomic_open(Path(out) / name, "wb") as f:
        sf.write(f, rir, SAMPLE_RATE, subtype="FLOAT", format="WAV")
    return {"file": name, "simulator": simulator, **drawn}


def bank(args: argparse.Namespace) -> None:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    jobs = [(args.simulator, args.seed, i, tuple(args.rt60), str(out)) for i in range(args.count)]
    if args.jobs > 1:  # spawned: a forked child can hang on locks its parent's threads held
        with ProcessPoolExecutor(args.jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
            rooms = list(pool.map(_write_room, jobs, chunksize=8))
    else:
        rooms = [_write_room(job) for job in jobs]
    with atomic_open(out / "rooms.jsonl") as f:
        f.writelines(json.dumps(r) + "\n" for r in rooms)
    rt60 = [r.get("rt60_measured", r["rt60"]) for r in rooms]
    print(f"simulate_rirs: {len(rooms)} {args.simulator} rooms in {out}, RT60 "
          f"{min(rt60):.2f}-{max(rt60):.2f} s (mean {sum(rt60) / len(rt60):.2f})")


def reverberate_manifest(args: argparse.Namespace) -> None:
    try:
        rirs = audio_files(args.rirs)  # the files training would draw from
    except ValueError as e:
        sys.exit(f"simulate_rirs: {e}")
    out = Path(args.out)
    if out.suffix != ".jsonl":
        sys.exit(f"simulate_rirs: --out {out}: give a .jsonl manifest path")
    audio_dir = out.with_suffix("")
    audio_dir.mkdir(parents=True, exist_ok=True)
    try:
        utts = read_manifest(args.manifest)
    except ManifestError as e:
        sys.exit(f"simulate_rirs: {e}")
    lines, used, loaded = [], set(), {}
    for index, utt in enumerate(utts):
        rir_path = rirs[derive_seed(args.seed, index) % len(rirs)]
        try:  # read as training reads them (asr.augment): mono, 16 kHz; each response once
            if rir_path not in loaded:
                loaded[rir_path] = load_audio(rir_path)
            rir = loaded[rir_path]
            wave = load_audio(utt.audio, start=utt.start or 0.0, end=utt.end, speed=utt.speed)
        except AudioError as e:
            print(f"simulate_rirs: {utt.id} skipped: {e}", file=sys.stderr)
            continue
        wet = reverberate(wave, rir, keep_power=True)
        peak = float(wet.abs().max()) if wet.numel() else 0.0
        if peak > 1.0:  # FLAC holds [-1, 1]
            wet = wet / peak
        path = audio_dir / f"{utt.id}.flac"
        with atomic_open(path, "wb") as f:
            sf.write(f, wet.numpy(), SAMPLE_RATE, format="FLAC")
        copy = Utterance(utt.id, str(path.resolve()), wet.numel() / SAMPLE_RATE, utt.text, speaker=utt.speaker)
        lines.append(json.dumps({**copy.to_json(), "rir": str(rir_path)}, ensure_ascii=False) + "\n")
        used.add(rir_path)
    with atomic_open(out) as f:
        f.writelines(lines)
    print(f"simulate_rirs: {len(lines)} utterances of {args.manifest} reverberated by {len(used)} of "
          f"{len(rirs)} responses in {args.rirs}: {out}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    b = sub.add_parser("bank", help="simulate impulse responses into a folder")
    b.add_argument("--out", required=True)
    b.add_argument("--count", type=int, default=400)
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--simulator", choices=SIMULATORS, default="pyroomacoustics")
    b.add_argument("--rt60", type=float, nargs=2, default=ReverbConfig().rt60, metavar=("LO", "HI"),
                   help="seconds, drawn uniformly (data.augment.reverb.rt60's default)")
    b.add_argument("--jobs", type=int, default=2)
    r = sub.add_parser("reverberate", help="a reverberant copy of a manifest")
    r.add_argument("--manifest", required=True)
    r.add_argument("--rirs", required=True, help="a folder of impulse responses (a bank)")
    r.add_argument("--out", required=True, help="the new manifest (.jsonl); its audio goes in a folder of its name")
    r.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    if args.command == "bank":
        if args.count < 1 or not 0 < args.rt60[0] <= args.rt60[1]:
            sys.exit("simulate_rirs: --count must be >= 1 and --rt60 LO HI with 0 < LO <= HI")
        bank(args)
    else:
        reverberate_manifest(args)


if __name__ == "__main__":
    main()
