"""LD and WD per (layer, format) from one recorded statistics pass: the round's estimates the planner weighs.

For layer l with recorded X, G, W and candidate format p, LD (lightning_snip.loss_divergence) is the relative
loss increase of its quantized forward GEMM and WD (lightning_snip.weight_divergence) how far its quantized
dgrad and wgrad move AdamW's next updates, relative to their energy: two dimensionless numbers the planner
adds as LD + lambda WD. bf16 is 0 for both. docs/method.md sections 4 and 5 give the maths and where they
depart from the method text; the studies behind each choice are in benchmarks/README.md.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import torch

from lightning_snip.aggregate import METRICS
from lightning_snip.formats import Format, QuantRecipe
from lightning_snip.groups import default_group_layers
from lightning_snip.loss_divergence import combine_loss_divergence, forward_divergence
from lightning_snip.round_inputs import RoundInputs, a_sharded_weight, all_finite
from lightning_snip.sharding import all_reduce_sum, is_sharded
from lightning_snip.stats import RoundPrecision, Statistics
from lightning_snip.weight_divergence import backward_divergence, update_energy

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LayerDivergence:
    """One layer's metrics for each candidate format (bf16 is 0 by definition); LD's and WD's parts relative
    to the loss and to the update energy."""

    loss_divergence: Mapping[Format, float]
    weight_divergence: Mapping[Format, float]
    first_order: Mapping[Format, float] = field(default_factory=dict)  # this batch's <G, dY>
    first_stderr: Mapping[Format, float] = field(default_factory=dict)  # its sampling error over the samples
    # <G, dY> averaged over this batch and the sampled training batches before the round, its standard error
    first_accumulated: Mapping[Format, float] = field(default_factory=dict)
    first_accumulated_stderr: Mapping[Format, float] = field(default_factory=dict)
    second_order: Mapping[Format, float] = field(default_factory=dict)
    wd_direct: Mapping[Format, float] = field(default_factory=dict)
    wd_propagated: Mapping[Format, float] = field(default_factory=dict)
    # Standard error of wd_propagated over the round's probes (Propagation.PROBE; 0 when exact).
    wd_propagated_stderr: Mapping[Format, float] = field(default_factory=dict)
    rel_error_forward: Mapping[Format, float] = field(default_factory=dict)
    rel_error_wgrad: Mapping[Format, float] = field(default_factory=dict)
    abs_error_forward: Mapping[Format, float] = field(default_factory=dict)  # ||dY||^2
    abs_error_wgrad: Mapping[Format, float] = field(default_factory=dict)  # ||E_W||^2

    def unclamped_loss_divergence(self) -> dict[Format, float]:
        """LD of every format before the clamp at 0: averages over rounds or ranks must be taken before
        it, which would otherwise bias noisy layers upwards."""
        out = {}
        for fmt, ld in self.loss_divergence.items():
            if fmt is Format.BF16 or not math.isfinite(ld) or fmt not in self.second_order:
                out[fmt] = ld
                continue
            out[fmt] = combine_loss_divergence(
                first=self.first_order[fmt], first_stderr=self.first_stderr[fmt],
                first_accumulated=self.first_accumulated.get(fmt), second=self.second_order[fmt], clamp=False)
        return out


@dataclass(frozen=True)
class DivergenceResult:
    """Per (fqn, format) LD and WD, normalized so the planner can add them; plus the loss."""

    layers: Mapping[str, LayerDivergence]
    loss: float
    used_adam: bool

    def as_dict(self) -> dict:
        return {
            "loss": self.loss,
            "used_adam": self.used_adam,
            "layers": {
                fqn: {
                    "loss_divergence": {f.value: v for f, v in d.loss_divergence.items()},
                    "weight_divergence": {f.value: v for f, v in d.weight_divergence.items()},
                    "rel_error_wgrad": {f.value: v for f, v in d.rel_error_wgrad.items()},
                }
                for fqn, d in self.layers.items()
            },
        }

    @classmethod
    def from_dict(cls, data: Mapping) -> "DivergenceResult":
        layers = {
            fqn: LayerDivergence(
                loss_divergence={Format(k): float(v) for k, v in d["loss_divergence"].items()},
                weight_divergence={Format(k): float(v) for k, v in d["weight_divergence"].items()},
                rel_error_wgrad={Format(k): float(v) for k, v in d.get("rel_error_wgrad", {}).items()},
            )
            for fqn, d in data["layers"].items()
        }
        return cls(layers=layers, loss=float(data["loss"]), used_adam=bool(data["used_adam"]))


_warned_no_adam = False


def estimate_divergence(
    stats: Statistics,
    formats: Iterable[Format],
    *,
    recipe: QuantRecipe = QuantRecipe(),
    noise_draws: int = 2,
    first_order_history: Mapping[tuple[str, Format], list[float]] | None = None,
    allowed: Mapping[str, Iterable[Format]] | None = None,
    generator: torch.Generator | None = None,
    probes: int = 4,
    precision: RoundPrecision = RoundPrecision.TRAINING,
    group_layers: int | None = None,
) -> DivergenceResult:
    """LD and WD for every recorded layer and each of ``formats``.

    Args:
        stats: a statistics pass (its graph is used for the VJPs and the noise passes).
        formats: candidate low-precision formats (bf16 gets 0 for both metrics).
        noise_draws: error-probe passes per FP4 format averaged for LD's second-order term.
        first_order_history: (fqn, format) -> the first-order terms of other batches
            (first_order.FirstOrderTerms), averaged with this round's.
        allowed: fqn -> formats the layer supports; others get +inf (never chosen).
        generator: the random source of the curvature probes and stochastic rounding.
        probes: forward-mode probes of WD's propagated term when ``stats`` was collected with
            Propagation.PROBE (relative standard error per layer <= sqrt(2 / probes)).
        precision: the dtype of the round's GEMM operands (RoundPrecision).
        group_layers: the most layers of one shape whose quantizers and GEMMs run as one batched call
            (lightning_snip.groups: the same numbers, fewer launches); None: the device's default.

    A layer whose sample holds NaN/Inf, or whose metric comes out non-finite, gets +inf for its
    low-precision formats (the planner then keeps it high) and a warning naming it.
    """
    global _warned_no_adam
    group_layers = _resolved_group_layers(stats, group_layers)
    formats = [f for f in dict.fromkeys(formats) if f is not Format.BF16]
    precision = RoundPrecision(precision)
    valid, invalid = _valid_formats(stats, formats, allowed)
    used_adam = all(a is not None for a in stats.param_adam.values())
    if not used_adam and not _warned_no_adam:
        logger.warning("weight divergence: optimizer keeps no Adam moments for every parameter; using plain gradient errors (A = 1)")
        _warned_no_adam = True
    adam = {name: stats.param_adam.get(name) if used_adam else None for name in stats.param_names}
    r = RoundInputs(
        stats=stats, formats=tuple(formats), recipe=recipe, adam=adam, denominator=1.0,
        loss_norm=abs(stats.loss) if stats.loss else 1.0, first_order_history=first_order_history or {},
        generator=generator, invalid=invalid, precision=precision, group_layers=group_layers,
    )
    metrics = _initial_metrics(stats, formats, valid)
    r = dataclasses.replace(r, denominator=update_energy(stats, adam, precision) or 1.0)
    forward_divergence(r, valid, metrics, noise_draws)
    # Backward (WD): the dgrad errors E_X of every (layer, format), drawn before any propagation (one
    # order of stochastic-rounding draws for both Propagation modes), then each layer's wgrad error.
    direct = backward_divergence(r, valid, metrics, probes)
    out = _layer_divergences(r, valid, metrics, direct)
    return DivergenceResult(layers=out, loss=stats.loss, used_adam=used_adam)


def _resolved_group_layers(stats: Statistics, group_layers: int | None) -> int:
    """estimate_divergence's ``group_layers``, checked; None: the default of the statistics' device."""
    if group_layers is None:
        return default_group_layers(next((s.x.device for s in stats.layers.values()), "cpu"))
    if not isinstance(group_layers, int) or isinstance(group_layers, bool) or group_layers < 1:
        raise ValueError(f"group_layers: invalid value {group_layers!r}; allowed: an integer >= 1, or None")
    return group_layers


def _initial_metrics(stats: Statistics, formats: list[Format], valid: dict) -> dict:
    """fqn -> metric (a LayerDivergence field) -> format -> value: bf16 free, a format a valid layer does not
    allow +inf."""
    metrics = {fqn: {k: {Format.BF16: 0.0} for k in _METRICS} for fqn in stats.layers}
    for fqn, fmts in valid.items():
        for fmt in formats:
            if fmt not in fmts:
                metrics[fqn]["loss_divergence"][fmt] = metrics[fqn]["weight_divergence"][fmt] = math.inf
    return metrics


_METRICS = tuple(f.name for f in dataclasses.fields(LayerDivergence))


def _layer_divergences(r: RoundInputs, valid: dict, metrics: dict, direct: dict) -> dict[str, "LayerDivergence"]:
    """The round's LayerDivergence per layer: WD = direct + propagated, anything non-finite marked
    invalid (+inf, one warning per round)."""
    stats, formats = r.stats, r.formats
    out: dict[str, LayerDivergence] = {}
    for fqn, st in stats.layers.items():
        if fqn not in valid:
            out[fqn] = _invalid(formats)
            continue
        for fmt in valid[fqn]:
            m = metrics[fqn]
            m["wd_direct"][fmt] = direct[fqn, fmt] / r.denominator
            wd = m["wd_direct"][fmt] + m["wd_propagated"][fmt]
            if not math.isfinite(wd) or not math.isfinite(m["loss_divergence"][fmt]):
                if (fqn, fmt) not in r.invalid:
                    r.invalid.append((fqn, fmt))
                m["loss_divergence"][fmt] = wd = math.inf
            m["weight_divergence"][fmt] = wd
        out[fqn] = LayerDivergence(**metrics[fqn])
    if r.invalid:
        # One line per round, not one per layer (a GPU round once printed 199 of them).
        shown = ", ".join(f"{fqn} ({fmt.value})" for fqn, fmt in r.invalid[:6])
        logger.warning("non-finite statistics or divergence: %d (layer, format) marked invalid and left out of plans: "
                       "%s%s", len(r.invalid), shown, ", ..." if len(r.invalid) > 6 else "")
    return out


def _valid_formats(stats: Statistics, formats: list[Format], allowed) -> tuple[dict[str, list[Format]], list]:
    """fqn -> the formats to measure for each layer whose sample is finite (on every rank), and the
    (fqn, format) candidates of the others (invalid)."""
    finite = {fqn: bool(all_finite(s.x) and all_finite(s.g)
                        and all_finite(s.weight.to_local() if is_sharded(s.weight) else s.weight))
              for fqn, s in stats.layers.items()}
    if stats.sharded and finite:
        # Every rank runs the same all-gathers below, layer by layer: agree on which layers take part.
        like = a_sharded_weight(stats)
        flags = all_reduce_sum(torch.tensor([float(not f) for f in finite.values()], device=like.device), like)
        finite = {fqn: float(flag) == 0.0 for fqn, flag in zip(finite, flags.cpu())}
    valid, invalid = {}, []
    for fqn, s in stats.layers.items():
        if finite[fqn]:
            valid[fqn] = formats if allowed is None else [f for f in formats if f in set(allowed[fqn])]
        else:
            invalid.extend((fqn, f) for f in formats if allowed is None or f in set(allowed[fqn]))
    return valid, invalid


def _invalid(formats) -> LayerDivergence:
    inf = {f: math.inf for f in formats}
    return LayerDivergence(loss_divergence={Format.BF16: 0.0, **inf}, weight_divergence={Format.BF16: 0.0, **inf})


def reduce_result(result: DivergenceResult | None, fqns: list[str], formats,
                  collective) -> DivergenceResult | None:
    """Average LD, WD and the relative wgrad error over data-parallel ranks (same order of layers and
    formats everywhere). None (with a warning) when any rank's round failed (it sends NaN)."""
    if collective.world_size <= 1:
        return result
    formats = list(dict.fromkeys((Format.BF16, *formats)))
    # (LD / WD / relative wgrad error, layer, format); the last feeds the gradient-noise guard
    values = torch.full((len(METRICS), len(fqns), len(formats)), float("nan"), dtype=torch.float64)
    if result is not None:
        for i, metric in enumerate(METRICS):
            values[i] = torch.tensor([[getattr(result.layers[f], metric).get(p, math.inf) for p in formats] for f in fqns],
                                     dtype=torch.float64)
    total = collective.all_sum(values) / collective.world_size
    if torch.isnan(total).any():
        logger.warning("SNIP statistics failed on some rank; keeping the current plan")
        return None
    layers = {
        fqn: LayerDivergence(
            loss_divergence=dict(zip(formats, total[0, i].tolist())),
            weight_divergence=dict(zip(formats, total[1, i].tolist())),
            rel_error_wgrad=dict(zip(formats, total[2, i].tolist())),
        )
        for i, fqn in enumerate(fqns)
    }
    return DivergenceResult(layers=layers, loss=result.loss if result else float("nan"), used_adam=bool(result and result.used_adam))
