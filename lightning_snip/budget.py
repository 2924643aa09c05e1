"""SNIP's own cost against training's, and the round schedule that keeps its share within a budget.

OverheadBudget times every optimizer step on the training thread (the wall time of its micro-batches, from each
one's start, before SNIP's work in it, to its end; what runs between steps, such as validation, is not counted). A step in which SNIP worked (a statistics round, a first-order sample, a plan switch and the
recompile its new formats cause) costs its excess over the median of the recent steps in which it did not (at
least 3 of them: one slow first step, which compiles and allocates, does not move it);
the rest is training's. With ``overhead_budget`` set, each round decides when the next one comes and how many
steps its first-order sample takes, so that SNIP's measured seconds stay within that share of training's over
the run: the next round comes at least ``interval`` steps later, and later still while the share spent so far
and the next cycle's predicted cost (the last round's, the last switch's, and the sample's) would exceed the
budget; the sample takes at most ``first_order_steps`` steps and at most as much time as a round. The spacing
then adapts to the evidence: a new plan that keeps at least STEADY_AGREEMENT of the previous plan's formats
doubles it (up to MAX_STRETCH times the budget's), one that keeps less than CHANGED_AGREEMENT, or a plan the
spike guard reverts, brings it back to the budget's (never below it: the budget and ``interval`` stay floors).
Fewer rounds cost no mean quality on either quality protocol but widened the seeds' spread (docs/method.md
section 12), so the spacing stretches only while the plans hold. Rounds stop
where the next one would fall past the run's last step. Without a budget the schedule is fixed (every
``interval`` steps, ``first_order_steps`` sampled before each). Either schedule counts from the first step it
sees, and a round is due at the first step at or after its scheduled one (never lost to a resume). Written by hand: no library schedules a
callback's work against a time budget. Pure Python; the controller feeds it times and broadcasts its decisions.
"""

from __future__ import annotations

import enum
import math
import statistics
from collections import deque
from collections.abc import Mapping

from lightning_snip.config import SNIPConfig

RECENT_STEPS = 32  # plain steps whose median is a step's cost without SNIP
MIN_RECENT = 3  # plain steps before a step SNIP worked in is priced (it waits): their median ignores one outlier,
# the process's first step (which compiles and allocates)
FIRST_SAMPLE_STEPS = 8  # a first round's first-order sample under a budget: nothing is timed before it
WORK_KINDS = ("round", "first_order", "switch")
APPLY_DELAY = 1  # a plan solved from step t's statistics applies at step t + 1: its solve runs in a thread meanwhile
STEADY_AGREEMENT = 0.9  # a plan keeping at least this share of its GEMMs' (layers') formats: the next round later
CHANGED_AGREEMENT = 0.75  # one keeping less: back to the budget's spacing
MAX_STRETCH = 8  # the longest spacing, in multiples of the budget's


class StepKind(enum.Enum):
    """What SNIP does on an optimizer step, as the schedule (OverheadBudget.step_kind) says."""

    PLAIN = "plain"  # nothing scheduled (a plan may still be applied, the canary may check one)
    FIRST_ORDER = "first_order"  # LD's first-order term sampled on the step's forward and backward
    ROUND = "round"  # a statistics round before the step's forward (its first micro-batch only)


class OverheadBudget:
    """Times steps, adds up SNIP's share, and schedules rounds (``next_round``, ``num_first_order``).

    Feed it ``step_started(step, now)`` at each micro-batch's start (a new step closes the last one),
    ``batch_ended(now)`` at its end, and ``mark(kind)`` when SNIP works in the current step (``round``, ``first_order``, ``switch``). Public:
    ``train_seconds``, ``snip_seconds`` (per kind), ``share`` (SNIP's over training's), ``next_round`` (None:
    no round left), ``num_first_order`` (its sample's steps) and ``stretch`` (the spacing's multiple of the budget's;
    ``plan_applied`` and ``plan_reverted`` adapt it).
    """

    def __init__(self, config: SNIPConfig) -> None:
        self.budget = config.overhead_budget if config.replan else None
        self.replan, self.warmup_steps, self.apply_delay = config.replan, config.warmup_steps, APPLY_DELAY
        self.interval, self.max_first_order = config.interval, config.first_order_steps
        self.horizon: int | None = None  # the run's last step + 1, when known (set_horizon)
        self.next_round: int | None = config.warmup_steps if config.replan else None
        # under a budget the first sample is small (nothing is timed before it) and leaves half the warmup unsampled
        self.num_first_order = self.max_first_order if self.budget is None else min(
            self.max_first_order, FIRST_SAMPLE_STEPS, config.warmup_steps // 2)
        self.train_seconds = 0.0
        self.snip_seconds = {kind: 0.0 for kind in WORK_KINDS}
        self.recent: deque[float] = deque(maxlen=RECENT_STEPS)
        # the last cycle's costs: a round's seconds, a switch's, and a first-order step's (None: not timed yet)
        self.costs: dict[str, float | None] = {kind: None for kind in WORK_KINDS}
        self._sampled: list[float] = []  # this cycle's first-order steps' excess seconds
        self._unresolved: list[tuple[str, float]] = []  # (kind, seconds) of steps closed before MIN_RECENT plain ones
        self._fastest = math.inf  # the shortest step closed: the step time until MIN_RECENT plain steps are timed
        self._step: int | None = None
        self._round_step: int | None = None  # the step whose round has started (one per step, not per micro-batch)
        self._start: float | None = None  # the running micro-batch's start
        self._seconds = 0.0  # the current step's micro-batches so far
        self._work: set[str] = set()
        self._next_work: set[str] = set()
        self.stretch = 1
        self._base: tuple[int, int] | None = None  # (the last round's step, the budget's gap after it)
        # The schedule counts from the first step it sees (anchor): a run resumed from a checkpoint without SNIP's
        # state, or SNIP added at step N, warms up and samples as a fresh run started at N would.
        self.anchored = False

    # ------------------------------------------------------------------ timing

    def set_horizon(self, max_steps: int | None, step: int = 0) -> None:
        """The run's number of steps (None: unknown), at ``step`` (a resumed run's first): a round the last horizon
        cut is scheduled again where this one allows it, and a round past this one is cut."""
        self.horizon = max_steps if max_steps is not None and max_steps > 0 else None
        if self.budget is not None and self._base is not None and (self.next_round is None or step < self.next_round
                                                                   - self.num_first_order):
            next_round = self._from_base(step)
            self.next_round = None if self._past_horizon(next_round) else next_round

    def step_started(self, step: int, now: float) -> None:
        """A micro-batch of ``step`` starts at ``now`` (seconds): a new step closes the last one."""
        if not self.anchored:
            self.anchor(step)
        if step != self._step:
            if self._step is not None and self._seconds > 0:
                self._close(self._seconds)
            self._step, self._seconds, self._work, self._next_work = step, 0.0, self._next_work, set()
        self._start = now

    def anchor(self, step: int) -> None:
        """Count the schedule from ``step``, the first this budget sees (a restored schedule is anchored already):
        the first round comes ``warmup_steps`` after it."""
        self.anchored = True
        if self.replan and self.next_round is not None and self._base is None:
            self.next_round += step

    def first_round_from(self, step: int) -> int | None:
        """The step of the next round of a run that (re)starts at ``step`` (None: none is scheduled): an unanchored
        schedule counts from ``step``, as ``anchor`` will."""
        if not self.replan or self.next_round is None:
            return None
        if not self.anchored and self._base is None:
            return self.next_round + step
        return max(self.next_round, step)  # (a restored schedule behind the run catches up at once: step_kind)

    def batch_ended(self, now: float) -> None:
        """The running micro-batch ends at ``now``."""
        if self._start is not None:
            self._seconds += now - self._start
            self._start = None

    def mark(self, kind: str, *, next_step: bool = False) -> None:
        """SNIP works in the current step (one of WORK_KINDS), or, ``next_step``, in the next one (a revert at a
        step's end: the next forward runs, and may recompile, the formats it restored)."""
        (self._next_work if next_step else self._work).add(kind)

    def _close(self, seconds: float) -> None:
        self._fastest = min(self._fastest, seconds)
        if not self._work:
            self.train_seconds += seconds
            self.recent.append(seconds)
            if len(self.recent) >= MIN_RECENT:
                for kind, unresolved in self._unresolved:  # steps SNIP worked in before: priced now
                    self._account(kind, unresolved)
                self._unresolved = []
            return
        kind = next(k for k in WORK_KINDS if k in self._work)  # a round's step: its round (and what else ran)
        if len(self.recent) >= MIN_RECENT:
            self._account(kind, seconds)
        else:
            self._unresolved.append((kind, seconds))

    def _account(self, kind: str, seconds: float) -> None:
        excess = seconds - statistics.median(self.recent)  # (a noisy step may be negative: the sum stays unbiased)
        self.train_seconds += seconds - excess
        self.snip_seconds[kind] += excess
        if kind == "first_order":
            self._sampled.append(excess)
        elif kind == "switch":
            self.costs["switch"] = max(excess, 0.0)

    @property
    def step_seconds(self) -> float | None:
        """The median recent step without SNIP's work (None before MIN_RECENT of them)."""
        return statistics.median(self.recent) if len(self.recent) >= MIN_RECENT else None

    @property
    def share(self) -> float:
        """SNIP's seconds over training's, so far."""
        return sum(self.snip_seconds.values()) / self.train_seconds if self.train_seconds > 0 else 0.0

    # ------------------------------------------------------------------ schedule

    def step_kind(self, step: int) -> StepKind:
        """What SNIP does at ``step``: ROUND when a round is due (the first step at or after the scheduled one, once
        per step: a schedule behind the run, such as a checkpoint's, catches up once and does not replay the rounds
        it missed), FIRST_ORDER on the ``num_first_order`` steps before it, else PLAIN."""
        if not self.replan or self.next_round is None:
            return StepKind.PLAIN
        if step >= self.next_round:
            return StepKind.PLAIN if step == self._round_step else StepKind.ROUND
        return StepKind.FIRST_ORDER if self.next_round - step <= self.num_first_order else StepKind.PLAIN

    def round_started(self, step: int) -> None:
        """The round of ``step`` has begun: the step's later micro-batches are PLAIN."""
        self._round_step = step

    def decide(self, step: int, round_seconds: float) -> tuple[int | None, int, int, int]:
        """After the round at ``step`` (``round_seconds`` long): the next round's step (None: none left), its
        sample's steps, and this round's step and the budget's gap (which ``plan_applied`` stretches). Rank 0
        decides; apply the answer with ``follow`` on every rank."""
        self.costs["round"] = round_seconds
        if self._sampled:
            self.costs["first_order"] = max(statistics.mean(self._sampled), 0.0)
        self._sampled = []
        if self.budget is None:
            return step + self.interval, self.max_first_order, step, self.interval
        next_round, num_first_order = self._budgeted(step, round_seconds)
        gap = next_round - step
        next_round = step + gap * self.stretch
        return (None if self._past_horizon(next_round) else next_round), num_first_order, step, gap

    def _from_base(self, first_unrun: int) -> int:
        """The last round's step plus the budget's gap times the stretch, no sooner than a whole sample ahead of
        ``first_unrun``."""
        round_step, gap = self._base
        return max(round_step + gap * self.stretch, first_unrun + 1 + self.num_first_order)

    def _past_horizon(self, next_round: int) -> bool:
        return self.horizon is not None and next_round + self.apply_delay >= self.horizon  # its plan would never apply

    def _budgeted(self, step: int, round_seconds: float) -> tuple[int, int]:
        per_sample = self.costs["first_order"]
        num = self.max_first_order if not per_sample else min(self.max_first_order,
                                                              int(round_seconds / per_sample))
        cycle = round_seconds + (self.costs["switch"] or 0.0) + num * (per_sample or 0.0)
        # this round's seconds are not in snip_seconds until its step closes: counted here
        spent = sum(self.snip_seconds.values()) + round_seconds
        step_seconds = self.step_seconds or (self._fastest if math.isfinite(self._fastest) else None)
        if not step_seconds:  # nothing timed at all (a round at step 0): the shortest spacing
            return step + self.interval, num
        gap = max(self.interval, math.ceil((spent + cycle - self.budget * self.train_seconds) / (self.budget * step_seconds)))
        return step + gap, min(num, gap // 2)  # (half the cycle's steps at least run plain: they price the rest)

    def follow(self, decision: tuple[int | None, int, int, int]) -> None:
        self.next_round, self.num_first_order, round_step, gap = decision
        self._base = (round_step, gap)

    def plan_applied(self, step: int, agreement: float) -> None:
        """A new plan, applied at the start of ``step``, kept ``agreement`` of the previous plan's formats (the
        same on every rank): steady plans space the rounds out, changed ones bring them back to the budget's."""
        if agreement >= STEADY_AGREEMENT:
            self._restretch(step, min(2 * self.stretch, MAX_STRETCH))
        elif agreement < CHANGED_AGREEMENT:
            self._restretch(step, 1)

    def plan_reverted(self, step: int) -> None:
        """The spike guard reverted the last plan at the end of ``step``: the budget's spacing again."""
        self._restretch(step + 1, 1)

    def _restretch(self, first_unrun: int, stretch: int) -> None:
        if self.budget is None or self._base is None or stretch == self.stretch:
            return
        shorter, self.stretch = stretch < self.stretch, stretch
        if self.next_round is not None and first_unrun > self.next_round - self.num_first_order:
            return  # its sample has begun: that round stays; the new stretch counts from its decision
        next_round = self._from_base(first_unrun)
        if shorter and self.next_round is not None:
            next_round = min(next_round, self.next_round)  # sooner never means later
        self.next_round = None if self._past_horizon(next_round) else next_round

    # ------------------------------------------------------------------ checkpoint

    def state_dict(self) -> dict:
        """The decisions and every clock-derived quantity later decisions read (the recent steps' times, the step
        still open, the costs): a resumed run schedules as the uninterrupted one, whatever its machine's speed,
        until its own times replace them."""
        return {"next_round": self.next_round, "num_first_order": self.num_first_order,
                "train_seconds": self.train_seconds, "snip_seconds": dict(self.snip_seconds),
                "costs": dict(self.costs), "stretch": self.stretch, "base": self._base,
                "recent": list(self.recent), "sampled": list(self._sampled),
                "unresolved": [list(item) for item in self._unresolved],
                "fastest": self._fastest if math.isfinite(self._fastest) else None,
                "open_step": None if self._step is None else [self._step, self._seconds, sorted(self._work),
                                                               sorted(self._next_work)]}

    def load_state_dict(self, state: Mapping) -> None:
        self.anchored = True
        self.next_round = state["next_round"]
        self.num_first_order = int(state["num_first_order"])
        self.train_seconds = float(state["train_seconds"])
        self.snip_seconds.update({k: float(v) for k, v in state["snip_seconds"].items()})
        self.costs.update(state["costs"])
        self.stretch = int(state.get("stretch", 1))  # (checkpoints before the adaptive spacing: none)
        self._base = tuple(state["base"]) if state.get("base") is not None else None
        # (checkpoints before 2026-12-05 kept no times: the resumed run times its own steps first)
        self.recent = deque((float(v) for v in state.get("recent", [])), maxlen=RECENT_STEPS)
        self._sampled = [float(v) for v in state.get("sampled", [])]
        self._unresolved = [(str(kind), float(seconds)) for kind, seconds in state.get("unresolved", [])]
        self._fastest = math.inf if state.get("fastest") is None else float(state["fastest"])
        if state.get("open_step") is not None:
            step, seconds, work, next_work = state["open_step"]
            self._step, self._seconds, self._work, self._next_work = int(step), float(seconds), set(work), set(next_work)
