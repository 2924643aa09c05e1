"""Kernel choice per format and device (capability mocked); torchao.float8's native GEMM path,
which runs on a CPU too (torch._scaled_mm has a CPU implementation); torchao's block-scaled
(MX, NVFP4) path, whose GEMM has no CPU kernel: its operands are checked bit for bit through
torchao's emulated GEMM, and its dispatch up to torch's block-scaled GEMM call."""

from __future__ import annotations

import pytest
import torch

from lightning_snip import linear as linear_mod
from lightning_snip.formats import Format, QuantRecipe
from lightning_snip.linear import (Kernel, SNIPLinear, describe_kernels, kernel_for, quantized_matmul,
                                  torchao_block_mm)


def _mock_gpu(monkeypatch, capability):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)


@pytest.mark.parametrize("capability,fp8_native,block_native", [
    ((8, 0), False, False), ((8, 6), False, False), ((8, 9), True, False), ((9, 0), True, False),
    ((10, 0), True, True), ((10, 3), True, True), ((12, 0), True, False)])
def test_kernel_choice_by_capability(monkeypatch, capability, fp8_native, block_native):
    _mock_gpu(monkeypatch, capability)
    cuda = torch.device("cuda", 0)
    assert kernel_for(Format.FP8, cuda) is (Kernel.TORCHAO_FP8 if fp8_native else Kernel.EMULATED)
    for fmt in (Format.MXFP8, Format.MXFP4, Format.NVFP4):  # torchao's block-scaled GEMMs: sm100 only
        assert kernel_for(fmt, cuda) is (Kernel.TORCHAO_BLOCK if block_native else Kernel.EMULATED)
    for fmt in (Format.FP8, Format.MXFP4):
        assert kernel_for(fmt, torch.device("cpu")) is Kernel.EMULATED  # CPUs emulate, whatever the GPU


def test_kernel_choice_without_cuda_and_the_setup_line(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert kernel_for(Format.FP8, torch.device("cuda", 0)) is Kernel.EMULATED
    assert kernel_for(Format.NVFP4, torch.device("cuda", 0)) is Kernel.EMULATED
    _mock_gpu(monkeypatch, (9, 0))
    line = describe_kernels([Format.BF16, Format.FP8, Format.MXFP4], torch.device("cuda", 0))
    assert line == "fp8: native torchao kernel; mxfp4: emulated (cuda:0)"
    _mock_gpu(monkeypatch, (10, 0))
    line = describe_kernels([Format.FP8, Format.MXFP8, Format.NVFP4], torch.device("cuda", 0))
    assert line == ("fp8: native torchao kernel; mxfp8: native torchao block-scaled kernel; "
                    "nvfp4: native torchao block-scaled kernel (cuda:0)")


def _spy_scaled_mm(monkeypatch):
    calls = []
    real = torch._scaled_mm

    def spy(*args, **kwargs):
        calls.append(args[0].dtype)
        return real(*args, **kwargs)

    monkeypatch.setattr(torch, "_scaled_mm", spy)
    return calls


@pytest.mark.parametrize("scaling", ["rowwise", "tensorwise"])
def test_native_fp8_gemm_runs_scaled_mm_and_matches_emulation(monkeypatch, scaling):
    calls = _spy_scaled_mm(monkeypatch)
    recipe = QuantRecipe(fp8_scaling=scaling)
    g = torch.Generator().manual_seed(0)
    a = torch.randn(64, 128, generator=g) * torch.exp(torch.randn(64, 1, generator=g))
    b = torch.randn(96, 128, generator=g)
    native = quantized_matmul(a, b, Format.FP8, recipe=recipe, kernel=Kernel.TORCHAO_FP8)
    emulated = quantized_matmul(a, b, Format.FP8, recipe=recipe, kernel=Kernel.EMULATED)
    assert calls == [torch.float8_e4m3fn]
    # Same quantized operands; only the GEMM's accumulation and output rounding differ (the CPU
    # kernel rounds rowwise outputs through bf16).
    rel = float((native - emulated).norm() / emulated.norm())
    assert native.dtype == torch.float32 and rel < 4e-3, rel
    exact = (a.double() @ b.double().t())
    assert float((native.double() - exact).norm() / exact.norm()) < 0.06
    # a GEMM on unquantized operands differs from the native one by FP8's error, far more than rel
    assert float((a @ b.t() - native).norm() / native.norm()) > 5 * rel


def test_native_fp8_unaligned_shapes_are_emulated(monkeypatch):
    calls = _spy_scaled_mm(monkeypatch)
    a, b = torch.randn(40, 72), torch.randn(24, 72)  # not multiples of 16
    native = quantized_matmul(a, b, Format.FP8, recipe=QuantRecipe(), kernel=Kernel.TORCHAO_FP8)
    assert calls == [] and torch.equal(native, quantized_matmul(a, b, Format.FP8, recipe=QuantRecipe()))


def test_snip_linear_uses_native_kernel_in_all_three_gemms(monkeypatch):
    """With the device reported as an FP8 GPU, forward, dgrad and wgrad each run torch._scaled_mm,
    with e4m3 operands (e5m2 for gradients when the recipe says so), and the gradients match the
    emulated layer's."""
    calls = _spy_scaled_mm(monkeypatch)
    torch.manual_seed(0)
    recipe = QuantRecipe(fp8_grad_dtype="e5m2")
    layer = SNIPLinear(64, 48, format="fp8", recipe=recipe).bfloat16()
    x = torch.randn(32, 64, dtype=torch.bfloat16, requires_grad=True)
    emulated = [t.detach().clone() for t in _fwd_bwd(layer, x)]
    assert calls == []
    monkeypatch.setattr(linear_mod, "kernel_for", lambda fmt, device: Kernel.TORCHAO_FP8)
    native = _fwd_bwd(layer, x)
    assert calls == [torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e5m2]  # fwd, dgrad, wgrad (a = G)
    for n, e in zip([t.detach() for t in native], emulated):
        assert float((n.float() - e.float()).norm() / e.float().norm()) < 1e-2


def _fwd_bwd(layer, x):
    layer.zero_grad(set_to_none=True)
    x.grad = None
    y = layer(x)
    y.float().square().sum().backward()
    return y, x.grad, layer.weight.grad


# ---------------------------------------------------------------------------------------------
# torchao's block-scaled GEMMs (MXTensor, NVFP4Tensor): compute capability 10.x.

BLOCK_FORMATS = [Format.MXFP8, Format.MXFP4, Format.NVFP4]


def _operands(dtype, m=64, n=96, k=128, seed=0):
    g = torch.Generator().manual_seed(seed)
    # rows of very different magnitude: a scale shared along the wrong axis would be visible
    a = torch.randn(m, k, generator=g) * torch.exp(2 * torch.randn(m, 1, generator=g))
    b = torch.randn(n, k, generator=g) * torch.exp(torch.randn(n, 1, generator=g))
    return a.to(dtype), b.to(dtype)


@pytest.mark.parametrize("fmt", BLOCK_FORMATS, ids=lambda f: f.value)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("grad_rounding", ["stochastic", "nearest"])
def test_block_kernel_operands_are_the_emulation_bit_for_bit(fmt, dtype, grad_rounding):
    """The operands torchao's block-scaled GEMM receives, multiplied through torchao's emulated GEMM,
    equal the emulation bit for bit: forward operands (RTN) and a stochastically rounded gradient
    operand with the same random draws (MXFP4: re-cast exactly; NVFP4: codes and scales wrapped)."""
    recipe = QuantRecipe(fp4_grad_rounding=grad_rounding)
    a, b = _operands(dtype)
    for a_is_grad in (False, True):
        emulated = quantized_matmul(a, b, fmt, recipe=recipe, a_is_grad=a_is_grad,
                                    generator=torch.Generator().manual_seed(1), kernel=Kernel.EMULATED)
        through = torchao_block_mm(a, b, fmt, recipe, a_is_grad, False, torch.Generator().manual_seed(1),
                                   emulate=True)
        assert through.dtype == dtype and torch.equal(through, emulated), (fmt, a_is_grad)
    if fmt.is_fp4 and grad_rounding == "stochastic":
        # the gradient operand is rounded stochastically: another draw gives another product
        other = torchao_block_mm(a, b, fmt, recipe, True, False, torch.Generator().manual_seed(2), emulate=True)
        assert not torch.equal(other, emulated)


def test_block_kernel_stochastic_gradient_operand_is_unbiased():
    """Averaged over draws, the native path's MXFP4/NVFP4 products with a stochastically rounded
    gradient operand approach Q(a)-free products: the bias of round-to-nearest does not."""
    a, b = _operands(torch.float32, m=32, n=32, k=64)
    exact = a.double() @ torch.eye(64, dtype=torch.float64)[:32].t()  # b = identity rows: picks a's columns
    b = torch.eye(64)[:32].contiguous()
    for fmt in (Format.MXFP4, Format.NVFP4):
        draws = [torchao_block_mm(a, b, fmt, QuantRecipe(), True, False, torch.Generator().manual_seed(s),
                                  emulate=True).double() for s in range(200)]
        mean_err = float((torch.stack(draws).mean(0) - exact).norm() / exact.norm())
        rtn = torchao_block_mm(a, b, fmt, QuantRecipe(fp4_grad_rounding="nearest"), True, False, emulate=True)
        rtn_err = float((rtn.double() - exact).norm() / exact.norm())
        assert mean_err < 0.3 * rtn_err, (fmt, mean_err, rtn_err)


def _spy_block_gemms(monkeypatch):
    """Record torch's block-scaled GEMM calls (no CPU kernel exists) and return zeros of the shape."""
    calls = []

    def scaled_mm(a, b, scale_a, scale_b, bias=None, out_dtype=None, **kwargs):
        calls.append(("_scaled_mm", a.dtype, b.dtype, scale_a.dtype, tuple(a.shape), tuple(b.shape)))
        return torch.zeros(a.shape[0], b.shape[1], dtype=out_dtype or torch.bfloat16)

    def f_scaled_mm(a, b, scale_a, scale_recipe_a, scale_b, scale_recipe_b, **kwargs):
        calls.append(("F.scaled_mm", a.dtype, b.dtype, scale_a.dtype, tuple(a.shape), tuple(b.shape)))
        return torch.zeros(a.shape[0], b.shape[1], dtype=kwargs.get("output_dtype") or torch.bfloat16)

    monkeypatch.setattr(torch, "_scaled_mm", scaled_mm)
    monkeypatch.setattr(torch.nn.functional, "scaled_mm", f_scaled_mm)
    return calls


def test_block_kernel_dispatches_to_torchs_block_scaled_gemm(monkeypatch):
    """On the native path (not emulated), torchao's dispatch hands torch's block-scaled GEMM the packed
    operands: e4m3 elements with e8m0 scales (mxfp8), e2m1 pairs with e8m0 scales (mxfp4, F.scaled_mm),
    e2m1 pairs with e4m3 scales (nvfp4), for a forward GEMM and a stochastically rounded one alike."""
    calls = _spy_block_gemms(monkeypatch)
    a, b = _operands(torch.bfloat16)
    expected = {
        Format.MXFP8: ("_scaled_mm", torch.float8_e4m3fn, torch.float8_e4m3fn, torch.float8_e8m0fnu, (64, 128)),
        Format.MXFP4: ("F.scaled_mm", torch.float4_e2m1fn_x2, torch.float4_e2m1fn_x2, torch.float8_e8m0fnu, (64, 64)),
        Format.NVFP4: ("_scaled_mm", torch.float4_e2m1fn_x2, torch.float4_e2m1fn_x2, torch.float8_e4m3fn, (64, 64)),
    }
    for fmt, (name, a_dtype, b_dtype, scale_dtype, a_shape) in expected.items():
        for a_is_grad in (False, True):
            calls.clear()
            out = quantized_matmul(a, b, fmt, recipe=QuantRecipe(), a_is_grad=a_is_grad, kernel=Kernel.TORCHAO_BLOCK,
                                   generator=torch.Generator().manual_seed(0))
            assert out.shape == (64, 96) and out.dtype == torch.bfloat16
            assert [c[:5] for c in calls] == [(name, a_dtype, b_dtype, scale_dtype, a_shape)], (fmt, calls)


def test_block_kernel_unsupported_gemms_are_emulated(monkeypatch):
    """Shapes off the 32-grid, and MXFP8 gradients in E5M2 (torchao's MX GEMM takes E4M3 only), take
    the emulation: no block-scaled GEMM call, the emulated result."""
    calls = _spy_block_gemms(monkeypatch)
    a, b = _operands(torch.float32, m=48, n=96, k=128)  # 48 rows: not a multiple of 32
    for fmt in BLOCK_FORMATS:
        out = quantized_matmul(a, b, fmt, recipe=QuantRecipe(fp4_grad_rounding="nearest"), kernel=Kernel.TORCHAO_BLOCK)
        assert torch.equal(out, quantized_matmul(a, b, fmt, recipe=QuantRecipe(), kernel=Kernel.EMULATED))
    a, b = _operands(torch.float32)
    e5m2 = QuantRecipe(fp8_grad_dtype="e5m2")
    out = quantized_matmul(a, b, Format.MXFP8, recipe=e5m2, a_is_grad=True, kernel=Kernel.TORCHAO_BLOCK)
    assert calls == []
    assert torch.equal(out, quantized_matmul(a, b, Format.MXFP8, recipe=e5m2, a_is_grad=True, kernel=Kernel.EMULATED))
    quantized_matmul(a, b, Format.MXFP8, recipe=e5m2, a_is_grad=False, kernel=Kernel.TORCHAO_BLOCK)
    assert len(calls) == 1  # the forward GEMM (E4M3 operands) still runs natively


@pytest.mark.parametrize("fmt", [Format.MXFP4, Format.NVFP4], ids=lambda f: f.value)
def test_snip_linear_routes_all_three_gemms_to_the_block_kernel(monkeypatch, fmt):
    """With the device reported as compute capability 10.x, forward, dgrad and wgrad each go through
    torchao_block_mm (the gradient operand, and only it, flagged for stochastic rounding), and the
    output and both gradients equal the emulated layer's bit for bit with the same random draws."""
    routed = []
    real = linear_mod.torchao_block_mm

    def through_torchao(a, b, fmt_, recipe, a_is_grad, b_is_grad, generator=None):
        routed.append((fmt_, a_is_grad, b_is_grad, tuple(a.shape), tuple(b.shape)))
        return real(a, b, fmt_, recipe, a_is_grad, b_is_grad, generator, emulate=True)

    torch.manual_seed(0)
    layer = SNIPLinear(64, 96, format=fmt)
    x = torch.randn(2, 32, 64, requires_grad=True)
    layer.generator = torch.Generator().manual_seed(5)
    emulated = [t.detach().clone() for t in _fwd_bwd(layer, x)]
    monkeypatch.setattr(linear_mod, "torchao_block_mm", through_torchao)
    monkeypatch.setattr(linear_mod, "kernel_for", lambda f, device: Kernel.TORCHAO_BLOCK)
    layer.generator = torch.Generator().manual_seed(5)
    native = _fwd_bwd(layer, x)
    assert routed == [(fmt, False, False, (64, 64), (96, 64)),   # fwd: X, W along k
                      (fmt, True, False, (64, 96), (64, 96)),    # dgrad: G, W^T along m
                      (fmt, True, False, (96, 64), (64, 64))]    # wgrad: G^T, X^T along tokens
    for n, e in zip(native, emulated):
        assert torch.equal(n.detach(), e)
