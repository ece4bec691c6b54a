"""Word n-gram language models: Kneser-Ney estimates that are distributions and match the
interpolated formula computed from the counts directly, ARPA files that read back to the same
scores (and hand-written ones that back off as the format says), clear errors for bad files, and
n-best rescoring that picks exactly the best search score + weight * LM score of the beam."""
from __future__ import annotations

import gzip
import json
import math
import os
import subprocess
import sys
from collections import Counter

import pytest
import torch
from test_api import write_decode_files

from asr.api import load_model
from asr.audio import load_audio
from asr.decode import decode_manifest
from asr.decoding import DecodingConfig, DecodingOptions, DecodingTask
from asr.lm import BOS, EOS, UNK, LMError, NgramLM, WordLMScorer, rescore, train_ngram
from asr.metrics import normalize_text
from asr.scorer import Selection
from asr.search import length_limits, teacher_forced_scores

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

CORPUS = [s.split() for s in [
    "WE WILL GO HOME", "WE WILL COOK", "THEY WILL GO OUT", "WE WERE HOME", "I WILL COOK AT HOME",
    "GO HOME", "WE", "THEY WERE OUT AT HOME",
]]
CONTEXTS = [(), (BOS,), ("WE",), (BOS, "WE"), ("WE", "WILL"), ("WILL", "GO"), ("NEVER", "SEEN"), ("HOME",),
            (BOS, "GO", "HOME"), ("WILL", "COOK", "AT")]


def vocabulary(lm: NgramLM) -> list[str]:
    return [w for (w,) in lm.probs[0] if w != BOS]


@pytest.mark.parametrize("order", [1, 2, 3, 4])
def test_every_context_gives_a_distribution(order):
    lm = train_ngram(CORPUS, order)
    words = vocabulary(lm)
    assert set(words) == {w for s in CORPUS for w in s} | {EOS, UNK}
    for context in CONTEXTS:
        assert sum(10 ** lm.log10_prob(context, w) for w in words) == pytest.approx(1.0, abs=1e-9), context


def reference_kneser_ney(sentences, order):
    """Interpolated Kneser-Ney straight from its definition, recursively (no backoff form)."""
    grams = Counter()
    for s in sentences:
        seq = (BOS, *s, EOS)
        for i in range(1, len(seq)):
            for k in range(1, min(order, i + 1) + 1):
                grams[seq[i - k + 1:i + 1]] += 1

    def count(gram):  # raw at the top order and after <s>; else distinct left words
        if len(gram) == order or gram[0] == BOS:
            return grams[gram]
        return sum(1 for g in grams if len(g) == len(gram) + 1 and g[1:] == gram)

    by_order = [{g: count(g) for g in grams if len(g) == k} for k in range(1, order + 1)]

    def discount(k):
        n1 = sum(1 for c in by_order[k - 1].values() if c == 1)
        n2 = sum(1 for c in by_order[k - 1].values() if c == 2)
        return min(max(n1 / (n1 + 2 * n2), 0.05), 0.95)

    vocab = {g[0] for g in by_order[0]} | {UNK}

    def prob(context, word):
        k = len(context) + 1
        table = {g: c for g, c in by_order[k - 1].items() if g[:-1] == context}
        if k == 1:
            total, d = sum(table.values()), discount(1)
            return max(table.get((word,), 0) - d, 0) / total + d * len(table) / total / len(vocab)
        lower = prob(context[1:], word)
        if not table:
            return lower
        total, d = sum(table.values()), discount(k)
        return max(table.get(context + (word,), 0) - d, 0) / total + d * len(table) / total * lower

    return prob, vocab


@pytest.mark.parametrize("order", [2, 3])
def test_the_backoff_form_is_the_interpolated_model(order):
    lm = train_ngram(CORPUS, order)
    prob, vocab = reference_kneser_ney(CORPUS, order)
    for context in CONTEXTS:
        context = context[len(context) - order + 1:]
        for word in vocab:
            assert 10 ** lm.log10_prob(context, word) == pytest.approx(prob(context, word), rel=1e-9), (context, word)


def test_a_unigram_model_by_hand():
    """Counts A 2, B 1, </s> 3: D = n1 / (n1 + 2 n2) = 1/3, total 6, 3 words seen, 4 in the vocabulary."""
    lm = train_ngram([["A"], ["A"], ["B"]], order=1)
    share = (1 / 3) * 3 / 6 / 4
    assert 10 ** lm.log10_prob((), "A") == pytest.approx((2 - 1 / 3) / 6 + share)
    assert 10 ** lm.log10_prob((), "ZEBRA") == pytest.approx(share)  # as <unk>
    assert lm.score(["A"]) == pytest.approx(math.log((5 / 3) / 6 + share) + math.log((3 - 1 / 3) / 6 + share))


def test_perplexity_is_per_predicted_word_end_included():
    lm = train_ngram(CORPUS, 2)
    sents = [["WE", "WILL", "GO"], ["HOME"]]
    want = math.exp(-(lm.score(sents[0]) + lm.score(sents[1])) / (4 + 2))
    assert lm.perplexity(sents) == pytest.approx(want)
    assert lm.perplexity(CORPUS) < lm.perplexity([s[::-1] for s in CORPUS])


@pytest.mark.parametrize("name", ["lm.arpa", "lm.arpa.gz"])
def test_arpa_files_read_back_to_the_same_scores(tmp_path, name):
    lm = train_ngram(CORPUS, 3)
    lm.save(tmp_path / name)
    raw = (tmp_path / name).read_bytes()
    text = (gzip.decompress(raw) if name.endswith(".gz") else raw).decode()
    assert text.startswith("\\data\\\nngram 1=") and text.rstrip().endswith("\\end\\")
    again = NgramLM.load(tmp_path / name)
    assert (again.order, again.vocab_size) == (3, lm.vocab_size)
    for s in [*CORPUS, ["WE", "WILL", "SWIM"], [], ["HOME", "HOME", "HOME"]]:
        assert again.score(s) == pytest.approx(lm.score(s), abs=1e-4)
    assert lm.score(["WE", "WILL", "GO", "HOME"]) > lm.score(["WE", "WERE", "GO", "HOME"])


HAND_WRITTEN = """made by hand, as lmplz writes them (lower case)

\\data\\
ngram 1=5
ngram 2=2

\\1-grams:
-1.0\t<s>\t-0.5
-0.5\t</s>
-0.7\tthe\t-0.3
-1.2\tcat
-0.9\tdon't

\\2-grams:
-0.2\t<s> the
-0.4\tthe cat

\\end\\
"""


def test_a_hand_written_arpa_backs_off_as_the_format_says(tmp_path):
    (tmp_path / "lm.arpa").write_text(HAND_WRITTEN)
    lm = NgramLM.load(tmp_path / "lm.arpa")
    ln10 = math.log(10)
    assert lm.score(["THE", "CAT"]) == pytest.approx((-0.2 - 0.4 - 0.5) * ln10)  # seen bigrams, </s> unigram
    assert lm.score(["CAT", "THE"]) == pytest.approx((-0.5 - 1.2 - 0.7 - 0.3 - 0.5) * ln10)  # backoffs
    assert lm.score(["DON'T"]) == pytest.approx((-0.5 - 0.9 - 0.5) * ln10)  # words normalized
    assert lm.score(["DOG"]) == pytest.approx((-0.5 - 1.2 - 0.5) * ln10)  # no <unk>: the rarest word


WITH_UNK = (HAND_WRITTEN.replace("ngram 1=5", "ngram 1=6").replace("ngram 2=2", "ngram 2=3")
            .replace("-1.2\tcat\n", "-1.2\tcat\n-1.5\t<UNK>\t-0.2\n")  # markers in any case
            .replace("-0.4\tthe cat\n", "-0.4\tthe cat\n-0.1\t<unk> cat\n"))


def test_unknown_words_read_as_unk_in_the_context_too(tmp_path):
    (tmp_path / "lm.arpa").write_text(WITH_UNK)
    lm = NgramLM.load(tmp_path / "lm.arpa")
    assert lm.log10_prob(["ZZZ"], "CAT") == pytest.approx(-0.1)  # the <unk> bigram, not CAT's unigram
    assert lm.log10_prob(["THE"], "ZZZ") == pytest.approx(-0.3 - 1.5)
    assert lm.score(["ZZZ", "CAT"]) == pytest.approx((-0.5 - 1.5 - 0.1 - 0.5) * math.log(10))


def test_spellings_that_normalize_alike_add_and_a_bom_is_allowed(tmp_path):
    text = HAND_WRITTEN.replace("-1.2\tcat\n", "-1.2\tcat\n-0.9\tThe\n").replace("ngram 1=5", "ngram 1=6")
    (tmp_path / "lm.arpa").write_bytes(b"\xef\xbb\xbf" + text.encode())
    lm = NgramLM.load(tmp_path / "lm.arpa")
    assert 10 ** lm.log10_prob([], "THE") == pytest.approx(10 ** -0.7 + 10 ** -0.9)
    assert lm.log10_prob(["THE"], "CAT") == pytest.approx(-0.4)
    assert lm.log10_prob(["THE"], "DON'T") == pytest.approx(-0.3 - 0.9)  # the first line's backoff


@pytest.mark.parametrize("text, message", [
    ("\\data\\\nngram 1=1\n\n\\1-grams:\n-0.5 </s>\n", "not an ARPA file"),
    ("\\end\\\n\\data\\\nngram 1=1\n\n\\1-grams:\n-0.5 </s>\n", "not an ARPA file"),
    ("\\data\\\nngram 1=2\n\n\\1-grams:\n-0.5 </s>\nhalf a</s>\n\\end\\\n", "lm.arpa:6: not a number"),
    ("\\data\\\nngram 1=1\n\n\\1-grams:\n-0.5 </s> a b c\n\\end\\\n", "lm.arpa:5: a 1-gram line needs"),
    ("\\data\\\nngram 1=1\nngram two\n", "lm.arpa:3: expected 'ngram N=COUNT'"),
    ("\\data\\\nngram 1=1\n\n\\2-grams:\n", "lm.arpa:4: \\\\2-grams: out of order"),
    ("\\data\\\nngram 1=1\n\n\\1-grams:\n-0.5 </s>\n-1.0 a\n\\end\\\n", "declares 1 1-grams, the file has more"),
    ("\\data\\\nngram 1=1\n\n\\1-grams:\n-1.0 a\n\\end\\\n", "lm.arpa: an n-gram model needs unigrams, </s>"),
    ("\\data\\\nngram 1=1\n\n\\1-grams:\n-inf </s>\n\\end\\\n", "lm.arpa:5: not a finite number"),
])
def test_a_bad_arpa_file_is_named_with_its_line(tmp_path, text, message):
    (tmp_path / "lm.arpa").write_text(text)
    with pytest.raises(LMError, match=message):
        NgramLM.load(tmp_path / "lm.arpa")


def test_arpa_errors_name_the_file(tmp_path):
    """Every problem is an LMError naming the file and the line (int()'s 4,300-digit limit, an
    overflow and a math domain error among them before); spellings that normalize alike add their
    probabilities without overflow or underflow; reading stops at \\end\\, and the work is bounded
    by what the file declares: a gzip file of 64 MiB of blank lines (65 kB on disk) is refused
    after 10,000 of them, and a 100,000-character line is not read whole."""
    head = "\\data\\\nngram 1=3\n\n\\1-grams:\n-1 </s>\n"
    cases = {
        "overflow.arpa": (head + "400 a\n400 A\n\\end\\\n", ":6: log10 probability 400 is above 0"),
        "digits.arpa": (f"\\data\\\nngram 1={'9' * 4301}\n", ":2: an n-gram count of 4,301 digits"),
        "order.arpa": (f"\\data\\\nngram {'1' * 4301}=1\n", ":2: an n-gram order of 4,301 digits"),
        "section.arpa": (f"\\data\\\nngram 1=1\n\\{'1' * 4301}-grams:\n", ":3: an n-gram order of 4,301 digits"),
        "high.arpa": ("\\data\\\nngram 1000=1\n", ":2: n-gram order 1000: this reader takes orders 1 to 100"),
        "more.arpa": (head + "-1 a\n-1 b\n-1 c\n" + "-1 d\n" * 1000 + "\\end\\\n",
                      ":8: \\data\\ declares 3 1-grams, the file has more"),
        "long.arpa": (head + "-1 " + "a" * 200_000 + "\n", ":6: a line of over 100,000 characters"),
    }
    for name, (text, reason) in cases.items():
        (tmp_path / name).write_text(text)
        with pytest.raises(LMError) as err:
            NgramLM.load(tmp_path / name)
        assert str(err.value).startswith(f"{tmp_path / name}:") and reason in str(err.value), str(err.value)
        assert "\n" not in str(err.value)
    (tmp_path / "tiny.arpa").write_text(head + "-400 a\n-400 A\n\\end\\\n")  # 10^-400: 0 as a float
    assert NgramLM.load(tmp_path / "tiny.arpa").log10_prob([], "A") == pytest.approx(-400 + math.log10(2))

    with gzip.open(tmp_path / "blank.arpa.gz", "wb") as f:
        f.write(head.encode() + b"-1 a\n-1 b\n")
        for _ in range(64):
            f.write(b"\n" * 2**20)
        f.write(b"\\end\\\n")
    assert (tmp_path / "blank.arpa.gz").stat().st_size < 100_000
    with pytest.raises(LMError, match=r"blank\.arpa\.gz:10007: more than 10,000 blank or comment lines"):
        NgramLM.load(tmp_path / "blank.arpa.gz")
    with gzip.open(tmp_path / "tail.arpa.gz", "wb") as f:  # after \end\: never read, to its cut end
        f.write(head.encode() + b"-1 a\n-1 b\n\\end\\\n" + b"junk\n" * 2**24)
    (tmp_path / "tail.arpa.gz").write_bytes((tmp_path / "tail.arpa.gz").read_bytes()[:-100])
    assert NgramLM.load(tmp_path / "tail.arpa.gz").vocab_size == 2


def test_a_cut_gzip_file_is_named(tmp_path):
    train_ngram(CORPUS, 2).save(tmp_path / "lm.arpa.gz")
    raw = (tmp_path / "lm.arpa.gz").read_bytes()
    (tmp_path / "cut.arpa.gz").write_bytes(raw[:len(raw) // 2])
    with pytest.raises(LMError, match="cut.arpa.gz: cannot read the language model"):
        NgramLM.load(tmp_path / "cut.arpa.gz")
    (tmp_path / "plain.arpa.gz").write_bytes(b"not gzip at all\n")
    with pytest.raises(LMError, match="plain.arpa.gz: cannot read the language model"):
        NgramLM.load(tmp_path / "plain.arpa.gz")


def test_bad_training_input_and_a_missing_file():
    with pytest.raises(LMError, match="no words"):
        train_ngram([[], []])
    with pytest.raises(LMError, match="order 0"):
        train_ngram(CORPUS, 0)
    with pytest.raises(LMError, match="nowhere.arpa: cannot read the language model"):
        NgramLM.load("nowhere.arpa")


def test_rescore_orders_by_the_sum_and_keeps_ties_in_search_order():
    lm = train_ngram(CORPUS, 3)
    nbest = [(["WE", "WERE", "COOK"], -1.0), (["WE", "WILL", "COOK"], -1.5), (["WE", "WILL", "COOK"], -1.5)]
    assert [i for i, _ in rescore(nbest, lm, 0.0, 3)] == [0, 1, 2]
    best = rescore(nbest, lm, 1.0, 2)
    assert [i for i, _ in best] == [1, 2]
    assert best[0][1] == pytest.approx(-1.5 + lm.score(["WE", "WILL", "COOK"]))


def test_the_word_bonus_adds_per_word_and_can_keep_a_word_the_lm_would_drop():
    lm = train_ngram(CORPUS, 3)
    nbest = [(["WE", "COOK"], -1.0), (["WE", "WILL", "COOK"], -1.0)]
    cost = lm.score(["WE", "COOK"]) - lm.score(["WE", "WILL", "COOK"])  # what WILL costs in ln P
    assert [i for i, _ in rescore(nbest, lm, 1.0, 2)] == ([0, 1] if cost > 0 else [1, 0])
    bonus = abs(cost) + 0.5  # enough to outweigh one word's cost either way
    best = rescore(nbest, lm, 1.0, 2, word_bonus=bonus)
    assert [i for i, _ in best] == [1, 0]
    assert best[0][1] == pytest.approx(-1.0 + lm.score(["WE", "WILL", "COOK"]) + 3 * bonus)
    assert best[1][1] == pytest.approx(-1.0 + lm.score(["WE", "COOK"]) + 2 * bonus)
    assert rescore([([], -2.0)], lm, 0.5, 1, word_bonus=7.0) == [(0, pytest.approx(-2.0 + 0.5 * lm.score([])))]


def test_lm_options_are_validated():
    with pytest.raises(ValueError, match="decoding.lm = 'lm.arpa' applies to beam search"):
        DecodingOptions(mode="ctc_greedy", lm="lm.arpa")
    with pytest.raises(ValueError, match="decoding.lm_weight = -0.1 must be finite and >= 0"):
        DecodingOptions(mode="attention", lm="lm.arpa", lm_weight=-0.1)
    with pytest.raises(ValueError, match="decoding.lm_fusion = True needs decoding.lm"):
        DecodingOptions(mode="attention", lm_fusion=True)
    with pytest.raises(ValueError, match="decoding.lm_word_bonus = nan must be finite"):
        DecodingOptions(mode="attention", lm="lm.arpa", lm_word_bonus=float("nan"))
    assert DecodingOptions(mode="attention", lm="lm.arpa", lm_word_bonus=-0.5).lm_word_bonus == -0.5  # a penalty
    assert DecodingOptions(mode="attention", lm_word_bonus=1.0).lm == ""  # unused without an LM, as lm_weight


@pytest.mark.parametrize("weight, bonus", [(1.0, 0.0), (0.4, 1.5)])
def test_the_fused_lm_adds_the_sentence_score_word_by_word(weight, bonus):
    """Scored token by token as a PartialScorer, a hypothesis that ends with eos gets exactly
    weight * lm.score(words) + bonus * len(words), however its words are split into pieces (a bare
    separator piece included): what rescoring adds."""
    lm = train_ngram(CORPUS, 3)
    pieces = [None, None, "\u2581WE", "\u2581W", "ILL", "\u2581", "GO", "\u2581COOK", "ED", None]
    eos = len(pieces) - 1
    scorer = WordLMScorer(lm, pieces, eos=eos, weight=weight, word_bonus=bonus)
    for tokens, words in [([2, 3, 4, 5, 6], ["WE", "WILL", "GO"]), ([7, 8, 2], ["COOKED", "WE"]), ([], [])]:
        state = scorer.init_state(torch.zeros(1, 3, 4), torch.tensor([3]), 2)  # 2 rows: row 1 is a bystander
        total = 0.0
        for token in [*tokens, eos]:
            candidates = torch.tensor([[token, eos], [token, eos]])
            scores, state = scorer.score_partial(state, candidates)
            assert scores[0].tolist() == scores[1].tolist()  # rows in the same state score alike
            assert scores[0, 1] == 0.0  # eos: ending is final_score's
            if token == eos:
                total += scorer.final_score(state)[0].item()
            else:
                total += scores[0, 0].item()
                state = scorer.select_state(state, Selection.of(torch.tensor([1, 0]), torch.tensor([token, token]), 2))
        assert total == pytest.approx(weight * lm.score(words) + bonus * len(words), abs=1e-5)
        expected = rescore([(words, 0.0)], lm, weight, 1, word_bonus=bonus)[0][1]
        assert total == pytest.approx(expected, abs=1e-5)


def test_fused_decoding_scores_each_hypothesis_with_its_sentence_probability(files):
    """Attention-only beam search with the LM fused: every hypothesis that ended with eos scores
    its decoder score plus weight x ln P_LM(words, </s>) (one cut at the length limit is not
    charged the decoder's eos); weight 0 decodes as without the LM; the LM changes choices."""
    model, folder = files
    recognizer, lm_file = load_model(model), str(folder / "lm.arpa")
    lm = NgramLM.load(lm_file)
    feats = [recognizer.feats(load_audio(folder / f"u{i}.wav")) for i in range(4)]
    beam = dict(mode="attention", beam_size=6, ctc_weight=0.0, nbest=3, max_len_ratio=0.5)
    plain = recognizer.decode(feats, DecodingOptions(**beam))
    same = recognizer.decode(feats, DecodingOptions(**beam, lm=lm_file, lm_weight=0.0, lm_fusion=True))
    assert [[h.tokens for h in n] for n in same] == [[h.tokens for h in n] for n in plain]
    changed = checked = 0
    for weight, bonus in ((0.5, 0.0), (3.0, 0.0), (0.5, 2.0)):
        fused = recognizer.decode(feats, DecodingOptions(**beam, lm=lm_file, lm_weight=weight, lm_word_bonus=bonus,
                                                       lm_fusion=True))
        for f, nbest, p in zip(feats, fused, plain):
            fused_best = nbest[0]
            memory, memory_lens = recognizer.model.encoder(f[None], torch.tensor([f.size(0)]))
            limit = int(length_limits(recognizer.model, memory_lens, 0.5, 2.0)[0])
            nbest = [h for h in nbest if len(h.tokens) < limit]  # ended with eos
            checked += len(nbest)
            if not nbest:
                continue
            width = max(len(h.tokens) for h in nbest)
            tokens = torch.tensor([[list(h.tokens) + [-1] * (width - len(h.tokens)) for h in nbest]])
            decoder = teacher_forced_scores(recognizer.model, memory, memory_lens, tokens,
                                            torch.tensor([[len(h.tokens) for h in nbest]]))[0]
            for h, att in zip(nbest, decoder.tolist()):
                words = normalize_text(recognizer.text(h.tokens)).split()
                assert h.score == pytest.approx(att + weight * lm.score(words) + bonus * len(words), abs=1e-4)
            changed += fused_best.tokens != p[0].tokens
    assert changed >= 1 and checked >= 8
    with pytest.raises(ValueError, match="and the loaded LM go together"):
        DecodingTask(recognizer.model, recognizer.tokenizer,
                     DecodingOptions(**beam, lm=lm_file, lm_weight=0.5, lm_fusion=True))


# --- from the outside: asr lm / decode / transcribe -------------------------------------------

WORDS = ["AB", "BAD", "CAFE", "HE", "EGG", "FADE", "A", "GH"]  # letters A-H, the test model's tokens


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("lm")
    model = write_decode_files(folder)
    train_ngram([["BAD", "CAFE"], ["HE", "AB"], ["FADE", "EGG", "A"], ["AB", "AB", "GH"]], 2).save(folder / "lm.arpa")
    return model, folder


def test_rescored_decoding_picks_the_best_sum_of_the_beam(files):
    model, folder = files
    recognizer = load_model(model)
    lm = NgramLM.load(folder / "lm.arpa")
    feats = [recognizer.feats(load_audio(folder / f"u{i}.wav")) for i in range(4)]
    beam = DecodingOptions(mode="attention", beam_size=6, ctc_weight=0.3, nbest=6)
    plain = recognizer.decode(feats, beam)
    changed = 0
    for weight, bonus in ((0.0, 0.0), (0.5, 0.0), (3.0, 0.0), (0.5, 3.0)):
        rescored = recognizer.decode(feats, DecodingOptions(mode="attention", beam_size=6, ctc_weight=0.3, nbest=2,
                                                          lm=str(folder / "lm.arpa"), lm_weight=weight,
                                                          lm_word_bonus=bonus))
        for nbest, found in zip(plain, rescored):
            words = [normalize_text(recognizer.text(h.tokens)).split() for h in nbest]
            totals = sorted(((h.score + weight * lm.score(w) + bonus * len(w), -i)
                             for i, (h, w) in enumerate(zip(nbest, words))), reverse=True)[:2]
            assert [h.tokens for h in found] == [nbest[-i].tokens for _, i in totals]
            assert [h.score for h in found] == pytest.approx([t for t, _ in totals], abs=1e-6)
            changed += weight > 0 and found[0].tokens != nbest[0].tokens
    assert changed >= 1  # the LM moved some choice


def test_asr_lm_then_decode_and_transcribe(files, tmp_path):
    model, folder = files
    (tmp_path / "more.txt").write_text("cafe bad\n\nHe ab!\n")
    done = subprocess.run([sys.executable, "-m", "asr.cli", "lm", "--manifest", str(folder / "test.jsonl"),
                           "--text", str(tmp_path / "more.txt"), "--order", "2", "--out", str(tmp_path / "lm.arpa")],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "2-gram LM" in done.stdout and "from 6 sentences" in done.stdout
    lm = NgramLM.load(tmp_path / "lm.arpa")
    assert lm.vocab_size == 4 and lm.score(["AB", "HE"]) > lm.score(["HE", "HE"])
    config = DecodingConfig(beam_size=4, batch_size=2, num_workers=0, device="cpu", lm=str(tmp_path / "lm.arpa"),
                            lm_weight=0.5)
    wer = decode_manifest(model, folder / "test.jsonl", tmp_path / "dec", config)
    assert wer["decoding"]["lm"] == str(tmp_path / "lm.arpa") and wer["decoding"]["lm_weight"] == 0.5
    header = json.loads((tmp_path / "dec" / "decode.jsonl").read_text().splitlines()[0])
    assert header["header"]["lm"]["size"] == (tmp_path / "lm.arpa").stat().st_size
    # the command line passes --lm and --lm-weight on: the API's transcripts with them, not without
    # (the fixture's LM and the search of test_rescored_decoding_picks_the_best_sum_of_the_beam)
    audio, lm_file = [folder / f"u{i}.wav" for i in range(4)], folder / "lm.arpa"
    done = subprocess.run([sys.executable, "-m", "asr.cli", "transcribe", "--model", str(model), "--beam-size", "6",
                           "--lm", str(lm_file), "--lm-weight", "3", *map(str, audio)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    recognizer = load_model(model)
    with_lm = [r.text for r in recognizer.transcribe(audio, beam_size=6, lm=lm_file, lm_weight=3.0)]
    assert [line.split("\t", 1)[1] for line in done.stdout.splitlines()] == with_lm
    assert with_lm != [r.text for r in recognizer.transcribe(audio, beam_size=6)]
    # and --lm-fusion: the LM inside the search, as decoding.lm_fusion does in asr decode
    done = subprocess.run([sys.executable, "-m", "asr.cli", "transcribe", "--model", str(model), "--beam-size", "6",
                           "--lm", str(lm_file), "--lm-weight", "3", "--lm-fusion", *map(str, audio)],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    fused = [r.text for r in recognizer.transcribe(audio, beam_size=6, lm=lm_file, lm_weight=3.0, lm_fusion=True)]
    assert [line.split("\t", 1)[1] for line in done.stdout.splitlines()] == fused
    feats = [recognizer.feats(load_audio(a)) for a in audio]
    options = DecodingOptions(mode="attention", beam_size=6, ctc_weight=0.3, lm=str(lm_file), lm_weight=3.0,
                            lm_fusion=True)
    assert fused == [recognizer.text(n[0].tokens) for n in recognizer.decode(feats, options)]
    # and --lm-word-bonus (a large bonus, so that the choice moves)
    done = subprocess.run([sys.executable, "-m", "asr.cli", "transcribe", "--model", str(model), "--beam-size", "6",
                           "--lm", str(lm_file), "--lm-weight", "3", "--lm-word-bonus", "20", *map(str, audio)],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    longer = [r.text for r in recognizer.transcribe(audio, beam_size=6, lm=lm_file, lm_weight=3.0, lm_word_bonus=20.0)]
    assert [line.split("\t", 1)[1] for line in done.stdout.splitlines()] == longer
    assert longer != with_lm


def test_a_replaced_lm_file_is_read_again(files, tmp_path):
    model, folder = files
    recognizer, path = load_model(model), tmp_path / "lm.arpa"
    (tmp_path / "a.arpa").write_text(HAND_WRITTEN)
    (tmp_path / "b.arpa").write_text(HAND_WRITTEN.replace("-0.4\tthe cat", "-0.3\tthe cat"))  # same size
    (tmp_path / "a.arpa").rename(path)
    first = recognizer.language_model(path)
    assert recognizer.language_model(path) is first  # read once per path
    stamp = path.stat()
    (tmp_path / "b.arpa").rename(path)  # as a save does: a new file renamed over the old one
    os.utime(path, ns=(stamp.st_atime_ns, stamp.st_mtime_ns))  # a coarse clock: the same time
    assert path.stat().st_size == stamp.st_size
    assert recognizer.language_model(path).log10_prob(["THE"], "CAT") == pytest.approx(-0.3)


def test_a_bad_lm_is_one_line_naming_the_file(files, tmp_path):
    model, folder = files
    missing = "nowhere.arpa: cannot read the language model"
    for args, message in (
            (["decode", "--model", str(model), "--manifest", str(folder / "test.jsonl"), "--out-dir",
              str(tmp_path / "d"), f"decoding.lm={tmp_path / 'nowhere.arpa'}"], missing),
            (["transcribe", "--model", str(model), "--lm", str(tmp_path / "nowhere.arpa"), str(folder / "u0.wav")],
             missing),
            (["lm", "--out", str(tmp_path / "x.arpa")], "give --manifest"),
            (["transcribe", "--model", str(model), "--lm-weight", "0.5", str(folder / "u0.wav")],
             "--lm-weight needs --lm"),
            (["transcribe", "--model", str(model), "--lm-fusion", str(folder / "u0.wav")],
             "--lm-fusion needs --lm"),
            (["transcribe", "--model", str(model), "--lm-word-bonus", "1", str(folder / "u0.wav")],
             "--lm-word-bonus needs --lm"),
            (["decode", "--model", str(model), "--manifest", str(folder / "test.jsonl"), "--out-dir",
              str(tmp_path / "d"), "decoding.lm_word_bonus=.nan"], "decoding.lm_word_bonus = nan must be finite")):
        done = subprocess.run([sys.executable, "-m", "asr.cli", *args], capture_output=True, text=True)
        assert done.returncode != 0
        assert message in done.stderr.strip().splitlines()[-1], (args[0], done.stderr)
