"""`zmqsync inspect`: ask a bus's publisher once for its state and print it.

With ``--json`` the state is ASCII-only JSON (the IPC handles left out: they are for
subscribers); otherwise tables (`_inspect_view`). Either way it says who besides the
owner can join the bus, and shows the relay tree when a relay root runs beside it.
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

from .._text import printable
from .args import add_target, bus_address, positive
from .buses import ask, socket_path

__all__ = ["DESCRIPTION", "HELP", "NAME", "add_arguments", "run"]

NAME = "inspect"
HELP = "manifest, buffers, workers and counters of a bus"
DESCRIPTION = "Ask a bus's publisher once for its state and print it."

_SECURITY_DOC = "docs/security.md"


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The bus, and how long to wait for its answer."""
    add_target(p)
    p.add_argument("--json", action="store_true", help="the state as JSON")
    p.add_argument(
        "--timeout",
        type=positive(float),
        default=3.0,
        help="how long to wait for the answer (s, default 3)",
    )


def run(args: argparse.Namespace) -> int:
    """Print the bus's state (and its relay tree, if any)."""
    from .._inspect_view import lag_of, print_relays, print_state
    from .._protocol import to_plain

    address = bus_address(args)
    reply = ask(address, args.timeout, args.name)
    access = _access(address, args.name)
    relays = _relay_tree(address, min(args.timeout, 1.0))  # None: no relay root
    if args.json:
        plain = to_plain(reply)
        for buf in plain["buffers"]:
            buf.pop("handle")  # IPC handle bytes are for subscribers, not for screens
        for worker in plain["workers"]:  # as the table shows it; None before its first ack
            worker["lag"] = lag_of(reply, worker["version"])
        if relays is not None:
            plain["relays"] = relays
        plain["access"] = access
        # ASCII only: control characters and non-ASCII peer text (a bidi override)
        # become \uXXXX escapes, exact for a parser and inert on a terminal.
        print(json.dumps(plain, indent=2, ensure_ascii=True))
    else:
        print_state(reply, _access_warning(address, access))
        if relays is not None:
            print_relays(relays)
    return 0


def _access(address: str, name: str | None = None) -> dict[str, Any]:
    """Who besides its owner can join the bus at `address`, as far as an inspector can tell.

    A tcp:// bus with CURVE answers only clients with keys, so an answer to an inspector
    that had none ($ZMQSYNC_CURVE_CLIENT unset) means the bus has no CURVE. On loopback
    that opens it to every local user: anyone can inspect it, join as a worker and, by
    never acking, stall every publish until its deadline. An ipc:// bus lives in a
    runtime dir only its user can enter (0700), so it says nothing there.

    Returns:
        ``curve``: whether this inspector connected with CURVE keys; ``open_to``:
        ``"local users"`` (loopback tcp, no CURVE), ``"network"`` (any other tcp, no
        CURVE: the publisher was started with ``insecure=True``) or None.
    """
    from .._security import client_from_env, is_loopback

    curve = client_from_env(name) is not None
    open_to: str | None = None
    if address.startswith("tcp://") and not curve:
        open_to = "local users" if is_loopback(address) else "network"
    return {"curve": curve, "open_to": open_to, "see": _SECURITY_DOC}


def _access_warning(address: str, access: dict[str, Any]) -> str | None:
    """One line for the human output, or None when nothing is open."""
    who = {"local users": "any local user", "network": "any host that can reach it"}
    if access["open_to"] not in who:
        return None
    return (
        f"warning: {printable(address)} has no CURVE: {who[access['open_to']]} can join this "
        "bus (inspect it, join as a worker, stall publishes by never acking); "
        f"see {_SECURITY_DOC} to require keys"
    )


def _relay_tree(address: str, timeout: float) -> dict[str, Any] | None:
    """The bus's relay tree, or None. The relay package imports torch: it is loaded only
    when a relay root's socket file lies next to the bus."""
    path = socket_path(address)
    if path is None or not os.path.exists(f"{path}.relay"):  # _sockets.sibling_endpoint
        return None
    from ..relay import inspect_relays

    return inspect_relays(address, timeout)
