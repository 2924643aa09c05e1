"""The loss-spike guard (issue 51): never fires on healthy runs; undoes a plan onto a broken FP4 forward.

Parts (each run cached as JSON under --out as it ends; a rerun resumes):

- ``healthy``: the main job as users run it (``python -m lightning_snip.train``, the demo at its defaults, one
  run per seed; ``--smollm2`` adds ``model=smollm2`` at its preset): plans watched and reverted, from the
  app's summary line, and the final losses.
- ``fault``: a 2-block demo model (dim 64) whose every MXFP4 forward is broken on purpose (noise 10x its
  output, harness.broken_fp4_forward's "noise"), the plan at step 11 of 60: with the guard (it reverts) against the same
  run with ``replan=False`` (the layers stay in fp8: a run that never had the bad plan), paired over seeds;
  beside it the seed-to-seed spread of the never-planned run, the noise the difference is read against.
- ``overhead``: the demo model, 120 steps at the defaults, the guard on against off (its per-step loss read
  and all-reduce), alternated, the ratio per pair.

    python benchmarks/spike_guard.py --parts healthy fault overhead --seeds 0 1 2 3 4 [--smollm2]

Prints a markdown report; commit it under benchmarks/results/spike_guard_<date>.md.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import time
from pathlib import Path

import torch

from harness import cached_json, mean_std

ROOT = Path(__file__).resolve().parent.parent


def healthy_run(out: Path, seed: int, model: str = "tiny") -> dict:
    """One run of the app at its defaults; what its summary says."""
    args = [sys.executable, "-m", "lightning_snip.train", f"trainer.seed={seed}", f"trainer.output_dir={out}/run",
            f"hydra.run.dir={out}/hydra"] + (["model=smollm2"] if model != "tiny" else [])
    start = time.perf_counter()
    proc = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=3600)
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr[-3000:])
    guard = re.search(r"spike guard: (\d+) plans watched, (\d+) reverted(?: \(largest loss rise (-?[\d.]+) sigma\))?",
                      proc.stdout)
    losses = re.search(r"train loss ([\d.]+); val loss ([\d.]+)", proc.stdout)
    plans = re.search(r"plans applied (\d+)", proc.stdout)
    return {"seed": seed, "model": model, "watched": int(guard.group(1)), "reverted": int(guard.group(2)),
            "largest_rise": float(guard.group(3)) if guard.group(3) else None,
            "plans": int(plans.group(1)), "train_loss": float(losses.group(1)), "val_loss": float(losses.group(2)),
            "seconds": time.perf_counter() - start}


def _module_and_data(seed: int):
    import lightning.pytorch as pl

    from lightning_snip.demo.lightning import ByteTextDataModule, DemoLM
    from lightning_snip.demo.model import LlamaConfig

    pl.seed_everything(seed)
    module = DemoLM(LlamaConfig(dim=64, num_layers=2, num_heads=4, num_kv_heads=2, hidden_dim=160))
    return module, ByteTextDataModule(seq_len=32, batch_size=8, val_batches=4, seed=seed)


def fault_run(seed: int, replan: bool, max_steps: int = 60) -> dict:
    """The demo model with every MXFP4 forward broken; the guard on (replan) or no plan at all."""
    import lightning.pytorch as pl

    import lightning_snip.linear as linear
    from lightning_snip.callback import SNIPCallback
    from lightning_snip.config import SNIPConfig
    from lightning_snip.formats import Format

    from harness import broken_fp4_forward  # the fault the tests inject

    from lightning_snip.statistics_round import RoundSettings

    module, data = _module_and_data(seed)
    snip = SNIPCallback(SNIPConfig(warmup_steps=10, interval=100, fp4_fraction=0.6, max_rows=128,
                                   replan=replan, overhead_budget=None),
                        round_settings=RoundSettings(noise_draws=1))  # the protocol's draw (1 until 2026-12-04)
    real = linear.quantized_matmul

    class Fault(pl.Callback):
        def on_fit_start(self, trainer, pl_module):
            linear.quantized_matmul = broken_fp4_forward(list(snip.layers.values()), Format.MXFP4, mode="noise")

    trainer = pl.Trainer(max_steps=max_steps, callbacks=[snip, Fault()], accelerator="cpu", logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         val_check_interval=max_steps, limit_val_batches=4)
    try:
        trainer.fit(module, datamodule=data)
    finally:
        linear.quantized_matmul = real
    return {"seed": seed, "replan": replan, "reverts": snip.controller.guard.num_reverts,
            "largest_rise": snip.controller.guard.max_rise,
            "plans": snip.num_plans_applied, "val_loss": float(trainer.callback_metrics["val/loss"])}


def overhead_pair(seed: int, steps: int = 120) -> dict:
    """Seconds of a demo run with the guard off, then on (the same seed, in this process)."""
    import lightning.pytorch as pl

    from lightning_snip.callback import SNIPCallback
    from lightning_snip.config import SNIPConfig
    from lightning_snip.demo.lightning import ByteTextDataModule, DemoLM
    from lightning_snip.demo.model import LlamaConfig

    out = {}
    for name, threshold in (("off", None), ("on", SNIPConfig().spike_threshold)):
        pl.seed_everything(seed)
        module = DemoLM(LlamaConfig())
        data = ByteTextDataModule(seq_len=128, batch_size=16, val_batches=1, seed=seed)
        snip = SNIPCallback(SNIPConfig(spike_threshold=threshold))
        trainer = pl.Trainer(max_steps=steps, callbacks=[snip], accelerator="cpu", logger=False,
                             enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                             limit_val_batches=0)
        start = time.perf_counter()
        trainer.fit(module, datamodule=data)
        out[name] = time.perf_counter() - start
    out["ratio"] = out["on"] / out["off"]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--parts", nargs="+", default=["healthy", "fault", "overhead"])
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2, 3, 4])
    parser.add_argument("--smollm2", action="store_true", help="also one healthy SmolLM2 run (model=smollm2)")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "spike_guard_runs")
    args = parser.parse_args()
    torch.set_num_threads(1)
    lines = []
    if "healthy" in args.parts:
        runs = [cached_json(args.out / f"healthy_tiny_{s}.json", lambda s=s: healthy_run(args.out / f"tiny{s}", s))
                for s in args.seeds]
        if args.smollm2:
            runs.append(cached_json(args.out / "healthy_smollm2_0.json",
                                lambda: healthy_run(args.out / "smollm2", 0, "smollm2")))
        lines += ["## Healthy runs (the app at its defaults)", "",
                  "| model | seed | plans applied | watched | reverted | largest loss rise (sigma) | train loss | val loss "
                  "| seconds |", "|---|---|---|---|---|---|---|---|---|"]
        lines += [f"| {r['model']} | {r['seed']} | {r['plans']} | {r['watched']} | {r['reverted']} | "
                  f"{r['largest_rise'] if r['largest_rise'] is None else format(r['largest_rise'], '.1f')} | "
                  f"{r['train_loss']:.4f} | {r['val_loss']:.4f} | {r['seconds']:.0f} |" for r in runs]
        lines += ["", f"Reverts: {sum(r['reverted'] for r in runs)} in {sum(r['watched'] for r in runs)} watched plans "
                  f"over {len(runs)} runs.", ""]
    if "fault" in args.parts:
        pairs = [(cached_json(args.out / f"fault_guard_{s}.json", lambda s=s: fault_run(s, True)),
                  cached_json(args.out / f"fault_noplan_{s}.json", lambda s=s: fault_run(s, False))) for s in args.seeds]
        diffs = [g["val_loss"] - n["val_loss"] for g, n in pairs]
        mean, std = mean_std(diffs)
        spread = mean_std([n["val_loss"] for _, n in pairs])[1]
        lines += ["## A plan onto a broken FP4 forward (every MXFP4 forward noise 10x its output)", "",
                  "| seed | reverts (guard) | val loss, guard | val loss, never planned | difference |", "|---|---|---|---|---|"]
        lines += [f"| {g['seed']} | {g['reverts']} | {g['val_loss']:.4f} | {n['val_loss']:.4f} | {d:+.4f} |"
                  for (g, n), d in zip(pairs, diffs)]
        lines += ["", f"Paired difference {mean:+.4f} ± {std:.4f} (n {len(diffs)}); the never-planned runs' seed "
                  f"spread (std) {spread:.4f}.", ""]
    if "overhead" in args.parts:
        pairs = [cached_json(args.out / f"overhead_{s}.json", lambda s=s: overhead_pair(s)) for s in args.seeds[:3]]
        ratios = [p["ratio"] for p in pairs]
        mean, std = mean_std(ratios)
        lines += ["## Overhead (demo model at the defaults, 120 steps, guard on / off in one process)", "",
                  "| seed | off s | on s | on / off |", "|---|---|---|---|"]
        lines += [f"| {i} | {p['off']:.1f} | {p['on']:.1f} | {p['ratio']:.3f} |" for i, p in enumerate(pairs)]
        lines += ["", f"Ratio {mean:.3f} ± {std:.3f}.", ""]
    print("\n".join(lines))


if __name__ == "__main__":
    main()
