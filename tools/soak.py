"""Soak test: a publisher and N workers under random faults, every version verified.

    python tools/soak.py --duration 1200 --workers 4 --size-mb 4

Runs `tools/trainer.py` (a real training loop, publishing as fast as it can with
``on_timeout="evict"``) and N ``zmqsync worker --verify --json --forever`` processes
(copy/alias, background/manual mixed), each in its own private runtime and shm dir.
While it runs it injects, at random: SIGKILL of a worker (restarted), SIGSTOP/SIGCONT of
a worker (a straggler or slow consumer), SIGKILL of the publisher (restarted: new bus,
new buffers) and a graceful publisher restart.

It checks that every version a worker applied matches the checksum the trainer stored in
it (torn or wrong versions: must be 0), that versions only increase within one bus (per
worker process: a restarted worker may start where the killed one stopped),
that no publish overran its deadline and that every live worker converges to the newest
version after the faults stop (hangs: must be 0), and that nothing is left in the shm
dir after a clean shutdown and one `zmqsync gc` (leaked segments: must be 0). Ends with
a table; exit status 1 if any must-be-0 count is not 0.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
TIMEOUT_S = 3.0  # the trainer's publish deadline
HEARTBEAT_S = 0.2
START_S = 180.0  # a process's start (torch's import) on a loaded 2-core host


class Child:
    """A subprocess whose JSON lines are handed to a callback by a reader thread."""

    def __init__(self, cmd: list[str], env: dict[str, str], on_record: Any) -> None:
        self.cmd = cmd
        self.proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env, cwd=ROOT
        )
        self.stopped = False
        self._thread = threading.Thread(target=self._read, args=(on_record,), daemon=True)
        self._thread.start()

    def _read(self, on_record: Any) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith("{"):
                on_record(self, json.loads(line))

    def send(self, sig: int) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)

    def end(self, sig: int = signal.SIGTERM, timeout: float = 15.0) -> None:
        if self.stopped:
            self.send(signal.SIGCONT)
            self.stopped = False
        self.send(sig)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)
        self._thread.join(5)
        if self.proc.stdout is not None:
            self.proc.stdout.close()


class Soak:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.rng = random.Random(args.seed)
        self.runtime = tempfile.mkdtemp(prefix="zsoak", dir="/tmp")
        self.shm = tempfile.mkdtemp(prefix="zmqsync-soak-", dir="/dev/shm")
        self.env = dict(os.environ, ZMQSYNC_RUNTIME_DIR=self.runtime, ZMQSYNC_SHM_DIR=self.shm)
        self.name = "soak"
        self.lock = threading.Lock()
        self.faults: collections.Counter[str] = collections.Counter()
        self.counts: collections.Counter[str] = collections.Counter()
        self.latencies: list[float] = []
        self.last_output = time.monotonic()
        self.latest: tuple[str, int] = ("", -1)  # (bus, version) last published
        self.worker_state: dict[str, tuple[str, int]] = {}
        self.reporter: dict[str, Child] = {}  # the process whose record worker_state holds
        self.bad: list[dict[str, Any]] = []
        self.trainer: Child | None = None
        self.armed = False
        self.workers: dict[str, Child] = {}

    # --- processes ---

    def start_trainer(self) -> None:
        cmd = [
            sys.executable,
            "tools/trainer.py",
            self.name,
            "--updates",
            "0",
            "--interval",
            str(self.args.interval),
            "--size-mb",
            str(self.args.size_mb),
            "--timeout",
            str(TIMEOUT_S),
            "--heartbeat",
            str(HEARTBEAT_S),
            "--on-timeout",
            "evict",
        ]
        with self.lock:
            self.armed = False  # the watchdog starts once the new trainer says "started"
        self.trainer = Child(cmd, self.env, self.on_trainer)

    def start_worker(self, wid: str) -> None:
        i = int(wid[1:])
        mode = ("copy", "alias")[i % 2]
        apply = ("background", "manual")[(i // 2) % 2]
        cmd = [
            sys.executable,
            "-m",
            "zmqsync",
            "worker",
            "--name",
            self.name,
            "--verify",
            "--json",
            "--forever",
            "--worker-id",
            wid,
            "--mode",
            mode,
            "--apply",
            apply,
            "--timeout",
            "30",
        ]
        self.workers[wid] = Child(cmd, self.env, self.on_worker)

    # --- records ---

    def on_trainer(self, child: Child, rec: dict[str, Any]) -> None:
        with self.lock:
            self.last_output = time.monotonic()
            if rec["event"] == "started":
                self.bus = rec["bus"]
                self.armed = True
            elif rec["event"] == "published":
                self.counts["publishes"] += 1
                self.latencies.append(rec["seconds"])
                self.latest = (self.bus, rec["version"])
                if rec["seconds"] > TIMEOUT_S + 1.0:
                    self.counts["overran"] += 1
            elif rec["event"] == "timeout":
                self.counts["publish_timeouts"] += 1

    def on_worker(self, child: Child, rec: dict[str, Any]) -> None:
        if rec.get("event") != "applied":
            return
        with self.lock:
            self.counts["applied"] += 1
            if rec.get("torn_detected"):
                self.counts["torn_detected"] += 1
            elif not rec.get("ok", False) or rec.get("expected") is None:
                self.counts["torn_or_wrong"] += 1
                self.bad.append(rec)
            prev = self.worker_state.get(rec["worker"])
            # A process applies each version once; a new process under the same id (a
            # killed worker restarted) may start at the version the old one had last.
            same = self.reporter.get(rec["worker"]) is child
            if (
                prev is not None
                and prev[0] == rec["bus"]
                and (rec["version"] <= prev[1] if same else rec["version"] < prev[1])
            ):
                self.counts["version_went_back"] += 1
                self.bad.append({**rec, "previous": prev})
            self.worker_state[rec["worker"]] = (rec["bus"], rec["version"])
            self.reporter[rec["worker"]] = child

    # --- faults ---

    def inject(self) -> None:
        kind = self.rng.choices(
            ["kill_worker", "stop_worker", "kill_publisher", "restart_publisher"],
            weights=[4, 4, 1, 1],
        )[0]
        wid = self.rng.choice(sorted(self.workers))
        worker = self.workers[wid]
        if kind == "kill_worker" and not worker.stopped:
            worker.end(signal.SIGKILL)
            time.sleep(self.rng.uniform(0.0, 0.5))
            self.start_worker(wid)
        elif kind == "stop_worker" and not worker.stopped:
            worker.send(signal.SIGSTOP)
            worker.stopped = True
            threading.Timer(self.rng.uniform(0.2, 4.0), self.resume, args=(worker,)).start()
        elif kind in ("kill_publisher", "restart_publisher"):
            assert self.trainer is not None
            self.trainer.end(signal.SIGKILL if kind == "kill_publisher" else signal.SIGTERM)
            time.sleep(self.rng.uniform(0.0, 1.0))
            self.start_trainer()
        else:
            return
        self.faults[kind] += 1

    def resume(self, worker: Child) -> None:
        worker.send(signal.SIGCONT)
        worker.stopped = False

    def watchdog(self) -> None:
        with self.lock:
            silent = time.monotonic() - self.last_output
            if not self.armed:  # a trainer starting up (importing torch) is not a hang
                return
        if silent > TIMEOUT_S + HEARTBEAT_S * 6 + 5:
            self.counts["hangs"] += 1
            self.bad.append({"event": "trainer silent", "seconds": silent})
            with self.lock:
                self.last_output = time.monotonic()

    # --- run ---

    def run(self) -> dict[str, Any]:
        from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

        self.start_trainer()
        for i in range(self.args.workers):
            self.start_worker(f"s{i}")
        # The clock starts once the trainer is up: importing torch takes seconds on a
        # loaded host, and a soak whose duration passed before its first publish soaked
        # nothing (it reported 0 publishes and 0 hangs).
        ready_by = time.monotonic() + START_S
        while not self.armed and time.monotonic() < ready_by:
            time.sleep(0.1)
        if not self.armed:
            self.counts["trainer_never_started"] += 1
        end = time.monotonic() + self.args.duration
        columns = (
            TextColumn("[bold]soak"),
            BarColumn(),
            TimeElapsedColumn(),
            TextColumn("{task.fields[status]}"),
        )
        with Progress(*columns, transient=False) as progress:
            task = progress.add_task("soak", total=self.args.duration, status="")
            next_fault = time.monotonic() + 2.0
            while (now := time.monotonic()) < end:
                if now >= next_fault:
                    self.inject()
                    next_fault = now + self.rng.uniform(*self.args.fault_every)
                self.watchdog()
                status = (
                    f"{self.counts['publishes']} publishes, "
                    f"{sum(self.faults.values())} faults, "
                    f"{self.counts['torn_or_wrong']} bad"
                )
                progress.update(task, completed=self.args.duration - (end - now), status=status)
                time.sleep(0.1)
        return self.finish()

    def converge(self, timeout: float) -> list[str]:
        """Workers that did not reach the newest version (hangs) after faults stopped."""
        for w in self.workers.values():
            if w.stopped:
                self.resume(w)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self.lock:
                bus, version = self.latest
                behind = [
                    wid
                    for wid in self.workers
                    if self.worker_state.get(wid, ("", -1)) < (bus, version - 2)
                    or self.worker_state.get(wid, ("", -1))[0] != bus
                ]
            if not behind:
                return []
            time.sleep(0.2)
        return behind

    def finish(self) -> dict[str, Any]:
        behind = self.converge(timeout=20.0)
        self.counts["hangs"] += len(behind)
        for wid in behind:
            self.bad.append(
                {
                    "event": "behind at end",
                    "worker": wid,
                    "state": self.worker_state.get(wid),
                    "latest": self.latest,
                }
            )
        assert self.trainer is not None
        self.trainer.end(signal.SIGTERM)
        for w in self.workers.values():
            w.end(signal.SIGTERM)
        left = sorted(os.listdir(self.shm))
        gc = subprocess.run(
            [sys.executable, "-m", "zmqsync", "gc"],
            env=self.env,
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=60,
        )
        leaked = sorted(os.listdir(self.shm))
        lat = sorted(self.latencies) or [float("nan")]
        result = {
            "duration_s": self.args.duration,
            "workers": self.args.workers,
            "size_mb": self.args.size_mb,
            "publishes": self.counts["publishes"],
            "applied_and_verified": self.counts["applied"] - self.counts["torn_or_wrong"],
            "faults": dict(self.faults),
            "publish_p50_ms": lat[len(lat) // 2] * 1e3,
            "publish_max_ms": lat[-1] * 1e3,
            "publish_timeouts_evicted": self.counts["publish_timeouts"],
            "torn_reads_detected": self.counts["torn_detected"],
            "hangs": self.counts["hangs"]
            + self.counts["overran"]
            + self.counts["trainer_never_started"],
            "behind_at_end": behind,
            "torn_or_wrong": self.counts["torn_or_wrong"] + self.counts["version_went_back"],
            "left_after_close": len(left),
            "collected_by_gc": gc.stdout.count("removed /"),
            "leaked_segments": len(leaked),
            "bad_records": self.bad[:10],
        }
        shutil.rmtree(self.runtime, ignore_errors=True)
        shutil.rmtree(self.shm, ignore_errors=True)
        return result


def render(result: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(
        title=f"zmqsync soak: {result['duration_s']:.0f} s, {result['workers']} workers, "
        f"{result['size_mb']} MiB model"
    )
    table.add_column("measure")
    table.add_column("value", justify="right")
    rows = [
        ("publishes", result["publishes"]),
        ("versions applied and verified by workers", result["applied_and_verified"]),
        *[(f"faults: {k}", v) for k, v in sorted(result["faults"].items())],
        ("publish p50", f"{result['publish_p50_ms']:.1f} ms"),
        ("publish max (deadline 3 s + eviction)", f"{result['publish_max_ms']:.1f} ms"),
        ("publishes that evicted a worker", result["publish_timeouts_evicted"]),
        ("hangs (must be 0)", result["hangs"]),
        ("torn or wrong versions (must be 0)", result["torn_or_wrong"]),
        (
            "torn reads detected by the seqlock (evicted alias readers)",
            result["torn_reads_detected"],
        ),
        ("segments left after close (killed publishers)", result["left_after_close"]),
        ("removed by zmqsync gc", result["collected_by_gc"]),
        ("leaked segments (must be 0)", result["leaked_segments"]),
    ]
    for k, v in rows:
        table.add_row(k, str(v))
    Console().print(table)
    for rec in result["bad_records"]:
        print("bad:", json.dumps(rec), file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--duration", type=float, default=60.0, help="seconds of faults")
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--size-mb", type=float, default=4.0)
    p.add_argument("--interval", type=float, default=0.02, help="pause between publishes (s)")
    p.add_argument("--fault-every", type=float, nargs=2, default=(1.0, 3.0), metavar=("MIN", "MAX"))
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--json", metavar="FILE", help="also write the result as JSON")
    args = p.parse_args(argv)
    result = Soak(args).run()
    render(result)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    bad = result["hangs"] or result["torn_or_wrong"] or result["leaked_segments"]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
