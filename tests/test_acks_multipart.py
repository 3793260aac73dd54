"""Multipart junk on the acks socket never costs an honest worker its ACK.

A raw PUSH peer streams multipart messages at the publisher's acks socket while a real
worker process acks every publish; both ACK readers, the native `AckReader` and the
Python one (ZMQSYNC_NATIVE=0), must take every honest ACK, each publish within a
deadline shorter than the liveness window.
"""

from __future__ import annotations

import time

import pytest
import torch
import zmq

import zmqsync
from tests.helpers import native as native_helper
from zmqsync import _publisher_agent
from zmqsync._fast_frames import ack_pattern, template
from zmqsync._follow import libzmq_path, zmq_error
from zmqsync._protocol import Ack, decode, encode

PARTS = 300  # more frames than one native read takes (256): a read ends inside one
BACKLOG = 20  # junk messages queued before each publish, so its ACK lands amid them
ROUNDS = 8


def _until(predicate, timeout: float = 30.0) -> None:
    end = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < end, "the publisher did not read the junk in time"
        time.sleep(0.01)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("way", ["native", "python"])
def test_multipart_junk_between_publishes_drops_no_honest_ack(spawn, name, monkeypatch, way):
    if way == "python":
        monkeypatch.setenv("ZMQSYNC_NATIVE", "0")  # the worker's side
        monkeypatch.setattr(_publisher_agent, "ACK_READER", None)  # the publisher's
    elif _publisher_agent.ACK_READER is None:
        native_helper.missing()
    ctx = zmq.Context()
    with zmqsync.Publisher(
        {"w": torch.zeros(64)}, name=name, heartbeat=0.5, timeout=1.0, on_timeout="raise"
    ) as pub:
        worker = spawn("worker", "--name", name, "--json", "--worker-id", "honest", "--forever")
        worker.wait_for(lambda r: r.get("event") == "applied" and r["version"] == 0, 60)
        junk, forger = ctx.socket(zmq.PUSH), ctx.socket(zmq.PUSH)
        for sock in (junk, forger):
            sock.linger = 0
            sock.sndhwm = 1_000_000
            sock.connect(pub.address + ".acks")
        message = [b"junk-%d" % i for i in range(PARTS)]
        sent = 0
        try:
            for _ in range(ROUNDS):
                # the worker's ACK comes amid queued junk: a reader that takes it takes
                # junk frames after it, and may stop inside a junk message
                for _ in range(BACKLOG):
                    junk.send_multipart(message)
                sent += BACKLOG
                pub.publish()
                # the publisher's agent reads the rest (each message counted at least once)
                _until(lambda s=sent: pub.counters.get("rejected", 0) >= s)
                # single-frame ACKs under 1,100 new worker ids, refused (no such worker):
                # they make the protocol forget the ids it checked, so the honest
                # worker's next ACK is read the slow way, decoded in full
                stale = pub.counters.get("stale", 0)
                for i in range(1100):
                    forger.send(encode(Ack(pub.bus_id, f"x{i}", "00aa11bb22cc33dd", 1)))
                _until(lambda s=stale: pub.counters.get("stale", 0) >= s + 1100)
                p = pub.publish()  # the first frame a reader takes: the honest ACK
                assert p.acked == ("honest",)
        finally:
            junk.close()
            forger.close()
            ctx.destroy(linger=0)


def test_the_native_reader_returns_whole_messages_and_keeps_nothing_between_reads():
    """A multipart message longer than a read is still read whole; the next read starts
    at the next message, whoever reads the socket in between."""
    native = native_helper.module()
    bus = "0123456789abcdef"
    ack = template(Ack, bus=bus, worker_id="w", session="00aa11bb22cc33dd")
    decode(ack(1))  # its worker id and session pass their checks: a native ACK
    ctx = zmq.Context()
    try:
        pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
        pull.bind("inproc://acks")
        push.connect("inproc://acks")
        pull.rcvtimeo = 1000
        pieces, versions, ids, sessions = ack_pattern(bus)
        reader = native.AckReader(
            libzmq=libzmq_path(),
            socket=pull,
            pieces=pieces,
            versions=versions,
            ids=ids,
            sessions=sessions,
            error=zmq_error,
        )
        push.send_multipart([b"first"] + [b"part"] * 999)
        push.send(ack(1))
        push.send_multipart([b"other", b"last"])
        push.send(b"junk")
        assert reader.read(1) == [(b"first", True)]
        assert reader.read(1) == [("w", "00aa11bb22cc33dd", 1)]
        # Python reads the next message's first part only; the reader takes the rest as
        # one message of its own, and the frame after it as what it is
        assert pull.recv() == b"other" and pull.rcvmore
        assert reader.read(10) == [(b"last", False), (b"junk", False)]
    finally:
        ctx.destroy(linger=0)
