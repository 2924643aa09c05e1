"""From a round's evidence to a plan: what the planner is fed, and the solve under the noise guard.

The controller (lightning_snip.controller) and the benchmarks call the same functions: a round's
invalid candidates and gradient-noise ratios, the noise guard's blocked formats, the planner's
candidates valued by the aggregate over rounds (clamped at 0: a negative estimate never makes a
format look better than bf16), the target check at setup, and the solve.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import re
from collections.abc import Collection, Iterable, Mapping, Sequence

from lightning_snip.config import SNIPConfig
from lightning_snip.divergence import DivergenceResult
from lightning_snip.formats import Format
from lightning_snip.linear import SNIPLinear
from lightning_snip.plan import Granularity, Plan
from lightning_snip.planner import (LayerCandidates, PlanInfeasibleError, check_target, gemm_items, keep_out_of_fp4,
                                    max_fp4_fraction, min_relative_cost, solve_plan)

logger = logging.getLogger(__name__)


def layer_flops(layers: Mapping[str, SNIPLinear]) -> dict[str, float]:
    """Relative FLOPs per step: every layer sees the same tokens, so 6 * m * k orders them."""
    return {fqn: 6.0 * layer.in_features * layer.out_features for fqn, layer in layers.items()}


def planning_value(values: Mapping[str, Mapping[str, float]], fqn: str, fmt: Format) -> float:
    """An estimate as the planner takes it: ``values[fqn][fmt.value]`` (+inf where missing), never
    below 0, the value of high precision (a negative estimate is noise, not a format better than bf16)."""
    if fmt is Format.BF16:
        return 0.0
    value = values.get(fqn, {}).get(fmt.value, math.inf)
    return max(0.0, value) if math.isfinite(value) else math.inf  # NaN / -inf: no estimate, not a free format


_BLOCK = re.compile(r"(?:^|\.)(\d+)(?:\.|$)")  # the first integer component: the block ("layers.3.")


def layer_classes(fqns: Iterable[str]) -> dict[str, str]:
    """fqn -> its class for class_shrinkage: the same module in the other blocks of its stack, split
    into the stack's first block, its inner blocks and its last block (the grouping of the fixed rule
    layer_type_edges, which holds a layer's forward and backward GEMMs). A stack is the name before the
    first integer component (``model.layers.``); its block range is the one ``fqns`` span; the module is
    the name after it (``.self_attn.q_proj``), so an encoder's, a decoder's and a cross-attention's
    q_proj are three classes. A layer with no integer component (an LM head) is a class of its own."""
    parsed = {}
    for fqn in fqns:
        match = _BLOCK.search(fqn)
        parsed[fqn] = None if match is None else (fqn[:match.start(1)], int(match.group(1)), fqn[match.end(1):])
    ranges: dict[str, tuple[int, int]] = {}
    for stack, block, _ in filter(None, parsed.values()):
        lo, hi = ranges.get(stack, (block, block))
        ranges[stack] = (min(lo, block), max(hi, block))
    out = {}
    for fqn, p in parsed.items():
        if p is None:
            out[fqn] = fqn
            continue
        stack, block, module = p
        lo, hi = ranges[stack]
        out[fqn] = f"{stack}*{module}@{'first' if block == lo else 'last' if block == hi else 'inner'}"
    return out


def shrink_to_class_means(values: Mapping[str, Mapping[str, float]], strength: float, *,
                          pinned: Collection[str] = ()) -> dict[str, dict[str, float]]:
    """``values`` (fqn -> format name -> estimate, as DivergenceAggregate.values gives them) with each
    layer's estimate moved toward the mean of its class (layer_classes over the fqns of ``values``) for
    that format: (1 - strength) * own + strength * class mean, signed values averaged (the planner
    clamps at 0 after). The ILP favours the layers whose estimate came out low by chance; a class mean
    averages its members' noise. 0 returns the values as they are, 1 the class means. ``pinned``
    layers, non-finite estimates (an invalid format: kept off it) and the members of a class with one
    finite estimate are unchanged; a mean is over the class's unpinned finite members. Written here: no
    dependency offers a grouped shrinkage."""
    if not (isinstance(strength, (int, float)) and not isinstance(strength, bool) and 0.0 <= strength <= 1.0):
        raise ValueError(f"class_shrinkage: invalid value {strength!r}; allowed: a number in [0, 1]")
    if isinstance(pinned, str):
        raise TypeError(f"pinned: expected a collection of fqns, got the string {pinned!r}")
    out = {fqn: dict(per_format) for fqn, per_format in values.items()}
    if strength == 0.0:
        return out
    pinned = frozenset(pinned)
    classes = layer_classes(values)
    members: dict[tuple[str, str], list[str]] = {}
    for fqn, per_format in values.items():
        for fmt, value in per_format.items():
            if fqn not in pinned and math.isfinite(value):
                members.setdefault((classes[fqn], fmt), []).append(fqn)
    for (_, fmt), fqns in members.items():
        if len(fqns) < 2:
            continue
        mean = math.fsum(values[fqn][fmt] for fqn in fqns) / len(fqns)
        for fqn in fqns:
            out[fqn][fmt] = (1.0 - strength) * values[fqn][fmt] + strength * mean
    return out


def check_class_shrinkage(layers: Mapping[str, SNIPLinear], config: SNIPConfig) -> None:
    """A warning at setup where ``class_shrinkage`` > 0 can change nothing: no two unpinned layers share
    a class (a model of at most 3 blocks, or whose names have no block index)."""
    if config.class_shrinkage == 0.0:
        return
    classes = layer_classes(layers)
    counts: dict[str, int] = {}
    for fqn, layer in layers.items():
        if layer.pinned is None:
            counts[classes[fqn]] = counts.get(classes[fqn], 0) + 1
    if not any(n > 1 for n in counts.values()):
        logger.warning("class_shrinkage=%s has no effect on this model: no two unpinned layers share a class (the "
                       "same module in the inner blocks of a stack; layers: %s)", config.class_shrinkage,
                       list(layers)[:3])


def layer_candidates(layers: Mapping[str, SNIPLinear], formats: Sequence[Format], *,
                     loss_divergence: Mapping[str, Mapping[str, float]] | None = None,
                     weight_divergence: Mapping[str, Mapping[str, float]] | None = None,
                     flops: Mapping[str, float] | None = None) -> list[LayerCandidates]:
    """The planner's choices: the candidate ``formats`` each layer's shape allows (bf16 only if
    listed, or where none fits), valued by planning_value of the given estimates (fqn -> format name ->
    value, as DivergenceAggregate.values gives them); zero everywhere when they are None (what pins and
    shapes alone decide: the target check, the fixed rules). ``flops``: layer_flops by default."""
    flops = layer_flops(layers) if flops is None else flops
    out = []
    for fqn, layer in layers.items():
        allowed = [f for f in formats if f in layer.allowed_formats] or [Format.BF16]

        def value(estimates, fmt):
            return 0.0 if estimates is None else planning_value(estimates, fqn, fmt)

        out.append(LayerCandidates(
            fqn=fqn,
            flops=flops[fqn],
            loss_divergence={f: value(loss_divergence, f) for f in allowed},
            weight_divergence={f: value(weight_divergence, f) for f in allowed},
            pinned=layer.pinned,
        ))
    return out


def aggregate_candidates(layers: Mapping[str, SNIPLinear], config: SNIPConfig, aggregate,
                         flops: Mapping[str, float] | None = None) -> list[LayerCandidates]:
    """The planner's choices valued by ``aggregate`` (a DivergenceAggregate: LD and WD over rounds),
    each estimate moved toward its class's mean by ``config.class_shrinkage`` (shrink_to_class_means)."""
    pinned = {fqn for fqn, layer in layers.items() if layer.pinned is not None}
    ld, wd = (shrink_to_class_means(aggregate.values(metric), config.class_shrinkage, pinned=pinned)
              for metric in ("loss_divergence", "weight_divergence"))
    return layer_candidates(layers, config.formats, flops=flops, loss_divergence=ld, weight_divergence=wd)


def invalid_formats(layers: Mapping[str, SNIPLinear], formats: Sequence[Format],
                    result: DivergenceResult) -> list[tuple[str, Format]]:
    """(fqn, format) of the unpinned layers' allowed low-precision candidates whose LD or WD the
    round found non-finite: left out of this round's evidence (logged as snip/invalid_formats)."""
    out = []
    for fqn, layer in layers.items():
        d = result.layers.get(fqn)
        if layer.pinned is not None or d is None:
            continue
        for fmt in formats:
            if fmt is Format.BF16 or fmt not in layer.allowed_formats:
                continue
            if not (math.isfinite(d.loss_divergence.get(fmt, math.inf))
                    and math.isfinite(d.weight_divergence.get(fmt, math.inf))):
                out.append((fqn, fmt))
    return out


def grad_noise_ratios(layers: Mapping[str, SNIPLinear], formats: Sequence[Format],
                      result: DivergenceResult) -> dict[str, float]:
    """Per unpinned layer: ||G^T X|| / ||Q(G)^T Q(X) - G^T X|| on the round's rows, for the best
    FP4 candidate the layer's shape allows (the gradient-noise guard's ratio; +inf: no error)."""
    ratios = {}
    for fqn, layer in layers.items():
        d = result.layers.get(fqn)
        fp4 = [f for f in formats if f.is_fp4 and f in layer.allowed_formats]
        if layer.pinned is not None or d is None or not fp4:
            continue
        errors = [d.rel_error_wgrad.get(f, math.nan) for f in fp4]
        errors = [e for e in errors if math.isfinite(e)]
        if errors:
            ratios[fqn] = 1.0 / min(errors) if min(errors) > 0 else math.inf
    return ratios


def guarded_formats(layers: Mapping[str, SNIPLinear], formats: Sequence[Format],
                    rel_error_wgrad: Mapping[str, Mapping[str, float]], threshold: float) -> dict[str, frozenset[Format]]:
    """fqn -> the FP4 candidates whose gradient/noise ratio 1 / ``rel_error_wgrad`` (the aggregate over
    rounds, as the plan's LD and WD: one round's single SR draw made the guarded set churn) is below
    ``threshold``; unpinned layers with at least one such format."""
    out = {}
    for fqn, layer in layers.items():
        if layer.pinned is not None:
            continue
        failing = frozenset(f for f in formats if f.is_fp4 and f in layer.allowed_formats
                            and rel_error_wgrad.get(fqn, {}).get(f.value, 0.0) * threshold > 1.0)  # 1/rel < threshold
        if failing:
            out[fqn] = failing
    return out


def check_reachable(layers: Mapping[str, SNIPLinear], config: SNIPConfig) -> None:
    """Raise ValueError when no plan can meet the FP4 fraction / cost budget: pins and layer shapes
    alone decide that, and every statistics round would otherwise fail on it."""
    cfg = config
    try:
        check_target(layer_candidates(layers, cfg.formats), fp4_fraction=cfg.fp4_fraction,
                     cost_budget=cfg.cost_budget, relative_cost=cfg.cost_model.relative_cost)
    except PlanInfeasibleError as err:
        field_name = "fp4_fraction" if cfg.fp4_fraction is not None else "cost_budget"
        value = cfg.fp4_fraction if cfg.fp4_fraction is not None else cfg.cost_budget
        pinned = [fqn for fqn, layer in layers.items() if layer.pinned is not None]
        by_shape = [f"{fqn} ({layer.in_features}->{layer.out_features})" for fqn, layer in layers.items()
                    if layer.pinned is None and not any(f.is_fp4 for f in cfg.formats if f in layer.allowed_formats)]
        why = []
        if pinned:
            why.append(f"pinned (pins): {pinned[:3]}")
        if by_shape:
            blocks = ", ".join(f"{f.value} needs dimensions divisible by {f.block_size}" for f in cfg.formats if f.is_fp4)
            why.append(f"no FP4 candidate fits the shape ({blocks}): {by_shape[:3]}")
        raise ValueError(f"{field_name}: {value!r} cannot be met ({err}); " + "; ".join(why)
                         + "; lower it, or unpin layers / add candidate formats") from None


def solve_guarded(candidates: list[LayerCandidates], guarded: Mapping[str, frozenset[Format]],
                  config: SNIPConfig) -> Plan:
    """The plan for ``candidates`` under ``config``'s target, with ``guarded`` (fqn -> FP4 formats the
    gradient-noise guard keeps out of the layer's backward GEMMs; out of the whole layer at granularity
    layer). Where that makes the FP4 fraction or the cost budget unreachable, the plan takes the
    nearest reachable target instead, with a warning (the guard wins over the target)."""
    cfg = config
    if Granularity(cfg.granularity) is Granularity.GEMM:
        items = gemm_items(candidates, guarded)
    else:
        items = [keep_out_of_fp4(c, guarded[c.fqn]) if c.fqn in guarded else c for c in candidates]
    relative_cost = cfg.cost_model.relative_cost
    fraction, budget = cfg.fp4_fraction, cfg.cost_budget
    why = f"SNIP noise guard: {len(guarded)} layers keep FP4 formats out of their backward (gradient/noise ratio < " \
          f"{cfg.noise_guard_threshold:.3g}); "
    reachable = max_fp4_fraction(items) if guarded and fraction is not None else 1.0
    if fraction is not None and reachable < fraction:
        fraction = reachable * (1 - 1e-9)
        logger.warning("%sthe largest reachable FP4 fraction, %.3f, is used instead of fp4_fraction=%s",
                       why, fraction, cfg.fp4_fraction)
    cheapest = min_relative_cost(items, relative_cost) if guarded and budget is not None else 0.0
    if budget is not None and cheapest > budget:
        budget = cheapest * (1 + 1e-9)
        logger.warning("%sthe lowest reachable relative GEMM cost, %.3f, is used instead of cost_budget=%s",
                       why, budget, cfg.cost_budget)
    plan = solve_plan(items, fp4_fraction=fraction, cost_budget=budget,
                      weight_divergence_weight=cfg.weight_divergence_weight,
                      time_limit_seconds=cfg.time_limit_seconds, relative_cost=relative_cost)
    return dataclasses.replace(plan, noise_guarded={fqn: tuple(sorted(f, key=lambda x: x.value))
                                                   for fqn, f in guarded.items()})
