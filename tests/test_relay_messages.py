"""The relay channel's messages go through the protocol module's one codec: `MessageSet`.

A set is defined like the bus's own messages (frozen dataclasses, a field table that is
the specification) and keeps h11's rule for `decode`: a message or `ProtocolError`,
nothing else. Defining a set changes nothing about the bus's messages.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.test_relay import MESSAGES
from zmqsync import ProtocolError
from zmqsync import _protocol as protocol
from zmqsync._checks import choice, integer, record, text
from zmqsync._protocol import FIELDS, MESSAGE_TYPES, MessageSet, TensorSpec, WorkerEntry
from zmqsync.relay import _membership, _messages
from zmqsync.relay._messages import RELAY

ROOT = Path(__file__).resolve().parent.parent
FUZZ = settings(max_examples=200, deadline=None)


def test_every_relay_message_type_is_exercised_and_none_is_a_bus_message():
    assert {type(m) for m in MESSAGES} == set(RELAY.types.values())
    assert set(RELAY.fields) == set(RELAY.types.values()) | {_messages.RelayInfo}
    assert not set(RELAY.fields) & set(FIELDS), "the bus's tables are untouched"
    assert not set(RELAY.types) & set(MESSAGE_TYPES)


@pytest.mark.parametrize("msg", MESSAGES, ids=lambda m: m.TYPE)
def test_a_relay_frame_is_a_map_of_proto_type_and_exactly_the_fields(msg):
    raw = msgpack.unpackb(RELAY.encode(msg))
    fields = list(RELAY.fields[type(msg)])
    assert sorted(raw) == sorted([*fields, "proto", "type"])
    assert (raw["proto"], raw["type"]) == (1, msg.TYPE)
    with pytest.raises(ProtocolError, match="relay protocol"):
        RELAY.decode(msgpack.packb(dict(raw, proto=True)))


def test_a_bus_message_is_not_a_relay_message_and_the_other_way_round():
    with pytest.raises(ProtocolError, match="unknown relay message type 'inspect'"):
        RELAY.decode(protocol.encode(protocol.Inspect("")))
    with pytest.raises(ProtocolError, match="unknown message type 'relay_bye'"):
        protocol.decode(RELAY.encode(_messages.Bye("1" * 16)))
    with pytest.raises(TypeError, match="not a relay message"):
        RELAY.encode(protocol.Inspect(""))  # type: ignore[arg-type]


def test_decode_refuses_what_is_not_bytes_or_too_long():
    with pytest.raises(ProtocolError, match="expected bytes"):
        RELAY.decode("relay_bye")  # type: ignore[arg-type]
    with pytest.raises(ProtocolError, match="exceeds"):
        RELAY.decode(b"\x80" * (protocol.MAX_MESSAGE + 1))


# --- h11's rule, fuzzed ---------------------------------------------------------------------


def decodes_or_refuses(data: bytes) -> None:
    try:
        msg = RELAY.decode(data)
    except ProtocolError:
        return
    assert type(msg) in RELAY.types.values()
    assert RELAY.decode(RELAY.encode(msg)) == msg


SCALARS = st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats()
VALUES = st.recursive(
    SCALARS | st.text() | st.binary(),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)


@FUZZ
@given(st.binary(max_size=256))
def test_arbitrary_bytes(data: bytes) -> None:
    decodes_or_refuses(data)


@FUZZ
@given(st.sampled_from(MESSAGES), st.data())
def test_one_field_replaced(msg: Any, data: st.DataObject) -> None:
    raw = msgpack.unpackb(RELAY.encode(msg))
    name = data.draw(st.sampled_from(sorted(raw)))
    raw[name] = data.draw(VALUES)
    decodes_or_refuses(msgpack.packb(raw, use_bin_type=True))


@FUZZ
@given(st.sampled_from(MESSAGES), st.integers(0, 10_000))
def test_every_truncation(msg: Any, at: int) -> None:
    frame = RELAY.encode(msg)
    decodes_or_refuses(frame[: at % len(frame)])


# --- defining a set ---------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Ping:
    """a -> b: are you there?"""

    TYPE: ClassVar[str] = "ping"
    name: str
    count: int
    specs: tuple[TensorSpec, ...]


@dataclass(frozen=True, slots=True)
class Pong:
    TYPE: ClassVar[str] = "pong"
    mood: str


@dataclass(slots=True)
class Mutable:
    TYPE: ClassVar[str] = "mutable"
    x: int


def test_a_new_set_decodes_its_own_messages_with_bus_records_inside():
    pings: MessageSet[Ping | Pong] = MessageSet("ping", 7)
    pings.define(
        Ping,
        {
            "name": (text(8, re.compile(r"^[a-z]+\Z")), "who"),
            "count": (integer(0, 9), "how many"),
            "specs": (protocol.list_of(record(TensorSpec), 2), "tensors"),
        },
    )
    pings.define(Pong, {"mood": (choice("ok", "busy"), "how it is")})
    spec = TensorSpec(("w",), "float32", (2,), (1,), 0, 8)
    ping = Ping("abc", 3, (spec,))
    assert pings.decode(pings.encode(ping)) == ping
    assert msgpack.unpackb(pings.encode(Pong("ok"))) == {"mood": "ok", "proto": 7, "type": "pong"}
    for bad, why in [
        ({"name": "ABC"}, "does not match"),
        ({"count": 10}, "outside"),
        ({"count": True}, "expected an integer"),
        ({"specs": [{"key": ["w"]}]}, "missing field"),
        ({"extra": 1}, "unknown field"),
    ]:
        raw = dict(msgpack.unpackb(pings.encode(ping)), **bad)
        with pytest.raises(ProtocolError, match=why):
            pings.decode(msgpack.packb(raw))
    with pytest.raises(ProtocolError, match="ping protocol '1', expected 7"):
        pings.decode(msgpack.packb({"proto": 1, "type": "pong", "mood": "ok"}))


def test_a_definition_must_match_its_dataclass_exactly():
    pings: MessageSet[Any] = MessageSet("ping", 1)
    with pytest.raises(TypeError, match="frozen dataclass"):
        pings.define(Mutable, {"x": (integer(), "")})

    @dataclass(frozen=True)
    class Tick:
        TYPE: ClassVar[str] = "tick"
        mood: str

    with pytest.raises(ValueError, match="the table names"):
        pings.define(Tick, {"mood": (choice("ok"), ""), "extra": (integer(), "")})
    with pytest.raises(ValueError, match="defined already"):
        pings.define(WorkerEntry, dict(FIELDS[WorkerEntry]))
    with pytest.raises(ValueError, match="defined already"):
        pings.define(_messages.Bye, dict(RELAY.fields[_messages.Bye]))

    @dataclass(frozen=True)
    class Other:
        TYPE: ClassVar[str] = "pong"
        y: int

    @dataclass(frozen=True)
    class Pong2:
        TYPE: ClassVar[str] = "pong"
        z: int

    pings.define(Other, {"y": (integer(), "")})
    with pytest.raises(ValueError, match="not a new type name"):
        pings.define(Pong2, {"z": (integer(), "")})


# --- the spec and its docs --------------------------------------------------------------


def test_every_relay_field_has_a_row_in_the_protocol_reference():
    doc = (ROOT / "docs" / "protocol.md").read_text(encoding="utf-8")
    part = doc[doc.index("# Relay control channel") :]
    sections = dict(re.findall(r"^## (\S+)\n(.*?)(?=^## |\Z)", part, flags=re.M | re.S))
    for cls, table in RELAY.fields.items():
        title = cls.TYPE.upper() if cls in RELAY.types.values() else cls.__name__
        for name in table:
            assert f"| `{name}` |" in sections[title], f"{title}.{name} missing"


@pytest.mark.parametrize("module", [_messages, _membership], ids=lambda m: m.__name__)
def test_messages_and_membership_do_no_io_and_know_no_tensors(module):
    imported = set()
    for node in ast.walk(ast.parse(Path(module.__file__).read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            imported |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            imported.add(node.module.split(".")[0])
    forbidden = {"zmq", "time", "socket", "torch", "threading", "os", "pickle", "subprocess"}
    assert imported and not imported & forbidden
