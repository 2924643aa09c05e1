"""What SNIP puts on the training path between its own steps (issue 61): no host read of a device value but one
batched read of the loss watch's losses every READ_EVERY steps, and no SNIP operator in a backward that samples
nothing (the first-order tap only on sampled steps; nothing at all without replanning)."""

import dataclasses
import sys

import lightning.pytorch as pl
import pytest
import torch

import lightning_snip.linear as linear
from lightning_snip.callback import SNIPCallback
from lightning_snip.formats import Format
from lightning_snip.step_loss import READ_EVERY, StepLosses

from lightning_snip.demo.lightning import ByteTextDataModule, DemoLM

from test_callback import SMALL, _snip

# the ways host code reads a tensor's value (each a device sync on an asynchronous device)
READS = ("item", "cpu", "tolist", "numpy", "__float__", "__bool__", "__int__")


class _Counter(pl.Callback):
    """Per step: the tensor reads made from lightning_snip's own code, the sums over ranks SNIP asked for, and the
    first-order tap's calls. Put it before SNIPCallback: a step's count starts before SNIP's hooks of that step."""

    def __init__(self, snip: SNIPCallback):
        self.snip, self.step = snip, None
        self.reads: dict[int, list[str]] = {}
        self.collectives: dict[int, int] = {}
        self.taps: dict[int, int] = {}

    def on_train_start(self, trainer, pl_module):
        all_sum = self.snip._collective.all_sum

        def counted(values):
            self.collectives[self.step] = self.collectives.get(self.step, 0) + 1
            return all_sum(values)

        self.snip._collective = dataclasses.replace(self.snip._collective, all_sum=counted)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.step = trainer.global_step
        self.reads.setdefault(self.step, [])

    def on_train_end(self, trainer, pl_module):
        self.step = "end"

    def read(self, name):
        if self.step is not None:
            self.reads.setdefault(self.step, []).append(name)

    def tap(self):
        self.taps[self.step] = self.taps.get(self.step, 0) + 1


def _fit(snip, max_steps, before=(), after=()):
    """A demo run with ``before`` callbacks ahead of SNIPCallback's hooks and ``after`` behind them; no logger."""
    pl.seed_everything(0)
    trainer = pl.Trainer(max_steps=max_steps, callbacks=[*before, snip, *after], logger=False, accelerator="cpu",
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         limit_val_batches=0)
    trainer.fit(DemoLM(SMALL), datamodule=ByteTextDataModule(seq_len=32, batch_size=8, val_batches=1))


def _is_key(tensor: torch.Tensor) -> bool:
    """An RNG token or a first-order tap's key (lightning_snip.rng, .linear): CPU int64 names, on the host by design
    (reading one waits for no device)."""
    return tensor.device.type == "cpu" and tensor.dtype == torch.int64 and tensor.numel() <= 2


@pytest.fixture
def counter_patches(monkeypatch):
    """Count every tensor read whose caller is lightning_snip's code (not Lightning's, not the model's)."""
    holder = {}

    def patch(name):
        original = getattr(torch.Tensor, name)

        def wrapper(self, *args, **kwargs):
            caller = sys._getframe(1).f_globals.get("__name__", "")
            if holder.get("counter") is not None and caller.startswith("lightning_snip") and not _is_key(self) \
                    and not caller.startswith("lightning_snip.demo"):  # (the demo is the user's model and data)
                holder["counter"].read(name)
            return original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, wrapper)

    for name in READS:
        patch(name)
    tap = linear.first_order_tap

    def counted_tap(*args):
        if holder.get("counter") is not None:
            holder["counter"].tap()
        return tap(*args)

    monkeypatch.setattr(linear, "first_order_tap", counted_tap)
    return holder


def test_no_host_read_outside_snips_steps_and_one_batched_read_every_read_every_steps(counter_patches):
    # rounds at 10 and 30 (2 sampled steps before each), plans at 11 and 31 (each watched, its gradients checked
    # for 16 steps after it), the plan canary at 10, 11, 30, 31
    snip = SNIPCallback(_snip(warmup_steps=10, interval=20, first_order_steps=2))
    counter = counter_patches["counter"] = _Counter(snip)
    _fit(snip, 40, before=[counter])
    counter_patches["counter"] = None
    assert snip.num_plans_applied == 2 and snip.controller.guard.num_watched == 2
    snips_steps = {8, 9, 10, 11, 28, 29, 30, 31}
    # where the pending losses are read: READ_EVERY closed since the last read, and before each of SNIP's steps
    expected, pending = set(), 0
    for step in range(40):
        if step in snips_steps:
            pending = 0
        pending += 1
        if pending == READ_EVERY:
            expected.add(step)
            pending = 0
    plain = [s for s in range(40) if s not in snips_steps]
    assert {s for s in plain if counter.reads[s]} == {s for s in plain if s in expected} and expected - snips_steps
    for step in plain:
        if step in expected:  # one sum over ranks, read in one copy (.cpu() in the Collective, .tolist() of its result)
            assert counter.collectives.get(step) == 1 and sorted(counter.reads[step]) == ["cpu", "tolist"], step
        else:
            assert counter.reads[step] == [] and counter.collectives.get(step, 0) == 0, step
    # the steps' losses all reached the watch: the last ones at the end of training
    assert counter.collectives.get("end") == 1 and len(snip.controller.guard.losses) == 32
    # the first-order tap ran in the sampled steps' backward alone: once per unpinned layer and step
    unpinned = sum(layer.pinned is None for layer in snip.layers.values())
    assert counter.taps == {8: unpinned, 9: unpinned, 28: unpinned, 29: unpinned}


def test_without_replanning_nothing_is_added_to_the_backward_and_bf16_layers_keep_f_linear(counter_patches,
                                                                                           monkeypatch):
    calls = []
    apply = linear._SNIPLinearFunction.apply
    monkeypatch.setattr(linear._SNIPLinearFunction, "apply", lambda *a: calls.append(a[3]) or apply(*a))
    snip = SNIPCallback(_snip(replan=False, initial_format="bf16"))
    counter = counter_patches["counter"] = _Counter(snip)
    _fit(snip, 6, before=[counter])
    counter_patches["counter"] = None
    assert all(layer.first_order_tap is None for layer in snip.layers.values())
    assert counter.taps == {} and calls == []  # every layer in bf16: F.linear, no autograd function
    assert all(reads == [] for reads in counter.reads.values()) and counter.collectives == {}


def test_step_losses_are_read_in_order_with_their_gradients_flags_and_restored_from_a_checkpoint():
    losses = StepLosses(read_every=3)
    module = torch.nn.Linear(2, 2)
    for step in range(3):
        losses.begin(step)
        module.weight.grad = torch.full((2, 2), float("nan") if step == 1 else 1.0)
        losses.check_gradients(module)
        if step == 1:  # zeroed in place, on the device
            assert torch.equal(module.weight.grad, torch.zeros(2, 2))
        assert not losses.end({"loss": torch.tensor(float(step))}, global_step=step) and not losses.full
        assert losses.end({"loss": torch.tensor(0.5)}, global_step=step + 1)  # a second micro-batch: the step closes
    assert losses.full
    sums = []
    read = losses.read(lambda values: sums.append(values.clone()) or values * 2, world_size=2)  # two equal ranks
    assert len(sums) == 1 and read == [(0, 0.5, True), (1, 1.5, False), (2, 2.5, True)] and losses.pending == []
    losses.begin(3)
    losses.end(torch.tensor(4.0), global_step=4)
    state = StepLosses()
    state.load_state_dict(losses.state_dict())
    assert state.read(lambda v: v, world_size=1) == [(3, 4.0, True)]


def test_a_reverts_lag_is_at_most_read_every_minus_one_steps(monkeypatch):
    """A plan that breaks the loss after its switch (not at it: the switch's cost and the canary see nothing) is
    reverted at the read that first holds the rise: at most READ_EVERY - 1 steps after a per-step read would."""
    reverted = {}

    class _BreakLater(pl.Callback):  # (after SNIPCallback: its batch end sees the step's revert)
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            reverted["broken"] = trainer.global_step >= 16

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if snip.controller.guard.num_reverts and "at" not in reverted:
                reverted["at"] = trainer.global_step - 1

    forward = linear.SNIPLinear.forward

    def faulty(self, x):
        y = forward(self, x)
        fp4 = self.format in (Format.MXFP4, Format.NVFP4)
        return y + torch.randn_like(y) * 10 * y.std() if reverted.get("broken") and fp4 else y

    snip = SNIPCallback(_snip(warmup_steps=10, interval=100, plan_canary=False, spike_threshold=6.0))
    alarm = snip.controller.guard._revert
    monkeypatch.setattr(snip.controller.guard, "_revert", lambda step, reason: reverted.setdefault("alarm", step)
                        and alarm(step, reason))
    monkeypatch.setattr(linear.SNIPLinear, "forward", faulty)
    _fit(snip, 40, after=[_BreakLater()])
    assert snip.num_plans_applied == 1 and snip.controller.guard.num_reverts == 1
    assert 16 <= reverted["alarm"] <= reverted["at"] <= reverted["alarm"] + READ_EVERY - 1, reverted
