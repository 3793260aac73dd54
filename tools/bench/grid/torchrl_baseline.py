"""The torchrl baseline: `SharedMemWeightSyncScheme` with N receivers, in a subprocess.

torchrl's sync ``send()`` blocks forever when a receiver has died, so the baseline runs
in its own process group (`python -m tools.bench.grid.worker torchrl SPEC`) that reports
one JSON line per measured point, and the harness kills the whole group when a point
misses its deadline. Two set-ups are planned per size: ``collector`` (the trained
module's own tensors are the shared buffer, as torchrl's collectors do with a CPU
policy) and ``own`` (the scheme owns a buffer; ``send()`` copies into it). torchrl
holds every size of a run at once, so the plan also keeps the sum under the budget.
After each run, zmqsync's live publishes are timed at the collector points' sizes
(`live`): the same sharing of the trainer's tensors, a round trip per publish.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .config import ROOT, SIZES, BenchConfig
from .machine import meminfo
from .plan import SAFETY, iterations, padded_bytes
from .results import Results, p50, p99
from .units import GiB, gib

# What one receiver process holds before any weights: an interpreter with torch and
# torchrl imported (0.2-0.6 GiB anonymous each, read from an OOM report of a 32-receiver
# run). The plan's data budget leaves these out; at 32 or 64 receivers they are most of it.
RECEIVER_BYTES = GiB * 6 // 10


class TorchrlBaseline:
    """Plans, runs and records torchrl's sends for one N at a time; `close()` kills."""

    def __init__(
        self, cfg: BenchConfig, results: Results, env: dict[str, str], log_dir: Path
    ) -> None:
        self.cfg, self.results, self.env, self.log_dir = cfg, results, env, log_dir
        self.proc: subprocess.Popen[str] | None = None

    def close(self) -> None:
        """Kill the subprocess's group if one is running. Idempotent."""
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(10)

    def plan(self, n: int) -> list[dict[str, Any]]:
        """The points to measure with `n` receivers; the others get their skip reason."""
        cfg = self.cfg
        points: list[dict[str, Any]] = []
        held = 0
        available = meminfo().get("MemAvailable")
        processes = n * RECEIVER_BYTES
        for key in cfg.sizes:
            size = SIZES[key]
            s = padded_bytes(size)
            for variant in ("collector", "own"):
                # the sender's buffers: the trained model's (collector), or a copy too (own)
                sender = (1 if variant == "collector" else 2) * s
                reason = ""
                if available is not None and processes > available - SAFETY:
                    reason = (
                        f"skipped: {n} receiver processes need about {gib(processes)}, "
                        f"{gib(available)} available"
                    )
                elif size.kind == "many" and n > cfg.torchrl_many_max_workers:
                    reason = (
                        f"skipped: above {cfg.torchrl_many_max_workers} workers "
                        "(--torchrl-many-max-workers): seconds per send, minutes to connect"
                    )
                elif variant == "own" and (n + 1) * s > cfg.torchrl_volume_cap:
                    reason = (
                        f"skipped: copies {gib((n + 1) * s)} per send "
                        f"(cap {gib(cfg.torchrl_volume_cap)})"
                    )
                elif held + sender > cfg.mem_budget:
                    budget = gib(cfg.mem_budget)
                    reason = f"skipped: torchrl holds every size at once; over {budget}"
                elif (
                    available is not None
                    and (need := processes + held + sender + n * s) > available - SAFETY
                ):
                    # besides the sender's buffers, each receiver builds its own model
                    reason = (
                        f"skipped: {n} receivers with a model each need about {gib(need)}, "
                        f"{gib(available)} available"
                    )
                if reason:
                    self.record(n, key, variant, status=reason)
                    continue
                held += sender
                iters, _ = iterations(cfg, size, (n + 1) * s if variant == "own" else s)
                points.append(
                    {
                        "key": key,
                        "kind": size.kind,
                        "nbytes": size.target,
                        "variant": variant,
                        "iters": iters,
                        "warmup": 1,
                        "min_iters": min(3, cfg.min_iters),
                        "max_seconds": cfg.phase_seconds,
                    }
                )
        return points

    def record(
        self, n: int, key: str, variant: str, status: str, lat: Sequence[float] = ()
    ) -> None:
        """`status` (and the latencies, if any) on every row of (n, key)."""
        for row in self.results.rows:
            if row.n == n and row.size == key:
                suffix = "_own" if variant == "own" else ""
                setattr(row, f"torchrl{suffix}_status", status)
                if lat:
                    setattr(row, f"torchrl{suffix}_p50", p50(lat))
                    setattr(row, f"torchrl{suffix}_p99", p99(lat))
                    row.samples[f"torchrl{suffix}"] = list(lat)

    def measure(self, n: int, points: list[dict[str, Any]]) -> None:
        """Run `points` with `n` receivers; the run's summary goes to results.torchrl_runs."""
        spec = {
            "workers": n,
            "points": points,
            "start_method": self.cfg.torchrl_start_method,
            "connect_timeout": self.cfg.timeout,
        }
        # Deadline per point (a dead receiver blocks send() forever): receivers connect,
        # then sends for 3 × phase_seconds at most, the last one at a pessimistic
        # 0.5 GB/s per copy; the clock restarts at each point's result line.
        biggest = max(padded_bytes(SIZES[p["key"]]) for p in points)
        per_point = (
            self.cfg.timeout + 30.0 + 4 * self.cfg.phase_seconds + 2 * (n + 1) * biggest / 1e9
        )
        log_path = self.log_dir / f"torchrl-{n}.log"
        run: dict[str, Any] = {"workers": n, "status": "ok", "deadline_per_point_s": per_point}
        t_run = time.perf_counter()
        done: set[tuple[str, str]] = set()
        with open(log_path, "w") as err:
            proc = self.proc = subprocess.Popen(
                [sys.executable, "-m", "tools.bench.grid.worker", "torchrl", json.dumps(spec)],
                stdout=subprocess.PIPE,
                stderr=err,
                text=True,
                env=self.env,
                cwd=ROOT,
                start_new_session=True,
            )
            try:
                self._follow(proc, n, run, done, per_point, budget=60.0 + per_point)
            finally:
                self._end(proc)
        if proc.returncode not in (0, None) and run["status"] == "ok":
            run["status"] = f"exited {proc.returncode}"
        if run["status"] != "ok":
            tail = log_path.read_text()[-800:].strip().splitlines()
            run["stderr_tail"] = tail[-6:]
        for p in points:
            if (p["key"], p["variant"]) not in done:
                why = run["status"] if run["status"] != "ok" else "no result"
                self.record(n, p["key"], p["variant"], f"error: {why}"[:300])
        run["seconds"] = time.perf_counter() - t_run
        # zmqsync's counterpart of the collector path, at the same sizes and N (imported
        # here: `python -m tools.bench.grid.live` must not find itself imported already)
        from .live import measure_live

        run["live"] = measure_live(
            self.cfg, self.results, n, points, self.env, self.log_dir / f"live-{n}.log"
        )
        self.results.torchrl_runs.append(run)

    def _follow(
        self,
        proc: subprocess.Popen[str],
        n: int,
        run: dict[str, Any],
        done: set[tuple[str, str]],
        per_point: float,
        budget: float,
    ) -> None:
        """Record the subprocess's result lines until it ends or misses a deadline."""
        lines: queue.Queue[str | None] = queue.Queue()

        def read() -> None:
            assert proc.stdout is not None
            for line in proc.stdout:
                lines.put(line)
            lines.put(None)

        threading.Thread(target=read, daemon=True).start()
        deadline = time.monotonic() + budget
        while True:
            try:
                line = lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                run["status"] = f"killed: no result within {per_point:.0f} s (deadline)"
                return
            if line is None:
                return
            if not line.startswith("{"):
                continue
            rec = json.loads(line)
            if rec.get("event") == "started":
                run.update(start_method=rec["start_method"], torchrl=rec["torchrl"])
            elif rec.get("event") == "point":
                deadline = time.monotonic() + per_point  # the next point's turn
                done.add((rec["key"], rec["variant"]))
                key = f"{rec['key']}/{rec['variant']}"
                if "error" in rec:
                    self.record(n, rec["key"], rec["variant"], f"error: {rec['error']}")
                    run.setdefault("errors", {})[key] = rec["error"]
                    continue
                self.record(n, rec["key"], rec["variant"], "ok", rec["lat"])
                run.setdefault("receivers_start_s", {})[key] = rec["start_s"]

    def _end(self, proc: subprocess.Popen[str]) -> None:
        """Kill the group (forkserver children included) and reap the subprocess."""
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(10)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # forkserver children, if any
        if proc.stdout is not None:
            proc.stdout.close()
        self.proc = None
