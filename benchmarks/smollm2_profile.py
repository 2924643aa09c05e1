"""A per-layer profile of SmolLM2-135M-Instruct: can the choice of FP4 layers matter on this model?

Per linear layer (the LM head aside: the app pins it):
- input outlier statistics of every linear on held-out text (the fidelity benchmark's held-out chunks of the stdlib
  corpus, in SmolLM2's tokens): max|x| / rms and the excess kurtosis of the input's entries, pooled
  over ``--batches`` batches of ``--batch`` x ``--seq-len`` tokens;
- the FP4 damage truths of a ``divergence_fidelity.py --models smollm2 --dump RAW`` run (``--truths
  RAW``): LD truth = held-out loss increase with only the layer's forward in mxfp4 / nvfp4 (mean over
  batches; its split-half ceiling), WD truth = the deviation of one AdamW update with only the layer's
  backward in the format (on the dump's layers: --include, and --wd-include for WD);
- how much of that damage a class rule explains: the share of variance (of the truth, and of its
  log10) explained by the means of its class, layer type (q, k, v, o, gate, up, down) x first /
  inner / last block, the rank correlation of the class means with the truth (beside the truth's
  ceiling), and the layers the class means miss most (the residual a per-layer measurement could
  use and a rule cannot).

    python benchmarks/smollm2_profile.py --truths RAW.json [--json OUT.json]
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import platform
import re
import statistics
from pathlib import Path

import torch
from scipy.stats import spearmanr

import harness

from lightning_snip.demo.data import ByteWindows, split_corpus
from lightning_snip.demo.lightning import ByteTextDataModule

TYPES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def block_of(fqn: str) -> int:
    return int(re.search(r"\blayers\.(\d+)\.", fqn).group(1))


def layer_class(fqn: str, num_blocks: int) -> tuple[str, str]:
    """(layer type, first | inner | last block) of a decoder layer's linear."""
    block = block_of(fqn)
    kind = fqn.rsplit(".", 1)[1]
    return kind, "first" if block == 0 else "last" if block == num_blocks - 1 else "inner"


def class_fit(fqns: list[str], values: list[float], num_blocks: int) -> dict:
    """Share of variance the class means explain (raw and log10), their Spearman with the values, and
    the layers with the largest log residual."""
    classes = [layer_class(f, num_blocks) for f in fqns]

    def explained(vals):
        groups: dict = {}
        for c, v in zip(classes, vals):
            groups.setdefault(c, []).append(v)
        means = {c: sum(g) / len(g) for c, g in groups.items()}
        fitted = [means[c] for c in classes]
        mean = sum(vals) / len(vals)
        total = sum((v - mean) ** 2 for v in vals)
        within = sum((v - f) ** 2 for v, f in zip(vals, fitted))
        return (1 - within / total if total > 0 else float("nan")), fitted

    floor = max(min((v for v in values if v > 0), default=1e-12), 1e-12)
    logs = [math.log10(max(v, floor)) for v in values]
    share, fitted = explained(values)
    share_log, fitted_log = explained(logs)
    residual = sorted(((lv - fl, f) for f, lv, fl in zip(fqns, logs, fitted_log)), key=lambda t: -abs(t[0]))
    # Out of sample: each layer predicted by its class's other members (classes of one layer, such as
    # the first and last block's when few blocks are measured, are fitted exactly in sample and left
    # out here), share of the log variance of those layers explained.
    loo_pred, loo_true = [], []
    for i, c in enumerate(classes):
        others = [logs[j] for j, d in enumerate(classes) if d == c and j != i]
        if others:
            loo_pred.append(sum(others) / len(others))
            loo_true.append(logs[i])
    loo = float("nan")
    if len(loo_true) > 2:
        mean = sum(loo_true) / len(loo_true)
        total = sum((v - mean) ** 2 for v in loo_true)
        loo = 1 - sum((v - p) ** 2 for v, p in zip(loo_true, loo_pred)) / total if total > 0 else float("nan")
    return {"variance_explained": share, "variance_explained_log": share_log,
            "loo_variance_explained_log": loo, "loo_layers": len(loo_true),
            "loo_class_means_spearman": float(spearmanr(loo_pred, loo_true).statistic) if len(loo_true) > 2 else float("nan"),
            "class_means_spearman": float(spearmanr(fitted, values).statistic),
            "largest_residuals": [[f, round(r, 3)] for r, f in residual[:8]],
            "num_classes": len(set(classes))}


def _ranks(values: list[float]) -> list[float]:
    """1 = the largest (average ranks for ties)."""
    from scipy.stats import rankdata

    return list(rankdata([-v for v in values]))


def outlier_stats(model, layers, batches_) -> dict:
    """fqn -> {max_over_rms, kurtosis} of the layer's input entries, pooled over the batches."""
    acc = {fqn: [0.0, 0.0, 0.0, 0.0, 0] for fqn in layers}  # max|x|, sum x^2, sum x^4, sum x, count

    def hook(fqn):
        def record(module, args):
            x = args[0].detach().double().flatten()
            a = acc[fqn]
            a[0] = max(a[0], float(x.abs().max()))
            a[1] += float(x.pow(2).sum())
            a[2] += float(x.pow(4).sum())
            a[3] += float(x.sum())
            a[4] += x.numel()
        return record

    handles = [module.register_forward_pre_hook(hook(fqn)) for fqn, module in layers.items()]
    try:
        with torch.no_grad():
            for batch in batches_:
                model.loss(batch)
    finally:
        for h in handles:
            h.remove()
    out = {}
    for fqn, (peak, s2, s4, s1, n) in acc.items():
        mean, m2 = s1 / n, s2 / n
        var = m2 - mean**2
        # excess kurtosis about zero mean (the inputs are near zero-mean; a raw 4th moment / m2^2 - 3)
        out[fqn] = {"max_over_rms": peak / math.sqrt(m2), "kurtosis": (s4 / n) / m2**2 - 3, "std": math.sqrt(var)}
    return out


def _parser() -> argparse.ArgumentParser:
    """The command line of this benchmark."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--truths", required=True, help="a divergence_fidelity.py --models smollm2 --dump file")
    parser.add_argument("--batches", type=int, default=8)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0, help="the fidelity run's seed (its held-out split)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", help="write the per-layer profile to this file")
    parser.add_argument("--outlier-ratio", type=float, default=100.0,
                        help="max/rms above which a layer's input counts as a massive activation")
    return parser


def _decoder_layers(raw: dict) -> tuple[list[str], list[str]]:
    """The dump's truths cut to the decoder layers' linears, in place (a dump without --exclude '*lm_head' also
    holds the head: it has no class). Returns (LD's layers, WD's layers)."""
    keep = [i for i, f in enumerate(raw["fqns"]) if re.search(r"\blayers\.\d+\.", f)]
    fqns = [raw["fqns"][i] for i in keep]
    raw["loss_increase"] = {fmt: [[b[i] for i in keep] for b in per_batch] for fmt, per_batch in raw["loss_increase"].items()}
    wd_all = raw.get("wd_fqns", raw["fqns"])
    wd_keep = [i for i, f in enumerate(wd_all) if re.search(r"\blayers\.\d+\.", f)]
    wd_fqns = [wd_all[i] for i in wd_keep]
    raw["update_deviation"] = {fmt: [[b[i] for i in wd_keep] for b in per_batch]
                               for fmt, per_batch in raw["update_deviation"].items()}
    return fqns, wd_fqns


def _outlier_lines(outliers: dict) -> list[str]:
    """The ``outlier`` lines: the medians of max/rms and kurtosis, the ten largest max/rms and down_proj's by
    block."""
    ratios = sorted(((o["max_over_rms"], f) for f, o in outliers.items()), reverse=True)
    lines = [f"outliers median max/rms {statistics.median(r for r, _ in ratios):.1f}; median kurtosis "
             f"{statistics.median(o['kurtosis'] for o in outliers.values()):.1f}"]
    for r, f in ratios[:10]:
        lines.append(f"outlier {f} max/rms {r:.0f} kurtosis {outliers[f]['kurtosis']:.0f}")
    down = [(o["max_over_rms"], f) for f, o in outliers.items() if f.endswith("down_proj")]
    lines.append("outlier down_proj max/rms by block: " + ", ".join(f"{block_of(f)}:{r:.0f}" for r, f in down))
    return lines


def _ld_estimate_lines(fmt: str, fqns: list[str], truth: list[float], raw: dict, outliers: dict, num_blocks: int,
                       halves, ceiling: float, class_rule: float, outlier_ratio: float) -> list[str]:
    """Where SNIP's LD misranks (the mean of the dump's rounds, what the aggregate approaches): the
    massive-activation layers (max/rms > outlier_ratio) against the rest, the class rule's out-of-sample
    layers (class_rule: its Spearman on them; halves: the truth's two halves, or None) and the layers
    misranked most. Returns the ``ld_estimate`` lines."""
    estimate = [statistics.mean(r[f]["loss_divergence"][fmt] for r in raw["rounds"]) for f in fqns]
    rank_t = _ranks(truth)
    rank_e = _ranks(estimate)
    heavy = [i for i, f in enumerate(fqns) if outliers[f]["max_over_rms"] > outlier_ratio]
    rest = [i for i in range(len(fqns)) if i not in heavy]

    def sub(idx):
        return float(spearmanr([estimate[i] for i in idx], [truth[i] for i in idx]).statistic) \
            if len(idx) > 2 else float("nan")

    classes = [layer_class(f, num_blocks) for f in fqns]
    shared = [i for i, c in enumerate(classes) if classes.count(c) > 1]  # the class rule's out-of-sample layers
    shared_ceiling = float(spearmanr([halves[0][i] for i in shared], [halves[1][i] for i in shared]).statistic) \
        if halves else float("nan")
    lines = [f"ld_estimate {fmt} on the class rule's out-of-sample layers({len(shared)}) {sub(shared):.3f} "
             f"(class rule {class_rule:.3f}; truth ceiling on them {shared_ceiling:.3f})"]
    worst = sorted(range(len(fqns)), key=lambda i: -abs(rank_e[i] - rank_t[i]))[:8]
    lines.append(f"ld_estimate {fmt} spearman_all {float(spearmanr(estimate, truth).statistic):.3f} "
                 f"outliers({len(heavy)}) {sub(heavy):.3f} rest({len(rest)}) {sub(rest):.3f} "
                 f"(ceiling {ceiling:.3f}; mean of {len(raw['rounds'])} rounds)")
    lines.append(f"# ld {fmt} most misranked (estimate rank / truth rank of {len(fqns)}, max/rms): " + ", ".join(
        f"{fqns[i]} {rank_e[i]:.0f}/{rank_t[i]:.0f} ({outliers[fqns[i]]['max_over_rms']:.0f})" for i in worst))
    return lines


def _ld_lines(fmt: str, per_batch: list, fqns: list[str], raw: dict, outliers: dict, num_blocks: int,
              profile: dict, outlier_ratio: float) -> list[str]:
    """One format's LD truth against the class rule (and SNIP's estimate, where the dump holds its rounds),
    added to profile; returns the ``ld_truth``, ``class_rule ld`` and ``ld_estimate`` lines."""
    truth = [sum(b[i] for b in per_batch) / len(per_batch) for i in range(len(fqns))]
    half = len(per_batch) // 2
    ceiling, halves = float("nan"), None  # (one batch: no halves)
    if half:
        first = [sum(b[i] for b in per_batch[:half]) / half for i in range(len(fqns))]
        second = [sum(b[i] for b in per_batch[half:]) / (len(per_batch) - half) for i in range(len(fqns))]
        ceiling, halves = float(spearmanr(first, second).statistic), (first, second)
    fit = class_fit(fqns, truth, num_blocks)
    fit["ceiling"] = ceiling
    profile["fits"][f"ld_{fmt}"] = fit
    for f, v in zip(fqns, truth):
        profile["layers"][f][f"ld_truth_{fmt}"] = v
    rank_ratio = float(spearmanr([outliers[f]["max_over_rms"] for f in fqns], truth).statistic)
    lines = [f"ld_truth {fmt} median {statistics.median(truth):.2e} max {max(truth):.2e} "
             f"({fqns[truth.index(max(truth))]}); negative {sum(v < 0 for v in truth)}/{len(truth)}; "
             f"ceiling {ceiling:.3f}; spearman with max/rms {rank_ratio:.3f}"]
    lines.append(f"class_rule ld {fmt} variance_explained {fit['variance_explained']:.3f} log "
                 f"{fit['variance_explained_log']:.3f} class_means_spearman {fit['class_means_spearman']:.3f} "
                 f"(ceiling {ceiling:.3f}; {fit['num_classes']} classes); out of sample: log "
                 f"{fit['loo_variance_explained_log']:.3f} spearman {fit['loo_class_means_spearman']:.3f} "
                 f"({fit['loo_layers']} layers)")
    lines.append(f"# ld {fmt} largest log10 residuals from the class means: "
                 + ", ".join(f"{f} {r:+.2f}" for f, r in fit["largest_residuals"]))
    if raw.get("rounds"):
        lines += _ld_estimate_lines(fmt, fqns, truth, raw, outliers, num_blocks, halves, ceiling,
                                    fit["loo_class_means_spearman"], outlier_ratio)
    return lines


def _wd_lines(fmt: str, per_batch: list, wd_fqns: list[str], num_blocks: int, profile: dict) -> list[str]:
    """One format's WD truth against the class rule, added to profile; returns the ``wd_truth`` and
    ``class_rule wd`` lines."""
    truth = [sum(sum(b[i]) / len(b[i]) for b in per_batch) / len(per_batch) for i in range(len(wd_fqns))]
    fit = class_fit(wd_fqns, truth, num_blocks)
    half = len(per_batch) // 2
    if half:
        first = [sum(sum(b[i]) / len(b[i]) for b in per_batch[:half]) / half for i in range(len(wd_fqns))]
        second = [sum(sum(b[i]) / len(b[i]) for b in per_batch[half:]) / (len(per_batch) - half)
                  for i in range(len(wd_fqns))]
        fit["ceiling"] = float(spearmanr(first, second).statistic)
    profile["fits"][f"wd_{fmt}"] = fit
    for f, v in zip(wd_fqns, truth):
        profile["layers"][f][f"wd_truth_{fmt}"] = v
    return [f"wd_truth {fmt} median {statistics.median(truth):.2e} max {max(truth):.2e} "
            f"({wd_fqns[truth.index(max(truth))]}); {len(wd_fqns)} layers; ceiling {fit.get('ceiling', float('nan')):.3f}",
            f"class_rule wd {fmt} variance_explained {fit['variance_explained']:.3f} log "
            f"{fit['variance_explained_log']:.3f} class_means_spearman {fit['class_means_spearman']:.3f}; "
            f"out of sample: log {fit['loo_variance_explained_log']:.3f} spearman "
            f"{fit['loo_class_means_spearman']:.3f} ({fit['loo_layers']} layers)"]


def main() -> None:
    args = _parser().parse_args()
    raw = json.loads(Path(args.truths).read_text())
    if "smollm2" not in raw:
        raise SystemExit(f"--truths: {args.truths} holds no smollm2 run (models: {', '.join(raw)}); run "
                         "divergence_fidelity.py --models smollm2 --dump it")
    raw = raw["smollm2"]
    torch.set_num_threads(args.threads)

    model = harness.SmolLM2LM()
    layers = {fqn: m for fqn, m in model.named_modules() if isinstance(m, torch.nn.Linear) and "lm_head" not in fqn}
    num_blocks = model.llama.config.num_hidden_layers
    tokens = ByteTextDataModule(None, seq_len=args.seq_len, tokenizer=model.tokenizer).load()
    train, _ = split_corpus(tokens, 0.05)
    _, held = harness.interleaved_split(train, 0.2, args.seed)
    gen = torch.Generator().manual_seed(args.seed + 7)
    stream = harness.batches(ByteWindows(held, args.seq_len), args.batch, gen)
    outliers = outlier_stats(model, layers, [next(stream) for _ in range(args.batches)])

    fqns, wd_fqns = _decoder_layers(raw)
    lines = [f"# {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC; {platform.machine()} python "
             f"{platform.python_version()} torch {torch.__version__}; SmolLM2-135M-Instruct, {len(fqns)} linears "
             f"profiled; outliers on {args.batches} held-out batches of {args.batch}x{args.seq_len} tokens; truths "
             f"from {args.truths}"]
    lines += _outlier_lines(outliers)
    profile = {"layers": {f: dict(o) for f, o in outliers.items()}, "fits": {}}
    for fmt, per_batch in raw["loss_increase"].items():
        lines += _ld_lines(fmt, per_batch, fqns, raw, outliers, num_blocks, profile, args.outlier_ratio)
    for fmt, per_batch in raw["update_deviation"].items():
        lines += _wd_lines(fmt, per_batch, wd_fqns, num_blocks, profile)
    print("\n".join(lines))
    if args.json:
        Path(args.json).write_text(json.dumps(profile, indent=1))


if __name__ == "__main__":
    main()
