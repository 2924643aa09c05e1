"""TensorBoard output of SNIPCallback: divergence scalars, plan scalars, a plan heatmap and table."""

from __future__ import annotations

import re
from collections.abc import Sequence

import torch

from lightning_snip.divergence import DivergenceResult
from lightning_snip.formats import Format
from lightning_snip.plan import Plan, split_key

# RGB per format for the plan image: high precision cool, FP4 warm.
FORMAT_COLORS = {
    Format.BF16: (70, 110, 200),
    Format.FP8: (90, 180, 120),
    Format.MXFP8: (140, 200, 90),
    Format.MXFP4: (240, 150, 40),
    Format.NVFP4: (220, 60, 50),
}


def divergence_scalars(result: DivergenceResult) -> dict[str, float]:
    """snip/ld/<fqn>/<format> and snip/wd/<fqn>/<format> for every finite value (bf16 is 0, skipped)."""
    out = {}
    for fqn, d in result.layers.items():
        for fmt, value in d.loss_divergence.items():
            if fmt is not Format.BF16 and value < float("inf"):
                out[f"snip/ld/{fqn}/{fmt.value}"] = value
        for fmt, value in d.weight_divergence.items():
            if fmt is not Format.BF16 and value < float("inf"):
                out[f"snip/wd/{fqn}/{fmt.value}"] = value
    return out


def plan_scalars(plan: Plan, num_changed: int) -> dict[str, float]:
    """``num_changed``: layers whose format the plan actually changed (a pinned layer never counts)."""
    return {
        "snip/fp4_fraction": plan.fp4_fraction,
        "snip/relative_gemm_cost": plan.relative_gemm_cost,
        "snip/plan_changes": float(num_changed),
    }


def _split(fqn: str) -> tuple[str, str]:
    """('3', 'attn.q') for 'layers.3.attn.q'; ('-', fqn) outside numbered blocks."""
    match = re.search(r"(?:^|\.)(\d+)\.(.+)$", fqn)
    return (match.group(1), match.group(2)) if match else ("-", fqn)


def plan_image(plan: Plan, cell: int = 16) -> torch.Tensor:
    """A (3, H, W) uint8 image: one row per block, one column per layer type, colored by format."""
    rows: list[str] = []
    cols: list[str] = []
    for fqn in plan:
        block, kind = _split(fqn)
        rows += [block] if block not in rows else []
        cols += [kind] if kind not in cols else []
    image = torch.full((3, len(rows), len(cols)), 255, dtype=torch.uint8)
    for fqn, fmt in plan.items():
        block, kind = _split(fqn)
        image[:, rows.index(block), cols.index(kind)] = torch.tensor(FORMAT_COLORS[fmt], dtype=torch.uint8)
    return image.repeat_interleave(cell, 1).repeat_interleave(cell, 2)


def plan_markdown(plan: Plan) -> str:
    """The plan table as TensorBoard text (markdown code block) with a color legend."""
    legend = ", ".join(f"{fmt.value} = rgb{FORMAT_COLORS[fmt]}" for fmt in Format)
    return f"```\n{plan.table()}\n```\n\nImage colors: {legend}"


def log_to_loggers(loggers: Sequence, step: int, scalars: dict[str, float], plan: Plan | None = None,
                   text: dict[str, str] | None = None) -> None:
    """Scalars to every Lightning logger; the plan image and table, and ``text`` (tag -> markdown), to
    TensorBoard loggers."""
    for logger in loggers:
        if scalars:
            logger.log_metrics(scalars, step=step)
        experiment = getattr(logger, "experiment", None)
        if text and hasattr(experiment, "add_text"):
            for tag, value in text.items():
                experiment.add_text(tag, value, global_step=step)
        if plan is not None and hasattr(experiment, "add_image") and hasattr(experiment, "add_text"):
            experiment.add_image("snip/plan", plan_image(plan), global_step=step)
            experiment.add_text("snip/plan_table", plan_markdown(plan), global_step=step)





def plan_agreement(plan: Plan, before: dict, layers) -> float:
    """Share of the switched (unpinned) layers, or of their GEMM directions in a per-GEMM plan, whose
    format ``plan`` keeps from ``before``."""
    unpinned = [key for key in plan if layers[split_key(key)[0]].pinned is None]
    if not unpinned:
        return 1.0
    return sum(1 for key in unpinned if plan[key] is before.get(key)) / len(unpinned)


def applied_plan_scalars(plan: Plan, num_changed: int, agreement: float) -> dict[str, float]:
    """What an applied plan logs (the metrics SNIPCallback's docstring lists)."""
    return {**plan_scalars(plan, num_changed), "snip/solver_seconds": plan.solve_seconds,
            "snip/noise_guarded_layers": len(plan.noise_guarded), "snip/plan_agreement": agreement}
