"""`zmqsync worker`: a standalone subscriber that joins a bus and reports each version."""

from __future__ import annotations

import argparse
import contextlib
import logging
from collections.abc import Iterator

from .._errors import ConnectTimeout
from .args import add_target, bus_address, check_address, non_negative_int, positive
from .buses import where_are_buses

__all__ = ["DESCRIPTION", "HELP", "NAME", "add_arguments", "run"]

NAME = "worker"
HELP = "a standalone subscriber: join a bus, apply every version, report"
DESCRIPTION = (
    "Join a bus and hold its weights: say when it joined, each version applied (a live "
    "line on a terminal, JSON lines with --json), when the publisher went away and came "
    "back, and a summary at the end (also on Ctrl-C or SIGTERM). Ends when the publisher "
    "closes the bus, unless --forever."
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The bus, how to apply versions, what to report and when to stop."""
    add_target(p)
    p.add_argument(
        "--mode",
        choices=("copy", "alias"),
        default="copy",
        help="copy into the worker's own tensors (default), or alias the shared buffer",
    )
    p.add_argument(
        "--apply",
        choices=("background", "manual"),
        default="background",
        help="apply each version as it arrives (default), or only at the worker's poll",
    )
    p.add_argument(
        "--verify",
        action="store_true",
        help="check each version against the _checksum tensor the trainer publishes "
        "(an error if the bus has none)",
    )
    p.add_argument(
        "--digest",
        action="store_true",
        help="with --json: each version's blake2b digest in its line, checked against nothing",
    )
    p.add_argument(
        "--json", action="store_true", help="one JSON line per event (joined, applied, ...)"
    )
    p.add_argument("--worker-id", default=None, help="id on the bus (default: HOST-PID-RANDOM)")
    p.add_argument(
        "--until-version",
        type=non_negative_int,
        default=None,
        help="exit once this version (or a newer one) is applied",
    )
    p.add_argument(
        "--forever",
        action="store_true",
        help="keep waiting for a new publisher after this one closes the bus",
    )
    p.add_argument(
        "--timeout",
        type=positive(float),
        default=30.0,
        help="how long to wait for a publisher to answer (s, default 30)",
    )


class _ShowWaiting(logging.Filter):
    """Lets the subscriber's one "waiting for bus" line through below the CLI's log level:
    a worker started before its trainer says what it waits for, at any --log-level."""

    def __init__(self, level: int) -> None:
        super().__init__()
        self.level = level

    def filter(self, record: logging.LogRecord) -> bool:
        from .._subscriber import WAITING

        return record.msg == WAITING or record.levelno >= self.level


@contextlib.contextmanager
def _showing_waiting() -> Iterator[None]:
    logger = logging.getLogger("zmqsync._subscriber")
    level = logger.getEffectiveLevel()
    if level <= logging.INFO:  # shown anyway
        yield
        return
    shown = _ShowWaiting(level)
    previous = logger.level
    logger.setLevel(logging.INFO)
    logger.addFilter(shown)
    try:
        yield
    finally:
        logger.removeFilter(shown)
        logger.setLevel(previous)


def run(args: argparse.Namespace) -> int:
    """Join the bus and hold its weights until it closes (or a signal); a timeout names
    the buses that do answer here."""
    from .._worker import run_worker

    address = check_address(args.address) if args.address else None
    try:
        with _showing_waiting():
            return run_worker(
                address,
                name=args.name,
                mode=args.mode,
                apply=args.apply,
                verify=args.verify,
                as_json=args.json,
                report_digest=args.digest,
                worker_id=args.worker_id,
                until_version=args.until_version,
                forever=args.forever,
                timeout=args.timeout,
            )
    except ConnectTimeout as exc:
        raise ConnectTimeout(f"{exc}{where_are_buses(bus_address(args))}") from exc
