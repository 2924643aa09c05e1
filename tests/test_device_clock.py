"""SNIP's clock on an asynchronous device (lightning_snip.device_clock): stamps that resolve late give the budget the
same times, decisions and state as a clock read at once; the host clock on such a device does not."""

from __future__ import annotations

import pytest
import torch

from lightning_snip.budget import APPLY_DELAY, OverheadBudget, StepKind
from lightning_snip.config import SNIPConfig
from lightning_snip.controller import SNIPController
from lightning_snip.device_clock import Timeline

from test_budget import ROUND, SAMPLE, STEP, SWITCH, _simulate

LAUNCH = 0.05  # host seconds to launch a step's kernels: the host runs ahead of the device


class _Device:
    """A stream whose work finishes ``lag`` seconds of work behind what the host has launched (a round's host sync
    waits for it all); a stamp is the device time at which the stream reaches it, ready once the device has."""

    def __init__(self, lag: float) -> None:
        self.lag, self.launched, self.reached, self.host = lag, 0.0, 0.0, 0.0
        self.late = 0  # stamps asked for before the device had reached them
        self.phase = "plain"  # what the host is doing (set by the simulation): "plain", "round" or "end"
        self.waits: list[str] = []  # the phase of every host wait on a stamp

    def launch(self, seconds: float) -> None:
        self.launched += seconds
        self.host = max(self.host + LAUNCH, self.launched - self.lag)  # (a full launch queue blocks the host)
        self.reached = max(self.reached, self.launched - self.lag)

    def synchronize(self) -> None:
        self.host = max(self.host, self.launched)  # the host waits for the queued work
        self.reached = self.launched

    def stamp(self) -> _Stamp:
        return _Stamp(self, self.launched)


class _Stamp:
    def __init__(self, device: _Device, at: float) -> None:
        self.device, self.at = device, at

    def ready(self) -> bool:
        ready = self.device.reached >= self.at
        self.device.late += not ready
        return ready

    def wait(self) -> None:
        self.device.waits.append(self.device.phase)
        self.device.reached = max(self.device.reached, self.at)

    def seconds(self) -> float:
        assert self.device.reached >= self.at, "a stamp read before the device got there (a CUDA event cannot be)"
        return self.at


def _simulate_on_device(timeline: Timeline, device: _Device, num_steps: int, first_step: int = 0
                        ) -> tuple[list[int], list[float]]:
    """_simulate's steps as the controller feeds them on a GPU: the work is launched, the stamps resolve late, a round
    synchronises (its reduction reads the host). Returns the round steps and the round seconds the budget decided on."""
    budget, rounds, seconds_seen, apply_at = timeline.budget, [], [], None
    for step in range(first_step, first_step + num_steps):
        timeline.step_started(step)
        device.launch(STEP)
        if apply_at == step:
            timeline.mark("switch")
            device.launch(SWITCH)
        kind = budget.step_kind(step)
        if kind is StepKind.ROUND:
            device.phase = "round"
            timeline.mark("round")
            start = timeline.stamp()
            device.launch(ROUND)
            device.synchronize()
            seconds = timeline.seconds_since(start)
            device.phase = "plain"
            seconds_seen.append(seconds)
            rounds.append(step)
            budget.follow(budget.decide(step, seconds))
            apply_at = step + APPLY_DELAY
        elif kind is StepKind.FIRST_ORDER:
            timeline.mark("first_order")
            device.launch(SAMPLE)
        timeline.batch_ended()
    timeline.step_started(first_step + num_steps)
    device.phase = "end"
    timeline.flush(wait=True)
    return rounds, seconds_seen


@pytest.mark.parametrize("budget_share", [None, 0.1])
def test_stamps_resolving_late_give_the_budget_what_a_clock_read_at_once_gives(budget_share):
    cfg = SNIPConfig(warmup_steps=20, interval=10, first_order_steps=4, overhead_budget=budget_share)
    at_once = OverheadBudget(cfg)
    expected_rounds = _simulate(at_once, 300)
    late = Timeline(OverheadBudget(cfg))
    device = _Device(lag=3 * STEP)
    late.stamps = device.stamp
    rounds, seconds = _simulate_on_device(late, device, 300)
    assert device.late > 100  # the stamps did resolve late: most calls waited in the timeline's queue
    assert rounds == expected_rounds and len(rounds) >= 3
    assert seconds == pytest.approx([ROUND] * len(rounds))  # the round alone, not the training work queued before it
    assert late.pending == 0
    _same_state(late.budget, at_once)


def test_a_run_joined_mid_way_counts_its_schedule_from_its_first_step_though_its_stamps_resolve_late():
    """SNIP added at step 100 (or resumed from a checkpoint without its state): the first round comes warmup_steps
    later, as with a clock read at once, although the step's time is still on the device when the round is checked."""
    cfg = SNIPConfig(warmup_steps=20, interval=10, first_order_steps=4, overhead_budget=None)
    late = Timeline(OverheadBudget(cfg))
    device = _Device(lag=3 * STEP)
    device.launched = 3 * STEP  # the steps before SNIP's first are still running on the device
    late.stamps = device.stamp
    rounds, _ = _simulate_on_device(late, device, 40, first_step=100)
    assert rounds == [120, 130]


def _same_state(a: OverheadBudget, b: OverheadBudget) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for key in sa:
        if isinstance(sa[key], (float, dict, list)) and key != "open_step":
            assert sa[key] == pytest.approx(sb[key]), key
        else:
            assert sa[key] == sb[key], key


def test_the_host_clock_on_an_asynchronous_device_counts_queued_training_work_as_snips():
    """What the device timeline is for: timed on the host, a sampled step counts its launches and a round's sync counts
    the steps queued before it as the round's."""
    cfg = SNIPConfig(warmup_steps=20, interval=10, first_order_steps=4, overhead_budget=None)
    timeline = Timeline(OverheadBudget(cfg))
    device = _Device(lag=3 * STEP)
    timeline.clock = lambda: device.host  # (stamps = None: the host clock, as on a CPU)
    _, seconds = _simulate_on_device(timeline, device, 60)
    assert seconds[0] == pytest.approx(ROUND + 3 * STEP, abs=0.5)  # not the round's ROUND
    assert timeline.budget.snip_seconds["round"] > 2 * ROUND + 4 * STEP


def test_the_controller_logs_its_overhead_when_it_prices_more_work_and_at_the_end():
    controller = SNIPController(SNIPConfig(warmup_steps=2, interval=100, overhead_budget=None))
    ticks = iter(range(1000))
    controller.timeline.clock = lambda: float(next(ticks))
    logged = []
    for step in range(8):
        controller.timeline.step_started(step)  # (begin_batch without the stochastic rounding a model would need)
        logged.append(controller.overhead_update())
        if step == 4:
            controller.timeline.mark("switch")
            next(ticks)  # the switch's second
        controller.end_batch()
    # plain steps change training's seconds, not SNIP's: nothing to log until step 4's work is priced at step 5
    assert [i for i, value in enumerate(logged) if value is not None] == [5]
    assert logged[5]["snip/overhead"] == pytest.approx(1.0 / 5)
    assert controller.overhead_update() is None  # nothing new
    # at the end, the steps closed so far (the last one, 7, stays open): 1 s of SNIP's over 7 s of training's
    assert controller.overhead_update(final=True) == {"snip/overhead": pytest.approx(1.0 / 7)}


@pytest.mark.parametrize("budget_share", [None, 0.1])
def test_the_clock_waits_for_the_device_only_in_a_round_and_at_the_end(budget_share):
    """No host wait on a stamp in a plain or sampled step (a wait drains the launch queue: issue 61); a round waits
    for the stamps up to its end (it has synchronised already), the end of training for the rest."""
    cfg = SNIPConfig(warmup_steps=20, interval=10, first_order_steps=4, overhead_budget=budget_share)
    timeline, device = Timeline(OverheadBudget(cfg)), _Device(lag=3 * STEP)
    timeline.stamps = device.stamp
    rounds, _ = _simulate_on_device(timeline, device, 300)
    assert len(rounds) >= 3 and device.late > 100
    assert set(device.waits) <= {"round", "end"} and device.waits.count("round") >= len(rounds)


def test_cuda_stamps_are_recorded_on_the_model_devices_stream(monkeypatch):
    """A model on cuda:1 while the host's current device is cuda:0 (a process that set no device): its stamps are
    events on cuda:1's current stream, not on the current device's."""
    recorded = []

    class FakeEvent:
        def __init__(self, enable_timing: bool) -> None:
            assert enable_timing

        def record(self, stream=None) -> None:
            recorded.append(stream)

    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: f"stream of {device}")
    timeline = Timeline(OverheadBudget(SNIPConfig()))
    timeline.use_device("cuda:1")
    timeline.stamp()
    timeline.stamp()
    assert recorded == ["stream of cuda:1"] * 2
    timeline.use_device("cpu")
    assert isinstance(timeline.stamp(), float) and len(recorded) == 2  # the host clock on a CPU


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA events need a GPU")
def test_cuda_events_time_the_device_work_between_stamps():
    timeline = Timeline(OverheadBudget(SNIPConfig()))
    timeline.use_device("cuda")
    a = torch.randn(4096, 4096, device="cuda")
    start = timeline.stamp()
    for _ in range(20):
        a = a @ a / 64
    assert timeline.seconds_since(start) > 0
