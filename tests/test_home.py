"""The flat layout's home slot (`_home`): a version is announced where the trainer wrote
it, and the trainer's tensors move on to the next free slot while the workers read.

The rules it must keep, each tested with real publishers, workers, sockets and shared
memory: the home slot is never announced while it is the home and never handed out;
every worker gets the trainer's bytes exactly; the trainer's tensors leave the segment
before it goes (close, or a tensor that left the layout); the slot count a user asks
for keeps its meaning (one slot more is made, `max_lag` is unchanged).
"""

from __future__ import annotations

import pytest
import torch

import zmqsync
from tests.test_flat import Many, _step
from zmqsync._checksum import digest
from zmqsync._home import SWAP_DATA_PTR, HomeBlock
from zmqsync._layout import flatten

pytestmark = pytest.mark.skipif(SWAP_DATA_PTR is None, reason="torch has no _swap_data_ptr_")


def _home(pub: zmqsync.Publisher) -> HomeBlock:
    block = pub._mode._block
    assert isinstance(block, HomeBlock)
    return block


def _segment(pub: zmqsync.Publisher) -> tuple[int, int]:
    """(first byte, end) of the publisher's slots in the mapping."""
    slots = pub._mode.bound.slots
    start = slots.flat(0).data_ptr()
    return start, slots.flat(slots.count - 1).data_ptr() + slots.flat(0).numel()


def _slot_of(pub: zmqsync.Publisher, tensor: torch.Tensor) -> int | None:
    slots = pub._mode.bound.slots
    for slot in range(slots.count):
        start = slots.flat(slot).data_ptr()
        if start <= tensor.data_ptr() < start + slots.flat(slot).numel():
            return slot
    return None


def test_a_publish_announces_the_home_and_moves_the_trainer_to_the_claimed_slot(name):
    model = Many(blocks=6)
    params = list(model.parameters())
    optimizer = torch.optim.Adam(model.parameters(), lr=0.05)
    with (
        zmqsync.Publisher(model, name=name, slots=2, writes=zmqsync.Copy(flat=True)) as pub,
        zmqsync.Subscriber(name=name) as sub,
    ):
        slots, registry = pub._mode.bound.slots, pub._role.registry
        assert slots.count == 3 and pub.max_lag_allowed == 1, "one slot more, the same room"
        home = _home(pub)
        assert home.slot == 1 and registry.home == 1
        seen = set()
        for v in range(1, 7):
            _step(model, optimizer, seed=v)
            announced = home.slot
            assert all(_slot_of(pub, t) == announced for t in flatten(model).values())
            assert slots.header.read_begin(announced, v) is None, "the home is being written"
            p = pub.publish()
            assert slots.header.latest() == (v, announced)
            assert home.slot != announced and registry.home == home.slot
            assert slots.header.read_begin(home.slot, v) is None
            assert all(_slot_of(pub, t) == home.slot for t in flatten(model).values())
            assert list(model.parameters()) == params, "the same Parameter objects"
            assert sub.wait_for_version(p.version, timeout=10)
            assert digest(flatten(sub.weights)) == digest(flatten(model)), v
            seen.add(announced)
        assert seen == {0, 1, 2}, "every slot takes its turn as the home"


def test_close_gives_the_trainer_its_tensors_back_outside_the_segment(name, bus_dirs):
    model = Many(blocks=4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    pub = zmqsync.Publisher(model, name=name, writes=zmqsync.Copy(flat=True)).start()
    try:
        for v in range(1, 4):
            _step(model, optimizer, seed=v)
            pub.publish()
        start, end = _segment(pub)
        before = {k: t.clone() for k, t in flatten(model).items()}
    finally:
        pub.close()
    _, shm = bus_dirs
    assert not list(shm.iterdir()), "the segment is gone"
    now = flatten(model)
    assert all(not start <= t.data_ptr() < end for t in now.values())
    assert all(torch.equal(now[k], t) for k, t in before.items())
    _step(model, optimizer, seed=9)  # training goes on in private memory


def test_a_tensor_that_leaves_ends_the_home_and_frees_its_slot(name, caplog):
    model = Many(blocks=4)
    with (
        zmqsync.Publisher(model, name=name, slots=2, writes=zmqsync.Copy(flat=True)) as pub,
        zmqsync.Subscriber(name=name) as sub,
    ):
        start, end = _segment(pub)
        weight = model.blocks[2][0].weight
        weight.data = weight.data.clone() + 1  # the same Parameter, a new storage
        with caplog.at_level("WARNING", logger="zmqsync"):
            p = pub.publish()
        assert "blocks.2.0.weight" in caplog.text and pub._mode._block is None
        assert pub._role.registry.home is None
        assert all(not start <= t.data_ptr() < end for t in flatten(model).values())
        assert sub.wait_for_version(p.version, timeout=10)
        assert digest(flatten(sub.weights)) == digest(flatten(model))
        used = set()
        for _ in range(4):  # the freed home is an ordinary slot again
            with torch.no_grad():
                model.norm.weight.add_(1)
            p = pub.publish()
            used.add(pub._mode.bound.slots.header.latest()[1])
            assert sub.wait_for_version(p.version, timeout=10)
            assert digest(flatten(sub.weights)) == digest(flatten(model))
        assert used == {0, 1, 2}


def test_alias_and_copy_workers_follow_the_home_with_the_fewest_slots(name):
    """slots=2 makes three: an alias worker pins the version it computes with, the home
    is the trainer's, and the third is the one a publish claims."""
    model = Many(blocks=5)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.05)
    with (
        zmqsync.Publisher(model, name=name, slots=2, writes=zmqsync.Copy(flat=True)) as pub,
        zmqsync.Subscriber(name=name, model=Many(blocks=5), reads=zmqsync.Aliases()) as aliaser,
        zmqsync.Subscriber(
            name=name, model=Many(blocks=5), reads=zmqsync.Copies(flat=True)
        ) as copier,
    ):
        for v in range(1, 9):
            _step(model, optimizer, seed=v)
            p = pub.publish(timeout=10)
            assert aliaser.wait_for_version(p.version, timeout=10)
            assert copier.wait_for_version(p.version, timeout=10)
            want = digest(flatten(model))
            assert digest(flatten(aliaser.model)) == want, v
            assert digest(flatten(copier.model)) == want, v


def test_worker_processes_get_every_version_bit_exact(name, spawn):
    model = Many(blocks=40)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.05)
    with zmqsync.Publisher(model, name=name, writes=zmqsync.Copy(flat=True)) as pub:
        workers = [
            spawn("tests/helpers/digest_worker.py", name, mode, module="")
            for mode in ("copy", "alias")
        ]
        for worker in workers:
            worker.wait_for(lambda r: r["event"] == "ready")
        assert pub.wait_for_workers(2, timeout=30)
        for v in range(1, 6):
            _step(model, optimizer, seed=v)
            p = pub.publish(timeout=30)
            want = digest(flatten(model))
            for worker in workers:
                seen = worker.wait_for(lambda r, v=p.version: r.get("version") == v)
                assert seen["digest"] == want, (worker.cmd, v)


def test_the_copy_runs_beside_copy_workers_and_before_the_announcement_without(name, monkeypatch):
    """With alias workers only nothing would run beside the copy into the next home: it
    comes first. A copy-mode worker on the bus reads the announced home meanwhile."""
    model = Many(blocks=3)
    with (
        zmqsync.Publisher(model, name=name, writes=zmqsync.Copy(flat=True)) as pub,
        zmqsync.Subscriber(name=name, model=Many(blocks=3), reads=zmqsync.Aliases()) as aliaser,
    ):
        home, announcer = _home(pub), pub._mode.bound.announcer
        at_send: list[tuple[int, int]] = []  # (announced slot, the home's slot) at RECEIVE
        send = announcer.send

        def recording(version, slot, named):
            at_send.append((slot, home.slot))
            send(version, slot, named)

        monkeypatch.setattr(announcer, "send", recording)
        assert aliaser.wait_for_version(pub.publish().version, timeout=10)
        announced, home_then = at_send[-1]
        assert home_then != announced, "alias workers only: the trainer moved first"
        with zmqsync.Subscriber(name=name) as copier:
            with torch.no_grad():
                model.norm.weight.add_(1)
            p = pub.publish()
            assert copier.wait_for_version(p.version, timeout=10)
            assert digest(flatten(copier.weights)) == digest(flatten(model))
        announced, home_then = at_send[-1]
        assert home_then == announced, "a copy worker reads it while the trainer copies it"
        assert home.slot != announced
        assert digest(flatten(aliaser.model)) == digest(flatten(model))


def test_one_slot_keeps_the_block_private_so_alias_workers_never_stall_a_publish(name):
    """slots=1: the only slot is rewritten under alias readers (they see the seqlock
    move). A home beside it would leave a publish no slot to claim while an alias
    worker holds the other: the block stays in private memory instead."""
    model = Many(blocks=3)
    with (
        zmqsync.Publisher(model, name=name, slots=1, writes=zmqsync.Copy(flat=True)) as pub,
        zmqsync.Subscriber(name=name, model=Many(blocks=3), reads=zmqsync.Aliases()) as aliaser,
    ):
        assert pub._mode.bound.slots.count == 1 and pub._role.registry.home is None
        assert pub._mode._block is not None and not isinstance(pub._mode._block, HomeBlock)
        for v in range(1, 4):
            with torch.no_grad():
                model.norm.weight.add_(1)
            p = pub.publish(timeout=10)
            assert aliaser.wait_for_version(p.version, timeout=10)
            assert digest(flatten(aliaser.model)) == digest(flatten(model)), v
