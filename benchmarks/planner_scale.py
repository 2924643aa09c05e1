"""Solve time of the SNIP ILP at Llama shapes (random metrics), 3 formats, 1 and 8 pipeline stages.

    python benchmarks/planner_scale.py [--repeats 3] [--fp4-fraction 0.75]

Target: 70B (80 blocks), 8 stages, optimal in <= 1 s; 405B (126 blocks) <= 5 s. Prints one line per
shape and stage count (median of the repeats; every solve must be proven optimal).
"""

from __future__ import annotations

import argparse
import platform
import random
import statistics
import time

from lightning_snip.formats import Format
from lightning_snip.plan import SolveStatus
from lightning_snip.planner import LayerCandidates, solve_gemm_plan, solve_plan

# (blocks, hidden, intermediate, kv dim) of Llama 3 shapes
SHAPES = {"1B": (22, 2048, 8192, 512), "7B": (32, 4096, 11008, 4096), "70B": (80, 8192, 28672, 1024), "405B": (126, 16384, 53248, 1024)}
FORMATS = (Format.FP8, Format.MXFP4, Format.NVFP4)


def llama_layers(blocks, hidden, inter, kv, rng, tokens=8192):
    dims = {"q": (hidden, hidden), "k": (kv, hidden), "v": (kv, hidden), "o": (hidden, hidden),
            "gate": (inter, hidden), "up": (inter, hidden), "down": (hidden, inter)}
    layers = []
    for b in range(blocks):
        for name, (m, k) in dims.items():
            ld = {f: rng.lognormvariate(-4 if f.is_fp4 else -7, 1.5) for f in FORMATS}
            wd = {f: rng.lognormvariate(-3 if f.is_fp4 else -6, 1.5) for f in FORMATS}
            layers.append(LayerCandidates(f"layers.{b}.{name}", 6.0 * tokens * m * k, ld, wd))
    return layers


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--fp4-fraction", type=float, default=0.75)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--granularity", choices=("layer", "gemm"), default="layer",
                        help="gemm: a format per layer and GEMM direction (forward; dgrad+wgrad)")
    args = parser.parse_args()
    solve = solve_plan if args.granularity == "layer" else solve_gemm_plan
    print(f"# machine: {platform.machine()} {platform.processor() or ''} python {platform.python_version()}")
    print(f"# fp4_fraction={args.fp4_fraction} repeats={args.repeats} seed={args.seed} formats={[f.value for f in FORMATS]} "
          f"granularity={args.granularity}")
    print("shape  blocks  layers  stages  median_s  max_s  status")
    for name, (blocks, hidden, inter, kv) in SHAPES.items():
        for num_stages in (1, 8):
            times, statuses = [], set()
            for r in range(args.repeats):
                rng = random.Random(args.seed * 1000 + r)
                layers = llama_layers(blocks, hidden, inter, kv, rng)
                stages = {l.fqn: int(l.fqn.split(".")[1]) * num_stages // blocks for l in layers} if num_stages > 1 else None
                start = time.perf_counter()
                plan = solve(layers, fp4_fraction=args.fp4_fraction, stages=stages, time_limit_seconds=60)
                times.append(time.perf_counter() - start)
                statuses.add(plan.status)
            status = "optimal" if statuses == {SolveStatus.OPTIMAL} else ",".join(s.value for s in statuses)
            print(f"{name:<5}  {blocks:>6}  {len(layers):>6}  {num_stages:>6}  {statistics.median(times):8.3f}  {max(times):5.3f}  {status}")


if __name__ == "__main__":
    main()
