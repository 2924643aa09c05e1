"""Add SNIP to a Lightning Trainer: the only change to a training script is the callback."""

import lightning.pytorch as pl

from lightning_snip import SNIPCallback, SNIPConfig
from lightning_snip.demo.lightning import ByteTextDataModule, DemoLM
from lightning_snip.demo.model import LlamaConfig


def main(max_steps: int = 30) -> SNIPCallback:
    snip = SNIPCallback(SNIPConfig(warmup_steps=5, interval=10, fp4_fraction=0.75, pins={"*lm_head": "bf16"}))
    trainer = pl.Trainer(max_steps=max_steps, callbacks=[snip], accelerator="cpu", limit_val_batches=0,
                         enable_progress_bar=False, default_root_dir="snip_runs/example")
    trainer.fit(DemoLM(LlamaConfig(dim=64, num_layers=2, hidden_dim=160)), datamodule=ByteTextDataModule(seq_len=64, batch_size=8))
    print(snip.plan.table())
    return snip


if __name__ == "__main__":
    main()
