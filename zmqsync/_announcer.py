"""Making a written version known: recorded by the publisher's role, then RECEIVE on the
events socket, sent from the thread that wrote it.

Every write mode ends a version here, the background writer of `Overlapped` included,
so the order "bytes in place → header says so → role → RECEIVE" is kept in one place.
"""

from __future__ import annotations

from ._errors import ClosedError, ZmqSyncError
from ._fast_frames import template
from ._layout import Key, Layout
from ._protocol import Receive
from ._publisher_agent import IO_LOCK_S, Agent, Shared

__all__ = ["Announcer"]


class Announcer:
    """Records and announces versions for one started publisher."""

    def __init__(self, shared: Shared, agent: Agent, layout: Layout, bus_id: str) -> None:
        self._shared = shared
        self._role = shared.role  # asked under `shared.cond`
        self._agent = agent
        self._specs = layout.specs
        # (seq, version, slot, changed) -> frame
        self._receive = template(Receive, bus=bus_id)
        self._bits: dict[frozenset[Key], bytes] = {}  # tensors named -> RECEIVE.changed
        self._sizes: dict[frozenset[Key] | None, int] = {None: layout.nbytes}  # -> bytes

    def record(self, version: int, slot: int, written: int) -> None:
        """`version` is in `slot`; writing it copied `written` bytes into the slot (the
        ``written_bytes`` counter: a partial publish writes less than a version)."""
        with self._shared.cond:
            self._role.published(version, slot, written)

    def copy_readers(self) -> bool:
        """Whether a copy-mode worker is on the bus (`PublisherRole.copy_readers`)."""
        with self._shared.cond:
            return self._role.copy_readers()

    def reserve(self, slot: int | None) -> None:
        """`slot` is the trainer's home from now on (None: none): see `Registry.reserve`."""
        with self._shared.cond:
            self._role.reserve_home(slot)

    def size_of(self, named: frozenset[Key] | None) -> int:
        """Bytes of the tensors `named` (None: all), in the slots' dtypes: computed once
        per set of keys, as `_changed_bits` is (a trainer publishes the same few subsets)."""
        size = self._sizes.get(named)
        if size is None:
            keys = frozenset() if named is None else named  # None is cached from the start
            size = sum(spec.nbytes for spec in self._specs if spec.key in keys)
            if len(self._sizes) > 64:
                self._sizes = {None: self._sizes[None]}
            self._sizes[named] = size
        return size

    def send(self, version: int, slot: int, named: frozenset[Key] | None) -> None:
        """Send RECEIVE from this thread (no hand-off to the agent: see `_publisher`)."""
        changed = b"" if named is None else self._changed_bits(named)
        agent, io, role = self._agent, self._shared.io, self._role
        if not io.acquire(timeout=IO_LOCK_S):
            raise ZmqSyncError(f"publisher {role.name!r}: its agent thread is stuck; close it")
        try:
            if agent.closed:
                raise ClosedError(f"Publisher {role.name!r} was closed while publishing")
            agent.send_frame(self._receive(role.next_seq(), version, slot, changed))
        finally:
            io.release()

    def needs_mirror(self) -> bool:
        """Whether a worker reading the CPU copy of CUDA weights is on the bus."""
        role = self._role
        if not role.cuda:
            return False
        with self._shared.cond:
            return role.cpu_readers()

    def _changed_bits(self, named: frozenset[Key]) -> bytes:
        """RECEIVE's bitmap of `named` over the manifest (bit i: entry i), computed once
        per set of keys (a trainer publishes the same few subsets again and again)."""
        bits = self._bits.get(named)
        if bits is None:
            mask = sum(1 << i for i, spec in enumerate(self._specs) if spec.key in named)
            bits = mask.to_bytes((len(self._specs) + 7) // 8, "little")
            if len(self._bits) > 64:
                self._bits.clear()
            self._bits[named] = bits
        return bits
