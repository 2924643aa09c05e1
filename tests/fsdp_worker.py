"""Run by test_fsdp.py: training with SNIPCallback under FSDP2 (Lightning's ModelParallelStrategy, the
model sharded with fully_shard in configure_model) on 2 CPU processes (gloo), or the same run in one
process (``single``). Both ranks read the same data, and the statistics rounds draw the same random
numbers on every rank, so the sharded run's divergences must equal the single-process ones. Writes
OUT_DIR/<mode>_rank<r>.json: plan, formats, the rounds' (reduced) divergences, weight shard types;
``resume`` restarts from the distributed checkpoint of ``fsdp`` and records the plan it restored."""

import json
import os
import sys

import lightning.pytorch as pl
import torch

import lightning_snip.controller as ctl
from lightning_snip.controller import SNIPController
from lightning_snip.callback import SNIPCallback
from lightning_snip.config import SNIPConfig
from lightning_snip.probes import unbatch_probes
from lightning_snip.demo.lightning import ByteTextDataModule, DemoLM
from lightning_snip.demo.model import LlamaConfig
from lightning_snip.formats import Format
from lightning_snip import statistics_round

statistics_round.DEFAULT_ROUND = statistics_round.RoundSettings(noise_draws=1)  # one error-probe draw per round, as the in-process tests (conftest.py)

MODEL = LlamaConfig(dim=64, num_layers=2, num_heads=4, num_kv_heads=2, hidden_dim=160)


class ShardedLM(DemoLM):
    def __init__(self, shard: bool, model: LlamaConfig = MODEL):
        super().__init__(model)
        self.shard = shard

    def configure_model(self):
        if not self.shard:
            return
        from torch.distributed.fsdp import fully_shard

        mesh = self.device_mesh["data_parallel"]
        for block in self.model.layers:
            fully_shard(block, mesh=mesh)
        fully_shard(self.model, mesh=mesh)


class _RestoredPlan(pl.Callback):
    def __init__(self, snip):
        self.snip, self.plan = snip, None

    def on_train_start(self, trainer, pl_module):
        self.plan = {k: v.value for k, v in self.snip.plan.items()} if self.snip.plan is not None else None


def _nan_on_rank_one() -> None:
    """Mode "fault": rank 1's MXFP4 forward output error of the mlp.down layers is NaN (a quantizer
    fault on one rank only); the ranks must agree to leave exactly those pairs out, or their
    collectives diverge."""
    import lightning_snip.loss_divergence as div
    from faults import nan_forward_weights

    def on_rank_one() -> bool:
        return torch.distributed.is_initialized() and torch.distributed.get_rank() == 1

    for name, fault in nan_forward_weights(Format.MXFP4, (64, 160), on_rank_one).items():
        setattr(div, name, fault)


def _count_gathers_in_rounds() -> dict:
    """Modes "gathers<L>": count, inside statistics rounds only, each FSDP2 parameter group's unshards
    (the all-gather of a block's parameters) and the DTensor.full_tensor calls (an all-gather of one
    tensor, e.g. a layer's weight for the round's GEMMs)."""
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup
    from torch.distributed.tensor import DTensor

    counts = {"in_round": False, "unshard": {}, "full_tensor": 0, "rounds": 0}
    unshard, full_tensor, round_ = FSDPParamGroup.unshard, DTensor.full_tensor, SNIPController.statistics_round

    def counted_unshard(self, *args, **kwargs):
        if counts["in_round"]:
            name = self._module_fqn or ""  # "" for the root group (embedding, norm, head)
            counts["unshard"][name] = counts["unshard"].get(name, 0) + 1
        return unshard(self, *args, **kwargs)

    def counted_full_tensor(self, *args, **kwargs):
        counts["full_tensor"] += counts["in_round"]
        return full_tensor(self, *args, **kwargs)

    def counted_round(self, *args, **kwargs):
        counts["in_round"] = True
        try:
            return round_(self, *args, **kwargs)
        finally:
            counts["in_round"] = False
            counts["rounds"] += 1

    FSDPParamGroup.unshard, DTensor.full_tensor, SNIPController.statistics_round = (
        counted_unshard, counted_full_tensor, counted_round)
    return counts


def main(out_dir: str, mode: str) -> None:
    torch.set_num_threads(1)
    pl.seed_everything(0)
    real = ctl.round_generator
    ctl.round_generator = lambda device, step, rank: real(device, step, 0)  # the same draws on every rank
    if mode == "fault":
        _nan_on_rank_one()
    single = mode in ("single", "bf16_single")
    gathers = _count_gathers_in_rounds() if mode.startswith("gathers") else None
    model = MODEL if gathers is None else LlamaConfig(dim=64, num_layers=int(mode[len("gathers"):]), num_heads=4,
                                                      num_kv_heads=2, hidden_dim=160)
    module = ShardedLM(shard=not single, model=model)
    if mode == "bf16_single":
        # FSDP2 runs the WD probes one pass each; batched, bf16 autocast rounds their tangents along other
        # GEMM paths (~1% apart, tests/test_probes.py): compare the same arithmetic.
        unbatch_probes(module)
    data = ByteTextDataModule(seq_len=32, batch_size=8, val_batches=1, seed=0)  # the same data on both ranks
    snip = SNIPCallback(SNIPConfig(overhead_budget=None, warmup_steps=2, interval=3, fp4_fraction=0.6, max_rows=128,
                                   candidate_formats=("fp8", "mxfp4"),  # (the fault and the test read mxfp4)
                                   initial_format="fp8", granularity="layer",
                                   target_scope="model"))
    restored = _RestoredPlan(snip)
    if single:
        strategy, devices = "auto", 1
    else:
        from lightning.pytorch.strategies import ModelParallelStrategy

        strategy, devices = ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1), 2
    trainer = pl.Trainer(
        max_steps=8 if mode == "resume" else 4 if gathers is not None else 6, accelerator="cpu", devices=devices, strategy=strategy,
        precision="bf16-mixed" if mode.startswith("bf16") else "32-true",
        callbacks=[snip, restored], logger=False, enable_progress_bar=False, enable_model_summary=False,
        # Validation right before the rounds: FSDP2 leaves its root unsharded after a forward without
        # backward, which the round must handle.
        limit_val_batches=1, val_check_interval=2, check_val_every_n_epoch=None,
        default_root_dir=out_dir, enable_checkpointing=False, use_distributed_sampler=False,
    )
    ckpt = os.path.join(out_dir, "fsdp.ckpt")
    trainer.fit(module, datamodule=data, ckpt_path=ckpt if mode == "resume" else None)
    if mode == "fsdp":
        trainer.save_checkpoint(ckpt)
    weight = module.model.layers[0].attn.q.weight
    with open(os.path.join(out_dir, f"{mode}_rank{trainer.global_rank}.json"), "w") as f:
        json.dump({"plan": {k: v.value for k, v in snip.plan.items()},
                   "invalid": [[fqn, fmt.value] for fqn, fmt in snip.invalid_formats],
                   "formats": {k: layer.format.value for k, layer in snip.layers.items()},
                   "rounds": [entry["divergence"] for entry in snip.history],
                   "plans": [entry["plan"]["formats"] for entry in snip.history if "plan" in entry],
                   "restored_plan": restored.plan, "num_stats_rounds": snip.num_stats_rounds,
                   "weight_type": type(weight).__name__, "layer_type": type(module.model.layers[0].attn.q).__name__,
                   "loss": float(trainer.callback_metrics["train/loss"]),
                   "gathers": None if gathers is None else {
                       "rounds": gathers["rounds"], "full_tensor": gathers["full_tensor"],
                       "unshard": gathers["unshard"], "layers": len(snip.layers)}}, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
