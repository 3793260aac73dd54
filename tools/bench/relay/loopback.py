"""Relay throughput against a raw torch.distributed broadcast of the same bytes.

One root process (this one: a Publisher and a RelayRoot) and two relay processes (this
script with ``--role relay``, each with its own runtime and shm dirs, as on another
host) take part, over gloo on loopback. For every size, in the same run and interleaved
round by round:

* **raw**: a gloo ``broadcast`` of a flat uint8 tensor of that size from the root to both
  relay processes (chunked like the relay, on a process group of its own), followed by
  a one-element all-reduce so that the time covers delivery to both;
* **relay**: the trainer publishes a version of that size; the time is the relay root's
  own measurement (`Relayed.seconds`): from the moment its subscriber holds the version
  to the moment both relays reported it announced on their own buses (``ack="relays"``):
  sends and notices, the chunks received straight into a free slot of each relay's bus,
  header checks, the relays' publishes and their reports. The trainer's ``publish()`` time (its copy
  into the root slot, then all of the above) is reported as well.

    python -m tools.bench relay loopback --sizes 1,4,16,64,256 --reps 5 --rounds 4 \\
        --out bench-relay.json

Medians are reported; on a loaded machine compare the two columns of one run only.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))

import zmqsync  # noqa: E402
from zmqsync.relay._wire import gloo_devices  # noqa: E402

TIMEOUT = datetime.timedelta(seconds=120)


def _raw_group(store: dist.Store, rank: int) -> dist.ProcessGroup:
    opts = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
    opts._timeout = TIMEOUT
    opts._devices = gloo_devices("127.0.0.1")
    return dist.ProcessGroupGloo(dist.PrefixStore("bench/raw/", store), rank, 3, opts)  # type: ignore[attr-defined]


def _raw_round(pg: dist.ProcessGroup, buf: torch.Tensor, chunk: int) -> None:
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    pending = []
    for off in range(0, buf.numel(), chunk):
        pending.append(pg.broadcast([buf[off : off + chunk]], opts))
        if len(pending) >= 2:  # as the relay does: two chunks in flight
            pending.pop(0).wait()
    for work in pending:
        work.wait()
    pg.allreduce([torch.zeros(1)]).wait()


def _command(store: dist.Store, index: int, cmd: dict) -> None:
    store.set(f"bench/cmd/{index}", json.dumps(cmd))


def _relay_main(args: argparse.Namespace) -> int:
    store = dist.TCPStore("127.0.0.1", args.bench_port, None, False, TIMEOUT)  # type: ignore[attr-defined]
    pg = _raw_group(store, args.rank)
    relay: zmqsync.Relay | None = None
    buf: torch.Tensor | None = None
    index = 0
    try:
        while True:
            key = f"bench/cmd/{index}"
            while not store.check([key]):  # poll: keep the GIL free for the relay's threads
                time.sleep(0.02)
            cmd = json.loads(store.get(key))
            index += 1
            if cmd["op"] == "stop":
                return 0
            if cmd["op"] == "join":
                if relay is not None:
                    relay.close()
                relay = zmqsync.Relay(
                    name=cmd["name"],
                    tree=zmqsync.Branch(cmd["init_method"], relay_id=f"bench{args.rank}"),
                    timeout=60,
                    heartbeat=0.5,
                ).start()
            elif cmd["op"] == "raw":
                if buf is None or buf.numel() != cmd["nbytes"]:
                    buf = torch.zeros(cmd["nbytes"], dtype=torch.uint8)  # faulted in once
                for _ in range(cmd["reps"]):
                    _raw_round(pg, buf, cmd["chunk"])
                store.set(f"bench/raw-done/{args.rank}/{index}", str(int(buf[-1])))
            elif cmd["op"] == "report":
                version = relay.version if relay is not None else -1
                store.set(f"bench/version/{args.rank}", str(version))
    finally:
        if relay is not None:
            relay.close()


def _spawn_relays(bench_port: int, base: Path) -> list[subprocess.Popen[bytes]]:
    procs = []
    for rank in (1, 2):
        runtime, shm = base / f"run{rank}", Path(f"/dev/shm/{base.name}-h{rank}")
        runtime.mkdir(mode=0o700)
        shm.mkdir(mode=0o700)
        env = dict(os.environ, ZMQSYNC_RUNTIME_DIR=str(runtime), ZMQSYNC_SHM_DIR=str(shm))
        cmd = [sys.executable, __file__, "--role", "relay", "--rank", str(rank)]
        cmd += ["--bench-port", str(bench_port)]
        procs.append(subprocess.Popen(cmd, env=env, cwd=ROOT))
    return procs


def _median_gbs(nbytes: int, seconds: list[float]) -> float:
    return nbytes / statistics.median(seconds) / 1e9


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--role", choices=("root", "relay"), default="root")
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--bench-port", type=int, default=0)
    p.add_argument("--sizes", default="4,64,256", help="MiB, comma-separated")
    p.add_argument("--reps", type=int, default=5, help="measurements per round and method")
    p.add_argument("--rounds", type=int, default=3, help="raw/relay alternations per size")
    p.add_argument("--chunk-mb", type=float, default=16.0)
    p.add_argument("--out", default=None, help="write the results as JSON here")
    args = p.parse_args(argv)
    if args.role == "relay":
        return _relay_main(args)

    base = Path(tempfile.mkdtemp(prefix="zsbr", dir="/tmp"))
    os.environ["ZMQSYNC_RUNTIME_DIR"] = str(base / "root")
    os.environ["ZMQSYNC_SHM_DIR"] = f"/dev/shm/{base.name}-root"
    os.makedirs(os.environ["ZMQSYNC_RUNTIME_DIR"], mode=0o700)
    os.makedirs(os.environ["ZMQSYNC_SHM_DIR"], mode=0o700)
    store = dist.TCPStore("127.0.0.1", 0, None, True, TIMEOUT, wait_for_workers=False)  # type: ignore[attr-defined]
    procs = _spawn_relays(store.port, base)
    chunk = int(args.chunk_mb * 2**20)
    results = []
    index = 0
    try:
        pg = _raw_group(store, 0)
        for size_mb in (float(s) for s in args.sizes.split(",")):
            nbytes = int(size_mb * 2**20)
            name = f"bench{int(size_mb)}"
            raw_buf = torch.ones(nbytes, dtype=torch.uint8)
            payload = {"w": torch.zeros(nbytes, dtype=torch.uint8)}
            raw_s: list[float] = []
            relay_s: list[float] = []
            publish_s: list[float] = []
            with (
                zmqsync.Publisher(payload, name=name, timeout=120) as pub,
                zmqsync.RelayRoot(
                    name=name,
                    tree=zmqsync.Tree(
                        "tcp://127.0.0.1:0", chunk_mb=args.chunk_mb, collective_timeout=30
                    ),
                    ack="relays",
                    timeout=60,
                ) as root,
            ):
                _command(
                    store, index, {"op": "join", "name": name, "init_method": root.init_method_url}
                )
                index += 1
                if not root.wait_for_relays(2, timeout=120):
                    raise SystemExit(f"relays did not join: {root.relays}")
                version = 0
                for rnd in range(args.rounds + 1):  # round 0 warms both paths up
                    _command(
                        store,
                        index,
                        {"op": "raw", "nbytes": nbytes, "reps": args.reps, "chunk": chunk},
                    )
                    index += 1
                    for _ in range(args.reps):
                        t0 = time.perf_counter()
                        _raw_round(pg, raw_buf, chunk)
                        if rnd:
                            raw_s.append(time.perf_counter() - t0)
                    for _ in range(args.reps):
                        version += 1
                        payload["w"][:8] = version  # different bytes each version
                        t0 = time.perf_counter()
                        handle = pub.publish(weights=payload)
                        elapsed = time.perf_counter() - t0
                        assert not handle.missing and root.last is not None
                        assert root.last.version == version and not root.last.missing
                        if rnd:
                            relay_s.append(root.last.seconds)
                            publish_s.append(elapsed)
                _command(store, index, {"op": "report"})
                index += 1
                for rank in (1, 2):
                    got = store.get(f"bench/version/{rank}").decode()
                    assert int(got) == version, f"relay {rank} holds version {got}, not {version}"
                    store.delete_key(f"bench/version/{rank}")
            row = {
                "size_mib": size_mb,
                "samples": len(raw_s),
                "raw_gbs": _median_gbs(nbytes, raw_s),
                "relay_gbs": _median_gbs(nbytes, relay_s),
                "ratio": statistics.median(raw_s) / statistics.median(relay_s),
                "raw_ms": statistics.median(raw_s) * 1e3,
                "relay_ms": statistics.median(relay_s) * 1e3,
                "publish_ms": statistics.median(publish_s) * 1e3,
            }
            results.append(row)
            print(
                f"{size_mb:7.0f} MiB  raw {row['raw_ms']:8.1f} ms ({row['raw_gbs']:.2f} GB/s)  "
                f"relay {row['relay_ms']:8.1f} ms ({row['relay_gbs']:.2f} GB/s)  "
                f"relay/raw {row['ratio']:.2f}  trainer publish {row['publish_ms']:.1f} ms",
                flush=True,
            )
        _command(store, index, {"op": "stop"})
        for proc in procs:
            proc.wait(120)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        shutil.rmtree(base, ignore_errors=True)
        for d in Path("/dev/shm").glob(f"{base.name}-*"):
            shutil.rmtree(d, ignore_errors=True)
    meta = {
        "cpus": os.cpu_count(),
        "torch": torch.__version__,
        "load_average": os.getloadavg(),
        "chunk_mib": args.chunk_mb,
        "reps": args.reps,
        "rounds": args.rounds,
    }
    if args.out:
        Path(args.out).write_text(json.dumps({"meta": meta, "results": results}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
