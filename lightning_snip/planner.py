"""The SNIP plan as an integer linear program on python-mip (the fixed-rule baselines are in lightning_snip.baselines).

Pure Python: imports no torch, so a plan can be solved offline from saved metrics.

    minimize    sum_{l,p} (LD(l,p) + lambda * WD(l,p)) x(l,p)
    subject to  sum_p x(l,p) = 1                                         for every layer l
                sum_{l in s} F_l x(l, fp4) >= r * sum_{l in s} F_l       (FP4 FLOPs fraction), or
                sum_{l in s,p} F_l cost_p x(l,p) <= b * sum_{l in s} F_l  (relative cost budget)
                for the whole model, or for each pipeline stage s
                x(l, pin_l) = 1                                          for pinned layers

A format whose divergence is +inf (e.g. non-finite statistics) is not a candidate for that layer.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Collection, Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType

from lightning_snip.formats import DEFAULT_RELATIVE_COST, FP4_FORMATS, Format
from lightning_snip.plan import BACKWARD, FORWARD, Plan, SolveStatus, gemm_key, split_key

# lambda in LD + lambda * WD. The method text's default is 1; 0.1 was chosen by measurement
# (benchmarks/results/compare_policies_v2_lambda_2026-11-30.md, two 8-block settings): the two terms are
# in different units (a relative loss increase vs a relative squared update deviation), and at 1 the
# ILP priced FP4 backward GEMMs (stochastic rounding: noise far below the gradient's own batch noise)
# above FP4 forwards. At 0.1 SNIP per GEMM at the backward-only fraction (0.64) came within noise of
# backward-only FP4 (gap 0.0023 vs 0.0018; at lambda 1: 0.0044, paired t -1.6), its plans served with FP4
# forwards lost 31% / 21% less (0.75: 0.0054 vs 0.0078 on one setting, 0.0063 vs 0.0080 on the other), and
# no gap measured got worse beyond noise (per layer: within noise either way).
DEFAULT_WEIGHT_DIVERGENCE_WEIGHT = 0.1

logger = logging.getLogger(__name__)


class PlanInfeasibleError(ValueError):
    """No assignment of formats meets the target under the pins and candidate formats."""


class SolverTimeoutError(RuntimeError):
    """The solver hit its time limit before finding any feasible plan."""


@dataclass(frozen=True)
class LayerCandidates:
    """One layer's choices: its FLOPs per step and its divergence for each candidate format."""

    fqn: str
    flops: float
    loss_divergence: Mapping[Format, float]
    weight_divergence: Mapping[Format, float]
    pinned: Format | None = None
    extra_cost: Mapping[Format, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.flops, (int, float)) or not math.isfinite(self.flops) or self.flops < 0:
            raise ValueError(f"flops of {self.fqn}: must be a finite number >= 0, got {self.flops!r}")
        extra = {Format.parse(f, field_name=f"extra_cost of {self.fqn}"): float(v) for f, v in self.extra_cost.items()}
        bad = {f.value: v for f, v in extra.items() if not (math.isfinite(v) and v >= 0)}
        if bad:
            raise ValueError(f"extra_cost of {self.fqn}: must be finite numbers >= 0, got {bad}")
        object.__setattr__(self, "extra_cost", MappingProxyType(extra))
        ld = _parse_metric(self.loss_divergence, f"loss_divergence of {self.fqn}")
        wd = _parse_metric(self.weight_divergence, f"weight_divergence of {self.fqn}")
        if set(ld) != set(wd):
            raise ValueError(
                f"weight_divergence of {self.fqn}: formats {sorted(f.value for f in wd)} differ from "
                f"loss_divergence's {sorted(f.value for f in ld)}"
            )
        if not ld:
            raise ValueError(f"loss_divergence of {self.fqn}: needs at least one candidate format")
        object.__setattr__(self, "loss_divergence", MappingProxyType(ld))
        object.__setattr__(self, "weight_divergence", MappingProxyType(wd))
        if self.pinned is not None:
            object.__setattr__(self, "pinned", Format.parse(self.pinned, field_name=f"pinned of {self.fqn}"))

    def cost(self, fmt: Format, relative_cost: Mapping[Format, float]) -> float:
        """The relative cost per FLOP of this layer (or GEMM item) in ``fmt``: the format's, plus what the layer's
        recipe adds in it (``extra_cost``: the RHT on an FP4 wgrad, formats.hadamard_backward_cost)."""
        return relative_cost[fmt] + self.extra_cost.get(fmt, 0.0)

    def choices(self) -> list[Format]:
        """Formats this layer may take: its pin, or every candidate with finite divergence."""
        if self.pinned is not None:
            return [self.pinned]
        return [
            f for f in self.loss_divergence if math.isfinite(self.loss_divergence[f]) and math.isfinite(self.weight_divergence[f])
        ]

    def score(self, fmt: Format, weight_divergence_weight: float) -> float:
        if self.pinned is not None and fmt not in self.loss_divergence:
            return 0.0  # a pinned format without metrics contributes a constant
        return self.loss_divergence[fmt] + weight_divergence_weight * self.weight_divergence[fmt]


def _parse_metric(metric: Mapping[Format, float], name: str) -> dict[Format, float]:
    out = {}
    for key, value in metric.items():
        fmt = Format.parse(key, field_name=name)
        value = float(value)
        if math.isnan(value) or value == -math.inf:
            raise ValueError(f"{name}[{fmt.value}]: must be a number or +inf (format excluded), got {value!r}")
        out[fmt] = value
    return out


@dataclass(frozen=True)
class _Target:
    fp4_fraction: float | None
    cost_budget: float | None
    relative_cost: Mapping[Format, float] = field(default_factory=lambda: dict(DEFAULT_RELATIVE_COST))

    def describe(self) -> str:
        if self.fp4_fraction is not None:
            return f"FP4 FLOPs fraction >= {self.fp4_fraction}"
        return f"relative GEMM cost <= {self.cost_budget}"


def _validate(layers, fp4_fraction, cost_budget, stages, relative_cost) -> tuple[_Target, dict[Hashable, list[LayerCandidates]]]:
    if not layers:
        raise ValueError("layers: at least one layer is needed")
    fqns = [layer.fqn for layer in layers]
    if len(set(fqns)) != len(fqns):
        raise ValueError(f"layers: duplicate fqn(s) {sorted({f for f in fqns if fqns.count(f) > 1})}")
    if (fp4_fraction is None) == (cost_budget is None):
        raise ValueError(
            f"fp4_fraction / cost_budget: give exactly one of them, got fp4_fraction={fp4_fraction!r}, cost_budget={cost_budget!r}"
        )
    if fp4_fraction is not None and not (isinstance(fp4_fraction, (int, float)) and 0.0 <= fp4_fraction <= 1.0):
        raise ValueError(f"fp4_fraction: must be in [0, 1], got {fp4_fraction!r}")
    if cost_budget is not None and not (isinstance(cost_budget, (int, float)) and cost_budget > 0 and math.isfinite(cost_budget)):
        raise ValueError(f"cost_budget: must be a positive number (relative to all-bf16 = 1.0), got {cost_budget!r}")
    costs = {Format.parse(k, field_name="relative_cost"): float(v) for k, v in relative_cost.items()}
    groups: dict[Hashable, list[LayerCandidates]] = {}
    if stages is None:
        groups[None] = list(layers)
    else:
        missing = [f for f in fqns if f not in stages]
        unknown = [f for f in stages if f not in set(fqns)]
        if missing or unknown:
            raise ValueError(f"stages: every layer needs a stage; missing {missing[:5]}, unknown fqns {unknown[:5]}")
        for layer in layers:
            groups.setdefault(stages[layer.fqn], []).append(layer)
    for layer in layers:
        if not layer.choices():
            raise PlanInfeasibleError(f"layer {layer.fqn}: every candidate format has infinite divergence")
        unknown_cost = [f.value for f in layer.choices() if f not in costs]
        if unknown_cost:
            raise ValueError(f"relative_cost: no cost for {unknown_cost} (layer {layer.fqn})")
    target = _Target(fp4_fraction, cost_budget, costs)
    for stage, group in groups.items():
        _check_reachable(stage, group, target)
    return target, groups


def _check_reachable(stage, group: Sequence[LayerCandidates], target: _Target) -> None:
    """Each layer is chosen independently, so the best reachable value of one linear constraint is
    the sum of the per-layer extremes: an exact feasibility test that names the failing stage."""
    total = sum(layer.flops for layer in group)
    where = "the model" if stage is None else f"pipeline stage {stage!r}"
    if total == 0:
        return
    if target.fp4_fraction is not None:
        best = sum(layer.flops for layer in group if any(f.is_fp4 for f in layer.choices())) / total
        if best < target.fp4_fraction - 1e-12:
            blocked = [layer.fqn for layer in group if not any(f.is_fp4 for f in layer.choices())]
            raise PlanInfeasibleError(
                f"{where}: FP4 FLOPs fraction {target.fp4_fraction} is unreachable; at most {best:.4f} of its FLOPs "
                f"can run in FP4 because {len(blocked)} layer(s) are pinned or have no finite FP4 candidate "
                f"(e.g. {blocked[:3]})"
            )
    else:
        best = sum(layer.flops * min(layer.cost(f, target.relative_cost) for f in layer.choices()) for layer in group) / total
        if best > target.cost_budget + 1e-12:
            raise PlanInfeasibleError(
                f"{where}: relative cost budget {target.cost_budget} is unreachable; the cheapest choice the pins "
                f"and candidates allow costs {best:.4f}"
            )


def check_target(
    layers: Sequence[LayerCandidates],
    *,
    fp4_fraction: float | None = None,
    cost_budget: float | None = None,
    stages: Mapping[str, Hashable] | None = None,
    relative_cost: Mapping[Format, float] = DEFAULT_RELATIVE_COST,
) -> None:
    """Raise what ``solve_plan`` would raise for the target alone, before any divergence exists:
    whether the pins and the layers' allowed formats can meet it at all (SNIPCallback calls it at
    fit start, so an impossible target fails then, not at the first plan).

    Raises:
        ValueError: bad arguments. PlanInfeasibleError: the target is unreachable (names the stage).
    """
    _validate(layers, fp4_fraction, cost_budget, stages, relative_cost)


def solve_plan(
    layers: Sequence[LayerCandidates],
    *,
    fp4_fraction: float | None = None,
    cost_budget: float | None = None,
    stages: Mapping[str, Hashable] | None = None,
    weight_divergence_weight: float = DEFAULT_WEIGHT_DIVERGENCE_WEIGHT,
    time_limit_seconds: float = 10.0,
    relative_cost: Mapping[Format, float] = DEFAULT_RELATIVE_COST,
) -> Plan:
    """Solve the SNIP ILP (module docstring) with CBC and return the plan.

    Raises:
        ValueError: bad arguments (named).
        PlanInfeasibleError: no plan meets the target (names the constraint and stage).
        SolverTimeoutError: the time limit passed with no feasible plan found.
    """
    import mip

    if not (isinstance(weight_divergence_weight, (int, float)) and weight_divergence_weight >= 0 and math.isfinite(weight_divergence_weight)):
        raise ValueError(f"weight_divergence_weight: must be a finite number >= 0, got {weight_divergence_weight!r}")
    if not (isinstance(time_limit_seconds, (int, float)) and time_limit_seconds > 0):
        raise ValueError(f"time_limit_seconds: invalid value {time_limit_seconds!r}; allowed: a number of seconds > 0")
    target, groups = _validate(layers, fp4_fraction, cost_budget, stages, relative_cost)
    start = time.perf_counter()

    choices = {layer.fqn: _undominated(layer, target, weight_divergence_weight) for layer in layers}
    scores = {(layer.fqn, f): layer.score(f, weight_divergence_weight) for layer in layers for f in choices[layer.fqn]}
    # Scale the objective to O(1) so CBC's absolute tolerances do not round small divergences to zero.
    scale = max((abs(s) for s in scores.values()), default=0.0) or 1.0

    model = mip.Model(sense=mip.MINIMIZE, solver_name=mip.CBC)
    model.verbose = 0
    model.threads = 1
    x = {key: model.add_var(var_type=mip.BINARY, name=f"x{i}") for i, key in enumerate(scores)}
    for layer in layers:
        model += mip.xsum(x[layer.fqn, f] for f in choices[layer.fqn]) == 1
    for group in groups.values():
        total = sum(layer.flops for layer in group)
        if total == 0:
            continue
        # FLOPs as shares of the stage's total keep coefficients O(1) at 405B scale too.
        share = {layer.fqn: layer.flops / total for layer in group}
        if target.fp4_fraction is not None:
            model += (
                mip.xsum(share[layer.fqn] * x[layer.fqn, f] for layer in group for f in choices[layer.fqn] if f.is_fp4)
                >= target.fp4_fraction - 1e-9
            )
        else:
            model += (
                mip.xsum(share[layer.fqn] * layer.cost(f, target.relative_cost) * x[layer.fqn, f] for layer in group for f in choices[layer.fqn])
                <= target.cost_budget + 1e-9
            )
        if target.fp4_fraction is not None:
            for better, worse in _interchangeable_pairs(group, choices, scores):
                model += x[better] >= x[worse]
    model.objective = mip.xsum((scores[key] / scale) * var for key, var in x.items())
    status = model.optimize(max_seconds=time_limit_seconds)
    seconds = time.perf_counter() - start

    if status == mip.OptimizationStatus.INFEASIBLE:
        raise PlanInfeasibleError(f"the solver proved {target.describe()} infeasible under the pins and candidates")
    if status not in (mip.OptimizationStatus.OPTIMAL, mip.OptimizationStatus.FEASIBLE):
        raise SolverTimeoutError(
            f"no feasible plan within time_limit_seconds={time_limit_seconds} (solver status {status.name})"
        )
    formats = {layer.fqn: next(f for f in choices[layer.fqn] if x[layer.fqn, f].x >= 0.5) for layer in layers}
    objective = sum(scores[fqn, f] for fqn, f in formats.items())
    plan = Plan(
        formats=formats, flops={layer.fqn: layer.flops for layer in layers},
        relative_cost=target.relative_cost,
        extra_cost={layer.fqn: layer.extra_cost for layer in layers if layer.extra_cost},
        policy="snip",
        status=SolveStatus.OPTIMAL if status == mip.OptimizationStatus.OPTIMAL else SolveStatus.FEASIBLE,
        objective=objective,
        solve_seconds=seconds,
    )
    if plan.status is SolveStatus.FEASIBLE:
        logger.warning("solver time limit (%ss) reached: using the best feasible plan found, not proven optimal", time_limit_seconds)
    return plan


def _interchangeable_pairs(group: Sequence[LayerCandidates], choices: Mapping[str, list[Format]],
                           scores: Mapping[tuple[str, Format], float]) -> list[tuple[tuple[str, Format], tuple[str, Format]]]:
    """Symmetry-breaking constraints x(a, fp4_a) >= x(b, fp4_b) under an FP4-fraction target.

    Layers of one stage with equal FLOPs and two choices left (one FP4, one not) are interchangeable
    in the constraint: for any plan that puts some of them in FP4, putting the same number of those
    with the smallest score increase (FP4 score - other score) there instead is as feasible and no
    worse. So an optimum exists that fills each such class in that order; saying so removes the
    equivalent branches that made CBC's optimality proof slow on models of identical blocks (7B:
    up to 1.6 s for 224 layers, benchmarks/results/planner_scale_gemm_2026-11-30.md).
    Returns (better, worse) variable keys, consecutive in each class's order."""
    classes: dict[float, list[tuple[float, str, Format]]] = {}
    for layer in group:
        options = choices[layer.fqn]
        if len(options) != 2 or options[0].is_fp4 == options[1].is_fp4:
            continue
        fp4, other = (options[0], options[1]) if options[0].is_fp4 else (options[1], options[0])
        increase = scores[layer.fqn, fp4] - scores[layer.fqn, other]
        classes.setdefault(layer.flops, []).append((increase, layer.fqn, fp4))
    pairs = []
    for members in classes.values():
        members.sort(key=lambda m: (m[0], m[1]))
        pairs.extend(((a[1], a[2]), (b[1], b[2])) for a, b in zip(members, members[1:]))
    return pairs


# Granularity "gemm" (issue 12, in progress): a layer's forward GEMM and its backward GEMMs (dgrad and
# wgrad together) each get a format. The forward is a third of the layer's GEMM FLOPs, the backward
# two thirds; LD is the forward's cost, lambda * WD the backward's. Both the objective and every
# target constraint are sums over (layer, direction), so the pair ILP is the per-layer ILP over
# 2 x layers "direction" items: each layer's forward and backward choices are independent given the
# constraints, and the 9 pairs of 3 formats never need enumerating.
FORWARD_SHARE = 1.0 / 3.0


def split_directions(layer: LayerCandidates) -> tuple[LayerCandidates, LayerCandidates]:
    """A layer as its forward item (flops/3, LD only) and backward item (2 flops/3, WD only)."""
    ld, wd = layer.loss_divergence, layer.weight_divergence
    # A format excluded in one direction (infinite divergence) stays excluded in both: the layer's
    # shape or statistics rule it out, not the direction.
    excluded = {f for f in ld if not (math.isfinite(ld[f]) and math.isfinite(wd[f]))}
    forward = LayerCandidates(
        fqn=gemm_key(layer.fqn, FORWARD), flops=layer.flops * FORWARD_SHARE, pinned=layer.pinned,
        loss_divergence={f: math.inf if f in excluded else v for f, v in ld.items()},
        weight_divergence={f: math.inf if f in excluded else 0.0 for f in wd})
    backward = LayerCandidates(
        fqn=gemm_key(layer.fqn, BACKWARD), flops=layer.flops * (1 - FORWARD_SHARE), pinned=layer.pinned,
        loss_divergence={f: math.inf if f in excluded else 0.0 for f in ld},
        weight_divergence={f: math.inf if f in excluded else v for f, v in wd.items()},
        # the layer's extra cost is the backward's (the RHT is on the wgrad), per FLOP of the backward's share
        extra_cost={f: v / (1 - FORWARD_SHARE) for f, v in layer.extra_cost.items()})
    return forward, backward


def keep_out_of_fp4(layer: LayerCandidates, formats: Collection[Format] | None = None) -> LayerCandidates:
    """The layer (or GEMM item) with ``formats`` (default: every FP4 format) excluded; bf16 at zero
    divergence where no other format is left. A pinned layer is returned as it is (a pin wins over
    the noise guard)."""
    if layer.pinned is not None:
        return layer
    out = set(formats) if formats is not None else FP4_FORMATS
    ld = {f: math.inf if f in out else v for f, v in layer.loss_divergence.items()}
    wd = {f: math.inf if f in out else v for f, v in layer.weight_divergence.items()}
    if not any(math.isfinite(ld[f]) and math.isfinite(wd[f]) for f in ld):
        ld[Format.BF16] = wd[Format.BF16] = 0.0
    return LayerCandidates(fqn=layer.fqn, flops=layer.flops, loss_divergence=ld, weight_divergence=wd,
                           extra_cost=layer.extra_cost)


def max_fp4_fraction(layers: Sequence[LayerCandidates]) -> float:
    """The largest FP4 FLOPs fraction any plan over these layers (or GEMM items) can reach."""
    total = sum(layer.flops for layer in layers)
    reachable = sum(layer.flops for layer in layers if any(f.is_fp4 for f in layer.choices()))
    return reachable / total if total else 0.0


def min_relative_cost(layers: Sequence[LayerCandidates], relative_cost: Mapping[Format, float] = DEFAULT_RELATIVE_COST) -> float:
    """The lowest relative GEMM cost any plan over these layers (or GEMM items) can reach."""
    total = sum(layer.flops for layer in layers)
    cheapest = sum(layer.flops * min(layer.cost(f, relative_cost) for f in layer.choices()) for layer in layers)
    return cheapest / total if total else 0.0


def gemm_items(layers: Sequence[LayerCandidates],
               backward_blocked: Mapping[str, Collection[Format]] | Collection[str] = ()) -> list[LayerCandidates]:
    """Each layer's forward and backward items (split_directions). ``backward_blocked``: fqn -> the
    formats its backward may not take (the gradient-noise guard), or fqns kept out of every FP4 format."""
    items = []
    for layer in layers:
        forward, backward = split_directions(layer)
        if layer.fqn in backward_blocked:
            formats = backward_blocked[layer.fqn] if isinstance(backward_blocked, Mapping) else None
            backward = keep_out_of_fp4(backward, formats)
        items += [forward, backward]
    return items


def solve_gemm_plan(layers: Sequence[LayerCandidates], *, stages: Mapping[str, Hashable] | None = None,
                    backward_blocked: Mapping[str, Collection[Format]] | Collection[str] = (), **targets) -> Plan:
    """The SNIP ILP at granularity "gemm": a Plan keyed by ``gemm_key(fqn, FORWARD | BACKWARD)``,
    whose FLOPs accounting (fp4_fraction, relative_gemm_cost) is per GEMM direction. Pins hold both
    directions; stages apply to both. ``backward_blocked``: fqns whose backward may not be FP4.
    ``targets``: ``solve_plan``'s keyword arguments (fp4_fraction, cost_budget,
    weight_divergence_weight, time_limit_seconds, relative_cost); raises as it does."""
    items = gemm_items(layers, backward_blocked)
    item_stages = None if stages is None else {
        gemm_key(fqn, d): stage for fqn, stage in stages.items() for d in (FORWARD, BACKWARD)}
    return solve_plan(items, stages=item_stages, **targets)


def gemm_formats(plan: Plan) -> dict[str, tuple[Format, Format]]:
    """fqn -> (forward format, backward format) of a per-GEMM plan."""
    out: dict[str, list] = {}
    for key, fmt in plan.items():
        fqn, direction = split_key(key)
        if direction is None:
            raise ValueError(f"plan: {key!r} is not a per-GEMM key '<fqn>:forward' or '<fqn>:backward'")
        out.setdefault(fqn, [None, None])[0 if direction == FORWARD else 1] = fmt
    missing = [fqn for fqn, pair in out.items() if None in pair]
    if missing:
        raise ValueError(f"plan: layers {missing[:5]} lack a forward or a backward format")
    return {fqn: (pair[0], pair[1]) for fqn, pair in out.items()}


def _undominated(layer: LayerCandidates, target: _Target, weight_divergence_weight: float) -> list[Format]:
    """Drop formats that another choice beats on both the objective and the constraint.

    Exact (some optimum uses only undominated formats) and what keeps CBC fast: under an FP4
    fraction target every layer reduces to two choices (best FP4, best non-FP4), a 0/1 knapsack
    without the symmetric ties that otherwise blow up branch and bound.
    """

    def constraint_rank(f: Format) -> float:  # lower is better for the constraint
        return -float(f.is_fp4) if target.fp4_fraction is not None else layer.cost(f, target.relative_cost)

    options = sorted(layer.choices(), key=lambda f: (constraint_rank(f), layer.score(f, weight_divergence_weight)))
    kept: list[Format] = []
    for f in options:  # increasing constraint rank: keep f only if it beats every better-ranked score
        if not kept or layer.score(f, weight_divergence_weight) < min(layer.score(k, weight_divergence_weight) for k in kept):
            if kept and constraint_rank(f) == constraint_rank(kept[-1]):
                continue
            kept.append(f)
    return kept


def fp4_target(layers: Sequence[LayerCandidates], fp4_fraction: float):
    """The checked FP4-fraction target of ``layers`` (raises ValueError as solve_plan does)."""
    target, _ = _validate(layers, fp4_fraction, None, None, DEFAULT_RELATIVE_COST)
    return target
