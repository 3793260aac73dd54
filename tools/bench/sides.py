"""The one runner of two sides that take turns: two checkouts, or two environments.

    python -m tools.bench sides --base REF [--head REF] [OPTIONS] SCENARIO [QUESTION] [ARGS]

runs ``python -m tools.bench SCENARIO [QUESTION] [ARGS]`` on side A (``--base``) and side
B (``--head``), round after round, A B, B A, A B, ... (``--rounds``), in one run, so a
shared machine's drift hits both alike; then prints every figure the runs wrote, per
side (median and range over the rounds), and B's median over A's. A side is:

* a tree: ``--base``/``--head`` take a commit (checked out once as a git worktree under
  /tmp/zmqsync-sides/, its native extension built there), a path to a checkout, or
  ``.`` (this one, the default head). The side's process runs in its tree with
  ``PYTHONPATH=TREE``: that tree's ``zmqsync`` and that tree's harness.
* a Python: ``--base-python``/``--head-python`` (another environment; default this one).
* a command: ``--base-cmd``/``--head-cmd``, a template with ``{python}``, ``{args}``
  (SCENARIO, QUESTION and ARGS as given), ``{options}`` (ARGS alone) and ``{out}`` (an
  empty directory per run, where the run writes its JSON). Default: ``{python} -m
  tools.bench {args}`` and the scenario's option that writes JSON into ``{out}``
  (`OUTPUT`). A checkout from before the harness left the package runs its own:
  ``--base-cmd '{python} -m zmqsync bench {options} --out {out}'``.

The figures come from the JSON a run wrote: the grid's rows (p50, the raw round trip
and ×floor per point), the trainer loop's records, the fixed cost's sides, the joins'
times per storm, or, for any other scenario, every number in the JSON by its path (lists of numbers by their median);
a run that wrote no JSON is compared on the numbers it printed, each named by its line's
words and its place in the line.

    python -m tools.bench sides --base 51e0b8f --base-cmd '{python} -m zmqsync bench {options} --out {out}' grid --quick
    python -m tools.bench sides --base HEAD~3 fixed --workers 8 --publishes 300
    python -m tools.bench sides --base HEAD --head-python /opt/venv2/bin/python staleness
"""  # noqa: E501

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
TREES = Path("/tmp/zmqsync-sides")  # commits checked out as worktrees, kept for the next run

# scenario (or "scenario question") -> the options that make it write its JSON into {out}
OUTPUT: dict[str, str] = {
    "grid": "--no-plot --out {out}",
    "trainer": "--no-plot --out {out}",
    "fixed": "--json {out}/run.json",
    "fixed rounds": "--json {out}/run.json",
    "fixed cpu": "--json {out}/run.json",
    "joins cost": "--json {out}/run.json",
    "staleness": "--json {out}/run.json",
    "metrics": "--json {out}/run.json",
}

Figures = dict[str, float]
MAX_UNNAMED = 16  # a longer list of objects without a text field is read as samples


@dataclass
class Side:
    """One side: where it runs (tree), with what (python), and how (command template)."""

    label: str
    tree: Path
    python: str
    command: str
    figures: list[Figures] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)


# --- the sides' trees -------------------------------------------------------------------


def _git(*args: str) -> str:
    return subprocess.run(
        ["git", "-C", str(ROOT), *args], capture_output=True, text=True, check=True
    ).stdout.strip()


def checkout(ref: str, python: str) -> tuple[Path, str]:
    """The tree of `ref` (a path, or a commit checked out once) and a label for it.

    A commit's worktree gets its native extension built with the side's Python: without
    it that side copies from Python and measures something else.
    """
    path = Path(ref).expanduser()
    if path.is_dir():
        return path.resolve(), "." if path.resolve() == ROOT else str(path)
    try:
        sha = _git("rev-parse", "--verify", f"{ref}^{{commit}}")
    except subprocess.CalledProcessError:
        raise SystemExit(f"{ref!r} is neither a directory nor a commit of {ROOT}") from None
    tree = TREES / sha[:12]
    if not (tree / "zmqsync").is_dir():
        TREES.mkdir(parents=True, exist_ok=True)
        _git("worktree", "add", "--detach", str(tree), sha)
    if not list((tree / "zmqsync").glob("_native*.so")):
        subprocess.run(
            [python, "setup.py", "build_ext", "--inplace"],
            cwd=tree, capture_output=True, check=True, timeout=600,
        )  # fmt: skip
    return tree, f"{ref} ({sha[:7]})"


# --- the figures of a run ---------------------------------------------------------------


def _grid(data: dict[str, Any]) -> Figures:
    out: Figures = {}
    for r in data["rows"]:
        if r.get("status") != "ok" or r.get("zmqsync_p50") is None:
            continue
        point = f"{r['n']} × {r['label']} {r['mode']}"
        out[f"{point}: p50 ms"] = r["zmqsync_p50"] * 1e3
        if r.get("raw_p50"):
            out[f"{point}: raw p50 ms"] = r["raw_p50"] * 1e3
        if r.get("x_floor"):
            out[f"{point}: ×floor"] = r["x_floor"]
    for mode, late in (data.get("late_join") or {}).items():
        if isinstance(late, dict) and late.get("p50") is not None:
            out[f"late join {mode}: p50 ms"] = late["p50"] * 1e3
    return out


def _trainer(data: list[dict[str, Any]]) -> Figures:
    out: Figures = {}
    for r in data:
        if r.get("status") != "ok" or "steps_per_s" not in r:
            continue
        point = f"{r['size_mb']} MB {r['way']}"
        out[f"{point}: steps/s"] = r["steps_per_s"]
        if r.get("blocked_p50") is not None:
            out[f"{point}: blocked p50 ms"] = r["blocked_p50"] * 1e3
    return out


def _fixed(data: dict[str, Any]) -> Figures:
    out: Figures = {}
    for result in data["results"]:
        raw = result["samples"].get("raw")
        for side, samples in result["samples"].items():
            p50 = statistics.median(samples)
            out[f"{result['workers']} workers {side}: p50 ms"] = p50 * 1e3
            if raw and side != "raw":
                out[f"{result['workers']} workers {side}: ×raw"] = p50 / statistics.median(raw)
    return out


def _joins(data: dict[str, Any]) -> Figures:
    out: Figures = {}
    for storm, samples in data["results"].items():
        if isinstance(samples, dict):  # before the runner: {side: samples}, one side here
            samples = next(iter(samples.values()), [])
        joined = [t for s in samples for t in s["joined"]]
        asked = len(joined) + sum(len(s["failed"]) for s in samples)
        out[f"{storm}: joined of {asked}"] = len(joined)
        if joined:
            out[f"{storm}: join p50 ms"] = statistics.median(joined) * 1e3
            out[f"{storm}: join max ms"] = max(joined) * 1e3
        if samples:
            out[f"{storm}: publish p50 ms"] = statistics.median(s["publish"] for s in samples) * 1e3
    return out


def _leaves(data: Any, path: str = "") -> Iterator[tuple[str, float]]:
    """Every number of a JSON document by its path; a list of numbers by its median, a list
    of objects by their text fields (or their place, up to `MAX_UNNAMED` of them)."""
    if isinstance(data, bool) or data is None:
        return
    if isinstance(data, int | float):
        yield path, float(data)
    elif isinstance(data, dict):
        for key, value in data.items():
            if key not in ("config", "machine", "command", "started", "seconds", "load"):
                yield from _leaves(value, f"{path}.{key}" if path else str(key))
    elif isinstance(data, list) and data and all(isinstance(x, int | float) for x in data):
        yield path, float(statistics.median(data))
    elif isinstance(data, list):
        for i, item in enumerate(data):
            names = [str(v) for v in item.values() if isinstance(v, str)] if isinstance(
                item, dict) else []  # fmt: skip
            if not names and len(data) > MAX_UNNAMED:
                return  # samples, not figures: a run's own summary names its figures
            yield from _leaves(item, f"{path}[{' '.join(names) or i}]")


def _printed(text: str) -> Figures:
    """The numbers a run printed, each named by its line's words and its place in it."""
    out: Figures = {}
    number = re.compile(r"^[-+]?\d+(?:\.\d+)?(?:e[-+]?\d+)?[×x%]?$")
    for line in text.splitlines():
        tokens = [t for t in re.split(r"[\s│|┃,;()]+", line) if t]
        words = " ".join(t for t in tokens if not number.match(t))
        values = [t.rstrip("×x%") for t in tokens if number.match(t)]
        for i, value in enumerate(values):
            out.setdefault(f"{words} #{i + 1}", float(value))
    return out


READERS: dict[str, Callable[[Any], Figures]] = {
    "grid": _grid,
    "trainer": _trainer,
    "fixed": _fixed,
    "fixed rounds": _fixed,
    "joins cost": _joins,
}


def figures(scenario: str, out: Path, stdout: str) -> Figures:
    """What a run measured: from the JSON it wrote into `out`, else from what it printed."""
    files = sorted(out.glob("*.json"))
    if not files:
        return _printed(stdout)
    data = json.loads(files[0].read_text())
    reader = READERS.get(scenario)  # "fixed" is its default question's, not "fixed cpu"'s
    return reader(data) if reader else dict(_leaves(data))


# --- rounds -----------------------------------------------------------------------------


def run_once(side: Side, args: list[str], scenario: str, timeout: float) -> None:
    """One run of the scenario on `side`; its figures (or why it failed) kept on it."""
    out = Path(tempfile.mkdtemp(prefix="zmqsync-sides-"))
    options = args[len(scenario.split(" ")) :]
    command = side.command.format(
        python=shlex.quote(side.python),
        args=shlex.join(args),
        options=shlex.join(options),
        out=shlex.quote(str(out)),
    )
    proc = subprocess.Popen(
        command, shell=True, cwd=side.tree, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, env={**_env(), "PYTHONPATH": str(side.tree)}, start_new_session=True,
    )  # fmt: skip
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
        if proc.returncode != 0:
            tail = (stderr.strip().splitlines() or ["no output"])[-1]
            side.failures.append(f"rc {proc.returncode}: {tail[:200]}")
        else:
            side.figures.append(figures(scenario, out, stdout))
    except subprocess.TimeoutExpired:
        side.failures.append(f"timed out after {timeout:.0f} s")
    finally:
        if proc.poll() is None:  # a run cut short: its whole session goes (workers too)
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)
        shutil.rmtree(out, ignore_errors=True)


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}


def _scenario(args: list[str]) -> str:
    """``grid`` or ``fixed rounds``: the scenario and, when given, its question."""
    sys.path.insert(0, str(ROOT))
    from tools.bench.__main__ import SCENARIOS

    if not args or args[0] not in SCENARIOS:
        raise SystemExit(f"sides: name a scenario ({', '.join(SCENARIOS)}), not {args[:1]}")
    if len(args) > 1 and args[1] in SCENARIOS[args[0]]:
        return f"{args[0]} {args[1]}"
    return args[0]


def _default_command(scenario: str) -> str:
    output = OUTPUT.get(scenario, "")  # each question's own: "fixed cold-calls" has none
    return f"{{python}} -m tools.bench {{args}} {output}".strip()


# --- the report -------------------------------------------------------------------------


def compare(a: Side, b: Side) -> list[dict[str, Any]]:
    """Per figure both sides have: each side's median and range, and B's median over A's."""
    rows = []
    names = [k for f in a.figures for k in f]
    for name in dict.fromkeys(names):
        va = [f[name] for f in a.figures if name in f]
        vb = [f[name] for f in b.figures if name in f]
        if not va or not vb:
            continue
        ma, mb = statistics.median(va), statistics.median(vb)
        rows.append({
            "figure": name, "a": ma, "a_range": (min(va), max(va)),
            "b": mb, "b_range": (min(vb), max(vb)), "ratio": mb / ma if ma else None,
            "overlap": min(va) <= max(vb) and min(vb) <= max(va),
        })  # fmt: skip
    return rows


def _fmt(x: float) -> str:
    return f"{x:.3g}" if abs(x) < 1000 else f"{x:.0f}"


def report(a: Side, b: Side, rows: list[dict[str, Any]], title: str) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    for column in ("figure", f"A: {a.label}", f"B: {b.label}", "B/A", "ranges overlap"):
        table.add_column(column, justify="left" if column == "figure" else "right")
    for r in rows:
        ra, rb = r["a_range"], r["b_range"]
        table.add_row(
            r["figure"],
            f"{_fmt(r['a'])} ({_fmt(ra[0])}–{_fmt(ra[1])})",
            f"{_fmt(r['b'])} ({_fmt(rb[0])}–{_fmt(rb[1])})",
            f"{r['ratio']:.2f}" if r["ratio"] is not None else "–",
            "yes" if r["overlap"] else "no",
        )
    console = Console()
    console.print(table)
    ratios = [r["ratio"] for r in rows if r["ratio"]]
    if ratios:
        overlap = sum(r["overlap"] for r in rows)
        console.print(
            f"{len(rows)} figures: median B/A {statistics.median(ratios):.2f} "
            f"({min(ratios):.2f}–{max(ratios):.2f}); ranges overlap at {overlap} of {len(rows)}"
        )
    for side in (a, b):
        for why in side.failures:
            console.print(f"[red]{side.label}: a run failed: {why}[/red]")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tools.bench sides",
        description=__doc__.split("\n\n")[0],
        epilog="SCENARIO [QUESTION] [ARGS] as for python -m tools.bench; --help above for more",
    )
    parser.add_argument("--base", required=True, help="side A: a commit, a checkout, or .")
    parser.add_argument("--head", default=".", help="side B (default: this checkout)")
    parser.add_argument("--base-python", default=sys.executable, help="side A's interpreter")
    parser.add_argument("--head-python", default=sys.executable, help="side B's interpreter")
    parser.add_argument("--base-cmd", help="side A's command: {python} {args} {options} {out}")
    parser.add_argument("--head-cmd", help="side B's command: {python} {args} {options} {out}")
    parser.add_argument("--rounds", type=int, default=2, help="runs per side (A B, B A, ...)")
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds per run")
    parser.add_argument("--json", type=Path, help="write every run's figures here")
    parser.add_argument("scenario", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    scenario = _scenario(args.scenario)
    sides = []
    for which in ("base", "head"):
        python = getattr(args, f"{which}_python")
        tree, label = checkout(getattr(args, which), python)
        command = getattr(args, f"{which}_cmd") or _default_command(scenario)
        sides.append(Side(label, tree, python, command))
    a, b = sides
    from rich.progress import Progress

    started = time.monotonic()
    with Progress(transient=True) as progress:
        task = progress.add_task(scenario, total=2 * args.rounds)
        for i in range(args.rounds):
            for side in (a, b) if i % 2 == 0 else (b, a):
                progress.update(task, description=f"{scenario}: {side.label} ({i + 1})")
                run_once(side, args.scenario, scenario, args.timeout)
                progress.advance(task)
                if args.json:  # after every run: a runner cut short keeps what it measured
                    _write(args.json, args.scenario, args.rounds, a, b)
    rows = compare(a, b)
    minutes = (time.monotonic() - started) / 60
    report(a, b, rows, f"{' '.join(args.scenario)}: {args.rounds} rounds, {minutes:.0f} min")
    return 0 if not (a.failures or b.failures) and rows else 1


def _write(path: Path, scenario: list[str], rounds: int, a: Side, b: Side) -> None:
    """Every run's figures, per side, and the comparison so far."""
    record = {
        "scenario": scenario, "rounds": rounds,
        "sides": [{"label": s.label, "tree": str(s.tree), "python": s.python,
                   "command": s.command, "figures": s.figures, "failures": s.failures}
                  for s in (a, b)],
        "compared": compare(a, b),
    }  # fmt: skip
    path.write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    sys.exit(main())
