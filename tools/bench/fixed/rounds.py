"""The fixed cost of a publish as plain worker processes see it, next to raw ZeroMQ.

Each *side* is a trainer process with its own N worker processes; the sides take turns,
one round each, for every round (their order rotates), so a load that drifts on a
shared machine hits every side alike. Sides:

``raw``
    a plain pyzmq trainer: one 8-byte message PUB -> N SUB, each worker (echo.py: a plain
    pyzmq process, no torch) answers PUSH -> PULL; timed until all N answers are in.
``zmqsync[/IDLE]``
    a trainer with ``Publisher`` over four ``nn.Linear(16, 16)`` (4 KB, 8 tensors);
    N worker processes that use only the public API::

        sub = zmqsync.Subscriber(name=..., model=model, reads=zmqsync.Aliases()).start()

    with background apply and an idle main thread (``IDLE``, default ``--idle``); timed:
    ``publish()``, from the call until every worker acked.
``harness``
    the grid's own setup (its pool workers, which answer its raw round trip on a thread
    of the same process, and its Fanout); timed: the publish, and the grid's own raw
    round trip right before it (reported as ``harness-raw``).

Two checkouts are compared by the runner, which alternates whole runs of this:
``python -m tools.bench sides --base REF --head REF fixed``.

The main thread of a plain worker (``--idle``): ``sleep:S`` sleeps S seconds in a loop,
``next`` waits for the next version (``wait_for_version(version + 1)``), ``far`` waits
for a version that never comes (``wait_for_version`` with a 1 s timeout, in a loop),
``stop`` waits in ``wait_for_stop``.

    .venv/bin/python -m tools.bench fixed --workers 8 64
    .venv/bin/python -m tools.bench fixed --workers 8 --sides raw zmqsync zmqsync/sleep:1

Prints p50 and p99 per side in ms, each over the raw side's, and the load average at
the start and the end; ``--json PATH`` writes every sample.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import IO, Any

HERE = Path(__file__).resolve()
ROOT = HERE.parents[3]
ECHO = HERE.parents[1] / "echo.py"
sys.path.insert(0, str(HERE.parents[1]))  # tools/bench: a side's process runs this by path
from roles import die_with_parent as _die_with_parent  # noqa: E402
from roles import rotated, subscriber  # noqa: E402
from roles import say as _say  # noqa: E402

READY_S = 1200.0  # N workers importing torch on a loaded 2-core machine take a while
ROUND_S = 60.0  # one round, on a deadline

# --- helpers shared by every role ------------------------------------------------------


def _spawn(args: list[str], env: dict[str, str], script: Path = HERE) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, str(script), *args],
        stdin=subprocess.DEVNULL,
        env=env,
        cwd="/tmp",  # so that PYTHONPATH decides which zmqsync is imported
    )


def _reap(procs: list[subprocess.Popen[bytes]], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    for proc in procs:
        try:
            proc.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


def _joined(pub: Any, n: int, procs: list[subprocess.Popen[Any]]) -> None:
    """Wait until `n` workers joined `pub`; a worker that exited ends the wait at once."""
    deadline = time.monotonic() + READY_S
    while not pub.wait_for_workers(n, timeout=1.0):
        dead = [p.returncode for p in procs if p.poll() is not None]
        if dead or time.monotonic() > deadline:
            why = f"{len(dead)} exited (rc {dead[0]})" if dead else f"not in {READY_S:.0f} s"
            raise SystemExit(f"only {len(pub.workers)} of {n} workers joined: {why}")


def _cpu(pid: int | str) -> dict[str, float]:
    """CPU seconds a process has run (schedstat: nanoseconds), by thread: ``main``,
    ``zmq`` (libzmq's I/O threads), ``other`` (a subscriber's agent, the publisher's)."""
    out = {"main": 0.0, "zmq": 0.0, "other": 0.0}
    pid = os.getpid() if pid == "self" else int(pid)
    with contextlib.suppress(OSError):
        for tid in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(OSError):
                with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                    ns = int(f.read().split()[0])
                with open(f"/proc/{pid}/task/{tid}/comm") as f:
                    comm = f.read()
                kind = "main" if int(tid) == pid else "zmq" if comm.startswith("ZMQbg") else "other"
                out[kind] += ns / 1e9
    return out


def _cpu_of(pids: list[int]) -> dict[str, float]:
    out = {"main": 0.0, "zmq": 0.0, "other": 0.0}
    for pid in pids:
        for kind, seconds in _cpu(pid).items():
            out[kind] += seconds
    return out


def _serve(round_once: Any, workers: list[int]) -> None:
    """Answer the orchestrator: one round per ``go`` line, the CPU spent so far per
    ``cpu`` line (this process, and its workers together), until ``quit``."""
    for line in sys.stdin:
        if line.strip() == "go":
            _say(**round_once())
        elif line.strip() == "cpu":
            _say(trainer=_cpu("self"), workers=_cpu_of(workers))
        elif line.strip() == "quit":
            return


# --- raw side --------------------------------------------------------------------------


def raw_trainer(n: int, runtime: str) -> int:
    import zmq

    _die_with_parent()
    ctx = zmq.Context()
    pub, pull = ctx.socket(zmq.PUB), ctx.socket(zmq.PULL)
    pub.linger = pull.linger = 0
    tag = uuid.uuid4().hex[:8]
    events, acks = f"ipc://{runtime}/raw-{tag}.pub", f"ipc://{runtime}/raw-{tag}.pull"
    pub.bind(events)
    pull.bind(acks)
    procs = [_spawn([events, acks], dict(os.environ), ECHO) for _ in range(n)]
    seq = [0]

    def gather(want: bytes | None, deadline: float) -> int:
        got = 0
        while got < n:
            left = int((deadline - time.monotonic()) * 1000)
            if left <= 0 or not pull.poll(left):
                break
            if want is None or pull.recv() == want:
                got += 1
        return got

    # until every subscription is live: a ping whose answers all come back
    deadline = time.monotonic() + READY_S
    while True:
        seq[0] += 1
        ping = seq[0].to_bytes(8, "little")
        pub.send(ping)
        if gather(ping, time.monotonic() + 0.2) == n:
            break
        if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
            raise SystemExit("raw workers did not all subscribe in time (or one exited)")
        while pull.poll(0):
            pull.recv()
    _say(event="ready")

    def round_once() -> dict[str, Any]:
        seq[0] += 1
        msg = seq[0].to_bytes(8, "little")
        t0 = time.perf_counter()
        pub.send(msg)
        got = gather(msg, time.monotonic() + ROUND_S)
        seconds = time.perf_counter() - t0
        if got < n:
            raise SystemExit(f"only {got} of {n} raw workers answered")
        return {"raw": seconds}

    _serve(round_once, [p.pid for p in procs])
    pub.send(b"quit")
    _reap(procs)
    ctx.destroy(linger=0)
    return 0


# --- zmqsync side ----------------------------------------------------------------------


def _linear4() -> Any:
    from torch import nn

    return nn.Sequential(*[nn.Linear(16, 16) for _ in range(4)])  # 4 KB in 8 tensors


def plain_worker(name: str, mode: str, idle: str) -> int:
    """What a user writes: a Subscriber with background apply, the main thread idle."""
    _die_with_parent()
    sub = subscriber(model=_linear4(), name=name, mode=mode, timeout=READY_S).start()
    try:
        if idle.startswith("sleep"):
            period = float(idle.partition(":")[2] or 1.0)
            while not sub.stopped and os.getppid() != 1:
                time.sleep(period)
        elif idle == "next":  # the parent is looked at on a timeout, as a raw worker does
            while not sub.stopped:
                if not sub.wait_for_version(sub.version + 1, timeout=1.0) and os.getppid() == 1:
                    break
        elif idle == "far":
            while not sub.stopped and os.getppid() != 1:
                sub.wait_for_version(2**62, timeout=1.0)
        elif idle == "stop":
            while not sub.wait_for_stop(timeout=1.0) and os.getppid() != 1:
                pass
        else:
            raise SystemExit(f"unknown --idle {idle!r}")
    finally:
        sub.close()
    return 0


def zmqsync_trainer(n: int, mode: str, idle: str) -> int:
    import zmqsync

    _die_with_parent()
    name = f"fc{uuid.uuid4().hex[:8]}"
    pub = zmqsync.Publisher(_linear4(), name=name, timeout=ROUND_S).start()
    procs = [_spawn(["_worker", name, mode, idle], dict(os.environ)) for _ in range(n)]
    try:
        _joined(pub, n, procs)
        _say(event="ready", zmqsync=zmqsync.__file__)

        def round_once() -> dict[str, Any]:
            t0 = time.perf_counter()
            pub.publish()
            return {"zmqsync": time.perf_counter() - t0}

        _serve(round_once, [p.pid for p in procs])
    finally:
        pub.close()  # STOP: the workers' main threads see `stopped` and exit
        _reap(procs, 30.0)
    return 0


# --- the bench harness's own setup -----------------------------------------------------


def harness_trainer(n: int, mode: str) -> int:
    """The harness's pool workers and Fanout, as the grid drives them."""
    import zmq

    import zmqsync
    from tools.bench.grid.fanout import Fanout
    from tools.bench.grid.pool import Pool

    _die_with_parent()
    runtime = os.environ["ZMQSYNC_RUNTIME_DIR"]
    logs = Path(tempfile.mkdtemp(prefix="fc-logs", dir=runtime))
    pool = Pool(dict(os.environ, PYTHONPATH=os.environ.get("PYTHONPATH", "")), logs, ROUND_S)
    ctx = zmq.Context()
    fan = Fanout(ctx, runtime, f"h{uuid.uuid4().hex[:8]}")
    name = f"fh{uuid.uuid4().hex[:8]}"
    from tools.bench.grid.worker import make_model

    trainer, _ = make_model("mlp", 4096, fill=True, grad=True)
    pub = zmqsync.Publisher(trainer, name=name, timeout=ROUND_S).start()
    try:
        pool.grow(n)
        pool.call(n, {"cmd": "model", "kind": "mlp", "nbytes": 4096})
        pool.call(n, {"cmd": "respond", "events": fan.events, "acks": fan.acks})
        fan.connected(n, ROUND_S)
        join = {"address": pub.address, "name": name, "mode": mode, "timeout": ROUND_S}
        pool.call(n, {"cmd": "join", **join, "shm_dir": os.environ["ZMQSYNC_SHM_DIR"]})
        _joined(pub, n, [w.proc for w in pool.workers])
        _say(event="ready", zmqsync=zmqsync.__file__)

        def round_once() -> dict[str, Any]:
            raw = fan.round(b"raw", n, ROUND_S)
            t0 = time.perf_counter()
            pub.publish()
            return {"harness": time.perf_counter() - t0, "harness-raw": raw}

        _serve(round_once, [w.proc.pid for w in pool.workers])
    finally:
        pub.close()
        pool.close()
        fan.close()
        ctx.destroy(linger=0)
    return 0


# --- orchestrator ----------------------------------------------------------------------


class Side:
    """One trainer subprocess and its workers, driven one round at a time."""

    def __init__(self, label: str, args: list[str], env: dict[str, str]) -> None:
        self.label = label
        self.proc = subprocess.Popen(
            [sys.executable, str(HERE), *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
            cwd="/tmp",
            text=True,
        )
        self.samples: dict[str, list[float]] = {}
        self.info: dict[str, Any] = {}
        self.cpu_per_round: dict[str, float] = {}

    def _line(self) -> dict[str, Any]:
        out: IO[str] | None = self.proc.stdout
        assert out is not None
        line = out.readline()
        if not line:
            raise SystemExit(f"side {self.label} exited (rc={self.proc.poll()})")
        record: dict[str, Any] = json.loads(line)
        return record

    def ready(self) -> None:
        self.info = self._line()

    def go(self, keep: bool) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()
        for key, seconds in self._line().items():
            if keep:
                self.samples.setdefault(key if key != "zmqsync" else self.label, []).append(seconds)

    def cpu(self) -> dict[str, dict[str, float]]:
        assert self.proc.stdin is not None
        self.proc.stdin.write("cpu\n")
        self.proc.stdin.flush()
        return self._line()

    def close(self) -> None:
        if self.proc.poll() is None and self.proc.stdin is not None:
            with contextlib.suppress(OSError):
                self.proc.stdin.write("quit\n")
                self.proc.stdin.flush()
                self.proc.stdin.close()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)


def _p(values: list[float], q: float) -> float:
    """Nearest-rank percentile."""
    ordered = sorted(values)
    return ordered[max(0, min(len(ordered) - 1, round(q * len(ordered) + 0.5) - 1))]


def _side(spec: str, n: int, args: argparse.Namespace, env: dict[str, str]) -> Side:
    kind, _, idle = spec.partition("/")
    side_env, label = dict(env), spec
    if kind == "raw":
        return Side("raw", ["_raw_trainer", str(n), env["ZMQSYNC_RUNTIME_DIR"]], side_env)
    if kind == "zmqsync":
        return Side(label, ["_trainer", str(n), args.mode, idle or args.idle], side_env)
    if kind == "harness":
        return Side(label, ["_harness", str(n), args.mode], side_env)
    raise SystemExit(f"unknown side {spec!r}")


def measure(n: int, args: argparse.Namespace, env: dict[str, str]) -> dict[str, Any]:
    sides: list[Side] = []
    try:
        for spec in args.sides:  # one at a time: N processes importing torch at once is enough
            sides.append(_side(spec, n, args, env))
            sides[-1].ready()
        load_start = os.getloadavg()
        cpu: dict[str, dict[str, dict[str, float]]] = {}
        for i in range(args.warmup + args.publishes):
            if i == args.warmup:
                cpu = {side.label: side.cpu() for side in sides}
            for side in rotated(sides, i):
                side.go(keep=i >= args.warmup)
        for side in sides:
            end = side.cpu()
            side.cpu_per_round = {
                f"{who}.{kind}": (end[who][kind] - cpu[side.label][who][kind]) / args.publishes
                for who in end
                for kind in end[who]
            }
    finally:
        for side in sides:
            side.close()
    samples: dict[str, list[float]] = {}
    for side in sides:
        samples.update(side.samples)
    return {
        "workers": n,
        "cpu_per_round": {side.label: side.cpu_per_round for side in sides},
        "load_start": load_start,
        "load_end": os.getloadavg(),
        "samples": samples,
    }


def report(result: dict[str, Any]) -> None:
    samples: dict[str, list[float]] = result["samples"]
    raw = samples.get("raw")
    la, lb = result["load_start"], result["load_end"]
    print(
        f"\n{result['workers']} workers, {len(next(iter(samples.values())))} rounds; load "
        f"{la[0]:.2f} {la[1]:.2f} {la[2]:.2f} at the start, {lb[0]:.2f} {lb[1]:.2f} "
        f"{lb[2]:.2f} at the end"
    )
    print(f"  {'side':<34} {'p50 ms':>8} {'p99 ms':>8} {'p50 ×raw':>9} {'p99 ×raw':>9}")
    for key, values in samples.items():
        p50, p99 = _p(values, 0.5), _p(values, 0.99)
        x50 = f"{p50 / _p(raw, 0.5):.2f}×" if raw else "-"
        x99 = f"{p99 / _p(raw, 0.99):.2f}×" if raw else "-"
        print(f"  {key:<34} {p50 * 1e3:8.3f} {p99 * 1e3:8.3f} {x50:>9} {x99:>9}")
    n = result["workers"]
    print("  CPU per round, µs (threads: main / libzmq I/O / other): trainer; each worker")
    for label, cpu in result["cpu_per_round"].items():
        t = " / ".join(f"{cpu[f'trainer.{k}'] * 1e6:.0f}" for k in ("main", "zmq", "other"))
        w = " / ".join(f"{cpu[f'workers.{k}'] * 1e6 / n:.0f}" for k in ("main", "zmq", "other"))
        print(f"    {label:<32} {t:>16};  {w:>14}")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    roles = {
        "_raw_trainer": lambda a: raw_trainer(int(a[0]), a[1]),
        "_worker": lambda a: plain_worker(a[0], a[1], a[2]),
        "_trainer": lambda a: zmqsync_trainer(int(a[0]), a[1], a[2]),
        "_harness": lambda a: harness_trainer(int(a[0]), a[1]),
    }
    if argv and argv[0] in roles:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # the orchestrator ends us
        return int(roles[argv[0]](argv[1:]))
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, nargs="+", default=[8, 64])
    parser.add_argument("--publishes", type=int, default=300)
    parser.add_argument("--warmup", type=int, default=30)
    parser.add_argument("--mode", choices=("alias", "copy"), default="alias")
    parser.add_argument("--idle", default="next", help="sleep:S | next | far | stop")
    parser.add_argument(
        "--sides",
        nargs="+",
        default=["raw", "zmqsync"],
        help="raw, zmqsync[/IDLE], harness",
    )
    parser.add_argument("--json", type=Path, help="write every sample here")
    args = parser.parse_args(argv)
    runtime = tempfile.mkdtemp(prefix="zfc", dir="/tmp")
    shm = tempfile.mkdtemp(prefix="zmqsync-fc-", dir="/dev/shm")
    env = dict(os.environ, ZMQSYNC_RUNTIME_DIR=runtime, ZMQSYNC_SHM_DIR=shm)
    env["PYTHONPATH"] = str(ROOT)
    results = []
    try:
        for n in args.workers:
            result = measure(n, args, env)
            report(result)
            results.append(result)
    finally:
        shutil.rmtree(runtime, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)
    if args.json:
        config = {k: v for k, v in vars(args).items() if k != "json"}
        args.json.write_text(json.dumps({"config": config, "results": results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
