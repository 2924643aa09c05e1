"""Run by test_ddp.py: 2-process CPU DDP (gloo) training with SNIPCallback; each rank writes its plan,
a checksum of its weights, its own (local) and the reduced divergences of each round, and the seed of
its stochastic-rounding stream to OUT_DIR/rank<r>.json."""

import json
import os
import sys

import lightning.pytorch as pl
import torch

from lightning_snip.callback import SNIPCallback
from lightning_snip.config import SNIPConfig
from lightning_snip.demo.lightning import ByteTextDataModule, DemoLM
from lightning_snip.demo.model import LlamaConfig
from lightning_snip import statistics_round

statistics_round.DEFAULT_ROUND = statistics_round.RoundSettings(noise_draws=1)  # one error-probe draw per round, as the in-process tests (conftest.py)

ROUNDS = []  # every round's local and reduced divergences on this rank


def _record_reductions() -> None:
    real = statistics_round.reduce_result

    def recording(result, *args):
        local = result.as_dict() if result is not None else None
        reduced = real(result, *args)
        ROUNDS.append({"local": local, "reduced": reduced.as_dict() if reduced is not None else None})
        return reduced

    statistics_round.reduce_result = recording


def spike(out_dir: str) -> None:
    """The guard under DDP: rank 0's MXFP4 forwards are broken (rank 1's are not); both ranks must put the plan's
    layers back at the same step, to the same formats (the canary's flags are summed over ranks)."""
    import lightning_snip.linear as linear
    from faults import broken_fp4_forward
    from lightning_snip.formats import Format

    torch.set_num_threads(1)
    pl.seed_everything(0)
    module = DemoLM(LlamaConfig(dim=64, num_layers=2, num_heads=4, num_kv_heads=2, hidden_dim=160))
    rank = int(os.environ.get("LOCAL_RANK", 0))
    data = ByteTextDataModule(seq_len=32, batch_size=8, val_batches=1, seed=rank)
    snip = SNIPCallback(SNIPConfig(overhead_budget=None, warmup_steps=10, interval=100, fp4_fraction=0.6, max_rows=128,
                                   candidate_formats=("fp8", "mxfp4")))  # (the fault is in mxfp4)
    reverts, seen = [], [0]

    class Fault(pl.Callback):
        def on_fit_start(self, trainer, pl_module):
            if trainer.global_rank == 0:
                linear.quantized_matmul = broken_fp4_forward(list(snip.layers.values()), Format.MXFP4, mode="noise")

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            count = snip.controller.guard.num_reverts + snip.controller.num_canary_reverts
            if count > seen[0]:
                reverts.append(trainer.global_step - 1)
                seen[0] = count

    trainer = pl.Trainer(
        max_steps=16, accelerator="cpu", devices=2, strategy="ddp", callbacks=[snip, Fault()], logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
    )
    trainer.fit(module, datamodule=data)
    weights = {n: float(p.detach().double().sum()) for n, p in module.named_parameters()}
    with open(os.path.join(out_dir, f"spike{trainer.global_rank}.json"), "w") as f:
        json.dump({"reverts": reverts, "plan": {k: v.value for k, v in snip.plan.items()}, "weights": weights,
                   "avoid": sorted(map(list, snip.controller.guard.avoid)), "guard": snip.controller.guard.state_dict()}, f)


def main(out_dir: str) -> None:
    torch.set_num_threads(1)
    pl.seed_everything(0)
    module = DemoLM(LlamaConfig(dim=64, num_layers=2, num_heads=4, num_kv_heads=2, hidden_dim=160))
    # Each rank samples its own data (different seeds): statistics differ, the plan must not.
    rank = int(os.environ.get("LOCAL_RANK", 0))
    data = ByteTextDataModule(seq_len=32, batch_size=8, val_batches=1, seed=rank)
    _record_reductions()
    snip = SNIPCallback(SNIPConfig(overhead_budget=None, warmup_steps=2, interval=4, fp4_fraction=0.6, max_rows=128, granularity="layer", target_scope="model",
                                   candidate_formats=("fp8", "mxfp4")))  # (the test reads mxfp4 by name)
    trainer = pl.Trainer(
        max_steps=6, accelerator="cpu", devices=2, strategy="ddp", callbacks=[snip], logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
    )
    trainer.fit(module, datamodule=data)
    weights = {n: float(p.detach().double().sum()) for n, p in module.named_parameters()}
    with open(os.path.join(out_dir, f"rank{trainer.global_rank}.json"), "w") as f:
        json.dump({"plan": {k: v.value for k, v in snip.plan.items()}, "weights": weights,
                   "formats": {k: l.format.value for k, l in snip.layers.items()}, "rounds": ROUNDS,
                   "sr_seed": snip.controller.sr_generator.initial_seed(),
                   "sampler": [type(trainer.train_dataloader.sampler).__name__,
                               getattr(trainer.train_dataloader.sampler, "rank", None)]}, f)


if __name__ == "__main__":
    (spike if sys.argv[2:] == ["spike"] else main)(sys.argv[1])
