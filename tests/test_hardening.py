"""Peers that send valid-looking traffic, or too much of it, against real processes.

Each attack runs against a publisher in its own process (tests/helpers/victim.py) whose
data segment is capped (RLIMIT_DATA): a flood that makes it allocate kills that process,
never the test machine, and a dead victim fails the test. A real worker process stays on
the bus throughout; the assertions are that the victim lives, keeps publishing within
its deadlines and keeps its worker, not how fast it does so.
"""

from __future__ import annotations

import contextlib
import gc
import mmap
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest
import torch
import zmq

import zmqsync
from zmqsync._buffers.header import Header
from zmqsync._config import RESERVE_MIN_S
from zmqsync._deadline import Deadline
from zmqsync._protocol import (
    Ack,
    Heartbeat,
    Hello,
    Inspect,
    Receive,
    State,
    Welcome,
    decode,
    encode,
)
from zmqsync._sockets import request

VICTIM = "tests/helpers/victim.py"
CAP_MB = 1024  # the victim's data segment; it idles at ~250 MB


@pytest.fixture
def ctx():
    context = zmq.Context()
    context.set(zmq.MAX_SOCKETS, 8192)
    yield context
    context.destroy(linger=0)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _victim(spawn, name, *extra):
    victim = spawn(VICTIM, name, "--data-mb", str(CAP_MB), *extra, module="")
    started = victim.wait_for(lambda r: r.get("event") == "started", timeout=60)
    return victim, started


def _worker(spawn, address, wid="good"):
    worker = spawn("worker", address, "--json", "--worker-id", wid, "--forever")
    worker.wait_for(lambda r: r.get("event") == "applied", timeout=60)
    return worker


def _end(victim) -> dict:
    """SIGTERM the victim; its last record, after checking it was not killed."""
    victim.proc.send_signal(signal.SIGTERM)
    rc = victim.finish(timeout=30)
    assert rc == 0, f"the publisher died (rc {rc}): {victim.stderr[-3000:]}"
    return victim.wait_for(lambda r: r.get("event") == "done", timeout=5)


def _published_during(victim, start: int, end: int) -> list[dict]:
    return [r for r in victim.records[start:end] if r.get("event") in ("published", "timeout")]


def _inspect(ctx, address) -> State:
    reply = request(ctx, address, Inspect(""), deadline=Deadline(10))
    assert isinstance(reply, State)
    return reply


def _flood(stop, ctx, kind, endpoint, frames, hwm=4):
    """Send `frames` round and round on a fresh socket until `stop` (never blocks).

    Bytes, never a shared zmq.Frame: each send wraps them without a copy, and a Frame
    sent from several threads at once corrupts its reference count.
    """
    sock = ctx.socket(kind)
    sock.linger = 0
    sock.setsockopt(zmq.SNDHWM, hwm)
    sock.connect(endpoint)
    try:
        while not stop.is_set():
            for frame in frames:
                try:
                    sock.send(frame, zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    time.sleep(0.0005)
    finally:
        sock.close()


def _under_attack(victim, attackers, seconds):
    """Run the attack threads for `seconds` while the victim publishes; its records then."""
    stop = threading.Event()
    threads = [threading.Thread(target=a, args=(stop,), daemon=True) for a in attackers]
    before = len(victim.records)
    for t in threads:
        t.start()
    try:
        time.sleep(seconds)  # the attack's duration, not a synchronisation
        assert victim.proc.poll() is None, f"the publisher died: {victim.stderr[-3000:]}"
    finally:
        stop.set()
        for t in threads:
            t.join(10)
    return _published_during(victim, before, len(victim.records))


def _assert_kept_publishing(records, worker="good"):
    assert len(records) >= 5, f"the publisher stopped publishing: {records[-3:]}"
    timeouts = [r for r in records if r["event"] == "timeout"]
    assert not timeouts, f"publishes missed their deadline under attack: {timeouts[:3]}"
    assert all(worker in r["acked"] for r in records), "the real worker stopped acking"


# --- resources a peer can make the publisher spend --------------------------------------


def test_big_frames_on_acks_and_control_neither_stall_nor_grow_the_publisher(ctx, spawn, name):
    victim, started = _victim(spawn, name)
    address = started["address"]
    worker = _worker(spawn, address)
    big = b"x" * (16 * 2**20 - 1024)  # just under the old 16 MiB limit
    attackers = [
        lambda stop: _flood(stop, ctx, zmq.PUSH, address + ".acks", [big]),
        lambda stop: _flood(stop, ctx, zmq.PUSH, address + ".acks", [big]),
        lambda stop: _flood(stop, ctx, zmq.DEALER, address, [big]),
        lambda stop: _flood(stop, ctx, zmq.DEALER, address, [b"", big]),
    ]
    records = _under_attack(victim, attackers, seconds=4)
    _assert_kept_publishing(records)
    done = _end(victim)
    assert done["peak_rss_mb"] < 600, f"the publisher grew to {done['peak_rss_mb']:.0f} MB"
    worker.kill()


def test_small_frame_floods_are_drained_within_a_budget(ctx, spawn, name):
    victim, started = _victim(spawn, name)
    address = started["address"]
    worker = _worker(spawn, address)
    junk = [b"\x81\xa1x\xa1y" * 100, b"\xff" * 900]  # under the frame limits, never valid
    attackers = [
        lambda stop: _flood(stop, ctx, zmq.PUSH, address + ".acks", junk, hwm=1000),
        lambda stop: _flood(stop, ctx, zmq.PUSH, address + ".acks", junk, hwm=1000),
        lambda stop: _flood(stop, ctx, zmq.DEALER, address, [b"", junk[0]], hwm=1000),
        # no envelope delimiter: REP skips such messages, and a blocking recv waited
        lambda stop: _flood(stop, ctx, zmq.DEALER, address, [junk[0]], hwm=1000),
    ]
    records = _under_attack(victim, attackers, seconds=4)
    _assert_kept_publishing(records)
    done = _end(victim)
    assert done["counters"]["rejected"] > 1000
    worker.kill()


class _Zmtp:
    """A peer that speaks raw ZMTP 3.0: libzmq as the sender would itself keep every
    subscription it sends (a 16 MiB one overflows its stack), so the attacker writes
    the frames by hand. Reconnects when the publisher drops it."""

    def __init__(self, endpoint: str, socket_type: bytes) -> None:
        self.endpoint, self.socket_type = endpoint, socket_type
        self.sock: socket.socket | None = None
        self.dropped = 0

    def _connect(self) -> socket.socket:
        if self.endpoint.startswith("ipc://"):
            sock = socket.socket(socket.AF_UNIX)
        else:
            host, port = self.endpoint[len("tcp://") :].rsplit(":", 1)
            sock = socket.create_connection((host, int(port)), timeout=5)
        try:
            if sock.family == socket.AF_UNIX:
                sock.settimeout(5)
                sock.connect(self.endpoint[len("ipc://") :])
            self._greet(sock)
        except BaseException:
            sock.close()
            raise
        return sock

    def _greet(self, sock: socket.socket) -> None:
        sock.settimeout(5)
        greeting = b"\xff" + bytes(8) + b"\x7f\x03\x00" + b"NULL".ljust(20, b"\x00") + bytes(32)
        sock.sendall(greeting)
        _recv_exactly(sock, 64)
        prop = b"\x0bSocket-Type" + len(self.socket_type).to_bytes(4, "big") + self.socket_type
        body = b"\x05READY" + prop
        sock.sendall(bytes([0x04, len(body)]) + body)

    def send(self, frame: bytes) -> None:
        header = bytes([0x02]) + len(frame).to_bytes(8, "big")  # a long, last frame
        try:
            if self.sock is None:
                self.sock = self._connect()
            self.sock.sendall(header + frame)
        except OSError:  # dropped by the publisher: that is the point
            self.dropped += 1
            self.close()

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None


def _recv_exactly(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise ConnectionError("closed during the ZMTP greeting")
        data += chunk
    return data


@pytest.mark.parametrize("kind", ["huge", "distinct"])
def test_subscriptions_other_than_everything_cost_the_publisher_nothing(ctx, spawn, name, kind):
    """16 MiB subscriptions (before: 233 MB -> 3 GB), or a stream of distinct small ones
    (libzmq keeps each, ~1 KiB, until the peer leaves), on events and tap over tcp."""
    port = _free_port()
    victim, started = _victim(spawn, name, "--address", f"tcp://127.0.0.1:{port}", "--tap")
    address = started["address"]
    worker = _worker(spawn, address)
    state = _inspect(ctx, address)
    huge = b"\x01" + b"s" * (16 * 2**20 - 64)

    def attack(stop, endpoint):
        peer = _Zmtp(endpoint, b"XSUB")
        try:
            while not stop.is_set():
                peer.send(huge if kind == "huge" else b"\x01" + os.urandom(12))
        finally:
            peer.close()

    endpoints = [state.events, state.tap] + ([state.events] if kind == "distinct" else [])
    attackers = [lambda stop, e=e: attack(stop, e) for e in endpoints]
    records = _under_attack(victim, attackers, seconds=5)
    _assert_kept_publishing(records)
    after = _inspect(ctx, address)
    if kind == "distinct":
        assert after.counters.get("dropped_peers", 0) > 0
    done = _end(victim)
    assert done["peak_rss_mb"] < 600, f"the publisher grew to {done['peak_rss_mb']:.0f} MB"
    worker.kill()


def test_connections_beyond_the_fd_limit_are_refused_not_fatal(ctx, spawn, name, bus_dirs):
    victim, started = _victim(spawn, name, "--nofile", "1024", "1024", "--interval", "0.2")
    address = started["address"]
    assert started["nofile"] == [1024, 1024]
    worker = _worker(spawn, address)
    kinds = [(".acks", b"PUSH"), (".events", b"SUB")]
    held: list[_Zmtp] = []
    try:
        for i in range(1100):  # a burst of 500 per second (see docs/security.md)
            # mostly acks: events and tap also limit how fast connections come
            suffix, kind = ("", b"DEALER") if i % 10 == 0 else kinds[int(i % 10 == 1)]
            peer = _Zmtp(address + suffix, kind)  # through the handshake: it stays
            with contextlib.suppress(OSError):
                peer.sock = peer._connect()
            held.append(peer)
            time.sleep(0.002)
        end = time.monotonic() + 20
        while True:
            state = _inspect(ctx, address)  # it still answers, with room kept for that
            if state.counters.get("refused_connections", 0) > 0 or time.monotonic() > end:
                break
            time.sleep(0.1)
        assert state.counters["refused_connections"] > 0
        assert state.counters["connections"] <= 1024
        assert [w.worker_id for w in state.workers] == ["good"]
        reply = request(
            ctx,
            address,
            Hello("", "late", 1, "h", "copy", "cpu"),
            deadline=Deadline(10),
        )
        assert reply.TYPE == "error" and "bus full" in reply.reason
        before = len(victim.records)
        deadline = time.monotonic() + 30
        while len(_published_during(victim, before, len(victim.records))) < 3:
            assert time.monotonic() < deadline, "no publishes while the bus was full"
            assert victim.proc.poll() is None, f"the publisher died: {victim.stderr[-3000:]}"
            time.sleep(0.1)
        _assert_kept_publishing(_published_during(victim, before, len(victim.records)) * 2)
    finally:
        for peer in held:
            peer.close()
    late = _worker(spawn, address, "late")  # room again once the flood is gone
    _end(victim)
    worker.kill()
    late.kill()


def test_default_max_workers_fit_under_the_default_fd_limits(ctx, spawn, name):
    # the common default: a soft limit of 1024 under a higher hard limit
    victim, started = _victim(
        spawn,
        name,
        "--nofile",
        "1024",
        "8192",
        "--no-publish",
        "--heartbeat",
        "10",
        "--handshake-rate",
        "100000",
        "--max-workers-per-peer",
        "1024",  # every worker below is this one process: one peer
    )
    address = started["address"]
    assert started["nofile"][0] > 2 * 1024, "the soft fd limit was not raised at start"
    held = []
    for i in range(1024):
        reply = request(
            ctx, address, Hello("", f"w{i}", i + 1, "h", "copy", "cpu"), deadline=Deadline(10)
        )
        assert isinstance(reply, Welcome), reply
        for kind, endpoint in ((zmq.SUB, reply.events), (zmq.PUSH, reply.acks)):
            sock = ctx.socket(kind)
            sock.linger = 0
            sock.connect(endpoint)
            held.append(sock)
    end = time.monotonic() + 30
    while (state := _inspect(ctx, address)).counters.get("connections", 0) < 2048:
        assert time.monotonic() < end, state.counters
        time.sleep(0.1)
    assert len(state.workers) == 1024
    assert state.counters.get("refused_connections", 0) == 0
    for sock in held:
        sock.close()
    _end(victim)


# --- lifecycle ----------------------------------------------------------------------------

_CYCLE = """
import gc, json, os, sys, warnings
import torch, zmqsync
gc.disable()  # collected below, on purpose, as part of a cycle
class Holder:
    pass
holder = Holder()
holder.self = holder  # a reference cycle, as torchrl's collectors make around a scheme
holder.bus = zmqsync.{cls}
holder.bus.start()
{before}
del holder
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    gc.collect()
kinds = sorted({{w.category.__name__ for w in caught}})
print(json.dumps({{"collected": True, "warnings": kinds}}), flush=True)
{after}
"""


def _run(script: str) -> subprocess.CompletedProcess[str]:
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "Traceback" not in out.stderr and "Exception" not in out.stderr, out.stderr[-3000:]
    return out


def test_a_publisher_collected_in_a_reference_cycle_leaves_nothing(name, bus_dirs):
    runtime, shm = bus_dirs
    script = _CYCLE.format(
        cls=f'Publisher({{"w": torch.zeros(4)}}, name="{name}")',
        before="assert len(os.listdir(os.environ['ZMQSYNC_SHM_DIR'])) == 1",
        after="""
print(json.dumps({"shm": os.listdir(os.environ["ZMQSYNC_SHM_DIR"]),
                  "runtime": os.listdir(os.environ["ZMQSYNC_RUNTIME_DIR"])}), flush=True)
""",
    )
    out = _run(script)
    assert '"warnings": ["ResourceWarning"]' in out.stdout
    assert '"shm": [], "runtime": []' in out.stdout, out.stdout
    assert os.listdir(shm) == [] and os.listdir(runtime) == []


def test_a_subscriber_collected_in_a_reference_cycle_says_bye(name):
    with zmqsync.Publisher({"w": torch.zeros(4)}, name=name, heartbeat=5.0) as pub:
        script = _CYCLE.format(
            cls=f'Subscriber(name="{name}", worker_id="cyclic")',
            before="",
            after="",
        )
        _run(script)
        # BYE, not silence: with a 5 s heartbeat, silence would take 30 s to notice
        end = time.monotonic() + 10
        while "cyclic" in pub.workers or pub.counters.get("handshakes", 0) < 1:
            assert time.monotonic() < end, "the collected subscriber never said BYE"
            time.sleep(0.05)
        assert pub.counters.get("lost", 0) == 0


def test_a_finalized_publisher_stops_its_agent_and_leaves_nothing(name, bus_dirs):
    _, shm = bus_dirs
    pub = zmqsync.Publisher({"w": torch.zeros(4)}, name=name).start()
    agent = pub._agent
    with pytest.warns(ResourceWarning):
        pub.__del__()  # what the collector does, whichever thread it runs on
    del pub
    gc.collect()
    assert not agent._thread.is_alive()
    assert os.listdir(shm) == []


# --- identity -----------------------------------------------------------------------------


def _events(ctx, endpoint):
    sub = ctx.socket(zmq.SUB)
    sub.linger = 0
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(endpoint)
    return sub


def _stops(sock, seconds=2.0) -> list:
    """The STOP events that arrive on `sock` within `seconds`."""
    end, out = time.monotonic() + seconds, []
    while (left := end - time.monotonic()) > 0:
        if sock.poll(int(left * 1000) + 1):
            frame = sock.recv()
            if not frame.startswith(b"\x00"):  # the XPUB welcome frame
                msg = decode(frame)
                if msg.TYPE == "stop":
                    out.append(msg)
    return out


def test_a_forged_hello_cannot_take_a_live_workers_id(ctx, spawn, name):
    with zmqsync.Publisher({"w": torch.zeros(1 << 16)}, name=name, slots=2) as pub:
        worker = spawn("worker", "--name", name, "--mode", "alias", "--json", "--worker-id", "v")
        worker.wait_for(lambda r: r.get("event") == "applied", timeout=60)
        real_pid = pub.workers["v"].pid
        for session in ("", "0" * 16):  # none, or a guessed one
            reply = request(
                ctx,
                pub.address,
                Hello("", "v", 1, "h", "alias", "cpu", "", session),
                deadline=Deadline(5),
            )
            assert reply.TYPE == "error" and "busy: worker id 'v' is in use" in reply.reason
        assert pub.workers["v"].pid == real_pid
        for v in range(1, 6):  # still protected and still acking: no torn reads possible
            assert pub.publish(weights={"w": torch.full((1 << 16,), float(v))}).acked == ("v",)
        assert pub.counters["refused_ids"] == 2
        worker.kill()


def test_two_processes_with_one_worker_id_the_second_is_refused_until_the_first_leaves(name):
    with zmqsync.Publisher({"w": torch.zeros(4)}, name=name) as pub:
        first = zmqsync.Subscriber(name=name, worker_id="same").start()
        try:
            with pytest.raises(zmqsync.ProtocolError, match="in use by a live worker"):
                zmqsync.Subscriber(name=name, worker_id="same", timeout=1.0).start()
            assert pub.publish().acked == ("same",) and first.version == 1
        finally:
            first.close()  # BYE: the id is free at once
        second = zmqsync.Subscriber(name=name, worker_id="same").start()
        try:
            assert pub.publish().acked == ("same",) and second.wait_for_version(2)
        finally:
            second.close()


def test_default_worker_ids_are_unique_within_one_process(name):
    with zmqsync.Publisher({"w": torch.zeros(4)}, name=name) as pub:
        with (
            zmqsync.Subscriber(name=name) as a,
            zmqsync.Subscriber(name=name) as b,
        ):
            assert a.worker_id != b.worker_id
            assert a.worker_id.startswith(f"{socket.gethostname()[:96]}-{os.getpid()}-")
            assert set(pub.publish().acked) == {a.worker_id, b.worker_id}


def test_a_rejoin_proven_by_its_session_displaces_the_old_one_and_protects_its_slot(ctx, name):
    with zmqsync.Publisher({"w": torch.zeros(4)}, name=name, slots=2) as pub:
        events = _events(ctx, pub.address + ".events")
        first = request(
            ctx, pub.address, Hello("", "p", 7, "h", "alias", "cpu"), deadline=Deadline(5)
        )
        assert isinstance(first, Welcome)
        acks = ctx.socket(zmq.PUSH)
        acks.linger = 0
        acks.connect(first.acks)
        acks.send(encode(Ack(pub.bus_id, "p", first.session, 0)))  # computes with v0 (slot 0)
        end = time.monotonic() + 5
        while pub.workers["p"].version < 0:
            assert time.monotonic() < end
            time.sleep(0.01)
        pub.publish(max_lag=None)  # v1 into slot 1; "p" still computes with v0 in slot 0
        # the same process re-joins (its link was lost): it proves it with its session
        proof = Hello("", "p", 7, "h", "alias", "cpu", "", first.session)
        again = request(ctx, pub.address, proof, deadline=Deadline(5))
        assert isinstance(again, Welcome) and again.session != first.session
        stops = _stops(events)
        assert [(s.session, s.reason) for s in stops] == [(first.session, "replaced")]
        # slot 0 still holds what the displaced session computes with: not written
        with pytest.raises(zmqsync.PublishTimeout, match="still hold every slot"):
            pub.publish(timeout=0.5)
        acks.send(encode(Ack(pub.bus_id, "p", again.session, 1)))  # moved on: slot 0 is free
        end = time.monotonic() + 5
        while pub.workers["p"].version < 1:
            assert time.monotonic() < end
            time.sleep(0.01)
        handle = pub.publish(max_lag=None)
        assert handle.version == 2  # the refused publish took no version
        acks.close()
        events.close()


def test_a_silent_sessions_id_may_be_taken_after_its_reserve_and_the_old_session_is_told(ctx, name):
    with zmqsync.Publisher({"w": torch.zeros(4)}, name=name, heartbeat=0.05) as pub:
        events = _events(ctx, pub.address + ".events")
        first = request(
            ctx, pub.address, Hello("", "q", 1, "h", "copy", "cpu"), deadline=Deadline(5)
        )
        acks = ctx.socket(zmq.PUSH)
        acks.linger = 0
        acks.connect(first.acks)
        acks.send(encode(Ack(pub.bus_id, "q", first.session, 0)))  # its first word
        end = time.monotonic() + 5
        while pub.workers["q"].version < 0:
            assert time.monotonic() < end
            time.sleep(0.01)
        acks.close()
        silent = time.monotonic()  # 6 heartbeats of silence: dropped, its id kept for it
        while not isinstance(
            second := request(
                ctx, pub.address, Hello("", "q", 2, "h", "copy", "cpu"), deadline=Deadline(5)
            ),
            Welcome,
        ):
            assert second.reason.startswith("busy: worker id 'q' is"), second
            assert time.monotonic() - silent < 15, "never let in"
            time.sleep(0.1)
        assert time.monotonic() - silent >= RESERVE_MIN_S, "let in while its id was kept"
        assert any(s.session == first.session for s in _stops(events, 1.0))
        events.close()


# --- what a sniffer sees ------------------------------------------------------------------


def test_the_tap_shows_no_session_a_peer_could_use(ctx, name):
    # nor the nonce, which proves a worker's process (and so would let a peer take its place)
    with zmqsync.Publisher(
        {"w": torch.zeros(4)}, name=name, security=zmqsync.Security(tap=True)
    ) as pub:
        tap = _events(ctx, pub.address + ".tap")
        end = time.monotonic() + 10
        while not tap.poll(50):  # the tap drops what it sends before a subscription lands
            assert time.monotonic() < end, "the tap never showed a frame"
            request(ctx, pub.address, Inspect(""), deadline=Deadline(5))
        with zmqsync.Subscriber(name=name, worker_id="s") as sub:
            real, nonce = sub._agent.session, sub._link.nonce
            for _ in range(3):
                pub.publish()
            records = []
            end = time.monotonic() + 2
            while time.monotonic() < end:
                if tap.poll(100):
                    records.append(decode(tap.recv()))
        frames = [decode(r.frame) for r in records if r.frame[:1] != b""]
        shown = {getattr(m, "session", "") for m in frames} - {""}
        assert any(m.TYPE == "ack" for m in frames) and any(m.TYPE == "welcome" for m in frames)
        assert real.encode() not in b"".join(r.frame for r in records)
        assert len(shown) == 1 and real not in shown, "one stand-in, the same for the session"
        hellos = [m for m in frames if m.TYPE == "hello"]
        assert len(nonce) == 32 and nonce.encode() not in b"".join(r.frame for r in records)
        assert hellos and all(len(h.nonce) == 32 and h.nonce != nonce for h in hellos)
        # the stand-in is worth nothing on the acks socket
        push = ctx.socket(zmq.PUSH)
        push.linger = 0
        push.connect(pub.address + ".acks")
        stale = pub.counters.get("stale", 0)
        push.send(encode(Ack(pub.bus_id, "s", shown.pop(), pub.version)))
        end = time.monotonic() + 5
        while pub.counters.get("stale", 0) == stale:
            assert time.monotonic() < end
            time.sleep(0.01)
        push.close()
        tap.close()


# --- what a subscriber trusts -------------------------------------------------------------


def test_slots_out_of_range_are_dropped_and_counted_not_fatal(bus_dirs, name):
    from tests.test_hostile_publisher import (
        BUS,
        FakePublisher,
        cpu_buffer,
        segment,
        spec,
        welcome,
    )

    runtime, shm = bus_dirs
    fake = FakePublisher(f"ipc://{runtime}/{name}.sock")
    slots, slot_bytes = 2, 4096
    try:
        with segment(shm, f"zmqsync-{name}-x-cpu", slots=slots, slot_bytes=slot_bytes) as seg:
            path = shm / seg
            with open(path, "r+b") as f, mmap.mmap(f.fileno(), 4096) as mm:
                words = memoryview(mm).cast("Q")
                header = Header(words)  # a header naming a slot past the segment, complete
                header.begin_write(9)
                header.end_write(9, 1)
                header.set_latest(1, 9)
                fake.serve(
                    welcome(
                        fake.endpoints,
                        (cpu_buffer(seg, slots, slot_bytes),),
                        (spec("w", 16, 0),),
                        slots=slots,
                        slot_bytes=slot_bytes,
                    )
                )
                sub = zmqsync.Subscriber(fake.address, timeout=5).start()
                try:
                    assert sub.version == 0  # not version 1 "in slot 9"
                    events = [
                        Receive(BUS, 1, 1, 5),  # slot 5 of 2
                        Receive(BUS, 2, 1, 63),
                        Heartbeat(BUS, 9, "", "", 1),  # a gap: repaired from the header
                    ]
                    end = time.monotonic() + 10
                    while sub.counters["rejected"] < 2:
                        for msg in events:
                            fake.events.send(encode(msg))
                        assert time.monotonic() < end, sub.counters
                        time.sleep(0.05)
                    assert sub._failure is None and sub.version == 0
                    sub.poll()  # usable: no agent failure to report
                finally:
                    sub.close()
                words.release()
    finally:
        fake.close()
