"""Bounded staleness: ``publish(max_lag=k)`` returns once every live worker applied at
least ``version - k``; lag is visible on both sides.

The bus tests run real worker processes of different speeds (the rollout workers of
tools/bench/staleness.py: they take the newest version at the start of each rollout,
apply="manual") and check the bound against the workers' own records: each worker stamps
``time.monotonic()`` when it applies a version, before it acks, and the test stamps the
moment each publish returned; CLOCK_MONOTONIC is one clock for the whole host.
"""

from __future__ import annotations

import bisect
import signal
import time

import pytest
import torch

import zmqsync
from zmqsync._protocol import Hello
from zmqsync._registry import Registry

TOOL = "tools/bench/staleness.py"
WEIGHTS = {"w": torch.zeros(256)}


def _hello(worker_id: str, mode: str = "copy") -> Hello:
    return Hello("", worker_id, 1, "h", mode, "cpu", "", "n-" + worker_id)


# --- the registry's view (no I/O) ---------------------------------------------------------


def test_lag_counts_versions_behind_the_latest_from_the_acks():
    reg = Registry(slots=4)
    reg.record(0, 0)
    fast, slow = reg.join(_hello("fast"), "s1", 0.0), reg.join(_hello("slow"), "s2", 0.0)
    for v in (1, 2, 3):
        reg.record(v, v)
    reg.ack("fast", fast.session, 3, 1.0)
    reg.ack("slow", slow.session, 1, 1.0)
    infos = reg.infos(0.0)
    assert (infos["fast"].lag, infos["slow"].lag) == (0, 2)
    assert reg.lags(3, reg.meant(["fast", "slow"])) == {"fast": 0, "slow": 2}
    assert reg.lags(2, reg.meant(["fast", "slow"])) == {"fast": 0, "slow": 1}


def test_a_worker_not_acked_yet_has_no_lag_but_counts_as_behind_for_a_publish():
    reg = Registry(slots=2)
    reg.record(4, 0)
    reg.join(_hello("new"), "s", 0.0)  # welcomed at 4, applying it
    assert reg.infos(0.0)["new"].lag is None  # not known before its first ack
    assert reg.lags(4, reg.meant(["new"])) == {"new": 1}  # a publish counts it behind
    assert not reg.alias_readers()
    reg.join(_hello("a", mode="alias"), "s2", 0.0)
    assert reg.alias_readers()


# --- what a publish may be asked ----------------------------------------------------------


def test_a_bound_the_slots_cannot_hold_is_refused(name):
    with zmqsync.Publisher(WEIGHTS, name=name, slots=2, timeout=30) as pub:
        with pytest.raises(ValueError, match=r"max_lag=2 needs slots >= 3"):
            pub.publish(max_lag=2)
        with pytest.raises(ValueError, match="int >= 0"):
            pub.publish(max_lag=True)  # a bool is no bound
        with pytest.raises(ValueError, match="int >= 0"):
            pub.publish(max_lag=-1)
        assert pub.version == 0  # nothing was published
        p = pub.publish(max_lag=1)
        assert (p.version, p.max_lag) == (1, 1)
        assert pub.publish(max_lag=None).max_lag is None
        assert pub.publish().max_lag == 0


def test_live_writes_have_no_slot_to_wait_for(name):
    with zmqsync.Publisher(
        {"w": torch.zeros(8)}, name=name, writes=zmqsync.Live(), timeout=30
    ) as pub:
        assert pub.publish(max_lag=5).max_lag == 5


def test_alias_workers_pin_a_slot_and_tighten_the_bound(name):
    with zmqsync.Publisher(WEIGHTS, name=name, slots=3, timeout=30) as pub:
        with zmqsync.Subscriber(name=name, worker_id="c", timeout=30):
            assert pub.publish(max_lag=2).max_lag == 2
        with zmqsync.Subscriber(name=name, worker_id="a", reads=zmqsync.Aliases(), timeout=30):
            p = pub.publish(max_lag=2)
            assert p.max_lag == 1  # slots - 2: the next claim still finds a free slot
            assert p.lags["a"] <= 1


def test_sub_lag_counts_what_a_manual_worker_has_not_polled_yet(name):
    with (
        zmqsync.Publisher(WEIGHTS, name=name, slots=4, timeout=30) as pub,
        zmqsync.Subscriber(
            name=name, worker_id="m", reads=zmqsync.Copies(manual=True), timeout=30
        ) as sub,
    ):
        assert sub.lag == 0
        for _ in range(3):
            pub.publish(max_lag=None)
        assert (sub.version, sub.lag) == (0, 3)
        # poll() applies the newest version whose RECEIVE the worker has read; the header
        # may name one whose RECEIVE is still on its way (a loaded host): poll again
        deadline = time.monotonic() + 10
        while sub.version < 3 and time.monotonic() < deadline:
            sub.poll(timeout=1)
        assert (sub.version, sub.lag) == (3, 0)


def test_a_worker_stuck_beyond_the_bound_is_named_in_time(name):
    with (
        zmqsync.Publisher(WEIGHTS, name=name, slots=4, timeout=1.0) as pub,
        zmqsync.Subscriber(
            name=name, worker_id="stuck", reads=zmqsync.Copies(manual=True), timeout=30
        ) as sub,
    ):
        pub.publish(max_lag=2)
        pub.publish(max_lag=2)
        t0 = time.monotonic()
        with pytest.raises(zmqsync.PublishTimeout, match="did not apply v1") as info:
            pub.publish(max_lag=2)
        assert time.monotonic() - t0 < 1.0 + 2.0
        assert info.value.version == 3 and info.value.missing == ("stuck",)
        assert pub.workers["stuck"].lag == 3
        assert sub.poll(timeout=10) and sub.version == 3


# --- real workers of different speeds -----------------------------------------------------


def _start(spawn, name: str, pub: zmqsync.Publisher, steps: dict[str, float]) -> dict:
    workers = {
        w: spawn(TOOL, "--worker", name, w, str(step), "--records", module="")
        for w, step in steps.items()
    }
    assert pub.wait_for_workers(len(workers), timeout=60)
    for proc in workers.values():
        proc.wait_for(lambda r: r.get("event") == "joined", timeout=60)
    return workers


def _applied_at(proc, t: float) -> int:
    """The newest version the worker had applied at monotonic time `t`, by its records."""
    records = [r for r in proc.records if r.get("event") == "applied"]
    times = [r["t"] for r in records]
    i = bisect.bisect_right(times, t)
    return max((r["version"] for r in records[:i]), default=-1)


def _run_bounded(spawn, name: str, k: int, publishes: int) -> list[dict[str, int]]:
    """`publishes` publishes with max_lag=k to a fast and a slow worker; each one's lag
    at every return, after checking the bound against the workers' own records."""
    with zmqsync.Publisher(WEIGHTS, name=name, slots=k + 1, timeout=30) as pub:
        workers = _start(spawn, name, pub, {"fast": 0.002, "slow": 0.08})
        returned, seen = [], []
        for v in range(1, publishes + 1):
            p = pub.publish({"w": torch.full((256,), float(v))}, max_lag=k)
            returned.append((v, time.monotonic()))
            seen.append(p.lags)
            assert p.max_lag == k and all(lag <= k for lag in p.lags.values()), p.lags
        for proc in workers.values():
            proc.wait_for(lambda r: r.get("version") == publishes, timeout=30)
            proc.proc.send_signal(signal.SIGTERM)
        for proc in workers.values():
            assert proc.finish() == 0, proc.stderr
    for worker_id, proc in workers.items():
        behind = [v - _applied_at(proc, t) for v, t in returned]
        assert max(behind) <= k, (worker_id, behind)
    return seen


@pytest.mark.parametrize("k", [0, 1, 2])
def test_at_every_return_no_worker_is_more_than_k_behind(spawn, name, k):
    seen = _run_bounded(spawn, name, k, publishes=24)
    if k:  # the bound was the limit, not idle: the slow worker ran k behind
        assert max(lags["slow"] for lags in seen) == k


def test_the_bound_holds_on_a_saturated_host(spawn, name, burners):
    burners(4, 120)  # both cores busy: the workers' apply and acks come late
    _run_bounded(spawn, name, 1, publishes=16)


def test_a_worker_killed_mid_run_does_not_hang_the_bound(spawn, name):
    with zmqsync.Publisher(WEIGHTS, name=name, slots=3, heartbeat=0.1, timeout=30) as pub:
        workers = _start(spawn, name, pub, {"fast": 0.002, "victim": 0.03})
        for _ in range(5):
            pub.publish(max_lag=2)
        workers["victim"].proc.kill()
        t0 = time.monotonic()
        for _ in range(10):  # raise on timeout: only the drop of the dead worker lets these go
            p = pub.publish(max_lag=2)
        assert time.monotonic() - t0 < 15, "the bound waited for a dead worker"
        assert "victim" not in pub.workers and p.lags.keys() == {"fast"}
        workers["fast"].proc.send_signal(signal.SIGTERM)
        assert workers["fast"].finish() == 0


# --- what inspect and sniff show ----------------------------------------------------------


def test_inspect_shows_each_workers_lag(name, capsys):
    import json

    from zmqsync.cli import main

    with (
        zmqsync.Publisher(WEIGHTS, name=name, slots=4, timeout=30) as pub,
        zmqsync.Subscriber(
            name=name, worker_id="behind", reads=zmqsync.Copies(manual=True), timeout=30
        ),
        zmqsync.Subscriber(name=name, worker_id="current", timeout=30) as current,
    ):
        for _ in range(2):
            pub.publish(max_lag=None)
        assert current.wait_for_version(2, timeout=10)
        deadline = time.monotonic() + 10  # the acks of the start reach the publisher
        while pub.workers["current"].lag != 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert {w: i.lag for w, i in pub.workers.items()} == {"behind": 2, "current": 0}
        assert main(["inspect", "--name", name, "--json"]) == 0
        lags = {w["worker_id"]: w["lag"] for w in json.loads(capsys.readouterr().out)["workers"]}
        assert lags == {"behind": 2, "current": 0}
        assert main(["inspect", "--name", name]) == 0
        table = capsys.readouterr().out
        assert "lag" in table and "behind" in table


def test_sniff_summary_counts_lag_as_each_version_is_announced():
    from zmqsync._protocol import Ack, Receive
    from zmqsync._sniff import Record, Summary

    summary = Summary({"fast", "slow"})
    bus = "ab" * 8

    def feed(msg, peer=""):
        return summary.add(Record(0.0, "in" if peer else "out", peer, msg))

    for v in (1, 2, 3):
        feed(Receive(bus, v, v, 0))
        feed(Ack(bus, "fast", "s", v), "fast")
        if v == 1:
            feed(Ack(bus, "slow", "s", v), "slow")
    assert summary.lags() == {"fast": 0, "slow": 2}
    line = feed(Receive(bus, 4, 4, 0))
    assert line is not None and "slow 3/2" in line  # now 3 behind v4; 2 when v4 went out
    assert "slow 3/2" in summary.final() and "fast 1/0" in summary.final()


# --- the tool that shows it ---------------------------------------------------------------


@pytest.mark.timeout(240)
def test_the_staleness_tool_runs_and_holds_its_bound(tmp_path, capsys):
    import importlib.util
    import json
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "tools" / "bench" / "staleness.py"
    spec = importlib.util.spec_from_file_location("staleness_tool", path)
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    out = tmp_path / "staleness.json"
    assert tool.main(["--bounds", "1", "none", "--steps", "12", "--json", str(out)]) == 0
    table = capsys.readouterr().out
    assert table.startswith("| max_lag | trainer steps/s |")
    runs = {r["max_lag"]: r for r in json.loads(out.read_text())["runs"]}
    assert set(runs) == {"1", "none"}
    assert max(runs["1"]["max_lag_seen"].values()) <= 1
    assert all(len(r["samples"]) == 12 for r in runs.values())
