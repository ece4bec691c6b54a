"""The network: subsampling lengths, attention, padding invariance, causality, the cache, the losses."""
from __future__ import annotations

import dataclasses
import itertools
import math
from pathlib import Path

import pytest
import torch
import yaml

from asr.audio import SAMPLE_RATE
from asr.config import from_dict
from asr.features import FeatureConfig, fbank
from asr.model import (
    ASRModel,
    Conv2dSubsampling,
    ModelConfig,
    MultiHeadAttention,
    build_model,
    check_ctc_feasible,
    conv_output_length,
    count_parameters,
    ctc_feasible,
    key_mask,
)
from asr.model.subsampling import RATES, right_context

CONF = Path(__file__).resolve().parents[1] / "conf"


from small_models import SMALL, small_model  # noqa: E402 (tests/)

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def random_targets(lengths: list[int], vocab: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Real-token targets (B, max len) padded with -1, and their lengths."""
    tokens = torch.full((len(lengths), max(lengths)), -1)
    for b, n in enumerate(lengths):
        tokens[b, :n] = torch.randint(2, vocab - 1, (n,), generator=generator)
    return tokens, torch.tensor(lengths)


# -- subsampling -------------------------------------------------------------------------------

@pytest.mark.parametrize("rate", RATES)
def test_output_lengths_over_a_grid(rate):
    """output_lengths equals the frames the convs really produce, never negative, ~T / rate."""
    sub = Conv2dSubsampling(n_mels=16, d_model=8, channels=4, rate=rate)
    assert sub.receptive_field == right_context(rate) + 1 == {4: 7, 6: 11, 8: 15}[rate]
    lengths = torch.arange(0, 120)
    out = sub.output_lengths(lengths)
    assert (out >= 0).all() and (out[: sub.receptive_field] == 0).all() and out[sub.receptive_field] == 1
    assert (out[1:] >= out[:-1]).all()
    for n in range(0, 120):
        x, x_lens = sub(torch.randn(1, n, 16), torch.tensor([n]))
        assert x_lens.item() == out[n].item() == conv_output_length(n, rate)
        if n >= sub.receptive_field:
            assert x.shape == (1, out[n].item(), 8)
            assert abs(out[n].item() - n / rate) <= right_context(rate) / rate + 1


@pytest.mark.parametrize("rate", RATES)
def test_subsampling_right_context(rate):
    """Output frame i depends on input frames rate*i .. rate*i + right_context, nothing later."""
    torch.manual_seed(0)
    sub = Conv2dSubsampling(n_mels=16, d_model=8, channels=4, rate=rate)
    feats = torch.randn(1, 60, 16)
    base, _ = sub(feats, torch.tensor([60]))
    for j in (0, 17, 40):
        changed = feats.clone()
        changed[0, j] += 1.0
        diff = (sub(changed, torch.tensor([60]))[0] - base).abs().amax(dim=-1)[0]  # (T',)
        depends = [i for i in range(diff.numel()) if diff[i] > 0]
        assert depends == [i for i in range(diff.numel()) if rate * i <= j <= rate * i + right_context(rate)]


# -- attention ---------------------------------------------------------------------------------

def reference_attention(q, k, v, mask=None, is_causal=False):
    """Plain matmul-softmax attention, the reference for SDPA."""
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.size(-1))  # (B, H, T, S)
    if is_causal:
        scores = scores.masked_fill(~torch.ones(scores.shape[-2:], dtype=torch.bool).tril(), -math.inf)
    if mask is not None:
        scores = scores.masked_fill(~mask, -math.inf)
    return scores.softmax(dim=-1) @ v


def test_sdpa_attention_matches_reference():
    torch.manual_seed(0)
    attn = MultiHeadAttention(d_model=24, n_heads=3).eval()
    x, memory = torch.randn(4, 7, 24), torch.randn(2, 9, 24)
    mask = key_mask(torch.tensor([9, 4]), 9)  # (2, 1, 1, 9)

    def finish(y):  # (B, H, T, dh) -> output projection, as attend does
        return attn.out_proj(y.transpose(1, 2).reshape(y.size(0), y.size(2), 24))

    q, k, v = attn.qkv(x)
    torch.testing.assert_close(attn(x, is_causal=True), finish(reference_attention(q, k, v, is_causal=True)))
    selfmask = key_mask(torch.tensor([7, 3, 5, 1]), 7)
    torch.testing.assert_close(attn(x, mask=selfmask), finish(reference_attention(q, k, v, mask=selfmask)))
    # cross-attention with 2 hypotheses per utterance: rows 0, 1 attend memory 0, rows 2, 3 memory 1
    mk, mv = attn.key_value(memory)
    got = attn.attend(attn.query(x), mk, mv, mask=mask)
    rows = torch.tensor([0, 0, 1, 1])
    want = finish(reference_attention(attn.query(x), mk[rows], mv[rows], mask=mask[rows]))
    torch.testing.assert_close(got, want)


def test_key_mask():
    mask = key_mask(torch.tensor([3, 0, 5]), 5)
    assert mask.shape == (3, 1, 1, 5) and mask.dtype == torch.bool
    assert mask[:, 0, 0].tolist() == [[True] * 3 + [False] * 2, [True] + [False] * 4, [True] * 5]


# -- encoder and decoder -----------------------------------------------------------------------

@pytest.mark.parametrize("rate, conv_kernel", [(4, 0), (6, 0), (8, 0), (4, 5), (8, 15)])
def test_padding_invariance(rate, conv_kernel):
    """An utterance alone and inside a padded batch with longer neighbours: same encoder output on
    its valid frames and the same decoder log-probs on its valid positions (float32, 1e-5); with
    the Conformer convolution block too (its kernel reaches into the padding of short utterances)."""
    model = small_model(subsampling=rate, conv_kernel=conv_kernel)
    g = torch.Generator().manual_seed(1)
    feat_lens = torch.tensor([57, 90, 123])
    feats = torch.randn(3, 123, 16, generator=g)  # padding frames are random too, not zeros
    tokens = torch.randint(2, 12, (3, 9), generator=g)
    token_lens = torch.tensor([5, 9, 7])
    h, h_lens = model.encoder(feats, feat_lens)
    lp = model.decoder(tokens, token_lens, h, h_lens)
    for b in range(3):
        n, m = feat_lens[b].item(), token_lens[b].item()
        h1, h1_lens = model.encoder(feats[b:b + 1, :n], feat_lens[b:b + 1])
        assert h1_lens.item() == h_lens[b].item() == h1.size(1)
        torch.testing.assert_close(h1[0], h[b, : h1.size(1)], atol=1e-5, rtol=1e-5)
        lp1 = model.decoder(tokens[b:b + 1, :m], token_lens[b:b + 1], h1, h1_lens)
        torch.testing.assert_close(lp1[0], lp[b, :m], atol=1e-5, rtol=1e-5)


def test_causality():
    """Changing token t + 1 never changes the log-probs at positions <= t."""
    model = small_model()
    g = torch.Generator().manual_seed(2)
    memory, memory_lens = torch.randn(2, 11, 32, generator=g), torch.tensor([11, 6])
    tokens = torch.randint(2, 12, (2, 10), generator=g)
    lens = torch.tensor([10, 10])
    base = model.decoder(tokens, lens, memory, memory_lens)
    for t in range(9):
        changed = tokens.clone()
        changed[:, t + 1] = (changed[:, t + 1] + 1 - 2) % 10 + 2
        out = model.decoder(changed, lens, memory, memory_lens)
        torch.testing.assert_close(out[:, : t + 1], base[:, : t + 1], atol=0, rtol=0)
        assert not torch.allclose(out[:, t + 1], base[:, t + 1])


@torch.inference_mode()
def test_cached_decoding_matches_forward():
    """Step by step with the cache (2 utterances x 3 hypotheses, capacity grown from 4) equals the
    teacher-forced forward over 40 steps, to 1e-5."""
    model = small_model()
    g = torch.Generator().manual_seed(3)
    memory, memory_lens = torch.randn(2, 15, 32, generator=g), torch.tensor([15, 8])
    steps, group = 40, 3
    tokens = torch.cat([torch.full((6, 1), model.config.sos), torch.randint(2, 12, (6, steps - 1), generator=g)], 1)
    rows = torch.arange(6) // group  # utterance of each row
    want = model.decoder(tokens, torch.full((6,), steps), memory[rows], memory_lens[rows])  # (6, steps, V)
    cache = model.decoder.init_cache(memory, memory_lens, rows=6, capacity=4)
    for t in range(steps):
        log_probs, cache = model.decoder.step(tokens[:, t], cache)
        torch.testing.assert_close(log_probs, want[:, t], atol=1e-5, rtol=1e-5)
    assert cache.length == steps and cache.capacity >= steps and cache.memory_kv.size(2) == 2


@torch.inference_mode()
def test_cache_reorder_and_drop():
    """Reordering hypotheses within their utterance, and dropping an utterance, keep the cache
    equal to the teacher-forced forward of the reordered histories."""
    model = small_model()
    g = torch.Generator().manual_seed(4)
    memory, memory_lens = torch.randn(3, 12, 32, generator=g), torch.tensor([12, 7, 10])
    history = torch.cat([torch.full((6, 1), model.config.sos), torch.randint(2, 12, (6, 5), generator=g)], 1)
    cache = model.decoder.init_cache(memory, memory_lens, rows=6)
    for t in range(3):
        _, cache = model.decoder.step(history[:, t], cache)
    index = torch.tensor([1, 1, 3, 2, 5, 5])  # within utterances (rows 2u, 2u + 1 are utterance u)
    cache, history = cache.reorder(index), history[index]
    _, cache = model.decoder.step(history[:, 3], cache)
    keep = torch.tensor([4, 5, 0, 1])  # drop utterance 1, swap the order of utterances 0 and 2
    cache, history = cache.reorder(keep), history[keep]
    log_probs, cache = model.decoder.step(history[:, 4], cache)
    utts = torch.tensor([2, 2, 0, 0])
    want = model.decoder(history[:, :5], torch.full((4,), 5), memory[utts], memory_lens[utts])[:, 4]
    torch.testing.assert_close(log_probs, want, atol=1e-5, rtol=1e-5)


@torch.inference_mode()
def test_cache_selection_copies_only_what_differs():
    """The cache keeps the inputs it has read, so selecting rows copies, of a row that takes another
    hypothesis of its utterance, only the positions from the first input they differ in, and of a
    row that takes another utterance's hypothesis, all of them; the counts (found on the device)
    say how many; the result is the cache of the selected histories, as the teacher-forced forward
    computes it."""
    model = small_model()
    g = torch.Generator().manual_seed(8)
    memory, memory_lens = torch.randn(3, 12, 32, generator=g), torch.tensor([12, 7, 10])
    history = torch.cat([torch.full((9, 1), model.config.sos), torch.randint(2, 12, (9, 6), generator=g)], 1)
    history[5, :4] = history[3, :4]  # rows 3 and 5 (utterance 1) share their first 4 inputs
    history[5, 4] = history[3, 4] + 1
    cache = model.decoder.init_cache(memory, memory_lens, rows=9, capacity=2)
    for t in range(5):
        _, cache = model.decoder.step(history[:, t], cache)
    # utterance 0 ends and utterance 2 (rows 6..8) fills its rows; row 5 takes row 3's hypothesis
    proposal = torch.tensor([6, 7, 8, 3, 4, 3, 0, 1, 2])  # the kept utterances first (2 of 3)
    counts = cache.selection_counts(proposal, torch.tensor(2))
    assert counts.tolist() == [4, 3 * 5 + 1, 1]  # rows moved, (row, position) pairs, utterances moved
    shared_part = cache.self_kv[:, :, 5, :4].mul_(1 + 1e-7).clone()  # marked: a copy would undo it
    cache.self_kv[:, :, 5, 4] = 1e6  # differs: must be overwritten
    index = proposal[:6]
    cache = cache.select(index, counts.tolist())
    assert torch.equal(cache.self_kv[:, :, 5, :4], shared_part)
    history = history[index]
    log_probs, cache = model.decoder.step(history[:, 5], cache)
    utts = torch.tensor([2, 2, 2, 1, 1, 1])
    want = model.decoder(history[:, :6], torch.full((6,), 6), memory[utts], memory_lens[utts])[:, 5]
    torch.testing.assert_close(log_probs, want, atol=1e-5, rtol=1e-5)
    assert cache.rows == 6 and cache.memory_kv.size(2) == 2


def test_short_input_gives_empty_output():
    """Inputs shorter than the receptive field: zero encoder frames, a finite loss, no crash."""
    model = small_model()
    feats, feat_lens = torch.randn(2, 5, 16), torch.tensor([5, 3])
    h, h_lens = model.encoder(feats, feat_lens)
    assert h_lens.tolist() == [0, 0] and torch.isfinite(h).all()
    out = model(feats, feat_lens, torch.tensor([[2, 3], [4, -1]]), torch.tensor([2, 1]))
    assert torch.isfinite(out.loss) and out.ctc_skipped.tolist() == [True, True]


# -- the model ---------------------------------------------------------------------------------

@pytest.mark.parametrize("tie, conv_kernel", [(False, 0), (True, 0), (False, 3)])
def test_every_parameter_gets_a_gradient(tie, conv_kernel):
    model = small_model(tie_embeddings=tie, conv_kernel=conv_kernel).train()
    g = torch.Generator().manual_seed(5)
    tokens, token_lens = random_targets([4, 6], 13, g)
    out = model(torch.randn(2, 50, 16, generator=g), torch.tensor([50, 41]), tokens, token_lens)
    out.loss.backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name


def test_tied_embeddings_share_the_matrix():
    tied, untied = small_model(tie_embeddings=True), small_model()
    assert tied.decoder.output.weight is tied.decoder.embed.weight
    assert count_parameters(untied) - count_parameters(tied) == 13 * 32


def test_bf16_autocast_matches_fp32_on_cpu():
    """bf16 autocast (8-bit mantissa, relative rounding 2^-8 = 0.4%) gives fp32's results within
    stated tolerances: losses 1% relative, encoder output 0.1 absolute (values of order 3),
    gradients 10% in relative norm with cosine similarity above 0.99 (measured: at most 0.1%,
    0.035 and 3.5% over five seeds). And the autocast pass did run its matrices in bf16."""
    model = small_model()
    g = torch.Generator().manual_seed(6)
    tokens, token_lens = random_targets([4, 6], 13, g)
    feats, feat_lens = torch.randn(2, 50, 16, generator=g), torch.tensor([50, 41])
    dtypes = []
    model.ctc.register_forward_hook(lambda module, args, output: dtypes.append(output.dtype))

    def run(autocast: bool):
        model.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out = model(feats, feat_lens, tokens, token_lens)
            with torch.no_grad():
                h, _ = model.encoder(feats, feat_lens)
        out.loss.backward()
        return out, h.float(), torch.cat([p.grad.flatten() for p in model.parameters()])

    ref, h_ref, grad_ref = run(autocast=False)
    out, h, grad = run(autocast=True)
    assert dtypes == [torch.float32, torch.bfloat16]
    assert out.loss.dtype == torch.float32 and torch.isfinite(out.loss)
    for name in ("loss", "att_loss", "ctc_loss"):
        torch.testing.assert_close(getattr(out, name), getattr(ref, name), rtol=1e-2, atol=0.0, msg=name)
    assert abs(out.accuracy - ref.accuracy) <= 1 / ref.num_tokens  # one argmax may flip
    assert out.ctc_skipped.tolist() == ref.ctc_skipped.tolist()
    torch.testing.assert_close(h, h_ref, rtol=0.0, atol=0.1)
    assert (grad - grad_ref).norm() <= 0.1 * grad_ref.norm()
    assert torch.nn.functional.cosine_similarity(grad, grad_ref, dim=0) > 0.99


def brute_force_ctc(log_probs: torch.Tensor, target: list[int]) -> float:
    """-log of the summed probability of every frame path (T, V) that collapses to `target`."""
    total = 0.0
    for path in itertools.product(range(log_probs.size(1)), repeat=log_probs.size(0)):
        collapsed = [s for i, s in enumerate(path) if s != 0 and (i == 0 or s != path[i - 1])]
        if collapsed == target:
            total += math.exp(sum(log_probs[t, s].item() for t, s in enumerate(path)))
    return -math.log(total)


def test_loss_matches_hand_computation():
    """V = 5 (blank, unk, tokens 2 and 3, sos/eos 4), 4 encoder frames: the attention loss from an
    explicit smoothed target distribution, the CTC loss by enumerating all 5^4 frame paths."""
    model = small_model(vocab_size=5, ctc_weight=0.4, lsm_weight=0.2)
    g = torch.Generator().manual_seed(7)
    feats, feat_lens = torch.randn(2, 19, 16, generator=g), torch.tensor([19, 19])  # 19 frames -> 4 at 4x
    tokens, token_lens = torch.tensor([[2, 3, 3], [3, -1, -1]]), torch.tensor([3, 1])
    out = model(feats, feat_lens, tokens, token_lens)
    h, h_lens = model.encoder(feats, feat_lens)
    assert h_lens.tolist() == [4, 4]
    ctc = sum(brute_force_ctc(model.ctc_log_probs(h)[b], t) for b, t in enumerate([[2, 3, 3], [3]]))
    att = 0.0
    for b, target in enumerate([[2, 3, 3, 4], [3, 4]]):
        inputs = torch.tensor([[4] + target[:-1]])
        log_probs = model.decoder(inputs, torch.tensor([len(target)]), h[b:b + 1], h_lens[b:b + 1])[0]
        for t, y in enumerate(target):
            q = torch.full((5,), 0.2 / 4)
            q[y] = 0.8
            att -= (q * log_probs[t]).sum().item()
    assert out.num_tokens.item() == 6 and out.num_utts.item() == 2
    assert out.ctc_loss.item() == pytest.approx(ctc / 2, rel=1e-5)
    assert out.att_loss.item() == pytest.approx(att / 6, rel=1e-5)
    assert out.loss.item() == pytest.approx(0.4 * ctc / 2 + 0.6 * att / 6, rel=1e-5)


def test_split_batch_with_global_normalizers_sums_to_whole():
    """Two halves of a batch with the whole batch's counts: losses and gradients add up to the whole's."""
    model = small_model().train()
    g = torch.Generator().manual_seed(8)
    feat_lens = torch.tensor([70, 45, 60, 33])
    feats = torch.randn(4, 70, 16, generator=g)
    tokens, token_lens = random_targets([5, 3, 7, 2], 13, g)
    whole = model(feats, feat_lens, tokens, token_lens)
    whole.loss.backward()
    want = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    num_tokens, num_utts = (token_lens + 1).sum(), 4
    total = 0.0
    for half in (slice(0, 2), slice(2, 4)):
        n, m = feat_lens[half].max(), token_lens[half].max()
        part = model(feats[half, :n], feat_lens[half], tokens[half, :m], token_lens[half],
                     num_tokens=num_tokens, num_utts=num_utts)
        part.loss.backward()
        total += part.loss.item()
    assert total == pytest.approx(whole.loss.item(), rel=1e-5)
    for p, w in zip(model.parameters(), want):
        torch.testing.assert_close(p.grad, w, atol=1e-6, rtol=1e-4)


def test_ctc_infeasible_utterance_is_skipped_not_infinite():
    model = small_model().train()
    g = torch.Generator().manual_seed(9)
    feats, feat_lens = torch.randn(2, 40, 16, generator=g), torch.tensor([40, 40])  # 9 frames each
    tokens = torch.tensor([[2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 2, 3], [2, 2, 2, 2, 2, 2, -1, -1, -1, -1, -1, -1]])
    token_lens = torch.tensor([12, 6])  # 12 labels > 9 frames; 6 labels + 5 repeats > 9 frames
    out = model(feats, feat_lens, tokens, token_lens)
    assert out.ctc_skipped.tolist() == [True, True] and out.ctc_loss.item() == 0.0
    out.loss.backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())
    feasible = ctc_feasible(torch.tensor([[2, 2, 3], [2, 3, 4]]), torch.tensor([3, 3]), torch.tensor([3, 3]))
    assert feasible.tolist() == [False, True]


def test_ctc_feasibility_at_build():
    check_ctc_feasible(4, 14.0)  # characters at 4x: 25 frames per second
    check_ctc_feasible(8, 3.5)  # BPE at 8x
    with pytest.raises(ValueError, match="8x subsampling gives 12.5 encoder frames per second") as e:
        build_model(dataclasses.replace(SMALL, subsampling=8), tokens_per_second=14.0)
    assert "\n" not in str(e.value)
    assert build_model(ModelConfig(**_small_dict(vocab_size=0)), vocab_size=40).config.vocab_size == 40


def test_build_model_keeps_the_training_label_rate():
    """The rate build_model checks is kept in the config (saved in model files); files without it load as 0."""
    model = build_model(SMALL, tokens_per_second=7.5)
    assert model.config.tokens_per_second == 7.5 and dataclasses.asdict(model.config)["tokens_per_second"] == 7.5
    old_file = {k: v for k, v in dataclasses.asdict(SMALL).items() if k != "tokens_per_second"}
    assert ModelConfig(**old_file).tokens_per_second == 0.0
    with pytest.raises(ValueError, match=r"^model\.tokens_per_second = -1"):
        ModelConfig(**_small_dict(tokens_per_second=-1.0))


def test_the_frame_shift_comes_from_the_frontend():
    """A 20 ms frontend: the encoder frame rate, the CTC check at build time and the frames the
    model really makes per second of audio all follow model.frame_shift_ms, not a fixed 10 ms."""
    config = dataclasses.replace(SMALL, frame_shift_ms=20.0)
    assert config.frames_per_second == 12.5 and SMALL.frames_per_second == 25.0  # 4x subsampling
    build_model(SMALL, tokens_per_second=14.0)  # 25 frames per second: enough for characters
    with pytest.raises(ValueError, match="4x subsampling gives 12.5 encoder frames per second"):
        build_model(config, tokens_per_second=14.0)
    features = FeatureConfig(n_mels=16, frame_length_ms=25.0, frame_shift_ms=20.0)
    wave = torch.randn(4 * SAMPLE_RATE, generator=torch.Generator().manual_seed(0)) * 0.1  # 4 s
    feats = fbank(wave, features)
    _, h_lens = ASRModel(config).encoder(feats[None], torch.tensor([feats.size(0)]))
    assert abs(h_lens.item() - 4 * config.frames_per_second) <= 1  # 49 frames of 4 s at 12.5 a second
    old_file = {k: v for k, v in dataclasses.asdict(SMALL).items() if k != "frame_shift_ms"}
    assert from_dict(ModelConfig, old_file).frame_shift_ms == 10.0  # model files from before still load
    with pytest.raises(ValueError, match=r"^model\.frame_shift_ms = 0"):
        ModelConfig(**_small_dict(frame_shift_ms=0.0))


def _small_dict(**changes) -> dict:
    return {**dataclasses.asdict(SMALL), **changes}


@pytest.mark.parametrize("changes, field", [
    ({"subsampling": 5}, "subsampling"), ({"d_model": 30}, "d_model"), ({"ctc_weight": 1.5}, "ctc_weight"),
    ({"vocab_size": 2}, "vocab_size"), ({"n_mels": 10, "subsampling": 8}, "n_mels"),
    ({"lsm_weight": 1.0}, "lsm_weight"), ({"encoder_layers": 0}, "encoder_layers"),
    ({"conv_kernel": 4}, "conv_kernel"), ({"conv_kernel": -1}, "conv_kernel"),
])
def test_config_errors_name_the_field(changes, field):
    with pytest.raises(ValueError, match=rf"^model\.{field} = ") as e:
        ModelConfig(**_small_dict(**changes))
    assert "\n" not in str(e.value)


def test_unset_vocabulary_is_refused():
    with pytest.raises(ValueError, match="vocab_size is not set"):
        ASRModel(ModelConfig())


def model_confs() -> list[Path]:
    return sorted(CONF.glob("*.yaml"))


def test_conf_has_the_four_model_files():
    assert {p.name for p in model_confs()} >= {"tiny.yaml", "synth.yaml", "librispeech_100h.yaml",
                                               "librispeech_960h.yaml"}


@pytest.mark.parametrize("path", model_confs(), ids=lambda p: p.name)
def test_every_conf_builds_a_model(path):
    """Every model YAML in conf/ (conf/decode/ aside) builds a model; its encoder and decoder run.
    On the meta device: shapes only, no memory, no time."""
    from asr.config import from_dict

    config = from_dict(ModelConfig, yaml.safe_load(path.read_text())["model"], source=str(path), prefix="model.")
    assert config.vocab_size == 0, "vocab_size comes from the tokenizer"
    with torch.device("meta"):
        model = build_model(config, vocab_size=300)
        h, h_lens = model.encoder(torch.empty(2, 100, config.n_mels), torch.tensor([100, 80]))
        log_probs = model.decoder(torch.zeros(2, 6, dtype=torch.long), torch.tensor([6, 4]), h, h_lens)
    assert h.shape == (2, conv_output_length(100, config.subsampling), config.d_model)
    assert log_probs.shape == (2, 6, 300)


def test_baseline_parameter_count():
    """librispeech_100h at a 300-token vocabulary: encoder + decoder = 27.25M, as ESPnet / WeNet."""
    config = ModelConfig(**yaml.safe_load((CONF / "librispeech_100h.yaml").read_text())["model"])
    with torch.device("meta"):
        model = build_model(config, vocab_size=300)
    assert count_parameters(model.encoder) + count_parameters(model.decoder) == 27_246_380
    assert count_parameters(model) == 27_246_380 + 300 * 257  # + the CTC head


def test_model_package_imports_only_torch():
    """asr/model is network math: it imports torch, itself and the token-id leaf asr.tokens,
    nothing else of ours (tests/test_imports.py checks the whole graph)."""
    package = Path(__file__).resolve().parents[1] / "asr" / "model"
    for path in package.glob("*.py"):
        for line in path.read_text().splitlines():
            words = line.split()
            if words[:1] in (["import"], ["from"]) and words[1].split(".")[0] == "asr":
                assert words[1].startswith("asr.model") or words[1] == "asr.tokens", f"{path.name}: {line}"


@pytest.mark.parametrize("encoder", ["transformer", "conformer"])
def test_a_training_forward_and_backward_read_nothing_on_the_host(encoder):
    """The loss and its gradients make no host read of tensor data (tests/host_syncs.py counts, on
    the CPU, what would make the host wait for a GPU): the attention loss masks padded targets
    rather than selecting them, and CTC takes lengths the caller keeps on the host."""
    from host_syncs import HostSyncs  # tests/host_syncs.py
    from small_models import SMALL  # tests/small_models.py

    torch.manual_seed(0)
    model = ASRModel(dataclasses.replace(SMALL, encoder=encoder, conv_kernel=7)).train()
    g = torch.Generator().manual_seed(0)
    feats, feat_lens = torch.randn(3, 180, SMALL.n_mels, generator=g), torch.tensor([180, 131, 77])
    token_lens = torch.tensor([9, 7, 4])
    tokens = torch.randint(1, SMALL.vocab_size - 2, (3, 9), generator=g)
    tokens = tokens.masked_fill(torch.arange(9) >= token_lens[:, None], -1)
    with HostSyncs() as syncs:
        model(feats, feat_lens, tokens, token_lens).loss.backward()
    assert syncs.count == 0, syncs.where
    assert all(p.grad is not None for p in model.parameters())


@pytest.mark.parametrize("encoder", ["transformer", "conformer"])
def test_intermediate_ctc_adds_the_ctc_head_on_the_chosen_layers(encoder):
    """interctc_weight w, layers (1, 2): CTC = (1 - w) * the final layer's + w * the mean of the
    CTC head's losses on layers 1 and 2 (through the final LayerNorm); w = 0 leaves the loss as it
    was; the encoder's output is the same with or without intermediate layers kept."""
    from small_models import SMALL  # tests/small_models.py

    config = dataclasses.replace(SMALL, encoder=encoder, conv_kernel=7, encoder_layers=3, dropout=0.0)
    torch.manual_seed(0)
    plain = ASRModel(config).eval()
    inter = ASRModel(dataclasses.replace(config, interctc_weight=0.4, interctc_layers=(1, 2))).eval()
    inter.load_state_dict(plain.state_dict())
    g = torch.Generator().manual_seed(0)
    feats, feat_lens = torch.randn(3, 180, SMALL.n_mels, generator=g), torch.tensor([180, 131, 77])
    token_lens = torch.tensor([9, 7, 4])
    tokens = torch.randint(1, SMALL.vocab_size - 2, (3, 9), generator=g)
    tokens = tokens.masked_fill(torch.arange(9) >= token_lens[:, None], -1)
    with torch.no_grad():
        base, mixed = plain(feats, feat_lens, tokens, token_lens), inter(feats, feat_lens, tokens, token_lens)
        h, h_lens, layers = inter.encoder.forward_intermediate(feats, feat_lens, (1, 2))
        assert torch.equal(h, plain.encoder(feats, feat_lens)[0]) and len(layers) == 2

        def ctc(x: torch.Tensor) -> float:
            lp = inter.ctc_log_probs(x).transpose(0, 1)
            return float(torch.nn.functional.ctc_loss(lp, tokens.clamp(min=0), h_lens, token_lens,
                                                       reduction="sum", zero_infinity=True)) / 3

        final, first, second = ctc(h), ctc(layers[0]), ctc(layers[1])
    assert float(base.ctc_loss) == pytest.approx(final, rel=1e-5)
    expected = 0.6 * final + 0.4 * (first + second) / 2
    assert float(mixed.ctc_loss) == pytest.approx(expected, rel=1e-5)
    assert float(mixed.att_loss) == pytest.approx(float(base.att_loss), rel=1e-6)
    assert abs(float(mixed.ctc_loss) - float(base.ctc_loss)) > 1e-3  # the layers' losses count
    for bad in ({"interctc_weight": 0.3}, {"interctc_layers": (1,)}, {"interctc_weight": 0.3, "interctc_layers": (3,)},
                {"interctc_weight": 0.3, "interctc_layers": (2, 1)}):
        with pytest.raises(ValueError, match="model.interctc"):
            dataclasses.replace(config, **bad)
