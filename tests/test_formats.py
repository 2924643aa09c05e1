import pytest
import torch

from lightning_snip.formats import CostModel, DEFAULT_RELATIVE_COST, Format, QuantRecipe, Rounding
from lightning_snip.quantize import fake_quantize

# Relative error bands for a GEMM of two fresh N(0,1) 1024x1024 operands, both quantized along the
# contraction axis, against float64. Measured: fp8 0.037, mxfp8 0.037, mxfp4 0.163, nvfp4 0.134.
# The expected errors follow from the element formats: E4M3 has 3 mantissa bits (relative rounding
# error ~2^-4 per element, averaged down in the dot product), E2M1 has 1 (plus block scaling). The
# band is [0.5x, 1.5x] of the measured value: a wrong scale, axis or rounding leaves it.
GEMM_ERROR = {Format.FP8: 0.037, Format.MXFP8: 0.037, Format.MXFP4: 0.163, Format.NVFP4: 0.134}


def _rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.mark.parametrize("fmt", list(GEMM_ERROR))
def test_gemm_error_band_against_float64(fmt):
    x, w = torch.randn(1024, 1024), torch.randn(1024, 1024)
    ref = x.double() @ w.double().t()
    y = fake_quantize(x, fmt, axis=1) @ fake_quantize(w, fmt, axis=1).t()
    err = _rel(y, ref)
    assert 0.5 * GEMM_ERROR[fmt] < err < 1.5 * GEMM_ERROR[fmt]


def test_bf16_is_identity():
    x = torch.randn(16, 32)
    assert fake_quantize(x, Format.BF16, axis=0) is x


@pytest.mark.parametrize("fmt", [Format.MXFP8, Format.MXFP4, Format.NVFP4])
def test_blocks_follow_the_axis(fmt):
    # One huge element per column: with blocks along axis 0 it only coarsens its own column's block,
    # with blocks along axis 1 it wipes out the small values of its row's block.
    x = torch.randn(64, 64)
    # MX scales are powers of two over 254 octaves; NVFP4's E4M3 block scales under one fp32 tensor
    # scale span ~2^17, so an outlier beyond that flushes whole other blocks (real NVFP4 behaviour).
    x[:, 0] = 1e3 if fmt is Format.NVFP4 else 1e7
    along_cols = fake_quantize(x, fmt, axis=0)
    along_rows = fake_quantize(x, fmt, axis=1)
    assert _rel(along_cols[:, 1:], x[:, 1:]) < 0.2
    assert _rel(along_rows[:, 1:fmt.block_size], x[:, 1:fmt.block_size]) > 0.5


def test_padding_keeps_every_element():
    x = torch.randn(10, 50)  # 50 is not a multiple of 32 or 16
    for fmt in (Format.MXFP4, Format.NVFP4, Format.MXFP8):
        q = fake_quantize(x, fmt, axis=1)
        assert q.shape == x.shape and torch.isfinite(q).all()
        assert _rel(q, x) < 0.2


@pytest.mark.parametrize("fmt", [f for f in Format if f is not Format.BF16])
def test_nan_never_passes_silently(fmt):
    x = torch.randn(32, 64)
    x[3, 5] = float("nan")
    q = fake_quantize(x, fmt, axis=1)
    assert torch.isnan(q[3, 5])
    x[3, 5] = float("inf")
    q = fake_quantize(x, fmt, axis=1)
    assert not torch.isfinite(q[3, 5])


@pytest.mark.parametrize("fmt", [Format.MXFP4, Format.NVFP4])
def test_stochastic_rounding_is_unbiased(fmt):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, 128)
    num = 800
    samples = torch.stack(
        [fake_quantize(x, fmt, axis=0, rounding=Rounding.STOCHASTIC, generator=g) for _ in range(num)]
    )
    rtn_err = _rel(fake_quantize(x, fmt, axis=0), x)
    bias = _rel(samples.mean(0), x)
    # Zero-mean noise averages as 1/sqrt(n): per-element SR std is at most half a grid step, so the
    # relative bias of the mean of 800 is ~0.2 / sqrt(800) ~ 0.007; RTN error is ~0.1.
    assert bias < 0.1 * rtn_err
    # Half as many samples: the mean's error grows like sqrt(2) (noise, not bias).
    bias_half = _rel(samples[: num // 4].mean(0), x)
    assert 1.4 < bias_half / bias < 2.6


def test_stochastic_rounding_variance_matches_grid():
    # Values scaled into a block where max|x| = 6 * 2^e; a value v between grid points lo < v < hi is
    # rounded up with probability p = (v-lo)/(hi-lo): variance (hi-lo)^2 p (1-p).
    x = torch.zeros(1, 32)
    x[0, 0] = 6.0  # fixes the MX scale to 1 (RCEIL: 6 / 6)
    x[0, 1:] = 2.5  # between grid points 2 and 3: p = 0.5, variance 0.25
    g = torch.Generator().manual_seed(2)
    samples = torch.stack([fake_quantize(x, Format.MXFP4, axis=1, rounding=Rounding.STOCHASTIC, generator=g) for _ in range(2000)])
    vals = samples[:, 0, 1:]
    assert set(vals.unique().tolist()) == {2.0, 3.0}
    assert abs(float(vals.var()) - 0.25) < 0.02
    assert abs(float(vals.mean()) - 2.5) < 0.02


def test_stochastic_rounding_only_for_fp4():
    with pytest.raises(ValueError, match="FP4"):
        fake_quantize(torch.randn(4, 32), Format.FP8, axis=1, rounding=Rounding.STOCHASTIC)


def test_unknown_format_lists_valid_ones():
    with pytest.raises(ValueError, match="bf16, fp8, mxfp8, mxfp4, nvfp4"):
        Format.parse("fp6")
    assert Format.parse("MXFP4") is Format.MXFP4


def test_fp8_tensorwise_differs_from_rowwise():
    x = torch.randn(64, 64)
    x[0] *= 1e5  # one loud row: tensorwise scaling flushes the quiet rows' small values
    row = fake_quantize(x, Format.FP8, axis=1, recipe=QuantRecipe(fp8_scaling="rowwise"))
    ten = fake_quantize(x, Format.FP8, axis=1, recipe=QuantRecipe(fp8_scaling="tensorwise"))
    assert _rel(row[1:], x[1:]) < 0.05 < _rel(ten[1:], x[1:])


def test_recipe_rejects_bad_values():
    with pytest.raises(ValueError, match="fp8_scaling"):
        QuantRecipe(fp8_scaling="blockwise")


def test_cost_model_defaults_and_override():
    assert CostModel().cost(Format.MXFP4) == 0.25 == DEFAULT_RELATIVE_COST[Format.NVFP4]
    cm = CostModel({"fp8": 0.6})
    assert cm.cost(Format.FP8) == 0.6 and cm.cost(Format.BF16) == 1.0
    with pytest.raises(ValueError, match="relative_cost"):
        CostModel({"fp8": -1})
