"""One monotonic deadline per operation; seconds everywhere, milliseconds only here.

Every wait in zmqsync is bounded by a `Deadline`. An operation (a publish, a handshake)
builds one and spends it across all of its waits, so N workers never turn into N
timeouts.
"""

from __future__ import annotations

import math
import time

__all__ = ["Deadline"]


class Deadline:
    """A point on ``time.monotonic()`` by which a wait must end; ``None`` = no limit."""

    __slots__ = ("at", "total")

    def __init__(self, seconds: float | None) -> None:
        if seconds is not None and (math.isnan(seconds) or seconds < 0):
            raise ValueError(f"a timeout must be >= 0 seconds or None, not {seconds!r}")
        self.total = seconds
        self.at = None if seconds is None else time.monotonic() + seconds

    def remaining(self) -> float | None:
        """Seconds left (never negative), or None when unlimited."""
        if self.at is None:
            return None
        return max(0.0, self.at - time.monotonic())

    def expired(self) -> bool:
        return self.at is not None and time.monotonic() >= self.at

    def wait_s(self, cap_s: float | None = None) -> float | None:
        """Seconds to block in the next wait: what remains, capped by `cap_s`."""
        left = self.remaining()
        if cap_s is None:
            return left
        return cap_s if left is None else min(left, cap_s)

    def poll_ms(self, cap_s: float | None = None) -> int:
        """For zmq poll: -1 when unlimited; never negative otherwise."""
        seconds = self.wait_s(cap_s)
        return -1 if seconds is None else math.ceil(seconds * 1000)

    def share_ms(self, parts: int) -> int:
        """An equal share of what remains, for the next of `parts` attempts."""
        left = self.remaining()
        if left is None:
            return -1
        return math.ceil(left * 1000 / max(1, parts))

    def __repr__(self) -> str:
        return f"<Deadline {self.remaining()} s left of {self.total}>"
