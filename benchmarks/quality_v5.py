"""Quality v5 (issue 65): SNIP as it ships against the NVFP4 recipe a user would pick, on SmolLM2-135M.

Registered on 2026-12-06, before any run of this script (the verdicts below are the ones reported; anything added
after seeing the data is reported as such, beside them, never in their place):

- Protocol (compare_policies' ``smollm2_v5`` setting): SmolLM2-135M-Instruct continued from quality v4's 4-step
  checkpoint for 64 steps of 4 x 128 tokens (lr 3e-4, cosine to 0.1x; the held-out loss in high precision over 16
  batches every 16 steps and at the end). SNIP exactly as it ships (``snip_gemm+ships``): every SNIPConfig default
  (candidates fp8 / nvfp4 with the recipe's numerics, per-GEMM plans, the target on the switchable layers, max_rows
  1024, which takes the whole 512-row batch, the overhead budget, the first-order sample, the spike guard and the plan
  canary on, the LM head pinned to bf16) but one the CPU forces: warmup_steps 16, not 50. A CPU step costs ~8 s, and
  50 steps of warm-up would leave 14 of the 64 steps under a plan; 16 is the shortest warm-up under which the budget's
  first-order sample keeps its shipped size (8 steps: min(first_order_steps, 8, warmup // 2)). SNIP's schedule runs
  from the checkpoint as in a user's run resumed without SNIP's state: the first-order sample on continuation steps
  8-15, the first round at step 16, its plan from step 17 on (48 steps under plans), later rounds where the budget
  puts them. Every fixed FP4 policy trains in SNIP's initial format (fp8) until that step and applies its plan there
  (compare_policies.late_plan_step); all_bf16 and all_fp8 run their format throughout.
  (Correction, 2026-12-07, from the code review before any verdict: counted from 1, the first round runs on the 17th
  continuation step and plans act from the 18th, so 47 of the 64 steps are under plans (a 50-step warm-up would have
  left 13); the trajectory's "step 16" is after 16 steps, the last point before any plan. With the default interval
  (100) no later round falls within the run: SNIP plans once.)
- Policies: all_bf16, all_fp8 (the references: quality v4's cached runs of the same checkpoint, seeds and horizon;
  this code's all_bf16 of seed 0 is run again as the reproduction check), ``nvfp4_recipe`` (its BF16 blocks, its
  natural FP4 share), SNIP at that share of the switchable layers, SNIP at the default 0.75, the best two per-GEMM rules
  of v4 (layer_type_edges_gemm, industry_tail_gemm) on nvfp4 at 0.75, and the per-GEMM oracle at 0.75 (SNIP's ILP on
  the checkpoint's truths: nvfp4's measured here with the recipe's numerics, fp8's v4's, same batches). Every FP4 GEMM
  is nvfp4 with the library's recipe defaults. Seeds 0-4: a seed fixes the data order and the rounding streams and
  is shared by every policy, so the end losses pair by seed.
- Verdicts: (a) SNIP at the recipe's share vs nvfp4_recipe: the paired lead at the end (the recipe's held-out loss
  minus SNIP's, per seed) > 2 paired std over 5 seeds; (b) SNIP at 0.75 vs nvfp4_recipe: no worse within 1 paired
  std (lead >= -1 std) while its plan puts more of the switchable FLOPs in FP4; (c) per seed, the share of the
  oracle's lead over the better of the two rules (by mean end gap) that SNIP at 0.75 captures.
  Known before the runs (the --quick check on SmolLM2's layers): the recipe's natural share is 0.833 of the switchable
  layers (0.658 of the model: SmolLM2's first 1 and last 4 of 30 blocks in BF16, by the paper's 2/62 and 8/62 of the depth), above the default 0.75, so (b)'s
  "more FLOPs in FP4" fails by construction on this model. Registered beside it, also before the runs: (b') the same
  lead condition while SNIP's plan costs less by the library's GEMM cost model (bf16 = 1; SNIP's non-FP4 GEMMs are
  fp8, the recipe's bf16: 0.468 against 0.517 in the check). (b) is reported as worded; (b') is the trade a user
  weighs on this model.

The second family (issue 65, Deliver 4; registered on 2026-12-06 before its runs): ``--model gemma3`` runs the same
protocol on Gemma 3 270M (compare_policies' ``gemma3_v5``: the ``gemma3`` setting's checkpoint, 2 SR seeds for WD's
truths) at seeds 0-2, with its own all_bf16 / all_fp8 runs and truths (nvfp4's shared with benchmarks/second_family.py,
fp8's measured here); verdicts (a) and (c) as above, at 3 seeds ((a) is then "> 2 paired std over 3 seeds").

    python benchmarks/quality_v5.py --workers 2        # runs what the cache lacks (resumes across sessions), reports
    python benchmarks/quality_v5.py --cached-only      # an interim report from the cache
    python benchmarks/quality_v5.py --quick            # a tiny check in a temporary store, nothing written

Writes benchmarks/results/compare_policies_smollm2_v5.json (v2's shape plus "trajectory" and "verdicts"),
compare_policies_smollm2_v5_runs.json, compare_policies_smollm2_v5_<date>.md and compare_policies_smollm2_v5.png; runs
are cached in compare_policies_smollm2_v5_cache/rows.jsonl as they end.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import json
import math
import statistics
import tempfile
import time
from pathlib import Path

import compare_policies as cp  # the script's own folder is on the path, as for every benchmark
from harness import bench_dir, machine_line
from quality_long import estimate_ranks

# model -> (its compare_policies setting, default seeds, the folder of its checkpoint under SNIP_BENCH_DIR, its title)
MODELS = {"smollm2": ("smollm2_v5", 5, "smollm2_long", "SmolLM2-135M"),  # (v4's checkpoint: the same pretraining)
          "gemma3": ("gemma3_v5", 3, "gemma3", "Gemma 3 270M")}  # (second_family's checkpoint)
SECOND_FAMILY_STORE = cp.RESULTS / "second_family_cache"  # Gemma 3's nvfp4 truths, by part (issue 64, Deliver 3)
SNIP = "snip_gemm+ships"
RECIPE = "nvfp4_recipe"
RULES = ("layer_type_edges_gemm", "industry_tail_gemm")
ORACLE = "oracle_gemm"
FRACTION = 0.75
V4_STORE = cp.RESULTS / "compare_policies_smollm2_long_cache"  # quality v4: the references' runs, fp8's truths


def recipe_share(s: cp.Setup) -> float:
    """nvfp4_recipe's natural FP4 share as a share of the switchable layers' FLOPs (SNIP's target at that share)."""
    from lightning_snip.evidence import switchable_share

    return round(switchable_share(cp.natural_fractions(s)[RECIPE], _gemm_items(s)[0]), 6)


def after_oracle(todo: list[tuple[str, float, int]], model: str) -> list[tuple[str, float, int]]:
    """The jobs of ``todo`` run after the oracle's (run_jobs runs every other job before the truths the oracle
    needs): Gemma 3's all_fp8, which no verdict of its needs (its truths take ~2 h on 2 cores)."""
    return [job for job in todo if model == "gemma3" and job[0] == "all_fp8"]


def heavy_jobs(model: str):
    """Which jobs run one at a time (compare_policies.next_job): Gemma 3's SNIP runs, whose statistics rounds took a
    worker to 11.5 GB (2026-12-07: two of them at once were killed for memory on 24 GB; a fixed plan's run took
    ~7.8 GB). None elsewhere."""
    return (lambda job: job[0].startswith("snip")) if model == "gemma3" else None


def jobs(share: float, seeds: int, model: str = "smollm2") -> list[tuple[str, float, int]]:
    """In the order the verdicts need them (the pool runs them in this order; a cut-off session leaves whole
    verdicts): SmolLM2: (a) and (b) seed by seed, then the rules, the reproduction check, and the oracle (after its
    truths); Gemma 3: (a) seed by seed, then all_bf16 (the gaps' reference: no verdict needs it), SNIP at 0.75 and
    the rules, the oracle, and all_fp8 (context: neither of its verdicts needs it; run after the oracle's truths and
    runs, see after_oracle). (A run takes 16-27 min there on 2 cores, two at a time: verdict (a) first fits a
    session.)"""
    if model == "gemma3":
        out = [(p, share, seed) for seed in range(seeds) for p in (RECIPE, SNIP)]
        out += [("all_bf16", 0.0, seed) for seed in range(seeds)]
        out += [(p, FRACTION, seed) for seed in range(seeds) for p in (SNIP,) + RULES]
        out += [(ORACLE, FRACTION, seed) for seed in range(seeds)]
        return out + [("all_fp8", 0.0, seed) for seed in range(seeds)]
    out = [("all_bf16", 0.0, 0)]  # the reproduction check first: its failure means every reference is run here
    out += [(p, f, seed) for seed in range(seeds) for p, f in ((RECIPE, share), (SNIP, share), (SNIP, FRACTION))]
    out += [(rule, FRACTION, seed) for seed in range(seeds) for rule in RULES]
    return out + [(ORACLE, FRACTION, seed) for seed in range(seeds)]


def reference_jobs(seeds: int) -> list[tuple[str, float, int]]:
    """Every seed's all_bf16 and all_fp8: the references run here where quality v4's cannot serve."""
    return [(p, 0.0, seed) for seed in range(seeds) for p in ("all_bf16", "all_fp8")]


def _v4_references() -> dict[str, dict[int, dict]]:
    """Quality v4's all_bf16 / all_fp8 rows by seed (empty where its cache is missing)."""
    path = V4_STORE / "rows.jsonl"
    v4_rows = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    return {p: {r["seed"]: r for r in v4_rows if r["policy"] == p} for p in ("all_bf16", "all_fp8")}


def _seed0_agrees(mine: dict[int, dict], v4: dict[str, dict[int, dict]]) -> bool:
    return abs(mine[0]["eval_loss"] - v4["all_bf16"][0]["eval_loss"]) <= 1e-4


def references(rows: list[dict], model: str = "smollm2") -> tuple[dict[str, dict[int, dict]], str]:
    """{all_bf16 / all_fp8: {seed: row}} from quality v4's cache where this code's all_bf16 of seed 0 reproduces
    v4's within 1e-4 (else this code's runs alone), and a line saying which; Gemma 3: this code's runs."""
    mine = {r["seed"]: r for r in rows if r["policy"] == "all_bf16"}
    own = {"all_bf16": mine, "all_fp8": {r["seed"]: r for r in rows if r["policy"] == "all_fp8"}}
    if model != "smollm2":
        return own, "all_bf16 / all_fp8: this code's runs"
    v4 = _v4_references()
    if not v4["all_bf16"]:
        return own, "all_bf16: quality v4's cache missing (gaps from this code's runs)"
    if 0 not in mine:
        return v4, "all_bf16 / all_fp8: quality v4's runs (this code's seed-0 reproduction not run yet: provisional)"
    agree = _seed0_agrees(mine, v4)
    line = (f"all_bf16 seed 0: this code {mine[0]['eval_loss']:.5f}, quality v4's cache "
            f"{v4['all_bf16'][0]['eval_loss']:.5f} ({'agree' if agree else 'DIFFER'} within 1e-4)")
    return (v4 if agree else own), line


def reproduced(rows: list[dict], model: str) -> bool:
    """False where this code's all_bf16 of seed 0 ran and differs from quality v4's (SmolLM2's references)."""
    mine = {r["seed"]: r for r in rows if r["policy"] == "all_bf16"}
    if model != "smollm2" or 0 not in mine:
        return True
    v4 = _v4_references()
    return not v4["all_bf16"] or _seed0_agrees(mine, v4)


def label(row: dict, share: float) -> str:
    """A run's name in the tables: SNIP's by its target (the same policy at two fractions)."""
    if row["policy"] != SNIP:
        return row["policy"]
    return "snip@recipe" if abs(row["fraction"] - share) < 1e-9 else f"snip@{row['fraction']:g}"


def by_label(rows: list[dict], share: float, bf16: dict[int, dict]) -> dict[str, dict[int, dict]]:
    out: dict[str, dict[int, dict]] = {}
    for r in rows:
        if r["seed"] in bf16 and r["policy"] != "all_bf16":
            out.setdefault(label(r, share), {})[r["seed"]] = r
    return out


def gaps(runs: dict[int, dict], bf16: dict[int, dict], step: int | None = None) -> dict[int, float]:
    """Seed -> held-out loss gap to all_bf16 (at the end, or at continuation ``step`` of the trajectory)."""
    def at(r):
        return r["eval_loss"] if step is None else dict((int(a), b) for a, b in r.get("trajectory", [])).get(step)

    return {seed: at(r) - at(bf16[seed]) for seed, r in runs.items()
            if seed in bf16 and at(r) is not None and at(bf16[seed]) is not None}


def paired(a: dict[int, float], b: dict[int, float]) -> tuple[float, float, float, list[int]]:
    """(mean, std, t, seeds) of a[seed] - b[seed] over the seeds both have."""
    seeds = sorted(set(a) & set(b))
    diffs = [a[k] - b[k] for k in seeds]
    if not diffs:
        return math.nan, math.nan, math.nan, []
    mean = statistics.fmean(diffs)
    sd = statistics.stdev(diffs) if len(diffs) > 1 else math.nan
    t = mean / (sd / math.sqrt(len(diffs))) if len(diffs) > 1 and sd > 0 else math.nan
    return mean, sd, t, seeds


def per_gemm(plan: dict[str, str]) -> dict[str, str]:
    """A stored plan with its per-layer keys (nvfp4_recipe's) split into the layer's two GEMM directions."""
    from lightning_snip.plan import BACKWARD, FORWARD, gemm_key, split_key

    return {key: fmt for k, f in plan.items() for key, fmt in (
        ((k, f),) if split_key(k)[1] is not None else ((gemm_key(k, FORWARD), f), (gemm_key(k, BACKWARD), f)))}


@functools.lru_cache(maxsize=4)
def _gemm_items(s: cp.Setup) -> tuple[list, dict]:
    """(the planner's candidates, {GEMM key: its item}) of the setting's model: built once (a model copy each)."""
    from lightning_snip.planner import gemm_items

    candidates = cp.plan_candidates(cp.run_module(s, continuation=True), None, s.candidates)
    return candidates, {c.fqn: c for c in gemm_items(candidates)}


def in_force(s: cp.Setup, row: dict) -> dict[str, str]:
    """The per-GEMM formats a run trained under after its plan step: its plan, or, where it applied none (a SNIP run
    whose round or solve failed), SNIP's initial fp8 everywhere but the pins."""
    if row.get("plan"):
        return per_gemm(row["plan"])
    return {key: item.pinned.value if item.pinned is not None else "fp8" for key, item in _gemm_items(s)[1].items()}


def switchable_fp4(s: cp.Setup, plan: dict[str, str]) -> float:
    """A per-GEMM plan's FP4 share of the switchable layers' FLOPs (the pinned head's left out)."""
    from lightning_snip.evidence import switchable_share
    from lightning_snip.plan import Plan

    candidates, items = _gemm_items(s)
    return switchable_share(Plan(formats=plan, flops={k: items[k].flops for k in plan}).fp4_fraction, candidates)


def plan_cost(s: cp.Setup, plan: dict[str, str]) -> float:
    """A per-GEMM plan priced by the library's cost model (Plan.relative_gemm_cost, bf16 = 1: the formats' costs and
    the RHT where the layer's recipe transforms the format's wgrad), as fp4_candidate.plan_cost prices it."""
    from lightning_snip.plan import Plan

    items = _gemm_items(s)[1]
    return Plan(formats=plan, flops={k: items[k].flops for k in plan},
                extra_cost={k: items[k].extra_cost for k in plan}).relative_gemm_cost


def verdicts(s: cp.Setup, runs: dict[str, dict[int, dict]], bf16: dict[int, dict], seeds_needed: int = 5,
             registered: tuple[str, ...] = ("a", "b", "b'", "c")) -> tuple[list[str], dict]:
    """The verdicts (a), (b), (b') and (c), as far as the runs go, each over the seeds its policies share; a verdict
    with fewer than ``seeds_needed`` seeds (the registered count) is not final, and one outside ``registered`` (this
    model's) is context. Returns the lines and their JSON."""
    lines, out = [], {}
    # (a), (b), (b') pair the end losses themselves (the registered lead: the recipe's held-out loss minus SNIP's,
    # where all_bf16 cancels): a seed counts once both policies ran it, before its all_bf16 has.
    def ends(policy: str) -> dict[int, float]:
        return {seed: r["eval_loss"] for seed, r in runs.get(policy, {}).items()}

    recipe = ends(RECIPE)

    def above(a: str, b: str, measure, seeds) -> bool:  # on every paired seed, a's plan above b's by ``measure``
        return all(measure(s, in_force(s, runs[a][k])) > measure(s, in_force(s, runs[b][k])) for k in seeds)

    def status(ok: bool, seeds: list[int], tag: str) -> str:
        if tag not in registered:
            return f"{'holds' if ok else 'does not hold'} (not registered for this model: context)"
        if len(seeds) < seeds_needed:
            return f"{'met' if ok else 'not met'} so far ({len(seeds)} of {seeds_needed} seeds: not final)"
        return "MET" if ok else "NOT MET"

    for tag, snip, need in (("a", "snip@recipe", "lead > 2 paired std"),
                            ("b", f"snip@{FRACTION:g}", "lead >= -1 paired std, more FP4"),
                            ("b'", f"snip@{FRACTION:g}", "lead >= -1 paired std, a lower GEMM cost")):
        snips = ends(snip)
        lead, sd, t, seeds = paired(recipe, snips)
        if not seeds:
            continue
        if tag == "a":
            ok = lead > 2 * sd
        elif tag == "b":  # more of the switchable FLOPs in FP4 than the recipe's plan, seed by seed
            ok = lead >= -sd and above(snip, RECIPE, switchable_fp4, seeds)
        else:  # the recipe's plan costs more GEMM time than SNIP's (the library's cost model), seed by seed
            ok = lead >= -sd and above(RECIPE, snip, plan_cost, seeds)
        ok = bool(ok) and len(seeds) > 1  # (one seed has no std)
        per = " ".join(f"{k}: {recipe[k] - snips[k]:+.4f}" for k in seeds)
        lines.append(f"verdict ({tag}) {snip} vs {RECIPE}: lead {lead:+.5f} ± {sd:.5f} ({lead / sd if sd else math.nan:.2f} "
                     f"std, t {t:.1f}, {len(seeds)} seeds; per seed {per}); registered: {need}: {status(ok, seeds, tag)}")
        out[tag] = {"snip": snip, "lead_mean": lead, "lead_std": sd, "t": t, "seeds": seeds, "met": ok,
                    "complete": len(seeds) >= seeds_needed, "registered": tag in registered}
    lines += capture(runs, bf16, seeds_needed, out)
    return lines, out


def capture(runs: dict[str, dict[int, dict]], bf16: dict[int, dict], seeds_needed: int, out: dict) -> list[str]:
    """Verdict (c): per seed, the share of the oracle's lead over the better rule (by mean end gap over the seeds
    every policy of the verdict ran) that SNIP at 0.75 captures; a seed where the oracle is not ahead of that rule
    has no share to capture (marked, left out of the means)."""
    gap = {p: gaps(runs.get(p, {}), bf16) for p in RULES + (ORACLE, f"snip@{FRACTION:g}")}
    seeds = sorted(set.intersection(*(set(g) for g in gap.values())))
    if not seeds:
        return []
    rule_means = {r: statistics.fmean(gap[r][k] for k in seeds) for r in RULES}
    best, snip, oracle = min(rule_means, key=rule_means.get), gap[f"snip@{FRACTION:g}"], gap[ORACLE]
    headroom = {k: gap[best][k] - oracle[k] for k in seeds}
    shares = {k: (gap[best][k] - snip[k]) / headroom[k] for k in seeds if headroom[k] > 0}
    cells = [f"{k}: {shares[k]:.2f}" if k in shares else f"{k}: none (oracle {-headroom[k]:+.4f} behind)" for k in seeds]
    mean_headroom = statistics.fmean(headroom.values())  # (a ratio over a headroom <= 0 has no meaning)
    whole = statistics.fmean(gap[best][k] - snip[k] for k in seeds) / mean_headroom if mean_headroom > 0 else None
    final = "" if len(seeds) >= seeds_needed else f" ({len(seeds)} of {seeds_needed} seeds: not final)"
    out["c"] = {"best_rule": best, "seeds": seeds, "shares": shares, "headroom": headroom,
                "ratio_of_means": whole, "complete": len(seeds) >= seeds_needed}
    return [f"verdict (c) share of the oracle's lead over {best} (the better rule over these seeds) captured by "
            f"snip@{FRACTION:g}, per seed: " + "; ".join(cells) + f"{final}; beside it, not registered: the ratio "
            "of the mean leads " + (f"{whole:.2f}" if whole is not None else
                                    f"undefined (the oracle {-mean_headroom:+.4f} behind {best} on the mean)")]


ORDER = ("all_fp8", RECIPE, "snip@recipe", f"snip@{FRACTION:g}") + RULES + (ORACLE,)


def run_table(s: cp.Setup, runs: dict[str, dict[int, dict]], bf16: dict[int, dict], truths: dict | None) -> list[str]:
    """Per policy, seed by seed (in seed order): its end gap, its plan's FP4 share of the switchable layers, its GEMM
    cost by the library's cost model (bf16 = 1), its plan's truth price (where the truths are measured), plans
    applied and reverts; a fixed policy's plan is the same on every seed (one value shown). A policy's mean ± std is
    over its own seeds (the verdicts pair by seed)."""
    lam = cp.oracle_lambda(ORACLE)
    lines = ["| policy | gap to bf16 at the end, mean ± std | seeds | gap per seed | FP4 share (switchable) | GEMM cost "
             f"(bf16 = 1) | truth price (λ {lam:g}) | plans | reverts | first plan at step | CPU s (mean) |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for name in ORDER:
        got = runs.get(name, {})
        g = gaps(got, bf16)
        if not g:
            continue
        seeds = sorted(g)
        rows, values = [got[k] for k in seeds], [g[k] for k in seeds]
        sd = statistics.stdev(values) if len(values) > 1 else math.nan
        plans = [in_force(s, r) for r in rows]
        shown = plans if name.startswith("snip") else plans[:1]
        price = " ".join(f"{cp.plan_objective(p, truths, lam):.4f}" for p in shown) if truths else ""
        starts = sorted({r.get("first_plan_step") for r in rows if r.get("first_plan_step") is not None})
        lines.append(f"| {name} | {statistics.fmean(values):+.4f} ± {sd:.4f} | {' '.join(map(str, seeds))} | "
                     + " ".join(f"{v:+.4f}" for v in values)
                     + f" | {' '.join(f'{switchable_fp4(s, p):.3f}' for p in shown)} | "
                     + f"{' '.join(f'{plan_cost(s, p):.3f}' for p in shown)} | {price} | "
                     + " ".join(str(r["plans"]) for r in rows) + " | " + " ".join(str(r.get("reverts", 0)) for r in rows)
                     + f" | {starts} | {statistics.fmean(r['seconds'] for r in rows):.0f} |")
    return lines


def trajectory(runs: dict[str, dict[int, dict]], bf16: dict[int, dict]) -> tuple[list[str], dict]:
    """The gap to bf16 along the continuation (mean ± std over seeds), and SNIP's leads over the recipe per step."""
    steps = sorted({int(p[0]) for r in bf16.values() for p in r.get("trajectory", [])})
    out = {name: {str(st): gaps(got, bf16, st) for st in steps} for name, got in runs.items()}
    lines = ["| policy | " + " | ".join(f"step {st}" for st in steps) + " |", "|---|" + "---|" * len(steps)]
    for name in ORDER:
        if name in out:
            lines.append(f"| {name} | " + " | ".join(
                f"{statistics.fmean(v.values()):+.4f} ± {statistics.stdev(v.values()) if len(v) > 1 else 0:.4f}"
                if (v := out[name][str(st)]) else "" for st in steps) + " |")
    lines += ["", f"Leads over {RECIPE} per step (its gap minus SNIP's, paired over seeds):", ""]
    for snip in ("snip@recipe", f"snip@{FRACTION:g}"):
        cells = [(st, paired(out.get(RECIPE, {}).get(str(st), {}), out.get(snip, {}).get(str(st), {}))) for st in steps]
        cells = [(st, c) for st, c in cells if c[3]]
        if cells:
            lines.append(f"    {snip}: " + ", ".join(f"step {st} {m:+.4f} ± {sd:.4f} (t {t:.1f})"
                                                   for st, (m, sd, t, _) in cells))
    summary = {name: {st: {"mean": statistics.fmean(v.values()), "std": statistics.stdev(v.values()) if len(v) > 1
                           else None, "seeds": list(v.values()), "seed_ids": list(v)} for st, v in by.items() if v}
               for name, by in out.items()}
    return lines, summary


def _checked_store(path: Path, measured: dict, what: str) -> dict:
    """The measured dict another benchmark saved in ``path`` (measured.json) for this very checkpoint."""
    theirs = json.loads(path.read_text())["measured"]
    if not cp.same_checkpoint(measured["fingerprint"], theirs["fingerprint"]):
        raise RuntimeError(f"{path.parent.name}'s checkpoint differs from this one: its {what} do not apply")
    return theirs


def measure_truths(s: cp.Setup, ckpt: Path, measured: dict, store: Path, model_name: str = "smollm2") -> None:
    """The oracle's truths at the checkpoint, one format at a time, each part saved as it ends (resumable); added to
    ``measured`` and saved in ``store``/measured.json. SmolLM2: nvfp4's (with the recipe's numerics) measured here into
    ``store``/truth_parts.json, fp8's quality v4's (the same checkpoint, batches and SR seeds: not measured again).
    Gemma 3: nvfp4's in benchmarks/second_family.py's parts (the same truths, measured by whichever runs first), fp8's
    here."""
    module, optimizer, data = cp.from_checkpoint(s, ckpt)
    model, layers = cp.truth_model(s, module)

    def one(fmt: str, parts: Path, chunk: int) -> dict:
        return cp.measure_truths(dataclasses.replace(s, candidates=(fmt,)), model, optimizer, layers, data,
                                 parts=parts, chunk=chunk)

    if model_name == "smollm2":
        v4 = _checked_store(V4_STORE / "measured.json", measured, "fp8 truths")
        fp8 = {"truths": v4["truths"], "ceilings": v4["ceilings"], "truth_seconds": 0.0}
        nvfp4 = one("nvfp4", store / "truth_parts.json", 30)
    else:
        _checked_store(SECOND_FAMILY_STORE / "measured.json", measured, "nvfp4 truth parts")
        nvfp4 = one("nvfp4", SECOND_FAMILY_STORE / "truth_parts.json", 21)  # (second_family's chunk)
        fp8 = one("fp8", store / "truth_parts.json", 21)
    truths = {metric: {**{k: v for k, v in fp8["truths"][metric].items() if k.endswith("|fp8")},
                       **{k: v for k, v in nvfp4["truths"][metric].items() if k.endswith("|nvfp4")}}
              for metric in ("loss_divergence", "weight_divergence")}
    ceilings = {**{k: v for k, v in fp8["ceilings"].items() if k.endswith("_fp8")},
                **{k: v for k, v in nvfp4["ceilings"].items() if k.endswith("_nvfp4")}}
    measured.update(truths=truths, ceilings=ceilings, truth_seconds=fp8["truth_seconds"] + nvfp4["truth_seconds"])
    (store / "measured.json").write_text(json.dumps({"setting": cp.setting_record(s), "measured": measured}))


def plot(summary: dict, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name in ORDER:
        if name in summary:
            xs = sorted(int(k) for k in summary[name])
            ax.errorbar(xs, [summary[name][str(x)]["mean"] for x in xs], yerr=[summary[name][str(x)]["std"] or 0
                                                                            for x in xs],
                        marker="o", capsize=3, label=name, ls="-" if name.startswith("snip") else "--")
    ax.axhline(0.0, color="gray", lw=0.8)
    ax.axvline(17, color="gray", lw=0.8, ls=":")  # the plans act from the 18th step on
    ax.set_xlabel("continuation steps done (4 x 128 tokens each; plans act from the 18th on)")
    ax.set_ylabel("held-out loss gap to bf16 (high precision)")
    ax.set_title(f"{title} continued: SNIP as it ships vs the NVFP4 recipe")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def setting(quick: bool, model: str = "smollm2") -> cp.Setup:
    """The model's v5 setting, or (``quick``) a tiny one of the same model: a few steps of 2 x 32 tokens."""
    if not quick:
        return cp.SETTINGS[MODELS[model][0]]
    return dataclasses.replace(cp.SETTINGS["smollm2_quick"], model=model, continue_steps=6, trajectory_every=2,
                               plan_start=2, target_scope="switchable", low="nvfp4", candidates=("fp8", "nvfp4"))


def report(s: cp.Setup, rows: list[dict], share: float, measured: dict, model: str = "smollm2"
           ) -> tuple[list[str], dict]:
    refs, ref_line = references(rows, model)
    bf16 = refs["all_bf16"]
    runs = by_label(rows, share, bf16)
    for seed, r in refs["all_fp8"].items():
        runs.setdefault("all_fp8", {})[seed] = r
    registered = ("a", "b", "b'", "c") if model == "smollm2" else ("a", "c")  # (Deliver 4: (a) and (c))
    verdict_lines, verdict_json = verdicts(s, runs, bf16, MODELS[model][1], registered)
    traj_lines, traj = trajectory(runs, bf16)
    truths = measured.get("truths")
    lines = [ref_line, "", *run_table(s, runs, bf16, truths), "", *verdict_lines, "",
             "Gap to bf16 (high-precision held-out loss) along the continuation, mean ± std over seeds (step n: after "
             f"n steps; plans act from the {s.plan_start + 2}th step on):", "", *traj_lines]
    if truths:
        lines += ["", "SNIP's first round against the checkpoint's truths (snip@0.75's runs; the round is the same at "
                  "either target):", estimate_ranks({k: r for k, r in runs.get(f"snip@{FRACTION:g}", {}).items() if r.get("estimates")}, measured), "",
                  "Does the plan's objective rank the runs' end gaps (issue 64, Deliver 4: the objective-vs-outcome "
                  "check, on these runs)? Every run at each fraction, its plan priced by the truths and by SNIP's "
                  "first-round estimates (the mean over its runs):",
                  *cp.objective_study([r for r in rows if r["policy"] != "all_bf16"] + list(bf16.values()), measured)]
    summary = {f"{r['fraction']:g}" if r["policy"] != RECIPE else f"{share:g}": {} for r in rows}
    for name, got in runs.items():
        g = gaps(got, bf16)
        if g:
            frac = "0" if name.startswith("all_") else f"{share:g}" if name in (RECIPE, "snip@recipe") else f"{FRACTION:g}"
            summary.setdefault(frac, {})[name] = {"mean": statistics.fmean(g.values()), "std": statistics.stdev(
                g.values()) if len(g) > 1 else None, "seeds": list(g.values()), "seed_ids": list(g)}
    return lines, {**{k: v for k, v in summary.items() if v}, "trajectory": traj, "verdicts": verdict_json,
                   "noise_floor": {"bf16_eval_loss": {k: r["eval_loss"] for k, r in sorted(bf16.items())}}}


def _finite(value):
    """``value`` with every non-finite float as None (strict JSON)."""
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return None if isinstance(value, float) and not math.isfinite(value) else value


def check_sources(model: str, measured: dict) -> None:
    """At start, not hours in: the other benchmarks' stores this model's run takes truths (and, for SmolLM2, the
    references) from hold this very checkpoint."""
    store = V4_STORE if model == "smollm2" else SECOND_FAMILY_STORE
    if (store / "measured.json").exists():
        _checked_store(store / "measured.json", measured, "truths and runs")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", choices=MODELS, default="smollm2")
    parser.add_argument("--seeds", type=int, help="default: 5 (SmolLM2), 3 (Gemma 3)")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--cached-only", action="store_true", help="run nothing: report what the cache holds")
    parser.add_argument("--quick", action="store_true", help="a tiny setting, 1 seed, in a temporary store")
    parser.add_argument("--store", type=Path, help="default: results/compare_policies_<setting>_cache")
    parser.add_argument("--out", type=Path, default=cp.RESULTS)
    args = parser.parse_args()
    name, seeds, folder, title = MODELS[args.model]
    args.seeds = args.seeds or seeds
    args.store = args.store or cp.RESULTS / f"compare_policies_{name}_cache"
    s = setting(args.quick, args.model)
    if args.quick:
        args.seeds, args.store = 1, Path(tempfile.mkdtemp(prefix="quality_v5_"))
    work = bench_dir("quick_v5" if args.quick else folder)
    args.store.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    ckpt, measured = cp.prepare(s, work, args.store, truths=False)
    cp.release_memory()
    if not args.quick:
        check_sources(args.model, measured)
    share = recipe_share(s)
    todo = jobs(share, args.seeds, args.model)
    if args.quick:
        todo = [j for j in todo if not j[0].startswith("oracle") and j[0] != RULES[1]]
    late, heavy = after_oracle(todo, args.model), heavy_jobs(args.model)
    rows = cp.run_jobs(s, ckpt, measured, [j for j in todo if j not in late], args.store, args.workers, work,
                       lambda: measure_truths(s, ckpt, measured, args.store, args.model), args.cached_only, heavy)
    if late:
        rows += cp.run_jobs(s, ckpt, measured, late, args.store, args.workers, work, None, args.cached_only, heavy)
    if not reproduced(rows, args.model):  # quality v4's references cannot serve: every seed's run here
        print("# this code's all_bf16 differs from quality v4's: the references of every seed run here", flush=True)
        extra = [job for job in reference_jobs(args.seeds) if job not in todo]
        rows += cp.run_jobs(s, ckpt, measured, extra, args.store, args.workers, work, None, args.cached_only)
    lines, summary = report(s, rows, share, measured, args.model)
    date = datetime.date.today().isoformat()
    head = [f"# Quality v5 (issue 65): SNIP as it ships vs the NVFP4 recipe, {title} — {date}",
            machine_line("quality_v5.py", args.workers), f"setting: {dataclasses.asdict(s)}; the recipe's FP4 share of the switchable "
            f"layers {share:.4f} (protocol and verdicts: this script's docstring, registered before the runs)",
            f"runs in the cache: {len(rows)}; wall {time.perf_counter() - start:.0f} s (this invocation)", ""]
    print("\n".join(head + lines), flush=True)
    if args.quick:
        return
    prefix = cp.results_prefix(name)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{prefix}.json").write_text(json.dumps(_finite(summary), indent=2))
    (args.out / f"{prefix}_runs.json").write_text(json.dumps({"setting": dataclasses.asdict(s), "rows": rows}, indent=1))
    (args.out / f"{prefix}_{date}.md").write_text("\n".join(head + lines) + "\n")
    plot(summary["trajectory"], args.out / f"{prefix}.png", title)


if __name__ == "__main__":
    main()
