"""Word timings (asr.alignment): the CTC Viterbi path on hand-built posteriors, against brute force,
batched == alone; words grouped from pieces, ordered and inside their segment."""
from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch
from test_api import TOKENS, write_decode_files
from test_beam_search import random_memory, tiny_model

from asr.alignment import align_words, ctc_viterbi, frame_centres, word_groups
from asr.tokenizer import CharTokenizer

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def posteriors(path: list[int], vocab: int = 6, peak: float = 0.9) -> torch.Tensor:
    """(1, T, V) log-probabilities whose frame t puts `peak` on path[t] (0 = blank), the rest spread."""
    probs = torch.full((len(path), vocab), (1 - peak) / (vocab - 1))
    probs[torch.arange(len(path)), torch.tensor(path)] = peak
    return probs.log()[None]


def test_viterbi_follows_the_path_the_posteriors_spell():
    # frames: blank, a, a, blank, b, blank, blank, b, c  -> targets a b b c; the repeated b needs its blank
    lp = posteriors([0, 2, 2, 0, 3, 0, 0, 3, 4])
    path = ctc_viterbi(lp, torch.tensor([9]), torch.tensor([[2, 3, 3, 4]]), torch.tensor([4]))
    assert path[0].tolist() == [-1, 0, 0, -1, 1, -1, -1, 2, 3]


def test_viterbi_is_forced_to_the_targets_even_against_the_posteriors():
    lp = posteriors([0, 2, 0, 0, 0, 0])  # the audio "says" a; the hypothesis is a b
    path = ctc_viterbi(lp, torch.tensor([6]), torch.tensor([[2, 3]]), torch.tensor([2]))
    seq = [k for k, _ in itertools.groupby(path[0].tolist()) if k >= 0]
    assert seq == [0, 1] and path[0, 1] == 0


def brute_force(lp: torch.Tensor, targets: list[int]) -> float:
    """The best path's score by enumerating every frame labelling that collapses to `targets`."""
    t_max, vocab = lp.shape
    best = -math.inf
    for labels in itertools.product(range(vocab), repeat=t_max):
        collapsed = [k for k, _ in itertools.groupby(labels) if k != 0]
        if collapsed == targets:
            best = max(best, float(sum(lp[t, k] for t, k in enumerate(labels))))
    return best


def path_score(lp: torch.Tensor, path: list[int], targets: list[int]) -> float:
    return float(sum(lp[t, targets[k] if k >= 0 else 0] for t, k in enumerate(path)))


@pytest.mark.parametrize("seed", range(4))
def test_viterbi_equals_brute_force_and_batched_equals_alone(seed):
    g = torch.Generator().manual_seed(seed)
    cases = [([1, 2], 5), ([2, 2], 4), ([1], 3), ([3, 1, 3], 6)]
    lens = torch.tensor([t for _, t in cases])
    lp = torch.randn(len(cases), int(lens.max()), 4, generator=g).log_softmax(-1)
    targets = torch.full((len(cases), 3), -1)
    for i, (y, _) in enumerate(cases):
        targets[i, :len(y)] = torch.tensor(y)
    target_lens = torch.tensor([len(y) for y, _ in cases])
    batched = ctc_viterbi(lp, lens, targets, target_lens)
    for i, (y, t) in enumerate(cases):
        alone = ctc_viterbi(lp[i:i + 1, :t], lens[i:i + 1], targets[i:i + 1, :len(y)], target_lens[i:i + 1])
        assert batched[i, :t].tolist() == alone[0].tolist() and (batched[i, t:] == -1).all()
        assert path_score(lp[i, :t], alone[0].tolist(), y) == pytest.approx(brute_force(lp[i, :t], y), abs=1e-5)


def test_word_groups_of_pieces_and_of_characters():
    chars = CharTokenizer(TOKENS)  # A-H and space
    ids = chars.encode("AB HE C")
    assert [(w, len(i)) for w, i in word_groups(ids, chars)] == [("AB", 2), ("HE", 2), ("C", 1)]
    from asr.tokenizer import train_tokenizer

    bpe = train_tokenizer(["THE CAT SAT ON THE MAT", "A CAT AND A HAT"] * 20, "bpe", 20)
    ids = bpe.encode("THE CAT SAT")
    assert [w for w, _ in word_groups(ids, bpe)] == ["THE", "CAT", "SAT"]
    assert sorted(i for _, idx in word_groups(ids, bpe) for i in idx) == list(range(len(ids)))


def test_word_timestamps_are_ordered_and_inside_the_segment():
    """Every word of every utterance (random model, random tokens) is ordered, inside its segment,
    confident in [0, 1]; an infeasible hypothesis shares the span in proportion, confidence 0."""
    model = tiny_model(3, dtype=torch.float32)
    memory, lens = random_memory(model, [17, 9, 30, 4], 3)
    chars = CharTokenizer(TOKENS)
    hyps = [chars.encode("AB HE"), chars.encode("H A"), chars.encode("BAD CAFE HEAD"), chars.encode("ABCDEFGH ABC")]
    durations = [float(frame_centres(model, n, 25.0)[-1]) + 0.1 for n in [17, 9, 30, 4]]
    words = align_words(model, memory, lens, hyps, chars, durations)
    assert [[w.text for w in ws] for ws in words] == [["AB", "HE"], ["H", "A"], ["BAD", "CAFE", "HEAD"],
                                                        ["ABCDEFGH", "ABC"]]
    for ws, duration in zip(words, durations):
        for w, nxt in zip(ws, ws[1:] + [None]):
            assert 0.0 <= w.start <= w.end <= duration and 0.0 <= w.confidence <= 1.0
            if nxt is not None:
                assert w.end <= nxt.start
    infeasible = words[3]  # 12 characters in 4 frames
    assert [w.confidence for w in infeasible] == [0.0, 0.0]
    assert infeasible[0].start == 0.0 and infeasible[-1].end == pytest.approx(durations[3])
    assert infeasible[0].end == pytest.approx(durations[3] * 8 / 11)


def test_transcribe_gives_words_within_each_segment(tmp_path):
    from asr.api import load_model

    model_path = write_decode_files(tmp_path)
    recognizer = load_model(model_path)
    results = recognizer.transcribe(sorted(tmp_path.glob("u*.wav")), beam_size=4, word_timestamps=True)
    plain = recognizer.transcribe(sorted(tmp_path.glob("u*.wav")), beam_size=4)
    assert [r.text for r in results] == [r.text for r in plain]
    for r in results:
        assert " ".join(w.text for w in r.words) == r.text.replace("  ", " ").strip()
        for w in r.words:
            assert any(s.start <= w.start <= w.end <= s.end for s in r.segments)
        assert [w.start for w in r.words] == sorted(w.start for w in r.words)
    assert any(r.words for r in results)


def parse_cues(text: str, mark: str) -> list[tuple[float, float, str]]:
    """(start, end, text) of every cue of an srt (mark ",") or vtt (mark ".") file."""
    import re

    clock = r"(\d\d):(\d\d):(\d\d)" + re.escape(mark) + r"(\d\d\d)"
    cues = []
    for m in re.finditer(clock + " --> " + clock + r"\n(.*)\n", text):
        g = [int(x) for x in m.groups()[:8]]
        start = g[0] * 3600 + g[1] * 60 + g[2] + g[3] / 1000
        end = g[4] * 3600 + g[5] * 60 + g[6] + g[7] / 1000
        cues.append((start, end, m.group(9)))
    return cues


def test_vtt_and_srt_parse_back(tmp_path):
    """`asr transcribe --word-timestamps --format all --output-dir`: srt and vtt hold a cue per word
    that parses back to the words and times of the json (to the millisecond), tsv the same in ms."""
    import json
    import subprocess
    import sys

    model_path = write_decode_files(tmp_path)
    out = tmp_path / "out"
    done = subprocess.run([sys.executable, "-m", "asr.cli", "transcribe", "--model", str(model_path),
                           str(tmp_path / "u1.wav"), str(tmp_path / "u3.wav"), "--beam-size", "4",
                           "--word-timestamps", "--format", "all", "--output-dir", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert sorted(p.name for p in out.iterdir()) == sorted(f"{u}.{f}" for u in ("u1", "u3")
                                                           for f in ("txt", "json", "srt", "vtt", "tsv"))
    for name in ("u1", "u3"):
        [result] = json.loads((out / f"{name}.json").read_text())
        words = [(w["start"], w["end"], w["word"]) for s in result["segments"] for w in s.get("words", [])]
        assert words and " ".join(w for *_, w in words) == result["text"]
        assert all(0.0 <= w["confidence"] <= 1.0 for s in result["segments"] for w in s["words"])
        srt, vtt = (out / f"{name}.srt").read_text(), (out / f"{name}.vtt").read_text()
        assert vtt.startswith("WEBVTT\n\n") and srt.startswith("1\n")
        for cues in (parse_cues(srt, ","), parse_cues(vtt, ".")):
            assert [c[2] for c in cues] == [w[2] for w in words]
            assert [t for c in cues for t in c[:2]] == pytest.approx([t for w in words for t in w[:2]], abs=1e-3)
        rows = [line.split("\t") for line in (out / f"{name}.tsv").read_text().splitlines()[1:]]
        assert [t for *_, t in rows] == [w[2] for w in words]
        assert [int(x) / 1000 for a, b, _ in rows for x in (a, b)] == pytest.approx(
            [t for w in words for t in w[:2]], abs=1e-3)
        assert (out / f"{name}.txt").read_text() == result["text"] + "\n"


@pytest.mark.slow
def test_word_timestamps_match_synthesis_events():
    """A tiny model overfit on 24 eSpeak NG utterances (the synth recipe's generator, two voices):
    its CTC alignment of their transcripts puts the words' starts within about 1 encoder frame (at
    most 1.25 frames, 50 ms at 4x: one run gave 1.06) of where eSpeak started them (its word events,
    as the synth recipe records them) on the median, and 90% of them within 3 frames. Fewer
    utterances let a self-attention encoder memorize them with its CTC spikes shifted in time: more
    of them (different sentences share words at different places) pin the spikes to the sound."""
    import dataclasses
    import statistics
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "recipes" / "synth" / "local"))
    import synthesize

    from asr.features import CMVNStats, FeatureConfig, GlobalCMVN, fbank
    from asr.model import ASRModel, ModelConfig

    sentences = synthesize.generated_texts({"train": 24, "dev": 0, "test": 0}, seed=1)["train"]
    engine = synthesize.ESpeak()
    resampler = synthesize.Resampler(engine.sample_rate, synthesize.SAMPLE_RATE)
    voices = ("en-us", "en-gb-scotland+f2")
    rendered = [synthesize.render(synthesize.Utt(id=f"u{i}", split="dev", text=t, voice=voices[i % 2], wpm=160,
                                                 pitch=50, pitch_range=50, volume=100, lead=0.3, tail=0.2,
                                                 snr_db=40.0), engine, resampler) for i, t in enumerate(sentences)]
    features = FeatureConfig(n_mels=40)
    feats = [fbank(torch.from_numpy(r.samples.astype(np.float32) / 32768), features) for r in rendered]
    stats = CMVNStats()
    for f in feats:
        stats.add(f)
    cmvn = GlobalCMVN(stats)
    feats = [cmvn(f) for f in feats]
    chars = CharTokenizer(sorted({c for t in sentences for c in t}))
    tokens = [chars.encode(t) for t in sentences]
    torch.manual_seed(0)
    model = ASRModel(dataclasses.replace(
        ModelConfig(), vocab_size=chars.vocab_size, n_mels=40, subsampling=4, conv_channels=16, d_model=96, n_heads=4,
        ffn_dim=192, encoder_layers=3, decoder_layers=1, dropout=0.0, ctc_weight=0.7, lsm_weight=0.0))
    x = torch.nn.utils.rnn.pad_sequence(feats, batch_first=True)
    x_lens = torch.tensor([f.size(0) for f in feats])
    y = torch.nn.utils.rnn.pad_sequence([torch.tensor(t) for t in tokens], batch_first=True, padding_value=-1)
    y_lens = torch.tensor([len(t) for t in tokens])
    optimizer = torch.optim.Adam(model.parameters(), lr=2e-3)
    for _ in range(600):
        optimizer.zero_grad()
        model(x, x_lens, y, y_lens).loss.backward()
        optimizer.step()
    model.eval()
    with torch.no_grad():
        memory, memory_lens = model.encoder(x, x_lens)
    durations = [len(r.samples) / 16000 for r in rendered]
    words = align_words(model, memory, memory_lens, tokens, chars, durations, frame_length_ms=features.frame_length_ms)
    frame = model.config.subsampling * features.frame_shift_ms / 1000  # 40 ms
    errors = []
    for r, ws, text in zip(rendered, words, sentences):
        assert [w.text for w in ws] == text.split()
        errors += [(ws[e["index"]].start - e["start"]) / frame for e in r.words]
    assert len(errors) >= 0.8 * sum(len(t.split()) for t in sentences)
    absolute = sorted(abs(e) for e in errors)
    assert statistics.median(absolute) <= 1.25 and absolute[int(0.9 * len(absolute))] <= 3.0, \
        [round(e, 1) for e in sorted(errors)]
