"""One look at a bus, the same whether it came from a `Publisher` in this process or from
a STATE answer over the control socket: what the metrics and ``zmqsync top`` show.

A worker's lag is the one `_registry.lag` computes (what ``Publisher.workers[id].lag``
and inspect say): the publisher's latest version minus the last version the worker
acked, None before its first ack. An in-process publisher's is taken as it reports it;
a STATE's is computed from the same two numbers. No I/O: the callers read the sources.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping
from typing import Any

from ._registry import lag

__all__ = ["BusSample", "WorkerSample", "from_publisher", "from_state"]


@dataclasses.dataclass(frozen=True)
class WorkerSample:
    """One worker as the publisher last saw it."""

    worker_id: str
    pid: int
    host: str
    mode: str
    transport: str
    version: int  # last acked, -1 before the first ack
    silent_s: float  # seconds since its last message
    lag: int | None  # versions behind the publisher's latest; None before its first ack


@dataclasses.dataclass(frozen=True)
class BusSample:
    """A bus at one moment: its publisher's version, workers and counters.

    `slots`, `slot_versions` and `version_bytes` are known from STATE only (None or
    empty for an in-process publisher, which does not expose them).
    """

    name: str
    bus_id: str
    pid: int
    version: int
    workers: tuple[WorkerSample, ...]
    counters: Mapping[str, int]
    slots: int | None = None
    slot_versions: tuple[int, ...] = ()
    version_bytes: int | None = None


def from_state(state: Any) -> BusSample:
    """A sample from a STATE message (`_protocol.State`), as INSPECT returns it."""
    latest = state.version
    workers = tuple(
        WorkerSample(
            w.worker_id,
            w.pid,
            w.host,
            w.mode,
            w.transport,
            w.version,
            w.last_seen,
            lag(latest, w.version),
        )
        for w in state.workers
    )
    return BusSample(
        name=state.name,
        bus_id=state.bus,
        pid=state.pid,
        version=latest,
        workers=workers,
        counters=dict(state.counters),
        slots=state.slots,
        slot_versions=tuple(state.slot_versions),
        version_bytes=sum(spec.nbytes for spec in state.manifest),
    )


def from_publisher(pub: Any, pid: int) -> BusSample:
    """A sample from a `Publisher` of this process, through its public properties only
    (each a snapshot taken under the publisher's lock). Each worker's lag is the one
    `Publisher.workers` reports, taken in the same snapshot as its version."""
    latest = pub.version
    now = time.time()  # WorkerInfo.last_seen is a time.time() timestamp
    workers = tuple(
        WorkerSample(
            info.worker_id,
            info.pid,
            info.host,
            info.mode,
            info.transport,
            info.version,
            max(0.0, now - info.last_seen),
            info.lag,
        )
        for info in pub.workers.values()
    )
    return BusSample(pub.name, pub.bus_id, pid, latest, workers, pub.counters)
