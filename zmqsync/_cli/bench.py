"""`zmqsync bench`: a quick check of publish latency on this host, in under a minute.

One publisher over an MLP of ``--size-mb``, ``--workers`` worker processes (`zmqsync
worker`, copy or alias), ``--publishes`` timed publishes, next to one memcpy of the
same bytes into shared memory (the floor a copy cannot beat). The measurement harness
(the full grid against raw ZeroMQ, torchrl and a pickled state_dict, and the other
scenarios) lives in a checkout's ``tools/bench`` (``python -m tools.bench``), not in
the package: see docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import subprocess
import sys
import time

__all__ = ["DESCRIPTION", "HELP", "NAME", "add_arguments", "run"]

NAME = "bench"
HELP = "a quick check: publish latency to N workers next to one memcpy"
DESCRIPTION = (
    "Time publishes of an MLP to N worker processes on this host, next to one memcpy of "
    "the same bytes into shared memory. The full harness: python -m tools.bench in a "
    "checkout (docs/benchmarks.md)."
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The quick check's knobs: workers, model size, publishes, worker mode."""
    p.add_argument("--workers", type=int, default=4, help="worker processes (default 4)")
    p.add_argument("--size-mb", type=float, default=64.0, help="model size in MB (default 64)")
    p.add_argument("--publishes", type=int, default=30, help="timed publishes (default 30)")
    p.add_argument("--mode", choices=("copy", "alias"), default="copy")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds for workers to join")


def run(args: argparse.Namespace) -> int:
    """Start the workers, time the publishes and the memcpy, print one table."""
    from .._demo import make_policy
    from .._publisher import Publisher

    model = make_policy(args.size_mb)
    state = {k: v.detach() for k, v in model.state_dict().items()}
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    name = f"bench-{int(time.time() * 1e3) % 10**9}"
    cmd = [sys.executable, "-m", "zmqsync", "worker", "--name", name, "--mode", args.mode]
    procs: list[subprocess.Popen[bytes]] = []
    try:
        with Publisher(state, name=name, timeout=args.timeout) as pub:
            procs = [
                subprocess.Popen([*cmd, "--worker-id", f"bench-{i}"], stdout=subprocess.DEVNULL)
                for i in range(args.workers)
            ]
            if not pub.wait_for_workers(args.workers, timeout=args.timeout):
                print(f"zmqsync bench: only {len(pub.workers)} of {args.workers} workers "
                      f"joined in {args.timeout} s", file=sys.stderr)  # fmt: skip
                return 1
            pub.publish()  # warm: every worker on a version before timing starts
            seconds = [pub.publish().seconds for _ in range(args.publishes)]
    finally:
        for proc in procs:  # the publisher's STOP ends them; a straggler is killed
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(10)
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    floor = _memcpy_seconds(nbytes, args.publishes)
    p50 = statistics.median(seconds)
    p99 = sorted(seconds)[min(len(seconds) - 1, int(len(seconds) * 0.99))]
    print(f"{args.workers} {args.mode} workers, {nbytes / 2**20:.1f} MiB, "
          f"{len(seconds)} publishes")  # fmt: skip
    print(f"publish p50 {p50 * 1e3:.2f} ms  p99 {p99 * 1e3:.2f} ms  "
          f"{nbytes / p50 / 1e9:.2f} GB/s")  # fmt: skip
    print(f"memcpy  p50 {floor * 1e3:.2f} ms  (publish / memcpy: {p50 / floor:.1f}x)")
    print("the full harness: python -m tools.bench in a checkout (docs/benchmarks.md)")
    return 0


def _memcpy_seconds(nbytes: int, n: int) -> float:
    """Median of `n` copies of `nbytes` into a shared-memory tensor (one thread)."""
    import torch as t

    src = t.empty(nbytes, dtype=t.uint8)
    dst = t.empty(nbytes, dtype=t.uint8).share_memory_()  # type: ignore[no-untyped-call]
    threads = t.get_num_threads()
    t.set_num_threads(1)
    try:
        dst.copy_(src)  # first touch
        samples = []
        for _ in range(max(3, n)):
            t0 = time.perf_counter()
            dst.copy_(src)
            samples.append(time.perf_counter() - t0)
    finally:
        t.set_num_threads(threads)
    return statistics.median(samples)
