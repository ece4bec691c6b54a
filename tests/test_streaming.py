"""Streaming encoders: chunked attention, causal convolutions, the non-square relative shift, and
chunk-by-chunk encoding equal to the whole utterance's under the same chunk mask."""
from __future__ import annotations

import dataclasses
import random

import pytest
import torch
from small_models import SMALL  # tests/small_models.py

from asr.model import ASRModel
from asr.model.attention import chunk_mask
from asr.model.conformer import rel_shift
from asr.model.encoder import sinusoidal_positions
from asr.model.subsampling import RATES, right_context

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

STREAMING = {
    "conformer": dataclasses.replace(SMALL, encoder="conformer", conv_kernel=5, causal_conv=True, encoder_layers=2,
                                     dropout=0.0),
    "transformer": dataclasses.replace(SMALL, encoder="transformer", conv_kernel=3, causal_conv=True,
                                       encoder_layers=2, dropout=0.0),
}


def streaming_model(kind: str, **changes) -> ASRModel:
    torch.manual_seed(0)
    return ASRModel(dataclasses.replace(STREAMING[kind], **changes)).double().eval()


def test_chunk_mask_allows_the_own_chunk_and_the_left_chunks():
    for length, chunk, left in [(10, 3, -1), (10, 3, 0), (10, 3, 1), (7, 1, 2), (5, 8, -1)]:
        mask = chunk_mask(length, chunk, left)[0, 0]
        for i in range(length):
            for j in range(length):
                ci, cj = i // chunk, j // chunk
                assert bool(mask[i, j]) == (cj <= ci and (left < 0 or cj >= ci - left)), (length, chunk, left, i, j)


@pytest.mark.parametrize("queries,keys", [(5, 5), (3, 8), (1, 6), (4, 4 + 11)])
def test_rel_shift_takes_a_chunk_over_its_left_context(queries, keys):
    """(Tq, Tk + Tq - 1) scores against positions Tk - 1 ... -(Tq - 1) -> (Tq, Tk): entry (i, j) is
    the score of relative position (Tk - Tq) + i - j (the queries are the last Tq keys)."""
    g = torch.Generator().manual_seed(0)
    scores = torch.randn(2, 3, queries, keys + queries - 1, generator=g)
    shifted = rel_shift(scores)
    assert shifted.shape == (2, 3, queries, keys)
    positions = list(range(keys - 1, -queries, -1))
    for i in range(queries):
        for j in range(keys):
            r = (keys - queries) + i - j
            assert torch.equal(shifted[..., i, j], scores[..., i, positions.index(r)])
    with pytest.raises(ValueError, match="rel_shift"):
        rel_shift(torch.zeros(1, 4, 3))


def test_chunk_position_bias_matches_the_explicit_i_minus_j_reference():
    """A chunk's relative-position term over its cache and itself, against (q_i + v) . P(r) / sqrt(dh)
    with r = the query's absolute position minus the key's, built from sinusoidal_positions of r."""
    model = streaming_model("conformer")
    attention = model.encoder.layers[0].self_attn
    g = torch.Generator().manual_seed(1)
    dh = model.config.d_model // attention.n_heads
    q = torch.randn(1, attention.n_heads, 3, dh, generator=g, dtype=torch.float64)
    cached, c = 5, 3
    positions = sinusoidal_positions(torch.arange(cached + c - 1, -c, -1), model.config.d_model).double()
    bias = attention.position_bias(q, positions)  # (1, H, C, L + C)
    for i in range(c):
        for j in range(cached + c):
            r = cached + i - j
            p = attention._heads(attention.pos_proj(sinusoidal_positions(torch.tensor([r]), model.config.d_model)
                                                    .double())[None])[0, :, 0]  # (H, dh)
            expected = ((q[0, :, i] + attention.pos_bias_v) * p).sum(-1) / dh ** 0.5
            torch.testing.assert_close(bias[0, :, i, j], expected, atol=1e-12, rtol=0)


def stream(encoder, feats: torch.Tensor, chunk: int, left: int, seed: int, most: int = 50) -> torch.Tensor:
    """The encoder output of feats (B, T, n_mels) fed in random pieces of 1 to `most` frames."""
    rng = random.Random(seed)
    state, out, start = encoder.init_state(feats.size(0), dtype=feats.dtype), [], 0
    while start < feats.size(1):
        size = rng.randint(1, most)
        piece = feats[:, start:start + size]
        start += size
        h, state = encoder.forward_chunk(piece, state, chunk_size=chunk, left_chunks=left, final=start >= feats.size(1))
        out.append(h)
    return torch.cat(out, dim=1)


@pytest.mark.parametrize("kind", ["conformer", "transformer"])
@pytest.mark.parametrize("chunk,left", [(1, -1), (4, -1), (4, 0), (3, 2), (16, 1)])
def test_chunk_by_chunk_encoding_equals_the_whole_utterance(kind, chunk, left):
    """Any split of the features, frames arriving 1 to 50 at a time (and one at a time): the
    encoder output of the whole utterance under the same chunk mask, float64, to 1e-9."""
    model = streaming_model(kind)
    g = torch.Generator().manual_seed(2)
    feats = torch.randn(2, 157, SMALL.n_mels, generator=g, dtype=torch.float64)
    with torch.no_grad():
        whole, lens = model.encoder(feats, torch.tensor([157, 157]), chunk_size=chunk, left_chunks=left)
        assert int(lens[0]) == whole.size(1)
        for seed in range(3):
            torch.testing.assert_close(stream(model.encoder, feats, chunk, left, seed), whole, atol=1e-9, rtol=0)
        torch.testing.assert_close(stream(model.encoder, feats, chunk, left, 0, most=1), whole, atol=1e-9, rtol=0)
        full, _ = model.encoder(feats, torch.tensor([157, 157]))
    assert not torch.allclose(whole, full, atol=1e-6)  # the chunk mask changes the output


@pytest.mark.parametrize("rate", RATES)
def test_a_chunk_comes_out_once_its_frames_and_the_right_context_are_in(rate):
    """The latency of a chunk of C encoder frames: its output comes with feature frame
    rate * (C - 1) + right_context(rate) + 1 of the chunk (counted from the chunk's start), no
    earlier; the subsampling's right context is 6, 10, 14 feature frames at 4x, 6x, 8x."""
    assert right_context(rate) == {4: 6, 6: 10, 8: 14}[rate]
    model = streaming_model("conformer", subsampling=rate)
    chunk = 3
    feats = torch.randn(1, rate * 2 * chunk + right_context(rate) + 5, SMALL.n_mels, dtype=torch.float64)
    state, arrivals = model.encoder.init_state(dtype=torch.float64), []
    with torch.no_grad():
        for t in range(feats.size(1)):
            h, state = model.encoder.forward_chunk(feats[:, t:t + 1], state, chunk_size=chunk)
            arrivals += [t + 1] * h.size(1)
    first = rate * (chunk - 1) + right_context(rate) + 1
    assert arrivals == [first] * chunk + [first + rate * chunk] * chunk


def test_streaming_needs_causal_convolutions_and_eval_mode():
    noncausal = streaming_model("conformer", causal_conv=False)
    feats = torch.zeros(1, 40, SMALL.n_mels, dtype=torch.float64)
    with pytest.raises(ValueError, match="causal_conv"):
        noncausal.encoder.forward_chunk(feats, noncausal.encoder.init_state(dtype=torch.float64), chunk_size=4)
    model = streaming_model("conformer").train()
    with pytest.raises(ValueError, match="eval mode"):
        model.encoder.forward_chunk(feats, model.encoder.init_state(dtype=torch.float64), chunk_size=4)


def test_causal_convolution_sees_no_future_frame():
    """With causal_conv and a chunk size of 1 (each frame attends to the past alone), changing the
    last input frames leaves every earlier encoder frame as it was."""
    model = streaming_model("conformer")
    g = torch.Generator().manual_seed(3)
    feats = torch.randn(1, 120, SMALL.n_mels, generator=g, dtype=torch.float64)
    changed = feats.clone()
    changed[:, 100:] += 1.0
    with torch.no_grad():
        a, _ = model.encoder(feats, torch.tensor([120]), chunk_size=1)
        b, _ = model.encoder(changed, torch.tensor([120]), chunk_size=1)
    settled = (100 - right_context(4) - 1) // 4  # encoder frames whose inputs all lie before frame 100
    torch.testing.assert_close(a[:, :settled], b[:, :settled], atol=1e-12, rtol=0)
    assert not torch.allclose(a[:, -1], b[:, -1])


def test_dynamic_chunk_training_draws_a_chunk_per_batch():
    """dynamic_chunk: each training forward draws its chunk (full context half of the time) from
    torch's generator, and the loss is that chunk's; without it nothing is drawn."""
    config = dataclasses.replace(STREAMING["conformer"], dynamic_chunk=True, max_chunk=4)
    torch.manual_seed(0)
    model = ASRModel(config).double().train()
    g = torch.Generator().manual_seed(4)
    feats, feat_lens = torch.randn(2, 90, SMALL.n_mels, generator=g, dtype=torch.float64), torch.tensor([90, 70])
    tokens, token_lens = torch.tensor([[3, 4, 5], [6, 7, -1]]), torch.tensor([3, 2])
    seen = set()
    with torch.no_grad():
        for seed in range(12):
            torch.manual_seed(seed)
            chunk = model._training_chunk()
            h, h_lens = model.encoder(feats, feat_lens, chunk_size=chunk)
            expected = model._ctc_sum(h, h_lens, tokens, token_lens, (h_lens, token_lens))[0] / 2
            torch.manual_seed(seed)
            assert float(model(feats, feat_lens, tokens, token_lens).ctc_loss) == pytest.approx(float(expected))
            seen.add(chunk)
    assert 0 in seen and len(seen) >= 3 and seen <= {0, 1, 2, 3, 4}
    model.config = dataclasses.replace(config, dynamic_chunk=False)
    state = torch.random.get_rng_state()
    model(feats, feat_lens, tokens, token_lens)
    assert torch.equal(torch.random.get_rng_state(), state)  # nothing drawn without the flag
