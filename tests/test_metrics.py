"""Prometheus metrics and `zmqsync top`, against real buses.

The exporter runs as its own process (``zmqsync metrics``) beside a trainer and workers
that are processes too; its ``/metrics`` is scraped over HTTP and parsed with
prometheus-client's own text parser, and the values are checked against publishes the
test made: versions, workers, a paused worker's lag, a timeout, ``zmqsync_up`` after the
publisher dies and after it restarts. The collectors of a Publisher and a Subscriber in
this process are scraped through the client's own HTTP server.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import msgpack
import pytest
import torch
from prometheus_client import CollectorRegistry, generate_latest, start_http_server
from prometheus_client.parser import text_string_to_metric_families
from rich.console import Console

import zmqsync
from tests.conftest import ROOT
from tests.test_peer_text import (
    HOST_SHOWN,
    WORKER,
    _fake_publisher,
    _free_port,
    _hostile_bus,
    _hostile_state,
    assert_inert,
    plain_wide_terminal,  # noqa: F401 (an autouse fixture, used here too)
)
from zmqsync import _histogram
from zmqsync._buffers import collect_garbage
from zmqsync._bus_sample import from_publisher
from zmqsync._protocol import State, TensorSpec, decode, encode, to_plain
from zmqsync._top_view import Top
from zmqsync.cli import main
from zmqsync.metrics import (
    PublisherCollector,
    RelayCollector,
    StateCollector,
    SubscriberCollector,
)

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def parse(text: str) -> Samples:
    """Every sample of an exposition, by (name, sorted labels), through the client's parser."""
    out: Samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def scrape(port: int) -> Samples:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as reply:
        assert reply.status == 200
        return parse(reply.read().decode())


def value(samples: Samples, name: str, **labels: str) -> float | None:
    return samples.get((name, tuple(sorted(labels.items()))))


def scrape_until(port: int, ready, timeout: float = 20.0, what: str = "") -> Samples:
    """Scrape until `ready(samples)`; the exporter may not listen yet at first."""
    end, samples = time.monotonic() + timeout, {}
    while time.monotonic() < end:
        try:
            samples = scrape(port)
        except (urllib.error.URLError, ConnectionError):
            samples = {}
        if samples and ready(samples):
            return samples
        time.sleep(0.05)
    raise AssertionError(f"not {what or 'ready'} within {timeout} s: {sorted(samples.items())}")


def _trainer(spawn, name: str):
    proc = spawn("tests/helpers/metrics_trainer.py", name, "--heartbeat", "2", module="")
    return proc, proc.wait_for(lambda r: r.get("event") == "started")


def _publish(trainer, version: int) -> dict:
    trainer.proc.send_signal(signal.SIGUSR1)
    return trainer.wait_for(lambda r: r.get("version") == version and r["event"] != "started")


@pytest.mark.timeout(150)
def test_exporter_process_reports_versions_lag_timeouts_and_up(spawn, name, bus_dirs):
    procs = []
    try:
        trainer, started = _trainer(spawn, name)
        procs.append(trainer)
        workers = {}
        for wid in ("wa", "wb"):
            worker = spawn("worker", "--name", name, "--json", "--forever", "--worker-id", wid)
            worker.wait_for(lambda r: r.get("event") == "joined")
            workers[wid] = worker
            procs.append(worker)
        port = _free_port()
        exporter = spawn("metrics", "--name", name, "--port", str(port), "--timeout", "0.5")
        procs.append(exporter)
        for version in (1, 2, 3):
            assert _publish(trainer, version)["event"] == "published"

        s = scrape_until(port, lambda s: value(s, "zmqsync_version", bus=name) == 3)
        assert value(s, "zmqsync_up", bus=name) == 1
        assert value(s, "zmqsync_workers", bus=name) == 2
        for wid in workers:
            assert value(s, "zmqsync_worker_version", bus=name, worker=wid) == 3
            assert value(s, "zmqsync_worker_lag", bus=name, worker=wid) == 0
        assert value(s, "zmqsync_publishes_total", bus=name) == 3
        assert value(s, "zmqsync_publish_seconds_count", bus=name) == 3
        assert value(s, "zmqsync_publish_seconds_bucket", bus=name, le="+Inf") == 3
        assert value(s, "zmqsync_publish_timeouts_total", bus=name) == 0
        assert value(s, "zmqsync_publisher_info", bus=name, bus_id=started["bus"],
                     pid=str(started["pid"])) == 1  # fmt: skip

        # a paused worker: the next publish times out on it, and it lags by one
        workers["wb"].stop()
        missed = _publish(trainer, 4)
        assert missed["event"] == "timeout" and missed["missing"] == ["wb"]
        # the exporter asks the bus at most once a second (--min-interval)
        s = scrape_until(port, lambda s: value(s, "zmqsync_version", bus=name) == 4)
        assert value(s, "zmqsync_worker_version", bus=name, worker="wb") == 3
        assert value(s, "zmqsync_worker_lag", bus=name, worker="wb") == 1
        assert value(s, "zmqsync_worker_lag", bus=name, worker="wa") == 0
        assert value(s, "zmqsync_publish_timeouts_total", bus=name) == 1
        assert value(s, "zmqsync_publishes_total", bus=name) == 4
        assert value(s, "zmqsync_publish_seconds_count", bus=name) == 3  # it never ended
        workers["wb"].proc.send_signal(signal.SIGCONT)

        # the publisher dies: up 0 and nothing else; a new one at the address: up 1
        trainer.proc.kill()
        trainer.proc.wait(10)
        s = scrape_until(port, lambda s: value(s, "zmqsync_up", bus=name) == 0, what="up 0")
        assert [key for key in s if key[0].startswith("zmqsync_")] == [
            ("zmqsync_up", (("bus", name),))
        ]
        again, restarted = _trainer(spawn, name)
        procs.append(again)
        assert restarted["bus"] != started["bus"]
        s = scrape_until(
            port,
            lambda s: (
                value(
                    s,
                    "zmqsync_publisher_info",
                    bus=name,
                    bus_id=restarted["bus"],
                    pid=str(restarted["pid"]),
                )
                == 1
            ),  # fmt: skip
            what="the restarted publisher",
        )
        assert value(s, "zmqsync_up", bus=name) == 1
        assert value(s, "zmqsync_version", bus=name) == 0
        assert value(s, "zmqsync_publishes_total", bus=name) == 0
        exporter.proc.send_signal(signal.SIGTERM)
        assert exporter.finish() == 143  # ended by SIGTERM (128 + 15), as every command
    finally:
        for proc in procs:  # the killed trainer's segment is free once its workers are gone
            proc.kill()
        collect_garbage(str(bus_dirs[1]))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("command", ["metrics", "top"])
def test_a_bus_that_is_not_there_at_start_is_one_line_and_exit_1(command, name):
    args = ["--port", "0"] if command == "metrics" else []
    done = subprocess.run(
        [sys.executable, "-m", "zmqsync", command, "--name", name, *args],
        capture_output=True,
        text=True,
        timeout=30,
        cwd=ROOT,
    )
    assert done.returncode == 1
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"zmqsync {command}: NoSuchBus: no bus at")
    assert done.stdout == ""


@pytest.mark.timeout(60)
def test_collectors_of_a_publisher_and_a_subscriber_in_this_process(name):
    weights = {"w": torch.zeros(64)}
    with (
        zmqsync.Publisher(weights, name=name, heartbeat=0.5) as pub,
        zmqsync.Subscriber(name=name, model=None, worker_id="me") as sub,
    ):
        for _ in range(2):
            pub.publish()
        assert sub.wait_for_version(2, timeout=10)
        registry = CollectorRegistry()
        registry.register(PublisherCollector(pub))
        registry.register(SubscriberCollector(sub))
        with pytest.raises(ValueError, match="Duplicated"):  # one collector per kind
            registry.register(PublisherCollector(pub))
        for collector in (PublisherCollector(pub), SubscriberCollector(sub)):
            declared = {f.name for f in collector.describe()}  # what the registry checks
            assert {f.name for f in collector.collect()} <= declared
        server, thread = start_http_server(0, addr="127.0.0.1", registry=registry)
        try:
            s = scrape(server.server_port)
        finally:
            server.shutdown()
            server.server_close()
            thread.join(5)
    assert value(s, "zmqsync_up", bus=name) == 1
    assert value(s, "zmqsync_version", bus=name) == 2
    assert value(s, "zmqsync_workers", bus=name) == 1
    assert value(s, "zmqsync_worker_version", bus=name, worker="me") == 2
    assert value(s, "zmqsync_worker_lag", bus=name, worker="me") == 0
    assert value(s, "zmqsync_publishes_total", bus=name) == 2
    assert value(s, "zmqsync_publish_seconds_count", bus=name) == 2
    assert value(s, "zmqsync_applied_version", bus=name, worker="me") == 2
    assert value(s, "zmqsync_connected", bus=name, worker="me") == 1
    applied = sum(
        value(s, "zmqsync_applied_versions_total", bus=name, worker="me", path=path) or 0
        for path in ("python", "native")
    )
    assert applied == 3  # v0 at start, then 1 and 2
    timed = value(s, "zmqsync_apply_seconds_count", bus=name, worker="me")
    assert timed == value(s, "zmqsync_applied_versions_total", bus=name, worker="me", path="python")


def test_one_publisher_collector_serves_several_buses(name):
    with (
        zmqsync.Publisher({"w": torch.zeros(4)}, name=name) as one,
        zmqsync.Publisher({"w": torch.zeros(4)}, name=name + "b") as two,
    ):
        two.publish()
        registry = CollectorRegistry()
        registry.register(PublisherCollector(one, two))
        s = parse(generate_latest(registry).decode())
    assert value(s, "zmqsync_version", bus=name) == 0
    assert value(s, "zmqsync_version", bus=name + "b") == 1


def test_metrics_escape_what_a_hostile_peer_sent(name):
    """Label values a peer chose are printable: curl on a terminal runs nothing."""
    with _fake_publisher(_hostile_state()) as address:
        collector = StateCollector(address, "hostile", timeout=2.0)
        try:
            registry = CollectorRegistry()
            registry.register(collector)
            text = generate_latest(registry).decode()
        finally:
            collector.close()
    assert_inert(text.replace("\\n", ""))  # the format's own escape of a newline is inert
    s = parse(text)
    assert value(s, "zmqsync_up", bus="hostile") == 1
    assert value(s, "zmqsync_worker_lag", bus="hostile", worker=WORKER) == 0
    info = [labels for (n, labels) in s if n == "zmqsync_worker_info"]
    assert dict(info[0])["host"] == HOST_SHOWN


@pytest.mark.timeout(60)
def test_top_shows_a_hostile_worker_literally(name, capsys):
    with _hostile_bus(name) as pub:
        pub.publish(timeout=0.2, workers=[])
        assert main(["top", "--name", name, "--count", "2", "--interval", "0.1"]) == 0
    out, err = capsys.readouterr()
    assert err == ""
    assert_inert(out)
    assert HOST_SHOWN in out and f"│ {WORKER} " in out
    assert "version 1" in out and "lag" in out


@pytest.mark.timeout(60)
def test_top_escapes_every_field_of_a_hostile_state(capsys):
    with _fake_publisher(_hostile_state()) as address:
        assert main(["top", address, "--count", "1", "--interval", "0.1"]) == 0
    out, _ = capsys.readouterr()
    assert_inert(out)
    assert HOST_SHOWN in out
    assert r"bus\x1b]0;pwned\x07[/bold]" in out


@pytest.mark.timeout(60)
def test_top_says_when_the_publisher_is_gone(name, capsys):
    pub = zmqsync.Publisher({"w": torch.zeros(4)}, name=name).start()
    try:
        top = Top("here")
        top.update(from_publisher(pub, os.getpid()), 10.0)
        pub.publish()
        top.update(from_publisher(pub, os.getpid()), 11.0)
        top.update(None, 12.0)
    finally:
        pub.close()
    console = Console(width=200, highlight=False, force_terminal=False)
    with console.capture() as cap:
        console.print(top.render(now=15.0))
    shown = cap.get()
    assert "publisher unreachable for 3 s" in shown
    assert "publishes 1.0/s" in shown


def test_import_zmqsync_and_the_cli_do_not_load_prometheus_client():
    code = (
        "import sys, zmqsync, zmqsync.cli; zmqsync.cli._parser(); "
        "assert 'prometheus_client' not in sys.modules, 'loaded'"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr


# --- the histogram the publisher and workers keep as counters ---------------------------------


def test_histogram_records_reads_and_estimates_quantiles():
    counts: dict[str, int] = {}
    for seconds in (0.0003, 0.0004, 0.002, 20.0):
        _histogram.record(counts, _histogram.PUBLISH, seconds)
    assert counts["publish_us_upto_500"] == 2
    assert counts["publish_us_upto_2500"] == 1
    assert counts["publish_us_upto_inf"] == 1
    assert counts["publish_us_sum"] == 300 + 400 + 2000 + 20_000_000
    hist = _histogram.read(counts, _histogram.PUBLISH)
    assert hist.count == 4 and hist.buckets[-1] == (float("inf"), 4)
    assert dict(hist.buckets)[0.0005] == 2 and dict(hist.buckets)[0.0025] == 3
    assert hist.sum == pytest.approx(20.0027)
    assert _histogram.quantile(hist, 0.5) == pytest.approx(0.0005)
    assert _histogram.quantile(hist, 0.99) == 10.0  # above the last bound: the last bound
    assert _histogram.quantile(_histogram.read({}, _histogram.PUBLISH), 0.5) is None
    later = dict(counts)
    _histogram.record(later, _histogram.PUBLISH, 0.00001)
    delta = _histogram.since(_histogram.read(later, _histogram.PUBLISH), hist)
    assert delta.count == 1 and delta.buckets[0] == (0.000025, 1)
    # a restarted publisher counts from zero: the new counts, not a negative difference
    assert _histogram.since(_histogram.read({}, _histogram.PUBLISH), hist).count == 0


def test_histogram_reads_bounds_it_does_not_know_and_ignores_look_alikes():
    counts = {"apply_us_upto_7": 2, "apply_us_upto_x": 5, "apply_us_sum": 14}
    hist = _histogram.read(counts, _histogram.APPLY)
    assert hist.count == 2 and (7e-6, 2) in hist.buckets


def test_a_long_manifest_is_encoded_once_and_stays_exact():
    """`encode` keeps the plain form of a long manifest (every scrape and join sends it):
    the bytes are those of a fresh encoding, and another manifest is never served."""

    def state(n: int, dtype: str) -> State:
        specs = tuple(TensorSpec((f"t{i}",), dtype, (1,), (1,), 256 * i, 4) for i in range(n))
        return State("0123456789abcdef", "m", 1, 0, 0, 1, (0,), 0.5, "", "tcp://127.0.0.1:1",
                     (), specs, (), {})  # fmt: skip

    first = state(200, "float32")
    fresh = msgpack.packb({**to_plain(first), "proto": 1, "type": "state"}, use_bin_type=True)
    assert encode(first) == fresh and encode(first) == fresh  # built, then reused
    other = state(200, "int32")
    assert decode(encode(other)).manifest == other.manifest
    assert decode(encode(first)).manifest == first.manifest


@pytest.mark.parametrize("port", ["-1", "65536", "http"])
def test_a_bad_port_is_a_usage_error(port, name, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["metrics", "--name", name, "--port", port])
    assert exc.value.code == 2
    assert "--port" in capsys.readouterr().err


@pytest.mark.timeout(60)
def test_a_port_in_use_is_one_line_and_exit_1(name, capsys):
    with zmqsync.Publisher({"w": torch.zeros(4)}, name=name), socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        code = main(["metrics", "--name", name, "--port", str(taken.getsockname()[1])])
    assert code == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("zmqsync metrics: OSError:"), err


@pytest.mark.timeout(60)
def test_a_worker_that_never_acked_has_no_lag_series(name):
    """A worker between its join and its first ack (here: one that never acks) has no
    known lag: no zmqsync_worker_lag sample, and zmqsync_worker_version -1."""
    with _hostile_bus(name) as pub:
        pub.publish(workers=[])
        collector = StateCollector(pub.address, name, timeout=2.0)
        try:
            registry = CollectorRegistry()
            registry.register(collector)
            s = parse(generate_latest(registry).decode())
        finally:
            collector.close()
    assert value(s, "zmqsync_worker_version", bus=name, worker=WORKER) == -1
    assert not [key for key in s if key[0] == "zmqsync_worker_lag"]
    assert value(s, "zmqsync_version", bus=name) == 1


# --- lag, blocked time and bytes written, on every path ----------------------------------


def _in_process(*collectors) -> Samples:
    registry = CollectorRegistry()
    for collector in collectors:
        registry.register(collector)
    return parse(generate_latest(registry).decode())


def _over_inspect(pub: zmqsync.Publisher) -> Samples:
    """What the exporter serves: STATE over the control socket (`StateCollector`)."""
    collector = StateCollector(pub.address, pub.name, timeout=5.0)
    try:
        return _in_process(collector)
    finally:
        collector.close()


@pytest.mark.timeout(120)
def test_a_paused_workers_lag_is_the_same_everywhere(spawn, name, capsys):
    """pub.workers[id].lag, inspect's lag, and zmqsync_worker_lag from the collector in
    this process and from the exporter process are one number, for a paused worker."""
    import json

    with zmqsync.Publisher({"w": torch.zeros(64)}, name=name, slots=4, heartbeat=2.0) as pub:
        workers = {}
        for wid in ("wa", "wb"):
            worker = spawn("worker", "--name", name, "--json", "--forever", "--worker-id", wid)
            worker.wait_for(lambda r: r.get("event") == "joined")
            workers[wid] = worker
        assert pub.wait_for_workers(2, timeout=30)
        pub.publish(timeout=30)  # both acked v1
        workers["wb"].stop()
        for _ in range(2):
            pub.publish(workers=["wa"], timeout=30)
        assert {w: i.lag for w, i in pub.workers.items()} == {"wa": 0, "wb": 2}
        port = _free_port()
        spawn("metrics", "--name", name, "--port", str(port), "--timeout", "2")
        exported = scrape_until(port, lambda s: value(s, "zmqsync_version", bus=name) == 3)
        here = _in_process(PublisherCollector(pub))
        assert main(["inspect", "--name", name, "--json"]) == 0
        shown = json.loads(capsys.readouterr().out)["workers"]
        inspected = {w["worker_id"]: w["lag"] for w in shown}
        infos = {w: i.lag for w, i in pub.workers.items()}
        workers["wb"].proc.send_signal(signal.SIGCONT)
    for s in (exported, here):
        assert {w: value(s, "zmqsync_worker_lag", bus=name, worker=w) for w in infos} == infos
    assert inspected == infos == {"wa": 0, "wb": 2}


@pytest.mark.timeout(120)
def test_overlapped_blocked_time_is_counted_and_exported(name):
    """zmqsync_publish_blocked_seconds_total adds up Publish.blocked of every version of an
    Overlapped publisher (inside publish() and in the optimizer steps that waited for a
    background copy), in this process and over INSPECT."""
    model = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.Linear(512, 512))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    handles = []
    with (
        zmqsync.Publisher(model, name=name, writes=zmqsync.Overlapped(opt), timeout=30) as pub,
        zmqsync.Subscriber(name=name, timeout=30) as sub,
    ):
        for _ in range(5):
            model(torch.ones(4, 512)).sum().backward()
            opt.step()  # waits, if the version before is still being copied
            opt.zero_grad()
            handles.append(pub.publish(max_lag=None))
        for handle in handles:
            handle.wait(30)
        assert sub.wait_for_version(5, timeout=30)
        here, there = _in_process(PublisherCollector(pub)), _over_inspect(pub)
    total = sum(h.blocked for h in handles)
    assert total > 0
    for s in (here, there):
        in_publish = value(s, "zmqsync_publish_blocked_seconds_total", bus=name, at="publish")
        in_step = value(s, "zmqsync_publish_blocked_seconds_total", bus=name, at="step")
        assert in_publish is not None and in_publish > 0 and in_step is not None
        assert in_publish + in_step == pytest.approx(total, abs=2e-5 * len(handles))
    assert value(here, "zmqsync_publish_blocked_seconds_total", bus=name, at="step") == value(
        there, "zmqsync_publish_blocked_seconds_total", bus=name, at="step"
    )


@pytest.mark.timeout(60)
def test_written_bytes_count_what_full_and_partial_publishes_wrote(name):
    weights = {"w": torch.zeros(256), "b": torch.zeros(4)}  # 1024 + 16 bytes
    with (
        zmqsync.Publisher(weights, name=name, timeout=30) as pub,
        zmqsync.Subscriber(name=name, model=None, timeout=30),
    ):
        pub.publish()  # every tensor
        after_full = _in_process(PublisherCollector(pub))
        pub.publish({"b": torch.ones(4)}, keys=["b"])  # only "b"
        here, there = _in_process(PublisherCollector(pub)), _over_inspect(pub)
    assert value(after_full, "zmqsync_written_bytes_total", bus=name) == 1040
    for s in (here, there):
        assert value(s, "zmqsync_written_bytes_total", bus=name) == 1040 + 16
        assert value(s, "zmqsync_version_bytes", bus=name) in (None, 1040)  # STATE only


@pytest.mark.timeout(120)
def test_relay_collector_reports_a_root_and_its_relay(name, bus_dirs):
    """A tree in this process (trainer, RelayRoot, one Relay, a worker on the relay's
    bus): the root's view of the relay and the relay's own agree on version and
    generation, nothing failed, and every version's notice is counted on some channel."""
    from tests.test_relay import in_process_tree

    tree = in_process_tree(name, bus_dirs, "metrics.sock", ack="tree", relay_timeout=5.0)
    with tree as (pub, root, relay, local), zmqsync.Subscriber(local, name=name) as sub:
        for v in (1, 2):
            assert not pub.publish(weights={"w": torch.full((4096,), float(v))}).missing
        assert sub.wait_for_version(2, timeout=10)
        end = time.monotonic() + 10  # the relay reports its workers with its heartbeats
        while not root.relays[relay.relay_id].workers and time.monotonic() < end:
            time.sleep(0.05)
        collector = RelayCollector(root, relay)
        assert {f.name for f in collector.collect()} <= {f.name for f in collector.describe()}
        s = _in_process(collector)
        gen = root.generation
    me = {"bus": name, "relay": relay.relay_id}
    assert value(s, "zmqsync_relay_up", **me) == 1
    assert value(s, "zmqsync_relay_version", **me) == 2
    assert value(s, "zmqsync_relay_root_version", bus=name) == 2
    assert value(s, "zmqsync_relay_root_relay_version", **me) == 2
    assert value(s, "zmqsync_relay_root_relay_lag", **me) == 0
    assert value(s, "zmqsync_relay_root_relay_acked", **me) == 2
    assert value(s, "zmqsync_relay_root_relay_workers", **me) == 1
    assert value(s, "zmqsync_relay_root_relays", bus=name, state="active") == 1
    assert value(s, "zmqsync_relay_root_relays", bus=name, state="lost") == 0
    assert gen >= 1 and value(s, "zmqsync_relay_root_generation", bus=name) == gen
    assert value(s, "zmqsync_relay_generation", **me) == gen
    assert value(s, "zmqsync_relay_versions_total", **me) == 3  # 0, 1 and 2
    assert value(s, "zmqsync_relay_root_relayed_total", bus=name) >= 2
    notices = sum(
        value(s, "zmqsync_relay_root_notices_total", bus=name, channel=channel) or 0
        for channel in ("data", "control")
    )
    assert notices >= 2
    for failed in ("lost", "evictions", "timeouts", "transfer_failures"):
        assert value(s, f"zmqsync_relay_root_{failed}_total", bus=name) == 0
    for reason in ("receive", "local", "formation"):
        assert value(s, "zmqsync_relay_failures_total", **me, reason=reason) == 0


def test_relay_collector_takes_relays_only():
    with pytest.raises(ValueError, match="at least one"):
        RelayCollector()
    with pytest.raises(TypeError, match="Relay and RelayRoot"):
        RelayCollector(object())


def test_every_metric_is_documented():
    """docs/metrics.md has a row for every metric a collector can export."""
    doc = (ROOT / "docs" / "metrics.md").read_text()
    state = StateCollector("ipc:///nonexistent/zmqsync-doc-check.sock", "x")
    try:
        families = [*state.describe(), *SubscriberCollector(object()).describe()]
    finally:
        state.close()
    relays = RelayCollector(
        zmqsync.RelayRoot(name="x", tree=zmqsync.Tree("tcp://127.0.0.1:0")),
        zmqsync.Relay(name="x", tree=zmqsync.Branch("tcp://127.0.0.1:1")),
    )
    families += relays.describe()
    shown = {f.name + ("_total" if f.type == "counter" else "") for f in families}
    assert len(shown) > 40
    assert sorted(n for n in shown if f"| `{n}` |" not in doc) == []
