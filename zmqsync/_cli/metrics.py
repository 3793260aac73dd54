"""`zmqsync metrics`: a Prometheus exporter for one bus, in a process of its own.

It asks the bus's publisher for its state (the INSPECT that ``zmqsync inspect`` sends)
at every scrape of ``/metrics``, so it runs beside an unmodified trainer, in another
container too. A bus that does not answer when the exporter starts is a one-line error
(exit 1): a wrong name or address should not look like a healthy exporter. Later, while
the publisher does not answer, a scrape says ``zmqsync_up 0``, and 1 again once a
publisher answers at the address (a restarted trainer). docs/metrics.md lists the
metrics. prometheus_client is imported by `run` only, so ``zmqsync --help`` needs it not.
"""

from __future__ import annotations

import argparse
import sys
import threading

from .._text import printable
from .args import add_target, bus_address, non_negative_int, positive
from .buses import ask
from .sniff import _signals_set

__all__ = ["DESCRIPTION", "HELP", "NAME", "add_arguments", "run"]

NAME = "metrics"
HELP = "serve a bus's metrics to Prometheus (/metrics over HTTP)"
DESCRIPTION = (
    "Serve /metrics for a bus, read over its control socket at each scrape: run it beside "
    "a trainer (or in another container) and point Prometheus at it. Needs "
    "prometheus-client (pip install 'zmqsync[metrics]'). See docs/metrics.md."
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


def run(args: argparse.Namespace) -> int:
    """Serve until Ctrl-C or SIGTERM; exit 1 if the bus does not answer at the start."""
    try:
        from prometheus_client import CollectorRegistry, start_http_server
    except ImportError:
        print(
            "zmqsync metrics: needs prometheus-client: pip install 'zmqsync[metrics]'",
            file=sys.stderr,
        )
        return 1
    from ..metrics import StateCollector

    address = bus_address(args)
    state = ask(address, max(args.timeout, 3.0), args.name)  # raises: one line, exit 1
    collector = StateCollector(address, state.name, timeout=args.timeout, name=args.name)
    registry = CollectorRegistry()
    registry.register(collector)
    stop = threading.Event()
    try:
        server, thread = start_http_server(args.port, addr=args.listen, registry=registry)
        try:
            host, port = str(server.server_address[0]), server.server_address[1]
            print(
                f"zmqsync metrics: serving http://{host}:{port}/metrics for bus "
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
        f"zmqsync metrics: stopped after {collector.scrapes} scrapes "
        f"({collector.failures} without an answer)",
        flush=True,
    )
    return 0
