"""Issue 64, Deliver 3: one statistics round's LD and WD on a second pretrained family, against its own truths.

Gemma 3 270M (Google; compare_policies' ``gemma3`` setting: continued from the base model after 4 warmup steps of 4 x
128 tokens of the bundled corpus, as SmolLM2's quality protocol) at the library's defaults as a new user meets them:
the LM head (tied, 63% of the linear FLOPs) pinned to bf16, the FP4 candidate nvfp4 with the library's recipe, 256
rows a round. Its truths at the checkpoint (compare_policies.measure_truths, the FP4 candidate only: LD over 4
batches, with the split-half ceiling; WD over 2 stochastic-rounding seeds, with theirs), then the library's round on
seed s's first batch, s = 0..2, with today's error probe and the scaled antithetic one (round_estimator's variants):
Spearman of LD and of WD against the truths per seed, beside the ceilings.

    python benchmarks/second_family.py              # measures what the store lacks (truths resume by part), reports
    python benchmarks/second_family.py --report-only
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import statistics as st
import tempfile
import time
from pathlib import Path

import compare_policies as cp  # the script's own folder is on the path, as for every benchmark
import ld_variance as lv
import round_estimator as re_

SETTING = "gemma3"
VARIANTS = ("today", "scaled_anti")


def measure(s: cp.Setup, store: Path, seeds: int) -> None:
    import torch

    from lightning_snip.config import SNIPConfig
    from lightning_snip.convert import convert_linears

    torch.set_num_threads(int(os.environ.get("SNIP_THREADS", "2")))
    work = Path(os.environ.get("SNIP_BENCH_DIR", os.path.join(tempfile.gettempdir(), "snip_compare_v2"))) / SETTING
    work.mkdir(parents=True, exist_ok=True)
    ckpt, measured = cp.prepare(s, work, store, truths=False)
    module, optimizer, data = cp.from_checkpoint(s, ckpt)
    if "truths" not in measured:
        model, layers = cp.truth_model(s, module)
        fp4 = dataclasses.replace(s, candidates=(s.low,))  # the FP4 truths only (the Spearman's pairs)
        measured.update(cp.measure_truths(fp4, model, optimizer, layers, data, parts=store / "truth_parts.json", chunk=21))
        (store / "measured.json").write_text(json.dumps({"setting": cp.setting_record(s), "measured": measured}))
    model = cp.truth_model(s, module)[0]
    layers = convert_linears(module.model, pins=cp.PINS)
    config = SNIPConfig(candidate_formats=list(s.candidates), max_rows=s.max_rows)
    runs = store / "rounds.jsonl"
    done = {(r["seed"], r["variant"]) for r in map(json.loads, runs.read_text().splitlines())} if runs.exists() else set()
    for seed in range(seeds):
        batch = lv.round_batch(s, seed)
        for variant in VARIANTS:
            if (seed, variant) not in done:
                r = re_.one_round(model, layers, optimizer, config, batch, variant, None, seed)
                with runs.open("a") as f:
                    f.write(json.dumps({"seed": seed, "variant": variant, **r}) + "\n")
                print(f"seed {seed} {variant}: {r['seconds']:.1f} s", flush=True)


def report(store: Path) -> list[str]:
    measured = json.loads((store / "measured.json").read_text())["measured"]
    truths, ceilings = measured["truths"], measured["ceilings"]
    rows = [json.loads(line) for line in (store / "rounds.jsonl").read_text().splitlines()]

    def ceiling(r: float) -> float:  # an error-free estimate's Spearman with the whole truths (Spearman-Brown)
        return math.sqrt(2 * r / (1 + r)) if r > 0 else math.nan

    fmt = next(k.partition("_")[2] for k in ceilings if k.startswith("loss_"))
    lines = [f"Truths ({fmt}): LD split-half Spearman {ceilings[f'loss_{fmt}']:.2f} (ceiling "
             f"{ceiling(ceilings[f'loss_{fmt}']):.2f}), WD split-half {ceilings[f'weights_{fmt}']:.2f} (ceiling "
             f"{ceiling(ceilings[f'weights_{fmt}']):.2f}); {measured.get('truth_seconds', math.nan):.0f} s", "",
             "| probe | LD Spearman per seed | mean | WD Spearman per seed | mean | round s (mean) |", "|---|---|---|---|---|---|"]
    for variant in VARIANTS:
        runs = sorted((r for r in rows if r["variant"] == variant), key=lambda r: r["seed"])
        if not runs:
            continue
        ld = [re_.fp4_spearman(r["estimates"]["loss_divergence"], truths["loss_divergence"]) for r in runs]
        wd = [re_.fp4_spearman(r["estimates"]["weight_divergence"], truths["weight_divergence"]) for r in runs]
        lines.append(f"| {variant} | {' '.join(f'{v:+.2f}' for v in ld)} | {st.fmean(ld):+.2f} | "
                     f"{' '.join(f'{v:+.2f}' for v in wd)} | {st.fmean(wd):+.2f} | "
                     f"{st.fmean(r['seconds'] for r in runs):.1f} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--store", type=Path, default=cp.RESULTS / "second_family_cache")
    parser.add_argument("--report-only", action="store_true")
    args = parser.parse_args()
    args.store.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    if not args.report_only:
        measure(cp.SETTINGS[SETTING], args.store, args.seeds)
    print("\n".join(report(args.store)) + f"\n\nwall {time.perf_counter() - start:.0f} s (this invocation)")


if __name__ == "__main__":
    main()
