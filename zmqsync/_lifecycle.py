"""Close what the user forgot to close, at interpreter exit.

Background threads are daemons, so an interpreter can exit while a Publisher or
Subscriber is still open (a script that ends without `close()`, a KeyboardInterrupt).
`atexit` then closes them, bounded in time like every close: the publisher still
broadcasts STOP and unlinks its segment. A SIGKILL skips this; the flock-based garbage
collection covers that case.
"""

from __future__ import annotations

import atexit
import contextlib
import weakref
from typing import Protocol

__all__ = ["track"]


class _Closable(Protocol):
    def close(self) -> None: ...


_live: weakref.WeakSet[_Closable] = weakref.WeakSet()


def track(obj: _Closable) -> None:
    _live.add(obj)


@atexit.register
def _close_all() -> None:
    for obj in list(_live):
        with contextlib.suppress(Exception):
            obj.close()
