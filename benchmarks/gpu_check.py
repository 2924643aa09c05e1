"""GPU check, prepared to run once on a lent GPU in under 5 minutes (also runs on a CPU, smaller).

1. Numerics per format: relative error against float64 of the emulated GEMM (lightning_snip's fused
   quantizers) and, where the device has one, of the native kernel (kernel_for: torchao.float8's
   training path for FP8 on compute capability >= 8.9; torchao's MX / NVFP4 block-scaled GEMMs on
   10.x), and native vs emulated; for FP4 also a gradient GEMM (its first operand stochastically
   rounded, the same random draws on both paths).
2. Speed: GEMM time over bf16 at 4096^3 and 8192^3 for the native kernels (casts included) and for
   the emulated formats (quantizers + bf16 matmul), and quantizer compile times.
3. A 50-step demo run with SNIPCallback in bf16-mixed (statistics round at step 20, plan applied).

    python benchmarks/gpu_check.py [--sizes 4096 8192] [--repeats 20] [--steps 50] [--out DIR]

Writes benchmarks/results/gpu_check_<date>_<device>.md (or under --out) and prints the same lines.
"""

from __future__ import annotations

import argparse
import datetime
import os
import re
import time

import torch

from lightning_snip import fused
from lightning_snip.formats import Format, QuantRecipe
from lightning_snip.linear import Kernel, kernel_for, quantized_matmul

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
        lines.append(line)
    for (kernel, dev), seconds in sorted(fused.compile_seconds.items()):
        lines.append(f"compile_seconds {kernel} {dev} {seconds:.1f}")


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
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    capability = torch.cuda.get_device_capability() if device.type == "cuda" else None
    lines = [f"# gpu_check {datetime.date.today()} device {name} capability {capability} torch {torch.__version__}"]
    sizes = args.sizes if device.type == "cuda" else [512]
    for part in (lambda: numerics(device, lines), lambda: speed(device, sizes, args.repeats, lines),
                 lambda: demo_run(device, args.steps, lines)):
        try:
            part()
        except Exception as err:  # report and go on: one failing part must not lose the others
            lines.append(f"error {type(err).__name__}: {str(err).splitlines()[0][:300]}")
        print("\n".join(lines[-3:]), flush=True)
    os.makedirs(args.out, exist_ok=True)
    slug = re.sub(r"[^A-Za-z0-9]+", "_", name).strip("_").lower()
    path = os.path.join(args.out, f"gpu_check_{datetime.date.today()}_{slug}.md")
    with open(path, "w") as f:
        f.write("```\n" + "\n".join(lines) + "\n```\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
