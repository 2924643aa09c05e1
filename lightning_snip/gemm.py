"""The GEMM backends: Q(a) @ Q(b)^T in every format, emulated or on torchao's native kernels.

Every GEMM is ``quantized_matmul(a, b)`` = a @ b^T with the contraction along dim 1 of both. Which
kernel runs is a function of the format and the device (kernel_for): torchao.float8's training
tensors for FP8 on GPUs with FP8 tensor cores, torchao's MX / NVFP4 tensors for block formats on
compute capability 10.x, and everywhere else the emulation (lightning_snip.quantize, then a
high-precision matmul). The training layer (lightning_snip.linear) and the statistics round
(lightning_snip.divergence) both multiply through here.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Iterable

import torch

from lightning_snip.formats import Format, Fp8Scaling, QuantRecipe, Rounding
from lightning_snip.grid import fp8_dtype
from lightning_snip.hadamard import hadamard_rows, rht_matrix
from lightning_snip.quantize import (fake_quantize, mxfp4_stochastic_parts, nvfp4_2d_parts, nvfp4_per_tensor_scale,
                                     nvfp4_stochastic_parts)

logger = logging.getLogger(__name__)


class Kernel(enum.Enum):
    """How a format's GEMMs run on a device."""

    EMULATED = "emulated"  # fused fake quantization (lightning_snip.quantize), then a high-precision matmul
    TORCHAO_FP8 = "native torchao kernel"  # torchao.float8's training tensors: its scales, torch._scaled_mm
    # torchao.prototype.mx_formats' MXTensor / NVFP4Tensor: cuBLAS / CUTLASS block-scaled GEMMs
    TORCHAO_BLOCK = "native torchao block-scaled kernel"


def kernel_for(fmt: Format, device: torch.device) -> Kernel:
    """The kernel a format's GEMMs use on ``device``.

    FP8: torchao.float8's training path (torch._scaled_mm) on CUDA GPUs with FP8 tensor cores
    (compute capability 8.9 and up: Ada, Hopper, Blackwell). MXFP8, MXFP4, NVFP4: torchao's
    block-scaled GEMMs (torchao_block_mm) on compute capability 10.x (B200/GB200/B300, the GPUs
    torchao's MX and NVFP4 GEMMs are built for); emulated elsewhere. A GEMM whose shapes or operand
    types the native kernel does not take is emulated (quantized_matmul).
    """
    device = torch.device(device)
    if fmt is not Format.BF16 and device.type == "cuda" and torch.cuda.is_available():
        capability = torch.cuda.get_device_capability(device)
        if fmt is Format.FP8 and capability >= (8, 9):
            return Kernel.TORCHAO_FP8
        if fmt in _BLOCK_FORMATS and capability[0] == 10:
            return Kernel.TORCHAO_BLOCK
    return Kernel.EMULATED


_BLOCK_FORMATS = (Format.MXFP8, Format.MXFP4, Format.NVFP4)


def describe_kernels(formats: Iterable[Format], device: torch.device) -> str:
    """One line for the setup log, e.g. "fp8: native torchao kernel; mxfp4: emulated (cuda:0); a GEMM
    runs natively when ..." (the shape rules, named whenever a format has a native kernel)."""
    kernels = {f: kernel_for(f, device) for f in formats if f is not Format.BF16}
    line = "; ".join(f"{f.value}: {k.value}" for f, k in kernels.items()) + f" ({torch.device(device)})"
    if any(k is not Kernel.EMULATED for k in kernels.values()):
        # quantized_matmul's per-GEMM rules: say so once, or a run whose GEMMs all fall back reads as native
        line += ("; a GEMM runs natively when its dimensions are multiples of 16 (fp8) / 32 (block-scaled, "
                 "bf16/fp32 operands, E4M3 MXFP8 gradients), otherwise emulated")
    return line


def warn_if_fp4_emulated(formats: Iterable[Format], device: torch.device) -> None:
    """One warning line where a CUDA ``device`` emulates an FP4 format among ``formats`` (no native FP4 GEMM:
    torchao's need compute capability 10.x): there a plan with FP4 trains slower than bf16, which the kernel
    line's INFO does not make plain. Nothing on a CPU, where every format is emulated by design."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return
    emulated = [f.value for f in formats if f.is_fp4 and kernel_for(f, device) is Kernel.EMULATED]
    if emulated:
        major, minor = torch.cuda.get_device_capability(device)
        logger.warning("SNIP: %s (compute capability %d.%d) has no native FP4 GEMM (torchao's need 10.x): %s run "
                       "emulated and train slower than bf16; for speed set candidate_formats=[fp8], fp4_fraction=0 "
                       "(the app: snip.candidate_formats=[fp8] snip.fp4_fraction=0)", device, major, minor,
                       ", ".join(emulated))


def emulated_layers(formats: Iterable[Format], device: torch.device, layers) -> dict[Format, list[str]]:
    """Per format with a native kernel on ``device``: the layers (``layers``: fqn -> SNIPLinear) that can
    take the format (allowed by their shape, not pinned to another) but whose weight dimensions the
    native GEMM does not take (multiples of 16 for FP8, 32 for block formats), so that their GEMMs in it
    are emulated. Token counts, operand dtypes and E5M2 MXFP8 gradients are checked per GEMM."""
    out: dict[Format, list[str]] = {}
    for fmt in formats:
        if fmt is Format.BF16 or kernel_for(fmt, device) is Kernel.EMULATED:
            continue
        multiple = 16 if fmt is Format.FP8 else 32
        able = {fqn: layer for fqn, layer in layers.items()
                if fmt in layer.allowed_formats and layer.pinned in (None, fmt)}
        out[fmt] = [fqn for fqn, layer in able.items() if layer.in_features % multiple or layer.out_features % multiple]
    return out


_MM_OUT_DTYPE_WORKS: dict[str, bool] = {}


def mm_fp32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b^T accumulated and returned in fp32, the operands in their own dtype.

    bf16/fp16 operands on a CUDA device run torch.mm's ``out_dtype=float32`` form: tensor-core
    GEMMs whose products are exact and whose sums are fp32, the arithmetic of an fp32 GEMM on the
    same (bf16-valued) operands, at bf16 speed (on an H200 an fp32 GEMM is about 15x slower). Where
    that form is missing (CPU builds have no aten::mm.dtype kernel) or for fp32 operands, both are
    upcast and multiplied in fp32: the same products and sums."""
    if a.dtype == b.dtype and a.dtype in (torch.bfloat16, torch.float16) and a.device.type == "cuda":
        if _MM_OUT_DTYPE_WORKS.get(a.device.type, True):
            try:
                return torch.mm(a, b.t(), out_dtype=torch.float32)
            # Only "this torch has no such form" (an unknown keyword, a missing kernel); any other error
            # (out of memory) propagates. Said once: the round is then correct but runs fp32 GEMMs.
            except (TypeError, NotImplementedError) as err:
                _MM_OUT_DTYPE_WORKS[a.device.type] = False
                logger.warning("lightning_snip: torch.mm(out_dtype=float32) is unavailable on %s (%s); statistics "
                               "rounds multiply bf16 operands upcast to fp32 (same numbers, slower GEMMs)",
                               a.device.type, (str(err).splitlines() or [""])[0][:200])
    return a.float() @ b.float().t()


def bmm_fp32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """mm_fp32 batched: a[i] @ b[i]^T for stacks (L, m, k) and (L, n, k), accumulated and returned in fp32
    (torch.bmm; on a CPU each slice's result is bit for bit mm_fp32's, tests/test_gemm.py). bf16/fp16
    operands on a CUDA device run torch.bmm's ``out_dtype=float32`` form where it exists, as mm_fp32."""
    if a.dtype == b.dtype and a.dtype in (torch.bfloat16, torch.float16) and a.device.type == "cuda":
        if _MM_OUT_DTYPE_WORKS.get("cuda-bmm", True):
            try:
                return torch.bmm(a, b.transpose(1, 2), out_dtype=torch.float32)
            except (TypeError, NotImplementedError) as err:  # no such form in this build (as mm_fp32)
                _MM_OUT_DTYPE_WORKS["cuda-bmm"] = False
                logger.warning("lightning_snip: torch.bmm(out_dtype=float32) is unavailable on %s (%s); statistics "
                               "rounds multiply stacked bf16 operands upcast to fp32 (same numbers, slower GEMMs)",
                               a.device.type, (str(err).splitlines() or [""])[0][:200])
    return torch.bmm(a.float(), b.float().transpose(1, 2))


def quantized_matmul(
    a: torch.Tensor,
    b: torch.Tensor,
    fmt: Format,
    *,
    recipe: QuantRecipe,
    a_is_grad: bool = False,
    b_is_grad: bool = False,
    b_is_weight: bool = False,
    hadamard: tuple[int, ...] | torch.Tensor | None = None,
    generator: torch.Generator | None = None,
    kernel: Kernel | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Return Q(a) @ Q(b)^T, both operands quantized along dim 1 (the contraction axis).

    ``b_is_weight``: b is the layer's weight (the forward's W, the dgrad's W^T): NVFP4 quantizes it with 16x16 tile
    scales where the recipe says (QuantRecipe.nvfp4_weight_scales_2d). ``hadamard``: this is the wgrad GEMM of a
    layer with this RHT sign vector (lightning_snip.hadamard): for a format in QuantRecipe.wgrad_hadamard both
    operands are transformed along dim 1 first (the product is unchanged before quantization).
    ``generator``: the random source of stochastic rounding (the global one when None).
    ``kernel``: None chooses by device (kernel_for); tests force TORCHAO_FP8 on a CPU, where
    torch._scaled_mm exists too. ``out_dtype``: None returns a's dtype (training's GEMMs);
    torch.float32 returns the fp32 accumulation itself (mm_fp32: the statistics round measures the
    quantization error, not the output's bf16 rounding; native kernels' outputs are upcast)."""
    if out_dtype not in (None, torch.float32):
        raise ValueError(f"out_dtype: invalid value {out_dtype!r}; allowed: None or torch.float32")
    if fmt is Format.BF16:
        return mm_fp32(a, b) if out_dtype is not None else a @ b.t()
    if hadamard is not None and recipe.uses_hadamard(fmt):
        matrix = rht_matrix(hadamard, str(a.device))
        a, b = hadamard_rows(a, matrix), hadamard_rows(b, matrix)
    scales_2d = b_is_weight and recipe.weight_scales_2d(fmt)
    kernel = kernel_for(fmt, a.device) if kernel is None else kernel
    # torch._scaled_mm needs every dimension a multiple of 16; other shapes are emulated.
    if kernel is Kernel.TORCHAO_FP8 and a.shape[1] % 16 == 0 and a.shape[0] % 16 == 0 and b.shape[0] % 16 == 0:
        if out_dtype is not None:  # torchao returns its operands' dtype: fp32 operands (the same FP8 casts,
            a, b = a.float(), b.float()  # scales from the same amax) give the fp32 output of torch._scaled_mm
        return torchao_fp8_mm(a, b, recipe, a_is_grad, b_is_grad)
    if kernel is Kernel.TORCHAO_BLOCK and block_native_supported(a, b, fmt, recipe, a_is_grad, b_is_grad):
        out = torchao_block_mm(a, b, fmt, recipe, a_is_grad, b_is_grad, generator, b_scales_2d=scales_2d)
        return out if out_dtype is None else out.to(out_dtype)
    qa = fake_quantize(a, fmt, axis=1, rounding=operand_rounding(fmt, recipe, a_is_grad), recipe=recipe, is_grad=a_is_grad,
                       generator=generator)
    qb = fake_quantize(b, fmt, axis=1, rounding=operand_rounding(fmt, recipe, b_is_grad), recipe=recipe, is_grad=b_is_grad,
                       generator=generator, scales_2d=scales_2d)
    return mm_fp32(qa, qb) if out_dtype is not None else qa @ qb.t()


def opaque_quantized_matmul(a: torch.Tensor, b: torch.Tensor, fmt: Format, *, recipe: QuantRecipe,
                            a_is_grad: bool = False, b_is_grad: bool = False,
                            hadamard: tuple[int, ...] | torch.Tensor | None = None,
                            generator: torch.Tensor | None = None) -> torch.Tensor:
    """quantized_matmul as one custom operator, opaque to torch.compile: the same kernels and numbers,
    for a GEMM whose shapes inductor mishandles when traced (SNIPLinear's block-format wgrad).
    ``generator``: an RNG token (lightning_snip.rng), which the operator mutates (its draws stay in order)."""
    from lightning_snip.rng import token_for

    token = token_for(None) if generator is None else generator
    if hadamard is not None and not isinstance(hadamard, torch.Tensor):
        hadamard = torch.tensor(hadamard, dtype=torch.int8)
    return _opaque_quantized_matmul(a, b, fmt.value, recipe.key, a_is_grad, b_is_grad, hadamard, token)


@torch.library.custom_op("lightning_snip::quantized_matmul", mutates_args=("token",))
def _opaque_quantized_matmul(a: torch.Tensor, b: torch.Tensor, fmt: str, recipe: str, a_is_grad: bool,
                             b_is_grad: bool, hadamard: torch.Tensor | None, token: torch.Tensor) -> torch.Tensor:
    return quantized_matmul(a, b, Format(fmt), recipe=QuantRecipe.from_key(recipe), a_is_grad=a_is_grad,
                            b_is_grad=b_is_grad, hadamard=hadamard, generator=token)


@_opaque_quantized_matmul.register_fake
def _opaque_quantized_matmul_fake(a, b, fmt, recipe, a_is_grad, b_is_grad, hadamard, token):
    return a.new_empty((a.shape[0], b.shape[0]))


def operand_rounding(fmt: Format, recipe: QuantRecipe, is_grad: bool) -> Rounding:
    """Gradient operands of FP4 GEMMs round as the recipe says (stochastic by default); all others to nearest."""
    return recipe.fp4_grad_rounding if (is_grad and fmt.is_fp4) else Rounding.NEAREST


def torchao_fp8_mm(a, b, recipe: QuantRecipe, a_is_grad: bool, b_is_grad: bool, *, emulate: bool = False) -> torch.Tensor:
    """Q(a) @ Q(b)^T through torchao.float8's training tensors, as Float8Linear's GEMMs run: its
    dynamic scales (rowwise: per row of each operand along the contraction axis, rounded down to a
    power of two; tensorwise: one amax scale), its saturated casts and its torch.mm dispatch to
    torch._scaled_mm (``emulate=True``: its fp32 emulation instead). The output has a's dtype."""
    from torchao.float8.config import ScalingGranularity
    from torchao.float8.float8_scaling_utils import hp_tensor_to_float8_dynamic
    from torchao.float8.float8_training_tensor import GemmInputRole, LinearMMConfig, ScaledMMConfig


    mm_config = ScaledMMConfig(emulate=emulate, use_fast_accum=False, fp8_output=False, pad_inner_dim=False)
    linear_mm_config = LinearMMConfig(mm_config, mm_config, mm_config)
    rowwise = recipe.fp8_scaling is Fp8Scaling.ROWWISE
    granularity = ScalingGranularity.AXISWISE if rowwise else ScalingGranularity.TENSORWISE

    def cast(t, is_grad, role, axiswise_dim):
        dtype = fp8_dtype(recipe.fp8_grad_dtype) if is_grad else torch.float8_e4m3fn
        return hp_tensor_to_float8_dynamic(t, dtype, linear_mm_config, gemm_input_role=role,
                                           scaling_granularity=granularity,
                                           axiswise_dim=axiswise_dim if rowwise else None,
                                           round_scales_to_power_of_2=rowwise)

    qa = cast(a.contiguous(), a_is_grad, GemmInputRole.INPUT, -1)
    # b^T (k x n) is scaled along its dim 0, the contraction axis, as torchao scales a weight.
    qb_t = cast(b.t(), b_is_grad, GemmInputRole.WEIGHT, 0)
    return torch.mm(qa, qb_t)


def block_native_supported(a: torch.Tensor, b: torch.Tensor, fmt: Format, recipe: QuantRecipe, a_is_grad: bool,
                           b_is_grad: bool) -> bool:
    """Whether torchao's block-scaled GEMM takes this GEMM: every dimension a multiple of 32 (the MX
    block; the cuBLAS/CUTLASS tile constraints and FP4's two-per-byte packing), bf16 or fp32
    operands, and for MXFP8 E4M3 elements (torchao's MX GEMM has no E5M2 gradient operands)."""
    if fmt not in _BLOCK_FORMATS or a.dim() != 2 or b.dim() != 2:
        return False
    if any(d % 32 for d in (a.shape[0], a.shape[1], b.shape[0])):
        return False
    if a.dtype not in (torch.float32, torch.bfloat16) or b.dtype not in (torch.float32, torch.bfloat16):
        return False
    e5m2_grads = fmt is Format.MXFP8 and fp8_dtype(recipe.fp8_grad_dtype) is torch.float8_e5m2
    return not (e5m2_grads and (a_is_grad or b_is_grad))


def torchao_block_mm(a: torch.Tensor, b: torch.Tensor, fmt: Format, recipe: QuantRecipe, a_is_grad: bool,
                     b_is_grad: bool, generator: torch.Generator | None = None, *, emulate: bool = False,
                     b_scales_2d: bool = False) -> torch.Tensor:
    """Q(a) @ Q(b)^T through torchao.prototype.mx_formats' tensors: MXTensor (mxfp8, mxfp4) or
    NVFP4Tensor, whose torch.mm dispatch runs torch._scaled_mm / F.scaled_mm with block scales
    (cuBLAS / CUTLASS on compute capability 10.x). ``emulate=True`` takes torchao's emulated GEMM
    instead (dequantize, then a high-precision matmul): the same operands on any device, which is
    how the CPU tests check them. Both operands are quantized along dim 1; the output has a's dtype.

    Round-to-nearest operands are cast by torchao itself (RCEIL MX scales; NVFP4's per-tensor and
    E4M3 block scales): what the emulation restates, bit for bit. torchao's casts round to nearest
    only, so stochastically rounded FP4 gradient operands are built here from the emulation's own
    parts, the rounded E2M1 codes and the scales they were rounded with
    (quantize.mxfp4_stochastic_parts / nvfp4_stochastic_parts, drawing the same random bits), packed
    into torchao's tensors. Operands are drawn a first, then b, as the emulation draws them. ``b_scales_2d``: b is
    an NVFP4 weight under the recipe's 16x16 tile scales (quantize.nvfp4_2d_parts: each tile's scale in its rows'
    1x16 blocks, which torchao's 1x16 block-scaled GEMM takes as they are); written here because torchao's own 2D
    quantizer (nvfp4_training.quantize_2d_triton) is a Triton kernel (CUDA only) of NVFP4Linear's whole-layer path,
    which takes only layers whose three GEMMs are all NVFP4, bf16, with every dimension a multiple of 128.

    Numerics of the native kernels (not run here: no such GPU): torchao's MX GEMM returns bf16 (cast
    to a's dtype after), so an fp32 run gets bf16-rounded MX GEMM outputs; NVFP4 operands are wrapped
    as fp32 on the native path, so that torchao applies the product of the two per-tensor scales in
    fp32 rather than rounded to bf16 (a whole-output bias of up to 2^-8 otherwise).
    """
    from torchao.prototype.mx_formats.config import ScaleCalculationMode
    from torchao.prototype.mx_formats.kernels import f32_to_f4_unpacked, pack_uint4
    from torchao.prototype.mx_formats.mx_tensor import MXTensor
    from torchao.prototype.mx_formats.nvfp4_tensor import NVFP4Tensor, QuantizeTensorToNVFP4Kwargs
    from torchao.quantization.quantize_.common.kernel_preference import KernelPreference


    preference = KernelPreference.EMULATED if emulate else KernelPreference.AUTO

    def cast(t: torch.Tensor, is_grad: bool, scales_2d: bool = False):
        t = t.contiguous()
        stochastic = operand_rounding(fmt, recipe, is_grad) is Rounding.STOCHASTIC
        if fmt is Format.NVFP4:
            t32 = t.float()
            # act_quant_kwargs=None makes NVFP4Tensor's mm dequantize (torchao's emulation); set, it
            # runs torch._scaled_mm. Both operands are pre-quantized, so its fields are unused.
            kwargs = None if emulate else QuantizeTensorToNVFP4Kwargs()
            orig_dtype = t.dtype if emulate else torch.float32
            if scales_2d:
                codes, scales, per_tensor_scale = nvfp4_2d_parts(t32)
                qdata = pack_uint4(f32_to_f4_unpacked(codes))
            elif stochastic:
                codes, scales, per_tensor_scale = nvfp4_stochastic_parts(t32, generator)
                qdata = pack_uint4(f32_to_f4_unpacked(codes))
            else:
                per_tensor_scale = nvfp4_per_tensor_scale(t32)
                out = NVFP4Tensor.to_nvfp4(t32, per_tensor_scale=per_tensor_scale)
                qdata, scales = out.qdata, out.scale
            return NVFP4Tensor(qdata, scales, 16, orig_dtype, per_tensor_scale=per_tensor_scale,
                               act_quant_kwargs=kwargs)
        if stochastic:  # MXFP4 gradient operand
            codes, scales = mxfp4_stochastic_parts(t.float(), generator)
            qdata = pack_uint4(f32_to_f4_unpacked(codes))
            return MXTensor(qdata, scales.view(torch.float8_e8m0fnu), torch.float4_e2m1fn_x2, 32, t.dtype,
                            preference, None, False)
        elem = torch.float4_e2m1fn_x2 if fmt is Format.MXFP4 else torch.float8_e4m3fn
        return MXTensor.to_mx(t, elem, 32, scaling_mode=ScaleCalculationMode.RCEIL, kernel_preference=preference)

    qa = cast(a, a_is_grad)
    qb = cast(b, b_is_grad, scales_2d=b_scales_2d and fmt is Format.NVFP4)
    return torch.mm(qa, qb.t()).to(a.dtype)


def _cuda_seconds(fn, repeats: int) -> float:
    """Median seconds of ``fn()`` on the current CUDA stream (after one warm-up call)."""
    import statistics

    fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def choose_fp8_scaling(device: torch.device | str, shapes: Iterable[tuple[int, int]], *, rows: int = 4096,
                       repeats: int = 10, timer=None) -> tuple[Fp8Scaling, dict[Fp8Scaling, float]]:
    """SNIPConfig(fp8_scaling="auto"): the FP8 scaling whose GEMMs run faster on ``device``, and the
    seconds each took ({} where none was timed).

    Where FP8 is emulated (kernel_for: no FP8 tensor cores) the emulation costs the same either way:
    rowwise, the finer scales. Where FP8 runs natively, the three GEMMs of a layer (forward, dgrad,
    wgrad: casts included, eager, bf16 operands, ``rows`` tokens) are timed for each distinct
    (out_features, in_features) of ``shapes`` (repeats counted: the model's layers), and the scaling
    with the smaller total wins: on an H200 tensorwise ran at 0.93x bf16 and rowwise at 1.14x
    (benchmarks/results, gpu_check 2026-11-30); Blackwell's may rank them otherwise. ``timer(fn,
    repeats)`` -> seconds replaces the CUDA-event timer (tests)."""
    device = torch.device(device)
    if kernel_for(Format.FP8, device) is Kernel.EMULATED:
        return Fp8Scaling.ROWWISE, {}
    timer = timer or _cuda_seconds
    counts: dict[tuple[int, int], int] = {}
    for shape in shapes:
        if shape[0] % 16 == 0 and shape[1] % 16 == 0:  # what the native kernel takes (quantized_matmul)
            counts[shape] = counts.get(shape, 0) + 1
    if not counts:
        return Fp8Scaling.ROWWISE, {}
    generator = torch.Generator(device=device).manual_seed(0)
    times = {}
    for scaling in (Fp8Scaling.ROWWISE, Fp8Scaling.TENSORWISE):
        recipe, total = QuantRecipe(fp8_scaling=scaling), 0.0
        for (out_features, in_features), count in counts.items():
            x, w, g = (torch.randn(*shape, device=device, dtype=torch.bfloat16, generator=generator)
                       for shape in ((rows, in_features), (out_features, in_features), (rows, out_features)))
            w_t, g_t, x_t = w.t().contiguous(), g.t().contiguous(), x.t().contiguous()

            def layer_gemms(x=x, w=w, g=g, w_t=w_t, g_t=g_t, x_t=x_t, recipe=recipe):
                quantized_matmul(x, w, Format.FP8, recipe=recipe)
                quantized_matmul(g, w_t, Format.FP8, recipe=recipe, a_is_grad=True)
                quantized_matmul(g_t, x_t, Format.FP8, recipe=recipe, a_is_grad=True)

            total += count * timer(layer_gemms, repeats)
        times[scaling] = total
    return min(times, key=lambda s: (times[s], s is not Fp8Scaling.ROWWISE)), times
