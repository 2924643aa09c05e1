"""SNIP across fits and checkpoints as users meet them (a fresh-eyes review, 2026-12-07): a callback reused on another
model starts afresh, a checkpoint written after fit keeps a solve still running, and a checkpoint's plan that this
run's pins or formats contradict is fitted to them with a warning instead of ending the run."""

from __future__ import annotations

import glob
import logging

import lightning.pytorch as pl
import pytest
import torch

from lightning_snip.demo.lightning import DemoLM
from lightning_snip.formats import Format

from test_callback import _FixedBatches
from test_resume_schedule import SMALL, _fit, _Rounds, _snip


@pytest.fixture(autouse=True)
def _threads():
    torch.set_num_threads(1)


def _trainer(root, callbacks, max_steps):
    return pl.Trainer(max_steps=max_steps, default_root_dir=root, logger=False, callbacks=list(callbacks),
                      enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0, accelerator="cpu",
                      enable_checkpointing=False)


def test_a_callback_reused_on_another_model_starts_afresh(tmp_path, caplog):
    snip = _snip(overhead_budget=None)
    _fit(tmp_path / "one", [snip], max_steps=10)
    assert snip.num_plans_applied == 2 and [h["step"] for h in snip.history] == [4, 8]
    seen = _Rounds(snip)
    with caplog.at_level(logging.INFO, logger="lightning_snip"):
        _fit(tmp_path / "two", [snip, seen], max_steps=10)  # (a new DemoLM)
    assert "a fit on a new model; the state this callback held from its last fit" in caplog.text
    assert "applied the plan held at train start" not in caplog.text  # (the other model's plan)
    assert seen.rounds == [4, 8] and [h["step"] for h in snip.history] == [4, 8] and snip.num_plans_applied == 2


def test_a_second_fit_on_the_same_model_goes_on_from_its_plan(tmp_path, caplog):
    snip = _snip(overhead_budget=None)
    model = DemoLM(SMALL)
    _trainer(tmp_path, [snip], 6).fit(model, datamodule=_FixedBatches())
    plan = dict(snip.plan)
    with caplog.at_level(logging.INFO, logger="lightning_snip"):
        _trainer(tmp_path, [snip], 2).fit(model, datamodule=_FixedBatches())
    assert "a fit on a new model" not in caplog.text
    assert "applied the plan held at train start (15 layers)" in caplog.text and dict(snip.plan) == plan


def test_a_checkpoint_written_after_fit_keeps_the_solve_still_running(tmp_path):
    """A round at step 4 whose plan applies at step 5, in a fit of 5 steps: the solve is pending when the fit ends and
    the checkpoint written then (the app's last.ckpt) holds it; the resumed run applies the plan the uninterrupted
    run applies at step 5."""
    full = _snip(overhead_budget=None)
    full_seen = _Rounds(full)
    _fit(tmp_path / "full", [full, full_seen], max_steps=7)
    first = _snip(overhead_budget=None)
    trainer = _fit(tmp_path / "first", [first], max_steps=5)
    assert first.num_plans_applied == 0 and first.num_stats_rounds == 1
    trainer.save_checkpoint(tmp_path / "end.ckpt")
    state = torch.load(tmp_path / "end.ckpt", weights_only=False)["callbacks"]
    assert next(iter(state.values()))["pending"] == [4, 5]
    resumed = _snip(overhead_budget=None)
    resumed_seen = _Rounds(resumed)
    _fit(tmp_path / "resumed", [resumed, resumed_seen], max_steps=7, ckpt_path=str(tmp_path / "end.ckpt"))
    assert resumed_seen.applied == [5] and resumed_seen.plans[6] == full_seen.plans[6]


@pytest.mark.parametrize("change, expected", [
    (dict(extra_pins=["*.attn.q=bf16"]), "(pinned)"),
    (dict(candidate_formats=["fp8", "mxfp4"]), "nvfp4 -> fp8 (not in candidate_formats)"),
])
def test_a_checkpoints_plan_that_this_runs_settings_contradict_is_fitted_to_them(tmp_path, caplog, change, expected):
    first = _snip(overhead_budget=None, candidate_formats=["fp8", "nvfp4"], fp4_fraction=0.9)
    _fit(tmp_path / "first", [first], max_steps=6, checkpoint_every=6)
    assert any(f is Format.NVFP4 for key, f in first.plan.items() if ".attn.q" in key)  # (what the change contradicts)
    ckpt = glob.glob(str(tmp_path / "first" / "ckpt" / "*.ckpt"))[0]
    resumed = _snip(overhead_budget=None, **{"candidate_formats": ["fp8", "nvfp4"], "fp4_fraction": 0.9, **change})
    seen = _Rounds(resumed)
    with caplog.at_level(logging.WARNING, logger="lightning_snip"):
        _fit(tmp_path / "resumed", [resumed, seen], max_steps=9, ckpt_path=ckpt)  # (a round at 8, its plan at 9)
    said = [r.getMessage() for r in caplog.records if "the checkpoint's plan does not fit" in r.getMessage()]
    assert len(said) == 1 and expected in said[0], said
    allowed = {Format.BF16, *resumed.controller.config.candidate_formats}
    for fqn, layer in resumed.layers.items():
        held = {layer.format, layer.backward_format or layer.format}
        assert held <= ({layer.pinned} if layer.pinned is not None else allowed), (fqn, held)
    assert seen.rounds == [8]  # (training went on, and so did SNIP)


def test_a_resume_without_snips_state_says_snip_starts_afresh(tmp_path, caplog):
    _fit(tmp_path / "plain", [], max_steps=10, checkpoint_every=10)  # a user's own run, no SNIP
    ckpt = glob.glob(str(tmp_path / "plain" / "ckpt" / "*.ckpt"))[0]
    with caplog.at_level(logging.INFO, logger="lightning_snip"):
        _fit(tmp_path / "resumed", [_snip(overhead_budget=None)], max_steps=16, ckpt_path=ckpt)
    assert ("this run starts at step 10 without SNIP's state (none in the checkpoint): SNIP starts afresh, "
            "warmup_steps=4 counted from here, its first statistics round at step 14") in caplog.text
    first = _snip(overhead_budget=None)  # a checkpoint with SNIP's state (before its first round) says nothing of it
    _fit(tmp_path / "first", [first], max_steps=3, checkpoint_every=3)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="lightning_snip"):
        _fit(tmp_path / "again", [_snip(overhead_budget=None)], max_steps=5,
             ckpt_path=glob.glob(str(tmp_path / "first" / "ckpt" / "*.ckpt"))[0])
    assert "without SNIP's state" not in caplog.text and "SNIP plan" not in caplog.text
