"""Bounded staleness, shown: an asynchronous trainer publishes after every step to
rollout workers of different speeds, once per ``max_lag`` in {0, 1, 2, none}.

    python -m tools.bench staleness                   # the table, docs/bench/staleness.json
    python -m tools.bench staleness--plot docs/img    # and staleness.png (needs matplotlib)

Each worker is a process (``python -m tools.bench staleness--worker ...``) that applies the
newest version at the start of each rollout (apply="manual", its safe point) and then
rolls out for its step time; one is several times slower than the others. The trainer
takes a step (a fixed wait, so that the figures measure the bus and the bound, not the
CPU the machine's other tenants leave) and then ``publish(max_lag=k)``. At each return
it records every worker's lag from the acks (`Publish.lags`); the table gives the
trainer's steps/s, relative to no bound, and the largest lag seen per worker. The bus
has 32 slots for every run, so that none's lag is not cut by the slots (a lag of
``slots - 1`` would be).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch

import zmqsync

sys.path.insert(0, str(Path(__file__).resolve().parent))  # its workers run it by path
from roles import subscriber  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
BOUNDS: tuple[int | None, ...] = (0, 1, 2, None)
# worker id -> seconds per rollout: the slow one is 8x the fast one
WORKERS = {"fast-a": 0.005, "fast-b": 0.005, "medium": 0.010, "slow": 0.040}
SLOTS = 32


def _label(k: int | None) -> str:
    return "none" if k is None else str(k)


def worker(name: str, worker_id: str, step: float, records: bool) -> int:
    """One rollout worker: poll (apply the newest version), roll out for `step`, again,
    until SIGTERM. Prints {"event": "joined", "version"} once started and, with
    `records`, {"event": "applied", "version", "t"} per version applied, `t` being
    ``time.monotonic()`` in `on_update`, before the ack (CLOCK_MONOTONIC is one clock
    for the host: tests/test_staleness.py compares it with when a publish returned)."""
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())

    def applied(version: int) -> None:
        print(json.dumps({"event": "applied", "version": version, "t": time.monotonic()}))
        sys.stdout.flush()

    with subscriber(
        name=name,
        worker_id=worker_id,
        apply="manual",
        timeout=60,
        on_update=applied if records else None,
    ) as sub:
        print(json.dumps({"event": "joined", "version": sub.version}), flush=True)
        while not stop.is_set():
            sub.poll()  # the safe point: the newest version, if one arrived
            stop.wait(step)  # the rollout
    return 0


def run(k: int | None, steps: int, step_s: float) -> dict[str, Any]:
    """One trainer run against fresh workers: every publish's lags, the steps/s."""
    name = f"stale{os.getpid()}"
    weights = {"w": torch.zeros(64 * 1024)}  # 256 KiB: the bus's cost, not the copy's
    procs = []
    with zmqsync.Publisher(weights, name=name, slots=SLOTS, timeout=60) as pub:
        try:
            for worker_id, rollout_s in WORKERS.items():
                cmd = [sys.executable, __file__, "--worker", name, worker_id, str(rollout_s)]
                procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True))
            for proc in procs:
                assert proc.stdout is not None
                json.loads(proc.stdout.readline())  # joined
            if not pub.wait_for_workers(len(WORKERS), timeout=60):
                raise SystemExit("the workers did not join within 60 s")
            pub.publish(max_lag=0)  # everyone at the same version first
            samples, start = [], time.perf_counter()
            for i in range(1, steps + 1):
                time.sleep(step_s)  # the training step
                p = pub.publish({"w": torch.full((64 * 1024,), float(i))}, max_lag=k)
                samples.append({"t": time.perf_counter() - start, "v": p.version, **p.lags})
            elapsed = time.perf_counter() - start
        finally:
            for proc in procs:
                proc.send_signal(signal.SIGTERM)
            for proc in procs:
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(10)
                if proc.stdout is not None:
                    proc.stdout.close()
    max_lag = {w: max(s.get(w, 0) for s in samples) for w in WORKERS}
    return {
        "max_lag": _label(k),
        "steps": steps,
        "seconds": elapsed,
        "steps_per_s": steps / elapsed,
        "max_lag_seen": max_lag,
        "samples": samples,
    }


def table(runs: list[dict[str, Any]]) -> str:
    free = next(r for r in runs if r["max_lag"] == "none")["steps_per_s"]
    lines = [
        "| max_lag | trainer steps/s | relative to no bound | largest lag seen "
        f"({', '.join(WORKERS)}) | max |",
        "|---|---|---|---|---|",
    ]
    for r in runs:
        seen = r["max_lag_seen"]
        lines.append(
            f"| {r['max_lag']} | {r['steps_per_s']:.1f} | {r['steps_per_s'] / free:.2f} | "
            f"{', '.join(str(seen[w]) for w in WORKERS)} | {max(seen.values())} |"
        )
    return "\n".join(lines)


def plot(runs: list[dict[str, Any]], out: Path) -> Path:
    """staleness.png: each worker's lag at every publish over time, one panel per bound."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(runs), 1, figsize=(8, 2.0 * len(runs)), sharex=True)
    top = max(max(r["max_lag_seen"].values()) for r in runs)
    for ax, r in zip(axes, runs, strict=True):
        ts = [s["t"] for s in r["samples"]]
        for i, w in enumerate(WORKERS):
            ax.step(ts, [s.get(w, 0) for s in r["samples"]], where="post", label=w, color=f"C{i}")
        ax.set_ylim(-0.3, top + 0.5)
        ax.set_ylabel("lag")
        ax.set_title(
            f"max_lag={r['max_lag']}: {r['steps_per_s']:.0f} steps/s, "
            f"largest lag {max(r['max_lag_seen'].values())}",
            fontsize=9,
        )
    axes[0].legend(fontsize=7, ncol=len(WORKERS), loc="upper right")
    axes[-1].set_xlabel("seconds since the first step")
    fig.suptitle("each worker's lag (versions behind) as each publish returns", fontsize=10)
    fig.tight_layout()
    out.mkdir(parents=True, exist_ok=True)
    path = out / "staleness.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--worker", nargs=3, metavar=("NAME", "ID", "STEP_S"), help=argparse.SUPPRESS)
    p.add_argument("--records", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--steps", type=int, default=150, help="publishes per bound (default 150)")
    p.add_argument(
        "--bounds",
        nargs="+",
        default=[_label(k) for k in BOUNDS],
        help="max_lag values to run, 'none' for no bound (default: 0 1 2 none)",
    )
    p.add_argument("--step-ms", type=float, default=5.0, help="training step (ms, default 5)")
    p.add_argument("--json", type=Path, default=ROOT / "docs/bench/staleness.json")
    p.add_argument("--plot", type=Path, default=None, help="directory for staleness.png")
    args = p.parse_args(argv)
    if args.worker:
        name, worker_id, step = args.worker
        return worker(name, worker_id, float(step), args.records)
    bounds = [None if b == "none" else int(b) for b in args.bounds]
    if None not in bounds:
        p.error("--bounds needs 'none': the table is relative to no bound")
    with tempfile.TemporaryDirectory(prefix="zs-stale") as runtime:
        os.environ.setdefault("ZMQSYNC_RUNTIME_DIR", runtime)
        runs = [run(k, args.steps, args.step_ms / 1e3) for k in bounds]
    print(table(runs))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    meta = {"workers_rollout_s": WORKERS, "step_ms": args.step_ms, "slots": SLOTS}
    args.json.write_text(json.dumps({"meta": meta, "runs": runs}, indent=1) + "\n")
    if args.plot is not None:
        print(f"plot: {plot(runs, args.plot)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
