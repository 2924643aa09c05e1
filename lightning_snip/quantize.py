"""Quantize-dequantize along a GEMM's contraction axis: the emulation of every format's operands.

The numerics are torchao's: FP8 scales and casts from ``torchao.float8``, MX block scaling from
``torchao.prototype.mx_formats.MXTensor`` and NVFP4 two-level scaling from ``NVFP4Tensor`` /
``nvfp4_quantize``, composed in ``reference_fake_quantize``. ``fake_quantize`` runs the same numbers
through lightning_snip.kernels (compiled, 3-13x faster on a CPU; tested bit for bit against the
reference). What torchao lacks is written by hand: quantizing along an arbitrary axis (here: ``to_rows`` /
``from_rows``, the contraction axis moved last and zero-padded to whole blocks, which leaves every dot product
exact), stochastic rounding onto the FP4 (E2M1) grid, which torchao only has as a GPU kernel (lightning_snip.grid:
it reuses torchao's block scales and replaces only the final rounding step), and NVFP4's 2D weight scales.
"""

from __future__ import annotations

import torch

from lightning_snip import kernels
from lightning_snip.formats import Format, Fp8Dtype, Fp8Scaling, QuantRecipe, Rounding
from lightning_snip.grid import (MX_BLOCK, NVFP4_BLOCK, fp8_dtype, nvfp4_scale_floor, random_bits, stochastic_round_e2m1,
                                 times_pow2_neg)


def fake_quantize(
    x: torch.Tensor,
    fmt: Format,
    *,
    axis: int,
    rounding: Rounding = Rounding.NEAREST,
    recipe: QuantRecipe = QuantRecipe(),
    is_grad: bool = False,
    generator: torch.Generator | None = None,
    bits: torch.Tensor | None = None,
    scales_2d: bool = False,
) -> torch.Tensor:
    """Quantize a 2-D tensor to ``fmt`` with scales shared along ``axis`` and return it dequantized.

    ``axis`` is the GEMM's contraction (reduction) axis: scale blocks run along it. Non-finite inputs
    stay non-finite in the output (they are never silently replaced). Returns a tensor of x's dtype.

    Args:
        x: a 2-D tensor.
        fmt: the target format; BF16 returns x unchanged (the run's own precision).
        axis: 0 or 1, the contraction axis.
        rounding: NEAREST, or STOCHASTIC (FP4 formats only; unbiased).
        recipe: FP8 scaling granularity and gradient dtype.
        is_grad: the operand is a gradient (selects recipe.fp8_grad_dtype for FP8/MXFP8).
        generator: random source for stochastic rounding.
        bits: stochastic rounding's random bits, drawn already (grid.random_bits for the numel of x
            padded to whole blocks along ``axis``, padded_numel) instead of from ``generator``; the fused
            quantizers only (not the reference's). 2-D (slices x draws, axis 1 only): one draw per equal
            slice of x's rows, each as for that slice alone (a stack of layers, groups.quantize_stack).
        scales_2d: NVFP4 with one scale per 16x16 tile (a weight under QuantRecipe.nvfp4_weight_scales_2d; the same
            numbers along either axis), rounded to nearest.
    """
    _check_quantize_args(x, fmt, axis, rounding)
    if scales_2d:
        if fmt is not Format.NVFP4 or rounding is not Rounding.NEAREST or bits is not None:
            raise ValueError(f"scales_2d: 2D block scales are NVFP4's, for weights rounded to nearest (got "
                             f"{fmt.value}, rounding={rounding.value})")
        return nvfp4_2d_fake_quantize(x)
    if fmt is Format.BF16:
        return x
    if bits is not None and (rounding is not Rounding.STOCHASTIC or kernels.quantizer_mode() == "reference"):
        raise ValueError("bits: pre-drawn random bits are for stochastic rounding with the fused quantizers "
                         f"(rounding={rounding.value}, LIGHTNING_SNIP_QUANTIZERS={kernels.quantizer_mode()})")
    if kernels.quantizer_mode() == "reference":
        return reference_fake_quantize(x, fmt, axis=axis, rounding=rounding, recipe=recipe, is_grad=is_grad,
                                       generator=generator)
    rows = to_rows(x, axis, fmt.block_size or 1)
    if fmt is Format.FP8:
        dtype = fp8_dtype(recipe.fp8_grad_dtype) if is_grad else torch.float8_e4m3fn
        fp8 = kernels.fp8_rowwise if recipe.fp8_scaling is Fp8Scaling.ROWWISE else kernels.fp8_tensorwise
        out = fp8(rows, dtype)
    elif rounding is Rounding.NEAREST:
        if fmt is Format.NVFP4:
            out = kernels.nvfp4_nearest(rows)
        else:
            if fmt is Format.MXFP4:
                grid = "e2m1"
            else:
                grid = "e5m2" if (is_grad and recipe.fp8_grad_dtype is Fp8Dtype.E5M2) else "e4m3"
            out = kernels.mx_nearest(rows, grid)
    else:
        # Stochastic rounding: the random bits are drawn here, eagerly, as the reference draws them.
        if bits is None:
            bits = random_bits(rows.numel(), generator, x.device)  # turned into uniforms inside the kernel
        else:
            _check_bits(bits, rows.numel(), x.shape[0], axis)
        out = kernels.nvfp4_stochastic(rows, bits) if fmt is Format.NVFP4 else kernels.mx_stochastic(rows, bits)
    return from_rows(out, x, axis)


def nvfp4_2d_fake_quantize(x: torch.Tensor) -> torch.Tensor:
    """NVFP4 with one E4M3 scale per 16x16 tile under the tensor's FP32 scale, rounded to nearest, dequantized (x's
    dtype): the recipe's weights, one quantized tensor for the forward and (transposed) the dgrad GEMM. The two
    scale levels and the rounding are those of 1x16 NVFP4 (kernels._nvfp4_rtn_kernel), the block a tile; written
    here because torchao's 2D quantizer is a Triton kernel only (nvfp4_training.quantize_2d_triton). Both axes are
    zero-padded to whole tiles (zeros change no tile's amax)."""
    rows, cols = x.shape
    padded = torch.nn.functional.pad(x.float(), (0, (-cols) % NVFP4_BLOCK, 0, (-rows) % NVFP4_BLOCK))
    tiles = padded.reshape(padded.shape[0] // NVFP4_BLOCK, NVFP4_BLOCK, padded.shape[1] // NVFP4_BLOCK, NVFP4_BLOCK)
    out = kernels.nvfp4_nearest_2d(tiles).reshape(padded.shape)  # (compiled; the padding and layout eager)
    return out[:rows, :cols].to(x.dtype)


def nvfp4_2d_parts(x: torch.Tensor):
    """nvfp4_2d_fake_quantize as parts for torchao's NVFP4Tensor (the native GEMM path, gemm.torchao_block_mm): (E2M1
    values as float32 of x's shape, E4M3 block scales (rows, cols / 16) along dim 1, the float32 per-tensor scale),
    element = value x block scale x per-tensor scale. A 16x16 tile's one scale is written into each of its 16 rows'
    1x16 blocks, so torchao's 1x16 block-scaled GEMM multiplies the recipe's 2D-scaled weight unchanged; x's
    transpose gives the transposed parts (the dgrad's W^T). Both dimensions must be multiples of 16. The 2D kernel's
    own arithmetic (kernels.nvfp4_nearest_parts over a tile), eager."""
    rows, cols = x.shape
    if rows % NVFP4_BLOCK or cols % NVFP4_BLOCK:
        raise ValueError(f"x: both dimensions must be multiples of {NVFP4_BLOCK} for 2D NVFP4 parts, got {tuple(x.shape)}")
    tiles = x.float().reshape(rows // NVFP4_BLOCK, NVFP4_BLOCK, cols // NVFP4_BLOCK, NVFP4_BLOCK)
    codes, per_tensor, block_fp8 = kernels.nvfp4_nearest_parts(tiles, (1, 3))
    scales = block_fp8.expand(-1, NVFP4_BLOCK, -1, 1).reshape(rows, cols // NVFP4_BLOCK)
    return codes.reshape(rows, cols), scales.to(torch.float8_e4m3fn), per_tensor.reshape(())


def to_rows(x: torch.Tensor, axis: int, block: int) -> torch.Tensor:
    """fp32, contraction axis last (a view when x is fp32), zero-padded to whole blocks (zero terms
    leave every dot product exact). Eager in the fused path: shapes and layout stay out of the
    compiled graphs, which would otherwise specialize on them."""
    rows = x.float() if axis == 1 else x.float().t()
    pad = (-rows.shape[1]) % block
    # Contiguous: blocks along a strided axis made the compiled kernels 5x slower (measured).
    return torch.nn.functional.pad(rows, (0, pad)) if pad else rows.contiguous()


def from_rows(out: torch.Tensor, x: torch.Tensor, axis: int) -> torch.Tensor:
    """to_rows undone: the padding cut, the axis moved back, x's dtype."""
    cols = x.shape[1] if axis == 1 else x.shape[0]
    out = out[:, :cols]
    return (out if axis == 1 else out.t()).to(x.dtype)


def _check_bits(bits: torch.Tensor, numel: int, num_rows: int, axis: int) -> None:
    """fake_quantize's pre-drawn ``bits`` against the ``numel`` elements it rounds (x's ``num_rows``)."""
    if bits.dim() == 2 and axis == 1 and bits.shape[0] >= 1 and num_rows % bits.shape[0] == 0:
        slices = bits.shape[0]
        expected = (slices, (numel // slices + 1) // 2)
        what = f"{slices} slices of {numel // slices} elements"
    else:
        expected, what = ((numel + 1) // 2,), f"{numel} elements"
    if tuple(bits.shape) != expected:
        raise ValueError(f"bits: expected shape {expected} of random int64 values for {what} (grid.random_bits; "
                         f"2-D: one row per equal slice of x's rows, axis 1), got shape {tuple(bits.shape)}")


def padded_numel(shape: tuple[int, int], fmt: Format, axis: int) -> int:
    """The elements fake_quantize rounds for a 2-D tensor of ``shape``: its contraction ``axis`` padded to
    whole blocks of ``fmt`` (the count of grid.random_bits that stochastic rounding draws for it)."""
    block = fmt.block_size or 1
    cols = shape[axis]
    return shape[1 - axis] * (cols + (-cols) % block)


def reference_fake_quantize(
    x: torch.Tensor,
    fmt: Format,
    *,
    axis: int,
    rounding: Rounding = Rounding.NEAREST,
    recipe: QuantRecipe = QuantRecipe(),
    is_grad: bool = False,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """fake_quantize composed from torchao's quantizers as they are (slow on CPU; the reference
    that lightning_snip.kernels is tested against bit for bit). Same arguments as fake_quantize."""
    _check_quantize_args(x, fmt, axis, rounding)
    if fmt is Format.BF16:
        return x
    rows = to_rows(x, axis, fmt.block_size or 1)
    if fmt is Format.FP8:
        out = _fp8_fake_quantize(rows, recipe, is_grad)
    elif fmt is Format.NVFP4:
        out = _nvfp4_fake_quantize(rows, rounding, generator)
    else:
        out = _mx_fake_quantize(rows, fmt, rounding, recipe, is_grad, generator)
    return from_rows(out, x, axis)


def _check_quantize_args(x, fmt: Format, axis: int, rounding: Rounding) -> None:
    if x.dim() != 2:
        raise ValueError(f"x: expected a 2-D tensor, got shape {tuple(x.shape)}")
    if axis not in (0, 1):
        raise ValueError(f"axis: must be 0 or 1, got {axis!r}")
    if rounding is Rounding.STOCHASTIC and not fmt.is_fp4:
        raise ValueError(f"rounding: stochastic rounding is implemented for FP4 formats only, not {fmt.value}")


def _fp8_fake_quantize(rows: torch.Tensor, recipe: QuantRecipe, is_grad: bool) -> torch.Tensor:
    from torchao.float8.config import ScalingGranularity
    from torchao.float8.float8_utils import tensor_to_scale, to_fp8_saturated

    dtype = fp8_dtype(recipe.fp8_grad_dtype) if is_grad else torch.float8_e4m3fn
    if recipe.fp8_scaling is Fp8Scaling.ROWWISE:
        # torchao's ROWWISE recipe rounds each row's scale down to a power of two: scaling and
        # unscaling are then exact, and a bf16 operand holds the dequantized values exactly. This
        # keeps the emulation bit-identical to Float8Linear(emulate=True) (tests/test_numerics.py).
        scale = tensor_to_scale(rows, dtype, scaling_granularity=ScalingGranularity.AXISWISE, axiswise_dim=-1,
                                round_scales_to_power_of_2=True)
    else:
        scale = tensor_to_scale(rows, dtype)  # torchao's TENSORWISE recipe: the exact amax scale
    return to_fp8_saturated(rows * scale, dtype).float() / scale


def _mx_fake_quantize(rows, fmt, rounding, recipe, is_grad, generator) -> torch.Tensor:
    from torchao.prototype.mx_formats.config import ScaleCalculationMode
    from torchao.prototype.mx_formats.mx_tensor import MXTensor, get_fp_scale

    if fmt is Format.MXFP8:
        elem = fp8_dtype(recipe.fp8_grad_dtype) if is_grad else torch.float8_e4m3fn
    else:
        elem = torch.float4_e2m1fn_x2
    # RCEIL (cuBLAS's MX scale rule) never saturates a block's largest element, which keeps
    # stochastic rounding unbiased; FLOOR would clip up to 25% of it for E2M1.
    mode = ScaleCalculationMode.RCEIL
    if rounding is Rounding.NEAREST:
        return MXTensor.to_mx(rows, elem, MX_BLOCK, scaling_mode=mode).dequantize(torch.float32)
    q, scale_e8m0 = mxfp4_stochastic_parts(rows, generator)
    scale = get_fp_scale(scale_e8m0).reshape(rows.shape[0], -1, 1)
    return (q.reshape(scale.shape[0], -1, MX_BLOCK) * scale).reshape(rows.shape)


def mxfp4_stochastic_parts(rows: torch.Tensor, generator: torch.Generator | None):
    """MXFP4 with stochastically rounded elements, as parts: (E2M1 values as float32 of rows' shape,
    the E8M0 block scales torchao's RCEIL cast computes for rows, (rows, cols / 32)). Rows' columns
    must be a multiple of 32. The native GEMM path wraps the parts into torchao's MXTensor
    (gemm.torchao_block_mm); the emulation multiplies them out."""
    from torchao.prototype.mx_formats.config import ScaleCalculationMode
    from torchao.prototype.mx_formats.mx_tensor import to_mx

    # RCEIL: see _mx_fake_quantize.
    scale_e8m0, _ = to_mx(rows, torch.float4_e2m1fn_x2, MX_BLOCK, ScaleCalculationMode.RCEIL)
    scale_e8m0 = scale_e8m0.reshape(rows.shape[0], -1)
    # Multiplied by 2^-e (grid.times_pow2_neg: normal factors), not divided by the scale 2^e: 2^-127 (an
    # all-zero block's scale) is subnormal, flushed to zero where denormals are (Triton kernels,
    # torch.set_flush_denormal), and 0 / 0 would be NaN. A NaN block (code 255) stays NaN.
    e = (scale_e8m0.view(torch.uint8).to(torch.float32) - 127.0).unsqueeze(-1)
    scaled = times_pow2_neg(rows.reshape(rows.shape[0], -1, MX_BLOCK), e.clamp(max=127.0))
    q = _stochastic_round_e2m1(torch.where(e == 128.0, float("nan"), scaled), generator)
    return q.reshape(rows.shape), scale_e8m0


def _nvfp4_fake_quantize(rows, rounding, generator) -> torch.Tensor:
    from torchao.prototype.mx_formats.nvfp4_tensor import NVFP4Tensor

    if rounding is Rounding.NEAREST:
        t = NVFP4Tensor.to_nvfp4(rows, per_tensor_scale=nvfp4_per_tensor_scale(rows))
        return t.dequantize(torch.float32)
    q, block_scales, per_tensor_scale = nvfp4_stochastic_parts(rows, generator)
    scale = (block_scales.float() * per_tensor_scale).unsqueeze(-1)
    return (q.reshape(scale.shape[0], -1, NVFP4_BLOCK) * scale).reshape(rows.shape)


def nvfp4_per_tensor_scale(rows: torch.Tensor) -> torch.Tensor:
    """torchao's per-tensor NVFP4 scale (amax / (448 * 6)) under grid.nvfp4_scale_floor (1.0 for an
    all-zero tensor, at least 2^-120). A NaN amax stays NaN."""
    from torchao.prototype.mx_formats.nvfp4_tensor import per_tensor_amax_to_scale

    return nvfp4_scale_floor(per_tensor_amax_to_scale(rows.abs().amax()))


def nvfp4_stochastic_parts(rows: torch.Tensor, generator: torch.Generator | None):
    """NVFP4 with stochastically rounded elements, as parts: (E2M1 values as float32 of rows' shape,
    E4M3 block scales (rows, cols / 16), the float32 per-tensor scale); element = value x block
    scale x per-tensor scale. Rows' columns must be a multiple of 16. The native GEMM path wraps the
    parts into torchao's NVFP4Tensor (gemm.torchao_block_mm); the emulation multiplies them out."""
    from torchao.prototype.mx_formats.nvfp4_tensor import nvfp4_quantize

    per_tensor_scale = nvfp4_per_tensor_scale(rows)
    block_scales_fp8, _ = nvfp4_quantize(rows, NVFP4_BLOCK, per_tensor_scale)
    block_scales_fp8 = block_scales_fp8.reshape(rows.shape[0], -1)
    blocks = rows.reshape(rows.shape[0], -1, NVFP4_BLOCK)
    # torchao rounds the E4M3 block scale to nearest; where that went down, the block's largest
    # element would saturate at 6 and bias stochastic rounding. Step such scales one E4M3 value up.
    scale = block_scales_fp8.float() * per_tensor_scale
    too_small = blocks.abs().amax(-1) > 6.0 * scale
    # (Clamped: torch before 2.12 does not saturate an eager float8 cast; 504 would become NaN.)
    bumped = (block_scales_fp8.float() * 1.125).clamp(max=448.0).to(torch.float8_e4m3fn)
    block_scales_fp8 = torch.where(too_small, bumped, block_scales_fp8)
    scale = torch.where(too_small, bumped.float() * per_tensor_scale, scale).unsqueeze(-1)
    q = _stochastic_round_e2m1(blocks / scale, generator)
    return q.reshape(rows.shape), block_scales_fp8, per_tensor_scale


def _stochastic_round_e2m1(v: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """grid.stochastic_round_e2m1 with random bits drawn eagerly from ``generator``."""
    return stochastic_round_e2m1(v, random_bits(v.numel(), generator, v.device))
