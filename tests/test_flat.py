"""The flat layout: many tensors as views of one block laid out as a slot (`_flat`).

A copy-mode worker with ``flat=True`` (and one without a model) copies a version as one
block; a trainer's tensors adopted into a block publish as one copy. Bit for bit through
training steps, BatchNorm statistics, partial publishes and tensors that leave the
block, with real publishers, workers, sockets and shared memory.
"""

from __future__ import annotations

import pytest
import torch

import zmqsync
from tests.helpers import native
from tests.helpers.models import Mixed, train_step
from zmqsync._checksum import digest
from zmqsync._flat import FlatBlock
from zmqsync._layout import Layout, flatten


class Many(torch.nn.Module):
    """Hundreds of small tensors (LayerNorms and small Linears), a BatchNorm's buffers."""

    def __init__(self, blocks: int = 60) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8)) for _ in range(blocks)
        )
        self.norm = torch.nn.BatchNorm1d(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.norm(x)


def _step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    model.train()
    optimizer.zero_grad()
    model(torch.randn(16, 8, generator=g)).square().mean().backward()
    optimizer.step()


def _inside(block: FlatBlock, tensor: torch.Tensor) -> bool:
    start = block.block.data_ptr()
    return start <= tensor.data_ptr() < start + block.block.numel()


def _same(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    return digest(flatten(a)) == digest(flatten(b))


def test_a_flat_copy_worker_stays_bit_exact_through_steps_and_partial_publishes(name):
    model = Many()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    worker_model = Many()
    params = list(worker_model.parameters())
    with (
        zmqsync.Publisher(model, name=name) as pub,
        zmqsync.Subscriber(name=name, model=worker_model, reads=zmqsync.Copies(flat=True)) as sub,
    ):
        target = sub._reader.target
        assert target is not None and target.flat is not None
        assert list(worker_model.parameters()) == params, "the same Parameter objects"
        assert all(_inside(target.flat, t) for t in flatten(worker_model).values())
        assert _same(worker_model, model)
        for v in range(1, 6):
            _step(model, optimizer, seed=v)
            assert sub.wait_for_version(pub.publish().version, timeout=10)
            assert _same(worker_model, model), v
        last = model.blocks[3][0].weight
        with torch.no_grad():
            last.add_(1.0)
            model.blocks[4][1].bias.add_(2.0)  # changed, not named: the worker keeps the old
        kept = worker_model.blocks[4][1].bias.clone()
        assert sub.wait_for_version(pub.publish(keys=["blocks.3.0.weight"]).version, timeout=10)
        assert torch.equal(worker_model.blocks[3][0].weight, last.detach())
        assert torch.equal(worker_model.blocks[4][1].bias, kept)
        assert sub.wait_for_version(pub.publish().version, timeout=10)
        assert _same(worker_model, model)
        if native.REQUIRED:  # copy mode's versions are the native follower's too
            assert sub.counters["native"] > 0


def test_a_copy_worker_without_a_model_gets_one_block(name):
    model = Mixed()
    with (
        zmqsync.Publisher(model, name=name) as pub,
        zmqsync.Subscriber(name=name) as sub,
    ):
        target = sub._reader.target
        assert target is not None and target.flat is not None
        for v in range(1, 4):
            train_step(model, seed=v)
            pub.publish()
            assert sub.wait_for_version(v, timeout=10)
            assert digest(flatten(sub.weights)) == digest(flatten(model))


def test_a_model_the_block_cannot_take_keeps_its_tensors(name):
    """A non-contiguous parameter: the model is copied tensor by tensor, as without flat."""
    model = Many(blocks=3)
    worker_model = Many(blocks=3)
    weight = worker_model.blocks[0][0].weight
    weight.data = weight.data.t().contiguous().t()  # the same values, transposed strides
    with (
        zmqsync.Publisher(model, name=name) as pub,
        zmqsync.Subscriber(name=name, model=worker_model, reads=zmqsync.Copies(flat=True)) as sub,
    ):
        assert sub._reader.target is not None and sub._reader.target.flat is None
        with torch.no_grad():
            model.blocks[0][0].weight.mul_(3)
        pub.publish()
        assert sub.wait_for_version(1, timeout=10)
        assert _same(worker_model, model)


def test_a_block_whose_storage_moved_is_left_for_tensor_by_tensor_copies(name):
    """A storage resized through one of the model's tensors (as FSDP does) moves the whole
    block: the worker notices before copying and copies tensor by tensor from then on."""
    model = Many(blocks=3)
    worker_model = Many(blocks=3)
    with (
        zmqsync.Publisher(model, name=name) as pub,
        zmqsync.Subscriber(name=name, model=worker_model, reads=zmqsync.Copies(flat=True)) as sub,
    ):
        target = sub._reader.target
        assert target is not None and target.flat is not None
        storage = worker_model.norm.weight.untyped_storage()
        storage.resize_(storage.nbytes() + 4096)  # a reallocation: every view moves with it
        with torch.no_grad():
            model.norm.weight.add_(1)
        pub.publish()
        assert sub.wait_for_version(1, timeout=10)
        assert target.flat is None
        assert _same(worker_model, model)


def test_a_block_adopts_tensors_and_finds_those_that_left():
    model = Many(blocks=4)
    flat = flatten(model, detach=False)
    layout = Layout.of(flat)
    before = {k: t.detach().clone() for k, t in flat.items()}
    assert FlatBlock.refusal(flat, layout) is None
    block = FlatBlock(layout)
    params = list(model.parameters())
    block.adopt(flat)
    assert list(model.parameters()) == params
    assert all(torch.equal(t, before[k]) for k, t in flatten(model).items())
    assert block.holds(flatten(model, detach=False)) and not block.moved(flat)
    model.blocks[1][0].weight.data = model.blocks[1][0].weight.data.clone()
    now = flatten(model, detach=False)
    assert not block.holds(now)
    assert block.moved(now) == [("blocks", "1", "0", "weight")]
    half = {k: t.half() for k, t in flat.items()}
    assert "float32" in (FlatBlock.refusal(half, layout) or "")


def test_a_block_is_written_into_a_slot_as_one_copy_under_the_seqlock(bus_dirs):
    """`Slots.write_block`: the slot holds the block's bytes, gaps included, and the
    header names the version; the per-tensor write of the same tensors agrees."""
    from zmqsync._buffers import CpuSegment
    from zmqsync._slots import Slots

    model = Many(blocks=5)
    flat = flatten(model, detach=False)
    layout = Layout.of(flat)
    block = FlatBlock(layout)
    block.adopt(flat)
    _, shm = bus_dirs
    segment = CpuSegment(str(shm), "flat-slots", slots=2, slot_bytes=layout.slot_bytes)
    try:
        slots = Slots(layout, segment)
        for version, slot in ((1, 0), (2, 1), (3, 0)):
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(version)
            slots.write_block(slot, version, block)
            assert torch.equal(slots.flat(slot), block.block)
            assert slots.header.latest() == (version, slot)
            slots.write(1 - slot, version, flatten(model, detach=False), mirror=False)
            views = slots.views(1 - slot)
            assert all(torch.equal(views[k], t) for k, t in flatten(model).items())
    finally:
        segment.close()


def _flat_publisher(model, name):
    return zmqsync.Publisher(model, name=name, writes=zmqsync.Copy(flat=True))


def _writes_blocks(pub) -> bool:
    mode = pub._mode
    return mode._block is not None


def test_a_flat_publisher_stays_bit_exact_through_steps_buffers_and_partial_publishes(name):
    """Adam steps and BatchNorm's running statistics land in the block; a full publish
    is one block copy; a partial one keeps the other tensors' last published values."""
    model = Many()
    params = list(model.parameters())
    optimizer = torch.optim.Adam(model.parameters(), lr=0.05)
    with (
        _flat_publisher(model, name) as pub,
        zmqsync.Subscriber(name=name) as copier,
        zmqsync.Subscriber(name=name, model=Many(), reads=zmqsync.Aliases()) as aliaser,
    ):
        assert _writes_blocks(pub)
        assert list(model.parameters()) == params, "the same Parameter objects"
        for v in range(1, 6):
            _step(model, optimizer, seed=v)
            p = pub.publish()
            assert copier.wait_for_version(p.version, timeout=10)
            assert digest(flatten(copier.weights)) == digest(flatten(model)), v
            assert _same(aliaser.model, model), v
        assert int(model.norm.num_batches_tracked) == 5
        kept = model.blocks[7][1].bias.detach().clone()
        with torch.no_grad():
            model.blocks[2][0].weight.add_(1.0)
            model.blocks[7][1].bias.add_(2.0)  # changed, not named: not published
        p = pub.publish(keys=["blocks.2.0.weight"])
        assert copier.wait_for_version(p.version, timeout=10)
        got = flatten(copier.weights)
        assert torch.equal(got[("blocks", "2", "0", "weight")], model.blocks[2][0].weight.detach())
        assert torch.equal(got[("blocks", "7", "1", "bias")], kept)
        p = pub.publish()
        assert copier.wait_for_version(p.version, timeout=10)
        assert digest(flatten(copier.weights)) == digest(flatten(model))
        assert _writes_blocks(pub)


def test_a_reallocated_parameter_leaves_the_flat_layout_with_a_warning(name, caplog):
    model = Many(blocks=4)
    with (
        _flat_publisher(model, name) as pub,
        zmqsync.Subscriber(name=name) as sub,
    ):
        assert _writes_blocks(pub)
        state = {k: v.clone() + 1 for k, v in model.state_dict().items()}
        model.load_state_dict(state, assign=True)  # new tensors: they leave the block
        with caplog.at_level("WARNING", logger="zmqsync"):
            p = pub.publish()
        assert not _writes_blocks(pub)
        assert "left the flat layout" in caplog.text and "blocks.0.0.weight" in caplog.text
        assert sub.wait_for_version(p.version, timeout=10)
        assert digest(flatten(sub.weights)) == digest(flatten(model))
        with torch.no_grad():
            model.blocks[1][0].weight.mul_(-2)
        p = pub.publish()
        assert sub.wait_for_version(p.version, timeout=10)
        assert digest(flatten(sub.weights)) == digest(flatten(model))


def test_one_tensor_reassigned_through_data_is_seen_too(name, caplog):
    model = Many(blocks=4)
    with _flat_publisher(model, name) as pub, zmqsync.Subscriber(name=name) as sub:
        weight = model.blocks[3][1].weight
        weight.data = weight.data.double().float() + 3  # the same Parameter, a new storage
        with caplog.at_level("WARNING", logger="zmqsync"):
            p = pub.publish()
        assert "blocks.3.1.weight" in caplog.text and not _writes_blocks(pub)
        assert sub.wait_for_version(p.version, timeout=10)
        assert digest(flatten(sub.weights)) == digest(flatten(model))


def test_weights_the_block_cannot_take_publish_tensor_by_tensor(name, caplog):
    model = Many(blocks=2)
    weight = model.blocks[0][0].weight
    weight.data = weight.data.t().contiguous().t()
    with caplog.at_level("WARNING", logger="zmqsync"):
        pub = _flat_publisher(model, name)
        pub.start()
    try:
        assert "no flat layout" in caplog.text and not _writes_blocks(pub)
        with zmqsync.Subscriber(name=name) as sub:
            with torch.no_grad():
                weight.add_(1)
            p = pub.publish()
            assert sub.wait_for_version(p.version, timeout=10)
            assert digest(flatten(sub.weights)) == digest(flatten(model))
    finally:
        pub.close()


def test_flat_takes_no_dtype():
    with pytest.raises(ValueError, match="no dtype"):
        zmqsync.Copy(flat=True, dtype=torch.bfloat16)


class _CountingList(torch.nn.ParameterList):
    """A ParameterList that counts the times it is asked for its own parameters."""

    asked = 0

    def named_parameters(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        if kwargs.get("recurse") is False:
            type(self).asked += 1
        return super().named_parameters(*args, **kwargs)


class _Wide(torch.nn.Module):
    """One module holding 1,500 tensors itself (a ParameterList, experts side by side)."""

    def __init__(self) -> None:
        super().__init__()
        self.experts = _CountingList(torch.nn.Parameter(torch.randn(16)) for _ in range(1500))


@pytest.mark.parametrize(("mode", "flat"), [("alias", False), ("copy", True)])
def test_a_worker_asks_a_module_of_many_tensors_for_them_once_per_join(name, mode, flat):
    """Asked once per tensor, a join of 2,000 tensors held by one module took seconds."""
    model, worker_model = _Wide(), _Wide()
    params = list(worker_model.parameters())
    with zmqsync.Publisher(model, name=name) as pub:
        pub.publish()
        _CountingList.asked = 0
        with zmqsync.Subscriber(
            name=name,
            model=worker_model,
            reads=(zmqsync.Aliases() if mode == "alias" else zmqsync.Copies(flat=flat)),
        ) as sub:
            assert sub.version == 1
            assert _CountingList.asked == 1
            assert list(worker_model.parameters()) == params, "the same Parameter objects"
            assert _same(worker_model, model)
            with torch.no_grad():
                model.experts[1499].add_(1.0)
            assert sub.wait_for_version(pub.publish().version, timeout=10)
            assert _same(worker_model, model)
