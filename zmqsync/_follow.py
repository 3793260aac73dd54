"""Where a worker's versions can take the native path (`_native.Follower`), and its parts.

On a host where the workers' threads come to each version with cold caches, the Python
between a RECEIVE and its ACK (read the frame, the Link's rule, the seqlock, the switch,
the bookkeeping, the ACK) cost a worker ~45 us of CPU per version, and a publish waits
for the sum over the workers on the cores. The Follower does the same steps in C for
the common case and hands Python everything else (see ``_follow.c``).

It is taken in alias mode with background apply on the CPU (a `Switch`), without an
``on_update`` callback, once a version of the bus was applied; ZMQSYNC_NATIVE=0 turns it
off, as it turns off the native copies. Without the extension every version goes the
Python way, which does the same.

A thread in `Subscriber.wait_for_version` sleeps on a `_native.Gate` (a futex) when the
extension is there, whichever way the versions come: the Follower opens it without
going back to Python, and the thread's wake-up skips Condition.wait's machinery.

On the publisher's side, the thread that waits for a version's ACKs reads those already
queued in one call (`_native.AckReader`), unless a tap must see every message.
"""

from __future__ import annotations

import functools
import os
from typing import Any

import zmq

__all__ = ["ACK_READER", "FOLLOWER", "GATE", "libzmq_path", "zmq_error"]


def _native_class(name: str) -> Any:
    if os.environ.get("ZMQSYNC_NATIVE", "1") == "0":
        return None
    try:
        from . import _native
    except ImportError:  # installed without a C compiler
        return None
    return getattr(_native, name, None)  # None: an older build


@functools.cache
def libzmq_path() -> str | None:
    """The libzmq this process runs pyzmq with (the Follower calls the same library on
    the same sockets; importing zmq loaded it), from the process's mappings; None if no
    mapped library is named libzmq."""
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.rstrip("\n").partition("/")[2]
                if path and "libzmq" in os.path.basename(path):
                    return "/" + path
    except OSError:
        pass
    return None


def zmq_error(errno: int) -> zmq.ZMQError:
    """The error pyzmq would raise for a failed receive with `errno`."""
    return zmq.ContextTerminated() if errno == zmq.ETERM else zmq.ZMQError(errno)


# The native Follower type; None: not built, turned off, or no libzmq found.
FOLLOWER = _native_class("Follower") if libzmq_path() is not None else None
# Threads waiting for a version sleep on a native Gate's futex; None: on a Condition.
GATE = _native_class("Gate")
# The publisher's ACKs read in batches; None: one by one from Python.
ACK_READER = _native_class("AckReader") if libzmq_path() is not None else None
