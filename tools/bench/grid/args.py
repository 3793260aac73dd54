"""The grid on the command line: its options, the configuration they make, the run.

`add_arguments` is shared by `python -m tools.bench grid` and `trainer` (cli.py), so both
take the same options; it stays cheap (``--help`` answers at once): nothing this package
imports at module level pulls in torch, zmq, rich or matplotlib. `run_from_args` turns
SIGTERM into the Ctrl-C path, so a killed run still ends its workers and removes its
files.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import signal
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from zmqsync._cli.signals import Terminated
from zmqsync._extras import install_hint

from .config import MODES, QUICK, SIZES, BenchConfig
from .machine import torchrl_available
from .plots import plot
from .report import print_report
from .run import run_bench
from .units import GiB


def _csv_ints(text: str) -> tuple[int, ...]:
    try:
        vals = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected numbers like 1,2,4, not {text!r}") from None
    if not vals or min(vals) < 1:
        raise argparse.ArgumentTypeError("worker counts must be >= 1")
    return vals


def _csv_sizes(text: str) -> tuple[str, ...]:
    vals = tuple(x.strip() for x in text.split(",") if x.strip())
    unknown = [v for v in vals if v not in SIZES]
    if unknown or not vals:
        raise argparse.ArgumentTypeError(
            f"unknown size(s) {unknown}; choose from {', '.join(SIZES)}"
        )
    return vals


def _csv_modes(text: str) -> tuple[str, ...]:
    vals = tuple(x.strip() for x in text.split(",") if x.strip())
    if not vals or any(v not in MODES for v in vals):
        raise argparse.ArgumentTypeError("modes: copy, alias or copy,alias")
    return vals


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The grid's options (cheap: this package imports no torch at top level)."""
    p.add_argument(
        "--quick",
        action="store_true",
        help="small grid (1 and 4 workers, up to 64 MB; a 1 GB late join): a few minutes "
        "(4 on 2 busy cores)",
    )
    p.add_argument("--workers", type=_csv_ints, default=None, help="e.g. 1,2,4,8,16,32,64")
    p.add_argument(
        "--sizes",
        type=_csv_sizes,
        default=None,
        help=f"from {','.join(SIZES)} (many = 2,000 tensors, 4 MB; llm = 219 bf16 tensors, 1.1 GB)",
    )
    p.add_argument("--modes", type=_csv_modes, default=None, help="copy,alias")
    p.add_argument(
        "--iters-scale",
        type=float,
        default=None,
        help="multiply the iterations per point (default 1; --quick 0.3)",
    )
    p.add_argument("--min-iters", type=int, default=None, help="samples per point at least")
    p.add_argument(
        "--phase-seconds",
        type=float,
        default=None,
        help="stop measuring a point after this long once --min-iters are in (default 5)",
    )
    p.add_argument("--no-torchrl", action="store_true", help="skip the torchrl baseline")
    p.add_argument(
        "--torchrl-max-workers",
        type=int,
        default=None,
        help="run torchrl only up to this N (default: every N)",
    )
    p.add_argument(
        "--torchrl-many-max-workers",
        type=int,
        default=None,
        help="run torchrl on the 2,000-tensor model only up to this N (default 16)",
    )
    p.add_argument("--no-naive", action="store_true", help="skip the pickled state_dict baseline")
    p.add_argument(
        "--late-join",
        default=None,
        metavar="SIZE",
        help="model size of the late-join test (default 1G; 'none' to skip)",
    )
    p.add_argument(
        "--mem-budget-gb",
        type=float,
        default=None,
        help="skip points needing more (default min(14, 60%% of MemAvailable))",
    )
    p.add_argument(
        "--worker-threads",
        type=int,
        default=None,
        help="torch threads in each worker (default: torch's default)",
    )
    p.add_argument(
        "--timeout", type=float, default=None, help="deadline of every operation, s (default 120)"
    )
    p.add_argument(
        "--out",
        type=Path,
        default=None,
        help="directory for results.json/.csv and plots (default ./zmqsync-bench)",
    )
    p.add_argument("--plot", action="store_true", help="draw PNG plots (needs matplotlib)")
    p.add_argument("--quiet", action="store_true", help="no progress bar and no tables")
    p.add_argument(
        "--trainer",
        action="store_true",
        help="only the trainer phase: a training loop (MLP, Adam) publishing every step to "
        "alias workers, five ways side by side (none, sync, overlapped, torchrl's two); "
        "~10 minutes at the default sizes",
    )
    p.add_argument(
        "--trainer-sizes",
        type=_csv_ints,
        default=(64, 512),
        help="trainer phase model sizes in MB (default 64,512)",
    )
    p.add_argument(
        "--trainer-workers", type=int, default=8, help="trainer phase alias workers (default 8)"
    )
    p.add_argument(
        "--trainer-repeats",
        type=int,
        default=2,
        help="trainer phase: run the ways this many times, alternating their order (default 2)",
    )
    p.add_argument(
        "--no-trainer-costs",
        action="store_true",
        help="trainer phase without the partial (1 GB model) and bf16 (512 MB) publishes",
    )


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    """The grid the options ask for: the full grid or --quick, with each option applied.

    Raises:
        ValueError: --late-join names no known size.
    """
    cfg = QUICK if args.quick else BenchConfig()
    changes: dict[str, Any] = {}
    names = ("workers", "sizes", "modes", "iters_scale", "min_iters", "phase_seconds")
    more = ("worker_threads", "timeout", "out", "torchrl_max_workers", "torchrl_many_max_workers")
    for name in (*names, *more):
        if getattr(args, name, None) is not None:
            changes[name] = getattr(args, name)
    if args.no_torchrl:
        changes["torchrl"] = False
    if args.no_naive:
        changes["naive"] = False
    if args.late_join is not None:
        if args.late_join.lower() == "none":
            changes["late_join"] = None
        elif args.late_join in SIZES:
            changes["late_join"] = args.late_join
        else:
            raise ValueError(f"--late-join: unknown size {args.late_join!r}")
    if args.mem_budget_gb is not None:
        changes["mem_budget"] = int(args.mem_budget_gb * GiB)
    changes["plot"] = bool(args.plot)
    return dataclasses.replace(cfg, **changes)


@contextlib.contextmanager
def _sigterm_as_interrupt() -> Iterator[None]:
    """SIGTERM unwinds like Ctrl-C: every process ended, every file removed."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame: Any) -> None:
        raise Terminated  # a KeyboardInterrupt: exit status 143, not Ctrl-C's 130

    old = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


def run_from_args(args: argparse.Namespace, command: str = "") -> int:
    """Run the grid: print tables and targets, write files (and plots)."""
    from rich.console import Console

    cfg = config_from_args(args)
    if args.trainer:
        return _run_trainer(args, cfg.out, cfg.plot)
    if cfg.plot:  # fail before a long run, not after it
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            print(f"tools.bench grid: --plot needs matplotlib: {install_hint('plot')}",
                  file=sys.stderr)  # fmt: skip
            return 1
    console = None if args.quiet else Console(width=None if sys.stdout.isatty() else 180)
    with _sigterm_as_interrupt():
        res = run_bench(
            cfg, console, command=command or "python -m tools.bench grid " + " ".join(sys.argv[1:])
        )
    if console is not None:
        print_report(res, console)
    if cfg.plot:
        for path in plot(res, cfg.out):
            if console is not None:
                console.print(f"plot: {path}")
    if console is not None:
        console.print(f"results: {cfg.out / 'results.json'}, {cfg.out / 'results.csv'} "
                      f"({res.seconds:.0f} s)")  # fmt: skip
    return 0


def _run_trainer(args: argparse.Namespace, out: Path, plot_it: bool) -> int:
    """`python -m tools.bench trainer`: the trainer phase alone (see `trainer`)."""
    import json

    from rich.console import Console

    from .trainer import WAYS, plot_trainer, print_trainer_report, run_trainer_phase

    console = None if args.quiet else Console(width=None if sys.stdout.isatty() else 180)
    ways = WAYS if torchrl_available() == "" else WAYS[:3]
    with _sigterm_as_interrupt():
        records = run_trainer_phase(
            sizes_mb=tuple(args.trainer_sizes),
            workers=args.trainer_workers,
            ways=ways,
            costs=not args.no_trainer_costs,
            repeats=args.trainer_repeats,
            progress=(lambda what: console.print(what)) if console else (lambda what: None),
        )
    out.mkdir(parents=True, exist_ok=True)
    (out / "trainer.json").write_text(json.dumps(records, indent=1))
    if console is not None:
        print_trainer_report(records, console)
        console.print(f"results: {out / 'trainer.json'}")
    if plot_it:
        path = plot_trainer(records, out)
        if console is not None:
            console.print(f"plot: {path}")
    return 0 if all(r["status"] == "ok" for r in records) else 1
