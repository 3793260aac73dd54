"""`zmqsync buses`, and finding a bus and asking it once: INSPECT, with errors that name
the buses here.

A bus that does not answer is the most common mistake (a wrong name, a trainer not
started, one killed): the errors say which buses do answer in the runtime dir, or that
the socket file is left over, so the operator need not guess. ``zmqsync buses`` lists
them all: each socket file in the runtime dir, asked once (pid, version, workers).
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

from .. import _config
from .._errors import ConnectTimeout, ZmqSyncError
from .._text import printable
from .args import positive

__all__ = [
    "DESCRIPTION",
    "HELP",
    "NAME",
    "NoSuchBus",
    "add_arguments",
    "ask",
    "inspect_bus",
    "run",
    "socket_path",
    "wait_for_bus",
    "where_are_buses",
]

NAME = "buses"
HELP = "list the buses on this host: name, address, pid, version, workers"
DESCRIPTION = (
    "List the buses whose socket files are in the runtime dir ($ZMQSYNC_RUNTIME_DIR, else "
    "$XDG_RUNTIME_DIR/zmqsync, else /tmp/zmqsync-UID), asking each publisher once for its "
    "pid, version and workers. A socket file nobody listens at is left over from a "
    "publisher that is gone (`zmqsync gc` removes it). Buses on tcp:// addresses have no "
    "socket file: ask them with `zmqsync inspect tcp://HOST:PORT`."
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """How to print, and how long to wait for each publisher."""
    p.add_argument("--json", action="store_true", help="one JSON object per bus")
    p.add_argument(
        "--timeout",
        type=positive(float),
        default=1.0,
        help="how long to wait for each publisher's answer (s, default 1)",
    )


def run(args: argparse.Namespace) -> int:
    """List the buses in the runtime dir; 0 also when there are none."""
    directory = _config.runtime_dir()
    found = [_describe(directory, entry, args.timeout) for entry in _sockets_in(directory)]
    if args.json:  # ASCII-only JSON, as for inspect --json: names come from peers
        for bus in found:
            print(json.dumps(bus, ensure_ascii=True), flush=True)
        return 0
    _print_table(directory, found)
    return 0


def _sockets_in(directory: str) -> list[str]:
    """The control socket files in `directory` (``<name>.sock``), by name."""
    return sorted(e for e in os.listdir(directory) if e.endswith(".sock"))


def _describe(directory: str, entry: str, timeout: float) -> dict[str, Any]:
    """One bus: what its publisher answers, or why it does not."""
    from .._gc import _refused

    name = entry[: -len(".sock")]
    path = os.path.join(directory, entry)
    bus: dict[str, Any] = {"name": name, "address": f"ipc://{path}"}
    if _refused(path):
        return {**bus, "state": "left over"}
    try:
        state = inspect_bus(bus["address"], timeout, name)
    except ZmqSyncError as exc:  # a timeout, or an answer that is not STATE
        return {**bus, "state": "no answer", "reason": str(exc)}
    applied = sum(1 for w in state.workers if w.version >= 0)
    return {
        **bus,
        "state": "up",
        "bus": state.bus,
        "pid": state.pid,
        "version": state.version,
        "workers": len(state.workers),
        "applied": applied,
    }


def _print_table(directory: str, found: list[dict[str, Any]]) -> None:
    from rich.box import SIMPLE_HEAD
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    console = Console(highlight=False)
    if not found:
        console.print(Text(f"no buses in {directory}"))
        return
    # no vertical rules: an 80-column terminal holds a whole address
    table = Table(
        title=Text(f"buses in {directory}"), title_justify="left", box=SIMPLE_HEAD, pad_edge=False
    )
    for col in ("name", "address", "pid", "version", "workers"):
        right = col in ("pid", "version", "workers")
        table.add_column(col, justify="right" if right else "left", overflow="fold")
    for bus in found:
        up = bus["state"] == "up"
        workers = Text(str(bus["workers"]) if up else bus["state"], style="" if up else "yellow")
        if up and bus["applied"] != bus["workers"]:  # welcomed, no version applied yet
            workers.append(f" ({bus['applied']} applied)")
        table.add_row(
            Text(printable(bus["name"])),
            Text(printable(bus["address"])),
            str(bus["pid"]) if up else "-",
            str(bus["version"]) if up else "-",
            workers,
        )
    console.print(table)
    if any(bus["state"] == "left over" for bus in found):
        console.print("left over: from a publisher that is gone; `zmqsync gc` removes it")


class NoSuchBus(ZmqSyncError):
    """No publisher's socket file at the bus's ipc:// address: nothing to ask."""


def socket_path(address: str) -> str | None:
    """The socket file of an ipc:// address, or None for tcp://."""
    return address[len("ipc://") :] if address.startswith("ipc://") else None


def _buses_here() -> list[str]:
    """Names of the buses whose publisher answers in the runtime dir (ipc:// only)."""
    from .._gc import _refused

    try:
        directory = _config.runtime_dir()
        names = sorted(os.listdir(directory))
    except OSError:
        return []
    found = []
    for entry in names:
        path = os.path.join(directory, entry)
        if entry.endswith(".sock") and not _refused(path):
            found.append(entry[: -len(".sock")])
    return found


def where_are_buses(address: str) -> str:
    """A hint for an ipc:// bus that did not answer: which buses do, or that it is dead."""
    from .._gc import _refused

    path = socket_path(address)
    if path is None:
        return ""
    if os.path.exists(path) and _refused(path):
        return f"; {path} is left over from a publisher that is gone (`zmqsync gc` removes it)"
    buses = _buses_here()
    listed = ", ".join(printable(b) for b in buses) if buses else "none"
    return f"; buses answering in {os.path.dirname(path)}: {listed}"


def _require_socket(address: str) -> None:
    """An ipc:// bus without its socket file cannot answer: say so now, not after the
    request's deadline, and name the buses that are there."""
    path = socket_path(address)
    if path is not None and not os.path.exists(path):
        raise NoSuchBus(f"no bus at {address} (no such socket file){where_are_buses(address)}")


def inspect_bus(address: str, timeout: float, name: str | None = None) -> Any:
    """The bus's STATE, from one INSPECT (with CURVE keys if the environment has them).

    Raises:
        ConnectTimeout: no answer within `timeout`.
        ProtocolError: the publisher answered with something other than STATE.
    """
    import zmq

    from .._deadline import Deadline
    from .._errors import ProtocolError
    from .._protocol import Inspect, State
    from .._security import client_from_env
    from .._sockets import request

    ctx = zmq.Context()
    try:
        curve = client_from_env(name)
        secure = curve.apply if curve is not None else None
        reply = request(ctx, address, Inspect(""), deadline=Deadline(timeout), secure=secure)
    finally:
        ctx.destroy(linger=0)
    if not isinstance(reply, State):
        raise ProtocolError(f"expected STATE, got {reply.TYPE}: {getattr(reply, 'reason', '')}")
    return reply


def ask(address: str, timeout: float, name: str | None = None) -> Any:
    """One INSPECT; a one-line error that names the buses here when nobody answers."""
    _require_socket(address)
    try:
        return inspect_bus(address, timeout, name)
    except ConnectTimeout as exc:
        raise ConnectTimeout(f"{exc}{where_are_buses(address)}") from exc


def wait_for_bus(address: str, timeout: float, name: str | None = None) -> Any:
    """INSPECT, retried until a publisher answers or `timeout` passes."""
    from .._deadline import Deadline

    deadline = Deadline(timeout)
    while True:
        try:
            return inspect_bus(address, min(1.0, deadline.remaining() or 1.0), name)
        except ConnectTimeout as exc:
            if deadline.expired():
                raise ConnectTimeout(f"{exc}{where_are_buses(address)}") from exc
