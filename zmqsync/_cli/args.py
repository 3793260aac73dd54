"""Argument types and the bus target the commands share.

A bad value is a usage error (exit 2) with a line that says what is wrong, found by
argparse or here before libzmq sees it, never a zmq traceback.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from .. import _config

__all__ = ["add_target", "bus_address", "check_address", "non_negative_int", "positive"]


def positive(kind: Callable[[str], Any]) -> Callable[[str], Any]:
    """An argparse type: `kind`, and greater than 0 (usage error, exit 2, otherwise)."""

    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if not value > 0:
            raise argparse.ArgumentTypeError(f"must be greater than 0, not {text}")
        return value

    parse.__name__ = kind.__name__  # argparse names the type in its messages
    return parse


def non_negative_int(text: str) -> int:
    """An argparse type: a whole number, 0 or more (usage error, exit 2, otherwise)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, not {text}")
    return value


def check_address(address: str) -> str:
    """A ZeroMQ endpoint a bus can live at, or a one-line ValueError saying what is.

    Caught here, not by libzmq: ``localhost:5555`` or ``http://…`` would otherwise end
    in a zmq traceback ("Protocol not supported", "Invalid argument").
    """
    if address.startswith("ipc://") and len(address) > len("ipc://"):
        return address
    if address.startswith("tcp://"):
        host, _, port = address[len("tcp://") :].rpartition(":")
        if host and port.isdigit():
            return address
    raise ValueError(
        f"address {address!r} is not a bus address: use tcp://HOST:PORT (e.g. "
        "tcp://127.0.0.1:5555) or ipc:///path/to/bus.sock, or --name NAME for a bus on "
        "this host"
    )


def bus_address(args: argparse.Namespace) -> str:
    """The bus address the command names: its positional address, else --name's."""
    if args.address:
        return check_address(args.address)
    return _config.default_address(args.name)


def add_target(p: argparse.ArgumentParser) -> None:
    """The bus a command talks to: an address, or a name on this host."""
    p.add_argument(
        "address",
        nargs="?",
        help="the bus's control address, tcp://HOST:PORT or ipc:///PATH (default: from --name)",
    )
    p.add_argument(
        "--name",
        default="weights",
        help="bus name on this host, as the trainer gave it (default: weights)",
    )
