"""The plan's solve, run on rank 0 in a background thread between a statistics round and the step its plan applies at,
and its outcome made the same on every rank."""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping
from dataclasses import dataclass

from lightning_snip.collective import Collective
from lightning_snip.config import SNIPConfig
from lightning_snip.evidence import solve_guarded
from lightning_snip.formats import Format
from lightning_snip.plan import Plan

logger = logging.getLogger("lightning_snip.controller")  # (its warnings are the controller's, as before the move)


@dataclass
class PendingSolve:
    """A solve started at ``stats_step`` whose plan takes effect at ``apply_step`` (rank 0 runs it)."""

    stats_step: int
    apply_step: int
    thread: threading.Thread | None = None
    plan: Plan | None = None
    error: BaseException | None = None

    def start(self, candidates, guarded: Mapping[str, frozenset[Format]], config: SNIPConfig,
              avoided: Mapping[str, frozenset[str]] | None = None) -> None:
        """Solve in a daemon thread (it never blocks exit)."""
        self.thread = threading.Thread(target=self._solve, args=(candidates, guarded, config, avoided), daemon=True,
                                       name="snip-solver")
        self.thread.start()

    def join(self, timeout: float) -> bool:
        """Wait at most ``timeout`` seconds for the solve; whether it has ended."""
        if self.thread is not None:
            self.thread.join(timeout)
        return self.thread is None or not self.thread.is_alive()

    def _solve(self, candidates, guarded, config: SNIPConfig, avoided=None) -> None:
        try:
            self.plan = solve_guarded(candidates, guarded, config, avoided)
        except BaseException as err:  # noqa: BLE001 - reported on the training thread at apply time
            self.error = err

    def outcome(self, collective: Collective) -> tuple[str | None, str | None]:
        """(the plan as JSON or None, the failure's cause or None), the same on every rank: rank 0 joins
        the thread (a failure logs a warning) and broadcasts."""
        message, error = None, None
        if collective.is_rank_zero:
            if self.thread is not None:
                self.thread.join()
            if self.error is not None:
                logger.warning("SNIP solve for step %d failed (%s: %s); keeping the current plan",
                               self.stats_step, type(self.error).__name__, self.error)
                error = f"solve for step {self.stats_step}: {type(self.error).__name__}: {self.error}"
            message = self.plan.to_json() if self.plan is not None else None
        return collective.broadcast((message, error))

