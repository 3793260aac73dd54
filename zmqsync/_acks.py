"""Waiting for workers: their acks of a version, or a slot they all let go of.

A publish spends one deadline on two waits, both here: finding a slot no worker holds,
then collecting every target's ack. What happens when the deadline passes is decided
in one place (`AckWait.expired`): trio's ``fail_after`` ("raise": `PublishTimeout`)
versus ``move_on_after`` ("evict": the late workers are dropped and the publish goes on).

The waiting thread reads the acks itself (see `AckWait.until`): a thread hand-off per
ack cost more than the rest of the round trip on 2 cores.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable

from ._deadline import Deadline
from ._errors import ClosedError, PublishTimeout, ZmqSyncError
from ._publisher_agent import Agent, Shared
from ._registry import Meant

__all__ = ["FAST_COLLECT_S", "AckWait"]

log = logging.getLogger(__name__)

# How long a publishing thread reads acks itself before leaving the rest to the agent.
# The agent's heartbeats and evictions wait that long at most; fast publishes never leave.
FAST_COLLECT_S = 0.02


class AckWait:
    """A started publisher's waits on its workers, shared by every `Publish` handle.

    Args:
        shared: what the publisher shares with its agent (the role, locks, failure).
        agent: the agent thread that owns the sockets (for collecting and evicting).
        on_timeout: "raise" or "evict" (see the module doc).
        timeout: the publisher's default deadline, for a handle's ``wait()``.
    """

    def __init__(self, shared: Shared, agent: Agent, on_timeout: str, timeout: float | None):
        self.timeout = timeout
        self._shared = shared
        self._agent = agent
        self._on_timeout = on_timeout
        self._role = shared.role  # the publish bookkeeping: asked under `_cond`
        self._cond = shared.cond
        self._name = shared.role.name
        self.closed = False  # set by Publisher.close(): waits stop with ClosedError

    # --- what a handle asks --------------------------------------------------------

    def acked(self, version: int, targets: tuple[Meant, ...]) -> tuple[str, ...]:
        with self._cond:
            return tuple(self._role.acked(version, targets))

    def missing(self, version: int, targets: tuple[Meant, ...]) -> list[str]:
        with self._cond:
            return self._role.missing(version, targets)

    def lags(self, version: int, targets: tuple[Meant, ...]) -> dict[str, int]:
        with self._cond:
            return self._role.lags(version, targets)

    def wait(
        self, version: int, targets: tuple[Meant, ...], deadline: Deadline, max_lag: int = 0
    ) -> tuple[str, ...]:
        """Wait until every target applied `version - max_lag` or newer (max_lag=0: acked
        `version` itself); the targets that did (`expired` decides what happens to the
        others). A target that leaves the bus, or is dropped as silent, is not waited for.
        """
        floor = version - max_lag
        role = self._role
        self.until(role.all_acked(floor, targets), deadline)
        with self._cond:
            if missing := role.missing(floor, targets):
                self.check()
                acked = role.acked(floor, targets)
                what = (
                    "did not ack" if max_lag == 0 else f"did not apply v{floor} (max_lag={max_lag})"
                )
                self.expired(version, acked, missing, what)
            return tuple(role.acked(floor, targets))

    def took(self, seconds: float) -> None:
        """A publish ended (every target acked, or the late ones were evicted) `seconds`
        after publish() was called: count it in the publish histogram (metrics)."""
        self._role.took(seconds)

    def blocked(self, seconds: float, *, in_step: bool = False) -> None:
        """The training thread waited `seconds` for a version, inside publish() or (with
        `in_step`) in an optimizer step: count it for the metrics."""
        self._role.blocked(seconds, in_step)

    # --- slots -----------------------------------------------------------------------

    def free_slot(self) -> int | None:
        """A slot no worker holds now, or None."""
        with self._cond:
            return self._role.free_slot()

    def is_free(self, slot: int) -> bool:
        """Whether no worker holds `slot`."""
        with self._cond:
            return not self._role.holders(slot)

    def claim_slot(self, deadline: Deadline) -> int:
        """A slot no worker holds, waiting for acks to release one if need be."""
        role = self._role
        with self._cond:  # the common case: a slot is free now
            slot = role.free_slot()
        if slot is not None:
            return slot
        free: list[int | None] = [None]

        def found() -> bool:
            free[0] = role.free_slot()
            return free[0] is not None

        while True:
            self.until(found, deadline)
            with self._cond:
                if found():
                    return free[0]  # type: ignore[return-value]
                self.check()
                self.expired(role.latest + 1, (), role.blockers(), "still hold every slot")

    # --- the wait itself -------------------------------------------------------------

    def check(self) -> None:
        """Raise if nothing can be waited for any more: the agent failed, or the
        publisher was closed."""
        failure = self._shared.failure
        if failure is not None:
            raise ZmqSyncError(f"publisher {self._name!r} agent failed: {failure!r}") from failure
        if self.closed or self._agent.closed:
            raise ClosedError(f"Publisher {self._name!r} was closed while waiting")

    def until(self, ready: Callable[[], bool], deadline: Deadline) -> None:
        """Block until `ready()` (called under the condition) or the deadline.

        The waiting thread takes the sockets (`io`) and handles acks as they arrive, in
        turns of FAST_COLLECT_S so the agent can still send heartbeats: no thread
        hand-off per ack. A thread that finds the sockets taken (another waiter, or the
        agent for a moment) waits on the condition, which every registry change wakes.
        """
        io, cond, agent = self._shared.io, self._cond, self._agent
        while True:
            with cond:
                if ready():
                    return
                self.check()
            if deadline.expired():
                return
            if io.acquire(blocking=False):
                try:
                    self.check()
                    agent.collect(ready, Deadline(deadline.wait_s(FAST_COLLECT_S)))
                finally:
                    io.release()
            else:
                with cond:
                    if not ready():
                        cond.wait(deadline.wait_s(FAST_COLLECT_S))

    def expired(self, version: int, acked: Iterable[str], missing: list[str], what: str) -> None:
        """The deadline passed with `missing` workers late (caller holds the condition)."""
        self._role.timed_out()
        if self._on_timeout == "raise":
            raise PublishTimeout(
                f"version {version}: {len(missing)} worker(s) {what} in time "
                f"({', '.join(missing[:8])}); they may have died or be stuck — pass "
                'on_timeout="evict" to continue without them',
                version=version,
                acked=acked,
                missing=missing,
            )
        evicted = self._role.evict(missing, time.monotonic())
        log.info(
            "evicted %d worker(s) at version %d: %s", len(evicted), version, ", ".join(missing)
        )
        for member in evicted:
            session, worker = member.session.encode(), member.worker_id.encode()
            self._agent.command(b"evict %s %s" % (session, worker))
        self._cond.notify_all()
