"""The handshake budget, driven directly: ids and an explicit clock, no I/O.

`HandshakeQueue` hands out handshake tokens at a fixed rate; when they run out, the ids
refused wait in line and are served in the order they first asked. Every test here is
exact: rates and times are binary fractions.
"""

from __future__ import annotations

from zmqsync._handshake_queue import HandshakeQueue


def drained(rate: float = 4.0, **options) -> HandshakeQueue:
    """A queue whose burst (two seconds' worth) was spent at time 0 by other ids."""
    queue = HandshakeQueue(rate, 0.0, **options)
    for i in range(int(2 * rate)):
        assert queue.take(f"early-{i}", 0.0)
    return queue


def test_a_full_bucket_serves_a_burst_of_two_seconds_then_refuses():
    queue = HandshakeQueue(4.0, 0.0)
    assert all(queue.take(f"w{i}", 0.0) for i in range(8))
    assert not queue.take("w8", 0.0)
    assert queue.waiting == 1
    assert queue.take("w8", 0.25), "one token back after 1/rate seconds"
    assert queue.waiting == 0


def test_ids_in_line_are_served_in_the_order_they_first_asked():
    queue = drained()
    for w in ("a", "b", "c"):
        assert not queue.take(w, 0.0)
    # one token at 0.25: it is a's, whoever asks first
    assert not queue.take("c", 0.25) and not queue.take("b", 0.25)
    assert queue.take("a", 0.25)
    # the next one is b's; c asking more often does not jump the line
    assert not queue.take("c", 0.375) and not queue.take("c", 0.5)
    assert queue.take("b", 0.5)
    assert queue.take("c", 0.75)
    assert queue.waiting == 0


def test_a_newcomer_waits_behind_the_line_and_then_takes_what_is_left():
    queue = drained()
    assert not queue.take("a", 0.0)
    assert not queue.take("new", 0.25), "the only token is a's"
    assert queue.waiting == 2
    assert queue.take("a", 0.25)
    assert queue.take("new", 0.5)
    # with more tokens than ids in line, a newcomer goes ahead at once
    assert queue.take("fresh", 2.0)


def test_a_token_goes_to_a_later_id_when_enough_are_left_for_those_ahead():
    queue = drained()
    for w in ("a", "b"):
        assert not queue.take(w, 0.0)
    assert not queue.take("b", 0.25), "one token: a's"
    assert queue.take("b", 0.5), "two tokens: one for a (still in line), one for b"
    assert queue.take("a", 0.5)


def test_a_place_is_dropped_when_its_id_stops_asking():
    queue = drained(rate=0.5, hold_s=1.0)  # one token every 2 s
    assert not queue.take("gone", 0.0)
    assert not queue.take("b", 1.0)
    assert queue.waiting == 2
    assert queue.take("b", 2.0), "'gone' last asked 2 s ago: its place (and token) went"
    assert queue.waiting == 0
    assert not queue.take("gone", 2.0), "it asks again: at the back of the line"
    assert queue.waiting == 1


def test_a_place_is_kept_while_its_id_asks_again():
    queue = drained(rate=0.5, hold_s=1.0)
    assert not queue.take("first", 0.0)
    assert not queue.take("b", 0.5)
    assert not queue.take("first", 0.75) and not queue.take("first", 1.5)
    assert not queue.take("b", 2.0), "the token at 2 s is first's"
    assert queue.take("first", 2.25)


def test_the_line_is_bounded():
    queue = drained(places=2)
    for w in ("a", "b", "c"):
        assert not queue.take(w, 0.0)
    assert queue.waiting == 2, "no place for c: it may ask again"
    assert queue.take("a", 0.25)
    assert not queue.take("c", 0.25)
    assert queue.waiting == 2


def test_tokens_never_exceed_the_burst():
    queue = drained()
    assert all(queue.take(f"late-{i}", 100.0) for i in range(8))
    assert not queue.take("one-more", 100.0)
