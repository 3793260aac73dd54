"""Fault injection on real processes: kills, stops, restarts, stale peers. Bounded in time."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

import zmqsync
from zmqsync._checksum import digest, stored_digest
from zmqsync.cli import main as cli_main

HB = 0.1  # heartbeat for these tests: a peer is lost after ~0.6 s


def _worker(spawn, name, wid, *extra):
    # no _checksum on these buses: --digest reports, --verify would refuse
    return spawn("worker", "--name", name, "--digest", "--json", "--worker-id", wid, *extra)


def _applied(proc, version):
    return proc.wait_for(lambda r: r.get("event") == "applied" and r["version"] >= version, 60)


def test_sigkill_worker_at_any_moment_publishes_return_within_deadline(spawn, name):
    weights = {"w": torch.zeros(1 << 20)}  # 4 MiB: kills land mid-copy too
    with zmqsync.Publisher(weights, name=name, heartbeat=HB, timeout=5.0) as pub:
        workers = [_worker(spawn, name, f"k{i}") for i in range(3)]
        assert pub.wait_for_workers(3, timeout=60)
        for w in workers:
            _applied(w, 0)
        victims = workers[:2]
        stop = threading.Event()

        def killer():
            for victim in victims:
                time.sleep(random.uniform(0.05, 0.4))
                victim.proc.send_signal(signal.SIGKILL)
            stop.set()

        thread = threading.Thread(target=killer)
        thread.start()
        v = 0
        while not stop.is_set() or v < 5:
            v += 1
            t0 = time.monotonic()
            p = pub.publish(weights={"w": torch.full((1 << 20,), float(v))})
            assert time.monotonic() - t0 < 5.0 + 1.0, "a publish overran its deadline"
            assert "k2" in p.acked
        thread.join()
        deadline = time.monotonic() + HB * 6 + 2
        while set(pub.workers) != {"k2"} and time.monotonic() < deadline:
            time.sleep(0.05)
        assert set(pub.workers) == {"k2"}, "dead workers were not noticed"
        assert pub.counters.get("lost", 0) == 2


def test_straggler_is_evicted_then_catches_up_after_sigcont(spawn, name):
    with zmqsync.Publisher(
        {"w": torch.zeros(16)}, name=name, heartbeat=0.5, timeout=1.0, on_timeout="evict"
    ) as pub:
        ok, slow = _worker(spawn, name, "ok"), _worker(spawn, name, "slow")
        assert pub.wait_for_workers(2, timeout=60)
        _applied(ok, 0), _applied(slow, 0)
        slow.stop()
        try:
            p = pub.publish(weights={"w": torch.full((16,), 1.0)})
            assert p.missing == ("slow",) and p.acked == ("ok",)
            assert "slow" not in pub.workers
            p = pub.publish(weights={"w": torch.full((16,), 2.0)})  # the next one just works
            assert p.acked == ("ok",) and not p.missing
        finally:
            slow.proc.send_signal(signal.SIGCONT)
        _applied(slow, 2)  # it re-joined by itself and applied the newest version
        assert pub.wait_for_workers(2, timeout=20)
        p = pub.publish(weights={"w": torch.full((16,), 3.0)})
        assert set(p.acked) == {"ok", "slow"}
    for w in (ok, slow):
        assert w.finish() == 0, w.stderr


def test_straggler_with_raise_names_it_and_the_bus_goes_on(spawn, name):
    with zmqsync.Publisher({"w": torch.zeros(16)}, name=name, heartbeat=2.0, timeout=0.5) as pub:
        slow = _worker(spawn, name, "slow")
        assert pub.wait_for_workers(1, timeout=60)
        _applied(slow, 0)
        slow.stop()
        try:
            with pytest.raises(zmqsync.PublishTimeout) as info:
                pub.publish()
            assert info.value.missing == ("slow",) and info.value.version == 1
        finally:
            slow.proc.send_signal(signal.SIGCONT)
        _applied(slow, 1)
        p = pub.publish()
        assert p.acked == ("slow",)


def test_publisher_sigkill_then_restart(spawn, name):
    """Subscribers keep their last whole version, notice, and re-join a new publisher."""
    trainer = spawn(
        "tools/trainer.py",
        name,
        "--updates",
        "0",
        "--heartbeat",
        str(HB),
        "--size-mb",
        "8",
        module="",
    )
    trainer.wait_for(lambda r: r.get("event") == "started", timeout=60)
    worker = _worker(spawn, name, "survivor", "--forever")
    _applied(worker, 1)
    with zmqsync.Subscriber(name=name, worker_id="inproc", timeout=20) as sub:
        assert sub.wait_for_version(3, timeout=30)
        time.sleep(random.uniform(0.0, 0.5))
        trainer.proc.send_signal(signal.SIGKILL)  # at any moment, mid-write included
        trainer.finish()
        deadline = time.monotonic() + HB * 6 + 3
        while sub.connected and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not sub.connected
        frozen = sub.version
        flat = {k: v.clone() for k, v in sub._reader.target.tensors.items()}
        assert stored_digest(flat) == digest(flat), "the last version is not whole"
        time.sleep(HB * 3)  # time passing is what is tested: the last version stays
        assert sub.version == frozen and not sub.connected
        # A new publisher at the same address: new bus, new buffers; no user code needed.
        restarted = spawn(
            "tools/trainer.py",
            name,
            "--updates",
            "0",
            "--heartbeat",
            str(HB),
            "--size-mb",
            "8",
            "--interval",
            "0.05",
            module="",
        )
        bus = restarted.wait_for(lambda r: r.get("event") == "started", timeout=60)["bus"]
        deadline = time.monotonic() + 20
        while not (sub.connected and sub._reader.bus_id == bus) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert sub.connected and sub._reader.bus_id == bus
        version_now = sub.version
        assert sub.wait_for_version(version_now + 2, timeout=20)
        flat = dict(sub._reader.target.tensors)
        assert stored_digest(flat) == digest(flat)
    n_before = len(worker.records)
    worker.wait_for(lambda r: r.get("event") == "applied" and worker.records.index(r) >= n_before)
    restarted.proc.send_signal(signal.SIGTERM)
    assert restarted.finish() == 0
    worker.kill()
    assert all(r.get("ok", True) for r in worker.records if r.get("event") == "applied")
    # The killed publisher's segment: collected now that nobody maps it.
    out = subprocess.run(
        [sys.executable, "-m", "zmqsync", "gc"], capture_output=True, text=True, timeout=30
    )
    assert out.returncode == 0


def test_stale_acks_and_heartbeats_are_ignored(name):
    import zmq

    from zmqsync._protocol import Ack, Heartbeat, encode

    with (
        zmqsync.Publisher({"w": torch.zeros(4)}, name=name, heartbeat=HB) as pub,
        zmqsync.Subscriber(name=name, worker_id="real") as sub,
    ):
        ctx = zmq.Context()
        push = ctx.socket(zmq.PUSH)
        push.linger = 0
        push.connect(pub.address + ".acks")
        try:
            push.send(encode(Ack("0123456789abcdef", "real", "0123456789abcdef", 0)))  # old bus
            push.send(encode(Ack(pub.bus_id, "real", "fedcba9876543210", 0)))  # old incarnation
            push.send(encode(Ack(pub.bus_id, "ghost", "fedcba9876543210", 0)))  # unknown worker
            push.send(encode(Heartbeat(pub.bus_id, 0, "ghost", "fedcba9876543210", 0)))
            push.send(encode(Ack(pub.bus_id, "real", sub._agent.session, 99)))  # unpublished
            deadline = time.monotonic() + 5
            while pub.counters.get("stale", 0) < 4 and time.monotonic() < deadline:
                time.sleep(0.02)
            counters = pub.counters
            assert counters.get("stale", 0) >= 4 and counters.get("rejected", 0) >= 1
            assert set(pub.workers) == {"real"} and pub.workers["real"].version == 0
            assert pub.publish().acked == ("real",)
        finally:
            push.close()
            ctx.destroy(linger=0)


def test_reused_worker_id_takes_the_place_of_a_killed_process(spawn, name):
    # a supervisor restarts a crashed worker under its old id: the new process is told
    # "busy" until the dead one has been silent for ~6 heartbeats, then takes its place
    with zmqsync.Publisher({"w": torch.zeros(4)}, name=name, heartbeat=HB) as pub:
        first = _worker(spawn, name, "same")
        _applied(first, 0)
        first.proc.send_signal(signal.SIGKILL)
        first.finish()
        second = zmqsync.Subscriber(name=name, worker_id="same", timeout=10).start()
        try:
            assert list(pub.workers) == ["same"] and pub.workers["same"].pid == os.getpid()
            p = pub.publish()
            assert p.acked == ("same",) and second.wait_for_version(1)
        finally:
            second.close()


def test_crash_cleanup_gc_removes_only_unlocked_segments(spawn, name, bus_dirs):
    _, shm = bus_dirs
    trainer = spawn("tools/trainer.py", name, "--updates", "0", "--interval", "0.2", module="")
    trainer.wait_for(lambda r: r.get("event") == "started", timeout=60)
    holder = zmqsync.Subscriber(name=name, reads=zmqsync.Aliases()).start()
    try:
        trainer.proc.send_signal(signal.SIGKILL)
        trainer.finish()
        assert len(os.listdir(shm)) == 1
        assert cli_main(["gc"]) == 0
        assert len(os.listdir(shm)) == 1, "a segment still mapped must never be removed"
    finally:
        holder.close()
    del holder
    import gc

    gc.collect()
    assert cli_main(["gc"]) == 0
    assert os.listdir(shm) == []


def test_next_publisher_start_collects_a_killed_publishers_segment(spawn, name, bus_dirs):
    _, shm = bus_dirs
    trainer = spawn("tools/trainer.py", name, "--updates", "0", "--interval", "0.2", module="")
    trainer.wait_for(lambda r: r.get("event") == "started", timeout=60)
    trainer.proc.send_signal(signal.SIGKILL)
    trainer.finish()
    old = os.listdir(shm)
    assert len(old) == 1
    with zmqsync.Publisher({"w": torch.zeros(4)}, name=name):
        assert old[0] not in os.listdir(shm)


def test_forgotten_objects_are_closed_at_interpreter_exit(name, bus_dirs):
    _, shm = bus_dirs
    script = f"""
import torch, zmqsync
pub = zmqsync.Publisher({{"w": torch.zeros(4)}}, name="{name}").start()
sub = zmqsync.Subscriber(name="{name}").start()
pub.publish()
print("ok", flush=True)
"""
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
    assert time.monotonic() - t0 < 30
    assert os.listdir(shm) == []


def test_close_is_bounded_with_a_dead_publisher(name):
    pub = zmqsync.Publisher({"w": torch.zeros(4)}, name=name, heartbeat=HB).start()
    sub = zmqsync.Subscriber(name=name).start()
    pub.close()
    t0 = time.monotonic()
    sub.close()
    sub.close()
    assert time.monotonic() - t0 < 6
    assert json.dumps(sub.version) == "0"


def test_a_worker_dropped_mid_publish_is_missing_not_acked(spawn, name):
    # A slower heartbeat than the other tests: "dead" must still be a member when
    # publish() starts, and a loaded 2-core machine can take more than HB * 6 (0.6 s)
    # between the SIGSTOP and that moment.
    hb = 0.4
    with zmqsync.Publisher({"w": torch.zeros(4)}, name=name, heartbeat=hb, timeout=10) as pub:
        ok, dead = _worker(spawn, name, "alive"), _worker(spawn, name, "dead")
        assert pub.wait_for_workers(2, timeout=60)
        _applied(ok, 0), _applied(dead, 0)
        dead.stop()
        try:
            p = pub.publish()  # returns once "dead" is dropped as silent (~6 beats)
            assert p.acked == ("alive",) and p.missing == ("dead",)
            assert p.seconds >= hb * 3
        finally:
            dead.proc.send_signal(signal.SIGCONT)


def test_a_forked_child_does_not_close_the_parents_bus(name, bus_dirs):
    _, shm = bus_dirs
    with (
        zmqsync.Publisher({"w": torch.zeros(4)}, name=name) as pub,
        zmqsync.Subscriber(name=name) as sub,
    ):
        pid = os.fork()
        if pid == 0:  # the child drops its copies, as a torchrl worker might
            pub.close()
            sub.close()
            os._exit(0)
        os.waitpid(pid, 0)
        assert len(os.listdir(shm)) == 1
        assert pub.publish().acked == (sub.worker_id,)


def test_a_segment_gone_before_the_rejoin_maps_it_is_retried(name, bus_dirs, monkeypatch):
    """The soak's one hang: a WELCOME names a segment that a restarted publisher's garbage
    collection removes before the worker maps it. The re-handshake must try again."""
    from zmqsync._buffers import cpu

    real_attach = cpu.CpuAttachment.attach.__func__
    vanished: list[str] = []

    def attach_after_the_file_vanished(cls, info, **options):
        if armed.is_set() and not vanished:  # the file disappears between WELCOME and open
            path = os.path.join(options["shm_dir"], info.segment)
            os.rename(path, path + ".away")
            vanished.append(path)
            try:
                return real_attach(cls, info, **options)
            finally:
                os.rename(path + ".away", path)
        return real_attach(cls, info, **options)

    armed = threading.Event()
    monkeypatch.setattr(cpu.CpuAttachment, "attach", classmethod(attach_after_the_file_vanished))
    with zmqsync.Publisher({"w": torch.zeros(4)}, name=name, heartbeat=HB, timeout=10) as pub:
        sub = zmqsync.Subscriber(name=name, reads=zmqsync.Copies(manual=True)).start()
        try:
            pub.close()  # the bus goes away; the worker is lost and keeps trying
            armed.set()
            with zmqsync.Publisher({"w": torch.ones(4)}, name=name, heartbeat=HB) as again:
                # on the bus again; a manual worker applies (and counts for
                # wait_for_workers) only at its next poll
                end = time.monotonic() + 20
                while not again.workers and time.monotonic() < end:
                    time.sleep(0.02)
                assert again.workers, "the worker re-joined the new bus"
                again.publish(max_lag=None)
                assert sub.wait_for_version(1, timeout=20), "the worker re-joined the new bus"
                assert vanished, "its first attempt met a vanished segment"
                assert sub.connected and sub._failure is None
                assert torch.equal(sub.weights["w"], torch.ones(4))
        finally:
            sub.close()


def test_a_command_to_an_agent_that_already_left_does_not_block(name):
    """close() tells the agent to stop, then its stop() does so again; the agent may have
    left in between (no workers to wait for). A PAIR send to an exited peer would block
    for good: the close of one CI run hung there."""
    pub = zmqsync.Publisher({"w": torch.zeros(4)}, name=name).start()
    try:
        agent = pub._agent
        assert agent is not None
        agent.command(b"stop")  # no workers: the agent leaves at once
        agent._thread.join(10)
        assert not agent._thread.is_alive()
        sent = threading.Event()

        def commands() -> None:  # the pipe's end is found closed at the second send
            for _ in range(3):
                agent.command(b"stop")
                time.sleep(0.1)
            sent.set()

        threading.Thread(target=commands, daemon=True).start()
        assert sent.wait(5), "a command to an agent that left blocked"
    finally:
        pub.close()
