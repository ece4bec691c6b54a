"""The conformer encoder: padding invariance, lengths, relative-position attention against an explicit
reference, training, the config key in model files, and the config's checks."""
from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest
import torch
from small_models import SMALL  # tests/small_models.py

from asr.api import load_model
from asr.checkpoint import model_file, save_atomic
from asr.config import from_dict, to_dict
from asr.features import CMVNStats, FeatureConfig, fbank
from asr.model import ASRModel, ConformerEncoder, ModelConfig, RelPositionAttention, build_model, key_mask
from asr.model.conformer import rel_shift, relative_encodings
from asr.model.encoder import sinusoidal_positions
from asr.model.subsampling import RATES, conv_output_length
from asr.tokenizer import CharTokenizer

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

CONFORMER = dataclasses.replace(SMALL, encoder="conformer", conv_kernel=7)


def conformer_model(seed: int = 0, **changes) -> ASRModel:
    torch.manual_seed(seed)
    return ASRModel(dataclasses.replace(CONFORMER, **changes)).eval()


@pytest.mark.parametrize("rate", RATES)
@pytest.mark.parametrize("train", [False, True], ids=["eval", "train"])
def test_conformer_padding_invariance(rate, train):
    """Each utterance alone and inside a batch padded past its end (random values in the padding):
    the same encoder output on its valid frames, in eval mode and in train mode with dropout 0."""
    model = conformer_model(subsampling=rate).train(train)
    g = torch.Generator().manual_seed(1)
    feat_lens = torch.tensor([41, 97, 130])
    feats = torch.randn(3, 150, 16, generator=g)  # 20 frames of padding past the longest
    h, h_lens = model.encoder(feats, feat_lens)
    for b in range(3):
        n = feat_lens[b].item()
        h1, h1_lens = model.encoder(feats[b:b + 1, :n], feat_lens[b:b + 1])
        assert h1_lens.item() == h_lens[b].item() == h1.size(1) > 0
        torch.testing.assert_close(h1[0], h[b, :h1.size(1)], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("rate", RATES)
def test_conformer_output_lengths(rate):
    """Over a grid of input lengths, one batch each with its neighbours: output lengths equal the
    subsampler's formula, the output has the longest of them frames, and every value is finite."""
    model = conformer_model(subsampling=rate)
    g = torch.Generator().manual_seed(2)
    for n in range(0, 90, 3):
        feat_lens = torch.tensor([n, max(n - 7, 0), n // 2])
        h, h_lens = model.encoder(torch.randn(3, n, 16, generator=g), feat_lens)
        want = [conv_output_length(m, rate) for m in feat_lens.tolist()]
        assert h_lens.tolist() == want == model.encoder.subsampling.output_lengths(feat_lens).tolist()
        assert h.shape == (3, max(want[0], 1), 32) and torch.isfinite(h).all()


def reference_rel_attention(attn: RelPositionAttention, x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """Every score from its explicit relative distance i - j, no shift: ((q_i + u) . k_j +
    (q_i + v) . P(i - j)) / sqrt(dh), P(r) the projected sinusoidal encoding of r; masked softmax,
    weighted values, output projection."""
    b, t, d = x.shape
    heads, dh = attn.n_heads, d // attn.n_heads
    q, k, v = attn.qkv(x)  # (B, H, T, dh)
    i = torch.arange(t)
    distance = i[:, None] - i[None, :]  # (T, T): i - j
    p = attn.pos_proj(sinusoidal_positions(distance.flatten(), d).to(x.dtype)).view(t, t, heads, dh)  # P(i - j)
    content = torch.einsum("bhid,bhjd->bhij", q + attn.pos_bias_u[:, None], k)
    position = torch.einsum("bhid,ijhd->bhij", q + attn.pos_bias_v[:, None], p)
    scores = (content + position) / math.sqrt(dh)
    valid = i[None, :] < lengths[:, None]  # (B, T) keys
    scores = scores.masked_fill(~valid[:, None, None, :], -math.inf)
    y = scores.softmax(dim=-1) @ v  # (B, H, T, dh)
    return attn.out_proj(y.transpose(1, 2).reshape(b, t, d))


def test_rel_pos_attention_matches_reference():
    """The SDPA module (query q + u, position scores shifted into a pre-scaled additive bias with the
    padding folded in) equals the explicit per-distance computation: outputs on valid frames and
    the gradients of every parameter, float64."""
    torch.manual_seed(3)
    attn = RelPositionAttention(d_model=24, n_heads=3).double()
    with torch.no_grad():  # u and v away from their initialization: every term matters
        attn.pos_bias_u.normal_()
        attn.pos_bias_v.normal_()
    x = torch.randn(3, 11, 24, dtype=torch.float64)
    lengths = torch.tensor([11, 6, 1])
    got = attn(x, relative_encodings(11, 24).double(), key_mask(lengths, 11))
    want = reference_rel_attention(attn, x, lengths)
    valid = torch.arange(11)[None, :] < lengths[:, None]
    torch.testing.assert_close(got[valid], want[valid], atol=1e-10, rtol=1e-10)
    grads = []
    for out in (got, want):
        attn.zero_grad()
        (out[valid] * torch.linspace(-1, 1, 24, dtype=torch.float64)).sum().backward()
        grads.append({name: p.grad.clone() for name, p in attn.named_parameters()})
    for name, grad in grads[0].items():
        assert grad.abs().sum() > 0, name
        torch.testing.assert_close(grad, grads[1][name], atol=1e-10, rtol=1e-8, msg=name)


def test_rel_shift_picks_the_entry_of_each_distance():
    """rel_shift(s)[i, j] = s[i, T - 1 - i + j]: with s[i, k] = 100 i + (T - 1 - k) (the position of
    column k), out[i, j] = 100 i + (i - j)."""
    t = 5
    k = torch.arange(2 * t - 1)
    scores = (100 * torch.arange(t)[:, None] + (t - 1 - k)[None, :]).expand(2, 3, t, 2 * t - 1)
    i = torch.arange(t)
    want = 100 * i[:, None] + (i[:, None] - i[None, :])
    assert torch.equal(rel_shift(scores), want.expand(2, 3, t, t))
    assert torch.equal(relative_encodings(t, 8)[t - 1 - 2], sinusoidal_positions(torch.tensor([2]), 8)[0])


def test_conformer_trains_and_every_parameter_learns():
    """A tiny conformer ASRModel: every parameter gets a gradient, and 8 Adam steps on one batch
    (dropout on) lower the loss."""
    model = conformer_model(dropout=0.1, attention_dropout=0.1).train()
    g = torch.Generator().manual_seed(4)
    feats, feat_lens = torch.randn(3, 60, 16, generator=g), torch.tensor([60, 47, 52])
    tokens = torch.randint(2, 12, (3, 5), generator=g)
    token_lens = torch.tensor([5, 3, 4])
    optimizer = torch.optim.Adam(model.parameters(), lr=2e-3)
    losses = []
    for step in range(8):
        optimizer.zero_grad()
        out = model(feats, feat_lens, tokens, token_lens)
        out.loss.backward()
        if step == 0:
            for name, p in model.named_parameters():
                assert p.grad is not None and p.grad.abs().sum() > 0, name
        optimizer.step()
        losses.append(out.loss.item())
    assert all(math.isfinite(x) for x in losses)
    assert losses[-1] < 0.8 * losses[0], losses


def test_model_file_round_trips_the_encoder_key(tmp_path: Path):
    """A conformer's model file keeps `encoder: conformer`; asr.load_model builds the same network
    (same encoder output); a model dict without the key (files from before) loads as a transformer."""
    model = conformer_model(vocab_size=12, n_mels=80)
    stats = CMVNStats()
    stats.add(fbank(torch.randn(16000, generator=torch.Generator().manual_seed(5)) * 0.1, FeatureConfig()))
    obj = model_file(model=to_dict(model.config), tokenizer=CharTokenizer(list("ABCDEFGH ")).to_dict(),
                     frontend={"features": to_dict(FeatureConfig()), "cmvn": stats.to_dict()},
                     state_dict=model.state_dict())
    save_atomic(obj, tmp_path / "model.pt")
    loaded = load_model(tmp_path / "model.pt").model
    assert loaded.config.encoder == "conformer" and loaded.config == model.config
    assert isinstance(loaded.encoder, ConformerEncoder)
    feats, feat_lens = torch.randn(2, 70, 80), torch.tensor([70, 44])
    torch.testing.assert_close(loaded.encoder(feats, feat_lens)[0], model.encoder(feats, feat_lens)[0])
    old = {k: v for k, v in to_dict(SMALL).items() if k not in ("encoder", "decoder_ffn_dim")}
    assert from_dict(ModelConfig, old, prefix="model.").encoder == "transformer"


def test_decoder_ffn_dim():
    """decoder_ffn_dim sets the decoder's feed-forward width apart from the encoder's (ESPnet's
    LibriSpeech-100h conformer: 1024 in the encoder, 2048 in the decoder); 0 keeps ffn_dim."""
    model = conformer_model(ffn_dim=48, decoder_ffn_dim=80)
    assert model.encoder.layers[0].ffn.net[0].out_features == 48
    assert model.decoder.layers[0].ffn.net[0].out_features == 80
    assert conformer_model(ffn_dim=48).decoder.layers[0].ffn.net[0].out_features == 48


@pytest.mark.parametrize("changes, field", [
    ({"encoder": "lstm"}, "encoder"),
    ({"encoder": "conformer", "conv_kernel": 0}, "conv_kernel"),
    ({"encoder": "conformer", "conv_kernel": 4}, "conv_kernel"),
    ({"encoder": "conformer", "conv_kernel": -3}, "conv_kernel"),
    ({"decoder_ffn_dim": -1}, "decoder_ffn_dim"),
])
def test_config_rejects_bad_encoder_settings(changes, field):
    with pytest.raises(ValueError, match=rf"^model\.{field} = ") as e:
        ModelConfig(**{**dataclasses.asdict(SMALL), **changes})
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match=rf"model\.{field}"):  # through a YAML section too
        from_dict(ModelConfig, {k: v for k, v in changes.items()}, source="x.yaml", prefix="model.")


def test_bf16_autocast_runs():
    """Under CPU bf16 autocast the conformer's loss is finite and within 2% of fp32 (the biases u,
    v and the position bias follow the query's dtype)."""
    model = conformer_model()
    g = torch.Generator().manual_seed(6)
    feats, feat_lens = torch.randn(2, 50, 16, generator=g), torch.tensor([50, 41])
    tokens, token_lens = torch.tensor([[2, 3, 4, 5], [6, 7, 8, -1]]), torch.tensor([4, 3])
    ref = model(feats, feat_lens, tokens, token_lens).loss
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(feats, feat_lens, tokens, token_lens).loss
    assert torch.isfinite(out) and abs(out.item() - ref.item()) <= 0.02 * ref.item()


def test_build_model_on_the_meta_device():
    with torch.device("meta"):
        model = build_model(CONFORMER)
    assert isinstance(model.encoder, ConformerEncoder) and model.encoder.d_model == 32
    assert model.encoder.subsampling.receptive_field == 7


@pytest.mark.gpu
@pytest.mark.parametrize("encoder", ["transformer", "conformer"])
def test_training_on_cuda_runs_no_cudnn_attention(encoder):
    """A bf16 training step on CUDA, profiled: every attention runs on the kernels `attention.sdpa`
    names (flash for the decoder's causal self-attention, memory-efficient for padded and biased
    attention), never cuDNN's, which builds a plan for every new shape; and the same loss as
    fp32 to bf16's precision."""
    from torch.profiler import ProfilerActivity, profile

    torch.manual_seed(0)
    model = ASRModel(dataclasses.replace(CONFORMER, encoder=encoder, dropout=0.0)).cuda().train()
    g = torch.Generator().manual_seed(0)
    feats = torch.randn(3, 180, SMALL.n_mels, generator=g).cuda()
    feat_lens = torch.tensor([180, 131, 77]).cuda()
    tokens = torch.randint(1, SMALL.vocab_size - 2, (3, 9), generator=g).cuda()
    token_lens = torch.tensor([9, 7, 4]).cuda()
    tokens = tokens.masked_fill(torch.arange(9, device="cuda") >= token_lens[:, None], -1)
    reference = model(feats, feat_lens, tokens, token_lens).loss.item()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(feats, feat_lens, tokens, token_lens).loss
        loss.backward()
        torch.cuda.synchronize()
    names = {e.key for e in prof.key_averages()}
    attention = {n for n in names if "attention" in n and n.startswith("aten::_")}
    assert not {n for n in attention if "cudnn" in n}, attention
    assert any("efficient_attention" in n for n in attention), attention
    assert any("flash_attention" in n for n in attention), attention
    assert loss.item() == pytest.approx(reference, rel=0.05)
