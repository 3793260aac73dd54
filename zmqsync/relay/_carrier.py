"""The root's relay thread at work: a version carried through the tree, against one deadline.

`Carrier.carry` is what the root's relay thread does with each version its subscriber
applies: (re-)form the generation if it must (PREPARE every connected relay, COMMIT
those READY in time, build the process group), post the sends and the notices, read the
relays' reports, and decide at the deadline. Its bookkeeping is the `Membership`; it
waits on the root's condition, which the agent thread notifies whenever the membership
changes. Every wait is bounded by the version's `Deadline` or by the root stopping.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch

from .._deadline import Deadline
from .._errors import ClosedError, PublishTimeout
from .._protocol import TensorSpec
from ._data_channel import DataChannel
from ._membership import Generation, Member, Membership, Verdict
from ._messages import RELAY, Commit, Evict, Prepare, Send
from ._root_agent import RootAgent
from ._wire import GroupThread, Wire, new_process_group

__all__ = ["Carrier", "Relayed", "Settings"]

log = logging.getLogger(__name__)

_LATE_FACTOR = 3  # on_timeout="raise": how many more deadlines to wait for late relays
# The relay thread waits for reports on the data channel in slices this long, then looks
# at what the agent thread changed (a relay lost, a failure reported on the control channel)
_REPORT_POLL_S = 0.005
_FINISH_POLL_S = 0.0005  # every relay has the version; gloo's send is finishing


@dataclass(frozen=True)
class Relayed:
    """One version carried to the relays: who has it, who is missing, how long it took."""

    version: int
    generation: int
    relays: tuple[str, ...]
    missing: tuple[str, ...]
    seconds: float
    nbytes: int


@dataclass(frozen=True)
class Settings:
    """The root's settings that carrying a version needs (see `RelayRoot`)."""

    tree: str
    name: str
    host: str
    backend: str
    device: torch.device | None
    ack: str
    on_timeout: str
    timeout: float  # one deadline per version
    heartbeat: float
    op_timeout: float  # of each collective
    form_wait: float  # for READYs
    form_timeout: float  # of building a group
    chunk_bytes: int


@dataclass(frozen=True, eq=False)
class _Group:
    """The current generation: its members (bookkeeping) and its process group (runner)."""

    generation: Generation
    runner: GroupThread

    @property
    def wire(self) -> Wire:
        wire = self.runner.wire
        assert wire is not None, "a formed group has its wire"
        return wire

    def close(self) -> None:
        self.generation.broken = True
        self.runner.close()


class Carrier:
    """Carries versions through the tree (see the module doc); the root's relay thread's.

    Args:
        settings: the root's settings.
        membership: the tree; read and changed only under `cond`.
        cond: the root's condition (the agent notifies it after every change).
        stopping: set when the root closes: every wait ends.
        agent: the control channel (PREPARE, COMMIT, EVICT, notices as a fallback).
        data: the data channel (notices, reports), or None.
        store: the rendezvous store the process groups are built on.
        relayed: called with each version's outcome.
        failed: called with a PublishTimeout when relays miss a deadline (raise mode).
    """

    def __init__(
        self,
        settings: Settings,
        membership: Membership,
        cond: threading.Condition,
        stopping: threading.Event,
        *,
        agent: RootAgent,
        data: DataChannel | None,
        store: Any,
        relayed: Callable[[Relayed], None],
        failed: Callable[[BaseException], None],
    ) -> None:
        self.settings = settings
        self._membership, self._cond, self._stopping = membership, cond, stopping
        self._agent, self._data, self._store = agent, data, store
        self._relayed, self._failed = relayed, failed
        self._group: _Group | None = None
        self._manifest: tuple[TensorSpec, ...] = ()
        self._slot_bytes = 0

    def needs_work(self) -> bool:
        """Between versions: the tree must be re-formed, or relays brought up to date.

        Reports that came after their version was finished (a late "acked") are applied
        first, and frames nobody reads otherwise are counted rather than left queued.
        """
        self._read_reports(0)
        with self._cond:
            group = self._group
            gen = group.generation if group is not None else None
            return self._membership.needs_distribution(gen, time.monotonic())

    def bus_changed(self) -> None:
        """The root bus is a new one: the generation ends before the next version."""
        with self._cond:
            if self._group is not None:
                self._group.generation.broken = True

    def close(self, join_s: float) -> None:
        """Drop the generation's group (after the relay thread stopped)."""
        with self._cond:
            group, self._group = self._group, None
        if group is not None:
            group.close()
            group.runner.join(join_s)

    def carry(self, version: int, flat: torch.Tensor, manifest: tuple[TensorSpec, ...]) -> None:
        """Carry `version` (its slot's bytes: `flat`; its tensors: `manifest`) to every
        relay, against one deadline. The membership holds the version already.

        At the deadline, "evict" drops the late relays and returns (the feed acks);
        "raise" records a PublishTimeout and keeps waiting for them (bounded: each relay's
        own wait has its local timeout, a silent relay is lost after ~6 heartbeats, and
        after `_LATE_FACTOR` more deadlines the version is acked without them).
        """
        m = self._membership
        self._manifest, self._slot_bytes = manifest, flat.numel()
        deadline = Deadline(self.settings.timeout)
        started = time.perf_counter()
        late: tuple[str, ...] | None = None  # raise mode, past the deadline: who was late

        def finish(group: _Group | None, done: tuple[str, ...], missing: tuple[str, ...]) -> None:
            gen = group.generation.number if group is not None else 0
            self._finish(version, gen, done, missing, started, flat.numel())

        def expired(group: _Group | None) -> bool:
            """The deadline passed: True when the version is finished (return)."""
            nonlocal late, deadline
            if late is None:
                verdict = self._on_deadline(version, group)
                late = verdict.missing
                if self.settings.on_timeout == "evict":
                    finish(group, verdict.done, verdict.missing)
                    return True
                deadline = Deadline(_LATE_FACTOR * self.settings.timeout)
                return False
            log.warning(
                "version %d: relay(s) %s still late after %.1f s more; acked without them",
                version,
                ", ".join(late),
                _LATE_FACTOR * self.settings.timeout,
            )
            finish(group, (), late)
            return True

        while True:
            if self._stopping.is_set():
                raise ClosedError("relay root closing")
            with self._cond:
                group = self._group
                reform = group is None or m.needs_reform(group.generation, time.monotonic())
            if reform:
                group = self._form(deadline)
                if group is None:
                    with self._cond:
                        nobody = not m.candidates()
                    if nobody:
                        finish(None, (), ())
                        return
                    if deadline.expired() and expired(None):
                        return
                    continue
            assert group is not None
            with self._cond:
                lagging = m.lagging(group.generation)
            if lagging and not self._transfer(group, lagging, version, flat, deadline):
                self._break(group)
                if deadline.expired() and expired(group):
                    return
                continue
            outcome = self._await(group, deadline)
            if outcome == "done":
                with self._cond:
                    done = m.done_by(group.generation)
                finish(group, done, ())
                return
            if outcome == "expired" and expired(group):
                return

    def _break(self, group: _Group) -> None:
        with self._cond:
            group.generation.broken = True
            if self._group is group:
                self._group = None
        group.close()

    def _form(self, deadline: Deadline) -> _Group | None:
        """PREPARE every connected relay, COMMIT those READY in time, build the group."""
        m = self._membership
        with self._cond:
            old, self._group = self._group, None
        if old is not None:
            old.close()  # first: its sockets close, so the relays' pending receives end now
        with self._cond:
            formation = m.prepare()
            if formation is None:
                return None
            prepares = [c.identity for c in formation.candidates]
        for identity in prepares:
            self._agent.send_to(identity, Prepare(self.settings.tree, formation.number))
        wait = Deadline(min(deadline.remaining() or 0.0, self.settings.form_wait))
        with self._cond:
            while not m.answered(formation):
                if wait.expired() or self._stopping.is_set():
                    break
                self._cond.wait(wait.wait_s(self.settings.heartbeat))
            gen = m.settle(formation, time.monotonic())
            if gen is None:
                return None
            commits = m.identities(gen)
        world = len(gen.members) + 1
        for identity, rank in commits:
            self._agent.send_to(identity, self._commit(gen, rank, world))
        runner = GroupThread(f"zmqsync-relay-{self.settings.name}-g{gen.number}")
        store = self._store
        prefix = f"zmqsync/{self.settings.name}/{self.settings.tree}/{gen.number}/"
        future = runner.submit(
            lambda: new_process_group(
                store,
                prefix,
                0,
                world,
                backend=self.settings.backend,
                host=self.settings.host,
                form_timeout=self.settings.form_timeout,
                op_timeout=self.settings.op_timeout,
            )
        )
        if not self._wait_future(future, deadline) or future.exception() is not None:
            reason = future.exception() if future.done() else "deadline"
            log.info("generation %d could not form: %s", gen.number, reason)
            runner.close()
            with self._cond:
                m.counters["formation_failures"] += 1
            return None
        runner.pg = future.result()
        runner.wire = Wire(
            runner.pg,
            self.settings.backend,
            self.settings.chunk_bytes,
            self.settings.op_timeout,
            self.settings.device,
        )
        group = _Group(gen, runner)
        with self._cond:
            m.formed(gen)
            self._group = group
            self._cond.notify_all()
        log.info("generation %d: %d relay(s): %s", gen.number, len(commits), ", ".join(gen.members))
        return group

    def _commit(self, gen: Generation, rank: int, world: int) -> Commit:
        return Commit(
            self.settings.tree,
            gen.number,
            rank,
            world,
            self.settings.backend,
            self.settings.op_timeout,
            self.settings.form_timeout,
            gen.bus,
            self._slot_bytes,
            self.settings.chunk_bytes,
            self._manifest,
        )

    def _wait_future(self, future: Future[Any], deadline: Deadline) -> bool:
        future.add_done_callback(lambda _f: self._notify())
        with self._cond:
            while not future.done():
                if deadline.expired() or self._stopping.is_set():
                    return False
                self._cond.wait(deadline.wait_s(self.settings.heartbeat))
        return True

    def _notify(self) -> None:
        with self._cond:
            self._cond.notify_all()

    def _transfer(
        self,
        group: _Group,
        lagging: list[Member],
        version: int,
        flat: torch.Tensor,
        deadline: Deadline,
    ) -> bool:
        """Send the bytes and announce them; True once every target reported it has them.

        The sends go first, posted on this thread: a relay has usually posted its receives
        already (see `Wire`), so the bytes flow while the notices travel.
        """
        m, gen = self._membership, group.generation
        everyone = len(lagging) == len(gen.members)
        ranks = sorted(r.rank for r in lagging)
        header = group.wire.header(gen.number, version, flat.numel())
        try:  # posted here, waited for on the executor: no thread hand-off before the bytes
            finish = group.wire.post_send(flat, header, ranks)
        except RuntimeError as exc:  # the group's connections are gone
            log.info("generation %d: sending v%d failed: %s", gen.number, version, exc)
            with self._cond:
                m.counters["transfer_failures"] += 1
            return False
        future = group.runner.submit(finish)
        notice = Send(
            self.settings.tree,
            gen.number,
            version,
            gen.bus,
            () if everyone else tuple(ranks),
            flat.numel(),
        )
        frame = RELAY.encode(notice)
        for r in lagging:
            self._send_notice(r, notice, frame)
        while True:
            with self._cond:
                if self._stopping.is_set():
                    raise ClosedError("relay root closing")
                if future.done() and future.exception() is not None:
                    log.info(
                        "generation %d: sending v%d failed: %s",
                        gen.number,
                        version,
                        future.exception(),
                    )
                    m.counters["transfer_failures"] += 1
                    return False
                arrived = m.arrived(gen, lagging)
                if future.done() and arrived:
                    m.finished(gen)  # re-form without the lost ones next time
                    return True
                if m.failing(gen) or deadline.expired():
                    return False
            # once every relay has it, only gloo's send is left to finish: look again soon
            self._read_reports(deadline.poll_ms(_FINISH_POLL_S if arrived else _REPORT_POLL_S))

    def _send_notice(self, relay: Member, notice: Send, frame: bytes) -> None:
        """On the data channel when the relay's data thread is connected to it; else on
        the control channel (through the agent), which every relay reads."""
        if self._data is not None and self._data.notify(relay.relay_id, frame):
            with self._cond:
                self._membership.counters["data_notices"] += 1
            return
        self._agent.send_to(relay.identity, notice)
        with self._cond:
            self._membership.counters["control_notices"] += 1

    def _read_reports(self, timeout_ms: int) -> None:
        """Wait up to `timeout_ms` for reports on the data channel and apply them (relay thread).

        Reports also arrive on the control channel (the agent applies those and notifies
        the condition); the callers look at the membership again after each slice.
        """
        data = self._data
        if data is None:
            with self._cond:
                self._cond.wait(timeout_ms / 1000)
            return
        reports, rejected = data.reports(timeout_ms)
        if not reports and not rejected:
            return
        now = time.monotonic()
        with self._cond:
            if rejected:
                self._membership.counters["rejected"] += rejected
            for report in reports:
                self._membership.report(report, now)

    def _await(self, group: _Group, deadline: Deadline) -> str:
        """Wait until every member reached the version: "done", "reform" or "expired"."""
        while True:
            with self._cond:
                if self._stopping.is_set():
                    raise ClosedError("relay root closing")
                if self._membership.complete(group.generation):
                    return "done"
                if group.generation.broken or group is not self._group:
                    return "reform"
                if deadline.expired():
                    return "expired"
            self._read_reports(deadline.poll_ms(_REPORT_POLL_S))

    def _on_deadline(self, version: int, group: _Group | None) -> Verdict:
        """trio's fail_after ("raise") versus move_on_after ("evict"): same deadline.

        Returns who reached the version and who missed it. "evict" drops the late relays
        (the caller finishes the version); "raise" records a PublishTimeout in
        `last_error` and leaves them in the tree.
        """
        agent = self._agent
        with self._cond:
            verdict = self._membership.deadline(
                group.generation if group is not None else None, time.monotonic()
            )
            for identity in verdict.evicted:
                agent.send_to(identity, Evict(self.settings.tree, f"evicted at version {version}"))
            if verdict.evicted and self._group is not None:
                self._group.generation.broken = True
        ids = verdict.missing
        if self.settings.on_timeout == "raise":
            verb = "have its workers ack" if self.settings.ack == "tree" else "receive"
            error = PublishTimeout(
                f"version {version}: {len(ids)} relay(s) did not {verb} it within "
                f"{self.settings.timeout:.1f} s ({', '.join(ids[:8])}); the relay root acks the "
                'version to its bus only once they have it — pass on_timeout="evict" to drop '
                "late relays",
                version=version,
                acked=list(verdict.done),
                missing=list(ids),
            )
            self._failed(error)
            log.warning("relay root: %s", error)
        elif ids:
            log.info("evicted %d relay(s) at version %d: %s", len(ids), version, ", ".join(ids))
        return verdict

    def _finish(
        self,
        version: int,
        gen: int,
        done: tuple[str, ...],
        missing: tuple[str, ...],
        started: float,
        nbytes: int,
    ) -> None:
        record = Relayed(version, gen, done, missing, time.perf_counter() - started, nbytes)
        with self._cond:
            self._membership.counters["relayed"] += 1
        self._relayed(record)
