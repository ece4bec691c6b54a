"""recipes/synth/local/tune.py and results.py: the LM weights chosen on dev by rescoring its beam,
the same hypotheses as `asr decode` with the LM, and the results table of stage 6."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import yaml
from test_api import write_decode_files, write_model_file

from asr.decode import decode_manifest
from asr.decoding import DecodingConfig
from asr.lm import train_ngram

LOCAL = Path(__file__).resolve().parents[1] / "recipes" / "synth" / "local"
sys.path.insert(0, str(LOCAL))

import results  # noqa: E402
import tune  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

WORDS = ["AB", "HE", "BAD", "CAFE", "FACE", "BEAD", "HEAD", "DEAF", "ACE", "BE"]
SEARCH = {"beam_size": 6, "ctc_weight": 0.3, "batch_size": 2, "num_workers": 0, "device": "cpu"}


def hyps(folder: Path) -> dict[str, str]:
    return dict((line.split(" ", 1) + [""])[:2] for line in (folder / "hyp.txt").read_text().splitlines())


@pytest.fixture(scope="module")
def decoded(tmp_path_factory) -> dict[str, Path]:
    """A random tiny model, 4 utterances, a word list and an LM that likes BE; the
    lexicon's decode with the whole beam kept, and `asr decode`'s with the LM (weight 10, bonus 1)."""
    folder = tmp_path_factory.mktemp("tune")
    model = write_decode_files(folder)
    (folder / "words.txt").write_text("\n".join(WORDS) + "\n")
    train_ngram([["FACE", "BE", "BE"], ["BE", "BE", "BE"], ["BE"]] * 5 + [[w] for w in WORDS]).save(folder / "lm.arpa")
    lexicon = DecodingConfig(**SEARCH, lexicon=str(folder / "words.txt"), nbest=SEARCH["beam_size"])
    decode_manifest(model, folder / "test.jsonl", folder / "lexicon", lexicon)
    with_lm = DecodingConfig(**SEARCH, lexicon=str(folder / "words.txt"), lm=str(folder / "lm.arpa"), lm_weight=10.0,
                             lm_word_bonus=1.0)
    decode_manifest(model, folder / "test.jsonl", folder / "lm", with_lm)
    config = folder / "decode.yaml"
    config.write_text(yaml.safe_dump({**SEARCH, "lm_weight": 10.0, "lm_word_bonus": 1.0}))
    return {"folder": folder, "manifest": folder / "test.jsonl", "config": config}


def test_rescoring_the_kept_beam_gives_what_decoding_with_the_lm_gives(decoded):
    folder = decoded["folder"]
    assert tune.main(["rescore", "--beam", str(folder / "lexicon"), "--manifest", str(decoded["manifest"]),
                      "--lm", str(folder / "lm.arpa"), "--config", str(decoded["config"]),
                      "--out-dir", str(folder / "rescored")]) == 0
    rescored, with_lm, lexicon = hyps(folder / "rescored"), hyps(folder / "lm"), hyps(folder / "lexicon")
    assert rescored == with_lm and all(rescored.values())  # non-empty, lexicon words
    assert all(set(h.split()) <= set(WORDS) for h in rescored.values())
    assert rescored != lexicon  # the LM changed something: the comparison is not vacuous
    # the same wer.json, the decoding settings included (the lexicon from the beam's journal)
    assert (folder / "rescored" / "wer.json").read_text() == (folder / "lm" / "wer.json").read_text()
    assert (folder / "rescored" / "ref.txt").read_text() == (folder / "lm" / "ref.txt").read_text()


def test_choose_takes_the_grid_point_of_the_lowest_dev_wer(decoded, tmp_path, capsys):
    folder = decoded["folder"]
    # references made to be what the LM at weight 10, bonus 1 writes: that point scores 0%
    lines = [json.loads(line) for line in decoded["manifest"].read_text().splitlines()]
    target = hyps(folder / "lm")
    for line in lines:
        line["text"] = target[line["id"]]
        line["audio"] = str(folder / line["audio"])
    manifest = tmp_path / "dev.jsonl"
    manifest.write_text("".join(json.dumps(line) + "\n" for line in lines))
    out = tmp_path / "decode.yaml"
    assert tune.main(["choose", "--beam", str(folder / "lexicon"), "--manifest", str(manifest), "--lm",
                      str(folder / "lm.arpa"), "--config", str(decoded["config"]), "--out", str(out),
                      "--weights", "0,10", "--bonuses", "1"]) == 0
    chosen = yaml.safe_load(out.read_text())
    assert (chosen["lm_weight"], chosen["lm_word_bonus"]) == (10.0, 1.0)
    assert chosen["beam_size"] == 6 and "lm" not in chosen and "lexicon" not in chosen  # the rest from --config
    grid = json.loads((tmp_path / "tune.json").read_text())["grid"]
    assert [(g["lm_weight"], g["wer"] == 0.0) for g in grid] == [(0.0, False), (10.0, True)]
    assert "chose lm_weight 10.0, lm_word_bonus 1.0 on dev: WER 0.00%" in capsys.readouterr().out
    # --then: the chosen values applied to other beams in the same run, as `rescore` would
    assert tune.main(["choose", "--beam", str(folder / "lexicon"), "--manifest", str(manifest), "--lm",
                      str(folder / "lm.arpa"), "--config", str(decoded["config"]), "--out", str(out),
                      "--weights", "0,10", "--bonuses", "1", "--then", str(folder / "lexicon"),
                      str(decoded["manifest"]), str(tmp_path / "then")]) == 0
    assert hyps(tmp_path / "then") == hyps(folder / "lm")


def test_an_open_vocabulary_beam_is_rescored_as_decoding_it_with_the_lm(decoded, tmp_path):
    """No lexicon: `choose` on the open beam (at a beam other than --config's) writes a config of that
    beam's size, and its hypotheses are `asr decode`'s with that config and the LM."""
    folder = decoded["folder"]
    open_search = {**SEARCH, "beam_size": 4}
    decode_manifest(folder / "model.pt", decoded["manifest"], tmp_path / "open",
                    DecodingConfig(**open_search, nbest=4))
    # an LM that knows each utterance's last hypothesis (the random model's words are no lexicon's)
    records = [json.loads(line) for line in (tmp_path / "open" / "decode.jsonl").read_text().splitlines()[1:]]
    lm = tmp_path / "lm.arpa"
    train_ngram([r["nbest"][-1]["text"].split() for r in records] * 5).save(lm)
    out = tmp_path / "decode_open_lm.yaml"
    assert tune.main(["choose", "--beam", str(tmp_path / "open"), "--manifest", str(decoded["manifest"]),
                      "--lm", str(lm), "--config", str(decoded["config"]), "--out", str(out),
                      "--weights", "10", "--bonuses", "1",
                      "--then", str(tmp_path / "open"), str(decoded["manifest"]), str(tmp_path / "open_lm")]) == 0
    chosen = yaml.safe_load(out.read_text())
    assert (chosen["beam_size"], chosen["lm_weight"]) == (4, 10.0) and "lexicon" not in chosen
    assert json.loads((tmp_path / "tune.json").read_text())["beam"] == str(tmp_path / "open")
    with_lm = DecodingConfig(**{**open_search, "lm_weight": chosen["lm_weight"],
                                "lm_word_bonus": chosen["lm_word_bonus"]}, lm=str(lm))
    decode_manifest(folder / "model.pt", decoded["manifest"], tmp_path / "decoded_lm", with_lm)
    rescored = hyps(tmp_path / "open_lm")
    assert rescored == hyps(tmp_path / "decoded_lm") and all(rescored.values())
    assert rescored != hyps(tmp_path / "open")  # the LM changed something: the comparison is not vacuous


def test_fusion_grid_gives_each_points_decode_and_its_mean_over_models(decoded, tmp_path, capsys):
    """`fusion` decodes dev open vocabulary with the LM inside the search at every weight x bonus, by
    each model: each point's WERs are `asr decode`'s with that fusion, their mean orders the grid."""
    folder = decoded["folder"]
    second = write_model_file(tmp_path / "second.pt", seed=1, eos_bias=0.0)
    models = [folder / "model.pt", second]
    assert tune.main(["fusion", "--model", *map(str, models), "--manifest", str(decoded["manifest"]),
                      "--lm", str(folder / "lm.arpa"), "--config", str(decoded["config"]),
                      "--out-dir", str(tmp_path / "grid"), "--weights", "0,10", "--bonuses", "1"]) == 0
    grid = json.loads((tmp_path / "grid" / "fusion.json").read_text())["grid"]
    assert [g["wer"] for g in grid] == sorted(g["wer"] for g in grid) and len(grid) == 2
    texts = {}
    for g in grid:
        fused = DecodingConfig(**{**SEARCH, "lm_weight": g["lm_weight"], "lm_word_bonus": g["lm_word_bonus"]},
                               lm=str(folder / "lm.arpa"), lm_fusion=True)
        wers = []
        for number, model in enumerate(models):
            out = tmp_path / f"check{number}_{g['lm_weight']}"
            wers.append(decode_manifest(model, decoded["manifest"], out, fused)["wer"])
            texts[number, g["lm_weight"]] = hyps(out)
            in_grid = tmp_path / "grid" / f"{number}_weight{g['lm_weight']}_bonus1.0"
            assert hyps(in_grid) == texts[number, g["lm_weight"]]
        assert g["wers"] == wers and g["wer"] == pytest.approx(sum(wers) / 2)
    assert texts[0, 0.0] != texts[0, 10.0] and texts[0, 10.0] != texts[1, 10.0]  # the LM and the model matter
    assert "lm_weight" in capsys.readouterr().out


def test_search_grid_decodes_with_the_lexicon_at_each_point(decoded, tmp_path):
    folder = decoded["folder"]
    assert tune.main(["search", "--model", str(folder / "model.pt"), "--manifest", str(decoded["manifest"]),
                      "--lexicon", str(folder / "words.txt"), "--config", str(decoded["config"]),
                      "--out-dir", str(tmp_path), "--ctc-weights", "0.3", "--length-bonuses", "0,1"]) == 0
    grid = json.loads((tmp_path / "search.json").read_text())["grid"]
    assert sorted((g["ctc_weight"], g["length_bonus"]) for g in grid) == [(0.3, 0.0), (0.3, 1.0)]
    for g in grid:
        texts = hyps(tmp_path / f"0_weight0.3_bonus{g['length_bonus']}")
        assert all(texts.values()) and all(set(h.split()) <= set(WORDS) for h in texts.values())


def test_a_beam_decoded_without_the_whole_beam_or_with_an_lm_is_refused(decoded, capsys):
    folder = decoded["folder"]
    assert tune.main(["choose", "--beam", str(folder / "lm"), "--manifest", str(decoded["manifest"]), "--lm",
                      str(folder / "lm.arpa"), "--config", str(decoded["config"]),
                      "--out", str(folder / "x.yaml")]) == 1
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "decode.jsonl: decoded with an LM or without the whole beam" in err


def test_results_table_gives_dev_beside_test_per_accent(tmp_path):
    data, exp = tmp_path / "data", tmp_path / "exp"
    data.mkdir()
    for s, accents in (("dev", ("en-029", "en-gb-x-gbcwmd")), ("test", ("en-gb-scotland", "en-us-nyc")),
                       ("dev_near", ("en-us", "en"))):
        lines = [{"id": f"{s}-{i}", "audio": "x.flac", "duration": 1.0, "text": "A B",
                  "speaker": f"{accents[i % 2]}+m1"} for i in range(4)]
        (data / f"{s}.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
        for suffix, wrong in (("_open", 2), ("_lexicon", 1)):  # no LM decode: named, not guessed
            folder = exp / f"decode_{s}{suffix}"
            folder.mkdir(parents=True)
            (folder / "ref.txt").write_text("".join(f"{s}-{i} A B\n" for i in range(4)))
            (folder / "hyp.txt").write_text("".join(f"{s}-{i} A {'C' if i < wrong else 'B'}\n" for i in range(4)))
    got = results.collect(exp, data)
    assert got["decodes"]["open"]["test"]["all"]["wer"] == 2 / 8
    assert got["decodes"]["open"]["test"]["en-gb-scotland"]["wer"] == 1 / 4  # test-0 (scotland), test-1 (nyc)
    assert got["decodes"]["lexicon"]["dev"]["en-029"]["wer"] == 1 / 4
    assert got["decodes"]["lexicon+lm"]["dev"] is None and got["decodes"]["open+lm"]["dev"] is None
    table = results.markdown(got)
    assert "| open vocabulary (no lexicon, no LM) | 25.00% /" in table and "not decoded" in table
    assert "| open vocabulary with the word LM in the search (weights chosen on dev) | not decoded" in table
    # the three dev sets side by side, then test: dev_near decoded, dev_synth not made
    header = table.splitlines()[0]
    assert header.index("dev: unseen accents") < header.index("dev_near: unseen voices") < header.index(
        "dev_synth: unseen synthesizer") < header.index("| test WER")
    assert got["sets"] == {"dev": "made", "dev_near": "made", "dev_synth": "not made", "test": "made"}
    assert got["decodes"]["open"]["dev_near"]["all"]["wer"] == 2 / 8 and got["decodes"]["open"]["dev_synth"] is None
    row = next(line for line in table.splitlines() if line.startswith("| open vocabulary"))
    assert row.split(" | ")[2:4] == ["25.00% / 16.67%", "not made"]  # 2 of 8 words, 2 of 12 characters
    # Festival unavailable: the set is named as skipped, with the reason stage 0 recorded
    (data / "dev_synth.skipped").write_text("festival.sh: cannot fetch Festival: no apt-get\n")
    got = results.collect(exp, data)
    assert got["sets"]["dev_synth"] == "skipped: festival.sh: cannot fetch Festival: no apt-get"
    assert "| skipped |" in results.markdown(got) and "dev_synth skipped: festival.sh" in results.markdown(got)
    # the LM weights of the open search (its wer.json's) and those chosen on the lexicon's beam, each named
    (exp / "tune.json").write_text(json.dumps({"chosen": {"lm_weight": 0.3, "lm_word_bonus": 1.5}, "dev_wer": 0.2}))
    (exp / "decode_dev_open_lm").mkdir()
    (exp / "decode_dev_open_lm" / "wer.json").write_text(json.dumps(
        {"wer": 0.2, "decoding": {"lm_weight": 0.4, "lm_word_bonus": 2.5, "lm_fusion": True}}))
    table = results.markdown(results.collect(exp, data))
    assert ("open vocabulary with the LM: weight 0.4 and word bonus 2.5 (conf/decode/synth_open_lm.yaml, chosen "
            "on dev over three training seeds); with the lexicon: LM weight 0.3 and word bonus 1.5 chosen on "
            "dev's beam (20.00%)") in table
