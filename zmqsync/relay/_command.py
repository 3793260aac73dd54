"""The `zmqsync relay` command: a `RelayRoot` or a `Relay`, run until a signal.

Its arguments are `zmqsync._cli.relay`'s (the parser must not import torch); this is
what runs once they are parsed. With ``--json`` it prints one ASCII-only line per event:
started, relayed (root) or published (relay), closed.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import signal
import threading
from collections.abc import Callable
from typing import Any

from .._cli import signals
from .._security import Security
from ._carrier import Relayed
from ._host import Relay
from ._options import Branch, Tree
from ._root import RelayRoot

__all__ = ["run_relay"]

Emit = Callable[[dict[str, Any]], None]


def run_relay(args: argparse.Namespace) -> int:
    """Run a relay root (``--root``) or a relay until SIGTERM/SIGINT; ``--json`` prints
    one line per event (started, relayed or published, closed)."""
    stop = threading.Event()

    def emit(record: dict[str, Any]) -> None:
        if args.json:  # ASCII only, as for inspect --json: relay ids come from peers
            print(json.dumps(record, ensure_ascii=True), flush=True)

    node = _root(args, emit) if args.root else _relay(args, emit)

    def on_signal(signum: int, frame: Any) -> None:
        signals.record(signum)  # exit 130 or 143 once closed
        stop.set()

    with contextlib.ExitStack() as stack:
        for signum in (signal.SIGTERM, signal.SIGINT):
            stack.callback(signal.signal, signum, signal.signal(signum, on_signal))
        stack.enter_context(node)
        started: dict[str, Any] = {"event": "started", "role": "root" if args.root else "relay"}
        if isinstance(node, RelayRoot):
            started.update(tree=node.tree, init_method=node.init_method_url, address=node.address)
        else:
            started.update(relay_id=node.relay_id)
        emit(started)
        while not stop.wait(0.2):
            pass
    emit({"event": "closed", "version": node.version})
    return 0


def _root(args: argparse.Namespace, emit: Emit) -> RelayRoot:
    """The root the arguments describe, reporting each version the tree has.

    Raises:
        ValueError: ``--curve`` was given (a root uses the trainer's keys).
    """
    if args.curve:
        raise ValueError(
            "--curve makes keys for a relay's own bus; a root joins the trainer's bus with "
            "the keys the trainer left (--name) or $ZMQSYNC_CURVE_CLIENT"
        )

    def relayed(r: Relayed) -> None:
        emit(
            {
                "event": "relayed",
                "version": r.version,
                "generation": r.generation,
                "relays": list(r.relays),
                "missing": list(r.missing),
                "seconds": r.seconds,
            }
        )

    tree = Tree(
        args.init_method,
        backend=args.backend,
        device=args.device,
        chunk_mb=args.chunk_mb,
        collective_timeout=args.collective_timeout,
    )
    return RelayRoot(
        args.address,
        name=args.name,
        tree=tree,
        ack=args.ack,
        timeout=args.timeout,
        on_timeout=args.on_timeout,
        heartbeat=args.heartbeat,
        on_relayed=relayed,
        security=Security(insecure=args.insecure),
    )


def _relay(args: argparse.Namespace, emit: Emit) -> Relay:
    """The relay the arguments describe, reporting each version it publishes here."""
    tree = Branch(
        args.init_method,
        relay_id=args.relay_id,
        device=args.device,
        join_timeout=args.connect_timeout,
    )
    return Relay(
        args.address,
        name=args.name,
        tree=tree,
        slots=args.slots,
        timeout=args.timeout,
        on_timeout=args.on_timeout,
        heartbeat=args.heartbeat,
        on_update=lambda v: emit({"event": "published", "version": v}),
        security=Security(curve=True if args.curve else None, insecure=args.insecure),
    )
