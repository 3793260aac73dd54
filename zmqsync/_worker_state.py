"""The per-version state a worker's two followers write: one home, with fixed names.

A version reaches a worker the Python way (the agent's loop, the `Link`'s rule,
`Reader.apply`) or through a follower: the native `Follower` (``_follower.c``) or its
Python twin (`ReferenceFollower`), which do the same steps. All of them record what
they did here, and nowhere else: the version the model computes with and the bus it
came from, the slot and seqlock counter it holds, the Link's sequence and liveness
clock, and the counters a version bumps. The Python writers go through `record` and
`followed` (the Link keeps its clock in `last_seq`/`last_heard`); the C is their twin.

The class has ``__slots__`` so that its names are fixed. The C writes these slots by
their member descriptors, looked up by name when a Follower is built: a slot renamed
here makes that construction fail with a TypeError, instead of the C creating a stale
attribute that nobody reads (a ``wait_for_version`` that then times out).
"""

from __future__ import annotations

__all__ = ["NATIVE_WRITES", "WorkerState"]


class WorkerState:
    """What a worker has applied and heard; written by both followers under its lock.

    Attributes:
        version: the version the model computes with (-1: none yet).
        bus: the bus that version came from ("" before the first; the followers take
            versions of that bus only, so they never change it).
        held: in alias mode, (slot, seqlock counter) of the slot aliased now.
        last_seq: the Link's sequence: events up to this seq are covered.
        last_heard: when a message of the Link's bus last arrived (monotonic seconds).
        applied: versions applied, whichever way they came.
        native: how many of them the native (C) follower took.
    """

    __slots__ = ("version", "bus", "held", "last_seq", "last_heard", "applied", "native")

    def __init__(self) -> None:
        self.version = -1
        self.bus = ""
        self.held: tuple[int, int] | None = None
        self.last_seq = 0
        self.last_heard = 0.0
        self.applied = 0
        self.native = 0

    def record(self, version: int, held: tuple[int, int] | None, bus: str) -> None:
        """A version applied the Python way (`Reader.apply`; caller holds the lock)."""
        self.held = held
        self.version, self.bus = version, bus
        self.applied += 1

    def followed(self, version: int, held: tuple[int, int] | None, seq: int, now: float) -> None:
        """A version the Python follower took, as the C records one (caller holds the
        lock): the Link's sequence and clock move with it (`native` counts the C's)."""
        self.held = held
        self.version = version
        self.applied += 1
        self.last_seq = seq
        self.last_heard = now

    def __repr__(self) -> str:
        return (
            f"<WorkerState v{self.version} seq {self.last_seq} held {self.held} "
            f"applied {self.applied} native {self.native}>"
        )


# The slots the native follower writes (``_follower.c`` looks each one up at construction).
NATIVE_WRITES = ("version", "held", "last_seq", "last_heard", "applied", "native")
