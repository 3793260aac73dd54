"""The trainer phase of two (or more) checkouts, side by side in one run.

`zmqsync bench --trainer` times a training loop that publishes after every step (see
docs/benchmarks.md, "Trainer phase"). This runs its ways (none, sync, overlapped by
default) for every tree given, one process each with that tree's ``zmqsync`` imported,
alternating trees and reversing the order every other repeat, so a machine whose speed
drifts weighs on every tree alike; then prints, per tree and way, steps/s and its ratio
to the same tree's "none", and the training thread's blocked time per publish.

    .venv/bin/python tools/trainer_ab.py --trees before=/tmp/before after=. --repeats 3

Each tree must have its native extension built (``python setup.py build_ext --inplace``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import Progress
from rich.table import Table

ROOT = Path(__file__).resolve().parent.parent


def _run(tree: Path, spec: dict[str, Any], timeout: float) -> dict[str, Any]:
    env = dict(os.environ, PYTHONPATH=str(tree))
    proc = subprocess.run(
        [sys.executable, "-m", "zmqsync._bench.trainer", json.dumps(spec)],
        capture_output=True,
        text=True,
        cwd=tree,
        env=env,
        timeout=timeout,
        start_new_session=True,
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        return {**spec, "status": f"failed (rc {proc.returncode}): {tail[:200]}"}
    return {**spec, **json.loads(lines[-1]), "status": "ok"}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trees", nargs="+", required=True, help="LABEL=PATH ...")
    parser.add_argument("--ways", nargs="+", default=["none", "sync", "overlapped"])
    parser.add_argument("--size-mb", type=int, default=64)
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=900.0)
    parser.add_argument("--json", type=Path, help="write every record here")
    args = parser.parse_args()
    trees = [(label, Path(path).resolve()) for label, path in (t.split("=", 1) for t in args.trees)]
    order = [(label, tree, way) for way in args.ways for label, tree in trees]
    records: list[dict[str, Any]] = []
    with Progress(transient=True) as progress:
        task = progress.add_task("trainer phase", total=len(order) * args.repeats)
        for repeat in range(args.repeats):
            for label, tree, way in order if repeat % 2 == 0 else order[::-1]:
                progress.update(task, description=f"{label} {way} ({repeat + 1})")
                spec = {"way": way, "size_mb": args.size_mb, "workers": args.workers,
                        "steps": args.steps}  # fmt: skip
                records.append({"tree": label, **_run(tree, spec, args.timeout)})
                progress.advance(task)
    if args.json:
        args.json.write_text(json.dumps(records, indent=1))
    table = Table(title=f"trainer phase, {args.size_mb} MB, {args.workers} alias workers")
    for column in ("tree", "way", "runs ok", "steps/s", "vs none", "blocked p50 ms",
                   "to last ack p50 ms", "load"):  # fmt: skip
        table.add_column(column, justify="left" if column in ("tree", "way") else "right")
    for label, _ in trees:

        def rate(way: str, label: str = label) -> float | None:
            ok = [r for r in records if r["tree"] == label and r["way"] == way
                  and r["status"] == "ok"]  # fmt: skip
            return statistics.median(r["steps_per_s"] for r in ok) if ok else None

        none = rate("none")
        for way in args.ways:
            ok = [r for r in records if r["tree"] == label and r["way"] == way
                  and r["status"] == "ok"]  # fmt: skip
            steps = rate(way)

            def med(key: str, ok: list[dict[str, Any]] = ok) -> str:
                values = [r[key] * 1e3 for r in ok if r.get(key) is not None]
                return f"{statistics.median(values):.2f}" if values else "–"

            table.add_row(
                label,
                way,
                f"{len(ok)}/{args.repeats}",
                f"{steps:.2f}" if steps else "–",
                f"{steps / none:.2f}×" if steps and none else "–",
                med("blocked_p50"),
                med("to_last_ack_p50"),
                f"{statistics.median(r['load'] for r in ok):.0f}" if ok else "–",
            )
    Console().print(table)
    failed = [r for r in records if r["status"] != "ok"]
    for r in failed:
        print(f"{r['tree']} {r['way']}: {r['status']}", file=sys.stderr)
    return 0 if not failed else 1


if __name__ == "__main__":
    sys.exit(main())
