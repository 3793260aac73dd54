"""Fixtures that give every test its own runtime dir and shm dir, and clean up.

Each test gets a fresh ``ZMQSYNC_RUNTIME_DIR`` (short: ipc paths are limited to 107
bytes) and ``ZMQSYNC_SHM_DIR`` (a directory under /dev/shm). Subprocesses inherit both.
After the test every spawned process is killed and the shm dir must be empty: a test
that leaks a segment fails, and the segments are removed either way.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


class Proc:
    """A subprocess whose JSON stdout lines are collected by a reader thread."""

    def __init__(self, cmd: list[str], env: dict[str, str]) -> None:
        self.cmd = cmd
        self.proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT
        )
        self.records: list[dict] = []
        self.stderr = ""
        self._err_lines: list[str] = []
        self._cond = threading.Condition()
        self._out = threading.Thread(target=self._read_out, daemon=True)
        self._err = threading.Thread(target=self._read_err, daemon=True)
        self._out.start()
        self._err.start()

    def _read_out(self) -> None:
        with contextlib.suppress(ValueError):  # the pipe closed by kill()/finish(): done
            for line in self.proc.stdout:  # type: ignore[union-attr]
                line = line.strip()
                if line.startswith("{"):
                    with self._cond:
                        self.records.append(json.loads(line))
                        self._cond.notify_all()

    def _read_err(self) -> None:
        with contextlib.suppress(ValueError):  # the pipe closed by kill()/finish(): done
            for line in self.proc.stderr:  # type: ignore[union-attr]
                with self._cond:
                    self._err_lines.append(line)
        self.stderr = "".join(self._err_lines)

    def stderr_so_far(self) -> str:
        """What the process wrote on stderr until now (`stderr` holds all of it once
        the process ended)."""
        with self._cond:
            return "".join(self._err_lines)

    def wait_for(self, predicate, timeout: float = 30.0) -> dict:
        """The first record matching `predicate`, waiting at most `timeout`."""
        end = time.monotonic() + timeout
        with self._cond:
            while True:
                for rec in self.records:
                    if predicate(rec):
                        return rec
                left = end - time.monotonic()
                if left <= 0 or (self.proc.poll() is not None and not self._out.is_alive()):
                    raise AssertionError(
                        f"no matching record from {self.cmd[-4:]} (rc={self.proc.poll()}); "
                        f"records={self.records[-3:]} stderr={self.stderr[-2000:]}"
                    )
                self._cond.wait(min(left, 0.2))

    def stop(self, timeout: float = 10.0) -> None:
        """SIGSTOP, then wait until every thread is stopped: kill() only queues the
        signal, and a thread that is on a CPU at that moment runs on for a while (long
        enough, on a loaded machine, to apply and ack one more version)."""
        self.proc.send_signal(signal.SIGSTOP)
        tasks, end = f"/proc/{self.proc.pid}/task", time.monotonic() + timeout
        while time.monotonic() < end:
            states = []
            for tid in os.listdir(tasks):
                with contextlib.suppress(FileNotFoundError):
                    with open(f"{tasks}/{tid}/stat") as f:
                        states.append(f.read().rsplit(")", 1)[1].split()[0])
            if states and all(state in "tT" for state in states):
                return
            time.sleep(0.005)
        raise AssertionError(f"{self.cmd[-4:]} did not stop within {timeout} s")

    def finish(self, timeout: float = 30.0) -> int:
        try:
            rc = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise AssertionError(f"{self.cmd} did not exit within {timeout} s") from None
        self._out.join(5)
        self._err.join(5)
        return rc

    def summary(self) -> dict:
        return self.wait_for(lambda r: r.get("event") == "summary", timeout=1)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)
        self._out.join(5)
        self._err.join(5)
        for pipe in (self.proc.stdout, self.proc.stderr):
            if pipe is not None:
                pipe.close()


@pytest.fixture(autouse=True)
def bus_dirs(monkeypatch):
    """Per-test runtime and shm dirs; fail the test if a segment is left behind."""
    runtime = tempfile.mkdtemp(prefix="zs", dir="/tmp")
    shm = os.path.join("/dev/shm", f"zmqsync-test-{uuid.uuid4().hex[:12]}")
    os.makedirs(shm, mode=0o700)
    monkeypatch.setenv("ZMQSYNC_RUNTIME_DIR", runtime)
    monkeypatch.setenv("ZMQSYNC_SHM_DIR", shm)
    yield Path(runtime), Path(shm)
    leaked = deadline_listdir(shm)
    shutil.rmtree(runtime, ignore_errors=True)
    shutil.rmtree(shm, ignore_errors=True)
    assert not leaked, f"segments left in the shm dir: {leaked}"


def deadline_listdir(path: str, timeout: float = 2.0) -> list[str]:
    """What is left in `path`, allowing a moment for exiting processes to finish."""
    end = time.monotonic() + timeout
    while (left := os.listdir(path)) and time.monotonic() < end:
        time.sleep(0.05)
    return left


@pytest.fixture
def ctx():
    """A ZeroMQ context for the test's own sockets, destroyed after it."""
    import zmq

    context = zmq.Context()
    yield context
    context.destroy(linger=0)


@pytest.fixture
def burners():
    """start(n, seconds) -> CPU-bound processes, all killed after the test: a saturated
    host is the normal case for our users (see `tests.helpers.load.Burners`)."""
    from tests.helpers.load import Burners  # it imports this module

    with Burners() as procs:
        yield procs.start


@pytest.fixture
def name() -> str:
    return f"t{uuid.uuid4().hex[:8]}"


@pytest.fixture
def spawn():
    """Start subprocesses (killed at teardown): spawn(args...) -> Proc."""
    procs: list[Proc] = []

    def _spawn(*args: str, module: str = "zmqsync") -> Proc:
        cmd = [sys.executable, "-m", module, *args] if module else [sys.executable, *args]
        proc = Proc(cmd, dict(os.environ))
        procs.append(proc)
        return proc

    yield _spawn
    for proc in procs:
        proc.kill()


@pytest.fixture(autouse=True)
def no_leaked_threads():
    yield
    end = time.monotonic() + 5
    while time.monotonic() < end:
        alive = [t.name for t in threading.enumerate() if t.name.startswith("zmqsync-")]
        if not alive:
            return
        time.sleep(0.05)
    raise AssertionError(f"zmqsync threads still alive after the test: {alive}")
