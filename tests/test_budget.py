"""The overhead budget (lightning_snip.budget): SNIP's time accounted from step times, the schedule that keeps its
share within the budget, and the controller and callback that feed it."""

from __future__ import annotations

import glob
import math

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from lightning_snip.budget import APPLY_DELAY, FIRST_SAMPLE_STEPS, OverheadBudget, StepKind
from lightning_snip.callback import SNIPCallback
from lightning_snip.config import SNIPConfig
from lightning_snip.controller import Collective, SNIPController

STEP, ROUND, SAMPLE, SWITCH = 1.0, 4.0, 0.25, 0.5  # seconds: a plain step, and what SNIP's work adds to one


def _simulate(budget: OverheadBudget, num_steps: int, *, round_cost=ROUND, sample_cost=SAMPLE, switch_cost=SWITCH,
              first_step=STEP, agreements=None) -> list[int]:
    """Drive ``budget`` as the controller does, on a clock where each kind of work adds its cost to a step; the
    steps that ran a round. ``agreements``: what each plan after the first keeps of the one before (then 1.0;
    None: plans are not compared)."""
    now, rounds, apply_at, plans = 0.0, [], None, 0
    agreements = iter(agreements) if agreements is not None else None
    for step in range(num_steps):
        budget.step_started(step, now)
        seconds = first_step if step == 0 else STEP
        if apply_at == step:
            budget.mark("switch")
            seconds += switch_cost
            plans += 1
            if plans > 1 and agreements is not None:
                budget.plan_applied(step, next(agreements, 1.0))
        kind = budget.step_kind(step)
        if kind is StepKind.ROUND:
            budget.mark("round")
            rounds.append(step)
            seconds += round_cost
            budget.follow(budget.decide(step, round_cost))
            apply_at = step + APPLY_DELAY
        elif kind is StepKind.FIRST_ORDER:
            budget.mark("first_order")
            seconds += sample_cost
        now += seconds
        budget.batch_ended(now)
    budget.step_started(num_steps, now)  # (closes the last step)
    return rounds


def test_steps_snip_worked_in_cost_their_excess_over_the_recent_plain_steps():
    budget = OverheadBudget(SNIPConfig(warmup_steps=20, interval=10, first_order_steps=4, overhead_budget=None))
    rounds = _simulate(budget, 35)
    assert rounds == [20, 30]
    # 4 sampled steps before each round (16-19, 26-29), a round at 20 and 30, a switch at 21 and 31
    assert budget.snip_seconds == pytest.approx({"round": 2 * ROUND, "first_order": 8 * SAMPLE, "switch": 2 * SWITCH})
    assert budget.train_seconds == pytest.approx(35 * STEP)
    assert budget.share == pytest.approx((2 * ROUND + 8 * SAMPLE + 2 * SWITCH) / 35)
    assert budget.costs == pytest.approx({"round": ROUND, "first_order": SAMPLE, "switch": SWITCH})


def test_without_a_budget_rounds_come_every_interval_as_before():
    cfg = SNIPConfig(warmup_steps=5, interval=7, first_order_steps=3, overhead_budget=None)
    budget = OverheadBudget(cfg)
    sampled = []
    step_kind = budget.step_kind
    budget.step_kind = lambda step: (kind := step_kind(step), kind is StepKind.FIRST_ORDER and sampled.append(step))[0]
    assert _simulate(budget, 60) == [5, 12, 19, 26, 33, 40, 47, 54]
    assert sampled == [s for r in (5, 12, 19, 26, 33, 40, 47, 54, 61) for s in range(r - 3, r) if s < 60]


def test_the_next_round_comes_as_late_as_the_budget_requires():
    cfg = SNIPConfig(warmup_steps=20, interval=10, first_order_steps=32, overhead_budget=0.02)
    budget = OverheadBudget(cfg)
    assert budget.num_first_order == FIRST_SAMPLE_STEPS  # nothing timed yet: a small first sample
    rounds = _simulate(budget, 21)
    assert rounds == [20]
    # The rule by hand: the next cycle costs a round, a switch and a sample of at most a round's time
    # (32 steps, capped at ROUND / SAMPLE = 16); the spent seconds are the first sample's and this round's.
    num = min(32, int(ROUND / SAMPLE))
    assert budget.num_first_order == num
    spent = FIRST_SAMPLE_STEPS * SAMPLE + ROUND
    cycle = ROUND + 0 + num * SAMPLE  # (no switch timed yet)
    train = 20 * STEP
    assert budget.next_round == 20 + math.ceil((spent + cycle - 0.02 * train) / (0.02 * STEP))


def test_over_a_long_run_the_measured_share_stays_within_the_budget():
    cfg = SNIPConfig(warmup_steps=50, interval=100, first_order_steps=32, overhead_budget=0.02)
    budget = OverheadBudget(cfg)
    rounds = _simulate(budget, 20_000)
    assert rounds[0] == 50 and len(rounds) >= 10
    assert all(b - a >= 100 for a, b in zip(rounds, rounds[1:]))
    assert 0.015 < budget.share <= 0.02 * 1.02  # spent, not left unused: close to the budget from below
    # A budget 4x larger buys rounds about 4x as often.
    more = OverheadBudget(SNIPConfig(warmup_steps=50, interval=100, first_order_steps=32, overhead_budget=0.08))
    assert len(_simulate(more, 20_000)) > 3 * len(rounds)


def test_the_interval_is_the_shortest_spacing_when_snip_is_cheap():
    budget = OverheadBudget(SNIPConfig(warmup_steps=10, interval=25, first_order_steps=4, overhead_budget=0.5))
    assert _simulate(budget, 200) == list(range(10, 200, 25))


def test_no_round_is_scheduled_whose_plan_would_come_after_the_run():
    budget = OverheadBudget(SNIPConfig(warmup_steps=20, interval=10, first_order_steps=8, overhead_budget=0.02))
    budget.set_horizon(400)
    rounds = _simulate(budget, 400)
    assert rounds == [20] and budget.next_round is None
    assert not any(budget.step_kind(s) is StepKind.FIRST_ORDER for s in range(400))  # nor samples for it
    assert budget.share <= 0.02  # the first cycle's cost amortized over the whole run


def test_the_schedule_survives_a_checkpoint():
    cfg = SNIPConfig(warmup_steps=20, interval=10, first_order_steps=8, overhead_budget=0.02)
    budget = OverheadBudget(cfg)
    _simulate(budget, 25)
    restored = OverheadBudget(cfg)
    restored.load_state_dict(budget.state_dict())
    assert (restored.next_round, restored.num_first_order) == (budget.next_round, budget.num_first_order)
    assert restored.share == pytest.approx(budget.share) and restored.costs == budget.costs


@pytest.mark.parametrize("value", [0, 1, 1.5, -0.1, True, float("nan")])
def test_a_bad_overhead_budget_names_the_field(value):
    with pytest.raises(ValueError, match=r"overhead_budget: invalid value .*allowed: a number in \(0, 1\)"):
        SNIPConfig(overhead_budget=value)


def test_every_rank_follows_rank_zeros_schedule():
    """Rank 1 times its own steps, but the round's decision it follows is the one rank 0 broadcast."""
    from lightning_snip.demo.model import LlamaConfig, TinyLlama

    torch.manual_seed(0)
    model = TinyLlama(LlamaConfig(dim=32, num_layers=1, num_heads=2, num_kv_heads=1, hidden_dim=64))
    controller = SNIPController(SNIPConfig(warmup_steps=2, interval=3, max_rows=32, first_order_steps=1, overhead_budget=0.02))
    controller.attach(model)
    rank_one = Collective(rank=1, world_size=1, broadcast=lambda obj: (123, 5, 2, 121))  # rank 0's answer
    tokens = torch.randint(0, 256, (2, 17))

    def loss_of(batch):
        logits = model(batch[:, :-1])
        return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))

    for step in range(3):
        controller.begin_batch(step)
        if controller.step_kind(step) is StepKind.ROUND:
            controller.statistics_round(model, tokens, loss_of, step=step, collective=rank_one)
        controller.end_batch()
    assert (controller.budget.next_round, controller.budget.num_first_order) == (123, 5)
    assert [controller.step_kind(step) for step in (123, 118, 117)] == [StepKind.ROUND, StepKind.FIRST_ORDER, StepKind.PLAIN]
    controller.close()


def test_a_budgeted_run_logs_its_overhead_and_stops_rounds_at_its_horizon(tmp_path):
    from test_callback import _fit, _snip

    snip = SNIPCallback(_snip(overhead_budget=0.02, warmup_steps=3, interval=2, first_order_steps=2))
    _fit(tmp_path, snip, max_steps=12)
    # A round costs several of these small steps: at 2%, the next one would come after the run's 12 steps.
    assert snip.num_stats_rounds == 1 and snip.num_plans_applied == 1
    assert snip.controller.budget.next_round is None
    assert 0 < snip.controller.overhead == snip.controller.budget.share
    events = EventAccumulator(glob.glob(str(tmp_path / "tb" / "*"))[0]).Reload()
    overhead = events.Scalars("snip/overhead")
    # The sample (step 2), the round (3) and the switch (4) are priced once 3 plain steps are timed (0, 1, 5): logged
    # at step 6, when step 5 closes; then once at the end, with the round in it.
    assert [e.step for e in overhead] == [6, 12]
    assert overhead[-1].value == pytest.approx(snip.controller.overhead) and overhead[0].value > 0
    state = snip.state_dict()["schedule"]
    assert state["next_round"] is None and state["train_seconds"] > 0 and state["costs"]["round"] > 0


def test_steady_plans_space_the_rounds_out_and_a_changed_plan_brings_them_back():
    """The budget's spacing here is the interval (25); plans keeping >= 0.9 double it (up to 8x), one keeping
    < 0.75 resets it, one in between keeps it; a reverted plan resets it."""
    cfg = SNIPConfig(warmup_steps=10, interval=25, first_order_steps=4, overhead_budget=0.5)
    budget = OverheadBudget(cfg)
    rounds = _simulate(budget, 1100, agreements=[1.0, 1.0, 1.0, 0.5, 0.8, 0.95, 1.0, 1.0, 1.0, 1.0])
    # first plan at 11 (no evidence); 36: x2 -> 85; 86: x4 -> 185; 186: x8 -> 385; 386 (0.5): x1 -> 410;
    # 411 (0.8): kept -> 435; 436: x2 -> 485; 486: x4 -> 585; 586: x8 -> 785; then x8 (capped): 985
    assert rounds == [10, 35, 85, 185, 385, 410, 435, 485, 585, 785, 985]
    assert budget.stretch == 8
    budget.plan_reverted(990)  # a revert: the budget's spacing, its sample still ahead
    assert budget.stretch == 1 and budget.next_round == 1010
    restored = OverheadBudget(cfg)
    restored.load_state_dict(budget.state_dict())
    assert (restored.stretch, restored.next_round) == (1, 1010)
    restored.plan_applied(991, 1.0)
    assert restored.next_round == 985 + 2 * 25  # stretched from the same round
    # a stretch past the run's end: no round left
    budget.set_horizon(1030)
    budget.plan_applied(991, 1.0)
    assert budget.next_round is None
    # without a budget the schedule stays fixed whatever the plans do
    fixed = OverheadBudget(SNIPConfig(warmup_steps=10, interval=25, first_order_steps=4, overhead_budget=None))
    assert _simulate(fixed, 200, agreements=[1.0] * 10) == list(range(10, 200, 25))


def test_a_revert_during_a_started_sample_keeps_its_round_and_a_new_horizon_reschedules():
    cfg = SNIPConfig(warmup_steps=10, interval=25, first_order_steps=4, overhead_budget=0.5)
    budget = OverheadBudget(cfg)
    assert _simulate(budget, 80, agreements=[1.0]) == [10, 35]  # stretch 2 at 36: the next round at 85
    assert (budget.next_round, budget.num_first_order, budget.stretch) == (85, 4, 2)
    budget.plan_reverted(82)  # its sample (81-84) has begun: the round stays where it is, not later
    assert budget.next_round == 85 and budget.stretch == 1
    budget.plan_applied(83, 1.0)  # nor does a steady plan move it once its sample runs
    assert budget.next_round == 85 and budget.stretch == 2
    # a horizon that cut a stretched round, then a resumed run with a longer one: the round comes back
    cut = OverheadBudget(cfg)
    _simulate(cut, 40, agreements=[1.0])
    cut.set_horizon(60, 40)
    assert cut.next_round is None
    resumed = OverheadBudget(cfg)
    resumed.load_state_dict(cut.state_dict())
    resumed.set_horizon(1000, 40)
    assert resumed.next_round == 85


def test_a_trainer_run_whose_plans_hold_stretches_its_rounds(tmp_path, monkeypatch):
    """Through the callback: every solve returns the same plan, so each plan after the first keeps all of its
    formats; the round after the second plan comes twice the budget's spacing after the round before, the one
    after the third four times, and TensorBoard says so."""
    from test_callback import _fit, _snip

    import lightning_snip.pending_solve as pending_solve

    real, first = pending_solve.solve_guarded, []
    monkeypatch.setattr(pending_solve, "solve_guarded",
                        lambda *a, **k: first[0] if first else first.append(real(*a, **k)) or first[0])
    decisions = []
    decide = OverheadBudget.decide
    monkeypatch.setattr(OverheadBudget, "decide", lambda self, *a: decisions.append(decide(self, *a)) or decisions[-1])
    snip = SNIPCallback(_snip(overhead_budget=0.9, warmup_steps=2, interval=2, first_order_steps=1))
    _fit(tmp_path, snip, max_steps=60)
    rounds = [h["step"] for h in snip.controller.history]
    assert len(rounds) >= 3
    # (next round, sample steps, round step, the budget's gap) per round; plans apply one step after their round
    assert rounds[1] == decisions[0][0] == rounds[0] + decisions[0][3]  # the first plan: no evidence yet
    assert rounds[2] == rounds[1] + 2 * decisions[1][3]  # the second kept every format: twice the spacing
    assert snip.controller.budget.stretch >= 4
    events = EventAccumulator(glob.glob(str(tmp_path / "tb" / "*"))[0]).Reload()
    stretch = [(e.step, e.value) for e in events.Scalars("snip/round_stretch")]
    assert stretch[:3] == [(rounds[0] + 1, 1.0), (rounds[1] + 1, 2.0), (rounds[2] + 1, 4.0)]


def test_work_before_any_plain_step_is_priced_once_one_comes():
    # warmup 0: step 0 is the round, 1 the switch, 2 the first plain step
    budget = OverheadBudget(SNIPConfig(warmup_steps=0, interval=50, first_order_steps=32, overhead_budget=0.02))
    _simulate(budget, 10)
    assert budget.snip_seconds == pytest.approx({"round": ROUND, "first_order": 0, "switch": SWITCH})
    assert budget.train_seconds == pytest.approx(10 * STEP)


def test_the_first_step_which_compiles_is_no_measure_of_a_step():
    # A first step 30x longer (compiles, allocates) must not make the steps SNIP worked in look cheap (a median of
    # few steps that included it came out above them: a negative share on a real Trainer, 2026-12-04).
    budget = OverheadBudget(SNIPConfig(warmup_steps=4, interval=10, first_order_steps=4, overhead_budget=0.02))
    assert _simulate(budget, 12, first_step=30 * STEP) == [4]
    assert budget.snip_seconds == pytest.approx({"round": ROUND, "first_order": 2 * SAMPLE, "switch": SWITCH})
    assert budget.train_seconds == pytest.approx(11 * STEP + 30 * STEP)
    assert budget.next_round is not None and budget.next_round > 4 + 10  # priced with the short steps


def test_the_budget_on_a_hugging_face_llama_under_bf16_mixed_and_accumulation(tmp_path):
    """Where users train: a module we did not write, bf16-mixed, 2 micro-batches per step. A step is timed over
    both micro-batches (one close per optimizer step), the share is positive, and the horizon stops rounds."""
    pytest.importorskip("transformers")
    from test_callback import _fit, _snip
    from test_training_setups import _HFLlamaLM

    snip = SNIPCallback(_snip(pins={"*lm_head": "bf16"}, granularity="gemm", fp4_fraction=0.3,
                              overhead_budget=0.02, warmup_steps=4, interval=2, first_order_steps=2))
    closed = []
    real_close = OverheadBudget._close
    snip.controller.budget._close = lambda seconds: (closed.append(seconds), real_close(snip.controller.budget, seconds))
    _fit(tmp_path, snip, module=_HFLlamaLM(), precision="bf16-mixed", accumulate_grad_batches=2, max_steps=10)
    assert len(closed) == 9  # steps 0-8 closed by the next step's start (the last one never is)
    assert snip.num_stats_rounds == 1 and snip.num_plans_applied == 1
    assert snip.controller.budget.next_round is None and snip.controller.overhead > 0


def test_a_switch_marked_for_the_next_step_is_priced_there():
    """A revert happens at a step's end: its cost (a recompile) falls in the next step's forward."""
    budget = OverheadBudget(SNIPConfig(warmup_steps=100, interval=10, overhead_budget=0.02))
    now = 0.0
    for step, seconds in enumerate([STEP] * 4 + [STEP, STEP + SWITCH, STEP]):
        budget.step_started(step, now)
        if step == 4:
            budget.mark("switch", next_step=True)
        now += seconds
        budget.batch_ended(now)
    budget.step_started(7, now)
    assert budget.snip_seconds["switch"] == pytest.approx(SWITCH) and budget.train_seconds == pytest.approx(7 * STEP)


def test_the_step_kind_has_one_home_and_a_round_runs_once_per_step():
    """The schedule's StepKind: the first-order sample on the steps before a round, the round on its step's first
    micro-batch only (round_started), nothing else."""
    budget = OverheadBudget(SNIPConfig(warmup_steps=3, interval=4, first_order_steps=2, overhead_budget=None))
    assert [budget.step_kind(step) for step in range(4)] == [StepKind.PLAIN, StepKind.FIRST_ORDER,
                                                              StepKind.FIRST_ORDER, StepKind.ROUND]
    budget.round_started(3)
    assert budget.step_kind(3) is StepKind.PLAIN  # the step's later micro-batches
    budget.follow(budget.decide(3, 0.1))
    assert [budget.step_kind(step) for step in range(4, 8)] == [StepKind.PLAIN, StepKind.FIRST_ORDER,
                                                                 StepKind.FIRST_ORDER, StepKind.ROUND]
    assert OverheadBudget(SNIPConfig(replan=False)).step_kind(10) is StepKind.PLAIN
