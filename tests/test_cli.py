"""The `zmqsync` command: `main(argv)` in-process, and one subprocess per command for
the exit status a shell sees."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
import torch

import zmqsync
from tests.conftest import ROOT
from zmqsync.cli import main


def _run(*args: str, timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
    """`python -m zmqsync ARGS` with this test's runtime and shm dirs."""
    return subprocess.run(
        [sys.executable, "-m", "zmqsync", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=dict(os.environ),
        cwd=ROOT,
    )


def _one_line(stderr: str) -> str:
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, f"expected a one-line reason, got:\n{stderr}"
    return lines[0]


# --- in-process -------------------------------------------------------------------------


def test_gc_on_an_empty_shm_dir(bus_dirs, capsys):
    runtime, shm = bus_dirs
    assert main(["gc"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines() == [
        f"0 leaked segment(s) removed from {shm}",
        f"0 dead socket file(s) removed from {runtime}",
    ]


def test_gc_removes_an_unlocked_segment_and_says_so(bus_dirs, tmp_path, capsys):
    _, shm = bus_dirs
    leaked = shm / "zmqsync-leaked-0000000000000000-cpu"
    leaked.write_bytes(b"x")
    assert main(["gc"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[:2] == [f"removed {leaked}", f"1 leaked segment(s) removed from {shm}"]
    assert not leaked.exists()
    other = tmp_path / "other"
    other.mkdir()
    (other / "zmqsync-x").write_bytes(b"x")
    assert main(["gc", "--shm-dir", str(other)]) == 0
    assert not (other / "zmqsync-x").exists()
    assert f"1 leaked segment(s) removed from {other}" in capsys.readouterr().out.splitlines()


def test_inspect_json_reports_the_running_bus(name, capsys):
    weights = {"policy.w": torch.zeros(3, 4), "steps": torch.zeros((), dtype=torch.int64)}
    with zmqsync.Publisher(weights, name=name) as pub:
        with zmqsync.Subscriber(name=name, worker_id="w-inspect") as sub:
            pub.publish(weights={"policy.w": torch.ones(3, 4), "steps": torch.tensor(1)})
            assert sub.wait_for_version(1, timeout=10)
            assert main(["inspect", "--name", name, "--json"]) == 0
    captured = capsys.readouterr()
    assert captured.err == ""
    state = json.loads(captured.out)
    assert state["name"] == name and state["bus"] == pub.bus_id
    assert state["version"] == 1 == pub.version
    assert state["slots"] == 2 and sorted(state["slot_versions"]) == [0, 1]
    [worker] = state["workers"]
    assert worker["worker_id"] == "w-inspect"
    assert worker["pid"] == os.getpid()
    assert worker["version"] == 1 and worker["mode"] == "copy"
    manifest = {tuple(s["key"]): s for s in state["manifest"]}
    assert set(manifest) == {("policy", "w"), ("steps",)}
    assert manifest[("policy", "w")]["dtype"] == "float32"
    assert manifest[("policy", "w")]["shape"] == [3, 4]
    assert manifest[("steps",)]["dtype"] == "int64" and manifest[("steps",)]["shape"] == []
    assert all(s["offset"] % 256 == 0 for s in state["manifest"])
    [buf] = state["buffers"]
    assert buf["kind"] == "cpu" and buf["segment"].startswith(f"zmqsync-{name}-")


def test_inspect_tables_return_zero(name, capsys):
    with zmqsync.Publisher({"w": torch.zeros(2)}, name=name):
        assert main(["inspect", "--name", name]) == 0
    out = capsys.readouterr().out
    assert "manifest" in out and "workers (0)" in out


def test_inspect_without_a_publisher_fails_fast_with_one_line(name, capsys):
    start = time.monotonic()
    assert main(["inspect", "--name", name, "--timeout", "0.5"]) == 1
    assert time.monotonic() - start < 3.0
    captured = capsys.readouterr()
    assert captured.out == ""
    line = _one_line(captured.err)
    assert line.startswith("zmqsync inspect: NoSuchBus: no bus at ipc://")
    assert name in line and "(no such socket file); buses answering in " in line


def test_a_bad_bus_name_is_a_one_line_error(capsys):
    assert main(["inspect", "--name", "../etc", "--timeout", "0.5"]) == 1
    line = _one_line(capsys.readouterr().err)
    assert line.startswith("zmqsync inspect: ValueError: bus name '../etc' is not allowed")


def test_an_unsafe_runtime_dir_is_a_one_line_error(monkeypatch, tmp_path, capsys):
    unsafe = tmp_path / "shared"
    unsafe.mkdir()
    unsafe.chmod(0o777)
    monkeypatch.setenv("ZMQSYNC_RUNTIME_DIR", str(unsafe))
    assert main(["inspect", "--name", "x", "--timeout", "0.5"]) == 1
    line = _one_line(capsys.readouterr().err)
    assert line.startswith("zmqsync inspect: PermissionError: runtime dir ")
    assert "chmod 700" in line


def test_usage_errors_exit_2(capsys):
    with pytest.raises(SystemExit) as exc:
        main([])
    assert exc.value.code == 2
    with pytest.raises(SystemExit) as exc:
        main(["nope"])
    assert exc.value.code == 2
    capsys.readouterr()


# --- one subprocess per command ---------------------------------------------------------


def test_demo_subprocess_exits_zero_with_the_summary(bus_dirs):
    done = _run("demo", "--workers", "2", "--updates", "3", "--size-mb", "1", timeout=90)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "OK" in done.stdout
    assert "2 workers" in done.stdout and "copy mode" in done.stdout
    assert "mismatches" in done.stdout
    # the bus's own latency first, the verified round trip apart from it
    assert done.stdout.index(" applied │") < done.stdout.index(" verified + acked │")
    assert "all reached v4 (v0 at start, v1 a warm-up, then 3 updates)" in done.stdout


def test_worker_subprocess_without_a_publisher_exits_one(name):
    done = _run("worker", "--name", name, "--timeout", "0.5", timeout=30)
    assert done.returncode == 1
    line = _one_line(done.stderr)
    assert line.startswith("zmqsync worker: ConnectTimeout: ")
    assert "no publisher answered" in line
    assert done.stdout == ""


def test_gc_subprocess_exits_zero(bus_dirs):
    _, shm = bus_dirs
    done = _run("gc", timeout=30)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[0] == f"0 leaked segment(s) removed from {shm}"
    assert done.stderr == ""


def test_inspect_subprocess_without_a_publisher_exits_one(name):
    done = _run("inspect", "--name", name, "--timeout", "0.5", timeout=30)
    assert done.returncode == 1
    assert _one_line(done.stderr).startswith("zmqsync inspect: NoSuchBus: ")
    assert done.stdout == ""
