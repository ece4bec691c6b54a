"""A small model that has learned a few eSpeak NG sentences by heart, for tests that need
transcripts that mean something (the server, the web page, int8 and exported models).

`train_spoken_model(folder)` synthesizes SENTENCES (the synth recipe's engine), each spoken RENDERINGS
times with other voices, speeds and edge silences, trains a character model on them until it
writes them back, and saves it as a model file beside the FLAC files. About 10 s on one CPU core.
The caller skips when espeakng_loader is missing (tests use the fixture in conftest.py).
"""
from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import NamedTuple

import numpy as np
import soundfile as sf
import torch

from asr.checkpoint import model_file, save_atomic
from asr.config import to_dict
from asr.features import CMVNStats, FeatureConfig, GlobalCMVN, fbank
from asr.model import ASRModel, ModelConfig
from asr.tokenizer import CharTokenizer

SYNTH = Path(__file__).resolve().parents[1] / "recipes" / "synth" / "local"

SENTENCES = (
    "the quick brown fox jumps",
    "seven green boats sail north",
    "please call stella today",
    "my cat likes warm milk",
)
# (voice, words per minute, lead and tail silence in seconds) of each rendering of every sentence
RENDERINGS = (("en-us", 165, 0.3, 0.3), ("en-us+m3", 150, 0.6, 0.2), ("en-gb-x-rp+f2", 175, 0.15, 0.7))


class SpokenModel(NamedTuple):
    model: Path  # the model file
    audio: list[Path]  # the FLAC files, RENDERINGS per sentence, sentence by sentence
    texts: list[str]  # their transcripts


def train_spoken_model(folder: Path, steps: int = 300) -> SpokenModel:
    sys.path.insert(0, str(SYNTH))
    import synthesize

    engine = synthesize.ESpeak()
    resampler = synthesize.Resampler(engine.sample_rate, synthesize.SAMPLE_RATE)
    folder.mkdir(parents=True, exist_ok=True)
    paths, texts, waves = [], [], []
    for i, text in enumerate(SENTENCES):
        for j, (voice, wpm, lead, tail) in enumerate(RENDERINGS):
            utt = synthesize.Utt(id=f"s{i}r{j}", split="test", text=text, voice=voice, wpm=wpm, pitch=50,
                                 pitch_range=50, volume=100, lead=lead, tail=tail, snr_db=35.0)
            samples = synthesize.render(utt, engine, resampler).samples
            path = folder / f"{utt.id}.flac"
            sf.write(path, samples, synthesize.SAMPLE_RATE)
            paths.append(path)
            texts.append(text)
            waves.append(torch.from_numpy(samples.astype(np.float32) / 32768))
    features = FeatureConfig(n_mels=40)
    feats = [fbank(w, features) for w in waves]
    stats = CMVNStats()
    for f in feats:
        stats.add(f)
    cmvn = GlobalCMVN(stats)
    feats = [cmvn(f) for f in feats]
    chars = CharTokenizer(sorted({c for t in SENTENCES for c in t}))
    tokens = [chars.encode(t) for t in texts]
    torch.manual_seed(0)
    config = dataclasses.replace(
        ModelConfig(), vocab_size=chars.vocab_size, n_mels=40, subsampling=4, conv_channels=16, d_model=64,
        n_heads=4, ffn_dim=128, encoder_layers=2, decoder_layers=1, dropout=0.0, ctc_weight=0.5, lsm_weight=0.0)
    model = ASRModel(config)
    x = torch.nn.utils.rnn.pad_sequence(feats, batch_first=True)
    x_lens = torch.tensor([f.size(0) for f in feats])
    y = torch.nn.utils.rnn.pad_sequence([torch.tensor(t) for t in tokens], batch_first=True, padding_value=-1)
    y_lens = torch.tensor([len(t) for t in tokens])
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a model this small trains fastest on one thread, and 10x slower on a busy machine's two
    try:
        for _ in range(steps):
            optimizer.zero_grad()
            model(x, x_lens, y, y_lens).loss.backward()
            optimizer.step()
    finally:
        torch.set_num_threads(threads)
    model.eval()
    obj = model_file(model=to_dict(config), tokenizer=chars.to_dict(),
                     frontend={"features": to_dict(features), "cmvn": stats.to_dict()}, state_dict=model.state_dict())
    save_atomic(obj, folder / "model.pt")
    return SpokenModel(folder / "model.pt", paths, texts)
