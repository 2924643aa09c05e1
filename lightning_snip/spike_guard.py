"""The loss-spike guard: a plan that makes training worse is undone within a few steps.

After a plan is applied, the guard watches the training loss of the next ``WINDOW`` optimizer steps
against the ``HISTORY`` steps before the switch: their level mu (where a least-squares line through them
ends: a falling loss's trend is not its level) and their noise sigma (the standard deviation around that
line: nor is the trend noise; at least ``MIN_RELATIVE_SIGMA`` of |mu|, so a flat history does not make noise a spike). A step
whose loss exceeds mu + threshold x sigma is a strike; ``PATIENCE`` strikes in a row (one batch's unlucky loss is
not a spike), or one non-finite loss or gradient, revert the GEMM directions the plan changed to their
formats before it. The reverted (direction, format) pairs are kept out of the next ``AVOID_ROUNDS``
solves, so the next round does not choose them again at once. The guard sees the same numbers on every
rank (the losses are averaged over ranks before it), so every rank reverts at the same step boundary.

Written here: Lightning and torch have no notion of a plan to undo. Pure Python (no torch): the state is
a plain dict for checkpoints.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass

HISTORY = 32  # losses before a switch that make its baseline
MIN_HISTORY = 8  # a switch with fewer losses before it is not watched (no trend to compare with)
WINDOW = 16  # optimizer steps watched after a switch
PATIENCE = 2  # strikes in a row that revert
MIN_RELATIVE_SIGMA = 0.01  # sigma's floor, a share of |mu|
AVOID_ROUNDS = 3  # solves that keep a reverted (direction, format) out


@dataclass(frozen=True)
class Revert:
    """The guard's decision: put ``formats`` (plan key -> format name before the switch) back."""

    step: int
    reason: str
    formats: dict[str, str]


def baseline(losses: list[float]) -> tuple[float, float]:
    """(level, noise) of the losses before a switch: where a least-squares line through them ends, and the
    standard deviation of their residuals from it."""
    n = len(losses)
    mean_t, mean_y = (n - 1) / 2, math.fsum(losses) / n
    var_t = math.fsum((t - mean_t) ** 2 for t in range(n))
    slope = math.fsum((t - mean_t) * (y - mean_y) for t, y in enumerate(losses)) / var_t
    residuals = [y - (mean_y + slope * (t - mean_t)) for t, y in enumerate(losses)]
    return mean_y + slope * (n - 1 - mean_t), math.sqrt(math.fsum(r * r for r in residuals) / (n - 2))


class SpikeGuard:
    """Watches the loss after each plan switch (see the module text).

    Args:
        threshold: a strike is a loss above mu + threshold x sigma of the steps before the switch; None: off.
    """

    def __init__(self, threshold: float | None) -> None:
        self.threshold = threshold
        self.losses: deque[float] = deque(maxlen=HISTORY)
        self.watch: dict | None = None  # {"step", "mu", "sigma", "strikes", "previous": {key: format}}
        self.avoid: dict[tuple[str, str], int] = {}  # (plan key, format name) -> solves left
        self.num_reverts = 0
        self.num_watched = 0  # switches watched (a switch with too short a history before it is not)
        self.max_rise = -math.inf  # the largest (loss - level) / noise seen while watching: the margin kept

    @property
    def enabled(self) -> bool:
        return self.threshold is not None

    @property
    def watching(self) -> bool:
        return self.watch is not None

    def on_switch(self, step: int, previous: Mapping[str, str]) -> None:
        """A plan was applied before ``step``; ``previous``: the format (name) each key it changed had."""
        if not previous:  # a plan that changed nothing: the watch of the last change goes on
            return
        if not self.enabled or len(self.losses) < MIN_HISTORY:
            self.watch = None
            return
        mu, sigma = baseline(list(self.losses))
        self.watch = {"step": step, "mu": mu, "sigma": max(sigma, MIN_RELATIVE_SIGMA * abs(mu)), "strikes": 0,
                      "previous": dict(previous)}
        self.num_watched += 1

    def observe(self, step: int, loss: float, *, finite_grads: bool = True) -> Revert | None:
        """One optimizer step's loss (averaged over micro-batches and ranks); a Revert when it is due."""
        if not self.enabled:
            return None
        watch = self.watch
        if watch is not None and step - watch["step"] >= WINDOW:
            self.watch = watch = None  # the plan held through its window
        if watch is None:
            if math.isfinite(loss):
                self.losses.append(loss)
            return None
        if not finite_grads or not math.isfinite(loss):
            return self._revert(step, "non-finite gradients" if not finite_grads else f"non-finite loss ({loss})")
        limit = watch["mu"] + self.threshold * watch["sigma"]
        self.max_rise = max(self.max_rise, (loss - watch["mu"]) / watch["sigma"])
        watch["strikes"] = watch["strikes"] + 1 if loss > limit else 0
        if watch["strikes"] >= PATIENCE:
            return self._revert(step, f"loss {loss:.4g} > {limit:.4g} (level {watch['mu']:.4g} + {self.threshold:g} x "
                                      f"{watch['sigma']:.3g}, the level and noise before the switch) for "
                                      f"{PATIENCE} steps")
        self.losses.append(loss)
        return None

    def _revert(self, step: int, reason: str) -> Revert:
        previous = self.watch["previous"]
        self.watch = None
        self.num_reverts += 1
        return Revert(step=step, reason=reason, formats=previous)

    def mark(self, revert: Revert, applied: Mapping[str, str]) -> None:
        """Keep the (key, format) pairs the reverted plan had changed to (``applied``, where it differs from the
        format restored) out of the next solves; a direction the plan left as it was is not held against it."""
        for key, before in revert.formats.items():
            if key in applied and applied[key] != before:
                self.avoid[key, applied[key]] = AVOID_ROUNDS

    def avoided(self) -> dict[str, frozenset[str]]:
        """Plan key -> format names a solve must not choose now."""
        out: dict[str, set[str]] = {}
        for (key, fmt), _ in self.avoid.items():
            out.setdefault(key, set()).add(fmt)
        return {key: frozenset(fmts) for key, fmts in out.items()}

    def count_solve(self) -> None:
        """One solve used the avoided pairs: each is avoided for one solve fewer."""
        self.avoid = {pair: left - 1 for pair, left in self.avoid.items() if left > 1}

    def state_dict(self) -> dict:
        return {"losses": list(self.losses), "watch": self.watch, "num_reverts": self.num_reverts,
                "num_watched": self.num_watched, "max_rise": self.max_rise,
                "avoid": [[key, fmt, left] for (key, fmt), left in self.avoid.items()]}

    def load_state_dict(self, state: Mapping) -> None:
        self.losses = deque((float(v) for v in state.get("losses", [])), maxlen=HISTORY)
        self.watch = dict(state["watch"]) if state.get("watch") else None
        self.num_reverts = int(state.get("num_reverts", 0))
        self.num_watched = int(state.get("num_watched", 0))
        self.max_rise = float(state.get("max_rise", -math.inf))
        self.avoid = {(key, fmt): int(left) for key, fmt, left in state.get("avoid", [])}
