"""The errors zmqsync raises on purpose. Catch ZmqSyncError for all of them.

* ZmqSyncError
  x ConnectTimeout      (also TimeoutError)  no WELCOME before the deadline
  x PublishTimeout      (also TimeoutError)  .version .acked .missing
  x ProtocolError                             a peer sent something outside the protocol
  x LayoutMismatch      (also ValueError)     publish() got other keys/shapes/dtypes
  x SharedMemoryFull    (also OSError)        .path .needed .free
  x BufferUnavailable   (also OSError)        a segment the publisher named cannot be mapped
  x FdLimitTooLow       (also OSError)        .limit .needed: `ulimit -n` cannot hold a bus
  x ClosedError         (also RuntimeError)   the Publisher/Subscriber was closed
  x RanksFailed         (also RuntimeError)   a sharded trainer's rank died, stalled or failed

Each error also subclasses the matching built-in, so ordinary ``except TimeoutError``
or ``except ValueError`` clauses keep working. Messages say what happened, with
identifiers, then what to do.
"""

from __future__ import annotations

from collections.abc import Iterable

__all__ = [
    "BufferUnavailable",
    "ClosedError",
    "ConnectTimeout",
    "FdLimitTooLow",
    "LayoutMismatch",
    "ProtocolError",
    "PublishTimeout",
    "RanksFailed",
    "SharedMemoryFull",
    "ZmqSyncError",
]


class ZmqSyncError(Exception):
    """Base class of every error zmqsync raises on purpose."""

    def __reduce__(self) -> tuple[object, ...]:
        # Keyword-only data (.missing, .needed, ...) survives pickling across processes.
        return (_rebuild, (type(self), self.args, self.__dict__))


def _rebuild(
    cls: type[ZmqSyncError], args: tuple[object, ...], state: dict[str, object]
) -> ZmqSyncError:
    exc = cls.__new__(cls)
    exc.args = args
    exc.__dict__.update(state)
    return exc


class ConnectTimeout(ZmqSyncError, TimeoutError):
    """No publisher answered the handshake before the deadline."""


class RanksFailed(ZmqSyncError, RuntimeError):
    """A sharded trainer's publish could not complete on every rank (one died, stalled
    or failed its write): the version is not announced, workers keep the last one."""


class PublishTimeout(ZmqSyncError, TimeoutError):
    """Some workers did not acknowledge a version before the deadline."""

    def __init__(
        self, message: str, *, version: int, acked: Iterable[str], missing: Iterable[str]
    ) -> None:
        super().__init__(message)
        self.version = version
        self.acked = tuple(acked)
        self.missing = tuple(missing)


class ProtocolError(ZmqSyncError):
    """A peer sent bytes that are not a valid message of this protocol and bus."""


class LayoutMismatch(ZmqSyncError, ValueError):
    """publish() got tensors whose keys, shapes or dtypes differ from the bus layout."""


class SharedMemoryFull(ZmqSyncError, OSError):
    """The shared-memory directory has no room for the buffer."""

    def __init__(self, message: str, *, path: str, needed: int, free: int) -> None:
        super().__init__(message)
        self.path = path
        self.needed = needed
        self.free = free

    def __str__(self) -> str:
        return str(self.args[0])


class BufferUnavailable(ZmqSyncError, OSError):
    """A shared segment the publisher named cannot be opened or mapped here."""

    def __str__(self) -> str:
        return str(self.args[0])


class FdLimitTooLow(ZmqSyncError, OSError):
    """The file descriptor limit cannot hold a bus; raise `ulimit -n`.

    Refused at start: under a limit this small libzmq's ipc listener would abort the
    whole process on EMFILE once peers connect.
    """

    def __init__(self, message: str, *, limit: int, needed: int) -> None:
        super().__init__(message)
        self.limit = limit
        self.needed = needed

    def __str__(self) -> str:
        return str(self.args[0])


class ClosedError(ZmqSyncError, RuntimeError):
    """The Publisher or Subscriber was closed (or never started)."""


for _cls in (
    ZmqSyncError,
    ConnectTimeout,
    PublishTimeout,
    ProtocolError,
    LayoutMismatch,
    SharedMemoryFull,
    BufferUnavailable,
    FdLimitTooLow,
    ClosedError,
    RanksFailed,
):
    _cls.__module__ = "zmqsync"
