"""Prometheus metrics of a bus: collectors for prometheus-client (``zmqsync[metrics]``).

A trainer that already exports metrics registers ours in its own registry; one that does
not can start the client's HTTP server::

    from prometheus_client import REGISTRY, start_http_server
    from zmqsync.metrics import PublisherCollector

    REGISTRY.register(PublisherCollector(pub))
    start_http_server(9108)

A worker does the same with `SubscriberCollector`, a relay tree's root and relays with
`RelayCollector`. The collectors are custom collectors
in prometheus-client's sense: they read, at each scrape, what a `Publisher` or
`Subscriber` counts anyway (its version, workers and counters), so a publish or an apply
does no work for them. `StateCollector` reads the same from another process, over the
control socket's INSPECT, which is what ``zmqsync metrics`` serves; a bus that does not
answer is ``zmqsync_up 0``, and scrapes closer together than its ``min_interval`` share
one INSPECT. `serve` starts prometheus-client's HTTP server, with TLS and client
certificates when given a `ServerTLS`. docs/metrics.md lists every metric.

This module imports prometheus_client; ``import zmqsync`` never imports this module.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import ssl
import sys
import threading
import time
from collections.abc import Iterable, Iterator
from typing import Any

try:
    from prometheus_client.core import (
        CounterMetricFamily,
        GaugeMetricFamily,
        HistogramMetricFamily,
        Metric,
    )
    from prometheus_client.registry import Collector
except ImportError as exc:  # pragma: no cover - the extra is installed in CI
    from ._extras import install_hint

    raise ImportError(
        f"zmqsync.metrics needs prometheus-client: {install_hint('metrics')}"
    ) from exc

from ._bus_sample import BusSample, from_publisher, from_state
from ._histogram import APPLY, BLOCKED_IN_PUBLISH, BLOCKED_IN_STEP, PUBLISH, Keys, read
from ._registry import lag
from ._text import printable

__all__ = [
    "PublisherCollector",
    "RelayCollector",
    "ServerTLS",
    "StateCollector",
    "SubscriberCollector",
    "serve",
]

log = logging.getLogger(__name__)

# Publisher counters shown as zmqsync_refused_total{reason}: what each refusal means.
_REFUSALS = {
    "rejected": "invalid",  # a request or worker message outside the protocol
    "refused_ids": "id_in_use",  # a HELLO for a worker id a live process holds
    "throttled": "handshake_rate",  # a HELLO beyond handshake_rate
    "refused_connections": "connections",  # a connection beyond the fd budget or a rate
    "dropped_peers": "flooding",  # a peer dropped for what it sent
    "stale": "stale_session",  # an ACK or HEARTBEAT of a session no longer on the bus
}


def _histogram_family(name: str, doc: str, labels: list[str]) -> HistogramMetricFamily:
    return HistogramMetricFamily(name, doc, labels=labels)


def _add_histogram(
    family: HistogramMetricFamily, values: list[str], counts: Any, keys: Keys
) -> None:
    hist = read(counts, keys)
    buckets = [("+Inf" if math.isinf(le) else repr(le), float(n)) for le, n in hist.buckets]
    family.add_metric(values, buckets, hist.sum)


def _bus_families(bus: str, sample: BusSample | None) -> list[Metric]:
    """Every metric of one bus; `sample` None: its publisher did not answer (up 0 only).

    Label values a peer chose (bus name, worker id, host) are made `printable`: the
    exposition format escapes only quotes, backslashes and newlines, and a scrape read
    with curl on a terminal must not run a peer's escape sequences.
    """
    bus = printable(bus)
    up = GaugeMetricFamily(
        "zmqsync_up", "1 if the bus's publisher answered this scrape, else 0", labels=["bus"]
    )
    up.add_metric([bus], 0.0 if sample is None else 1.0)
    if sample is None:
        return [up]
    b, c = [bus], sample.counters
    info = GaugeMetricFamily(
        "zmqsync_publisher_info",
        "the publisher's bus id (new at every start) and pid; always 1",
        labels=["bus", "bus_id", "pid"],
    )
    info.add_metric([bus, sample.bus_id, str(sample.pid)], 1.0)
    version = GaugeMetricFamily("zmqsync_version", "the last published version", labels=["bus"])
    version.add_metric(b, float(sample.version))
    workers = GaugeMetricFamily("zmqsync_workers", "workers on the bus now", labels=["bus"])
    workers.add_metric(b, float(len(sample.workers)))
    per = ["bus", "worker"]
    w_version = GaugeMetricFamily(
        "zmqsync_worker_version", "the last version the worker acknowledged", labels=per
    )
    w_lag = GaugeMetricFamily(
        "zmqsync_worker_lag", "versions the worker is behind the latest", labels=per
    )
    w_silent = GaugeMetricFamily(
        "zmqsync_worker_last_seen_seconds", "seconds since the worker's last message", labels=per
    )
    w_info = GaugeMetricFamily(
        "zmqsync_worker_info",
        "how the worker applies and reads versions, and where it runs; always 1",
        labels=[*per, "mode", "transport", "host", "pid"],
    )
    for w in sample.workers:
        who = [bus, printable(w.worker_id)]
        w_version.add_metric(who, float(w.version))
        if w.lag is not None:  # no series before its first ack: its lag is unknown
            w_lag.add_metric(who, float(w.lag))
        w_silent.add_metric(who, w.silent_s)
        w_info.add_metric([*who, w.mode, w.transport, printable(w.host), str(w.pid)], 1.0)
    seconds = _histogram_family(
        "zmqsync_publish_seconds",
        "from publish() to the last worker's ack, for publishes whose end was waited for",
        ["bus"],
    )
    _add_histogram(seconds, b, c, PUBLISH)
    families: list[Metric] = [up, info, version, workers, w_version, w_lag, w_silent, w_info]
    families.append(seconds)
    for name, key, doc in (
        ("zmqsync_publishes", "publishes", "versions published (version 0 not counted)"),
        ("zmqsync_publish_timeouts", "timeouts", "publishes that missed their deadline"),
        ("zmqsync_acks", "acks", "acknowledgements counted"),
        ("zmqsync_handshakes", "handshakes", "workers welcomed (joins and re-joins)"),
    ):
        counter = CounterMetricFamily(name, doc, labels=["bus"])
        counter.add_metric(b, float(c.get(key, 0)))
        families.append(counter)
    lost = CounterMetricFamily(
        "zmqsync_workers_lost",
        "workers dropped: silent for ~6 heartbeats, or evicted by a publish's deadline",
        labels=["bus", "reason"],
    )
    lost.add_metric([bus, "silent"], float(c.get("lost", 0)))
    lost.add_metric([bus, "evicted"], float(c.get("evictions", 0)))
    refused = CounterMetricFamily(
        "zmqsync_refused", "requests, messages and connections refused", labels=["bus", "reason"]
    )
    for key, reason in _REFUSALS.items():
        refused.add_metric([bus, reason], float(c.get(key, 0)))
    blocked = CounterMetricFamily(
        "zmqsync_publish_blocked_seconds",
        "seconds the training thread waited for versions (Publish.blocked summed): inside "
        "publish() (at=publish), and with Overlapped writes in optimizer steps waiting for "
        "a version's background copy (at=step)",
        labels=["bus", "at"],
    )
    blocked.add_metric([bus, "publish"], c.get(BLOCKED_IN_PUBLISH, 0) / 1e6)
    blocked.add_metric([bus, "step"], c.get(BLOCKED_IN_STEP, 0) / 1e6)
    written = CounterMetricFamily(
        "zmqsync_written_bytes",
        "bytes the publisher copied into slots: a full publish the whole version, a "
        "partial one (keys=, skip_unchanged) only the tensors it changed",
        labels=["bus"],
    )
    written.add_metric(b, float(c.get("written_bytes", 0)))
    families += [lost, refused, blocked, written]
    if "connections" in c:  # STATE only
        conns = GaugeMetricFamily(
            "zmqsync_connections", "connections open to the bus's sockets", labels=["bus"]
        )
        conns.add_metric(b, float(c["connections"]))
        families.append(conns)
    if sample.version_bytes is not None:
        size = GaugeMetricFamily(
            "zmqsync_version_bytes",
            "bytes of one version: what a full publish writes (rate(zmqsync_publishes_total) "
            "times this bounds the bytes written per second)",
            labels=["bus"],
        )
        size.add_metric(b, float(sample.version_bytes))
        families.append(size)
    if sample.slot_versions:
        slots = GaugeMetricFamily(
            "zmqsync_slot_version",
            "the version each slot holds (-1: empty)",
            labels=["bus", "slot"],
        )
        for i, v in enumerate(sample.slot_versions):
            slots.add_metric([bus, str(i)], float(v))
        families.append(slots)
    return families


class PublisherCollector(Collector):
    """The metrics of publishers of this process, read at each scrape.

    Args:
        publishers: one or more `zmqsync.Publisher`; one collector for all of them (two
            collectors of the same names cannot share a registry).
    """

    def __init__(self, *publishers: Any) -> None:
        if not publishers:
            raise ValueError("PublisherCollector needs at least one Publisher")
        self._publishers = publishers

    def collect(self) -> Iterator[Metric]:
        merged: dict[str, Metric] = {}
        for pub in self._publishers:
            for family in _bus_families(pub.name, from_publisher(pub, os.getpid())):
                _merge(merged, family)
        yield from merged.values()

    def describe(self) -> Iterator[Metric]:
        """The names this collector exports (the registry checks them for clashes)."""
        yield from _bus_families("", _EMPTY)


class SubscriberCollector(Collector):
    """The metrics of workers (`zmqsync.Subscriber`) of this process, read at each scrape."""

    def __init__(self, *subscribers: Any) -> None:
        if not subscribers:
            raise ValueError("SubscriberCollector needs at least one Subscriber")
        self._subscribers = subscribers

    def collect(self) -> Iterator[Metric]:
        yield from _worker_families(self._subscribers)

    def describe(self) -> Iterator[Metric]:
        """The names this collector exports (the registry checks them for clashes)."""
        yield from _worker_families(())


def _worker_families(subscribers: Iterable[Any]) -> list[Metric]:
    labels = ["bus", "worker"]
    version = GaugeMetricFamily(
        "zmqsync_applied_version", "the version the worker's model computes with", labels=labels
    )
    connected = GaugeMetricFamily(
        "zmqsync_connected", "1 while the worker hears its publisher, else 0", labels=labels
    )
    seconds = _histogram_family(
        "zmqsync_apply_seconds",
        "from taking a version to its being applied, before its ack (versions the native "
        "follower takes are counted in zmqsync_applied_versions_total, not timed)",
        labels,
    )
    applied = CounterMetricFamily(
        "zmqsync_applied_versions", "versions applied", labels=[*labels, "path"]
    )
    events = CounterMetricFamily(
        "zmqsync_dropped_events",
        "events dropped: invalid, from a foreign bus, or a gap in the sequence",
        labels=[*labels, "reason"],
    )
    for sub in subscribers:
        key, c = [printable(sub.name), printable(sub.worker_id)], sub.counters
        version.add_metric(key, float(sub.version))
        connected.add_metric(key, 1.0 if sub.connected else 0.0)
        _add_histogram(seconds, key, c, APPLY)
        native = c.get("native", 0)
        applied.add_metric([*key, "python"], float(c.get("applied", 0) - native))
        applied.add_metric([*key, "native"], float(native))
        for reason in ("rejected", "foreign", "gaps"):
            events.add_metric([*key, reason], float(c.get(reason, 0)))
    return [version, connected, seconds, applied, events]


class StateCollector(Collector):
    """The metrics of a bus in another process, from one INSPECT per scrape.

    What ``zmqsync metrics`` serves: it runs beside an unmodified trainer (in another
    container too), asks the control socket as ``zmqsync inspect`` does, and reports
    ``zmqsync_up 0`` while nobody answers there.

    Whoever reaches the exporter decides how often it scrapes, and every INSPECT is work
    for the publisher's agent thread (the one that also welcomes workers). So the
    publisher is asked at most once per `min_interval`: a scrape sooner than that after
    the last answer (or the last silence) is served that answer, its workers' last-seen
    times aged by the time since. Scrapes are also taken one at a time, so a burst of
    them never puts more than one INSPECT in flight.

    Args:
        address: the bus's control address.
        bus: the label to use (the bus's name).
        timeout: seconds one scrape waits for the publisher's answer.
        name: the bus name, to find CURVE keys a ``curve=True`` publisher wrote.
        min_interval: seconds an answer (or a silence) is reused for; 0 asks at every
            scrape.
    """

    def __init__(
        self,
        address: str,
        bus: str,
        *,
        timeout: float = 1.0,
        name: str | None = None,
        min_interval: float = 1.0,
    ) -> None:
        import zmq

        from ._security import client_from_env

        if min_interval < 0:
            raise ValueError(f"min_interval must be 0 or more seconds, not {min_interval}")
        self.address, self.bus, self.timeout = address, bus, timeout
        self.min_interval = min_interval
        curve = client_from_env(name)
        self._secure = curve.apply if curve is not None else None
        self._ctx: Any = zmq.Context()
        self._closed = threading.Event()
        # one scrape at a time: close() waits for it before the context goes
        self._asking = threading.Lock()
        # (time.monotonic() of the last answer or silence, the sample or None)
        self._last: tuple[float, BusSample | None] | None = None
        self.scrapes = 0  # samples served
        self.inspects = 0  # INSPECTs sent to the publisher
        self.failures = 0  # INSPECTs without a STATE in answer

    def sample(self) -> BusSample | None:
        """The bus now (at most `min_interval` old), or None if its publisher did not
        answer within `timeout`."""
        if not self._asking.acquire(timeout=self.timeout):
            return None  # another scrape took the whole deadline: the bus did not answer
        try:
            if self._closed.is_set():
                return None
            self.scrapes += 1
            now = time.monotonic()
            if self._last is not None and now - self._last[0] < self.min_interval:
                return _aged(self._last[1], now - self._last[0])
            sample = self._ask()
            self._last = (time.monotonic(), sample)
            return sample
        finally:
            self._asking.release()

    def _ask(self) -> BusSample | None:
        """One INSPECT, under `_asking`."""
        from ._deadline import Deadline
        from ._errors import ZmqSyncError
        from ._protocol import Inspect, State
        from ._sockets import request

        self.inspects += 1
        try:
            reply = request(
                self._ctx,
                self.address,
                Inspect(""),
                deadline=Deadline(self.timeout),
                secure=self._secure,
                cancelled=self._closed.is_set,
            )
        except ZmqSyncError as exc:
            self.failures += 1
            log.info("no state from %s: %s", self.address, exc)
            return None
        if not isinstance(reply, State):
            self.failures += 1
            log.info("%s answered %s, not STATE", self.address, reply.TYPE)
            return None
        return from_state(reply)

    def collect(self) -> Iterator[Metric]:
        yield from _bus_families(self.bus, self.sample())

    def describe(self) -> Iterator[Metric]:
        """The names this collector exports (the registry checks them for clashes)."""
        yield from _bus_families("", _EMPTY)

    def close(self) -> None:
        """Cut a scrape in progress short, then release the ZeroMQ context. Idempotent."""
        self._closed.set()
        if self._asking.acquire(timeout=self.timeout + 1.0):  # the scrape saw `_closed`
            self._asking.release()
        self._ctx.destroy(linger=0)


def _aged(sample: BusSample | None, seconds: float) -> BusSample | None:
    """`sample` as it would read `seconds` later: its workers heard that much longer ago."""
    if sample is None or seconds <= 0:
        return sample
    workers = tuple(dataclasses.replace(w, silent_s=w.silent_s + seconds) for w in sample.workers)
    return dataclasses.replace(sample, workers=workers)


@dataclasses.dataclass(frozen=True)
class ServerTLS:
    """TLS for the metrics server: its certificate and key, and whom it lets scrape.

    The fields are those of a Prometheus exporter's web config (exporter-toolkit's
    ``tls_server_config``). With `client_ca_file`, the server is what that config calls
    ``client_auth_type: RequireAndVerifyClientCert``: a scraper without a certificate
    signed by that CA gets no answer at all, so a bus's worker ids, hosts and pids stay
    with whoever holds such a certificate. Without it, TLS only encrypts and proves the
    server (anyone who reaches the port may scrape).

    Args:
        cert_file: the server's certificate (PEM), with its chain if any.
        key_file: the certificate's private key (PEM, unencrypted).
        client_ca_file: the CA certificates (PEM) a scraper's certificate must chain to.
    """

    cert_file: str
    key_file: str
    client_ca_file: str | None = None

    def check(self) -> None:
        """Load every file once, so that a missing or bad one is a one-line error naming
        it before anything starts (prometheus-client's own error reads "PEM lib").

        Raises:
            ValueError: a file is missing or unreadable, is not PEM, or the key is not
                the certificate's.
        """
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        for role, path in self._files():
            if not os.path.isfile(path):
                raise ValueError(f"{role} {path!r}: no such file")
            if not os.access(path, os.R_OK):
                raise ValueError(f"{role} {path!r}: not readable by this user")
        try:
            ctx.load_cert_chain(self.cert_file, self.key_file)
        except (ssl.SSLError, OSError) as exc:
            raise ValueError(
                f"TLS certificate {self.cert_file!r} and key {self.key_file!r} do not load "
                f"({_reason(exc)}): both must be PEM, the key unencrypted and the "
                "certificate's own"
            ) from exc
        if self.client_ca_file is not None:
            try:
                ctx.load_verify_locations(cafile=self.client_ca_file)
            except (ssl.SSLError, OSError) as exc:
                raise ValueError(
                    f"client CA file {self.client_ca_file!r} does not load ({_reason(exc)}): "
                    "it must hold PEM CA certificates"
                ) from exc

    def _files(self) -> list[tuple[str, str]]:
        files = [("TLS certificate", self.cert_file), ("TLS key", self.key_file)]
        if self.client_ca_file is not None:
            files.append(("client CA file", self.client_ca_file))
        return files


def _reason(exc: BaseException) -> str:
    """What OpenSSL said, without its source line ("_ssl.c:3900")."""
    reason = getattr(exc, "reason", None)
    return str(reason) if reason else str(exc)


# How long a connection to the metrics server may take to say what it wants (TLS
# handshake and request line): past it, its thread gives up on it.
CONNECTION_TIMEOUT_S = 10.0


def serve(
    registry: Any, port: int, *, addr: str = "127.0.0.1", tls: ServerTLS | None = None
) -> tuple[Any, threading.Thread]:
    """Serve `registry` on ``/metrics``: prometheus-client's `start_http_server`, with TLS
    and client certificates from `tls`, and hardened against idle connections.

    prometheus-client's TLS server does the handshake of each connection in the thread
    that accepts them all, with no timeout: one connection that sends nothing would stall
    every scrape. Here the handshake is left to the connection's own thread, each
    connection gets `CONNECTION_TIMEOUT_S` to finish it and send its request, and a
    refused handshake (no client certificate, plain HTTP) is an INFO log line, not a
    traceback on stderr.

    Args:
        registry: what to serve (a `prometheus_client.CollectorRegistry`).
        port: TCP port; 0 picks a free one (``server.server_address[1]`` says which).
        addr: address to listen on.
        tls: certificate, key and client CA; None serves plain HTTP.

    Returns:
        The server and its thread, as `start_http_server` returns them: stop with
        ``server.shutdown(); server.server_close()``.

    Raises:
        ValueError: a TLS file is missing or bad (`ServerTLS.check`).
        OSError: the port cannot be bound.
    """
    from prometheus_client import start_http_server

    files: dict[str, Any] = {}
    if tls is not None:
        tls.check()
        files = {
            "certfile": tls.cert_file,
            "keyfile": tls.key_file,
            "client_cafile": tls.client_ca_file,
            "client_auth_required": tls.client_ca_file is not None,
        }
    server: Any = None
    server, thread = start_http_server(port, addr=addr, registry=registry, **files)
    if isinstance(server.socket, ssl.SSLSocket):
        # what SSLSocket.accept() passes on to each connection (typeshed omits it);
        # tests/test_metrics_tls.py checks that an idle connection stalls nothing
        server.socket.do_handshake_on_connect = False  # type: ignore[attr-defined]
    server.RequestHandlerClass = type(
        "TimedHandler", (server.RequestHandlerClass,), {"timeout": CONNECTION_TIMEOUT_S}
    )
    server.handle_error = _log_refused
    return server, thread


def _log_refused(request: Any, client_address: Any) -> None:
    """A connection that failed (handshake refused, timed out, closed): a log line."""
    exc = sys.exc_info()[1]
    log.info("metrics connection from %s failed: %s", client_address, exc)


class RelayCollector(Collector):
    """The metrics of relay trees (`zmqsync.RelayRoot`, `zmqsync.Relay`) of this process.

    A root reports the tree as it sees it (its version and generation, each relay's
    state, version and lag, and what went wrong: relays lost and evicted, deadlines
    missed, transfers failed, notices that fell back to the control channel); a relay
    reports its own side (connected, the version on its host's bus, its generation, its
    failures). Read at each scrape from their public snapshots, so relaying does no work
    for them. A relay's local bus is a `Publisher`: `PublisherCollector(relay.publisher)`
    once it exists (after the first version arrived) adds that bus's metrics.

    Args:
        relays: one or more `zmqsync.RelayRoot` or `zmqsync.Relay` (mixed as wanted).
    """

    def __init__(self, *relays: Any) -> None:
        from .relay import Relay, RelayRoot

        if not relays:
            raise ValueError("RelayCollector needs at least one Relay or RelayRoot")
        self._roots = [r for r in relays if isinstance(r, RelayRoot)]
        self._relays = [r for r in relays if isinstance(r, Relay)]
        others = [r for r in relays if not isinstance(r, Relay | RelayRoot)]
        if others:
            raise TypeError(f"RelayCollector takes Relay and RelayRoot objects, not {others[0]!r}")

    def collect(self) -> Iterator[Metric]:
        yield from _root_families(self._roots)
        yield from _relay_families(self._relays)

    def describe(self) -> Iterator[Metric]:
        """The names this collector exports (the registry checks them for clashes)."""
        yield from _root_families(())
        yield from _relay_families(())


# RelayRoot counters shown as counters of their own: name, counter key, meaning.
_ROOT_COUNTERS = (
    ("zmqsync_relay_root_relayed", "relayed", "versions every relay of the tree received"),
    ("zmqsync_relay_root_joins", "joins", "relays that joined (restarts and re-joins too)"),
    ("zmqsync_relay_root_generations", "generations", "generations formed (each change of "
     "the relays' member list is one)"),
    ("zmqsync_relay_root_lost", "lost", "relays dropped as silent for ~6 heartbeats"),
    ("zmqsync_relay_root_timeouts", "timeouts", "versions a relay did not have (or its "
     "workers did not ack, ack=tree) by the root's deadline"),
    ("zmqsync_relay_root_evictions", "evictions", "relays evicted by a deadline "
     "(on_timeout=evict): they re-join"),
    ("zmqsync_relay_root_transfer_failures", "transfer_failures", "versions whose transfer "
     "to the relays failed (the generation ends)"),
    ("zmqsync_relay_root_formation_failures", "formation_failures", "generations whose "
     "process group could not be formed"),
)  # fmt: skip


def _root_families(roots: Iterable[Any]) -> list[Metric]:
    bus, per = ["bus"], ["bus", "relay"]
    version = GaugeMetricFamily(
        "zmqsync_relay_root_version", "the root bus's version the root holds", labels=bus
    )
    generation = GaugeMetricFamily(
        "zmqsync_relay_root_generation", "the last generation formed (0 before any)", labels=bus
    )
    states = GaugeMetricFamily(
        "zmqsync_relay_root_relays",
        "relays the root knows, by state: pending (not in this generation), active, lost, evicted",
        labels=[*bus, "state"],
    )
    r_version = GaugeMetricFamily(
        "zmqsync_relay_root_relay_version",
        "the last root version on the relay's own bus (-1: none yet)",
        labels=per,
    )
    r_lag = GaugeMetricFamily(
        "zmqsync_relay_root_relay_lag",
        "versions the relay's bus is behind the root's (no sample before its first)",
        labels=per,
    )
    r_acked = GaugeMetricFamily(
        "zmqsync_relay_root_relay_acked",
        "the last version all the relay's local workers acked (-1: none yet)",
        labels=per,
    )
    r_seen = GaugeMetricFamily(
        "zmqsync_relay_root_relay_last_seen_seconds",
        "seconds since the relay's last message (lost after ~6 heartbeats)",
        labels=per,
    )
    r_workers = GaugeMetricFamily(
        "zmqsync_relay_root_relay_workers", "workers on the relay's bus", labels=per
    )
    r_info = GaugeMetricFamily(
        "zmqsync_relay_root_relay_info",
        "the relay's state, host and pid; always 1",
        labels=[*per, "state", "host", "pid"],
    )
    counters = {
        name: CounterMetricFamily(name, doc, labels=bus) for name, _key, doc in _ROOT_COUNTERS
    }
    notices = CounterMetricFamily(
        "zmqsync_relay_root_notices",
        "version notices sent to relays, by channel: data (straight to the relay's data "
        "thread), control (the fallback while a relay's data channel is not connected)",
        labels=[*bus, "channel"],
    )
    refused = CounterMetricFamily(
        "zmqsync_relay_root_refused",
        "relay messages dropped: invalid, or of a session or generation no longer current",
        labels=[*bus, "reason"],
    )
    for root in roots:
        b = [printable(root.name)]
        latest, c, infos = root.version, root.counters, root.relays.values()
        version.add_metric(b, float(latest))
        generation.add_metric(b, float(root.generation))
        for state in ("pending", "active", "lost", "evicted"):
            states.add_metric([*b, state], float(sum(i.state == state for i in infos)))
        for i in infos:
            who = [*b, printable(i.relay_id)]
            r_version.add_metric(who, float(i.version))
            behind = lag(latest, i.version)
            if behind is not None:
                r_lag.add_metric(who, float(behind))
            r_acked.add_metric(who, float(i.acked))
            r_seen.add_metric(who, float(i.last_seen))
            r_workers.add_metric(who, float(len(i.workers)))
            r_info.add_metric([*who, printable(i.state), printable(i.host), str(i.pid)], 1.0)
        for name, key, _doc in _ROOT_COUNTERS:
            counters[name].add_metric(b, float(c.get(key, 0)))
        notices.add_metric([*b, "data"], float(c.get("data_notices", 0)))
        notices.add_metric([*b, "control"], float(c.get("control_notices", 0)))
        refused.add_metric([*b, "invalid"], float(c.get("rejected", 0)))
        refused.add_metric([*b, "stale"], float(c.get("stale", 0)))
    families: list[Metric] = [version, generation, states, r_version, r_lag, r_acked, r_seen]
    return [*families, r_workers, r_info, *counters.values(), notices, refused]


def _relay_families(relays: Iterable[Any]) -> list[Metric]:
    per = ["bus", "relay"]
    up = GaugeMetricFamily(
        "zmqsync_relay_up", "1 while the root accepts the relay and is heard from", labels=per
    )
    version = GaugeMetricFamily(
        "zmqsync_relay_version",
        "the last root version on this host's bus (-1 before the first)",
        labels=per,
    )
    generation = GaugeMetricFamily(
        "zmqsync_relay_generation", "the generation the relay is in (-1: none)", labels=per
    )
    versions = CounterMetricFamily(
        "zmqsync_relay_versions", "versions received and published on this host", labels=per
    )
    generations = CounterMetricFamily(
        "zmqsync_relay_generations", "generations the relay joined", labels=per
    )
    preposted = CounterMetricFamily(
        "zmqsync_relay_preposted",
        "versions whose receives were posted into a free slot before their notice came",
        labels=per,
    )
    failures = CounterMetricFamily(
        "zmqsync_relay_failures",
        "what failed on the relay: receive (a transfer), local (its bus), formation (a "
        "process group)",
        labels=[*per, "reason"],
    )
    refused = CounterMetricFamily(
        "zmqsync_relay_refused",
        "root messages dropped: invalid, or of a generation no longer current",
        labels=[*per, "reason"],
    )
    for relay in relays:
        who, c = [printable(relay.name), printable(relay.relay_id)], dict(relay.counters)
        up.add_metric(who, 1.0 if relay.connected else 0.0)
        version.add_metric(who, float(relay.version))
        generation.add_metric(who, float(relay.generation))
        versions.add_metric(who, float(c.get("versions", 0)))
        generations.add_metric(who, float(c.get("generations", 0)))
        preposted.add_metric(who, float(c.get("preposted", 0)))
        for reason in ("receive", "local", "formation"):
            failures.add_metric([*who, reason], float(c.get(f"{reason}_failures", 0)))
        refused.add_metric([*who, "invalid"], float(c.get("rejected", 0)))
        refused.add_metric([*who, "stale"], float(c.get("stale", 0)))
    return [up, version, generation, versions, generations, preposted, failures, refused]


def _merge(merged: dict[str, Metric], family: Metric) -> None:
    """Add `family`'s samples to the family of the same name (several buses)."""
    if family.name in merged:
        merged[family.name].samples.extend(family.samples)
    else:
        merged[family.name] = family


# A bus with every optional metric, for `describe` (names only).
_EMPTY = BusSample(
    "", "", 0, 0, (), {"connections": 0}, slots=1, slot_versions=(0,), version_bytes=0
)
