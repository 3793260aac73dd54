"""How `zmqsync inspect` shows a bus: its STATE and its relay tree as rich tables.

Every string in them came from a peer (a worker id, a host, a bus or counter name, a
relay id): each is escaped (`printable`) and handed to rich as `Text`, which rich never
parses for markup or emoji codes. rich is imported inside the functions: the command
line loads this module without it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ._histogram import PUBLISH, quantile, read
from ._registry import lag
from ._text import printable

__all__ = ["add_id_column", "lag_of", "print_relays", "print_state"]


def add_id_column(table: Any, header: str) -> None:
    """Add a column of ids (worker or relay ids) to a rich `table`: on a terminal too
    narrow for the whole table an id is folded onto more lines, never cut
    ("collector-gp…"), and no column is cropped for it."""
    table.add_column(header, overflow="fold")


def lag_of(state: Any, acked: int) -> int | None:
    """How many versions a worker that acked `acked` is behind the bus's latest (what
    ``Publisher.workers[id].lag`` says, by the same `_registry.lag`); None before its
    first ack."""
    return lag(state.version, acked)


def print_relays(tree: Mapping[str, Any]) -> None:
    """The relay tree (`inspect_relays`) as tables: the relays, then each relay's workers.

    Relay ids, hosts and worker ids come from other hosts: every string is escaped
    (`printable`) and handed to rich as `Text`, never parsed as markup.
    """
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    def cell(value: object) -> Text:
        return Text(printable(value))

    console = Console()
    console.print(
        Text.assemble(
            ("relay root", "bold"),
            f" {printable(tree['tree'])} pid {tree['pid']}  version {tree['version']}  "
            f"generation {tree['generation']}  ack={printable(tree['ack'])}",
        )
    )
    relays = Table(title=f"relays ({len(tree['relays'])})")
    add_id_column(relays, "relay")
    columns = ("host", "pid", "state", "rank", "gen", "version", "acked", "workers")
    for col in (*columns, "last seen"):
        relays.add_column(col, overflow="fold")
    for r in tree["relays"]:
        relays.add_row(
            cell(r["relay_id"]),
            cell(r["host"]),
            str(r["pid"]),
            cell(r["state"]),
            str(r["rank"]),
            str(r["generation"]),
            str(r["version"]),
            str(r["acked"]),
            str(len(r["workers"])),
            f"{r['last_seen']:.2f} s ago",
        )
    console.print(relays)
    for r in tree["relays"]:
        if not r["workers"]:
            continue
        title = Text(f"workers of relay {printable(r['relay_id'])} ({len(r['workers'])})")
        table = Table(title=title)
        add_id_column(table, "worker")
        for col in ("pid", "host", "mode", "version", "last seen"):
            table.add_column(col, overflow="fold")
        for w in r["workers"]:
            table.add_row(
                cell(w["worker_id"]),
                str(w["pid"]),
                cell(w["host"]),
                cell(w["mode"]),
                str(w["version"]),
                f"{w['last_seen']:.2f} s ago",
            )
        console.print(table)


def print_state(state: Any, warning: str | None = None) -> None:
    """The STATE as tables. Every string in it came from a peer: each is escaped
    (`printable`) and handed to rich as `Text`, which rich never parses for markup or
    emoji codes."""
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    def cell(value: object) -> Text:
        return Text(printable(value))

    console = Console()
    console.print(
        Text.assemble(
            ("bus", "bold"),
            f" {printable(repr(state.name))} id {printable(state.bus)} pid {state.pid}  "
            f"version {state.version}  seq {state.seq}  slots {list(state.slot_versions)}  "
            f"heartbeat {state.heartbeat} s",
        )
    )
    if warning is not None:
        console.print(Text(warning, style="bold yellow"), soft_wrap=True)
    buffers = Table(title="buffers")
    for col in ("kind", "device", "segment", "bytes"):
        buffers.add_column(col)
    for b in state.buffers:
        buffers.add_row(cell(b.kind), cell(b.device), cell(b.segment), f"{b.size:,}")
    console.print(buffers)
    manifest = Table(title=f"manifest ({len(state.manifest)} tensors)")
    for col in ("name", "dtype", "shape", "bytes", "offset"):
        manifest.add_column(col)
    for s in state.manifest[:200]:
        manifest.add_row(
            cell(s.name), cell(s.dtype), str(list(s.shape)), f"{s.nbytes:,}", str(s.offset)
        )
    console.print(manifest)
    workers = Table(title=f"workers ({len(state.workers)})")
    add_id_column(workers, "worker")
    for col in ("host/pid", "mode", "transport", "version", "lag", "heard"):
        justify = "right" if col in ("version", "lag", "heard") else "left"
        workers.add_column(col, justify=justify, overflow="fold")  # type: ignore[arg-type]
    for w in state.workers:
        lag = lag_of(state, w.version)
        workers.add_row(
            cell(w.worker_id),
            cell(f"{w.host}/{w.pid}"),
            cell(w.mode),
            # why a worker reads the CPU copy of CUDA weights, when it does
            cell(f"{w.transport} ({w.transport_note})" if w.transport_note else w.transport),
            str(w.version),
            "-" if lag is None else str(lag),
            f"{w.last_seen:.1f} s ago",
        )
    console.print(workers)
    shown = {k: v for k, v in state.counters.items() if not k.startswith(PUBLISH.name + "_us_")}
    counters = ", ".join(f"{printable(k)}={v}" for k, v in sorted(shown.items()))
    console.print(Text(f"counters: {counters or '-'}"))
    timed = read(state.counters, PUBLISH)  # the publish histogram's counters, in one line
    if timed.count:
        p50, p99 = quantile(timed, 0.5) or 0.0, quantile(timed, 0.99) or 0.0
        console.print(
            Text(
                f"publish to the last ack: p50 {p50 * 1e3:.2f} ms, p99 {p99 * 1e3:.2f} ms over "
                f"{timed.count} publishes (estimated from histogram buckets)"
            )
        )
