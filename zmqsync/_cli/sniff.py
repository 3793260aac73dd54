"""`zmqsync sniff`: every message on a bus as it happens, a line per acked version, a
summary at the end.

It reads the publisher's tap (`_sniff`), or the events socket alone when the bus has
none, or a recording (``--replay``). Ctrl-C and SIGTERM end the loop between two
messages, so the summary is always printed.
"""

from __future__ import annotations

import argparse
import contextlib
import json
from typing import Any

from .._text import printable
from . import LINE_LIMIT, signals
from .args import add_target, bus_address, positive
from .buses import ask, wait_for_bus

__all__ = ["DESCRIPTION", "HELP", "NAME", "add_arguments", "run"]

NAME = "sniff"
HELP = "watch a bus: every message, ack latencies, gaps"
DESCRIPTION = (
    "Print every message on a bus as it happens (from the publisher's tap), a line per "
    "fully acked version, and a summary at the end (also on Ctrl-C or SIGTERM). See "
    "docs/sniffer.md."
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The bus (or a recording), filters, and when to stop."""
    add_target(p)
    p.add_argument("--json", action="store_true", help="one JSON object per message")
    p.add_argument("--count", type=positive(int), default=None, help="stop after N messages shown")
    p.add_argument("--duration", type=positive(float), default=None, help="stop after S seconds")
    p.add_argument("--type", action="append", help="only these message types (repeatable)")
    p.add_argument("--worker", action="append", help="only messages of these workers")
    p.add_argument("--record", metavar="FILE", help="save every frame seen to FILE")
    p.add_argument("--replay", metavar="FILE", help="show a recording instead of a live bus")
    p.add_argument(
        "--timeout",
        type=positive(float),
        default=3.0,
        help="how long to wait for the bus to answer (s, default 3)",
    )
    p.add_argument(
        "--wait", action="store_true", help="retry until a publisher answers (up to --timeout)"
    )
    p.add_argument(
        "--exit-on-stop", action="store_true", help="exit when the publisher closes the bus"
    )


def _signals_set(stop: Any) -> contextlib.AbstractContextManager[None]:
    """Ctrl-C and SIGTERM set `stop` (a threading.Event) for as long as the block runs:
    a loop that checks it ends between two items, and prints what it has; the command
    then exits 130 or 143 (`signals.ending`)."""
    return signals.ending(stop)


def run(args: argparse.Namespace) -> int:
    import threading

    from rich.console import Console
    from rich.markup import escape

    from .._deadline import Deadline
    from .._sniff import Sniffer, Summary, read_recording, to_json, to_line, write_record

    # emoji off: ":thumbs_up:" in a worker id is shown as typed (to_line escapes markup)
    out = Console(highlight=False, soft_wrap=True, emoji=False)
    err = Console(stderr=True, highlight=False, soft_wrap=True, emoji=False)
    stop = threading.Event()
    with contextlib.ExitStack() as stack:
        if args.replay:
            records = read_recording(stack.enter_context(open(args.replay, "rb")))
            summary = Summary(set())
        else:
            address = bus_address(args)
            if args.wait:
                state = wait_for_bus(address, args.timeout, args.name)
            else:
                state = ask(address, args.timeout, args.name)
            sniffer = stack.enter_context(Sniffer(state, address))
            if sniffer.fallback:
                err.print(
                    "zmqsync sniff: this bus has no tap (start the publisher with tap=True "
                    "or ZMQSYNC_TAP=1); showing the events socket only: no acks, no hellos"
                )
            records = sniffer.records(Deadline(args.duration), stop)
            summary = Summary(
                {w.worker_id for w in state.workers}, acks_visible=not sniffer.fallback
            ).seed(state)
        recording = stack.enter_context(open(args.record, "wb")) if args.record else None
        stack.enter_context(_signals_set(stop))  # from here on a signal ends the loop
        shown = 0
        for record in records:
            if recording is not None:
                write_record(recording, record)
            done = summary.add(record)
            if args.type and record.type not in args.type:
                continue
            if args.worker and record.peer not in args.worker:
                continue
            if args.json:  # ASCII-only JSON, as for inspect --json
                print(json.dumps(to_json(record), ensure_ascii=True), flush=True)
            else:
                out.print(to_line(record, colour=True))
                if done:  # names the missing (or lagging) workers: peer text
                    out.print(f"[bold]  {escape(printable(done, limit=LINE_LIMIT))}[/]")
            shown += 1
            if args.count and shown >= args.count:
                break
            if args.exit_on_stop and record.type == "stop" and not record.msg.session:
                break
            if stop.is_set():  # a replay has no deadline to poll: stop between records
                break
        err.print(f"zmqsync sniff: {shown} messages shown; {summary.final()}")
    return 0
