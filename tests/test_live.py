"""Live publishers (``Publisher(live=True)``): the trainer's tensors are the slot."""

from __future__ import annotations

import os

import pytest
import torch

import zmqsync

pytestmark = pytest.mark.timeout(120)


def _live_worker(spawn, name):
    return spawn("tests/helpers/live_worker.py", name, module="")


def test_alias_workers_see_in_place_changes_and_each_publish(spawn, name, bus_dirs):
    weights = {"w": torch.zeros(4096), "n": torch.zeros((), dtype=torch.int64)}
    trainer_w = weights["w"]
    with zmqsync.Publisher(weights, name=name, writes=zmqsync.Live(), timeout=30) as pub:
        assert weights["w"] is trainer_w, "the trainer keeps its tensor objects"
        workers = [_live_worker(spawn, name) for _ in range(2)]
        assert pub.wait_for_workers(2, timeout=60)
        for w in workers:
            w.wait_for(lambda r: r["event"] == "seen" and r["version"] == 0)
        trainer_w.fill_(7.0)  # in place, no publish: the workers read the same memory
        for w in workers:
            w.wait_for(lambda r: r["event"] == "seen" and r["value"] == 7.0 and r["version"] == 0)
        trainer_w.add_(1.0)
        p = pub.publish()  # a notification: nothing is copied
        assert p.version == 1 and len(p.acked) == 2
        for w in workers:
            w.wait_for(lambda r: r["event"] == "seen" and r["value"] == 8.0 and r["version"] == 1)
        p = pub.publish(
            weights={"w": torch.full((4096,), 3.0), "n": torch.ones((), dtype=torch.int64)}
        )
        assert p.version == 2
        assert float(trainer_w[0]) == 3.0, "given weights land in the trainer's tensors"
        for w in workers:
            w.wait_for(lambda r: r["event"] == "seen" and r["value"] == 3.0 and r["version"] == 2)
    for w in workers:
        assert w.finish() == 0
    trainer_w.add_(1.0)  # the trainer's tensors got private memory back on close
    assert float(trainer_w[0]) == 4.0
    assert not os.listdir(bus_dirs[1])


def test_a_module_keeps_its_parameters_and_optimizer(name):
    model = torch.nn.Linear(8, 4)
    params = list(model.parameters())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with zmqsync.Publisher(model, name=name, writes=zmqsync.Live()) as pub:
        assert list(model.parameters()) == params
        with zmqsync.Subscriber(name=name, reads=zmqsync.Aliases(), timeout=10) as sub:
            model(torch.ones(2, 8)).sum().backward()
            opt.step()  # writes the slot in place
            torch.testing.assert_close(sub.tensors[("weight",)], model.weight.detach())
            assert pub.publish().version == 1 and sub.version == 1
    opt.step()  # still works on private memory after close
    assert model.weight.grad is not None


def test_what_a_live_bus_cannot_share_cannot_be_spelled(name):
    """A cast or a background copy of tensors that are the slot itself means nothing:
    Live() takes no options, and the publisher has no others for it."""
    with pytest.raises(TypeError):
        zmqsync.Live(dtype=torch.bfloat16)  # type: ignore[call-arg]
    with pytest.raises(TypeError):
        zmqsync.Publisher({"w": torch.zeros(4)}, name=name, live=True)  # type: ignore[call-arg]
    with pytest.raises(TypeError, match="writes="):
        zmqsync.Publisher({"w": torch.zeros(4)}, name=name, writes=torch.bfloat16)


def test_bench_times_live_publishes_beside_torchrl(bus_dirs, tmp_path):
    """The harness's live points, as the torchrl baseline runs them after its own."""
    from tools.bench.grid.config import BenchConfig
    from tools.bench.grid.live import measure_live
    from tools.bench.grid.results import Results, Row

    results = Results(config={}, machine={}, rows=[Row(n=2, size="4M", label="4 MB", mode="alias")])
    point = {"key": "4M", "kind": "mlp", "nbytes": 4 << 20, "iters": 8, "warmup": 1,
             "min_iters": 3, "max_seconds": 5}  # fmt: skip
    points = [{**point, "variant": "collector"}, {**point, "variant": "own"}]
    cfg = BenchConfig(timeout=60.0)
    summary = measure_live(cfg, results, 2, points, dict(os.environ), tmp_path / "live.log")
    assert set(summary) == {"4M"}, (summary, (tmp_path / "live.log").read_text()[-2000:])
    assert summary["4M"]["iters"] == 8 and summary["4M"]["p50"] < 1.0
    assert len(results.rows[0].samples["zmqsync_live"]) == 8
    assert not os.listdir(bus_dirs[1])
