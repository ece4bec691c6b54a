"""Closed-vocabulary decoding: the compiled word list walks exactly the lexicon's words (any
segmentation), and the beam search with it writes only those words, batched as alone, with the
scores of the unconstrained search's formula."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from host_syncs import HostSyncs  # tests/host_syncs.py
from test_api import TOKENS, write_decode_files
from test_beam_search import JOINT, LENGTHS, attention_log_prob, ctc_log_prob, length_limits, random_memory, tiny_model

import asr.lexicon as lexicon_module
from asr.api import load_model
from asr.decode import decode_manifest
from asr.decoding import DecodingConfig, DecodingOptions, DecodingTask
from asr.lexicon import Lexicon, LexiconError, LexiconScorer, read_words
from asr.metrics import normalize_text
from asr.search import Scorers, SearchOptions, decode_memory
from asr.tokenizer import CharTokenizer, train_tokenizer

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

TEXTS = [normalize_text(t) for t in [
    "the cat sat on the mat", "a cattle ranch in the west", "catalogue of the stars",
    "on and on it went", "at the station at ten", "the ant and the antelope", "west of the sun",
]] * 4
WORDS = sorted({w for t in TEXTS for w in t.split()})


def pieces(tokenizer) -> list[str | None]:
    return [None, None, *(tokenizer.piece(t) for t in range(2, tokenizer.vocab_size - 1)), None]


def compiled(tokenizer, words=WORDS) -> Lexicon:
    return Lexicon(words, pieces(tokenizer), eos=tokenizer.eos)


def walk(lexicon: Lexicon, tokens: list[int]) -> tuple[bool, bool]:
    """(every token allowed on the way, eos allowed at the end)."""
    state = lexicon.start(1)
    for t in tokens:
        if not lexicon.allowed(state)[0, t]:
            return False, False
        state = lexicon.advance(state, torch.tensor([t]))
        assert state.item() >= 0
    return True, bool(lexicon.allowed(state)[0, lexicon.eos])


@pytest.fixture(scope="module", params=["char", "bpe", "unigram"])
def tokenizer(request):
    kind = request.param
    return train_tokenizer(TEXTS, kind, {"bpe": 40, "unigram": 34}.get(kind))


@pytest.mark.parametrize("dense_bytes", [0, 10**9], ids=["gathers-only", "dense-rows"])
def test_allowed_is_every_transition_of_the_state(tokenizer, dense_bytes, monkeypatch):
    """The masks equal the transitions themselves, whether a state's row is gathered from its run
    of keys or kept dense (DENSE_BYTES 0: none dense; 10**9: every state with over 16 keys)."""
    monkeypatch.setattr(lexicon_module, "DENSE_BYTES", dense_bytes)
    lexicon = compiled(tokenizer)
    v = lexicon.vocab_size
    states = torch.arange(lexicon.sp + 1)
    edges = {(k // v, k % v) for k in lexicon._keys.tolist()}
    want = torch.zeros(len(states), v, dtype=torch.bool)
    for state, token in edges:
        want[state, token] = True
    want |= lexicon._starts & lexicon._may_end[states][:, None]
    want[:, lexicon.eos] = lexicon._may_end[states]
    assert torch.equal(lexicon.allowed(states), want)
    assert torch.equal(lexicon.allowed(states.flip(0)), want.flip(0))  # rows in any order
    wide = int((lexicon._offsets.diff() > 16).sum())  # states with more keys than the narrowest gather
    assert lexicon._dense.size(0) - 1 == (wide if dense_bytes else 0)


def test_every_lexicon_sentence_walks_to_an_end(tokenizer):
    lexicon = compiled(tokenizer)
    assert lexicon.num_words == len(WORDS) and lexicon.unspellable == 0
    for text in [*TEXTS[:7], "WEST CATTLE ANTELOPE", "A"]:
        assert walk(lexicon, tokenizer.encode(text)) == (True, True), text


@pytest.mark.parametrize("text", ["THE CA", "CATS", "THE DOG", "ANTEL", "THEN"])
def test_other_text_is_refused(tokenizer, text):
    """A prefix of a word cannot end; a word not in the list cannot be written at all."""
    assert walk(compiled(tokenizer), tokenizer.encode(text)) != (True, True)


def test_a_removed_word_is_refused(tokenizer):
    lexicon = compiled(tokenizer, [w for w in WORDS if w != "STATION"])
    assert walk(lexicon, tokenizer.encode("AT THE STATION")) != (True, True)
    assert walk(lexicon, tokenizer.encode("AT THE")) == (True, True)


def test_any_segmentation_of_a_word_is_allowed():
    """BPE's own split of CATTLE is not the only one: the same letters in single-letter pieces pass."""
    tok = train_tokenizer(TEXTS, "bpe", 40)
    ids = {tok.piece(t): t for t in range(2, tok.vocab_size - 1)}
    own = tok.encode("CATTLE")
    spelled = [ids["\u2581C"], *(ids[c] for c in "ATTLE")]
    assert own != spelled
    assert walk(compiled(tok), spelled) == (True, True)


def test_the_start_may_end_but_not_a_bare_separator():
    tok = CharTokenizer(list(" ACENT"))
    lexicon = compiled(tok, ["CAT", "ANT", "NET"])
    assert walk(lexicon, []) == (True, True)  # the empty hypothesis
    space = tok.encode(" ")[0]
    assert walk(lexicon, [space]) == (True, False)
    assert walk(lexicon, tok.encode("CAT ANT")) == (True, True)
    assert walk(lexicon, tok.encode("CAT  ANT"))[0] is False  # two separators in a row
    assert walk(lexicon, tok.encode("CATANT")) == (False, False)  # a second word needs a separator


def test_words_the_pieces_cannot_spell_are_counted():
    tok = CharTokenizer(list(" ACENT"))
    lexicon = compiled(tok, ["CAT", "DOG", "NEAT"])
    assert (lexicon.num_words, lexicon.unspellable) == (2, 1)


def test_read_words(tmp_path):
    path = tmp_path / "lexicon.txt"
    path.write_text("don't d oU n t\n\ncat k a t\nCat\n  mother-in-law  x\n")
    assert read_words(path) == ["DON'T", "CAT", "MOTHER", "IN", "LAW"]
    (tmp_path / "empty.txt").write_text("\n \n")
    with pytest.raises(LexiconError, match="empty.txt: no words"):
        read_words(tmp_path / "empty.txt")
    with pytest.raises(LexiconError, match="gone.txt: cannot read"):
        read_words(tmp_path / "gone.txt")


def test_from_file_refuses_a_list_the_tokenizer_cannot_spell(tmp_path):
    path = tmp_path / "words.txt"
    path.write_text("XYZ\nQQ\n")
    with pytest.raises(LexiconError, match="words.txt: none of its words can be spelled"):
        Lexicon.from_file(path, CharTokenizer(list(" ACENT")))


# --- the beam search with a lexicon -------------------------------------------------------------

SEARCH_WORDS = ["AB", "BAD", "CAFE", "HE", "EGG", "FADE", "A", "GH"]  # letters A-H, TOKENS of test_api


def constrained(model, memory, lens, options):
    tok = CharTokenizer(TOKENS)
    scorer = LexiconScorer(compiled(tok, SEARCH_WORDS))
    scorers = Scorers({"lexicon": scorer}, weights={"lexicon": 1.0}, constraints=("lexicon",))
    return tok, decode_memory(model, memory, lens, options, scorers)


@pytest.mark.parametrize("options", [JOINT, SearchOptions(mode="attention", beam_size=3, ctc_weight=0.0, nbest=3)],
                         ids=["joint", "attention"])
def test_search_writes_only_lexicon_words_batched_as_alone(options):
    model = tiny_model(5, dtype=torch.float32)
    memory, lens = random_memory(model, LENGTHS, 5)
    tok, batched = constrained(model, memory, lens, options)
    written = set()
    cut = 0
    for b, nbest in enumerate(batched):
        for h in nbest:  # those cut at the length limit too: never in the middle of a word
            assert set(tok.decode(h.tokens).split()) <= set(SEARCH_WORDS), tok.decode(h.tokens)
            written |= set(tok.decode(h.tokens).split())
            cut += len(h.tokens) == LENGTHS[b]
        alone = constrained(model, memory[b:b + 1, :LENGTHS[b]], lens[b:b + 1], options)[1][0]
        assert [h.tokens for h in alone] == [h.tokens for h in nbest]
        assert [h.score for h in alone] == pytest.approx([h.score for h in nbest], abs=1e-4)
    assert len(written) >= 2 and cut >= 1  # cut ones checked too
    unconstrained = {tok.decode(n[0].tokens) for n in decode_memory(model, memory, lens, options)}
    assert not all(set(t.split()) <= set(SEARCH_WORDS) for t in unconstrained)  # the constraint did something


def test_constrained_scores_are_the_unconstrained_formula():
    """The lexicon adds 0 to what it allows: score == (1 - w) log P_att + w log P_ctc + bonus * len."""
    model = tiny_model(6)
    memory, lens = random_memory(model, LENGTHS, 6)
    w, bonus = JOINT.ctc_weight, JOINT.length_bonus
    checked = 0
    for b, nbest in enumerate(constrained(model, memory, lens, JOINT)[1]):
        for h in nbest:
            if len(h.tokens) == LENGTHS[b] or h.score == float("-inf"):
                continue
            want = ((1 - w) * attention_log_prob(model, memory, lens, b, h.tokens)
                    + w * ctc_log_prob(model, memory, lens, b, h.tokens) + bonus * len(h.tokens))
            assert h.score == pytest.approx(want, abs=1e-4, rel=1e-6)
            checked += 1
    assert checked >= 5


def test_lexicon_options_are_validated():
    with pytest.raises(ValueError, match="decoding.lexicon = 'w.txt' applies to beam search"):
        DecodingOptions(mode="greedy", lexicon="w.txt")
    model = tiny_model(0)
    memory, lens = random_memory(model, [5], 0)
    with pytest.raises(ValueError, match="and the compiled lexicon go together"):
        DecodingTask(model, CharTokenizer(TOKENS), DecodingOptions(lexicon="w.txt"))
    scorer = Scorers({"lexicon": LexiconScorer(compiled(CharTokenizer(TOKENS), SEARCH_WORDS))})
    with pytest.raises(ValueError, match="apply to beam search"):
        decode_memory(model, memory, lens, SearchOptions(mode="greedy"), scorer)


# --- from the outside: asr decode / transcribe ------------------------------------------------


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("lexicon")
    model = write_decode_files(folder)
    (folder / "words.txt").write_text("\n".join(SEARCH_WORDS) + "\n")
    return model, folder


def test_decode_with_a_lexicon(files, tmp_path):
    model, folder = files
    config = DecodingConfig(beam_size=4, batch_size=2, num_workers=0, device="cpu", lexicon=str(folder / "words.txt"))
    wer = decode_manifest(model, folder / "test.jsonl", tmp_path / "dec", config)
    assert wer["decoding"]["lexicon"] == str(folder / "words.txt")
    hyps = [line.split()[1:] for line in (tmp_path / "dec" / "hyp.txt").read_text().splitlines()]
    assert all(set(words) <= set(SEARCH_WORDS) for words in hyps) and any(hyps)
    header = json.loads((tmp_path / "dec" / "decode.jsonl").read_text().splitlines()[0])
    assert header["header"]["lexicon"]["size"] == (folder / "words.txt").stat().st_size
    recognizer = load_model(model)
    texts = [r.text for r in recognizer.transcribe([folder / "u1.wav"], lexicon=folder / "words.txt", beam_size=4)]
    assert set(texts[0].split()) <= set(SEARCH_WORDS)


def test_a_changed_word_list_is_compiled_again(files, tmp_path):
    model, folder = files
    recognizer, words = load_model(model), tmp_path / "words.txt"
    words.write_text("AB\nHE\n")
    first = recognizer.lexicon(words)
    assert recognizer.lexicon(words) is first and first.num_words == 2  # compiled once per path
    words.write_text("AB\nHE\nCAFE\n")
    later = words.stat().st_mtime_ns + 10**9  # a coarse file-system clock could hide the rewrite
    os.utime(words, ns=(later, later))
    assert recognizer.lexicon(words).num_words == 3  # not the stale list
    texts = [r.text for r in recognizer.transcribe([folder / "u1.wav"], lexicon=words, beam_size=4)]
    assert set(texts[0].split()) <= {"AB", "HE", "CAFE"}
    words.unlink()
    with pytest.raises(LexiconError, match="cannot read the word list"):
        recognizer.lexicon(words)  # a list that went away is not served from the cache


def test_a_bad_lexicon_is_one_line_naming_the_file(files, tmp_path):
    model, folder = files
    for args in (["decode", "--model", str(model), "--manifest", str(folder / "test.jsonl"), "--out-dir",
                  str(tmp_path / "d"), f"decoding.lexicon={tmp_path / 'nowhere.txt'}"],
                 ["transcribe", "--model", str(model), "--lexicon", str(tmp_path / "nowhere.txt"),
                  str(folder / "u0.wav")]):
        done = subprocess.run([sys.executable, "-m", "asr.cli", *args], capture_output=True, text=True)
        assert done.returncode != 0
        lines = done.stderr.strip().splitlines()
        assert "nowhere.txt: cannot read the word list" in lines[-1], done.stderr


@pytest.mark.parametrize("options", [JOINT, SearchOptions(mode="attention", beam_size=3, ctc_weight=0.0)],
                         ids=["joint", "attention"])
def test_lexicon_search_makes_one_host_transfer_per_step(options):
    """The lexicon's constraint adds no host read to the search's one per step (tests/host_syncs.py
    counts on the CPU what would make the host wait for a GPU)."""
    model = tiny_model(5, dtype=torch.float32)
    memory, lens = random_memory(model, LENGTHS, 5)
    steps = int(length_limits(model, lens, options.max_len_ratio, options.max_rate_factor).max()) + 1
    tok = CharTokenizer(TOKENS)
    scorer = LexiconScorer(compiled(tok, SEARCH_WORDS))  # compiled outside the count: a build, not a step
    scorers = Scorers({"lexicon": scorer}, weights={"lexicon": 1.0}, constraints=("lexicon",))
    with HostSyncs() as syncs:
        decode_memory(model, memory, lens, options, scorers)
    assert 0 < syncs.count <= steps + 4, (syncs.count, steps, syncs.where.most_common(5), syncs.kinds)


@pytest.mark.gpu
def test_constrained_search_on_cuda_equals_cpu_with_one_sync_per_step():
    import warnings

    model = tiny_model(5, dtype=torch.float32)
    memory, lens = random_memory(model, LENGTHS, 5)
    cpu = constrained(model, memory, lens, JOINT)[1]
    model, memory, lens = model.cuda(), memory.cuda(), lens.cuda()  # the copies are not the search's
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            cuda = constrained(model, memory, lens, JOINT)[1]
        finally:
            torch.cuda.set_sync_debug_mode("default")
    assert [[h.tokens for h in n] for n in cpu] == [[h.tokens for h in n] for n in cuda]
    syncs = sum("synchroniz" in str(w.message) for w in caught)
    assert syncs <= max(LENGTHS) + 1 + 8, syncs
