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
from collections.abc import Mapping, Sequence

from lightning_snip.config import SNIPConfig, TargetScope
from lightning_snip.divergence import DivergenceResult
from lightning_snip.formats import Format, hadamard_backward_cost
from lightning_snip.linear import SNIPLinear
from lightning_snip.plan import BACKWARD, FORWARD, Granularity, Plan, split_key
from lightning_snip.planner import (FORWARD_SHARE, LayerCandidates, PlanInfeasibleError, check_target, gemm_items,
                                    keep_out_of_fp4, max_fp4_fraction, solve_plan)

logger = logging.getLogger(__name__)


def layer_flops(layers: Mapping[str, SNIPLinear]) -> dict[str, float]:
    """Relative FLOPs per step: every layer sees the same tokens, so 6 * m * k orders them."""
    return {fqn: 6.0 * layer.in_features * layer.out_features for fqn, layer in layers.items()}


def planning_value(values: Mapping[str, Mapping[Format, float]], fqn: str, fmt: Format) -> float:
    """An estimate as the planner takes it: ``values[fqn][fmt]`` (+inf where missing), never below 0, the value
    of high precision (a negative estimate is noise, not a format better than bf16). The one place LD is clamped:
    rounds and ranks are averaged before it."""
    if fmt is Format.BF16:
        return 0.0
    value = values.get(fqn, {}).get(fmt, math.inf)
    return max(0.0, value) if math.isfinite(value) else math.inf  # NaN / -inf: no estimate, not a free format


def layer_candidates(layers: Mapping[str, SNIPLinear], formats: Sequence[Format], *,
                     loss_divergence: Mapping[str, Mapping[Format, float]] | None = None,
                     weight_divergence: Mapping[str, Mapping[Format, float]] | None = None,
                     flops: Mapping[str, float] | None = None) -> list[LayerCandidates]:
    """The planner's choices: the candidate ``formats`` each layer's shape allows (bf16 only if
    listed, or where none fits), valued by planning_value of the given estimates (fqn -> format ->
    value, as DivergenceAggregate.values gives them); zero everywhere when they are None (what pins and
    shapes alone decide: the target check, the fixed rules). ``flops``: layer_flops by default."""
    flops = layer_flops(layers) if flops is None else flops
    for name, estimates in (("loss_divergence", loss_divergence), ("weight_divergence", weight_divergence)):
        keys = {key for per_format in (estimates or {}).values() for key in per_format}
        if any(not isinstance(key, Format) for key in keys):  # (a name would read as a missing estimate, +inf)
            raise TypeError(f"{name}: format keys must be Format members, got {sorted(map(repr, keys))[:5]}")
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
            extra_cost=rht_price(layer, None),  # (a pin's format too)
        ))
    return out


def rht_price(layer: SNIPLinear, direction: str | None) -> dict[Format, float]:
    """The RHT's price (formats.hadamard_backward_cost) of the formats whose wgrad the layer's recipe transforms, per
    FLOP of a plan item: the whole layer (``direction`` None: its backward's share of its FLOPs), its backward
    (BACKWARD) or its forward (FORWARD: none)."""
    if direction == FORWARD:
        return {}
    share = 1.0 if direction == BACKWARD else 1 - FORWARD_SHARE
    rht = share * hadamard_backward_cost(layer.in_features, layer.out_features)
    return {f: rht for f in Format if layer.recipe.uses_hadamard(f)}


def priced_plan(plan: Plan, layers: Mapping[str, SNIPLinear]) -> Plan:
    """``plan`` with the RHT's price of its layers' recipes where it carries none (a plan made by hand, or saved
    before the price existed, 2026-12-06): its relative GEMM cost then reads as a solved plan's would."""
    if plan.extra_cost:
        return plan
    extra = {}
    for key in plan.formats:
        fqn, direction = split_key(key)
        if fqn in layers and (price := rht_price(layers[fqn], direction)):
            extra[key] = price
    return dataclasses.replace(plan, extra_cost=extra) if extra else plan


def fitted_plan(plan: Plan, layers: Mapping[str, SNIPLinear], config: SNIPConfig) -> tuple[Plan, list[str]]:
    """``plan`` (restored from a checkpoint) fitted to this run's layers and settings, and a line per entry changed:
    an entry for a layer no longer converted is dropped, a pinned layer takes its pin, and (while SNIP plans) a
    format outside this run's candidate formats (bf16 aside) or the layer's shape takes ``initial_format`` (bf16
    where the shape refuses it), until the next plan."""
    allowed = set(config.candidate_formats) | {Format.BF16} if config.replan else set(Format)
    initial = Format.parse(config.initial_format, field_name="initial_format")
    formats, changes = {}, []
    for key, fmt in plan.formats.items():
        layer = layers.get(split_key(key)[0])
        if layer is None:
            changes.append(f"{key}: not a converted layer of this run, dropped")
            continue
        if layer.pinned is not None:
            formats[key], why = layer.pinned, "pinned"
        elif fmt in allowed and fmt in layer.allowed_formats:
            formats[key] = fmt
        else:
            formats[key] = initial if initial in layer.allowed_formats else Format.BF16
            why = "not in candidate_formats" if fmt not in allowed else "not allowed by its shape"
        if formats[key] is not fmt:
            changes.append(f"{key}: {fmt.value} -> {formats[key].value} ({why})")
    if not changes:
        return plan, []
    return dataclasses.replace(plan, formats=formats, flops={key: plan.flops[key] for key in formats},
                               extra_cost={key: v for key, v in plan.extra_cost.items() if key in formats}), changes


def aggregate_candidates(layers: Mapping[str, SNIPLinear], config: SNIPConfig, aggregate,
                         flops: Mapping[str, float] | None = None) -> list[LayerCandidates]:
    """The planner's choices valued by ``aggregate`` (a DivergenceAggregate: LD and WD over rounds)."""
    return layer_candidates(layers, config.candidate_formats, flops=flops, loss_divergence=aggregate.values("loss_divergence"),
                            weight_divergence=aggregate.values("weight_divergence"))

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
                    rel_error_wgrad: Mapping[str, Mapping[Format, float]], threshold: float) -> dict[str, frozenset[Format]]:
    """fqn -> the FP4 candidates whose gradient/noise ratio 1 / ``rel_error_wgrad`` (the aggregate over
    rounds, as the plan's LD and WD: one round's single SR draw made the guarded set churn) is below
    ``threshold``; unpinned layers with at least one such format."""
    out = {}
    for fqn, layer in layers.items():
        if layer.pinned is not None:
            continue
        failing = frozenset(f for f in formats if f.is_fp4 and f in layer.allowed_formats
                            and rel_error_wgrad.get(fqn, {}).get(f, 0.0) * threshold > 1.0)  # 1/rel < threshold
        if failing:
            out[fqn] = failing
    return out


def _pinned_split(candidates: Sequence[LayerCandidates]) -> tuple[float, list[LayerCandidates], float]:
    """(every candidate's FLOPs, the pinned candidates, the unpinned ones' FLOPs)."""
    total = sum(c.flops for c in candidates)
    pinned = [c for c in candidates if c.pinned is not None]
    return total, pinned, total - sum(c.flops for c in pinned)


def model_target(candidates: Sequence[LayerCandidates], config: SNIPConfig) -> float:
    """``config``'s fp4_fraction as a share of every candidate layer's FLOPs, what the planner constrains:
    under target_scope=switchable the pinned layers' FLOPs (and their pins' FP4 FLOPs) are added to the
    target's share of the unpinned ones. The same linear constraint, so the same plan as the switchable target."""
    fraction = config.fp4_fraction
    if TargetScope(config.target_scope) is TargetScope.MODEL:
        return fraction
    total, pinned, free = _pinned_split(candidates)
    if not total or not pinned:
        return fraction
    return (sum(c.flops for c in pinned if c.pinned.is_fp4) + fraction * free) / total


def switchable_share(model_share: float, candidates: Sequence[LayerCandidates]) -> float:
    """The inverse of model_target for one FP4 share of the model's FLOPs: the unpinned layers' part of it.
    NaN where no layer is unpinned."""
    total, pinned, free = _pinned_split(candidates)
    if not free:
        return math.nan
    return (model_share * total - sum(c.flops for c in pinned if c.pinned.is_fp4)) / free


def check_reachable(layers: Mapping[str, SNIPLinear], config: SNIPConfig) -> None:
    """Raise ValueError when no plan can meet the FP4 fraction: pins and layer shapes alone decide that,
    and every statistics round would otherwise fail on it."""
    cfg = config
    if cfg.fp4_fraction > 0 and layers and all(layer.pinned is not None for layer in layers.values()):
        raise ValueError(f"pins: leave no layer for SNIP to plan (all {len(layers)} converted layers are pinned, e.g. "
                         f"{list(layers)[:3]}), so fp4_fraction={cfg.fp4_fraction!r} has nothing to be a share of and "
                         "every round would plan nothing; unpin layers, or train at the pins' formats with "
                         "replan=False (or fp4_fraction=0)")
    candidates = layer_candidates(layers, cfg.candidate_formats)
    try:
        check_target(candidates, fp4_fraction=model_target(candidates, cfg))
    except PlanInfeasibleError as err:
        pinned = [fqn for fqn, layer in layers.items() if layer.pinned is not None]
        by_shape = [f"{fqn} ({layer.in_features}->{layer.out_features})" for fqn, layer in layers.items()
                    if layer.pinned is None and not any(f.is_fp4 for f in cfg.candidate_formats if f in layer.allowed_formats)]
        why = []
        if TargetScope(cfg.target_scope) is TargetScope.SWITCHABLE:
            why.append(f"at most {switchable_share(max_fp4_fraction(candidates), candidates):.4f} of the "
                       "switchable layers' FLOPs can run in FP4")
        else:
            why.append(str(err))
        if pinned:
            why.append(f"pinned (pins): {pinned[:3]}")
        if by_shape:
            blocks = ", ".join(f"{f.value} needs dimensions divisible by {f.block_size}" for f in cfg.candidate_formats if f.is_fp4)
            why.append(f"no FP4 candidate fits the shape ({blocks}): {by_shape[:3]}")
        raise ValueError(f"fp4_fraction: {cfg.fp4_fraction!r} cannot be met; " + "; ".join(why)
                         + "; lower it, or unpin layers / add candidate formats") from None


def solve_guarded(candidates: list[LayerCandidates], guarded: Mapping[str, frozenset[Format]],
                  config: SNIPConfig, avoided: Mapping[str, frozenset[str]] | None = None) -> Plan:
    """The plan for ``candidates`` under ``config``'s target, with ``guarded`` (fqn -> FP4 formats the
    gradient-noise guard keeps out of the layer's backward GEMMs; out of the whole layer at granularity
    layer) and ``avoided`` (plan key -> format names the spike guard reverted lately). Where that makes
    the FP4 fraction unreachable, the plan takes the nearest reachable target instead,
    with a warning (the guards win over the target)."""
    cfg = config
    if Granularity(cfg.granularity) is Granularity.GEMM:
        items = gemm_items(candidates, guarded)
    else:
        items = [keep_out_of_fp4(c, guarded[c.fqn]) if c.fqn in guarded else c for c in candidates]
    avoided = avoided or {}
    items = [keep_out_of_fp4(c, {Format(f) for f in avoided[c.fqn]}) if c.fqn in avoided else c for c in items]
    fraction = model_target(candidates, cfg)
    why = (f"SNIP noise guard: {len(guarded)} layers keep FP4 formats out of their backward (gradient/noise ratio < "
           f"{cfg.noise_guard_threshold or 0:.3g}); " if guarded else "") + (
           f"SNIP spike guard: {len(avoided)} GEMMs avoid the formats of a reverted plan; " if avoided else "")
    reachable = max_fp4_fraction(items) if why else 1.0
    if reachable < fraction:
        logger.warning("%sthe largest reachable FP4 fraction of the model's FLOPs, %.3f, is used instead of %.3f "
                       "(fp4_fraction=%s)", why, reachable, fraction, cfg.fp4_fraction)
        fraction = reachable * (1 - 1e-9)
    plan = solve_plan(items, fp4_fraction=fraction, weight_divergence_weight=cfg.weight_divergence_weight)
    return dataclasses.replace(plan, noise_guarded={fqn: tuple(sorted(f, key=lambda x: x.value))
                                                   for fqn, f in guarded.items()})


def current_fp4_fraction(layers: Mapping[str, SNIPLinear], flops: Mapping[str, float], *, unpinned: bool = False) -> float:
    """FP4 share of ``layers``' linear FLOPs (of the unpinned ones' with ``unpinned``) in their current formats."""
    chosen = [fqn for fqn, layer in layers.items() if not (unpinned and layer.pinned is not None)]
    total = sum(flops[fqn] for fqn in chosen)
    if not total:
        return 0.0
    share = FORWARD_SHARE  # of a layer's GEMM FLOPs: the forward; dgrad + wgrad the rest
    return sum(flops[fqn] * (share * layers[fqn].format.is_fp4 + (1 - share) * (
        layers[fqn].backward_format or layers[fqn].format).is_fp4) for fqn in chosen) / total


def describe_target(layers: Mapping[str, SNIPLinear], config: SNIPConfig) -> str:
    """The target in one line, in the config's scope and the model's, e.g. "fp4_fraction 0.75 of the
    switchable layers' linear FLOPs (0.281 of the model's; pinned layers hold 62.5% of them)"."""
    cfg = config
    candidates = layer_candidates(layers, cfg.candidate_formats)
    total, _, free = _pinned_split(candidates)
    pinned = 1.0 - free / total if total else 0.0
    value = cfg.fp4_fraction
    if TargetScope(cfg.target_scope) is TargetScope.MODEL:
        return f"fp4_fraction {value:g} of the converted layers' linear FLOPs (pinned layers hold {pinned:.1%} of them)"
    return (f"fp4_fraction {value:g} of the switchable layers' linear FLOPs ({model_target(candidates, cfg):.3f} of "
            f"the model's; pinned layers hold {pinned:.1%} of them)")

