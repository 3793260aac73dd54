"""Finding a bus and asking it once: INSPECT, with errors that name the buses here.

A bus that does not answer is the most common mistake (a wrong name, a trainer not
started, one killed): the errors say which buses do answer in the runtime dir, or that
the socket file is left over, so the operator need not guess.
"""

from __future__ import annotations

import os
from typing import Any

from .. import _config
from .._errors import ConnectTimeout, ZmqSyncError
from .._text import printable

__all__ = ["NoSuchBus", "ask", "inspect_bus", "socket_path", "wait_for_bus", "where_are_buses"]


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
