"""The main job: SNIP training of the demo model on the bundled corpus (a Hydra application).

    python -m lightning_snip.train trainer.max_steps=60 snip.warmup_steps=10 snip.interval=20 snip.fp4_fraction=0.8
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import hydra
from omegaconf import DictConfig, OmegaConf

from lightning_snip.config import TrainConfig, register_configs

CONF_DIR = str(Path(__file__).resolve().parent.parent / "conf")
logger = logging.getLogger(__name__)


def to_config(cfg: DictConfig) -> TrainConfig:
    """Hydra's composed config -> the validated frozen dataclasses (runs every __post_init__)."""
    return OmegaConf.to_object(cfg)


def run(config: TrainConfig) -> dict:
    """Train the demo with SNIPCallback; return the summary (also printed)."""
    import lightning.pytorch as pl
    import torch
    from lightning.pytorch.loggers import TensorBoardLogger

    from lightning_snip.callback import SNIPCallback
    from lightning_snip.demo.lightning import ByteTextDataModule, DemoLM

    t = config.trainer
    pl.seed_everything(t.seed, workers=True)
    if not torch.cuda.is_available():
        torch.set_num_threads(max(1, torch.get_num_threads()))
    module = DemoLM(config.model, lr=t.lr, weight_decay=t.weight_decay)
    data = ByteTextDataModule(config.data.path, seq_len=config.data.seq_len, batch_size=config.data.batch_size,
                              val_fraction=config.data.val_fraction, val_batches=config.data.val_batches, seed=t.seed)
    snip = SNIPCallback(config.snip)
    tb = TensorBoardLogger(save_dir=t.output_dir, name="snip")
    trainer = pl.Trainer(
        max_steps=t.max_steps, accelerator=t.accelerator, devices=t.devices, strategy=t.strategy, precision=t.precision,
        logger=tb, callbacks=[snip], log_every_n_steps=t.log_every_n_steps,
        val_check_interval=min(t.val_check_interval, t.max_steps), check_val_every_n_epoch=None,
        enable_model_summary=False, enable_progress_bar=False,
    )
    start = time.perf_counter()
    trainer.fit(module, datamodule=data)
    seconds = time.perf_counter() - start
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
    summary = {
        "steps": trainer.global_step,
        "seconds": seconds,
        "train_loss": metrics.get("train/loss"),
        "val_loss": metrics.get("val/loss"),
        "fp4_fraction": snip.plan.fp4_fraction if snip.plan else 0.0,
        "plans_applied": snip.num_plans_applied,
        "log_dir": tb.log_dir,
    }
    if trainer.is_global_zero:
        print("\n=== SNIP summary ===")
        if snip.plan is not None:
            print(snip.plan.table())
        else:
            print(f"no SNIP plan yet (first statistics round at step {config.snip.warmup_steps}); all layers in {config.snip.initial_format}")
        print(f"steps {summary['steps']} in {seconds:.1f} s; train loss {summary['train_loss']}; val loss {summary['val_loss']}")
        print(f"FP4 FLOPs fraction {summary['fp4_fraction']:.3f}; plans applied {summary['plans_applied']}")
        print(f"TensorBoard logs: {summary['log_dir']}  (tensorboard --logdir {t.output_dir})")
    return summary


register_configs()


@hydra.main(version_base=None, config_path=CONF_DIR, config_name="config")
def main(cfg: DictConfig) -> None:
    run(to_config(cfg))


if __name__ == "__main__":
    main()
