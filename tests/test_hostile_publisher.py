"""A fake publisher at a subscriber's address: what its WELCOME may make the subscriber do.

Any local process can take a subscriber's address first (a loopback tcp port, an ipc
path in a shared directory) and answer its HELLO. Each test here does that with real
sockets: a REP socket at the address answers every HELLO with a WELCOME built from
zmqsync's own message classes, next to an XPUB (events) and a PULL (acks) where
``resolve_endpoint`` lets a WELCOME point, and a segment file the test made in the shm
dir with a valid header.

The subscriber under attack runs in a subprocess with a data-size limit (RLIMIT_DATA,
set in ``preexec_fn`` before it runs any code): what a WELCOME makes it allocate past
that limit fails there with an allocation error, and never reaches this machine's OOM
killer. Each victim must fail fast, with a ProtocolError it handled (exit code 3), or,
where the WELCOME is legitimate, start and apply version 0 (exit code 0).
"""

from __future__ import annotations

import contextlib
import json
import math
import mmap
import os
import resource
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import zmq

import zmqsync
from zmqsync import _protocol as protocol
from zmqsync._buffers.header import HEADER_BYTES, Header
from zmqsync._config import XPUB_WELCOME
from zmqsync._protocol import (
    BufferInfo,
    TensorSpec,
    Welcome,
    contiguous_stride,
    encode,
)

ROOT = Path(__file__).resolve().parent.parent
MiB = 1 << 20
# The victim's data limit: the interpreter, torch, zmq and a small model need ~300 MiB
# of it (torch alone imports under 512 MiB); every attack below asks for at least twice
# the limit, so on code that trusted it the victim would die of an allocation error.
VICTIM_DATA_BYTES = 768 * MiB
ATTACK_BYTES = 2 * VICTIM_DATA_BYTES
TIMEOUT_S = 20.0  # the victim's handshake deadline (generous: a loaded host)
FAST_S = TIMEOUT_S / 2  # "fails fast": well within that deadline
OTHER_UID = 65534  # nobody
BUS, SESSION = "ab" * 8, "cd" * 8

# The subscriber under attack. Exit codes: 0 started, 3 refused with a zmqsync error
# (handled), 4 any other exception; a signal shows as a negative return code.
VICTIM = """
import json, sys, time
import zmqsync
address, timeout, uid = sys.argv[1], float(sys.argv[2]), sys.argv[3]
started = time.monotonic()
try:
    options = {"security": zmqsync.Security(publisher_uid=int(uid))} if uid else {}
    sub = zmqsync.Subscriber(address, timeout=timeout, **options).start()
except zmqsync.ZmqSyncError as exc:
    record, code = {"event": "refused", "type": type(exc).__name__, "message": str(exc)}, 3
except BaseException as exc:
    record, code = {"event": "crashed", "type": type(exc).__name__, "message": str(exc)}, 4
else:
    record, code = {"event": "started", "version": sub.version}, 0
    sub.close()
record["seconds"] = time.monotonic() - started
print(json.dumps(record), flush=True)
sys.exit(code)
"""


def _cap_data() -> None:  # runs in the child between fork and exec
    resource.setrlimit(resource.RLIMIT_DATA, (VICTIM_DATA_BYTES, VICTIM_DATA_BYTES))


def run_victim(address: str, publisher_uid: int | None = None) -> tuple[int, dict[str, Any]]:
    """Run a copy-mode Subscriber (no model: it allocates a tensor per manifest entry)
    against `address` under the data limit; its exit code and the record it printed."""
    try:
        done = subprocess.run(
            [sys.executable, "-c", VICTIM, address, str(TIMEOUT_S), str(publisher_uid or "")],
            capture_output=True,
            text=True,
            timeout=TIMEOUT_S + 40,  # the interpreter and torch load first
            cwd=ROOT,
            preexec_fn=_cap_data,
        )
    except subprocess.TimeoutExpired as exc:
        raise AssertionError(f"the victim did not exit: {exc.stderr!r}") from None
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    assert lines, f"rc={done.returncode}, no record; stderr: {done.stderr[-3000:]}"
    return done.returncode, json.loads(lines[-1])


def assert_refused(rc: int, record: dict[str, Any], *fragments: str) -> str:
    """The victim refused the WELCOME in time with a ProtocolError saying `fragments`."""
    assert rc >= 0, f"the victim was killed by {signal.Signals(-rc).name}: {record}"
    assert (rc, record["event"], record.get("type")) == (3, "refused", "ProtocolError"), record
    assert record["seconds"] < FAST_S, record
    for fragment in fragments:
        assert fragment in record["message"], (fragment, record["message"])
    return str(record["message"])


def assert_started(rc: int, record: dict[str, Any]) -> None:
    assert (rc, record["event"], record.get("version")) == (0, "started", 0), record


# --- the fake publisher ------------------------------------------------------------------


def spec(name: str, nbytes: int, offset: int, buffer: int = 0) -> TensorSpec:
    shape = (nbytes // 4,)
    return TensorSpec((name,), "float32", shape, contiguous_stride(shape), offset, nbytes, buffer)


def cpu_buffer(segment: str, slots: int, slot_bytes: int) -> BufferInfo:
    return BufferInfo("cpu", "cpu", segment, HEADER_BYTES + slots * slot_bytes, HEADER_BYTES)


def welcome(
    endpoints: dict[str, str],
    buffers: tuple[BufferInfo, ...],
    manifest: tuple[TensorSpec, ...],
    *,
    slots: int,
    slot_bytes: int,
) -> Welcome:
    return Welcome(
        bus=BUS,
        session=SESSION,
        seq=0,
        version=0,
        slot=0,
        slots=slots,
        slot_bytes=slot_bytes,
        heartbeat=0.5,
        events=endpoints["events"],
        acks=endpoints["acks"],
        tap="",
        buffers=buffers,
        manifest=manifest,
    )


def forged(msg: Welcome, **fields: Any) -> Welcome:
    """`msg` with `fields` set without `Welcome`'s checks: a fake publisher does not run
    them. `encode` then sends the fields as they are."""
    for field, value in fields.items():
        object.__setattr__(msg, field, value)
    return msg


class FakePublisher:
    """Control (REP), events (XPUB) and acks (PULL) at an address; every HELLO gets the
    same answer. A subscriber that accepts the WELCOME starts against it for real."""

    def __init__(self, address: str) -> None:
        self.ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self.control = self._bind(zmq.REP, address)
        self.address = self.control.getsockopt_string(zmq.LAST_ENDPOINT)
        sibling = self.address.rsplit(":", 1)[0] + ":*" if address.startswith("tcp") else None
        self.events = self._bind(zmq.XPUB, sibling or f"{address}.events")
        self.events.setsockopt(zmq.XPUB_WELCOME_MSG, XPUB_WELCOME)
        self.acks = self._bind(zmq.PULL, sibling or f"{address}.acks")
        self.endpoints = {
            "events": self.events.getsockopt_string(zmq.LAST_ENDPOINT),
            "acks": self.acks.getsockopt_string(zmq.LAST_ENDPOINT),
        }
        self.answer = b""
        self.hellos = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="fake-publisher", daemon=True)

    def _bind(self, kind: int, address: str) -> zmq.Socket[bytes]:
        sock = self.ctx.socket(kind)
        sock.linger = 0
        sock.bind(address)
        return sock

    def serve(self, msg: Welcome) -> FakePublisher:
        self.answer = encode(msg)
        self._thread.start()
        return self

    def _serve(self) -> None:
        # libzmq attaches a new subscriber to the XPUB (and sends it the welcome frame
        # a subscriber waits for) only when this thread uses that socket: poll it too.
        poller = zmq.Poller()
        poller.register(self.control, zmq.POLLIN)
        poller.register(self.events, zmq.POLLIN)
        while not self._stop.is_set():
            ready = dict(poller.poll(50))
            if self.events in ready:
                self.events.recv()  # a subscription
            if self.control in ready:
                self.control.recv()
                self.hellos += 1
                self.control.send(self.answer)

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(10)
        if not self.ctx.closed:
            self.ctx.destroy(linger=0)


@pytest.fixture
def fake(name, bus_dirs) -> Iterator[FakePublisher]:
    runtime, _ = bus_dirs
    publisher = FakePublisher(f"ipc://{runtime}/{name}.sock")
    yield publisher
    publisher.close()


@contextlib.contextmanager
def segment(
    shm: Path,
    name: str,
    *,
    slots: int,
    slot_bytes: int,
    backed: bool = True,
    owner: int | None = None,
) -> Iterator[str]:
    """A segment file as a publisher makes it (all bytes reserved, a valid header with
    version 0 in slot 0), or only as big (`backed` False: ftruncate, a sparse file).
    Removed afterwards, whatever happened."""
    path = shm / name
    size = HEADER_BYTES + slots * slot_bytes
    try:
        with open(os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600), "r+b") as f:
            if backed:
                os.posix_fallocate(f.fileno(), 0, size)
            else:
                os.ftruncate(f.fileno(), size)
            with mmap.mmap(f.fileno(), HEADER_BYTES) as mm, memoryview(mm) as raw:
                with raw.cast("Q") as words:
                    header = Header.initialise(words, slots, slot_bytes)
                    header.begin_write(0)
                    header.end_write(0, 0)
                    header.set_latest(0, 0)
            if owner is not None:
                os.fchown(f.fileno(), owner, owner)
        yield name
    finally:
        path.unlink(missing_ok=True)


def _seg(name: str) -> str:
    return f"zmqsync-{name}-{BUS}-cpu"


# --- what a manifest may ask a subscriber to allocate ------------------------------------


def test_overlapping_tensors_are_refused_before_anything_is_allocated(fake, name, bus_dirs):
    # 64 entries of 24 MiB, all at offset 0 of one 24 MiB slot: 1.5 GiB from a segment
    # the fake really reserved.
    _, shm = bus_dirs
    slot_bytes = 24 * MiB
    count = math.ceil(ATTACK_BYTES / slot_bytes)
    with segment(shm, _seg(name), slots=1, slot_bytes=slot_bytes) as seg:
        msg = welcome(
            fake.endpoints,
            (cpu_buffer(seg, 1, slot_bytes),),
            (spec("w0", slot_bytes, 0),),
            slots=1,
            slot_bytes=slot_bytes,
        )
        manifest = tuple(spec(f"w{i}", slot_bytes, 0) for i in range(count))
        fake.serve(forged(msg, manifest=manifest))
        message = assert_refused(
            *run_victim(fake.address), f"w0 (bytes 0 to {slot_bytes}) and w1", "overlap in buffer 0"
        )
    assert message.startswith("welcome: ")


def test_a_sparse_segment_is_refused_before_it_is_mapped(fake, name, bus_dirs):
    # A valid WELCOME on a file made with ftruncate: it passes a size check, but none of
    # its 1.5 GiB is reserved, so the tensors it lists would all be the victim's own.
    _, shm = bus_dirs
    tensor_bytes, count = 256 * MiB, ATTACK_BYTES // (256 * MiB)
    slot_bytes = tensor_bytes * count
    manifest = tuple(spec(f"w{i}", tensor_bytes, i * tensor_bytes) for i in range(count))
    with segment(shm, _seg(name), slots=1, slot_bytes=slot_bytes, backed=False) as seg:
        buffers = (cpu_buffer(seg, 1, slot_bytes),)
        fake.serve(welcome(fake.endpoints, buffers, manifest, slots=1, slot_bytes=slot_bytes))
        assert_refused(
            *run_victim(fake.address), f"segment {shm / seg} is sparse", "posix_fallocate"
        )


def test_tensors_that_add_up_past_the_segment_are_refused(fake, name, bus_dirs):
    # No overlap inside any buffer, but one 96 MiB tensor in each of 16 buffers (the CPU
    # segment and 15 CUDA buffers without a handle): a subscriber reading the CPU copy
    # would allocate 1.5 GiB for a 96 MiB slot.
    _, shm = bus_dirs
    slot_bytes = 96 * MiB
    gpus = tuple(
        BufferInfo("cuda", f"cuda:{i}", "", slot_bytes, 0, ipc_note="no handle: test")
        for i in range(15)
    )
    with segment(shm, _seg(name), slots=1, slot_bytes=slot_bytes) as seg:
        buffers = (cpu_buffer(seg, 1, slot_bytes), *gpus)
        msg = welcome(
            fake.endpoints, buffers, (spec("w0", slot_bytes, 0),), slots=1, slot_bytes=slot_bytes
        )
        manifest = tuple(spec(f"w{i}", slot_bytes, 0, buffer=i) for i in range(16))
        fake.serve(forged(msg, manifest=manifest))
        assert_refused(
            *run_victim(fake.address), f"add up to {16 * slot_bytes} bytes", "more than one slot"
        )


def test_more_tensor_views_than_a_subscriber_builds_are_refused(fake, name, bus_dirs):
    # Empty tensors take no room in a slot, but a subscriber builds a view of each in
    # every slot: 64 slots of 12,500 of them are 800,000 views (~600 MB).
    _, shm = bus_dirs
    slots, count = 64, 12_500
    assert slots * count > protocol.MAX_SLOT_VIEWS
    empty = tuple(spec(f"e{i}", 0, 0) for i in range(count))
    with segment(shm, _seg(name), slots=slots, slot_bytes=4096) as seg:
        buffers = (cpu_buffer(seg, slots, 4096),)
        fake.serve(welcome(fake.endpoints, buffers, empty, slots=slots, slot_bytes=4096))
        assert_refused(*run_victim(fake.address), "800000 tensor views", "fewer slots")


def test_a_big_legitimate_manifest_still_maps(name):
    # 20,000 small tensors (a mixture-of-experts model's count), 2 slots, under the cap.
    weights = {f"e{i}": torch.full((4,), float(i)) for i in range(20_000)}
    with zmqsync.Publisher(weights, name=name) as pub:
        rc, record = run_victim(pub.address)
        assert_started(rc, record)
        assert record["seconds"] < TIMEOUT_S, record
        assert pub.counters["handshakes"] == 1


# --- whose segment a subscriber maps ------------------------------------------------------

needs_root = pytest.mark.skipif(
    os.geteuid() != 0, reason="needs root to make files owned by another uid (chown)"
)


def _small(fake: FakePublisher, seg: str) -> Welcome:
    return welcome(
        fake.endpoints, (cpu_buffer(seg, 2, 4096),), (spec("w", 16, 0),), slots=2, slot_bytes=4096
    )


@needs_root
def test_a_segment_of_another_uid_is_refused(fake, name, bus_dirs):
    # The control socket is ours (this test's uid); the segment is nobody's: whoever owns
    # it could truncate it under the victim's mapping (SIGBUS on its next read).
    _, shm = bus_dirs
    with segment(shm, _seg(name), slots=2, slot_bytes=4096, owner=OTHER_UID) as seg:
        fake.serve(_small(fake, seg))
        message = assert_refused(
            *run_victim(fake.address),
            f"segment {shm / seg} is owned by uid {OTHER_UID}",
            f"expected uid {os.getuid()} (the owner of the control socket",
            f"Security(publisher_uid={OTHER_UID})",
        )
    assert fake.hellos == 1, "refused at the first WELCOME"
    assert "another program answers" in message


@needs_root
def test_an_ipc_bus_trusts_the_owner_of_its_control_socket(fake, name, bus_dirs):
    # A runtime dir shared with one group (``group=``): the publisher's uid is the
    # control socket's owner, and its segment is accepted; one of anyone else is not.
    runtime, shm = bus_dirs
    os.chown(runtime / f"{name}.sock", OTHER_UID, -1)
    with segment(shm, _seg(name), slots=2, slot_bytes=4096, owner=OTHER_UID) as seg:
        fake.serve(_small(fake, seg))
        assert_started(*run_victim(fake.address))
    fake.close()
    other = FakePublisher(f"ipc://{runtime}/{name}2.sock")
    try:
        os.chown(runtime / f"{name}2.sock", OTHER_UID, -1)
        with segment(shm, _seg(name + "2"), slots=2, slot_bytes=4096) as seg:
            other.serve(_small(other, seg))
            assert_refused(
                *run_victim(other.address),
                f"owned by uid {os.getuid()}, expected uid {OTHER_UID}",
                str(runtime / f"{name}2.sock"),
            )
    finally:
        other.close()


@needs_root
def test_a_tcp_bus_of_another_uid_needs_publisher_uid(name, bus_dirs):
    # Over tcp nothing names the publisher's uid: by default it must be ours, and a
    # publisher running as another uid (containers sharing a group) is accepted only
    # when the subscriber says so.
    _, shm = bus_dirs
    publisher = FakePublisher("tcp://127.0.0.1:*")
    try:
        with segment(shm, _seg(name), slots=2, slot_bytes=4096, owner=OTHER_UID) as seg:
            publisher.serve(_small(publisher, seg))
            assert_refused(
                *run_victim(publisher.address),
                f"expected uid {os.getuid()} (this process's uid)",
                f"pass Subscriber(security=Security(publisher_uid={OTHER_UID}))",
            )
            assert_started(*run_victim(publisher.address, publisher_uid=OTHER_UID))
    finally:
        publisher.close()
