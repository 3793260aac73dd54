"""The subscriber's side of the link, driven directly: no sockets, no threads, explicit `now`.

`Link` holds the Clone rules (each event once, in seq order; a gap repaired from the
header's latest), liveness (LOST after LOST_AFTER_BEATS silent beats, a handshake tried
once per beat), the session a HELLO proves a re-join with, and the slot-range check.
Every test feeds it messages and times and checks exactly what it answers.
"""

from __future__ import annotations

import pytest

from zmqsync._config import FIRST_WORD_S, LOST_AFTER_BEATS, REJOIN_MIN_S
from zmqsync._link import (
    Handshake,
    Link,
    LinkState,
    Lost,
    Offer,
    Rejected,
    Repair,
    Stopped,
)
from zmqsync._protocol import (
    Ack,
    BufferInfo,
    Bye,
    Heartbeat,
    Hello,
    Message,
    Receive,
    Stop,
    Welcome,
    decode,
    encode,
)
from zmqsync._publisher_role import Endpoints, PublisherRole

BUS = "0123456789abcdef"
OTHER = "fedcba9876543210"
SESSION = "00000000000000aa"
HB = 0.5  # a binary fraction: every time below is exact


def welcome(**changes) -> Welcome:
    """A WELCOME to bus BUS: version 3 in slot 1 of 2, events up to seq 10 covered."""
    slots, slot_bytes = changes.pop("slots", 2), 4096
    cpu = BufferInfo("cpu", "cpu", "zmqsync-t-cpu", 4096 + slots * slot_bytes, 4096)
    fields = {
        "bus": BUS,
        "session": SESSION,
        "seq": 10,
        "version": 3,
        "slot": 1,
        "slots": slots,
        "slot_bytes": slot_bytes,
        "heartbeat": HB,
        "events": "ipc:///tmp/t.events",
        "acks": "ipc:///tmp/t.acks",
        "tap": "",
        "buffers": (cpu,),
        "manifest": (),
    }
    return Welcome(**{**fields, **changes})


def active(now: float = 0.0, **changes) -> Link:
    """A link that adopted `welcome(**changes)` at `now`."""
    link = Link("w0", "alias")
    link.welcome(welcome(**changes), now, latest=None)
    return link


def beat(version: int = 3) -> Heartbeat:
    """The HEARTBEAT worker w0 sends on BUS."""
    return Heartbeat(BUS, 0, "w0", SESSION, version)


def lost_by_silence(link: Link) -> float:
    """Silence until the link is LOST; the time it happened (last heard at 0)."""
    at = HB * LOST_AFTER_BEATS + HB
    assert link.tick(at, 3) == (beat(), Lost("publisher silent"))
    return at


# --- the handshake ----------------------------------------------------------------------


def test_a_new_link_holds_nothing():
    link = Link("w0", "copy")
    assert link.state is LinkState.NEW and not link.connected
    assert (link.bus_id, link.session, link.last_seq, link.slots) == ("", "", 0, 0)
    assert (link.heartbeat, link.last_heard, link.next_tick, link.stopped) == (0.5, 0.0, 0.0, False)
    assert link.counters == {"rejected": 0, "foreign": 0, "gaps": 0}


def test_the_first_hello_carries_no_session():
    link = Link("w0", "alias")
    assert link.hello(42, "host", "cuda", "") == Hello(
        "", "w0", 42, "host", "alias", "cuda", "", ""
    )


def test_every_hello_carries_the_same_nonce():
    nonce = "0123456789abcdef" * 2
    link = Link("w0", "copy", nonce=nonce)
    first = link.hello(42, "host", "cpu", "")
    assert first == Hello("", "w0", 42, "host", "copy", "cpu", "", "", nonce)
    assert link.fallback_hello(first, welcome(), "cpu", "no GPU").nonce == nonce
    link.welcome(welcome(), 0.0, latest=None)
    lost_by_silence(link)
    assert link.hello(42, "host", "cpu", "").nonce == nonce, "a re-join proves the process"


def test_welcome_makes_the_link_active_on_its_bus():
    link = Link("w0", "alias")
    offer = link.welcome(welcome(heartbeat=0.25, seq=7), now=2.0, latest=None)
    assert offer == Offer(BUS, 3, 1), "the WELCOME's version, in its slot"
    assert link.state is LinkState.ACTIVE and link.connected
    assert (link.bus_id, link.session, link.last_seq, link.slots) == (BUS, SESSION, 7, 2)
    assert (link.heartbeat, link.last_heard, link.stopped) == (0.25, 2.0, False)
    assert link.next_tick == 0.0, "the first beat is due at once"
    assert link.counters == {"rejected": 0, "foreign": 0, "gaps": 0}


def test_every_later_hello_carries_the_session_held_now():
    link = active()
    assert link.hello(42, "host", "cpu", "").session == SESSION, "proves the same process"
    lost_by_silence(link)
    assert link.hello(42, "host", "cpu", "") == Hello(
        "", "w0", 42, "host", "alias", "cpu", "", SESSION
    )
    link.welcome(welcome(bus=OTHER, session="00000000000000bb"), 5.0, latest=None)
    assert link.hello(42, "host", "cpu", "").session == "00000000000000bb"


def test_the_fallback_hello_carries_the_session_of_the_first_welcome():
    link = Link("w0", "copy")
    first = link.hello(42, "host", "cuda", "")
    again = link.fallback_hello(first, welcome(session="00000000000000cc"), "cpu", "no GPU")
    assert again == Hello("", "w0", 42, "host", "copy", "cpu", "no GPU", "00000000000000cc")
    assert link.state is LinkState.NEW and link.session == "", "nothing adopted yet"


def test_welcome_offers_a_newer_version_the_header_already_names():
    assert Link("w", "copy").welcome(welcome(), 0.0, latest=(5, 0)) == Offer(BUS, 5, 0)
    assert Link("w", "copy").welcome(welcome(), 0.0, latest=(3, 0)) == Offer(BUS, 3, 1)
    assert Link("w", "copy").welcome(welcome(), 0.0, latest=(2, 0)) == Offer(BUS, 3, 1)


def test_welcome_ignores_a_header_latest_outside_the_slots():
    link = Link("w0", "copy")
    assert link.welcome(welcome(slots=2), 0.0, latest=(9, 2)) == Offer(BUS, 3, 1)
    assert link.counters == {"rejected": 1, "foreign": 0, "gaps": 0}


def test_a_rejoin_adopts_the_new_welcome_and_clears_stopped():
    link = active()
    assert link.on_event(Stop(BUS, 11, "", "closing"), 1.0) == Lost("publisher sent STOP (closing)")
    assert link.stopped
    offer = link.welcome(welcome(bus=OTHER, seq=0, version=0, slot=0), 4.0, latest=None)
    assert offer == Offer(OTHER, 0, 0)
    assert link.state is LinkState.ACTIVE and not link.stopped
    assert (link.bus_id, link.last_seq, link.last_heard) == (OTHER, 0, 4.0)


def test_a_rejoins_first_beat_is_at_most_one_new_heartbeat_away():
    link = active()
    at = lost_by_silence(link)
    assert link.tick(at, 3) == (Handshake(),) and link.next_tick == at + HB
    link.welcome(welcome(heartbeat=0.125), at + 0.125, latest=None)
    assert link.next_tick == at + 0.25, "the new publisher's interval"
    link = active()
    at = lost_by_silence(link)
    assert link.tick(at, 3) == (Handshake(),)
    link.welcome(welcome(heartbeat=4.0), at + 0.125, latest=None)
    assert link.next_tick == at + HB, "never later than the beat already due"


# --- events: each once, in order ----------------------------------------------------------


def test_events_up_to_the_welcomes_seq_are_dropped():
    link = active()
    assert link.on_event(Receive(BUS, 9, 2, 0), 1.0) is None
    assert link.on_event(Receive(BUS, 10, 3, 1), 1.0) is None, "the WELCOME covered it"
    assert link.on_event(Stop(BUS, 10, "", "old"), 1.0) is None
    assert link.state is LinkState.ACTIVE and not link.stopped
    assert link.on_event(Receive(BUS, 11, 4, 0), 1.0) == Offer(BUS, 4, 0)
    assert link.on_event(Receive(BUS, 11, 4, 0), 1.0) is None, "never twice"
    assert link.last_seq == 11
    assert link.counters == {"rejected": 0, "foreign": 0, "gaps": 0}


def test_a_seq_gap_is_counted_and_the_event_still_applied():
    link = active()
    assert link.on_event(Receive(BUS, 13, 6, 0), 1.0) == Offer(BUS, 6, 0)
    assert link.last_seq == 13
    assert link.counters == {"rejected": 0, "foreign": 0, "gaps": 1}
    assert link.on_event(Receive(BUS, 12, 5, 1), 1.0) is None, "older than what was applied"
    assert link.on_event(Receive(BUS, 14, 7, 1), 1.0) == Offer(BUS, 7, 1)
    assert link.counters["gaps"] == 1


def test_a_newer_seq_in_a_publisher_heartbeat_is_repaired_from_the_header():
    link = active()
    assert link.on_event(Heartbeat(BUS, 10, "", "", 3), 1.0) is None, "nothing missed"
    assert link.on_event(Heartbeat(BUS, 12, "", "", 5), 1.0) == Repair()
    assert link.last_seq == 12
    assert link.counters == {"rejected": 0, "foreign": 0, "gaps": 1}
    assert link.repair((5, 0)) == Offer(BUS, 5, 0)
    assert link.repair(None) is None, "the header knows no version"
    assert link.repair((5, 2)) is None, "a slot outside the bus"
    assert link.counters == {"rejected": 1, "foreign": 0, "gaps": 1}
    assert link.on_event(Receive(BUS, 12, 5, 0), 1.0) is None, "the repair covered it"
    assert link.on_event(Receive(BUS, 13, 6, 1), 1.0) == Offer(BUS, 6, 1)


def test_a_receive_for_a_slot_outside_the_bus_is_rejected():
    link = active(slots=2)
    assert link.on_event(Receive(BUS, 11, 4, 2), 1.0) == Rejected("RECEIVE v4 for slot 2 of 2")
    assert link.on_event(Receive(BUS, 12, 4, 63), 1.5) == Rejected("RECEIVE v4 for slot 63 of 2")
    assert link.counters == {"rejected": 2, "foreign": 0, "gaps": 0}
    assert link.last_seq == 10, "a dropped event does not count as seen"
    assert link.last_heard == 1.5, "it is still proof that the publisher is alive"
    assert link.on_event(Receive(BUS, 11, 4, 1), 2.0) == Offer(BUS, 4, 1)


def test_an_invalid_frame_is_counted_as_rejected():
    link = active()
    link.on_invalid()
    assert link.counters == {"rejected": 1, "foreign": 0, "gaps": 0}
    assert link.last_heard == 0.0, "not proof of life"


def test_messages_of_another_bus_are_counted_and_ignored():
    link = active()
    assert link.on_event(Receive(OTHER, 11, 4, 0), 1.0) is None
    assert link.on_event(Stop(OTHER, 12, "", "closing"), 1.0) is None
    assert link.on_event(Heartbeat(OTHER, 0, "w9", SESSION, 1), 1.0) is None, "a worker's"
    assert link.on_event(Ack(OTHER, "w9", SESSION, 1), 1.0) is None
    assert link.counters == {"rejected": 0, "foreign": 4, "gaps": 0}
    assert link.state is LinkState.ACTIVE and not link.stopped
    assert (link.last_seq, link.last_heard) == (10, 0.0), "no seq taken, no proof of life"


def test_a_publisher_heartbeat_of_another_bus_means_a_new_publisher():
    link = active()
    assert link.on_event(Heartbeat(OTHER, 0, "", "", 0), 1.0) == Lost(
        "a new publisher answers at the address"
    )
    assert link.state is LinkState.LOST and not link.stopped
    assert link.on_event(Heartbeat(OTHER, 0, "", "", 0), 1.5) is None, "lost once"
    assert link.counters == {"rejected": 0, "foreign": 2, "gaps": 0}


def test_other_messages_of_our_bus_are_proof_of_life_and_nothing_else():
    link = active()
    assert link.on_event(Heartbeat(BUS, 0, "w9", SESSION, 1), 2.0) is None
    assert link.on_event(Ack(BUS, "w9", SESSION, 1), 2.5) is None
    assert (link.last_seq, link.last_heard, link.state) == (10, 2.5, LinkState.ACTIVE)
    assert link.counters == {"rejected": 0, "foreign": 0, "gaps": 0}


# --- STOP -----------------------------------------------------------------------------------


def test_stop_for_the_bus_loses_the_link_and_reports_stopped():
    link = active()
    assert link.on_event(Stop(BUS, 11, "", "closing"), 1.0) == Lost("publisher sent STOP (closing)")
    assert link.state is LinkState.LOST and link.stopped and not link.connected
    assert link.last_seq == 11


def test_stop_for_the_bus_while_lost_reports_stopped():
    link = active()
    lost_by_silence(link)
    assert not link.stopped
    assert link.on_event(Stop(BUS, 11, "", "closing"), 4.0) == Stopped(
        "publisher sent STOP (closing)"
    )
    assert link.state is LinkState.LOST and link.stopped


def test_stop_for_our_session_is_an_eviction():
    link = active()
    assert link.on_event(Stop(BUS, 11, SESSION, "too slow"), 1.0) == Lost("evicted (too slow)")
    assert link.state is LinkState.LOST and not link.stopped
    assert link.last_seq == 11


def test_stop_for_another_session_is_someone_elses_eviction():
    link = active()
    assert link.on_event(Stop(BUS, 11, "00000000000000dd", "too slow"), 1.0) is None
    assert link.state is LinkState.ACTIVE and not link.stopped
    assert link.last_seq == 11, "but it is an event: the seq moves on"
    assert link.on_event(Receive(BUS, 12, 4, 0), 1.0) == Offer(BUS, 4, 0)


# --- the clock ------------------------------------------------------------------------------


def test_heartbeats_go_out_once_per_interval_while_active():
    link = active()
    assert link.tick(0.0, 3) == (beat(3),)
    assert link.next_tick == HB
    assert link.tick(0.25, 3) == (), "not due yet"
    assert link.tick(0.5, 4) == (beat(4),), "it says which version it computes with"
    assert link.tick(0.75, 4) == ()
    assert link.tick(1.0, 4) == (beat(4),)
    assert link.next_tick == 1.5


def test_no_heartbeats_before_a_welcome_while_lost_or_after_close():
    link = Link("w0", "copy")
    assert link.tick(0.0, -1) == () and link.tick(100.0, -1) == ()
    link = active()
    at = lost_by_silence(link)
    assert link.tick(at + HB, 3) == (Handshake(),), "no heartbeat, a handshake"
    link.close()
    assert link.tick(at + 10, 3) == ()


def test_silence_loses_the_link_only_after_lost_after_beats_heartbeats():
    limit = HB * LOST_AFTER_BEATS
    link = active()
    assert link.tick(limit, 3) == (beat(),), "silent for exactly the limit: still active"
    assert link.state is LinkState.ACTIVE
    link = active()
    assert link.tick(limit + 1 / 128, 3) == (beat(), Lost("publisher silent"))
    assert link.state is LinkState.LOST and not link.connected and not link.stopped


def test_any_message_of_our_bus_resets_the_silence():
    limit = HB * LOST_AFTER_BEATS
    link = active()
    link.on_event(Heartbeat(BUS, 10, "", "", 3), 2.0)
    assert link.tick(2.0 + limit, 3) == (beat(),)
    link.on_event(Receive(BUS, 11, 4, 2), 4.0)  # rejected, still a sign of life
    assert link.tick(4.0 + limit, 3) == (beat(),)
    assert link.tick(4.0 + limit + HB, 3) == (beat(), Lost("publisher silent"))


def test_lost_tries_a_handshake_at_once_then_once_per_heartbeat():
    link = active()
    at = lost_by_silence(link)
    assert link.tick(at + 0.25, 3) == (Handshake(),), "at once: a beat may be long"
    assert link.tick(at + 0.5, 3) == ()
    assert link.tick(at + 0.25 + HB, 3) == (Handshake(),)
    assert link.tick(at + 0.25 + HB + 0.25, 3) == ()
    assert link.tick(at + 0.25 + 2 * HB, 3) == (Handshake(),)
    assert link.tick(at + 5 * HB, 3) == (Handshake(),), "late ticks do not pile up"
    assert link.tick(at + 5 * HB + 0.25, 3) == ()
    link.welcome(welcome(), at + 6 * HB, latest=None)
    assert link.tick(at + 6 * HB, 3) == (beat(),), "active again"


def test_a_rejoins_deadline_has_a_floor_and_grows_while_attempts_fail():
    link = active(heartbeat=0.125)  # two beats: 0.25 s, far too short for a busy host
    lost_by_silence(link)
    assert link.rejoin_deadline() == REJOIN_MIN_S == 2.0
    link.rejoin_failed(2.0)
    assert link.rejoin_deadline() == 4.0
    link.rejoin_failed(4.0)
    assert link.rejoin_deadline() == FIRST_WORD_S == 5.0, "what a first word may take"
    link.welcome(welcome(heartbeat=0.125), 100.0, latest=None)
    assert link.rejoin_deadline() == 2.0, "back to the floor once in"
    slow = active(heartbeat=4.0)
    assert slow.rejoin_deadline() == 8.0, "two beats of a long heartbeat"
    slow.rejoin_failed(8.0)
    slow.rejoin_failed(16.0)
    assert slow.rejoin_deadline() == 24.0, "six beats: the publisher's patience"


def test_an_eviction_asks_for_a_handshake_at_once():
    link = active()
    assert link.tick(0.0, 3) == (beat(),) and link.next_tick == HB
    assert link.on_event(Stop(BUS, 11, SESSION, "evicted"), 0.125) == Lost("evicted (evicted)")
    assert link.tick(0.125, 3) == (Handshake(),)


def test_a_rejoin_told_taken_stops_the_link_for_good():
    link = active()
    at = lost_by_silence(link)
    assert link.tick(at + HB, 3) == (Handshake(),)
    assert link.refused("busy: worker id 'w0' is in use by a live worker (pid 9)") is None
    assert link.refused("bus full: 4 workers (max_workers)") is None
    assert link.state is LinkState.LOST and not link.stopped, "tried again next beat"
    assert link.tick(at + 2 * HB, 3) == (Handshake(),)
    reason = "taken: worker id 'w0' belongs to another process now (pid 9)"
    assert link.refused(reason) == Stopped(reason)
    assert link.state is LinkState.REFUSED and not link.connected
    assert (link.stopped, link.refusal, link.session) == (True, reason, "")
    assert link.tick(at + 3 * HB, 3) == () and link.tick(at + 30 * HB, 3) == ()
    assert link.close() is None, "no session to say BYE with"


def test_a_refusal_is_final_only_for_a_rejoin():
    link = Link("w0", "copy")  # start(): the refusal is raised to the user instead
    assert link.refused("taken: worker id 'w0' belongs to another process now") is None
    assert link.state is LinkState.NEW
    link = active()
    assert link.refused("taken: ...") is None, "an active link is not re-joining"
    assert link.state is LinkState.ACTIVE


# --- the end --------------------------------------------------------------------------------


def test_close_says_bye_once_with_the_session():
    link = active()
    assert link.close() == Bye(BUS, "w0", SESSION)
    assert link.state is LinkState.CLOSED and not link.connected
    assert link.close() is None


def test_close_without_a_session_says_nothing():
    link = Link("w0", "copy")
    assert link.close() is None
    assert link.state is LinkState.CLOSED


@pytest.mark.parametrize(
    "msg",
    [
        Receive(BUS, 11, 4, 0),
        Receive(BUS, 11, 4, 9),
        Stop(BUS, 11, "", "closing"),
        Stop(BUS, 11, SESSION, "evicted"),
        Heartbeat(BUS, 99, "", "", 3),
        Heartbeat(OTHER, 0, "", "", 0),
        Receive(OTHER, 11, 4, 0),
    ],
)
def test_closed_ignores_everything(msg):
    link = active()
    link.close()
    assert link.on_event(msg, 1.0) is None
    link.on_invalid()
    assert link.tick(100.0, 3) == ()
    assert link.repair((5, 0)) is None
    assert link.welcome(welcome(bus=OTHER), 2.0, latest=None) is None
    assert link.state is LinkState.CLOSED and not link.stopped
    assert (link.bus_id, link.last_seq, link.last_heard) == (BUS, 10, 0.0)
    assert link.counters == {"rejected": 0, "foreign": 0, "gaps": 0}


def test_counters_go_where_the_owner_keeps_them():
    counters = {"applied": 7, "gaps": 2}
    link = Link("w0", "copy", counters)
    assert link.counters is counters
    assert counters == {"applied": 7, "gaps": 2, "rejected": 0, "foreign": 0}
    link.on_event(Receive(OTHER, 1, 0, 0), 0.0)
    assert counters == {"applied": 7, "gaps": 2, "rejected": 0, "foreign": 1}


# --- pairs: the publisher role's real messages, through bytes, to the worker's Link ------


class Pair:
    """A `PublisherRole` and a worker's `Link` joined by message passing, h11-style.

    Every message goes through `encode` and `decode`, as on the wire; there are no
    sockets and no threads, and the clock is passed in: each protocol rule is checked
    between the two real state objects, exactly.
    """

    def __init__(self, slots: int = 2) -> None:
        self.role = PublisherRole(
            name="t",
            bus_id=BUS,
            slots=slots,
            heartbeat=HB,
            slot_bytes=4096,
            manifest=(),
            new_session=lambda: SESSION,
        )
        self.role.registry.record(0, 0)  # the version a Publisher starts with
        cpu = BufferInfo("cpu", "cpu", "zmqsync-t-cpu", 4096 + slots * 4096, 4096)
        self.role.endpoints = Endpoints("ipc:///tmp/t.events", "ipc:///tmp/t.acks", "", (cpu,))
        self.link = Link("w0", "alias", nonce="ab" * 16)

    def join(self, now: float) -> Offer | None:
        """The handshake: HELLO to the role, its WELCOME to the link, and the ACK back."""
        hello = _wire(self.link.hello(1, "host", "cpu", ""))
        welcome, _replaced = self.role.welcome(self.role.admit(hello, now), now)
        offer = self.link.welcome(_wire(welcome), now, latest=None)
        if offer is not None:
            assert self.ack(offer.version, now)
        return offer

    def publish(self, version: int, slot: int) -> Receive:
        """The RECEIVE the publisher sends for `version`, written to `slot`."""
        self.role.registry.record(version, slot)
        return Receive(BUS, self.role.next_seq(), version, slot, b"")

    def deliver(self, event: Message, now: float) -> object:
        return self.link.on_event(_wire(event), now)

    def ack(self, version: int, now: float) -> bool:
        ack = Ack(BUS, self.link.worker_id, self.link.session, version)
        return self.role.on_worker_message(_wire(ack), now)


def _wire(msg: Message) -> Message:
    return decode(encode(msg))


def test_pair_a_handshake_leaves_both_sides_agreeing():
    pair = Pair()
    offer = pair.join(0.0)
    assert offer == Offer(BUS, 0, 0)
    assert pair.link.connected and pair.link.session == SESSION
    assert pair.link.last_seq == pair.role.seq, "events up to the WELCOME's are covered"
    assert pair.role.registry.find("w0", SESSION) is not None


def test_pair_every_receive_in_order_is_offered_and_its_ack_counts():
    pair = Pair()
    pair.join(0.0)
    for version in range(1, 6):
        slot = version % 2
        offer = pair.deliver(pair.publish(version, slot), version * 0.1)
        assert offer == Offer(BUS, version, slot)
        assert pair.ack(version, version * 0.1)
    assert pair.link.last_seq == pair.role.seq == 5
    assert pair.role.counters["acks"] == 6 and pair.link.counters["gaps"] == 0


def test_pair_a_lost_receive_is_repaired_from_the_publishers_heartbeat():
    pair = Pair()
    pair.join(0.0)
    pair.publish(1, 1)  # lost on the way
    assert isinstance(pair.deliver(pair.role.heartbeat_event(), 0.5), Repair)
    assert pair.link.last_seq == pair.role.seq and pair.link.counters["gaps"] == 1
    assert pair.deliver(pair.publish(2, 0), 0.6) == Offer(BUS, 2, 0), "in order again"


def test_pair_an_old_event_delivered_again_is_dropped():
    pair = Pair()
    pair.join(0.0)
    receive = pair.publish(1, 1)
    assert pair.deliver(receive, 0.1) == Offer(BUS, 1, 1)
    assert pair.deliver(receive, 0.2) is None


def test_pair_an_eviction_stops_the_session_and_a_rejoin_gets_a_new_welcome():
    pair = Pair()
    pair.join(0.0)
    pair.role.evict(["w0"], 0.5)
    lost = pair.deliver(pair.role.stop_for(SESSION, "evicted"), 1.0)
    assert isinstance(lost, Lost) and not pair.link.connected
    assert pair.join(2.0) == Offer(BUS, 0, 0), "the re-join's HELLO carries the session"
    assert pair.link.connected and pair.role.registry.find("w0", SESSION) is not None


def test_pair_a_worker_heartbeat_keeps_it_on_the_bus_and_silence_drops_it():
    pair = Pair()
    pair.join(0.0)
    beats = [m for m in pair.link.tick(HB, 0) if isinstance(m, Heartbeat)]
    assert beats and not pair.role.on_worker_message(_wire(beats[0]), HB)
    assert pair.role.drop_silent(HB * LOST_AFTER_BEATS) == []
    assert [m.worker_id for m in pair.role.drop_silent(HB * (2 * LOST_AFTER_BEATS + 1))] == ["w0"]


def test_pair_the_publishers_close_stops_the_worker():
    pair = Pair()
    pair.join(0.0)
    result = pair.deliver(pair.role.close(), 1.0)
    assert isinstance(result, Lost | Stopped) and pair.link.stopped
