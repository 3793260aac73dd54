"""What the native types share on the Python side: the extension's classes (or None),
the libzmq pyzmq runs on, and pyzmq's errors for a failed receive.

The worker's types (`_follow`) and the publisher's (`_ack_reader`) each import from
here; neither imports the other.
"""

from __future__ import annotations

import functools
import os
from typing import Any

import zmq

__all__ = ["libzmq_path", "native_class", "zmq_error"]


def native_class(name: str) -> Any:
    """The extension's class `name`, or None: ZMQSYNC_NATIVE=0, not built (installed
    without a C compiler), or an older build without it."""
    if os.environ.get("ZMQSYNC_NATIVE", "1") == "0":
        return None
    try:
        from . import _native
    except ImportError:  # installed without a C compiler
        return None
    return getattr(_native, name, None)  # None: an older build


@functools.cache
def libzmq_path() -> str | None:
    """The libzmq this process runs pyzmq with (the native types call the same library
    on the same sockets; importing zmq loaded it), from the process's mappings; None if
    no mapped library is named libzmq."""
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
