"""The native per-version paths: a worker's (`_native.Follower`), its waiters' (`Gate`),
and the publisher's ACK reader (`AckReader`).

The Follower must take only RECEIVEs that `read_receive` takes, with the same fields
(checked byte for byte, on the publisher's frames, their mutations and hypothesis'
frames), write ACKs byte for byte as the template does, and leave every worker's view
unchanged: a plain worker process that follows a publisher with it sees every version
whole, as one started with ZMQSYNC_NATIVE=0 (the Python way) does. The alias-mode tests
of test_fixed_cost run every way in one process too.
"""

from __future__ import annotations

import os
import random
import threading
import time

import msgpack
import pytest
import torch
import zmq
from hypothesis import given, settings
from hypothesis import strategies as st

import zmqsync
from tests.helpers import native as native_helper
from tests.test_fixed_cost import BUS, _acks, _receives
from zmqsync._fast_frames import (
    ack_pattern,
    read_ack,
    read_receive,
    receive_pattern,
    template,
    template_pieces,
)
from zmqsync._follow import libzmq_path, zmq_error
from zmqsync._protocol import Ack, Receive, decode

native = native_helper.module(at_module_level=True)
if not hasattr(native, "Follower"):
    native_helper.missing("an older build of the native extension", at_module_level=True)

PIECES, RANGES = receive_pattern(BUS)


def _match(frame: bytes) -> tuple[int, int, int] | None:
    return native.match_receive(PIECES, RANGES, frame)  # type: ignore[no-any-return]


def _read(frame: bytes) -> tuple[int, int, int] | None:
    fields = read_receive(frame, BUS)
    return None if fields is None else fields[:3]


def _frames() -> list[bytes]:
    """test_fixed_cost's RECEIVEs, and one at the top of every range."""
    top = template(Receive, bus=BUS)(2**63 - 1, 2**63 - 1, 0, b"\x00" * 300)
    return [*_receives(), top]


def test_the_follower_reads_the_publishers_receives_as_read_receive_does():
    for frame in _frames():
        assert _match(frame) == _read(frame) is not None
    other = receive_pattern("fedcba9876543210")
    assert all(native.match_receive(*other, frame) is None for frame in _frames())


def test_it_takes_nothing_read_receive_refuses_and_reads_the_same_fields():
    rng = random.Random(11)
    taken = 0
    for frame in _frames():
        cuts = [frame[:cut] for cut in range(len(frame))]
        flips = []
        for _ in range(400):
            data = bytearray(frame)
            for _ in range(rng.randint(1, 3)):
                data[rng.randrange(len(data))] = rng.randrange(256)
            flips.append(bytes(data))
        for data in [*cuts, *flips, frame + b"\x00"]:
            fields = _match(data)
            if fields is not None:
                taken += 1
                assert fields == _read(data), data
    assert taken > 0, "some mutations (a changed field value) are still RECEIVEs"


_INT = st.one_of(
    st.integers(-(2**63), 2**63 - 1),
    st.sampled_from([0, 127, 128, 255, 256, 65_535, 65_536, 2**32 - 1, 2**32, -1, -32, -33]),
)


def _packed(value: int, width: int) -> bytes:
    """`value` in a msgpack int form longer than the shortest (decoders take any)."""
    if value < 0:
        tag = {1: 0xD0, 2: 0xD1, 4: 0xD2, 8: 0xD3}[width]
        return bytes([tag]) + value.to_bytes(width, "big", signed=True)
    tag = {1: 0xCC, 2: 0xCD, 4: 0xCE, 8: 0xCF}[width]
    return bytes([tag]) + value.to_bytes(width, "big")


@settings(max_examples=300, deadline=None)
@given(
    seq=_INT,
    version=_INT,
    slot=_INT,
    changed=st.binary(max_size=40),
    widths=st.lists(st.sampled_from([0, 1, 2, 4, 8]), min_size=3, max_size=3),
)
def test_any_int_form_of_any_field_is_read_as_read_receive_reads_it(
    seq, version, slot, changed, widths
):
    parts = []
    for value, width in zip((seq, version, slot), widths, strict=True):
        fits = width and (-(2 ** (8 * width - 1)) <= value < 0 or 0 <= value < 2 ** (8 * width))
        parts.append(_packed(value, width) if fits else msgpack.packb(value))
    head, after_seq, after_version, after_slot, tail = PIECES
    frame = b"".join(
        [head, parts[0], after_seq, parts[1], after_version, parts[2], after_slot]
        + [msgpack.packb(changed, use_bin_type=True), tail]
    )
    assert _match(frame) == _read(frame)


@settings(max_examples=300, deadline=None)
@given(st.integers(-(2**63), 2**63 - 1))
def test_acks_are_packed_as_msgpack_packs_them(value):
    assert native.pack_int(value) == msgpack.packb(value)


def test_an_ack_from_its_pieces_is_the_templates():
    head, tail = template_pieces(Ack, bus=BUS, worker_id="w-1", session="00aa11bb22cc33dd")
    frame = template(Ack, bus=BUS, worker_id="w-1", session="00aa11bb22cc33dd")
    for version in (0, 1, 127, 128, 70_000, 2**40):
        assert head + native.pack_int(version) + tail == frame(version)


# --- the gate ---------------------------------------------------------------------------


def _waits(gate, version: int, timeout: float, out: list[tuple[bool, float]]) -> None:
    start = time.monotonic()
    out.append((gate.wait(version, timeout), time.monotonic() - start))


def test_a_gate_wakes_the_threads_waiting_for_a_version_it_reaches():
    gate = native.Gate()
    assert gate.version == -1 and gate.wait(-1, 0.0)
    got: list[tuple[bool, float]] = []
    threads = [threading.Thread(target=_waits, args=(gate, 3, 20.0, got)) for _ in range(3)]
    for t in threads:
        t.start()
    time.sleep(0.1)
    gate.open(2)  # not yet
    time.sleep(0.1)
    assert got == []
    gate.open(3)
    for t in threads:
        t.join(20)
    assert [reached for reached, _ in got] == [True] * 3
    assert gate.version == 3 and gate.wait(2, 0.0)


def test_a_gate_wait_times_out_and_a_kick_ends_it_early():
    gate = native.Gate(5)
    assert gate.wait(6, 0.05) is False
    got: list[tuple[bool, float]] = []
    waiter = threading.Thread(target=_waits, args=(gate, 6, 20.0, got))
    waiter.start()
    time.sleep(0.1)
    gate.kick()  # look at something else (a close): the version was not reached
    waiter.join(20)
    assert got and got[0][0] is False and got[0][1] < 10
    assert gate.wait(5, None) is True, "no limit, and reached already"


def test_close_releases_a_thread_waiting_for_a_version_at_once(name):
    with zmqsync.Publisher(torch.nn.Linear(4, 4), name=name, timeout=20):
        sub = zmqsync.Subscriber(
            name=name, model=torch.nn.Linear(4, 4), reads=zmqsync.Aliases()
        ).start()
        errors: list[BaseException] = []

        def wait() -> None:
            try:
                sub.wait_for_version(10**6, timeout=None)
            except BaseException as exc:  # the ClosedError it must raise
                errors.append(exc)

        waiter = threading.Thread(target=wait)
        waiter.start()
        time.sleep(0.2)
        start = time.monotonic()
        sub.close()
        waiter.join(20)
        assert not waiter.is_alive() and time.monotonic() - start < 10
        assert [type(e) for e in errors] == [zmqsync.ClosedError]


# --- whole workers, both ways -----------------------------------------------------------


def _fill(model: torch.nn.Module, step: int) -> float:
    with torch.no_grad():
        for i, p in enumerate(model.parameters()):
            p.fill_(step + i / 8)
        return float(sum(p.sum() for p in model.parameters()))


@pytest.mark.parametrize("way", ["native", "python"])
def test_a_plain_worker_process_sees_every_version_whole(name, spawn, monkeypatch, way):
    if way == "python":
        monkeypatch.setenv("ZMQSYNC_NATIVE", "0")
    elif os.environ.get("ZMQSYNC_NATIVE") == "0":
        native_helper.missing("ZMQSYNC_NATIVE=0 turns the native path off")
    trainer = torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(4)])
    with zmqsync.Publisher(trainer, name=name, timeout=20) as pub:
        worker = spawn("tests/helpers/follow_worker.py", name, module="")
        worker.wait_for(lambda r: r.get("event") == "ready", timeout=60)
        for step in range(1, 31):
            expected = _fill(trainer, step)
            pub.publish()
            seen = worker.wait_for(
                lambda r, v=pub.version: r.get("event") == "seen" and r["version"] == v,
                timeout=20,
            )
            assert seen["sum"] == pytest.approx(expected, rel=1e-6), step
    done = worker.wait_for(lambda r: r.get("event") == "done", timeout=20)["counters"]
    assert done["applied"] >= 30 and done["gaps"] == 0
    if way == "native":
        assert done["native"] >= 25, done  # all but the first few (before the switch)
    else:
        assert done["native"] == 0, done


# --- the publisher's side: ACKs read in batches ------------------------------------------


def test_the_ack_reader_takes_only_what_read_ack_takes_with_the_same_fields():
    decode(_acks()[0])  # its worker id and session pass their checks once
    rng = random.Random(5)
    frames = list(_acks())
    for frame in _acks():
        frames += [frame[:cut] for cut in range(len(frame))]
        for _ in range(200):
            data = bytearray(frame)
            data[rng.randrange(len(data))] = rng.randrange(256)
            frames.append(bytes(data))
    other = template(Ack, bus=BUS, worker_id="never-checked", session="00aa11bb22cc33dd")
    frames.append(other(3))  # a worker id no check passed yet: decode's to judge
    ctx = zmq.Context()
    pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    try:
        pull.bind("inproc://acks")
        push.connect("inproc://acks")
        pull.rcvtimeo = 1000
        reader = native.AckReader(
            libzmq=libzmq_path(),
            socket=pull,
            pieces=ack_pattern(BUS)[0],
            versions=ack_pattern(BUS)[1],
            ids=ack_pattern(BUS)[2],
            sessions=ack_pattern(BUS)[3],
            error=zmq_error,
        )
        for frame in frames:
            push.send(frame)
        push.send_multipart([b"a", b"b"])
        items: list[tuple] = []
        while len(items) < len(frames) + 1:
            got = reader.read(1000)
            assert got, "every frame sent is read"
            items += got
        assert reader.read(10) == [], "nothing more queued: returns after RCVTIMEO"
    finally:
        ctx.destroy(linger=0)
    taken = 0
    for frame, item in zip(frames, items, strict=False):
        if type(item[0]) is str:
            taken += 1
            assert item == read_ack(frame, BUS), frame
        else:
            assert item == (frame, False)
    assert taken >= len(_acks()) and items[len(frames) - 1] == (frames[-1], False)
    assert items[-1] == (b"a", True), "a multipart message comes whole, as its first frame"
