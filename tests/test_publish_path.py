"""What a publish walks through: the publisher strings the write mode and the ack wait
together, and neither calls back into it (a walk of ``publish(weights)`` is a line, not
a star)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import zmqsync

PACKAGE = Path(zmqsync.__file__).resolve().parent


def _walk(pub: zmqsync.Publisher, weights) -> list[tuple[str, str, str]]:
    """(caller's module, callee's module, callee) for every call between zmqsync's own
    modules during one publish on this thread."""
    calls: list[tuple[str, str, str]] = []

    def module(frame) -> str | None:
        path = Path(frame.f_code.co_filename)
        return path.stem if path.is_relative_to(PACKAGE) and path.suffix == ".py" else None

    def profile(frame, event, arg):
        if event != "call":
            return
        callee, caller = module(frame), frame.f_back and module(frame.f_back)
        if callee and caller and callee != caller:
            calls.append((caller, callee, frame.f_code.co_name))

    sys.setprofile(profile)
    try:
        pub.publish(weights)
    finally:
        sys.setprofile(None)
    return calls


@pytest.mark.parametrize(
    "writes",
    [zmqsync.Copy(), zmqsync.Copy(skip_unchanged=True), zmqsync.Live()],
    ids=["copy", "skip-unchanged", "live"],
)
def test_a_publish_leaves_the_publisher_for_its_write_mode_and_its_ack_wait(name, writes):
    weights = {"w": torch.zeros(64), "b": torch.zeros(3)}
    with (
        zmqsync.Publisher(weights, name=name, writes=writes, timeout=30) as pub,
        zmqsync.Subscriber(name=name, timeout=30),
    ):
        calls = _walk(pub, {"w": torch.ones(64), "b": torch.ones(3)})
    left_for = {callee for caller, callee, _ in calls if caller == "_publisher"}
    assert {"_write_modes", "_acks"} <= left_for
    back = [(caller, fn) for caller, callee, fn in calls if callee == "_publisher"]
    assert len(back) <= 2, back  # in practice none: nothing calls the publisher back
    assert back == []


def test_an_overlapped_publish_announces_from_the_writer_without_the_publisher(name):
    model = torch.nn.Linear(8, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with (
        zmqsync.Publisher(model, name=name, writes=zmqsync.Overlapped(opt), timeout=30) as pub,
        zmqsync.Subscriber(name=name, timeout=30),
    ):
        calls = _walk(pub, None)
    assert [c for c in calls if c[1] == "_publisher"] == []
