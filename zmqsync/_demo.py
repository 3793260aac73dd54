"""`zmqsync demo`: a trainer and N independent worker processes, verified end to end.

The trainer takes a few optimizer steps on a small MLP policy (with BatchNorm, so
int64 counters and running statistics travel too), stores a digest of the weights in a
``_checksum`` tensor, and publishes. Each worker is a separate ``zmqsync worker``
process started with `subprocess`; it checks every version it applies against that
digest. The run fails (exit 1) on any mismatch or any worker that missed the end.

Two numbers come out of each publish, and the headline is the bus's own: the time from
`publish()` until every worker has applied the version (each worker stamps the moment
its `on_update` starts, just after the apply, on the clock all processes of the host
share). The checksum each worker then computes (blake2b over every byte) and its ack
close the publish's round trip, the second number: on 2 cores four workers hashing
64 MiB take far longer than the bus, and a newcomer must not take one for the other.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from ._checksum import CHECKSUM_KEY, digest, digest_tensor
from ._layout import Key, flatten
from ._publisher import Publisher

__all__ = ["DemoResult", "run_demo"]

log = logging.getLogger(__name__)


def make_policy(size_mb: float) -> torch.nn.Sequential:
    """An MLP of about `size_mb` MiB: Linear layers, a BatchNorm, a bf16 head."""
    hidden = max(16, int(math.sqrt(size_mb * 2**20 / 4 / 2)))
    model = torch.nn.Sequential(
        torch.nn.Linear(32, hidden),
        torch.nn.ReLU(),
        torch.nn.Linear(hidden, hidden),
        torch.nn.BatchNorm1d(hidden),
        torch.nn.ReLU(),
        torch.nn.Linear(hidden, hidden),
        torch.nn.Linear(hidden, 8),
    )
    model[-1].to(torch.bfloat16)  # mixed dtypes travel too
    return model


_TORCH_PROCESS_BYTES = 300 * 2**20  # what a process that imported torch holds anyway


def check_resources(
    *, workers: int, size_mb: float, slots: int, mode: str, shm_dir: str | None = None
) -> None:
    """Refuse, with what fits, a demo this host cannot hold (before allocating anything).

    The trainer holds the policy and its gradients, the segment `slots` copies (in the
    shm dir's tmpfs, which is memory too), each copy-mode worker one more copy, and every
    process torch itself.

    Raises:
        ValueError: not enough memory or shm space; the message says how much is needed.
    """
    from . import _config

    model = size_mb * 2**20
    shm_needed = 4096 + slots * model
    per_worker = model if mode == "copy" else 0.0
    mem_needed = shm_needed + 2 * model + workers * per_worker
    mem_needed += (workers + 1) * _TORCH_PROCESS_BYTES
    directory = _config.shm_dir(shm_dir)
    st = os.statvfs(directory)
    shm_free = st.f_bavail * st.f_frsize
    mem_free = _available_memory()
    gib = 2**30
    if shm_needed > shm_free or (mem_free is not None and mem_needed > mem_free):
        have = f"{shm_free / gib:.1f} GiB free in {directory}"
        if mem_free is not None:
            have += f" and {mem_free / gib:.1f} GiB of memory available"
        raise ValueError(
            f"--size-mb {size_mb:g} with {workers} workers ({mode} mode, {slots} slots) needs "
            f"about {shm_needed / gib:.1f} GiB in {directory} and {mem_needed / gib:.1f} GiB of "
            f"memory in all; this host has {have}: use a smaller --size-mb, fewer --workers "
            "or --mode alias"
        )


def _available_memory() -> int | None:
    """MemAvailable from /proc/meminfo, in bytes (None where there is none)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _state(model: torch.nn.Sequential) -> dict[Key, torch.Tensor]:
    flat = flatten(model)
    flat[CHECKSUM_KEY] = digest_tensor(digest(flat))
    return flat


def _train_step(model: torch.nn.Sequential, opt: torch.optim.Optimizer) -> None:
    x = torch.randn(64, 32)
    hidden = model[:-1](x)
    loss = model[-1](hidden.bfloat16()).float().pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()


@dataclass
class DemoResult:
    latencies: list[float] = field(default_factory=list)  # publish(): round trip, verified
    applied: list[float] = field(default_factory=list)  # publish() -> every worker applied
    nbytes: int = 0
    workers: dict[str, dict[str, Any]] = field(default_factory=dict)
    exit_codes: dict[str, int | None] = field(default_factory=dict)
    published: list[str] = field(default_factory=list)

    def ok(self, n_workers: int, last_version: int) -> bool:
        return not self.problems(n_workers, last_version)

    def problems(self, n_workers: int, last_version: int) -> list[str]:
        """Why the run failed, one phrase per worker at fault (empty: it did not)."""
        out = []
        for wid, rc in sorted(self.exit_codes.items()):
            if wid not in self.workers:
                out.append(f"{wid} printed no summary (exit status {rc})")
        for wid, w in sorted(self.workers.items()):
            if w.get("mismatches"):
                out.append(f"{wid}: checksum mismatch at versions {w['mismatches']}")
            if w.get("last_version") != last_version:
                out.append(f"{wid} stopped at v{w.get('last_version')}, not v{last_version}")
            if w.get("verified", 0) < 1:
                out.append(f"{wid} verified nothing")
        if len(self.exit_codes) < n_workers:
            out.append(f"only {len(self.exit_codes)} of {n_workers} workers ran")
        return out


class _WorkerProcess:
    def __init__(self, cmd: list[str]) -> None:
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
        self.summary: dict[str, Any] = {}
        self.applied: dict[int, float] = {}  # version -> when this worker had applied it
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith("{"):
                record = json.loads(line)
                if record.get("event") == "summary":
                    self.summary = record
                elif record.get("event") == "applied":
                    self.applied[record["version"]] = record["applied_ts"]

    def finish(self, timeout: float) -> None:
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)
        self._reader.join(5)


def run_demo(
    *,
    workers: int,
    updates: int,
    size_mb: float,
    mode: str,
    slots: int = 2,
    timeout: float = 30.0,
    console: Any = None,
) -> DemoResult:
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    torch.manual_seed(0)
    model = make_policy(size_mb)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    name = f"demo-{os.getpid()}"
    result = DemoResult()
    procs: list[_WorkerProcess] = []
    started: dict[int, float] = {}  # version -> when publish() was called
    state = _state(model)
    with Publisher(state, name=name, slots=slots, timeout=timeout) as pub:
        result.nbytes = sum(t.numel() * t.element_size() for t in state.values())
        cmd = [
            sys.executable,
            "-m",
            "zmqsync",
            "worker",
            "--name",
            name,
            "--mode",
            mode,
            "--verify",
            "--json",
        ]
        try:
            procs = [_WorkerProcess([*cmd, "--worker-id", f"worker-{i}"]) for i in range(workers)]
            if not pub.wait_for_workers(workers, timeout=timeout):
                raise TimeoutError(
                    f"only {len(pub.workers)} of {workers} workers joined in {timeout} s"
                )
            pub.publish()  # everyone on version >= 0 acked before timing starts
            columns = (
                TextColumn("[bold]publishing"),
                BarColumn(),
                TextColumn("{task.completed}/{task.total}"),
                TextColumn("{task.fields[last]}"),
                TimeElapsedColumn(),
            )
            with Progress(*columns, console=console, transient=False) as progress:
                task = progress.add_task("publish", total=updates, last="")
                for _ in range(updates):
                    _train_step(model, opt)
                    state = _state(model)
                    started[pub.version + 1] = time.time()  # the workers' clock
                    handle = pub.publish(weights=state)
                    result.latencies.append(handle.seconds)
                    progress.update(
                        task, advance=1, last=f"v{handle.version} {handle.seconds * 1e3:.1f} ms"
                    )
            last = pub.version
        except BaseException:  # Ctrl-C, SIGTERM (cli.py raises it too), a failure
            for p in procs:
                p.proc.kill()
            for p in procs:  # reaped here: no worker outlives the demo, not even a zombie
                with contextlib.suppress(subprocess.TimeoutExpired):
                    p.proc.wait(5)
            raise
    for i, p in enumerate(procs):  # the publisher's STOP ends every worker
        p.finish(timeout)
        result.exit_codes[f"worker-{i}"] = p.proc.returncode
        if p.summary:
            result.workers[p.summary["worker"]] = p.summary
    for version, t0 in started.items():
        stamps = [p.applied.get(version) for p in procs]
        if all(t is not None for t in stamps):
            result.applied.append(max(t for t in stamps if t is not None) - t0)
    result.published.append(str(last))
    return result


def _p50_p99(values: list[float]) -> tuple[float, float]:
    lat = sorted(values)
    return statistics.median(lat), lat[min(len(lat) - 1, math.ceil(0.99 * len(lat)) - 1)]


def render(
    result: DemoResult, *, workers: int, mode: str, console: Any, updates: int | None = None
) -> bool:
    """Print the summary tables; True when every worker verified every version."""
    from rich.table import Table

    last = int(result.published[-1]) if result.published else -1
    size = f"{result.nbytes / 2**20:.1f} MiB"
    table = Table(
        title=f"zmqsync demo: {len(result.latencies)} updates of a {size} policy to {workers} "
        f"workers ({mode} mode)",
        caption="applied: write a slot, RECEIVE, the version applied in every worker (the "
        "bus's latency). verified: then each worker's blake2b over all the bytes and its "
        "ack (the demo's own check, not the bus's cost)",
    )
    for col in ("publish → every worker", "p50", "p99", "throughput p50"):
        table.add_column(col, justify="right")
    if result.applied:
        p50, p99 = _p50_p99(result.applied)
        table.add_row(
            "applied",
            f"{p50 * 1e3:.2f} ms",
            f"{p99 * 1e3:.2f} ms",
            f"{result.nbytes / p50 / 1e9:.2f} GB/s to each worker",
        )
    if result.latencies:
        p50, p99 = _p50_p99(result.latencies)
        table.add_row(
            "verified + acked",
            f"{p50 * 1e3:.2f} ms",
            f"{p99 * 1e3:.2f} ms",
            "-",
        )
    console.print(table)
    per_worker = Table(title="workers")
    for col in ("worker", "versions applied", "last version", "verified", "mismatches"):
        per_worker.add_column(col, justify="right")
    for wid, w in sorted(result.workers.items()):
        per_worker.add_row(
            wid,
            str(w["applied"]),
            str(w["last_version"]),
            str(w["verified"]),
            str(len(w["mismatches"])),
        )
    console.print(per_worker)
    problems = result.problems(workers, last)
    if not problems:
        n = len(result.latencies) if updates is None else updates
        console.print(
            f"[green]OK[/green]: every worker verified every version it applied; all reached "
            f"v{last} (v0 at start, v1 a warm-up, then {n} updates)",
            soft_wrap=True,
        )
    else:
        from rich.markup import escape

        console.print(f"[red]FAILED[/red]: {escape('; '.join(problems))}", soft_wrap=True)
    return not problems
