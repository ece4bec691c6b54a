"""The exported streaming encoder (asr export with chunk_size: the stream_subsample and stream_chunk
graphs) run by onnxruntime behind asr.streaming's Stream and advance: the same encoder output as
PyTorch's forward_chunks for streams advanced together, the same events and final texts; what the
export and Recognizer.stream refuse."""
from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
import torch
from small_models import SMALL  # tests/small_models.py
from test_streaming import encode_in_pieces, feed_in_pieces, spoken, streaming_model  # tests/test_streaming.py

from asr.api import load_model
from asr.checkpoint import CheckpointError, model_file, save_atomic
from asr.config import to_dict
from asr.features import CMVNStats, FeatureConfig, GlobalCMVN, fbank
from asr.tokenizer import CharTokenizer

pytest.importorskip("onnxruntime")
pytest.importorskip("onnxscript")
pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

# (kind, model changes, chunk_size, left_chunks): the conformer's relative positions over a cache, the
# transformer's absolute ones without any cache (left_chunks 0, no convolution: both caches empty)
CASES = {"conformer": ("conformer", {}, 4, 2), "transformer": ("transformer", {"conv_kernel": 0}, 3, 0)}


def write_streaming_model(path: Path, kind: str, **changes) -> Path:
    """A float32 model file of test_streaming's streaming model (one decoder layer, `changes`) whose
    CTC head writes varied tokens (centred, whitened encoder output, as recognizer_parts makes it)."""
    model = streaming_model(kind, decoder_layers=1, **changes).float()
    features = FeatureConfig(n_mels=SMALL.n_mels, dither=0.0)
    stats = CMVNStats()
    stats.add(fbank(spoken(2.0, 99), features))
    with torch.no_grad():
        h = model.encoder(GlobalCMVN(stats)(fbank(spoken(2.0, 99), features))[None], torch.tensor([200]))[0][0]
        w = torch.randn(model.ctc.weight.shape, generator=torch.Generator().manual_seed(0))
        w = 3.0 * w / h.std(0)
        model.ctc.weight.copy_(w)
        model.ctc.bias.copy_(-w @ h.mean(0))
        model.decoder.output.weight.mul_(4.0)
    tokenizer = CharTokenizer(list("abcdefghij")[:SMALL.vocab_size - 3])
    save_atomic(model_file(model=to_dict(model.config), tokenizer=tokenizer.to_dict(),
                           frontend={"features": to_dict(features), "cmvn": stats.to_dict()},
                           state_dict=model.state_dict()), path)
    return path


@pytest.fixture(scope="module", params=sorted(CASES))
def exported(request, tmp_path_factory):
    """(model file, its streaming export folder, chunk_size, left_chunks) of each case."""
    from asr.export import export_model

    kind, changes, chunk, left = CASES[request.param]
    folder = tmp_path_factory.mktemp(f"stream-{kind}")
    path = write_streaming_model(folder / "model.pt", kind, **changes)
    export_model(path, folder / "onnx", chunk_size=chunk, left_chunks=left)
    return path, folder / "onnx", chunk, left


def encoded_in_pieces(encoder, feats: list[torch.Tensor], chunk: int, left: int, seed: int) -> list[torch.Tensor]:
    """test_streaming.encode_in_pieces with its own random.Random(seed)."""
    return encode_in_pieces(encoder, feats, chunk, left, random.Random(seed))


def test_exported_stream_encodes_as_pytorch(exported):
    """Streams of different lengths (one too short for an encoder frame) fed in random pieces and
    advanced together: each one's encoder output from the graphs is PyTorch's forward_chunks' (float32,
    to 1e-4), in batched calls of the chunk graph."""
    path, folder, chunk, left = exported
    torch_encoder, onnx_encoder = load_model(path).model.encoder, load_model(folder).model.encoder
    g = torch.Generator().manual_seed(8)
    feats = [torch.randn(1, n, SMALL.n_mels, generator=g) for n in (157, 93, 40, 5)]
    rows = []
    graph = onnx_encoder.chunk
    onnx_encoder.chunk = lambda x, *rest: rows.append(x.size(0)) or graph(x, *rest)
    for seed in range(2):
        with torch.no_grad():
            expected = encoded_in_pieces(torch_encoder, feats, chunk, left, seed)
        got = encoded_in_pieces(onnx_encoder, feats, chunk, left, seed)
        assert [h.shape for h in got] == [h.shape for h in expected] and got[-1].size(1) == 0
        for h, want in zip(got, expected):
            torch.testing.assert_close(h, want, atol=1e-4, rtol=0)
    assert max(rows) >= 2


def test_exported_streams_give_the_pytorch_streams_events(exported):
    """Recognizer.stream of the export (its chunk options by default): streams fed in random pieces
    and advanced together give the PyTorch streams' events (partials and finals, tokens and times)
    and final texts, for both final searches."""
    path, folder, chunk, left = exported
    torch_recognizer, onnx_recognizer = load_model(path), load_model(folder)
    waves = [spoken(s, 10 + i) for i, s in enumerate((2.3, 1.1, 0.6))]
    for final in ("attention", "rescore"):
        expected = feed_in_pieces([torch_recognizer.stream(chunk, left, beam_size=3, final=final) for _ in waves],
                                  waves, 0)
        streams = [onnx_recognizer.stream(beam_size=3, final=final) for _ in waves]
        got = feed_in_pieces(streams, waves, 0)
        assert [[(e.kind, e.tokens, e.text) for e in x] for x in got] == \
            [[(e.kind, e.tokens, e.text) for e in x] for x in expected]
        assert [t for x in got for e in x for t in (e.start, e.end)] == pytest.approx(
            [t for x in expected for e in x for t in (e.start, e.end)])
        assert any(e.kind == "final" and e.text for x in got for e in x)
        assert [s.result() for s in streams] == [" ".join(e.text for e in x if e.kind == "final" and e.text)
                                                 for x in expected]


def test_an_export_streams_only_as_exported(exported, tmp_path):
    """Recognizer.stream refuses other chunk options than the export's, and an export without the
    streaming graphs; load_exported refuses a malformed "streaming" entry, or one whose sizes would
    make a stream's state too large."""
    _, folder, chunk, left = exported
    recognizer = load_model(folder)
    with pytest.raises(ValueError, match=f"chunks of {chunk} encoder frames with {left} left chunks"):
        recognizer.stream(chunk + 1, left)
    with pytest.raises(ValueError, match="fixed by asr export"):
        recognizer.stream(chunk, -1)
    copy = shutil.copytree(folder, tmp_path / "copy")
    meta = json.loads((copy / "export.json").read_text())
    for entry, error in (({**meta["streaming"], "left_chunks": -1}, "left_chunks"),
                         ({**meta["streaming"], "chunk_size": 4096, "left_chunks": 1}, "more than 4096 frames"),
                         ({**meta["streaming"], "graphs": {"stream_chunk": "stream_chunk.onnx"}}, "stream_subsample")):
        (copy / "export.json").write_text(json.dumps({**meta, "streaming": entry}))
        with pytest.raises(CheckpointError, match=error):
            load_model(copy)
    (copy / "export.json").write_text(json.dumps({k: v for k, v in meta.items() if k != "streaming"}))
    with pytest.raises(ValueError, match="export it with asr export --streaming"):
        load_model(copy).stream()


def test_export_refuses_unbounded_left_context_and_a_model_that_cannot_stream(tmp_path):
    """left_chunks -1 (or none) cannot be a fixed-size cache, a chunk may attend to at most 4096
    frames, and a model whose convolutions see the future cannot stream: each a one-line ValueError
    before any graph is written."""
    from asr.export import export_model

    path = write_streaming_model(tmp_path / "model.pt", "conformer")
    for left in (-1, None):
        with pytest.raises(ValueError, match="left_chunks must be >= 0.*cannot be exported"):
            export_model(path, tmp_path / "out", chunk_size=4, left_chunks=left)
    with pytest.raises(ValueError, match="chunk_size must be >= 1"):
        export_model(path, tmp_path / "out", chunk_size=-2, left_chunks=1)
    with pytest.raises(ValueError, match="attends to more than 4096 frames"):  # (a stream's state is bounded)
        export_model(path, tmp_path / "out", chunk_size=64, left_chunks=64)
    full = write_streaming_model(tmp_path / "full.pt", "conformer", causal_conv=False)
    with pytest.raises(ValueError, match="cannot stream.*causal_conv"):
        export_model(full, tmp_path / "out", chunk_size=4, left_chunks=1)
    assert not (tmp_path / "out").exists()
