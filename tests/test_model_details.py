"""The model's details that the equivalence tests cannot see (DESIGN.md, "the classic transformer,
done right"): the pre-LayerNorm residual order and the final norms, the initialization each matrix
is meant to get, the embedding scale and the sinusoids against their formula written here, and the
self-attention weights of the explicit attention path (attention pictures) beside the fused path."""
from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from small_models import SMALL  # tests/small_models.py
from torch import nn

from asr.model import ASRModel, ModelConfig, MultiHeadAttention, key_mask
from asr.model.encoder import sinusoidal_positions
from asr.search import SearchOptions, search

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

ENCODERS = {  # the encoder kinds, as SMALL's changes
    "transformer": {},
    "transformer_conv": {"conv_kernel": 5},  # a transformer with a convolution block in every layer
    "conformer": {"encoder": "conformer", "conv_kernel": 7},
}
FEAT_LENS = [90, 41, 5]  # feature frames: 21, 9 and 0 encoder frames at 4x


def model_of(part: str, seed: int = 0, dtype: torch.dtype = torch.float64) -> ASRModel:
    """SMALL with the encoder of `part` (ENCODERS; the transformer for "decoder"), in eval mode, with
    every LayerNorm's scale and shift drawn at random: which norm runs where then shows in the output."""
    torch.manual_seed(seed)
    model = ASRModel(dataclasses.replace(SMALL, **ENCODERS.get(part, {}))).eval().to(dtype)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, nn.LayerNorm):
                module.weight.normal_(1.0, 0.5)
                module.bias.normal_(0.0, 0.5)
    return model


def random_feats(model: ASRModel, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    feats = torch.randn(len(FEAT_LENS), max(FEAT_LENS), model.config.n_mels, generator=g, dtype=torch.float64)
    return feats.to(model.ctc.weight.dtype), torch.tensor(FEAT_LENS)


def decoder_inputs(model: ASRModel, seed: int = 2):
    """tokens (3, 7) starting with sos, token_lens, memory (3, 12, d) with random padding, memory_lens."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(2, model.config.vocab_size - 1, (3, 7), generator=g)
    tokens[:, 0] = model.config.sos
    memory = torch.randn(3, 12, model.config.d_model, generator=g, dtype=torch.float64)
    return tokens, torch.tensor([7, 4, 1]), memory.to(model.ctc.weight.dtype), torch.tensor([12, 5, 1])


def residual_stream(shape: tuple[int, ...], seed: int = 3) -> torch.Tensor:
    """A residual stream far from normalized (mean 1, scale 3 per frame, float64): a LayerNorm of
    it, or a sublayer fed it unnormalized, changes it visibly."""
    g = torch.Generator().manual_seed(seed)
    return 1.0 + 3.0 * torch.randn(*shape, generator=g, dtype=torch.float64)


# ---------------------------------------------------------------------------------------------
# pre-LayerNorm residual blocks and the final norms


def encoder_layer_reference(layer: nn.Module, x: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor):
    """DESIGN.md's pre-LN block from the layer's own sublayers: x + f(LN(x)) for each sublayer f in
    order; the conformer's macaron halves and its closing LayerNorm (ESPnet's norm_final)."""
    valid = mask[:, 0, 0, :]  # (B, T)
    if hasattr(layer, "norm_out"):  # conformer
        x = x + 0.5 * layer.ffn_macaron(layer.norm_ffn_macaron(x))
        x = x + layer.self_attn(layer.norm_attn(x), positions, mask)
        x = x + layer.conv(layer.norm_conv(x), valid)
        x = x + 0.5 * layer.ffn(layer.norm_ffn(x))
        return layer.norm_out(x)
    x = x + layer.self_attn(layer.norm1(x), mask=mask)
    if layer.conv_kernel > 0:
        x = x + layer.conv(layer.norm_conv(x), valid)
    return x + layer.ffn(layer.norm2(x))


def decoder_layer_reference(layer: nn.Module, x: torch.Tensor, memory: torch.Tensor, mask: torch.Tensor):
    """Causal self-attention, cross-attention, feed-forward, each x + f(LN(x))."""
    x = x + layer.self_attn(layer.norm1(x), is_causal=True)
    k, v = layer.cross_attn.key_value(memory)
    x = x + layer.cross_attn.attend(layer.cross_attn.query(layer.norm2(x)), k, v, mask=mask)
    return x + layer.ffn(layer.norm3(x))


def silence_sublayers(model: ASRModel) -> None:
    """Zero the last matrix and bias of every sublayer (attention, feed-forward, convolution): each
    then adds exactly 0 to the residual stream."""
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, MultiHeadAttention):
                last = module.out_proj
            elif hasattr(module, "pointwise_out"):  # ConvModule
                last = module.pointwise_out
            elif hasattr(module, "net"):  # FeedForward
                last = module.net[-1]
            else:
                continue
            last.weight.zero_()
            last.bias.zero_()


def layers_io(stack: nn.Module, run) -> tuple[tuple, torch.Tensor]:
    """(the first layer's inputs, the last layer's output) while `run()` runs the stack."""
    seen = {}

    def keep_inputs(module, args, out) -> None:  # (a hook returning something would replace the output)
        seen.setdefault("in", args)

    def keep_output(module, args, out) -> None:
        seen["out"] = out

    first = stack.layers[0].register_forward_hook(keep_inputs)
    last = stack.layers[-1].register_forward_hook(keep_output)
    try:
        run()
    finally:
        first.remove()
        last.remove()
    return seen["in"], seen["out"]


@pytest.mark.parametrize("part", [*ENCODERS, "decoder"])
def test_pre_ln_order_and_final_norms(part):
    """Each layer equals its pre-LN composition written above (a post-LN block, a missing or swapped
    norm, another order of the sublayers all differ, the norms' scales and shifts being random); with
    every sublayer silenced a block passes the residual stream through unnormalized (the conformer's
    then only through its closing norm); the stack's output is its final LayerNorm of the last
    layer's output."""
    model = model_of(part)
    if part == "decoder":
        tokens, token_lens, memory, memory_lens = decoder_inputs(model)
        stack, mask = model.decoder, key_mask(memory_lens, memory.size(1))
        x = residual_stream((3, 7, model.config.d_model))
        for layer in stack.layers:
            torch.testing.assert_close(layer(x, *layer.cross_attn.key_value(memory), mask),
                                       decoder_layer_reference(layer, x, memory, mask), atol=1e-12, rtol=0)
        _, last = layers_io(stack, lambda: stack(tokens, token_lens, memory, memory_lens))
        out = stack(tokens, token_lens, memory, memory_lens)  # log-probabilities (B, L, V) float32
        torch.testing.assert_close(out, stack.output(stack.norm(last)).float().log_softmax(-1), atol=1e-6, rtol=0)
        silence_sublayers(model)
        for layer in stack.layers:
            assert torch.equal(layer(x, *layer.cross_attn.key_value(memory), mask), x)
        return
    feats, feat_lens = random_feats(model)
    stack = model.encoder
    (x0, *rest), last = layers_io(stack, lambda: stack(feats, feat_lens))
    *extra, mask, valid = rest  # extra: the conformer's relative encodings
    positions = extra[0] if extra else None
    x = residual_stream(x0.shape)
    args = (x, *extra, mask, valid)
    for layer in stack.layers:
        torch.testing.assert_close(layer(*args), encoder_layer_reference(layer, x, mask, positions),
                                   atol=1e-12, rtol=0)
    h, _ = stack(feats, feat_lens)
    torch.testing.assert_close(h, stack.norm(last), atol=1e-12, rtol=0)  # the final norm, on every frame
    assert not torch.allclose(h, last, atol=1e-3)  # (the last layer's output is not already normalized alike)
    silence_sublayers(model)
    for layer in stack.layers:
        assert torch.equal(layer(*args), layer.norm_out(x) if part == "conformer" else x)


# ---------------------------------------------------------------------------------------------
# initialization


BIG = ModelConfig(vocab_size=1000, n_mels=80, conv_channels=128, d_model=256, n_heads=4, ffn_dim=1024,
                  encoder_layers=1, decoder_layers=1)  # big enough for tight statistics, quick to build


def assert_uniform(w: torch.Tensor, bound: float, name: str) -> None:
    """w's entries look like n independent draws of U(-bound, bound): none outside the bound, the
    largest within 20 / n of it (all n below that: probability e^-20), mean 0 and variance
    bound^2 / 3 within 6 standard errors (a uniform's w^2 has variance 0.8 (bound^2 / 3)^2).
    A normal of the same variance passes the bound, a narrower or wider uniform misses the variance."""
    w = w.detach().double().flatten()
    n, var = w.numel(), bound ** 2 / 3
    top = w.abs().max().item()
    assert bound * (1 - 20 / n) <= top <= bound * (1 + 1e-6), f"{name}: max |w| {top:.4g}, bound {bound:.4g}"
    assert abs(w.mean().item()) <= 6 * math.sqrt(var / n), f"{name}: mean {w.mean().item():.3g}"
    ratio = w.square().mean().item() / var
    assert abs(ratio - 1) <= 6 * math.sqrt(0.8 / n), f"{name}: variance {ratio:.4f} x {var:.4g} ({n} entries)"


def assert_normal(w: torch.Tensor, std: float, name: str) -> None:
    """w's entries look like draws of N(0, std^2): variance within 6 standard errors (w^2 has
    variance 2 std^4), and the fourth moment 3 std^4 (a uniform's is 1.8) within 6 of its (96 std^8)."""
    w = w.detach().double().flatten()
    n = w.numel()
    ratio = w.square().mean().item() / std ** 2
    assert abs(ratio - 1) <= 6 * math.sqrt(2 / n), f"{name}: variance {ratio:.4f} x {std ** 2:.4g}"
    kurtosis = (w / std).pow(4).mean().item()
    assert abs(kurtosis - 3) <= 6 * math.sqrt(96 / n), f"{name}: fourth moment {kurtosis:.3f} std^4, not 3"


def xavier_bound(fan_in: int, fan_out: int) -> float:
    return math.sqrt(6 / (fan_in + fan_out))


def intended_initialization(model: ASRModel) -> dict[str, tuple]:
    """What ASRModel.reset_parameters and the conformer mean each parameter to get, by name:
    ("uniform", bound), ("normal", std), ("const", value), or ("chunks", bound) for the packed
    (3 d, d) attention in-projection, xavier-uniform on each (d, d) third as if separate."""
    d = model.config.d_model
    intended: dict[str, tuple] = {}
    for prefix, module in model.named_modules():
        own = {name: p for name, p in module.named_parameters(prefix=prefix, recurse=False)}
        if isinstance(module, MultiHeadAttention):
            intended[f"{prefix}.in_weight"] = ("chunks", xavier_bound(d, d))
            intended[f"{prefix}.in_bias"] = ("const", 0.0)
            for name in ("pos_bias_u", "pos_bias_v"):  # RelPositionAttention: xavier over (H, dh)
                if f"{prefix}.{name}" in own:
                    intended[f"{prefix}.{name}"] = ("uniform", xavier_bound(d // model.config.n_heads,
                                                                            model.config.n_heads))
        elif isinstance(module, (nn.Linear, nn.Conv2d)):
            w = module.weight
            taps = w[0, 0].numel() if w.dim() == 4 else 1  # a Conv2d's kernel: fans count its taps
            intended[f"{prefix}.weight"] = ("uniform", xavier_bound(w.size(1) * taps, w.size(0) * taps))
            if module.bias is not None:
                intended[f"{prefix}.bias"] = ("const", 0.0)
        elif isinstance(module, nn.Conv1d):  # the depthwise conv: torch's default, U(+-1/sqrt(k)) both
            fan_in = module.weight[0].numel()
            intended[f"{prefix}.weight"] = intended[f"{prefix}.bias"] = ("uniform", fan_in ** -0.5)
        elif isinstance(module, nn.LayerNorm):
            intended[f"{prefix}.weight"], intended[f"{prefix}.bias"] = ("const", 1.0), ("const", 0.0)
        elif isinstance(module, nn.Embedding):
            intended[f"{prefix}.weight"] = ("normal", d ** -0.5)  # sqrt(d) x embedding: unit variance
    return intended


@pytest.mark.parametrize("encoder", ["transformer", "conformer"])
def test_xavier_uniform_initialisation(encoder):
    """Every parameter of a model of 256 dimensions against what the code intends for it (each one
    checked: a parameter added without an intended initialization fails here). Caught: a plain
    normal_, torch's default kaiming-uniform on a Linear (variance 1/3 of xavier's on a square one),
    xavier over the packed (3 d, d) matrix as a whole (half the variance), an embedding left N(0, 1)."""
    torch.manual_seed(0)
    model = ASRModel(dataclasses.replace(BIG, encoder=encoder, conv_kernel=15 if encoder == "conformer" else 0))
    parameters = dict(model.named_parameters())
    intended = intended_initialization(model)
    assert sorted(intended) == sorted(parameters)
    for name, (kind, value) in intended.items():
        w = parameters[name]
        if kind == "chunks":
            assert w.shape == (3 * model.config.d_model, model.config.d_model), name
            for part, chunk in zip("qkv", w.chunk(3)):
                assert_uniform(chunk, value, f"{name}[{part}]")
        elif kind == "uniform":
            assert_uniform(w, value, name)
        elif kind == "normal":
            assert_normal(w, value, name)
        else:
            assert torch.equal(w, torch.full_like(w, value)), name


# ---------------------------------------------------------------------------------------------
# embedding scale and sinusoids


def formula_positions(positions: list[int], d: int) -> torch.Tensor:
    """(P, d) float64: PE[p, 2i] = sin(p / 10000^(2i/d)), PE[p, 2i+1] = cos(p / 10000^(2i/d))."""
    table = torch.empty(len(positions), d, dtype=torch.float64)
    for row, p in enumerate(positions):
        for i in range(d // 2):
            angle = p / 10000 ** (2 * i / d)
            table[row, 2 * i], table[row, 2 * i + 1] = math.sin(angle), math.cos(angle)
    return table


def position_tolerance(positions: list[int]) -> torch.Tensor:
    """(P, 1): float32 rounding of the angle p x frequency grows with p (about 2e-8 p)."""
    return 1e-6 + 6e-8 * torch.tensor(positions, dtype=torch.float64)[:, None].abs()


def test_embedding_scale_and_sinusoids_match_the_formula():
    """sinusoidal_positions against the formula; the decoder's first layer reads embed(token) x
    sqrt(d) + PE(position) and the transformer encoder's subsampled x sqrt(d) + PE(frame); the
    conformer's first layer reads x sqrt(d) and the relative encodings of T - 1 .. -(T - 1)."""
    for d in (2, 8, 256):
        positions = [*range(128), 1000, 4999]
        error = (sinusoidal_positions(torch.tensor(positions), d).double() - formula_positions(positions, d)).abs()
        assert (error <= position_tolerance(positions)).all(), d

    model = model_of("decoder")
    tokens, token_lens, memory, memory_lens = decoder_inputs(model)
    (x, *_), _ = layers_io(model.decoder, lambda: model.decoder(tokens, token_lens, memory, memory_lens))
    d, length = model.config.d_model, tokens.size(1)
    want = model.decoder.embed.weight[tokens] * math.sqrt(d) + formula_positions(list(range(length)), d)
    torch.testing.assert_close(x, want, atol=1e-6, rtol=0)

    feats, feat_lens = random_feats(model)
    subsampled, _ = model.encoder.subsampling(feats, feat_lens)  # (B, T', d)
    (x, *_), _ = layers_io(model.encoder, lambda: model.encoder(feats, feat_lens))
    frames = list(range(subsampled.size(1)))
    torch.testing.assert_close(x, subsampled * math.sqrt(d) + formula_positions(frames, d), atol=1e-6, rtol=0)

    conformer = model_of("conformer")
    subsampled, _ = conformer.encoder.subsampling(feats, feat_lens)
    (x, relative, *_), _ = layers_io(conformer.encoder, lambda: conformer.encoder(feats, feat_lens))
    t = subsampled.size(1)
    torch.testing.assert_close(x, subsampled * math.sqrt(d), atol=1e-12, rtol=0)
    torch.testing.assert_close(relative, formula_positions(list(range(t - 1, -t, -1)), d), atol=1e-6, rtol=0)


# ---------------------------------------------------------------------------------------------
# self-attention weights (explicit path) and the fused paths


def encoder_valid_lengths(model: ASRModel) -> list[int]:
    return model.encoder.subsampling.output_lengths(torch.tensor(FEAT_LENS)).tolist()


@pytest.mark.parametrize("part", ["transformer", "conformer", "decoder"])
def test_self_attention_weights_rows_sum_to_one(part):
    """Encoder weights (layers, B, H, T', T'): every row sums to 1 over its utterance's valid frames
    (the first frame for an utterance of none), is exactly 0 on padding and positive on the valid
    frames, and an utterance alone gets the same weights. Decoder weights (layers, B, H, L, L): rows
    sum to 1 over positions 0 .. l, exactly 0 above the diagonal (so on the padding of a shorter
    target too). float32, the models' dtype."""
    model = model_of(part, dtype=torch.float32)
    config = model.config
    if part == "decoder":
        tokens, token_lens, memory, memory_lens = decoder_inputs(model)
        weights = model.decoder.forward_with_attention(tokens, token_lens, memory, memory_lens).self_attention
        length = tokens.size(1)
        assert weights.shape == (config.decoder_layers, 3, config.n_heads, length, length)
        torch.testing.assert_close(weights.sum(-1), torch.ones(weights.shape[:-1]), atol=1e-6, rtol=0)
        above = torch.ones(length, length, dtype=torch.bool).triu(1)
        assert (weights[..., above] == 0).all()
        assert (weights[..., ~above] > 0).all()
        return
    feats, feat_lens = random_feats(model)
    out = model.encoder.forward_with_attention(feats, feat_lens)
    weights, frames = out.self_attention, out.memory.size(1)
    assert out.memory_lens.tolist() == encoder_valid_lengths(model)
    assert weights.shape == (config.encoder_layers, 3, config.n_heads, frames, frames)
    for b, n in enumerate(out.memory_lens.tolist()):
        keys = max(n, 1)
        sums = weights[:, b, ..., :keys].sum(-1)  # (layers, H, T')
        torch.testing.assert_close(sums, torch.ones_like(sums), atol=1e-6, rtol=0)
        assert (weights[:, b, ..., keys:] == 0).all()
        assert (weights[:, b, ..., :keys] > 0).all()
        if n:
            alone = model.encoder.forward_with_attention(feats[b:b + 1, :FEAT_LENS[b]], feat_lens[b:b + 1])
            torch.testing.assert_close(alone.self_attention[:, 0, :, :n, :n], weights[:, b, :, :n, :n],
                                       atol=1e-5, rtol=0)


@pytest.mark.parametrize("part", ["transformer", "transformer_conv", "conformer", "decoder"])
def test_explicit_paths_match_the_fused_ones(part):
    """forward_with_attention gives forward's outputs to rounding (float32: 1e-5; float64: 1e-12, the
    decoder's float32 log-probabilities 1e-6), every frame and position; forward's own output is bit
    for bit what it was before."""
    for dtype, atol in ((torch.float32, 1e-5), (torch.float64, 1e-6 if part == "decoder" else 1e-12)):
        model = model_of(part, dtype=dtype)
        if part == "decoder":
            tokens, token_lens, memory, memory_lens = decoder_inputs(model)
            before = model.decoder(tokens, token_lens, memory, memory_lens)
            explicit = model.decoder.forward_with_attention(tokens, token_lens, memory, memory_lens)
            torch.testing.assert_close(explicit.log_probs, before, atol=atol, rtol=0)
            assert torch.equal(model.decoder(tokens, token_lens, memory, memory_lens), before)
            continue
        feats, feat_lens = random_feats(model)
        h, h_lens = model.encoder(feats, feat_lens)
        explicit = model.encoder.forward_with_attention(feats, feat_lens)
        assert torch.equal(explicit.memory_lens, h_lens)
        torch.testing.assert_close(explicit.memory, h, atol=atol, rtol=0)
        assert torch.equal(model.encoder(feats, feat_lens)[0], h)


def test_training_and_decoding_never_take_the_explicit_path(monkeypatch):
    """The loss (and its gradient) and beam search run on the fused path only: the explicit one,
    made to fail here, is never called."""
    def refuse(*args, **kwargs):
        raise AssertionError("the explicit attention path ran without weights being asked for")

    monkeypatch.setattr(MultiHeadAttention, "attend_with_weights", refuse)
    for part in ("transformer", "conformer"):
        model = model_of(part, dtype=torch.float32)
        feats, feat_lens = random_feats(model)
        targets = torch.tensor([[3, 4, 5], [6, 7, -1], [8, -1, -1]])
        model.train()(feats, feat_lens, targets, torch.tensor([3, 2, 1])).loss.backward()
        found = search(model.eval(), feats, feat_lens, SearchOptions(mode="attention", beam_size=3, ctc_weight=0.3))
        assert len(found) == 3
