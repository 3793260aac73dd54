"""Honest workers get in and stay in: identity and admission against real processes.

A worker proves it is the same process with a secret it draws once (its HELLO's
`nonce`), so a HELLO whose answer it never saw does not lock it out; a worker whose id
another process took while it was paused learns so, and its acks and the other
process's are never confused; a HELLO storm for a live worker's id costs the honest
joins nothing. Publishers and workers are real processes on real sockets.
"""

from __future__ import annotations

import os
import signal
import statistics
import sys
import time

import pytest
import torch
import zmq

import zmqsync
from zmqsync._config import default_address
from zmqsync._deadline import Deadline
from zmqsync._protocol import Heartbeat, Hello, Inspect, State, Welcome, decode, encode
from zmqsync._sockets import request

from .conftest import ROOT

STORM = str(ROOT / "tools" / "bench" / "storms.py")
HELPERS = str(ROOT / "tests" / "helpers") + "/"


def _applied(proc, version, timeout=60):
    return proc.wait_for(lambda r: r.get("event") == "applied" and r["version"] >= version, timeout)


def _counters(ctx, address):
    state = request(ctx, address, Inspect(""), deadline=Deadline(10))
    assert isinstance(state, State)
    return state.counters


def test_a_hello_whose_welcome_was_lost_does_not_lock_its_worker_out(ctx, spawn, burners, name):
    # A HELLO read and answered into a REQ socket that is gone (the worker's attempt timed
    # out, on a stopped or saturated host): the session the publisher registered for it
    # is the worker's own. At heartbeat=2 that session stayed "live" for 12 s and refused
    # every retry ("busy: ... in use"), past the worker's whole timeout. The retry (a new
    # socket, the same HELLO, the same nonce: what the subscriber's Lazy Pirate sends)
    # gets in. The loss is made by hand, not by a well-timed SIGSTOP: the publisher
    # builds a WELCOME in about a millisecond, so no stop lands between its reading the
    # HELLO and answering it.
    publisher = spawn(
        HELPERS + "bus_publisher.py", name, "--tensors", "20000", "--heartbeat", "2", module=""
    )
    publisher.wait_for(lambda r: r.get("event") == "started", timeout=60)
    burners(2, 120)  # both cores busy
    try:
        address = default_address(name)
        hello = Hello("", "late", os.getpid(), "host", "copy", "cpu", "", "", "ab" * 16)
        before = _counters(ctx, address).get("handshakes", 0)
        lost = ctx.socket(zmq.REQ)
        lost.linger = 0
        lost.connect(address)
        lost.send(encode(hello))  # its WELCOME goes to a socket nobody reads
        deadline = Deadline(30)
        while _counters(ctx, address).get("handshakes", 0) == before:
            assert not deadline.expired(), "the publisher never read the HELLO"
            time.sleep(0.05)
        lost.close()
        retry = request(ctx, address, hello, deadline=Deadline(10))
        assert isinstance(retry, Welcome), retry
        with zmqsync.Subscriber(name=name, worker_id="late", timeout=30) as sub:
            assert sub.connected and sub.version == 0  # and a real worker of that id
    finally:
        publisher.proc.send_signal(signal.SIGTERM)
        assert publisher.finish() == 0, publisher.stderr


def test_a_paused_workers_id_taken_by_another_process_is_said_and_never_counted(
    spawn, burners, name
):
    hb = 0.25  # a worker is dropped after 1.5 s of silence
    burners(4, 120)  # on a saturated host
    with zmqsync.Publisher({"w": torch.zeros(64)}, name=name, heartbeat=hb, timeout=30) as pub:
        first = spawn("worker", "--name", name, "--json", "--worker-id", "same")
        _applied(first, 0)
        assert pub.workers["same"].pid == first.proc.pid
        first.stop()
        meant = pub.publish(max_lag=None)  # meant for the process now paused
        end = time.monotonic() + 20
        while "same" in pub.workers:
            assert time.monotonic() < end, "the paused worker was never dropped"
            time.sleep(0.05)
        second = spawn("worker", "--name", name, "--json", "--worker-id", "same")
        _applied(second, meant.version)
        assert pub.workers["same"].pid == second.proc.pid, "the holder now"
        meant.wait(timeout=5)
        assert meant.acked == () and meant.missing == ("same",), (
            "another process's ack counted for the paused one"
        )
        later = pub.publish()
        assert later.acked == ("same",)  # the holder now is a worker like any other
        first.proc.send_signal(signal.SIGCONT)
        rc = first.finish(timeout=10 * hb + 10)
        assert rc != 0, first.stderr
        assert "belongs to another process" in first.stderr, first.stderr
        assert pub.workers["same"].pid == second.proc.pid
        assert pub.publish().acked == ("same",)
        second.kill()


def _join_times(name: str, count: int) -> list[float]:
    times = []
    for i in range(count):
        t0 = time.monotonic()
        with zmqsync.Subscriber(name=name, worker_id=f"honest-{i}", timeout=10.0) as sub:
            times.append(time.monotonic() - t0)
            assert sub.version >= 0
    return times


@pytest.mark.parametrize("burning", [0, 4])
def test_a_hello_storm_for_a_live_id_costs_honest_joins_nothing(spawn, burners, name, burning):
    burners(burning, 120)  # honest joins on a quiet host, and on a saturated one
    with zmqsync.Publisher({"w": torch.zeros(64)}, name=name, timeout=20) as pub:
        victim = spawn("worker", "--name", name, "--json", "--worker-id", "victim")
        _applied(victim, 0)
        quiet = _join_times(name, 3)
        storm = spawn(STORM, "--name", name, "--worker-id", "victim", "--seconds", "30", module="")
        storm.wait_for(lambda r: r.get("event") == "storming", timeout=30)
        end = time.monotonic() + 20
        while pub.counters.get("refused_ids", 0) < 2000:  # the storm is on
            assert time.monotonic() < end, pub.counters
            time.sleep(0.05)
        stormy = _join_times(name, 7)
        refused = pub.counters.get("refused_ids", 0)
        storm.proc.send_signal(signal.SIGTERM)
        report = storm.wait_for(lambda r: r.get("event") == "done", timeout=30)
        print(
            f"{burning} burners: quiet {quiet}, storm {stormy}, storm report {report}",
            file=sys.stderr,
        )
        assert report["answers"].get("busy", 0) > 1000 and refused > 1000
        assert max(stormy) < max(2.0, 20 * statistics.median(quiet)), (quiet, stormy)
        assert pub.publish().acked  # the victim still acks
        assert "victim" in pub.workers and pub.workers["victim"].pid == victim.proc.pid
        assert os.getpid() not in {w.pid for w in pub.workers.values()}


def test_a_worker_that_missed_its_stop_is_told_again(ctx, name):
    # A session dropped while its worker was still in its handshake (between HELLO and a
    # live subscription) missed the STOP that said so: it went on beating with a session
    # that is no member of anything, counted "stale" for ever, and never re-joined.
    with zmqsync.Publisher(
        {"w": torch.zeros(4)}, name=name, heartbeat=0.1, on_timeout="evict"
    ) as pub:
        hello = Hello("", "slow", 1, "h", "copy", "cpu")
        welcome = request(ctx, pub.address, hello, deadline=Deadline(5))
        assert isinstance(welcome, Welcome)
        pub.publish(timeout=0.2)  # it never acks: evicted, told STOP (nobody listens yet)
        assert "slow" not in pub.workers
        events = ctx.socket(zmq.SUB)
        events.linger = 0
        events.setsockopt(zmq.SUBSCRIBE, b"")
        events.connect(welcome.events)
        acks = ctx.socket(zmq.PUSH)
        acks.linger = 0
        acks.connect(welcome.acks)
        end, told = time.monotonic() + 10, None
        while told is None:
            assert time.monotonic() < end, f"never told; counters {pub.counters}"
            acks.send(encode(Heartbeat(pub.bus_id, 0, "slow", welcome.session, 0)))
            while events.poll(100):
                frame = events.recv()
                if frame[:1] != b"\x00":
                    msg = decode(frame)
                    if msg.TYPE == "stop" and msg.session == welcome.session:
                        told = msg
        assert told.reason == "not on the bus"
        acks.close()
        events.close()
