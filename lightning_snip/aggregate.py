"""Evidence accumulated across statistics rounds: an exponential moving average of each layer's LD
and WD per format, which the planner solves on instead of the last round alone.

One round's LD is one batch's estimate and carries that batch's noise (docs/method.md section 4);
averaging rounds is the largest single gain measured for it (benchmarks/results/divergence_fidelity_*).
Rounds come from different checkpoints of a run, so older ones go stale: an EMA weighs them down.

Per entry (layer, format) with value x_n at round n:

    s_n = decay * s_{n-1} + (1 - decay) * x_n,     w_n = decay * w_{n-1} + (1 - decay)
    aggregate = s_n / w_n

(w corrects the start-up bias, as Adam's 1 - beta^t does, and lets an entry first seen late start
at its own value). ``decay = 0`` plans from the last round alone. A non-finite value (a layer whose
statistics were invalid, or a format its shape forbids) is not folded in: the entry reads +inf for
as long as its latest round is non-finite, so the planner keeps the layer off that format, and
returns to its finite history afterwards.

Pure Python (no torch): formats are ``Format`` members, written out by name in the state, a plain dict for
checkpoints.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from lightning_snip.formats import Format

# rel_error_wgrad: the relative wgrad error of each format, which the gradient-noise guard reads
METRICS = ("loss_divergence", "weight_divergence", "rel_error_wgrad")


@dataclass
class _Entry:
    total: float = 0.0
    weight: float = 0.0
    latest_finite: bool = True

    def value(self) -> float:
        if not self.latest_finite or self.weight == 0.0:
            return math.inf
        return self.total / self.weight


DECAY = 0.5
"""The callback's EMA decay: the history's weight at each new round (docs/configuration.md names its study)."""


class DivergenceAggregate:
    """EMA over statistics rounds of per-(layer, format) LD and WD.

    Args:
        decay: weight of the history at each new round, in [0, 1).
    """

    def __init__(self, decay: float = DECAY) -> None:
        if not (isinstance(decay, (int, float)) and 0.0 <= decay < 1.0):
            raise ValueError(f"decay: invalid value {decay!r}; allowed: a number in [0, 1)")
        self.decay = float(decay)
        self.num_rounds = 0
        self._entries: dict[tuple[str, str, Format], _Entry] = {}  # (metric, fqn, format) -> entry

    def update(self, values: Mapping[str, Mapping[str, Mapping[Format, float]]]) -> None:
        """Fold in one round: ``values[metric][fqn][format]`` for the METRICS it has."""
        for metric in METRICS:
            for fqn, per_format in values.get(metric, {}).items():
                for fmt, value in per_format.items():
                    if not isinstance(fmt, Format):
                        raise TypeError(f"values[{metric!r}][{fqn!r}]: format keys must be Format members, got {fmt!r}")
                    entry = self._entries.setdefault((metric, fqn, fmt), _Entry())
                    value = float(value)
                    entry.latest_finite = math.isfinite(value)
                    if entry.latest_finite:
                        entry.total = self.decay * entry.total + (1.0 - self.decay) * value
                        entry.weight = self.decay * entry.weight + (1.0 - self.decay)
        self.num_rounds += 1

    def values(self, metric: str) -> dict[str, dict[Format, float]]:
        """fqn -> format -> aggregated value of ``metric`` (one of METRICS)."""
        if metric not in METRICS:
            raise ValueError(f"metric: invalid value {metric!r}; allowed: {', '.join(METRICS)}")
        out: dict[str, dict[Format, float]] = {}
        for (m, fqn, fmt), entry in self._entries.items():
            if m == metric:
                out.setdefault(fqn, {})[fmt] = entry.value()
        return out

    def state_dict(self) -> dict:
        return {
            "decay": self.decay,
            "num_rounds": self.num_rounds,
            "entries": [[m, fqn, fmt.value, e.total, e.weight, e.latest_finite] for (m, fqn, fmt), e in self._entries.items()],
        }

    def load_state_dict(self, state: Mapping) -> None:
        """Restore a saved aggregate. Its history is kept even if ``decay`` has changed since (the new
        decay applies from the next round on)."""
        self.num_rounds = int(state["num_rounds"])
        self._entries = {
            (m, fqn, Format(fmt)): _Entry(total=float(total), weight=float(weight), latest_finite=bool(finite))
            for m, fqn, fmt, total, weight, finite in state["entries"]
        }
