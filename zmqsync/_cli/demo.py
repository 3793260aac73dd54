"""`zmqsync demo`: a trainer and N verifying workers on this host, then a summary.

The newcomer's first command: it shows the bus working end to end (every version
verified by checksum) and fails (exit 1) if any worker missed a version.
"""

from __future__ import annotations

import argparse

from .args import positive

__all__ = ["DESCRIPTION", "HELP", "NAME", "add_arguments", "run"]

NAME = "demo"
HELP = "a trainer and N worker processes, every version verified, then a summary"
DESCRIPTION = (
    "Start a trainer and N `zmqsync worker --verify` processes on this host, publish a "
    "policy K times, and print the bus's publish latency, the verified round trip and "
    "each worker's counts. Exit 1 if any worker missed a version or a checksum."
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The demo's size, workers, slots and deadline."""
    p.add_argument(
        "--workers",
        type=positive(int),
        default=4,
        metavar="N",
        help="worker processes (default 4)",
    )
    p.add_argument(
        "--updates",
        type=positive(int),
        default=20,
        metavar="N",
        help="versions to publish after the warm-up (default 20)",
    )
    p.add_argument(
        "--size-mb",
        type=positive(float),
        default=64.0,
        metavar="MIB",
        help="size of the policy in MiB (default 64); refused if the host cannot hold it",
    )
    p.add_argument(
        "--mode",
        choices=("copy", "alias"),
        default="copy",
        help="copy: each worker copies into its own tensors (default); alias: workers "
        "compute on the shared buffer itself",
    )
    p.add_argument(
        "--slots",
        type=positive(int),
        default=2,
        metavar="N",
        help="copies of the policy in shared memory (default 2)",
    )
    p.add_argument(
        "--timeout",
        type=positive(float),
        default=60.0,
        metavar="S",
        help="deadline (s) for the workers to join and for each publish (default 60)",
    )


def run(args: argparse.Namespace) -> int:
    """Run the demo; 0 if every worker verified every version."""
    from rich.console import Console

    from .._demo import check_resources, render, run_demo

    check_resources(workers=args.workers, size_mb=args.size_mb, slots=args.slots, mode=args.mode)
    console = Console()
    result = run_demo(
        workers=args.workers,
        updates=args.updates,
        size_mb=args.size_mb,
        mode=args.mode,
        slots=args.slots,
        timeout=args.timeout,
        console=console,
    )
    ok = render(result, workers=args.workers, mode=args.mode, console=console, updates=args.updates)
    return 0 if ok else 1
