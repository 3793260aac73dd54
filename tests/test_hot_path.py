"""What the hot path caches and shares must never change what a worker computes with.

The publisher keeps where a module's tensors live (`ModuleReader`) and groups its copies;
the subscriber keeps per-slot copy plans and alias setters; the publishing thread sends
RECEIVE and reads acks itself while the agent drains the rest. Each shortcut is checked
here against the plain behaviour, with real sockets and shared memory.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

import zmqsync
from zmqsync import _copy
from zmqsync._layout import ModuleReader, flatten


@pytest.fixture(params=["native", "shared", "python"])
def copy_loop(request, monkeypatch):
    """The byte copies through the native loop (on one thread, or every one shared among
    three), or (not built) from Python."""
    if request.param == "python":
        monkeypatch.setattr(_copy, "NATIVE_COPY", None)
    else:
        assert _copy.NATIVE_COPY is not None
    if request.param == "shared":
        monkeypatch.setattr(_copy, "SHARED_COPY_MIN", 1)
        monkeypatch.setattr(_copy, "COPY_THREADS", 3)
    return request.param


class Tricky(torch.nn.Module):
    """A shared submodule, a tied weight, a None bias, a non-persistent buffer."""

    def __init__(self) -> None:
        super().__init__()
        shared = torch.nn.Linear(3, 3)
        self.a = shared
        self.b = shared
        self.c = torch.nn.Linear(3, 3, bias=False)
        self.c.weight = self.a.weight
        self.d = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.ReLU(), torch.nn.Linear(2, 1))
        self.norm = torch.nn.BatchNorm1d(3)
        self.register_buffer("scratch", torch.zeros(4), persistent=False)


def _named(module: torch.nn.Module) -> dict[tuple[str, ...], torch.Tensor]:
    items = [*module.named_parameters(), *module.named_buffers()]
    return {tuple(name.split(".")): t for name, t in items}


def test_reader_matches_named_parameters_then_buffers():
    model = Tricky()
    read = ModuleReader(model).read()
    expected = _named(model)
    assert list(read) == list(expected), "same keys, same order, same de-duplication"
    assert all(read[k] is expected[k] for k in expected)
    assert list(flatten(model)) == list(expected)


def test_reader_sees_a_new_parameter_and_a_replaced_submodule():
    model = Tricky()
    reader = ModuleReader(model)
    reader.read()
    model.d[0].weight = torch.nn.Parameter(torch.ones(2, 3))
    assert reader.read()[("d", "0", "weight")] is model.d[0].weight
    model.d[2] = torch.nn.Linear(2, 1)
    assert reader.read()[("d", "2", "bias")] is model.d[2].bias


def test_reader_sees_a_change_made_behind_torchs_back(monkeypatch):
    model = Tricky()
    reader = ModuleReader(model)
    reader.read()
    replacement = torch.nn.Linear(3, 2)
    model.d._modules["0"] = replacement  # no registration hook fires
    monkeypatch.setattr(ModuleReader, "REWALK_S", 0.0)
    assert reader.read()[("d", "0", "weight")] is replacement.weight


def test_reader_notices_a_deleted_or_emptied_entry():
    model = Tricky()
    reader = ModuleReader(model)
    reader.read()
    model.d[0].bias = None
    assert ("d", "0", "bias") not in reader.read()
    del model.norm.running_mean
    assert ("norm", "running_mean") not in reader.read()


def test_publish_reads_a_replaced_submodule(name):
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    worker_model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    with (
        zmqsync.Publisher(model, name=name, timeout=20) as pub,
        zmqsync.Subscriber(name=name, model=worker_model) as sub,
    ):
        pub.publish()
        model[1] = torch.nn.Linear(4, 2)  # a new module, new tensors
        with torch.no_grad():
            model[1].weight.fill_(7.0)
        pub.publish()
        assert sub.wait_for_version(pub.version, timeout=20)
        assert torch.equal(worker_model[1].weight, torch.full((2, 4), 7.0))


def test_publish_of_a_removed_tensor_is_a_layout_mismatch(name):
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    with zmqsync.Publisher(model, name=name, timeout=20) as pub:
        model[1].bias = None
        with pytest.raises(zmqsync.LayoutMismatch, match="missing key"):
            pub.publish()


class Wide(torch.nn.Module):
    """A tensor large enough for the memmove path, a mid-sized one (memmove, not a byte
    view), a non-contiguous one, small ones; with `many`, more tensors than the
    publisher copies as bytes (`MEMMOVE_ALL_MAX`)."""

    def __init__(self, many: bool = False) -> None:
        super().__init__()
        self.big = torch.nn.Parameter(torch.zeros(600, 512))  # 1.2 MB
        self.mid = torch.nn.Parameter(torch.zeros(200, 128))  # 100 KB
        self.bent = torch.nn.Parameter(torch.zeros(8, 6).t())  # not contiguous
        self.small = torch.nn.Linear(5, 5)
        self.register_buffer("steps", torch.zeros((), dtype=torch.int64))
        if many:
            self.many = torch.nn.ParameterList(torch.zeros(3) for _ in range(70))


@pytest.mark.parametrize("many", [False, True], ids=["few", "many"])
@pytest.mark.parametrize("mode", ["copy", "alias"])
def test_every_copy_path_delivers_exact_values(name, mode, many, copy_loop):
    trainer, worker = Wide(many), Wide(many)
    assert not worker.bent.is_contiguous()
    with (
        zmqsync.Publisher(trainer, name=name, timeout=20) as pub,
        zmqsync.Subscriber(
            name=name,
            model=worker,
            reads=(zmqsync.Aliases() if mode == "alias" else zmqsync.Copies()),
        ) as sub,
    ):
        for step in range(1, 5):  # both slots, each plan used twice
            with torch.no_grad():
                for i, t in enumerate(flatten(trainer).values()):
                    t.copy_(torch.randn(t.shape).mul(step + i) if t.is_floating_point() else step)
            pub.publish()
            assert sub.wait_for_version(pub.version, timeout=20)
            for key, expected in flatten(trainer).items():
                assert torch.equal(flatten(worker)[key], expected), (step, key)


def test_copy_mode_follows_a_storage_that_was_freed_and_reallocated(name, copy_loop):
    """FSDP frees a parameter by resizing its storage to 0 and re-allocates it later: the
    memmove the copy plan keeps must go to the new memory, never the freed one."""
    trainer, worker = torch.nn.Linear(64, 64), torch.nn.Linear(64, 64)
    with (
        zmqsync.Publisher(trainer, name=name, timeout=20) as pub,
        zmqsync.Subscriber(name=name, model=worker) as sub,
    ):
        for step in range(1, 5):
            storage = worker.weight.untyped_storage()
            nbytes = storage.nbytes()
            keep = torch.empty(1 << 16)  # the allocator hands the freed block to someone else
            storage.resize_(0)
            filler = torch.full((nbytes // 4,), -1.0)
            storage.resize_(nbytes)
            with torch.no_grad():
                trainer.weight.fill_(step)
            pub.publish()
            assert sub.wait_for_version(pub.version, timeout=20)
            assert torch.equal(worker.weight, trainer.weight), step
            assert torch.equal(filler, torch.full_like(filler, -1.0)), "freed memory written"
            del keep


@pytest.mark.parametrize("replace", ["data", "parameter", "in place"])
def test_publish_reads_a_source_that_moved_since_the_last_one(name, replace, copy_loop):
    """The publisher copies a few small tensors as bytes and keeps a view of where each
    source was: a source re-allocated (``.data =``, a new Parameter) must be read where
    it is now, and one written in place read again."""
    trainer, worker = torch.nn.Linear(16, 16), torch.nn.Linear(16, 16)
    trainer.register_buffer("mid", torch.full((200, 128), 3.0))  # 100 KB: by memmove
    worker.register_buffer("mid", torch.zeros(200, 128))
    with (
        zmqsync.Publisher(trainer, name=name, timeout=20) as pub,
        zmqsync.Subscriber(name=name, model=worker) as sub,
    ):
        kept = []  # old sources stay allocated: their addresses are not handed out again
        for step in range(1, 5):
            old = trainer.weight.data_ptr()
            kept.append(trainer.weight.data)
            fresh = torch.full((16, 16), float(step))
            if replace == "data":
                trainer.weight.data = fresh
            elif replace == "parameter":
                trainer.weight = torch.nn.Parameter(fresh)
            else:
                with torch.no_grad():
                    trainer.weight.copy_(fresh)
            assert (trainer.weight.data_ptr() == old) == (replace == "in place")
            pub.publish()
            assert sub.wait_for_version(pub.version, timeout=20)
            assert torch.equal(worker.weight, fresh), step
            assert torch.equal(worker.mid, trainer.mid), step


class TwoBig(torch.nn.Module):
    """Two tensors of 1.2 MB (the publisher's "big" ones); `bent`: the second is a
    transposed view (not contiguous: no byte copy may read it)."""

    def __init__(self, bent: bool = False) -> None:
        super().__init__()
        self.a = torch.nn.Parameter(torch.zeros(600, 512))
        self.b = torch.nn.Parameter(torch.zeros(512, 600).t() if bent else torch.zeros(600, 512))


@pytest.mark.parametrize("source", ["in place", "replaced", "bent"])
def test_big_tensors_arrive_whichever_way_they_are_copied(name, source, copy_loop):
    """The publisher writes its big tensors with torch (a bent one too); a source
    re-allocated between publishes is read where it is now, and the worker's copy of
    them is shared among threads with copy_loop "shared"."""
    trainer, worker = TwoBig(bent=source == "bent"), TwoBig()
    with (
        zmqsync.Publisher(trainer, name=name, timeout=20) as pub,
        zmqsync.Subscriber(name=name, model=worker) as sub,
    ):
        kept = []  # old sources stay allocated: their addresses are not handed out again
        for step in range(1, 5):
            fresh = torch.randn(600, 512)
            if source == "replaced":
                kept.append(trainer.a.data)
                trainer.a.data = fresh
            else:
                with torch.no_grad():
                    trainer.a.copy_(fresh)
            with torch.no_grad():
                trainer.b.copy_(fresh * -step)
            pub.publish()
            assert sub.wait_for_version(pub.version, timeout=20)
            assert torch.equal(worker.a, fresh), step
            assert torch.equal(worker.b, fresh * -step), step


def test_the_all_acked_check_agrees_with_missing_whatever_the_order(name):
    """The publishing thread's O(1)-per-ack check must say done exactly when
    `Registry.missing` is empty: acks in any order, a target that leaves, one that leaves
    and re-joins (the same process: un-acked again) before the end, one whose id another
    process takes (gone: it owes nothing, and the newcomer's ack does not count)."""
    import random

    from zmqsync._protocol import Hello

    def hello(w, process):
        return Hello(pub.bus_id, w, 1, "h", "copy", "cpu", "", "", f"{process:032x}")

    with zmqsync.Publisher({"w": torch.zeros(4)}, name=name, heartbeat=30) as pub:
        reg, rng = pub._role.registry, random.Random(7)
        for trial in range(50):
            with pub._shared.cond:
                for w in list(reg.members):
                    reg.leave(w, reg.members[w].session)
                ids = [f"w{i}" for i in range(rng.randint(1, 12))]
                for i, w in enumerate(ids):
                    reg.join(hello(w, i), w, 0.0)
                version = reg.latest + 1
                reg.record(version, 0)
                targets = reg.meant(ids)
                ready = pub._role.all_acked(version, targets)
                events = [("ack", w) for w in ids]
                events += [("leave", w) for w in rng.sample(ids, rng.randint(0, len(ids)))]
                if trial % 3 == 0:
                    events.append(("rejoin", rng.choice(ids)))
                if trial % 4 == 0:
                    events.append(("taken", rng.choice(ids)))
                rng.shuffle(events)
                for kind, w in events:
                    assert ready() == (not reg.missing(version, targets)), (trial, kind, w)
                    member = reg.members.get(w)
                    if kind == "ack" and member is not None:
                        reg.ack(w, member.session, version, 0.0)
                    elif kind == "leave" and member is not None:
                        reg.leave(w, member.session)
                    elif kind in ("rejoin", "taken"):
                        if member is not None:
                            reg.leave(w, member.session)
                        process = ids.index(w) + (1000 if kind == "taken" else 0)
                        reg.join(hello(w, process), w + kind[0], 0.0)
                assert ready() == (not reg.missing(version, targets)), trial
                for w in list(reg.members):  # whoever is left acks: then done
                    reg.ack(w, reg.members[w].session, version, 0.0)
                assert ready()


@pytest.mark.parametrize("mode", ["copy", "alias"])
def test_conjugate_views_arrive_as_their_values(name, mode, copy_loop):
    """memmove copies bytes; a conj() view's bytes are not its values (torch applies the
    bit lazily), so such tensors must go through torch, on the publisher's side and into a
    worker's own conj() tensor."""
    base = torch.randn(8, dtype=torch.complex64)
    weights = {"z": base.conj(), "r": torch.randn(8)}
    worker = {"z": torch.zeros(8, dtype=torch.complex64).conj(), "r": torch.zeros(8)}
    if mode == "alias":
        worker = None
    with (
        zmqsync.Publisher(weights, name=name, timeout=20) as pub,
        zmqsync.Subscriber(
            name=name,
            model=worker,
            reads=(zmqsync.Aliases() if mode == "alias" else zmqsync.Copies()),
        ) as sub,
    ):
        for step in range(1, 4):
            base.mul_(step)
            pub.publish()
            assert sub.wait_for_version(pub.version, timeout=20)
            got = sub.weights
            assert torch.equal(got["z"], base.conj()), step
            if worker is not None:
                assert torch.equal(worker["z"], base.conj()), step


def test_many_threads_publish_and_wait_at_once(name):
    model = torch.nn.Linear(8, 8)
    errors: list[BaseException] = []
    with (
        zmqsync.Publisher(model, name=name, timeout=20, slots=3) as pub,
        zmqsync.Subscriber(name=name, model=torch.nn.Linear(8, 8), reads=zmqsync.Aliases()) as sub1,
        zmqsync.Subscriber(name=name, model=torch.nn.Linear(8, 8)) as sub2,
    ):

        def publisher_thread() -> None:
            try:
                for _ in range(25):
                    handle = pub.publish(max_lag=None)
                    assert handle.wait(timeout=20).missing == ()
            except BaseException as exc:  # reported below
                errors.append(exc)

        threads = [threading.Thread(target=publisher_thread) for _ in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        assert not errors, errors
        assert pub.version == 100
        assert sub1.wait_for_version(100, timeout=20) and sub2.wait_for_version(100, timeout=20)


def test_acks_nobody_waits_for_are_still_collected(name):
    with (
        zmqsync.Publisher(torch.nn.Linear(4, 4), name=name, timeout=20) as pub,
        zmqsync.Subscriber(name=name, model=torch.nn.Linear(4, 4)) as sub,
    ):
        handle = pub.publish(max_lag=None)
        assert sub.wait_for_version(handle.version, timeout=20)
        deadline = time.monotonic() + 10
        while not handle.done() and time.monotonic() < deadline:
            time.sleep(0.005)  # the agent drains the acks socket by itself
        assert handle.done()
        assert pub.workers[sub.worker_id].version == handle.version


def test_subscriber_close_does_not_wait_for_a_long_heartbeat(name):
    with zmqsync.Publisher(torch.nn.Linear(4, 4), name=name, heartbeat=60) as pub:
        sub = zmqsync.Subscriber(name=name, model=torch.nn.Linear(4, 4)).start()
        started = time.monotonic()
        sub.close()
        assert time.monotonic() - started < 3, "close() wakes the agent's blocking recv"
        deadline = time.monotonic() + 10
        while pub.workers and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not pub.workers, "the BYE was sent"
