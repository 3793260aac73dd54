"""The bus end to end: real subprocess workers, real sockets, real shared memory."""

from __future__ import annotations

import os
import time

import pytest
import torch

import zmqsync
from tests.helpers.models import Mixed, filled, train_step
from zmqsync import _config
from zmqsync._checksum import digest
from zmqsync._layout import flatten


def _worker(spawn, name, mode="copy", *extra):
    return spawn(
        "worker",
        "--name",
        name,
        "--mode",
        mode,
        "--digest",  # these buses publish no _checksum: the test compares digests itself
        "--json",
        "--worker-id",
        f"w-{mode}-{len(extra)}-{time.monotonic_ns()}",
        *extra,
    )


@pytest.mark.parametrize("mode", ["copy", "alias"])
def test_mixed_dtypes_bit_exact_in_subprocess_workers(spawn, name, mode):
    torch.manual_seed(0)
    model = Mixed()
    expected = {}
    with zmqsync.Publisher(model, name=name, timeout=30) as pub:
        expected[0] = digest(flatten(model))
        workers = [_worker(spawn, name, mode) for _ in range(3)]
        assert pub.wait_for_workers(3, timeout=60)
        for w in workers:
            w.wait_for(lambda r: r.get("version") == 0)
        for v in range(1, 12):
            train_step(model, seed=v)
            p = pub.publish()
            assert p.version == v and not p.missing and len(p.acked) == 3
            expected[v] = digest(flatten(model))
    for w in workers:
        assert w.finish() == 0
        applied = {r["version"]: r["checksum"] for r in w.records if r["event"] == "applied"}
        assert set(applied) == set(range(12)), "every version applied exactly once"
        assert applied == expected, "worker tensors differ from the trainer's"


def test_sixteen_independent_processes(spawn, name):
    weights = {"w": torch.zeros(64, 64), "step": torch.zeros((), dtype=torch.int64)}
    with zmqsync.Publisher(weights, name=name, timeout=60) as pub:
        workers = [_worker(spawn, name) for _ in range(16)]
        assert pub.wait_for_workers(16, timeout=90), f"only {len(pub.workers)} joined"
        for v in range(1, 4):
            p = pub.publish(weights={"w": torch.full((64, 64), float(v)), "step": torch.tensor(v)})
            assert len(p.acked) == 16 and not p.missing
        assert all(info.version == 3 for info in pub.workers.values())
    for w in workers:
        assert w.finish() == 0
        assert w.summary()["last_version"] == 3


def test_late_joiner_computes_with_current_version_at_start(name):
    model = Mixed()
    with zmqsync.Publisher(model, name=name) as pub:
        for v in range(1, 6):
            train_step(model, seed=v)
            pub.publish()
        late = Mixed()
        with zmqsync.Subscriber(name=name, model=late) as sub:
            assert sub.version == 5
            assert digest(flatten(late)) == digest(flatten(model))
            train_step(model, seed=6)
            pub.publish()
            assert sub.wait_for_version(6, timeout=10)
            assert digest(flatten(late)) == digest(flatten(model))


def test_late_joiner_subprocess_never_misses_or_repeats(spawn, name):
    weights = {"w": torch.zeros(8)}
    with zmqsync.Publisher(weights, name=name, timeout=30) as pub:
        for v in range(1, 6):
            pub.publish(weights={"w": torch.full((8,), float(v))})
        w = _worker(spawn, name)
        assert pub.wait_for_workers(1, timeout=60)
        first = w.wait_for(lambda r: r["event"] == "applied")
        assert first["version"] >= 5
        for v in range(6, 10):
            pub.publish(weights={"w": torch.full((8,), float(v))})
    assert w.finish() == 0
    versions = [r["version"] for r in w.records if r["event"] == "applied"]
    assert versions == list(range(5, 10))


@pytest.mark.parametrize("slots", [2, 1])
def test_alias_readers_never_see_a_torn_version(spawn, name, slots):
    template = {
        "a": torch.zeros(256, 256),
        "b": torch.zeros(1000, dtype=torch.bfloat16),
        "c": torch.zeros(333, dtype=torch.int64),
    }
    with zmqsync.Publisher(template, name=name, slots=slots, timeout=30) as pub:
        readers = [
            spawn("tests/helpers/torn_worker.py", name, "alias", module="") for _ in range(2)
        ]
        for r in readers:
            r.wait_for(lambda rec: rec["event"] == "ready", timeout=60)
        assert pub.wait_for_workers(2, timeout=30)
        end = time.monotonic() + 4.0
        version = 0
        while time.monotonic() < end:
            version += 1
            pub.publish(weights=filled(template, version))
    for r in readers:
        assert r.finish() == 0
        s = r.summary()
        assert s["bad"] == 0, f"a reader saw a mix of two versions: {s}"
        assert s["reads"] > 100 and s["versions"] > 5, s
        if slots > 1:
            assert s["torn"] == 0, "with free slots the publisher never rewrites a held one"


def test_layout_mismatch_names_the_difference_and_bus_keeps_working(name):
    weights = {"a": torch.zeros(4), "b": torch.zeros(2, 3)}
    with zmqsync.Publisher(weights, name=name) as pub, zmqsync.Subscriber(name=name) as sub:
        with pytest.raises(zmqsync.LayoutMismatch, match="missing key 'b'"):
            pub.publish(weights={"a": torch.zeros(4)})
        with pytest.raises(zmqsync.LayoutMismatch, match=r"b: got float32\[3, 2\]"):
            pub.publish(weights={"a": torch.zeros(4), "b": torch.zeros(3, 2)})
        with pytest.raises(ValueError, match="a: got float64"):
            pub.publish(weights={"a": torch.zeros(4, dtype=torch.float64), "b": torch.zeros(2, 3)})
        with pytest.raises(zmqsync.LayoutMismatch, match="unexpected key 'c'"):
            pub.publish(weights={**weights, "c": torch.zeros(1)})
        p = pub.publish(weights={"a": torch.ones(4), "b": torch.ones(2, 3)})
        assert p.version == 1 and sub.wait_for_version(1, timeout=10)
        assert torch.equal(sub.weights["a"], torch.ones(4))


def test_subscriber_model_must_match_the_bus(name):
    with zmqsync.Publisher({"a": torch.zeros(4)}, name=name):
        sub = zmqsync.Subscriber(name=name, model={"a": torch.zeros(5)})
        with pytest.raises(zmqsync.LayoutMismatch, match="a: it has float32\\[5\\]|a: got") as exc:
            sub.start()
        assert "this worker's model" in str(exc.value)
        assert "new Publisher" not in str(exc.value)  # the trainer's advice is not the worker's


def test_publish_wait_false_targets_and_on_update(name):
    seen = []
    with zmqsync.Publisher({"x": torch.zeros(3)}, name=name) as pub:
        with (
            zmqsync.Subscriber(
                name=name, worker_id="a", reads=zmqsync.Copies(on_update=seen.append)
            ) as a,
            zmqsync.Subscriber(name=name, worker_id="b", reads=zmqsync.Copies(manual=True)) as b,
        ):
            p = pub.publish(weights={"x": torch.ones(3)}, max_lag=None, workers=["a"])
            assert p.targets == ("a",)
            assert p.wait(timeout=10) is p and p.done() and p.acked == ("a",)
            assert a.version == 1 and seen == [0, 1]
            assert b.version == 0  # manual: nothing applied until poll()
            assert b.poll(timeout=5) and b.version == 1
            assert torch.equal(b.weights["x"], torch.ones(3))
            assert not b.poll()  # nothing new


def test_alias_mode_model_shares_the_buffer_and_is_read_only(name):
    model = torch.nn.Linear(4, 2)
    worker = torch.nn.Linear(4, 2)
    param = worker.weight
    with (
        zmqsync.Publisher(model, name=name) as pub,
        zmqsync.Subscriber(name=name, model=worker, reads=zmqsync.Aliases()) as sub,
    ):
        with torch.no_grad():
            model.weight.fill_(3.0)
        pub.publish()
        assert sub.wait_for_version(1)
        assert worker.weight is param  # identity kept, data swapped
        assert torch.equal(worker.weight, model.weight)
        assert worker(torch.ones(1, 4)).shape == (1, 2)


def test_publish_timeout_names_missing_workers(name):
    with (
        zmqsync.Publisher({"x": torch.zeros(3)}, name=name, timeout=0.5) as pub,
        zmqsync.Subscriber(name=name, worker_id="slow", reads=zmqsync.Copies(manual=True)),
    ):
        with pytest.raises(zmqsync.PublishTimeout) as info:
            pub.publish()
        assert info.value.missing == ("slow",) and info.value.version == 1
        assert isinstance(info.value, TimeoutError)
        assert "slow" in str(info.value) and "evict" in str(info.value)


def test_close_leaves_nothing_behind(name, bus_dirs):
    runtime, shm = bus_dirs
    pub = zmqsync.Publisher({"x": torch.zeros(1000)}, name=name).start()
    sub = zmqsync.Subscriber(name=name, reads=zmqsync.Aliases()).start()
    assert len(os.listdir(shm)) == 1
    sub.close()
    pub.close()
    pub.close()
    sub.close()  # idempotent
    assert os.listdir(shm) == []
    assert [p for p in os.listdir(runtime) if p.startswith(name)] == []
    with pytest.raises(zmqsync.ClosedError):
        pub.publish()
    with pytest.raises(zmqsync.ClosedError):
        pub.start()


def test_close_removes_the_socket_files_even_when_the_agent_thread_is_stuck(
    name, bus_dirs, monkeypatch, caplog
):
    # A thread that keeps the sockets' lock (say, a signal landed between its acquire and
    # its try) leaves the agent thread waiting past close()'s join: the process may end
    # before that thread removes its files, so close() removes them itself.
    runtime, shm = bus_dirs
    monkeypatch.setattr(_config, "THREAD_JOIN_S", 0.2)
    monkeypatch.setenv("ZMQSYNC_TAP", "1")
    pub = zmqsync.Publisher({"x": torch.zeros(1)}, name=name).start()
    sockets = [p for p in os.listdir(runtime) if p.startswith(name)]
    assert len(sockets) == 4, sockets  # control, events, acks, tap
    io = pub._shared.io
    io.acquire()
    try:
        with caplog.at_level("WARNING", logger="zmqsync"):
            pub.close()
        assert "did not stop within its deadline" in caplog.text
        assert [p for p in os.listdir(runtime) if p.startswith(name)] == []
        assert os.listdir(shm) == []
    finally:
        io.release()
    pub._agent._thread.join(10)  # lets go once it has the lock: nothing left to close
    assert not pub._agent._thread.is_alive()


def test_default_address_lives_in_a_private_runtime_dir(name, bus_dirs):
    runtime, _ = bus_dirs
    with zmqsync.Publisher({"x": torch.zeros(1)}, name=name) as pub:
        assert pub.address == f"ipc://{runtime}/{name}.sock"
        assert os.stat(runtime).st_mode & 0o777 == 0o700
        assert os.stat(f"{runtime}/{name}.sock").st_mode & 0o777 == 0o600


def test_second_publisher_on_the_same_address_is_refused(name):
    with zmqsync.Publisher({"x": torch.zeros(1)}, name=name):
        with pytest.raises(zmqsync.ZmqSyncError, match="already serves"):
            zmqsync.Publisher({"x": torch.zeros(1)}, name=name).start()


def test_no_publisher_is_a_clear_connect_timeout(name):
    with pytest.raises(zmqsync.ConnectTimeout, match="no publisher answered"):
        zmqsync.Subscriber(name=name, timeout=0.3).start()


def test_tcp_loopback_address(name):
    with zmqsync.Publisher({"x": torch.zeros(3)}, "tcp://127.0.0.1:0", name=name) as pub:
        pass
    addr = "tcp://127.0.0.1:47123"
    with (
        zmqsync.Publisher({"x": torch.zeros(3)}, addr, name=name) as pub,
        zmqsync.Subscriber(addr, name=name) as sub,
    ):
        pub.publish(weights={"x": torch.ones(3)})
        assert sub.version == 1 and torch.equal(sub.weights["x"], torch.ones(3))


def test_a_relays_bus_publishes_what_lands_under_the_roots_numbers(name):
    """The relay's private seam (`Landing`): bytes written into a slot, published under
    the number the root gave them; a trainer's publish() has no such options."""
    from zmqsync._write_modes import Landing

    def fill(value: float):
        return lambda flat: flat.view(torch.float32).fill_(value)

    landing = Landing()
    with (
        zmqsync.Publisher({"x": torch.zeros(2)}, name=name, writes=landing) as pub,
        zmqsync.Subscriber(name=name) as sub,
    ):
        landing.stage(41, fill(4.0))
        assert pub.publish().version == 41 and sub.version == 41
        assert torch.equal(sub.weights["x"], torch.full((2,), 4.0))
        with pytest.raises(zmqsync.ZmqSyncError, match="stage"):
            pub.publish()  # nothing staged: a relay publishes only what it received
        landing.stage(41, fill(5.0))
        with pytest.raises(ValueError, match="not greater"):
            pub.publish()
        slot = landing.reserve()
        assert slot is not None
        landing.open(slot).view(torch.float32).fill_(6.0)  # landed long before
        landing.stage(100, lambda flat: None, slot)
        assert pub.publish().version == 100 and sub.version == 100
        assert torch.equal(sub.weights["x"], torch.full((2,), 6.0))
        with pytest.raises(ValueError, match="received"):
            landing.stage(101, fill(1.0))
            pub.publish(weights={"x": torch.ones(2)})
