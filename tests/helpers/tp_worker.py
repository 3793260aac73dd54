"""One rank of a tensor-parallel worker group (torch.distributed over gloo, CPU), for
the TP worker tests.

    RANK=r WORLD_SIZE=n MASTER_ADDR=127.0.0.1 MASTER_PORT=p \\
        python -m tests.helpers.tp_worker NAME copy|alias [tp|shard-net]

Every rank builds `TpNet` (`tests/helpers/tp_model.py`), parallelizes it (fc1
ColwiseParallel, fc2 RowwiseParallel, odd ColwiseParallel on an odd shape) and
subscribes with ``Subscriber(name=NAME, model=model, worker_id=f"tp{rank}")``. After
each version it prints its local shards (``to_local()``, as lists: float32 values are
exact in JSON) and the output of a forward pass of the TP model on a fixed input (a
collective: every rank runs it for every version, in order). With ``shard-net`` the
model is the sharded trainer's (`tests/helpers/shard_trainer.py`, fc1 and fc2 parallel
alike) and a version is reported as the digest of the full tensors the ranks' shards
gather into (``full_tensor()``, a collective), to compare with the trainer's own full
state dict. Once the publisher closes
the bus it prints its counters and exits 0. JSON lines on stdout; ZMQSYNC_NATIVE=0 in
its environment: the Python copies and follower.
"""

from __future__ import annotations

import json
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

import zmqsync
from tests.helpers.ranks import leave
from tests.helpers.shard_trainer import Net
from tests.helpers.tp_model import INPUT, TpNet
from zmqsync._checksum import digest
from zmqsync._layout import flatten


def _say(**record: object) -> None:
    print(json.dumps(record), flush=True)


def _locals(model: torch.nn.Module) -> dict[str, dict[str, object]]:
    out: dict[str, dict[str, object]] = {}
    with torch.no_grad():
        for key, param in model.named_parameters():
            local = param.to_local()  # type: ignore[operator]
            out[key] = {"values": local.tolist(), "ptr": local.data_ptr()}
    return out


def _gathered_digest(model: torch.nn.Module) -> str:
    """The digest of the model's full tensors, gathered from every rank's shards."""
    full = {
        key: t.full_tensor() if hasattr(t, "full_tensor") else t
        for key, t in model.state_dict().items()
    }
    return digest(flatten(full))


def main() -> int:
    name, mode = sys.argv[1], sys.argv[2]
    kind = sys.argv[3] if len(sys.argv) > 3 else "tp"
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    rank = dist.get_rank()
    model: torch.nn.Module = TpNet() if kind == "tp" else Net()
    plan = {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()}
    if kind == "tp":
        plan["odd"] = ColwiseParallel()
    parallelize_module(model, init_device_mesh("cpu", (dist.get_world_size(),)), plan)
    params = {key: id(p) for key, p in model.named_parameters()}
    reads = zmqsync.Aliases() if mode == "alias" else zmqsync.Copies()
    sub = zmqsync.Subscriber(name=name, model=model, reads=reads, worker_id=f"tp{rank}", timeout=60)
    with sub:
        reported = -1
        while not sub.stopped:
            if reported >= 0 and not sub.wait_for_version(reported + 1, timeout=1.0):
                continue
            reported = sub.version
            if kind != "tp":
                _say(event="seen", rank=rank, version=reported, digest=_gathered_digest(model))
                continue
            with torch.no_grad():
                out = model(INPUT)
            same = {key: id(p) for key, p in model.named_parameters()} == params
            _say(event="seen", rank=rank, version=reported, locals=_locals(model),
                 out=out.tolist(), same_params=same)  # fmt: skip
        counters = sub.counters
    _say(event="done", rank=rank, counters=counters)
    leave()


if __name__ == "__main__":
    sys.exit(main())
