"""The demo's LightningModule (TinyLlama + AdamW) and byte-level DataModule."""

from __future__ import annotations

import lightning.pytorch as pl
import torch

from lightning_snip.demo.data import ByteWindows, load_corpus, min_corpus_bytes, split_corpus
from lightning_snip.demo.model import LlamaConfig, TinyLlama


class DemoLM(pl.LightningModule):
    def __init__(self, model: LlamaConfig = LlamaConfig(), *, lr: float = 3e-3, weight_decay: float = 0.1,
                 lr_decay_start: int | None = None, lr_decay_steps: int = 1):
        """``lr_decay_start``/``lr_decay_steps``: linear decay of the learning rate to 0 over these
        steps (None: constant), e.g. to end a benchmark's continuation at a low-noise final iterate."""
        super().__init__()
        self.model = TinyLlama(model)
        self.lr, self.weight_decay = lr, weight_decay
        self.lr_decay_start, self.lr_decay_steps = lr_decay_start, max(1, lr_decay_steps)

    def configure_model(self) -> None:
        """Under FSDP2 (Lightning's ModelParallelStrategy; the app's ``trainer.strategy=fsdp2``):
        shard every block, then the rest, over the data-parallel mesh. Otherwise nothing."""
        mesh = self.device_mesh
        if mesh is None:
            return
        from torch.distributed.fsdp import fully_shard

        for block in self.model.layers:
            fully_shard(block, mesh=mesh["data_parallel"])
        fully_shard(self.model, mesh=mesh["data_parallel"])

    def snip_loss(self, batch) -> torch.Tensor:
        """The loss SNIPCallback's statistics rounds use (no logging side effects)."""
        return self.model.loss(batch)

    def training_step(self, batch, batch_idx):
        loss = self.model.loss(batch)
        self.log("train/loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx):
        loss = self.model.loss(batch)
        self.log("val/loss", loss, prog_bar=True, sync_dist=True)
        return loss

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=self.weight_decay, betas=(0.9, 0.95))
        start, length = self.lr_decay_start, self.lr_decay_steps

        def factor(step: int) -> float:  # a closure, so a resumed run keeps this run's schedule
            return 1.0 if start is None or step < start else max(0.0, 1.0 - (step - start) / length)

        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class WindowStream(torch.utils.data.distributed.DistributedSampler):
    """Window indices drawn uniformly with replacement, the i-th a function of (seed, i) alone, from
    index ``start`` on: one practically endless epoch that can be resumed at any position.

    With ``num_replicas`` > 1, rank r takes the stream's positions r, r + num_replicas, ... (from
    ``start``, a position in the whole stream): the ranks draw disjoint shares of one stream and
    together consume it as one process would. A DistributedSampler by type, so Lightning does not
    wrap it in its DistributedSamplerWrapper, which lists every index of the epoch on every rank (for
    this 10^8-window epoch, measured: 17 GB over 2 ranks and ~80 s at each start and resume). The
    sharding is written here because the stream is resumable and endless, which torch's and
    Lightning's distributed samplers (one finite shuffled permutation per epoch) are not."""

    CHUNK = 4096

    def __init__(self, num_windows: int, *, seed: int, start: int = 0, length: int = 10**8, num_replicas: int = 1,
                 rank: int = 0) -> None:
        # DistributedSampler.__init__ is not called: it needs a dataset and a process group, and
        # nothing of it is used (Lightning's set_epoch is a no-op: the epoch never ends).
        if num_replicas < 1 or not 0 <= rank < num_replicas:
            raise ValueError(f"WindowStream: rank {rank} is not in [0, num_replicas={num_replicas})")
        self.num_windows, self.seed, self.start, self.length = num_windows, seed, start, length
        self.num_replicas, self.rank, self.epoch = num_replicas, rank, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return len(range(self.start + self.rank, self.length, self.num_replicas))

    def __iter__(self):
        position, step = self.start + self.rank, self.num_replicas
        while position < self.length:
            chunk, offset = divmod(position, self.CHUNK)
            generator = torch.Generator().manual_seed(self.seed * 1_000_003 + chunk)
            count = len(range(position, min(self.length, (chunk + 1) * self.CHUNK), step))
            indices = torch.randint(self.num_windows, (self.CHUNK,), generator=generator)[offset::step][:count]
            yield from indices.tolist()
            position += count * step


class ByteTextDataModule(pl.LightningDataModule):
    """Windows of a byte corpus: shuffled training windows, a fixed held-out tail for validation."""

    def __init__(self, path: str | None = None, *, seq_len: int = 128, batch_size: int = 16,
                 val_fraction: float = 0.05, val_batches: int = 8, seed: int = 0):
        super().__init__()
        self.path, self.seq_len, self.batch_size = path, seq_len, batch_size
        self.val_fraction, self.val_batches, self.seed = val_fraction, val_batches, seed

    def load(self) -> torch.Tensor:
        """The corpus, checked to be long enough for one window in each split (ValueError naming
        data.path, the file's size and what is needed)."""
        need = min_corpus_bytes(self.seq_len, self.val_fraction)
        return load_corpus(self.path, min_bytes=need, why=(
            f" (one window of data.seq_len + 1 = {self.seq_len + 1} bytes in the validation split, "
            f"data.val_fraction = {self.val_fraction}, and in the training split)"))

    def setup(self, stage: str | None = None) -> None:
        train, val = split_corpus(self.load(), self.val_fraction)
        # Training windows start at every seq_len/2 offset: twice the distinct windows of a tiling.
        self.train_set = ByteWindows(train, self.seq_len, stride=max(1, self.seq_len // 2))
        val_set = ByteWindows(val, self.seq_len)
        count = min(len(val_set), self.val_batches * self.batch_size)
        self.val_set = torch.utils.data.Subset(val_set, range(count))

    def train_dataloader(self):
        # A resumed run continues the uninterrupted run's stream of windows: the sampler starts after
        # the windows the restored steps consumed (Lightning restarts a plain DataLoader from its start).
        # Under DDP / FSDP2 each data-parallel rank takes its share of the stream, the ranks Lightning's
        # distributed sampler would split it over (distributed_sampler_kwargs: under ModelParallelStrategy
        # the data-parallel mesh, not every process); with the Trainer's use_distributed_sampler=False
        # every rank gets the whole stream, the user's choice.
        start, replicas, rank = 0, 1, 0
        trainer = self.trainer
        if trainer is not None:
            shard = trainer.distributed_sampler_kwargs
            if shard and getattr(trainer._accelerator_connector, "use_distributed_sampler", True):
                replicas, rank = shard["num_replicas"], shard["rank"]
            start = trainer.global_step * trainer.accumulate_grad_batches * self.batch_size * replicas
        sampler = WindowStream(len(self.train_set), seed=self.seed, start=start, num_replicas=replicas, rank=rank)
        return torch.utils.data.DataLoader(self.train_set, batch_size=self.batch_size, sampler=sampler)

    def val_dataloader(self):
        return torch.utils.data.DataLoader(self.val_set, batch_size=self.batch_size)
