"""One rank of a sharded trainer (torch.distributed over gloo, CPU), for the shard tests.

    RANK=r WORLD_SIZE=n MASTER_ADDR=127.0.0.1 MASTER_PORT=p \\
        python -m tests.helpers.shard_trainer NAME --kind fsdp|tp|2d --steps K \\
        [--workers W] [--gate DIR] [--die-at V] [--stall-at V] [--victim R] [--timeout S]
        [--bf16]

Every rank builds the same model (dims that do not divide by the ranks), shards it
(FSDP2's fully_shard, tensor parallel, or both on a 2D mesh), builds
``Publisher(model, name=NAME)`` and starts it; then K times: a real training step
(forward, backward, SGD, buffers changed), ``publish()``, and rank 0 prints the digest
of the trainer's own full state dict (``get_model_state_dict(full_state_dict=True)``)
for that version. With --gate, rank 0 then waits for DIR/<version> (the test makes it
once a worker showed that version) before every rank goes on, and for DIR/0 before the
first step.

A Publisher refused at construction is reported as {"event": "refused"} (exit 4).
--die-at V: rank --victim SIGKILLs itself instead of publishing version V. --stall-at V:
it sleeps instead, for a long while. The others report {"event": "failed"} with the
error and exit. JSON lines on stdout; rank 0 prints "started" first.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

import zmqsync
from tests.helpers.ranks import leave
from zmqsync._checksum import digest
from zmqsync._layout import flatten


class Net(torch.nn.Module):
    """norm(13) -> fc1(13 -> 30) -> relu -> fc2(30 -> 7), and two buffers."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(13)
        self.fc1 = torch.nn.Linear(13, 30)
        self.fc2 = torch.nn.Linear(30, 7)
        self.register_buffer("steps", torch.zeros((), dtype=torch.int64))
        self.register_buffer("scale", torch.ones(5, dtype=torch.bfloat16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(self.norm(x))))


def _say(**record: object) -> None:
    print(json.dumps(record), flush=True)


def _shard(model: Net, kind: str, world: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    plan = {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()}
    if kind == "fsdp":
        mesh = init_device_mesh("cpu", (world,))
        fully_shard(model.fc1, mesh=mesh)
        fully_shard(model.fc2, mesh=mesh)
        fully_shard(model, mesh=mesh)
    elif kind == "tp":
        parallelize_module(model, init_device_mesh("cpu", (world,)), plan)
    else:  # 2d: FSDP over dp, TP inside
        mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "tp"))
        parallelize_module(model, mesh["tp"], plan)
        fully_shard(model, mesh=mesh["dp"])


def _full_digest(model: Net, dtype: torch.dtype | None = None) -> str | None:
    """The trainer's own full state dict (a collective), hashed on rank 0; `dtype`: its
    floating tensors cast first, as ``Copy(dtype=...)`` publishes them."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    full = get_model_state_dict(model, options=options)
    if dtype is not None:
        full = {k: v.to(dtype) if v.is_floating_point() else v for k, v in full.items()}
    return digest(flatten(full)) if dist.get_rank() == 0 else None


def _step(model: Net, opt: torch.optim.Optimizer, step: int, kind: str) -> None:
    """A training step: forward, backward, SGD; for tensor parallel alone, a direct
    update of each rank's shards (DTensor's forward refuses the uneven column shards
    this model has on 4 ranks, which are the point of the test)."""
    g = torch.Generator().manual_seed(step)
    if kind != "tp":
        x = torch.randn(8, 13, generator=g)
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
    with torch.no_grad():
        if kind == "tp":
            for i, p in enumerate(model.parameters()):  # a replica gets the same update
                local = p.to_local() if hasattr(p, "to_local") else p
                gen = torch.Generator().manual_seed(1000 * step + i)
                local.add_(torch.randn(local.shape, generator=gen))
        model.steps += 1
        model.scale.mul_(1.5)


def _gate(directory: str, version: int, timeout: float = 60.0) -> None:
    end = time.monotonic() + timeout
    while not os.path.exists(os.path.join(directory, str(version))):
        if time.monotonic() > end:
            raise TimeoutError(f"no gate for version {version} within {timeout} s")
        time.sleep(0.01)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("name")
    p.add_argument("--kind", choices=("fsdp", "tp", "2d"), default="fsdp")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--gate", default=None)
    p.add_argument("--die-at", type=int, default=None)
    p.add_argument("--stall-at", type=int, default=None)
    p.add_argument("--victim", type=int, default=1)
    p.add_argument("--timeout", type=float, default=30.0)
    p.add_argument("--bf16", action="store_true", help="publish with Copy(dtype=bfloat16)")
    args = p.parse_args()

    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = Net()
    _shard(model, args.kind, world)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    try:
        dtype = torch.bfloat16 if args.bf16 else None
        writes = zmqsync.Copy(dtype=dtype)
        pub = zmqsync.Publisher(model, name=args.name, timeout=args.timeout, writes=writes)
        pub.start()
    except (TypeError, NotImplementedError) as exc:  # refused, on every rank alike
        _say(event="refused", rank=rank, error=str(exc), kind=type(exc).__name__)
        # No teardown of the group: the other rank is leaving at the same moment, and
        # gloo's destructor may abort on a peer that already closed (SIGABRT under load).
        sys.stdout.flush()
        os._exit(4)
    d0 = _full_digest(model, dtype)
    if rank == 0:
        kinds = sorted({type(t).__name__ for t in flatten(model, sharded=True).values()})
        _say(event="started", rank=rank, pid=os.getpid(), kinds=kinds, bus=pub.bus_id)
        _say(event="version", version=0, digest=d0)
        pub.wait_for_workers(args.workers, timeout=60)
        if args.gate:  # and the test's own worker, when the worker is a relay root
            _gate(args.gate, 0)
    dist.barrier()
    for step in range(1, args.steps + 1):
        _step(model, opt, step, args.kind)
        if rank == args.victim and step == args.die_at:
            os.kill(os.getpid(), signal.SIGKILL)
        if rank == args.victim and step == args.stall_at:
            time.sleep(600)
        try:
            handle = pub.publish()
        except zmqsync.ZmqSyncError as exc:
            _say(event="failed", rank=rank, version=step, error=str(exc), kind=type(exc).__name__)
            pub.close()
            sys.stdout.flush()
            os._exit(3)  # the group lost a rank: no collective can complete any more
        d = _full_digest(model, dtype)
        if rank == 0:
            _say(event="version", version=handle.version, digest=d, acked=list(handle.acked))
            if args.gate:
                _gate(args.gate, handle.version)
        dist.barrier()
    pub.close()
    _say(event="done", rank=rank)
    leave()


if __name__ == "__main__":
    sys.exit(main())
