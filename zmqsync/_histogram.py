"""Durations kept as counters: a fixed-bucket histogram inside a counters map.

A publish's duration (on the publisher) and an apply's (on a worker) are recorded on the
thread that finished them, in O(1): a bisect over `BOUNDS_US` and two dict updates,
with keys built once. They live in the counters each side keeps anyway (the
publisher's `counters`, which STATE carries to inspectors and exporters, and a worker's
`Subscriber.counters`), so they travel without a new message field: an inspector of an
older version shows them as counters, an exporter of a newer one finds none on an older
bus and reports an empty histogram.

The keys of a histogram named ``publish``:

* ``publish_us_upto_<bound>``: durations in (the bound before, bound] microseconds;
  ``publish_us_upto_inf``: longer than the last bound. Only buckets that were hit
  appear, so a counters line stays short.
* ``publish_us_sum``: the sum of the durations, in whole microseconds.

The count is the sum of the buckets (never stored apart, so the two always agree).
Prometheus' cumulative ``le`` buckets are made from these by `read`. No I/O, no clock.
"""

from __future__ import annotations

import dataclasses
from bisect import bisect_left
from collections.abc import Mapping, MutableMapping

__all__ = [
    "APPLY",
    "BLOCKED_IN_PUBLISH",
    "BLOCKED_IN_STEP",
    "BOUNDS_US",
    "PUBLISH",
    "Histogram",
    "Keys",
    "quantile",
    "read",
    "record",
    "since",
]

# From a tiny model applied in one worker (tens of us) to a large one to many (seconds).
BOUNDS_US = (
    25, 50, 100, 250, 500, 1_000, 2_500, 5_000, 10_000, 25_000, 50_000,
    100_000, 250_000, 500_000, 1_000_000, 2_500_000, 5_000_000, 10_000_000,
)  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Keys:
    """The counter names of one histogram, built once (no string work per record)."""

    name: str
    buckets: tuple[str, ...]  # one per bound, then the one above the last
    sum: str

    @classmethod
    def of(cls, name: str) -> Keys:
        buckets = tuple(f"{name}_us_upto_{b}" for b in BOUNDS_US) + (f"{name}_us_upto_inf",)
        return cls(name, buckets, f"{name}_us_sum")


PUBLISH = Keys.of("publish")  # publish() to the last ack (publisher)
APPLY = Keys.of("apply")  # a version taken to applied, before its ack (worker)

# Sums without buckets (microseconds): what publishing cost the training thread, inside
# publish() and, with Overlapped writes, inside optimizer steps (see `Publish.blocked`).
BLOCKED_IN_PUBLISH = "blocked_publish_us"
BLOCKED_IN_STEP = "blocked_step_us"


def record(counts: MutableMapping[str, int], keys: Keys, seconds: float) -> None:
    """Count one duration of `seconds` into `counts`.

    Not locked: each histogram's keys are written only by the threads that finish what
    it times (two finishing at the same instant may lose one count, never corrupt the
    map); readers copy the map in one C call (``dict(counts)``), which no Python thread
    interrupts.
    """
    us = max(0, int(seconds * 1e6))
    bucket = keys.buckets[bisect_left(BOUNDS_US, us)]
    counts[bucket] = counts.get(bucket, 0) + 1
    counts[keys.sum] = counts.get(keys.sum, 0) + us


@dataclasses.dataclass(frozen=True)
class Histogram:
    """A histogram as Prometheus shows it: cumulative counts per upper bound (seconds,
    ending with +inf), their count and the sum of the durations in seconds."""

    buckets: tuple[tuple[float, int], ...]
    count: int
    sum: float


def read(counts: Mapping[str, int], keys: Keys) -> Histogram:
    """The histogram `keys` names, from a counters map (empty if it has none).

    Bounds are read from the keys themselves, merged with this version's, so that the
    buckets of a publisher of another version are shown with their own bounds.
    """
    prefix = f"{keys.name}_us_upto_"
    hits: dict[float, int] = {float(b): 0 for b in BOUNDS_US}
    hits[float("inf")] = 0
    for key, value in counts.items():
        if key.startswith(prefix):
            upto = key[len(prefix) :]
            try:
                hits[float("inf") if upto == "inf" else float(int(upto))] = value
            except ValueError:
                continue  # not one of ours: a counter that only looks like it
    total, cumulative = 0, []
    for bound in sorted(hits):
        total += hits[bound]
        cumulative.append((bound / 1e6, total))
    return Histogram(tuple(cumulative), total, counts.get(keys.sum, 0) / 1e6)


def since(now: Histogram, before: Histogram | None) -> Histogram:
    """What was recorded between two readings of one histogram (`now` if `before` is
    None, or if the counts went down: a restarted publisher counts from zero)."""
    if before is None or before.count > now.count or len(before.buckets) != len(now.buckets):
        return now
    buckets = tuple((b, n - m) for (b, n), (_, m) in zip(now.buckets, before.buckets, strict=True))
    return Histogram(buckets, now.count - before.count, now.sum - before.sum)


def quantile(hist: Histogram, q: float) -> float | None:
    """The `q` quantile in seconds, estimated as Prometheus' histogram_quantile does:
    linear inside the bucket it falls in; the last finite bound if it falls above it.
    None without any count."""
    if hist.count == 0:
        return None
    rank, lower, below = q * hist.count, 0.0, 0
    for bound, cumulative in hist.buckets:
        if cumulative >= rank and cumulative > below:
            if bound == float("inf"):
                return lower
            return lower + (bound - lower) * (rank - below) / (cumulative - below)
        lower, below = bound, cumulative
    return lower
