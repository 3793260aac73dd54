"""CURVE buses deliver every event as fast as plain ones: library, CLI and relays.

Every publish here has a deadline shorter than the liveness window (6 heartbeats): an
ack may not come from a worker that re-joined after a silence, only from the RECEIVE
itself. Workers, sniffers and inspectors are real processes.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time

import pytest
import torch
import zmq

import zmqsync
from tests.conftest import Proc, deadline_listdir
from zmqsync._buffers import collect_garbage
from zmqsync._config import LOST_AFTER_BEATS
from zmqsync.cli import main

HEARTBEAT_S = 0.5
PUBLISH_TIMEOUT_S = 1.0  # a third of the liveness window below
assert PUBLISH_TIMEOUT_S < HEARTBEAT_S * LOST_AFTER_BEATS / 2
PUBLISHES = 5


def _loopback() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


def _serve_zap(ctx, user_id: bytes, stop: threading.Event) -> threading.Thread:
    """A minimal ZAP handler (RFC 27) that allows everyone with `user_id`."""
    zap = ctx.socket(zmq.REP)
    zap.linger = 0
    zap.bind("inproc://zeromq.zap.01")

    def serve() -> None:
        try:
            while not stop.is_set():
                if zap.poll(50):
                    version, request_id, *_ = zap.recv_multipart()
                    zap.send_multipart([version, request_id, b"200", b"OK", user_id, b""])
        finally:
            zap.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return thread


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    ("user_id", "rcvhwm", "arrives"),
    [(b"the client's key", 1, False), (b"", 1, True), (b"the client's key", 2, True)],
)
def test_libzmq_loses_a_queue_place_per_connection_to_a_zap_user_id(ctx, user_id, rcvhwm, arrives):
    """Raw pyzmq, no zmqsync: why the publisher answers ZAP with no User-Id.

    Given a User-Id, libzmq puts a credential message at the head of the connection's
    pipe; the writer counts it against RCVHWM, the reader skips it without counting. A
    RCVHWM of 1 then never lets the one subscription through. If a libzmq release
    counts both sides alike, the first case fails: the empty User-Id is then no longer
    needed (but harmless).
    """
    stop = threading.Event()
    handler = _serve_zap(ctx, user_id, stop)
    server_public, server_secret = zmq.curve_keypair()
    public, secret = zmq.curve_keypair()
    xpub = ctx.socket(zmq.XPUB)
    xpub.linger = 0
    xpub.rcvhwm = rcvhwm
    xpub.zap_domain = b"test"
    xpub.curve_secretkey, xpub.curve_publickey = server_secret, server_public
    xpub.curve_server = True
    xpub.bind("tcp://127.0.0.1:*")
    sub = ctx.socket(zmq.SUB)
    sub.linger = 0
    sub.curve_serverkey, sub.curve_publickey, sub.curve_secretkey = server_public, public, secret
    sub.subscribe(b"")
    sub.connect(xpub.getsockopt_string(zmq.LAST_ENDPOINT))
    try:
        subscribed = xpub.poll(1000) == zmq.POLLIN  # also lets the XPUB take the connection
        assert subscribed == arrives
        if arrives:
            assert xpub.recv() == b"\x01"
            xpub.send(b"event")
            assert sub.poll(1000) and sub.recv() == b"event"
    finally:
        sub.close()
        xpub.close()
        stop.set()
        handler.join(5)


def _worker(spawn, address, name, wid):
    return spawn("worker", address, "--name", name, "--json", "--worker-id", wid, "--forever")


def _publish_all(pub, n: int = PUBLISHES) -> None:
    """Publish `n` versions; each must be acked within PUBLISH_TIMEOUT_S."""
    for _ in range(n):
        p = pub.publish(timeout=PUBLISH_TIMEOUT_S)
        assert not p.missing


def _joined_once(worker, version: int) -> None:
    """The worker applied `version` and never lost the bus nor joined it twice."""
    worker.wait_for(lambda r: r.get("event") == "applied" and r["version"] == version, timeout=10)
    events = [r["event"] for r in worker.records]
    assert events.count("joined") == 1, events
    assert "lost" not in events and "rejoined" not in events, events


@pytest.mark.timeout(120)
@pytest.mark.parametrize("keys", ["server", "flag"])
def test_curve_worker_acks_every_publish_before_the_liveness_window(
    spawn, name, bus_dirs, monkeypatch, keys
):
    """``curve=CurveServer`` with the worker's keys in $ZMQSYNC_CURVE_CLIENT, or
    ``curve=True`` with the keys the publisher left in the runtime dir."""
    address = _loopback()
    if keys == "server":
        server_public, server_secret = zmqsync.curve_keypair()
        public, secret = zmqsync.curve_keypair()
        curve: zmqsync.CurveServer | bool = zmqsync.CurveServer(
            server_public, server_secret, allowed_clients=[public]
        )
        path = bus_dirs[0] / "client.json"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump({"server_public": server_public, "public": public, "secret": secret}, f)
        monkeypatch.setenv("ZMQSYNC_CURVE_CLIENT", str(path))
    else:
        curve = True
    weights = {"w": torch.zeros(1024)}
    with zmqsync.Publisher(
        weights,
        address,
        name=name,
        security=zmqsync.Security(curve=curve),
        heartbeat=HEARTBEAT_S,
        on_timeout="raise",
    ) as pub:
        worker = _worker(spawn, address, name, "cw")
        assert pub.wait_for_workers(1, timeout=60)
        _publish_all(pub)
        _joined_once(worker, PUBLISHES)


@pytest.mark.timeout(120)
def test_curve_bus_serves_sniff_and_inspect(spawn, name):
    """The CLI on a ``curve=True`` bus: the sniffer's tap subscription and inspect's
    request, both with the keys found by bus name."""
    address = _loopback()
    with zmqsync.Publisher(
        {"w": torch.zeros(1024)},
        address,
        name=name,
        security=zmqsync.Security(curve=True, tap=True),
        heartbeat=HEARTBEAT_S,
        on_timeout="raise",
    ) as pub:
        worker = _worker(spawn, address, name, "cw")
        assert pub.wait_for_workers(1, timeout=60)
        sniffer = spawn("sniff", address, "--name", name, "--json", "--duration", "60")
        # a heartbeat reaches the sniffer: its subscription to the tap was taken
        sniffer.wait_for(lambda r: r.get("type") == "heartbeat", timeout=30)
        _publish_all(pub, 3)
        for version in (1, 2, 3):
            sniffer.wait_for(
                lambda r, v=version: r.get("type") == "ack" and r.get("version") == v, timeout=10
            )
        _joined_once(worker, 3)
        done = subprocess.run(
            [sys.executable, "-m", "zmqsync", "inspect", address, "--name", name, "--json"],
            capture_output=True,
            text=True,
            timeout=60,
            env=dict(os.environ),
        )
        assert done.returncode == 0, done.stderr
        state = json.loads(done.stdout)
        assert state["access"]["curve"] is True
        assert [w["worker_id"] for w in state["workers"]] == ["cw"]


RELAY_PUBLISH_TIMEOUT_S = 2.0  # a trip through the tree, still inside the 3 s window


@pytest.mark.timeout(240)
def test_relay_root_reads_a_curve_bus_and_a_relay_serves_one(name, bus_dirs):
    """A ``curve=True`` trainer; the root finds its keys by name, as a worker does; a
    relay on another (simulated) host runs its own bus with ``--curve``, and its worker
    finds that bus's keys in its host's runtime dir."""
    runtime, shm = bus_dirs
    host_runtime, host_shm = runtime / "hostB", shm / "hostB"
    host_runtime.mkdir(mode=0o700)
    host_shm.mkdir(mode=0o700)
    trainer_address, local_address = _loopback(), _loopback()
    procs: list[Proc] = []
    try:
        with (
            zmqsync.Publisher(
                {"w": torch.zeros(4096)},
                trainer_address,
                name=name,
                security=zmqsync.Security(curve=True),
                heartbeat=HEARTBEAT_S,
                on_timeout="raise",
            ) as pub,
            zmqsync.RelayRoot(
                trainer_address,
                name=name,
                tree=zmqsync.Tree("tcp://127.0.0.1:0"),
                ack="tree",
                timeout=8,
                heartbeat=HEARTBEAT_S,
            ) as root,
        ):
            env = dict(
                os.environ,
                ZMQSYNC_RUNTIME_DIR=str(host_runtime),
                ZMQSYNC_SHM_DIR=str(host_shm),
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=root.init_method_url.rsplit(":", 1)[1],
            )
            zmq_cli = [sys.executable, "-m", "zmqsync"]
            relay = Proc(
                [*zmq_cli, "relay", local_address, "--name", name, "--relay-id", "hostB",
                 "--heartbeat", str(HEARTBEAT_S), "--timeout", "3", "--curve", "--json"],
                env,
            )  # fmt: skip
            procs.append(relay)
            assert root.wait_for_relays(1, timeout=90), root.relays
            assert (host_runtime / f"{name}.curve").exists()
            worker = Proc(
                [*zmq_cli, "worker", local_address, "--name", name, "--json", "--forever",
                 "--worker-id", "hostB-w", "--timeout", "60"],
                env,
            )  # fmt: skip
            procs.append(worker)
            worker.wait_for(lambda r: r.get("event") == "applied", timeout=90)
            end = time.monotonic() + 30
            while not all(len(r.workers) == 1 for r in root.relays.values()):
                assert time.monotonic() < end, root.relays
                time.sleep(0.05)
            for version in range(1, 4):
                p = pub.publish(weights={"w": torch.full((4096,), float(version))},
                                timeout=RELAY_PUBLISH_TIMEOUT_S)  # fmt: skip
                assert p.acked == ("relay-root",) and not p.missing
                # tree mode: the root acked once the relay's worker acked
                worker.wait_for(
                    lambda r, v=version: r.get("event") == "applied" and r["version"] == v,
                    timeout=10,
                )
            events = [r["event"] for r in worker.records]
            assert events.count("joined") == 1 and "rejoined" not in events, events
    finally:
        for proc in procs:
            proc.kill()
        collect_garbage(str(host_shm))  # segments of the SIGKILLed relay, now unlocked
        leaked = deadline_listdir(str(host_shm))
        shutil.rmtree(host_shm, ignore_errors=True)
        shutil.rmtree(host_runtime, ignore_errors=True)
    assert not leaked, f"segments left on the relay's host: {leaked}"


def test_cli_root_takes_no_curve_flag(name, capsys):
    """A root is a client of the trainer's bus: it has keys to find, none to make."""
    assert main(["relay", "--root", "--curve", "--name", name]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("zmqsync relay: ValueError: --curve makes keys for a relay's own bus")


@pytest.mark.timeout(180)
def test_a_worker_started_first_finds_the_keys_and_keeps_up_with_new_ones(spawn, name):
    """A ``curve=True`` publisher writes its keys as it starts, new ones at each start:
    a worker that waits for it gets in, and gets in again after a restart."""
    address = _loopback()
    weights = {"w": torch.zeros(1024)}
    worker = spawn(
        "worker", address, "--name", name, "--json", "--worker-id", "early", "--forever",
        "--timeout", "60",
    )  # fmt: skip
    buses = []
    for generation in range(2):
        with zmqsync.Publisher(
            weights,
            address,
            name=name,
            security=zmqsync.Security(curve=True),
            heartbeat=HEARTBEAT_S,
            on_timeout="raise",
        ) as pub:
            assert pub.wait_for_workers(1, timeout=60), generation
            _publish_all(pub, 2)
            buses.append(pub.bus_id)
    applied = {(r["bus"], r["version"]) for r in worker.records if r["event"] == "applied"}
    assert {(bus, 2) for bus in buses} <= applied, applied
