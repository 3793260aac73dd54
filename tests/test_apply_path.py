"""What a worker's apply walks through: the agent hands a version to the reader (the
apply mode), which reads the seqlock, applies, records in the worker state and hands
back the version to ack; the Subscriber façade is not on the way (a walk of one version
is a line, not a star). The twin of tests/test_publish_path.py for the worker side."""

from __future__ import annotations

import sys
import threading
from pathlib import Path

import pytest
import torch

import zmqsync

PACKAGE = Path(zmqsync.__file__).resolve().parent


class _Walk:
    """(caller's module, callee's module, callee) for every call between zmqsync's own
    modules on the threads it is installed on (Python's profile hook, per thread)."""

    def __init__(self, thread_prefix: str | None = None) -> None:
        self.calls: list[tuple[str, str, str]] = []
        self.thread_prefix = thread_prefix
        self.on = False

    @staticmethod
    def _module(frame) -> str | None:
        path = Path(frame.f_code.co_filename)
        if not (path.is_relative_to(PACKAGE) and path.suffix == ".py"):
            return None
        return ".".join(path.relative_to(PACKAGE).with_suffix("").parts)

    def __call__(self, frame, event, arg):
        if event != "call" or not self.on:
            return
        if self.thread_prefix and not threading.current_thread().name.startswith(
            self.thread_prefix
        ):
            return
        callee, caller = self._module(frame), frame.f_back and self._module(frame.f_back)
        if callee and caller and callee != caller:
            self.calls.append((caller, callee, frame.f_code.co_name))


ROUTE = {
    ("_subscriber_agent", "_weakly"),  # the offer goes to the reader, held weakly
    ("_weakly", "_read_modes"),
    ("_read_modes", "_buffers.header"),  # seqlock: read_begin, read_valid
    ("_read_modes", "_apply"),  # copy into the model / alias it
    ("_read_modes", "_worker_state"),  # record: one writer
    ("_read_modes", "_histogram"),  # the apply's time
}


def test_a_background_apply_goes_agent_reader_state_and_never_through_the_facade(name):
    """On the Python way (``on_update`` keeps a version there): one RECEIVE, its apply,
    its ACK, traced on the agent thread."""
    model = torch.nn.Linear(16, 16)
    walk = _Walk(thread_prefix="zmqsync-sub-")
    seen: list[int] = []
    threading.setprofile(walk)  # the agent thread starts with it
    try:
        with (
            zmqsync.Publisher(model, name=name, timeout=30) as pub,
            zmqsync.Subscriber(
                name=name,
                model=torch.nn.Linear(16, 16),
                reads=zmqsync.Copies(on_update=seen.append),
            ) as sub,
        ):
            walk.on = True
            with torch.no_grad():
                model.weight.add_(1)
            version = pub.publish().version
            assert sub.wait_for_version(version, 10)
            walk.on = False
    finally:
        threading.setprofile(None)  # type: ignore[arg-type]
    pairs = {(caller, callee) for caller, callee, _ in walk.calls}
    assert ROUTE <= pairs, sorted(pairs)
    assert not any("_subscriber" == callee for _, callee, _ in walk.calls), walk.calls
    applies = [c for c in walk.calls if c[1] == "_read_modes" and c[2] == "apply"]
    assert len(applies) == 1
    recorded = [c for c in walk.calls if c[1] == "_worker_state"]
    assert [fn for _, _, fn in recorded] == ["record"]
    assert seen[-1] == version


@pytest.mark.parametrize("reads", [zmqsync.Copies(manual=True), zmqsync.Aliases(manual=True)])
def test_a_manual_poll_goes_facade_reader_state_then_the_agent_acks(name, reads):
    """``poll()`` on the user's thread: the façade asks the reader for the pending offer
    and its apply, then the agent for the ACK; nothing calls the façade back."""
    weights = {"w": torch.zeros(64)}
    with (
        zmqsync.Publisher(weights, name=name, timeout=30) as pub,
        zmqsync.Subscriber(name=name, reads=reads, timeout=30) as sub,
    ):
        pub.publish({"w": torch.ones(64)}, max_lag=None)
        walk = _Walk()
        walk.on = True
        sys.setprofile(walk)
        try:
            assert sub.poll(timeout=10)
        finally:
            sys.setprofile(None)
        assert torch.equal(sub.tensors[("w",)], torch.ones(64))
    facade = [(callee, fn) for caller, callee, fn in walk.calls if caller == "_subscriber"]
    assert ("_read_modes", "take_pending") in facade
    assert ("_read_modes", "apply") in facade
    assert ("_subscriber_agent", "ack_from_user") in facade
    pairs = {(caller, callee) for caller, callee, _ in walk.calls}
    assert {("_read_modes", "_buffers.header"), ("_read_modes", "_worker_state")} <= pairs
    back = [c for c in walk.calls if c[1] == "_subscriber"]
    assert back == []
