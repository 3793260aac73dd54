"""The runner of checkouts side by side: sides that take turns, so drift hits each alike.

A *side* is ``LABEL[=TREE]``: ``TREE`` is a checkout whose ``zmqsync`` that side's
processes import (``PYTHONPATH=TREE``, started from ``/tmp`` so nothing else decides;
default: this checkout). Every scenario that compares checkouts or ways uses the helpers
here: `parse_side`, `tree_env`, `rotated` (the order of round ``i``), and the two role
helpers of a side's processes (`die_with_parent`, `say`). The fixed cost and the joins
alternate their sides round by round inside one run (``python -m tools.bench fixed
--sides raw zmqsync=/tmp/before zmqsync``, ``python -m tools.bench joins cost --sides
before=/tmp/before after``); whole runs that take minutes alternate here, tree by tree,
reversing the order every other repeat. The one such run today is the trainer loop:

    python -m tools.bench sides --trees before=/tmp/before after=. --repeats 3 [--ways none sync]

runs the trainer loop's ways (none, sync, overlapped by default) for every tree, one
process each with that tree's ``zmqsync`` imported, then prints, per tree and way, steps/s
and its ratio to the same tree's "none", and the training thread's blocked time per
publish. A tree from before the harness moved out of the package runs its
``tools.bench.grid.trainer``. Each tree must have its native extension built (``python
setup.py build_ext --inplace``, or a copy of this checkout's ``zmqsync/*.so``).

This file is imported by path too (a side's process is a script run from ``/tmp``): it
imports nothing of ``tools``.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import signal
import statistics
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TypeVar

ROOT = Path(__file__).resolve().parents[2]
T = TypeVar("T")


def parse_side(spec: str) -> tuple[str, Path | None]:
    """``LABEL[=TREE]`` -> (label, the tree's resolved path or None for this checkout)."""
    label, _, tree = spec.partition("=")
    return label, Path(tree).resolve() if tree else None


def tree_env(tree: Path | None, base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of a side's processes: its tree's ``zmqsync`` first."""
    return dict(base if base is not None else os.environ, PYTHONPATH=str(tree or ROOT))


def rotated(items: Sequence[T], i: int) -> list[T]:
    """Round `i`'s order: the sides rotate, so none is always first or last."""
    k = i % len(items) if items else 0
    return [*items[k:], *items[:k]]


def die_with_parent() -> None:
    """Linux: SIGKILL this process when its parent dies (no orphan keeps sockets)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() == 1:
        os._exit(1)


def say(**record: Any) -> None:
    """One JSON line on stdout: how a side's process reports to the runner."""
    print(json.dumps(record), flush=True)


def _trainer_module(tree: Path) -> str:
    if (tree / "tools" / "bench" / "grid" / "trainer.py").is_file():
        return "tools.bench.grid.trainer"
    return "zmqsync._bench.trainer"  # a checkout from before the harness left the package


def _run(tree: Path, spec: dict[str, Any], timeout: float) -> dict[str, Any]:
    env = dict(os.environ, PYTHONPATH=str(tree))
    proc = subprocess.run(
        [sys.executable, "-m", _trainer_module(tree), json.dumps(spec)],
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


def main(argv: list[str] | None = None) -> int:
    from rich.console import Console
    from rich.progress import Progress
    from rich.table import Table

    parser = argparse.ArgumentParser(
        prog="python -m tools.bench sides", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--trees", nargs="+", required=True, help="LABEL=PATH ...")
    parser.add_argument("--ways", nargs="+", default=["none", "sync", "overlapped"])
    parser.add_argument("--size-mb", type=int, default=64)
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=900.0)
    parser.add_argument("--json", type=Path, help="write every record here")
    args = parser.parse_args(argv)
    trees = [(label, tree or ROOT) for label, tree in map(parse_side, args.trees)]
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
