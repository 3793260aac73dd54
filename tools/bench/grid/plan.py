"""Planning: what each phase would cost, whether it fits, and how long to measure it.

These are pure functions of the configuration, a model size and the memory free now:
the run asks them before it allocates anything, so a point that cannot fit is skipped
with the reason in its row instead of pushing the host into swap or the OOM killer.
"""

from __future__ import annotations

import math
import time

from .config import BenchConfig, Size
from .units import GiB, gib

SAFETY = 3 * GiB  # kept free for everything else on the host


def padded_bytes(size: Size) -> int:
    """Bytes of the model at `size` as the workers lay it out (each tensor aligned)."""
    from .worker import MODEL_ALIGN, element_size, model_shapes

    shapes, step = model_shapes(size.kind, size.target), element_size(size.kind)
    return sum(-(-math.prod(s) * step // MODEL_ALIGN) * MODEL_ALIGN for s in shapes)


def iterations(cfg: BenchConfig, size: Size, volume_per_iter: float) -> tuple[int, int]:
    """(timed iterations, warm-up) at `size`, capped by the bytes a phase may copy."""
    base = max(cfg.min_iters, round(size.iters * cfg.iters_scale))
    by_volume = int(cfg.volume_budget / max(volume_per_iter, 1))
    return max(cfg.min_iters, min(base, by_volume)), size.warmup


def _need(what: str, n: int, s: int) -> int:
    """Bytes a phase holds at once (data only; the workers' interpreters aside)."""
    if what == "copy":  # 2 slots + the trainer's home, floor src + dst, one model per worker
        return (n + 5) * s
    if what == "alias":  # 2 slots + the trainer's home, floor dst
        return 4 * s
    if what == "naive":  # trainer, pickle; per worker: model, message, unpickled copy
        return (3 * n + 2) * s
    raise ValueError(what)


def skip_reason(cfg: BenchConfig, what: str, n: int, s: int, available: int | None = None) -> str:
    """Why a phase cannot run ('' if it can): memory budget, free memory, volume cap."""
    need = _need(what, n, s)
    if need > cfg.mem_budget:
        return f"skipped: needs {gib(need)} (budget {gib(cfg.mem_budget)})"
    if available is not None and need > available - SAFETY:
        return f"skipped: needs {gib(need)}, {gib(available)} available"
    if what == "naive" and (n + 1) * s > cfg.naive_volume_cap:
        cap = gib(cfg.naive_volume_cap)
        return f"skipped: moves {gib((n + 1) * s)} per publish (cap {cap})"
    return ""


def total_steps(cfg: BenchConfig) -> int:
    """Phases in the whole run, for the progress bar."""
    total = len(cfg.workers) * len(cfg.sizes) * (len(cfg.modes) + int(cfg.naive))
    if cfg.torchrl:
        total += sum(1 for n in cfg.workers if n <= cfg.torchrl_max_workers)
    return total + (1 if cfg.late_join else 0)


class Stopwatch:
    """Ends a measuring loop early: `min_iters` samples and `phase_seconds` spent, or at
    least one sample and three times `phase_seconds` (one publish may take seconds)."""

    def __init__(self, cfg: BenchConfig, warmup: int) -> None:
        self.cfg, self.warmup, self.t0 = cfg, warmup, time.perf_counter()

    def enough(self, i: int) -> bool:
        samples, spent = i - self.warmup, time.perf_counter() - self.t0
        limit = self.cfg.phase_seconds
        return (samples >= self.cfg.min_iters and spent > limit) or (
            samples >= 1 and spent > 3 * limit
        )
