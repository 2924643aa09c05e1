"""What every layer's divergence of one statistics round shares: the round's inputs, its layers in groups of
one shape (lightning_snip.groups), their stacked operands, and scalars read with one device transfer."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from lightning_snip.adamw import AdamState
from lightning_snip.formats import Format, QuantRecipe
from lightning_snip.groups import MAX_GROUP_LAYERS, layer_groups, stack, working_bytes
from lightning_snip.sharding import dense, is_sharded
from lightning_snip.stats import LayerStats, RoundPrecision, Statistics


@dataclass(frozen=True)
class RoundInputs:
    """What every layer's divergence of one round shares."""

    stats: Statistics
    formats: tuple[Format, ...]
    recipe: QuantRecipe
    # parameter name -> this rank's AdamW state before the step (AdamState.local(); None: no Adam)
    adam: Mapping[str, AdamState | None]
    denominator: float  # sum_k ||u_k||^2 (or ||g_k||^2 without Adam)
    loss_norm: float
    first_order_history: Mapping[tuple[str, Format], list[float]]
    generator: torch.Generator | None  # stochastic rounding of the gradient GEMMs' errors
    precision: RoundPrecision = RoundPrecision.TRAINING
    # the most layers of one shape stacked into one batched call (None: the device's default, groups.layer_groups)
    group_layers: int | None = MAX_GROUP_LAYERS


def round_groups(inputs: RoundInputs, fqns, valid: Mapping) -> list[list[str]]:
    """The round's groups of ``fqns`` (layer_groups): layers of one shape measured in the same formats, at
    most inputs.group_layers of them and MAX_GROUP_BYTES of their working_bytes."""
    return layer_groups(inputs.stats, fqns, inputs.precision, max_layers=inputs.group_layers,
                        extra_key=lambda fqn: tuple(valid.get(fqn, ())),
                        layer_bytes=lambda fqn: working_bytes(inputs.stats.layers[fqn], len(valid.get(fqn, ()))))


def stacked_operands(inputs: RoundInputs, group: list[str], which: str) -> torch.Tensor:
    """One operand (``which``: "x", "g" or "w") of a group's layers in the round's dtype, stacked
    (layers x rows x cols; a view for a group of one)."""
    stats, index = inputs.stats, "xgw".index(which)
    return stack([round_operands(stats, stats.layers[fqn], inputs.precision, weight=which == "w")[index]
                  for fqn in group])


def round_operands(stats: Statistics, layer: LayerStats, precision: RoundPrecision, *, weight: bool = True):
    """X, G (Statistics.operands: cast once per round) and W (None with ``weight=False``: no
    all-gather under FSDP2) in the dtype of the round's GEMMs (RoundPrecision)."""
    x, g = stats.operands(layer.fqn, precision)
    return x, g, dense(layer.weight).to(layer.operand_dtype(precision)) if weight else None


def read_scalars(values: list[torch.Tensor]) -> list[float]:
    """0-d tensors as floats, read with one device transfer (a sync per value made a GPU round wait
    thousands of times); values on other devices than the first (a model split over devices) are
    copied there first."""
    if not values:
        return []
    device = values[0].device
    return torch.stack([v.to(device) for v in values]).tolist()


def all_finite(t: torch.Tensor) -> torch.Tensor:
    """Whether every element of ``t`` is finite, a 0-d bool tensor: from its min and max (one pass, NaN
    propagates into both), 15x faster on a CPU than isfinite(t).all(), which builds a bool copy of t."""
    if t.numel() == 0:
        return torch.ones((), dtype=torch.bool, device=t.device)
    low, high = torch.aminmax(t)
    return torch.isfinite(low) & torch.isfinite(high)


def a_sharded_weight(stats: Statistics):
    """Any sharded layer weight of the round: its mesh is the group the round's sums are reduced over."""
    return next(s.weight for s in stats.layers.values() if is_sharded(s.weight))
