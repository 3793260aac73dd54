"""The connection gate against descriptor reuse, in one process with real sockets.

libzmq reports a connection by its descriptor number, and reports it late: by the time
the gate reads "accepted on 15", that connection may be gone and 15 may belong to a
newer one. These tests hold the gate back on purpose (it reads its monitor only when
told) so that the reuse happens every time.
"""

from __future__ import annotations

import os
import socket
import time

import pytest
import zmq

from zmqsync._connections import Gate

pytestmark = pytest.mark.timeout(60)


def _sockets() -> set[int]:
    """This process's descriptors that are sockets (listing them opens a descriptor:
    never while a connection whose number matters is being accepted)."""
    return {fd for fd in map(int, os.listdir("/proc/self/fd")) if _is_socket(fd)}


def _is_socket(fd: int) -> bool:
    """Whether descriptor `fd` is a socket now (opens no descriptor itself)."""
    try:
        return os.readlink(f"/proc/self/fd/{fd}").startswith("socket:")
    except OSError:
        return False


def _until(predicate, what: str, timeout: float = 10.0) -> None:
    end = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < end, f"timed out waiting for {what}"
        time.sleep(0.005)


def _alive(sock: socket.socket, seconds: float = 0.5) -> bool:
    """Whether the publisher side still holds `sock`'s connection (no EOF, no reset)."""
    sock.settimeout(seconds)
    try:
        while True:
            if not sock.recv(4096):  # the greeting first, then nothing unless shut down
                return False
    except TimeoutError:
        return True
    except OSError:
        return False


def test_a_refusal_never_reaches_the_connection_that_reused_its_descriptor(ctx, tmp_path):
    """A connection refused late (the budget was full when it came) must not take down
    the connection that got its descriptor number after it left."""
    bound = ctx.socket(zmq.XPUB)
    bound.linger = 0
    bound.bind(f"ipc://{tmp_path}/events")
    endpoint = bound.getsockopt_string(zmq.LAST_ENDPOINT)
    path = endpoint[len("ipc://") :]
    gate = Gate(1, 64, 1024, 1000.0)
    monitor = gate.watch(bound, endpoint)
    # client sockets first: their descriptors must not take the hole made below
    holder, attacker, honest = (socket.socket(socket.AF_UNIX) for _ in range(3))
    try:
        placeholder = os.open("/dev/null", os.O_RDONLY)  # keeps the lowest number free
        before = _sockets()
        holder.connect(path)
        _until(lambda: len(_sockets() - before) == 1, "the holder's connection")
        (held,) = _sockets() - before
        os.close(placeholder)
        attacker.connect(path)
        _until(lambda: _is_socket(placeholder), "the attacker's connection")
        attacker.shutdown(socket.SHUT_RDWR)  # libzmq closes its side: its number is free
        # (shut down, not closed: closing would free this process's own numbers too)
        _until(lambda: not _is_socket(placeholder), "the attacker's connection to end")
        holder.shutdown(socket.SHUT_RDWR)  # room in the budget now, for the honest one
        _until(lambda: not _is_socket(held), "the holder's connection to end")
        honest.connect(path)
        _until(lambda: _is_socket(placeholder), "the honest connection")
        # Only now does the gate read what happened: accepted (the holder), accepted
        # (the attacker: over the budget), disconnected, disconnected, accepted (honest,
        # on the attacker's old number, with room for it).
        gate.on_event(monitor)
        assert _alive(honest), "the gate shut down the honest connection"
        gate.on_event(monitor)
        assert gate.count == 1  # the honest one, counted
    finally:
        for sock in (holder, attacker, honest):
            sock.close()
        gate.close()
        bound.close()


_HOLD = """
import socket, sys
s = socket.socket(socket.AF_UNIX)
s.connect(sys.argv[1])
print('{"event": "connected"}', flush=True)
while s.recv(4096):
    pass
print('{"event": "shut down"}', flush=True)
"""


def _holder(spawn, path):
    proc = spawn("-c", _HOLD, path, module="")
    proc.wait_for(lambda r: r.get("event") == "connected", timeout=30)
    return proc


def _settled(gate, monitor, predicate, what: str) -> None:
    _until(lambda: (gate.on_event(monitor), predicate())[1], what)


def test_past_the_budget_a_members_connection_stays_and_another_process_goes(ctx, tmp_path, spawn):
    """A welcomed worker's process is a member: past the budget its connection is kept
    (within the headroom), while another process's is shut down: exactly that one."""
    bound = ctx.socket(zmq.XPUB)
    bound.linger = 0
    bound.bind(f"ipc://{tmp_path}/events")
    endpoint = bound.getsockopt_string(zmq.LAST_ENDPOINT)
    path = endpoint[len("ipc://") :]
    gate = Gate(1, 64, 1024, 1000.0, headroom=1)
    monitor = gate.watch(bound, endpoint)
    member = socket.socket(socket.AF_UNIX)
    try:
        holder = _holder(spawn, path)
        _settled(gate, monitor, lambda: gate.count == 1, "the holder counted")
        stranger = _holder(spawn, path)
        _settled(gate, monitor, lambda: gate.refused == 1, "the stranger refused")
        stranger.wait_for(lambda r: r.get("event") == "shut down", timeout=10)
        gate.welcomed(f"pid {os.getpid()}")
        member.connect(path)
        _settled(gate, monitor, lambda: gate.count == 2, "the member counted")
        assert _alive(member), "the member's connection was shut down"
        assert gate.refused == 1
        assert not [r for r in holder.records if r.get("event") == "shut down"]
    finally:
        member.close()
        gate.close()
        bound.close()


def test_a_handshake_is_refused_by_its_peers_rate_unless_the_peer_is_a_member(ctx, tmp_path):
    """Decided at the handshake (ZAP), for exactly one connection: a process that used
    up its rate is refused, and gets in once a worker was welcomed from it (a member has
    an allowance of its own)."""
    gate = Gate(1000, 64, 1024, 0.5)  # one peer: one connection now, then one per 2 s
    gate.serve_zap(ctx, None)
    bound = ctx.socket(zmq.XPUB)
    bound.linger = 0
    bound.zap_domain = b"test.events"
    bound.setsockopt(zmq.XPUB_WELCOME_MSG, b"welcome")
    bound.bind(f"ipc://{tmp_path}/events")
    endpoint = bound.getsockopt_string(zmq.LAST_ENDPOINT)
    gate.watch(bound, endpoint, rate_limited=True)
    subs = []

    def welcomed(sub) -> bool:
        """Whether `sub` got the publisher's welcome (its handshake allowed), or was
        refused; never long enough a wait for a refused peer to earn a new token."""
        refused, end = gate.refused, time.monotonic() + 10.0
        while time.monotonic() < end and gate.refused == refused:
            gate.on_zap()
            bound.getsockopt(zmq.EVENTS)  # the publisher side attaches what was allowed
            if sub.poll(5):
                return sub.recv() == b"welcome"
        return False

    try:
        for expected in (True, False, False):
            sub = ctx.socket(zmq.SUB)
            sub.linger = 0
            sub.subscribe(b"")
            sub.connect(endpoint)
            subs.append(sub)
            assert welcomed(sub) is expected
        assert gate.refused == 2
        gate.welcomed(f"pid {os.getpid()}")
        for _ in range(4):  # a member's own allowance: four times the rate, 2 s of burst
            sub = ctx.socket(zmq.SUB)
            sub.linger = 0
            sub.subscribe(b"")
            sub.connect(endpoint)
            subs.append(sub)
            assert welcomed(sub), "a member's connection was refused"
    finally:
        for sub in subs:
            sub.close()
        gate.close()
        bound.close()
        gate.close_zap()
