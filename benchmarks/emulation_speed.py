"""Emulation speed: a training step with every linear layer in one format, relative to high precision.

Measured side by side in one process, configurations interleaved in each repeat (the machine is
shared and noisy); the median over repeats of each configuration's mean step time. Quantizer modes
(lightning_snip.kernels.quantizer_mode): ``compiled`` (the default, "fast"), ``reference`` (torchao's
quantizers composed, what lightning_snip ran before, "eager"). Both give identical numbers.

Models: the demo model (width 128, 4 blocks, batch 16 x 128 tokens) and a 1024-wide model (2
blocks, SwiGLU 2816, batch 4 x 128). High precision is the same model with the layers in bf16 mode,
i.e. the run's own fp32 F.linear. The peer: torchao's own emulated training GEMMs on one 1024x512
layer (x 1024x512), fwd+bwd, against nn.Linear: Float8Linear(emulate=True) (rowwise recipe) and
mx_mm with emulated kernels (mxfp8, mxfp4); lightning_snip's SNIPLinear on the same layer beside it.

    python benchmarks/emulation_speed.py [--repeats 3] [--steps 3] [--quick] [--threads 1] [--no-reference]

Prints ``step_ratio <model> <format> <value>`` (compiled), ``step_ratio_paired ... median m range
lo-hi n k`` (per-repeat ratios to the same repeat's high-precision step), ``step_ratio_reference ...``,
``layer_ratio <impl> <format> <value>`` for the one-layer comparison, and the compile time.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import platform
import statistics
import time

import torch
from torch import nn

from lightning_snip import kernels
from lightning_snip.convert import convert_linears
from lightning_snip.demo.model import LlamaConfig, TinyLlama
from lightning_snip.formats import Format
from lightning_snip.linear import SNIPLinear

from harness import quantizer_mode, torchao_float8, torchao_mx

FORMATS = (Format.FP8, Format.MXFP8, Format.MXFP4, Format.NVFP4)
MODELS = {
    "demo": (LlamaConfig(), 16),
    "wide1024": (LlamaConfig(dim=1024, num_layers=2, num_heads=8, num_kv_heads=4, hidden_dim=2816), 4),
}


class StepTimer:
    """A model, its AdamW and a fixed batch; ``time(fmt, mode, steps)`` = mean seconds per step."""

    def __init__(self, config: LlamaConfig, batch_size: int, seq_len: int = 128, seed: int = 0):
        torch.manual_seed(seed)
        self.model = TinyLlama(config)
        self.layers = convert_linears(self.model)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        tokens = torch.randint(0, config.vocab_size, (batch_size, seq_len + 1))
        self.batch = (tokens[:, :-1], tokens[:, 1:])

    def step(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        self.model.loss(self.batch).backward()
        self.optimizer.step()

    def time(self, fmt: Format, mode: str, steps: int) -> float:
        for layer in self.layers.values():
            layer.format = fmt
        with quantizer_mode(mode):
            self.step()  # warm-up (and, the first time, compilation)
            start = time.perf_counter()
            for _ in range(steps):
                self.step()
            return (time.perf_counter() - start) / steps


def peer_layer_ratios(repeats: int) -> dict[tuple[str, str], float]:
    """fwd+bwd of one 1024x512 -> 512 layer: torchao's emulated training GEMMs and SNIPLinear, each
    over nn.Linear, interleaved."""
    # harness.torchao_float8 / torchao_mx: the same constructions tests/test_numerics.py checks bit for bit
    torch.manual_seed(0)
    base = nn.Linear(512, 512)
    x = torch.randn(1024, 512, requires_grad=True)
    impls = {("high_precision", "-"): base}
    impls[("torchao", "fp8")] = torchao_float8(nn.Linear(512, 512), "rowwise")
    for fmt in (Format.MXFP8, Format.MXFP4):
        impls[("torchao", fmt.value)] = torchao_mx(nn.Linear(512, 512), fmt)
    for fmt in FORMATS:
        layer = SNIPLinear.from_linear(nn.Linear(512, 512), format=fmt)
        impls[("lightning_snip", fmt.value)] = layer

    def run(fn, n=5):
        fn(x).sum().backward()
        start = time.perf_counter()
        for _ in range(n):
            fn(x).sum().backward()
        return (time.perf_counter() - start) / n

    times: dict[tuple[str, str], list[float]] = {k: [] for k in impls}
    for _ in range(repeats):
        for key, fn in impls.items():
            times[key].append(run(fn))
    hp = statistics.median(times[("high_precision", "-")])
    return {k: statistics.median(v) / hp for k, v in times.items() if k[0] != "high_precision"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--quick", action="store_true", help="demo model only, 1 repeat of 2 steps")
    parser.add_argument("--no-reference", action="store_true",
                        help="skip the reference (torchao-composed) quantizers: more repeats of the targets' ratios")
    args = parser.parse_args()
    if args.quick:
        args.models, args.repeats, args.steps = ["demo"], 1, 2
    torch.set_num_threads(args.threads)
    print(f"# emulation_speed {datetime.date.today()} torch {torch.__version__} {platform.processor() or platform.machine()} "
          f"threads {args.threads} repeats {args.repeats} steps {args.steps} seed 0")
    modes = ("compiled",) if args.no_reference else ("compiled", "reference")
    configs = [(Format.BF16, "compiled")] + [(f, m) for f in FORMATS for m in modes]
    for name in args.models:
        config, batch_size = MODELS[name]
        timer = StepTimer(config, batch_size)
        times: dict[tuple[Format, str], list[float]] = {c: [] for c in configs}
        for _ in range(args.repeats):
            for fmt, mode in configs:
                times[(fmt, mode)].append(timer.time(fmt, mode, args.steps))
        hp = statistics.median(times[(Format.BF16, "compiled")])
        print(f"# {name}: {dataclasses.asdict(config)}, batch {batch_size}x128; high-precision step {hp * 1e3:.1f} ms")
        for fmt in FORMATS:
            print(f"step_ratio {name} {fmt.value} {statistics.median(times[(fmt, 'compiled')]) / hp:.2f}")
            # Paired: each repeat's format time over the same repeat's high-precision time (timed
            # minutes apart at most), so drift of the machine between repeats cancels.
            paired = sorted(t / h for t, h in zip(times[(fmt, "compiled")], times[(Format.BF16, "compiled")]))
            print(f"step_ratio_paired {name} {fmt.value} median {statistics.median(paired):.2f} "
                  f"range {paired[0]:.2f}-{paired[-1]:.2f} n {len(paired)}")
            if not args.no_reference:
                print(f"step_ratio_reference {name} {fmt.value} "
                      f"{statistics.median(times[(fmt, 'reference')]) / hp:.2f}")
    if not args.quick:
        for (impl, fmt), ratio in peer_layer_ratios(args.repeats).items():
            print(f"layer_ratio {impl} {fmt} {ratio:.2f}")
    for (kernel, device), seconds in sorted(kernels.compile_seconds.items()):
        print(f"compile_seconds {kernel} {device} {seconds:.1f}")


if __name__ == "__main__":
    main()
