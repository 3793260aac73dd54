"""Where a copy-mode publish spends its time, step by step, three ways side by side.

The same model is published three ways in one process, each to its own N copy-mode
worker processes (real `Subscriber`s started with subprocess), in alternating rounds so
that drift on a shared machine hits every way alike:

* ``home``: ``Copy(flat=True)``: the trainer's tensors live in a slot of the segment; a
  publish announces it and copies it to the next free slot while the workers read;
* ``home-py``: the same, with the check that every tensor is at its place made from
  Python (`_places.at_reference`) instead of the C++ pass;
* ``block``: the same flat layout with the block in private memory (what ``flat=True``
  does without torch's pointer swap): a publish copies the block into a free slot, then
  announces;
* ``tensors``: ``Copy()``: a publish copies tensor by tensor, then announces.

Each publish's steps are timed by wrapping the library's own methods (read and check,
claim, the block's write, the announcement, the home slot's copy, the wait for acks),
so the table says which step a way saves. It is the measurement behind "The home slot"
in docs/benchmarks.md.

    .venv/bin/python -m tools.bench steps ways --model many --workers 1 --rounds 5
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import Any

from rich.console import Console
from rich.table import Table

import zmqsync
from tools.bench.grid.worker import make_model
from zmqsync import _announcer, _home, _places, _publisher, _slots, _write_modes

WAYS = ("home", "home-py", "block", "tensors")
SIZES = {"4k": ("mlp", 4 << 10), "4m": ("mlp", 4 << 20), "many": ("many", 4 << 20)}
STEPS = (
    (_write_modes.CopyWrites, "read", "read + check"),
    (_write_modes.Mode, "claim", "claim"),
    (_slots.Slots, "write_block", "block write"),
    (_slots.Slots, "write", "tensor writes"),
    (_announcer.Announcer, "send", "RECEIVE send"),
    (_home.HomeBlock, "move_to", "home copy"),
    (_publisher.Publish, "wait", "wait for acks"),
)

_WORKER = r"""
import sys
from tools.bench.grid.worker import make_model
from tools.bench.roles import subscriber
name, shm, kind, nbytes = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
model = make_model(kind, nbytes, fill=False)[0]
flat = kind == "many"
with subscriber(name=name, model=model, mode="copy", flat=flat, shm_dir=shm):
    sys.stdin.read()
"""

Samples = dict[str, list[float]]


def _timed(samples: dict[str, Samples], way: list[str]) -> Iterator[None]:
    """Wrap each step's method so that every call is timed under the current way."""
    originals = []
    for cls, attr, label in STEPS:
        method = getattr(cls, attr)
        originals.append((cls, attr, method))

        @functools.wraps(method)
        def timed(*args: Any, _m: Callable[..., Any] = method, _l: str = label, **kw: Any) -> Any:
            t = time.perf_counter()
            try:
                return _m(*args, **kw)
            finally:
                if way[0]:  # not a warm-up publish
                    samples[way[0]].setdefault(_l, []).append(time.perf_counter() - t)

        setattr(cls, attr, timed)
    try:
        yield
    finally:
        for cls, attr, method in originals:
            setattr(cls, attr, method)


def _started(way: str, model: Any, name: str, shm: str) -> zmqsync.Publisher:
    # `block`: the flat layout as it is without torch's pointer swap, which the write
    # mode looks up when it is built
    swap = vars(_write_modes)["SWAP_DATA_PTR"]
    if way == "block":
        vars(_write_modes)["SWAP_DATA_PTR"] = None
    try:
        writes = zmqsync.Copy(flat=way != "tensors")  # home-py: `main` switches the check
        return zmqsync.Publisher(model, name=name, writes=writes, shm_dir=shm, timeout=60).start()
    finally:
        vars(_write_modes)["SWAP_DATA_PTR"] = swap


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=tuple(SIZES), default="many")
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--iters", type=int, default=200, help="publishes per way per round")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)
    kind, nbytes = SIZES[args.model]
    shm = tempfile.mkdtemp(dir="/dev/shm", prefix="zmqsync-steps-")
    os.environ["ZMQSYNC_RUNTIME_DIR"] = shm
    samples: dict[str, Samples] = {way: {} for way in WAYS}
    totals: dict[str, list[float]] = {way: [] for way in WAYS}
    procs: list[subprocess.Popen[bytes]] = []
    way = [""]
    with contextlib.ExitStack() as stack:
        stack.callback(shutil.rmtree, shm, True)
        pubs = {}
        for w in WAYS:
            name = f"steps-{w}-{os.getpid()}"
            pub = stack.enter_context(
                _started(w, make_model(kind, nbytes, fill=True)[0], name, shm)
            )
            pubs[w] = pub
            for _ in range(args.workers):
                cmd = [sys.executable, "-c", _WORKER, name, shm, kind, str(nbytes)]
                procs.append(subprocess.Popen(cmd, stdin=subprocess.PIPE))
            if not pub.wait_for_workers(args.workers, timeout=120):
                raise SystemExit(f"{w}: workers did not join in 120 s")

        def stop_workers() -> None:
            for proc in procs:
                with contextlib.suppress(OSError):
                    proc.stdin.close()  # type: ignore[union-attr]
            for proc in procs:
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    proc.kill()

        stack.callback(stop_workers)
        with contextlib.contextmanager(_timed)(samples, way):
            checks = {w: _places.at_reference if w == "home-py" else _places.at for w in WAYS}
            for _ in range(args.rounds):
                for w in WAYS:
                    _places.at = checks[w]
                    for i in range(args.iters + 10):  # 10 warm-up publishes per round
                        way[0] = w if i >= 10 else ""
                        t = time.perf_counter()
                        pubs[w].publish()
                        if way[0]:
                            totals[w].append(time.perf_counter() - t)
    table = Table(title=f"{args.model}, {args.workers} copy workers: p50 µs per publish")
    table.add_column("step")
    for w in WAYS:
        table.add_column(w, justify="right")
    labels = [label for _, _, label in STEPS]
    for label in ("publish", *labels):
        cells = []
        for w in WAYS:
            got = totals[w] if label == "publish" else samples[w].get(label, [])
            cells.append(f"{statistics.median(got) * 1e6:.0f}" if got else "-")
        if any(c != "-" for c in cells):
            table.add_row(label, *cells)
    Console().print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
