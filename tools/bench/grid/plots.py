"""The run as figures: latency against model size, against workers, and worker memory.

matplotlib is an extra (``zmqsync[plot]``): it is imported inside `plot` only, so the
benchmark and its tables run without it and a missing install is one clear message.
Every series is a p50 on log-log axes, zmqsync solid, floors dotted, other systems
dashed, so the floors read as the bottom line the library is measured against.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .config import SIZES
from .units import MiB, human

if TYPE_CHECKING:
    from .results import Results, Row

# (legend, value of a row or None when the row does not carry it, colour, line style)
_SERIES: list[tuple[str, Callable[[Row], float | None], str, str]] = [
    ("zmqsync copy", lambda r: r.zmqsync_p50 if r.mode == "copy" else None, "C0", "-o"),
    ("zmqsync alias", lambda r: r.zmqsync_p50 if r.mode == "alias" else None, "C1", "-o"),
    ("N+1 copies floor", lambda r: r.copyn_p50 if r.mode == "copy" else None, "C0", ":"),
    ("memcpy floor", lambda r: r.memcpy_floor if r.mode == "alias" else None, "C7", ":"),
    ("raw ZeroMQ rt", lambda r: r.raw_p50 if r.mode == "alias" else None, "C2", ":"),
    ("torchrl (collector)", lambda r: r.torchrl_p50 if r.mode == "alias" else None, "C3",
     "--s"),
    ("torchrl (own buffer)", lambda r: r.torchrl_own_p50 if r.mode == "alias" else None, "C5",
     "--^"),
    ("naive pickle", lambda r: r.naive_p50 if r.mode == "alias" else None, "C4", "--x"),
]  # fmt: skip


def plot(res: Results, out: Path) -> list[Path]:
    """latency_vs_size.png, latency_vs_workers.png, memory.png under `out`."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        from zmqsync._extras import install_hint

        raise SystemExit(
            f"plots need matplotlib (or run without --plot): {install_hint('plot')}"
        ) from None
    out.mkdir(parents=True, exist_ok=True)
    ok = [r for r in res.rows if r.status == "ok"]
    ns = sorted({r.n for r in ok})
    paths = []
    for name, draw in (
        ("latency_vs_size.png", _latency_vs_size),
        ("latency_vs_workers.png", _latency_vs_workers),
        ("memory.png", _memory),
    ):
        fig = draw(plt, ok, ns)
        if fig is None:
            continue
        paths.append(out / name)
        fig.savefig(paths[-1], dpi=110)
        plt.close(fig)
    return paths


def _draw(ax: Any, rows: list[Row], xkey: Callable[[Row], float], base: int) -> None:
    """Every series of `rows` on `ax`, x from `xkey` on a log axis of `base`."""
    for label, get, color, style in _SERIES:
        pts = sorted((xkey(r), v) for r in rows if (v := get(r)) is not None)
        if pts:
            ax.plot([p[0] for p in pts], [p[1] * 1e3 for p in pts], style, color=color,
                    label=label, markersize=4, linewidth=1.2)  # fmt: skip
    ax.set_xscale("log", base=base)
    ax.set_yscale("log")
    ax.grid(True, which="both", alpha=0.3)


def _grid(plt: Any, panels: int, cols: int, width: float) -> tuple[Any, Any, float]:
    """A figure of `panels` axes, `cols` a row; the spare axes switched off."""
    rows = -(-panels // cols)
    height = 3.4 * rows + 0.9
    fig, axes = plt.subplots(rows, cols, figsize=(width * cols, height), squeeze=False)
    for ax in list(axes.flat)[panels:]:
        ax.axis("off")
    return fig, axes, height


def _finish(fig: Any, axes: Any, title: str, height: float) -> None:
    """One legend for all panels, below them, and the title."""
    handles, labels = axes.flat[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=4, fontsize=8)
    fig.suptitle(title)
    fig.tight_layout(rect=(0, 0.65 / height, 1, 0.97))


def _latency_vs_size(plt: Any, ok: list[Row], ns: list[int]) -> Any:
    """One panel per N; the 2,000-tensor model is left out (same bytes as 4 MB)."""
    if not ns:
        return None
    fig, axes, height = _grid(plt, len(ns), min(4, len(ns)), 4.2)
    ticks = sorted({r.nbytes for r in ok if r.size not in ("many", "llm")})
    for ax, n in zip(axes.flat, ns, strict=False):
        mlp = [r for r in ok if r.n == n and r.size not in ("many", "llm")]
        _draw(ax, mlp, lambda r: r.nbytes, 10)
        ax.set_xticks(ticks, [human(t) for t in ticks], fontsize=7, rotation=35)
        ax.minorticks_off()
        ax.set_title(f"{n} worker{'s' if n > 1 else ''}")
        ax.set_xlabel("model bytes")
        ax.set_ylabel("p50 per publish (ms)")
    _finish(fig, axes, "latency vs model size (p50 per publish)", height)
    return fig


def _latency_vs_workers(plt: Any, ok: list[Row], ns: list[int]) -> Any:
    """One panel per model size."""
    sizes = [k for k in SIZES if any(r.size == k for r in ok)]
    if not sizes:
        return None
    fig, axes, height = _grid(plt, len(sizes), min(3, len(sizes)), 4.6)
    for ax, key in zip(axes.flat, sizes, strict=False):
        _draw(ax, [r for r in ok if r.size == key], lambda r: r.n, 2)
        ax.set_xticks(ns, [str(n) for n in ns])
        ax.minorticks_off()
        ax.set_title(SIZES[key].label)
        ax.set_xlabel("workers N")
        ax.set_ylabel("p50 per publish (ms)")
    _finish(fig, axes, "latency vs number of workers (p50 per publish)", height)
    return fig


def _memory(plt: Any, ok: list[Row], ns: list[int]) -> Any:
    """MiB per worker beyond the segment against model bytes, with the 5% line."""
    mem_rows = [r for r in ok if r.extra is not None and r.size not in ("many", "llm")]
    if not mem_rows:
        return None
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for mode, color in (("copy", "C0"), ("alias", "C1")):
        for n, marker in zip(ns, "os^vD<>p", strict=False):
            pts = sorted(
                (r.nbytes, max(r.extra or 0, 0.01 * MiB) / MiB)
                for r in mem_rows
                if r.mode == mode and r.n == n
            )
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], f"-{marker}", color=color,
                        alpha=0.7, markersize=4, label=f"{mode}, N={n}")  # fmt: skip
    xs = sorted({r.nbytes for r in mem_rows})
    ax.plot(xs, [0.05 * x / MiB for x in xs], "k:", label="5% of the model")
    ax.plot(xs, [x / MiB for x in xs], "k--", alpha=0.4, label="the model's bytes")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("model bytes")
    ax.set_ylabel("MiB per worker beyond the segment (≥ 0.01)")
    ax.set_title("worker memory beyond the shared segment (PSS)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    return fig
