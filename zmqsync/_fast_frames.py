"""What the fast path compiles against: RECEIVE and ACK as fixed bytes and inline reads.

A worker reads one RECEIVE per version and writes one ACK; the publisher reads one ACK
per worker per version. Each of these runs on a thread that comes to it with cold
caches, where building a message object and calling a check per field cost several
microseconds. So the two hot messages have, beside `_protocol.encode` and `decode`:

- templates (`template`, `template_pieces`): `encode`'s bytes for messages that share
  most fields, with only the others packed per message;
- readers (`read_receive`, `read_ack`): the fields of a frame `decode` would accept as
  that message, or None for anything else (then `decode` says what it is);
- patterns (`receive_pattern`, `ack_pattern`): the pieces and ranges the native readers
  of `_follow` match frames against, for the same frames as the readers.

The contract is `decode`'s: a reader or pattern takes only what `decode` takes, with the
same values (tests hold them to it byte for byte), and a template writes what `encode`
writes. The limits come from `_protocol.FIELDS`, never restated. No sockets, no clock,
no torch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import fields
from typing import Any

import msgpack

from ._checks import bin_limit, int_range, passed_strings
from ._protocol import FIELDS, FLAT, MAX_MESSAGE, PROTO, Ack, Message, Receive

__all__ = [
    "ack_pattern",
    "read_ack",
    "read_receive",
    "receive_pattern",
    "template",
    "template_pieces",
]


def template_pieces(cls: type[Message], **fixed: Any) -> tuple[bytes, ...]:
    """The bytes `encode` writes for `cls` messages that share the `fixed` fields, in
    pieces: what comes before the first other field, between each two, and after the
    last (every other field is packed between two pieces, in field order)."""
    if cls not in FLAT:
        raise TypeError(f"{cls.__name__} has nested records: use encode()")
    names = [f.name for f in fields(cls)]
    if unknown := set(fixed) - set(names):
        raise ValueError(f"{cls.__name__} has no field(s) {sorted(unknown)}")
    pieces: list[bytes] = []
    literal = msgpack.Packer().pack_map_header(len(names) + 2)
    for name in names:
        literal += msgpack.packb(name)
        if name in fixed:
            literal += msgpack.packb(fixed[name], use_bin_type=True)
        else:
            pieces.append(literal)
            literal = b""
    pieces.append(literal + msgpack.packb({"proto": PROTO, "type": cls.TYPE})[1:])
    return tuple(pieces)


def template(cls: type[Message], **fixed: Any) -> Callable[..., bytes]:
    """`encode` for `cls` messages that share the `fixed` fields; the others are given
    positionally, in field order, and only they are packed per message.

    A worker's ACKs differ only in the version, the publisher's RECEIVEs only in seq,
    version and slot; packing the rest again cost a cold thread ~4 us per message. The
    bytes are `encode`'s for the same message.
    """
    head, *tails = template_pieces(cls, **fixed)
    # One Packer per template, not msgpack.packb (a Python function that builds a Packer
    # and its buffer per call). Its pack() of an int, str or bytes runs in C without
    # releasing the GIL or calling back into Python, so threads that share a template
    # (a worker's agent and, in manual mode, the user's thread) cannot interleave in it.
    pack = msgpack.Packer(use_bin_type=True, autoreset=True).pack
    if len(tails) == 1:
        tail = tails[0]
        return lambda value: head + pack(value) + tail

    def frame(*values: Any) -> bytes:
        out = [head]
        for value, tail in zip(values, tails, strict=True):
            out += (pack(value), tail)
        return b"".join(out)

    return frame


# The checks `decode` applies to these fields, inlined below: the same objects as in
# the field table, so a limit changed there changes here.
_SEQ_LO, _SEQ_HI = int_range(FIELDS[Receive]["seq"][0])
_VERSION_LO, _VERSION_HI = int_range(FIELDS[Receive]["version"][0])
_SLOT_LO, _SLOT_HI = int_range(FIELDS[Receive]["slot"][0])
_CHANGED_MAX = bin_limit(FIELDS[Receive]["changed"][0])
_ACK_VERSION = int_range(FIELDS[Ack]["version"][0])
_RECEIVE_KEYS = len(fields(Receive)) + 2  # + proto and type
_ACK_KEYS = len(fields(Ack)) + 2
_IDS_PASSED = passed_strings(FIELDS[Ack]["worker_id"][0])
_SESSIONS_PASSED = passed_strings(FIELDS[Ack]["session"][0])


def ack_pattern(bus: str) -> tuple[tuple[bytes, ...], tuple[int, int], set[str], set[str]]:
    """An ACK of `bus` as workers write it, for a native reader: the pieces around
    worker_id, session and version (`template_pieces`), the version's range, and the
    worker ids and sessions that passed their checks before (the sets `read_ack` looks
    in, kept up to date here). A frame made of these, whose ids are in those sets, is
    one `read_ack` takes, with the same values; any other frame is left to `decode`."""
    pieces = template_pieces(Ack, bus=bus)
    return pieces, _ACK_VERSION, _IDS_PASSED, _SESSIONS_PASSED


def receive_pattern(bus: str, *, partial: bool = True) -> tuple[tuple[bytes, ...], tuple[int, ...]]:
    """A RECEIVE of `bus` as the publisher writes it, for a native reader: the pieces
    around seq, version, slot and changed (`template_pieces`), and the ranges
    `read_receive` checks (seq, version and slot low and high, changed's longest). A
    frame made of these pieces, with fields in these ranges, is one `read_receive`
    takes, with the same values; any other frame is left to it. `partial=False`: only
    RECEIVEs of whole versions (an empty `changed`), what a copy-mode follower takes."""
    changed = _CHANGED_MAX if partial else 0
    ranges = (_SEQ_LO, _SEQ_HI, _VERSION_LO, _VERSION_HI, _SLOT_LO, _SLOT_HI, changed)
    return template_pieces(Receive, bus=bus), ranges


def read_receive(data: bytes, bus: str) -> tuple[int, int, int, bytes] | None:
    """``(seq, version, slot, changed)`` of a RECEIVE of `bus`, or None for anything else.

    None means "not that": another message, another bus, or bytes that are not a valid
    message; `decode` then says which. What it returns is exactly what `decode` would
    accept as such a RECEIVE (the same checks, done inline), given a `bus` that is valid
    itself (one a decoded WELCOME named). A worker reads one RECEIVE per version, on a
    thread that comes to it with cold caches: no message object, and no call per field.
    """
    if type(data) is not bytes or len(data) > MAX_MESSAGE:
        return None
    try:
        raw = msgpack.unpackb(data, raw=False, strict_map_key=True, use_list=True)
    except (ValueError, msgpack.UnpackException, RecursionError, BufferError):
        return None
    if type(raw) is not dict or len(raw) != _RECEIVE_KEYS:
        return None
    try:
        if raw["type"] != "receive" or raw["bus"] != bus:
            return None
        proto, seq, version, slot = raw["proto"], raw["seq"], raw["version"], raw["slot"]
        changed = raw["changed"]
    except KeyError:
        return None
    if (
        type(proto) is not int
        or proto != PROTO
        or type(seq) is not int
        or not _SEQ_LO <= seq <= _SEQ_HI
        or type(version) is not int
        or not _VERSION_LO <= version <= _VERSION_HI
        or type(slot) is not int
        or not _SLOT_LO <= slot <= _SLOT_HI
        or type(changed) is not bytes
        or len(changed) > _CHANGED_MAX
    ):
        return None
    return seq, version, slot, changed


def read_ack(data: bytes, bus: str) -> tuple[str, str, int] | None:
    """``(worker_id, session, version)`` of an ACK of `bus`, or None for anything else.

    As `read_receive`, for the publisher's side: one ACK per worker per version, read by
    the publishing thread between two waits. Worker ids and sessions are taken only if
    their checks passed them before (every worker's WELCOME did); anything else goes to
    `decode`.
    """
    if type(data) is not bytes or len(data) > MAX_MESSAGE:
        return None
    try:
        raw = msgpack.unpackb(data, raw=False, strict_map_key=True, use_list=True)
    except (ValueError, msgpack.UnpackException, RecursionError, BufferError):
        return None
    if type(raw) is not dict or len(raw) != _ACK_KEYS:
        return None
    try:
        if raw["type"] != "ack" or raw["bus"] != bus:
            return None
        proto, worker_id, session, version = (
            raw["proto"],
            raw["worker_id"],
            raw["session"],
            raw["version"],
        )
    except KeyError:
        return None
    if (
        type(proto) is not int
        or proto != PROTO
        or type(worker_id) is not str
        or worker_id not in _IDS_PASSED
        or type(session) is not str
        or session not in _SESSIONS_PASSED
        or type(version) is not int
        or not _ACK_VERSION[0] <= version <= _ACK_VERSION[1]
    ):
        return None
    return worker_id, session, version
