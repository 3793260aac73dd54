"""What one call per message costs a worker whose thread comes to it with cold caches.

On this 2-core machine N worker processes and a trainer share two cores: each worker's
thread runs a few microseconds per round trip, after the others evicted its caches. A
call that takes a microsecond warm can then cost tens. This measures it on the raw round
trip itself: a trainer sends an 8-byte message PUB -> N SUB, each worker (a plain pyzmq
echo on a thread, its main thread asleep, torch imported) answers PUSH -> PULL, and the
worker does one extra thing per message, per variant:

``none``       nothing
``python``     a Python loop of 300 additions (about 5 us warm)
``swap``       one ``UntypedStorage._swap_data_ptr_`` (an alias worker's version switch)
``add``        ``t.add_(1)`` on a 64-float tensor (one op through torch's dispatcher)
``add-t1``     the same with ``torch.set_num_threads(1)``

It prints, per variant, the median wall time of a round and the CPU each worker spent
per round (all its threads, from ``/proc``), variants alternating so drift hits all.

    .venv/bin/python -m tools.bench fixed cold-calls --workers 8 --rounds 1500
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import zmq

ECHO = Path(__file__).resolve().parents[1] / "echo.py"  # the workers, with --extra
sys.path.insert(0, str(ECHO.parent))
from echo import EXTRAS as VARIANTS  # noqa: E402


def _cpu(pid: int) -> float:
    """Seconds of CPU every thread of `pid` used so far."""
    total = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{tid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])
    return total / os.sysconf("SC_CLK_TCK")


def _run(
    variant: str, n: int, rounds: int, ctx: zmq.Context[zmq.Socket[bytes]], where: str
) -> tuple[float, float]:
    pub, pull = ctx.socket(zmq.PUB), ctx.socket(zmq.PULL)
    pub.linger = pull.linger = 0
    events, acks = f"ipc://{where}/events-{variant}", f"ipc://{where}/acks-{variant}"
    pub.bind(events)
    pull.bind(acks)
    pull.rcvtimeo = 30_000
    procs = [
        subprocess.Popen([sys.executable, str(ECHO), events, acks, "--extra", variant, "--thread"])
        for _ in range(n)
    ]
    try:
        deadline = time.monotonic() + 300
        while True:  # every worker subscribed and answering
            pub.send(b"hello")
            got, until = 0, time.monotonic() + 0.3
            while time.monotonic() < until:
                if pull.poll(30):
                    pull.recv()
                    got += 1
            if got >= n:
                break
            if time.monotonic() > deadline:
                raise SystemExit(f"{variant}: the workers did not answer in 300 s")
        while pull.poll(100):
            pull.recv()
        before, started = sum(map(_cpu, (p.pid for p in procs))), time.perf_counter()
        for _ in range(rounds):
            pub.send(b"r")
            for _ in range(n):
                pull.recv()
        wall = (time.perf_counter() - started) / rounds
        cpu = (sum(map(_cpu, (p.pid for p in procs))) - before) / rounds / n
        pub.send(b"quit")
        for proc in procs:
            proc.wait(30)
        return wall, cpu
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
        pub.close()
        pull.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=1500)
    parser.add_argument("--repeats", type=int, default=2, help="alternations of the variants")
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    args = parser.parse_args(argv)
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    where = tempfile.mkdtemp(prefix="zmqsync-cold-")
    samples: dict[str, list[tuple[float, float]]] = {v: [] for v in args.variants}
    load = os.getloadavg()[0]
    try:
        for _ in range(args.repeats):
            for variant in args.variants:
                samples[variant].append(_run(variant, args.workers, args.rounds, ctx, where))
    finally:
        ctx.destroy(linger=0)
        shutil.rmtree(where, ignore_errors=True)
    after = os.getloadavg()[0]
    print(
        f"{args.workers} workers, {args.rounds} rounds x{args.repeats}, load {load:.1f}-{after:.1f}"
    )
    print(f"{'variant':10s} {'wall us':>8s} {'cpu/worker us':>14s}")
    for variant, values in samples.items():
        wall = statistics.median(w for w, _ in values)
        cpu = statistics.median(c for _, c in values)
        print(f"{variant:10s} {wall * 1e6:8.0f} {cpu * 1e6:14.0f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
