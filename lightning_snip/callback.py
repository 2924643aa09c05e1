"""SNIPCallback: the Lightning plugin that samples statistics, solves plans and switches formats."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy, ModelParallelStrategy, SingleDeviceStrategy
from typing_extensions import override

from lightning_snip.aggregate import DivergenceAggregate
from lightning_snip.config import SNIPConfig
from lightning_snip.convert import apply_plan, convert_linears, glob_filter, layer_assignment
from lightning_snip.divergence import (DivergenceResult, FirstOrderTerms, LayerDivergence, LossEstimator,
                                       estimate_divergence)
from lightning_snip.formats import Format
from lightning_snip.gemm import describe_kernels
from lightning_snip.plan import Granularity, Plan, SolveStatus, split_key
from lightning_snip.planner import (LayerCandidates, PlanInfeasibleError, check_target, gemm_items, keep_out_of_fp4,
                                    max_fp4_fraction, min_relative_cost, solve_plan)
from lightning_snip.reporting import divergence_scalars, log_to_loggers, plan_scalars
from lightning_snip.stats import FirstOrderSampler, ForwardModeUnsupportedError, Propagation, collect_stats, slice_batch

logger = logging.getLogger(__name__)

# Single device, DDP, and FSDP2 through ModelParallelStrategy without tensor parallelism (the user
# shards with fully_shard in configure_model). FSDP1 and DeepSpeed are not among them;
# DeepSpeedStrategy subclasses DDPStrategy, so it is excluded by name.
SUPPORTED_STRATEGIES = (SingleDeviceStrategy, DDPStrategy, ModelParallelStrategy)
UNSUPPORTED_STRATEGIES = (DeepSpeedStrategy,)


@dataclass
class _PendingSolve:
    """A solve started at ``stats_step`` whose plan takes effect at ``apply_step`` (rank 0 runs it)."""

    stats_step: int
    apply_step: int
    thread: threading.Thread | None = None
    plan: Plan | None = None
    error: BaseException | None = None


class SNIPCallback(Callback):
    """Adaptive per-layer FP4/FP8 precision (SNIP) for a LightningModule's linear layers.

    On fit setup the selected ``nn.Linear`` layers become SNIPLinear (same Parameters) in
    ``config.initial_format``, pinned layers in their pin. Strategies: single device, DDP, and FSDP2
    through ModelParallelStrategy with tensor_parallel_size=1 (layers converted in place after
    ``fully_shard``; statistics from the sharded weights and optimizer state, see
    lightning_snip.divergence); others fail at setup. Every ``interval`` steps from
    ``warmup_steps`` on, a statistics round runs on the first ``max_rows`` token rows of the batch
    (high precision, see lightning_snip.stats). In the ``first_order_steps`` training steps before
    it, hooks sample LD's first-order term on the live steps (FirstOrderSampler, ``first_order_rows``
    rows each), which the ``accumulated`` estimator averages with the round's own. The round's
    divergences are averaged over data-parallel ranks (unclamped), and folded into an exponential moving average over rounds (``aggregate_decay``; see
    lightning_snip.aggregate), and rank 0 solves the ILP on that aggregate in a background thread.
    ``apply_delay`` steps later rank 0 joins the thread, broadcasts the plan, and every rank applies it
    before that step's forward pass. A failed statistics round or solve logs a warning and training
    continues on the last good plan. The aggregate, the first-order samples since the last round and a
    solve still pending are part of the checkpoint: a resumed run plans exactly as the uninterrupted
    one (given the same data and deterministic GEMMs).

    The statistics loss is ``pl_module.snip_loss(batch)`` if the module defines it, else the loss
    returned by ``training_step(batch, batch_idx)``.

    Logged metrics (every Lightning logger; image and text to TensorBoard only):
        ``snip/ld/<fqn>/<format>``: forward loss divergence (relative loss increase) of the round,
            per layer/format, before the clamp at 0 that planning applies.
        ``snip/wd/<fqn>/<format>``: backward weight divergence (relative update deviation).
        ``snip/stats_seconds``: wall time of the statistics round (statistics step).
        ``snip/invalid_formats``: (layer, format) candidates the round found non-finite (left out of
            its evidence; one warning per round names them). Non-zero is a fault to look into.
        ``snip/wd_probe_rel_stderr``: (``wd_propagation=probe``) the median over layers and formats of
            the probes' relative standard error of WD's propagated term in the round (this rank's).
        ``snip/solver_seconds``: ILP solve time (apply step).
        ``snip/fp4_fraction``: FP4 share of the switched layers' linear FLOPs under the applied plan.
        ``snip/relative_gemm_cost``: GEMM cost of the applied plan relative to all-bf16.
        ``snip/plan_changes``: layers whose format the applied plan changed.
        ``snip/plan_agreement``: share of the switched layers whose format the new plan keeps.
        ``snip/plan`` (image): blocks x layer types colored by format.
        ``snip/plan_table`` (text): the plan as a table.

    Public state: ``layers`` (fqn -> SNIPLinear), ``plan`` (the applied Plan or None), ``history``
    (a list of dicts: step, divergence, plan), ``num_stats_rounds``, ``num_plans_applied``.
    """

    def __init__(self, config: SNIPConfig | None = None, *, plan: Plan | None = None) -> None:
        """Args:
            config: the settings (SNIPConfig defaults when None).
            plan: a plan to apply at fit start instead of ``initial_format`` (checked against the
                model at setup); with ``config.replan=False`` it holds for the whole run.
        """
        super().__init__()
        self.config = config if config is not None else SNIPConfig()
        if not isinstance(self.config, SNIPConfig):
            raise TypeError(f"config: expected a SNIPConfig, got {type(self.config).__name__}")
        if plan is not None and not isinstance(plan, Plan):
            raise TypeError(f"plan: expected a lightning_snip.plan.Plan, got {type(plan).__name__}")
        self.layers: dict = {}
        self.plan: Plan | None = plan
        self.history: list[dict] = []
        self.num_stats_rounds = 0
        self.num_plans_applied = 0
        self.aggregate = DivergenceAggregate(self.config.aggregate_decay)
        self._pending: _PendingSolve | None = None
        self._restored_pending: tuple[int, int] | None = None  # (stats_step, apply_step) from a checkpoint
        self._propagation = Propagation(self.config.wd_propagation)  # exact after probes proved unsupported
        self._flops: dict[str, float] = {}
        self._sampler: FirstOrderSampler | None = None
        self._first_order_terms: FirstOrderTerms | None = None
        self._last_round_step: int | None = None  # one round per optimizer step (not per micro-batch)
        self._recording: contextlib.ExitStack | None = None
        # (fqn, format) -> first-order terms of the batches sampled since the last round.
        self._first_order_history: dict[tuple[str, Format], list[float]] = {}
        self._sr_generator: torch.Generator | None = None
        self._sr_seed = 0
        self.num_consecutive_failures = 0  # statistics rounds or solves in a row that gave no plan
        self.grad_noise_ratios: dict[str, float] = {}  # the last round's, per switchable layer
        self.invalid_formats: list[tuple[str, Format]] = []  # the last round's non-finite candidates

    @property
    def fp4_fraction(self) -> float:
        """FP4 share of the switched layers' linear FLOPs under the formats in force now."""
        total = sum(self._flops.values())
        if not total:
            return 0.0
        # The forward GEMM is a third of a layer's GEMM FLOPs, dgrad + wgrad two thirds.
        return sum(self._flops[fqn] * (layer.format.is_fp4 / 3 + 2 * (layer.backward_format or layer.format).is_fp4 / 3)
                   for fqn, layer in self.layers.items()) / total

    # ------------------------------------------------------------------ hooks

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        strategy = trainer.strategy
        if not isinstance(strategy, SUPPORTED_STRATEGIES) or isinstance(strategy, UNSUPPORTED_STRATEGIES):
            raise ValueError(
                f"trainer.strategy: {type(strategy).__name__} is not supported by SNIPCallback; "
                "allowed: single device, DDP (ddp, ddp_spawn, ddp_find_unused_parameters_*), FSDP2 "
                "(ModelParallelStrategy with tensor_parallel_size=1, fully_shard in configure_model)"
            )
        if isinstance(strategy, ModelParallelStrategy):
            tensor_parallel = strategy.device_mesh["tensor_parallel"].size()
            if tensor_parallel > 1:
                raise ValueError(
                    f"trainer.strategy: ModelParallelStrategy(tensor_parallel_size={tensor_parallel}) is not supported "
                    "by SNIPCallback (a tensor-parallel layer's GEMMs and statistics span ranks); allowed: "
                    "tensor_parallel_size=1 (FSDP2 data parallelism)")
            if Propagation(self.config.wd_propagation) is Propagation.EXACT:
                raise ValueError("snip.wd_propagation: exact is not supported under FSDP2 (ModelParallelStrategy): it "
                                 "holds every parameter's gradient whole; allowed: probe")

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Converted here, not in setup: layers built (or compiled) in ``configure_model`` exist only
        # after setup, and the strategy has moved the model to its device.
        cfg = self.config
        try:
            self.layers = convert_linears(
                pl_module,
                filter=glob_filter(cfg.include, cfg.exclude),
                pins=cfg.pin_formats,
                initial_format=cfg.initial_format,
                recipe=cfg.recipe,
            )
        except ValueError as err:  # name the config fields, not convert_linears' arguments
            message = str(err)
            for argument, field_name in (("filter:", "snip.include:"), ("pins:", "snip.pins:")):
                if message.startswith(argument):
                    raise ValueError(field_name + message[len(argument):]) from None
            raise
        # Relative FLOPs per step: every layer sees the same tokens, so 6 * m * k orders them.
        self._flops = {fqn: 6.0 * layer.in_features * layer.out_features for fqn, layer in self.layers.items()}
        self._first_order_terms = FirstOrderTerms(cfg.formats, recipe=cfg.recipe)
        self._propagation = Propagation(cfg.wd_propagation)
        # Pinned layers never change format: their LD is never used, so they are not sampled.
        self._sampler = FirstOrderSampler({fqn: layer for fqn, layer in self.layers.items() if layer.pinned is None},
                                          cfg.first_order_rows, self._first_order_terms.add)
        if self.plan is not None:
            apply_plan(pl_module, self.plan)  # a given plan that does not fit the model fails here
        if cfg.replan:
            self._check_target()
        # Stochastic rounding draws from one generator per rank, reseeded every micro-batch from
        # (the run's seed, rank, step, batch index): ranks round independently, a rerun or a resumed
        # run draws the same numbers, and the global RNG (dropout) is left alone.
        self._sr_generator = torch.Generator(device=pl_module.device)
        self._sr_seed = torch.initial_seed()
        for layer in self.layers.values():
            layer.generator = self._sr_generator
        if not trainer.is_global_zero:  # the run's setup lines once, not once per rank
            return
        num_pinned = sum(1 for layer in self.layers.values() if layer.pinned is not None)
        logger.info("SNIP: %d switchable layers (%d pinned), initial format %s", len(self.layers), num_pinned,
                    cfg.initial_format)
        formats = sorted({Format.parse(f) for f in (cfg.initial_format, *cfg.formats, *cfg.pin_formats.values())},
                         key=lambda f: f.value)
        logger.info("SNIP: GEMM kernels: %s", describe_kernels(formats, pl_module.device))
        if not cfg.noise_guard and cfg.noise_guard_threshold != math.sqrt(3.0):
            logger.warning("SNIP: snip.noise_guard_threshold=%s has no effect while snip.noise_guard is false "
                           "(the ratios are logged either way)", cfg.noise_guard_threshold)
        max_steps = trainer.max_steps if trainer.max_steps is not None and trainer.max_steps >= 0 else None
        if cfg.replan and max_steps is not None and cfg.warmup_steps >= max_steps:
            logger.warning("SNIP: snip.warmup_steps (%d) >= the run's max_steps (%d): no statistics round will run "
                           "and the layers stay in %s", cfg.warmup_steps, max_steps, cfg.initial_format)

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.plan is not None:  # given, or restored from a checkpoint
            apply_plan(pl_module, self.plan)
            if trainer.is_global_zero:
                logger.info("SNIP: applied the plan held at train start (%d layers)", len(self.plan))
        if self._restored_pending is not None:
            # The checkpoint was saved between a statistics round and its apply step: the round is in
            # the restored aggregate, so solving it again gives the plan the uninterrupted run applies.
            stats_step, apply_step = self._restored_pending
            self._restored_pending = None
            self._start_solve(trainer, stats_step, apply_step)

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch, batch_idx: int) -> None:
        step = trainer.global_step
        self._sr_generator.manual_seed(_stream_seed(self._sr_seed, trainer.global_rank, step, batch_idx))
        if self._pending is not None and step >= self._pending.apply_step:
            self._apply_pending(trainer, pl_module, step)
        if self._is_stats_step(step):
            if step != self._last_round_step:  # with gradient accumulation, the step's first micro-batch
                self._last_round_step = step
                self._statistics_round(trainer, pl_module, batch, batch_idx, step)
        elif self._is_first_order_step(step) and self._recording is None:
            self._first_order_terms.grad_scale = _gradient_scale(trainer)
            self._recording = contextlib.ExitStack()
            self._recording.enter_context(self._sampler.recording(offset=step))

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs, batch, batch_idx: int) -> None:
        self._stop_recording()
        for key, values in self._first_order_terms.take().items():
            self._first_order_history.setdefault(key, []).extend(values)

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._stop_recording()  # no hooks left on the user's model

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._stop_recording()

    def _stop_recording(self) -> None:
        if self._recording is not None:
            self._recording.close()
            self._recording = None

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._pending = None  # a solve still running is a daemon thread: it never blocks exit

    @override
    def state_dict(self) -> dict:
        return {
            "plan": self.plan.to_json() if self.plan is not None else None,
            "history": json.dumps(self.history),
            "num_stats_rounds": self.num_stats_rounds,
            "num_plans_applied": self.num_plans_applied,
            "aggregate": self.aggregate.state_dict(),
            "pending": None if self._pending is None else [self._pending.stats_step, self._pending.apply_step],
            "first_order_history": [[fqn, fmt.value, values] for (fqn, fmt), values in self._first_order_history.items()],
            "num_consecutive_failures": self.num_consecutive_failures,
        }

    @override
    def load_state_dict(self, state_dict: dict) -> None:
        self.plan = Plan.from_json(state_dict["plan"]) if state_dict.get("plan") else None
        self.history = json.loads(state_dict.get("history", "[]"))
        self.num_stats_rounds = int(state_dict.get("num_stats_rounds", 0))
        self.num_plans_applied = int(state_dict.get("num_plans_applied", 0))
        if state_dict.get("aggregate"):
            self.aggregate.load_state_dict(state_dict["aggregate"])
        else:  # a checkpoint from before the aggregate existed: rebuild it from the rounds it kept
            for entry in self.history:
                self._fold_into_aggregate(entry["divergence"])
        pending = state_dict.get("pending")
        self._restored_pending = (int(pending[0]), int(pending[1])) if pending else None
        self._first_order_history = {(fqn, Format(fmt)): [float(v) for v in values]
                                     for fqn, fmt, values in state_dict.get("first_order_history", [])}
        self.num_consecutive_failures = int(state_dict.get("num_consecutive_failures", 0))

    # ------------------------------------------------------------------ helpers

    def _is_stats_step(self, step: int) -> bool:
        cfg = self.config
        return cfg.replan and step >= cfg.warmup_steps and (step - cfg.warmup_steps) % cfg.interval == 0

    def _is_first_order_step(self, step: int) -> bool:
        """Whether ``step`` is one of the ``first_order_steps`` steps before a statistics round."""
        cfg = self.config
        if not cfg.replan or cfg.first_order_steps == 0 or LossEstimator(cfg.loss_estimator) is not LossEstimator.ACCUMULATED:
            return False
        next_round = cfg.warmup_steps if step < cfg.warmup_steps else (
            cfg.warmup_steps + ((step - cfg.warmup_steps) // cfg.interval + 1) * cfg.interval)
        return 1 <= next_round - step <= cfg.first_order_steps

    def _statistics_round(self, trainer, pl_module, batch, batch_idx, step) -> None:
        cfg = self.config
        start = time.perf_counter()
        result = None
        try:
            sliced = slice_batch(batch, cfg.max_rows)
            optimizer = trainer.optimizers[0] if trainer.optimizers else None
            precision = trainer.precision_plugin

            def loss_fn():
                # The strategy's precision context (autocast under *-mixed), as in the training step;
                # compiled code runs eagerly: the round's hooks and noise must not be traced, guarded
                # on or recompiled for.
                with precision.train_step_context(), torch.compiler.set_stance("force_eager"):
                    return _loss(pl_module, sliced, batch_idx)

            with _buffers_restored(pl_module):  # the recording pass and every noise re-run
                while result is None:
                    stats = self._collect(pl_module, loss_fn, optimizer, _amp_loss_scale(trainer))
                    try:
                        result = estimate_divergence(
                            stats, cfg.formats, recipe=cfg.recipe, noise_draws=cfg.noise_draws, noise_scale=cfg.noise_scale,
                            curvature_probe=cfg.curvature_probe,
                            loss_estimator=cfg.loss_estimator, first_order_history=self._first_order_history,
                            allowed={fqn: layer.allowed_formats for fqn, layer in self.layers.items()},
                            generator=_round_generator(pl_module.device, step, trainer.global_rank), probes=cfg.wd_probes,
                        )
                    except ForwardModeUnsupportedError as err:
                        if stats.sharded or self._propagation is Propagation.EXACT:
                            raise
                        # Once, loudly, and for the rest of the run: not a failure per round.
                        logger.warning("SNIP: %s. Switching to snip.wd_propagation=exact for the rest of the run "
                                       "(one vector-Jacobian product per layer: a round's cost grows with depth "
                                       "squared); set it in the config to silence this.", err)
                        self._propagation = Propagation.EXACT
                    finally:
                        stats.release()
            # Rounds and ranks are averaged before the clamp at 0 (in _candidates): clamping each one
            # first would bias noisy layers upwards.
            result = DivergenceResult(
                layers={fqn: dataclasses.replace(d, loss_divergence=d.loss_divergence_as(cfg.loss_estimator, clamp=False))
                        for fqn, d in result.layers.items()},
                loss=result.loss, used_adam=result.used_adam)
        except Exception as err:  # noqa: BLE001 - a failed round must not take training down
            logger.warning("SNIP statistics at step %d failed (%s: %s); keeping the current plan", step, type(err).__name__, err)
            cause = f"statistics at step {step}: {type(err).__name__}: {err}"
        else:
            cause = f"statistics at step {step} failed on another rank"
        self._first_order_history = {}
        probe_noise = _probe_noise(result) if result is not None else None
        # Every rank reaches the reduction (a failed rank contributes NaN, which invalidates the round).
        result = self._reduce(trainer, result)
        self.num_stats_rounds += 1
        seconds = time.perf_counter() - start
        if result is None:
            self._count_failure(cause)
            return
        self.grad_noise_ratios = self._grad_noise_ratios(result)
        self.invalid_formats = self._invalid_formats(result)
        if probe_noise is not None:
            log_to_loggers(trainer.loggers, step, {"snip/wd_probe_rel_stderr": probe_noise})
        log_to_loggers(trainer.loggers, step, {**divergence_scalars(result), "snip/stats_seconds": seconds,
                                               "snip/invalid_formats": float(len(self.invalid_formats)),
                                               **{f"snip/grad_noise_ratio/{fqn}": r for fqn, r in self.grad_noise_ratios.items()}})
        self.history.append({"step": step, "divergence": result.as_dict()})
        self._fold_into_aggregate(self.history[-1]["divergence"])
        self._start_solve(trainer, step, step + self.config.apply_delay)

    def _collect(self, pl_module, loss_fn, optimizer, loss_scale: float):
        """collect_stats; under fp16 a loss scale that overflows is lowered (by 2^8, as often as it
        takes, down to 1) instead of losing the round, as GradScaler lowers its own."""
        while True:
            stats = collect_stats(pl_module, loss_fn, layers=self.layers, optimizer=optimizer, loss_scale=loss_scale,
                                  propagation=self._propagation)
            finite = all(torch.isfinite(s.g).all() for s in stats.layers.values())
            if finite or loss_scale <= 1.0:
                return stats
            stats.release()
            loss_scale = max(1.0, loss_scale / 256.0)

    def _check_target(self) -> None:
        """Fail at fit start when no plan can meet the FP4 fraction / cost budget: pins and layer
        shapes alone decide that, and every statistics round would otherwise fail on it."""
        cfg = self.config
        candidates = [dataclasses.replace(c, loss_divergence={f: 0.0 for f in c.loss_divergence},
                                          weight_divergence={f: 0.0 for f in c.weight_divergence})
                      for c in self._candidates()]
        try:
            check_target(candidates, fp4_fraction=cfg.fp4_fraction, cost_budget=cfg.cost_budget,
                         relative_cost=cfg.cost_model.relative_cost)
        except PlanInfeasibleError as err:
            field_name = "snip.fp4_fraction" if cfg.fp4_fraction is not None else "snip.cost_budget"
            value = cfg.fp4_fraction if cfg.fp4_fraction is not None else cfg.cost_budget
            pinned = [fqn for fqn, layer in self.layers.items() if layer.pinned is not None]
            by_shape = [f"{fqn} ({layer.in_features}->{layer.out_features})" for fqn, layer in self.layers.items()
                        if layer.pinned is None and not any(f.is_fp4 for f in cfg.formats if f in layer.allowed_formats)]
            why = []
            if pinned:
                why.append(f"pinned (snip.pins): {pinned[:3]}")
            if by_shape:
                blocks = ", ".join(f"{f.value} needs dimensions divisible by {f.block_size}" for f in cfg.formats if f.is_fp4)
                why.append(f"no FP4 candidate fits the shape ({blocks}): {by_shape[:3]}")
            raise ValueError(f"{field_name}: {value!r} cannot be met ({err}); " + "; ".join(why)
                             + "; lower it, or unpin layers / add candidate formats") from None

    def _count_failure(self, cause: str) -> None:
        """One more round or solve that gave no plan; past ``max_consecutive_failures`` in a row, stop
        the run with the cause (a warning per round that nobody reads is a silent failure)."""
        self.num_consecutive_failures += 1
        limit = self.config.max_consecutive_failures
        if limit is not None and self.num_consecutive_failures >= limit:
            raise RuntimeError(
                f"SNIP: {self.num_consecutive_failures} statistics rounds or solves in a row gave no plan "
                f"(snip.max_consecutive_failures={limit}); the last: {cause}. Fix the cause, or set "
                "snip.max_consecutive_failures=null to keep training on the last good plan."
            )

    def _fold_into_aggregate(self, divergence: dict) -> None:
        """One round, as ``DivergenceResult.as_dict()`` keeps it in ``history``, into the aggregate."""
        layers = divergence["layers"]
        self.aggregate.update({metric: {fqn: d[metric] for fqn, d in layers.items() if metric in d}
                               for metric in ("loss_divergence", "weight_divergence", "rel_error_wgrad")})

    def _invalid_formats(self, result: DivergenceResult) -> list[tuple[str, Format]]:
        """(fqn, format) of the unpinned layers' allowed low-precision candidates whose LD or WD the
        round found non-finite: left out of this round's evidence (logged as snip/invalid_formats)."""
        out = []
        for fqn, layer in self.layers.items():
            d = result.layers.get(fqn)
            if layer.pinned is not None or d is None:
                continue
            for fmt in self.config.formats:
                if fmt is Format.BF16 or fmt not in layer.allowed_formats:
                    continue
                if not (math.isfinite(d.loss_divergence.get(fmt, math.inf))
                        and math.isfinite(d.weight_divergence.get(fmt, math.inf))):
                    out.append((fqn, fmt))
        return out

    def _grad_noise_ratios(self, result: DivergenceResult) -> dict[str, float]:
        """Per unpinned layer: ||G^T X|| / ||Q(G)^T Q(X) - G^T X|| on the round's rows, for the best
        FP4 candidate the layer's shape allows (the gradient-noise guard's ratio; +inf: no error)."""
        ratios = {}
        for fqn, layer in self.layers.items():
            d = result.layers.get(fqn)
            fp4 = [f for f in self.config.formats if f.is_fp4 and f in layer.allowed_formats]
            if layer.pinned is not None or d is None or not fp4:
                continue
            errors = [d.rel_error_wgrad.get(f, math.nan) for f in fp4]
            errors = [e for e in errors if math.isfinite(e)]
            if errors:
                ratios[fqn] = 1.0 / min(errors) if min(errors) > 0 else math.inf
        return ratios

    def _guarded_formats(self) -> dict[str, frozenset[Format]]:
        """fqn -> the FP4 candidates whose gradient/noise ratio, from the aggregate over rounds (as the
        plan's LD and WD: one round's single SR draw made the guarded set churn), is below
        snip.noise_guard_threshold; unpinned layers with at least one such format."""
        rel = self.aggregate.values("rel_error_wgrad")
        threshold = self.config.noise_guard_threshold
        out = {}
        for fqn, layer in self.layers.items():
            if layer.pinned is not None:
                continue
            failing = frozenset(f for f in self.config.formats if f.is_fp4 and f in layer.allowed_formats
                                and rel.get(fqn, {}).get(f.value, 0.0) * threshold > 1.0)  # 1/rel < threshold
            if failing:
                out[fqn] = failing
        return out

    def _start_solve(self, trainer, stats_step: int, apply_step: int) -> None:
        """Rank 0 solves the plan on the current aggregate in a background thread."""
        pending = _PendingSolve(stats_step=stats_step, apply_step=apply_step)
        if trainer.is_global_zero:
            candidates = self._candidates()
            guarded = self._guarded_formats() if self.config.noise_guard else {}
            pending.thread = threading.Thread(target=self._solve, args=(pending, candidates, guarded), daemon=True,
                                              name="snip-solver")
            pending.thread.start()
        self._pending = pending

    def _reduce(self, trainer, result: DivergenceResult | None) -> DivergenceResult | None:
        """Average LD, WD and the relative wgrad error over data-parallel ranks (same order of layers
        and formats everywhere)."""
        if trainer.world_size <= 1:
            return result
        fqns = list(self.layers)
        formats = list(dict.fromkeys((Format.BF16, *self.config.formats)))
        # (LD / WD / relative wgrad error, layer, format); the last feeds the gradient-noise guard
        metrics = ("loss_divergence", "weight_divergence", "rel_error_wgrad")
        values = torch.full((len(metrics), len(fqns), len(formats)), float("nan"), dtype=torch.float64)
        if result is not None:
            for i, metric in enumerate(metrics):
                values[i] = torch.tensor([[getattr(result.layers[f], metric).get(p, math.inf) for p in formats] for f in fqns],
                                         dtype=torch.float64)
        device = trainer.strategy.root_device
        total = trainer.strategy.reduce(values.to(device), reduce_op="sum").cpu() / trainer.world_size
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

    def _candidates(self) -> list[LayerCandidates]:
        """The planner's choices, valued by the aggregate over rounds: the configured candidate formats
        the layer's shape allows (bf16 only if listed, or where none fits)."""
        ld, wd = self.aggregate.values("loss_divergence"), self.aggregate.values("weight_divergence")
        out = []
        for fqn, layer in self.layers.items():
            formats = [f for f in self.config.formats if f in layer.allowed_formats] or [Format.BF16]
            out.append(LayerCandidates(
                fqn=fqn,
                flops=self._flops[fqn],
                loss_divergence={f: _value(ld, fqn, f) for f in formats},
                weight_divergence={f: _value(wd, fqn, f) for f in formats},
                pinned=layer.pinned,
            ))
        return out

    def _solve(self, pending: _PendingSolve, candidates: list[LayerCandidates],
               guarded: Mapping[str, frozenset[Format]]) -> None:
        """``guarded``: fqn -> FP4 formats the gradient-noise guard keeps out of the layer's backward
        GEMMs (out of the whole layer at granularity layer). Where that makes snip.fp4_fraction or
        snip.cost_budget unreachable, the plan takes the nearest reachable target instead, with a
        warning (the guard wins over the target)."""
        cfg = self.config
        if Granularity(cfg.granularity) is Granularity.GEMM:
            items = gemm_items(candidates, guarded)
        else:
            items = [keep_out_of_fp4(c, guarded[c.fqn]) if c.fqn in guarded else c for c in candidates]
        relative_cost = cfg.cost_model.relative_cost
        fraction, budget = cfg.fp4_fraction, cfg.cost_budget
        try:
            why = f"SNIP noise guard: {len(guarded)} layers keep FP4 formats out of their backward (gradient/noise ratio < " \
                  f"{cfg.noise_guard_threshold:.3g}); "
            reachable = max_fp4_fraction(items) if guarded and fraction is not None else 1.0
            if fraction is not None and reachable < fraction:
                fraction = reachable * (1 - 1e-9)
                logger.warning("%sthe largest reachable FP4 fraction, %.3f, is used instead of snip.fp4_fraction=%s",
                               why, fraction, cfg.fp4_fraction)
            cheapest = min_relative_cost(items, relative_cost) if guarded and budget is not None else 0.0
            if budget is not None and cheapest > budget:
                budget = cheapest * (1 + 1e-9)
                logger.warning("%sthe lowest reachable relative GEMM cost, %.3f, is used instead of snip.cost_budget=%s",
                               why, budget, cfg.cost_budget)
            plan = solve_plan(items, fp4_fraction=fraction, cost_budget=budget,
                              weight_divergence_weight=cfg.weight_divergence_weight,
                              time_limit_seconds=cfg.time_limit_seconds, relative_cost=relative_cost)
            pending.plan = dataclasses.replace(plan, noise_guarded={fqn: tuple(sorted(f, key=lambda x: x.value))
                                                                   for fqn, f in guarded.items()})
        except BaseException as err:  # noqa: BLE001 - reported on the training thread at apply time
            pending.error = err

    def _apply_pending(self, trainer, pl_module, step: int) -> None:
        pending, self._pending = self._pending, None
        message, error = None, None
        if trainer.is_global_zero:
            if pending.thread is not None:
                pending.thread.join()
            if pending.error is not None:
                logger.warning("SNIP solve for step %d failed (%s: %s); keeping the current plan",
                               pending.stats_step, type(pending.error).__name__, pending.error)
                error = f"solve for step {pending.stats_step}: {type(pending.error).__name__}: {pending.error}"
            message = pending.plan.to_json() if pending.plan is not None else None
        message, error = trainer.strategy.broadcast((message, error), src=0)
        if message is None:
            self._count_failure(error or f"solve for step {pending.stats_step} gave no plan")
            return
        plan = Plan.from_json(message)
        before = layer_assignment(self.layers, Granularity(self.config.granularity))
        try:
            apply_plan(pl_module, plan)
        except ValueError as err:
            logger.warning("SNIP plan from step %d could not be applied (%s); keeping the current plan", pending.stats_step, err)
            self._count_failure(f"plan from step {pending.stats_step} could not be applied: {err}")
            return
        self.num_consecutive_failures = 0
        self.plan = plan
        self.num_plans_applied += 1
        if self.history and self.history[-1]["step"] == pending.stats_step:
            self.history[-1]["plan"] = json.loads(message)
        # Layers with a changed format (in a per-GEMM plan: in either direction).
        num_changed = len({split_key(key)[0] for key, fmt in plan.items() if before.get(key) is not fmt})
        scalars = {**plan_scalars(plan, num_changed), "snip/solver_seconds": plan.solve_seconds,
                   "snip/noise_guarded_layers": len(plan.noise_guarded),
                   "snip/plan_agreement": _plan_agreement(plan, before, self.layers)}
        log_to_loggers(trainer.loggers, step, scalars, plan)
        status = "" if plan.status is SolveStatus.OPTIMAL else f" ({plan.status.value})"
        if trainer.is_global_zero:  # every rank applied it; one line for the run
            logger.info("SNIP plan applied at step %d: FP4 FLOPs fraction %.3f, %d of %d layers changed%s",
                        step, plan.fp4_fraction, num_changed, len(self.layers), status)


@contextlib.contextmanager
def _buffers_restored(module: torch.nn.Module):
    """The round's forward passes leave the module's buffers as they found them (BatchNorm running
    statistics, counters a forward updates); attributes outside buffers are the module's own."""
    saved = [(buffer, buffer.detach().clone()) for buffer in module.buffers()]
    try:
        yield
    finally:
        with torch.no_grad():
            for buffer, value in saved:
                buffer.copy_(value)


def _probe_noise(result: DivergenceResult) -> float | None:
    """Median relative standard error of the probed propagated term over (layer, format); None when
    the round computed it exactly (no spread) or nothing was probed."""
    ratios = sorted(d.wd_propagated_stderr[f] / d.wd_propagated[f] for d in result.layers.values()
                    for f in d.wd_propagated_stderr if f is not Format.BF16 and d.wd_propagated.get(f, 0) > 0
                    and math.isfinite(d.wd_propagated_stderr[f]))
    if not ratios or ratios[-1] == 0:
        return None
    return ratios[len(ratios) // 2]


def _stream_seed(seed: int, rank: int, step: int, batch_idx: int) -> int:
    """A 63-bit seed for one (rank, step, micro-batch) of a run seeded with ``seed``."""
    mixed = seed
    for value in (rank, step, batch_idx):
        mixed = (mixed * 6364136223846793005 + 1442695040888963407 + value) % (1 << 63)
    return mixed


def _round_generator(device: torch.device, step: int, rank: int) -> torch.Generator:
    """The curvature probes' random source for one round: a function of (step, rank) only, so a
    resumed run draws what the uninterrupted one drew, and ranks draw independently."""
    return torch.Generator(device=device).manual_seed(0x5A1B + 1_000_003 * step + rank)


def _gradient_scale(trainer) -> float:
    """The factor the gradients of a training step carry: 1 / accumulate_grad_batches (Lightning
    divides the loss), times the loss scale of AMP's GradScaler (16-mixed)."""
    return _amp_loss_scale(trainer) / trainer.accumulate_grad_batches


def _amp_loss_scale(trainer) -> float:
    """The current loss scale of AMP's GradScaler (16-mixed), else 1."""
    scaler = getattr(trainer.precision_plugin, "scaler", None)
    if scaler is not None and scaler.is_enabled():
        return float(scaler.get_scale())
    return 1.0


def _value(aggregated: dict, fqn: str, fmt: Format) -> float:
    """The aggregated value; never below 0, the value of high precision (a negative estimate must
    not make a format look better than bf16)."""
    if fmt is Format.BF16:
        return 0.0
    return max(0.0, aggregated.get(fqn, {}).get(fmt.value, math.inf))


def _plan_agreement(plan: Plan, before: dict, layers) -> float:
    """Share of the switched (unpinned) layers, or of their GEMM directions in a per-GEMM plan, whose
    format ``plan`` keeps from ``before``."""
    unpinned = [key for key in plan if layers[split_key(key)[0]].pinned is None]
    if not unpinned:
        return 1.0
    return sum(1 for key in unpinned if plan[key] is before.get(key)) / len(unpinned)


def _loss(pl_module: pl.LightningModule, batch, batch_idx: int) -> torch.Tensor:
    """The statistics loss: ``snip_loss(batch)`` if the module has it, else ``training_step`` run
    without its side effects (see _side_effect_free)."""
    if hasattr(pl_module, "snip_loss"):
        return pl_module.snip_loss(batch)
    with _side_effect_free(pl_module) as backward_losses:
        out = pl_module.training_step(batch, batch_idx)
    loss = out["loss"] if isinstance(out, dict) else out
    if backward_losses:  # manual optimization: the loss is what training_step backpropagates
        loss = backward_losses[0] if len(backward_losses) == 1 else torch.stack(backward_losses).sum()
    if not isinstance(loss, torch.Tensor):
        raise TypeError("statistics: training_step returned no loss tensor and called no manual_backward; "
                        "define snip_loss(batch) on the module")
    return loss


class _NoOpOptimizer:
    """Stands in for a LightningOptimizer / scheduler inside a statistics round: steps nothing."""

    def __init__(self, wrapped) -> None:
        self._wrapped = wrapped

    def step(self, *args, **kwargs):
        return None

    def zero_grad(self, *args, **kwargs) -> None:
        return None

    @contextlib.contextmanager
    def toggle_model(self, *args, **kwargs):
        yield

    def __getattr__(self, name):  # param_groups, state, ...: read from the real one
        return getattr(self._wrapped, name)


@contextlib.contextmanager
def _side_effect_free(pl_module: pl.LightningModule):
    """Run ``training_step`` for statistics only: ``self.log``/``log_dict`` log nothing, optimizers
    and schedulers from ``self.optimizers()``/``self.lr_schedulers()`` step nothing, and
    ``manual_backward(loss)`` runs no backward but hands its loss to the round (yielded list).
    Instance attributes shadow the methods for the block and are removed after."""
    losses: list[torch.Tensor] = []
    real_optimizers, real_schedulers = pl_module.optimizers, pl_module.lr_schedulers

    def optimizers(use_pl_optimizer: bool = True):
        opts = real_optimizers(use_pl_optimizer)
        return [_NoOpOptimizer(o) for o in opts] if isinstance(opts, list) else _NoOpOptimizer(opts)

    def lr_schedulers():
        scheds = real_schedulers()
        if scheds is None:
            return None
        return [_NoOpOptimizer(s) for s in scheds] if isinstance(scheds, list) else _NoOpOptimizer(scheds)

    patches = {
        "log": lambda *args, **kwargs: None,
        "log_dict": lambda *args, **kwargs: None,
        "manual_backward": lambda loss, *args, **kwargs: losses.append(loss),
        "optimizers": optimizers,
        "lr_schedulers": lr_schedulers,
        "toggle_optimizer": lambda *args, **kwargs: None,
        "untoggle_optimizer": lambda *args, **kwargs: None,
        "clip_gradients": lambda *args, **kwargs: None,
    }
    for name, fn in patches.items():
        pl_module.__dict__[name] = fn
    try:
        yield losses
    finally:
        for name in patches:
            pl_module.__dict__.pop(name, None)
