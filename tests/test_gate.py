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


@pytest.fixture
def ctx():
    context = zmq.Context()
    yield context
    context.destroy(linger=0)


def _sockets() -> set[int]:
    """This process's descriptors that are sockets."""
    found = set()
    for name in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{name}").startswith("socket:"):
                found.add(int(name))
        except OSError:
            continue
    return found


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
        os.close(placeholder)
        attacker.connect(path)
        _until(lambda: placeholder in _sockets(), "the attacker's connection")
        attacker.shutdown(socket.SHUT_RDWR)  # libzmq closes its side: its number is free
        # (shut down, not closed: closing would free this process's own numbers too)
        _until(lambda: placeholder not in _sockets(), "the attacker's connection to end")
        holder.shutdown(socket.SHUT_RDWR)  # room in the budget now, for the honest one
        _until(lambda: len(_sockets() - before) == 0, "the holder's connection to end")
        honest.connect(path)
        _until(lambda: placeholder in _sockets(), "the honest connection")
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
