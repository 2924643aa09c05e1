"""Fused emulation quantizers: the numerics of quantize.reference_fake_quantize in one compiled pass.

Why this module exists: the reference path composes torchao's quantizers, which were written for
GPU kernels. On a CPU, torchao's eager FP4 cast packs and unpacks E2M1 codes with a dozen bitwise
passes, and inductor does not vectorize float8 casts, so compiling torchao's functions gave no
speed-up. What is written here by hand is only the final rounding onto a float grid
(lightning_snip.grid), which inductor fuses with the scale computation into one vectorized loop. The
scales are torchao's: ``amax_to_scale`` (FP8) is called as it is; the MX (RCEIL) and NVFP4
(two-level) scale rules are restated in a few lines each (see _e8m0_scales and nvfp4_scales for why).
tests/test_kernels.py checks every format, both roundings and both axes bit for bit against the
reference, on random and edge inputs (zeros, subnormals, block maxima, inf, NaN).

Every kernel takes ``rows``: fp32, 2-D, contraction axis last, whole blocks (quantize.to_rows); the
public functions below are its typed entry points. Stochastic rounding takes random bits drawn
eagerly by the caller (grid.random_bits, as the reference draws them), so both paths agree for the
same generator state; the bits become uniforms inside the compiled kernel.

Compilation (``run_compiled``, also used by lightning_snip.adamw): one graph per kernel family,
shapes dynamic (``dynamic=True``), compiled on first use and reused for every layer and step. Where
torch.compile is unavailable or fails (no C++ compiler, an unsupported device), the same functions
run eagerly, with the same numerics, and the reason is logged once. ``LIGHTNING_SNIP_QUANTIZERS=eager``
turns compilation off, ``=reference`` uses the torchao composition (quantizer_mode). SNIP's own work (own_work) runs
a kernel not compiled yet eagerly until its eager calls have cost what compiling it is expected to (see
DEFERRED_DEVICES).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable

import torch

from lightning_snip.grid import (E2M1, E4M3, E5M2, FP8_GRIDS, MX_BLOCK, NVFP4_BLOCK, nvfp4_scale_floor, round_to_grid,
                                 stochastic_round_e2m1, times_pow2_neg)

logger = logging.getLogger(__name__)

# Kernels take grids by name: under dynamic=True an int argument would become symbolic.
GRID_NAMES = {"e4m3": E4M3, "e5m2": E5M2, "e2m1": E2M1}
QUANTIZER_MODES = ("compiled", "eager", "reference")


def quantizer_mode() -> str:
    """``LIGHTNING_SNIP_QUANTIZERS``: ``compiled`` (default), ``eager`` (these kernels uncompiled) or
    ``reference`` (quantize.reference_fake_quantize, torchao's quantizers composed). All three give
    the same numbers; the benchmark compares their speed."""
    mode = os.environ.get("LIGHTNING_SNIP_QUANTIZERS", "compiled").strip().lower()
    if mode not in QUANTIZER_MODES:
        raise ValueError(f"LIGHTNING_SNIP_QUANTIZERS: unknown mode {mode!r}; valid: {', '.join(QUANTIZER_MODES)}")
    return mode


# --- the typed entry points ----------------------------------------------------------------------


def fp8_rowwise(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """FP8 with one power-of-two scale per row (torchao's ROWWISE recipe), dequantized."""
    return run_compiled(_fp8_rowwise_kernel, rows, dtype)


def fp8_tensorwise(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """FP8 with one amax scale for the tensor (torchao's TENSORWISE recipe), dequantized."""
    return run_compiled(_fp8_tensorwise_kernel, rows, dtype)


def mx_nearest(rows: torch.Tensor, grid_name: str) -> torch.Tensor:
    """MX (E8M0 scale per 32, RCEIL) rounded to nearest on ``grid_name`` (e2m1, e4m3, e5m2), dequantized."""
    return run_compiled(_mx_rtn_kernel, rows, grid_name)


def mx_stochastic(rows: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
    """MXFP4 with stochastically rounded elements (``bits``: grid.random_bits), dequantized."""
    return run_compiled(_mx_sr_kernel, rows, bits)


def nvfp4_nearest(rows: torch.Tensor) -> torch.Tensor:
    """NVFP4 (E4M3 scale per 16 and a per-tensor scale) rounded to nearest, dequantized."""
    return run_compiled(_nvfp4_rtn_kernel, rows)


def nvfp4_nearest_2d(tiles: torch.Tensor) -> torch.Tensor:
    """NVFP4 with one E4M3 scale per 16x16 tile (``tiles``: fp32, (rows / 16, 16, cols / 16, 16)) and the per-tensor
    scale, rounded to nearest, dequantized (quantize.nvfp4_2d_fake_quantize)."""
    return run_compiled(_nvfp4_rtn_2d_kernel, tiles)


def nvfp4_stochastic(rows: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
    """NVFP4 with stochastically rounded elements (``bits``: grid.random_bits), dequantized."""
    return run_compiled(_nvfp4_sr_kernel, rows, bits)


# --- the kernels (the other arguments are Python constants: a compiled graph per value, few) -------


def _fp8_rowwise_kernel(rows: torch.Tensor, fp8_dtype: torch.dtype) -> torch.Tensor:
    from torchao.float8.float8_utils import amax_to_scale

    scale = amax_to_scale(rows.abs().amax(-1, keepdim=True), fp8_dtype, round_scales_to_power_of_2=True)
    return round_to_grid(rows * scale, FP8_GRIDS[fp8_dtype]) / scale


def _fp8_tensorwise_kernel(rows: torch.Tensor, fp8_dtype: torch.dtype) -> torch.Tensor:
    from torchao.float8.float8_utils import amax_to_scale

    scale = amax_to_scale(rows.abs().amax(), fp8_dtype)
    return round_to_grid(rows * scale, FP8_GRIDS[fp8_dtype]) / scale


def _e8m0_scales(blocks: torch.Tensor, max_pos: float):
    """torchao's RCEIL MX scale (``_to_mx_rceil``, cuBLAS's rule) as fp32 values: the multiplier
    applied before rounding and the block scale applied after. Written out because torchao's
    version builds the uint8 E8M0 code and converts it back through ``pow``, which inductor does not
    fuse on a CPU; the arithmetic below gives the same values:
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


def nvfp4_scales(blocks: torch.Tensor, block_dims: tuple[int, ...] = (-1,)):
    """nvfp4_quantize's two-level scale (torchao, per_tensor_scale given): per-tensor fp32 scale and
    the E4M3 block scales as fp32 values, a block spanning ``block_dims`` (a 16x16 tile: two of them)."""
    per_tensor = nvfp4_scale_floor(blocks.abs().amax().float() / (448.0 * 6.0))  # per_tensor_amax_to_scale
    block_scale = blocks.abs().amax(block_dims, keepdim=True) / 6.0
    eps = torch.finfo(torch.float8_e4m3fn).tiny
    block_fp8 = round_to_grid(torch.clamp(block_scale / per_tensor, min=eps, max=448.0), E4M3)
    return per_tensor, block_fp8


def nvfp4_nearest_parts(blocks: torch.Tensor, block_dims: tuple[int, ...] = (-1,)):
    """NVFP4 of ``blocks`` rounded to nearest as parts: (E2M1 values, the per-tensor scale, the E4M3 block scales as
    fp32 values), a block spanning ``block_dims``; element = value x per-tensor scale x block scale."""
    per_tensor, block_fp8 = nvfp4_scales(blocks, block_dims)
    scaled = torch.clamp(blocks * ((1.0 / per_tensor) / block_fp8), -6.0, 6.0)
    return round_to_grid(scaled, E2M1), per_tensor, block_fp8


def _nvfp4_round_nearest(blocks: torch.Tensor, block_dims: tuple[int, ...] = (-1,)) -> torch.Tensor:
    """NVFP4 of ``blocks`` rounded to nearest, dequantized, a block spanning ``block_dims``."""
    codes, per_tensor, block_fp8 = nvfp4_nearest_parts(blocks, block_dims)
    return codes * (per_tensor * block_fp8)


def _nvfp4_rtn_kernel(rows: torch.Tensor) -> torch.Tensor:
    return _nvfp4_round_nearest(rows.reshape(rows.shape[0], -1, NVFP4_BLOCK)).reshape(rows.shape)


def _nvfp4_rtn_2d_kernel(tiles: torch.Tensor) -> torch.Tensor:
    return _nvfp4_round_nearest(tiles, (1, 3))


def _nvfp4_sr_kernel(rows: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
    blocks = rows.reshape(rows.shape[0], -1, NVFP4_BLOCK)
    per_tensor, block_fp8 = nvfp4_scales(blocks)
    scale = block_fp8 * per_tensor
    # As the reference: where the E4M3 block scale rounded down, step it one E4M3 value up.
    too_small = blocks.abs().amax(-1, keepdim=True) > 6.0 * scale
    bumped = round_to_grid(block_fp8 * 1.125, E4M3) * per_tensor
    scale = torch.where(too_small, bumped, scale)
    return (stochastic_round_e2m1(blocks / scale, bits) * scale).reshape(rows.shape)


# --- compilation ---------------------------------------------------------------------------------

_compiled: dict[tuple[str, str], object] = {}
_broken: set[tuple[str, str]] = set()
_lock = threading.Lock()
compile_seconds: dict[tuple[str, str], float] = {}  # (kernel name, device type) -> first-call time

# SNIP's own work (a statistics round, the canary, the first-order sample: own_work()) calls a kernel a few times a
# round, where training calls it every step. In a compiled model training's quantizers are traced into its graph, so
# a round was the only caller of these kernels, and it paid their first compile, ~3-11 s each on a CPU, more than
# the work (benchmarks/results/overhead_2026-12-06.md: ~20 s of a 350-step run). There a kernel nothing compiled yet
# runs eagerly (the same numerics, tests/test_kernels.py) until its eager calls have cost what a compile is expected
# to (the rent-or-buy rule: never more than twice the better choice in hindsight), then compiles. Training's calls
# compile at first use, as before. On a CPU only: elsewhere the host times an eager call's launches, not its work.
DEFERRED_DEVICES = ("cpu",)
COMPILE_PRICE_SECONDS = 3.0  # before any compile in this process: a CPU kernel's typical first call (2.5-3.5 s)
_eager_seconds: dict[tuple[str, str], float] = {}  # (kernel name, device type) -> SNIP's eager seconds so far
_own = threading.local()


@contextlib.contextmanager
def own_work():
    """SNIP's own work (not training's) runs inside: a kernel not compiled yet is rented eagerly (see above)."""
    depth = getattr(_own, "depth", 0)
    _own.depth = depth + 1
    try:
        yield
    finally:
        _own.depth = depth


def compile_price() -> float:
    """What compiling a kernel is expected to cost: the mean first call of those compiled in this process, or
    COMPILE_PRICE_SECONDS before any."""
    measured = [s for (_, device), s in compile_seconds.items() if device in DEFERRED_DEVICES]
    return sum(measured) / len(measured) if measured else COMPILE_PRICE_SECONDS


def _detached(args) -> list:
    """The kernel's arguments, each tensor detached (no autograd view base, no requires_grad)."""
    return [a.detach() if isinstance(a, torch.Tensor) else a for a in args]


def _rented(key: tuple[str, str], kernel: Callable, args) -> torch.Tensor | None:
    """``kernel(*args)`` run eagerly and its seconds counted, where SNIP's own work calls a kernel not compiled yet
    whose eager calls have not yet cost a compile; else None (compile it)."""
    if key in _compiled or getattr(_own, "depth", 0) == 0 or key[1] not in DEFERRED_DEVICES:
        return None
    if _eager_seconds.get(key, 0.0) >= compile_price():
        return None
    start = time.perf_counter()
    with torch.no_grad():
        out = kernel(*_detached(args))
    _eager_seconds[key] = _eager_seconds.get(key, 0.0) + time.perf_counter() - start
    return out


def _default_stance():
    try:
        from torch._dynamo.eval_frame import _stance  # private; the public API has no getter
        if _stance.stance == "default":
            return contextlib.nullcontext()
    except (ImportError, AttributeError):
        pass
    return torch.compiler.set_stance("default") if hasattr(torch.compiler, "set_stance") else contextlib.nullcontext()


def run_compiled(kernel: Callable, *args):
    """Run ``kernel`` compiled for the first input's device type, or eagerly where compiling failed
    (or under LIGHTNING_SNIP_QUANTIZERS=eager)."""
    if torch.compiler.is_compiling():
        # Traced into a user's compiled graph (a SNIPLinear in a compiled model): the kernel's ops
        # become part of that graph, which inductor fuses with their neighbours.
        return kernel(*args)
    name = kernel.__name__
    device_type = args[0].device.type
    key = (name, device_type)
    if quantizer_mode() == "eager" or key in _broken:
        return kernel(*args)
    if (out := _rented(key, kernel, args)) is not None:
        return out
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
        inputs = _detached(args)
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
                       "(same numerics, slower)", name, device_type, type(err).__name__, (str(err).splitlines() or [""])[0][:200])
        return kernel(*args)
    if first:
        compile_seconds[key] = time.perf_counter() - start
        logger.info("lightning_snip: compiled kernel %s for %s in %.1f s", name, device_type, compile_seconds[key])
    return out
