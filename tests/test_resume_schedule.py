"""Rounds are never silently lost (issue 60): a run resumed from a checkpoint without SNIP's state, or SNIP added at
step N, plans as a fresh run started at N would; a resumed run under the overhead budget plans exactly as the
uninterrupted one, its schedule independent of the resumed machine's clock."""

from __future__ import annotations

import glob

import lightning.pytorch as pl
import pytest
import torch

from lightning_snip.budget import OverheadBudget, StepKind
from lightning_snip.callback import SNIPCallback
from lightning_snip.config import SNIPConfig
from lightning_snip.controller import SNIPController
from lightning_snip.demo.lightning import DemoLM
from lightning_snip.demo.model import LlamaConfig

from test_callback import _FixedBatches

SMALL = LlamaConfig(dim=64, num_layers=2, num_heads=4, num_kv_heads=2, hidden_dim=160)


@pytest.fixture(autouse=True)
def _threads():
    torch.set_num_threads(1)


class _Rounds(pl.Callback):
    """The steps at which SNIP ran a statistics round and applied a plan."""

    def __init__(self, snip):
        self.snip, self.rounds, self.applied, self.plans = snip, [], [], {}
        self._counts = (0, 0)

    def on_train_start(self, trainer, pl_module):
        self._counts = (self.snip.controller.num_stats_rounds, self.snip.controller.num_plans_applied)  # (restored)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        controller = self.snip.controller
        step = trainer.global_step - 1
        if controller.num_stats_rounds > self._counts[0]:
            self.rounds.append(step)
        if controller.num_plans_applied > self._counts[1]:
            self.applied.append(step)
        self._counts = (controller.num_stats_rounds, controller.num_plans_applied)
        if controller.plan is not None:
            self.plans[trainer.global_step] = dict(controller.plan)


class _TickClock:
    """A clock that advances one second per reading: the same calls give the same times on any machine."""

    def __init__(self, snip):
        self.now, self.tick = 0.0, 1.0
        snip.controller.timeline.clock = self

    def __call__(self) -> float:
        self.now += self.tick
        return self.now


class _SlowerFrom(pl.Callback):
    """Steps from ``step`` on tick twice as slowly (a machine's speed changing mid-run, in both runs)."""

    def __init__(self, clock, step):
        self.clock, self.step = clock, step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.clock.tick = 2.0 if trainer.global_step >= self.step else 1.0


class _StopAt(pl.Callback):
    """Ends the fit after ``step`` steps, as a crash would, in a run set up for more (its horizon is the whole run)."""

    def __init__(self, step):
        self.step = step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step >= self.step:
            trainer.should_stop = True


def _fit(root, callbacks, max_steps, ckpt_path=None, checkpoint_every=None):
    pl.seed_everything(0)
    callbacks = list(callbacks)
    if checkpoint_every is not None:
        callbacks.append(pl.callbacks.ModelCheckpoint(dirpath=root / "ckpt", every_n_train_steps=checkpoint_every,
                                                      save_top_k=-1))
    trainer = pl.Trainer(max_steps=max_steps, default_root_dir=root, logger=False, callbacks=callbacks,
                         enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0, accelerator="cpu",
                         enable_checkpointing=checkpoint_every is not None)
    trainer.fit(DemoLM(SMALL), datamodule=_FixedBatches(), ckpt_path=ckpt_path)
    return trainer


def _snip(**kw):
    base = dict(warmup_steps=4, interval=4, fp4_fraction=0.6, max_rows=128, first_order_steps=2)
    return SNIPCallback(SNIPConfig(**{**base, **kw}))


@pytest.mark.parametrize("overhead_budget", [None, 0.5])
def test_a_run_resumed_from_a_checkpoint_without_snip_plans_as_a_fresh_run_started_there(tmp_path, overhead_budget):
    _fit(tmp_path / "plain", [], max_steps=10, checkpoint_every=10)  # a user's own run, no SNIP
    ckpt = glob.glob(str(tmp_path / "plain" / "ckpt" / "*.ckpt"))[0]
    snip = _snip(overhead_budget=overhead_budget)
    seen = _Rounds(snip)
    _fit(tmp_path / "resumed", [snip, seen], max_steps=24, ckpt_path=ckpt)
    # warm-up from the resume step (10 + 4), its first-order sample before it, then its plan at the next step
    assert seen.rounds[0] == 14 and seen.applied[0] == 15
    assert snip.history[0]["step"] == 14
    if overhead_budget is None:
        assert seen.rounds == [14, 18, 22] and snip.num_plans_applied == 3
    else:
        assert snip.num_plans_applied >= 1
    assert snip.controller.budget.snip_seconds["first_order"] != 0.0 or overhead_budget is None


def test_a_run_resumed_too_near_its_end_to_plan_says_so(tmp_path, caplog):
    _fit(tmp_path / "plain", [], max_steps=10, checkpoint_every=10)  # a user's own run, no SNIP
    ckpt = glob.glob(str(tmp_path / "plain" / "ckpt" / "*.ckpt"))[0]
    snip = _snip()  # (the default budget) its warm-up counts from step 10: a round at 14, whose plan needs step 15
    with caplog.at_level("WARNING", logger="lightning_snip"):
        _fit(tmp_path / "resumed", [snip], max_steps=15, ckpt_path=ckpt)
    said = [r.getMessage() for r in caplog.records if "no plan will be made" in r.getMessage()]
    assert len(said) == 1 and "steps 10 to 14" in said[0] and "round runs at step 14, too late for its plan to apply" in said[0], said
    assert snip.num_plans_applied == 0


def test_a_plan_too_early_for_the_loss_watch_says_so(tmp_path, caplog):
    snip = _snip(warmup_steps=4, interval=8, overhead_budget=None)  # plans at steps 5 (5 losses seen) and 13
    with caplog.at_level("INFO", logger="lightning_snip"):
        _fit(tmp_path, [snip], max_steps=14)
    applied = [r.getMessage() for r in caplog.records if "SNIP plan applied at step" in r.getMessage()]
    assert len(applied) == 2 and "not watched by the loss watch (fewer than 8 losses before it)" in applied[0]
    assert "not watched" not in applied[1]


@pytest.mark.parametrize("overhead_budget", [None, 0.02])
def test_the_no_plan_warning_comes_exactly_when_no_plan_can_apply(caplog, overhead_budget):
    def warned(max_steps, step, **kw):
        controller = SNIPController(SNIPConfig(warmup_steps=4, overhead_budget=overhead_budget, **kw))
        caplog.clear()
        with caplog.at_level("WARNING", logger="lightning_snip"):
            controller.set_horizon(max_steps, step)
        return any("no plan will be made" in r.getMessage() for r in caplog.records)

    assert warned(5, 0) and not warned(6, 0)  # a round at step 4 applies its plan at 5: 6 steps are needed
    assert warned(25, 20) and not warned(26, 20)  # resumed at 20 (no SNIP state): its round at 24
    assert not warned(None, 20)  # no known end: nothing to say
    assert not warned(5, 0, replan=False)  # (no plan is expected)
    # a restored schedule: its next round as saved, or at once where the run is past it (step_kind catches up)
    restored = SNIPController(SNIPConfig(warmup_steps=4, overhead_budget=overhead_budget))
    restored.budget.load_state_dict({**restored.budget.state_dict(), "next_round": 8})
    assert restored.budget.first_round_from(3) == 8 and restored.budget.first_round_from(30) == 30
    caplog.clear()
    with caplog.at_level("WARNING", logger="lightning_snip"):
        restored.set_horizon(32, 30)  # resumed at 30 with a round due at once: its plan applies at 31
        assert "no plan will be made" not in caplog.text
        restored.set_horizon(31, 30)
        assert "round runs at step 30, too late for its plan to apply" in caplog.text
        # a checkpoint saved between a round and its plan's step: the solve restarts at train start, no warning
        caplog.clear()
        restored.restored_pending = (30, 31)
        restored.set_horizon(31, 30)
        assert "no plan will be made" not in caplog.text


def test_snip_added_mid_run_counts_its_schedule_from_its_first_step():
    for overhead_budget in (None, 0.5):
        budget = OverheadBudget(SNIPConfig(warmup_steps=20, interval=10, first_order_steps=4,
                                           overhead_budget=overhead_budget))
        rounds, sampled, now = [], [], 0.0
        for step in range(100, 135):
            budget.step_started(step, now)
            kind = budget.step_kind(step)
            if kind is StepKind.ROUND:
                budget.mark("round")
                rounds.append(step)
                budget.follow(budget.decide(step, 0.01))
            elif kind is StepKind.FIRST_ORDER:
                sampled.append(step)
            now += 1.0
            budget.batch_ended(now)
        assert rounds[0] == 120, overhead_budget
        assert sampled[:budget.num_first_order] == list(range(120 - len(sampled[:4]), 120))[:budget.num_first_order]
        if overhead_budget is None:
            assert rounds == [120, 130] and sampled == [116, 117, 118, 119, 126, 127, 128, 129]


def test_a_schedule_behind_the_run_catches_up_once():
    budget = OverheadBudget(SNIPConfig(warmup_steps=5, interval=10, first_order_steps=2, overhead_budget=None))
    budget.load_state_dict({**budget.state_dict(), "next_round": 5})  # a checkpoint's schedule, resumed at step 40
    assert [budget.step_kind(step) for step in (4, 40, 41)] == [StepKind.FIRST_ORDER, StepKind.ROUND, StepKind.ROUND]
    budget.follow(budget.decide(40, 1.0))
    assert budget.next_round == 50 and budget.step_kind(41) is StepKind.PLAIN  # the missed rounds (15, 25, 35) are not replayed


def test_a_resumed_run_under_the_budget_plans_exactly_as_the_uninterrupted_one(tmp_path):
    cfg = dict(warmup_steps=2, interval=2, first_order_steps=4, overhead_budget=0.3, initial_format="mxfp4",
               granularity="layer")
    full = _snip(**cfg)
    full_seen = _Rounds(full)
    _fit(tmp_path / "full", [_SlowerFrom(_TickClock(full), 9), full, full_seen], max_steps=30)

    first = _snip(**cfg)
    _fit(tmp_path / "first", [_SlowerFrom(_TickClock(first), 9), first, _StopAt(9)], max_steps=30, checkpoint_every=9)
    ckpt = glob.glob(str(tmp_path / "first" / "ckpt" / "*.ckpt"))[0]
    resumed = _snip(**cfg)
    clock = _TickClock(resumed)
    clock.now = 1e6  # another clock: only the differences it measures after the resume count
    resumed_seen = _Rounds(resumed)
    _fit(tmp_path / "resumed", [_SlowerFrom(clock, 9), resumed, resumed_seen], max_steps=30, ckpt_path=ckpt)

    # the budget spaced the rounds beyond the interval, and the resumed run's fell at the same steps
    assert len(full_seen.rounds) >= 3 and any(b - a > 2 for a, b in zip(full_seen.rounds, full_seen.rounds[1:]))
    assert [s for s in full_seen.rounds if s >= 9] == resumed_seen.rounds
    assert full.controller.budget.state_dict()["next_round"] == resumed.controller.budget.state_dict()["next_round"]
    assert resumed.controller.budget.share == pytest.approx(full.controller.budget.share)
    for step, plan in resumed_seen.plans.items():
        assert plan == full_seen.plans[step], step


def test_the_state_of_a_long_run_does_not_grow_with_its_rounds():
    import pickle

    from lightning_snip.controller import HISTORY_ROUNDS, SNIPController
    from lightning_snip.demo.model import TinyLlama

    torch.manual_seed(0)
    model = TinyLlama(LlamaConfig(dim=32, num_layers=1, num_heads=2, num_kv_heads=1, hidden_dim=64))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    controller = SNIPController(SNIPConfig(warmup_steps=0, interval=1, max_rows=16, first_order_steps=0,
                                           overhead_budget=None, granularity="layer"))
    controller.attach(model)
    tokens = torch.randint(0, 256, (2, 9))

    def loss_of(batch):
        logits = model(batch[:, :-1])
        return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))

    sizes = {}
    for step in range(2 * HISTORY_ROUNDS + 8):
        controller.begin_batch(step)
        controller.apply_due(model, step)
        if controller.step_kind(step) is StepKind.ROUND:
            controller.statistics_round(model, tokens, loss_of, step=step, optimizer=optimizer)
        loss = loss_of(tokens)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        controller.end_batch()
        controller.observe_step(model, step, float(loss))
        sizes[step] = len(pickle.dumps(controller.state_dict()))
    controller.close()
    assert controller.num_stats_rounds == 2 * HISTORY_ROUNDS + 8 and len(controller.history) == HISTORY_ROUNDS
    assert controller.history[-1]["step"] == 2 * HISTORY_ROUNDS + 7
    late, later = sizes[HISTORY_ROUNDS + 4], sizes[2 * HISTORY_ROUNDS + 7]
    assert later <= 1.05 * late, (late, later)  # (not the number of rounds: 1.5x more of them)
