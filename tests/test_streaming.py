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


# ---------------------------------------------------------------------------------------------
# streaming recognition (asr.streaming)


def spoken(seconds: float, seed: int) -> torch.Tensor:
    """A waveform with some structure (tones that change every 0.2 s, and noise)."""
    g = torch.Generator().manual_seed(seed)
    t = torch.arange(int(seconds * 16000)) / 16000.0
    freqs = 200 + 1800 * torch.rand(int(seconds / 0.2) + 1, generator=g)
    wave = 0.3 * torch.sin(2 * torch.pi * freqs[(t / 0.2).long()] * t) + 0.05 * torch.randn(t.numel(), generator=g)
    return wave.float()


def recognizer_parts(kind: str = "conformer"):
    from asr.features import CMVNStats, FeatureConfig, GlobalCMVN, fbank
    from asr.tokenizer import CharTokenizer

    model = streaming_model(kind)
    tokenizer = CharTokenizer(list("abcdefghijklmnopqrstuvwxyz '")[:SMALL.vocab_size - 4])
    features = FeatureConfig(n_mels=SMALL.n_mels, dither=0.0)
    stats = CMVNStats()
    stats.add(fbank(spoken(2.0, 99), features))
    cmvn = GlobalCMVN(stats)
    with torch.no_grad():  # a CTC head on the encoder's centred, whitened output: it writes varied tokens
        h = model.encoder(cmvn(fbank(spoken(2.0, 99), features)).double()[None], torch.tensor([200]))[0][0]
        w = torch.randn(model.ctc.weight.shape, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
        w = 3.0 * w / h.std(0)
        model.ctc.weight.copy_(w)
        model.ctc.bias.copy_(-w @ h.mean(0))
        model.decoder.output.weight.mul_(4.0)
    return model, tokenizer, features, cmvn


@pytest.mark.parametrize("chunk,left", [(4, -1), (8, 1)])
def test_streaming_final_text_equals_the_chunked_ctc_rescore_decode(chunk, left):
    """Endpointing and length caps off, one utterance fed in random pieces: the final text is the
    non-streaming ctc_rescore decode of the same model under the same chunk mask (float64), and
    the partial results along the way are prefixes the search held."""
    from asr.features import fbank
    from asr.search import SearchOptions, ctc_rescore
    from asr.streaming import Stream, StreamingOptions

    model, tokenizer, features, cmvn = recognizer_parts()
    wave = spoken(3.1, 1)
    options = StreamingOptions(chunk_size=chunk, left_chunks=left, beam_size=4, ctc_weight=0.5)
    with torch.no_grad():
        feats = cmvn(fbank(wave, features)).double()[None]
        memory, lens = model.encoder(feats, torch.tensor([feats.size(1)]), chunk_size=chunk, left_chunks=left)
        expected = ctc_rescore(model, memory, lens, SearchOptions(mode="ctc_rescore", beam_size=4, ctc_weight=0.5,
                                                                  max_len_ratio=1.0, max_rate_factor=0.0))[0][0]
    assert len(expected.tokens) > 3
    rng = random.Random(0)
    stream, events, start = Stream(model, tokenizer, features, cmvn, options), [], 0
    while start < wave.numel():
        size = rng.randint(1, 4000)
        events += stream.accept_waveform(wave[start:start + size])
        start += size
    events += stream.finish()
    finals = [e for e in events if e.kind == "final"]
    assert len(finals) == 1 and finals[0].tokens == expected.tokens
    assert stream.result() == tokenizer.decode(list(expected.tokens))
    partials = [e for e in events if e.kind == "partial"]
    assert len(partials) >= 2 and all(e.end <= finals[0].end for e in partials)


def test_streaming_endpoints_split_the_segments():
    """With a maximum segment length, finals come one per segment, each starting where the last
    ended, and nothing is heard twice."""
    from asr.streaming import Stream, StreamingOptions

    model, tokenizer, features, cmvn = recognizer_parts()
    stream = Stream(model, tokenizer, features, cmvn, StreamingOptions(chunk_size=4, beam_size=3, max_segment=0.8))
    events = stream.accept_waveform(spoken(3.0, 2)) + stream.finish()
    finals = [e for e in events if e.kind == "final"]
    assert len(finals) >= 3
    assert finals[0].start == 0.0 and all(a.end == b.start for a, b in zip(finals, finals[1:]))
    assert all(f.end - f.start <= 0.8 + 4 * 0.04 + 1e-9 for f in finals)
    with pytest.raises(ValueError, match="finished"):
        stream.accept_waveform(spoken(0.1, 3))


def test_streaming_prefix_search_equals_the_whole_search_and_counts_trailing_blanks():
    """Frames fed in pieces: the beams of prefix_beam_search over all of them (no length cap), and
    the frames since the last one whose best token was not blank."""
    from asr.ctc_prefix import StreamingPrefixSearch, prefix_beam_search

    g = torch.Generator().manual_seed(5)
    log_probs = (3.0 * torch.randn(2, 40, 9, generator=g, dtype=torch.float64)).log_softmax(-1)
    log_probs[:, 33:, 0] = 0.0  # the last 7 frames: blank is best
    whole = prefix_beam_search(log_probs, torch.tensor([40, 40]), beam=5, max_lens=torch.tensor([40, 40]))
    search = StreamingPrefixSearch(batch=2, beam=5, like=log_probs)
    for start, size in ((0, 3), (3, 1), (4, 20), (24, 9)):
        search.feed(log_probs[:, start:start + size])
    best = log_probs[:, :33].argmax(-1).tolist()
    assert search.trailing_blanks.tolist() == [len(row) - len("".join(map(str, row)).rstrip("0")) for row in best]
    search.feed(log_probs[:, 33:])
    got = search.prefixes()
    assert torch.equal(got.lengths, whole.lengths) and torch.equal(got.scores, whole.scores)
    for b in range(2):
        for n in range(5):
            k = int(whole.lengths[b, n])
            assert torch.equal(got.tokens[b, n, :k], whole.tokens[b, n, :k])
    assert search.trailing_blanks.tolist() == [7, 7]


def test_decoding_chunk_size_encodes_as_the_streaming_model_hears():
    """decoding.chunk_size / left_chunks: the decoding task encodes under that chunk mask (the
    search then runs on it as on any memory); an object without chunked attention is refused."""
    from asr.decoding import DecodingOptions, DecodingTask
    from asr.features import fbank

    model, tokenizer, features, cmvn = recognizer_parts()
    model.float()
    feats = [cmvn(fbank(spoken(s, i), features)) for i, s in enumerate((1.3, 2.1))]
    options = DecodingOptions(mode="ctc_greedy", chunk_size=4, left_chunks=1)
    task = DecodingTask(model, tokenizer, options)
    memory, lens = task.encode(feats)
    padded = torch.nn.utils.rnn.pad_sequence(feats, batch_first=True)
    with torch.no_grad():
        expected, _ = model.encoder(padded, torch.tensor([f.size(0) for f in feats]), chunk_size=4, left_chunks=1)
        whole, _ = model.encoder(padded, torch.tensor([f.size(0) for f in feats]))
    torch.testing.assert_close(memory, expected)
    assert not torch.allclose(memory, whole, atol=1e-4)
    assert [n[0].tokens for n in task.run(feats)] == [n[0].tokens for n in DecodingTask(
        model, tokenizer, options).decode_memory(expected, lens)]

    class WholeOnly:
        device = torch.device("cpu")
        chunked_attention = False

    with pytest.raises(ValueError, match="decoding.chunk_size"):
        DecodingTask(WholeOnly(), tokenizer, options)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="chunk_size"):
        DecodingOptions(chunk_size=-1)
