"""Issue 64, Deliver 1: where the variance of one round's LD comes from, on SmolLM2 at quality v4's checkpoint.

LD of a (layer, FP4 format) in one round is (docs/method.md section 4)

    LD = first + second,   first = <G, dY> / |loss| of the round's rows,   second = 1/2 dY^T H dY / |loss|

with the first-order term shrunk by its own sampling error (James-Stein over the round's samples) when no training
batch was sampled before the round, and the second-order term the mean of NOISE_DRAWS error-probe passes. Its noise
has four sources: the probe's random signs (draws), the round's batch (which samples the round sees: the first-order
term is mostly this), the rows the round takes of it, and the first-order sample of earlier batches (none at the
first round). This script measures each at the checkpoint of ``compare_policies``' ``smollm2_long`` setting (quality
v4: SmolLM2-135M-Instruct after 4 warmup steps; its LD truths are committed, 4 batches of 4 x 128 tokens): for each
of ``--batches`` training batches (seed s's first batch of the continuation's data order, the batch a run of seed s
plans its first round from) and each row count, the per-sample first-order sums and ``--draws`` single-draw
second-order terms of every layer in the FP4 format, with the seconds each part costs. Everything is kept per
(batch, rows) in ``--store`` as it ends (the run resumes); ``report`` turns it into the variance table, the
Spearman of estimators built from the parts against the truths (beside the truths' ceiling) and the spread of their
plans' truth prices.

    python benchmarks/ld_variance.py --batches 8 --draws 8 --rows 256 512       # measures what the store lacks
    python benchmarks/ld_variance.py --report-only                              # the tables from the store
    python benchmarks/ld_variance.py --quick                                    # a tiny check, nothing written
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics as st
import tempfile
import time
from pathlib import Path

import compare_policies as cp  # the script's own folder is on the path, as for every benchmark
from harness import bench_dir

SETTING = "smollm2_long"
V4_STORE = cp.RESULTS / "compare_policies_smollm2_long_cache"  # the checkpoint's truths (quality v4)


def load(s: cp.Setup, work: Path, store: Path):
    """(model with .loss, layers, data module, truths per batch {(fqn, fmt): [per-batch loss increase]}, mean loss)
    at the setting's checkpoint; the truths from quality v4's committed cache (checked by the fingerprint)."""
    ckpt, measured = cp.prepare(s, work, prepared_store(store), truths=False)
    cp.release_memory()
    module, _, data = cp.from_checkpoint(s, ckpt)
    model, layers = cp.truth_model(s, module)
    parts = json.loads((store / "truth_parts.json").read_text()) if (store / "truth_parts.json").exists() else {}
    per_batch: dict[tuple[str, str], list[float]] = {}
    for i in range(s.truth_batches):
        for fqn, fmt, v in parts.get(f"ld{i}", []):
            per_batch.setdefault((fqn, fmt), []).append(v)
    return model, layers, data, per_batch, measured


def prepared_store(store: Path) -> Path:
    """``store`` with quality v4's measurements of the checkpoint (its truths) copied in, once: compare_policies.prepare
    reads them from there, and never touches v4's committed cache."""
    store.mkdir(parents=True, exist_ok=True)
    for name in ("measured.json", "truth_parts.json"):
        if not (store / name).exists() and (V4_STORE / name).exists():
            shutil.copy(V4_STORE / name, store / name)
    return store


def round_batch(s: cp.Setup, seed: int):
    """Seed ``seed``'s first training batch (its data module's stream from the start)."""
    data = cp.data_module(s, seed)
    data.setup()
    return next(iter(data.train_dataloader()))


def measure(model, layers, batch, rows: int, draws: int, fmt_name: str, seed: int, probes=()) -> dict:
    """One (batch, rows): per layer the first-order term's per-sample sums and ``draws`` single-draw second-order
    terms (both in loss units, not yet divided by |loss|), the round's loss and the seconds of each part."""
    import torch

    from lightning_snip.curvature import error_probe_second_order
    from lightning_snip.formats import Format, QuantRecipe
    from lightning_snip.gemm import bmm_fp32
    from lightning_snip.groups import quantize_stack
    from lightning_snip.round_inputs import RoundInputs, round_groups, stacked_operands
    from lightning_snip.stats import collect_stats, slice_batch

    fmt = Format.parse(fmt_name)
    sliced = slice_batch(batch, rows)
    t0 = time.perf_counter()
    stats = collect_stats(model, lambda: model.loss(sliced), layers=layers)
    t1 = time.perf_counter()
    inputs = RoundInputs(stats=stats, formats=(fmt,), recipe=QuantRecipe(), adam={}, denominator=1.0,
                         loss_norm=abs(stats.loss), first_order_history={}, generator=None)
    valid = {fqn: [fmt] for fqn in stats.layers}
    errors, first, energy = {}, {}, {}
    for group in round_groups(inputs, stats.layers, valid):
        x, w = stacked_operands(inputs, group, "x"), stacked_operands(inputs, group, "w")
        dy = bmm_fp32(quantize_stack(x, fmt, recipe=inputs.recipe), quantize_stack(w, fmt, recipe=inputs.recipe,
                                                                                  is_weight=True)) - bmm_fp32(x, w)
        g = stacked_operands(inputs, group, "g").float()
        n = stats.layers[group[0]].num_samples
        per_sample = (g * dy).sum(-1).double().reshape(len(group), n, -1).sum(-1)
        for i, fqn in enumerate(group):
            errors[fqn, fmt] = dy[i]
            first[fqn] = per_sample[i].tolist()
            energy[fqn] = float(dy[i].double().pow(2).sum())
    t2 = time.perf_counter()
    second = {fqn: [] for fqn in first}
    for d in range(draws):
        generator = torch.Generator().manual_seed(1_000 * seed + d)
        for (fqn, _), value in error_probe_second_order(stats, errors, [fmt], 1, generator).items():
            second[fqn].append(value)
    t3 = time.perf_counter()
    variants = {}
    for scale, antithetic in probes:
        start = time.perf_counter()
        name = f"h{scale:g}{'_anti' if antithetic else ''}"
        variants[name] = probe_draws(stats, errors, draws, seed, scale, antithetic)
        variants[name + "_seconds"] = (time.perf_counter() - start) / max(draws, 1)
    loss = float(stats.loss)
    stats.release()
    return {"loss": loss, "first": first, "second": second, "energy": energy, "probes": variants,
            "seconds": {"stats": t1 - t0, "errors": t2 - t1, "draw": (t3 - t2) / max(draws, 1)}}


def probe_draws(stats, errors: dict, draws: int, seed: int, scale: float, antithetic: bool) -> dict[str, list[float]]:
    """Single-draw second-order terms of every layer, as curvature.error_probe_second_order draws them (a random sign
    per layer and sample, every layer's error injected at once), with the errors scaled by ``scale`` (the term
    divided by scale^2: scale 1 is the library's probe) and, ``antithetic``, each draw's gradient change a central
    difference of the signs and their negation (two passes per draw)."""
    import torch

    keys = list(errors)
    units = [stats.layers[fqn].num_samples for fqn, _ in keys]
    out = {fqn: [] for fqn, _ in keys}
    generator = torch.Generator().manual_seed(10_000 + 1_000 * seed)
    for _ in range(draws):
        drawn = (torch.rand(sum(units), generator=generator) < 0.5).float() * 2 - 1
        noise = {fqn: scale * signs.repeat_interleave(errors[fqn, f].shape[0] // n).unsqueeze(1) * errors[fqn, f]
                 for (fqn, f), signs, n in zip(keys, drawn.split(units), units)}
        plus = stats.output_grads_with_noise(noise)
        if antithetic:
            minus = stats.output_grads_with_noise({fqn: -v for fqn, v in noise.items()})
            delta = {fqn: (plus[fqn].float() - minus[fqn].float()) / 2 for fqn in plus}
            del minus
        else:
            delta = {fqn: plus[fqn].float() - stats.layers[fqn].g.float() for fqn in plus}
        for fqn, _ in keys:
            out[fqn].append(float(0.5 * (noise[fqn] * delta[fqn]).sum().double()) / scale ** 2)
        del noise, plus, delta
    return out


def _rel(r: dict) -> tuple[dict, dict, dict]:
    """A measured (batch, rows)'s parts relative to its loss: first-order term, its within-batch variance (the
    James-Stein shrinkage's, over the round's samples), single-draw second-order terms; per fqn."""
    loss = abs(r["loss"])
    first, within, second = {}, {}, {}
    for fqn, units in r["first"].items():
        n = len(units)
        first[fqn] = sum(units) / loss
        mean = sum(units) / n
        within[fqn] = n * sum((u - mean) ** 2 for u in units) / (n - 1) / loss ** 2 if n > 1 else math.inf
        second[fqn] = [v / loss for v in r["second"][fqn]]
    return first, within, second


def shrunk(first: float, variance: float) -> float:
    """The library's positive-part James-Stein shrinkage of one batch's first-order term
    (loss_divergence.combine_loss_divergence with no sampled history)."""
    from lightning_snip.loss_divergence import combine_loss_divergence

    return combine_loss_divergence(first=first, first_stderr=math.sqrt(variance), first_accumulated=None, second=0.0)


def estimators(parts: dict[int, tuple], draws: int) -> dict[str, dict[int, dict[str, float]]]:
    """name -> batch -> fqn -> LD, for the estimators built from one (rows)'s measured parts (``parts``: batch ->
    _rel(...)): today's round and counterfactuals that remove one source of noise each (by the other batches' or
    draws' average: what an unlimited sample of that source would give)."""
    import statistics as st

    batches = sorted(parts)
    fqns = list(parts[batches[0]][0])
    mean_first = {f: st.fmean(parts[b][0][f] for b in batches) for f in fqns}
    mean_second = {f: st.fmean(v for b in batches for v in parts[b][2][f]) for f in fqns}
    out: dict[str, dict[int, dict[str, float]]] = {}
    for b in batches:
        first, within, second = parts[b]
        today_second = {f: st.fmean(second[f][:2]) for f in fqns}
        all_draws = {f: st.fmean(second[f][:draws]) for f in fqns}
        js = {f: shrunk(first[f], within[f]) for f in fqns}
        others = [o for o in batches if o != b]
        history = {f: st.fmean([parts[o][0][f] for o in others[:4]] + [first[f]]) for f in fqns}
        cells = {
            "today (JS first + 2 draws)": {f: js[f] + today_second[f] for f in fqns},
            f"today, draws averaged ({draws})": {f: js[f] + all_draws[f] for f in fqns},
            "today, first unshrunk": {f: first[f] + today_second[f] for f in fqns},
            "second only, 2 draws": today_second,
            f"second only, {draws} draws": all_draws,
            "first over 5 batches + 2 draws": {f: history[f] + today_second[f] for f in fqns},
            "first over all batches + 2 draws": {f: mean_first[f] + today_second[f] for f in fqns},
            "all batches' mean (E[LD] at these rows)": {f: mean_first[f] + mean_second[f] for f in fqns},
        }
        for name, values in cells.items():
            out.setdefault(name, {})[b] = values
    return out


def variance_table(parts: dict[int, tuple], draws: int) -> dict[str, float]:
    """Each source's variance of one round's LD (relative units), summed over the layers: the probe's draws (of a
    2-draw mean), the second-order term's batch, the first-order term's batch (raw and as the round shrinks it)."""
    import statistics as st

    batches = sorted(parts)
    fqns = list(parts[batches[0]][0])
    out = {"draws (2-draw mean)": 0.0, "second-order: batch": 0.0, "first-order: batch (raw)": 0.0,
           "first-order: batch (James-Stein, as today)": 0.0, "today's LD: total over batches and draws": 0.0}
    for f in fqns:
        draw_var = st.fmean(st.variance(parts[b][2][f][:draws]) for b in batches)
        out["draws (2-draw mean)"] += draw_var / 2
        out["second-order: batch"] += max(0.0, st.variance([st.fmean(parts[b][2][f][:draws]) for b in batches])
                                          - draw_var / draws)
        out["first-order: batch (raw)"] += st.variance([parts[b][0][f] for b in batches])
        out["first-order: batch (James-Stein, as today)"] += st.variance(
            [shrunk(parts[b][0][f], parts[b][1][f]) for b in batches])
        out["today's LD: total over batches and draws"] += st.variance(
            [shrunk(parts[b][0][f], parts[b][1][f]) + st.fmean(parts[b][2][f][:2]) for b in batches])
    return out


def load_rounds(store: Path) -> dict[int, dict[int, dict]]:
    """rows -> batch -> the measured round (rounds.jsonl)."""
    out: dict[int, dict[int, dict]] = {}
    path = store / "rounds.jsonl"
    for line in path.read_text().splitlines() if path.exists() else []:
        r = json.loads(line)
        out.setdefault(r["rows"], {})[r["batch"]] = r
    return out


def spearman_to_truths(values: dict[str, float], truths: dict[str, float], fmt: str) -> float:
    from scipy.stats import spearmanr

    keys = [f for f in values if f"model.{f}|{fmt}" in truths and math.isfinite(values[f])]
    return float(spearmanr([values[f] for f in keys], [truths[f"model.{f}|{fmt}"] for f in keys]).statistic)


def v4_runs() -> dict[int, dict]:
    """Quality v4's SNIP-as-it-ships runs by seed (their first round's estimates: WD and the 8-bit LD the plans here
    reuse, and today's plan-price spread)."""
    path = V4_STORE / "rows.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    return {r["seed"]: r for r in rows if r["policy"] == "snip_gemm+defaults" and r.get("estimates")}


def plan_prices(est: dict[int, dict[str, float]], measured: dict, s: cp.Setup, fmt: str) -> dict[int, float]:
    """Batch -> the truth price of the plan SNIP's ILP makes (quality_long.snip_solver: per GEMM, 0.75 of the model's
    linear FLOPs, lambda 0.1) of this LD in ``fmt`` beside v4's seed-b round's own WD and 8-bit LD (batch b < 5):
    the part of the plans' spread that this LD's noise makes."""
    import quality_long

    runs = v4_runs()
    solve = quality_long.snip_solver(s, 0.75)
    lam = cp.oracle_lambda("oracle")
    out = {}
    for b, values in est.items():
        if b not in runs:
            continue
        estimates = {metric: dict(v) for metric, v in runs[b]["estimates"].items()}
        for fqn, v in values.items():
            estimates["loss_divergence"][f"model.{fqn}|{fmt}"] = v
        plan = solve(estimates)
        out[b] = cp.plan_objective({k: getattr(f, "value", f) for k, f in plan.items()}, measured["truths"], lam)
    return out


def report(store: Path, measured: dict, s: cp.Setup, fmt: str, draws: int) -> list[str]:
    import statistics as st

    truths = measured["truths"]["loss_divergence"]
    r = measured["ceilings"].get(f"loss_{fmt}", math.nan)
    ceiling = math.sqrt(2 * r / (1 + r)) if r > 0 else math.nan
    lines = [f"LD truths ({fmt}, quality v4's checkpoint, {s.truth_batches} batches): split-half Spearman {r:.2f}; "
             f"an error-free estimate would rank them at about {ceiling:.2f} (the ceiling).", ""]
    rounds = load_rounds(store)
    for rows, by_batch in sorted(rounds.items()):
        parts = {b: _rel(r) for b, r in by_batch.items()}
        seconds = {k: st.fmean(r["seconds"][k] for r in by_batch.values()) for k in ("stats", "errors", "draw")}
        lines += [f"## {rows} rows, {len(parts)} batches, {draws} draws each", "",
                  "seconds (mean): recording pass {stats:.1f}, FP4 errors and first-order terms {errors:.1f}, "
                  "one probe draw {draw:.1f}".format(**seconds), "",
                  "| source | variance summed over layers | share |", "|---|---|---|"]
        table = variance_table(parts, draws)
        parts_total = sum(v for k, v in table.items() if not k.startswith(("today", "first-order: batch (raw)")))
        for name, value in table.items():
            share = f"{value / parts_total:.0%}" if not name.startswith(("today", "first-order: batch (raw)")) else ""
            lines.append(f"| {name} | {value:.3e} | {share} |")
        lines += ["", "| estimator | Spearman vs truths per batch | mean ± std | plan truth price per batch (b < 5) "
                  "| mean ± std |", "|---|---|---|---|---|"]
        for name, est in estimators(parts, draws).items():
            rho = [spearman_to_truths(est[b], truths, fmt) for b in sorted(est)]
            prices = plan_prices(est, measured, s, fmt)
            pv = [prices[b] for b in sorted(prices)]
            lines.append(f"| {name} | {' '.join(f'{x:+.2f}' for x in rho)} | {st.fmean(rho):+.2f} ± "
                         f"{st.stdev(rho) if len(rho) > 1 else 0:.2f} | {' '.join(f'{x:.4f}' for x in pv)} | "
                         + (f"{st.fmean(pv):.4f} ± {st.stdev(pv):.4f}" if len(pv) > 1 else "") + " |")
        lines.append("")
    return lines


def same_batch_truths(model, layers, s: cp.Setup, store: Path, batches: int, rows: int, fmt_name: str) -> None:
    """The loss change each layer's FP4 forward makes alone on a round's own rows (harness.loss_increase: what the
    truths measure, on the round's batch): the estimate's bias, apart from the batch's noise (same_batch.json)."""
    import torch

    import harness
    from lightning_snip.formats import Format
    from lightning_snip.stats import slice_batch

    path = store / "same_batch.json"
    out = json.loads(path.read_text()) if path.exists() else {}
    for b in range(batches):
        if str(b) in out:
            continue
        batch = slice_batch(round_batch(s, b), rows)
        with torch.no_grad():
            base = float(model.loss(batch))
        increase = harness.loss_increase(model, layers, batch, [Format.parse(fmt_name)])
        out[str(b)] = {"rows": rows, "base": base, "increase": {fqn: v for (fqn, _), v in increase.items()}}
        path.write_text(json.dumps(out))


def probe_report(store: Path, truths: dict, fmt: str) -> list[str]:
    """The probe variants (rounds_probes.jsonl) against the truths and, where measured, against the loss change on
    the round's own rows (same_batch.json)."""
    import numpy as np
    from scipy.stats import spearmanr

    path = store / "rounds_probes.jsonl"
    if not path.exists():
        return []
    rounds = {r["batch"]: r for r in map(json.loads, path.read_text().splitlines())}
    same = json.loads((store / "same_batch.json").read_text()) if (store / "same_batch.json").exists() else {}
    fqns = list(next(iter(rounds.values()))["first"])
    truth = np.array([truths[f"model.{f}|{fmt}"] for f in fqns])
    names = ["library (h1)"] + [k for k in next(iter(rounds.values()))["probes"] if not k.endswith("_seconds")]
    lines = ["| probe (scale h, antithetic) | s per draw | sum of the mean second-order term (truths' sum "
             f"{truth.sum():.3f}) | Spearman vs truths of the second-order term, one batch, 2 / 8 draws (mean over batches) | first + second, all batches' mean |"
             " same batch: Spearman / Pearson of first + second vs the loss change | of second vs the change minus "
             "first |", "|---|---|---|---|---|---|---|"]
    for name in names:
        second, rho2, rho8, fid, fid2 = [], [], [], [], []
        for b, r in sorted(rounds.items()):
            loss = abs(r["loss"])
            draws = r["second"] if name.startswith("library") else r["probes"][name]
            d = np.array([draws[f] for f in fqns]) / loss
            first = np.array([sum(r["first"][f]) / loss for f in fqns])
            second.append(d.mean(1) + first)
            rho2.append(spearmanr(d[:, :2].mean(1), truth)[0])
            rho8.append(spearmanr(d.mean(1), truth)[0])
            if str(b) in same:
                actual = np.array([same[str(b)]["increase"][f] for f in fqns]) / same[str(b)]["base"]
                fid.append((spearmanr(first + d.mean(1), actual)[0], np.corrcoef(first + d.mean(1), actual)[0, 1]))
                fid2.append((spearmanr(d.mean(1), actual - first)[0], np.corrcoef(d.mean(1), actual - first)[0, 1]))
        seconds = st.fmean(r["seconds"]["draw"] if name.startswith("library") else r["probes"][name + "_seconds"]
                           for r in rounds.values())
        mean = np.mean(second, 0)
        lines.append(f"| {name} | {seconds:.2f} | {float(np.mean([x.sum() for x in second])):.3f} | "
                     f"{st.fmean(rho2):+.2f} / {st.fmean(rho8):+.2f} | {spearmanr(mean, truth)[0]:+.2f} | "
                     + " ".join(f"{a:+.2f}/{c:+.2f}" for a, c in fid) + " | "
                     + " ".join(f"{a:+.2f}/{c:+.2f}" for a, c in fid2) + " |")
    return lines


def first_order_report(store: Path, truths: dict, fmt: str, rows: int) -> list[str]:
    """LD's first-order term averaged over k batches (rounds.jsonl and rounds_first.jsonl at ``rows``), alone and
    with the second-order term of every measured batch and draw: what a larger first-order sample buys."""
    import numpy as np
    from scipy.stats import spearmanr

    runs = [r for name in ("rounds.jsonl", "rounds_first.jsonl") if (store / name).exists()
            for r in map(json.loads, (store / name).read_text().splitlines()) if r["rows"] == rows]
    if not runs:
        return []
    fqns = list(runs[0]["first"])
    truth = np.array([truths[f"model.{f}|{fmt}"] for f in fqns])
    first = np.array([[sum(r["first"][f]) / abs(r["loss"]) for f in fqns] for r in runs])
    second = np.mean([[st.fmean(r["second"][f]) / abs(r["loss"]) for f in fqns] for r in runs if r["second"][fqns[0]]], 0)
    lines = [f"| batches k ({rows} rows each) | Spearman vs truths: first-order mean | first-order mean + second-order "
             "mean | mean abs first-order term |", "|---|---|---|---|"]
    for k in sorted({1, 4, 8, 16, len(first)}):
        if k <= len(first):
            mean = first[:k].mean(0)
            lines.append(f"| {k} | {spearmanr(mean, truth)[0]:+.2f} | {spearmanr(mean + second, truth)[0]:+.2f} | "
                         f"{np.abs(mean).mean():.5f} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batches", type=int, default=8)
    parser.add_argument("--first-batches", type=int, default=0,
                        help="batches after --batches measured for the first-order term only (rounds_first.jsonl)")
    parser.add_argument("--draws", type=int, default=8)
    parser.add_argument("--rows", type=int, nargs="+", default=[256, 512])
    parser.add_argument("--format", default="mxfp4")
    parser.add_argument("--store", type=Path, default=cp.RESULTS / "ld_variance_cache")
    parser.add_argument("--report-only", action="store_true")
    parser.add_argument("--probes", nargs="*", default=[], metavar="SCALE[:anti]",
                        help="probe variants measured beside the library's (a separate file: rounds_probes.jsonl)")
    parser.add_argument("--same-batch", type=int, default=0, help="batches whose loss change per layer is measured "
                        "on the round's own rows (the first --rows value)")
    parser.add_argument("--quick", action="store_true", help="a tiny setting, nothing written")
    args = parser.parse_args()
    import torch

    torch.set_num_threads(int(os.environ.get("SNIP_THREADS", "2")))
    s = cp.SETTINGS[SETTING]
    if args.quick:
        s = cp.SETTINGS["smollm2_quick"]
        args.batches, args.draws, args.rows = 2, 2, [64]
        args.store = Path(tempfile.mkdtemp(prefix="ld_variance_"))
    work = bench_dir("quick_ld" if args.quick else SETTING)
    if not args.report_only:
        model, layers, _, _, _ = load(s, work, args.store)
        probes = [(float(p.partition(":")[0]), p.endswith(":anti")) for p in args.probes]
        _measure_all(model, layers, s, args, probes)
        same_batch_truths(model, layers, s, args.store, args.same_batch, args.rows[0], args.format)
    measured = json.loads((prepared_store(args.store) / "measured.json").read_text())["measured"]
    if "truths" in measured:
        truths = measured["truths"]["loss_divergence"]
        print("\n".join(report(args.store, measured, s, args.format, args.draws)
                        + ["## Probe variants", ""] + probe_report(args.store, truths, args.format)
                        + ["", "## The first-order sample", ""] + first_order_report(args.store, truths, args.format,
                                                                                      max(args.rows))))


def _measure_all(model, layers, s: cp.Setup, args, probes) -> None:
    """The (batch, rows) rounds the store lacks: with every part (rounds.jsonl, or rounds_probes.jsonl with
    ``probes``), then the first-order-only batches (rounds_first.jsonl)."""
    targets = [("rounds_probes.jsonl" if probes else "rounds.jsonl", range(args.batches), args.draws),
               ("rounds_first.jsonl", range(args.batches, args.batches + args.first_batches), 0)]
    for name, batches, draws in targets:
        path = args.store / name
        done = {(r["batch"], r["rows"]) for r in map(json.loads, path.read_text().splitlines())} if path.exists() else set()
        for b in batches:
            batch = round_batch(s, b)
            for rows in args.rows:
                if (b, rows) in done:
                    continue
                r = measure(model, layers, batch, rows, draws, args.format, b, probes if draws else ())
                with path.open("a") as f:
                    f.write(json.dumps({"batch": b, "rows": rows, "format": args.format, **r}) + "\n")
                print(f"{name} batch {b} rows {rows}: {r['seconds']}", flush=True)


if __name__ == "__main__":
    main()
