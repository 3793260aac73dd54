"""One rank of a tensor-parallel worker group (torch.distributed over gloo, CPU), for
the TP worker tests.

    RANK=r WORLD_SIZE=n MASTER_ADDR=127.0.0.1 MASTER_PORT=p \\
        python -m tests.helpers.tp_worker NAME copy|alias

Every rank builds `TpNet` (`tests/helpers/tp_model.py`), parallelizes it (fc1
ColwiseParallel, fc2 RowwiseParallel, odd ColwiseParallel on an odd shape) and
subscribes with ``Subscriber(name=NAME, model=model, worker_id=f"tp{rank}")``. After
each version it prints its local shards (``to_local()``, as lists: float32 values are
exact in JSON) and the output of a forward pass of the TP model on a fixed input (a
collective: every rank runs it for every version, in order). Once the publisher closes
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
from tests.helpers.tp_model import INPUT, TpNet


def _say(**record: object) -> None:
    print(json.dumps(record), flush=True)


def _locals(model: torch.nn.Module) -> dict[str, dict[str, object]]:
    out: dict[str, dict[str, object]] = {}
    with torch.no_grad():
        for key, param in model.named_parameters():
            local = param.to_local()  # type: ignore[operator]
            out[key] = {"values": local.tolist(), "ptr": local.data_ptr()}
    return out


def main() -> int:
    name, mode = sys.argv[1], sys.argv[2]
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    rank = dist.get_rank()
    model = TpNet()
    plan = {"fc1": ColwiseParallel(), "fc2": RowwiseParallel(), "odd": ColwiseParallel()}
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
            with torch.no_grad():
                out = model(INPUT)
            same = {key: id(p) for key, p in model.named_parameters()} == params
            _say(event="seen", rank=rank, version=reported, locals=_locals(model),
                 out=out.tolist(), same_params=same)  # fmt: skip
        counters = sub.counters
    _say(event="done", rank=rank, counters=counters)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
