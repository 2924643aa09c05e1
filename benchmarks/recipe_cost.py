"""What the NVFP4 recipe's pieces cost on the training path (issue 63): a training step of the demo model with every
switchable layer in an FP4 format, the recipe's knobs on (the default: RHT on wgrad, 2D NVFP4 weight scales) against
off (the plain layout), timed in turn in one process (pairs A, B, A, B, ...: the machine's drift falls on both).

Registered before the run: the verdict is the median over pairs of the step-time ratio on / off per format, with
its spread; no target (the recipe is the numerics users train with, not an option to switch off for speed), but a
cost above 10% on the emulated CPU path is reported as a finding.

    python benchmarks/recipe_cost.py [--pairs 5] [--steps 10] [--out results/recipe_cost_<date>.md]
"""

from __future__ import annotations

import argparse
import datetime
import platform
import statistics
import time
from pathlib import Path

import torch

from harness import BATCH, SEQ_LEN, model_config

from lightning_snip.convert import convert_linears
from lightning_snip.demo.model import TinyLlama
from lightning_snip.formats import Format, QuantRecipe

RECIPES = {"recipe": QuantRecipe(), "plain": QuantRecipe(wgrad_hadamard=(), nvfp4_weight_scales_2d=False)}


def _setup(fmt: Format, width: int, blocks: int):
    """The demo model with its LM head in bf16 and every other layer in ``fmt``, an optimizer and a batch."""
    torch.manual_seed(0)
    model = TinyLlama(model_config(width, blocks))
    layers = convert_linears(model, pins={"lm_head": "bf16"}, initial_format=fmt)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tokens = torch.randint(0, 256, (BATCH, SEQ_LEN + 1), generator=torch.Generator().manual_seed(1))
    return model, layers, optimizer, (tokens[:, :-1], tokens[:, 1:])


def _steps_seconds(model, layers, optimizer, batch, recipe: QuantRecipe, steps: int) -> float:
    """Seconds per training step (forward, backward, AdamW) under ``recipe``, the mean of ``steps``."""
    for layer in layers.values():
        layer.recipe = recipe
    start = time.perf_counter()
    for _ in range(steps):
        model.loss(batch).backward()
        optimizer.step()
        optimizer.zero_grad()
    return (time.perf_counter() - start) / steps


def measure(fmt: Format, pairs: int, steps: int, width: int, blocks: int) -> dict:
    """Per pair: the step seconds with the recipe, without it, and their ratio."""
    model, layers, optimizer, batch = _setup(fmt, width, blocks)
    for recipe in RECIPES.values():  # warm-up: the quantizer kernels compile once per process
        _steps_seconds(model, layers, optimizer, batch, recipe, 2)
    rows = []
    for _ in range(pairs):
        on = _steps_seconds(model, layers, optimizer, batch, RECIPES["recipe"], steps)
        off = _steps_seconds(model, layers, optimizer, batch, RECIPES["plain"], steps)
        rows.append((on, off, on / off))
    return {"pairs": rows, "median": statistics.median(r[2] for r in rows),
            "std": statistics.stdev(r[2] for r in rows) if len(rows) > 1 else float("nan")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pairs", type=int, default=5)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--blocks", type=int, default=4)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(2)
    lines = [f"Demo model width {args.width}, {args.blocks} blocks, {BATCH} x {SEQ_LEN} tokens per step; every layer but "
             f"the LM head in the format; {args.pairs} pairs of {args.steps} steps, the recipe's knobs on / off.", "",
             "| format | step s, recipe (median) | step s, plain (median) | on / off per pair | median ± std |",
             "|---|---|---|---|---|"]
    for fmt in (Format.MXFP4, Format.NVFP4):
        result = measure(fmt, args.pairs, args.steps, args.width, args.blocks)
        rows = result["pairs"]
        lines.append(f"| {fmt.value} | {statistics.median(r[0] for r in rows):.4f} | "
                     f"{statistics.median(r[1] for r in rows):.4f} | {', '.join(f'{r[2]:.3f}' for r in rows)} | "
                     f"{result['median']:.3f} ± {result['std']:.3f} |")
        print(lines[-1], flush=True)
    if args.out:
        head = [f"# The NVFP4 recipe's cost on the training path — {datetime.date.today().isoformat()}", "",
                f"Command: `cd benchmarks && python recipe_cost.py --pairs {args.pairs} --steps {args.steps} --width "
                f"{args.width} --blocks {args.blocks} --out {args.out}`; machine {platform.machine()}, "
                f"{torch.get_num_threads()} threads, torch {torch.__version__}; emulated FP4.", ""]
        args.out.write_text("\n".join(head + lines) + "\n")


if __name__ == "__main__":
    main()
