"""A seeded plain-PyTorch SNIP run's every number, for checking that a refactor keeps behaviour bit for bit.

A 3-block demo model (dim 64) trains 12 steps under SNIPController (rounds at steps 3, 7 and 11, two sampled
first-order steps before each, plans at 4 and 8) at granularity layer and gemm, with the FP4 target read over
the whole model (target_scope=model, as every release before 2026-12-04 read it). Written: every step's loss
(repr), every applied plan, and every round's LD, WD and relative wgrad error per (layer, format). Run it at two
commits and compare the files (``--compare``): equal means the same numbers to the last bit.

    python benchmarks/seeded_dump.py --out dump.json [--compare other.json]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.nn.functional as F


def _loss(model, batch):
    inputs, targets = batch
    logits = model(inputs)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def _step_kind(controller, step: int) -> tuple[bool, bool]:
    """(a round is due, the first-order term is sampled) at ``step``: controller.step_kind since 2026-12-06, the
    is_round_due / is_first_order_step pair before."""
    if hasattr(controller, "step_kind"):
        kind = controller.step_kind(step).value
        return kind == "round", kind == "first_order"
    return controller.is_round_due(step), controller.is_first_order_step(step)


def seeded_run(granularity: str) -> dict:
    from lightning_snip.config import SNIPConfig
    from lightning_snip.controller import SNIPController
    from lightning_snip.demo.model import LlamaConfig, TinyLlama

    torch.manual_seed(0)
    model = TinyLlama(LlamaConfig(dim=64, num_layers=3, num_heads=4, num_kv_heads=2, hidden_dim=160))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    settings = dict(warmup_steps=3, interval=4, first_order_steps=2, max_rows=128, fp4_fraction=0.6,
                    granularity=granularity)
    if "first_order_rows" in SNIPConfig.__dataclass_fields__:  # (until 2026-12-04; since, the sample takes max_rows)
        settings["first_order_rows"] = 128
    if "target_scope" in SNIPConfig.__dataclass_fields__:  # (the field since 2026-12-04; its absence is "model")
        settings["target_scope"] = "model"
    if "overhead_budget" in SNIPConfig.__dataclass_fields__:  # (since 2026-12-04; its absence is the fixed schedule)
        settings["overhead_budget"] = None
    controller = SNIPController(SNIPConfig(**settings))
    controller.attach(model)
    generator = torch.Generator().manual_seed(1)
    losses, plans = [], []
    for step in range(12):
        tokens = torch.randint(0, 256, (8, 33), generator=generator)
        batch = (tokens[:, :-1], tokens[:, 1:])
        controller.begin_batch(step)
        applied = controller.apply_due(model, step)
        if applied:
            plans.append((step, {key: fmt.value for key, fmt in applied[1].items()}))
        round_due, first_order = _step_kind(controller, step)
        if round_due:
            controller.statistics_round(model, batch, lambda b: _loss(model, b), step=step, optimizer=opt)
        elif first_order:
            controller.start_first_order(step)
        loss = _loss(model, batch)
        loss.backward()
        opt.step()
        opt.zero_grad()
        controller.end_batch()
        losses.append(repr(loss.item()))
    rounds = [{fqn: {m: d[m] for m in ("loss_divergence", "weight_divergence", "rel_error_wgrad")}
               for fqn, d in entry["divergence"]["layers"].items()} for entry in controller.history]
    return {"losses": losses, "plans": plans, "rounds": rounds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--compare", type=Path, help="a dump of another commit to compare with")
    args = parser.parse_args()
    torch.set_num_threads(1)
    dump = {granularity: seeded_run(granularity) for granularity in ("layer", "gemm")}
    args.out.write_text(json.dumps(dump, indent=0, sort_keys=True))
    if args.compare:
        other = json.loads(args.compare.read_text())
        for granularity, run in json.loads(args.out.read_text()).items():
            same = {part: run[part] == other[granularity][part] for part in ("losses", "plans", "rounds")}
            print(f"{granularity}: " + ", ".join(f"{part} {'equal' if ok else 'DIFFER'}" for part, ok in same.items()))


if __name__ == "__main__":
    main()
