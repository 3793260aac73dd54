"""ZmqWeightSyncScheme inside real torchrl collectors (torchrl's packaged mock env, no gym).

Every version v has known weights (`weights_for(v)`), so each collected frame can be
checked twice: its ``("next", "policy_version")`` names a version, and its action must be
what that version's policy computes from its observation.

Run as ``python -m tests.test_torchrl NAME UNTIL`` this module is also the independent
collector of `test_late_collector_attaches_by_name`: a process torchrl did not spawn.
"""

from __future__ import annotations

import gc
import json
import os
import pickle
import sys
import threading
import time
import warnings
import weakref

import pytest
import torch
from torch import nn

with warnings.catch_warnings():
    # torchrl's own legacy classes warn about their deprecated base class on import.
    warnings.filterwarnings(
        "ignore",
        message=".*inherits from WeightUpdaterBase is deprecated",
        category=DeprecationWarning,
    )
    pytest.importorskip("torchrl", minversion="0.14")
    from tensordict import TensorDict
    from tensordict.nn import TensorDictModule
    from torchrl.collectors import Collector, MultiAsyncCollector, MultiSyncCollector
    from torchrl.testing.mocking_classes import ContinuousActionVecMockEnv

    from zmqsync.integrations.torchrl import ZmqWeightSyncScheme

pytestmark = pytest.mark.timeout(90)

OBS = 7  # ContinuousActionVecMockEnv: observation and action sizes
VERSION = ("next", "policy_version")  # the version whose weights chose the frame's action


def make_env() -> ContinuousActionVecMockEnv:
    return ContinuousActionVecMockEnv()


def weights_for(version: int) -> dict[str, torch.Tensor]:
    """The known weights of `version` (a state_dict of `make_policy()`)."""
    gen = torch.Generator().manual_seed(1000 + version)
    return {
        "module.0.weight": torch.randn(OBS, OBS, generator=gen) * 0.5,
        "module.0.bias": torch.randn(OBS, generator=gen) * 0.1,
    }


def make_policy(version: int | None = 0) -> TensorDictModule:
    policy = TensorDictModule(
        nn.Sequential(nn.Linear(OBS, OBS), nn.Tanh()), in_keys=["observation"], out_keys=["action"]
    )
    if version is not None:
        set_version(policy, version)
    return policy


def set_version(policy: nn.Module, version: int) -> None:
    policy.load_state_dict(weights_for(version))


def versions(batch) -> list[int]:
    return sorted(set(batch.get(VERSION).flatten().tolist()))


def action_error(batch) -> float:
    """Largest |action - policy_v(observation)| over frames, v being each frame's version."""
    frames = batch.reshape(-1)
    worst = 0.0
    for version in versions(frames):
        rows = frames[frames.get(VERSION).reshape(-1) == version]
        w = weights_for(version)
        expected = torch.tanh(rows["observation"] @ w["module.0.weight"].T + w["module.0.bias"])
        worst = max(worst, (rows["action"] - expected).abs().max().item())
    return worst


def test_scheme_pickles_as_plain_settings():
    with ZmqWeightSyncScheme(slots=3, timeout=5.0) as scheme:
        scheme.init_on_sender(model_id="policy", model=make_policy())
        data = pickle.dumps(scheme)
        clone = pickle.loads(data)
        assert b"rebuild_tensor" not in data and b"Publisher" not in data
        assert (clone.name, clone.address) == (scheme.name, scheme.address)
        assert clone.publisher is None and clone.version == -1
        assert scheme.name.startswith("torchrl-policy-") and scheme.version == 0


def test_each_side_holds_its_own_state_and_one_function_makes_the_subscriber():
    """The sender's buses and a receiver's Subscriber live in separate objects, neither
    pickled; a change of the Subscriber's constructor is a change of one function."""
    import ast
    from pathlib import Path

    import zmqsync.integrations.torchrl as package

    made = {}
    for path in Path(package.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) in (
                "Subscriber",
                "Publisher",
            ):
                made.setdefault(node.func.id, []).append(path.name)
    assert made == {"Subscriber": ["_receiver.py"], "Publisher": ["_sender.py"]}
    with ZmqWeightSyncScheme() as scheme:
        scheme.init_on_sender(model_id="policy", model=make_policy())
        assert scheme._sender is not None and scheme._receiver is None
        state = scheme.__getstate__()
        assert state["_sender"] is None and state["_receiver"] is None
        assert state["_rendezvous"].name == scheme.name  # all a receiver needs, as strings


def test_options_are_checked_where_they_are_given():
    for bad in ({"mode": "zero"}, {"apply": "later"}, {"on_timeout": "ignore"}, {"slots": 0}):
        with pytest.raises(ValueError):
            ZmqWeightSyncScheme(**bad)
    with pytest.raises(ValueError, match="not allowed"):
        ZmqWeightSyncScheme(name="no spaces")
    with ZmqWeightSyncScheme() as orphan:  # a receiver no sender set up, and no name
        policy = make_policy()  # the scheme holds its model by weak reference
        orphan.init_on_receiver(model_id="policy", model=policy)
        with pytest.raises(ValueError, match="name"):
            orphan.connect()


def test_receiver_fills_a_stateless_policy_and_follows_a_replaced_one(name):
    """torchrl ships workers a meta-device policy, and may later swap in a copy of it."""
    policy = make_policy(0)
    with ZmqWeightSyncScheme(name=name) as trainer:
        trainer.init_on_sender(model_id="policy", model=policy)
        with torch.device("meta"):
            stateless = make_policy(None)
        replacement = make_policy(None)
        with ZmqWeightSyncScheme(name=name) as receiver:
            receiver.init_on_receiver(model_id="policy", model=stateless, worker_idx=3)
            receiver.connect()
            assert receiver.subscriber.worker_id == f"{name}-w3"
            assert all(t.device.type == "cpu" for t in stateless.state_dict().values())
            assert torch.equal(stateless.state_dict()["module.0.weight"], policy.module[0].weight)
            receiver.model = replacement  # what torchrl's worker does after a device copy
            set_version(policy, 1)
            trainer.send()  # returns once the re-attached receiver applied it
            assert list(trainer.publisher.workers) == [f"{name}-w3"]
            weight = replacement.state_dict()["module.0.weight"]
            assert torch.equal(weight, weights_for(1)["module.0.weight"])
            assert not torch.equal(stateless.state_dict()["module.0.weight"], weight)


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_every_worker_computes_with_each_new_version(kind):
    """Sync collector, background apply: update_policy_weights_() returns once every
    worker applied version k, and the next batch is version k on every worker and frame.
    Async collector, manual apply: a worker applies at the start of a rollout, so no
    batch mixes versions; each frame's label matches its action either way."""
    policy = make_policy(0)
    cls, options = {
        "sync": (MultiSyncCollector, {}),
        "async": (MultiAsyncCollector, {"apply": "manual"}),
    }[kind]
    with ZmqWeightSyncScheme(**options) as scheme:
        collector = cls(
            [make_env, make_env],
            policy,
            frames_per_batch=40,
            total_frames=-1,
            weight_sync_schemes={"policy": scheme},
            track_policy_version=True,
        )
        try:
            workers = sorted(scheme.publisher.workers)
            assert workers == [f"{scheme.name}-w0", f"{scheme.name}-w1"]
            latest, seen, batches = 0, [], iter(collector)
            for i, batch in enumerate(batches):
                assert action_error(batch) < 1e-5, versions(batch)
                seen.append(versions(batch))
                if kind == "sync":
                    assert versions(batch) == [latest]  # both workers, every frame
                else:
                    assert len(versions(batch)) == 1 and versions(batch)[0] <= latest
                if i == 7:
                    break
                if i % 2 == 0:
                    latest += 1
                    set_version(policy, latest)
                    # alternately re-read the collector's policy and pass weights explicitly
                    weights = TensorDict.from_module(policy) if latest % 2 else None
                    collector.update_policy_weights_(weights)
                    assert scheme.last_publish.version == latest == scheme.version
                    assert collector.policy_version == latest
                    if kind == "sync":  # applied by both before update_policy_weights_ returned
                        assert sorted(scheme.last_publish.acked) == workers
            for _ in range(20):  # async: batches in flight during the update drain out
                if seen[-1] == [latest]:
                    break
                batch = next(batches)
                assert action_error(batch) < 1e-5
                seen.append(versions(batch))
            assert seen[-1] == [latest]
        finally:
            collector.shutdown()


def test_killed_worker_does_not_hang_update():
    policy = make_policy(0)
    with ZmqWeightSyncScheme(heartbeat=0.1, timeout=30.0) as scheme:
        collector = MultiSyncCollector(
            [make_env, make_env],
            policy,
            frames_per_batch=40,
            total_frames=-1,
            weight_sync_schemes={"policy": scheme},
        )
        try:
            collector.procs[1].kill()
            collector.procs[1].join(10)
            set_version(policy, 1)
            start = time.monotonic()
            collector.update_policy_weights_()
            elapsed = time.monotonic() - start
            assert elapsed < 5.0, f"update took {elapsed:.1f} s with a dead worker"
            assert scheme.version == 1
            assert sorted(scheme.publisher.workers) == [f"{scheme.name}-w0"]
            assert scheme.publisher.workers[f"{scheme.name}-w0"].version == 1
        finally:
            collector.shutdown(raise_on_error=False)


def test_late_collector_attaches_by_name(name, spawn):
    """A collector torchrl did not spawn joins late, by name, and follows new versions."""
    policy = make_policy(0)
    with ZmqWeightSyncScheme(name=name, timeout=30.0) as scheme:
        scheme.init_on_sender(model_id="policy", model=policy)
        scheme.connect()
        for version in (1, 2, 3):  # nobody listens yet: returns at once
            set_version(policy, version)
            scheme.send()
        child = spawn("-m", "tests.test_torchrl", name, "4", module="")
        joined = child.wait_for(lambda r: r["event"] == "joined", timeout=60)
        assert joined["version"] == 3
        first = child.wait_for(lambda r: r["event"] == "batch")
        assert first["versions"] == [3] and first["error"] < 1e-5
        set_version(policy, 4)
        scheme.send()  # waits for the child's ack: at the start of its next rollout
        assert scheme.last_publish.acked == (joined["worker_id"],)
        later = child.wait_for(lambda r: r["event"] == "batch" and 4 in r["versions"])
        assert later["versions"] == [4] and later["error"] < 1e-5
        assert child.finish() == 0, child.stderr[-2000:]
        assert all(r["error"] < 1e-5 for r in child.records if r["event"] == "batch")


def test_multi_collector_started_elsewhere_attaches_its_workers(name):
    """A MultiSyncCollector given attach=True starts no bus: its workers join the trainer's
    (here in alias mode: their policies compute straight from the shared buffer)."""
    policy = make_policy(0)
    with ZmqWeightSyncScheme(name=name) as trainer:
        trainer.init_on_sender(model_id="policy", model=policy)
        set_version(policy, 1)
        trainer.send()  # nobody listens yet
        options = {"attach": True, "worker_id": "box7", "mode": "alias"}
        with ZmqWeightSyncScheme(name=name, **options) as scheme:
            collector = MultiSyncCollector(
                [make_env, make_env],
                make_policy(None),
                frames_per_batch=40,
                total_frames=-1,
                weight_sync_schemes={"policy": scheme},
                track_policy_version=True,
            )
            try:
                assert scheme.publisher is None
                assert sorted(trainer.publisher.workers) == ["box7-w0", "box7-w1"]
                batches = iter(collector)
                batch = next(batches)
                assert versions(batch) == [1] and action_error(batch) < 1e-5
                set_version(policy, 2)
                trainer.send()  # returns once both of the collector's workers applied it
                assert sorted(trainer.last_publish.acked) == ["box7-w0", "box7-w1"]
                collector.update_policy_weights_()  # nothing to do here: the trainer publishes
                batch = next(batches)
                assert versions(batch) == [2] and action_error(batch) < 1e-5
                assert trainer.version == 2
            finally:
                collector.shutdown()


def test_manual_apply_never_mixes_versions_in_a_batch(name):
    """An in-process single collector receiving on its own (weight_recv_schemes)."""
    policy = make_policy(0)
    with ZmqWeightSyncScheme(name=name, sync=False) as trainer:
        trainer.init_on_sender(model_id="policy", model=policy)
        with ZmqWeightSyncScheme(name=name, apply="manual") as receiver:
            collector = Collector(
                make_env(),
                make_policy(None),
                frames_per_batch=20,
                total_frames=-1,
                weight_recv_schemes={"policy": receiver},
                track_policy_version=True,
                auto_register_policy_transforms=False,  # else torchrl 0.14 warns
            )
            try:
                batches = iter(collector)
                assert versions(next(batches)) == [0]
                set_version(policy, 1)
                trainer.send()  # returns at once; the collector applies at a safe point
                assert receiver.receive(timeout=5.0) is not None  # collector.receive_weights()
                assert receiver.version == collector.policy_version == 1
                batch = next(batches)
                assert versions(batch) == [1] and action_error(batch) < 1e-5
                set_version(policy, 2)
                trainer.send()
                for _ in range(50):  # applied at the start of a rollout, never inside one
                    batch = next(batches)
                    assert len(versions(batch)) == 1 and action_error(batch) < 1e-5
                    if versions(batch) == [2]:
                        break
                assert versions(batch) == [2]
            finally:
                collector.shutdown()


def test_dropped_scheme_releases_its_bus_and_segments(bus_dirs):
    """torchrl never shuts a scheme down: dropped with its collector, in a reference cycle
    that only the garbage collector frees, it closes its (live) bus without a warning."""
    policy = make_policy(0)

    def collect_once() -> tuple[weakref.ref, str]:
        scheme = ZmqWeightSyncScheme()
        collector = MultiSyncCollector(
            [make_env],
            policy,
            frames_per_batch=20,
            total_frames=-1,
            weight_sync_schemes={"policy": scheme},
        )
        cycle: list[object] = [collector]
        cycle.append(cycle)  # only the cycle collector frees it
        try:
            next(iter(collector))
            assert scheme.live and os.listdir(bus_dirs[1])
        finally:
            collector.shutdown()
        return weakref.ref(scheme), scheme.name

    gone, name = collect_once()
    with warnings.catch_warnings():
        warnings.simplefilter("error", ResourceWarning)
        gc.collect()
    assert gone() is None
    assert not os.listdir(bus_dirs[1]), "the bus's segment is left in the shm dir"
    assert not [t for t in threading.enumerate() if t.name.startswith("zmqsync-")]
    set_version(policy, 1)  # the policy's tensors are private again, and writable
    assert torch.equal(policy.module[0].weight.detach(), weights_for(1)["module.0.weight"])


def test_params_map_one_bus_for_shared_weights_one_per_worker_for_distinct(name):
    shared = TensorDict.from_module(make_policy(1)).data.clone()
    with ZmqWeightSyncScheme(name=name) as scheme:
        scheme.init_on_sender(params_map={0: shared, 1: shared, 2: shared})
        assert scheme.publisher is not None and not scheme.publishers and not scheme.live
    own = {i: TensorDict.from_module(make_policy(i)).data.clone() for i in range(2)}
    with ZmqWeightSyncScheme(name=name) as scheme:
        scheme.init_on_sender(params_map=own)
        assert scheme.publisher is None and sorted(scheme.publishers) == [0, 1]
        assert [p.name for p in scheme.publishers.values()] == [f"{name}-0", f"{name}-1"]
        receivers, policies = [], []
        try:
            for i in range(2):
                clone = pickle.loads(pickle.dumps(scheme))  # what torchrl hands worker i
                policies.append(make_policy(None))
                clone.init_on_receiver(model_id="policy", model=policies[i], worker_idx=i)
                clone.connect()
                receivers.append(clone)
            for i in range(2):
                assert torch.equal(policies[i].module[0].weight, weights_for(i)["module.0.weight"])
            update = TensorDict.from_module(make_policy(5)).data
            scheme.send({1: update})  # worker 1 only; sync: applied when this returns
            assert torch.equal(policies[1].module[0].weight, weights_for(5)["module.0.weight"])
            assert torch.equal(policies[0].module[0].weight, weights_for(0)["module.0.weight"])
            assert scheme.publishers[1].version == 1 and scheme.publishers[0].version == 0
        finally:
            for receiver in receivers:
                receiver.shutdown()
    with pytest.raises(ValueError, match="params_map"):
        ZmqWeightSyncScheme().init_on_sender(params_map={"0": shared})


def _independent_collector(name: str, until: int) -> int:
    """A collector in a process of its own: attach by name, report each batch as JSON."""
    scheme = ZmqWeightSyncScheme(name=name, apply="manual", timeout=30.0)
    collector = Collector(
        make_env(),
        make_policy(None),  # random weights: the bus replaces them before the first step
        frames_per_batch=20,
        total_frames=-1,
        weight_recv_schemes={"policy": scheme},
        track_policy_version=True,
        auto_register_policy_transforms=False,
    )
    sub = scheme.subscriber
    assert sub is not None
    joined = {"event": "joined", "version": sub.version, "worker_id": sub.worker_id}
    print(json.dumps(joined), flush=True)
    deadline = time.monotonic() + 60
    try:
        for batch in collector:
            seen = versions(batch)
            report = {"event": "batch", "versions": seen, "error": action_error(batch)}
            print(json.dumps(report), flush=True)
            if max(seen) >= until or time.monotonic() > deadline:
                break
            time.sleep(0.05)
    finally:
        collector.shutdown()
        scheme.shutdown()
    return 0 if max(seen) >= until else 1


if __name__ == "__main__":
    sys.exit(_independent_collector(sys.argv[1], int(sys.argv[2])))
