"""Bounded staleness through torchrl: ``ZmqWeightSyncScheme(sync=k)`` and the scheme
built by torchrl's backend registry, ``WeightSyncScheme.from_backend("zmq")``.

torchrl's own tests of ``from_backend`` (``test_weight_sync_scheme_from_backend`` and
``..._forwards_kwargs`` in its test_collectors.py) are not shipped in its wheel and not
vendored here (tests/torchrl_cases holds the collector cases only); the first tests below
check what they check, for the "zmq" backend: the name builds the class, keyword
arguments reach its constructor, torchrl's own names still resolve.
"""

from __future__ import annotations

import subprocess
import sys
import warnings

import pytest

with warnings.catch_warnings():
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    pytest.importorskip("torchrl", minversion="0.14")
    from torchrl.collectors import MultiAsyncCollector, MultiSyncCollector
    from torchrl.weight_update import SharedMemWeightSyncScheme
    from torchrl.weight_update.weight_sync_schemes import WeightSyncScheme

    import zmqsync
    from tests.test_torchrl import make_env, make_policy, set_version, versions
    from zmqsync.integrations.torchrl import ZmqWeightSyncScheme

pytestmark = pytest.mark.timeout(120)


def test_from_backend_builds_the_scheme_with_its_options():
    scheme = WeightSyncScheme.from_backend("zmq", name="policy", sync=1, slots=3)
    assert type(scheme) is ZmqWeightSyncScheme
    assert (scheme.name, scheme.sync) == ("policy", 1)
    assert WeightSyncScheme.from_backend("zmq").sync is True  # background apply: waits
    with pytest.raises(TypeError, match="unknown option"):
        WeightSyncScheme.from_backend("zmq", bogus=1)
    for backend in ("shared", "thread"):  # torchrl's own names still resolve
        assert type(WeightSyncScheme.from_backend(backend)) is SharedMemWeightSyncScheme


def test_from_backend_knows_zmq_once_the_integration_is_imported():
    code = (
        "from torchrl.weight_update.weight_sync_schemes import WeightSyncScheme as W\n"
        "try:\n"
        "    W.from_backend('zmq')\n"
        "except ValueError:\n"
        "    print('unknown before')\n"
        "import zmqsync.integrations.torchrl\n"
        "print(type(W.from_backend('zmq')).__name__)\n"
    )
    done = subprocess.run(
        [sys.executable, "-W", "ignore", "-c", code], capture_output=True, text=True, timeout=90
    )
    assert done.stdout.split() == ["unknown", "before", "ZmqWeightSyncScheme"], done.stderr


def test_sync_is_the_one_knob_for_how_long_an_update_waits():
    """torchrl's bool, and an int k for bounded staleness; no second knob."""
    import inspect

    assert "max_lag" not in inspect.signature(ZmqWeightSyncScheme).parameters
    assert not hasattr(ZmqWeightSyncScheme, "max_lag")
    # value given -> what scheme.sync reads back (and what each publish waits for)
    for given in (True, False, 1, 5):
        sync = ZmqWeightSyncScheme(sync=given).sync
        assert sync == given and type(sync) is type(given)
    assert ZmqWeightSyncScheme().sync is True  # background apply waits, as torchrl's do
    assert ZmqWeightSyncScheme(apply="manual").sync is False  # would wait for a rollout
    assert ZmqWeightSyncScheme(apply="manual", sync=True).sync is True
    assert ZmqWeightSyncScheme(apply="manual", sync=2).sync == 2
    with pytest.raises(ValueError, match="sync=0 is ambiguous"):
        ZmqWeightSyncScheme(sync=0)
    with pytest.raises(ValueError, match="k >= 1, not -1"):
        ZmqWeightSyncScheme(sync=-1)
    for bad in (1.5, "1", 1.0):
        with pytest.raises(TypeError, match="sync must be True, False or an int >= 1"):
            ZmqWeightSyncScheme(sync=bad)
    with pytest.raises(TypeError, match="unknown option.*max_lag.*sync=k"):
        ZmqWeightSyncScheme(max_lag=1)  # the Publisher's name for it: not a second knob


def test_a_bound_the_slots_cannot_hold_is_refused_where_the_bus_starts():
    with ZmqWeightSyncScheme(sync=2, writes=zmqsync.Copy()) as scheme:  # 2 slots: lag 1
        with pytest.raises(ValueError, match="sync=2 needs slots >= 3"):
            scheme.init_on_sender(model_id="policy", model=make_policy())
    with ZmqWeightSyncScheme(sync=2, writes=zmqsync.Copy(), slots=3) as scheme:
        scheme.init_on_sender(model_id="policy", model=make_policy())
        scheme.send()
        assert scheme.last_publish.max_lag == 2
    with ZmqWeightSyncScheme(sync=2, writes=zmqsync.Live()) as live:  # no slot to wait for
        live.init_on_sender(model_id="policy", model=make_policy())
        live.send()
    with ZmqWeightSyncScheme(sync=False) as scheme:  # no wait: the publish returns at once
        scheme.init_on_sender(model_id="policy", model=make_policy())
        scheme.send()
        assert scheme.last_publish.max_lag is None


def test_a_live_bus_is_asked_for_with_writes_alone():
    import inspect

    assert "live" not in inspect.signature(ZmqWeightSyncScheme).parameters
    assert ZmqWeightSyncScheme(writes=zmqsync.Live()).live
    assert not ZmqWeightSyncScheme(writes=zmqsync.Copy()).live
    with pytest.raises(ValueError, match="writes=Live.. shares the trainer.s tensors"):
        ZmqWeightSyncScheme(writes=zmqsync.Live(), mode="copy")


def test_update_returns_with_every_worker_at_most_k_versions_behind():
    """An asynchronous collector whose workers apply in the background: with sync=1,
    update_policy_weights_() returns once every worker applied the version before it
    (``scheme.last_publish.lags``), and each frame's policy_version names the version
    that acted, so a batch's staleness is the version published before it arrived minus
    its oldest policy_version."""
    policy = make_policy(0)
    with WeightSyncScheme.from_backend("zmq", sync=1, timeout=30) as scheme:
        collector = MultiAsyncCollector(
            [make_env, make_env],
            policy,
            frames_per_batch=20,
            total_frames=-1,
            weight_sync_schemes={"policy": scheme},
            track_policy_version=True,
        )
        try:
            published, batches, staleness = 0, iter(collector), []
            for _ in range(8):
                batch = next(batches)
                staleness.append(published - min(versions(batch)))
                published += 1
                set_version(policy, published)
                collector.update_policy_weights_()
                p = scheme.last_publish
                assert p.version == published and p.max_lag == 1
                assert len(p.lags) == 2 and max(p.lags.values()) <= 1
            assert min(staleness) >= 0
        finally:
            collector.shutdown()


def test_manual_workers_of_a_sync_collector_run_at_most_one_version_behind():
    """Manual apply takes a version at the start of a rollout, which a sync collector's
    workers begin only when the trainer asks for the next batch; with sync=1 the
    update returns before the workers acked it, so a worker may begin its rollout before
    the version's RECEIVE reached it, and the next update waits for that worker. The
    rollout's start waits for a version the header already names, so neither waits
    forever, and each batch's staleness is at most 1."""
    policy = make_policy(0)
    with WeightSyncScheme.from_backend("zmq", apply="manual", sync=1, timeout=30) as scheme:
        collector = MultiSyncCollector(
            [make_env, make_env],
            policy,
            frames_per_batch=40,
            total_frames=-1,
            weight_sync_schemes={"policy": scheme},
            track_policy_version=True,
        )
        try:
            published, batches = 0, iter(collector)
            for _ in range(8):
                batch = next(batches)
                assert published - min(versions(batch)) <= 1
                published += 1
                set_version(policy, published)
                collector.update_policy_weights_()
                assert max(scheme.last_publish.lags.values()) <= 1
        finally:
            collector.shutdown()
