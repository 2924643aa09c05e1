"""The loss-spike guard (lightning_snip.spike_guard): the rule on hand-made losses, then on a real Trainer with a
layer whose FP4 forward is broken on purpose, healthy runs, and a resumed run."""

import dataclasses
import glob
import logging
import math

import pytest
import torch
from lightning.pytorch.callbacks import Callback
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from lightning_snip.callback import SNIPCallback
from lightning_snip.config import SNIPConfig
from lightning_snip.controller import SNIPController
from lightning_snip.formats import Format
from lightning_snip.spike_guard import AVOID_ROUNDS, CONFIRM_SHARE, MIN_HISTORY, PATIENCE, Alarm, Revert, SpikeGuard

from test_callback import _fit


def _guard(losses, threshold=6.0):
    guard = SpikeGuard(threshold)
    for step, loss in enumerate(losses):
        assert guard.observe(step, loss) is None
    return guard


def _noisy(n, level=3.0, slope=-0.01, noise=0.02, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [level + slope * i + noise * float(torch.randn((), generator=g)) for i in range(n)]


def test_a_spike_alarms_and_reverts_when_the_same_batch_confirms_it():
    guard = _guard(_noisy(20))
    guard.on_switch(20, {"a:forward": "fp8", "a:backward": "fp8"})
    assert guard.watching and guard.num_watched == 1 and guard.needs_plan_cost
    assert guard.set_plan_cost(20, 0.0) is None and not guard.needs_plan_cost
    sigma, level = guard.watch["sigma"], guard.watch["mu"]
    assert guard.observe(20, level + 4 * sigma) is None  # one step at 4 sigma: below the CUSUM's limit
    alarm = guard.observe(21, level + 8.1 * sigma)  # 3 + 7.1 >= 10 sigma accumulated: 2 x (6 - 1)
    assert isinstance(alarm, Alarm) and alarm.step == 21 and alarm.previous == {"a:forward": "fp8", "a:backward": "fp8"}
    assert alarm.rise == pytest.approx(6.05 * sigma, rel=0.01)  # the mean excess of the 2 steps
    assert guard.confirm(dataclasses.replace(alarm), plan_cost=0.99 * CONFIRM_SHARE * alarm.rise) is None  # not the plan's
    guard.watch['previous'] = alarm.previous
    revert = guard.confirm(alarm, plan_cost=CONFIRM_SHARE * alarm.rise)
    assert revert is not None and revert.step == 21 and revert.formats == alarm.previous
    assert "same batch" in revert.reason and not guard.watching and guard.num_reverts == 1 and guard.num_unconfirmed == 1
    guard.mark(revert, {"a:forward": "mxfp4", "a:backward": "fp8"})
    # the direction the plan changed is avoided; the one it left in fp8 is not held against fp8
    assert guard.avoided() == {"a:forward": frozenset({"mxfp4"})}
    for _ in range(AVOID_ROUNDS):
        assert guard.avoided()
        guard.count_solve()
    assert guard.avoided() == {}


def test_a_rise_the_same_batch_does_not_confirm_is_not_the_plans_and_the_watch_goes_on_from_there():
    """A data shift: the loss steps up and stays up, but the plan's formats cost what they cost at the switch."""
    guard = _guard(_noisy(32))
    guard.on_switch(32, {"a": "fp8"})
    guard.set_plan_cost(32, 0.01)
    verdicts = [guard.observe(step, 3.0) for step in range(32, 40)]  # +0.7 over the level, held
    alarm = next(v for v in verdicts if v is not None)
    assert guard.confirm(alarm, plan_cost=0.011) is None and guard.num_unconfirmed == 1 and guard.watching
    assert guard.watch["mu"] > 2.9 and guard.watch["offset"] == 0  # the new level holds the shift
    assert all(guard.observe(step, 3.0) is None for step in range(alarm.step + 1, alarm.step + 60))


def test_a_slow_climb_alarms_and_a_flat_loss_never_does():
    guard = _guard(_noisy(32, slope=0.0))
    guard.on_switch(32, {"a": "fp8"})
    guard.set_plan_cost(32, 0.0)
    sigma, level = guard.watch["sigma"], guard.watch["mu"]
    climb = [guard.observe(32 + t, level + 0.1 * sigma * t) for t in range(60)]  # 0.1 sigma more per step
    first = next(t for t, v in enumerate(climb) if v is not None)
    assert isinstance(climb[first], Alarm) and 15 < first < 40  # tens of steps, never the first few
    flat = _guard(_noisy(32, slope=0.0))
    flat.on_switch(32, {"a": "fp8"})
    flat.set_plan_cost(32, 0.0)
    assert all(flat.observe(32 + t, loss) is None for t, loss in enumerate(_noisy(400, slope=0.0, seed=1)))


def test_a_rising_trend_is_followed_and_a_falling_one_is_not_continued():
    """The LR warm-up's rise is continued (no alarm while the loss keeps rising as it did); a falling loss that
    flattens is no rise."""
    rising = _guard([2.0 + 0.02 * t for t in range(32)])
    rising.on_switch(32, {"a": "fp8"})
    rising.set_plan_cost(32, 0.0)
    assert all(rising.observe(t, 2.0 + 0.02 * t - 0.02 * (t - 32) ** 2 / 64) is None for t in range(32, 64))
    falling = _guard(_noisy(32, level=5.0, slope=-0.05, noise=0.01))
    falling.on_switch(32, {"a": "fp8"})
    falling.set_plan_cost(32, 0.0)
    assert all(falling.observe(t, falling.watch["mu"]) is None for t in range(32, 200))  # flattened at once


def test_a_non_finite_loss_or_gradient_or_a_catastrophic_plan_cost_reverts_at_once():
    for bad in ({"loss": math.nan}, {"loss": 2.5, "finite_grads": False}):
        guard = _guard([2.5] * 10)
        guard.on_switch(10, {"a": "fp8"})
        revert = guard.observe(10, bad["loss"], finite_grads=bad.get("finite_grads", True))
        assert isinstance(revert, Revert) and "non-finite" in revert.reason
    for cost in (math.nan, 1.0):
        guard = _guard(_noisy(20))
        guard.on_switch(20, {"a": "fp8"})
        revert = guard.set_plan_cost(20, cost)
        assert isinstance(revert, Revert) and "switch's batch" in revert.reason and not guard.watching
    short = _guard([2.5] * (MIN_HISTORY - 1))
    short.on_switch(MIN_HISTORY, {"a": "fp8"})
    assert not short.watching  # too little history to judge by


def test_the_baseline_is_where_the_loss_is_now_and_its_noise_around_the_trend():
    """A loss falling along a line with noise: the level is the mean of the last LEVEL_STEPS (a plain mean of all
    would sit half the fall above it), the noise the residuals' spread around the line (the fall is not noise)."""
    from lightning_snip.spike_guard import LEVEL_STEPS, baseline

    g = torch.Generator().manual_seed(0)
    noise = [0.01 * float(torch.randn((), generator=g)) for _ in range(32)]
    level, sigma, slope = baseline([5.0 - 0.05 * t + e for t, e in enumerate(noise)])
    assert level == pytest.approx(5.0 - 0.05 * (31 - (LEVEL_STEPS - 1) / 2), abs=0.02)
    assert 0.005 < sigma < 0.02 and slope == pytest.approx(-0.05, abs=0.005)


def test_the_guard_is_checked_and_can_be_off():
    with pytest.raises(ValueError, match=r"^spike_threshold: invalid value 0; allowed: a finite number > 0"):
        SNIPConfig(spike_threshold=0)
    guard = SpikeGuard(None)
    guard.on_switch(10, {"a": "fp8"})
    assert not guard.enabled and guard.observe(10, math.nan) is None


class _LossRecorder(Callback):
    def __init__(self):
        self.losses = {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses[trainer.global_step - 1] = float(outputs["loss"])


def _broken_run(tmp_path, monkeypatch, mode, **kw):
    """A run whose plan (at step 11) meets every layer's MXFP4 forward broken on purpose."""
    import lightning_snip.linear as linear
    from faults import broken_fp4_forward

    # the loss watch alone (the plan canary, on by default, puts such layers back before the step: test_plan_canary.py)
    settings = dict(overhead_budget=None, warmup_steps=10, interval=100, fp4_fraction=0.6, max_rows=128, plan_canary=False,
                    candidate_formats=("fp8", "mxfp4"))  # (the fault is in mxfp4)
    snip = SNIPCallback(SNIPConfig(**{**settings, **kw}))

    class InjectFault(Callback):  # the fault comes with the layers (converted at fit start)
        def on_fit_start(self, trainer, pl_module):
            monkeypatch.setattr(linear, "quantized_matmul", broken_fp4_forward(list(snip.layers.values()), Format.MXFP4,
                                                                               mode=mode))

    losses = _LossRecorder()
    _fit(tmp_path, snip, max_steps=24, callbacks=[InjectFault(), losses])
    monkeypatch.undo()
    return snip, losses.losses


@pytest.mark.parametrize("mode", ["nan", "noise"])
def test_a_plan_onto_a_broken_fp4_forward_is_reverted_and_the_loss_comes_back(tmp_path, monkeypatch, mode):
    snip, losses = _broken_run(tmp_path, monkeypatch, mode)
    guard = snip.controller.guard
    assert snip.num_plans_applied == 1 and guard.num_watched == 1 and guard.num_reverts == 1
    events = EventAccumulator(glob.glob(str(tmp_path / "tb" / "version_0"))[0])
    events.Reload()
    reverted = events.Scalars("snip/plan_reverted")
    # the plan applies at step 11; what it costs on that step's batch (NaN, or far above the loss's noise) reverts it
    # before the step's forward
    assert [e.step for e in reverted] == [11]
    assert "snip/plan_reverted_reason/text_summary" in events.Tags()["tensors"]
    # every layer back in its format from before the plan (fp8), and its FP4 choices avoided
    assert all(layer.format is Format.FP8 and layer.backward_format in (None, Format.FP8)
               for layer in snip.layers.values() if layer.pinned is None)
    assert all(fmt is not Format.MXFP4 for fmt in snip.plan.values()) and guard.avoided()
    # the loss comes back: the last steps near the steps before the switch, all finite
    before = sum(losses[s] for s in range(5, 10)) / 5
    after = [losses[s] for s in range(19, 24)]
    assert all(math.isfinite(v) for v in after) and max(after) < before


def test_healthy_runs_are_never_reverted(tmp_path):
    """Plans applied with the guard on, two seeds: watched, never reverted (benchmarks/spike_guard.py
    counts 5 demo seeds and SmolLM2 at the defaults)."""
    import lightning.pytorch as pl

    watched = 0
    for seed in (0, 1):
        snip = SNIPCallback(SNIPConfig(overhead_budget=None, warmup_steps=10, interval=8, fp4_fraction=0.75, max_rows=128))
        pl.seed_everything(seed)
        _fit(tmp_path / str(seed), snip, max_steps=36)
        assert snip.num_plans_applied == 4 and snip.controller.guard.num_reverts == 0
        watched += snip.controller.guard.num_watched
    assert watched >= 2


def test_a_resumed_run_reverts_as_the_uninterrupted_one(tmp_path, monkeypatch):
    """A checkpoint written while the loss watch watches a plan resumes watching: a fault that begins after the
    checkpoint (the FP4 forward broken from step 13) is reverted at the same step, with the avoided formats and
    the guard's counts of the uninterrupted run."""
    import lightning.pytorch as pl

    import lightning_snip.linear as linear
    from faults import broken_fp4_forward

    def run(path, max_steps, ckpt_path=None, save_every=None):
        snip = SNIPCallback(SNIPConfig(overhead_budget=None, warmup_steps=10, interval=100, fp4_fraction=0.6,
                                       max_rows=128, plan_canary=False, candidate_formats=("fp8", "mxfp4")))
        step = {"now": 0}

        class InjectFault(Callback):
            def on_fit_start(self, trainer, pl_module):
                broken = broken_fp4_forward(list(snip.layers.values()), Format.MXFP4, mode="noise")
                real = linear.quantized_matmul
                monkeypatch.setattr(linear, "quantized_matmul",
                                    lambda *a, **kw: (broken if step["now"] >= 13 else real)(*a, **kw))

            def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
                step["now"] = trainer.global_step

        callbacks = [InjectFault()]
        if save_every:
            callbacks.append(pl.callbacks.ModelCheckpoint(dirpath=path / "ckpt", every_n_train_steps=save_every,
                                                          save_top_k=-1))
        _fit(path, snip, max_steps=max_steps, ckpt_path=ckpt_path, callbacks=callbacks,
             enable_checkpointing=bool(save_every))
        monkeypatch.undo()
        return snip

    full = run(tmp_path / "full", 20)
    first = run(tmp_path / "first", 12, save_every=12)
    assert first.controller.guard.watching and first.controller.guard.watch["cost"] is not None
    resumed = run(tmp_path / "resumed", 20, ckpt_path=glob.glob(str(tmp_path / "first" / "ckpt" / "*.ckpt"))[0])
    for snip in (full, resumed):
        assert snip.controller.guard.num_reverts == 1 and not snip.controller.guard.watching
    assert resumed.controller.guard.avoid == full.controller.guard.avoid and full.controller.guard.avoid
    assert dict(resumed.plan) == dict(full.plan)


def test_a_solve_pending_at_a_revert_is_solved_again_without_the_reverted_formats(tmp_path, monkeypatch):
    """A round every 2 steps: the solve started in the step the guard reverts (12) was priced without the
    avoided formats; it is started again with them avoided, so the plans of the next solves do not put the
    reverted (GEMM direction, format) pairs back."""
    snip, _ = _broken_run(tmp_path, monkeypatch, "noise", interval=2)
    assert snip.controller.guard.num_reverts >= 1
    plans = {entry["step"]: entry["plan"]["formats"] for entry in snip.history if entry.get("plan")}
    reverted = {(key, fmt) for key, fmt in plans[10].items() if fmt != "fp8" and not key.startswith("model.lm_head")}
    assert reverted  # the plan of step 10 (applied at 11) moved directions off fp8; the guard reverted it at 12
    for stats_step in (12, 14):  # solves within the avoided ones
        assert not reverted & set(plans[stats_step].items()), stats_step


def test_the_guard_watches_a_hugging_face_llama_under_bf16_mixed_and_accumulation(tmp_path):
    """Where users train: a module we did not write, bf16-mixed, 2 micro-batches per step. Each step's loss is
    the micro-batches' mean; the plan is watched (and its gradients checked) and a healthy run never reverts."""
    pytest.importorskip("transformers")
    from test_training_setups import _HFLlamaLM

    snip = SNIPCallback(SNIPConfig(overhead_budget=None, warmup_steps=10, interval=100, fp4_fraction=0.6, max_rows=128))
    _fit(tmp_path, snip, max_steps=16, module=_HFLlamaLM(), precision="bf16-mixed", accumulate_grad_batches=2)
    guard = snip.controller.guard
    assert snip.num_plans_applied == 1 and guard.num_watched == 1 and guard.num_reverts == 0
    # every step observed, each the mean of its 2 micro-batches (about ln 256 here, not half or twice it)
    assert len(guard.losses) == 16 and 5 < guard.losses[0] < 6 and all(1 < v < 7 for v in guard.losses)
    assert -math.inf < guard.max_rise < 6


def test_under_torch_compile_a_revert_returns_to_a_compiled_assignment(tmp_path, monkeypatch):
    """A compiled model: the broken plan is reverted as in eager mode, and the formats it returns to are the ones
    the steps before the plan ran, so the revert compiles nothing new."""
    import lightning_snip.linear as linear
    from faults import broken_fp4_forward
    from test_callback import SMALL
    from test_training_setups import _CompileCounter, _CompiledLM

    torch._dynamo.reset()
    snip = SNIPCallback(SNIPConfig(overhead_budget=None, warmup_steps=10, interval=100, fp4_fraction=0.6, max_rows=128,
                                   plan_canary=False, candidate_formats=("fp8", "mxfp4")))  # (the fault is in mxfp4)
    counter = _CompileCounter(snip)

    class InjectFault(Callback):
        def on_fit_start(self, trainer, pl_module):
            monkeypatch.setattr(linear, "quantized_matmul",
                                broken_fp4_forward(list(snip.layers.values()), Format.MXFP4, mode="noise"))

    _fit(tmp_path, snip, max_steps=16, module=_CompiledLM(SMALL), callbacks=[InjectFault(), counter])
    monkeypatch.undo()
    assert snip.controller.guard.num_reverts == 1
    formats = [f for f, _ in counter.rows]
    assert formats[-1] == formats[0]  # back to the formats before the plan
    assert sum(frames for f, frames in counter.rows[PATIENCE + 11:]) == 0  # nothing compiled after the revert


def test_gradients_are_checked_only_in_the_steps_after_a_switch_the_loss_every_step():
    """The gradient check is a host sync per step: the GRADIENT_STEPS after a switch, not the whole watch."""
    from lightning_snip.spike_guard import GRADIENT_STEPS

    guard = _guard(_noisy(20))
    assert not guard.checks_gradients(20)
    guard.on_switch(20, {"a": "fp8"})
    guard.set_plan_cost(20, 0.0)
    assert guard.checks_gradients(20) and guard.checks_gradients(20 + GRADIENT_STEPS - 1)
    assert not guard.checks_gradients(20 + GRADIENT_STEPS) and guard.watching
    assert isinstance(guard.observe(20 + GRADIENT_STEPS, math.nan), Revert)  # a non-finite loss: still every step


def test_an_unconfirmed_alarm_is_a_warning_and_reverts_nothing(caplog):
    """The loss rose after a plan but its formats' forward on the same batch does not explain it (a data shift, or
    a rise through the backward GEMMs, which no forward shows): not reverted, and the user is told at WARNING."""
    controller = SNIPController(SNIPConfig())
    for step, loss in enumerate(_noisy(32)):  # (down to ~2.7: a loss of 3.0 is a rise)
        assert controller.observe_step(None, step, loss) is None
    controller.guard.on_switch(32, {"a": "fp8"})
    controller.guard.set_plan_cost(32, 0.01)
    with caplog.at_level(logging.INFO, logger="lightning_snip"):
        outs = [controller.observe_step(None, step, 3.0, same_batch_cost=lambda previous: 0.011)
                for step in range(32, 40)]
    scalars, reason = next(out for out in outs if out is not None)
    assert scalars == {"snip/loss_watch_unconfirmed": 1.0} and reason == ""
    said = [r for r in caplog.records if "loss watch at step" in r.getMessage()]
    assert len(said) >= 2 and all("not reverted" in r.getMessage() for r in said)  # (the shift alarms again)
    # a warning once per plan, then info: the watch's new baselines after a lasting shift alarm again
    assert [r.levelno for r in said] == [logging.WARNING] + [logging.INFO] * (len(said) - 1)
    assert "cost only 0.001 more than at the switch" in said[0].getMessage()  # (0.011 now, 0.01 at the switch)
    assert controller.guard.num_reverts == 0 and controller.canary_due
    controller.guard.on_switch(40, {"a": "nvfp4"})  # a new plan: its first unconfirmed alarm warns again
    controller.guard.set_plan_cost(40, 0.0)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="lightning_snip"):
        for step in range(40, 60):
            controller.observe_step(None, step, 3.5, same_batch_cost=lambda previous: 0.0)
    said = [r for r in caplog.records if "loss watch at step" in r.getMessage()]
    assert said and said[0].levelno == logging.WARNING


def test_a_measure_that_fails_warns_and_training_goes_on(caplog):
    """The loss watch's measures run the user's loss on a slice of the batch; one that fails (a batch the loss
    cannot take sliced) warns and falls back: the switch's cost unmeasured (none expected), an alarm unconfirmed
    taken as the plan's (reverted, as without a measure). Nothing is raised into the training loop."""
    from lightning_snip.convert import layer_assignment
    from lightning_snip.demo.model import LlamaConfig, TinyLlama
    from lightning_snip.plan import Granularity

    def broken():
        raise TypeError("the loss needs the whole batch")

    model = TinyLlama(LlamaConfig(vocab_size=64, dim=32, num_layers=1, num_heads=2, num_kv_heads=1, hidden_dim=64))
    controller = SNIPController(SNIPConfig())
    controller.attach(model)
    for step, loss in enumerate(_noisy(32)):
        controller.observe_step(model, step, loss)
    keys = layer_assignment(controller.layers, Granularity(controller.config.granularity))
    controller.guard.on_switch(32, {key: fmt.value for key, fmt in keys.items()})
    with caplog.at_level(logging.WARNING, logger="lightning_snip"):
        scalars, reason = controller.measure_switch(model, broken, step=32)
    assert scalars == {"snip/plan_cost_at_switch": 0.0} and reason == "" and not controller.guard.needs_plan_cost
    assert "measuring the plan's cost on step 32's batch failed (TypeError: the loss needs the whole batch)" \
        in caplog.text and "expects no cost" in caplog.text
    outs = [controller.observe_step(model, step, 3.5, same_batch_cost=lambda previous: broken())
            for step in range(33, 40)]
    scalars, reason = next(out for out in outs if out is not None)
    assert scalars["snip/plan_reverted"] == 1.0 and controller.guard.num_reverts == 1
    assert "taken as the plan's" in caplog.text


def test_a_measure_that_fails_on_one_rank_fails_on_every_rank_after_the_same_collective():
    """Under DDP a rank whose loss fails must still join the ranks' sum (else its next collective pairs with theirs),
    and the ranks whose loss worked must take the same fallback: every rank raises, after one all_sum each."""
    from lightning_snip.canary import plan_cost
    from lightning_snip.convert import convert_linears, layer_assignment
    from lightning_snip.plan import Granularity

    model = torch.nn.Sequential(torch.nn.Linear(16, 16))
    layers = convert_linears(model)
    previous = {key: fmt.value for key, fmt in layer_assignment(layers, Granularity.GEMM).items()}
    sums = []

    def other_rank_failed(values):
        sums.append(values.clone())
        return values + torch.tensor([0.0, 0.0, 1.0], dtype=values.dtype)

    def loss():
        return model(torch.ones(2, 16)).sum()

    with pytest.raises(RuntimeError, match="failed on 1 other rank"):
        plan_cost(model, loss, layers, Granularity.GEMM, previous, all_sum=other_rank_failed, world_size=2)

    def broken():
        raise ValueError("this rank's slice")

    with pytest.raises(ValueError, match="this rank's slice"):
        plan_cost(model, broken, layers, Granularity.GEMM, previous, all_sum=other_rank_failed, world_size=2)
    assert len(sums) == 2 and sums[1][2] == 1.0  # (the failing rank joined the sum, its flag set)
    assert plan_cost(model, loss, layers, Granularity.GEMM, previous) == 0.0  # (one rank, same formats: no cost)
