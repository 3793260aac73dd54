"""What the publisher's log says about its workers, at levels an operator can filter.

INFO for the normal life of a worker (joined, left, dropped after it worked); WARNING for
what makes a trainer publish to fewer workers than the operator started: a refusal, a
worker that left or went silent without ever applying a version (a model of another
layout raises `LayoutMismatch` on its side; the publisher sees only that it never acked).
The agent (`_publisher_agent`) makes the log calls; this module only words and grades
them, so that the agent's socket loop stays short. No I/O, no clock.
"""

from __future__ import annotations

import logging
from typing import Any

__all__ = ["Refusals", "departure", "rejoin_note"]


def rejoin_note(transport: str, session: str, old: Any) -> str:
    """The end of a "joined" line: "" for a first join, else how it came back (`old`:
    the member it replaced, None for a first join)."""
    if old is None:
        return ""
    if old.session != session:
        return " replacing a silent session"
    # the same process: re-joined, or asked for another transport
    return " again" + (f", now for {transport}" if old.transport != transport else "")


def departure(member: Any) -> tuple[int, str]:
    """The level of a line about a worker leaving or dropped, and what to add to it: a
    warning when it never applied a version (never acked)."""
    if member.acked >= 0:
        return logging.INFO, ""
    return logging.WARNING, " without applying a version"


class Refusals:
    """Grades refusals of HELLOs: a warning once per worker and reason (a worker retries
    a busy or full bus every few tens of milliseconds), DEBUG while it repeats, and
    DEBUG while the publisher closes (its workers' re-joins are refused then, as due)."""

    def __init__(self) -> None:
        self._last = ("", "")

    def level(self, worker_id: str, reason: str, closing: bool, hello: bool = True) -> int:
        """The level of "`worker_id` refused: `reason`" (`hello`: a worker's HELLO, not
        an inspector's request, which is DEBUG)."""
        if not hello:
            return logging.DEBUG
        refusal = (worker_id, reason)
        repeated, self._last = refusal == self._last, refusal
        return logging.DEBUG if repeated or closing else logging.WARNING
