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
        shared: what the publisher shares with its agent (registry, locks, failure).
        agent: the agent thread that owns the sockets (for collecting and evicting).
        on_timeout: "raise" or "evict" (see the module doc).
        timeout: the publisher's default deadline, for a handle's ``wait()``.
    """

    def __init__(self, shared: Shared, agent: Agent, on_timeout: str, timeout: float | None):
        self.timeout = timeout
        self._shared = shared
        self._agent = agent
        self._on_timeout = on_timeout
        self._registry = shared.role.registry
        self._cond = shared.cond
        self._name = shared.role.name
        self.closed = False  # set by Publisher.close(): waits stop with ClosedError

    # --- what a handle asks --------------------------------------------------------

    def acked(self, version: int, targets: tuple[Meant, ...]) -> tuple[str, ...]:
        with self._cond:
            return tuple(self._registry.acked(version, targets))

    def missing(self, version: int, targets: tuple[Meant, ...]) -> list[str]:
        with self._cond:
            return self._registry.missing(version, targets)

    def lags(self, version: int, targets: tuple[Meant, ...]) -> dict[str, int]:
        with self._cond:
            return self._registry.lags(version, targets)

    def wait(
        self, version: int, targets: tuple[Meant, ...], deadline: Deadline, max_lag: int = 0
    ) -> tuple[str, ...]:
        """Wait until every target applied `version - max_lag` or newer (max_lag=0: acked
        `version` itself); the targets that did (`expired` decides what happens to the
        others). A target that leaves the bus, or is dropped as silent, is not waited for.
        """
        floor = version - max_lag
        self.until(self._all_acked(floor, targets), deadline)
        with self._cond:
            if missing := self._registry.missing(floor, targets):
                self.check()
                acked = self._registry.acked(floor, targets)
                what = (
                    "did not ack" if max_lag == 0 else f"did not apply v{floor} (max_lag={max_lag})"
                )
                self.expired(version, acked, missing, what)
            return tuple(self._registry.acked(floor, targets))

    def took(self, seconds: float) -> None:
        """A publish ended (every target acked, or the late ones were evicted) `seconds`
        after publish() was called: count it in the publish histogram (metrics)."""
        self._shared.role.took(seconds)

    def blocked(self, seconds: float, *, in_step: bool = False) -> None:
        """The training thread waited `seconds` for a version, inside publish() or (with
        `in_step`) in an optimizer step: count it for the metrics."""
        self._shared.role.blocked(seconds, in_step)

    # --- slots -----------------------------------------------------------------------

    def free_slot(self) -> int | None:
        """A slot no worker holds now, or None."""
        with self._cond:
            return self._registry.free_slot()

    def is_free(self, slot: int) -> bool:
        """Whether no worker holds `slot`."""
        with self._cond:
            return not self._registry.holders(slot)

    def claim_slot(self, deadline: Deadline) -> int:
        """A slot no worker holds, waiting for acks to release one if need be."""
        with self._cond:  # the common case: a slot is free now
            slot = self._registry.free_slot()
        if slot is not None:
            return slot
        free: list[int | None] = [None]

        def found() -> bool:
            free[0] = self._registry.free_slot()
            return free[0] is not None

        while True:
            self.until(found, deadline)
            with self._cond:
                if found():
                    return free[0]  # type: ignore[return-value]
                self.check()
                blockers = self._registry.blockers()
                self.expired(self._registry.latest + 1, (), blockers, "still hold every slot")

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

    def _all_acked(self, version: int, targets: tuple[Meant, ...]) -> Callable[[], bool]:
        """A check, asked after every ack (under the condition), of whether no target is
        missing.

        Asking `Registry.missing` each time costs O(targets) per ack, O(N^2) per publish
        (64 workers: 4,096 lookups). This one keeps the targets not yet seen done and looks
        at the last of them: one lookup per ack while it has not acked, each target
        dropped once. Acks only grow and members only leave, so a dropped target stays
        done, except one that re-joins meanwhile: the full check runs once at the end.
        """
        registry, pending = self._registry, list(targets)

        def ready() -> bool:
            members = registry.members
            while pending:
                worker_id, process = pending[-1]
                member = members.get(worker_id)
                if member is not None and member.acked < version:
                    if not process or member.process == process:
                        return False
                pending.pop()
            missing = set(registry.missing(version, targets))
            pending.extend(t for t in targets if t[0] in missing)
            return not pending

        return ready

    def expired(self, version: int, acked: Iterable[str], missing: list[str], what: str) -> None:
        """The deadline passed with `missing` workers late (caller holds the condition)."""
        self._shared.role.counters["timeouts"] += 1
        if self._on_timeout == "raise":
            raise PublishTimeout(
                f"version {version}: {len(missing)} worker(s) {what} in time "
                f"({', '.join(missing[:8])}); they may have died or be stuck — pass "
                'on_timeout="evict" to continue without them',
                version=version,
                acked=acked,
                missing=missing,
            )
        evicted = self._shared.role.evict(missing, time.monotonic())
        log.info(
            "evicted %d worker(s) at version %d: %s", len(evicted), version, ", ".join(missing)
        )
        for member in evicted:
            session, worker = member.session.encode(), member.worker_id.encode()
            self._agent.command(b"evict %s %s" % (session, worker))
        self._cond.notify_all()
