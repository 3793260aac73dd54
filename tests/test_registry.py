"""The publisher's bookkeeping, driven directly: no sockets, no threads, explicit `now`.

`Registry` decides who is on the bus, which acks count, and which slot may be
written. The slot rule is the safety property of the whole bus: a slot a live worker
may be reading, or (alias mode) computes with, is never handed out.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from zmqsync._protocol import Hello
from zmqsync._registry import Member, Registry, WorkerInfo

BUS = "0123456789abcdef"


def hello(worker_id: str, mode: str = "copy", pid: int = 100, nonce: str = "") -> Hello:
    return Hello(BUS, worker_id, pid, "host", mode, "cpu", "", "", nonce)


NA, NB = "a" * 32, "b" * 32  # two processes' nonces


def anyone(*worker_ids: str) -> list[tuple[str, str]]:
    """Targets meaning whichever process holds each id."""
    return [(w, "") for w in worker_ids]


def started(slots: int = 2) -> Registry:
    """A registry as Publisher.start() leaves it: version 0 in slot 0."""
    reg = Registry(slots)
    reg.record(0, 0)
    return reg


def publish(reg: Registry) -> int:
    """What Publisher.publish() does with the registry: claim a slot, record the version."""
    slot = reg.free_slot()
    assert slot is not None, f"no free slot; blockers={reg.blockers()}"
    reg.record(reg.latest + 1, slot)
    return slot


# --- membership -------------------------------------------------------------------------


def test_join_registers_a_member_welcomed_at_the_latest_version():
    reg = started()
    publish(reg)
    member = reg.join(hello("w0", mode="alias", pid=42), "s0", now=5.0)
    assert reg.members == {"w0": member}
    assert (member.worker_id, member.session, member.pid, member.host) == ("w0", "s0", 42, "host")
    assert (member.mode, member.transport) == ("alias", "cpu")
    assert member.floor == 1 and member.acked == -1 and member.last_seen == 5.0


def test_ack_counts_only_for_the_current_session_and_published_versions():
    reg = started()
    reg.join(hello("w0"), "s0", now=0.0)
    assert not reg.ack("w0", "other", 0, now=1.0), "a session we never welcomed"
    assert not reg.ack("nobody", "s0", 0, now=1.0), "a worker we do not know"
    assert reg.members["w0"].acked == -1 and reg.members["w0"].last_seen == 0.0
    assert not reg.ack("w0", "s0", 1, now=1.0), "version 1 was never published"
    assert reg.members["w0"].acked == -1
    assert reg.ack("w0", "s0", 0, now=2.0)
    assert reg.members["w0"].acked == 0 and reg.members["w0"].last_seen == 2.0
    publish(reg)
    publish(reg)
    assert reg.ack("w0", "s0", 2, now=3.0)
    assert reg.ack("w0", "s0", 1, now=4.0), "a late ack for an older version is harmless"
    assert reg.members["w0"].acked == 2, "acked never goes backwards"
    assert reg.members["w0"].last_seen == 4.0


def test_seen_refreshes_only_the_current_session():
    reg = started()
    reg.join(hello("w0"), "s0", now=0.0)
    assert not reg.seen("w0", "old", now=9.0)
    assert reg.members["w0"].last_seen == 0.0
    assert reg.seen("w0", "s0", now=3.0)
    assert reg.members["w0"].last_seen == 3.0
    assert not reg.seen("nobody", "s0", now=3.0)


def test_leave_needs_the_right_session():
    reg = started()
    reg.join(hello("w0"), "s0", now=0.0)
    assert reg.leave("w0", "old") is None
    assert "w0" in reg.members
    member = reg.leave("w0", "s0")
    assert member is not None and member.session == "s0"
    assert reg.members == {}
    assert reg.leave("w0", "s0") is None, "leaving twice is harmless"


def test_evict_drops_known_workers_and_ignores_unknown_ones():
    reg = started()
    for w in ("a", "b", "c"):
        reg.join(hello(w), f"s-{w}", now=0.0)
    gone = reg.evict(["a", "zzz", "c", "a"], now=0.0)
    assert [m.worker_id for m in gone] == ["a", "c"]
    assert list(reg.members) == ["b"]
    assert reg.evict([], now=0.0) == []


def test_a_reused_worker_id_replaces_the_old_process():
    reg = started()
    reg.join(hello("w0", pid=1), "old", now=0.0)
    assert reg.ack("w0", "old", 0, now=1.0)
    publish(reg)
    new = reg.join(hello("w0", mode="alias", pid=2), "new", now=2.0)
    assert reg.members == {"w0": new}
    assert (new.pid, new.mode, new.floor, new.acked) == (2, "alias", 1, -1)
    # the old process's late messages must not touch the new entry
    assert not reg.ack("w0", "old", 1, now=3.0)
    assert reg.members["w0"].acked == -1
    assert not reg.seen("w0", "old", now=4.0)
    assert reg.members["w0"].last_seen == 2.0
    assert reg.leave("w0", "old") is None
    assert reg.members["w0"] is new
    assert reg.missing(1, reg.meant(["w0"])) == ["w0"], "the new process still owes its ack"
    assert reg.ack("w0", "new", 1, now=5.0)
    assert reg.missing(1, reg.meant(["w0"])) == []


def test_find_distinguishes_sessions():
    reg = started()
    member = reg.join(hello("w0"), "s0", now=0.0)
    assert reg.find("w0", "s0") is member
    assert reg.find("w0", "s1") is None
    assert reg.find("w1", "s0") is None


# --- liveness ---------------------------------------------------------------------------


def test_silent_lists_workers_not_heard_from_within_the_limit():
    reg = started()
    reg.join(hello("a"), "sa", now=0.0)
    reg.join(hello("b"), "sb", now=0.0)
    reg.join(hello("c"), "sc", now=0.0)
    reg.ack("a", "sa", 0, now=8.0)
    reg.seen("b", "sb", now=6.0)
    assert reg.silent(now=9.0, limit_s=3.0) == ["c"]
    assert reg.silent(now=9.0, limit_s=9.0) == [], "exactly at the limit is not yet silent"
    assert reg.silent(now=10.0, limit_s=3.0) == ["b", "c"]
    assert reg.silent(now=100.0, limit_s=3.0) == ["a", "b", "c"]


def test_missing_lists_targets_on_the_bus_that_owe_an_ack():
    reg = started()
    for w in ("a", "b", "c"):
        reg.join(hello(w), f"s{w}", now=0.0)
    publish(reg)
    reg.ack("b", "sb", 1, now=1.0)
    assert reg.missing(1, anyone("c", "a", "b")) == ["c", "a"], "in the targets' order"
    assert reg.missing(1, anyone("a", "gone")) == ["a"], "a target that left owes nothing"
    assert reg.missing(0, anyone("a", "b", "c")) == ["a", "c"]
    reg.leave("a", "sa")
    assert reg.missing(1, anyone("a", "b", "c")) == ["c"]


def test_infos_snapshot_with_wall_clock_last_seen():
    reg = started()
    reg.join(hello("w0", pid=7), "s0", now=10.0)
    reg.ack("w0", "s0", 0, now=12.0)
    infos = reg.infos(wall_offset=1000.0)
    assert infos == {"w0": WorkerInfo("w0", 7, "host", 0, "copy", "cpu", 1012.0, lag=0)}
    with pytest.raises(AttributeError):
        infos["w0"].version = 3  # type: ignore[misc]


# --- versions and slots -----------------------------------------------------------------


def test_record_and_slot_of():
    reg = Registry(3)
    assert reg.latest == -1 and reg.slot_versions == [-1, -1, -1]
    reg.record(0, 0)
    reg.record(1, 2)
    assert reg.latest == 1 and reg.slot_versions == [0, -1, 1]
    assert reg.slot_of(1) == 2 and reg.slot_of(0) == 0
    with pytest.raises(ValueError):
        reg.slot_of(5)


def test_free_slot_prefers_empty_then_oldest():
    reg = started(slots=3)
    assert reg.free_slot() == 1, "an empty slot first"
    assert publish(reg) == 1
    assert publish(reg) == 2
    assert reg.slot_versions == [0, 1, 2]
    assert reg.free_slot() == 0, "then the oldest version"
    assert publish(reg) == 0
    assert reg.free_slot() == 1


def publish_from_home(reg: Registry) -> int:
    """Publisher.publish with the flat layout's home slot: the home is announced as the
    version, and the slot claimed becomes the home."""
    slot, announced = reg.free_slot(), reg.home
    assert slot is not None and announced is not None, f"blockers={reg.blockers()}"
    reg.record(reg.latest + 1, announced)
    reg.reserve(slot)
    return announced


def test_the_home_slot_is_never_handed_out_and_holds_no_version():
    reg = started(slots=3)
    reg.reserve(1)
    reg.join(hello("a", mode="alias"), "sa", now=0.0)
    reg.ack("a", "sa", 0, now=0.0)
    assert reg.free_slot() == 2, "not the home, though it is empty too"
    assert publish_from_home(reg) == 1 and reg.home == 2
    assert reg.slot_versions == [0, 1, -1]
    assert reg.free_slot() is None, "a computes with 0, 1 is the latest, 2 is the home"
    assert reg.blockers() == ["a"]
    reg.ack("a", "sa", 1, now=0.0)
    assert reg.free_slot() == 0
    assert publish_from_home(reg) == 2 and reg.home == 0
    assert reg.slot_versions == [-1, 1, 2]
    reg.reserve(None)
    assert reg.free_slot() == 0, "no home: an empty slot like any other"


def test_copy_worker_that_acked_the_latest_blocks_nothing():
    reg = started()
    reg.join(hello("c"), "sc", now=0.0)
    reg.ack("c", "sc", 0, now=0.0)
    assert publish(reg) == 1
    reg.ack("c", "sc", 1, now=0.0)
    assert reg.holders(0) == [] and reg.holders(1) == []
    assert reg.free_slot() == 0
    assert reg.blockers() == []


def test_worker_that_has_not_acked_the_latest_blocks_the_latest_slot():
    reg = started()
    reg.join(hello("c"), "sc", now=0.0)
    assert reg.holders(0) == ["c"], "welcomed at 0 and still reading it"
    reg.ack("c", "sc", 0, now=0.0)
    assert publish(reg) == 1  # version 1 in slot 1
    assert reg.holders(1) == ["c"] and reg.holders(0) == []
    assert reg.free_slot() == 0, "version 2 may go where version 0 was"
    assert publish(reg) == 0  # version 2 in slot 0; c has acked neither 1 nor 2
    assert reg.holders(0) == ["c"] and reg.holders(1) == ["c"]
    assert reg.free_slot() is None
    assert reg.blockers() == ["c"]
    reg.ack("c", "sc", 2, now=0.0)
    assert reg.free_slot() == 1


def test_alias_worker_holding_a_version_blocks_its_slot():
    reg = started()
    reg.join(hello("a", mode="alias"), "sa", now=0.0)
    reg.join(hello("c"), "sc", now=0.0)
    reg.ack("a", "sa", 0, now=0.0)
    reg.ack("c", "sc", 0, now=0.0)
    assert reg.holders(0) == ["a"], "alias: it computes with version 0's bytes"
    assert publish(reg) == 1
    reg.ack("c", "sc", 1, now=0.0)
    assert reg.holders(0) == ["a"] and reg.holders(1) == ["a"]
    assert reg.free_slot() is None, "a holds 0 and has not yet moved to 1"
    assert reg.blockers() == ["a"]
    reg.ack("a", "sa", 1, now=0.0)
    assert reg.holders(0) == [] and reg.holders(1) == ["a"]
    assert reg.free_slot() == 0
    assert publish(reg) == 0


def test_alias_worker_that_left_or_was_evicted_releases_its_slot():
    reg = started()
    reg.join(hello("a", mode="alias"), "sa", now=0.0)
    reg.ack("a", "sa", 0, now=0.0)
    publish(reg)
    assert reg.free_slot() is None
    reg.evict(["a"], now=0.0)
    assert reg.free_slot() == 0
    assert reg.blockers() == []


def test_single_slot_alias_holders_do_not_block_the_only_slot():
    reg = started(slots=1)
    reg.join(hello("a", mode="alias"), "sa", now=0.0)
    reg.join(hello("b", mode="alias"), "sb", now=0.0)
    assert reg.free_slot() is None, "alias readers still mapping version 0 block it"
    assert reg.blockers() == ["a", "b"]
    reg.ack("a", "sa", 0, now=0.0)
    reg.ack("b", "sb", 0, now=0.0)
    assert reg.holders(0) == []
    assert reg.free_slot() == 0, "slots=1: the seqlock protects alias readers instead"
    assert publish(reg) == 0
    assert reg.free_slot() is None, "readers of version 1 are in flight"
    reg.ack("a", "sa", 1, now=0.0)
    reg.ack("b", "sb", 1, now=0.0)
    assert reg.free_slot() == 0


def test_single_slot_copy_reader_in_flight_blocks_the_only_slot():
    reg = started(slots=1)
    reg.join(hello("a", mode="alias"), "sa", now=0.0)
    reg.ack("a", "sa", 0, now=0.0)
    reg.join(hello("c"), "sc", now=0.0)
    assert reg.free_slot() is None, "c is copying version 0 out of the only slot"
    assert reg.blockers() == ["c"]
    reg.ack("c", "sc", 0, now=0.0)
    assert reg.free_slot() == 0
    assert publish(reg) == 0
    reg.ack("a", "sa", 1, now=0.0)
    assert reg.free_slot() is None and reg.blockers() == ["c"]
    reg.leave("c", "sc")
    assert reg.free_slot() == 0


def test_late_joiner_never_blocks_versions_older_than_its_welcome():
    reg = started(slots=3)
    publish(reg)
    publish(reg)  # versions 0, 1, 2 in slots 0, 1, 2
    reg.join(hello("late"), "sl", now=0.0)  # welcomed at 2
    assert reg.holders(0) == [] and reg.holders(1) == [] and reg.holders(2) == ["late"]
    assert reg.free_slot() == 0
    reg.ack("late", "sl", 1, now=0.0)  # an ack below its floor changes nothing
    assert reg.holders(2) == ["late"]


def test_blockers_are_sorted_and_unique():
    reg = started()
    for w in ("z", "m", "a"):
        reg.join(hello(w, mode="alias"), f"s{w}", now=0.0)
        reg.ack(w, f"s{w}", 0, now=0.0)
    publish(reg)
    assert reg.free_slot() is None
    assert reg.blockers() == ["a", "m", "z"]


# --- identity: one live session per worker id -------------------------------------------


def proving(worker_id: str, session: str, mode: str = "copy") -> Hello:
    return Hello(BUS, worker_id, 100, "host", mode, "cpu", "", session)


def test_claim_refuses_a_live_workers_id_without_its_session():
    reg = started()
    reg.join(hello("w0"), "s0", now=0.0)
    assert reg.claim(hello("w1"), now=1.0, silent_after=3.0) is None  # a free id
    refusal = reg.claim(hello("w0"), now=1.0, silent_after=3.0)
    assert refusal is not None and "'w0' is in use by a live worker (pid 100)" in refusal
    assert reg.claim(proving("w0", "guess"), now=1.0, silent_after=3.0) == refusal
    assert reg.claim(proving("w0", "s0"), now=1.0, silent_after=3.0) is None  # same process
    assert reg.claim(hello("w0"), now=3.0, silent_after=3.0) == refusal  # not silent yet
    assert reg.claim(hello("w0"), now=3.1, silent_after=3.0) is None  # gone silent


def test_claim_counts_any_message_as_proof_of_life():
    reg = started()
    reg.join(hello("w0"), "s0", now=0.0)
    assert reg.seen("w0", "s0", now=2.9)
    assert reg.claim(hello("w0"), now=5.0, silent_after=3.0) is not None
    assert reg.ack("w0", "s0", 0, now=5.5)
    assert reg.claim(hello("w0"), now=8.4, silent_after=3.0) is not None


def test_a_proven_rejoin_displaces_the_old_session_which_keeps_its_slot_until_it_lets_go():
    reg = started()
    reg.join(hello("w0", mode="alias"), "s0", now=0.0)
    assert reg.ack("w0", "s0", 0, now=0.5)  # computes with v0 in slot 0
    assert publish(reg) == 1  # v1 in slot 1
    reg.join(proving("w0", "s0", mode="alias"), "s1", now=1.0)  # re-joined, floor v1
    assert set(reg.members) == {"w0"} and reg.members["w0"].session == "s1"
    assert list(reg.displaced) == ["s0"]
    assert reg.holders(0) == ["w0"], "the displaced session still computes with slot 0"
    assert reg.free_slot() is None
    assert not reg.ack("w0", "s0", 1, now=1.5), "the displaced session is no member"
    assert reg.leave("w0", "s0") is None and list(reg.displaced) == ["s0"]
    assert reg.ack("w0", "s1", 1, now=2.0)  # the process computes with v1: it let go
    assert reg.displaced == {}
    assert reg.free_slot() == 0


def test_a_displaced_session_that_goes_silent_stops_holding_its_slot():
    reg = started()
    reg.join(hello("w0", mode="alias"), "s0", now=0.0)
    assert reg.ack("w0", "s0", 0, now=0.9)  # its last word
    publish(reg)
    reg.join(proving("w0", "s0", mode="alias"), "s1", now=1.0)
    assert reg.seen("w0", "s1", now=3.5)
    assert reg.silent(now=3.9, limit_s=3.0) == [] and list(reg.displaced) == ["s0"]
    assert reg.silent(now=4.0, limit_s=3.0) == [] and reg.displaced == {}
    assert reg.holders(0) == []


def test_taking_the_id_of_a_silent_session_displaces_nothing():
    reg = started()
    reg.join(hello("w0", mode="alias"), "s0", now=0.0)
    assert reg.ack("w0", "s0", 0, now=0.0)
    assert reg.claim(hello("w0", mode="alias", pid=7), now=10.0, silent_after=3.0) is None
    reg.join(hello("w0", mode="alias", pid=7), "s1", now=10.0)
    assert reg.displaced == {} and reg.members["w0"].pid == 7


def test_a_process_proves_itself_by_its_nonce_without_the_session():
    # its first HELLO was registered, but the WELCOME never reached it (its REQ gave up):
    # the retry carries no session, only the nonce, and must not be refused by its own past
    reg = started()
    reg.join(hello("w0", nonce=NA), "s0", now=0.0)
    assert reg.members["w0"].process == NA
    assert reg.claim(hello("w0", nonce=NA), now=0.5, silent_after=3.0) is None
    refusal = reg.claim(hello("w0", nonce=NB), now=0.5, silent_after=3.0)
    assert refusal is not None and refusal.startswith("busy: worker id 'w0' is in use")
    reg.join(hello("w0", mode="alias", nonce=NA), "s1", now=0.5)
    assert list(reg.displaced) == ["s0"], "the same process: its old session is displaced"
    assert reg.members["w0"].session == "s1" and reg.members["w0"].process == NA


def test_a_former_holder_finds_its_id_taken_and_anyone_else_busy():
    reg = started()
    reg.join(hello("w0", pid=1, nonce=NA), "sa", now=0.0)
    assert [m.worker_id for m in reg.evict(reg.silent(now=4.0, limit_s=3.0), now=4.0)] == ["w0"]
    reg.join(hello("w0", pid=2, nonce=NB), "sb", now=4.0)
    back = reg.claim(hello("w0", pid=1, nonce=NA), now=5.0, silent_after=3.0)
    assert back is not None and back.startswith(
        "taken: worker id 'w0' belongs to another process now (pid 2)"
    )
    other = reg.claim(hello("w0", pid=3, nonce="c" * 32), now=5.0, silent_after=3.0)
    assert other is not None and other.startswith("busy:"), "a stranger may be a restart"
    assert reg.claim(hello("w0", pid=3), now=5.0, silent_after=3.0) == other
    # the holder goes silent: the id is free for anyone again, its former holder too
    assert reg.claim(hello("w0", pid=1, nonce=NA), now=7.5, silent_after=3.0) is None


def test_a_holder_that_took_a_silent_id_directly_makes_the_former_one_taken():
    reg = started()
    reg.join(hello("w0", pid=1, nonce=NA), "sa", now=0.0)
    assert reg.claim(hello("w0", pid=2, nonce=NB), now=3.5, silent_after=3.0) is None
    reg.join(hello("w0", pid=2, nonce=NB), "sb", now=3.5)
    assert reg.displaced == {}, "another process: nothing of the old one is protected"
    back = reg.claim(hello("w0", pid=1, nonce=NA), now=4.0, silent_after=3.0)
    assert back is not None and back.startswith("taken:")


def test_acks_count_for_the_process_a_publish_meant():
    reg = started()
    reg.join(hello("w0", nonce=NA), "sa", now=0.0)
    publish(reg)
    meant = reg.meant(["w0", "nobody"])
    assert meant == (("w0", NA), ("nobody", ""))
    assert reg.missing(1, meant) == ["w0"]
    reg.evict(["w0"], now=0.0)  # dropped as silent
    assert reg.missing(1, meant) == [], "gone: no longer owed"
    reg.join(hello("w0", nonce=NB), "sb", now=5.0)
    assert reg.ack("w0", "sb", 1, now=5.5)
    assert reg.acked(1, meant) == [] and reg.missing(1, meant) == [], "another process's ack"
    assert reg.acked(1, reg.meant(["w0"])) == ["w0"], "a publish made for the holder now"
    assert reg.acked(1, anyone("w0")) == ["w0"]


def test_a_re_join_of_the_same_process_is_still_the_one_meant():
    reg = started()
    reg.join(hello("w0", nonce=NA), "s0", now=0.0)
    publish(reg)
    meant = reg.meant(["w0"])
    assert reg.ack("w0", "s0", 1, now=0.5)
    reg.join(hello("w0", nonce=NA), "s1", now=1.0)  # lost its link, re-joined
    assert reg.acked(1, meant) == [] and reg.missing(1, meant) == ["w0"]
    assert reg.ack("w0", "s1", 1, now=1.5)
    assert reg.acked(1, meant) == ["w0"] and reg.missing(1, meant) == []
    reg.leave("w0", "s1")
    assert reg.acked(1, meant) == ["w0"], "it acked before it left"


def test_departed_processes_are_bounded_per_worker_id():
    reg = started()
    for i in range(20):
        reg.join(hello("w0", nonce=f"{i:032x}"), f"{i:016x}", now=float(i))
        reg.leave("w0", f"{i:016x}")
    assert list(reg.departed) == ["w0"]
    assert list(reg.departed["w0"]) == [f"{i:032x}" for i in range(12, 20)], "the newest 8"


# --- the slot rule, written out once for speed, against its plain form ------------------

_MEMBER = st.tuples(
    st.sampled_from(["copy", "alias"]),
    st.integers(-1, 6),  # floor
    st.integers(-1, 6),  # acked
)


@settings(max_examples=400, deadline=None)
@given(
    slot_versions=st.lists(st.integers(-1, 6), min_size=1, max_size=4),
    latest=st.integers(-1, 6),
    members=st.lists(_MEMBER, max_size=5),
    displaced=st.lists(_MEMBER, max_size=2),
    home=st.one_of(st.none(), st.integers(0, 3)),
)
def test_free_slot_is_the_oldest_slot_without_holders(
    slot_versions, latest, members, displaced, home
):
    reg = Registry(len(slot_versions))
    reg.slot_versions, reg.latest = list(slot_versions), latest
    reg.home = home if home is None or home < len(slot_versions) else None
    for i, (mode, floor, acked) in enumerate(members + displaced):
        member = Member(f"w{i}", f"s{i}", 100, "host", mode, "cpu", floor, acked)
        if i < len(members):
            reg.members[member.worker_id] = member
        else:
            reg.displaced[member.session] = member
    order = sorted(range(len(slot_versions)), key=lambda s: slot_versions[s])
    expected = next((s for s in order if s != reg.home and not reg.holders(s)), None)
    assert reg.free_slot() == expected


# --- fencing: an id kept for its process, first words, peers, what a deadline drops ------


def reserving(alive=lambda peer: True, **kw) -> Registry:
    reg = Registry(2, first_word_s=5.0, reserve_s=5.0, alive=alive, **kw)
    reg.record(0, 0)
    return reg


def test_a_dropped_workers_id_is_kept_for_its_process_and_busy_for_anyone_else():
    reg = reserving()
    reg.join(hello("w0", pid=1, nonce=NA), "sa", now=0.0, peer="pid 1")
    assert reg.ack("w0", "sa", 0, now=0.5)  # it spoke: an established worker
    assert [m.worker_id for m in reg.evict(["w0"], now=1.6)] == ["w0"]  # a deadline missed
    stranger = reg.claim(hello("w0", pid=2, nonce=NB), now=1.7, silent_after=3.0)
    assert stranger is not None and stranger.startswith(
        "busy: worker id 'w0' is kept for the process that held it (pid 1) for 4.9 s more"
    )
    assert reg.claim(hello("w0", pid=2), now=6.5, silent_after=3.0) == stranger.replace(
        "4.9", "0.1"
    ), "a HELLO without a nonce proves nothing either"
    assert reg.claim(hello("w0", pid=1, nonce=NA), now=6.5, silent_after=3.0) is None
    reg.join(hello("w0", pid=1, nonce=NA), "sa2", now=6.5, peer="pid 1")
    assert reg.reserved == {}, "back: nothing kept any more"
    # its reserve over, a stranger may have it
    reg.evict(["w0"], now=10.0)
    assert reg.claim(hello("w0", pid=2, nonce=NB), now=15.0, silent_after=3.0) is None
    assert reg.reserved == {}


def test_a_silent_worker_not_swept_yet_is_kept_for_its_reserve_too():
    reg = reserving()
    reg.join(hello("w0", nonce=NA), "sa", now=0.0)
    assert reg.seen("w0", "sa", now=1.0)
    assert reg.claim(hello("w0", nonce=NB), now=8.9, silent_after=3.0) is not None
    assert reg.claim(hello("w0", nonce=NB), now=9.1, silent_after=3.0) is None


def test_a_worker_that_left_or_never_spoke_keeps_nothing():
    reg = reserving()
    reg.join(hello("a", nonce=NA), "sa", now=0.0)
    assert reg.ack("a", "sa", 0, now=0.5)
    assert reg.leave("a", "sa") is not None  # BYE: free at once
    assert reg.claim(hello("a", nonce=NB), now=0.6, silent_after=3.0) is None
    reg.join(hello("b", nonce=NA), "sb", now=0.0)  # welcomed, then never a word
    reg.evict(["b"], now=1.0)
    assert reg.claim(hello("b", nonce=NB), now=1.1, silent_after=3.0) is None
    assert reg.reserved == {}


def test_a_replacement_of_a_process_that_never_spoke_waits_the_first_word_time_only():
    # heartbeat 2 s: silence is 12 s, but the first word is due within 5 s
    reg = reserving()
    reg.join(hello("w0", nonce=NA), "sa", now=0.0)
    assert reg.claim(hello("w0", nonce=NB), now=5.0, silent_after=12.0) is not None
    assert reg.claim(hello("w0", nonce=NB), now=5.1, silent_after=12.0) is None
    assert reg.silent(now=5.1, limit_s=12.0) == [], "the sweep still gives it the beats"


def test_a_process_known_to_be_gone_leaves_its_id_free_at_once():
    dead = {"pid 1"}
    reg = reserving(alive=lambda peer: peer not in dead)
    reg.join(hello("w0", pid=1, nonce=NA), "sa", now=0.0, peer="pid 1")
    assert reg.ack("w0", "sa", 0, now=0.5)
    assert reg.claim(hello("w0", nonce=NB), now=0.6, silent_after=3.0) is None
    reg.join(hello("w1", pid=2, nonce=NB), "sb", now=0.0, peer="pid 2")
    assert reg.ack("w1", "sb", 0, now=0.5)
    dead.add("pid 2")
    reg.evict(["w1"], now=1.0)
    assert reg.reserved == {}


def test_one_peer_holds_at_most_its_share_of_members():
    reg = reserving(max_per_peer=2)
    reg.join(hello("a"), "sa", now=0.0, peer="pid 1")
    assert reg.room_for("pid 1")
    reg.join(hello("b"), "sb", now=0.0, peer="pid 1")
    assert not reg.room_for("pid 1") and reg.room_for("pid 2")
    reg.leave("a", "sa")
    assert reg.room_for("pid 1") and reg.per_peer == {"pid 1": 1}
    reg.join(proving("b", "sb"), "sb2", now=0.1, peer="pid 1")  # a re-join counts once
    assert reg.per_peer == {"pid 1": 1}
    reg.evict(["b"], now=1.0)
    assert reg.per_peer == {}


def test_a_deadline_blames_only_the_holders_of_the_slot_it_can_have():
    # an alias worker that acked the latest pins its slot; a member that never acks holds
    # both: only it stands between the next version and a slot
    reg = started()
    reg.join(hello("honest", mode="alias"), "sh", now=0.0)
    reg.join(hello("mute"), "sm", now=0.0)  # welcomed at v0, never acks
    assert reg.ack("honest", "sh", 0, now=0.1)
    publish(reg)  # v1 in slot 1
    assert reg.ack("honest", "sh", 1, now=0.2)
    assert reg.free_slot() is None
    assert reg.blockers() == ["mute"]
    # nobody pins: the slot the fewest hold, then the oldest
    reg2 = started(3)
    reg2.join(hello("a"), "sa", now=0.0)
    reg2.join(hello("b"), "sb", now=0.0)
    publish(reg2)
    publish(reg2)
    assert reg2.ack("a", "sa", 1, now=0.1)  # a still reads v2; b reads v0..v2
    assert reg2.blockers() == ["b"]
