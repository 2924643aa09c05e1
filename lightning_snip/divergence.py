"""What a statistics round gives the planner: LD and WD per (layer, format), and their average over ranks.

For layer l with recorded X, G, W and candidate format p, LD (lightning_snip.loss_divergence) is the relative
loss increase of its quantized forward GEMM and WD (lightning_snip.weight_divergence) how far its quantized
dgrad and wgrad move AdamW's next updates, relative to their energy: two dimensionless numbers the planner
adds as LD + lambda WD. bf16 is 0 for both. LD is not clamped here (rounds and ranks are averaged first; the
planner clamps it, evidence.planning_value). lightning_snip.statistics_round runs the round that makes them;
docs/method.md sections 4 and 5 give the maths, benchmarks/README.md the studies behind each choice.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from lightning_snip.aggregate import METRICS
from lightning_snip.formats import Format

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LayerDivergence:
    """One layer's metrics for each candidate format (bf16 is 0 by definition); LD's and WD's parts relative
    to the loss and to the update energy (loss_divergence.ForwardParts, weight_divergence.BackwardParts). A
    result averaged over ranks keeps the planner's three (aggregate.METRICS)."""

    loss_divergence: Mapping[Format, float]  # unclamped
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


@dataclass(frozen=True)
class DivergenceResult:
    """Per (fqn, format) LD and WD, normalized so the planner can add them; plus the loss."""

    layers: Mapping[str, LayerDivergence]
    loss: float
    used_adam: bool
    # the median relative standard error of WD's probed term over (layer, format) on this rank (None: exact)
    probe_rel_stderr: float | None = None

    def metric_values(self) -> dict[str, dict[str, Mapping[Format, float]]]:
        """metric -> fqn -> format -> value of the planner's metrics (aggregate.METRICS), as the aggregate folds
        them in."""
        return {metric: {fqn: getattr(layer, metric) for fqn, layer in self.layers.items()} for metric in METRICS}

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
    return DivergenceResult(layers=layers, loss=result.loss if result else float("nan"),
                            used_adam=bool(result and result.used_adam),
                            probe_rel_stderr=result.probe_rel_stderr if result else None)
