"""When a model's loop acts and when it runs again: pure functions of a clock.

Inventory-driven changes wait until the pool has stayed the same for the settle window, so
flapping nodes cause no churn; a pool that changed with the spec (nodeSelector, tolerations) was
asked for and acts at once. Leaders are polled every `status_poll_seconds`. Each rule says how long
until its verdict may change, and the loop runs again at the earliest of those, or after the resync
period (controller-runtime's `Result{RequeueAfter}`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

# Look again this soon while a profiling pod runs, pods start or terminate (they change without
# other events at times), or after a reconcile failed.
RECHECK_SECONDS = 5.0


@dataclass(frozen=True)
class Pool:
    """The settle window's memory: the pool last seen, since when, and with which spec."""

    fingerprint: str = ""
    since: float = 0.0
    generation: int = -1       # the spec generation the pool was last seen with (-1: none yet)
    reconsidered: str = ""     # the pool a better plan was last looked for on


@dataclass(frozen=True)
class Settling:
    pool: Pool                 # to remember
    settled: bool              # inventory-driven changes may act
    reconsider: bool           # look for a clearly faster plan: once per settled pool
    wake_in: float | None      # seconds until the pool counts as settled (None: it does)

    def considered(self) -> Pool:
        """The pool to remember once a plan was chosen with `reconsider`."""
        return replace(self.pool, reconsidered=self.pool.fingerprint) if self.reconsider else self.pool


def settle(pool: Pool, fingerprint: str, generation: int, now: float, window: float) -> Settling:
    """The settle window at `now` for the pool `fingerprint`, seen with spec `generation`."""
    if fingerprint != pool.fingerprint:
        spec_changed = pool.generation not in (-1, generation)
        pool = replace(pool, fingerprint=fingerprint, since=float("-inf") if spec_changed else now)
    pool = replace(pool, generation=generation)
    waited = now - pool.since
    settled = waited >= window
    return Settling(pool, settled, reconsider=settled and pool.reconsidered != fingerprint,
                    wake_in=None if settled else window - waited + 0.01)


def poll_in(last: float, now: float, period: float) -> float | None:
    """Seconds until the leaders are due for a poll (0: now), or None when polling is off."""
    if period <= 0:
        return None
    return max(0.0, period - (now - last))


def requeue_after(resync: float, *waits: float | None) -> float:
    """When to run again: the earliest of the rules' waits, at the latest after `resync`."""
    return min([resync, *(w for w in waits if w is not None)])


def retry_after(resync: float, planned: float | None) -> float:
    """When to run again after a reconcile failed: soon, and no later than it had planned to."""
    return min(resync if planned is None else planned, RECHECK_SECONDS)
