"""Kernel choice per format and device (capability mocked); torchao.float8's native GEMM path,
which runs on a CPU too (torch._scaled_mm has a CPU implementation); torchao's block-scaled
(MX, NVFP4) path, whose GEMM has no CPU kernel: its operands are checked bit for bit through
torchao's emulated GEMM, and its dispatch up to torch's block-scaled GEMM call."""

from __future__ import annotations

import logging

import pytest
import torch

from lightning_snip import gemm as gemm_mod
from lightning_snip.formats import Format, QuantRecipe
from lightning_snip.quantize import fake_quantize
from lightning_snip.gemm import Kernel, describe_kernels, kernel_for, quantized_matmul, torchao_block_mm
from lightning_snip.linear import SNIPLinear

ONE_D = QuantRecipe(nvfp4_weight_scales_2d=False)  # NVFP4 weights in 1x16 blocks: every GEMM natively


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
    assert line.startswith("fp8: native torchao kernel; mxfp4: emulated (cuda:0); a GEMM runs natively when")
    _mock_gpu(monkeypatch, (10, 0))
    line = describe_kernels([Format.FP8, Format.MXFP8, Format.NVFP4], torch.device("cuda", 0))
    assert line.startswith("fp8: native torchao kernel; mxfp8: native torchao block-scaled kernel; "
                           "nvfp4: native torchao block-scaled kernel (cuda:0); a GEMM runs natively when")
    assert describe_kernels([Format.MXFP4], torch.device("cpu")) == "mxfp4: emulated (cpu)"


def test_setup_names_the_layers_a_native_kernel_does_not_take(monkeypatch, caplog):
    from lightning_snip.config import SNIPConfig
    from lightning_snip.controller import log_setup

    layers = {"ok": SNIPLinear(64, 96), "odd": SNIPLinear(64, 40), "nv": SNIPLinear(48, 64),
              "head": SNIPLinear(64, 50)}
    layers["head"].pinned = Format.BF16  # pinned to another format: never runs fp8, not named
    assert gemm_mod.emulated_layers([Format.FP8, Format.NVFP4], torch.device("cpu"), layers) == {}
    _mock_gpu(monkeypatch, (10, 0))
    cuda = torch.device("cuda", 0)
    found = gemm_mod.emulated_layers([Format.BF16, Format.FP8, Format.MXFP4, Format.NVFP4], cuda, layers)
    # MXFP4: only layers whose shape allows it (then the native kernel takes them); NVFP4 blocks of 16
    # allow 48, the native GEMM needs 32.
    assert found == {Format.FP8: ["odd"], Format.MXFP4: [], Format.NVFP4: ["nv"]}
    with caplog.at_level("INFO", logger="lightning_snip"):
        log_setup(SNIPConfig(candidate_formats=("fp8", "mxfp4", "nvfp4")), layers, cuda)
    assert "1 layer(s) run fp8 emulated (weight dimensions not multiples of 16): odd (64->40)" in caplog.text
    assert "1 layer(s) run nvfp4 emulated (weight dimensions not multiples of 32): nv (48->64)" in caplog.text
    assert "every layer that can run mxfp4 has weight dimensions its native kernel takes" in caplog.text
    # the recipe's 2D NVFP4 weight scales run natively too (since 2026-12-06): no warning about them
    assert "2D 16x16 scales" not in caplog.text and "emulated on this GPU" not in caplog.text


@pytest.mark.parametrize("capability, num_warnings", [((9, 0), 1), ((10, 0), 0), (None, 0)])
def test_setup_warns_once_where_a_gpu_emulates_fp4(monkeypatch, caplog, capability, num_warnings):
    """A Hopper (9.0) emulates FP4 and trains slower than bf16: one warning line saying what to set; a B200
    (10.0) runs it natively; a CPU (None here) emulates by design, said by the kernel line's INFO only."""
    from lightning_snip.config import SNIPConfig
    from lightning_snip.controller import log_setup

    device = torch.device("cpu") if capability is None else torch.device("cuda", 0)
    if capability is not None:
        _mock_gpu(monkeypatch, capability)
    layers = {"up": SNIPLinear(64, 128), "down": SNIPLinear(128, 64)}
    with caplog.at_level("INFO", logger="lightning_snip"):
        log_setup(SNIPConfig(pins=[]), layers, device)  # (no pins: no warning about them)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == num_warnings, warnings
    if num_warnings:
        assert "\n" not in warnings[0] and warnings[0].startswith("SNIP: cuda:0 (compute capability 9.0) has no native "
                                                                  "FP4 GEMM")
        assert "nvfp4 run emulated and train slower than bf16" in warnings[0]  # the default FP4 candidate
        assert "candidate_formats=[fp8], fp4_fraction=0 (the app: snip.candidate_formats=[fp8] snip.fp4_fraction=0)" \
            in warnings[0]
        SNIPConfig(candidate_formats=["fp8"], fp4_fraction=0)  # the advice is a valid config
    assert "SNIP: GEMM kernels: fp8: " in caplog.text  # the kernel line stays, at INFO
    caplog.clear()
    with caplog.at_level("INFO", logger="lightning_snip"):  # no FP4 format, no warning
        log_setup(SNIPConfig(candidate_formats=["fp8"], fp4_fraction=0, pins=[]), layers, device)
    assert not [r for r in caplog.records if r.levelno == logging.WARNING]


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


def test_native_fp8_gemm_with_fp32_output_is_the_fp32_gemm_of_the_same_fp8_operands(monkeypatch):
    # The statistics round asks for fp32 outputs (out_dtype): on bf16 operands torchao would return
    # bf16, adding the output's rounding to the measured quantization error. Same FP8 casts (torchao
    # scales an fp32 upcast of them), fp32 output.
    # (tensorwise: the CPU's rowwise kernel rounds its outputs through bf16 whatever the output dtype)
    calls = _spy_scaled_mm(monkeypatch)
    recipe = QuantRecipe(fp8_scaling="tensorwise")
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(64, 128, generator=g).bfloat16(), torch.randn(96, 128, generator=g).bfloat16()
    out = quantized_matmul(a, b, Format.FP8, recipe=recipe, kernel=Kernel.TORCHAO_FP8, out_dtype=torch.float32)
    assert out.dtype == torch.float32 and len(calls) == 1
    fp32_operands = quantized_matmul(a.float(), b.float(), Format.FP8, recipe=recipe, kernel=Kernel.TORCHAO_FP8)
    assert torch.equal(out, fp32_operands)
    bf16_out = quantized_matmul(a, b, Format.FP8, recipe=recipe, kernel=Kernel.TORCHAO_FP8)
    assert bf16_out.dtype == torch.bfloat16 and not torch.equal(bf16_out.float(), out)


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
    monkeypatch.setattr(gemm_mod, "kernel_for", lambda fmt, device: Kernel.TORCHAO_FP8)
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


def _decode_block_gemms(monkeypatch):
    """Stand-ins for torch's block-scaled GEMMs (no CPU kernel exists) that decode what torchao hands
    them (packed e2m1 pairs or e4m3 elements, swizzled e8m0 / e4m3 block scales, b column-major),
    multiply in float64 and record each call: the native path run numerically on a CPU."""
    from torchao.prototype.mx_formats.kernels import f4_unpacked_to_f32, unpack_uint4
    from torchao.prototype.mx_formats.utils import from_blocked

    calls = []

    def elements(x):
        assert x.is_contiguous()
        if x.dtype == torch.float4_e2m1fn_x2:
            return f4_unpacked_to_f32(unpack_uint4(x.view(torch.uint8))).double()
        return x.double()

    def scales(s, rows, k, block):
        s = from_blocked(s.reshape(-1), rows, k // block)
        if s.dtype == torch.float8_e4m3fn:
            return s.double()
        return torch.exp2(s.view(torch.uint8).double() - 127)  # e8m0: a biased power of two

    def gemm(name, a, b, scale_a, scale_b, out_dtype, block):
        calls.append((name, a.dtype, b.dtype, scale_a.dtype, tuple(a.shape)))
        qa, qb = elements(a), elements(b.t())  # b arrives column-major (k x n)
        (m, k), n = qa.shape, qb.shape[0]
        qa = (qa.view(m, k // block, block) * scales(scale_a, m, k, block)[..., None]).view(m, k)
        qb = (qb.view(n, k // block, block) * scales(scale_b, n, k, block)[..., None]).view(n, k)
        return (qa @ qb.t()).to(out_dtype)

    def scaled_mm(a, b, scale_a, scale_b, bias=None, out_dtype=None, **kwargs):
        assert bias is None
        return gemm("_scaled_mm", a, b, scale_a, scale_b, out_dtype, 16 if scale_a.dtype == torch.float8_e4m3fn else 32)

    def f_scaled_mm(a, b, scale_a, scale_recipe_a, scale_b, scale_recipe_b, output_dtype=None, **kwargs):
        return gemm("F.scaled_mm", a, b, scale_a, scale_b, output_dtype, 32)

    monkeypatch.setattr(torch, "_scaled_mm", scaled_mm)
    monkeypatch.setattr(torch.nn.functional, "scaled_mm", f_scaled_mm)
    return calls


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_block_kernel_native_path_through_torchs_block_scaled_gemm(monkeypatch, dtype):
    """On the native path (not emulated), torchao's dispatch hands torch's block-scaled GEMM the packed
    operands, e4m3 elements with e8m0 scales (mxfp8), e2m1 pairs with e8m0 scales (mxfp4, F.scaled_mm),
    e2m1 pairs with e4m3 scales (nvfp4), which decode to the emulation's product: for a forward GEMM and
    a stochastically rounded one with the same draws. Differences allowed: torchao's MX GEMM returns
    bf16 (an fp32 run's output is bf16-rounded), and the float64 stand-in accumulates exactly."""
    calls = _decode_block_gemms(monkeypatch)
    a, b = _operands(dtype)
    expected = {
        Format.MXFP8: ("_scaled_mm", torch.float8_e4m3fn, torch.float8_e4m3fn, torch.float8_e8m0fnu, (64, 128)),
        Format.MXFP4: ("F.scaled_mm", torch.float4_e2m1fn_x2, torch.float4_e2m1fn_x2, torch.float8_e8m0fnu, (64, 64)),
        Format.NVFP4: ("_scaled_mm", torch.float4_e2m1fn_x2, torch.float4_e2m1fn_x2, torch.float8_e4m3fn, (64, 64)),
    }
    for fmt, call in expected.items():
        for a_is_grad in (False, True):
            calls.clear()
            native = quantized_matmul(a, b, fmt, recipe=QuantRecipe(), a_is_grad=a_is_grad, kernel=Kernel.TORCHAO_BLOCK,
                                      generator=torch.Generator().manual_seed(1))
            emulated = quantized_matmul(a, b, fmt, recipe=QuantRecipe(), a_is_grad=a_is_grad, kernel=Kernel.EMULATED,
                                        generator=torch.Generator().manual_seed(1))
            assert calls == [call], (fmt, calls)
            assert native.shape == (64, 96) and native.dtype == dtype
            # bf16 output rounding (2^-9 relative) at most; a lost per-tensor scale, a round-to-nearest
            # gradient operand or a wrong scale rule differ by far more.
            diff = float((native.double() - emulated.double()).norm() / emulated.double().norm())
            assert diff < 4e-3, (fmt, a_is_grad, diff)
            if fmt is not Format.NVFP4 and dtype is torch.bfloat16:
                assert torch.equal(native, emulated), fmt  # products of bf16-exact values, one rounding
    # NVFP4 operands travel as fp32 on the native path: the per-tensor scales' product is applied in
    # fp32 (torchao rounds it to the operands' dtype), so bf16 runs see no whole-output scale bias.
    from lightning_snip.quantize import nvfp4_per_tensor_scale

    g = torch.Generator().manual_seed(13)
    a, b = (torch.randn(64, 128, generator=g) * 4.3).bfloat16(), torch.randn(96, 128, generator=g).bfloat16()
    product = nvfp4_per_tensor_scale(a.float()) * nvfp4_per_tensor_scale(b.float())
    assert float(product.bfloat16().float() / product) > 1.002  # these inputs would show the bias
    exact = (fake_quantize(a.float(), Format.NVFP4, axis=1).double()
             @ fake_quantize(b.float(), Format.NVFP4, axis=1).double().t())
    native = quantized_matmul(a, b, Format.NVFP4, recipe=QuantRecipe(), kernel=Kernel.TORCHAO_BLOCK).double()
    assert abs(float((native * exact).sum() / (exact * exact).sum()) - 1.0) < 2e-4


def test_block_kernel_takes_the_recipes_2d_weight_through_torchs_block_scaled_gemm(monkeypatch):
    """The recipe's 2D-scaled NVFP4 weight (issue 63) on the native path: a forward (W) and a dgrad (W^T) GEMM reach
    torch's block-scaled GEMM (the stand-in decodes what torchao hands it) with each 16x16 tile's scale in its rows'
    1x16 blocks, and give the emulated 2D product; with 1x16 scales they would not."""
    from lightning_snip.quantize import nvfp4_2d_parts

    calls = _decode_block_gemms(monkeypatch)
    a, w = _operands(torch.float32, m=64, n=96, k=128)
    for operand_b, a_in in ((w, a), (w.t().contiguous(), torch.randn(64, 96))):
        kwargs = dict(recipe=QuantRecipe(), b_is_weight=True, generator=torch.Generator().manual_seed(1))
        native = quantized_matmul(a_in, operand_b, Format.NVFP4, kernel=Kernel.TORCHAO_BLOCK, **kwargs)
        emulated = quantized_matmul(a_in, operand_b, Format.NVFP4, kernel=Kernel.EMULATED, **kwargs)
        one_d = quantized_matmul(a_in, operand_b, Format.NVFP4, kernel=Kernel.EMULATED,
                                 **dict(kwargs, recipe=QuantRecipe(nvfp4_weight_scales_2d=False)))
        assert len(calls) == 1
        calls.clear()
        diff = float((native.double() - emulated.double()).norm() / emulated.double().norm())
        assert diff < 1e-6, diff  # fp32 accumulation order only
        assert float((one_d.double() - emulated.double()).norm() / emulated.double().norm()) > 100 * max(diff, 1e-9)
    codes, scales, _ = nvfp4_2d_parts(w)
    tiles = scales.float().reshape(6, 16, 8)
    assert torch.equal(tiles, tiles[:, :1].expand_as(tiles))  # one scale per tile, in each of its 16 rows
    with pytest.raises(ValueError, match="multiples of 16"):
        nvfp4_2d_parts(torch.randn(24, 32))


def test_block_kernel_unsupported_gemms_are_emulated(monkeypatch):
    """Shapes off the 32-grid, and MXFP8 gradients in E5M2 (torchao's MX GEMM takes E4M3 only), take
    the emulation: no block-scaled GEMM call, the emulated result."""
    calls = _decode_block_gemms(monkeypatch)
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
    real = gemm_mod.torchao_block_mm

    def through_torchao(a, b, fmt_, recipe, a_is_grad, b_is_grad, generator=None, b_scales_2d=False):
        routed.append((fmt_, a_is_grad, b_is_grad, tuple(a.shape), tuple(b.shape)) + ((True,) if b_scales_2d else ()))
        return real(a, b, fmt_, recipe, a_is_grad, b_is_grad, generator, emulate=True, b_scales_2d=b_scales_2d)

    torch.manual_seed(0)
    layer = SNIPLinear(64, 96, format=fmt, recipe=ONE_D)
    x = torch.randn(2, 32, 64, requires_grad=True)
    layer.generator = torch.Generator().manual_seed(5)
    emulated = [t.detach().clone() for t in _fwd_bwd(layer, x)]
    monkeypatch.setattr(gemm_mod, "torchao_block_mm", through_torchao)
    monkeypatch.setattr(gemm_mod, "kernel_for", lambda f, device: Kernel.TORCHAO_BLOCK)
    layer.generator = torch.Generator().manual_seed(5)
    native = _fwd_bwd(layer, x)
    assert routed == [(fmt, False, False, (64, 64), (96, 64)),   # fwd: X, W along k
                      (fmt, True, False, (64, 96), (64, 96)),    # dgrad: G, W^T along m
                      (fmt, True, False, (96, 64), (64, 64))]    # wgrad: G^T, X^T along tokens
    for n, e in zip(native, emulated):
        assert torch.equal(n.detach(), e)
    if fmt is Format.NVFP4:  # the recipe (2D weight scales, the RHT on the wgrad): all three native, the same numbers
        layer.recipe = QuantRecipe()
        monkeypatch.undo()
        layer.generator = torch.Generator().manual_seed(5)
        emulated = [t.detach().clone() for t in _fwd_bwd(layer, x)]
        monkeypatch.setattr(gemm_mod, "torchao_block_mm", through_torchao)
        monkeypatch.setattr(gemm_mod, "kernel_for", lambda f, device: Kernel.TORCHAO_BLOCK)
        routed.clear()
        layer.generator = torch.Generator().manual_seed(5)
        native = _fwd_bwd(layer, x)
        assert routed == [(fmt, False, False, (64, 64), (96, 64), True),  # fwd: W with 16x16 tile scales
                          (fmt, True, False, (64, 96), (64, 96), True),   # dgrad: the same tiles, transposed
                          (fmt, True, False, (96, 64), (64, 64))]         # wgrad: after the RHT
        for n, e in zip(native, emulated):
            assert torch.equal(n.detach(), e)


@pytest.mark.parametrize("fmt", BLOCK_FORMATS, ids=lambda f: f.value)
def test_block_kernel_all_zero_and_tiny_operands(monkeypatch, fmt):
    """An all-zero operand (a zero-initialized weight, an all-zero gradient) gives a zero product on
    every path (torchao's NVFP4 per-tensor scale of 0 made it 0 / 0 = NaN), and blocks near the bottom
    of the float32 range (a re-cast would clamp their MXFP4 scale and zero them) match the emulation."""
    _decode_block_gemms(monkeypatch)
    zeros, b = torch.zeros(64, 128), _operands(torch.float32)[1]
    for a_is_grad in (False, True):
        for kernel in (Kernel.EMULATED, Kernel.TORCHAO_BLOCK):
            for x, y in ((zeros, b), (b[:64], zeros[:32])):
                out = quantized_matmul(x, y, fmt, recipe=QuantRecipe(), a_is_grad=a_is_grad, kernel=kernel,
                                       generator=torch.Generator().manual_seed(0))
                assert torch.equal(out, torch.zeros_like(out)), (kernel, a_is_grad)
        assert torch.equal(fake_quantize(zeros, fmt, axis=1), zeros)
    tiny = torch.zeros(32, 64)
    tiny[:, 0], tiny[:, 1] = 3.2 * 2.0**-126, 2.0**-126
    for seed in range(3):
        emulated = quantized_matmul(tiny, torch.eye(64)[:32], fmt, recipe=QuantRecipe(), a_is_grad=True,
                                    kernel=Kernel.EMULATED, generator=torch.Generator().manual_seed(seed))
        through = torchao_block_mm(tiny, torch.eye(64)[:32], fmt, QuantRecipe(), True, False,
                                   torch.Generator().manual_seed(seed), emulate=True)
        assert torch.equal(through, emulated), seed


@pytest.mark.parametrize("fmt", BLOCK_FORMATS, ids=lambda f: f.value)
def test_snip_linear_native_block_path_in_all_three_gemms(monkeypatch, fmt):
    """A bf16 SNIPLinear on a (mocked) compute-capability-10 device: forward, dgrad and wgrad each reach
    torch's block-scaled GEMM through torchao's dispatch (decoded on the CPU), with the operands of
    each GEMM's contraction axis, and give the emulated layer's output and gradients (MX: bit for bit;
    NVFP4: up to the per-tensor scales applied in fp32 instead of bf16)."""
    calls = _decode_block_gemms(monkeypatch)
    torch.manual_seed(0)
    layer = SNIPLinear(64, 96, format=fmt, recipe=ONE_D).bfloat16()
    x = torch.randn(2, 32, 64, dtype=torch.bfloat16, requires_grad=True)
    # A loss whose output gradient does not depend on the output: both runs round the same G
    # stochastically (with the output's gradient, NVFP4's small forward difference would move every
    # stochastic rounding decision downstream of it).
    r = torch.randn(2, 32, 96, dtype=torch.bfloat16)

    def fwd_bwd():
        layer.zero_grad(set_to_none=True)
        x.grad = None
        layer.generator = torch.Generator().manual_seed(5)
        y = layer(x)
        (y * r).float().sum().backward()
        return [y.detach().clone(), x.grad.clone(), layer.weight.grad.clone()]

    emulated = fwd_bwd()
    assert calls == []
    monkeypatch.setattr(gemm_mod, "kernel_for", lambda f, device: Kernel.TORCHAO_BLOCK)
    native = fwd_bwd()
    packed = 1 if fmt is Format.MXFP8 else 2  # e2m1 pairs: half the columns
    assert [c[4] for c in calls] == [(64, 64 // packed), (64, 96 // packed), (96, 64 // packed)]  # fwd, dgrad, wgrad
    for n, e in zip(native, emulated):
        if fmt is Format.NVFP4:
            assert float((n.double() - e.double()).norm() / e.double().norm()) < 1e-2
        else:
            assert torch.equal(n, e)


def test_fp8_scaling_auto_times_each_distinct_layer_shape_and_takes_the_faster_scaling(monkeypatch):
    from lightning_snip import gemm
    from lightning_snip.formats import Fp8Scaling

    def no_timing(*_):
        raise AssertionError("nothing is timed where fp8 is emulated")

    assert gemm.choose_fp8_scaling("cpu", [(64, 32)], timer=no_timing) == (Fp8Scaling.ROWWISE, {})
    # As where FP8 runs natively: the layer GEMMs recorded instead of run, timed by a scripted clock.
    monkeypatch.setattr(gemm, "kernel_for", lambda fmt, device: gemm.Kernel.TORCHAO_FP8)
    seen = []
    monkeypatch.setattr(gemm, "quantized_matmul", lambda a, b, fmt, *, recipe, **kw: seen.append(
        (recipe.fp8_scaling, tuple(a.shape), tuple(b.shape), kw.get("a_is_grad", False))))
    cost = {Fp8Scaling.ROWWISE: 1.0, Fp8Scaling.TENSORWISE: 0.5}

    def clock(fn, repeats):
        fn()
        return cost[seen[-1][0]]

    # (30, 64): not a native FP8 shape, not timed; (64, 32) twice in the model: counted twice
    chosen, times = gemm.choose_fp8_scaling("cpu", [(64, 32), (48, 64), (64, 32), (30, 64)], rows=16, timer=clock)
    assert chosen is Fp8Scaling.TENSORWISE and times == {Fp8Scaling.ROWWISE: 2.0 * 1 + 1.0, Fp8Scaling.TENSORWISE: 1.5}
    rowwise = [s[1:] for s in seen if s[0] is Fp8Scaling.ROWWISE]
    # forward X W^T, dgrad G W, wgrad G^T X of each distinct shape
    assert rowwise == [((16, 32), (64, 32), False), ((16, 64), (32, 64), True), ((64, 16), (32, 16), True),
                       ((16, 64), (48, 64), False), ((16, 48), (64, 48), True), ((48, 16), (64, 16), True)]
    cost[Fp8Scaling.TENSORWISE] = 1.0  # a tie keeps the finer scales
    assert gemm.choose_fp8_scaling("cpu", [(64, 32)], rows=16, timer=clock)[0] is Fp8Scaling.ROWWISE
    assert gemm.choose_fp8_scaling("cpu", [(30, 60)], timer=no_timing) == (Fp8Scaling.ROWWISE, {})
