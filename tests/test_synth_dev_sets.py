"""The dev sets that separate the gaps (issue 47): dev (unseen accents), dev_near (the training
accents in voice variants training never uses) and dev_synth (Festival's ked voice) speak the same
held-out sentences; which voices and lines go where, and Festival's voice when it can be fetched."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "recipes" / "synth" / "local"))  # the recipe's helpers are scripts

import festival  # noqa: E402
import flite  # noqa: E402
import synthesize  # noqa: E402

RECIPE = {"train": 27000, "dev": 200, "test": 400, "dev_near": 200}  # run.sh's sizes


def accent_and_variant(voice: str) -> tuple[str, str]:
    accent, _, variant = voice.partition("+")
    return accent, variant


@pytest.fixture(scope="module")
def recipe_plan() -> synthesize.CorpusPlan:
    return synthesize.plan_corpus(RECIPE, seed=0)


def test_near_variants_are_never_dealt_to_training(recipe_plan):
    train_accents = set(recipe_plan.accents["train"])
    near = set(synthesize.NEAR_VARIANTS)
    assert near < set(synthesize.VARIANTS) and "" not in near
    assert set(synthesize.TRAIN_VARIANTS) == set(synthesize.VARIANTS) - near
    trained = {accent_and_variant(u.voice) for u in recipe_plan.utts["train"]}
    assert {a for a, _ in trained} == train_accents and not {v for _, v in trained} & near
    # dev_near: every near variant of every training accent, and nothing else
    heard = {accent_and_variant(u.voice) for u in recipe_plan.utts["dev_near"]}
    assert heard == {(a, v) for a in train_accents for v in near}
    assert not {u.voice for u in recipe_plan.utts["dev_near"]} & {u.voice for u in recipe_plan.utts["train"]}


def test_dev_near_speaks_devs_held_out_sentences_and_dev_and_test_are_as_before(recipe_plan):
    texts, utts = recipe_plan.texts, recipe_plan.utts
    assert texts["dev_near"] == texts["dev"] and len(utts["dev_near"]) == RECIPE["dev"]
    assert [u.text for u in utts["dev_near"]] == [u.text for u in utts["dev"]]
    assert not set(texts["train"]) & set(texts["dev"]) and not set(texts["train"]) & set(texts["test"])
    assert not {u.id for u in utts["dev_near"]} & {u.id for u in utts["dev"]}
    # dev and test are planned as before the near variants were held out (every variant of their
    # accents), so their results stay comparable
    for split, accents in (("dev", synthesize.DEV_ACCENTS), ("test", synthesize.TEST_ACCENTS)):
        assert utts[split] == synthesize.plan_split(split, texts[split], synthesize.voices(accents), 0)
    card = synthesize.corpus_card(texts, 0, recipe_plan.accents, generated=True)["splits"]
    assert card["dev_near"]["variants"] == list(synthesize.NEAR_VARIANTS)
    assert card["dev_near"]["accents"] == card["train"]["accents"]
    assert card["dev_near"]["unseen_words"] == card["dev"]["unseen_words"]


def test_a_text_files_held_out_lines_make_the_dev_sets(tmp_path):
    """The learning check's corpus: dev_near speaks dev's lines (the first --num-dev-near), never a
    training line; more than dev has is a one-line error."""
    text = tmp_path / "text.txt"
    text.write_text("".join(f"line number {i} of the book\n" for i in range(40)), encoding="utf-8")
    plan = synthesize.plan_corpus({"train": 30, "dev": 6, "test": 0, "dev_near": 4}, seed=3, text_file=text)
    assert plan.texts["dev_near"] == plan.texts["dev"][:4] and len(plan.texts["dev"]) == 6
    assert not set(plan.texts["train"]) & set(plan.texts["dev"])
    assert not {accent_and_variant(u.voice)[1] for u in plan.utts["train"]} & set(synthesize.NEAR_VARIANTS)
    with pytest.raises(synthesize.SynthError, match="--num-dev-near 7: dev_near speaks dev's sentences"):
        synthesize.plan_corpus({"train": 30, "dev": 6, "test": 0, "dev_near": 7}, text_file=text)
    assert synthesize.plan_corpus({"train": 30, "dev": 6, "test": 0}, text_file=text).utts["dev_near"] == []


def test_the_command_speaks_dev_near_as_large_as_dev_by_default(tmp_path):
    text = tmp_path / "text.txt"
    text.write_text("".join(f"line number {i} of the book\n" for i in range(10)), encoding="utf-8")
    out = tmp_path / "data"
    args = ["--out-dir", str(out), "--num-train", "3", "--num-dev", "2", "--num-test", "0", "--text", str(text),
            "--jobs", "1", "--seed", "4"]
    assert synthesize.main(args) == 0
    read = {s: [json.loads(line) for line in (out / f"{s}.jsonl").read_text().splitlines()]
            for s in ("train", "dev", "dev_near")}
    assert [u["text"] for u in read["dev_near"]] == [u["text"] for u in read["dev"]]
    assert all(accent_and_variant(u["speaker"])[1] in synthesize.NEAR_VARIANTS for u in read["dev_near"])
    assert all(accent_and_variant(u["speaker"])[1] not in synthesize.NEAR_VARIANTS for u in read["train"])
    assert all(sf.info(str(out / u["audio"])).frames / 16000 == u["duration"] for u in read["dev_near"])
    assert (out / "dev_near_words.jsonl").is_file()
    card = json.loads((out / "corpus.json").read_text())["splits"]
    assert card["dev_near"]["sentences"] == 2 and card["dev_near"]["variants"] == list(synthesize.NEAR_VARIANTS)
    assert synthesize.main([*args, "--num-dev-near", "0"]) == 0  # none asked: an earlier one is removed
    assert not (out / "dev_near.jsonl").exists() and "dev_near" not in json.loads((out / "corpus.json").read_text())[
        "splits"]


def test_dev_synth_speaks_devs_sentences_with_its_own_draws():
    dev = [{"id": f"dev-{i:06d}", "text": f"SENTENCE {i}"} for i in range(50)][::-1]  # any order in
    plan = festival.plan(dev, None, seed=0)
    assert [u.text for u in plan] == [f"SENTENCE {i}" for i in range(50)]  # dev's order (by id)
    assert [u.source for u in plan] == [f"dev-{i:06d}" for i in range(50)]
    assert [u.id for u in plan] == [f"dev_synth-{i:06d}" for i in range(50)]
    assert all(festival.DURATION_STRETCH[0] <= u.stretch <= festival.DURATION_STRETCH[1] for u in plan)
    assert all(festival.F0_MEAN[0] <= u.f0_mean <= festival.F0_MEAN[1] for u in plan)
    assert all(synthesize.EDGE_SILENCE[0] <= e <= synthesize.EDGE_SILENCE[1] for u in plan for e in (u.lead, u.tail))
    assert len({u.stretch for u in plan}) > 10 and len({u.key for u in plan}) == 50
    assert festival.plan(dev, None, seed=0) == plan and festival.plan(dev, None, seed=1) != plan
    assert festival.plan(dev, 3, seed=0) == plan[:3]


def test_festival_is_given_the_text_espeak_is_given():
    """The normalized transcript, numbers already in words (speakable), lower case, as one sentence;
    in ASCII for Festival."""
    line = synthesize.speakable("It's 42 degrees in Montréal")
    assert line == "IT'S FORTY TWO DEGREES IN MONTRÉAL"
    assert festival.festival_text(line) == "it's forty two degrees in montreal."
    assert festival.festival_text("HELLO THERE") == synthesize.engine_text("HELLO THERE") == "hello there."


def test_without_festival_the_dev_set_is_skipped_not_failed(tmp_path, monkeypatch, capsys):
    data = tmp_path / "data"
    data.mkdir()
    (data / "dev.jsonl").write_text(json.dumps({"id": "dev-000000", "audio": "x.flac", "duration": 1.0,
                                                "text": "HELLO THERE", "speaker": "en-029"}) + "\n")
    (data / "dev_synth.jsonl").write_text("stale\n")
    # tools/festival.sh as it answers on a system without apt-get (the real one: next test)
    fake = tmp_path / "festival.sh"
    fake.write_text('echo "festival.sh: cannot fetch Festival into $2: no apt-get" >&2; exit 1\n')
    monkeypatch.setattr(festival, "FESTIVAL_SH", fake)
    assert festival.main(["dev-set", "--data", str(data), "--festival-dir", str(tmp_path / "f")]) == 0
    err = capsys.readouterr().err
    assert "the unseen-synthesizer dev set (dev_synth) is skipped: festival.sh: cannot fetch Festival" in err
    assert not (data / "dev_synth.jsonl").exists()
    assert "no apt-get" in (data / "dev_synth.skipped").read_text()
    assert festival.main(["dev-set", "--data", str(data), "--festival-dir", str(tmp_path / "f"), "--require"]) == 1
    assert "festival: error: festival.sh: cannot fetch Festival" in capsys.readouterr().err


def test_lines_are_spoken_in_one_festival_run_and_resampled_to_16_khz(tmp_path, monkeypatch):
    """speak(): one Scheme script with each line's prosody and text; a voice at another rate (here a
    fake festival writing 8 kHz tones) comes back at 16 kHz."""
    fake = tmp_path / "fake_festival.py"
    fake.write_text(
        "import re, sys\nimport numpy as np, soundfile as sf\n"
        "assert sys.argv[1:3] == ['run', 'DIR'] and sys.argv[3] == '-b'\n"
        "script = open(sys.argv[4]).read()\nopen(__file__ + '.seen', 'w').write(script)\n"
        "for n, path in enumerate(re.findall(r'\"([^\"]+\\.wav)\"', script)):\n"
        "    t = np.arange(4000 * (n + 1)) / 8000\n"
        "    sf.write(path, (8000 * np.sin(2 * np.pi * 440 * t)).astype(np.int16), 8000)\n")
    (tmp_path / "festival.sh").write_text(f'exec {sys.executable} {fake} "$@"\n')
    monkeypatch.setattr(festival, "FESTIVAL_SH", tmp_path / "festival.sh")
    lines = [festival.Line("HELLO THERE", 0.9, 95), festival.Line("IT'S TWO", 1.2, 120)]
    spoken = festival.speak(lines, Path("DIR"))
    assert [len(y) for y in spoken] == [8000, 16000]  # 0.5 s and 1 s at 16 kHz
    assert 0.6 * 8000 < np.abs(spoken[0]).max() < 1.05 * 8000
    script = (tmp_path / "fake_festival.py.seen").read_text()
    assert script.startswith("(voice_ked_diphone)\n") and script.count("(utt.save.wave") == 2
    assert "(Parameter.set 'Duration_Stretch 0.9)" in script and "(target_f0_mean 120)" in script
    assert '(SynthText "it\'s two.")' in script


@pytest.mark.parametrize("script, name", [(festival.FESTIVAL_SH, "Festival"), (flite.FLITE_SH, "Flite")])
def test_fetch_without_apt_get_says_so_in_one_line(tmp_path, script, name):
    """tools/festival.sh and tools/flite.sh (both through tools/debunpack.sh) on a system without them."""
    empty = tmp_path / "bin"  # no festival or flite, no apt-get on PATH
    empty.mkdir()
    done = subprocess.run(["/bin/bash", str(script), "fetch", str(tmp_path / "f")],
                          capture_output=True, text=True, env={"PATH": str(empty), "HOME": str(tmp_path)}, timeout=60)
    assert done.returncode == 1 and done.stdout == ""
    assert done.stderr.strip().splitlines()[-1].startswith(
        f"{name.lower()}.sh: cannot fetch {name} into {tmp_path / 'f'}: no apt-get")


@pytest.mark.slow
def test_ked_speaks_a_line_into_a_16khz_flac(tmp_path):
    """Festival fetched (tools/festival.sh: apt-get download and dpkg-deb -x into the user's cache;
    13-20 s here the first time, a network download: slow-marked for that), its ked voice speaks a
    line into a 16 kHz FLAC, and a two-line dev set."""
    try:
        folder = festival.fetch(festival.default_dir())
    except festival.FestivalError as e:
        pytest.skip(f"Festival cannot be fetched here: {e}")
    out = tmp_path / "hello.flac"
    line = "WE FOUND TWENTY ONE WINDOWS IN DETROIT"
    assert festival.main(["say", line, str(out), "--festival-dir", str(folder)]) == 0
    info = sf.info(str(out))
    assert (info.samplerate, info.channels, info.format, info.subtype) == (16000, 1, "FLAC", "PCM_16")
    samples = sf.read(str(out), dtype="int16")[0]
    assert 1.0 < len(samples) / 16000 < 6.0 and np.abs(samples).max() > 3000  # speech, not silence
    data = tmp_path / "data"
    data.mkdir()
    dev = [{"id": f"dev-{i:06d}", "audio": "x.flac", "duration": 1.0, "text": t, "speaker": "en-029"}
           for i, t in enumerate(["THANK YOU SAID HER FATHER", "IT'S SMOOTH TO PASS THE CASTLE IN JULY"])]
    (data / "dev.jsonl").write_text("".join(json.dumps(u) + "\n" for u in dev))
    assert festival.main(["dev-set", "--data", str(data), "--festival-dir", str(folder)]) == 0
    made = [json.loads(line) for line in (data / "dev_synth.jsonl").read_text().splitlines()]
    assert [u["text"] for u in made] == [u["text"] for u in dev]
    for u in made:
        assert u["speaker"] == "festival+ked_diphone"
        assert u["duration"] == sf.info(str(data / u["audio"])).frames / 16000
        samples = sf.read(str(data / u["audio"]), dtype="int16")[0]
        assert np.mean(samples == 0) < 0.03  # the noise floor, as eSpeak's dev lines have
    keys = {p: p.stat().st_mtime_ns for p in (data / "wav" / "dev_synth").glob("*.flac")}
    assert festival.main(["dev-set", "--data", str(data), "--festival-dir", str(folder)]) == 0  # kept
    assert keys == {p: p.stat().st_mtime_ns for p in (data / "wav" / "dev_synth").glob("*.flac")}


def test_learning_check_names_each_dev_set_or_why_it_is_missing(tmp_path):
    sys.path.insert(0, str(ROOT / "tools"))
    import learning_check

    (tmp_path / "dev.jsonl").write_text('{"id": "a"}\n')
    (tmp_path / "dev_near.jsonl").write_text("")  # --num-dev-near 0: nothing to decode
    (tmp_path / "dev_synth.skipped").write_text("festival.sh: cannot fetch Festival: no apt-get\n")
    sets = learning_check.dev_sets(tmp_path)
    assert list(sets) == ["dev", "dev_near", "dev_synth"] and sets["dev"] == tmp_path / "dev.jsonl"
    assert sets["dev_near"] == f"empty ({tmp_path / 'dev_near.jsonl'})"
    (tmp_path / "dev_near.jsonl").unlink()  # a corpus made before the near variants were held out
    assert learning_check.dev_sets(tmp_path)["dev_near"] == f"not made ({tmp_path} has no dev_near.jsonl)"
    assert sets["dev_synth"] == "skipped: festival.sh: cannot fetch Festival: no apt-get"


def test_learning_check_prints_each_dev_sets_scores_or_why_it_is_missing(tmp_path, capsys):
    sys.path.insert(0, str(ROOT / "tools"))
    import learning_check

    scores = {"cer": 0.1234, "wer": 0.4567, "utterances": 150}
    report = {"config": "conf/small.yaml", "overrides": ["training.seed=2"], "steps": 6000, "train_minutes": 35.0,
              "below": 0.5, "plateau_left_at": {"train": 1200, "valid": None}, "warnings": [],
              "dev_sets": {"dev": scores, "dev_near": {**scores, "wer": 0.2}, "dev_synth": {"missing": "skipped: x"}}}
    learning_check.print_report(report, 2, tmp_path / "learning_check.json")
    lines = capsys.readouterr().out.splitlines()
    assert any(line.startswith("config") and line.endswith("small.yaml training.seed=2") for line in lines)
    assert any(line.startswith("CTC < 0.5 ln V, train") and line.endswith("step 1200 (20%)") for line in lines)
    assert any(line.startswith("CTC < 0.5 ln V, dev") and line.endswith("never") for line in lines)
    assert any(line.startswith("dev (unseen accents)") and line.endswith("12.3% / 45.7%") for line in lines)
    assert any(line.startswith("dev_near (unseen voices)") and line.endswith("12.3% / 20.0%") for line in lines)
    assert any(line.startswith("dev_synth (unseen synthesizer)") and line.endswith("skipped: x") for line in lines)
    assert lines[-1] == f"report: {tmp_path / 'learning_check.json'}"


def test_choose_on_dev_decodes_apart_from_the_recipes_own_decodes(tmp_path, monkeypatch):
    """tools/choose_on_dev.py decodes each dev set at beam 10 into folders of its own: stage 5's
    decode_<set>_open (beam 40) in the same experiment is neither read nor written."""
    monkeypatch.syspath_prepend(str(ROOT / "tools"))
    import choose_on_dev

    data = tmp_path / "data"
    data.mkdir()
    for dev in choose_on_dev.DEV_SETS:
        (data / f"{dev}.jsonl").write_text("")
    exp = tmp_path / "recipe" / "exp" / "choice_base_s0"
    stage5 = exp / "decode_dev_open"
    stage5.mkdir(parents=True)
    (exp / "model_avg.pt").write_text("")
    (stage5 / "wer.json").write_text(json.dumps({"wer": 0.5}))  # beam 40: not choose_on_dev's figure
    decoded = []

    def fake_run(cmd, log):
        out = Path(cmd[cmd.index("--out-dir") + 1])
        assert cmd[cmd.index("--beam-size") + 1] == "10"
        out.mkdir(parents=True)
        (out / "wer.json").write_text(json.dumps({"wer": 0.25}))
        decoded.append(out)

    monkeypatch.setattr(choose_on_dev, "RECIPE", tmp_path / "recipe")
    monkeypatch.setattr(choose_on_dev, "ROOT", tmp_path)
    monkeypatch.setattr(choose_on_dev, "run", fake_run)
    result = choose_on_dev.one_run("base", [], 0, data, tmp_path / "log")
    assert [result[d] for d in choose_on_dev.DEV_SETS] == [25.0, 25.0, 25.0]
    assert len(decoded) == 3 and stage5 not in decoded and all(d.parent == exp for d in decoded)
    assert json.loads((stage5 / "wer.json").read_text()) == {"wer": 0.5}
    (data / "dev_near_rev.jsonl").write_text("")  # --extra-dev: decoded beside the three, the rest reused
    result = choose_on_dev.one_run("base", [], 0, data, tmp_path / "log", (*choose_on_dev.DEV_SETS, "dev_near_rev"))
    assert result["dev_near_rev"] == 25.0 and decoded[3:] == [exp / "decode_dev_near_rev_open_beam10"]


def test_learning_check_trains_from_the_audio_when_noise_or_reverberation_is_on(tmp_path, monkeypatch):
    """Dumped features would leave data.augment.noise/reverb nothing to apply to: with either on,
    no features are dumped and training is given none (the CMVN statistics are still made)."""
    sys.path.insert(0, str(ROOT / "tools"))
    import learning_check

    from asr.train_setup import load_experiment_config

    calls = []
    monkeypatch.setattr(learning_check, "run", lambda cmd, log, *a: calls.append([str(c) for c in cmd]))
    for overrides, dumped in (([], True), (["data.augment.noise.prob=0.5"], False),
                              (["data.augment.reverb.prob=0.3"], False)):
        calls.clear()
        out = tmp_path / str(len(overrides) and overrides[0])
        config = load_experiment_config(str(ROOT / "conf" / "small.yaml"), overrides)
        lang, cmvn, feats = learning_check.prepare(config, tmp_path, tmp_path / "train.jsonl", out, out / "log")
        cmvn_call = next(c for c in calls if c[1] == "cmvn")
        assert ("--dump-feats" in cmvn_call) == dumped
        assert feats == (out / "feats40" if dumped else None)


def test_learning_check_reuses_another_checks_preparation_only_when_made_the_same_way(tmp_path, monkeypatch, capsys):
    """--prepared-from DIR hard-links DIR's tokenizer, CMVN statistics and features when DIR's
    prepared.json names the same corpus and settings; otherwise they are made again, said in a line."""
    sys.path.insert(0, str(ROOT / "tools"))
    import learning_check

    from asr.train_setup import load_experiment_config

    calls = []

    def fake_run(cmd, log, *a):
        calls.append(cmd[1])
        if cmd[1] == "tokenizer":
            out = Path(cmd[cmd.index("--out") + 1])
            out.mkdir(parents=True)
            (out / "tokenizer.json").write_text("{}")
        else:
            Path(cmd[cmd.index("--out") + 1]).write_text("{}")
            Path(cmd[cmd.index("--dump-feats") + 1]).mkdir()
            (Path(cmd[cmd.index("--dump-feats") + 1]) / "a.npy").write_text("x")

    monkeypatch.setattr(learning_check, "run", fake_run)
    config = load_experiment_config(str(ROOT / "conf" / "small.yaml"), [])
    corpus, train = tmp_path / "corpus", tmp_path / "corpus" / "train.jsonl"
    first = tmp_path / "first"
    first.mkdir()
    made = learning_check.prepare(config, corpus, train, first, first / "log")
    assert calls == ["tokenizer", "cmvn"] and (first / learning_check.PREPARED).is_file()

    calls.clear()
    second = tmp_path / "second"
    second.mkdir()
    lang, cmvn, feats = learning_check.prepare(config, corpus, train, second, second / "log", reuse=first)
    assert calls == []  # nothing made again
    assert [p.name for p in (lang, cmvn, feats)] == [p.name for p in made]
    assert (feats / "a.npy").stat().st_ino == (made[2] / "a.npy").stat().st_ino  # a link, not a copy

    for other in (load_experiment_config(str(ROOT / "conf" / "small.yaml"), ["data.features.frame_shift_ms=20"]),
                  config):
        calls.clear()
        third = tmp_path / f"third{len(list(tmp_path.iterdir()))}"
        third.mkdir()
        elsewhere = tmp_path / "other" / "train.jsonl" if other is config else train
        learning_check.prepare(other, elsewhere.parent, elsewhere, third, third / "log", reuse=first)
        assert calls == ["tokenizer", "cmvn"]  # other features, or another corpus: made here
        assert "not reused" in capsys.readouterr().out


def test_choose_on_dev_compares_learning_checks_sharing_the_first_ones_preparation(tmp_path, monkeypatch):
    """--learning-check: each variant and seed one tools/learning_check.py run into OUT_ROOT/NAME_sSEED,
    every run but the first pointed at the first's folder (--prepared-from); finished ones kept."""
    monkeypatch.syspath_prepend(str(ROOT / "tools"))
    import choose_on_dev

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "train.jsonl").write_text("")
    calls = []

    def fake_run(cmd, log):
        cmd = [str(c) for c in cmd]
        calls.append(cmd)
        out = Path(cmd[cmd.index("--out") + 1])
        out.mkdir(parents=True)
        seed = int(next(c for c in cmd if c.startswith("training.seed="))[-1])
        wer = 0.5 - 0.1 * ("model.d_model=192" in cmd) + 0.01 * seed
        (out / "learning_check.json").write_text(json.dumps({"train_minutes": 2.0, "dev_sets": {
            "dev": {"wer": wer}, "dev_near": {"wer": wer / 2}, "dev_synth": {"missing": "skipped: no Festival"}}}))

    monkeypatch.setattr(choose_on_dev, "run", fake_run)
    argv = ["choose_on_dev.py", "--learning-check", str(corpus), "--out-root", str(tmp_path / "runs"),
            "--variant", "base=", "--variant", "wide=model.d_model=192", "--seeds", "0", "1",
            "--json", str(tmp_path / "choice.json")]
    monkeypatch.setattr(sys, "argv", argv)
    choose_on_dev.main()
    first = str(tmp_path / "runs" / "base_s0")
    assert [c[c.index("--out") + 1] for c in calls] == [first, *(str(tmp_path / "runs" / n) for n in
                                                                  ("wide_s0", "base_s1", "wide_s1"))]
    assert "--prepared-from" not in calls[0] and all(c[c.index("--prepared-from") + 1] == first for c in calls[1:])
    assert all(c[c.index("--data") + 1] == str(corpus) for c in calls)
    result = json.loads((tmp_path / "choice.json").read_text())["variants"]
    assert [r["dev"] for r in result["wide"]["runs"]] == pytest.approx([40.0, 41.0])
    assert [r["dev_near"] for r in result["base"]["runs"]] == pytest.approx([25.0, 25.5])
    assert all("dev_synth" not in r for r in result["base"]["runs"])
    calls.clear()
    choose_on_dev.main()  # finished: nothing run again
    assert calls == []
