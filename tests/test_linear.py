import pytest
import torch
from torch import nn

from lightning_snip.formats import Format
from lightning_snip.linear import SNIPLinear, supported_formats

# Relative error of output, dX and dW against float64, for a 256-token, 512->512 layer with fresh
# N(0,1) inputs. Bands are [0.4x, 1.6x] of the value measured here; gradient GEMMs of FP4 formats use
# stochastic rounding on G, whose extra variance raises their error above the RTN forward one.
BANDS = {
    Format.FP8: (0.037, 0.037, 0.037),
    Format.MXFP8: (0.037, 0.037, 0.037),
    Format.MXFP4: (0.16, 0.19, 0.19),
    Format.NVFP4: (0.13, 0.16, 0.16),
}


def _rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


def _reference(x, w, b, g):
    x64, w64 = x.double(), w.double()
    y = x64 @ w64.t() + b.double()
    return y, g.double() @ w64, g.double().t() @ x64


@pytest.mark.parametrize("fmt", list(BANDS))
def test_three_gemms_against_float64(fmt):
    layer = SNIPLinear(512, 512, format=fmt)
    x = torch.randn(4, 64, 512, requires_grad=True)
    g = torch.randn(4, 64, 512)
    y = layer(x)
    y.backward(g)
    y_ref, dx_ref, dw_ref = _reference(x.detach().reshape(-1, 512), layer.weight.detach(), layer.bias.detach(), g.reshape(-1, 512))
    errors = (_rel(y.reshape(-1, 512), y_ref), _rel(x.grad.reshape(-1, 512), dx_ref), _rel(layer.weight.grad, dw_ref))
    for err, expected in zip(errors, BANDS[fmt]):
        assert 0.4 * expected < err < 1.6 * expected, (fmt, errors)
    # Every output element is written and sane: none is left at a fill value or far off the reference
    # (the largest elementwise error stays within a few block-quantization steps of the RMS error).
    for out, ref in ((y.reshape(-1, 512), y_ref), (x.grad.reshape(-1, 512), dx_ref), (layer.weight.grad, dw_ref)):
        assert torch.isfinite(out).all()
        diff = (out.double() - ref).abs()
        assert float(diff.max()) < 8 * float(diff.pow(2).mean().sqrt())
    assert torch.allclose(layer.bias.grad, g.reshape(-1, 512).sum(0))


def test_bf16_layer_in_bfloat16_matches_float64_within_bf16_precision():
    layer = SNIPLinear(512, 512, dtype=torch.bfloat16, format="bf16")
    x = torch.randn(256, 512, dtype=torch.bfloat16)
    y = layer(x)
    y_ref = x.double() @ layer.weight.double().t() + layer.bias.double()
    assert _rel(y, y_ref) < 0.006  # bf16 has 8 mantissa bits: ~0.003 measured


def test_matches_nn_linear_exactly_in_bf16_mode():
    lin = nn.Linear(48, 40)
    snip = SNIPLinear.from_linear(lin)
    x = torch.randn(7, 48)
    assert torch.equal(snip(x), lin(x))
    assert snip.weight is lin.weight and snip.bias is lin.bias


def test_odd_token_count_is_padded_for_wgrad():
    layer = SNIPLinear(64, 32, format=Format.MXFP4)
    x = torch.randn(37, 64, requires_grad=True)  # 37 tokens: not a multiple of 32
    layer(x).sum().backward()
    assert torch.isfinite(layer.weight.grad).all() and torch.isfinite(x.grad).all()
    ref = torch.ones(37, 32).t() @ x.detach()
    assert _rel(layer.weight.grad, ref) < 0.3


def test_nan_input_reaches_output():
    layer = SNIPLinear(64, 64, format=Format.MXFP4)
    x = torch.randn(8, 64)
    x[2, 1] = float("nan")
    y = layer(x)
    assert torch.isnan(y[2]).any()


def test_format_validation_and_repr():
    layer = SNIPLinear(64, 64)
    layer.format = "nvfp4"
    assert layer.format is Format.NVFP4 and "format=nvfp4" in repr(layer)
    with pytest.raises(ValueError, match="valid formats are"):
        layer.format = "int4"
    odd = SNIPLinear(48, 40)
    assert supported_formats(48, 40) == {Format.BF16, Format.FP8}
    with pytest.raises(ValueError, match="48->40.*allowed: bf16, fp8"):
        odd.format = Format.MXFP4


def test_state_dict_keys_are_those_of_nn_linear():
    lin = nn.Linear(32, 32)
    snip = SNIPLinear.from_linear(lin, format="mxfp4")
    assert list(snip.state_dict()) == list(lin.state_dict())


def test_a_generator_leaves_the_rng_registry_with_its_last_layer():
    """Layers hold their generator's RNG token; a deep copy shares it; when the last holder goes, the
    registry (what a compiled graph draws through) forgets the generator instead of keeping it for the
    process's lifetime."""
    import copy
    import gc

    from lightning_snip import rng

    gc.collect()  # earlier tests' layers
    before = rng.num_registered()
    generator = torch.Generator().manual_seed(0)
    layers = [SNIPLinear(64, 64) for _ in range(3)]
    for layer in layers:
        layer.generator = generator
    twin = copy.deepcopy(layers[0])
    assert twin.generator is generator and twin._rng_token is layers[0]._rng_token
    assert rng.num_registered() == before + 1
    del layers, layer
    gc.collect()
    assert rng.num_registered() == before + 1  # the copy still draws from it
    del twin
    gc.collect()
    assert rng.num_registered() == before
