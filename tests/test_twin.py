"""The native Follower and its Python twin, `ReferenceFollower`, driven by one script.

One scripted stream of frames (RECEIVEs in order, heartbeats, a gap, stale and
repeated sequences, a slot torn by its writer, a version not newer, a foreign bus,
STOPs) goes through each follower, on real sockets, over a real header mapping and a
real `Switch`; after every frame the result of ``next``, the `WorkerState` and the
model's bytes must be the same for both. The C's rules are mirrored from Python
(`Link.on_receive`, `Header.read_begin`, `Switch.point_at`, `Reader.apply`):
this is what holds them together. Copy mode runs its own script through both (a copy
callable instead of the switch, the seqlock read again after it: a copy the writer
tore, a copier that declines and a partial version are left to Python).

ZMQSYNC_REQUIRE_NATIVE=1 (as CI sets it) turns a missing extension into a failure here.
"""

from __future__ import annotations

import ctypes
import mmap
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
import zmq

from tests.helpers import native as native_helper
from zmqsync._apply import Switch
from zmqsync._buffers.header import FIRST_SLOT_WORD, HEADER_BYTES, Header
from zmqsync._fast_frames import receive_pattern, template, template_pieces
from zmqsync._native_lib import libzmq_path, zmq_error
from zmqsync._protocol import Ack, Heartbeat, Receive, Stop, encode
from zmqsync._reference_follower import ReferenceFollower
from zmqsync._worker_state import NATIVE_WRITES, WorkerState

BUS = "0123456789abcdef"
OTHER = "fedcba9876543210"
SESSION = "00aa11bb22cc33dd"
SLOTS = 3
KINDS = ["native", "python"]


def _native() -> Any:
    """The extension, or a skip (a failure where CI requires it)."""
    return native_helper.module()


# One step: (what the writer does to the header first, the frame). A header action is
# ("write", slot, version): the slot now holds that version whole; ("tear", slot): the
# writer is inside that slot (its counter odd).
Step = tuple[tuple[Any, ...] | None, bytes]
_receive = template(Receive, bus=BUS)


def _script() -> list[Step]:
    beat = encode(Heartbeat(BUS, 1, "", "", 0))
    return [
        (("write", 1, 1), _receive(1, 1, 1, b"")),  # the next RECEIVE: taken
        (None, _receive(1, 1, 1, b"")),  # the same seq again: left
        (("write", 2, 2), _receive(2, 2, 2, b"\x01")),  # taken (changed ignored)
        (None, beat),  # a heartbeat: left
        (("write", 0, 3), _receive(4, 3, 0, b"")),  # a gap (seq 3 lost): left
        (None, _receive(3, 3, 0, b"")),  # the missing one: taken
        (("tear", 1), _receive(4, 4, 1, b"")),  # the slot is being written: left
        (("write", 1, 4), _receive(4, 4, 1, b"")),  # whole now: taken
        (None, _receive(5, 4, 2, b"")),  # a version not newer: left
        (None, _receive(5, 9, SLOTS, b"")),  # a slot past the bus's: left
        (None, template(Receive, bus=OTHER)(5, 9, 0, b"")),  # another bus: left
        (("write", 2, 7), _receive(5, 6, 2, b"")),  # the slot holds another version: left
        (None, _receive(5, 7, 2, b"")),  # taken
        (None, encode(Stop(BUS, 6, SESSION, "evicted"))),  # our STOP: left
        (None, encode(Stop(BUS, 7, "", "closed"))),  # the bus's: left
        (None, b"\x93garbage"),  # not a message: left
        (("write", 0, 8), _receive(6, 8, 0, b"")),  # seq 6 was the STOP's: taken here
    ]


class _Env:
    """A header mapping, slots of distinct bytes, a Switch over them, and sockets."""

    def __init__(self, ctx: zmq.Context[zmq.Socket[bytes]], tag: str) -> None:
        self.map = mmap.mmap(-1, HEADER_BYTES)
        self.words = memoryview(self.map).cast("Q")
        self.header = Header.initialise(self.words, SLOTS, 64)
        self.address = ctypes.addressof(ctypes.c_char.from_buffer(self.map))
        self.data = torch.arange(SLOTS * 16, dtype=torch.float32).reshape(SLOTS, 16)
        views = [{"w": self.data[i]} for i in range(SLOTS)]
        switch = Switch.over(views[0], 0, SLOTS)
        assert switch is not None
        if switch.swap is None:
            pytest.skip("this torch has no storage pointer swap")
        for slot in (1, 2, 0):  # every slot's holder built, as after a few versions
            assert switch.point_at(slot, views[slot])
        self.switch = switch
        self.state = WorkerState()
        self.lock = threading.RLock()
        self.feed, self.events = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
        self.feed.bind(f"inproc://twin-events-{tag}")
        self.events.connect(f"inproc://twin-events-{tag}")
        self.events.rcvtimeo = 50
        self.acks, self.collect = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
        self.collect.bind(f"inproc://twin-acks-{tag}")
        self.acks.connect(f"inproc://twin-acks-{tag}")
        self.collect.rcvtimeo = 0
        self.opened: list[int] = []

    def follower(self, kind: str, copy: Any = None) -> Any:
        head, tail = template_pieces(Ack, bus=BUS, worker_id="w-1", session=SESSION)
        common = dict(
            events=self.events,
            acks=self.acks,
            ack_head=head,
            ack_tail=tail,
            slots=SLOTS,
            switch=self.switch,
            state=self.state,
            lock=self.lock,
            copy=copy,
        )
        if copy is not None:
            common["switch"] = None
        if kind == "python":
            return ReferenceFollower(
                bus=BUS, header=self.header, opened=self.opened.append, **common
            )
        native = _native()
        self.gate = native.Gate()
        pieces, ranges = receive_pattern(BUS, partial=copy is None)
        return native.Follower(
            libzmq=libzmq_path(),
            pieces=pieces,
            ranges=ranges,
            header=self.address,
            header_words=HEADER_BYTES // 8,
            first_slot_word=FIRST_SLOT_WORD,
            gate=self.gate,
            error=zmq_error,
            **common,
        )

    def do(self, action: tuple[Any, ...] | None) -> None:
        if action is None:
            return
        if action[0] == "tear":
            self.header.begin_write(action[1])
        else:
            _, slot, version = action
            if self.words[FIRST_SLOT_WORD + 2 * slot] & 1 == 0:
                self.header.begin_write(slot)
            self.header.end_write(slot, version)

    def acked(self) -> list[bytes]:
        out = []
        while True:
            try:
                out.append(self.collect.recv())
            except zmq.Again:
                return out

    def snapshot(self, got: Any, heard_before: float) -> dict[str, Any]:
        s = self.state
        return {
            "got": got,
            "version": s.version,
            "held_slot": None if s.held is None else s.held[0],
            "held_counter": None if s.held is None else s.held[1],
            "last_seq": s.last_seq,
            "heard": s.last_heard != heard_before,
            "applied": s.applied,
            "at": self.switch.at,
            "model": float(self.switch.tensors["w"][0]),
            "acks": self.acked(),
        }


@contextmanager
def _env(tag: str) -> Iterator[_Env]:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    env = _Env(ctx, tag)
    try:
        yield env
    finally:
        ctx.destroy(linger=0)
        env.words.release()


def _run(kind: str) -> list[dict[str, Any]]:
    with _env(kind) as env:
        follower = env.follower(kind)
        out = []
        for action, frame in _script():
            env.do(action)
            env.feed.send(frame)
            before = env.state.last_heard
            got = follower.next(env.state.last_seq, env.state.version, 0.0)
            out.append(env.snapshot(got, before))
        assert follower.next(env.state.last_seq, env.state.version, 0.0) is None, "RCVTIMEO"
        if kind == "native":
            assert env.state.native == env.state.applied
        else:
            assert env.state.native == 0 and env.opened == [1, 2, 3, 4, 7, 8]
        return out


def test_both_followers_leave_the_same_state_after_every_frame():
    native, python = _run("native"), _run("python")
    for i, (frame, n, p) in enumerate(zip(_script(), native, python, strict=True)):
        assert n == p, (i, frame)
    taken = [s["got"] for s in python if type(s["got"]) is int]
    assert taken == [1, 2, 3, 4, 7, 8], "the script takes these versions"
    assert python[-1]["model"] == 0.0 and python[-2]["model"] == 32.0, "slot 0, then 2"


@pytest.mark.parametrize("kind", KINDS)
def test_versions_before_the_tick_are_acked_on_the_way_back_into_the_receive(kind):
    with _env(f"tick-{kind}") as env:
        follower = env.follower(kind)
        for seq in (1, 2, 3):
            slot = seq % SLOTS
            env.do(("write", slot, seq))
            env.feed.send(_receive(seq, seq, slot, b""))
        got = follower.next(0, -1, float("inf"))  # no beat due: on until the timeout
        assert got is None
        assert (env.state.version, env.state.last_seq, env.state.applied) == (3, 3, 3)
        assert env.acked() == [template(Ack, bus=BUS, worker_id="w-1", session=SESSION)(v)
                               for v in (1, 2, 3)]  # fmt: skip


def test_the_native_follower_refuses_a_state_without_the_slots_it_writes():
    """A slot renamed on the Python side fails at construction, not at the first version."""
    _native()
    assert set(NATIVE_WRITES) <= set(WorkerState.__slots__)

    class Renamed:
        __slots__ = tuple(n if n != "last_seq" else "sequence" for n in WorkerState.__slots__)

    with _env("renamed") as env:
        env.state = Renamed()  # type: ignore[assignment]
        with pytest.raises(TypeError, match="no slot last_seq"):
            env.follower("native")
        env.state = WorkerState()
        env.follower("native")  # the real one passes


def test_the_native_follower_refuses_a_switch_without_the_attributes_it_uses():
    """The Switch's attributes the C reads and writes by name are checked when it is
    built: one renamed on the Python side fails there, never at the first version."""
    _native()
    assert {"model", "swap", "holders", "at", "active"} <= set(Switch.__slots__)

    class Renamed:
        __slots__ = ("model", "swap", "holders", "position", "active")

    with _env("renamed-switch") as env:
        real, renamed = env.switch, Renamed()
        renamed.model, renamed.swap, renamed.holders = real.model, real.swap, real.holders
        renamed.position, renamed.active = real.at, real.active
        env.switch = renamed  # type: ignore[assignment]
        with pytest.raises(TypeError, match="no attribute at"):
            env.follower("native")
        env.switch = real
        env.follower("native")  # the real one passes


def _copy_script() -> list[Step]:
    """Copy mode: ("decline", slot, version) writes the slot and makes the copier
    decline once, ("tear-in-copy", slot, version) writes it and makes the writer start
    on it again while it is copied."""
    return [
        (("write", 1, 1), _receive(1, 1, 1, b"")),  # taken: copied, still whole
        (("write", 2, 2), _receive(2, 2, 2, b"\x01")),  # a partial version: left
        (None, _receive(2, 2, 2, b"")),  # taken
        (("tear-in-copy", 0, 3), _receive(3, 3, 0, b"")),  # torn while copied: left
        (("write", 0, 3), _receive(3, 3, 0, b"")),  # whole again: taken
        (("decline", 1, 4), _receive(4, 4, 1, b"")),  # the copier cannot: left
        (None, _receive(4, 4, 1, b"")),  # taken
        (("write", 1, 5), _receive(5, 5, 1, b"")),  # the same slot again: copied again
        (None, _receive(7, 6, 2, b"")),  # a gap: left
        (None, encode(Stop(BUS, 6, SESSION, "evicted"))),  # our STOP: left
    ]


def _run_copy(kind: str) -> list[dict[str, Any]]:
    with _env(f"copy-{kind}") as env:
        model = torch.zeros(16)
        plan: dict[str, Any] = {"decline": False, "tear": None}

        def copy(slot: int) -> bool:
            if plan["decline"]:
                plan["decline"] = False
                return False
            model.copy_(env.data[slot])
            if plan["tear"] == slot:  # the writer starts on the slot during the copy
                env.header.begin_write(slot)
                plan["tear"] = None
            return True

        follower = env.follower(kind, copy=copy)
        out = []
        for action, frame in _copy_script():
            if action is not None and action[0] == "decline":
                env.do(("write", action[1], action[2]))
                plan["decline"] = True
            elif action is not None and action[0] == "tear-in-copy":
                env.do(("write", action[1], action[2]))
                plan["tear"] = action[1]
            else:
                env.do(action)
            env.data[:, 0] += 1  # what each slot holds moves on: a copy shows when it ran
            env.feed.send(frame)
            before = env.state.last_heard
            got = follower.next(env.state.last_seq, env.state.version, 0.0)
            snap = env.snapshot(got, before)
            snap["model"] = model.tolist()
            out.append(snap)
        return out


def test_both_followers_copy_the_same_versions_in_copy_mode():
    native, python = _run_copy("native"), _run_copy("python")
    for i, (frame, n, p) in enumerate(zip(_copy_script(), native, python, strict=True)):
        assert n == p, (i, frame)
    taken = [s["got"] for s in python if type(s["got"]) is int]
    assert taken == [1, 2, 3, 4, 5], "the script takes these versions"
    assert all(s["held_slot"] is None for s in python), "a copy holds no slot"
