"""The number grids and the arithmetic every quantizer shares, written once.

Both quantizer paths use this module: the fused kernels (lightning_snip.kernels) trace it, and the
torchao composition (lightning_snip.quantize.reference_fake_quantize) calls it where torchao lacks a
rule. What torchao does not have, written here by hand:

- ``round_to_grid``: round-to-nearest-even onto E4M3 / E5M2 / E2M1 with arithmetic and one bit trick,
  which inductor fuses with the scale computation into one vectorized loop on a CPU (torchao's FP4
  cast packs and unpacks codes in a dozen passes; inductor does not vectorize float8 casts);
- ``stochastic_round_e2m1``: stochastic rounding onto E2M1 (torchao has it only inside GPU kernels);
- the NVFP4 per-tensor scale's floor and its all-zero rule (``nvfp4_scale_floor``), which torchao
  lacks, and the 2^-e multiply that never forms a subnormal factor (``times_pow2_neg``).
"""

from __future__ import annotations

import torch

from lightning_snip.formats import Fp8Dtype

# Element grids: (mantissa bits, exponent of the smallest normal, largest finite value).
E4M3 = (3, -6, 448.0)
E5M2 = (2, -14, 57344.0)
E2M1 = (1, 0, 6.0)
FP8_GRIDS = {torch.float8_e4m3fn: E4M3, torch.float8_e5m2: E5M2}
MX_BLOCK = 32  # the OCP MX block size (torchao's default); NVFP4 blocks are 16
NVFP4_BLOCK = 16

# NVFP4's per-tensor scale is at least this (nvfp4_scale_floor; torchao's has no floor): below it, a
# block scale (>= E4M3's smallest normal 2^-6) times the per-tensor scale is subnormal, flushed to zero
# on a GPU (0 / 0 = NaN), and 1 / per-tensor / block scale overflows. Only tensors whose amax is below
# 448 * 6 * 2^-120 (about 2e-33) are affected.
NVFP4_MIN_PER_TENSOR_SCALE = 2.0**-120


def fp8_dtype(dtype: Fp8Dtype) -> torch.dtype:
    """The torch element type of an Fp8Dtype."""
    return torch.float8_e4m3fn if Fp8Dtype(dtype) is Fp8Dtype.E4M3 else torch.float8_e5m2


def round_to_grid(v: torch.Tensor, grid: tuple[int, int, float]) -> torch.Tensor:
    """Round float32 values to nearest-even on a float grid with subnormals; saturate at its max.

    Normal range: round the fp32 mantissa to ``mbits`` bits in the integer domain (add half an ulp
    minus one plus the kept lsb, then clear the dropped bits: carries move into the exponent
    correctly). Below the smallest normal the grid is uniform: torch.round (half to even) on the
    scaled value. NaN stays NaN; +-inf saturates (the reference clamps before casting).
    """
    mbits, emin, vmax = grid
    mag = v.abs().clamp(max=vmax)
    drop = 23 - mbits
    bits = mag.view(torch.int32)
    normal = ((bits + ((1 << (drop - 1)) - 1) + ((bits >> drop) & 1)) & ~((1 << drop) - 1)).view(torch.float32)
    sub_step = 2.0 ** (emin - mbits)
    sub = torch.round(mag * (1.0 / sub_step)) * sub_step
    return torch.copysign(torch.where(mag < 2.0**emin, sub, normal), v)


def random_bits(n: int, generator: torch.Generator | torch.Tensor | None, device) -> torch.Tensor:
    """Random bits for ``n`` stochastic-rounding uniforms: ceil(n / 2) int64 draws, each holding two
    24-bit uniforms (uniforms_from_bits). Half the generator calls of torch.rand (the CPU generator's
    cost dominated SR), and the same distribution as torch.rand's float32: multiples of 2^-24 in [0, 1).
    Drawn from the caller's generator (outside the fused kernels) by both quantizer paths, so they agree
    for one state. ``generator`` may be an RNG token (lightning_snip.rng): the same draw through a custom operator
    that torch.compile traces (SNIPLinear's GEMMs pass their layer's token)."""
    if isinstance(generator, torch.Tensor):
        from lightning_snip.rng import generator_of, random_bits_op

        if torch.compiler.is_compiling():
            return random_bits_op(generator, n, torch.device(device))
        generator = generator_of(generator)  # eager: the same draw without the operator's dispatch
    return torch.empty((n + 1) // 2, dtype=torch.int64, device=device).random_(generator=generator)


def uniforms_from_bits(bits: torch.Tensor, shape) -> torch.Tensor:
    """Float32 uniforms in [0, 1) of ``shape`` from random_bits (traceable: fused kernels call it). 2-D
    ``bits`` (slices x draws) hold one random_bits draw per equal, consecutive slice of the elements (a
    stack of layers quantized as one matrix, groups.quantize_stack): each slice's uniforms from its row."""
    mask = (1 << 24) - 1
    n = 1
    for d in shape:
        n = n * d
    if bits.dim() == 2:
        u = torch.cat([bits & mask, (bits >> 24) & mask], dim=1)[:, : n // bits.shape[0]].reshape(-1)
        return (u.to(torch.float32) * 2.0**-24).reshape(shape)
    u = torch.cat([bits & mask, (bits >> 24) & mask])[: bits.shape[0] * 2].to(torch.float32) * 2.0**-24
    return u[:n].reshape(shape)


def stochastic_round_e2m1(v: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
    """Round scaled values onto the E2M1 grid, up with probability equal to the distance from below,
    with the random bits given (random_bits).

    The positive E2M1 grid {0, 0.5, 1, 1.5, 2, 3, 4, 6} is uniform inside each binade (step 0.5 below
    2, 1 in [2, 4), 2 in [4, 6]), so lo = floor(|v| / step) * step. E[q] = v for |v| <= 6; larger
    magnitudes (only where an E4M3 block scale rounded down) saturate at 6. Non-finite values pass
    through. Tested on its own in tests/test_kernels.py (P(round up) = distance, unbiasedness).
    """
    u = uniforms_from_bits(bits, v.shape)
    mag = v.abs().clamp(max=6.0)
    step = torch.where(mag < 2.0, 0.5, torch.where(mag < 4.0, 1.0, 2.0))
    lo = torch.floor(mag / step) * step
    q = torch.where(u * step < mag - lo, lo + step, lo).clamp(max=6.0)
    q = torch.copysign(q, v)
    return torch.where(torch.isfinite(v), q, v)


def times_pow2_neg(v: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
    """v * 2^-e for integer-valued e in [-127, 127], with every factor a normal float32: 2^-127 (e = 127,
    a block holding inf) is subnormal, flushed to zero where denormals are (Triton kernels,
    torch.set_flush_denormal), and inf * 0 would be NaN. Equal to v * 2^-e where nothing is flushed.
    What a flush still changes, without NaN and as in torchao's own cast: a block whose amax is below
    max_pos * 2^-126 (about 7e-38 for E2M1, 5e-36 for E4M3, 7e-34 for E5M2 gradients) has a subnormal
    amax / max_pos, and its values quantize to zero."""
    return v * torch.where(e == 127.0, 0.5, 1.0) * torch.exp2(-torch.clamp(e, max=126.0))


def nvfp4_scale_floor(scale: torch.Tensor) -> torch.Tensor:
    """The per-tensor NVFP4 scale (amax / (448 * 6)) as used here: 1.0 for an all-zero tensor, where
    torchao's 0 makes every block 0 / 0 = NaN (a zero weight, e.g. a LoRA-B initialization, or an
    all-zero gradient must quantize to zeros); and at least NVFP4_MIN_PER_TENSOR_SCALE (an eager
    0 * inf gave NaN for a tensor of amax ~1e-34). A NaN scale stays NaN."""
    return torch.where(scale == 0, torch.ones_like(scale), scale.clamp(min=NVFP4_MIN_PER_TENSOR_SCALE))
