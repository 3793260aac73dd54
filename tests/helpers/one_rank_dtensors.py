"""DTensor cases in a world of one rank (gloo), each reported as one JSON line.

    python tests/helpers/one_rank_dtensors.py NAME

A world of one is enough to check what a DTensor publisher refuses, by name, without a
crash: a Partial placement, another `writes=` than Copy(), ``publish(keys=...)``; that a
one-rank mesh publishes as any bus, and that a worker whose model holds DTensors takes
its slice.
"""

from __future__ import annotations

import json
import socket
import sys

import torch
import torch.distributed as dist


def _say(case: str, exc: BaseException | None = None, **more: object) -> None:
    record = {"case": case, "error": None if exc is None else f"{type(exc).__name__}: {exc}"}
    print(json.dumps({**record, **more}), flush=True)


def main() -> int:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Shard

    import zmqsync

    name = sys.argv[1]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    mesh = init_device_mesh("cpu", (1,))
    full = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    sharded = {"w": DTensor.from_local(full.clone(), mesh, [Shard(0)]), "b": torch.ones(2)}
    partial = {"w": DTensor.from_local(full.clone(), mesh, [Partial()])}

    try:
        zmqsync.Publisher(partial, name=f"{name}p")
        _say("partial")
    except Exception as exc:  # reported, the test reads it
        _say("partial", exc)
    try:
        zmqsync.Publisher(sharded, name=f"{name}w", writes=zmqsync.Live())
        _say("live")
    except Exception as exc:
        _say("live", exc)
    with zmqsync.Publisher(sharded, name=name, timeout=10) as pub:
        try:
            pub.publish(keys=["b"])
            _say("keys")
        except Exception as exc:
            _say("keys", exc)
        worker = torch.nn.Linear(4, 3)
        worker.weight = torch.nn.Parameter(DTensor.from_local(full.clone(), mesh, [Shard(0)]))
        sub = zmqsync.Subscriber(name=name, timeout=10)
        sub.start()
        sharded["w"].to_local().add_(1)
        pub.publish()
        got = sub.wait_for_version(pub.version, timeout=10)
        same = bool(torch.equal(sub.weights["w"], full + 1))
        sub.close()
        _say("one-rank", version=pub.version, applied=got, same=same)
        try:  # a worker's model of DTensors takes its slice (here: all of it)
            model = {"w": worker.weight, "b": torch.zeros(2)}
            with zmqsync.Subscriber(name=name, model=model, timeout=10):
                with torch.no_grad():
                    took = bool(torch.equal(worker.weight.to_local(), full + 1))
            _say("worker", took=took)
        except Exception as exc:
            _say("worker", exc)
        try:  # alias mode rebinds a module's own DTensor shards: a dict has none
            zmqsync.Subscriber(name=name, model=model, reads=zmqsync.Aliases(), timeout=10).start()
            _say("alias-dict")
        except Exception as exc:
            _say("alias-dict", exc)
        holder = torch.nn.Module()
        holder.w = worker.weight
        holder.register_buffer("b", torch.zeros(2))
        with torch.no_grad():
            own = holder.w.to_local().data_ptr()  # the shard's own memory, before
        with zmqsync.Subscriber(name=name, model=holder, reads=zmqsync.Aliases(), timeout=10):
            with torch.no_grad():
                local = holder.w.to_local()
                took = bool(torch.equal(local, full + 1)) and holder.w is worker.weight
            _say("alias-module", took=took, view=local.data_ptr() != own)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
