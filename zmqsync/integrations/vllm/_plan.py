"""What the driver decides from the workers' statuses: no I/O, shared by `Engine` (an
offline ``LLM``) and `ServerUpdates` (``vllm serve``), and tested without vLLM."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..._errors import ZmqSyncError

__all__ = ["UpdateFailed", "agreed", "check", "gone", "newest"]

Status = dict[str, Any]

# Why an update failed (UpdateFailed.kind), in the order one is reported when several are.
KINDS = ("broken", "join", "bus", "mismatch", "not-finite", "disagree", "trainer")


class UpdateFailed(ZmqSyncError, RuntimeError):
    """An update applied no new version; the engine still serves `.version`.

    Attributes:
        version: the version the engine computes with (-1: its checkpoint's weights).
        kind: "trainer" (no publisher answers: it closed or died), "mismatch" (names or
            shapes differ from the engine's checkpoint), "not-finite" (NaN or inf, with
            ``check_finite=True``), "disagree" (workers hold different versions),
            "join"/"bus" (the bus refused or failed), "broken" (vLLM's reload failed
            midway: restart the engine).
    """

    def __init__(self, message: str, *, version: int, kind: str) -> None:
        super().__init__(message)
        self.version = version
        self.kind = kind


def check(statuses: Sequence[Status], where: str, version: int) -> None:
    """Raise the first worker error (by `KINDS` order), naming the bus and the version kept.

    Raises:
        UpdateFailed: a worker reported an error.
    """
    failed = [s for s in statuses if s.get("error")]
    if not failed:
        return
    worst = min(failed, key=lambda s: KINDS.index(s["kind"]) if s["kind"] in KINDS else 99)
    kept = "its checkpoint's weights" if version < 0 else f"version {version}"
    raise UpdateFailed(
        f"{where}: engine worker {worst.get('rank', '?')}: {worst['error']}; the engine "
        f"keeps {kept}",
        version=version,
        kind=worst["kind"],
    )


def agreed(statuses: Sequence[Status]) -> tuple[str, int] | None:
    """The (bus, version) every worker fetched, or None when they differ."""
    fetched = {(s["fetched_bus"], s["fetched"]) for s in statuses}
    return next(iter(fetched)) if len(fetched) == 1 else None


def newest(statuses: Sequence[Status]) -> tuple[str, int]:
    """The newest version fetched: on the bus most workers are on, its highest version."""
    buses = [s["fetched_bus"] for s in statuses]
    bus = max(set(buses), key=buses.count)
    return bus, max(s["fetched"] for s in statuses if s["fetched_bus"] == bus)


def gone(statuses: Sequence[Status]) -> bool:
    """Whether a worker's publisher closed the bus or stopped answering."""
    return any(s["stopped"] or not s["connected"] for s in statuses)


def trainer_gone(where: str, version: int) -> UpdateFailed:
    kept = "its checkpoint's weights" if version < 0 else f"version {version}"
    return UpdateFailed(
        f"{where}: no trainer answers (its publisher closed the bus or died); the engine "
        f"keeps {kept}, and takes new versions again once a publisher of this name starts",
        version=version,
        kind="trainer",
    )
