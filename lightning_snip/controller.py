"""SNIPController: the SNIP loop without a Trainer.

It owns the schedule (which steps sample the first-order term, which run a statistics round), the
round itself, the aggregate over rounds, the background solve and the switch at a step boundary, and
its checkpoint state. It talks to other ranks only through a ``Collective`` given to each call (a sum
over ranks and a broadcast from rank 0; one process by default), and logs nothing to a Lightning
logger: each call that measures something returns its scalars. lightning_snip.callback.SNIPCallback
is the Lightning adapter over it; a plain PyTorch loop or a benchmark can drive it directly:

    controller = SNIPController(SNIPConfig(...))
    controller.attach(model)
    controller.resume(model)  # a plan given to the controller (or restored by load_state_dict)
    for step, batch in enumerate(batches):
        controller.begin_batch(step)
        controller.apply_due(model, step)
        kind = controller.step_kind(step)
        if kind is StepKind.ROUND:
            controller.statistics_round(model, batch, lambda b: model.loss(b), step=step, optimizer=opt)
        elif kind is StepKind.FIRST_ORDER:
            controller.start_first_order(step)  # samples LD's first-order term on this step
        loss = model.loss(batch); loss.backward(); opt.step(); opt.zero_grad()
        controller.end_batch()
        controller.observe_step(model, step, loss.item())  # the spike guard (reverts a plan that hurts)
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Callable, Mapping

import torch

from lightning_snip.aggregate import DivergenceAggregate
from lightning_snip.budget import APPLY_DELAY, OverheadBudget, StepKind
from lightning_snip.canary import CanaryVerdict, check_plan, plan_cost
from lightning_snip.collective import SINGLE_PROCESS, Collective
from lightning_snip.config import SNIPConfig
from lightning_snip.device_clock import Timeline
from lightning_snip.divergence import DivergenceResult
from lightning_snip.convert import (UnmatchedPinsError, apply_plan, convert_linears, find_output_head, glob_filter,
                                    layer_assignment)
from lightning_snip.evidence import (aggregate_candidates, check_reachable, current_fp4_fraction, fitted_plan,
                                     grad_noise_ratios, guarded_formats, invalid_formats, layer_flops, priced_plan)
from lightning_snip.first_order import FirstOrderRecorder
from lightning_snip.formats import Format
from lightning_snip.kernels import own_work
from lightning_snip.linear import SNIPLinear
from lightning_snip.pending_solve import PendingSolve
from lightning_snip.recompile import CompiledPlans
from lightning_snip.rng import stream_seed
from lightning_snip.plan import Granularity, Plan, SolveStatus, reverted_plan, split_key
from lightning_snip.reporting import applied_plan_scalars, divergence_scalars, plan_agreement
from lightning_snip.setup_report import log_setup
from lightning_snip.stats import Propagation
from lightning_snip.spike_guard import (AVOID_ROUNDS, measured_cost, MIN_HISTORY, Alarm, Revert, SpikeGuard, log_revert,
                                        log_unconfirmed)
from lightning_snip.statistics_round import RoundSettings, round_generator, run_statistics_round

logger = logging.getLogger(__name__)

# Rounds kept in ``history`` (memory and checkpoint): the aggregate carries what later solves need, so a long run's
# state does not grow with its rounds.
HISTORY_ROUNDS = 16
# The longest fit end waits for a solve still running: the solver's own limit (planner.solve_plan, 10 s) and margin.
SOLVE_JOIN_SECONDS = 30.0


def _config_field_error(err: ValueError, cfg) -> ValueError:
    """convert_linears' error in the config's words: its ``filter`` is ``include``, and unmatched pins
    that all come from ``extra_pins`` are named as that field."""
    message = str(err)
    if message.startswith("filter:"):
        return ValueError("include:" + message[len("filter:"):])
    if isinstance(err, UnmatchedPinsError) and set(err.patterns) <= cfg.extra_pin_globs:
        return ValueError("extra_pins:" + message[len("pins:"):])
    return err


class SNIPController:
    """Adaptive per-layer FP4/FP8 precision (SNIP) for a model's linear layers, trainer-free.

    ``attach`` converts the selected ``nn.Linear`` layers to SNIPLinear (same Parameters). Every
    ``interval`` steps from ``warmup_steps`` on, ``statistics_round`` measures LD and WD on the first
    ``max_rows`` token rows of a batch (high precision, see lightning_snip.stats), averages them over
    ranks, folds them into the aggregate over rounds and starts the ILP solve on rank 0 in a
    background thread; at the next step (budget.APPLY_DELAY) ``apply_due`` joins it, broadcasts the plan and
    every rank applies it before that step's forward pass. In the ``first_order_steps`` steps before
    a round, ``start_first_order`` samples LD's first-order term on the live training steps. A failed
    round or solve logs a warning and training continues on the last good plan; past
    ``max_consecutive_failures`` in a row it raises.

    Public state: ``config``, ``layers`` (fqn -> SNIPLinear), ``plan`` (the applied Plan or None),
    ``history`` (a list of dicts: step, divergence, plan; the last HISTORY_ROUNDS rounds), ``aggregate``, ``num_stats_rounds``,
    ``num_plans_applied``, ``num_consecutive_failures``, ``grad_noise_ratios`` and ``invalid_formats``
    (the last round's), ``sr_generator`` (stochastic rounding's random source).
    """

    def __init__(self, config: SNIPConfig | None = None, *, plan: Plan | None = None,
                 round_settings: RoundSettings | None = None) -> None:
        self.config = config if config is not None else SNIPConfig()
        if round_settings is not None and not isinstance(round_settings, RoundSettings):
            raise TypeError(f"round_settings: expected a lightning_snip.statistics_round.RoundSettings, got "
                            f"{type(round_settings).__name__}")
        self.round_settings = round_settings  # the estimator's (None: the library's; benchmarks vary them)
        if not isinstance(self.config, SNIPConfig):
            raise TypeError(f"config: expected a SNIPConfig, got {type(self.config).__name__}")
        if plan is not None and not isinstance(plan, Plan):
            raise TypeError(f"plan: expected a lightning_snip.plan.Plan, got {type(plan).__name__}")
        self.layers: dict[str, SNIPLinear] = {}
        self.output_head: str | None = None  # the model's output head by what it is (convert.find_output_head)
        self.plan: Plan | None = plan
        self.plan_restored = False  # the plan came from a checkpoint (resume fits it to this run's settings)
        self.state_restored = False  # load_state_dict ran (a checkpoint with SNIP's state)
        self.history: list[dict] = []
        self.num_stats_rounds = self.num_plans_applied = 0
        self.aggregate = DivergenceAggregate()
        self.pending: PendingSolve | None = None
        self.restored_pending: tuple[int, int] | None = None  # (stats_step, apply_step): a checkpoint's
        self.propagation = Propagation.PROBE  # exact after probes proved unsupported
        self.flops: dict[str, float] = {}
        self.budget = OverheadBudget(self.config)  # when rounds run, and what SNIP's work costs
        self.timeline = Timeline(self.budget)  # SNIP's clock: the device's timeline (lightning_snip.device_clock)
        self.priced_seconds = 0.0  # SNIP's seconds the budget had priced when ``overhead_update`` last logged them
        self.recorder: FirstOrderRecorder | None = None
        # (fqn, format) -> first-order terms of the batches sampled since the last round.
        self.first_order_history: dict[tuple[str, Format], list[float]] = {}
        self.device = torch.device("cpu")  # the model's, from attach
        self.sr_generator: torch.Generator | None = None
        self.sr_seed = 0
        self.num_consecutive_failures = 0  # statistics rounds or solves in a row that gave no plan
        self.grad_noise_ratios: dict[str, float] = {}  # the last round's, per switchable layer
        self.invalid_formats: list[tuple[str, Format]] = []  # the last round's non-finite candidates
        # (without replanning nothing switches: no guard, and nothing read per step)
        self.guard = SpikeGuard(self.config.spike_threshold if self.config.replan else None)
        self.formats_before_switch: dict[str, Format] = {}  # plan key -> format before the last plan (the canary's fallback)
        self.num_canary_reverts = 0  # GEMM directions the plan canary put back
        self.canary_due = False  # an alarm the same batch did not confirm: the canary checks the next step
        self.unconfirmed_warned: int | None = None  # the switch step whose watch last warned of an unconfirmed alarm
        self.compiled_plans = CompiledPlans()  # keeps dynamo's recompile limit ahead of the assignments applied

    @property
    def fp4_fraction(self) -> float:
        """FP4 share of the converted layers' linear FLOPs under the formats in force now."""
        return current_fp4_fraction(self.layers, self.flops)

    @property
    def switchable_fp4_fraction(self) -> float:
        """FP4 share of the switchable (unpinned) layers' linear FLOPs under the formats in force now."""
        return current_fp4_fraction(self.layers, self.flops, unpinned=True)

    def close(self, timeout: float = SOLVE_JOIN_SECONDS) -> None:
        """Stop the first-order sampling and wait (at most ``timeout`` seconds) for a solve still running: at fit
        end, a process that exits while the solver's thread runs native code can abort ("terminate called
        without an active exception"). A solve that outlives the wait is left to its daemon thread, said."""
        self.stop_recording()
        pending, self.pending = self.pending, None
        if pending is not None:  # (kept for a checkpoint written after fit, and a next fit: solved again from its round)
            self.restored_pending = (pending.stats_step, pending.apply_step)
        if pending is not None and not pending.join(timeout):
            logger.warning("SNIP: the solve started at step %d was still running %.0f s after fit end; left to its "
                           "daemon thread", pending.stats_step, timeout)

    # ------------------------------------------------------------------ setup

    def attach(self, model: torch.nn.Module, *, device: torch.device | str | None = None) -> None:
        """Convert ``model``'s selected linears (at the default pins, its output head found by what it is
        stays in bf16: lightning_snip.convert.find_output_head), apply a given plan, check the target is
        reachable and give every layer the stochastic-rounding generator (on ``device``, default the model's)."""
        cfg = self.config
        try:
            self.layers = convert_linears(model, filter=glob_filter(cfg.include, cfg.exclude), pins=cfg.pin_formats,
                                          optional_pins=cfg.optional_pins, output_head_format=cfg.output_head_format,
                                          initial_format=cfg.initial_format, recipe=cfg.recipe)
        except ValueError as err:  # name the config's field, not convert_linears' argument (pins is both)
            raise _config_field_error(err, cfg) from None
        self.output_head = find_output_head(model)  # (for the setup lines: said where the pins leave it switchable)
        self.flops = layer_flops(self.layers)
        self.recorder = FirstOrderRecorder(self.layers, cfg) if cfg.replan else None  # (no taps without rounds)
        if self.plan is not None and not self.plan_restored:
            apply_plan(model, self.plan)  # a given plan that does not fit the model fails here
        if cfg.replan:
            check_reachable(self.layers, cfg)
        # Stochastic rounding draws from one generator per rank, reseeded every micro-batch from
        # (the run's seed, rank, step, batch index): ranks round independently, a rerun or a resumed
        # run draws the same numbers, and the global RNG (dropout) is left alone.
        if device is None:
            device = next((p.device for p in model.parameters()), torch.device("cpu"))
        self.device = torch.device(device)
        self.timeline.use_device(self.device)
        self.sr_generator = torch.Generator(device=self.device)
        self.sr_seed = torch.initial_seed()
        for layer in self.layers.values():
            layer.generator = self.sr_generator
        self.compiled_plans.note_plan(self.layers)

    def log_setup(self, device) -> None:
        """The run's setup lines (call on one rank)."""
        log_setup(self.config, self.layers, device, self.output_head)

    def resume(self, model: torch.nn.Module, collective: Collective = SINGLE_PROCESS) -> None:
        """At train start: apply the plan held (given, or restored from a checkpoint), and restart a
        solve the checkpoint was saved in the middle of."""
        if self.plan is not None and self.plan_restored:  # a checkpoint's plan, under this run's pins and formats
            self.plan, changes = fitted_plan(self.plan, self.layers, self.config)
            self.plan_restored = False
            if changes and collective.is_rank_zero:
                logger.warning("SNIP: the checkpoint's plan does not fit this run's settings; %d entr%s changed until "
                               "the next plan: %s", len(changes), "y" if len(changes) == 1 else "ies",
                               "; ".join(changes[:3]) + ("; ..." if len(changes) > 3 else ""))
        if self.plan is not None:
            self.plan = priced_plan(self.plan, self.layers)  # (a hand-made or older plan: the RHT's price added)
            apply_plan(model, self.plan)
            self.compiled_plans.note_plan(self.layers)
            if collective.is_rank_zero:
                logger.info("SNIP: applied the plan held at train start (%d layers)",
                            len({split_key(key)[0] for key in self.plan}))
        if self.restored_pending is not None:
            # The checkpoint was saved between a statistics round and its apply step: the round is in
            # the restored aggregate, so solving it again gives the plan the uninterrupted run applies.
            stats_step, apply_step = self.restored_pending
            self.restored_pending = None
            self.start_solve(stats_step, apply_step, collective, count=False)  # (counted before the checkpoint)

    # ------------------------------------------------------------------ schedule

    def step_kind(self, step: int) -> StepKind:
        """What the schedule (the budget's) has SNIP do at ``step``: ROUND (a statistics round before its forward;
        with gradient accumulation, on the step's first micro-batch only), FIRST_ORDER (LD's first-order term
        sampled on its forward and backward) or PLAIN."""
        return self.budget.step_kind(step)

    def works_at(self, step: int) -> bool:
        """Whether SNIP works before ``step``'s forward: a round, a plan to apply, or the plan canary."""
        return self.step_kind(step) is StepKind.ROUND or self.pending is not None or self.canary_due

    def begin_batch(self, step: int, batch_idx: int = 0, rank: int = 0) -> None:
        """Time the steps (a new step closes the last one), and reseed stochastic rounding for this (rank, step,
        micro-batch)."""
        self.timeline.step_started(step)
        self.sr_generator.manual_seed(stream_seed(self.sr_seed, rank, step, batch_idx))

    def set_horizon(self, max_steps: int | None, step: int = 0, collective: Collective = SINGLE_PROCESS) -> None:
        """The run's number of optimizer steps (None: unknown), at ``step`` (where a resumed run starts): under a
        budget, no round after the first is scheduled whose plan would come after the run's end. Warns (rank zero)
        when no plan has been made or is being solved and none can apply before that end, such as a run resumed
        near its end from a checkpoint without SNIP's state (its warm-up counts from the resumed step)."""
        self.budget.set_horizon(max_steps, step)
        if (not self.config.replan or self.plan is not None or self.restored_pending is not None
                or not collective.is_rank_zero):
            return
        first = self.budget.first_round_from(step)
        if first is None or (max_steps is not None and max_steps > 0 and first + APPLY_DELAY >= max_steps):
            when = ("no round is scheduled" if first is None
                    else f"the first statistics round runs at step {first}, too late for its plan to apply")
            logger.warning("SNIP: no plan will be made in this run (its steps %d to %s; %s; warmup_steps=%d): "
                           "every switchable layer stays in %s", step,
                           max_steps - 1 if max_steps is not None and max_steps > 0 else "?", when,
                           self.config.warmup_steps, self.config.initial_format)
        elif step > 0 and not self.state_restored:  # (SNIP added to a run in progress, or a checkpoint without its state)
            logger.info("SNIP: this run starts at step %d without SNIP's state (none in the checkpoint): SNIP starts "
                        "afresh, warmup_steps=%d counted from here, its first statistics round at step %d", step,
                        self.config.warmup_steps, first)

    @property
    def overhead(self) -> float:
        """SNIP's measured time over training's so far (lightning_snip.budget), as far as the device has got."""
        self.timeline.flush()
        return self.budget.share

    def overhead_update(self, *, final: bool = False) -> dict[str, float] | None:
        """``snip/overhead`` to log when the budget has priced more of SNIP's work since the last one (a step SNIP worked
        in is priced once it closes and the device has run it), and at the end (``final``: waits for the device)."""
        self.timeline.flush(wait=final)
        priced = sum(self.budget.snip_seconds.values())
        if priced == self.priced_seconds and not final:
            return None
        self.priced_seconds = priced
        return {"snip/overhead": self.budget.share}

    def start_first_order(self, step: int, grad_scale: float = 1.0) -> None:
        """Sample the first-order term on this training step's forward and backward (until
        end_batch); ``grad_scale``: the factor the step's gradients carry (accumulation, loss scale)."""
        self.recorder.start(step, grad_scale)
        self.timeline.mark("first_order")

    def end_batch(self) -> None:
        """Stop sampling and keep what this micro-batch's steps sampled; the micro-batch's time ends."""
        self.timeline.batch_ended()
        if self.recorder is None:
            return
        for key, values in self.recorder.stop_and_take().items():
            self.first_order_history.setdefault(key, []).extend(values)

    def stop_recording(self) -> None:
        """Stop the first-order sampling (also on an exception or at teardown)."""
        if self.recorder is not None:
            self.recorder.stop()

    # ------------------------------------------------------------------ the round

    def statistics_round(self, model: torch.nn.Module, batch, loss_of: Callable[[object], torch.Tensor], *, step: int,
                         optimizer: torch.optim.Optimizer | None = None, loss_scale: float = 1.0,
                         collective: Collective = SINGLE_PROCESS) -> dict[str, float] | None:
        """One statistics round on ``batch`` (sliced to ``max_rows`` rows; ``loss_of(sliced)`` is the
        loss), then the solve. Returns the round's scalars to log, or None when it failed (on any rank)."""
        cfg = self.config
        self.budget.round_started(step)
        self.timeline.mark("round")
        start = self.timeline.stamp()
        result = None
        try:
            with own_work():
                result = run_statistics_round(
                    model, batch, loss_of, self.layers, cfg, optimizer=optimizer, loss_scale=loss_scale,
                    propagation=self.propagation, first_order_history=self.first_order_history,
                    generator=lambda: round_generator(self.device, step, collective.rank),
                    on_exact=lambda: setattr(self, "propagation", Propagation.EXACT), settings=self.round_settings,
                    collective=collective)
        except Exception as err:  # noqa: BLE001 - a failed round must not take training down
            logger.warning("SNIP statistics at step %d failed (%s: %s); keeping the current plan", step, type(err).__name__, err)
            cause = f"statistics at step {step}: {type(err).__name__}: {err}"
        else:
            cause = f"statistics at step {step} failed on another rank"
        self.first_order_history = {}
        self.num_stats_rounds += 1
        seconds = self.timeline.seconds_since(start)  # (the budget up to date: its decision reads it)
        # when the next round comes (one decision for every rank: rank 0's times decide)
        self.budget.follow(collective.broadcast(self.budget.decide(step, seconds)))
        if result is None:
            self.count_failure(cause)
            return None
        self.grad_noise_ratios = grad_noise_ratios(self.layers, cfg.candidate_formats, result)
        self.invalid_formats = invalid_formats(self.layers, cfg.candidate_formats, result)
        scalars = {} if result.probe_rel_stderr is None else {"snip/wd_probe_rel_stderr": result.probe_rel_stderr}
        scalars.update({**divergence_scalars(result), "snip/stats_seconds": seconds,
                        "snip/invalid_formats": float(len(self.invalid_formats)),
                        **{f"snip/grad_noise_ratio/{fqn}": r for fqn, r in self.grad_noise_ratios.items()}})
        self.history.append({"step": step, "divergence": result.as_dict()})
        self.aggregate.update(result.metric_values())
        del self.history[:-HISTORY_ROUNDS]
        self.start_solve(step, step + APPLY_DELAY, collective)
        return scalars

    def count_failure(self, cause: str) -> None:
        """One more round or solve that gave no plan; past ``max_consecutive_failures`` in a row, stop
        the run with the cause (a warning per round that nobody reads is a silent failure)."""
        self.num_consecutive_failures += 1
        limit = self.config.max_consecutive_failures
        if limit is not None and self.num_consecutive_failures >= limit:
            raise RuntimeError(
                f"SNIP: {self.num_consecutive_failures} statistics rounds or solves in a row gave no plan "
                f"(max_consecutive_failures={limit}); the last: {cause}. Fix the cause, or set "
                "max_consecutive_failures=None (the app: snip.max_consecutive_failures=null) to keep training on "
                "the last good plan."
            )

    # ------------------------------------------------------------------ evidence -> plan

    def candidates(self):
        """The planner's choices from the aggregate over rounds (evidence.aggregate_candidates)."""
        return aggregate_candidates(self.layers, self.config, self.aggregate, self.flops)

    def guarded(self) -> dict[str, frozenset[Format]]:
        """The noise guard's blocked FP4 formats per layer, from the aggregate ({} when it is off)."""
        if self.config.noise_guard_threshold is None:
            return {}
        return guarded_formats(self.layers, self.config.candidate_formats, self.aggregate.values("rel_error_wgrad"),
                               self.config.noise_guard_threshold)

    def start_solve(self, stats_step: int, apply_step: int, collective: Collective = SINGLE_PROCESS, *,
                    count: bool = True) -> None:
        """Rank 0 solves the plan on the current aggregate in a background thread; ``count``: the solve uses up
        one of the spike guard's avoided solves (not when it repeats one already counted)."""
        self.pending = PendingSolve(stats_step=stats_step, apply_step=apply_step)
        if collective.is_rank_zero:
            self.pending.start(self.candidates(), self.guarded(), self.config, self.guard.avoided())
        if count:
            self.guard.count_solve()  # (on every rank: the guard's state is the same everywhere)

    def apply_due(self, model: torch.nn.Module, step: int,
                  collective: Collective = SINGLE_PROCESS) -> tuple[dict[str, float], Plan] | None:
        """Apply the pending plan if its step has come: rank 0 joins the solve and broadcasts it, every
        rank applies it. Returns (scalars, plan) to log, or None (nothing due, or no plan)."""
        if self.pending is None or step < self.pending.apply_step:
            return None
        pending, self.pending = self.pending, None
        message, error = pending.outcome(collective)
        if message is None:
            self.count_failure(error or f"solve for step {pending.stats_step} gave no plan")
            return None
        plan = Plan.from_json(message)
        before = layer_assignment(self.layers, Granularity(self.config.granularity))
        try:
            apply_plan(model, plan)
            self.compiled_plans.note_plan(self.layers)
        except ValueError as err:
            logger.warning("SNIP plan from step %d could not be applied (%s); keeping the current plan", pending.stats_step, err)
            self.count_failure(f"plan from step {pending.stats_step} could not be applied: {err}")
            return None
        self.num_consecutive_failures = 0
        self.plan = plan
        self.num_plans_applied += 1
        self.timeline.mark("switch")
        if self.history and self.history[-1]["step"] == pending.stats_step:
            self.history[-1]["plan"] = json.loads(message)
        # Layers with a changed format (in a per-GEMM plan: in either direction).
        changed = {split_key(key)[0] for key, fmt in plan.items() if before.get(key) is not fmt}
        num_changed = len(changed)
        self.guard.on_switch(step, {key: fmt.value for key, fmt in before.items() if split_key(key)[0] in changed})
        self.formats_before_switch = dict(before)
        agreement = plan_agreement(plan, before, self.layers)
        if self.num_plans_applied > 1:  # (the first plan's agreement is with the initial format: no evidence)
            self.budget.plan_applied(step, agreement)
        scalars = applied_plan_scalars(plan, num_changed, agreement)
        scalars["snip/fp4_fraction_switchable"] = self.switchable_fp4_fraction
        scalars["snip/round_stretch"] = float(self.budget.stretch)
        status = "" if plan.status is SolveStatus.OPTIMAL else f" ({plan.status.value})"
        if num_changed and self.guard.enabled and not self.guard.watching:  # (said: a plan the guard cannot revert)
            status += f"; not watched by the loss watch (fewer than {MIN_HISTORY} losses before it)"
        if collective.is_rank_zero:  # every rank applied it; one line for the run
            logger.info("SNIP plan applied at step %d: FP4 FLOPs fraction %.3f of the switchable layers (%.3f of the "
                        "model), %d of %d switchable layers changed%s", step, self.switchable_fp4_fraction,
                        plan.fp4_fraction, num_changed, sum(layer.pinned is None for layer in self.layers.values()), status)
        return scalars, plan

    def observe_step(self, model: torch.nn.Module, step: int, loss: float, *, finite_grads: bool = True,
                     collective: Collective = SINGLE_PROCESS,
                     same_batch_cost: Callable[[Mapping[str, str]], float] | None = None
                     ) -> tuple[dict[str, float], str] | None:
        """One optimizer step's loss (the same on every rank: averaged over micro-batches and ranks) and
        whether its gradients were finite, for the loss watch (lightning_snip.spike_guard). Its alarm is confirmed
        with ``same_batch_cost(previous)``: this step's batch's loss under the formats in force minus under
        ``previous`` (``plan_cost`` computes it; None: every alarm is taken as the plan's). When the guard reverts
        the last plan's changes, every rank applies the formats from before it here (call at a step boundary), and
        a solve still pending is started again with the reverted formats avoided; returns the scalars and the
        reason to log, else None."""
        verdict = self.guard.observe(step, loss, finite_grads=finite_grads)
        if isinstance(verdict, Alarm):
            alarm = verdict
            cost = math.inf if same_batch_cost is None else measured_cost(
                lambda: same_batch_cost(alarm.previous), math.inf, step, collective, "the alarm is taken as the plan's")
            verdict = self.guard.confirm(alarm, cost)
            if verdict is None:
                self.canary_due = True  # (a fault that came after the switch shows in no same-batch forward)
                if collective.is_rank_zero:
                    switched = self.guard.watch["switched"] if self.guard.watch is not None else None
                    log_unconfirmed(alarm, cost, again=switched is not None and switched == self.unconfirmed_warned)
                    self.unconfirmed_warned = switched
                return {"snip/loss_watch_unconfirmed": float(self.guard.num_unconfirmed)}, ""
        if verdict is None:
            return None
        return self._revert(model, verdict, collective, at_step_end=True)

    def _revert(self, model: torch.nn.Module, revert: Revert, collective: Collective, *, at_step_end: bool
                ) -> tuple[dict[str, float], str]:
        applied = {key: self.plan[key].value for key in revert.formats if self.plan is not None and key in self.plan}
        apply_plan(model, revert.formats)
        self.compiled_plans.note_plan(self.layers)
        self.timeline.mark("switch", next_step=at_step_end)
        self.budget.plan_reverted(revert.step if at_step_end else revert.step - 1)
        self.guard.mark(revert, applied)
        self.plan = reverted_plan(self.plan, revert.formats)
        if self.pending is not None:  # solved without the avoided formats: solve it again (its thread's answer is dropped)
            self.start_solve(self.pending.stats_step, self.pending.apply_step, collective, count=False)
        if collective.is_rank_zero:
            log_revert(revert)
        return {"snip/plan_reverted": 1.0, "snip/spike_reverts": float(self.guard.num_reverts)}, revert.reason

    def measure_switch(self, model: torch.nn.Module, loss_fn: Callable[[], torch.Tensor], *, step: int,
                       collective: Collective = SINGLE_PROCESS) -> tuple[dict[str, float], str] | None:
        """After a switch (and its canary), before the step's forward: what the plan's formats cost on this batch
        (``loss_fn()``, a slice of it), for the loss watch; a catastrophic cost reverts the plan here. Returns the
        scalars and the revert's reason to log (an empty reason: none), or None when nothing was measured."""
        if not self.guard.needs_plan_cost:
            return None
        cost = measured_cost(lambda: self.plan_cost(model, loss_fn, self.guard.watch["previous"], collective),
                                   0.0, step, collective, "the watch expects no cost from the plan")
        revert = self.guard.set_plan_cost(step, cost)
        scalars = {"snip/plan_cost_at_switch": cost}
        if revert is None:
            return scalars, ""
        reverted, reason = self._revert(model, revert, collective, at_step_end=False)
        return {**scalars, **reverted}, reason

    def plan_cost(self, model: torch.nn.Module, loss_fn: Callable[[], torch.Tensor], previous: Mapping[str, str],
                  collective: Collective = SINGLE_PROCESS) -> float:
        """``loss_fn()`` (a sliced batch's loss) under the formats in force minus under ``previous`` (plan key ->
        format), forward only, averaged over ranks (lightning_snip.canary.plan_cost)."""
        with own_work():
            return plan_cost(model, loss_fn, self.layers, Granularity(self.config.granularity), previous,
                             all_sum=collective.all_sum, world_size=collective.world_size)

    def check_plan(self, model: torch.nn.Module, loss_fn: Callable[[], torch.Tensor], *, step: int,
                   collective: Collective = SINGLE_PROCESS) -> tuple[dict[str, float], str] | None:
        """The plan canary (lightning_snip.canary) on the formats in force, ``loss_fn()`` the loss of a slice of
        this step's batch: a GEMM direction whose training path disagrees with the round's path goes back at once
        (to its format before the last plan, or bf16), its format avoided for the next AVOID_ROUNDS solves. Call
        before the step's forward (after ``apply_due``, and before a round). Returns the scalars and the reverted
        layers' reasons to log, or None when it was off; a canary that fails logs a warning and changes nothing."""
        self.canary_due = False
        if not self.config.plan_canary or not self.layers:
            return None
        start = self.timeline.stamp()
        try:
            with own_work():
                verdict = check_plan(model, loss_fn, self.layers, Granularity(self.config.granularity),
                                     self.formats_before_switch, seed=stream_seed(self.sr_seed, collective.rank, step,
                                                                                  1 << 20), all_sum=collective.all_sum)
        except Exception as err:  # noqa: BLE001 - a failed check must not take training down
            if collective.is_rank_zero:
                logger.warning("SNIP plan canary at step %d failed (%s: %s); the plan stays as it is", step,
                               type(err).__name__, err)
            return None
        reason = self._restore_canary(model, verdict, step, collective)
        scalars = {"snip/canary_seconds": self.timeline.seconds_since(start), "snip/canary_worst_ratio": verdict.worst_ratio,
                   "snip/canary_reverts": float(self.num_canary_reverts)}
        return scalars, reason

    def _restore_canary(self, model: torch.nn.Module, verdict: CanaryVerdict, step: int, collective: Collective) -> str:
        if not verdict.restore:
            return ""
        granularity = Granularity(self.config.granularity)
        current = layer_assignment(self.layers, granularity)
        apply_plan(model, verdict.restore)
        self.compiled_plans.note_plan(self.layers)
        changed = {key: fmt for key, fmt in verdict.restore.items() if fmt is not current[key]}
        for key in changed:
            self.guard.avoid[key, current[key].value] = AVOID_ROUNDS
        self.plan = reverted_plan(self.plan, {key: fmt.value for key, fmt in verdict.restore.items()})
        self.num_canary_reverts += len(changed)
        self.budget.plan_reverted(step - 1)  # (a changed plan: the budget's spacing again)
        if self.pending is not None:
            self.start_solve(self.pending.stats_step, self.pending.apply_step, collective, count=False)
        reason = verdict.reason
        if collective.is_rank_zero:
            logger.warning("SNIP plan canary at step %d: %d GEMM direction(s) whose training path disagrees with the "
                           "round's path put back (%s), their formats avoided for the next %d solves: %s", step,
                           len(changed), ", ".join(f"{k} -> {f.value}" for k, f in sorted(changed.items())),
                           AVOID_ROUNDS, reason)
        return reason

    # ------------------------------------------------------------------ checkpoint

    def state_dict(self) -> dict:
        self.timeline.flush(wait=True)  # (the budget's times up to now)
        return {
            "plan": self.plan.to_json() if self.plan is not None else None,
            "history": json.dumps(self.history),
            "num_stats_rounds": self.num_stats_rounds, "num_plans_applied": self.num_plans_applied,
            "aggregate": self.aggregate.state_dict(),
            "pending": ([self.pending.stats_step, self.pending.apply_step] if self.pending is not None
                        else list(self.restored_pending) if self.restored_pending is not None else None),
            "first_order_history": [[fqn, fmt.value, values] for (fqn, fmt), values in self.first_order_history.items()],
            "num_consecutive_failures": self.num_consecutive_failures, "num_canary_reverts": self.num_canary_reverts,
            "spike_guard": self.guard.state_dict(), "schedule": self.budget.state_dict(),  # (the key checkpoints hold)
            "formats_before_switch": {key: fmt.value for key, fmt in self.formats_before_switch.items()},
        }

    def load_state_dict(self, state_dict: dict) -> None:
        self.timeline.discard()  # (calls left from a fit that ended in an exception: the checkpoint's state replaces them)
        self.plan = Plan.from_json(state_dict["plan"]) if state_dict.get("plan") else None
        self.plan_restored = self.plan is not None  # (fitted to this run's pins and formats at train start)
        self.state_restored = True
        self.history = json.loads(state_dict.get("history", "[]"))
        self.num_stats_rounds = int(state_dict.get("num_stats_rounds", 0))
        self.num_plans_applied = int(state_dict.get("num_plans_applied", 0))
        if state_dict.get("aggregate"):
            self.aggregate.load_state_dict(state_dict["aggregate"])
        else:  # a checkpoint from before the aggregate existed: rebuild it from the rounds it kept
            for entry in self.history:
                self.aggregate.update(DivergenceResult.from_dict(entry["divergence"]).metric_values())
        pending = state_dict.get("pending")
        self.restored_pending = (int(pending[0]), int(pending[1])) if pending else None
        self.first_order_history = {(fqn, Format(fmt)): [float(v) for v in values]
                                    for fqn, fmt, values in state_dict.get("first_order_history", [])}
        self.num_consecutive_failures = int(state_dict.get("num_consecutive_failures", 0))
        if state_dict.get("spike_guard"):
            self.guard.load_state_dict(state_dict["spike_guard"])
        if state_dict.get("schedule"):
            self.budget.load_state_dict(state_dict["schedule"])
        self.formats_before_switch = {key: Format(fmt) for key, fmt in state_dict.get("formats_before_switch", {}).items()}
        self.num_canary_reverts = int(state_dict.get("num_canary_reverts", 0))
