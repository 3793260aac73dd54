"""`zmqsync bench`: zmqsync against floors, torchrl and a pickled state_dict.

The arguments are `_bench`'s own (shared with tools/bench.py), loaded only when the
parser is built.
"""

from __future__ import annotations

import argparse

__all__ = ["DESCRIPTION", "HELP", "NAME", "add_arguments", "run"]

NAME = "bench"
HELP = "benchmarks: zmqsync vs floors, torchrl, naive pickle"
DESCRIPTION = (
    "Measure zmqsync against a memcpy floor, raw ZeroMQ, torchrl and a pickled "
    "state_dict. See docs/benchmarks.md."
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The benchmarks' arguments, as `_bench` defines them."""
    from .._bench import add_arguments as add_bench_arguments

    add_bench_arguments(p)


def run(args: argparse.Namespace) -> int:
    """Run the benchmarks the arguments select."""
    from .._bench import run_from_args

    return run_from_args(args)
