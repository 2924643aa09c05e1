"""SNIPController without a Trainer: the loop of its docstring on the demo model in plain PyTorch."""

import logging

import torch
import torch.nn.functional as F

from lightning_snip.budget import StepKind
from lightning_snip.config import SNIPConfig
from lightning_snip.controller import SNIPController
from lightning_snip.demo.model import LlamaConfig, TinyLlama
from lightning_snip.formats import Format


def _loss(model, batch):
    inputs, targets = batch
    logits = model(inputs)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def test_a_plain_pytorch_loop_samples_plans_and_switches():
    model = TinyLlama(LlamaConfig(dim=64, num_layers=2, num_heads=4, num_kv_heads=2, hidden_dim=160))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    controller = SNIPController(SNIPConfig(overhead_budget=None, warmup_steps=2, interval=3, first_order_steps=1, max_rows=128, fp4_fraction=0.6, pins=["lm_head=bf16"],
                                           granularity="layer", target_scope="model",
                                           candidate_formats=("fp8", "mxfp4")))  # (mxfp4's metrics read by name)
    controller.attach(model)
    assert len(controller.layers) == 2 * 7 + 1 and controller.layers["lm_head"].pinned is Format.BF16
    tokens = torch.randint(0, 256, (8, 33), generator=torch.Generator().manual_seed(0))
    batch = (tokens[:, :-1], tokens[:, 1:])
    sampled = []
    for step in range(7):
        controller.begin_batch(step)
        controller.apply_due(model, step)
        kind = controller.step_kind(step)
        if kind is StepKind.ROUND:
            scalars = controller.statistics_round(model, batch, lambda b: _loss(model, b), step=step, optimizer=opt)
            assert scalars["snip/stats_seconds"] > 0 and "snip/ld/layers.0.mlp.down/mxfp4" in scalars
        elif kind is StepKind.FIRST_ORDER:
            controller.start_first_order(step)
            sampled.append(step)
        loss = _loss(model, batch)
        loss.backward()
        opt.step()
        opt.zero_grad()
        controller.end_batch()
    # rounds at 2 and 5, first-order samples on the step before each, plans applied at 3 and 6
    assert sampled == [1, 4] and controller.num_stats_rounds == 2 and controller.num_plans_applied == 2
    plan = controller.plan
    assert {fqn: layer.format for fqn, layer in controller.layers.items()} == dict(plan)
    assert abs(controller.fp4_fraction - plan.fp4_fraction) < 1e-9 and plan.fp4_fraction >= 0.6
    # checkpoint state: a fresh controller restored from it holds the same plan and aggregate
    restored = SNIPController(controller.config)
    restored.load_state_dict(controller.state_dict())
    assert dict(restored.plan) == dict(plan) and restored.aggregate.state_dict() == controller.aggregate.state_dict()


def test_a_round_measures_a_pinned_layer_in_its_pin_only(monkeypatch):
    """A plan never moves a pinned layer: the round measures it in its pin (bf16: in no format) and
    every unpinned layer's deterministic parts (the forward errors, the first-order term of LD) are
    those of a round that measured every layer in every format."""
    import math

    import pytest

    from lightning_snip.statistics_round import measured_formats, run_statistics_round
    from lightning_snip.convert import convert_linears

    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64))
    layers = convert_linears(model, pins={"lm_head": "bf16", "model.layers.0.self_attn.q_proj": "fp8"})
    assert measured_formats(layers)["lm_head"] == frozenset({Format.BF16})
    assert measured_formats(layers)["model.layers.0.self_attn.q_proj"] == frozenset({Format.FP8})
    assert measured_formats(layers)["model.layers.1.mlp.down_proj"] == layers["model.layers.1.mlp.down_proj"].allowed_formats
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tokens = torch.randint(0, 256, (2, 17))

    def loss_fn():
        return F.cross_entropy(model(input_ids=tokens[:, :-1]).logits.reshape(-1, 256), tokens[:, 1:].reshape(-1))

    loss_fn().backward()
    opt.step()
    cfg = SNIPConfig(candidate_formats=("fp8", "mxfp4"))
    result = run_statistics_round(model, tokens, lambda _: loss_fn(), layers, cfg, optimizer=opt,
                                  generator=torch.Generator().manual_seed(0)).layers
    head, q0 = result["lm_head"], result["model.layers.0.self_attn.q_proj"]
    assert head.loss_divergence == {Format.BF16: 0.0, Format.FP8: math.inf, Format.MXFP4: math.inf}
    assert head.weight_divergence == {Format.BF16: 0.0, Format.FP8: math.inf, Format.MXFP4: math.inf}
    assert math.isfinite(q0.weight_divergence[Format.FP8]) and q0.weight_divergence[Format.MXFP4] == math.inf
    # the same round with every layer measured in every format (as before 2026-12-03)
    from lightning_snip import statistics_round

    every = {fqn: layer.allowed_formats for fqn, layer in layers.items()}
    monkeypatch.setattr(statistics_round, "measured_formats", lambda _: every)
    full = run_statistics_round(model, tokens, lambda _: loss_fn(), layers, cfg, optimizer=opt,
                                generator=torch.Generator().manual_seed(0)).layers
    assert all(math.isfinite(full["lm_head"].weight_divergence[f]) for f in (Format.FP8, Format.MXFP4))
    for fqn in layers:
        if layers[fqn].pinned is None:
            for fmt in (Format.FP8, Format.MXFP4):
                assert result[fqn].rel_error_forward[fmt] == full[fqn].rel_error_forward[fmt], (fqn, fmt)
                assert result[fqn].first_order[fmt] == full[fqn].first_order[fmt], (fqn, fmt)
                assert math.isfinite(result[fqn].weight_divergence[fmt]) and result[fqn].weight_divergence[fmt] > 0


def test_the_default_target_is_a_share_of_the_switchable_layers(caplog):
    """A model whose pinned LM head is most of its linear FLOPs (a small model with a large vocabulary)
    trains at the defaults: fp4_fraction is a share of the switchable layers' FLOPs, the model's share
    said beside it; the same target over the whole model cannot be met and fails at setup, naming it."""
    import logging

    import pytest

    from lightning_snip.convert import apply_plan
    from lightning_snip.evidence import layer_candidates, model_target, solve_guarded

    def model():
        torch.manual_seed(0)
        return TinyLlama(LlamaConfig(vocab_size=8192, dim=64, num_layers=2, num_heads=4, num_kv_heads=2, hidden_dim=160))

    with pytest.raises(ValueError, match=r"^fp4_fraction: 0.75 cannot be met; .*FP4 FLOPs fraction 0.75 is unreachable"):
        SNIPController(SNIPConfig(target_scope="model")).attach(model())
    lm = model()
    controller = SNIPController(SNIPConfig())
    with caplog.at_level(logging.INFO, logger="lightning_snip"):
        controller.attach(lm)
        controller.log_setup("cpu")
    assert "replan=False" not in caplog.text
    flops = controller.flops
    head = flops["lm_head"] / sum(flops.values())
    assert head > 0.6
    expected_model = 0.75 * (1 - head)
    assert (f"target fp4_fraction 0.75 of the switchable layers' linear FLOPs ({expected_model:.3f} of the model's; "
            f"pinned layers hold {head:.1%} of them)") in caplog.text
    cfg = controller.config
    fraction = model_target(layer_candidates(controller.layers, cfg.candidate_formats), cfg)
    assert fraction == pytest.approx(expected_model)
    g = torch.Generator().manual_seed(1)
    fp4 = next(f for f in cfg.candidate_formats if f.is_fp4)  # the default FP4 candidate
    estimates = [{fqn: {Format.FP8: float(torch.rand((), generator=g)) * 1e-3,
                        fp4: float(torch.rand((), generator=g))}
                  for fqn in controller.layers} for _ in range(2)]
    candidates = layer_candidates(controller.layers, cfg.candidate_formats, loss_divergence=estimates[0],
                                  weight_divergence=estimates[1])
    plan = solve_guarded(candidates, {}, cfg)
    apply_plan(lm, plan)
    assert 0.75 - 1e-9 <= controller.switchable_fp4_fraction and controller.fp4_fraction < 0.3
    assert controller.fp4_fraction == pytest.approx(plan.fp4_fraction)
    # the same plan as the whole-model target it stands for (the same linear constraint)
    same = solve_guarded(candidates, {}, SNIPConfig(target_scope="model", fp4_fraction=fraction * (1 - 1e-12)))
    assert dict(same) == dict(plan)


def test_pins_that_leave_nothing_to_plan_fail_at_setup():
    """Every layer pinned (``*=bf16``): under the switchable scope the target has no FLOPs to be a share of, and
    rounds would run for plans that change nothing; it fails at setup, naming the field; fp4_fraction=0 trains."""
    import pytest

    def model():
        return TinyLlama(LlamaConfig(vocab_size=64, dim=32, num_layers=1, num_heads=2, num_kv_heads=1, hidden_dim=64))

    for pins in (["*=bf16"], ["*=fp8"], ["*=nvfp4"]):
        with pytest.raises(ValueError, match=r"^pins: leave no layer for SNIP to plan \(all 8 .*fp4_fraction=0.75 has nothing"):
            SNIPController(SNIPConfig(pins=pins)).attach(model())
    SNIPController(SNIPConfig(pins=["*=bf16"], fp4_fraction=0.0)).attach(model())
    SNIPController(SNIPConfig(pins=["*=nvfp4"], replan=False)).attach(model())


def test_the_last_matching_pin_wins_and_setup_says_so(caplog):
    """Pins that overlap: a general glob then a specific one keeps the specific one's format (the last match), an
    extra pin wins over the default head pin that matches the same layer, and setup names the layers they disagree on."""
    import logging

    def model():
        return TinyLlama(LlamaConfig(vocab_size=64, dim=32, num_layers=1, num_heads=2, num_kv_heads=1, hidden_dim=64))

    controller = SNIPController(SNIPConfig(pins=["*.attn.*=fp8", "*.attn.q=bf16"]))
    with caplog.at_level(logging.WARNING, logger="lightning_snip"):
        controller.attach(model())
    assert controller.layers["layers.0.attn.q"].pinned is Format.BF16
    assert controller.layers["layers.0.attn.k"].pinned is Format.FP8
    assert "1 layer(s) match pins of different formats; the last matching pin wins" in caplog.text
    assert "layers.0.attn.q: *.attn.*=fp8, *.attn.q=bf16 -> bf16" in caplog.text
    controller = SNIPController(SNIPConfig(extra_pins=["*head=fp8"]))
    controller.attach(model())
    assert controller.layers["lm_head"].pinned is Format.FP8


def test_close_joins_a_solve_still_running_within_its_bound(monkeypatch, caplog):
    """At fit end (SNIPCallback.on_fit_end / teardown) the controller waits for a solve still running, at
    most its bound: a process exiting while the solver's thread runs native code can abort."""
    import logging
    import threading

    import lightning_snip.pending_solve as pending_solve

    release = threading.Event()
    monkeypatch.setattr(pending_solve, "solve_guarded", lambda *a: release.wait(10) and None)
    controller = SNIPController(SNIPConfig(pins=[]))
    controller.attach(TinyLlama(LlamaConfig(dim=64, num_layers=1, num_heads=4, num_kv_heads=2, hidden_dim=160)))
    controller.aggregate.update({"loss_divergence": {}, "weight_divergence": {}})
    controller.start_solve(0, 1)
    thread = controller.pending.thread
    with caplog.at_level(logging.WARNING, logger="lightning_snip"):
        controller.close(timeout=0.05)  # still running: said, left to its daemon thread
    assert thread.is_alive() and "still running" in caplog.text and controller.pending is None
    controller.start_solve(0, 1)
    thread = controller.pending.thread
    release.set()
    controller.close()
    assert not thread.is_alive() and controller.pending is None


def test_model_target_adds_the_pinned_layers_back_in_their_own_formats():
    """fp4_fraction f of the switchable FLOPs is (pinned FP4 FLOPs + f x switchable FLOPs) / all of them over the
    model: hand-checked on a pin to bf16 and one to mxfp4; switchable_share inverts it."""
    import pytest

    from lightning_snip.convert import convert_linears
    from lightning_snip.evidence import layer_candidates, model_target, switchable_share

    model = TinyLlama(LlamaConfig(dim=64, num_layers=1, num_heads=4, num_kv_heads=2, hidden_dim=160))
    pins = {"lm_head": "bf16", "layers.0.mlp.up": "mxfp4"}
    layers = convert_linears(model, pins=pins)
    flops = {fqn: layer.in_features * layer.out_features for fqn, layer in layers.items()}
    total, head, up = sum(flops.values()), flops["lm_head"], flops["layers.0.mlp.up"]
    free = total - head - up
    candidates = layer_candidates(layers, [Format.FP8, Format.MXFP4])
    config = SNIPConfig(fp4_fraction=0.5, pins=pins)
    fraction = model_target(candidates, config)
    assert fraction == pytest.approx((up + 0.5 * free) / total)
    assert switchable_share(fraction, candidates) == pytest.approx(0.5)
    assert model_target(candidates, SNIPConfig(fp4_fraction=0.5, pins=pins, target_scope="model")) == 0.5


def test_replan_false_says_what_it_turns_off(caplog):
    controller = SNIPController(SNIPConfig(replan=False))
    controller.attach(TinyLlama(LlamaConfig(vocab_size=256, dim=32, num_layers=1, num_heads=2, num_kv_heads=1,
                                            hidden_dim=64)))
    with caplog.at_level(logging.INFO, logger="lightning_snip"):
        controller.log_setup("cpu")
    assert "replan=False: the given plan (or the initial format) holds for the whole run; no statistics round, loss " \
           "watch or plan canary runs" in caplog.text
    assert controller.guard.enabled is False and controller.recorder is None
