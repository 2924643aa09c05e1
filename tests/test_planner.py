import dataclasses
import itertools
import json
import math
import random
import subprocess
import sys

import pytest

from lightning_snip.formats import Format
from lightning_snip.plan import Plan, SolveStatus
from lightning_snip.baselines import first_last_plan, industry_tail_plan, layer_type_plan, min_rel_err_plan, natural_fp4_fraction, random_plan, uniform_plan
from lightning_snip.planner import LayerCandidates, PlanInfeasibleError, SolverTimeoutError, solve_plan

F3 = (Format.BF16, Format.FP8, Format.MXFP4)
COST = {Format.BF16: 1.0, Format.FP8: 0.5, Format.MXFP4: 0.25}


def layer(fqn, flops, ld, wd=None, pinned=None):
    return LayerCandidates(fqn, flops, dict(zip(F3, ld)), dict(zip(F3, wd or (0, 0, 0))), pinned)


def test_hand_checkable_three_layers():
    # FLOPs 1, 2, 1 (total 4). Fraction 0.5 needs FP4 on layer b alone (2/4) or a and c (2/4).
    # FP4 costs: a 0.3, b 1.0, c 0.4 -> {a, c} (0.7) beats {b} (1.0); the others in their cheapest
    # non-FP4 choice (fp8 < bf16 here).
    layers = [
        layer("a", 1, (0.2, 0.1, 0.3)),
        layer("b", 2, (0.2, 0.1, 1.0)),
        layer("c", 1, (0.2, 0.1, 0.4)),
    ]
    plan = solve_plan(layers, fp4_fraction=0.5)
    assert dict(plan) == {"a": Format.MXFP4, "b": Format.FP8, "c": Format.MXFP4}
    assert plan.status is SolveStatus.OPTIMAL and plan.objective == pytest.approx(0.8)
    assert plan.fp4_fraction == pytest.approx(0.5)
    # Weight divergence weighted in: FP4 on c now costs 0.4 + 2 * 0.5 = 1.4 -> {b} wins (1.0 + a, c in fp8).
    layers[2] = layer("c", 1, (0.2, 0.1, 0.4), (0, 0, 0.5))
    plan = solve_plan(layers, fp4_fraction=0.5, weight_divergence_weight=2.0)
    assert dict(plan) == {"a": Format.FP8, "b": Format.MXFP4, "c": Format.FP8}


def _brute_force(layers, fraction=None, budget=None, stages=None, lam=1.0):
    best = math.inf
    for combo in itertools.product(*(l.choices() for l in layers)):
        groups = {}
        for l, f in zip(layers, combo):
            groups.setdefault(stages[l.fqn] if stages else 0, []).append((l, f))
        ok = True
        for members in groups.values():
            total = sum(l.flops for l, _ in members)
            if fraction is not None:
                ok &= sum(l.flops for l, f in members if f.is_fp4) >= fraction * total - 1e-9 * total
            else:
                ok &= sum(l.flops * COST[f] for l, f in members) <= budget * total + 1e-9 * total
        if ok:
            best = min(best, sum(l.score(f, lam) for l, f in zip(layers, combo)))
    return best


@pytest.mark.parametrize("seed", range(8))
def test_equal_flops_layers_agree_with_brute_force(seed):
    """Layers of equal FLOPs (identical blocks) get symmetry-breaking order constraints in the ILP;
    the optimum must not change: brute force over many such instances, with stages and pins."""
    rng = random.Random(100 + seed)
    n = rng.randint(6, 8)
    # Four candidates with two FP4 formats (the default config's shape): three or four choices per layer.
    formats = (*F3, Format.NVFP4)
    layers = [
        LayerCandidates(f"l{i}", rng.choice([1, 3]) * 1e9, {f: rng.uniform(-0.1, 1) for f in formats},
                        {f: rng.uniform(0, 1) for f in formats}, Format.FP8 if rng.random() < 0.1 else None)
        for i in range(n)
    ]
    stages = {l.fqn: i % 2 for i, l in enumerate(layers)} if seed % 2 else None
    for fraction in (0.25, 0.5, 0.75, 0.9):
        expected = _brute_force(layers, fraction, None, stages, 1.0)
        try:
            plan = solve_plan(layers, stages=stages, fp4_fraction=fraction, weight_divergence_weight=1.0,
                              relative_cost={**COST, Format.NVFP4: 0.25})
        except PlanInfeasibleError:
            assert expected == math.inf
            continue
        assert plan.objective == pytest.approx(expected, abs=1e-7), fraction


@pytest.mark.parametrize("seed", range(12))
def test_agrees_with_brute_force(seed):
    rng = random.Random(seed)
    n = rng.randint(2, 10 if seed < 4 else 7)
    layers = [
        layer(f"l{i}", rng.choice([1, 2, 4, 8]) * 1e9, [rng.uniform(-0.1, 1) for _ in F3], [rng.uniform(0, 1) for _ in F3],
              pinned=Format.BF16 if rng.random() < 0.1 else None)
        for i in range(n)
    ]
    stages = {l.fqn: i % 2 for i, l in enumerate(layers)} if seed % 2 else None
    lam = rng.uniform(0, 2)
    kwargs = {"fp4_fraction": rng.choice([0.0, 0.25, 0.5, 0.75])} if seed % 3 else {"cost_budget": rng.choice([0.4, 0.6, 0.8])}
    expected = _brute_force(layers, kwargs.get("fp4_fraction"), kwargs.get("cost_budget"), stages, lam)
    try:
        plan = solve_plan(layers, stages=stages, weight_divergence_weight=lam, relative_cost=COST, **kwargs)
    except PlanInfeasibleError:
        assert expected == math.inf
        return
    assert plan.objective == pytest.approx(expected, abs=1e-7)
    if "fp4_fraction" in kwargs:
        groups = {}
        for l in layers:
            groups.setdefault(stages[l.fqn] if stages else 0, []).append(l.fqn)
        for fqns in groups.values():
            sub = Plan({f: plan[f] for f in fqns}, {f: plan.flops[f] for f in fqns})
            assert sub.fp4_fraction >= kwargs["fp4_fraction"] - 1e-9
    else:
        assert Plan(dict(plan), dict(plan.flops), relative_cost=COST).relative_gemm_cost <= kwargs["cost_budget"] + 1e-9
    for l in layers:
        if l.pinned:
            assert plan[l.fqn] is l.pinned


def test_infinite_divergence_excludes_a_format():
    layers = [layer("a", 1, (0, 0, math.inf)), layer("b", 1, (0, 0, 5.0))]
    assert solve_plan(layers, fp4_fraction=0.5)["b"] is Format.MXFP4


def test_infeasible_names_the_constraint_and_stage():
    layers = [layer("a", 3, (0, 0, 1), pinned=Format.BF16), layer("b", 1, (0, 0, 1))]
    with pytest.raises(PlanInfeasibleError, match=r"FP4 FLOPs fraction 0.5 is unreachable; at most 0.2500.*\['a'\]"):
        solve_plan(layers, fp4_fraction=0.5)
    with pytest.raises(PlanInfeasibleError, match="pipeline stage 1"):
        solve_plan(layers, fp4_fraction=0.5, stages={"a": 1, "b": 0})
    with pytest.raises(PlanInfeasibleError, match="relative cost budget 0.5"):
        solve_plan(layers, cost_budget=0.5)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"fp4_fraction": 1.5}, "fp4_fraction"),
        ({"fp4_fraction": -0.1}, "fp4_fraction"),
        ({}, "fp4_fraction / cost_budget"),
        ({"fp4_fraction": 0.5, "cost_budget": 0.5}, "fp4_fraction / cost_budget"),
        ({"fp4_fraction": 0.5, "stages": {"a": 0, "zzz": 1}}, "stages"),
        ({"fp4_fraction": 0.5, "weight_divergence_weight": -1}, "weight_divergence_weight"),
        ({"cost_budget": 0}, "cost_budget"),
    ],
)
def test_bad_arguments_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field.replace("/", ".")):
        solve_plan([layer("a", 1, (0, 0, 1))], **kwargs)


def test_bad_layer_values_name_the_field():
    with pytest.raises(ValueError, match="flops of a"):
        layer("a", -1, (0, 0, 1))
    with pytest.raises(ValueError, match=r"loss_divergence of a\[mxfp4\]"):
        layer("a", 1, (0, 0, float("nan")))
    with pytest.raises(ValueError, match="unknown format 'fp2'"):
        LayerCandidates("a", 1, {"fp2": 0.0}, {"fp2": 0.0})


def test_timeout_returns_feasible_marked_or_raises(monkeypatch):
    import mip

    layers = [layer(f"l{i}", 1, (0, 0.1, 0.2 + i)) for i in range(4)]
    real = mip.Model.optimize

    def stopped_early(self, *a, **k):
        real(self, *a, **k)
        return mip.OptimizationStatus.FEASIBLE

    monkeypatch.setattr(mip.Model, "optimize", stopped_early)
    plan = solve_plan(layers, fp4_fraction=0.5, time_limit_seconds=0.5)
    assert plan.status is SolveStatus.FEASIBLE and plan.fp4_fraction >= 0.5
    monkeypatch.setattr(mip.Model, "optimize", lambda self, *a, **k: mip.OptimizationStatus.NO_SOLUTION_FOUND)
    with pytest.raises(SolverTimeoutError, match="time_limit_seconds=0.5"):
        solve_plan(layers, fp4_fraction=0.5, time_limit_seconds=0.5)


def _llama_layers(blocks=4):
    shapes = {"q": (64, 64), "k": (16, 64), "v": (16, 64), "o": (64, 64), "gate": (128, 64), "up": (128, 64), "down": (64, 128)}
    out = []
    for b in range(blocks):
        for name, (m, k) in shapes.items():
            out.append(layer(f"layers.{b}.{name}", 6 * m * k, (0, 0, 1)))
    out.append(layer("lm_head", 6 * 256 * 64, (0, 0, 1), pinned=Format.BF16))
    return out


@pytest.mark.parametrize("fraction", [0.0, 0.5, 0.75])
def test_baselines_meet_the_target_and_respect_pins(fraction):
    layers = _llama_layers()
    rel_err = {l.fqn: i for i, l in enumerate(layers)}
    plans = [
        random_plan(layers, fp4_fraction=fraction, seed=1),
        min_rel_err_plan(layers, rel_err, fp4_fraction=fraction),
        layer_type_plan(layers, fp4_fraction=fraction),
        first_last_plan(layers, fp4_fraction=fraction),
    ]
    for plan in plans:
        assert plan.fp4_fraction >= fraction - 1e-9
        assert plan["lm_head"] is Format.BF16
        assert set(plan.values()) <= {Format.FP8, Format.MXFP4, Format.BF16}
    assert random_plan(layers, fp4_fraction=0.5, seed=1) == plans[0] if fraction == 0.5 else True
    if fraction == 0.5:
        first_last = plans[3]
        assert first_last["layers.3.down"] is Format.FP8  # an edge block stays high
        assert first_last["layers.1.up"] is Format.MXFP4 and first_last["layers.2.q"] is Format.MXFP4
        layer_type = plans[2]
        assert layer_type["layers.2.up"] is Format.MXFP4 and layer_type["layers.2.k"] is Format.FP8
        assert plans[1]["layers.0.q"] is Format.MXFP4  # smallest relative error first
    uni = uniform_plan(layers, "mxfp4")
    assert uni["lm_head"] is Format.BF16 and uni.count(Format.MXFP4) == len(layers) - 1
    assert uniform_plan(layers, "bf16").count(Format.BF16) == len(layers)
    with pytest.raises(ValueError, match="nvfp4 is not a candidate"):
        uniform_plan(layers, "nvfp4")


def test_plan_json_round_trip_and_table():
    plan = solve_plan(_llama_layers(2), fp4_fraction=0.5)
    again = Plan.from_json(plan.to_json())
    assert again == plan and again.status is plan.status and again.fp4_fraction == plan.fp4_fraction
    assert json.loads(plan.to_json())["formats"]["lm_head"] == "bf16"
    table = plan.table()
    assert "layers.1.down" in table and "FP4 FLOPs fraction" in table
    assert "; layers: " in table.splitlines()[-1]
    assert 0.25 < plan.relative_gemm_cost < 1.0
    # a long plan's table lists the rows outside its most common format, the rest counted in one row
    common = max(set(plan.values()), key=lambda f: sum(v is f for v in plan.values()))
    short = plan.table(max_rows=3).splitlines()
    others = [k for k, v in plan.items() if v is not common]
    assert len(short) == 2 + len(others) + 2 and short[-2].startswith(f"(the other {len(plan) - len(others)} rows)")
    assert common.value in short[-2] and short[-1] == table.splitlines()[-1]
    assert all(any(line.startswith(k + " ") for line in short) for k in others)
    assert plan.table(max_rows=len(plan)) == table


def test_planner_imports_no_torch():
    code = "import sys, lightning_snip.planner, lightning_snip.plan; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_ordered_baselines_trim_their_overshoot():
    layers = [layer("b1", 6, (0, 0, 0)), layer("s1", 1, (0, 0, 0)), layer("s2", 1, (0, 0, 0)), layer("b2", 6, (0, 0, 0))]
    from lightning_snip.baselines import ordered_plan

    plan = ordered_plan(layers, ["s1", "s2", "b1", "b2"], fp4_fraction=9 / 14, policy="test")
    # s1, s2, b1 = 8/14 < 9/14, so b2 is added (14/14); trimming back over b1, s2, s1: dropping b1
    # leaves 8/14 (too few), dropping s2 leaves 13/14 (kept), then s1 -> 12/14 (kept).
    assert {f for f, fmt in plan.items() if fmt is Format.MXFP4} == {"b1", "b2"}
    assert plan.fp4_fraction == pytest.approx(12 / 14)


def test_layer_type_edges_last_fills_inner_blocks_from_the_middle_out():
    """edges_last: in each direction the first and last blocks come after every other block, and
    within a type the blocks fill from the middle outwards (model order would take blocks 0 and 1)."""
    from lightning_snip.baselines import layer_type_plan
    from lightning_snip.plan import BACKWARD, split_key

    layers = [layer(f"layers.{b}.{kind}", 1, (0, 0, 0)) for b in range(7) for kind in ("mlp.up", "attn.q")]
    fp4 = lambda plan: {k for k, f in plan.items() if f.is_fp4}  # noqa: E731
    assert fp4(layer_type_plan(layers, fp4_fraction=2 / 14)) == {"layers.0.mlp.up", "layers.1.mlp.up"}
    assert fp4(layer_type_plan(layers, fp4_fraction=2 / 14, edges_last=True)) == {"layers.3.mlp.up", "layers.2.mlp.up"}
    # 6 of 14: every up of blocks 1-5 (not the edges'), then the q of the middle block.
    assert fp4(layer_type_plan(layers, fp4_fraction=6 / 14, edges_last=True)) == (
        {f"layers.{b}.mlp.up" for b in range(1, 6)} | {"layers.3.attn.q"})
    gemm = layer_type_plan(layers, fp4_fraction=0.68, edges_last=True, granularity="gemm")
    forward = {split_key(k)[0] for k in fp4(gemm) if split_key(k)[1] != BACKWARD}
    assert gemm.policy == "layer_type_edges_gemm" and forward == {"layers.3.mlp.up"}  # 2/3 backward + one forward (1/42)


def test_baselines_take_format_names_and_refuse_bad_ones():
    """A format name is the format it names (it once fell back silently to the layer's first FP4
    candidate, mxfp4, when "nvfp4" was asked for by name); a bad one is an error naming the field."""
    from lightning_snip.baselines import backward_only_plan, layer_type_plan, random_plan

    four = (Format.BF16, Format.FP8, Format.MXFP4, Format.NVFP4)  # mxfp4 first: the old fallback
    layers = [LayerCandidates(f"l{i}.mlp.up", 1, dict.fromkeys(four, 0.0), dict.fromkeys(four, 0.0)) for i in range(4)]
    for plan in (random_plan(layers, fp4_fraction=0.5, seed=0, low="nvfp4", high="bf16"),
                 layer_type_plan(layers, fp4_fraction=0.5, low="NVFP4", high="bf16", granularity="gemm"),
                 backward_only_plan(layers, low="nvfp4", high="bf16")):
        used = {f for _, f in plan.items()}
        assert Format.NVFP4 in used and Format.MXFP4 not in used and Format.FP8 not in used, plan
    with pytest.raises(ValueError, match=r"low: unknown format 'nvfp5'.*valid formats"):
        random_plan(layers, fp4_fraction=0.5, seed=0, low="nvfp5")
    with pytest.raises(ValueError, match=r"low / high: need an FP4 format and a non-FP4 one, got fp8 / nvfp4"):
        layer_type_plan(layers, fp4_fraction=0.5, low="fp8", high="nvfp4")


# ---------------------------------------------------------------- granularity "gemm" (pairs)


def _brute_force_pairs(layers, fraction=None, budget=None, stages=None, lam=1.0):
    """The best (forward, backward) pair per layer by enumerating every combination."""
    options = []
    for lay in layers:
        fmts = lay.choices()
        options.append([(f, b) for f in fmts for b in fmts])
    groups = {}
    for lay in layers:
        groups.setdefault(None if stages is None else stages[lay.fqn], []).append(lay)
    best, best_pairs = math.inf, None
    for combo in itertools.product(*options):
        pairs = {lay.fqn: pair for lay, pair in zip(layers, combo)}
        ok = True
        for group in groups.values():
            total = sum(lay.flops for lay in group)
            fwd = {lay.fqn: lay.flops / 3 for lay in group}
            bwd = {lay.fqn: 2 * lay.flops / 3 for lay in group}
            if fraction is not None:
                fp4 = sum(fwd[q] * pairs[q][0].is_fp4 + bwd[q] * pairs[q][1].is_fp4 for q in fwd)
                ok &= fp4 >= fraction * total - 1e-9
            else:
                cost = sum(fwd[q] * COST[pairs[q][0]] + bwd[q] * COST[pairs[q][1]] for q in fwd)
                ok &= cost <= budget * total + 1e-9
        if not ok:
            continue
        value = sum(lay.loss_divergence.get(pairs[lay.fqn][0], 0.0) + lam * lay.weight_divergence.get(pairs[lay.fqn][1], 0.0)
                    for lay in layers if lay.pinned is None)
        if value < best - 1e-12:
            best, best_pairs = value, pairs
    return best, best_pairs


@pytest.mark.parametrize("seed", range(6))
def test_gemm_pairs_agree_with_brute_force(seed):
    from lightning_snip.planner import BACKWARD, FORWARD, gemm_formats, gemm_key, solve_gemm_plan

    rng = random.Random(seed)
    layers = [layer(f"l{i}", rng.choice([1, 2, 3]), [rng.uniform(0, 0.2), rng.uniform(0, 1), rng.uniform(0, 3)],
                    [rng.uniform(0, 0.2), rng.uniform(0, 1), rng.uniform(0, 3)],
                    pinned=Format.BF16 if (seed % 3 == 0 and i == 3) else None)
              for i in range(4)]
    stages = {f"l{i}": i // 2 for i in range(4)} if seed % 2 else None
    kwargs = dict(fp4_fraction=rng.choice([0.3, 0.5, 0.7])) if seed < 4 else dict(cost_budget=rng.choice([0.45, 0.6]))
    try:
        plan = solve_gemm_plan(layers, stages=stages, relative_cost=COST, weight_divergence_weight=0.7, **kwargs)
    except PlanInfeasibleError:
        best, _ = _brute_force_pairs(layers, kwargs.get("fp4_fraction"), kwargs.get("cost_budget"), stages, 0.7)
        assert best == math.inf
        return
    best, pairs = _brute_force_pairs(layers, kwargs.get("fp4_fraction"), kwargs.get("cost_budget"), stages, 0.7)
    got = gemm_formats(plan)
    value = sum(lay.loss_divergence[got[lay.fqn][0]] + 0.7 * lay.weight_divergence[got[lay.fqn][1]]
                for lay in layers if lay.pinned is None)
    assert value == pytest.approx(best, abs=1e-9)
    assert set(plan) == {gemm_key(f"l{i}", d) for i in range(4) for d in (FORWARD, BACKWARD)}
    if seed % 3 == 0:
        assert got["l3"] == (Format.BF16, Format.BF16)  # a pin holds both directions
    # The plan's FLOPs accounting is per direction: forward 1/3, backward 2/3 of a layer.
    total = sum(lay.flops for lay in layers)
    fp4 = sum(lay.flops / 3 * got[lay.fqn][0].is_fp4 + 2 * lay.flops / 3 * got[lay.fqn][1].is_fp4 for lay in layers)
    assert plan.fp4_fraction == pytest.approx(fp4 / total)


def test_gemm_split_prefers_fp4_backward_when_the_forward_is_sensitive():
    from lightning_snip.planner import gemm_formats, solve_gemm_plan

    # One layer whose FP4 forward is costly (LD) and FP4 backward is cheap (WD): at fraction 2/3 the
    # per-GEMM plan puts exactly the backward in FP4; a per-layer plan must pay the forward too.
    lay = layer("a", 3, (0.0, 0.01, 5.0), (0.0, 0.01, 0.02))
    got = gemm_formats(solve_gemm_plan([lay], fp4_fraction=2 / 3, relative_cost=COST))
    assert got == {"a": (Format.BF16, Format.MXFP4)}  # bf16 is a candidate here, with LD 0
    assert solve_plan([lay], fp4_fraction=2 / 3, relative_cost=COST)["a"] is Format.MXFP4


def test_backward_only_baseline_puts_exactly_the_backward_in_fp4():
    from lightning_snip.baselines import backward_only_plan
    from lightning_snip.planner import BACKWARD, FORWARD, gemm_formats

    layers = [layer("a", 1, (0, 0, 0)), layer("b", 2, (0, 0, 0)), layer("head", 1, (0, 0, 0), pinned=Format.BF16)]
    plan = backward_only_plan(layers)
    assert gemm_formats(plan) == {"a": (Format.FP8, Format.MXFP4), "b": (Format.FP8, Format.MXFP4),
                                  "head": (Format.BF16, Format.BF16)}
    assert plan.fp4_fraction == pytest.approx(2 / 3 * 3 / 4)  # 2/3 of the unpinned 3 of 4 FLOPs
    assert plan.policy == "backward_only"
    with pytest.raises(ValueError, match="low / high: need an FP4 format"):
        backward_only_plan(layers, low=Format.FP8)


def test_noise_guard_blocks_fp4_backward_only_and_agrees_with_brute_force():
    """solve_gemm_plan with backward_blocked: blocked layers never get an FP4 backward; the rest of
    the plan is the brute-force optimum over the remaining (forward, backward) pairs."""
    from lightning_snip.plan import BACKWARD, FORWARD, gemm_key
    from lightning_snip.planner import max_fp4_fraction, gemm_items, solve_gemm_plan

    rng = random.Random(3)
    layers = [layer(f"l{i}", rng.choice([1.0, 2.0, 3.0]), [0, rng.random(), rng.random() * 2],
                    [0, rng.random(), rng.random() * 2]) for i in range(4)]
    blocked = {"l1", "l3"}
    fraction = 0.3
    plan = solve_gemm_plan(layers, backward_blocked=blocked, fp4_fraction=fraction, weight_divergence_weight=1.0)
    for fqn in blocked:
        assert not plan[gemm_key(fqn, BACKWARD)].is_fp4
    items = gemm_items(layers, blocked)
    best = None
    for choice in itertools.product(*[[f for f in F3 if f in item.choices()] for item in items]):
        fp4 = sum(item.flops for item, f in zip(items, choice) if f.is_fp4) / sum(i.flops for i in items)
        if fp4 + 1e-9 < fraction:
            continue
        cost = sum(item.score(f, 1.0) for item, f in zip(items, choice))
        best = cost if best is None else min(best, cost)
    got = sum(item.score(plan[item.fqn], 1.0) for item in items)
    assert got == pytest.approx(best, abs=1e-9)
    # forward 1/3 of every layer + backward 2/3 of the unblocked ones
    flops = {l.fqn: l.flops for l in layers}
    expected = (sum(flops.values()) / 3 + 2 / 3 * sum(v for k, v in flops.items() if k not in blocked)) / sum(flops.values())
    assert max_fp4_fraction(items) == pytest.approx(expected)
    assert plan[gemm_key("l1", FORWARD)] in F3


def test_keep_out_of_fp4_leaves_pins_and_falls_back_to_bf16():
    from lightning_snip.planner import keep_out_of_fp4

    only_fp4 = LayerCandidates("a", 1.0, {Format.MXFP4: 0.1}, {Format.MXFP4: 0.1})
    assert keep_out_of_fp4(only_fp4).choices() == [Format.BF16]
    assert keep_out_of_fp4(layer("b", 1.0, [0, 1, 2])).choices() == [Format.BF16, Format.FP8]
    pinned = layer("c", 1.0, [0, 1, 2], pinned=Format.MXFP4)
    assert keep_out_of_fp4(pinned) is pinned
    both = LayerCandidates("d", 1.0, {Format.FP8: 1, Format.MXFP4: 2, Format.NVFP4: 3},
                           {Format.FP8: 1, Format.MXFP4: 2, Format.NVFP4: 3})
    assert keep_out_of_fp4(both, {Format.MXFP4}).choices() == [Format.FP8, Format.NVFP4]  # one format at a time


def test_plan_json_keeps_noise_guarded_layers_and_the_table_marks_them():
    import dataclasses

    from lightning_snip.plan import BACKWARD, gemm_key
    from lightning_snip.planner import solve_gemm_plan

    plan = dataclasses.replace(solve_gemm_plan(_llama_layers(2), fp4_fraction=0.3),
                               noise_guarded={"layers.0.up": ("mxfp4",)})
    again = Plan.from_json(plan.to_json())
    assert dict(again.noise_guarded) == {"layers.0.up": (Format.MXFP4,)}
    marked = [line for line in again.table().splitlines() if "noise guard" in line]
    assert len(marked) == 2 and marked[0].startswith(gemm_key("layers.0.up", BACKWARD))  # the row, and the totals
    assert "(noise guard: no mxfp4 backward)" in marked[0] and "noise guard: 1 layer" in marked[1]
    assert "; GEMM directions: " in marked[1]  # a per-GEMM plan counts directions, not layers
    old = json.loads(plan.to_json())
    del old["noise_guarded"]  # a plan saved before the guard existed
    assert dict(Plan.from_json(json.dumps(old)).noise_guarded) == {}


@pytest.mark.parametrize("fraction", [0.3, 0.6, 0.85])
def test_per_gemm_random_and_layer_type_baselines(fraction):
    from lightning_snip.plan import BACKWARD, FORWARD, gemm_key, split_key

    layers = _llama_layers()
    for plan in (random_plan(layers, fp4_fraction=fraction, seed=1, granularity="gemm"),
                 layer_type_plan(layers, fp4_fraction=fraction, granularity="gemm")):
        assert plan.policy.endswith("_gemm")
        assert set(plan) == {gemm_key(l.fqn, d) for l in layers for d in (FORWARD, BACKWARD)}
        assert fraction - 1e-9 <= plan.fp4_fraction < fraction + 0.05  # trimmed to the target
        assert plan[gemm_key("lm_head", FORWARD)] is plan[gemm_key("lm_head", BACKWARD)] is Format.BF16
    typed = layer_type_plan(layers, fp4_fraction=fraction, granularity="gemm")
    fp4_forward = [k for k, f in typed.items() if f.is_fp4 and split_key(k)[1] == FORWARD]
    fp4_backward = [k for k, f in typed.items() if f.is_fp4 and split_key(k)[1] == BACKWARD]
    backward_share = sum(typed.flops[k] for k in typed if split_key(k)[1] == BACKWARD and "lm_head" not in k) / typed.total_flops
    if fraction < backward_share:  # backward GEMMs alone reach it: no forward in FP4
        assert not fp4_forward and fp4_backward
    else:
        assert fp4_forward and len(fp4_backward) >= len(layers) - 5  # (trimming may return a few)
    a = random_plan(layers, fp4_fraction=fraction, seed=1, granularity="gemm")
    b = random_plan(layers, fp4_fraction=fraction, seed=2, granularity="gemm")
    assert a == random_plan(layers, fp4_fraction=fraction, seed=1, granularity="gemm") and a != b


def test_industry_tail_keeps_the_first_two_and_the_last_blocks_high():
    layers = _llama_layers(blocks=8)  # tail: ceil(0.15 * 8) = 2 blocks (6, 7)
    natural = natural_fp4_fraction(layers)
    block_flops = sum(l.flops for l in layers if l.fqn.startswith("layers.0."))
    total = sum(l.flops for l in layers)
    assert natural == pytest.approx(4 * block_flops / total)
    at_natural = industry_tail_plan(layers, fp4_fraction=natural)
    fp4_blocks = {int(fqn.split(".")[1]) for fqn, f in at_natural.items() if f.is_fp4}
    assert fp4_blocks == {2, 3, 4, 5} and at_natural["lm_head"] is Format.BF16
    assert at_natural.count(Format.MXFP4) == 28 and at_natural.policy == "industry_tail"
    # Beyond the natural fraction: block 1, then 0, then the tail's earliest block; block 7 stays high.
    more = industry_tail_plan(layers, fp4_fraction=natural + 1.5 * block_flops / total)
    assert all(more[f"layers.1.{n}"] is Format.MXFP4 for n in ("q", "up", "down"))
    assert any(more[f"layers.0.{n}"] is Format.MXFP4 for n in ("q", "k", "v", "o", "gate", "up", "down"))
    assert all(more[f"layers.{b}.{n}"] is Format.FP8 for b in (6, 7) for n in ("q", "up"))
    most = industry_tail_plan(layers, fp4_fraction=natural + 3.5 * block_flops / total)
    assert all(most[f"layers.6.{n}"] is Format.MXFP4 for n in ("q", "up"))
    assert any(most[f"layers.7.{n}"] is Format.FP8 for n in ("q", "k", "v", "o", "gate", "up", "down"))
    # Below it, FP4 fills the unprotected range from its middle outwards.
    half = industry_tail_plan(layers, fp4_fraction=2 * block_flops / total)
    assert {int(fqn.split(".")[1]) for fqn, f in half.items() if f.is_fp4} == {3, 4}
    # Three blocks: the first two and the tail (block 2) protect everything; the first blocks win
    # the overlap, so past the natural fraction (0) block 1 fills before the tail's block 2.
    three = _llama_layers(blocks=3)
    assert natural_fp4_fraction(three) == 0.0
    one_block = sum(l.flops for l in three if l.fqn.startswith("layers.0.")) / sum(l.flops for l in three)
    plan3 = industry_tail_plan(three, fp4_fraction=one_block)
    assert {int(fqn.split(".")[1]) for fqn, f in plan3.items() if f.is_fp4} == {1}
    # An unpinned head (outside any block) is the last to take FP4.
    unpinned = [l if l.pinned is None else dataclasses.replace(l, pinned=None) for l in layers]
    assert industry_tail_plan(unpinned, fp4_fraction=0.9)["lm_head"] is Format.FP8
    with pytest.raises(ValueError, match="tail_share"):
        industry_tail_plan(layers, fp4_fraction=0.5, tail_share=1.5)
    with pytest.raises(ValueError, match="first_blocks"):
        industry_tail_plan(layers, fp4_fraction=0.5, first_blocks=-1)


def _recipe_layers(blocks, *, nvfp4=True):
    """Llama-shaped candidates over bf16 / fp8 (/ nvfp4), the head pinned bf16."""
    fmts = (Format.BF16, Format.FP8) + ((Format.NVFP4,) if nvfp4 else ())
    return [LayerCandidates(l.fqn, l.flops, dict.fromkeys(fmts, 0.0), dict.fromkeys(fmts, 0.0), l.pinned)
            for l in _llama_layers(blocks)]


def test_nvfp4_recipe_keeps_the_papers_first_and_last_blocks_in_bf16():
    from lightning_snip.baselines import PolicyContext, baseline_plan, nvfp4_recipe_plan, recipe_high_blocks

    # The paper's 62 blocks: the first 2 and the last 8; by shares of the depth elsewhere, one at each end at least.
    assert recipe_high_blocks(range(62)) == {0, 1, *range(54, 62)}
    assert recipe_high_blocks(range(30)) == {0, 26, 27, 28, 29}  # SmolLM2: 1 and round(3.87) = 4
    assert recipe_high_blocks(range(8)) == {0, 7}
    assert recipe_high_blocks(range(2)) == {0, 1} and recipe_high_blocks([]) == set()
    assert recipe_high_blocks([3, 5, 9, 11, 12], first_share=0.2, last_share=0.4) == {3, 11, 12}  # by position
    layers = _recipe_layers(30)
    plan = baseline_plan("nvfp4_recipe", layers, PolicyContext(fp4_fraction=0.1))  # the target plays no part
    assert plan.policy == "nvfp4_recipe" and plan["lm_head"] is Format.BF16
    high = {int(fqn.split(".")[1]) for fqn, f in plan.items() if f is Format.BF16 and fqn != "lm_head"}
    assert high == {0, 26, 27, 28, 29}
    assert {f for fqn, f in plan.items() if int(fqn.split(".")[1] if fqn != "lm_head" else -1) not in high
            and fqn != "lm_head"} == {Format.NVFP4}  # never FP8: the recipe is NVFP4 or BF16
    block = sum(l.flops for l in layers if l.fqn.startswith("layers.0."))
    assert plan.fp4_fraction == pytest.approx(25 * block / sum(l.flops for l in layers))
    # An unpinned layer outside any block stays high; a layer whose shape rules NVFP4 out too.
    unpinned = [dataclasses.replace(l, pinned=None) if l.fqn == "lm_head" else l for l in layers]
    no_nvfp4 = [LayerCandidates(l.fqn, l.flops, {Format.BF16: 0.0, Format.FP8: 0.0}, {Format.BF16: 0.0, Format.FP8: 0.0})
                if l.fqn == "layers.10.q" else l for l in unpinned]
    other = nvfp4_recipe_plan(no_nvfp4)
    assert other["lm_head"] is Format.BF16 and other["layers.10.q"] is Format.BF16
    assert other["layers.10.k"] is Format.NVFP4
    with pytest.raises(ValueError, match="low: nvfp4 is not a candidate"):
        nvfp4_recipe_plan(_recipe_layers(8, nvfp4=False))
    no_bf16 = [LayerCandidates(l.fqn, l.flops, {Format.FP8: 0.0, Format.NVFP4: 0.0}, {Format.FP8: 0.0, Format.NVFP4: 0.0})
               for l in _llama_layers(8) if l.pinned is None]
    with pytest.raises(ValueError, match="high: bf16 is not a candidate format of layer"):
        nvfp4_recipe_plan(no_bf16)
    with pytest.raises(ValueError, match="low / high"):
        nvfp4_recipe_plan(layers, low="fp8")
    with pytest.raises(ValueError, match="last_share"):
        recipe_high_blocks(range(8), last_share=2)


def test_industry_tail_per_gemm_puts_every_backward_in_fp4_before_any_forward():
    layers = _llama_layers(blocks=8)
    unpinned = sum(l.flops for l in layers if l.pinned is None) / sum(l.flops for l in layers)
    # Under the backward share (2/3 of the unpinned FLOPs) no forward is FP4; the backwards follow the rule.
    low = industry_tail_plan(layers, fp4_fraction=0.5 * unpinned, granularity="gemm")
    assert low.policy == "industry_tail_gemm"
    assert not any(f.is_fp4 for key, f in low.items() if key.endswith(":forward"))
    fp4_blocks = {int(key.split(".")[1]) for key, f in low.items() if f.is_fp4}
    assert 7 not in fp4_blocks and {3, 4} <= fp4_blocks  # from the unprotected middle, the last block last
    # Above it every backward is FP4, and the forwards fill by the rule: the tail's last block stays high.
    high = industry_tail_plan(layers, fp4_fraction=0.85 * unpinned, granularity="gemm")
    assert all(f.is_fp4 for key, f in high.items() if key.endswith(":backward") and not key.startswith("lm_head"))
    forward_fp4 = {int(key.split(".")[1]) for key, f in high.items() if key.endswith(":forward") and f.is_fp4}
    assert {3, 4} <= forward_fp4 and 7 not in forward_fp4
    assert high.fp4_fraction == pytest.approx(0.85 * unpinned, abs=0.01)
