"""`zmqsync gc`: remove segments and socket files that killed processes left behind."""

from __future__ import annotations

import argparse
import os

from .. import _config

__all__ = ["DESCRIPTION", "HELP", "NAME", "add_arguments", "run"]

NAME = "gc"
HELP = "remove segments and socket files left by killed processes"
DESCRIPTION = (
    "Remove shared-memory segments that no process maps any more and ipc:// socket files "
    "that no publisher listens on. Safe while buses run."
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Where segments and socket files live."""
    p.add_argument(
        "--shm-dir",
        default=None,
        help="where segments live (default: $ZMQSYNC_SHM_DIR or /dev/shm)",
    )
    p.add_argument(
        "--runtime-dir",
        default=None,
        help="where socket files live (default: $ZMQSYNC_RUNTIME_DIR or the user's)",
    )


def run(args: argparse.Namespace) -> int:
    """Collect both directories and list what was removed."""
    from .._gc import collect_garbage, collect_sockets

    directory = _config.shm_dir(args.shm_dir)
    runtime = args.runtime_dir or _config.runtime_dir()
    for path, what in ((directory, "--shm-dir"), (runtime, "--runtime-dir")):
        if not os.path.isdir(path):
            raise NotADirectoryError(f"{path} ({what}) is not a directory: nothing to collect")
    removed = collect_garbage(directory)
    sockets = collect_sockets(runtime)
    for path in (*removed, *sockets):
        print(f"removed {path}")
    print(f"{len(removed)} leaked segment(s) removed from {directory}")
    print(f"{len(sockets)} dead socket file(s) removed from {runtime}")
    return 0
