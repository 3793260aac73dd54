"""Relays: a root and relays over gloo on loopback, each "host" with its own dirs.

The trainer's Publisher and the RelayRoot run in the test process; relays and their
workers are real processes (``zmqsync relay``, ``zmqsync worker --verify``) whose
ZMQSYNC_RUNTIME_DIR and ZMQSYNC_SHM_DIR are their own, as on separate hosts. Every
version a worker applies is checked against the checksum the trainer published with it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import signal
import socket
import sys
import time

import msgpack
import pytest
import torch
import zmq

import zmqsync
from tests.conftest import Proc, deadline_listdir
from zmqsync._buffers import collect_garbage
from zmqsync._checksum import CHECKSUM_KEY, digest, digest_tensor
from zmqsync._layout import flatten
from zmqsync._protocol import TensorSpec, WorkerEntry
from zmqsync.cli import main
from zmqsync.relay import _messages as messages
from zmqsync.relay._messages import RELAY
from zmqsync.relay._rendezvous import rendezvous

HB = 0.25  # heartbeat everywhere: a peer is lost after ~1.5 s of silence
LOOPBACK = zmqsync.Tree("tcp://127.0.0.1:0")  # a root's rendezvous on any free local port


def weights(version: int) -> dict:
    """A small model state whose bytes depend on `version`, with its checksum."""
    g = torch.Generator().manual_seed(version)
    flat = {
        ("policy", "w"): torch.randn(256, 128, generator=g),
        ("policy", "b"): torch.randn(128, generator=g).to(torch.bfloat16),
        ("steps",): torch.tensor(version, dtype=torch.int64),
    }
    flat[CHECKSUM_KEY] = digest_tensor(digest(flat))
    return flat


class Host:
    """One simulated host: its own runtime dir and shm dir, its own processes."""

    def __init__(self, name: str, runtime, shm, env: dict[str, str]) -> None:
        self.name = name
        self.runtime = runtime / name
        self.shm = shm / name
        self.runtime.mkdir(mode=0o700)
        self.shm.mkdir(mode=0o700)
        self.env = dict(
            os.environ, ZMQSYNC_RUNTIME_DIR=str(self.runtime), ZMQSYNC_SHM_DIR=str(self.shm)
        )
        self.env.update(env)
        self.procs: list[Proc] = []

    def run(self, *args: str) -> Proc:
        proc = Proc([sys.executable, "-m", "zmqsync", *args], self.env)
        self.procs.append(proc)
        return proc

    def relay(self, bus: str, *extra: str) -> Proc:
        return self.run(
            "relay",
            "--name",
            bus,
            "--relay-id",
            self.name,
            "--heartbeat",
            str(HB),
            "--timeout",
            "3",
            "--json",
            *extra,
        )

    def worker(self, bus: str, mode: str = "copy", *extra: str, verify: bool = True) -> Proc:
        """`verify`: the bus publishes checksums (else each version's digest is reported)."""
        return self.run(
            "worker",
            "--name",
            bus,
            "--mode",
            mode,
            "--verify" if verify else "--digest",
            "--json",
            "--forever",
            "--worker-id",
            f"{self.name}-w",
            "--timeout",
            "120",
            *extra,
        )


@pytest.fixture
def hosts(bus_dirs):
    """hosts(name, **env) -> Host; at teardown every process is killed and no segment left."""
    runtime, shm = bus_dirs
    made: list[Host] = []

    def _make(name: str, **env: str) -> Host:
        host = Host(name, runtime, shm, env)
        made.append(host)
        return host

    yield _make
    leaked = []
    for host in made:
        for proc in host.procs:
            proc.kill()
        collect_garbage(str(host.shm))  # segments of SIGKILLed relays, now unlocked
        leaked += [f"{host.name}/{f}" for f in deadline_listdir(str(host.shm))]
        shutil.rmtree(host.shm, ignore_errors=True)
        shutil.rmtree(host.runtime, ignore_errors=True)
    assert not leaked, f"segments left on the relay hosts: {leaked}"


def applied(proc: Proc) -> dict[int, dict]:
    return {r["version"]: r for r in proc.records if r.get("event") == "applied"}


def applied_ok(proc: Proc, version: int) -> bool:
    record = proc.wait_for(lambda r: r.get("event") == "applied" and r["version"] == version, 30)
    return bool(record["ok"])


def stop(proc: Proc) -> dict:
    """SIGTERM, wait, and return the worker's summary line."""
    proc.proc.terminate()
    assert proc.finish(timeout=30) == 143, proc.stderr[-2000:]  # 128 + SIGTERM
    return proc.summary()


def inspect_json(name: str, capsys) -> dict:
    capsys.readouterr()
    assert main(["inspect", "--name", name, "--json", "--timeout", "5"]) == 0
    return json.loads(capsys.readouterr().out)


def _wait(predicate, timeout: float, what: str):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.mark.timeout(240)
def test_two_relays_every_version_verified_through_kill_and_restart(name, hosts, capsys):
    expected = {0: digest(flatten(weights(0)))}
    with (
        zmqsync.Publisher(weights(0), name=name, timeout=30, heartbeat=HB) as pub,
        zmqsync.RelayRoot(name=name, tree=LOOPBACK, ack="tree", timeout=8, heartbeat=HB) as root,
    ):
        env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(root.init_method_url.split(":")[-1])}
        a, b = hosts("hostA", **env), hosts("hostB", **env)
        relays = {"hostA": a.relay(name), "hostB": b.relay(name)}
        workers = {"hostA": a.worker(name, "copy"), "hostB": b.worker(name, "alias")}
        assert root.wait_for_relays(2, timeout=90), root.relays
        for w in workers.values():
            w.wait_for(lambda r: r.get("event") == "applied" and r["version"] == 0, timeout=90)
        _wait(lambda: all(len(r.workers) == 1 for r in root.relays.values()), 10, "worker reports")

        def publish(version: int) -> zmqsync.Publish:
            flat = weights(version)
            expected[version] = digest(flat)
            return pub.publish(weights=flat)

        for v in range(1, 5):
            p = publish(v)
            assert p.acked == ("relay-root",) and not p.missing
            # tree mode: the root acked only after both remote workers acked (their JSON
            # line is printed before the ack; our reader thread may not have read it yet)
            for w in workers.values():
                assert applied_ok(w, v)

        # zmqsync inspect on the root lists the relays and, per relay, its workers
        tree = _wait(
            lambda: (
                (t := inspect_json(name, capsys))
                and all(
                    r["acked"] == 4 and [w["version"] for w in r["workers"]] == [4]
                    for r in t["relays"]["relays"]
                )
                and t
            ),
            10,
            "inspect to show version 4 everywhere",
        )
        relays_seen = {r["relay_id"]: r for r in tree["relays"]["relays"]}
        assert set(relays_seen) == {"hostA", "hostB"}
        assert relays_seen["hostA"]["workers"][0]["worker_id"] == "hostA-w"
        assert all(r["state"] == "active" and r["version"] == 4 for r in relays_seen.values())
        assert tree["relays"]["version"] == 4 and tree["relays"]["ack"] == "tree"

        # kill relay B mid-run: the root drops it within its deadline and goes on
        relays["hostB"].kill()
        for v in range(5, 8):
            p = publish(v)
            assert p.acked == ("relay-root",) and p.seconds < 8 + 5, (v, p.seconds)
            assert applied_ok(workers["hostA"], v)
        _wait(lambda: root.relays["hostB"].state in ("lost", "evicted"), 10, "hostB dropped")
        assert root.relays["hostA"].state == "active"
        # B's worker keeps computing with its last version, as with a dead publisher
        assert max(applied(workers["hostB"])) == 4
        assert workers["hostB"].proc.poll() is None

        # restart relay B on its host: it re-joins, its worker re-joins its new bus
        relays["hostB"] = b.relay(name)
        assert root.wait_for_relays(2, timeout=90), root.relays
        workers["hostB"].wait_for(lambda r: r.get("event") == "applied" and r["version"] == 7, 60)
        for v in range(8, 10):
            p = publish(v)
            assert p.acked == ("relay-root",) and not p.missing
        for w in workers.values():
            w.wait_for(lambda r: r.get("event") == "applied" and r["version"] == 9, 30)
        assert root.counters["generations"] >= 3
    summaries = {h: stop(w) for h, w in workers.items()}
    for host, w in workers.items():
        records = [r for r in w.records if r.get("event") == "applied"]
        assert all(r["ok"] and not r["torn_detected"] for r in records), records
        assert summaries[host]["mismatches"] == []
        for r in records:  # the same bytes as the trainer's version of that number
            if r["version"] > 0:
                assert r["checksum"] == expected[r["version"]], r
    versions_a = [r["version"] for r in workers["hostA"].records if r.get("event") == "applied"]
    assert versions_a == list(range(10)), "a live relay's worker saw every version once"
    versions_b = [r["version"] for r in workers["hostB"].records if r.get("event") == "applied"]
    assert versions_b[:5] == [0, 1, 2, 3, 4] and versions_b[-3:] == [7, 8, 9], versions_b
    for proc in relays.values():
        proc.proc.terminate()
    assert relays["hostA"].finish(30) == 143


@pytest.mark.timeout(180)
def test_hung_relay_is_dropped_within_the_deadline_and_rejoins(name, hosts):
    with (
        zmqsync.Publisher({"w": torch.zeros(64 * 1024)}, name=name, timeout=30) as pub,
        zmqsync.RelayRoot(
            name=name,
            tree=zmqsync.Tree("tcp://127.0.0.1:0", chunk_mb=0.0625),  # 4 chunks per version
            ack="relays",
            timeout=6,  # collectives time out after 6 heartbeats (1.5 s), well within
            heartbeat=HB,
        ) as root,
    ):
        url = root.init_method_url
        a, b = hosts("hostA"), hosts("hostB")
        ra, rb = a.relay(name, "--init-method", url), b.relay(name, "--init-method", url)
        worker = a.worker(name, "copy", "--apply", "manual", verify=False)  # no checksums
        assert root.wait_for_relays(2, timeout=90), root.relays
        worker.wait_for(lambda r: r.get("event") == "applied", timeout=90)

        # relays mode: a stopped worker behind relay A does not hold the root's publish
        os.kill(worker.proc.pid, signal.SIGSTOP)
        try:
            p = pub.publish(weights={"w": torch.full((64 * 1024,), 1.0)})
            assert not p.missing
            assert root.relays["hostA"].acked == 0  # acked while A's worker could not
        finally:
            os.kill(worker.proc.pid, signal.SIGCONT)

        # a hung relay (SIGSTOP): the publish ends within the deadline, the other goes on
        os.kill(rb.proc.pid, signal.SIGSTOP)
        try:
            p = pub.publish(weights={"w": torch.full((64 * 1024,), 2.0)})
            assert p.seconds < 6 + 3, p.seconds
            assert root.last is not None and root.last.version == 2
            for v in (3, 4):
                p = pub.publish(weights={"w": torch.full((64 * 1024,), float(v))})
                assert p.seconds < 6 + 3, (v, p.seconds)
            ra.wait_for(lambda r: r.get("event") == "published" and r["version"] == 4, 30)
            _wait(lambda: root.relays["hostB"].state != "active", 10, "hostB dropped")
            # the culprit is dropped, never the relay it held up
            assert root.relays["hostA"].state == "active" and root.relays["hostA"].version == 4
            assert "hostA" not in root.last.missing
        finally:
            os.kill(rb.proc.pid, signal.SIGCONT)
        # woken up, B finds its session ended, joins again and catches up
        assert root.wait_for_relays(2, timeout=60), root.relays
        rb.wait_for(lambda r: r.get("event") == "published" and r["version"] == 4, 30)
        p = pub.publish(weights={"w": torch.full((64 * 1024,), 5.0)})
        assert not p.missing
        for proc in (ra, rb):
            proc.wait_for(lambda r: r.get("event") == "published" and r["version"] == 5, 30)
        # dropped by whichever fired first: the deadline, a failed collective, or silence
        detected = ("timeouts", "transfer_failures", "lost")
        assert sum(root.counters.get(what, 0) for what in detected) >= 1, root.counters


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.timeout(180)
def test_raise_mode_withholds_the_ack_from_a_late_relay(name, hosts):
    port = _free_port()
    a = hosts("hostA", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    # started before the root: it waits for the rendezvous to answer
    # heartbeat 1 s on host A: its bus drops a silent worker only after 6 s, after the
    # trainer's 4 s deadline, however loaded the machine
    relay = a.relay(name, "--timeout", "8", "--connect-timeout", "120", "--heartbeat", "1")
    with zmqsync.Publisher({"w": torch.zeros(1000)}, name=name, timeout=4, heartbeat=HB) as pub:
        with zmqsync.RelayRoot(
            name=name,
            tree=zmqsync.Tree(f"tcp://127.0.0.1:{port}"),
            ack="tree",
            timeout=2,
            on_timeout="raise",
            heartbeat=1.0,
        ) as root:
            assert root.wait_for_relays(1, timeout=90), root.relays
            # a worker on host A that is alive (heartbeats) but acks only when it polls
            with zmqsync.Subscriber(
                f"ipc://{a.runtime}/{name}.sock",
                name=name,
                reads=zmqsync.Copies(manual=True),
                worker_id="slow",
                shm_dir=str(a.shm),
                timeout=30,
            ) as slow:
                p = pub.publish(weights={"w": torch.ones(1000)}, max_lag=None)
                assert slow.poll(timeout=20) and not p.wait().missing
                # version 2: the relay is alive and heard from, but its worker does not ack
                # within the root's 2 s: the root withholds its ack, the trainer's
                # deadline (4 s) decides, and nobody is evicted
                with pytest.raises(zmqsync.PublishTimeout) as info:
                    pub.publish(weights={"w": torch.full((1000,), 2.0)})
                assert info.value.missing == ("relay-root",)
                _wait(lambda: isinstance(root.last_error, zmqsync.PublishTimeout), 10, "error")
                assert root.last_error.missing == ("hostA",) and root.last_error.version == 2
                assert root.relays["hostA"].state == "active"
                assert slow.poll(timeout=10) and slow.version == 2
                p = pub.publish(weights={"w": torch.full((1000,), 3.0)}, max_lag=None)
                assert slow.poll(timeout=20) and not p.wait().missing
                assert torch.equal(slow.weights["w"], torch.full((1000,), 3.0))
    relay.proc.terminate()
    assert relay.finish(30) == 143


@pytest.mark.timeout(150)
def test_cli_root_process_and_an_in_process_relay(name, spawn, bus_dirs):
    runtime, _ = bus_dirs
    local = f"ipc://{runtime}/relayed.sock"
    with zmqsync.Publisher({"w": torch.zeros(1000)}, name=name, timeout=30, heartbeat=HB) as pub:
        root = spawn(
            "relay",
            "--root",
            "--name",
            name,
            "--init-method",
            "tcp://127.0.0.1:0",
            "--ack",
            "relays",
            "--heartbeat",
            str(HB),
            "--json",
        )
        url = root.wait_for(lambda r: r.get("event") == "started", timeout=60)["init_method"]
        seen: list[int] = []
        with zmqsync.Relay(
            local,
            name=name,
            tree=zmqsync.Branch(url, relay_id="inproc"),
            heartbeat=HB,
            security=zmqsync.Security(tap=True),
            on_update=seen.append,
        ) as relay:
            assert relay.wait_for_version(0, timeout=30) and relay.publisher is not None
            sniffer = spawn("sniff", local, "--json", "--duration", "60")
            sniffer.wait_for(lambda r: r.get("type") == "heartbeat", timeout=60)
            with zmqsync.Subscriber(local, name=name, worker_id="local-w") as sub:
                assert pub.wait_for_workers(1, timeout=10)  # the relay root
                p = pub.publish(weights={"w": torch.ones(1000)})
                assert not p.missing and sub.wait_for_version(1, timeout=20)
                assert torch.equal(sub.weights["w"], torch.ones(1000))
                # on_update runs on the relay's data thread just after it told the root
                _wait(lambda: seen, 10, "on_update")
                assert relay.version == 1 and relay.connected and seen == [1]
                # the sniffer on the relay's bus sees the root's version number
                sniffer.wait_for(
                    lambda r: r["type"] == "ack" and r["peer"] == "local-w" and r["version"] == 1,
                    timeout=30,
                )
                assert any(r["type"] == "receive" and r["version"] == 1 for r in sniffer.records)
                # the root process goes away: the local bus stays, the worker keeps v1
                root.proc.send_signal(signal.SIGTERM)
                assert root.finish(30) == 143
                closed = [r for r in root.records if r.get("event") == "closed"]
                assert closed and closed[0]["version"] == 1
                _wait(lambda: not relay.connected, 10, "the relay to notice")
                assert sub.connected and sub.version == 1
                assert torch.equal(sub.weights["w"], torch.ones(1000))


@contextlib.contextmanager
def in_process_tree(name: str, bus_dirs, sock: str, *, ack: str, relay_timeout: float):
    """A trainer's Publisher (4096 floats), a RelayRoot and one Relay, in this process;
    yields them and the relay's local bus address once the relay holds version 0."""
    runtime, _ = bus_dirs
    local = f"ipc://{runtime}/{sock}"
    with (
        zmqsync.Publisher({"w": torch.zeros(4096)}, name=name, timeout=20, heartbeat=HB) as pub,
        zmqsync.RelayRoot(name=name, tree=LOOPBACK, ack=ack, timeout=8, heartbeat=HB) as root,
        zmqsync.Relay(
            local,
            name=name,
            tree=zmqsync.Branch(root.init_method_url),
            heartbeat=HB,
            timeout=relay_timeout,
        ) as relay,
    ):
        assert relay.wait_for_version(0, timeout=30)
        yield pub, root, relay, local


@pytest.mark.timeout(120)
def test_local_alias_workers_holding_every_slot_never_stall_the_group(name, bus_dirs):
    tree = in_process_tree(name, bus_dirs, "held.sock", ack="relays", relay_timeout=1.0)
    with tree as (pub, root, relay, local):
        # an alias worker that never polls: it holds its slot and blocks the other one
        with zmqsync.Subscriber(local, name=name, reads=zmqsync.Aliases(manual=True)) as held:
            assert not pub.publish(weights={"w": torch.ones(4096)}).missing
            assert relay.version == 1 and held.version == 0
            assert relay._local.reserve_slot() is None
            # the bytes go to a staging buffer at once; the relay's own bus then evicts
            # the stuck worker after its 1 s timeout and publishes version 2
            p = pub.publish(weights={"w": torch.full((4096,), 2.0)})
            assert not p.missing and relay.version == 2
            assert root.counters.get("transfer_failures", 0) == 0
            assert relay.counters.get("receive_failures", 0) == 0
            assert relay.publisher.counters.get("evictions") == 1
            # evicted, it joins again and computes with version 2
            assert held.wait_for_version(2, timeout=20)
            assert torch.equal(held.weights["w"], torch.full((4096,), 2.0))


def test_cli_relay_errors_are_one_line(name, capsys):
    assert main(["relay", "--name", name, "--init-method", "udp://x:1"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("zmqsync relay: ValueError: init_method 'udp://x:1'") and "\n" not in err
    assert main(["relay", "--name", name, "--init-method", "tcp://203.0.113.7:29500"]) == 1
    assert "insecure=True" in capsys.readouterr().err
    assert main(["relay", "--root", "--name", name, "--init-method", "tcp://127.0.0.1:0",
                 "--timeout", "0.5"]) == 1  # fmt: skip
    assert "ConnectTimeout: no publisher answered" in capsys.readouterr().err


def test_relay_settings_are_checked_before_any_connection(monkeypatch):
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    with pytest.raises(ValueError, match="MASTER_ADDR and MASTER_PORT"):
        zmqsync.Relay(name="x")
    remote = zmqsync.Branch("tcp://198.51.100.3:29500")
    with pytest.raises(ValueError, match="no authentication"):
        zmqsync.Relay(name="x", tree=remote)
    zmqsync.Relay(name="x", tree=remote, security=zmqsync.Security(insecure=True))  # no I/O
    with pytest.raises(ValueError, match="slots >= 2"):
        zmqsync.Relay(name="x", tree=zmqsync.Branch("tcp://127.0.0.1:1"), slots=1)
    with pytest.raises(ValueError, match='ack must be "tree" or "relays"'):
        zmqsync.RelayRoot(name="x", tree=LOOPBACK, ack="all")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="NCCL"):
            zmqsync.RelayRoot(name="x", tree=zmqsync.Tree("tcp://127.0.0.1:0", backend="nccl"))
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29999")
    assert zmqsync.Relay(name="x")._port == 29999


def test_tree_and_branch_check_their_options_and_each_side_takes_its_own(monkeypatch):
    # made before MASTER_ADDR is set (as a default argument is): env:// is read by the
    # Relay or RelayRoot that is given one, not by the options
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    assert zmqsync.Tree().init_method is None and zmqsync.Branch().relay_id is None
    with pytest.raises(ValueError, match="init_method 'udp://x:1'"):
        zmqsync.Branch("udp://x:1")
    with pytest.raises(ValueError, match="port '70000'"):
        zmqsync.Tree("tcp://127.0.0.1:70000")
    with pytest.raises(ValueError, match='backend=\\) must be "gloo" or "nccl"'):
        zmqsync.Tree(backend="mpi")
    with pytest.raises(ValueError, match='NCCL stages each chunk.*backend="nccl"'):
        zmqsync.Tree(device="cuda:1")  # gloo never touches a GPU
    for chunk_mb in (0, -1.0, float("inf"), "16"):
        with pytest.raises(ValueError, match="chunk_mb"):
            zmqsync.Tree(chunk_mb=chunk_mb)
    with pytest.raises(ValueError, match="collective_timeout"):
        zmqsync.Tree(collective_timeout=0)
    with pytest.raises(ValueError, match="relay_id must be 1 to 128 printable"):
        zmqsync.Branch(relay_id="host b")
    with pytest.raises(ValueError, match="join_timeout"):
        zmqsync.Branch(join_timeout=-1)
    with pytest.raises(TypeError, match="positional"):
        zmqsync.Tree("tcp://127.0.0.1:0", "nccl")  # everything but the address by name
    with pytest.raises(dataclasses.FrozenInstanceError):
        zmqsync.Tree().backend = "nccl"  # type: ignore[misc]
    # each side takes its own object, and says which one
    with pytest.raises(
        TypeError, match=r"Relay\(tree=\) takes a zmqsync.Branch.*a Tree is how a root"
    ):
        zmqsync.Relay(name="x", tree=LOOPBACK)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"RelayRoot\(tree=\) takes a zmqsync.Tree"):
        zmqsync.RelayRoot(name="x", tree="tcp://127.0.0.1:0")  # type: ignore[arg-type]
    # what the objects hold reaches the relay and the root (no I/O before start)
    relay = zmqsync.Relay(
        name="x", tree=zmqsync.Branch("tcp://127.0.0.1:1", relay_id="b1", join_timeout=3)
    )
    assert (relay.relay_id, relay._port, relay._join_timeout) == ("b1", 1, 3.0)
    assert zmqsync.Relay(name="x", tree=zmqsync.Branch("tcp://127.0.0.1:1")).relay_id
    tree = zmqsync.Tree("tcp://127.0.0.1:0", chunk_mb=1, collective_timeout=2)
    root = zmqsync.RelayRoot(name="x", tree=tree, timeout=5)
    assert (root._chunk_bytes, root._op_timeout) == (2**20, 2.0)
    assert isinstance(root.tree, str)  # the tree's id, as before


def test_root_refuses_a_one_slot_bus(name):
    with zmqsync.Publisher({"w": torch.zeros(4)}, name=name, slots=1):
        root = zmqsync.RelayRoot(name=name, tree=LOOPBACK, timeout=5)
        with pytest.raises(zmqsync.ZmqSyncError, match="slots >= 2"):
            root.start()


SPEC = TensorSpec(("a", "w"), "float32", (2, 3), (3, 1), 0, 24)
WORKER = WorkerEntry("w0", 12, "h", "copy", "cpu", 3, 0.5)
MESSAGES = [
    messages.Join("hostA", "hostA", 1, "", -1),
    messages.Accept("0" * 16, "1" * 16, 0.5),
    messages.Refuse("0" * 16, "tree full"),
    messages.Prepare("0" * 16, 3),
    messages.Commit("0" * 16, 3, 1, 3, "gloo", 10.0, 4.0, "2" * 16, 4096, 1 << 20, (SPEC,)),
    messages.Send("0" * 16, 3, 7, "2" * 16, (2,), 4096),
    messages.Beat("0" * 16, 3),
    messages.Evict("0" * 16, "evicted"),
    messages.Status("1" * 16, 3, "2" * 16, 7, 6, (WORKER,)),
    messages.Report("1" * 16, "acked", 3, 7, "2" * 16, 7, ("w9",), ""),
    messages.Bye("1" * 16),
    messages.RelayState(
        "0" * 16,
        "policy",
        99,
        "2" * 16,
        7,
        3,
        "tree",
        (messages.RelayInfo("hostA", "h", 1, "active", 1, 3, 7, 6, 0.1, (WORKER,)),),
        {"joins": 2},
    ),
]


@pytest.mark.parametrize("msg", MESSAGES, ids=lambda m: m.TYPE)
def test_relay_messages_round_trip(msg):
    assert RELAY.decode(RELAY.encode(msg)) == msg


@pytest.mark.parametrize("msg", MESSAGES, ids=lambda m: m.TYPE)
def test_relay_messages_refuse_missing_extra_and_wrong_fields(msg):
    raw = msgpack.unpackb(RELAY.encode(msg))
    for key in [k for k in raw if k not in ("proto", "type")]:
        broken = dict(raw)
        del broken[key]
        with pytest.raises(zmqsync.ProtocolError, match="missing field"):
            RELAY.decode(msgpack.packb(broken))
        wrong = dict(raw, **{key: {"nested": [1.5]}})
        with pytest.raises(zmqsync.ProtocolError):
            RELAY.decode(msgpack.packb(wrong))
    with pytest.raises(zmqsync.ProtocolError, match="unknown field"):
        RELAY.decode(msgpack.packb(dict(raw, extra=1)))
    with pytest.raises(zmqsync.ProtocolError, match="relay protocol"):
        RELAY.decode(msgpack.packb(dict(raw, proto=2)))


@pytest.mark.parametrize(
    "frame",
    [
        b"",
        b"\x80\x04\x95cos\nsystem\n",  # a pickle is not msgpack
        msgpack.packb([1, 2]),
        msgpack.packb({"proto": 1, "type": "relay_info"}),
        msgpack.packb({"proto": 1, "type": "hello"}),
        msgpack.packb({"proto": True, "type": "relay_beat", "tree": "0" * 16, "gen": 1}),
        msgpack.packb({"proto": 1, "type": "relay_beat", "tree": "0" * 16, "gen": -1}),
        msgpack.packb({"proto": 1, "type": "relay_beat", "tree": "X" * 16, "gen": 1}),
        msgpack.packb(
            {
                "proto": 1,
                "type": "relay_send",
                "tree": "0" * 16,
                "gen": 1,
                "version": 1,
                "root_bus": "2" * 16,
                "targets": [0],
                "nbytes": 1,
            }
        ),  # fmt: skip
    ],
)
def test_relay_garbage_is_a_protocol_error(frame):
    with pytest.raises(zmqsync.ProtocolError):
        RELAY.decode(frame)


def test_rendezvous_urls():
    assert rendezvous("tcp://10.1.2.3:29500") == ("10.1.2.3", 29500)
    assert rendezvous("tcp://[::1]:29500") == ("::1", 29500)
    for bad in ("tcp://host", "tcp://h:port", "file:///tmp/x", "tcp://h:70000"):
        with pytest.raises(ValueError):
            rendezvous(bad)


@pytest.mark.timeout(120)
def test_data_channel_carries_versions_drops_garbage_and_falls_back(name, bus_dirs):
    """Notices and reports go straight between the root's relay thread and the relay's
    data thread; hostile frames there are dropped and counted; a relay whose data
    channel is down still gets every version through the control channel."""
    tree = in_process_tree(name, bus_dirs, "data.sock", ack="tree", relay_timeout=2.0)
    with tree as (pub, root, relay, local), zmqsync.Subscriber(local, name=name) as sub:
        for v in range(1, 4):
            assert not pub.publish(weights={"w": torch.full((4096,), float(v))}).missing
            assert relay.version == v and sub.wait_for_version(v, timeout=10)
        assert root.counters["data_notices"] >= 3
        # the relay posted its receives before the notices came (slots freed in time)
        assert relay.counters["preposted"] >= 1
        # and the slot it posted into is marked as being written from then on: a reader
        # that is not a holder sees the seqlock move before any byte lands
        posted = _wait(lambda: relay._posted, 5, "receives posted ahead")
        assert posted.slot is not None and relay.publisher is not None
        header = relay.publisher._mode.bound.slots.header
        assert header.read_begin(posted.slot, header.slot_version(posted.slot)) is None
        # hostile frames on the data ROUTER: not msgpack, a pickle, another message type,
        # a report of a session that does not exist
        ctx = zmq.Context()
        try:
            evil = ctx.socket(zmq.DEALER)
            evil.linger = 0
            evil.connect(root._data_endpoint)
            stale = messages.Report("f" * 16, "acked", 1, 99, "2" * 16, 99, (), "")
            for frame in (
                b"garbage",
                b"\x80\x04\x95cos\nsystem\n",
                RELAY.encode(messages.Bye("1" * 16)),
                RELAY.encode(stale),
                b"two",
            ):
                evil.send(frame)
            evil.send_multipart([b"a", b"b"])
            assert not pub.publish(weights={"w": torch.full((4096,), 4.0)}).missing
            assert relay.version == 4
            # before the context goes: linger=0 drops whatever it has not sent yet
            assert _wait(lambda: root.counters.get("rejected", 0) >= 5, 10, "rejected frames")
        finally:
            ctx.destroy(linger=0)
        assert root.counters.get("stale", 0) >= 1
        # the relay's data thread drops its connection: notices take the control channel
        assert relay._agent is not None
        relay._agent.data_endpoint = ""
        time.sleep(0.2)  # the data thread closes its DEALER within one inbox slice
        before = root.counters.get("control_notices", 0)
        for v in range(5, 8):
            assert not pub.publish(weights={"w": torch.full((4096,), float(v))}).missing
            assert relay.version == v and sub.wait_for_version(v, timeout=10)
        assert root.counters["control_notices"] >= before + 3
        assert torch.equal(sub.weights["w"], torch.full((4096,), 7.0))
        assert root.counters.get("transfer_failures", 0) == 0
