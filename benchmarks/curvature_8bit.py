"""The 8-bit formats' curvature transferred from the FP4 probes (SNIPConfig.curvature_8bit): does it change the plans?

At a setting's checkpoint (compare_policies' pretrained one), ``--rounds`` statistics rounds with the callback's
defaults but ``curvature_8bit=probe`` (every format's own error-probe passes). From each round's parts, LD of the
8-bit formats is formed twice: with their own probed second-order term, and with the transfer
(transferred_second_order: the layer's FP4 quotient second / ||dY||^2 times the 8-bit ||dY||^2, what
``curvature_8bit=transfer`` computes; tests/test_benchmarks.py checks the two agree). Reported:

- Spearman over layers of the 8-bit LD, probed against transferred, per round; beside it the probed LD's own
  agreement between consecutive rounds (its noise);
- the 8-bit second-order term's size against the FP4 one, per layer;
- the plan study of objective_outcome.py: gemm-granularity plans solved on 1 or 2 rounds (A) with either LD,
  priced by the other rounds' mean LD (probed) + WD: out of sample; the paired difference (transfer - probe) over
  the splits, and how many layers' formats the transfer changed.

    python benchmarks/curvature_8bit.py --setting deep8 --checkpoint <dir>/pretrained.ckpt [--rounds 8]
    python benchmarks/curvature_8bit.py --setting deep8 --from-json <its output> --lam 1

Writes benchmarks/results/curvature_8bit_<setting>_<date>.json (the result and the rounds) and prints the
lines of the report. Plans and prices at the callback's lambda (weight_divergence_weight) unless --lam says.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import itertools
import json
import statistics
import time
from pathlib import Path

import compare_policies as cp
import objective_outcome as oo

HERE = Path(__file__).resolve().parent


def transferred_second_order(d, formats) -> dict:
    """A round's LayerDivergence ``d`` measured with curvature_8bit=probe: its second-order terms with the
    8-bit formats' replaced by the transfer (the FP4 formats' pooled quotient times the 8-bit error energy)."""
    fp4 = [f for f in formats if f.is_fp4 and f in d.second_order and d.abs_error_forward.get(f, 0) > 0]
    second = dict(d.second_order)
    if fp4:
        quotient = sum(d.second_order[f] for f in fp4) / sum(d.abs_error_forward[f] for f in fp4)
        for f in formats:
            if not f.is_fp4 and f in d.abs_error_forward:
                second[f] = quotient * d.abs_error_forward[f]
    return second


def measure_rounds(s: cp.Setup, ckpt: Path, count: int) -> list[dict]:
    """``count`` rounds at the checkpoint: per round {"ld", "ld_transfer", "wd", "second", "second_transfer"} ->
    {"model.<fqn>|<format>": value} (LD unclamped, as the planner's aggregate takes it) and its seconds."""
    import torch

    from lightning_snip.config import SNIPConfig
    from lightning_snip.divergence import estimate_divergence
    from lightning_snip.formats import Format
    from lightning_snip.stats import collect_stats, slice_batch

    module, optimizer, data = cp.from_checkpoint(s, ckpt)
    model, layers = cp._truth_model(s, module)
    cfg = SNIPConfig()
    formats = [Format.parse(f) for f in s.candidates]
    stream = oo._stream(s, data)
    rounds = []
    for i in range(count):
        batch = slice_batch(next(stream), s.max_rows)
        start = time.perf_counter()
        stats = collect_stats(model, lambda: model.loss(batch), layers=layers, optimizer=optimizer)
        result = estimate_divergence(
            stats, formats, recipe=cfg.recipe, noise_draws=cfg.noise_draws, noise_scale=cfg.noise_scale,
            curvature_probe=cfg.curvature_probe, curvature_8bit="probe", loss_estimator=cfg.loss_estimator,
            generator=torch.Generator().manual_seed(i), probes=cfg.wd_probes)
        stats.release()
        out = {"ld": {}, "ld_transfer": {}, "wd": {}, "second": {}, "second_transfer": {},
               "seconds": time.perf_counter() - start}
        for fqn, d in result.layers.items():
            second = transferred_second_order(d, formats)
            moved = dataclasses.replace(d, second_order=second)
            ld = d.loss_divergence_as(cfg.loss_estimator, clamp=False)
            ld_t = moved.loss_divergence_as(cfg.loss_estimator, clamp=False)
            for f in formats:
                key = f"model.{fqn}|{f.value}"
                out["ld"][key], out["ld_transfer"][key], out["wd"][key] = ld[f], ld_t[f], d.weight_divergence[f]
                out["second"][key], out["second_transfer"][key] = d.second_order[f], second[f]
        rounds.append(out)
        print(f"  round {i + 1}/{count}: {out['seconds']:.1f} s", flush=True)
    return rounds


def study(s: cp.Setup, rounds: list[dict], lam: float) -> dict:
    """The numbers of the report (see the module docstring) from ``rounds``; plans and prices at
    lambda ``lam`` (LD + lam WD)."""
    from lightning_snip import planner
    from lightning_snip.formats import Format

    from harness import spearman

    formats = [Format.parse(f) for f in s.candidates]
    eight = [f.value for f in formats if not f.is_fp4 and f is not Format.BF16]
    fp4 = [f.value for f in formats if f.is_fp4]
    keys = {v: [k for k in rounds[0]["ld"] if k.endswith("|" + v)] for v in eight + fp4}
    out = {"rounds": len(rounds), "round_seconds": statistics.median(r["seconds"] for r in rounds), "lambda": lam,
           "formats": {}}
    for v in eight:
        ks = keys[v]
        probe_vs_transfer = [spearman([r["ld"][k] for k in ks], [r["ld_transfer"][k] for k in ks]) for r in rounds]
        consecutive = [spearman([a["ld"][k] for k in ks], [b["ld"][k] for k in ks]) for a, b in zip(rounds, rounds[1:])]
        ratios = []
        for k in ks:
            layer = k.rsplit("|", 1)[0]
            ref = statistics.fmean(abs(r["second"][f"{layer}|{fp4[0]}"]) for r in rounds)
            ratios.append(statistics.fmean(abs(r["second"][k]) for r in rounds) / max(ref, 1e-300))
        out["formats"][v] = {"probe_vs_transfer": probe_vs_transfer, "probe_consecutive": consecutive,
                             "second_ratio_median": statistics.median(ratios), "second_ratio_max": max(ratios)}
    module = cp._module(s)
    out["plans"] = {}
    for frac in (0.75, 0.9):
        if not _reachable(module, s, frac):  # SmolLM2: its pinned lm_head leaves at most 0.79 for FP4
            continue
        for size in (1, 2):
            prices, changed = {"probe": [], "transfer": []}, []
            for held in itertools.combinations(range(len(rounds)), size):
                a = [rounds[i] for i in held]
                b = [r for i, r in enumerate(rounds) if i not in held]
                price = {"ld": oo.mean_rounds(b, "ld"), "wd": oo.mean_rounds(b, "wd"), "drift": {}}
                plans = {}
                for kind, metric in (("probe", "ld"), ("transfer", "ld_transfer")):
                    evidence = {"loss_divergence": oo.mean_rounds(a, metric), "weight_divergence": oo.mean_rounds(a, "wd")}
                    cands = cp._candidates(module, cp.pooled_truths(evidence, 0.0), s.candidates)
                    plan = planner.solve_gemm_plan(cands, fp4_fraction=frac, weight_divergence_weight=lam)
                    plans[kind] = {k: f.value for k, f in plan.items()}
                    prices[kind].append(oo.plan_price(plans[kind], price, lam))
                changed.append(sum(plans["probe"][k] != plans["transfer"][k] for k in plans["probe"]))
            diffs = [t - p for t, p in zip(prices["transfer"], prices["probe"])]
            out["plans"][f"{frac:g}/{size}"] = {
                "splits": len(diffs), "probe": statistics.fmean(prices["probe"]),
                "transfer": statistics.fmean(prices["transfer"]), "diff": statistics.fmean(diffs),
                "diff_std": statistics.stdev(diffs), "changed": statistics.fmean(changed), "gemms": len(plans["probe"])}
    return out


def _reachable(module, s: cp.Setup, fraction: float) -> bool:
    from lightning_snip import planner

    try:
        planner.solve_gemm_plan(cp._candidates(module, None, s.candidates), fp4_fraction=fraction)
    except planner.PlanInfeasibleError:
        return False
    return True


def report_lines(name: str, result: dict) -> list[str]:
    lines = [f"[{name}] {result['rounds']} rounds, median {result['round_seconds']:.1f} s each; lambda {result['lambda']:g}"]
    for v, r in result["formats"].items():
        lines.append(f"[{name}] {v} LD, probed vs transferred, Spearman per round: "
                     + " ".join(f"{x:.2f}" for x in r["probe_vs_transfer"]))
        lines.append(f"[{name}] {v} LD probed, consecutive rounds: " + " ".join(f"{x:.2f}" for x in r["probe_consecutive"]))
        lines.append(f"[{name}] {v} |second-order| / the FP4 one's, per layer: median {r['second_ratio_median']:.3f}, "
                     f"max {r['second_ratio_max']:.3f}")
    for key, p in result["plans"].items():
        frac, size = key.split("/")
        lines.append(f"[{name}] fraction {frac}, plans on {size} round(s), priced by the others ({p['splits']} splits): "
                     f"probe {p['probe']:.5f}, transfer {p['transfer']:.5f}, transfer - probe {p['diff']:+.5f} "
                     f"± {p['diff_std']:.5f}; GEMMs whose format changed {p['changed']:.1f} of {p['gemms']}")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--setting", choices=sorted(cp.SETTINGS), default="deep8")
    parser.add_argument("--checkpoint", type=Path, help="compare_policies' pretrained.ckpt of the setting")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--lam", type=float, default=None,
                        help="lambda of the plans and prices (default: the callback's weight_divergence_weight)")
    parser.add_argument("--from-json", type=Path, default=None,
                        help="an earlier run's output: its rounds again, not measured (another --lam)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=HERE / "results")
    args = parser.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    from lightning_snip.config import SNIPConfig

    s = cp.SETTINGS[args.setting]
    lam = SNIPConfig().weight_divergence_weight if args.lam is None else args.lam
    if args.from_json is not None:
        rounds = json.loads(args.from_json.read_text())["rounds"]
    elif args.checkpoint is None:
        raise SystemExit("curvature_8bit: --checkpoint (or --from-json) is required")
    else:
        rounds = measure_rounds(s, args.checkpoint, args.rounds)
    result = study(s, rounds, lam)
    date = datetime.date.today().isoformat()
    path = args.out / f"curvature_8bit_{args.setting}_{date}.json"
    path.write_text(json.dumps({"setting": args.setting, "result": result, "rounds": rounds}))
    print("\n".join(report_lines(args.setting, result)))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
