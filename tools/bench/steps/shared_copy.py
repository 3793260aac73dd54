"""Shared copies or not, alternating in one run: what `ZMQSYNC_COPY_THREADS` buys.

A copy-mode worker's copy of 16 MiB or more is shared among threads by the native loop.
Separate benchmark runs of the two settings differ by more than the effect (the host's
memory speed drifts from minute to minute), so this starts one publisher and N
subprocess copy-mode workers (a bench MLP model) and switches every worker between the
two settings on the same processes, phase by phase: its copy shared, or on its own
thread. It prints the median publish latency (publish called -> every ack in) of each
phase and the median over the phases.

    .venv/bin/python -m tools.bench steps shared-copy --size 64 --workers 4 [--step]
    .venv/bin/python -m tools.bench steps shared-copy --micro --size 64 [--busy]

``--step`` runs a 16 MiB torch ``copy_`` at its default threads before each publish, as
a training step leaves its OpenMP threads spinning when ``publish()`` starts. The shared
loop was also tried for the publisher's big tensors; with ``--step`` it lost to torch's
``copy_`` (docs/benchmarks.md, "Tried and dropped: the shared copy for the publisher's big
tensors"; this tool at commit 51ca2ad has that side).

``--micro`` times one copy of ``--size`` MiB into shared memory in this process: one
thread (ctypes.memmove), torch's ``copy_`` at its default threads, and the native loop
shared among ``COPY_THREADS``; ``--busy`` keeps one core busy with a spinning process
meanwhile. The numbers of "Big copies shared among threads" in docs/benchmarks.md come
from this tool.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import select
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from array import array
from collections.abc import Callable

import torch

import zmqsync
from tools.bench.grid.worker import make_model
from zmqsync import _copy

# Each worker reads lines on stdin: "shared" / "single" sets how its next plans copy.
_WORKER = r"""
import sys
from zmqsync import _copy
from tools.bench.grid.worker import make_model
from tools.bench.roles import subscriber
name, nbytes, mode = sys.argv[1], int(sys.argv[2]), sys.argv[3]
default = _copy.COPY_THREADS
model = make_model("mlp", nbytes, fill=False)[0]
with subscriber(name=name, model=model, mode=mode) as sub:
    for line in sys.stdin:
        _copy.COPY_THREADS = default if line.strip() == "shared" else 1
        if sub._reader.target is not None:  # the next version plans its copies again
            sub._reader.target.forget_views()
        print("ok", flush=True)
"""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", type=int, default=64, help="model size, MiB")
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=6, help="alternations of the phases")
    parser.add_argument("--publishes", type=int, default=15, help="measured per phase")
    parser.add_argument(
        "--step",
        action="store_true",
        help="before each publish, a 16 MiB torch copy_ at its default threads (a training "
        "step's last kernel: its OpenMP threads are still spinning when publish() starts)",
    )
    parser.add_argument("--micro", action="store_true", help="time one copy in this process")
    parser.add_argument("--busy", action="store_true", help="--micro with one core kept busy")
    args = parser.parse_args(argv)
    if args.micro:
        return _micro(args.size << 20, busy=args.busy)
    if _copy.COPY_THREADS < 2 or _copy.NATIVE_COPY is None:
        parser.error("needs the native loop and 2+ CPUs (ZMQSYNC_COPY_THREADS unset)")
    nbytes = args.size << 20
    rundir = tempfile.mkdtemp(prefix="zmqsync-ab-")
    os.environ["ZMQSYNC_RUNTIME_DIR"] = rundir
    name = f"ab{os.getpid()}"
    procs: list[subprocess.Popen[str]] = []
    latency: dict[str, list[float]] = {"shared": [], "single": []}
    step_src, step_dst = (
        torch.ones(16 << 20, dtype=torch.uint8),
        torch.zeros(16 << 20, dtype=torch.uint8),
    )
    try:
        model = make_model("mlp", nbytes, fill=True, grad=True)[0]
        with zmqsync.Publisher(model, name=name, timeout=120) as pub:
            procs = [
                subprocess.Popen(
                    [sys.executable, "-c", _WORKER, name, str(nbytes), "copy"],
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    text=True,
                )
                for _ in range(args.workers)
            ]
            if not pub.wait_for_workers(args.workers, timeout=120):
                raise SystemExit("workers did not join in 120 s")
            for _ in range(args.rounds):
                for setting in ("single", "shared"):
                    _set(procs, setting)
                    for _ in range(3):  # plans rebuilt, pages touched
                        pub.publish()
                    seconds = []
                    for _ in range(args.publishes):
                        if args.step:
                            step_dst.copy_(step_src)
                        seconds.append(pub.publish().seconds)
                    latency[setting].append(statistics.median(seconds) * 1e3)
    finally:
        for proc in procs:
            if proc.stdin is not None:
                proc.stdin.close()
        for proc in procs:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
        shutil.rmtree(rundir, ignore_errors=True)
    step = ", a torch step before each publish" if args.step else ""
    print(f"{args.size} MiB, copy mode, {args.workers} workers{step}")
    for setting, values in latency.items():
        phases = ", ".join(f"{v:.2f}" for v in values)
        print(f"{setting:7s} median {statistics.median(values):8.2f} ms   phases: {phases}")
    return 0


def _micro(nbytes: int, *, busy: bool) -> int:
    """Median and worst of 1 s of copies per way, the ways interleaved copy by copy."""
    copy_many = _copy.NATIVE_COPY
    if copy_many is None:
        raise SystemExit("needs the native loop")
    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.zeros(nbytes, dtype=torch.uint8).share_memory_()  # type: ignore[no-untyped-call]
    plan = array("Q", [dst.data_ptr(), src.data_ptr(), nbytes])
    ways: dict[str, Callable[[], object]] = {
        "one thread (memmove)": lambda: ctypes.memmove(dst.data_ptr(), src.data_ptr(), nbytes),
        f"torch copy_ ({torch.get_num_threads()} threads)": lambda: dst.copy_(src),
        f"shared ({_copy.COPY_THREADS} threads)": lambda: copy_many(plan, _copy.COPY_THREADS),
    }
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if busy else None
    times: dict[str, list[float]] = {way: [] for way in ways}
    try:
        end = time.monotonic() + max(3.0, len(ways) * 1.0)
        while time.monotonic() < end or min(map(len, times.values())) < 5:
            for way, run in ways.items():
                started = time.perf_counter()
                run()
                times[way].append(time.perf_counter() - started)
    finally:
        if spinner is not None:
            spinner.kill()
            spinner.wait(10)
    print(f"one copy of {nbytes >> 20} MiB into shared memory{', one core busy' if busy else ''}")
    for way, seconds in times.items():
        print(
            f"{way:28s} median {statistics.median(seconds) * 1e3:8.3f} ms"
            f"   worst {max(seconds[1:]) * 1e3:8.3f} ms   ({len(seconds)} copies)"
        )
    return 0


def _set(procs: list[subprocess.Popen[str]], setting: str) -> None:
    """Switch every worker's next copy plans to `setting` ("shared" or "single")."""
    for proc in procs:
        assert proc.stdin is not None and proc.stdout is not None
        proc.stdin.write(setting + "\n")
        proc.stdin.flush()
        ready, _, _ = select.select([proc.stdout], [], [], 60)
        if not ready or proc.stdout.readline().strip() != "ok":
            raise SystemExit("a worker did not switch")


if __name__ == "__main__":
    raise SystemExit(main())
