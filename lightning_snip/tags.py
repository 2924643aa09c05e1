"""Every ``snip/`` tag SNIP logs, in one table: the tag, when it is logged and what it means.

The modules that log write the tags as literals (``reporting.py``, ``controller.py``, ``callback.py``);
tests/test_tags.py checks that every such literal is a row here, and that this table is the one the callback's
docstring and docs/metrics.md give (and that the README names no other). Scalars go to every Lightning logger;
images and text to TensorBoard only. ``<fqn>``: a converted layer's name; ``<format>``: a candidate format's value.
Pure Python.
"""

from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True)
class Tag:
    name: str  # as logged, with <fqn> / <format> where the tag is one per layer (and format)
    when: str  # the event that logs it
    meaning: str
    kind: str = "scalar"  # scalar, image or text

    def matches(self, logged: str) -> bool:
        """Whether ``logged`` (a tag as written to a logger) is this one."""
        pattern = re.escape(self.name).replace(re.escape("<fqn>"), r".+").replace(re.escape("<format>"), r"[a-z0-9]+")
        return re.fullmatch(pattern, logged) is not None


ROUND, APPLIED, CANARY, WATCH = "statistics round", "plan applied", "plan canary", "loss watch"

TAGS: tuple[Tag, ...] = (
    Tag("snip/ld/<fqn>/<format>", ROUND, "forward loss divergence (relative loss increase) of the round, per layer and "
        "format, before the clamp at 0 that planning applies"),
    Tag("snip/wd/<fqn>/<format>", ROUND, "backward weight divergence (relative AdamW update deviation)"),
    Tag("snip/stats_seconds", ROUND, "the round's seconds on the device's timeline"),
    Tag("snip/wd_probe_rel_stderr", ROUND, "the median over layers and formats of the probes' relative standard error of "
        "WD's propagated term (this rank's; not logged when it is computed exactly)"),
    Tag("snip/invalid_formats", ROUND, "(layer, format) candidates the round found non-finite, left out of its "
        "evidence and named in one warning; non-zero is a fault to look into"),
    Tag("snip/grad_noise_ratio/<fqn>", ROUND, "the gradient-noise guard's ratio ‖GᵀX‖ / ‖Q(G)ᵀQ(X) − GᵀX‖ "
        "for the best FP4 candidate (logged with the guard on or off)"),
    Tag("snip/overhead", "when SNIP's priced time grows, and at the end", "SNIP's measured time over training's so "
        "far, on the device's timeline (what overhead_budget bounds; lightning_snip.budget)"),
    Tag("snip/solver_seconds", APPLIED, "the ILP solve's seconds"),
    Tag("snip/fp4_fraction", APPLIED, "FP4 share of the converted layers' linear FLOPs under the applied plan"),
    Tag("snip/fp4_fraction_switchable", APPLIED, "the same share of the switchable (unpinned) layers' FLOPs"),
    Tag("snip/relative_gemm_cost", APPLIED, "the applied plan's GEMM cost relative to all-bf16"),
    Tag("snip/plan_changes", APPLIED, "layers whose format the applied plan changed"),
    Tag("snip/plan_agreement", APPLIED, "share of the switched layers' formats the new plan keeps"),
    Tag("snip/round_stretch", APPLIED, "the round spacing's multiple of the budget's (1-8: steady plans stretch it)"),
    Tag("snip/noise_guarded_layers", APPLIED, "layers whose backward the gradient-noise guard kept out of FP4"),
    Tag("snip/plan", APPLIED, "blocks x layer types, colored by format", "image"),
    Tag("snip/plan_table", APPLIED, "the plan as a table", "text"),
    Tag("snip/canary_reverts", CANARY, "GEMM directions the plan canary put back so far (lightning_snip.canary)"),
    Tag("snip/canary_worst_ratio", CANARY, "the largest ratio of a training path's error to the round's path's"),
    Tag("snip/canary_seconds", CANARY, "the check's seconds"),
    Tag("snip/canary_reason", CANARY, "what the canary put back, and why", "text"),
    Tag("snip/plan_cost_at_switch", "switch", "what the new plan's formats cost on the switch's batch (the loss "
        "watch's offset)"),
    Tag("snip/loss_watch_unconfirmed", WATCH, "alarms the same batch found were not the plan's (the watch goes on "
        "from a new baseline; lightning_snip.spike_guard)"),
    Tag("snip/plan_reverted", WATCH, "1 at a step where the loss watch reverted the last plan's changes"),
    Tag("snip/spike_reverts", WATCH, "the loss watch's reverts so far"),
    Tag("snip/plan_reverted_reason", WATCH, "why the loss watch reverted", "text"),
)


def tag_for(logged: str) -> Tag | None:
    """The row of a tag as logged (None: not SNIP's)."""
    return next((tag for tag in TAGS if tag.matches(logged)), None)


def markdown_table() -> str:
    """The table as docs/metrics.md gives it."""
    rows = ["| tag | kind | when | meaning |", "|---|---|---|---|"]
    rows += [f"| `{t.name}` | {t.kind} | {t.when} | {t.meaning} |" for t in TAGS]
    return "\n".join(rows)
