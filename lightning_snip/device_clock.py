"""SNIP's clock: when the training steps and SNIP's own work ran on the device, fed to the budget in order.

On a CPU nothing is asynchronous: the host clock at a hook is the time the work before it finished, and the budget
hears of each time at once. On a GPU the host runs ahead of the kernels it launches: a step timed on the host counts
its launches, not its kernels, and the first host sync in SNIP's work (a round's reduction) counts the queued
training work as SNIP's. There each time is a CUDA event recorded on the current stream at the hook (no sync), and
the budget hears of it only once the device has passed it (``Event.query``), in the order the hooks ran: the step
boundaries, and which steps SNIP worked in, replay against the device's timeline a few steps late. Decisions that
read times wait for the stamps they need: a round's schedule (``seconds_since`` at its end, where the round has
synchronised already), a checkpoint and the end of training (``flush(wait=True)``).

Written by hand: torch gives the events (torch.cuda.Event), but neither torch nor Lightning keeps a deferred
timeline of hooks (Lightning's Timer callback and its profilers time the host).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

import torch

from lightning_snip.budget import OverheadBudget


class EventStamp:
    """A point on a CUDA stream's timeline: ``stream``'s (default: the current device's current stream). Its seconds
    are chained from the stamp recorded before it (the previous stamp's seconds, a double, plus the float32
    milliseconds between the two events): from one origin, float32 would lose milliseconds within hours of a run."""

    __slots__ = ("event", "previous", "_seconds")

    def __init__(self, previous: EventStamp | None = None, stream: torch.cuda.Stream | None = None) -> None:
        self.event = torch.cuda.Event(enable_timing=True)
        self.event.record(stream)  # (the event is created on the stream's device)
        self.previous = previous
        self._seconds: float | None = None if previous is not None else 0.0

    def ready(self) -> bool:
        return self.event.query()

    def wait(self) -> None:
        self.event.synchronize()

    def seconds(self) -> float:
        if self._seconds is None:  # (the stamps before it are done: a stream runs in order)
            previous = self.previous
            self._seconds = previous.seconds() + previous.event.elapsed_time(self.event) / 1000.0  # (milliseconds)
            self.previous = None  # (the chain is not kept)
        return self._seconds


class Timeline:
    """Feeds ``budget`` (lightning_snip.budget.OverheadBudget) the times of the hooks, read on ``device``'s timeline.

    ``step_started(step)``, ``batch_ended()`` and ``mark(kind, next_step=...)`` take the place of the budget's calls of
    the same names: each is replayed on the budget, in order, once every stamp before it has resolved. ``stamp()``
    and ``seconds_since(stamp)`` time a stretch of SNIP's work (waiting for its end). ``clock``: the host clock used
    where the device is not a GPU (a test may set its own); ``stamps``: how a stamp is taken there (a test may give
    late-resolving ones: anything with ``ready()``, ``wait()`` and ``seconds()``).
    """

    def __init__(self, budget: OverheadBudget) -> None:
        self.budget = budget
        self.clock: Callable[[], float] = time.perf_counter
        self.stamps: Callable[[], object] | None = None  # None: the host clock (set by use_device on a GPU)
        self._last_event: EventStamp | None = None  # the latest CUDA stamp (the next one chains from it)
        self._device: torch.device | None = None  # the CUDA device whose current stream the stamps are recorded on
        self._queue: deque[tuple[Callable, tuple]] = deque()

    def use_device(self, device: torch.device | str) -> None:
        """Stamp with CUDA events on a CUDA device (its current stream, where the model's work runs, whichever device
        is current on the host), with the host clock elsewhere."""
        device = torch.device(device)
        self._device = device if device.type == "cuda" else None
        self.stamps = self._event if self._device is not None else None

    def _event(self) -> EventStamp:
        self._last_event = EventStamp(self._last_event, torch.cuda.current_stream(self._device))
        return self._last_event

    def stamp(self):
        """Now, on the timeline: a float (seconds) on the host clock, or a stamp that resolves later."""
        return self.clock() if self.stamps is None else self.stamps()

    # ------------------------------------------------------------------ the budget's calls, replayed in order

    def step_started(self, step: int) -> None:
        if not self.budget.anchored:  # the schedule, not a time: at once (a round check follows in this step)
            self.budget.anchor(step)
        self._feed(self.budget.step_started, step, self.stamp())

    def batch_ended(self) -> None:
        self._feed(self.budget.batch_ended, self.stamp())

    def mark(self, kind: str, *, next_step: bool = False) -> None:
        self._feed(lambda kind, next_step: self.budget.mark(kind, next_step=next_step), kind, next_step)

    def _feed(self, call: Callable, *args) -> None:
        self._queue.append((call, args))
        self.flush()

    def flush(self, *, wait: bool = False) -> None:
        """Replay the calls whose stamps have resolved (``wait``: all of them, waiting for the device)."""
        while self._queue:
            call, args = self._queue[0]
            stamps = [arg for arg in args if _is_stamp(arg)]
            if not all(stamp.ready() for stamp in stamps):
                if not wait:
                    return
                for stamp in stamps:
                    stamp.wait()
            self._queue.popleft()
            call(*(arg.seconds() if _is_stamp(arg) else arg for arg in args))

    def discard(self) -> None:
        """Drop the calls not replayed yet (a checkpoint's state replaces what they would have changed)."""
        self._queue.clear()

    @property
    def pending(self) -> int:
        """Calls not replayed yet (their stamps unresolved)."""
        return len(self._queue)

    def seconds_since(self, start) -> float:
        """The seconds from ``start`` (a ``stamp()``) to now on the timeline, waiting for the device to get there; the
        budget is brought up to date on the way (its decisions read it)."""
        end = self.stamp()
        self.flush(wait=True)
        if not _is_stamp(end):
            return end - start
        end.wait()
        return end.seconds() - start.seconds()


def _is_stamp(value) -> bool:
    return hasattr(value, "ready")
