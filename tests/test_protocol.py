"""The wire protocol, with no sockets: round trips, and h11's rule for `decode`.

`decode` either returns a message or raises `ProtocolError`; any other exception is a
bug. The fuzz tests below feed it random bytes, every truncation of every valid
message, valid messages with one field (at any depth) replaced by a value of another
type, wrong manifests, huge strings, deep nesting and a pickle payload.
"""

from __future__ import annotations

import ast
import copy
import dataclasses
import math
import os
import pickle
import random
import time
from pathlib import Path
from typing import Any

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from zmqsync import ProtocolError
from zmqsync import _checks as checks
from zmqsync import _fast_frames as fast_frames
from zmqsync import _protocol as protocol
from zmqsync._checks import build
from zmqsync._fast_frames import template
from zmqsync._protocol import (
    FIELDS,
    MAX_MESSAGE,
    MESSAGE_TYPES,
    PROTO,
    Ack,
    BufferInfo,
    Bye,
    Error,
    Heartbeat,
    Hello,
    Inspect,
    Message,
    Receive,
    State,
    Stop,
    Tap,
    TensorSpec,
    Welcome,
    WorkerEntry,
    contiguous_stride,
    decode,
    encode,
)

BUS = "0123456789abcdef"
FOREIGN = "aaaaaaaaaaaaaaaa"
SESSION = "fedcba9876543210"
SLOT_BYTES = 8192
FUZZ = settings(max_examples=200, deadline=None)


def spec(
    key: tuple[str, ...], dtype: str, shape: tuple[int, ...], offset: int, buffer: int = 0
) -> TensorSpec:
    nbytes = math.prod(shape) * protocol.DTYPES[dtype]
    return TensorSpec(key, dtype, shape, contiguous_stride(shape), offset, nbytes, buffer)


# A small policy as the publisher would lay it out: 256-byte-aligned offsets, one
# buffer per device, parameters and buffers (a 0-d int64 counter, an empty tensor).
MANIFEST = (
    spec(("0", "weight"), "float32", (64, 8), 0),
    spec(("0", "bias"), "float32", (64,), 2048),
    spec(("1", "weight"), "bfloat16", (4, 64), 2304),
    spec(("1", "bias"), "bfloat16", (4,), 2816),
    spec(("norm", "num_batches_tracked"), "int64", (), 3072),
    spec(("norm", "running_mean"), "float16", (0, 3), 3328),
    spec(("head", "scale"), "float8_e4m3fn", (16, 16), 0, buffer=1),
)
BUFFERS = (
    BufferInfo("cpu", "cpu", f"zmqsync-policy-{BUS}-cpu", 4096 + 2 * SLOT_BYTES, 4096),
    BufferInfo(
        "cuda",
        "cuda:0",
        f"zmqsync-policy-{BUS}-cuda0",
        4096 + 2 * SLOT_BYTES,
        4096,
        handle=bytes(range(64)),
        device_uuid="GPU-5f0c2a1e-8d7b-4c3a-9e21-0123456789ab",
    ),
)
WORKERS = (
    WorkerEntry("host-4242", 4242, "host", "copy", "cpu", 3, 0.25),
    WorkerEntry("actor-1", 77, "node-7.example", "alias", "cuda", -1, 12.5),
)

MESSAGES: list[Message] = [
    Hello("", "host-4242", 4242, "host", "copy", "cpu"),
    Hello(BUS, "actor-1", 77, "node-7.example", "alias", "cuda"),
    Welcome(
        bus=BUS,
        session=SESSION,
        seq=17,
        version=3,
        slot=1,
        slots=2,
        slot_bytes=SLOT_BYTES,
        heartbeat=0.5,
        events="ipc:///run/user/1000/zmqsync/policy.sock.events",
        acks="ipc:///run/user/1000/zmqsync/policy.sock.acks",
        tap="",
        buffers=BUFFERS,
        manifest=MANIFEST,
    ),
    Receive(BUS, 18, 4, 0),
    Stop(BUS, 19, "", "publisher closed"),
    Stop(BUS, 20, SESSION, "evicted"),
    Heartbeat(BUS, 20, "", "", 4),
    Heartbeat(BUS, 0, "host-4242", SESSION, -1),
    Ack(BUS, "host-4242", SESSION, 4),
    Bye(BUS, "host-4242", SESSION),
    Inspect(""),
    Inspect(BUS),
    State(
        bus=BUS,
        name="policy",
        pid=1234,
        version=4,
        seq=20,
        slots=2,
        slot_versions=(4, 3),
        heartbeat=0.5,
        tap="",
        events="ipc:///run/user/1000/zmqsync/policy.sock.events",
        buffers=BUFFERS,
        manifest=MANIFEST,
        workers=WORKERS,
        counters={"publishes": 4, "acks": 7, "timeouts": 0, "evictions": 1, "rejected": 2},
    ),
    Error(BUS, "transport cuda is not offered by this bus"),
    Tap(BUS, 1767225600.25, "in", "host-4242", b"\x81\xa5proto\x01"),
]
HELLO, WELCOME = MESSAGES[0], MESSAGES[2]
BUS_MESSAGES = [m for m in MESSAGES if m.bus]


def ids(msg: Any) -> str:
    return f"{msg.TYPE}-{msg.bus or 'nobus'}"


def plain(msg: Any) -> dict[str, Any]:
    """The map on the wire, as a mutable Python structure."""
    raw = msgpack.unpackb(encode(msg), raw=False)
    assert type(raw) is dict
    return raw


def pack(raw: Any) -> bytes:
    data: bytes = msgpack.packb(raw, use_bin_type=True)
    return data


def decodes_or_refuses(data: Any, **kwargs: Any) -> Any:
    """h11's rule: a message or ProtocolError. Anything else propagates and fails."""
    try:
        msg = decode(data, **kwargs)
    except ProtocolError:
        return None
    assert type(msg) in MESSAGE_TYPES.values()
    assert decode(encode(msg)) == msg  # whatever we accept, we can say again
    return msg


def refused(data: Any, **kwargs: Any) -> ProtocolError:
    with pytest.raises(ProtocolError) as info:
        decode(data, **kwargs)
    return info.value


# --- round trips -------------------------------------------------------------------------


def test_every_message_type_is_exercised() -> None:
    assert {type(m) for m in MESSAGES} == set(MESSAGE_TYPES.values())
    assert set(FIELDS) == set(MESSAGE_TYPES.values()) | {TensorSpec, BufferInfo, WorkerEntry}


@pytest.mark.parametrize("msg", MESSAGES, ids=ids)
def test_round_trip(msg: Any) -> None:
    assert decode(encode(msg)) == msg
    assert decode(encode(msg), bus=BUS) == msg
    for view in (bytearray, memoryview):
        data: Any = view(encode(msg))
        assert decode(data) == msg


@pytest.mark.parametrize("msg", MESSAGES, ids=ids)
def test_encoding_is_a_plain_msgpack_map(msg: Any) -> None:
    raw = plain(msg)
    assert raw["proto"] == PROTO
    assert raw["type"] == msg.TYPE
    assert raw["bus"] == msg.bus
    assert set(raw) == set(FIELDS[type(msg)]) | {"proto", "type"}


def test_bytes_travel_as_msgpack_bin() -> None:
    raw = plain(WELCOME)
    assert raw["buffers"][1]["handle"] == bytes(range(64))  # bin, not str
    assert raw["buffers"][0]["handle"] == b""


def test_decoded_sequences_are_tuples() -> None:
    welcome = decode(encode(WELCOME))
    assert isinstance(welcome, Welcome)
    assert type(welcome.manifest) is tuple and type(welcome.manifest[0].shape) is tuple
    assert welcome.manifest[4].shape == () and welcome.manifest[4].nbytes == 8


def test_int_heartbeat_is_accepted_as_float() -> None:
    raw = plain(WELCOME)
    raw["heartbeat"] = 2
    welcome = decode(pack(raw))
    assert isinstance(welcome, Welcome)
    assert welcome.heartbeat == 2.0 and type(welcome.heartbeat) is float


# --- envelope: proto, type, bus, fields --------------------------------------------------


@pytest.mark.parametrize("msg", BUS_MESSAGES, ids=ids)
def test_foreign_bus_is_refused(msg: Any) -> None:
    error = refused(encode(msg), bus=FOREIGN)
    assert "foreign bus" in str(error)
    assert decode(encode(msg), bus=BUS) == msg
    assert decode(encode(msg)) == msg  # no bus given: no bus check


@pytest.mark.parametrize("msg", [Hello("", "w", 1, "h", "copy", "cpu"), Inspect("")], ids=ids)
def test_hello_and_inspect_may_carry_an_empty_bus(msg: Any) -> None:
    assert decode(encode(msg), bus=FOREIGN) == msg


@pytest.mark.parametrize("cls", [Receive, Stop, Heartbeat, Ack, Bye, Welcome, State, Error])
def test_other_messages_need_a_bus(cls: type[Any]) -> None:
    msg = next(m for m in MESSAGES if type(m) is cls)
    raw = plain(msg)
    raw["bus"] = ""
    refused(pack(raw))
    refused(pack(raw), bus=BUS)


@pytest.mark.parametrize(
    "bus",
    [
        "0123456789ABCDEF",
        "0123456789abcde",
        "0123456789abcdef0",
        "0123456789abcdeg",
        "0123456789abcde\n",
        " 123456789abcdef",
    ],
)
def test_malformed_bus_is_refused(bus: str) -> None:
    raw = plain(Inspect(""))
    raw["bus"] = bus
    refused(pack(raw))


@pytest.mark.parametrize("proto", [0, 2, -1, 2**64 - 1, "1", b"\x01", 1.0, True, None, [1], {}])
def test_wrong_proto_is_refused(proto: Any) -> None:
    raw = plain(Receive(BUS, 1, 1, 0))
    raw["proto"] = proto
    assert "protocol" in str(refused(pack(raw)))


def test_missing_proto_is_refused() -> None:
    raw = plain(Receive(BUS, 1, 1, 0))
    del raw["proto"]
    refused(pack(raw))


@pytest.mark.parametrize(
    "kind", ["HELLO", "Receive", "receive2", "", "TensorSpec", "__class__", 1, None, b"hello", []]
)
def test_unknown_type_is_refused(kind: Any) -> None:
    raw = plain(Receive(BUS, 1, 1, 0))
    raw["type"] = kind
    assert "unknown message type" in str(refused(pack(raw)))


def test_missing_type_is_refused() -> None:
    raw = plain(Receive(BUS, 1, 1, 0))
    del raw["type"]
    refused(pack(raw))


def paths(value: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every position inside a plain message, depth first."""
    if isinstance(value, dict):
        items = list(value.items())
    elif isinstance(value, list):
        items = list(enumerate(value))
    else:
        return []
    out = []
    for key, item in items:
        out.append((*prefix, key))
        out.extend(paths(item, (*prefix, key)))
    return out


def with_replaced(raw: Any, path: tuple[Any, ...], value: Any) -> Any:
    raw = copy.deepcopy(raw)
    parent = raw
    for step in path[:-1]:
        parent = parent[step]
    parent[path[-1]] = value
    return raw


def map_paths(msg: Any) -> list[tuple[Any, ...]]:
    """Paths to every map (the message and each nested record)."""
    raw = plain(msg)
    return [()] + [p for p in paths(raw) if isinstance(get(raw, p), dict) and p[-1] != "counters"]


def get(raw: Any, path: tuple[Any, ...]) -> Any:
    for step in path:
        raw = raw[step]
    return raw


@pytest.mark.parametrize("msg", MESSAGES, ids=ids)
def test_unknown_field_is_refused_at_any_depth(msg: Any) -> None:
    for where in map_paths(msg):
        for extra in ("extra", "Bus", "proto2", ""):
            raw = plain(msg)
            get(raw, where)[extra] = 0
            assert "unknown field" in str(refused(pack(raw))), (where, extra)
        raw = plain(msg)
        get(raw, where)[b"bus"] = 0  # a bin key is not the str key "bus"
        refused(pack(raw))


@pytest.mark.parametrize("msg", MESSAGES, ids=ids)
def test_missing_field_is_refused_at_any_depth(msg: Any) -> None:
    for where in map_paths(msg):
        for name in list(get(plain(msg), where)):
            raw = plain(msg)
            del get(raw, where)[name]
            refused(pack(raw))


# --- truncation and trailing bytes -------------------------------------------------------


@pytest.mark.parametrize("msg", MESSAGES, ids=ids)
def test_every_truncation_is_refused(msg: Any) -> None:
    data = encode(msg)
    for cut in range(len(data)):
        refused(data[:cut])


@pytest.mark.parametrize("msg", MESSAGES, ids=ids)
def test_trailing_bytes_are_refused(msg: Any) -> None:
    data = encode(msg)
    for tail in (b"\x00", b"\xc0", data):
        refused(data + tail)


# --- fuzzing: h11's property --------------------------------------------------------------

SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**63), 2**64 - 1),  # all msgpack can carry
    st.sampled_from([-1, 0, 1, 255, 256, 2**31, 2**48, 2**48 + 1, 2**63 - 1, 2**63, 2**64 - 1]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([math.nan, math.inf, -math.inf, -0.0, 1e308, 5e-324]),
    st.text(max_size=40),
    st.sampled_from(
        [
            "",
            BUS,
            SESSION,
            "x" * 5000,
            "cpu",
            "cuda",
            "copy",
            "alias",
            "float32",
            "zmqsync-a/../b",
            "../etc/passwd",
            f"zmqsync-p-{BUS}-cpu\n",
            "tcp://",
            "\0",
        ]
    ),
    st.binary(max_size=40),
)
VALUES = st.recursive(
    SCALARS,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)
# Python values msgpack cannot carry, for the field checks called directly.
PY_VALUES = st.recursive(
    SCALARS
    | st.integers(-(2**200), 2**200)
    | st.sampled_from([2**64, 2**100, -(2**64) - 1, 10**400, -(10**400)]),
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.tuples(inner, inner)
        | st.dictionaries(
            st.text(max_size=8) | st.binary(max_size=4) | st.integers(), inner, max_size=4
        )
    ),
    max_leaves=12,
)
MUTATION_SITES = [(i, p) for i, m in enumerate(MESSAGES) for p in paths(plain(m))]


@FUZZ
@given(st.binary(max_size=512))
def test_arbitrary_bytes(data: bytes) -> None:
    decodes_or_refuses(data)
    decodes_or_refuses(data, bus=BUS)


@FUZZ
@given(st.sampled_from(MESSAGES), st.binary(min_size=1, max_size=64), st.integers(0, 10_000))
def test_spliced_bytes(msg: Any, junk: bytes, at: int) -> None:
    data = encode(msg)
    at %= len(data)
    decodes_or_refuses(data[:at] + junk + data[at:])
    decodes_or_refuses(data[:at] + junk + data[at + len(junk) :])


@FUZZ
@given(st.sampled_from(MESSAGES), st.integers(0, 10_000), st.integers(1, 255))
def test_flipped_byte(msg: Any, at: int, xor: int) -> None:
    data = bytearray(encode(msg))
    data[at % len(data)] ^= xor
    decodes_or_refuses(bytes(data), bus=BUS)


@FUZZ
@given(st.sampled_from(MUTATION_SITES), VALUES)
def test_one_field_replaced_at_any_depth(site: tuple[int, tuple[Any, ...]], value: Any) -> None:
    index, path = site
    raw = with_replaced(plain(MESSAGES[index]), path, value)
    decodes_or_refuses(pack(raw))
    decodes_or_refuses(pack(raw), bus=BUS)


@FUZZ
@given(
    st.sampled_from(sorted(MESSAGE_TYPES)),
    st.dictionaries(
        st.sampled_from(sorted({name for table in FIELDS.values() for name in table})),
        VALUES,
        max_size=14,
    ),
)
def test_random_maps_of_known_fields(kind: str, fields: dict[str, Any]) -> None:
    decodes_or_refuses(pack({"proto": PROTO, "type": kind, **fields}))


@FUZZ
@given(st.sampled_from([(cls, name) for cls, table in FIELDS.items() for name in table]), PY_VALUES)
def test_each_field_check_returns_or_refuses(site: tuple[type[Any], str], value: Any) -> None:
    cls, name = site
    check, _doc = FIELDS[cls][name]
    try:
        check(value, f"{cls.__name__}.{name}")
    except ProtocolError:
        pass


IDS = st.text(st.characters(min_codepoint=0x21, max_codepoint=0x7E), min_size=1, max_size=128)
HEX16 = st.text("0123456789abcdef", min_size=16, max_size=16)
U63 = st.integers(0, 2**63 - 1)


@FUZZ
@given(HEX16, IDS, HEX16 | st.just(""), U63, st.integers(1, 2**63 - 1), st.integers(0, 63))
def test_a_template_packs_what_encode_packs(
    bus: str, worker_id: str, session: str, version: int, seq: int, slot: int
) -> None:
    ack = template(Ack, bus=bus, worker_id=worker_id, session=session)
    assert ack(version) == encode(Ack(bus, worker_id, session, version))
    receive = template(Receive, bus=bus)
    assert receive(seq, version, slot, b"") == encode(Receive(bus, seq, version, slot))
    changed = bytes([slot % 256, 1])
    assert receive(seq, version, slot, changed) == encode(Receive(bus, seq, version, slot, changed))


def test_a_template_needs_a_flat_message_and_its_own_fields() -> None:
    with pytest.raises(TypeError, match="encode"):
        template(Welcome)
    with pytest.raises(ValueError, match="nope"):
        template(Ack, nope=1)


HOT_FIELD_VALUES = {
    "bus": st.sampled_from([BUS, FOREIGN, "0123456789ABCDEF", ""]) | VALUES,
    "worker_id": st.sampled_from(["w-1", "w 1", "", "x" * 129]) | VALUES,
    "session": st.sampled_from([SESSION, "", "fedcba987654321g"]) | VALUES,
    "seq": st.sampled_from([0, 1, 2**63 - 1, 2**63, -1, True]) | VALUES,
    "version": st.sampled_from([0, 5, 2**63 - 1, 2**63, -1, False, 1.0]) | VALUES,
    "slot": st.sampled_from([0, 63, 64, -1, True]) | VALUES,
    "changed": st.sampled_from([b"", b"\x05", b"x" * 12_500, b"x" * 12_501, "ab", bytearray()])
    | VALUES,
}


@FUZZ
@given(
    st.sampled_from([Receive, Ack]).flatmap(
        lambda cls: st.tuples(
            st.just(cls),
            st.fixed_dictionaries({n: HOT_FIELD_VALUES[n] for n in FIELDS[cls]}),
            st.sets(st.sampled_from(sorted(FIELDS[cls]))),
        )
    )
)
def test_decode_of_the_hot_messages_accepts_what_the_field_checks_accept(
    case: tuple[type[Any], dict[str, Any], set[str]],
) -> None:
    """Whatever the values (and missing fields) of a RECEIVE or ACK, decode agrees with
    the field walk itself, before and after the text checks learned the strings."""
    cls, values, dropped = case
    raw = {name: v for name, v in values.items() if name not in dropped}
    try:
        expected = build(cls, dict(raw), cls.TYPE)
    except ProtocolError:
        expected = None
    frame = pack({**raw, "proto": PROTO, "type": cls.TYPE})
    for _ in range(2):  # the walk above taught the text checks; both decodes see it
        assert decodes_or_refuses(frame) == expected


NASTY = [
    None,
    True,
    False,
    -1,
    2**63,
    2**64,
    10**400,
    -(10**400),
    math.nan,
    math.inf,
    -math.inf,
    -0.0,
    "",
    "x" * 100_000,
    b"",
    b"\0" * 300,
    [],
    [[[]]],
    (1, 2),
    {},
    {1: 2},
    {b"k": 1},
    {"bus": BUS},
    object(),
]


@pytest.mark.parametrize(
    "site",
    [(cls, name) for cls, table in FIELDS.items() for name in table],
    ids=lambda site: f"{site[0].__name__}.{site[1]}",
)
def test_each_field_check_survives_nasty_values(site: tuple[type[Any], str]) -> None:
    cls, name = site
    check, _doc = FIELDS[cls][name]
    for value in NASTY:
        try:
            check(value, f"{cls.__name__}.{name}")
        except ProtocolError:
            pass


# --- manifests that parse but must not be trusted ----------------------------------------


def bad_manifest(**changes: Any) -> bytes:
    """WELCOME whose first tensor has `changes` applied (a map, before validation)."""
    raw = plain(WELCOME)
    raw["manifest"][0].update(changes)
    return pack(raw)


@pytest.mark.parametrize(
    "changes",
    [
        # shape x itemsize overflows 64 bits; the wrapped product would be 0
        {"shape": [2**40, 2**40, 2**40], "stride": [0, 2**40, 1], "nbytes": 0},  # wrapped too
        {"shape": [2**40, 2**40, 2**40], "stride": [2**48, 2**40, 1], "nbytes": 0},
        {"shape": [2**32, 2**32], "stride": [2**32, 1], "nbytes": 0},
        {"shape": [2**48] * 16, "stride": [1] * 16, "nbytes": 2**48},
        {"shape": [2**48 + 1], "stride": [1], "nbytes": 4},
        {"shape": [64, 8], "nbytes": 2047},  # shape x itemsize != nbytes
        {"shape": [64, 8], "nbytes": 2**63},
        {"shape": [-64, -8], "stride": [-8, 1], "nbytes": 2048},
        {"shape": [1] * 17, "stride": [1] * 17, "nbytes": 4},  # too many dims
        # offsets past the slot
        {"offset": SLOT_BYTES},
        {"offset": SLOT_BYTES - 256},
        {"offset": 2**48},
        {"offset": -256},
        {"offset": 2**64 - 256},
        # unaligned offsets
        {"offset": 1},
        {"offset": 128},
        {"offset": 255},
        # unknown dtypes
        {"dtype": "float128"},
        {"dtype": "torch.float32"},
        {"dtype": "Float32"},
        {"dtype": "object"},
        {"dtype": ""},
        {"dtype": 4},
        # non-contiguous strides
        {"stride": [1, 64]},
        {"stride": [8, 1, 1]},
        {"stride": [8]},
        {"stride": [0, 0]},
        {"stride": [16, 1]},
        # keys
        {"key": []},
        {"key": [""]},
        {"key": ["0", ""]},
        {"key": "0.weight"},
        {"key": ["x" * 257]},
        {"key": ["k"] * 33},
        # buffer index
        {"buffer": 2},
        {"buffer": 15},
        {"buffer": 16},
        {"buffer": -1},
    ],
    ids=repr,
)
def test_wrong_manifest_is_refused(changes: dict[str, Any]) -> None:
    refused(bad_manifest(**changes))


@pytest.mark.parametrize(
    "changes",
    [
        {"slot": 2},  # slot >= slots
        {"slots": 0},
        {"slots": 65},
        {"slot_bytes": SLOT_BYTES * 2},  # slots no longer fit in the segment
        {"slot_bytes": 3000},  # a tensor now ends past the slot
        {"buffers": []},
        {"manifest": [plain(WELCOME)["manifest"][0]] * 2 + [{}]},
        {"heartbeat": 0.0},
        {"heartbeat": math.nan},
        {"heartbeat": math.inf},
        {"heartbeat": 3601},
        {"events": "udp://x"},
        {"events": "/tmp/x.sock"},
        {"acks": ""},
        {"session": "abc"},
        {"seq": -1},
        {"version": -1},
    ],
    ids=repr,
)
def test_wrong_welcome_is_refused(changes: dict[str, Any]) -> None:
    raw = plain(WELCOME)
    raw.update(changes)
    refused(pack(raw))


@pytest.mark.parametrize(
    "changes",
    [
        {"segment": "zmqsync-../../etc/passwd"},
        {"segment": "zmqsync-a/b"},
        {"segment": "../zmqsync-a"},
        {"segment": "/dev/shm/zmqsync-a"},
        {"segment": "zmqsync-"},
        {"segment": "zmqsync-a\n"},
        {"segment": "zmqsync-a\0"},
        {"segment": "zmqsync-" + "a" * 161},
        {"kind": "rocm"},
        {"device": ""},
        {"size": 4096},
        {"size": -1},
        {"header_bytes": 2**20 + 1},
        {"handle": "not bytes"},
        {"handle": b"\0" * 257},
        {"device_uuid": "u" * 65},
    ],
    ids=repr,
)
def test_wrong_buffer_is_refused(changes: dict[str, Any]) -> None:
    raw = plain(WELCOME)
    raw["buffers"][0].update(changes)
    refused(pack(raw))


# --- where tensors may sit: what a WELCOME may ask a subscriber to allocate ---------------


def welcome_bytes(
    manifest: list[TensorSpec], slot_bytes: int = SLOT_BYTES, slots: int = 2
) -> bytes:
    """WELCOME (two buffers: the CPU segment and one GPU) listing `manifest`, packed
    without our constructor's checks, as a peer could send it."""
    raw = plain(WELCOME)
    raw["manifest"] = [protocol.to_plain(s) for s in manifest]
    raw.update(slot_bytes=slot_bytes, slots=slots, slot=0)
    for buffer in raw["buffers"]:
        buffer["size"] = buffer["header_bytes"] + slots * slot_bytes
    return pack(raw)


def accepted(manifest: list[TensorSpec], **sizes: int) -> Welcome:
    msg = decode(welcome_bytes(manifest, **sizes))
    assert isinstance(msg, Welcome) and msg.manifest == tuple(manifest)
    assert own_welcome(manifest, **sizes) == msg
    return msg


def refused_placement(manifest: list[TensorSpec], **sizes: int) -> str:
    """The message of the ProtocolError `decode` raises; our own constructor refuses the
    same manifest with a ValueError saying the same (a publisher never builds one)."""
    message = str(refused(welcome_bytes(manifest, **sizes)))
    with pytest.raises(ValueError) as info:
        own_welcome(manifest, **sizes)
    assert message == f"welcome: {info.value}"
    return message


def own_welcome(
    manifest: list[TensorSpec], slot_bytes: int = SLOT_BYTES, slots: int = 2
) -> Welcome:
    """What `welcome_bytes` packs, built with our constructor (and its checks)."""
    buffers = tuple(
        dataclasses.replace(b, size=b.header_bytes + slots * slot_bytes) for b in BUFFERS
    )
    return dataclasses.replace(
        WELCOME,
        slot=0,
        slots=slots,
        slot_bytes=slot_bytes,
        buffers=buffers,
        manifest=tuple(manifest),
    )


def test_adjacent_tensors_are_accepted_and_one_byte_more_overlaps() -> None:
    a, b = spec(("a",), "float32", (256,), 0), spec(("b",), "float32", (4,), 1024)
    accepted([a, b])
    accepted([b, a])  # any order
    wide = spec(("a",), "uint8", (1025,), 0)  # ends one byte into b
    message = refused_placement([wide, b])
    assert "a (bytes 0 to 1025) and b (bytes 1024 to 1040) overlap in buffer 0" in message
    assert message.startswith("welcome: ")
    assert "overlap in buffer 0" in refused_placement([b, wide])


@pytest.mark.parametrize(
    "offsets",
    [
        (0, 0),  # the same bytes twice
        (0, 256),  # b starts inside a
        (256, 0),  # listed after the tensor it overlaps
        (0, 768, 1024),  # b inside a, c past both
    ],
    ids=repr,
)
def test_overlapping_tensors_of_one_buffer_are_refused(offsets: tuple[int, ...]) -> None:
    manifest = [spec((f"t{i}",), "float32", (256,), at) for i, at in enumerate(offsets)]
    assert "overlap in buffer 0" in refused_placement(manifest)


def test_buffers_are_independent_but_each_one_is_checked() -> None:
    # The CPU segment and a GPU buffer each have their own slots: the same offsets in
    # two buffers are two places. Inside the GPU buffer the same rule holds.
    cpu = spec(("cpu",), "float32", (256,), 0, buffer=0)
    gpu = spec(("gpu",), "float32", (256,), 0, buffer=1)
    accepted([cpu, gpu])
    assert "overlap in buffer 0" in refused_placement([cpu, dataclasses.replace(gpu, buffer=0)])
    other = spec(("gpu2",), "float32", (4,), 512, buffer=1)
    assert "gpu (bytes 0 to 1024) and gpu2" in refused_placement([cpu, gpu, other])
    assert "overlap in buffer 1" in refused_placement([cpu, gpu, other])


def test_all_tensors_together_fit_in_one_slot() -> None:
    # No overlap in either buffer, but a subscriber reading the CPU copy finds both
    # tensors in the CPU slot, and one without a model allocates both.
    cpu = spec(("cpu",), "float32", (1536,), 0, buffer=0)  # 6144 bytes
    fits = spec(("gpu",), "float32", (512,), 0, buffer=1)  # 2048: 8192 in all
    accepted([cpu, fits])
    too_much = spec(("gpu",), "float32", (513,), 0, buffer=1)
    message = refused_placement([cpu, too_much])
    assert f"the tensors add up to 8196 bytes, more than one slot ({SLOT_BYTES} bytes)" in message


def test_empty_tensors_may_sit_anywhere_in_the_slot() -> None:
    a = spec(("a",), "float32", (256,), 0)
    empties = [
        spec(("e0",), "float32", (0,), 0),  # where a starts
        spec(("e1",), "float16", (0, 3), 512),  # inside a
        spec(("e2",), "int64", (4, 0), 512),  # twice at the same place
        spec(("e3",), "float32", (0,), SLOT_BYTES),  # at the very end
    ]
    accepted([a, *empties])
    accepted([*empties, a])
    assert "overlap" in refused_placement([a, spec(("e1",), "float16", (1,), 512)])
    assert "past the slot" in refused_placement([spec(("e",), "float32", (0,), SLOT_BYTES + 256)])


def test_overlaps_are_found_in_a_shuffled_manifest_of_many_tensors() -> None:
    n = 1_000
    manifest = [spec((f"t{i}",), "float32", (64,), 256 * i) for i in range(n)]
    random.Random(7).shuffle(manifest)
    accepted(manifest, slot_bytes=256 * n)
    late = spec(("late",), "float32", (128,), 256 * 500)  # covers t500 and t501
    manifest.insert(123, late)
    message = refused_placement(manifest, slot_bytes=256 * n)
    assert "late" in message and "t500" in message and "overlap in buffer 0" in message


def test_a_big_legitimate_manifest_decodes_in_time() -> None:
    # 20,000 small tensors (a mixture-of-experts model's count), laid out as the
    # publisher lays them out: one pass. Shuffled, the check sorts: still far from the
    # ~0.5 s the decode of the message itself takes here.
    n = 20_000
    manifest = [spec((f"e{i}",), "float32", (4,), 256 * i) for i in range(n)]
    started = time.perf_counter()
    msg = accepted(manifest, slot_bytes=256 * n)
    assert decode(encode(msg)) == msg
    decoded_s = time.perf_counter() - started
    shuffled = tuple(random.Random(1).sample(manifest, n))
    started = time.perf_counter()
    protocol._check_placement(shuffled, 2, 256 * n)
    assert time.perf_counter() - started < max(1.0, decoded_s), "the check is not O(n log n)"


def test_the_tensor_view_budget_is_a_receivers_check() -> None:
    # A subscriber builds a view of every tensor in every slot. Empty tensors take no
    # room, so only a budget bounds them; a publisher that builds such a WELCOME is
    # consistent (its handshake thread must not fail), and the subscriber refuses it.
    budget = protocol.MAX_SLOT_VIEWS
    slots, count = 64, budget // 64
    empties = [spec((f"e{i}",), "float32", (0,), 0) for i in range(count + 1)]
    accepted(empties[:count], slots=slots)
    message = str(refused(welcome_bytes(empties, slots=slots)))
    assert f"64 slots x {count + 1} tensors = {slots * (count + 1)} tensor views" in message
    assert f"more than {budget}" in message and "fewer slots" in message
    own = own_welcome(empties, slots=slots)  # a publisher builds it without complaint
    assert len(own.manifest) == count + 1


@pytest.mark.parametrize("worker_id", ["", "a b", "a\n", "é", "x" * 129, "\x7f", "tab\there"])
def test_worker_id_must_be_printable_ascii(worker_id: str) -> None:
    raw = plain(HELLO)
    raw["worker_id"] = worker_id
    refused(pack(raw))


# --- size, depth, hostile payloads -------------------------------------------------------


@pytest.mark.parametrize("field", ["worker_id", "host", "mode", "bus", "unknown"])
def test_ten_megabyte_string_is_refused(field: str) -> None:
    raw = plain(HELLO)
    raw[field] = "x" * (10 * 2**20)
    refused(pack(raw))


def test_ten_megabyte_key_and_blob_are_refused() -> None:
    raw = plain(HELLO)
    raw["k" * (10 * 2**20)] = 1
    refused(pack(raw))
    raw = plain(WELCOME)
    raw["buffers"][0]["handle"] = b"\0" * (10 * 2**20)
    refused(pack(raw))


def test_oversized_message_is_refused_before_parsing() -> None:
    raw = plain(HELLO)
    raw["host"] = "h" * MAX_MESSAGE
    assert "exceeds" in str(refused(pack(raw)))


def test_huge_declared_lengths_are_refused() -> None:
    # headers promising 4 GiB arrays, maps, strings and blobs that never come
    for head in (b"\xdd", b"\xdf", b"\xdb", b"\xc6"):
        refused(head + b"\xff\xff\xff\xff")
        refused(b"\x81\xa5proto" + head + b"\xff\xff\xff\xff")


def test_many_small_items_are_refused() -> None:
    raw = plain(WELCOME)
    raw["buffers"] = [raw["buffers"][0]] * 17
    refused(pack(raw))
    raw = plain(HELLO)
    raw["mode"] = [0] * 1_000_000
    refused(pack(raw))


NESTINGS = [1, 100, 500, 900, 990, 999, 1000, 1010, 1023, 1024, 1025, 5000, 100_000]


def nested_list(depth: int) -> bytes:
    return b"\x91" * depth + b"\xc0"  # [[[...[nil]...]]]


def nested_map(depth: int) -> bytes:
    return b"\x81\xa1k" * depth + b"\xc0"  # {"k": {"k": ... nil}}


def field(name: str, value: bytes) -> bytes:
    return bytes([0xA0 | len(name)]) + name.encode() + value


@pytest.mark.parametrize("depth", NESTINGS)
@pytest.mark.parametrize("build", [nested_list, nested_map], ids=["list", "map"])
def test_deep_nesting_is_refused(depth: int, build: Any) -> None:
    deep = build(depth)
    refused(deep)
    # as proto, as type, and as the value of a checked field of a valid message
    refused(b"\x81" + field("proto", deep))
    refused(b"\x82" + field("proto", b"\x01") + field("type", deep))
    hello = plain(HELLO)
    del hello["mode"]
    prefix = bytearray(pack(hello))
    assert prefix[0] == 0x80 | len(hello)
    prefix[0] += 1
    refused(bytes(prefix) + field("mode", deep))
    refused(bytes(prefix) + field("pid", deep))


def test_deep_nesting_packed_by_msgpack_is_refused() -> None:
    value: Any = None
    for depth in range(500):  # msgpack's own packer stops at 512
        value = [value] if depth % 2 else {"k": value}
    raw = plain(HELLO)
    raw["host"] = value
    refused(pack(raw))
    raw = plain(WELCOME)
    raw["manifest"][0]["key"] = value
    refused(pack(raw))


def test_ext_types_are_refused() -> None:
    for value in (msgpack.ExtType(1, b"x"), msgpack.Timestamp(1, 2)):
        raw = plain(HELLO)
        raw["host"] = value
        refused(pack(raw))
    refused(b"\x81\xa5proto\xc7\x0c\xff" + b"\xff" * 12)  # a timestamp that cannot be


class Canary:
    """Pickles to 'create this directory': the shape of every pickle RCE."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.mkdir, (self.path,))


def test_canary_payload_is_live(tmp_path: Path) -> None:
    # The payload does act when unpickled, so the test below proves something.
    pickle.loads(pickle.dumps(Canary(tmp_path / "proof")))
    assert (tmp_path / "proof").is_dir()


@pytest.mark.parametrize("proto", range(pickle.HIGHEST_PROTOCOL + 1))
def test_pickle_payload_is_never_unpickled(tmp_path: Path, proto: int) -> None:
    canary = tmp_path / "canary"
    payload = pickle.dumps(Canary(canary), protocol=proto)
    wrapped = pickle.dumps({"proto": 1, "type": "hello", "obj": Canary(canary)}, protocol=proto)
    for data in (payload, wrapped, pack({"proto": 1, "type": "hello"}) + payload):
        refused(data)
        refused(data, bus=BUS)
    # inside a valid message it is only bytes, handed back untouched
    raw = plain(WELCOME)
    raw["buffers"][0]["handle"] = payload[:256]
    welcome = decode(pack(raw))
    assert isinstance(welcome, Welcome) and welcome.buffers[0].handle == payload[:256]
    raw = plain(HELLO)
    raw["host"] = payload  # bin where str is expected
    refused(pack(raw))
    assert not canary.exists()


def test_non_bytes_input_is_refused() -> None:
    for data in (None, "hello", 1, [encode(HELLO)], memoryview(b"\0" * 8).cast("Q")):
        refused(data)


# --- the module itself -------------------------------------------------------------------

FORBIDDEN_IMPORTS = {"zmq", "time", "socket", "torch", "pickle", "asyncio", "threading", "os"}


@pytest.mark.parametrize("module", [protocol, checks, fast_frames], ids=lambda m: m.__name__)
def test_protocol_modules_do_no_io(module: Any) -> None:
    source = Path(module.__file__).read_text(encoding="utf-8")
    imported = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            imported |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            imported.add(node.module.split(".")[0])
        elif isinstance(node, ast.Name) and node.id in ("__import__", "eval", "exec"):
            imported.add(node.id)
    assert imported, "no imports found: the parse is wrong"
    assert not imported & (FORBIDDEN_IMPORTS | {"__import__", "eval", "exec", "importlib"})
