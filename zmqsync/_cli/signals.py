"""Ctrl-C and SIGTERM in the commands: how a command ends on them, and its exit status.

``zmqsync --help`` promises 130 after Ctrl-C (SIGINT) and 143 after SIGTERM, from every
command. Two ways lead there:

* Most commands let the signal unwind them: SIGINT raises KeyboardInterrupt and SIGTERM
  `Terminated` (a KeyboardInterrupt too, see `terminate_as_interrupt`), so every
  ``with`` block closes what it opened; `zmqsync.cli.main` turns it into the status.
* The commands that run until stopped (worker, sniff, top, metrics, relay) catch both
  signals (`ending`), finish the line they are on and print their summary. `ending`
  remembers the signal, and `main` exits with its status rather than 0.

Only the main thread handles signals; `caught` is a plain module-level value written by
the handler and read by `main` once the command returned.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from types import FrameType

__all__ = [
    "Terminated",
    "caught",
    "ending",
    "exit_status",
    "interrupt",
    "record",
    "reset",
    "terminate_as_interrupt",
]

_caught: int | None = None  # the last SIGINT/SIGTERM a command caught and ended on


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where Ctrl-C's KeyboardInterrupt would be (exit status 143)."""


def reset() -> None:
    """Forget a signal caught before (`main` calls it before each command)."""
    global _caught
    _caught = None


def record(signum: int) -> None:
    """A command ends because of `signum`: its exit status will say so."""
    global _caught
    _caught = signum


def caught() -> int | None:
    """The signal the command ended on, or None."""
    return _caught


def exit_status(signum: int) -> int:
    """The shell's status for a process ended by `signum`: 130 (SIGINT), 143 (SIGTERM)."""
    return 128 + signum


def interrupt(signum: int) -> None:
    """Raise what `signum` raises where a command is unwound rather than stopped."""
    record(signum)
    raise Terminated if signum == signal.SIGTERM else KeyboardInterrupt


@contextlib.contextmanager
def terminate_as_interrupt() -> Iterator[None]:
    """SIGTERM raises `Terminated` in the main thread while the block runs, so that
    ``kill`` and ``docker stop`` unwind what Ctrl-C unwinds."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def on_sigterm(signum: int, frame: FrameType | None) -> None:
        interrupt(signum)

    previous = signal.signal(signal.SIGTERM, on_sigterm)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextlib.contextmanager
def ending(stop: threading.Event) -> Iterator[None]:
    """Ctrl-C and SIGTERM set `stop` (and are remembered) while the block runs: a loop
    that checks `stop` ends between two items and prints what it has."""

    def on_signal(signum: int, frame: FrameType | None) -> None:
        record(signum)
        stop.set()

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
