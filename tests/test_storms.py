"""Honest workers join, and stay, while other processes storm the publisher's sockets.

Real processes throughout: a publisher (tests/helpers/victim.py), a storm
(tools/bench/storms.py: connect and close in a loop, or whole handshakes), and
workers that time their own join (tests/helpers/joiner.py) started during the storm.
Without per-peer limits one storming process spent the allowance of every peer: 1 of 4
workers got in within 10 s. See docs/security.md ("Connection storms").
"""

from __future__ import annotations

import signal
import socket
import statistics
import time
from pathlib import Path

import pytest

from zmqsync._deadline import Deadline
from zmqsync._protocol import Inspect, State
from zmqsync._security import client_from_env
from zmqsync._sockets import request

pytestmark = pytest.mark.timeout(180)

VICTIM, JOINER = "tests/helpers/victim.py", "tests/helpers/joiner.py"
STORM = "tools/bench/storms.py"
JOIN_DEADLINE_S = 10.0  # what each worker allows itself (the default Subscriber timeout)
# Connections a second per peer (and HELLOs a second): low, so that a storm spends any
# shared allowance at once, however fast this host lets it connect (loopback tcp here
# takes a few hundred connections a second, ipc tens of thousands).
RATE = "20"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _victim(spawn, name, *extra):
    victim = spawn(
        VICTIM,
        name,
        "--data-mb",
        "1024",
        "--interval",
        "0.1",
        "--handshake-rate",
        RATE,
        *extra,
        module="",
    )
    started = victim.wait_for(lambda r: r.get("event") == "started", timeout=60)
    return victim, started["address"]


def _state(ctx, address, name) -> State:
    keys = client_from_env(name)
    secure = keys.apply if keys is not None else None
    reply = request(ctx, address, Inspect(""), deadline=Deadline(10), secure=secure)
    assert isinstance(reply, State), reply
    return reply


def _end(victim) -> None:
    victim.proc.send_signal(signal.SIGTERM)
    rc = victim.finish(timeout=30)
    assert rc == 0, f"the publisher died (rc {rc}): {victim.stderr[-3000:]}"


def _storm(spawn, endpoint, mode="raw", seconds=60.0):
    storm = spawn(STORM, endpoint, "--mode", mode, "--seconds", str(seconds), module="")
    time.sleep(1.0)  # let it reach full speed (the storm's own ramp, not a synchronisation)
    assert storm.proc.poll() is None, f"the storm did not start: {storm.stderr[-2000:]}"
    return storm


def _join_during(spawn, tmp_path: Path, address, name, workers=4) -> list[dict]:
    """Start `workers` joiners at once; what each reported (joined, then heard)."""
    go = tmp_path / f"go-{time.monotonic_ns()}"
    joiners = [
        spawn(
            JOINER,
            address,
            "--name",
            name,
            "--go",
            str(go),
            "--timeout",
            str(JOIN_DEADLINE_S),
            module="",
        )
        for _ in range(workers)
    ]
    for joiner in joiners:
        joiner.wait_for(lambda r: r.get("event") == "ready", timeout=60)
    go.touch()
    results = []
    for joiner in joiners:
        last = joiner.wait_for(lambda r: r.get("event") in ("heard", "deaf", "timeout"), timeout=60)
        joined = [r for r in joiner.records if r.get("event") == "joined"]
        results.append({"last": last, "joined": joined[0]["seconds"] if joined else None})
    return results


def _assert_all_joined(results):
    """Every worker got in within its own deadline (JOIN_DEADLINE_S: else ConnectTimeout)
    and then heard new versions. How long each took is not asserted: on a loaded host a
    join takes seconds with no storm at all (tools/bench/joins/storm.py has the figures)."""
    failed = [r["last"] for r in results if r["last"]["event"] != "heard"]
    assert not failed, f"{len(failed)} of {len(results)} workers did not get in: {failed}"
    times = sorted(r["joined"] for r in results)
    return statistics.median(times), times[-1]


@pytest.mark.parametrize("transport", ["ipc", "ipc-curve", "tcp", "tcp-curve"])
def test_workers_join_during_a_connect_storm_on_the_events_socket(
    ctx, spawn, name, tmp_path, transport
):
    """With CURVE the storm has no keys: its connections never get past the handshake,
    and must cost the workers nothing."""
    extra = ["--address", f"tcp://127.0.0.1:{_free_port()}"] if "tcp" in transport else []
    if "curve" in transport:
        extra.append("--curve")
    victim, address = _victim(spawn, name, *extra)
    storm = _storm(spawn, _state(ctx, address, name).events)
    results = _join_during(spawn, tmp_path, address, name)
    assert storm.proc.poll() is None, "the storm ended before the workers joined"
    _assert_all_joined(results)
    storm.kill()
    _end(victim)


def test_workers_join_during_a_storm_on_a_saturated_host(ctx, spawn, name, tmp_path, burners):
    burners(2, 300)  # both cores busy for the whole test (ended with it)
    victim, address = _victim(spawn, name)
    storm = _storm(spawn, _state(ctx, address, name).events)
    _assert_all_joined(_join_during(spawn, tmp_path, address, name))
    storm.kill()
    _end(victim)


def test_a_handshaking_storm_from_one_process_costs_other_processes_nothing(
    ctx, spawn, name, tmp_path
):
    """Every connection of this storm completes its greeting, so the publisher's rate
    limit sees each one: its process is held to its own rate, the workers are not."""
    victim, address = _victim(spawn, name)
    storm = _storm(spawn, _state(ctx, address, name).events, mode="zmtp")
    _assert_all_joined(_join_during(spawn, tmp_path, address, name))
    refused = _state(ctx, address, name).counters.get("refused_connections", 0)
    assert refused > 0, "the storm was never held to its rate"
    storm.kill()
    _end(victim)


def test_a_sniffer_sees_the_bus_during_a_connect_storm_on_the_tap(ctx, spawn, name):
    victim, address = _victim(spawn, name, "--tap")
    storm = _storm(spawn, _state(ctx, address, name).tap)
    start = time.monotonic()
    sniffer = spawn("sniff", address, "--name", name, "--json", "--count", "3", "--timeout", "10")
    sniffer.wait_for(lambda r: "type" in r, timeout=30)
    first = time.monotonic() - start
    assert sniffer.finish(timeout=30) == 0, sniffer.stderr[-2000:]
    assert first < 8.0, f"the sniffer's first message came after {first:.1f} s"
    storm.kill()
    _end(victim)


# --- the file descriptor limit ----------------------------------------------------------


def test_a_descriptor_limit_too_small_for_a_bus_is_an_error_at_start(spawn, name, bus_dirs):
    """Under a hard `ulimit -n 64` the budget's floor was above the limit, and a storm
    then took the last descriptor: libzmq's SIGABRT."""
    runtime, _ = bus_dirs
    storm = spawn(STORM, f"ipc://{runtime}/{name}.sock.events", "--seconds", "20", module="")
    victim = spawn(VICTIM, name, "--nofile", "64", "64", "--interval", "0.1", module="")
    rc = victim.finish(timeout=60)
    storm.kill()
    assert rc != -signal.SIGABRT, f"libzmq aborted the publisher: {victim.stderr[-2000:]}"
    assert rc == 1, f"rc {rc}, records {victim.records}: {victim.stderr[-2000:]}"
    assert "FdLimitTooLow" in victim.stderr and "ulimit -n" in victim.stderr
    assert not [r for r in victim.records if r.get("event") == "started"]


def test_a_small_descriptor_limit_and_a_connect_storm_leave_the_bus_running(
    ctx, spawn, name, tmp_path
):
    victim, address = _victim(spawn, name, "--nofile", "256", "256")
    events = f"{address}.events"
    storms = [_storm(spawn, events), _storm(spawn, events, mode="hold")]
    _assert_all_joined(_join_during(spawn, tmp_path, address, name, workers=2))
    for storm in storms:
        storm.kill()
    _end(victim)
