"""The benchmarks: `zmqsync bench` with plots, or plots/markdown from a past run.

    python tools/bench.py                       # the full grid, then plots (needs matplotlib)
    python tools/bench.py --quick --out /tmp/q  # the quick grid (a few minutes; 4 on 2 busy cores)
    python tools/bench.py --replot DIR          # redraw DIR/results.json's plots into DIR
    python tools/bench.py --markdown DIR        # print the tables of docs/benchmarks.md

Every option of `zmqsync bench` works here (see `zmqsync bench --help`); this wrapper adds
``--plot`` by default, ``--plot-dir`` (where the PNGs go, default: ``--out``),
``--replot`` and ``--markdown``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from zmqsync import _bench  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tools/bench.py", description=__doc__.splitlines()[0])
    _bench.add_arguments(parser)
    parser.add_argument("--no-plot", action="store_true", help="do not draw plots")
    parser.add_argument("--plot-dir", type=Path, default=None, help="where the PNGs go")
    parser.add_argument("--replot", type=Path, metavar="DIR", help="only redraw DIR's plots")
    parser.add_argument("--markdown", type=Path, metavar="DIR", help="print DIR's tables")
    args = parser.parse_args(argv)
    if args.markdown:
        print(_bench.markdown_report(_bench.load_results(args.markdown)), end="")
        return 0
    if args.replot:
        res = _bench.load_results(args.replot)
        for path in _bench.plot(res, args.plot_dir or args.replot):
            print(f"plot: {path}")
        return 0
    args.plot = not args.no_plot
    command = "python tools/bench.py " + " ".join(sys.argv[1:] if argv is None else argv)
    rc = _bench.run_from_args(args, command=command.strip())
    if rc == 0 and args.plot and args.plot_dir:
        res = _bench.load_results(args.out or _bench.BenchConfig().out)
        for path in _bench.plot(res, args.plot_dir):
            print(f"plot: {path}")
    return rc


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        sys.exit(130)
