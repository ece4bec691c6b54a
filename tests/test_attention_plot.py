"""Attention pictures: the explicit attention path beside the fused one, the three kinds of picture
(cross-attention, encoder and decoder self-attention), `asr decode --plot-attention` and the
pictures a training run draws at each validation. (The self-attention weights themselves:
tests/test_model_details.py.)"""
from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from matplotlib.image import imread
from small_models import small_model  # tests/small_models.py
from test_api import write_decode_files, write_model_file
from test_beam_search import random_memory, tiny_model
from test_trainer import asr_train, make_corpus

from asr import cli
from asr.attention_plot import (
    KINDS,
    AttentionFigure,
    attention_pictures,
    attention_weights,
    cross_attention,
    draw_attention,
    picture_name,
)
from asr.model import MultiHeadAttention, key_mask
from asr.tokenizer import CharTokenizer

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
LENGTHS = [9, 4, 1]  # memory frames of each utterance: the longest unpadded, one of a single frame


def attention_inputs(rows_per_utt: int = 1, *, dtype=torch.float64, seed: int = 0):
    """A MultiHeadAttention (eval) and q (R, H, T, dh), k and v (B, H, S, dh), mask (B, 1, 1, S):
    B = len(LENGTHS) utterances, R = rows_per_utt * B query rows (beam search folds them)."""
    torch.manual_seed(seed)
    attention = MultiHeadAttention(d_model=32, n_heads=4).to(dtype).eval()
    batch, frames = len(LENGTHS), max(LENGTHS)
    q = torch.randn(batch * rows_per_utt, 4, 5, 8, dtype=dtype)
    k, v = torch.randn(2, batch, 4, frames, 8, dtype=dtype)
    return attention, q, k, v, key_mask(torch.tensor(LENGTHS), frames)


@pytest.mark.parametrize("rows_per_utt", [1, 3])
def test_attention_rows_sum_to_one_over_unpadded_frames(rows_per_utt):
    attention, q, k, v, mask = attention_inputs(rows_per_utt)
    _, weights = attention.attend_with_weights(q, k, v, mask=mask)  # (R, H, T, S)
    assert weights.shape == (q.size(0), 4, 5, max(LENGTHS))
    for row in range(q.size(0)):
        frames = LENGTHS[row // rows_per_utt]  # the N rows of an utterance attend to its memory
        assert torch.allclose(weights[row, :, :, :frames].sum(-1), torch.ones(4, 5, dtype=q.dtype), atol=1e-12)
        assert (weights[row, :, :, frames:] == 0).all()  # exactly 0 on padding
        assert (weights[row, :, :, :frames] > 0).all()

    # the decoder's pictures: every layer, head and output position, the same rule
    model = tiny_model()
    memory, memory_lens = random_memory(model, LENGTHS)
    tokens = torch.randint(2, model.config.vocab_size - 1, (len(LENGTHS), 6))
    tokens[:, 0] = model.config.sos
    found = model.decoder.forward_with_attention(tokens, torch.full((3,), 6), memory, memory_lens).cross_attention
    assert found.shape == (model.config.decoder_layers, len(LENGTHS), model.config.n_heads, 6, max(LENGTHS))
    for b, frames in enumerate(LENGTHS):
        assert torch.allclose(found[:, b, ..., :frames].sum(-1), torch.ones(()).double(), atol=1e-12)
        assert (found[:, b, ..., frames:] == 0).all()


def fused_reference(attention: MultiHeadAttention, q, k, v, mask=None, is_causal=False) -> torch.Tensor:
    """`attend` as it was before the explicit path existed: fold, SDPA, unfold, project."""
    rows, heads, t, dh = q.shape
    batch = k.size(0)
    if rows > batch:
        q = q.view(batch, -1, heads, t, dh).transpose(1, 2).reshape(batch, heads, -1, dh)
    y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal)
    y = y.view(batch, heads, -1, t, dh).permute(0, 2, 3, 1, 4)
    return attention.out_proj(y.reshape(rows, t, attention.d_model))


@pytest.mark.parametrize("dtype,atol", [(torch.float64, 1e-12), (torch.float32, 1e-6)])
def test_fused_attention_output_unchanged_when_weights_are_kept(dtype, atol):
    for rows_per_utt in (1, 3):  # beam search's folded rows too
        attention, q, k, v, mask = attention_inputs(rows_per_utt, dtype=dtype)
        additive = torch.zeros(mask.shape, dtype=dtype).masked_fill(~mask, float("-inf"))  # the cache's mask
        for m in (mask, additive, None):
            fused = attention.attend(q, k, v, mask=m)
            assert torch.equal(fused, fused_reference(attention, q, k, v, mask=m))  # the default path, bit for bit
            explicit, _ = attention.attend_with_weights(q, k, v, mask=m)
            torch.testing.assert_close(explicit, fused, atol=atol, rtol=0)
    x = torch.randn(2, 7, 32, dtype=dtype)  # causal self-attention
    q, k, v = attention.qkv(x)
    fused = attention.attend(q, k, v, is_causal=True)
    assert torch.equal(fused, fused_reference(attention, q, k, v, is_causal=True))
    torch.testing.assert_close(attention.attend_with_weights(q, k, v, is_causal=True)[0], fused, atol=atol, rtol=0)

    # the decoder: forward_with_attention gives forward's log-probabilities; forward is left as it was
    model = tiny_model(dtype=dtype)
    memory, memory_lens = random_memory(model, LENGTHS)
    tokens = torch.randint(2, model.config.vocab_size - 1, (len(LENGTHS), 6))
    token_lens = torch.tensor([6, 3, 1])
    before = model.decoder(tokens, token_lens, memory, memory_lens)
    kept = model.decoder.forward_with_attention(tokens, token_lens, memory, memory_lens)
    valid = torch.arange(6) < token_lens[:, None]
    # two layers and the 4x sharpened output layer of tiny_model: float32 rounding grows to a few 1e-6
    torch.testing.assert_close(kept.log_probs[valid], before[valid], atol=10 * atol, rtol=0)
    assert torch.equal(model.decoder(tokens, token_lens, memory, memory_lens), before)


def test_cross_attention_of_one_utterance_is_its_rows_in_a_batch():
    """The picture's pass (one utterance, no padding) equals that utterance's rows of a padded batch."""
    model = tiny_model()
    memory, memory_lens = random_memory(model, LENGTHS)
    tokens = [3, 5, 4]
    inputs = torch.tensor([[model.config.sos, *tokens]] * len(LENGTHS))
    batch = model.decoder.forward_with_attention(inputs, torch.full((3,), 4), memory, memory_lens).cross_attention
    for b, frames in enumerate(LENGTHS):
        alone = cross_attention(model, memory[b, :frames], tokens)  # (layers, L + 1, S) mean over heads
        torch.testing.assert_close(alone, batch[:, b, :, :, :frames].mean(1).float(), atol=1e-6, rtol=0)


FIGURES = {  # kind -> (shape, row labels, column labels) of a figure of that kind
    "cross": ((2, 8, 30), [*"HE SAID", "<eos>"], None),
    "encoder_self": ((3, 30, 30), None, None),
    "decoder_self": ((2, 8, 8), [*"HE SAID", "<eos>"], ["<sos>", *"HE SAID"]),
}


@pytest.mark.parametrize("kind", KINDS)
def test_a_redrawn_figure_is_the_figure_drawn_afresh(kind):
    """Training lays an utterance's figure out once and redraws only its heatmaps; each kind."""
    shape, labels, columns = FIGURES[kind]
    figure = AttentionFigure(shape, labels, title="u0: HE SAID", frame_ms=40.0, kind=kind, columns=columns)
    first = figure.draw(torch.rand(shape))
    weights = torch.rand(shape).softmax(-1)
    again = figure.draw(weights)
    assert first.shape == again.shape and first.dtype == np.uint8 and first.shape[-1] == 4
    assert not np.array_equal(first, again)
    assert np.array_equal(again, draw_attention(weights, labels, title="u0: HE SAID", frame_ms=40.0, kind=kind,
                                                columns=columns))
    with pytest.raises(ValueError, match="shape"):
        figure.draw(torch.rand(shape[0], shape[1] + 1, shape[2]))
    with pytest.raises(ValueError, match="kind"):
        AttentionFigure(shape, labels, kind="decoder")


@pytest.mark.parametrize("encoder", ["transformer", "conformer"])
def test_attention_pictures_draw_each_kind(encoder):
    """attention_weights: one utterance's three kinds, mean over heads, from one pass each: the
    cross-attention that `cross_attention` gives over the same encoder output, the encoder's rows
    summing to 1 over its frames, the decoder's lower triangular; attention_pictures draws each."""
    model = small_model(encoder=encoder, conv_kernel=7 if encoder == "conformer" else 0)
    config = model.config
    feats = torch.randn(60, config.n_mels, generator=torch.Generator().manual_seed(0))
    tokens = [3, 5, 4, 5]
    weights = attention_weights(model, feats, tokens)
    memory, memory_lens = model.encoder(feats[None], torch.tensor([60]))
    frames = int(memory_lens[0])
    assert list(weights) == list(KINDS)
    assert weights["cross"].shape == (config.decoder_layers, 5, frames)
    assert weights["encoder_self"].shape == (config.encoder_layers, frames, frames)
    assert weights["decoder_self"].shape == (config.decoder_layers, 5, 5)
    torch.testing.assert_close(weights["cross"], cross_attention(model, memory[0], tokens), atol=1e-5, rtol=0)
    torch.testing.assert_close(weights["encoder_self"].sum(-1), torch.ones(config.encoder_layers, frames),
                               atol=1e-5, rtol=0)
    assert torch.equal(weights["decoder_self"], weights["decoder_self"].tril())
    torch.testing.assert_close(weights["decoder_self"].sum(-1), torch.ones(config.decoder_layers, 5), atol=1e-5,
                               rtol=0)

    tokenizer = CharTokenizer(list("ABCDEFGHIJ"))  # V = 13, as SMALL
    pictures = attention_pictures(model, tokenizer, feats, tokens, title="u0: text")
    assert list(pictures) == list(KINDS)
    for kind, image in pictures.items():
        assert image.dtype == np.uint8 and image.shape[-1] == 4 and image.std() > 10, kind
    assert len({image.shape for image in pictures.values()}) == 3  # three layouts


def test_picture_names():
    """The cross-attention keeps the name it always had; the others add their kind."""
    assert picture_name("spk/utt-1") == picture_name("spk/utt-1", "cross") == "spk_utt-1.png"
    assert picture_name("spk/utt-1", "encoder_self") == "spk_utt-1.encoder_self.png"
    assert picture_name("u0", "decoder_self") == "u0.decoder_self.png"
    with pytest.raises(ValueError, match="kind"):
        picture_name("u0", "self")


def png_size(path: Path) -> tuple[int, int]:
    """(width, height) from a PNG's header; asserts the signature."""
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE and data[12:16] == b"IHDR", path
    return struct.unpack(">II", data[16:24])


def test_decode_plot_attention_writes_each_kind_of_the_first_utterances(tmp_path, capsys):
    model = write_decode_files(tmp_path)
    write_model_file(model, eos_bias=1.0)  # hypotheses of a few tokens: a fast decode
    out = tmp_path / "out"
    assert cli.main(["decode", "--model", str(model), "--manifest", str(tmp_path / "test.jsonl"), "--out-dir",
                     str(out), "--device", "cpu", "--plot-attention", "2", "decoding.num_workers=0"]) == 0
    assert "attention/" in capsys.readouterr().out
    pictures = sorted((out / "attention").iterdir())
    names = sorted(picture_name(utt, kind) for utt in ("utt0", "utt1") for kind in KINDS)
    assert [p.name for p in pictures] == names  # the first two of the manifest: utt0.png, utt0.encoder_self.png ...
    assert len((out / "hyp.txt").read_text().splitlines()) == 4  # the decode itself as without pictures
    for path in pictures:
        width, height = png_size(path)
        assert 200 <= width <= 4000 and 150 <= height <= 2000
        image = imread(path)
        assert image.shape[:2] == (height, width) and image.std() > 0.05  # a picture, not a blank


def test_training_draws_attention_pictures_at_each_validation(tmp_path):
    manifest = make_corpus(tmp_path / "data", n=3)
    exp = tmp_path / "exp"
    out = asr_train(manifest, exp, "training.epochs=2", "data.num_workers=0", "training.attention_plots=2")
    assert out.returncode == 0, out.stderr[-2000:]
    for epoch in (1, 2):
        pictures = sorted((exp / "attention" / f"epoch{epoch}").iterdir())
        assert [p.name for p in pictures] == ["u0.png", "u1.png"]  # the first two of the decode subset
        assert all(png_size(p)[0] > 200 for p in pictures)
    events = b"".join(p.read_bytes() for p in (exp / "tensorboard").iterdir())
    assert b"attention/u0" in events and b"attention/u1" in events and PNG_SIGNATURE in events
    valid = [json.loads(line) for line in (exp / "metrics.jsonl").read_text().splitlines()]
    assert sum(r["kind"] == "valid" for r in valid) == 2
