"""Cost of LD's first-order sampling (SNIPCallback, snip.first_order_steps, max_rows rows each) on the demo
model: one training step with and without the FirstOrderSampler hooks, side by side in one process,
with the switched layers in bf16 (what a step costs on hardware with native low-precision kernels)
and in emulated mxfp4 (what it costs on this CPU). Candidates fp8 and mxfp4, LM head pinned (not
sampled), batch 16x128 (2048 rows), seed 0. Each row count is timed interleaved with the plain step:
best of ``--repeats`` x 4 steps each.

    python benchmarks/first_order_cost.py [--rows 256 1024 2048] [--repeats 2]

Prints ``first_order_cost <format> <rows> <plain ms> <sampled ms> <per sampled step %> <wall % at 32 of
every 100 steps>``.
"""
import argparse
import time

import torch

from lightning_snip.convert import convert_linears
from lightning_snip.demo.model import LlamaConfig, TinyLlama
from lightning_snip.first_order import FirstOrderSampler, FirstOrderTerms
from lightning_snip.formats import Format


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[256])
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = TinyLlama(LlamaConfig())
    layers = convert_linears(model, pins={"*lm_head": "bf16"})
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tok = torch.randint(256, (16, 129))
    batch = (tok[:, :-1], tok[:, 1:])
    terms = FirstOrderTerms([Format.FP8, Format.MXFP4])
    switched = {f: layer for f, layer in layers.items() if layer.pinned is None}
    samplers = {rows: FirstOrderSampler(switched, rows, terms.add) for rows in args.rows}

    def step(rows):
        opt.zero_grad()
        if rows:
            with samplers[rows].recording(offset=1):
                model.loss(batch).backward()
        else:
            model.loss(batch).backward()
        opt.step()
        terms.take()

    print(f"# first_order_cost: demo model, batch 16x128, rows {args.rows}, best of {args.repeats} x 4 steps, seed 0")
    for fmt in (Format.BF16, Format.MXFP4):
        for layer in switched.values():
            layer.format = fmt
        res = {}
        for _ in range(args.repeats):
            for rows in [0] + args.rows:  # interleaved: the plain step beside every row count
                step(rows)
                t = time.perf_counter()
                for _ in range(4):
                    step(rows)
                res.setdefault(rows, []).append((time.perf_counter() - t) / 4)
        plain = min(res[0])
        for rows in args.rows:
            sampled = min(res[rows])
            print(f"first_order_cost {fmt.value} {rows} {plain * 1000:.0f} {sampled * 1000:.0f} "
                  f"{(sampled / plain - 1) * 100:.1f} {(sampled - plain) * 32 / (plain * 100) * 100:.1f}")


if __name__ == "__main__":
    main()
