"""Where a worker's versions can take the native path (`_native.Follower`), and its parts.

On a host where the workers' threads come to each version with cold caches, the Python
between a RECEIVE and its ACK (read the frame, the Link's rule, the seqlock, the switch,
the bookkeeping, the ACK) cost a worker ~45 us of CPU per version, and a publish waits
for the sum over the workers on the cores. The Follower does the same steps in C for
the common case and hands Python everything else (see ``_follower.c``).

It is taken in alias mode with background apply on the CPU (a `Switch`), and in copy
mode, where it calls the target's copier (one block copy for a flat model) between the
seqlock reads; either way with background apply, without an ``on_update`` callback,
and once a version of the bus was applied (`can_take` holds the whole rule).
ZMQSYNC_NATIVE=0 turns it off, as it turns off the native copies. Without the extension
every version goes the Python way (`ReferenceFollower`, its twin), which does the same.

A thread in `Subscriber.wait_for_version` sleeps on a `_native.Gate` (a futex) when the
extension is there, whichever way the versions come: the Follower opens it without
going back to Python, and the thread's wake-up skips Condition.wait's machinery.

The publisher's ACK reader is `_ack_reader`'s; what the two share is `_native_lib`'s.
"""

from __future__ import annotations

from ._native_lib import libzmq_path, native_class, zmq_error

__all__ = ["FOLLOWER", "GATE", "libzmq_path", "zmq_error"]

# The native Follower type; None: not built, turned off, or no libzmq found.
FOLLOWER = native_class("Follower") if libzmq_path() is not None else None
# Threads waiting for a version sleep on a native Gate's futex; None: on a Condition.
GATE = native_class("Gate")
