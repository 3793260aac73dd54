"""Every message the protocol allows fits the socket that receives it.

A socket refuses frames above its limit (MAXMSGSIZE): libzmq drops the peer that sent
one. A limit below the largest legal message turns an honest publisher into one that
is never acked; so each limit is derived from, or checked against, the field table.
"""

from __future__ import annotations

import pytest
import torch

import zmqsync
from zmqsync import _config
from zmqsync._checks import MAX_U63
from zmqsync._protocol import (
    MAX_EVENT,
    MAX_SLOTS,
    MAX_TENSORS,
    Ack,
    Bye,
    Heartbeat,
    Hello,
    Inspect,
    Receive,
    Stop,
    Welcome,
    decode,
    encode,
    max_encoded,
)

BUS = "f" * 16
WIDE = "\U0010ffff"  # 4 bytes of UTF-8: the longest character a text field may hold


def _largest_events() -> list[Receive | Stop | Heartbeat]:
    """The longest legal event of each kind."""
    return [
        Receive(BUS, MAX_U63, MAX_U63, MAX_SLOTS - 1, bytes((MAX_TENSORS + 7) // 8)),
        Stop(BUS, MAX_U63, BUS, WIDE * 256),
        Heartbeat(BUS, MAX_U63, WIDE * 128, BUS, MAX_U63),
    ]


def test_the_largest_legal_events_fit_the_events_socket():
    for event in _largest_events():
        frame = encode(event)
        assert decode(frame, bus=BUS) == event, "the message is legal"
        assert len(frame) <= MAX_EVENT, (event.TYPE, len(frame), MAX_EVENT)
    receive = encode(_largest_events()[0])
    # the bound is the largest RECEIVE, give or take its text fields' width
    assert len(receive) <= MAX_EVENT <= len(receive) + 64


def test_bound_sockets_accept_the_largest_legal_message_of_their_peers():
    assert max_encoded(Ack, Bye, Heartbeat) <= _config.WORKER_MAX_BYTES
    assert max_encoded(Hello, Inspect) <= _config.CONTROL_MAX_BYTES


def test_max_encoded_refuses_messages_with_records():
    with pytest.raises(TypeError, match="not a flat field"):
        max_encoded(Welcome)


@pytest.mark.timeout(300)
def test_partial_publishes_at_the_maximum_tensor_count_are_acked(spawn, name):
    """MAX_TENSORS tensors: each partial publish's RECEIVE carries the largest bitmap."""
    weights = {f"t{i}": torch.zeros(1) for i in range(MAX_TENSORS)}
    with zmqsync.Publisher(weights, name=name, heartbeat=0.5, on_timeout="raise") as pub:
        worker = spawn("worker", "--name", name, "--json", "--worker-id", "big", "--forever")
        worker.wait_for(lambda r: r.get("event") == "applied" and r["version"] == 0, 120)
        for version, i in enumerate((0, MAX_TENSORS // 2, MAX_TENSORS - 1), start=1):
            key = f"t{i}"
            # shorter than the liveness window (6 heartbeats): acked by the RECEIVE itself
            p = pub.publish(weights={key: torch.full((1,), float(version))}, keys=[key], timeout=2)
            assert not p.missing
            worker.wait_for(
                lambda r, v=version: r.get("event") == "applied" and r["version"] == v, 10
            )
        events = [r["event"] for r in worker.records]
        assert events.count("joined") == 1 and "rejoined" not in events, events
