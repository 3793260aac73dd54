"""Where a rank's piece of a sharded tensor sits in the full tensor: pure arithmetic.

A slot holds every tensor at its full logical shape, row-major. A sharded trainer's rank
writes only its own piece there, and a tensor-parallel worker reads only its own: both
need the same answer to "which elements of the full tensor does mesh coordinate `c`
hold, in which order, at which byte offsets". This module gives it from plain numbers
(the placements, the mesh's shape, the coordinate, the full shape), so it can be tested
exactly and used by either side without torch.

The placements follow DTensor's semantics, applied left to right over the mesh dims:

* `Shard(d)`: the elements held so far along dim `d` are cut as ``torch.chunk`` cuts
  them (pieces of ``ceil(n / parts)``, the last ones shorter or empty: FSDP2's uneven
  last shard) and coordinate ``i`` keeps piece ``i``.
* `StridedShard(d, split_factor)`: what FSDP2 over a tensor-parallel mesh makes: the
  later mesh dims' `Shard(d)` (the tensor-parallel cut, `split_factor` pieces) happened
  first, and this dim cut the piece they left, as ``torch.chunk`` does. So it is
  applied after them, which is exact for uneven sizes too (FSDP2 pads the TP piece, not
  the full dim). Without a later `Shard(d)`: the elements are cut into `split_factor`
  chunks, each into ``parts`` pieces, and coordinate ``i`` keeps piece ``i`` of each.
* `Replicate()`: every coordinate holds the same elements; only coordinate 0 of such a
  mesh dim writes them (`writes`), so no byte is written twice.

A rank's elements along one dim are a few runs (one for `Shard`, up to `split_factor`
for `StridedShard`); its local tensor is their concatenation, dim by dim. Partial
placements (a pending reduction) have no place in a slot: callers refuse them first.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = [
    "Box",
    "Placement",
    "Replicate",
    "Run",
    "Shard",
    "StridedShard",
    "boxes",
    "byte_ranges",
    "chunk",
    "contiguous",
    "held",
    "local_shape",
    "writes",
]

Run = tuple[int, int]  # [start, stop) along one dim


@dataclass(frozen=True)
class Shard:
    dim: int


@dataclass(frozen=True)
class StridedShard:
    dim: int
    split_factor: int


@dataclass(frozen=True)
class Replicate:
    pass


Placement = Shard | StridedShard | Replicate


@dataclass(frozen=True)
class Box:
    """One rectangular part of a rank's piece: where it is in the full tensor (`full`)
    and in the rank's local tensor (`local`), as one run per dim."""

    full: tuple[Run, ...]
    local: tuple[Run, ...]


def chunk(size: int, parts: int, index: int) -> Run:
    """Piece `index` of `size` elements cut into `parts` as ``torch.chunk`` cuts them
    (padded with empty pieces up to `parts`, as DTensor does)."""
    if parts < 1 or not 0 <= index < parts:
        raise ValueError(f"piece {index} of {parts}")
    step = -(-size // parts)
    start = min(index * step, size)
    return start, min(start + step, size)


def _take(runs: list[Run], start: int, stop: int) -> list[Run]:
    """Positions [start, stop) of the concatenation of `runs`, as runs of the full dim."""
    out: list[Run] = []
    seen = 0
    for a, b in runs:
        lo, hi = max(start, seen), min(stop, seen + b - a)
        if lo < hi:
            out.append((a + lo - seen, a + hi - seen))
        seen += b - a
    return out


def _length(runs: list[Run]) -> int:
    return sum(b - a for a, b in runs)


def _merge(runs: list[Run]) -> list[Run]:
    out: list[Run] = []
    for a, b in runs:
        if out and out[-1][1] == a:
            out[-1] = (out[-1][0], b)
        elif a < b:
            out.append((a, b))
    return out


def _check(shape: Sequence[int], placements: Sequence[Placement], mesh: Sequence[int],
           coordinate: Sequence[int]) -> None:  # fmt: skip
    if not len(placements) == len(mesh) == len(coordinate):
        raise ValueError(
            f"{len(placements)} placements, a mesh of {len(mesh)} dims, a coordinate of "
            f"{len(coordinate)}: they must agree"
        )
    for p, parts, c in zip(placements, mesh, coordinate, strict=True):
        if not 0 <= c < parts:
            raise ValueError(f"coordinate {tuple(coordinate)} is outside the mesh {tuple(mesh)}")
        if not isinstance(p, Replicate) and not 0 <= p.dim < len(shape):
            raise ValueError(f"{p} of a tensor of {len(shape)} dims")
        if isinstance(p, StridedShard) and p.split_factor < 1:
            raise ValueError(f"{p}: split_factor must be >= 1")


def held(
    shape: Sequence[int],
    placements: Sequence[Placement],
    mesh: Sequence[int],
    coordinate: Sequence[int],
) -> tuple[tuple[Run, ...], ...]:
    """Per dim of the full tensor, the runs of elements coordinate `coordinate` holds, in
    the order its local tensor holds them (an empty tuple: none)."""
    _check(shape, placements, mesh, coordinate)
    dims: list[list[Run]] = [[(0, n)] if n else [] for n in shape]
    strided: list[tuple[StridedShard, int, int, bool]] = []  # cut after the later shards
    for i, (p, parts, c) in enumerate(zip(placements, mesh, coordinate, strict=True)):
        if isinstance(p, StridedShard):
            later = any(isinstance(q, Shard) and q.dim == p.dim for q in placements[i + 1 :])
            strided.append((p, parts, c, later))
        elif isinstance(p, Shard):
            runs = dims[p.dim]
            dims[p.dim] = _take(runs, *chunk(_length(runs), parts, c))
    for p, parts, c, later in reversed(strided):
        runs = dims[p.dim]
        if later:  # the later shards picked their chunk: this one cuts inside it
            dims[p.dim] = _take(runs, *chunk(_length(runs), parts, c))
            continue
        kept: list[Run] = []
        for j in range(p.split_factor):
            a, b = chunk(_length(runs), p.split_factor, j)
            lo, hi = chunk(b - a, parts, c)
            kept.extend(_take(runs, a + lo, a + hi))
        dims[p.dim] = kept
    return tuple(tuple(_merge(runs)) for runs in dims)


def local_shape(
    shape: Sequence[int],
    placements: Sequence[Placement],
    mesh: Sequence[int],
    coordinate: Sequence[int],
) -> tuple[int, ...]:
    """The shape of coordinate `coordinate`'s local tensor."""
    return tuple(sum(b - a for a, b in runs) for runs in held(shape, placements, mesh, coordinate))


def writes(placements: Sequence[Placement], coordinate: Sequence[int]) -> bool:
    """Whether `coordinate` writes its piece: it is coordinate 0 of every mesh dim its
    piece is replicated over (the others hold the same bytes)."""
    return all(
        c == 0 for p, c in zip(placements, coordinate, strict=True) if isinstance(p, Replicate)
    )


def boxes(
    shape: Sequence[int],
    placements: Sequence[Placement],
    mesh: Sequence[int],
    coordinate: Sequence[int],
) -> list[Box]:
    """The rank's piece as rectangular boxes (one per combination of runs), each with
    its place in the full tensor and in the local one; [] when it holds nothing."""
    per_dim = held(shape, placements, mesh, coordinate)
    if any(not runs for runs in per_dim) and shape:
        return []
    local_runs = []
    for runs in per_dim:
        at, mine = 0, []
        for a, b in runs:
            mine.append((at, at + b - a))
            at += b - a
        local_runs.append(mine)
    pairs = [
        list(zip(full, loc, strict=True)) for full, loc in zip(per_dim, local_runs, strict=True)
    ]
    return [
        Box(tuple(f for f, _ in combo), tuple(loc for _, loc in combo))
        for combo in itertools.product(*pairs)
    ]


def byte_ranges(
    shape: Sequence[int],
    itemsize: int,
    placements: Sequence[Placement],
    mesh: Sequence[int],
    coordinate: Sequence[int],
) -> list[tuple[int, int]]:
    """The rank's piece as ``(offset, nbytes)`` ranges of the full tensor's row-major
    bytes, in the order of its local tensor's row-major bytes: copying them one after
    the other into a contiguous local tensor fills it. Adjacent ranges are merged."""
    per_dim = held(shape, placements, mesh, coordinate)
    if any(not runs for runs in per_dim):
        return []
    strides = [itemsize * math.prod(shape[d + 1 :]) for d in range(len(shape))]
    # the innermost dims held whole (one run over the dim), and the one before them,
    # make one contiguous span per run of that dim: only the dims outside it loop
    inner = len(shape)
    while inner > 0 and per_dim[inner - 1] == ((0, shape[inner - 1]),):
        inner -= 1
    if inner == 0:
        return [(0, itemsize * math.prod(shape))] if math.prod(shape) else []
    span_dim = inner - 1
    spans = [(a * strides[span_dim], (b - a) * strides[span_dim]) for a, b in per_dim[span_dim]]
    outer = [[i for a, b in per_dim[d] for i in range(a, b)] for d in range(span_dim)]
    out: list[tuple[int, int]] = []
    for index in itertools.product(*outer):
        base = sum(i * s for i, s in zip(index, strides, strict=False))
        for offset, nbytes in spans:
            if out and out[-1][0] + out[-1][1] == base + offset:
                out[-1] = (out[-1][0], out[-1][1] + nbytes)
            else:
                out.append((base + offset, nbytes))
    return out


def contiguous(
    shape: Sequence[int],
    placements: Sequence[Placement],
    mesh: Sequence[int],
    coordinate: Sequence[int],
) -> bool:
    """Whether the rank's piece is one contiguous range of the full tensor's bytes (or
    empty): what an alias of the slot needs."""
    return len(byte_ranges(shape, 1, placements, mesh, coordinate)) <= 1
