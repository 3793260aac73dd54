"""`zmqsync top`'s screen: one bus, refreshed every second (rich).

`Top` keeps the previous sample, so that rates (publishes per second) and the publish
latency over the last interval come from the differences of the publisher's counters
and histogram, as Prometheus' ``rate()`` and ``histogram_quantile()`` would. Every
string a peer sent (worker id, host, bus name, counter name) reaches the screen as a
rich `Text` built from `printable`, never parsed as markup.
"""

from __future__ import annotations

import dataclasses
import time

from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from ._bus_sample import BusSample
from ._histogram import PUBLISH, Histogram, quantile, read, since
from ._inspect_view import add_id_column
from ._text import printable

__all__ = ["Top"]

# Publisher counters shown on the refusals line, with what they count.
_REFUSALS = (
    ("rejected", "invalid"),
    ("refused_ids", "id in use"),
    ("throttled", "handshake rate"),
    ("refused_connections", "connections"),
    ("dropped_peers", "flooding"),
    ("stale", "stale session"),
)


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.2f} ms"


@dataclasses.dataclass
class Top:
    """What the screen remembers between two refreshes."""

    target: str  # the address, for the title
    last: BusSample | None = None
    last_at: float = 0.0
    last_hist: Histogram | None = None
    unreachable_since: float | None = None
    closed: bool = False  # the bus is gone as a closed one goes (its socket file removed)
    frame: tuple[float, Histogram] | None = None  # publishes/s, latencies: the last interval

    def update(self, sample: BusSample | None, now: float, closed: bool = False) -> None:
        """Take a new sample (None: the publisher did not answer; `closed`: because it
        closed the bus, as a trainer that ends does, rather than died or hangs)."""
        if sample is None:
            if self.unreachable_since is None:
                self.unreachable_since = now
            self.closed = closed
            return
        self.unreachable_since, self.closed = None, False
        hist = read(sample.counters, PUBLISH)
        last = self.last
        if last is not None and last.bus_id == sample.bus_id and now > self.last_at:
            done = sample.counters.get("publishes", 0) - last.counters.get("publishes", 0)
            self.frame = (max(0, done) / (now - self.last_at), since(hist, self.last_hist))
        else:  # first sample, or a new publisher: no interval yet
            self.frame = None
        self.last, self.last_at, self.last_hist = sample, now, hist

    def render(self, now: float | None = None) -> RenderableType:
        """The screen for the current state."""
        now = time.monotonic() if now is None else now
        s = self.last
        if s is None:
            return Text(f"no answer from {printable(self.target)} yet")
        head = Text()
        head.append(f"bus {printable(s.name)}", style="bold")
        head.append(f"  {printable(s.bus_id)}  pid {s.pid}  {printable(self.target)}\n")
        if self.unreachable_since is not None:
            gone = now - self.unreachable_since
            if self.closed:
                head.append(
                    f"bus closed by its publisher {gone:.0f} s ago; waiting for a new one\n",
                    style="bold",
                )
            else:
                head.append(f"publisher unreachable for {gone:.0f} s\n", style="bold red")
        head.append(f"version {s.version}  workers {len(s.workers)}  ")
        if self.frame is not None:
            rate, hist = self.frame
            head.append(
                f"publishes {rate:.1f}/s  latency p50 {_ms(quantile(hist, 0.5))} "
                f"p99 {_ms(quantile(hist, 0.99))}"
            )
        else:
            head.append("publishes -/s")
        c = s.counters
        total = read(c, PUBLISH)
        head.append(
            f"\npublishes {c.get('publishes', 0)}  timeouts {c.get('timeouts', 0)}  "
            f"p50 {_ms(quantile(total, 0.5))} p99 {_ms(quantile(total, 0.99))} (since start)"
        )
        lost = f"\nworkers lost {c.get('lost', 0)} silent, {c.get('evictions', 0)} evicted"
        refused = ", ".join(f"{what} {c[key]}" for key, what in _REFUSALS if c.get(key))
        head.append(f"{lost}  refused: {refused or 'none'}")
        return Group(head, self._workers(s))

    @staticmethod
    def _workers(s: BusSample) -> Table:
        table = Table(title=None, expand=False)
        add_id_column(table, "worker")
        for column in ("version", "lag", "mode", "transport", "host/pid", "heard"):
            justify = "right" if column in ("version", "lag", "heard") else "left"
            table.add_column(column, justify=justify, overflow="fold")  # type: ignore[arg-type]
        for w in sorted(s.workers, key=lambda w: (-(w.lag or 0), w.worker_id)):
            table.add_row(
                Text(printable(w.worker_id)),
                str(w.version),
                Text(
                    "-" if w.lag is None else str(w.lag),
                    style="bold red" if (w.lag or 0) > 1 else "",
                ),
                w.mode,
                w.transport,
                Text(f"{printable(w.host)}/{w.pid}"),
                f"{w.silent_s:.1f} s ago",
            )
        return table
