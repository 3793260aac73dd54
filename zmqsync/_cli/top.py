"""`zmqsync top`: a live view of one bus, refreshed every second.

Each refresh is one INSPECT (as ``zmqsync inspect``); the screen (`_top_view`) shows the
workers with their version, lag, mode, host/pid and when they were last heard, the
publishes per second and their latency over the last interval, and the refusals. A bus
that does not answer at the start is a one-line error (exit 1); later the screen says
how long the publisher has been unreachable, and picks up a restarted one. On a
terminal the screen is redrawn in place; otherwise each refresh is printed below the
last (for logs, and ``--count`` in scripts).
"""

from __future__ import annotations

import argparse
import os
import threading
import time

from .args import add_target, bus_address, positive
from .buses import ask, inspect_bus, socket_path
from .sniff import _signals_set

__all__ = ["DESCRIPTION", "HELP", "NAME", "add_arguments", "run"]

NAME = "top"
HELP = "a live view of a bus: workers, lag, publish rate and latency"
DESCRIPTION = (
    "Show a bus live, refreshed every second: its workers (version, lag, mode, host/pid, "
    "last heard), publishes per second and their latency, refusals. Ctrl-C ends it."
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The bus, how often to refresh, and when to stop."""
    add_target(p)
    p.add_argument(
        "--interval", type=positive(float), default=1.0, help="seconds between refreshes"
    )
    p.add_argument("--count", type=positive(int), default=None, help="stop after N refreshes")
    p.add_argument(
        "--timeout",
        type=positive(float),
        default=1.0,
        help="how long a refresh waits for the publisher's answer (s, default 1)",
    )


def run(args: argparse.Namespace) -> int:
    """Refresh until Ctrl-C, SIGTERM or --count; exit 1 if the bus does not answer first."""
    from rich.console import Console
    from rich.live import Live

    from .._bus_sample import from_state
    from .._errors import ZmqSyncError
    from .._top_view import Top

    address = bus_address(args)
    top = Top(address)
    top.update(from_state(ask(address, max(args.timeout, 3.0), args.name)), time.monotonic())
    console = Console(highlight=False)
    stop = threading.Event()
    shown = 0

    def refresh() -> None:
        try:
            sample = from_state(inspect_bus(address, args.timeout, args.name))
        except ZmqSyncError:
            sample = None
        # a publisher that closed the bus removed its socket file; a dead one left it
        path = socket_path(address)
        top.update(sample, time.monotonic(), closed=path is not None and not os.path.exists(path))

    with _signals_set(stop):
        if console.is_terminal:
            with Live(top.render(), console=console, auto_refresh=False) as live:
                while not stop.wait(args.interval):
                    refresh()
                    live.update(top.render(), refresh=True)
                    shown += 1
                    if args.count is not None and shown >= args.count:
                        break
        else:
            while not stop.wait(args.interval):
                refresh()
                console.print(top.render())
                console.print()
                shown += 1
                if args.count is not None and shown >= args.count:
                    break
    return 0
