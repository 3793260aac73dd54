"""The operator's view of a bus, with real processes: who counts as joined and what the
trainer logs about it, Ctrl-C in the middle of a publish, a worker started before its
trainer."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

import zmqsync
from tests.conftest import ROOT, deadline_listdir


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


@pytest.mark.timeout(180)
def test_sigterm_to_a_plain_trainer_script_closes_its_bus_too(name, spawn, bus_dirs):
    # docker stop, kill: SIGTERM's default action ends Python without unwinding; the
    # first zmqsync object started makes it raise SystemExit(143) instead (_lifecycle)
    runtime, shm = bus_dirs
    worker = spawn("tests/helpers/shaped_worker.py", name, "16", "20", module="")
    trainer = spawn("tests/helpers/loop_trainer.py", name, module="")
    trainer.wait_for(lambda r: r["event"] == "ready", timeout=90)
    worker.wait_for(lambda r: r["event"] == "busy" and r["version"] >= 1, timeout=60)
    terminated = time.time()
    trainer.proc.send_signal(signal.SIGTERM)
    assert trainer.finish(timeout=30) == 143, trainer.stderr[-2000:]
    assert os.listdir(runtime) == [] and os.listdir(shm) == []
    stopped = worker.wait_for(lambda r: r["event"] == "stopped", timeout=30)
    assert stopped["ts"] - terminated < 2.0, stopped
    worker.kill()


def test_a_forked_child_of_a_trainer_still_dies_of_sigterm(name):
    with zmqsync.Publisher({"w": torch.zeros(4)}, name=name):
        pid = os.fork()
        if pid == 0:  # the child: wait to be terminated
            time.sleep(30)
            os._exit(0)
        time.sleep(0.5)  # past the child's after-fork reset (a signal before it is lost)
        os.kill(pid, signal.SIGTERM)
        _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGTERM


@pytest.mark.timeout(180)
@pytest.mark.parametrize("pause", [0.1, 0.3])
def test_a_second_sigint_during_the_close_leaves_nothing_either(name, spawn, bus_dirs, pause):
    runtime, shm = bus_dirs
    worker = spawn("tests/helpers/shaped_worker.py", name, "16", "0.5", module="")
    trainer = spawn("tests/helpers/loop_trainer.py", name, module="")
    trainer.wait_for(lambda r: r["event"] == "ready", timeout=90)
    trainer.wait_for(lambda r: r["event"] == "publishing" and r["version"] >= 2, timeout=30)
    trainer.proc.send_signal(signal.SIGINT)
    time.sleep(pause)  # the second Ctrl-C of an impatient operator, while the close runs
    trainer.proc.send_signal(signal.SIGINT)
    assert trainer.finish(timeout=30) != 0
    assert os.listdir(runtime) == []
    assert os.listdir(shm) == []
    worker.wait_for(lambda r: r["event"] == "stopped", timeout=30)


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


# --- every command exits 130 after SIGINT, 143 after SIGTERM --------------------------------


class _Command:
    """`python -m zmqsync ARGS` in a process group of its own, every output line kept."""

    def __init__(self, *args: str, cwd=ROOT) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "zmqsync", *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=cwd,
            env=dict(os.environ),
            start_new_session=True,  # its workers too are ended by `kill`
        )
        self._lines: list[str] = []
        self._lock = threading.Lock()
        self._readers = [
            threading.Thread(target=self._read, args=(pipe,), daemon=True)
            for pipe in (self.proc.stdout, self.proc.stderr)
        ]
        for reader in self._readers:
            reader.start()

    def _read(self, pipe) -> None:
        for line in pipe:
            with self._lock:
                self._lines.append(line)

    @property
    def output(self) -> str:
        with self._lock:
            return "".join(self._lines)

    def wait_for(self, text: str, timeout: float = 90.0) -> None:
        _wait_until(
            lambda: text in self.output or self.proc.poll() is not None, timeout, repr(text)
        )
        assert text in self.output, self.output[-3000:]

    def finish(self, timeout: float = 60.0) -> int:
        rc = self.proc.wait(timeout)
        for reader in self._readers:
            reader.join(5)
        return rc

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)
        for pipe in (self.proc.stdout, self.proc.stderr):
            if pipe is not None:
                pipe.close()


@pytest.fixture
def command():
    """command(ARGS...) -> a running `zmqsync ARGS`; every one killed at teardown."""
    started: list[_Command] = []

    def start(*args: str, cwd=ROOT) -> _Command:
        started.append(_Command(*args, cwd=cwd))
        return started[-1]

    yield start
    for cmd in started:
        cmd.kill()


@pytest.fixture
def silent_bus(bus_dirs, ctx):
    """A socket file whose listener takes requests and never answers (a hung publisher):
    yields (name, a function that waits until a request came in)."""
    import zmq

    runtime, _ = bus_dirs
    router = ctx.socket(zmq.ROUTER)
    router.linger = 0
    router.bind(f"ipc://{runtime}/hung.sock")

    def asked(timeout: float = 60.0) -> None:
        assert router.poll(int(timeout * 1000)) & zmq.POLLIN, "no request came in"

    yield "hung", asked
    router.close()


SIGNALS = pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["sigint", "sigterm"])


def _ends_with(cmd: _Command, sig: int) -> None:
    cmd.proc.send_signal(sig)
    assert cmd.finish() == 128 + sig, cmd.output[-3000:]
    assert "Traceback" not in cmd.output, cmd.output[-3000:]


@SIGNALS
@pytest.mark.timeout(120)
@pytest.mark.parametrize("what", ["worker", "sniff", "top", "metrics", "relay"])
def test_commands_on_a_bus_exit_128_plus_the_signal(what, sig, name, command, bus_dirs):
    runtime, _ = bus_dirs
    args, ready = {
        "worker": (("worker", "--name", name, "--json"), '"event": "joined"'),
        "sniff": (("sniff", "--name", name, "--json"), '"type": "heartbeat"'),
        "top": (("top", "--name", name, "--interval", "0.2"), "workers 0"),
        "metrics": (("metrics", "--name", name, "--port", "0"), "serving http://"),
        "relay": (
            ("relay", "--root", "--name", name, "--init-method", "tcp://127.0.0.1:0", "--json"),
            '"event": "started"',
        ),
    }[what]
    security = zmqsync.Security(tap=True)
    with zmqsync.Publisher(torch.nn.Linear(4, 2), name=name, security=security):
        cmd = command(*args)
        cmd.wait_for(ready)
        _ends_with(cmd, sig)
    assert os.listdir(runtime) == []


@SIGNALS
@pytest.mark.timeout(120)
@pytest.mark.parametrize("what", ["inspect", "buses"])
def test_commands_waiting_for_a_hung_publisher_exit_128_plus_the_signal(
    what, sig, command, silent_bus
):
    bus, asked = silent_bus
    if what == "inspect":
        cmd = command("inspect", "--name", bus, "--timeout", "60")
    else:
        cmd = command("buses", "--timeout", "60")
    asked()  # the command is inside its wait for the answer
    _ends_with(cmd, sig)


@SIGNALS
@pytest.mark.timeout(180)
def test_the_demo_exits_128_plus_the_signal_and_leaves_nothing(sig, command, bus_dirs):
    runtime, _ = bus_dirs
    cmd = command("demo", "--workers", "1", "--updates", "100000", "--size-mb", "1")
    _wait_until(lambda: any(runtime.iterdir()), 120, "the demo's bus")
    _ends_with(cmd, sig)
    assert os.listdir(runtime) == []


STARTS_AND_CLOSES = """
import sys, torch, zmqsync
model = torch.nn.Linear(4, 2)
for i in range(100_000):
    with zmqsync.Publisher(model, name=f"loop{i}", timeout=5):
        if i == 0:
            print("looping", flush=True)
"""


@pytest.mark.timeout(300)
def test_a_sigterm_at_any_moment_of_a_start_or_close_leaves_nothing(bus_dirs):
    # A script that starts and closes publishers in a loop, SIGTERMed once at moments
    # spread over a loop's length: most land inside a start (its agent binding the
    # sockets: what a signal there left behind were the socket files) or a close (the
    # segment and the files, when it landed between two of its steps), some inside a
    # finalizer (pyzmq's Socket.__del__), where Python drops the exception and the signal
    # is sent again. Each run must exit 143 and leave no socket file and no segment.
    runtime, shm = bus_dirs
    for delay in [0.0, 0.003, 0.007, 0.011, 0.017, 0.023, 0.031, 0.043, 0.057, 0.071]:
        proc = subprocess.Popen(
            [sys.executable, "-c", STARTS_AND_CLOSES],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
        )  # fmt: skip
        try:
            assert proc.stdout is not None and proc.stdout.readline() == "looping\n"
            time.sleep(delay)
            proc.send_signal(signal.SIGTERM)
            err = proc.communicate(timeout=30)[1]
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.communicate(timeout=30)
        assert proc.returncode == 143, (delay, err[-3000:])
        assert deadline_listdir(str(runtime)) == [], delay
        assert deadline_listdir(str(shm)) == [], delay


@SIGNALS
@pytest.mark.timeout(240)
def test_the_bench_exits_128_plus_the_signal(sig, command, tmp_path):
    # in tmp_path: whatever the bench writes next to it (results) stays there
    cmd = command("bench", "--workers", "1", "--timeout", "60", cwd=tmp_path)
    _wait_until(lambda: _children(cmd.proc.pid), 180, "the bench's first worker")
    _ends_with(cmd, sig)


def _children(pid: int) -> list[int]:
    out = []
    with contextlib.suppress(FileNotFoundError):
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                out += [int(c) for c in f.read().split()]
    return out


# --- frictions ---------------------------------------------------------------------------


def _zmqsync(*args: str, columns: int = 80) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, COLUMNS=str(columns))
    return subprocess.run(
        [sys.executable, "-m", "zmqsync", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        cwd=ROOT,
    )


def test_version_names_the_package_python_and_zeromq():
    import platform

    import zmq

    done = _zmqsync("--version")
    assert done.returncode == 0, done.stderr
    assert done.stdout == (
        f"zmqsync {zmqsync.__version__} ({os.path.dirname(zmqsync.__file__)}; Python "
        f"{platform.python_version()}, pyzmq {zmq.__version__}, libzmq {zmq.zmq_version()})\n"
    )


@pytest.mark.timeout(120)
def test_buses_lists_every_bus_here_and_the_left_over_ones(bus_dirs, name):
    import json
    import socket

    runtime, _ = bus_dirs
    assert _zmqsync("buses").stdout == f"no buses in {runtime}\n"
    with socket.socket(socket.AF_UNIX) as dead:  # a killed publisher's socket file
        dead.bind(str(runtime / "gone.sock"))
    with zmqsync.Publisher(torch.nn.Linear(4, 2), name=name) as pub:
        with zmqsync.Subscriber(name=name, model=torch.nn.Linear(4, 2), timeout=30):
            pub.publish()
            table = _zmqsync("buses")
            listed = _zmqsync("buses", "--json")
    assert table.returncode == 0 and listed.returncode == 0, table.stderr + listed.stderr
    gone, up = (json.loads(line) for line in listed.stdout.splitlines())
    assert gone == {"name": "gone", "address": f"ipc://{runtime}/gone.sock", "state": "left over"}
    assert up == {
        "name": name,
        "address": pub.address,
        "state": "up",
        "bus": pub.bus_id,
        "pid": os.getpid(),
        "version": 1,
        "workers": 1,
        "applied": 1,
    }
    lines = table.stdout.splitlines()
    assert lines[0].strip() == f"buses in {runtime}"
    assert max(len(line) for line in lines) <= 80
    row = next(line for line in lines if line.strip().startswith(name))
    assert row.split() == [name, pub.address, str(os.getpid()), "1", "1"]
    row = next(line for line in lines if line.strip().startswith("gone"))
    assert row.split() == ["gone", f"ipc://{runtime}/gone.sock", "-", "-", "left", "over"]
    assert "`zmqsync gc` removes it" in table.stdout
    os.unlink(runtime / "gone.sock")


@pytest.mark.timeout(120)
def test_long_worker_ids_are_never_cut_at_80_columns(name):
    long_id = "collector-gpu-node-17-rank-3-abcdef0123"
    with zmqsync.Publisher(torch.nn.Linear(4, 2), name=name) as pub:
        with zmqsync.Subscriber(
            name=name, model=torch.nn.Linear(4, 2), worker_id=long_id, timeout=30
        ):
            pub.publish()
            shown = {
                "inspect": _zmqsync("inspect", "--name", name),
                "top": _zmqsync("top", "--name", name, "--count", "1", "--interval", "0.1"),
            }
    for what, done in shown.items():
        assert done.returncode == 0, done.stderr
        lines = done.stdout.splitlines()
        assert max(len(line) for line in lines) <= 80, (what, done.stdout)
        assert "…" not in done.stdout, (what, done.stdout)
        # folded onto lines of the id's column, in order: the whole id
        cells = [line.split("│")[1].strip() for line in lines if line.startswith("│")]
        assert long_id in "".join(cells), (what, done.stdout)


@pytest.mark.timeout(120)
def test_top_says_the_bus_closed_rather_than_unreachable(name, command):
    with zmqsync.Publisher(torch.nn.Linear(4, 2), name=name):
        top = command("top", "--name", name, "--interval", "0.2")
        top.wait_for("workers 0")
    top.wait_for("bus closed by its publisher")
    assert "unreachable" not in top.output
    _ends_with(top, signal.SIGINT)


@pytest.mark.timeout(120)
def test_tools_trainer_leaves_the_tap_to_zmqsync_tap(name, bus_dirs):
    runtime, _ = bus_dirs
    env = dict(os.environ, ZMQSYNC_TAP="1")
    trainer = subprocess.Popen(
        [sys.executable, "tools/trainer.py", name, "--updates", "0", "--interval", "0.05"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=ROOT,
    )
    try:
        assert '"started"' in trainer.stdout.readline()
        done = _zmqsync("inspect", "--name", name, "--json")
        assert done.returncode == 0, done.stderr
        assert f'"tap": "ipc://{runtime}/{name}.sock.tap"' in done.stdout, done.stdout
    finally:
        trainer.terminate()
        trainer.communicate(timeout=30)
    assert trainer.returncode == 0


def test_install_hints_name_what_each_extra_installs():
    import tomllib

    from zmqsync._extras import EXTRAS, install_hint

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    for extra, requirements in EXTRAS.items():
        assert list(requirements) == extras[extra]
        hint = install_hint(extra)
        assert hint.startswith(f"pip install '{requirements[0]}'")
        assert f"'zmqsync[{extra}]'" not in hint  # what fails outside a checkout
        assert f"'.[{extra}]'" in hint


def test_member_log_grades_what_the_operator_must_see():
    from types import SimpleNamespace

    from zmqsync._member_log import Refusals, departure, rejoin_note

    assert departure(SimpleNamespace(acked=3)) == (logging.INFO, "")
    assert departure(SimpleNamespace(acked=-1)) == (logging.WARNING, " without applying a version")
    refusals = Refusals()
    assert refusals.level("w1", "bus full", False) == logging.WARNING
    assert refusals.level("w1", "bus full", False) == logging.DEBUG  # its retries
    assert refusals.level("w2", "bus full", False) == logging.WARNING
    assert refusals.level("w1", "bus full", False) == logging.WARNING
    assert refusals.level("w3", "the publisher is closing", True) == logging.DEBUG
    assert refusals.level("inspector", "INSPECT is not a request", False, False) == logging.DEBUG
    old = SimpleNamespace(session="s1", transport="cpu")
    assert rejoin_note("cpu", "s1", None) == ""
    assert rejoin_note("cpu", "s2", old) == " replacing a silent session"
    assert rejoin_note("cpu", "s1", old) == " again"
    assert rejoin_note("cuda", "s1", old) == " again, now for cuda"


# --- zmqsync.testing ---------------------------------------------------------------------


def _guide_files() -> dict[str, str]:
    """The two files of docs/guide.md's "Testing your own trainer and workers", as written."""
    import re

    guide = (ROOT / "docs" / "guide.md").read_text()
    section = guide.split("## Testing your own trainer and workers", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```python\n(# (\S+)\n.*?)```", section, flags=re.S)
    return {filename: code for code, filename in blocks}


def _pytest(directory, *args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    """pytest in `directory`, as a user runs it: none of this suite's settings or dirs."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("ZMQSYNC_")}
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        cwd=directory,
    )


@pytest.mark.timeout(300)
def test_the_guides_example_test_runs_as_written(tmp_path):
    files = _guide_files()
    assert sorted(files) == ["conftest.py", "test_policy_sync.py"]
    for filename, code in files.items():
        (tmp_path / filename).write_text(code)
    done = _pytest(tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "1 passed" in done.stdout


FAILING = """
import json, os, sys, time

def test_fails_with_a_worker_running(zmqsync_bus):
    worker = zmqsync_bus.spawn(sys.executable, "-c", WORKER, zmqsync_bus.name)
    # a second process, which SIGTERM ends
    child = zmqsync_bus.spawn(sys.executable, "-c", "import time; time.sleep(600)")
    pub = zmqsync_bus.publisher({"w": torch.zeros(4)})
    assert pub.wait_for_workers(1, timeout=60)
    with open(os.environ["RECORD"], "w") as f:
        json.dump({"pids": [worker.pid, child.pid], "runtime": zmqsync_bus.runtime_dir,
                   "shm": zmqsync_bus.shm_dir}, f)
    assert False, "the test fails with everything still running"
"""

WORKER_IGNORING_SIGTERM = """
import signal, sys, time, torch, zmqsync
signal.signal(signal.SIGTERM, signal.SIG_IGN)  # only SIGKILL ends it
sub = zmqsync.Subscriber(name=sys.argv[1], model={"w": torch.zeros(4)}, timeout=60).start()
while True:
    time.sleep(1)
"""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.timeout(300)
def test_the_fixture_ends_processes_and_removes_files_when_a_test_fails(tmp_path, monkeypatch):
    import json

    (tmp_path / "conftest.py").write_text('pytest_plugins = ["zmqsync.testing"]\n')
    source = f"import torch\nWORKER = {WORKER_IGNORING_SIGTERM!r}\n{FAILING}"
    (tmp_path / "test_failing.py").write_text(source)
    record = tmp_path / "record.json"
    monkeypatch.setenv("RECORD", str(record))
    done = _pytest(tmp_path, timeout=240)
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-3000:]
    assert "1 failed" in done.stdout and "the test fails with everything" in done.stdout
    seen = json.loads(record.read_text())
    assert not [pid for pid in seen["pids"] if _alive(pid)]  # SIGKILLed after the grace
    assert not os.path.exists(seen["runtime"]) and not os.path.exists(seen["shm"])


@pytest.mark.timeout(120)
def test_private_bus_outside_pytest_restores_the_environment_and_keeps_leftovers(bus_dirs):
    from zmqsync.testing import private_bus

    before = os.environ["ZMQSYNC_RUNTIME_DIR"]
    with private_bus() as bus:
        assert os.environ["ZMQSYNC_RUNTIME_DIR"] == bus.runtime_dir != before
        pub = bus.publisher({"w": torch.zeros(4)})
        assert pub.address == bus.address
        sub = bus.subscriber(timeout=30)
        assert sub.version == 0
        # a file of the bus's that its own code would have left behind
        (open(os.path.join(bus.shm_dir, "stray"), "w")).close()
    assert os.environ["ZMQSYNC_RUNTIME_DIR"] == before
    assert bus.leftovers == [os.path.join(bus.shm_dir, "stray")]  # the closes removed the rest
    assert not os.path.exists(bus.runtime_dir) and not os.path.exists(bus.shm_dir)


def test_import_zmqsync_loads_neither_the_test_helpers_nor_pytest():
    code = (
        "import sys, zmqsync, zmqsync.cli; zmqsync.Publisher; zmqsync.cli._parser(); "
        "assert 'zmqsync.testing' not in sys.modules and 'pytest' not in sys.modules"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr


def test_buses_and_version_import_no_torch(bus_dirs):
    code = (
        "import sys, zmqsync.cli\n"
        "assert zmqsync.cli.main(['buses']) == 0\n"
        "try:\n"
        "    zmqsync.cli.main(['--version'])\n"
        "except SystemExit as exc:\n"
        "    assert exc.code == 0\n"
        "assert 'torch' not in sys.modules, 'torch loaded'\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("no buses in ") and "zmqsync " in done.stdout
