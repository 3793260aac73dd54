"""The torchrl scheme over a sharded trainer: every rank of an FSDP2 (or tensor-parallel)
trainer builds ``ZmqWeightSyncScheme(name=...)``'s sender over its DTensor policy and
calls ``send()``; a receiver in another process (the scheme's receiver side alone, or a
torchrl ``Collector`` given it as ``weight_recv_schemes``; a plain policy) gets every
version bit-exact against the trainer's own
``get_model_state_dict(full_state_dict=True)``. What torchrl cannot run (a multi-process
collector holding a DTensor policy) is refused in one line, before any bus starts; a
single collector that runs the policy in the trainer's own process is served.

Real processes, as in `tests/test_shards.py`: the ranks (gloo on localhost) and the
receiver are this file run as a script (``rank``, ``receiver``, ``refusals``); the model
is shard_trainer's shape sized for torchrl's mock env, sharded by
`tests/helpers/shard_trainer.py`'s ``_shard``.
"""

from __future__ import annotations

import json
import os
import sys
import time

import pytest

pytestmark = [pytest.mark.timeout(240), pytest.mark.slow]

SCRIPT = "tests/test_torchrl_shards.py"


def _event(name: str, **fields: object):
    return lambda r: r.get("event") == name and all(r.get(k) == v for k, v in fields.items())


@pytest.fixture
def ranks():
    """launch(n, *args) -> the n rank processes of one trainer, killed at teardown."""
    from tests.conftest import Proc
    from tests.test_shards import _free_port

    procs: list[Proc] = []

    def launch(n: int, *args: str) -> list[Proc]:
        port = str(_free_port())
        for rank in range(n):
            env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(n), LOCAL_RANK=str(rank))
            env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, OMP_NUM_THREADS="1")
            procs.append(Proc([sys.executable, SCRIPT, "rank", *args], env))
        return procs[-n:]

    yield launch
    for proc in procs:
        proc.kill()


@pytest.mark.parametrize(
    ("kind", "sync", "side"),
    [("fsdp", "true", "scheme"), ("tp", "1", "scheme"), ("fsdp", "true", "collector")],
)
def test_every_rank_sends_and_a_receiver_gets_the_full_state_dict(
    ranks, spawn, tmp_path, name, kind, sync, side
):
    """sync=True: the host's send() returns once the receiver applied the version;
    sync=1 (bounded staleness) is accepted on every rank and waits only on the host.
    The receiver is the scheme's receiver side alone, or a torchrl `Collector`."""
    gate = tmp_path / "gate"
    gate.mkdir()
    procs = ranks(2, name, kind, sync, str(gate))
    host = procs[0]
    host.wait_for(_event("started"), timeout=120)
    receiver = spawn(SCRIPT, "receiver", name, side, module="")
    assert (
        receiver.wait_for(_event("seen", version=0), timeout=120)["digest"]
        == (host.wait_for(_event("version", version=0), timeout=60)["digest"])
    )
    (gate / "0").touch()
    for version in (1, 2, 3):
        want = host.wait_for(_event("version", version=version), timeout=120)
        seen = receiver.wait_for(_event("seen", version=version), timeout=120)
        assert seen["digest"] == want["digest"], f"version {version} differs from full_state_dict"
        if sync == "true":
            assert want["acked"] == [receiver.wait_for(_event("ready"))["worker"]]
        (gate / str(version)).touch()
    # the other rank's send() returned once each version was announced: no acks there
    other = procs[1].wait_for(_event("version", version=3), timeout=60)
    assert other["acked"] == [] and other["workers"] == []
    for proc in procs:
        proc.wait_for(_event("done"), timeout=60)
        assert proc.finish(30) == 0, proc.stderr[-2000:]
    assert receiver.finish(60) == 0, receiver.stderr[-2000:]


def test_what_torchrl_cannot_run_is_refused_in_one_line(spawn, name, bus_dirs):
    proc = spawn(SCRIPT, "refusals", name, module="")
    assert proc.finish(180) == 0, proc.stderr[-3000:]
    cases = {r["case"]: r for r in proc.records}
    multi = cases["multi-process collector"]["error"]
    assert multi.startswith("TypeError: model 'policy' of MultiSyncCollector holds DTensors")
    assert "attach=True" in multi
    assert cases["no name"]["error"].startswith("ValueError: the policy holds DTensors")
    assert cases["per-worker"]["error"].startswith("TypeError: per-worker weights hold DTensors")
    assert all("\n" not in r["error"] for r in cases.values())
    assert cases["single collector"]["error"] == ""
    _, shm = bus_dirs
    assert not [f for f in os.listdir(shm) if not f.startswith(".")], "a bus was left behind"


# --- the processes -------------------------------------------------------------------


def _say(**record: object) -> None:
    print(json.dumps(record), flush=True)


def _gate(directory: str, version: int, timeout: float = 120.0) -> None:
    end = time.monotonic() + timeout
    while not os.path.exists(os.path.join(directory, str(version))):
        if time.monotonic() > end:
            raise TimeoutError(f"no gate for version {version} within {timeout} s")
        time.sleep(0.01)


OBS = 7  # ContinuousActionVecMockEnv's observation and action sizes


def _policy():
    """A torchrl policy around shard_trainer's model shape, sized for the mock env:
    norm(7) -> fc1(7 -> 30) -> relu -> fc2(30 -> 7), and two buffers (int64, bf16)."""
    import torch
    from tensordict.nn import TensorDictModule

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm = torch.nn.LayerNorm(OBS)
            self.fc1 = torch.nn.Linear(OBS, 30)
            self.fc2 = torch.nn.Linear(30, OBS)
            self.register_buffer("steps", torch.zeros((), dtype=torch.int64))
            self.register_buffer("scale", torch.ones(5, dtype=torch.bfloat16))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.tanh(self.fc2(torch.relu(self.fc1(self.norm(x)))))

    return TensorDictModule(Net(), in_keys=["observation"], out_keys=["action"])


def _step(policy, opt, step: int, kind: str) -> None:
    """A training step (FSDP2: forward, backward, SGD; tensor parallel: each rank's shards
    moved directly, as in shard_trainer), and the buffers changed."""
    import torch

    net = policy.module
    g = torch.Generator().manual_seed(step)
    if kind == "fsdp":
        net(torch.randn(8, OBS, generator=g)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    with torch.no_grad():
        if kind == "tp":
            for i, p in enumerate(net.parameters()):
                local = p.to_local() if hasattr(p, "to_local") else p
                gen = torch.Generator().manual_seed(1000 * step + i)
                local.add_(torch.randn(local.shape, generator=gen))
        net.steps += 1
        net.scale.mul_(1.5)


def _rank(name: str, kind: str, sync: str, gate: str) -> int:
    """One trainer rank: shard, build the scheme's sender, send() after each step."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from tests.helpers.ranks import leave
    from tests.helpers.shard_trainer import _full_digest, _shard
    from zmqsync.integrations.torchrl import ZmqWeightSyncScheme

    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    rank = dist.get_rank()
    torch.manual_seed(0)
    policy = _policy()
    _shard(policy.module, kind, dist.get_world_size())
    opt = torch.optim.SGD(policy.parameters(), lr=0.1)
    scheme = ZmqWeightSyncScheme(name=name, timeout=60, sync=True if sync == "true" else int(sync))
    scheme.init_on_sender(model_id="policy", model=policy)  # every rank: a collective
    scheme.connect()
    d0 = _full_digest(policy)
    publisher = scheme.publisher
    assert publisher is not None
    if rank == 0:
        _say(event="started")
        _say(event="version", version=0, digest=d0)
        publisher.wait_for_workers(1, timeout=120)
        _gate(gate, 0)
    dist.barrier()
    for step in range(1, 4):
        _step(policy, opt, step, kind)
        scheme.send()  # every rank: its shards; the host announces and waits for acks
        done = scheme.last_publish
        assert done is not None and scheme.version == step
        digest = _full_digest(policy)
        _say(event="version", rank=rank, version=done.version, digest=digest,
             acked=sorted(done.acked), workers=sorted(publisher.workers))  # fmt: skip
        if rank == 0:
            _gate(gate, step)
        dist.barrier()
    scheme.shutdown()
    _say(event="done", rank=rank)
    leave()


def _receiver(name: str, side: str) -> int:
    """A plain policy in another process, updated by the scheme's receiver side alone
    (`side` "scheme") or by a torchrl `Collector` given it as ``weight_recv_schemes``
    ("collector", applying at each rollout): report each version it applies."""
    import warnings

    import torch
    from torchrl.collectors import Collector
    from torchrl.testing.mocking_classes import ContinuousActionVecMockEnv

    from zmqsync._checksum import digest
    from zmqsync._layout import flatten
    from zmqsync.integrations.torchrl import ZmqWeightSyncScheme

    warnings.simplefilter("ignore", DeprecationWarning)
    torch.manual_seed(1)  # other weights than the trainer's: version 0 must replace them
    policy = _policy()
    seen, end = -1, time.monotonic() + 180

    def report(recv: ZmqWeightSyncScheme) -> None:
        nonlocal seen
        if recv.version != seen:
            seen = recv.version
            _say(event="seen", version=seen, digest=digest(flatten(policy.state_dict())))

    with ZmqWeightSyncScheme(name=name, apply="manual", timeout=60) as recv:
        if side == "collector":
            collector = Collector(
                ContinuousActionVecMockEnv(), policy, frames_per_batch=10, total_frames=-1,
                weight_recv_schemes={"policy": recv},
            )  # fmt: skip
        else:
            recv.init_on_receiver(model_id="policy", model=policy)
            recv.connect()
        assert recv.subscriber is not None
        _say(event="ready", worker=recv.subscriber.worker_id)
        if side == "collector":
            for _ in collector:  # each rollout starts with the newest version
                report(recv)
                if seen == 3 or time.monotonic() > end:
                    break
            collector.shutdown()
        while seen < 3 and time.monotonic() < end:
            recv.receive(timeout=0.5)
            report(recv)
    return 0 if seen == 3 else 5


def _refusals(name: str) -> int:
    """A world of one rank (gloo): each case's error, one JSON line each."""
    import socket
    import warnings

    import torch.distributed as dist
    from tensordict import TensorDict
    from tensordict.nn import TensorDictModule
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torchrl.collectors import Collector, MultiSyncCollector
    from torchrl.testing.mocking_classes import ContinuousActionVecMockEnv

    from zmqsync.integrations.torchrl import ZmqWeightSyncScheme

    warnings.simplefilter("ignore")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    mesh = init_device_mesh("cpu", (1,))

    def policy() -> TensorDictModule:
        net = nn.Sequential(nn.Linear(7, 7), nn.Tanh())
        fully_shard(net, mesh=mesh)
        return TensorDictModule(net, in_keys=["observation"], out_keys=["action"])

    def case(label: str, run) -> None:
        try:
            run()
        except (TypeError, ValueError) as exc:
            _say(case=label, error=f"{type(exc).__name__}: {exc}")
        else:
            _say(case=label, error="")

    def multi() -> None:
        scheme = ZmqWeightSyncScheme(name=name)
        collector = MultiSyncCollector(
            [ContinuousActionVecMockEnv] * 2, policy(), frames_per_batch=20, total_frames=-1,
            weight_sync_schemes={"policy": scheme},
        )  # fmt: skip
        collector.shutdown()

    def single() -> None:  # torchrl runs it in this process: the scheme serves it
        with ZmqWeightSyncScheme(name=f"{name}-single") as scheme:
            collector = Collector(
                ContinuousActionVecMockEnv(), policy(), frames_per_batch=10, total_frames=-1,
                weight_sync_schemes={"policy": scheme},
            )  # fmt: skip
            next(iter(collector))
            collector.update_policy_weights_()
            assert scheme.version == 1, scheme.version
            collector.shutdown()

    def scheme_over(scheme: ZmqWeightSyncScheme) -> None:
        with scheme:
            scheme.init_on_sender(model_id="policy", model=policy())

    case("single collector", single)
    case("multi-process collector", multi)
    case("no name", lambda: scheme_over(ZmqWeightSyncScheme()))

    def per_worker() -> None:
        shards = {i: TensorDict.from_module(policy()) for i in range(2)}
        with ZmqWeightSyncScheme(name=name) as scheme:
            scheme.init_on_sender(model_id="policy", params_map=shards)

    case("per-worker", per_worker)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    role, *rest = sys.argv[1:]
    sys.exit({"rank": _rank, "receiver": _receiver, "refusals": _refusals}[role](*rest))
