"""GPU check: real FP8 kernels (torch._scaled_mm, as torchao.float8 uses) against lightning_snip's
emulation, and GEMM speed ratios. Runs in a few minutes on one GPU; on a CPU it runs the emulated
numerics only and says so.

    python benchmarks/gpu_check.py [--sizes 4096 8192] [--repeats 20]

Prints per format: relative error of the real and emulated GEMM against float64 and their mutual
difference (same numerics up to accumulation order), then bf16 vs fp8 GEMM time ratios.
"""

from __future__ import annotations

import argparse

import torch

from lightning_snip.formats import Format, QuantRecipe, fake_quantize
from lightning_snip.linear import _fp8_scaled_mm, has_native_kernel


def rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


def timed(fn, repeats):
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        fn()
        start.record()
        for _ in range(repeats):
            fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / repeats / 1000
    import time

    fn()
    t = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - t) / repeats


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", type=int, nargs="+", default=[4096, 8192])
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    print(f"# device {name}; torch {torch.__version__}; native fp8: {has_native_kernel(Format.FP8, device)}")
    recipe = QuantRecipe()
    torch.manual_seed(0)
    n = 1024 if device.type == "cpu" else 4096
    a, b = torch.randn(n, n, device=device), torch.randn(n, n, device=device)
    ref = a.double() @ b.double().t()
    for fmt in (Format.FP8, Format.MXFP8, Format.MXFP4, Format.NVFP4):
        emulated = fake_quantize(a, fmt, axis=1) @ fake_quantize(b, fmt, axis=1).t()
        line = f"numerics {fmt.value:<6} n={n} emulated_vs_fp64 {rel(emulated, ref):.4f}"
        if fmt is Format.FP8 and has_native_kernel(fmt, device):
            real = _fp8_scaled_mm(a.bfloat16(), b.bfloat16(), recipe, False, False)
            line += f" real_vs_fp64 {rel(real, ref):.4f} real_vs_emulated {rel(real, emulated):.4f}"
        print(line)
    for size in args.sizes if device.type == "cuda" else [512]:
        x, w = torch.randn(size, size, device=device, dtype=torch.bfloat16), torch.randn(size, size, device=device, dtype=torch.bfloat16)
        t_bf16 = timed(lambda: x @ w.t(), args.repeats)
        t_emul = timed(lambda: fake_quantize(x, Format.MXFP4, axis=1) @ fake_quantize(w, Format.MXFP4, axis=1).t(), max(1, args.repeats // 4))
        line = f"speed n={size} bf16 {t_bf16 * 1e3:.3f} ms; mxfp4_emulated/bf16 {t_emul / t_bf16:.2f}"
        if has_native_kernel(Format.FP8, device):
            t_fp8 = timed(lambda: _fp8_scaled_mm(x, w, recipe, False, False), args.repeats)
            line += f"; fp8_real/bf16 {t_fp8 / t_bf16:.3f} (incl. casts)"
        print(line)


if __name__ == "__main__":
    main()
