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


def without_chunks(forward_intermediate, seen: list):
    """The encoder's forward_intermediate called without its chunk arguments (noted in `seen`)."""
    def whole(feats, feat_lens, layers, **chunk):
        seen.append(chunk)
        return forward_intermediate(feats, feat_lens, layers)

    return whole


@pytest.mark.parametrize("kind", ["conformer", "transformer"])
@pytest.mark.parametrize("causal", [False, True])
def test_chunk_size_zero_is_bit_identical_to_full_context(kind, causal):
    """chunk_size=0 (whatever left_chunks) is the encoder called without chunk arguments, bit for
    bit; and training with dynamic_chunk off takes the steps of a model whose encoder is only ever
    called without them (the same weights after two steps, the same random draws)."""
    model = streaming_model(kind, causal_conv=causal)
    g = torch.Generator().manual_seed(6)
    feats, lens = torch.randn(2, 70, SMALL.n_mels, generator=g, dtype=torch.float64), torch.tensor([70, 51])
    with torch.no_grad():
        full = model.encoder(feats, lens)
        for kwargs in ({"chunk_size": 0}, {"chunk_size": 0, "left_chunks": 2}):
            assert torch.equal(model.encoder(feats, lens, **kwargs)[0], full[0])
        assert torch.equal(model.encode(feats, lens)[0], full[0])
    tokens, token_lens = torch.tensor([[3, 4, 5], [6, 7, -1]]), torch.tensor([3, 2])
    trained, seen = [], []
    for reference in (False, True):
        model = streaming_model(kind, causal_conv=causal, dropout=0.1, dynamic_chunk=False).train()
        if reference:  # the encoder as it was before chunks: no chunk arguments reach it
            model.encoder.forward_intermediate = without_chunks(model.encoder.forward_intermediate, seen)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        torch.manual_seed(7)
        for _ in range(2):
            optimizer.zero_grad()
            model(feats, lens, tokens, token_lens).loss.backward()
            optimizer.step()
        trained.append((model.state_dict(), torch.random.get_rng_state()))
    assert seen == [{"chunk_size": 0}] * 2
    assert torch.equal(trained[0][1], trained[1][1])
    for name, weight in trained[0][0].items():
        assert torch.equal(weight, trained[1][0][name]), name


def test_chunk_mask_sees_only_its_chunk_and_left_context():
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
def test_forward_chunk_equals_whole_utterance_for_any_split(kind, chunk, left):
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


@pytest.mark.parametrize("final", ["attention", "rescore"])
@pytest.mark.parametrize("chunk,left", [(4, -1), (8, 1)])
def test_streaming_final_text_equals_offline_decode_of_the_same_model(chunk, left, final):
    """Endpointing and length-rate caps off, one utterance fed in random pieces: the final text is
    the non-streaming decode of the same model under the same chunk mask (float64) in the final's
    mode (attention: the joint beam search; rescore: ctc_rescore), and the partial results along
    the way are prefixes the CTC search held."""
    from asr.features import fbank
    from asr.search import SearchOptions, decode_memory
    from asr.streaming import Stream, StreamingOptions

    model, tokenizer, features, cmvn = recognizer_parts()
    wave = spoken(3.1, 1)
    options = StreamingOptions(chunk_size=chunk, left_chunks=left, beam_size=4, ctc_weight=0.5, final=final,
                               max_rate_factor=0.0)
    mode = "attention" if final == "attention" else "ctc_rescore"
    with torch.no_grad():
        feats = cmvn(fbank(wave, features)).double()[None]
        memory, lens = model.encoder(feats, torch.tensor([feats.size(1)]), chunk_size=chunk, left_chunks=left)
        expected = decode_memory(model, memory, lens, SearchOptions(mode=mode, beam_size=4, ctc_weight=0.5,
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


# ---------------------------------------------------------------------------------------------
# several streams in one batched encoder step (StreamingEncoder.forward_chunks, asr.streaming.advance)


def encode_in_pieces(encoder, feats: list[torch.Tensor], chunk: int, left: int, rng: random.Random, *,
                     latest_start: int = 3, dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    """Each stream's encoder output (1, n, d) when its features (1, F, n_mels) arrive in random
    pieces of 1-30 frames, the streams starting at random rounds (up to `latest_start`) and
    advanced together (forward_chunks) after each round."""
    begins = [rng.randint(0, latest_start) for _ in feats]
    states = [encoder.init_state(1, dtype=dtype) for _ in feats]
    fed, out, rounds = [0] * len(feats), [[] for _ in feats], 0
    while any(n < f.size(1) for n, f in zip(fed, feats)):
        rows = [i for i, f in enumerate(feats) if begins[i] <= rounds and fed[i] < f.size(1) and rng.random() < 0.8]
        pieces = []
        for i in rows:
            size = rng.randint(1, 30)
            pieces.append(feats[i][:, fed[i]:fed[i] + size])
            fed[i] += size
        h, new = encoder.forward_chunks(pieces, [states[i] for i in rows], chunk_size=chunk, left_chunks=left,
                                        final=[fed[i] >= feats[i].size(1) for i in rows])
        for i, h_i, state in zip(rows, h, new):
            out[i].append(h_i)
            states[i] = state
        rounds += 1
    return [torch.cat(o, dim=1) for o in out]


@pytest.mark.parametrize("kind", ["conformer", "transformer"])
@pytest.mark.parametrize("chunk,left", [(4, -1), (3, 1), (8, 0)])
def test_streams_batched_together_give_each_ones_encoder_output(kind, chunk, left):
    """Streams of different lengths that start at different times, fed in random pieces and advanced
    together in random interleavings (float64): each stream's output is that of its whole utterance
    under the chunk mask (to 1e-9), and of forward_chunk alone; the steps really are batched."""
    model = streaming_model(kind)
    g = torch.Generator().manual_seed(8)
    lengths = [157, 93, 40, 5]  # the last makes no encoder frame
    feats = [torch.randn(1, n, SMALL.n_mels, generator=g, dtype=torch.float64) for n in lengths]
    encoder, batches = model.encoder, []
    step = encoder._chunk_step

    def counted(chunks, caches, left):
        batches.append(len(chunks))
        return step(chunks, caches, left)

    encoder._chunk_step = counted
    with torch.no_grad():
        whole = [encoder(f, torch.tensor([f.size(1)]), chunk_size=chunk, left_chunks=left) for f in feats]
        for seed in range(2):
            rng, batches[:] = random.Random(seed), []
            out = encode_in_pieces(encoder, feats, chunk, left, rng, latest_start=4, dtype=torch.float64)
            for i, (memory, lens) in enumerate(whole):
                got = out[i]
                torch.testing.assert_close(got, memory[:, :int(lens[0])], atol=1e-9, rtol=0)
                torch.testing.assert_close(got, encoder.forward_chunk(feats[i], encoder.init_state(
                    1, dtype=torch.float64), chunk_size=chunk, left_chunks=left, final=True)[0], atol=1e-9, rtol=0)
            assert max(batches) >= 2


def test_forward_chunks_wants_one_row_per_stream():
    model = streaming_model("conformer")
    state = model.encoder.init_state(2, dtype=torch.float64)
    with pytest.raises(ValueError, match="one row"):
        model.encoder.forward_chunks([torch.zeros(2, 8, SMALL.n_mels, dtype=torch.float64)], [state], chunk_size=4)


def feed_in_pieces(streams, waves, seed: int) -> list[list]:
    """Each stream's events when the waves arrive in random pieces, the streams starting at
    different times and advanced together after every round (asr.streaming.advance)."""
    from asr.streaming import advance

    rng = random.Random(seed)
    begins = [rng.randint(0, 3) for _ in streams]
    fed, events, rounds = [0] * len(streams), [[] for _ in streams], 0
    while not all(s.finished for s in streams):
        for i, (stream, wave) in enumerate(zip(streams, waves)):
            if begins[i] > rounds or stream.finished or rng.random() < 0.2:
                continue
            if fed[i] < wave.numel():
                size = rng.randint(1, 6000)
                stream.feed(wave[fed[i]:fed[i] + size])
                fed[i] += size
            else:
                stream.end()
        for i, got in enumerate(advance(streams)):
            events[i] += got
        rounds += 1
    return events


def test_advance_gives_each_batched_stream_the_events_it_has_alone():
    """Streams fed in random pieces and advanced together give every stream the events (partials,
    finals, times) and the final text it gives alone; streams with other chunk options in the same
    call are encoded in their own batch, with their own events too."""
    from asr.streaming import Stream, StreamingOptions, advance

    model, tokenizer, features, cmvn = recognizer_parts()
    waves = [spoken(s, 10 + i) for i, s in enumerate((2.3, 1.1, 3.0, 0.5))]
    options = [StreamingOptions(chunk_size=4, beam_size=3, max_segment=m) for m in (0.0, 0.0, 1.0, 0.0)]
    options.append(StreamingOptions(chunk_size=8, left_chunks=1, beam_size=3))  # a group of its own
    waves.append(spoken(1.7, 20))
    alone = []
    for wave, o in zip(waves, options):
        stream = Stream(model, tokenizer, features, cmvn, o)
        alone.append(stream.accept_waveform(wave) + stream.finish())
    assert all(any(e.kind == "final" and e.text for e in events) for events in alone[:3])
    batches = []
    step = model.encoder._chunk_step

    def counted(chunks, caches, left):
        batches.append((len(chunks), left))
        return step(chunks, caches, left)

    model.encoder._chunk_step = counted
    for seed in range(2):
        streams = [Stream(model, tokenizer, features, cmvn, o) for o in options]
        events = feed_in_pieces(streams, waves, seed)
        for got, expected in zip(events, alone):
            assert [(e.kind, e.tokens, e.text) for e in got] == [(e.kind, e.tokens, e.text) for e in expected]
            assert [t for e in got for t in (e.start, e.end)] == pytest.approx([t for e in expected
                                                                                 for t in (e.start, e.end)])
        assert all(s.result() == " ".join(e.text for e in x if e.kind == "final" and e.text)
                   for s, x in zip(streams, alone))
    assert max(n for n, left in batches if left < 0) >= 3 and {left for _, left in batches} == {-1, 8}
    assert advance([]) == []


def test_a_stream_is_ready_with_a_whole_chunk_or_once_ended():
    """feed buffers without encoding; ready once a chunk of encoder frames waits (chunk 4 at 4x:
    19 feature frames, encoder frame 3 seeing frames 12 to 18), or once ended; the advance after
    end gives the last final and the stream is finished; no audio after end; a stream given twice
    to advance is refused."""
    from asr.streaming import Stream, StreamingOptions, advance

    model, tokenizer, features, cmvn = recognizer_parts()
    stream = Stream(model, tokenizer, features, cmvn, StreamingOptions(chunk_size=4, beam_size=3))
    wave = spoken(1.0, 4)
    stream.feed(wave[:160 * 17])  # 15 frames of a 25 ms window and 10 ms hop; a chunk needs 19
    assert not stream.ready and advance([stream]) == [[]] and stream._frames == 0
    stream.feed(wave[160 * 17:160 * 21])
    assert stream.ready
    events = advance([stream])[0]
    assert stream._frames == 4 and not stream.ready and all(e.kind == "partial" for e in events)
    stream.feed(wave[160 * 21:])
    stream.end()
    assert stream.ready and not stream.finished
    with pytest.raises(ValueError, match="ended"):
        stream.feed(wave[:100])
    events = advance([stream])[0]
    assert stream.finished and not stream.ready and events[-1].kind == "final"
    assert advance([stream]) == [[]]
    with pytest.raises(ValueError, match="finished"):
        stream.end()
    other = Stream(model, tokenizer, features, cmvn)
    with pytest.raises(ValueError, match="twice"):
        advance([other, other])
