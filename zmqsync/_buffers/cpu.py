"""CPU buffers: a file in a tmpfs directory (default /dev/shm), mapped zero-copy.

* Created under a temporary name, locked, reserved with ``posix_fallocate`` (a full
  /dev/shm is a clear `SharedMemoryFull` now, never a SIGBUS later), then renamed.
* Every process that maps a segment holds a shared ``flock`` on it for as long as the
  mapping lives. `collect_garbage` removes segments whose lock is free: a SIGKILLed
  publisher leaks nothing for long, and a segment still in use is never removed.
* Subscribers open without create, refuse symlinks and anything but a regular file of
  the announced size, and map read-only: a worker that writes into aliased weights
  faults in that worker instead of corrupting everyone's.
* Subscribers map only what they checked on the opened descriptor: a file of the
  publisher's uid (their own, the control socket's owner, or the one configured), that
  no one else may write, whose bytes are all reserved. Whoever can truncate a mapped
  file kills the mapping process with SIGBUS on its next read, and a sparse file passes
  a size check with memory nobody reserved.
* A mapping is never closed while a tensor view of it is alive. ``torch.frombuffer``
  keeps a reference to the mmap object but no buffer export, so ``mmap.close()`` would
  unmap under live views (a segfault on next use). We therefore never call it: we drop
  our references, and the mapping (and the lock's file descriptor, via a finalizer)
  goes when the last view does.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import mmap
import os
import stat
import warnings
import weakref
from collections.abc import Iterator
from typing import Any, ClassVar

import torch

from .._errors import BufferUnavailable, ProtocolError, SharedMemoryFull
from .._gc import PREFIX, collect_garbage  # torch-free, for `zmqsync gc`
from .._protocol import BufferInfo
from .base import AttachedBuffer, SharedBuffer
from .header import HEADER_BYTES, Header

__all__ = ["CpuAttachment", "CpuSegment", "collect_garbage", "segment_name"]

log = logging.getLogger(__name__)

_FULL_ERRNOS = (errno.ENOSPC, errno.EFBIG, errno.ENOMEM, errno.EDQUOT)


def segment_name(bus_name: str, bus: str, device: str = "cpu") -> str:
    return f"{PREFIX}{bus_name}-{bus}-{device.replace(':', '')}"


def _free_bytes(directory: str) -> int:
    try:
        st = os.statvfs(directory)
    except OSError:
        return 0
    return st.f_bavail * st.f_frsize


@contextlib.contextmanager
def map_os_errors(path: str, needed: int) -> Iterator[None]:
    """Turn the OS's 'no room' errors into SharedMemoryFull, with what to do."""
    try:
        yield
    except OSError as exc:
        if exc.errno not in _FULL_ERRNOS:
            raise
        free = _free_bytes(os.path.dirname(path))
        raise SharedMemoryFull(
            f"cannot reserve {needed / 2**20:.1f} MiB for {path}: only {free / 2**20:.1f} MiB "
            f"free in {os.path.dirname(path)}; free space there, use fewer slots, pass "
            "shm_dir= (or ZMQSYNC_SHM_DIR) for a bigger tmpfs, or raise Docker's shm_size",
            path=path,
            needed=needed,
            free=free,
        ) from exc


def _as_tensor(mm: mmap.mmap) -> torch.Tensor:
    with warnings.catch_warnings():
        # A read-only mapping is read-only on purpose (see module docstring).
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(mm, dtype=torch.uint8)


class CpuSegment(SharedBuffer):
    """The publisher's segment: created, written, unlinked on close."""

    kind: ClassVar[str] = "cpu"

    def __init__(
        self, directory: str, name: str, *, slots: int, slot_bytes: int, gid: int | None = None
    ) -> None:
        self.path = os.path.join(directory, name)
        self.name = name
        self.size = HEADER_BYTES + slots * slot_bytes
        self.slots, self._slot_bytes = slots, slot_bytes
        tmp = os.path.join(directory, f".{name}.tmp")
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        placed = tmp  # the file to remove if this is cut short (a signal's exception too)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)
            if gid is not None:  # containers running as other uids of this group
                os.fchown(fd, -1, gid)
                os.fchmod(fd, 0o640)
            with map_os_errors(self.path, self.size):
                os.posix_fallocate(fd, 0, self.size)
            os.rename(tmp, self.path)
            placed = self.path
            self._mm = mmap.mmap(fd, self.size, flags=mmap.MAP_SHARED)
            self._words = memoryview(self._mm)[:HEADER_BYTES].cast("Q")
            self.header = Header.initialise(self._words, slots, slot_bytes)
            self._flat = _as_tensor(self._mm)
        except BaseException:
            os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(placed)
            raise
        self._fd: int | None = fd

    def slot(self, index: int) -> torch.Tensor:
        start = HEADER_BYTES + index * self._slot_bytes
        return self._flat[start : start + self._slot_bytes]

    def describe(self) -> BufferInfo:
        return BufferInfo("cpu", "cpu", self.name, self.size, HEADER_BYTES)

    def close(self) -> None:
        if self._fd is None:
            return
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        self.header.release()
        del self._flat, self._mm  # unmapped once no view of ours is left
        os.close(self._fd)
        self._fd = None

    def __repr__(self) -> str:
        state = "closed" if self._fd is None else f"{self.size} bytes"
        return f"<CpuSegment {self.path} {state}>"


class CpuAttachment(AttachedBuffer):
    """A subscriber's read-only mapping of a publisher's segment."""

    kind: ClassVar[str] = "cpu"

    def __init__(self, mm: mmap.mmap, fd: int, path: str, slot_bytes: int) -> None:
        self.path = path
        self._mm: mmap.mmap | None = mm
        self._slot_bytes = slot_bytes
        self._words = memoryview(mm)[:HEADER_BYTES].cast("Q")
        self.header = Header(self._words)
        self._flat: torch.Tensor | None = _as_tensor(mm)
        # The shared lock lives exactly as long as the mapping does.
        weakref.finalize(mm, os.close, fd)

    @classmethod
    def attach(
        cls, info: BufferInfo, *, slots: int, slot_bytes: int, **options: Any
    ) -> CpuAttachment:
        """Map the segment `info` names, read-only, after checking the opened file.

        Args:
            info: the segment as WELCOME describes it.
            slots, slot_bytes: the slots WELCOME announces in it.
            **options: ``shm_dir`` (required): where segments live. ``owner``: the uid
                the file must belong to (None: see ``control``). ``control``: the bus's
                control address; for ``ipc://`` the socket file's owner is the
                publisher's uid, else it is this process's.

        Raises:
            ProtocolError: the file is not one the publisher made for this WELCOME (a
                symlink, not a regular file, another owner, writable by others, smaller
                than announced, sparse, no valid header).
            BufferUnavailable: it cannot be opened here (another shm dir, no access).
        """
        directory = options["shm_dir"]
        control = options.get("control") or ""
        owner = _expected_owner(options.get("owner"), control)
        if "/" in info.segment or info.segment in (".", ".."):
            raise ProtocolError(f"segment name {info.segment!r} is not a plain file name")
        path = os.path.join(directory, info.segment)
        try:
            # O_NONBLOCK: a FIFO planted under a segment's name must not block open()
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise ProtocolError(f"segment {path} is a symlink; refusing to follow it") from exc
            raise BufferUnavailable(
                f"cannot open segment {info.segment} in {directory}: {exc.strerror}; "
                "publisher and subscriber must use the same shm dir (shm_dir= or "
                "ZMQSYNC_SHM_DIR) and, in containers, share it (ipc: or a volume)"
            ) from exc
        try:
            st = os.fstat(fd)  # the file we map, not whatever the name points to later
            if not stat.S_ISREG(st.st_mode):
                raise ProtocolError(f"segment {path} is not a regular file")
            _check_owner(path, st, owner, control)
            if st.st_size < info.size or info.size < HEADER_BYTES + slots * slot_bytes:
                raise ProtocolError(
                    f"segment {path} holds {st.st_size} bytes, WELCOME announced {info.size}"
                )
            if st.st_blocks * 512 < info.size:
                raise ProtocolError(
                    f"segment {path} is sparse: {st.st_blocks * 512} of its {info.size} "
                    "bytes are reserved. A zmqsync publisher reserves every byte "
                    "(posix_fallocate), so another program made this file, or the shm dir "
                    "is not on a tmpfs that reserves them; check what answers at the "
                    "address, and keep segments on a tmpfs (shm_dir= or ZMQSYNC_SHM_DIR)"
                )
            fcntl.flock(fd, fcntl.LOCK_SH)
            mm = mmap.mmap(fd, info.size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
        except BaseException:
            os.close(fd)
            raise
        attached = cls(mm, fd, path, slot_bytes)
        if not attached.header.valid(slots, slot_bytes):
            attached.close()
            raise ProtocolError(f"segment {path} has no valid header for {slots} slots")
        return attached

    def header_address(self) -> int:
        """Where the header's words are mapped. They stay mapped while a view of a slot
        lives (the mapping goes with its last view), whatever `close` did."""
        if self._flat is None:
            raise ValueError("buffer is closed")
        return int(self._flat.data_ptr())

    def slot(self, index: int) -> torch.Tensor:
        if self._flat is None:
            raise ValueError("buffer is closed")
        start = HEADER_BYTES + index * self._slot_bytes
        return self._flat[start : start + self._slot_bytes]

    def close(self) -> None:
        if self._mm is None:
            return
        self.header.release()
        self._flat = None
        self._mm = None  # unmapped (and unlocked) when the last tensor view dies


def _expected_owner(owner: int | None, control: str) -> tuple[int, str]:
    """The uid a segment must belong to, and where that expectation comes from.

    An ipc:// control socket lives in a runtime dir that is private, or shared with one
    group on purpose (``group=``): whoever owns the socket is the publisher. Over tcp://
    nothing names the publisher's uid, so it must be ours unless the user says otherwise.
    """
    if owner is not None:
        return owner, "the publisher_uid configured"
    if control.startswith("ipc://"):
        socket_path = control[len("ipc://") :]
        try:
            return os.stat(socket_path).st_uid, f"the owner of the control socket {socket_path}"
        except OSError:  # gone (its publisher with it), or an abstract socket: no file
            pass
    return os.getuid(), "this process's uid"


def _check_owner(path: str, st: os.stat_result, owner: tuple[int, str], control: str) -> None:
    """ProtocolError unless the segment is the publisher's and only it may change it."""
    uid, why = owner
    if st.st_uid != uid:
        where = f" at {control}" if control else ""
        raise ProtocolError(
            f"segment {path} is owned by uid {st.st_uid}, expected uid {uid} ({why}); "
            "a file of another user could be truncated under the mapping. If the "
            f"publisher{where} runs as uid {st.st_uid} on purpose (containers sharing a "
            f"group), pass Subscriber(security=Security(publisher_uid={st.st_uid})); "
            "otherwise another "
            "program answers at that address"
        )
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise ProtocolError(
            f"segment {path} is writable by others (mode {stat.S_IMODE(st.st_mode):o}): "
            "anyone who may write it could truncate it under the mapping. A zmqsync "
            "publisher makes segments 0600 (0640 with group=); check what answers at the "
            "address"
        )
