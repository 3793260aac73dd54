"""The page a sharded trainer's ranks coordinate through (`zmqsync._rank_page`), driven
from one process: each RankPage is its own opening of the file, so its liveness lock is
its own too, as a rank's is."""

from __future__ import annotations

import os

import pytest

from zmqsync._deadline import Deadline
from zmqsync._rank_page import RankPage, RanksFailed, page_name

pytestmark = pytest.mark.timeout(30)


@pytest.fixture
def pages(bus_dirs):
    """host, peer1, peer2 on one page of 3 ranks; closed after the test."""
    _, shm = bus_dirs
    name = page_name("t", "0123456789abcdef")
    host = RankPage.create(str(shm), name, 3, digest=42)
    peers = [RankPage.attach(str(shm), name, i, 3, 42, Deadline(1.0)) for i in (1, 2)]
    yield host, *peers
    for page in peers:
        page.close()
    host.close(unlink=True)


def test_a_publish_goes_from_go_to_written_to_outcome(pages):
    host, p1, p2 = pages
    host.go(1, slot=1, version=5)
    assert p1.wait_go(1, Deadline(1.0)) == (1, 5)
    assert p2.wait_go(1, Deadline(1.0)) == (1, 5)
    p1.written(1)
    p2.written(1)
    host.wait_written(1, 5, Deadline(1.0))
    host.outcome(1)
    p1.wait_outcome(1, Deadline(1.0))
    assert p2.announced() == 1


def test_a_rank_that_did_not_write_is_named_at_the_deadline(pages):
    host, p1, _ = pages
    host.go(1, 0, 1)
    p1.written(1)
    with pytest.raises(RanksFailed, match=r"version 1 was not published: rank\(s\) 2 did not"):
        host.wait_written(1, 1, Deadline(0.05))
    with pytest.raises(RanksFailed, match="publish 1 failed \\(rank 2"):
        p1.wait_outcome(1, Deadline(1.0))


def test_a_dead_rank_is_seen_before_the_deadline(pages):
    host, _, p2 = pages
    host.go(1, 0, 1)
    p2.close()  # its lock goes, as a killed process's does
    deadline = Deadline(10.0)
    with pytest.raises(RanksFailed, match=r"rank 1 \(pid \d+\) died|rank 2 \(pid \d+\) died"):
        host.wait_written(1, 1, deadline)
    assert deadline.remaining() > 5


def test_a_rank_whose_publish_raised_stops_the_host_waiting(pages):
    host, p1, p2 = pages
    host.go(1, 0, 1)
    p1.written(1)
    p2.failed(1)
    with pytest.raises(RanksFailed, match="rank 2's publish\\(\\) raised before writing"):
        host.wait_written(1, 1, Deadline(10.0))


def test_a_peer_hears_when_the_host_failed_before_posting_a_slot(pages):
    host, p1, _ = pages
    host.outcome(1, failed_by=0)
    with pytest.raises(RanksFailed, match="the host's own step"):
        p1.wait_go(1, Deadline(1.0))


def test_a_peer_that_skipped_a_publish_is_told(pages):
    host, p1, _ = pages
    host.go(2, 0, 2)
    with pytest.raises(RanksFailed, match="as often as the others"):
        p1.wait_go(1, Deadline(1.0))


def test_a_closed_host_ends_a_peers_wait(pages):
    host, p1, _ = pages
    host.close(unlink=True)
    with pytest.raises(RanksFailed, match="closed its publisher"):
        p1.wait_go(1, Deadline(5.0))


def test_a_page_of_another_layout_or_none_at_all_is_refused(bus_dirs):
    _, shm = bus_dirs
    name = page_name("t", "fedcba9876543210")
    with pytest.raises(RanksFailed, match="opened no bus within 0.05 s"):
        RankPage.attach(str(shm), name, 1, 2, 7, Deadline(0.05))
    host = RankPage.create(str(shm), name, 2, digest=7)
    try:
        with pytest.raises(RanksFailed, match="not this trainer's page"):
            RankPage.attach(str(shm), name, 1, 2, 8, Deadline(1.0))
    finally:
        host.close(unlink=True)
    assert not os.path.exists(os.path.join(shm, name))
