"""The relay root's bookkeeping, driven directly: no sockets, no threads, explicit `now`.

`Membership` decides who is on the tree, which generation the relays form, what counts
as a relay having (or its workers having acked) a version, and what a deadline does to
late relays. The root's threads only feed it messages and act on its answers.
"""

from __future__ import annotations

import itertools

import pytest

from zmqsync._config import LOST_AFTER_BEATS
from zmqsync._protocol import WorkerEntry
from zmqsync.relay._membership import Generation, Member, Membership
from zmqsync.relay._messages import (
    Accept,
    Beat,
    Bye,
    Evict,
    Join,
    Refuse,
    RelayInfo,
    Report,
    Status,
)

TREE = "0" * 16
BUS = "b" * 16
OTHER_BUS = "c" * 16
HB = 0.5
SILENT = HB * LOST_AFTER_BEATS  # 3.0 s
FORM_WAIT = 2.0


def tree(**options) -> Membership:
    sessions = (f"{i:016x}" for i in itertools.count(1))
    settings = dict(heartbeat=HB, form_wait=FORM_WAIT, new_session=lambda: next(sessions))
    m = Membership(TREE, **{**settings, **options})
    m.hold(BUS, 0)
    return m


def join(m: Membership, relay_id: str, now: float = 0.0, have=("", -1)) -> Member:
    answer = m.on_message(relay_id.encode(), Join(relay_id, "h", 7, *have), now)
    assert isinstance(answer, Accept), answer
    member = m.members[relay_id]
    assert member.session == answer.session
    return member


def report(m: Membership, r: Member, stage: str, gen: int, version: int = -1, **kw):
    """A REPORT from `r`: "received" and "acked" say its bus holds `version` of BUS."""
    have_bus, have = (BUS, version) if stage in ("received", "acked") else ("", -1)
    missing, reason, now = kw.get("missing", ()), kw.get("reason", ""), kw.get("now", 0.0)
    msg = Report(r.session, stage, gen, version, have_bus, have, tuple(missing), reason)
    return m.on_message(r.identity, msg, now)


def form(m: Membership, *ready: Member, now: float = 0.0) -> Generation:
    """A whole formation: PREPARE, the given relays answer READY, COMMIT, group built."""
    formation = m.prepare()
    assert formation is not None
    for r in ready:
        report(m, r, "ready", formation.number, now=now)
    gen = m.settle(formation, now)
    assert gen is not None
    m.formed(gen)
    return gen


def status(m: Membership, r: Member, now: float, version=-1, acked=-1, gen=-1, workers=()):
    bus = BUS if version >= 0 else ""
    return m.on_message(r.identity, Status(r.session, gen, bus, version, acked, workers), now)


# --- sessions ---------------------------------------------------------------------------


def test_a_join_is_accepted_with_a_session_of_its_own():
    m = tree()
    answer = m.on_message(b"id-a", Join("hostA", "ha", 11, BUS, 4), now=1.0)
    assert answer == Accept(TREE, "0000000000000001", HB)
    a = m.members["hostA"]
    assert (a.identity, a.host, a.pid, a.order, a.last_seen) == (b"id-a", "ha", 11, 1, 1.0)
    assert (a.state, a.wants, a.rank, a.generation) == ("pending", True, -1, -1)
    assert a.has(BUS, 4) and not a.has(BUS, 5) and not a.has(OTHER_BUS, 0)
    assert m.member_of("0000000000000001") is a
    assert m.counters == {"joins": 1}


def test_a_join_with_a_known_id_replaces_the_old_process():
    m = tree()
    old = join(m, "hostA")
    new = join(m, "hostA", now=2.0)
    assert new is not old and m.members == {"hostA": new}
    assert (new.session, new.order) == ("0000000000000002", 2)
    assert m.member_of(old.session) is None
    # the old process's messages change nothing and are told to join again
    answer = status(m, old, now=3.0, version=9)
    assert answer == Evict(TREE, "unknown or ended session: join again")
    assert new.last_seen == 2.0 and new.have_version == -1
    assert m.on_message(old.identity, Bye(old.session), 3.0) is None
    assert m.members == {"hostA": new}
    assert m.counters["stale"] == 1


def test_a_full_tree_refuses_new_relays_but_not_restarts():
    m = tree(max_relays=2)
    join(m, "a")
    join(m, "b")
    assert m.on_message(b"c", Join("c", "h", 1, "", -1), 0.0) == Refuse(TREE, "tree full: 2 relays")
    assert "c" not in m.members
    join(m, "b", now=1.0)  # a restart of a known relay takes its place


def test_unknown_sessions_are_told_to_join_again_and_a_bye_is_harmless():
    m = tree()
    stranger = Status("f" * 16, -1, "", -1, -1, ())
    assert m.on_message(b"x", stranger, 0.0) == Evict(TREE, "unknown or ended session: join again")
    assert m.on_message(b"x", Bye("f" * 16), 0.0) is None
    assert m.counters == {"stale": 1}
    assert m.on_message(b"x", Beat(TREE, 1), 0.0) is None, "a root message from a relay"
    assert m.counters["rejected"] == 1


def test_a_bye_removes_the_relay():
    m = tree()
    a = join(m, "a")
    assert m.on_message(a.identity, Bye(a.session), 1.0) is None
    assert m.members == {} and m.sessions == {}


def test_a_status_refreshes_what_the_relay_holds_its_workers_and_its_route():
    m = tree()
    a = join(m, "a")
    worker = WorkerEntry("w0", 5, "h", "copy", "cpu", 3, 0.25)
    msg = Status(a.session, -1, BUS, 3, 2, (worker,))
    assert m.on_message(b"new-route", msg, now=1.5) is None
    assert (a.last_seen, a.identity, a.workers) == (1.5, b"new-route", (worker,))
    assert a.has(BUS, 3) and a.acked(BUS, 2) and not a.acked(BUS, 3)
    # numbers never go backwards within a bus; a new root bus starts them over
    status(m, a, 2.0, version=1, acked=1)
    assert (a.have_version, a.acked_version) == (3, 2)
    m.on_message(a.identity, Status(a.session, -1, OTHER_BUS, 0, 0, ()), 2.5)
    assert a.has(OTHER_BUS, 0) and not a.has(BUS, 0) and a.acked(OTHER_BUS, 0)


# --- silence ----------------------------------------------------------------------------


def test_silence_for_six_beats_loses_a_relay_and_the_others_get_a_beat():
    m = tree()
    a, b = join(m, "a"), join(m, "b")
    status(m, b, now=2.0)
    assert m.tick(SILENT) == [b"a", b"b"], "exactly six beats of silence: not yet"
    assert m.tick(SILENT + 0.01) == [b"b"]
    assert (a.state, b.state) == ("lost", "pending")
    assert m.counters["lost"] == 1
    assert m.tick(SILENT + 0.02) == [b"b"], "lost once, counted once"
    assert m.counters["lost"] == 1
    assert status(m, a, now=4.0) == Evict(TREE, "unknown or ended session: join again")
    assert m.infos(4.0)[0] == RelayInfo("a", "h", 7, "lost", -1, -1, -1, -1, 4.0, ())
    assert m.reachable() == [b"b"]
    join(m, "a", now=5.0)  # a lost relay joins again as a new member
    assert m.members["a"].state == "pending" and m.reachable() == [b"a", b"b"]


# --- generations --------------------------------------------------------------------------


def test_a_generation_is_formed_from_the_relays_ready_in_time_in_join_order():
    m = tree()
    a, b, c = join(m, "a"), join(m, "b"), join(m, "c")
    formation = m.prepare()
    assert formation is not None and formation.number == 1 and m.gen == 1
    assert formation.candidates == (a, b, c)
    report(m, c, "ready", 1)
    report(m, a, "ready", 0)  # an answer to an older PREPARE
    assert not m.answered(formation)
    report(m, a, "ready", 1)
    assert not m.answered(formation)
    gen = m.settle(formation, now=10.0)
    assert gen is not None and (gen.number, gen.bus) == (1, BUS)
    assert gen.members == {"a": (a.session, 1), "c": (c.session, 2)}
    # the late one is left out and not asked again before FORM_WAIT passed
    assert (b.wants, b.retry_at, b.state) == (False, 10.0 + FORM_WAIT, "pending")
    assert m.identities(gen) == [(b"a", 1), (b"c", 2)]
    assert (a.state, a.rank) == ("pending", -1), "active only once the group exists"
    m.formed(gen)
    assert [(r.state, r.rank, r.generation, r.wants) for r in (a, c)] == [
        ("active", 1, 1, False),
        ("active", 2, 1, False),
    ]
    assert m.counters["generations"] == 1
    assert m.alive(gen) == [a, c]


def test_every_candidate_ready_or_gone_ends_the_wait_for_readys():
    m = tree()
    a, b = join(m, "a"), join(m, "b")
    formation = m.prepare()
    report(m, a, "ready", 1)
    m.tick(SILENT + 1)  # both silent: lost
    assert m.answered(formation)
    assert m.settle(formation, SILENT + 1) is None
    assert b.state == "lost"


def test_no_connected_relay_no_formation():
    m = tree()
    assert m.prepare() is None and m.gen == 0
    join(m, "a")
    m.tick(SILENT + 1)
    assert m.prepare() is None and m.gen == 0


def test_an_active_relay_late_for_the_next_formation_falls_back_to_pending():
    m = tree()
    a, b = join(m, "a"), join(m, "b")
    form(m, a, b)
    gen2 = form(m, a, now=4.0)  # b's data thread is stuck: no READY
    assert (b.state, b.rank, b.wants, b.retry_at) == ("pending", 2, False, 4.0 + FORM_WAIT)
    assert m.infos(4.0)[1].rank == -1, "a rank is shown only while active"
    assert gen2.members == {"a": (a.session, 1)}
    # a late READY, or an idle STATUS once the retry time passed, makes it want in again
    report(m, b, "ready", 2, now=5.0)
    assert b.wants and not m.wanting(5.0) and m.wanting(4.0 + FORM_WAIT)


def test_an_idle_status_wants_in_only_after_the_retry_time():
    m = tree()
    a = join(m, "a")
    formation = m.prepare()
    m.settle(formation, now=1.0)  # no READY: retry at 3.0
    assert not a.wants
    status(m, a, now=2.0)
    assert not a.wants and not m.wanting(2.0)
    status(m, a, now=3.0)
    assert a.wants and m.wanting(3.0)


def test_a_relay_that_rejoined_during_formation_is_not_activated_by_it():
    m = tree()
    a = join(m, "a")
    formation = m.prepare()
    report(m, a, "ready", 1)
    gen = m.settle(formation, 0.0)
    again = join(m, "a", now=0.5)  # restarted while the group was being built
    m.formed(gen)
    assert again.state == "pending" and again.rank == -1
    assert m.alive(gen) == [] and m.needs_reform(gen, 0.5)


def test_what_ends_a_generation():
    m = tree()
    a, b = join(m, "a"), join(m, "b")
    gen = form(m, a, b)
    assert not m.needs_reform(gen, 0.0)
    gen.broken = True
    assert m.needs_reform(gen, 0.0)
    gen = form(m, a, b)
    m.hold(OTHER_BUS, 0)  # the trainer restarted
    assert m.needs_reform(gen, 0.0)
    m.hold(BUS, 0)
    join(m, "c")  # a relay that wants in
    assert m.needs_reform(gen, 0.0)
    gen = form(m, a, b, m.members["c"])
    status(m, b, now=1.0)
    status(m, m.members["c"], now=1.0)
    m.tick(SILENT + 0.5)  # a lost
    assert m.needs_reform(gen, SILENT + 0.5) and m.alive(gen) == [b, m.members["c"]]


# --- versions -----------------------------------------------------------------------------


def test_a_version_has_arrived_once_every_live_target_reported_it():
    m = tree()
    a, b = join(m, "a"), join(m, "b")
    gen = form(m, a, b)
    m.hold(BUS, 1)
    assert m.lagging(gen) == [a, b]
    assert not m.arrived(gen, [a, b]) and not m.failing(gen)
    report(m, a, "received", 1, 1)
    assert m.lagging(gen) == [b] and not m.arrived(gen, [a, b]) and m.arrived(gen, [a])
    report(m, b, "received", 1, 1)
    assert m.arrived(gen, [a, b]) and m.lagging(gen) == []


def test_a_failure_report_or_a_lost_member_stops_the_wait_for_a_transfer():
    m = tree()
    a, b = join(m, "a"), join(m, "b")
    gen = form(m, a, b)
    m.hold(BUS, 1)
    report(m, b, "failed", 0, 1, now=1.0, reason="old")
    assert not m.failing(gen), "a failure of another generation"
    report(m, b, "failed", gen.number, 1, now=1.0, reason="header mismatch")
    assert m.failing(gen)
    assert b.retry_at == 1.0 + HB
    gen = form(m, a, b, now=2.0)
    status(m, a, now=3.0)
    m.tick(2.0 + SILENT + 0.5)  # b lost
    assert m.failing(gen)
    report(m, a, "received", gen.number, 1)
    assert m.arrived(gen, [a, b]), "the lost one is no longer waited for"


@pytest.mark.parametrize("ack", ["tree", "relays"])
def test_a_version_is_complete_when_every_member_has_it_or_acked_it(ack):
    m = tree(ack=ack)
    a, b = join(m, "a"), join(m, "b")
    gen = form(m, a, b)
    m.hold(BUS, 1)
    report(m, a, "received", 1, 1)
    report(m, b, "received", 1, 1)
    assert m.complete(gen) == (ack == "relays")
    report(m, a, "acked", 1, 1, missing=("w3",))
    report(m, b, "acked", 1, 1)
    assert m.complete(gen)
    assert a.missing == ("w3",)
    assert m.done_by(gen) == ("a", "b") and not gen.broken


def test_a_generation_that_lost_a_member_finishes_the_version_then_ends():
    m = tree(ack="relays")
    a, b = join(m, "a"), join(m, "b")
    gen = form(m, a, b)
    m.hold(BUS, 1)
    status(m, a, now=2.0)
    m.tick(SILENT + 1)  # b lost
    report(m, a, "received", 1, 1, now=SILENT + 1)
    assert m.complete(gen) and gen.broken
    assert m.done_by(gen) == ("a",)


def test_what_the_root_does_between_versions():
    m = tree()
    assert not m.needs_distribution(None, 0.0), "nobody on the tree"
    a = join(m, "a")
    assert m.needs_distribution(None, 0.0), "a relay wants in"
    gen = form(m, a)
    assert m.needs_distribution(gen, 0.0), "it does not have version 0 yet"
    report(m, a, "received", 1, 0)
    assert not m.needs_distribution(gen, 0.0)
    m.hold(BUS, 1)
    report(m, a, "failed", 1, 1, now=1.0)
    assert not m.needs_distribution(gen, 1.0), "it failed: not before its retry time"
    assert m.needs_distribution(gen, 1.0 + HB)
    assert m.active_with_version() == 0
    report(m, a, "received", 1, 1, now=2.0)
    assert m.active_with_version() == 1


def test_the_deadline_evicts_the_late_relays_and_ends_the_generation():
    m = tree(ack="tree", on_timeout="evict")
    a, b = join(m, "a"), join(m, "b")
    gen = form(m, a, b)
    m.hold(BUS, 1)
    report(m, a, "acked", 1, 1)
    report(m, b, "received", 1, 1)
    verdict = m.deadline(gen, now=5.0)
    assert (verdict.done, verdict.missing, verdict.evicted) == (("a",), ("b",), (b"b",))
    assert (b.state, b.wants, b.retry_at) == ("evicted", False, 5.0 + SILENT)
    assert gen.broken and m.counters["timeouts"] == 1 and m.counters["evictions"] == 1
    assert status(m, b, 6.0) == Evict(TREE, "unknown or ended session: join again")
    assert m.candidates() == [a]


def test_the_deadline_in_raise_mode_keeps_the_late_relays():
    m = tree(ack="relays", on_timeout="raise")
    a, b = join(m, "a"), join(m, "b")
    gen = form(m, a, b)
    m.hold(BUS, 1)
    report(m, b, "received", 1, 1)
    verdict = m.deadline(gen, now=5.0)
    assert (verdict.done, verdict.missing, verdict.evicted) == (("b",), ("a",), ())
    assert a.state == "active" and not gen.broken
    assert m.counters["timeouts"] == 1 and "evictions" not in m.counters


def test_without_an_intact_generation_the_deadline_judges_every_candidate():
    m = tree(on_timeout="evict")
    a, b = join(m, "a"), join(m, "b")
    gen = form(m, a, b)
    gen.broken = True
    m.hold(BUS, 1)
    report(m, a, "acked", 1, 1)
    verdict = m.deadline(gen, now=1.0)
    assert (verdict.done, verdict.missing) == (("a",), ("b",))
    verdict = m.deadline(None, now=1.0)
    assert (verdict.done, verdict.missing) == (("a",), ())


def test_data_channel_reports_of_ended_sessions_are_counted_stale():
    m = tree()
    a = join(m, "a")
    gen = form(m, a)
    m.hold(BUS, 1)
    good = Report(a.session, "received", gen.number, 1, BUS, 1, (), "")
    assert m.report(good, now=2.0) and a.has(BUS, 1) and a.last_seen == 2.0
    assert not m.report(Report("f" * 16, "received", 1, 2, BUS, 2, (), ""), now=3.0)
    assert m.counters["stale"] == 1 and a.last_seen == 2.0


def test_what_inspect_shows_of_a_relay():
    m = tree()
    a = join(m, "a", now=1.0, have=(BUS, 0))
    form(m, a, now=1.0)
    m.hold(BUS, 3)
    report(m, a, "acked", 1, 2, now=1.5)
    assert m.infos(4.0) == (RelayInfo("a", "h", 7, "active", 1, 1, 2, 2, 2.5, ()),)
    m.hold(OTHER_BUS, 0)  # another root bus: what it holds is not a version of this one
    assert m.infos(4.0)[0].version == -1 and m.infos(4.0)[0].acked == -1
