"""An export folder is untrusted input (asr.onnx_model): its graph files are named by plain names in
the folder, and each graph is checked against what asr export writes (inputs and outputs, operators,
constant sizes, nothing onnxruntime would compute while loading) before onnxruntime sees any. The
graphs here are written by hand with the onnx package, so these tests need no export (the real
exports pass the same checks in tests/test_fast_cpu.py and in asr export itself)."""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from asr.checkpoint import CheckpointError
from asr.config import to_dict
from asr.features import CMVNStats, FeatureConfig
from asr.model import ModelConfig
from asr.onnx_graphs import EXPORT_FILE, GRAPHS, check_graph
from asr.onnx_model import EXPORT_FORMAT, EXPORT_VERSION, load_exported
from asr.tokenizer import CharTokenizer

onnx = pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")
from onnx import TensorProto, helper  # noqa: E402

CONFIG = ModelConfig(vocab_size=12, n_mels=16, conv_channels=4, d_model=8, n_heads=2, ffn_dim=16, encoder_layers=1,
                     decoder_layers=1)
FLOAT, INT64 = TensorProto.FLOAT, TensorProto.INT64


def value(name: str, dtype: int, dims) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, dtype, list(dims))


def weight(name: str, *dims: int) -> onnx.TensorProto:
    return helper.make_tensor(name, FLOAT, list(dims), [0.01] * int(torch.tensor(dims).prod()))


def graph_bytes(nodes, inputs, outputs, initializers=()) -> bytes:
    graph = helper.make_graph(nodes, "g", inputs, outputs, initializer=list(initializers))
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)]).SerializeToString()


def encoder() -> bytes:
    """A graph with the encoder's inputs and outputs (a projection standing in for the network)."""
    return graph_bytes([helper.make_node("MatMul", ["feats", "w"], ["memory"]),
                        helper.make_node("Identity", ["feat_lens"], ["memory_lens"])],
                       [value("feats", FLOAT, ["batch", "time", 16]), value("feat_lens", INT64, ["batch"])],
                       [value("memory", FLOAT, ["batch", "frames", 8]), value("memory_lens", INT64, ["batch"])],
                       [weight("w", 16, 8)])


def ctc(*extra_nodes, extra_initializers=(), logits: str = "logits", vocab: int = 12) -> bytes:
    """A graph with the CTC head's inputs and outputs; `extra_nodes` add to its logits (named
    `logits`) what ends in `logits`'s stead."""
    return graph_bytes([helper.make_node("MatMul", ["memory", "w"], ["logits"]), *extra_nodes,
                        helper.make_node("LogSoftmax", [logits], ["ctc_log_probs"], axis=-1)],
                       [value("memory", FLOAT, ["batch", "frames", 8])],
                       [value("ctc_log_probs", FLOAT, ["batch", "frames", vocab])],
                       [weight("w", 8, vocab), *extra_initializers])


def bomb() -> bytes:
    """The probe of issue 46: four ConstantOfShape nodes of 512 MB each, their sums added to the logits."""
    nodes, sizes = [], []
    for i in range(4):
        sizes.append(helper.make_tensor(f"s{i}", INT64, [1], [2**27]))
        nodes += [helper.make_node("ConstantOfShape", [f"s{i}"], [f"c{i}"],
                                   value=helper.make_tensor("v", FLOAT, [1], [1.0])),
                  helper.make_node("ReduceSum", [f"c{i}"], [f"r{i}"], keepdims=0),
                  helper.make_node("Add", ["logits" if i == 0 else f"sum{i}", f"r{i}"], [f"sum{i + 1}"])]
    return ctc(*nodes, extra_initializers=sizes, logits="sum4")


def export_folder(folder: Path, graphs: dict[str, bytes] | None = None, names: dict[str, object] | None = None,
                  int8_names: dict[str, object] | None = None) -> Path:
    """An export folder of CONFIG: export.json, the tokenizer, and `graphs` ({graph: file content}:
    the encoder and CTC graphs above by default; the decoder's are placeholders, never reached)."""
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = CharTokenizer(list("ABCDEFGH "))
    tokenizer.save(folder)
    from asr.onnx_model import tokenizer_fingerprint

    stats = CMVNStats()
    stats.add(torch.randn(50, 16))
    files = {name: f"{name}.onnx" for name in GRAPHS}
    contents = {"encoder": encoder(), "ctc": ctc(), "decoder_init": b"", "decoder_step": b"", **(graphs or {})}
    for name, data in contents.items():
        (folder / files[name]).write_bytes(data)
    meta = {"format": EXPORT_FORMAT, "version": EXPORT_VERSION, "model": to_dict(CONFIG),
            "frontend": {"features": to_dict(FeatureConfig(n_mels=16)), "cmvn": stats.to_dict()},
            "tokenizer": {"vocab_size": tokenizer.vocab_size, "fingerprint": tokenizer_fingerprint(tokenizer)},
            "graphs": {**files, **(names or {})}, "int8_graphs": int8_names or {}, "opset": 20}
    (folder / EXPORT_FILE).write_text(json.dumps(meta))
    return folder


def refused(folder: Path) -> str:
    with pytest.raises(CheckpointError) as err:
        load_exported(folder)
    assert "\n" not in str(err.value)
    return str(err.value)


def test_export_graph_paths_stay_in_the_folder(tmp_path):
    """export.json names each graph by a plain .onnx file name beside it: a path out of the folder, an
    absolute one, one into a subfolder, or no name at all is refused naming export.json before any
    file is opened; a graph file that is missing and one that cannot be read get the same words."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "ctc.onnx").write_bytes(bomb())
    for name in ["../outside/ctc.onnx", str(outside / "ctc.onnx"), "sub/ctc.onnx", "..", "ctc", "", 5, None]:
        folder = export_folder(tmp_path / "export", names={"ctc": name})
        message = refused(folder)
        assert message == f"{folder / EXPORT_FILE}: graphs.ctc must name a .onnx file beside export.json, got {name!r}"
    message = refused(export_folder(tmp_path / "export", int8_names={**{g: f"{g}.onnx" for g in GRAPHS},
                                                                    "encoder": "/etc/passwd"}))
    assert "int8_graphs.encoder must name a .onnx file beside export.json, got '/etc/passwd'" in message
    folder = export_folder(tmp_path / "export")
    meta = json.loads((folder / EXPORT_FILE).read_text())
    del meta["graphs"]["ctc"]
    (folder / EXPORT_FILE).write_text(json.dumps(meta))
    assert "'graphs' must name the files of the graphs encoder, ctc, decoder_init, decoder_step" in refused(folder)

    folder = export_folder(tmp_path / "missing")
    os.remove(folder / "ctc.onnx")
    missing = refused(folder)
    assert missing == f"{folder / 'ctc.onnx'}: cannot read this graph file (missing or unreadable)"
    folder = export_folder(tmp_path / "unreadable")
    os.remove(folder / "ctc.onnx")
    (folder / "ctc.onnx").mkdir()  # unreadable even for root
    assert refused(folder) == missing.replace("missing", "unreadable", 1)


def test_exported_graphs_are_checked_against_what_asr_export_writes(tmp_path):
    """Before onnxruntime sees any graph: the issue's ctc.onnx of four ConstantOfShape nodes (2 GB
    once onnxruntime folds them) is refused naming the file, and so is every other graph asr export
    would not write: another operator or a subgraph, an Expand to a constant shape,
    constants larger than the model's weights, external data, inputs and outputs other than the
    config's, and bytes that are not ONNX. What onnxruntime computes from constants while loading
    must be of sizes known from the graph and within the model's weights (small ones pass: asr
    export leaves the Transpose of a weight). The graphs written like asr export's pass."""
    folder = export_folder(tmp_path / "export", {"ctc": bomb()})
    assert len(bomb()) < 2_500
    assert refused(folder) == (f"{folder / 'ctc.onnx'}: node 1 (ConstantOfShape): an operator asr export never "
                               "writes")
    path = Path("g.onnx")
    check_graph(encoder(), path, "encoder", CONFIG)
    check_graph(ctc(), path, "ctc", CONFIG)
    one = helper.make_tensor("one", FLOAT, [], [1.0])
    check_graph(ctc(helper.make_node("Transpose", ["w"], ["wt"], perm=[1, 0]),  # computed at load, and small
                    helper.make_node("Transpose", ["wt"], ["w2"], perm=[1, 0]),
                    helper.make_node("Slice", ["w2", "starts", "ends"], ["half"]),  # (its size: no larger)
                    helper.make_node("MatMul", ["memory", "half"], ["again"]), logits="again",
                    extra_initializers=[helper.make_tensor("starts", INT64, [1], [0]),
                                        helper.make_tensor("ends", INT64, [1], [8])]), path, "ctc", CONFIG)
    shape = helper.make_tensor("shape", INT64, [3], [1, 1, 2**30])
    subgraph = helper.make_graph([helper.make_node("Identity", ["logits"], ["then"])], "then", [],
                                 [value("then", FLOAT, ["batch", "frames", 12])])
    external = weight("big", 8, 12)
    external.data_location = TensorProto.EXTERNAL
    cases = {
        "an operator asr export never writes": ctc(
            helper.make_node("Tile", ["logits", "reps"], ["tiled"]), logits="tiled",
            extra_initializers=[helper.make_tensor("reps", INT64, [3], [1, 1, 1])]),
        "node 1 (If): an operator": ctc(helper.make_node("If", ["cond"], ["chosen"], then_branch=subgraph,
                                                         else_branch=subgraph), logits="chosen",
                                        extra_initializers=[helper.make_tensor("cond", TensorProto.BOOL, [], [1])]),
        "node 1 (Expand) computes from constants alone (onnxruntime would compute it while loading the graph) a "
        "tensor of a size not known before it runs": ctc(
            helper.make_node("Expand", ["one", "shape"], ["big"]), helper.make_node("Add", ["logits", "big"], ["sum"]),
            logits="sum", extra_initializers=[one, shape]),
        "node 1 (Mul) computes from constants alone (onnxruntime would compute it while loading the graph) a tensor "
        "of 4,194,304 elements": ctc(  # an outer product of two small constants
            helper.make_node("Mul", ["column", "row"], ["outer"]),
            helper.make_node("ReduceSum", ["outer"], ["total"], keepdims=0),
            helper.make_node("Add", ["logits", "total"], ["sum"]), logits="sum",
            extra_initializers=[weight("column", 2048, 1), weight("row", 1, 2048)]),
        "node 3 (Expand) computes from constants alone": ctc(  # the Shape of a tensor of known sizes is a constant
            helper.make_node("Shape", ["w"], ["size"]), helper.make_node("Mul", ["size", "thousand"], ["more"]),
            helper.make_node("Expand", ["one", "more"], ["big"]),
            helper.make_node("Add", ["logits", "big"], ["sum"]), logits="sum",
            extra_initializers=[one, helper.make_tensor("thousand", INT64, [1], [1000])]),
        "node 1 (Expand) expands to a constant shape": ctc(
            helper.make_node("Expand", ["logits", "shape"], ["big"]), logits="big", extra_initializers=[shape]),
        "constant 'big' of 1,048,576 elements": ctc(
            helper.make_node("Add", ["logits", "big"], ["sum"]), logits="sum",
            extra_initializers=[helper.make_tensor("big", FLOAT, [2**20], [0.0] * 2**20)]),
        "'big' is external data": ctc(helper.make_node("Add", ["logits", "big"], ["sum"]), logits="sum",
                                      extra_initializers=[external]),
        "'ctc_log_probs' is (?, ?, 13) of element type 1, the model of export.json makes it (?, ?, 12)": ctc(vocab=13),
        "not an ONNX graph": b"\x08\x07" + os.urandom(64),
    }
    for reason, data in cases.items():
        with pytest.raises(CheckpointError) as err:
            check_graph(data, path, "ctc", CONFIG)
        assert str(err.value).startswith("g.onnx: ") and reason in str(err.value), (reason, str(err.value))
    with pytest.raises(CheckpointError, match=r"g\.onnx: its inputs are \(memory\), the encoder graph's are"):
        check_graph(ctc(), path, "encoder", CONFIG)
    shutil.rmtree(folder)
