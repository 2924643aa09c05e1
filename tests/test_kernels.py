"""The fused quantizers (lightning_snip.kernels) against the torchao reference, bit for bit."""

from __future__ import annotations

import itertools
import logging

import pytest
import torch

from lightning_snip import grid, kernels
from lightning_snip.formats import Format, QuantRecipe, Rounding
from lightning_snip.quantize import fake_quantize, reference_fake_quantize

FORMATS = (Format.FP8, Format.MXFP8, Format.MXFP4, Format.NVFP4)
RECIPES = {
    "rowwise_e4m3": QuantRecipe(),
    "tensorwise_e5m2": QuantRecipe(fp8_scaling="tensorwise", fp8_grad_dtype="e5m2"),
}


def _wide_range(shape, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g) * torch.exp(torch.randn(shape, generator=g) * 4)


def _edges(shape, seed):
    """Zeros, fp32 subnormals, exact grid points and ties after scaling (powers of two times grid
    values and midpoints), block maxima, values far above and below their block's maximum."""
    x = _wide_range(shape, seed)
    flat = x.view(-1)
    flat[::7] = 0.0
    flat[1::11] = 1e-40
    flat[2::13] = -3e-39
    flat[3::17] = 448.0 * 2.0**4
    flat[4::19] = 6.0
    flat[5::23] = 5.0  # a tie on the E2M1 grid (4 | 6) when the block scale is 1
    flat[6::29] = -1.75
    flat[8::31] = 2.0**-130
    return x


def _tiny_amax(shape, amax):
    w = _wide_range(shape, 6)
    return w / w.abs().amax() * amax


def _inputs():
    nan = _wide_range((64, 96), 3)
    nan.view(-1)[::37] = float("nan")
    inf = _wide_range((64, 96), 4)
    inf.view(-1)[::41] = float("inf")
    inf.view(-1)[5::53] = float("-inf")
    return {
        "wide_range": _wide_range((96, 80), 0),
        "edges": _edges((64, 96), 1),
        "zeros": torch.zeros(32, 64),
        "all_tiny": torch.full((32, 64), 1e-41),
        # amax ~1e-34: NVFP4's per-tensor scale below its floor (eager RTN gave 0 * inf = NaN)
        "tiny_amax": torch.cat([torch.zeros(16, 64), _tiny_amax((16, 64), 1e-34)]),
        "ragged": _wide_range((40, 50), 2),  # neither axis a multiple of a block: zero padding
        "bf16": _wide_range((64, 64), 5).bfloat16(),
        "nan": nan,
        "inf": inf,
    }


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.isnan(), b.isnan())
            and torch.equal(torch.nan_to_num(a, nan=0.0), torch.nan_to_num(b, nan=0.0)))


CASES = [
    (fmt, rounding, axis, recipe, is_grad)
    for fmt in FORMATS
    for rounding in ((Rounding.NEAREST, Rounding.STOCHASTIC) if fmt.is_fp4 else (Rounding.NEAREST,))
    for axis in (0, 1)
    for recipe in (RECIPES if fmt in (Format.FP8, Format.MXFP8) else ["rowwise_e4m3"])
    for is_grad in ((False, True) if fmt in (Format.FP8, Format.MXFP8) else (False,))
]


@pytest.mark.parametrize("mode", ["compiled", "eager"])
@pytest.mark.parametrize("fmt,rounding,axis,recipe,is_grad", CASES,
                         ids=lambda v: getattr(v, "value", str(v)))
def test_fused_equals_reference_bit_for_bit(monkeypatch, mode, fmt, rounding, axis, recipe, is_grad):
    monkeypatch.setenv("LIGHTNING_SNIP_QUANTIZERS", mode)
    for name, x in _inputs().items():
        kwargs = dict(axis=axis, rounding=rounding, recipe=RECIPES[recipe], is_grad=is_grad)
        got = fake_quantize(x, fmt, generator=torch.Generator().manual_seed(7), **kwargs)
        want = reference_fake_quantize(x, fmt, generator=torch.Generator().manual_seed(7), **kwargs)
        assert _same(got, want), (name, int(((got != want) & ~(got.isnan() & want.isnan())).sum()))


def _grid_values(grid):
    """Every non-negative value of the grid, and every midpoint between neighbours."""
    mbits, emin, vmax = grid
    values = {0.0}
    for e in range(emin, 20):
        for m in range(2**mbits):
            v = (1 + m / 2**mbits) * 2.0**e
            if v <= vmax:
                values.add(v)
    values |= {k * 2.0 ** (emin - mbits) for k in range(2**mbits)}  # subnormals
    values = sorted(values)
    mids = [(a + b) / 2 for a, b in zip(values, values[1:])]
    return torch.tensor(values), torch.tensor(mids)


@pytest.mark.parametrize("fp8_grid,dtype", [(grid.E4M3, torch.float8_e4m3fn), (grid.E5M2, torch.float8_e5m2)])
def test_round_to_grid_matches_torch_fp8_casts(fp8_grid, dtype):
    values, mids = _grid_values(fp8_grid)
    g = torch.Generator().manual_seed(0)
    sweep = torch.cat([values, mids, mids.nextafter(torch.tensor(0.0)), mids.nextafter(torch.tensor(1e9)),
                       torch.rand(20000, generator=g) * fp8_grid[2], torch.rand(20000, generator=g) * 2.0 ** fp8_grid[1]])
    sweep = torch.cat([sweep, -sweep])
    assert torch.equal(grid.round_to_grid(sweep, fp8_grid), sweep.to(dtype).float())
    assert torch.equal(grid.round_to_grid(values, fp8_grid), values)  # grid points are fixed points


def test_round_to_grid_matches_torchao_e2m1_cast():
    from torchao.prototype.mx_formats.kernels import f4_unpacked_to_f32, f32_to_f4_unpacked

    values, mids = _grid_values(grid.E2M1)
    g = torch.Generator().manual_seed(0)
    sweep = torch.cat([values, mids, mids.nextafter(torch.tensor(0.0)), mids.nextafter(torch.tensor(9.0)),
                       torch.rand(20000, generator=g) * 6.0, torch.tensor([7.0, 100.0])])
    sweep = torch.cat([sweep, -sweep])
    want = f4_unpacked_to_f32(f32_to_f4_unpacked(sweep))
    assert torch.equal(grid.round_to_grid(sweep, grid.E2M1), want)
    assert torch.equal(grid.round_to_grid(values, grid.E2M1), values)


def test_round_to_grid_non_finite():
    v = torch.tensor([float("nan"), float("inf"), float("-inf")])
    out = grid.round_to_grid(v, grid.E4M3)
    assert out[0].isnan() and out[1] == 448.0 and out[2] == -448.0


@pytest.mark.parametrize("fmt", [Format.MXFP4, Format.NVFP4])
def test_stochastic_rounding_unbiased(fmt):
    """The mean of many SR draws converges to x (RTN's error does not shrink with more draws)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(32, 64, generator=g)
    draws = torch.stack([fake_quantize(x, fmt, axis=1, rounding=Rounding.STOCHASTIC, generator=g) for _ in range(400)])
    bias = (draws.mean(0) - x).abs().mean() / x.abs().mean()
    rtn = (fake_quantize(x, fmt, axis=1) - x).abs().mean() / x.abs().mean()
    assert bias < 0.01 and rtn > 0.05, (bias, rtn)


@pytest.mark.compiled_quantizers
def test_training_steps_do_not_recompile():
    """After the first step, quantizers of every layer and direction reuse their compiled graphs."""
    from torch._dynamo.utils import counters

    from lightning_snip.linear import SNIPLinear

    torch.manual_seed(0)
    layers = torch.nn.Sequential(SNIPLinear(64, 96, format="nvfp4"), torch.nn.ReLU(), SNIPLinear(96, 32, format="mxfp4"))
    x = torch.randn(128, 64)
    layers(x).square().mean().backward()
    before = counters["stats"]["unique_graphs"]
    for batch in (128, 128, 256):  # a new batch size is a new (dynamic-shape) input, not a new graph
        layers(torch.randn(batch, 64)).square().mean().backward()
    assert counters["stats"]["unique_graphs"] == before


@pytest.mark.compiled_quantizers
def test_compile_failure_falls_back_to_eager_with_one_warning(monkeypatch, caplog):
    def broken_compile(fn, **kwargs):
        def run(*args):
            raise RuntimeError("no C++ compiler")
        return run

    monkeypatch.setattr(kernels, "_compiled", {})
    monkeypatch.setattr(kernels, "_broken", set())
    monkeypatch.setattr(torch, "compile", broken_compile)
    x = _wide_range((32, 64), 0)
    with caplog.at_level(logging.WARNING, logger="lightning_snip.kernels"):
        outs = [fake_quantize(x, Format.MXFP4, axis=1) for _ in range(3)]
    warnings = [r for r in caplog.records if "running it eagerly" in r.getMessage()]
    assert len(warnings) == 1 and "no C++ compiler" in warnings[0].getMessage()
    assert all(_same(o, reference_fake_quantize(x, Format.MXFP4, axis=1)) for o in outs)


def test_unknown_quantizer_mode_names_the_variable(monkeypatch):
    monkeypatch.setenv("LIGHTNING_SNIP_QUANTIZERS", "fastest")
    with pytest.raises(ValueError, match="LIGHTNING_SNIP_QUANTIZERS.*fastest.*compiled, eager, reference"):
        fake_quantize(torch.randn(4, 32), Format.MXFP4, axis=1)


def test_sr_uniforms_are_uniform_and_independent():
    """The SR random source on its own (the fused and reference paths share it, so the bit-for-bit
    tests cannot see it): 24-bit uniforms in [0, 1) with the moments of U(0, 1), and the two
    uniforms cut from one 64-bit draw uncorrelated."""
    from lightning_snip.grid import random_bits, uniforms_from_bits

    n = 2_000_000
    bits = random_bits(n, torch.Generator().manual_seed(0), "cpu")
    u = uniforms_from_bits(bits, (n,)).double()
    assert u.min() >= 0 and u.max() < 1 and torch.equal(u * 2**24, (u * 2**24).round())
    assert abs(float(u.mean()) - 0.5) < 4 * (1 / 12) ** 0.5 / n**0.5
    assert abs(float(u.var()) - 1 / 12) < 1e-3
    half = n // 2  # u[i] and u[half + i] come from the same draw
    corr = float(torch.corrcoef(torch.stack([u[:half], u[half:]]))[0, 1])
    assert abs(corr) < 4 / half**0.5, corr
    counts = torch.histc(u.float(), bins=64, min=0, max=1)
    assert float(((counts - n / 64) ** 2 / (n / 64)).sum()) < 120  # chi-square, 63 dof: p ~ 1e-5


@pytest.mark.parametrize("fmt", [Format.MXFP4, Format.NVFP4])
def test_sr_rounds_up_with_probability_equal_to_the_distance_from_below(fmt):
    """Each block holds 6.0 (scale exactly 1 for MXFP4) and copies of one value between two grid
    points: the share rounded up must match the fractional distance, to sampling precision."""
    rows = 20000
    for value, lo, hi in ((0.3, 0.0, 0.5), (2.6, 2.0, 3.0), (4.5, 4.0, 6.0)):
        x = torch.full((rows, 32), value)
        x[:, 0] = x[:, 16] = 6.0
        q = fake_quantize(x, fmt, axis=1, rounding=Rounding.STOCHASTIC, generator=torch.Generator().manual_seed(1))
        body = torch.cat([q[:, 1:16], q[:, 17:]], 1)
        if fmt is Format.NVFP4:  # two-level scale: compare in units of this tensor's actual scale
            scale = 6.0 / q[:, 0].max()
            body = body * scale
        assert set(body.unique().tolist()) <= {lo, hi}, (value, body.unique())
        share_up = float((body == hi).double().mean())
        expected = (value - lo) / (hi - lo)
        assert abs(share_up - expected) < 4 * (expected * (1 - expected) / body.numel()) ** 0.5 + 1e-4, (value, share_up)


@pytest.mark.parametrize("mode", ["compiled", "eager", "reference"])
@pytest.mark.parametrize("fmt,rounding", [(f, r) for f in FORMATS
                                          for r in ((Rounding.NEAREST, Rounding.STOCHASTIC) if f.is_fp4
                                                    else (Rounding.NEAREST,))],
                         ids=lambda v: getattr(v, "value", str(v)))
def test_zero_blocks_stay_zero_where_subnormals_flush(monkeypatch, mode, fmt, rounding):
    """A GPU's Triton kernels flush subnormals to zero; an all-zero MX block's scale 2^-127 is one,
    and dividing by it gave NaN for every all-zero gradient block on an H200 (the attention query's
    gradient has one per sequence: the first token's). torch.set_flush_denormal reproduces the
    flush on a CPU."""
    monkeypatch.setenv("LIGHTNING_SNIP_QUANTIZERS", mode)
    x = _wide_range((64, 128), 9)
    x[0] = 0.0  # an all-zero row: zero blocks along axis 1
    x[:, 32:64] = 0.0  # a zero block in every row
    tiny = torch.zeros(32, 64)
    tiny[0, 0] = 1e-34  # NVFP4: a per-tensor scale whose product with a block scale is subnormal
    with_inf = _wide_range((32, 64), 10)
    with_inf[3, 5] = float("inf")  # an MX block exponent of 127: 2^-127 is subnormal
    kwargs = dict(axis=1, rounding=rounding, is_grad=rounding is Rounding.STOCHASTIC)
    inputs = (x, tiny, with_inf)
    want = [fake_quantize(t, fmt, generator=torch.Generator().manual_seed(3), **kwargs) for t in inputs]
    if not torch.set_flush_denormal(True):
        pytest.skip("this CPU cannot flush subnormals")
    try:
        got = [fake_quantize(t, fmt, generator=torch.Generator().manual_seed(3), **kwargs) for t in inputs]
    finally:
        torch.set_flush_denormal(False)
    assert torch.isfinite(got[0]).all() and torch.isfinite(got[1]).all(), [int(g.isnan().sum()) for g in got]
    assert torch.equal(got[0][0], torch.zeros_like(got[0][0])) and torch.equal(got[0][:, 32:64], torch.zeros_like(got[0][:, 32:64]))
    assert torch.equal(got[0], want[0])  # the other blocks hold no subnormals: the flush changes nothing
    assert torch.equal(got[1][1:], torch.zeros_like(got[1][1:]))  # all-zero rows of a tiny tensor stay zero
    assert torch.equal(got[1], want[1])
    # inf and NaN where they are without the flush (an MX block holding inf: inf, not NaN). Not for the
    # reference's MX round-to-nearest: that is torchao's own cast, whose 2^-127 for such a block flushes.
    if not (mode == "reference" and fmt in (Format.MXFP8, Format.MXFP4) and rounding is Rounding.NEAREST):
        assert torch.equal(got[2].isinf(), want[2].isinf()) and torch.equal(got[2].isnan(), want[2].isnan())


def _fake_compile(monkeypatch, price: float):
    """torch.compile recorded (the kernel runs as it is) and kernels' state fresh; a compile is priced ``price`` s."""
    compiled = []

    def fake(fn, **kwargs):
        compiled.append(fn.__name__)
        return fn

    monkeypatch.setattr(kernels, "_compiled", {})
    monkeypatch.setattr(kernels, "_broken", set())
    monkeypatch.setattr(kernels, "_eager_seconds", {})
    monkeypatch.setattr(kernels, "compile_seconds", {})
    monkeypatch.setattr(kernels, "compile_price", lambda: price)  # (a fake compile's first call costs nothing)
    monkeypatch.setattr(torch, "compile", fake)
    return compiled


@pytest.mark.compiled_quantizers
def test_snips_own_work_rents_a_kernel_until_it_has_cost_a_compile(monkeypatch):
    """In own_work a kernel nothing compiled runs eagerly (the same numbers) until its eager seconds reach the price of
    a compile, then compiles; training's calls (outside own_work) compile at first use, as before."""
    compiled = _fake_compile(monkeypatch, price=3600.0)
    x = _wide_range((64, 128), 1)
    with kernels.own_work():
        outs = [fake_quantize(x, Format.MXFP4, axis=1) for _ in range(3)]
    assert compiled == [] and kernels._eager_seconds[("_mx_rtn_kernel", "cpu")] > 0
    assert all(_same(o, reference_fake_quantize(x, Format.MXFP4, axis=1)) for o in outs)
    fake_quantize(x, Format.NVFP4, axis=1)  # training's call
    assert compiled == ["_nvfp4_rtn_kernel"]
    with kernels.own_work():
        fake_quantize(x, Format.NVFP4, axis=1)  # compiled already: used as it is
        assert ("_nvfp4_rtn_kernel", "cpu") not in kernels._eager_seconds
        rent = kernels._eager_seconds[("_mx_rtn_kernel", "cpu")]
        monkeypatch.setattr(kernels, "compile_price", lambda: rent)
        assert _same(fake_quantize(x, Format.MXFP4, axis=1), outs[0])  # its rent has reached the price
    assert compiled == ["_nvfp4_rtn_kernel", "_mx_rtn_kernel"]


def test_a_compile_is_priced_at_this_process_cpu_compiles(monkeypatch):
    monkeypatch.setattr(kernels, "compile_seconds", {})
    assert kernels.compile_price() == kernels.COMPILE_PRICE_SECONDS  # none yet
    kernels.compile_seconds.update({("a", "cpu"): 2.0, ("b", "cpu"): 4.0, ("c", "cuda"): 60.0})
    assert kernels.compile_price() == 3.0


@pytest.mark.compiled_quantizers
def test_a_round_compiles_none_of_the_kernels_only_it_uses():
    """The controller's round, canary and first-order sample are SNIP's own work: on the demo, AdamW's update kernels
    (used by the round alone) stay uncompiled under a price they never reach, while training compiles its quantizers."""
    from tests.test_controller import test_a_plain_pytorch_loop_samples_plans_and_switches as loop

    with pytest.MonkeyPatch.context() as mp:
        compiled = _fake_compile(mp, price=3600.0)
        loop()
        assert compiled and not any("adam" in name for name in compiled), compiled
        assert any("adam" in name for name, _ in kernels._eager_seconds), kernels._eager_seconds
