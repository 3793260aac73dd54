"""The connection rules, driven directly: no sockets, no threads, explicit `now`.

`Admission` decides, at a connection's handshake, whether its peer may connect again
now; `Budget` counts connections against the descriptor budget from monitor events and
names what to refuse so that a reused descriptor number is never taken for it.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from zmqsync._admission import MAX_PEERS, Admission, Budget, Refusal, Verdict, peer_of

# --- peers ------------------------------------------------------------------------------


def test_an_ipc_peer_is_the_process_libzmq_read_from_so_peercred():
    assert peer_of("localhost:1000:1000:4645", ipc=True) == "pid 4645"
    assert peer_of(":1000:1000:17", ipc=True) == "pid 17"
    assert peer_of("localhost:0:0:0", ipc=True) == "pid 0"  # outside our pid namespace


def test_a_tcp_peer_is_its_source_address_and_an_unknown_one_is_one_peer():
    assert peer_of("127.0.0.1", ipc=False) == "127.0.0.1"
    assert peer_of("::1", ipc=False) == "::1"
    assert peer_of("", ipc=False) == "?"
    assert peer_of("", ipc=True) == "?"
    assert peer_of("localhost", ipc=True) == "?"
    assert peer_of("a:b:c:not-a-pid", ipc=True) == "?"


# --- rates per peer ---------------------------------------------------------------------


def admitted(adm: Admission, peer: str, now: float, n: int) -> int:
    return sum(adm.admit(peer, now).allowed for _ in range(n))


def test_a_peer_gets_a_burst_of_two_seconds_then_its_rate():
    adm = Admission(10.0, now=0.0)
    assert admitted(adm, "pid 1", 0.0, 25) == 20
    assert adm.admit("pid 1", 0.0) is Verdict.PEER_RATE
    assert admitted(adm, "pid 1", 0.5, 10) == 5  # half a second: five tokens
    assert adm.refused[Verdict.PEER_RATE] == 5 + 1 + 5


def test_one_peer_over_its_rate_costs_another_peer_nothing():
    adm = Admission(10.0, now=0.0)
    assert admitted(adm, "pid 1", 0.0, 1000) == 20
    assert admitted(adm, "pid 2", 0.0, 3) == 3
    assert adm.admit("pid 2", 0.0) is Verdict.ALLOW


def test_peers_together_are_held_to_the_total_rate():
    adm = Admission(10.0, now=0.0)  # total: 40 a second, a burst of 80
    assert sum(admitted(adm, f"pid {p}", 0.0, 20) for p in range(4)) == 80
    # the total is spent: a peer that has not been quiet gets nothing more from it
    assert admitted(adm, "pid 5", 0.0, 2) == 2  # (quiet until now: the lane below)
    assert adm.admit("pid 5", 0.0) is Verdict.TOTAL_RATE
    later = sum(admitted(adm, f"pid {p}", 0.125, 10) for p in (0, 1, 2, 3, 5))
    assert later == 5  # an eighth of a second of the total
    # pid 5 asked 1 + 9 times past the total; the others were over their own rates
    assert adm.refused[Verdict.TOTAL_RATE] == 1 + 9
    assert adm.refused[Verdict.PEER_RATE] == 4 * 9


def test_a_quiet_peer_gets_in_while_many_peers_storm_together():
    # Eight processes storming at their own rate each spend the total as fast as it
    # refills; a sniffer's first connection (a peer with a full bucket) still gets in,
    # through a lane the storming peers cannot use (their buckets are never full).
    adm = Admission(10.0, now=0.0)
    now, sniffer = 0.0, []
    while now < 10.0:
        for p in range(8):
            admitted(adm, f"pid {p}", now, 50)
        if now >= 5.0 and not sniffer:
            sniffer.append(adm.admit("pid 99", now))
        now += 0.01
    assert sniffer == [Verdict.ALLOW]
    assert adm.refused[Verdict.TOTAL_RATE] > 1000
    # a peer that went quiet for a whole burst's time is welcome again, once in a while
    assert adm.admit("pid 3", now + 2.0) is Verdict.ALLOW


def test_new_peers_each_get_two_connections_from_the_quiet_lane_at_most():
    adm = Admission(10.0, now=0.0)
    admitted(adm, "pid 0", 0.0, 20)
    admitted(adm, "pid 1", 0.0, 20)
    admitted(adm, "pid 2", 0.0, 20)
    admitted(adm, "pid 3", 0.0, 20)  # the total's burst is spent
    assert [admitted(adm, f"pid {p}", 0.0, 20) for p in range(10, 60)] == [2] * 40 + [0] * 10
    assert adm.refused[Verdict.TOTAL_RATE] == 40 * 18 + 10 * 20  # the lane's 80 are spent


def test_a_refused_connection_spends_no_token():
    adm = Admission(10.0, now=0.0)
    assert admitted(adm, "pid 9", 0.0, 2) == 2  # no longer quiet
    for p in range(4):
        admitted(adm, f"pid {p}", 0.0, 20)  # the total's burst is spent
    assert adm.admit("pid 9", 0.0) is Verdict.TOTAL_RATE
    assert admitted(adm, "pid 9", 2.0, 20) == 20  # its own bucket is full again, not less


def test_a_clock_that_goes_back_adds_no_tokens():
    adm = Admission(10.0, now=100.0)
    admitted(adm, "pid 1", 100.0, 20)
    assert admitted(adm, "pid 1", 50.0, 5) == 0
    assert admitted(adm, "pid 1", 100.25, 5) == 2  # a quarter second after the last


# --- members: welcomed workers' peers ---------------------------------------------------


def test_a_member_has_a_rate_of_its_own_apart_from_everyone_elses():
    adm = Admission(10.0, now=0.0, grace=30.0)
    admitted(adm, "pid 7", 0.0, 1000)  # its own bucket spent: by an attacker with its pid?
    for p in range(100):
        admitted(adm, f"pid {p + 100}", 0.0, 20)  # and the total's, and the quiet lane's
    adm.welcome("pid 7", 0.0)
    # a member: four times a peer's rate, two seconds of burst, whatever others spent
    assert admitted(adm, "pid 7", 0.0, 10_000) == 80
    assert adm.admit("pid 7", 0.0) is Verdict.MEMBER_RATE
    assert admitted(adm, "pid 7", 0.5, 100) == 20
    assert adm.refused[Verdict.MEMBER_RATE] == 10_000 - 80 + 1 + 80
    adm.welcome("pid 7", 0.5)  # a renewal keeps its bucket: no fresh burst
    assert adm.admit("pid 7", 0.5) is Verdict.MEMBER_RATE


def test_membership_lasts_its_grace_after_the_last_welcome_or_renewal():
    adm = Admission(1.0, now=0.0, grace=30.0)
    adm.welcome("pid 7", 0.0)
    assert adm.is_member("pid 7", 30.0)
    adm.welcome("pid 7", 25.0)  # renewed while the worker is on the bus
    assert adm.is_member("pid 7", 55.0)
    assert not adm.is_member("pid 7", 55.1)
    assert adm.members == 0  # forgotten once expired


def test_an_unknown_peer_never_becomes_a_member():
    adm = Admission(1.0, now=0.0)
    adm.welcome("?", 0.0)
    assert not adm.is_member("?", 0.0)


def test_peers_and_members_remembered_are_bounded_least_recent_first():
    adm = Admission(1.0, now=0.0, max_peers=3)
    for p in range(5):
        adm.admit(f"pid {p}", 0.0)
        adm.welcome(f"pid {p}", 0.0)
    assert adm.peers == 3 and adm.members == 3
    assert not adm.is_member("pid 1", 0.0) and adm.is_member("pid 2", 0.0)
    adm.admit("pid 2", 0.0)  # seen again: now the most recent
    adm.admit("pid 9", 0.0)
    assert adm.admit("pid 2", 0.0).allowed  # pid 3 was forgotten, not pid 2
    assert MAX_PEERS >= 1024  # every default worker's process fits


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError):
        Admission(0.0, now=0.0)
    with pytest.raises(ValueError):
        Admission(1.0, now=0.0, max_peers=0)


@settings(max_examples=200, deadline=None)
@given(
    steps=st.lists(st.tuples(st.integers(0, 5), st.floats(0.0, 0.5), st.booleans()), max_size=200)
)
def test_no_peer_ever_gets_more_than_its_burst_plus_its_rate(steps):
    """Whatever the order of peers, welcomes and time: a non-member peer's connections
    over any run never exceed its burst plus rate x elapsed."""
    rate = 5.0
    adm = Admission(rate, now=0.0, max_peers=64)
    now, got = 0.0, dict.fromkeys(range(6), 0)
    for peer, dt, member in steps:
        now += dt
        if member and peer == 0:
            adm.welcome("pid 0", now)
        if adm.admit(f"pid {peer}", now).allowed:
            got[peer] += 1
    for peer in range(1, 6):
        assert got[peer] <= 2 * rate + rate * now + 1e-9


# --- the descriptor budget --------------------------------------------------------------


def budget(limit: int = 2, control_limit: int = 2, headroom: int = 1) -> Budget:
    b = Budget(limit, control_limit, headroom)
    b.watch("events")
    b.watch("acks")
    b.watch("control", control=True)
    return b


def test_worker_connections_past_the_limit_are_refused_by_number_and_event():
    b = budget()
    assert b.accepted("events", 10) is None
    assert b.accepted("acks", 11) is None
    refusal = b.accepted("events", 12)
    assert refusal == Refusal("events", 12, b.serial)
    assert (b.count, b.total) == (2, 2)
    assert b.full(0) is False and b.full(1) is True


def test_a_refusal_means_its_connection_only_while_no_event_about_its_number_came():
    b = budget(limit=1)
    b.accepted("events", 10)
    refusal = b.accepted("events", 12)
    assert refusal is not None and b.current(refusal)
    b.disconnected("events", 12)  # it left: libzmq closes 12 next, and may reuse it
    assert not b.current(refusal)
    b.disconnected("events", 10)
    assert b.accepted("events", 12) is None  # a new connection on 12, with room
    assert not b.current(refusal)  # never to be taken for the refused one
    assert b.count == 1


def test_an_event_on_another_socket_does_not_stale_a_refusal():
    b = budget(limit=1)
    b.accepted("events", 10)
    refusal = b.accepted("events", 12)
    assert refusal is not None
    b.accepted("control", 13)
    assert b.current(refusal)


def test_control_past_its_limit_refuses_the_oldest_and_keeps_the_new():
    b = budget(control_limit=2)
    b.accepted("control", 20)
    b.accepted("control", 21)
    serial_20 = b.serial - 1
    refusal = b.accepted("control", 22)
    assert refusal == Refusal("control", 20, serial_20, oldest=True)
    assert b.total == 2 and b.count == 0
    assert b.current(refusal)
    assert not b.keep(refusal)  # the oldest control connection is never kept


def test_a_members_connection_past_the_limit_is_kept_within_the_headroom():
    b = budget(limit=1, headroom=1)
    b.accepted("events", 10)
    first, second = b.accepted("acks", 11), b.accepted("acks", 12)
    assert first is not None and second is not None
    assert b.keep(first)
    assert not b.keep(second)  # the headroom is spent
    assert b.count == 2
    b.disconnected("acks", 11)
    assert b.count == 1


def test_a_refusal_whose_connection_left_is_not_kept():
    b = budget(limit=1, headroom=4)
    b.accepted("events", 10)
    refusal = b.accepted("events", 12)
    assert refusal is not None
    b.disconnected("events", 12)
    assert not b.keep(refusal)
    assert b.count == 1


def test_changed_after_names_any_connection_coming_or_going_on_a_number():
    b = budget()
    mark = b.serial
    assert not b.changed_after("events", 10, mark)
    b.accepted("events", 10)
    assert b.changed_after("events", 10, mark)
    mark = b.serial
    assert not b.changed_after("events", 10, mark)
    b.disconnected("events", 10)
    assert b.changed_after("events", 10, mark)
    assert not b.changed_after("acks", 10, mark)


def test_a_disconnection_never_counted_changes_no_count():
    b = budget(limit=1)
    b.accepted("events", 10)
    b.disconnected("events", 99)
    b.disconnected("acks", 10)
    assert b.count == 1
