"""The numbers of a run: one `Row` per grid point, `Results` for the run, and its files.

Rows hold raw measurements (p50/p99 and the samples); every ratio is derived from them
on demand (`Row.ratios`), so a results.json written by an older harness is re-judged
by the current targets when it is loaded again. The files are results.json (everything,
samples and targets included) and results.csv (one flat line per row).
"""

from __future__ import annotations

import dataclasses
import json
import math
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .config import SLOTS

# --- statistics ---------------------------------------------------------------------


def p50(xs: Sequence[float]) -> float | None:
    """The median, or None without samples (a phase that measured nothing)."""
    return statistics.median(xs) if xs else None


def p99(xs: Sequence[float]) -> float | None:
    """Nearest-rank 99th percentile (the maximum below 100 samples)."""
    if not xs:
        return None
    s = sorted(xs)
    return s[min(len(s) - 1, math.ceil(0.99 * len(s)) - 1)]


def _div(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else a / b


# --- rows and runs ------------------------------------------------------------------


@dataclass
class Row:
    """One grid point: N workers, one model size, one zmqsync mode, and its baselines."""

    n: int
    size: str
    label: str
    mode: str
    nbytes: int = 0  # bytes of the model's tensors (what one publish moves)
    tensors: int = 0
    status: str = "ok"  # "ok" | "skipped: ..." | "error: ..."
    iters: int = 0
    zmqsync_p50: float | None = None
    zmqsync_p99: float | None = None
    zmqsync_lib_p50: float | None = None  # Publish.seconds as the library reports it
    raw_p50: float | None = None
    raw_p99: float | None = None
    memcpy1_p50: float | None = None
    memcpyd_p50: float | None = None
    copyn_p50: float | None = None
    naive_p50: float | None = None
    naive_p99: float | None = None
    naive_status: str = ""
    torchrl_p50: float | None = None
    torchrl_p99: float | None = None
    torchrl_status: str = ""
    torchrl_own_p50: float | None = None
    torchrl_own_p99: float | None = None
    torchrl_own_status: str = ""
    join_p50: float | None = None
    pss_delta: float | None = None  # per worker, mean: after - before (anon + shmem PSS)
    seg_pss: float | None = None  # per worker, mean: PSS of the shared segment
    extra: float | None = None  # per worker, max: pss_delta - seg_pss
    segment_bytes: int | None = None
    segment_slots: int = SLOTS  # models the segment holds (+1: the flat layout's home slot)
    seconds: float | None = None  # wall time of this row's phase, set-up included
    naive_seconds: float | None = None
    samples: dict[str, list[float]] = field(default_factory=dict)

    @property
    def memcpy_floor(self) -> float | None:
        """The faster of the single-threaded and the default-threads memcpy."""
        vals = [v for v in (self.memcpy1_p50, self.memcpyd_p50) if v is not None]
        return min(vals) if vals else None

    def ratios(self) -> dict[str, float | None]:
        """zmqsync's p50 over each baseline, throughput and memory shares."""
        floor = self.memcpy_floor
        alias_floor = None if floor is None or self.raw_p50 is None else floor + self.raw_p50
        return {
            "x_raw": _div(self.zmqsync_p50, self.raw_p50),
            "x_floor": _div(
                self.zmqsync_p50, self.copyn_p50 if self.mode == "copy" else alias_floor
            ),
            "x_torchrl": _div(self.zmqsync_p50, self.torchrl_p50),
            "x_torchrl_own": _div(self.zmqsync_p50, self.torchrl_own_p50),
            "x_naive": _div(self.zmqsync_p50, self.naive_p50),
            "gbps": _div(self.nbytes / 1e9, self.zmqsync_p50),
            "extra_frac": _div(self.extra, self.nbytes),
            "segment_frac": _div(self.segment_bytes, self.segment_slots * self.nbytes),
        }

    def flat(self) -> dict[str, Any]:
        """Every field but the samples, with the derived ratios: one CSV/JSON record."""
        d = {k: v for k, v in dataclasses.asdict(self).items() if k != "samples"}
        d.update(memcpy_floor=self.memcpy_floor, **self.ratios())
        return d


@dataclass
class Results:
    """A whole run: its configuration, the machine, the rows and the separate phases."""

    config: dict[str, Any]
    machine: dict[str, Any]
    rows: list[Row] = field(default_factory=list)
    late_join: dict[str, Any] = field(default_factory=dict)
    torchrl_runs: list[dict[str, Any]] = field(default_factory=list)
    started: float = field(default_factory=time.time)
    seconds: float = 0.0
    interrupted: bool = False
    aborted: str = ""
    command: str = ""

    def row(self, n: int, size: str, mode: str) -> Row | None:
        for r in self.rows:
            if (r.n, r.size, r.mode) == (n, size, mode):
                return r
        return None

    def to_json(self) -> dict[str, Any]:
        return {
            "command": self.command,
            "config": self.config,
            "machine": self.machine,
            "started": self.started,
            "seconds": self.seconds,
            "interrupted": self.interrupted,
            "aborted": self.aborted,
            "rows": [{**r.flat(), "samples": r.samples} for r in self.rows],
            "late_join": self.late_join,
            "torchrl_runs": self.torchrl_runs,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Results:
        """Results from a results.json; fields this version does not know are dropped."""
        names = {f.name for f in dataclasses.fields(Row)}
        res = cls(config=data["config"], machine=data["machine"])
        res.command = data.get("command", "")
        res.started, res.seconds = data.get("started", 0.0), data.get("seconds", 0.0)
        res.interrupted = data.get("interrupted", False)
        res.aborted = data.get("aborted", "")
        res.rows = [Row(**{k: v for k, v in r.items() if k in names}) for r in data["rows"]]
        res.late_join = data.get("late_join", {})
        res.torchrl_runs = data.get("torchrl_runs", [])
        return res


# --- files (written by report.write_results) ---------------------------------------


def load_results(path: Path) -> Results:
    """A past run, from its directory or its results.json."""
    p = path / "results.json" if path.is_dir() else path
    return Results.from_json(json.loads(p.read_text()))
