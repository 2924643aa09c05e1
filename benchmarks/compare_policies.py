"""SNIP against the baselines at equal FP4 FLOPs fraction (the paper's accuracy-vs-FP4 protocol).

Pretrains the demo model in high precision (one checkpoint), then continues the same number of steps
from it under each policy: all-bf16, all-fp8, all-fp4 (mxfp4), and at each FP4 fraction SNIP, random,
min-rel-err, layer-type order and first/last blocks high (FP4 = mxfp4, the rest fp8; the LM head pinned
bf16 in every run). Reports the held-out eval loss gap to the bf16 run (evaluated in high precision),
mean and std over seeds; a seed sets the continuation's data order, stochastic rounding and the random
policy.

    python benchmarks/compare_policies.py [--quick] [--seeds 3] [--workers 2]
    python benchmarks/compare_policies.py --noise-floor    # bf16 seed std vs the all-fp4 gap only

Writes benchmarks/results/compare_policies.json, compare_policies_<date>.md and compare_policies.png.
"""

from __future__ import annotations

import argparse
import concurrent.futures as futures
import datetime
import json
import logging
import multiprocessing
import os
import platform
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
FRACTIONS = (0.5, 0.75, 0.9)
FRACTION_POLICIES = ("snip", "random", "min_rel_err", "layer_type", "first_last")


@dataclass(frozen=True)
class Setup:
    dim: int
    num_layers: int
    hidden_dim: int
    seq_len: int
    batch_size: int
    lr: float
    pretrain_steps: int
    continue_steps: int
    snip_interval: int


FULL = Setup(dim=128, num_layers=4, hidden_dim=352, seq_len=128, batch_size=16, lr=3e-3,
             pretrain_steps=300, continue_steps=120, snip_interval=40)
QUICK = Setup(dim=64, num_layers=4, hidden_dim=160, seq_len=64, batch_size=8, lr=3e-3,
              pretrain_steps=40, continue_steps=12, snip_interval=6)


def _model_config(s: Setup):
    from lightning_snip.demo.model import LlamaConfig

    return LlamaConfig(dim=s.dim, num_layers=s.num_layers, num_heads=4, num_kv_heads=2, hidden_dim=s.hidden_dim)


def _data(s: Setup, seed: int):
    from lightning_snip.demo.lightning import ByteTextDataModule

    # val_batches large enough to cover the whole held-out tail: a low-noise eval.
    return ByteTextDataModule(seq_len=s.seq_len, batch_size=s.batch_size, val_batches=10**6, seed=seed)


def _trainer(max_steps: int, callbacks, root: Path):
    import lightning.pytorch as pl

    return pl.Trainer(max_steps=max_steps, accelerator="cpu", devices=1, callbacks=callbacks, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                      limit_val_batches=0, default_root_dir=root)


def pretrain(s: Setup, root: Path) -> tuple[Path, dict[str, float]]:
    """High-precision pretraining -> checkpoint, plus each layer's relative MXFP4 output error there
    (what min-rel-err ranks by)."""
    import lightning.pytorch as pl
    import torch

    from lightning_snip.convert import convert_linears, glob_filter
    from lightning_snip.demo.lightning import DemoLM
    from lightning_snip.divergence import estimate_divergence
    from lightning_snip.formats import Format
    from lightning_snip.stats import collect_stats, slice_batch

    torch.set_num_threads(2)
    pl.seed_everything(1234)
    module = DemoLM(_model_config(s), lr=s.lr)
    data = _data(s, seed=1234)
    trainer = _trainer(s.pretrain_steps, [], root)
    trainer.fit(module, datamodule=data)
    ckpt = root / "pretrained.ckpt"
    trainer.save_checkpoint(ckpt)
    layers = convert_linears(module, filter=glob_filter(("*",)), pins={"*lm_head": "bf16"})
    batch = slice_batch(next(iter(data.train_dataloader())), 1024)
    stats = collect_stats(module, lambda: module.snip_loss(batch), layers=layers)
    result = estimate_divergence(stats, [Format.MXFP4], noise_draws=0)
    stats.release()
    return ckpt, {fqn: d.rel_error_forward[Format.MXFP4] for fqn, d in result.layers.items()}


def _baseline_plan(policy: str, fraction: float, seed: int, module, rel_error):
    from lightning_snip.convert import convert_linears
    from lightning_snip.formats import Format
    from lightning_snip.planner import (LayerCandidates, first_last_plan, layer_type_plan, min_rel_err_plan,
                                        random_plan, uniform_plan)

    layers = convert_linears(module, pins={"*lm_head": "bf16"})  # converted again by the callback: a no-op
    zero = {Format.BF16: 0.0, Format.FP8: 0.0, Format.MXFP4: 0.0}
    cands = [LayerCandidates(f, 6.0 * l.in_features * l.out_features, zero, zero, l.pinned) for f, l in layers.items()]
    if policy in ("all_bf16", "all_fp8", "all_fp4"):
        return uniform_plan(cands, {"all_bf16": "bf16", "all_fp8": "fp8", "all_fp4": "mxfp4"}[policy])
    if policy == "random":
        return random_plan(cands, fp4_fraction=fraction, seed=seed)
    if policy == "min_rel_err":
        return min_rel_err_plan(cands, rel_error, fp4_fraction=fraction)
    if policy == "layer_type":
        return layer_type_plan(cands, fp4_fraction=fraction)
    if policy == "first_last":
        return first_last_plan(cands, fp4_fraction=fraction)
    raise ValueError(f"policy: unknown {policy!r}")


def run_one(s: Setup, ckpt: str, policy: str, fraction: float, seed: int, rel_error: dict, root: str) -> dict:
    """Continue from the checkpoint under one policy; return the held-out loss (high precision)."""
    import lightning.pytorch as pl
    import torch

    from lightning_snip.callback import SNIPCallback
    from lightning_snip.config import SNIPConfig
    from lightning_snip.demo.lightning import DemoLM
    from lightning_snip.stats import high_precision

    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    torch.set_num_threads(1)
    pl.seed_everything(seed)
    # The continuation decays the learning rate linearly to 0: its final iterate depends far less on
    # the data order, which lowers the seed-to-seed noise floor of the comparison.
    module = DemoLM(_model_config(s), lr=s.lr, lr_decay_start=s.pretrain_steps, lr_decay_steps=s.continue_steps)
    pins = {"*lm_head": "bf16"}
    if policy == "snip":
        config = SNIPConfig(warmup_steps=s.pretrain_steps, interval=s.snip_interval, apply_delay=1, fp4_fraction=fraction,
                            candidate_formats=("fp8", "mxfp4"), initial_format="fp8", pins=pins)
        callback = SNIPCallback(config)
    else:
        plan = _baseline_plan(policy, fraction, seed, DemoLM(_model_config(s)), rel_error)
        callback = SNIPCallback(SNIPConfig(replan=False, fp4_fraction=fraction or 0.0, pins=pins), plan=plan)
    data = _data(s, seed)
    start = time.perf_counter()
    trainer = _trainer(s.pretrain_steps + s.continue_steps, [callback], Path(root))
    trainer.fit(module, datamodule=data, ckpt_path=ckpt)
    seconds = time.perf_counter() - start
    losses = []
    with torch.no_grad(), high_precision(callback.layers):
        for batch in data.val_dataloader():
            losses.append((module.snip_loss(batch).item(), len(batch[0])))
    eval_loss = sum(l * n for l, n in losses) / sum(n for _, n in losses)
    achieved = callback.plan.fp4_fraction if callback.plan else 0.0
    return {"policy": policy, "fraction": fraction, "seed": seed, "eval_loss": eval_loss, "achieved_fraction": achieved,
            "seconds": seconds, "plans": callback.num_plans_applied}


def _jobs(noise_floor: bool, seeds: int):
    jobs = [("all_bf16", 0.0), ("all_fp4", 1.0)]
    if not noise_floor:
        jobs += [("all_fp8", 0.0)] + [(p, f) for f in FRACTIONS for p in FRACTION_POLICIES]
    return [(p, f, seed) for seed in range(seeds) for p, f in jobs]


def summarize(rows: list[dict]) -> dict:
    bf16 = {r["seed"]: r["eval_loss"] for r in rows if r["policy"] == "all_bf16"}
    out: dict[str, dict] = {}
    for r in rows:
        if r["policy"] == "all_bf16" and r["seed"] not in bf16:
            continue
        key = f"{r['fraction']:.2f}".rstrip("0").rstrip(".") if r["fraction"] not in (0.0, 1.0) else f"{r['fraction']:.1f}"
        name = {"all_bf16": "all_bf16", "all_fp8": "all_fp8", "all_fp4": "all_fp4"}.get(r["policy"], r["policy"])
        out.setdefault(key, {}).setdefault(name, []).append(r["eval_loss"] - bf16[r["seed"]])
    return {
        frac: {name: {"mean": statistics.fmean(g), "std": statistics.stdev(g) if len(g) > 1 else 0.0, "seeds": len(g)}
               for name, g in policies.items()}
        for frac, policies in sorted(out.items(), key=lambda kv: float(kv[0]))
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--noise-floor", action="store_true", help="only all-bf16 and all-fp4 runs")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    s = QUICK if args.quick else FULL
    work = Path(os.environ.get("SNIP_BENCH_DIR", "/tmp/snip_compare"))
    work.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    ckpt, rel_error = pretrain(s, work)
    print(f"# pretrained {s.pretrain_steps} steps in {time.perf_counter() - start:.0f} s", flush=True)
    jobs = _jobs(args.noise_floor, args.seeds)
    rows = []
    ctx = multiprocessing.get_context("spawn")
    with futures.ProcessPoolExecutor(args.workers, mp_context=ctx) as pool:
        pending = [pool.submit(run_one, s, str(ckpt), p, f, seed, rel_error, str(work)) for p, f, seed in jobs]
        for fut in futures.as_completed(pending):
            row = fut.result()
            rows.append(row)
            print(f"{row['policy']:<12} frac {row['fraction']:.2f} seed {row['seed']} eval {row['eval_loss']:.4f} "
                  f"achieved {row['achieved_fraction']:.3f} plans {row['plans']} {row['seconds']:.0f}s", flush=True)
    summary = summarize(rows)
    total = time.perf_counter() - start
    bf16_std = statistics.stdev([r["eval_loss"] for r in rows if r["policy"] == "all_bf16"]) if args.seeds > 1 else 0.0
    fp4_gap = summary["1.0"]["all_fp4"]["mean"]
    date = datetime.date.today().isoformat()
    command = "python benchmarks/compare_policies.py " + " ".join(a for a in os.sys.argv[1:])
    header = [
        f"# compare_policies — {date}",
        f"command: `{command.strip()}`; {args.seeds} seeds; total {total / 60:.1f} min",
        f"machine: {platform.machine()} ({os.cpu_count()} cores), Python {platform.python_version()}; FP4 emulated",
        f"setup: {asdict(s)}",
        f"noise floor: bf16 eval-loss std over seeds {bf16_std:.5f}; all-fp4 gap {fp4_gap:.5f} "
        f"({fp4_gap / bf16_std if bf16_std else float('inf'):.1f}x the std; needs >= 5x)",
        "",
        "| fraction | policy | gap to bf16 (mean) | std | seeds |",
        "|---|---|---|---|---|",
    ]
    for frac, policies in summary.items():
        for name, v in sorted(policies.items(), key=lambda kv: kv[1]["mean"]):
            header.append(f"| {frac} | {name} | {v['mean']:+.5f} | {v['std']:.5f} | {v['seeds']} |")
    print("\n".join(header))
    if args.quick or args.noise_floor:
        return
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "compare_policies.json").write_text(json.dumps(summary, indent=2))
    (args.out / f"compare_policies_{date}.md").write_text("\n".join(header) + "\n\n![gap vs fraction](compare_policies.png)\n")
    (args.out / "compare_policies_runs.json").write_text(json.dumps(rows, indent=1))
    plot(summary, args.out / "compare_policies.png")


def plot(summary: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for name in FRACTION_POLICIES:
        xs = [float(f) for f in summary if name in summary[f]]
        ax.errorbar(xs, [summary[f"{x:g}"][name]["mean"] for x in xs], yerr=[summary[f"{x:g}"][name]["std"] for x in xs],
                    marker="o", capsize=3, label=name)
    for name, frac in (("all_fp8", "0.0"), ("all_fp4", "1.0")):
        if frac in summary and name in summary[frac]:
            ax.errorbar([float(frac)], [summary[frac][name]["mean"]], yerr=[summary[frac][name]["std"]], marker="s", label=name)
    ax.axhline(0.0, color="gray", lw=0.8)
    ax.set_xlabel("FP4 FLOPs fraction")
    ax.set_ylabel("eval loss gap to bf16")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
