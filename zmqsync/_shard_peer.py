"""A sharded trainer's rank that does not host the bus: it writes its shards, no more.

Every rank builds ``Publisher(model, name=...)`` and calls ``publish()``; on the host
rank that is a full publisher (`_shard_writes`), on every other one it is this: at
start, map the host's segment (writable: this rank writes into it) once the host's
page appears, and write version 0; at each publish, read and check this rank's tensors,
wait for the slot the host posts, write this rank's pieces, and wait until the host
announced the version (or failed it: then this rank raises too). Workers, acks and
sockets are the host's alone.

The mapping follows the publisher's segment rules (`_buffers.cpu`): a shared ``flock``
for as long as it lives (so `zmqsync gc` leaves the segment alone), no unmapping under
live views (the views go, then the mapping).
"""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
import time
import weakref
from typing import Any

import torch

from ._buffers import segment_name
from ._buffers.header import HEADER_BYTES, Header
from ._deadline import Deadline
from ._errors import ClosedError
from ._layout import Key, Layout
from ._rank_page import RankPage, RanksFailed, page_name
from ._shards import Shards, ShardWriter
from ._source import Source

__all__ = ["PeerPublish", "ShardPeer"]


class PeerPublish:
    """What publish() returns on a rank that does not host the bus: the version, once
    announced. Acks are the host's (its `Publish` has them)."""

    acked: tuple[str, ...] = ()
    missing: tuple[str, ...] = ()
    targets: tuple[str, ...] = ()
    written = True

    def __init__(self, version: int, seconds: float) -> None:
        self.version = version
        self.seconds = self.write_seconds = self.blocked = seconds

    def done(self) -> bool:
        return True

    def wait(self, timeout: float | None = None, *, max_lag: int = 0) -> PeerPublish:
        return self

    def __repr__(self) -> str:
        return f"<PeerPublish v{self.version} written {self.seconds * 1e3:.2f} ms>"


def _map_segment(path: str, size: int) -> tuple[mmap.mmap, int]:
    """The host's segment, mapped writable, with a shared lock held as long as it is."""
    fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if st.st_uid != os.getuid() or st.st_size < size:
            raise RanksFailed(
                f"{path} is not the host rank's segment for this model ({st.st_size} bytes "
                f"of uid {st.st_uid}, expected {size} of uid {os.getuid()})"
            )
        fcntl.flock(fd, fcntl.LOCK_SH)
        mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED)
    except BaseException:
        os.close(fd)
        raise
    weakref.finalize(mm, os.close, fd)  # the lock lives exactly as long as the mapping
    return mm, fd


class ShardPeer:
    """One non-host rank of a sharded publisher (see the module doc)."""

    def __init__(
        self,
        name: str,
        source: Source,
        layout: Layout,
        shards: Shards,
        slots: int,
        shm_dir: str,
        timeout: float | None,
    ) -> None:
        self.name, self.shards = name, shards
        self._source, self._layout = source, layout
        self._slots, self._shm_dir, self._timeout = slots, shm_dir, timeout
        self._writer = ShardWriter(layout, shards)
        self._page: RankPage | None = None
        self._views: list[dict[Key, torch.Tensor]] = []
        self._number = 0
        self.version = -1  # the last version the host announced with this rank's part

    def start(self) -> None:
        """Attach to the host's page and segment, then write version 0 with the others.

        Raises:
            RanksFailed: the host opened no bus in time, or failed version 0.
        """
        deadline = Deadline(self._timeout)
        shards = self.shards
        page = RankPage.attach(
            self._shm_dir, page_name(self.name, shards.bus_id), shards.index,
            len(shards.ranks), shards.digest, deadline,
        )  # fmt: skip
        try:
            slot_bytes = self._layout.slot_bytes
            path = os.path.join(self._shm_dir, segment_name(self.name, shards.bus_id))
            mm, _ = _map_segment(path, HEADER_BYTES + self._slots * slot_bytes)
            words = memoryview(mm)[:HEADER_BYTES].cast("Q")
            valid = Header(words).valid(self._slots, slot_bytes)
            words.release()
            if not valid:
                raise RanksFailed(f"{path} has no valid header for {self._slots} slots")
            flat = torch.frombuffer(mm, dtype=torch.uint8)
            self._views = [
                self._layout.views(flat[HEADER_BYTES + i * slot_bytes :][:slot_bytes])
                for i in range(self._slots)
            ]
            self._page = page
            self._write(0, self._source.read(None, None), time.perf_counter(), deadline)
        except BaseException:
            self.close()
            page.close()
            raise

    def publish(self, weights: Any, keys: Any, timeout: float | None) -> PeerPublish:
        """This rank's part of one publish (see the module doc)."""
        page = self._usable()
        started = time.perf_counter()
        self._number += 1
        deadline = Deadline(timeout)
        try:
            if keys is not None:
                raise NotImplementedError(
                    "a sharded publisher publishes every tensor: publish(keys=...) is not "
                    "supported with DTensor weights"
                )
            flat = self._source.read(weights, None)
        except BaseException:
            page.failed(self._number)  # the host stops waiting for this rank
            raise
        return self._write(self._number, flat, started, deadline)

    def _write(
        self, number: int, flat: dict[Key, torch.Tensor], started: float, deadline: Deadline
    ) -> PeerPublish:
        page = self._usable()
        slot, version = page.wait_go(number, deadline)
        try:
            self._writer.write(self._views[slot], flat)
        except BaseException:
            page.failed(number)
            raise
        page.written(number)
        page.wait_outcome(number, deadline)
        self.version = version
        return PeerPublish(version, time.perf_counter() - started)

    def _usable(self) -> RankPage:
        if self._page is None:
            raise ClosedError(
                f"Publisher {self.name!r} (rank {self.shards.rank}) is not started or "
                "closed; call start() on a new one"
            )
        return self._page

    def close(self) -> None:
        """Drop the views (the mapping goes with the last one) and the page. Idempotent."""
        self._views = []
        page, self._page = self._page, None
        if page is not None:
            with contextlib.suppress(OSError):
                page.close()
