"""A sharded trainer's publish, side by side with gathering it first: wall time and each
rank's peak memory, FSDP2 over 2 and 4 ranks (gloo, CPU), 64 MB to 1 GB.

    python -m tools.bench shards                       # 64, 256, 1024 MB; 2 and 4 ranks
    python -m tools.bench shards --sizes 64 --ranks 2  # one configuration
    python -m tools.bench shards --json out.json
    python -m tools.bench shards --plot docs/bench/shards.json   # shards.png beside it
    python -m tools.bench shards --apply             # a TP worker's copy vs a full one
    python -m tools.bench shards --readers --sizes 64 256   # TP workers' apply vs full ones

Two ways, alternating in one run, the same model and one copy-mode worker each:

* ``sharded``: every rank's ``Publisher(model)`` over the FSDP2 model; each rank writes
  its own shard into the slot (no gather).
* ``gather``: ``get_model_state_dict(full_state_dict=True, cpu_offload=True)`` on every
  rank (a collective that gathers the whole model into rank 0), then a plain
  ``Publisher.publish(weights=full)`` on rank 0: what a sharded trainer does without it.

The model is built on the meta device and materialized after ``fully_shard`` (no rank
ever holds it whole at start), as Linear(4096, 4096) layers of 64 MiB. Per configuration:
one warm-up publish, then --publishes timed ones, each after a barrier; rank 0's time
(the host's publish, or gather + publish) is reported as the median, with the slowest
rank's. Peak RSS is each rank's high-water mark (``VmHWM``) over the publishes only
(reset through ``/proc/self/clear_refs`` after the warm-up); it counts the pages of the
shared segment the rank wrote, which are not the rank's own. So the private memory
(``RssAnon``) is given beside it, its largest value sampled after each gather and each
publish (where a gathered copy is still held).

``--apply`` measures instead, in one process, the copy a tensor-parallel worker's apply
makes (its slice of every tensor) against a full worker's (`apply_main`); ``--readers``
the whole thing as a trainer sees it: a plain trainer's publish, every ack included, to
2 full workers against a 2-rank tensor-parallel worker group (`apply_workers_main`).

Each rank is this file run as ``--rank`` (torch.distributed's env: RANK, WORLD_SIZE,
MASTER_ADDR, MASTER_PORT); the worker is ``--worker``.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
import uuid
from datetime import timedelta
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
LAYER_MB = 64  # Linear(4096, 4096), float32, no bias


def _status_mb(field: str) -> float:
    """A field of /proc/self/status, in MB: VmHWM (peak RSS, shared memory pages this
    process touched included), RssAnon (its private memory now)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(f"{field}:"):
                return int(line.split()[1]) / 1024
    return -1.0


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:  # 5: reset the high-water mark
        f.write("5")


def _say(**record: Any) -> None:
    print(json.dumps(record), flush=True)


def rank_main(way: str, name: str, size_mb: int, publishes: int) -> int:
    """One rank: build the sharded model, publish `publishes` times one way, report."""
    import torch
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import zmqsync

    dist.init_process_group("gloo", timeout=timedelta(seconds=600))
    rank, world = dist.get_rank(), dist.get_world_size()
    with torch.device("meta"):
        model = torch.nn.Sequential(
            *(torch.nn.Linear(4096, 4096, bias=False) for _ in range(size_mb // LAYER_MB))
        )
    mesh = init_device_mesh("cpu", (world,))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu")
    with torch.no_grad():
        for p in model.parameters():
            p.to_local().normal_()
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)

    def gathered() -> dict[str, torch.Tensor]:
        return get_model_state_dict(model, options=options)

    pub: Any = None
    if way == "sharded":
        pub = zmqsync.Publisher(model, name=name, timeout=120).start()
    else:
        first = gathered()
        if rank == 0:
            pub = zmqsync.Publisher(first, name=name, timeout=120).start()
        del first
    if rank == 0:
        _say(event="started")
        pub.wait_for_workers(1, timeout=120)
    dist.barrier()
    times: list[float] = []
    private = 0.0  # the private memory's peak, sampled where it peaks: with the version held
    for i in range(publishes + 1):
        if i == 1:
            _reset_peak()
        dist.barrier()
        started = time.perf_counter()
        if way == "sharded":
            pub.publish()
        else:
            full = gathered()
            if rank == 0:
                pub.publish(weights=full)
            private = max(private, _status_mb("RssAnon"))
            del full
        if i:
            times.append(time.perf_counter() - started)
        private = max(private, _status_mb("RssAnon"))
    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, (times, _status_mb("VmHWM"), private))
    if rank == 0:
        _say(
            event="result",
            ms=[round(1e3 * statistics.median(t), 2) for t, _, _ in everyone],
            peak_rss_mb=[round(p, 1) for _, p, _ in everyone],
            private_mb=[round(p, 1) for _, _, p in everyone],
        )
    dist.barrier()
    if pub is not None:
        pub.close()
    dist.destroy_process_group()
    return 0


def worker_main(name: str) -> int:
    """A copy-mode worker: applies every version until its publisher closes."""
    import zmqsync

    with zmqsync.Subscriber(name=name, timeout=120) as sub:
        while not sub.stopped:
            sub.wait_for_version(sub.version + 1, timeout=1.0)
    return 0


def apply_main(sizes: list[int], ranks: list[int], repeats: int) -> list[dict[str, Any]]:
    """The copy a tensor-parallel worker's apply will make (its slice of each tensor, by
    `_shard_reads.slice_moves` and the native loop) vs a full worker's (every byte), in
    this process: layers alternate row shards (ColwiseParallel: one range) and column
    shards (RowwiseParallel: one range per row), as in a TP transformer."""
    import torch

    from zmqsync._copy import ByteCopies
    from zmqsync._shard_reads import slice_moves
    from zmqsync._shards import Piece
    from zmqsync._slices import Shard, local_shape

    rows = []
    for size_mb in sizes:
        layers = size_mb // LAYER_MB
        slot = [torch.randn(4096, 4096) for _ in range(layers)]  # the full tensors
        full = [torch.empty_like(t) for t in slot]
        whole = ByteCopies(
            [(d.data_ptr(), s.data_ptr(), s.nbytes) for d, s in zip(full, slot, strict=True)]
        )
        for n in ranks:
            pieces = [Piece((Shard(i % 2),), (n,), (0,)) for i in range(layers)]
            local = [
                torch.empty(local_shape(tuple(t.shape), p.placements, p.mesh, p.coordinate))
                for t, p in zip(slot, pieces, strict=True)
            ]
            moves = [m for v, d, p in zip(slot, local, pieces, strict=True)
                     for m in slice_moves(v, d, p)]  # fmt: skip
            sliced = ByteCopies(moves)
            times: dict[str, list[float]] = {"full": [], "slice": []}
            for _ in range(repeats):  # alternating, after one warm-up each
                for label, plan in (("full", whole), ("slice", sliced)):
                    plan.run()
                    started = time.perf_counter()
                    plan.run()
                    times[label].append(time.perf_counter() - started)
            rows.append({
                "size_mb": size_mb, "tp": n,
                "full_ms": round(1e3 * statistics.median(times["full"]), 2),
                "slice_ms": round(1e3 * statistics.median(times["slice"]), 2),
                "slice_mb": round(sum(m[2] for m in moves) / 2**20, 1),
            })  # fmt: skip
        del slot, full
    return rows


def _layers(size_mb: int) -> Any:
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(
        *(torch.nn.Linear(4096, 4096, bias=False) for _ in range(size_mb // LAYER_MB))
    )


def reader_main(kind: str, name: str, size_mb: int, mode: str) -> int:
    """A worker of `apply_workers_main`: "full" (a plain model) or "tp" (one rank of a
    2-rank tensor-parallel group: even layers ColwiseParallel, odd RowwiseParallel), in
    Copies() or Aliases(), until the publisher closes."""
    import zmqsync

    model = _layers(size_mb)
    worker_id = None
    if kind == "tp":
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            RowwiseParallel,
            parallelize_module,
        )

        dist.init_process_group("gloo", timeout=timedelta(seconds=600))
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        plan = {str(i): ColwiseParallel() if i % 2 == 0 else RowwiseParallel()
                for i in range(len(model))}  # fmt: skip
        parallelize_module(model, mesh, plan)
        worker_id = f"tp{dist.get_rank()}"
    reads = zmqsync.Aliases() if mode == "alias" else zmqsync.Copies()
    with zmqsync.Subscriber(
        name=name, model=model, reads=reads, worker_id=worker_id, timeout=120
    ) as sub:
        while not sub.stopped:
            sub.wait_for_version(sub.version + 1, timeout=1.0)
    return 0


def apply_workers_main(sizes: list[int], publishes: int) -> list[dict[str, Any]]:
    """A plain trainer's publish (every ack included) to 2 full workers against a 2-rank
    tensor-parallel worker group, in Copies() and Aliases(): what the workers' applies
    cost the trainer, side by side."""
    import torch

    import zmqsync

    rows = []
    me = [sys.executable, str(Path(__file__).resolve())]
    for size_mb in sizes:
        model = _layers(size_mb)
        for mode in ("copy", "alias"):
            for kind in ("full", "tp"):
                name = f"tpw{uuid.uuid4().hex[:6]}"
                port = str(_free_port())
                procs: list[subprocess.Popen[bytes]] = []
                try:
                    with zmqsync.Publisher(model, name=name, timeout=120) as pub:
                        for rank in range(2):
                            env = dict(os.environ, RANK=str(rank), WORLD_SIZE="2",
                                       MASTER_ADDR="127.0.0.1", MASTER_PORT=port)  # fmt: skip
                            argv = [*me, "--reader", kind, name, str(size_mb), mode]
                            procs.append(subprocess.Popen(argv, env=env, cwd=ROOT))
                        if not pub.wait_for_workers(2, timeout=180):
                            raise RuntimeError(f"{kind} workers did not join")
                        times = []
                        for i in range(publishes + 1):
                            with torch.no_grad():
                                model[0].weight.add_(1.0)
                            started = time.perf_counter()
                            pub.publish()
                            if i:
                                times.append(time.perf_counter() - started)
                    for proc in procs:  # they leave once the bus closed
                        proc.wait(timeout=60)
                finally:
                    for proc in procs:
                        if proc.poll() is None:
                            proc.kill()
                            proc.wait(timeout=30)
                rows.append({"size_mb": size_mb, "mode": mode, "workers": kind,
                             "ms": round(1e3 * statistics.median(times), 2)})  # fmt: skip
        del model
    return rows


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_one(way: str, size_mb: int, ranks: int, publishes: int) -> dict[str, Any]:
    """Start `ranks` ranks and a worker for one way and size; their result line."""
    name = f"shards{uuid.uuid4().hex[:6]}"
    port = str(_free_port())
    me = [sys.executable, str(Path(__file__).resolve())]
    procs = []
    for rank in range(ranks):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(ranks), MASTER_PORT=port)
        env.update(MASTER_ADDR="127.0.0.1", LOCAL_RANK=str(rank))
        args = ["--rank", way, name, str(size_mb), str(publishes)]
        out = subprocess.PIPE if rank == 0 else subprocess.DEVNULL
        procs.append(subprocess.Popen([*me, *args], env=env, stdout=out, text=True, cwd=ROOT))
    worker = None
    try:
        host = procs[0]
        assert host.stdout is not None
        result: dict[str, Any] = {}
        for line in host.stdout:
            record = json.loads(line) if line.startswith("{") else {}
            if record.get("event") == "started":
                worker = subprocess.Popen([*me, "--worker", name], cwd=ROOT)
            elif record.get("event") == "result":
                result = record
        for proc in procs:
            proc.wait(timeout=600)
        if not result:
            raise RuntimeError(f"{way} {size_mb} MB on {ranks} ranks reported nothing")
        return {"way": way, "size_mb": size_mb, "ranks": ranks, **result}
    finally:
        for proc in [*procs, worker]:
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait(timeout=30)


def plot(rows_json: Path) -> Path:
    """The sharded publish against gathering first, from a ``--json`` run: wall time and
    the private memory of the rank that holds the most, per size and rank count."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = json.loads(rows_json.read_text())
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for ranks, marker in ((2, "o"), (4, "s")):
        for way, style in (("sharded", "-"), ("gather", "--")):
            mine = sorted(
                (r for r in rows if r["ranks"] == ranks and r["way"] == way),
                key=lambda r: r["size_mb"],
            )
            if not mine:
                continue
            sizes = [r["size_mb"] for r in mine]
            label = f"{way}, {ranks} ranks"
            left.plot(sizes, [r["ms"][0] for r in mine], style, marker=marker, label=label)
            right.plot(
                sizes, [max(r["private_mb"]) for r in mine], style, marker=marker, label=label
            )
    for ax, what in ((left, "publish, rank 0 (ms)"), (right, "largest rank's private memory (MB)")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("model (MB)")
        ax.set_ylabel(what)
        ax.grid(True, which="both", alpha=0.3)
    left.legend(fontsize=8)
    fig.suptitle("A sharded trainer's publish vs get_model_state_dict(full) + publish")
    fig.tight_layout()
    out = rows_json.with_suffix(".png")
    fig.savefig(out, dpi=110)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.bench shards", description=__doc__)
    p.add_argument("--sizes", type=int, nargs="+", default=[64, 256, 1024], help="MB")
    p.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    p.add_argument("--publishes", type=int, default=5)
    p.add_argument("--json", default=None, help="write the rows here too")
    p.add_argument("--plot", metavar="JSON", help="draw a --json run's rows (needs matplotlib)")
    p.add_argument(
        "--apply", action="store_true", help="instead: a TP worker's slice copy vs a full copy"
    )
    p.add_argument("--rank", nargs=4, metavar=("WAY", "NAME", "MB", "N"), help=argparse.SUPPRESS)
    p.add_argument("--worker", metavar="NAME", help=argparse.SUPPRESS)
    p.add_argument(
        "--reader", nargs=4, metavar=("KIND", "NAME", "MB", "MODE"), help=argparse.SUPPRESS
    )
    p.add_argument(
        "--readers",
        action="store_true",
        help="instead: a publish to 2 full workers vs a 2-rank TP worker group",
    )
    args = p.parse_args(argv)
    if args.plot:
        print(plot(Path(args.plot)))
        return 0
    if args.rank:
        way, name, size_mb, n = args.rank
        return rank_main(way, name, int(size_mb), int(n))
    if args.worker:
        return worker_main(args.worker)
    if args.reader:
        kind, name, size_mb, mode = args.reader
        return reader_main(kind, name, int(size_mb), mode)
    if args.readers:
        print(f"{'MB':>5} {'mode':>6} {'2 full workers ms':>18} {'2-rank TP group ms':>19}")
        rows = apply_workers_main(args.sizes, args.publishes)
        for size_mb in args.sizes:
            for mode in ("copy", "alias"):
                got = {r["workers"]: r["ms"] for r in rows
                       if r["size_mb"] == size_mb and r["mode"] == mode}  # fmt: skip
                print(f"{size_mb:>5} {mode:>6} {got['full']:>18.1f} {got['tp']:>19.1f}", flush=True)
        if args.json:
            Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")
        return 0
    if args.apply:
        print(f"{'MB':>5} {'TP':>3} {'full copy ms':>12} {'slice copy ms':>13} {'slice MB':>9}")
        for row in apply_main(args.sizes, args.ranks, args.publishes):
            print(
                f"{row['size_mb']:>5} {row['tp']:>3} {row['full_ms']:>12.1f} "
                f"{row['slice_ms']:>13.1f} {row['slice_mb']:>9.1f}",
                flush=True,
            )
        return 0
    rows = []
    print(
        f"{'ranks':>5} {'MB':>5} {'way':>8} {'rank 0 ms':>10} {'slowest ms':>10}  "
        "per rank: peak RSS MB (private MB)"
    )
    for ranks in args.ranks:
        for size_mb in args.sizes:
            for way in ("sharded", "gather"):  # side by side, the same model and worker
                row = run_one(way, size_mb, ranks, args.publishes)
                rows.append(row)
                rss = " ".join(
                    f"{v:.0f} ({p:.0f})"
                    for v, p in zip(row["peak_rss_mb"], row["private_mb"], strict=True)
                )
                print(
                    f"{ranks:>5} {size_mb:>5} {way:>8} {row['ms'][0]:>10.1f} "
                    f"{max(row['ms']):>10.1f}  {rss}",
                    flush=True,
                )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
