"""The full grid: run it (plots by default), or redraw/print a past run's plots and tables.

    python -m tools.bench grid                       # the full grid, then plots (matplotlib)
    python -m tools.bench grid --quick --out /tmp/q  # the quick grid (a few minutes)
    python -m tools.bench grid --replot DIR          # redraw DIR/results.json's plots into DIR
    python -m tools.bench grid --markdown DIR        # print the tables of docs/benchmarks.md
    python -m tools.bench trainer                    # the trainer loop (grid --trainer)

``--help`` lists the grid's knobs; this adds ``--no-plot``, ``--plot-dir`` (where the PNGs
go, default: ``--out``), ``--replot`` and ``--markdown``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from . import BenchConfig, add_arguments, load_results, markdown_report, plot, run_from_args


def main(argv: list[str] | None = None, prog: str = "python -m tools.bench grid") -> int:
    """Parse the grid's options and run it (or only redraw or print a past run)."""
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    add_arguments(parser)
    parser.add_argument("--no-plot", action="store_true", help="do not draw plots")
    parser.add_argument("--plot-dir", type=Path, default=None, help="where the PNGs go")
    parser.add_argument("--replot", type=Path, metavar="DIR", help="only redraw DIR's plots")
    parser.add_argument("--markdown", type=Path, metavar="DIR", help="print DIR's tables")
    args = parser.parse_args(argv)
    if args.markdown:
        print(markdown_report(load_results(args.markdown)), end="")
        return 0
    if args.replot:
        res = load_results(args.replot)
        for path in plot(res, args.plot_dir or args.replot):
            print(f"plot: {path}")
        return 0
    args.plot = not args.no_plot
    rc = run_from_args(args, command=f"{prog} {' '.join(argv)}".strip())
    if rc == 0 and args.plot and args.plot_dir and not args.trainer:
        res = load_results(args.out or BenchConfig().out)
        for path in plot(res, args.plot_dir):
            print(f"plot: {path}")
    return rc


def trainer_main(argv: list[str] | None = None) -> int:
    """The trainer loop: the grid's ``--trainer`` phase alone."""
    argv = sys.argv[1:] if argv is None else argv
    return main(["--trainer", *argv], prog="python -m tools.bench trainer")
