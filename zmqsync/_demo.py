"""`zmqsync demo`: a trainer and N independent worker processes, verified end to end.

The trainer takes a few optimizer steps on a small MLP policy (with BatchNorm, so
int64 counters and running statistics travel too), stores a digest of the weights in a
``_checksum`` tensor, and publishes. Each worker is a separate ``zmqsync worker``
process started with `subprocess`; it checks every version it applies against that
digest. The run fails (exit 1) on any mismatch or any worker that missed the end.
"""

from __future__ import annotations

import json
import logging
import math
import os
import statistics
import subprocess
import sys
import threading
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
    latencies: list[float] = field(default_factory=list)
    nbytes: int = 0
    workers: dict[str, dict[str, Any]] = field(default_factory=dict)
    published: list[str] = field(default_factory=list)

    def ok(self, n_workers: int, last_version: int) -> bool:
        return len(self.workers) == n_workers and all(
            not w.get("mismatches")
            and w.get("last_version") == last_version
            and w.get("verified", 0) >= 1
            for w in self.workers.values()
        )


class _WorkerProcess:
    def __init__(self, cmd: list[str]) -> None:
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
        self.summary: dict[str, Any] = {}
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith("{"):
                record = json.loads(line)
                if record.get("event") == "summary":
                    self.summary = record

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
                    handle = pub.publish(weights=state)
                    result.latencies.append(handle.seconds)
                    progress.update(
                        task, advance=1, last=f"v{handle.version} {handle.seconds * 1e3:.1f} ms"
                    )
            last = pub.version
        except BaseException:
            for p in procs:
                p.proc.kill()
            raise
    for p in procs:  # the publisher's STOP ends every worker
        p.finish(timeout)
        if p.summary:
            result.workers[p.summary["worker"]] = p.summary
    result.published.append(str(last))
    return result


def render(result: DemoResult, *, workers: int, mode: str, console: Any) -> bool:
    """Print the summary tables; True when every worker verified every version."""
    from rich.table import Table

    last = int(result.published[-1]) if result.published else -1
    lat = sorted(result.latencies)
    p50 = statistics.median(lat) if lat else float("nan")
    p99 = lat[min(len(lat) - 1, math.ceil(0.99 * len(lat)) - 1)] if lat else float("nan")
    table = Table(
        title=f"zmqsync demo: {len(lat)} updates to {workers} workers ({mode} mode)",
        caption="publish = write + RECEIVE + every worker applied, verified its checksum, acked",
    )
    for col in ("model", "publish p50", "publish p99", "throughput p50"):
        table.add_column(col, justify="right")
    table.add_row(
        f"{result.nbytes / 2**20:.1f} MiB",
        f"{p50 * 1e3:.2f} ms",
        f"{p99 * 1e3:.2f} ms",
        f"{result.nbytes / p50 / 1e9:.2f} GB/s to each worker",
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
    ok = result.ok(workers, last)
    if ok:
        console.print(
            f"[green]OK[/green]: every worker verified every version it applied; "
            f"all reached v{last}"
        )
    else:
        console.print(
            f"[red]FAILED[/red]: mismatches, missing workers, or workers short of v{last}"
        )
    return ok
