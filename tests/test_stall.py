"""Publishing off the training loop: overlapped copies, partial publishes, bf16 slots.

Workers are real subprocesses (tests/helpers/stall_worker.py) that report the digest of
what they compute with for every version they apply, before acking it; the trainer
records the digest of what each version must hold when it publishes it.
"""

from __future__ import annotations

import random
import time

import pytest
import torch

import zmqsync
from tests.helpers.models import Mixed, train_step
from zmqsync._checksum import digest
from zmqsync._errors import LayoutMismatch
from zmqsync._layout import flatten

START_S = 180.0  # a worker process's start (torch's import) on a loaded 2-core machine


def _worker(spawn, name: str, mode: str, model: str = "none"):
    worker_id = f"{mode}-{model}-{time.monotonic_ns()}"
    return spawn("tests/helpers/stall_worker.py", name, mode, model, worker_id, module="")


def _join(pub: zmqsync.Publisher, workers: list) -> None:
    joined = pub.wait_for_workers(len(workers), timeout=START_S)
    assert joined, [(w.proc.poll(), w.stderr[-1500:]) for w in workers]
    for w in workers:
        w.wait_for(lambda r: r.get("event") == "applied", START_S)


def _check(workers: list, expected: dict[int, str]) -> None:
    """Every version a worker applied holds exactly what was published; every worker
    reached the last version."""
    last = max(expected)
    for w in workers:
        assert w.finish(60) == 0, w.stderr[-2000:]
        applied = {r["version"]: r["checksum"] for r in w.records if r["event"] == "applied"}
        assert last in applied, f"{w.cmd[-3:]} stopped at {max(applied)}"
        wrong = {v: c for v, c in applied.items() if c != expected[v]}
        assert not wrong, f"{w.cmd[-3:]}: versions {sorted(wrong)} differ from the trainer's"


def _cast(flat: dict, dtype: torch.dtype) -> dict:
    """A copy of `flat`, floating tensors in `dtype` (a copy of each: `to` returns a
    tensor that has the dtype already as it is, and the trainer changes it later)."""
    return {
        k: t.to(dtype, copy=True) if t.is_floating_point() else t.clone() for k, t in flat.items()
    }


def _loss(model: Mixed, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(step)
    return model(torch.randn(16, 16, generator=g)).float().square().mean()


@pytest.mark.timeout(420)
def test_overlapped_publish_is_bit_exact_and_buffers_changed_in_forward_are_published(spawn, name):
    """A training loop with optimizer=: forward (BatchNorm statistics change), backward,
    step, publish(max_lag=None). Each version holds the parameters as step() left them and
    the statistics as they were at publish(), not as the next forward left them."""
    torch.manual_seed(0)
    model = Mixed()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    expected: dict[int, str] = {}
    handles = []
    with zmqsync.Publisher(model, name=name, writes=zmqsync.Overlapped(opt), timeout=60) as pub:
        expected[0] = digest(flatten(model))
        workers = [_worker(spawn, name, "alias"), _worker(spawn, name, "copy")]
        _join(pub, workers)
        for step in range(1, 21):
            model.train()
            loss = _loss(model, step)  # BatchNorm statistics change here
            opt.zero_grad()
            loss.backward()
            opt.step()  # waits only while the last version's copy is unfinished
            handle = pub.publish(max_lag=None)
            expected[handle.version] = digest(flatten(model))
            handles.append(handle)
        for handle in handles:
            assert not handle.wait(60).missing
            assert handle.written and handle.write_seconds is not None
            assert handle.blocked >= 0
    _check(workers, expected)


@pytest.mark.timeout(420)
def test_an_optimizer_step_racing_the_background_copy_never_tears_a_version(spawn, name):
    """step() right after publish(max_lag=None), with nothing in between: the copy of the
    published parameters is under way, and the step's pre-hook must hold it back. What
    each version should hold is found afterwards, by replaying the same steps on a twin
    (hashing 16 MB between publish and step would let the copy finish first)."""

    def trainer() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(0)
        model = torch.nn.Sequential(*(torch.nn.Linear(1024, 1024) for _ in range(4)))  # 16 MB
        for p in model.parameters():
            p.grad = torch.ones_like(p)
        return model, torch.optim.SGD(model.parameters(), lr=0.1)

    model, opt = trainer()
    waited = 0.0
    with zmqsync.Publisher(
        model, name=name, writes=zmqsync.Overlapped(opt), slots=3, timeout=60
    ) as pub:
        workers = [_worker(spawn, name, "alias"), _worker(spawn, name, "copy")]
        _join(pub, workers)
        first = pub.version
        handles = []
        for _ in range(15):
            handle = pub.publish(max_lag=None)
            opt.step()  # every parameter changes while its copy may be running
            handles.append(handle)
        for handle in handles:
            assert not handle.wait(60).missing
            waited += handle.blocked
    twin, twin_opt = trainer()
    expected = {first: digest(flatten(twin))}
    for handle in handles:
        expected[handle.version] = digest(flatten(twin))
        twin_opt.step()
    _check(workers, expected)
    assert waited > 0


@pytest.mark.timeout(420)
def test_twenty_mixed_full_and_partial_publishes_keep_every_slot_exact(spawn, name):
    """Partial publishes name a few tensors; the trainer changes the others too, but a
    version holds the others as last published. Three slots are reused again and again,
    so a slot is often several versions stale when it is written."""
    rng = random.Random(7)
    torch.manual_seed(0)
    model = Mixed()
    keys = [".".join(k) for k in flatten(model)]
    with zmqsync.Publisher(model, name=name, slots=3, timeout=60) as pub:
        published = {k: t.clone() for k, t in flatten(model).items()}
        expected = {0: digest(published)}
        workers = [
            _worker(spawn, name, "alias"),
            _worker(spawn, name, "copy"),
            _worker(spawn, name, "copy", "mixed"),
        ]
        _join(pub, workers)
        kinds = []
        for step in range(1, 21):
            train_step(model, seed=step)  # every tensor changes
            now = flatten(model)
            if step % 3 == 0:  # a full publish every third step
                handle = pub.publish()
                published = {k: t.clone() for k, t in now.items()}
                kinds.append("full")
            else:
                named = rng.sample(keys, rng.randint(1, 3))
                chosen = {tuple(k.split(".")): now[tuple(k.split("."))] for k in named}
                if step % 2:  # re-read from the model, or given as weights=
                    handle = pub.publish(keys=named)
                else:
                    handle = pub.publish(weights=chosen, keys=list(chosen))
                published.update({k: t.clone() for k, t in chosen.items()})
                kinds.append("partial")
            assert not handle.missing and handle.version == step
            expected[step] = digest(published)
    assert kinds.count("partial") > 10
    _check(workers, expected)


def test_a_copy_worker_copies_only_the_tensors_that_changed(name):
    """The worker holds version n and gets n+1, which changed one tensor: it copies that
    one only, so something it wrote into another tensor of its own model stays there.
    (A worker never writes its weights; this is how a test sees what was copied.)"""
    torch.manual_seed(0)
    trainer = Mixed()
    with zmqsync.Publisher(trainer, name=name, timeout=30) as pub:
        local = Mixed()
        with zmqsync.Subscriber(name=name, model=local, timeout=30) as sub:
            with torch.no_grad():
                local.head.bias.fill_(float("nan"))
                trainer.encoder.weight.add_(1.0)
            pub.publish(keys=["encoder.weight"])
            assert sub.wait_for_version(1, timeout=30)
            assert torch.equal(local.encoder.weight, trainer.encoder.weight)
            assert torch.isnan(local.head.bias).all(), "an unchanged tensor was copied"
            pub.publish()  # a full version copies everything again
            assert sub.wait_for_version(2, timeout=30)
            assert digest(flatten(local)) == digest(flatten(trainer))


@pytest.mark.timeout(420)
def test_bf16_slots_reach_bf16_workers_in_both_modes(spawn, name):
    torch.manual_seed(0)
    model = Mixed()
    with zmqsync.Publisher(
        model, name=name, writes=zmqsync.Copy(dtype=torch.bfloat16), timeout=60
    ) as pub:
        expected = {0: digest(_cast(flatten(model), torch.bfloat16))}
        workers = [
            _worker(spawn, name, "alias", "mixed-bf16"),
            _worker(spawn, name, "copy", "mixed-bf16"),
            _worker(spawn, name, "alias"),
        ]
        _join(pub, workers)
        published = _cast(flatten(model), torch.bfloat16)
        for step in range(1, 8):
            train_step(model, seed=step)
            now = _cast(flatten(model), torch.bfloat16)
            if step == 4:  # a partial publish on a bf16 bus too
                assert not pub.publish(keys=["encoder.bias"]).missing
                published[("encoder", "bias")] = now[("encoder", "bias")]
            else:
                assert not pub.publish().missing
                published = now
            expected[step] = digest(published)
        # a float32 model cannot take a bf16 bus: the error names the difference
        with pytest.raises(LayoutMismatch, match="dtype|bfloat16"):
            zmqsync.Subscriber(name=name, model=Mixed(), timeout=30).start()
    _check(workers, expected)


def test_bf16_slots_hold_half_the_bytes(name, bus_dirs):
    _, shm = bus_dirs
    weights = {"w": torch.randn(1024, 256), "steps": torch.zeros(4, dtype=torch.int64)}
    sizes = {}
    for dtype in (torch.float32, torch.bfloat16):  # one bus at a time: one segment
        with zmqsync.Publisher(weights, name=name, writes=zmqsync.Copy(dtype=dtype)):
            (segment,) = shm.iterdir()
            sizes[dtype] = segment.stat().st_size
    assert sizes[torch.bfloat16] < 0.55 * sizes[torch.float32], sizes


def test_keys_that_are_not_tensors_of_the_bus_are_refused_and_the_bus_goes_on(name):
    weights = {"a": torch.zeros(4), "b": torch.zeros(2, 3)}
    with zmqsync.Publisher(weights, name=name, timeout=10) as pub:
        with pytest.raises(LayoutMismatch, match="'c' is not a tensor of this bus"):
            pub.publish(keys=["c"])
        with pytest.raises(ValueError, match="names no tensor"):
            pub.publish(keys=[])
        with pytest.raises(LayoutMismatch):  # weights= lacks a named tensor
            pub.publish(weights={"a": torch.ones(4)}, keys=["a", "b"])
        with pytest.raises(LayoutMismatch):  # a named tensor of the wrong shape
            pub.publish(weights={"a": torch.ones(5)}, keys=["a"])
        assert pub.publish(weights={"a": torch.ones(4)}, keys=["a"]).version == 1
        assert pub.version == 1


def test_close_with_a_version_still_being_written_announces_it_first(name, caplog):
    model = torch.nn.Sequential(*(torch.nn.Linear(1024, 1024) for _ in range(8)))  # 32 MB
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    pub = zmqsync.Publisher(model, name=name, writes=zmqsync.Overlapped(opt), timeout=30).start()
    try:
        handle = pub.publish(max_lag=None)
    finally:
        pub.close()
    assert handle.written and pub.version == 1
    assert "in the background failed" not in caplog.text
    # the hooks are gone with the publisher: a step no longer waits for anything
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()


class _FillStep(torch.optim.Optimizer):
    """An optimizer whose step() sets every parameter to the next version's number: a
    reader can tell from any element which version it belongs to."""

    def __init__(self, params) -> None:
        super().__init__(params, {})
        self.count = 0

    @torch.no_grad()
    def step(self, closure=None) -> None:  # type: ignore[override]
        self.count += 1
        for group in self.param_groups:
            for p in group["params"]:
                p.fill_(self.count % 100)


@pytest.mark.timeout(420)
def test_alias_readers_never_see_a_torn_version_with_overlapped_publishes(spawn, name):
    model = torch.nn.ParameterDict(
        {
            "a": torch.nn.Parameter(torch.zeros(512, 512)),
            "b": torch.nn.Parameter(torch.zeros(1000, dtype=torch.bfloat16)),
        }
    )
    opt = _FillStep(model.parameters())
    with zmqsync.Publisher(model, name=name, writes=zmqsync.Overlapped(opt), timeout=30) as pub:
        readers = [
            spawn("tests/helpers/torn_worker.py", name, "alias", module="") for _ in range(2)
        ]
        for r in readers:
            r.wait_for(lambda rec: rec["event"] == "ready", timeout=START_S)
        assert pub.wait_for_workers(2, timeout=START_S)
        end = time.monotonic() + 4.0
        while time.monotonic() < end:
            opt.step()  # waits for the copy of the version before
            last = pub.publish(max_lag=None)
        last.wait(30)
    for r in readers:
        assert r.finish(60) == 0, r.stderr[-2000:]
        s = r.summary()
        assert s["bad"] == 0 and s["torn"] == 0, f"a reader saw a mix of two versions: {s}"
        assert s["reads"] > 100 and s["versions"] > 5, s


def test_skip_unchanged_publishes_what_the_version_counters_say_moved(name, caplog):
    """Only layer 0 trains: its tensors go out, the others are not copied (a copy worker's
    local garbage in them survives). A write through .data moves no counter: True
    misses it (as documented), "verify" finds it, publishes it and says so."""
    trainer = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
    opt = torch.optim.SGD(trainer[0].parameters(), lr=0.1)
    with zmqsync.Publisher(
        trainer, name=name, writes=zmqsync.Copy(skip_unchanged=True), timeout=30
    ) as pub:
        local = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
        with zmqsync.Subscriber(name=name, model=local, timeout=30) as sub:
            with torch.no_grad():
                local[1].bias.fill_(float("nan"))
            trainer(torch.randn(4, 8)).sum().backward()
            opt.step()
            pub.publish()
            assert sub.wait_for_version(1, timeout=30)
            assert torch.equal(local[0].weight, trainer[0].weight)
            assert torch.isnan(local[1].bias).all(), "an unchanged tensor was copied"
            trainer[1].bias.data.add_(1.0)  # no version counter moves
            pub.publish()
            assert sub.wait_for_version(2, timeout=30)
            assert torch.isnan(local[1].bias).all()
    caplog.clear()
    with zmqsync.Publisher(
        trainer, name=name, writes=zmqsync.Copy(skip_unchanged="verify"), timeout=30
    ) as pub:
        local = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
        with zmqsync.Subscriber(name=name, model=local, timeout=30) as sub:
            trainer[1].bias.data.add_(1.0)
            pub.publish()
            assert sub.wait_for_version(1, timeout=30)
            assert torch.equal(local[1].bias, trainer[1].bias)
            assert "1.bias" in caplog.text and "without their version counter" in caplog.text
            pub.publish()  # nothing changed: a version that copies nothing
            assert sub.wait_for_version(2, timeout=30)
            assert digest(flatten(local)) == digest(flatten(trainer))
    with pytest.raises(ValueError, match="skip_unchanged"):
        zmqsync.Publisher(trainer, name=name, writes=zmqsync.Copy(skip_unchanged="sometimes"))


@pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason=f"needs a CUDA GPU: torch.cuda.is_available() is False (torch {torch.__version__})",
)
@pytest.mark.timeout(420)
def test_overlapped_publish_of_a_cuda_model_is_bit_exact(spawn, name):
    """The copy runs on a side stream; step() right after publish() makes its own stream
    wait for it. An alias worker (CUDA IPC) and a copy worker see every version whole."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(1024, 1024) for _ in range(8))).cuda()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    x = torch.randn(64, 1024, device="cuda")
    expected: dict[int, str] = {}
    with zmqsync.Publisher(model, name=name, writes=zmqsync.Overlapped(opt), timeout=60) as pub:
        expected[0] = digest(flatten(model))
        workers = [_worker(spawn, name, "alias"), _worker(spawn, name, "copy")]
        _join(pub, workers)
        handles = []
        for _ in range(15):
            opt.zero_grad()
            model(x).square().mean().backward()
            handle = pub.publish(max_lag=None)
            expected[handle.version] = digest(flatten(model))
            opt.step()  # queued behind the copy on the GPU, not waited for on the host
            handles.append(handle)
        for handle in handles:
            assert not handle.wait(60).missing
    _check(workers, expected)
