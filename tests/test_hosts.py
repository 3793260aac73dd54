"""Relays across real network stacks: every "host" its own namespaces, faults on the wire.

Each host is a holder process in its own network, mount and UTS namespace
(tests/helpers/netns.py): its own host name, its own tmpfs at /dev/shm, its own
loopback, and a veth link to the root host, addresses in 198.18.0.0/24 (nothing touches
the machine's own network). The root host runs the trainer
(tests/helpers/hosts_trainer.py) and ``zmqsync relay --root``; relay hosts hostb and
hostc each run ``zmqsync relay`` (relay id: its host name) and two ``zmqsync worker
--verify``, one alias and one copy. Every version every worker applies is checked
against the digest the trainer published for that number; at the end every process
exits by itself, no host's /dev/shm holds a segment and no process is left in any host.

The faults: a relay host's link taken down mid-transfer for longer than every relay
timeout and brought back; a relay process SIGKILLed and restarted; the relay root
SIGKILLed and restarted. Each test prints what it measured (``-s`` shows it); the
numbers in docs/multi-host.md come from these lines.

The namespace tests need root (CI runs the suite as root) and are skipped with the
reason otherwise; the unit tests of how gloo picks its address run everywhere.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch.distributed as dist

from tests.conftest import Proc
from tests.helpers.netns import RELAY_IFNAME, ROOT_ADDRESS, Cluster, unavailable
from zmqsync.relay import _wire
from zmqsync.relay._rendezvous import source_ip
from zmqsync.relay._wire import gloo_devices

_why = unavailable()
needs_namespaces = pytest.mark.skipif(_why is not None, reason=f"namespace hosts: {_why}")

BUS = "policy"
HB = 0.25  # heartbeat everywhere: a silent peer is lost after 6 beats (1.5 s)
LOST_S = 6 * HB
ROOT_TIMEOUT = 3.0  # the relay root's deadline per version (tree mode, evict)
RELAY_TIMEOUT = 2.0  # each relay host's own bus deadline (below the root's)
OUTAGE_S = 5.0  # longer than every relay timeout: root, relay, collectives, liveness
REJOIN_S = 6.0  # bound on a re-join once the cause is gone (24 beats; measured: 1-2 s)
PORT = 29500  # the rendezvous: in the root host's own network namespace, always free
START_S = 120.0  # a process's start, on a loaded 2-core machine


def python(*args: str) -> list[str]:
    return [sys.executable, *args]


def applied(proc: Proc) -> list[dict]:
    return [r for r in proc.records if r.get("event") == "applied"]


def last_applied(proc: Proc) -> int:
    records = applied(proc)
    return records[-1]["version"] if records else -1


def wait_until(what: str, predicate: Callable[[], object], timeout: float) -> float:
    """Poll `predicate` every 10 ms; the monotonic time it first held."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return time.monotonic()
        time.sleep(0.01)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def report(**measured: object) -> None:
    """One line of what a test measured (``pytest -s`` shows it)."""
    print("\nMEASURED " + json.dumps(measured), flush=True)


class Deployment:
    """The processes of one test on a `Cluster`, started and stopped by host."""

    def __init__(self, cluster: Cluster, tmp: Path) -> None:
        self.cluster = cluster
        self.procs: list[Proc] = []
        self.env: dict[str, dict[str, str]] = {}
        for hostname in cluster.hosts:
            runtime = tmp / hostname
            runtime.mkdir(mode=0o700)
            env = dict(
                os.environ,
                ZMQSYNC_RUNTIME_DIR=str(runtime),
                ZMQSYNC_SHM_DIR="/dev/shm",  # the host's own tmpfs
                MASTER_ADDR=ROOT_ADDRESS,
                MASTER_PORT=str(PORT),
            )
            env.pop("GLOO_SOCKET_IFNAME", None)
            if hostname == "hostb":  # the others: gloo binds the address that reaches the root
                env["GLOO_SOCKET_IFNAME"] = RELAY_IFNAME
            self.env[hostname] = env
        self.trainer: Proc | None = None
        self.root: Proc | None = None
        self.relays: dict[str, Proc] = {}
        self.workers: dict[str, Proc] = {}
        self.expected: dict[int, str] = {}  # version -> the trainer's digest

    def run(self, hostname: str, *argv: str) -> Proc:
        proc = Proc([*self.cluster.hosts[hostname].prefix(), *argv], self.env[hostname])
        self.procs.append(proc)
        return proc

    def start_trainer(self, size_mb: float) -> None:
        self.trainer = self.run(
            "hostr",
            *python("tests/helpers/hosts_trainer.py", BUS, "--size-mb", str(size_mb)),
            *("--timeout", "30", "--heartbeat", str(HB)),
        )
        started = self.trainer.wait_for(lambda r: r.get("event") == "started", START_S)
        self.expected[0] = started["checksum"]

    def start_root(self) -> Proc:
        self.root = self.run(
            "hostr",
            *python("-m", "zmqsync", "relay", "--root", "--name", BUS, "--insecure", "--json"),
            *("--ack", "tree", "--timeout", str(ROOT_TIMEOUT), "--heartbeat", str(HB)),
        )
        return self.root

    def start_relay(self, hostname: str) -> Proc:
        self.relays[hostname] = self.run(
            hostname,
            *python("-m", "zmqsync", "relay", "--name", BUS, "--insecure", "--json"),
            *("--timeout", str(RELAY_TIMEOUT), "--heartbeat", str(HB)),
            *("--connect-timeout", str(START_S)),
        )
        return self.relays[hostname]

    def start_worker(self, hostname: str, mode: str) -> Proc:
        worker_id = f"{hostname}-{mode}"
        self.workers[worker_id] = self.run(
            hostname,
            *python("-m", "zmqsync", "worker", "--name", BUS, "--mode", mode, "--verify"),
            *("--json", "--forever", "--worker-id", worker_id, "--timeout", str(START_S)),
        )
        return self.workers[worker_id]

    def start_all(self, size_mb: float = 0.25) -> None:
        """The trainer and the relay root on hostr; a relay and two workers (alias, copy)
        on every relay host; returns once every worker applied version 0."""
        self.start_trainer(size_mb)
        self.start_root()
        for host in self.cluster.relay_hosts:
            self.start_relay(host.hostname)
            for mode in ("alias", "copy"):
                self.start_worker(host.hostname, mode)
        for worker in self.workers.values():
            worker.wait_for(lambda r: r.get("event") == "applied", START_S)

    def workers_on(self, hostname: str) -> list[Proc]:
        return [w for worker_id, w in self.workers.items() if worker_id.startswith(hostname)]

    def ask(self) -> int:
        """Tell the trainer to publish the next version (it prints a record); its number."""
        assert self.trainer is not None
        version = max(self.expected) + 1
        self.expected[version] = ""  # the digest comes with the record
        self.trainer.proc.send_signal(signal.SIGUSR1)
        return version

    def outcome(self, version: int, timeout: float = 30.0) -> dict:
        """The trainer's record of `version` (published or timeout)."""
        assert self.trainer is not None
        record = self.trainer.wait_for(lambda r: r.get("version") == version, timeout)
        self.expected[version] = record["checksum"]
        return record

    def publish(self) -> dict:
        """One version, published and acked (or not) by the tree; its record."""
        return self.outcome(self.ask())

    def stop_all(self) -> None:
        """SIGTERM everything, workers first; each must exit by itself with status 0."""
        groups = [self.workers.values(), self.relays.values(), [self.root], [self.trainer]]
        for group in groups:
            procs = [p for p in group if p is not None and p.proc.poll() is None]
            for proc in procs:
                proc.proc.terminate()
            for proc in procs:
                assert proc.finish(timeout=30) == 0, (proc.cmd[-8:], proc.stderr[-3000:])

    def check_bit_exact(self) -> None:
        """Every version every worker applied has the trainer's bytes for that number,
        and every worker's summary lists no mismatch."""
        for worker_id, worker in self.workers.items():
            for record in applied(worker):
                assert record["ok"] and not record["torn_detected"], (worker_id, record)
                assert record["checksum"] == self.expected[record["version"]], (worker_id, record)
            summary = worker.summary()
            assert summary["mismatches"] == [], (worker_id, summary)

    def check_nothing_left(self) -> None:
        """No segment in any host's /dev/shm and no process in any host (once all exited)."""
        for host in self.cluster.hosts.values():
            shm, name = host.shm, host.hostname
            wait_until(f"{name}'s /dev/shm to be empty", lambda s=shm: not os.listdir(s), 5)
            wait_until(f"no process left on {name}", lambda h=host: not h.processes(), 5)


@pytest.fixture
def cluster() -> Iterator[Cluster]:
    made = Cluster(("hostb", "hostc"))
    try:
        yield made
    finally:
        leftovers = made.close()
    assert not any(leftovers.values()), f"processes left in the hosts: {leftovers}"


@pytest.fixture
def deployment(cluster, tmp_path) -> Iterator[Deployment]:
    dep = Deployment(cluster, tmp_path)
    try:
        yield dep
    finally:
        for proc in dep.procs:
            proc.kill()


def test_gloo_binds_gloo_socket_ifname_or_the_route_to_the_rendezvous(monkeypatch):
    made: list[dict] = []
    monkeypatch.setattr(
        dist.ProcessGroupGloo, "create_device", staticmethod(lambda **kw: made.append(kw) or kw)
    )
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    assert gloo_devices("127.0.0.1") == [{"hostname": "127.0.0.1"}]
    # not torch's default device (the address the host name resolves to), which is
    # 127.0.1.1 on Debian, or nothing (then loopback) in a network namespace
    monkeypatch.setattr(_wire, "source_ip", lambda host: {"hostr": "198.18.0.3"}[host])
    assert gloo_devices("hostr") == [{"hostname": "198.18.0.3"}]
    # torch's own variable, which a group made by hand would otherwise ignore
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "eth0,ib0")
    assert gloo_devices("hostr") == [{"interface": "eth0"}, {"interface": "ib0"}]
    assert gloo_devices("127.0.0.1") == [{"interface": "eth0"}, {"interface": "ib0"}]


def test_source_ip_is_the_address_of_the_route():
    assert source_ip("127.0.0.1") == "127.0.0.1"
    with pytest.raises(ValueError, match="no route from this host to the rendezvous host"):
        source_ip("no-such-host.invalid")


@needs_namespaces
def test_every_host_has_its_own_stack_and_every_worker_every_version(deployment, cluster):
    dep = deployment
    dep.start_all()
    # each host: its own name, its own /dev/shm with its own bus's segment, and gloo on
    # the address that reaches the root (hostc: no GLOO_SOCKET_IFNAME; hostb: eth0)
    segments = {}
    for hostname, host in cluster.hosts.items():
        assert host.sh("hostname").strip() == hostname
        segments[hostname] = set(os.listdir(host.shm))
        assert len(segments[hostname]) == 1, (hostname, segments[hostname])
    assert len(set.union(*segments.values())) == 3  # three buses, one per host
    assert not set.union(*segments.values()) & set(os.listdir("/dev/shm"))
    probe = "from zmqsync.relay._rendezvous import source_ip; print(source_ip('hostr'))"
    src = cluster.hosts["hostc"].sh(f'{sys.executable} -c "{probe}"', timeout=60)
    assert src.strip() == cluster.addresses["hostc"]

    for _ in range(5):
        record = dep.publish()
        assert record["event"] == "published" and not record["missing"], record
        assert record["seconds"] < ROOT_TIMEOUT, record
    # tree mode: the root acked each version once every worker on every host acked it
    for worker in dep.workers.values():
        wait_until("the last version everywhere", lambda w=worker: last_applied(w) == 5, 10)

    # the root host's `zmqsync inspect` sees both relays by host name, with their workers
    tree = json.loads(
        cluster.root.sh(
            f"{sys.executable} -m zmqsync inspect --name {BUS} --json",
            timeout=60,
            env=dep.env["hostr"],
        )
    )["relays"]
    relays = {r["relay_id"]: r for r in tree["relays"]}
    assert set(relays) == {"hostb", "hostc"}
    for relay_id, relay in relays.items():
        assert relay["host"] == relay_id and relay["state"] == "active"
        assert {w["worker_id"] for w in relay["workers"]} == {
            f"{relay_id}-alias",
            f"{relay_id}-copy",
        }
        assert {w["host"] for w in relay["workers"]} == {relay_id}

    dep.stop_all()
    dep.check_bit_exact()
    for worker in dep.workers.values():
        assert [r["version"] for r in applied(worker)] == list(range(6))
    dep.check_nothing_left()
