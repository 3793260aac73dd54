"""The publisher's protocol rules, driven directly: messages and an explicit clock, no I/O.

`PublisherRole` decides who may join, what a WELCOME and a STATE say, what worker
messages change and what liveness sends. Every test here is exact: no sockets, no
threads, no sleeping.
"""

from __future__ import annotations

import dataclasses
import itertools

import pytest

from zmqsync._config import FIRST_WORD_PER_TENSOR_S, FIRST_WORD_S, LOST_AFTER_BEATS
from zmqsync._errors import ProtocolError
from zmqsync._protocol import (
    Ack,
    BufferInfo,
    Bye,
    Error,
    Heartbeat,
    Hello,
    Stop,
    TensorSpec,
    contiguous_stride,
    decode,
    encode,
)
from zmqsync._publisher_role import Endpoints, PublisherRole

BUS = "0123456789abcdef"
SPEC = TensorSpec(("w",), "float32", (4,), contiguous_stride((4,)), 0, 16)
CPU = BufferInfo("cpu", "cpu", "zmqsync-t-0123456789abcdef-cpu", 4096 * 3, 4096)


def role(**options) -> PublisherRole:
    """A role as a started publisher has it: version 0 in slot 0, endpoints bound."""
    sessions = (f"{i:016x}" for i in itertools.count(1))
    settings = dict(
        name="t",
        bus_id=BUS,
        slots=2,
        heartbeat=0.5,
        slot_bytes=4096,
        manifest=(SPEC,),
        now=0.0,
        new_session=lambda: next(sessions),
    )
    r = PublisherRole(**{**settings, **options})
    r.record(0, 0)
    r.endpoints = Endpoints("ipc:///r/t.sock.events", "ipc:///r/t.sock.acks", "", (CPU,))
    return r


def hello(worker_id: str = "w", session: str = "", mode: str = "copy", nonce: str = "") -> Hello:
    return Hello("", worker_id, 7, "host", mode, "cpu", "", session, nonce)


def join(r: PublisherRole, worker_id: str = "w", now: float = 0.0, **kw):
    return r.welcome(r.admit(hello(worker_id, **kw), now), now)


def test_a_welcome_names_everything_a_worker_needs_and_round_trips():
    r = role()
    welcome, replaced = join(r)
    assert replaced is None
    assert (welcome.bus, welcome.session, welcome.seq, welcome.version, welcome.slot) == (
        BUS,
        "0000000000000001",
        0,
        0,
        0,
    )
    assert (welcome.events, welcome.acks, welcome.buffers, welcome.manifest) == (
        "ipc:///r/t.sock.events",
        "ipc:///r/t.sock.acks",
        (CPU,),
        (SPEC,),
    )
    assert decode(encode(welcome)) == welcome
    assert r.counters["handshakes"] == 1 and list(r.registry.members) == ["w"]


def test_handshakes_beyond_the_rate_are_busy_then_allowed_again():
    r = role(handshake_rate=2.0)  # a burst of 4
    for i in range(4):
        join(r, f"w{i}", now=0.0)
    with pytest.raises(ProtocolError, match="busy: too many handshakes"):
        r.admit(hello("w4"), 0.0)
    assert r.counters["throttled"] == 1
    join(r, "w4", now=0.5)  # one token back after half a second


def test_refusals_that_cost_nothing_spend_no_handshake_token():
    r = role(handshake_rate=2.0, max_workers=2, max_workers_per_peer=2)  # a burst of 4
    join(r, "live", now=0.0)
    for _ in range(1000):  # a storm for a live worker's id
        with pytest.raises(ProtocolError, match="busy: worker id 'live' is in use"):
            r.admit(hello("live"), 0.0)
    join(r, "b", now=0.0)
    for _ in range(1000):  # a storm of new ids on a full bus
        with pytest.raises(ProtocolError, match="bus full"):
            r.admit(hello("new"), 0.0)
    assert (r.counters["refused_ids"], r.counters["throttled"]) == (1000, 0)
    assert r.queue.take("x", 0.0) and r.queue.take("y", 0.0), "two of four tokens left"


def test_a_throttled_worker_keeps_its_place_in_line():
    r = role(handshake_rate=2.0)  # a burst of 4, then one token every 0.5 s
    for i in range(4):
        join(r, f"w{i}", now=0.0)
    with pytest.raises(ProtocolError, match="busy: too many handshakes"):
        r.admit(hello("first"), 0.0)
    with pytest.raises(ProtocolError, match="busy: too many handshakes"):
        r.admit(hello("second"), 0.25)
    with pytest.raises(ProtocolError, match="busy: too many handshakes"):
        r.admit(hello("second"), 0.5)  # the token at 0.5 is first's
    join(r, "first", now=0.5)
    join(r, "second", now=1.0)
    assert r.counters["throttled"] == 3


def test_a_process_re_joins_by_its_nonce_and_a_former_holder_is_told_taken():
    r = role()
    lost, _ = join(r, "w", now=0.0, nonce="a" * 32)  # its WELCOME never arrived
    again, replaced = join(r, "w", now=0.5, nonce="a" * 32)
    assert replaced is not None and replaced.session == lost.session
    assert lost.session in r.registry.displaced
    assert again.session != lost.session
    assert r.on_ack("w", again.session, 0, 1.0)
    for member in r.drop_silent(now=4.5):  # then paused: silent for six beats
        r.stop_for(member.session, "silent too long")
    with pytest.raises(ProtocolError, match="busy: worker id 'w' is kept for the process"):
        join(r, "w", now=4.5, nonce="b" * 32)  # kept for its process: 5 s at least
    join(r, "w", now=9.6, nonce="b" * 32)  # then another process may take the id
    with pytest.raises(ProtocolError, match="taken: worker id 'w' belongs to another process"):
        r.admit(hello("w", session=again.session, nonce="a" * 32), 10.0)
    assert r.counters["refused_ids"] == 2


def test_a_full_bus_refuses_new_ids_and_still_welcomes_known_ones():
    r = role(max_workers=1)
    join(r, "a")
    with pytest.raises(ProtocolError, match=r"bus full: 1 workers \(max_workers\)"):
        r.admit(hello("b"), 0.1)
    with pytest.raises(ProtocolError, match="bus full: no room for more connections"):
        role().admit(hello("b"), 0.1, connections_full=True)
    session = r.registry.members["a"].session
    assert r.admit(hello("a", session=session), 0.2).worker_id == "a"


def test_a_live_workers_id_is_refused_without_its_session():
    r = role()
    first, _ = join(r, "w", now=0.0)
    with pytest.raises(ProtocolError, match="busy: worker id 'w' is in use by a live worker"):
        join(r, "w", now=1.0)
    assert r.counters["refused_ids"] == 1
    again, replaced = join(r, "w", now=1.0, session=first.session)
    assert replaced is not None and replaced.session == first.session
    assert again.session != first.session
    stop = r.stop_for(replaced.session, "replaced")
    assert stop == Stop(BUS, 1, first.session, "replaced") and r.seq == 1
    assert first.session in r.registry.displaced


def test_a_silent_sessions_id_may_be_taken_by_anyone_once_its_reserve_is_over():
    r = role()
    first, _ = join(r, "w", now=0.0)
    r.on_worker_message(Heartbeat(BUS, 0, "w", first.session, 0), 1.0)
    with pytest.raises(ProtocolError, match="busy: worker id 'w' is in use"):
        join(r, "w", now=4.01)  # 6 beats of 0.5 s: silent, and kept for 5 s more
    second, replaced = join(r, "w", now=9.01)
    assert replaced is not None and replaced.session == first.session
    assert r.registry.displaced == {}


def test_a_worker_gets_longer_for_its_first_word_than_for_the_next():
    # its handshake (decode the WELCOME, map, subscribe, apply) may take longer than six
    # short beats on a loaded host: dropped then, it would never get in
    r = role(heartbeat=0.125)
    welcome, _ = join(r, "w", now=0.0)
    assert r.drop_silent(FIRST_WORD_S) == []
    with pytest.raises(ProtocolError, match="busy:"):
        join(r, "w", now=FIRST_WORD_S)
    assert r.on_ack("w", welcome.session, 0, FIRST_WORD_S)
    assert r.drop_silent(FIRST_WORD_S + 0.75) == []
    assert [m.worker_id for m in r.drop_silent(FIRST_WORD_S + 0.875)] == ["w"]
    join(r, "x", now=10.0)
    assert [m.worker_id for m in r.drop_silent(10.0 + FIRST_WORD_S + 0.125)] == ["x"]


def test_a_first_word_may_take_longer_on_a_bus_of_many_tensors():
    # a worker maps, checks and views every tensor before it can ack its first version
    many = tuple(
        TensorSpec((f"t{i}",), "float32", (4,), contiguous_stride((4,)), 256 * i, 16)
        for i in range(50_000)
    )
    r = role(heartbeat=0.125, manifest=many, slot_bytes=256 * 50_000)
    cpu = dataclasses.replace(CPU, size=4096 + 2 * 256 * 50_000)
    r.endpoints = dataclasses.replace(r.endpoints, buffers=(cpu,))
    join(r, "w", now=0.0)
    limit = FIRST_WORD_S + 50_000 * FIRST_WORD_PER_TENSOR_S
    assert limit == pytest.approx(15.0)
    assert r.drop_silent(limit - 0.25) == []
    assert [m.worker_id for m in r.drop_silent(limit + 0.25)] == ["w"]


def test_worker_messages_count_only_with_the_current_session():
    r = role()
    welcome, _ = join(r)
    r.record(1, 1)
    assert r.on_worker_message(Ack(BUS, "w", welcome.session, 1), 1.0)
    assert not r.on_worker_message(Ack(BUS, "w", "f" * 16, 1), 1.0)
    assert not r.on_worker_message(Heartbeat(BUS, 0, "w", "f" * 16, 1), 1.0)
    assert not r.on_worker_message(Heartbeat(BUS, 0, "w", welcome.session, 1), 2.0)
    assert r.registry.members["w"].last_seen == 2.0
    assert not r.on_worker_message(Error(BUS, "no"), 2.0)
    assert (r.counters["acks"], r.counters["stale"], r.counters["rejected"]) == (1, 2, 1)
    assert r.on_worker_message(Bye(BUS, "w", welcome.session), 3.0)
    assert r.registry.members == {}


def test_liveness_drops_silent_workers_and_numbers_each_stop():
    r = role()
    a, _ = join(r, "a", now=0.0)
    join(r, "b", now=0.0)
    r.on_worker_message(Heartbeat(BUS, 0, "a", a.session, 0), 1.0)
    r.on_worker_message(Heartbeat(BUS, 0, "b", r.registry.members["b"].session, 0), 3.0)
    assert r.heartbeat_event() == Heartbeat(BUS, 0, "", "", 0)
    assert r.drop_silent(4.0) == []
    lost = r.drop_silent(4.01)
    assert [m.worker_id for m in lost] == ["a"] and r.counters["lost"] == 1
    assert r.stop_for(a.session, "silent too long") == Stop(BUS, 1, a.session, "silent too long")
    assert r.heartbeat_event().seq == 1, "the heartbeat carries the last event seq"
    assert list(r.registry.members) == ["b"]


def test_the_sweep_waits_for_unread_frames_but_not_for_ever():
    r = role()  # six beats of 0.5 s
    a, _ = join(r, "a", now=0.0)
    r.on_worker_message(Heartbeat(BUS, 0, "a", a.session, 0), 1.0)
    for beat in range(LOST_AFTER_BEATS):  # its last heartbeats may wait there, unread
        assert r.drop_silent(5.0 + beat, unread=True) == []
    assert [m.worker_id for m in r.drop_silent(11.0, unread=True)] == ["a"], "a flood"
    b, _ = join(r, "b", now=20.0)
    r.on_worker_message(Heartbeat(BUS, 0, "b", b.session, 0), 20.0)
    assert r.drop_silent(24.0, unread=True) == [], "the count starts again"
    assert [m.worker_id for m in r.drop_silent(24.5)] == ["b"]


def test_a_dropped_session_that_still_beats_is_told_again_once_per_beat():
    # its STOP went out before its subscription was live: it would beat with a dead
    # session for ever, a member of nothing, never re-joining
    r = role()
    a, _ = join(r, "a", now=0.0)
    assert r.gone("a", a.session, 1.0) is None, "a live session"
    [dropped] = r.drop_silent(FIRST_WORD_S + 0.5)
    assert r.stop_for(dropped.session, "silent too long").seq == 1
    assert r.gone("a", a.session, 6.0) == Stop(BUS, 2, a.session, "not on the bus")
    assert r.gone("a", a.session, 6.25) is None, "once per beat"
    assert r.gone("a", a.session, 6.5) == Stop(BUS, 3, a.session, "not on the bus")
    assert r.gone("a", "0" * 16, 7.0) is None, "a session this bus never issued"
    assert r.gone("b", a.session, 7.0) is None, "nor another worker's"
    assert r.counters["told_gone"] == 2


def test_state_shows_workers_their_notes_and_extra_counters():
    r = role()
    join(r, "w", now=0.0)
    state = r.state(1.5, pid=42, extra={"connections": 3})
    assert (state.bus, state.name, state.pid, state.version, state.slots) == (BUS, "t", 42, 0, 2)
    assert [(w.worker_id, w.last_seen, w.version) for w in state.workers] == [("w", 1.5, -1)]
    assert state.counters == {"handshakes": 1, "connections": 3}
    assert decode(encode(state)) == state


def test_closing_refuses_handshakes_and_says_stop_to_everyone():
    r = role()
    stop = r.close()
    assert stop == Stop(BUS, 1, "", "publisher closed")
    with pytest.raises(ProtocolError, match="the publisher is closing"):
        r.admit(hello(), 0.0)


def test_evictions_are_counted():
    r = role()
    join(r, "a")
    join(r, "b")
    assert [m.worker_id for m in r.evict(["a", "zz"], now=0.0)] == ["a"]
    assert r.counters["evictions"] == 1 and list(r.registry.members) == ["b"]


def test_a_publish_is_booked_through_the_role():
    # what AckWait and the Announcer ask, in the order a publish asks it
    r = role()  # version 0 in slot 0, recorded without counting a publish
    a, _ = join(r, "a")
    b, _ = join(r, "b", mode="alias")
    assert (r.latest, r.counters["publishes"], r.applied_workers()) == (0, 0, 0)
    targets = r.targets()
    assert [w for w, _ in targets] == ["a", "b"]
    assert r.targets(["b", "x"]) == (targets[1], ("x", "")), "x: whoever holds it then"
    assert (r.copy_readers(), r.alias_readers(), r.cpu_readers()) == (True, True, True)
    assert r.free_slot() == 1 and r.holders(1) == []
    r.published(1, 1, written=16)
    assert (r.latest, r.counters["publishes"], r.counters["written_bytes"]) == (1, 1, 16)
    ready = r.all_acked(1, targets)
    assert not ready() and r.missing(1, targets) == ["a", "b"] and r.acked(1, targets) == []
    assert r.lags(1, targets) == {"a": 2, "b": 2}  # welcomed at 0: about to replace -1
    assert r.on_ack("a", a.session, 1, 1.0) and not ready()
    assert r.on_ack("b", b.session, 1, 1.0) and ready()
    assert r.acked(1, targets) == ["a", "b"] and r.lags(1, targets) == {"a": 0, "b": 0}
    assert r.applied_workers() == 2 and r.infos(100.0)["b"].last_seen == 101.0
    assert r.member("b", b.session).acked == 1 and r.member("b", "f" * 16) is None
    assert r.free_slot() == 0, "b computes with version 1 (alias): slot 1 is pinned"
    r.published(2, 0, written=16)
    assert r.free_slot() is None and r.holders(0) == ["a", "b"] and r.holders(1) == ["b"]
    assert r.blockers() == ["a", "b"], "the holders of the slot fewest workers pin"
    r.timed_out()
    assert [m.worker_id for m in r.evict(r.blockers(), 2.0)] == ["a", "b"]
    assert (r.counters["timeouts"], r.counters["evictions"], dict(r.members)) == (1, 2, {})


def test_what_the_agent_counts_goes_through_the_role():
    r = role()
    r.count("rejected")
    r.count("rejected", 2)
    r.count("dropped_peers", 0)  # counted, as a drain that dropped nobody counts it
    assert dict(r.counters) == {"rejected": 3, "dropped_peers": 0}


def test_the_trainers_home_slot_is_never_handed_out():
    r = role()
    join(r, "w")  # welcomed at version 0: it reads slot 0
    r.reserve_home(1)
    assert r.free_slot() is None, "slot 0 is being read, slot 1 is the trainer's home"
    r.reserve_home(None)
    assert r.free_slot() == 1
