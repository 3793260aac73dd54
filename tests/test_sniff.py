"""The sniffer and inspect against a real bus: publisher, workers and sniffer are processes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import torch

import zmqsync
from zmqsync.cli import main


def _trainer(spawn, name, *args):
    return spawn("tools/trainer.py", name, "--tap", *args, module="")


def _sniffer(spawn, name, *args):
    return spawn("sniff", "--name", name, "--json", *args)


def _ready(proc):
    return proc.wait_for(lambda r: r.get("event") == "started", timeout=60)


def test_sniffer_sees_every_receive_ack_and_stop(spawn, name):
    trainer = _trainer(spawn, name, "--updates", "6", "--interval", "0.3", "--wait-workers", "2")
    _ready(trainer)
    sniffer = _sniffer(spawn, name, "--duration", "60")
    # The sniffer subscribes before the workers join: it sees their HELLOs too.
    sniffer.wait_for(lambda r: r.get("type") == "heartbeat", timeout=30)
    workers = [
        spawn("worker", "--name", name, "--verify", "--json", "--worker-id", f"sw{i}")
        for i in range(2)
    ]
    trainer.wait_for(lambda r: r.get("event") == "done", timeout=90)
    assert trainer.finish() == 0
    for w in workers:
        assert w.finish() == 0
    sniffer.wait_for(lambda r: r.get("type") == "stop" and not r.get("session"), timeout=30)
    sniffer.kill()
    recs = sniffer.records
    receives = {r["version"] for r in recs if r["type"] == "receive" and r["dir"] == "out"}
    assert set(range(1, 7)) <= receives
    for wid in ("sw0", "sw1"):
        acked = {r["version"] for r in recs if r["type"] == "ack" and r["peer"] == wid}
        assert set(range(1, 7)) <= acked, f"{wid} acks missing: {sorted(acked)}"
        assert any(r["type"] == "hello" and r["worker_id"] == wid for r in recs)
    assert all({"ts", "dir", "type", "peer"} <= set(r) for r in recs)
    welcome = next(r for r in recs if r["type"] == "welcome")
    assert "manifest" not in welcome and welcome["tensors"] > 0
    assert all("handle" not in b for b in welcome["buffers"])


def test_stopped_sniffer_does_not_delay_the_bus(spawn, name):
    trainer = _trainer(spawn, name, "--updates", "0", "--timeout", "5", "--on-timeout", "raise")
    _ready(trainer)
    worker = spawn("worker", "--name", name, "--worker-id", "busy", "--json")
    worker.wait_for(lambda r: r.get("event") == "applied", timeout=60)
    sniffer = _sniffer(spawn, name, "--duration", "120")
    sniffer.wait_for(lambda r: r.get("type") in ("receive", "ack"), timeout=30)
    os.kill(sniffer.proc.pid, signal.SIGSTOP)
    try:
        # ~3 tap frames per publish and a tap high-water mark of 1000: it must overflow.
        start = len([r for r in trainer.records if r.get("event") == "published"])
        trainer.wait_for(
            lambda r: r.get("event") == "published" and r["version"] > start + 1500, timeout=90
        )
        state = _inspect_json(name)
        assert state["counters"].get("tap_dropped", 0) > 0
        assert not [r for r in trainer.records if r.get("event") == "timeout"]
    finally:
        os.kill(sniffer.proc.pid, signal.SIGCONT)
    # Killing the sniffer and starting a new one does not disturb the bus either.
    sniffer.kill()
    before = _inspect_json(name)["version"]
    again = _sniffer(spawn, name, "--duration", "30", "--type", "receive")
    seen = again.wait_for(lambda r: r.get("type") == "receive", timeout=30)
    assert seen["version"] > before
    os.kill(trainer.proc.pid, signal.SIGTERM)
    assert trainer.finish() == 0
    assert not [r for r in trainer.records if r.get("event") == "timeout"]
    assert worker.finish() == 0


def _inspect_json(name):
    out = subprocess.run(
        [sys.executable, "-m", "zmqsync", "inspect", "--name", name, "--json"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_record_then_replay_gives_the_same_lines(spawn, name, tmp_path):
    recording = tmp_path / "bus.rec"
    trainer = _trainer(spawn, name, "--updates", "5", "--interval", "0.2", "--wait-workers", "1")
    _ready(trainer)
    sniffer = _sniffer(spawn, name, "--duration", "60", "--record", str(recording))
    sniffer.wait_for(lambda r: r.get("type") == "heartbeat", timeout=30)
    worker = spawn("worker", "--name", name, "--json")
    assert trainer.finish(90) == 0 and worker.finish() == 0
    sniffer.wait_for(lambda r: r.get("type") == "stop", timeout=30)
    os.kill(sniffer.proc.pid, signal.SIGINT)
    sniffer.finish()
    live = [json.dumps(r) for r in sniffer.records]
    replay = subprocess.run(
        [sys.executable, "-m", "zmqsync", "sniff", "--replay", str(recording), "--json"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert replay.returncode == 0, replay.stderr
    replayed = replay.stdout.splitlines()
    assert len(replayed) >= len(live) > 10
    assert replayed[: len(live)] == live


def test_without_tap_sniff_falls_back_to_events(name, capsys):
    with zmqsync.Publisher({"x": torch.zeros(3)}, name=name, heartbeat=0.05) as pub:
        pub.publish()
        assert main(["sniff", "--name", name, "--json", "--count", "2"]) == 0
    out, err = capsys.readouterr()
    assert "no tap" in err
    lines = [json.loads(line) for line in out.splitlines()]
    assert len(lines) == 2 and all(r["type"] == "heartbeat" for r in lines)
    # it sees no acks, so it claims no version was fully acked
    assert "(acks not visible without a tap)" in err.splitlines()[-1], err


def test_inspect_json_matches_the_bus(name, capsys):
    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.BatchNorm1d(2))
    with (
        zmqsync.Publisher(model, name=name, security=zmqsync.Security(tap=True)) as pub,
        zmqsync.Subscriber(name=name, worker_id="insp-a", reads=zmqsync.Aliases()),
    ):
        pub.publish()
        pub.publish()
        assert main(["inspect", "--name", name, "--json"]) == 0
        state = json.loads(capsys.readouterr().out)
        assert state["version"] == 2 and state["name"] == name
        assert [w["worker_id"] for w in state["workers"]] == ["insp-a"]
        assert state["workers"][0]["version"] == 2 and state["workers"][0]["mode"] == "alias"
        names = {".".join(t["key"]) for t in state["manifest"]}
        assert names == {
            "0.weight",
            "0.bias",
            "1.weight",
            "1.bias",
            "1.running_mean",
            "1.running_var",
            "1.num_batches_tracked",
        }
        assert state["counters"]["publishes"] == 2 and state["counters"]["acks"] >= 3
        assert sorted(state["slot_versions"]) == [1, 2] and state["tap"]
        assert main(["inspect", "--name", name]) == 0
        table = capsys.readouterr().out
        assert "insp-a" in table and "running_mean" in table


def test_sniff_waits_for_the_publisher_and_exits_when_the_bus_closes(spawn, name):
    sniffer = spawn(
        "sniff",
        "--name",
        name,
        "--json",
        "--wait",
        "--timeout",
        "60",
        "--exit-on-stop",
        "--type",
        "receive",
        "--type",
        "stop",
    )
    trainer = _trainer(spawn, name, "--updates", "3", "--interval", "0.2")
    assert trainer.finish(90) == 0
    assert sniffer.finish(60) == 0
    types = [r["type"] for r in sniffer.records]
    assert types[-1] == "stop" and "receive" in types
