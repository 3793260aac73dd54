"""The header page: per-slot version and seqlock counter, and the latest version.

Seqlock protocol (one writer, many readers, across processes):

* The writer makes a slot's counter **odd** before touching the slot's bytes, writes
  them, stores the slot's version, then makes the counter **even** again.
* A reader records the counter (it must be even and the slot must hold the version it
  expects), reads or aliases the bytes, then re-reads the counter. Equal counters prove
  that what it read is one whole version; anything else means retry or reject.

The publisher never writes a slot a live subscriber holds, so in normal operation the
check never fails; it is what makes slots=1, evictions and crashes safe. Words are
aligned 8-byte stores, which x86-64 and arm64 perform atomically; x86-64's store order
makes the counter protocol sound without explicit fences (see docs/guide.md).
"""

from __future__ import annotations

__all__ = ["FIRST_SLOT_WORD", "HEADER_BYTES", "MAGIC", "Header"]

HEADER_BYTES = 4096
MAGIC = 0x315F434E5953514D  # b"MQSYNC_1" little-endian
_EMPTY = (1 << 64) - 1
# word indices
_MAGIC, _SLOTS, _SLOT_BYTES, _LATEST_LOCK, _LATEST_VERSION, _LATEST_SLOT, _CLOSED = range(7)
# a slot's words: (seqlock counter, version) at FIRST_SLOT_WORD + 2 * slot. The native
# follower (``_follower.c``) is given these at construction rather than its own copy.
FIRST_SLOT_WORD = _FIRST_SLOT = 8
MAX_SLOTS = (HEADER_BYTES // 8 - _FIRST_SLOT) // 2


class Header:
    """Typed access to the header words of one mapped segment."""

    __slots__ = ("_words",)

    def __init__(self, words: memoryview) -> None:
        self._words = words  # memoryview cast to "Q" over the first HEADER_BYTES

    @classmethod
    def initialise(cls, words: memoryview, slots: int, slot_bytes: int) -> Header:
        header = cls(words)
        for i in range(len(words)):
            words[i] = 0
        for slot in range(slots):
            words[_FIRST_SLOT + 2 * slot + 1] = _EMPTY
        words[_SLOTS] = slots
        words[_SLOT_BYTES] = slot_bytes
        words[_LATEST_VERSION] = _EMPTY
        words[_MAGIC] = MAGIC  # last: a reader seeing MAGIC sees the rest
        return header

    def valid(self, slots: int, slot_bytes: int) -> bool:
        w = self._words
        return w[_MAGIC] == MAGIC and w[_SLOTS] == slots and w[_SLOT_BYTES] == slot_bytes

    # --- writer side ---

    def begin_write(self, slot: int) -> None:
        i = _FIRST_SLOT + 2 * slot
        self._words[i] = self._words[i] + 1 | 1  # odd: being written
        self._words[i + 1] = _EMPTY

    def end_write(self, slot: int, version: int) -> None:
        i = _FIRST_SLOT + 2 * slot
        self._words[i + 1] = version
        self._words[i] = self._words[i] + 1  # even: complete

    def set_latest(self, version: int, slot: int) -> None:
        w = self._words
        w[_LATEST_LOCK] = w[_LATEST_LOCK] + 1 | 1
        w[_LATEST_VERSION] = version
        w[_LATEST_SLOT] = slot
        w[_LATEST_LOCK] = w[_LATEST_LOCK] + 1

    def mark_closed(self) -> None:
        """The bus is closing: readers see it at once, also a worker whose thread is busy
        (in `on_update`) when the STOP arrives."""
        self._words[_CLOSED] = 1

    # --- reader side ---

    def closed(self) -> bool:
        """True once the writer closed the bus (`mark_closed`)."""
        return self._words[_CLOSED] != 0

    def read_begin(self, slot: int, version: int) -> int | None:
        """The counter to check later, or None if `slot` does not now hold `version`.

        Mirrored in C by Follower.next (``_follower.c``), which reads the same two words.
        """
        i = _FIRST_SLOT + 2 * slot
        counter = self._words[i]
        if counter & 1 or self._words[i + 1] != version:
            return None
        return counter

    def read_valid(self, slot: int, counter: int) -> bool:
        """True if `slot` was not rewritten since `read_begin` returned `counter`."""
        return self._words[_FIRST_SLOT + 2 * slot] == counter

    def slot_version(self, slot: int) -> int:
        value = self._words[_FIRST_SLOT + 2 * slot + 1]
        return -1 if value == _EMPTY else value

    def latest(self) -> tuple[int, int] | None:
        """(version, slot) last announced by the writer, or None while unknown.

        A slot outside the segment (the header is the publisher's to write, and a
        hostile one may write anything) is unknown too, never an index to use.
        """
        w = self._words
        for _ in range(1000):
            lock = w[_LATEST_LOCK]
            version, slot = w[_LATEST_VERSION], w[_LATEST_SLOT]
            if not lock & 1 and w[_LATEST_LOCK] == lock:
                if version == _EMPTY or slot >= min(w[_SLOTS], MAX_SLOTS):
                    return None
                return version, slot
        return None

    def release(self) -> None:
        self._words.release()
