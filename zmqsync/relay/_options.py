"""How each side takes part in a relay tree: `Tree` (the root's) and `Branch` (a relay's).

A root and its relays meet at one rendezvous, but each side decides different things: the
root forms the tree (it hosts the rendezvous, picks the collective backend, cuts a
version into chunks, bounds every collective); a relay only finds it and joins (its id
on the tree, where NCCL stages its bytes, how long its start waits for a root). So each
side takes one small frozen object holding only the options that apply to it, as the
publisher takes `Copy`/`Overlapped`/`Live` and `Security`; an option of the other side
cannot be spelled:

    RelayRoot(name="policy", tree=Tree("tcp://0.0.0.0:29500", backend="nccl"))
    Relay(name="policy", tree=Branch("tcp://hostA:29500", relay_id="hostB"))

Both check their values when made, before any I/O; neither reads the environment
(``env://`` is read by the `RelayRoot` or `Relay` that is given one), so both are safe as
default arguments.
"""

from __future__ import annotations

import math
from dataclasses import KW_ONLY, dataclass

from .. import _config
from .._errors import ProtocolError
from ._messages import RELAY_ID
from ._rendezvous import check_init_method

__all__ = ["BACKENDS", "Branch", "Tree", "check_relay_id", "require"]

BACKENDS = ("gloo", "nccl")


def _seconds(value: float | None, name: str, *, finite: bool = False) -> None:
    """None, or a positive number of seconds (finite if `finite`)."""
    if value is None:
        return
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not number or not value > 0 or (finite and math.isinf(value)):
        raise ValueError(f"{name} must be a positive number of seconds or None, not {value!r}")


def _device(value: object, owner: str) -> str | None:
    """A CUDA device as its name: None, a str, or a ``torch.device`` (made a str here, so
    that the options stay plain values)."""
    if value is None or isinstance(value, str):
        return value
    if getattr(value, "type", None) == "cuda":  # a torch.device, without importing torch
        return str(value)
    raise TypeError(f"{owner}(device=) takes a CUDA device such as 'cuda:1', not {value!r}")


def check_relay_id(relay_id: str) -> str:
    """`relay_id`, if it can name a relay on the tree (it travels in every message).

    Raises:
        ValueError: not 1 to 128 printable ASCII characters without spaces.
    """
    try:
        return str(RELAY_ID(relay_id, "relay_id"))
    except ProtocolError as exc:
        raise ValueError(
            f"relay_id must be 1 to 128 printable ASCII characters without spaces (it "
            f"names the relay in every message of the tree), not {relay_id!r}"
        ) from exc


@dataclass(frozen=True)
class Tree:
    """How a `RelayRoot` forms the tree: the rendezvous it hosts, how versions travel.

    Args:
        init_method: the rendezvous this root hosts (a torch TCPStore): ``"env://"``
            (None, the default: MASTER_ADDR and MASTER_PORT, read by the root) or
            ``"tcp://HOST:PORT"`` (port 0: any free port, see
            `RelayRoot.init_method_url`). Relays give their `Branch` the same address.
        backend: "gloo" (CPU, the default) or "nccl" (each chunk goes through a CUDA
            staging buffer on `device`; it pays off between GPU hosts on a fast fabric).
        device: with "nccl", the CUDA device of the staging buffer (None: the current
            one). Nothing uses it with gloo, so it is refused there.
        chunk_mb: MiB per collective when a version is sent: smaller chunks bound the
            memory a transfer holds and the time one collective may take.
        collective_timeout: the timeout (s) of every collective (each chunk) and of
            building a group; None: about the time to declare a silent relay lost (6
            heartbeats, at least 1 s), never more than the root's `timeout`. A hung
            relay blocks the collective it is part of and nothing can cancel one, so this
            bounds how long the others wait before the group is re-formed without it.

    Raises:
        ValueError: a malformed `init_method`, an unknown `backend`, `device` with gloo,
            or a `chunk_mb` or `collective_timeout` that is not positive.
    """

    init_method: str | None = None
    _: KW_ONLY
    backend: str = "gloo"
    device: str | None = None
    chunk_mb: float = _config.RELAY_CHUNK_MB
    collective_timeout: float | None = None

    def __post_init__(self) -> None:
        check_init_method(self.init_method)
        if self.backend not in BACKENDS:
            raise ValueError(f'Tree(backend=) must be "gloo" or "nccl", not {self.backend!r}')
        object.__setattr__(self, "device", _device(self.device, "Tree"))
        if self.device is not None and self.backend != "nccl":
            raise ValueError(
                f"Tree(device={self.device!r}) is where NCCL stages each chunk; with backend="
                f'{self.backend!r} no bytes go through a GPU: pass backend="nccl" or leave '
                "device out"
            )
        chunk = self.chunk_mb
        if isinstance(chunk, bool) or not isinstance(chunk, (int, float)) or not chunk > 0:
            raise ValueError(f"Tree(chunk_mb=) must be a positive number of MiB, not {chunk!r}")
        if math.isinf(chunk):
            raise ValueError("Tree(chunk_mb=) must be finite: a version is sent in chunks")
        _seconds(self.collective_timeout, "Tree(collective_timeout=)")


@dataclass(frozen=True)
class Branch:
    """How a `Relay` finds the tree and joins it.

    Args:
        init_method: where the root's rendezvous is: ``"env://"`` (None, the default:
            MASTER_ADDR and MASTER_PORT, read by the relay) or ``"tcp://HOST:PORT"``
            (the root's `init_method_url`).
        relay_id: this relay's id on the tree (None: the host name); a relay that
            restarts with the same id replaces the old one, so give each relay of a
            host its own.
        device: the CUDA device of the NCCL staging buffer, if the root chooses NCCL
            (None: the current one); the root decides the backend, so gloo ignores it.
        join_timeout: how long `Relay.start()` waits for a root to accept it (s; None:
            the relay's `timeout`): a relay started before its root waits this long.

    Raises:
        ValueError: a malformed `init_method` or `relay_id`, or a `join_timeout` that is
            not a positive number of seconds.
    """

    init_method: str | None = None
    _: KW_ONLY
    relay_id: str | None = None
    device: str | None = None
    join_timeout: float | None = None

    def __post_init__(self) -> None:
        check_init_method(self.init_method)
        if self.relay_id is not None:
            check_relay_id(self.relay_id)
        object.__setattr__(self, "device", _device(self.device, "Branch"))
        _seconds(self.join_timeout, "Branch(join_timeout=)")


def require(tree: object, kind: type[Tree] | type[Branch], who: str) -> None:
    """Refuse a `tree=` that is not a `kind` with a TypeError that says what to pass.

    Raises:
        TypeError: `tree` is not a `kind` (the other side's object, or anything else).
    """
    if isinstance(tree, kind):
        return
    other = Branch if kind is Tree else Tree
    hint = ""
    if isinstance(tree, other):
        side = "a relay joins" if other is Branch else "a root forms"
        hint = f"; a {other.__name__} is how {side} the tree"
    example = (
        'Tree("tcp://HOST:PORT", backend="gloo")'
        if kind is Tree
        else 'Branch("tcp://ROOT:PORT", relay_id="hostB")'
    )
    raise TypeError(
        f"{who}(tree=) takes a zmqsync.{kind.__name__}, e.g. tree={example}, not {tree!r}{hint}"
    )
