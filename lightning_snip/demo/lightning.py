"""The demo's LightningModule (TinyLlama + AdamW) and byte-level DataModule."""

from __future__ import annotations

import math
import re

import lightning.pytorch as pl
import torch
import torch.nn.functional as F

from lightning_snip.demo.data import ByteWindows, load_corpus, min_corpus_bytes, split_corpus
from lightning_snip.demo.model import LlamaConfig, TinyLlama
from lightning_snip.linear import SNIPLinear
from lightning_snip.stats import high_precision


def lr_factor(step: int, *, warmup_steps: int = 0, cosine_steps: int | None = None, min_lr_ratio: float = 0.1) -> float:
    """The learning rate's multiplier at ``step``: linear warmup over ``warmup_steps``, then (if
    ``cosine_steps``) cosine decay to ``min_lr_ratio`` at step ``cosine_steps``, constant after."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if cosine_steps is None:
        return 1.0
    progress = min(1.0, (step - warmup_steps) / max(1, cosine_steps - warmup_steps))
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


class CausalLM(pl.LightningModule):
    """Continued pretraining of a Hugging Face causal LM (``model(input_ids=...)`` returning
    ``.logits``, e.g. lightning_snip.hf.load_smollm2's): next-token cross-entropy on (inputs,
    targets) windows, AdamW, linear warmup then cosine decay to ``min_lr_ratio * lr`` at the
    Trainer's ``max_steps``.

    Logged: ``train/loss``; ``val/loss``, the held-out loss in high precision (every SNIPLinear in
    bf16, i.e. the run's own precision, as in the SNIP paper's evaluation) and ``val/loss_plan``, the
    same batches in the formats of the plan in force.

    The schedule follows the Trainer's ``max_steps``: a run resumed with a larger ``max_steps``
    stretches its cosine from there on, and the checkpoint's learning rate wins over a changed ``lr``
    (torch's LambdaLR restores its base rates).
    """

    def __init__(self, model: torch.nn.Module, *, lr: float = 3e-4, weight_decay: float = 0.1, warmup_steps: int = 0,
                 cosine: bool = True, min_lr_ratio: float = 0.1):
        super().__init__()
        self.model = model
        self.lr, self.weight_decay = lr, weight_decay
        self.warmup_steps, self.cosine, self.min_lr_ratio = warmup_steps, cosine, min_lr_ratio

    def snip_loss(self, batch) -> torch.Tensor:
        inputs, targets = batch
        logits = self.model(input_ids=inputs, use_cache=False).logits
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))

    def training_step(self, batch, batch_idx):
        loss = self.snip_loss(batch)
        self.log("train/loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx):
        loss_plan = self.snip_loss(batch)
        with high_precision({name: m for name, m in self.model.named_modules() if isinstance(m, SNIPLinear)}):
            loss = self.snip_loss(batch)
        self.log("val/loss", loss, sync_dist=True)
        self.log("val/loss_plan", loss_plan, sync_dist=True)
        return loss

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=self.weight_decay, betas=(0.9, 0.95))
        total = self.trainer.max_steps if self.cosine and self.trainer.max_steps > 0 else None
        warmup, floor = self.warmup_steps, self.min_lr_ratio

        def factor(step: int) -> float:  # a closure, so a resumed run keeps this run's schedule
            return lr_factor(step, warmup_steps=warmup, cosine_steps=total, min_lr_ratio=floor)

        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class DemoLM(pl.LightningModule):
    def __init__(self, model: LlamaConfig = LlamaConfig(), *, lr: float = 3e-3, weight_decay: float = 0.1,
                 lr_decay_start: int | None = None, lr_decay_steps: int = 1, warmup_steps: int = 0,
                 cosine: bool = False, min_lr_ratio: float = 0.1):
        """``lr_decay_start``/``lr_decay_steps``: linear decay of the learning rate to 0 over these
        steps (None: constant), e.g. to end a benchmark's continuation at a low-noise final iterate.
        ``warmup_steps``, ``cosine``, ``min_lr_ratio``: as CausalLM's (lr_factor)."""
        super().__init__()
        self.model = TinyLlama(model)
        self.lr, self.weight_decay = lr, weight_decay
        self.lr_decay_start, self.lr_decay_steps = lr_decay_start, max(1, lr_decay_steps)
        self.warmup_steps, self.cosine, self.min_lr_ratio = warmup_steps, cosine, min_lr_ratio

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
        """The loss SNIPCallback's statistics rounds use (no logging side effects): TinyLlama.loss's, through
        ``self.model(...)`` itself, so that a model compiled as ``self.model = torch.compile(self.model)`` runs its
        compiled forward (``self.model.loss`` would reach the original module's method and run it eagerly)."""
        inputs, targets = batch
        logits = self.model(inputs)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))

    def training_step(self, batch, batch_idx):
        loss = self.snip_loss(batch)
        self.log("train/loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx):
        loss = self.snip_loss(batch)
        self.log("val/loss", loss, prog_bar=True, sync_dist=True)
        return loss

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=self.weight_decay, betas=(0.9, 0.95))
        start, length = self.lr_decay_start, self.lr_decay_steps
        total = self.trainer.max_steps if self.cosine and self.trainer.max_steps > 0 else None
        warmup, floor = self.warmup_steps, self.min_lr_ratio

        def factor(step: int) -> float:  # a closure, so a resumed run keeps this run's schedule
            shape = lr_factor(step, warmup_steps=warmup, cosine_steps=total, min_lr_ratio=floor)
            return shape * (1.0 if start is None or step < start else max(0.0, 1.0 - (step - start) / length))

        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def _line_pieces(text: str, size: int):
    start = 0
    while start < len(text):
        match = _PIECE_END.search(text, start + size)
        end = len(text) if match is None else match.start()
        yield text[start:end]
        start = end


_PIECE_END = re.compile(r"(?<=\S)\n")  # a piece ends before a newline that ends a line of text


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
    """Windows of a text corpus, as bytes or as the tokens of ``tokenizer`` (a Hugging Face
    tokenizer: the model's own, for a pretrained model): shuffled training windows, a fixed held-out
    tail for validation."""

    def __init__(self, path: str | None = None, *, seq_len: int = 128, batch_size: int = 16,
                 val_fraction: float = 0.05, val_batches: int = 8, seed: int = 0, tokenizer=None):
        super().__init__()
        self.path, self.seq_len, self.batch_size = path, seq_len, batch_size
        self.val_fraction, self.val_batches, self.seed = val_fraction, val_batches, seed
        self.tokenizer = tokenizer
        self._corpus: torch.Tensor | None = None  # tokenized once (load() before fit, then setup())

    def load(self) -> torch.Tensor:
        """The corpus (bytes, or token ids with a tokenizer), checked to be long enough for one
        window in each split (ValueError naming data.path, its size and what is needed)."""
        if self._corpus is not None:
            return self._corpus
        need = min_corpus_bytes(self.seq_len, self.val_fraction)
        unit = "bytes" if self.tokenizer is None else "tokens"
        why = (f" (one window of data.seq_len + 1 = {self.seq_len + 1} {unit} in the validation split, "
               f"data.val_fraction = {self.val_fraction}, and in the training split)")
        if self.tokenizer is None:
            self._corpus = load_corpus(self.path, min_bytes=need, why=why)
            return self._corpus
        text = bytes(load_corpus(self.path).numpy()).decode("utf-8", errors="replace")
        # In pieces of whole lines (a tokenizer warns of, and some truncate, a text longer than the
        # model's context), cut just before a newline that follows a non-space character: byte-level
        # BPE's pre-tokenizer splits there anyway, so the ids are the whole text's (a cut after the
        # newline would merge "\n\n" at a piece's end into one token that the whole text splits).
        pieces = [piece for piece in _line_pieces(text, 8192)]
        ids = [i for piece in self.tokenizer(pieces, add_special_tokens=False)["input_ids"] for i in piece]
        if len(ids) < need:
            name = repr(self.path) if self.path else "the default corpus"
            raise ValueError(f"data.path: {name} holds {len(ids)} tokens; at least {need} are needed{why}")
        self._corpus = torch.tensor(ids, dtype=torch.int32)
        return self._corpus

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
