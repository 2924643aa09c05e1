"""The plan canary (lightning_snip.canary): each layer's training GEMMs against the round's path, on a layer and on a
real Trainer with faults injected on the training path only (lightning_snip.linear's GEMM; the statistics round's
path untouched). benchmarks/guard_faults.py measures the same faults over 5 seeds with the loss they cost."""

from __future__ import annotations

import math

import lightning.pytorch as pl
import pytest
import torch

import lightning_snip.linear as linear
from lightning_snip.callback import SNIPCallback
from lightning_snip.canary import FLOOR, RATIO, check_layer, check_plan
from lightning_snip.config import SNIPConfig
from lightning_snip.demo.lightning import ByteTextDataModule, DemoLM
from lightning_snip.formats import Format
from lightning_snip.linear import SNIPLinear
from lightning_snip.plan import Granularity

from faults import training_path_fault
from test_callback import SMALL


def _operands(seed=0, rows=128, k=64, m=96):
    g = torch.Generator().manual_seed(seed)
    layer = SNIPLinear(k, m, bias=False)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(m, k, generator=g) / math.sqrt(k))
    return layer, torch.randn(rows, k, generator=g), torch.randn(rows, m, generator=g) * 1e-3


@pytest.mark.parametrize("fmt", [Format.FP8, Format.MXFP8, Format.MXFP4, Format.NVFP4])
def test_a_healthy_training_path_passes_in_every_format_and_its_error_is_the_rounds(fmt):
    layer, x, g = _operands()
    layer.format = fmt
    checks = check_layer(layer, "layer", x, g, torch.Generator().manual_seed(1))
    assert [c.direction for c in checks] == ["forward", "backward"]
    for check in checks:
        assert not check.failed, check
        assert 0 < check.training < 0.5 and check.training <= 1.5 * check.statistics + FLOOR  # the same numerics
    assert layer.weight.grad is None  # the canary's gradients never reach .grad
    layer.format = Format.BF16
    assert check_layer(layer, "layer", x, g, torch.Generator()) == []  # nothing quantized, nothing to check


@pytest.mark.parametrize("kind,direction", [("negated_fp4_gradients", "backward"), ("zeroed_fp4_gradients", "backward"),
                                            ("noisy_fp4_forward", "forward"), ("broken_fp8_forward", "forward")])
def test_each_training_path_fault_fails_its_direction_and_only_it(monkeypatch, kind, direction):
    layer, x, g = _operands()
    layer.format = Format.FP8 if kind == "broken_fp8_forward" else Format.MXFP4
    monkeypatch.setattr(linear, "quantized_matmul", training_path_fault(kind))
    checks = {c.direction: c for c in check_layer(layer, "layer", x, g, torch.Generator().manual_seed(1))}
    assert checks[direction].failed and checks[direction].ratio > RATIO, checks[direction]
    assert not checks["backward" if direction == "forward" else "forward"].failed


def test_a_failure_on_another_rank_puts_the_layer_back_on_every_rank_to_its_format_before_the_plan():
    torch.manual_seed(0)
    model = DemoLM(SMALL)
    from lightning_snip.convert import convert_linears, layer_assignment

    layers = convert_linears(model, initial_format="mxfp4")
    before = {key: Format.FP8 for key in layer_assignment(layers, Granularity.GEMM)}
    tokens = torch.randint(0, 256, (2, 33))
    loss_fn = lambda: model.snip_loss((tokens[:, :-1], tokens[:, 1:]))  # noqa: E731
    names = list(layers)
    verdict = check_plan(model, loss_fn, layers, Granularity.GEMM, before, seed=0)
    assert verdict.restore == {} and verdict.checks and all(not c.failed for c in verdict.checks)

    def other_rank_fails(flags):  # another rank found the second layer's backward broken (on the first reduction)
        flags = flags.clone()
        if other_rank_fails.first:
            flags[2 * 1 + 1] += 1
        other_rank_fails.first = False
        return flags

    other_rank_fails.first = True
    verdict = check_plan(model, loss_fn, layers, Granularity.GEMM, before, seed=0, all_sum=other_rank_fails)
    # the failed direction to its format before the plan, the other direction kept: a plan sets both
    assert verdict.restore == {f"{names[1]}:backward": Format.FP8, f"{names[1]}:forward": Format.MXFP4}


def test_a_fallback_that_fails_too_goes_to_bf16(monkeypatch):
    """FP8 is the format before the plan but its forward is broken as well as the FP4 one: bf16, at once."""
    torch.manual_seed(0)
    model = DemoLM(SMALL)
    from lightning_snip.convert import convert_linears, layer_assignment

    layers = convert_linears(model, initial_format="mxfp4")
    before = {key: Format.FP8 for key in layer_assignment(layers, Granularity.GEMM)}
    real = linear.quantized_matmul
    noisy, broken = training_path_fault("noisy_fp4_forward"), training_path_fault("broken_fp8_forward")
    monkeypatch.setattr(linear, "quantized_matmul",
                        lambda a, b, f, *args, **kw: (noisy if f.is_fp4 else broken if f is Format.FP8 else real)(
                            a, b, f, *args, **kw))
    tokens = torch.randint(0, 256, (2, 33))
    verdict = check_plan(model, lambda: model.snip_loss((tokens[:, :-1], tokens[:, 1:])), layers, Granularity.GEMM,
                         before, seed=0)
    forwards = {key: fmt for key, fmt in verdict.restore.items() if key.endswith(":forward")}
    assert forwards and set(forwards.values()) == {Format.BF16}


def _run(seed, *, kind=None, replan=True, max_steps=40, **kw):
    pl.seed_everything(seed)
    initial = "bf16" if kind == "broken_fp8_forward" else "fp8"
    snip = SNIPCallback(SNIPConfig(warmup_steps=10, interval=20, fp4_fraction=0.6, max_rows=128, overhead_budget=None,
                                   initial_format=initial, replan=replan, **kw))
    real = linear.quantized_matmul

    class Fault(pl.Callback):
        def on_fit_start(self, trainer, pl_module):
            if kind is not None:
                linear.quantized_matmul = training_path_fault(kind)

    trainer = pl.Trainer(max_steps=max_steps, callbacks=[snip, Fault()], accelerator="cpu", logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         val_check_interval=max_steps, limit_val_batches=4)
    try:
        trainer.fit(DemoLM(SMALL), datamodule=ByteTextDataModule(seq_len=32, batch_size=8, val_batches=4, seed=seed))
    finally:
        linear.quantized_matmul = real
    return snip, float(trainer.callback_metrics["val/loss"])


@pytest.mark.parametrize("kind", ["negated_fp4_gradients", "zeroed_fp4_gradients", "noisy_fp4_forward",
                                  "broken_fp8_forward"])
def test_a_training_path_fault_is_put_back_before_the_plans_first_step_on_every_seed(kind):
    for seed in (0, 1):
        snip, loss = _run(seed, kind=kind)
        _, never = _run(seed, kind=kind, replan=False)  # a run that never had the plan
        assert snip.num_plans_applied == 2 and snip.controller.num_canary_reverts > 0, (kind, seed)
        assert abs(loss - never) < 0.05, (kind, seed, loss, never)
        faulty = Format.FP8 if kind == "broken_fp8_forward" else Format.MXFP4
        direction = "backward" if "gradients" in kind else "forward"
        in_force = [layer.format if direction == "forward" else (layer.backward_format or layer.format)
                    for layer in snip.layers.values() if layer.pinned is None]
        assert faulty not in in_force, (kind, seed)  # (after the second plan too: checked again at its switch)


def test_healthy_runs_are_never_put_back():
    for seed in (0, 1, 2):
        snip, _ = _run(seed)
        assert snip.num_plans_applied == 2 and snip.controller.num_canary_reverts == 0
        assert snip.controller.guard.num_reverts == 0
