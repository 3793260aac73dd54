"""The publisher's ACKs, read in batches (`_native.AckReader`, ``_ack_reader.c``).

The thread that waits for a version's ACKs reads those already queued in one call,
unless a tap must see every message. Each ACK it reads is what `_protocol.read_ack`
returns for it (tests/test_follow.py holds the two together); any other frame is
handed back for the Python way. Without the extension, or with ZMQSYNC_NATIVE=0, every
ACK is read from Python.
"""

from __future__ import annotations

from ._native_lib import libzmq_path, native_class

__all__ = ["ACK_READER"]

# The native AckReader type; None: not built, turned off, or no libzmq found.
ACK_READER = native_class("AckReader") if libzmq_path() is not None else None
