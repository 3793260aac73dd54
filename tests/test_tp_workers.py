"""Tensor-parallel workers take their slices: a worker group of 2 ranks (gloo on
localhost), each one rank of ``parallelize_module`` (ColwiseParallel, RowwiseParallel),
subscribed to a plain trainer's bus, in Copies() and Aliases(). After every version each
rank's local shards equal its slice of the trainer's full tensors, bit for bit, and a
forward pass through the TP model gives the full model's output.

The trainer is this process; the ranks are `tests/helpers/tp_worker.py`. Any layout in,
any layout out: a sharded trainer (FSDP2, `tests/helpers/shard_trainer.py`) feeds the
same TP workers, whose shards gather into the trainer's full state dict, bit for bit.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

import zmqsync
from tests.conftest import Proc
from tests.helpers.tp_model import INPUT, TpNet
from tests.test_shards import _event, _free_port, _run, ranks  # noqa: F401 (the trainer's ranks)

pytestmark = [pytest.mark.timeout(240), pytest.mark.slow]

WORKER = "tests.helpers.tp_worker"  # run as a module: it imports tests.helpers.tp_model
RANKS = 2
# how each parameter is placed on the worker mesh: the dim it is sharded on (None: replicated)
SHARD_DIM = {
    "fc1.weight": 0,
    "fc1.bias": 0,
    "fc2.weight": 1,
    "fc2.bias": None,
    "odd.weight": 0,
    "odd.bias": 0,
}


@pytest.fixture
def workers():
    """launch(name, mode) -> the worker group's rank processes, killed at teardown."""
    procs: list[Proc] = []

    def launch(name: str, mode: str, native: bool = True, kind: str = "tp") -> list[Proc]:
        port = str(_free_port())
        for rank in range(RANKS):
            env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(RANKS), LOCAL_RANK=str(rank))
            env["ZMQSYNC_NATIVE"] = "1" if native else "0"
            env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, OMP_NUM_THREADS="1")
            procs.append(Proc([sys.executable, "-m", WORKER, name, mode, kind], env))
        return procs

    yield launch
    for proc in procs:
        proc.kill()


def _seen(proc: Proc, version: int) -> dict:
    return proc.wait_for(lambda r: r.get("event") == "seen" and r["version"] == version, 120)


def _check(full: TpNet, record: dict, rank: int) -> None:
    """The rank's local shards are its slices of `full`, bit for bit; its forward pass
    is the full model's."""
    for key, tensor in full.state_dict().items():
        dim = SHARD_DIM[key]
        want = tensor if dim is None else torch.chunk(tensor, RANKS, dim)[rank]
        got = torch.tensor(record["locals"][key]["values"], dtype=tensor.dtype)
        assert got.shape == want.shape, (key, rank)
        assert torch.equal(got, want), f"version {record['version']}: {key} on rank {rank}"
    with torch.no_grad():
        out = full(INPUT)
    torch.testing.assert_close(torch.tensor(record["out"]), out, rtol=1e-5, atol=1e-5)
    assert record["same_params"], "the Parameters must stay the same objects"


@pytest.mark.parametrize(
    ("mode", "native"),
    [("copy", True), ("copy", False), ("alias", True)],
    ids=["copy", "copy-python", "alias"],
)
def test_tp_workers_take_their_slices_of_every_version(workers, name, mode, native):
    """`native`: the workers' copies and follower are the native ones (False: Python's,
    ZMQSYNC_NATIVE=0); in copy mode a follower takes the versions after the first."""
    torch.manual_seed(0)
    full = TpNet()
    with zmqsync.Publisher(full, name=name, timeout=60) as pub:
        procs = workers(name, mode, native)
        for proc in procs:  # joined: version 0, applied at start
            _seen(proc, 0)
        assert pub.wait_for_workers(RANKS, timeout=30)
        versions = range(4)
        pointers: dict[str, set[int]] = {"fc1.weight": set(), "fc2.weight": set()}
        for version in versions:
            if version:
                with torch.no_grad():
                    for p in full.parameters():
                        p.add_(torch.randn(p.shape))
                pub.publish()
                assert pub.version == version
            for rank, proc in enumerate(procs):
                record = _seen(proc, version)
                _check(full, record, rank)
                if rank == 0:
                    for key, seen in pointers.items():
                        seen.add(record["locals"][key]["ptr"])
    for proc in procs:
        assert proc.finish(60) == 0, (proc.cmd, proc.stderr[-3000:])
        counters = proc.wait_for(lambda r: r.get("event") == "done")["counters"]
        assert counters["applied"] == len(versions)
        if mode == "copy" and native:
            assert counters["native"] == len(versions) - 1, counters
    # copy mode fills the shards in place; alias mode binds fc1.weight (its row slice is
    # one byte range) to each slot's bytes and copies fc2.weight's column slice
    assert len(pointers["fc2.weight"]) == 1
    assert (len(pointers["fc1.weight"]) > 1) == (mode == "alias")


@pytest.mark.parametrize("mode", ["copy", "alias"])
def test_an_fsdp2_trainer_feeds_tp_workers(ranks, workers, tmp_path, name, mode):  # noqa: F811
    """2 FSDP2 ranks publish; 2 TP ranks each take their slices of every version: the
    full tensors their shards gather into are the trainer's full state dict."""
    procs, host, _, gate = _run(ranks, None, tmp_path, name, 2, "fsdp", root=True,
                                extra=("--workers", str(RANKS)))  # fmt: skip
    group = workers(name, mode, kind="shard-net")
    want = host.wait_for(_event("version", version=0), timeout=60)["digest"]
    for proc in group:
        assert proc.wait_for(_event("seen", version=0), timeout=120)["digest"] == want
    (gate / "0").touch()
    for version in range(1, 4):
        want = host.wait_for(_event("version", version=version), timeout=120)["digest"]
        for proc in group:
            seen = proc.wait_for(_event("seen", version=version), timeout=120)
            assert seen["digest"] == want, f"version {version} on rank {seen['rank']}"
        (gate / str(version)).touch()
    for proc in [*procs, *group]:
        assert proc.finish(60) == 0, (proc.cmd, proc.stderr[-3000:])
