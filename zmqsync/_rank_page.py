"""The page a sharded trainer's ranks coordinate through: one small shared file per bus.

A sharded publisher is one bus hosted by one rank (the host: it owns the sockets, the
segment and the slots); every other rank (a peer) maps the segment and writes its own
shards into the slot the host names. Each publish is numbered the same on every rank
(the n-th call of ``publish()``, start's version 0 being number 0), and goes:

1. the host claims a slot, marks it being written (the seqlock), and posts ``go``:
   number, slot, version;
2. every rank writes its shards; a peer then posts ``written`` = number (or ``failed``
   = number, when its own publish raised before writing);
3. the host, once every rank wrote, completes the slot, announces the version and posts
   the ``outcome`` of the number: done, or failed (and by whose fault), which every
   peer waits for.

Each rank holds a lock on a byte of its own (`_lock`) for as long as it lives, so a
rank that died is seen at once (the kernel drops a dead process's locks, a zombie's
too), not at the deadline. Every wait has one. Words are aligned 8-byte stores, written
in the order readers read them backwards (slot and version before the number), as the
header's seqlock relies on (see `_buffers.header`).

No torch and no sockets: the page is words in a file, the waits are a bounded backoff.
"""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
import struct
import time
from collections.abc import Callable

from ._deadline import Deadline
from ._errors import RanksFailed
from ._gc import PREFIX

__all__ = ["MAX_RANKS", "RankPage", "RanksFailed", "page_name"]

PAGE_BYTES = 4096
_MAGIC = 0x31534B4E4152535A  # b"ZSRANKS1" little-endian
_EMPTY = (1 << 64) - 1
# words
_W_MAGIC, _W_RANKS, _W_DIGEST, _W_GO_N, _W_GO_SLOT, _W_GO_VERSION = range(6)
_W_OUT_N, _W_OUT, _W_CLOSED = 6, 7, 8
_FIRST_RANK, _RANK_WORDS = 16, 3  # per rank: pid, written number, failed number
MAX_RANKS = (PAGE_BYTES // 8 - _FIRST_RANK) // _RANK_WORDS
_LOCKS_AT = PAGE_BYTES  # rank r's liveness lock: byte _LOCKS_AT + r (beyond the data)
_OUT_DONE = 0  # outcome word: 0 done, else 1 + the index of the rank that failed it

_SPIN_MIN_S, _SPIN_MAX_S = 20e-6, 2e-3  # the waits' backoff: a publish is milliseconds


def _lock(fd: int, kind: int, at: int) -> None:
    """Lock (or unlock) one byte with an open file description lock: held by this
    opening of the file, not by the process, so closing another descriptor of the page
    in this process (`zmqsync gc` does) keeps it, and a dead process's goes with it."""
    flock = struct.pack("@hhqqi4x", kind, os.SEEK_SET, at, 1, 0)  # struct flock, l_pid 0
    fcntl.fcntl(fd, fcntl.F_OFD_SETLK, flock)


def page_name(bus_name: str, bus_id: str) -> str:
    return f"{PREFIX}{bus_name}-{bus_id}-ranks"


def _reached(word: int, number: int) -> bool:
    return word != _EMPTY and word >= number


class RankPage:
    """One rank's view of the page. `index` is the rank's place in the trainer's group
    (0: the host)."""

    def __init__(self, fd: int, path: str, index: int) -> None:
        self.path, self.index = path, index
        self._fd: int | None = fd
        self._mm = mmap.mmap(fd, PAGE_BYTES, flags=mmap.MAP_SHARED)
        self._w = memoryview(self._mm).cast("Q")
        _lock(fd, fcntl.F_WRLCK, _LOCKS_AT + index)

    # --- opening ------------------------------------------------------------------

    @classmethod
    def create(cls, directory: str, name: str, ranks: int, digest: int) -> RankPage:
        """The host's: a new page for `ranks` ranks whose layouts hash to `digest`."""
        if not 1 <= ranks <= MAX_RANKS:
            raise ValueError(f"a sharded publisher takes 1 to {MAX_RANKS} ranks, not {ranks}")
        path, tmp = os.path.join(directory, name), os.path.join(directory, f".{name}.tmp")
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)  # in use: `zmqsync gc` leaves it alone
            os.posix_fallocate(fd, 0, PAGE_BYTES)
            page = cls(fd, path, 0)
            w = page._w
            for i in range(len(w)):
                w[i] = _EMPTY
            w[_W_RANKS], w[_W_DIGEST], w[_W_CLOSED] = ranks, digest, 0
            for r in range(ranks):
                w[_FIRST_RANK + _RANK_WORDS * r] = 0  # pid: not joined yet
            w[_FIRST_RANK] = os.getpid()
            w[_W_MAGIC] = _MAGIC  # last: a peer that sees it sees the rest
            os.rename(tmp, path)
        except BaseException:
            os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        return page

    @classmethod
    def attach(
        cls, directory: str, name: str, index: int, ranks: int, digest: int, deadline: Deadline
    ) -> RankPage:
        """A peer's: the host's page once it exists (it appears when the host starts).

        Raises:
            RanksFailed: no page within the deadline, or one for another group or layout.
        """
        path = os.path.join(directory, name)
        while True:
            with contextlib.suppress(FileNotFoundError):
                fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
                break
            if deadline.expired():
                raise RanksFailed(
                    f"rank {index}: the host rank opened no bus within {deadline.total} s "
                    f"({path} never appeared); did its Publisher.start() fail?"
                )
            time.sleep(0.005)
        try:
            if os.fstat(fd).st_uid != os.getuid():
                raise RanksFailed(f"{path} belongs to another user; refusing to write into it")
            fcntl.flock(fd, fcntl.LOCK_SH)
            page = cls(fd, path, index)
        except BaseException:
            os.close(fd)
            raise
        w = page._w
        if w[_W_MAGIC] != _MAGIC or w[_W_RANKS] != ranks or w[_W_DIGEST] != digest:
            page.close()
            raise RanksFailed(
                f"rank {index}: {path} is not this trainer's page ({ranks} ranks, this "
                "layout); every rank must build the same model and Publisher"
            )
        w[_FIRST_RANK + _RANK_WORDS * index] = os.getpid()
        return page

    def close(self, *, unlink: bool = False) -> None:
        """Unmap; the host also marks the page closed (peers waiting see it) and removes
        it. Idempotent."""
        if self._fd is None:
            return
        if unlink:
            self._w[_W_CLOSED] = 1
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)
        self._w.release()
        self._mm.close()
        os.close(self._fd)  # drops this rank's locks
        self._fd = None

    # --- the host ------------------------------------------------------------------

    def go(self, number: int, slot: int, version: int) -> None:
        """Publish `number` writes `version` into `slot` (marked being written)."""
        w = self._w
        w[_W_GO_SLOT], w[_W_GO_VERSION] = slot, version
        w[_W_GO_N] = number

    def wait_written(self, number: int, version: int, deadline: Deadline) -> None:
        """Return once every peer wrote its shards of publish `number`.

        Raises:
            RanksFailed: a peer died, failed its publish, or did not write in time.
        """

        def missing() -> list[int]:
            return [r for r in range(1, self._ranks) if not _reached(self._word(r, 1), number)]

        def check() -> None:
            for r in missing():
                if _reached(self._word(r, 2), number):
                    raise self._fail(number, r, f"rank {r}'s publish() raised before writing")
                if self._word(r, 0) and not self._alive(r):
                    pid = self._word(r, 0)
                    raise self._fail(
                        number, r, f"rank {r} (pid {pid}) died or closed its publisher"
                    )

        if not self._wait(lambda: not missing(), check, deadline):
            late = missing()
            raise self._fail(
                number,
                late[0],
                f"rank(s) {', '.join(map(str, late))} did not write their shards within "
                f"{deadline.total} s (stalled, or publishing less often than the others)",
                version,
            )

    def outcome(self, number: int, failed_by: int | None = None) -> None:
        """Publish `number` is over: announced (None) or failed by rank `failed_by`."""
        w = self._w
        w[_W_OUT] = _OUT_DONE if failed_by is None else 1 + failed_by
        w[_W_OUT_N] = number

    def _fail(self, number: int, rank: int, why: str, version: int | None = None) -> RanksFailed:
        self.outcome(number, rank)
        v = f"version {version}" if version is not None else f"publish {number}"
        return RanksFailed(f"{v} was not published: {why}; workers keep the last complete version")

    # --- a peer --------------------------------------------------------------------

    def wait_go(self, number: int, deadline: Deadline) -> tuple[int, int]:
        """The (slot, version) publish `number` writes, once the host posted it.

        Raises:
            RanksFailed: the host failed this publish, died, closed, or moved past it.
        """
        w = self._w

        def posted() -> bool:
            return _reached(w[_W_GO_N], number) or _reached(w[_W_OUT_N], number)

        if not self._wait(posted, self._host_check, deadline):
            raise RanksFailed(
                f"rank {self.index}: the host posted no slot for publish {number} within "
                f"{deadline.total} s (its workers may hold every slot, or it is stalled)"
            )
        if _reached(w[_W_OUT_N], number):  # failed before a slot was posted
            raise self._failed(number)
        if w[_W_GO_N] != number:
            raise RanksFailed(
                f"rank {self.index}: the host is at publish {w[_W_GO_N]}, this rank at "
                f"{number}: every rank must call publish() as often as the others"
            )
        return w[_W_GO_SLOT], w[_W_GO_VERSION]

    def written(self, number: int) -> None:
        self._w[_FIRST_RANK + _RANK_WORDS * self.index + 1] = number

    def failed(self, number: int) -> None:
        """This rank's publish `number` raised before writing: the host stops waiting."""
        self._w[_FIRST_RANK + _RANK_WORDS * self.index + 2] = number

    def wait_outcome(self, number: int, deadline: Deadline) -> None:
        """Return once the host announced publish `number`.

        Raises:
            RanksFailed: it failed (the reason names the rank), or no word in time.
        """
        w = self._w
        if not self._wait(lambda: _reached(w[_W_OUT_N], number), self._host_check, deadline):
            raise RanksFailed(
                f"rank {self.index}: the host announced nothing for publish {number} within "
                f"{deadline.total} s"
            )
        if w[_W_OUT] != _OUT_DONE:
            raise self._failed(number)

    def announced(self) -> int | None:
        """The number of the last publish the host announced (None: none yet)."""
        w = self._w
        return None if w[_W_OUT_N] == _EMPTY or w[_W_OUT] != _OUT_DONE else w[_W_OUT_N]

    def _failed(self, number: int) -> RanksFailed:
        culprit = self._w[_W_OUT] - 1
        who = "the host's own step" if culprit == 0 else f"rank {culprit}"
        return RanksFailed(
            f"rank {self.index}: publish {number} failed ({who}: see that rank's error); "
            "workers keep the last complete version"
        )

    def _host_check(self) -> None:
        if self._w[_W_CLOSED]:
            raise RanksFailed(f"rank {self.index}: the host rank closed its publisher")
        if not self._alive(0):
            raise RanksFailed(
                f"rank {self.index}: the host rank (pid {self._word(0, 0)}) died; "
                "workers keep the last complete version"
            )

    # --- words, liveness, waits ----------------------------------------------------

    @property
    def _ranks(self) -> int:
        return self._w[_W_RANKS]

    def _word(self, rank: int, which: int) -> int:
        return self._w[_FIRST_RANK + _RANK_WORDS * rank + which]

    def _alive(self, rank: int) -> bool:
        """Whether rank `rank` still holds its lock (taking it proves it is gone)."""
        assert self._fd is not None
        try:
            _lock(self._fd, fcntl.F_WRLCK, _LOCKS_AT + rank)
        except OSError:
            return True
        _lock(self._fd, fcntl.F_UNLCK, _LOCKS_AT + rank)
        return False

    @staticmethod
    def _wait(done: Callable[[], bool], check: Callable[[], None], deadline: Deadline) -> bool:
        """Poll `done` with a backoff up to `_SPIN_MAX_S`, calling `check` (which raises
        what ends the wait early) every few ms; False at the deadline."""
        pause, checked = _SPIN_MIN_S, time.monotonic()
        while not done():
            now = time.monotonic()
            if now - checked >= 0.005:
                check()
                checked = now
            if deadline.expired():
                return done()
            time.sleep(min(pause, max(deadline.remaining() or 0.0, 0.0) or pause))
            pause = min(pause * 2, _SPIN_MAX_S)
        return True
