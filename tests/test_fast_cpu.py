"""The fast CPU path: int8 weights (asr.quantize) and the exported model in onnxruntime
(asr.export, asr.onnx_model), on a model that has learned its sentences (the spoken_model fixture),
so that transcripts mean something."""
from __future__ import annotations

import dataclasses
import json
import shutil
import sys
from collections.abc import Callable

import pytest
import torch
from torch import nn

from asr.api import load_model
from asr.checkpoint import CheckpointError
from asr.decoding import DecodingOptions
from asr.model import MultiHeadAttention
from asr.quantize import Int8Linear, quantize_int8
from asr.tokenizer import CharTokenizer

pytest.importorskip("onnxruntime")
pytest.importorskip("onnxscript")


@pytest.fixture(scope="module")
def exported(spoken_model, tmp_path_factory):
    """The spoken model exported (float32 and int8 graphs)."""
    from asr.export import export_model

    folder = tmp_path_factory.mktemp("exported")
    export_model(spoken_model.model, folder, int8=True)
    return folder


def test_int8_transcripts_match_fp32(spoken_model):
    """Every weight matmul is int8 and the transcripts are the float32 ones, word for word (the
    bound stated: a WER change of 0 on these 12 files)."""
    recognizer = load_model(spoken_model.model)
    quantized = quantize_int8(recognizer.model)
    assert not any(isinstance(m, nn.Linear) for m in quantized.modules())
    attentions = [m for m in quantized.modules() if isinstance(m, MultiHeadAttention)]
    assert attentions and all(m.int8_in is not None for m in attentions)
    assert any(isinstance(m, nn.Linear) for m in recognizer.model.modules())  # the original is left alone

    fp32 = [r.text for r in recognizer.transcribe(spoken_model.audio)]
    recognizer.options = dataclasses.replace(recognizer.options, int8=True)
    int8 = [r.text for r in recognizer.transcribe(spoken_model.audio)]
    assert fp32 == spoken_model.texts
    assert int8 == fp32

    x = torch.randn(3, 7, recognizer.model.config.d_model)  # the int8 layer is close to the float one
    linear = recognizer.model.decoder.output
    error = (Int8Linear.from_linear(linear)(x) - linear(x)).abs().max()
    assert error < 0.05 * linear(x).abs().max()


def test_export_matches_pytorch(spoken_model, exported):
    """The graphs give the model's encoder output, CTC and step log-probabilities (beam rows, a
    cache several steps long) within 1e-4, and the same transcripts; so do the int8 graphs' transcripts."""
    torch_model = load_model(spoken_model.model)
    onnx_model = load_model(exported)
    model, graphs = torch_model.model, onnx_model.model
    feats = [torch_model.feats(torch.from_numpy(_read(p))) for p in spoken_model.audio[:3]]
    x = torch.nn.utils.rnn.pad_sequence(feats, batch_first=True)
    x_lens = torch.tensor([f.size(0) for f in feats])
    with torch.no_grad():
        memory, memory_lens = model.encode(x, x_lens)
        got, got_lens = graphs.encode(x, x_lens)
        assert torch.equal(got_lens, memory_lens)
        valid = torch.arange(memory.size(1)) < memory_lens[:, None]
        assert (got - memory)[valid].abs().max() < 1e-4
        assert (graphs.ctc_log_probs(memory) - model.ctc_log_probs(memory))[valid].abs().max() < 1e-4

        rows = 3 * 4  # 3 utterances x 4 hypotheses
        cache = model.init_cache(memory, memory_lens, rows=rows, capacity=2)
        state = graphs.init_cache(memory, memory_lens, rows=rows, capacity=3)  # grown once, at step 3
        tokens = torch.full((rows,), model.config.sos)
        generator = torch.Generator().manual_seed(0)
        for step in range(5):
            buffer = state.self_kv.data_ptr()
            expected, cache = model.step(tokens, cache)
            log_probs, state = graphs.step(tokens, state)
            assert (log_probs - expected).abs().max() < 1e-4
            assert (state.self_kv.data_ptr() == buffer) == (step != 3)  # written in place unless full
            tokens = torch.randint(2, model.config.vocab_size - 1, (rows,), generator=generator)
            order = torch.randperm(rows, generator=generator).view(3, 4).sort(dim=1).values  # within utterances
            order = (order % 4 + torch.arange(3)[:, None] * 4).flatten()
            cache, state = cache.reorder(order), state.reorder(order)

    texts = [r.text for r in onnx_model.transcribe(spoken_model.audio)]
    assert texts == [r.text for r in torch_model.transcribe(spoken_model.audio)] == spoken_model.texts
    onnx_model.options = DecodingOptions(int8=True)
    assert [r.text for r in onnx_model.transcribe(spoken_model.audio)] == spoken_model.texts


def _called(run: Callable[[], object], files: tuple[str, ...]) -> tuple[object, set[str]]:
    """run()'s result and the functions of `files` (asr/ paths) it called."""
    called: set[str] = set()

    def profile(frame, event, arg):  # sys.setprofile's signature
        path = frame.f_code.co_filename
        if event == "call" and path.endswith(files):
            called.add(f"{path.rsplit('/', 1)[1]}:{frame.f_code.co_qualname}")

    sys.setprofile(profile)
    try:
        result = run()
    finally:
        sys.setprofile(None)
    return result, called


@pytest.mark.parametrize("options", [DecodingOptions(), DecodingOptions(mode="greedy"),
                                     DecodingOptions(mode="ctc_rescore", beam_size=4)], ids=lambda o: o.mode)
def test_one_search_drives_pytorch_and_the_export(spoken_model, exported, options):
    """The same decoding task runs the same code over the PyTorch model and its export: the same
    functions of decoding.py, search.py, ctc_prefix.py and scorer.py are called (only the model's
    own methods differ, behind asr.inference), and the same hypotheses come out."""
    torch_model, onnx_model = load_model(spoken_model.model), load_model(exported)
    feats = [torch_model.feats(torch.from_numpy(_read(p))) for p in spoken_model.audio[:4]]
    files = ("asr/decoding.py", "asr/search.py", "asr/ctc_prefix.py", "asr/scorer.py")
    with torch.no_grad():
        want, torch_calls = _called(lambda: torch_model.task(options).run(feats), files)
        got, onnx_calls = _called(lambda: onnx_model.task(options).run(feats), files)
    assert torch_calls == onnx_calls and any("search.py" in c for c in torch_calls)
    assert [[h.tokens for h in nbest] for nbest in got] == [[h.tokens for h in nbest] for nbest in want]
    assert all(nbest[0].tokens for nbest in want)


def test_exported_step_reads_the_cache_and_returns_one_position(exported, tmp_path):
    """A step's cost does not grow with a copy of the cache: the step graph's only cache output is the
    new position's keys and values, (layers, 2, B, N, H, dh) with no time axis. A folder exported by
    the previous version (whose step returned the whole cache) is refused with one line."""
    import onnx

    from asr.onnx_graphs import EXPORT_FILE

    meta = json.loads((exported / EXPORT_FILE).read_text())
    model = meta["model"]
    step = onnx.load(str(exported / "decoder_step.onnx"), load_external_data=False)
    shapes = {v.name: [d.dim_value or d.dim_param for d in v.type.tensor_type.shape.dim]
              for v in [*step.graph.input, *step.graph.output]}
    batch, beam = shapes["tokens"]
    assert [v.name for v in step.graph.output] == ["log_probs", "new_kv"]
    assert shapes["new_kv"] == [model["decoder_layers"], 2, batch, beam, model["n_heads"],
                                model["d_model"] // model["n_heads"]]
    assert isinstance(shapes["self_k_0"][3], str)  # the capacity: dynamic, and in no output

    folder = tmp_path / "old"
    shutil.copytree(exported, folder)
    meta["version"] -= 1
    (folder / EXPORT_FILE).write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match=r"export\.json: exported by an older version .*run asr export again$"):
        load_model(folder)


def test_exported_model_refuses_a_mismatched_tokenizer(exported, tmp_path):
    """A tokenizer that is not the exported one is refused naming its file: another tokenizer's
    file, and one whose vocabulary does not match the graphs' output layer even when export.json
    was edited to vouch for it."""
    folder = tmp_path / "export"
    shutil.copytree(exported, folder)
    other = CharTokenizer(list("abcdefgh"))
    other.save(folder)
    with pytest.raises(CheckpointError, match=r"tokenizer\.json: not the tokenizer this model was exported with"):
        load_model(folder)

    from asr.export import EXPORT_FILE, tokenizer_fingerprint

    meta = json.loads((folder / EXPORT_FILE).read_text())
    meta["tokenizer"] = {"vocab_size": other.vocab_size, "fingerprint": tokenizer_fingerprint(other)}
    (folder / EXPORT_FILE).write_text(json.dumps(meta))
    message = rf"tokenizer\.json: {other.vocab_size} tokens, the exported graphs output \d+$"
    with pytest.raises(CheckpointError, match=message):
        load_model(folder)


def _read(path):
    import soundfile as sf

    return sf.read(path, dtype="float32")[0]
