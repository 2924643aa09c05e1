"""How a process reaches the others of a data-parallel run: the one seam through which SNIP's controller talks to
other ranks (the callback builds it from the Trainer's strategy; a plain loop or a test passes its own)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Collective:
    """How this process reaches the others of a data-parallel run. ``all_sum`` sums a CPU tensor over
    ranks (and returns it on the CPU); ``broadcast`` returns rank 0's object on every rank. The
    defaults are a single process."""

    rank: int = 0
    world_size: int = 1
    all_sum: Callable[[torch.Tensor], torch.Tensor] = lambda values: values
    broadcast: Callable[[object], object] = lambda obj: obj

    @property
    def is_rank_zero(self) -> bool:
        return self.rank == 0


SINGLE_PROCESS = Collective()
