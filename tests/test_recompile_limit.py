"""CompiledPlans raises dynamo's recompile limits ahead of the distinct format assignments SNIP applies
(lightning_snip/recompile.py): counted per frame a model may be compiled in, never lowered, capped with a warning."""

import logging

import pytest
import torch
from torch import nn

from lightning_snip import recompile
from lightning_snip.formats import Format
from lightning_snip.linear import SNIPLinear
from lightning_snip.recompile import CompiledPlans

torch.set_num_threads(1)

FP8, MXFP4, BF16 = Format.FP8, Format.MXFP4, Format.BF16


@pytest.fixture
def limits():
    """A small fake recompile limit, and dynamo's config restored after the test (note_plan sets the real,
    process-wide one). config.patch, not monkeypatch: undoing a monkeypatch deletes a dynamo config entry."""
    with torch._dynamo.config.patch(recompile_limit=4, accumulated_recompile_limit=256,
                                    fail_on_recompile_limit_hit=False):
        yield torch._dynamo.config


def _assign(layers, formats):
    for layer, fmt in zip(layers.values(), formats):
        layer.format = fmt


def test_the_limit_is_raised_before_the_distinct_assignments_reach_it(limits, caplog):
    layers = {"a": SNIPLinear(64, 64), "b": SNIPLinear(64, 64)}
    plans = CompiledPlans()
    raised = []
    with caplog.at_level(logging.INFO, logger="lightning_snip"):
        # 1, 2, 2 (a repeat), 3, 4 (a backward format alone is an assignment too) distinct: a cache of 4 entries
        # and a fifth with the next plan, over the limit of 4; then 5, within the raised one.
        for formats, backward in [((FP8, FP8), None), ((MXFP4, FP8), None), ((FP8, FP8), None), ((FP8, MXFP4), None),
                                  ((FP8, FP8), MXFP4), ((MXFP4, MXFP4), None)]:
            _assign(layers, formats)
            layers["a"].backward_format = backward
            raised.append(plans.note_plan(layers))
    assert raised == [{}, {}, {}, {}, {"recompile_limit": 8}, {}]  # doubled, not raised to the count
    assert limits.recompile_limit == 8 and plans.num_assignments == 5
    lines = [r.getMessage() for r in caplog.records]
    assert lines == ["SNIP: 4 distinct format assignments so far (under torch.compile, a graph each); raised "
                     "torch._dynamo.config's recompile_limit from 4 to 8 (process-wide settings) so compiled frames "
                     "do not fall back to eager"]


def test_a_users_higher_limit_is_never_lowered(limits):
    limits.recompile_limit = 100
    layers = {"a": SNIPLinear(64, 64)}
    plans = CompiledPlans()
    for fmt in (FP8, MXFP4, BF16, Format.NVFP4):
        layer = layers["a"]
        layer.format = fmt
        assert plans.note_plan(layers) == {}
    assert limits.recompile_limit == 100


def test_blocks_compiled_one_by_one_count_each_blocks_assignment(limits):
    """Blocks of a ModuleList share their forward's code: compiled block by block, one plan that gives four
    blocks four assignments puts four graphs in one cache (tests/test_recompile_limit.py::
    test_without_it_dynamo_falls_back_and_with_it_it_does_not shows dynamo doing so)."""
    limits.recompile_limit = 8
    layers = {f"layers.{i}.{name}": SNIPLinear(64, 64) for i in range(4) for name in ("up", "down")}
    plans = CompiledPlans()
    _assign(layers, [FP8] * 8)
    assert plans.note_plan(layers) == {}  # 1 assignment, and up to 4 new ones next: 5 <= 8
    _assign(layers, [FP8, MXFP4, MXFP4, FP8, MXFP4, MXFP4, BF16, FP8])  # 4 new block assignments, 1 new model one
    assert plans.note_plan(layers) == {"recompile_limit": 16}  # 5 met + 4 = 9 > 8
    assert plans.num_assignments == 5 and len(plans.seen[""]) == 2
    # Nested numbered modules (experts in a block) are frames of their own.
    experts = {f"layers.0.experts.{e}.w": SNIPLinear(64, 64) for e in range(3)}
    plans = CompiledPlans()
    _assign(experts, [FP8, MXFP4, BF16])
    plans.note_plan(experts)
    assert plans.seen["layers.*.experts.*"] == {((f, f, layer.recipe),) for f, layer in zip((FP8, MXFP4, BF16),
                                                                                        experts.values())}


def test_the_cap_is_said_once_and_the_accumulated_limit_follows(limits, monkeypatch, caplog):
    monkeypatch.setattr(recompile, "MAX_RECOMPILE_LIMIT", 6)
    limits.accumulated_recompile_limit = 4
    layers = {f"layers.{i}.up": SNIPLinear(64, 64) for i in range(3)}
    plans = CompiledPlans()
    with caplog.at_level(logging.INFO, logger="lightning_snip"):
        _assign(layers, [FP8, MXFP4, BF16])  # 3 met + 3 = 6: both limits raised, to the cap
        assert plans.note_plan(layers) == {"recompile_limit": 6, "accumulated_recompile_limit": 6}
        assert not [r for r in caplog.records if r.levelno == logging.WARNING]
        for formats in ([MXFP4, BF16, FP8], [BF16, FP8, MXFP4]):  # the same three: nothing new
            _assign(layers, formats)
            assert plans.note_plan(layers) == {}
        _assign(layers, [Format.NVFP4, FP8, FP8])  # 4 met + 3 = 7 > the cap
        assert plans.note_plan(layers) == {}
        _assign(layers, [Format.MXFP8, FP8, FP8])
        plans.note_plan(layers)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and warnings[0].startswith(
        "SNIP: 4 distinct format assignments so far; under torch.compile the next plan may need more graphs per frame "
        "than torch._dynamo.config.recompile_limit (6; SNIP raises it to at most 6)")
    assert limits.recompile_limit == 6 and limits.accumulated_recompile_limit == 6


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = SNIPLinear(32, 32)
        self.down = SNIPLinear(32, 32, bias=False)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


@pytest.mark.parametrize("noted", [False, True])
def test_without_it_dynamo_falls_back_and_with_it_it_does_not(limits, noted):
    """Real dynamo, with a limit of 2 and a hard failure where it would fall back to eager: four blocks compiled
    one by one, given four assignments by one plan, hit the limit unless note_plan raised it."""
    limits.recompile_limit = 2
    limits.fail_on_recompile_limit_hit = True
    torch._dynamo.reset()
    model = nn.ModuleList(_Block() for _ in range(4))
    for block in model:
        block.compile(backend="eager")
    layers = {f"{i}.{name}": getattr(block, name) for i, block in enumerate(model) for name in ("up", "down")}
    plans = CompiledPlans()
    x = torch.randn(2, 8, 32)

    def apply_and_run(formats):
        _assign(layers, formats)
        if noted:
            plans.note_plan(layers)
        with torch.no_grad():
            for block in model:
                block(x)

    try:
        apply_and_run([BF16] * 8)
        plan = [FP8, BF16, BF16, FP8, FP8, FP8, BF16, BF16]  # blocks (fp8, bf16), (bf16, fp8), (fp8, fp8), (bf16, bf16)
        if noted:
            apply_and_run(plan)
            # the first assignment: 1 met + 4 blocks = 5 > 2, raised to 5; the plan: 4 met + 4 = 8 > 5, doubled to 10
            assert limits.recompile_limit == 10
        else:
            with pytest.raises(torch._dynamo.exc.FailOnRecompileLimitHit, match="recompile_limit"):
                apply_and_run(plan)
    finally:
        torch._dynamo.reset()
