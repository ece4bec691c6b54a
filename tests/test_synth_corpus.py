"""Stage 0 of the synthetic-speech recipe: the text generator, the voice split and the synthesized corpus."""
from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

LOCAL = Path(__file__).resolve().parents[1] / "recipes" / "synth" / "local"
sys.path.insert(0, str(LOCAL))  # recipe helpers are scripts, not a package; spawned workers inherit the path

import accents  # noqa: E402
import make_text  # noqa: E402
import synthesize  # noqa: E402


def accent(speaker: str) -> str:
    return speaker.split("+")[0]


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


# --- text generator ----------------------------------------------------------------------------------


def test_vocabulary_has_over_1000_words_and_covers_every_sentence():
    vocab = make_text.vocabulary()
    assert len(vocab) >= 1000
    train = make_text.make_sentences(3000, "train", seed=0)
    test = make_text.make_sentences(500, "test", seed=0)
    train_words = {w for s in train for w in s.split()}
    assert len(train_words) >= 1000  # the words really used, not only listed
    assert {w for s in train + test for w in s.split()} <= vocab


@pytest.mark.parametrize("seed", [0, 1])
def test_dev_and_test_templates_are_disjoint_from_training_and_add_no_words(seed):
    train, dev, test = (make_text.templates(s, seed) for s in ("train", "dev", "test"))
    assert len(dev) == make_text.DEV_TEMPLATE_COUNT and set(train) | set(dev) == set(make_text.TRAIN_TEMPLATES)
    assert not set(train) & set(dev) and not set(train) & set(test) and not set(dev) & set(test)
    assert dev == make_text.dev_templates(seed) and (seed == 0 or dev != make_text.dev_templates(0))
    train_kinds = set().union(*map(make_text.slot_kinds, train))
    train_words = {w for t in train for w in re.sub(r"\{[^}]+\}", " ", t).split()}
    for held in (dev, test):
        assert set().union(*map(make_text.slot_kinds, held)) <= train_kinds  # "v_food:ing" must be trained too
        assert {w for t in held for w in re.sub(r"\{[^}]+\}", " ", t).split()} <= train_words
    sentences = set(make_text.make_sentences(3000, "train", seed))
    assert not sentences & set(make_text.make_sentences(500, "test", seed))
    assert not sentences & set(make_text.make_sentences(300, "dev", seed))


def test_no_dev_or_test_template_shares_three_literal_words_in_a_row_with_a_training_template():
    """The dev and test frames are new: no run of three literal (non-slot) words of theirs appears
    in any training template, so the training text never holds a held-out frame's phrase."""
    def literal_runs(template: str) -> set[tuple[str, ...]]:
        tokens = template.split()
        return {tuple(tokens[i:i + 3]) for i in range(len(tokens) - 2)
                if not any("{" in t for t in tokens[i:i + 3])}
    train = set().union(*map(literal_runs, make_text.templates("train", 0)))
    for template in make_text.templates("dev", 0) + make_text.TEST_TEMPLATES:
        assert not literal_runs(template) & train, template


def test_three_worlds_share_no_template_voice_or_unseen_word():
    """Train, dev and test (the recipe's sizes and seed) have their own templates and accents;
    dev and test have their own unseen words, which no training sentence, LM sentence or the
    tokenizer's text (the training transcripts) holds, and no LM or training text holds a test
    sentence. The unseen words are 5-10% of the test set's distinct words."""
    num, seed = {"train": 27000, "dev": 200, "test": 400}, 0
    accents = {"dev": set(synthesize.DEV_ACCENTS), "test": set(synthesize.TEST_ACCENTS)}
    accents["train"] = set(synthesize.ACCENTS) - accents["dev"] - accents["test"]
    assert len(accents["train"]) >= 3 and not accents["dev"] & accents["test"]
    texts = synthesize.generated_texts(num, seed)
    lm_text = synthesize.lm_sentences(num, seed, 20000) + synthesize.lm_clauses(20000, seed)
    unseen = {s: make_text.unseen_words(s, seed) for s in ("dev", "test")}
    assert unseen["dev"] and unseen["test"] and not unseen["dev"] & unseen["test"]
    heard = {w for s in texts["train"] + lm_text for w in s.split()}
    assert not heard & (unseen["dev"] | unseen["test"])
    assert not set(texts["test"]) & (set(lm_text) | set(texts["train"]) | set(texts["dev"]))
    words = {s: {w for t in texts[s] for w in t.split()} for s in ("dev", "test")}
    assert not words["dev"] & unseen["test"] and not words["test"] & unseen["dev"]
    share = len(words["test"] & unseen["test"]) / len(words["test"])
    assert 0.05 <= share <= 0.10, share
    assert words["dev"] & unseen["dev"]
    # every unseen word is a whole family: no plural or possessive of it is heard either
    for w in unseen["test"] | unseen["dev"]:
        if w in make_text.THINGS + make_text.FOODS + make_text.ANIMALS:
            assert make_text.plural(w) in unseen["test"] | unseen["dev"], w
        if w in make_text.FIRST_NAMES:
            assert w + "'S" in unseen["test"] | unseen["dev"], w


def test_sentences_are_normalized_distinct_and_deterministic():
    for split in ("train", "dev", "test"):
        sentences = make_text.make_sentences(300, split, seed=7)
        assert len(set(sentences)) == 300
        for s in sentences:
            assert make_text.is_normalized(s), s
            assert synthesize.normalize(s) == s
        assert sentences == make_text.make_sentences(300, split, seed=7)
        assert sentences[:100] == make_text.make_sentences(100, split, seed=7)  # prefix-stable
        assert sentences != make_text.make_sentences(300, split, seed=8)


def test_spliced_sentences_reuse_runs_of_training_words_and_never_a_held_out_sentence():
    stream = make_text.make_sentences(2200, "train", seed=0)
    train, dev = stream[:2000], stream[2000:]
    test = make_text.make_sentences(300, "test", seed=0)
    mixed = make_text.splice_some(train, 0.5, seed=0, avoid=set(dev) | set(test))
    assert len(mixed) == len(train) and len(set(mixed)) == len(mixed)
    train_set = set(train)
    new = [s for s in mixed if s not in train_set]
    assert 900 < len(new) < 1100  # about half
    assert not set(mixed) & (set(dev) | set(test))
    assert all(m == t for m, t in zip(mixed, train) if m in train_set)  # the rest stay where they were
    pairs = {p for s in train for p in zip(s.split(), s.split()[1:])}
    for s in new:
        words = s.split()
        assert make_text.SPLICE_LENGTH[0] <= len(words) <= make_text.SPLICE_LENGTH[1], s
        assert make_text.is_normalized(s)
        # every word pair is a training pair or a seam; runs have >= 2 words, so seams are not adjacent
        seams = [i for i, p in enumerate(zip(words, words[1:])) if p not in pairs]
        assert all(b - a >= 2 for a, b in zip(seams, seams[1:])), s
    assert mixed == make_text.splice_some(train, 0.5, seed=0, avoid=set(dev) | set(test))
    assert mixed != make_text.splice_some(train, 0.5, seed=1, avoid=set(dev) | set(test))
    assert make_text.splice_some(train, 0.0, seed=0) == train
    with pytest.raises(ValueError, match="within"):
        make_text.splice_some(train, 1.5, seed=0)


def test_random_word_sentences_draw_from_the_vocabulary():
    train = make_text.make_sentences(2000, "train", seed=0)
    mixed = make_text.random_words_some(train, 0.1, seed=0)
    replaced = [m for m, t in zip(mixed, train) if m != t]
    assert 150 < len(replaced) < 250  # about a tenth
    vocabulary = make_text.vocabulary() - make_text.excluded_words("train", 0)  # not dev's or test's unseen words
    pairs = {p for s in train for p in zip(s.split(), s.split()[1:])}
    for s in replaced:
        assert make_text.SPLICE_LENGTH[0] <= len(s.split()) <= make_text.SPLICE_LENGTH[1], s
        assert set(s.split()) <= vocabulary and make_text.is_normalized(s)
    new_pairs = [p for s in replaced for p in zip(s.split(), s.split()[1:]) if p not in pairs]
    assert len(new_pairs) > 0.9 * sum(len(s.split()) - 1 for s in replaced)  # word pairs no template has
    assert mixed == make_text.random_words_some(train, 0.1, seed=0)
    assert mixed != make_text.random_words_some(train, 0.1, seed=1)
    assert make_text.random_words_some(train, 0.0, seed=0) == train
    with pytest.raises(ValueError, match="within"):
        make_text.random_words_some(train, -0.1, seed=0)


def test_generated_splits_hold_spliced_training_sentences_only_in_train():
    num = {"train": 1000, "dev": 100, "test": 100}
    texts = synthesize.generated_texts(num, seed=3, spliced=0.5, random_words=0.0)
    template_sentences = set(make_text.make_sentences(1000, "train", seed=3))
    assert texts["dev"] == make_text.make_sentences(100, "dev", seed=3)  # dev: the dev templates' sentences
    assert texts["test"] == make_text.make_sentences(100, "test", seed=3)
    assert 400 < sum(s not in template_sentences for s in texts["train"]) < 600
    assert not set(texts["train"]) & (set(texts["dev"]) | set(texts["test"]))
    unspliced = synthesize.generated_texts(num, seed=3, spliced=0.0, random_words=0.0)
    assert unspliced["train"] == make_text.make_sentences(1000, "train", seed=3)
    # the default: spliced, then a tenth random words; never a dev or test sentence
    default = synthesize.generated_texts(num, seed=3)
    assert default["train"] == make_text.random_words_some(
        synthesize.generated_texts(num, seed=3, random_words=0.0)["train"], synthesize.RANDOM_WORDS, 3)
    assert not set(default["train"]) & (set(default["dev"]) | set(default["test"]))


def test_lm_sentences_continue_the_training_stream_past_train():
    num = {"train": 1000, "dev": 100, "test": 100}
    texts = synthesize.generated_texts(num, seed=3)
    stream = make_text.make_sentences(1000 + 500, "train", seed=3)
    lm = synthesize.lm_sentences(num, seed=3, count=500)
    assert lm == stream[1000:]  # training templates only, in generation order: deterministic
    assert not set(lm) & (set(texts["train"]) | set(texts["dev"]) | set(texts["test"]))


def test_clauses_are_new_word_sequences_of_the_training_vocabulary():
    sentences = make_text.clauses(3000, seed=5)
    assert len(set(sentences)) == 3000 and sentences == make_text.clauses(3000, seed=5)
    assert sentences[:100] == make_text.clauses(100, seed=5) and sentences != make_text.clauses(3000, seed=6)
    vocab = make_text.vocabulary() - make_text.excluded_words("train", 5)
    for s in sentences:
        words = s.split()
        assert make_text.is_normalized(s) and set(words) <= vocab and len(words) <= 16, s
    # what the templates lack: word pairs of tenses, modals and questions the test frames use too
    def word_pairs(texts: list[str]) -> set[tuple[str, str]]:
        return {p for s in texts for p in zip(s.split(), s.split()[1:])}
    pairs, template_pairs = word_pairs(sentences), word_pairs(make_text.make_sentences(20000, "train", seed=5))
    for pair in [("WE", "WILL"), ("SHOULD", "HAVE"), ("IF", "IT"), ("HAVE", "YOU")]:
        assert pair in pairs
    assert len(pairs - template_pairs) > len(pairs) / 2


@pytest.mark.parametrize("n, words", [
    (0, "ZERO"), (13, "THIRTEEN"), (40, "FORTY"), (99, "NINETY NINE"), (100, "ONE HUNDRED"),
    (305, "THREE HUNDRED AND FIVE"), (1005, "ONE THOUSAND AND FIVE"),
    (21_342, "TWENTY ONE THOUSAND THREE HUNDRED AND FORTY TWO"), (2_000_000, "TWO MILLION"),
])
def test_number_words(n, words):
    assert make_text.number_words(n) == words


def test_ordinals_years_articles_plurals():
    assert make_text.ordinal_words(23) == "TWENTY THIRD"
    assert make_text.ordinal_words(30) == "THIRTIETH"
    assert make_text.year_words(1984) == "NINETEEN EIGHTY FOUR"
    assert make_text.year_words(1905) == "NINETEEN OH FIVE"
    assert make_text.year_words(2007) == "TWO THOUSAND AND SEVEN"
    assert make_text.with_article("ORANGE CUP") == "AN ORANGE CUP"
    assert make_text.with_article("USEFUL BOX") == "A USEFUL BOX"
    assert [make_text.plural(w) for w in ("BOX", "CHERRY", "DONKEY", "KNIFE", "CHOCOLATE BAR")] == [
        "BOXES", "CHERRIES", "DONKEYS", "KNIVES", "CHOCOLATE BARS"]


def test_user_text_is_normalized_with_numbers_in_words():
    assert synthesize.normalize("Rock-’n’-roll / jazz, isn't it?  'Yes'") == "ROCK N ROLL JAZZ ISN'T IT YES"
    assert synthesize.speakable("Meet me at 10, on the 2nd of May!") == "MEET ME AT TEN ON THE SECOND OF MAY"
    assert synthesize.speakable("1,250 people paid 3.5 euros, code 007") == (
        "ONE THOUSAND TWO HUNDRED AND FIFTY PEOPLE PAID THREE POINT FIVE EUROS CODE ZERO ZERO SEVEN")


# --- audio -------------------------------------------------------------------------------------------


def test_resampler_matches_torchaudio():
    import torch
    import torchaudio

    x = np.random.default_rng(0).standard_normal(22050 + 123).astype(np.float32)
    ours = synthesize.Resampler(22050, 16000)(x)
    ref = torchaudio.functional.resample(torch.from_numpy(x), 22050, 16000).numpy()
    assert ours.shape == ref.shape
    np.testing.assert_allclose(ours, ref, atol=1e-4)


def test_every_voice_exists():
    synthesize.check_voices(synthesize.TEST_ACCENTS)
    engine = synthesize.ESpeak()
    for voice in synthesize.voices(synthesize.ACCENTS[:1]) + list(synthesize.ACCENTS):
        assert len(engine.synthesize("hello there.", voice)) > 0.3 * engine.sample_rate, voice
    with pytest.raises(synthesize.SynthError, match="no voice"):
        engine.synthesize("hello.", "en-nowhere")


def test_accent_distances_come_from_espeaks_phonemes():
    assert accents.edit_distance(["a", "b", "c"], ["a", "c"]) == 1
    assert accents.edit_distance(["k", "A@"], ["k", "A@", "r"]) == 1 and accents.edit_distance([], ["x"]) == 1
    phonemizer = accents.Phonemizer()
    assert phonemizer.phonemes("car", "en-us")[0] == "k"
    assert phonemizer.phonemes("car", "en-gb-scotland") != phonemizer.phonemes("car", "en")  # the rhotic r
    table = accents.distances(["car", "water", "hello", "world"], ["en-us", "en", "en-gb-scotland"], phonemizer)
    assert all(table[a][a] == {"phonemes": 0.0, "words": 0.0} for a in table)
    assert table["en"]["en-gb-scotland"] == table["en-gb-scotland"]["en"] and table["en"]["en-gb-scotland"]["words"] > 0
    with pytest.raises(synthesize.SynthError, match="no voice"):
        phonemizer.phonemes("car", "en-nowhere")
    assert "| en-gb-scotland (test) |" in accents.markdown(table, 4)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """3 utterances per split, synthesized by 2 worker processes."""
    out = tmp_path_factory.mktemp("synth")
    synthesize.synthesize_corpus(out, {"train": 3, "dev": 3, "test": 3}, seed=1, jobs=2, lm_count=50,
                                 lm_clause_count=20)
    return out


def test_lm_text_holds_other_training_template_sentences_then_clauses(corpus):
    lines = (corpus / "lm_text.txt").read_text(encoding="utf-8").splitlines()
    assert lines[:50] == synthesize.lm_sentences({"train": 3, "dev": 3, "test": 3}, seed=1, count=50)
    assert lines[50:] == make_text.clauses(20, seed=1)
    spoken = {u["text"] for split in synthesize.SPLITS for u in read_jsonl(corpus / f"{split}.jsonl")}
    assert len(lines) == 70 and not set(lines) & spoken


def test_manifests_match_the_flac_files(corpus):
    for split in synthesize.SPLITS:
        utts = read_jsonl(corpus / f"{split}.jsonl")
        assert [u["id"] for u in utts] == sorted(u["id"] for u in utts) and len(utts) == 3
        for u in utts:
            assert set(u) == {"id", "audio", "duration", "text", "speaker"}
            assert not Path(u["audio"]).is_absolute()
            info = sf.info(str(corpus / u["audio"]))
            assert (info.samplerate, info.channels, info.format, info.subtype) == (16000, 1, "FLAC", "PCM_16")
            assert u["duration"] == info.frames / 16000
            samples = sf.read(str(corpus / u["audio"]), dtype="int16")[0]
            assert len(samples) == info.frames and np.abs(samples).max() > 1000  # decodes, not silent
            assert make_text.is_normalized(u["text"])


def test_word_starts_sit_beside_the_manifests_in_order_inside_each_file(corpus):
    """<split>_words.jsonl: a line per manifest line, in its order; eSpeak's word events as words
    of the manifest text at increasing times after the lead silence, inside the audio."""
    for split in synthesize.SPLITS:
        utts = read_jsonl(corpus / f"{split}.jsonl")
        entries = read_jsonl(corpus / f"{split}_words.jsonl")
        assert [e["id"] for e in entries] == [u["id"] for u in utts]
        timed = total = 0
        for u, e in zip(utts, entries):
            words = u["text"].split()
            assert all(w["word"] == words[w["index"]] for w in e["words"])
            assert all(a["index"] < b["index"] and a["start"] < b["start"] for a, b in zip(e["words"], e["words"][1:]))
            assert 0 <= e["words"][0]["start"] and e["words"][-1]["start"] < u["duration"]
            timed, total = timed + len(e["words"]), total + len(words)
        assert timed > 0.7 * total


def test_audio_has_a_noise_floor_at_the_planned_snr(corpus):
    """No digital silence (it decodes to a log-mel floor that training, with its dither, never
    sees): the edges hold the planned white noise, speech RMS / noise RMS = the plan's snr_db."""
    plans = synthesize.synthesize_corpus(corpus, {"train": 3, "dev": 3, "test": 3}, seed=1, lm_count=50,
                                         lm_clause_count=20)
    plan = {u.id: u for split in ("train", "dev") for u in plans[split]}
    checked = 0
    for u in read_jsonl(corpus / "train.jsonl") + read_jsonl(corpus / "dev.jsonl"):
        samples = sf.read(str(corpus / u["audio"]), dtype="float64")[0] * 32768
        utt = plan[u["id"]]
        assert synthesize.NOISE_SNR_DB[0] <= utt.snr_db <= synthesize.NOISE_SNR_DB[1]
        assert np.mean(samples == 0) < 0.03  # digital silence would be 15-30% (the edges, the gaps)
        if utt.lead < 0.02:  # a trimmed edge (training only): no noise-only stretch to measure
            continue
        checked += 1
        edge = samples[:int(utt.lead * 16000) - 10]  # noise only
        speech_rms = np.sqrt(np.mean(np.square(samples)))
        snr = 20 * np.log10(speech_rms / np.sqrt(np.mean(np.square(edge))))
        assert abs(snr - utt.snr_db) < 3.0, (u["id"], snr, utt.snr_db)
    assert checked >= 3


def test_only_training_utterances_have_trimmed_edges():
    """A share of the training utterances start or end at the speech's first or last sample; dev
    and test keep their edge silences, as before."""
    texts = ["HELLO THERE"] * 2000
    train = synthesize.plan_split("train", texts, synthesize.voices(("en-us",)), seed=0)
    trimmed = [u.lead == 0 for u in train] + [u.tail == 0 for u in train]
    assert abs(sum(trimmed) / len(trimmed) - synthesize.TRIMMED_EDGE) < 0.03
    for split in ("dev", "test"):
        plan = synthesize.plan_split(split, texts, synthesize.voices(("en-us",)), seed=0)
        low, high = synthesize.EDGE_SILENCE
        assert all(low <= e <= high for u in plan for e in (u.lead, u.tail))


def test_dev_and_test_accents_are_never_heard_in_training(corpus):
    speakers = {s: {u["speaker"] for u in read_jsonl(corpus / f"{s}.jsonl")} for s in synthesize.SPLITS}
    train_accents = set(synthesize.ACCENTS) - set(synthesize.TEST_ACCENTS) - set(synthesize.DEV_ACCENTS)
    assert {accent(s) for s in speakers["train"]} <= train_accents
    assert {accent(s) for s in speakers["dev"]} <= set(synthesize.DEV_ACCENTS)
    assert {accent(s) for s in speakers["test"]} <= set(synthesize.TEST_ACCENTS)
    texts = {s: {u["text"] for u in read_jsonl(corpus / f"{s}.jsonl")} for s in synthesize.SPLITS}
    assert not texts["train"] & texts["dev"] and not texts["train"] & texts["test"]
    card = json.loads((corpus / "corpus.json").read_text())
    assert card["seed"] == 1 and card["splits"]["dev"]["accents"] == list(synthesize.DEV_ACCENTS)
    assert card["splits"]["test"]["templates"] == len(make_text.TEST_TEMPLATES)
    assert {"unseen_words", "unseen_distinct_words"} <= set(card["splits"]["test"]) - set(card["splits"]["train"])


def test_plan_deals_voices_evenly_with_held_out_accents():
    plan = synthesize.plan_split("test", ["HELLO"] * 200, synthesize.voices(synthesize.TEST_ACCENTS), seed=0)
    counts = {}
    for u in plan:
        counts[u.voice] = counts.get(u.voice, 0) + 1
    assert set(counts) == set(synthesize.voices(synthesize.TEST_ACCENTS)) and max(counts.values()) <= 3
    assert all(synthesize.RATE_WPM[0] <= u.wpm <= synthesize.RATE_WPM[1] for u in plan)


def test_rerun_keeps_finished_files_and_remakes_stale_ones(corpus, capsys):
    stale = corpus / "wav" / "dev" / "dev-000000.flac"
    sf.write(str(stale), np.zeros(1600, np.int16), 16000, format="FLAC")  # no plan key: must be remade
    before = {p: p.stat().st_mtime_ns for p in corpus.glob("wav/*/*.flac") if p != stale}
    synthesize.synthesize_corpus(corpus, {"train": 3, "dev": 3, "test": 3}, seed=1, jobs=1, lm_count=50,
                                 lm_clause_count=20)
    assert "1 made, 8 kept" in capsys.readouterr().err
    assert before == {p: p.stat().st_mtime_ns for p in corpus.glob("wav/*/*.flac") if p != stale}
    dev = {u["id"]: u for u in read_jsonl(corpus / "dev.jsonl")}
    assert dev["dev-000000"]["duration"] == sf.info(str(stale)).frames / 16000 > 0.5
    assert not list(corpus.glob("wav/*/.*.tmp")) and not list(corpus.glob(".*.tmp"))


def test_text_file_splits_sentences_and_spells_numbers(tmp_path):
    lines = [f"Line number {i} of the file." for i in range(1, 9)] + ["", "Line number 1 of the file!"]
    text = tmp_path / "text.txt"
    text.write_text("\n".join(lines), encoding="utf-8")
    out = tmp_path / "data"
    assert synthesize.main(["--out-dir", str(out), "--num-train", "5", "--num-dev", "1", "--num-test", "2",
                            "--text", str(text), "--jobs", "1"]) == 0
    texts = {s: [u["text"] for u in read_jsonl(out / f"{s}.jsonl")] for s in synthesize.SPLITS}
    assert len(texts["train"]) == 5 and len(texts["dev"]) == 1 and len(texts["test"]) == 2
    assert not set(texts["train"]) & (set(texts["dev"]) | set(texts["test"]))
    assert all(t.startswith("LINE NUMBER ") and t.endswith(" OF THE FILE") for ts in texts.values() for t in ts)
    assert "LINE NUMBER ONE OF THE FILE" in sum(texts.values(), [])
    # the generator's LM text is the generator's: a stale one from an earlier run is removed
    (out / "lm_text.txt").write_text("STALE\n", encoding="utf-8")
    assert synthesize.main(["--out-dir", str(out), "--num-train", "5", "--num-dev", "1", "--num-test", "2",
                            "--text", str(text), "--jobs", "1"]) == 0
    assert not (out / "lm_text.txt").exists()


def test_bad_arguments_are_one_line_errors(tmp_path, capsys):
    assert synthesize.main(["--out-dir", str(tmp_path), "--num-train", "1", "--num-dev", "0",
                            "--num-test", "0", "--test-accents", "en-mars"]) == 1
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "en-mars" in err
    assert synthesize.main(["--out-dir", str(tmp_path), "--num-train", "1", "--num-dev", "0", "--num-test", "0",
                            "--dev-accents", "en-us-nyc"]) == 1
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "must be disjoint" in err
    short = tmp_path / "short.txt"
    short.write_text("one sentence\n", encoding="utf-8")
    assert synthesize.main(["--out-dir", str(tmp_path), "--num-train", "1", "--num-dev", "1",
                            "--num-test", "1", "--text", str(short)]) == 1
    assert "short.txt: 1 distinct sentences" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        synthesize.main(["--out-dir", str(tmp_path), "--num-train", "1", "--num-dev", "1",
                         "--num-test", "1", "--spliced", "2"])
    assert "--spliced must be within [0, 1]" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        synthesize.main(["--out-dir", str(tmp_path), "--num-train", "1", "--num-dev", "1",
                         "--num-test", "1", "--lm-sentences", "-1"])
    assert "counts must be >= 0" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        synthesize.main(["--out-dir", str(tmp_path), "--num-train", "1", "--num-dev", "1",
                         "--num-test", "1", "--lm-clauses", "-1"])
    assert "counts must be >= 0" in capsys.readouterr().err
