"""CPU per round: where a 4 KB publish to N workers spends its CPU, next to raw ZeroMQ.

On 2 cores every round trip is CPU-bound: a publish takes about (CPU every process
spends on it) / 2. This harness starts N subprocess workers, each a real `Subscriber`
plus a raw SUB->PUSH echo on its main thread (echo.py), then runs a loop of publishes and a loop
of raw round trips (PUB -> N SUB, N PUSH -> PULL, an 8-byte payload), and reads the CPU
each loop cost from ``/proc/PID/task/TID/stat``: the publishing thread, the publisher's
agent thread, and every worker process (all its threads). Phases alternate
``--rounds`` times, so drift on a shared machine hits both sides.

    .venv/bin/python -m tools.bench fixed cpu --workers 8 --mode copy --rounds 3

It is the profile behind "Where the time goes" in docs/benchmarks.md; the ratios it
prints are not the benchmark's (its raw responder is a bare loop, the benchmark's is a
thread that also handles naive and copy floors).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch
import zmq

import zmqsync

ECHO = Path(__file__).resolve().parents[1] / "echo.py"  # the workers: a Subscriber + echo


def _model(kind: str) -> torch.nn.Module:
    if kind == "many":  # the bench's 2,000 tensors of 2 KB
        from tools.bench.grid.worker import make_model

        return make_model("many", 0, fill=True, grad=True)[0]
    return torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(4)])  # 4 KB, 8 tensors


def _thread_cpu(pid: int, tid: int) -> float:
    with open(f"/proc/{pid}/task/{tid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _process_cpu(pid: int) -> float:
    return sum(_thread_cpu(pid, int(tid)) for tid in os.listdir(f"/proc/{pid}/task"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--mode", choices=("copy", "alias"), default="alias")
    parser.add_argument("--iters", type=int, default=3000, help="rounds per phase")
    parser.add_argument("--rounds", type=int, default=1, help="alternations of the phases")
    parser.add_argument("--model", choices=("4k", "many"), default="4k", help="many: 2,000 x 2 KB")
    parser.add_argument(
        "--flat", action="store_true", help="the flat layout on both sides (as the bench's many)"
    )
    parser.add_argument("--json", type=Path, help="write the figures here (what `sides` reads)")
    args = parser.parse_args(argv)
    n, iters = args.workers, args.iters
    rundir = tempfile.mkdtemp(prefix="zmqsync-cpu-")
    os.environ["ZMQSYNC_RUNTIME_DIR"] = rundir
    name = f"cpu{os.getpid()}"
    ctx = zmq.Context()
    raw_pub = ctx.socket(zmq.PUB)
    raw_pub.bind(f"ipc://{rundir}/raw-events")
    raw_pull = ctx.socket(zmq.PULL)
    raw_pull.bind(f"ipc://{rundir}/raw-acks")
    raw_pull.rcvtimeo = 10_000
    procs: list[subprocess.Popen[bytes]] = []
    rows: dict[str, list[float]] = {}
    try:
        writes = zmqsync.Copy(flat=args.flat)
        with zmqsync.Publisher(_model(args.model), name=name, timeout=30, writes=writes) as pub:
            echo = [sys.executable, str(ECHO), *_raw_endpoints(rundir), "--subscribe", name]
            echo += ["--mode", args.mode, "--model", args.model, *(["--flat"] * args.flat)]
            procs = [subprocess.Popen(echo) for _ in range(n)]
            if not pub.wait_for_workers(n, timeout=120):
                raise SystemExit("workers did not join in 120 s")
            _raw_connected(raw_pub, raw_pull, n)
            main_tid = threading.get_native_id()
            agent = pub._agent
            assert agent is not None
            agent_tid = agent._thread.native_id
            assert agent_tid is not None
            me = os.getpid()

            def snapshot() -> tuple[float, float, float]:
                workers = sum(_process_cpu(p.pid) for p in procs)
                return _thread_cpu(me, main_tid), _thread_cpu(me, agent_tid), workers

            for _ in range(args.rounds):
                for phase in ("zmqsync", "raw"):
                    before, started = snapshot(), time.perf_counter()
                    for _ in range(iters):
                        if phase == "zmqsync":
                            pub.publish()
                        else:
                            raw_pub.send(b"r")
                            for _ in range(n):
                                raw_pull.recv()
                    wall = time.perf_counter() - started
                    after = snapshot()
                    per = [(a - b) / iters * 1e6 for a, b in zip(after, before, strict=True)]
                    for key, value in (
                        (f"{phase} wall per round", wall / iters * 1e6),
                        (f"{phase} publishing thread", per[0]),
                        (f"{phase} publisher agent", per[1]),
                        (f"{phase} each worker", per[2] / n),
                    ):
                        rows.setdefault(key, []).append(value)
            raw_pub.send(b"quit")
            for proc in procs:
                proc.wait(30)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
        ctx.destroy(linger=0)
        shutil.rmtree(rundir, ignore_errors=True)
    what = "2,000-tensor" if args.model == "many" else "4 KB"
    layout = ", flat" if args.flat else ""
    print(f"{n} workers, {args.mode} mode{layout}, {what} model, {iters} rounds x {args.rounds}")
    print(f"{'µs per round (median of the rounds)':40s} {'value':>8s}")
    shown = {key: values for key, values in rows.items() if key != "raw publisher agent"}
    for key, values in shown.items():
        print(f"{key:40s} {statistics.median(values):8.0f}")
    if args.json:  # µs per round, one value per alternation: `sides` takes their median
        config = {"workers": n, "mode": args.mode, "model": args.model, "flat": args.flat}
        args.json.write_text(json.dumps({"config": config, **shown}, indent=1))
    return 0


def _raw_endpoints(rundir: str) -> tuple[str, str]:
    return f"ipc://{rundir}/raw-events", f"ipc://{rundir}/raw-acks"


def _raw_connected(pub: zmq.Socket[bytes], pull: zmq.Socket[bytes], n: int) -> None:
    """Send numbered hellos until one is answered by all `n` workers (a SUB joins late)."""
    deadline = time.monotonic() + 60
    for k in range(1_000_000):
        if time.monotonic() > deadline:
            raise SystemExit("raw sockets did not connect in 60 s")
        token = b"hello %d" % k
        pub.send(token)
        answers = 0
        while pull.poll(100):
            answers += pull.recv() == token
        if answers == n:
            return


if __name__ == "__main__":
    raise SystemExit(main())
