"""Peer-controlled text on the terminal: `zmqsync inspect`, `sniff` and `worker` show what
a hostile peer sent as inert, literal text.

Any local process can be a peer. The hostile one here joins with a worker id that is
rich markup (``[/bold]``: printable ASCII, so the protocol accepts it) and a host that
retitles the window, clears the screen, forges a line and reverses the text after it.
Peers are real: a `zmqsync.Publisher` with a raw pyzmq REQ socket as the hostile
worker, or a REP socket in this process playing a hostile publisher.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import socket
import subprocess
import sys
import threading
import time

import pytest
import torch
import zmq

import zmqsync
from tests.conftest import ROOT
from zmqsync import _config
from zmqsync._protocol import (
    BufferInfo,
    Error,
    Hello,
    Message,
    State,
    TensorSpec,
    WorkerEntry,
    decode,
    encode,
)
from zmqsync.cli import main

WORKER = "[/bold]"
HOST = "evil\x1b]0;pwned\x07\x1b[2J\nFORGED\u202e"
HOST_SHOWN = r"evil\x1b]0;pwned\x07\x1b[2J\nFORGED\u202e"  # one line, every escape visible
# an OSC 8 link and a markup tag that would colour the rest of the line
NOTE = "[red]\x1b]8;;http://evil.example/\x1b\\click\x1b]8;;\x1b\\"
NOTE_SHOWN = "[red]\\x1b]8;;http://evil.example/\\x1b\\click\\x1b]8;;\\x1b\\"
REASON = "no\x1b[2J\x07\nzmqsync worker: FORGED [/bold]\u202e"
REASON_SHOWN = r"no\x1b[2J\x07\nzmqsync worker: FORGED [/bold]\u202e"
BUS = "0123456789abcdef"
SGR = re.compile(r"\x1b\[[0-9;]*m")  # colour codes rich itself writes when forced to


@pytest.fixture(autouse=True)
def plain_wide_terminal(monkeypatch):
    """Wide enough that no table cell wraps (a wrapped cell would split the escaped
    text); no inherited colour or CURVE keys."""
    monkeypatch.setenv("COLUMNS", "400")
    for var in ("FORCE_COLOR", "NO_COLOR", "ZMQSYNC_CURVE_CLIENT"):
        monkeypatch.delenv(var, raising=False)


def assert_inert(text: str) -> None:
    """Nothing in `text` acts on a terminal: no control character but the newlines that
    end lines, no bidi override, no line the peer started."""
    for ch in text:
        assert ch == "\n" or ch.isprintable(), f"{ch!r} reached the terminal in:\n{text}"
    assert not any(
        line.startswith(("FORGED", "zmqsync worker: FORGED")) for line in text.split("\n")
    )


def _hello(worker_id: str = WORKER) -> bytes:
    return encode(Hello("", worker_id, os.getpid(), HOST, "copy", "cpu", NOTE))


def _join(address: str, timeout: float = 5.0) -> Message:
    """The hostile worker: one raw HELLO, its answer, and nothing else ever again."""
    ctx = zmq.Context()
    try:
        req = ctx.socket(zmq.REQ)
        req.linger = 0
        req.connect(address)
        req.send(_hello())
        assert req.poll(int(timeout * 1000)) & zmq.POLLIN, f"no answer from {address}"
        reply = decode(req.recv())
        req.close()
        return reply
    finally:
        ctx.destroy(linger=0)


@contextlib.contextmanager
def _hostile_bus(name: str, **kwargs):
    """A real publisher (heartbeat 2 s: the silent worker stays for ~12 s) that has
    welcomed the hostile worker."""
    kwargs.setdefault("heartbeat", 2.0)
    with zmqsync.Publisher({"w": torch.zeros(4)}, name=name, **kwargs) as pub:
        assert _join(pub.address).TYPE == "welcome"
        yield pub


@contextlib.contextmanager
def _fake_publisher(reply: Message):
    """A misbehaving publisher: a REP socket on loopback tcp answering every request
    with `reply`. Yields its address."""
    ctx = zmq.Context()
    rep = ctx.socket(zmq.REP)
    rep.linger = 0
    port = rep.bind_to_random_port("tcp://127.0.0.1")
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            if rep.poll(20) & zmq.POLLIN:
                rep.recv()
                rep.send(encode(reply))

    thread = threading.Thread(target=serve, name="fake-publisher", daemon=True)
    thread.start()
    try:
        yield f"tcp://127.0.0.1:{port}"
    finally:
        stop.set()
        thread.join(5)
        assert not thread.is_alive()
        rep.close()
        ctx.term()


def _hostile_state() -> State:
    """A STATE in which every free-text field is hostile."""
    return State(
        bus=BUS,
        name="bus\x1b]0;pwned\x07[/bold]",
        pid=1,
        version=3,
        seq=3,
        slots=1,
        slot_versions=(3,),
        heartbeat=0.5,
        tap="",
        events="tcp://127.0.0.1:1",
        buffers=(BufferInfo("cpu", "cpu\x1b[2J[/]", "zmqsync-x", 8192, 4096),),
        manifest=(TensorSpec(("[/bold]\x1b[2J", "w\u202e"), "float32", (1,), (1,), 0, 4),),
        workers=(WorkerEntry(WORKER, 7, HOST, "copy", "cpu", 3, 0.5, NOTE),),
        counters={"evil\x1b[2J[/red]": 5},
    )


def _run(*args: str, env: dict[str, str] | None = None, timeout: float = 20.0):
    return subprocess.run(
        [sys.executable, "-m", "zmqsync", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
        cwd=ROOT,
    )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# --- inspect -------------------------------------------------------------------------------


def test_inspect_shows_a_hostile_worker_literally(name, capsys):
    with _hostile_bus(name):
        assert main(["inspect", "--name", name]) == 0  # a MarkupError crashed it before
    out, err = capsys.readouterr()
    assert err == ""
    assert_inert(out)
    assert HOST_SHOWN in out
    assert f"│ {WORKER} " in out  # the worker's cell, its id printed as typed
    assert "workers (1)" in out
    assert "any local user" not in out  # ipc://: private to its user


def test_inspect_subprocess_exits_zero_with_a_hostile_worker_on_the_bus(name):
    with _hostile_bus(name):
        done = _run("inspect", "--name", name, env={"FORCE_COLOR": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stderr == ""
    assert_inert(SGR.sub("", done.stdout))  # rich's own colours are the only escapes
    assert HOST_SHOWN in SGR.sub("", done.stdout)


def test_inspect_json_is_ascii_and_gives_the_peer_text_back_exactly(name, capsys):
    with _hostile_bus(name):
        assert main(["inspect", "--name", name, "--json"]) == 0
    out = capsys.readouterr().out
    assert out.isascii() and "\x1b" not in out
    assert "\\u001b]0;pwned\\u0007" in out and "\\u202e" in out
    state = json.loads(out)
    [worker] = state["workers"]
    assert worker["worker_id"] == WORKER and worker["host"] == HOST
    assert state["access"] == {"curve": False, "open_to": None, "see": "docs/security.md"}


def test_inspect_escapes_every_field_of_a_hostile_state(capsys):
    with _fake_publisher(_hostile_state()) as address:
        assert main(["inspect", address]) == 0
    out, err = capsys.readouterr()
    assert err == ""
    assert_inert(out)
    for shown in (
        r"'bus\x1b]0;pwned\x07[/bold]'",  # the bus name
        r"cpu\x1b[2J[/]",  # a buffer's device
        r"[/bold]\x1b[2J.w\u202e",  # a tensor key
        HOST_SHOWN,
        NOTE_SHOWN,
        r"evil\x1b[2J[/red]=5",  # a counter's name
    ):
        assert shown in out, shown


def test_inspect_prints_a_refusal_as_one_escaped_line(capsys):
    with _fake_publisher(Error(BUS, REASON)) as address:
        assert main(["inspect", address]) == 1
    out, err = capsys.readouterr()
    assert out == ""
    assert_inert(err)
    [line] = err.splitlines()
    assert line.startswith("zmqsync inspect: ProtocolError: expected STATE, got error: ")
    assert line.endswith(REASON_SHOWN)


# --- sniff ---------------------------------------------------------------------------------


def _sniff_while_joining(name: str, *args: str, env: dict[str, str] | None = None):
    """`zmqsync sniff ARGS` on the tap while the hostile worker joins, again and again
    until the sniffer has shown its --count (it may subscribe after the first HELLO)."""
    cmd = [sys.executable, "-m", "zmqsync", "sniff", "--name", name, "--duration", "15", *args]
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, **(env or {})},
        cwd=ROOT,
    )
    try:
        end = time.monotonic() + 15
        while proc.poll() is None and time.monotonic() < end:
            _join(_config.default_address(name))
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(0.2)
        out, err = proc.communicate(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=10)
    return proc.returncode, out, err


def test_sniff_shows_a_hostile_hello_literally(name):
    with _hostile_bus(name, security=zmqsync.Security(tap=True)):
        rc, out, err = _sniff_while_joining(
            name, "--type", "hello", "--type", "welcome", "--count", "2", env={"FORCE_COLOR": "1"}
        )
    assert rc == 0, err[-3000:]
    out = SGR.sub("", out)
    assert_inert(out)
    assert_inert(SGR.sub("", err))
    hello = next(line for line in out.splitlines() if " hello " in line)
    assert f" {WORKER} " in hello  # the peer column
    assert f"worker_id={WORKER} " in hello and f"host={HOST_SHOWN} " in hello


def test_sniff_json_is_ascii_and_exact(name):
    with _hostile_bus(name, security=zmqsync.Security(tap=True)):
        rc, out, err = _sniff_while_joining(name, "--json", "--type", "hello", "--count", "1")
    assert rc == 0, err[-3000:]
    [line] = out.splitlines()
    assert line.isascii() and "\\u202e" in line
    record = json.loads(line)
    assert record["peer"] == WORKER and record["host"] == HOST
    assert record["transport_note"] == NOTE


# --- worker --------------------------------------------------------------------------------


def test_worker_prints_a_hostile_refusal_as_one_escaped_line():
    with _fake_publisher(Error(BUS, REASON)) as address:
        done = _run("worker", address, "--timeout", "5")
    assert done.returncode == 1
    assert done.stdout == ""
    assert_inert(done.stderr)
    [line] = done.stderr.splitlines()
    assert line.startswith(f"zmqsync worker: ProtocolError: the publisher at {address} refused us")
    assert line.endswith(REASON_SHOWN)


def test_log_lines_show_peer_text_escaped_and_keep_tracebacks():
    from zmqsync.cli import _PrintableFormatter  # what main() logs through

    formatter = _PrintableFormatter("%(name)s %(message)s")
    record = logging.makeLogRecord(
        {"name": "zmqsync._subscriber", "msg": "lost the publisher: %s", "args": (REASON,)}
    )
    assert formatter.format(record) == f"zmqsync._subscriber lost the publisher: {REASON_SHOWN}"
    try:
        raise ValueError("boom")
    except ValueError:
        record = logging.makeLogRecord(
            {"msg": "failed: %s", "args": (HOST,), "exc_info": sys.exc_info()}
        )
    text = formatter.format(record)
    first, *traceback = text.split("\n")
    assert first.endswith(f"failed: {HOST_SHOWN}")
    assert (
        traceback[0] == "Traceback (most recent call last):" and traceback[-1] == "ValueError: boom"
    )


# --- who can join --------------------------------------------------------------------------


def test_inspect_of_a_loopback_tcp_bus_without_curve_says_any_local_user_can_join(name, capsys):
    address = f"tcp://127.0.0.1:{_free_port()}"
    with zmqsync.Publisher({"w": torch.zeros(2)}, address, name=name):
        assert main(["inspect", address]) == 0
        out = capsys.readouterr().out
        assert main(["inspect", address, "--json"]) == 0
        state = json.loads(capsys.readouterr().out)
    [line] = [line for line in out.splitlines() if "any local user" in line]
    assert line.startswith(f"warning: {address} has no CURVE: any local user can join this bus")
    assert "docs/security.md" in line
    assert state["access"] == {"curve": False, "open_to": "local users", "see": "docs/security.md"}


def test_inspect_of_an_ipc_bus_gives_no_warning(name, capsys):
    with zmqsync.Publisher({"w": torch.zeros(2)}, name=name):
        assert main(["inspect", "--name", name]) == 0
        out = capsys.readouterr().out
        assert main(["inspect", "--name", name, "--json"]) == 0
        state = json.loads(capsys.readouterr().out)
    assert "warning" not in out and "CURVE" not in out
    assert state["access"]["open_to"] is None


def test_relay_tables_of_inspect_show_peer_text_literally(capsys):
    """Relay ids, hosts and the relays' workers come from other hosts: `inspect` prints
    them as text, never as markup."""
    from zmqsync._inspect_view import print_relays
    from zmqsync._protocol import to_plain
    from zmqsync.relay import RelayInfo

    worker = WorkerEntry(WORKER, 7, HOST, "copy", "cpu", 3, 0.5)
    relay = RelayInfo("[/red]relay", HOST, 8, "active", 1, 1, 3, 3, 0.1, (worker,))
    tree = {"tree": "t[/]", "pid": 9, "version": 3, "generation": 1, "ack": "all"}
    tree["relays"] = [to_plain(relay)]
    print_relays(tree)
    out = capsys.readouterr().out
    assert_inert(out)
    assert "relay root t[/] pid 9" in out
    assert "│ [/red]relay " in out and f"│ {WORKER} " in out
    assert out.count(HOST_SHOWN) == 2
