"""Each optimizer step's loss for the loss watch, kept on the device and read a few steps late.

On an asynchronous device every read of a device value on the host (``.item()``, ``.cpu()``, a collective whose
result the host needs) waits for the queue of launched work to drain. The loss watch needs each step's loss (the
micro-batches' losses summed on the device: Lightning divides each by accumulate_grad_batches, so the sum is the
step's mean) and whether its gradients were finite, averaged over ranks so that every rank decides alike. So the
losses stay on the device until READ_EVERY steps have closed, and then one stacked tensor is summed over ranks and
read in one copy: outside SNIP's own steps, one host read per READ_EVERY steps and none in between. The watch
then sees those steps in order, so a revert lands at most READ_EVERY - 1 steps later than a per-step read would
have made it. The steps SNIP works in (a round, a switch, a canary) read what is pending first, so each plan's
watch starts from every loss before it.

The gradients' finiteness (checked in the GRADIENT_STEPS steps after a switch, lightning_snip.spike_guard) is
decided on the device too: a non-finite gradient norm zeroes this rank's gradients in place (AdamW then steps by
its momentum alone instead of writing NaN into the weights) with no host read; the flag joins the next read, where
the sum over ranks makes the guard's revert the same on every rank. Under DDP the gradients are the same on every
rank, so every rank zeroes alike; under FSDP2 each rank zeroes the shard it holds.

Written here: Lightning logs a step's loss, but keeps no device-side window of it for a callback to read late.
"""

from __future__ import annotations

import logging

import torch

logger = logging.getLogger(__name__)

READ_EVERY = 8  # closed steps whose losses one host read brings back (the loss watch's most lag, in steps)


class StepLosses:
    """The losses of closed optimizer steps, on the device until ``read``."""

    def __init__(self, read_every: int = READ_EVERY) -> None:
        self.read_every = read_every
        self.step, self.total, self.bad = -1, None, None  # the open step: its loss so far, its gradients' flag
        self.pending: list[tuple[int, torch.Tensor, torch.Tensor | None]] = []  # closed steps not read yet
        self.warned = False

    def begin(self, step: int) -> None:
        if step != self.step:
            self.step, self.total, self.bad = step, None, None

    def end(self, outputs, global_step: int) -> bool:
        """Add a micro-batch's loss (``outputs``: training_step's return); whether its step closed (the optimizer
        stepped: ``global_step`` moved on), which puts the step among the pending ones."""
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        if isinstance(loss, torch.Tensor):
            loss = loss.detach().float().reshape(())
            self.total = loss if self.total is None else self.total + loss
        elif not self.warned:  # (manual optimization may return nothing)
            self.warned = True
            logger.warning("SNIP spike guard: the training step returned no loss (a tensor, or a dict with 'loss'); "
                           "the guard watches nothing in this run (snip.spike_threshold=null silences this)")
        if global_step == self.step or self.total is None:
            return False
        self.pending.append((self.step, self.total, self.bad))
        self.total, self.bad = None, None
        return True

    @property
    def full(self) -> bool:
        """READ_EVERY closed steps are pending: time for a read."""
        return len(self.pending) >= self.read_every

    def check_gradients(self, module: torch.nn.Module) -> None:
        """Zero this rank's gradients in place if any is not finite, on the device (no host read); the flag is
        read with the step's loss."""
        grads = [p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
                 for p in module.parameters() if p.grad is not None]
        if not grads:
            return
        bad = torch.logical_not(torch.isfinite(torch.nn.utils.get_total_norm(grads)))
        for grad in grads:
            grad.masked_fill_(bad, 0.0)
        self.bad = bad if self.bad is None else torch.logical_or(self.bad, bad)

    def read(self, all_sum, world_size: int) -> list[tuple[int, float, bool]]:
        """The pending steps' (step, loss averaged over ranks, gradients finite on every rank), in order: one
        stacked tensor, one sum over ranks (``all_sum``, a Collective's), one copy to the host."""
        if not self.pending:
            return []
        device = self.pending[-1][1].device  # (steps restored from a checkpoint are on the CPU)
        losses = [loss.to(device) for _, loss, _ in self.pending]
        flags = [loss.new_zeros(()) if bad is None else bad.to(loss) for loss, (_, _, bad) in zip(losses, self.pending)]
        values = all_sum(torch.stack([*losses, *flags])).tolist()
        steps, count = [step for step, _, _ in self.pending], len(self.pending)
        self.pending = []
        return [(step, values[i] / world_size, values[count + i] == 0) for i, step in enumerate(steps)]

    def state_dict(self) -> dict:
        """The pending steps as host numbers (a checkpoint reads them: one copy then), this rank's."""
        return {"pending": [[step, float(loss), bad is not None and bool(bad)] for step, loss, bad in self.pending]}

    def load_state_dict(self, state: dict) -> None:
        """Pending steps from a checkpoint (rank 0's on every rank: their sum over ranks averages to it)."""
        self.pending = [(int(step), torch.tensor(float(loss)), torch.tensor(bool(bad)) if bad else None)
                        for step, loss, bad in state.get("pending", [])]
