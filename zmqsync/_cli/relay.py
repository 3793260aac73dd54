"""`zmqsync relay`: run a relay root next to the trainer's bus, or a relay on another host.

Only the arguments live here: `zmqsync --help` builds every command's parser and must
not import torch, which the relay package does. The command itself is
`zmqsync.relay._command`, imported when it runs.
"""

from __future__ import annotations

import argparse

from .. import _config

__all__ = ["DESCRIPTION", "HELP", "NAME", "add_arguments", "run"]

NAME = "relay"
HELP = "carry a bus to other hosts over torch.distributed"
DESCRIPTION = (
    "Run a relay root next to the trainer's bus (--root), or a relay on another host, "
    "until SIGTERM or Ctrl-C. See docs/multi-host.md."
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """A root or a relay, its bus, its tree and its deadlines."""
    p.add_argument("address", nargs="?", help="this host's bus address (default: from --name)")
    p.add_argument("--name", default="weights", help="bus name (default: weights)")
    p.add_argument("--root", action="store_true", help="run the root, next to the trainer's bus")
    p.add_argument("--init-method", default=None, help="env:// (default) or tcp://HOST:PORT")
    p.add_argument(
        "--backend",
        choices=("gloo", "nccl"),
        default="gloo",
        help="root: the collective backend (a relay follows its root's)",
    )
    p.add_argument("--ack", choices=("tree", "relays"), default="tree", help="root: what acks mean")
    p.add_argument("--timeout", type=float, default=10.0, help="deadline per version (s)")
    p.add_argument("--on-timeout", choices=("evict", "raise"), default="evict")
    p.add_argument("--heartbeat", type=float, default=0.5)
    p.add_argument(
        "--chunk-mb", type=float, default=_config.RELAY_CHUNK_MB, help="root: MiB per collective"
    )
    p.add_argument(
        "--collective-timeout",
        type=float,
        default=None,
        help="root: timeout of each collective (s); default: ~6 heartbeats, at least 1 s",
    )
    p.add_argument("--relay-id", default=None, help="relay: id on the tree (default: host name)")
    p.add_argument("--slots", type=int, default=2, help="relay: slots of the local bus")
    p.add_argument(
        "--device", default=None, help="CUDA device of the NCCL staging buffer (with nccl)"
    )
    p.add_argument("--connect-timeout", type=float, default=60.0, help="relay: wait for a root (s)")
    p.add_argument(
        "--insecure", action="store_true", help="allow a non-loopback rendezvous address"
    )
    p.add_argument(
        "--curve",
        action="store_true",
        help="relay: CURVE on the local bus, its workers' keys left in the runtime dir (a "
        "root needs no flag: it finds a curve=True trainer's keys as a worker does)",
    )
    p.add_argument("--json", action="store_true", help="one JSON line per event")


def run(args: argparse.Namespace) -> int:
    """Run the root or the relay until SIGTERM or Ctrl-C (`zmqsync.relay._command`)."""
    from ..relay._command import run_relay

    return run_relay(args)
