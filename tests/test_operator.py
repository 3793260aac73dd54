"""The operator's view of a bus, with real processes: who counts as joined and what the
trainer logs about it, Ctrl-C in the middle of a publish, a worker started before its
trainer."""

from __future__ import annotations

import logging
import os
import signal
import time

import pytest
import torch

import zmqsync


def _wait_until(predicate, timeout: float, what: str) -> None:
    end = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > end:
            raise AssertionError(f"not within {timeout} s: {what}")
        time.sleep(0.02)


def _lines(caplog, level: int, text: str) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.levelno == level and r.name.startswith("zmqsync") and text in r.getMessage()
    ]


@pytest.mark.timeout(180)
def test_a_worker_that_cannot_apply_never_counts_and_the_trainer_says_so(name, spawn, caplog):
    caplog.set_level(logging.INFO, logger="zmqsync")
    with zmqsync.Publisher(torch.nn.Linear(16, 8), name=name) as pub:
        bad = spawn("tests/helpers/shaped_worker.py", name, "32", module="")
        bad.wait_for(lambda r: r["event"] == "mismatch", timeout=90)
        assert bad.finish() == 3
        # it was welcomed, then failed to apply: never counted, and a warning says so
        assert not pub.wait_for_workers(1, timeout=0.5)
        _wait_until(
            lambda: _lines(caplog, logging.WARNING, "left without applying a version"),
            10,
            "a warning that the worker left without applying",
        )
        assert not pub.workers
        assert _lines(caplog, logging.INFO, "joined")  # its join was logged, at INFO

        good = spawn("tests/helpers/shaped_worker.py", name, "16", module="")
        assert pub.wait_for_workers(1, timeout=90)
        good.wait_for(lambda r: r["event"] == "joined", timeout=30)
        (info,) = pub.workers.values()
        assert info.version >= 0
        assert pub.publish().acked == (info.worker_id,)
    good.wait_for(lambda r: r["event"] == "stopped", timeout=30)
    assert good.finish() == 0
    assert _lines(caplog, logging.INFO, f"worker {info.worker_id} left")


@pytest.mark.timeout(60)
def test_a_refused_worker_is_a_warning(name, caplog):
    caplog.set_level(logging.INFO, logger="zmqsync")
    security = zmqsync.Security(max_workers=1)
    model = torch.nn.Linear(4, 2)
    with zmqsync.Publisher(model, name=name, security=security) as pub:
        with zmqsync.Subscriber(name=name, model=torch.nn.Linear(4, 2), timeout=20):
            assert pub.wait_for_workers(1, timeout=20)
            extra = zmqsync.Subscriber(name=name, model=torch.nn.Linear(4, 2), timeout=1)
            with pytest.raises((zmqsync.ProtocolError, zmqsync.ConnectTimeout)):
                extra.start()
            extra.close()
    (line, *_) = _lines(caplog, logging.WARNING, "refused: bus full")
    assert line.startswith(f"worker {extra.worker_id} refused")


@pytest.mark.timeout(180)
def test_sigint_during_a_publish_leaves_nothing_and_stops_a_busy_worker_at_once(
    name, spawn, bus_dirs
):
    runtime, shm = bus_dirs
    # the worker spends 20 s in on_update of every version after its first
    worker = spawn("tests/helpers/shaped_worker.py", name, "16", "20", module="")
    trainer = spawn("tests/helpers/loop_trainer.py", name, module="")
    trainer.wait_for(lambda r: r["event"] == "ready", timeout=90)
    worker.wait_for(lambda r: r["event"] == "busy" and r["version"] >= 1, timeout=60)
    trainer.wait_for(lambda r: r["event"] == "publishing" and r["version"] >= 1, timeout=5)
    # the trainer is inside publish(), waiting for the ack of a worker inside on_update
    interrupted = time.time()
    trainer.proc.send_signal(signal.SIGINT)
    assert trainer.finish(timeout=30) != 0  # a plain script: KeyboardInterrupt
    assert "KeyboardInterrupt" in trainer.stderr
    assert os.listdir(runtime) == []  # no socket file (control, events, acks) left
    assert os.listdir(shm) == []
    stopped = worker.wait_for(lambda r: r["event"] == "stopped", timeout=30)
    # told within a heartbeat or two (0.5 s each), though on_update has 15 s to go
    assert stopped["ts"] - interrupted < 2.0, stopped
    assert stopped["connected"] is False
    worker.kill()


@pytest.mark.timeout(60)
def test_a_worker_started_before_its_trainer_says_it_waits(name, caplog):
    caplog.set_level(logging.INFO, logger="zmqsync")
    sub = zmqsync.Subscriber(name=name, timeout=1.5)
    with pytest.raises(zmqsync.ConnectTimeout):
        sub.start()
    sub.close()
    (line,) = _lines(caplog, logging.INFO, "waiting for bus")
    assert line == f"waiting for bus {name!r} at {sub.address} up to 1.5 s"


@pytest.mark.timeout(60)
def test_a_worker_that_finds_its_trainer_says_nothing_about_waiting(name, caplog):
    caplog.set_level(logging.INFO, logger="zmqsync")
    with zmqsync.Publisher(torch.nn.Linear(4, 2), name=name):
        with zmqsync.Subscriber(name=name, model=torch.nn.Linear(4, 2), timeout=20):
            pass
    assert not _lines(caplog, logging.INFO, "waiting for bus")


@pytest.mark.timeout(120)
def test_the_cli_worker_shows_that_it_waits_then_joins(name, spawn):
    worker = spawn("worker", "--name", name, "--json", "--timeout", "60")
    end = time.monotonic() + 60
    while "waiting for bus" not in worker.stderr_so_far() and time.monotonic() < end:
        time.sleep(0.05)
    assert f"waiting for bus {name!r} at " in worker.stderr_so_far()
    assert "up to 60 s" in worker.stderr_so_far()
    with zmqsync.Publisher(torch.nn.Linear(4, 2), name=name):
        worker.wait_for(lambda r: r["event"] == "joined", timeout=60)
    assert worker.finish() == 0
    assert worker.stderr.count("waiting for bus") == 1
