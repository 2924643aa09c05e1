"""The loss watch: a plan that makes training worse is undone, whether it spikes the loss or makes it climb.

After a plan is applied, the guard watches every later optimizer step's training loss (until the next plan that
changes something) against the ``HISTORY`` steps before the switch: the level is the mean of their last ``LEVEL_STEPS``, the noise
sigma the standard deviation of all of them around their least-squares line (the trend is not noise; at least
``NOISE_FLOOR`` of |level|, so a constant loss does not make every wiggle a rise). A rising trend (the LR
warm-up's, a data shift's) is continued, damped over ``HISTORY`` steps (level + slope x HISTORY x (1 -
exp(-delta / HISTORY))); a falling one is not: a loss curve flattens, and a fall continued made healthy plans
look like rises (measured on the demo: 4 alarms in 30 steps after its first switch). A one-sided CUSUM on the standardized residuals,
S = max(0, S + z - DRIFT), accumulates a rise: two steps at ``threshold`` sigma, one step at twice that, or a
rise of 2 sigma held for about ``threshold`` x PATIENCE steps alarm (S >= PATIENCE x (threshold - DRIFT)).
A non-finite loss or gradient alarms at once.

Right after the switch, the caller measures what the plan's formats cost on that step's batch (its loss minus
under the formats before it, forward only): the watch expects that cost on top of the trend (a healthy FP4 plan
costs some loss at once; only what comes beyond it is a rise), and a cost of ``threshold`` sigma or more reverts
at once. An alarm that is not a non-finite value is a suspicion, not yet a verdict: a loss also rises during the LR
warm-up, or when the data shifts. The caller confirms it (controller.observe_step: the same batch's loss under
the plan's formats and under the formats before it, forward only): a plan whose formats now cost at least
CONFIRM_SHARE of the rise more than they did at the switch is reverted; otherwise the rise is not the plan's, and the watch
takes a new baseline from the latest losses. Harm through the gradients (a wrong wgrad kernel) shows in no
same-batch forward: the plan canary (lightning_snip.canary) checks those GEMMs directly.

A revert puts the GEMM directions the plan changed back to their formats before it; the reverted
(direction, format) pairs are kept out of the next ``AVOID_ROUNDS`` solves, so the next round does not choose
them again at once. The guard sees the same numbers on every rank (the losses are averaged over ranks before
it), so every rank reverts at the same step boundary.

Written here: Lightning and torch have no notion of a plan to undo. Pure Python (no torch): the state is
a plain dict for checkpoints.
"""

from __future__ import annotations

import logging
import math
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from lightning_snip.collective import Collective
from lightning_snip.plan import split_key

logger = logging.getLogger(__name__)

HISTORY = 32  # losses before a switch that make its baseline (and the damping of its trend, in steps)
MIN_HISTORY = 8  # a switch with fewer losses before it is not watched (no trend to compare with)
LEVEL_STEPS = 8  # the last losses whose mean is the level
PATIENCE = 2  # steps at the threshold that alarm (the CUSUM's limit, with DRIFT)
DRIFT = 1.0  # the CUSUM's allowance per step, in sigma: a rise below it never accumulates
NOISE_FLOOR = 1e-3  # sigma's floor, a share of |level|
CONFIRM_SHARE = 0.5  # an alarm is the plan's when its formats cost this share of the rise on the same batch
AVOID_ROUNDS = 3  # solves that keep a reverted (direction, format) out
GRADIENT_STEPS = 16  # steps after a switch whose gradients are checked for finiteness (on the device, step_loss.py)


@dataclass(frozen=True)
class Revert:
    """The guard's decision: put ``formats`` (plan key -> format name before the switch) back."""

    step: int
    reason: str
    formats: dict[str, str]


@dataclass(frozen=True)
class Alarm:
    """A rise the caller confirms (``SpikeGuard.confirm``): ``rise``, the loss's mean excess over its expected
    value in the steps the CUSUM accumulated, ``previous``, the formats before the plan to compare with, and
    ``cost_at_switch``, what the plan's formats cost on the switch's batch (a rise is the plan's when they now
    cost more by a share of it)."""

    step: int
    rise: float
    reason: str
    previous: dict[str, str]
    cost_at_switch: float = 0.0


def baseline(losses: list[float]) -> tuple[float, float, float]:
    """(level, noise, slope) of the losses before a switch: the mean of the last LEVEL_STEPS (where the loss is
    now: a line's end sits below a curve that flattens; moved to the last step along a rising trend), the standard deviation of all of them around their
    least-squares line (the trend is not noise), and that line's slope per step."""
    n = len(losses)
    mean_t, mean_y = (n - 1) / 2, math.fsum(losses) / n
    var_t = math.fsum((t - mean_t) ** 2 for t in range(n))
    slope = math.fsum((t - mean_t) * (y - mean_y) for t, y in enumerate(losses)) / var_t
    residuals = [y - (mean_y + slope * (t - mean_t)) for t, y in enumerate(losses)]
    recent = losses[-LEVEL_STEPS:]
    # a rising mean is carried to the last step along the trend (it lags by half its span); a falling one is not
    level = math.fsum(recent) / len(recent) + max(slope, 0.0) * (len(recent) - 1) / 2
    return level, math.sqrt(math.fsum(r * r for r in residuals) / (n - 2)), slope


def expected_loss(watch: Mapping, step: int) -> float:
    """The loss expected at ``step``: the level before the switch, a rising trend continued (damped over HISTORY
    steps: the LR warm-up's rise is not the plan's), plus what the plan's formats cost on the switch's own batch
    (``offset``). A falling trend is not continued: a loss curve flattens, and expecting it to keep falling
    alarmed on every healthy demo run (4 alarms in 30 steps after the first switch)."""
    delta = step - watch["step"] + 1  # (the level is the last steps before the switch)
    rise = max(watch["slope"], 0.0) * HISTORY * (1.0 - math.exp(-delta / HISTORY))
    return watch["mu"] + rise + watch["offset"]


class SpikeGuard:
    """Watches the loss after each plan switch (see the module text).

    Args:
        threshold: a rise alarms once the CUSUM of its standardized residuals reaches PATIENCE x (threshold -
            DRIFT): two steps at threshold sigma, or a smaller rise held longer; None: off.
    """

    def __init__(self, threshold: float | None) -> None:
        self.threshold = threshold
        self.losses: deque[float] = deque(maxlen=HISTORY)
        # {"step", "mu", "slope", "sigma", "cusum", "excess", "steps", "previous": {key: format}}
        self.watch: dict | None = None
        self.avoid: dict[tuple[str, str], int] = {}  # (plan key, format name) -> solves left
        self.num_reverts = 0
        self.num_watched = 0  # switches watched (a switch with too short a history before it is not)
        self.num_unconfirmed = 0  # alarms the same-batch check found were not the plan's
        self.max_rise = -math.inf  # the largest (loss - expected) / noise seen while watching: the margin kept

    @property
    def enabled(self) -> bool:
        return self.threshold is not None

    @property
    def watching(self) -> bool:
        return self.watch is not None

    def checks_gradients(self, step: int) -> bool:
        """Whether ``step``'s gradients are checked for finiteness: the GRADIENT_STEPS steps after a switch, where
        a plan's formats first meet them (the watch itself goes on; a non-finite loss is caught at every step)."""
        return self.watch is not None and step - self.watch.get("switched", self.watch["step"]) < GRADIENT_STEPS

    @property
    def limit(self) -> float:
        """The CUSUM's alarm level, in sigma."""
        return PATIENCE * (self.threshold - DRIFT)

    def on_switch(self, step: int, previous: Mapping[str, str]) -> None:
        """A plan was applied before ``step``; ``previous``: the format (name) each key it changed had."""
        if not previous:  # a plan that changed nothing: the watch of the last change goes on
            return
        if not self.enabled or len(self.losses) < MIN_HISTORY:
            self.watch = None
            return
        self.watch = {"step": step, "switched": step, "previous": dict(previous), "cost": None, "offset": 0.0}
        self._rebase(step)
        self.num_watched += 1

    def _rebase(self, step: int) -> None:
        mu, sigma, slope = baseline(list(self.losses))
        self.watch.update({"step": step, "mu": mu, "slope": slope, "sigma": max(sigma, NOISE_FLOOR * abs(mu), 1e-12),
                           "cusum": 0.0, "excess": 0.0, "steps": 0})

    @property
    def needs_plan_cost(self) -> bool:
        """A plan was just applied and what its formats cost on its first batch is not measured yet."""
        return self.watch is not None and self.watch["cost"] is None

    def set_plan_cost(self, step: int, cost: float) -> Revert | None:
        """What the plan's formats cost on the switch's own batch (its loss minus under the formats before it, the
        same on every rank): the watch expects it on top of the trend. A cost of ``threshold`` sigma or more (or
        not finite) reverts at once: a catastrophe needs no trend to be seen."""
        watch = self.watch
        if not math.isfinite(cost) or cost >= self.threshold * watch["sigma"]:
            return self._revert(step, f"the plan's formats cost {cost:.4g} on the switch's batch, >= {self.threshold:g} "
                                      f"x the loss's noise ({watch['sigma']:.3g})")
        watch["cost"], watch["offset"] = cost, max(cost, 0.0)
        return None

    def observe(self, step: int, loss: float, *, finite_grads: bool = True) -> Revert | Alarm | None:
        """One optimizer step's loss (averaged over micro-batches and ranks): a Revert (a non-finite loss or
        gradient), an Alarm for the caller to confirm, or None."""
        if not self.enabled:
            return None
        watch = self.watch
        if watch is None:
            if math.isfinite(loss):
                self.losses.append(loss)
            return None
        if not finite_grads or not math.isfinite(loss):
            return self._revert(step, "non-finite gradients" if not finite_grads else f"non-finite loss ({loss})")
        watch.setdefault("offset", 0.0)
        expected = expected_loss(watch, step)
        z = (loss - expected) / watch["sigma"]
        self.max_rise = max(self.max_rise, z)
        watch["cusum"] = max(0.0, watch["cusum"] + z - DRIFT)
        if watch["cusum"] > 0:
            watch["excess"], watch["steps"] = watch["excess"] + (loss - expected), watch["steps"] + 1
        else:
            watch["excess"], watch["steps"] = 0.0, 0
        self.losses.append(loss)
        if watch["cusum"] >= self.limit:
            rise = watch["excess"] / watch["steps"]
            return Alarm(step=step, rise=rise, previous=dict(watch["previous"]), cost_at_switch=watch["cost"] or 0.0,
                         reason=(
                f"loss {loss:.4g} against {expected:.4g} expected by the trend before the switch (noise "
                f"{watch['sigma']:.3g}); a mean rise of {rise:.3g} over {watch['steps']} steps (CUSUM "
                f"{watch['cusum']:.1f} >= {self.limit:g} sigma)"))
        return None

    def confirm(self, alarm: Alarm, plan_cost: float) -> Revert | None:
        """The same-batch check of ``alarm``: ``plan_cost``, the batch's loss under the plan's formats minus under
        the formats before it (the same on every rank). A Revert when the plan explains the rise; otherwise the
        watch takes a new baseline from the latest losses (and goes on)."""
        if math.isfinite(plan_cost) and plan_cost - alarm.cost_at_switch < CONFIRM_SHARE * alarm.rise:
            self.num_unconfirmed += 1
            if self.watch is not None:
                self._rebase(alarm.step + 1)
                self.watch["offset"] = 0.0  # (the new level holds the plan's cost already)
            return None
        return self._revert(alarm.step, f"{alarm.reason}; on the same batch the plan's formats cost {plan_cost:.3g}")

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
                "num_watched": self.num_watched, "max_rise": self.max_rise, "num_unconfirmed": self.num_unconfirmed,
                "avoid": [[key, fmt, left] for (key, fmt), left in self.avoid.items()]}

    def load_state_dict(self, state: Mapping) -> None:
        self.losses = deque((float(v) for v in state.get("losses", [])), maxlen=HISTORY)
        self.watch = dict(state["watch"]) if state.get("watch") else None
        if self.watch is not None and "cusum" not in self.watch:  # (a watch from before 2026-12-05: taken anew)
            self.watch.update({"cost": 0.0, "offset": 0.0})
            self._rebase(self.watch["step"])
        self.num_unconfirmed = int(state.get("num_unconfirmed", 0))
        self.num_reverts = int(state.get("num_reverts", 0))
        self.num_watched = int(state.get("num_watched", 0))
        self.max_rise = float(state.get("max_rise", -math.inf))
        self.avoid = {(key, fmt): int(left) for key, fmt, left in state.get("avoid", [])}


def log_revert(revert: Revert) -> None:
    """The warning naming the layers a revert put back (call on one rank)."""
    layers = sorted({split_key(key)[0] for key in revert.formats})
    logger.warning("SNIP spike guard at step %d: %s; the last plan's changes to %d layer(s) reverted (%s%s), their "
                   "formats avoided for the next %d solves", revert.step, revert.reason, len(layers),
                   ", ".join(layers[:6]), ", ..." if len(layers) > 6 else "", AVOID_ROUNDS)


def log_unconfirmed(alarm: Alarm, plan_cost: float, *, again: bool = False) -> None:
    """The line of an alarm the same batch did not confirm (call on one rank): a warning, not a note, since a rise
    the plan's backward formats caused shows in no forward and is not reverted (the user is the one who can act);
    ``again`` (a repeat under the same plan: the watch's new baselines after a lasting shift alarm again within a few
    steps) an info line."""
    logger.log(logging.INFO if again else logging.WARNING,
               "SNIP loss watch at step %d: the loss rose %.3g above the watch's expected loss after the last plan, "
               "but that plan's formats cost only %.3g more than at the switch on the same batch's forward: not "
               "reverted (a rise through the backward GEMMs shows in no forward; if it goes on, pin the layers or set "
               "replan=False); watching on from a new baseline", alarm.step, alarm.rise,
               plan_cost - alarm.cost_at_switch)


def measured_cost(measure: Callable[[], float], fallback: float, step: int, collective: Collective,
                   meaning: str) -> float:
    """``measure()``, the plan's cost on this step's batch; a measure that fails (the user's loss on a slice of
    the batch) warns and gives ``fallback``: training goes on, the loss watch with it."""
    try:
        return measure()
    except Exception as err:  # noqa: BLE001 - the loss watch's measure must not take training down
        if collective.is_rank_zero:
            logger.warning("SNIP loss watch: measuring the plan's cost on step %d's batch failed (%s: %s); %s",
                           step, type(err).__name__, err, meaning)
        return fallback
