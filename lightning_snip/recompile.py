"""Dynamo's recompile limit, kept ahead of the format assignments SNIP applies.

Under torch.compile each SNIPLinear's formats are a guard (lightning_snip/linear.py): every distinct assignment
a compiled frame meets is one more graph in that frame's cache, and at ``torch._dynamo.config.recompile_limit``
(8 by default; ``accumulated_recompile_limit``, 256, caps every code object) dynamo stops compiling the frame
and runs it eagerly for the rest of the process, with one warning of its own. A model compiled block by block
(``block.compile()`` on each block of a ModuleList: the blocks share one code object) meets one assignment per
distinct block in a single plan, so one per-layer plan can reach the limit; a model compiled whole meets one
per plan. CompiledPlans counts both from the layers' names and raises the limits before they are reached.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

from lightning_snip.linear import SNIPLinear

logger = logging.getLogger(__name__)

MAX_RECOMPILE_LIMIT = 1024
"""The highest recompile limit SNIP sets: every cache entry is a compiled graph kept in memory and a recompile
paid in time; a run whose plans need more is told, not given an unbounded cache."""

_LIMITS = ("recompile_limit", "accumulated_recompile_limit")
_OLD_NAMES = {"recompile_limit": "cache_size_limit", "accumulated_recompile_limit": "accumulated_cache_size_limit"}


class CompiledPlans:
    """The distinct format assignments applied to a model's SNIPLinears, per frame they could be compiled in.

    Call ``note_plan(layers)`` after every change of the layers' formats (attach, an applied plan, a revert),
    before the next forward. A frame is the whole model (key ``""``) or every module at a numbered position of
    the model (``layers.3``, grouped as ``layers.*``: a ModuleList's blocks, which share their code); its
    assignment is the tuple of its layers' (forward format, backward format, recipe), what the guards read.
    Counting a frame that is not compiled on its own only raises the limit higher than needed.
    """

    def __init__(self) -> None:
        self.seen: dict[str, set[tuple]] = {}  # frame group -> the distinct assignments its frames met
        self.warned = False  # the cap's warning is said once

    def note_plan(self, layers: Mapping[str, SNIPLinear]) -> dict[str, int]:
        """Count the formats now in force; where the next plan could take a frame past dynamo's limits, raise
        them (never lower them). Returns the limits raised, name -> new value ({} when none was).

        The limits are process-wide settings of torch._dynamo (no per-frame one reaches a model the user
        compiled): raising them also lets the user's other frames recompile more before falling back."""
        instances: dict[str, dict[str, list]] = {}  # group -> instance -> its layers' assignments, in module order
        for fqn, layer in layers.items():
            assignment = (layer.format, layer.backward_format or layer.format, layer.recipe)
            instances.setdefault("", {}).setdefault("", []).append(assignment)
            parts = fqn.split(".")
            for i, part in enumerate(parts[:-1]):
                if part.isdigit():
                    group = ".".join("*" if p.isdigit() else p for p in parts[:i + 1])
                    instances.setdefault(group, {}).setdefault(".".join(parts[:i + 1]), []).append(assignment)
        # A frame's cache after the next plan: the assignments met so far, plus one per instance (the next plan
        # may give each block a new one).
        needed = 0
        for group, members in instances.items():
            seen = self.seen.setdefault(group, set())
            seen.update(tuple(assignments) for assignments in members.values())
            needed = max(needed, len(seen) + len(members))
        return self._raise_limits(needed)

    @property
    def num_assignments(self) -> int:
        """The most distinct assignments any frame group has met."""
        return max((len(seen) for seen in self.seen.values()), default=0)

    def _raise_limits(self, needed: int) -> dict[str, int]:
        from torch._dynamo import config

        names = [name if hasattr(config, name) else _OLD_NAMES[name] for name in _LIMITS]  # (older torch's names)
        raised, before = {}, {}
        for name in names:
            current = getattr(config, name)
            # Doubled, not raised to the count: a long run's raises (and their lines) stay few.
            target = min(max(needed, 2 * current), MAX_RECOMPILE_LIMIT)
            if needed > current and target > current:
                setattr(config, name, target)
                raised[name], before[name] = target, current
        if raised:
            logger.info("SNIP: %d distinct format assignments so far (under torch.compile, a graph each); raised "
                        "torch._dynamo.config's %s (process-wide settings) so compiled frames do not fall back to "
                        "eager", self.num_assignments,
                        ", ".join(f"{name} from {before[name]} to {value}" for name, value in raised.items()))
        if not self.warned and any(needed > getattr(config, name) for name in names):
            self.warned = True
            logger.warning("SNIP: %d distinct format assignments so far; under torch.compile the next plan may need "
                           "more graphs per frame than torch._dynamo.config.%s (%d; SNIP raises it to at most %d), and "
                           "a frame past it runs eagerly: fewer plans (a larger interval, or replan=False) keep it "
                           "compiled", self.num_assignments, names[0], getattr(config, names[0]), MAX_RECOMPILE_LIMIT)
        return raised
