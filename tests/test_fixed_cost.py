"""The short ways a version takes from RECEIVE to ACK must change nothing a worker sees.

A worker reads a RECEIVE of its bus without a message object (`read_receive`), the
publisher an ACK (`read_ack`); an alias-mode worker on the CPU switches versions by
moving one storage (`_apply.Switch`, by the native Follower or in Python) instead of
setting every tensor (every way is checked); threads in `wait_for_version` are woken
only for the version they wait for.
Each is checked here against the plain behaviour, with real sockets and shared memory,
or byte for byte.
"""

from __future__ import annotations

import random
import threading

import pytest
import torch

import zmqsync
from tests.helpers import native
from zmqsync import _apply, _read_modes, _subscriber
from zmqsync._errors import ProtocolError
from zmqsync._fast_frames import read_ack, read_receive, template
from zmqsync._layout import flatten
from zmqsync._protocol import Ack, Receive, decode, encode

BUS = "0123456789abcdef"


class Net(torch.nn.Module):
    """Parameters, a shared submodule, and buffers (BatchNorm's running statistics)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(6, 6)
        self.b = self.a
        self.norm = torch.nn.BatchNorm1d(6)
        self.head = torch.nn.Linear(6, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.b(self.a(x))))


def _fill(model: torch.nn.Module, step: int) -> None:
    with torch.no_grad():
        for i, t in enumerate(flatten(model).values()):
            t.copy_(torch.full(t.shape, float(step * 100 + i)) if t.is_floating_point() else step)


def _same(worker: torch.nn.Module, trainer: torch.nn.Module) -> bool:
    mine = flatten(worker)
    return all(torch.equal(mine[key], t) for key, t in flatten(trainer).items())


@pytest.fixture(params=["native", "switch", "per-tensor"])
def alias_way(request, monkeypatch):
    """Alias mode through the storage switch, by the native Follower (where it is built)
    or in Python, or (a torch without its pointer swap) by setting every tensor."""
    if request.param == "native":
        if _read_modes.FOLLOWER is None:
            native.missing()
    else:
        monkeypatch.setattr(_read_modes, "FOLLOWER", None)
        monkeypatch.setattr(_subscriber, "GATE", None)
    if request.param == "per-tensor":
        monkeypatch.setattr(_apply, "_SWAP_DATA_PTR", None)
    else:
        assert _apply._SWAP_DATA_PTR is not None, "the torch of constraints.txt has it"
    return request.param


def test_alias_mode_follows_every_version(name, alias_way):
    trainer, worker = Net(), Net()
    params = dict(worker.named_parameters())
    with (
        zmqsync.Publisher(trainer, name=name, timeout=20) as pub,
        zmqsync.Subscriber(name=name, model=worker, reads=zmqsync.Aliases()) as sub,
    ):
        where = {}
        for step in range(1, 7):  # every slot several times
            _fill(trainer, step)
            pub.publish()
            assert sub.wait_for_version(pub.version, timeout=20)
            assert _same(worker, trainer), step
            where[step] = worker.a.weight.data_ptr()
            assert dict(worker.named_parameters()) == params, "the same Parameter objects"
            assert worker.b is worker.a
            for key, t in sub.tensors.items():
                assert torch.equal(t, flatten(trainer)[key])
        assert where[1] != where[2], "consecutive versions are in different slots"
        assert where[1] == where[3], "and two slots take turns"
        assert sub.counters["applied"] >= 6
        if alias_way == "native":  # all but the first (it binds the model to the switch)
            assert sub.counters["native"] >= 4, sub.counters
        else:
            assert sub.counters["native"] == 0


def test_alias_model_keeps_the_last_version_after_close(name, alias_way):
    trainer, worker = Net(), Net()
    with zmqsync.Publisher(trainer, name=name, timeout=20) as pub:
        with zmqsync.Subscriber(name=name, model=worker, reads=zmqsync.Aliases()) as sub:
            _fill(trainer, 3)
            pub.publish()
            assert sub.wait_for_version(pub.version, timeout=20)
        expected = {k: t.clone() for k, t in flatten(trainer).items()}
    # publisher and subscriber are closed: the model still reads the mapping it aliases
    assert all(torch.equal(flatten(worker)[k], t) for k, t in expected.items())
    worker.eval()
    assert worker(torch.ones(2, 6)).shape == (2, 2)


def test_alias_mode_follows_a_new_publisher_at_the_address(name, alias_way):
    first, second, worker = Net(), Net(), Net()
    _fill(first, 1)
    _fill(second, 2)
    pub = zmqsync.Publisher(first, name=name, timeout=20, heartbeat=0.1).start()
    sub = zmqsync.Subscriber(name=name, model=worker, reads=zmqsync.Aliases()).start()
    try:
        assert _same(worker, first)
        pub.close()
        pub = zmqsync.Publisher(second, name=name, timeout=20, heartbeat=0.1).start()
        assert pub.wait_for_workers(1, timeout=20), "the worker joins the new bus by itself"
        for step in (3, 4, 5):
            _fill(second, step)
            pub.publish()
            assert sub.wait_for_version(pub.version, timeout=20)
            assert sub.bus_id == pub.bus_id
            assert _same(worker, second), step
    finally:
        sub.close()
        pub.close()


def _wait(sub: zmqsync.Subscriber, version: int, timeout: float, got: list[bool]) -> None:
    got.append(sub.wait_for_version(version, timeout))


def test_a_thread_waiting_for_the_next_version_gets_it(name):
    trainer, worker = Net(), Net()
    with (
        zmqsync.Publisher(trainer, name=name, timeout=20) as pub,
        zmqsync.Subscriber(name=name, model=worker, reads=zmqsync.Aliases()) as sub,
    ):
        for _ in range(5):
            want = sub.version + 1
            got: list[bool] = []
            waiter = threading.Thread(target=_wait, args=(sub, want, 20.0, got))
            waiter.start()
            pub.publish()
            waiter.join(30)
            assert got == [True] and sub.version >= want


def test_a_thread_waiting_for_a_far_version_times_out_while_others_arrive(name):
    with (
        zmqsync.Publisher(Net(), name=name, timeout=20) as pub,
        zmqsync.Subscriber(name=name, model=Net(), reads=zmqsync.Aliases()) as sub,
    ):
        got: list[bool] = []
        waiter = threading.Thread(target=_wait, args=(sub, 10**9, 0.5, got))
        waiter.start()
        for _ in range(3):
            pub.publish()
        waiter.join(30)
        assert got == [False]
        assert sub.wait_for_version(pub.version, timeout=0), "later waits still work"


# --- the fast readers, byte for byte ------------------------------------------------


def _receives() -> list[bytes]:
    frame = template(Receive, bus=BUS)
    return [
        frame(seq, version, slot, changed)
        for seq, version, slot, changed in (
            (1, 0, 0, b""),
            (2, 127, 1, b"\x01"),
            (300, 70_000, 63, b"\xff" * 9),
            (2**40, 2**62, 5, b""),
        )
    ]


def _acks() -> list[bytes]:
    frame = template(Ack, bus=BUS, worker_id="w-1", session="00aa11bb22cc33dd")
    return [frame(v) for v in (0, 1, 255, 65_536, 2**40)]


def test_fast_readers_read_what_decode_reads():
    for frame in _receives():
        msg = decode(frame)
        assert read_receive(frame, BUS) == (msg.seq, msg.version, msg.slot, msg.changed)
        assert read_receive(frame, "fedcba9876543210") is None, "another bus: decode's"
        assert read_ack(frame, BUS) is None
    for frame in _acks():
        msg = decode(frame)  # its worker id and session now passed their checks
        assert read_ack(frame, BUS) == (msg.worker_id, msg.session, msg.version)
        assert read_receive(frame, BUS) is None
    assert read_ack(encode(Ack(BUS, "never-seen-before", "00aa11bb22cc33dd", 1)), BUS) is None


def _mutations(frame: bytes, rng: random.Random) -> list[bytes]:
    out = [frame[:cut] for cut in range(len(frame))]
    for _ in range(300):
        data = bytearray(frame)
        for _ in range(rng.randint(1, 3)):
            data[rng.randrange(len(data))] = rng.randrange(256)
        out.append(bytes(data))
    out += [rng.randbytes(rng.randint(0, 120)) for _ in range(200)]
    return out


def test_fast_readers_accept_nothing_decode_refuses():
    """Whatever they return is a message decode returns too, with the same fields."""
    rng = random.Random(7)
    for frame in _acks():
        decode(frame)
    for frame in [*_receives(), *_acks()]:
        for data in _mutations(frame, rng):
            for read, kind in ((read_receive, Receive), (read_ack, Ack)):
                fields = read(data, BUS)
                if fields is None:
                    continue
                try:
                    msg = decode(data)
                except ProtocolError as exc:
                    pytest.fail(f"{read.__name__} accepted {data!r}, decode refused: {exc}")
                assert type(msg) is kind and msg.bus == BUS
                if kind is Receive:
                    assert fields == (msg.seq, msg.version, msg.slot, msg.changed)
                else:
                    assert fields == (msg.worker_id, msg.session, msg.version)
