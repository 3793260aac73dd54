"""Hostile and malformed input against a running bus, and who may connect."""

from __future__ import annotations

import logging
import os
import pickle
import socket
import stat
import threading
import time

import msgpack
import pytest
import torch
import zmq

import zmqsync
from zmqsync._config import runtime_dir
from zmqsync._protocol import PROTO, Ack, Hello, Inspect, State, decode, encode
from zmqsync.cli import main as cli_main


class _Canary:
    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def _raw(ctx, kind, endpoint):
    sock = ctx.socket(kind)
    sock.linger = 0
    sock.connect(endpoint)
    return sock


def _state(ctx, address) -> State:
    req = _raw(ctx, zmq.REQ, address)
    req.send(encode(Inspect("")))
    assert req.poll(5000)
    reply = decode(req.recv())
    req.close()
    assert isinstance(reply, State)
    return reply


def test_garbage_on_every_endpoint_is_dropped_and_counted(ctx, name, tmp_path):
    canary = tmp_path / "canary"
    pickled = pickle.dumps(_Canary(str(canary)))
    with (
        zmqsync.Publisher(
            {"w": torch.zeros(8)}, name=name, security=zmqsync.Security(tap=True)
        ) as pub,
        zmqsync.Subscriber(name=name, worker_id="good") as sub,
    ):
        foreign = msgpack.packb(
            {
                "proto": PROTO,
                "type": "ack",
                "bus": "0" * 16,
                "worker_id": "good",
                "session": "0" * 16,
                "version": 0,
            }
        )
        wrong_proto = msgpack.packb({"proto": 99, "type": "inspect", "bus": ""})
        hostile = [
            b"",
            b"\xff\xfe garbage",
            encode(Inspect(""))[:-2],
            pickled,
            foreign,
            wrong_proto,
            msgpack.packb([1, 2, 3]),
            b"\x91" * 1000,
            encode(Hello("", "../../../etc/passwd", 1, "h", "copy", "cpu"))[:-1],
        ]
        # control: every bad request gets an ERROR answer, never a crash or a hang
        for frame in hostile:
            req = _raw(ctx, zmq.REQ, pub.address)
            req.send(frame)
            assert req.poll(5000), "the publisher stopped answering"
            reply = decode(req.recv())
            assert reply.TYPE == "error"
            req.close()
        # a frame larger than any request: libzmq drops the sender, nothing is answered
        req = _raw(ctx, zmq.REQ, pub.address)
        req.send(b"\x91" * 100_000)
        assert not req.poll(500)
        req.close()
        # a traversal-looking worker id is only a name: it joins, and no path is made of it
        req = _raw(ctx, zmq.REQ, pub.address)
        req.send(encode(Hello("", "../../x", 1, "h", "copy", "cpu")))
        assert req.poll(5000) and decode(req.recv()).TYPE == "welcome"
        req.close()
        # acks and events: garbage, forged acks for versions never published, multipart
        push = _raw(ctx, zmq.PUSH, pub.address + ".acks")
        for frame in hostile:
            push.send(frame)
        push.send(encode(Ack(pub.bus_id, "good", sub._agent.session, 1000)))
        push.send_multipart([b"a", b"b"])
        xsub = _raw(ctx, zmq.XSUB, pub.address + ".events")
        for frame in hostile:
            xsub.send(frame)
        end = time.monotonic() + 10
        while (state := _state(ctx, pub.address)).counters.get("stale", 0) < 1 or state.counters[
            "rejected"
        ] < 2 * len(hostile):
            assert time.monotonic() < end, state.counters
            time.sleep(0.02)
        assert state.counters["rejected"] >= 2 * len(hostile)
        assert state.counters["stale"] >= 1
        assert pub.workers["good"].version == 0  # the forged ack changed nothing
        assert not canary.exists(), "something was unpickled"
        p = pub.publish()  # still serving
        assert "good" in p.acked and sub.version == 1
        push.close()
        xsub.close()


def test_flood_on_every_socket_does_not_stop_real_workers(ctx, name):
    with (
        zmqsync.Publisher({"w": torch.zeros(8)}, name=name, timeout=20) as pub,
        zmqsync.Subscriber(name=name, worker_id="good") as sub,
    ):
        stop = threading.Event()

        def flood(kind, endpoint, frame, count):
            sock = _raw(ctx, kind, endpoint)
            for _ in range(count):
                if stop.is_set():
                    break
                try:
                    sock.send(frame, zmq.NOBLOCK)
                except zmq.Again:
                    time.sleep(0.001)
            sock.close()

        big = b"x" * (17 * 1024 * 1024)  # over MAXMSGSIZE: libzmq drops the peer
        floods = [
            threading.Thread(
                target=flood, args=(zmq.PUSH, pub.address + ".acks", b"\x00junk", 100_000)
            ),
            threading.Thread(target=flood, args=(zmq.DEALER, pub.address, b"\x00junk", 100_000)),
            threading.Thread(
                target=flood, args=(zmq.XSUB, pub.address + ".events", b"\x01x", 100_000)
            ),
            threading.Thread(target=flood, args=(zmq.PUSH, pub.address + ".acks", big, 3)),
            threading.Thread(target=flood, args=(zmq.DEALER, pub.address, big, 3)),
        ]
        for t in floods:
            t.start()
        try:
            for v in range(1, 21):
                p = pub.publish()  # bounded by its 20 s deadline: raises if it overran
                assert p.acked == ("good",) and sub.version >= v
        finally:
            stop.set()
            for t in floods:
                t.join(30)
        assert pub.counters["rejected"] > 0


def _maps() -> str:
    with open("/proc/self/maps") as f:
        return f.read()


def _fake_publisher(ctx, address, welcome_body: dict):
    rep = ctx.socket(zmq.REP)
    rep.linger = 0
    rep.bind(address)

    def serve():
        if rep.poll(10_000):
            rep.recv()
            rep.send(msgpack.packb(welcome_body, use_bin_type=True))
        rep.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return thread


def _welcome(address: str, **changes) -> dict:
    body = {
        "proto": PROTO,
        "type": "welcome",
        "bus": "ab" * 8,
        "session": "cd" * 8,
        "seq": 0,
        "version": 0,
        "slot": 0,
        "slots": 2,
        "slot_bytes": 4096,
        "heartbeat": 0.5,
        "events": address + ".events",
        "acks": address + ".acks",
        "tap": "",
        "buffers": [
            {
                "kind": "cpu",
                "device": "cpu",
                "segment": "zmqsync-fake-x-cpu",
                "size": 4096 * 3,
                "header_bytes": 4096,
                "handle": b"",
                "device_uuid": "",
                "pid_ns": 0,
                "ipc_note": "",
            }
        ],
        "manifest": [
            {
                "key": ["w"],
                "dtype": "float32",
                "shape": [4],
                "stride": [1],
                "offset": 0,
                "nbytes": 16,
                "buffer": 0,
            }
        ],
    }
    for key, value in changes.items():
        if key in body["buffers"][0]:
            body["buffers"][0][key] = value
        else:
            body[key] = value
    return body


@pytest.mark.parametrize(
    "case",
    [
        "dotdot",
        "absolute",
        "symlink",
        "past_the_file",
        "huge_manifest",
        "cuda_handle",
        "foreign_endpoint",
        "offset_past_slot",
    ],
)
def test_hostile_welcome_is_refused_and_maps_nothing(ctx, name, bus_dirs, tmp_path, case):
    _, shm = bus_dirs
    address = f"ipc://{runtime_dir()}/{name}.sock"
    outside = tmp_path / "secret"
    outside.write_bytes(b"\0" * 4096 * 3)
    changes: dict = {
        "dotdot": {"segment": "../secret"},
        "absolute": {"segment": str(outside)},
        "symlink": {"segment": "zmqsync-link"},
        "past_the_file": {"segment": "zmqsync-small", "size": 4096 * 3},
        "huge_manifest": {
            "manifest": [
                {
                    "key": ["w"],
                    "dtype": "float32",
                    "shape": [2**40],
                    "stride": [1],
                    "offset": 0,
                    "nbytes": 2**42,
                    "buffer": 0,
                }
            ]
        },
        "cuda_handle": {"kind": "cuda", "device": "cuda:0", "handle": b"\x01" * 300},
        "foreign_endpoint": {"events": "ipc:///tmp/elsewhere/x.events"},
        "offset_past_slot": {
            "manifest": [
                {
                    "key": ["w"],
                    "dtype": "float32",
                    "shape": [4],
                    "stride": [1],
                    "offset": 8192,
                    "nbytes": 16,
                    "buffer": 0,
                }
            ]
        },
    }[case]
    os.symlink(outside, shm / "zmqsync-link")
    (shm / "zmqsync-small").write_bytes(b"\0" * 100)
    fake = _fake_publisher(ctx, address, _welcome(address, **changes))
    maps_before = _maps().count(str(outside))
    with pytest.raises(zmqsync.ProtocolError):
        zmqsync.Subscriber(address, name=name, timeout=5).start()
    fake.join(10)
    assert _maps().count(str(outside)) == maps_before == 0
    os.unlink(shm / "zmqsync-link")
    os.unlink(shm / "zmqsync-small")


def test_runtime_dir_must_be_private(monkeypatch, tmp_path):
    shared = tmp_path / "rt"
    shared.mkdir(mode=0o777)
    os.chmod(shared, 0o777)
    monkeypatch.setenv("ZMQSYNC_RUNTIME_DIR", str(shared))
    with pytest.raises(PermissionError, match="writable by others"):
        runtime_dir()
    os.chmod(shared, 0o700)
    os.chown(shared, 65534, -1)
    with pytest.raises(PermissionError, match="owned by uid 65534"):
        runtime_dir()
    fresh = tmp_path / "new"
    monkeypatch.setenv("ZMQSYNC_RUNTIME_DIR", str(fresh))
    assert runtime_dir() == str(fresh) and os.stat(fresh).st_mode & 0o777 == 0o700


def test_files_are_private_by_default_and_shared_with_a_group(name, bus_dirs):
    runtime, shm = bus_dirs
    with zmqsync.Publisher({"w": torch.zeros(4)}, name=name):
        for f in os.listdir(runtime):
            assert os.stat(runtime / f).st_mode & 0o777 == 0o600, f
        (seg,) = os.listdir(shm)
        assert os.stat(shm / seg).st_mode & 0o777 == 0o600
    with (
        zmqsync.Publisher(
            {"w": torch.zeros(4)}, name=name, security=zmqsync.Security(group=100)
        ) as pub,
        zmqsync.Subscriber(name=name),
    ):
        sock = pub.address[len("ipc://") :]
        assert os.stat(sock).st_mode & 0o777 == 0o660 and os.stat(sock).st_gid == 100
        (seg,) = os.listdir(shm)
        assert os.stat(shm / seg).st_mode & 0o777 == 0o640 and os.stat(shm / seg).st_gid == 100


def test_non_loopback_tcp_requires_curve_or_insecure(name):
    with pytest.raises(ValueError, match="reachable from other hosts"):
        zmqsync.Publisher({"w": torch.zeros(4)}, "tcp://0.0.0.0:47311", name=name).start()
    with (
        zmqsync.Publisher(
            {"w": torch.zeros(4)},
            "tcp://0.0.0.0:47311",
            name=name,
            security=zmqsync.Security(insecure=True),
        ) as pub,
        zmqsync.Subscriber("tcp://127.0.0.1:47311", name=name) as sub,
    ):
        pub.publish()
        assert sub.version == 1


def test_curve_lets_in_allowed_clients_only(ctx, name):
    server_pub, server_sec = zmqsync.curve_keypair()
    client_pub, client_sec = zmqsync.curve_keypair()
    other_pub, other_sec = zmqsync.curve_keypair()
    curve = zmqsync.CurveServer(server_pub, server_sec, allowed_clients=[client_pub])
    assert server_sec not in repr(curve)
    address = "tcp://0.0.0.0:47313"
    with zmqsync.Publisher(
        {"w": torch.zeros(4)}, address, name=name, security=zmqsync.Security(curve=curve)
    ) as pub:
        good = zmqsync.CurveClient(server_pub, client_pub, client_sec)
        with zmqsync.Subscriber(
            "tcp://127.0.0.1:47313", name=name, security=zmqsync.Security(curve=good)
        ) as sub:
            pub.publish()
            assert sub.version == 1 and list(pub.workers) == [sub.worker_id]
        intruder = zmqsync.CurveClient(server_pub, other_pub, other_sec)
        with pytest.raises(zmqsync.ConnectTimeout):
            zmqsync.Subscriber(
                "tcp://127.0.0.1:47313",
                name=name,
                security=zmqsync.Security(curve=intruder),
                timeout=1.0,
            ).start()
        plain = zmqsync.Subscriber("tcp://127.0.0.1:47313", name=name, timeout=1.0)
        with pytest.raises(zmqsync.ConnectTimeout):
            plain.start()
        # an unauthorized SUB on the events socket receives nothing
        spy = _raw(ctx, zmq.SUB, pub.address.replace("0.0.0.0", "127.0.0.1"))
        spy.setsockopt(zmq.SUBSCRIBE, b"")
        pub.publish()
        assert not spy.poll(1000)
        spy.close()
        assert pub.workers == {}


def test_curve_is_one_flag_away_on_one_host(ctx, name, bus_dirs, caplog):
    runtime, _ = bus_dirs
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    address = f"tcp://127.0.0.1:{port}"
    keys = runtime / f"{name}.curve"
    with zmqsync.Publisher(
        {"w": torch.zeros(4)}, address, name=name, security=zmqsync.Security(curve=True)
    ) as pub:
        assert keys.exists() and stat.S_IMODE(keys.stat().st_mode) == 0o600
        # subscribers and the CLI of this name find the keys in the runtime dir
        with zmqsync.Subscriber(address, name=name) as sub:
            pub.publish()
            assert sub.version == 1
        assert cli_main(["inspect", address, "--name", name, "--json"]) == 0
        # whoever cannot read them gets nothing
        keys_copy = keys.read_bytes()
        keys.unlink()
        with pytest.raises(zmqsync.ConnectTimeout):
            zmqsync.Subscriber(address, name=name, timeout=1.0).start()
        keys.write_bytes(keys_copy)
    assert not keys.exists(), "the publisher removes its client keys when it closes"
    with caplog.at_level(logging.WARNING, logger="zmqsync"):
        with zmqsync.Publisher({"w": torch.zeros(4)}, address, name=name):
            pass
    assert "has no CURVE: any local user can inspect this bus" in caplog.text


def _hello_storm(ctx, address, count):
    dealer = _raw(ctx, zmq.DEALER, address)
    for i in range(count):
        dealer.send_multipart([b"", encode(Hello("", f"storm-{i}", i, "h", "copy", "cpu"))])
    answers = []
    while dealer.poll(2000):
        answers.append(decode(dealer.recv_multipart()[1]))
    dealer.close()
    assert len(answers) == count
    return [a.reason for a in answers if a.TYPE == "error"]


def test_hello_storm_is_throttled_and_capped(ctx, name):
    # new ids beyond the handshake budget: refused "busy" (each one's id gets a place in line)
    with zmqsync.Publisher(
        {"w": torch.zeros(4)},
        name=name,
        security=zmqsync.Security(max_workers=1000, handshake_rate=100.0),
    ) as pub:
        refused = _hello_storm(ctx, pub.address, 2000)
        assert any(r.startswith("busy: too many handshakes") for r in refused)
        assert len(pub.workers) <= 1000
        assert pub.counters["throttled"] > 0
    # beyond max_workers: "bus full", which costs no handshake (the budget stays for others)
    with zmqsync.Publisher(
        {"w": torch.zeros(4)},
        name=name,
        security=zmqsync.Security(max_workers=20, handshake_rate=100.0, max_workers_per_peer=20),
    ) as pub:
        refused = _hello_storm(ctx, pub.address, 2000)
        assert any(r.startswith("bus full") for r in refused)
        assert len(pub.workers) == 20
        assert pub.counters.get("throttled", 0) == 0 and pub.counters["handshakes"] == 20
    # after the storm a real worker can still join: storm members are dropped when silent
    with zmqsync.Publisher(
        {"w": torch.zeros(4)},
        name=name,
        security=zmqsync.Security(max_workers=2, handshake_rate=5.0, max_workers_per_peer=2),
    ) as pub:
        with (
            zmqsync.Subscriber(name=name, worker_id="a"),
            zmqsync.Subscriber(name=name, worker_id="b"),
        ):
            with pytest.raises(zmqsync.ProtocolError, match="bus full"):  # asked until then
                zmqsync.Subscriber(name=name, worker_id="c", timeout=1.0).start()
