"""Quality v4 (issue 52): the SmolLM2 protocol over 4x the horizon, SNIP as it ships, and the gap's trajectory.

The setting is compare_policies' ``smollm2_long``: SmolLM2-135M-Instruct continued for 64 steps of 4 x 128 tokens
(16 in quality v3) from the same 4-step checkpoint, so the oracle's truths are v3's (copied from its committed cache
when the regenerated checkpoint has the same fingerprint). Policies at FP4 fraction 0.75 of the whole model's linear
FLOPs: SNIP at the library's defaults (per GEMM, and per layer; the rounds' rows CPU-sized, 256, and per GEMM also at
the library's max_rows, which takes the whole batch here), the best fixed rules of v3 (industry_tail,
layer_type_edges_gemm), the industry rule per GEMM with the backwards first (industry_tail_gemm: forwards stay in
FP8 as long as the target allows), the per-GEMM oracle, and all_fp8 / all_bf16. Every run is appended to the cache
(``--store``) as it ends and reused, so the benchmark resumes across sessions; ``--policies`` stages runs.

    python benchmarks/quality_long.py --seeds 5 --workers 1                # runs what the cache lacks, then reports
    python benchmarks/quality_long.py --seeds 5 --cached-only              # an interim report from the cache
    python benchmarks/quality_long.py --quick                              # a tiny check, nothing written

Reports (benchmarks/results/): compare_policies_smollm2_long.json (v2's shape plus "trajectory"), the dated
markdown table with paired differences and t values, the trajectory plot, the runs.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import compare_policies as cp  # the script's own folder is on the path, as for every benchmark
from harness import bench_dir

SETTING = "smollm2_long"
SNIP = "snip_gemm+defaults"  # the product as it ships (granularity gemm is the default)
SNIP_LAYER = "snip+defaults"
# SNIP with the library's max_rows (1024: here the whole batch of 4 x 128 tokens, 4 samples) instead of the setting's
# CPU-sized 256 (2 samples): the first round's sample as a user's run takes it (added on 2026-12-04, after the other
# runs, when the plans' truth prices showed the first round's sampling noise).
SNIP_ROWS = "snip_gemm+defaults+rows1024"
SNIPS = (SNIP, SNIP_ROWS, SNIP_LAYER)
RULES = ("industry_tail", "layer_type_edges_gemm", "industry_tail_gemm")
POLICIES = ("all_bf16", "all_fp8", SNIP, SNIP_ROWS, SNIP_LAYER) + RULES + ("oracle_gemm",)


def jobs(fraction: float, seeds: int, policies=POLICIES) -> list[tuple[str, float, int]]:
    """Seed by seed, so that a cut-off session leaves whole seeds of the policies it ran."""
    return [(p, 0.0 if p.startswith("all_") else fraction, seed) for seed in range(seeds) for p in policies]


def seed_truths(store: Path, measured: dict) -> None:
    """Copy v3's truth parts into ``store`` when this checkpoint is v3's (same fingerprint): the oracle's truths
    are a property of the checkpoint, not of the horizon (1550 s on this machine, not measured again)."""
    v3 = cp.RESULTS / "compare_policies_smollm2_cache"
    parts, theirs = store / "truth_parts.json", v3 / "measured.json"
    if parts.exists() or not theirs.exists() or not (v3 / "truth_parts.json").exists():
        return
    if cp.same_checkpoint(measured["fingerprint"], json.loads(theirs.read_text())["measured"]["fingerprint"]):
        shutil.copy(v3 / "truth_parts.json", parts)
        print(f"# truths: v3's parts reused (same checkpoint, fingerprint {measured['fingerprint']})", flush=True)


def trajectories(rows: list[dict]) -> dict:
    """{policy: {step: {seed: gap to the seed's all_bf16 at that step}}} from the runs' trajectories."""
    bf16 = {r["seed"]: dict((int(s), v) for s, v in r["trajectory"]) for r in rows if r["policy"] == "all_bf16"}
    out: dict = {}
    for r in rows:
        if r["seed"] not in bf16:
            continue
        for step, loss in r["trajectory"]:
            out.setdefault(r["policy"], {}).setdefault(int(step), {})[r["seed"]] = loss - bf16[r["seed"]][int(step)]
    return out


def _stats(values: list[float]) -> tuple[float, float, float]:
    """(mean, std, t) of a list; std and t nan under two values."""
    mean = statistics.fmean(values)
    sd = statistics.stdev(values) if len(values) > 1 else math.nan
    return mean, sd, mean / (sd / math.sqrt(len(values))) if len(values) > 1 and sd > 0 else math.nan


def lead(traj: dict, snip: str, rule: str, step: int) -> dict[int, float]:
    """Seed -> the rule's gap minus SNIP's at ``step`` (positive: SNIP ahead), over the seeds both ran."""
    a, b = traj.get(snip, {}).get(step, {}), traj.get(rule, {}).get(step, {})
    return {seed: b[seed] - a[seed] for seed in a if seed in b}


def report(rows: list[dict], s: cp.Setup) -> tuple[list[str], dict]:
    """The markdown lines and the JSON trajectory summary."""
    summary = cp.summarize(rows)
    traj = trajectories(rows)
    steps = sorted({step for p in traj.values() for step in p})
    lines = cp.table(summary) + [""]
    final = next(iter(v for k, v in summary.items() if k != "0.0"), {})
    rules = {p: final[p] for p in RULES if p in final}
    best = min(rules, key=lambda p: rules[p]["mean"]) if rules else None
    # the middle of the horizon: the step nearest half the last (32 of 16..64)
    middle = min(steps[:-1], key=lambda st: abs(st - steps[-1] / 2)) if len(steps) > 1 else None
    for snip in SNIPS + ("oracle_gemm",):  # the oracle: what SNIP's ILP makes of the truths (its estimates' ceiling)
        if best is None or snip not in final:
            continue
        mean, sd, t, n = cp.paired(rules[best], final[snip])
        tag = "oracle" if snip.startswith("oracle") else "snip"
        lines.append(f"    {tag}_vs_best_rule {snip} {mean:+.5f} better than {best} (paired over {n} seeds: std of the "
                     f"differences {sd:.5f}, {mean / sd if sd else math.nan:.1f} std, t {t:.1f}; target > 2 std)")
        for rule in rules:
            m, sd_, t_, n_ = cp.paired(rules[rule], final[snip])
            lines.append(f"      vs {rule}: {m:+.5f} ± {sd_:.5f} (t {t_:.1f}, {n_} seeds, ahead on "
                         f"{sum(d > 0 for d in lead(traj, snip, rule, steps[-1]).values())})")
        if middle is not None:
            mid, end = lead(traj, snip, best, middle), lead(traj, snip, best, steps[-1])
            growth = [end[k] - mid[k] for k in end if k in mid]
            if growth:
                g, gsd, gt = _stats(growth)
                lines.append(f"    lead_growth {snip} vs {best}: step {middle} {_stats(list(mid.values()))[0]:+.5f} -> "
                             f"step {steps[-1]} {_stats(list(end.values()))[0]:+.5f}; end minus middle {g:+.5f} ± "
                             f"{gsd:.5f} (t {gt:.1f}; target: no smaller at the end)")
    out = {p: {str(step): dict(zip(("mean", "std", "t"), _stats(list(g.values()))), seeds=list(g.values()),
                               seed_ids=list(g)) for step, g in sorted(by_step.items())}
           for p, by_step in sorted(traj.items())}
    lines += ["", "Gap to bf16 (high-precision held-out loss) along the continuation, mean ± std over seeds:", "",
              "| policy | " + " | ".join(f"step {st}" for st in steps) + " |", "|---|" + "---|" * len(steps)]
    for p in POLICIES:
        if p in out:
            lines.append(f"| {p} | " + " | ".join(f"{out[p][str(st)]['mean']:+.4f} ± {out[p][str(st)]['std']:.4f}"
                                                  if str(st) in out[p] else "" for st in steps) + " |")
    if best is not None:
        lines += ["", f"SNIP's lead over {best} (the best fixed rule at the end) per step, paired over seeds:", ""]
        for snip in SNIPS + ("oracle_gemm",):
            cells = [(st, _stats(list(lead(traj, snip, best, st).values()))) for st in steps
                     if lead(traj, snip, best, st)]
            if cells:
                lines.append(f"    {snip}: " + ", ".join(f"step {st} {m:+.4f} ± {sd:.4f} (t {t:.1f})"
                                                         for st, (m, sd, t) in cells))
    return lines, out


def truth_prices(store: Path, measured: dict) -> dict | None:
    """The checkpoint's measured dict with the oracle's truths: this run's, the store's, or v3's (same checkpoint)."""
    if "truths" in measured:
        return measured
    for path in (store / "measured.json", cp.RESULTS / "compare_policies_smollm2_cache" / "measured.json"):
        theirs = json.loads(path.read_text())["measured"] if path.exists() else {}
        if "truths" in theirs and cp.same_checkpoint(measured["fingerprint"], theirs["fingerprint"]):
            return theirs
    return None


def plan_prices(rows: list[dict], measured: dict) -> list[str]:
    """Each run's plan priced with the checkpoint's truths (the ILP's objective at the oracle's lambda: what a
    plan should cost by the oracle's measurements), beside its gap at the end, per seed; then compare_policies'
    objective-vs-gap Spearman over the runs. A SNIP plan comes from its seed's own sample, so its price varies
    by seed; a fixed rule's does not."""
    lam = cp.oracle_lambda("oracle")
    bf16 = {r["seed"]: r["eval_loss"] for r in rows if r["policy"] == "all_bf16"}
    lines = ["", f"Plans priced by the checkpoint's truths (ILP objective at lambda {lam:g}; lower is better) and "
             "their gap to bf16 at the end, per seed:", "", "| policy | objective per seed | gap per seed |", "|---|---|---|"]
    for p in POLICIES:
        runs = sorted((r for r in rows if r["policy"] == p and r.get("plan") and r["seed"] in bf16),
                      key=lambda r: r["seed"])
        if runs and 0 < runs[0]["fraction"] < 1:
            lines.append(f"| {p} | " + " ".join(f"{cp.plan_objective(r['plan'], measured['truths'], lam):.4f}"
                                                 for r in runs)
                         + " | " + " ".join(f"{r['eval_loss'] - bf16[r['seed']]:+.4f}" for r in runs) + " |")
    return lines + [""] + cp.objective_study(rows, measured)


def snip_solver(s: cp.Setup, fraction: float):
    """estimates -> the plan SNIP's ILP makes of them in this setting (per GEMM, the whole model's target, SNIP's
    lambda), on the continuation model's layers: as compare_policies plans the oracle."""
    from lightning_snip import planner

    module = cp.run_module(s, continuation=True)
    return lambda estimates: planner.solve_gemm_plan(cp.plan_candidates(module, estimates, s.candidates),
                                                     fp4_fraction=fraction,
                                                     weight_divergence_weight=cp.oracle_lambda("oracle"))


def estimate_ranks(runs: dict[int, dict], measured: dict) -> str:
    """Per seed, how SNIP's first round ranks the (layer, FP4 format) truths: Spearman of its LD and of its WD
    with the checkpoint's, beside the truths' own split-half ceiling (compare_policies' measured["ceilings"])."""
    from scipy.stats import spearmanr

    truths, cells = measured["truths"], {}
    for metric, short in (("loss_divergence", "LD"), ("weight_divergence", "WD")):
        for seed, r in sorted(runs.items()):
            est = r["estimates"][metric]
            keys = [k for k in est if k.partition("|")[2].startswith(("mxfp4", "nvfp4")) and k in truths[metric]
                    and math.isfinite(est[k]) and math.isfinite(truths[metric][k])]
            rho = float(spearmanr([est[k] for k in keys], [truths[metric][k] for k in keys]).statistic) \
                if len(keys) > 1 else math.nan
            cells.setdefault(short, []).append(f"{rho:+.2f}")
    # The truths' own noise: their split-half Spearman r per FP4 format (LD only; WD's truths have one rounding
    # seed here, no split); an estimate without error would rank the whole truths at about sqrt(2r / (1 + r)).
    halves = {k.partition("_")[2]: v for k, v in measured.get("ceilings", {}).items()
              if k.startswith("loss_") and k.partition("_")[2] in ("mxfp4", "nvfp4") and math.isfinite(v)}
    return ("SNIP's first round against the truths, Spearman over the (layer, FP4 format) pairs, per seed: " + "; ".join(
        f"{short} {' '.join(v)}" for short, v in cells.items()) + "".join(
        f" (LD truths' split-half Spearman on {f} {r:.2f}: an error-free estimate would reach about "
        f"{math.sqrt(2 * r / (1 + r)) if r > 0 else math.nan:.2f})" for f, r in halves.items()))


def pooled_plans(rows: list[dict], measured: dict, solve, fraction: float) -> list[str]:
    """SNIP's plan from more rounds than one, offline: the SNIP runs' first rounds (one per seed, each on its seed's
    batch at the checkpoint) averaged over every subset of k seeds, solved as SNIP solves (``solve``: estimates ->
    plan) and priced by the checkpoint's truths, beside the oracle's plan (the truths' own minimum) and the fixed
    rules' plans. k = 1 re-solves each run's own round (and says whether that gives the run's plan); a larger k
    stands for a plan made from k rounds on k batches. No training: what a second round could buy, priced by the
    objective whose rank the runs' gaps follow (objective_vs_gap above)."""
    from itertools import combinations

    lam = cp.oracle_lambda("oracle")
    runs = {r["seed"]: r for r in rows if r["policy"] == SNIP and r.get("estimates") and r["fraction"] == fraction}
    if len(runs) < 2:
        return []
    seeds = sorted(runs)

    def names(plan) -> dict[str, str]:  # a solved Plan's formats as the runs store them (names)
        return {k: getattr(f, "value", f) for k, f in plan.items()}

    def price(plan) -> float:
        return cp.plan_objective(names(plan), measured["truths"], lam)

    def mean_estimates(subset):
        """Each key's mean over the subset's finite values (as SNIP's aggregate skips a round's non-finite one);
        inf where none is finite (a pinned layer's other formats, an invalid format: the planner excludes them)."""
        out = {}
        for metric in ("loss_divergence", "weight_divergence"):
            keys = dict.fromkeys(k for s in subset for k in runs[s]["estimates"][metric])
            values = {k: [v for s in subset if math.isfinite(v := runs[s]["estimates"][metric].get(k, math.inf))]
                      for k in keys}
            out[metric] = {k: statistics.fmean(v) if v else math.inf for k, v in values.items()}
        return out

    lines = ["", f"SNIP's plan from k rounds (the first rounds of k seeds' runs averaged, solved as SNIP solves at "
             f"{fraction:g}), priced by the checkpoint's truths (lambda {lam:g}; lower is better), mean over the "
             "subsets of seeds:", "", "| rounds k | subsets | objective mean ± std | min - max |", "|---|---|---|---|"]
    same = 0
    for k in range(1, len(seeds) + 1):
        prices = []
        for subset in combinations(seeds, k):
            plan = solve(mean_estimates(subset))
            prices.append(price(plan))
            if k == 1:
                same += names(plan) == runs[subset[0]]["plan"]
        sd = statistics.stdev(prices) if len(prices) > 1 else 0.0
        lines.append(f"| {k} | {len(prices)} | {statistics.fmean(prices):.4f} ± {sd:.4f} | "
                     f"{min(prices):.4f} - {max(prices):.4f} |")
    lines.append("")
    lines.append(estimate_ranks(runs, measured))
    lines.append(f"k = 1 re-solved gives the run's own plan on {same} of {len(seeds)} seeds (runs that applied one plan: "
                 f"{sum(r.get('plans', 1) == 1 for r in runs.values())}); the oracle's plan (solved on "
                 f"the truths) costs {price(solve(measured['truths'])):.4f}" + "".join(
                     f"; {p} {cp.plan_objective(r['plan'], measured['truths'], lam):.4f}"
                     for p in RULES for r in rows if r["policy"] == p and r.get("plan") and r["seed"] == seeds[0]))
    return lines


def wall_times(rows: list[dict]) -> str:
    by: dict[str, list[float]] = {}
    for r in rows:
        by.setdefault(r["policy"], []).append(r["seconds"])
    return "wall time per run (fit without the trajectory's evaluations, 1 thread; mean over seeds): " + ", ".join(
        f"{p} {statistics.fmean(v):.0f} s" for p, v in sorted(by.items(), key=lambda kv: POLICIES.index(kv[0])
                                                             if kv[0] in POLICIES else 99))


def plot(traj: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for p in POLICIES:
        if p not in traj or p == "all_bf16":
            continue
        xs = sorted(int(k) for k in traj[p])
        ax.errorbar(xs, [traj[p][str(x)]["mean"] for x in xs], yerr=[traj[p][str(x)]["std"] for x in xs], marker="o",
                    capsize=3, label=p, ls="-" if p.startswith("snip") else "--")
    ax.axhline(0.0, color="gray", lw=0.8)
    ax.set_xlabel("continuation step (4 x 128 tokens each)")
    ax.set_ylabel("held-out loss gap to bf16 (high precision)")
    ax.set_title("SmolLM2-135M continued, FP4 fraction 0.75")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--fraction", type=float, default=0.75)
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--policies", nargs="+", choices=POLICIES, help="run only these (all_bf16 always runs)")
    parser.add_argument("--cached-only", action="store_true", help="run nothing: report the seeds the cache completes")
    parser.add_argument("--quick", action="store_true", help="a tiny setting, 1 seed, in a temporary store")
    parser.add_argument("--store", type=Path, default=cp.RESULTS / f"compare_policies_{SETTING}_cache")
    parser.add_argument("--out", type=Path, default=cp.RESULTS)
    args = parser.parse_args()
    s = cp.SETTINGS[SETTING]
    if args.quick:
        s = dataclasses.replace(cp.SETTINGS["smollm2_quick"], continue_steps=4, trajectory_every=2)
        args.seeds, args.store = 1, Path(tempfile.mkdtemp(prefix="quality_long_"))
    work = bench_dir("quick_long" if args.quick else SETTING)
    args.store.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    ckpt, measured = cp.prepare(s, work, args.store, truths=False)
    cp.release_memory()
    seed_truths(args.store, measured)

    def truths():
        module, optimizer, data = cp.from_checkpoint(s, ckpt)
        model, layers = cp.truth_model(s, module)
        measured.update(cp.measure_truths(s, model, optimizer, layers, data, parts=args.store / "truth_parts.json",
                                          chunk=30))
        (args.store / "measured.json").write_text(json.dumps({"setting": cp.setting_record(s), "measured": measured}))

    todo = jobs(args.fraction, args.seeds, POLICIES if not args.policies else
                [p for p in POLICIES if p in set(args.policies) | {"all_bf16"}])
    rows = cp.run_jobs(s, ckpt, measured, todo, args.store, args.workers, work, truths, args.cached_only)
    if args.cached_only:
        rows = cp.complete_seeds(rows, todo)
    lines, traj = report(rows, s)
    prices = truth_prices(args.store, measured)
    if prices is not None:
        lines += plan_prices(rows, prices)
        lines += pooled_plans(rows, prices, snip_solver(s, args.fraction), args.fraction)
    date = datetime.date.today().isoformat()
    head = [f"# Quality v4 (issue 52): SmolLM2 over 4x the horizon — {date}",
            f"command: `python benchmarks/quality_long.py {' '.join(sys.argv[1:])}`; machine: {platform.machine()} "
            f"({os.cpu_count()} cores), Python {platform.python_version()}; FP4 emulated",
            f"setting: {dataclasses.asdict(s)}", f"seeds with every policy's run: {sorted({r['seed'] for r in rows})}",
            f"wall {time.perf_counter() - start:.0f} s (this invocation)", wall_times(rows), ""]
    print("\n".join(head + lines), flush=True)
    if args.quick:
        return
    bf16 = [r["eval_loss"] for r in sorted(rows, key=lambda r: r["seed"]) if r["policy"] == "all_bf16"]
    noise = {"bf16_eval_loss_mean": statistics.fmean(bf16), "bf16_eval_loss_std": statistics.stdev(bf16)
             if len(bf16) > 1 else None, "seeds": bf16}
    prefix = cp.results_prefix(SETTING)
    (args.out / f"{prefix}.json").write_text(json.dumps(dict(cp.summarize(rows), noise_floor=noise, trajectory=traj),
                                                        indent=2))
    (args.out / f"{prefix}_runs.json").write_text(json.dumps({"setting": dataclasses.asdict(s), "rows": rows}, indent=1))
    (args.out / f"{prefix}_{date}.md").write_text("\n".join(head + lines) + "\n")
    plot(traj, args.out / f"{prefix}.png")


if __name__ == "__main__":
    main()
