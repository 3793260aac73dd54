"""`zmqsync metrics`: a Prometheus exporter for one bus, in a process of its own.

It asks the bus's publisher for its state (the INSPECT that ``zmqsync inspect`` sends)
at every scrape of ``/metrics``, so it runs beside an unmodified trainer, in another
container too. A bus that does not answer when the exporter starts is a one-line error
(exit 1): a wrong name or address should not look like a healthy exporter. Later, while
the publisher does not answer, a scrape says ``zmqsync_up 0``, and 1 again once a
publisher answers at the address (a restarted trainer). Scrapes closer together than
``--min-interval`` share one INSPECT, so whoever reaches the port cannot make the
publisher answer more often than that. ``--tls-cert``/``--tls-key`` serve HTTPS, and
``--tls-client-ca`` lets only scrapers with a certificate of that CA read anything: the
metrics name workers, hosts and pids. docs/metrics.md lists the metrics.
prometheus_client is imported by `run` only, so ``zmqsync --help`` needs it not.
"""

from __future__ import annotations

import argparse
import sys
import threading
from typing import TYPE_CHECKING

from .._text import printable
from .args import add_target, bus_address, non_negative_int, positive
from .buses import ask
from .sniff import _signals_set

if TYPE_CHECKING:
    from ..metrics import ServerTLS

__all__ = ["DESCRIPTION", "HELP", "NAME", "add_arguments", "run"]

NAME = "metrics"
HELP = "serve a bus's metrics to Prometheus (/metrics over HTTP or HTTPS)"
DESCRIPTION = (
    "Serve /metrics for a bus, read over its control socket at each scrape: run it beside "
    "a trainer (or in another container) and point Prometheus at it. Needs "
    "prometheus-client (pip install prometheus-client). See docs/metrics.md."
)


def _port(text: str) -> int:
    """An argparse type: a TCP port, 0 to 65535 (usage error, exit 2, otherwise)."""
    port = non_negative_int(text)
    if port > 65535:
        raise argparse.ArgumentTypeError(f"a TCP port is at most 65535, not {text}")
    return port


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The bus, where to listen, and how long a scrape waits for the publisher."""
    add_target(p)
    p.add_argument(
        "--port", type=_port, required=True, help="TCP port to serve /metrics on (0: any free one)"
    )
    p.add_argument(
        "--listen",
        default="127.0.0.1",
        metavar="HOST",
        help="address to listen on (default 127.0.0.1; 0.0.0.0 in a container)",
    )
    p.add_argument(
        "--timeout",
        type=positive(float),
        default=1.0,
        help="how long a scrape waits for the publisher's answer (s, default 1)",
    )
    p.add_argument(
        "--min-interval",
        type=_non_negative_float,
        default=1.0,
        metavar="S",
        help="ask the publisher at most once per S seconds; scrapes in between get the "
        "last answer (default 1; 0: at every scrape)",
    )
    tls = p.add_argument_group(
        "TLS", "serve HTTPS; with --tls-client-ca, only to scrapers with a certificate of that CA"
    )
    tls.add_argument("--tls-cert", metavar="FILE", help="the server's certificate (PEM)")
    tls.add_argument("--tls-key", metavar="FILE", help="its private key (PEM, unencrypted)")
    tls.add_argument(
        "--tls-client-ca",
        metavar="FILE",
        help="CA certificates (PEM) a scraper's certificate must chain to; without a "
        "certificate of theirs a scraper gets nothing (RequireAndVerifyClientCert)",
    )


def _non_negative_float(text: str) -> float:
    """An argparse type: seconds, 0 or more (usage error, exit 2, otherwise)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value >= 0:  # NaN too
        raise argparse.ArgumentTypeError(f"must be 0 or more, not {text}")
    return value


def _tls(args: argparse.Namespace) -> ServerTLS | None:
    """The TLS the flags ask for, checked; None for plain HTTP.

    Raises:
        ValueError: a flag without its partner, or a file missing or bad: one line.
    """
    from ..metrics import ServerTLS

    if args.tls_cert is None and args.tls_key is None:
        if args.tls_client_ca is not None:
            raise ValueError("--tls-client-ca needs --tls-cert and --tls-key (the server's own)")
        return None
    if args.tls_cert is None or args.tls_key is None:
        raise ValueError("--tls-cert and --tls-key go together: the certificate and its key")
    tls = ServerTLS(args.tls_cert, args.tls_key, args.tls_client_ca)
    tls.check()
    return tls


def run(args: argparse.Namespace) -> int:
    """Serve until Ctrl-C or SIGTERM; exit 1 if the bus does not answer at the start."""
    try:
        from prometheus_client import CollectorRegistry
    except ImportError:
        from .._extras import install_hint

        print(
            f"zmqsync metrics: needs prometheus-client: {install_hint('metrics')}", file=sys.stderr
        )
        return 1
    from ..metrics import StateCollector, serve

    tls = _tls(args)  # raises: one line, exit 1, before the bus is asked
    address = bus_address(args)
    state = ask(address, max(args.timeout, 3.0), args.name)  # raises: one line, exit 1
    collector = StateCollector(
        address,
        state.name,
        timeout=args.timeout,
        name=args.name,
        min_interval=args.min_interval,
    )
    registry = CollectorRegistry()
    registry.register(collector)
    stop = threading.Event()
    try:
        server, thread = serve(registry, args.port, addr=args.listen, tls=tls)
        try:
            host, port = str(server.server_address[0]), server.server_address[1]
            scheme = "http" if tls is None else "https"
            who = ""
            if tls is not None:
                who = " (client certificates required)" if tls.client_ca_file else ""
            print(
                f"zmqsync metrics: serving {scheme}://{host}:{port}/metrics{who} for bus "
                f"{printable(state.name)} at {printable(address)}",
                flush=True,
            )
            with _signals_set(stop):
                while not stop.wait(3600):
                    pass
        finally:
            server.shutdown()
            server.server_close()
            thread.join(5)
    finally:
        collector.close()
    print(
        f"zmqsync metrics: stopped after {collector.scrapes} scrapes, "
        f"{collector.inspects} INSPECTs ({collector.failures} without an answer)",
        flush=True,
    )
    return 0
