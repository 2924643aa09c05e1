"""SNIPController without a Trainer: the loop of its docstring on the demo model in plain PyTorch."""

import torch
import torch.nn.functional as F

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
    controller = SNIPController(SNIPConfig(warmup_steps=2, interval=3, first_order_steps=1, first_order_rows=64,
                                           max_rows=128, noise_draws=1, fp4_fraction=0.6, pins=["lm_head=bf16"]))
    controller.attach(model)
    assert len(controller.layers) == 2 * 7 + 1 and controller.layers["lm_head"].pinned is Format.BF16
    tokens = torch.randint(0, 256, (8, 33), generator=torch.Generator().manual_seed(0))
    batch = (tokens[:, :-1], tokens[:, 1:])
    sampled = []
    for step in range(7):
        controller.begin_batch(step)
        controller.apply_due(model, step)
        if controller.is_round_due(step):
            scalars = controller.statistics_round(model, batch, lambda b: _loss(model, b), step=step, optimizer=opt)
            assert scalars["snip/stats_seconds"] > 0 and "snip/ld/layers.0.mlp.down/mxfp4" in scalars
        elif controller.is_first_order_step(step):
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
