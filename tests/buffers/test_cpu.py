"""CPU segments: create, attach read-only, the header seqlock, garbage collection, a full tmpfs.

Every segment lives in the per-test shm dir (``ZMQSYNC_SHM_DIR``, set by the
``bus_dirs`` fixture), which must be empty when the test ends. Anything that would
crash the process (a write into a read-only mapping) happens in a subprocess.
"""

from __future__ import annotations

import dataclasses
import errno
import gc
import mmap
import os
import shutil
import signal
import socket
import stat
import subprocess
import threading
import time

import pytest
import torch

import zmqsync
from zmqsync._buffers import CpuAttachment, CpuSegment, collect_garbage, segment_name
from zmqsync._buffers.cpu import map_os_errors
from zmqsync._buffers.header import HEADER_BYTES, Header
from zmqsync._protocol import BufferInfo

PAGE = 4096
BUS = "0123456789abcdef"

# A subprocess that maps a segment read-only, reports the first byte of slot 0, then
# either writes into it ("write": must die of SIGSEGV/SIGBUS) or holds it ("hold").
HOLDER = """
import json, os, sys, time
from zmqsync._buffers import CpuAttachment
from zmqsync._protocol import BufferInfo
segment, size, slots, slot_bytes, action = sys.argv[1:6]
info = BufferInfo("cpu", "cpu", segment, int(size), 4096)
att = CpuAttachment.attach(info, slots=int(slots), slot_bytes=int(slot_bytes),
                           shm_dir=os.environ["ZMQSYNC_SHM_DIR"])
view = att.slot(0)
print(json.dumps({"event": "ready", "first": int(view[0])}), flush=True)
if action == "write":
    view[0] = 42
    print(json.dumps({"event": "wrote"}), flush=True)
else:
    time.sleep(100)
"""

# A publisher that creates a segment, writes version 3 into slot 0, and waits to be killed.
CREATOR = """
import json, os, sys, time
from zmqsync._buffers import CpuSegment
seg = CpuSegment(os.environ["ZMQSYNC_SHM_DIR"], sys.argv[1], slots=1, slot_bytes=4096)
seg.header.begin_write(0)
seg.slot(0)[:4] = 7
seg.header.end_write(0, 3)
seg.header.set_latest(3, 0)
print(json.dumps({"event": "ready", "path": seg.path, "size": seg.size}), flush=True)
time.sleep(100)
"""


def _ready(record: dict) -> bool:
    return record.get("event") == "ready"


@pytest.fixture
def shm() -> str:
    return os.environ["ZMQSYNC_SHM_DIR"]


@pytest.fixture
def seg_name(name) -> str:
    return segment_name(name, BUS)


def _attach(seg: CpuSegment, shm: str, *, slots: int, slot_bytes: int = PAGE, **changes):
    info = dataclasses.replace(seg.describe(), **changes) if changes else seg.describe()
    return CpuAttachment.attach(info, slots=slots, slot_bytes=slot_bytes, shm_dir=shm)


def _info(segment: str, size: int) -> BufferInfo:
    return BufferInfo("cpu", "cpu", segment, size, HEADER_BYTES)


def _run_unblocking_fifo(fn, fifo: str, seconds: float = 2.0) -> tuple[bool, dict]:
    """Run `fn` in a thread; if it is still blocked after `seconds`, open `fifo` for
    writing (which releases a blocked open) so the thread can finish. Returns
    (was_blocked, {"value": ...} or {"error": ...})."""
    result: dict = {}

    def target() -> None:
        try:
            result["value"] = fn()
        except BaseException as exc:
            result["error"] = exc

    thread = threading.Thread(target=target, name="test-fifo-open", daemon=True)
    thread.start()
    thread.join(seconds)
    blocked = thread.is_alive()
    if blocked:
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        thread.join(10)
        assert not thread.is_alive(), "the blocked open did not return after a writer came"
    return blocked, result


# --- create -----------------------------------------------------------------------------


def test_segment_name_is_prefixed_and_plain():
    assert segment_name("policy", BUS) == f"zmqsync-policy-{BUS}-cpu"
    assert segment_name("policy", BUS, "cuda:1") == f"zmqsync-policy-{BUS}-cuda1"


def test_create_makes_a_private_regular_file_of_the_right_size(shm, seg_name):
    with CpuSegment(shm, seg_name, slots=3, slot_bytes=2 * PAGE) as seg:
        st = os.lstat(seg.path)
        assert seg.path == os.path.join(shm, seg_name)
        assert stat.S_ISREG(st.st_mode)
        assert stat.S_IMODE(st.st_mode) == 0o600
        assert st.st_uid == os.getuid()
        assert st.st_size == seg.size == HEADER_BYTES + 3 * 2 * PAGE
        assert os.listdir(shm) == [seg_name], "no temporary file is left behind"
        assert st.st_blocks * 512 >= seg.size, "the pages are reserved up front"
        info = seg.describe()
        assert (info.kind, info.device, info.segment, info.size, info.header_bytes) == (
            "cpu",
            "cpu",
            seg_name,
            seg.size,
            HEADER_BYTES,
        )
        assert seg.header.valid(3, 2 * PAGE)
        assert not seg.header.valid(2, 2 * PAGE)
        assert seg.header.latest() is None
        assert [seg.header.slot_version(i) for i in range(3)] == [-1, -1, -1]
        assert seg.slot(2).shape == (2 * PAGE,) and seg.slot(2).dtype == torch.uint8
        assert "bytes" in repr(seg)
    assert not os.path.exists(seg.path)
    assert "closed" in repr(seg)
    seg.close()  # idempotent


def test_slots_do_not_overlap_the_header_or_each_other(shm, seg_name):
    with CpuSegment(shm, seg_name, slots=2, slot_bytes=PAGE) as seg:
        seg.slot(0).fill_(1)
        seg.slot(1).fill_(2)
        assert seg.header.valid(2, PAGE), "writing slots left the header alone"
        att = _attach(seg, shm, slots=2)
        assert bool((att.slot(0) == 1).all()) and bool((att.slot(1) == 2).all())
        att.close()


# --- attach -----------------------------------------------------------------------------


def test_attach_sees_the_writers_bytes_and_header(shm, seg_name):
    with CpuSegment(shm, seg_name, slots=2, slot_bytes=PAGE) as seg:
        seg.slot(1)[:4] = torch.tensor([1, 2, 3, 4], dtype=torch.uint8)
        att = _attach(seg, shm, slots=2)
        assert att.slot(1)[:4].tolist() == [1, 2, 3, 4]
        seg.slot(1)[0] = 9
        assert int(att.slot(1)[0]) == 9, "one shared mapping, not a copy"
        att.close()
        att.close()  # idempotent
        with pytest.raises(ValueError, match="closed"):
            att.slot(0)


def test_attached_mapping_is_read_only_a_write_faults_the_writer(spawn, shm, seg_name):
    with CpuSegment(shm, seg_name, slots=1, slot_bytes=PAGE) as seg:
        seg.slot(0)[0] = 5
        proc = spawn("-c", HOLDER, seg.name, str(seg.size), "1", str(PAGE), "write", module="")
        assert proc.wait_for(_ready)["first"] == 5
        rc = proc.finish()
        assert rc in (-signal.SIGSEGV, -signal.SIGBUS), f"rc={rc} stderr={proc.stderr[-2000:]}"
        assert not [r for r in proc.records if r["event"] == "wrote"]
        assert int(seg.slot(0)[0]) == 5, "nothing reached the publisher's bytes"


def test_attach_refuses_a_missing_file_with_a_helpful_message(shm):
    with pytest.raises(zmqsync.BufferUnavailable) as info:
        CpuAttachment.attach(
            _info("zmqsync-gone-0000000000000000-cpu", HEADER_BYTES + PAGE),
            slots=1,
            slot_bytes=PAGE,
            shm_dir=shm,
        )
    message = str(info.value)
    assert f"cannot open segment zmqsync-gone-0000000000000000-cpu in {shm}" in message
    assert "No such file" in message
    assert "ZMQSYNC_SHM_DIR" in message and "same shm dir" in message
    assert isinstance(info.value, OSError)
    assert isinstance(info.value.__cause__, FileNotFoundError)


def test_attach_refuses_a_symlink(shm, seg_name):
    with CpuSegment(shm, seg_name, slots=1, slot_bytes=PAGE) as seg:
        link = os.path.join(shm, "zmqsync-symlink")
        os.symlink(seg.path, link)
        try:
            with pytest.raises(zmqsync.ProtocolError, match="symlink"):
                _attach(seg, shm, slots=1, segment="zmqsync-symlink")
        finally:
            os.unlink(link)


def test_attach_refuses_a_directory(shm):
    os.mkdir(os.path.join(shm, "zmqsync-dir"))
    try:
        with pytest.raises(zmqsync.ProtocolError, match="zmqsync-dir is not a regular file"):
            CpuAttachment.attach(
                _info("zmqsync-dir", HEADER_BYTES + PAGE), slots=1, slot_bytes=PAGE, shm_dir=shm
            )
    finally:
        os.rmdir(os.path.join(shm, "zmqsync-dir"))


def test_attach_refuses_a_fifo_without_blocking(shm):
    fifo = os.path.join(shm, "zmqsync-fifo")
    os.mkfifo(fifo, 0o600)
    try:
        blocked, result = _run_unblocking_fifo(
            lambda: CpuAttachment.attach(
                _info("zmqsync-fifo", HEADER_BYTES + PAGE), slots=1, slot_bytes=PAGE, shm_dir=shm
            ),
            fifo,
        )
        assert isinstance(result.get("error"), zmqsync.ProtocolError), result
        assert not blocked, "attach() blocked opening a FIFO"
    finally:
        os.unlink(fifo)


def test_attach_refuses_a_file_smaller_than_announced(shm):
    path = os.path.join(shm, "zmqsync-small")
    with open(path, "wb") as f:
        f.write(b"\0" * 100)
    try:
        with pytest.raises(zmqsync.ProtocolError, match="holds 100 bytes, WELCOME announced 8192"):
            CpuAttachment.attach(
                _info("zmqsync-small", HEADER_BYTES + PAGE), slots=1, slot_bytes=PAGE, shm_dir=shm
            )
    finally:
        os.unlink(path)


def test_attach_refuses_announced_sizes_that_do_not_add_up(shm, seg_name):
    with CpuSegment(shm, seg_name, slots=1, slot_bytes=PAGE) as seg:
        with pytest.raises(zmqsync.ProtocolError, match="WELCOME announced"):
            _attach(seg, shm, slots=1, size=seg.size + PAGE)  # bigger than the file
        with pytest.raises(zmqsync.ProtocolError, match="WELCOME announced"):
            _attach(seg, shm, slots=2)  # 2 slots cannot fit in the announced size


def test_attach_refuses_a_header_for_other_slots_or_no_header(shm, seg_name):
    with CpuSegment(shm, seg_name, slots=2, slot_bytes=PAGE) as seg:
        with pytest.raises(zmqsync.ProtocolError, match="no valid header for 1 slots"):
            _attach(seg, shm, slots=1)
    path = os.path.join(shm, "zmqsync-zeros")
    with open(path, "wb") as f:
        f.write(b"\0" * (HEADER_BYTES + PAGE))
    try:
        with pytest.raises(zmqsync.ProtocolError, match="no valid header"):
            CpuAttachment.attach(
                _info("zmqsync-zeros", HEADER_BYTES + PAGE), slots=1, slot_bytes=PAGE, shm_dir=shm
            )
    finally:
        os.unlink(path)


@pytest.mark.parametrize("segment", ["../etc/passwd", "a/b", ".", "..", "/dev/shm/x"])
def test_attach_refuses_segment_names_that_are_not_plain(shm, segment):
    with pytest.raises(zmqsync.ProtocolError, match="not a plain file name"):
        CpuAttachment.attach(
            _info(segment, HEADER_BYTES + PAGE), slots=1, slot_bytes=PAGE, shm_dir=shm
        )


# --- attach maps only the publisher's own, fully reserved file --------------------------

OTHER_UID = 65534  # nobody
needs_root = pytest.mark.skipif(
    os.getuid() != 0, reason="needs root to make files owned by another uid (chown)"
)


def _fake_segment(shm: str, name: str, *, slots: int, reserved: int) -> str:
    """A segment file with a valid header whose first `reserved` bytes are allocated;
    the rest of its size is a hole (ftruncate)."""
    path = os.path.join(shm, name)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, HEADER_BYTES + slots * PAGE)
        os.posix_fallocate(fd, 0, reserved)
        with mmap.mmap(fd, HEADER_BYTES) as mm:
            words = memoryview(mm).cast("Q")
            Header.initialise(words, slots, PAGE)
            words.release()
    finally:
        os.close(fd)
    return path


@pytest.mark.parametrize("reserved", [HEADER_BYTES, HEADER_BYTES + PAGE], ids=["1-of-3", "2-of-3"])
def test_attach_refuses_a_sparse_segment(shm, reserved):
    # ftruncate makes a file of any size without memory behind it: it passes the size
    # check, and what the subscriber then allocates for its tensors is its own.
    path = _fake_segment(shm, "zmqsync-sparse", slots=2, reserved=reserved)
    try:
        with pytest.raises(zmqsync.ProtocolError) as info:
            CpuAttachment.attach(
                _info("zmqsync-sparse", HEADER_BYTES + 2 * PAGE),
                slots=2,
                slot_bytes=PAGE,
                shm_dir=shm,
            )
        message = str(info.value)
        assert (
            f"segment {path} is sparse: {reserved} of its {HEADER_BYTES + 2 * PAGE} bytes"
            in message
        )
        assert "posix_fallocate" in message and "tmpfs" in message
    finally:
        os.unlink(path)


def test_attach_accepts_a_segment_once_every_byte_is_reserved(shm):
    path = _fake_segment(shm, "zmqsync-full", slots=2, reserved=HEADER_BYTES + 2 * PAGE)
    try:
        att = CpuAttachment.attach(
            _info("zmqsync-full", HEADER_BYTES + 2 * PAGE), slots=2, slot_bytes=PAGE, shm_dir=shm
        )
        att.close()
    finally:
        os.unlink(path)


@needs_root
def test_attach_refuses_a_segment_of_another_uid(shm, seg_name):
    # Its owner could truncate it under the mapping: SIGBUS on the subscriber's next read.
    with CpuSegment(shm, seg_name, slots=1, slot_bytes=PAGE) as seg:
        os.chown(seg.path, OTHER_UID, OTHER_UID)
        with pytest.raises(zmqsync.ProtocolError) as info:
            _attach(seg, shm, slots=1)
        message = str(info.value)
        assert f"segment {seg.path} is owned by uid {OTHER_UID}" in message
        assert f"expected uid {os.getuid()} (this process's uid)" in message
        assert f"Subscriber(security=Security(publisher_uid={OTHER_UID}))" in message
        described = seg.describe()
        att = CpuAttachment.attach(
            described, slots=1, slot_bytes=PAGE, shm_dir=shm, owner=OTHER_UID
        )
        att.close()  # the uid a user names is the one expected
        with pytest.raises(zmqsync.ProtocolError, match="expected uid 4242 \\(the publisher_uid"):
            CpuAttachment.attach(described, slots=1, slot_bytes=PAGE, shm_dir=shm, owner=4242)


@needs_root
def test_attach_expects_the_owner_of_an_ipc_control_socket(shm, seg_name, bus_dirs):
    # A runtime dir shared with one group (group=): the socket's owner is the publisher.
    runtime, _ = bus_dirs
    sock_path = str(runtime / "bus.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        listener.bind(sock_path)
        os.chown(sock_path, OTHER_UID, -1)
        control = f"ipc://{sock_path}"
        with CpuSegment(shm, seg_name, slots=1, slot_bytes=PAGE) as seg:
            info = seg.describe()
            with pytest.raises(zmqsync.ProtocolError) as refused:
                CpuAttachment.attach(info, slots=1, slot_bytes=PAGE, shm_dir=shm, control=control)
            assert f"owned by uid {os.getuid()}, expected uid {OTHER_UID}" in str(refused.value)
            assert f"(the owner of the control socket {sock_path})" in str(refused.value)
            os.chown(seg.path, OTHER_UID, -1)
            att = CpuAttachment.attach(info, slots=1, slot_bytes=PAGE, shm_dir=shm, control=control)
            att.close()
            # tcp (nothing names the publisher) or a socket gone with its publisher: ours
            for other in ("tcp://127.0.0.1:5555", f"ipc://{runtime}/gone.sock"):
                with pytest.raises(zmqsync.ProtocolError, match="this process's uid"):
                    CpuAttachment.attach(info, slots=1, slot_bytes=PAGE, shm_dir=shm, control=other)
    finally:
        listener.close()


@pytest.mark.parametrize("mode", [0o660, 0o602, 0o666], ids=lambda mode: f"{mode:o}")
def test_attach_refuses_a_segment_others_may_write(shm, seg_name, mode):
    # Anyone who may write it may truncate it. A publisher's segments are 0600, or 0640
    # with group= (readable, never writable, by the group).
    with CpuSegment(shm, seg_name, slots=1, slot_bytes=PAGE) as seg:
        os.chmod(seg.path, mode)
        with pytest.raises(zmqsync.ProtocolError, match=f"writable by others \\(mode {mode:o}\\)"):
            _attach(seg, shm, slots=1)
        os.chmod(seg.path, 0o640)
        _attach(seg, shm, slots=1).close()


# --- the header seqlock across two mappings ---------------------------------------------


def test_seqlock_rejects_reads_during_and_after_a_rewrite(shm, seg_name):
    with CpuSegment(shm, seg_name, slots=2, slot_bytes=PAGE) as seg:
        att = _attach(seg, shm, slots=2)
        writer, reader = seg.header, att.header
        assert reader.read_begin(0, 0) is None, "an empty slot holds no version"

        writer.begin_write(0)
        assert reader.read_begin(0, 1) is None, "odd counter: being written"
        writer.end_write(0, 1)
        counter = reader.read_begin(0, 1)
        assert counter is not None and counter % 2 == 0
        assert reader.slot_version(0) == 1
        assert reader.read_valid(0, counter)
        assert reader.read_begin(0, 2) is None, "the slot holds 1, not 2"

        writer.begin_write(1)
        writer.end_write(1, 2)
        assert reader.read_valid(0, counter), "writing another slot does not disturb slot 0"

        writer.begin_write(0)
        assert reader.read_begin(0, 1) is None
        assert reader.slot_version(0) == -1, "a slot being written holds no version"
        assert not reader.read_valid(0, counter), "a read overlapping a write is rejected"
        writer.end_write(0, 3)
        assert not reader.read_valid(0, counter), "even again, but a rewrite happened"
        assert reader.read_begin(0, 1) is None
        assert reader.read_begin(0, 3) == counter + 2
        att.close()


def test_latest_is_none_until_announced_then_follows_the_writer(shm, seg_name):
    with CpuSegment(shm, seg_name, slots=2, slot_bytes=PAGE) as seg:
        att = _attach(seg, shm, slots=2)
        assert att.header.latest() is None
        seg.header.set_latest(0, 0)
        assert att.header.latest() == (0, 0)
        seg.header.set_latest(7, 1)
        assert att.header.latest() == (7, 1)
        att.close()


# --- views outlive close() --------------------------------------------------------------


def test_views_outlive_close_and_keep_the_mapping_and_lock(shm, seg_name):
    seg = CpuSegment(shm, seg_name, slots=1, slot_bytes=PAGE)
    seg.slot(0)[:8] = torch.arange(8, dtype=torch.uint8)
    # A second name for the same file: it survives the publisher's unlink, so we can
    # watch collect_garbage decide whether the subscriber's lock is still held.
    link = os.path.join(shm, f"{seg_name}-link")
    os.link(seg.path, link)
    att = _attach(seg, shm, slots=1, segment=os.path.basename(link))
    view = att.slot(0)[:8]
    words = att.slot(0)[:16].view(torch.int64)
    att.close()
    del att
    gc.collect()
    assert view.tolist() == list(range(8)), "a view outlives CpuAttachment.close()"
    seg.slot(0)[0] = 99
    assert int(view[0]) == 99, "and still maps the publisher's pages"
    seg.close()
    assert not os.path.exists(seg.path)
    assert int(view[1]) == 1 and words.shape == (2,)
    assert collect_garbage(shm) == [], "live views keep the shared lock"
    del view, words
    gc.collect()
    assert collect_garbage(shm) == [link], "the lock goes with the last view"


def test_publisher_views_outlive_segment_close(shm, seg_name):
    seg = CpuSegment(shm, seg_name, slots=1, slot_bytes=PAGE)
    view = seg.slot(0)[:4]
    view.fill_(3)
    seg.close()
    assert view.tolist() == [3, 3, 3, 3]
    view.add_(1)
    assert view.tolist() == [4, 4, 4, 4]


# --- garbage collection -----------------------------------------------------------------


def test_gc_spares_a_segment_this_process_holds(shm, seg_name):
    with CpuSegment(shm, seg_name, slots=1, slot_bytes=PAGE) as seg:
        assert collect_garbage(shm) == []
        assert os.path.exists(seg.path)


def test_gc_spares_a_held_segment_and_removes_it_once_every_holder_died(spawn, shm, seg_name):
    creator = spawn("-c", CREATOR, seg_name, module="")
    made = creator.wait_for(_ready)
    path = made["path"]
    assert collect_garbage(shm) == [], "the live publisher holds its lock"
    holder = spawn("-c", HOLDER, seg_name, str(made["size"]), "1", str(PAGE), "hold", module="")
    assert holder.wait_for(_ready)["first"] == 7
    creator.kill()  # a crashed publisher: its fd is closed by the kernel, its file stays
    assert os.path.exists(path)
    assert collect_garbage(shm) == [], "a live subscriber still maps it"
    assert os.path.exists(path)
    holder.kill()
    assert collect_garbage(shm) == [path]
    assert not os.path.exists(path)
    assert collect_garbage(shm) == []


def test_gc_removes_unlocked_leftovers_and_only_zmqsync_files(shm, tmp_path):
    leaked = os.path.join(shm, "zmqsync-leaked-0000000000000000-cpu")
    other = os.path.join(shm, "not-ours")
    for path in (leaked, other):
        with open(path, "wb") as f:
            f.write(b"x")
    victim = tmp_path / "victim"
    victim.write_bytes(b"keep me")
    link = os.path.join(shm, "zmqsync-link-to-victim")
    os.symlink(victim, link)
    try:
        assert collect_garbage(shm) == [leaked]
        assert os.path.exists(other) and os.path.islink(link)
        assert victim.read_bytes() == b"keep me"
    finally:
        os.unlink(other)
        os.unlink(link)


def test_gc_gives_half_created_segments_a_grace_period(shm):
    tmp = os.path.join(shm, ".zmqsync-half-0000000000000000-cpu.tmp")
    with open(tmp, "wb") as f:
        f.write(b"x")
    assert collect_garbage(shm) == [], "a young temporary file may still be renamed"
    old = time.time() - 3600
    os.utime(tmp, (old, old))
    assert collect_garbage(shm) == [tmp]


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to create a file owned by another uid")
def test_gc_spares_other_users_files(shm):
    path = os.path.join(shm, "zmqsync-someone-else")
    with open(path, "wb") as f:
        f.write(b"x")
    os.chown(path, 12345, -1)
    try:
        assert collect_garbage(shm) == []
        assert os.path.exists(path)
    finally:
        os.unlink(path)


def test_gc_of_a_missing_directory_is_empty(tmp_path):
    assert collect_garbage(str(tmp_path / "nope")) == []


def test_gc_does_not_block_on_a_fifo(shm):
    fifo = os.path.join(shm, "zmqsync-fifo")
    os.mkfifo(fifo, 0o600)
    try:
        blocked, result = _run_unblocking_fifo(lambda: collect_garbage(shm), fifo)
        assert result.get("value") == [], result
        assert not blocked, "collect_garbage() blocked opening a FIFO"
    finally:
        os.unlink(fifo)


# --- a full tmpfs -----------------------------------------------------------------------


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EFBIG, errno.ENOMEM, errno.EDQUOT])
def test_map_os_errors_turns_no_room_into_shared_memory_full(tmp_path, code):
    path = str(tmp_path / "zmqsync-x")
    with pytest.raises(zmqsync.SharedMemoryFull) as info:
        with map_os_errors(path, 123):
            raise OSError(code, os.strerror(code))
    assert (info.value.path, info.value.needed) == (path, 123)
    assert info.value.__cause__.errno == code


@pytest.mark.parametrize("code", [errno.EACCES, errno.EIO, errno.EPERM])
def test_map_os_errors_lets_other_errors_through(tmp_path, code):
    with pytest.raises(OSError) as info:
        with map_os_errors(str(tmp_path / "x"), 1):
            raise OSError(code, os.strerror(code))
    assert not isinstance(info.value, zmqsync.SharedMemoryFull)
    assert info.value.errno == code


@pytest.fixture
def small_tmpfs(tmp_path):
    """A 1 MiB tmpfs, mounted for the test and unmounted after it."""
    mnt = tmp_path / "tiny"
    mnt.mkdir()
    if shutil.which("mount") is None:
        pytest.skip("no mount command here: cannot make a small tmpfs")
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1m,mode=0700", "tmpfs", str(mnt)],
        capture_output=True,
        text=True,
        timeout=30,
    )
    if done.returncode != 0:
        pytest.skip(
            f"mounting a tmpfs is not permitted here (needs CAP_SYS_ADMIN): {done.stderr.strip()}"
        )
    try:
        yield str(mnt)
    finally:
        subprocess.run(["umount", str(mnt)], check=True, timeout=30)


def test_full_tmpfs_raises_shared_memory_full_and_leaves_nothing(small_tmpfs, seg_name):
    with CpuSegment(small_tmpfs, "zmqsync-fits", slots=1, slot_bytes=PAGE):
        pass  # a segment that fits is fine
    with pytest.raises(zmqsync.SharedMemoryFull) as info:
        CpuSegment(small_tmpfs, seg_name, slots=2, slot_bytes=2**20)
    exc = info.value
    assert exc.path == os.path.join(small_tmpfs, seg_name)
    assert exc.needed == HEADER_BYTES + 2 * 2**20
    assert 0 <= exc.free <= 2**20
    assert isinstance(exc, OSError)
    assert isinstance(exc.__cause__, OSError) and exc.__cause__.errno == errno.ENOSPC
    message = str(exc)
    assert "2.0 MiB" in message and small_tmpfs in message
    assert "shm_size" in message and "ZMQSYNC_SHM_DIR" in message
    assert os.listdir(small_tmpfs) == [], "the temporary file is removed"


def test_publisher_on_a_full_tmpfs_raises_shared_memory_full(small_tmpfs, name, bus_dirs):
    runtime, _ = bus_dirs
    weights = {"w": torch.zeros(2**18)}  # 1 MiB; 2 slots cannot fit in 1 MiB
    with pytest.raises(zmqsync.SharedMemoryFull, match="shm_size") as info:
        with zmqsync.Publisher(weights, name=name, shm_dir=small_tmpfs):
            pass
    assert info.value.needed >= 2 * 2**20
    assert info.value.path.startswith(small_tmpfs + os.sep)
    assert os.listdir(small_tmpfs) == []
    assert os.listdir(runtime) == [], "no socket was bound"
