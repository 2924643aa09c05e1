"""SNIPCallback: the Lightning plugin that samples statistics, solves plans and switches formats."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy, ModelParallelStrategy, SingleDeviceStrategy
from typing_extensions import override

from lightning_snip.budget import StepKind
from lightning_snip.canary import CANARY_ROWS
from lightning_snip.config import SNIPConfig
from lightning_snip.controller import SINGLE_PROCESS, Collective, SNIPController
from lightning_snip.statistics_round import RoundSettings
from lightning_snip.convert import glob_filter, matching_pins
from lightning_snip.gemm import choose_fp8_scaling
from lightning_snip.formats import Format, Fp8Scaling
from lightning_snip.plan import Plan
from lightning_snip.reporting import log_to_loggers
from lightning_snip.stats import slice_batch
from lightning_snip.step_loss import StepLosses

logger = logging.getLogger(__name__)

# Single device, DDP, and FSDP2 through ModelParallelStrategy without tensor parallelism (the user
# shards with fully_shard in configure_model). FSDP1 and DeepSpeed are not among them;
# DeepSpeedStrategy subclasses DDPStrategy, so it is excluded by name.
SUPPORTED_STRATEGIES = (SingleDeviceStrategy, DDPStrategy, ModelParallelStrategy)
UNSUPPORTED_STRATEGIES = (DeepSpeedStrategy,)
_STATE = ("config", "layers", "plan", "history", "aggregate", "num_stats_rounds", "num_plans_applied",
          "num_consecutive_failures", "grad_noise_ratios", "invalid_formats", "fp4_fraction",
          "switchable_fp4_fraction")


class SNIPCallback(Callback):
    """Adaptive per-layer FP4/FP8 precision (SNIP) for a LightningModule's linear layers.

    On fit setup the selected ``nn.Linear`` layers become SNIPLinear (same Parameters) in
    ``config.initial_format``, pinned layers in their pin. Strategies: single device, DDP, and FSDP2
    through ModelParallelStrategy with tensor_parallel_size=1 (layers converted in place after
    ``fully_shard``; statistics from the sharded weights and optimizer state, see
    lightning_snip.divergence); others fail at setup. Every ``interval`` steps from
    ``warmup_steps`` on, a statistics round runs on the first ``max_rows`` token rows of the batch
    (high precision, see lightning_snip.stats). In the ``first_order_steps`` training steps before
    it, LD's first-order term is sampled on the live steps (FirstOrderSampler, ``max_rows``
    rows each), which the ``accumulated`` estimator averages with the round's own. The round's
    divergences are averaged over data-parallel ranks (unclamped), and folded into an exponential moving average over rounds (see
    lightning_snip.aggregate), and rank 0 solves the ILP on that aggregate in a background thread.
    At the next step rank 0 joins the thread, broadcasts the plan, and every rank applies it
    before that step's forward pass. A failed statistics round or solve logs a warning and training
    continues on the last good plan. The aggregate, the first-order samples since the last round and a
    solve still pending are part of the checkpoint: a resumed run plans exactly as the uninterrupted
    one (given the same data and deterministic GEMMs).

    The statistics loss is ``pl_module.snip_loss(batch)`` if the module defines it, else the loss
    returned by ``training_step(batch, batch_idx)``.

    Logged metrics (every Lightning logger; image and text to TensorBoard only), each explained in
    lightning_snip.tags.TAGS and docs/metrics.md:
        statistics round: ``snip/ld/<fqn>/<format>`` (LD, before the clamp at 0 that planning applies),
            ``snip/wd/<fqn>/<format>`` (WD), ``snip/stats_seconds``, ``snip/wd_probe_rel_stderr``,
            ``snip/invalid_formats`` (non-zero is a fault to look into), ``snip/grad_noise_ratio/<fqn>``;
        plan applied: ``snip/solver_seconds``, ``snip/fp4_fraction``, ``snip/fp4_fraction_switchable``,
            ``snip/relative_gemm_cost``, ``snip/plan_changes``, ``snip/plan_agreement``, ``snip/round_stretch``,
            ``snip/noise_guarded_layers``, ``snip/plan`` (image), ``snip/plan_table`` (text);
        the guard: ``snip/canary_reverts``, ``snip/canary_worst_ratio``, ``snip/canary_seconds``,
            ``snip/canary_reason`` (text), ``snip/plan_cost_at_switch``, ``snip/loss_watch_unconfirmed``,
            ``snip/plan_reverted``, ``snip/spike_reverts``, ``snip/plan_reverted_reason`` (text);
        ``snip/overhead``: SNIP's measured time over training's so far, on the device's timeline (logged where
            it has priced more of its own work, and at the end).

    The loop itself is lightning_snip.controller.SNIPController (``self.controller``); this class
    is its Lightning adapter. Public state (the controller's): ``layers`` (fqn -> SNIPLinear),
    ``plan`` (the applied Plan or None), ``history`` (a list of dicts: step, divergence, plan; the last 16 rounds),
    ``aggregate``, ``num_stats_rounds``, ``num_plans_applied``, ``num_consecutive_failures``,
    ``grad_noise_ratios``, ``invalid_formats``, ``fp4_fraction``, ``switchable_fp4_fraction``.
    """

    def __init__(self, config: SNIPConfig | None = None, *, plan: Plan | None = None,
                 round_settings: RoundSettings | None = None) -> None:
        """Args:
            config: the settings (SNIPConfig defaults when None).
            plan: a plan to apply at fit start instead of ``initial_format`` (checked against the
                model at setup); with ``config.replan=False`` it holds for the whole run.
            round_settings: the estimator's settings (lightning_snip.statistics_round.RoundSettings; None: the
                library's, fixed by their studies; for benchmarks and studies, not a user's setting).
        """
        super().__init__()
        self._given = (config, plan, round_settings)  # (a fit on another model starts from these again)
        self._start_fresh()

    def _start_fresh(self) -> None:
        config, plan, round_settings = self._given
        self.controller = SNIPController(config, plan=plan, round_settings=round_settings)
        self._collective: Collective | None = None  # the trainer's ranks, built once per fit
        self._fp8_auto = self.controller.config.fp8_scaling is Fp8Scaling.AUTO
        self._restored_fp8_scaling: str | None = None  # fp8_scaling=auto's choice, from a checkpoint
        self._step_losses = StepLosses()  # the loss watch's view of each optimizer step, read a few steps late
        self._last_batch = None  # (batch, batch_idx) of the last closed step

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit":
            _check_strategy(trainer.strategy, self.controller.config)
            if _converted_another_model(self.controller, pl_module):  # (a checkpoint's state is restored after setup)
                self.controller.close()
                self._start_fresh()
                if trainer.is_global_zero:
                    logger.info("SNIP: a fit on a new model; the state this callback held from its last fit (plan, "
                                "statistics, schedule) is dropped")

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Converted here, not in setup: layers built (or compiled) in ``configure_model`` exist only
        # after setup, and the strategy has moved the model to its device.
        self._collective = _collective(trainer)
        self.controller.config = resolve_fp8_scaling(self.controller.config, pl_module, pl_module.device, self._collective,
                                                     restored=self._restored_fp8_scaling)
        self.controller.attach(pl_module, device=pl_module.device)
        if trainer.is_global_zero:  # the run's setup lines once, not once per rank
            self.controller.log_setup(pl_module.device)

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        steps = trainer.estimated_stepping_batches  # (max_steps, or what max_epochs comes to; inf if unbounded)
        self.controller.set_horizon(int(steps) if isinstance(steps, (int, float)) and math.isfinite(steps) else None,
                                    trainer.global_step, self._collective)
        self.controller.resume(pl_module, self._collective)

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch, batch_idx: int) -> None:
        controller, step, collective = self.controller, trainer.global_step, self._collective
        self._step_losses.begin(step)
        controller.begin_batch(step, batch_idx, trainer.global_rank)
        if (overhead := controller.overhead_update()) is not None:  # (the work of a step the device has finished)
            log_to_loggers(trainer.loggers, step, overhead)
        if controller.guard.enabled and self._step_losses.pending and controller.works_at(step):
            self._observe(trainer, pl_module, batch, batch_idx)  # each plan's watch from every loss before it
        applied = controller.apply_due(pl_module, step, collective)
        if applied is not None:
            log_to_loggers(trainer.loggers, step, *applied)
        kind = controller.step_kind(step)
        # the plan canary: after a switch, at every round, and after a rise of the loss the same batch did not confirm
        if applied is not None or kind is StepKind.ROUND or controller.canary_due:
            self._check_plan(trainer, pl_module, batch, batch_idx, step)
        if kind is StepKind.ROUND:
            scalars = controller.statistics_round(
                pl_module, batch, _statistics_loss(trainer, pl_module, batch_idx), step=step, collective=collective,
                optimizer=trainer.optimizers[0] if trainer.optimizers else None, loss_scale=_amp_loss_scale(trainer))
            if scalars is not None:
                log_to_loggers(trainer.loggers, step, scalars)
        elif kind is StepKind.FIRST_ORDER:
            controller.start_first_order(step, _gradient_scale(trainer))

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs, batch, batch_idx: int) -> None:
        self.controller.end_batch()
        if self.controller.guard.enabled and self._step_losses.end(outputs, trainer.global_step):
            self._last_batch = (batch, batch_idx)  # (the end of training confirms an alarm on it)
            if self._step_losses.full:
                self._observe(trainer, pl_module, batch, batch_idx)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.controller.guard.enabled and self._step_losses.pending:
            self._observe(trainer, pl_module, *self._last_batch)  # the last steps' losses
        self._last_batch = None
        log_to_loggers(trainer.loggers, trainer.global_step, self.controller.overhead_update(final=True))

    def _observe(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch, batch_idx: int) -> None:
        """The pending steps' losses (at most StepLosses.READ_EVERY, so a revert lands at most that many steps late),
        read in one copy (the same on every rank), to the loss watch in order; an alarm is confirmed on this batch
        (any batch prices the plan's formats against the ones before it)."""
        collective = self._collective
        for step, loss, finite_grads in self._step_losses.read(collective.all_sum, collective.world_size):
            reverted = self.controller.observe_step(
                pl_module, step, loss, finite_grads=finite_grads, collective=collective,
                same_batch_cost=_same_batch_cost(self.controller, trainer, pl_module, batch, batch_idx, collective))
            if reverted is not None:
                scalars, reason = reverted
                log_to_loggers(trainer.loggers, step, scalars,
                               text={"snip/plan_reverted_reason": reason} if reason else None)

    def _check_plan(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch, batch_idx: int, step: int) -> None:
        """The plan canary on a slice of this batch, then (after a switch) what the plan costs on it."""
        loss_of = _statistics_loss(trainer, pl_module, batch_idx)
        # (sliced inside the loss functions: a batch that cannot be sliced fails there, where a failure is caught)
        checked = self.controller.check_plan(pl_module, lambda: loss_of(slice_batch(batch, CANARY_ROWS)), step=step,
                                             collective=self._collective)
        if checked is not None:
            scalars, reason = checked
            log_to_loggers(trainer.loggers, step, scalars, text={"snip/canary_reason": reason} if reason else None)
        if self.controller.guard.needs_plan_cost:
            measured = self.controller.measure_switch(
                pl_module, lambda: loss_of(slice_batch(batch, self.controller.config.max_rows)), step=step,
                collective=self._collective)
            if measured is not None:
                scalars, reason = measured
                log_to_loggers(trainer.loggers, step, scalars, text={"snip/plan_reverted_reason": reason} if reason else None)

    @override
    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer) -> None:
        if self.controller.guard.checks_gradients(trainer.global_step) and _amp_loss_scale(trainer) == 1.0:  # (AMP skips them)
            self._step_losses.check_gradients(pl_module)

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self.controller.stop_recording()  # no hooks left on the user's model

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self.controller.close()  # hooks removed, a solve still running joined (bounded)

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.controller.close()

    @override
    def state_dict(self) -> dict:
        state = self.controller.state_dict()
        state["step_losses"] = self._step_losses.state_dict()  # (losses the loss watch has not read yet)
        if self._fp8_auto and self.controller.config.fp8_scaling is not Fp8Scaling.AUTO:
            state["fp8_scaling_auto"] = self.controller.config.fp8_scaling.value  # a resumed run keeps it
        return state

    @override
    def load_state_dict(self, state_dict: dict) -> None:
        self.controller.load_state_dict(state_dict)
        self._step_losses.load_state_dict(state_dict.get("step_losses", {}))
        self._restored_fp8_scaling = state_dict.get("fp8_scaling_auto")


def _controller_attribute(name: str) -> property:
    return property(lambda self: getattr(self.controller, name),
                    lambda self, value: setattr(self.controller, name, value),
                    doc=f"The controller's ``{name}`` (SNIPController).")


for _name in _STATE:  # the public state is the controller's (see the class docstring)
    setattr(SNIPCallback, _name, _controller_attribute(_name))


def _converted_another_model(controller: SNIPController, model: torch.nn.Module) -> bool:
    """Whether ``controller`` holds the layers of a model other than ``model`` (the callback served a fit on it: its
    plan, statistics and schedule are that model's)."""
    layer = next(iter(controller.layers.values()), None)
    return layer is not None and not any(module is layer for module in model.modules())


def _same_batch_cost(controller: SNIPController, trainer: pl.Trainer, pl_module: pl.LightningModule, batch,
                     batch_idx: int, collective: Collective):
    """The loss watch's confirmation: this batch's loss (a max_rows slice) under the formats in force minus under
    ``previous``."""
    loss_of = _statistics_loss(trainer, pl_module, batch_idx)

    def cost(previous):
        return controller.plan_cost(pl_module, lambda: loss_of(slice_batch(batch, controller.config.max_rows)),
                                    previous, collective)

    return cost


def _check_strategy(strategy, config: SNIPConfig) -> None:
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


def resolve_fp8_scaling(config: SNIPConfig, model: torch.nn.Module, device, collective: Collective = SINGLE_PROCESS,
                        *, restored: str | None = None) -> SNIPConfig:
    """``config`` with fp8_scaling="auto" replaced by rank 0's choice on ``device`` (gemm.choose_fp8_scaling
    over the shapes of the linears the config selects, but those pinned to another format), logged once and
    the same on every rank; ``restored``: the choice a checkpoint holds, kept (a resumed run does not switch
    recipe mid-run); any other config unchanged. A timing that fails leaves rowwise, with a warning."""
    if config.fp8_scaling is not Fp8Scaling.AUTO:
        return config
    chosen = None
    if restored is not None:
        chosen = Fp8Scaling.parse(restored, field_name="fp8_scaling")
        if collective.is_rank_zero:
            logger.info("SNIP: fp8_scaling=auto keeps the checkpoint's choice, %s", chosen.value)
    elif collective.is_rank_zero:
        chosen = _timed_fp8_scaling(config, model, device)
    chosen = collective.broadcast(chosen)  # one recipe on every rank: the ranks' timings may differ
    return dataclasses.replace(config, fp8_scaling=chosen)


def _timed_fp8_scaling(config: SNIPConfig, model: torch.nn.Module, device) -> Fp8Scaling:
    select = glob_filter(config.include, config.exclude)
    # not the layers pinned to another format (the LM head in bf16): their GEMMs never run FP8
    pins = {glob: Format.parse(fmt) for glob, fmt in config.pin_formats.items()}
    shapes = [(m.out_features, m.in_features) for name, m in model.named_modules()
              if isinstance(m, torch.nn.Linear) and select(name, m)
              and (not (matched := matching_pins(name, pins)) or matched[-1][1] is Format.FP8)]
    try:
        chosen, times = choose_fp8_scaling(device, shapes)
    except Exception as err:  # noqa: BLE001 - a failed timing must not stop the run (nor hang the other ranks)
        logger.warning("SNIP: fp8_scaling=auto could not time the FP8 GEMMs on %s (%s: %s); using rowwise",
                       torch.device(device), type(err).__name__, (str(err).splitlines() or [""])[0][:200])
        return Fp8Scaling.ROWWISE
    timed = ", ".join(f"{s.value} {t * 1e3:.2f} ms" for s, t in times.items())
    logger.info("SNIP: fp8_scaling=auto chose %s on %s (%s)", chosen.value, torch.device(device),
                f"fp8 GEMMs with casts of the model's {len(shapes)} layer shapes: {timed}" if times
                else "no native FP8 GEMM here: emulated, the finer scales")
    return chosen


def _collective(trainer: pl.Trainer) -> Collective:
    """The trainer's strategy as the controller's Collective."""
    strategy = trainer.strategy
    return Collective(
        rank=trainer.global_rank, world_size=trainer.world_size,
        all_sum=lambda values: strategy.reduce(values.to(strategy.root_device), reduce_op="sum").cpu(),
        broadcast=lambda obj: strategy.broadcast(obj, src=0))


def _statistics_loss(trainer: pl.Trainer, pl_module: pl.LightningModule, batch_idx: int):
    """The round's loss of a sliced batch: in the strategy's precision context (autocast under
    *-mixed), as the training step; compiled code runs eagerly (the round's hooks and noise must not
    be traced, guarded on or recompiled for)."""
    precision = trainer.precision_plugin

    def loss_of(sliced):
        with precision.train_step_context(), torch.compiler.set_stance("force_eager"):
            return _loss(pl_module, sliced, batch_idx)

    return loss_of


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
