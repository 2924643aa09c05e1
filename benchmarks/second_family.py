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
import datetime
import json
import math
import os
import platform
import statistics as st
import time
from pathlib import Path

import compare_policies as cp  # the script's own folder is on the path, as for every benchmark
from harness import bench_dir
import ld_variance as lv
import round_estimator as re_

SETTING = "gemma3"
VARIANTS = ("today", "scaled_anti")


def measure(s: cp.Setup, store: Path, seeds: int) -> None:
    import torch

    torch.set_num_threads(int(os.environ.get("SNIP_THREADS", "2")))
    work = bench_dir(SETTING)
    ckpt, measured = cp.prepare(s, work, store, truths=False)
    module, optimizer, data = cp.from_checkpoint(s, ckpt)
    _rounds(s, store, seeds, module, optimizer)  # first: minutes, where the truths take an hour (and resume by part)
    if "truths" not in measured:
        model, layers = cp.truth_model(s, module)
        fp4 = dataclasses.replace(s, candidates=(s.low,))  # the FP4 truths only (the Spearman's pairs)
        measured.update(cp.measure_truths(fp4, model, optimizer, layers, data, parts=store / "truth_parts.json", chunk=21))
        (store / "measured.json").write_text(json.dumps({"setting": cp.setting_record(s), "measured": measured}))


def _rounds(s: cp.Setup, store: Path, seeds: int, module, optimizer) -> None:
    """The library's round at the defaults on each seed's first batch, with each probe variant (rounds.jsonl)."""
    from lightning_snip.config import SNIPConfig
    from lightning_snip.convert import convert_linears

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


def partial_truths(store: Path) -> tuple[dict, dict, int]:
    """LD's truths and ceiling from the LD batches measured so far (truth_parts.json), while the WD part runs: the
    mean loss increase per layer (ranked as the relative one: one checkpoint's base loss divides them all alike)."""
    from harness import spearman

    parts = json.loads((store / "truth_parts.json").read_text()) if (store / "truth_parts.json").exists() else {}
    batches = [parts[k] for k in sorted(parts) if k.startswith("ld")]
    if len(batches) < 2:
        return {}, {}, len(batches)
    values = {}
    for batch in batches:
        for fqn, fmt, v in batch:
            values.setdefault(f"model.{fqn}|{fmt}", []).append(v)
    fmt = batches[0][0][1]
    half = len(batches) // 2
    keys = sorted(values)
    split = spearman([st.fmean(values[k][:half]) for k in keys], [st.fmean(values[k][half:]) for k in keys])
    return ({"loss_divergence": {k: st.fmean(v) for k, v in values.items()}, "weight_divergence": {}},
            {f"loss_{fmt}": split, f"weights_{fmt}": math.nan}, len(batches))


def report(store: Path) -> list[str]:
    measured = json.loads((store / "measured.json").read_text())["measured"]
    if "truths" in measured:
        truths, ceilings, batches = measured["truths"], measured["ceilings"], cp.SETTINGS[SETTING].truth_batches
    else:
        truths, ceilings, batches = partial_truths(store)
        if not truths:
            return ["no truths yet (fewer than 2 LD batches measured)"]
    rows = [json.loads(line) for line in (store / "rounds.jsonl").read_text().splitlines()]

    def ceiling(r: float) -> float:  # an error-free estimate's Spearman with the whole truths (Spearman-Brown)
        return math.sqrt(2 * r / (1 + r)) if r > 0 else math.nan

    fmt = next(k.partition("_")[2] for k in ceilings if k.startswith("loss_"))
    lines = [f"Truths ({fmt}; LD from {batches} batches): LD split-half Spearman {ceilings[f'loss_{fmt}']:.2f} (ceiling "
             f"{ceiling(ceilings[f'loss_{fmt}']):.2f}), WD split-half {ceilings[f'weights_{fmt}']:.2f} (ceiling "
             f"{ceiling(ceilings[f'weights_{fmt}']):.2f}); {measured.get('truth_seconds', math.nan):.0f} s", "",
             "| probe | LD Spearman per seed | mean | WD Spearman per seed | mean | round s (mean) |", "|---|---|---|---|---|---|"]
    for variant in VARIANTS:
        runs = sorted((r for r in rows if r["variant"] == variant), key=lambda r: r["seed"])
        if not runs:
            continue
        ld = [re_.fp4_spearman(r["estimates"]["loss_divergence"], truths["loss_divergence"]) for r in runs]
        wd = [re_.fp4_spearman(r["estimates"]["weight_divergence"], truths["weight_divergence"])
              if truths["weight_divergence"] else math.nan for r in runs]
        lines.append(f"| {variant} | {' '.join(f'{v:+.2f}' for v in ld)} | {st.fmean(ld):+.2f} | "
                     f"{' '.join(f'{v:+.2f}' for v in wd)} | {st.fmean(wd):+.2f} | "
                     f"{st.fmean(r['seconds'] for r in runs):.1f} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--store", type=Path, default=cp.RESULTS / "second_family_cache")
    parser.add_argument("--report-only", action="store_true")
    parser.add_argument("--write", action="store_true", help="also write benchmarks/results/second_family_<date>.md")
    args = parser.parse_args()
    args.store.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    if not args.report_only:
        measure(cp.SETTINGS[SETTING], args.store, args.seeds)
    lines = report(args.store)
    print("\n".join(lines) + f"\n\nwall {time.perf_counter() - start:.0f} s (this invocation)")
    if args.write:
        out = cp.RESULTS / f"second_family_{datetime.date.today().isoformat()}.md"
        head = [f"# One round's LD and WD on Gemma 3 270M against its own truths ({datetime.date.today().isoformat()}, "
                "issue 64, Deliver 3)", "", (__doc__ or "").split("\n\n")[1].replace("\n", " "), "",
                f"command: `python benchmarks/second_family.py --seeds {args.seeds}`; machine: {platform.machine()} "
                f"({os.cpu_count()} cores), Python {platform.python_version()}; FP4 emulated; setting: "
                f"{cp.setting_record(cp.SETTINGS[SETTING])}", ""]
        out.write_text("\n".join(head + lines) + "\n")


if __name__ == "__main__":
    main()
