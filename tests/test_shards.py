"""Sharded trainers publish collectively: real ranks (torch.distributed over gloo on
localhost), FSDP2, tensor parallel and both, each rank writing only its shards; plain
workers get versions bit-exact against the trainer's own full state dict; a rank that
dies or stalls fails the publish on the others, and workers keep the last version.

The ranks are `tests/helpers/shard_trainer.py`, the worker `tests/helpers/digest_worker.py`.
"""

from __future__ import annotations

import os
import shutil
import socket
import sys

import pytest

from tests.conftest import Proc
from zmqsync._buffers import collect_garbage

pytestmark = [pytest.mark.timeout(240), pytest.mark.slow]

TRAINER = ("-m", "tests.helpers.shard_trainer")
WORKER = "tests/helpers/digest_worker.py"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def ranks():
    """launch(n, *args) -> the n rank processes of one trainer, killed at teardown."""
    procs: list[Proc] = []

    def launch(n: int, *args: str, wrap: dict[int, list[str]] | None = None) -> list[Proc]:
        """`wrap`: a command to run some ranks under (rank -> its argv prefix)."""
        port = str(_free_port())
        for rank in range(n):
            env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(n), LOCAL_RANK=str(rank))
            env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, OMP_NUM_THREADS="1")
            prefix = (wrap or {}).get(rank, [])
            procs.append(Proc([*prefix, sys.executable, *TRAINER, *args], env))
        return procs[-n:]

    yield launch
    for proc in procs:
        proc.kill()


def _event(name: str, **fields: object):
    return lambda r: r.get("event") == name and all(r.get(k) == v for k, v in fields.items())


def _run(ranks, spawn, tmp_path, name, n, kind, mode="copy", steps=3, extra=(), root=False):
    """Start the ranks and one worker (`root`: none, the caller starts a relay root);
    gate every version on the worker having it."""
    gate = tmp_path / "gate"
    gate.mkdir()
    procs = ranks(n, name, "--kind", kind, "--steps", str(steps), "--gate", str(gate), *extra)
    host = procs[0]
    started = host.wait_for(_event("started"), timeout=120)
    assert started["kinds"] == ["DTensor", "Tensor"]
    worker = None if root else spawn(WORKER, name, mode, module="")
    return procs, host, worker, gate


def _check_versions(host: Proc, worker: Proc, gate, versions) -> None:
    worker.wait_for(_event("ready"), timeout=120)
    (gate / "0").touch()  # the trainer publishes version 1 once the worker is there
    for version in versions:
        want = host.wait_for(_event("version", version=version), timeout=120)["digest"]
        seen = worker.wait_for(_event("seen", version=version), timeout=120)
        assert seen["digest"] == want, f"version {version} differs from full_state_dict"
        (gate / str(version)).touch()


CASES = [
    pytest.param(2, "fsdp", "copy", id="fsdp2-2ranks-copy"),
    pytest.param(4, "fsdp", "alias", id="fsdp2-4ranks-alias"),
    pytest.param(2, "tp", "copy", id="tp-2ranks-copy"),
    pytest.param(4, "tp", "alias", id="tp-4ranks-alias"),
    pytest.param(4, "2d", "copy", id="fsdp-x-tp-2x2-copy"),
]


@pytest.mark.parametrize(("n", "kind", "mode"), CASES)
def test_every_version_is_the_trainers_full_state_dict(ranks, spawn, tmp_path, name, n, kind, mode):
    procs, host, worker, gate = _run(ranks, spawn, tmp_path, name, n, kind, mode)
    # version 0 (start) arrives before the first publish: the worker shows it as ready
    ready = worker.wait_for(_event("ready"), timeout=60)
    assert ready["version"] == 0
    _check_versions(host, worker, gate, range(1, 4))
    for proc in procs:
        proc.wait_for(_event("done"), timeout=60)
        assert proc.finish(30) == 0, proc.stderr[-2000:]


def test_a_sharded_publish_cast_to_bf16(ranks, spawn, tmp_path, name):
    """Copy(dtype=torch.bfloat16): each rank casts its own shard on the way; every version
    is the trainer's full state dict cast to bf16, bit for bit."""
    procs, host, worker, gate = _run(ranks, spawn, tmp_path, name, 2, "fsdp",
                                     extra=("--bf16",))  # fmt: skip
    _check_versions(host, worker, gate, range(1, 4))
    for proc in procs:
        assert proc.finish(60) == 0, proc.stderr[-2000:]


@pytest.mark.parametrize("n", [2, 4])
def test_a_rank_killed_mid_publish_fails_it_on_every_other_rank(ranks, spawn, tmp_path, name, n):
    procs, host, worker, gate = _run(
        ranks, spawn, tmp_path, name, n, "fsdp", extra=("--die-at", "2", "--timeout", "20")
    )
    _check_versions(host, worker, gate, [1])
    others = [procs[0], *procs[2:]]
    for proc in others:
        failed = proc.wait_for(_event("failed", version=2), timeout=60)
        assert failed["kind"] == "RanksFailed"
        assert (
            "rank 1" in failed["error"]
            and "workers keep the last complete version" in (failed["error"])
        )
    assert "died" in procs[0].wait_for(_event("failed"))["error"]
    assert procs[1].finish(30) == -9
    # the worker never saw version 2, and holds version 1 whole
    assert worker.finish(60) == 0
    assert max(r["version"] for r in worker.records if r.get("event") == "seen") == 1


def test_a_stalled_rank_fails_the_publish_at_the_deadline(ranks, spawn, tmp_path, name):
    procs, host, worker, gate = _run(
        ranks, spawn, tmp_path, name, 2, "fsdp", extra=("--stall-at", "2", "--timeout", "3")
    )
    _check_versions(host, worker, gate, [1])
    failed = host.wait_for(_event("failed", version=2), timeout=60)
    assert "did not write their shards within 3.0 s" in failed["error"], failed
    procs[1].kill()
    assert worker.finish(60) == 0
    assert max(r["version"] for r in worker.records if r.get("event") == "seen") == 1


def test_a_host_killed_mid_publish_fails_it_on_the_other_ranks(
    ranks, spawn, tmp_path, name, bus_dirs
):
    procs, host, worker, gate = _run(
        ranks, spawn, tmp_path, name, 2, "fsdp",
        extra=("--die-at", "2", "--victim", "0", "--timeout", "20"),
    )  # fmt: skip
    _check_versions(host, worker, gate, [1])
    failed = procs[1].wait_for(_event("failed", version=2), timeout=60)
    assert "the host rank (pid" in failed["error"] and "died" in failed["error"], failed
    assert host.finish(30) == -9
    assert procs[1].finish(30) == 3
    # the worker keeps version 1 whole; the killed host's segment is garbage once no
    # rank maps it any more
    worker.kill()
    assert max(r["version"] for r in worker.records if r.get("event") == "seen") == 1
    _, shm = bus_dirs
    assert collect_garbage(str(shm))


def test_relays_carry_a_sharded_trainers_versions(ranks, spawn, tmp_path, name, bus_dirs):
    """The sharded trainer's bus is fed to a relay root; "host B" (its own runtime and shm
    dirs) runs a relay and a plain worker, which gets every version bit-exact."""
    procs, host, worker, gate = _run(ranks, spawn, tmp_path, name, 2, "fsdp", root=True)
    root = spawn(
        "relay", "--root", "--name", name, "--init-method", "tcp://127.0.0.1:0",
        "--ack", "relays", "--json",
    )  # fmt: skip
    url = root.wait_for(_event("started"), timeout=60)["init_method"]
    runtime, shm = bus_dirs
    elsewhere = {"ZMQSYNC_RUNTIME_DIR": str(runtime / "hostB"), "ZMQSYNC_SHM_DIR": f"{shm}-hostB"}
    os.makedirs(elsewhere["ZMQSYNC_RUNTIME_DIR"], mode=0o700)
    os.makedirs(elsewhere["ZMQSYNC_SHM_DIR"], mode=0o700)
    env = dict(os.environ, **elsewhere)
    relay = Proc([sys.executable, "-m", "zmqsync", "relay", "--name", name, "--relay-id",
                  "hostB", "--init-method", url, "--json"], env)  # fmt: skip
    far = Proc([sys.executable, WORKER, name, "copy"], env)
    try:
        _check_versions(host, far, gate, range(1, 4))
        for proc in procs:
            assert proc.finish(60) == 0, proc.stderr[-2000:]
    finally:
        for proc in (far, relay):
            proc.kill()
        collect_garbage(elsewhere["ZMQSYNC_SHM_DIR"])
        os.rmdir(elsewhere["ZMQSYNC_SHM_DIR"])


@pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("unshare") is None,
    reason="needs root and unshare(1), for a rank with a host name of its own",
)
def test_a_mesh_spanning_hosts_is_refused_on_every_rank_in_one_line(ranks, name):
    """Rank 1 runs in a UTS namespace of its own (another host name; the network and the
    shared memory are still this host's, so gloo connects): both ranks are told, by the
    tensor's name, before any segment exists."""
    other = ["unshare", "--uts", "sh", "-c", 'hostname elsewhere && exec "$0" "$@"']
    procs = ranks(2, name, "--workers", "0", wrap={1: other})
    for proc in procs:
        refused = proc.wait_for(_event("refused"), timeout=120)
        assert refused["kind"] == "TypeError"
        error = refused["error"]
        assert error.startswith("'norm.weight' is a DTensor whose mesh spans 2 hosts (")
        assert "elsewhere" in error and "docs/multi-host.md" in error and "\n" not in error
        assert proc.finish(60) == 4
