"""What a benchmark run measures: the model sizes, the modes, the grid and its budgets.

Every other module of the harness reads these; none of them changes them. The errors
live here too because both the pool (a worker that fails or imported other sources)
and the run (which records one and goes on, or aborts on the other) need them, and
neither should import the other for an exception class.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from .units import GiB, KiB, MiB

# The checkout that holds the `zmqsync` package: workers run from it, with it first on
# PYTHONPATH, so they import the very sources the harness digests.
ROOT = Path(__file__).resolve().parents[3]


@dataclass(frozen=True)
class Size:
    """One model size of the grid, and how many publishes to time at it."""

    key: str
    kind: str  # "mlp" | "many" | "llm"
    target: int  # bytes asked for; the model's real size is in the results
    label: str
    iters: int  # timed publishes at this size (before --iters-scale and volume caps)
    warmup: int


# The small models are timed for seconds, not for a fixed count: 200 publishes of 4 KB
# are ~0.2 s, and over such a window a shared host's drift moved the floor's p50 by 70%
# between its first and last quarter while the publishes beside it stayed put. Their
# warm-up covers the first point of a run, whose first ~100 publishes come in cold.
# `phase_seconds` still ends a point (many workers make each round slower).
SIZES: dict[str, Size] = {
    s.key: s
    for s in (
        Size("4K", "mlp", 4 * KiB, "4 KB", 2000, 50),
        Size("4M", "mlp", 4 * MiB, "4 MB", 1000, 20),
        Size("many", "many", 4 * MiB, "2000 × 2 KB", 1000, 20),
        Size("64M", "mlp", 64 * MiB, "64 MB", 30, 2),
        Size("512M", "mlp", 512 * MiB, "512 MB", 10, 1),
        Size("1G", "mlp", 1 * GiB, "1 GB", 6, 1),
        Size("llm", "llm", 1 * GiB, "LLM 1 GB bf16", 6, 3),  # first-touch: 3 warm-ups
    )
}
MODES = ("copy", "alias")
# Every model is published with the flat layout (`Copy(flat=True)`): the trainer's tensors
# live in a slot of the segment (its home, one slot more than SLOTS) and a publish copies
# it to the next while the workers read it. Copy-mode workers of these kinds also keep
# their model in one block laid out as a slot (many tensors: a version is one copy).
FLAT_KINDS = ("many", "llm")
SLOTS = 2  # the publisher's slots in every phase: the segment holds this many models


@dataclass
class BenchConfig:
    """What to run. The defaults are the full grid (docs/benchmarks.md)."""

    workers: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)
    sizes: tuple[str, ...] = ("4K", "4M", "many", "64M", "512M", "1G", "llm")
    modes: tuple[str, ...] = MODES
    iters_scale: float = 1.0
    min_iters: int = 5
    torchrl: bool = True
    torchrl_max_workers: int = 64
    torchrl_start_method: str = "forkserver"
    torchrl_many_max_workers: int = 16  # the 2,000-tensor model costs torchrl ~0.2 s/worker
    naive: bool = True
    late_join: str | None = "1G"
    late_join_rounds: int = 15
    mem_budget: int = 0  # bytes; 0: min(14 GiB, 60% of MemAvailable at start)
    volume_budget: int = 24 * GiB  # bytes copied per phase (caps iterations)
    naive_volume_cap: int = 8 * GiB  # bytes moved per naive publish
    torchrl_volume_cap: int = 8 * GiB  # bytes copied per torchrl "own" send
    phase_seconds: float = 5.0  # stop measuring a phase after this, once min_iters are in
    timeout: float = 120.0  # deadline of every single operation (s)
    worker_threads: int | None = None  # torch threads in workers (None: torch's default)
    out: Path = Path("zmqsync-bench")
    plot: bool = False
    quick: bool = False


QUICK = BenchConfig(
    workers=(1, 4),
    sizes=("4K", "4M", "many", "64M"),
    iters_scale=0.3,
    min_iters=3,
    late_join="1G",
    late_join_rounds=6,
    phase_seconds=2.0,
    quick=True,
)


class BenchError(Exception):
    """One phase of the benchmark failed (recorded in its row; the run goes on)."""


class SourceChanged(Exception):
    """zmqsync's sources changed during the run: the results would mix two versions."""
