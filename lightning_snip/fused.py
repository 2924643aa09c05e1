"""Fused emulation quantizers: the numerics of formats.reference_fake_quantize in one compiled pass.

Why this module exists: the reference path composes torchao's quantizers, which were written for
GPU kernels. On a CPU, torchao's eager FP4 cast packs and unpacks E2M1 codes with a dozen bitwise
passes, and inductor does not vectorize float8 casts, so compiling torchao's functions gave no
speed-up (measured on a 2048x128 operand, one thread: mxfp4 10-16 ms eager, 8.5 ms compiled; fp8
2.5 ms both; the 2048x128x352 matmul it feeds takes 3.5 ms). What is written here by hand is only
the final rounding onto a float grid (E4M3, E5M2, E2M1) with arithmetic and one bit trick, which
inductor fuses with the scale computation into one vectorized loop. The scales are torchao's:
``amax_to_scale`` (FP8) is called as it is; the MX (RCEIL) and NVFP4 (two-level) scale rules are
restated in a few lines each (see _e8m0_scales and _nvfp4_scales for why).
tests/test_fused.py checks every format, both roundings and both axes bit for bit against the
reference, on random and edge inputs (zeros, subnormals, block maxima, inf, NaN).

Stochastic rounding draws its random bits eagerly from the caller's generator (formats.random_bits,
as the reference does), so the fused and reference paths give identical results for the same
generator state; the bits become uniforms inside the compiled kernel.

Compilation: one graph per kernel family, shapes dynamic (``dynamic=True``), compiled on first use
and reused for every layer and step. Where torch.compile is unavailable or fails (no C++ compiler,
an unsupported device), the same functions run eagerly, with the same numerics, and the reason is
logged once. ``LIGHTNING_SNIP_QUANTIZERS=eager`` turns compilation off, ``=reference`` uses the
torchao composition (quantizer_mode).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)

# Element grids: (mantissa bits, exponent of the smallest normal, largest finite value).
E4M3 = (3, -6, 448.0)
E5M2 = (2, -14, 57344.0)
E2M1 = (1, 0, 6.0)
_GRIDS = {torch.float8_e4m3fn: E4M3, torch.float8_e5m2: E5M2}
# Kernels take grids by name: under dynamic=True an int argument would become symbolic.
GRID_NAMES = {"e4m3": E4M3, "e5m2": E5M2, "e2m1": E2M1}
MX_BLOCK = 32  # the OCP MX block size (torchao's default); NVFP4 blocks are 16


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


def stochastic_round_e2m1(v: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
    """Stochastic rounding onto E2M1 with the random bits given (formats._stochastic_round_e2m1 says
    why it is written by hand and what it guarantees)."""
    from lightning_snip.formats import uniforms_from_bits

    u = uniforms_from_bits(bits, v.shape)
    mag = v.abs().clamp(max=6.0)
    step = torch.where(mag < 2.0, 0.5, torch.where(mag < 4.0, 1.0, 2.0))
    lo = torch.floor(mag / step) * step
    q = torch.where(u * step < mag - lo, lo + step, lo).clamp(max=6.0)
    q = torch.copysign(q, v)
    return torch.where(torch.isfinite(v), q, v)


def to_rows(x: torch.Tensor, axis: int, block: int) -> torch.Tensor:
    """fp32, contraction axis last (a view when x is fp32), zero-padded to whole blocks as the
    reference does (zero terms leave every dot product exact). Eager: shapes and layout stay out of
    the compiled graphs, which would otherwise specialize on them."""
    rows = x.float() if axis == 1 else x.float().t()
    pad = (-rows.shape[1]) % block
    # Contiguous: blocks along a strided axis made the compiled kernels 5x slower (measured).
    return F.pad(rows, (0, pad)) if pad else rows.contiguous()


def from_rows(out: torch.Tensor, x: torch.Tensor, axis: int) -> torch.Tensor:
    cols = x.shape[1] if axis == 1 else x.shape[0]
    out = out[:, :cols]
    return (out if axis == 1 else out.t()).to(x.dtype)


# --- kernels: rows is fp32, 2-D, contraction last, whole blocks; the other arguments are Python
# constants (a compiled graph per value, few in practice) --------------------------------------


def _fp8_rowwise_kernel(rows: torch.Tensor, fp8_dtype: torch.dtype) -> torch.Tensor:
    from torchao.float8.float8_utils import amax_to_scale

    scale = amax_to_scale(rows.abs().amax(-1, keepdim=True), fp8_dtype, round_scales_to_power_of_2=True)
    return round_to_grid(rows * scale, _GRIDS[fp8_dtype]) / scale


def _fp8_tensorwise_kernel(rows: torch.Tensor, fp8_dtype: torch.dtype) -> torch.Tensor:
    from torchao.float8.float8_utils import amax_to_scale

    scale = amax_to_scale(rows.abs().amax(), fp8_dtype)
    return round_to_grid(rows * scale, _GRIDS[fp8_dtype]) / scale


# NVFP4's per-tensor scale is at least this (formats.nvfp4_per_tensor_scale; torchao's has no floor): below
# it, a block scale (>= E4M3's smallest normal 2^-6) times the per-tensor scale is subnormal, flushed to
# zero on a GPU (0 / 0 = NaN), and 1 / per-tensor / block scale overflows. Only tensors whose amax is
# below 448 * 6 * 2^-120 (about 2e-33) are affected.
NVFP4_MIN_PER_TENSOR_SCALE = 2.0**-120


def times_pow2_neg(v: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
    """v * 2^-e for integer-valued e in [-127, 127], with every factor a normal float32: 2^-127 (e = 127,
    a block holding inf) is subnormal, flushed to zero where denormals are (Triton kernels,
    torch.set_flush_denormal), and inf * 0 would be NaN. Equal to v * 2^-e where nothing is flushed.
    What a flush still changes, without NaN and as in torchao's own cast: a block whose amax is below
    max_pos * 2^-126 (about 7e-38 for E2M1, 5e-36 for E4M3, 7e-34 for E5M2 gradients) has a subnormal
    amax / max_pos, and its values quantize to zero."""
    return v * torch.where(e == 127.0, 0.5, 1.0) * torch.exp2(-torch.clamp(e, max=126.0))


def _e8m0_scales(blocks: torch.Tensor, max_pos: float):
    """torchao's RCEIL MX scale (``_to_mx_rceil``, cuBLAS's rule) as fp32 values: the multiplier
    applied before rounding and the block scale applied after. Written out because torchao's
    version builds the uint8 E8M0 code and converts it back through ``pow``, which inductor does not
    fuse on a CPU (5-10 ms for a 2048x128 operand); the arithmetic below gives the same values:
    exponent e = clamp(ceil(log2(amax / max_pos)), -127, 127) (NaN stays NaN, inf gives 127);
    block scale 2^e, and e. Rounding multiplies by 2^-e (times_pow2_neg), except by 1.0 at e = -127
    (torchao's zero-exponent rule, _mx_rtn_kernel) or not (the SR kernel, as torchao's SR reference)."""
    descale = blocks.abs().amax(-1, keepdim=True) / max_pos
    e = torch.clamp(torch.ceil(torch.log2(descale)), -127.0, 127.0)
    return torch.exp2(e), e


def _mx_rtn_kernel(rows: torch.Tensor, grid_name: str) -> torch.Tensor:
    grid = GRID_NAMES[grid_name]
    blocks = rows.reshape(rows.shape[0], -1, MX_BLOCK)
    scale, e = _e8m0_scales(blocks, grid[2])
    scaled = torch.clamp(torch.where(e == -127.0, blocks, times_pow2_neg(blocks, e)), -grid[2], grid[2])
    return (round_to_grid(scaled, grid) * scale).reshape(rows.shape)


def _mx_sr_kernel(rows: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
    blocks = rows.reshape(rows.shape[0], -1, MX_BLOCK)
    scale, e = _e8m0_scales(blocks, 6.0)
    # Multiplied by 2^-e (normal factors), not divided by the scale 2^e: an all-zero block has e = -127,
    # and the subnormal 2^-127 is flushed to zero in a Triton kernel (pytorch#125557), where 0 / 0 gave
    # NaN for every all-zero gradient block on a GPU (found by benchmarks/gpu_check.py on an H200).
    return (stochastic_round_e2m1(times_pow2_neg(blocks, e), bits) * scale).reshape(rows.shape)


def _nvfp4_scales(blocks: torch.Tensor):
    """nvfp4_quantize's two-level scale (torchao, per_tensor_scale given): per-tensor fp32 scale and
    the E4M3 block scales as fp32 values."""
    per_tensor = blocks.abs().amax().float() / (448.0 * 6.0)  # per_tensor_amax_to_scale
    # formats.nvfp4_per_tensor_scale: 1 for an all-zero tensor (torchao's 0 gives 0 / 0 = NaN), and at
    # least NVFP4_MIN_PER_TENSOR_SCALE.
    per_tensor = torch.where(per_tensor == 0, torch.ones_like(per_tensor), per_tensor.clamp(min=NVFP4_MIN_PER_TENSOR_SCALE))
    block_scale = blocks.abs().amax(-1, keepdim=True) / 6.0
    eps = torch.finfo(torch.float8_e4m3fn).tiny
    block_fp8 = round_to_grid(torch.clamp(block_scale / per_tensor, min=eps, max=448.0), E4M3)
    return per_tensor, block_fp8


def _nvfp4_rtn_kernel(rows: torch.Tensor) -> torch.Tensor:
    blocks = rows.reshape(rows.shape[0], -1, 16)
    per_tensor, block_fp8 = _nvfp4_scales(blocks)
    scaled = torch.clamp(blocks * ((1.0 / per_tensor) / block_fp8), -6.0, 6.0)
    return (round_to_grid(scaled, E2M1) * (per_tensor * block_fp8)).reshape(rows.shape)


def _nvfp4_sr_kernel(rows: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
    blocks = rows.reshape(rows.shape[0], -1, 16)
    per_tensor, block_fp8 = _nvfp4_scales(blocks)
    scale = block_fp8 * per_tensor
    # As the reference: where the E4M3 block scale rounded down, step it one E4M3 value up.
    too_small = blocks.abs().amax(-1, keepdim=True) > 6.0 * scale
    bumped = round_to_grid(block_fp8 * 1.125, E4M3) * per_tensor
    scale = torch.where(too_small, bumped, scale)
    return (stochastic_round_e2m1(blocks / scale, bits) * scale).reshape(rows.shape)


# --- AdamW's update maps (stats.AdamState: the statistics round's weight divergence) -------------
# Not quantizers, but the same problem: each is a chain of 10-20 elementwise ops over a parameter's
# moments, and eagerly every op is a pass over parameter-sized memory (on an H200 at width 4096 the
# eager chains were most of a round's device time: benchmarks/results/gpu_check_2026-11-30_round_precision.md).
# Compiled, each is one pass. The hyper-parameters come as one fp32 tensor ``h`` (AdamState.
# coefficients: beta1, 1 - beta1, beta2, 1 - beta2, 1 - beta2^t, eps, lr / (1 - beta1^t), for the
# step t whose update is perturbed), not as Python floats, which a compiled graph specializes on: the
# bias corrections change every step, and every round would recompile.


def _adam_sensitivity_kernel(exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, grad: torch.Tensor,
                             h: torch.Tensor) -> torch.Tensor:
    b1, c1, b2, c2, bc2, eps, gain = h[0], h[1], h[2], h[3], h[4], h[5], h[6]
    g = grad.float()
    m1 = b1 * exp_avg.float() + c1 * g
    s1 = ((b2 * exp_avg_sq.float() + c2 * g * g) / bc2).sqrt()
    through_v = torch.where(s1 > 0, m1 * c2 * g / (bc2 * s1.clamp_min(1e-38) * (s1 + eps) ** 2), torch.zeros_like(s1))
    return gain * (c1 / (s1 + eps) - through_v)


def _adam_deviation_kernel(exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, grad: torch.Tensor, delta: torch.Tensor,
                           h: torch.Tensor) -> torch.Tensor:
    b1, c1, b2, c2, bc2, eps, gain = h[0], h[1], h[2], h[3], h[4], h[5], h[6]
    g, d = grad.float(), delta.float()
    m1 = b1 * exp_avg.float() + c1 * g
    v1 = b2 * exp_avg_sq.float() + c2 * g * g
    dv = c2 * d * (2 * g + d)  # v2 - v1
    s1 = (v1 / bc2).sqrt()
    s2 = ((v1 + dv).clamp_min(0) / bc2).sqrt()
    ds = torch.where(s1 + s2 > 0, dv / bc2 / (s1 + s2), torch.zeros_like(dv))
    return gain * (c1 * d / (s2 + eps) - m1 * ds / ((s1 + eps) * (s2 + eps)))


def _adam_update_energy_kernel(exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, grad: torch.Tensor,
                               h: torch.Tensor) -> torch.Tensor:
    b1, c1, b2, c2, bc2, eps, gain = h[0], h[1], h[2], h[3], h[4], h[5], h[6]
    g = grad.float()
    m1 = b1 * exp_avg.float() + c1 * g
    v1 = b2 * exp_avg_sq.float() + c2 * g * g
    return (gain * m1 / ((v1 / bc2).sqrt() + eps)).pow(2).sum()


# --- compilation ------------------------------------------------------------------------------

_KERNELS = {k.__name__: k for k in (_fp8_rowwise_kernel, _fp8_tensorwise_kernel, _mx_rtn_kernel, _mx_sr_kernel,
                                    _nvfp4_rtn_kernel, _nvfp4_sr_kernel, _adam_sensitivity_kernel,
                                    _adam_deviation_kernel, _adam_update_energy_kernel)}
_compiled: dict[tuple[str, str], object] = {}
_broken: set[tuple[str, str]] = set()
_lock = threading.Lock()
compile_seconds: dict[tuple[str, str], float] = {}  # first-call time of each compiled kernel


QUANTIZER_MODES = ("compiled", "eager", "reference")


def _default_stance():
    try:
        from torch._dynamo.eval_frame import _stance  # private; the public API has no getter
        if _stance.stance == "default":
            return contextlib.nullcontext()
    except (ImportError, AttributeError):
        pass
    return torch.compiler.set_stance("default") if hasattr(torch.compiler, "set_stance") else contextlib.nullcontext()


def quantizer_mode() -> str:
    """``LIGHTNING_SNIP_QUANTIZERS``: ``compiled`` (default), ``eager`` (these kernels uncompiled) or
    ``reference`` (formats.reference_fake_quantize, torchao's quantizers composed). All three give
    the same numbers; the benchmark compares their speed."""
    mode = os.environ.get("LIGHTNING_SNIP_QUANTIZERS", "compiled").strip().lower()
    if mode not in QUANTIZER_MODES:
        raise ValueError(f"LIGHTNING_SNIP_QUANTIZERS: unknown mode {mode!r}; valid: {', '.join(QUANTIZER_MODES)}")
    return mode


def run_kernel(name: str, *args):
    """Run kernel ``name`` compiled for the input's device type, or eagerly where compiling failed."""
    kernel = _KERNELS[name]
    device_type = args[0].device.type
    key = (name, device_type)
    if quantizer_mode() == "eager" or key in _broken:
        return kernel(*args)
    fn = _compiled.get(key)
    first = fn is None
    if first:
        with _lock:
            fn = _compiled.setdefault(key, torch.compile(kernel, dynamic=True, fullgraph=True))
    start = time.perf_counter()
    try:
        # The callback's statistics rounds run under set_stance("force_eager") (so a user's compiled
        # model does not recompile); these kernels are ours and stay compiled. (Entering the stance
        # costs ~20-30 us, so only where another stance is active.)
        # Inputs detached (no autograd view base, no requires_grad) and grad mode off: dynamo guards
        # on both, and forward/backward calls otherwise recompiled the same kernel several times.
        inputs = [a.detach() if isinstance(a, torch.Tensor) else a for a in args]
        with _default_stance(), torch.no_grad():
            try:
                out = fn(*inputs)
            except Exception as err:  # noqa: BLE001
                if type(err).__name__ != "FailOnRecompileLimitHit":
                    raise
                # A new variant (a size-1 dimension, another element grid) past dynamo's global
                # recompile_limit: compile it anyway, under a limit that applies to this call only.
                with torch._dynamo.config.patch(recompile_limit=64):
                    out = fn(*inputs)
    except Exception as err:  # noqa: BLE001 - any compiler failure falls back to the same eager code
        _broken.add(key)
        logger.warning("lightning_snip: kernel %s could not be compiled on %s (%s: %s); running it eagerly "
                       "(same numerics, slower)", name, device_type, type(err).__name__, str(err).splitlines()[0][:200])
        return kernel(*args)
    if first:
        compile_seconds[key] = time.perf_counter() - start
        logger.info("lightning_snip: compiled kernel %s for %s in %.1f s", name, device_type, compile_seconds[key])
    return out
