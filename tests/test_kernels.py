"""Kernel choice per format and device (capability mocked), and torchao.float8's native GEMM path,
which runs on a CPU too (torch._scaled_mm has a CPU implementation)."""

from __future__ import annotations

import pytest
import torch

from lightning_snip import linear as linear_mod
from lightning_snip.formats import Format, QuantRecipe
from lightning_snip.linear import Kernel, SNIPLinear, describe_kernels, kernel_for, quantized_matmul


def _mock_gpu(monkeypatch, capability):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)


@pytest.mark.parametrize("capability,fp8_native", [((8, 0), False), ((8, 6), False), ((8, 9), True), ((9, 0), True),
                                                   ((10, 0), True), ((12, 0), True)])
def test_kernel_choice_by_capability(monkeypatch, capability, fp8_native):
    _mock_gpu(monkeypatch, capability)
    cuda = torch.device("cuda", 0)
    assert kernel_for(Format.FP8, cuda) is (Kernel.TORCHAO_FP8 if fp8_native else Kernel.EMULATED)
    for fmt in (Format.MXFP8, Format.MXFP4, Format.NVFP4):  # MX GEMMs are not routed to torchao yet
        assert kernel_for(fmt, cuda) is Kernel.EMULATED
    assert kernel_for(Format.FP8, torch.device("cpu")) is Kernel.EMULATED  # CPUs emulate, whatever the GPU


def test_kernel_choice_without_cuda_and_the_setup_line(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert kernel_for(Format.FP8, torch.device("cuda", 0)) is Kernel.EMULATED
    _mock_gpu(monkeypatch, (9, 0))
    line = describe_kernels([Format.BF16, Format.FP8, Format.MXFP4], torch.device("cuda", 0))
    assert line == "fp8: native torchao kernel; mxfp4: emulated (cuda:0)"


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
