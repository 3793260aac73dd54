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
# a re-join once the link is back: the relay's next connect attempt (every max(1 s, 2
# beats)), its JOIN, a new generation (PREPARE, READY, COMMIT, gloo's mesh), the current
# version (measured: 0.4 s after the link came back, 0.5-2 s after a restarted process
# announced itself); the rest is slack for a loaded machine
REJOIN_S = 5.0
# a test's own bound: seven processes to start (torch imports: 5-30 s each on two cores
# shared with other jobs), a fault, a restart, everything to stop
TEST_TIMEOUT_S = 420
PORT = 29500  # the rendezvous: in the root host's own network namespace, always free
START_S = 120.0  # a process's start, on a loaded 2-core machine


def python(*args: str) -> list[str]:
    return [sys.executable, *args]


def applied(proc: Proc) -> list[dict]:
    return [r for r in proc.records if r.get("event") == "applied"]


def last_applied(proc: Proc) -> int:
    records = applied(proc)
    return records[-1]["version"] if records else -1


def root_versions(proc: Proc) -> list[tuple[int, dict]]:
    """(the root version whose bytes it holds, the record) for each version `proc` applied.

    A relay that opens its bus again (after it was killed) opens it at version 0 holding
    the root's current version, then publishes those bytes at once under the root's
    number (docs/multi-host.md, Limitations): a worker that re-joins in that instant
    applies "0" of the new bus first. That record counts as the next one's version (the
    same bytes); the checksum check then proves it held them.
    """
    records = applied(proc)
    out = []
    for i, record in enumerate(records):
        version = record["version"]
        reopened = i > 0 and version == 0 and record["bus"] != records[i - 1]["bus"]
        if reopened and i + 1 < len(records) and records[i + 1]["bus"] == record["bus"]:
            version = records[i + 1]["version"]
        out.append((version, record))
    return out


def versions_of(proc: Proc) -> list[int]:
    """The root versions `proc` applied, in order (a re-opened bus's "0" merged)."""
    versions: list[int] = []
    for version, _ in root_versions(proc):
        if not versions or versions[-1] != version:
            versions.append(version)
    return versions


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
            *python("-m", "zmqsync", "--log-level", "INFO", "relay", "--root", "--name", BUS),
            *("--insecure", "--json"),
            *("--ack", "tree", "--timeout", str(ROOT_TIMEOUT), "--heartbeat", str(HB)),
        )
        return self.root

    def start_relay(self, hostname: str) -> Proc:
        self.relays[hostname] = self.run(
            hostname,
            *python("-m", "zmqsync", "--log-level", "INFO", "relay", "--name", BUS),
            *("--insecure", "--json"),
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

    def outcome(self, version: int, timeout: float = 45.0) -> dict:
        """The trainer's record of `version` (published or timeout); `timeout` is longer
        than the trainer's own deadline (30 s), so a late publish shows what it missed."""
        assert self.trainer is not None
        record = self.trainer.wait_for(lambda r: r.get("version") == version, timeout)
        self.expected[version] = record["checksum"]
        return record

    def publish(self) -> dict:
        """One version, published and acked (or not) by the tree; its record."""
        return self.outcome(self.ask())

    def stop_all(self) -> None:
        """SIGTERM everything, workers first; each must exit by itself: the trainer with
        status 0, the zmqsync commands with 143 (128 + SIGTERM)."""
        groups = [self.workers.values(), self.relays.values(), [self.root], [self.trainer]]
        for group in groups:
            procs = [p for p in group if p is not None and p.proc.poll() is None]
            for proc in procs:
                proc.proc.terminate()
            for proc in procs:
                status = 0 if proc is self.trainer else 143
                assert proc.finish(timeout=30) == status, (proc.cmd[-8:], proc.stderr[-3000:])

    def check_bit_exact(self) -> None:
        """Every version every worker applied has the trainer's bytes for that number,
        and every worker's summary lists no mismatch."""
        for worker_id, worker in self.workers.items():
            for version, record in root_versions(worker):
                assert record["ok"] and not record["torn_detected"], (worker_id, record)
                assert record["checksum"] == self.expected[version], (worker_id, record)
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
@pytest.mark.slow
@pytest.mark.timeout(TEST_TIMEOUT_S)
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
        assert versions_of(worker) == list(range(6))
    dep.check_nothing_left()


def root_record(dep: Deployment, version: int) -> dict:
    assert dep.root is not None
    return dep.root.wait_for(lambda r: r.get("event") == "relayed" and r["version"] == version, 10)


def recovered(dep: Deployment, hostname: str, version: int, since: float) -> dict[str, float]:
    """Seconds from `since` (wall clock) until each worker on `hostname` applied `version`
    or newer, waiting for it: a re-joined host gets the current version by itself."""
    workers = {w.cmd[w.cmd.index("--worker-id") + 1]: w for w in dep.workers_on(hostname)}
    for worker in workers.values():
        wait_until(
            f"{hostname} to catch up", lambda w=worker: last_applied(w) >= version, REJOIN_S * 3
        )
    return {
        worker_id: round(
            next(r for r in applied(w) if r["version"] >= version)["applied_ts"] - since, 3
        )
        for worker_id, w in workers.items()
    }


def publish_everywhere(dep: Deployment, count: int) -> list[dict]:
    """`count` versions, each acked by every worker on every host within the deadline."""
    records = []
    for _ in range(count):
        record = dep.publish()
        assert record["event"] == "published" and not record["missing"], record
        assert record["seconds"] < ROOT_TIMEOUT, record
        assert root_record(dep, record["version"])["missing"] == [], record
        records.append(record)
    return records


@needs_namespaces
@pytest.mark.slow
@pytest.mark.timeout(TEST_TIMEOUT_S)
def test_link_down_mid_transfer_longer_than_every_timeout_then_back(deployment, cluster):
    dep = deployment
    size_mb = 4.0
    dep.start_all(size_mb=size_mb)
    cluster.shape("hostb", 40)  # 5 MB/s: a version takes ~0.8 s to reach hostb
    publish_everywhere(dep, 2)
    whole = {w: last_applied(w) for w in dep.workers_on("hostb")}
    assert set(whole.values()) == {2}

    # cut hostb's link while a version is on its way there
    base = cluster.sent_to("hostb")
    cut = dep.ask()
    part = size_mb * 2**20 / 4
    wait_until(
        "a quarter of the version on the wire", lambda: cluster.sent_to("hostb") - base > part, 10
    )
    cluster.link("hostb", up=False)
    down = time.time()
    sent = cluster.sent_to("hostb") - base
    assert sent < size_mb * 2**20, "the version was through before the cut"
    cluster.shape("hostb", None)  # the re-join below is timed on a clear link
    # a worker that joins hostb's bus during the outage gets the last whole version there
    probe = dep.run(
        "hostb",
        *python("-m", "zmqsync", "worker", "--name", BUS, "--verify", "--json"),
        *("--until-version", "2", "--worker-id", "hostb-probe", "--timeout", str(START_S)),
    )
    # the root drops the cut relay within its deadline and acks; hostc has the version
    record = dep.outcome(cut)
    assert record["event"] == "published" and not record["missing"], record
    assert record["seconds"] < ROOT_TIMEOUT + 1.0, record
    assert "hostb" not in root_record(dep, cut)["relays"]
    cut_s = record["seconds"]
    # and publishing goes on at full speed on the root and hostc, without hostb
    during = []
    probe_by = down + START_S  # the probe's own bound
    while time.time() - down < OUTAGE_S or (probe.proc.poll() is None and time.time() < probe_by):
        record = dep.publish()
        assert record["event"] == "published" and not record["missing"], record
        assert record["seconds"] < ROOT_TIMEOUT, record
        assert root_record(dep, record["version"])["relays"] == ["hostc"]
        during.append(record["seconds"])
        time.sleep(0.2)
    assert probe.finish(START_S) == 0, probe.stderr[-2000:]
    (seen,) = applied(probe)
    assert seen["version"] == 2 and seen["ok"] and seen["checksum"] == dep.expected[2], seen

    cluster.link("hostb", up=True)
    up = time.time()
    latest = max(dep.expected)
    rejoin = recovered(dep, "hostb", latest, since=up)
    assert max(rejoin.values()) < REJOIN_S, rejoin
    # hostb's workers kept version 2 through the outage: nothing torn, nothing partial
    for worker in dep.workers_on("hostb"):
        versions = versions_of(worker)
        assert versions[:4] == [0, 1, 2, latest], versions
    publish_everywhere(dep, 2)
    for worker in dep.workers.values():
        wait_until(
            "the last version everywhere", lambda w=worker: last_applied(w) == latest + 2, 10
        )

    dep.stop_all()
    dep.check_bit_exact()
    dep.check_nothing_left()
    report(
        fault="link down mid-transfer",
        sent_before_cut=sent,
        outage_s=round(up - down, 2),
        cut_version_publish_s=round(cut_s, 3),
        publish_during_outage_max_s=round(max(during), 3),
        rejoin_s=rejoin,
    )


@needs_namespaces
@pytest.mark.slow
@pytest.mark.timeout(TEST_TIMEOUT_S)
def test_relay_process_killed_and_restarted(deployment, cluster):
    dep = deployment
    dep.start_all()
    publish_everywhere(dep, 2)
    dep.relays["hostc"].kill()  # SIGKILL: no BYE, its bus's segment stays locked by nobody
    killed = time.time()
    # the root drops it within its deadline; hostb gets every version meanwhile
    first = dep.publish()
    assert first["event"] == "published" and not first["missing"], first
    assert first["seconds"] < ROOT_TIMEOUT + 1.0, first
    for _ in range(2):
        record = dep.publish()
        assert not record["missing"] and record["seconds"] < ROOT_TIMEOUT, record
        assert root_record(dep, record["version"])["relays"] == ["hostb"]
    for worker in dep.workers_on("hostb"):
        wait_until("hostb to have every version", lambda w=worker: last_applied(w) == 5, 10)
    # hostc's workers keep computing with their last version
    for worker in dep.workers_on("hostc"):
        assert worker.proc.poll() is None and last_applied(worker) == 2

    restarted = time.time()
    relay = dep.start_relay("hostc")
    relay.wait_for(lambda r: r.get("event") == "started", START_S)  # it joined the root
    joined, joined_at = time.time(), time.monotonic()
    # its bus is a new one: the workers re-join it by themselves, at the current version
    rejoin = recovered(dep, "hostc", 5, since=joined)
    assert max(rejoin.values()) < REJOIN_S, rejoin
    # the killed relay's bus was still mapped by its workers when the new one opened;
    # once they moved, the new relay's sweep removes it (every 5 s): one bus per host
    shm = cluster.hosts["hostc"].shm
    swept = wait_until("the killed relay's bus removed", lambda: len(os.listdir(shm)) == 1, 15)
    publish_everywhere(dep, 2)
    for worker in dep.workers.values():
        wait_until("the last version everywhere", lambda w=worker: last_applied(w) == 7, 10)

    dep.stop_all()
    dep.check_bit_exact()
    for worker in dep.workers_on("hostc"):
        versions = versions_of(worker)
        assert versions == [0, 1, 2, 5, 6, 7], versions
    dep.check_nothing_left()
    report(
        fault="relay process SIGKILLed, restarted",
        dropped_in_publish_s=round(first["seconds"], 3),
        down_s=round(restarted - killed, 2),
        process_start_s=round(joined - restarted, 2),
        joined_to_workers_s=rejoin,
        joined_to_old_bus_removed_s=round(swept - joined_at, 2),
    )


@needs_namespaces
@pytest.mark.slow
@pytest.mark.timeout(TEST_TIMEOUT_S)
def test_relay_root_killed_and_restarted(deployment, cluster):
    dep = deployment
    dep.start_all()
    publish_everywhere(dep, 2)
    assert dep.root is not None
    dep.root.kill()
    killed = time.time()
    # the trainer's bus drops the silent relay-root worker and goes on
    record = dep.publish()
    assert record["seconds"] < LOST_S + ROOT_TIMEOUT, record
    gone = dep.publish()
    assert gone["event"] == "published" and gone["seconds"] < 1.0, gone
    # relays keep their buses and their workers their last version
    for worker in dep.workers.values():
        assert worker.proc.poll() is None and last_applied(worker) == 2
    for relay in dep.relays.values():
        assert relay.proc.poll() is None

    restarted = time.time()
    dep.start_root().wait_for(lambda r: r.get("event") == "started", START_S)
    started = time.time()
    # both relays re-join the new root by themselves and get the current version
    rejoin = {h: recovered(dep, h, 4, since=started) for h in ("hostb", "hostc")}
    assert max(max(r.values()) for r in rejoin.values()) < REJOIN_S, rejoin
    publish_everywhere(dep, 2)
    for worker in dep.workers.values():
        wait_until("the last version everywhere", lambda w=worker: last_applied(w) == 6, 10)

    dep.stop_all()
    dep.check_bit_exact()
    for worker in dep.workers.values():  # same root bus: the relays kept their buses
        versions = versions_of(worker)
        assert versions == [0, 1, 2, 4, 5, 6], versions
    dep.check_nothing_left()
    report(
        fault="relay root SIGKILLed, restarted",
        publish_while_root_dead_s=[round(record["seconds"], 3), round(gone["seconds"], 3)],
        down_s=round(restarted - killed, 2),
        process_start_s=round(started - restarted, 2),
        started_to_workers_s=rejoin,
    )
