"""The run as tables: rich tables on the terminal, Markdown for docs/benchmarks.md.

Both render the same three views of a `Results` (latency against every baseline,
memory per worker, the targets) and both work from a loaded results.json alone, so the
documentation can be regenerated without measuring again. rich is imported inside
`print_report`: it is the command line's dependency, not the library's.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .targets import evaluate_targets
from .units import mib, ms, num, pct, times

if TYPE_CHECKING:
    from .results import Results, Row

# --- files --------------------------------------------------------------------------

CSV_FIELDS = [
    "n", "size", "label", "mode", "nbytes", "tensors", "status", "iters",
    "zmqsync_p50", "zmqsync_p99", "zmqsync_lib_p50", "raw_p50", "raw_p99",
    "memcpy1_p50", "memcpyd_p50", "memcpy_floor", "copyn_p50",
    "x_raw", "x_floor", "gbps",
    "torchrl_p50", "torchrl_p99", "torchrl_status", "x_torchrl",
    "torchrl_own_p50", "torchrl_own_p99", "torchrl_own_status", "x_torchrl_own",
    "naive_p50", "naive_p99", "naive_status", "x_naive",
    "join_p50", "pss_delta", "seg_pss", "extra", "extra_frac", "segment_bytes", "segment_frac",
    "seconds", "naive_seconds",
]  # fmt: skip


def write_results(res: Results, out: Path) -> None:
    """results.json (the targets judged, as the tables show them) and results.csv under `out`."""
    out.mkdir(parents=True, exist_ok=True)
    data = {**res.to_json(), "targets": evaluate_targets(res)}
    (out / "results.json").write_text(json.dumps(data, indent=1, default=str))
    with open(out / "results.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_FIELDS, extrasaction="ignore")
        writer.writeheader()
        for r in res.rows:
            writer.writerow(r.flat())


# --- rich ---------------------------------------------------------------------------


def print_report(res: Results, console: Any) -> None:
    """The tables (rich) and the targets."""
    console.print(_latency_table(res.rows))
    console.print(_memory_table(res.rows))
    if res.late_join:
        lj = res.late_join
        parts = [
            f"{m}: p50 {ms(lj[m]['p50'])}, max {ms(lj[m]['max'])}"
            for m in ("alias", "copy")
            if m in lj
        ]
        console.print(f"late join ({lj.get('label')}): {'; '.join(parts) or lj.get('status')}")
    console.print(_targets_table(res))


def _latency_table(rows: list[Row]) -> Any:
    from rich.table import Table

    lat = Table(
        title="publish latency, p50 (ms) — ratios are zmqsync p50 over the baseline",
        caption="floor: copy mode = N+1 concurrent copies; alias = memcpy + raw round trip",
    )
    for col in (
        "N", "model", "mode", "zmqsync", "p99", "raw rt", "memcpy 1t/def", "N+1 copies",
        "×raw", "×floor", "GB/s", "torchrl coll/own", "×torchrl", "naive",
    ):  # fmt: skip
        lat.add_column(col, justify="right")
    for r in rows:
        x = r.ratios()
        if r.status != "ok":
            lat.add_row(str(r.n), r.label, r.mode, f"[dim]{r.status}[/]", *[""] * 10)
            continue
        lat.add_row(
            str(r.n),
            r.label,
            r.mode,
            num(r.zmqsync_p50),
            num(r.zmqsync_p99),
            num(r.raw_p50),
            f"{num(r.memcpy1_p50)}/{num(r.memcpyd_p50)}",
            num(r.copyn_p50),
            times(x["x_raw"]),
            times(x["x_floor"]),
            "-" if x["gbps"] is None else f"{x['gbps']:.2f}",
            f"{num(r.torchrl_p50)}/{num(r.torchrl_own_p50)}",
            times(x["x_torchrl"]),
            num(r.naive_p50) if r.naive_p50 is not None else (r.naive_status[:10] or "-"),
        )
    return lat


def _memory_table(rows: list[Row]) -> Any:
    from rich.table import Table

    mem = Table(title="memory per worker (MiB): PSS after − before, and beyond the segment")
    for col in (
        "N", "model", "mode", "model MiB", "PSS Δ", "segment share", "beyond", "% model",
        "segment / (slots×model)", "join p50",
    ):  # fmt: skip
        mem.add_column(col, justify="right")
    for r in rows:
        if r.status != "ok":
            continue
        x = r.ratios()
        mem.add_row(
            str(r.n), r.label, r.mode, mib(r.nbytes), mib(r.pss_delta), mib(r.seg_pss),
            mib(r.extra), pct(x["extra_frac"], r.nbytes),
            "-" if x["segment_frac"] is None else f"{x['segment_frac']:.4f}", num(r.join_p50),
        )  # fmt: skip
    return mem


def _targets_table(res: Results) -> Any:
    from rich.table import Table

    targets = Table(title="targets")
    for col in ("name", "target", "met", "measured"):
        targets.add_column(col)
    for t in evaluate_targets(res):
        met = {True: "[green]met[/]", False: "[red]not met[/]", None: "[dim]n/a[/]"}[t["met"]]
        targets.add_row(t["id"], t["target"], met, t["measured"])
    return targets


# --- Markdown -----------------------------------------------------------------------


def markdown_report(res: Results) -> str:
    """The tables of docs/benchmarks.md, from a results.json."""
    lines = [*_latency_markdown(res.rows), "", *_memory_markdown(res.rows)]
    lines += ["", "| name | target | met | measured |", "|---|---|---|---|"]
    for t in evaluate_targets(res):
        met = {True: "**met**", False: "**not met**", None: "n/a"}[t["met"]]
        lines.append(f"| {t['id']} | {t['target']} | {met} | {t['measured']} |")
    return "\n".join(lines) + "\n"


def _latency_markdown(rows: list[Row]) -> list[str]:
    lines = [
        "| N | model | mode | zmqsync p50 | p99 | raw rt | memcpy 1t / default | N+1 copies "
        "| ×raw | ×floor | GB/s | torchrl collector / own | ×torchrl (coll / own) | naive |",
        "|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        x = r.ratios()
        if r.status != "ok":
            lines.append(f"| {r.n} | {r.label} | {r.mode} | {r.status} |||||||||||")
            continue
        naive = num(r.naive_p50) if r.naive_p50 is not None else (r.naive_status or "-")
        gbps = "-" if x["gbps"] is None else f"{x['gbps']:.2f}"
        lines.append(
            f"| {r.n} | {r.label} | {r.mode} | {num(r.zmqsync_p50)} | {num(r.zmqsync_p99)} "
            f"| {num(r.raw_p50)} | {num(r.memcpy1_p50)} / {num(r.memcpyd_p50)} "
            f"| {num(r.copyn_p50)} | {times(x['x_raw'])} | {times(x['x_floor'])} "
            f"| {gbps} "
            f"| {num(r.torchrl_p50)} / {num(r.torchrl_own_p50)} "
            f"| {times(x['x_torchrl'])} / {times(x['x_torchrl_own'])} | {naive} |"
        )
    return lines


def _memory_markdown(rows: list[Row]) -> list[str]:
    lines = [
        "| N | model | mode | model MiB | PSS Δ MiB | segment share MiB | beyond segment MiB "
        "| % of model | segment / (slots × model) | join p50 (ms) |",
        "|---:|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        if r.status != "ok":
            continue
        x = r.ratios()
        frac = pct(x["extra_frac"], r.nbytes)
        seg = "-" if x["segment_frac"] is None else f"{x['segment_frac']:.4f}"
        lines.append(
            f"| {r.n} | {r.label} | {r.mode} | {mib(r.nbytes)} | {mib(r.pss_delta)} "
            f"| {mib(r.seg_pss)} | {mib(r.extra)} | {frac} | {seg} | {num(r.join_p50)} |"
        )
    return lines
