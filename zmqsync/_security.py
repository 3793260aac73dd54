"""Who may connect: loopback and ipc:// by default, CURVE for anything else.

On one host the runtime dir's permissions (0700) decide who can reach an ipc:// socket,
and a loopback tcp:// address is reachable only from this host's network namespace. A
tcp:// address on any other interface is reachable by the network, so it requires CURVE
(encryption plus an allowlist of client public keys, checked through ZAP by the
publisher's `Gate`) unless the caller passes ``insecure=True`` explicitly. An
unauthorized client gets no handshake, no events, and its messages never reach the
publisher's code.

Keys are Z85 text (40 characters), as made by `curve_keypair()`.

CURVE is one flag away on one host: ``Publisher(..., security=Security(curve=True))``
makes a server key pair and one client key pair for the bus, and writes the client's keys to
``<runtime dir>/<name>.curve`` (0600; 0640 with the bus's group). A subscriber, `zmqsync
inspect` or `sniff` for that name finds the file there and uses it; whoever cannot read
the runtime dir cannot join. The publisher removes the file when it closes (and one left
by a killed publisher when the next one starts without CURVE). Each start makes new
keys, so a subscriber given none reads them again for every connection (`found_keys`).
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import logging
import os
import tempfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import zmq
from zmq.utils import z85

__all__ = [
    "CurveClient",
    "CurveServer",
    "Security",
    "client_from_env",
    "client_keys_path",
    "curve_keypair",
    "forget_keys",
    "found_keys",
    "is_loopback",
    "issue_keys",
    "require_security",
]

log = logging.getLogger(__name__)

ZAP_DOMAIN = "zmqsync"


def curve_keypair() -> tuple[str, str]:
    """A new (public, secret) CURVE key pair, Z85 text."""
    public, secret = zmq.curve_keypair()
    return public.decode(), secret.decode()


def _key(value: str | bytes) -> bytes:
    raw = value.encode() if isinstance(value, str) else value
    if len(raw) != 40:
        raise ValueError("CURVE keys are 40 characters of Z85 text (see zmqsync.curve_keypair())")
    return raw


@dataclass(frozen=True)
class CurveServer:
    """A publisher's key pair and the client public keys it lets in."""

    public: str
    secret: str
    allowed_clients: frozenset[str] = field(default_factory=frozenset)

    def __init__(self, public: str, secret: str, allowed_clients: Iterable[str] = ()) -> None:
        object.__setattr__(self, "public", _key(public).decode())
        object.__setattr__(self, "secret", _key(secret).decode())
        object.__setattr__(
            self, "allowed_clients", frozenset(_key(k).decode() for k in allowed_clients)
        )

    def __repr__(self) -> str:  # never print a secret
        return f"CurveServer(public={self.public!r}, {len(self.allowed_clients)} clients)"

    def apply(self, sock: zmq.Socket[bytes]) -> None:
        sock.zap_domain = ZAP_DOMAIN.encode()
        # Without a ZAP handler libzmq would let every key in ("Stonehouse"): enforced,
        # a handshake then fails instead (while the publisher opens or closes).
        sock.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)
        sock.curve_secretkey = _key(self.secret)
        sock.curve_publickey = _key(self.public)
        sock.curve_server = True

    def allows(self, key: bytes) -> bool:
        """Whether a client's public key (32 bytes, as ZAP gives it) may connect."""
        return len(key) == 32 and z85.encode(key).decode() in self.allowed_clients


@dataclass(frozen=True)
class CurveClient:
    """A subscriber's (or inspector's) key pair and the publisher's public key."""

    server_public: str
    public: str
    secret: str

    def __repr__(self) -> str:
        return f"CurveClient(server_public={self.server_public!r}, public={self.public!r})"

    def apply(self, sock: zmq.Socket[bytes]) -> None:
        sock.curve_serverkey = _key(self.server_public)
        sock.curve_publickey = _key(self.public)
        sock.curve_secretkey = _key(self.secret)


def client_from_env(name: str | None = None) -> CurveClient | None:
    """A client's keys: from the JSON file named by $ZMQSYNC_CURVE_CLIENT, else (given a
    bus `name`) from the file a ``curve=True`` publisher wrote in the runtime dir.

    The file holds {"server_public": ..., "public": ..., "secret": ...}; keep it 0600.
    """
    path = os.environ.get("ZMQSYNC_CURVE_CLIENT")
    if not path and name is not None:
        path = client_keys_path(name)
        if not os.path.exists(path):
            return None
    if not path:
        return None
    with open(path) as f:
        keys = json.load(f)
    return CurveClient(keys["server_public"], keys["public"], keys["secret"])


def found_keys(name: str) -> Callable[[zmq.Socket[bytes]], None]:
    """CURVE options for each socket of a subscriber of bus `name` given no keys: those
    `client_from_env` finds when the socket is made, if any.

    Read again for every socket, not once: a ``curve=True`` publisher makes new keys
    each time it starts, so a worker that started before it, or outlives its restart,
    must use the keys there are now. Without keys (a bus without CURVE, or a file not
    written yet) the socket connects without CURVE, and a CURVE publisher does not answer
    it: the handshake's next attempt reads the keys again.
    """

    def apply(sock: zmq.Socket[bytes]) -> None:
        try:
            keys = client_from_env(name)
        except FileNotFoundError as exc:  # $ZMQSYNC_CURVE_CLIENT names a file not there yet
            log.info("no CURVE keys at %s yet: connecting without", exc.filename)
            return
        if keys is not None:
            keys.apply(sock)

    return apply


def client_keys_path(name: str) -> str:
    """Where a ``curve=True`` publisher of bus `name` leaves its client keys."""
    from ._config import check_name, runtime_dir

    return os.path.join(runtime_dir(), f"{check_name(name)}.curve")


def issue_keys(name: str, gid: int | None) -> CurveServer:
    """Keys for a ``curve=True`` bus: the server's, allowing one client key pair whose
    keys are written (atomically, never readable by others) for the bus's subscribers."""
    server_public, server_secret = curve_keypair()
    public, secret = curve_keypair()
    path = client_keys_path(name)
    directory = os.path.dirname(path)
    fd, tmp = tempfile.mkstemp(prefix=".curve-", dir=directory)  # created 0600
    try:
        if gid is not None:
            os.fchown(fd, -1, gid)
            os.fchmod(fd, 0o640)
        with os.fdopen(fd, "w") as f:
            json.dump({"server_public": server_public, "public": public, "secret": secret}, f)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return CurveServer(server_public, server_secret, allowed_clients=[public])


def forget_keys(name: str) -> None:
    """Remove the client keys of bus `name` (the publisher is closing, or uses none)."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(client_keys_path(name))


def is_loopback(address: str) -> bool:
    """ipc://, inproc:// and tcp:// on 127.0.0.0/8, ::1 or localhost."""
    if not address.startswith("tcp://"):
        return True
    host = address[len("tcp://") :].rsplit(":", 1)[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # "*", an interface name, a host name: reachable from outside


def require_security(address: str, curve: CurveServer | None, insecure: bool) -> None:
    if curve is None and not insecure and not is_loopback(address):
        raise ValueError(
            f"{address} is reachable from other hosts: give it CURVE keys (a Publisher: "
            "security=zmqsync.Security(curve=True); see docs/security.md), use a loopback "
            "or ipc:// address, or pass insecure=True to accept unauthenticated clients "
            "knowingly"
        )


@dataclass(frozen=True)
class Security:
    """Who may reach a bus, what they can see, what they may make it spend, and whom a
    worker trusts: every public class takes one (``security=``), each using the options
    that apply to it and refusing the others with a clear error.

    The defaults suit one host: ipc:// or loopback, no keys, the runtime dir's 0700
    deciding who connects. See docs/security.md for what each option defends against.

    Args:
        curve: A publisher (or a relay's bus): True makes keys for this bus and leaves
            the client's in the runtime dir, where subscribers of this name find them;
            or a `CurveServer` (keys and a client allowlist). Required for a tcp://
            address that is not loopback; on loopback tcp without it any local user can
            join. A subscriber (or a relay root joining a trainer): a `CurveClient`
            (its keys and the publisher's public key); None or True: the keys
            $ZMQSYNC_CURVE_CLIENT names, else those a ``curve=True`` publisher of the
            bus's name left in the runtime dir, if any.
        insecure: allow a non-loopback tcp:// address without CURVE, and a relay's
            non-loopback rendezvous (explicit opt-in).
        group: a group name or gid that may use the bus (socket files and segments
            become 0660 with that group), for containers running as different uids.
        tap: open the tap socket that mirrors every message for `zmqsync sniff`
            (sessions and nonces hashed); None: on when ZMQSYNC_TAP is "1".
        max_workers: HELLOs from new worker ids past this many are refused ("bus full").
        max_workers_per_peer: workers one peer (a process on ipc://, a host on tcp://)
            may hold; past it its new worker ids are refused ("bus full"), so that one
            peer cycling ids cannot fill the bus. None: three quarters of max_workers.
            Raise it to max_workers when one peer holds most workers by design (every
            worker over loopback tcp, or in containers of another pid namespace).
        handshake_rate: HELLOs, and new connections to the events and tap sockets, per
            second *per peer* (a storm is refused and counted; a welcomed worker's peer
            has four times that of its own).
        publisher_uid: a subscriber: the uid the publisher's segments must belong to.
            None: the owner of the ipc:// control socket, else this process's uid (a
            tcp:// bus of another uid needs it: docs/security.md).
    """

    curve: CurveServer | CurveClient | bool | None = None
    insecure: bool = False
    group: str | int | None = None
    tap: bool | None = None
    max_workers: int = 1024
    handshake_rate: float = 200.0
    max_workers_per_peer: int | None = None
    publisher_uid: int | None = None

    def __post_init__(self) -> None:
        if self.max_workers < 1 or self.handshake_rate <= 0:
            raise ValueError("max_workers must be >= 1 and handshake_rate > 0")
        per_peer = self.max_workers_per_peer
        if per_peer is not None and not 1 <= per_peer <= self.max_workers:
            raise ValueError("max_workers_per_peer must be between 1 and max_workers")
        if self.curve is False:
            object.__setattr__(self, "curve", None)

    def bus_side(self, who: str) -> None:
        """Check that these options suit a bus's side (a publisher, a relay's bus):
        ValueError naming the first that does not."""
        if isinstance(self.curve, CurveClient):
            raise ValueError(
                f"{who} serves a bus: its security takes curve=True or a CurveServer, not "
                "a CurveClient (the keys of a worker)"
            )
        if self.publisher_uid is not None:
            raise ValueError(f"{who} serves a bus: publisher_uid= is a subscriber's option")

    def worker_side(self, who: str, *, insecure: bool = False) -> CurveClient | None:
        """The keys these options give a worker's side (a subscriber, a relay root), or
        None: find them by the bus's name. ValueError for an option of a bus's side
        (`insecure` too, unless the caller has a use for it)."""
        if isinstance(self.curve, CurveServer):
            raise ValueError(
                f"{who} joins a bus: its security takes curve=CurveClient(...) (or None: "
                "the keys a curve=True publisher of this name left), not a CurveServer"
            )
        default = Security()
        publisher_only = [
            option
            for option in ("group", "tap", "max_workers", "handshake_rate", "max_workers_per_peer")
            if getattr(self, option) != getattr(default, option)
        ]
        if self.insecure and not insecure:
            publisher_only.insert(0, "insecure")
        if publisher_only:
            raise ValueError(
                f"{who} joins a bus: {', '.join(publisher_only)} "
                f"{'is an option' if len(publisher_only) == 1 else 'are options'} of the "
                "publisher's security, not a worker's"
            )
        return self.curve if isinstance(self.curve, CurveClient) else None
