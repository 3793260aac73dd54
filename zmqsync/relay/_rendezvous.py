"""Where root and relays meet: the rendezvous URL, the trust check, the store's keys.

The root hosts a torch ``TCPStore`` at the rendezvous address; relays read from it the
endpoints of the root's two ZeroMQ sockets (control and data). Everything here is
checked before any connection is made, so a wrong setting fails at construction.
"""

from __future__ import annotations

import os
import socket

from .._security import is_loopback

__all__ = [
    "check_init_method",
    "control_key",
    "data_identity",
    "data_key",
    "ip",
    "rendezvous",
    "require_trusted",
    "source_ip",
]


def check_init_method(init_method: str | None) -> str:
    """The rendezvous URL, checked for its form only: ``"env://"`` (also for None) or
    ``tcp://HOST:PORT``. The environment is not read here (see `rendezvous`), so that a
    `Tree` or `Branch` can be made, as a default argument too, before MASTER_ADDR is set.

    Raises:
        ValueError: neither form, or a port that is not a TCP port number.
    """
    url = init_method or "env://"
    if url == "env://":
        return url
    if not (url.startswith("tcp://") and ":" in url[len("tcp://") :]):
        raise ValueError(f"init_method {url!r}: use 'env://' or 'tcp://HOST:PORT'")
    _port(url.rsplit(":", 1)[1])
    return url


def _port(port: str) -> int:
    if not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"rendezvous port {port!r} is not a TCP port number")
    return int(port)


def rendezvous(init_method: str | None) -> tuple[str, int]:
    """(host, port) of the root's TCPStore from ``env://`` or ``tcp://host:port``.

    Raises:
        ValueError: the URL or the environment variables are missing or malformed.
    """
    url = check_init_method(init_method)
    if url == "env://":
        host, port = os.environ.get("MASTER_ADDR", ""), os.environ.get("MASTER_PORT", "")
        if not host or not port:
            raise ValueError(
                "init_method env:// needs MASTER_ADDR and MASTER_PORT (the root's address "
                "and a free port on it), or give the address: Tree('tcp://HOST:PORT') on the "
                "root, Branch('tcp://HOST:PORT') on a relay (--init-method)"
            )
    else:
        host, port = url[len("tcp://") :].rsplit(":", 1)
        host = host.strip("[]")
    return host, _port(port)


def require_trusted(host: str, insecure: bool) -> None:
    """Refuse a rendezvous other hosts can reach unless the caller said the network is
    trusted: the TCPStore, gloo and NCCL have no authentication.

    Raises:
        ValueError: `host` is not a loopback address and `insecure` is False.
    """
    if not insecure and not is_loopback(f"tcp://{host}:0"):
        raise ValueError(
            f"rendezvous address {host} is reachable from other hosts, and torch.distributed "
            "(TCPStore, gloo, NCCL) has no authentication: run relays on a trusted cluster "
            "network and pass security=Security(insecure=True) (--insecure) to say so, or use "
            "127.0.0.1"
        )


def ip(host: str) -> str:
    """An address ZeroMQ can bind/connect (it does not resolve names on bind).

    Raises:
        ValueError: the name does not resolve.
    """
    try:
        return socket.gethostbyname(host)
    except OSError as exc:
        raise ValueError(f"cannot resolve rendezvous host {host!r}: {exc}") from exc


def source_ip(host: str) -> str:
    """The address of this host that packets to `host` leave from (its route to `host`;
    nothing is sent: a UDP socket is only connected).

    Raises:
        ValueError: `host` does not resolve, or no route leads there.
    """
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, 9, type=socket.SOCK_DGRAM)[0]
        with socket.socket(family, kind, proto) as probe:
            probe.connect(address)
            return str(probe.getsockname()[0])
    except OSError as exc:
        raise ValueError(f"no route from this host to the rendezvous host {host!r}: {exc}") from exc


def control_key(name: str) -> str:
    """The store key under which the root publishes its control ROUTER's endpoint."""
    return f"zmqsync/{name}/control"


def data_key(name: str) -> str:
    """The store key under which the root publishes its data ROUTER's endpoint."""
    return f"zmqsync/{name}/data"


def data_identity(relay_id: str) -> bytes:
    """The routing id of a relay's data-thread DEALER on the root's data ROUTER."""
    return relay_id.encode()
