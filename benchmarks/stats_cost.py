"""Cost of one statistics round against depth: time in training steps and peak extra memory.

For the demo architecture at several depths and two widths, each configuration in its own
subprocess (so its peak RSS is its own): a model with AdamW state, a 2048-row batch (16 x 128
tokens) and the callback's defaults (SNIPConfig(): max_rows 1024, candidates fp8 and mxfp4, 2 noise
draws per format, statistics_round.WD_PROBES forward-mode probes). Measured:

- round time / the high-precision training step on the 2048-row batch (forward, backward, AdamW);
- round time / the same step with every layer in emulated mxfp4;
- the round's peak extra memory: the rise of the process's peak RSS (VmHWM, reset through
  /proc/self/clear_refs) over its RSS before the round, in a separate subprocess whose glibc malloc
  runs with a fixed mmap threshold (MALLOC_MMAP_THRESHOLD_) so freed tensors leave the RSS instead
  of staying in its arenas (that costs system time, so the timings run in another subprocess);
- the bound of issue 11: one block's parameters in fp32 + 4 x the slice's activations (the rise of
  peak RSS during a forward pass with autograd on the 1024-row slice, i.e. what a training step
  holds for its backward).

``--exact-max-blocks``: also the EXACT propagation (one vector-Jacobian product per layer), the
round before issue 11, at depths up to that.

``--variants 8,2,4+unbatched+ungrouped``: also time, interleaved with the default round in the same
process, rounds with that many WD probes (``+unbatched``: one forward-mode pass per probe, as before 2026-12-02
night, batched in one pass since; ``+ungrouped``: group_layers=1, each layer's quantizers and GEMMs alone, the
CPU's default; ``+grouped``: stacked with the layers of their shape, 16 at a time, a GPU's default;
``+pinned``: the pinned LM head measured in every format too). The round of 2026-12-02 afternoon also measured
the 8-bit formats' own curvature passes (an option since removed: issue 53).

    python benchmarks/stats_cost.py [--blocks 2,4,8,16,32] [--widths 128,256] [--repeats 2] [--quick]

``--ops``: also count, one round each, the operations each round dispatches that would launch a GPU kernel
(harness.count_kernel_ops), beside those of the high-precision step.

Prints ``round_cost <blocks> <hp_steps> <emulated_steps> <extra_mib> width=<w>``, ``memory_bound ...``,
``memory_bound_variant <blocks> <variant> <extra_mib> <bound_mib> width=<w>``,
``round_ops <blocks> <ops> <hp_step_ops> <ops_per_layer> width=<w>``, ``round_ops_variant <blocks> <variant> <ops>
<ops / the default round's> width=<w>``,
``round_cost_exact ...``, ``round_variant <blocks> <variant> <hp_steps> <emulated_steps> width=<w>`` and
``depth_scaling <width> <hp_steps at max depth / at 4 blocks>``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys

import torch

from lightning_snip.statistics_round import WD_PROBES

from harness import BATCH, SEQ_LEN, RoundVariant, measure_one
from lightning_snip.groups import MAX_GROUP_LAYERS

def parse_variants(text: str) -> list[RoundVariant]:
    """"8,4+unbatched+ungrouped" -> the extra rounds to time: their WD probes, whether they run one
    forward-mode pass each (``unbatched``) instead of batched in one, and whether each layer's quantizers and
    GEMMs run alone (``ungrouped``: group_layers=1) or stacked with the layers of its shape (``grouped``:
    MAX_GROUP_LAYERS); neither: the device's default; ``pinned``: the LM head, pinned to bf16, measured in every
    format too (the round before 2026-12-03 afternoon)."""
    out = []
    for item in filter(None, text.split(",")):
        count, *flags = item.split("+")
        if (not count.isdigit() or int(count) < 1 or not set(flags) <= {"unbatched", "ungrouped", "grouped", "pinned"}
                or {"ungrouped", "grouped"} <= set(flags)):
            raise SystemExit(f"--variants: invalid item {item!r}; allowed: a number of probes >= 1, optionally "
                             "followed by +unbatched, +pinned and/or one of +ungrouped, +grouped, e.g. "
                             "8,4+grouped,4+unbatched+ungrouped+pinned")
        grouping = 1 if "ungrouped" in flags else MAX_GROUP_LAYERS if "grouped" in flags else None
        out.append(RoundVariant(int(count), "unbatched" in flags, grouping, "pinned" in flags))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", default="2,4,8,16,32")
    parser.add_argument("--widths", default="128,256")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--exact-max-blocks", type=int, default=8)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="2 and 4 blocks, width 64, one repeat")
    parser.add_argument("--variants", default="", help="also time rounds with these settings, e.g. 8,4+unbatched")
    parser.add_argument("--one", nargs=2, type=int, metavar=("WIDTH", "BLOCKS"), help=argparse.SUPPRESS)
    parser.add_argument("--ops", action="store_true", help="also count each round's kernel-launching operations "
                        "(harness.count_kernel_ops: a CPU proxy of a GPU's launches)")
    parser.add_argument("--mode", choices=["memory", "time", "ops"], default="time", help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.one:
        width, blocks = args.one
        result = measure_one(width, blocks, args.repeats, blocks <= args.exact_max_blocks, args.seed, args.mode,
                             parse_variants(args.variants))
        print(json.dumps(result))
        return
    if args.quick:
        args.blocks, args.widths, args.repeats, args.exact_max_blocks = "2,4", "64", 1, 2
    blocks_list = [int(b) for b in args.blocks.split(",")]
    widths = [int(w) for w in args.widths.split(",")]
    print(f"# {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC; {platform.machine()} python "
          f"{platform.python_version()} torch {torch.__version__}; {args.threads} thread(s); seed {args.seed}; "
          f"median of {args.repeats} repeat(s); batch {BATCH}x{SEQ_LEN}; SNIPConfig() defaults (wd_probes "
          f"{WD_PROBES}); variants {args.variants or 'none'}", flush=True)
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    results = []
    for width in widths:
        for blocks in blocks_list:
            r = {}
            for mode in ("memory", "time") + (("ops",) if args.ops else ()):
                cmd = [sys.executable, __file__, "--one", str(width), str(blocks), "--repeats", str(args.repeats),
                       "--exact-max-blocks", str(args.exact_max_blocks), "--threads", str(args.threads),
                       "--seed", str(args.seed), "--mode", mode, "--variants", args.variants]
                mode_env = {**env, "MALLOC_MMAP_THRESHOLD_": "65536"} if mode == "memory" else env
                proc = subprocess.run(cmd, env=mode_env, capture_output=True, text=True)
                if proc.returncode != 0:
                    raise SystemExit(f"stats_cost: width {width}, {blocks} blocks ({mode}) failed:\n{proc.stderr[-3000:]}")
                r.update(json.loads(proc.stdout.strip().splitlines()[-1]))
            results.append(r)
            print(f"# width {width}, {blocks} blocks, {r['layers']} layers: hp step {r['hp_step_seconds']:.3f} s, "
                  f"mxfp4 step {r['emulated_step_seconds']:.3f} s, round {r['round_seconds']:.3f} s"
                  + (f", exact round {r['round_seconds_exact']:.3f} s" if "round_seconds_exact" in r else "")
                  + f"; model {r['model_param_mib']:.1f} MiB, block {r['block_param_mib']:.2f} MiB, "
                  f"slice activations {r['slice_activation_mib']:.1f} MiB", flush=True)
    for r in results:
        w, b = r["width"], r["blocks"]
        hp = r["round_seconds"] / r["hp_step_seconds"]
        emulated = r["round_seconds"] / r["emulated_step_seconds"]
        print(f"round_cost {b} {hp:.2f} {emulated:.2f} {r['round_extra_mib']:.1f} width={w}")
        bound = r["block_param_mib"] + 4 * r["slice_activation_mib"]
        print(f"memory_bound {b} {r['round_extra_mib']:.1f} {bound:.1f} width={w}")
        for name, mib in r.get("round_extra_mib_variants", []):
            print(f"memory_bound_variant {b} {name} {mib:.1f} {bound:.1f} width={w}")
        for probes, seconds in r.get("variants", []):
            print(f"round_variant {b} {probes} {seconds / r['hp_step_seconds']:.2f} "
                  f"{seconds / r['emulated_step_seconds']:.2f} width={w}")
        if "ops_round" in r:
            print(f"round_ops {b} {r['ops_round']} {r['ops_hp_step']} {r['ops_round'] / r['layers']:.0f} width={w}")
            for name, ops in r["ops_variants"]:
                print(f"round_ops_variant {b} {name} {ops} {ops / r['ops_round']:.2f} width={w}")
        if "round_seconds_exact" in r:
            print(f"round_cost_exact {b} {r['round_seconds_exact'] / r['hp_step_seconds']:.2f} "
                  f"{r['round_seconds_exact'] / r['emulated_step_seconds']:.2f} {r['round_extra_mib_exact']:.1f} width={w}")
    for w in widths:
        by_blocks = {r["blocks"]: r["round_seconds"] / r["hp_step_seconds"] for r in results if r["width"] == w}
        base = 4 if 4 in by_blocks else min(by_blocks)
        print(f"depth_scaling {w} {by_blocks[max(by_blocks)] / by_blocks[base]:.2f} "
              f"({max(by_blocks)} blocks / {base} blocks, round cost in hp steps)")


if __name__ == "__main__":
    main()
