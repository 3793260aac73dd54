"""Byte units, and numbers the way the benchmark prints them.

The progress lines, the targets and the report tables all show the same quantities
(milliseconds, ratios, MiB, shares of a model): one set of formatters here keeps them
agreeing, and keeps the targets and the tables from importing each other.
"""

from __future__ import annotations

KiB, MiB, GiB = 1024, 2**20, 2**30


def gib(n: float) -> str:
    """Bytes in GiB, one decimal: the unit of memory budgets and skip reasons."""
    return f"{n / GiB:.1f} GiB"


def ms(x: float | None) -> str:
    """Seconds as milliseconds with the unit: three decimals below 10 ms."""
    return "-" if x is None else f"{x * 1e3:.3f} ms" if x < 0.01 else f"{x * 1e3:.1f} ms"


def num(x: float | None) -> str:
    """Seconds as a bare millisecond figure for table cells (the header names the unit)."""
    if x is None:
        return "-"
    value = x * 1e3
    return f"{value:.3f}" if value < 1 else f"{value:.2f}" if value < 100 else f"{value:.0f}"


def times(x: float | None) -> str:
    """A ratio, as "1.23×"."""
    return "-" if x is None else f"{x:.2f}×"


def pct(frac: float | None, nbytes: int) -> str:
    """A share of the model's bytes; meaningless (n/a) for models under 1 MiB."""
    if frac is None:
        return "-"
    return "n/a (< 1 MB)" if nbytes < MiB else f"{frac * 100:.2f}%"


def human(nbytes: float) -> str:
    """Bytes as a round figure in the largest unit that fits (axis ticks)."""
    for unit, scale in (("GB", GiB), ("MB", MiB), ("KB", KiB)):
        if nbytes >= scale * 0.9:
            return f"{nbytes / scale:.0f} {unit}"
    return f"{nbytes:.0f} B"


def mib(x: float | None) -> str:
    """Bytes in MiB, one decimal, without the unit (table cells)."""
    return "-" if x is None else f"{x / MiB:.1f}"
