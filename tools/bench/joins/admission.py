"""Figures for "honest workers get in and stay in" (docs/security.md, docs/reliability.md).

Three measurements, each on one bus on this host (ipc://, a private runtime dir), each
bounded in processes and time, each printing one JSON line per run:

    python -m tools.bench joins admission storm --joins 7
        honest joins one after another, first undisturbed, then during a HELLO storm for
        a live worker's id (tools/bench/storms.py): p50 and max join time of each.
    python -m tools.bench joins admission resume --heartbeat 0.1 --burners 6 --runs 5
        a worker whose main thread computes in Python (a collector's rollout) is
        SIGSTOPped past liveness while CPU burners run, then SIGCONTed: seconds until it
        acks again.
    python -m tools.bench joins admission saturated --workers 32 --burners 6 --hot 40
        alias workers of a 2,000-tensor model, started and waiting for a publisher, join
        one that starts while CPU burners run: how many are in and acking, and when; the
        publisher's counters; seconds after the burners stop until every worker acks a
        new version.
    python -m tools.bench joins admission fenced --pause evicted --runs 3 [--burners 2]
        a worker paused (SIGSTOP) until a publish's deadline evicts it (1.6 s) or until
        it is dropped as silent (3.6 s), undisturbed and during a HELLO storm for its id:
        seconds from SIGCONT until it acks a new version, and whether any other process
        held its id meanwhile.
    python -m tools.bench joins admission member-storm --seconds 10
        the publisher's CPU (cores) idle, during a handshaking storm from a process that
        is no worker, and from one that joined as a worker first: connections made and
        refused.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import torch

import zmqsync

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # its busy worker runs it by path
from roles import subscriber  # noqa: E402

ROOT = Path(__file__).resolve().parents[3]
MAX_PROCESSES = 64
MAX_SECONDS = 300.0


@contextlib.contextmanager
def _private_dirs() -> Iterator[None]:
    runtime = tempfile.mkdtemp(prefix="zsfig", dir="/tmp")
    shm = tempfile.mkdtemp(prefix="zmqsync-fig-", dir="/dev/shm")
    old = {k: os.environ.get(k) for k in ("ZMQSYNC_RUNTIME_DIR", "ZMQSYNC_SHM_DIR")}
    os.environ.update(ZMQSYNC_RUNTIME_DIR=runtime, ZMQSYNC_SHM_DIR=shm)
    try:
        yield
    finally:
        for key, value in old.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        shutil.rmtree(runtime, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)


class _Procs:
    """Subprocesses started here, all killed on the way out."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen[str]] = []

    def start(self, *args: str, out: bool = False) -> subprocess.Popen[str]:
        if len(self.procs) >= MAX_PROCESSES:
            raise SystemExit(f"more than {MAX_PROCESSES} processes: refused")
        proc = subprocess.Popen(
            [sys.executable, *args],
            stdout=subprocess.PIPE if out else subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            text=True,
            cwd=ROOT,
        )
        self.procs.append(proc)
        return proc

    def burners(self, n: int, seconds: float) -> list[subprocess.Popen[str]]:
        code = (
            f"import time\nend = time.monotonic() + {seconds}\nwhile time.monotonic() < end: pass"
        )
        return [self.start("-c", code) for _ in range(n)]

    def kill(self, procs: list[subprocess.Popen[str]] | None = None) -> None:
        for proc in procs if procs is not None else self.procs:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGCONT)
                proc.kill()
            proc.wait(10)


def _wait(check, seconds: float, step: float = 0.01) -> float | None:  # noqa: ANN001
    """Seconds until `check()` is true, or None after `seconds`."""
    t0 = time.monotonic()
    while not check():
        if time.monotonic() - t0 > seconds:
            return None
        time.sleep(step)
    return time.monotonic() - t0


def _acked(pub: zmqsync.Publisher, worker_id: str, version: int) -> bool:
    info = pub.workers.get(worker_id)
    return info is not None and info.version >= version


def _summary(times: list[float]) -> dict[str, float]:
    return {"p50": round(statistics.median(times), 3), "max": round(max(times), 3)}


# --- storm ---------------------------------------------------------------------------------


def _joins(name: str, count: int, prefix: str) -> tuple[list[float], list[str]]:
    times, failures = [], []
    for i in range(count):
        t0 = time.monotonic()
        try:
            with subscriber(name=name, worker_id=f"{prefix}-{i}", timeout=10.0):
                times.append(time.monotonic() - t0)
        except zmqsync.ZmqSyncError as exc:
            failures.append(f"{time.monotonic() - t0:.1f} s: {exc}"[:200])
    return times, failures


def storm(args: argparse.Namespace) -> dict[str, object]:
    name, procs = "figstorm", _Procs()
    try:
        with zmqsync.Publisher({"w": torch.zeros(64)}, name=name, timeout=20) as pub:
            victim = procs.start(
                "-m", "zmqsync", "worker", "--name", name, "--worker-id", "victim", "--json"
            )
            if _wait(lambda: "victim" in pub.workers, 60) is None:
                raise SystemExit("the victim never joined")
            quiet, quiet_failed = _joins(name, args.joins, "quiet")
            hellos = procs.start(
                STORMS,
                "--name", name, "--worker-id", "victim", "--seconds", "60",
                *(("--ids", str(args.ids)) if args.ids else ()),
                out=True,
            )  # fmt: skip
            if _wait(lambda: pub.counters.get("refused_ids", 0) > 2000, 30) is None:
                if not args.ids:
                    raise SystemExit("the storm never started")
                time.sleep(2.0)
            before = pub.counters
            t0 = time.monotonic()
            stormy, stormy_failed = _joins(name, args.joins, "stormy")
            took = time.monotonic() - t0
            after = pub.counters
            hellos.send_signal(signal.SIGTERM)
            out, _ = hellos.communicate(timeout=30)
            report = json.loads(out.strip().splitlines()[-1])
            del victim
        refused = after.get("refused_ids", 0) - before.get("refused_ids", 0)
        throttled = after.get("throttled", 0) - before.get("throttled", 0)
        return {
            "figure": "storm",
            "ids": args.ids or 1,
            "quiet": _summary(quiet) if quiet else None,
            "storm": _summary(stormy) if stormy else None,
            "failed": quiet_failed + stormy_failed,
            "storm_refusals_per_s_during_joins": round((refused + throttled) / took),
            "storm_report": report,
        }
    finally:
        procs.kill()


# --- resume --------------------------------------------------------------------------------


def busy_worker(args: argparse.Namespace) -> dict[str, object]:
    """A worker whose main thread computes in Python until SIGTERM (for `resume`)."""
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    with subscriber(name=args.name, worker_id=args.worker_id, mode="alias", timeout=120):
        print(json.dumps({"event": "joined"}), flush=True)
        total = 0
        while not stop.is_set():
            for i in range(10_000):
                total += i * i % 7
    return {"event": "done"}


def resume(args: argparse.Namespace) -> dict[str, object]:
    name, procs = "figresume", _Procs()
    weights = {f"t{i}": torch.zeros(16) for i in range(args.tensors)}
    backs: list[float | None] = []
    try:
        with zmqsync.Publisher(weights, name=name, heartbeat=args.heartbeat, timeout=60) as pub:
            worker = procs.start(
                str(Path(__file__).resolve()), "busy-worker", name, "paused", out=True
            )
            if _wait(lambda: _acked(pub, "paused", 0), 120) is None:
                raise SystemExit("the worker never joined")
            for _ in range(args.runs):
                hot = procs.burners(args.burners, MAX_SECONDS)
                worker.send_signal(signal.SIGSTOP)
                if _wait(lambda: "paused" not in pub.workers, 6 * args.heartbeat + 60) is None:
                    raise SystemExit("the paused worker was never dropped")
                version = pub.publish(max_lag=None).version
                worker.send_signal(signal.SIGCONT)
                back = _wait(lambda v=version: _acked(pub, "paused", v), 60)
                backs.append(None if back is None else round(back, 3))
                procs.kill(hot)
                _wait(lambda: _acked(pub, "paused", pub.publish(max_lag=None).version), 30, 0.5)
            counters = pub.counters
    finally:
        procs.kill()
    done = [b for b in backs if b is not None]
    return {
        "figure": "resume",
        "heartbeat": args.heartbeat,
        "burners": args.burners,
        "tensors": args.tensors,
        "back_s": backs,
        **({"summary": _summary(done)} if done else {}),
        "counters": counters,
    }


# --- saturated -----------------------------------------------------------------------------


def _cpu_ticks(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])  # utime + stime


def _idle(procs: list[subprocess.Popen[str]], seconds: float) -> float | None:
    """Seconds until no process of `procs` used CPU for 1 s (imports done, each one
    waiting for its WELCOME), or None after `seconds`."""
    t0 = time.monotonic()
    last = [_cpu_ticks(p.pid) for p in procs]
    while time.monotonic() - t0 < seconds:
        time.sleep(1.0)
        now = [_cpu_ticks(p.pid) for p in procs]
        if all(b - a <= 1 for a, b in zip(last, now, strict=True)):  # 10 ms of CPU at most
            return time.monotonic() - t0
        last = now
    return None


def saturated(args: argparse.Namespace) -> dict[str, object]:
    """Workers started (and imported) first, waiting for a publisher; then the burners,
    then the publisher: every handshake happens on the saturated host."""
    name, procs, n = "figsat", _Procs(), args.workers
    weights = {f"t{i}": torch.zeros(16) for i in range(args.tensors)}
    ids = [f"w{i}" for i in range(n)]
    try:
        workers = [
            procs.start(
                "-m",
                "zmqsync",
                "worker",
                "--name",
                name,
                "--mode",
                "alias",
                "--worker-id",
                w,
                "--timeout",
                "200",
            )  # fmt: skip
            for w in ids
        ]
        if _idle(workers, 240) is None:
            raise SystemExit("the workers never settled")
        hot = procs.burners(args.burners, args.hot)
        with zmqsync.Publisher(weights, name=name, heartbeat=args.heartbeat, timeout=60) as pub:
            t0 = time.monotonic()
            seen: dict[int, float] = {}
            while time.monotonic() - t0 < args.hot:
                count = len(pub.workers)
                if count not in seen:
                    seen[count] = round(time.monotonic() - t0, 1)
                if count == n and all(_acked(pub, w, 0) for w in ids):
                    break
                time.sleep(0.1)
            hot_counters = pub.counters
            in_while_hot = len(pub.workers)
            acking_while_hot = sum(_acked(pub, w, 0) for w in ids)
            procs.kill(hot)
            version = pub.publish(max_lag=None).version
            settled = _wait(lambda: all(_acked(pub, w, version) for w in ids), 120, 0.05)
            acking = sum(_acked(pub, w, version) for w in ids)
            counters = pub.counters
    finally:
        procs.kill()
    return {
        "figure": "saturated",
        "workers": n,
        "burners": args.burners,
        "tensors": args.tensors,
        "heartbeat": args.heartbeat,
        "in_while_hot": in_while_hot,
        "acking_while_hot": acking_while_hot,
        "all_in_after_s": seen.get(n),
        "acking_after_calm_s": None if settled is None else round(settled, 2),
        "acking": acking,
        "counters_while_hot": hot_counters,
        "counters": counters,
    }


# --- fenced ------------------------------------------------------------------------------

STORMS = str(ROOT / "tools" / "bench" / "storms.py")  # a HELLO storm or a connection storm


def _paused_once(pub: zmqsync.Publisher, victim: subprocess.Popen[str], pause: str) -> dict:
    victim.send_signal(signal.SIGSTOP)
    time.sleep(0.2)  # every thread stopped (a thread on a CPU runs a little longer)
    t0, others = time.monotonic(), set()
    if pause == "evicted":
        pub.publish(timeout=1.0)
    while time.monotonic() - t0 < (1.6 if pause == "evicted" else 3.6):
        holder = pub.workers.get("victim")
        if holder is not None and holder.pid != victim.pid:
            others.add(holder.pid)
        time.sleep(0.02)
    victim.send_signal(signal.SIGCONT)
    resumed = time.monotonic()
    version = pub.publish(max_lag=None).version
    back = _wait(
        lambda: _acked(pub, "victim", version) and pub.workers["victim"].pid == victim.pid, 60
    )
    return {
        "back_s": None if back is None else round(time.monotonic() - resumed, 3),
        "held_by_others": len(others),
        "alive": victim.poll() is None,
    }


def fenced(args: argparse.Namespace) -> dict[str, object]:
    name, procs, out = "figfenced", _Procs(), {}
    try:
        procs.burners(args.burners, MAX_SECONDS)
        with zmqsync.Publisher(
            {"w": torch.zeros(64)}, name=name, on_timeout="evict", timeout=10.0
        ) as pub:
            victim = procs.start("-m", "zmqsync", "worker", "--name", name, "--worker-id", "victim")
            _wait(lambda: _acked(pub, "victim", 0), 60)
            for scene in ("undisturbed", "storm"):
                storm = None
                if scene == "storm":
                    storm = procs.start(
                        STORMS, "--name", name, "--worker-id", "victim", "--seconds", "120"
                    )
                    _wait(lambda: pub.counters.get("refused_ids", 0) > 1000, 30)
                runs = [_paused_once(pub, victim, args.pause) for _ in range(args.runs)]
                out[scene] = runs
                if storm is not None:
                    procs.kill([storm])
            out["counters"] = {
                k: pub.counters.get(k, 0) for k in ("refused_ids", "evictions", "lost")
            }
    finally:
        procs.kill()
    return {"figure": "fenced", "pause": args.pause, "burners": args.burners, **out}


def _record(proc: subprocess.Popen[str], key: str) -> dict:
    """The first JSON line `proc` prints that has `key` ({} if it exits first)."""
    for line in proc.stdout:  # type: ignore[union-attr]
        if line.startswith("{") and key in (record := json.loads(line)):
            return record
    return {}


def member_storm(args: argparse.Namespace) -> dict[str, object]:
    procs, out = _Procs(), {}
    try:
        victim = procs.start(
            "tests/helpers/victim.py",
            "figmember",
            "--data-mb",
            "1024",
            "--interval",
            "0.1",
            out=True,
        )
        address = _record(victim, "address")["address"]
        events = _inspect(address).events
        for scene, extra in (("idle", None), ("stranger", []), ("member", ["--join", address])):
            before = _inspect(address).counters.get("refused_connections", 0)
            ticks, t0 = _cpu_ticks(victim.pid), time.monotonic()
            made = 0
            if extra is None:
                time.sleep(args.seconds)
            else:
                seconds = str(args.seconds)
                storm = procs.start(
                    STORMS, events, "--mode", "zmtp", "--seconds", seconds, *extra, out=True
                )
                made = _record(storm, "connections").get("connections", 0)
            elapsed = time.monotonic() - t0
            cores = (_cpu_ticks(victim.pid) - ticks) / os.sysconf("SC_CLK_TCK") / elapsed
            refused = _inspect(address).counters.get("refused_connections", 0) - before
            out[scene] = {"cores": round(cores, 2), "connections": made, "refused": refused}
        victim.send_signal(signal.SIGTERM)
        victim.wait(30)
    finally:
        procs.kill()
    return {"figure": "member-storm", "seconds": args.seconds, **out}


def _inspect(address: str):  # noqa: ANN202 - a State
    import zmq

    from zmqsync._deadline import Deadline
    from zmqsync._protocol import Inspect
    from zmqsync._sockets import request

    with zmq.Context() as ctx:
        return request(ctx, address, Inspect(""), deadline=Deadline(10))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="figure", required=True)
    s = sub.add_parser("storm")
    s.add_argument("--joins", type=int, default=7)
    s.add_argument("--ids", type=int, default=0, help="storm with this many new ids instead")
    r = sub.add_parser("resume")
    r.add_argument("--heartbeat", type=float, default=0.1)
    r.add_argument("--burners", type=int, default=6)
    r.add_argument("--tensors", type=int, default=2000)
    r.add_argument("--runs", type=int, default=5)
    b = sub.add_parser("busy-worker")
    b.add_argument("name")
    b.add_argument("worker_id")
    t = sub.add_parser("saturated")
    t.add_argument("--workers", type=int, default=32)
    t.add_argument("--burners", type=int, default=6)
    t.add_argument("--tensors", type=int, default=2000)
    t.add_argument("--heartbeat", type=float, default=0.5)
    t.add_argument("--hot", type=float, default=40.0, help="seconds the burners run")
    f = sub.add_parser("fenced")
    f.add_argument("--pause", choices=("evicted", "silent"), default="evicted")
    f.add_argument("--runs", type=int, default=3)
    f.add_argument("--burners", type=int, default=0)
    m = sub.add_parser("member-storm")
    m.add_argument("--seconds", type=float, default=10.0)
    args = p.parse_args(argv)
    for key in ("burners", "workers"):
        if getattr(args, key, 0) > MAX_PROCESSES // 2:
            raise SystemExit(f"--{key} at most {MAX_PROCESSES // 2}")
    if getattr(args, "hot", 0) > MAX_SECONDS:
        raise SystemExit(f"--hot at most {MAX_SECONDS:.0f} s")
    if args.figure == "busy-worker":
        busy_worker(args)
        return 0
    run = {
        "storm": storm,
        "resume": resume,
        "saturated": saturated,
        "fenced": fenced,
        "member-storm": member_storm,
    }[args.figure]
    with _private_dirs():
        print(json.dumps(run(args)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
