"""The `zmqsync` command: thin argparse over the library. ``main(argv) -> int``.

Expected failures (`ZmqSyncError`, a bad address, a refused path) print one line and
exit 1; usage errors exit 2; Ctrl-C exits 130 and SIGTERM 143, after closing what the
command opened. Only this module configures logging. Each command (its arguments and
what it runs) is a module of `zmqsync._cli`; this one builds the parser from them.

Startup: operators run ``inspect``, ``sniff`` and ``gc`` in loops and containers, so
nothing here imports torch at module level, and those commands never do (`import
zmqsync` loads its public names lazily; tests/test_newcomer_cli.py checks it). Commands
that move tensors (demo, worker, bench, relay) import it inside their function.

Signals: SIGTERM (``docker stop``, systemd, ``kill``) raises KeyboardInterrupt in the
main thread, as Ctrl-C does, so every ``with`` block unwinds the same way: a publisher
unlinks its segment and socket files, the demo ends its workers. The commands that run
until stopped (worker, sniff, top, metrics, relay) catch both signals themselves, finish
the line they are on and print their summary. Every command then exits 130 after
SIGINT and 143 after SIGTERM (`_cli.signals`); one that failed meanwhile keeps its 1.

Any local process can be a peer on a bus, so every string a peer sent (a worker id, a
host, a STOP or ERROR reason, a bus name, a counter name, a tensor key) is shown with its
control characters escaped (`printable`) and, where rich renders it, as a `Text` object
or through `rich.markup.escape`, so ``[/bold]`` is printed and never parsed. ``--json``
output is ASCII-only JSON: control characters and non-ASCII text (a bidi override) come
out as ``\\uXXXX`` escapes and round-trip exactly through any JSON parser.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from collections.abc import Sequence
from typing import Any

from ._cli import (
    LINE_LIMIT,
    bench,
    buses,
    demo,
    gc,
    inspect,
    metrics,
    relay,
    signals,
    sniff,
    top,
    worker,
)
from ._errors import ZmqSyncError
from ._text import printable

__all__ = ["main"]

# In the order of `zmqsync --help`.
COMMANDS = (demo, worker, buses, inspect, sniff, top, metrics, bench, relay, gc)

_DESCRIPTION = """\
Move PyTorch weights from a trainer to worker processes on this host (shared memory +
ZeroMQ), and watch the buses that do it."""
_EPILOG = """\
examples:
  zmqsync demo                          a trainer and 4 verifying workers, then a summary
  zmqsync worker --name policy --verify join the bus 'policy' and check every version
  zmqsync buses                         the buses on this host: pid, version, workers
  zmqsync inspect --name policy         manifest, buffers, workers and counters of a bus
  zmqsync sniff --name policy           every message on the bus, as it happens
  zmqsync top --name policy             workers, lag, publish rate and latency, live
  zmqsync metrics --name policy --port 9108   /metrics for Prometheus
  zmqsync gc                            remove what killed trainers left behind

Buses are found by name in $ZMQSYNC_RUNTIME_DIR (default $XDG_RUNTIME_DIR/zmqsync or
/tmp/zmqsync-UID), or by address: tcp://HOST:PORT or ipc:///path. Exit status: 0 on
success, 1 with a one-line reason on failure, 2 for a usage error, 130 after Ctrl-C,
143 after SIGTERM. Docs: README.md, docs/guide.md, docs/sniffer.md,
docs/metrics.md."""


def version_line() -> str:
    """What ``zmqsync --version`` prints: this package, where it is installed, and the
    Python and ZeroMQ it runs with (the versions a bug report needs)."""
    import platform

    import zmq

    from . import __version__

    return (
        f"zmqsync {__version__} ({os.path.dirname(os.path.abspath(__file__))}; Python "
        f"{platform.python_version()}, pyzmq {zmq.__version__}, libzmq {zmq.zmq_version()})"
    )


class _Version(argparse.Action):
    """``--version``: computed when asked, so ``zmqsync --help`` imports no zmq."""

    def __init__(self, option_strings: Sequence[str], dest: str, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, help=kwargs.get("help"))

    def __call__(self, parser: argparse.ArgumentParser, *args: Any) -> None:
        print(version_line())
        parser.exit()


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="zmqsync",
        description=_DESCRIPTION,
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--version", action=_Version, help="the version of zmqsync (and Python, ZeroMQ); exit"
    )
    parser.add_argument(
        "--log-level",
        default="WARNING",
        help="show the library's log lines from this level on: DEBUG, INFO, WARNING (default)",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in COMMANDS:
        p = sub.add_parser(command.NAME, help=command.HELP, description=command.DESCRIPTION)
        command.add_arguments(p)
        p.set_defaults(func=command.run)
    return parser


class _PrintableFormatter(logging.Formatter):
    """Log lines whose message is escaped with `printable`.

    The library logs peer text (a STOP reason, a worker's host, a fallback reason from
    a WELCOME); on a terminal that text must not move the cursor or, with a newline,
    forge a log line of its own. Only the message is escaped: a traceback below it
    keeps its lines.
    """

    def formatMessage(self, record: logging.LogRecord) -> str:
        record.message = printable(record.message, limit=LINE_LIMIT)
        return super().formatMessage(record)


def _expected(exc: BaseException) -> bool:
    """Failures that get one line (no traceback): the library's own errors, timeouts,
    refused values and paths, and libzmq's errors (a port in use, a path it may not
    bind), whose message names what failed."""
    if isinstance(exc, ZmqSyncError | TimeoutError | ValueError | OSError):
        return True
    zmq = sys.modules.get("zmq")
    return zmq is not None and isinstance(exc, zmq.ZMQError)


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    handler = logging.StreamHandler()
    handler.setFormatter(_PrintableFormatter("%(asctime)s %(name)s %(message)s"))
    logging.basicConfig(level=args.log_level.upper(), handlers=[handler])
    signals.reset()
    try:
        with signals.terminate_as_interrupt():
            status = int(args.func(args))
    except KeyboardInterrupt as exc:
        term = isinstance(exc, signals.Terminated)
        return signals.exit_status(signal.SIGTERM if term else signal.SIGINT)
    except Exception as exc:
        if not _expected(exc):
            raise
        # a ProtocolError quotes what the peer said ("... refused us: <reason>")
        reason = printable(exc, limit=LINE_LIMIT)
        print(f"zmqsync {args.command}: {type(exc).__name__}: {reason}", file=sys.stderr)
        return 1
    signum = signals.caught()  # a command that ended on a signal it caught
    return signals.exit_status(signum) if signum is not None and status == 0 else status


if __name__ == "__main__":
    sys.exit(main())
